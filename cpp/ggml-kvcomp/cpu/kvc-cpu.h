#pragma once

// CPU kernels of the kvc types: quantization entry points and dot products against q8_0.

#include "kvc-common.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

GGML_BACKEND_API void quantize_row_kvc8(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_BACKEND_API void quantize_row_kvc5(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_BACKEND_API void quantize_row_kvc4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_BACKEND_API void quantize_row_kvc3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_BACKEND_API void quantize_row_kvc2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// The dispatching dot products use SIMD where the build has it; the _generic ones are the
// scalar reference that tests hold them to.
#define GGML_KVCOMP_DECLARE_VEC_DOT(name)                                                              \
    GGML_BACKEND_API void ggml_vec_dot_##name##_q8_0(int n, float * GGML_RESTRICT s, size_t bs,          \
            const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc); \
    GGML_BACKEND_API void ggml_vec_dot_##name##_q8_0_generic(int n, float * GGML_RESTRICT s, size_t bs,  \
            const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

GGML_KVCOMP_DECLARE_VEC_DOT(kvc8)
GGML_KVCOMP_DECLARE_VEC_DOT(kvc5)
GGML_KVCOMP_DECLARE_VEC_DOT(kvc4)
GGML_KVCOMP_DECLARE_VEC_DOT(kvc3)
GGML_KVCOMP_DECLARE_VEC_DOT(kvc2)

// One kvc row against ny query rows in q8_0 (by bytes apart): s[g] is what the type's
// vec_dot gives for row g, bit for bit, with the row decoded once for all of them (the query
// heads of a KV head in the decode kernel). ref selects the scalar reference; NULL for a type
// other than kvc. ny is at most GGML_KVC_DOT_MULTI_MAX.
#define GGML_KVC_DOT_MULTI_MAX 16
typedef void (*ggml_kvc_vec_dot_multi_t)(int n, float * GGML_RESTRICT s, const void * GGML_RESTRICT vx,
                                         const void * GGML_RESTRICT vy, size_t by, int ny);
GGML_BACKEND_API ggml_kvc_vec_dot_multi_t ggml_kvc_cpu_get_vec_dot_multi(enum ggml_type type, bool ref);

// Row dequantization for the CPU's hot loops (flash attention's V rows, casts of cache
// views): the SIMD kernels for the kvc types where the build has them, upstream's to_float
// for every other type.
GGML_BACKEND_API ggml_to_float_t ggml_kvc_cpu_get_to_float(enum ggml_type type);

struct ggml_compute_params;

// FLASH_ATTN_EXT on the CPU when it reads a kvc cache or a second, exact source
// (ggml_flash_attn_ext_add_exact), kvc-fattn.cpp: a decode kernel that splits the keys of all
// sources over the threads and reads each packed row once for all query heads of its KV head,
// and a tiled prompt kernel that dequantizes 64-key tiles (the main cells' K once for all
// blocks of query tokens) and multiplies them as upstream's tiled F16 path does.
// params->use_ref selects the scalar reference of both. Returns false, having done nothing,
// for a node that reads neither (upstream's kernels run it).
GGML_BACKEND_API bool ggml_kvc_cpu_flash_attn_ext(const struct ggml_compute_params * params, struct ggml_tensor * dst);
// Bytes such a node needs in the plan's buffer beyond upstream's FLASH_ATTN_EXT scratch, run
// on n_threads threads: the main cells' scores of every row, and a prompt's K and V tiles,
// converted once for all of its blocks of query tokens (0 for a node upstream runs).
GGML_BACKEND_API size_t ggml_kvc_cpu_flash_attn_ext_work_size(const struct ggml_tensor * dst, int n_threads);

// MUL_MAT hinted GGML_HINT_SRC0_IS_HADAMARD (upstream's rotation of Q, K and V around a
// quantized cache), kvc-fwht.c: the rows with AVX-512 where the build has it, upstream's floats
// bit for bit. Returns false, having done nothing, where it does not apply (upstream's FWHT
// runs it).
GGML_BACKEND_API bool ggml_kvc_cpu_fwht(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// SET_ROWS into a kvc cache, kvc-set-rows.c: the blocks of all rows are split over the
// threads (one new row per stream is a decode step's write). Returns false, having done
// nothing, for any other destination type. ggml_kvc_cpu_n_tasks gives such a node every
// thread and any other node `n_tasks` (upstream's count).
GGML_BACKEND_API bool ggml_kvc_cpu_set_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst);
GGML_BACKEND_API int  ggml_kvc_cpu_n_tasks(const struct ggml_tensor * node, int n_threads, int n_tasks);

// The tracker's K rows of a ubatch that makes no offset, on a host cache, as one
// GGML_OP_CUSTOM node (kvc-offset-rows.c; a ggml_custom_op_t), bit for bit the graph form:
// src: cur [ne0, n_tok] F32; c [ne0, 1, planes], each plane's offset row in the store; w
// [1, n + 1, planes], the plane's weights (1 on its c row: c is fixed; none: c is 0 and
// written so); idx [n_tok] I64, the store row each token's row goes to; the store; the
// sampled rows of cur and their rows in the tap (copied first). dst = clamp(leaky_relu(cur,
// 1), +-65504) - c of each row's plane, and the store rows take the clamped rows. Reached by
// name, "ggml_kvc_cpu_offset_rows".
GGML_BACKEND_API void ggml_kvc_cpu_offset_rows(struct ggml_tensor * dst, int ith, int nth, void * userdata);

// The CPU backend's quantizer of a type (ggml_get_type_traits_cpu's from_float: SIMD where
// the build has it, the same bytes as from_float_ref), for code that reaches the backend
// through the registry: ggml_backend_reg_get_proc_address(cpu, "ggml_kvc_cpu_get_from_float").
typedef ggml_from_float_t (*ggml_kvc_cpu_get_from_float_t)(enum ggml_type type);
GGML_BACKEND_API ggml_from_float_t ggml_kvc_cpu_get_from_float(enum ggml_type type);
// ggml_kvc_cpu_get_to_float (above) through the registry: "ggml_kvc_cpu_get_to_float"
typedef ggml_to_float_t (*ggml_kvc_cpu_get_to_float_t)(enum ggml_type type);
// ggml-cpu's get_proc_address asks here first: the entries above and ggml_cpu_fp16_to_fp32
// (SIMD, where ggml-base's ggml_fp16_to_fp32_row is scalar) by name, else NULL.
GGML_BACKEND_API void * ggml_kvc_cpu_get_proc_address(const char * name);

// Entries for ggml-cpu.c's type_traits_cpu table.
#define GGML_KVCOMP_CPU_TYPE_TRAIT(name, NAME)             \
    [GGML_TYPE_##NAME] = {                                 \
        .from_float   = quantize_row_##name,               \
        .vec_dot      = ggml_vec_dot_##name##_q8_0,        \
        .vec_dot_type = GGML_TYPE_Q8_0,                    \
        .nrows        = 1,                                 \
    }

#define GGML_KVCOMP_CPU_TYPE_TRAITS             \
    GGML_KVCOMP_CPU_TYPE_TRAIT(kvc8, KVC8),     \
    GGML_KVCOMP_CPU_TYPE_TRAIT(kvc4, KVC4),     \
    GGML_KVCOMP_CPU_TYPE_TRAIT(kvc3, KVC3),     \
    GGML_KVCOMP_CPU_TYPE_TRAIT(kvc2, KVC2),     \
    GGML_KVCOMP_CPU_TYPE_TRAIT(kvc5, KVC5)

#ifdef __cplusplus
}
#endif
