#pragma once
// Calibration of the cost model on the live machine. A short collective microbenchmark measures,
// with every rank of the communicator taking part at once (so oversubscription shows):
// - the transport: ping-pong between rank pairs (0,1), (2,3), ... at 8 B .. 4 MiB; a least-squares
//   fit of the one-way time t(S) = alpha + S / beta, relative error weighted so small and large
//   sizes count alike;
// - both ways: every rank sending to the next rank and receiving from the previous one at once,
//   the load of a ring step, at 4 KiB .. 16 MiB (the curve the simulator interpolates; its 4 MiB
//   point is exchange_gbps); and the same with receives that reduce;
// - memory: every rank copying, then summing two float arrays, at once, 32 KiB .. 32 MiB (the rate of
//   the executor's local copies and reductions, in and out of cache; with more ranks than cores it
//   is the share a rank gets);
// - the executor: a ring all-reduce of 8 bytes, whose 2(n-1) dependent receives cost alpha plus
//   the per-instruction overhead each; and a plan of local copies of one element, the overhead of
//   an instruction that waits on no peer;
// - the wait: a ring all-reduce of 8 B and of 256 KiB with waits that poll 0, 20, 50, 100, 200,
//   500 and 1000 us before they sleep (TUTTI_SPIN); the choice is the shortest poll that loses
//   neither workload more than 5 % and lasts at least one wake-up (what a sleep costs a hop: poll
//   shorter than that and a wait that could have been caught costs more than the polling would
//   have, the ski-rental rule);
// - the shared-memory FIFO (slots x slot size) and the executor's tile: for process ranks,
//   communicators split off with each FIFO layout (and the calibrated single copy) exchange 64 KiB,
//   1 MiB and 16 MiB as a ring step does, interleaved (thread ranks pass 32 KiB and more by address,
//   so they keep the default layout); on the chosen layout, a ring all-reduce of 16 MiB runs with
//   tiles of 256 KiB .. 4 MiB. A setting
//   other than the default must win by more than 5 % (TUTTI_SHM_SLOTS, TUTTI_SHM_SLOT_SIZE,
//   TUTTI_TILE_SIZE);
// - the one-shot mailbox against the plan the dispatcher would run otherwise, per collective, at
//   64 B .. 128 KiB while the call fits the mailbox, under the chosen polling window; the threshold
//   is the largest measured size up to which the mailbox wins at every size
//   (TUTTI_ONESHOT_THRESHOLD).
// The last four are shared-memory settings, measured only there.
// Times are the median of a few rounds (a run of calls sees the typical round, not the luckiest).
// The result is stored per (transport, ranks) in a JSON file (TUTTI_CALIBRATION_FILE, default
// ~/.cache/tutti/calibration.json), reused by the tuner and tutti-sim, and may be edited to
// override any value.

#include <optional>
#include <string>
#include <vector>

#include "compiler/simulate.hpp"
#include "runtime/communicator.hpp"
#include "topologies/topology.hpp"

namespace tutti::tuning {

struct Calibration {
  std::string transport;  // "shm" or "tcp": what connects the ranks
  int nranks = 0;         // ranks on the host when measured
  int cores = 0;
  double alpha_us = 0;    // one-way latency of a message
  double beta_gbps = 0;   // transport bandwidth per direction, GB/s (one direction at a time)
  double exchange_gbps = 0;  // per flow while every rank sends 4 MiB to the next and receives from the previous
  double memory_gbps = 0;     // a rank's local copy rate while every rank copies
  double instruction_us = 0;  // executor overhead per receiving plan instruction (wake-up included)
  double local_instruction_us = 0;  // per instruction that waits on no peer (copies, sends)
  // Process ranks over shared memory: the message size from which reading the sender's buffer
  // directly (process_vm_readv) beats the FIFO's two copies, under a ring's load; 0: not measured
  // (thread ranks, TCP, or single copy forbidden); UINT64_MAX: never. Communicators of this many
  // ranks use it unless TUTTI_SHM_CMA_THRESHOLD is set (collectives/dispatcher.cpp).
  uint64_t single_copy_threshold = 0;
  // The measurements behind it: size -> (GB/s through the FIFO, GB/s by single copy).
  std::vector<std::pair<uint64_t, std::pair<double, double>>> single_copy;
  // The polling window of waits (us) for this machine and rank count, valid when spin_points is not
  // empty (0 is a valid window: sleep at once). Used unless TUTTI_SPIN is set. spin_points: window -> time relative to the fastest (the geometric mean over
  // the workloads); wake_us: what sleeping cost a hop of the 8 B ring.
  int spin_us = 0;
  double wake_us = 0;
  std::vector<std::pair<int, double>> spin_points;
  // Ranks over shared memory: the FIFO layout and the executor's tile size for this machine and rank
  // count; 0: not measured. Used unless TUTTI_SHM_SLOTS, TUTTI_SHM_SLOT_SIZE or TUTTI_TILE_SIZE is
  // set (for plan channels; the point-to-point channel keeps the layout it was made with). The
  // measurements: each layout's and each tile's time relative to the fastest (a geometric mean over
  // the sizes for layouts).
  uint32_t fifo_slots = 0;
  uint64_t fifo_slot_bytes = 0;
  int64_t tile_bytes = 0;
  struct FifoPoint {
    uint32_t slots = 0;
    uint64_t slot_bytes = 0;
    double relative = 0;
    bool operator==(const FifoPoint&) const = default;
  };
  std::vector<FifoPoint> fifo_points;
  std::vector<std::pair<int64_t, double>> tile_points;
  // Per collective, the largest call (nccl-tests' size) the one-shot mailbox takes (0: none), with the measurements behind it: size -> (one-shot us, plan
  // us). Used unless TUTTI_ONESHOT_THRESHOLD is set; every rank must see the same file, as for a
  // decision table.
  struct OneShotCut {
    Collective collective = Collective::kAllReduce;
    uint64_t threshold = 0;
    std::vector<std::pair<uint64_t, std::pair<double, double>>> points;
  };
  std::vector<OneShotCut> oneshot;
  // The measurements behind the fit: size -> one-way time (us).
  std::vector<std::pair<uint64_t, double>> pingpong;
  // One-way time per size under a collective's load (ping-pong up to 512 B, then every rank
  // sending to the next while receiving from the previous), which the simulator interpolates for
  // shared memory.
  std::vector<std::pair<uint64_t, double>> curve;
  // The same with receives that sum into a local array (recv_reduce): what a reducing step costs
  // under load, whose difference from `curve` is the work a reduction adds to a receive.
  std::vector<std::pair<uint64_t, double>> reduce_exchange;
  // A rank's copy rate while every rank copies at once, per bytes it touches (source and
  // destination): in cache the rate is several times memory_gbps (plan::CostModel::memory_curve).
  std::vector<std::pair<uint64_t, double>> memory_curve;
  // The same for a float sum of two arrays (GB/s of output, per bytes touched: both inputs and
  // the output), the work a reducing receive adds.
  std::vector<std::pair<uint64_t, double>> reduce_curve;
};

// Collective: every rank measures; every rank returns the same calibration (rank 0's view of the
// transport fit, the slowest rank's memory rate).
Calibration calibrate(Communicator& comm);

// The single-copy threshold from (size, (FIFO GB/s, single-copy GB/s)) points: the smallest size
// from which single copy is at least as fast at that size and every larger one; UINT64_MAX if
// there is none.
uint64_t choose_single_copy_threshold(const std::vector<std::pair<uint64_t, std::pair<double, double>>>& points);

// The one-shot threshold from (size, (one-shot us, plan us)) points: the largest size up to which
// the one-shot path is at least as fast (within 3 %) at every measured size; 0 if it loses at the
// smallest or there are no points.
uint64_t choose_oneshot_threshold(const std::vector<std::pair<uint64_t, std::pair<double, double>>>& points);
// Which of several settings to keep, from their times relative to the fastest: the default
// (index `default_index`) unless another is more than 5 % faster, else the fastest.
size_t choose_setting(const std::vector<double>& relative, size_t default_index);
// The polling window from (window us, relative time) points and the cost of a sleep (us): the
// shortest window at least `wake_us` long whose time is within 5 % of the best; the longest
// window if none is.
int choose_spin(const std::vector<std::pair<int, double>>& points, double wake_us);

// Fits alpha and beta to (size, time) points by relative least squares. InvalidArgument for fewer
// than two distinct sizes.
std::pair<double, double> fit_alpha_beta(const std::vector<std::pair<uint64_t, double>>& points);

// The calibration file: TUTTI_CALIBRATION_FILE, else $XDG_CACHE_HOME/tutti/calibration.json, else
// ~/.cache/tutti/calibration.json.
std::string calibration_path();
// Entries of the file (none if it does not exist); InvalidArgument naming the file and field if
// it is malformed.
std::vector<Calibration> load_calibrations(const std::string& path);
// Adds or replaces the entry for (transport, nranks).
void save_calibration(const std::string& path, const Calibration& c);
// The stored entry for (transport, nranks), if any.
std::optional<Calibration> find_calibration(const std::string& path, const std::string& transport, int nranks);
// What a communicator of its ranks takes from a shared-memory calibration when it is made
// (runtime/comm_options.hpp): the settings it measured, each only where it measured one.
std::optional<ShmCalibration> shm_settings(const Calibration& c);

// Puts a calibration into a topology (the ranks' shared-memory path: latency and bandwidth) and a
// cost model (memory rate, instruction overhead).
void apply(const Calibration& c, topo::Topology& t, plan::CostModel& m);

// A topology of `nranks` CPU ranks on one host, as the live machine runs them.
topo::Topology host_topology(int nranks);

}  // namespace tutti::tuning
