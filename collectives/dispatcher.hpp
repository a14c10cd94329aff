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
#include "core/address_space.hpp"
#include "core/datatype.hpp"
#include "runtime/device/device_executor.hpp"
#include "runtime/cpu_executor.hpp"

namespace tutti {

struct CollectiveCall {
  Collective collective = Collective::kAllReduce;
  const void* input = nullptr;
  void* output = nullptr;
  int64_t count = 0;  // NCCL's count (allgather: sendcount, reduce-scatter: recvcount)
  Reduction reduction;
  int root = 0;
  bool device = false;     // buffers in device memory: run by a device executor
  void* stream = nullptr;  // cudaStream_t the call is ordered on (device executors)
};

// The sizes of a call on `nranks` ranks, checked before anything else uses them (both APIs call it
// first): InvalidArgument naming `fn` and the argument where count x element size (x ranks, for a
// buffer that holds every rank's part) overflows or describes memory past what this process can
// address. A wrapped size would move nothing and report success; an unaddressable one would crash.
// Inline: a bound that no call of fewer than 2^32 elements on fewer than 2^20 ranks can pass when both
// buffers end below 2^47 decides most calls in a few instructions; the rest are checked exactly, out
// of line (check_call_sizes_exactly).
inline void check_call_sizes(const CollectiveCall& call, int nranks, int rank, const char* fn);
// The bytes of a point-to-point transfer of `count` elements of `type`, checked the same way.
size_t checked_transfer_bytes(const void* buffer, size_t count, DataType type, int rank, const char* fn);
// check_call_sizes without the shortcut.
void check_call_sizes_exactly(const CollectiveCall& call, int nranks, int rank, const char* fn);

inline void check_call_sizes(const CollectiveCall& call, int nranks, int rank, const char* fn) {
  const auto count = static_cast<uint64_t>(call.count);  // a negative count is past 2^63 here
  const auto n = static_cast<uint64_t>(nranks);
  constexpr uint64_t kUserTop = uint64_t{1} << 47;
  if (count < (uint64_t{1} << 32) && n < (uint64_t{1} << 20)) {
    const uint64_t bound = count * 8 * n;  // at least the bytes of either buffer, below 2^55
    if (bound <= kUserTop && reinterpret_cast<uintptr_t>(call.input) <= kUserTop - bound &&
        reinterpret_cast<uintptr_t>(call.output) <= kUserTop - bound)
      return;
  }
  check_call_sizes_exactly(call, nranks, rank, fn);
}

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

// What a dispatcher is told to prefer, and the settings of the CPU executor it makes; from_env()
// reads TUTTI_ALGO/NCCL_ALGO, TUTTI_TUNING_FILE, TUTTI_TUNE, TUTTI_ONESHOT_THRESHOLD, TUTTI_CHECK
// and the CPU executor's variables (CpuExecutorOptions::from_env).
inline constexpr uint64_t kDefaultOneshotThreshold = 8 << 10;
// The same where every rank is on one host with more ranks than cores (Communicator::crowded_host):
// there the mailbox, where each rank runs once per call, beats the plans, where each step waits for
// a rank to be scheduled, up to 128 KiB for every collective (4 processes on 2 cores: 16-32 KiB
// calls 1.5-4x faster; docs/PERFORMANCE.md), which is also what the calibration chose on such hosts.
inline constexpr uint64_t kCrowdedOneshotThreshold = 128 << 10;


struct DispatcherOptions {
  std::optional<std::string> algo;         // a forced algorithm
  std::optional<std::string> tuning_file;  // decision table to load (and save, when tuning)
  bool tune = false;
  // Largest call (nccl-tests' size) for the one-shot mailbox. Unset: per collective, what
  // tutti-tune --calibrate measured for this machine and rank count, else kDefaultOneshotThreshold
  // (kCrowdedOneshotThreshold on a crowded host).
  std::optional<uint64_t> oneshot_threshold;
  bool check = false;  // compare every call's arguments across ranks first
  CpuExecutorOptions executor;
  static DispatcherOptions from_env();
};

// What dispatchers of one communicator may share: the executor (its scratch, staging and per-plan
// state) and the compiled built-in plans. Dispatchers with different options that choose the same
// plan then run the very same plan on the same memory; with separate executors two identical
// choices measured up to 11 % apart in one run (page placement), which `tutti-tune --compare`
// would report as a tuning error.
struct DispatchResources {
  DispatchResources(Communicator& c, const CpuExecutorOptions& options) : comm(c), executor(c, options) {}
  Communicator& comm;
  CpuExecutor executor;
  std::map<std::string, std::shared_ptr<const PreparedPlan>> plans;  // built-ins, by name and parameters
};

class Dispatcher {
 public:
  // `shared`: resources of another dispatcher of the same communicator (none: its own).
  explicit Dispatcher(Communicator& comm, const DispatcherOptions& options = DispatcherOptions::from_env(),
                      std::shared_ptr<DispatchResources> shared = nullptr);
  // Host buffers: the CPU executor, or the host mailbox for small calls.
  void run(const CollectiveCall& call);
  // Any executor: the same choice among plans (never the host mailbox on a device), with the call's
  // adaptations (in-place, premulsum, avg, a non-root's reduce output) done by the executor too, in
  // the order of call.stream. A device executor returns once everything is enqueued.
  void run(const CollectiveCall& call, Executor& executor);
  // Starts a host call without waiting for peers where it can (the one-shot mailbox: publish this
  // rank's contribution, finish at once if every peer's is there). Returns nothing when the call is
  // done, else the rest of it, to be run before any other call of this dispatcher (non-blocking
  // communicators hand it to their worker thread). Calls it cannot split are returned whole.
  std::function<void()> start(const CollectiveCall& call);
  // What the call would take, predicted by the cost model for the plan run() would choose, on this
  // host's topology with tutti-tune --calibrate's calibration when there is one. Runs nothing and
  // talks to no peer (ncclGroupSimulateEnd).
  double predict_us(const CollectiveCall& call);
  // The same for a given plan (a user's, run with run_plan) on pieces of `bytes`.
  double predict_us(const plan::Plan& plan, uint64_t bytes);
  // The same for one message of `bytes` to or from `peer`.
  double predict_transfer_us(int peer, size_t bytes);
  // The plan the last run used (for logs and tests).
  const std::string& last_plan() const { return last_plan_; }
  const tuning::Table& table() const { return table_; }
  const std::shared_ptr<DispatchResources>& resources() const { return res_; }

  // External plans of this process: the environment's (TUTTI_PLAN_DIR, MSCCL_XML_FILES,
  // MSCCL_ALGO_DIR, read on first use) and those load_plan() added. A snapshot.
  static std::vector<std::shared_ptr<const PreparedPlan>> loaded_plans();
  // Adds a plan file (JSON or MSCCL XML) for every dispatcher's later choices; throws InvalidArgument
  // naming the file if it cannot be read or verified.
  static void load_plan(const std::string& path);

 private:
  // The reference stays valid for the dispatcher's life (choices are never dropped).
  const Choice& choose(Collective c, bool inplace, uint64_t bytes, int root, int64_t count, int64_t esize,
                bool device = false);
  // choose() for a whole call, as run() would choose for it (start() and predict_us() ask too).
  const Choice& choose_for(const CollectiveCall& call);
  std::shared_ptr<const PreparedPlan> builtin(const std::string& name, std::map<std::string, int> params);
  // What choose() is asked, as its sources see it: the call's shape, and whether the one-shot
  // mailbox can take the call at all.
  struct ChoiceQuery {
    Collective c;
    bool inplace;
    uint64_t bytes;
    int root;
    int64_t count;
    int n;
    bool fits;
    // Whether a plan runs this call (collective, ranks, root, chunking, in-place).
    bool applicable(const PreparedPlan& pp) const;
    // The parameters of built-in `name` that the call decides (in-place, root, chunks).
    std::map<std::string, int> params_for(const std::string& name) const;
  };
  // The sources choose() asks in this order; each returns an empty Choice where it does not decide.
  Choice forced_choice(const ChoiceQuery& q);
  static Choice loaded_choice(const ChoiceQuery& q);
  Choice table_choice(const ChoiceQuery& q);
  Choice oneshot_choice(const ChoiceQuery& q) const;
  Choice default_choice(const ChoiceQuery& q);
  // Built-in `name` for the call, if it applies (else nullptr).
  std::shared_ptr<const PreparedPlan> applicable_builtin(const ChoiceQuery& q, const std::string& name);
  // A decision table entry's candidate as a choice for the call, if it applies.
  Choice candidate_choice(const ChoiceQuery& q, const tuning::Candidate& cand);
  void check_consistent(const CollectiveCall& call);
  void warn_about_settings();

  Communicator& comm_;
  std::shared_ptr<DispatchResources> res_;
  bool check_;                       // TUTTI_CHECK, read once
  std::optional<std::string> algo_;  // TUTTI_ALGO / NCCL_ALGO, read once
  std::optional<std::string> tuning_file_;  // TUTTI_TUNING_FILE
  bool tune_ = false;                       // TUTTI_TUNE
  tuning::Table table_;
  std::optional<uint64_t> oneshot_threshold_;  // TUTTI_ONESHOT_THRESHOLD
  std::map<Collective, uint64_t> calibrated_oneshot_;  // per collective, when the calibration has one
  uint64_t oneshot_threshold(Collective c) const;
  Choice tuned(Collective c, uint64_t bytes, const std::function<Choice(const tuning::Candidate&)>& make);
  // Choices already made: (collective, in-place, root, bytes, count, element size, device) -> choice.
  using ChoiceKey = std::tuple<int, bool, int, uint64_t, int64_t, int64_t, bool>;
  std::map<ChoiceKey, Choice> chosen_;
  ChoiceKey last_key_{};
  const Choice* last_chosen_ = nullptr;  // chosen_[last_key_]
  const Choice* last_run_ = nullptr;     // what run() ran last (last_plan_ is its name)
  std::string last_plan_;
};

}  // namespace tutti
