// State-file fuzzer. Usage:
//   test-kvc-state MODEL.gguf [SECONDS [SEED]]
//
// For each mode (off on f16, low-latency, balanced, high-precision) a context decodes a
// prompt on sequence 0 and a different one on sequence 1, saves sequence 0 to a slot file
// and notes the logits of a continuation restored from it. Then seeded mutants of that file
// are restored into sequence 0: cuts (inside every section and exactly at the seal), byte
// flips in every section, NaN/Inf stamps in F16 rows and 0xFF kvc blocks (behind a valid
// seal, so the row checks are reached, and without), wrong shapes behind a valid seal, and
// appended bytes; a few also go through host buffers (llama_state_seq_set_data). Every
// mutant must be refused with a reason (llama_kvcomp_last_error) and leave sequence 0 empty,
// or restore the original tokens and continue to the original logits bit for bit; a cut file
// (down to 0 bytes) is refused for the same reason twice, so no reader parsed bytes past the
// cut. A state holding kvcomp's sections is read only behind its seal. After
// every mutant sequence 1 must still continue to its own logits, and at the end the
// original file must restore and the monitor's metrics hold no NaN or Inf. A failure prints
// its seed; `test-kvc-state MODEL 1 SEED` replays from it.
//
// `test-kvc-state MODEL --bench N` measures instead: a balanced context holding N tokens saves
// and restores its sequence as a slot file three times, and one JSON line gives the times of
// the save, the restore, and of the checks in them (from the library's "kvcomp: state:" log).

#include "kvc-llama-util.h"
#include "kvc-test-util.h"
#include "llama-kvcomp.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

using namespace kvc_test;

namespace {

constexpr int    N_PROMPT = 48; // past the tracker's 32 first positions: its offset is set
constexpr int    N_CONT   = 4;
constexpr size_t SEAL     = 24;

using bytes = std::vector<uint8_t>;

struct range {
    size_t      b = 0, e = 0;
    const char * name = "";
};

// Where the parts of a sequence state file lie (docs/state.md).
struct layout {
    std::vector<range> sections;  // header, tokens, cells, K rows, V rows, kvcomp, seal
    range k_rows, v_rows, buf_rows; // buf_rows: the residual buffer's F16 rows (may be empty)
    int32_t  k_type = -1;
    size_t   k_row  = 0;
    size_t   k_row_field = 0;     // offset of layer 0's K row size
};

template <typename T> T get(const bytes & f, size_t & o) {
    T v;
    if (o + sizeof(T) > f.size()) {
        throw std::runtime_error("short");
    }
    std::memcpy(&v, f.data() + o, sizeof(T));
    o += sizeof(T);
    return v;
}

layout parse(const bytes & f) {
    layout L;
    size_t o = 8;
    const uint32_t n_tok = get<uint32_t>(f, o);
    L.sections.push_back({ 0, 12, "header" });
    L.sections.push_back({ 12, 12 + 4 * (size_t) n_tok, "tokens" });
    o = 12 + 4 * (size_t) n_tok;
    const size_t cells0 = o;
    const uint32_t n_stream = get<uint32_t>(f, o);
    // one stream holds the sequence; the others write a zero cell count
    uint32_t n_cells = 0, s_data = 0;
    for (; s_data < n_stream && n_cells == 0; ++s_data) {
        n_cells = get<uint32_t>(f, o);
    }
    for (uint32_t c = 0; c < n_cells; ++c) {
        get<int32_t>(f, o);
        const uint32_t n_seq = get<uint32_t>(f, o);
        o += 4 * (size_t) n_seq;
    }
    L.sections.push_back({ cells0, o, "cells" });
    get<uint32_t>(f, o); // v_trans (0: flash attention)
    const uint32_t n_layer = get<uint32_t>(f, o);
    L.k_rows.b = o;
    for (uint32_t l = 0; l < n_layer; ++l) {
        L.k_type = get<int32_t>(f, o);
        if (l == 0) {
            L.k_row_field = o;
        }
        L.k_row = get<uint64_t>(f, o);
        o += L.k_row * n_cells;
    }
    L.k_rows = { L.k_rows.b, o, "K rows" };
    const size_t v0 = o;
    for (uint32_t l = 0; l < n_layer; ++l) {
        get<int32_t>(f, o);
        const uint64_t row = get<uint64_t>(f, o);
        o += row * n_cells;
    }
    L.v_rows = { v0, o, "V rows" };
    for (; s_data < n_stream; ++s_data) {
        get<uint32_t>(f, o);
    }
    L.sections.push_back(L.k_rows);
    L.sections.push_back(L.v_rows);
    const size_t end = f.size() - SEAL;
    if (o < end) {
        const size_t kv0 = o;
        uint32_t h[7];
        for (uint32_t & x : h) {
            x = get<uint32_t>(f, o);
        }
        get<uint64_t>(f, o); // the hash of the kvct plans (0: none)
        if (get<uint32_t>(f, o)) { // the tracker's part
            const uint32_t nl = get<uint32_t>(f, o), ns = get<uint32_t>(f, o);
            for (uint32_t s = 0; s < ns; ++s) {
                if (!get<uint32_t>(f, o)) {
                    continue;
                }
                const uint32_t status = get<uint32_t>(f, o);
                o += 8;
                for (uint32_t l = 0; l < nl; ++l) {
                    const uint32_t ne = get<uint32_t>(f, o);
                    o += 4 * (size_t) ne * (status == 1 ? 33 : 1);
                }
            }
        }
        uint32_t n_entries = 0;
        for (uint32_t s = 0; s < h[6]; ++s) {
            const uint32_t n = get<uint32_t>(f, o);
            n_entries = std::max(n_entries, n);
            o += 13 * (size_t) n;
            if (n > 0) {
                L.buf_rows = { o, o + (size_t) n * 2 * h[3], "buffer rows" };
            }
            o += (size_t) n * 2 * (h[3] + h[4]) * h[2];
        }
        L.sections.push_back({ kv0, end, "kvcomp" });
    }
    L.sections.push_back({ end, f.size(), "seal" });
    return L;
}

bytes read_file(const std::string & p) {
    std::ifstream in(p, std::ios::binary);
    return bytes(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string & p, const bytes & b) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write((const char *) b.data(), (std::streamsize) b.size());
}

// The digest kvcomp-state.cpp seals with, written out again from docs/state.md: a mutant that
// must reach the checks behind the seal (row contents, shapes) gets a valid seal.
uint64_t digest_of(const uint8_t * p, size_t n) {
    constexpr uint64_t K0 = 0x9e3779b97f4a7c15ull, K1 = 0xc2b2ae3d27d4eb4full;
    const auto step = [](uint64_t h, uint64_t w) { h = (h ^ w) * K1; return h ^ (h >> 29); };
    uint64_t lane[4] = { K0, K1, ~K0, ~K1 };
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 4; ++j) {
            uint64_t w;
            std::memcpy(&w, p + i + 8 * j, 8);
            lane[j] = step(lane[j], w);
        }
    }
    uint8_t last[32] = {};
    std::memcpy(last, p + i, n - i);
    for (int j = 0; j < 4; ++j) {
        uint64_t w;
        std::memcpy(&w, last + 8 * j, 8);
        lane[j] = step(lane[j], w);
    }
    uint64_t h = (uint64_t) n * K0;
    for (int j = 0; j < 4; ++j) {
        h = step(h + ((lane[j] << (7 * j + 1)) | (lane[j] >> (63 - 7 * j))), K0);
    }
    return h ^ (h >> 32);
}

void reseal(bytes & f) {
    const size_t n = f.size() - SEAL;
    const uint64_t d = digest_of(f.data(), n);
    std::memcpy(f.data() + n, &d, 8);
}

struct fixture {
    llama_context * ctx = nullptr;
    std::vector<llama_token> toks0, toks1;  // the two sequences' texts
    std::vector<float> ref0, ref1_full, ref1_empty; // continuation logits (see main)
    std::string path;
};

std::vector<float> continue_seq(llama_context * ctx, const std::vector<llama_token> & toks, llama_seq_id seq) {
    std::vector<float> out = decode(ctx, toks, N_PROMPT, N_PROMPT + N_CONT, N_CONT, seq, N_CONT);
    llama_memory_seq_rm(llama_get_memory(ctx), seq, N_PROMPT, -1);
    return out;
}

// the reason of the last refusal
std::string g_last_reason;

// Restores a mutant into sequence 0: 0 refused as it should be, 1 restored identically,
// -1 a failed check (printed with the seed).
int try_restore(report & rep, const fixture & fx, const bytes & mutant, bool host, const std::string & what, uint32_t seed) {
    llama_memory_t mem = llama_get_memory(fx.ctx);
    llama_memory_seq_rm(mem, 0, -1, -1);
    size_t n = 0, n_got = 0;
    std::vector<llama_token> got(N_PROMPT + 8);
    if (host) {
        n = llama_state_seq_set_data(fx.ctx, mutant.data(), mutant.size(), 0);
        n_got = N_PROMPT;
        std::copy(fx.toks0.begin(), fx.toks0.begin() + N_PROMPT, got.begin());
    } else {
        write_file(fx.path, mutant);
        n = llama_state_seq_load_file(fx.ctx, fx.path.c_str(), 0, got.data(), got.size(), &n_got);
    }
    if (std::getenv("KVC_STATE_VERBOSE")) {
        printf("    %s: %s\n", what.c_str(), n ? "restored" : llama_kvcomp_last_error());
    }
    if (n == 0) {
        const char * why = llama_kvcomp_last_error();
        g_last_reason = why ? why : "";
        if (!why || !*why || llama_memory_seq_pos_max(mem, 0) != -1) {
            rep.check(false, "seed %u: %s refused without a reason or left cells in sequence 0 (reason: %s)", seed,
                      what.c_str(), why ? why : "none");
            return -1;
        }
        if (continue_seq(fx.ctx, fx.toks1, 1) != fx.ref1_empty) {
            rep.check(false, "seed %u: after %s (refused: %s) sequence 1 continues differently", seed, what.c_str(), why);
            return -1;
        }
        return 0;
    }
    const bool same_tokens = n_got == (size_t) N_PROMPT && std::equal(got.begin(), got.begin() + N_PROMPT, fx.toks0.begin());
    if (!same_tokens || continue_seq(fx.ctx, fx.toks0, 0) != fx.ref0) {
        rep.check(false, "seed %u: %s restored, but %s", seed, what.c_str(),
                  same_tokens ? "sequence 0 continues differently" : "with other tokens");
        return -1;
    }
    if (continue_seq(fx.ctx, fx.toks1, 1) != fx.ref1_full) {
        rep.check(false, "seed %u: after %s (restored) sequence 1 continues differently", seed, what.c_str());
        return -1;
    }
    return 1;
}

struct mode_case {
    const char * name;
    ggml_type    type_k, type_v;
};

// The seeded mutants of a file: name, bytes, through a host buffer.
struct mutant {
    std::string name;
    bytes       b;
    bool        host = false;
};

std::vector<mutant> make_mutants(const bytes & f, const layout & L, const bytes & host, std::mt19937 & rng) {
    std::vector<mutant> out;
    const auto pick = [&](size_t b, size_t e) { return b + std::uniform_int_distribution<size_t>(0, e - b - 1)(rng); };
    for (const range & r : L.sections) {
        if (r.e <= r.b) {
            continue;
        }
        const size_t at = pick(r.b, r.e);
        out.push_back({ std::string("cut in ") + r.name + " at " + std::to_string(at), bytes(f.begin(), f.begin() + at) });
        for (int k = 0; k < 3; ++k) {
            bytes m = f;
            const size_t o = pick(r.b, r.e);
            m[o] ^= (uint8_t) (1u << std::uniform_int_distribution<int>(0, 7)(rng));
            out.push_back({ std::string("bit flip in ") + r.name + " at " + std::to_string(o), m });
        }
    }
    out.push_back({ "cut at the seal (complete, unsealed)", bytes(f.begin(), f.end() - SEAL) });
    out.push_back({ "cut to 0 bytes", bytes() });
    {
        bytes m = f;
        for (int i = 0; i < 1000; ++i) {
            m.push_back((uint8_t) rng());
        }
        out.push_back({ "1000 bytes appended", m });
    }
    // F16 rows: the cache's own (an f16 cache) and the residual buffer's
    for (const range & r : { L.k_type == GGML_TYPE_F16 ? L.k_rows : range{}, L.buf_rows }) {
        if (r.e <= r.b + 32) {
            continue;
        }
        const uint16_t stamps[] = { 0x7e00, 0x7c00, 0xfc00 };
        for (uint16_t s : stamps) {
            bytes m = f;
            // an F16 value inside the rows, past the layer's type and size fields
            const size_t o = r.b + 16 + 2 * ((pick(r.b + 16, r.e - 2) - r.b - 16) / 2);
            std::memcpy(m.data() + o, &s, 2);
            out.push_back({ "F16 stamp " + std::to_string(s) + " in " + r.name + ", unsealed", m });
            reseal(m);
            out.push_back({ "F16 stamp " + std::to_string(s) + " in " + r.name + ", sealed", m });
        }
    }
    if (L.k_type != GGML_TYPE_F16) {
        // one 0xFF block of layer 0's K rows
        const size_t bs = ggml_type_size((ggml_type) L.k_type);
        const size_t n_blocks = L.k_row / bs;
        const size_t row0 = L.k_row_field + 8;
        const size_t o = row0 + (pick(0, 8) * L.k_row) + pick(0, n_blocks) * bs;
        bytes m = f;
        std::memset(m.data() + o, 0xff, bs);
        out.push_back({ "0xFF K block, unsealed", m });
        reseal(m);
        out.push_back({ "0xFF K block, sealed", m });
    }
    {
        bytes m = f;
        uint64_t row = L.k_row + 2;
        std::memcpy(m.data() + L.k_row_field, &row, 8);
        reseal(m);
        out.push_back({ "K row size of another model, sealed", m });
        m = f;
        int32_t type = L.k_type == GGML_TYPE_F16 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
        std::memcpy(m.data() + L.k_row_field - 4, &type, 4);
        reseal(m);
        out.push_back({ "K type of another cache, sealed", m });
    }
    for (const range & r : L.sections) {
        if (std::string(r.name) == "kvcomp") {
            bytes m = f;
            uint32_t ne = 7;
            std::memcpy(m.data() + r.b + 12, &ne, 4);
            reseal(m);
            out.push_back({ "kvcomp section of another model, sealed", m });
        }
    }
    // host buffers (llama_state_seq_get_data) are sealed as files are
    out.push_back({ "host buffer, intact", host, true });
    for (int k = 0; k < 2; ++k) {
        bytes m = host;
        const size_t o = pick(8, host.size());
        m[o] ^= 0x10;
        out.push_back({ "host buffer, bit flip at " + std::to_string(o), m, true });
    }
    out.push_back({ "host buffer, cut short", bytes(host.begin(), host.begin() + pick(8, host.size())), true });
    return out;
}

// The times the library logs for its checks, summed per kind.
struct check_times {
    double seal_ms = 0.0, sealed_ms = 0.0, rows_ms = 0.0;
};

check_times g_times;

void on_log(ggml_log_level, const char * text, void *) {
    double ms = 0.0, mib = 0.0;
    size_t n = 0;
    if (std::sscanf(text, "kvcomp: state: seal of %lf MiB checked in %lf ms", &mib, &ms) == 2) {
        g_times.seal_ms += ms;
    } else if (std::sscanf(text, "kvcomp: state: %lf MiB sealed in %lf ms", &mib, &ms) == 2) {
        g_times.sealed_ms += ms;
    } else if (std::sscanf(text, "kvcomp: state: K/V rows of %zu restored cells checked in %lf ms", &n, &ms) == 2) {
        g_times.rows_ms += ms;
    }
}

int bench(llama_model * model, int n_tokens) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_tokens + 256; cp.n_batch = 512; cp.n_ubatch = 512;
    cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_KVC4; cp.type_v = GGML_TYPE_KVC3;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    ctx_ptr c;
    c.ctx = llama_init_from_model(model, cp);
    llama_kvcomp_params p;
    llama_kvcomp_mode_preset(LLAMA_KVCOMP_MODE_BALANCED, &p, nullptr, nullptr);
    if (!c.ctx || llama_kvcomp_configure(c.ctx, &p) != 0) {
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> toks(n_tokens);
    std::mt19937 rng(1);
    for (auto & t : toks) {
        t = (llama_token) (rng() % (uint32_t) n_vocab);
    }
    decode(c.ctx, toks, 0, n_tokens, 512, 0);
    const std::string path = "test-kvc-state-bench.bin";
    double save_ms = 0.0, load_ms = 0.0;
    size_t n_bytes = 0;
    const int reps = 3;
    for (int r = 0; r < reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        n_bytes = llama_state_seq_save_file(c.ctx, path.c_str(), 0, toks.data(), toks.size());
        auto t1 = std::chrono::steady_clock::now();
        llama_memory_seq_rm(llama_get_memory(c.ctx), 0, -1, -1);
        std::vector<llama_token> got(n_tokens);
        size_t n_got = 0;
        const size_t n_read = llama_state_seq_load_file(c.ctx, path.c_str(), 0, got.data(), got.size(), &n_got);
        auto t2 = std::chrono::steady_clock::now();
        if (n_read != n_bytes) {
            return 1;
        }
        save_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
        load_ms += std::chrono::duration<double, std::milli>(t2 - t1).count();
    }
    std::remove(path.c_str());
    printf("{\"tokens\": %d, \"mode\": \"balanced\", \"bytes\": %zu, \"save_ms\": %.1f, \"seal_ms\": %.1f, "
           "\"restore_ms\": %.1f, \"seal_check_ms\": %.1f, \"row_check_ms\": %.1f}\n", n_tokens, n_bytes,
           save_ms / reps, g_times.sealed_ms / reps, load_ms / reps, g_times.seal_ms / reps, g_times.rows_ms / reps);
    return 0;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [SECONDS [SEED]]\n", argv[0]);
        return 2;
    }
    const bool     is_bench = argc > 3 && std::strcmp(argv[2], "--bench") == 0;
    const double   budget = argc > 2 && !is_bench ? std::atof(argv[2]) : 60.0;
    const uint32_t seed0  = argc > 3 && !is_bench ? (uint32_t) std::strtoul(argv[3], nullptr, 10) : 1;
    llama_log_set(on_log, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "failed to load %s\n", argv[1]);
        return 2;
    }
    if (is_bench) {
        const int rc = bench(model, std::atoi(argv[3]));
        llama_model_free(model);
        return rc;
    }
    std::string text;
    for (int i = 0; i < 6; ++i) {
        text += "Day " + std::to_string(i) + ": the keeper wrote down the wind, the tide and every ship that passed the point. ";
    }
    std::vector<llama_token> toks = test_tokenize(model, text, 512);
    const int n_tok = (int) toks.size();

    report rep;
    rep.check(n_tok >= 2 * (N_PROMPT + N_CONT), "text has %d tokens", n_tok);
    const mode_case modes[] = {
        { "off",            GGML_TYPE_F16,  GGML_TYPE_F16  },
        { "low-latency",    GGML_TYPE_KVC4, GGML_TYPE_KVC4 },
        { "balanced",       GGML_TYPE_KVC4, GGML_TYPE_KVC3 },
        { "high-precision", GGML_TYPE_KVC8, GGML_TYPE_KVC8 },
    };
    const auto t0 = std::chrono::steady_clock::now();
    const auto elapsed = [&]() { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    int n_modes = 0;
    for (size_t im = 0; im < std::size(modes) && n_tok >= 2 * (N_PROMPT + N_CONT); ++im) {
        const mode_case & mc = modes[im];
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 2;
        cp.n_threads = 2; cp.n_threads_batch = 2;
        cp.type_k = mc.type_k; cp.type_v = mc.type_v;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
        ctx_ptr c;
        c.ctx = llama_init_from_model(model, cp);
        fixture fx;
        fx.ctx   = c.ctx;
        fx.path  = std::string("test-kvc-state-") + mc.name + ".bin";
        fx.toks0 = toks;
        fx.toks1.assign(toks.begin() + N_PROMPT + N_CONT, toks.end());
        llama_kvcomp_params p;
        llama_kvcomp_mode_preset(llama_kvcomp_mode_from_name(mc.name), &p, nullptr, nullptr);
        const bool configured = fx.ctx && llama_kvcomp_configure(fx.ctx, &p) == 0;
        if (!configured) {
            rep.check(false, "%s: context", mc.name);
            continue;
        }
        decode(fx.ctx, fx.toks0, 0, N_PROMPT, 16, 0);
        decode(fx.ctx, fx.toks1, 0, N_PROMPT, 16, 1);
        const size_t n_saved = llama_state_seq_save_file(fx.ctx, fx.path.c_str(), 0, toks.data(), N_PROMPT);
        const bytes file = read_file(fx.path);
        // the references: sequence 1 beside an empty sequence 0, and both after the file's restore
        llama_memory_seq_rm(llama_get_memory(fx.ctx), 0, -1, -1);
        fx.ref1_empty = continue_seq(fx.ctx, fx.toks1, 1);
        size_t n_got = 0;
        std::vector<llama_token> got(N_PROMPT);
        const size_t n_read = llama_state_seq_load_file(fx.ctx, fx.path.c_str(), 0, got.data(), got.size(), &n_got);
        bytes host(llama_state_seq_get_size(fx.ctx, 0));
        host.resize(llama_state_seq_get_data(fx.ctx, host.data(), host.size(), 0));
        fx.ref0      = continue_seq(fx.ctx, fx.toks0, 0);
        fx.ref1_full = continue_seq(fx.ctx, fx.toks1, 1);
        layout L;
        bool parsed = n_saved == file.size() && n_read == file.size() && !fx.ref0.empty() && host.size() > SEAL;
        try {
            L = parse(file);
        } catch (const std::exception & e) {
            fprintf(stderr, "%s: %s\n", mc.name, e.what());
            parsed = false;
        }
        rep.check(parsed && L.k_rows.e > L.k_rows.b,
                  "%s: a %zu-byte slot file saved (%zu), restored (%zu%s%s) and parsed (%zu sections, K %s)", mc.name,
                  file.size(), n_saved, n_read, n_read ? "" : ": ", n_read ? "" : llama_kvcomp_last_error(),
                  L.sections.size(), L.k_type >= 0 ? ggml_type_name((ggml_type) L.k_type) : "?");
        if (!parsed) {
            continue;
        }
        ++n_modes;
        // each mode gets its share of the time; a round of mutants per seed
        const double t_end = budget * (double) (im + 1) / (double) std::size(modes);
        int n_refused = 0, n_same = 0, n_bad = 0, n_rounds = 0;
        for (uint32_t seed = seed0 + 1000 * (uint32_t) im; n_rounds == 0 || elapsed() < t_end; ++seed, ++n_rounds) {
            std::mt19937 rng(seed);
            for (const mutant & m : make_mutants(file, L, host, rng)) {
                const std::string what = std::string(mc.name) + ": " + m.name;
                int r = try_restore(rep, fx, m.b, m.host, what, seed);
                // a reader that parsed bytes past a cut would print what memory held: the
                // same file must be refused for the same reason twice
                if (r == 0 && m.name.rfind("cut", 0) == 0) {
                    const std::string first = g_last_reason;
                    r = try_restore(rep, fx, m.b, m.host, what, seed);
                    if (r == 0 && g_last_reason != first) {
                        rep.check(false, "seed %u: %s refused for two reasons: '%s', then '%s'", seed, what.c_str(),
                                  first.c_str(), g_last_reason.c_str());
                        r = -1;
                    }
                }
                r < 0 ? ++n_bad : r == 0 ? ++n_refused : ++n_same;
            }
        }
        rep.check(n_bad == 0, "%s: %d rounds of mutants, %d refused with a reason, %d restored identically, %d failed",
                  mc.name, n_rounds, n_refused, n_same, n_bad);
        rep.check(try_restore(rep, fx, file, false, std::string(mc.name) + ": the original file", seed0) == 1,
                  "%s: the original file restores after the mutants", mc.name);
        if (p.tracker) {
            llama_kvcomp_monitor_refresh(fx.ctx);
            std::string prom(1 << 20, '\0');
            const int64_t len = llama_kvcomp_snapshot_text(fx.ctx, LLAMA_KVCOMP_FORMAT_PROMETHEUS, -1, prom.data(), prom.size());
            prom.resize(len > 0 ? std::min<size_t>((size_t) len, prom.size()) : 0);
            std::string lower(prom);
            std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
            rep.check(len > 0 && lower.find("nan") == std::string::npos && lower.find("inf") == std::string::npos,
                      "%s: /metrics text (%lld bytes) holds no NaN or Inf", mc.name, (long long) len);
        }
        std::remove(fx.path.c_str());
    }
    rep.check(n_modes == (int) std::size(modes), "%d modes in %.0f s (budget %.0f s, first seed %u)", n_modes, elapsed(), budget, seed0);
    llama_model_free(model);
    llama_backend_free();
    return rep.finish("test-kvc-state");
}
