# Sourced by the scripts that build the clone (build.sh, wheel-check.sh, cuda-build.sh,
# cuda-compile.sh). Needs $root (the clone) and $cache ($KVCOMP_CACHE).
#   kvcomp_build_dir NAME -> sets sdist (the patched upstream tree) and build, the build folder
#                            $cache/NAME-<key> of this pin and patch series
#   kvcomp_adopt_build    -> a build folder configured from another clone is configured again
#                            here (ccache keeps the objects)
#   kvcomp_ccache         -> exports the ccache settings that let every clone share its objects

kvcomp_build_dir() {
    sdist=$(python3 "$root/scripts/prepare_upstream.py")
    local key
    key=$(basename "$(dirname "$sdist")")
    build="$cache/$1-${key#upstream-}"
}

kvcomp_adopt_build() {
    if [ -f "$build/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$build/CMakeCache.txt"; then
        rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
    fi
}

kvcomp_ccache() {
    export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache}
    export CCACHE_BASEDIR=$root
    export CCACHE_NOHASHDIR=1
}
