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
mkdir -p "$build"
kvcomp_adopt_build
kvcomp_ccache

generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVCOMP_UPSTREAM_DIR="$sdist" >&2
fi

# shellcheck disable=SC2086
cmake --build "$build" --parallel "$jobs" --target $targets >&2
ln -sfn "$build" "$root/build"
echo "$build"
