#pragma once
// The vocabulary every tutti API shares: element types, reduction operators and errors. Public and
// self-contained (standard headers only); the library's own code uses these same definitions.

#include <stdexcept>
#include <string>

namespace tutti {

// Element types; the numbers equal NCCL's ncclDataType_t.
enum class DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
  kFp8E4M3 = 10,
  kFp8E5M2 = 11,
};
inline constexpr int kNumDataTypes = 12;

// Reduction operators; the numbers equal NCCL's ncclRedOp_t.
enum class RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,        // sum, then divided by the number of contributions
  kPreMulSum = 5,  // each contribution multiplied by a scalar, then summed
};
inline constexpr int kNumRedOps = 6;

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

// Everything tutti throws. Messages carry their context (rank, peer, collective, step, argument),
// because the reader of an error is usually looking at one rank's log out of many.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(bounded(what)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  // Messages longer than kMaxMessage keep their start and end and say how much was cut: an error
  // that quotes a caller's input (a 100 KB string) must not become the input.
  static constexpr size_t kMaxMessage = 4096;
  static std::string bounded(const std::string& what);

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

}  // namespace tutti
