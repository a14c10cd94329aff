#pragma once
// The vocabulary every layer shares (DESIGN.md 2): which collective, which buffer, which protocol,
// and what a collective means. It sits below the DSL so that the Plan and both executors depend on it
// and never on the DSL.
//
// What a collective means, symbolically: which chunks each rank starts with (precondition) and which
// multiset of contributions each output chunk must hold at the end (postcondition). Both the DSL's
// own symbolic execution and the compiler's plan verifier check against this one definition.
//
// A contribution is (origin rank, origin input index). A chunk's content is a sorted multiset of
// contributions: a copy moves it, a reduction merges two multisets. A compute kernel wraps its
// arguments into an application term (kernel(args)), so a standard collective whose data passed
// through a kernel is reported as wrong unless the collective is Custom and expects it.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tutti/kernel.hpp"

namespace tutti {

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kReduce, kAllToAll, kGather, kScatter, kSendRecv, kCustom };
// nccl-tests' names, which every tool prints: all_reduce, all_gather, reduce_scatter, broadcast,
// reduce, alltoall, gather, scatter, sendrecv, custom.
const char* to_string(Collective c);
// Whether a collective combines contributions with the call's reduction op (all_reduce, reduce,
// reduce_scatter; a custom collective says so through its postcondition instead).
constexpr bool reduces(Collective c) {
  return c == Collective::kAllReduce || c == Collective::kReduce || c == Collective::kReduceScatter;
}
// Whether a collective has a root rank (broadcast, reduce, gather, scatter).
constexpr bool has_root(Collective c) {
  return c == Collective::kBroadcast || c == Collective::kReduce || c == Collective::kGather || c == Collective::kScatter;
}
// Accepts those and MSCCL's (allreduce, allgather, reduce_scatter/reducescatter, ...), any case,
// with or without '_' and '-'.
std::optional<Collective> parse_collective(const std::string& text);

// A rank's buffers in a plan: the call's input and output, the executor's scratch, and the user's
// state buffers (optimizer moments, parameters, statistics: CollectiveSpec::states), which persist
// between calls and are passed to each one. State buffer k is `state_buffer(k)`.
enum class BufferKind : uint16_t { kInput = 0, kOutput = 1, kScratch = 2, kState = 3 /* kState + k: state buffer k */ };
constexpr BufferKind state_buffer(int k) { return static_cast<BufferKind>(static_cast<int>(BufferKind::kState) + k); }
constexpr bool is_state(BufferKind b) { return static_cast<int>(b) >= static_cast<int>(BufferKind::kState); }
constexpr int state_index(BufferKind b) { return static_cast<int>(b) - static_cast<int>(BufferKind::kState); }
std::string to_string(BufferKind b);  // "input", "output", "scratch", "state0", "state1", ...
std::optional<BufferKind> parse_buffer(const std::string& text);

// How a connection moves data (MSCCL's `proto`): Simple (data, fence, flag per slot), LL (8-byte
// lines of 4 data bytes and a 4-byte flag, no fence), LL128. kAuto leaves the choice to the compiler.
enum class Protocol { kAuto, kSimple, kLL, kLL128 };
const char* to_string(Protocol p);


// A leaf: the call's input chunk `index` of `rank`, or (state >= 0) chunk `index` of that state
// buffer as the call found it.
struct Contribution {
  int rank;
  int index;
  int state = -1;
  auto operator<=>(const Contribution&) const = default;
};

struct Application;

// A value as a term: the reduction (commutative, associative) of its leaves `parts` and of kernel
// applications. Both lists are sorted, so equal terms compare equal whatever order built them, and
// a kernel applied before a reduction differs from one applied after it.
struct Content {
  std::vector<Contribution> parts;   // sorted
  std::vector<Application> applied;  // sorted
  bool empty() const { return parts.empty() && applied.empty(); }  // "nothing written"
  bool operator==(const Content& other) const;
  bool operator<(const Content& other) const;
  static Content of(int rank, int index);
  static Content of_state(int rank, int state, int index);  // state buffer `state`'s chunk at the call's start
  // Output `output` of `kernel` applied to `args` with the step's scalars.
  static Content apply(KernelId kernel, std::vector<Content> args, std::vector<ScalarArg> scalars = {}, int output = 0);
  void merge(const Content& other);  // reduction
  std::string describe() const;      // "{r0:i1, r2:i1, scale({r1:i1})}"
};

struct Application {
  KernelId kernel = kernels::kIdentity;
  int output = 0;
  std::vector<ScalarArg> scalars;
  std::vector<Content> args;
  bool operator==(const Application& other) const;
  bool operator<(const Application& other) const;
};

// A storage location after in-place aliasing is resolved.
struct Location {
  BufferKind buffer;
  int index;
  auto operator<=>(const Location&) const = default;
};

// A state buffer of a custom collective: the same number of chunks on every rank. A chunk is the
// call's chunk (count / chunk_factor elements) or, with `unit` > 0, that many elements whatever the
// count (a statistic such as a sum of squares). Messages and local steps move chunks between
// buffers of one unit only.
struct StateBufferSpec {
  std::string name;
  int chunks = 0;
  int64_t unit = 0;
  // What chunk `index` of `rank` must hold at the end; nullopt (or no function): not checked.
  std::function<std::optional<Content>(int rank, int index)> post;
};

struct CollectiveSpec {
  Collective kind = Collective::kAllReduce;
  int nranks = 1;
  int chunk_factor = 1;  // chunks per rank-sized piece (C)
  bool inplace = false;
  int root = 0;          // Broadcast, Reduce, Gather, Scatter
  // Custom collectives only.
  int custom_input_chunks = 0, custom_output_chunks = 0;
  std::function<std::optional<Content>(int rank, int index)> custom_pre;   // input content
  std::function<std::optional<Content>(int rank, int index)> custom_post;  // nullopt: not checked
  std::vector<StateBufferSpec> states;  // the user's buffers besides input and output (custom only)

  // A standard collective's spec (no custom conditions, no state buffers).
  static CollectiveSpec of(Collective kind, int nranks, int chunk_factor = 1, bool inplace = false, int root = 0);
  int input_chunks() const;
  int output_chunks() const;
  bool has_root() const;
  // Where (buffer, index) of `rank` really lives: in-place collectives alias output and input.
  Location canonical(int rank, BufferKind buffer, int index) const;
  Content precondition(int rank, int input_index) const;
  // Expected content of output chunk `index` on `rank`; nullopt when the collective leaves it unspecified.
  std::optional<Content> postcondition(int rank, int output_index) const;
  // Expected content of chunk `index` of state buffer `state` at the end; nullopt: unchecked.
  std::optional<Content> state_postcondition(int rank, int state, int index) const;
  // The state buffer with this name; throws InvalidArgument naming it and the buffers there are.
  int state_named(const std::string& name) const;
  std::string describe() const;  // "allreduce, 8 ranks, 8 chunks, in-place"
};

}  // namespace tutti
