// Graph-level pieces of kvcomp's attention: the second K/V source of a FLASH_ATTN_EXT node
// and the op-support rule that keeps it on the backends that implement it.

#include "ggml-kvcomp.h"
#include "ggml-backend.h"

#include <string.h>

void ggml_flash_attn_ext_add_exact(struct ggml_tensor * a, struct ggml_tensor * k_exact, struct ggml_tensor * v_exact) {
    GGML_ASSERT(a->op == GGML_OP_FLASH_ATTN_EXT);
    if (!k_exact && !v_exact) {
        return;
    }
    const struct ggml_tensor * k    = a->src[1];
    const struct ggml_tensor * v    = a->src[2];
    const struct ggml_tensor * mask = a->src[3];
    GGML_ASSERT(k_exact && v_exact && "the exact K and V come together");
    GGML_ASSERT(k_exact->type == GGML_TYPE_F16 && v_exact->type == GGML_TYPE_F16);
    GGML_ASSERT(k_exact->ne[0] == k->ne[0] && k_exact->ne[2] == k->ne[2] && k_exact->ne[3] == k->ne[3]);
    GGML_ASSERT(v_exact->ne[0] == v->ne[0] && v_exact->ne[2] == v->ne[2] && v_exact->ne[3] == v->ne[3]);
    GGML_ASSERT(k_exact->ne[1] == v_exact->ne[1]);
    GGML_ASSERT(k_exact->nb[0] == ggml_type_size(GGML_TYPE_F16) && v_exact->nb[0] == ggml_type_size(GGML_TYPE_F16));
    GGML_ASSERT(mask && mask->ne[0] >= k->ne[1] + k_exact->ne[1] && "the mask covers both sources");
    a->src[GGML_KVCOMP_FA_SRC_K_EXACT] = k_exact;
    a->src[GGML_KVCOMP_FA_SRC_V_EXACT] = v_exact;
}

bool ggml_flash_attn_ext_has_exact(const struct ggml_tensor * a) {
    return a->op == GGML_OP_FLASH_ATTN_EXT && a->src[GGML_KVCOMP_FA_SRC_K_EXACT] != NULL;
}

bool ggml_kvcomp_dev_supports_op(struct ggml_backend_device * dev, const struct ggml_tensor * op) {
    if (!ggml_flash_attn_ext_has_exact(op)) {
        return true;
    }
    return ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU && strcmp(ggml_backend_dev_name(dev), "CPU") == 0;
}
