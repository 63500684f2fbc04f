//! \file
//! MPI error checking (component `weave::mpi`).
//!
//! MPI's default handler aborts the job; weave's MPI communicator installs
//! `MPI_ERRORS_RETURN` on the communicators it wraps so that failures arrive here instead.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <mpi.h>

#include <string>

WEAVE_NAMESPACE_BEGIN

//! MPI's text for an error code.
inline std::string mpi_error_string(int status) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS)
    return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(length));
}

//! Throws `errc::mpi` naming the failed call and MPI's description unless `status` is success.
inline void mpi_check(int status, const char* call,
                      source_location where = source_location::current()) {
  if (WEAVE_LIKELY(status == MPI_SUCCESS))
    return;
  detail::raise(errc::mpi,
                detail::concat(call, " failed (", status, "): ", mpi_error_string(status)), where);
}

WEAVE_NAMESPACE_END

//! Checks an MPI call, naming it in the error.
#define WEAVE_MPI_CHECK(call) ::weave::mpi_check((call), #call)
