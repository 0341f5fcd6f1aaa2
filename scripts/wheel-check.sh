#!/usr/bin/env bash
# pip-installs this clone into a fresh virtualenv (the wheel's own native build, python/README.md)
# and runs the Python API tests against that install, with no KVCOMP_BIN_DIR and no checkout on
# sys.path. The wheel's build folder lives beside scripts/build.sh's in $KVCOMP_CACHE, so it is
# kept between runs and a first build takes its objects from the same ccache.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache=${KVCOMP_CACHE:-$HOME/.cache/kvcomp}

# shellcheck source=scripts/build-env.sh
source "$root/scripts/build-env.sh"
kvcomp_build_dir wheel
kvcomp_adopt_build

# the same ccache settings as scripts/build.sh, its compilers (CMake's default cc and c++, where
# scikit-build-core would name gcc and g++) and a folder at the same depth, so that the compiler
# command lines match its objects
export CC=${CC:-cc} CXX=${CXX:-c++}
kvcomp_ccache
export CMAKE_BUILD_PARALLEL_LEVEL=${KVCOMP_JOBS:-2}
unset KVCOMP_BIN_DIR LLAMA_CPP_LIB_PATH MTMD_CPP_LIB

venv="$cache/wheel-venv"
python3 -m venv --clear "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet --config-settings=build-dir="$build" "$root[test]"

# --import-mode=importlib keeps the clone off sys.path: ggml_kvcomp comes from the install
"$venv/bin/pytest" -p no:cacheprovider --import-mode=importlib tests/test_wheel.py tests/test_python_api.py "$@"
