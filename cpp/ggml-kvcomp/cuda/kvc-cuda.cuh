#pragma once

// CUDA kernels of the kvc types (block layouts in kvc-common.h). Upstream's ggml-cuda reaches
// them through the hooks below, one line each (cpp/patches/0011-cuda-kvc-hooks.patch); every
// hook returns "not mine" for ops without a kvc tensor, so upstream's own paths are untouched.

#include "ggml-cuda/common.cuh"
#include "ggml-cuda/convert.cuh"

#include "ggml-kvcomp.h"

// The kvc types with CUDA kernels: kvc5 has none yet (ggml_kvcomp_is_cpu_only). The kvct
// types have theirs apart (below), as every kernel reads them with their plans.
static inline bool ggml_cuda_kvc_is_kvc(ggml_type type) {
    return ggml_kvcomp_is_kvc(type) && !ggml_kvcomp_is_cpu_only(type);
}

// Converters for convert.cu's tables (contiguous and strided sources); nullptr for other types.
to_fp16_cuda_t    ggml_cuda_kvc_get_to_fp16(ggml_type type);
to_fp32_cuda_t    ggml_cuda_kvc_get_to_fp32(ggml_type type);
to_fp16_nc_cuda_t ggml_cuda_kvc_get_to_fp16_nc(ggml_type type);
to_fp32_nc_cuda_t ggml_cuda_kvc_get_to_fp32_nc(ggml_type type);

// SET_ROWS into a kvc tensor, GET_ROWS and CPY from or to one: false when no kvc type is involved.
bool ggml_cuda_kvc_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_kvc_get_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_kvc_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1);

// Whether the kvc vector kernel reads this FLASH_ATTN_EXT's K and V directly (so upstream needs
// no f16 copy of them), and the kernel itself: false when it does not apply.
bool ggml_cuda_kvc_fattn_vec_applies(const ggml_tensor * dst);
bool ggml_cuda_kvc_flash_attn_ext_vec(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// kvct K (kvc-kvct-cuda.cu): the vector kernel reads it with the node's plans for any number
// of queries, since no kernel of upstream can read a kvct row (fattn.cu asks this first), and
// SET_ROWS codes rows with the node's plans (false for another type).
bool ggml_cuda_kvct_fattn_applies(const ggml_tensor * dst);
bool ggml_cuda_kvct_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
// supports_op of an op with a kvct tensor (-1 for other ops): SET_ROWS and FLASH_ATTN_EXT
// with their plans, nothing else (nothing can read a kvct row without them).
int ggml_cuda_kvct_supports_op(const ggml_tensor * op);

// supports_op for ops that touch a kvc tensor: 1 or 0; -1 when the op is upstream's to judge.
int ggml_cuda_kvc_supports_op(const ggml_tensor * op);
