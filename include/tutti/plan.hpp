#pragma once
// From a DSL program (tutti/dsl.hpp) to a plan file the library runs: the compiler checks the
// program's postcondition, lowers it to per-rank instruction blocks, fuses receive/send pairs, and
// verifies the result (every output chunk holds exactly the right contributions, no deadlock with
// the FIFOs the runtime uses, no data race). Load the file with tutti::load_plan (tutti/tutti.hpp),
// or name its directory in TUTTI_PLAN_DIR for any program on the NCCL API; TUTTI_ALGO=<program
// name> forces it where it applies.

#include <cstdint>
#include <string>

#include "tutti/dsl.hpp"

namespace tutti {

struct PlanOptions {
  uint64_t min_bytes = 0;           // the calls the dispatcher uses the plan for (MSCCL's minBytes..maxBytes)
  uint64_t max_bytes = UINT64_MAX;
  int instances = 1;                // copies of the plan side by side on smaller chunks
};

// Compiles and verifies `program` and writes the plan to `path`: tutti's JSON, or MSCCL's XML for a
// path ending in .xml (which refuses what MSCCL cannot express, e.g. compute steps). Returns the
// verifier's summary. Throws InvalidArgument naming the violated property and the rank, block and
// step, or what MSCCL XML cannot hold.
std::string save_plan(const dsl::Program& program, const std::string& path, const PlanOptions& options = {});

}  // namespace tutti
