#include "kvc-kvct-cpu.h"
#include "kvc-common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

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
}

// The coefficients of row x plus `base`, in channel order. The row is copied with room after
// it for the 4-byte loads of its last codes.
static void kvc_t_decoder_coefs(const kvc_t_decoder * dec, const uint8_t * x, const float * base, float * v) {
    const int32_t d = dec->plan->d;
    const float * levels = kvc_t_levels_of(1);
    uint8_t buf[(8 + KVC_T_MAX_BITS * KVC_T_MAX_D) / 8 + 8];
    memcpy(buf, x, dec->row_bytes);
    memset(buf + dec->row_bytes, 0, 8);
    const float s = kvc_e8_to_fp32(buf[0]);
    if (!(s > 0.0f)) {
        memcpy(v, base, d * sizeof(float));
        return;
    }
    for (int32_t c = 0; c < d; ++c) {
        uint32_t w;
        memcpy(&w, buf + dec->boff[c], sizeof(w));
        const uint32_t code = (w >> dec->shift[c]) & (uint32_t) dec->mask[c];
        v[c] = levels[dec->lvl[c] + (int32_t) code] * dec->sig[c] * s + base[c];
    }
}

static const float kvc_t_zeros[KVC_T_MAX_D] = { 0 };

void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y) {
    const kvc_t_plan * plan = dec->plan;
    if (dec->identity) {
        kvc_t_decoder_coefs(dec, x, kvc_t_zeros, y);
        return;
    }
    float v[KVC_T_MAX_D];
    kvc_t_decoder_coefs(dec, x, kvc_t_zeros, v);
    if (dec->pairing == 0) {
        kvc_t_inverse(plan, v, y);
        return;
    }
    // kvc_t_inverse over RoPE's own pairing: channel a of pair p is ia * p, b is a + ib
    const int32_t n = plan->d / 2;
    const int32_t ia = dec->pairing == 1 ? 2 : 1, ib = dec->pairing == 1 ? 1 : n;
    for (int32_t p = 0; p < n; ++p) {
        const int32_t a = ia * p, b = a + ib;
        const float rc = plan->rot[p][0], rs = plan->rot[p][1];
        y[a] = rc * v[a] - rs * v[b] + plan->mean[a];
        y[b] = rs * v[a] + rc * v[b] + plan->mean[b];
    }
}

void kvc_t_decoder_row_at(const kvc_t_decoder * dec, const uint8_t * x, const kvc_t_rope_walk * w, float * y) {
    const int32_t n = dec->plan->d / 2;
    const float * c = w->c;
    const float * s = w->s;
    if (!w->fold) {
        kvc_t_decoder_row(dec, x, y);
        kvc_t_rope_row(dec->plan, c, s, 0, y);
        return;
    }
    float v[KVC_T_MAX_D];
    kvc_t_decoder_coefs(dec, x, dec->base, v);
    if (dec->pairing == 1) {
        for (int32_t p = 0; p < n; ++p) {
            const float a = v[2 * p], b = v[2 * p + 1];
            y[2 * p]     = c[p] * a - s[p] * b;
            y[2 * p + 1] = s[p] * a + c[p] * b;
        }
    } else {
        for (int32_t p = 0; p < n; ++p) {
            const float a = v[p], b = v[p + n];
            y[p]     = c[p] * a - s[p] * b;
            y[p + n] = s[p] * a + c[p] * b;
        }
    }
}

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope, const kvc_t_decoder * dec) {
    w->rope   = rope;
    w->dec    = dec;
    w->fold   = dec && dec->pairing != 0;
    w->pos    = INT64_MIN;
    w->n_step = 0;
}

void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos) {
    if (pos == w->pos) {
        return;
    }
    const int32_t n = w->rope->n_pairs;
    float * GGML_RESTRICT c = w->c;
    float * GGML_RESTRICT s = w->s;
    if (w->pos != INT64_MIN && pos == w->pos + 1 && w->n_step < KVC_T_ROPE_RESYNC) {
        const float * GGML_RESTRICT sc = w->rope->step_c;
        const float * GGML_RESTRICT ss = w->rope->step_s;
        for (int32_t p = 0; p < n; ++p) {
            const float cp = c[p], sp = s[p];
            c[p] = cp * sc[p] - sp * ss[p];
            s[p] = sp * sc[p] + cp * ss[p];
        }
        w->n_step++;
    } else {
        kvc_t_rope_cs(w->rope, pos, c, s);
        w->n_step = 0;
        if (w->fold) {
            const kvc_t_plan * plan = w->dec->plan;
            for (int32_t p = 0; p < n; ++p) {
                const float cp = c[p], sp = s[p], rc = plan->rot[p][0], rs = plan->rot[p][1];
                c[p] = cp * rc - sp * rs;
                s[p] = sp * rc + cp * rs;
            }
        }
    }
    w->pos = pos;
}
