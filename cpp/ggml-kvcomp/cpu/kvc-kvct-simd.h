#pragma once

// What the CPU's kvct files share (kvc-kvct-init-cpu.c sets decoders and RoPE walks up,
// kvc-kvct-cpu.c decodes and scores rows): the instruction set they are built for, the VBMI
// decoder's magnitude table, and the walk's angle arithmetic.

#include "kvc-kvct-cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KVC_T_VBMI
#endif
#endif
// without VBMI (AVX-512 of Skylake-X and Cascade Lake included) rows are decoded 8 at a time
#if !defined(KVC_T_VBMI) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_T_AVX2
#endif

#if defined(__GNUC__)
#define KVC_T_INLINE static inline __attribute__((always_inline))
#else
#define KVC_T_INLINE static inline
#endif

#if defined(KVC_T_VBMI)
// Byte p of the magnitudes (kvc-kvct-init-cpu.c)
extern uint8_t kvc_t_vbmi_plane[4][256];
#endif

// (c, s) turned in place by the angles (tc, ts): the sum of both
static inline void kvc_t_add_angles(int32_t n, float * GGML_RESTRICT c, float * GGML_RESTRICT s, const float * GGML_RESTRICT tc,
                                    const float * GGML_RESTRICT ts) {
    for (int32_t p = 0; p < n; ++p) {
        const float cp = c[p], sp = s[p];
        c[p] = cp * tc[p] - sp * ts[p];
        s[p] = sp * tc[p] + cp * ts[p];
    }
}

// the multiple of m at or below pos
static inline int64_t kvc_t_floor_to(int64_t pos, int64_t m) {
    const int64_t r = pos % m;
    return pos - (r < 0 ? r + m : r);
}
