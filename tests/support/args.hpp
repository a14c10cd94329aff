#pragma once
// Flag values of the test programs (tutti-storm, tutti-fault-rank): a whole number of at least
// `lowest`, or a message naming the flag and the value, never a silent zero from atoi.

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>

namespace tutti::test_support {

inline std::optional<long long> whole_flag(const char* program, const char* flag, const char* text, long long lowest) {
  char* end = nullptr;
  errno = 0;
  const long long v = text ? std::strtoll(text, &end, 10) : 0;
  if (!text || end == text || *end != '\0' || errno != 0 || v < lowest) {
    std::fprintf(stderr, "%s: %s: '%s' is not a whole number of at least %lld\n", program, flag, text ? text : "",
                 lowest);
    return std::nullopt;
  }
  return v;
}

}  // namespace tutti::test_support
