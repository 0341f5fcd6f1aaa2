// kvct on the CPU, set up once per plan and per RoPE: a decoder's tables for the instruction set
// it runs on (kvc_t_decoder_init), the RoPE steps and the walk that turns rows to their positions.

#include "kvc-kvct-cpu.h"
#include "kvc-kvct-simd.h"
#include "kvc-common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(KVC_T_VBMI)
#include "ggml-threading.h"

// Byte p of the magnitudes: the upper half of the levels of 1..7 bits (b's at 2^(b-1) - 1),
// 0 at 127 (a coefficient of 0 bits), then those of 8 bits from 128. The same for every plan:
// made once per process, under ggml's lock as ggml_cpu_init makes its tables.
uint8_t kvc_t_vbmi_plane[4][256];

static void kvc_t_vbmi_plane_init(void) {
    static bool done = false;
    ggml_critical_section_start();
    if (!done) {
        float mag[256] = { 0 };
        for (int b = 1; b <= KVC_T_MAX_BITS; ++b) {
            const float * l = kvc_t_levels_of(b);
            const int h = 1 << (b - 1);
            for (int k = 0; k < h; ++k) {
                mag[(b == 8 ? 128 : h - 1) + k] = l[h + k];
            }
        }
        for (int i = 0; i < 256; ++i) {
            uint32_t u;
            memcpy(&u, &mag[i], sizeof(u));
            for (int p = 0; p < 4; ++p) {
                kvc_t_vbmi_plane[p][i] = (uint8_t) (u >> (8 * p));
            }
        }
        done = true;
    }
    ggml_critical_section_end();
}

// The channel of lane l of vector q of chunk m (the decoder's lane layout, kvc-kvct-cpu.h).
// Pairs side by side: vectors 2h and 2h + 1 hold the first and second channels of pairs
// 32 m + 16 h .. + 15. Otherwise channel order, in which NEOX's pairs already lie apart.
static int32_t kvc_t_vbmi_channel(const kvc_t_decoder * dec, int32_t m, int32_t q, int32_t l) {
    return dec->pairing == 1 ? 64 * m + 32 * (q / 2) + 2 * l + q % 2 : 64 * m + 16 * q + l;
}

// The VBMI decoder's tables (kvc-kvct-cpu.h). Code byte i is lane 4 (i / 16) + i % 4 of vector
// i / 4 % 4. The two words of its qword lane start at the codes of its bytes i - i % 8 (bytes
// 0-3 of the lane) and i - i % 8 + 4 (bytes 4-7). Each word holds its 4 codes: in channel
// order they are consecutive, side by side pairs' a or b channels are every other one, so a
// word spans at most 7 bits before its first code and 7 codes of 8 bits.
static void kvc_t_vbmi_init(kvc_t_decoder * dec) {
    const kvc_t_plan * plan = dec->plan;
    kvc_t_vbmi_plane_init();
    for (int32_t m = 0; m < plan->d / 64; ++m) {
        const int32_t c0 = 64 * m, w0 = dec->boff[c0];
        dec->vb_w0[m]   = w0;
        dec->vb_has8[m] = false;
        for (int32_t i = 0; i < 64; ++i) {
            const int32_t t = i % 8, i0 = i - t;
            const int32_t ch = kvc_t_vbmi_channel(dec, m, i / 4 % 4, 4 * (i / 16) + i % 4);
            const int32_t fa = kvc_t_vbmi_channel(dec, m, i0 / 4 % 4, 4 * (i0 / 16));
            const int32_t fb = kvc_t_vbmi_channel(dec, m, i0 / 4 % 4 + 1, 4 * (i0 / 16));
            const int32_t ba = dec->boff[fa], bb = dec->boff[fb], b = plan->bits[ch];
            dec->vb_perm_a[c0 + i] = (uint8_t) (ba - w0 + t);
            dec->vb_perm_b[c0 + i] = (uint8_t) (bb - w0 + t);
            dec->vb_ctrl[c0 + i]   = (uint8_t) (8 * (dec->boff[ch] - (t < 4 ? ba : bb)) + dec->shift[ch]);
            dec->vb_mask[c0 + i]   = (uint8_t) dec->mask[ch];
            dec->vb_top[c0 + i]    = b > 0 ? (uint8_t) (1 << (b - 1)) : 0;
            dec->vb_low[c0 + i]    = b > 0 ? (uint8_t) ((1 << (b - 1)) - 1) : 0;
            dec->vb_moff[c0 + i]   = b == 0 ? 127 : b == 8 ? 128 : (uint8_t) ((1 << (b - 1)) - 1);
            dec->vb_has8[m] |= b == 8;
        }
        for (int32_t q = 0; q < 4; ++q) {
            for (int32_t l = 0; l < 16; ++l) {
                const int32_t ch = kvc_t_vbmi_channel(dec, m, q, l);
                dec->vb_sig[c0 + 16 * q + l]  = dec->sig[ch];
                dec->vb_base[c0 + 16 * q + l] = dec->base[ch];
            }
        }
    }
}
#endif

#if defined(KVC_T_AVX2)
static void kvc_t_avx2_init(kvc_t_decoder * dec) {
    const kvc_t_plan * plan = dec->plan;
    memset(dec->av_mag, 0, sizeof(dec->av_mag));
    for (int b = 1; b <= 5; ++b) {
        const int h = 1 << (b - 1);
        for (int k = 0; k < h; ++k) {
            dec->av_mag[h - 1 + k] = kvc_t_levels_of(b)[h + k];
        }
    }
    for (int32_t c = 0; c < plan->d; ++c) {
        const int b = plan->bits[c];
        // a group's 8 codes start at most 7 x 8 + 7 bits after its first byte: the 4 bytes
        // of each lie in the group's 16
        const int32_t w0 = dec->boff[c / 8 * 8];
        dec->av_win[c / 8] = w0;
        for (int i = 0; i < 4; ++i) {
            dec->av_ctrl[4 * c + i] = (uint8_t) (dec->boff[c] - w0 + i);
        }
        dec->av_top[c]  = b > 0 ? 1 << (b - 1) : 0;
        dec->av_moff[c] = b > 0 && b <= 5 ? (1 << (b - 1)) - 1 : 0;
        if (c % 8 == 0) {
            dec->av_wide[c / 8] = 0;
        }
        const uint8_t wide = b <= 4 ? 0 : b == 5 ? 1 : 2;
        dec->av_wide[c / 8] = wide > dec->av_wide[c / 8] ? wide : dec->av_wide[c / 8];
    }
    // windows only move forward: the groups whose window reaches past the row are the last
    dec->av_safe = plan->d;
    for (int32_t c = plan->d - 8; c >= 0 && dec->av_win[c / 8] + 16 > (int32_t) dec->row_bytes; c -= 8) {
        dec->av_safe = c;
    }
    dec->av_tail = dec->av_safe < plan->d ? dec->av_win[dec->av_safe / 8] : (int32_t) dec->row_bytes;
}
#endif

void kvc_t_decoder_init(kvc_t_decoder * dec, const kvc_t_plan * plan) {
    const int32_t d = plan->d, n = d / 2;
    dec->plan = plan;
    dec->row_bytes = kvc_t_row_size(plan->row_bits);
    bool identity = true;
    for (int32_t p = 0; p < n; ++p) {
        identity = identity && plan->rot[p][0] == 1.0f && plan->rot[p][1] == 0.0f;
    }
    for (int32_t c = 0; c < d; ++c) {
        identity = identity && plan->mean[c] == 0.0f;
    }
    dec->identity = identity;
    bool normal = true, neox = true;
    for (int32_t p = 0; p < n; ++p) {
        normal = normal && plan->pair[p][0] == 2 * p && plan->pair[p][1] == 2 * p + 1;
        neox   = neox && plan->pair[p][0] == p && plan->pair[p][1] == p + n;
    }
    dec->pairing = normal ? 1 : neox ? 2 : 0;
    int32_t pos = 8;
    for (int32_t c = 0; c < d; ++c) {
        const int b = plan->bits[c];
        dec->boff[c]  = pos / 8;
        dec->shift[c] = pos % 8;
        dec->mask[c]  = (1 << b) - 1;
        dec->lvl[c]   = b > 0 ? (1 << b) - 2 : 0;
        dec->sig[c]   = b > 0 ? plan->sigma[c] : 0.0f;
        dec->base[c]  = 0.0f;
        pos += b;
    }
    for (int32_t p = 0; p < n && dec->pairing != 0; ++p) {
        const int32_t a = plan->pair[p][0], b = plan->pair[p][1];
        const float rc = plan->rot[p][0], rs = plan->rot[p][1];
        dec->base[a] = rc * plan->mean[a] + rs * plan->mean[b];
        dec->base[b] = rc * plan->mean[b] - rs * plan->mean[a];
    }
#if defined(KVC_T_VBMI)
    kvc_t_vbmi_init(dec);
#elif defined(KVC_T_AVX2)
    kvc_t_avx2_init(dec);
#endif
}

void kvc_t_rope_steps_init(kvc_t_rope_steps * st, const kvc_t_rope * rope) {
    // in double, one step after another: j steps are off by about j double roundings
    for (int32_t p = 0; p < rope->n_pairs; ++p) {
        const double c1 = cos((double) rope->theta[p]), s1 = sin((double) rope->theta[p]);
        double c = 1.0, s = 0.0;
        for (int j = 0; j <= KVC_T_ROPE_STEPS; ++j) {
            st->c[j][p]  = (float) c;
            st->s[j][p]  = (float) s;
            st->ct[p][j] = (float) c;
            st->st[p][j] = (float) s;
            const double cn = c * c1 - s * s1;
            s = s * c1 + c * s1;
            c = cn;
        }
    }
}

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope, const kvc_t_rope_steps * steps, const kvc_t_decoder * dec) {
    w->rope   = rope;
    w->steps  = steps;
    w->dec    = dec;
    w->fold   = dec && dec->pairing != 0;
    w->base   = INT64_MIN;
    w->delta  = 0;
}

void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos) {
    const int32_t n = w->rope->n_pairs;
    const int64_t b = kvc_t_floor_to(pos, KVC_T_ROPE_STEPS);
    if (b != w->base) {
        const float * sc = w->steps->c[KVC_T_ROPE_STEPS];
        const float * ss = w->steps->s[KVC_T_ROPE_STEPS];
        if (w->base != INT64_MIN && b == w->base + KVC_T_ROPE_STEPS && b % KVC_T_ROPE_EXACT != 0) {
            kvc_t_add_angles(n, w->bc, w->bs, sc, ss);
        } else {
            const int64_t e = kvc_t_floor_to(b, KVC_T_ROPE_EXACT);
            float * bc = w->bc;
            float * bs = w->bs;
            kvc_t_rope_cs(w->rope, e, bc, bs);
            if (w->fold) {
                const kvc_t_plan * plan = w->dec->plan;
                for (int32_t p = 0; p < n; ++p) {
                    const float cp = bc[p], sp = bs[p], rc = plan->rot[p][0], rs = plan->rot[p][1];
                    bc[p] = cp * rc - sp * rs;
                    bs[p] = sp * rc + cp * rs;
                }
            }
            for (int64_t q = e; q < b; q += KVC_T_ROPE_STEPS) {
                kvc_t_add_angles(n, bc, bs, sc, ss);
            }
        }
        w->base = b;
    }
    w->delta = (int32_t) (pos - b);
}
