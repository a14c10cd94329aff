#include "runtime/fault.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/communicator.hpp"

namespace tutti {
namespace {

int64_t integer(const std::string& fault, const std::string& key, const std::string& text, int64_t min) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TUTTI_CHECK(used == text.size() && !text.empty() && v >= min, InvalidArgument,
              "TUTTI_FAULT '{}': {}={} is not an integer of at least {}", fault, key, text, min);
  return v;
}

}  // namespace

std::string to_string(FaultKind k) {
  switch (k) {
    case FaultKind::kKill: return "kill";
    case FaultKind::kStop: return "stop";
    case FaultKind::kDelay: return "delay";
    case FaultKind::kClose: return "close";
    case FaultKind::kDrop: return "drop";
    case FaultKind::kCorrupt: return "corrupt";
  }
  return "?";
}

std::vector<FaultSpec> parse_faults(const std::string& text) {
  std::vector<FaultSpec> out;
  for (const std::string& one : env::split_list(text, ',')) {
    std::vector<std::string> parts = env::split_list(one, ':');
    FaultSpec f;
    const std::string& kind = parts[0];
    bool known = false;
    for (FaultKind k : {FaultKind::kKill, FaultKind::kStop, FaultKind::kDelay, FaultKind::kClose, FaultKind::kDrop,
                        FaultKind::kCorrupt})
      if (kind == to_string(k)) f.kind = k, known = true;
    TUTTI_CHECK(known, InvalidArgument,
                "TUTTI_FAULT '{}': unknown fault '{}' (kill, stop, delay, close, drop or corrupt)", one, kind);
    for (size_t i = 1; i < parts.size(); ++i) {
      size_t eq = parts[i].find('=');
      TUTTI_CHECK(eq != std::string::npos, InvalidArgument, "TUTTI_FAULT '{}': '{}' is not key=value", one, parts[i]);
      const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
      if (key == "rank") f.rank = static_cast<int>(integer(one, key, value, 0));
      else if (key == "call") f.call = integer(one, key, value, 1);
      else if (key == "step") f.step = integer(one, key, value, 0);
      else if (key == "peer") f.peer = static_cast<int>(integer(one, key, value, 0));
      else if (key == "seconds") {
        char* end = nullptr;
        f.seconds = std::strtod(value.c_str(), &end);
        TUTTI_CHECK(!value.empty() && end && *end == '\0' && std::isfinite(f.seconds) && f.seconds >= 0,
                    InvalidArgument, "TUTTI_FAULT '{}': seconds={} is not a number of seconds", one, value);
      } else {
        throw InvalidArgument(fmt::format("TUTTI_FAULT '{}': unknown key '{}' (rank, call, step, peer, seconds)", one, key));
      }
    }
    out.push_back(f);
  }
  return out;
}

std::unique_ptr<FaultInjector> FaultInjector::make(const std::vector<FaultSpec>& specs, int rank) {
  auto out = std::make_unique<FaultInjector>();
  for (const FaultSpec& f : specs)
    if (f.rank == rank) out->specs_.push_back(f);
  if (out->specs_.empty()) return nullptr;
  out->fired_.assign(out->specs_.size(), false);
  return out;
}

void FaultInjector::begin_call(Communicator& comm) {
  {
    std::lock_guard lock(mutex_);
    ++calls_;
  }
  at_step(comm, 0);
}

void FaultInjector::at_step(Communicator& comm, int64_t step) {
  std::vector<FaultSpec> due;
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < specs_.size(); ++i)
      if (!fired_[i] && specs_[i].call == calls_ && specs_[i].step == step) {
        fired_[i] = true;
        due.push_back(specs_[i]);
      }
  }
  for (const FaultSpec& f : due) fire(comm, f);
}

void FaultInjector::fire(Communicator& comm, const FaultSpec& f) {
  TUTTI_WARN("rank {}: TUTTI_FAULT: injecting '{}' at call {}, step {}", comm.rank(), to_string(f.kind), calls_, f.step);
  switch (f.kind) {
    case FaultKind::kKill: ::kill(getpid(), SIGKILL); return;
    case FaultKind::kStop: ::kill(getpid(), SIGSTOP); return;
    case FaultKind::kDelay:
      std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
      return;
    case FaultKind::kClose:
    case FaultKind::kDrop:
    case FaultKind::kCorrupt: comm.inject(f.kind, f.peer); return;
  }
}

}  // namespace tutti
