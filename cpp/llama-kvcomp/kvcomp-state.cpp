// Verified states: the seal every state this build writes ends with, the checks before a
// state is read, and the check of every K/V row a state restores (docs/state.md).

#include "kvcomp-state.h"

#include "kvcomp-hash.h"

#include "kvcomp-buffer.h"
#include "llama-kvcomp.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache.h"
#include "llama-mmap.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

thread_local std::string kvcomp_last_error;
thread_local bool        kvcomp_in_state_op = false;
thread_local bool        kvcomp_state_sealed = false; // the state being read passed its seal

// Upstream gives most reasons for refusing a state only to the log (a mismatched row size,
// no room for the cells): while a state operation runs on this thread, its first error line
// becomes the reason too. The callback in force is chained, so logging is unchanged.
struct kvcomp_log_chain {
    ggml_log_callback prev    = nullptr;
    void *            prev_ud = nullptr;

    static kvcomp_log_chain & get() {
        static kvcomp_log_chain chain;
        static std::once_flag once;
        std::call_once(once, []() {
            llama_log_get(&chain.prev, &chain.prev_ud);
            llama_log_set(callback, nullptr);
        });
        return chain;
    }

    static void callback(ggml_log_level level, const char * text, void *) {
        if (kvcomp_in_state_op && level == GGML_LOG_LEVEL_ERROR && kvcomp_last_error.empty() && text) {
            std::string line(text);
            while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
                line.pop_back();
            }
            kvcomp_last_error = line;
        }
        const kvcomp_log_chain & c = get();
        if (c.prev) {
            c.prev(level, text, c.prev_ud);
        }
    }
};

// Marks a state operation on this thread: clears the last reason, captures upstream's.
struct kvcomp_state_op {
    kvcomp_state_op() {
        kvcomp_log_chain::get();
        kvcomp_last_error.clear();
        kvcomp_in_state_op  = true;
        kvcomp_state_sealed = false;
    }
    ~kvcomp_state_op() {
        kvcomp_in_state_op  = false;
        kvcomp_state_sealed = false;
    }
};

// What ends a sealed state: the digest of the n_bytes before it.
struct kvcomp_seal {
    uint64_t digest;
    uint64_t n_bytes;
    uint32_t version;
    uint32_t magic;
};
static_assert(sizeof(kvcomp_seal) == 24, "the seal has no padding");

constexpr uint32_t KVCOMP_SEAL_MAGIC   = 0x4c414553; // "SEAL"
constexpr uint32_t KVCOMP_SEAL_VERSION = 1;

kvcomp_seal kvcomp_seal_of(const kvcomp_hasher & h) {
    return { h.digest(), h.n_total, KVCOMP_SEAL_VERSION, KVCOMP_SEAL_MAGIC };
}

// Whether the last bytes of a state of `size` bytes look like a seal of the bytes before it.
bool kvcomp_is_seal(const kvcomp_seal & s, size_t size) {
    return size >= sizeof(kvcomp_seal) && s.magic == KVCOMP_SEAL_MAGIC && s.n_bytes == size - sizeof(kvcomp_seal);
}

void kvcomp_check_seal(const kvcomp_seal & s, const kvcomp_hasher & h) {
    if (s.version != KVCOMP_SEAL_VERSION) {
        throw std::runtime_error("the state's seal is version " + std::to_string(s.version) + ", this build reads " +
                                 std::to_string(KVCOMP_SEAL_VERSION));
    }
    if (s.digest != h.digest()) {
        throw std::runtime_error("checksum mismatch: the state was changed after it was saved");
    }
}

struct kvcomp_file_closer {
    void operator()(FILE * f) const { std::fclose(f); }
};
using kvcomp_file_ptr = std::unique_ptr<FILE, kvcomp_file_closer>;

kvcomp_file_ptr kvcomp_open(const char * path, const char * mode) {
    kvcomp_file_ptr f(std::fopen(path, mode));
    if (!f) {
        throw std::runtime_error(std::string("cannot open ") + path + ": " + std::strerror(errno));
    }
    return f;
}

// The digest of the first n bytes of a file.
kvcomp_hasher kvcomp_hash_file(FILE * f, size_t n) {
    kvcomp_hasher h;
    std::vector<uint8_t> buf(1u << 20);
    std::fseek(f, 0, SEEK_SET);
    while (n > 0) {
        const size_t want = std::min(n, buf.size());
        if (std::fread(buf.data(), 1, want, f) != want) {
            throw std::runtime_error("the state file could not be read back");
        }
        h.update(buf.data(), want);
        n -= want;
    }
    return h;
}

size_t kvcomp_file_size(FILE * f) {
    std::fseek(f, 0, SEEK_END);
    const long size = std::ftell(f);
    if (size < 0) {
        throw std::runtime_error("the state file has no size");
    }
    return (size_t) size;
}

// Runs f, keeping the reason of an exception; returns 0 then.
size_t kvcomp_guard(const std::function<size_t()> & f) {
    try {
        return f();
    } catch (const std::exception & e) {
        llama_kvcomp_state_failed(e.what());
        LLAMA_LOG_ERROR("kvcomp: state refused: %s\n", e.what());
        return 0;
    }
}

} // namespace

bool llama_kvcomp_state_is_sealed(void) {
    return kvcomp_state_sealed;
}

void llama_kvcomp_set_last_error(const std::string & reason) {
    kvcomp_last_error = reason;
}

int32_t llama_kvcomp_fail(int32_t rc, const std::string & why) {
    LLAMA_LOG_ERROR("kvcomp: %s\n", why.c_str());
    llama_kvcomp_set_last_error(why);
    return rc;
}

void llama_kvcomp_state_failed(const char * reason) {
    if (kvcomp_last_error.empty()) {
        kvcomp_last_error = reason && *reason ? reason : "refused (see the log)";
    }
}

const char * llama_kvcomp_last_error(void) {
    return kvcomp_last_error.empty() ? nullptr : kvcomp_last_error.c_str();
}

// The size upstream reports for a state of n bytes, seal included (0 stays 0).
static size_t kvcomp_state_sealed_size(size_t n) {
    return n ? n + sizeof(kvcomp_seal) : 0;
}

// Host buffers: save(n) writes the state into dst, at most n bytes, and returns its size; the
// seal follows it. Returns the size with the seal, or 0.
static size_t kvcomp_state_save(uint8_t * dst, size_t size, const std::function<size_t(size_t)> & save) {
    const kvcomp_state_op op;
    if (size < sizeof(kvcomp_seal)) {
        llama_kvcomp_state_failed("the buffer is smaller than the state");
        return 0;
    }
    const size_t n = save(size - sizeof(kvcomp_seal));
    if (n == 0) {
        llama_kvcomp_state_failed(nullptr);
        return 0;
    }
    kvcomp_hasher h;
    h.update(dst, n);
    const kvcomp_seal s = kvcomp_seal_of(h);
    std::memcpy(dst + n, &s, sizeof(s));
    return n + sizeof(s);
}

// load(n) reads the state from the first n bytes of src and returns the bytes it used;
// clear() empties what a refused state may have restored. A sealed state is checked before
// load runs; an unsealed one (upstream's) must be used to its last byte. Returns the bytes
// used, seal included, or 0 with the reason kept.
static size_t kvcomp_state_load(const uint8_t * src, size_t size, const std::function<size_t(size_t)> & load,
                               const std::function<void()> & clear) {
    const kvcomp_state_op op;
    // the deprecated llama_set_state_data passes no size: nothing marks where a seal would be
    if (size == SIZE_MAX) {
        return load(size);
    }
    return kvcomp_guard([&]() -> size_t {
        size_t payload = size;
        kvcomp_seal s = {};
        if (size >= sizeof(s)) {
            std::memcpy(&s, src + size - sizeof(s), sizeof(s));
        }
        if (kvcomp_is_seal(s, size)) {
            kvcomp_hasher h;
            h.update(src, s.n_bytes);
            kvcomp_check_seal(s, h);
            kvcomp_state_sealed = true;
            payload = s.n_bytes;
        }
        const size_t n = load(payload);
        if (n == 0 || n != payload) {
            clear();
        }
        if (n == 0) {
            throw std::runtime_error(kvcomp_last_error.empty() ? "refused (see the log)" : kvcomp_last_error);
        }
        if (n != payload) {
            throw std::runtime_error(std::to_string(payload - n) + " bytes after the state");
        }
        return size;
    });
}

// Files: save() writes the file (0: failed); the seal is appended. Returns the sealed size.
static size_t kvcomp_state_save_file(const char * path, const std::function<size_t()> & save) {
    const kvcomp_state_op op;
    return kvcomp_guard([&]() -> size_t {
        const size_t n = save();
        if (n == 0) {
            throw std::runtime_error("the state could not be written");
        }
        kvcomp_seal s;
        size_t size = 0;
        const int64_t t0 = ggml_time_us();
        {
            auto f = kvcomp_open(path, "rb");
            size = kvcomp_file_size(f.get());
            s = kvcomp_seal_of(kvcomp_hash_file(f.get(), size));
        }
        auto f = kvcomp_open(path, "ab");
        if (std::fwrite(&s, sizeof(s), 1, f.get()) != 1 || std::fflush(f.get()) != 0) {
            throw std::runtime_error(std::string("cannot write the seal of ") + path);
        }
        LLAMA_LOG_INFO("kvcomp: state: %.1f MiB sealed in %.1f ms\n", size / 1048576.0, (ggml_time_us() - t0) / 1000.0);
        return size + sizeof(s);
    });
}

// llama-context.cpp's io_magic and the sequence id that begin a sequence's buffer
// (llama_state_seq_get_data) and that its file leaves out; test-kvc-state's unsealed files
// fail if upstream changes them.
constexpr uint32_t KVCOMP_SEQ_BUFFER_MAGIC = 0xaf143cd8;
constexpr size_t   KVCOMP_SEQ_BUFFER_HEAD  = 2 * sizeof(uint32_t);
static_assert(KVCOMP_SEQ_BUFFER_HEAD <= 3 * sizeof(uint32_t), "it fits over a file's header");

// How a state file is read: load() is upstream's file reader, for a sealed file (checked before
// it runs) and for a caller asking the token count only; load_data(data, off) reads the state
// data[off, end) that follows the tokens from memory, for an unsealed file (upstream's file
// reader takes a read past the end for zeros, so a cut-short file would be parsed from
// garbage), and may overwrite the header and tokens before off (at least 12 bytes, already
// read); clear() empties what a refused state may have restored.
struct kvcomp_state_file_ops {
    std::function<size_t()>                                load;
    std::function<size_t(std::vector<uint8_t> &, size_t)> load_data;
    std::function<void()>                                  clear;
};

// The header of a state file (magic, version, token count), checked against what the caller
// reads; an unsealed file's tokens must fit in it too.
static void kvcomp_check_state_header(const uint32_t header[3], size_t size, uint32_t magic, uint32_t version) {
    if (header[0] != magic) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "not a state file of this kind (magic %08x, expected %08x)", header[0], magic);
        throw std::runtime_error(buf);
    }
    if (header[1] != version) {
        throw std::runtime_error("state file version " + std::to_string(header[1]) + ", this build reads " +
                                 std::to_string(version));
    }
    if ((size - 3 * sizeof(uint32_t)) / sizeof(llama_token) < header[2]) {
        throw std::runtime_error("the state file is cut short (" + std::to_string(header[2]) + " tokens in " +
                                 std::to_string(size) + " bytes)");
    }
}

// With verify, checks the token count against n_token_capacity and the seal, then reads the
// file (load for a sealed one, load_data for an unsealed one, tokens copied to tokens_out); an
// exception or 0 runs clear(). Without verify (a caller asking the token count only) only the
// header is checked before load runs. Returns what load returned, or the file's size, with the
// seal counted; 0 with the reason kept.
static size_t kvcomp_state_load_file(const char * path, uint32_t magic, uint32_t version, bool verify, size_t n_token_capacity,
                                    llama_token * tokens_out, size_t * n_token_count_out, const kvcomp_state_file_ops & ops) {
    const kvcomp_state_op op;
    return kvcomp_guard([&]() -> size_t {
        size_t tail = 0;
        std::vector<uint8_t> data; // an unsealed file's bytes
        {
            auto f = kvcomp_open(path, "rb");
            const size_t size = kvcomp_file_size(f.get());
            uint32_t header[3] = {};
            std::fseek(f.get(), 0, SEEK_SET);
            if (size < sizeof(header) || std::fread(header, sizeof(header), 1, f.get()) != 1) {
                throw std::runtime_error("the state file is cut short (" + std::to_string(size) + " bytes, no header)");
            }
            kvcomp_check_state_header(header, size, magic, version);
            if (verify && header[2] > n_token_capacity) {
                throw std::runtime_error("the state holds " + std::to_string(header[2]) + " tokens, the caller has room for " +
                                         std::to_string(n_token_capacity));
            }
            kvcomp_seal s = {};
            if (verify && size >= sizeof(s)) {
                std::fseek(f.get(), (long) (size - sizeof(s)), SEEK_SET);
                if (std::fread(&s, sizeof(s), 1, f.get()) != 1) {
                    throw std::runtime_error("the state file could not be read");
                }
            }
            if (verify && kvcomp_is_seal(s, size)) {
                const int64_t t0 = ggml_time_us();
                kvcomp_check_seal(s, kvcomp_hash_file(f.get(), s.n_bytes));
                kvcomp_state_sealed = true;
                tail = sizeof(s);
                LLAMA_LOG_INFO("kvcomp: state: seal of %.1f MiB checked in %.1f ms\n", s.n_bytes / 1048576.0,
                               (ggml_time_us() - t0) / 1000.0);
            } else if (verify) {
                data.resize(size);
                std::fseek(f.get(), 0, SEEK_SET);
                if (std::fread(data.data(), 1, size, f.get()) != size) {
                    throw std::runtime_error("the state file could not be read");
                }
            }
        }
        size_t n = 0;
        try {
            if (data.empty()) {
                n = ops.load();
            } else {
                // an unsealed file: header, tokens, then the state as a buffer holds it, every read bounded
                const size_t n_tokens = ((const uint32_t *) data.data())[2];
                const size_t off      = 3 * sizeof(uint32_t) + n_tokens * sizeof(llama_token);
                std::memcpy(tokens_out, data.data() + 3 * sizeof(uint32_t), n_tokens * sizeof(llama_token));
                *n_token_count_out = n_tokens;
                const size_t used = ops.load_data(data, off);
                if (used != 0 && used != data.size() - off) {
                    llama_kvcomp_state_failed(("the state is " + std::to_string(used) + " bytes, the file holds " +
                                               std::to_string(data.size() - off)).c_str());
                }
                n = used == data.size() - off ? data.size() : 0;
            }
        } catch (const std::exception & e) {
            llama_kvcomp_state_failed(e.what());
        }
        if (n == 0) {
            ops.clear();
            std::string why = kvcomp_last_error.empty() ? "refused (see the log)" : kvcomp_last_error;
            if (verify && tail == 0 && why.find("no seal") == std::string::npos) {
                why += " (the file has no seal: it was cut short, or written by another build)";
            }
            kvcomp_last_error = why;
            throw std::runtime_error(why);
        }
        // a byte count (sequence files) counts the seal as read
        return n > 1 ? n + tail : n;
    });
}

size_t llama_kvcomp_state_file_tail(llama_file & file) {
    const size_t size = file.size();
    if (size < sizeof(kvcomp_seal)) {
        return 0;
    }
    const size_t pos = file.tell();
    kvcomp_seal s;
    file.seek(size - sizeof(s), SEEK_SET);
    file.read_raw(&s, sizeof(s));
    file.seek(pos, SEEK_SET);
    return kvcomp_is_seal(s, size) ? sizeof(s) : 0;
}

void llama_kvcomp_buffer::check_restored_rows(llama_io_read_i & io, llama_kv_cache & kv, llama_seq_id seq_id,
                                              const llama_kv_cache::slot_info_vec_t & sinfos) {
    if (!io.flush()) {
        return;
    }
    const int64_t t0 = ggml_time_us();
    size_t n_rows = 0;
    std::vector<uint8_t> buf;
    const auto check = [&](ggml_tensor * t, uint32_t strm, uint32_t c0, uint32_t n, bool trans, const char * what, uint32_t il) {
        if (!trans) {
            buf.resize(t->nb[1] * n);
            ggml_backend_tensor_get(t, buf.data(), strm * t->nb[2] + c0 * t->nb[1], buf.size());
            const bool ok = ggml_kvcomp_is_kvct(t->type) ?
                kvc_t_validate_rows(t->type, kv.hparams.n_embd_head_k(il), buf.data(), buf.size()) :
                ggml_validate_row_data(t->type, buf.data(), buf.size());
            if (ok) {
                return;
            }
        } else {
            // a transposed V (unquantized, no flash attention) holds channel j of every cell in
            // the stream's row j
            const size_t es = ggml_element_size(t);
            buf.resize(t->nb[2]);
            ggml_backend_tensor_get(t, buf.data(), strm * t->nb[2], buf.size());
            std::vector<uint8_t> col(es * t->ne[0] * n);
            for (uint32_t i = 0; i < n; ++i) {
                for (int64_t j = 0; j < t->ne[0]; ++j) {
                    std::memcpy(col.data() + (i * t->ne[0] + j) * es, buf.data() + (j * t->ne[1] + c0 + i) * es, es);
                }
            }
            if (ggml_validate_row_data(t->type, col.data(), col.size())) {
                return;
            }
        }
        if (seq_id == -1) {
            kv.clear(true);
        } else {
            kv.seq_rm(seq_id, -1, -1);
        }
        throw std::runtime_error(std::string("the state's ") + what + " rows of layer " + std::to_string(il) +
                                 " hold non-finite values or codes out of range (" + ggml_type_name(t->type) + ", cells " +
                                 std::to_string(c0) + ".." + std::to_string(c0 + n - 1) + ")");
    };
    for (const auto & si : sinfos) {
        if (si.empty()) {
            continue;
        }
        const uint32_t strm = (uint32_t) si.strm[0];
        const auto & idxs = si.idxs[0];
        // upstream restores a sequence into runs of consecutive cells: one read per run
        for (size_t i = 0; i < idxs.size();) {
            size_t j = i + 1;
            while (j < idxs.size() && idxs[j] == idxs[j - 1] + 1) {
                ++j;
            }
            for (const auto & l : kv.layers) {
                check(l.k, strm, idxs[i], (uint32_t) (j - i), false, "K", l.il);
                if (l.v) {
                    check(l.v, strm, idxs[i], (uint32_t) (j - i), kv.v_trans, "V", l.il);
                }
            }
            n_rows += j - i;
            i = j;
        }
    }
    if (n_rows > 0) {
        LLAMA_LOG_INFO("kvcomp: state: K/V rows of %zu restored cells checked in %.1f ms\n", n_rows,
                       (ggml_time_us() - t0) / 1000.0);
    }
}

size_t llama_kvcomp_state_get_size(llama_context * ctx) {
    return kvcomp_state_sealed_size(ctx->state_get_size());
}

size_t llama_kvcomp_state_get_data(llama_context * ctx, uint8_t * dst, size_t size) {
    return kvcomp_state_save(dst, size, [&](size_t n) { return ctx->state_get_data(dst, n); });
}

size_t llama_kvcomp_state_set_data(llama_context * ctx, const uint8_t * src, size_t size) {
    return kvcomp_state_load(src, size, [&](size_t n) { return ctx->state_set_data(src, n); },
                             [&]() { llama_memory_clear(llama_get_memory(ctx), true); });
}

bool llama_kvcomp_state_load_file(llama_context * ctx, const char * path, llama_token * tokens_out,
                                  size_t n_token_capacity, size_t * n_token_count_out) {
    const kvcomp_state_file_ops ops = {
        [&]() -> size_t { return ctx->state_load_file(path, tokens_out, n_token_capacity, n_token_count_out); },
        [&](std::vector<uint8_t> & data, size_t off) { return ctx->state_set_data(data.data() + off, data.size() - off); },
        [&]() { llama_memory_clear(llama_get_memory(ctx), true); },
    };
    return kvcomp_state_load_file(path, LLAMA_SESSION_MAGIC, LLAMA_SESSION_VERSION, true, n_token_capacity, tokens_out,
                                  n_token_count_out, ops) != 0;
}

bool llama_kvcomp_state_save_file(llama_context * ctx, const char * path, const llama_token * tokens, size_t n_token_count) {
    return kvcomp_state_save_file(path, [&]() -> size_t { return ctx->state_save_file(path, tokens, n_token_count); }) != 0;
}

// States kept on the device never leave the process: neither sealed nor checked.
size_t llama_kvcomp_state_seq_get_size(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags) {
    const size_t n = ctx->state_seq_get_size(seq_id, flags);
    return flags & LLAMA_STATE_SEQ_FLAGS_ON_DEVICE ? n : kvcomp_state_sealed_size(n);
}

size_t llama_kvcomp_state_seq_get_data(llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id,
                                       llama_state_seq_flags flags) {
    if (flags & LLAMA_STATE_SEQ_FLAGS_ON_DEVICE) {
        return ctx->state_seq_get_data(seq_id, dst, size, flags);
    }
    return kvcomp_state_save(dst, size, [&](size_t n) { return ctx->state_seq_get_data(seq_id, dst, n, flags); });
}

size_t llama_kvcomp_state_seq_set_data(llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq_id,
                                       llama_state_seq_flags flags) {
    if (flags & LLAMA_STATE_SEQ_FLAGS_ON_DEVICE) {
        const kvcomp_state_op op;
        kvcomp_state_sealed = true; // it never left the process
        return ctx->state_seq_set_data(seq_id, src, size, flags);
    }
    return kvcomp_state_load(src, size, [&](size_t n) { return ctx->state_seq_set_data(seq_id, src, n, flags); },
                             [&]() { llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1); });
}

size_t llama_kvcomp_state_seq_save_file(llama_context * ctx, const char * path, llama_seq_id seq_id,
                                        const llama_token * tokens, size_t n_token_count) {
    return kvcomp_state_save_file(path, [&]() { return ctx->state_seq_save_file(seq_id, path, tokens, n_token_count); });
}

size_t llama_kvcomp_state_seq_load_file(llama_context * ctx, const char * path, llama_seq_id seq_id, llama_token * tokens_out,
                                        size_t n_token_capacity, size_t * n_token_count_out) {
    const kvcomp_state_file_ops ops = {
        [&]() { return ctx->state_seq_load_file(seq_id, path, tokens_out, n_token_capacity, n_token_count_out); },
        [&](std::vector<uint8_t> & data, size_t off) -> size_t {
            // a sequence's buffer starts with what a file leaves out, upstream's magic and the
            // sequence: written over the tokens' last bytes, in place
            const size_t   at      = off - KVCOMP_SEQ_BUFFER_HEAD;
            const uint32_t head[2] = { KVCOMP_SEQ_BUFFER_MAGIC, (uint32_t) seq_id };
            std::memcpy(data.data() + at, head, sizeof(head));
            const size_t used = ctx->state_seq_set_data(seq_id, data.data() + at, data.size() - at, 0);
            return used >= KVCOMP_SEQ_BUFFER_HEAD ? used - KVCOMP_SEQ_BUFFER_HEAD : 0;
        },
        [&]() { llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1); },
    };
    return kvcomp_state_load_file(path, LLAMA_STATE_SEQ_MAGIC, LLAMA_STATE_SEQ_VERSION, tokens_out != nullptr, n_token_capacity,
                                  tokens_out, n_token_count_out, ops);
}
