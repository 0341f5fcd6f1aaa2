#!/usr/bin/env bash
# One prepared check on a machine with an NVIDIA GPU (sm_90: H100, H200), sized for 10 minutes
# on 16 cores:
#   1. build the CUDA backend for sm_90 only, and only what the checks run (scripts/cuda-build.sh;
#      skipped with --bin DIR: the bin/ folder of such a build made elsewhere);
#   2. test-kvc-backend: every kvc op, type, head size and K/V pair on the GPU against the CPU
#      backend, with the NMSE bounds of the CPU tests;
#   3. kvcomp kld with every layer on the GPU: f16, q8_0, q4_0, the kvc types and the modes;
#   4. kvcomp bench on the GPU: decode (tg 64) and prefill (pp 512) at depths 0, 4096, 16384.
# Every stage runs even if an earlier one failed; summary.md and summary.json (with the logs)
# land in --out. The model (default SmolLM2) comes from $KVCOMP_CACHE as everywhere else.
#
# usage: scripts/gpu-check.sh [--bin DIR] [--out DIR] [--model NAME] [--chunks N] [--configs LIST]
#                             [--stages backend,kld,bench]
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=""
out="$root/gpu-check-out"
chunks=8
model=smollm2-135m
stages=backend,kld,bench
configs="f16,q8_0,q4_0,kvc8,kvc4,low-latency,balanced,high-precision"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin)     bin=$(cd "$2" && pwd); shift 2 ;;
        --out)     out=$2; shift 2 ;;
        --chunks)  chunks=$2; shift 2 ;;
        --model)   model=$2; shift 2 ;;
        --stages)  stages=$2; shift 2 ;;
        --configs) configs=$2; shift 2 ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
stamp() { echo "gpu-check: $(( $(date +%s) - t0 )) s: $*" >&2; }

if [ -z "$bin" ]; then
    bin=$("$root/scripts/cuda-build.sh" 90 2>"$out/build.log") || { tail -30 "$out/build.log"; exit 1; }
    stamp "built"
fi

# the build's own libraries, then the CUDA runtime and cuBLAS wherever this machine keeps them
libs="$bin"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import glob, site; print(" ".join(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/*/lib")))' 2>/dev/null); do
    [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVCOMP_BIN_DIR="$bin"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>&1
echo "$model" >"$out/model.txt"

has() { [[ ",$stages," == *",$1,"* ]]; }

if has backend; then
    "$bin/test-kvc-backend" >"$out/backend.log" 2>&1
    echo $? >"$out/backend.rc"
    stamp "backend test: exit $(cat "$out/backend.rc"), $(tail -1 "$out/backend.log")"
fi

if has kld; then
    python3 -m ggml_kvcomp kld --model "$model" --ngl 99 --threads 8 --ctx 512 --chunks "$chunks" \
        --configs "$configs" --json "$out/kld.json" >"$out/kld.md" 2>"$out/kld.log"
    echo $? >"$out/kld.rc"
    stamp "kld: exit $(cat "$out/kld.rc")"
fi

if has bench; then
    python3 -m ggml_kvcomp bench --model "$model" --ngl 99 --threads 8 --depths 0,4096,16384 --n-gen 64 \
        --n-prompt 512 --reps 2 --configs "$configs" --json "$out/bench.json" >"$out/bench.md" 2>"$out/bench.log"
    echo $? >"$out/bench.rc"
    stamp "bench: exit $(cat "$out/bench.rc")"
fi

python3 -m ggml_kvcomp.gpu_summary "$out"
