// The CUDA decoder of kvct rows (cuda/kvc-kvct-cuda.cuh: a plan loaded as the attention kernel
// holds it, a row's codes read, the plan's rotation undone and the row turned to its key's
// position, dotted with a query) run as host code against the C reference
// (dequantize_row_kvct, kvc_t_rope_cs, kvc_t_rope_row, a double dot), so that the kernel's
// reading of the format is checked on a machine without a GPU. scripts/cuda-compile.sh
// builds and runs it. Head sizes 64/128/256, pairs side by side and NEOX-ordered, every kvct
// type, positions up to 60000, zero rows, a plan with 8-bit coefficients.

#include "cuda/kvc-kvct-cuda.cuh"
#include "kvc-test-plans.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using namespace kvc_test;

namespace {

int n_fail = 0;
int n_pass = 0;

void check(bool ok, const char * what, double err, double bound) {
    n_pass += ok;
    n_fail += !ok;
    printf("  [%s] %s: %.2e <= %.0e\n", ok ? "ok" : "FAIL", what, err, bound);
}

template <int D>
void test_head(ggml_type type, bool neox, float spread, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::uniform_int_distribution<int> position(0, 60000);
    kvc_t_plan plan;
    if (!fit_random_plan(plan, type, D, neox, spread, rng)) {
        check(false, "plan fit", 0.0, 0.0);
        return;
    }
    const kvc_t_rope rope = make_rope(D, 1.0f + 0.1f*(seed % 3));
    static kvct_plan_smem<D> sp; // as a block of the attention kernel holds it
    kvct_plan_load<D>(sp, &plan, &rope, true, 0, 1);

    std::vector<uint8_t> row(kvc_t_row_size(plan.row_bits));
    std::vector<float> x(D), y(D), q(D), c(D/2), s(D/2);
    double worst = 0.0;
    bool zero_row = false;
    for (int i = 0; i < 300; ++i) {
        for (int j = 0; j < D; ++j) {
            x[j] = plan.mean[j] + (i == 7 ? 0.0f : 3.0f*g(rng)*plan.sigma[j]);
            q[j] = g(rng);
        }
        quantize_row_kvct_ref(&plan, x.data(), row.data());
        zero_row |= row[0] == 0;
        const int64_t pos = i == 0 ? 0 : position(rng);
        dequantize_row_kvct(&plan, row.data(), y.data());
        kvc_t_rope_cs(&rope, pos, c.data(), s.data());
        kvc_t_rope_row(&plan, c.data(), s.data(), 0, y.data());
        double ref = 0.0, mag = 0.0;
        for (int j = 0; j < D; ++j) {
            ref += (double) q[j]*y[j];
            mag += std::fabs((double) q[j]*y[j]);
        }
        const double got = kvct_dot_row<D>(sp, row.data(), pos, q.data());
        worst = std::fmax(worst, std::fabs(got - ref) / (mag + 1e-30));
    }
    char what[128];
    snprintf(what, sizeof(what), "%s d=%d %s spread %.0f: q . row turned, relative to sum |q y|", ggml_type_name(type), D,
             neox ? "NEOX pairs" : "pairs side by side", spread);
    // float sums of D products and angles reduced in double: a few ulps of the magnitude
    const double bound = 2e-5;
    check(worst <= bound && zero_row, what, worst, bound);
}

} // namespace

int main() {
    for (ggml_type type : { GGML_TYPE_KVCT4, GGML_TYPE_KVCT3, GGML_TYPE_KVCT2, GGML_TYPE_KVCT5 }) {
        for (bool neox : { false, true }) {
            for (float spread : { 3.0f, 8.0f }) {
                const uint32_t seed = (uint32_t) (type*100 + neox*10 + (int) spread);
                test_head<64>(type, neox, spread, seed);
                test_head<128>(type, neox, spread, seed + 1);
                test_head<256>(type, neox, spread, seed + 2);
            }
        }
    }
    printf("test-kvc-kvct-cuda-host: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail == 0 ? 0 : 1;
}
