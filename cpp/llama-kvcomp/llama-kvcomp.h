#pragma once

// kvcomp inside llama.cpp: the public C API.

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The presets, in the order of the degrade ladder (docs/reference.md, "Modes and the scale tracker").
enum llama_kvcomp_mode {
    LLAMA_KVCOMP_MODE_OFF,            // upstream cache: no buffer, no tracker
    LLAMA_KVCOMP_MODE_LOW_LATENCY,    // kvc4 K/V, scale tracker, no residual buffer
    LLAMA_KVCOMP_MODE_BALANCED,       // kvc4 K / kvc3 V, 56-position window, merge every 8 steps
    LLAMA_KVCOMP_MODE_HIGH_PRECISION, // merge every 8 steps
    LLAMA_KVCOMP_MODE_CUSTOM,         // knobs set one by one
    LLAMA_KVCOMP_MODE_COUNT,
};

// Knobs of the residual buffer (docs/design-residual-buffer.md) and of the scale tracker
// (docs/design-tracker-modes.md).
struct llama_kvcomp_params {
    int32_t mode;           // enum llama_kvcomp_mode these knobs came from
    int32_t window;         // newest positions every query sees at full precision (0: none)
    int32_t sinks;          // first positions of each sequence kept at full precision (0: none)
    int32_t merge_interval; // slots of tokens that left the window are released every N ubatches (>= 1)
    float   merge_at;       // ... or as soon as this fraction of the slots is in use (0, 1]
    float   pin_threshold;  // relative quantization error ||x - deq(q(x))|| / ||x|| of a token above
                            // which it stays exact (0: no outlier pins)
    float   pin_budget;     // most cells pinned as outliers, in per cent of the cache size [0, 100]
    int32_t tracker;        // 1: the scale tracker runs and removes each layer's K offset, the mean of
                            // the first 32 K rows of the sequence that starts each KV stream
                            // (quantized K only, not kvct), 0: off
    float   ema_shallow;    // tracker EMA weight α of the first layer, (0, 1]
    float   ema_deep;       // ... of the last layer; layers between are interpolated, (0, 1]
    int32_t keep_prompt;    // 1: each sequence keeps the exact rows its last prompt's final token read,
                            // through any generation (window more slots per sequence), so that token
                            // decoded again after a cut-back (a reused or restored prompt) reads them
                            // all (llama-server turns this on); 0: off. Not part of a mode.
};

// Everything off, mode LLAMA_KVCOMP_MODE_CUSTOM.
LLAMA_API struct llama_kvcomp_params llama_kvcomp_default_params(void);

// A mode's preset: the knobs and the K/V cache types it is meant for (GGML_TYPE_F16 for
// "off"). Returns 0, or -1 for an unknown mode.
LLAMA_API int32_t llama_kvcomp_mode_preset(int32_t mode, struct llama_kvcomp_params * params,
                                           enum ggml_type * type_k, enum ggml_type * type_v);

// The K cache type a mode takes when the model's K statistics are given (--kv-comp-kstats,
// llama_kvcomp_set_k_stats): kvct4 for low-latency and balanced, whose K then has about a
// fifth of kvc4's error at the same bits (docs/formats.md, "kvct"); the preset's K for the others.
// -1 for an unknown mode.
LLAMA_API int32_t llama_kvcomp_mode_type_k_stats(int32_t mode);

// Per-layer K types. Upstream's cache has one K type for every layer, but a bit of K costs up to
// 50x more KLD in some layers than in others (docs/kv-rows.md, "With the cache's own types"):
// a rule may store the least sensitive layers one type lower. A cache's tensors are made with
// its context, before any kvcomp call can reach the context (llama-cpp-python makes model and
// context in one call), so the rule is process-wide: it applies to the contexts created after
// it is set, and each context keeps the types it was made with.
enum llama_kvcomp_k_layers {
    LLAMA_KVCOMP_K_LAYERS_SAME,  // every layer stores K as the context's type_k (upstream's)
    LLAMA_KVCOMP_K_LAYERS_EDGES, // a kvct4 K cache stores its first layer and the last sixth of
                                 // its layers (rounded up) as kvct3; other K types are unchanged
    LLAMA_KVCOMP_K_LAYERS_COUNT,
};

// Sets the rule for the contexts created from now on. Returns 0, or -1 for an unknown rule.
LLAMA_API int32_t llama_kvcomp_set_k_layers(int32_t rule);
LLAMA_API int32_t llama_kvcomp_get_k_layers(void);

// The K type of layer il (of n_layer) under rule in a context whose K type is type_k.
LLAMA_API enum ggml_type llama_kvcomp_layer_type_k(int32_t rule, int32_t il, int32_t n_layer, enum ggml_type type_k);

// The rule a mode takes with the model's K statistics: EDGES for balanced, whose sinks and
// window keep the first layer's most sensitive rows exact (0.2 bits less K per element for a
// measured +0-5% KLD on SmolLM2 and Gemma-3), SAME for the others (low-latency's first layer
// would cost it 20%). -1 for an unknown mode.
LLAMA_API int32_t llama_kvcomp_mode_k_layers(int32_t mode);

// A measured per-layer profile (`kvcomp calibrate --layers` writes one, docs/formats.md): in
// the layers it lists a kvct4 K is stored as kvct3, and in others a kvc3 V as kvc4, where the
// model's single-layer costs say a bit moved from K to V buys KLD. Process-wide like the rule,
// which it replaces while loaded; NULL unloads it. Returns 0, or -1 for a file that is missing,
// damaged or not a profile (reason in llama_kvcomp_last_error). A context of a model of
// another architecture or layer count is refused when it is made.
LLAMA_API int32_t llama_kvcomp_load_layers(const char * path);

// "same", "edges"; NULL for an unknown rule. And the rule of a name (or of its number), or -1.
LLAMA_API const char * llama_kvcomp_k_layers_name(int32_t rule);
LLAMA_API int32_t llama_kvcomp_k_layers_from_name(const char * name);

// The ggml_type of a tensor type name ("kvc4", "q8_0", "f16", ...), or -1: for bindings that
// pass cache types as numbers (llama-cpp-python's type_k/type_v).
LLAMA_API int32_t llama_kvcomp_type_from_name(const char * name);

// "off", "low-latency", "balanced", "high-precision", "custom"; NULL for an unknown mode.
LLAMA_API const char * llama_kvcomp_mode_name(int32_t mode);

// The mode of a name above, or -1.
LLAMA_API int32_t llama_kvcomp_mode_from_name(const char * name);

// Attaches the residual buffer and the scale tracker described by params to the context's
// KV cache (both caches of a sliding-window model), or removes them when every knob is off.
// Call it after the context is created; tokens already cached stay quantized for every later
// query, and the K offset they were stored with stays in use until the cache empties.
// Returns 0 on success, a negative value with a logged reason otherwise: -1 invalid params,
// -2 unsupported cache (needs flash attention and a transformer KV cache), -3 allocation
// failure.
LLAMA_API int32_t llama_kvcomp_configure(struct llama_context * ctx, const struct llama_kvcomp_params * params);

// Loads K statistics (a GGUF file written by llama-kvcomp-calibrate / `kvcomp calibrate`)
// and fits from them the plans of every kvct K cache of the context (docs/formats.md,
// "kvct"); a cache of another K type ignores them. A kvct cache needs its plans before its
// first token: until then llama_decode fails with the reason in llama_kvcomp_last_error.
// Call after the context is created, while the cache is empty. Returns 0, or -1 for a file
// that is missing, damaged or made for another model (reason logged), -2 for a cache that
// cannot hold kvct rows (no flash attention, KV cache off the host, tokens already cached),
// -3 for an allocation failure.
LLAMA_API int32_t llama_kvcomp_set_k_stats(struct llama_context * ctx, const char * path);

// The first positions of every chunk a statistics run leaves out: the attention sinks sit far
// from the other rows, and the modes keep them exact.
#define LLAMA_KVCOMP_CALIB_SKIP_FIRST 4

// Measures the model's K statistics (the file llama_kvcomp_set_k_stats loads) by running it over
// tokens with an exact F16 cache, in chunks of n_chunk tokens at positions 0..n_chunk-1, the
// first skip_first of each left out, on a context of its own; writes them, sealed, to path.
// The result depends on the model, the tokens and the chunking only (not on the threads).
// progress as in llama_kvcomp_set_k_stats_auto. Returns 0, or -1 with the reason in
// llama_kvcomp_last_error.
LLAMA_API int32_t llama_kvcomp_measure_k_stats(struct llama_model * model, const llama_token * tokens, int32_t n_tokens,
                                               int32_t n_chunk, int32_t skip_first, int32_t n_threads, const char * path,
                                               llama_progress_callback progress, void * user_data);

// The K statistics without a file: on first use of a model the library measures them on a
// built-in text (about 2K tokens; fewer for models past 1B parameters) and keeps them in
// cache_dir (NULL: $KVCOMP_CACHE/kstats, else ~/.cache/kvcomp/kstats) under a name made from
// the model's fingerprint (shape, RoPE, token-embedding signature, normalisation weights);
// later starts read that file. A cached file that is damaged or another model's is measured
// again, never used; a folder that cannot be written gives statistics for this run only (a
// warning says so). Then as llama_kvcomp_set_k_stats. progress (may be NULL) is called with
// the share done before each chunk of the measuring run and with 1 at its end; returning false
// stops it (-1).
LLAMA_API int32_t llama_kvcomp_set_k_stats_auto(struct llama_context * ctx, const char * cache_dir,
                                                llama_progress_callback progress, void * user_data);

// Where the statistics the last successful llama_kvcomp_set_k_stats or _auto call of this thread
// applied came from, in words for a log line ("" before any).
LLAMA_API const char * llama_kvcomp_k_stats_source(void);

// Why a context of model cannot store K as a kvct type, or NULL when it can: a KV cache off the
// host (offload_kqv as in llama_context_params; the kvct kernels run on the CPU), or a RoPE the
// kvct plans cannot follow (none, partial, multi-section).
LLAMA_API const char * llama_kvcomp_kvct_unfit(const struct llama_model * model, bool offload_kqv);

// The values a statistics file is bound to: whole rows of the token embeddings from the middle
// of the vocabulary (token_embd, which no backend repacks), as F32, at most n_max of them. The
// same model quantized another way gives nearly the same values; another model's are
// unrelated. Returns how many were written: 0 for a model without them, -1 for one whose type
// cannot be read back.
LLAMA_API int32_t llama_kvcomp_model_signature(const struct llama_model * model, float * out, int32_t n_max);

// The knobs in effect (as configured; every knob off when nothing is attached). Returns 0,
// or -1 without a context.
LLAMA_API int32_t llama_kvcomp_get_config(struct llama_context * ctx, struct llama_kvcomp_params * params);

// The K and V cache types of the context (with per-layer K types, the type most layers have).
// Returns 0, or -1 without a transformer KV cache.
LLAMA_API int32_t llama_kvcomp_get_cache_types(struct llama_context * ctx, enum ggml_type * type_k, enum ggml_type * type_v);

// Switches to a mode's knobs at run time (logged): new tokens follow them, cached tokens keep
// how they were stored. The K/V types are fixed when the context is created, so only the
// buffer and tracker knobs change. Same return codes as llama_kvcomp_configure.
LLAMA_API int32_t llama_kvcomp_set_mode(struct llama_context * ctx, int32_t mode);

// What the residual buffer holds and has done, for tests and monitoring.
struct llama_kvcomp_stats {
    int32_t n_slots;         // slots allocated
    int32_t n_used;          // slots holding an exact row
    int32_t n_pinned;        // outlier pins among them
    int32_t n_pin_budget;    // most outlier pins
    int64_t n_merges;        // merge passes run
    int64_t n_released;      // slots released by merges
    int64_t n_overflow;      // rows that found no free slot and stayed quantized (0 unless mis-sized)
    float   pin_err_min;     // smallest error among the pins (0: none)
    float   evicted_err_max; // largest error of an outlier released for lack of budget (0: none)
};

// Returns 0 and fills stats, or -1 when the context has no residual buffer.
LLAMA_API int32_t llama_kvcomp_get_stats(struct llama_context * ctx, struct llama_kvcomp_stats * stats);

// Whether llama_memory_seq_rm(seq_id, p0, p1) would keep the exact copy of every row that the
// sequence's next query sees exactly: 1 yes (always without a buffer), 0 no, -1 no context.
// A cut-back behind rows the buffer has released (they are kept while their slots are not
// needed) would give the re-decoded tokens quantized keys where a fresh run has exact ones;
// a caller that must match a fresh run clears the sequence and decodes it again instead
// (llama-server does, for a reused prompt).
LLAMA_API int32_t llama_kvcomp_seq_rm_exact(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1);

// KV heads whose scales llama_kvcomp_layer_stats holds (k_scale, v_scale): the first 16 of
// the layer's. The monitor's head snapshots (llama_kvcomp_get_snapshot) and its exports
// (/metrics, /kvcomp, llama_kvcomp_snapshot_text) have every KV head, however many.
#define LLAMA_KVCOMP_MAX_HEADS 16

// The scale tracker's view of one layer. RMSEs are over the K rows it sampled, in the values
// attention sees; "plain" is what the same type gives without the offset removal. A sampled
// row holding a non-finite value is left out of every statistic (docs/monitoring.md).
struct llama_kvcomp_layer_stats {
    int32_t il;             // model layer
    int32_t n_head_kv;
    int64_t n_rows;         // K rows measured
    float   alpha;          // EMA weight of this layer
    float   k_rms;          // RMS of the measured K rows
    float   k_rmse;         // round-trip RMSE of those rows as stored (offset removed)
    float   k_rmse_offset;  // the same (no channel scales are applied any more)
    float   k_rmse_plain;   // ... had they been stored as they came
    float   k_offset_rms;   // RMS of the K offset in use
    float   k_range_spread; // largest / smallest K channel scale in use: always 1 (none are applied)
    float   k_scale[LLAMA_KVCOMP_MAX_HEADS]; // KV heads 0..15 (0 past n_head_kv): largest smoothed half-range of
                                             // its K channels; heads 16 and up: the monitor's head snapshots
    float   v_scale[LLAMA_KVCOMP_MAX_HEADS]; // ... smoothed half-range of its V rows
};

// Fills stats for model layer il. Returns 0, or -1 when the context has no tracker or the
// layer has no KV cache.
LLAMA_API int32_t llama_kvcomp_get_layer_stats(struct llama_context * ctx, int32_t il, struct llama_kvcomp_layer_stats * stats);

// Monitoring (docs/monitoring.md): per layer and KV head quantization error, scales and
// buffer norms; per sequence a sliding-window perplexity of the generated tokens; and the
// degrade policy, which steps the context down the mode ladder (high-precision -> balanced
// -> low-latency -> off) when a sequence's perplexity stays above its baseline.
struct llama_kvcomp_monitor_params {
    int32_t enabled;          // 1: collect and evaluate, 0: off (default 1)
    int32_t ppl_window;       // generated tokens per perplexity window (default 64)
    float   degrade_ratio;    // a window is "above" when its perplexity > ratio x baseline (default 1.2)
    int32_t degrade_windows;  // this many windows above in a row step the mode down (default 3; 0: never)
    float   baseline_ppl;     // f16-KV perplexity from a calibration profile (> 0); 0: each sequence's first window
    float   fill_warn;        // warn when this fraction of the buffer's slots is in use (default 0.8)
    float   l2_jump;          // warn when a layer/head's buffer L2 norm exceeds this x its running mean (default 2; 0: never)
    int32_t refresh;          // ubatches between two snapshots (default 8)
};

LLAMA_API struct llama_kvcomp_monitor_params llama_kvcomp_monitor_default_params(void);

// Why monitor params are invalid, or NULL.
LLAMA_API const char * llama_kvcomp_monitor_params_error(const struct llama_kvcomp_monitor_params * params);

// Sets the monitor of a context (kept across llama_kvcomp_configure and mode switches).
// Returns 0, or -1 for invalid params (reason logged).
LLAMA_API int32_t llama_kvcomp_set_monitor(struct llama_context * ctx, const struct llama_kvcomp_monitor_params * params);

// After sampling `token` from the logits of output i of the last decode for sequence
// seq_id: adds its log-probability (from the model's full distribution) to the sequence's
// window and, at the end of a window, applies the degrade policy. Call from the thread that
// decodes. Returns 0, or -1 when monitoring is off or the logits are missing.
LLAMA_API int32_t llama_kvcomp_observe(struct llama_context * ctx, llama_seq_id seq_id, int32_t i, llama_token token);

// Forgets a sequence's windows and baseline (a new request starts on it).
LLAMA_API void llama_kvcomp_seq_reset(struct llama_context * ctx, llama_seq_id seq_id);

// Takes a snapshot now (from the thread that decodes); otherwise one is taken every
// `refresh` ubatches. Returns 0, or -1 when monitoring is off.
LLAMA_API int32_t llama_kvcomp_monitor_refresh(struct llama_context * ctx);

// One per model layer and KV head (every head of the layer). The monitor takes no non-finite
// value into its statistics; a value it cannot take from finite numbers this refresh (a
// buffer norm while a held row is not finite) is NaN here, absent from /metrics and null in
// the JSON, and counted in llama_kvcomp_snapshot.n_nonfinite. A layer no tracker follows (the
// tracker off, or a kvct K cache, whose plans take its place) has its round-trip error and
// scales unmeasured: NaN too, and absent the same way, but not counted.
struct llama_kvcomp_head_snapshot {
    int32_t il;          // model layer
    int32_t head;        // KV head
    float   k_rmse;      // K round-trip RMSE as stored, over the rows the tracker sampled (0: none yet)
    float   k_rmse_rel;  // ... over those rows' RMS
    float   k_scale;     // largest smoothed half-range of the head's K channels
    float   v_scale;     // smoothed half-range of the head's V rows
    float   buf_l2_k;    // L2 norm of the head's K rows held in the residual buffer
    float   buf_l2_v;    // ... V rows
};

struct llama_kvcomp_seq_snapshot {
    int32_t seq_id;
    int64_t n_tokens;     // generated tokens observed
    int32_t n_windows;    // windows completed
    int32_t n_above;      // consecutive windows above the threshold
    float   ppl_last;     // perplexity of the last complete window (0: none yet)
    float   ppl_baseline; // the baseline in use (0: not set yet)
};

struct llama_kvcomp_degrade_event {
    int64_t t_us;         // ggml_time_us() when it happened
    int32_t seq_id;       // the sequence whose windows triggered it
    int32_t mode_from;
    int32_t mode_to;
    float   ppl;          // the last window's perplexity
    float   ppl_baseline;
    float   ratio;        // degrade_ratio in force
    int32_t n_windows;    // windows above in a row
};

struct llama_kvcomp_snapshot {
    int32_t mode;          // enum llama_kvcomp_mode in force
    int32_t n_heads;       // layer x KV head rows available
    int32_t n_seqs;        // sequences observed
    int32_t n_events;      // degrade steps taken (all of them; the log keeps the last 64)
    int64_t n_ubatches;    // ubatches seen
    int64_t t_us;          // when the snapshot was taken
    int32_t n_slots;       // residual buffer slots, all caches
    int32_t n_used;
    int32_t n_pinned;
    float   fill;          // n_used / n_slots (0 without a buffer)
    int64_t n_merges;
    int64_t n_released;
    int64_t n_warn_fill;   // fill warnings issued
    int64_t n_warn_l2;     // L2 jump warnings issued
    int64_t n_nonfinite;   // non-finite values kept out of the statistics (docs/monitoring.md, "Non-finite values")
    int32_t enabled;       // 1: the monitor collects; 0: it is set off (the snapshot holds nothing current)
};

// Copies the latest snapshot (any thread). heads/seqs/events may be NULL; at most the given
// counts are written, the snapshot says how many exist. Returns 0, or -1 without monitoring.
LLAMA_API int32_t llama_kvcomp_get_snapshot(struct llama_context * ctx, struct llama_kvcomp_snapshot * snap,
                                            struct llama_kvcomp_head_snapshot * heads, int32_t n_heads_max,
                                            struct llama_kvcomp_seq_snapshot * seqs, int32_t n_seqs_max,
                                            struct llama_kvcomp_degrade_event * events, int32_t n_events_max);

enum llama_kvcomp_format {
    LLAMA_KVCOMP_FORMAT_JSON,
    LLAMA_KVCOMP_FORMAT_PROMETHEUS, // text exposition format, series named llamacpp:kvcomp_*
};

// The latest snapshot as text (any thread), like snprintf: writes at most size bytes
// including the terminating 0 and returns the full length, or -1 without monitoring.
// layer >= 0 keeps that model layer's per-head rows only (both formats), -1 all.
LLAMA_API int64_t llama_kvcomp_snapshot_text(struct llama_context * ctx, int32_t format, int32_t layer, char * buf, size_t size);

// Why params are invalid, or NULL when they are valid.
LLAMA_API const char * llama_kvcomp_params_error(const struct llama_kvcomp_params * params);

// Why the last call on this thread that failed did so, or NULL after a success: the state API
// (llama_state_load_file, llama_state_set_data, llama_state_seq_*: 0 or false is the return
// code, this is the message; docs/state.md), llama_kvcomp_configure and llama_kvcomp_set_mode.
// The text stays valid until the next such call on the thread.
LLAMA_API const char * llama_kvcomp_last_error(void);

#ifdef __cplusplus
}
#endif
