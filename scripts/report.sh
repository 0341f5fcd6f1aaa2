#!/usr/bin/env bash
# Regenerates docs/results.md and README's mode table: runs each measurement as a `kvcomp`
# command whose rows, command line, date and machine are kept as a record in
# docs/results-data/ (`kvcomp record`), then renders the report from every record there
# (`kvcomp report --data`). `--quick` measures a subset (SmolLM2-F32 quality at ctx 2048, one
# speed table; memory comes from the quality run) and keeps the other tables' records from
# the last full run. Uses the build in build/ (KVCOMP_BIN_DIR) and the models in the cache.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

quick=()
case "${1:-}" in
    --quick) quick=(--quick) ;;
    "") ;;
    *) echo "usage: scripts/report.sh [--quick]" >&2; exit 2 ;;
esac
venv=$(scripts/venv.sh)
kvcomp() { "$venv/bin/python" -m ggml_kvcomp "$@"; }
data=docs/results-data
start=$SECONDS

# a record's command, run again once if it fails (the library can be relinked under a run)
step() {
    local name=$1
    shift
    echo "report.sh: $name ($((SECONDS - start)) s so far) ..." >&2
    kvcomp record --data "$data" --name "$name" "${quick[@]}" -- "$@" \
        || kvcomp record --data "$data" --name "$name" "${quick[@]}" -- "$@"
}

modes=high-precision,balanced:k3,low-latency:k3
# balanced:k1 beside the default: statistics from a file calibrated on the corpus (`kvcomp calibrate`)
quality=f16,q8_0,q4_0,iq4_nl,kvc8,kvc4,kvc3,$modes,balanced:k1
long=f16,q8_0,q4_0,$modes
speed=f16,q8_0,q4_0,kvc4,$modes

if [ ${#quick[@]} -gt 0 ]; then
    step quality-smollm2-135m-f32-ctx2048 kld --model smollm2-135m-f32 --ctx 2048 --chunks 1 \
        --configs f16,q8_0,q4_0,kvc4,$modes
    step speed-smollm2-135m bench --model smollm2-135m --depths 0,4096 --n-gen 16 --n-prompt 512 --reps 1 \
        --configs f16,q8_0,$modes
else
    step quality-smollm2-135m-f32-ctx2048 kld --model smollm2-135m-f32 --ctx 2048 --chunks 2 --configs "$quality"
    step quality-gemma3-270m-ctx2048 kld --model gemma3-270m --ctx 2048 --chunks 2 --configs "$quality"
    step quality-smollm2-135m-f32-ctx8192 kld --model smollm2-135m-f32 --ctx 8192 --chunks 1 --configs "$quality"
    step quality-gemma3-270m-ctx8192 kld --model gemma3-270m --ctx 8192 --chunks 1 --configs "$quality"
    for ctx in 16384 32768; do
        step long-gemma3-270m-ctx$ctx kld --model gemma3-270m --ctx $ctx --chunks 1 --configs "$long"
        step needle-gemma3-270m-ctx$ctx needle --model gemma3-270m --ctx $ctx --configs "$long"
    done
    step speed-smollm2-135m bench --model smollm2-135m --depths 0,4096 --n-gen 32 --n-prompt 512 --reps 2 \
        --configs "$speed"
    # a fill of 16384 tokens per repetition: f16 and the modes only (upstream's quantized caches
    # fill at a fifth of f16's speed at depth)
    step speed-smollm2-135m-d16384 bench --model smollm2-135m --depths 16384 --n-gen 32 --reps 1 \
        --configs f16,kvc4,$modes
    step parallel-synth-kv8x128 bench --model synth-kv8x128 --parallel 8 --depths 4096 --n-gen 32 --configs "$speed"
    # the kvct decoders of CPUs without VBMI, in builds for their level on this machine (q4_0
    # and the other models where the time allows: upstream's quantized caches fill slowly)
    isa_speed=(bench --depths 0,4096 --n-gen 32 --n-prompt 512 --rounds 2)
    if grep -qw avx2 /proc/cpuinfo; then
        KVCOMP_BIN_DIR=$(scripts/build-isa.sh avx2) step speed-avx2-smollm2-135m "${isa_speed[@]}" \
            --model smollm2-135m --configs f16,q8_0,q4_0,balanced:k3,low-latency:k3
        for model in synth-kv8x128 gemma3-270m; do
            KVCOMP_BIN_DIR=$(scripts/build-isa.sh avx2) step speed-avx2-$model "${isa_speed[@]}" \
                --model $model --configs f16,q8_0,balanced:k3,low-latency:k3
        done
    fi
    if grep -qw avx512f /proc/cpuinfo; then
        KVCOMP_BIN_DIR=$(scripts/build-isa.sh avx512) step speed-avx512-smollm2-135m "${isa_speed[@]}" \
            --model smollm2-135m --configs f16,q8_0,q4_0,balanced:k3,low-latency:k3
    fi
fi
kvcomp report --data "$data" --results docs/results.md --readme README.md
echo "report.sh: done in $((SECONDS - start)) s" >&2
