#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs (llama-perplexity, llama-bench, test-kvc-backend and
# their libraries) for one GPU architecture, on any machine with nvcc; no GPU is needed, so
# the binaries can be built on a CPU machine and carried to the GPU one (docs/cuda.md).
# cuBLAS comes from the toolkit when it has it, else from the nvidia-cublas wheel; without a
# CUDA driver library to link, upstream's GGML_CUDA_NO_VMM memory pool is used. On x86-64 the
# CPU backend targets AVX2 rather than this machine. Prints the bin folder.
#
# usage: scripts/cuda-build.sh [ARCH]      ARCH: a CUDA architecture, default 90 (H100/H200)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}
arch=${1:-90}
jobs=${KVCOMP_JOBS:-$(nproc)}

command -v nvcc >/dev/null 2>&1 || { echo "cuda-build: nvcc not found on PATH" >&2; exit 1; }
# shellcheck source=scripts/cuda-env.sh
source "$root/scripts/cuda-env.sh"

# shellcheck source=scripts/build-env.sh
source "$root/scripts/build-env.sh"
kvcomp_build_dir "build-cuda-sm${arch}"

args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_UPSTREAM_DIR="$sdist" -DGGML_CUDA=ON
      -DCMAKE_CUDA_ARCHITECTURES="$arch")
toolkit=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)
if ! ls "$toolkit"/lib*/libcublas.so* "$toolkit"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    lib=$(kvcomp_cublas lib)
    inc=$(kvcomp_cublas include)
    args+=(-DCUDA_cublas_LIBRARY="$lib/libcublas.so.13" -DCUDA_cublasLt_LIBRARY="$lib/libcublasLt.so.13"
           -DCMAKE_CUDA_FLAGS="-I$inc")
fi
if ! ldconfig -p 2>/dev/null | grep -q "libcuda\.so" && ! ls "$toolkit"/lib*/stubs/libcuda.so "$toolkit"/targets/*/lib/stubs/libcuda.so >/dev/null 2>&1; then
    args+=(-DGGML_CUDA_NO_VMM=ON)
fi
if [ "$(uname -m)" = x86_64 ]; then
    args+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi

if kvcomp_stale_build "$build"; then
    rm -rf "$build"
    cmake -S "$root" -B "$build" "${args[@]}" >&2
fi
cmake --build "$build" --parallel "$jobs" --target llama-perplexity llama-bench test-kvc-backend >&2
echo "$build/bin"
