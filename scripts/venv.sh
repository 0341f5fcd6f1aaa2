#!/usr/bin/env bash
# The project's virtualenv (KVCOMP_VENV, default .venv): made or refreshed when pyproject.toml
# is newer, with the package (editable) and its test and report tools; prints its path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=${KVCOMP_VENV:-$root/.venv}
if [ ! -x "$venv/bin/pytest" ] || [ pyproject.toml -nt "$venv/bin/pytest" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --upgrade pip >&2
    # llama-cpp-python without its own native build: it loads ours (python/README.md)
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install --quiet -e '.[test]' >&2
    touch "$venv/bin/pytest"
fi
echo "$venv"
