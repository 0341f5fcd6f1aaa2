#include "kvcomp-buffer.h"
#include "kvcomp-state.h"

#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-io.h"

#include "ggml-kvcomp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>

// "KVCB": the buffer's part of a state, after upstream's cells
static constexpr uint32_t KVCOMP_STATE_MAGIC   = 0x4243564b;
// 4: the tracker part holds a K offset per stream (3: one for all, 2: channel scales too)
static constexpr uint32_t KVCOMP_STATE_VERSION = 6;

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
    // for a reused or restored prompt) gives the logits of the first run.
    //
    // The window is held once when the slot writes follow the layer's attention: a token
    // then takes the slot of a row that only its own ubatch's queries still see exactly, and
    // W + S + N - 1 slots per sequence take any split of a prompt. Not when outliers are
    // measured (every row waits a ubatch in a slot of its own), when later layers read this
    // cache's slots (they attend after the write), or on a device cache (attention reads a
    // copy that the write precedes until the device kernels read the slots, issue 21).
    bool host = true;
    for (const auto & l : kv.layers) {
        host = host && ggml_kvcomp_buffer_cpu_kernels(l.k->buffer) && ggml_kvcomp_buffer_cpu_kernels(l.v->buffer);
    }
    give_away = buffered && host && params.pin_threshold <= 0.0f && kv.map_layer_ids.size() == kv.layers.size();
    const uint32_t n_window = n_seq * (uint32_t) (params.window + params.sinks + params.merge_interval - 1 + KVCOMP_CUT_BACK);
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

bool llama_kvcomp_buffer::is_exact(llama_pos key, llama_pos query, bool pinned) const {
    return pinned || key < params.sinks || key > query - params.window;
}

void llama_kvcomp_buffer::free_slot(stream_map & m, uint32_t s) {
    if (m.slot_cell[s] >= 0) {
        m.cell_slot[m.slot_cell[s]] = -1;
    }
    m.slot_cell[s]  = -1;
    m.slot_kinds[s] = SLOT_KIND_FREE;
}

void llama_kvcomp_buffer::set_slot(stream_map & m, uint32_t s, uint32_t cell, llama_pos pos, slot_kind kind) {
    m.slot_cell[s]  = (int32_t) cell;
    m.slot_pos[s]   = pos;
    m.slot_kinds[s] = kind;
    m.slot_err[s]   = 0.0f;
    m.cell_slot[cell] = (int32_t) s;
}

uint32_t llama_kvcomp_buffer::n_main(uint32_t n_kv, uint32_t kv_size, int32_t il, bool is_k) const {
    if (!buffered) {
        return n_kv;
    }
    const ggml_tensor * cur = (is_k ? k_cur : v_cur)[layer_of_il[il]];
    // (a reserve graph spans every stream; whatever the count, its main part is the whole cache)
    const uint32_t n_streams = ub_streams.empty() ? 1 : (uint32_t) ub_streams.size();
    const uint32_t extra = n_extra(cur ? (uint32_t) cur->ne[1] / n_streams : 0);
    GGML_ASSERT(n_kv > extra);
    // a worst-case reserve graph reports n_extra_max() on top of the whole cache
    return std::min(n_kv - extra, kv_size);
}

// ||x - deq(q(x))|| / ||x|| over the token's K and V rows in every layer: x is the slot's
// F16 row, deq(q(x)) the main cache's row.
void llama_kvcomp_buffer::main_row_f32(const ggml_tensor * main, int32_t ib, bool is_k, uint64_t row, llama_pos pos,
                                       std::vector<uint8_t> & raw, float * y) const {
    raw.resize(main->nb[1]);
    ggml_backend_tensor_get(main, raw.data(), row * main->nb[1], main->nb[1]);
    if (is_k && plans) {
        plans->row_to_f32(ib, raw.data(), y, pos);
    } else if (main->type == GGML_TYPE_F32) {
        std::memcpy(y, raw.data(), main->ne[0] * sizeof(float));
    } else {
        ggml_get_type_traits(main->type)->to_float(raw.data(), y, main->ne[0]);
    }
}

float llama_kvcomp_buffer::measure(const llama_kv_cache & kv, uint32_t strm, uint32_t s) const {
    const uint64_t c = (uint64_t) strm * kv.get_size() + maps[strm].slot_cell[s];
    const uint64_t r = (uint64_t) strm * n_rows() + s;
    double err = 0.0, ref = 0.0;
    std::vector<uint8_t> raw;
    std::vector<ggml_fp16_t> exact;
    std::vector<float> x, y;
    for (size_t ib = 0; ib < k_buf.size(); ++ib) {
        for (int is_k = 0; is_k < 2; ++is_k) {
            const ggml_tensor * main  = is_k ? kv.layers[ib].k : kv.layers[ib].v;
            const ggml_tensor * slots = is_k ? k_buf[ib] : v_buf[ib];
            const int64_t n = main->ne[0];
            exact.resize(n);
            x.resize(n);
            y.resize(n);
            main_row_f32(main, (int32_t) ib, is_k, c, kv.v_cells[strm].pos_get(maps[strm].slot_cell[s]), raw, y.data());
            ggml_backend_tensor_get(slots, exact.data(), r * slots->nb[1], slots->nb[1]);
            ggml_fp16_to_fp32_row(exact.data(), x.data(), n);
            for (int64_t i = 0; i < n; ++i) {
                err += (double) (x[i] - y[i]) * (x[i] - y[i]);
                ref += (double) x[i] * x[i];
            }
        }
    }
    return ref > 0.0 ? (float) std::sqrt(err / ref) : 0.0f;
}

// A measured token that left the window: an outlier stays (pinned) within the budget, the
// least harmful pin making room for a worse one; everything else is released.
void llama_kvcomp_buffer::pin_or_free(stream_map & m, uint32_t s) {
    if (params.pin_threshold <= 0.0f || m.slot_err[s] <= params.pin_threshold || pin_budget == 0) {
        m.slot_kinds[s] = SLOT_KIND_SPARE;
        return;
    }
    uint32_t n_pinned = 0;
    int32_t  weakest  = -1;
    for (uint32_t t = 0; t < n_slots(); ++t) {
        if (m.slot_kinds[t] == SLOT_KIND_PINNED) {
            ++n_pinned;
            if (weakest < 0 || m.slot_err[t] < m.slot_err[weakest]) {
                weakest = (int32_t) t;
            }
        }
    }
    if (n_pinned >= pin_budget) {
        if (m.slot_err[weakest] >= m.slot_err[s]) {
            evicted_err_max = std::max(evicted_err_max, m.slot_err[s]);
            m.slot_kinds[s] = SLOT_KIND_SPARE;
            return;
        }
        evicted_err_max = std::max(evicted_err_max, m.slot_err[weakest]);
        free_slot(m, (uint32_t) weakest);
    }
    m.slot_kinds[s] = SLOT_KIND_PINNED;
}

void llama_kvcomp_buffer::apply(const llama_kv_cache & kv, const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ubatch) {
    // before the tracker sets up this ubatch: what the monitor reads is final then
    if (monitor) {
        monitor->on_ubatch(kv);
    }
    if (tracker) {
        tracker->update(kv.v_cells, sinfo, ubatch);
    }
    if (!buffered) {
        return;
    }
    for (auto & m : maps) {
        std::fill(m.cell_ub.begin(), m.cell_ub.end(), -1);
        std::fill(m.cell_given.begin(), m.cell_given.end(), -1);
    }
    ub_streams.assign(sinfo.strm.begin(), sinfo.strm.end());
    ++n_applied;
    // the ubatch holds the same number of tokens for each of its streams, stream by stream
    for (size_t s = 0; s < sinfo.n_stream(); ++s) {
        apply_stream(kv, sinfo.strm[s], sinfo.idxs[s], ubatch, (uint32_t) (s * sinfo.size()));
    }
    if (tracker && tracker->n_reencode() > 0) {
        // the slots of the rows the tracker stores again take them too
        std::vector<int64_t> rows;
        for (uint64_t r : tracker->reencode_list()) {
            const uint32_t strm = (uint32_t) (r / kv.get_size());
            const int32_t slot = maps[strm].read_slot((uint32_t) (r % kv.get_size()));
            rows.push_back((int64_t) strm * n_rows() + (slot >= 0 ? slot : n_slots()));
        }
        ggml_backend_tensor_set(reencode_slots, rows.data(), 0, rows.size() * sizeof(int64_t));
    }
}

const void * llama_kvcomp_buffer::graph_id() const {
    // a graph that stores earlier rows again is not one to reuse, nor is the next one
    return &graph_ids[tracker ? tracker->graph_variant() : 0];
}

void llama_kvcomp_buffer::apply_stream(const llama_kv_cache & kv, uint32_t strm, const std::vector<uint32_t> & cells_ub,
                                       const llama_ubatch & ubatch, uint32_t i0) {
    const auto & cells = kv.v_cells[strm];
    stream_map & m = maps[strm];

    for (uint32_t i = 0; i < cells_ub.size(); ++i) {
        m.cell_ub[cells_ub[i]] = (int32_t) i;
    }

    // the earliest query of each sequence in this ubatch, and the first one after it
    std::map<llama_seq_id, llama_pos> first_query, next_query;
    for (uint32_t i = i0; i < i0 + cells_ub.size(); ++i) {
        for (int32_t j = 0; j < ubatch.n_seq_id[i]; ++j) {
            const llama_seq_id seq = ubatch.seq_id[i][j];
            auto it = first_query.find(seq);
            if (it == first_query.end() || ubatch.pos[i] < it->second) {
                first_query[seq] = ubatch.pos[i];
            }
            next_query[seq] = std::max(next_query.count(seq) ? next_query[seq] : 0, ubatch.pos[i] + 1);
        }
    }

    // whether a query of this ubatch or a later one (from_query: first_query), or a later
    // one only (next_query), sees the row of cell c exactly
    const auto wanted = [&](int32_t c, llama_pos pos, const std::map<llama_seq_id, llama_pos> & from_query) {
        for (llama_seq_id seq = 0; seq < LLAMA_MAX_SEQ; ++seq) {
            if (!cells.seq_has(c, seq)) {
                continue;
            }
            const auto it = from_query.find(seq);
            if (is_exact(pos, it != from_query.end() ? it->second : cells.seq_pos_max(seq) + 1, false)) {
                return true;
            }
        }
        return false;
    };
    // a slot a token of this ubatch may take (the window held once), unless a query after a
    // cut-back of up to KVCOMP_CUT_BACK tokens sees its row exactly
    std::map<llama_seq_id, llama_pos> kept_query = next_query;
    for (auto & [seq, pos] : kept_query) {
        pos = std::max<llama_pos>(0, pos - KVCOMP_CUT_BACK);
    }
    const auto givable = [&](uint32_t s) {
        return give_away && m.slot_cell[s] >= 0 && m.slot_kinds[s] == SLOT_KIND_ROW && m.slot_pos[s] >= params.sinks &&
               m.cell_ub[m.slot_cell[s]] < 0 && !wanted(m.slot_cell[s], m.slot_pos[s], kept_query);
    };

    // A cell that was removed, overwritten (now or by a state load) or moved no longer
    // matches the row in its slot; rows written by the last ubatch get their error measured.
    // A spare (a released row kept while its slot is not needed) that a query sees exactly
    // again, after its sequence was cut back, is a row again.
    uint32_t n_used = 0;
    std::vector<uint32_t> give_order; // the slots a token may take, oldest row first
    for (uint32_t s = 0; s < n_slots(); ++s) {
        const int32_t c = m.slot_cell[s];
        if (c < 0) {
            continue;
        }
        if (cells.is_empty(c) || cells.pos_get(c) != m.slot_pos[s] || m.cell_ub[c] >= 0) {
            free_slot(m, s);
            continue;
        }
        if (m.slot_kinds[s] == SLOT_KIND_SPARE) {
            if (!wanted(c, m.slot_pos[s], first_query)) {
                continue;
            }
            m.slot_kinds[s] = SLOT_KIND_ROW;
        }
        if (m.slot_kinds[s] == SLOT_KIND_STAGED) {
            m.slot_err[s] = measure(kv, strm, s);
        }
        ++n_used;
        if (givable(s)) {
            give_order.push_back(s);
        }
    }
    std::sort(give_order.begin(), give_order.end(), [&](uint32_t a, uint32_t b) {
        return std::make_pair(m.slot_pos[a], a) < std::make_pair(m.slot_pos[b], b);
    });

    // the tokens of this ubatch that a later query sees exactly, after a cut-back too
    std::vector<bool> needs_slot(cells_ub.size(), params.pin_threshold > 0.0f);
    uint32_t n_needed = 0;
    for (uint32_t i = 0; i < cells_ub.size(); ++i) {
        for (int32_t j = 0; j < ubatch.n_seq_id[i0 + i] && !needs_slot[i]; ++j) {
            needs_slot[i] = is_exact(ubatch.pos[i0 + i], kept_query[ubatch.seq_id[i0 + i][j]], false);
        }
        n_needed += needs_slot[i];
    }

    // merge (release) on the fixed interval, when the slots fill past merge_at, or when this
    // ubatch would not fit
    const bool merge = n_applied % (uint64_t) params.merge_interval == 0 ||
                       n_used >= params.merge_at * n_slots() ||
                       n_used - (uint32_t) give_order.size() + n_needed > n_slots();
    if (merge) {
        ++n_merges;
        for (uint32_t s = 0; s < n_slots(); ++s) {
            const int32_t c = m.slot_cell[s];
            if (c < 0 || m.slot_kinds[s] == SLOT_KIND_PINNED || m.slot_kinds[s] == SLOT_KIND_SPARE || m.slot_pos[s] < params.sinks) {
                continue;
            }
            if (!wanted(c, m.slot_pos[s], first_query)) {
                pin_or_free(m, s);
                n_released += m.slot_kinds[s] == SLOT_KIND_SPARE;
            }
        }
    }
    for (uint32_t s = 0; s < n_slots(); ++s) {
        if (m.slot_kinds[s] == SLOT_KIND_STAGED) {
            m.slot_kinds[s] = SLOT_KIND_ROW;
        }
    }

    // A slot follows the position (a ring) whenever it is free, so the keys reach attention
    // in the same order however the prompt was split into ubatches: attention sums in key
    // order, and a different order alone moves logits by ~1e-2 on SmolLM2.
    uint32_t next_free = 0;
    size_t   next_give = 0;
    for (uint32_t i = 0; i < cells_ub.size(); ++i) {
        if (!needs_slot[i]) {
            continue;
        }
        const llama_pos pos = ubatch.pos[i0 + i];
        const auto available = [&](uint32_t t) { return m.slot_cell[t] < 0 || m.slot_kinds[t] == SLOT_KIND_SPARE; };
        int32_t s = -1;
        if (available(pos % n_slots())) {
            s = pos % n_slots();
        } else {
            while (next_free < n_slots() && m.slot_cell[next_free] >= 0) {
                ++next_free;
            }
            // no free slot: the spare of the oldest position, which a cut-back reaches last,
            // else the oldest row only this ubatch still sees exactly
            uint32_t pick = next_free;
            for (uint32_t t = 0; t < n_slots() && next_free == n_slots(); ++t) {
                if (m.slot_kinds[t] == SLOT_KIND_SPARE && (pick == n_slots() || m.slot_pos[t] < m.slot_pos[pick])) {
                    pick = t;
                }
            }
            // (a merge may have made one a spare since, or a token taken it)
            while (pick == n_slots() && next_give < give_order.size()) {
                const uint32_t t = give_order[next_give++];
                if (givable(t)) {
                    m.cell_given[m.slot_cell[t]] = (int32_t) t;
                    pick = t;
                }
            }
            if (pick == n_slots()) {
                // pins and rows still in some window fill every slot: the token is attended
                // through its quantized row, which is correct, only not exact. Said once per
                // buffer (this repeats per token); the count is in the stats and at the end.
                if (n_overflow == 0) {
                    LLAMA_LOG_WARN("%s: residual buffer full, position %d stays quantized (further ones are counted, "
                                   "not logged)\n", __func__, pos);
                }
                ++n_overflow;
                continue;
            }
            s = (int32_t) pick;
        }
        free_slot(m, (uint32_t) s);
        set_slot(m, (uint32_t) s, cells_ub[i], pos, params.pin_threshold > 0.0f ? SLOT_KIND_STAGED : SLOT_KIND_ROW);
    }
}

ggml_tensor * llama_kvcomp_buffer::cpy(ggml_context * ctx0, ggml_tensor * cache, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_k) const {
    const int64_t n_tokens = cur->ne[1];
    ggml_tensor * idx_main = ggml_view_1d(ctx0, idxs, n_tokens, 0);
    ggml_tensor * idx_slot = ggml_view_1d(ctx0, idxs, n_tokens, n_tokens * ggml_element_size(idxs));

    const int32_t ib = layer_of_il[il];
    ggml_tensor * slots = (is_k ? k_buf : v_buf)[ib];
    if (tracker) {
        cur = tracker->transform(ctx0, cur, ib, is_k);
        if (ggml_tensor * again = tracker->reencoded(ib)) {
            // before this ubatch's rows, which may take the same slots
            cache = ggml_set_rows(ctx0, cache, again, tracker->reencode_rows(ctx0));
            if (buffered) {
                slots = ggml_set_rows(ctx0, slots, again, ggml_view_1d(ctx0, reencode_slots, again->ne[1], 0));
            }
        }
    }
    if (buffered) {
        (is_k ? k_read : v_read)[ib]       = slots;
        (is_k ? k_written : v_written)[ib] = ggml_set_rows(ctx0, slots, cur, idx_slot);
        (is_k ? k_cur : v_cur)[ib]         = cur;
    }

    ggml_tensor * rows = is_k && plans && plans->pre_rope() ? pre_rope_rows(ctx0, cur, ib) : cur;
    ggml_tensor * out = ggml_set_rows(ctx0, cache, rows, idx_main);
    if (is_k && plans) {
        ggml_kvct_set_plans(out, plans->tensor(ib));
    }
    return out;
}

// K rows as the model computed them before its RoPE, which cur (upstream's [n_embd_k_gqa,
// n_tokens] view of K) turned: the RoPE node's input, when the plans can follow that RoPE.
// Otherwise the layer codes cur itself, read without a turn: correct, with plans fitted for
// other rows (said once per layer).
ggml_tensor * llama_kvcomp_buffer::pre_rope_rows(ggml_context * ctx0, ggml_tensor * cur, int32_t ib) const {
    const ggml_tensor * rope = cur->op == GGML_OP_VIEW && cur->view_offs == 0 ? cur->src[0] : nullptr;
    if (!rope || rope->op != GGML_OP_ROPE || !ggml_are_same_shape(rope, rope->src[0]) || !plans->set_rope(ib, rope)) {
        if (!rope_warned[ib]) {
            LLAMA_LOG_WARN("kvcomp: cache layer %d: K does not come from a RoPE the kvct plans follow; its rows are coded "
                           "after RoPE\n", ib);
            rope_warned[ib] = true;
        }
        // a model's graphs build K alike, so a layer never has rows of both kinds
        GGML_ASSERT(!plans->has_rope(ib) && "kvcomp: a layer's K changed from RoPE rows to others within one context");
        return cur;
    }
    ggml_tensor * pre = rope->src[0];
    if (pre->nb[0] != ggml_type_size(pre->type) || pre->nb[1] != ggml_row_size(pre->type, pre->ne[0])) {
        pre = ggml_cont(ctx0, pre);
    }
    return ggml_view_2d(ctx0, pre, cur->ne[0], cur->ne[1], pre->nb[2], 0);
}

ggml_tensor * llama_kvcomp_buffer::get(ggml_context * ctx0, ggml_tensor * main_view, int32_t il, bool is_k) const {
    const int32_t ib  = layer_of_il[il];
    if (is_k && plans) {
        // the attention node takes the plans from here (llama_kvcomp_add_exact finds them by name)
        ggml_tensor * pv = ggml_kvct_plans_view(ctx0, plans->tensor(ib), plans->has_rope(ib) ? plans->positions(ib) : nullptr);
        ggml_format_name(pv, "kvcomp_plans_k-%d", il);
        ggml_format_name(main_view, "kvcomp_main_k-%d", il);
    }
    if (!buffered) {
        return main_view;
    }
    const int64_t ne0 = main_view->ne[0];
    const int64_t ne1 = main_view->ne[1];
    const int64_t ns  = main_view->ne[3];
    // the first stream of the graph being built, which a reserve graph (all streams) does not
    // share with the last ubatch
    const size_t  s0  = main_view->view_offs / main_view->nb[3];

    ggml_tensor * & read    = (is_k ? k_read : v_read)[ib];
    ggml_tensor * & written = (is_k ? k_written : v_written)[ib];
    ggml_tensor * & cur     = (is_k ? k_cur : v_cur)[ib];
    const ggml_tensor * cache = main_view->view_src ? main_view->view_src : main_view;
    const bool device = cache->buffer && !ggml_kvcomp_buffer_cpu_kernels(cache->buffer);
    // (a layer that reads another layer's cache finds no write of its own in this graph)
    ggml_tensor * slots = device && written ? written : read ? read : (is_k ? k_buf : v_buf)[ib];

    // The exact rows: the slots, read where they lie, and the ubatch's own rows rounded to F16
    // as the slots hold them, so a key seen exactly is the same value in a batched prompt and
    // in a decode step (the ubatch's streams are consecutive, as upstream's views of the main
    // cache assume).
    ggml_tensor * exact = ggml_view_4d(ctx0, slots, ne0, ne1, n_slots(), ns,
            ggml_row_size(slots->type, ne0), slots->nb[1], slots->nb[1] * n_rows(), slots->nb[1] * n_rows() * s0);
    ggml_tensor * exact_ub = nullptr;
    if (cur) {
        const int64_t n_tps = cur->ne[1] / ns;
        exact_ub = ggml_view_4d(ctx0, cur, ne0, ne1, n_tps, ns, ggml_row_size(cur->type, ne0), cur->nb[1], cur->nb[1] * n_tps, 0);
    }
    const char c = is_k ? 'k' : 'v';
    if (written && !device) {
        // added to the graph after the layer's attention by llama_kvcomp_add_exact
        ggml_format_name(written, "kvcomp_write_%c-%d", c, il);
    }
    read    = nullptr;
    written = nullptr;
    cur     = nullptr;

    if (device) {
        // Device caches: until the GPU kernels read the exact rows as their own sources
        // (issue 21), attention reads an F16 copy of the main cells joined to them, taken
        // after the slot write. (A cache on an rpc-server of this build on the CPU is read as
        // in host memory, by the server.)
        ggml_tensor * all = ggml_concat(ctx0, ggml_cast(ctx0, main_view, GGML_TYPE_F16), exact, 2);
        return exact_ub ? ggml_concat(ctx0, all, ggml_cast(ctx0, exact_ub, GGML_TYPE_F16), 2) : all;
    }
    // Host caches: attention reads the main cells where they lie and the exact rows as further
    // sources, attached to the node by llama_kvcomp_add_exact, which finds them by these names
    // (the ubatch's F32 rows are read as their F16 rounding, so no cast node).
    ggml_format_name(main_view, "kvcomp_main_%c-%d", c, il);
    ggml_format_name(exact, "kvcomp_exact_%c-%d", c, il);
    if (is_k) {
        ggml_tensor * order = ggml_view_2d(ctx0, exact_order, exact_order->ne[0], ns, exact_order->nb[1], 0);
        ggml_format_name(order, "kvcomp_order-%d", il);
    }
    if (exact_ub) {
        ggml_format_name(exact_ub, "kvcomp_ubatch_%c-%d", c, il);
    }
    return main_view;
}

void llama_kvcomp_add_exact(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * fa) {
    const ggml_tensor * k = fa->src[1];
    const ggml_tensor * v = fa->src[2];
    if (k->op != GGML_OP_PERMUTE || v->op != GGML_OP_PERMUTE) {
        return;
    }
    int il_k = -1;
    int il_v = -1;
    if (ggml_kvcomp_is_kvct(k->type) && sscanf(k->src[0]->name, "kvcomp_main_k-%d", &il_k) == 1) {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_plans_k-%d", il_k);
        if (ggml_tensor * pv = ggml_get_tensor(ctx, name)) {
            ggml_kvct_set_plans(fa, pv);
        }
    }
    if (sscanf(k->src[0]->name, "kvcomp_main_k-%d", &il_k) != 1 || sscanf(v->src[0]->name, "kvcomp_main_v-%d", &il_v) != 1 ||
        il_k != il_v) {
        return;
    }
    auto find = [&](const char * part, char c) -> ggml_tensor * {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_%s_%c-%d", part, c, il_k);
        ggml_tensor * t = ggml_get_tensor(ctx, name);
        // the same permutation as the main K/V: [head size, keys, KV heads, streams]
        return t ? ggml_permute(ctx, t, 0, 2, 1, 3) : nullptr;
    };
    ggml_tensor * ke = find("exact", 'k');
    ggml_tensor * ve = find("exact", 'v');
    GGML_ASSERT(ke && ve && "kvcomp: the exact rows of a buffered layer are missing from its graph");
    ggml_flash_attn_ext_add_exact(fa, ke, ve, find("ubatch", 'k'), find("ubatch", 'v'));
    char order_name[GGML_MAX_NAME];
    snprintf(order_name, sizeof(order_name), "kvcomp_order-%d", il_k);
    if (ggml_tensor * order = ggml_get_tensor(ctx, order_name)) {
        ggml_flash_attn_ext_set_exact_order(fa, order);
    }
    for (const char c : { 'k', 'v' }) {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_write_%c-%d", c, il_k);
        if (ggml_tensor * w = ggml_get_tensor(ctx, name)) {
            // SET_ROWS reads sources 0-2; this one only orders the write after the node
            GGML_ASSERT(w->op == GGML_OP_SET_ROWS && !w->src[3]);
            w->src[3] = fa;
            ggml_build_forward_expand(gf, w);
        }
    }
}

void llama_kvcomp_buffer::set_input_slot_idxs(int64_t * dst, const llama_kv_cache::slot_info & sinfo) const {
    for (size_t s = 0; s < sinfo.n_stream(); ++s) {
        const stream_map & m = maps[sinfo.strm[s]];
        const int64_t offs = (int64_t) sinfo.strm[s] * n_rows();
        for (size_t i = 0; i < sinfo.size(); ++i) {
            const int32_t slot = m.cell_slot[sinfo.idxs[s][i]];
            dst[s * sinfo.size() + i] = offs + (slot >= 0 ? slot : n_slots());
        }
    }
}

void llama_kvcomp_buffer::set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch,
                                            const std::function<void(float *, int64_t)> & fill_main) const {
    if (plans && plans->pre_rope()) {
        // where attention turns the kvct rows to: every cell's position now (the ubatch's
        // cells included; a shift moved them)
        const ggml_tensor * pos = plans->positions(0);
        std::vector<int32_t> p(ggml_nelements(pos));
        for (int64_t strm = 0; strm < pos->ne[1]; ++strm) {
            const auto & cells = kv.v_cells[strm];
            for (int64_t c = 0; c < pos->ne[0]; ++c) {
                p[strm * pos->ne[0] + c] = cells.is_empty((uint32_t) c) ? 0 : cells.pos_get((uint32_t) c);
            }
        }
        plans->set_positions(p);
    }
    if (!buffered) {
        std::vector<float> main(ggml_nelements(dst));
        fill_main(main.data(), dst->ne[0]);
        if (dst->type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(main.data(), (ggml_fp16_t *) dst->data, (int64_t) main.size());
        } else {
            std::copy(main.begin(), main.end(), (float *) dst->data);
        }
        return;
    }
    const int64_t n_kv   = dst->ne[0];
    const int64_t n_ps   = (int64_t) ub_streams.size();
    const int64_t n_tps  = ubatch->n_tokens / n_ps;
    const int64_t n_main = n_kv - n_extra((uint32_t) n_tps);
    const int64_t n_rows = dst->ne[1] * dst->ne[2] * dst->ne[3];

    std::vector<float> main((size_t) n_main * n_rows);
    fill_main(main.data(), n_main);

    // Per stream plane, the exact keys in the order of the cells they hold: a key's turn in
    // attention then does not depend on whether it lies in a slot or among the ubatch's rows.
    // (A device cache's attention reads a copy in cell order and needs none.)
    if (ggml_kvcomp_buffer_cpu_kernels(exact_order->buffer)) {
        std::vector<int32_t> order(ggml_nelements(exact_order), -1);
        for (int64_t sp = 0; sp < n_ps; ++sp) {
            const stream_map & m = maps[ub_streams[sp]];
            int32_t * o = order.data() + sp * exact_order->ne[0];
            for (int64_t j = 0; j < n_main; ++j) {
                const int32_t e = m.exact_key((uint32_t) j, n_slots());
                if (e >= 0) {
                    *o++ = e;
                }
            }
        }
        ggml_backend_tensor_set(exact_order, order.data(), 0, order.size() * sizeof(int32_t));
    }

    std::vector<float> row(n_kv);
    for (int64_t r = 0; r < n_rows; ++r) {
        // rows are the ubatch's tokens, stream by stream
        const uint32_t strm = ub_streams[std::min(r / n_tps, n_ps - 1)];
        const auto & cells = kv.v_cells[strm];
        const stream_map & m = maps[strm];
        const llama_pos p = ubatch->pos[r % ubatch->n_tokens];
        std::fill(row.begin() + n_main, row.end(), -INFINITY);
        for (int64_t j = 0; j < n_main; ++j) {
            const float v = main[r * n_main + j];
            row[j] = v;
            if (v == -INFINITY) {
                continue;
            }
            const int32_t e = m.exact_key((uint32_t) j, n_slots());
            if (e < 0) {
                continue;
            }
            // a row of the ubatch is not a pin yet
            const bool pinned = e < (int32_t) n_slots() && m.cell_slot[j] >= 0 && m.slot_kinds[e] == SLOT_KIND_PINNED;
            if (is_exact(cells.pos_get(j), p, pinned)) {
                row[n_main + e] = v;
                row[j] = -INFINITY;
            }
        }
        if (dst->type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(row.data(), (ggml_fp16_t *) dst->data + r * n_kv, n_kv);
        } else {
            std::copy(row.begin(), row.end(), (float *) dst->data + r * n_kv);
        }
    }
}

void llama_kvcomp_buffer::set_input_shift(const llama_kv_cache & kv) {
    int32_t * data = (int32_t *) shift_input->data;
    for (uint32_t strm = 0; strm < maps.size(); ++strm) {
        const auto & cells = kv.v_cells[strm];
        stream_map & m = maps[strm];
        int32_t * d = data + (size_t) strm * n_rows();
        for (uint32_t s = 0; s < n_slots(); ++s) {
            const int32_t c = m.slot_cell[s];
            d[s] = 0;
            // a slot written at the cell's old position moves with it
            if (c >= 0 && !cells.is_empty(c) && cells.get_shift(c) != 0 && cells.pos_get(c) - cells.get_shift(c) == m.slot_pos[s]) {
                d[s] = cells.get_shift(c);
                m.slot_pos[s] = cells.pos_get(c);
            }
        }
        d[n_slots()] = 0;
    }
}

namespace {

class llm_graph_input_kvcomp_shift : public llm_graph_input_i {
public:
    llm_graph_input_kvcomp_shift(const llama_kv_cache & kv, llama_kvcomp_buffer & buf) : kv(kv), buf(buf) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        buf.set_input_shift(kv);
    }

    const llama_kv_cache & kv;
    llama_kvcomp_buffer & buf;
};

} // namespace

ggml_tensor * llama_kvcomp_buffer::build_input_shift(const llama_kv_cache & kv, ggml_context * ctx0, llm_graph_result * res) {
    if (tracker) {
        tracker->resolve();
        tracker->on_shift();
    }
    shift_input = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, (int64_t) n_rows() * maps.size());
    ggml_set_input(shift_input);
    res->add_input(std::make_unique<llm_graph_input_kvcomp_shift>(kv, *this));
    return shift_input;
}

// Stored K rows (a [n_rot, n_head_kv, n_rows] view) moved by RoPE: undo the tracker's
// transform, unrotate, RoPE in F32 (upstream's own shift of an unquantized cache), rotate,
// transform again, store.
ggml_tensor * llama_kvcomp_buffer::shift_rows(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                              ggml_tensor * view, ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                              float freq_base, float freq_scale, uint32_t il) const {
    const int32_t ib = layer_of_il[il];
    ggml_tensor * tmp = ggml_cast(ctx0, view, GGML_TYPE_F32);
    tmp = tracker ? tracker->unstore(ctx0, tmp, ib, false) : tmp;
    tmp = rot ? llama_mul_mat_hadamard(ctx0, tmp, rot) : tmp;
    tmp = kv.build_rope_shift(cparams, ctx0, tmp, shift, nullptr, factors, freq_base, freq_scale, il);
    tmp = rot ? llama_mul_mat_hadamard(ctx0, tmp, rot) : tmp;
    tmp = tracker ? tracker->unstore(ctx0, tmp, ib, true) : tmp;
    return ggml_cpy(ctx0, tmp, view);
}

ggml_tensor * llama_kvcomp_buffer::build_shift_main(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                                    ggml_tensor * k_view, ggml_tensor * shift, ggml_tensor * rot,
                                                    ggml_tensor * factors, float freq_base, float freq_scale, uint32_t il) const {
    if (plans && plans->has_rope(layer_of_il[il])) {
        // rows before RoPE do not move: attention turns them to the cells' new positions
        return shift;
    }
    if (!tracker) {
        return kv.build_rope_shift(cparams, ctx0, k_view, shift, rot, factors, freq_base, freq_scale, il);
    }
    return shift_rows(kv, ctx0, cparams, k_view, shift, rot, factors, freq_base, freq_scale, il);
}

ggml_tensor * llama_kvcomp_buffer::build_shift(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                               ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                               float freq_base, float freq_scale, uint32_t il) const {
    const auto & hparams = kv.hparams;
    ggml_tensor * slots = k_buf[layer_of_il[il]];

    const int64_t n_embd_head = hparams.n_embd_head_k(il);
    const int64_t n_rot       = hparams.n_rot(il);
    const int64_t n_embd_nope = hparams.n_lora_kv > 0 ? n_embd_head - n_rot : 0;
    ggml_tensor * view = ggml_view_3d(ctx0, slots, n_rot, hparams.n_head_kv(il), slots->ne[1],
            ggml_row_size(slots->type, n_embd_head), slots->nb[1], ggml_row_size(slots->type, n_embd_nope));
    return shift_rows(kv, ctx0, cparams, view, shift, rot, factors, freq_base, freq_scale, il);
}

bool llama_kvcomp_buffer::rm_keeps_exact(const llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const llama_kvcomp_buffer * b = kv.kvcomp.get();
    if (!b || !b->buffered) {
        return true;
    }
    p0 = std::max<llama_pos>(p0, 0);
    p1 = p1 < 0 ? std::numeric_limits<llama_pos>::max() : p1;
    for (uint32_t strm = 0; strm < b->maps.size(); ++strm) {
        const auto & cells = kv.v_cells[strm];
        const stream_map & m = b->maps[strm];
        for (llama_seq_id seq = seq_id < 0 ? 0 : seq_id; seq < (seq_id < 0 ? LLAMA_MAX_SEQ : seq_id + 1); ++seq) {
            const llama_pos max = cells.seq_pos_max(seq);
            if (max < 0 || p0 > max) {
                continue;
            }
            // the position the sequence's next token gets once the range is gone
            const llama_pos next = p1 > max ? p0 : max + 1;
            for (uint32_t c = 0; c < cells.size(); ++c) {
                if (cells.is_empty(c) || !cells.seq_has(c, seq)) {
                    continue;
                }
                const llama_pos pos = cells.pos_get(c);
                if ((pos >= p0 && pos < p1) || !b->is_exact(pos, next, false)) {
                    continue;
                }
                const int32_t s = m.cell_slot[c];
                if (s < 0 || m.slot_pos[s] != pos) {
                    return false;
                }
            }
        }
    }
    return true;
}

void llama_kvcomp_buffer::copy_stream(uint32_t ssrc, uint32_t sdst) {
    std::vector<uint8_t> tmp;
    for (const auto * bufs : { &k_buf, &v_buf }) {
        for (ggml_tensor * t : *bufs) {
            tmp.resize(t->nb[1] * n_rows());
            ggml_backend_tensor_get(t, tmp.data(), t->nb[1] * n_rows() * ssrc, tmp.size());
            ggml_backend_tensor_set(t, tmp.data(), t->nb[1] * n_rows() * sdst, tmp.size());
        }
    }
    maps[sdst] = maps[ssrc];
    if (tracker) {
        tracker->copy_stream(ssrc, sdst);
    }
}

void llama_kvcomp_buffer::state_write(llama_io_write_i & io, const llama_kv_cache & kv, llama_seq_id seq_id) const {
    // an exact cache's state is upstream's, readable with or without these settings
    if (!buffered && !tracker && !plans) {
        return;
    }
    const uint32_t header[] = {
        KVCOMP_STATE_MAGIC, KVCOMP_STATE_VERSION, (uint32_t) k_buf.size(), (uint32_t) k_buf[0]->ne[0],
        (uint32_t) v_buf[0]->ne[0], n_slots(), (uint32_t) maps.size(),
    };
    io.write(header, sizeof(header));
    // which plans coded the kvct K rows (0: not a kvct cache)
    const uint64_t plans_id = plans ? plans->fingerprint() : 0;
    io.write(&plans_id, sizeof(plans_id));
    if (plans) {
        // the plans themselves, so that a context under other plans can re-code the rows
        const std::vector<kvc_t_plan> all = plans->all();
        const uint32_t pre = plans->pre_rope() ? 1 : 0, n_plans = (uint32_t) all.size();
        io.write(&pre, sizeof(pre));
        io.write(&n_plans, sizeof(n_plans));
        io.write(all.data(), all.size() * sizeof(kvc_t_plan));
    }

    // the cells upstream saves: those of the sequence (all, for -1), less the ones a sliding
    // window already hides
    const auto saved = [&](const llama_kv_cells & cells, uint32_t c) {
        if (cells.is_empty(c) || (seq_id != -1 && !cells.seq_has(c, seq_id))) {
            return false;
        }
        return seq_id == -1 || !llama_hparams::is_masked_swa(kv.n_swa, kv.swa_type, cells.pos_get(c), cells.seq_pos_max(seq_id));
    };

    const uint32_t has_tracker = tracker ? 1 : 0;
    io.write(&has_tracker, sizeof(has_tracker));
    if (tracker) {
        std::vector<bool> holds(maps.size(), false);
        for (uint32_t strm = 0; strm < maps.size(); ++strm) {
            for (uint32_t c = 0; c < kv.v_cells[strm].size() && !holds[strm]; ++c) {
                holds[strm] = saved(kv.v_cells[strm], c);
            }
        }
        tracker->state_write(io, holds);
    }

    for (uint32_t strm = 0; strm < maps.size(); ++strm) {
        const auto & cells = kv.v_cells[strm];
        const stream_map & m = maps[strm];

        // upstream writes the cells it saves in index order; a slot names its cell by that rank
        std::vector<uint32_t> entry_rank, entry_slot;
        uint32_t rank = 0;
        for (uint32_t c = 0; c < cells.size(); ++c) {
            if (!saved(cells, c)) {
                continue;
            }
            if (m.cell_slot[c] >= 0 && m.slot_pos[m.cell_slot[c]] == cells.pos_get(c) &&
                m.slot_kinds[m.cell_slot[c]] != SLOT_KIND_SPARE) {
                entry_rank.push_back(rank);
                entry_slot.push_back((uint32_t) m.cell_slot[c]);
            }
            ++rank;
        }

        const uint32_t n_entries = (uint32_t) entry_rank.size();
        io.write(&n_entries, sizeof(n_entries));
        for (uint32_t e = 0; e < n_entries; ++e) {
            const uint32_t s = entry_slot[e];
            const uint8_t kind = m.slot_kinds[s];
            io.write(&entry_rank[e], sizeof(uint32_t));
            io.write(&s,             sizeof(uint32_t));
            io.write(&kind,          sizeof(kind));
            io.write(&m.slot_err[s], sizeof(float));
        }
        for (size_t ib = 0; ib < k_buf.size(); ++ib) {
            for (ggml_tensor * t : { k_buf[ib], v_buf[ib] }) {
                for (uint32_t s : entry_slot) {
                    io.write_tensor(t, ((size_t) strm * n_rows() + s) * t->nb[1], t->nb[1]);
                }
            }
        }
    }
}

// The exact rows of a state are F16 copies of what the model wrote; a NaN or Inf among them
// would reach every later query exactly, so such a state is refused.
static void check_rows_finite(ggml_tensor * t, const std::vector<uint64_t> & rows) {
    std::vector<uint8_t> row(t->nb[1]);
    for (uint64_t r : rows) {
        ggml_backend_tensor_get(t, row.data(), r * t->nb[1], row.size());
        if (!ggml_validate_row_data(t->type, row.data(), row.size())) {
            throw std::runtime_error("residual buffer section holds non-finite values");
        }
    }
}

void llama_kvcomp_buffer::state_read(llama_io_read_i & io, llama_kv_cache & kv, llama_seq_id seq_id,
                                     const llama_kv_cache::slot_info_vec_t & sinfos) {
    if (!buffered && !tracker && !plans) {
        return;
    }
    // the restored cells hold other tokens now
    for (uint32_t strm = 0; strm < maps.size(); ++strm) {
        stream_map & m = maps[strm];
        for (uint32_t s = 0; s < n_slots(); ++s) {
            const int32_t c = m.slot_cell[s];
            bool restored = seq_id == -1;
            for (const auto & si : sinfos) {
                restored = restored || (!si.empty() && (uint32_t) si.strm[0] == strm &&
                                        std::find(si.idxs[0].begin(), si.idxs[0].end(), (uint32_t) c) != si.idxs[0].end());
            }
            if (c >= 0 && restored) {
                free_slot(m, s);
            }
        }
    }

    try {
        if (!llama_kvcomp_state_is_sealed()) {
            throw std::runtime_error("the state holds the residual buffer, tracker or plans but no seal (this build seals "
                                     "every state it writes): it was cut short, changed, or written by another build");
        }
        uint32_t header[7];
        io.read(header, sizeof(header));
        if (header[0] != KVCOMP_STATE_MAGIC) {
            throw std::runtime_error("no residual buffer section (was the state saved without --kv-comp-*?)");
        }
        if (header[1] != KVCOMP_STATE_VERSION) {
            throw std::runtime_error("residual buffer section version " + std::to_string(header[1]) + ", expected " +
                                     std::to_string(KVCOMP_STATE_VERSION));
        }
        if (header[2] != k_buf.size() || header[3] != k_buf[0]->ne[0] || header[4] != v_buf[0]->ne[0]) {
            throw std::runtime_error("residual buffer section is for another model");
        }
        if (header[6] != sinfos.size()) {
            throw std::runtime_error("residual buffer section has " + std::to_string(header[6]) + " streams, the state " +
                                     std::to_string(sinfos.size()));
        }
        uint64_t plans_id = 0;
        io.read(&plans_id, sizeof(plans_id));
        if ((plans_id != 0) != (plans != nullptr)) {
            throw std::runtime_error(plans_id == 0 ? "the state's K rows were not coded with kvct plans" :
                                     "the state's K rows are kvct, this cache's are not");
        }
        uint32_t saved_pre = 0, n_plans = 0;
        std::vector<kvc_t_plan> saved;
        if (plans_id != 0) {
            io.read(&saved_pre, sizeof(saved_pre));
            io.read(&n_plans, sizeof(n_plans));
            if (saved_pre > 1 || n_plans != plans->all().size()) {
                throw std::runtime_error("the state's kvct plans are corrupted or for another model");
            }
            saved.resize(n_plans);
            io.read(saved.data(), saved.size() * sizeof(kvc_t_plan));
        }

        // the K offsets the restored rows were stored with, per stream
        std::vector<llama_kvcomp_tracker::restore_target> targets(sinfos.size());
        for (size_t si = 0; si < sinfos.size(); ++si) {
            if (sinfos[si].empty()) {
                continue;
            }
            auto & t = targets[si];
            t.strm = sinfos[si].strm[0];
            for (uint32_t c : sinfos[si].idxs[0]) {
                t.cells.push_back((uint64_t) t.strm * kv.get_size() + c);
            }
            t.replace = seq_id == -1 || kv.v_cells[t.strm].get_used() <= t.cells.size();
        }
        if (plans && plans_id != plans->fingerprint()) {
            recode_rows(io, kv, saved, saved_pre != 0, targets);
        }
        uint32_t has_tracker = 0;
        io.read(&has_tracker, sizeof(has_tracker));
        if (has_tracker > 1 || (has_tracker && !tracker)) {
            throw std::runtime_error(has_tracker > 1 ? "tracker flag is corrupted" :
                                     "the state was saved with the scale tracker on; this context has none");
        }
        std::vector<std::vector<std::vector<float>>> moved(sinfos.size());
        if (tracker) {
            moved = tracker->state_read(io, targets, seq_id, has_tracker != 0);
        }

        for (uint32_t si = 0; si < header[6]; ++si) {
            uint32_t n_entries = 0;
            io.read(&n_entries, sizeof(n_entries));
            const bool has_cells = !sinfos[si].empty();
            const std::vector<uint32_t> none;
            const std::vector<uint32_t> & restored = has_cells ? sinfos[si].idxs[0] : none;
            if (n_entries > restored.size()) {
                throw std::runtime_error("residual buffer section holds more rows than the state has cells");
            }
            const uint32_t strm = has_cells ? sinfos[si].strm[0] : 0;
            stream_map & m = maps[strm];

            // a slot goes back where it was when this buffer has the same size, so the keys
            // reach attention in the same order as before the save; a slot whose cell was
            // removed since the last ubatch (which would free it) is not in the way
            std::vector<uint32_t> dst(n_entries), cells_of(n_entries);
            std::vector<slot_kind> kinds(n_entries);
            std::vector<float> errs(n_entries);
            std::vector<bool> taken(n_slots(), false);
            const auto & cells = kv.v_cells[strm];
            for (uint32_t s = 0; s < n_slots(); ++s) {
                const int32_t c = m.slot_cell[s];
                taken[s] = c >= 0 && m.slot_kinds[s] != SLOT_KIND_SPARE && !cells.is_empty(c) && cells.pos_get(c) == m.slot_pos[s];
            }
            for (uint32_t e = 0; e < n_entries; ++e) {
                uint32_t r, s;
                uint8_t kind;
                io.read(&r,       sizeof(r));
                io.read(&s,       sizeof(s));
                io.read(&kind,    sizeof(kind));
                io.read(&errs[e], sizeof(float));
                if (r >= restored.size() || kind == SLOT_KIND_FREE || kind > SLOT_KIND_PINNED || !std::isfinite(errs[e])) {
                    throw std::runtime_error("residual buffer section is corrupted");
                }
                if (header[5] != n_slots() || s >= n_slots() || taken[s]) {
                    s = (uint32_t) (std::find(taken.begin(), taken.end(), false) - taken.begin());
                }
                dst[e]      = s; // n_slots(): no room, the row is read into the scratch row
                kinds[e]    = (slot_kind) kind;
                cells_of[e] = restored[r];
                if (s < n_slots()) {
                    taken[s] = true;
                }
            }
            std::vector<uint64_t> rows(n_entries);
            for (uint32_t e = 0; e < n_entries; ++e) {
                rows[e] = (uint64_t) strm * n_rows() + dst[e];
            }
            for (size_t ib = 0; ib < k_buf.size(); ++ib) {
                for (ggml_tensor * t : { k_buf[ib], v_buf[ib] }) {
                    for (uint64_t r : rows) {
                        io.read_tensor(t, r * t->nb[1], t->nb[1]);
                    }
                }
                // a host buffer's reader applies its rows at its end: before the check and the
                // re-encode below read them back
                if (io.flush()) {
                    check_rows_finite(k_buf[ib], rows);
                    check_rows_finite(v_buf[ib], rows);
                }
                if (!moved[si].empty()) {
                    llama_kvcomp_tracker::reencode(k_buf[ib], rows, moved[si][ib]);
                }
            }
            for (uint32_t e = 0; e < n_entries; ++e) {
                if (dst[e] < n_slots()) {
                    // (a spare's cell must no longer point at the slot)
                    free_slot(m, dst[e]);
                    set_slot(m, dst[e], cells_of[e], cells.pos_get(cells_of[e]), kinds[e]);
                    m.slot_err[dst[e]] = errs[e];
                }
            }
        }
    } catch (const std::exception & e) {
        if (seq_id == -1) {
            kv.clear(true);
        } else {
            kv.seq_rm(seq_id, -1, -1);
        }
        throw std::runtime_error(std::string("kvcomp: ") + e.what());
    }
}

void llama_kvcomp_buffer::recode_rows(llama_io_read_i & io, llama_kv_cache & kv, const std::vector<kvc_t_plan> & saved,
                                      bool saved_pre_rope, const std::vector<llama_kvcomp_tracker::restore_target> & targets) {
    // upstream's reader of host memory applies the restored rows at its end: now, before they
    // are read back; a reader that cannot (the device's) leaves them unread
    if (!io.flush()) {
        throw std::runtime_error("the state's kvct K rows were coded with other plans, and this reader cannot re-code them: "
                                 "load it with the K statistics it was saved with (--kv-comp-kstats)");
    }
    std::vector<uint64_t> rows;
    for (const auto & t : targets) {
        rows.insert(rows.end(), t.cells.begin(), t.cells.end());
    }
    size_t off = 0;
    for (size_t ib = 0; ib < kv.layers.size(); ++ib) {
        const size_t n = plans->n_head((int32_t) ib);
        const std::string err = plans->recode((int32_t) ib, kv.layers[ib].k, saved.data() + off, n, saved_pre_rope, rows);
        if (!err.empty()) {
            throw std::runtime_error("the state's kvct K rows were coded with other plans and cannot be re-coded (" + err +
                                     "): load it with the K statistics it was saved with (--kv-comp-kstats)");
        }
        off += n;
    }
    LLAMA_LOG_INFO("kvcomp: %zu restored K rows were coded with other plans: re-coded with this context's\n", rows.size());
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
            next->monitor = kv.kvcomp->monitor;
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

ggml_tensor * llama_kvcomp_buffer::scale_q(ggml_context * ctx0, ggml_tensor * q, int32_t il) const {
    // K is stored as k - c, and softmax cancels q·c: Q stays as it is (a per-head basis of the
    // stored K would turn Q here)
    GGML_UNUSED(ctx0);
    GGML_UNUSED(il);
    return q;
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
    // a device cache's residual buffer writes its rows in another order (issue 21)
    for (const ggml_type t : { type_k, type_v }) {
        if ((ggml_kvcomp_is_cpu_only(t) || ggml_kvcomp_is_kvct(t)) && !ggml_kvcomp_dev_cpu_kernels(dev)) {
            throw std::runtime_error(std::string("kvcomp: the KV cache of layer ") + std::to_string(il) + " would live on " +
                                     ggml_backend_dev_name(dev) + " (" + ggml_backend_dev_description(dev) + "): " +
                                     ggml_type_name(t) + " caches run on the CPU backend for now, here or on an "
                                     "rpc-server of this build (issue 21): keep the KV cache in host memory (--no-kv-offload)");
        }
    }
}
