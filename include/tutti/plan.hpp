#pragma once
// From a DSL program (tutti/dsl.hpp) to a plan file the library runs: the compiler checks the
// program's postcondition, lowers it to per-rank instruction blocks, fuses receive/send pairs, and
// verifies the result (every output chunk holds exactly the right contributions, no deadlock with
// the FIFOs the runtime uses, no data race). Load the file with tutti::load_plan (tutti/tutti.hpp),
// or name its directory in TUTTI_PLAN_DIR for any program on the NCCL API; TUTTI_ALGO=<program
// name> forces it where it applies.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tutti/dsl.hpp"
#include "tutti/tutti.hpp"

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

struct PreparedPlan;  // the runtime's

// A compiled and verified plan held in memory, run directly with run_plan (a fused operation, a
// custom collective with state buffers): no file, no dispatcher choice. Copies share the plan.
class CompiledPlan {
 public:
  CompiledPlan() = default;
  const std::string& name() const;
  const std::string& summary() const;  // the verifier's report
  std::string json() const;            // the plan file's text
  // The library's: the plan as the executors take it.
  const std::shared_ptr<const PreparedPlan>& prepared() const { return prepared_; }

 private:
  friend CompiledPlan compile_plan(const dsl::Program& program);
  std::shared_ptr<const PreparedPlan> prepared_;
  std::string summary_;
};

// Compiles and verifies `program` (InvalidArgument as save_plan's).
CompiledPlan compile_plan(const dsl::Program& program);

// One call of a compiled plan: the buffers of this rank and the call's values.
struct PlanCall {
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;  // elements per rank piece: the collective's count (a chunk is count / chunk_factor)
  DataType type = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  std::vector<void*> states;    // the plan's state buffers, in the order the collective declares them
  std::vector<double> scalars;  // the values of its kernels' per-call scalars (ScalarArg::per_call slots)
};

// Runs the plan on this rank's buffers, in order with the Comm's other calls (every rank runs it as
// the same call). Checks arguments at once (InvalidArgument naming the plan: rank count, count,
// state buffers); the run's errors come from the Work. Host buffers, the CPU executor.
Work run_plan(Comm& comm, const CompiledPlan& plan, const PlanCall& call);

// What a call of `count` elements of `type` per rank piece would take, predicted by the simulator
// on this host's topology (with tutti-tune --calibrate's calibration when there is one), each
// kernel costed by its registered cost. Runs nothing, talks to no peer.
double predict_plan_us(Comm& comm, const CompiledPlan& plan, size_t count, DataType type);

}  // namespace tutti
