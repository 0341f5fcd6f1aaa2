#pragma once

// Device code of the transform-coded K rows (kvct; the scalar reference is kvc-transform.c,
// the layout docs/formats.md): a plan's row decoded and turned to its key's position, for the
// attention kernels of kvc-cuda.cu, and the tables both directions read. The plans live in
// device memory as the node's plans tensor holds them (one kvc_t_plan per KV head, then the
// layer's kvc_t_rope).

#include "kvc-cuda-common.cuh"
#include "kvc-lloyd-max.h"
#include "kvc-transform.h"

namespace {

__host__ __device__ constexpr bool kvc_is_kvct(ggml_type t) {
    return t >= GGML_KVCOMP_KVCT_FIRST && t <= GGML_KVCOMP_KVCT_LAST;
}

constexpr int KVCT_N_LEVELS = (2 << KVC_T_MAX_BITS) - 2;              // 2^b levels for b = 1..8
constexpr int KVCT_N_MIDS   = (2 << KVC_T_MAX_BITS) - KVC_T_MAX_BITS - 2; // 2^b - 1 thresholds each

__constant__ float kvct_levels_dev[KVCT_N_LEVELS] = KVC_LM_LEVELS;
__constant__ float kvct_mids_dev[KVCT_N_MIDS]     = KVC_LM_MIDS;

// The decoding side below is host code too, so that test-kvc-kvct-cuda-host can check it
// against the C reference on a machine without a GPU.

// level i of the table (the host's copy in host code)
__host__ __device__ __forceinline__ float kvct_level(int i) {
#ifdef __CUDA_ARCH__
    return kvct_levels_dev[i];
#else
    static const float levels[KVCT_N_LEVELS] = KVC_LM_LEVELS;
    return levels[i];
#endif
}

// where the levels and thresholds of b bits start in the tables (kvc-transform.c's layout)
__host__ __device__ __forceinline__ int kvct_levels_at(int b) {
    return (1 << b) - 2;
}
__host__ __device__ __forceinline__ int kvct_mids_at(int b) {
    return (1 << b) - b - 1;
}

// b (1..8) bits of row x from bit `off` on, LSB first (a code spans at most two bytes)
__host__ __device__ __forceinline__ int kvct_code(const uint8_t * x, int off, int b) {
    const int i = off >> 3;
    const int r = off & 7;
    uint32_t v = x[i] >> r;
    if (r + b > 8) {
        v |= (uint32_t) x[i + 1] << (8 - r);
    }
    return (int) (v & ((1u << b) - 1u));
}

// The (cos, sin) of the angle pos * theta, taken in double and reduced before the float
// sincos, as kvc_t_rope_cs takes it within float rounding.
__host__ __device__ __forceinline__ void kvct_turn(int64_t pos, float theta, float & c, float & s) {
    const double a = (double) pos * (double) theta;
    const double two_pi = 6.283185307179586;
    sincosf((float) (a - two_pi * rint(a / two_pi)), &s, &c);
}

// One KV head's plan and its layer's RoPE, as the attention kernel reads them from shared
// memory: every thread of a block reads the same entry at the same time (a broadcast).
template <int D>
struct kvct_plan_smem {
    float    lv[KVCT_N_LEVELS];
    float    sigma[D];
    uint16_t off[D];  // the first bit of coefficient j's code in the row
    uint8_t  bits[D];
    int16_t  a[D/2], b[D/2];
    float    c[D/2], s[D/2], ma[D/2], mb[D/2], theta[D/2];
    float    mscale;
    int      turn;     // rows coded before RoPE, with the cells' positions at hand
};

// Fills sp from plan (every thread of the block calls it; a __syncthreads() must follow).
template <int D>
__host__ __device__ void kvct_plan_load(kvct_plan_smem<D> & sp, const kvc_t_plan * plan, const kvc_t_rope * rope, bool have_pos,
                               int tid, int n_threads) {
    for (int i = tid; i < KVCT_N_LEVELS; i += n_threads) {
        sp.lv[i] = kvct_level(i);
    }
    for (int j = tid; j < D; j += n_threads) {
        sp.sigma[j] = plan->sigma[j];
        sp.bits[j]  = plan->bits[j];
    }
    for (int p = tid; p < D/2; p += n_threads) {
        const int a = plan->pair[p][0], b = plan->pair[p][1];
        sp.a[p]  = (int16_t) a;
        sp.b[p]  = (int16_t) b;
        sp.c[p]  = plan->rot[p][0];
        sp.s[p]  = plan->rot[p][1];
        sp.ma[p] = plan->mean[a];
        sp.mb[p] = plan->mean[b];
        sp.theta[p] = rope->n_pairs > 0 ? rope->theta[p] : 0.0f;
    }
    if (tid == 0) {
        int off = 8;
        for (int j = 0; j < D; ++j) {
            sp.off[j] = (uint16_t) off;
            off += plan->bits[j];
        }
        sp.mscale = rope->mscale;
        sp.turn   = rope->n_pairs > 0 && have_pos;
    }
}

// Coefficient j of a row whose scale is e (0: a zero row).
template <int D>
__host__ __device__ __forceinline__ float kvct_coef(const kvct_plan_smem<D> & sp, const uint8_t * x, float e, int j) {
    const int b = sp.bits[j];
    return b > 0 ? sp.lv[kvct_levels_at(b) + kvct_code(x, sp.off[j], b)] * sp.sigma[j] * e : 0.0f;
}

// q . (row x decoded, turned to position pos when the plan's layer turns rows)
template <int D>
__host__ __device__ __forceinline__ float kvct_dot_row(const kvct_plan_smem<D> & sp, const uint8_t * x, int64_t pos, const float * q) {
    const float e = kvc_step(x[0]);
    float sum = 0.0f;
    for (int p = 0; p < D/2; ++p) {
        const int   a  = sp.a[p], b = sp.b[p];
        const float ya = kvct_coef<D>(sp, x, e, a);
        const float yb = kvct_coef<D>(sp, x, e, b);
        float xa = sp.c[p]*ya - sp.s[p]*yb + sp.ma[p];
        float xb = sp.s[p]*ya + sp.c[p]*yb + sp.mb[p];
        if (sp.turn) {
            float ct, st;
            kvct_turn(pos, sp.theta[p], ct, st);
            const float ra = (ct*xa - st*xb)*sp.mscale;
            const float rb = (st*xa + ct*xb)*sp.mscale;
            xa = ra;
            xb = rb;
        }
        sum += q[a]*xa + q[b]*xb;
    }
    return sum;
}

} // namespace
