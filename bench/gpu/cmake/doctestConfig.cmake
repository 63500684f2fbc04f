# doctest as carried by bench/gpu/run.sh (<carry>/deps): its headers in ../include and its CMake
# scripts (doctest.cmake, doctestAddTests.cmake) beside this file. Copied into the carry folder;
# a rebuild on the GPU machine passes -Ddoctest_DIR=<carry>/deps/cmake.
if(NOT TARGET doctest::doctest)
  list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
  get_filename_component(_weave_deps "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
  add_library(doctest::doctest INTERFACE IMPORTED)
  set_target_properties(doctest::doctest PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_weave_deps}/include")
  unset(_weave_deps)
endif()
set(doctest_FOUND TRUE)
