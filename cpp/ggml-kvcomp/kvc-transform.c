// Reference of the transform-coded K row (kvc-transform.h): plan fitting, row coding and
// decoding, scalar and backend independent.

#include "kvc-transform.h"
#include "kvc-common.h"
#include "kvc-lloyd-max.h"

#include <math.h>
#include <string.h>

static_assert(KVC_LM_MAX_BITS == KVC_T_MAX_BITS, "the Lloyd-Max table covers every bit count of a coefficient");

static const float kvc_lm_levels[] = KVC_LM_LEVELS;
static const float kvc_lm_mids[] = KVC_LM_MIDS;
static const float kvc_lm_dist[KVC_T_MAX_BITS + 1] = KVC_LM_DIST;

static_assert(sizeof(kvc_lm_levels) / sizeof(kvc_lm_levels[0]) == (2u << KVC_T_MAX_BITS) - 2,
              "2^b levels for each b = 1..8");
static_assert(sizeof(kvc_lm_mids) / sizeof(kvc_lm_mids[0]) == (2u << KVC_T_MAX_BITS) - KVC_T_MAX_BITS - 2,
              "2^b - 1 thresholds for each b = 1..8");

float kvc_t_lloyd_max_dist(int bits) {
    return bits >= 0 && bits <= KVC_T_MAX_BITS ? kvc_lm_dist[bits] : 1.0f;
}

// the 2^b levels of b bits
static inline const float * kvc_t_levels(int b) {
    return kvc_lm_levels + ((1 << b) - 2);
}

// the 2^b - 1 thresholds between them: 0.5f * (l[k] + l[k + 1]), made when the table was
// generated so that the search for a code reads each with one load
static inline const float * kvc_t_mids(int b) {
    return kvc_lm_mids + ((1 << b) - b - 1);
}

const float * kvc_t_levels_of(int bits) {
    return bits >= 1 && bits <= KVC_T_MAX_BITS ? kvc_t_levels(bits) : NULL;
}

// Whether d is a head size a plan holds and its pairs name every channel exactly once.
static bool kvc_t_pairs_valid(const int16_t (*pair)[2], int32_t d) {
    if (d < 2 || d > KVC_T_MAX_D || d % 2 != 0) {
        return false;
    }
    uint8_t seen[KVC_T_MAX_D] = { 0 };
    for (int32_t p = 0; p < d / 2; ++p) {
        for (int i = 0; i < 2; ++i) {
            const int c = pair[p][i];
            if (c < 0 || c >= d || seen[c]) {
                return false;
            }
            seen[c] = 1;
        }
    }
    return true;
}

bool kvc_t_plan_fit(kvc_t_plan * plan, const kvc_t_stats * stats, enum kvc_t_basis basis, int32_t row_bits) {
    const int32_t d = stats->d;
    if (!kvc_t_pairs_valid(stats->pair, d) || row_bits < 8 || row_bits > 8 + KVC_T_MAX_BITS * d) {
        return false;
    }
    for (int32_t p = 0; p < d / 2; ++p) {
        const float * m = stats->k2[p];
        const float * w = stats->w[p];
        for (int i = 0; i < 3; ++i) {
            if (!isfinite(m[i]) || !isfinite(w[i])) {
                return false;
            }
        }
        if (m[0] < 0.0f || m[2] < 0.0f || w[0] < 0.0f || w[2] < 0.0f ||
            !isfinite(stats->mean[stats->pair[p][0]]) || !isfinite(stats->mean[stats->pair[p][1]])) {
            return false;
        }
    }

    kvc_t_plan out;
    memset(&out, 0, sizeof(out));
    out.d = d;
    float var[KVC_T_MAX_D];
    float wgt[KVC_T_MAX_D];
    for (int32_t p = 0; p < d / 2; ++p) {
        const int a = stats->pair[p][0];
        const int b = stats->pair[p][1];
        out.pair[p][0] = (int16_t) a;
        out.pair[p][1] = (int16_t) b;
        double saa = stats->k2[p][0], sab = stats->k2[p][1], sbb = stats->k2[p][2];
        const double waa = stats->w[p][0], wab = stats->w[p][1], wbb = stats->w[p][2];
        if (basis == KVC_T_BASIS_POOLED) {
            // after RoPE a mean turns with the position: it stays in the row, in the moments
            const double ma = stats->mean[a], mb = stats->mean[b];
            const double e = 0.5 * (saa + ma * ma + sbb + mb * mb);
            out.rot[p][0] = 1.0f;
            out.rot[p][1] = 0.0f;
            var[a] = var[b] = (float) e;
            wgt[a] = wgt[b] = (float) (0.5 * (waa + wbb));
            continue;
        }
        // the major axis (c, s) of the pair's second moments becomes coefficient a
        const double th = 0.5 * atan2(2.0 * sab, saa - sbb);
        const double c = cos(th), s = sin(th);
        out.rot[p][0] = (float) c;
        out.rot[p][1] = (float) s;
        out.mean[a] = stats->mean[a];
        out.mean[b] = stats->mean[b];
        var[a] = (float) fmax(0.0, c * c * saa + 2.0 * c * s * sab + s * s * sbb);
        var[b] = (float) fmax(0.0, s * s * saa - 2.0 * c * s * sab + c * c * sbb);
        wgt[a] = (float) fmax(0.0, c * c * waa + 2.0 * c * s * wab + s * s * wbb);
        wgt[b] = (float) fmax(0.0, s * s * waa - 2.0 * c * s * wab + c * c * wbb);
    }
    for (int32_t j = 0; j < d; ++j) {
        // a coefficient that never moved keeps a tiny scale and, its weight 0, no bits
        out.sigma[j] = fmaxf(sqrtf(var[j]), 1e-20f);
    }
    for (int32_t budget = row_bits - 8; budget > 0; --budget) {
        int32_t best = -1;
        float   gain = -1.0f;
        for (int32_t j = 0; j < d; ++j) {
            if (out.bits[j] < KVC_T_MAX_BITS) {
                const float g = wgt[j] * var[j] * (kvc_lm_dist[out.bits[j]] - kvc_lm_dist[out.bits[j] + 1]);
                if (g > gain) {
                    gain = g;
                    best = j;
                }
            }
        }
        out.bits[best]++;
    }
    out.row_bits = row_bits;
    *plan = out;
    return true;
}

bool kvc_t_plan_valid(const kvc_t_plan * plan) {
    const int32_t d = plan->d;
    if (!kvc_t_pairs_valid(plan->pair, d)) {
        return false;
    }
    int32_t sum = 8;
    for (int32_t j = 0; j < d; ++j) {
        if (plan->bits[j] > KVC_T_MAX_BITS || !isfinite(plan->mean[j]) || !isfinite(plan->sigma[j]) || !(plan->sigma[j] > 0.0f)) {
            return false;
        }
        sum += plan->bits[j];
    }
    for (int32_t p = 0; p < d / 2; ++p) {
        const float c = plan->rot[p][0], s = plan->rot[p][1];
        if (!(fabsf(c * c + s * s - 1.0f) <= 1e-4f)) {
            return false;
        }
    }
    return sum == plan->row_bits;
}

void kvc_t_forward(const kvc_t_plan * plan, const float * GGML_RESTRICT x, float * GGML_RESTRICT y) {
    for (int32_t p = 0; p < plan->d / 2; ++p) {
        const int   a = plan->pair[p][0], b = plan->pair[p][1];
        const float c = plan->rot[p][0], s = plan->rot[p][1];
        const float xa = x[a] - plan->mean[a];
        const float xb = x[b] - plan->mean[b];
        y[a] =  c * xa + s * xb;
        y[b] = -s * xa + c * xb;
    }
}

void kvc_t_inverse(const kvc_t_plan * plan, const float * GGML_RESTRICT y, float * GGML_RESTRICT x) {
    for (int32_t p = 0; p < plan->d / 2; ++p) {
        const int   a = plan->pair[p][0], b = plan->pair[p][1];
        const float c = plan->rot[p][0], s = plan->rot[p][1];
        x[a] = c * y[a] - s * y[b] + plan->mean[a];
        x[b] = s * y[a] + c * y[b] + plan->mean[b];
    }
}

// Index of the level of b bits nearest to u (ties go down): the number of midpoints between
// levels below u, found in b halvings without a branch on u (the row scale's search calls this
// 21 times per coefficient, and a branch on u is mispredicted half the time).
static int kvc_t_nearest(int b, float u) {
    const float * t = kvc_t_mids(b);
    int lo = 0;
    for (int step = 1 << (b - 1); step > 0; step >>= 1) {
        lo += u > t[lo + step - 1] ? step : 0;
    }
    return lo;
}

// The row scale's code: the 1/8-octave step code (kvc_e8_to_fp32) nearest to s in the log
// domain, 0 for s = 0.
static uint8_t kvc_t_scale_code(float s) {
    if (!(s > 0.0f)) {
        return 0;
    }
    const float e = roundf(8.0f * log2f(s)) + 160.0f;
    return (uint8_t) (e < 1.0f ? 1 : e > (float) KVC_E8_MAX ? KVC_E8_MAX : e);
}

// The squared error in K's units of coding the coefficients u (in units of their sigma) at
// the scale of code e; once its running sum reaches `limit` (it only grows) the rest is not
// added, as such a scale cannot win the search.
static double kvc_t_row_error(const kvc_t_plan * plan, const float * u, uint8_t e, double limit) {
    const float s = kvc_e8_to_fp32(e);
    const float inv = 1.0f / s;
    double err = 0.0;
    for (int32_t j = 0; j < plan->d; ++j) {
        const int   b = plan->bits[j];
        const float r = b > 0 ? u[j] - s * kvc_t_levels(b)[kvc_t_nearest(b, u[j] * inv)] : u[j];
        err += (double) plan->sigma[j] * (double) plan->sigma[j] * (double) r * (double) r;
        if (j % 8 == 7 && err >= limit) {
            break;
        }
    }
    return err;
}

uint8_t kvc_t_row_start(const kvc_t_plan * plan, const float * GGML_RESTRICT x, float * GGML_RESTRICT u) {
    const int32_t d = plan->d;
    float xs[KVC_T_MAX_D] = { 0 };
    for (int32_t j = 0; j < d; ++j) {
        xs[j] = isfinite(x[j]) ? x[j] : plan->mean[j];
    }
    kvc_t_forward(plan, xs, u);

    // the scale the search starts from: the RMS of the coded coefficients in units of their sigma
    double ss = 0.0;
    int    n  = 0;
    for (int32_t j = 0; j < d; ++j) {
        u[j] /= plan->sigma[j];
        if (plan->bits[j] > 0) {
            ss += (double) u[j] * (double) u[j];
            ++n;
        }
    }
    return kvc_t_scale_code(n > 0 ? (float) sqrt(ss / n) : 0.0f);
}

// The code with the smallest error among KVC_T_SEARCH_DOWN below e0 and KVC_T_SEARCH_UP above
// it (a row with a coefficient far out in its distribution is better served by a larger scale
// than by clipping it at the outermost level); ties go to e0, then to the smaller code.
uint8_t kvc_t_row_search_ref(const kvc_t_plan * plan, const float * u, uint8_t e0) {
    uint8_t e = e0;
    double  best = kvc_t_row_error(plan, u, e0, INFINITY);
    for (int c = (int) e0 - KVC_T_SEARCH_DOWN; c <= (int) e0 + KVC_T_SEARCH_UP; ++c) {
        if (c >= 1 && c <= KVC_E8_MAX && c != e0) {
            const double err = kvc_t_row_error(plan, u, (uint8_t) c, best);
            if (err < best) {
                best = err;
                e = (uint8_t) c;
            }
        }
    }
    return e;
}

void kvc_t_row_pack_codes(const kvc_t_plan * plan, const uint8_t * codes, size_t stride, uint8_t e, uint8_t * GGML_RESTRICT y) {
    memset(y, 0, kvc_t_row_size(plan->row_bits));
    uint8_t * out = y;
    uint64_t  acc = e;
    int32_t   n   = 8;
    for (int32_t j = 0; j < plan->d; ++j) {
        if (plan->bits[j] == 0) {
            continue;
        }
        acc |= (uint64_t) codes[j * stride] << n;
        n += plan->bits[j];
        for (; n >= 8; n -= 8) {
            *out++ = (uint8_t) acc;
            acc >>= 8;
        }
    }
    if (n > 0) {
        *out = (uint8_t) acc;
    }
}

void kvc_t_row_pack(const kvc_t_plan * plan, const float * u, uint8_t e, uint8_t * GGML_RESTRICT y) {
    if (e == 0) {
        memset(y, 0, kvc_t_row_size(plan->row_bits));
        return;
    }
    const float inv = 1.0f / kvc_e8_to_fp32(e);
    uint8_t codes[KVC_T_MAX_D];
    for (int32_t j = 0; j < plan->d; ++j) {
        codes[j] = plan->bits[j] > 0 ? (uint8_t) kvc_t_nearest(plan->bits[j], u[j] * inv) : 0;
    }
    kvc_t_row_pack_codes(plan, codes, 1, e, y);
}

void quantize_row_kvct_ref(const kvc_t_plan * plan, const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y) {
    float u[KVC_T_MAX_D];
    const uint8_t e0 = kvc_t_row_start(plan, x, u);
    kvc_t_row_pack(plan, u, e0 == 0 ? 0 : kvc_t_row_search_ref(plan, u, e0), y);
}

void dequantize_row_kvct(const kvc_t_plan * plan, const uint8_t * GGML_RESTRICT x, float * GGML_RESTRICT y) {
    const int32_t d = plan->d;
    const float   s = kvc_e8_to_fp32(x[0]);
    float v[KVC_T_MAX_D];
    int32_t pos = 8;
    for (int32_t j = 0; j < d; ++j) {
        const int b = plan->bits[j];
        uint32_t code = 0;
        for (int i = 0; i < b; ++i, ++pos) {
            code |= (uint32_t) ((x[pos / 8] >> (pos % 8)) & 1u) << i;
        }
        v[j] = b > 0 && s > 0.0f ? kvc_t_levels(b)[code] * plan->sigma[j] * s : 0.0f;
    }
    kvc_t_inverse(plan, v, y);
}

int32_t kvc_t_type_row_bits(enum ggml_type type, int64_t d) {
    if (!ggml_kvcomp_is_kvct(type) || d <= 0 || d % QK_KVCT != 0 || d > KVC_T_MAX_D) {
        return 0;
    }
    return (int32_t) (8 * ggml_row_size(type, d));
}

bool kvc_t_validate_rows(enum ggml_type type, int64_t d, const void * data, size_t nb) {
    if (kvc_t_type_row_bits(type, d) == 0) {
        return false;
    }
    const size_t    rs = ggml_row_size(type, d);
    const uint8_t * p  = (const uint8_t *) data;
    if (nb % rs != 0) {
        return false;
    }
    for (size_t i = 0; i < nb; i += rs) {
        if (p[i] > KVC_E8_MAX) {
            return false;
        }
    }
    return true;
}

bool kvc_t_rope_from_op(kvc_t_rope * rope, const int32_t * op_params, const float * freq_factors, int64_t d) {
    const int32_t n_dims = op_params[1];
    const int32_t mode   = op_params[2];
    const int32_t n_ctx_orig = op_params[4];
    float freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
    memcpy(&freq_base,   op_params + 5, sizeof(float));
    memcpy(&freq_scale,  op_params + 6, sizeof(float));
    memcpy(&ext_factor,  op_params + 7, sizeof(float));
    memcpy(&attn_factor, op_params + 8, sizeof(float));
    memcpy(&beta_fast,   op_params + 9, sizeof(float));
    memcpy(&beta_slow,   op_params + 10, sizeof(float));
    // op_params[15]: the first turned channel
    if (n_dims != d || d % 2 != 0 || d > KVC_T_MAX_D || (mode & ~GGML_ROPE_TYPE_NEOX) != 0 || op_params[15] != 0) {
        return false;
    }
    // the angle is linear in the position (upstream's rope_yarn): theta_extrap = pos *
    // base^(-2p/n_dims) / factor, mixed with freq_scale * theta_extrap by YaRN's ramp
    float corr[2];
    ggml_rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow, corr);
    kvc_t_rope out;
    memset(&out, 0, sizeof(out));
    out.n_pairs = n_dims / 2;
    out.mscale  = ext_factor != 0.0f ? attn_factor * (1.0f + 0.1f * logf(1.0f / freq_scale)) : attn_factor;
    for (int32_t p = 0; p < n_dims / 2; ++p) {
        const double w = pow((double) freq_base, -2.0 * p / n_dims) / (double) (freq_factors ? freq_factors[p] : 1.0f);
        double mix = 0.0;
        if (ext_factor != 0.0f) {
            const double y = (p - (double) corr[0]) / fmax(0.001, (double) (corr[1] - corr[0]));
            mix = (1.0 - fmin(1.0, fmax(0.0, y))) * (double) ext_factor;
        }
        out.theta[p] = (float) (w * ((double) freq_scale * (1.0 - mix) + mix));
    }
    *rope = out;
    return true;
}

void kvc_t_rope_cs(const kvc_t_rope * rope, int64_t pos, float * c, float * s) {
    for (int32_t p = 0; p < rope->n_pairs; ++p) {
        const double a = (double) pos * (double) rope->theta[p];
        c[p] = (float) cos(a) * rope->mscale;
        s[p] = (float) sin(a) * rope->mscale;
    }
}

void kvc_t_rope_row(const kvc_t_plan * plan, const float * c, const float * s, int inverse, float * x) {
    for (int32_t p = 0; p < plan->d / 2; ++p) {
        const int a = plan->pair[p][0], b = plan->pair[p][1];
        const float xa = x[a], xb = x[b];
        if (inverse) {
            const float g = 1.0f / (c[p] * c[p] + s[p] * s[p]);
            x[a] = ( c[p] * xa + s[p] * xb) * g;
            x[b] = (-s[p] * xa + c[p] * xb) * g;
        } else {
            x[a] = c[p] * xa - s[p] * xb;
            x[b] = s[p] * xa + c[p] * xb;
        }
    }
}
