// The residual buffer's setup and configuration (attach, K statistics, device checks), its
// statistics, and what the monitor reads through kvcomp-monitor-source.h. The slot map and its
// window policy are in kvcomp-buffer-slots.cpp, the graph in kvcomp-buffer-graph.cpp, the
// state sections in kvcomp-buffer-state.cpp.

#include "kvcomp-buffer.h"
#include "kvcomp-monitor-source.h"
#include "kvcomp-state.h"

#include "llama-impl.h"

#include "ggml-kvcomp.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

llama_kvcomp_buffer::llama_kvcomp_buffer(const llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max,
                                         std::shared_ptr<llama_kvcomp_tracker> tracker)
    : params(params), buffered(wants_slots(params) && lossy(kv)), n_ubatch(n_ubatch), tracker(std::move(tracker)) {
    const uint32_t kv_size = kv.get_size();
    const uint32_t n_seq   = kv.n_stream > 1 ? 1 : n_seq_max; // sequences per stream
    pin_budget = params.pin_threshold > 0.0f ? (uint32_t) std::ceil(params.pin_budget / 100.0f * kv_size) : 0;

    // While a ubatch runs, its queries read the window before it from slots (W - 1 per
    // sequence) and its own rows from the graph, and the rows later queries need are written
    // to slots (up to W per sequence, or every row when outliers are measured). Sinks stay,
    // tokens that left the window wait up to N - 1 ubatches for the next merge, and pins
    // have their budget. Each sequence also keeps the KVCOMP_CUT_BACK rows before its window:
    // a sequence cut back by that many tokens still finds every row its next query sees
    // exactly, so re-decoding a prompt's last token (llama-server and llama-cpp-python do it
    // for a reused or restored prompt) gives the logits of the first run. With keep_prompt,
    // each sequence keeps the window its last prompt's final token read as well, W slots more,
    // so that re-decode finds its rows after a generation too.
    //
    // The window is held once when the slot writes follow the layer's attention: a token
    // then takes the slot of a row that only its own ubatch's queries still see exactly, and
    // W + S + N - 1 slots per sequence take any split of a prompt. Not when outliers are
    // measured (every row waits a ubatch in a slot of its own), when later layers read this
    // cache's slots (they attend after the write), or on a device cache (attention there
    // reads a copy that the write precedes, the device kernels not reading the slots).
    bool host = true;
    for (const auto & l : kv.layers) {
        host = host && ggml_kvcomp_buffer_cpu_kernels(l.k->buffer) && ggml_kvcomp_buffer_cpu_kernels(l.v->buffer);
    }
    give_away = buffered && host && params.pin_threshold <= 0.0f && kv.map_layer_ids.size() == kv.layers.size();
    const uint32_t n_window = n_seq * (uint32_t) (params.window + params.sinks + params.merge_interval - 1 + KVCOMP_CUT_BACK +
                                                  (params.keep_prompt ? params.window : 0));
    const uint32_t n_new    = give_away ? 0 : params.pin_threshold > 0.0f ? n_ubatch : std::min(n_seq * (uint32_t) params.window, n_ubatch);
    n_slots_stream = buffered ? n_window + n_new + pin_budget : 0;

    maps.resize(kv.n_stream);
    for (auto & m : maps) {
        m.slot_cell.assign(n_slots_stream, -1);
        m.slot_pos.assign(n_slots_stream, -1);
        m.slot_kinds.assign(n_slots_stream, SLOT_KIND_FREE);
        m.slot_err.assign(n_slots_stream, 0.0f);
        m.cell_slot.assign(kv_size, -1);
        m.cell_ub.assign(kv_size, -1);
        m.cell_given.assign(kv_size, -1);
        m.seq_anchor.assign(LLAMA_MAX_SEQ, -1);
    }

    int32_t max_il = 0;
    for (const auto & [il, ikv] : kv.map_layer_ids) {
        max_il = std::max(max_il, il);
    }
    layer_of_il.assign(max_il + 1, -1);
    // layers that reuse another layer's cache read its slots and its transform
    for (const auto & [il, ikv] : kv.map_layer_ids) {
        layer_of_il[il] = ikv;
    }

    // one more row per stream, never attended: where a token without a slot writes its row;
    // the slots live next to the cache they shadow (llama_kvcomp_storage)
    const size_t n_tensors = 2 * kv.layers.size() + 2;
    for (const auto & l : kv.layers) {
        ggml_context * c = storage.ctx_for(ggml_backend_buffer_get_type(l.k->buffer), n_tensors);
        k_buf.push_back(ggml_new_tensor_2d(c, GGML_TYPE_F16, l.k->ne[0], (int64_t) n_rows() * kv.n_stream));
        v_buf.push_back(ggml_new_tensor_2d(c, GGML_TYPE_F16, l.v->ne[0], (int64_t) n_rows() * kv.n_stream));
        ggml_format_name(k_buf.back(), "kvcomp_k_l%u", l.il);
        ggml_format_name(v_buf.back(), "kvcomp_v_l%u", l.il);
    }
    ggml_context * c0 = storage.ctx_for(ggml_backend_buffer_get_type(kv.layers[0].k->buffer), n_tensors);
    reencode_slots = ggml_new_tensor_1d(c0, GGML_TYPE_I64, std::max<int64_t>(1, this->tracker ? this->tracker->n_reencode_max() : 0));
    exact_order = ggml_new_tensor_2d(c0, GGML_TYPE_I32, (int64_t) n_slots() + n_ubatch, kv.n_stream);
    k_read.assign(k_buf.size(), nullptr);
    v_read.assign(k_buf.size(), nullptr);
    k_written.assign(k_buf.size(), nullptr);
    v_written.assign(k_buf.size(), nullptr);
    k_cur.assign(k_buf.size(), nullptr);
    v_cur.assign(k_buf.size(), nullptr);
    rope_warned.assign(k_buf.size(), false);
    storage.alloc("residual buffer");

    // bits per K/V element: the main cache's, and what the buffer adds to them
    size_t main_bytes = 0;
    double n_elem = 0.0;
    for (const auto & l : kv.layers) {
        main_bytes += ggml_nbytes(l.k) + ggml_nbytes(l.v);
        n_elem += (double) (l.k->ne[0] + l.v->ne[0]) * kv_size * kv.n_stream;
    }
    const size_t buf_bytes = buffered ? storage.nbytes() : 0;
    LLAMA_LOG_INFO("kvcomp: KV memory: main cache %.2f MiB (%.2f bpe), residual buffer %.2f MiB (%.2f bpe, %u streams of %u slots), "
            "total %.2f bpe\n", main_bytes / (1024.0 * 1024.0), 8.0 * main_bytes / n_elem, buf_bytes / (1024.0 * 1024.0),
            8.0 * buf_bytes / n_elem, kv.n_stream, n_slots_stream, 8.0 * (main_bytes + buf_bytes) / n_elem);
}

llama_kvcomp_buffer::~llama_kvcomp_buffer() {
    if (n_overflow > 1) {
        LLAMA_LOG_WARN("kvcomp: %lld positions found the residual buffer full and stayed quantized\n", (long long) n_overflow);
    }
}

void llama_kvcomp_buffer::adopt_storage(llama_kvcomp_buffer & prev) {
    // Upstream reuses the last graph when the next ubatch has the same shape, and that graph
    // points at the previous configuration's slot tensors. With the same slot count the
    // shape is the same, so those tensors must stay the ones in use.
    if (prev.n_slots_stream != n_slots_stream || prev.k_buf.size() != k_buf.size() || prev.maps.size() != maps.size()) {
        return;
    }
    storage.swap(prev.storage);
    std::swap(k_buf, prev.k_buf);
    std::swap(v_buf, prev.v_buf);
    std::swap(reencode_slots, prev.reencode_slots);
    std::swap(exact_order, prev.exact_order);
}

void llama_kvcomp_buffer::head_snapshots(const llama_kv_cache & kv, std::vector<llama_kvcomp_head_snapshot> & out) const {
    std::vector<float> k_l2, v_l2;
    for (size_t ib = 0; ib < kv.layers.size(); ++ib) {
        const int32_t il = (int32_t) kv.layers[ib].il;
        const int64_t n_head_k = kv.layers[ib].k->ne[0] / kv.hparams.n_embd_head_k(il);
        const int64_t n_head_v = kv.layers[ib].v->ne[0] / kv.hparams.n_embd_head_v(il);
        slot_norms((int32_t) ib, k_l2, v_l2, n_head_k, n_head_v);
        llama_kvcomp_layer_stats ls = {};
        const bool tracked = get_layer_stats(il, ls);
        for (int64_t h = 0; h < std::max(n_head_k, n_head_v); ++h) {
            llama_kvcomp_head_snapshot hs = {};
            hs.il   = il;
            hs.head = (int32_t) h;
            if (tracked && h < n_head_k) {
                float rms = 0.0f;
                tracker->get_head_stats((int32_t) ib, (int32_t) h, hs.k_rmse, rms);
                hs.k_rmse_rel = rms > 0.0f ? hs.k_rmse / rms : 0.0f;
            }
            hs.k_scale  = tracked && h < LLAMA_KVCOMP_MAX_HEADS ? ls.k_scale[h] : 0.0f;
            hs.v_scale  = tracked && h < LLAMA_KVCOMP_MAX_HEADS ? ls.v_scale[h] : 0.0f;
            hs.buf_l2_k = h < n_head_k ? k_l2[h] : 0.0f;
            hs.buf_l2_v = h < n_head_v ? v_l2[h] : 0.0f;
            out.push_back(hs);
        }
    }
}

// x[0] x[0] + ... + x[n-1] x[n-1]: a head's row in float, 8 partial sums so that the loop
// vectorizes without reordering a float sum (the monitor reads every held slot at each refresh,
// where a double per product made the refresh a twentieth of a short decode step), the rows
// added in double by the caller
static double sum_squares(const float * x, int64_t n) {
    float s[8] = { 0.0f };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; ++l) {
            s[l] += x[i + l] * x[i + l];
        }
    }
    double t = ((double) s[0] + s[4]) + ((double) s[1] + s[5]) + (((double) s[2] + s[6]) + ((double) s[3] + s[7]));
    for (; i < n; ++i) {
        t += (double) x[i] * x[i];
    }
    return t;
}

void llama_kvcomp_buffer::slot_norms(int32_t ib, std::vector<float> & k_l2, std::vector<float> & v_l2, int64_t n_head_k,
                                     int64_t n_head_v) const {
    k_l2.assign(n_head_k, 0.0f);
    v_l2.assign(n_head_v, 0.0f);
    if (!buffered) {
        return;
    }
    // held slots only, each converted once, read in place from a host buffer (the monitor
    // refreshes during decoding)
    using to_f32_t = void (*)(const ggml_fp16_t *, float *, int64_t);
    static const to_f32_t cpu_to_f32 = (to_f32_t) llama_kvcomp_cpu_proc("ggml_cpu_fp16_to_fp32");
    const to_f32_t to_f32 = cpu_to_f32 ? cpu_to_f32 : ggml_fp16_to_fp32_row;
    std::vector<uint8_t> raw;
    std::vector<float> row;
    const auto norms = [&](const ggml_tensor * t, std::vector<float> & out) {
        const int64_t n = t->ne[0], d = n / (int64_t) out.size();
        const bool host = ggml_backend_buffer_is_host(t->buffer);
        row.resize((size_t) n);
        std::vector<double> acc(out.size(), 0.0);
        for (size_t st = 0; st < maps.size(); ++st) {
            const size_t off = st * n_rows() * t->nb[1];
            const uint8_t * src = (const uint8_t *) t->data + off;
            if (!host) {
                raw.resize(n_slots() * t->nb[1]);
                ggml_backend_tensor_get(t, raw.data(), off, raw.size());
                src = raw.data();
            }
            for (uint32_t s = 0; s < n_slots(); ++s) {
                if (maps[st].slot_kinds[s] == SLOT_KIND_FREE || maps[st].slot_kinds[s] == SLOT_KIND_SPARE) {
                    continue;
                }
                to_f32((const ggml_fp16_t *) (src + s * t->nb[1]), row.data(), n);
                for (size_t h = 0; h < out.size(); ++h) {
                    acc[h] += sum_squares(row.data() + (int64_t) h * d, d);
                }
            }
        }
        for (size_t h = 0; h < out.size(); ++h) {
            out[h] = (float) std::sqrt(acc[h]);
        }
    };
    norms(k_buf[ib], k_l2);
    norms(v_buf[ib], v_l2);
}

bool llama_kvcomp_source_stats(const llama_kv_cache & kv, llama_kvcomp_stats & st) {
    if (!kv.kvcomp) {
        return false;
    }
    st = kv.kvcomp->get_stats();
    return true;
}

void llama_kvcomp_source_heads(const llama_kv_cache & kv, std::vector<llama_kvcomp_head_snapshot> & out) {
    kv.kvcomp->head_snapshots(kv, out);
}

const llama_kvcomp_tracker * llama_kvcomp_source_tracker(const llama_kv_cache & kv, int32_t il, int32_t & ib) {
    return kv.kvcomp ? llama_kvcomp_tracker::of_layer(kv.get_k_storage(il), ib) : nullptr;
}

const llama_kvcomp_tracker * llama_kvcomp_source_tracker(const llama_kv_cache & kv) {
    const std::vector<uint32_t> ids = kv.get_layer_ids();
    int32_t ib = -1;
    return ids.empty() ? nullptr : llama_kvcomp_source_tracker(kv, (int32_t) ids[0], ib);
}

void llama_kvcomp_source_head_scales(const llama_kvcomp_tracker & tr, int32_t ib, int32_t h, float & k_scale, float & v_scale) {
    tr.get_head_scales(ib, h, k_scale, v_scale);
}

int64_t llama_kvcomp_source_n_nonfinite(const llama_kvcomp_tracker & tr) {
    return tr.n_nonfinite();
}

llama_kvcomp_stats llama_kvcomp_buffer::get_stats() const {
    llama_kvcomp_stats st = {};
    st.n_slots         = (int32_t) (n_slots() * maps.size());
    st.n_pin_budget    = (int32_t) pin_budget;
    st.n_merges        = n_merges;
    st.n_released      = n_released;
    st.n_overflow      = n_overflow;
    st.evicted_err_max = evicted_err_max;
    for (const stream_map & m : maps) {
        for (uint32_t s = 0; s < n_slots(); ++s) {
            if (m.slot_kinds[s] == SLOT_KIND_FREE || m.slot_kinds[s] == SLOT_KIND_SPARE) {
                continue;
            }
            ++st.n_used;
            if (m.slot_kinds[s] == SLOT_KIND_PINNED) {
                st.pin_err_min = st.n_pinned == 0 ? m.slot_err[s] : std::min(st.pin_err_min, m.slot_err[s]);
                ++st.n_pinned;
            }
        }
    }
    return st;
}

int32_t llama_kvcomp_buffer::attach(llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max) {
    // a tracker stays with the cache once it has set offsets: the cached keys carry them
    std::shared_ptr<llama_kvcomp_tracker> tracker = kv.kvcomp ? kv.kvcomp->tracker : nullptr;
    std::shared_ptr<llama_kvcomp_plans>   plans   = kv.kvcomp ? kv.kvcomp->plans : nullptr;
    // An unquantized cache already holds every row exactly: exact copies or a K offset would
    // compensate nothing and only change how attention rounds, so they stay off there and the
    // logits are upstream's bit for bit (docs/design-residual-buffer.md, "Exact caches").
    // A kvct K row is centred and scaled by its plan, which a run-time offset would only move
    // away from the statistics the plan was fitted to.
    const ggml_type type_k = kv.layers[0].k->type;
    const bool wants_tracker = params.tracker && ggml_is_quantized(type_k) && !ggml_kvcomp_is_kvct(type_k);
    if (params.tracker && !wants_tracker) {
        LLAMA_LOG_INFO("kvcomp: K is %s, %s: the scale tracker stays off\n", ggml_type_name(type_k),
                       ggml_kvcomp_is_kvct(type_k) ? "coded with fixed plans" : "stored exactly");
    }
    if (wants_slots(params) && !lossy(kv)) {
        LLAMA_LOG_INFO("kvcomp: K/V are %s/%s, stored exactly: the residual buffer stays off\n",
                ggml_type_name(kv.layers[0].k->type), ggml_type_name(kv.layers[0].v->type));
    }
    if (!wants_slots(params) && !params.tracker && !tracker && !plans) {
        kv.kvcomp.reset();
        return 0;
    }
    if (kv.v_trans && ((wants_slots(params) && lossy(kv)) || wants_tracker || tracker || plans)) {
        return llama_kvcomp_fail(-2, "kvcomp needs flash attention (-fa on)");
    }
    try {
        if (!tracker && wants_tracker) {
            std::vector<llama_kvcomp_tracker::layer_desc> descs;
            for (const auto & l : kv.layers) {
                descs.push_back({ l.k, l.v, (int32_t) l.il, (int64_t) kv.hparams.n_embd_head_k(l.il), (int64_t) kv.hparams.n_embd_head_v(l.il) });
            }
            tracker = std::make_shared<llama_kvcomp_tracker>(descs, params, kv.n_stream, n_ubatch, n_seq_max > kv.n_stream);
        }
        if (tracker) {
            tracker->set_params(params);
        }
        auto next = std::make_shared<llama_kvcomp_buffer>(kv, params, n_ubatch, n_seq_max, tracker);
        next->plans = plans;
        if (kv.kvcomp) {
            next->adopt_storage(*kv.kvcomp);
            next->on_ubatch = kv.kvcomp->on_ubatch;
        }
        kv.kvcomp = next;
    } catch (const std::exception & e) {
        // the residual buffer is what grows with the knobs: say which ones sized it
        const std::string why = std::string("the residual buffer could not be allocated (") + e.what() + "): window " +
            std::to_string(params.window) + ", sinks " + std::to_string(params.sinks) + ", merge interval " +
            std::to_string(params.merge_interval) + " and pin budget " + std::to_string(params.pin_budget) +
            "% size it; lower --kv-comp-window, --kv-comp-sinks, --kv-comp-merge or --kv-comp-pin-budget";
        return llama_kvcomp_fail(-3, why);
    }
    return 0;
}

void llama_kvcomp_buffer::cache_types(const llama_kv_cache & kv, ggml_type & type_k, ggml_type & type_v) {
    const auto most = [&](ggml_tensor * llama_kv_cache::kv_layer::*t) {
        size_t best = 0;
        ggml_type out = (kv.layers[0].*t)->type;
        for (const auto & l : kv.layers) {
            const size_t n = std::count_if(kv.layers.begin(), kv.layers.end(), [&](const auto & o) { return (o.*t)->type == (l.*t)->type; });
            // a tie goes to the wider type: a per-layer rule narrows the edges of the -ctk type,
            // and a 4-layer model has as many edge layers as others
            if (n > best || (n == best && ggml_row_size((l.*t)->type, 256) > ggml_row_size(out, 256))) {
                best = n;
                out  = (l.*t)->type;
            }
        }
        return out;
    };
    type_k = most(&llama_kv_cache::kv_layer::k);
    type_v = most(&llama_kv_cache::kv_layer::v);
}

int32_t llama_kvcomp_buffer::set_k_stats(llama_kv_cache & kv, const std::shared_ptr<llama_kvcomp_kstats> & stats, uint32_t n_ubatch,
                                         uint32_t n_seq_max) {
    const ggml_type type_k = kv.layers[0].k->type;
    if (!ggml_kvcomp_is_kvct(type_k)) {
        LLAMA_LOG_INFO("kvcomp: K is %s: the K statistics are not used (they serve the kvct caches)\n", ggml_type_name(type_k));
        return 0;
    }
    if (kv.v_trans) {
        return llama_kvcomp_fail(-2, std::string("a ") + ggml_type_name(type_k) + " K cache needs flash attention (-fa on)");
    }
    for (uint32_t strm = 0; strm < kv.n_stream; ++strm) {
        if (kv.v_cells[strm].get_used() > 0) {
            return llama_kvcomp_fail(-2, "the K statistics are set before the cache holds tokens (its rows would be read with "
                                         "other plans)");
        }
    }
    std::shared_ptr<llama_kvcomp_plans> plans;
    try {
        std::vector<llama_kvcomp_plans::layer_desc> descs;
        for (const auto & l : kv.layers) {
            descs.push_back({ l.k, (int32_t) l.il, (int64_t) kv.hparams.n_embd_head_k(l.il) });
        }
        plans = std::make_shared<llama_kvcomp_plans>(descs, *stats);
    } catch (const std::runtime_error & e) {
        return llama_kvcomp_fail(-1, std::string("K statistics '") + stats->path + "': " + e.what());
    }
    try {
        if (!kv.kvcomp) {
            kv.kvcomp = std::make_shared<llama_kvcomp_buffer>(kv, llama_kvcomp_default_params(), n_ubatch, n_seq_max, nullptr);
        }
    } catch (const std::exception & e) {
        return llama_kvcomp_fail(-3, e.what());
    }
    kv.kvcomp->plans = plans;
    // The plans code K's own channels, where RoPE's pairs and their energies are: upstream's
    // Hadamard rotation of a quantized K (and of Q) would spread them evenly over the head, so
    // it is off for a kvct cache (the plan takes its place).
    kv.attn_rot_k = false;
    size_t k_bytes = 0;
    for (const auto & l : kv.layers) {
        k_bytes += ggml_nbytes(l.k);
    }
    std::string types, types_v;
    for (const auto & l : kv.layers) {
        types   += std::string(types.empty() ? "" : ",") + ggml_type_name(l.k->type);
        types_v += std::string(types_v.empty() ? "; V " : ",") + ggml_type_name(l.v->type);
    }
    types += types_v;
    LLAMA_LOG_INFO("kvcomp: K plans of %zu layers (%s) from '%s' (%llu tokens of %s): %.2f MiB beside %.2f MiB of K rows\n",
                   kv.layers.size(), types.c_str(), stats->path.c_str(), (unsigned long long) stats->n_tokens,
                   stats->arch.c_str(), plans->nbytes() / (1024.0 * 1024.0), k_bytes / (1024.0 * 1024.0));
    return 0;
}

bool llama_kvcomp_buffer::ready(const llama_kv_cache & kv) {
    const ggml_type type_k = kv.layers[0].k->type;
    const ggml_type type_v = kv.layers[0].v ? kv.layers[0].v->type : GGML_TYPE_F16;
    if (!ggml_kvcomp_is_kvct(type_v) && (!ggml_kvcomp_is_kvct(type_k) || (kv.kvcomp && kv.kvcomp->plans))) {
        return true;
    }
    const std::string why = ggml_kvcomp_is_kvct(type_v) ?
        std::string("V cannot be ") + ggml_type_name(type_v) + ": the kvct types code K rows only (use kvc4 or kvc3 for V)" :
        std::string("a ") + ggml_type_name(type_k) +
            " K cache needs its plans: load K statistics first (--kv-comp-kstats FILE, llama_kvcomp_set_k_stats; "
            "`kvcomp calibrate` writes them)";
    llama_kvcomp_fail(-1, why);
    return false;
}

bool llama_kvcomp_buffer::get_layer_stats(int32_t il, llama_kvcomp_layer_stats & st) const {
    if (!tracker || il < 0 || il >= (int32_t) layer_of_il.size() || layer_of_il[il] < 0) {
        return false;
    }
    st = {};
    st.il = il;
    tracker->get_layer_stats(layer_of_il[il], st);
    return true;
}

void llama_kvcomp_check_device(ggml_backend_dev_t dev, int32_t il, ggml_type type_k, ggml_type type_v) {
    for (const ggml_type t : { type_k, type_v }) {
        if (!ggml_kvcomp_dev_knows_type(dev, t)) {
            throw std::runtime_error(std::string("kvcomp: the KV cache of layer ") + std::to_string(il) + " would live on " +
                                     ggml_backend_dev_name(dev) + " (" + ggml_backend_dev_description(dev) + "), an rpc-server that does not know the type " +
                                     ggml_type_name(t) + " (one built without the kvcomp types, such as upstream's): run "
                                     "this build's ggml-rpc-server there, or keep the KV cache here with --no-kv-offload");
        }
    }
    // (the plans are fitted later, but the context's first graph already places the rows' writes)
    // kvct: the CUDA backend has kernels for its nodes, but they have not run on a GPU yet, and
    // a device cache's residual buffer writes its rows in another order
    for (const ggml_type t : { type_k, type_v }) {
        if ((ggml_kvcomp_is_cpu_only(t) || ggml_kvcomp_is_kvct(t)) && !ggml_kvcomp_dev_cpu_kernels(dev)) {
            throw std::runtime_error(std::string("kvcomp: the KV cache of layer ") + std::to_string(il) + " would live on " +
                                     ggml_backend_dev_name(dev) + " (" + ggml_backend_dev_description(dev) + "): " +
                                     ggml_type_name(t) + " caches run on the CPU backend for now, here or on an "
                                     "rpc-server of this build: keep the KV cache in host memory (--no-kv-offload)");
        }
    }
}
