#pragma once

// Verified state files and buffers (docs/state.md): every state this build writes ends with a
// seal (a hash of the bytes before it), every state it reads is checked against its seal
// before upstream parses it, and every restored KV row is checked before it is used. A state
// that fails is refused whole, and the reason is kept for llama_kvcomp_last_error().

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

struct llama_file;

// Bytes the seal adds to a state.
size_t llama_kvcomp_state_seal_size();

// The size upstream reports for a state of n bytes, seal included (0 stays 0).
size_t llama_kvcomp_state_sealed_size(size_t n);

// Host buffers: save(n) writes the state into dst, at most n bytes, and returns its size; the
// seal follows it. Returns the size with the seal, or 0.
size_t llama_kvcomp_state_save(uint8_t * dst, size_t size, const std::function<size_t(size_t)> & save);

// load(n) reads the state from the first n bytes of src and returns the bytes it used;
// clear() empties what a refused state may have restored. A sealed state is checked before
// load runs; an unsealed one (upstream's) must be used to its last byte. Returns the bytes
// used, seal included, or 0 with the reason kept.
size_t llama_kvcomp_state_load(const uint8_t * src, size_t size, const std::function<size_t(size_t)> & load,
                               const std::function<void()> & clear);

// Files: save() writes the file and returns its size (0: failed); the seal is appended.
size_t llama_kvcomp_state_save_file(const char * path, const std::function<size_t()> & save);

// With verify, checks the header (magic, version, token count against n_token_capacity) and the
// seal; then runs load(), and an exception or 0 from it runs clear(). Returns what load
// returned, or 0 with the reason kept. Without verify (a caller asking the token count only)
// only load runs.
size_t llama_kvcomp_state_load_file(const char * path, uint32_t magic, uint32_t version, bool verify, size_t n_token_capacity,
                                    const std::function<size_t()> & load, const std::function<void()> & clear);

// The seal bytes at the end of an open state file (0 for upstream's unsealed files), for the
// loaders that compare the state's size with the file's.
size_t llama_kvcomp_state_file_tail(llama_file & file);

// Keeps why a state operation failed (the first reason wins until the next operation starts).
void llama_kvcomp_state_failed(const char * reason);

// Why the last failed kvcomp call on this thread failed (for llama_kvcomp_configure and the
// state API alike); set_last_error("") clears it.
void llama_kvcomp_set_last_error(const std::string & reason);
