// Round-trip and dot-product tests of the kvc types against float math and upstream types.
//
// - round trip: NMSE per type and distribution under named bounds, and never worse than
//   the upstream type of the same size class (kvc8 vs q8_0, kvc4 vs q4_0 and iq4_nl)
// - all-zero rows come back exactly zero
// - NaN/Inf inputs: the output stays finite, other blocks are bit-identical to a clean row
// - vec_dot: the SIMD path equals the scalar reference, and both equal the float dot
//   product of the dequantized operands
// - row dequantization: the CPU's SIMD path equals the scalar reference bit for bit

#include "kvc-test-quants.h"
#include "kvc-cpu.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>

using namespace kvc_test;

namespace {

constexpr int N_ROWS = 256;
constexpr int N      = 128;

struct type_bounds {
    ggml_type type;
    double    nmse_gaussian;  // NMSE of i.i.d. N(0,1) rows
    double    nmse_t3;        // Student-t, 3 degrees of freedom
    double    nmse_outlier;   // a fixed channel subset scaled by 8
    ggml_type upstream;       // must not be beaten by this upstream type (GGML_TYPE_COUNT: none)
};

// Bounds sit ~25% above the measured values so a broken level table, packing or step
// search fails while float noise does not.
const type_bounds BOUNDS[] = {
    { GGML_TYPE_KVC8, 3.6e-5, 9.0e-5, 1.4e-4, GGML_TYPE_Q8_0 },
    { GGML_TYPE_KVC5, 2.0e-3, 2.5e-3, 2.85e-3, GGML_TYPE_Q5_0 },
    { GGML_TYPE_KVC4, 6.4e-3, 9.5e-3, 1.15e-2, GGML_TYPE_Q4_0 },
    { GGML_TYPE_KVC3, 2.65e-2, 4.9e-2, 6.0e-2, GGML_TYPE_COUNT },
    { GGML_TYPE_KVC2, 1.17e-1, 2.5e-1, 3.45e-1, GGML_TYPE_COUNT },
};

void test_round_trip(report & rep, const type_bounds & b) {
    const dist dists[] = { dist::gaussian, dist::student_t3, dist::outlier_channels };
    const double bound[] = { b.nmse_gaussian, b.nmse_t3, b.nmse_outlier };
    for (int di = 0; di < 3; ++di) {
        const auto x = make_rows(dists[di], N_ROWS, N, 1234 + di);
        const double e = nmse(round_trip(b.type, x, N).data(), x.data(), x.size());
        rep.check(e <= bound[di], "%s %-16s nmse %.3e <= %.3e", ggml_type_name(b.type), dist_name(dists[di]), e, bound[di]);

        const ggml_type ups[] = { b.upstream, b.type == GGML_TYPE_KVC4 ? GGML_TYPE_IQ4_NL : GGML_TYPE_COUNT };
        for (ggml_type u : ups) {
            if (u == GGML_TYPE_COUNT) {
                continue;
            }
            const double eu = nmse(round_trip(u, x, N).data(), x.data(), x.size());
            rep.check(e <= eu, "%s %-16s nmse %.3e <= %s %.3e", ggml_type_name(b.type), dist_name(dists[di]), e, ggml_type_name(u), eu);
        }
    }
}

void test_zero_rows(report & rep, ggml_type type) {
    const std::vector<float> x(4 * N, 0.0f);
    const auto y = round_trip(type, x, N);
    bool all_zero = true;
    for (float v : y) {
        all_zero &= v == 0.0f;
    }
    rep.check(all_zero, "%s all-zero rows round-trip to exact zeros", ggml_type_name(type));
}

void test_non_finite(report & rep, ggml_type type) {
    auto clean = make_rows(dist::gaussian, 1, N, 77);
    auto dirty = clean;
    dirty[5]  = NAN;
    dirty[40] = INFINITY;
    dirty[41] = -INFINITY;

    const size_t rs = ggml_row_size(type, N);
    std::vector<uint8_t> qc(rs);
    std::vector<uint8_t> qd(rs);
    const auto * tt = ggml_get_type_traits(type);
    tt->from_float_ref(clean.data(), qc.data(), N);
    tt->from_float_ref(dirty.data(), qd.data(), N);

    std::vector<float> y(N);
    tt->to_float(qd.data(), y.data(), N);
    bool finite = true;
    for (float v : y) {
        finite &= std::isfinite(v);
    }
    rep.check(finite, "%s NaN/Inf input dequantizes to finite values", ggml_type_name(type));

    // blocks 0 (value 5) and 1 (values 40, 41) are touched, blocks 2 and 3 must not be
    const size_t bs = ggml_type_size(type);
    rep.check(memcmp(qc.data() + 2 * bs, qd.data() + 2 * bs, 2 * bs) == 0,
        "%s NaN/Inf leave the other blocks bit-identical", ggml_type_name(type));

    // inside a touched block the finite values keep their usual accuracy
    std::vector<float> yc(N);
    tt->to_float(qc.data(), yc.data(), N);
    double num = 0.0, den = 0.0;
    for (int i = 0; i < 64; ++i) {
        if (i == 5 || i == 40 || i == 41) {
            continue;
        }
        num += (y[i] - clean[i]) * (y[i] - clean[i]);
        den += clean[i] * clean[i];
    }
    const double bound = 4.0 * nmse(yc.data(), clean.data(), 64) + 1e-6;
    rep.check(num / den <= bound, "%s NaN/Inf blocks keep finite values accurate: nmse %.3e <= %.3e",
        ggml_type_name(type), num / den, bound);
}

void test_vec_dot(report & rep, ggml_type type, ggml_vec_dot_t generic, int n) {
    const auto * cpu = ggml_get_type_traits_cpu(type);
    const auto * q8  = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    const auto x = make_rows(dist::gaussian, 64, n, 99);
    const auto y = make_rows(dist::student_t3, 64, n, 100);

    double max_simd = 0.0;
    double max_ref  = 0.0;
    std::vector<uint8_t> qx(ggml_row_size(type, n));
    std::vector<uint8_t> qy(ggml_row_size(GGML_TYPE_Q8_0, n));
    std::vector<float> dx(n);
    std::vector<float> dy(n);
    for (int r = 0; r < 64; ++r) {
        cpu->from_float(x.data() + r * n, qx.data(), n);
        q8->from_float(y.data() + r * n, qy.data(), n);
        ggml_get_type_traits(type)->to_float(qx.data(), dx.data(), n);
        ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float(qy.data(), dy.data(), n);

        float s_simd = 0.0f;
        float s_gen  = 0.0f;
        cpu->vec_dot(n, &s_simd, 0, qx.data(), 0, qy.data(), 0, 1);
        generic(n, &s_gen, 0, qx.data(), 0, qy.data(), 0, 1);

        double ref = 0.0;
        double mag = 0.0;
        for (int i = 0; i < n; ++i) {
            ref += (double) dx[i] * dy[i];
            mag += std::fabs((double) dx[i] * dy[i]);
        }
        max_simd = std::max(max_simd, std::fabs((double) s_simd - s_gen) / mag);
        max_ref  = std::max(max_ref,  std::fabs((double) s_gen - ref) / mag);
    }
    rep.check(max_simd <= 1e-5, "%s vec_dot SIMD vs scalar, rows of %d: max rel diff %.2e <= 1e-5", ggml_type_name(type), n, max_simd);
    rep.check(max_ref  <= 1e-5, "%s vec_dot scalar vs float dot of dequantized rows of %d: max rel diff %.2e <= 1e-5", ggml_type_name(type), n, max_ref);
}

// The multi-row dot product (one kvc row, several q8_0 query rows) gives each row's vec_dot
// bit for bit, SIMD against the dispatching vec_dot and the reference against the scalar one.
void test_vec_dot_multi(report & rep, ggml_type type, ggml_vec_dot_t generic, int n) {
    const auto * cpu = ggml_get_type_traits_cpu(type);
    const auto * q8  = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    const auto x = make_rows(dist::gaussian, 1, n, 41);
    const auto y = make_rows(dist::student_t3, GGML_KVC_DOT_MULTI_MAX, n, 42);
    const size_t by = ggml_row_size(GGML_TYPE_Q8_0, n);
    std::vector<uint8_t> qx(ggml_row_size(type, n));
    std::vector<uint8_t> qy(by * GGML_KVC_DOT_MULTI_MAX);
    cpu->from_float(x.data(), qx.data(), n);
    q8->from_float(y.data(), qy.data(), (int64_t) y.size());
    for (int ny : { 1, 3, GGML_KVC_DOT_MULTI_MAX }) {
        float s_simd[GGML_KVC_DOT_MULTI_MAX], s_ref[GGML_KVC_DOT_MULTI_MAX];
        ggml_kvc_cpu_get_vec_dot_multi(type, false)(n, s_simd, qx.data(), qy.data(), by, ny);
        ggml_kvc_cpu_get_vec_dot_multi(type, true)(n, s_ref, qx.data(), qy.data(), by, ny);
        int n_same = 0;
        for (int g = 0; g < ny; ++g) {
            float e_simd = 0.0f, e_ref = 0.0f;
            cpu->vec_dot(n, &e_simd, 0, qx.data(), 0, qy.data() + g * by, 0, 1);
            generic(n, &e_ref, 0, qx.data(), 0, qy.data() + g * by, 0, 1);
            n_same += std::memcmp(&e_simd, &s_simd[g], sizeof(float)) == 0 && std::memcmp(&e_ref, &s_ref[g], sizeof(float)) == 0;
        }
        rep.check(n_same == ny, "%s vec_dot of rows of %d over %d query rows equals %d single vec_dots bit for bit (%d)",
            ggml_type_name(type), n, ny, ny, n_same);
    }
}

// The CPU quantizer (SIMD step search where the build has it) writes the reference's bytes.
void test_cpu_from_float(report & rep, ggml_type type) {
    const std::vector<float> x = quantizer_inputs(N);
    std::vector<uint8_t> ref(ggml_row_size(type, (int64_t) x.size()));
    std::vector<uint8_t> cpu(ref.size(), 0xAA);
    ggml_get_type_traits(type)->from_float_ref(x.data(), ref.data(), (int64_t) x.size());
    ggml_get_type_traits_cpu(type)->from_float(x.data(), cpu.data(), (int64_t) x.size());
    rep.check(std::memcmp(ref.data(), cpu.data(), ref.size()) == 0, "%s CPU quantization writes the reference's bytes (%zu values)",
        ggml_type_name(type), x.size());
}

void test_cpu_to_float(report & rep, ggml_type type) {
    auto x = make_rows(dist::student_t3, 64, N, 77);
    std::fill(x.begin() + 3 * N, x.begin() + 3 * N + 32, 0.0f);
    std::vector<uint8_t> q(ggml_row_size(type, N) * 64);
    ggml_get_type_traits_cpu(type)->from_float(x.data(), q.data(), (int64_t) x.size());

    std::vector<float> ref(x.size());
    std::vector<float> simd(x.size(), -1.0f);
    ggml_get_type_traits(type)->to_float(q.data(), ref.data(), (int64_t) x.size());
    ggml_kvc_cpu_get_to_float(type)(q.data(), simd.data(), (int64_t) x.size());
    rep.check(std::memcmp(ref.data(), simd.data(), ref.size() * sizeof(float)) == 0,
        "%s CPU row dequantization equals the scalar reference bit for bit", ggml_type_name(type));
}

} // namespace

int main() {
    ggml_cpu_init();
    report rep;

    const ggml_vec_dot_t generic[] = {
        ggml_vec_dot_kvc8_q8_0_generic, ggml_vec_dot_kvc5_q8_0_generic, ggml_vec_dot_kvc4_q8_0_generic,
        ggml_vec_dot_kvc3_q8_0_generic, ggml_vec_dot_kvc2_q8_0_generic,
    };
    for (size_t i = 0; i < sizeof(BOUNDS) / sizeof(BOUNDS[0]); ++i) {
        const ggml_type t = BOUNDS[i].type;
        printf("%s: %.3f bits per value\n", ggml_type_name(t), 8.0 * ggml_type_size(t) / ggml_blck_size(t));
        test_round_trip(rep, BOUNDS[i]);
        test_zero_rows(rep, t);
        test_non_finite(rep, t);
        // one chunk of blocks, several with a partial last one (kvc_vec_dot_multi_*_avx2)
        for (int n : { N, 320, 1024 }) {
            test_vec_dot(rep, t, generic[i], n);
            test_vec_dot_multi(rep, t, generic[i], n);
        }
        test_cpu_to_float(rep, t);
        test_cpu_from_float(rep, t);
    }
    rep.check(ggml_kvc_cpu_get_to_float(GGML_TYPE_Q4_0) == ggml_get_type_traits(GGML_TYPE_Q4_0)->to_float,
        "other types keep upstream's row dequantization");
    rep.check(ggml_kvc_cpu_get_vec_dot_multi(GGML_TYPE_Q8_0, false) == nullptr, "no multi-row kvc dot product for q8_0");

    rep.check(ggml_kvcomp_type_from_name("kvc4") == GGML_TYPE_KVC4, "type_from_name(kvc4)");
    rep.check(ggml_kvcomp_type_from_name("kvc5") == GGML_TYPE_KVC5 && ggml_kvcomp_type_from_name("kvct5") == GGML_TYPE_KVCT5,
        "type_from_name(kvc5), (kvct5)");
    rep.check(ggml_kvcomp_type_from_name("kvc6") == GGML_TYPE_COUNT, "type_from_name(kvc6) is unknown");

    return rep.finish("test-kvc-quants");
}
