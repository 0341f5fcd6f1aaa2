#pragma once

// The scale tracker: range statistics of the K/V rows a cache receives, per layer, KV head and
// channel, and the K offset they yield (docs/design-tracker-modes.md).
//
// A key offset shared by every key of a layer does not change attention (softmax cancels
// q·c), so the cache stores k - c and nothing reads it back. c must be the same for every
// key a query sees, and what a sequence computes must not depend on other requests: each KV
// stream has its own c, the mean of the K rows at the first KVCOMP_CALIB_ROWS positions of
// the sequence that started the stream, whatever ubatches brought them (0 in a stream that
// several sequences share, a unified cache's). Until those rows are
// all there the stream stores k as it comes (c = 0) and keeps a copy of them; the ubatch that
// completes them sets c in its graph and stores the earlier rows again as k - c
// (docs/design-tracker-modes.md, "Isolation").

#include "kvcomp-storage.h"
#include "kvcomp-window.h"
#include "llama-kvcomp.h"
#include "llama-kv-cache.h"
#include "llama-kv-cells.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

// A function of the CPU backend by name (cpp/ggml-kvcomp/cpu/kvc-cpu.h,
// ggml_kvc_cpu_get_proc_address), nullptr without one.
void * llama_kvcomp_cpu_proc(const char * name);

class llama_io_read_i;
class llama_io_write_i;
struct llama_ubatch;

struct llama_kvcomp_tracker {
    // a cache layer: its K and V tensors ([n_embd, cells, streams]) and head sizes
    struct layer_desc {
        ggml_tensor * k;
        ggml_tensor * v;
        int32_t il;
        int64_t n_embd_head_k;
        int64_t n_embd_head_v;
    };

    // n_stream: the cache's KV streams, n_ubatch: the most tokens a ubatch holds, shared_streams:
    // whether a stream holds several sequences (a unified cache serving more than one), whose
    // keys then stay without an offset: one c per stream would be the first sequence's, and
    // every other sequence's answers would depend on which one that was
    llama_kvcomp_tracker(const std::vector<layer_desc> & descs, const llama_kvcomp_params & params, uint32_t n_stream,
                         uint32_t n_ubatch, bool shared_streams);
    ~llama_kvcomp_tracker();

    void set_params(const llama_kvcomp_params & p) { params = p; }

    // Graph side, in the cache's cpy hook: samples K rows into the tap and returns cur - c of
    // each row's stream (cur itself for V).
    ggml_tensor * transform(ggml_context * ctx, ggml_tensor * cur, int32_t ib, bool is_k) const;

    // The rows of earlier ubatches that the graph being built stores again under the offset it
    // sets ([n_embd_k, n_reencode()], after transform() of the same layer; nullptr when none),
    // and the main rows (stream * cells + cell) they go to, as an I64 view and on the host.
    ggml_tensor * reencoded(int32_t ib) const;
    ggml_tensor * reencode_rows(ggml_context * ctx) const;
    const std::vector<uint64_t> & reencode_list() const { return old_rows; }
    uint32_t n_reencode() const { return (uint32_t) old_rows.size(); }
    uint32_t n_reencode_max() const { return n_stream * KVCOMP_CALIB_N; }
    // 0 for the graphs of one shape that make some stream's c, 3 for those whose every c is
    // fixed (a decode step once the first rows are in); a graph that stores rows again is 1
    // or 2, never the same as the graph before it
    // (on a host cache, every graph that makes no c is one node per layer: 3 too)
    uint32_t graph_variant() const {
        return old_rows.empty() ? (steady || one_node() ? 3 : 0) : 1 + (uint32_t) (n_setups % 2);
    }

    // Host side, before each ubatch's graph (after upstream placed it: sinfo, and the cells of
    // every stream): folds the last ubatch's rows into the statistics and sets up what this
    // ubatch's graph does per stream.
    void update(const llama_kv_cells_vec & cells, const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ubatch);

    // after a ubatch that set offsets in its graph: the host copies take them (called before
    // anything reads them)
    void resolve() const;

    // A RoPE shift moves positions: a stream still collecting its rows stays at c = 0.
    void on_shift();

    // around a RoPE shift of stored K rows ([n_rot, n_head_kv, rows of all streams]): rows + c
    // of each row's stream before, and rows - c back
    ggml_tensor * unstore(ggml_context * ctx, ggml_tensor * rows, int32_t ib, bool back) const;

    // split KV: a sequence copied to another stream takes its offset along
    void copy_stream(uint32_t ssrc, uint32_t sdst);

    // The offsets, with the state: one entry per stream, `holds` tells which streams hold
    // saved cells. A target stream that holds other tokens keeps its offset: the restored K
    // rows (cells: stream * size + cell) are re-encoded onto it by adding c_f - c per channel,
    // and the shift used per layer is returned (empty when none was needed) for the slot rows
    // the caller restores. present: whether the state has a tracker part (without, c = 0).
    struct restore_target {
        uint32_t strm;
        std::vector<uint64_t> cells;
        bool replace; // the stream holds nothing else
    };
    void state_write(llama_io_write_i & io, const std::vector<bool> & holds) const;
    std::vector<std::vector<std::vector<float>>> state_read(llama_io_read_i & io, const std::vector<restore_target> & targets,
                                                            llama_seq_id seq_id, bool present);
    static void reencode(ggml_tensor * t, const std::vector<uint64_t> & rows, const std::vector<float> & shift);

    // Statistics. A sampled token whose K row (as it came) or V row (as stored) holds a
    // non-finite value is left out of all of them, in its layer: they are what they would be
    // without it. An update none of whose rows is left takes no window slot and no step of the
    // recompute schedule. Such rows (one per layer and sampling) are counted.
    void get_layer_stats(int32_t ib, llama_kvcomp_layer_stats & st) const;
    int32_t n_layers() const { return (int32_t) layers.size(); }
    // KV head h of layer ib: round-trip RMSE of its sampled K rows as stored, and their RMS
    void get_head_stats(int32_t ib, int32_t h, float & rmse, float & rms) const;
    // KV head h of layer ib (any h < the layer's KV heads; 0 until the first recompute): the
    // largest smoothed half-range of its K channels, and the smoothed half-range of its V rows
    void get_head_scales(int32_t ib, int32_t h, float & k_scale, float & v_scale) const;
    // sampled rows left out for a non-finite value, since the tracker was made
    int64_t n_nonfinite() const { return n_nonfinite_rows; }

    // The tracker that samples the cache layer whose K tensor is k (llama_kv_cache::get_k_storage),
    // and that layer's index in it (ib); nullptr when none does. The cache's buffer owns its
    // tracker; the monitor finds it here for the per-head values the public layer stats cap
    // at LLAMA_KVCOMP_MAX_HEADS heads. Call from the thread that decodes.
    static const llama_kvcomp_tracker * of_layer(const ggml_tensor * k, int32_t & ib);


private:
    struct layer_state {
        ggml_tensor * k_main = nullptr;
        ggml_tensor * v_main = nullptr;
        int64_t n_embd_k = 0, n_embd_v = 0, n_embd_head_k = 0, n_embd_head_v = 0;
        float   alpha = 0.1f;
        // window of the last updates and its smoothed values, K per channel, V per head
        kvcomp_window k_win, v_win;
        std::vector<float> k_hi, k_lo, v_hi, v_lo;
        bool    warm = false;
        std::vector<float> c; // offsets in use (host copy), n_embd_k per stream
        ggml_from_float_t k_quantize = nullptr; // k_main's quantizer (measure)
        ggml_to_float_t   k_to_float = nullptr; // its dequantizer, and v_main's (update)
        ggml_to_float_t   v_to_float = nullptr;
        // running round-trip error sums of the sampled K rows: as stored (offset removed) and
        // as they came; and the rows' energy
        double  k_err = 0.0, k_err_plain = 0.0, k_energy = 0.0;
        int64_t n_rows_measured = 0;
        std::vector<double> k_err_head, k_energy_head; // the same per KV head, as stored
    };

    enum calib_status : uint32_t {
        CALIB_STATUS_NONE,    // c = 0 until the stream empties (its first rows cannot be stored again)
        CALIB_STATUS_PENDING, // collecting the rows of its first positions, c = 0 meanwhile
        CALIB_STATUS_SET,
    };

    struct stream_state {
        calib_status status = CALIB_STATUS_NONE;
        llama_seq_id seq    = -1; // the sequence whose first positions set c
        llama_pos    p0     = 0;  // its first position
    };

    void recompute(layer_state & l);
    // cells: the main row (stream * cells + cell) of each of the n_rows K rows
    void measure(layer_state & l, const float * k_rows, const uint64_t * cells, size_t n_rows);
    void write_offsets(uint32_t strm) const;
    // the stream's c stays 0 from now on (status NONE), in the store too
    void fix_zero(uint32_t strm);
    // the cells holding the first positions of the stream's sequence, with their rank among them
    std::vector<std::pair<uint32_t, llama_pos>> first_rows(const llama_kv_cells & cells, uint32_t strm) const;
    // The store's rows: the tap's samples, then per stream a block of the copies of its first
    // rows and its c (a plane's c is made from its own stream's block only), then a row for
    // the tokens nothing is copied from.
    static uint32_t row_raw(uint32_t strm, llama_pos i) { return KVCOMP_TAP_N + strm * (KVCOMP_CALIB_N + 1) + (uint32_t) i; }
    static uint32_t row_c(uint32_t strm) { return row_raw(strm, KVCOMP_CALIB_N); }
    uint32_t row_trash() const { return row_raw(n_stream, 0); }
    uint32_t n_store_rows() const { return row_trash() + 1; }

    static constexpr uint32_t KVCOMP_TAP_N   = 32; // rows sampled per ubatch and layer
    static constexpr uint32_t KVCOMP_CALIB_N = 32; // first positions that set a stream's c

    llama_kvcomp_params params;
    uint32_t n_stream;
    bool     shared_streams;
    // (mutable: resolve() completes the host copy of what the last graph computed)
    mutable std::vector<layer_state> layers;
    std::vector<stream_state> streams;
    uint64_t n_updates = 0;
    int64_t  n_nonfinite_rows = 0;
    uint64_t n_setups  = 0; // ubatches set up
    mutable std::vector<uint32_t> pending_read; // streams whose c the last graph set

    // the last ubatch: how many rows its tap holds and which cells they went to
    std::vector<uint64_t> tap_cells;
    // this ubatch: stream planes, rows stored again (main row, copy row, plane)
    uint32_t n_planes = 1;
    uint32_t plane_strm0 = 0;
    std::vector<uint64_t> old_rows;
    // no plane of this ubatch makes its c (none collects its first rows, none stores rows again)
    bool steady = false;
    // no plane of this ubatch sets its c from its first rows (it may collect them, with c 0)
    bool quiet = false;
    std::vector<int32_t>  old_raw_h, old_plane_h;
    // host copies of the inputs last written (most ubatches write the same ones)
    std::vector<float>   w_host;
    std::vector<int64_t> idx_host;

    std::vector<ggml_tensor *> store; // per layer: [n_embd_k_gqa, n_store_rows()] F32
    ggml_tensor * weights  = nullptr; // [1, KVCOMP_CALIB_N + 1, n_stream] F32: per plane, the weights of its block that make its c
    ggml_tensor * copy_idx = nullptr; // [n_ubatch] I64: the store row each token's raw row goes to
    ggml_tensor * old_main = nullptr; // [n_stream * KVCOMP_CALIB_N] I64: main rows stored again
    ggml_tensor * old_raw  = nullptr; // [n_stream * KVCOMP_CALIB_N] I32: their copies in the store
    ggml_tensor * old_plane = nullptr; // [n_stream * KVCOMP_CALIB_N] I32: the plane of their stream
    mutable std::vector<ggml_tensor *> reenc; // per layer, from the graph being built

    llama_kvcomp_storage storage; // the stores beside each layer's cells
    // the CPU's one-node form of the K rows of a graph that makes no c (host caches only),
    // or nullptr
    ggml_custom_op_t offset_rows = nullptr;
    bool one_node() const { return quiet && old_rows.empty() && offset_rows; }
};
