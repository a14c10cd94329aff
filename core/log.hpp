#pragma once
// fmt-based logging with NCCL's levels and subsystems, so NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
// means what NCCL users expect. Lines look like NCCL's: "host:pid:tid [rank] TUTTI INFO message".
// The level check is one relaxed atomic load, so disabled logging costs nothing on hot paths.

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace tutti::log {

enum class Level : int { kNone = 0, kVersion = 1, kWarn = 2, kInfo = 3, kAbort = 4, kTrace = 5 };

enum Subsys : uint32_t {
  kInit = 1u << 0,
  kColl = 1u << 1,
  kP2P = 1u << 2,
  kShm = 1u << 3,
  kNet = 1u << 4,
  kGraph = 1u << 5,
  kTuning = 1u << 6,
  kEnv = 1u << 7,
  kAlloc = 1u << 8,
  kCall = 1u << 9,
  kBootstrap = 1u << 10,
  kAll = ~0u,
};

struct Settings {
  Level level;
  uint32_t subsys;
};

// Parses TUTTI_DEBUG/NCCL_DEBUG and the subsystem list (exposed for tests).
Level parse_level(std::string_view text);
uint32_t parse_subsys(std::string_view text);

// Current settings, read from the environment on first use.
const Settings& settings();
// Re-reads the environment (tests change it).
void reload();

inline bool enabled(Level level, uint32_t subsys) {
  const Settings& s = settings();
  if (static_cast<int>(level) > static_cast<int>(s.level)) return false;
  // WARN and VERSION are never filtered by subsystem, as in NCCL.
  return level <= Level::kWarn || (s.subsys & subsys) != 0;
}

// The rank shown in this thread's log lines (-1: none). Communicators set it around their calls.
void set_thread_rank(int rank);
int thread_rank();

void write(Level level, uint32_t subsys, const std::string& message);

}  // namespace tutti::log

#define TUTTI_LOG(level, subsys, ...)                                                        \
  do {                                                                                        \
    if (::tutti::log::enabled(::tutti::log::Level::level, (subsys)))                          \
      ::tutti::log::write(::tutti::log::Level::level, (subsys), fmt::format(__VA_ARGS__));    \
  } while (0)
#define TUTTI_WARN(...) TUTTI_LOG(kWarn, ::tutti::log::kAll, __VA_ARGS__)
#define TUTTI_INFO(subsys, ...) TUTTI_LOG(kInfo, subsys, __VA_ARGS__)
#define TUTTI_TRACE(subsys, ...) TUTTI_LOG(kTrace, subsys, __VA_ARGS__)
