#pragma once

// What the monitor (kvcomp-monitor.h) reads of a context's caches, read-only. Dependencies run
// one way: the monitor includes this header and neither the buffer's nor the tracker's; the
// C API (kvcomp-api.cpp) and the residual buffer (kvcomp-buffer.cpp, which reads its tracker)
// implement it; neither the buffer nor the tracker includes the monitor. The buffer tells the
// monitor of each ubatch through the callback the C API gives it (llama_kvcomp_buffer::on_ubatch),
// and the monitor changes the mode through the public C API (llama-kvcomp.h).

#include "llama-kvcomp.h"

#include <cstdint>
#include <vector>

class llama_kv_cache;
struct llama_context;
struct llama_kvcomp_tracker;

// the transformer caches of a context: one, or two for a sliding-window model
std::vector<llama_kv_cache *> llama_kvcomp_caches(llama_context * ctx);

// false when kv carries no kvcomp parts; otherwise st holds its residual buffer's counters
bool llama_kvcomp_source_stats(const llama_kv_cache & kv, llama_kvcomp_stats & st);

// one row per layer of kv (which carries kvcomp parts) and KV head, appended to out
void llama_kvcomp_source_heads(const llama_kv_cache & kv, std::vector<llama_kvcomp_head_snapshot> & out);

// The tracker that samples model layer il of kv, and that layer's index in it (ib); nullptr
// when kv carries no kvcomp parts or no tracker samples the layer. Call from the thread that
// decodes.
const llama_kvcomp_tracker * llama_kvcomp_source_tracker(const llama_kv_cache & kv, int32_t il, int32_t & ib);
// the same for kv's first layer: the tracker of the whole cache
const llama_kvcomp_tracker * llama_kvcomp_source_tracker(const llama_kv_cache & kv);

// KV head h of layer ib of tr: the largest smoothed half-range of its K channels, and the
// smoothed half-range of its V rows (llama_kvcomp_tracker::get_head_scales)
void llama_kvcomp_source_head_scales(const llama_kvcomp_tracker & tr, int32_t ib, int32_t h, float & k_scale, float & v_scale);

// sampled rows tr left out for a non-finite value, since it was made
int64_t llama_kvcomp_source_n_nonfinite(const llama_kvcomp_tracker & tr);
