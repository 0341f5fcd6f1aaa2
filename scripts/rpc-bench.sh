#!/usr/bin/env bash
# Speed and bytes per decode step over two local ggml-rpc-servers against one process:
# llama-bench at depth D (default 4096) for each configuration
# given as "name|KV flags", e.g.
#   scripts/rpc-bench.sh "f16|-ctk f16 -ctv f16" "balanced|-ctk kvc4 -ctv kvc3 --kv-comp balanced"
# Bytes per step: the loopback interface's bytes over a run of 48 generated tokens minus one
# of 16, over 32. Prints llama-bench's JSON lines prefixed LOCAL/RPC and one BYTES line each.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
B=$root/build/bin
M=${KVCOMP_MODEL:-$HOME/.cache/kvcomp/models/smollm2-135m.gguf}
D=${D:-4096}
p1=50141; p2=50142
lo() { awk '/lo:/{print $2}' /proc/net/dev; }
start() {
    "$B/ggml-rpc-server" -H 127.0.0.1 -p $p1 -t 2 >/dev/null 2>&1 & P1=$!
    "$B/ggml-rpc-server" -H 127.0.0.1 -p $p2 -t 2 >/dev/null 2>&1 & P2=$!
    sleep 1.5
}
stop() { kill -9 "$P1" "$P2" 2>/dev/null; wait "$P1" "$P2" 2>/dev/null; sleep 0.5; }
RPC="-rpc 127.0.0.1:$p1,127.0.0.1:$p2 -ngl 99"
for cfg in "$@"; do
    name=${cfg%%|*}; args=${cfg#*|}
    # shellcheck disable=SC2086
    "$B/llama-bench" -m "$M" -fa 1 -t 2 -p 512 -n 32 -d "$D" -r 1 $args -o jsonl 2>/dev/null | sed "s/^/LOCAL $name /"
    start
    # shellcheck disable=SC2086
    "$B/llama-bench" -m "$M" -fa 1 -t 2 -p 512 -n 32 -d "$D" -r 1 $args $RPC -o jsonl 2>/dev/null | sed "s/^/RPC $name /"
    stop; start
    # shellcheck disable=SC2086
    a=$(lo); "$B/llama-bench" -m "$M" -fa 1 -t 2 -p 0 -n 16 -d "$D" -r 1 $args $RPC >/dev/null 2>&1; b=$(lo)
    stop; start
    # shellcheck disable=SC2086
    c=$(lo); "$B/llama-bench" -m "$M" -fa 1 -t 2 -p 0 -n 48 -d "$D" -r 1 $args $RPC >/dev/null 2>&1; d=$(lo)
    stop
    echo "BYTES $name n16=$((b-a)) n48=$((d-c)) per_step=$(( ((d-c)-(b-a))/32 ))"
done
