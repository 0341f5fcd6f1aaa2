#pragma once

// The residual buffer: an F16 copy of the K/V rows of recent, sink and outlier tokens,
// attended instead of their quantized rows. Every row is also written to the quantized cache,
// so a slot can be released at any time without work ("merge" = release).
//
// The cache reports n_kv_main + n_slots + n_tokens cells; attention sees
// [main cells ; slots ; rows of the current ubatch] and the mask shows each visible key once:
// exact (from a slot or from the ubatch) when the query may see it exactly, otherwise from the
// main cache. Exactness depends on positions only, so a batched prompt and token-by-token
// decoding see the same keys.

#include "kvcomp-layers.h"
#include "kvcomp-plans.h"
#include "kvcomp-storage.h"
#include "kvcomp-tracker.h"
#include "llama-kvcomp.h"
#include "llama-kv-cache.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

struct llama_cparams;
struct llama_ubatch;
class llama_io_read_i;
class llama_io_write_i;
class llm_graph_result;

// Rows a sequence keeps before its window (llama_kvcomp_buffer's slot count): a cut-back by
// that many tokens keeps every row the next query sees exactly (llama_kvcomp_seq_rm_exact).
constexpr int32_t KVCOMP_CUT_BACK = 1;

// The hooks kvcomp adds to one llama_kv_cache: the residual buffer (when any of window,
// sinks and pins is on) and the scale tracker (kvcomp-tracker.h), which may run alone.
struct llama_kvcomp_buffer {
    llama_kvcomp_buffer(const llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max,
                        std::shared_ptr<llama_kvcomp_tracker> tracker);
    ~llama_kvcomp_buffer();

    // llama_kvcomp_configure on one cache; same return codes
    static int32_t attach(llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max);

    // the types most layers have (a per-layer rule or profile gives some layers others)
    static void cache_types(const llama_kv_cache & kv, ggml_type & type_k, ggml_type & type_v);

    // told of every ubatch this cache places, before the tracker sets it up: the C API connects
    // the context's monitor here (kvcomp-monitor-source.h)
    std::function<void(const llama_kv_cache &)> on_ubatch;

    // the plans of a kvct K cache (kvcomp-plans.h), kept by every later configuration
    std::shared_ptr<llama_kvcomp_plans> plans;

    // llama_kvcomp_set_k_stats on one cache: plans for a kvct K cache from the statistics (a
    // cache of another K type is left alone); same return codes
    static int32_t set_k_stats(llama_kv_cache & kv, const std::shared_ptr<llama_kvcomp_kstats> & stats, uint32_t n_ubatch,
                               uint32_t n_seq_max);

    // Whether kv can take a ubatch: a kvct K cache needs its plans (reason logged when not).
    static bool ready(const llama_kv_cache & kv);

    // Whether a RoPE shift of the cached K rows is possible (llama_memory_can_shift): kvct rows
    // coded before RoPE only change position; rows coded after RoPE (statistics of version 1)
    // would have to be decoded, turned and coded again (not built; docs/formats.md)
    bool can_shift() const { return !plans || plans->pre_rope(); }

    // one row per layer of this cache and KV head, for the monitor
    void head_snapshots(const llama_kv_cache & kv, std::vector<llama_kvcomp_head_snapshot> & out) const;

    // cache layer ib: L2 norm per KV head of the K and V rows the slots hold
    void slot_norms(int32_t ib, std::vector<float> & k_l2, std::vector<float> & v_l2, int64_t n_head_k, int64_t n_head_v) const;

    // whether the params ask for slots at all, and whether the cache has rows they could improve
    static bool wants_slots(const llama_kvcomp_params & p) { return p.window > 0 || p.sinks > 0 || p.pin_threshold > 0.0f; }
    static bool lossy(const llama_kv_cache & kv) {
        return ggml_is_quantized(kv.layers[0].k->type) || ggml_is_quantized(kv.layers[0].v->type);
    }

    // slots per KV stream
    uint32_t n_slots() const { return n_slots_stream; }

    const llama_kvcomp_params & get_params() const { return params; }
    llama_kvcomp_stats get_stats() const;
    // the tracker's view of model layer il; false without a tracker or when il is not here
    bool get_layer_stats(int32_t il, llama_kvcomp_layer_stats & st) const;

    // attention width beyond the main cells for a ubatch of n_tokens, and its upper bound;
    // without slots, attention reads the main cache as upstream does
    uint32_t n_extra(uint32_t n_tokens) const { return buffered ? n_slots() + n_tokens : 0; }
    uint32_t n_extra_max() const { return buffered ? n_slots() + n_ubatch : 0; }

    // main cells of a get_k/get_v of width n_kv in the graph being built (after its cpy)
    uint32_t n_main(uint32_t n_kv, uint32_t kv_size, int32_t il, bool is_k) const;

    // After upstream placed the ubatch (sinfo): decide pins, release slots no query will see
    // exactly, and give a slot to every token of the ubatch that later queries see exactly.
    void apply(const llama_kv_cache & kv, const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ubatch);

    // What a graph was built for (llama_kv_cache_context::kvcomp_id): one that stores rows
    // again for the tracker differs from the next ubatch's of the same shape.
    const void * graph_id() const;

    // Writes the ubatch's rows into the main cache (returned) and into the slots (kept for
    // the get() of the same layer in the same graph); `idxs` holds main rows then slot rows.
    ggml_tensor * cpy(ggml_context * ctx, ggml_tensor * cache, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_k) const;

    // Q as attention must see it for the stored K (hook of patch 0009)
    ggml_tensor * scale_q(ggml_context * ctx, ggml_tensor * q, int32_t il) const;

    // [main view ; slots ; current ubatch], as F32, along the cell dimension.
    ggml_tensor * get(ggml_context * ctx, ggml_tensor * main_view, int32_t il, bool is_k) const;

    // Slot row of each ubatch token, in the second half of a k/v idxs input.
    void set_input_slot_idxs(int64_t * dst, const llama_kv_cache::slot_info & sinfo) const;

    // fill_main(data, n_kv_main) writes upstream's mask for the main cells; this widens it.
    void set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch,
                           const std::function<void(float *, int64_t)> & fill_main) const;

    // Context shift: the main rows (build_shift_main replaces upstream's shift of a layer's K
    // view, to put the tracker's offset back around RoPE) and the slot rows of shifted cells.
    // build_input_shift once per shift graph, then build_shift per layer.
    ggml_tensor * build_shift_main(const llama_kv_cache & kv, ggml_context * ctx, const llama_cparams & cparams,
                                   ggml_tensor * k_view, ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                   float freq_base, float freq_scale, uint32_t il) const;
    ggml_tensor * build_input_shift(const llama_kv_cache & kv, ggml_context * ctx, llm_graph_result * res);
    void set_input_shift(const llama_kv_cache & kv);
    ggml_tensor * build_shift(const llama_kv_cache & kv, ggml_context * ctx, const llama_cparams & cparams,
                              ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                              float freq_base, float freq_scale, uint32_t il) const;

    // Whether seq_rm(seq_id, p0, p1) on kv (with or without a buffer) leaves the exact copy of
    // every row that the sequence's next query sees exactly (llama_kvcomp_seq_rm_exact).
    static bool rm_keeps_exact(const llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1);

    // Split KV: a sequence copied to another stream takes that stream's slots along.
    void copy_stream(uint32_t ssrc, uint32_t sdst);

    // The buffer's part of a state: the slots of the cells upstream wrote, after them.
    void state_write(llama_io_write_i & io, const llama_kv_cache & kv, llama_seq_id seq_id) const;
    // Reads that part; `sinfos` are the cells upstream restored. Throws with a reason (and
    // removes what was restored) when the part is missing or damaged.
    void state_read(llama_io_read_i & io, llama_kv_cache & kv, llama_seq_id seq_id,
                    const llama_kv_cache::slot_info_vec_t & sinfos);

    // Applies what io read so far and checks the K/V rows upstream restored into the cells of
    // sinfos (any cache, with or without kvcomp; kvcomp-state.cpp): on a row with non-finite
    // values or codes out of range, empties what the read restored and throws the reason.
    // A reader that cannot apply early (on-device states) leaves the rows unchecked.
    static void check_restored_rows(llama_io_read_i & io, llama_kv_cache & kv, llama_seq_id seq_id,
                                    const llama_kv_cache::slot_info_vec_t & sinfos);

private:
    // state_read of a state whose kvct K rows were coded with other plans (`saved`, every
    // layer's): its restored rows (targets) decoded with those and coded with this context's
    void recode_rows(llama_io_read_i & io, llama_kv_cache & kv, const std::vector<kvc_t_plan> & saved, bool saved_pre_rope,
                     const std::vector<llama_kvcomp_tracker::restore_target> & targets);

    enum slot_kind : uint8_t {
        SLOT_KIND_FREE,
        SLOT_KIND_ROW,    // an exact row, released once no query sees it exactly
        SLOT_KIND_STAGED, // written by the last ubatch, its error not measured yet
        SLOT_KIND_PINNED, // an outlier, exact for every later query
        SLOT_KIND_SPARE,  // a released row, kept until its slot is needed: a sequence cut back
                          // behind it finds its exact row again (seq_rm + re-decode)
    };

    // The slot map of one KV stream; slot s of stream st is row st * (n_slots + 1) + s.
    struct stream_map {
        std::vector<int32_t>   slot_cell; // cell held by each slot, -1 when free
        std::vector<llama_pos> slot_pos;  // position the cell had when its row was written
        std::vector<slot_kind> slot_kinds;
        std::vector<float>     slot_err;  // measured relative error (staged and pinned slots)
        std::vector<int32_t>   cell_slot; // slot of each cell, -1 when none
        std::vector<int32_t>   cell_ub;   // column of each cell in the current ubatch, -1 when none
        // slot each cell held before the current ubatch gave it to one of its tokens, -1 when
        // none: that ubatch's queries still read the old row there (the write follows them)
        std::vector<int32_t>   cell_given;
        // per sequence: the position after its last prompt (-1: none yet), whose final token's
        // exact rows keep_prompt holds (apply_stream)
        std::vector<llama_pos> seq_anchor;

        // the slot whose row the current ubatch's attention reads for `cell`, -1 when none (a
        // slot given to one of the ubatch's tokens still holds the old row: the write follows)
        int32_t read_slot(uint32_t cell) const { return cell_slot[cell] >= 0 ? cell_slot[cell] : cell_given[cell]; }

        // the exact key the current ubatch's attention may read for `cell`: its row among the
        // ubatch's (n_slots + column), else its read_slot, -1 when none
        int32_t exact_key(uint32_t cell, uint32_t n_slots) const {
            return cell_ub[cell] >= 0 ? (int32_t) n_slots + cell_ub[cell] : read_slot(cell);
        }
    };

    bool is_exact(llama_pos key, llama_pos query, bool pinned) const;
    // whether keep_prompt holds the row at pos of sequence seq: its last prompt's final token
    // (decoded again after a cut-back by KVCOMP_CUT_BACK) reads it exactly
    bool anchored(const stream_map & m, llama_seq_id seq, llama_pos pos) const;
    ggml_tensor * shift_rows(const llama_kv_cache & kv, ggml_context * ctx, const llama_cparams & cparams, ggml_tensor * view,
                             ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors, float freq_base, float freq_scale,
                             uint32_t il) const;
    uint32_t n_rows() const { return n_slots() + 1; }
    void adopt_storage(llama_kvcomp_buffer & prev);
    void free_slot(stream_map & m, uint32_t s);
    void set_slot(stream_map & m, uint32_t s, uint32_t cell, llama_pos pos, slot_kind kind);
    // row `row` of cache layer ib's K or V to F32 (kvct K through its plans)
    void main_row_f32(const ggml_tensor * main, int32_t ib, bool is_k, uint64_t row, llama_pos pos, std::vector<uint8_t> & raw,
                      float * y) const;
    ggml_tensor * pre_rope_rows(ggml_context * ctx, ggml_tensor * cur, int32_t ib) const;
    float measure(const llama_kv_cache & kv, uint32_t strm, uint32_t s) const;
    void pin_or_free(stream_map & m, uint32_t s);
    void apply_stream(const llama_kv_cache & kv, uint32_t strm, const std::vector<uint32_t> & cells_ub,
                      const llama_ubatch & ubatch, uint32_t i0);

    llama_kvcomp_params params;
    bool     buffered;
    // whether a ubatch token may take the slot of a row only that ubatch's queries still see
    // exactly (a window held once); see the constructor for when it may not
    bool     give_away = false;
    uint32_t n_ubatch;
    uint32_t n_slots_stream;
    uint32_t pin_budget; // cells per stream
    uint64_t n_applied = 0;
    int64_t  n_merges = 0;
    int64_t  n_released = 0;
    int64_t  n_overflow = 0;
    float    evicted_err_max = 0.0f;

    std::vector<stream_map> maps;
    std::vector<uint32_t>   ub_streams; // stream of each ubatch stream plane

    std::vector<ggml_tensor *> k_buf; // per cache layer: [n_embd_k_gqa, (n_slots + 1) * n_stream] F16
    std::vector<ggml_tensor *> v_buf;
    std::vector<int32_t>       layer_of_il; // model layer -> index in k_buf/v_buf

    // per layer, from the graph being built: the slots as attention reads them (after the
    // rows the tracker stores again), the write of the ubatch's rows into them (after the
    // layer's attention on host caches, llama_kvcomp_add_exact; before it on device caches,
    // which read a copy) and the ubatch's own rows
    mutable std::vector<ggml_tensor *> k_read;
    mutable std::vector<ggml_tensor *> v_read;
    mutable std::vector<ggml_tensor *> k_written;
    mutable std::vector<ggml_tensor *> v_written;
    mutable std::vector<ggml_tensor *> k_cur;
    mutable std::vector<ggml_tensor *> v_cur;

    // I64: the slot rows of the rows the tracker stores again
    ggml_tensor * reencode_slots = nullptr;
    // I32 [n_slots + n_ubatch, streams]: the order of the exact keys (ggml_flash_attn_ext_set_exact_order)
    ggml_tensor * exact_order = nullptr;
    char graph_ids[4] = {};

    // per cache layer: a K that is not a RoPE the plans follow was reported
    mutable std::vector<bool> rope_warned;

    // per slot row: the RoPE shift of its cell, for build_shift
    ggml_tensor * shift_input = nullptr;

    // shared with the next configuration of the same cache: cached keys keep their offset
    std::shared_ptr<llama_kvcomp_tracker> tracker;

    // the slots, beside each layer's cells
    llama_kvcomp_storage storage;
};

// Hook after upstream builds a FLASH_ATTN_EXT node of graph gf (patch 0017): when its K and V
// are the main views of a buffered layer (named by llama_kvcomp_buffer::get), attaches that
// layer's exact rows as further sources of the node (ggml_flash_attn_ext_add_exact), then adds
// the write of the ubatch's rows into the slots to gf after the node, which the write names as
// a source: ggml records no write-after-read edge, and a backend that runs nodes concurrently
// must not write a slot the node still reads. Other nodes are left alone.
void llama_kvcomp_add_exact(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * fa);

// Hook in the KV cache's constructor (patch 0020), for layer il's cells on device dev: throws
// with the reason, before anything is allocated there, when dev is an rpc-server that does
// not know type_k or type_v (one without the kvcomp types would close the connection at the
// first such tensor), or when type_k is a kvct type and dev does not run kvcomp's CPU kernels
// (no other backend reads kvct rows yet: the first graph would abort on the rows' writes).
void llama_kvcomp_check_device(ggml_backend_dev_t dev, int32_t il, ggml_type type_k, ggml_type type_v);
