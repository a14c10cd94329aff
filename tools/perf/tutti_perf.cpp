// tutti-perf: nccl-tests for tutti, through the NCCL API (libnccl.so.2).
//
//   tutti-perf COLL [-b 8] [-e 128M] [-f 2 | -i STEP] [-n 20] [-w 5] [-c 1] [-o sum|...|all]
//              [-d float|...|all] [-r ROOT|-1] [-z 0] [-a 1] [-t THREADS] [-G 0|1]
//   COLL: all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv
//
// Runs under tutti-run -n N (one rank per process, times -t threads) or alone with -t N threads.
// Prints nccl-tests' table (size, count, type, redop, root; time, algbw, busbw and #wrong for
// out-of-place and in-place) and the "Avg bus bandwidth" footer. Data follows nccl-tests' idea:
// small integers, so any reduction order is exact and results are compared bit for bit. The exit
// status is non-zero if any element is wrong or a call fails.
//
// -G 1 puts the buffers in CUDA device memory (the current device, 0 unless CUDA_VISIBLE_DEVICES
// says otherwise) and runs every rank's calls on a stream of its own, as nccl-tests does: several
// ranks of one GPU need concurrent kernels. Times then include waiting for the stream.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "collectives/include/nccl.h"
#ifdef TUTTI_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "core/datatype.hpp"
#include "core/element.hpp"
#include "core/env.hpp"
#include "core/reduce.hpp"
#include "tools/perf/reference.hpp"

using namespace tutti;

namespace {

// A data buffer: plain memory, or with -R 1 memory from ncclMemAlloc registered with the
// communicator, which peers on this host read in place (zero copy), as nccl-tests' -R does.
class Buffer {
 public:
  Buffer(size_t bytes, bool registered, bool device, ncclComm_t comm) : comm_(comm) {
    if (device) {
#ifdef TUTTI_HAVE_CUDA
      if (cudaMalloc(reinterpret_cast<void**>(&data_), bytes) != cudaSuccess ||
          cudaMemset(data_, 0, bytes) != cudaSuccess) {
        std::fprintf(stderr, "tutti-perf: cudaMalloc of %zu bytes failed\n", bytes);
        std::exit(1);
      }
      device_ = true;
      if (registered && ncclCommRegister(comm, data_, bytes, &handle_) != ncclSuccess) {
        std::fprintf(stderr, "tutti-perf: ncclCommRegister failed: %s\n", ncclGetLastError(comm));
        std::exit(1);
      }
#endif
    } else if (registered) {
      if (ncclMemAlloc(reinterpret_cast<void**>(&data_), bytes) != ncclSuccess ||
          ncclCommRegister(comm, data_, bytes, &handle_) != ncclSuccess) {
        std::fprintf(stderr, "tutti-perf: ncclMemAlloc/ncclCommRegister of %zu bytes failed: %s\n", bytes,
                     ncclGetLastError(comm));
        std::exit(1);
      }
      std::memset(data_, 0, bytes);
    } else {
      plain_.resize(bytes);
      data_ = plain_.data();
    }
  }
  ~Buffer() {
    if (handle_) ncclCommDeregister(comm_, handle_);
#ifdef TUTTI_HAVE_CUDA
    if (device_) {
      cudaFree(data_);
      return;
    }
#endif
    if (plain_.empty() && data_) ncclMemFree(data_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  unsigned char* data() { return data_; }

 private:
  ncclComm_t comm_;
  unsigned char* data_ = nullptr;
  void* handle_ = nullptr;
  bool device_ = false;
  std::vector<unsigned char> plain_;
};

// Host <-> buffer copies and waiting for a rank's calls: plain memory and the CPU executor need
// neither; device buffers go through cudaMemcpy and the rank's stream.
struct Memory {
  bool device = false;
  void* stream = nullptr;
  // On the rank's stream: a plain cudaMemcpy from pageable memory may return before its DMA is
  // done and is not ordered with a non-blocking stream (measured: in-place results computed from
  // the previous call's data).
  void to_buffer(void* dst, const void* src, size_t n) const {
#ifdef TUTTI_HAVE_CUDA
    if (device) {
      auto s = static_cast<cudaStream_t>(stream);
      if (n && (cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s) != cudaSuccess ||
                cudaStreamSynchronize(s) != cudaSuccess))
        fail("cudaMemcpyAsync to the device");
      return;
    }
#endif
    if (n) std::memcpy(dst, src, n);
  }
  void from_buffer(void* dst, const void* src, size_t n) const {
#ifdef TUTTI_HAVE_CUDA
    if (device) {
      auto s = static_cast<cudaStream_t>(stream);
      if (n && (cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
                cudaStreamSynchronize(s) != cudaSuccess))
        fail("cudaMemcpyAsync from the device");
      return;
    }
#endif
    if (n) std::memcpy(dst, src, n);
  }
  void wait() const {
#ifdef TUTTI_HAVE_CUDA
    if (device && cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) != cudaSuccess) fail("cudaStreamSynchronize");
#endif
  }
  [[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "tutti-perf: %s failed\n", what);
    throw std::runtime_error(what);
  }
};

enum class Coll { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kSendRecv };

struct Options {
  Coll coll = Coll::kAllReduce;
  std::string coll_name;
  uint64_t min_bytes = 32 << 20, max_bytes = 32 << 20;
  double factor = 2;
  uint64_t step = 0;
  int iters = 20, warmup = 5;
  bool check = true;
  std::vector<int> ops;        // ncclRedOp_t (5 = premulsum)
  std::vector<DataType> types;
  int root = 0;                // -1: all roots
  bool blocking = true;
  int average = 1;
  int threads = 1;
  bool alltoall_api = false;  // -A 1: ncclAlltoAll (NCCL 2.28; MSCCL's ncclAllToAll is the same call) instead of grouped send/recv
  bool registered = false;    // -R 1: buffers from ncclMemAlloc, registered (nccl-tests' user buffer registration)
  bool device = false;        // -G 1: buffers in CUDA device memory, a stream per rank
};

constexpr const char* kUsage =
    "usage: tutti-perf COLL [-b min] [-e max] [-f factor|-i step] [-n iters] [-w warmup] [-c 0|1] [-o op|all]\n"
    "                  [-d type|all] [-r root|-1] [-z 0|1] [-a 0-3] [-t threads] [-A 0|1] [-R 0|1] [-G 0|1]\n"
    "COLL: all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv (allreduce... accepted)\n"
    "Flags follow nccl-tests' (any order, before or after COLL); -g, -m, -p are accepted and ignored.\n"
    "Ranks: -t threads per process; processes from tutti-run, mpirun or srun (set NCCL_COMM_ID=host:port\n"
    "and the same TUTTI_COMM_SECRET under mpirun/srun so they can meet).\n";

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr, "tutti-perf: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

uint64_t parse_bytes(const std::string& flag, const char* s) {
  try {
    return env::parse_size(s);
  } catch (const std::exception&) {
    usage(flag + ": '" + s + "' is not a size (bytes, or with K/M/G)");
  }
}

int parse_int(const std::string& flag, const char* v, int lowest) {
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lowest || x > 1 << 30)
    usage(flag + ": '" + v + "' is not a whole number of at least " + std::to_string(lowest));
  return static_cast<int>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  const std::pair<const char*, Coll> names[] = {{"all_reduce", Coll::kAllReduce},   {"all_gather", Coll::kAllGather},
                                                {"reduce_scatter", Coll::kReduceScatter}, {"broadcast", Coll::kBroadcast},
                                                {"reduce", Coll::kReduce},           {"alltoall", Coll::kAllToAll},
                                                {"sendrecv", Coll::kSendRecv}};
  auto plain = [](std::string n) {  // one spelling: all_reduce, allreduce, all-reduce
    std::erase_if(n, [](char c) { return c == '_' || c == '-'; });
    return n;
  };
  std::string ops = "sum", types = "float";
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (f.empty() || f[0] != '-') {
      if (!o.coll_name.empty()) usage("two collectives given: " + o.coll_name + " and " + f);
      o.coll_name = f;
      bool found = false;
      for (auto& [n, c] : names)
        if (plain(f) == plain(n)) o.coll = c, o.coll_name = n, found = true;
      if (!found) usage("unknown collective " + f);
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + f);
    const char* v = argv[++i];
    if (f == "-b") o.min_bytes = parse_bytes(f, v);
    else if (f == "-e") o.max_bytes = parse_bytes(f, v);
    else if (f == "-f") {
      o.factor = std::atof(v);
      if (!(o.factor > 1)) usage(std::string("-f: the size factor must be above 1, not '") + v + "'");
    } else if (f == "-i") o.step = parse_bytes(f, v);
    else if (f == "-n") o.iters = parse_int(f, v, 1);
    else if (f == "-w") o.warmup = parse_int(f, v, 0);
    else if (f == "-c") o.check = parse_int(f, v, 0) != 0;
    else if (f == "-o") ops = v;
    else if (f == "-d") types = v;
    else if (f == "-r") o.root = parse_int(f, v, -1);
    else if (f == "-z") o.blocking = parse_int(f, v, 0) == 0;
    else if (f == "-a") o.average = parse_int(f, v, 0);
    else if (f == "-t") o.threads = parse_int(f, v, 1);
    else if (f == "-A") o.alltoall_api = parse_int(f, v, 0) != 0;
    else if (f == "-R") o.registered = parse_int(f, v, 0) != 0;
    else if (f == "-G") o.device = parse_int(f, v, 0) != 0;
    else if (f == "-g" || f == "-m" || f == "-p") continue;  // nccl-tests flags without meaning here
    else usage("unknown flag " + f);
  }
  if (o.coll_name.empty()) usage("missing collective");
#ifndef TUTTI_HAVE_CUDA
  if (o.device) usage("-G 1 needs a CUDA build");
#endif
  if (o.min_bytes > o.max_bytes) usage("-b (smallest size) is above -e (largest size)");
  if (ops == "all") o.ops = {0, 1, 2, 3, 4, 5};
  else {
    auto op = parse_redop(ops);
    if (!op) usage("unknown op " + ops);
    o.ops = {static_cast<int>(*op)};
  }
  if (types == "all") {
    for (int t = 0; t < kNumDataTypes; ++t) o.types.push_back(static_cast<DataType>(t));
  } else {
    auto t = parse_datatype(types);
    if (!t) usage("unknown datatype " + types);
    o.types = {*t};
  }
  bool reduces = o.coll == Coll::kAllReduce || o.coll == Coll::kReduce || o.coll == Coll::kReduceScatter;
  if (!reduces) o.ops = {0};
  return o;
}

// This process's rank and the number of processes, from tutti-run or the launchers the library
// reads (mpirun, PMI, srun); 1 process without any.
std::pair<int, int> process_rank_and_count() {
  auto first = [](std::initializer_list<const char*> names) -> const char* {
    for (const char* n : names)
      if (const char* v = std::getenv(n)) return v;
    return nullptr;
  };
  const char* rank = first({"TUTTI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"});
  const char* size = first({"TUTTI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
  int procs = size ? std::atoi(size) : 1, proc = rank ? std::atoi(rank) : 0;
  if (procs > 1 && !std::getenv("TUTTI_COMM_ID") && !std::getenv("NCCL_COMM_ID")) {
    std::fprintf(stderr,
                 "tutti-perf: rank %d of %d processes (from the launcher's environment), but no rendezvous address: "
                 "set NCCL_COMM_ID=host:port and TUTTI_COMM_SECRET for every process, or start them with tutti-run\n",
                 proc, procs);
    std::exit(2);
  }
  return {proc, procs};
}

double bus_factor(Coll c, int n) {
  switch (c) {
    case Coll::kAllReduce: return 2.0 * (n - 1) / n;
    case Coll::kAllGather:
    case Coll::kReduceScatter:
    case Coll::kAllToAll: return static_cast<double>(n - 1) / n;
    default: return 1;
  }
}

// Elements per rank piece (NCCL's count) for a size in bytes, nccl-tests' convention.
size_t count_of(Coll c, uint64_t bytes, size_t esize, int n) {
  size_t elems = bytes / esize;
  if (c == Coll::kAllGather || c == Coll::kReduceScatter || c == Coll::kAllToAll) return elems / n;
  return elems;
}

using reference::value;  // element i of rank r, as a double (tools/perf/reference.hpp)

void store(DataType t, void* base, size_t i, double v) {
  store_value(t, static_cast<unsigned char*>(base) + i * size_of(t), v);
}

struct Shared {
  Options opt;
  int nranks = 1;
  std::atomic<long> wrong{0};
  std::atomic<int> failed{0};
  double bw_sum = 0;
  int bw_count = 0;
};

#define CHECK_NCCL(call)                                                                                   \
  do {                                                                                                     \
    ncclResult_t rc_ = (call);                                                                             \
    if (rc_ != ncclSuccess && rc_ != ncclInProgress) {                                                     \
      std::fprintf(stderr, "tutti-perf: rank %d: %s failed: %s: %s\n", rank, #call, ncclGetErrorString(rc_), \
                   ncclGetLastError(comm));                                                                \
      throw std::runtime_error("nccl call failed");                                                        \
    }                                                                                                      \
  } while (0)

class Rank {
 public:
  // The buffers are allocated once, for the largest size, as nccl-tests does: freeing device memory
  // synchronizes the whole device, which must not happen while another rank of this GPU waits in a
  // collective for this one.
  Rank(Shared& s, ncclComm_t comm, int rank, Memory mem)
      : s_(s),
        comm_(comm),
        rank_(rank),
        mem_(mem),
        send_(s.opt.max_bytes + 64, s.opt.registered, s.opt.device, comm),
        recv_(s.opt.max_bytes + 64, s.opt.registered, s.opt.device, comm),
        sync_(64, false, s.opt.device, comm) {}

  // One size, one type, one op, one root; returns per-rank (time us, wrong) for out-of-place and in-place.
  void run_case(uint64_t bytes, DataType t, int op_index, int root, double times[2], long wrong[2]) {
    const Options& o = s_.opt;
    const int n = s_.nranks, rank = rank_;
    ncclComm_t comm = comm_;
    const size_t es = size_of(t), count = count_of(o.coll, bytes, es, n);
    size_t in_elems = count, out_elems = count;
    if (o.coll == Coll::kAllGather) out_elems = count * n;
    if (o.coll == Coll::kReduceScatter || o.coll == Coll::kAllToAll) in_elems = count * n;
    if (o.coll == Coll::kAllToAll) out_elems = count * n;
    Buffer& send = send_;
    Buffer& recv = recv_;
    cudaStream_t stream = static_cast<cudaStream_t>(mem_.stream);
    std::vector<unsigned char> expect(std::max<size_t>(out_elems, 1) * es);
    ncclRedOp_t op = static_cast<ncclRedOp_t>(std::min(op_index, 4));
    ncclRedOp_t premul{};
    if (op_index == 5) {
      unsigned char two[8] = {};
      store(t, two, 0, 2.0);
      CHECK_NCCL(ncclRedOpCreatePreMulSum(&premul, two, static_cast<ncclDataType_t>(t), ncclScalarHostImmediate, comm));
      op = premul;
    }
    std::vector<unsigned char> staging(std::max(in_elems, out_elems) * es);
    auto fill = [&](void* buf, size_t elems, size_t offset_elems) {
      for (size_t i = 0; i < elems; ++i) store(t, staging.data(), i, value(t, op_index, rank, i + offset_elems));
      mem_.to_buffer(buf, staging.data(), elems * es);
    };
    // Expected output for this rank.
    auto expected = [&]() {
      for (size_t i = 0; i < out_elems; ++i) {
        double v = 0;
        switch (o.coll) {
          case Coll::kAllReduce:
          case Coll::kReduce:
          case Coll::kReduceScatter:
            v = reference::reduced(t, op_index, n, o.coll == Coll::kReduceScatter ? rank * count + i : i);
            break;
          case Coll::kAllGather: v = value(t, op_index, static_cast<int>(i / count), i % count); break;
          case Coll::kBroadcast: v = value(t, op_index, root, i); break;
          case Coll::kAllToAll: v = value(t, op_index, static_cast<int>(i / count), rank * count + i % count); break;
          case Coll::kSendRecv: v = value(t, op_index, (rank + n - 1) % n, i); break;
        }
        store(t, expect.data(), i, v);
      }
      if (op_index == 4) divide(t, expect.data(), expect.data(), static_cast<uint64_t>(n), out_elems);
    };
    // A non-blocking communicator (-z 1) returns ncclInProgress: wait for the call to be issued.
    auto settle = [&] {
      if (o.blocking) return;
      ncclResult_t st;
      do CHECK_NCCL(ncclCommGetAsyncError(comm, &st));
      while (st == ncclInProgress);
      CHECK_NCCL(st);
    };
    auto call = [&](const void* sb, void* rb) {
      switch (o.coll) {
        case Coll::kAllReduce: CHECK_NCCL(ncclAllReduce(sb, rb, count, (ncclDataType_t)t, op, comm, stream)); break;
        case Coll::kAllGather: CHECK_NCCL(ncclAllGather(sb, rb, count, (ncclDataType_t)t, comm, stream)); break;
        case Coll::kReduceScatter: CHECK_NCCL(ncclReduceScatter(sb, rb, count, (ncclDataType_t)t, op, comm, stream)); break;
        case Coll::kBroadcast: CHECK_NCCL(ncclBroadcast(sb, rb, count, (ncclDataType_t)t, root, comm, stream)); break;
        case Coll::kReduce: CHECK_NCCL(ncclReduce(sb, rb, count, (ncclDataType_t)t, op, root, comm, stream)); break;
        case Coll::kAllToAll:
          if (o.alltoall_api) {
            CHECK_NCCL(ncclAlltoAll(sb, rb, count, (ncclDataType_t)t, comm, stream));  // NCCL 2.28's spelling
            break;
          }
          CHECK_NCCL(ncclGroupStart());
          for (int q = 0; q < n; ++q) {
            CHECK_NCCL(ncclSend(static_cast<const unsigned char*>(sb) + q * count * es, count, (ncclDataType_t)t, q, comm, stream));
            CHECK_NCCL(ncclRecv(static_cast<unsigned char*>(rb) + q * count * es, count, (ncclDataType_t)t, q, comm, stream));
          }
          CHECK_NCCL(ncclGroupEnd());
          break;
        case Coll::kSendRecv:
          CHECK_NCCL(ncclGroupStart());
          CHECK_NCCL(ncclSend(sb, count, (ncclDataType_t)t, (rank + 1) % n, comm, stream));
          CHECK_NCCL(ncclRecv(rb, count, (ncclDataType_t)t, (rank + n - 1) % n, comm, stream));
          CHECK_NCCL(ncclGroupEnd());
          break;
      }
      settle();
    };
    // Every rank starts its timed calls together, as nccl-tests (Barrier) and MPI benchmarks
    // (MPI_Barrier) do: without it a rank that finished the warm-up early, such as a broadcast's
    // root that runs ahead of its readers, counts the others' lateness as its own time. An
    // all-reduce is a barrier: no rank leaves it before every rank has entered.
    auto barrier = [&] {
      CHECK_NCCL(ncclAllReduce(sync_.data(), sync_.data(), 1, ncclFloat, ncclSum, comm, stream));
      settle();
      mem_.wait();
    };
    if (o.check) expected();
    for (int place = 0; place < 2; ++place) {
      bool inplace = place == 1;
      if (inplace && (o.coll == Coll::kAllToAll || o.coll == Coll::kSendRecv)) {
        times[1] = -1;
        wrong[1] = 0;
        continue;  // nccl-tests runs these out-of-place only... for in-place too, but they need a copy
      }
      // In place: the input sits where NCCL expects it inside the receive buffer.
      unsigned char* sb = send.data();
      unsigned char* rb = recv.data();
      if (inplace) {
        if (o.coll == Coll::kAllGather) sb = rb + rank * count * es;
        else if (o.coll == Coll::kReduceScatter) {
          rb = send.data() + rank * count * es;
          sb = send.data();
        } else sb = rb;
      }
      auto reset = [&] { fill(sb, in_elems, 0); };
      reset();
      for (int w = 0; w < o.warmup; ++w) {
        call(sb, rb);
        mem_.wait();
        reset();
      }
      // Timed: consecutive calls; the data is checked on a separate, fresh call.
      barrier();
      double t0 = now();
      for (int it = 0; it < o.iters; ++it) call(sb, rb);
      mem_.wait();
      times[place] = (now() - t0) / o.iters * 1e6;
      wrong[place] = 0;
      if (o.check) {
        reset();
        call(sb, rb);
        mem_.wait();
        mem_.from_buffer(staging.data(), rb, out_elems * es);
        const unsigned char* got = staging.data();
        bool meaningful = !(o.coll == Coll::kReduce && rank != root);
        if (meaningful)
          for (size_t i = 0; i < out_elems; ++i)
            if (std::memcmp(got + i * es, expect.data() + i * es, es) != 0) ++wrong[place];
      }
    }
    if (op_index == 5) CHECK_NCCL(ncclRedOpDestroy(premul, comm));
  }

  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 private:
  Shared& s_;
  ncclComm_t comm_;
  int rank_;
  Memory mem_;
  Buffer send_, recv_;
  Buffer sync_;  // the barrier's all-reduce, apart from the data
};

}  // namespace

int main(int argc, char** argv) {
  Shared s;
  s.opt = parse(argc, argv);
  // Each rank thread's stream needs a hardware queue of its own: two streams that share one run
  // their kernels in order, and a collective's kernels wait for each other. CUDA's default is 8
  // queues; set before the first CUDA call. (Processes have a context, and queues, each.)
  if (s.opt.device) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  const Options& o = s.opt;
  const std::pair<int, int> proc_count = process_rank_and_count();
  const int proc = proc_count.first, procs = proc_count.second;  // not a structured binding: lambdas capture them (clang 14)
  s.nranks = procs * o.threads;
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) {
    std::fprintf(stderr, "tutti-perf: ncclGetUniqueId failed: %s\n", ncclGetLastError(nullptr));
    return 1;
  }
  if (proc == 0) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::printf("# nThread %d nGpus 1 minBytes %llu maxBytes %llu step: %g(%s) warmup iters: %d iters: %d agg iters: 1 "
                "validation: %d graph: 0\n#\n# Using devices\n",
                o.threads, (unsigned long long)o.min_bytes, (unsigned long long)o.max_bytes, o.step ? (double)o.step : o.factor,
                o.step ? "bytes" : "factor", o.warmup, o.iters, o.check ? 1 : 0);
    std::printf("#  Rank %2d Group  0 Pid %6d on %10s device  - [%s] tutti (%d ranks)\n#\n", 0, getpid(), host,
                o.device ? "device memory" : "host memory", s.nranks);
    std::printf("#                                                              out-of-place                       in-place\n");
    std::printf("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    std::printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n");
    std::fflush(stdout);
  }
  std::vector<uint64_t> sizes;
  for (uint64_t b = o.min_bytes; b <= o.max_bytes;) {
    sizes.push_back(b);
    uint64_t next = o.step ? b + o.step : static_cast<uint64_t>(std::max<double>(b * o.factor, b + 1));
    if (next <= b) break;
    b = next;
  }
  std::vector<std::vector<double>> results(o.threads);  // per thread: time values to average
  std::vector<std::thread> threads;
  int exit_code = 0;
  for (int t = 0; t < o.threads; ++t)
    threads.emplace_back([&, t] {
      int rank = proc * o.threads + t;
      ncclComm_t comm = nullptr;
      try {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = o.blocking ? 1 : 0;
        CHECK_NCCL(ncclCommInitRankConfig(&comm, s.nranks, id, rank, &cfg));
        if (!o.blocking) {
          ncclResult_t st;
          do CHECK_NCCL(ncclCommGetAsyncError(comm, &st));
          while (st == ncclInProgress);
          CHECK_NCCL(st);
        }
        Memory mem;
        mem.device = o.device;
#ifdef TUTTI_HAVE_CUDA
        cudaStream_t stream = nullptr;
        if (o.device && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
          Memory::fail("cudaStreamCreate");
        mem.stream = stream;
#endif
        auto rank_state = std::make_unique<Rank>(s, comm, rank, mem);  // its buffers go before the communicator
        Rank& r = *rank_state;
        std::vector<int> roots;
        bool has_root = o.coll == Coll::kBroadcast || o.coll == Coll::kReduce;
        if (!has_root) roots = {-1};
        else if (o.root < 0) for (int q = 0; q < s.nranks; ++q) roots.push_back(q);
        else roots = {o.root};
        // Agreement on times and errors: an allreduce of (time, wrong) over all ranks.
        std::vector<double> agg(4);
        for (DataType type : o.types)
          for (int op : o.ops)
            for (int root : roots)
              for (uint64_t bytes : sizes) {
                if (has_root && (root < 0 || root >= s.nranks)) throw std::runtime_error("root out of range");
                size_t es = size_of(type);
                size_t count = count_of(o.coll, bytes, es, s.nranks);
                double times[2];
                long wrong[2];
                r.run_case(bytes, type, op, std::max(root, 0), times, wrong);
                double mine[4] = {times[0], times[1], static_cast<double>(wrong[0]), static_cast<double>(wrong[1])};
                double sum[4];
                auto settle = [&] {
                  // A non-blocking communicator returns ncclInProgress: wait before reading results.
                  ncclResult_t st = ncclSuccess;
                  if (!o.blocking)
                    do CHECK_NCCL(ncclCommGetAsyncError(comm, &st));
                    while (st == ncclInProgress);
                  CHECK_NCCL(st);
                };
                CHECK_NCCL(ncclAllReduce(mine, sum, 4, ncclFloat64, ncclSum, comm, nullptr));
                settle();
                double tmax[2];
                CHECK_NCCL(ncclAllReduce(mine, tmax, 2, ncclFloat64, ncclMax, comm, nullptr));
                settle();
                if (rank == 0) {
                  double tt[2];
                  for (int k = 0; k < 2; ++k) tt[k] = o.average == 1 ? sum[k] / s.nranks : o.average == 3 ? tmax[k] : times[k];
                  size_t report_bytes = count * es * (o.coll == Coll::kAllGather || o.coll == Coll::kReduceScatter || o.coll == Coll::kAllToAll ? s.nranks : 1);
                  auto col = [&](int k) {
                    if (times[k] < 0) return std::string("      N/A     N/A     N/A    N/A");
                    double algbw = report_bytes / (tt[k] * 1e-6) / 1e9;
                    double busbw = algbw * bus_factor(o.coll, s.nranks);
                    if (k == 0 || times[1] < 0) s.bw_sum += busbw, ++s.bw_count;
                    return fmt::format(" {:8.2f} {:7.2f} {:7.2f} {:6.0f}", tt[k], algbw, busbw, sum[2 + k]);
                  };
                  std::string redop = op == 5 ? "premulsum" : std::string(name(static_cast<RedOp>(op)));
                  bool reduces = o.coll == Coll::kAllReduce || o.coll == Coll::kReduce || o.coll == Coll::kReduceScatter;
                  std::printf("%12zu  %12zu  %8s  %6s  %6d %s %s\n", report_bytes, count, std::string(name(type)).c_str(),
                              reduces ? redop.c_str() : "none", root, col(0).c_str(), col(1).c_str());
                  std::fflush(stdout);
                  s.wrong += static_cast<long>(sum[2] + sum[3]);
                }
              }
        rank_state.reset();
        CHECK_NCCL(ncclCommDestroy(comm));
#ifdef TUTTI_HAVE_CUDA
        if (stream) cudaStreamDestroy(stream);
#endif
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tutti-perf: rank %d: %s\n", rank, e.what());
        s.failed = 1;
        if (comm) ncclCommAbort(comm);
      }
    });
  for (auto& th : threads) th.join();
  if (proc == 0) {
    std::printf("# Out of bounds values : %ld %s\n", s.wrong.load(), s.wrong.load() == 0 ? "OK" : "FAILED");
    std::printf("# Avg bus bandwidth    : %g \n", s.bw_count ? s.bw_sum / s.bw_count : 0.0);
    if (s.failed.load()) std::printf("# Errors               : a rank's NCCL call failed (its message is on stderr) FAILED\n");
    std::printf("#\n");
  }
  if (s.wrong.load() != 0 || s.failed.load()) exit_code = 1;
  return exit_code;
}
