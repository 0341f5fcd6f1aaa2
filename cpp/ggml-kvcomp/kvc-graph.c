// Graph-level pieces of kvcomp's attention: the second K/V source of a FLASH_ATTN_EXT node
// and the op-support rule that keeps it on the backends that implement it.

#include "ggml-kvcomp.h"
#include "ggml-backend.h"


// One exact part: F16 rows (F32 also for the ubatch's, read as their F16 rounding) with the
// main pair's head size, KV heads and streams.
static void kvc_check_exact(const struct ggml_tensor * main, const struct ggml_tensor * part, bool f32_ok) {
    GGML_ASSERT((part->type == GGML_TYPE_F16 || (f32_ok && part->type == GGML_TYPE_F32)) &&
                part->nb[0] == ggml_type_size(part->type));
    GGML_ASSERT(part->ne[0] == main->ne[0] && part->ne[2] == main->ne[2] && part->ne[3] == main->ne[3]);
}

void ggml_flash_attn_ext_add_exact(struct ggml_tensor * a, struct ggml_tensor * k_exact, struct ggml_tensor * v_exact,
                                   struct ggml_tensor * k_ubatch, struct ggml_tensor * v_ubatch) {
    GGML_ASSERT(a->op == GGML_OP_FLASH_ATTN_EXT);
    const struct ggml_tensor * k    = a->src[1];
    const struct ggml_tensor * v    = a->src[2];
    const struct ggml_tensor * mask = a->src[3];
    GGML_ASSERT(k_exact && v_exact && "the exact K and V come together");
    GGML_ASSERT(!k_ubatch == !v_ubatch && "the ubatch's K and V come together");
    kvc_check_exact(k, k_exact, false);
    kvc_check_exact(v, v_exact, false);
    GGML_ASSERT(k_exact->ne[1] == v_exact->ne[1]);
    int64_t n_keys = k->ne[1] + k_exact->ne[1];
    if (k_ubatch) {
        kvc_check_exact(k, k_ubatch, true);
        kvc_check_exact(v, v_ubatch, true);
        GGML_ASSERT(k_ubatch->ne[1] == v_ubatch->ne[1]);
        n_keys += k_ubatch->ne[1];
    }
    GGML_ASSERT(mask && mask->ne[0] >= n_keys && "the mask covers every source");
    a->src[GGML_KVCOMP_FA_SRC_K_EXACT]  = k_exact;
    a->src[GGML_KVCOMP_FA_SRC_V_EXACT]  = v_exact;
    a->src[GGML_KVCOMP_FA_SRC_K_UBATCH] = k_ubatch;
    a->src[GGML_KVCOMP_FA_SRC_V_UBATCH] = v_ubatch;
}

void ggml_flash_attn_ext_set_exact_order(struct ggml_tensor * a, struct ggml_tensor * order) {
    struct ggml_tensor * ke = a->src[GGML_KVCOMP_FA_SRC_K_EXACT];
    GGML_ASSERT(ke && ke->view_src && "the order goes with the node's exact keys");
    GGML_ASSERT(order->type == GGML_TYPE_I32 && ggml_is_contiguous(order));
    // a view's computation reads nothing: the source only puts the order in the graph
    GGML_ASSERT(!ke->src[1] || ke->src[1] == order);
    ke->src[1] = order;
}

const struct ggml_tensor * ggml_flash_attn_ext_get_exact_order(const struct ggml_tensor * a) {
    const struct ggml_tensor * ke = a->src[GGML_KVCOMP_FA_SRC_K_EXACT];
    return ke && ke->view_src ? ke->src[1] : NULL;
}

bool ggml_flash_attn_ext_has_exact(const struct ggml_tensor * a) {
    return a->op == GGML_OP_FLASH_ATTN_EXT && a->src[GGML_KVCOMP_FA_SRC_K_EXACT] != NULL;
}

static int ggml_kvct_plans_src(const struct ggml_tensor * node) {
    switch (node->op) {
        case GGML_OP_SET_ROWS:        return GGML_KVCOMP_SET_ROWS_SRC_PLANS;
        case GGML_OP_FLASH_ATTN_EXT:  return GGML_KVCOMP_FA_SRC_K_PLANS;
        default:                      return -1;
    }
}

void ggml_kvct_set_plans(struct ggml_tensor * node, struct ggml_tensor * plans) {
    const int is = ggml_kvct_plans_src(node);
    GGML_ASSERT(is >= 0 && "kvct plans go to the SET_ROWS or FLASH_ATTN_EXT node of a kvct cache");
    const struct ggml_tensor * rows = node->op == GGML_OP_SET_ROWS ? node : node->src[1];
    GGML_ASSERT(ggml_kvcomp_is_kvct(rows->type) && "only kvct rows have plans");
    GGML_ASSERT(plans->type == GGML_TYPE_I8 && ggml_is_contiguous(plans) && ggml_nelements(plans) == plans->ne[0]);
    node->src[is] = plans;
}

const struct ggml_tensor * ggml_kvct_get_plans(const struct ggml_tensor * node) {
    const int is = ggml_kvct_plans_src(node);
    return is >= 0 ? node->src[is] : NULL;
}

struct ggml_tensor * ggml_kvct_plans_view(struct ggml_context * ctx, struct ggml_tensor * plans, struct ggml_tensor * positions) {
    struct ggml_tensor * v = ggml_view_1d(ctx, plans, plans->ne[0], 0);
    if (positions) {
        GGML_ASSERT(positions->type == GGML_TYPE_I32 && ggml_is_contiguous(positions));
        // a view's computation reads nothing: the source only puts the positions in the graph
        v->src[1] = positions;
    }
    return v;
}

const struct ggml_tensor * ggml_kvct_get_positions(const struct ggml_tensor * node) {
    const struct ggml_tensor * plans = ggml_kvct_get_plans(node);
    return plans && plans->op == GGML_OP_VIEW ? plans->src[1] : NULL;
}

bool ggml_kvcomp_dev_supports_op(struct ggml_backend_device * dev, const struct ggml_tensor * op) {
    if (!ggml_kvcomp_dev_knows(dev, op)) {
        return false;
    }
    bool cpu_only = ggml_kvcomp_is_cpu_only(op->type);
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        cpu_only |= op->src[i] && ggml_kvcomp_is_cpu_only(op->src[i]->type);
    }
    if (!ggml_flash_attn_ext_has_exact(op) && !cpu_only) {
        return true;
    }
    return ggml_kvcomp_dev_cpu_kernels(dev);
}
