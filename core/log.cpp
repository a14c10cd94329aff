#include "core/log.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>

#include "core/env.hpp"

namespace tutti::log {
namespace {

struct State {
  Settings settings{Level::kWarn, kInit | kEnv};
  std::mutex mutex;
  FILE* out = stderr;
  std::string host;
};

State& state() {
  static State* s = [] {
    auto* st = new State();  // leaked on purpose: logging must work during static destruction
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    st->host = host;
    return st;
  }();
  return *s;
}

std::once_flag g_once;
thread_local int t_rank = -1;

std::string upper(std::string_view text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), ::toupper);
  return s;
}

void load() {
  State& st = state();
  Settings s{Level::kWarn, kInit | kEnv};
  s.level = parse_level(env::get_string("TUTTI_DEBUG"));
  s.subsys = parse_subsys(env::get_string("TUTTI_DEBUG_SUBSYS"));
  std::string file = env::get_string("TUTTI_DEBUG_FILE");
  std::lock_guard lock(st.mutex);
  if (!file.empty()) {
    std::string path;
    for (size_t i = 0; i < file.size(); ++i) {
      if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'h') path += st.host, ++i;
      else if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'p') path += std::to_string(getpid()), ++i;
      else path += file[i];
    }
    if (FILE* f = std::fopen(path.c_str(), "a")) {
      if (st.out != stderr) std::fclose(st.out);
      st.out = f;
    }
  }
  st.settings = s;
}

}  // namespace

Level parse_level(std::string_view text) {
  std::string s = upper(text);
  if (s == "NONE" || s.empty()) return Level::kNone;
  if (s == "VERSION") return Level::kVersion;
  if (s == "WARN") return Level::kWarn;
  if (s == "INFO") return Level::kInfo;
  if (s == "ABORT") return Level::kAbort;
  if (s == "TRACE") return Level::kTrace;
  return Level::kWarn;  // unknown: NCCL ignores it too, keep warnings visible
}

uint32_t parse_subsys(std::string_view text) {
  std::string s = upper(text);
  bool invert = !s.empty() && s[0] == '^';
  if (invert) s.erase(0, 1);
  uint32_t mask = 0;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    std::string name = s.substr(start, end - start);
    static const std::pair<const char*, uint32_t> kNames[] = {
        {"INIT", kInit},   {"COLL", kColl},         {"P2P", kP2P},   {"SHM", kShm},   {"NET", kNet},
        {"GRAPH", kGraph}, {"TUNING", kTuning},     {"ENV", kEnv},   {"ALLOC", kAlloc}, {"CALL", kCall},
        {"BOOTSTRAP", kBootstrap}, {"ALL", kAll}};
    for (auto& [n, bit] : kNames)
      if (name == n) mask |= bit;
    start = end + 1;
  }
  return invert ? ~mask : mask;
}

const Settings& settings() {
  std::call_once(g_once, load);
  return state().settings;
}

void reload() {
  std::call_once(g_once, [] {});
  load();
}

void set_thread_rank(int rank) { t_rank = rank; }
int thread_rank() { return t_rank; }

void write(Level level, uint32_t, const std::string& message) {
  static const char* kNames[] = {"NONE", "VERSION", "WARN", "INFO", "ABORT", "TRACE"};
  State& st = state();
  long tid = syscall(SYS_gettid);
  std::string rank = t_rank >= 0 ? fmt::format(" [{}]", t_rank) : std::string();
  std::string line =
      fmt::format("{}:{}:{}{} TUTTI {} {}\n", st.host, getpid(), tid, rank, kNames[static_cast<int>(level)], message);
  std::lock_guard lock(st.mutex);
  std::fwrite(line.data(), 1, line.size(), st.out);
  std::fflush(st.out);
}

}  // namespace tutti::log
