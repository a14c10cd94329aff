#pragma once
// The tuner: which built-in algorithm, with which parameters, for each collective, rank count and
// size window. It enumerates candidates (algorithm x channels x chunks x levels), ranks them with the
// cost model (plan::simulate on a topology), and on the live machine confirms the best by measuring
// them on the communicator. The result is a decision table, which the dispatcher consults before its
// fixed size windows (TUTTI_TUNING_FILE loads it; TUTTI_TUNE=1 fills it while running and saves it
// there).
//
// Measurement is collective: every rank runs the same candidates in the same order, and the time
// of a candidate is the slowest rank's, so every rank reaches the same decision.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/algorithms/registry.hpp"
#include "compiler/simulate.hpp"
#include "core/function_ref.hpp"
#include "runtime/communicator.hpp"
#include "topologies/topology.hpp"

namespace tutti::tuning {

// The one-shot mailbox path (collectives/oneshot.hpp): a candidate the dispatcher runs without a
// plan, on communicators whose ranks all share memory, for calls that fit the mailbox.
inline constexpr const char* kOneShot = "oneshot";

struct Candidate {
  std::string algorithm;      // built-in name
  algorithms::Params params;  // tuned parameters only (the dispatcher adds inplace and root)
  Protocol protocol = Protocol::kAuto;  // kAuto: the plan's own (GPU ranks only differ)
  std::string describe() const;  // "ring_allreduce channels=2 protocol=LL"
  bool operator==(const Candidate&) const = default;
};

struct Entry {
  Collective collective = Collective::kAllReduce;
  int nranks = 1;
  uint64_t min_bytes = 0, max_bytes = UINT64_MAX;  // nccl-tests' size, inclusive
  Candidate choice;
  double time_us = 0;  // predicted or measured at the size the entry was tuned for
};

struct Table {
  static constexpr int kVersion = 1;
  std::string topology;  // what it was tuned on
  std::string source;    // "model" or "measured"
  std::vector<Entry> entries;

  const Entry* find(Collective c, int nranks, uint64_t bytes) const;
  // Adds or replaces the entry for [min, max] of (collective, nranks).
  void put(const Entry& e);
  std::string to_json() const;
  static Table from_json(const std::string& text);  // InvalidArgument naming what is wrong
  static Table load(const std::string& path);
  void save(const std::string& path) const;
};

// Every candidate of a collective at a rank count: each built-in it supports, with channels in
// {1, 2, 4}, chunks in {1, 2, 4, 8} and hierarchical levels at every divisor of nranks; with
// `protocols`, each of those with Simple, LL and LL128 (for GPU ranks, whose cost depends on it).
std::vector<Candidate> candidates(Collective c, int nranks, bool protocols = false);
// The built-ins with their default parameters: "fixed" algorithms, as TUTTI_ALGO would pick them.
std::vector<Candidate> defaults(Collective c, int nranks);
// The compiled plan of a candidate (out-of-place, root 0).
plan::Plan plan_of(const Candidate& c, Collective coll, int nranks);

struct Ranked {
  Candidate candidate;
  double time_us;
};
// Candidates sorted by predicted time (fastest first) for `bytes` on `topology`.
std::vector<Ranked> rank_by_model(Collective c, int nranks, uint64_t bytes, const topo::Topology& topology,
                                  const plan::CostModel& model = {});

// Sizes from min to max by factor (nccl-tests' -b -e -f).
std::vector<uint64_t> sweep(uint64_t min_bytes, uint64_t max_bytes, double factor);
// One entry per size, merged into windows where consecutive sizes agree. Windows meet halfway (in
// log scale) between tuned sizes; the first starts at 0 and the last ends at UINT64_MAX.
void add_windows(Table& table, Collective c, int nranks, const std::vector<uint64_t>& sizes,
                 const std::vector<Ranked>& best);

// The choices of a measured sweep: rankings[i] is what was measured at the i-th size. Among the
// candidates within `tolerance` of the fastest at a size, each size takes the one with the lowest
// mean of time / fastest time over that size and its two neighbours (where it was measured), so a
// plan that is a few percent faster at one size only (noise) does not split a window, and one that
// wins beside a crossover is not kept past it; with one size this is the fastest.
std::vector<Ranked> choose_smoothed(const std::vector<std::vector<Ranked>>& rankings, double tolerance = 0.05);

// The model alone (presets, machines we do not have).
Table tune_model(const topo::Topology& topology, Collective c, int nranks, const std::vector<uint64_t>& sizes,
                 const plan::CostModel& model = {});

// t[way][round] -> one time per way: the way's median ratio to the median way of each round, times
// the median of that reference. Within a round, a size's ways run milliseconds apart, in the same
// phase of the machine, while rounds spread over phases up to 3x apart; plain medians then depend on
// how many of a way's rounds fell in a slow phase (the very same plan came out 6 % apart).
std::vector<double> paired_medians(const std::vector<std::vector<double>>& t);

// Times several ways of running the same call on a live communicator (collective: every rank passes
// the same list). For `rounds` rounds, each way in turn (in a shuffled order, new each round) gets
// one untimed call, a barrier and `iters` timed calls; a round's time of a way is the slowest rank's
// mean per call, and the result (paired_medians) is the same on every rank. Interleaving puts every
// way through the same moments of a noisy machine, pairing cancels the moment, and medians drop
// preempted rounds.
std::vector<double> interleaved_medians(Communicator& comm, const std::vector<FunctionRef<void()>>& ways, int rounds,
                                        int iters);
// The same over a sweep: ways[i] are the ways at the i-th size, each timed with iters[i] calls.
// Rounds are the outer loop, so each size's median spans the whole sweep instead of the second or
// two its own rounds would take: this machine's shared-memory speed changes in phases of 2-3 s
// (docs/PERFORMANCE.md), and a choice made in one phase can be wrong in the next.
std::vector<std::vector<double>> interleaved_sweep(Communicator& comm,
                                                   const std::vector<std::vector<FunctionRef<void()>>>& ways,
                                                   int rounds, const std::vector<int>& iters);

// Measures candidates on a live communicator (collective call); returns them fastest first, with the
// slowest rank's time per call (interleaved_medians; warmup calls each first).
std::vector<Ranked> measure(Communicator& comm, Collective c, uint64_t bytes, const std::vector<Candidate>& cands,
                            int iters, int warmup, int rounds = 5);
// measure() at every size of a sweep (cands[i] at sizes[i], iters[i] calls per round), through
// interleaved_sweep: the buffers of every size stay allocated for the whole sweep.
std::vector<std::vector<Ranked>> measure_sweep(Communicator& comm, Collective c, const std::vector<uint64_t>& sizes,
                                               const std::vector<std::vector<Candidate>>& cands,
                                               const std::vector<int>& iters, int warmup, int rounds);
// What to measure at one size: the model's top `top` candidates plus every fixed algorithm, so the
// tuned choice is never worse than the best fixed one as far as measurement can tell.
std::vector<Candidate> shortlist(Collective c, int nranks, uint64_t bytes, const topo::Topology& topology, int top);

// The world topology of a live communicator (collective): every rank's detected view of its host
// goes through the bootstrap, and one view per host is merged (topo::merge) with the ranks placed
// on their hosts. Ranks on one host share its devices; hosts are joined through their NICs.
topo::Topology live_topology(Communicator& comm);

}  // namespace tutti::tuning
