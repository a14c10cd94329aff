#pragma once
// Starts rank processes for multi-process tests without tutti-run (which would kill the survivors
// of a failure before they could report it), and collects their exit statuses and output.

#include <map>
#include <string>
#include <vector>

namespace tutti::test_support {

struct ProcessResult {
  int status = 0;  // raw waitpid status
  std::string output;
  bool stopped = false;  // it stopped (SIGSTOP) and was killed once every other rank had ended
  bool exited(int code) const;
  bool killed_by(int sig) const;
};

// Runs argv once per rank with extra environment per rank; waits for all (no time limit here: the
// CTest timeout bounds a hang). Output is stdout+stderr of each process. A rank that stops itself
// (TUTTI_FAULT=stop) is killed with SIGKILL once every other rank has exited.
std::vector<ProcessResult> spawn_ranks(const std::vector<std::string>& argv,
                                       const std::vector<std::map<std::string, std::string>>& envs);

}  // namespace tutti::test_support
