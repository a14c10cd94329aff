// tutti-storm: a collective storm. Every rank draws the same random sequence of calls from a fixed
// seed and issues them on three communicators at once: the world, a split into even and odd ranks,
// and a split with the ranks in reverse order. Calls are every collective (all-reduce, all-gather,
// reduce-scatter, broadcast, reduce, all-to-all, a ring of sends and receives), every datatype and
// op (premulsum too), counts from 0 to --max-bytes (odd counts, log-uniform sizes), in place and
// out of place, roots at random, alone or several in one ncclGroupStart/End. Every result is
// compared bit for bit with the reference (nccl-tests' data: small integers, so every reduction
// order is exact).
//
//   tutti-storm [--calls K] [--seed S] [--max-bytes B] [--threads T] [--mismatch]
//
// Under tutti-run every process runs T ranks as threads (default 1). Each rank prints one line,
// "rank R: storm of K calls (seed S): W wrong, E failed"; the exit status is 0 only if every rank
// of this process saw no wrong element and no failed call.
//
// --mismatch: K calls on the world communicator, a fresh one for each, where in most calls one
// rank (drawn at random) changes one thing of its call: the count (doubled, halved, one more), the
// datatype, the op, the root or the collective; then every rank makes a matching small all-reduce
// (the next call). Every rank checks its own outcome: an error (what a mismatch must give, in the
// call or, for a rank that finished its part first, at the next call), or success with exactly its
// own call's result; success with any other result is "wrong". Each rank prints "rank R: mismatch
// storm of K calls (M mismatched, ...): E errors in the call, N at the next call, Q quiet, W wrong,
// F matching calls failed", where quiet counts mismatched calls that never gave this rank an error
// (ranks that each broadcast from themselves, for one); the exit status is 0 only if no rank saw a
// wrong result and every matching call succeeded. Set TUTTI_TIMEOUT: a mismatch that no message
// shows (two ranks that each take themselves for a reduce's root) ends there.
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/include/nccl.h"
#include "core/datatype.hpp"
#include "core/reduce.hpp"
#include "tests/support/args.hpp"
#include "tools/perf/reference.hpp"

using namespace tutti;

namespace {

enum class Coll { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kSendRecv };
constexpr int kColls = 7;
const char* const kNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv"};

struct Options {
  int calls = 60;
  uint64_t seed = 1;
  uint64_t max_bytes = 8 << 20;
  int threads = 1;
};

// One call as every rank drew it. `root_draw` becomes a root of whichever communicator it runs on.
struct Call {
  Coll coll;
  DataType type;
  int op;  // 0 sum, 1 prod, 2 max, 3 min, 4 avg, 5 premulsum (by 2)
  size_t count;
  bool inplace;
  uint64_t root_draw;
  int comm;  // 0 world, 1 parity split, 2 reversed split
  uint64_t salt;
};

// nccl-tests' kind of data (tools/perf/reference.hpp), shifted by a per-call salt so that
// consecutive calls move different values.
double value(DataType t, int op, int rank, size_t i, uint64_t salt) { return reference::value(t, op, rank, i + salt); }

Call draw(std::mt19937_64& rng, const Options& o, bool allow_p2p) {
  Call c;
  c.coll = static_cast<Coll>(rng() % (allow_p2p ? kColls : kColls - 1));
  c.type = static_cast<DataType>(rng() % kNumDataTypes);
  c.op = static_cast<int>(rng() % 6);
  const size_t es = size_of(c.type);
  if (rng() % 16 == 0) {
    c.count = 0;
  } else {
    // Log-uniform bytes in [es, max_bytes], an odd count; the pieces of gathers and scatters are
    // per rank, so their totals stay within max_bytes for up to 8 ranks.
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    uint64_t bytes = static_cast<uint64_t>(std::exp(u * std::log(static_cast<double>(o.max_bytes) / es))) * es;
    if (c.coll == Coll::kAllGather || c.coll == Coll::kReduceScatter || c.coll == Coll::kAllToAll) bytes /= 8;
    c.count = std::max<size_t>(1, bytes / es) | 1;
  }
  c.inplace = (rng() & 1) && c.coll != Coll::kAllToAll && c.coll != Coll::kSendRecv;
  c.root_draw = rng();
  c.comm = static_cast<int>(rng() % 3);
  c.salt = rng() % 1000;
  return c;
}

// Rank `me`'s result of call `c` on n ranks, out_elems elements (the reference: nccl-tests' data).
void expected_result(const Call& c, int n, int me, size_t out_elems, std::vector<unsigned char>& expect) {
  const size_t es = size_of(c.type), count = c.count;
  const int root = static_cast<int>(c.root_draw % static_cast<uint64_t>(n));
  expect.assign(std::max<size_t>(out_elems, 1) * es, 0);
  for (size_t i = 0; i < out_elems; ++i) {
    double v = 0;
    switch (c.coll) {
      case Coll::kAllReduce:
      case Coll::kReduce:
      case Coll::kReduceScatter:
        v = reference::reduced(c.type, c.op, n, (c.coll == Coll::kReduceScatter ? me * count + i : i) + c.salt);
        break;
      case Coll::kAllGather: v = value(c.type, c.op, static_cast<int>(i / count), i % count, c.salt); break;
      case Coll::kBroadcast: v = value(c.type, c.op, root, i, c.salt); break;
      case Coll::kAllToAll:
        v = value(c.type, c.op, static_cast<int>(i / count), me * count + i % count, c.salt);
        break;
      case Coll::kSendRecv: v = value(c.type, c.op, (me + n - 1) % n, i, c.salt); break;
    }
    store_value(c.type, expect.data() + i * es, v);
  }
  const bool reduces = c.coll == Coll::kAllReduce || c.coll == Coll::kReduce || c.coll == Coll::kReduceScatter;
  if (reduces && c.op == 4) divide(c.type, expect.data(), expect.data(), static_cast<uint64_t>(n), out_elems);
}

// Elements of `got` that differ from `expect`, bit for bit.
long count_wrong(const unsigned char* got, const std::vector<unsigned char>& expect, size_t elems, size_t es) {
  long wrong = 0;
  for (size_t i = 0; i < elems; ++i)
    if (std::memcmp(got + i * es, expect.data() + i * es, es) != 0) ++wrong;
  return wrong;
}

#define STORM_CHECK(call)                                                                                          \
  do {                                                                                                            \
    ncclResult_t rc_ = (call);                                                                                    \
    if (rc_ != ncclSuccess) throw std::runtime_error(std::string(#call) + ": " + ncclGetErrorString(rc_) + ": " + \
                                                     ncclGetLastError(nullptr));                                 \
  } while (0)

class Rank {
 public:
  Rank(const Options& o, int rank, int nranks, ncclComm_t world) : o_(o), rank_(rank) {
    comms_[0] = world;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    STORM_CHECK(ncclCommSplit(world, rank % 2, rank, &comms_[1], &cfg));
    STORM_CHECK(ncclCommSplit(world, 0, nranks - rank, &comms_[2], &cfg));
    for (auto& b : bufs_) {
      b.send.assign(o.max_bytes + 64, 0);
      b.recv.assign(o.max_bytes + 64, 0);
    }
  }
  ~Rank() {
    ncclCommDestroy(comms_[1]);
    ncclCommDestroy(comms_[2]);
  }

  // Runs the whole sequence; returns the number of wrong elements and failed calls.
  std::pair<long, long> run() {
    std::mt19937_64 rng(o_.seed);
    long wrong = 0, failed = 0;
    for (int step = 0; step < o_.calls;) {
      // Alone, or two or three collectives in one group on one communicator.
      const int group = rng() % 4 == 0 ? 2 + static_cast<int>(rng() % 2) : 1;
      std::vector<Call> calls;
      for (int g = 0; g < group; ++g) {
        calls.push_back(draw(rng, o_, group == 1));
        calls.back().comm = calls.front().comm;
      }
      step += group;
      try {
        if (group > 1) STORM_CHECK(ncclGroupStart());
        for (int g = 0; g < group; ++g) issue(calls[g], bufs_[g]);
        if (group > 1) STORM_CHECK(ncclGroupEnd());
        // A premulsum op lives until the group that uses it has run.
        for (auto& [op, comm] : premuls_) STORM_CHECK(ncclRedOpDestroy(op, comm));
        premuls_.clear();
        for (int g = 0; g < group; ++g) {
          long w = check(calls[g], bufs_[g]);
          if (w)
            std::fprintf(stderr, "rank %d: %ld wrong in %s of %zu %s (op %d, %s, comm %d%s)\n", rank_, w,
                         kNames[static_cast<int>(calls[g].coll)], calls[g].count,
                         std::string(name(calls[g].type)).c_str(), calls[g].op,
                         calls[g].inplace ? "in place" : "out of place", calls[g].comm, group > 1 ? ", grouped" : "");
          wrong += w;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: call %d failed: %s\n", rank_, step, e.what());
        ++failed;
        break;  // the communicators may be unusable now; the exit status reports it
      }
    }
    return {wrong, failed};
  }

 private:
  struct Buffers {
    std::vector<unsigned char> send, recv;
    std::vector<unsigned char> expect;
    unsigned char *sb = nullptr, *rb = nullptr;
    size_t out_elems = 0;
    bool meaningful = true;
  };

  void issue(const Call& c, Buffers& b) {
    ncclComm_t comm = comms_[c.comm];
    int n = 0, me = 0;
    STORM_CHECK(ncclCommCount(comm, &n));
    STORM_CHECK(ncclCommUserRank(comm, &me));
    const size_t es = size_of(c.type), count = c.count;
    const int root = static_cast<int>(c.root_draw % static_cast<uint64_t>(n));
    const auto t = static_cast<ncclDataType_t>(c.type);
    size_t in_elems = count, out_elems = count;
    if (c.coll == Coll::kAllGather || c.coll == Coll::kAllToAll) out_elems = count * n;
    if (c.coll == Coll::kReduceScatter || c.coll == Coll::kAllToAll) in_elems = count * n;
    b.sb = b.send.data();
    b.rb = b.recv.data();
    if (c.inplace) {
      if (c.coll == Coll::kAllGather) b.sb = b.rb + me * count * es;
      else if (c.coll == Coll::kReduceScatter) b.sb = b.rb, b.rb = b.rb + me * count * es;
      else b.sb = b.rb;
    }
    for (size_t i = 0; i < in_elems; ++i) store_value(c.type, b.sb + i * es, value(c.type, c.op, me, i, c.salt));
    // The reference, before the call (in-place calls overwrite the input).
    b.out_elems = out_elems;
    b.meaningful = !(c.coll == Coll::kReduce && me != root);
    expected_result(c, n, me, out_elems, b.expect);
    const bool reduces = c.coll == Coll::kAllReduce || c.coll == Coll::kReduce || c.coll == Coll::kReduceScatter;
    ncclRedOp_t op = static_cast<ncclRedOp_t>(std::min(c.op, 4));
    ncclRedOp_t premul{};
    if (reduces && c.op == 5) {
      unsigned char two[8] = {};
      store_value(c.type, two, 2.0);
      STORM_CHECK(ncclRedOpCreatePreMulSum(&premul, two, t, ncclScalarHostImmediate, comm));
      op = premul;
    }
    switch (c.coll) {
      case Coll::kAllReduce: STORM_CHECK(ncclAllReduce(b.sb, b.rb, count, t, op, comm, nullptr)); break;
      case Coll::kAllGather: STORM_CHECK(ncclAllGather(b.sb, b.rb, count, t, comm, nullptr)); break;
      case Coll::kReduceScatter: STORM_CHECK(ncclReduceScatter(b.sb, b.rb, count, t, op, comm, nullptr)); break;
      case Coll::kBroadcast: STORM_CHECK(ncclBroadcast(b.sb, b.rb, count, t, root, comm, nullptr)); break;
      case Coll::kReduce: STORM_CHECK(ncclReduce(b.sb, b.rb, count, t, op, root, comm, nullptr)); break;
      case Coll::kAllToAll: STORM_CHECK(ncclAlltoAll(b.sb, b.rb, count, t, comm, nullptr)); break;
      case Coll::kSendRecv:
        STORM_CHECK(ncclGroupStart());
        STORM_CHECK(ncclSend(b.sb, count, t, (me + 1) % n, comm, nullptr));
        STORM_CHECK(ncclRecv(b.rb, count, t, (me + n - 1) % n, comm, nullptr));
        STORM_CHECK(ncclGroupEnd());
        break;
    }
    if (reduces && c.op == 5) premuls_.push_back({premul, comm});
  }

  long check(const Call& c, const Buffers& b) {
    if (!b.meaningful) return 0;
    const size_t es = size_of(c.type);
    checked_bytes_ += b.out_elems * es;
    return count_wrong(b.rb, b.expect, b.out_elems, es);
  }

  const Options& o_;
  int rank_;
  ncclComm_t comms_[3] = {};
  Buffers bufs_[3];
  std::vector<std::pair<ncclRedOp_t, ncclComm_t>> premuls_;

 public:
  uint64_t checked_bytes_ = 0;  // of results compared with the reference
};

// --- the mismatch storm ---------------------------------------------------------------------------

// What a rank changes in its call, when it is the odd one.
enum class Change { kNone, kCount, kType, kOp, kRoot, kCollective };
const char* const kChangeNames[] = {"none", "count", "datatype", "op", "root", "collective"};

struct MismatchCall {
  Call call;
  Change change = Change::kNone;
  int odd_rank = -1;
  uint64_t variant = 0;  // which new value the odd rank takes
};

MismatchCall draw_mismatch(std::mt19937_64& rng, const Options& o, int nranks) {
  MismatchCall m;
  m.call = draw(rng, o, false);
  m.call.comm = 0;
  m.call.count = std::max<size_t>(m.call.count, 2);
  m.call.op %= 5;  // no premulsum: its operator would be one more thing to match
  if (rng() % 5 != 0) {  // four calls in five are mismatched
    m.odd_rank = static_cast<int>(rng() % static_cast<uint64_t>(nranks));
    m.change = static_cast<Change>(1 + rng() % 5);
  }
  m.variant = rng();
  return m;
}

// The call rank `rank` makes: the drawn one, or the odd rank's changed one.
Call call_of(const MismatchCall& m, int rank, int nranks) {
  Call c = m.call;
  if (rank != m.odd_rank) return c;
  const bool reduces = c.coll == Coll::kAllReduce || c.coll == Coll::kReduce || c.coll == Coll::kReduceScatter;
  const bool rooted = c.coll == Coll::kBroadcast || c.coll == Coll::kReduce;
  Change change = m.change;
  if ((change == Change::kOp && !reduces) || (change == Change::kRoot && !rooted)) change = Change::kCount;
  switch (change) {
    case Change::kNone: break;
    case Change::kCount: {
      const size_t choices[] = {c.count * 2, c.count / 2, c.count + 1};
      c.count = choices[m.variant % 3];
      break;
    }
    case Change::kType:
      c.type = static_cast<DataType>((static_cast<int>(c.type) + 1 + m.variant % (kNumDataTypes - 1)) % kNumDataTypes);
      break;
    case Change::kOp: c.op = static_cast<int>((c.op + 1 + m.variant % 4) % 5); break;
    case Change::kRoot: c.root_draw = m.call.root_draw + 1 + m.variant % static_cast<uint64_t>(std::max(nranks - 1, 1)); break;
    case Change::kCollective: {
      // Another collective whose buffers this rank's call still covers (count * n elements at most).
      const Coll others[] = {Coll::kAllReduce, Coll::kBroadcast, Coll::kReduce, Coll::kAllGather, Coll::kReduceScatter,
                             Coll::kAllToAll};
      Coll next = others[m.variant % 6];
      if (next == c.coll) next = others[(m.variant + 1) % 6];
      c.coll = next;
      c.inplace = false;
      break;
    }
  }
  return c;
}

struct MismatchTally {
  long mismatched = 0, errors = 0, errors_next = 0, quiet = 0, wrong = 0, failed_matching = 0;
};

class MismatchRank {
 public:
  MismatchRank(int rank, int nranks) : rank_(rank), nranks_(nranks) {}

  // One call on `comm`, then a matching small all-reduce (the "next call": a rank that finished its
  // part of a mismatched call hears of it there); the tally says how they ended on this rank.
  // Returns whether the communicator failed.
  bool trial(const MismatchCall& m, ncclComm_t comm, MismatchTally& t) {
    const long errors_before = t.errors + t.failed_matching;
    const long quiet_before = t.quiet;
    one_call(m, comm, t);
    int32_t x = 1;
    const ncclResult_t next = ncclAllReduce(&x, &x, 1, ncclInt32, ncclSum, comm, nullptr);
    const bool failed_in_call = t.errors + t.failed_matching > errors_before;
    if (next != ncclSuccess && !failed_in_call) {
      if (m.odd_rank < 0) {
        ++t.failed_matching;
        std::fprintf(stderr, "rank %d: the call after a matching call failed: %s\n", rank_, ncclGetLastError(comm));
      } else if (t.quiet > quiet_before) {
        --t.quiet, ++t.errors_next;  // heard of the mismatch at the next call
      }
    }
    if (t.quiet > quiet_before && next == ncclSuccess) {
      const Call c = call_of(m, rank_, nranks_);
      std::fprintf(stderr, "rank %d: quiet: %s of %zu %s, op %d, root draw %llu (%s changed on rank %d)\n", rank_,
                   kNames[static_cast<int>(c.coll)], c.count, std::string(name(c.type)).c_str(), c.op,
                   static_cast<unsigned long long>(c.root_draw % static_cast<uint64_t>(nranks_)),
                   kChangeNames[static_cast<int>(m.change)], m.odd_rank);
    }
    if (next == ncclSuccess && x != nranks_) {
      ++t.wrong;
      std::fprintf(stderr, "rank %d: WRONG: the next call's all-reduce gave %d, not %d\n", rank_, x, nranks_);
    }
    return failed_in_call || next != ncclSuccess;
  }

 private:
  void one_call(const MismatchCall& m, ncclComm_t comm, MismatchTally& t) {
    const Call c = call_of(m, rank_, nranks_);
    if (m.odd_rank >= 0) ++t.mismatched;
    ncclResult_t rc = ncclSuccess;
    std::string error;
    try {
      rc = issue(c, comm);
    } catch (const std::exception& e) {
      rc = ncclInternalError;
      error = e.what();
    }
    if (rc != ncclSuccess) {
      if (m.odd_rank < 0) {
        ++t.failed_matching;
        std::fprintf(stderr, "rank %d: a matching %s failed: %s\n", rank_, kNames[static_cast<int>(c.coll)],
                     error.empty() ? ncclGetLastError(comm) : error.c_str());
      } else {
        ++t.errors;
      }
      return;
    }
    const long w = check(c);
    if (w) {
      ++t.wrong;
      std::fprintf(stderr, "rank %d: WRONG: %s of %zu %s (%s changed on rank %d) returned success with %ld wrong elements\n",
                   rank_, kNames[static_cast<int>(c.coll)], c.count, std::string(name(c.type)).c_str(),
                   kChangeNames[static_cast<int>(m.change)], m.odd_rank, w);
    } else if (m.odd_rank >= 0) {
      ++t.quiet;
    }
  }

  ncclResult_t issue(const Call& c, ncclComm_t comm) {
    const size_t es = size_of(c.type), count = c.count;
    const int n = nranks_, me = rank_;
    const int root = static_cast<int>(c.root_draw % static_cast<uint64_t>(n));
    const auto t = static_cast<ncclDataType_t>(c.type);
    size_t in_elems = count, out_elems = count;
    if (c.coll == Coll::kAllGather || c.coll == Coll::kAllToAll) out_elems = count * n;
    if (c.coll == Coll::kReduceScatter || c.coll == Coll::kAllToAll) in_elems = count * n;
    const size_t need = std::max(in_elems, out_elems) * es + 64;  // a changed call may need more
    if (send_.size() < need) send_.resize(need), recv_.resize(need);
    unsigned char* sb = send_.data();
    unsigned char* rb = recv_.data();
    std::fill(recv_.begin(), recv_.end(), 0);
    for (size_t i = 0; i < in_elems; ++i) store_value(c.type, sb + i * es, value(c.type, c.op, me, i, c.salt));
    out_elems_ = out_elems;
    meaningful_ = !(c.coll == Coll::kReduce && me != root);
    expected_result(c, n, me, out_elems, expect_);
    const auto op = static_cast<ncclRedOp_t>(c.op);
    switch (c.coll) {
      case Coll::kAllReduce: return ncclAllReduce(sb, rb, count, t, op, comm, nullptr);
      case Coll::kAllGather: return ncclAllGather(sb, rb, count, t, comm, nullptr);
      case Coll::kReduceScatter: return ncclReduceScatter(sb, rb, count, t, op, comm, nullptr);
      case Coll::kBroadcast: return ncclBroadcast(sb, rb, count, t, root, comm, nullptr);
      case Coll::kReduce: return ncclReduce(sb, rb, count, t, op, root, comm, nullptr);
      case Coll::kAllToAll: return ncclAlltoAll(sb, rb, count, t, comm, nullptr);
      case Coll::kSendRecv: break;
    }
    return ncclInternalError;
  }

  long check(const Call& c) const {
    if (!meaningful_) return 0;
    return count_wrong(recv_.data(), expect_, out_elems_, size_of(c.type));
  }

  int rank_, nranks_;
  std::vector<unsigned char> send_, recv_, expect_;
  size_t out_elems_ = 0;
  bool meaningful_ = true;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace

// Runs body(rank, thread index, print lock) on one thread per rank of this process; the exit status
// is 0 only if every body returned true.
int on_rank_threads(const Options& o, int proc, const std::function<bool(int, int, std::mutex&)>& body) {
  std::mutex print;
  std::vector<int> bad(o.threads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t)
    threads.emplace_back([&, t] { bad[t] = body(proc * o.threads + t, t, print) ? 0 : 1; });
  for (auto& th : threads) th.join();
  std::fflush(stdout);
  return std::count(bad.begin(), bad.end(), 1) ? 1 : 0;
}

// The mismatch storm on this process's ranks. Each call gets a fresh world communicator: a detected
// mismatch fails the one it ran on. Ranks that are threads of one process take each call's unique id
// from the first of them (a barrier hands it over); under tutti-run the environment's id serves all.
int mismatch_main(const Options& o, int proc, int procs) {
  const int nranks = procs * o.threads;
  const bool env_id = std::getenv("TUTTI_COMM_ID") != nullptr;
  std::barrier sync(o.threads);
  ncclUniqueId id{};
  return on_rank_threads(o, proc, [&](int rank, int t, std::mutex& print) {
    MismatchRank me(rank, nranks);
    MismatchTally tally;
    std::mt19937_64 rng(o.seed);
    for (int k = 0; k < o.calls; ++k) {
      const MismatchCall m = draw_mismatch(rng, o, nranks);
      if (!env_id && t == 0 && ncclGetUniqueId(&id) != ncclSuccess) std::abort();
      if (!env_id) sync.arrive_and_wait();
      ncclUniqueId mine = id;
      if (env_id) ncclGetUniqueId(&mine);
      if (!env_id) sync.arrive_and_wait();  // everyone has copied the id before the next one is made
      ncclComm_t comm = nullptr;
      if (ncclCommInitRank(&comm, nranks, mine, rank) != ncclSuccess) {
        std::lock_guard lock(print);
        std::printf("rank %d: init of call %d failed: %s\n", rank, k, ncclGetLastError(nullptr));
        if (!env_id) sync.arrive_and_drop();  // the other threads' inits fail in turn, not wait here
        return false;
      }
      if (me.trial(m, comm, tally)) ncclCommAbort(comm);
      else ncclCommDestroy(comm);
    }
    std::lock_guard lock(print);
    std::printf("rank %d: mismatch storm of %d calls (%ld mismatched, seed %llu, %d ranks): %ld errors in the call, "
                "%ld at the next call, %ld quiet, %ld wrong, %ld matching calls failed\n",
                rank, o.calls, tally.mismatched, static_cast<unsigned long long>(o.seed), nranks, tally.errors,
                tally.errors_next, tally.quiet, tally.wrong, tally.failed_matching);
    return tally.wrong == 0 && tally.failed_matching == 0;
  });
}

int main(int argc, char** argv) {
  Options o;
  bool mismatch = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--mismatch") {
      mismatch = true;
      --i;  // a flag without a value
      continue;
    }
    const char* text = i + 1 < argc ? argv[i + 1] : nullptr;
    const long long lowest = a == "--threads" ? 1 : a == "--max-bytes" ? 8 : 0;
    std::optional<long long> v;
    if (a == "--calls" || a == "--seed" || a == "--max-bytes" || a == "--threads")
      v = test_support::whole_flag("tutti-storm", a.c_str(), text, lowest);
    else
      std::fprintf(stderr, "usage: tutti-storm [--calls K] [--seed S] [--max-bytes B] [--threads T] [--mismatch]\n");
    if (!v) return 2;
    if (a == "--calls") o.calls = static_cast<int>(*v);
    else if (a == "--seed") o.seed = static_cast<uint64_t>(*v);
    else if (a == "--max-bytes") o.max_bytes = static_cast<uint64_t>(*v);
    else o.threads = static_cast<int>(*v);
  }
  const int proc = env_int("TUTTI_RANK", 0), procs = env_int("TUTTI_SIZE", 1);
  if (mismatch) return mismatch_main(o, proc, procs);
  const int nranks = procs * o.threads;
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) {
    std::fprintf(stderr, "tutti-storm: ncclGetUniqueId failed: %s\n", ncclGetLastError(nullptr));
    return 1;
  }
  return on_rank_threads(o, proc, [&](int rank, int, std::mutex& print) {
    ncclComm_t world = nullptr;
    bool good = false;
    try {
      STORM_CHECK(ncclCommInitRank(&world, nranks, id, rank));
      long wrong = 0, failed = 0;
      uint64_t checked = 0;
      {
        Rank r(o, rank, nranks, world);
        std::tie(wrong, failed) = r.run();
        checked = r.checked_bytes_;
      }
      std::lock_guard lock(print);
      std::printf("rank %d: storm of %d calls (seed %llu, %d ranks, %.1f MiB of results checked): %ld wrong, %ld "
                  "failed\n",
                  rank, o.calls, static_cast<unsigned long long>(o.seed), nranks, checked / 1048576.0, wrong, failed);
      good = !wrong && !failed;
    } catch (const std::exception& e) {
      std::lock_guard lock(print);
      std::printf("rank %d: %s\n", rank, e.what());
    }
    if (world) ncclCommDestroy(world);
    return good;
  });
}
