#pragma once

// Verified state files and buffers (docs/state.md): every state this build writes ends with a
// seal (a hash of the bytes before it), every state it reads is checked against its seal
// before upstream parses it, and every restored KV row is checked before it is used. A state
// that fails is refused whole, and the reason is kept for llama_kvcomp_last_error().

#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <string>

struct llama_file;

// What llama.h's state functions do (patch 0016 forwards each to its namesake here): the
// state as upstream writes and reads it, sealed on the way out and checked on the way in.
size_t llama_kvcomp_state_get_size(llama_context * ctx);
size_t llama_kvcomp_state_get_data(llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_kvcomp_state_set_data(llama_context * ctx, const uint8_t * src, size_t size);
bool   llama_kvcomp_state_load_file(llama_context * ctx, const char * path, llama_token * tokens_out,
                                    size_t n_token_capacity, size_t * n_token_count_out);
bool   llama_kvcomp_state_save_file(llama_context * ctx, const char * path, const llama_token * tokens, size_t n_token_count);
size_t llama_kvcomp_state_seq_get_size(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_kvcomp_state_seq_get_data(llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id,
                                       llama_state_seq_flags flags);
size_t llama_kvcomp_state_seq_set_data(llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id seq_id,
                                       llama_state_seq_flags flags);
size_t llama_kvcomp_state_seq_save_file(llama_context * ctx, const char * path, llama_seq_id seq_id,
                                        const llama_token * tokens, size_t n_token_count);
size_t llama_kvcomp_state_seq_load_file(llama_context * ctx, const char * path, llama_seq_id seq_id, llama_token * tokens_out,
                                        size_t n_token_capacity, size_t * n_token_count_out);

// The seal bytes at the end of an open state file (0 for upstream's unsealed files), for the
// loaders that compare the state's size with the file's.
size_t llama_kvcomp_state_file_tail(llama_file & file);

// Whether the state this thread is reading passed its seal: a state holding kvcomp's own
// sections (residual buffer, tracker, plans) is read only then, since this build seals every
// state it writes and those sections have no range a reader could check.
bool llama_kvcomp_state_is_sealed(void);

// Keeps why a state operation failed (the first reason wins until the next operation starts).
void llama_kvcomp_state_failed(const char * reason);

// Why the last failed kvcomp call on this thread failed (for llama_kvcomp_configure and the
// state API alike); set_last_error("") clears it.
void llama_kvcomp_set_last_error(const std::string & reason);

// Logs why a call failed, keeps it for llama_kvcomp_last_error and returns rc.
int32_t llama_kvcomp_fail(int32_t rc, const std::string & why);

// Where the K statistics applied by this thread's last successful llama_kvcomp_set_k_stats or
// _auto call came from (llama_kvcomp_k_stats_source).
std::string & llama_kvcomp_k_stats_note();
