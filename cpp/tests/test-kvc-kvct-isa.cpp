// kvct's CPU row decoder (kvc-kvct-cpu.c) built for one instruction-set level, against the
// format's reference: every build of the CPU backend takes the decoder its machine's flags
// allow (portable scalar, AVX-512 turn, AVX-512 VBMI decode), and test-kvc-kvct checks only
// the one of the machine that runs it. CMake builds this file once per level (KVC_ISA names
// it); a level the machine cannot run exits 77 (skipped).
//
// Rows are coded with quantize_row_kvct_ref under plans of both RoPE pairings, head sizes
// 64/128/256, energies that give some coefficients 8 bits and energies that do not; each is
// read at positions with runs and jumps (kvc_t_rope_walk) and compared with
// dequantize_row_kvct turned by kvc_t_rope_cs's exact angles: NMSE <= 1e-10 (the walk's
// float angles; measured about 1e-12), and rows after RoPE (no turn) bit for bit.

#include "kvc-test-util.h"
#include "kvc-kvct-cpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>

using namespace kvc_test;

namespace {

kvc_t_plan make_plan(int d, bool neox, bool steep, kvc_t_basis basis) {
    int16_t pair[KVC_T_MAX_D / 2][2];
    float   mean[KVC_T_MAX_D], k2[KVC_T_MAX_D / 2][3], w[KVC_T_MAX_D / 2][3];
    for (int p = 0; p < d / 2; ++p) {
        pair[p][0] = (int16_t) (neox ? p : 2 * p);
        pair[p][1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
        const float e = 4.0f * std::exp((steep ? -30.0f : -8.0f) * (float) p / (float) (d / 2)) + (steep ? 1e-4f : 0.05f);
        k2[p][0] = e;
        k2[p][1] = 0.3f * e;
        k2[p][2] = 0.7f * e;
        w[p][0] = w[p][2] = 1.0f;
        w[p][1] = 0.0f;
        mean[pair[p][0]] = basis == KVC_T_BASIS_POOLED ? 0.0f : 0.1f * (float) p;
        mean[pair[p][1]] = basis == KVC_T_BASIS_POOLED ? 0.0f : -0.05f * (float) p;
    }
    const kvc_t_stats st = { d, pair, mean, k2, w };
    kvc_t_plan plan;
    GGML_ASSERT(kvc_t_plan_fit(&plan, &st, basis, kvc_t_type_row_bits(GGML_TYPE_KVCT4, d)));
    return plan;
}

void test_decoder(report & rep, int d, bool neox, bool steep) {
    const int n = 3000;
    static kvc_t_plan plan, pooled;
    static kvc_t_decoder dec, dec_pooled;
    static kvc_t_rope_steps steps;
    plan   = make_plan(d, neox, steep, KVC_T_BASIS_PAIR_AXES);
    pooled = make_plan(d, neox, steep, KVC_T_BASIS_POOLED);
    kvc_t_decoder_init(&dec, &plan);
    kvc_t_decoder_init(&dec_pooled, &pooled);
    kvc_t_rope rope;
    memset(&rope, 0, sizeof(rope));
    rope.n_pairs = d / 2;
    rope.mscale  = 1.0f;
    for (int p = 0; p < d / 2; ++p) {
        rope.theta[p] = std::pow(10000.0f, -2.0f * (float) p / (float) d);
    }
    kvc_t_rope_steps_init(&steps, &rope);
    kvc_t_rope_walk walk;
    kvc_t_rope_walk_init(&walk, &rope, &steps, &dec);

    const auto x = make_rows(dist::gaussian, n, d, 17 + d);
    std::vector<uint8_t> row(kvc_t_row_size(plan.row_bits));
    std::vector<float> xs(d), y(d), z(d), c(d / 2), s(d / 2);
    double e2 = 0.0, n2 = 0.0;
    bool same = true;
    for (int r = 0; r < n; ++r) {
        for (int i = 0; i < d; ++i) {
            xs[i] = plan.mean[i] + 2.0f * x[(size_t) r * d + i] * std::sqrt(plan.sigma[i]);
        }
        quantize_row_kvct_ref(&plan, xs.data(), row.data());
        const int64_t pos = r < 2 * n / 3 ? r : r % 3 == 0 ? 40000 + 5 * r : 900 + r;
        kvc_t_rope_walk_to(&walk, pos);
        kvc_t_decoder_row_at(&dec, row.data(), &walk, y.data());
        dequantize_row_kvct(&plan, row.data(), z.data());
        kvc_t_rope_cs(&rope, pos, c.data(), s.data());
        kvc_t_rope_row(&plan, c.data(), s.data(), 0, z.data());
        for (int i = 0; i < d; ++i) {
            e2 += (double) (y[i] - z[i]) * (y[i] - z[i]);
            n2 += (double) z[i] * z[i];
        }
        quantize_row_kvct_ref(&pooled, xs.data(), row.data());
        kvc_t_decoder_row(&dec_pooled, row.data(), y.data());
        dequantize_row_kvct(&pooled, row.data(), z.data());
        same &= memcmp(y.data(), z.data(), d * sizeof(float)) == 0;
    }
    const char * name = neox ? "neox" : "normal";
    rep.check(e2 / n2 <= 1e-10, "%s: d=%3d %s%s rows before RoPE, turned, vs reference: nmse %.2e <= 1e-10", KVC_ISA, d, name,
              steep ? " steep" : "", e2 / n2);
    rep.check(same, "%s: d=%3d %s%s rows after RoPE equal dequantize_row_kvct bit for bit", KVC_ISA, d, name, steep ? " steep" : "");
}

} // namespace

int main() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    const bool can = KVC_ISA_LEVEL == 0 || (KVC_ISA_LEVEL == 1 && __builtin_cpu_supports("avx2")) ||
                     (KVC_ISA_LEVEL == 2 && __builtin_cpu_supports("avx512f")) ||
                     (KVC_ISA_LEVEL == 3 && __builtin_cpu_supports("avx512vbmi"));
    if (!can) {
        printf("test-kvc-kvct-isa: %s cannot run on this CPU, skipped\n", KVC_ISA);
        return 77;
    }
#endif
    report rep;
    for (int d : { 64, 128, 256 }) {
        for (bool neox : { false, true }) {
            for (bool steep : { false, true }) {
                test_decoder(rep, d, neox, steep);
            }
        }
    }
    return rep.finish("test-kvc-kvct-isa");
}
