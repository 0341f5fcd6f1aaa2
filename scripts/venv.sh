#!/usr/bin/env bash
# The project's virtualenv (KVCOMP_VENV, default .venv): made anew when pyproject.toml is
# newer, with the package (editable) and its test and report tools; prints its path. The
# package is installed without its native build (KVCOMP_NATIVE=OFF, python/README.md): it runs
# scripts/build.sh's library from build/bin.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=${KVCOMP_VENV:-$root/.venv}
if [ ! -x "$venv/bin/pytest" ] || [ pyproject.toml -nt "$venv/bin/pytest" ]; then
    # --clear: a venv made before may hold a llama-cpp-python whose llama_cpp files ours replace
    python3 -m venv --clear "$venv" >&2
    "$venv/bin/pip" install --quiet --upgrade pip >&2
    "$venv/bin/pip" install --quiet --config-settings=cmake.define.KVCOMP_NATIVE=OFF -e '.[test]' >&2
    touch "$venv/bin/pytest"
fi
echo "$venv"
