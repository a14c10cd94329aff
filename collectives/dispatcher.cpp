#include "collectives/dispatcher.hpp"

#include "compiler/plan_file.hpp"
#include "core/address_space.hpp"
#include "runtime/call_stamp.hpp"

#include "collectives/calibrate.hpp"
#include "collectives/oneshot.hpp"
#include "compiler/simulate.hpp"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "runtime/wire.hpp"

namespace tutti {
namespace {

// NCCL's in-place calls: the input is the rank's slice of the output (all-gather), the output the
// rank's slice of the input (reduce-scatter), or the very same buffer.
bool is_inplace(Collective c, const unsigned char* in, const unsigned char* out, int rank, int64_t piece_bytes) {
  switch (c) {
    case Collective::kAllGather:
    case Collective::kGather: return in == out + rank * piece_bytes;
    case Collective::kReduceScatter:
    case Collective::kScatter: return out == in + rank * piece_bytes;
    default: return in == out;
  }
}

}  // namespace

namespace {

int64_t input_elems(Collective c, int64_t count, int n) {
  return c == Collective::kReduceScatter || c == Collective::kAllToAll ? count * n : count;
}
int64_t output_elems(Collective c, int64_t count, int n) {
  return c == Collective::kAllGather || c == Collective::kAllToAll ? count * n : count;
}

// How many `count`s a call's input and output buffers hold.
int64_t input_parts(Collective c, int n) {
  return c == Collective::kReduceScatter || c == Collective::kAllToAll || c == Collective::kScatter ? n : 1;
}
int64_t output_parts(Collective c, int n) {
  return c == Collective::kAllGather || c == Collective::kAllToAll || c == Collective::kGather ? n : 1;
}

void check_buffer_size(const void* buffer, uint64_t count, DataType type, int64_t parts, const char* what, int rank,
                       const char* fn) {
  const std::optional<uint64_t> bytes = checked_bytes(count, size_of(type), static_cast<uint64_t>(parts));
  TUTTI_CHECK(bytes, InvalidArgument, "{}: rank {}: count {} of {}{} overflows a 64-bit byte size ({})", fn, rank, count,
              name(type), parts > 1 ? fmt::format(" times {} ranks", parts) : "", what);
  TUTTI_CHECK(!buffer || addressable(buffer, *bytes), InvalidArgument,
              "{}: rank {}: {} at {} with count {} of {} ({} bytes) ends past this process's memory", fn, rank, what,
              buffer, count, name(type), *bytes);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s;
}

// Where each loaded plan came from, for the warning about two plans of one name.
std::map<const PreparedPlan*, std::string>& plan_sources() {
  static std::map<const PreparedPlan*, std::string> sources;
  return sources;
}

// Adds the plan in `path` to `out`, verified; throws InvalidArgument naming the file if it cannot be
// read or verified. A plan `out` holds already is not added twice (a warning names both files).
void add_plan(std::vector<std::shared_ptr<const PreparedPlan>>& out, const std::string& path) {
  plan::Plan p = plan::load_file(path);
  try {
    plan::certify(p);
  } catch (const Error& e) {
    rethrow_with_context(e, path);
  }
  for (const auto& other : out)
    if (other->plan.name == p.name && other->plan.collective == p.collective && other->plan.nranks == p.nranks &&
        other->plan.inplace == p.inplace) {
      auto source = plan_sources().find(other.get());
      TUTTI_WARN("plan '{}' ({} for {} ranks) is in {} and in {}; the one from {} is used: the first loaded wins "
                 "(TUTTI_PLAN_DIR in name order, then MSCCL_XML_FILES in the order given, then MSCCL_ALGO_DIR; "
                 "rename one to use both)",
                 p.name, to_string(p.collective), p.nranks,
                 source != plan_sources().end() ? source->second : "an earlier load", path,
                 source != plan_sources().end() ? source->second : "the earlier load");
      return;
    }
  TUTTI_INFO(log::kTuning, "loaded plan '{}' ({} for {} ranks, {}..{} bytes) from {}", p.name, to_string(p.collective),
             p.nranks, p.min_bytes, p.max_bytes, path);
  out.push_back(PreparedPlan::make(std::move(p)));
  plan_sources()[out.back().get()] = path;
}

// The environment's plans: one that cannot be used is skipped with a warning, not an error.
void load_into(std::vector<std::shared_ptr<const PreparedPlan>>& out, const std::string& path) {
  try {
    add_plan(out, path);
  } catch (const Error& e) {
    TUTTI_WARN("ignoring plan {}: {}", path, e.what());
  } catch (const std::bad_alloc&) {
    TUTTI_WARN("ignoring plan {}: out of memory while reading it", path);
  } catch (const std::exception& e) {
    TUTTI_WARN("ignoring plan {}: {}", path, e.what());
  }
}

void load_dir(std::vector<std::shared_ptr<const PreparedPlan>>& out, const std::string& dir, bool json_too) {
  DIR* d = opendir(dir.c_str());
  if (!d) {
    TUTTI_WARN("plan directory {} cannot be read", dir);
    return;
  }
  std::vector<std::string> files;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    auto ends = [&](const char* x) { return name.size() > strlen(x) && name.substr(name.size() - strlen(x)) == x; };
    if (ends(".xml") || (json_too && ends(".json"))) files.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  for (auto& f : files) load_into(out, f);
}

}  // namespace

namespace {
// The process's plans: the environment's, read on first use, and those load_plan() adds.
std::mutex g_plans_mutex;
std::vector<std::shared_ptr<const PreparedPlan>>& plans_locked() {
  static std::vector<std::shared_ptr<const PreparedPlan>> plans = [] {
    std::vector<std::shared_ptr<const PreparedPlan>> v;
    if (auto dir = env::raw("TUTTI_PLAN_DIR")) load_dir(v, *dir, true);
    if (auto files = env::raw("MSCCL_XML_FILES"))
      for (auto& f : env::split_list(*files, ':')) load_into(v, f);
    if (auto dir = env::raw("MSCCL_ALGO_DIR")) load_dir(v, *dir, false);
    return v;
  }();
  return plans;
}
}  // namespace

std::vector<std::shared_ptr<const PreparedPlan>> Dispatcher::loaded_plans() {
  std::lock_guard lock(g_plans_mutex);
  return plans_locked();
}

void Dispatcher::load_plan(const std::string& path) {
  std::lock_guard lock(g_plans_mutex);
  add_plan(plans_locked(), path);
}

DispatcherOptions DispatcherOptions::from_env() {
  DispatcherOptions o;
  o.algo = env::raw("TUTTI_ALGO");
  o.tuning_file = env::raw("TUTTI_TUNING_FILE");
  o.tune = env::get_bool("TUTTI_TUNE");
  if (env::is_set("TUTTI_ONESHOT_THRESHOLD")) o.oneshot_threshold = env::get_size("TUTTI_ONESHOT_THRESHOLD");
  o.check = env::get_bool("TUTTI_CHECK");
  o.executor = CpuExecutorOptions::from_env();
  return o;
}

Dispatcher::Dispatcher(Communicator& comm, const DispatcherOptions& options, std::shared_ptr<DispatchResources> shared)
    : comm_(comm),
      res_(shared ? std::move(shared) : std::make_shared<DispatchResources>(comm, options.executor)),
      check_(options.check),
      algo_(options.algo),
      tuning_file_(options.tuning_file),
      tune_(options.tune),
      oneshot_threshold_(options.oneshot_threshold) {
  TUTTI_CHECK(&res_->comm == &comm, InvalidArgument,
              "rank {}: a dispatcher can share resources only with dispatchers of its own communicator", comm.rank());
  if (tuning_file_ && !tuning_file_->empty() && ::access(tuning_file_->c_str(), F_OK) == 0) {
    table_ = tuning::Table::load(*tuning_file_);
    TUTTI_INFO(log::kTuning, "rank {}: decision table {} ({} entries, {})", comm.rank(), *tuning_file_,
               table_.entries.size(), table_.source);
  } else if (tuning_file_ && !tuning_file_->empty() && !tune_ && comm.rank() == 0) {
    TUTTI_WARN("TUTTI_TUNING_FILE={} does not exist; the built-in size windows decide (TUTTI_TUNE=1 measures and "
               "writes it)",
               *tuning_file_);
  }
  warn_about_settings();
  if (table_.source.empty()) table_.source = "measured";
  // The one-shot thresholds the communicator's calibration measured (its other settings are already
  // the communicator's and the executor's), unless TUTTI_ONESHOT_THRESHOLD chose one.
  if (!oneshot_threshold_ && comm.calibration())
    for (const auto& [collective, threshold] : comm.calibration()->oneshot) {
      calibrated_oneshot_[collective] = threshold;
      TUTTI_INFO(log::kTuning, "rank {}: one-shot {} up to {} bytes (calibrated for {} ranks over shm)", comm.rank(),
                 to_string(collective), threshold, comm.size());
    }
}

// Settings that would otherwise be ignored without a word: a forced algorithm that names nothing,
// loaded plans made for another number of ranks. Once per process and cause (rank 0 of each size).
void Dispatcher::warn_about_settings() {
  static std::mutex mu;
  static std::set<std::string> said;
  auto once = [&](const std::string& key, const std::string& text) {
    std::lock_guard lock(mu);
    if (said.insert(key).second) TUTTI_WARN("{}", text);
  };
  if (algo_ && !algo_->empty()) {
    const std::string want = lower(*algo_);
    bool known = want == tuning::kOneShot;
    std::string names;
    for (const auto& b : algorithms::builtins()) {
      const std::string family = b.name.substr(0, b.name.find('_'));
      known = known || want == b.name || want == family;
      if (names.find(family + " ") == std::string::npos) names += family + " ";
    }
    for (const auto& pp : loaded_plans()) known = known || want == lower(pp->plan.name);
    if (!known)
      once("algo " + want,
           fmt::format("TUTTI_ALGO/NCCL_ALGO={} names no algorithm: not a built-in, a family ({}or {}) or a loaded "
                       "plan; the default choice is used",
                       *algo_, names, tuning::kOneShot));
  }
  if (comm_.rank() == 0)
    for (const auto& pp : loaded_plans())
      if (pp->plan.nranks != comm_.size())
        once(fmt::format("ranks {} {}", pp->plan.name, comm_.size()),
             fmt::format("loaded plan '{}' is for {} ranks; a communicator of {} ranks does not use it",
                         pp->plan.name, pp->plan.nranks, comm_.size()));
}

Choice Dispatcher::tuned(Collective c, uint64_t bytes, const std::function<Choice(const tuning::Candidate&)>& make) {
  const int n = comm_.size();
  if (const tuning::Entry* e = table_.find(c, n, bytes)) return make(e->choice);
  if (!tune_) return {};
  // Measure this size's power-of-two bucket once: the model's shortlist plus every fixed algorithm,
  // on every rank in the same order (all ranks reach this call together, as NCCL requires).
  uint64_t hi = 1;
  while (hi < bytes) hi <<= 1;
  auto cands = tuning::shortlist(c, n, hi, tuning::live_topology(comm_), 4);
  // measure() rules the one-shot path out where the bucket's top does not fit the mailbox.
  if (comm_.mailbox()) cands.push_back({tuning::kOneShot, {}});
  auto ranked = tuning::measure(comm_, c, hi, cands, bytes <= (1u << 20) ? 50 : 5, 2);
  tuning::Entry e;
  e.collective = c;
  e.nranks = n;
  e.min_bytes = hi / 2 + 1;
  e.max_bytes = hi;
  e.choice = ranked.front().candidate;
  e.time_us = ranked.front().time_us;
  table_.put(e);
  TUTTI_INFO(log::kTuning, "rank {}: tuned {} of {}..{} bytes: {} ({:.2f} us; next {} {:.2f} us)", comm_.rank(),
             to_string(c), e.min_bytes, e.max_bytes, e.choice.describe(), e.time_us,
             ranked.size() > 1 ? ranked[1].candidate.describe() : "-", ranked.size() > 1 ? ranked[1].time_us : 0.0);
  if (tuning_file_ && !tuning_file_->empty() && comm_.rank() == 0) {
    table_.topology = "live";
    table_.save(*tuning_file_);
  }
  return make(e.choice);
}

std::shared_ptr<const PreparedPlan> Dispatcher::builtin(const std::string& name, std::map<std::string, int> params) {
  std::string key = name;
  for (auto& [k, v] : params) key += fmt::format(" {}={}", k, v);
  auto& cache = res_->plans;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  plan::Compiled c = plan::compile(algorithms::build(name, comm_.size(), params));
  auto prepared = PreparedPlan::make(std::move(c.plan));
  cache[key] = prepared;
  return prepared;
}

uint64_t Dispatcher::oneshot_threshold(Collective c) const {
  if (oneshot_threshold_) return *oneshot_threshold_;
  auto it = calibrated_oneshot_.find(c);
  if (it != calibrated_oneshot_.end()) return it->second;
  return comm_.crowded_host() ? kCrowdedOneshotThreshold : kDefaultOneshotThreshold;
}

bool Dispatcher::ChoiceQuery::applicable(const PreparedPlan& pp) const {
  const plan::Plan& p = pp.plan;
  if (p.collective != c || p.nranks != n) return false;
  if (has_root(c) && (p.root != root || p.inplace)) return false;
  if (!p.any_count && count % p.chunk_factor != 0) return false;
  // An in-place plan serves an out-of-place reduce-scatter only with a larger output: never.
  if (c == Collective::kReduceScatter && p.inplace && !inplace) return false;
  return true;
}

std::map<std::string, int> Dispatcher::ChoiceQuery::params_for(const std::string& name) const {
  const algorithms::Builtin& b = algorithms::find_builtin(name);
  std::map<std::string, int> prm;
  for (auto& p : b.params) {
    if (p.name == "inplace") prm["inplace"] = has_root(c) ? 0 : inplace;
    if (p.name == "root") prm["root"] = root;
    if (p.name == "chunks" && name == "chain_broadcast")
      prm["chunks"] = static_cast<int>(std::clamp<uint64_t>(bytes >> 20, 1, 16));
  }
  return prm;
}

std::shared_ptr<const PreparedPlan> Dispatcher::applicable_builtin(const ChoiceQuery& q, const std::string& name) {
  for (const auto& b : algorithms::builtins())
    if (b.name == name && b.collective == q.c) {
      auto prm = q.params_for(name);
      std::map<std::string, int> full;
      try {
        full = algorithms::resolve(b, q.n, prm);
      } catch (const InvalidArgument&) {
        return nullptr;  // not for this rank count
      }
      auto pp = builtin(name, full);
      if (q.applicable(*pp)) return pp;
    }
  return nullptr;
}

// TUTTI_ALGO/NCCL_ALGO: the one-shot path, a loaded plan or a built-in (by name or family) of that name.
Choice Dispatcher::forced_choice(const ChoiceQuery& q) {
  if (!algo_) return {};
  std::string want = lower(*algo_);
  if (want == tuning::kOneShot && q.fits) return Choice::one_shot();
  for (auto& pp : loaded_plans())
    if (lower(pp->plan.name) == want && q.applicable(*pp)) return pp;
  std::string coll = to_string(q.c);
  for (const std::string& name : {want, want + "_" + coll})
    if (auto pp = applicable_builtin(q, name)) return pp;
  static std::once_flag warned;
  std::call_once(warned, [&] { TUTTI_INFO(log::kTuning, "TUTTI_ALGO={} does not apply to {}; using the default", *algo_, coll); });
  return {};
}

// Loaded plans whose size window holds the call, the first loaded first.
Choice Dispatcher::loaded_choice(const ChoiceQuery& q) {
  for (auto& pp : loaded_plans())
    if (q.applicable(*pp) && pp->plan.min_bytes <= q.bytes && q.bytes <= pp->plan.max_bytes) return pp;
  return {};
}

Choice Dispatcher::candidate_choice(const ChoiceQuery& q, const tuning::Candidate& cand) {
  if (cand.algorithm == tuning::kOneShot) return q.fits ? Choice::one_shot() : Choice{};
  const algorithms::Builtin& b = algorithms::find_builtin(cand.algorithm);
  if (b.collective != q.c) return {};
  auto prm = q.params_for(cand.algorithm);
  for (auto& [k, v] : cand.params) prm[k] = v;
  std::map<std::string, int> full;
  try {
    full = algorithms::resolve(b, q.n, prm);
  } catch (const InvalidArgument& e) {
    TUTTI_WARN("decision table entry {} does not apply to {} ranks: {}", cand.describe(), q.n, e.what());
    return {};
  }
  auto pp = builtin(cand.algorithm, full);
  return q.applicable(*pp) ? Choice(pp) : Choice{};
}

// The decision table (or, with TUTTI_TUNE=1, a measurement of this size).
Choice Dispatcher::table_choice(const ChoiceQuery& q) {
  return tuned(q.c, q.bytes, [&](const tuning::Candidate& cand) { return candidate_choice(q, cand); });
}

// Small calls on one host: the one-shot mailbox, while it beats the plans (see PERFORMANCE.md).
Choice Dispatcher::oneshot_choice(const ChoiceQuery& q) const {
  if (q.fits && q.bytes <= oneshot_threshold(q.c)) return Choice::one_shot();
  return {};
}

Choice Dispatcher::default_choice(const ChoiceQuery& q) {
  const std::string name = algorithms::default_algorithm(q.c, q.bytes, q.n, comm_.crowded_host());
  auto pp = applicable_builtin(q, name);
  TUTTI_CHECK(pp != nullptr, InternalError, "built-in {} does not apply to {} ranks", name, q.n);
  return pp;
}

const Choice& Dispatcher::choose(Collective c, bool inplace, uint64_t bytes, int root, int64_t count, int64_t esize,
                                 bool device) {
  auto key = std::make_tuple(static_cast<int>(c), inplace, root, bytes, count, esize, device);
  // A loop of one call shape (the common case) skips the map.
  if (last_chosen_ && last_key_ == key) return *last_chosen_;
  auto hit = chosen_.find(key);
  if (hit != chosen_.end()) {
    last_key_ = key;
    return *(last_chosen_ = &hit->second);
  }
  // The mailbox lives in host memory: device buffers always run plans.
  const bool fits = !device && comm_.mailbox() && oneshot_fits(*comm_.mailbox(), c, count, esize);
  const ChoiceQuery q{c, inplace, bytes, root, count, comm_.size(), fits};
  // The first source that decides wins.
  Choice ch = forced_choice(q);
  if (!ch) ch = loaded_choice(q);
  if (!ch) ch = table_choice(q);
  if (!ch) ch = oneshot_choice(q);
  if (!ch) ch = default_choice(q);
  last_key_ = key;
  return *(last_chosen_ = &(chosen_[key] = std::move(ch)));  // map nodes stay put
}

void Dispatcher::check_consistent(const CollectiveCall& call) {
  wire::Writer w;
  w.put<int32_t>(static_cast<int32_t>(call.collective)).put<int64_t>(call.count);
  w.put<int32_t>(static_cast<int32_t>(call.reduction.type)).put<int32_t>(static_cast<int32_t>(call.reduction.op));
  w.put<int32_t>(call.root);
  auto all = comm_.bootstrap().allgather(w.bytes(), BootstrapOp::kCallCheck);
  for (int r = 0; r < comm_.size(); ++r) {
    wire::Reader rd(all[r], "TUTTI_CHECK header");
    auto coll = static_cast<Collective>(rd.get<int32_t>());
    int64_t count = rd.get<int64_t>();
    auto type = static_cast<DataType>(rd.get<int32_t>());
    auto op = static_cast<RedOp>(rd.get<int32_t>());
    int root = rd.get<int32_t>();
    auto mismatch = [&](const char* what, const std::string& mine, const std::string& theirs) {
      throw InvalidArgument(fmt::format("TUTTI_CHECK: rank {} calls {} with {} {} but rank {} with {} {}", comm_.rank(),
                                        to_string(call.collective), what, mine, r, what, theirs));
    };
    if (coll != call.collective) mismatch("collective", to_string(call.collective), to_string(coll));
    if (count != call.count) mismatch("count", std::to_string(call.count), std::to_string(count));
    if (type != call.reduction.type) mismatch("datatype", std::string(name(call.reduction.type)), std::string(name(type)));
    if (reduces(coll) && op != call.reduction.op) mismatch("op", std::string(name(call.reduction.op)), std::string(name(op)));
    if (has_root(coll) && root != call.root) mismatch("root", std::to_string(call.root), std::to_string(root));
  }
}

namespace {

// Device calls up to this size run LL (one 16-byte store per 8 bytes, no fence per message); above
// it Simple, whose full-width copies move more bytes per instruction.
constexpr uint64_t kDeviceLLBytes = 64 << 10;

}  // namespace

namespace {
// This host's model for `n` ranks: the calibration tutti-tune --calibrate measured for the
// communicator's transport, if any, else the defaults.
std::pair<topo::Topology, plan::CostModel> host_model(Communicator& comm) {
  const int n = comm.size();
  std::pair<topo::Topology, plan::CostModel> m{tuning::host_topology(n), {}};
  const std::string transport = n > 1 ? comm.transport_to(comm.rank() == 0 ? 1 : 0) : "shm";
  if (auto cal = tuning::find_calibration(comm.options().calibration_file, transport, n))
    tuning::apply(*cal, m.first, m.second);
  return m;
}
}  // namespace

const Choice& Dispatcher::choose_for(const CollectiveCall& call) {
  const Collective c = call.collective;
  const int n = comm_.size();
  const int64_t esize = static_cast<int64_t>(size_of(call.reduction.type));
  const uint64_t bytes =
      static_cast<uint64_t>(std::max(input_elems(c, call.count, n), output_elems(c, call.count, n)) * esize);
  // premulsum reads a scaled copy of the input, so such a call never runs in place (as in run()).
  const bool inplace = call.reduction.op != RedOp::kPreMulSum &&
                       is_inplace(c, static_cast<const unsigned char*>(call.input),
                                  static_cast<const unsigned char*>(call.output), comm_.rank(), call.count * esize);
  return choose(c, inplace, bytes, call.root, call.count, esize, call.device);
}

double Dispatcher::predict_transfer_us(int peer, size_t bytes) {
  auto [t, model] = host_model(comm_);
  const topo::Path path = t.path(comm_.rank(), peer);
  return path.latency_us + model.instruction_us + static_cast<double>(bytes) / (path.gbps * 1e3);
}

double Dispatcher::predict_us(const plan::Plan& p, uint64_t bytes) {
  auto [t, model] = host_model(comm_);
  return plan::simulate(p, t, bytes, model).time_us;
}

double Dispatcher::predict_us(const CollectiveCall& call) {
  const int n = comm_.size();
  const Collective c = call.collective;
  const int64_t esize = static_cast<int64_t>(size_of(call.reduction.type));
  Choice choice = choose_for(call);
  auto [t, model] = host_model(comm_);
  // The one-shot mailbox has no plan: the model's default algorithm for the call stands in for it.
  plan::Plan fallback;
  if (choice.oneshot) {
    auto defaults = tuning::defaults(c, n);
    TUTTI_CHECK(!defaults.empty(), InternalError, "no default algorithm for {} on {} ranks", to_string(c), n);
    fallback = tuning::plan_of(defaults.front(), c, n);
  }
  const plan::Plan& p = choice.oneshot ? fallback : choice.plan->plan;
  return plan::simulate(p, t, static_cast<uint64_t>(call.count * esize), model).time_us;
}

void check_call_sizes_exactly(const CollectiveCall& call, int nranks, int rank, const char* fn) {
  TUTTI_CHECK(call.count >= 0, InvalidArgument, "{}: rank {}: count {} is past 2^63", fn, rank,
              static_cast<uint64_t>(call.count));
  const auto count = static_cast<uint64_t>(call.count);
  check_buffer_size(call.input, count, call.reduction.type, input_parts(call.collective, nranks), "sendbuff", rank, fn);
  check_buffer_size(call.output, count, call.reduction.type, output_parts(call.collective, nranks), "recvbuff", rank,
                    fn);
}

size_t checked_transfer_bytes(const void* buffer, size_t count, DataType type, int rank, const char* fn) {
  check_buffer_size(buffer, count, type, 1, "buffer", rank, fn);
  return count * size_of(type);
}

void Dispatcher::run(const CollectiveCall& call) { run(call, res_->executor); }

std::function<void()> Dispatcher::start(const CollectiveCall& call) {
  auto whole = [this, call] { run(call); };
  // Only a plain host call the one-shot mailbox takes can be split; the rest runs whole, later.
  if (call.device || check_ || call.reduction.op == RedOp::kPreMulSum || !comm_.mailbox()) return whole;
  const int n = comm_.size(), rank = comm_.rank();
  const Collective c = call.collective;
  const Choice& choice = choose_for(call);
  if (!choice.oneshot) return whole;
  Mailbox& mb = *comm_.mailbox();
  // A root far ahead of its receivers would wait for room: that wait belongs on the worker.
  if (!oneshot_has_room(mb, c, call.count, static_cast<int64_t>(size_of(call.reduction.type)))) return whole;
  last_plan_ = tuning::kOneShot;
  last_run_ = &choice;
  if (FaultInjector* f = comm_.faults()) f->begin_call(comm_);
  auto finish = [call, &mb, n, rank] {
    finish_oneshot(mb, call.collective, call.input, call.output, call.count, call.reduction, call.root);
    if (call.reduction.op == RedOp::kAvg && (call.collective != Collective::kReduce || rank == call.root))
      tutti::divide(call.reduction.type, call.output, call.output, static_cast<uint64_t>(n),
                    static_cast<size_t>(output_elems(call.collective, call.count, n)));
  };
  if (start_oneshot(mb, c, call.input, call.count, call.reduction, call.root)) {
    finish();
    return {};
  }
  return finish;
}

void Dispatcher::run(const CollectiveCall& call, Executor& ex) {
  // What this rank's collective call is, for the divergence probe (runtime/comm_state.hpp).
  // The same stamp every message of the call carries (the chosen plan has the call's collective and
  // root), computed once.
  const CallStamp stamp =
      make_stamp(call.collective, call.reduction.type, call.reduction.op, call.root, static_cast<uint64_t>(call.count));
  CallActivity activity(comm_.state(), stamp);
  const bool dev = ex.device();
  void* const stream = call.stream;
  const int n = comm_.size(), rank = comm_.rank();
  const Collective c = call.collective;
  const int64_t esize = static_cast<int64_t>(size_of(call.reduction.type));
  const int64_t in_elems = input_elems(c, call.count, n), out_elems = output_elems(c, call.count, n);
  const size_t in_bytes = static_cast<size_t>(in_elems * esize), out_bytes = static_cast<size_t>(out_elems * esize);
  if (FaultInjector* f = comm_.faults()) f->begin_call(comm_);
  if (check_) check_consistent(call);
  const unsigned char* in = static_cast<const unsigned char*>(call.input);
  unsigned char* out = static_cast<unsigned char*>(call.output);
  bool inplace = is_inplace(c, in, out, rank, call.count * esize);
  // premulsum: the scaled contribution replaces the input.
  const unsigned char* scaled = nullptr;
  if (call.reduction.op == RedOp::kPreMulSum) {
    auto* t = static_cast<unsigned char*>(ex.temp(0, in_bytes, stream));
    ex.scale(call.reduction.type, t, in, call.reduction.scalar, static_cast<size_t>(in_elems), stream);
    in = scaled = t;
    inplace = false;
  }
  const uint64_t bytes = static_cast<uint64_t>(std::max(in_bytes, out_bytes));
  const Choice& choice = choose(c, inplace, bytes, call.root, call.count, esize, dev);
  if (&choice != last_run_) {  // names are compared only when the choice changes
    if (last_plan_ != choice.name())
      TUTTI_INFO(log::kTuning, "rank {}: {} of {} bytes{} runs plan '{}'", rank, to_string(c), bytes,
                 dev ? " on the device" : "", choice.name());
    last_plan_ = choice.name();
    last_run_ = &choice;
  }
  auto finish = [&] {
    if (call.reduction.op == RedOp::kAvg && (c != Collective::kReduce || rank == call.root))
      ex.divide(call.reduction.type, out, out, static_cast<uint64_t>(n), static_cast<size_t>(out_elems), stream);
  };
  if (choice.oneshot) {
    // `in` is the premulsum-scaled copy where there is one; in-place calls need nothing more.
    run_oneshot(*comm_.mailbox(), c, in, out, call.count, call.reduction, call.root);
    finish();
    return;
  }
  // Reduce, gather: non-roots keep their receive buffer untouched (NCCL does not use it there, and
  // a gather's may be NULL; the mailbox does not write it). Scatter: no plan reads a non-root's
  // send buffer, which may be NULL: executors are given none.
  if ((c == Collective::kReduce || c == Collective::kGather) && rank != call.root)
    out = static_cast<unsigned char*>(ex.temp(1, out_bytes, stream));
  if (c == Collective::kScatter && rank != call.root) in = nullptr;
  const auto& pp = choice.plan;
  ExecArgs args;
  args.count = call.count;
  args.reduction = call.reduction;
  args.input = in;
  args.output = out;
  args.stream = stream;
  args.stamp = stamp;
  if (dev && bytes <= kDeviceLLBytes) args.protocol = Protocol::kLL;
  if (!has_root(c) && pp->plan.inplace && !inplace) {
    // Out-of-place call, in-place plan: put the input where the plan expects it.
    unsigned char* slot = c == Collective::kAllGather ? out + rank * call.count * esize : out;
    ex.copy(slot, in, in_bytes, stream);
    args.input = slot;
  } else if (!has_root(c) && !pp->plan.inplace && inplace && in != scaled) {
    // In-place call, out-of-place plan: the plan must read an input it does not overwrite.
    auto* t = static_cast<unsigned char*>(ex.temp(0, in_bytes, stream));
    ex.copy(t, in, in_bytes, stream);
    args.input = t;
  }
  TUTTI_TRACE(log::kColl, "rank {}: {} count {} {} via plan '{}'", rank, to_string(c), call.count,
              name(call.reduction.type), pp->plan.name);
  ex.run(*pp, args);
  finish();
}

}  // namespace tutti

