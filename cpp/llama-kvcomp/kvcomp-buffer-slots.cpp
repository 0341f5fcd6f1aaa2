// The residual buffer's slot map and window policy: which rows a ubatch gives a slot, which
// slots a merge releases, which rows stay pinned, and what a cut-back or a copied stream keeps.

#include "kvcomp-buffer.h"

#include "llama-batch.h"
#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

bool llama_kvcomp_buffer::is_exact(llama_pos key, llama_pos query, bool pinned) const {
    return pinned || key < params.sinks || key > query - params.window;
}

bool llama_kvcomp_buffer::anchored(const stream_map & m, llama_seq_id seq, llama_pos pos) const {
    const llama_pos anchor = m.seq_anchor[seq];
    return params.keep_prompt && anchor >= 0 && pos < anchor && is_exact(pos, anchor - KVCOMP_CUT_BACK, false);
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
    if (on_ubatch) {
        on_ubatch(kv);
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

void llama_kvcomp_buffer::apply_stream(const llama_kv_cache & kv, uint32_t strm, const std::vector<uint32_t> & cells_ub,
                                       const llama_ubatch & ubatch, uint32_t i0) {
    const auto & cells = kv.v_cells[strm];
    stream_map & m = maps[strm];

    for (uint32_t i = 0; i < cells_ub.size(); ++i) {
        m.cell_ub[cells_ub[i]] = (int32_t) i;
    }

    // the earliest query of each sequence in this ubatch, the first one after it, and how
    // many tokens the sequence has here
    std::map<llama_seq_id, llama_pos> first_query, next_query;
    std::map<llama_seq_id, uint32_t> n_tokens;
    for (uint32_t i = i0; i < i0 + cells_ub.size(); ++i) {
        for (int32_t j = 0; j < ubatch.n_seq_id[i]; ++j) {
            const llama_seq_id seq = ubatch.seq_id[i][j];
            auto it = first_query.find(seq);
            if (it == first_query.end() || ubatch.pos[i] < it->second) {
                first_query[seq] = ubatch.pos[i];
            }
            next_query[seq] = std::max(next_query.count(seq) ? next_query[seq] : 0, ubatch.pos[i] + 1);
            ++n_tokens[seq];
        }
    }

    // Anchors. A sequence cut back before its anchor's query has left that prompt, and one
    // that has none (new, or restored from a state) takes the end of its next ubatch: a
    // restored prompt's last token decoded again sets it where its first run did. A prompt,
    // two tokens or more of the sequence in one ubatch, moves it to its end.
    for (llama_seq_id seq = 0; seq < LLAMA_MAX_SEQ; ++seq) {
        llama_pos & anchor = m.seq_anchor[seq];
        const auto it = first_query.find(seq);
        const llama_pos next = it != first_query.end() ? it->second : cells.seq_pos_max(seq) + 1;
        if (anchor >= 0 && anchor - KVCOMP_CUT_BACK > next) {
            anchor = -1;
        }
        if (it != first_query.end() && (anchor < 0 || n_tokens[seq] > 1)) {
            anchor = next_query[seq];
        }
    }

    // whether a query of this ubatch or a later one (from_query: first_query), or a later
    // one only (next_query), sees the row of cell c exactly, or keep_prompt holds it
    const auto wanted = [&](int32_t c, llama_pos pos, const std::map<llama_seq_id, llama_pos> & from_query) {
        for (llama_seq_id seq = 0; seq < LLAMA_MAX_SEQ; ++seq) {
            if (!cells.seq_has(c, seq)) {
                continue;
            }
            const auto it = from_query.find(seq);
            if (is_exact(pos, it != from_query.end() ? it->second : cells.seq_pos_max(seq) + 1, false) ||
                anchored(m, seq, pos)) {
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
