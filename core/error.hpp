#pragma once
// Typed errors. Inside tutti everything throws one of these; the C API boundary turns them into
// ncclResult_t plus ncclGetLastError() text, and nothing throws across it.
//
// Messages carry their context (rank, peer, collective, step, argument) because the reader of an
// error is usually looking at one rank's log out of many.

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tutti {

enum class ErrorKind {
  kInvalidArgument,  // the caller passed something wrong
  kInvalidUsage,     // the call is not allowed in this state (freed communicator, bad order)
  kSystem,           // an OS call failed
  kRemote,           // a peer failed, left or sent something malformed
  kTimeout,          // a wait exceeded its deadline
  kAborted,          // the communicator was aborted while the call waited
  kInternal,         // a bug in tutti
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

#define TUTTI_DEFINE_ERROR(Name, Kind) \
  class Name : public Error {          \
   public:                             \
    explicit Name(const std::string& what) : Error(ErrorKind::Kind, what) {} \
  };
TUTTI_DEFINE_ERROR(InvalidArgument, kInvalidArgument)
TUTTI_DEFINE_ERROR(InvalidUsage, kInvalidUsage)
TUTTI_DEFINE_ERROR(RemoteError, kRemote)
TUTTI_DEFINE_ERROR(Timeout, kTimeout)
TUTTI_DEFINE_ERROR(Aborted, kAborted)
TUTTI_DEFINE_ERROR(InternalError, kInternal)
#undef TUTTI_DEFINE_ERROR

// An OS call failed; the message ends with strerror(err).
class SystemError : public Error {
 public:
  SystemError(const std::string& what, int err);
  int code() const { return code_; }

 private:
  int code_;
};

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
