#!/usr/bin/env bash
# What a decode step sends to two local ggml-rpc-servers, command by command: the
# servers log every command with GGML_RPC_DEBUG=1; a llama-bench run of 48
# generated tokens minus one of 16 at depth D (default 1024), over 32. Usage:
#   scripts/rpc-commands.sh "-ctk kvc4 -ctv kvc3 --kv-comp balanced"
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
B=$root/build/bin
M=${KVCOMP_MODEL:-$HOME/.cache/kvcomp/models/smollm2-135m.gguf}
D=${D:-1024}
kv=$1
logs=$(mktemp -d)
run() {
    GGML_RPC_DEBUG=1 "$B/ggml-rpc-server" -H 127.0.0.1 -p 50131 -t 2 >"$logs/s1.log" 2>&1 & P1=$!
    GGML_RPC_DEBUG=1 "$B/ggml-rpc-server" -H 127.0.0.1 -p 50132 -t 2 >"$logs/s2.log" 2>&1 & P2=$!
    sleep 1
    # shellcheck disable=SC2086
    "$B/llama-bench" -m "$M" -fa 1 -t 2 -p 0 -n "$1" -d "$D" -r 1 $kv -rpc 127.0.0.1:50131,127.0.0.1:50132 -ngl 99 >/dev/null 2>&1
    kill "$P1" "$P2"; wait "$P1" "$P2" 2>/dev/null
    cat "$logs/s1.log" "$logs/s2.log" >"$logs/n$1.log"
}
run 16; run 48
python3 - "$logs/n16.log" "$logs/n48.log" <<'PY'
import collections, re, sys
def tally(path):
    size, count = collections.Counter(), collections.Counter()
    for line in open(path, errors="replace"):
        m = re.match(r"\[(\w+)\]", line)
        if not m:
            continue
        count[m.group(1)] += 1
        s = re.search(r"size: (\d+)", line)
        if s and m.group(1) in ("set_tensor", "get_tensor", "set_tensor_hash"):
            size[m.group(1)] += int(s.group(1))
    return size, count
s16, c16 = tally(sys.argv[1]); s48, c48 = tally(sys.argv[2])
for k in sorted(c48):
    n = (c48[k] - c16[k]) / 32
    if n:
        print(f"{k:>20}: {(s48[k] - s16[k]) / 32 / 1024:8.1f} KiB/step {n:6.1f} commands/step")
PY
rm -rf "$logs"
