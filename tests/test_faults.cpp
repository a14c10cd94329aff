// Fault injection (TUTTI_FAULT, runtime/fault.hpp): every injected fault ends in an error on every
// rank within a bound, never in a hang or in a wrong result reported as success. Ranks run as
// threads of one process and as processes, over shared memory and TCP, on the one-shot path and on
// plans. tests/fault_rank.cpp is the program under test; each of its ranks prints one line.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "runtime/fault.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/unique_id.hpp"
#include "tests/support/env.hpp"
#include "tests/support/sanitizers.hpp"
#include "tests/support/spawn.hpp"

namespace tutti {
namespace {

using test_support::kThreadSanitizer;

constexpr double kTimeout = 2;  // TUTTI_TIMEOUT of every run here
// Faults that break a link or a message are seen at once (milliseconds); the bound only absorbs a
// loaded CI machine. Faults that leave peers waiting (drop, stop) take the timeout, the liveness
// check (1 s) and the same allowance.
constexpr double kPromptBound = 10;
constexpr double kWaitBound = kTimeout + 1 + 10;

struct Report {
  bool ok = false, error = false, wrong = false;
  double seconds = 0;
  std::string line;
};

std::map<int, Report> parse(const std::string& output) {
  std::map<int, Report> out;
  static const std::regex ok(R"(^rank (\d+): ok: )"), error(R"(^rank (\d+): error in call \d+, ([0-9.]+) s after)"),
      wrong(R"(^rank (\d+): WRONG)");
  size_t start = 0;
  while (start < output.size()) {
    size_t end = output.find('\n', start);
    if (end == std::string::npos) end = output.size();
    std::string line = output.substr(start, end - start);
    start = end + 1;
    std::smatch m;
    if (std::regex_search(line, m, ok)) out[std::stoi(m[1])] = {true, false, false, 0, line};
    else if (std::regex_search(line, m, error)) out[std::stoi(m[1])] = {false, true, false, std::stod(m[2]), line};
    else if (std::regex_search(line, m, wrong)) out[std::stoi(m[1])] = {false, false, true, 0, line};
  }
  return out;
}

struct ThreadRun {
  int status = -1;  // exit status of the threads run
  std::string output;
};

// Three ranks as threads of one tutti-fault-rank process.
ThreadRun run_threads(const std::string& fault, const std::string& transport, size_t count) {
  const std::string timeout = std::to_string(kTimeout);
  test_support::ScopedEnv env(
      {{"TUTTI_FAULT", fault.c_str()}, {"TUTTI_TIMEOUT", timeout.c_str()}, {"TUTTI_TRANSPORT", transport.c_str()}});
  std::string cmd = std::string(TUTTI_FAULT_RANK_PATH) + " --threads 3 --calls 5 --fault-call 3 --count " +
                    std::to_string(count) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ThreadRun r;
  std::array<char, 4096> buf;
  while (size_t k = fread(buf.data(), 1, buf.size(), p)) r.output.append(buf.data(), k);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Three processes; rank 1 is the one the faults here name.
std::vector<test_support::ProcessResult> run_processes(const std::string& fault, const std::string& transport,
                                                       size_t count) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), UniqueId::random_secret(), true);
  std::vector<std::map<std::string, std::string>> envs;
  for (int r = 0; r < 3; ++r)
    envs.push_back({{"TUTTI_RANK", std::to_string(r)},
                    {"TUTTI_SIZE", "3"},
                    {"TUTTI_COMM_ID", root.unique_id().hex()},
                    {"TUTTI_TRANSPORT", transport},
                    {"TUTTI_TIMEOUT", std::to_string(kTimeout)},
                    {"TUTTI_FAULT", fault}});
  return test_support::spawn_ranks(
      {TUTTI_FAULT_RANK_PATH, "--calls", "5", "--fault-call", "3", "--count", std::to_string(count)}, envs);
}

// Every rank in `ranks` reported an error within `bound` seconds; none reported a wrong result.
void expect_errors(const std::map<int, Report>& reports, const std::vector<int>& ranks, double bound,
                   const std::string& context) {
  for (int r : ranks) {
    auto it = reports.find(r);
    ASSERT_NE(it, reports.end()) << context << ": rank " << r << " reported nothing";
    EXPECT_TRUE(it->second.error) << context << ": " << it->second.line;
    EXPECT_LE(it->second.seconds, bound) << context << ": " << it->second.line;
  }
  for (auto& [r, rep] : reports) EXPECT_FALSE(rep.wrong) << context << ": " << rep.line;
}

// The one-shot path (1 KiB over shared memory) and plans (1 KiB over TCP, 1 MiB over both).
struct Case {
  const char* transport;
  size_t count;
};
const Case kCases[] = {{"shm", 256}, {"shm", 1 << 18}, {"tcp", 256}, {"tcp", 1 << 18}};

std::string name(const Case& c) { return std::string(c.transport) + "/" + std::to_string(c.count * 4) + " B"; }

TEST(FaultSpec, ParsesEveryKindAndKey) {
  auto f = parse_faults("kill:rank=2:call=7:step=3,delay:seconds=0.25,drop:peer=1,close,corrupt:rank=1,stop");
  ASSERT_EQ(f.size(), 6u);
  EXPECT_EQ(f[0].kind, FaultKind::kKill);
  EXPECT_EQ(f[0].rank, 2);
  EXPECT_EQ(f[0].call, 7);
  EXPECT_EQ(f[0].step, 3);
  EXPECT_EQ(f[1].kind, FaultKind::kDelay);
  EXPECT_DOUBLE_EQ(f[1].seconds, 0.25);
  EXPECT_EQ(f[1].rank, 0);
  EXPECT_EQ(f[1].call, 1);
  EXPECT_EQ(f[2].peer, 1);
  EXPECT_EQ(f[3].peer, -1);
  EXPECT_EQ(f[4].kind, FaultKind::kCorrupt);
  EXPECT_EQ(f[5].kind, FaultKind::kStop);
  EXPECT_TRUE(parse_faults("").empty());
}

TEST(FaultSpec, RejectsWhatItCannotHonourNamingThePart) {
  auto message = [](const std::string& text) {
    try {
      parse_faults(text);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("explode").find("unknown fault 'explode'"), std::string::npos);
  EXPECT_NE(message("kill:when=3").find("unknown key 'when'"), std::string::npos);
  EXPECT_NE(message("kill:call=0").find("call=0"), std::string::npos);
  EXPECT_NE(message("kill:rank=x").find("rank=x"), std::string::npos);
  EXPECT_NE(message("delay:seconds=-1").find("seconds=-1"), std::string::npos);
  EXPECT_NE(message("drop:peer").find("'peer' is not key=value"), std::string::npos);
}

TEST(FaultThreads, ClosedLinksFailEveryRankPromptly) {
  for (const Case& c : kCases) {
    ThreadRun r = run_threads("close:rank=1:call=3", c.transport, c.count);
    EXPECT_EQ(r.status, 3) << name(c) << "\n" << r.output;
    auto reports = parse(r.output);
    expect_errors(reports, {0, 1, 2}, kPromptBound, name(c));
    EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  }
}

TEST(FaultThreads, CorruptHeadersAreRejectedOnEveryRank) {
  for (const Case& c : kCases) {
    ThreadRun r = run_threads("corrupt:rank=1:call=3", c.transport, c.count);
    EXPECT_EQ(r.status, 3) << name(c) << "\n" << r.output;
    expect_errors(parse(r.output), {0, 1, 2}, kPromptBound, name(c));
    // The receiver names the damage: a checksum on plans, the call header on the one-shot path.
    EXPECT_TRUE(r.output.find("checksum mismatch") != std::string::npos ||
                r.output.find("calls all_reduce of 264 float") != std::string::npos)
        << name(c) << "\n" << r.output;
  }
}

TEST(FaultThreads, CorruptionLaterInACallIsRejectedToo) {
  // Step 2 of a 1 MiB ring all-reduce: the fault lands between two messages of one call.
  for (const char* transport : {"shm", "tcp"}) {
    ThreadRun r = run_threads("corrupt:rank=2:call=3:step=2", transport, 1 << 18);
    EXPECT_EQ(r.status, 3) << transport << "\n" << r.output;
    expect_errors(parse(r.output), {0, 1, 2}, kPromptBound, transport);
    EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  }
}

TEST(FaultThreads, DroppedMessagesEndInATimeoutNamingTheWait) {
  for (const Case& c : kCases) {
    ThreadRun r = run_threads("drop:rank=1:call=3", c.transport, c.count);
    EXPECT_EQ(r.status, 3) << name(c) << "\n" << r.output;
    expect_errors(parse(r.output), {0, 1, 2}, kWaitBound, name(c));
    // The wait-for dump: what the rank waited on, and that every peer is alive.
    EXPECT_NE(r.output.find("timed out after 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("every peer answered a liveness check"), std::string::npos) << r.output;
    EXPECT_TRUE(r.output.find("step ") != std::string::npos || r.output.find("waiting for rank 1") != std::string::npos)
        << r.output;
  }
}

TEST(FaultThreads, DelayShorterThanTheTimeoutIsOnlySlowness) {
  for (const Case& c : {kCases[0], kCases[3]}) {
    ThreadRun r = run_threads("delay:rank=1:call=3:seconds=0.5", c.transport, c.count);
    EXPECT_EQ(r.status, 0) << name(c) << "\n" << r.output;
    auto reports = parse(r.output);
    for (int rank = 0; rank < 3; ++rank) EXPECT_TRUE(reports[rank].ok) << r.output;
  }
}

TEST(FaultThreads, DelayPastTheTimeoutFailsEveryRank) {
  ThreadRun r = run_threads("delay:rank=1:call=3:seconds=4", "shm", 1 << 18);
  EXPECT_EQ(r.status, 3) << r.output;
  expect_errors(parse(r.output), {0, 1, 2}, 4 + kPromptBound, "delay 4 s");
}

TEST(FaultProcesses, KilledRankIsNamedByEverySurvivor) {
  for (const Case& c : kCases) {
    auto res = run_processes("kill:rank=1:call=3", c.transport, c.count);
    EXPECT_TRUE(res[1].killed_by(SIGKILL)) << name(c) << ": " << res[1].output;
    std::map<int, Report> reports;
    for (int r : {0, 2}) {
      EXPECT_TRUE(res[r].exited(3)) << name(c) << " rank " << r << ": " << res[r].output;
      EXPECT_NE(res[r].output.find("rank 1"), std::string::npos) << res[r].output;
      reports.merge(parse(res[r].output));
    }
    expect_errors(reports, {0, 2}, kPromptBound, name(c));
  }
}

TEST(FaultProcesses, KilledMidCallIsNamedByEverySurvivor) {
  auto res = run_processes("kill:rank=2:call=3:step=2", "shm", 1 << 18);
  EXPECT_TRUE(res[2].killed_by(SIGKILL)) << res[2].output;
  std::map<int, Report> reports;
  for (int r : {0, 1}) {
    EXPECT_TRUE(res[r].exited(3)) << "rank " << r << ": " << res[r].output;
    reports.merge(parse(res[r].output));
  }
  expect_errors(reports, {0, 1}, kPromptBound, "kill at step 2");
}

TEST(FaultProcesses, StoppedRankIsReportedAfterTheTimeout) {
  for (const Case& c : {kCases[0], kCases[1], kCases[3]}) {
    auto res = run_processes("stop:rank=1:call=3", c.transport, c.count);
    EXPECT_TRUE(res[1].stopped) << name(c) << ": " << res[1].output;
    std::map<int, Report> reports;
    for (int r : {0, 2}) {
      EXPECT_TRUE(res[r].exited(3)) << name(c) << " rank " << r << ": " << res[r].output;
      // Named as the one that does not answer, not just as the one waited for.
      EXPECT_TRUE(std::regex_search(res[r].output, std::regex("no answer to a liveness check within 1 s from rank 1 ")))
          << name(c) << " rank " << r << ": " << res[r].output;
      reports.merge(parse(res[r].output));
    }
    expect_errors(reports, {0, 2}, kWaitBound, name(c));
    for (int r : {0, 2}) EXPECT_GE(reports[r].seconds, kTimeout * 0.9) << reports[r].line;
  }
}

TEST(FaultProcesses, CloseAndCorruptFailEveryProcess) {
  for (const char* fault : {"close:rank=1:call=3", "corrupt:rank=1:call=3"})
    for (const Case& c : {kCases[0], kCases[3]}) {
      auto res = run_processes(fault, c.transport, c.count);
      std::map<int, Report> reports;
      for (int r = 0; r < 3; ++r) {
        EXPECT_TRUE(res[r].exited(3)) << fault << " " << name(c) << " rank " << r << ": " << res[r].output;
        reports.merge(parse(res[r].output));
      }
      expect_errors(reports, {0, 1, 2}, kPromptBound, std::string(fault) + " " + name(c));
    }
}

// Containment: a rank whose call times out while its peer still reads its buffer by reference
// (thread ranks: memcpy straight out of the sender's memory; processes: process_vm_readv) returns,
// and its caller frees the buffer at once. Before, the reader could segfault (exit 139). Now the
// failing rank withdraws the message first (Connection::withdraw): the read in progress finishes,
// later ones fail with an error. Whatever the timing, nothing may crash.
TEST(Containment, TimeoutDuringAReadByReferenceCrashesNothing) {
  // One 512 MiB message each way: a read takes about 100 ms, the timeout is 50 ms. Without the
  // withdrawal, thread ranks crashed in about half of the trials (issue 24: 4 of 5).
  // Under ThreadSanitizer (.ci/sanitize.sh) one trial per launch: a race between the withdrawal and
  // the read shows in any trial where the read outlasts the timeout (reads there are several times
  // slower), while repeated trials count crashes, which the plain build does. Seven trials under it
  // took about 3 of CI's 30 minutes, mostly the kernel mapping shadow memory. Smaller messages
  // finish there before the timeout fires (256 MiB did), so the size stays.
  for (const char* launch : {"", TUTTI_RUN_PATH " -n 2 "})
    for (int trial = 0; trial < (kThreadSanitizer ? 1 : *launch ? 2 : 5); ++trial) {
      std::string cmd = std::string("TUTTI_TIMEOUT=0.05 ") + launch + TUTTI_PERF_PATH +
                        " sendrecv -b 512M -e 512M -n 1 -w 0 -c 0" + (*launch ? "" : " -t 2") + " 2>&1";
      FILE* p = popen(cmd.c_str(), "r");
      std::string out;
      std::array<char, 4096> buf;
      while (size_t k = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), k);
      int st = pclose(p);
      ASSERT_TRUE(WIFEXITED(st)) << cmd << "\n" << out;
      // tutti-run reports a rank killed by a signal as 128 + the signal.
      EXPECT_LT(WEXITSTATUS(st), 128) << cmd << "\n" << out;
      if (WEXITSTATUS(st) != 0) {
        EXPECT_TRUE(out.find("timed out") != std::string::npos || out.find("withdrew") != std::string::npos)
            << cmd << "\n" << out;
      }
    }
}

}  // namespace
}  // namespace tutti
