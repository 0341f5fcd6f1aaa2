#pragma once

// Helpers shared by the kvcomp C++ tests: deterministic row generators, error metrics and
// a tiny check/report layer whose failures make the test binary exit non-zero.

#include "ggml.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace kvc_test {

enum class dist { gaussian, student_t3, outlier_channels };

inline const char * dist_name(dist d) {
    switch (d) {
        case dist::gaussian:         return "gaussian";
        case dist::student_t3:       return "student-t3";
        case dist::outlier_channels: return "outlier-channels";
    }
    return "?";
}

// n_rows rows of n values. Outlier rows scale a fixed set of channels by 8, like the
// per-channel outliers of real K rows.
inline std::vector<float> make_rows(dist d, int n_rows, int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::chi_squared_distribution<float> chi2(3.0f);
    std::vector<float> x((size_t) n_rows * n);
    for (int r = 0; r < n_rows; ++r) {
        for (int i = 0; i < n; ++i) {
            float v = normal(rng);
            if (d == dist::student_t3) {
                v /= std::sqrt(chi2(rng) / 3.0f);
            } else if (d == dist::outlier_channels && (i % 37 == 5)) {
                v *= 8.0f;
            }
            x[(size_t) r * n + i] = v;
        }
    }
    return x;
}

// Whether this CPU runs code built for ISA test level `level` (0 portable, 1 AVX2, 2 AVX-512,
// 3 AVX-512 VBMI); a test built for a level it lacks exits 77 (skipped).
inline bool cpu_has_isa_level(int level) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return level == 0 || (level == 1 && __builtin_cpu_supports("avx2")) ||
           (level == 2 && __builtin_cpu_supports("avx512f")) || (level == 3 && __builtin_cpu_supports("avx512vbmi"));
#else
    return level == 0;
#endif
}

// Normalized mean squared error: sum (a - b)^2 / sum b^2, b being the reference.
inline double nmse(const float * a, const float * b, size_t n) {
    double num = 0.0;
    double den = 0.0;
    for (size_t i = 0; i < n; ++i) {
        const double d = (double) a[i] - b[i];
        num += d * d;
        den += (double) b[i] * b[i];
    }
    return den > 0.0 ? num / den : num;
}

inline std::vector<uint8_t> quantize_ref(ggml_type type, const std::vector<float> & x, int n) {
    const size_t rs = ggml_row_size(type, n);
    std::vector<uint8_t> q(rs * (x.size() / n));
    for (size_t r = 0; r < x.size() / n; ++r) {
        ggml_get_type_traits(type)->from_float_ref(x.data() + r * n, q.data() + r * rs, n);
    }
    return q;
}

inline std::vector<float> dequantize(ggml_type type, const uint8_t * q, int n, int n_rows) {
    std::vector<float> y((size_t) n * n_rows);
    for (int r = 0; r < n_rows; ++r) {
        ggml_get_type_traits(type)->to_float(q + r * ggml_row_size(type, n), y.data() + (size_t) r * n, n);
    }
    return y;
}

inline std::vector<float> round_trip(ggml_type type, const std::vector<float> & x, int n) {
    return dequantize(type, quantize_ref(type, x, n).data(), n, (int) (x.size() / n));
}

// A ggml context whose graphs run on the CPU backend's plan (use_ref: its scalar reference
// kernels where it has them).
struct graph_ctx {
    ggml_context * ctx;
    explicit graph_ctx(size_t mem) {
        ggml_init_params p = { mem, nullptr, false };
        ctx = ggml_init(p);
    }
    ~graph_ctx() { ggml_free(ctx); }

    void compute(ggml_tensor * out, int n_threads = 2, bool use_ref = false) {
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_cplan plan = ggml_graph_plan(gf, n_threads, nullptr);
        std::vector<uint8_t> work(plan.work_size);
        plan.work_data = work.data();
        plan.use_ref   = use_ref;
        GGML_ASSERT(ggml_graph_compute(gf, &plan) == GGML_STATUS_SUCCESS);
    }
};

struct report {
    int n_pass = 0;
    int n_fail = 0;

    // Records one check; prints failures always and passes with their numbers.
    void check(bool ok, const char * fmt, ...) {
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof(buf), fmt, ap);
        va_end(ap);
        printf("  [%s] %s\n", ok ? "ok" : "FAIL", buf);
        ok ? ++n_pass : ++n_fail;
    }

    int finish(const char * name) const {
        printf("%s: %d passed, %d failed\n", name, n_pass, n_fail);
        return n_fail == 0 && n_pass > 0 ? 0 : 1;
    }
};

} // namespace kvc_test
