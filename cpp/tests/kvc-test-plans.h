#pragma once

// kvct plans and RoPEs for tests that need them without a model: shared by test-kvc-backend
// (compiled as C++) and test-kvc-kvct-cuda-host (compiled by nvcc), so it needs only
// kvc-transform.h.

#include "kvc-transform.h"

#include <cmath>
#include <random>
#include <vector>

namespace kvc_test {

// A plan of `type` for heads of d values fitted to random statistics: pair energies over
// `spread` decades around 1 (8 decades give some coefficients 8 bits), correlated pairs, a mean
// on a fifth of the pairs; pairs side by side or NEOX-ordered. False when no plan fits.
inline bool fit_random_plan(kvc_t_plan & plan, ggml_type type, int d, bool neox, float spread, std::mt19937 & rng) {
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<int16_t> pair(d);
    std::vector<float> mean(d, 0.0f), k2(3*d/2), w(3*d/2);
    for (int p = 0; p < d/2; ++p) {
        pair[2*p]     = (int16_t) (neox ? p : 2*p);
        pair[2*p + 1] = (int16_t) (neox ? p + d/2 : 2*p + 1);
        const float va = std::pow(10.0f, spread*(u(rng) - 0.5f)), vb = std::pow(10.0f, spread*(u(rng) - 0.5f));
        const float rho = 1.6f*u(rng) - 0.8f;
        k2[3*p] = va; k2[3*p + 1] = rho*std::sqrt(va*vb); k2[3*p + 2] = vb;
        w[3*p] = 0.5f + u(rng); w[3*p + 1] = 0.1f; w[3*p + 2] = 0.5f + u(rng);
        mean[pair[2*p]] = u(rng) < 0.2f ? 4.0f*u(rng) - 2.0f : 0.0f;
    }
    const kvc_t_stats st = { d, (const int16_t (*)[2]) pair.data(), mean.data(), (const float (*)[3]) k2.data(),
                             (const float (*)[3]) w.data() };
    return kvc_t_plan_fit(&plan, &st, KVC_T_BASIS_PAIR_AXES, kvc_t_type_row_bits(type, d));
}

// A RoPE that turns every pair of a head of d values, base 10000, with the gain mscale.
inline kvc_t_rope make_rope(int d, float mscale) {
    kvc_t_rope rope = {};
    rope.n_pairs = d/2;
    rope.mscale  = mscale;
    for (int p = 0; p < d/2; ++p) {
        rope.theta[p] = std::pow(10000.0f, -2.0f*p/d);
    }
    return rope;
}

} // namespace kvc_test
