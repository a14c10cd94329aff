#pragma once
// Typed errors. Inside tutti everything throws one of these; the C API boundary turns them into
// ncclResult_t plus ncclGetLastError() text, and nothing throws across it.
//
// Messages carry their context (rank, peer, collective, step, argument) because the reader of an
// error is usually looking at one rank's log out of many.

#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "tutti/types.hpp"

namespace tutti {

// ErrorKind, Error and its kinds are public: include/tutti/types.hpp.

// Throws SystemError with the current errno, the failed call and the given context.
[[noreturn]] void throw_system_error(const std::string& what);

// Rethrows an Error of the same kind with `prefix: ` in front of its message.
[[noreturn]] void rethrow_with_context(const Error& e, const std::string& prefix);

}  // namespace tutti

// TUTTI_CHECK(cond, Type, "fmt", args...): throws Type with the formatted message when cond fails.
// Like Gloo's GLOO_ENFORCE, but the caller picks the error type so callers can react to it.
#define TUTTI_CHECK(cond, Type, ...)                 \
  do {                                               \
    if (!(cond)) throw Type(fmt::format(__VA_ARGS__)); \
  } while (0)

// Checks a POSIX call returning -1 on failure; the message names the call and the context.
#define TUTTI_SYSCALL(call, ...)                                                   \
  ([&] {                                                                           \
    auto tutti_rc_ = (call);                                                       \
    if (tutti_rc_ == -1) ::tutti::throw_system_error(fmt::format(__VA_ARGS__));   \
    return tutti_rc_;                                                              \
  }())
