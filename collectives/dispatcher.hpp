#pragma once
// The dispatcher turns a collective call into a plan run: it picks a plan for (collective, ranks,
// bytes, in-place), adapts the call to the plan (in-place vs out-of-place, avg, premulsum), and runs
// it on the executor.
//
// Choice, in order: TUTTI_ALGO/NCCL_ALGO if it names an applicable plan; then loaded plans
// (TUTTI_PLAN_DIR, MSCCL_XML_FILES, MSCCL_ALGO_DIR) whose size window [min_bytes, max_bytes] holds
// the call; then the decision table (TUTTI_TUNING_FILE, collectives/tuner.hpp), which TUTTI_TUNE=1
// extends by measuring on first use of a size; then the built-in defaults by size. "Bytes" is the
// larger of the input and output buffer, nccl-tests' "size".

#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include "collectives/tuner.hpp"
#include "runtime/executor.hpp"

namespace tutti {

struct CollectiveCall {
  dsl::Collective collective = dsl::Collective::kAllReduce;
  const void* input = nullptr;
  void* output = nullptr;
  int64_t count = 0;  // NCCL's count (allgather: sendcount, reduce-scatter: recvcount)
  Reduction reduction;
  int root = 0;
};

// What runs a call: a prepared plan, or the one-shot mailbox path (collectives/oneshot.hpp).
struct Choice {
  std::shared_ptr<const PreparedPlan> plan;
  bool oneshot = false;
  Choice() = default;
  Choice(std::shared_ptr<const PreparedPlan> p) : plan(std::move(p)) {}  // NOLINT: a plan is a choice
  static Choice one_shot() {
    Choice c;
    c.oneshot = true;
    return c;
  }
  explicit operator bool() const { return oneshot || plan != nullptr; }
  std::string name() const { return oneshot ? std::string(tuning::kOneShot) : plan->plan.name; }
};

// What a dispatcher is told to prefer; from_env() reads TUTTI_ALGO/NCCL_ALGO, TUTTI_TUNING_FILE,
// TUTTI_TUNE and TUTTI_ONESHOT_THRESHOLD.
struct DispatcherOptions {
  std::optional<std::string> algo;         // a forced algorithm
  std::optional<std::string> tuning_file;  // decision table to load (and save, when tuning)
  bool tune = false;
  uint64_t oneshot_threshold = 8 << 10;
  static DispatcherOptions from_env();
};

class Dispatcher {
 public:
  explicit Dispatcher(Communicator& comm, const DispatcherOptions& options = DispatcherOptions::from_env());
  void run(const CollectiveCall& call);
  // The plan the last run used (for logs and tests).
  const std::string& last_plan() const { return last_plan_; }
  const tuning::Table& table() const { return table_; }

  // External plans of this process (loaded once from the environment).
  static const std::vector<std::shared_ptr<const PreparedPlan>>& loaded_plans();

 private:
  Choice choose(dsl::Collective c, bool inplace, uint64_t bytes, int root, int64_t count, int64_t esize);
  std::shared_ptr<const PreparedPlan> builtin(const std::string& name, std::map<std::string, int> params);
  void check_consistent(const CollectiveCall& call);

  Communicator& comm_;
  Executor executor_;
  bool check_;                       // TUTTI_CHECK, read once
  std::optional<std::string> algo_;  // TUTTI_ALGO / NCCL_ALGO, read once
  std::optional<std::string> tuning_file_;  // TUTTI_TUNING_FILE
  bool tune_ = false;                       // TUTTI_TUNE
  tuning::Table table_;
  uint64_t oneshot_threshold_;              // TUTTI_ONESHOT_THRESHOLD
  Choice tuned(dsl::Collective c, uint64_t bytes, const std::function<Choice(const tuning::Candidate&)>& make);
  // Choices already made: (collective, in-place, root, bytes, count, element size) -> choice.
  std::map<std::tuple<int, bool, int, uint64_t, int64_t, int64_t>, Choice> chosen_;
  std::map<std::string, std::shared_ptr<const PreparedPlan>> cache_;
  std::vector<unsigned char> temp_in_, temp_out_;
  std::string last_plan_;
};

}  // namespace tutti
