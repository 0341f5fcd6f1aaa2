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

static uint32_t tap_stride(uint32_t n_tokens) {
    return (n_tokens + KVCOMP_TAP_ROWS - 1) / KVCOMP_TAP_ROWS;
}

llama_kvcomp_tracker::llama_kvcomp_tracker(const std::vector<layer_desc> & descs, const llama_kvcomp_params & params) : params(params) {
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
        l.c.assign(l.n_embd_k, 0.0f);
        tap.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, l.n_embd_k, KVCOMP_TAP_ROWS + 1));
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
    set_weights(false, 1);
}

llama_kvcomp_tracker::~llama_kvcomp_tracker() {
    // the tracker's measurement of the whole run, for `kvcomp kld` (docs/results.md)
    double err = 0.0, err_plain = 0.0, energy = 0.0;
    int64_t n_rows = 0, n_values = 0;
    for (const auto & l : layers) {
        err       += l.k_err_offset;
        err_plain += l.k_err_plain;
        energy    += l.k_energy;
        n_rows    += l.n_rows_measured;
        n_values  += l.n_rows_measured * l.n_embd_k;
    }
    if (n_values > 0) {
        LLAMA_LOG_INFO("kvcomp: tracker: K rows measured = %lld, RMSE = %.6f, RMSE without offset = %.6f, row RMS = %.6f\n",
                (long long) n_rows, std::sqrt(err / n_values), std::sqrt(err_plain / n_values), std::sqrt(energy / n_values));
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

    // The tap's last row holds the offset. c = Σ_r tap_r · w_r: w picks that row, or, for a
    // ubatch that sets the offset, weighs the sampled rows 1/n (their mean; the host then
    // stores the same mean in the last row). One graph shape for every ubatch and few nodes:
    // the graph's node budget is upstream's. The view of the whole tap hangs on the copy, so
    // it is read after the copy.
    ggml_tensor * all = ggml_view_2d(ctx0, tapped, ne0, KVCOMP_TAP_ROWS + 1, tap[ib]->nb[1], 0);
    return ggml_sub(ctx0, cur, ggml_out_prod(ctx0, all, calibrate));
}

ggml_tensor * llama_kvcomp_tracker::add_offset(ggml_context * ctx0, ggml_tensor * rows, int32_t ib, float sign) const {
    const layer_state & l = layers[ib];
    // rows: [n_rot, n_head_kv, n_cells] over the first n_rot values of each head
    ggml_tensor * c = ggml_cont(ctx0, ggml_view_3d(ctx0, tap[ib], rows->ne[0], rows->ne[1], 1,
            l.n_embd_head_k * sizeof(float), l.n_embd_k * sizeof(float), KVCOMP_TAP_ROWS * tap[ib]->nb[1]));
    return sign > 0.0f ? ggml_add(ctx0, rows, c) : ggml_sub(ctx0, rows, c);
}

void llama_kvcomp_tracker::fold(layer_state & l, std::vector<update_stats> & win, const float * rows, uint32_t n_rows, int64_t n_embd) const {
    GGML_UNUSED(l);
    update_stats & u = win[n_updates % KVCOMP_WINDOW];
    u.n = n_rows;
    u.sum.assign(n_embd, 0.0f);
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
            u.sum[i] += x[i];
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
    std::vector<float> mean(l.n_embd_k), hi(l.n_embd_k), lo(l.n_embd_k), cand_hi, cand_lo;
    for (int64_t i = 0; i < l.n_embd_k; ++i) {
        double s = 0.0;
        cand_hi.clear();
        cand_lo.clear();
        for (const auto & u : l.k_win) {
            if (u.n == 0) {
                continue;
            }
            s += u.sum[i];
            for (float v : { u.hi1[i], u.hi2[i] }) {
                if (std::isfinite(v)) cand_hi.push_back(v);
            }
            for (float v : { u.lo1[i], u.lo2[i] }) {
                if (std::isfinite(v)) cand_lo.push_back(v);
            }
        }
        mean[i] = (float) (s / (double) n);
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
    smooth(l.k_mean, mean);
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
                e += (double) (x[i] - y[i]) * (x[i] - y[i]);
            }
            (pass ? l.k_err_offset : l.k_err_plain) += e;
        }
        for (int64_t i = 0; i < n; ++i) {
            l.k_energy += (double) raw[i] * raw[i];
        }
    }
    l.n_rows_measured += (int64_t) n_rows;
}

void llama_kvcomp_tracker::write_offsets() const {
    for (size_t ib = 0; ib < layers.size(); ++ib) {
        ggml_backend_tensor_set(tap[ib], layers[ib].c.data(), KVCOMP_TAP_ROWS * tap[ib]->nb[1], tap[ib]->nb[1]);
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
        std::vector<float> rows, vrows;
        std::vector<uint8_t> raw;
        for (size_t ib = 0; ib < layers.size(); ++ib) {
            layer_state & l = layers[ib];
            const uint32_t n_rows = (uint32_t) tap_cells.size();
            rows.resize((size_t) n_rows * l.n_embd_k);
            ggml_backend_tensor_get(tap[ib], rows.data(), 0, rows.size() * sizeof(float));
            fold(l, l.k_win, rows.data(), n_rows, l.n_embd_k);

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
            fold(l, l.v_win, vrows.data(), n_rows, l.n_embd_v);

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
        // the cache starts over: the smoothed mean when there is one, else this ubatch's rows;
        // with the tracker switched off, no offset
        const bool warm = std::all_of(layers.begin(), layers.end(), [](const layer_state & l) { return l.warm; });
        if (params.tracker && !warm) {
            calibrating = true;
        } else {
            for (auto & l : layers) {
                if (params.tracker) {
                    l.c = l.k_mean;
                } else {
                    std::fill(l.c.begin(), l.c.end(), 0.0f);
                }
            }
            write_offsets();
        }
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

// Adds delta to the given rows of t, through F32 (the rows are re-quantized once).
void llama_kvcomp_tracker::reencode(ggml_tensor * t, const std::vector<uint64_t> & rows, const std::vector<float> & delta) {
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
            x[i] += delta[i];
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
    // a state saved without a tracker holds rows stored as they came: offset zero
    uint32_t n = (uint32_t) layers.size();
    if (!present) {
        std::vector<std::vector<float>> file(n);
        for (uint32_t ib = 0; ib < n; ++ib) {
            file[ib].assign(layers[ib].c.size(), 0.0f);
        }
        return adopt(file, cells, replace);
    }
    io.read(&n, sizeof(n));
    if (n != layers.size()) {
        throw std::runtime_error("tracker section has " + std::to_string(n) + " layers, the cache " + std::to_string(layers.size()));
    }
    std::vector<std::vector<float>> file(n);
    for (uint32_t ib = 0; ib < n; ++ib) {
        uint32_t ne = 0;
        io.read(&ne, sizeof(ne));
        if (ne != layers[ib].c.size()) {
            throw std::runtime_error("tracker section is for another model");
        }
        file[ib].resize(ne);
        io.read(file[ib].data(), ne * sizeof(float));
        for (float v : file[ib]) {
            if (!std::isfinite(v)) {
                throw std::runtime_error("tracker section is corrupted (non-finite offset)");
            }
        }
    }

    return adopt(file, cells, replace);
}

std::vector<std::vector<float>> llama_kvcomp_tracker::adopt(const std::vector<std::vector<float>> & file,
                                                            const std::vector<uint64_t> & cells, bool replace) {
    const size_t n = layers.size();
    std::vector<std::vector<float>> delta;
    if (replace) {
        for (size_t ib = 0; ib < n; ++ib) {
            layers[ib].c = file[ib];
        }
        write_offsets();
        pending_read = false;
        return delta;
    }
    // other sequences keep the offsets in use: the restored keys move onto them
    bool same = true;
    for (size_t ib = 0; ib < n && same; ++ib) {
        same = file[ib] == layers[ib].c;
    }
    if (same) {
        return delta;
    }
    delta.resize(n);
    for (size_t ib = 0; ib < n; ++ib) {
        delta[ib].resize(file[ib].size());
        for (size_t i = 0; i < file[ib].size(); ++i) {
            delta[ib][i] = file[ib][i] - layers[ib].c[i];
        }
        reencode(layers[ib].k_main, cells, delta[ib]);
    }
    LLAMA_LOG_INFO("kvcomp: %zu restored K rows re-encoded onto this context's offsets\n", cells.size());
    return delta;
}

void llama_kvcomp_tracker::get_layer_stats(int32_t ib, llama_kvcomp_layer_stats & st) const {
    resolve();
    const layer_state & l = layers[ib];
    st.n_rows     = l.n_rows_measured;
    st.alpha      = l.alpha;
    const double n = (double) std::max<int64_t>(1, l.n_rows_measured * l.n_embd_k);
    st.k_rms          = (float) std::sqrt(l.k_energy / n);
    st.k_rmse         = (float) std::sqrt(l.k_err_offset / n);
    st.k_rmse_plain   = (float) std::sqrt(l.k_err_plain / n);
    double e = 0.0;
    for (float v : l.c) {
        e += (double) v * v;
    }
    st.k_offset_rms = l.c.empty() ? 0.0f : (float) std::sqrt(e / (double) l.c.size());
    // how unequal the channels' ranges are (1: equal), what per-channel equalization would act on
    float rmin = INFINITY, rmax = 0.0f;
    for (size_t i = 0; i < l.k_hi.size(); ++i) {
        const float r = l.k_hi[i] - l.k_lo[i];
        rmin = std::min(rmin, r);
        rmax = std::max(rmax, r);
    }
    st.k_range_spread = l.warm && rmin > 0.0f ? rmax / rmin : 0.0f;
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
