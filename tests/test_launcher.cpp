// tutti-run: environment, output prefixes, exit statuses, and never hanging on a dead rank.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

struct LaunchResult {
  int status;
  std::string output;
};

LaunchResult run(const std::string& args) {
  std::string cmd = std::string(TUTTI_RUN_PATH) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t k = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), k);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(Launcher, SetsRankVariablesAndPrefixesOutputWhenAsked) {
  // As mpirun: plain lines by default, so nccl-tests' output parsers work on tutti-run's.
  LaunchResult plain = run("-n 2 sh -c 'echo rank=$TUTTI_RANK'");
  EXPECT_EQ(plain.status, 0) << plain.output;
  EXPECT_NE(plain.output.find("rank=0\n"), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("rank=1\n"), std::string::npos) << plain.output;
  EXPECT_EQ(plain.output.find("["), std::string::npos) << plain.output;
  LaunchResult r =
      run("-n 3 --tag-output sh -c 'echo rank=$TUTTI_RANK size=$TUTTI_SIZE local=$TUTTI_LOCAL_RANK id=${#TUTTI_COMM_ID}'");
  EXPECT_EQ(r.status, 0) << r.output;
  for (int i = 0; i < 3; ++i)
    EXPECT_NE(r.output.find("[" + std::to_string(i) + "] rank=" + std::to_string(i) + " size=3 local=" +
                            std::to_string(i) + " id=256"),
              std::string::npos)
        << r.output;
}

TEST(Launcher, ReturnsTheFirstNonZeroStatus) {
  LaunchResult r = run("-n 3 sh -c 'if [ $TUTTI_RANK = 1 ]; then exit 7; fi; exit 0'");
  EXPECT_EQ(r.status, 7) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
}

TEST(Launcher, KillsTheRestWhenARankDies) {
  // Ranks 0 and 2 would sleep for ten minutes; rank 1 is killed. tutti-run must end them all.
  LaunchResult r = run("-n 3 sh -c 'if [ $TUTTI_RANK = 1 ]; then kill -9 $$; fi; exec sleep 600'");
  EXPECT_EQ(r.status, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("terminating the other 2 rank(s)"), std::string::npos) << r.output;
}

TEST(Launcher, ReportsAProgramThatCannotStart) {
  LaunchResult r = run("-n 2 /nonexistent/program");
  EXPECT_EQ(r.status, 127) << r.output;
  EXPECT_NE(r.output.find("cannot execute /nonexistent/program"), std::string::npos) << r.output;
}

TEST(Launcher, RejectsBadArguments) {
  EXPECT_EQ(run("-n 0 true").status, 2);
  EXPECT_EQ(run("true").status, 2);
  EXPECT_EQ(run("-n 2").status, 2);
  EXPECT_EQ(run("--bogus -n 2 true").status, 2);
}

TEST(Launcher, RunsRealRanksThatTalk) {
  LaunchResult r = run(std::string("-n 4 --tag-output ") + TUTTI_TEST_RANK_PATH + " exchange 65536");
  EXPECT_EQ(r.status, 0) << r.output;
  for (int i = 0; i < 4; ++i) EXPECT_NE(r.output.find("[" + std::to_string(i) + "] rank " + std::to_string(i) + ": received"), std::string::npos) << r.output;
}

}  // namespace
