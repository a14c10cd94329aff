#pragma once
// Deadlines for blocking waits. Every wait in tutti takes one, so "every blocking wait honours a
// timeout" is a property of the types rather than of each call site.

#include <algorithm>
#include <chrono>

namespace tutti {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  // seconds <= 0 means no deadline.
  static Deadline after(double seconds) {
    Deadline d;
    if (seconds > 0) {
      d.infinite_ = false;
      d.at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    }
    return d;
  }
  static Deadline never() { return Deadline(); }
  bool infinite() const { return infinite_; }
  bool expired() const { return !infinite_ && Clock::now() >= at_; }
  // Milliseconds until the deadline, capped at cap_ms (also the answer when infinite).
  int ms_left(int cap_ms) const {
    if (infinite_) return cap_ms;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(left, 0, cap_ms));
  }

 private:
  bool infinite_ = true;
  Clock::time_point at_{};
};

}  // namespace tutti
