#include "core/error.hpp"

#include <cerrno>
#include <cstring>

namespace tutti {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kInvalidUsage: return "invalid usage";
    case ErrorKind::kSystem: return "system error";
    case ErrorKind::kRemote: return "remote error";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kAborted: return "aborted";
    case ErrorKind::kInternal: return "internal error";
  }
  return "unknown error";
}

SystemError::SystemError(const std::string& what, int err)
    : Error(ErrorKind::kSystem, fmt::format("{}: {}", what, std::strerror(err))), code_(err) {}

void throw_system_error(const std::string& what) { throw SystemError(what, errno); }

void rethrow_with_context(const Error& e, const std::string& prefix) {
  std::string msg = fmt::format("{}: {}", prefix, e.what());
  switch (e.kind()) {
    case ErrorKind::kInvalidArgument: throw InvalidArgument(msg);
    case ErrorKind::kInvalidUsage: throw InvalidUsage(msg);
    case ErrorKind::kSystem: throw Error(ErrorKind::kSystem, msg);
    case ErrorKind::kRemote: throw RemoteError(msg);
    case ErrorKind::kTimeout: throw Timeout(msg);
    case ErrorKind::kAborted: throw Aborted(msg);
    case ErrorKind::kInternal: throw InternalError(msg);
  }
  throw InternalError(msg);
}

std::string Error::bounded(const std::string& what) {
  if (what.size() <= kMaxMessage) return what;
  const size_t head = kMaxMessage * 3 / 4, tail = kMaxMessage / 8;
  return what.substr(0, head) + fmt::format(" [... {} bytes cut ...] ", what.size() - head - tail) +
         what.substr(what.size() - tail);
}

}  // namespace tutti
