#!/usr/bin/env bash
# The CUDA check that needs no GPU (part of scripts/test.sh): compiles our kernels
# (cpp/ggml-kvcomp/cuda) and the ggml-cuda files that patch 0011 hooks them into, for sm_80,
# sm_86, sm_89 and sm_90, with upstream's own flags: a CMake configure of the CUDA backend, then
# only those objects. Then it builds and runs test-kvc-kvct-cuda-host, the kernels' kvct
# decoder as host code against the C reference (ggml-base and the CUDA runtime, no GPU).
# cuBLAS is never linked, so only its headers are needed; they come from the nvidia-cublas
# wheel on PyPI, cached in $KVCOMP_CACHE. Without nvcc it says so and exits 0.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}
jobs=${KVCOMP_JOBS:-2}
archs=${KVCOMP_CUDA_ARCHS:-"80;86;89;90"}

if ! command -v nvcc >/dev/null 2>&1; then
    echo "cuda-compile: nvcc not found on PATH, so the CUDA sources were not compiled" >&2
    exit 0
fi

# shellcheck source=scripts/cuda-env.sh
source "$root/scripts/cuda-env.sh"
inc=$(kvcomp_cublas include)
cublas_dir=$(dirname "$inc")

# shellcheck source=scripts/build-env.sh
source "$root/scripts/build-env.sh"
kvcomp_build_dir "cuda-compile"

if kvcomp_stale_build "$build"; then
    rm -rf "$build"
    # The libraries are never linked here; their paths only satisfy the configure step.
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCOMP_UPSTREAM_DIR="$sdist" \
        -DKVCOMP_BUILD_TESTS=OFF -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES="$archs" \
        -DCUDA_cublas_LIBRARY="$cublas_dir/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cublas_dir/libcublasLt.so" \
        -DCMAKE_CUDA_FLAGS="-I$inc" >"$build.configure.log" 2>&1 || { cat "$build.configure.log" >&2; exit 1; }
fi

# our kernels and every ggml-cuda file the patch touches
targets=$(ninja -C "$build" -t targets all)
objects=()
while read -r obj; do
    objects+=("$obj")
done < <(
    {
        echo "kvc-cuda.cu.o"
        echo "kvc-kvct-cuda.cu.o"
        sed -n 's|^+++ b/ggml/src/ggml-cuda/\(.*\)$|ggml-cuda.dir/\1.o|p' "$root"/cpp/patches/*.patch
    } | while read -r suffix; do
        sed -n "s|^\([^:]*${suffix//./\\.}\): .*|\1|p" <<<"$targets"
    done | sort -u
)
if [ "${#objects[@]}" -lt 2 ]; then
    echo "cuda-compile: found no objects to build in $build" >&2
    exit 1
fi
echo "cuda-compile: ${#objects[@]} objects for sm ${archs}" >&2
ninja -C "$build" -j "$jobs" "${objects[@]}" >&2
# the kernels' kvct decoder as host code against the C reference: links the CUDA runtime, no GPU
ninja -C "$build" -j "$jobs" test-kvc-kvct-cuda-host >&2
"$build/bin/test-kvc-kvct-cuda-host" >&2
echo "cuda-compile: ok" >&2
