// K statistics for the kvct cache types (docs/formats.md, "kvct") from a text the user gives:
// runs it through the model with an exact cache and writes, per layer and KV head, what a kvct
// plan is fitted from (llama_kvcomp_measure_k_stats, cpp/llama-kvcomp/kvcomp-calibrate.cpp).
// Without a file the library measures them itself on a built-in text
// (llama_kvcomp_set_k_stats_auto); this tool is for statistics of a chosen text.
//
// Usage: llama-kvcomp-calibrate -m MODEL -f TEXT -o OUT.gguf [-c 512] [--chunks 16] [--skip-first 4]

#include "arg.h"
#include "common.h"
#include "log.h"
#include "llama-kvcomp.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    int n_chunks = 16;
    int skip_first = LLAMA_KVCOMP_CALIB_SKIP_FIRST;
    std::string out;
    std::vector<char *> rest;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if ((a == "--chunks" || a == "--skip-first" || a == "-o") && i + 1 < argc) {
            const std::string v = argv[++i];
            if (a == "-o") {
                out = v;
            } else {
                char * end = nullptr;
                const long n = strtol(v.c_str(), &end, 10);
                if (*end != '\0' || n < 0 || n > 1000000) {
                    fprintf(stderr, "%s wants a count, got '%s'\n", a.c_str(), v.c_str());
                    return 1;
                }
                (a == "--chunks" ? n_chunks : skip_first) = (int) n;
            }
            continue;
        }
        rest.push_back(argv[i]);
    }
    common_params params;
    params.n_ctx = 512;
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_IMATRIX)) {
        return 1;
    }
    if (params.prompt.empty() || out.empty() || n_chunks < 1 || params.n_ctx <= skip_first) {
        LOG_ERR("usage: %s -m MODEL -f TEXT -o OUT.gguf [-c N_CTX] [--chunks N] [--skip-first N]\n", argv[0]);
        return 1;
    }
    common_init();
    llama_backend_init();
    // the library makes the contexts it measures with; the tool needs only the model and its vocabulary
    llama_model * model = llama_model_load_from_file(params.model.path.c_str(), common_model_params_to_llama(params));
    if (!model) {
        LOG_ERR("failed to load the model '%s'\n", params.model.path.c_str());
        return 1;
    }
    const std::vector<llama_token> toks = common_tokenize(llama_model_get_vocab(model), params.prompt, true);
    const int n_ctx = (int) params.n_ctx;
    n_chunks = std::min<int>(n_chunks, (int) (toks.size() / n_ctx));
    if (n_chunks < 1) {
        LOG_ERR("the text has %zu tokens, fewer than one chunk of %d\n", toks.size(), n_ctx);
        llama_model_free(model);
        return 1;
    }
    const int32_t res = llama_kvcomp_measure_k_stats(model, toks.data(), n_chunks * n_ctx, n_ctx, skip_first,
                                                     params.cpuparams.n_threads, out.c_str(), nullptr, nullptr);
    llama_model_free(model);
    if (res != 0) {
        LOG_ERR("kvcomp calibrate: %s\n", llama_kvcomp_last_error());
        return 1;
    }
    LOG_INF("kvcomp calibrate: K statistics of %zu tokens (%d chunks of %d) -> %s\n", (size_t) n_chunks * (n_ctx - skip_first),
            n_chunks, n_ctx, out.c_str());
    return 0;
}
