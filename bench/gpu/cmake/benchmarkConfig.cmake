# Google Benchmark as carried by bench/gpu/run.sh (<carry>/deps): its headers in ../include and
# its library in ../../lib (libbenchmark.a where one was found, else the shared library the
# carried bench_gpu loads). Copied into the carry folder; a rebuild on the GPU machine passes
# -Dbenchmark_DIR=<carry>/deps/cmake.
if(NOT TARGET benchmark::benchmark)
  get_filename_component(_weave_deps "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
  get_filename_component(_weave_lib "${CMAKE_CURRENT_LIST_DIR}/../../lib" ABSOLUTE)
  find_package(Threads REQUIRED)
  if(EXISTS "${_weave_lib}/libbenchmark.a")
    add_library(benchmark::benchmark STATIC IMPORTED)
    set_target_properties(benchmark::benchmark PROPERTIES
      IMPORTED_LOCATION "${_weave_lib}/libbenchmark.a"
      INTERFACE_COMPILE_DEFINITIONS BENCHMARK_STATIC_DEFINE)
  else()
    file(GLOB _weave_shared "${_weave_lib}/libbenchmark.so*")
    if(NOT _weave_shared)
      set(benchmark_FOUND FALSE)
      set(benchmark_NOT_FOUND_MESSAGE "no libbenchmark in ${_weave_lib}")
      return()
    endif()
    list(GET _weave_shared 0 _weave_shared)
    add_library(benchmark::benchmark SHARED IMPORTED)
    set_target_properties(benchmark::benchmark PROPERTIES IMPORTED_LOCATION "${_weave_shared}")
    unset(_weave_shared)
  endif()
  set_target_properties(benchmark::benchmark PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_weave_deps}/include"
    INTERFACE_LINK_LIBRARIES Threads::Threads)
  unset(_weave_deps)
  unset(_weave_lib)
endif()
set(benchmark_FOUND TRUE)
