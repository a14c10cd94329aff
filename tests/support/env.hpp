#pragma once
// Sets environment variables for a scope and restores them when it ends, however it ends: a test that
// fails an ASSERT (which returns early) or throws must not leak its settings into the tests after it.

#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tutti::test_support {

class ScopedEnv {
 public:
  ScopedEnv() = default;
  // A nullptr value unsets the variable.
  explicit ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) set(name, value);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) setenv(it->first.c_str(), it->second->c_str(), 1);
      else unsetenv(it->first.c_str());
    }
  }

  // A nullptr value unsets the variable. Only the value before the first set of a name is kept, so
  // a test can change a variable midway and still get the original back.
  void set(const char* name, const char* value) {
    bool seen = false;
    for (const auto& s : saved_) seen = seen || s.first == name;
    if (!seen) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    }
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace tutti::test_support
