// CUDA kernels of the kvc types: dequantization (convert, GET_ROWS, CPY to float), quantization
// (SET_ROWS, CPY from F32/F16) and a flash-attention vector kernel that reads kvc K and V blocks
// where they lie. The scalar references are in kvc-quants.c; cpp/tests/test-kvc-backend.cpp
// checks every op here against the CPU backend.

#include "kvc-cuda.cuh"
#include "kvc-cuda-common.cuh"
#include "kvc-kvct-cuda.cuh"

#include "kvc-common.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

template <ggml_type type> struct kvc_traits;
template <> struct kvc_traits<GGML_TYPE_KVC8> { using block = block_kvc8; static constexpr int n_levels = 0; };
template <> struct kvc_traits<GGML_TYPE_KVC4> { using block = block_kvc4; static constexpr int n_levels = 16; };
template <> struct kvc_traits<GGML_TYPE_KVC3> { using block = block_kvc3; static constexpr int n_levels = 8; };
template <> struct kvc_traits<GGML_TYPE_KVC2> { using block = block_kvc2; static constexpr int n_levels = 4; };

template <ggml_type type> constexpr int kvc_block_size = (int) sizeof(typename kvc_traits<type>::block);

__constant__ int8_t kvc_levels_kvc4_dev[16] = KVC_LEVELS_KVC4;
__constant__ int8_t kvc_levels_kvc3_dev[8]  = KVC_LEVELS_KVC3;
__constant__ int8_t kvc_levels_kvc2_dev[4]  = KVC_LEVELS_KVC2;

// Codes index the level table per lane, which constant memory would serialize: every kernel
// copies its type's levels to shared memory first (kvc_load_levels, then __syncthreads).
template <ggml_type type>
__device__ __forceinline__ void kvc_load_levels(float * lv, int tid, int n_threads) {
    constexpr int n = kvc_traits<type>::n_levels;
    for (int i = tid; i < n; i += n_threads) {
        if constexpr (type == GGML_TYPE_KVC4) {
            lv[i] = kvc_levels_kvc4_dev[i];
        } else if constexpr (type == GGML_TYPE_KVC3) {
            lv[i] = kvc_levels_kvc3_dev[i];
        } else if constexpr (type == GGML_TYPE_KVC2) {
            lv[i] = kvc_levels_kvc2_dev[i];
        }
    }
}

// The code of value j (0..31) of a low-bit block b.
template <ggml_type type>
__device__ __forceinline__ int kvc_code(const uint8_t * b, int j) {
    if constexpr (type == GGML_TYPE_KVC4) {
        const int q = b[2 + (j & 15)];
        return j < 16 ? q & 15 : q >> 4;
    } else if constexpr (type == GGML_TYPE_KVC3) {
        const int g = j >> 3;
        return ((b[2 + (j & 7)] >> (2*g)) & 3) | (((b[10 + g] >> (j & 7)) & 1) << 2);
    } else {
        static_assert(type == GGML_TYPE_KVC2, "low-bit kvc type expected");
        return (b[2 + (j & 7)] >> (2*((j >> 3)))) & 3;
    }
}

// Values j0 .. j0 + n - 1 of block b, all in one 16-value sub-block.
template <ggml_type type, int n>
__device__ __forceinline__ void kvc_values(const uint8_t * b, int j0, const float * lv, float * out) {
    if constexpr (type == GGML_TYPE_KVC8) {
        const float d = __half2float(*(const half *) b);
#pragma unroll
        for (int i = 0; i < n; ++i) {
            out[i] = d * (float) (int8_t) b[2 + j0 + i];
        }
    } else {
        const float d = kvc_step(b[j0 >> 4]);
#pragma unroll
        for (int i = 0; i < n; ++i) {
            out[i] = d * lv[kvc_code<type>(b, j0 + i)];
        }
    }
}

// ---- quantization: one warp per 32-value block, the search of kvc-quants.c ----
//
// A thread per block made the search (14 steps x 16 values x the levels) the latency of every
// KV write: the lanes of a warp try the candidate steps side by side instead, and then each
// lane encodes the value it holds.

// Non-finite inputs are stored as zero, as the reference does.
__device__ __forceinline__ float kvc_finite_or_zero(float v) {
    return isfinite(v) ? v : 0.0f;
}

template <int n_levels>
__device__ __forceinline__ int kvc_nearest(const float * lv, float v) {
    int c = 0;
#pragma unroll
    for (int i = 0; i + 1 < n_levels; ++i) {
        c += v > 0.5f*(lv[i] + lv[i + 1]);
    }
    return c;
}

// the lowest error over the lanes of a group of `width`, ties to the lower candidate index
template <int width>
__device__ __forceinline__ void kvc_argmin(float & err, int & idx) {
#pragma unroll
    for (int off = width/2; off > 0; off >>= 1) {
        const float e2 = __shfl_xor_sync(0xffffffff, err, off, width);
        const int   i2 = __shfl_xor_sync(0xffffffff, idx, off, width);
        if (e2 < err || (e2 == err && i2 < idx)) {
            err = e2;
            idx = i2;
        }
    }
}

// v: the block's 32 values (finite), lane: this thread's lane; writes block y.
template <ggml_type type>
__device__ void kvc_quantize_block_warp(const float * v, uint8_t * y, const float * lv, int lane) {
    if constexpr (type == GGML_TYPE_KVC8) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < QK_KVC; ++i) {
            amax = fmaxf(amax, fabsf(v[i]));
        }
        // candidate s = lane (8 of them) of the reference's absmax-relative steps
        const half dh = __float2half(amax / 127.0f * (1.0f - 0.03f*lane));
        const float d = __half2float(dh);
        float err = INFINITY;
        if (lane < 8 && amax > 0.0f && d != 0.0f) {
            const float id = 1.0f / d;
            err = 0.0f;
#pragma unroll
            for (int i = 0; i < QK_KVC; ++i) {
                const float diff = v[i] - d*(float) min(127, max(-127, __float2int_rn(v[i]*id)));
                err += diff*diff;
            }
        }
        int best = lane;
        kvc_argmin<WARP_SIZE>(err, best);
        const half  picked = __shfl_sync(0xffffffff, dh, best);
        const half  bd = err == INFINITY ? __float2half(amax / 127.0f) : picked;
        const float bf = __half2float(bd);
        const float id = bf != 0.0f ? 1.0f / bf : 0.0f;
        if (lane == 0) {
            *(half *) y = bd;
        }
        y[2 + lane] = (uint8_t) (int8_t) min(127, max(-127, __float2int_rn(v[lane]*id)));
    } else {
        constexpr int n = kvc_traits<type>::n_levels;
        const int sb = lane / QK_KVC_SUB; // this lane's sub-block
        const int ci = lane % QK_KVC_SUB; // its candidate step, and the value it encodes
        const float * vs = v + sb*QK_KVC_SUB;

        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < QK_KVC_SUB; ++i) {
            amax = fmaxf(amax, fabsf(vs[i]));
        }
        // the shuffles below need every lane, so a zero sub-block searches nothing but still joins
        const int e_max = amax > 0.0f ? min(KVC_E8_MAX, max(1, __float2int_rn(8.0f*log2f(amax / lv[n - 1])) + 160)) : 0;
        const int e_try = e_max + KVC_SEARCH_UP - ci;
        float err = INFINITY;
        if (amax > 0.0f && ci <= KVC_SEARCH_UP + KVC_SEARCH_DOWN && e_try >= 1 && e_try <= KVC_E8_MAX) {
            const float d  = kvc_step((uint8_t) e_try);
            const float id = 1.0f / d;
            err = 0.0f;
#pragma unroll
            for (int i = 0; i < QK_KVC_SUB; ++i) {
                const float diff = vs[i] - d*lv[kvc_nearest<n>(lv, vs[i]*id)];
                err += diff*diff;
            }
        }
        int best = ci;
        kvc_argmin<QK_KVC_SUB>(err, best);
        const int e    = amax > 0.0f ? e_max + KVC_SEARCH_UP - best : 0;
        const int code = e ? kvc_nearest<n>(lv, vs[ci]*(1.0f / kvc_step((uint8_t) e))) : n / 2;
        if (ci == 0) {
            y[sb] = (uint8_t) e;
        }
        // lane i holds the code of value i; gather each byte's codes from their lanes
        if constexpr (type == GGML_TYPE_KVC4) {
            const int hi = __shfl_down_sync(0xffffffff, code, QK_KVC_SUB);
            if (lane < QK_KVC_SUB) {
                y[2 + lane] = (uint8_t) (code | hi << 4);
            }
        } else {
            const int c1 = __shfl_down_sync(0xffffffff, code, 8);
            const int c2 = __shfl_down_sync(0xffffffff, code, 16);
            const int c3 = __shfl_down_sync(0xffffffff, code, 24);
            if (lane < 8) {
                y[2 + lane] = (uint8_t) ((code & 3) | (c1 & 3) << 2 | (c2 & 3) << 4 | (c3 & 3) << 6);
            }
            if constexpr (type == GGML_TYPE_KVC3) {
                const uint32_t bits = __ballot_sync(0xffffffff, (code >> 2) & 1);
                if (lane < 4) {
                    y[10 + lane] = (uint8_t) (bits >> (8*lane));
                }
            }
        }
    }
}

// Rows of a 4-d tensor in order: the byte offset of row r, for a row mapping between two
// tensors of the same element count and row length (CPY).
struct kvc_rows {
    int64_t ne1, ne2;
    int64_t nb1, nb2, nb3;

    __device__ __forceinline__ int64_t offset(int64_t r) const {
        const int64_t i1 = r % ne1;
        const int64_t i2 = (r / ne1) % ne2;
        const int64_t i3 = r / (ne1*ne2);
        return i1*nb1 + i2*nb2 + i3*nb3;
    }
};

static kvc_rows kvc_rows_of(const ggml_tensor * t) {
    return { t->ne[1], t->ne[2], (int64_t) t->nb[1], (int64_t) t->nb[2], (int64_t) t->nb[3] };
}

constexpr int KVC_THREADS = 256;

// ---- dequantization ----

// dst row r = the kvc row at rows.src(r), as dst_t, at rows.dst(r) (byte offsets): the one
// dequantizing kernel behind convert, GET_ROWS and CPY, which differ in their row addressing.
template <ggml_type type, typename dst_t, typename rows_t>
__global__ void k_kvc_rows_to_float(const char * __restrict__ src, char * __restrict__ dst, int64_t ne00, int64_t n_rows,
                                    const rows_t rows) {
    __shared__ float lv[16];
    kvc_load_levels<type>(lv, threadIdx.x, blockDim.x);
    __syncthreads();

    const int64_t i00 = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i00 >= ne00) {
        return;
    }
    for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) {
        float v;
        kvc_values<type, 1>((const uint8_t *) src + rows.src(r) + (i00 / QK_KVC)*kvc_block_size<type>, i00 % QK_KVC, lv, &v);
        *(dst_t *) (dst + rows.dst(r) + i00*sizeof(dst_t)) = ggml_cuda_cast<dst_t>(v);
    }
}

// row r of two tensors with the same rows (CPY, and the converters with a contiguous dst)
struct kvc_rows_pair {
    kvc_rows s, d;
    __device__ __forceinline__ int64_t src(int64_t r) const { return s.offset(r); }
    __device__ __forceinline__ int64_t dst(int64_t r) const { return d.offset(r); }
};

template <ggml_type type, typename dst_t, typename rows_t>
void kvc_rows_to_float_cuda(const void * src, void * dst, int64_t ne00, int64_t n_rows, const rows_t & rows,
                            cudaStream_t stream) {
    if (ne00 == 0 || n_rows == 0) {
        return;
    }
    const dim3 grid((unsigned) ((ne00 + KVC_THREADS - 1) / KVC_THREADS), (unsigned) std::min<int64_t>(n_rows, 65535));
    k_kvc_rows_to_float<type, dst_t><<<grid, KVC_THREADS, 0, stream>>>((const char *) src, (char *) dst, ne00, n_rows, rows);
}

// strides in blocks, as upstream's *_nc converters take them
template <ggml_type type, typename dst_t>
void kvc_to_nc_cuda(const void * x, dst_t * y, int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03,
                    int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream) {
    const int64_t bs = kvc_block_size<type>;
    const int64_t rs = ne00*(int64_t) sizeof(dst_t);
    const kvc_rows_pair rows = { { ne01, ne02, s01*bs, s02*bs, s03*bs }, { ne01, ne02, rs, rs*ne01, rs*ne01*ne02 } };
    kvc_rows_to_float_cuda<type, dst_t>(x, y, ne00, ne01*ne02*ne03, rows, stream);
}

template <ggml_type type, typename dst_t>
void kvc_to_cont_cuda(const void * x, dst_t * y, int64_t k, cudaStream_t stream) {
    const int64_t nb = k / QK_KVC;
    // rows of 32 blocks keep the grid's x dimension small for long tensors
    const int64_t row = nb % 32 == 0 ? 32 : 1;
    kvc_to_nc_cuda<type>(x, y, row*QK_KVC, nb / row, 1, 1, row, nb, nb, stream);
}

// Calls f(std::integral_constant<ggml_type, T>) for the kvc type T == type; false for other types.
template <typename F>
bool kvc_dispatch(ggml_type type, F && f) {
    switch (type) {
        case GGML_TYPE_KVC8: f(std::integral_constant<ggml_type, GGML_TYPE_KVC8>{}); return true;
        case GGML_TYPE_KVC4: f(std::integral_constant<ggml_type, GGML_TYPE_KVC4>{}); return true;
        case GGML_TYPE_KVC3: f(std::integral_constant<ggml_type, GGML_TYPE_KVC3>{}); return true;
        case GGML_TYPE_KVC2: f(std::integral_constant<ggml_type, GGML_TYPE_KVC2>{}); return true;
        default:             return false;
    }
}

// The converter of a kvc type for upstream's tables (strided when nc); nullptr for other types.
template <typename fn_t, typename dst_t, bool nc>
fn_t kvc_converter(ggml_type type) {
    fn_t fn = nullptr;
    kvc_dispatch(type, [&](auto t) {
        if constexpr (nc) {
            fn = kvc_to_nc_cuda<decltype(t)::value, dst_t>;
        } else {
            fn = kvc_to_cont_cuda<decltype(t)::value, dst_t>;
        }
    });
    return fn;
}

// GET_ROWS: dst[:, i10, i11, i12] = src0[:, src1[i10, i11, i12], i11, i12]
struct kvc_rows_gathered {
    const char * ids;
    int64_t ne10, ne11;
    int64_t nb01, nb02, nb03, nb10, nb11, nb12, nb1, nb2, nb3;

    __device__ __forceinline__ int64_t src(int64_t r) const {
        const int64_t i10 = r % ne10, i11 = (r / ne10) % ne11, i12 = r / (ne10*ne11);
        return *(const int32_t *) (ids + i10*nb10 + i11*nb11 + i12*nb12)*nb01 + i11*nb02 + i12*nb03;
    }
    __device__ __forceinline__ int64_t dst(int64_t r) const {
        const int64_t i10 = r % ne10, i11 = (r / ne10) % ne11, i12 = r / (ne10*ne11);
        return i10*nb1 + i11*nb2 + i12*nb3;
    }
};

// kvc row rows.dst(r) = quantized float row rows.src(r) (byte offsets, values nb00 bytes apart):
// one warp per 32-value block, the kernel behind SET_ROWS and CPY into a kvc tensor.
template <ggml_type type, typename src_t, typename rows_t>
__global__ void k_kvc_rows_from_float(const char * __restrict__ src, char * __restrict__ dst, int64_t nb_row, int64_t n_rows,
                                      int64_t nb00, const rows_t rows) {
    __shared__ float lv[16];
    __shared__ float vals[KVC_THREADS];
    kvc_load_levels<type>(lv, threadIdx.x, blockDim.x);

    const int     lane = threadIdx.x % WARP_SIZE;
    const int64_t i    = ((int64_t) blockIdx.x*blockDim.x + threadIdx.x) / WARP_SIZE;
    float * v = vals + (threadIdx.x / WARP_SIZE)*QK_KVC;
    const bool active = i < nb_row*n_rows;
    const int64_t r  = active ? i / nb_row : 0;
    const int64_t ib = active ? i % nb_row : 0;
    v[lane] = active ? kvc_finite_or_zero(ggml_cuda_cast<float>(*(const src_t *) (src + rows.src(r) + (ib*QK_KVC + lane)*nb00))) : 0.0f;
    __syncthreads();
    if (!active) {
        return;
    }
    kvc_quantize_block_warp<type>(v, (uint8_t *) dst + rows.dst(r) + ib*kvc_block_size<type>, lv, lane);
}

// the kernels above for a kvc type and a float type known at run time
template <typename rows_t>
void kvc_rows_to_float(ggml_type type, ggml_type dst_type, const void * src, void * dst, int64_t ne00, int64_t n_rows,
                       const rows_t & rows, cudaStream_t stream) {
    kvc_dispatch(type, [&](auto t) {
        if (dst_type == GGML_TYPE_F16) {
            kvc_rows_to_float_cuda<decltype(t)::value, half>(src, dst, ne00, n_rows, rows, stream);
        } else {
            kvc_rows_to_float_cuda<decltype(t)::value, float>(src, dst, ne00, n_rows, rows, stream);
        }
    });
}

template <typename rows_t>
void kvc_rows_from_float(ggml_type type, ggml_type src_type, const void * src, void * dst, int64_t ne00, int64_t n_rows,
                         int64_t nb00, const rows_t & rows, cudaStream_t stream) {
    const int64_t nb_row = ne00 / QK_KVC;
    if (nb_row*n_rows == 0) {
        return;
    }
    const int64_t per_cta = KVC_THREADS / WARP_SIZE;
    const int n_blocks = (int) ((nb_row*n_rows + per_cta - 1) / per_cta);
    kvc_dispatch(type, [&](auto t) {
        constexpr ggml_type tt = decltype(t)::value;
        if (src_type == GGML_TYPE_F16) {
            k_kvc_rows_from_float<tt, half><<<n_blocks, KVC_THREADS, 0, stream>>>(
                (const char *) src, (char *) dst, nb_row, n_rows, nb00, rows);
        } else {
            k_kvc_rows_from_float<tt, float><<<n_blocks, KVC_THREADS, 0, stream>>>(
                (const char *) src, (char *) dst, nb_row, n_rows, nb00, rows);
        }
    });
}

// ---- flash attention, vector kernel ----
//
// One thread block per (chunk of KVC_FA_CHUNK cells, Q head, Q column). Scores: a thread per
// cell dots Q with its whole K row. Values: warps take cells in turn, each lane holding D/32
// consecutive values of the V row. K and V are read as packed blocks and never copied. Each
// block leaves a partial softmax (max, sum, weighted V) and k_kvc_fattn_combine merges the
// chunks, with the attention sink when there is one.

constexpr int KVC_FA_WARPS = 4;
constexpr int KVC_FA_CHUNK = 256;

struct kvc_fattn_params {
    const char * Q; const char * K; const char * V; const char * mask; const float * sinks;
    float * part; // per (row, chunk): max, sum, D values
    float * dst;
    int64_t n_kv, n_q, n_head, n_head_k, n_head_v, n_q3, n_k3, n_v3, mask_ne1, mask_ne3;
    int64_t nbq1, nbq2, nbq3, nbk1, nbk2, nbk3, nbv1, nbv2, nbv3, nbm1, nbm3;
    float scale, softcap, m0, m1;
    uint32_t n_head_log2;
    int n_chunks;
    // kvct K: the plans (one per KV head, then the layer's kvc_t_rope) and, for rows coded
    // before RoPE, the cells' positions ([pos_ne0 cells, streams], K's first stream pos_s0)
    const kvc_t_plan * plans;
    const int32_t * pos;
    int64_t pos_ne0, pos_s0;
};

template <int D>
__device__ __forceinline__ int64_t kvc_fattn_part_stride() {
    return D + 2;
}

// q . row for one kvc row of D values (q in shared memory: every thread reads the same q value
// at the same time, a broadcast)
template <ggml_type type, int D>
__device__ __forceinline__ float kvc_dot_row(const uint8_t * row, const float * q, const float * lv) {
    float sum = 0.0f;
#pragma unroll
    for (int ib = 0; ib < D/QK_KVC; ++ib) {
        const uint8_t * b  = row + ib*kvc_block_size<type>;
        const float   * qb = q + ib*QK_KVC;
        if constexpr (type == GGML_TYPE_KVC8) {
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < QK_KVC; ++j) {
                s += qb[j]*(float) (int8_t) b[2 + j];
            }
            sum += __half2float(*(const half *) b)*s;
        } else {
            float s0 = 0.0f;
            float s1 = 0.0f;
#pragma unroll
            for (int j = 0; j < QK_KVC_SUB; ++j) {
                s0 += qb[j]*lv[kvc_code<type>(b, j)];
                s1 += qb[j + QK_KVC_SUB]*lv[kvc_code<type>(b, j + QK_KVC_SUB)];
            }
            sum += kvc_step(b[0])*s0 + kvc_step(b[1])*s1;
        }
    }
    return sum;
}

template <int D, ggml_type type_K, ggml_type type_V>
__global__ void __launch_bounds__(KVC_FA_WARPS*WARP_SIZE) k_kvc_fattn_vec(const kvc_fattn_params p) {
    constexpr int EPL = D / WARP_SIZE; // values per lane
    static_assert(D % (2*WARP_SIZE) == 0 && QK_KVC_SUB % EPL == 0, "head size must be a multiple of 64, at most 512");

    __shared__ float lv_k[16];
    __shared__ float lv_v[16];
    __shared__ float q_s[D];
    __shared__ float s[KVC_FA_CHUNK];
    __shared__ float red[KVC_FA_WARPS][D];
    __shared__ float red_max[KVC_FA_WARPS];
    __shared__ float red_sum[KVC_FA_WARPS];

    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;

    constexpr bool kvct = kvc_is_kvct(type_K);
    __shared__ std::conditional_t<kvct, kvct_plan_smem<D>, char> kp_s;
    if constexpr (!kvct) {
        kvc_load_levels<type_K>(lv_k, tid, blockDim.x);
    }
    kvc_load_levels<type_V>(lv_v, tid, blockDim.x);

    const int     chunk = blockIdx.x;
    const int64_t h     = blockIdx.y;
    const int64_t iq1   = blockIdx.z % p.n_q;
    const int64_t iq3   = blockIdx.z / p.n_q;

    const int64_t c0 = (int64_t) chunk*KVC_FA_CHUNK;
    const int64_t c1 = min(p.n_kv, c0 + KVC_FA_CHUNK);

    const int64_t hk = h / (p.n_head / p.n_head_k);
    const int64_t hv = h / (p.n_head / p.n_head_v);
    const char * Kh = p.K + hk*p.nbk2 + (iq3 / (p.n_q3 / p.n_k3))*p.nbk3;
    const char * Vh = p.V + hv*p.nbv2 + (iq3 / (p.n_q3 / p.n_v3))*p.nbv3;
    const half * mrow = p.mask ? (const half *) (p.mask + (iq1 % p.mask_ne1)*p.nbm1 + (iq3 % p.mask_ne3)*p.nbm3) : nullptr;

    float slope = 1.0f;
    if (p.m0 != 1.0f || p.m1 != 1.0f) {
        slope = h < p.n_head_log2 ? powf(p.m0, h + 1) : powf(p.m1, 2*(h - p.n_head_log2) + 1);
    }

    const int j0 = (lane*EPL) % QK_KVC;
    const int64_t kb = (lane*EPL) / QK_KVC; // block of this lane's V values in a row

    const float * qrow = (const float *) (p.Q + iq1*p.nbq1 + h*p.nbq2 + iq3*p.nbq3);
    // kvct: the positions of this stream's cells
    const int32_t * pos_s = nullptr;
    if constexpr (kvct) {
        kvct_plan_load<D>(kp_s, p.plans + hk, (const kvc_t_rope *) (p.plans + p.n_head_k), p.pos != nullptr, tid, blockDim.x);
        pos_s = p.pos ? p.pos + (p.pos_s0 + iq3 / (p.n_q3 / p.n_k3))*p.pos_ne0 : nullptr;
    }
    for (int i = tid; i < D; i += blockDim.x) {
        q_s[i] = qrow[i] * p.scale;
    }
    __syncthreads();

    // scores: a thread per cell, so no reduction per cell
    float tmax = -INFINITY;
    for (int64_t c = c0 + tid; c < c1; c += blockDim.x) {
        const float mv = mrow ? slope*__half2float(mrow[c]) : 0.0f;
        float sc = -INFINITY;
        if (mv != -INFINITY) {
            float dot;
            if constexpr (kvct) {
                dot = kvct_dot_row<D>(kp_s, (const uint8_t *) Kh + c*p.nbk1, kp_s.turn ? pos_s[c] : 0, q_s);
            } else {
                dot = kvc_dot_row<type_K, D>((const uint8_t *) Kh + c*p.nbk1, q_s, lv_k);
            }
            if (p.softcap != 0.0f) {
                dot = p.softcap*tanhf(dot);
            }
            sc = dot + mv;
        }
        s[c - c0] = sc;
        tmax = fmaxf(tmax, sc);
    }
    tmax = warp_reduce_max(tmax);
    if (lane == 0) {
        red_max[warp] = tmax;
    }
    __syncthreads();

    float m = red_max[0];
#pragma unroll
    for (int w = 1; w < KVC_FA_WARPS; ++w) {
        m = fmaxf(m, red_max[w]);
    }

    float acc[EPL] = {};
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int64_t c = c0 + warp; c < c1; c += KVC_FA_WARPS) {
            const float pc = expf(s[c - c0] - m);
            l += pc;
            if (pc == 0.0f) {
                continue;
            }
            float v[EPL];
            kvc_values<type_V, EPL>((const uint8_t *) Vh + c*p.nbv1 + kb*kvc_block_size<type_V>, j0, lv_v, v);
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                acc[i] += pc*v[i];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        red[warp][lane*EPL + i] = acc[i];
    }
    if (lane == 0) {
        red_sum[warp] = l; // every lane of a warp summed the same weights
    }
    __syncthreads();

    const int64_t row = (iq3*p.n_q + iq1)*p.n_head + h;
    float * part = p.part + (row*p.n_chunks + chunk)*kvc_fattn_part_stride<D>();
    for (int d = tid; d < D; d += blockDim.x) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < KVC_FA_WARPS; ++w) {
            sum += red[w][d];
        }
        part[2 + d] = sum;
    }
    if (tid == 0) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < KVC_FA_WARPS; ++w) {
            sum += red_sum[w];
        }
        part[0] = m;
        part[1] = sum;
    }
}

// dst row (iq3, iq1, h) = sum_c e^(m_c - M) acc_c / (sum_c e^(m_c - M) l_c + e^(sink - M))
template <int D>
__global__ void k_kvc_fattn_combine(const kvc_fattn_params p) {
    const int64_t row = blockIdx.x;
    const int64_t h   = row % p.n_head;
    const float * part = p.part + row*p.n_chunks*kvc_fattn_part_stride<D>();

    float M = p.sinks ? p.sinks[h] : -INFINITY;
    for (int c = 0; c < p.n_chunks; ++c) {
        M = fmaxf(M, part[c*kvc_fattn_part_stride<D>()]);
    }
    float L = p.sinks ? expf(p.sinks[h] - M) : 0.0f;
    for (int c = 0; c < p.n_chunks; ++c) {
        const float mc = part[c*kvc_fattn_part_stride<D>()];
        L += mc == -INFINITY ? 0.0f : expf(mc - M)*part[c*kvc_fattn_part_stride<D>() + 1];
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < p.n_chunks; ++c) {
            const float mc = part[c*kvc_fattn_part_stride<D>()];
            acc += mc == -INFINITY ? 0.0f : expf(mc - M)*part[c*kvc_fattn_part_stride<D>() + 2 + d];
        }
        p.dst[row*D + d] = L > 0.0f ? acc / L : 0.0f;
    }
}

template <int D, ggml_type type_K, ggml_type type_V>
void kvc_fattn_vec_launch(const kvc_fattn_params & p, cudaStream_t stream) {
    const dim3 grid(p.n_chunks, (unsigned) p.n_head, (unsigned) (p.n_q*p.n_q3));
    k_kvc_fattn_vec<D, type_K, type_V><<<grid, KVC_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
    k_kvc_fattn_combine<D><<<(unsigned) (p.n_head*p.n_q*p.n_q3), D, 0, stream>>>(p);
}

// The K/V pairs with a vector kernel: K at least as wide as V (the kvc types are numbered from
// the widest), since K carries the softmax's sensitivity and is the one users keep wider.
constexpr bool kvc_fattn_pair(ggml_type type_K, ggml_type type_V) {
    return type_K <= type_V;
}

static bool kvc_fattn_pair_supported(ggml_type type_K, ggml_type type_V) {
    return ggml_cuda_kvc_is_kvc(type_V) &&
           (ggml_kvcomp_is_kvct(type_K) || (ggml_cuda_kvc_is_kvc(type_K) && kvc_fattn_pair(type_K, type_V)));
}

template <int D>
bool kvc_fattn_vec_dispatch_d(ggml_type type_K, ggml_type type_V, const kvc_fattn_params & p, cudaStream_t stream) {
    bool done = false;
    if (ggml_kvcomp_is_kvct(type_K)) {
        // one kernel for every kvct type: the row's bits are the plan's
        kvc_dispatch(type_V, [&](auto tv) {
            kvc_fattn_vec_launch<D, GGML_TYPE_KVCT4, decltype(tv)::value>(p, stream);
            done = true;
        });
        return done;
    }
    kvc_dispatch(type_K, [&](auto tk) {
        kvc_dispatch(type_V, [&](auto tv) {
            constexpr ggml_type tK = decltype(tk)::value;
            constexpr ggml_type tV = decltype(tv)::value;
            if constexpr (kvc_fattn_pair(tK, tV)) {
                kvc_fattn_vec_launch<D, tK, tV>(p, stream);
                done = true;
            }
        });
    });
    return done;
}

} // namespace

to_fp16_cuda_t ggml_cuda_kvc_get_to_fp16(ggml_type type) {
    return kvc_converter<to_fp16_cuda_t, half, false>(type);
}

to_fp32_cuda_t ggml_cuda_kvc_get_to_fp32(ggml_type type) {
    return kvc_converter<to_fp32_cuda_t, float, false>(type);
}

to_fp16_nc_cuda_t ggml_cuda_kvc_get_to_fp16_nc(ggml_type type) {
    return kvc_converter<to_fp16_nc_cuda_t, half, true>(type);
}

to_fp32_nc_cuda_t ggml_cuda_kvc_get_to_fp32_nc(ggml_type type) {
    return kvc_converter<to_fp32_nc_cuda_t, float, true>(type);
}

bool ggml_cuda_kvc_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    if (ggml_cuda_kvct_set_rows(ctx, dst)) {
        return true;
    }
    if (!ggml_cuda_kvc_is_kvc(dst->type)) {
        return false;
    }
    GGML_TENSOR_BINARY_OP_LOCALS

    auto run = [&](auto idx) {
        kvc_rows_from_float(dst->type, src0->type, src0->data, dst->data, ne00, ne01*ne02*ne03, (int64_t) nb00,
                            kvc_rows_scattered_of<decltype(idx)>(dst), ctx.stream());
    };
    if (src1->type == GGML_TYPE_I64) {
        run(int64_t());
    } else {
        run(int32_t());
    }
    return true;
}

bool ggml_cuda_kvc_get_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    if (!ggml_cuda_kvc_is_kvc(src0->type)) {
        return false;
    }
    GGML_TENSOR_BINARY_OP_LOCALS

    const kvc_rows_gathered rows = { (const char *) src1->data, ne10, ne11, (int64_t) nb01, (int64_t) nb02, (int64_t) nb03,
                                     (int64_t) nb10, (int64_t) nb11, (int64_t) nb12, (int64_t) nb1, (int64_t) nb2, (int64_t) nb3 };
    kvc_rows_to_float(src0->type, dst->type, src0->data, dst->data, ne00, ne10*ne11*ne12, rows, ctx.stream());
    return true;
}

bool ggml_cuda_kvc_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1) {
    const bool from_kvc = ggml_cuda_kvc_is_kvc(src0->type);
    const bool to_kvc   = ggml_cuda_kvc_is_kvc(src1->type);
    if ((!from_kvc && !to_kvc) || src0->type == src1->type) {
        return false;
    }
    const int64_t ne00   = src0->ne[0];
    const int64_t n_rows = ggml_nrows(src0);
    const kvc_rows_pair rows = { kvc_rows_of(src0), kvc_rows_of(src1) };
    if (from_kvc) {
        kvc_rows_to_float(src0->type, src1->type, src0->data, src1->data, ne00, n_rows, rows, ctx.stream());
    } else {
        kvc_rows_from_float(src1->type, src0->type, src0->data, src1->data, ne00, n_rows, (int64_t) src0->nb[0], rows,
                            ctx.stream());
    }
    return true;
}

bool ggml_cuda_kvc_fattn_vec_applies(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const int64_t D = Q->ne[0];
    if (ggml_kvcomp_is_kvct(K->type)) {
        const ggml_tensor * plans = ggml_kvct_get_plans(dst);
        if (!plans || kvc_t_plans_n_head(ggml_nbytes(plans)) != K->ne[2] || kvc_t_type_row_bits(K->type, D) == 0 ||
            ggml_flash_attn_ext_has_exact(dst)) {
            return false;
        }
        // the positions are read as [cells, streams] of I32 from K's first stream on
        const ggml_tensor * pos = ggml_kvct_get_positions(dst);
        if (pos && (pos->type != GGML_TYPE_I32 || !ggml_is_contiguous(pos) || pos->ne[0] < K->ne[1])) {
            return false;
        }
    }
    return kvc_fattn_pair_supported(K->type, V->type) && (D == 64 || D == 128 || D == 256) &&
           K->ne[0] == D && V->ne[0] == D && Q->type == GGML_TYPE_F32 &&
           K->nb[0] == ggml_type_size(K->type) && V->nb[0] == ggml_type_size(V->type);
}

bool ggml_cuda_kvct_fattn_applies(const ggml_tensor * dst) {
    return ggml_kvcomp_is_kvct(dst->src[1]->type) && ggml_cuda_kvc_fattn_vec_applies(dst);
}

bool ggml_cuda_kvc_flash_attn_ext_vec(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!ggml_cuda_kvc_fattn_vec_applies(dst)) {
        return false;
    }
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * V     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    kvc_fattn_params p = {};
    p.Q = (const char *) Q->data;
    p.K = (const char *) K->data;
    p.V = (const char *) V->data;
    p.mask  = mask ? (const char *) mask->data : nullptr;
    p.sinks = sinks ? (const float *) sinks->data : nullptr;
    p.dst   = (float *) dst->data;
    p.n_kv = K->ne[1]; p.n_q = Q->ne[1]; p.n_head = Q->ne[2]; p.n_head_k = K->ne[2]; p.n_head_v = V->ne[2];
    p.n_q3 = Q->ne[3]; p.n_k3 = K->ne[3]; p.n_v3 = V->ne[3];
    p.mask_ne1 = mask ? mask->ne[1] : 1;
    p.mask_ne3 = mask ? mask->ne[3] : 1;
    p.nbq1 = Q->nb[1]; p.nbq2 = Q->nb[2]; p.nbq3 = Q->nb[3];
    p.nbk1 = K->nb[1]; p.nbk2 = K->nb[2]; p.nbk3 = K->nb[3];
    p.nbv1 = V->nb[1]; p.nbv2 = V->nb[2]; p.nbv3 = V->nb[3];
    p.nbm1 = mask ? mask->nb[1] : 0;
    p.nbm3 = mask ? mask->nb[3] : 0;

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    p.scale   = softcap != 0.0f ? scale / softcap : scale;
    p.softcap = softcap;
    p.n_head_log2 = 1u << (uint32_t) floorf(log2f((float) p.n_head));
    p.m0 = max_bias > 0.0f ? powf(2.0f, -max_bias / p.n_head_log2) : 1.0f;
    p.m1 = max_bias > 0.0f ? powf(2.0f, -(max_bias / 2.0f) / p.n_head_log2) : 1.0f;
    p.n_chunks = (int) ((p.n_kv + KVC_FA_CHUNK - 1) / KVC_FA_CHUNK);
    if (ggml_kvcomp_is_kvct(K->type)) {
        const ggml_tensor * pos = ggml_kvct_get_positions(dst);
        p.plans   = (const kvc_t_plan *) ggml_kvct_get_plans(dst)->data;
        p.pos     = pos ? (const int32_t *) pos->data : nullptr;
        p.pos_ne0 = pos ? pos->ne[0] : 0;
        p.pos_s0  = K->view_src ? (int64_t) (K->view_offs / K->nb[3]) : 0;
    }

    const int64_t D = Q->ne[0];
    ggml_cuda_pool_alloc<float> part(ctx.pool(), (size_t) (p.n_head*p.n_q*p.n_q3*p.n_chunks*(D + 2)));
    p.part = part.get();

    cudaStream_t stream = ctx.stream();
    switch (D) {
        case 64:  return kvc_fattn_vec_dispatch_d<64>(K->type, V->type, p, stream);
        case 128: return kvc_fattn_vec_dispatch_d<128>(K->type, V->type, p, stream);
        default:  return kvc_fattn_vec_dispatch_d<256>(K->type, V->type, p, stream);
    }
}

int ggml_cuda_kvc_supports_op(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    const int kvct = ggml_cuda_kvct_supports_op(op);
    if (kvct >= 0) {
        return kvct;
    }
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            if (!ggml_cuda_kvc_is_kvc(op->type)) {
                return -1;
            }
            return (src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16) &&
                   (src1->type == GGML_TYPE_I32 || src1->type == GGML_TYPE_I64) && op->ne[0] % QK_KVC == 0;
        case GGML_OP_GET_ROWS:
            if (!ggml_cuda_kvc_is_kvc(src0->type)) {
                return -1;
            }
            return src1->type == GGML_TYPE_I32 && (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16);
        case GGML_OP_CPY: {
            const bool from_kvc = ggml_cuda_kvc_is_kvc(src0->type);
            const bool to_kvc   = ggml_cuda_kvc_is_kvc(src1->type);
            if (!from_kvc && !to_kvc) {
                return -1;
            }
            if (src0->type == src1->type) {
                return ggml_is_contiguous(src0) && ggml_is_contiguous(src1);
            }
            const ggml_type other = from_kvc ? src1->type : src0->type;
            const ggml_tensor * q = from_kvc ? src0 : src1;
            return (other == GGML_TYPE_F32 || other == GGML_TYPE_F16) && !(from_kvc && to_kvc) &&
                   src0->ne[0] == src1->ne[0] && src0->ne[0] % QK_KVC == 0 && q->nb[0] == ggml_type_size(q->type) &&
                   ggml_nrows(src0) == ggml_nrows(src1);
        }
        case GGML_OP_MUL_MAT:
            if (!ggml_cuda_kvc_is_kvc(src0->type)) {
                return -1;
            }
            // cuBLAS on an f16 copy made by the converters above
            return src1->type == GGML_TYPE_F32 && src0->nb[0] == ggml_type_size(src0->type) && src1->nb[0] == sizeof(float);
        case GGML_OP_MUL_MAT_ID:
            return ggml_cuda_kvc_is_kvc(src0->type) ? 0 : -1;
        default:
            return -1;
    }
}
