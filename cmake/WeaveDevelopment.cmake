# Settings and helpers for weave's own tests, benchmarks and examples (never for consumers).
option(WEAVE_WERROR "Treat warnings in weave's own targets as errors" OFF)
option(WEAVE_CLUSTER_TESTS
  "Run the MPI tests across an emulated cluster too (tests/cluster/weave-cluster, as root)" OFF)
# The `cuda` preset builds only what needs nvcc, NCCL or a GPU; the host build covers the rest.
option(WEAVE_CUDA_TARGETS_ONLY "Build only CUDA/NCCL tests, benchmarks and header checks" OFF)

add_library(weave_dev_flags INTERFACE)
target_compile_options(weave_dev_flags INTERFACE
  $<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor>
  $<$<AND:$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>,$<BOOL:${WEAVE_WERROR}>>:-Werror>
  # GCC 12 reports false -Wrestrict positives inside libstdc++'s string code at -O3 (PR 105651).
  $<$<COMPILE_LANG_AND_ID:CXX,GNU>:-Wno-restrict>
  # The tests compare host code bitwise with device code that rounds every multiply and add
  # separately; GCC contracts a * b + c into an FMA by default where the target has one (aarch64
  # hosts such as Grace, or -mfma), so host code is built without contraction (but for targets
  # that check the compiler's default, WEAVE_DEFAULT_FP_CONTRACT).
  $<$<AND:$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>,$<NOT:$<BOOL:$<TARGET_PROPERTY:WEAVE_DEFAULT_FP_CONTRACT>>>>:-ffp-contract=off>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-ffp-contract=off>)

# CUDA sources of tests and benchmarks need the CUDA language; consumers of weave::cuda do not.
set(WEAVE_CUDA_LANGUAGE OFF)
if(TARGET weave_cuda)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90) # Hopper (H100/H200); override on the command line
    endif()
    enable_language(CUDA)
    # CMake 3.25 has no CUDA20 dialect entry for nvcc; pass the flag directly.
    string(APPEND CMAKE_CUDA_FLAGS " -std=c++20 --expt-relaxed-constexpr")
    set(WEAVE_CUDA_LANGUAGE ON)
  elseif(WEAVE_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WEAVE_ENABLE_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()

if(WEAVE_ENABLE_TESTING)
  find_package(doctest QUIET)
  if(NOT doctest_FOUND)
    message(FATAL_ERROR "weave's tests need doctest (Debian: doctest-dev), "
                        "or configure with -DWEAVE_ENABLE_TESTING=OFF")
  endif()
  include(doctest)
endif()

# MPI launcher settings shared by tests, benchmarks and examples run under mpirun.
if(TARGET weave_mpi)
  set(WEAVE_MPIEXEC_FLAGS --oversubscribe)
  # Open MPI refuses root unless asked; containers and CI run as root.
  set(WEAVE_MPI_ENVIRONMENT
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
    OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
    # Under ASan: keep Open MPI's plugins loaded and unwind fully at malloc, so its
    # process-lifetime allocations name their libraries and the suppressions match them.
    OMPI_MCA_mca_base_component_disable_dlclose=1
    "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/support/lsan.supp:fast_unwind_on_malloc=0")
endif()

# weave_add_test(<name> SOURCES <files...> [LIBS <targets...>] [LABELS <labels...>])
# A doctest executable; each test case becomes one CTest test named <name>/<case>.
function(weave_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  if(WEAVE_CUDA_TARGETS_ONLY)
    return()
  endif()
  # CTest's discovery splits a case name at ';' into names that match no case, so such a case
  # would silently never run.
  foreach(source IN LISTS ARG_SOURCES)
    file(STRINGS "${source}" cases REGEX "TEST_CASE\\(\"[^\"]*;")
    if(cases)
      message(FATAL_ERROR "${name}: a test case name in ${source} contains ';', which CTest "
                          "discovery cannot run: ${cases}")
    endif()
  endforeach()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE weave_test_main weave_dev_flags ${ARG_LIBS})
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/tests/support")
  doctest_discover_tests(${name} TEST_PREFIX "${name}/" PROPERTIES TIMEOUT 300)
  # Discovered tests cannot take a list-valued property; the directory's LABELS apply to them.
  set_property(DIRECTORY APPEND PROPERTY LABELS ${ARG_LABELS})
endfunction()

# weave_add_mpi_test(<name> SOURCES <files...> NP <counts...> [LIBS ...] [LABELS ...])
# A doctest executable run under mpirun once per process count, as CTest test <name>/np<N>.
function(weave_add_mpi_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;NP;LIBS;LABELS" ${ARGN})
  if(NOT TARGET weave_mpi OR WEAVE_CUDA_TARGETS_ONLY)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE weave_test_main weave_dev_flags weave_mpi ${ARG_LIBS})
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/tests/support")
  foreach(np IN LISTS ARG_NP)
    add_test(NAME ${name}/np${np}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${WEAVE_MPIEXEC_FLAGS}
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${name}/np${np} PROPERTIES
      LABELS "mpi;${ARG_LABELS}" TIMEOUT 300 PROCESSORS ${np}
      ENVIRONMENT "${WEAVE_MPI_ENVIRONMENT}")
  endforeach()
endfunction()

# weave_add_cuda_test(<name> SOURCES <files...> [LIBS ...])
# A doctest executable with CUDA sources. Without a GPU it prints "skipped: no GPU" and exits
# 77, which CTest reports as skipped (never as passed).
function(weave_add_cuda_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT WEAVE_CUDA_LANGUAGE)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE weave_cuda_test_main weave_dev_flags weave_cuda ${ARG_LIBS})
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/tests/support")
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "cuda;${ARG_LABELS}" TIMEOUT 300
    SKIP_RETURN_CODE 77)
endfunction()

# The command-line helper of the examples, tools and benchmark drivers (examples/support):
# typed, range-checked options and a main wrapper (see command_line.hpp).
add_library(weave_command_line INTERFACE)
target_include_directories(weave_command_line INTERFACE "${PROJECT_SOURCE_DIR}/examples/support")
target_compile_features(weave_command_line INTERFACE cxx_std_20)

# weave_add_bad_option_tests(<target> <program name> CASE <option> <args...> [CASE ...])
# One test per CASE: running <target> with <args...> must exit with status 2, print nothing
# on stdout and exactly one line on stderr, "<program name>: ...", that names <option>
# (cmake/check_bad_option.cmake). A crash, an abort or an escaped exception fails the test.
function(weave_add_bad_option_tests target program)
  if(NOT WEAVE_ENABLE_TESTING OR NOT TARGET ${target})
    return()
  endif()
  set(args "")
  set(index 0)
  # Appends a sentinel CASE so the last case is flushed like the others.
  foreach(word IN LISTS ARGN ITEMS CASE)
    if(word STREQUAL "CASE")
      list(LENGTH args words)
      if(words GREATER 0)
        list(POP_FRONT args option)
        math(EXPR index "${index} + 1")
        add_test(NAME options/${target}/${index}
          COMMAND ${CMAKE_COMMAND} -DPROGRAM=$<TARGET_FILE:${target}> -DNAME=${program}
                  -DOPTION=${option} -P "${PROJECT_SOURCE_DIR}/cmake/check_bad_option.cmake"
                  -- ${args})
        set_tests_properties(options/${target}/${index} PROPERTIES LABELS "options" TIMEOUT 60)
      endif()
      set(args "")
    else()
      list(APPEND args "${word}")
    endif()
  endforeach()
endfunction()
