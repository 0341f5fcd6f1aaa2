# What a pip wheel holds (pyproject.toml builds target kvcomp-wheel and installs component
# kvcomp only, so upstream's own install rules stay out): the pinned sdist's llama_cpp
# package, and in its lib folder, where llama_cpp loads libllama from, every shared library
# of this build and the tools, found through an $ORIGIN rpath (python/README.md).

option(KVCOMP_NATIVE "kvcomp: build the libraries and tools into the wheel; OFF: Python packages only" ON)

add_custom_target(kvcomp-wheel)

# the bindings come from the same prepared tree as libllama, so the two always match
install(DIRECTORY ${KVCOMP_SDIST_DIR}/llama_cpp DESTINATION . COMPONENT kvcomp PATTERN __pycache__ EXCLUDE)

set(KVCOMP_WHEEL_TOOLS llama-server llama-cli llama-perplexity llama-bench llama-batched-bench llama-quantize
    llama-kvcomp-calibrate llama-kvcomp-steps llama-kvcomp-rows llama-kvcomp-ksim ggml-rpc-server)

# shared and module libraries below `dir`: whichever ggml backends CMAKE_ARGS turned on
function(kvcomp_shared_libraries out dir)
    set(found)
    get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
    foreach(t IN LISTS targets)
        get_target_property(type ${t} TYPE)
        if (type STREQUAL "SHARED_LIBRARY" OR type STREQUAL "MODULE_LIBRARY")
            list(APPEND found ${t})
        endif()
    endforeach()
    get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
    foreach(sub IN LISTS subdirs)
        kvcomp_shared_libraries(more ${sub})
        list(APPEND found ${more})
    endforeach()
    set(${out} ${found} PARENT_SCOPE)
endfunction()

# deferred to the end of the top-level CMakeLists.txt, when every target exists
function(kvcomp_wheel_native)
    kvcomp_shared_libraries(libs ${CMAKE_SOURCE_DIR})
    set(targets ${libs})
    foreach(t IN LISTS KVCOMP_WHEEL_TOOLS)
        if (TARGET ${t})
            list(APPEND targets ${t})
        endif()
    endforeach()
    message(STATUS "kvcomp: wheel holds ${targets}")
    add_dependencies(kvcomp-wheel ${targets})
    # one file per library: a wheel holds no symlinks, so libllama.so.0.x would ship three times
    set_property(TARGET ${libs} PROPERTY VERSION)
    set_property(TARGET ${libs} PROPERTY SOVERSION)
    set_target_properties(${targets} PROPERTIES INSTALL_RPATH "$ORIGIN")
    install(TARGETS ${targets} COMPONENT kvcomp
            LIBRARY DESTINATION llama_cpp/lib RUNTIME DESTINATION llama_cpp/lib)
endfunction()

if (KVCOMP_NATIVE)
    cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL kvcomp_wheel_native)
endif()
