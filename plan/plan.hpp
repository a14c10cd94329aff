#pragma once
// The Plan: what the compiler hands the runtime, a layer of its own between them (the compiler
// makes and verifies plans, executors run them; neither includes the other). Per rank, a list of blocks; each block is an ordered
// list of instructions run by one worker (a CPU worker or a CUDA thread block). Instructions name
// their local chunks explicitly, their peers and channel explicitly, and any number of dependencies
// on steps of other blocks of the same rank. No field has a fixed cap.
//
// Instruction semantics (on `count` consecutive chunks):
//   send                  send srcs[0] to send_peer
//   recv                  dst = data from recv_peer
//   copy                  dst = srcs[0]
//   reduce                dst = srcs[0] (+) srcs[1] (+) ...      (n-ary; dst may be one of srcs)
//   recv_copy_send        dst = data from recv_peer; send dst to send_peer
//   recv_reduce_send      send (data from recv_peer (+) srcs[0]) to send_peer, store nothing
//   recv_reduce_copy      dst = data from recv_peer (+) srcs[0]
//   recv_reduce_copy_send dst = data from recv_peer (+) srcs[0]; send dst to send_peer
//   compute               dst, more_dsts... = kernel(srcs...; scalars)   (a registered kernel, tutti/kernel.hpp;
//                         all operands on this rank, equal counts; outputs written after every input is read)
//   nop                   nothing (carries dependencies)
// Messages on one connection (sender, receiver, channel) are matched in order: the k-th send meets
// the k-th receive. `remote` records where the data comes from or goes to on the peer; it is
// informational (MSCCL XML stores the sender's offsets on receives, tutti never relies on them).

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/semantics.hpp"
#include "tutti/collective.hpp"
#include "tutti/kernel.hpp"

namespace tutti::plan {

const char* to_string(Opcode op);
std::optional<Opcode> parse_opcode(const std::string& text);
bool sends(Opcode op);
bool receives(Opcode op);
bool stores(Opcode op);  // writes dst

struct Ref {
  BufferKind buffer = BufferKind::kInput;
  int64_t index = 0;
  int64_t count = 1;
  bool operator==(const Ref&) const = default;
  std::string describe() const;  // "input[3..5)"
};

struct Dep {
  int64_t block;
  int64_t step;
  bool operator==(const Dep&) const = default;
  auto operator<=>(const Dep&) const = default;
};

struct Instruction {
  Opcode op = Opcode::kNop;
  std::vector<Ref> srcs;
  std::optional<Ref> dst;
  int send_peer = -1;
  int recv_peer = -1;
  std::optional<Ref> remote;
  std::vector<Dep> deps;
  KernelId kernel = kernels::kIdentity;  // compute: the kernel (tutti/kernel.hpp; JSON names it)
  std::vector<ScalarArg> scalars;        // compute: its scalars (constants, or slots of the call's values)
  std::vector<Ref> more_dsts;            // compute: outputs 1.. of a kernel with several (dst is output 0)
  // Stated by plan::certify for a send: every write of this rank to the chunks it sends happens
  // before it, so a peer may read them in place, from the sender's buffer, until the end of the
  // call (ncclCommRegister's direct reads) instead of from a copy in its FIFO.
  bool stable_source = false;
  bool operator==(const Instruction&) const = default;
  int64_t count() const;
  std::vector<Ref> writes() const;  // dst, then more_dsts
};

struct Block {
  int64_t id = 0;  // its index in RankPlan::blocks (importers renumber; see renumber_blocks)
  int channel = 0;
  std::vector<Instruction> steps;
  bool operator==(const Block&) const = default;
};

// A state buffer (CollectiveSpec::states): the user's, passed to each call (ExecArgs::states in
// this order), `chunks` chunks on every rank, a chunk being the call's chunk or (unit > 0) `unit`
// elements.
struct StateBuffer {
  std::string name;
  int64_t chunks = 0;
  int64_t unit = 0;
  bool operator==(const StateBuffer&) const = default;
};

struct RankPlan {
  int64_t input_chunks = 0, output_chunks = 0, scratch_chunks = 0;
  std::vector<Block> blocks;
  bool operator==(const RankPlan&) const = default;
};

struct Plan {
  static constexpr int kVersion = 1;
  std::string name;
  Collective collective = Collective::kAllReduce;
  int nranks = 1;
  int chunk_factor = 1;
  bool inplace = false;
  int root = 0;
  Protocol protocol = Protocol::kSimple;
  uint64_t min_bytes = 0;
  uint64_t max_bytes = UINT64_MAX;
  std::string topology;  // what it was made or tuned for ("" = generic)
  // Stated by the compiler when it verifies the plan (plan::certify), so executors read them instead
  // of deriving them:
  // - the smallest FIFO depth, in messages per connection, the verifier proved deadlock-free; an
  //   executor with shallower FIFOs must refuse the plan. 0: not verified, no executor runs it.
  int64_t fifo_depth = 0;
  // - true when every transfer and local operation moves chunks between equal sub-indices, so the
  //   plan works for any element count; otherwise a call needs count % chunk_factor == 0.
  bool any_count = false;
  std::vector<StateBuffer> states;  // Ref buffer state_buffer(k) is states[k]
  std::vector<RankPlan> ranks;
  bool operator==(const Plan&) const = default;

  CollectiveSpec spec() const;
  int channels() const;       // 1 + highest channel used
  int64_t steps() const;      // instructions over all ranks
  int64_t blocks() const;     // blocks over all ranks
  int64_t unit(BufferKind b) const;  // elements per chunk of b: a state buffer's unit, else 0 (the call's chunk)
  int64_t size(int rank, BufferKind b) const;  // chunks of b on `rank`
};

// What a plan may ask for. Importers check these before they allocate anything sized by the file,
// and the verifier before it builds its state, so a hostile or damaged file costs at most this much
// (docs/PLANS.md lists them; tests/test_plan_limits.cpp breaks them).
struct Limits {
  static constexpr int kRanks = 4096;                       // nranks / ngpus
  static constexpr int kChannels = 32;                      // channel ids 0..31 (NCCL's MAXCHANNELS)
  static constexpr int64_t kChunksPerBuffer = 1 << 20;      // input, output, scratch chunks of one rank
  static constexpr int64_t kChunkSlots = 1 << 22;           // chunks of every buffer of every rank
  static constexpr int64_t kChunkSlotsTimesRanks = 1LL << 28;  // the verifier's symbolic state
  static constexpr int kChunkFactor = 1 << 16;              // chunks per rank piece
  static constexpr int64_t kSteps = 1 << 22;                // instructions over all ranks
  static constexpr int64_t kBlocksPerRank = 1 << 16;
  static constexpr int64_t kOperandsPerStep = 1 << 12;      // sources, destinations, dependencies
  static constexpr size_t kFileBytes = size_t{256} << 20;   // a plan file
  static constexpr size_t kWarnings = 32;                   // importer warnings kept (then a count)
  // Scratch chunks a rank may have per chunk of its largest buffer: the executor allocates scratch
  // per call in that proportion (MSCCL's all-pairs plans use n - 1).
  static constexpr int64_t scratch_ratio(int nranks) { return std::max<int64_t>(64, 4 * int64_t{nranks}); }
};
// Throws InvalidArgument naming the field, its value and the limit.
void check_limits(const Plan& plan);

// Makes block ids equal to their position in RankPlan::blocks and rewrites dependencies to match, so
// executors index blocks directly. Importers call it. Throws InvalidArgument naming rank, block and
// step for a duplicate block id or a dependency on a block that does not exist.
void renumber_blocks(Plan& plan);
// Whether the plan works for any element count (see Plan::any_count).
bool splits_any_count(const Plan& plan);

// Versioned JSON. parse_json throws InvalidArgument naming the field (and unknown fields).
std::string to_json(const Plan& plan);
Plan parse_json(const std::string& text);

// The text of a plan file: regular files only (a FIFO, a device or a directory is refused without
// blocking), at most Limits::kFileBytes, checked while reading. InvalidArgument naming the file.
std::string read_file(const std::string& path);
// Plan files, .json or MSCCL's .xml (load_file, save_file), are the compiler's, whose importer and
// exporter read and write XML: compiler/plan_file.hpp.

}  // namespace tutti::plan
