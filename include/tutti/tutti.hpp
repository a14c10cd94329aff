#pragma once
// tutti's C++ API: communicators, asynchronous collectives on typed spans, groups, and plans.
// Public and self-contained (standard headers and tutti/types.hpp only). The NCCL API (nccl.h) is
// the other way in; both run the same verified plans on the same runtime.
//
//   tutti::Comm comm = tutti::Comm::from_env();             // under tutti-run, mpirun or srun
//   std::vector<float> grad(n), sum(n);
//   tutti::Work w = comm.all_reduce<float>(grad, sum);       // returns at once
//   ... compute that does not touch grad or sum ...
//   w.wait();                                                // sum holds the all-reduce
//
// Ownership: a Comm owns its connections and its worker thread; destroying it waits for the calls
// it still holds, then leaves the group (as ncclCommDestroy). Buffers stay the caller's: they must
// stay valid and untouched (inputs unmodified, outputs unread) until the call's Work is done.
//
// Ordering: the calls of one Comm run one at a time, in the order they were made, on the Comm's
// worker thread; a collective matches the same call of every other rank (the k-th collective of one
// rank meets the k-th of the others, as in NCCL). When wait() returns, or test() returns true, the
// call's results are visible to the calling thread.
//
// Thread safety: make calls on one Comm from one thread at a time; Work handles may be waited on
// from any thread. abort() may be called from any thread.
//
// Errors: calls check their arguments and throw tutti::InvalidArgument at once; what goes wrong
// while a call runs (a peer failed, TUTTI_TIMEOUT, abort) is thrown by wait()/test() as the kinds
// of tutti::Error in tutti/types.hpp, naming the rank, peer and collective.
//
// Buffers are host memory in this API (device buffers: use the NCCL API on a stream).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tutti/types.hpp"

namespace tutti {

namespace api_detail {
struct CommState;
struct WorkState;
}  // namespace api_detail

class CompiledPlan;  // tutti/plan.hpp
struct PlanCall;

// The C++ element type of each DataType (types without a standard C++ type, such as bfloat16,
// are reached through the untyped calls).
template <class T>
constexpr DataType data_type_of() {
  if constexpr (std::is_same_v<T, int8_t>) return DataType::kInt8;
  else if constexpr (std::is_same_v<T, uint8_t>) return DataType::kUint8;
  else if constexpr (std::is_same_v<T, int32_t>) return DataType::kInt32;
  else if constexpr (std::is_same_v<T, uint32_t>) return DataType::kUint32;
  else if constexpr (std::is_same_v<T, int64_t>) return DataType::kInt64;
  else if constexpr (std::is_same_v<T, uint64_t>) return DataType::kUint64;
  else if constexpr (std::is_same_v<T, float>) return DataType::kFloat32;
  else if constexpr (std::is_same_v<T, double>) return DataType::kFloat64;
  else static_assert(sizeof(T) == 0, "no tutti::DataType for this element type; use the untyped calls");
}

// Where the ranks of a new communicator meet: made once (by rank 0) and given to every rank, e.g.
// as text through a file or a launcher.
struct CommId {
  std::array<unsigned char, 128> bytes{};
  static CommId create();  // starts the rendezvous in this process
  std::string to_string() const;
  static CommId parse(std::string_view text);  // throws InvalidArgument naming what is wrong
};

// Settings of a communicator; unset fields keep the TUTTI_* environment's (docs/ENVIRONMENT.md).
struct CommConfig {
  double timeout_s = -1;  // every wait gives up after this long (TUTTI_TIMEOUT); < 0: the environment's
};

// The handle of a call in progress. Copyable; all copies refer to the same call. A default-made
// Work is done.
class Work {
 public:
  Work() = default;
  bool test();  // true once the call is done; throws what the call failed with
  void wait();  // returns once the call is done; throws what the call failed with
  // The library makes Works; the state type is not part of the API.
  static Work make(std::shared_ptr<api_detail::WorkState> s) {
    Work w;
    w.state_ = std::move(s);
    return w;
  }

 private:
  std::shared_ptr<api_detail::WorkState> state_;
};

class Comm {
 public:
  // Collective over the `nranks` ranks that pass the same id.
  static Comm create(const CommId& id, int nranks, int rank, const CommConfig& config = {});
  // `nranks` ranks as threads of this process (rank r in element r); use each from its own thread.
  static std::vector<Comm> create_local(int nranks, const CommConfig& config = {});
  // This process's rank from tutti-run, mpirun or srun (TUTTI_RANK/TUTTI_SIZE/TUTTI_COMM_ID, or
  // the launcher's variables with NCCL_COMM_ID).
  static Comm from_env(const CommConfig& config = {});

  Comm(Comm&&) noexcept;
  Comm& operator=(Comm&&) noexcept;
  ~Comm();  // waits for the calls it holds, then leaves (collective, as ncclCommDestroy)

  int rank() const;
  int size() const;

  // Untyped calls: `count` elements of `type` per rank piece, as NCCL counts them.
  Work all_reduce(const void* in, void* out, size_t count, DataType type, RedOp op);
  Work reduce(const void* in, void* out, size_t count, DataType type, RedOp op, int root);
  Work broadcast(const void* in, void* out, size_t count, DataType type, int root);
  Work all_gather(const void* in, void* out, size_t count, DataType type);      // out: size() * count
  Work reduce_scatter(const void* in, void* out, size_t count, DataType type, RedOp op);  // in: size() * count
  Work all_to_all(const void* in, void* out, size_t count, DataType type);      // count per peer
  Work send(const void* in, size_t count, DataType type, int peer);
  Work recv(void* out, size_t count, DataType type, int peer);

  // Typed calls on spans; sizes are checked (InvalidArgument names the call and both sizes).
  template <class T>
  Work all_reduce(std::span<const T> in, std::span<T> out, RedOp op = RedOp::kSum) {
    check_sizes("all_reduce", in.size(), out.size(), 1);
    return all_reduce(in.data(), out.data(), in.size(), data_type_of<T>(), op);
  }
  template <class T>
  Work all_gather(std::span<const T> in, std::span<T> out) {
    check_sizes("all_gather", in.size() * size(), out.size(), 1);
    return all_gather(in.data(), out.data(), in.size(), data_type_of<T>());
  }
  template <class T>
  Work reduce_scatter(std::span<const T> in, std::span<T> out, RedOp op = RedOp::kSum) {
    check_sizes("reduce_scatter", in.size(), out.size() * size(), 1);
    return reduce_scatter(in.data(), out.data(), out.size(), data_type_of<T>(), op);
  }
  template <class T>
  Work broadcast(std::span<const T> in, std::span<T> out, int root) {
    check_sizes("broadcast", in.size(), out.size(), 1);
    return broadcast(in.data(), out.data(), out.size(), data_type_of<T>(), root);
  }
  template <class T>
  Work all_to_all(std::span<const T> in, std::span<T> out) {
    check_sizes("all_to_all", in.size(), out.size(), size());
    return all_to_all(in.data(), out.data(), in.size() / size(), data_type_of<T>());
  }

  // Sends and receives made between group_start() and group_end() run together, so a rank may
  // send to and receive from the same peers without ordering them (as ncclGroupStart/End); the
  // Works of the group are done together. Collectives are not allowed inside a group.
  void group_start();
  Work group_end();

  // Collective: new communicators of the ranks with the same color, ordered by key (color < 0:
  // none for this rank, an empty Comm is returned whose valid() is false).
  Comm split(int color, int key);
  bool valid() const { return state_ != nullptr; }

  // Makes every call in progress on this rank fail with Aborted, and the peers' with RemoteError.
  void abort();
  // The plan or path the last finished collective ran (for logs and tests).
  std::string last_plan() const;

 private:
  friend Work run_plan(Comm& comm, const CompiledPlan& plan, const PlanCall& call);
  friend double predict_plan_us(Comm& comm, const CompiledPlan& plan, size_t count, DataType type);
  explicit Comm(std::unique_ptr<api_detail::CommState> s);
  void check_sizes(const char* call, size_t a, size_t b, size_t multiple) const;
  std::unique_ptr<api_detail::CommState> state_;
};

// Host memory that the ranks on this host read in place (a named shared-memory segment, as
// ncclMemAlloc's): collectives and plans move each of its bytes once, straight from the sender's
// buffer, instead of through a FIFO. Page-aligned, zeroed. Free it with free_shared; throws a
// tutti::Error naming the size if the segment cannot be made.
void* alloc_shared(size_t bytes);
void free_shared(void* p);  // InvalidArgument for a pointer alloc_shared did not return

// Makes a plan file (tutti JSON, or MSCCL XML) available to every communicator made afterwards in
// this process: it is verified now (InvalidArgument with the verifier's message if it fails) and
// used for calls it fits (its collective, ranks and size window), or forced with TUTTI_ALGO.
void load_plan(const std::string& path);

// The version of the library ("0.1.0").
const char* version();

}  // namespace tutti
