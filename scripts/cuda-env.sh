# Sourced by the CUDA scripts: cuBLAS from the nvidia-cublas wheel on PyPI, for machines whose
# CUDA toolkit has no cuBLAS (the CI machine has nvcc only), and the configure check. Needs $cache.
#   kvcomp_cublas include   -> prints a folder holding cublas_v2.h
#   kvcomp_cublas lib       -> prints a folder holding libcublas.so.13 and libcublasLt.so.13
kvcomp_cublas_pin="nvidia-cublas==13.10.0.20"

kvcomp_cublas() {
    local part=$1
    local dir="$cache/cublas-13.10.0.20"
    local want="$dir/nvidia/cu13/include/cublas_v2.h"
    [ "$part" = lib ] && want="$dir/nvidia/cu13/lib/libcublasLt.so.13"
    if [ ! -f "$want" ]; then
        mkdir -p "$cache/dl" "$dir"
        if ! ls "$cache"/dl/nvidia_cublas-13.10.0.20-*.whl >/dev/null 2>&1; then
            python3 -m pip download -q --no-deps --only-binary=:all: "$kvcomp_cublas_pin" -d "$cache/dl" >&2 || return 1
        fi
        python3 - "$dir" "nvidia/cu13/$part/" "$cache"/dl/nvidia_cublas-13.10.0.20-*.whl <<'PY' || return 1
import sys, zipfile
dest, prefix, wheel = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(prefix)])
PY
    fi
    echo "$dir/nvidia/cu13/$part"
}

# kvcomp_stale_build BUILD: true when BUILD is not a configured build of this clone
# (kvcomp_other_clone: scripts/build-env.sh, sourced beside this file)
kvcomp_stale_build() {
    [ ! -f "$1/build.ninja" ] || [ ! -f "$1/CMakeCache.txt" ] || kvcomp_other_clone "$1"
}
