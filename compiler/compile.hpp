#pragma once
// From a DSL Program to a verified Plan, and the passes that shape plans.
//
// compile() = check the program's postcondition, lower, [fuse], assign blocks, minimise
// dependencies, [replicate instances], verify. Each pass is a separate function with its own tests.

#include <cstdint>
#include <string>

#include "plan/plan.hpp"
#include "compiler/verify.hpp"
#include "tutti/dsl.hpp"

namespace tutti::plan {

// Lowering: one instruction per DSL operation on each rank it touches (send/recv pairs for
// operations between ranks), data dependencies from the program order, and blocks: all sends of a
// connection (peer, channel) in one block, all receives of one in one block, local operations per
// channel, or the block the program annotated.
Plan lower(const dsl::Program& program, bool fuse = true);

// MSCCL's three fusions on a rank's instruction stream, applied during lowering when fuse=true:
// recv + send of the same chunk -> recv_copy_send; recv_reduce_copy + send -> recv_reduce_copy_send;
// a recv_reduce_copy_send whose stored result nobody reads -> recv_reduce_send. A send of another
// location that provably holds the same data (the DSL knows the contents) is redirected first, so
// fusion also works across buffer indices.

// Removes dependencies implied by program order or by other dependencies of the same rank.
// Returns how many were removed.
int64_t minimise_dependencies(Plan& plan);

enum class InstancePolicy { kInterleaved, kBatched };
// Runs `instances` copies of the plan side by side on smaller chunks: chunk factor x instances,
// instance j on channels c*instances + j. Interleaved: chunk x of instance j is x*instances + j*count;
// batched: j*buffer_chunks + x.
Plan replicate(const Plan& plan, int instances, InstancePolicy policy);

struct CompileOptions {
  bool fuse = true;
  int instances = 1;
  InstancePolicy policy = InstancePolicy::kInterleaved;
  Protocol protocol = Protocol::kSimple;
  uint64_t min_bytes = 0, max_bytes = UINT64_MAX;
  VerifyOptions verify;
};

struct Compiled {
  Plan plan;
  VerifyReport report;
  int64_t steps_before_fusion = 0, blocks_before_fusion = 0;
};

Compiled compile(const dsl::Program& program, const CompileOptions& options = {});

}  // namespace tutti::plan
