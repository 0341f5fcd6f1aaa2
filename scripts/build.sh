#!/usr/bin/env bash
# Configure and build kvcomp (patched upstream + our code), CPU backend, Release.
# The build folder lives in $KVCOMP_CACHE (default ~/.cache/kvcomp), keyed by the upstream pin
# and the patch series, and ./build links to it. ccache, when present, makes a fresh clone
# reuse earlier compilations.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}
jobs=${KVCOMP_JOBS:-2}
targets=${KVCOMP_TARGETS:-"llama llama-server llama-perplexity llama-bench llama-batched-bench llama-cli llama-quantize llama-kvcomp-steps llama-kvcomp-rows llama-kvcomp-ksim llama-kvcomp-calibrate ggml-rpc-server kvcomp-tests"}

# shellcheck source=scripts/build-env.sh
source "$root/scripts/build-env.sh"
kvcomp_build_dir build
kvcomp_configure

# shellcheck disable=SC2086
cmake --build "$build" --parallel "$jobs" --target $targets >&2
ln -sfn "$build" "$root/build"
echo "$build"
