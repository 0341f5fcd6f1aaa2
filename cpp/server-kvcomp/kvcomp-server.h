#pragma once

// kvcomp in llama-server: the monitor's series appended to /metrics, and GET /kvcomp with the
// JSON snapshot (docs/monitoring.md).

#include "server-http.h"

#include <functional>

struct common_params;
struct llama_context;

// llama-server's kvcomp defaults, set before its command line is parsed: a prompt the server
// reuses or restores after a generation keeps its exact rows (--kv-comp-keep-prompt), since
// its prompt cache re-decodes a cached prompt's last token.
void kvcomp_server_defaults(common_params & params);

// /metrics: upstream's handler, then the monitor's series when it answered 200 and a monitor
// is on.
server_http_context::handler_t kvcomp_server_metrics_handler(server_http_context::handler_t upstream,
                                                             std::function<llama_context *()> ctx);

// GET /kvcomp[?layer=N][&format=json|prometheus]: the snapshot (layer N's per-head rows only
// when given, in either format); 501 when the endpoint or the monitor is off; 400 for an
// unknown parameter, one given twice, a layer that is not a whole number below the model's
// layer count (an empty one included), a format other than json or prometheus.
// ctx is asked for when a request comes (the model loads after the routes are registered);
// it only names the monitor (the snapshot is a copy the decoding thread published), so the
// HTTP threads never touch the context itself.
server_http_context::handler_t kvcomp_server_handler(bool enabled, std::function<llama_context *()> ctx);
