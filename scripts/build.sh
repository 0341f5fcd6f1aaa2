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

sdist=$(python3 "$root/scripts/prepare_upstream.py")
key=$(basename "$(dirname "$sdist")")
build="$cache/build-${key#upstream-}"
mkdir -p "$build"

# A build folder configured from another clone is reconfigured (ccache keeps the objects).
if [ -f "$build/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$build/CMakeCache.txt"; then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
fi

export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache}
export CCACHE_BASEDIR=$root
export CCACHE_NOHASHDIR=1

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
