// tutti-run: starts N local ranks of a program and serves their rendezvous.
//
//   tutti-run -n N [--tag-output] [--bind-to core|none] [--] program [args...]
//
// Like mpirun, ranks are bound to one core each (rank r to the r-th allowed core) when there are
// at least as many cores as ranks, and left unbound otherwise; --bind-to none turns binding off.
// Each rank gets TUTTI_RANK, TUTTI_SIZE, TUTTI_LOCAL_RANK, TUTTI_LOCAL_SIZE and TUTTI_COMM_ID (the
// hex unique id of a rendezvous root that runs inside tutti-run). Output lines are forwarded whole
// (never interleaved mid-line) and, as mpirun's, without a prefix unless --tag-output asks for
// "[rank] ", so parsers of nccl-tests' output read tutti-run's too. The exit status is the first non-zero status of a rank (128+signal for a killed
// one); when a rank fails, the others get SIGTERM, then SIGKILL two seconds later, so tutti-run never
// hangs on a broken job.

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "runtime/rendezvous.hpp"

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

struct Rank {
  pid_t pid = -1;
  int out = -1, err = -1;
  std::string out_buf, err_buf;
  bool exited = false;
  int status = 0;
};

int usage(const char* msg) {
  std::fprintf(stderr,
               "tutti-run: %s\nusage: tutti-run -n N [--tag-output] [--] program [args...]\n"
               "  -n, --np N     number of ranks to start on this host\n"
               "  --tag-output   prefix output lines with [rank] (as mpirun's option; off by default)\n"
               "  --bind-to core|none  bind each rank to a core (default when ranks <= cores) or not\n",
               msg);
  return 2;
}

void forward(std::string& buf, const char* data, size_t n, int rank, FILE* to, bool prefix, bool flush_all) {
  buf.append(data, n);
  size_t start = 0, nl;
  while ((nl = buf.find('\n', start)) != std::string::npos) {
    if (prefix) std::fprintf(to, "[%d] ", rank);
    std::fwrite(buf.data() + start, 1, nl - start + 1, to);
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush_all && !buf.empty()) {
    if (prefix) std::fprintf(to, "[%d] ", rank);
    std::fwrite(buf.data(), 1, buf.size(), to);
    std::fputc('\n', to);
    buf.clear();
  }
  std::fflush(to);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int n = -1;
  bool prefix = false;
  std::string bind = "auto";
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-n" || a == "--np" || a == "-np") {
      if (i + 1 >= argc) return usage("-n needs a number");
      char* end = nullptr;
      n = static_cast<int>(std::strtol(argv[++i], &end, 10));
      if (*end || n < 1) return usage("-n needs a positive number");
    } else if (a == "--tag-output") {
      prefix = true;
    } else if (a == "--no-prefix") {
      prefix = false;  // the default now; kept so older scripts run
    } else if (a == "--bind-to") {
      if (i + 1 >= argc) return usage("--bind-to needs core or none");
      bind = argv[++i];
      if (bind != "core" && bind != "none") return usage("--bind-to takes core or none");
    } else if (a == "--") {
      ++i;
      break;
    } else if (a == "-h" || a == "--help") {
      usage("help");
      return 0;
    } else if (!a.empty() && a[0] == '-') {
      return usage(("unknown option " + a).c_str());
    } else {
      break;
    }
  }
  if (n < 1) return usage("missing -n N");
  if (i >= argc) return usage("missing program");

  std::unique_ptr<tutti::RendezvousRoot> root;
  try {
    root = std::make_unique<tutti::RendezvousRoot>(tutti::SocketAddress::parse("127.0.0.1:0"),
                                                   tutti::UniqueId::random_secret(), true);
  } catch (const tutti::Error& e) {
    std::fprintf(stderr, "tutti-run: cannot start the rendezvous root: %s\n", e.what());
    return 1;
  }
  std::string comm_id = root->unique_id().hex();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  bool binding = bind == "core" || (bind == "auto" && n <= static_cast<int>(cores.size()));

  std::vector<Rank> ranks(n);
  for (int r = 0; r < n; ++r) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
      std::perror("tutti-run: pipe");
      return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("tutti-run: fork");
      return 1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher that dies takes its ranks with it
      if (binding && !cores.empty()) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cores[r % cores.size()], &one);
        sched_setaffinity(0, sizeof(one), &one);
      }
      dup2(out[1], 1);
      dup2(err[1], 2);
      setenv("TUTTI_RANK", std::to_string(r).c_str(), 1);
      setenv("TUTTI_SIZE", std::to_string(n).c_str(), 1);
      setenv("TUTTI_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("TUTTI_LOCAL_SIZE", std::to_string(n).c_str(), 1);
      setenv("TUTTI_COMM_ID", comm_id.c_str(), 1);
      execvp(argv[i], argv + i);
      std::fprintf(stderr, "tutti-run: cannot execute %s: %s\n", argv[i], std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    ranks[r].pid = pid;
    ranks[r].out = out[0];
    ranks[r].err = err[0];
  }

  int result = 0;
  int running = n;
  bool killing = false;
  auto kill_started = std::chrono::steady_clock::now();
  auto all_exited = kill_started;
  auto terminate_all = [&](int sig) {
    for (auto& rk : ranks)
      if (!rk.exited) kill(rk.pid, sig);
  };
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owner;  // (rank, is_err)
    for (int r = 0; r < n; ++r) {
      if (ranks[r].out >= 0) fds.push_back({ranks[r].out, POLLIN, 0}), owner.push_back({r, false});
      if (ranks[r].err >= 0) fds.push_back({ranks[r].err, POLLIN, 0}), owner.push_back({r, true});
    }
    if (running == 0 && (fds.empty() || std::chrono::steady_clock::now() - all_exited > std::chrono::seconds(1)))
      break;  // a rank's background children may hold the pipes open: do not wait for them
    if (!fds.empty()) poll(fds.data(), fds.size(), 50);
    else usleep(20000);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [r, is_err] = owner[k];
      char buf[65536];
      ssize_t got = read(fds[k].fd, buf, sizeof(buf));
      Rank& rk = ranks[r];
      if (got > 0) {
        forward(is_err ? rk.err_buf : rk.out_buf, buf, static_cast<size_t>(got), r, is_err ? stderr : stdout, prefix,
                false);
      } else if (got == 0 || errno != EINTR) {
        forward(is_err ? rk.err_buf : rk.out_buf, "", 0, r, is_err ? stderr : stdout, prefix, true);
        close(fds[k].fd);
        (is_err ? rk.err : rk.out) = -1;
      }
    }
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (int r = 0; r < n; ++r) {
        if (ranks[r].pid != pid) continue;
        ranks[r].exited = true;
        ranks[r].status = status;
        if (--running == 0) all_exited = std::chrono::steady_clock::now();
        int code = exit_code(status);
        if (code != 0 && result == 0) {
          result = code;
          if (WIFSIGNALED(status))
            std::fprintf(stderr, "tutti-run: rank %d (pid %d) was killed by signal %d (%s)\n", r, pid, WTERMSIG(status),
                         strsignal(WTERMSIG(status)));
          else
            std::fprintf(stderr, "tutti-run: rank %d (pid %d) exited with status %d\n", r, pid, code);
          if (running > 0) {
            std::fprintf(stderr, "tutti-run: terminating the other %d rank(s)\n", running);
            terminate_all(SIGTERM);
            killing = true;
            kill_started = std::chrono::steady_clock::now();
          }
        }
      }
    }
    if (g_signal && !killing) {
      std::fprintf(stderr, "tutti-run: got signal %d, terminating ranks\n", static_cast<int>(g_signal));
      terminate_all(g_signal);
      if (result == 0) result = 128 + g_signal;
      killing = true;
      kill_started = std::chrono::steady_clock::now();
    }
    if (killing && running > 0 && std::chrono::steady_clock::now() - kill_started > std::chrono::seconds(2)) {
      terminate_all(SIGKILL);
      kill_started = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
  }
  return result;
}
