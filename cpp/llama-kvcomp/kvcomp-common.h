#pragma once

// kvcomp in llama.cpp's common library: command-line flags and their application to a context.

#include "llama-kvcomp.h"

#include <vector>

struct common_arg;
struct common_params;

// The --kv-comp-* flags, for common_params_parser_init.
std::vector<common_arg> common_kvcomp_args();

// -ctk was given: K is the user's from then on, which neither a mode nor --kv-comp-kstats changes.
void common_kvcomp_type_k_given();

// Before the context is created: refuses, with the fix in the message, what upstream would
// refuse less clearly (a mode's quantized V cache with -fa off).
bool common_kvcomp_check(const common_params & params);
// The same for the context params of model about to be made: a mode whose kvct K cache would
// land on a device without kvct kernels gets its plain K type in cparams instead (logged).
bool common_kvcomp_check(const common_params & params, llama_context_params & cparams, const llama_model * model);

// Applies params.kvcomp to a freshly created context; logs the reason and returns false
// when the combination is not supported.
bool common_kvcomp_apply(llama_context * ctx, const common_params & params);

// The same flags in llama-bench, which has its own parser: consumes argv[i] (and its value)
// when it is a --kv-comp-* flag and returns true; sets invalid_param on a bad value.
bool common_kvcomp_bench_arg(int argc, char ** argv, int & i, bool & invalid_param);
void common_kvcomp_bench_usage();
// The checks common_kvcomp_check makes, on the context parameters of a llama-bench test, before
// the context is made (llama-bench keeps libllama's log quiet, so the reason would be lost);
// false (reason logged) if refused.
bool common_kvcomp_bench_check(const llama_context_params & cparams);
// Applies the parsed flags to a context llama-bench created; false (reason logged) if refused.
bool common_kvcomp_bench_apply(llama_context * ctx);
