// Per-step decode latency with the residual buffer, for the merge-cost measurement:
// fills the context to a depth, then decodes single tokens and times each step, sorting the
// steps by whether the buffer ran a merge pass in them, with the monitor's per-token work
// inside each step (its overhead). Prints one JSON object.
//
// Usage: llama-kvcomp-steps -m MODEL -c CTX -n N_GEN [--ops] [-ctk T -ctv T -fa on -t N --kv-comp-...]
// The context is filled to CTX - N_GEN - 1 tokens first. Common flags apply as in llama-cli.
// --ops also times every graph node of the steps, summed per op ("ops": microseconds a step
// and a node). The scheduler then runs each node on its own, so the steps are slower; a node's
// time is its own, which is how a kernel is compared with f16's inside a model, where its rows
// are read cold (a micro-benchmark of the node alone reads them from cache).

#include "arg.h"
#include "common.h"
#include "kvcomp-tool.h"
#include "llama-kvcomp.h"
#include "log.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

static double percentile(std::vector<double> v, double p) {
    if (v.empty()) {
        return 0.0;
    }
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, (size_t) (p * (v.size() - 1) + 0.5))];
}

// per op: summed microseconds and nodes, while `on`
struct op_times {
    bool on = false;
    std::chrono::steady_clock::time_point last;
    std::map<std::string, std::pair<double, int64_t>> ops;
};

// Asks for every node; the time since the last node finished is the node's.
static bool time_op(ggml_tensor * t, bool ask, void * user_data) {
    if (ask) {
        return true;
    }
    auto &     ot  = *(op_times *) user_data;
    const auto now = std::chrono::steady_clock::now();
    if (ot.on) {
        auto & e = ot.ops[ggml_op_desc(t)];
        e.first += std::chrono::duration<double, std::micro>(now - ot.last).count();
        e.second++;
    }
    ot.last = now;
    return true;
}

int main(int argc, char ** argv) {
    // --ops is ours: taken out before the common flags are parsed
    bool ops = false;
    std::vector<char *> args;
    for (int i = 0; i < argc; ++i) {
        if (strcmp(argv[i], "--ops") == 0) {
            ops = true;
        } else {
            args.push_back(argv[i]);
        }
    }
    common_params params;
    params.n_predict = 64;
    if (!common_params_parse((int) args.size(), args.data(), params, LLAMA_EXAMPLE_COMMON)) {
        return 1;
    }
    op_times ot;
    if (ops) {
        params.cb_eval           = time_op;
        params.cb_eval_user_data = &ot;
    }
    common_init();
    auto init = kvcomp_tool_context(params);
    llama_context * ctx = init->context();
    if (!ctx) {
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_gen   = std::max(1, params.n_predict);
    const int depth   = (int) llama_n_ctx(ctx) - n_gen - 1;
    if (depth < 0) {
        LOG_ERR("-c must exceed -n\n");
        return 1;
    }

    // any fixed token sequence: the content does not change the work per step
    auto token_at = [&](int i) { return (llama_token) (1000 + (i * 7919) % (n_vocab - 1000)); };
    const int n_batch = (int) llama_n_batch(ctx);
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    auto fill = [&](int p0, int p1) {
        batch.n_tokens = p1 - p0;
        for (int i = p0; i < p1; ++i) {
            batch.token[i - p0]     = token_at(i);
            batch.pos[i - p0]       = i;
            batch.n_seq_id[i - p0]  = 1;
            batch.seq_id[i - p0][0] = 0;
            batch.logits[i - p0]    = i == p1 - 1;
        }
        return llama_decode(ctx, batch) == 0;
    };
    for (int p = 0; p < depth; p += n_batch) {
        if (!fill(p, std::min(depth, p + n_batch))) {
            LOG_ERR("decode failed while filling the context\n");
            return 1;
        }
    }

    std::vector<double> all, with_merge, without_merge;
    llama_kvcomp_stats st = {};
    const int32_t reused_before = llama_perf_context(ctx).n_reused;
    const bool buffered = llama_kvcomp_get_stats(ctx, &st) == 0;
    for (int i = 0; i < n_gen; ++i) {
        const int64_t merges_before = st.n_merges;
        const int64_t t0 = ggml_time_us();
        ot.on   = true;
        ot.last = std::chrono::steady_clock::now();
        if (!fill(depth + i, depth + i + 1)) {
            LOG_ERR("decode failed at step %d\n", i);
            return 1;
        }
        ot.on = false;
        // the monitor's share of a step, as llama-server pays it after sampling (a no-op with
        // the monitor off)
        llama_kvcomp_observe(ctx, 0, -1, token_at(depth + i + 1));
        llama_synchronize(ctx);
        const double ms = (ggml_time_us() - t0) / 1000.0;
        all.push_back(ms);
        if (buffered) {
            llama_kvcomp_get_stats(ctx, &st);
        }
        (buffered && st.n_merges > merges_before ? with_merge : without_merge).push_back(ms);
    }
    llama_batch_free(batch);
    // steps that reused the last graph: one built anew costs more than a small model's step
    const int32_t n_reused = llama_perf_context(ctx).n_reused - reused_before;

    double mean = 0.0;
    for (double v : all) {
        mean += v / all.size();
    }
    std::string ops_json;
    for (const auto & [name, e] : ot.ops) {
        char buf[200];
        snprintf(buf, sizeof(buf), "%s\"%s\": {\"us_per_step\": %.2f, \"us_per_node\": %.2f, \"nodes_per_step\": %.4f}",
                 ops_json.empty() ? "" : ", ", name.c_str(), e.first / n_gen, e.first / (double) e.second,
                 (double) e.second / n_gen);
        ops_json += buf;
    }
    printf("{\"depth\": %d, \"n_gen\": %d, \"buffered\": %s, \"slots\": %d, \"mean_ms\": %.4f, \"p50_ms\": %.4f, "
           "\"max_ms\": %.4f, \"n_merge_steps\": %zu, \"max_ms_merge\": %.4f, \"max_ms_no_merge\": %.4f, "
           "\"n_reused\": %d%s%s%s}\n",
           depth, n_gen, buffered ? "true" : "false", buffered ? st.n_slots : 0, mean, percentile(all, 0.5),
           percentile(all, 1.0), with_merge.size(), percentile(with_merge, 1.0), percentile(without_merge, 1.0), n_reused,
           ops ? ", \"ops\": {" : "", ops_json.c_str(), ops ? "}" : "");
    llama_backend_free();
    return 0;
}
