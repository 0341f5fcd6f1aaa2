#pragma once

// kvcomp KV-cache tensor types: the public API.
// Block layouts are in kvc-common.h, the formats are described in docs/formats.md.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// The kvc types: GGML_TYPE_KVC8 .. GGML_TYPE_KVC2, and GGML_TYPE_KVC5, added after the kvct
// types (a type's number never changes: an rpc-server knows the types below the count it
// says, and state files name their types by number).
#define GGML_KVCOMP_TYPE_FIRST GGML_TYPE_KVC8
#define GGML_KVCOMP_TYPE_LAST  GGML_TYPE_KVC2

static inline bool ggml_kvcomp_is_kvc(enum ggml_type t) {
    return (t >= GGML_KVCOMP_TYPE_FIRST && t <= GGML_KVCOMP_TYPE_LAST) || t == GGML_TYPE_KVC5;
}

// The transform-coded K types (docs/formats.md, "kvct"), GGML_TYPE_KVCT4 .. GGML_TYPE_KVCT5:
// a row is one KV head's d values coded with a plan of that layer and head, so no kernel can
// read or write one without the plans. A node that does (SET_ROWS into such a cache, the
// FLASH_ATTN_EXT that reads it) carries them as a source (ggml_kvct_set_plans): an I8 tensor
// of one kvc_t_plan (kvc-transform.h) per KV head and the layer's kvc_t_rope. The CPU
// backend runs such nodes, and the CUDA backend has kernels for them (not yet run on a GPU,
// so a kvct cache is not placed on one: llama_kvcomp_check_device).
#define GGML_KVCOMP_KVCT_FIRST GGML_TYPE_KVCT4
#define GGML_KVCOMP_KVCT_LAST  GGML_TYPE_KVCT5

static inline bool ggml_kvcomp_is_kvct(enum ggml_type t) {
    return t >= GGML_KVCOMP_KVCT_FIRST && t <= GGML_KVCOMP_KVCT_LAST;
}

// Types whose kernels exist for the CPU backend only (kvc5): a cache of one lives in
// host memory, or on an rpc-server of this build.
static inline bool ggml_kvcomp_is_cpu_only(enum ggml_type t) {
    return t == GGML_TYPE_KVC5;
}

// Returns GGML_TYPE_COUNT when the name is not a kvc or kvct type.
GGML_API enum ggml_type ggml_kvcomp_type_from_name(const char * name);

// Two-source attention. A FLASH_ATTN_EXT node may read exact F16 rows beside its main K/V
// (the residual buffer's rows beside the quantized cells) under one online softmax and one
// mask. The exact rows come in two parts, read where they lie: the buffer's slots and the
// current ubatch's own rows (optional). Keys are numbered main cells first, then slots, then
// ubatch rows, and the mask has a column for each (mask->ne[0] >= their sum; a worst-case
// graph may have more). Each part has the main pair's head size, KV heads and streams and
// shares its permutation. The slots are F16; the ubatch's rows are F16 or F32, and F32 rows
// are read as their F16 rounding (what the slots keep of them), so the graph needs no cast.
// Set like the sinks, in these sources of the node:
#define GGML_KVCOMP_FA_SRC_K_EXACT  5
#define GGML_KVCOMP_FA_SRC_V_EXACT  6
#define GGML_KVCOMP_FA_SRC_K_UBATCH 7
#define GGML_KVCOMP_FA_SRC_V_UBATCH 8
// the K plans of a FLASH_ATTN_EXT node, and of a SET_ROWS node, when K is a kvct type
#define GGML_KVCOMP_FA_SRC_K_PLANS    9
#define GGML_KVCOMP_SET_ROWS_SRC_PLANS 2

GGML_API void ggml_flash_attn_ext_add_exact(struct ggml_tensor * a, struct ggml_tensor * k_exact, struct ggml_tensor * v_exact,
                                            struct ggml_tensor * k_ubatch, struct ggml_tensor * v_ubatch);

// The order in which the node takes its exact keys: I32 [>= slots + ubatch rows, streams], per
// stream the keys (0 .. slots - 1: slots, then the ubatch's rows) in the order of the cells they
// hold, -1 after the last. A key's turn then does not depend on whether it lies in a slot (a
// decode step) or among the ubatch's rows (a prompt). Without one, slots then ubatch rows.
// Carried by the node's exact K (a view there): the node has no source left.
GGML_API void ggml_flash_attn_ext_set_exact_order(struct ggml_tensor * a, struct ggml_tensor * order);
GGML_API const struct ggml_tensor * ggml_flash_attn_ext_get_exact_order(const struct ggml_tensor * a);

// Whether a FLASH_ATTN_EXT node reads a second source (above).
GGML_API bool ggml_flash_attn_ext_has_exact(const struct ggml_tensor * a);

// Gives a SET_ROWS node that writes a kvct cache, or a FLASH_ATTN_EXT node that reads one as
// K, the plans of its rows ([n_head_kv * sizeof(kvc_t_plan) + sizeof(kvc_t_rope)] I8); and
// reads them back (NULL when the node has none).
GGML_API void ggml_kvct_set_plans(struct ggml_tensor * node, struct ggml_tensor * plans);
GGML_API const struct ggml_tensor * ggml_kvct_get_plans(const struct ggml_tensor * node);

// Rows coded before RoPE (the plans' kvc_t_rope turns pairs) are turned to their keys'
// positions when attention reads them: the FLASH_ATTN_EXT node's plans are then a view of
// the plans that carries the positions of the cache's cells (I32 [cells, streams], the view
// of K telling its first stream). Positions NULL: a plain view.
GGML_API struct ggml_tensor * ggml_kvct_plans_view(struct ggml_context * ctx, struct ggml_tensor * plans, struct ggml_tensor * positions);
GGML_API const struct ggml_tensor * ggml_kvct_get_positions(const struct ggml_tensor * node);

// The op-support query's kvcomp rule, asked before a device's own answer: a node with a
// second attention source or with kvct plans runs only where its kernel is (the CPU
// backend, here or behind an rpc-server of this build), since a backend that does not know
// the sources would silently attend the main cells alone, and one that does not know the
// plans cannot read the rows; and no node goes to an rpc-server that does not know one of
// its types.
struct ggml_backend_device;
struct ggml_backend;
struct ggml_backend_buffer;
GGML_API bool ggml_kvcomp_dev_supports_op(struct ggml_backend_device * dev, const struct ggml_tensor * op);

// kvcomp over ggml-rpc (kvc-rpc.cpp, docs/distributed.md). A server of this build answers a
// client's HELLO with the number of ggml types it knows (bits 0-6 of the byte upstream
// leaves 0) and GGML_KVCOMP_RPC_CPU_KERNELS when every device it serves is the CPU backend.
#define GGML_KVCOMP_RPC_CPU_KERNELS 0x80
// the server's byte (GGML_KVCOMP_RPC_CAPS in the environment replaces it, for tests)
GGML_API uint8_t ggml_kvcomp_rpc_server_caps(struct ggml_backend ** backends, size_t n);
// the client keeps what the server at endpoint said
GGML_API void    ggml_kvcomp_rpc_set_caps(const char * endpoint, uint8_t caps);
// whether a device can hold t and its sources (a type), as every device can but an
// rpc-server that does not know them (one that does not say knows upstream's types only)
GGML_API bool    ggml_kvcomp_dev_knows(struct ggml_backend_device * dev, const struct ggml_tensor * t);
GGML_API bool    ggml_kvcomp_dev_knows_type(struct ggml_backend_device * dev, enum ggml_type type);
// whether the server at endpoint knows the types of t and of its sources (ggml-rpc asks
// before it sends t to learn its size: an upstream server would close the connection; patch
// 0020). Upstream's fit step sizes a cache kept here (--no-kv-offload) that way too.
GGML_API bool    ggml_kvcomp_rpc_knows(const char * endpoint, const struct ggml_tensor * t);
// whether kvcomp's CPU kernels run a device's nodes (the CPU backend, or an rpc-server of
// this build on it), and a buffer's (host memory, or such a device's)
GGML_API bool    ggml_kvcomp_dev_cpu_kernels(struct ggml_backend_device * dev);
GGML_API bool    ggml_kvcomp_buffer_cpu_kernels(struct ggml_backend_buffer * buf);
// A server whose connection fails (it stopped, crashed or closed it) is lost: ggml-rpc sends
// it nothing more and hands back zeros for what it asked (output: the reply's buffer), and
// every graph computed afterwards fails (llama_decode returns -3), in place of upstream's
// abort of the whole process. A lost server stays lost for the process's lifetime.
// ggml_kvcomp_rpc_any_lost, asked after a graph is computed, waits for every connected
// server to finish it (one round trip each), so the graph during which one died fails too.
GGML_API void    ggml_kvcomp_rpc_lost(const char * endpoint, void * output, size_t output_size);
GGML_API bool    ggml_kvcomp_rpc_any_lost(void);
// A server that stops answering without closing its connection (stopped, hung, or cut off
// by the network) is lost once a reply, or the sending of a command, has waited
// GGML_KVCOMP_RPC_TIMEOUT seconds (0: without limit); ggml-rpc applies it to each connection
// it opens. A reply waits behind the graph the server computes, so the limit must exceed the
// longest graph. A server that cannot be reached at all has no devices: --rpc fails with
// its name rather than aborting (patch 0021).
#define GGML_KVCOMP_RPC_TIMEOUT_DEFAULT 300
GGML_API void    ggml_kvcomp_rpc_client_socket(uintptr_t fd);
GGML_API void    ggml_kvcomp_rpc_unreachable(const char * endpoint);

#ifdef __cplusplus
}
#endif
