// SET_ROWS into a kvc cache on the CPU: the write of new K/V rows. Upstream runs the op on one
// thread (ggml_get_n_tasks), so every layer's write of a decode step, and of a prompt, is
// quantized while the other threads wait at the barrier. The kvc types' blocks are
// independent (32 values, their own step), so here the blocks of all rows are split: every
// thread quantizes an equal share, each block on one thread.

#include "kvc-cpu.h"
#include "kvc-kvct-code-cpu.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"

// blocks converted from F16 at a time (a stack buffer)
#define KVC_SET_ROWS_CHUNK 8

int ggml_kvc_cpu_n_tasks(const struct ggml_tensor * node, int n_threads, int n_tasks) {
    if (node->op != GGML_OP_SET_ROWS) {
        return n_tasks;
    }
    switch (node->type) {
        GGML_KVCOMP_ALL_TYPE_CASES:
            return n_threads;
        default:
            return n_tasks;
    }
}

// Source row r of a SET_ROWS (r over its rows, planes and batches): where it is read (*x) and
// the destination row it is written to (*y).
static void kvc_set_rows_at(const struct ggml_tensor * dst, int64_t r, const char ** x, char ** y) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];

    GGML_TENSOR_BINARY_OP_LOCALS

    const int64_t i01 = r % ne01;
    const int64_t i02 = (r / ne01) % ne02;
    const int64_t i03 = r / (ne01 * ne02);
    const char * pi = (const char *) src1->data + i01 * nb10 + (i02 % ne11) * nb11 + (i03 % ne12) * nb12;
    const int64_t i1 = src1->type == GGML_TYPE_I64 ? *(const int64_t *) pi : *(const int32_t *) pi;
    GGML_ASSERT(i1 >= 0 && i1 < ne1);
    *x = (const char *) src0->data + i01 * nb01 + i02 * nb02 + i03 * nb03;
    *y = (char *) dst->data + i1 * nb1 + i02 * nb2 + i03 * nb3;
}

// kvct rows: every head's row of every written row is one unit, coded with its head's plan.
static void kvc_set_rows_kvct(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0  = dst->src[0];
    const struct ggml_tensor * src1  = dst->src[1];
    const struct ggml_tensor * plans = ggml_kvct_get_plans(dst);
    GGML_ASSERT(plans && "kvcomp: a kvct cache is written with its plans (llama_kvcomp_set_k_stats)");

    GGML_TENSOR_BINARY_OP_LOCALS

    const kvc_t_plan * plan = (const kvc_t_plan *) plans->data;
    const int64_t n_head = kvc_t_plans_n_head(ggml_nbytes(plans));
    const int64_t d      = plan[0].d;
    GGML_ASSERT(n_head > 0 && n_head * d == ne00 && ne00 == ne0);
    GGML_ASSERT(kvc_t_type_row_bits(dst->type, d) == plan[0].row_bits);
    const size_t rs = ggml_row_size(dst->type, d);

    const int64_t nr    = ne01 * ne02 * ne03;
    const int64_t n_all = nr * n_head;
    const int64_t u0 = n_all * params->ith / params->nth;
    const int64_t u1 = n_all * (params->ith + 1) / params->nth;
    float buf[KVC_T_MAX_D];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t h = u % n_head;
        const char * x;
        char       * y;
        kvc_set_rows_at(dst, u / n_head, &x, &y);
        if (src0->type == GGML_TYPE_F32) {
            kvc_t_quantize_row(&plan[h], (const float *) x + h * d, (uint8_t *) y + h * rs);
        } else {
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x + h * d, buf, d);
            kvc_t_quantize_row(&plan[h], buf, (uint8_t *) y + h * rs);
        }
    }
}

bool ggml_kvc_cpu_set_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    if (ggml_kvcomp_is_kvct(dst->type)) {
        GGML_ASSERT((src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16) &&
                    (src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32));
        kvc_set_rows_kvct(params, dst);
        return true;
    }
    switch (dst->type) {
        GGML_KVCOMP_TYPE_CASES:
            break;
        default:
            return false;
    }
    if ((src0->type != GGML_TYPE_F32 && src0->type != GGML_TYPE_F16) ||
        (src1->type != GGML_TYPE_I64 && src1->type != GGML_TYPE_I32)) {
        return false;
    }

    GGML_TENSOR_BINARY_OP_LOCALS

    GGML_ASSERT(ne00 == ne0 && ne00 % QK_KVC == 0);
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(dst->type)->from_float;
    const int64_t nblk = ne00 / QK_KVC;
    const int64_t nr   = ne01 * ne02 * ne03;
    const size_t  bs   = ggml_type_size(dst->type);

    // this thread's share of the blocks of all rows, row by row
    const int64_t n_all = nr * nblk;
    const int64_t b0 = n_all * params->ith / params->nth;
    const int64_t b1 = n_all * (params->ith + 1) / params->nth;
    for (int64_t b = b0; b < b1;) {
        const int64_t j0 = b % nblk;
        const int64_t j1 = MIN(nblk, j0 + (b1 - b));
        const char * x;
        char       * y;
        kvc_set_rows_at(dst, b / nblk, &x, &y);
        if (src0->type == GGML_TYPE_F32) {
            from_float((const float *) x + j0 * QK_KVC, y + j0 * bs, (j1 - j0) * QK_KVC);
        } else {
            float buf[KVC_SET_ROWS_CHUNK * QK_KVC];
            for (int64_t j = j0; j < j1; j += KVC_SET_ROWS_CHUNK) {
                const int64_t n = MIN(KVC_SET_ROWS_CHUNK, j1 - j) * QK_KVC;
                ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x + j * QK_KVC, buf, n);
                from_float(buf, y + j * bs, n);
            }
        }
        b += j1 - j0;
    }
    return true;
}
