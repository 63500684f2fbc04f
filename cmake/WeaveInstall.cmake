# Install rules and the CMake package (find_package(weave CONFIG [COMPONENTS cuda nccl mpi])).
set(WEAVE_CONFIG_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/weave")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS weave EXPORT weaveTargets)
install(EXPORT weaveTargets NAMESPACE weave:: DESTINATION "${WEAVE_CONFIG_DIR}")

# One export set per component, so a consumer that does not ask for CUDA never needs it.
foreach(component IN LISTS WEAVE_COMPONENTS)
  install(TARGETS weave_${component} EXPORT weave_${component}Targets)
  install(EXPORT weave_${component}Targets NAMESPACE weave:: DESTINATION "${WEAVE_CONFIG_DIR}")
endforeach()

configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/weaveConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/weaveConfig.cmake"
  INSTALL_DESTINATION "${WEAVE_CONFIG_DIR}")
# Header-only: any architecture may use the package.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES
  "${PROJECT_BINARY_DIR}/weaveConfig.cmake"
  "${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake"
  "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
  DESTINATION "${WEAVE_CONFIG_DIR}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/weave")
