#include "kvcomp-tracker.h"

#include "llama-impl.h"
#include "llama-io.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

// rows sampled per ubatch and layer, spread evenly over the ubatch
static constexpr uint32_t KVCOMP_TAP_ROWS = 32;
// the window of updates the statistics cover, and how often they are recomputed
static constexpr uint32_t KVCOMP_WINDOW   = 32;
static constexpr uint32_t KVCOMP_RECOMPUTE = 8;
static constexpr double   KVCOMP_QUANTILE = 0.999;
// the row of the tap after the samples: the offset c
static constexpr uint32_t KVCOMP_ROW_C     = KVCOMP_TAP_ROWS;

static uint32_t tap_stride(uint32_t n_tokens) {
    return (n_tokens + KVCOMP_TAP_ROWS - 1) / KVCOMP_TAP_ROWS;
}

llama_kvcomp_tracker::llama_kvcomp_tracker(const std::vector<layer_desc> & descs, const llama_kvcomp_params & params)
    : params(params) {
    ggml_init_params ip = { (descs.size() + 1) * ggml_tensor_overhead(), nullptr, true };
    ctx = ggml_init(ip);
    if (!ctx) {
        throw std::runtime_error("kvcomp: failed to create the tracker context");
    }
    const size_t n = descs.size();
    layers.resize(n);
    for (size_t ib = 0; ib < n; ++ib) {
        const layer_desc & kl = descs[ib];
        layer_state & l = layers[ib];
        l.k_main        = kl.k;
        l.v_main        = kl.v;
        l.n_embd_k      = kl.k->ne[0];
        l.n_embd_v      = kl.v->ne[0];
        l.n_embd_head_k = kl.n_embd_head_k;
        l.n_embd_head_v = kl.n_embd_head_v;
        // deep layers follow their rows faster: α rises linearly with depth
        const float t = n > 1 ? (float) ib / (float) (n - 1) : 0.0f;
        l.alpha = params.ema_shallow + t * (params.ema_deep - params.ema_shallow);
        l.k_win.resize(KVCOMP_WINDOW);
        l.v_win.resize(KVCOMP_WINDOW);
        l.k_err_head.assign(l.n_embd_k / l.n_embd_head_k, 0.0);
        l.k_energy_head.assign(l.n_embd_k / l.n_embd_head_k, 0.0);
        l.c.assign(l.n_embd_k, 0.0f);
        tap.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, l.n_embd_k, KVCOMP_ROW_C + 1));
        ggml_format_name(tap.back(), "kvcomp_tap_l%u", kl.il);
    }
    calibrate = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, KVCOMP_TAP_ROWS + 1);
    ggml_set_name(calibrate, "kvcomp_calibrate");

    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_buffer_get_type(descs[0].k->buffer));
    if (!buf) {
        ggml_free(ctx);
        throw std::runtime_error("kvcomp: failed to allocate the tracker");
    }
    ggml_backend_buffer_clear(buf, 0);
    write_offsets();
    set_weights(false, 1);
}

llama_kvcomp_tracker::~llama_kvcomp_tracker() {
    // the tracker's measurement of the whole run, for `kvcomp kld` (docs/results.md)
    double err = 0.0, err_plain = 0.0, energy = 0.0;
    int64_t n_rows = 0, n_values = 0;
    for (const auto & l : layers) {
        err        += l.k_err;
        err_plain  += l.k_err_plain;
        energy     += l.k_energy;
        n_rows     += l.n_rows_measured;
        n_values   += l.n_rows_measured * l.n_embd_k;
    }
    if (n_values > 0) {
        LLAMA_LOG_INFO("kvcomp: tracker: K rows measured = %lld, RMSE = %.6f, RMSE offset only = %.6f, RMSE plain = %.6f, "
                "row RMS = %.6f\n", (long long) n_rows, std::sqrt(err / n_values), std::sqrt(err / n_values),
                std::sqrt(err_plain / n_values), std::sqrt(energy / n_values));
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

ggml_tensor * llama_kvcomp_tracker::transform(ggml_context * ctx0, ggml_tensor * cur, int32_t ib, bool is_k) const {
    if (!is_k) {
        return cur;
    }
    const int64_t ne0      = cur->ne[0];
    const uint32_t n_tok   = (uint32_t) cur->ne[1];
    const uint32_t stride  = tap_stride(n_tok);
    const int64_t n_sample = (n_tok + stride - 1) / stride;

    ggml_tensor * sampled = ggml_view_2d(ctx0, cur, ne0, n_sample, cur->nb[1] * stride, 0);
    ggml_tensor * tapped  = ggml_cpy(ctx0, sampled, ggml_view_2d(ctx0, tap[ib], ne0, n_sample, tap[ib]->nb[1], 0));

    // c = Σ_r tap_r · w_r over the samples and the offset row: w picks the offset row, or, for
    // a ubatch that sets the offset, weighs the samples 1/n (their mean; the host then stores
    // the same mean in the offset row). One graph shape for every ubatch and few nodes: the
    // graph's node budget is upstream's. The view hangs on the copy, so it is read after it.
    ggml_tensor * all = ggml_view_2d(ctx0, tapped, ne0, KVCOMP_ROW_C + 1, tap[ib]->nb[1], 0);
    return ggml_sub(ctx0, cur, ggml_out_prod(ctx0, all, calibrate));
}

ggml_tensor * llama_kvcomp_tracker::unstore(ggml_context * ctx0, ggml_tensor * rows, int32_t ib, bool back) const {
    const layer_state & l = layers[ib];
    // rows: [n_rot, n_head_kv, n_cells] over the first n_rot values of each head
    const auto row = [&](uint32_t r) {
        return ggml_cont(ctx0, ggml_view_3d(ctx0, tap[ib], rows->ne[0], rows->ne[1], 1,
                l.n_embd_head_k * sizeof(float), l.n_embd_k * sizeof(float), r * tap[ib]->nb[1]));
    };
    return back ? ggml_sub(ctx0, rows, row(KVCOMP_ROW_C)) : ggml_add(ctx0, rows, row(KVCOMP_ROW_C));
}

void llama_kvcomp_tracker::fold(std::vector<update_stats> & win, const float * rows, uint32_t n_rows, int64_t n_embd) const {
    update_stats & u = win[n_updates % KVCOMP_WINDOW];
    u.n = n_rows;
    u.hi1.assign(n_embd, -INFINITY);
    u.hi2.assign(n_embd, -INFINITY);
    u.lo1.assign(n_embd, INFINITY);
    u.lo2.assign(n_embd, INFINITY);
    for (uint32_t r = 0; r < n_rows; ++r) {
        const float * x = rows + (size_t) r * n_embd;
        for (int64_t i = 0; i < n_embd; ++i) {
            if (!std::isfinite(x[i])) {
                continue;
            }
            if (x[i] > u.hi1[i]) {
                u.hi2[i] = u.hi1[i];
                u.hi1[i] = x[i];
            } else if (x[i] > u.hi2[i]) {
                u.hi2[i] = x[i];
            }
            if (x[i] < u.lo1[i]) {
                u.lo2[i] = u.lo1[i];
                u.lo1[i] = x[i];
            } else if (x[i] < u.lo2[i]) {
                u.lo2[i] = x[i];
            }
        }
    }
}

// The q-quantile from the top of a set of n samples, given each update's two extreme values:
// with n <= 1000 * 2 it is among them.
static float extreme_quantile(std::vector<float> & cand, size_t n, bool top) {
    const size_t k = std::min(cand.size() - 1, (size_t) std::floor((1.0 - KVCOMP_QUANTILE) * (double) n));
    if (top) {
        std::nth_element(cand.begin(), cand.begin() + k, cand.end(), std::greater<float>());
    } else {
        std::nth_element(cand.begin(), cand.begin() + k, cand.end());
    }
    return cand[k];
}

void llama_kvcomp_tracker::recompute(layer_state & l) {
    // K per channel
    size_t n = 0;
    for (const auto & u : l.k_win) {
        n += u.n;
    }
    if (n == 0) {
        return;
    }
    std::vector<float> hi(l.n_embd_k), lo(l.n_embd_k), cand_hi, cand_lo;
    for (int64_t i = 0; i < l.n_embd_k; ++i) {
        cand_hi.clear();
        cand_lo.clear();
        for (const auto & u : l.k_win) {
            if (u.n == 0) {
                continue;
            }
            for (float v : { u.hi1[i], u.hi2[i] }) {
                if (std::isfinite(v)) cand_hi.push_back(v);
            }
            for (float v : { u.lo1[i], u.lo2[i] }) {
                if (std::isfinite(v)) cand_lo.push_back(v);
            }
        }
        hi[i] = cand_hi.empty() ? 0.0f : extreme_quantile(cand_hi, n, true);
        lo[i] = cand_lo.empty() ? 0.0f : extreme_quantile(cand_lo, n, false);
    }

    // V per head, from its channels' extremes
    const int64_t n_head_v = l.n_embd_v / l.n_embd_head_v;
    std::vector<float> vhi(n_head_v, 0.0f), vlo(n_head_v, 0.0f);
    size_t nv = 0;
    for (const auto & u : l.v_win) {
        nv += u.n;
    }
    for (int64_t h = 0; h < n_head_v && nv > 0; ++h) {
        cand_hi.clear();
        cand_lo.clear();
        for (const auto & u : l.v_win) {
            if (u.n == 0) {
                continue;
            }
            for (int64_t i = h * l.n_embd_head_v; i < (h + 1) * l.n_embd_head_v; ++i) {
                for (float v : { u.hi1[i], u.hi2[i] }) {
                    if (std::isfinite(v)) cand_hi.push_back(v);
                }
                for (float v : { u.lo1[i], u.lo2[i] }) {
                    if (std::isfinite(v)) cand_lo.push_back(v);
                }
            }
        }
        vhi[h] = cand_hi.empty() ? 0.0f : extreme_quantile(cand_hi, nv * l.n_embd_head_v, true);
        vlo[h] = cand_lo.empty() ? 0.0f : extreme_quantile(cand_lo, nv * l.n_embd_head_v, false);
    }

    const auto smooth = [&](std::vector<float> & ema, const std::vector<float> & x) {
        if (!l.warm || ema.size() != x.size()) {
            ema = x;
            return;
        }
        for (size_t i = 0; i < x.size(); ++i) {
            ema[i] += l.alpha * (x[i] - ema[i]);
        }
    };
    smooth(l.k_hi, hi);
    smooth(l.k_lo, lo);
    smooth(l.v_hi, vhi);
    smooth(l.v_lo, vlo);
    l.warm = true;
}

void llama_kvcomp_tracker::measure(layer_state & l, const float * k_rows, size_t n_rows) {
    const ggml_tensor * k_main = l.k_main;
    const auto * tt = ggml_get_type_traits(k_main->type);
    const int64_t n = l.n_embd_k;
    std::vector<uint8_t> q(k_main->nb[1]);
    std::vector<float> x(n), y(n);
    // pass 0: as the rows came; 1: as stored (offset removed)
    for (size_t r = 0; r < n_rows; ++r) {
        const float * raw = k_rows + r * n;
        for (int pass = 0; pass < 2; ++pass) {
            for (int64_t i = 0; i < n; ++i) {
                x[i] = raw[i] - (pass ? l.c[i] : 0.0f);
            }
            if (k_main->type == GGML_TYPE_F32) {
                y = x;
            } else {
                tt->from_float_ref(x.data(), q.data(), n);
                tt->to_float(q.data(), y.data(), n);
            }
            double e = 0.0;
            for (int64_t i = 0; i < n; ++i) {
                const double d = (double) (x[i] - y[i]);
                e += d * d;
                if (pass == 1) {
                    l.k_err_head[i / l.n_embd_head_k] += d * d;
                }
            }
            (pass == 0 ? l.k_err_plain : l.k_err) += e;
        }
        for (int64_t i = 0; i < n; ++i) {
            l.k_energy += (double) raw[i] * raw[i];
            l.k_energy_head[i / l.n_embd_head_k] += (double) raw[i] * raw[i];
        }
    }
    l.n_rows_measured += (int64_t) n_rows;
}

void llama_kvcomp_tracker::write_offsets() const {
    for (size_t ib = 0; ib < layers.size(); ++ib) {
        ggml_backend_tensor_set(tap[ib], layers[ib].c.data(), KVCOMP_ROW_C * tap[ib]->nb[1], tap[ib]->nb[1]);
    }
}

void llama_kvcomp_tracker::set_weights(bool calibrating, uint32_t n_sample) {
    if (calibrating == w_calibrating && (!calibrating || n_sample == w_n_sample)) {
        return;
    }
    std::vector<float> w(KVCOMP_TAP_ROWS + 1, 0.0f);
    if (calibrating) {
        std::fill(w.begin(), w.begin() + n_sample, 1.0f / (float) n_sample);
    } else {
        w[KVCOMP_TAP_ROWS] = 1.0f;
    }
    ggml_backend_tensor_set(calibrate, w.data(), 0, ggml_nbytes(calibrate));
    w_calibrating = calibrating;
    w_n_sample    = n_sample;
}

void llama_kvcomp_tracker::resolve() const {
    if (pending_read && !tap_cells.empty()) {
        // the last ubatch's graph took the mean of its sampled rows as the offset: keep it
        std::vector<float> rows;
        for (size_t ib = 0; ib < layers.size(); ++ib) {
            layer_state & l = layers[ib];
            rows.resize(tap_cells.size() * l.n_embd_k);
            ggml_backend_tensor_get(tap[ib], rows.data(), 0, rows.size() * sizeof(float));
            for (int64_t i = 0; i < l.n_embd_k; ++i) {
                float s = 0.0f;
                for (size_t r = 0; r < tap_cells.size(); ++r) {
                    s += rows[r * l.n_embd_k + i] * (1.0f / (float) tap_cells.size());
                }
                l.c[i] = s;
            }
        }
        write_offsets();
    }
    pending_read = false;
}

void llama_kvcomp_tracker::update(const std::vector<uint64_t> & cells, bool empty) {
    resolve();
    if (!tap_cells.empty() && params.tracker) {
        const bool measure_now = n_updates % KVCOMP_RECOMPUTE == 0;
        // Each read below waits for the device that holds the cache: off the host, the windows
        // take every KVCOMP_RECOMPUTE-th update only, so the decode steps between need no round trip.
        const bool on_host = layers.empty() || ggml_backend_buffer_is_host(layers[0].v_main->buffer);
        std::vector<float> rows, vrows;
        std::vector<uint8_t> raw;
        for (size_t ib = 0; ib < layers.size() && (on_host || measure_now); ++ib) {
            layer_state & l = layers[ib];
            const uint32_t n_rows = (uint32_t) tap_cells.size();
            rows.resize((size_t) n_rows * l.n_embd_k);
            ggml_backend_tensor_get(tap[ib], rows.data(), 0, rows.size() * sizeof(float));
            fold(l.k_win, rows.data(), n_rows, l.n_embd_k);

            // V rows as stored: nothing is subtracted from them
            const ggml_tensor * v = l.v_main;
            vrows.resize((size_t) n_rows * l.n_embd_v);
            raw.resize(v->nb[1]);
            for (uint32_t r = 0; r < n_rows; ++r) {
                ggml_backend_tensor_get(v, raw.data(), tap_cells[r] * v->nb[1], v->nb[1]);
                if (v->type == GGML_TYPE_F32) {
                    std::memcpy(vrows.data() + (size_t) r * l.n_embd_v, raw.data(), v->nb[1]);
                } else {
                    ggml_get_type_traits(v->type)->to_float(raw.data(), vrows.data() + (size_t) r * l.n_embd_v, l.n_embd_v);
                }
            }
            fold(l.v_win, vrows.data(), n_rows, l.n_embd_v);

            if (measure_now) {
                measure(l, rows.data(), n_rows);
            }
        }
        ++n_updates;
        if (n_updates % KVCOMP_RECOMPUTE == 0) {
            for (auto & l : layers) {
                recompute(l);
            }
        }
    }

    const uint32_t stride   = tap_stride((uint32_t) cells.size());
    const uint32_t n_sample = ((uint32_t) cells.size() + stride - 1) / stride;
    bool calibrating = false;
    if (empty) {
        // The cache starts over: the offset comes from this ubatch's own rows (with the tracker
        // switched off, none), never from the smoothed statistics, which hold earlier
        // sequences' rows: what a sequence computes must not depend on the requests served
        // before it (docs/design-tracker-modes.md, "Isolation").
        calibrating = params.tracker;
        for (auto & l : layers) {
            std::fill(l.c.begin(), l.c.end(), 0.0f);
        }
        write_offsets();
    }
    set_weights(calibrating, n_sample);
    pending_read = calibrating;

    tap_cells.clear();
    for (size_t i = 0; i < cells.size(); i += stride) {
        tap_cells.push_back(cells[i]);
    }
}

void llama_kvcomp_tracker::state_write(llama_io_write_i & io) const {
    resolve();
    const uint32_t n = (uint32_t) layers.size();
    io.write(&n, sizeof(n));
    for (const auto & l : layers) {
        const uint32_t ne = (uint32_t) l.c.size();
        io.write(&ne, sizeof(ne));
        io.write(l.c.data(), ne * sizeof(float));
    }
}

void llama_kvcomp_tracker::reencode(ggml_tensor * t, const std::vector<uint64_t> & rows, const std::vector<float> & shift) {
    const auto * tt = ggml_get_type_traits(t->type);
    const int64_t n = t->ne[0];
    std::vector<uint8_t> raw(t->nb[1]);
    std::vector<float> x(n);
    for (uint64_t r : rows) {
        ggml_backend_tensor_get(t, raw.data(), r * t->nb[1], t->nb[1]);
        if (t->type == GGML_TYPE_F32) {
            std::memcpy(x.data(), raw.data(), t->nb[1]);
        } else {
            tt->to_float(raw.data(), x.data(), n);
        }
        for (int64_t i = 0; i < n; ++i) {
            x[i] += shift[i];
        }
        if (t->type == GGML_TYPE_F32) {
            std::memcpy(raw.data(), x.data(), t->nb[1]);
        } else {
            tt->from_float_ref(x.data(), raw.data(), n);
        }
        ggml_backend_tensor_set(t, raw.data(), r * t->nb[1], t->nb[1]);
    }
}

std::vector<std::vector<float>> llama_kvcomp_tracker::state_read(llama_io_read_i & io, const std::vector<uint64_t> & cells,
                                                                  bool replace, bool present) {
    // a state saved without a tracker holds rows stored as they came: c = 0
    const uint32_t n_layers = (uint32_t) layers.size();
    std::vector<std::vector<float>> fc(n_layers);
    for (uint32_t ib = 0; ib < n_layers; ++ib) {
        fc[ib].assign(layers[ib].c.size(), 0.0f);
    }
    if (present) {
        uint32_t n = 0;
        io.read(&n, sizeof(n));
        if (n != n_layers) {
            throw std::runtime_error("tracker section has " + std::to_string(n) + " layers, the cache " + std::to_string(n_layers));
        }
        for (uint32_t ib = 0; ib < n; ++ib) {
            uint32_t ne = 0;
            io.read(&ne, sizeof(ne));
            if (ne != fc[ib].size()) {
                throw std::runtime_error("tracker section is for another model");
            }
            io.read(fc[ib].data(), ne * sizeof(float));
            for (uint32_t i = 0; i < ne; ++i) {
                if (!std::isfinite(fc[ib][i])) {
                    throw std::runtime_error("tracker section is corrupted (offset out of range)");
                }
            }
        }
    }

    std::vector<std::vector<float>> maps;
    if (replace) {
        for (uint32_t ib = 0; ib < n_layers; ++ib) {
            layers[ib].c = fc[ib];
        }
        write_offsets();
        pending_read = false;
        return maps;
    }
    bool same = true;
    for (uint32_t ib = 0; ib < n_layers && same; ++ib) {
        same = fc[ib] == layers[ib].c;
    }
    if (same) {
        return maps;
    }
    // other sequences keep the offset in use: the restored keys move onto it,
    // k - c = x + (c_f - c) for a row x stored as k - c_f
    maps.resize(n_layers);
    for (uint32_t ib = 0; ib < n_layers; ++ib) {
        const layer_state & l = layers[ib];
        maps[ib].resize(l.c.size());
        for (size_t i = 0; i < l.c.size(); ++i) {
            maps[ib][i] = fc[ib][i] - l.c[i];
        }
        reencode(l.k_main, cells, maps[ib]);
    }
    LLAMA_LOG_INFO("kvcomp: %zu restored K rows re-encoded onto this context's offsets\n", cells.size());
    return maps;
}

void llama_kvcomp_tracker::get_layer_stats(int32_t ib, llama_kvcomp_layer_stats & st) const {
    resolve();
    const layer_state & l = layers[ib];
    st.n_rows     = l.n_rows_measured;
    st.alpha      = l.alpha;
    const double n = (double) std::max<int64_t>(1, l.n_rows_measured * l.n_embd_k);
    st.k_rms          = (float) std::sqrt(l.k_energy / n);
    st.k_rmse         = (float) std::sqrt(l.k_err / n);
    st.k_rmse_offset  = st.k_rmse;
    st.k_rmse_plain   = (float) std::sqrt(l.k_err_plain / n);
    double e = 0.0;
    for (float v : l.c) {
        e += (double) v * v;
    }
    st.k_offset_rms = l.c.empty() ? 0.0f : (float) std::sqrt(e / (double) l.c.size());
    st.k_range_spread = 1.0f;
    const int64_t n_head_v = l.n_embd_v / l.n_embd_head_v;
    st.n_head_kv = (int32_t) n_head_v;
    for (int64_t h = 0; h < LLAMA_KVCOMP_MAX_HEADS; ++h) {
        st.v_scale[h] = h < n_head_v && l.warm ? 0.5f * (l.v_hi[h] - l.v_lo[h]) : 0.0f;
        float s = 0.0f;
        if (h < l.n_embd_k / l.n_embd_head_k && l.warm) {
            for (int64_t i = h * l.n_embd_head_k; i < (h + 1) * l.n_embd_head_k; ++i) {
                s = std::max(s, 0.5f * (l.k_hi[i] - l.k_lo[i]));
            }
        }
        st.k_scale[h] = s;
    }
}

void llama_kvcomp_tracker::get_head_stats(int32_t ib, int32_t h, float & rmse, float & rms) const {
    const layer_state & l = layers[ib];
    const double n = (double) std::max<int64_t>(1, l.n_rows_measured * l.n_embd_head_k);
    rmse = (float) std::sqrt(l.k_err_head[h] / n);
    rms  = (float) std::sqrt(l.k_energy_head[h] / n);
}
