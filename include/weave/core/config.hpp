//! \file
//! Versioning, namespace macros and portability attributes shared by every weave header.
#pragma once

#define WEAVE_VERSION_MAJOR 0
#define WEAVE_VERSION_MINOR 1
#define WEAVE_VERSION_PATCH 0
//! Single integer for preprocessor comparisons: major * 10000 + minor * 100 + patch.
#define WEAVE_VERSION                                                                              \
  (WEAVE_VERSION_MAJOR * 10000 + WEAVE_VERSION_MINOR * 100 + WEAVE_VERSION_PATCH)

// The inline ABI namespace lets two incompatible weave versions link into one program
// (a trainer and a vendored plugin, say) without ODR clashes.
#define WEAVE_NAMESPACE_BEGIN                                                                      \
  namespace weave {                                                                                \
  inline namespace v0 {
#define WEAVE_NAMESPACE_END                                                                        \
  }                                                                                                \
  }

#if defined(__CUDACC__) || defined(__HIPCC__)
#define WEAVE_HOST_DEVICE __host__ __device__
#define WEAVE_DEVICE __device__
#else
#define WEAVE_HOST_DEVICE
#define WEAVE_DEVICE
#endif

#if defined(__GNUC__) || defined(__clang__)
#define WEAVE_LIKELY(x) __builtin_expect(!!(x), 1)
#define WEAVE_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define WEAVE_LIKELY(x) (x)
#define WEAVE_UNLIKELY(x) (x)
#endif

#if __cplusplus < 202002L && !defined(_MSVC_LANG)
#error "weave requires C++20"
#endif
