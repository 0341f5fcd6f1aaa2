// The residual buffer's part of a state: after upstream's cells, the slots of the cells it
// saved, the tracker's offsets and the kvct plans that coded the K rows (docs/state.md).

#include "kvcomp-buffer.h"
#include "kvcomp-state.h"

#include "llama-impl.h"
#include "llama-io.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

// "KVCB": the buffer's part of a state, after upstream's cells
static constexpr uint32_t KVCOMP_STATE_MAGIC   = 0x4243564b;
// 4: the tracker part holds a K offset per stream (3: one for all, 2: channel scales too)
static constexpr uint32_t KVCOMP_STATE_VERSION = 6;

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
    // the restored cells hold other tokens now, and the sequence's prompt is the state's
    for (uint32_t strm = 0; strm < maps.size(); ++strm) {
        stream_map & m = maps[strm];
        if (seq_id == -1) {
            std::fill(m.seq_anchor.begin(), m.seq_anchor.end(), -1);
        } else {
            m.seq_anchor[seq_id] = -1;
        }
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
