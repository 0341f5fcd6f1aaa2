#pragma once

// Device helpers shared by the kernels of the kvc types (kvc-cuda.cu) and of the kvct types
// (kvc-kvct-cuda.cu).

#include "ggml-cuda/common.cuh"

#include "kvc-common.h"

#include <cstring>

namespace {

// kvc_e8_to_fp32 with the fraction picked by selects, not an indexed (local-memory) table
// (host code too: the host test of the kvct decoder, test-kvc-kvct-cuda-host).
__host__ __device__ __forceinline__ float kvc_step(uint8_t e) {
    constexpr float frac_tab[8] = KVC_E8_FRAC;
    const int f = e & 7;
    float frac = frac_tab[0];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int i = 1; i < 8; ++i) {
        frac = f == i ? frac_tab[i] : frac;
    }
    const uint32_t bits = ((uint32_t) (e >> 3) + 107u) << 23;
#ifdef __CUDA_ARCH__
    const float p = __uint_as_float(bits);
#else
    float p;
    memcpy(&p, &bits, sizeof(p));
#endif
    return e ? p * frac : 0.0f;
}

// SET_ROWS: row (i01, i02, i03) of src0 goes to row src1[i01, i02 % ne11, i03 % ne12] of plane (i02, i03)
template <typename idx_t>
struct kvc_rows_scattered {
    const char * ids;
    int64_t ne01, ne02, ne11, ne12;
    int64_t nb01, nb02, nb03, nb10, nb11, nb12, nb1, nb2, nb3;

    __device__ __forceinline__ int64_t src(int64_t r) const {
        return (r % ne01)*nb01 + ((r / ne01) % ne02)*nb02 + (r / (ne01*ne02))*nb03;
    }
    __device__ __forceinline__ int64_t dst(int64_t r) const {
        const int64_t i01 = r % ne01, i02 = (r / ne01) % ne02, i03 = r / (ne01*ne02);
        return (int64_t) *(const idx_t *) (ids + i01*nb10 + (i02 % ne11)*nb11 + (i03 % ne12)*nb12)*nb1 + i02*nb2 + i03*nb3;
    }
};

// the rows of a SET_ROWS node
template <typename idx_t>
kvc_rows_scattered<idx_t> kvc_rows_scattered_of(const ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    return { (const char *) src1->data, src0->ne[1], src0->ne[2], src1->ne[1], src1->ne[2],
             (int64_t) src0->nb[1], (int64_t) src0->nb[2], (int64_t) src0->nb[3],
             (int64_t) src1->nb[0], (int64_t) src1->nb[1], (int64_t) src1->nb[2],
             (int64_t) dst->nb[1], (int64_t) dst->nb[2], (int64_t) dst->nb[3] };
}

} // namespace
