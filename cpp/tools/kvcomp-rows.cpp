// Dumps the attention inputs of a prompt for offline study of what a KV format could gain
// (docs/kv-rows.md): K before and after RoPE and Q after RoPE, every layer, as the graph
// computes them, before upstream's Hadamard rotation and before any cache type rounds them.
//
// Usage: llama-kvcomp-rows -m MODEL -f TEXT -c N_TOKENS -o PREFIX [-ub 512 -t N]
// (parsed as imatrix parses: it too reads activations of a text)
// Writes PREFIX.kpre.f32, PREFIX.kpost.f32, PREFIX.qpost.f32 (float32, in the order
// ubatch, layer, token, head, dim) and PREFIX.json with the shapes.

#include "arg.h"
#include "common.h"
#include "kvcomp-tool.h"
#include "log.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

struct rows_dump {
    FILE * k_pre  = nullptr;
    FILE * k_post = nullptr;
    FILE * q_post = nullptr;
    bool   ok     = true;
    const ggml_tensor * k_pending = nullptr; // the last K node before RoPE, and its rows
    std::vector<float>  k_pending_rows;
    // shapes as the graph has them (Gemma's head size is not n_embd / n_head)
    int64_t head_dim  = 0;
    int64_t n_head_kv = 0;
    int64_t n_head    = 0;
};

static bool rows_read(rows_dump & d, const ggml_tensor * t, std::vector<float> & buf) {
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        LOG_ERR("%s: %s is %s%s, expected contiguous f32\n", __func__, t->name, ggml_type_name(t->type),
                ggml_is_contiguous(t) ? "" : " and strided");
        d.ok = false;
        return false;
    }
    buf.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    return true;
}

static void rows_write(rows_dump & d, FILE * f, const std::vector<float> & buf) {
    d.ok = d.ok && fwrite(buf.data(), sizeof(float), buf.size(), f) == buf.size();
}

// The RoPE nodes named Kcur-<il> and Qcur-<il>. K before RoPE is copied when its own node is
// computed: the allocator may let RoPE write over its input.
static bool rows_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    const bool is_k = strncmp(t->name, "Kcur", 4) == 0;
    const bool is_q = strncmp(t->name, "Qcur-", 5) == 0 && t->op == GGML_OP_ROPE;
    if (ask) {
        return is_k || is_q;
    }
    rows_dump & d = *(rows_dump *) user_data;
    std::vector<float> buf;
    if (is_k && t->op != GGML_OP_ROPE) {
        d.k_pending = t;
        rows_read(d, t, d.k_pending_rows);
    } else if (is_k) {
        if (t->src[0] != d.k_pending && t->src[0]->view_src != d.k_pending) {
            LOG_ERR("%s: the input of %s was not seen before it\n", __func__, t->name);
            d.ok = false;
            return false;
        }
        d.head_dim  = t->ne[0];
        d.n_head_kv = t->ne[1];
        rows_write(d, d.k_pre, d.k_pending_rows);
        if (rows_read(d, t, buf)) {
            rows_write(d, d.k_post, buf);
        }
    } else if (is_q) {
        d.n_head = t->ne[1];
        if (rows_read(d, t, buf)) {
            rows_write(d, d.q_post, buf);
        }
    }
    return d.ok;
}

int main(int argc, char ** argv) {
    common_params params;
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_IMATRIX)) {
        return 1;
    }
    if (params.prompt.empty() || params.out_file.empty() || params.n_ctx <= 0) {
        LOG_ERR("usage: %s -m MODEL -f TEXT -c N_TOKENS -o PREFIX\n", argv[0]);
        return 1;
    }
    common_init();

    const std::string prefix = params.out_file;
    rows_dump d;
    d.k_pre  = fopen((prefix + ".kpre.f32").c_str(), "wb");
    d.k_post = fopen((prefix + ".kpost.f32").c_str(), "wb");
    d.q_post = fopen((prefix + ".qpost.f32").c_str(), "wb");
    if (!d.k_pre || !d.k_post || !d.q_post) {
        LOG_ERR("cannot write %s.*.f32\n", prefix.c_str());
        return 1;
    }
    params.cb_eval           = rows_eval_cb;
    params.cb_eval_user_data = &d;
    params.warmup            = false;

    auto init = kvcomp_tool_context(params);
    llama_context * ctx = init->context();
    if (!ctx) {
        return 1;
    }
    const llama_model * model = llama_get_model(ctx);
    const int32_t n_tokens = params.n_ctx;
    const int32_t n_ubatch = (int32_t) llama_n_ubatch(ctx);
    std::vector<llama_token> toks = common_tokenize(ctx, params.prompt, true);
    if ((int32_t) toks.size() < n_tokens || n_tokens % n_ubatch != 0) {
        LOG_ERR("need %d tokens, a multiple of the ubatch (%d); the text has %zu\n", n_tokens, n_ubatch, toks.size());
        return 1;
    }
    for (int32_t i0 = 0; i0 < n_tokens && d.ok; i0 += n_ubatch) {
        if (llama_decode(ctx, llama_batch_get_one(toks.data() + i0, n_ubatch)) != 0) {
            LOG_ERR("decode failed at token %d\n", i0);
            return 1;
        }
    }
    d.ok = fclose(d.k_pre) == 0 && fclose(d.k_post) == 0 && fclose(d.q_post) == 0 && d.ok;
    if (!d.ok) {
        LOG_ERR("writing %s.*.f32 failed\n", prefix.c_str());
        return 1;
    }
    if (d.head_dim == 0 || d.n_head == 0) {
        LOG_ERR("the graph has no RoPE nodes named Kcur-<il> and Qcur-<il>: nothing to dump for this model\n");
        return 1;
    }

    FILE * js = fopen((prefix + ".json").c_str(), "w");
    if (!js) {
        LOG_ERR("cannot write %s.json\n", prefix.c_str());
        return 1;
    }
    fprintf(js, "{\"n_layer\": %d, \"n_head\": %lld, \"n_head_kv\": %lld, \"head_dim\": %lld, \"n_tokens\": %d, \"n_ubatch\": %d}\n",
            llama_model_n_layer(model), (long long) d.n_head, (long long) d.n_head_kv, (long long) d.head_dim, n_tokens, n_ubatch);
    fclose(js);
    return 0;
}
