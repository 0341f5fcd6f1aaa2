#!/usr/bin/env bash
# The test command: builds (reusing the cached build), compiles the CUDA sources (no GPU
# needed, scripts/cuda-compile.sh), prepares a virtualenv with the test tools, then runs lint,
# type checks and the pytest suite, which also runs the C++ tests; last, pip-installs the clone
# into a fresh virtualenv and runs the Python API tests there (scripts/wheel-check.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=$(scripts/venv.sh)

log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/build.log
mkdir -p "$(dirname "$log")"
echo "building (log: $log) ..."
scripts/build.sh >"$log" 2>&1 || { tail -n 60 "$log"; echo "build failed, see $log" >&2; exit 1; }
cuda_log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/cuda-compile.log
echo "compiling the CUDA kernels and hooks, no GPU needed (log: $cuda_log) ..."
scripts/cuda-compile.sh >"$cuda_log" 2>&1 || { tail -n 60 "$cuda_log"; echo "CUDA compile failed, see $cuda_log" >&2; exit 1; }
tail -n 1 "$cuda_log"
"$venv/bin/ruff" check ggml_kvcomp tests scripts
"$venv/bin/mypy"
"$venv/bin/pytest" -v "$@"
wheel_log=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}/wheel-check.log
echo "pip-installing the clone into a fresh virtualenv and testing it (log: $wheel_log) ..."
scripts/wheel-check.sh -q >"$wheel_log" 2>&1 || { tail -n 60 "$wheel_log"; echo "wheel check failed, see $wheel_log" >&2; exit 1; }
tail -n 1 "$wheel_log"
