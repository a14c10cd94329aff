#pragma once
// The text of the tutti::Error a call throws ("" when it throws none): what tests match messages on.

#include <functional>
#include <string>

#include "tutti/types.hpp"

namespace tutti::test_support {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace tutti::test_support
