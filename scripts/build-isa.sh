#!/usr/bin/env bash
# Builds llama-bench with the CPU backend compiled for one x86 level below this machine's own,
# so that the speed of the machines at that level is measured here (scripts/report.sh):
#   avx2    AVX2, FMA, F16C (AMD Zen 1-3, most Intel desktop CPUs)
#   avx512  AVX-512 F/CD/VL/DQ/BW without VBMI (Intel Skylake-X, Cascade Lake)
# The build folder is $KVCOMP_CACHE/build-LEVEL-<key> (build.sh's key). Prints its bin folder,
# for KVCOMP_BIN_DIR.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}
jobs=${KVCOMP_JOBS:-2}
level=${1:-}
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
case "$level" in
    avx2) ;;
    avx512) flags+=(-DGGML_AVX512=ON) ;;
    *) echo "usage: scripts/build-isa.sh avx2|avx512" >&2; exit 2 ;;
esac

# shellcheck source=scripts/build-env.sh
source "$root/scripts/build-env.sh"
kvcomp_build_dir "build-$level"
kvcomp_configure "${flags[@]}"
cmake --build "$build" --parallel "$jobs" --target llama-bench >&2
echo "$build/bin"
