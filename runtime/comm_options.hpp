#pragma once
// A communicator's settings, filled when it is made (CommOptions::from_env reads TUTTI_* variables).
// Apart from communicator.hpp so transports can read them without depending on the communicator.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/fault.hpp"
#include "tutti/collective.hpp"

namespace tutti {

enum class TransportKind { kAuto, kShm, kTcp };

struct CommOptions {
  double init_timeout_s = 120;
  int64_t max_ranks = 1 << 20;      // TUTTI_MAX_RANKS: larger communicators are refused at once
  int64_t max_local_ranks = 4096;   // TUTTI_MAX_LOCAL_RANKS: ranks one process may hold as threads
  double timeout_s = 1800;
  double divergence_probe_s = 2;  // TUTTI_DIVERGENCE_PROBE: idle seconds before a wait asks the peers (0: never)
  TransportKind transport = TransportKind::kAuto;
  // Settings the calibration of this machine may provide (ShmCalibration): unset, the communicator
  // takes the calibration's value when it is made, else the default below; Communicator::options()
  // has them set. A value given here (or by the variable) is the user's choice and always wins.
  std::optional<uint32_t> shm_slots;                  // TUTTI_SHM_SLOTS
  std::optional<uint64_t> shm_slot_size;              // TUTTI_SHM_SLOT_SIZE
  std::optional<uint64_t> shm_single_copy_threshold;  // TUTTI_SHM_CMA_THRESHOLD
  std::optional<int> spin;                            // TUTTI_SPIN, microseconds
  static constexpr uint32_t kDefaultShmSlots = 16;
  static constexpr uint64_t kDefaultShmSlotSize = 128 << 10;
  static constexpr uint64_t kDefaultSingleCopyThreshold = 64 << 20;
  static constexpr int kDefaultSpin = 200;
  bool shm_single_copy = true;
  // Below the threshold, messages of 16 KiB or more choose the FIFO or single copy by the rates
  // measured on each connection (runtime/transport/single_copy_choice.hpp).
  bool shm_single_copy_adaptive = true;
  uint64_t shm_zero_copy_threshold = 32 << 10;
  bool huge_pages = true;  // TUTTI_HUGE_PAGES: one-shot outboxes, and FIFOs that full slots stream through, on huge pages
  int tcp_sockets = 2;
  uint64_t tcp_stripe_threshold = 256 << 10;
  uint64_t mailbox_bytes = 256 << 10;  // data capacity of each rank's one-shot outbox (0: none)
  std::vector<FaultSpec> faults;      // TUTTI_FAULT (runtime/fault.hpp); none by default
  // TUTTI_SOCKET_IFNAME: which interfaces bootstrap and rendezvous sockets listen on (NCCL's syntax:
  // prefixes, '^' excludes, '=' exact; runtime/socket.hpp). Empty: the first that is up, not loopback.
  std::string socket_ifname;
  // TUTTI_COMM_SECRET: the secret of a bare host:port comm id, which carries none (UniqueId::parse).
  std::string comm_secret;
  // TUTTI_CALIBRATION_FILE, else $XDG_CACHE_HOME/tutti/calibration.json, else
  // ~/.cache/tutti/calibration.json: where this machine's calibration is (ShmCalibration below).
  std::string calibration_file;

  // Defaults from TUTTI_* variables (see docs/ENVIRONMENT.md).
  static CommOptions from_env();
};

// What `tutti-tune --calibrate` measured on this machine for `nranks` ranks on one host over shared
// memory (collectives/calibrate.hpp keeps the whole measurement). A communicator whose ranks all
// share its host over shared memory takes it once, when it is made: each value replaces the
// default of a setting its options leave unset; the CPU executor (tile) and the dispatcher (one-shot
// thresholds) take theirs from Communicator::calibration() when they are made. Only the
// calibration's own sweeps change a made communicator's settings afterwards.
struct ShmCalibration {
  std::optional<uint64_t> single_copy_threshold;
  std::optional<int> spin_us;
  std::optional<std::pair<uint32_t, uint64_t>> fifo_layout;  // slots, slot bytes
  std::optional<int64_t> tile_bytes;
  std::vector<std::pair<Collective, uint64_t>> oneshot;  // the largest one-shot call, per collective
};
// Where communicators look for it: the collectives layer installs the reader of its calibration
// file (collectives/calibrate.cpp; the runtime does not know that file's format). Without a source,
// or when it has nothing for `nranks`, the defaults stand.
using CalibrationSource = std::function<std::optional<ShmCalibration>(const std::string& file, int nranks)>;
void set_calibration_source(CalibrationSource source);
std::optional<ShmCalibration> find_shm_calibration(const std::string& file, int nranks);

}  // namespace tutti
