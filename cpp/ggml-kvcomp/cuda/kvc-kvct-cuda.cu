// SET_ROWS into a kvct cache on the GPU: each KV head's row coded with its plan as
// quantize_row_kvct_ref codes it (kvc-transform.c). One warp per head's row: its lanes take
// the row's pairs to the plan's coefficients, then the 21 candidate row scales of the search
// one per lane, and the best one codes the row. Products and sums are rounded one by one
// (no contraction into FMAs), as the reference computes them, so that the search compares
// the same errors; cpp/tests/test-kvc-backend.cpp checks the rows against the CPU's.

#include "kvc-cuda.cuh"
#include "kvc-kvct-cuda.cuh"

namespace {

constexpr int KVCT_Q_WARPS = 4;

static_assert(KVC_T_SEARCH_DOWN + KVC_T_SEARCH_UP + 1 <= WARP_SIZE, "a lane per candidate scale");

// the index of the level of b bits nearest to v (ties go down), as kvc_t_nearest finds it
__device__ __forceinline__ int kvct_nearest(const float * mids, int b, float v) {
    const float * t = mids + kvct_mids_at(b);
    int lo = 0;
    for (int step = 1 << (b - 1); step > 0; step >>= 1) {
        lo += v > t[lo + step - 1] ? step : 0;
    }
    return lo;
}

// the squared error in K's units of coding u (in units of sigma) at scale code e, added in
// double in coefficient order (kvc_t_row_error)
static __device__ double kvct_row_error(const kvc_t_plan * plan, const float * u, const float * lv, const float * mids, int d,
                                 uint8_t e) {
    const float s   = kvc_step(e);
    const float inv = __fdiv_rn(1.0f, s);
    double err = 0.0;
    for (int j = 0; j < d; ++j) {
        const int b = plan->bits[j];
        float r = u[j];
        if (b > 0) {
            const int code = kvct_nearest(mids, b, __fmul_rn(u[j], inv));
            r = __fsub_rn(u[j], __fmul_rn(s, lv[kvct_levels_at(b) + code]));
        }
        const double sg = (double) plan->sigma[j];
        err = __dadd_rn(err, __dmul_rn(__dmul_rn(__dmul_rn(sg, sg), (double) r), (double) r));
    }
    return err;
}

// the row scale's code nearest to s in the log domain (kvc_t_scale_code)
__device__ __forceinline__ int kvct_scale_code(float s) {
    if (!(s > 0.0f)) {
        return 0;
    }
    const float e = roundf(8.0f * log2f(s)) + 160.0f;
    return e < 1.0f ? 1 : e > (float) KVC_E8_MAX ? KVC_E8_MAX : (int) e;
}

template <typename src_t, typename rows_t>
__global__ void __launch_bounds__(KVCT_Q_WARPS*WARP_SIZE) k_kvct_rows_from_float(
        const char * __restrict__ src, char * __restrict__ dst, const kvc_t_plan * __restrict__ plans, int64_t n_head,
        int64_t n_rows, size_t row_size, const rows_t rows) {
    __shared__ float   lv[KVCT_N_LEVELS];
    __shared__ float   mids[KVCT_N_MIDS];
    __shared__ float   u_s[KVCT_Q_WARPS][KVC_T_MAX_D];
    __shared__ uint8_t codes_s[KVCT_Q_WARPS][KVC_T_MAX_D];
    for (int i = threadIdx.x; i < KVCT_N_LEVELS; i += blockDim.x) {
        lv[i] = kvct_levels_dev[i];
    }
    for (int i = threadIdx.x; i < KVCT_N_MIDS; i += blockDim.x) {
        mids[i] = kvct_mids_dev[i];
    }
    __syncthreads();

    const int     lane = threadIdx.x % WARP_SIZE;
    const int     warp = threadIdx.x / WARP_SIZE;
    const int64_t unit = (int64_t) blockIdx.x*KVCT_Q_WARPS + warp;
    if (unit >= n_rows*n_head) {
        return;
    }
    const int64_t r = unit / n_head;
    const int64_t h = unit % n_head;
    const kvc_t_plan * plan = plans + h;
    const int d = plan->d;
    const src_t * x = (const src_t *) (src + rows.src(r)) + h*d;
    uint8_t     * y = (uint8_t *) (dst + rows.dst(r)) + h*row_size;
    float   * u     = u_s[warp];
    uint8_t * codes = codes_s[warp];

    // y = T (x - mean) in units of sigma, a non-finite value taken as its channel's mean
    for (int p = lane; p < d/2; p += WARP_SIZE) {
        const int   a  = plan->pair[p][0], b = plan->pair[p][1];
        const float c  = plan->rot[p][0], s = plan->rot[p][1];
        const float va = ggml_cuda_cast<float>(x[a]);
        const float vb = ggml_cuda_cast<float>(x[b]);
        const float xa = __fsub_rn(isfinite(va) ? va : plan->mean[a], plan->mean[a]);
        const float xb = __fsub_rn(isfinite(vb) ? vb : plan->mean[b], plan->mean[b]);
        u[a] = __fdiv_rn(__fadd_rn(__fmul_rn(c, xa), __fmul_rn(s, xb)), plan->sigma[a]);
        u[b] = __fdiv_rn(__fadd_rn(__fmul_rn(-s, xa), __fmul_rn(c, xb)), plan->sigma[b]);
    }
    __syncwarp();

    // the search starts at the RMS of the coded coefficients (summed in the reference's order)
    int e0 = 0;
    if (lane == 0) {
        double ss = 0.0;
        int    n  = 0;
        for (int j = 0; j < d; ++j) {
            if (plan->bits[j] > 0) {
                ss = __dadd_rn(ss, __dmul_rn((double) u[j], (double) u[j]));
                ++n;
            }
        }
        e0 = kvct_scale_code(n > 0 ? (float) sqrt(ss / n) : 0.0f);
    }
    e0 = __shfl_sync(0xffffffff, e0, 0);

    // lane i tries code e0 - KVC_T_SEARCH_DOWN + i; the least error wins, ties to e0, then to
    // the smaller code (the reference's order of trial)
    const int cand  = e0 - KVC_T_SEARCH_DOWN + lane;
    const bool valid = e0 > 0 && lane <= KVC_T_SEARCH_DOWN + KVC_T_SEARCH_UP && cand >= 1 && cand <= KVC_E8_MAX;
    double err  = valid ? kvct_row_error(plan, u, lv, mids, d, (uint8_t) cand) : INFINITY;
    int    rank = cand == e0 ? -1 : cand;
    int    best = cand;
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        const double e2 = __shfl_xor_sync(0xffffffff, err, off);
        const int    r2 = __shfl_xor_sync(0xffffffff, rank, off);
        const int    b2 = __shfl_xor_sync(0xffffffff, best, off);
        if (e2 < err || (e2 == err && r2 < rank)) {
            err  = e2;
            rank = r2;
            best = b2;
        }
    }
    const int e = e0 > 0 ? best : 0;

    // row_bits is 8 x the type's row size (kvc_t_type_row_bits)
    const int n_bytes = (int) row_size;
    if (e == 0) {
        for (int i = lane; i < n_bytes; i += WARP_SIZE) {
            y[i] = 0;
        }
        return;
    }
    const float inv = __fdiv_rn(1.0f, kvc_step((uint8_t) e));
    for (int j = lane; j < d; j += WARP_SIZE) {
        const int b = plan->bits[j];
        codes[j] = b > 0 ? (uint8_t) kvct_nearest(mids, b, __fmul_rn(u[j], inv)) : 0;
    }
    __syncwarp();

    // the scale's byte, then the codes' bits one after the other (kvc_t_row_pack_codes)
    if (lane == 0) {
        uint8_t * out = y;
        uint32_t  acc = (uint32_t) e;
        int       n   = 8;
        for (int j = 0; j < d; ++j) {
            const int b = plan->bits[j];
            if (b == 0) {
                continue;
            }
            acc |= (uint32_t) codes[j] << n;
            n += b;
            for (; n >= 8; n -= 8) {
                *out++ = (uint8_t) acc;
                acc >>= 8;
            }
        }
        if (n > 0) {
            *out++ = (uint8_t) acc;
        }
        for (; out < y + n_bytes; ++out) {
            *out = 0;
        }
    }
}

} // namespace

bool ggml_cuda_kvct_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!ggml_kvcomp_is_kvct(dst->type)) {
        return false;
    }
    const ggml_tensor * src0  = dst->src[0];
    const ggml_tensor * src1  = dst->src[1];
    const ggml_tensor * plans = ggml_kvct_get_plans(dst);
    GGML_ASSERT(plans && "kvcomp: a kvct cache is written with its plans (llama_kvcomp_set_k_stats)");
    GGML_TENSOR_BINARY_OP_LOCALS

    const int64_t n_head = kvc_t_plans_n_head(ggml_nbytes(plans));
    GGML_ASSERT(n_head > 0 && ne00 % n_head == 0 && ne00 == ne0);
    const int64_t d = ne00 / n_head;
    GGML_ASSERT(kvc_t_type_row_bits(dst->type, d) > 0);
    const int64_t n_rows = ne01*ne02*ne03;
    if (n_rows == 0) {
        return true;
    }
    const size_t row_size = ggml_row_size(dst->type, d);
    const int n_blocks = (int) ((n_rows*n_head + KVCT_Q_WARPS - 1) / KVCT_Q_WARPS);

    auto run = [&](auto idx, auto val) {
        const auto rows = kvc_rows_scattered_of<decltype(idx)>(dst);
        k_kvct_rows_from_float<decltype(val)><<<n_blocks, KVCT_Q_WARPS*WARP_SIZE, 0, ctx.stream()>>>(
            (const char *) src0->data, (char *) dst->data, (const kvc_t_plan *) plans->data, n_head, n_rows, row_size, rows);
    };
    const bool i64 = src1->type == GGML_TYPE_I64;
    if (src0->type == GGML_TYPE_F16) {
        i64 ? run(int64_t(), half()) : run(int32_t(), half());
    } else {
        i64 ? run(int64_t(), float()) : run(int32_t(), float());
    }
    return true;
}

int ggml_cuda_kvct_supports_op(const ggml_tensor * op) {
    bool kvct = ggml_kvcomp_is_kvct(op->type);
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        kvct |= op->src[i] && ggml_kvcomp_is_kvct(op->src[i]->type);
    }
    if (!kvct) {
        return -1;
    }
    switch (op->op) {
        case GGML_OP_SET_ROWS: {
            const ggml_tensor * plans = ggml_kvct_get_plans(op);
            const int64_t n_head = plans ? kvc_t_plans_n_head(ggml_nbytes(plans)) : 0;
            return ggml_kvcomp_is_kvct(op->type) && n_head > 0 && op->ne[0] % n_head == 0 &&
                   kvc_t_type_row_bits(op->type, op->ne[0] / n_head) > 0 &&
                   (op->src[0]->type == GGML_TYPE_F32 || op->src[0]->type == GGML_TYPE_F16) &&
                   op->src[0]->nb[0] == ggml_type_size(op->src[0]->type) &&
                   (op->src[1]->type == GGML_TYPE_I32 || op->src[1]->type == GGML_TYPE_I64);
        }
        case GGML_OP_FLASH_ATTN_EXT:
            return ggml_cuda_kvc_fattn_vec_applies(op);
        default:
            // without its plans no kernel can read or write a kvct row (as on the CPU)
            return 0;
    }
}
