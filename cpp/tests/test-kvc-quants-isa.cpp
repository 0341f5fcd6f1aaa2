// The kvc low-bit quantizers' CPU search (kvc-quantize-cpu.c) built at one x86 level (KVC_ISA:
// portable, AVX2, AVX-512), so that each of its paths is held to the reference's bytes on a
// machine whose own build takes another: kvc5, kvc4, kvc3 and kvc2 over quantizer_inputs().

#include "kvc-test-quants.h"
#include "kvc-quantize-cpu.h"

#include <cstring>

using namespace kvc_test;

int main() {
    if (!cpu_has_isa_level(KVC_ISA_LEVEL)) {
        printf("test-kvc-quants-isa: %s cannot run on this CPU, skipped\n", KVC_ISA);
        return 77;
    }
    report rep;
    const kvc_quantize_sub_t sub = kvc_cpu_quantize_sub();
    rep.check((sub == kvc_quantize_sub_ref) == (KVC_ISA_LEVEL == 0),
        "%s: the search is %s", KVC_ISA, sub == kvc_quantize_sub_ref ? "the scalar reference" : "a SIMD one");
    const int n = 256;
    const std::vector<float> x = quantizer_inputs(n);
    for (ggml_type t : { GGML_TYPE_KVC5, GGML_TYPE_KVC4, GGML_TYPE_KVC3, GGML_TYPE_KVC2 }) {
        std::vector<uint8_t> ref(ggml_row_size(t, (int64_t) x.size()));
        std::vector<uint8_t> got(ref.size(), 0xAA);
        ggml_get_type_traits(t)->from_float_ref(x.data(), ref.data(), (int64_t) x.size());
        kvc_quantize_row_lowbit(t, x.data(), got.data(), (int64_t) x.size(), sub);
        rep.check(std::memcmp(ref.data(), got.data(), ref.size()) == 0, "%s: %s quantization writes the reference's bytes (%zu values)",
            KVC_ISA, ggml_type_name(t), x.size());
    }
    return rep.finish("test-kvc-quants-isa");
}
