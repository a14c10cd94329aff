// Rendezvous and bootstrap under bad input: wrong secrets, truncated and malformed messages,
// missing ranks, inconsistent sizes, a rank killed after setup, and launchers' rank variables.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "runtime/auth.hpp"
#include "runtime/communicator.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/wire.hpp"
#include "tests/support/spawn.hpp"

using namespace tutti;

namespace {

Fd raw_connect(const SocketAddress& addr) {
  return connect_with_retry(addr, Deadline::after(10), nullptr, "test peer");
}

// True when the other side closes the connection (refusal) rather than answering. What it sends
// first (a listener's challenge) is read and dropped; gives up (false) after 30 s of silence.
bool closed_by_peer(int fd) {
  char buf[256];
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 30000) == 0) return false;
    ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
    if (k == 0) return true;
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return true;  // reset also counts as closed
  }
}

// A rendezvous hello as a client with `secret` would send it: the MAC over the root's challenge.
void send_hello(int fd, uint64_t secret, int rank, int nranks, uint32_t type = 1) {
  auth::Nonce challenge = auth::recv_challenge(fd, Deadline::after(5), "root");
  auth::Nonce mine = auth::random_nonce();
  wire::Writer w;
  w.put(mine).put<uint64_t>(0).put<int32_t>(rank).put<int32_t>(nranks).put<double>(30.0);
  std::vector<unsigned char> info{1, 2, 3};
  w.put_bytes(info.data(), info.size());
  auth::Mac proof = auth::mac(secret, "tutti rendezvous hello", challenge, w.bytes().data(), w.bytes().size());
  wire::FrameHeader h;
  h.type = type;
  h.length = proof.size() + w.bytes().size();
  send_exact(fd, &h, sizeof(h), Deadline::after(5), "root");
  send_exact(fd, proof.data(), proof.size(), Deadline::after(5), "root");
  send_exact(fd, w.bytes().data(), w.bytes().size(), Deadline::after(5), "root");
}

// Two ranks complete a rendezvous on this root (proves the root survived the bad clients).
void expect_rendezvous_works(const UniqueId& id) {
  std::vector<std::vector<std::vector<unsigned char>>> tables(2);
  std::thread t([&] { tables[1] = rendezvous(id, 1, 2, 0, {11}, 30, nullptr); });
  tables[0] = rendezvous(id, 0, 2, 0, {10}, 30, nullptr);
  t.join();
  ASSERT_EQ(tables[0].size(), 2u);
  EXPECT_EQ(tables[0][1], std::vector<unsigned char>{11});
  EXPECT_EQ(tables[1][0], std::vector<unsigned char>{10});
}

TEST(Rendezvous, WrongSecretIsRefusedAndOthersProceed) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), 42, false);
  Fd bad = raw_connect(root.unique_id().root());
  send_hello(bad.get(), 41, 0, 2);
  EXPECT_TRUE(closed_by_peer(bad.get()));
  // The library's own client with a wrong secret gets a clear error, not a hang.
  UniqueId wrong = UniqueId::make(root.unique_id().root(), 43);
  try {
    rendezvous(wrong, 0, 2, 0, {1}, 30, nullptr);
    FAIL() << "expected an error";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
  }
  // Nor does the secret travel: a hello is a MAC over a fresh challenge, so replaying one to
  // another connection (another challenge) is refused too.
  expect_rendezvous_works(root.unique_id());
}

size_t resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// Before, the root buffered whatever length a hello claimed (up to 64 MiB) before it looked at the
// secret: one connection took it from 4 to 131 MiB. Now nothing past a 4 KiB hello is read from a
// connection that has not proven the secret: a claim beyond it is refused at the header.
TEST(RendezvousAttack, ClaimedHugeHellosAreRefusedAtTheHeaderWithoutBuffering) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), 42, true);
  const size_t before = resident_bytes();
  std::vector<Fd> flood;
  std::vector<char> junk(1 << 20, 'x');
  for (int i = 0; i < 20; ++i) {
    Fd fd = raw_connect(root.unique_id().root());
    wire::FrameHeader h;
    h.type = static_cast<uint32_t>(wire::FrameType::kHello);
    h.length = 64u << 20;
    send_exact(fd.get(), &h, sizeof(h), Deadline::after(5), "root");
    ::send(fd.get(), junk.data(), junk.size(), MSG_DONTWAIT | MSG_NOSIGNAL);  // as much as the socket takes
    flood.push_back(std::move(fd));
  }
  for (auto& fd : flood) EXPECT_TRUE(closed_by_peer(fd.get()));
  expect_rendezvous_works(root.unique_id());
  EXPECT_LT(resident_bytes(), before + (16u << 20)) << "the root grew by " << (resident_bytes() - before) << " bytes";
}

// A listener keeps at most wire::kMaxPendingConnections connections that have not proven the
// secret: idle ones beyond that push out the oldest, and real ranks still get through.
TEST(RendezvousAttack, IdleConnectionsAreCappedOldestFirst) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), 42, true);
  std::vector<Fd> idle;
  for (size_t i = 0; i < wire::kMaxPendingConnections + 16; ++i) {
    idle.push_back(raw_connect(root.unique_id().root()));
    auth::recv_challenge(idle.back().get(), Deadline::after(5), "root");  // accepted: challenged
  }
  EXPECT_TRUE(closed_by_peer(idle.front().get()));  // the oldest was dropped
  expect_rendezvous_works(root.unique_id());
}

// Someone who can reach the port but lacks the secret cannot join as a rank (before, with a
// host:port id, the secret was a hash of the address: an impostor joined as rank 1 and got rank
// 0's host, pid, segment name and address, and the real rank 1 was refused).
TEST(RendezvousAttack, AnImpostorRankIsRefusedAndTheRealOneJoins) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), UniqueId::random_secret(), true);
  Fd impostor = raw_connect(root.unique_id().root());
  send_hello(impostor.get(), /*a guess*/ 0x1234, 1, 2);
  EXPECT_TRUE(closed_by_peer(impostor.get()));
  expect_rendezvous_works(root.unique_id());
}

// An impostor on the root's port: challenges, reads the hello, and answers with a table under a
// MAC it cannot compute.
void fake_root(int listener) {
  int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) return;
  Fd c(fd);
  auth::send_challenge(fd, auth::random_nonce());
  wire::FrameHeader h;
  recv_exact(fd, &h, sizeof(h), Deadline::after(5), "rank");
  std::vector<unsigned char> hello(h.length);
  recv_exact(fd, hello.data(), hello.size(), Deadline::after(5), "rank");
  wire::Writer w;  // a table of one rank, under a MAC it cannot compute
  w.put(auth::Mac{}).put<int32_t>(1);
  std::vector<unsigned char> info{6, 6, 6};
  w.put_bytes(info.data(), info.size());
  wire::FrameHeader t;
  t.type = static_cast<uint32_t>(wire::FrameType::kTable);
  t.length = w.bytes().size();
  send_exact(fd, &t, sizeof(t), Deadline::after(5), "rank");
  send_exact(fd, w.bytes().data(), w.bytes().size(), Deadline::after(5), "rank");
}

// And a rank does not take a table from an impostor root (someone who took the port first): the
// real root proves the secret over the rank's own nonce.
TEST(RendezvousAttack, AnImpostorRootIsNotBelieved) {
  Fd listener = listen_on(SocketAddress::parse("127.0.0.1:0"));
  set_nonblocking(listener.get(), false);  // the fake root's accept waits for the rank
  SocketAddress addr = local_address(listener.get());
  std::thread fake([&] {
    try {
      fake_root(listener.get());
    } catch (const Error&) {  // the rank hung up: what the test checks is on its side
    }
  });
  try {
    rendezvous(UniqueId::make(addr, 99), 0, 1, 0, {1}, 10, nullptr);
    ADD_FAILURE() << "a table from an impostor root was taken";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("without proving the communicator's secret"), std::string::npos) << e.what();
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  fake.join();
}

// At its descriptor limit a listener used to spin a core and stall communicator creation for up
// to 10 s. A root limited to 48 descriptors, flooded with 200 idle connections, must still let a
// real group meet: it drops the oldest connections that proved nothing to make room.
TEST(RendezvousAttack, RealRanksMeetAtTheDescriptorLimit) {
  std::string cmd = std::string(TUTTI_TEST_RANK_PATH) + " fd-limit-root 48";
  FILE* child = popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr);
  char line[512] = {};
  ASSERT_NE(std::fgets(line, sizeof(line), child), nullptr);
  std::string hex(line);
  while (!hex.empty() && (hex.back() == '\n' || hex.back() == '\r')) hex.pop_back();
  UniqueId id = UniqueId::parse(hex, "");
  std::vector<Fd> idle;
  for (int i = 0; i < 200; ++i) {
    try {
      idle.push_back(connect_with_retry(id.root(), Deadline::after(2), nullptr, "root"));
    } catch (const Error&) {
      break;  // the backlog is full: enough
    }
  }
  EXPECT_GT(idle.size(), 48u);
  expect_rendezvous_works(id);
  idle.clear();
  std::string rest;
  while (std::fgets(line, sizeof(line), child)) rest += line;
  EXPECT_EQ(pclose(child), 0) << rest;
  // The root's whole life took a few milliseconds of CPU; spinning at the limit, it burnt a core
  // until the idle connections' 10 s handshake deadline freed descriptors (CPU time, not wall
  // time: a loaded machine does not change it).
  double cpu = -1;
  ASSERT_EQ(std::sscanf(rest.c_str(), "cpu %lf", &cpu), 1) << rest;
  EXPECT_LT(cpu, 2.0) << rest;
}

TEST(Rendezvous, TruncatedAndMalformedMessagesAreRefused) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), 7, false);
  {
    Fd truncated = raw_connect(root.unique_id().root());
    wire::FrameHeader h;
    h.type = 1;
    h.length = 100;
    send_exact(truncated.get(), &h, 10, Deadline::after(5), "root");  // part of a header, then close
  }
  {
    Fd garbage = raw_connect(root.unique_id().root());
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    send_exact(garbage.get(), junk, sizeof(junk), Deadline::after(5), "root");
    EXPECT_TRUE(closed_by_peer(garbage.get()));
  }
  {
    Fd huge = raw_connect(root.unique_id().root());
    wire::FrameHeader h;
    h.type = 1;
    h.length = uint64_t{1} << 40;
    send_exact(huge.get(), &h, sizeof(h), Deadline::after(5), "root");
    EXPECT_TRUE(closed_by_peer(huge.get()));
  }
  {
    // A well-framed hello whose payload is short: the reader must not run past the end.
    Fd shortp = raw_connect(root.unique_id().root());
    wire::FrameHeader h;
    h.type = 1;
    h.length = 4;
    uint32_t secret_part = 7;
    send_exact(shortp.get(), &h, sizeof(h), Deadline::after(5), "root");
    send_exact(shortp.get(), &secret_part, 4, Deadline::after(5), "root");
    EXPECT_TRUE(closed_by_peer(shortp.get()));
  }
  expect_rendezvous_works(root.unique_id());
}

TEST(Rendezvous, MissingRankTimesOutNamingIt) {
  CommOptions opts = CommOptions::from_env();
  opts.init_timeout_s = 1;
  UniqueId id = create_unique_id("");
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)  // rank 3 of 4 never comes
    threads.emplace_back([&, r] {
      try {
        Communicator::create(id, 4, r, opts);
      } catch (const Timeout& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_NE(errors[r].find("ranks 3 of 4 never arrived"), std::string::npos) << errors[r];
}

// Two clients that conflict: whichever the root sees second is refused with a message naming the
// conflict, the other times out waiting for the missing ranks. Exactly one refusal either way.
void expect_conflict(const UniqueId& id, int rank_a, int size_a, int rank_b, int size_b, uint64_t generation,
                         const std::string& expected) {
  std::vector<std::string> refused(2);
  auto run = [&](int slot, int rank, int size) {
    try {
      rendezvous(id, rank, size, generation, {0}, 1, nullptr);
    } catch (const InvalidArgument& e) {
      refused[slot] = e.what();
    } catch (const Timeout&) {
    }
  };
  std::thread a(run, 0, rank_a, size_a), b(run, 1, rank_b, size_b);
  a.join();
  b.join();
  // The root sees the conflict when the second rank arrives and fails both at once (the first one
  // would otherwise wait for the group until its timeout).
  for (const std::string& r : refused) EXPECT_NE(r.find(expected), std::string::npos) << refused[0] << " | " << refused[1];
}

TEST(Rendezvous, InconsistentSizesDuplicateAndOutOfRangeRanksAreNamed) {
  RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), 9, true);
  const UniqueId& id = root.unique_id();
  expect_conflict(id, 0, 3, 1, 4, 0, "ranks but rank");
  expect_conflict(id, 1, 2, 1, 2, 1, "joined twice");
  try {
    rendezvous(id, 7, 3, 2, {0}, 5, nullptr);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 7 is out of range for 3 ranks"), std::string::npos) << e.what();
  }
}

TEST(Bootstrap, MeshRefusesStrangersAndKeepsWorking) {
  auto comms = Communicator::create_local(2);
  SocketAddress listen = comms[0]->bootstrap().listen_address();
  if (listen.storage.ss_family == AF_INET && reinterpret_cast<sockaddr_in*>(&listen.storage)->sin_addr.s_addr == 0)
    listen = SocketAddress::parse("127.0.0.1:" + std::to_string(listen.port()));
  Fd stranger = raw_connect(listen);
  auth::Nonce challenge = auth::recv_challenge(stranger.get(), Deadline::after(5), "rank 0");
  wire::Writer w;
  w.put<int32_t>(1);
  auth::Mac guess = auth::mac(12345, "tutti mesh hello", challenge, w.bytes().data(), w.bytes().size());
  wire::FrameHeader h;
  h.type = static_cast<uint32_t>(wire::FrameType::kMeshHello);
  h.length = guess.size() + w.bytes().size();
  send_exact(stranger.get(), &h, sizeof(h), Deadline::after(5), "rank 0");
  send_exact(stranger.get(), guess.data(), guess.size(), Deadline::after(5), "rank 0");
  send_exact(stranger.get(), w.bytes().data(), w.bytes().size(), Deadline::after(5), "rank 0");
  EXPECT_TRUE(closed_by_peer(stranger.get()));
  int v = 5, got = 0;
  std::thread t([&] { comms[1]->send(0, &v, sizeof(v)); });
  comms[0]->recv(1, &got, sizeof(got));
  t.join();
  EXPECT_EQ(got, 5);
  std::thread b([&] { comms[1]->barrier(); });
  comms[0]->barrier();
  b.join();
}

std::string rank_binary() { return TUTTI_TEST_RANK_PATH; }

TEST(Processes, KilledRankGivesSurvivorsARemoteErrorNamingIt) {
  for (const char* transport : {"shm", "tcp"}) {
    RendezvousRoot root(SocketAddress::parse("127.0.0.1:0"), UniqueId::random_secret(), true);
    std::vector<std::map<std::string, std::string>> envs;
    for (int r = 0; r < 4; ++r)
      envs.push_back({{"TUTTI_RANK", std::to_string(r)},
                      {"TUTTI_SIZE", "4"},
                      {"TUTTI_COMM_ID", root.unique_id().hex()},
                      {"TUTTI_TRANSPORT", transport}});
    auto results = test_support::spawn_ranks({rank_binary(), "kill", "2"}, envs);
    EXPECT_TRUE(results[2].killed_by(SIGKILL)) << results[2].output;
    for (int r : {0, 1, 3}) {
      EXPECT_TRUE(results[r].exited(3)) << transport << " rank " << r << ": " << results[r].output;
      EXPECT_NE(results[r].output.find("rank 2"), std::string::npos) << results[r].output;
    }
  }
}

uint16_t free_port() {
  Fd l = listen_on(SocketAddress::parse("127.0.0.1:0"));
  return local_address(l.get()).port();
}

TEST(Processes, OpenMpiAndSlurmRankVariablesWithNcclCommId) {
  std::string comm_id = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::map<std::string, std::string>> ompi, slurm;
  for (int r = 0; r < 3; ++r) {
    ompi.push_back({{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                    {"OMPI_COMM_WORLD_SIZE", "3"},
                    {"NCCL_COMM_ID", comm_id},
                    {"TUTTI_COMM_SECRET", "ompi-test"}});
  }
  for (auto& res : test_support::spawn_ranks({rank_binary(), "exchange", "65536"}, ompi))
    EXPECT_TRUE(res.exited(0)) << res.output;
  comm_id = "127.0.0.1:" + std::to_string(free_port());
  for (int r = 0; r < 2; ++r)
    slurm.push_back({{"SLURM_PROCID", std::to_string(r)},
                     {"SLURM_NTASKS", "2"},
                     {"NCCL_COMM_ID", comm_id},
                     {"TUTTI_COMM_SECRET", "slurm-test"}});
  for (auto& res : test_support::spawn_ranks({rank_binary(), "exchange", "65536"}, slurm))
    EXPECT_TRUE(res.exited(0)) << res.output;
}

TEST(Processes, MissingRankVariablesGiveAClearError) {
  auto res = test_support::spawn_ranks({rank_binary(), "exchange"}, {{{"TUTTI_RANK", "0"}}});
  EXPECT_TRUE(res[0].exited(1));
  EXPECT_NE(res[0].output.find("the number of ranks is not set"), std::string::npos) << res[0].output;
}

}  // namespace
