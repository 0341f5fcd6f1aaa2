// Measuring a model's K statistics (docs/formats.md, "kvct"): the model runs over a text with
// an exact cache, and per layer and KV head, per RoPE pair of K's channels before RoPE (the
// RoPE output turned back), the channels' means and centred second moments are summed, with
// the queries' mean energy on the pair (the weight of an error there). The first positions of
// every chunk are left out: the attention sinks sit far from the other rows, and the modes keep
// them exact. So is, in its layer, a token whose Q or K row holds a NaN or Inf.
//
// Two callers: llama-kvcomp-calibrate (a text file given by the user) and the statistics the
// library measures itself on first use of a model (llama_kvcomp_set_k_stats_auto), on the
// built-in text of kvcomp-calib-text.h, cached by the model's fingerprint.

#include "kvcomp-calib-text.h"
#include "kvcomp-plans.h"
#include "kvcomp-state.h"
#include "llama-kvcomp.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#ifdef _WIN32
#include <process.h>
#define kvcomp_getpid _getpid
#else
#include <unistd.h>
#define kvcomp_getpid getpid
#endif

namespace {

// running sums of one layer
struct layer_sums {
    int64_t d = 0, n_kv = 0, n_head = 0;
    double  n_k = 0.0, n_q = 0.0;
    std::vector<double> k1;  // [n_kv][d]: sum of k
    std::vector<double> k2;  // [n_kv][d/2][3]: sum of ka ka, ka kb, kb kb (uncentred)
    std::vector<double> q2;  // [n_head][d]: sum of q^2
};

struct calib_state {
    int64_t skip_first = 4;
    int  neox = -1; // RoPE's pairing, from the first K RoPE node
    bool ok = true;
    std::string err;
    int64_t n_nonfinite = 0; // Q or K rows left out
    std::vector<layer_sums> layers;
    std::vector<float> x;    // the rows of the node being read
};

bool calib_fail(calib_state & st, const std::string & why) {
    if (st.ok) {
        st.err = why;
    }
    st.ok = false;
    return false;
}

// K's rows [d, heads, n_tok] of a RoPE output turned back to what the model computed before
// RoPE (token i of the ubatch is at position i), by the angles the kvct kernels turn them with
bool unturn_rows(const ggml_tensor * t, std::vector<float> & x) {
    const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
    std::vector<float> factors;
    if (t->src[2]) {
        factors.resize(d / 2);
        ggml_backend_tensor_get(t->src[2], factors.data(), 0, factors.size() * sizeof(float));
    }
    kvc_t_rope rope;
    if (!kvc_t_rope_from_op(&rope, (const int32_t *) t->op_params, factors.empty() ? nullptr : factors.data(), d)) {
        return false;
    }
    const bool neox = (((const int32_t *) t->op_params)[2] & GGML_ROPE_TYPE_NEOX) != 0;
    kvc_t_plan pairs = {};
    pairs.d = (int32_t) d;
    for (int64_t p = 0; p < d / 2; ++p) {
        pairs.pair[p][0] = (int16_t) (neox ? p : 2 * p);
        pairs.pair[p][1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
    }
    std::vector<float> c(d / 2), s(d / 2);
    for (int64_t tok = 0; tok < n_tok; ++tok) {
        kvc_t_rope_cs(&rope, tok, c.data(), s.data());
        for (int64_t h = 0; h < nh; ++h) {
            kvc_t_rope_row(&pairs, c.data(), s.data(), 1, x.data() + (tok * nh + h) * d);
        }
    }
    return true;
}

void add_q(calib_state & st, layer_sums & l, int64_t nh, int64_t d, int64_t n_tok, const std::vector<bool> & keep) {
    if (l.q2.empty()) {
        l.n_head = nh;
        l.q2.assign(nh * d, 0.0);
    }
    for (int64_t tok = st.skip_first; tok < n_tok; ++tok) {
        if (!keep[tok]) {
            continue;
        }
        for (int64_t i = 0; i < nh * d; ++i) {
            const double v = st.x[tok * nh * d + i];
            l.q2[i] += v * v;
        }
        l.n_q += 1.0;
    }
}

void add_k(calib_state & st, layer_sums & l, int64_t nh, int64_t d, int64_t n_tok, const std::vector<bool> & keep) {
    if (l.k1.empty()) {
        l.d = d;
        l.n_kv = nh;
        l.k1.assign(nh * d, 0.0);
        l.k2.assign(nh * d / 2 * 3, 0.0);
    }
    const int neox = st.neox;
    for (int64_t tok = st.skip_first; tok < n_tok; ++tok) {
        if (!keep[tok]) {
            continue;
        }
        l.n_k += 1.0;
        for (int64_t h = 0; h < nh; ++h) {
            const float * r = st.x.data() + (tok * nh + h) * d;
            for (int64_t i = 0; i < d; ++i) {
                l.k1[h * d + i] += r[i];
            }
            for (int64_t p = 0; p < d / 2; ++p) {
                const double a = r[neox ? p : 2 * p];
                const double b = r[neox ? p + d / 2 : 2 * p + 1];
                double * s = &l.k2[(h * d / 2 + p) * 3];
                s[0] += a * a;
                s[1] += a * b;
                s[2] += b * b;
            }
        }
    }
}

bool calib_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    calib_state & st = *(calib_state *) user_data;
    const bool is_k = strncmp(t->name, "Kcur-", 5) == 0 && t->op == GGML_OP_ROPE;
    const bool is_q = strncmp(t->name, "Qcur-", 5) == 0 && t->op == GGML_OP_ROPE;
    if (!is_k && !is_q) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    int il = -1;
    if (sscanf(t->name + 5, "%d", &il) != 1 || il < 0) {
        return st.ok;
    }
    const int32_t * op = (const int32_t *) t->op_params;
    const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
    if (op[1] != d || d % 2 != 0) {
        return calib_fail(st, std::string(t->name) + ": RoPE turns " + std::to_string(op[1]) + " of " + std::to_string(d) +
                              " channels; the kvct pairs need all of them");
    }
    const int neox = (op[2] & GGML_ROPE_TYPE_NEOX) != 0;
    if (st.neox < 0) {
        st.neox = neox;
    } else if (st.neox != neox) {
        return calib_fail(st, std::string(t->name) + ": layers pair RoPE's channels differently");
    }
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        return calib_fail(st, std::string(t->name) + " is not contiguous F32");
    }
    if ((int) st.layers.size() <= il) {
        st.layers.resize(il + 1);
    }
    st.x.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, st.x.data(), 0, ggml_nbytes(t));
    if (is_k && !unturn_rows(t, st.x)) {
        return calib_fail(st, std::string(t->name) + ": a RoPE the kvct plans cannot follow (multi-section, partial or "
                              "with an offset)");
    }
    std::vector<bool> keep(n_tok, true);
    for (int64_t tok = st.skip_first; tok < n_tok; ++tok) {
        for (int64_t i = 0; i < nh * d && keep[tok]; ++i) {
            keep[tok] = std::isfinite(st.x[tok * nh * d + i]);
        }
        st.n_nonfinite += keep[tok] ? 0 : 1;
    }
    (is_q ? add_q : add_k)(st, st.layers[il], nh, d, n_tok, keep);
    return st.ok;
}

bool write_stats(const calib_state & st, const llama_model * model, uint64_t n_tokens, const std::string & path,
                 std::string & err) {
    const std::vector<float> signature = llama_kvcomp_signature_of(model);
    const int64_t n_sig = (int64_t) signature.size();
    if (n_sig == 0) {
        err = "the token embeddings (the statistics' signature) are missing or cannot be read back as F32";
        return false;
    }
    size_t n_bytes = 2 * ggml_tensor_overhead() + (size_t) n_sig * sizeof(float);
    for (const auto & l : st.layers) {
        n_bytes += (size_t) l.n_kv * (l.d / 2) * LLAMA_KVCOMP_KSTATS_PER_PAIR * sizeof(float) + ggml_tensor_overhead();
    }
    char arch[128] = "";
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    ggml_init_params ip = { n_bytes, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_u32(g, LLAMA_KVCOMP_KSTATS_KEY_VER, LLAMA_KVCOMP_KSTATS_VERSION);
    gguf_set_val_str(g, LLAMA_KVCOMP_KSTATS_KEY_ARCH, arch);
    gguf_set_val_u64(g, LLAMA_KVCOMP_KSTATS_KEY_NTOK, n_tokens);
    gguf_set_val_bool(g, LLAMA_KVCOMP_KSTATS_KEY_NEOX, st.neox == 1);
    gguf_set_val_bool(g, LLAMA_KVCOMP_KSTATS_KEY_PRE, true);
    ggml_tensor * sig = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_sig);
    ggml_set_name(sig, LLAMA_KVCOMP_KSTATS_SIGNATURE);
    std::memcpy(sig->data, signature.data(), n_sig * sizeof(float));
    gguf_add_tensor(g, sig);
    bool ok = true;
    for (size_t il = 0; il < st.layers.size() && ok; ++il) {
        const layer_sums & l = st.layers[il];
        if (l.k1.empty() || l.q2.empty() || l.n_k < 2.0 || l.n_q < 1.0 || l.n_head % l.n_kv != 0) {
            err = "layer " + std::to_string(il) + ": no K or Q rows were seen";
            ok = false;
            break;
        }
        const int64_t d = l.d, g_per = l.n_head / l.n_kv;
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, LLAMA_KVCOMP_KSTATS_PER_PAIR, d / 2, l.n_kv);
        ggml_format_name(t, LLAMA_KVCOMP_KSTATS_TENSOR, (int) il);
        float * out = (float *) t->data;
        for (int64_t h = 0; h < l.n_kv; ++h) {
            for (int64_t p = 0; p < d / 2; ++p) {
                const int64_t a = st.neox ? p : 2 * p, b = st.neox ? p + d / 2 : 2 * p + 1;
                const double ma = l.k1[h * d + a] / l.n_k, mb = l.k1[h * d + b] / l.n_k;
                const double * s = &l.k2[(h * d / 2 + p) * 3];
                double wq = 0.0;
                for (int64_t q = h * g_per; q < (h + 1) * g_per; ++q) {
                    wq += 0.5 * (l.q2[q * d + a] + l.q2[q * d + b]) / l.n_q;
                }
                float * o = out + (h * (d / 2) + p) * LLAMA_KVCOMP_KSTATS_PER_PAIR;
                o[0] = (float) ma;
                o[1] = (float) mb;
                o[2] = (float) std::max(0.0, s[0] / l.n_k - ma * ma);
                o[3] = (float) (s[1] / l.n_k - ma * mb);
                o[4] = (float) std::max(0.0, s[2] / l.n_k - mb * mb);
                o[5] = (float) (wq / (double) g_per);
                o[6] = 0.0f;
                o[7] = o[5];
            }
        }
        gguf_add_tensor(g, t);
    }
    if (ok) {
        llama_kvcomp_kstats_seal(g, ctx);
        ok = gguf_write_to_file(g, path.c_str(), false);
        if (!ok) {
            err = "cannot write '" + path + "'";
        }
    }
    gguf_free(g);
    ggml_free(ctx);
    return ok;
}

// The folder self-measured statistics are kept in: KVCOMP_CACHE/kstats, else the user's cache
// folder's kvcomp/kstats (the Python tools use the same one).
std::string auto_cache_dir(const char * dir) {
    if (dir && *dir) {
        return dir;
    }
    if (const char * c = std::getenv("KVCOMP_CACHE"); c && *c) {
        return std::string(c) + "/kstats";
    }
#ifdef _WIN32
    const char * home = std::getenv("LOCALAPPDATA");
    return home && *home ? std::string(home) + "/kvcomp/kstats" : std::string();
#else
    const char * home = std::getenv("HOME");
    return home && *home ? std::string(home) + "/.cache/kvcomp/kstats" : std::string();
#endif
}

// What the statistics of a model depend on besides its weights' bulk: its shape, its RoPE, the
// token embeddings' signature and every normalisation weight (which a fine-tune changes and no
// backend repacks), with the statistics' version and the built-in text's. Two models share a
// cached file only when all of these are equal.
uint64_t model_fingerprint(const llama_model * model) {
    kvcomp_hasher h;
    char arch[128] = "";
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    h.update(arch, std::strlen(arch) + 1);
    const int32_t shape[] = {
        LLAMA_KVCOMP_KSTATS_VERSION, LLAMA_KVCOMP_CALIB_TEXT_VERSION, llama_model_n_layer(model), llama_model_n_embd(model),
        llama_model_n_head(model), llama_model_n_head_kv(model), (int32_t) model->hparams.n_embd_head_k(),
        (int32_t) model->hparams.n_rot(), (int32_t) model->hparams.rope_type,
    };
    h.update(shape, sizeof(shape));
    const float rope[] = { model->hparams.rope_freq_base_train, model->hparams.rope_freq_scale_train };
    h.update(rope, sizeof(rope));
    const uint64_t sizes[] = { llama_model_n_params(model), llama_model_size(model) };
    h.update(sizes, sizeof(sizes));
    const std::vector<float> sig = llama_kvcomp_signature_of(model);
    h.update(sig.data(), sig.size() * sizeof(float));
    std::vector<uint8_t> buf;
    const auto add = [&](const ggml_tensor * t) {
        if (t && t->buffer && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
            buf.resize(ggml_nbytes(t));
            ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
            h.update(buf.data(), buf.size());
        }
    };
    for (const auto & layer : model->layers) {
        add(layer.attn_norm);
        add(layer.attn_q_norm);
        add(layer.attn_k_norm);
        add(layer.ffn_norm);
    }
    add(model->output_norm);
    return h.digest();
}

// The built-in text's tokens that a model of n_params parameters is measured on: all of them
// (about 2K) up to 1B parameters, fewer above so that the run stays near 2·10^12
// multiply-adds, and never fewer than one chunk of 256.
std::vector<llama_token> auto_tokens(const llama_model * model, int32_t & n_chunk) {
    std::string text;
    for (const char * part : llama_kvcomp_calib_text) {
        text += part;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> toks(text.size() + 16);
    const int32_t n = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(), true, false);
    toks.resize(std::max(0, n));
    const double n_params = std::max<double>(1.0, (double) llama_model_n_params(model));
    const int64_t budget = std::clamp<int64_t>((int64_t) (2e12 / n_params), 256, (int64_t) toks.size());
    n_chunk = (int32_t) std::min<int64_t>(512, budget);
    toks.resize(std::min<size_t>(toks.size(), (size_t) (budget / n_chunk) * n_chunk));
    return toks;
}

} // namespace

int32_t llama_kvcomp_measure_k_stats(llama_model * model, const llama_token * tokens, int32_t n_tokens, int32_t n_chunk,
                                     int32_t skip_first, int32_t n_threads, const char * path,
                                     llama_progress_callback progress, void * user_data) {
    llama_kvcomp_set_last_error("");
    if (!model || !tokens || !path || n_chunk <= skip_first || skip_first < 0 || n_tokens < n_chunk) {
        return llama_kvcomp_fail(-1, "llama_kvcomp_measure_k_stats: no model, tokens or path, or fewer tokens than one chunk "
                                     "(more than skip_first)");
    }
    calib_state st;
    st.skip_first = skip_first;
    llama_context_params cp = llama_context_default_params();
    // one ubatch per chunk, so a token's index in the ubatch is its position; an exact cache
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) n_chunk;
    cp.n_seq_max = 1;
    cp.type_k = cp.type_v = GGML_TYPE_F16;
    cp.n_threads = cp.n_threads_batch = std::max(1, n_threads);
    cp.cb_eval = calib_eval_cb;
    cp.cb_eval_user_data = &st;
    cp.no_perf = true;
    // before the context's own lines (its KV cache's size), so that a log reader can tell
    // them from those of the context that asked for the statistics
    LLAMA_LOG_INFO("kvcomp: measuring the model's K statistics in a context of its own (%d cells)\n", n_chunk);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        return llama_kvcomp_fail(-1, "K statistics: the measuring context could not be created");
    }
    const int32_t n_chunks = n_tokens / n_chunk;
    llama_batch batch = llama_batch_init(n_chunk, 0, 1);
    int32_t rc = 0;
    for (int32_t chunk = 0; chunk < n_chunks && rc == 0; ++chunk) {
        if (progress && !progress((float) chunk / (float) n_chunks, user_data)) {
            rc = llama_kvcomp_fail(-1, "K statistics: the measuring run was stopped");
            break;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = n_chunk;
        for (int32_t i = 0; i < n_chunk; ++i) {
            batch.token[i]     = tokens[(size_t) chunk * n_chunk + i];
            batch.pos[i]       = i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = i == n_chunk - 1;
        }
        if (llama_decode(ctx, batch) != 0 || !st.ok) {
            rc = llama_kvcomp_fail(-1, "K statistics: decoding chunk " + std::to_string(chunk) + " failed" +
                                       (st.err.empty() ? std::string() : ": " + st.err));
        }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    if (rc != 0) {
        return rc;
    }
    std::string err;
    const uint64_t n_used = (uint64_t) n_chunks * (uint64_t) (n_chunk - skip_first);
    if (!write_stats(st, model, n_used, path, err)) {
        return llama_kvcomp_fail(-1, "K statistics: " + err);
    }
    if (progress) {
        progress(1.0f, user_data);
    }
    LLAMA_LOG_INFO("kvcomp: K statistics of %zu layers over %llu tokens (%d chunks of %d; %lld rows left out for a "
                   "non-finite value) -> %s\n", st.layers.size(), (unsigned long long) n_used, n_chunks, n_chunk,
                   (long long) st.n_nonfinite, path);
    return 0;
}

int32_t llama_kvcomp_set_k_stats_auto(llama_context * ctx, const char * cache_dir, llama_progress_callback progress,
                                      void * user_data) {
    llama_kvcomp_set_last_error("");
    if (!ctx) {
        return llama_kvcomp_fail(-1, "llama_kvcomp_set_k_stats_auto: no context");
    }
    llama_model * model = const_cast<llama_model *>(llama_get_model(ctx));
    const std::string dir = auto_cache_dir(cache_dir);
    char name[96];
    snprintf(name, sizeof(name), "auto-%016llx.kstats.gguf", (unsigned long long) model_fingerprint(model));
    const std::string path = dir.empty() ? std::string() : dir + "/" + name;
    std::error_code ec;
    if (!path.empty() && std::filesystem::exists(path, ec)) {
        if (llama_kvcomp_set_k_stats(ctx, path.c_str()) == 0) {
            llama_kvcomp_k_stats_note() = "measured on the built-in text, read from the cache " + path;
            return 0;
        }
        const char * why = llama_kvcomp_last_error();
        LLAMA_LOG_WARN("kvcomp: the cached K statistics are refused (%s): measuring them again\n", why ? why : "?");
    }
    int32_t n_chunk = 0;
    const std::vector<llama_token> toks = auto_tokens(model, n_chunk);
    // a temporary name in the target folder, renamed once whole: a concurrent reader never sees
    // half a file, and two processes measuring at once write the same bytes
    bool cached = !dir.empty() && (std::filesystem::create_directories(dir, ec), std::filesystem::is_directory(dir, ec));
    std::string tmp = dir + "/" + name + "." + std::to_string((long long) kvcomp_getpid()) + ".tmp";
    if (cached) {
        if (FILE * f = std::fopen(tmp.c_str(), "wb")) {
            std::fclose(f);
        } else {
            cached = false;
        }
    }
    if (!cached) {
        LLAMA_LOG_WARN("kvcomp: the cache folder '%s' cannot be written: the K statistics are measured for this run only\n",
                       dir.c_str());
        tmp = (std::filesystem::temp_directory_path(ec) / (std::string(name) + "." +
               std::to_string((long long) kvcomp_getpid()) + ".tmp")).string();
    }
    const auto t0 = std::chrono::steady_clock::now();
    int32_t rc = llama_kvcomp_measure_k_stats(model, toks.data(), (int32_t) toks.size(), n_chunk,
                                              LLAMA_KVCOMP_CALIB_SKIP_FIRST, llama_n_threads(ctx), tmp.c_str(), progress,
                                              user_data);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rc == 0 && cached) {
        std::filesystem::rename(tmp, path, ec);
        if (ec) {
            std::filesystem::remove(tmp, ec);
            return llama_kvcomp_fail(-1, "K statistics: cannot move the measured file to '" + path + "'");
        }
    }
    const std::string used = cached ? path : tmp;
    if (rc == 0) {
        rc = llama_kvcomp_set_k_stats(ctx, used.c_str());
    }
    if (!cached || rc != 0) {
        std::filesystem::remove(tmp, ec);
    }
    if (rc == 0) {
        char buf[96];
        snprintf(buf, sizeof(buf), "measured on the built-in text (%zu tokens, %.1f s), ", toks.size(), secs);
        llama_kvcomp_k_stats_note() = buf + (cached ? "cached in " + path : std::string("not cached"));
    }
    return rc;
}
