#include "kvcomp-plans.h"

#include "gguf.h"

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace {

// K and Q values past f16's range break an f16 cache before any kvcomp type: means and
// energies of a real model's rows stay far inside these bounds.
constexpr double KSTATS_MAX_MEAN   = 65504.0;
constexpr double KSTATS_MAX_ENERGY = 65504.0 * 65504.0;

// Why a pair's row (means, centred moments, query weights) cannot come from a model's rows;
// nullptr when it can: finite, within range, both 2x2 matrices positive semi-definite.
const char * kstats_pair_error(const float * s) {
    for (int j = 0; j < LLAMA_KVCOMP_KSTATS_PER_PAIR; ++j) {
        if (!std::isfinite(s[j])) {
            return "a non-finite value";
        }
    }
    if (std::fabs(s[0]) > KSTATS_MAX_MEAN || std::fabs(s[1]) > KSTATS_MAX_MEAN) {
        return "a mean past f16's range";
    }
    for (const float * m : { s + 2, s + 5 }) {
        const double aa = m[0], ab = m[1], bb = m[2];
        if (aa < 0.0 || bb < 0.0 || aa > KSTATS_MAX_ENERGY || bb > KSTATS_MAX_ENERGY) {
            return "a second moment below zero or past f16's range";
        }
        // Cauchy-Schwarz, with room for the float rounding of the stored moments
        if (std::fabs(ab) > std::sqrt(aa * bb) * (1.0 + 1e-4) + 1e-30) {
            return "a covariance larger than its variances allow";
        }
    }
    return nullptr;
}

} // namespace

std::string llama_kvcomp_kstats::check_model(const std::vector<float> & model_signature) const {
    const std::string other = "'" + path + "' holds the K statistics of another model";
    if (model_signature.size() != signature.size()) {
        return other + " (its signature has " + std::to_string(signature.size()) + " values, this model's " +
               std::to_string(model_signature.size()) + ")";
    }
    double dot = 0.0, n_file = 0.0, n_model = 0.0;
    for (size_t i = 0; i < signature.size(); ++i) {
        dot     += (double) signature[i] * model_signature[i];
        n_file  += (double) signature[i] * signature[i];
        n_model += (double) model_signature[i] * model_signature[i];
    }
    // The same weights quantized another way (the statistics of a Q4 file on its F32 copy) stay
    // within a few percent; another model's weights are unrelated (cosine near 0).
    const double cosine = n_file > 0.0 && n_model > 0.0 ? dot / std::sqrt(n_file * n_model) : (n_file == n_model ? 1.0 : 0.0);
    const double ratio  = n_model > 0.0 ? std::sqrt(n_file / n_model) : 0.0;
    if (cosine < LLAMA_KVCOMP_KSTATS_MIN_COSINE || (n_model > 0.0 && (ratio < 0.8 || ratio > 1.25))) {
        char buf[128];
        snprintf(buf, sizeof(buf), " (its token embeddings match this model's at cosine %.3f, norm ratio %.3f)", cosine, ratio);
        return other + buf;
    }
    return "";
}

std::shared_ptr<llama_kvcomp_kstats> llama_kvcomp_kstats::load(const std::string & path, std::string & err) {
    ggml_context * tctx = nullptr;
    gguf_init_params ip = { /*no_alloc =*/ false, /*ctx =*/ &tctx };
    gguf_context * g = gguf_init_from_file(path.c_str(), ip);
    if (!g) {
        err = "cannot read '" + path + "' as a GGUF file (missing or damaged)";
        return nullptr;
    }
    auto out = std::make_shared<llama_kvcomp_kstats>();
    out->path = path;
    auto key = [&](const char * name, gguf_type type) -> int64_t {
        const int64_t id = gguf_find_key(g, name);
        return id >= 0 && gguf_get_kv_type(g, id) == type ? id : -1;
    };
    const int64_t k_ver  = key(LLAMA_KVCOMP_KSTATS_KEY_VER, GGUF_TYPE_UINT32);
    const int64_t k_arch = key(LLAMA_KVCOMP_KSTATS_KEY_ARCH, GGUF_TYPE_STRING);
    const int64_t k_ntok = key(LLAMA_KVCOMP_KSTATS_KEY_NTOK, GGUF_TYPE_UINT64);
    const int64_t k_neox = key(LLAMA_KVCOMP_KSTATS_KEY_NEOX, GGUF_TYPE_BOOL);
    const int64_t k_pre  = key(LLAMA_KVCOMP_KSTATS_KEY_PRE, GGUF_TYPE_BOOL);
    const int64_t k_sum  = key(LLAMA_KVCOMP_KSTATS_KEY_SUM, GGUF_TYPE_UINT64);
    const ggml_tensor * sig = ggml_get_tensor(tctx, LLAMA_KVCOMP_KSTATS_SIGNATURE);
    if (k_ver < 0 || k_arch < 0 || k_ntok < 0 || k_neox < 0) {
        err = "'" + path + "' is not a kvcomp K statistics file (llama-kvcomp-calibrate writes one)";
    } else if (gguf_get_val_u32(g, k_ver) != LLAMA_KVCOMP_KSTATS_VERSION) {
        err = "'" + path + "' has statistics version " + std::to_string(gguf_get_val_u32(g, k_ver)) + ", this build reads " +
              std::to_string(LLAMA_KVCOMP_KSTATS_VERSION) + " (sealed, bound to the model): measure them again " +
              "(`kvcomp calibrate -m MODEL`)";
    } else if (k_pre < 0 || k_sum < 0 || !sig || sig->type != GGML_TYPE_F32 || ggml_nelements(sig) != sig->ne[0]) {
        err = "'" + path + "' lacks its checksum, its RoPE key or the model's signature";
    } else if (gguf_get_val_u64(g, k_sum) != llama_kvcomp_kstats_digest(g, tctx)) {
        err = "'" + path + "': checksum mismatch, the file was changed after it was written";
    } else {
        out->arch     = gguf_get_val_str(g, k_arch);
        out->n_tokens = gguf_get_val_u64(g, k_ntok);
        out->pre_rope = gguf_get_val_bool(g, k_pre);
        out->signature.assign((const float *) sig->data, (const float *) sig->data + sig->ne[0]);
        const bool neox = gguf_get_val_bool(g, k_neox);
        for (int il = 0; err.empty(); ++il) {
            char name[GGML_MAX_NAME];
            snprintf(name, sizeof(name), LLAMA_KVCOMP_KSTATS_TENSOR, il);
            const ggml_tensor * t = ggml_get_tensor(tctx, name);
            if (!t) {
                break;
            }
            const int64_t d = 2 * t->ne[1];
            if (t->type != GGML_TYPE_F32 || t->ne[0] != LLAMA_KVCOMP_KSTATS_PER_PAIR || d > KVC_T_MAX_D || t->ne[2] < 1 ||
                t->ne[3] != 1) {
                err = "'" + path + "': tensor " + name + " has the wrong type or shape";
                break;
            }
            layer l;
            l.d = (int32_t) d;
            const float * x = (const float *) t->data;
            for (int64_t h = 0; h < t->ne[2] && err.empty(); ++h) {
                double k_energy = 0.0, q_energy = 0.0;
                for (int64_t p = 0; p < d / 2 && err.empty(); ++p) {
                    const float * s = x + (h * (d / 2) + p) * LLAMA_KVCOMP_KSTATS_PER_PAIR;
                    if (const char * why = kstats_pair_error(s)) {
                        err = "'" + path + "': " + name + ", KV head " + std::to_string(h) + ", pair " + std::to_string(p) +
                              " holds " + why;
                    }
                    k_energy += (double) s[2] + s[4];
                    q_energy += (double) s[5] + s[7];
                }
                if (err.empty() && (k_energy <= 0.0 || q_energy <= 0.0)) {
                    err = "'" + path + "': " + name + ", KV head " + std::to_string(h) + " has no " +
                          (k_energy <= 0.0 ? "K" : "query") + " energy on any channel (no rows were measured)";
                }
            }
            for (int64_t h = 0; h < t->ne[2] && err.empty(); ++h) {
                head hd;
                hd.pair.resize(d);
                hd.mean.resize(d);
                hd.k2.resize(3 * d / 2);
                hd.w.resize(3 * d / 2);
                for (int64_t p = 0; p < d / 2; ++p) {
                    const float * s = x + (h * (d / 2) + p) * LLAMA_KVCOMP_KSTATS_PER_PAIR;
                    const int a = (int) (neox ? p : 2 * p);
                    const int b = (int) (neox ? p + d / 2 : 2 * p + 1);
                    hd.pair[2 * p] = (int16_t) a;
                    hd.pair[2 * p + 1] = (int16_t) b;
                    hd.mean[a] = s[0];
                    hd.mean[b] = s[1];
                    std::memcpy(&hd.k2[3 * p], s + 2, 3 * sizeof(float));
                    std::memcpy(&hd.w[3 * p], s + 5, 3 * sizeof(float));
                }
                l.heads.push_back(std::move(hd));
            }
            out->layers.resize(il + 1);
            out->layers[il] = std::move(l);
        }
        if (err.empty() && out->layers.empty()) {
            err = "'" + path + "' holds no layer's statistics";
        }
    }
    gguf_free(g);
    ggml_free(tctx);
    return err.empty() ? out : nullptr;
}

llama_kvcomp_plans::llama_kvcomp_plans(const std::vector<layer_desc> & layers, const llama_kvcomp_kstats & stats) {
    const size_t n_layer = layers.size();
    for (size_t ib = 0; ib < n_layer; ++ib) {
        const auto &  l      = layers[ib];
        const int32_t il     = l.il;
        const int64_t d      = l.d;
        const int64_t n_head = l.k->ne[0] / d;
        const int32_t bits   = kvc_t_type_row_bits(l.k->type, d);
        const std::string where = "layer " + std::to_string(il) + ": ";
        if (bits == 0) {
            throw std::runtime_error(where + ggml_type_name(l.k->type) + " K rows of " + std::to_string(d) +
                                     " values: a kvct row holds a multiple of " + std::to_string(QK_KVCT) + " up to " +
                                     std::to_string(KVC_T_MAX_D));
        }
        if (il >= (int32_t) stats.layers.size() || stats.layers[il].heads.empty()) {
            throw std::runtime_error(where + "'" + stats.path + "' has no statistics for it (made for another model?)");
        }
        const auto & sl = stats.layers[il];
        if (sl.d != d || (int64_t) sl.heads.size() != n_head) {
            throw std::runtime_error(where + "the statistics are for " + std::to_string(sl.heads.size()) + " KV heads of " +
                                     std::to_string(sl.d) + " values, the model has " + std::to_string(n_head) + " of " +
                                     std::to_string(d) + " (made for another model?)");
        }
        std::vector<kvc_t_plan> lp(n_head);
        for (int64_t h = 0; h < n_head; ++h) {
            const auto & hd = sl.heads[h];
            const kvc_t_stats st = { (int32_t) d, (const int16_t (*)[2]) hd.pair.data(), hd.mean.data(),
                                     (const float (*)[3]) hd.k2.data(), (const float (*)[3]) hd.w.data() };
            if (!kvc_t_plan_fit(&lp[h], &st, stats.pre_rope ? KVC_T_BASIS_PAIR_AXES : KVC_T_BASIS_POOLED, bits)) {
                throw std::runtime_error(where + "KV head " + std::to_string(h) + ": '" + stats.path +
                                         "' has statistics no plan can be fitted to (non-finite or negative values)");
            }
        }
        plans.push_back(std::move(lp));
        row_size.push_back(ggml_row_size(l.k->type, d));
    }

    pre = stats.pre_rope && n_layer > 0;
    for (size_t ib = 0; ib < n_layer; ++ib) {
        ggml_backend_buffer_type_t buft = layers[ib].k->buffer ? ggml_backend_buffer_get_type(layers[ib].k->buffer) :
                                                                 ggml_backend_cpu_buffer_type();
        ggml_context * c = storage.ctx_for(buft, n_layer + 1);
        tensors.push_back(ggml_new_tensor_1d(c, GGML_TYPE_I8, (int64_t) (plans[ib].size() * sizeof(kvc_t_plan) + sizeof(kvc_t_rope))));
        ggml_format_name(tensors.back(), "kvcomp_plans_l%d", layers[ib].il);
        if (pre) {
            // a new context is a new buffer type: the positions go there too
            ggml_tensor * p = ggml_get_tensor(c, "kvcomp_cell_pos");
            if (!p) {
                p = ggml_new_tensor_2d(c, GGML_TYPE_I32, layers[0].k->ne[1], layers[0].k->ne[2]);
                ggml_set_name(p, "kvcomp_cell_pos");
                pos_all.push_back(p);
            }
            pos_of.push_back(p);
        }
    }
    storage.alloc("kvct plans");
    if (pre) {
        pos_sent.assign(ggml_nelements(pos_all[0]), 0);
    }
    uint64_t hv = 1469598103934665603ull; // FNV-1a over every plan's bytes
    kvc_t_rope none;
    std::memset(&none, 0, sizeof(none));
    ropes.assign(n_layer, none);
    for (size_t ib = 0; ib < n_layer; ++ib) {
        const size_t nb = plans[ib].size() * sizeof(kvc_t_plan);
        ggml_backend_tensor_set(tensors[ib], plans[ib].data(), 0, nb);
        ggml_backend_tensor_set(tensors[ib], &none, nb, sizeof(kvc_t_rope));
        const uint8_t * p = (const uint8_t *) plans[ib].data();
        for (size_t i = 0; i < plans[ib].size() * sizeof(kvc_t_plan); ++i) {
            hv = (hv ^ p[i]) * 1099511628211ull;
        }
    }
    // the same plans read rows coded before RoPE differently from rows coded after it
    hash = (hv ^ (stats.pre_rope ? 1u : 0u)) * 1099511628211ull;
}

std::vector<kvc_t_plan> llama_kvcomp_plans::all() const {
    std::vector<kvc_t_plan> out;
    for (const auto & lp : plans) {
        out.insert(out.end(), lp.begin(), lp.end());
    }
    return out;
}

std::string llama_kvcomp_plans::recode(int32_t ib, ggml_tensor * k, const kvc_t_plan * from, size_t n_from,
                                       bool from_pre_rope, const std::vector<uint64_t> & rows) const {
    const std::vector<kvc_t_plan> & to = plans[ib];
    if (from_pre_rope != pre_rope()) {
        // the rows would have to be turned by their cells' positions as well
        return std::string("its K rows were coded ") + (from_pre_rope ? "before" : "after") + " RoPE, this context's " +
               (pre_rope() ? "before" : "after");
    }
    if (n_from != to.size()) {
        return "its plans are for " + std::to_string(n_from) + " KV heads, the cache has " + std::to_string(to.size());
    }
    for (size_t h = 0; h < n_from; ++h) {
        if (!kvc_t_plan_valid(&from[h]) || from[h].d != to[h].d || from[h].row_bits != to[h].row_bits) {
            return "its plans are damaged or for another shape";
        }
    }
    const size_t rs = row_size[ib];
    std::vector<uint8_t> raw(k->nb[1]);
    std::vector<float> x(KVC_T_MAX_D);
    for (uint64_t r : rows) {
        ggml_backend_tensor_get(k, raw.data(), r * k->nb[1], raw.size());
        for (size_t h = 0; h < to.size(); ++h) {
            dequantize_row_kvct(&from[h], raw.data() + h * rs, x.data());
            quantize_row_kvct_ref(&to[h], x.data(), raw.data() + h * rs);
        }
        ggml_backend_tensor_set(k, raw.data(), r * k->nb[1], raw.size());
    }
    return "";
}

void llama_kvcomp_plans::set_positions(const std::vector<int32_t> & p) {
    GGML_ASSERT(p.size() == pos_sent.size());
    size_t first = 0, last = p.size();
    while (first < last && p[first] == pos_sent[first]) {
        ++first;
    }
    while (last > first && p[last - 1] == pos_sent[last - 1]) {
        --last;
    }
    if (first == last) {
        return;
    }
    for (ggml_tensor * t : pos_all) {
        ggml_backend_tensor_set(t, p.data() + first, first * sizeof(int32_t), (last - first) * sizeof(int32_t));
    }
    std::copy(p.begin() + first, p.begin() + last, pos_sent.begin() + first);
}

bool llama_kvcomp_plans::set_rope(int32_t ib, const ggml_tensor * node) {
    const kvc_t_plan & p0 = plans[ib][0];
    std::vector<float> factors;
    if (const ggml_tensor * ff = node->src[2]) {
        if (ff->type != GGML_TYPE_F32 || ggml_nelements(ff) < p0.d / 2) {
            return false;
        }
        factors.resize(p0.d / 2);
        ggml_backend_tensor_get(ff, factors.data(), 0, factors.size() * sizeof(float));
    }
    kvc_t_rope r;
    if (!pre_rope() || node->op != GGML_OP_ROPE ||
        !kvc_t_rope_from_op(&r, (const int32_t *) node->op_params, factors.empty() ? nullptr : factors.data(), p0.d)) {
        return false;
    }
    // the plans' pairs are RoPE's (NEOX: (p, p + d/2))
    const bool neox = (((const int32_t *) node->op_params)[2] & GGML_ROPE_TYPE_NEOX) != 0;
    if (p0.pair[1][0] != (neox ? 1 : 2)) {
        return false;
    }
    if (std::memcmp(&rope(ib), &r, sizeof(r)) != 0) {
        ggml_backend_tensor_set(tensors[ib], &r, plans[ib].size() * sizeof(kvc_t_plan), sizeof(r));
        ropes[ib] = r;
    }
    return true;
}

void llama_kvcomp_plans::row_to_f32(int32_t ib, const uint8_t * x, float * y, int64_t p) const {
    const kvc_t_rope & r = rope(ib);
    float c[KVC_T_MAX_D / 2], s[KVC_T_MAX_D / 2];
    if (r.n_pairs > 0) {
        kvc_t_rope_cs(&r, p, c, s);
    }
    for (const kvc_t_plan & pl : plans[ib]) {
        dequantize_row_kvct(&pl, x, y);
        if (r.n_pairs > 0) {
            kvc_t_rope_row(&pl, c, s, 0, y);
        }
        x += row_size[ib];
        y += pl.d;
    }
}
