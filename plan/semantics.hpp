#pragma once
// What a Plan instruction does to bytes, written once for every executor: the opcodes, the table of
// what each one does, and the chunk geometry. The Plan's types (plan/plan.hpp), the CPU interpreter
// (runtime/cpu_executor.cpp) and the device interpreter (runtime/device/interpreter.hpp, compiled
// by nvcc too) include it. Host/device neutral: no exceptions, no allocation, plain integer
// arithmetic.
//
// Chunk geometry. A call moves `count` elements per rank piece (NCCL's count: the allreduce count,
// the allgather sendcount, the reduce-scatter recvcount). A buffer is a sequence of pieces of `count`
// elements (one piece, or nranks pieces for an allgather output / reduce-scatter input / alltoall),
// and each piece is cut into C = chunk_factor chunks. Chunk j lies in piece j / C; its sub-index
// k = j % C covers elements [floor(k*count/C), floor((k+1)*count/C)) of the piece. Any count works:
// when C does not divide it, chunks differ by one element, and two chunks with the same sub-index
// always have the same size, which is what a message between them needs. Scratch buffers use the
// same geometry.
//
// Tiles. A transfer of B bytes is cut into ceil(B / tile) tiles (at least one, so zero-byte chunks
// still exchange an empty message and both sides agree on the message count); the tile size is a
// multiple of the element size, so reductions never split an element.

#include <cstdint>

#include "core/element.hpp"  // TUTTI_HD

namespace tutti::plan {

// What an instruction does (plan/plan.hpp describes each; op_info below is their table).
enum class Opcode : uint8_t {
  kNop,
  kSend,
  kRecv,
  kCopy,
  kReduce,
  kRecvCopySend,
  kRecvReduceSend,
  kRecvReduceCopy,
  kRecvReduceCopySend,
  kCompute,
};
inline constexpr int kNumOpcodes = 10;

}  // namespace tutti::plan

namespace tutti::exec {

struct Geometry {
  int64_t count = 0;         // elements per piece
  int64_t chunk_factor = 1;  // chunks per piece
  int64_t elem_size = 1;

  TUTTI_HD int64_t chunk_begin(int64_t chunk) const {
    int64_t piece = chunk / chunk_factor, k = chunk % chunk_factor;
    return piece * count + (k * count) / chunk_factor;
  }
  TUTTI_HD int64_t chunk_end(int64_t chunk) const {
    int64_t piece = chunk / chunk_factor, k = chunk % chunk_factor;
    return piece * count + ((k + 1) * count) / chunk_factor;
  }
  // Byte offset and length of chunks [index, index + n).
  TUTTI_HD int64_t offset(int64_t index) const { return chunk_begin(index) * elem_size; }
  TUTTI_HD int64_t bytes(int64_t index, int64_t n) const {
    return (chunk_end(index + n - 1) - chunk_begin(index)) * elem_size;
  }
};

TUTTI_HD int64_t tile_count(int64_t bytes, int64_t tile) { return bytes <= 0 ? 1 : (bytes + tile - 1) / tile; }
TUTTI_HD int64_t tile_begin(int64_t t, int64_t tile) { return t * tile; }
TUTTI_HD int64_t tile_bytes(int64_t t, int64_t bytes, int64_t tile) {
  int64_t b = bytes - t * tile;
  return b < 0 ? 0 : (b < tile ? b : tile);
}

}  // namespace tutti::exec

namespace tutti::plan {

// How each opcode uses the connection and the local operands.
struct OpShape {
  bool recv;          // takes a message from recv_peer
  bool send;          // gives a message to send_peer
  bool reduce_local;  // combines the message with srcs[0]
  bool store;         // writes dst
  bool staging;       // the message must land apart from dst (dst is also an operand, or nothing is stored)
};

// The one table of opcodes: name (JSON, logs), shape, and how many local sources an instruction
// combines (kAllSources: every one of srcs). plan.cpp (names, sends/receives/stores for the lowering,
// importers, verifier and simulator), the CPU executor and the device interpreter all read it. A
// constexpr function rather than an array so device code can use it too.
inline constexpr int kAllSources = -1;
struct OpInfo {
  const char* name;
  OpShape shape;
  int local_sources;
};
TUTTI_HD constexpr OpInfo op_info(Opcode op) {
  switch (op) {
    case Opcode::kNop: break;
    case Opcode::kSend: return {"send", {false, true, false, false, false}, 1};
    case Opcode::kRecv: return {"recv", {true, false, false, true, false}, 0};
    case Opcode::kCopy: return {"copy", {false, false, false, true, false}, 1};
    case Opcode::kReduce: return {"reduce", {false, false, false, true, false}, kAllSources};
    case Opcode::kRecvCopySend: return {"recv_copy_send", {true, true, false, true, false}, 0};
    case Opcode::kRecvReduceSend: return {"recv_reduce_send", {true, true, true, false, true}, 1};
    case Opcode::kRecvReduceCopy: return {"recv_reduce_copy", {true, false, true, true, true}, 1};
    case Opcode::kRecvReduceCopySend: return {"recv_reduce_copy_send", {true, true, true, true, true}, 1};
    case Opcode::kCompute: return {"compute", {false, false, false, true, false}, 1};
  }
  return {"nop", {false, false, false, false, false}, 0};
}
TUTTI_HD constexpr OpShape shape_of(Opcode op) { return op_info(op).shape; }

}  // namespace tutti::plan
