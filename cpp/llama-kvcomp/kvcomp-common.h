#pragma once

// kvcomp in llama.cpp's common library: command-line flags and their application to a context.

#include "llama-kvcomp.h"

#include <vector>

struct common_arg;
struct common_params;

// The --kv-comp-* flags, for common_params_parser_init.
std::vector<common_arg> common_kvcomp_args();

// Applies params.kvcomp to a freshly created context; logs the reason and returns false
// when the combination is not supported.
bool common_kvcomp_apply(llama_context * ctx, const common_params & params);
