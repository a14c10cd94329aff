#pragma once
// Verification of a Plan by symbolic execution. Proves, or reports the first violation of:
// - structure: refs in range, peers valid, operands as the opcode needs, dependencies that exist;
// - matching: each connection (sender, receiver, channel) is sent by one block and received by one
//   block (so its order is defined), with as many receives as sends and equal chunk counts in order;
// - deadlock freedom with FIFOs of a given depth (in messages): blocks run as sequential processes
//   that block on dependencies, on empty FIFOs (receives) and on full FIFOs (sends). With one writer
//   and one reader per FIFO the outcome does not depend on scheduling (a Kahn network), so one
//   simulation decides it; a deadlock is reported as the cycle of waits;
// - the collective's postcondition: every output chunk holds exactly the right multiset of
//   (origin rank, origin index) contributions;
// - no data race: two accesses of one chunk on one rank, in different blocks, one of them a write,
//   must be ordered by program order, dependencies or messages (vector clocks).
// Failures throw InvalidArgument whose message starts with "verification failed: <property>:" and
// names rank, block and step.

#include <cstdint>
#include <string>
#include <vector>

#include "plan/plan.hpp"

namespace tutti::plan {

struct VerifyOptions {
  int64_t fifo_depth = 0;  // 0: find the smallest depth that works (and fail only if none does)
  bool check_hazards = true;
  // The collective to check against; default: plan.spec(). Custom collectives pass theirs (the
  // plan cannot carry C++ pre/postconditions).
  const CollectiveSpec* spec = nullptr;
};

struct VerifyReport {
  int64_t steps = 0, blocks = 0;
  int channels = 0;
  int64_t max_chunks = 0;            // largest buffer (chunks) over ranks
  int64_t fifo_depth_needed = 0;     // smallest FIFO depth (messages) without deadlock
  int64_t max_messages_per_connection = 0;
  // Sends whose source chunks no write of their rank follows (every write to them happens before
  // the send): (rank, block index, step). Found with the hazard check; empty without it.
  struct At {
    int rank, block, step;
  };
  std::vector<At> stable_sends;
  std::string summary(const Plan& plan) const;
};

VerifyReport verify(const Plan& plan, const VerifyOptions& options = {});

// Verifies the plan and states in it what executors rely on: the FIFO depth it was proved for
// (plan.fifo_depth, at least 1), whether it splits any element count (plan.any_count) and which
// sends a peer may read in place (Instruction::stable_source). Executors
// refuse plans that were not certified. Throws as verify() does.
VerifyReport certify(Plan& plan, const VerifyOptions& options = {});

}  // namespace tutti::plan
