#include "kvc-kvct-cpu.h"
#include "kvc-common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

void kvc_t_decoder_init(kvc_t_decoder * dec, const kvc_t_plan * plan) {
    dec->plan = plan;
    dec->row_bytes = kvc_t_row_size(plan->row_bits);
    bool identity = true;
    for (int32_t p = 0; p < plan->d / 2; ++p) {
        identity = identity && plan->rot[p][0] == 1.0f && plan->rot[p][1] == 0.0f;
    }
    for (int32_t c = 0; c < plan->d; ++c) {
        identity = identity && plan->mean[c] == 0.0f;
    }
    dec->identity = identity;
    bool normal = true, neox = true;
    for (int32_t p = 0; p < plan->d / 2; ++p) {
        normal = normal && plan->pair[p][0] == 2 * p && plan->pair[p][1] == 2 * p + 1;
        neox   = neox && plan->pair[p][0] == p && plan->pair[p][1] == p + plan->d / 2;
    }
    dec->pairing = normal ? 1 : neox ? 2 : 0;
    int32_t n = 0;
    int32_t pos = 8;
    for (int32_t c = 0; c < plan->d; ++c) {
        const int b = plan->bits[c];
        if (b == 0) {
            continue;
        }
        dec->j[n]     = c;
        dec->boff[n]  = pos / 8;
        dec->shift[n] = pos % 8;
        dec->mask[n]  = (1 << b) - 1;
        dec->lvl[n]   = (1 << b) - 2;
        pos += b;
        ++n;
    }
    dec->n = n;
}

// the row, with room after it for the 4-byte loads of its last codes
static float kvc_t_padded_row(const kvc_t_decoder * dec, const uint8_t * x, uint8_t * buf) {
    memcpy(buf, x, dec->row_bytes);
    memset(buf + dec->row_bytes, 0, 8);
    return kvc_e8_to_fp32(buf[0]);
}

static inline uint32_t kvc_t_code(const kvc_t_decoder * dec, const uint8_t * buf, int32_t i) {
    uint32_t w;
    memcpy(&w, buf + dec->boff[i], sizeof(w));
    return (w >> dec->shift[i]) & (uint32_t) dec->mask[i];
}

void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y) {
    const kvc_t_plan * plan = dec->plan;
    const float * levels = kvc_t_levels_of(1);
    uint8_t buf[(8 + KVC_T_MAX_BITS * KVC_T_MAX_D) / 8 + 8];
    const float s = kvc_t_padded_row(dec, x, buf);
    float v[KVC_T_MAX_D];
    float * out = dec->identity ? y : v;
    memset(out, 0, plan->d * sizeof(float));
    if (s > 0.0f) {
        for (int32_t i = 0; i < dec->n; ++i) {
            const int32_t c = dec->j[i];
            out[c] = levels[dec->lvl[i] + (int32_t) kvc_t_code(dec, buf, i)] * plan->sigma[c] * s;
        }
    }
    if (dec->identity) {
        return;
    }
    const int32_t n = plan->d / 2;
    const int32_t ia = dec->pairing == 1 ? 2 : 1, ib = dec->pairing == 1 ? 1 : n;
    if (dec->pairing == 0) {
        kvc_t_inverse(plan, v, y);
        return;
    }
    // kvc_t_inverse over RoPE's own pairing: channel a of pair p is ia * p, b is a + ib
    for (int32_t p = 0; p < n; ++p) {
        const int32_t a = ia * p, b = a + ib;
        const float rc = plan->rot[p][0], rs = plan->rot[p][1];
        y[a] = rc * v[a] - rs * v[b] + plan->mean[a];
        y[b] = rs * v[a] + rc * v[b] + plan->mean[b];
    }
}

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope) {
    w->rope   = rope;
    w->pos    = INT64_MIN;
    w->n_step = 0;
}

void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos) {
    if (pos == w->pos) {
        return;
    }
    const int32_t n = w->rope->n_pairs;
    if (w->pos != INT64_MIN && pos == w->pos + 1 && w->n_step < KVC_T_ROPE_RESYNC) {
        const float * sc = w->rope->step_c;
        const float * ss = w->rope->step_s;
        for (int32_t p = 0; p < n; ++p) {
            const float c = w->c[p], s = w->s[p];
            w->c[p] = c * sc[p] - s * ss[p];
            w->s[p] = s * sc[p] + c * ss[p];
        }
        w->n_step++;
    } else {
        kvc_t_rope_cs(w->rope, pos, w->c, w->s);
        w->n_step = 0;
    }
    w->pos = pos;
}

void kvc_t_decoder_turn(const kvc_t_decoder * dec, const float * c, const float * s, float * y) {
    const int32_t n = dec->plan->d / 2;
    if (dec->pairing == 1) {
        for (int32_t p = 0; p < n; ++p) {
            const float a = y[2 * p], b = y[2 * p + 1];
            y[2 * p]     = c[p] * a - s[p] * b;
            y[2 * p + 1] = s[p] * a + c[p] * b;
        }
    } else if (dec->pairing == 2) {
        float * yb = y + n;
        for (int32_t p = 0; p < n; ++p) {
            const float a = y[p], b = yb[p];
            y[p]  = c[p] * a - s[p] * b;
            yb[p] = s[p] * a + c[p] * b;
        }
    } else {
        kvc_t_rope_row(dec->plan, c, s, 0, y);
    }
}
