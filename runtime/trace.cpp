#include "runtime/trace.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/log.hpp"

namespace tutti::trace {
namespace {

struct Event {
  int rank;
  int64_t block;
  const char* op;
  double start, end;
  int64_t bytes;
  int peer;
  std::string plan;
};

struct Collector {
  std::mutex mu;
  std::vector<Event> events;
  std::string path;
  bool per_process = false;  // ranks are processes: each writes its own file
  int min_rank = 1 << 30;
};

std::atomic<bool> g_on{false};

Collector& collector() {
  static Collector* c = new Collector();  // outlives static destruction: written from atexit
  return *c;
}

std::string escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o;
}

void write_file() {
  Collector& c = collector();
  std::lock_guard lock(c.mu);
  if (c.events.empty()) return;
  std::string path = c.path;
  size_t r = path.find("%r");
  if (r != std::string::npos) {
    path.replace(r, 2, std::to_string(c.min_rank));
  } else if (c.per_process) {
    size_t dot = path.rfind('.');
    std::string tag = ".rank" + std::to_string(c.min_rank);
    path = dot == std::string::npos ? path + tag : path.substr(0, dot) + tag + path.substr(dot);
  }
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    TUTTI_WARN("TUTTI_TRACE: cannot write {}", path);
    return;
  }
  std::fprintf(f, "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n");
  for (size_t i = 0; i < c.events.size(); ++i) {
    const Event& e = c.events[i];
    std::fprintf(f,
                 "%s{\"name\":\"%s\",\"cat\":\"plan\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%lld,"
                 "\"args\":{\"bytes\":%lld,\"peer\":%d,\"plan\":\"%s\"}}\n",
                 i ? "," : "", e.op, e.start, e.end - e.start, e.rank, static_cast<long long>(e.block),
                 static_cast<long long>(e.bytes), e.peer, escape(e.plan).c_str());
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
}

}  // namespace

void start(const std::string& path, bool ranks_are_processes) {
  if (path.empty()) return;
  Collector& c = collector();
  std::lock_guard lock(c.mu);
  if (g_on.load(std::memory_order_relaxed)) return;  // the first executor's file, for the whole process
  c.path = path;
  c.per_process = ranks_are_processes;
  std::atexit(write_file);
  g_on.store(true, std::memory_order_release);
}

bool enabled() { return g_on.load(std::memory_order_acquire); }

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void record(int rank, int64_t block, const char* op, double start_us, double end_us, int64_t bytes, int peer,
            const std::string& plan) {
  Collector& c = collector();
  std::lock_guard lock(c.mu);
  c.min_rank = std::min(c.min_rank, rank);
  c.events.push_back({rank, block, op, start_us, end_us, bytes, peer, plan});
}

}  // namespace tutti::trace
