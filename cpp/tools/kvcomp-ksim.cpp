// What coding K costs in KLD, before a cache type exists for the coder (docs/kv-rows.md):
// each chunk of a text is decoded once with an exact (F16) cache for reference logits and
// once per K coder, the coder replacing every K row with its coded value as the graph makes
// it; V and everything else stay exact. The coders:
//  - an upstream or kvc type name (q8_0, q4_0, iq4_nl, kvc4, ...): K after RoPE, turned by
//    the Hadamard matrix upstream turns a quantized cache's K by, through the type's
//    reference quantizer and back (what a -ctk of that type with -ctv f16 stores);
//  - pre-pairs:BPE, post-pairs:BPE: the transform-coded row (kvc-transform.h) at BPE bits
//    per value, its plan fitted per layer and KV head on the chunk's first ubatch (the moment
//    the scale tracker fixes its offset), K coded before RoPE with a rotation per RoPE pair
//    (RoPE then turns the coded row, as kernels would per key) or after RoPE with the pair's
//    statistics pooled. The queries' weight on a pair is their mean energy on it in that
//    ubatch, pooled over the pair.
// The graph's RoPE node of K (Kcur-<il>) is where this happens: before it runs for a pre-RoPE
// coder (its input was computed for the callback's previous request), after it for the rest.
// --vcode codes V instead (K exact), at the graph's last V node (the reshape named Vcur-<il>):
// a type as for K (upstream turns a quantized V cache by the same Hadamard matrix), or
// pre-pairs:BPE, the transform-coded row with a rotation per pair of channels (2i, 2i+1) and
// every channel weighted alike (V has no RoPE; the output projection reads every channel), or
// eig:BPE, the same coder on the row's coefficients in the head's eigenbasis (the mean and
// covariance of the chunk's first ubatch; attention would undo it once per query).
//
// A coder followed by @L codes layer L only (a layer's share of the KLD); KIND:per-layer takes
// each layer's bits per value from --layer-bpe B0,B1,... (the table gives their mean).
//
// Usage: llama-kvcomp-ksim -m MODEL -f TEXT -c N_CTX --chunks N --kcode f16,kvc4,pre-pairs:4.5
//        [--vcode kvc4,pre-pairs:4.5] [--exact-first N] [--layer-bpe B0,B1,...]
// Prints one table row per coder: the part it codes, bits per value, mean KLD against the
// exact run and its standard error, over the second half of every chunk. --exact-first N
// leaves the rows of the first N positions exact, as the residual buffer's sinks keep them
// (and out of the plans' statistics).

#include "arg.h"
#include "common.h"
#include "log.h"
#include "kvc-transform.h"
#include "kvcomp-tool.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

enum ksim_kind { KSIM_EXACT, KSIM_TYPE, KSIM_PRE_PAIRS, KSIM_POST_PAIRS, KSIM_EIG };

struct ksim_coder {
    std::string name;
    ksim_kind   kind = KSIM_EXACT;
    ggml_type   type = GGML_TYPE_F16;
    float       bpe  = 16.0f;
    bool        v    = false; // codes V (K exact) instead of K
    int         layer = -1;   // the one layer it codes (-1: every layer)
    bool        per_layer = false; // bits per value by layer (ksim_state::layer_bpe); bpe is their mean
};

struct ksim_state {
    const ksim_coder * coder = nullptr;
    bool calibrate = false;           // this ubatch fixes the plans (the chunk's first)
    int  pos0 = 0;                    // the position of the ubatch's first token
    int  exact_first = 0;             // keys at positions below stay exact (the buffer's sinks)
    bool ok = true;
    std::vector<std::vector<kvc_t_plan>> plans;  // [layer][KV head]
    std::vector<std::vector<float>>      qw;     // [layer]: per query head and channel, mean q^2 of this ubatch
    // eig: per layer and KV head, the rows' mean and their covariance's eigenvectors (column
    // j of a d x d row-major matrix, by falling eigenvalue)
    std::vector<std::vector<std::vector<double>>> eig_mean, eig_vec;
    std::vector<float> layer_bpe; // --layer-bpe: bits per value of each layer, for the per-layer coders
    int64_t n_head = 0;
};

bool parse_coder(const std::string & spec, ksim_coder & c, const std::vector<float> & layer_bpe) {
    c.name = spec;
    const size_t at = spec.find('@');
    const std::string s = spec.substr(0, at);
    if (at != std::string::npos) {
        char * end = nullptr;
        const long l = strtol(spec.c_str() + at + 1, &end, 10);
        if (at + 1 == spec.size() || *end != '\0' || l < 0 || l > 1000) {
            return false;
        }
        c.layer = (int) l;
    }
    const size_t colon = s.find(':');
    if (colon != std::string::npos) {
        const std::string kind = s.substr(0, colon);
        char * end = nullptr;
        if (s.substr(colon + 1) == "per-layer") {
            if (layer_bpe.empty()) {
                return false;
            }
            c.per_layer = true;
            c.bpe = 0.0f;
            for (float b : layer_bpe) {
                c.bpe += b / (float) layer_bpe.size();
            }
        } else if (c.bpe = strtof(s.c_str() + colon + 1, &end); *end != '\0' || !(c.bpe >= 1.0f && c.bpe <= 8.5f)) {
            return false;
        }
        c.kind = kind == "pre-pairs" ? KSIM_PRE_PAIRS : kind == "post-pairs" ? KSIM_POST_PAIRS :
                 kind == "eig" ? KSIM_EIG : KSIM_EXACT;
        return c.kind != KSIM_EXACT;
    }
    if (s == "f16") {
        return true;
    }
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        const auto * tr = ggml_get_type_traits((ggml_type) t);
        if (tn && s == tn && tr->from_float_ref && tr->to_float) {
            c.kind = KSIM_TYPE;
            c.type = (ggml_type) t;
            c.bpe  = 8.0f * (float) tr->type_size / (float) tr->blck_size;
            return true;
        }
    }
    return false;
}

// rows[n][d] *= H (normalized Sylvester Hadamard; its own inverse)
void hadamard_rows(float * x, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; ++r) {
        float * v = x + r * d;
        for (int64_t h = 1; h < d; h *= 2) {
            for (int64_t i = 0; i < d; i += 2 * h) {
                for (int64_t j = i; j < i + h; ++j) {
                    const float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
            }
        }
        const float s = 1.0f / sqrtf((float) d);
        for (int64_t i = 0; i < d; ++i) {
            v[i] *= s;
        }
    }
}

// The plans of one layer from its K rows of this ubatch ([token][head][d]) and the queries'
// energies: RoPE's pairs are (i, i + d/2), upstream's NEOX order, or (2i, 2i+1), by the model.
// V (c.v): pairs (2i, 2i+1), every channel weighted alike.
bool fit_layer(ksim_state & st, int il, const std::vector<float> & k, int64_t d, int64_t n_kv, int64_t n_tok, bool neox) {
    const ksim_coder & c = *st.coder;
    if (!c.v && ((int) st.qw.size() <= il || st.qw[il].empty())) {
        LOG_ERR("layer %d: K came before its queries; the plan has no query weights\n", il);
        return false;
    }
    st.plans.resize(il + 1);
    st.plans[il].resize(n_kv);
    static const std::vector<float> none;
    const std::vector<float> & qw = c.v ? none : st.qw[il];
    const int64_t g = c.v ? 1 : st.n_head / n_kv;
    for (int64_t h = 0; h < n_kv; ++h) {
        std::vector<int16_t> pair(d);
        std::vector<float>   mean(d, 0.0f), k2(3 * d / 2), w(3 * d / 2);
        for (int64_t p = 0; p < d / 2; ++p) {
            pair[2 * p]     = (int16_t) (neox ? p : 2 * p);
            pair[2 * p + 1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
        }
        // the rows that will be coded: not the ones kept exact
        const int64_t t0 = std::min<int64_t>(n_tok - 1, std::max(0, st.exact_first - st.pos0));
        const double  n  = (double) (n_tok - t0);
        std::vector<double> m(d, 0.0);
        for (int64_t t = t0; t < n_tok; ++t) {
            for (int64_t i = 0; i < d; ++i) {
                m[i] += k[(t * n_kv + h) * d + i];
            }
        }
        for (int64_t i = 0; i < d; ++i) {
            mean[i] = (float) (m[i] / n);
        }
        for (int64_t p = 0; p < d / 2; ++p) {
            const int a = pair[2 * p], b = pair[2 * p + 1];
            double saa = 0.0, sab = 0.0, sbb = 0.0;
            for (int64_t t = t0; t < n_tok; ++t) {
                const double xa = k[(t * n_kv + h) * d + a] - mean[a];
                const double xb = k[(t * n_kv + h) * d + b] - mean[b];
                saa += xa * xa;
                sab += xa * xb;
                sbb += xb * xb;
            }
            k2[3 * p + 0] = (float) (saa / n);
            k2[3 * p + 1] = (float) (sab / n);
            k2[3 * p + 2] = (float) (sbb / n);
            double wq = c.v ? 1.0 : 0.0;
            for (int64_t q = h * g; q < (h + 1) * g && !c.v; ++q) {
                wq += 0.5 * (qw[q * d + a] + qw[q * d + b]);
            }
            w[3 * p + 0] = w[3 * p + 2] = (float) (wq / g);
            w[3 * p + 1] = 0.0f;
        }
        const kvc_t_stats stats = { (int32_t) d, (const int16_t (*)[2]) pair.data(), mean.data(),
                                    (const float (*)[3]) k2.data(), (const float (*)[3]) w.data() };
        const kvc_t_basis basis = c.kind == KSIM_POST_PAIRS ? KVC_T_BASIS_POOLED : KVC_T_BASIS_PAIR_AXES;
        if (c.per_layer && (int) st.layer_bpe.size() <= il) {
            LOG_ERR("layer %d: --layer-bpe names %zu layers\n", il, st.layer_bpe.size());
            return false;
        }
        const float bpe = c.per_layer ? st.layer_bpe[il] : c.bpe;
        if (!kvc_t_plan_fit(&st.plans[il][h], &stats, basis, (int32_t) lroundf(bpe * (float) d))) {
            LOG_ERR("layer %d head %lld: the plan's statistics were refused\n", il, (long long) h);
            return false;
        }
    }
    return true;
}

// The eigenvectors of a symmetric d x d matrix (row-major, destroyed), by falling eigenvalue,
// as the columns of vec: cyclic Jacobi rotations until the off-diagonal part is negligible.
void jacobi_eigen(std::vector<double> & a, int64_t d, std::vector<double> & vec) {
    vec.assign(d * d, 0.0);
    for (int64_t i = 0; i < d; ++i) {
        vec[i * d + i] = 1.0;
    }
    for (int sweep = 0; sweep < 64; ++sweep) {
        double off = 0.0, diag = 0.0;
        for (int64_t i = 0; i < d; ++i) {
            for (int64_t j = 0; j < d; ++j) {
                (i == j ? diag : off) += a[i * d + j] * a[i * d + j];
            }
        }
        if (off <= 1e-24 * diag) {
            break;
        }
        for (int64_t p = 0; p < d; ++p) {
            for (int64_t q = p + 1; q < d; ++q) {
                const double apq = a[p * d + q];
                if (std::fabs(apq) <= 1e-300) {
                    continue;
                }
                const double theta = (a[q * d + q] - a[p * d + p]) / (2.0 * apq);
                const double t = (theta >= 0.0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
                const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
                for (int64_t k = 0; k < d; ++k) {
                    const double akp = a[k * d + p], akq = a[k * d + q];
                    a[k * d + p] = c * akp - s * akq;
                    a[k * d + q] = s * akp + c * akq;
                }
                for (int64_t k = 0; k < d; ++k) {
                    const double apk = a[p * d + k], aqk = a[q * d + k];
                    a[p * d + k] = c * apk - s * aqk;
                    a[q * d + k] = s * apk + c * aqk;
                }
                for (int64_t k = 0; k < d; ++k) {
                    const double vkp = vec[k * d + p], vkq = vec[k * d + q];
                    vec[k * d + p] = c * vkp - s * vkq;
                    vec[k * d + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    std::vector<int64_t> order(d);
    for (int64_t i = 0; i < d; ++i) {
        order[i] = i;
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a[x * d + x] > a[y * d + y]; });
    std::vector<double> sorted(d * d);
    for (int64_t k = 0; k < d; ++k) {
        for (int64_t j = 0; j < d; ++j) {
            sorted[k * d + j] = vec[k * d + order[j]];
        }
    }
    vec.swap(sorted);
}

// eig: rows ([token][head][d]) to their coefficients in the head's eigenbasis and back.
void eig_rows(const ksim_state & st, int il, std::vector<float> & k, int64_t d, int64_t n_kv, int64_t n_tok, bool back) {
    std::vector<double> x(d);
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t h = 0; h < n_kv; ++h) {
            float * row = k.data() + (t * n_kv + h) * d;
            const std::vector<double> & e = st.eig_vec[il][h];
            const std::vector<double> & m = st.eig_mean[il][h];
            for (int64_t j = 0; j < d; ++j) {
                double acc = back ? m[j] : 0.0;
                for (int64_t i = 0; i < d; ++i) {
                    acc += back ? e[j * d + i] * row[i] : e[i * d + j] * (row[i] - m[i]);
                }
                x[j] = acc;
            }
            for (int64_t j = 0; j < d; ++j) {
                row[j] = (float) x[j];
            }
        }
    }
}

// eig: the mean and eigenbasis of each KV head from this ubatch's rows (those not kept exact).
void fit_eig(ksim_state & st, int il, const std::vector<float> & k, int64_t d, int64_t n_kv, int64_t n_tok) {
    st.eig_mean.resize(il + 1);
    st.eig_vec.resize(il + 1);
    st.eig_mean[il].assign(n_kv, std::vector<double>(d, 0.0));
    st.eig_vec[il].resize(n_kv);
    const int64_t t0 = std::min<int64_t>(n_tok - 1, std::max(0, st.exact_first - st.pos0));
    const double  n  = (double) (n_tok - t0);
    for (int64_t h = 0; h < n_kv; ++h) {
        std::vector<double> & m = st.eig_mean[il][h];
        for (int64_t t = t0; t < n_tok; ++t) {
            for (int64_t i = 0; i < d; ++i) {
                m[i] += k[(t * n_kv + h) * d + i] / n;
            }
        }
        std::vector<double> cov(d * d, 0.0);
        for (int64_t t = t0; t < n_tok; ++t) {
            const float * r = k.data() + (t * n_kv + h) * d;
            for (int64_t i = 0; i < d; ++i) {
                for (int64_t j = 0; j < d; ++j) {
                    cov[i * d + j] += (r[i] - m[i]) * (r[j] - m[j]) / n;
                }
            }
        }
        jacobi_eigen(cov, d, st.eig_vec[il][h]);
    }
}

// Codes the K rows of one layer in place in `t` ([d, n_kv, n_tok], contiguous F32).
bool code_rows(ksim_state & st, int il, ggml_tensor * t, bool neox) {
    if (st.coder->layer >= 0 && il != st.coder->layer) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        LOG_ERR("%s: %s is not contiguous F32\n", __func__, t->name);
        return false;
    }
    const int64_t d = t->ne[0], n_kv = t->ne[1], n_tok = t->ne[2];
    std::vector<float> k(ggml_nelements(t));
    ggml_backend_tensor_get(t, k.data(), 0, ggml_nbytes(t));
    const int64_t n_exact = std::min<int64_t>(n_tok, std::max(0, st.exact_first - st.pos0));
    const std::vector<float> exact(k.begin(), k.begin() + n_exact * n_kv * d);
    const ksim_coder & c = *st.coder;
    if (c.kind == KSIM_TYPE) {
        const auto * tr = ggml_get_type_traits(c.type);
        std::vector<uint8_t> q(ggml_row_size(c.type, d));
        hadamard_rows(k.data(), n_kv * n_tok, d);
        for (int64_t r = 0; r < n_kv * n_tok; ++r) {
            tr->from_float_ref(k.data() + r * d, q.data(), d);
            tr->to_float(q.data(), k.data() + r * d, d);
        }
        hadamard_rows(k.data(), n_kv * n_tok, d);
    } else {
        if (c.kind == KSIM_EIG) {
            if (st.calibrate) {
                fit_eig(st, il, k, d, n_kv, n_tok);
            }
            if ((int) st.eig_vec.size() <= il || st.eig_vec[il].empty()) {
                LOG_ERR("layer %d: no basis (the first ubatch did not reach it)\n", il);
                return false;
            }
            eig_rows(st, il, k, d, n_kv, n_tok, false);
        }
        if (st.calibrate && !fit_layer(st, il, k, d, n_kv, n_tok, neox)) {
            return false;
        }
        if ((int) st.plans.size() <= il || st.plans[il].empty()) {
            LOG_ERR("layer %d: no plan (the first ubatch did not reach it)\n", il);
            return false;
        }
        std::vector<uint8_t> q(kvc_t_row_size(st.plans[il][0].row_bits));
        for (int64_t tok = 0; tok < n_tok; ++tok) {
            for (int64_t h = 0; h < n_kv; ++h) {
                float * row = k.data() + (tok * n_kv + h) * d;
                quantize_row_kvct_ref(&st.plans[il][h], row, q.data());
                dequantize_row_kvct(&st.plans[il][h], q.data(), row);
            }
        }
        if (c.kind == KSIM_EIG) {
            eig_rows(st, il, k, d, n_kv, n_tok, true);
        }
    }
    std::copy(exact.begin(), exact.end(), k.begin());
    ggml_backend_tensor_set(t, k.data(), 0, ggml_nbytes(t));
    return true;
}

bool ksim_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    ksim_state & st = *(ksim_state *) user_data;
    const ksim_coder & c = *st.coder;
    if (c.kind == KSIM_EXACT) {
        return !ask;
    }
    if (c.v) {
        int il = -1;
        if (strncmp(t->name, "Vcur-", 5) != 0 || t->op != GGML_OP_RESHAPE || sscanf(t->name + 5, "%d", &il) != 1) {
            return !ask;
        }
        if (!ask) {
            st.ok = st.ok && code_rows(st, il, t, false);
        }
        return st.ok;
    }
    const bool is_k    = strncmp(t->name, "Kcur", 4) == 0;
    const bool is_rope = t->op == GGML_OP_ROPE;
    const bool is_q    = strncmp(t->name, "Qcur-", 5) == 0 && is_rope;
    if (!(is_k || is_q)) {
        return !ask;
    }
    int il = -1;
    if (is_rope && sscanf(t->name + 5, "%d", &il) != 1) {
        return false;
    }
    const bool neox = is_rope && (((const int32_t *) t->op_params)[2] & GGML_ROPE_TYPE_NEOX) != 0;
    if (is_k && is_rope && ((const int32_t *) t->op_params)[1] != t->ne[0]) {
        LOG_ERR("%s: RoPE turns %d of %lld channels; the pair coders need all of them\n", t->name,
                ((const int32_t *) t->op_params)[1], (long long) t->ne[0]);
        st.ok = false;
        return false;
    }
    if (ask) {
        // before K's RoPE runs: its input was computed for an earlier request
        if (is_k && is_rope && c.kind == KSIM_PRE_PAIRS) {
            st.ok = st.ok && code_rows(st, il, t->src[0], neox);
        }
        return true;
    }
    if (is_q && st.calibrate && c.kind != KSIM_TYPE) {
        // per query head and channel, the mean of q^2 over the ubatch's tokens
        const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
        std::vector<float> q(ggml_nelements(t));
        ggml_backend_tensor_get(t, q.data(), 0, ggml_nbytes(t));
        st.n_head = nh;
        st.qw.resize(il + 1);
        st.qw[il].assign(nh * d, 0.0f);
        for (int64_t tok = 0; tok < n_tok; ++tok) {
            for (int64_t i = 0; i < nh * d; ++i) {
                st.qw[il][i] += q[tok * nh * d + i] * q[tok * nh * d + i] / (float) n_tok;
            }
        }
    } else if (is_k && is_rope && c.kind != KSIM_PRE_PAIRS) {
        st.ok = st.ok && code_rows(st, il, t, neox);
    }
    return st.ok;
}

// log-softmax of n logits, in double
void log_softmax(const float * x, int n, std::vector<double> & out) {
    double m = x[0];
    for (int i = 1; i < n; ++i) {
        m = std::max(m, (double) x[i]);
    }
    double s = 0.0;
    for (int i = 0; i < n; ++i) {
        s += std::exp(x[i] - m);
    }
    const double ls = m + std::log(s);
    out.resize(n);
    for (int i = 0; i < n; ++i) {
        out[i] = x[i] - ls;
    }
}

} // namespace

int main(int argc, char ** argv) {
    // our options, taken out before upstream's parser sees the rest
    ksim_state st;
    std::vector<ksim_coder> coders;
    int n_chunks = 4;
    std::vector<char *> rest;
    // first, as the coders named per-layer read it
    std::vector<float> & layer_bpe = st.layer_bpe;
    for (int i = 0; i + 1 < argc; ++i) {
        if (std::string(argv[i]) != "--layer-bpe") {
            continue;
        }
        for (const char * p = argv[i + 1]; *p;) {
            char * end = nullptr;
            const float b = strtof(p, &end);
            if (end == p || !(b >= 1.0f && b <= 8.5f) || (*end != ',' && *end != '\0')) {
                fprintf(stderr, "--layer-bpe wants bits per value in [1, 8.5], one per layer, comma-separated\n");
                return 1;
            }
            layer_bpe.push_back(b);
            p = *end ? end + 1 : end;
        }
    }
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--layer-bpe" && i + 1 < argc) {
            ++i;
            continue;
        }
        if ((a == "--kcode" || a == "--vcode" || a == "--chunks" || a == "--exact-first") && i + 1 < argc) {
            const std::string v = argv[++i];
            if (a == "--chunks") {
                n_chunks = atoi(v.c_str());
                continue;
            }
            if (a == "--exact-first") {
                st.exact_first = atoi(v.c_str());
                continue;
            }
            size_t p0 = 0;
            while (p0 <= v.size()) {
                const size_t p1 = std::min(v.find(',', p0), v.size());
                ksim_coder c;
                c.v = a == "--vcode";
                if (!parse_coder(v.substr(p0, p1 - p0), c, layer_bpe) || (c.v ? c.kind == KSIM_POST_PAIRS : c.kind == KSIM_EIG)) {
                    fprintf(stderr, "unknown %s coder '%s' (a type name with a reference quantizer, pre-pairs:BPE%s, BPE per-layer with "
                            "--layer-bpe; @LAYER after it)\n",
                            c.v ? "V" : "K", v.substr(p0, p1 - p0).c_str(), c.v ? " or eig:BPE" : " or post-pairs:BPE");
                    return 1;
                }
                coders.push_back(c);
                p0 = p1 + 1;
            }
            continue;
        }
        rest.push_back(argv[i]);
    }
    common_params params;
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_IMATRIX)) {
        return 1;
    }
    if (params.prompt.empty() || params.n_ctx <= 0 || coders.empty() || n_chunks < 1 || st.exact_first < 0) {
        LOG_ERR("usage: %s -m MODEL -f TEXT -c N_CTX --chunks N --kcode CODER[,CODER...] [--vcode CODER[,CODER...]] "
                "[--exact-first N] [--layer-bpe B0,B1,...]\n", argv[0]);
        return 1;
    }
    common_init();

    ksim_coder exact;
    st.coder = &exact;
    params.cb_eval           = ksim_eval_cb;
    params.cb_eval_user_data = &st;
    params.warmup            = false;
    auto init = kvcomp_tool_context(params);
    llama_context * ctx = init->context();
    if (!ctx) {
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_ctx   = params.n_ctx;
    const int n_ub    = (int) llama_n_ubatch(ctx);
    const int first   = n_ctx / 2;
    std::vector<llama_token> toks = common_tokenize(ctx, params.prompt, true);
    if ((int64_t) toks.size() < (int64_t) n_ctx * n_chunks || n_ctx % n_ub != 0) {
        LOG_ERR("need %d chunks of %d tokens (a multiple of the ubatch, %d); the text has %zu tokens\n", n_chunks, n_ctx, n_ub, toks.size());
        return 1;
    }

    // one pass over a chunk: the log-probabilities of its scored tokens, or their KLD against ref
    llama_batch batch = llama_batch_init(n_ub, 0, 1);
    auto run = [&](int chunk, const ksim_coder & c, std::vector<float> * ref, std::vector<double> * kld) {
        st.coder = &c;
        st.plans.clear();
        st.eig_vec.clear();
        st.eig_mean.clear();
        llama_memory_clear(llama_get_memory(ctx), true);
        std::vector<double> lp;
        for (int i0 = 0; i0 < n_ctx; i0 += n_ub) {
            batch.n_tokens = n_ub;
            for (int i = 0; i < n_ub; ++i) {
                batch.token[i]     = toks[(size_t) chunk * n_ctx + i0 + i];
                batch.pos[i]       = i0 + i;
                batch.n_seq_id[i]  = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i]    = i0 + i >= first;
            }
            st.calibrate = i0 == 0;
            st.pos0      = i0;
            if (llama_decode(ctx, batch) != 0 || !st.ok) {
                LOG_ERR("decode failed in chunk %d at token %d with %s coder %s\n", chunk, i0, c.v ? "V" : "K", c.name.c_str());
                return false;
            }
            for (int i = std::max(i0, first); i < i0 + n_ub; ++i) {
                log_softmax(llama_get_logits_ith(ctx, i - i0), n_vocab, lp);
                float * r = ref->data() + (size_t) (i - first) * n_vocab;
                if (!kld) {
                    for (int v = 0; v < n_vocab; ++v) {
                        r[v] = (float) lp[v];
                    }
                    continue;
                }
                double kl = 0.0;
                for (int v = 0; v < n_vocab; ++v) {
                    kl += std::exp((double) r[v]) * ((double) r[v] - lp[v]);
                }
                kld->push_back(kl);
            }
        }
        return true;
    };

    std::vector<std::vector<double>> klds(coders.size());
    std::vector<float> ref((size_t) (n_ctx - first) * n_vocab);
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        if (!run(chunk, exact, &ref, nullptr)) {
            return 1;
        }
        for (size_t ic = 0; ic < coders.size(); ++ic) {
            if (!run(chunk, coders[ic], &ref, &klds[ic])) {
                return 1;
            }
        }
        fprintf(stderr, "chunk %d of %d done\n", chunk + 1, n_chunks);
    }
    llama_batch_free(batch);

    printf("| coded (the other exact) | coder | bits per value | mean KLD | standard error |\n|---|---|---:|---:|---:|\n");
    for (size_t ic = 0; ic < coders.size(); ++ic) {
        const std::vector<double> & k = klds[ic];
        double s = 0.0, s2 = 0.0;
        for (double v : k) {
            s += v;
            s2 += v * v;
        }
        const double n = (double) k.size();
        const double mean = s / n;
        const double se = std::sqrt(std::max(0.0, s2 / n - mean * mean) / std::max(1.0, n - 1.0));
        printf("| %s | %s | %.2f | %.6f | %.6f |\n", coders[ic].v ? "V" : "K", coders[ic].name.c_str(), coders[ic].bpe, mean, se);
    }
    return 0;
}
