//! \file
//! The one exception type weave throws, its error codes, and the checking macros.
//!
//! Every failure is a `weave::error` carrying an `errc`, a message that names the offending
//! value, and the source location of the check that failed. Backend wrappers (CUDA, NCCL, MPI)
//! live in their own headers so that this one needs nothing but the standard library.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/source_location.hpp"

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! What went wrong. Stable numeric values: they may be logged or compared across versions.
enum class errc : int {
  invalid_argument = 1, //!< a parameter is outside its documented domain (k > E, NaN logits)
  out_of_range = 2,     //!< an index names something that does not exist (expert id >= E)
  size_overflow = 3,    //!< a size or count does not fit the type a backend needs
  size_mismatch = 4,    //!< two sizes that must agree do not (buffer rows, peer counts)
  not_supported = 5,    //!< the operation is not available for this backend/type/configuration
  invalid_state = 6,    //!< the object is not in a state that allows the call
  timeout = 7,          //!< a peer or a device did not answer in time
  peer_failure = 8,     //!< another rank failed or aborted
  cuda = 9,             //!< the CUDA runtime reported an error
  nccl = 10,            //!< NCCL reported an error
  mpi = 11,             //!< MPI reported an error
  internal = 12,        //!< a weave invariant broke: a bug, please report it
  config_mismatch = 13, //!< ranks built one collective object with different configurations
  call_mismatch = 14,   //!< ranks issued different calls at one collective (call order broken)
  protocol = 15,        //!< a peer sent bytes no weave rank writes (a corrupt or foreign message)
  experts_lost = 16,    //!< a failure took every copy of some experts: the layer cannot serve them
};

//! Short, stable name of an error code ("invalid_argument", ...).
constexpr const char* to_string(errc code) noexcept {
  switch (code) {
  case errc::invalid_argument:
    return "invalid_argument";
  case errc::out_of_range:
    return "out_of_range";
  case errc::size_overflow:
    return "size_overflow";
  case errc::size_mismatch:
    return "size_mismatch";
  case errc::not_supported:
    return "not_supported";
  case errc::invalid_state:
    return "invalid_state";
  case errc::timeout:
    return "timeout";
  case errc::peer_failure:
    return "peer_failure";
  case errc::cuda:
    return "cuda";
  case errc::nccl:
    return "nccl";
  case errc::mpi:
    return "mpi";
  case errc::internal:
    return "internal";
  case errc::config_mismatch:
    return "config_mismatch";
  case errc::call_mismatch:
    return "call_mismatch";
  case errc::protocol:
    return "protocol";
  case errc::experts_lost:
    return "experts_lost";
  }
  return "unknown";
}

namespace detail {

//! True when `value` is the number of an `errc`: what a code read from a peer's bytes must be.
WEAVE_HOST_DEVICE constexpr bool is_errc(std::int64_t value) noexcept {
  return value >= static_cast<std::int64_t>(errc::invalid_argument) &&
         value <= static_cast<std::int64_t>(errc::experts_lost);
}

} // namespace detail

//! `std::error_category` for `errc`, so weave errors compose with `std::error_code`.
inline const std::error_category& weave_category() noexcept {
  struct category final : std::error_category {
    const char* name() const noexcept override { return "weave"; }
    std::string message(int value) const override { return to_string(static_cast<errc>(value)); }
  };
  static const category instance;
  return instance;
}

inline std::error_code make_error_code(errc code) noexcept {
  return {static_cast<int>(code), weave_category()};
}

//! The exception weave throws. `what()` reads "weave <code>: <message> (<file>:<line>)".
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message, source_location where = source_location::current())
      : std::runtime_error(format(code, message, where))
      , code_(code)
      , where_(where)
      , message_(message) {}

  //! The error code.
  errc code() const noexcept { return code_; }
  //! The check that failed.
  const source_location& where() const noexcept { return where_; }
  //! The message alone, without code and location.
  const std::string& message() const noexcept { return message_; }

 private:
  static std::string format(errc code, const std::string& message, source_location where) {
    std::ostringstream out;
    out << "weave " << to_string(code) << ": " << message << " (" << where.file_name() << ':'
        << where.line() << ')';
    return out.str();
  }

  errc code_;
  source_location where_;
  std::string message_;
};

namespace detail {

//! Streams every argument into one string; used to build messages that name values.
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] inline void raise(errc code, std::string message, source_location where) {
  throw error(code, message, where);
}

} // namespace detail

WEAVE_NAMESPACE_END

//! \cond
template <>
struct std::is_error_code_enum<weave::errc> : std::true_type {};
//! \endcond

//! Throws `weave::error(code, message)` where the message is the concatenation of the arguments.
#define WEAVE_THROW(code, ...)                                                                     \
  ::weave::detail::raise((code), ::weave::detail::concat(__VA_ARGS__),                             \
                         ::weave::source_location::current())

//! Throws `weave::error(code, ...)` unless `cond` holds. The message arguments are evaluated
//! only on failure, so naming values in them costs nothing on the good path.
#define WEAVE_EXPECT(cond, code, ...)                                                              \
  do {                                                                                             \
    if (WEAVE_UNLIKELY(!(cond)))                                                                   \
      WEAVE_THROW(code, __VA_ARGS__);                                                              \
  } while (false)
