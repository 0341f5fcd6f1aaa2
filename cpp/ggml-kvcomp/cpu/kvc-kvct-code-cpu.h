#pragma once

// Coding kvct rows on the CPU (kvc-kvct-code-cpu.c): the bytes of quantize_row_kvct_ref, its
// row scale's search vectorized where the build has AVX-512 or AVX2. Internal to the CPU
// backend.

#include "kvc-transform.h"

#ifdef __cplusplus
extern "C" {
#endif

void kvc_t_quantize_row(const kvc_t_plan * plan, const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y);

#ifdef __cplusplus
}
#endif
