#pragma once
// What the host hands a device plan interpreter: plain structs of fixed size, no pointers to host
// objects, the same on the CUDA device and on the emulated device (runtime/device/interpreter.hpp).
// Host/device neutral: <cstdint>, the element-wise programs' code (core/element_program.hpp) and the
// opcodes (plan/semantics.hpp).
//
// A flattened plan (runtime/device/device_plan.hpp) is five arrays per rank: blocks, steps, the
// operands of the steps, their dependencies and the scalars of their kernels. Refs are canonical:
// in-place aliasing is resolved when flattening, so an interpreter knows the input, the output,
// scratch and the plan's state buffers (parameters, optimizer moments, statistics: LaunchArgs::states).
//
// One pass. A plan with state buffers runs in a single round over the whole call (interpreter.hpp,
// "Rounds"): a statistic of a chunk, a barrier on a norm or a row-shaped operand cannot be cut into
// slices, so each of its messages must fit one slot (the host checks, by the plan's name).
//
// Memory of one connection (sender s -> receiver r on channel c) lives in the receiver's device
// memory and is written through peer pointers (runtime/device/fifo.hpp states the ordering
// contract):
//   Fifo { tail, head, pad; Simple slots [depth][slot_bytes]; LL slots [depth][ll_slot_bytes];
//          descriptors [depth][kDescWords] }
// tail: messages the sender has posted (Simple); head: messages the receiver has consumed (both
// protocols). The sender's and receiver's own message counts live in their own memory (FifoView::count)
// and persist across launches, like NCCL's step counters.
//
// Direct reads (registered buffers, peers in one address space): a Simple message may carry no
// data. Its slot's descriptor then names where the data lies in the sender's memory (the base of
// the sender's canonical buffer and the first chunk's index; the receiver places the chunks with
// the geometry both share), and the receiver reads them there. The sender only does so for a send
// the compiler marked stable_source, from a buffer registered with the communicator, to a peer
// that can address its memory; it writes descriptor {0, 0} for a message in the slot, and before
// its launch ends it waits until every message it let a peer read in place has been consumed.
//
// Call stamps. Every message says which call sent it (runtime/call_stamp.hpp: collective, type, op,
// root, count), as messages of the host transports do: a Simple message in its descriptor's third
// word, an LL message in the header line that opens its slot ({stamp, flag}, like a data line). The
// receiver compares it with its own call's before it reads any data, so ranks whose calls differ
// (1M floats against 512K, where both cut the call into rounds of one slot) fail at the first
// message, naming both calls, instead of one of them returning another call's data. Point-to-point
// launches carry stamp 0 on both sides.

#include <cstdint>

#include "core/element_program.hpp"
#include "plan/semantics.hpp"

namespace tutti::device {

// The most threads a block of the interpreter has (TUTTI_DEVICE_THREADS): the CUDA kernel is
// compiled for it (__launch_bounds__), so its registers fit a block of this many threads. Without
// the bound the compiler gave the interpreter 168 registers a thread, which no 512-thread block
// (NCCL's default, and ours) can have on a GPU of 65536 registers per multiprocessor.
inline constexpr int kMaxBlockThreads = 512;

// kBufState + s: state buffer s of the plan.
enum Buf : uint8_t { kBufInput = 0, kBufOutput = 1, kBufScratch = 2, kBufState = 3, kBufNone = 255 };

// What one launch carries by value (LaunchArgs is a kernel parameter, at most 4 KiB on CUDA): state
// buffers and per-call scalar values. Plans with more are refused by name (device_executor.cpp).
inline constexpr int kMaxStates = 16;
inline constexpr int kMaxScalars = 32;

// A state buffer of the call: unit 0 has the call's chunk geometry (a parameter array); unit u > 0
// has u elements per chunk (a statistic: 1).
struct DevState {
  unsigned char* base = nullptr;
  int64_t unit = 0;
};

// A kernel's scalar: a constant, or the call's value in slot `slot` (LaunchArgs::scalars).
struct DevScalar {
  double value = 0;
  int32_t slot = -1;
};

struct DevRef {
  int64_t index = 0;  // chunk index in the canonical buffer
  uint8_t buf = kBufNone;
};

struct DevDep {
  int32_t block = 0;  // dense index of the block on this rank
  int32_t step = 0;
};

struct DevStep {
  plan::Opcode op = plan::Opcode::kNop;  // plan/semantics.hpp
  uint8_t signal = 0;  // another block depends on this step: publish progress after it
  uint8_t stable_src = 0;  // a send whose source a peer may read in place (plan::Instruction::stable_source)
  uint16_t nsrcs = 0;
  uint16_t nouts = 0;      // compute: outputs after dst, at srcs[first_src + nsrcs, ... + nouts)
  int32_t send_conn = -1;  // index into LaunchArgs::send (this rank's outgoing FIFOs of the plan)
  int32_t recv_conn = -1;  // index into LaunchArgs::recv
  int32_t first_src = 0;   // srcs[first_src, first_src + nsrcs)
  int32_t first_dep = 0;   // deps[first_dep, first_dep + ndeps)
  int32_t ndeps = 0;
  int32_t kernel = 0;      // compute: tutti::DeviceKernel value
  double kernel_arg = 1;   // compute, scale: the factor (a constant)
  int32_t first_scalar = 0;  // compute: its scalars, at scalars[first_scalar, + nscalars)
  int32_t nscalars = 0;
  // compute: where input 0 starts in its buffer, for kernels whose result depends on the position
  // (a dropout mask, rows): chunk `offset_index` as the plan names it, in a buffer of the call's
  // geometry, or of `offset_unit` elements per chunk when that is not 0.
  int64_t offset_index = 0;
  int64_t offset_unit = 0;
  int32_t first_code = 0;  // kElementwise: its program, at code[first_code, + ncode)
  int32_t ncode = 0;
  int64_t count = 0;       // chunks
  DevRef dst;
};

struct DevBlock {
  int32_t first_step = 0;
  int32_t nsteps = 0;
};

// One direction of one connection as this rank sees it.
struct FifoView {
  unsigned char* simple = nullptr;  // [depth][slot_bytes], in the receiver's memory
  unsigned char* ll = nullptr;      // [depth][ll_slot_bytes], in the receiver's memory
  uint64_t* tail = nullptr;         // receiver's memory, written by the sender
  uint64_t* head = nullptr;         // receiver's memory, written by the receiver
  uint64_t* count = nullptr;        // this rank's memory: messages this side has sent / received
  uint64_t* desc = nullptr;         // [depth][kDescWords], in the receiver's memory: where a message's data is
  int32_t peer = -1;                // for error reports
  int32_t direct = 0;               // sender's view: the peer can read this rank's memory in place
};

// Per rank, in its device memory; survives launches (and CUDA graph replays).
struct RankState {
  uint64_t epoch;     // launches finished; progress words of launch e are (e << 32) | steps
  uint64_t finished;  // blocks of the current launch that are done (the last one bumps epoch)
  uint64_t direct_messages;  // messages peers read in place, over all launches (for tests and traces)
};

// Set by the first wait that gives up; every wait polls it, so one failure stops every block of
// every rank that shares it. In host-mapped memory on CUDA, so the host reads it at any time.
struct Status {
  int32_t failed;  // 0 ok, 1 aborted, 2 timed out, kBadIndex, kStampMismatch, kCommFailed
  int32_t block, step, peer;
  int32_t waits_for_block;  // a dependency wait: the block waited for (-1: none)
  int64_t round;
  // kBadIndex: the operand's element and its value (a token index). kStampMismatch: value is the
  // stamp of the peer's message.
  int64_t slot, value;
};
inline constexpr int32_t kBadIndex = 3;        // a kernel met a value out of range
inline constexpr int32_t kStampMismatch = 4;  // a message of another call arrived (Status::peer sent it)
inline constexpr int32_t kCommFailed = 5;     // the communicator failed (the host's stop word said so)

// The host's stop word (LaunchArgs::abort): 0 run, kStopAbort the communicator was aborted or
// revoked, kStopFailed it failed (this rank or a peer: CommState::add_stop_word).
inline constexpr int32_t kStopAbort = 1;
inline constexpr int32_t kStopFailed = 2;

// A Simple message's descriptor: where its data lies (0, 0: in the slot) and its call stamp.
inline constexpr int kDescWords = 4;
inline constexpr int kDescStamp = 2;
// An LL slot opens with its header: one line carrying the stamp, and one unused line, so that data
// lines stay 32-byte aligned as a pair.
inline constexpr int64_t kLLHeaderBytes = 32;
// Data bytes an LL slot of `ll_slot_bytes` holds (each 8 data bytes take a 16-byte line).
inline constexpr int64_t ll_capacity(int64_t ll_slot_bytes) { return (ll_slot_bytes - kLLHeaderBytes) / 2; }

enum Protocol : int32_t { kProtoSimple = 0, kProtoLL = 1 };

struct LaunchArgs {
  const DevBlock* blocks = nullptr;
  const DevStep* steps = nullptr;
  const DevRef* srcs = nullptr;
  const DevDep* deps = nullptr;
  const DevScalar* scalar_refs = nullptr;  // DevStep::first_scalar indexes it
  const element::ElementCode* code = nullptr;  // DevStep::first_code indexes it
  const FifoView* send = nullptr;
  const FifoView* recv = nullptr;
  uint64_t* progress = nullptr;  // per thread block (instance * nblocks + block)
  RankState* state = nullptr;
  Status* status = nullptr;          // this rank's failure record
  const volatile int32_t* abort = nullptr;  // the host's stop word (kStopAbort, kStopFailed)
  unsigned char* bufs[3] = {nullptr, nullptr, nullptr};
  DevState states[kMaxStates] = {};
  int32_t nstates = 0;
  double scalars[kMaxScalars] = {};  // the call's per-call scalar values
  int32_t nscalars = 0;
  int32_t nblocks = 0;    // plan blocks of this rank
  int32_t instances = 1;  // copies of the plan, each with its own FIFOs, taking rounds in turn
  int32_t nsend = 0, nrecv = 0;  // FIFO views per instance (send[instance * nsend + conn])
  int32_t protocol = kProtoSimple;
  uint32_t registered = 0;  // bit b: bufs[b] lies in memory registered with the communicator
  int32_t op = 0;    // RedOp
  int32_t type = 0;  // DataType
  int64_t esize = 1;
  int64_t count = 0;         // elements per piece (NCCL's count)
  int64_t chunk_factor = 1;
  int64_t round_elems = 0;   // elements of each piece per round (a multiple of chunk_factor)
  int64_t rounds = 1;
  int64_t depth = 1;         // slots per FIFO
  int64_t slot_bytes = 0;    // Simple slot
  int64_t ll_slot_bytes = 0; // LL slot (holds ll_capacity(ll_slot_bytes) data bytes)
  uint64_t timeout_ns = 0;   // 0: wait forever
  uint64_t stamp = 0;        // this rank's call (runtime/call_stamp.hpp); every message carries it
};

// Message layout: the chunks of a message follow each other, each starting on a 16-byte boundary.
inline constexpr int64_t kChunkAlign = 16;

}  // namespace tutti::device
