# Sourced by the scripts that build the clone (build.sh, wheel-check.sh, cuda-build.sh,
# cuda-compile.sh). Needs $root (the clone) and $cache ($KVCOMP_CACHE).
#   kvcomp_build_dir NAME -> sets sdist (the patched upstream tree) and build, the build folder
#                            $cache/NAME-<key> of this pin and patch series
#   kvcomp_adopt_build    -> a build folder configured from another clone is configured again
#                            here (ccache keeps the objects)
#   kvcomp_ccache         -> exports the ccache settings that let every clone share its objects
#   kvcomp_other_clone DIR -> true when DIR was configured from another clone than $root
#   kvcomp_configure ARGS -> makes $build (fresh or from another clone: configured here, with
#                            ninja where there is one, Release, and ARGS), then exports ccache's
#                            settings

kvcomp_build_dir() {
    sdist=$(python3 "$root/scripts/prepare_upstream.py")
    local key
    key=$(basename "$(dirname "$sdist")")
    build="$cache/$1-${key#upstream-}"
}

kvcomp_other_clone() {
    [ -f "$1/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$1/CMakeCache.txt"
}

kvcomp_adopt_build() {
    if kvcomp_other_clone "$build"; then
        rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
    fi
}

kvcomp_ccache() {
    export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache}
    export CCACHE_BASEDIR=$root
    export CCACHE_NOHASHDIR=1
}

kvcomp_configure() {
    mkdir -p "$build"
    kvcomp_adopt_build
    kvcomp_ccache
    local generator=()
    if command -v ninja >/dev/null 2>&1; then
        generator=(-G Ninja)
    fi
    if [ ! -f "$build/CMakeCache.txt" ]; then
        cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVCOMP_UPSTREAM_DIR="$sdist" "$@" >&2
    fi
}
