#include "kvcomp-tracker.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "kvc-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

// the window of updates the statistics cover, and how often they are recomputed (the
// window's groups)
static constexpr uint32_t KVCOMP_WINDOW   = 32;
static constexpr uint32_t KVCOMP_RECOMPUTE = 8;
static constexpr double   KVCOMP_QUANTILE = 0.999;

static uint32_t tap_stride(uint32_t n_tokens, uint32_t n_tap) {
    return (n_tokens + n_tap - 1) / n_tap;
}

static bool all_finite(const float * x, int64_t n) {
    // x - x is 0 for a finite x only: no branch per value, so the loop vectorizes
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) {
        ok &= x[i] - x[i] == 0.0f;
    }
    return ok;
}

// the trackers alive, by the K tensor of each cache layer they sample (of_layer)
namespace {
struct tracker_registry {
    std::mutex mtx;
    std::map<const ggml_tensor *, std::pair<const llama_kvcomp_tracker *, int32_t>> layers;
};

tracker_registry & registry() {
    static tracker_registry r;
    return r;
}
} // namespace

const llama_kvcomp_tracker * llama_kvcomp_tracker::of_layer(const ggml_tensor * k, int32_t & ib) {
    tracker_registry & r = registry();
    std::lock_guard<std::mutex> lock(r.mtx);
    const auto it = r.layers.find(k);
    if (it == r.layers.end()) {
        return nullptr;
    }
    ib = it->second.second;
    return it->second.first;
}

void * llama_kvcomp_cpu_proc(const char * name) {
    ggml_backend_reg_t cpu = ggml_backend_reg_by_name("CPU");
    return cpu ? ggml_backend_reg_get_proc_address(cpu, name) : nullptr;
}

// measure() quantizes a row of every layer every KVCOMP_RECOMPUTE updates: with the CPU
// backend's quantizer (the same bytes as the reference, SIMD where the build has it) it is a
// small part of the step it runs in, with the scalar reference a large one.
static ggml_from_float_t k_quantizer(ggml_type type) {
    const auto get = (ggml_kvc_cpu_get_from_float_t) llama_kvcomp_cpu_proc("ggml_kvc_cpu_get_from_float");
    ggml_from_float_t q = get ? get(type) : nullptr;
    return q ? q : ggml_get_type_traits(type)->from_float_ref;
}

// the rows read back each update: the CPU backend's dequantizer (SIMD, the same floats)
static ggml_to_float_t dequantizer(ggml_type type) {
    const auto get = (ggml_kvc_cpu_get_to_float_t) llama_kvcomp_cpu_proc("ggml_kvc_cpu_get_to_float");
    ggml_to_float_t f = get ? get(type) : nullptr;
    return f ? f : ggml_get_type_traits(type)->to_float;
}

llama_kvcomp_tracker::llama_kvcomp_tracker(const std::vector<layer_desc> & descs, const llama_kvcomp_params & params,
                                           uint32_t n_stream, uint32_t n_ubatch, bool shared_streams)
    : params(params), n_stream(n_stream), shared_streams(shared_streams) {
    const size_t n = descs.size();
    // each layer's store beside its cells, the tensors every layer reads beside the first's
    const size_t n_tensors = n + 5;
    ggml_context * ctx = storage.ctx_for(ggml_backend_buffer_get_type(descs[0].k->buffer), n_tensors);
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
        l.k_win = kvcomp_window(l.n_embd_k, KVCOMP_WINDOW, KVCOMP_RECOMPUTE, KVCOMP_TAP_N, KVCOMP_QUANTILE);
        l.v_win = kvcomp_window(l.n_embd_v, KVCOMP_WINDOW, KVCOMP_RECOMPUTE, KVCOMP_TAP_N, KVCOMP_QUANTILE);
        l.k_err_head.assign(l.n_embd_k / l.n_embd_head_k, 0.0);
        l.k_energy_head.assign(l.n_embd_k / l.n_embd_head_k, 0.0);
        l.c.assign((size_t) n_stream * l.n_embd_k, 0.0f);
        l.k_quantize = k_quantizer(kl.k->type);
        l.k_to_float = dequantizer(kl.k->type);
        l.v_to_float = dequantizer(kl.v->type);
        store.push_back(ggml_new_tensor_2d(storage.ctx_for(ggml_backend_buffer_get_type(kl.k->buffer), n_tensors), GGML_TYPE_F32,
                                           l.n_embd_k, n_store_rows()));
        ggml_format_name(store.back(), "kvcomp_store_l%u", kl.il);
    }
    weights   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, KVCOMP_CALIB_N + 1, n_stream);
    copy_idx  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_ubatch);
    old_main  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_reencode_max());
    old_raw   = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_reencode_max());
    old_plane = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_reencode_max());
    ggml_set_name(weights, "kvcomp_weights");
    ggml_set_name(copy_idx, "kvcomp_copy_idx");

    storage.alloc("tracker");
    // a decode step pays a barrier of every thread per node: on a host cache, a graph that
    // makes no offset takes its K rows in one CPU node; a device cache keeps the graph form
    if (storage.is_host()) {
        offset_rows = (ggml_custom_op_t) llama_kvcomp_cpu_proc("ggml_kvc_cpu_offset_rows");
    }
    streams.resize(n_stream);
    reenc.assign(n, nullptr);

    tracker_registry & r = registry();
    std::lock_guard<std::mutex> lock(r.mtx);
    for (size_t ib = 0; ib < n; ++ib) {
        r.layers[descs[ib].k] = { this, (int32_t) ib };
    }
}

llama_kvcomp_tracker::~llama_kvcomp_tracker() {
    // the tracker's measurement of the whole run, for `kvcomp kld`
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
    if (n_nonfinite_rows > 0) {
        LLAMA_LOG_WARN("kvcomp: tracker: %lld sampled rows held non-finite values and were left out of the statistics\n",
                (long long) n_nonfinite_rows);
    }
    {
        tracker_registry & r = registry();
        std::lock_guard<std::mutex> lock(r.mtx);
        for (auto it = r.layers.begin(); it != r.layers.end();) {
            it = it->second.first == this ? r.layers.erase(it) : std::next(it);
        }
    }
}

ggml_tensor * llama_kvcomp_tracker::transform(ggml_context * ctx0, ggml_tensor * cur, int32_t ib, bool is_k) const {
    reenc[ib] = nullptr;
    if (!is_k) {
        return cur;
    }
    ggml_tensor * st = store[ib];
    const int64_t  ne0      = cur->ne[0];
    const uint32_t n_tok    = (uint32_t) cur->ne[1];
    const uint32_t stride   = tap_stride(n_tok, KVCOMP_TAP_N);
    const int64_t  n_sample = (n_tok + stride - 1) / stride;
    // a graph built without a ubatch of its own (a reserve) has one plane per stream
    const int64_t  np  = n_tok % n_planes == 0 && plane_strm0 + n_planes <= n_stream ? n_planes : 1;
    const int64_t  ntp = n_tok / np;
    const size_t   nb1 = st->nb[1];

    ggml_tensor * sampled = ggml_view_2d(ctx0, cur, ne0, n_sample, cur->nb[1] * stride, 0);
    // each plane's c in the row after its block
    const auto c_view = [&](ggml_tensor * src) {
        return ggml_view_3d(ctx0, src, ne0, 1, np, nb1, nb1 * (KVCOMP_CALIB_N + 1), row_c(plane_strm0) * nb1);
    };
    ggml_tensor * w = ggml_view_3d(ctx0, weights, 1, KVCOMP_CALIB_N + 1, np, weights->nb[1], weights->nb[2], 0);
    ggml_tensor * idx = ggml_view_1d(ctx0, copy_idx, n_tok, 0);
    if (one_node() && np == (int64_t) n_planes) {
        // what the nodes below do, in one
        ggml_tensor * args[] = { cur, c_view(st), w, idx, st, sampled, ggml_view_2d(ctx0, st, ne0, n_sample, nb1, 0) };
        return ggml_custom_4d(ctx0, GGML_TYPE_F32, ne0, n_tok, 1, 1, args, 7, offset_rows, 1, nullptr);
    }
    ggml_tensor * tapped  = ggml_cpy(ctx0, sampled, ggml_view_2d(ctx0, st, ne0, n_sample, nb1, 0));

    // The graph's node budget is upstream's: few nodes, one shape for every ubatch. The views
    // of the store hang on the copy, so they are read after it: the rows of this ubatch that
    // are among its stream's first go to the stream's block, then each plane's c is made from
    // its block (the mean of those rows when they are complete now, else the c it holds, or 0)
    // and written back to it.
    // A value that is not finite (a model's NaN) is 0, as the quantizer takes it without a
    // tracker (docs/formats.md), both in c and in the row stored as k - c: leaky_relu with
    // slope 1, (x > 0 ? x : 0) + (x < 0 ? x : 0), is x for every finite x and 0 for NaN, and
    // the clamp to F16's range bounds an infinity.
    // One NaN would otherwise make c, and so every later key of the stream, NaN (stored as
    // zeros), and a NaN row would be stored as k = c instead of k = 0.
    ggml_tensor * finite = ggml_clamp(ctx0, ggml_leaky_relu(ctx0, cur, 1.0f, false), -65504.0f, 65504.0f);
    ggml_tensor * c_rows = nullptr;
    if (steady && np == (int64_t) n_planes) {
        // every plane's c is fixed (set, or 0) and its row of the store holds it: read there,
        // without making it again (a node costs a barrier of every thread in a decode step)
        c_rows = c_view(tapped);
    } else {
        ggml_tensor * all = ggml_view_2d(ctx0, tapped, ne0, n_store_rows(), nb1, 0);
        all = ggml_set_rows(ctx0, all, finite, idx);
        ggml_tensor * blocks = ggml_view_3d(ctx0, all, ne0, KVCOMP_CALIB_N + 1, np, nb1, nb1 * (KVCOMP_CALIB_N + 1),
                row_raw(plane_strm0, 0) * nb1);
        ggml_tensor * c = ggml_out_prod(ctx0, blocks, w); // [ne0, 1, np]
        c_rows = ggml_cpy(ctx0, c, c_view(all));

        if (!old_rows.empty()) {
            // earlier rows of a stream that sets its c now: stored again from their copies
            const int64_t n_old = (int64_t) old_rows.size();
            ggml_tensor * raw = ggml_get_rows(ctx0, all, ggml_view_1d(ctx0, old_raw, n_old, 0));
            ggml_tensor * cs  = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, c, ne0, np), ggml_view_1d(ctx0, old_plane, n_old, 0));
            reenc[ib] = ggml_sub(ctx0, raw, cs);
        }
    }

    ggml_tensor * x = ggml_view_3d(ctx0, finite, ne0, ntp, np, finite->nb[1], finite->nb[1] * ntp, 0);
    return ggml_reshape_2d(ctx0, ggml_sub(ctx0, x, c_rows), ne0, n_tok);
}

ggml_tensor * llama_kvcomp_tracker::reencoded(int32_t ib) const {
    return reenc[ib];
}

ggml_tensor * llama_kvcomp_tracker::reencode_rows(ggml_context * ctx0) const {
    return ggml_view_1d(ctx0, old_main, (int64_t) old_rows.size(), 0);
}

ggml_tensor * llama_kvcomp_tracker::unstore(ggml_context * ctx0, ggml_tensor * rows, int32_t ib, bool back) const {
    const layer_state & l = layers[ib];
    ggml_tensor * st = store[ib];
    // rows: [n_rot, n_head_kv, rows of every stream] over the first n_rot values of each head
    const int64_t n_per = rows->ne[2] / n_stream;
    ggml_tensor * r4 = ggml_reshape_4d(ctx0, rows, rows->ne[0], rows->ne[1], n_per, n_stream);
    ggml_tensor * c  = ggml_cont(ctx0, ggml_view_4d(ctx0, st, rows->ne[0], rows->ne[1], 1, n_stream,
            l.n_embd_head_k * sizeof(float), st->nb[1], st->nb[1] * (KVCOMP_CALIB_N + 1), row_c(0) * st->nb[1]));
    r4 = back ? ggml_sub(ctx0, r4, c) : ggml_add(ctx0, r4, c);
    return ggml_reshape_3d(ctx0, r4, rows->ne[0], rows->ne[1], rows->ne[2]);
}

void llama_kvcomp_tracker::recompute(layer_state & l) {
    if (l.k_win.n_rows() == 0) {
        return;
    }
    std::vector<float> hi, lo, vhi_c, vlo_c;
    l.k_win.quantiles(hi, lo);
    // V per head: from the lowest of its channels' quantiles to the highest
    l.v_win.quantiles(vhi_c, vlo_c);
    const int64_t n_head_v = l.n_embd_v / l.n_embd_head_v;
    std::vector<float> vhi(n_head_v), vlo(n_head_v);
    for (int64_t h = 0; h < n_head_v; ++h) {
        const int64_t i0 = h * l.n_embd_head_v;
        vhi[h] = *std::max_element(vhi_c.begin() + i0, vhi_c.begin() + i0 + l.n_embd_head_v);
        vlo[h] = *std::min_element(vlo_c.begin() + i0, vlo_c.begin() + i0 + l.n_embd_head_v);
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

void llama_kvcomp_tracker::measure(layer_state & l, const float * k_rows, const uint64_t * cells, size_t n_rows) {
    const ggml_tensor * k_main = l.k_main;
    const int64_t n  = l.n_embd_k;
    const int64_t hd = l.n_embd_head_k;
    const int64_t n_head = n / hd;
    std::vector<uint8_t> q(k_main->nb[1]);
    std::vector<float> x(n), y(n);
    // per head: the squared error as the row came (pass 0) and as stored (1)
    std::vector<double> e_head[2] = { std::vector<double>(n_head), std::vector<double>(n_head) };
    const uint64_t n_cells = (uint64_t) ggml_nrows(k_main) / n_stream; // ([n_embd, cells, streams])
    for (size_t r = 0; r < n_rows; ++r) {
        const float * raw = k_rows + r * n;
        const float * c   = l.c.data() + (cells[r] / n_cells) * n;
        // a stream whose offset is not set stores the row as it came: one quantization
        const bool has_c = std::any_of(c, c + n, [](float v) { return v != 0.0f; });
        double e[2] = { 0.0, 0.0 };
        for (int pass = 0; pass < (has_c ? 2 : 1); ++pass) {
            for (int64_t i = 0; i < n; ++i) {
                x[i] = raw[i] - (pass ? c[i] : 0.0f);
            }
            if (k_main->type == GGML_TYPE_F32) {
                y = x;
            } else {
                l.k_quantize(x.data(), q.data(), n);
                l.k_to_float(q.data(), y.data(), n);
            }
            // head by head: an index divided per value cost more than the quantization
            for (int64_t h = 0; h < n_head; ++h) {
                double eh = 0.0;
                for (int64_t i = h * hd; i < (h + 1) * hd; ++i) {
                    const double d = (double) (x[i] - y[i]);
                    eh += d * d;
                }
                e_head[pass][h] = eh;
                e[pass] += eh;
            }
        }
        if (!has_c) {
            e[1] = e[0];
            e_head[1] = e_head[0];
        }
        // the row is finite (update() checked), the offset it is stored under may not be
        if (!std::isfinite(e[0]) || !std::isfinite(e[1])) {
            ++n_nonfinite_rows;
            continue;
        }
        l.k_err_plain += e[0];
        l.k_err       += e[1];
        for (int64_t h = 0; h < n_head; ++h) {
            double eh = 0.0;
            for (int64_t i = h * hd; i < (h + 1) * hd; ++i) {
                eh += (double) raw[i] * raw[i];
            }
            l.k_err_head[h]    += e_head[1][h];
            l.k_energy_head[h] += eh;
            l.k_energy         += eh;
        }
        ++l.n_rows_measured;
    }
}

void llama_kvcomp_tracker::write_offsets(uint32_t strm) const {
    for (size_t ib = 0; ib < layers.size(); ++ib) {
        const layer_state & l = layers[ib];
        ggml_backend_tensor_set(store[ib], l.c.data() + (size_t) strm * l.n_embd_k, row_c(strm) * store[ib]->nb[1], store[ib]->nb[1]);
    }
}

void llama_kvcomp_tracker::resolve() const {
    // the last ubatch's graph made these streams' offsets: the host copies take them
    for (uint32_t strm : pending_read) {
        for (size_t ib = 0; ib < layers.size(); ++ib) {
            layer_state & l = layers[ib];
            ggml_backend_tensor_get(store[ib], l.c.data() + (size_t) strm * l.n_embd_k, row_c(strm) * store[ib]->nb[1], store[ib]->nb[1]);
        }
    }
    pending_read.clear();
}

void llama_kvcomp_tracker::fix_zero(uint32_t strm) {
    // The store's row of a stream may hold the last sequence's c until a graph makes c again,
    // and a steady graph reads c there: the stream's 0 (its host copy) goes there at once.
    streams[strm].status = CALIB_STATUS_NONE;
    write_offsets(strm);
}

void llama_kvcomp_tracker::on_shift() {
    // the copies are of rows at their old positions, under their old rotation
    for (uint32_t strm = 0; strm < n_stream; ++strm) {
        if (streams[strm].status == CALIB_STATUS_PENDING) {
            fix_zero(strm);
        }
    }
}

std::vector<std::pair<uint32_t, llama_pos>> llama_kvcomp_tracker::first_rows(const llama_kv_cells & cells, uint32_t strm) const {
    const stream_state & ss = streams[strm];
    std::vector<std::pair<uint32_t, llama_pos>> out;
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (cells.is_empty(c) || !cells.seq_has(c, ss.seq)) {
            continue;
        }
        const llama_pos d = cells.pos_get(c) - ss.p0;
        if (d >= 0 && d < (llama_pos) KVCOMP_CALIB_N) {
            out.push_back({ c, d });
        }
    }
    return out;
}

void llama_kvcomp_tracker::update(const llama_kv_cells_vec & cells, const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ubatch) {
    resolve();
    if (!tap_cells.empty() && params.tracker) {
        const bool measure_now = n_updates % KVCOMP_RECOMPUTE == 0;
        // Each read below waits for the device that holds the cache: off the host, the windows
        // take every KVCOMP_RECOMPUTE-th update only, so the decode steps between need no round trip.
        const bool on_host = layers.empty() || ggml_backend_buffer_is_host(layers[0].v_main->buffer);
        std::vector<float> rows, vrows;
        std::vector<uint64_t> good_cells;
        std::vector<uint8_t> raw;
        // An update whose rows are read here counts once one of its rows is left in a layer:
        // a ubatch of non-finite rows only leaves the statistics as they were. The layers it
        // left nothing in get an empty window slot once it counts.
        bool counted = !(on_host || measure_now);
        std::vector<size_t> empty_layers;
        for (size_t ib = 0; ib < layers.size() && (on_host || measure_now); ++ib) {
            layer_state & l = layers[ib];
            const uint32_t n_rows = (uint32_t) tap_cells.size();
            rows.resize((size_t) n_rows * l.n_embd_k);
            ggml_backend_tensor_get(store[ib], rows.data(), 0, rows.size() * sizeof(float));

            // V rows as stored: nothing is subtracted from them
            const ggml_tensor * v = l.v_main;
            vrows.resize((size_t) n_rows * l.n_embd_v);
            raw.resize(v->nb[1]);
            for (uint32_t r = 0; r < n_rows; ++r) {
                ggml_backend_tensor_get(v, raw.data(), tap_cells[r] * v->nb[1], v->nb[1]);
                if (v->type == GGML_TYPE_F32) {
                    std::memcpy(vrows.data() + (size_t) r * l.n_embd_v, raw.data(), v->nb[1]);
                } else {
                    l.v_to_float(raw.data(), vrows.data() + (size_t) r * l.n_embd_v, l.n_embd_v);
                }
            }

            // A token's rows are kept or left out together: a K row that came out non-finite
            // is stored as zeros in a kvc V row that is no value of the model either
            // (docs/formats.md, "NaN/Inf").
            uint32_t n_good = 0;
            good_cells.clear();
            for (uint32_t r = 0; r < n_rows; ++r) {
                const float * kr = rows.data() + (size_t) r * l.n_embd_k;
                const float * vr = vrows.data() + (size_t) r * l.n_embd_v;
                if (!all_finite(kr, l.n_embd_k) || !all_finite(vr, l.n_embd_v)) {
                    ++n_nonfinite_rows;
                    continue;
                }
                if (n_good != r) {
                    std::copy(kr, kr + l.n_embd_k, rows.data() + (size_t) n_good * l.n_embd_k);
                    std::copy(vr, vr + l.n_embd_v, vrows.data() + (size_t) n_good * l.n_embd_v);
                }
                good_cells.push_back(tap_cells[r]);
                ++n_good;
            }
            if (n_good == 0) {
                empty_layers.push_back(ib);
                continue;
            }
            counted = true;
            l.k_win.fold(n_updates, rows.data(), n_good);
            l.v_win.fold(n_updates, vrows.data(), n_good);
            if (measure_now) {
                measure(l, rows.data(), good_cells.data(), n_good);
            }
        }
        if (counted) {
            for (size_t ib : empty_layers) {
                layers[ib].k_win.fold(n_updates, nullptr, 0);
                layers[ib].v_win.fold(n_updates, nullptr, 0);
            }
            ++n_updates;
            if (n_updates % KVCOMP_RECOMPUTE == 0) {
                for (auto & l : layers) {
                    recompute(l);
                }
            }
        }
    }

    // what this ubatch's graph does per stream plane (its tokens, stream by stream)
    ++n_setups;
    n_planes    = (uint32_t) sinfo.n_stream();
    plane_strm0 = sinfo.strm[0];
    const uint32_t ntp = sinfo.size();
    std::vector<float>   w((size_t) (KVCOMP_CALIB_N + 1) * n_stream, 0.0f);
    std::vector<int64_t> idx(ubatch.n_tokens, row_trash());
    steady = true;
    quiet  = true;
    old_rows.clear();
    old_raw_h.clear();
    old_plane_h.clear();
    for (uint32_t p = 0; p < n_planes; ++p) {
        const uint32_t strm = sinfo.strm[p];
        const uint32_t i0   = p * ntp;
        stream_state & ss = streams[strm];
        if (cells[strm].get_used() <= ntp) {
            // The stream starts over: its offset will come from the first rows of the sequence
            // starting it, never from what earlier sequences left (the statistics, other
            // streams), so what a sequence computes depends on its own tokens only.
            ss.seq = ubatch.seq_id[i0][0];
            ss.p0  = ubatch.pos[i0];
            for (auto & l : layers) {
                std::fill(l.c.begin() + (size_t) strm * l.n_embd_k, l.c.begin() + (size_t) (strm + 1) * l.n_embd_k, 0.0f);
            }
            if (params.tracker && !shared_streams) {
                ss.status = CALIB_STATUS_PENDING;
            } else {
                fix_zero(strm);
            }
        }
        if (ss.status == CALIB_STATUS_PENDING && !params.tracker) {
            fix_zero(strm);
        }
        float * wp = w.data() + (size_t) p * (KVCOMP_CALIB_N + 1);
        if (ss.status == CALIB_STATUS_PENDING) {
            // this graph makes the plane's c: 0 while its first rows come in, their mean once
            // they are all in
            steady = false;
            bool all_first = true;
            for (uint32_t i = i0; i < i0 + ntp; ++i) {
                const llama_pos d = ubatch.pos[i] - ss.p0;
                if (ubatch.n_seq_id[i] == 1 && ubatch.seq_id[i][0] == ss.seq && d >= 0 && d < (llama_pos) KVCOMP_CALIB_N) {
                    idx[i] = row_raw(strm, d);
                } else {
                    all_first = false;
                }
            }
            const auto first = first_rows(cells[strm], strm);
            std::vector<bool> seen(KVCOMP_CALIB_N, false);
            for (const auto & [c, d] : first) {
                seen[d] = true;
            }
            if (std::find(seen.begin(), seen.end(), false) == seen.end()) {
                std::fill(wp, wp + KVCOMP_CALIB_N, 1.0f / (float) KVCOMP_CALIB_N);
                // the earlier ones are stored again
                const std::vector<uint32_t> & ub = sinfo.idxs[p];
                for (const auto & [c, d] : first) {
                    if (std::find(ub.begin(), ub.end(), c) == ub.end()) {
                        old_rows.push_back((uint64_t) strm * cells[strm].size() + c);
                        old_raw_h.push_back((int32_t) row_raw(strm, d));
                        old_plane_h.push_back((int32_t) p);
                    }
                }
                ss.status = CALIB_STATUS_SET;
                pending_read.push_back(strm);
                quiet = false;
            } else if (!all_first) {
                // rows the stream keeps no copy of are stored as they came: c stays 0
                fix_zero(strm);
            }
        } else if (ss.status == CALIB_STATUS_SET) {
            wp[KVCOMP_CALIB_N] = 1.0f;
        }
    }
    steady = steady && old_rows.empty();
    if (w != w_host) {
        ggml_backend_tensor_set(weights, w.data(), 0, w.size() * sizeof(float));
        w_host = w;
    }
    if (idx != idx_host) {
        ggml_backend_tensor_set(copy_idx, idx.data(), 0, idx.size() * sizeof(int64_t));
        idx_host = idx;
    }
    if (!old_rows.empty()) {
        const std::vector<int64_t> rows(old_rows.begin(), old_rows.end());
        ggml_backend_tensor_set(old_main, rows.data(), 0, rows.size() * sizeof(int64_t));
        ggml_backend_tensor_set(old_raw, old_raw_h.data(), 0, old_raw_h.size() * sizeof(int32_t));
        ggml_backend_tensor_set(old_plane, old_plane_h.data(), 0, old_plane_h.size() * sizeof(int32_t));
    }

    const uint32_t stride = tap_stride(ubatch.n_tokens, KVCOMP_TAP_N);
    tap_cells.clear();
    for (uint32_t p = 0; p < n_planes; ++p) {
        for (uint32_t j = 0; j < ntp; ++j) {
            if ((p * ntp + j) % stride == 0) {
                tap_cells.push_back((uint64_t) sinfo.strm[p] * cells[0].size() + sinfo.idxs[p][j]);
            }
        }
    }
}

void llama_kvcomp_tracker::copy_stream(uint32_t ssrc, uint32_t sdst) {
    resolve();
    std::vector<uint8_t> tmp;
    for (size_t ib = 0; ib < layers.size(); ++ib) {
        layer_state & l = layers[ib];
        const size_t n = store[ib]->nb[1] * (KVCOMP_CALIB_N + 1);
        tmp.resize(n);
        ggml_backend_tensor_get(store[ib], tmp.data(), row_raw(ssrc, 0) * store[ib]->nb[1], n);
        ggml_backend_tensor_set(store[ib], tmp.data(), row_raw(sdst, 0) * store[ib]->nb[1], n);
        std::copy(l.c.begin() + (size_t) ssrc * l.n_embd_k, l.c.begin() + (size_t) (ssrc + 1) * l.n_embd_k,
                  l.c.begin() + (size_t) sdst * l.n_embd_k);
    }
    streams[sdst] = streams[ssrc];
}

void llama_kvcomp_tracker::state_write(llama_io_write_i & io, const std::vector<bool> & holds) const {
    resolve();
    const uint32_t n = (uint32_t) layers.size();
    io.write(&n, sizeof(n));
    io.write(&n_stream, sizeof(n_stream));
    for (uint32_t strm = 0; strm < n_stream; ++strm) {
        const uint32_t held = holds[strm] ? 1 : 0;
        io.write(&held, sizeof(held));
        if (!held) {
            continue;
        }
        const stream_state & ss = streams[strm];
        const uint32_t status = ss.status;
        io.write(&status, sizeof(status));
        io.write(&ss.seq, sizeof(ss.seq));
        io.write(&ss.p0, sizeof(ss.p0));
        for (size_t ib = 0; ib < layers.size(); ++ib) {
            const layer_state & l = layers[ib];
            const uint32_t ne = (uint32_t) l.n_embd_k;
            io.write(&ne, sizeof(ne));
            io.write(l.c.data() + (size_t) strm * ne, ne * sizeof(float));
            if (ss.status == CALIB_STATUS_PENDING) {
                // the copies of its first rows, for the ubatch that completes them
                io.write_tensor(store[ib], row_raw(strm, 0) * store[ib]->nb[1], KVCOMP_CALIB_N * store[ib]->nb[1]);
            }
        }
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

std::vector<std::vector<std::vector<float>>> llama_kvcomp_tracker::state_read(llama_io_read_i & io,
        const std::vector<restore_target> & targets, llama_seq_id seq_id, bool present) {
    // the offsets a restored sequence moves onto must be the ones in force, not last step's
    resolve();
    const uint32_t n_layers = (uint32_t) layers.size();
    if (present) {
        uint32_t n = 0, ns = 0;
        io.read(&n, sizeof(n));
        io.read(&ns, sizeof(ns));
        if (n != n_layers) {
            throw std::runtime_error("tracker section has " + std::to_string(n) + " layers, the cache " + std::to_string(n_layers));
        }
        if (ns != targets.size()) {
            throw std::runtime_error("tracker section has " + std::to_string(ns) + " streams, the state " + std::to_string(targets.size()));
        }
    }
    std::vector<std::vector<std::vector<float>>> maps(targets.size());
    std::vector<float> fc, raw;
    for (size_t si = 0; si < targets.size(); ++si) {
        const restore_target & t = targets[si];
        // a state saved without a tracker holds rows stored as they came: c = 0
        uint32_t held = 0, status = CALIB_STATUS_NONE;
        llama_seq_id seq = -1;
        llama_pos p0 = 0;
        std::vector<std::vector<float>> cs(n_layers), raws(n_layers);
        if (present) {
            io.read(&held, sizeof(held));
            if (held > 1 || (held == 0) != t.cells.empty()) {
                throw std::runtime_error("tracker section is corrupted (its streams are not the state's)");
            }
            if (held) {
                io.read(&status, sizeof(status));
                io.read(&seq, sizeof(seq));
                io.read(&p0, sizeof(p0));
                if (status > CALIB_STATUS_SET) {
                    throw std::runtime_error("tracker section is corrupted (unknown offset state)");
                }
            }
        }
        for (uint32_t ib = 0; ib < n_layers; ++ib) {
            const layer_state & l = layers[ib];
            cs[ib].assign(l.n_embd_k, 0.0f);
            if (!held) {
                continue;
            }
            uint32_t ne = 0;
            io.read(&ne, sizeof(ne));
            if (ne != l.n_embd_k) {
                throw std::runtime_error("tracker section is for another model");
            }
            io.read(cs[ib].data(), ne * sizeof(float));
            for (float v : cs[ib]) {
                if (!std::isfinite(v)) {
                    throw std::runtime_error("tracker section is corrupted (offset out of range)");
                }
            }
            if (status == CALIB_STATUS_PENDING) {
                raws[ib].resize((size_t) KVCOMP_CALIB_N * ne);
                io.read(raws[ib].data(), raws[ib].size() * sizeof(float));
            }
        }
        if (t.cells.empty()) {
            continue;
        }
        stream_state & ss = streams[t.strm];
        if (t.replace) {
            // the stream holds the restored tokens only: it takes their offset (and, when they
            // were still collecting their first rows, the copies)
            ss.status = (calib_status) status;
            ss.seq    = seq_id == -1 ? seq : seq_id;
            ss.p0     = p0;
            for (uint32_t ib = 0; ib < n_layers; ++ib) {
                layer_state & l = layers[ib];
                std::copy(cs[ib].begin(), cs[ib].end(), l.c.begin() + (size_t) t.strm * l.n_embd_k);
                if (status == CALIB_STATUS_PENDING) {
                    ggml_backend_tensor_set(store[ib], raws[ib].data(), row_raw(t.strm, 0) * store[ib]->nb[1],
                            raws[ib].size() * sizeof(float));
                }
            }
            write_offsets(t.strm);
            pending_read.erase(std::remove(pending_read.begin(), pending_read.end(), t.strm), pending_read.end());
            continue;
        }
        // Other tokens keep the stream's offset: the restored keys move onto it,
        // k - c = x + (c_f - c) for a row x stored as k - c_f. A stream still collecting its
        // first rows now holds rows it has no copy of.
        if (ss.status == CALIB_STATUS_PENDING) {
            fix_zero(t.strm);
        }
        bool same = true;
        for (uint32_t ib = 0; ib < n_layers && same; ++ib) {
            const layer_state & l = layers[ib];
            same = std::equal(cs[ib].begin(), cs[ib].end(), l.c.begin() + (size_t) t.strm * l.n_embd_k);
        }
        if (same) {
            continue;
        }
        maps[si].resize(n_layers);
        for (uint32_t ib = 0; ib < n_layers; ++ib) {
            const layer_state & l = layers[ib];
            maps[si][ib].resize(l.n_embd_k);
            for (int64_t i = 0; i < l.n_embd_k; ++i) {
                maps[si][ib][i] = cs[ib][i] - l.c[(size_t) t.strm * l.n_embd_k + i];
            }
            reencode(l.k_main, t.cells, maps[si][ib]);
        }
        LLAMA_LOG_INFO("kvcomp: %zu restored K rows re-encoded onto stream %u's offsets\n", t.cells.size(), t.strm);
    }
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
    // over the streams whose offset is set
    double e = 0.0;
    size_t n_set = 0;
    for (uint32_t strm = 0; strm < n_stream; ++strm) {
        if (streams[strm].status != CALIB_STATUS_SET) {
            continue;
        }
        for (int64_t i = 0; i < l.n_embd_k; ++i) {
            const double v = l.c[(size_t) strm * l.n_embd_k + i];
            e += v * v;
        }
        ++n_set;
    }
    st.k_offset_rms = n_set == 0 ? 0.0f : (float) std::sqrt(e / (double) (n_set * l.n_embd_k));
    st.k_range_spread = 1.0f;
    st.n_head_kv = (int32_t) (l.n_embd_v / l.n_embd_head_v);
    // the first LLAMA_KVCOMP_MAX_HEADS heads; the monitor reads every head from get_head_scales
    for (int32_t h = 0; h < LLAMA_KVCOMP_MAX_HEADS; ++h) {
        get_head_scales(ib, h, st.k_scale[h], st.v_scale[h]);
    }
}

void llama_kvcomp_tracker::get_head_scales(int32_t ib, int32_t h, float & k_scale, float & v_scale) const {
    const layer_state & l = layers[ib];
    k_scale = 0.0f;
    v_scale = 0.0f;
    if (!l.warm) {
        return;
    }
    if (h < l.n_embd_v / l.n_embd_head_v) {
        v_scale = 0.5f * (l.v_hi[h] - l.v_lo[h]);
    }
    if (h < l.n_embd_k / l.n_embd_head_k) {
        for (int64_t i = (int64_t) h * l.n_embd_head_k; i < (int64_t) (h + 1) * l.n_embd_head_k; ++i) {
            k_scale = std::max(k_scale, 0.5f * (l.k_hi[i] - l.k_lo[i]));
        }
    }
}

void llama_kvcomp_tracker::get_head_stats(int32_t ib, int32_t h, float & rmse, float & rms) const {
    const layer_state & l = layers[ib];
    const double n = (double) std::max<int64_t>(1, l.n_rows_measured * l.n_embd_head_k);
    rmse = (float) std::sqrt(l.k_err_head[h] / n);
    rms  = (float) std::sqrt(l.k_energy_head[h] / n);
}
