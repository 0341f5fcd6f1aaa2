// The tracker's K rows on the CPU as one custom node (docs/design-tracker-modes.md): a decode
// step pays a barrier of every thread per node, and the graph form of this (the tap's copy,
// leaky_relu, clamp, the copy of the first rows, the offset's product and copy, and sub) is
// four nodes per layer once the offset is fixed and seven while the first rows come in.

#include "kvc-cpu.h"

#include <string.h>

// leaky_relu(x, 1) then clamp to F16's range as ggml computes them: the same bits
static inline float kvc_finite(float x) {
    const float v = (x > 0.0f ? x : 0.0f) + (x < 0.0f ? x : 0.0f);
    const float m = v < 65504.0f ? v : 65504.0f;
    return m > -65504.0f ? m : -65504.0f;
}

void ggml_kvc_cpu_offset_rows(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    GGML_UNUSED(userdata);
    // a decode step's rows are a few hundred values: one thread, no split to pay for
    if (ith != 0) {
        return;
    }
    const struct ggml_tensor * cur   = dst->src[0];
    struct ggml_tensor       * c     = dst->src[1];
    const struct ggml_tensor * w     = dst->src[2];
    const struct ggml_tensor * idx   = dst->src[3];
    struct ggml_tensor       * store = dst->src[4];
    const struct ggml_tensor * smp   = dst->src[5];
    struct ggml_tensor       * tap   = dst->src[6];
    const int64_t ne0 = cur->ne[0];
    const int64_t np  = c->ne[2];
    const int64_t ntp = cur->ne[1] / np;
    const int64_t nw  = w->ne[1];

    for (int64_t r = 0; r < smp->ne[1]; ++r) {
        memcpy((char *) tap->data + r * tap->nb[1], (const char *) smp->data + r * smp->nb[1], ne0 * sizeof(float));
    }
    // a plane's c: the one its row holds (weight 1 on that row), or 0 while its first rows
    // come in (no weight); the graph form makes it as the weighted sum of the plane's block
    for (int64_t p = 0; p < np; ++p) {
        const float wc = *(const float *) ((const char *) w->data + (nw - 1) * w->nb[1] + p * w->nb[2]);
        if (wc == 0.0f) {
            memset((char *) c->data + p * c->nb[2], 0, ne0 * sizeof(float));
        }
    }
    for (int64_t t = 0; t < cur->ne[1]; ++t) {
        const float * x  = (const float *) ((const char *) cur->data + t * cur->nb[1]);
        const float * cp = (const float *) ((const char *) c->data + (t / ntp) * c->nb[2]);
        const int64_t row = ((const int64_t *) idx->data)[t];
        float * y = (float *) ((char *) dst->data + t * dst->nb[1]);
        float * s = (float *) ((char *) store->data + row * store->nb[1]);
        for (int64_t i = 0; i < ne0; ++i) {
            const float v = kvc_finite(x[i]);
            s[i] = v;
            y[i] = v - cp[i];
        }
    }
}
