// kvct's CPU row decoder (kvc-kvct-cpu.c) built for one instruction-set level, against the
// format's reference: every build of the CPU backend takes the decoder its machine's flags
// allow (portable scalar; AVX2 decode, also under AVX-512 without VBMI, with the AVX-512 turn
// there; AVX-512 VBMI decode), and test-kvc-kvct checks only
// the one of the machine that runs it. CMake builds this file once per level (KVC_ISA names
// it); a level the machine cannot run exits 77 (skipped).
//
// Rows are coded with quantize_row_kvct_ref under plans of both RoPE pairings, head sizes
// 64/128/192/256, energies that give some coefficients 8 bits and energies that do not, a row at
// its plan's mean (scale code 0) among them; each is read at positions with runs and jumps
// (kvc_t_rope_walk) and compared with dequantize_row_kvct turned by kvc_t_rope_cs's exact
// angles: NMSE <= 1e-10 (the walk's float angles; measured about 1e-12), and rows after RoPE
// (no turn) bit for bit. The rows' scores against queries (kvc_t_decoder_dots, which decode
// steps use) are held to double dot products of the reference rows. The coder (kvc_t_quantize_row, kvc-kvct-code-cpu.c) writes
// the reference's bytes.

#include "kvc-test-util.h"
#include "kvc-kvct-cpu.h"
#include "kvc-kvct-code-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define KVC_TEST_GUARD_PAGE
#endif

using namespace kvc_test;

namespace {

kvc_t_plan make_plan(int d, bool neox, bool steep, kvc_t_basis basis, ggml_type type = GGML_TYPE_KVCT4) {
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
    GGML_ASSERT(kvc_t_plan_fit(&plan, &st, basis, kvc_t_type_row_bits(type, d)));
    return plan;
}

// groups of 8 coefficients by their widest one: at most 4 bits, 5, more (the AVX2 decoder's
// three paths), over every decoder test's plan
int64_t n_groups_by_width[3] = { 0, 0, 0 };

// Eight rows at once (kvc_t_decoder_rows8, which attention's K tiles take where it is built)
// against kvc_t_decoder_row_at row by row, bit for bit. Rows lie 3 rows apart, as one KV head's
// rows do among three. Blocks of 8 keys take positions in a run, every other position, in
// falling order and across a multiple of KVC_T_ROPE_STEPS, near 0 and past 40000; the decoder
// must take every block within one such run where it is built (and none elsewhere), and
// decline the others. The last 8 rows before an unreadable page decode as elsewhere.
void test_rows8(report & rep, const kvc_t_decoder & dec, const kvc_t_rope & rope, const kvc_t_rope_steps & steps,
                const std::vector<uint8_t> & rows, const char * name, bool steep) {
    const int d = dec.plan->d;
    const size_t rb = kvc_t_row_size(dec.plan->row_bits);
    const int n_blocks = (int) (rows.size() / rb) / 8;
    std::vector<uint8_t> heads(rows.size() * 3);
    for (size_t r = 0; r < rows.size() / rb; ++r) {
        memcpy(&heads[(3 * r + 1) * rb], &rows[r * rb], rb);
    }
    std::vector<float> tile((size_t) d * 8), y(d);
    kvc_t_rows8 r8;
    std::vector<float> tab(std::max<size_t>(1, kvc_t_rows8_floats(dec.plan)));
    kvc_t_rows8_init(&r8, &dec, tab.data());
#if defined(__AVX512F__)
    const int lanes = 16;
#else
    const int lanes = 8;
#endif
    const bool built = kvc_t_rows8_floats(dec.plan) > 0 && (d / 2) % lanes == 0;
    kvc_t_rope_walk w8, wr;
    kvc_t_rope_walk_init(&w8, &rope, &steps, &dec);
    kvc_t_rope_walk_init(&wr, &rope, &steps, &dec);
    int taken = 0, eligible = 0, differ = 0, wrong = 0;
    const auto same8 = [&](const uint8_t * x0, int64_t stride, const int64_t * pos) {
        bool ok = true;
        for (int i = 0; i < 8; ++i) {
            kvc_t_rope_walk_to(&wr, pos[i]);
            kvc_t_decoder_row_at(&dec, x0 + i * stride, &wr, y.data());
            for (int c = 0; c < d; ++c) {
                ok &= memcmp(&tile[(size_t) c * 8 + i], &y[c], sizeof(float)) == 0;
            }
        }
        return ok;
    };
    for (int b = 0; b < n_blocks; ++b) {
        const int64_t at = (b % 5 == 0 ? 40000 : 0) + 16 * b;
        int64_t pos[8];
        for (int i = 0; i < 8; ++i) {
            const int k = b % 4;
            pos[i] = at + (k == 0 ? b % 3 + i : k == 1 ? 2 * i : k == 2 ? 15 - i : 12 + i);
        }
        const bool one_run = b % 4 != 3;
        const uint8_t * x0 = &heads[(3 * (size_t) (8 * b) + 1) * rb];
        const bool took = kvc_t_decoder_rows8(&dec, &r8, &w8, x0, (int64_t) (3 * rb), pos, tile.data(), 8);
        eligible += one_run;
        taken += took;
        wrong += took != (built && one_run);
        differ += took && !same8(x0, (int64_t) (3 * rb), pos);
    }
    rep.check(wrong == 0 && differ == 0,
              "%s: d=%3d %s%s 8 rows at once: %d of %d blocks in one run taken%s, %d differ from the row decoder bit for bit", KVC_ISA,
              d, name, steep ? " steep" : "", taken, eligible, built ? "" : " (not built here)", differ);

#if defined(KVC_TEST_GUARD_PAGE)
    const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    uint8_t * page = (uint8_t *) mmap(nullptr, 2 * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    GGML_ASSERT(page != MAP_FAILED && mprotect(page + ps, ps, PROT_NONE) == 0);
    uint8_t * last = page + ps - 8 * rb;
    memcpy(last, rows.data(), 8 * rb);
    const int64_t pos[8] = { 0, 1, 2, 3, 4, 5, 6, 7 };
    const bool took = kvc_t_decoder_rows8(&dec, &r8, &w8, last, (int64_t) rb, pos, tile.data(), 8);
    const bool ok = took == built && (!took || same8(last, (int64_t) rb, pos));
    munmap(page, 2 * ps);
    rep.check(ok, "%s: d=%3d %s%s 8 rows at once that end at an unreadable page decode as elsewhere", KVC_ISA, d, name,
              steep ? " steep" : "");
#endif
}

void test_decoder(report & rep, int d, bool neox, bool steep, ggml_type type) {
    const int n = 3000;
    static kvc_t_plan plan, pooled;
    static kvc_t_decoder dec, dec_pooled;
    static kvc_t_rope_steps steps;
    plan   = make_plan(d, neox, steep, KVC_T_BASIS_PAIR_AXES, type);
    pooled = make_plan(d, neox, steep, KVC_T_BASIS_POOLED, type);
    for (const kvc_t_plan * pl : { &plan, &pooled }) {
        for (int c0 = 0; c0 < d; c0 += 8) {
            const int w = *std::max_element(pl->bits + c0, pl->bits + c0 + 8);
            ++n_groups_by_width[w <= 4 ? 0 : w == 5 ? 1 : 2];
        }
    }
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
    const size_t rb = kvc_t_row_size(plan.row_bits);
    std::vector<uint8_t> row(rb), rows(n * rb), rows_pooled(n * rb);
    std::vector<int64_t> at(n);
    std::vector<float> turned((size_t) n * d), plain((size_t) n * d);
    std::vector<float> xs(d), y(d), z(d), c(d / 2), s(d / 2);
    double e2 = 0.0, n2 = 0.0;
    bool same = true;
    for (int r = 0; r < n; ++r) {
        for (int i = 0; i < d; ++i) {
            // every 97th row at the mean: scale code 0, which the decoders take apart
            xs[i] = plan.mean[i] + (r % 97 == 5 ? 0.0f : 2.0f * x[(size_t) r * d + i] * std::sqrt(plan.sigma[i]));
        }
        quantize_row_kvct_ref(&plan, xs.data(), row.data());
        // a run, a run with gaps of 3 (as three sequences' cells alternate), then jumps between
        // two runs
        const int64_t pos = r < n / 3 ? r : r < 2 * n / 3 ? 3 * r - 2 * (n / 3) : r % 3 == 0 ? 40000 + 5 * r : 900 + r;
        kvc_t_rope_walk_to(&walk, pos);
        kvc_t_decoder_row_at(&dec, row.data(), &walk, y.data());
        dequantize_row_kvct(&plan, row.data(), z.data());
        kvc_t_rope_cs(&rope, pos, c.data(), s.data());
        kvc_t_rope_row(&plan, c.data(), s.data(), 0, z.data());
        memcpy(&rows[r * rb], row.data(), rb);
        memcpy(&turned[(size_t) r * d], z.data(), d * sizeof(float));
        at[r] = pos;
        for (int i = 0; i < d; ++i) {
            e2 += (double) (y[i] - z[i]) * (y[i] - z[i]);
            n2 += (double) z[i] * z[i];
        }
        quantize_row_kvct_ref(&pooled, xs.data(), row.data());
        kvc_t_decoder_row(&dec_pooled, row.data(), y.data());
        dequantize_row_kvct(&pooled, row.data(), z.data());
        same &= memcmp(y.data(), z.data(), d * sizeof(float)) == 0;
        memcpy(&rows_pooled[r * rb], row.data(), rb);
        memcpy(&plain[(size_t) r * d], z.data(), d * sizeof(float));
    }
    char name[64];
    snprintf(name, sizeof(name), "%s %s", neox ? "neox" : "normal", ggml_type_name(type));
    rep.check(e2 / n2 <= 1e-10, "%s: d=%3d %s%s rows before RoPE, turned, vs reference: nmse %.2e <= 1e-10", KVC_ISA, d, name,
              steep ? " steep" : "", e2 / n2);
    rep.check(same, "%s: d=%3d %s%s rows after RoPE equal dequantize_row_kvct bit for bit", KVC_ISA, d, name, steep ? " steep" : "");

    test_rows8(rep, dec, rope, steps, rows, name, steep);

    // scores a tile at a time, against double dot products with the reference rows: batches of
    // 37, 16 and 5 rows (full and partial tiles) for 1, 2, 3, 6 and 16 queries (the AVX2
    // decoder's register counts 1, 2, 4 and 8 with zero queries, and more than it holds)
    const auto qs = make_rows(dist::gaussian, KVC_T_DOTS_MAX_Q, d, 5 + d);
    const float * q[KVC_T_DOTS_MAX_Q];
    for (int g = 0; g < KVC_T_DOTS_MAX_Q; ++g) {
        q[g] = &qs[(size_t) g * d];
    }
    kvc_t_rope_walk_init(&walk, &rope, &steps, &dec);
    double worst[2] = { 0.0, 0.0 };
    const int lens[3] = { 37, 16, 5 }, gns[5] = { 1, 3, KVC_T_DOTS_MAX_Q, 2, 6 };
    std::vector<float> dots(KVC_T_DOTS_MAX_Q * 37);
    const uint8_t * ptr[37];
    for (int r0 = 0, b = 0; r0 < n; r0 += lens[b % 3], ++b) {
        const int len = std::min(lens[b % 3], n - r0), gn = gns[b % 5];
        for (int before = 0; before < 2; ++before) {
            const std::vector<uint8_t> & src = before ? rows : rows_pooled;
            const std::vector<float> & ref = before ? turned : plain;
            for (int i = 0; i < len; ++i) {
                ptr[i] = &src[(r0 + i) * rb];
            }
            kvc_t_decoder_dots(before ? &dec : &dec_pooled, before ? &walk : nullptr, ptr, &at[r0], len, q, gn, dots.data(), 37);
            for (int g = 0; g < gn; ++g) {
                for (int i = 0; i < len; ++i) {
                    double e = 0.0, qq = 0.0, zz = 0.0;
                    for (int k = 0; k < d; ++k) {
                        const double zk = ref[(size_t) (r0 + i) * d + k];
                        e += zk * q[g][k];
                        qq += (double) q[g][k] * q[g][k];
                        zz += zk * zk;
                    }
                    worst[before] = std::max(worst[before], std::fabs(dots[g * 37 + i] - e) / std::sqrt(qq * zz + 1e-30));
                }
            }
        }
    }
    rep.check(worst[1] <= 1e-5, "%s: d=%3d %s%s scores of turned rows vs double: max error %.2e <= 1e-5 of |q||k|", KVC_ISA, d,
              name, steep ? " steep" : "", worst[1]);
    rep.check(worst[0] <= 1e-6, "%s: d=%3d %s%s scores of rows after RoPE vs double: max error %.2e <= 1e-6 of |q||k|", KVC_ISA, d,
              name, steep ? " steep" : "", worst[0]);

#if defined(KVC_TEST_GUARD_PAGE)
    // the last rows of a cache's buffer: a row whose last byte is followed by a page that cannot
    // be read, decoded by every entry point; a decoder reading past the row's end faults here
    const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    uint8_t * page = (uint8_t *) mmap(nullptr, 2 * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    GGML_ASSERT(page != MAP_FAILED && mprotect(page + ps, ps, PROT_NONE) == 0);
    uint8_t * last = page + ps - rb;
    bool guarded_same = true;
    std::vector<float> ya(d), yb(d), da(KVC_T_DOTS_MAX_Q), db(KVC_T_DOTS_MAX_Q);
    for (int r = 0; r < 8; ++r) {
        for (int before = 0; before < 2; ++before) {
            const uint8_t * src = before ? &rows[r * rb] : &rows_pooled[r * rb];
            const kvc_t_decoder * dc = before ? &dec : &dec_pooled;
            memcpy(last, src, rb);
            kvc_t_rope_walk_to(&walk, at[r]);
            kvc_t_decoder_row_at(dc, last, &walk, ya.data());
            kvc_t_decoder_row_at(dc, src, &walk, yb.data());
            guarded_same &= memcmp(ya.data(), yb.data(), d * sizeof(float)) == 0;
            kvc_t_decoder_row(dc, last, ya.data());
            kvc_t_decoder_row(dc, src, yb.data());
            guarded_same &= memcmp(ya.data(), yb.data(), d * sizeof(float)) == 0;
            for (int gn : { 1, 3, 6 }) {
                const uint8_t * pa[1] = { last }, * pb[1] = { src };
                kvc_t_decoder_dots(dc, before ? &walk : nullptr, pa, &at[r], 1, q, gn, da.data(), 1);
                kvc_t_decoder_dots(dc, before ? &walk : nullptr, pb, &at[r], 1, q, gn, db.data(), 1);
                guarded_same &= memcmp(da.data(), db.data(), gn * sizeof(float)) == 0;
            }
        }
    }
    munmap(page, 2 * ps);
    rep.check(guarded_same, "%s: d=%3d %s%s rows that end at an unreadable page decode as elsewhere", KVC_ISA, d, name,
              steep ? " steep" : "");
#endif
}

// The coder (kvc_t_quantize_row, a cache's writes) against quantize_row_kvct_ref, byte for
// byte: rows of three distributions at four magnitudes (so that the search's candidates run
// past both ends of the scale codes), all-zero rows, and rows with NaN and Inf values.
void test_coder(report & rep, int d, bool neox, bool steep, ggml_type type) {
    const int n = 1500;
    const kvc_t_plan plan = make_plan(d, neox, steep, neox ? KVC_T_BASIS_POOLED : KVC_T_BASIS_PAIR_AXES, type);
    const size_t rb = kvc_t_row_size(plan.row_bits);
    std::vector<uint8_t> a(rb), b(rb);
    std::vector<float> xs(d);
    const dist dists[3] = { dist::gaussian, dist::student_t3, dist::outlier_channels };
    const float gains[4] = { 1.0f, 1e-17f, 3e9f, 0.02f };
    int differ = 0, coded = 0;
    for (int k = 0; k < 3; ++k) {
        const auto x = make_rows(dists[k], n, d, 91 + 7 * k + d);
        for (int r = 0; r < n; ++r) {
            const float g = r % 50 == 7 ? 0.0f : gains[r % 4];
            for (int i = 0; i < d; ++i) {
                xs[i] = g == 0.0f ? plan.mean[i] : plan.mean[i] + g * x[(size_t) r * d + i] * std::sqrt(plan.sigma[i]);
            }
            if (r % 97 == 3) {
                xs[r % d] = NAN;
                xs[(r + 5) % d] = -INFINITY;
            }
            kvc_t_quantize_row(&plan, xs.data(), a.data());
            quantize_row_kvct_ref(&plan, xs.data(), b.data());
            differ += memcmp(a.data(), b.data(), rb) != 0;
            coded += a[0] != 0;
        }
    }
    rep.check(differ == 0 && coded > 0, "%s: d=%3d %s%s %s rows coded as the reference codes them: %d of %d differ (%d not zero)",
              KVC_ISA, d, neox ? "neox" : "normal", steep ? " steep" : "", ggml_type_name(type), differ, 3 * n, coded);
}

} // namespace

int main() {
    if (!cpu_has_isa_level(KVC_ISA_LEVEL)) {
        printf("test-kvc-kvct-isa: %s cannot run on this CPU, skipped\n", KVC_ISA);
        return 77;
    }
    report rep;
    for (int d : { 64, 128, 192, 256 }) {
        for (bool neox : { false, true }) {
            for (bool steep : { false, true }) {
                for (ggml_type t : { GGML_TYPE_KVCT4, GGML_TYPE_KVCT5 }) {
                    test_decoder(rep, d, neox, steep, t);
                }
                for (ggml_type t : { GGML_TYPE_KVCT5, GGML_TYPE_KVCT4, GGML_TYPE_KVCT3, GGML_TYPE_KVCT2 }) {
                    test_coder(rep, d, neox, steep, t);
                }
            }
        }
    }
    rep.check(n_groups_by_width[0] > 0 && n_groups_by_width[1] > 0 && n_groups_by_width[2] > 0,
        "the decoder's plans hold groups of 8 whose widest coefficient has <= 4 bits (%lld), 5 (%lld) and more (%lld)",
        (long long) n_groups_by_width[0], (long long) n_groups_by_width[1], (long long) n_groups_by_width[2]);
    return rep.finish("test-kvc-kvct-isa");
}
