#pragma once
// The embedded DSL: a Program records chunk operations between ranks and executes them symbolically
// as it goes, so a mistake is reported at the operation that makes it (which op, which rank and
// chunk, why), and the final state can be checked against the collective's postcondition.
//
//   dsl::Program p("ring_allreduce", {Collective::kAllReduce, n, n});
//   auto c = p.chunk(r, dsl::Buffer::input(), i);   // a reference to a chunk
//   c = c.copy(next, dsl::Buffer::input(), i);      // returns the new location: dataflow style
//   c = p.chunk(next, dsl::Buffer::input(), i).reduce(c);  // dst = dst (+) src, returns dst
//   c.then(kernel, {scalars...});                           // a registered kernel on the result, in place
//
// Programs are plain C++: loops, functions and parameters build them. Operations are kept in the
// order they were issued; that order is one valid sequential execution, which lowering preserves.

#include <memory>
#include <string>
#include <vector>

#include "tutti/collective.hpp"
#include "tutti/kernel.hpp"

namespace tutti::dsl {

// A buffer of a rank: input, output, a named scratch buffer (which grows as indices are used), or a
// state buffer the collective declares (CollectiveSpec::states: the user's optimizer moments,
// parameters, statistics), by name.
struct Buffer {
  BufferKind kind = BufferKind::kInput;  // state buffers: kState until the program resolves the name
  std::string name;                      // scratch and state buffers
  static Buffer input() { return {BufferKind::kInput, {}}; }
  static Buffer output() { return {BufferKind::kOutput, {}}; }
  static Buffer scratch(std::string name = "scratch") { return {BufferKind::kScratch, std::move(name)}; }
  static Buffer state(std::string name) { return {BufferKind::kState, std::move(name)}; }
  bool operator==(const Buffer&) const = default;
  std::string describe() const;
};

// Optional scheduling hints; -1 / kAuto leave the choice to the compiler.
struct Annotations {
  int channel = -1;
  int block = -1;  // block (worker) on both the sending and the receiving rank
  Protocol protocol = Protocol::kAuto;
  int priority = 0;
};


enum class OpKind { kCopy, kReduce, kCompute };

struct ChunkLoc {
  int rank;
  Buffer buffer;
  int index;
  int count;
};

struct Op {
  OpKind kind;
  ChunkLoc src;  // kReduce: the incoming operand
  ChunkLoc dst;  // kReduce: the operand that receives the result
  Annotations annotations;
  KernelId kernel = kernels::kIdentity;
  std::vector<ScalarArg> scalars = {};  // the kernel's scalars (tutti/kernel.hpp): constants or per call
  std::vector<ChunkLoc> inputs = {}, outputs = {};  // kCompute: the kernel's operands (src, dst: the first)
  int id = 0;  // position in program order
};

class Program;

// A reference to `count` consecutive chunks of one rank's buffer.
class ChunkRef {
 public:
  int rank() const { return loc_.rank; }
  const Buffer& buffer() const { return loc_.buffer; }
  int index() const { return loc_.index; }
  int count() const { return loc_.count; }
  const ChunkLoc& loc() const { return loc_; }

  // Copies these chunks to (dst_rank, buffer, index); returns the destination reference.
  ChunkRef copy(int dst_rank, const Buffer& buffer, int index, Annotations a = {}) const;
  // this = this (+) src, element-wise over the chunks; returns this. src may be on another rank.
  ChunkRef reduce(const ChunkRef& src, Annotations a = {}) const;
  // An epilogue: runs a registered kernel (tutti/kernel.hpp) with these chunks as its first input,
  // then `inputs`, writing `outputs` (none: these chunks, in place); returns the first output, so
  // a schedule reads as dataflow: g.reduce(peer).then(unscale, {scale}, {}, {g, sum}). Throws
  // InvalidArgument for an unknown kernel or operands that do not fit it (Program::apply).
  ChunkRef then(KernelId kernel, std::vector<ScalarArg> scalars = {}, const std::vector<ChunkRef>& inputs = {},
                const std::vector<ChunkRef>& outputs = {}, Annotations a = {}) const;
  // The chunks one by one, or in k equal parts (count must divide).
  std::vector<ChunkRef> split(int parts) const;
  // The single chunk at offset i of this range.
  ChunkRef operator[](int i) const;

 private:
  friend class Program;
  ChunkRef(Program* p, ChunkLoc loc) : program_(p), loc_(std::move(loc)) {}
  Program* program_;
  ChunkLoc loc_;
};

class Program {
 public:
  Program(std::string name, CollectiveSpec spec);
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  Program(Program&&) = default;

  const std::string& name() const { return name_; }
  const CollectiveSpec& spec() const { return spec_; }
  int nranks() const { return spec_.nranks; }

  // A reference to existing chunks; throws InvalidArgument if out of range.
  ChunkRef chunk(int rank, const Buffer& buffer, int index, int count = 1);
  // Contiguous chunks as one reference: they must be adjacent in one buffer of one rank.
  ChunkRef group(const std::vector<ChunkRef>& refs);
  // Runs a registered kernel (tutti/kernel.hpp) of several operands: `outputs` = kernel(`inputs`;
  // scalars), chunk by chunk. Operands are on one rank with equal counts; outputs may be inputs
  // (in place). Returns the outputs. Throws InvalidArgument naming what does not fit the kernel.
  std::vector<ChunkRef> apply(KernelId kernel, const std::vector<ChunkRef>& inputs,
                              const std::vector<ChunkRef>& outputs, std::vector<ScalarArg> scalars = {},
                              Annotations a = {});

  const std::vector<Op>& ops() const { return ops_; }
  // Chunks of the named scratch buffer used on `rank` (its size).
  int scratch_chunks(int rank, const std::string& name) const;
  std::vector<std::string> scratch_names() const { return scratch_names_; }

  // Content of a chunk now (after all operations so far).
  const Content& content(int rank, const Buffer& buffer, int index) const;
  // Throws InvalidArgument naming the first output chunk that does not hold what the collective
  // promises. Called by the compiler; useful in tests of hand-written programs.
  void check_postcondition() const;

 private:
  friend class ChunkRef;
  ChunkRef record(Op op);
  void check_range(const ChunkLoc& loc, const char* what, bool growing) const;
  Content& slot(int rank, const Buffer& buffer, int index);
  Buffer resolve(const Buffer& buffer) const;  // a state buffer's name to its BufferKind
  int64_t unit(const Buffer& buffer) const;    // elements per chunk (0: the call's chunk)
  std::string op_name(const Op& op) const;

  std::string name_;
  CollectiveSpec spec_;
  std::vector<Op> ops_;
  std::vector<std::string> scratch_names_;
  // State per rank: input, output and scratch (by name) contents, in canonical form.
  struct RankState {
    std::vector<Content> input, output;
    std::vector<std::vector<Content>> scratch;  // by scratch name index
    std::vector<std::vector<Content>> states;   // by CollectiveSpec::states index
  };
  std::vector<RankState> state_;
};

}  // namespace tutti::dsl
