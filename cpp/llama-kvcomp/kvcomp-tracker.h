#pragma once

// The scale tracker: range statistics of the K/V rows a cache receives, per layer, KV head and
// channel, and the K offset they yield (docs/design-tracker-modes.md).
//
// A key offset shared by every key of a layer does not change attention (softmax cancels
// q·c), so the cache stores k - c and nothing reads it back. c must be the same for every
// key a query sees: it is set when the cache is empty (from the first ubatch's rows, or from
// the tracker's smoothed mean once it has one) and then stays until the cache empties again.

#include "llama-kvcomp.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

class llama_io_read_i;
class llama_io_write_i;

struct llama_kvcomp_tracker {
    // a cache layer: its K and V tensors ([n_embd, cells * streams]) and head sizes
    struct layer_desc {
        ggml_tensor * k;
        ggml_tensor * v;
        int32_t il;
        int64_t n_embd_head_k;
        int64_t n_embd_head_v;
    };

    llama_kvcomp_tracker(const std::vector<layer_desc> & descs, const llama_kvcomp_params & params);
    ~llama_kvcomp_tracker();

    void set_params(const llama_kvcomp_params & p) { params = p; }

    // Graph side, in the cache's cpy hook: samples K rows into the tap and returns cur - c
    // (cur itself for V).
    ggml_tensor * transform(ggml_context * ctx, ggml_tensor * cur, int32_t ib, bool is_k) const;

    // Host side, before each ubatch's graph: folds the last ubatch's rows into the statistics
    // and, when the cache held nothing but this ubatch, lets this ubatch set the offset.
    // `cells` are the cells this ubatch writes (all streams), `empty` whether they are all
    // the cache holds.
    void update(const std::vector<uint64_t> & cells, bool empty);

    // after a ubatch that set the offsets in its graph: the host copy and the tap's offset row
    // take the same mean (called before anything reads either)
    void resolve() const;

    // around a RoPE shift of stored K rows ([n_rot, n_head_kv, n_cells]): rows + c
    // before, and rows - c back
    ggml_tensor * unstore(ggml_context * ctx, ggml_tensor * rows, int32_t ib, bool back) const;

    // The offsets, with the state. A sequence read beside tokens stored under another offset
    // has its K rows (cells: those restored) re-encoded onto this one by adding c_f - c per
    // channel; the shifts used, one per layer, are returned (empty when none was needed) for
    // the slot rows the caller restores. present: whether the state has a tracker part
    // (without, c = 0).
    void state_write(llama_io_write_i & io) const;
    std::vector<std::vector<float>> state_read(llama_io_read_i & io, const std::vector<uint64_t> & cells, bool replace, bool present);
    static void reencode(ggml_tensor * t, const std::vector<uint64_t> & rows, const std::vector<float> & shift);

    void get_layer_stats(int32_t ib, llama_kvcomp_layer_stats & st) const;
    int32_t n_layers() const { return (int32_t) layers.size(); }
    // KV head h of layer ib: round-trip RMSE of its sampled K rows as stored, and their RMS
    void get_head_stats(int32_t ib, int32_t h, float & rmse, float & rms) const;


private:
    // per channel, what one update contributed: the two largest and two
    // smallest values (enough for a 99.9th percentile over up to 1000 samples)
    struct update_stats {
        uint32_t n = 0;
        std::vector<float> hi1, hi2, lo1, lo2;
    };

    struct layer_state {
        ggml_tensor * k_main = nullptr;
        ggml_tensor * v_main = nullptr;
        int64_t n_embd_k = 0, n_embd_v = 0, n_embd_head_k = 0, n_embd_head_v = 0;
        float   alpha = 0.1f;
        // window of the last updates (ring) and its smoothed values, K per channel, V per head
        std::vector<update_stats> k_win, v_win;
        std::vector<float> k_hi, k_lo, v_hi, v_lo;
        bool    warm = false;
        std::vector<float> c; // offset in use (host copy)
        // running round-trip error sums of the sampled K rows: as stored (offset removed) and
        // as they came; and the rows' energy
        double  k_err = 0.0, k_err_plain = 0.0, k_energy = 0.0;
        int64_t n_rows_measured = 0;
        std::vector<double> k_err_head, k_energy_head; // the same per KV head, as stored
    };

    void fold(std::vector<update_stats> & win, const float * rows, uint32_t n_rows, int64_t n_embd) const;
    void recompute(layer_state & l);
    void measure(layer_state & l, const float * k_rows, size_t n_rows);
    void write_offsets() const;
    void set_weights(bool calibrating, uint32_t n_sample);

    llama_kvcomp_params params;
    // (mutable: resolve() completes the host copy of what the last graph computed)
    mutable std::vector<layer_state> layers;
    uint64_t n_updates = 0;
    mutable bool pending_read = false; // the offsets were set in the last graph
    bool     w_calibrating = true; // what `calibrate` holds
    uint32_t w_n_sample = 0;

    // the last ubatch: how many rows its tap holds and which cells they went to
    std::vector<uint64_t> tap_cells;

    std::vector<ggml_tensor *> tap; // per layer: [n_embd_k_gqa, n_tap + 1] F32, sampled raw K rows, then the offset
    ggml_tensor * calibrate = nullptr; // [1, n_tap + 1] F32: the weights that make the offset from the tap's rows

    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
};
