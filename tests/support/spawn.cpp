#include "tests/support/spawn.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace tutti::test_support {

bool ProcessResult::exited(int code) const { return WIFEXITED(status) && WEXITSTATUS(status) == code; }
bool ProcessResult::killed_by(int sig) const { return WIFSIGNALED(status) && WTERMSIG(status) == sig; }

std::vector<ProcessResult> spawn_ranks(const std::vector<std::string>& argv,
                                       const std::vector<std::map<std::string, std::string>>& envs) {
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (size_t r = 0; r < envs.size(); ++r) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      size_t eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (auto& [k, v] : envs[r]) env[k] = v;
    std::vector<std::string> env_strings;
    for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp, args;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (auto& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    char path[] = "/tmp/tutti-spawn-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) throw std::runtime_error("mkstemp failed");
    logs.push_back(path);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    pid_t pid;
    int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(fd);
    if (rc != 0) throw std::runtime_error("posix_spawn of " + argv[0] + " failed");
    pids.push_back(pid);
  }
  std::vector<ProcessResult> results(pids.size());
  for (size_t r = 0; r < pids.size(); ++r) {
    waitpid(pids[r], &results[r].status, WUNTRACED);
    results[r].stopped = WIFSTOPPED(results[r].status);
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    if (results[r].stopped) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &results[r].status, 0);
    }
    std::ifstream in(logs[r]);
    std::stringstream ss;
    ss << in.rdbuf();
    results[r].output = ss.str();
    unlink(logs[r].c_str());
  }
  return results;
}

}  // namespace tutti::test_support
