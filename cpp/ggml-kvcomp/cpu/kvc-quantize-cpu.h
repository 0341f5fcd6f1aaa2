#pragma once

// The CPU's sub-block quantizer of the kvc low-bit types (kvc-quantize-cpu.c): the best the
// build targets, the same bytes as kvc_quantize_sub_ref.

#include "kvc-common.h"

#ifdef __cplusplus
extern "C" {
#endif

kvc_quantize_sub_t kvc_cpu_quantize_sub(void);

#ifdef __cplusplus
}
#endif
