#pragma once
// A communicator's settings, filled when it is made (CommOptions::from_env reads TUTTI_* variables).
// Apart from communicator.hpp so transports can read them without depending on the communicator.

#include <cstdint>
#include <vector>

#include "runtime/fault.hpp"

namespace tutti {

enum class TransportKind { kAuto, kShm, kTcp };

struct CommOptions {
  double init_timeout_s = 120;
  int64_t max_ranks = 1 << 20;      // TUTTI_MAX_RANKS: larger communicators are refused at once
  int64_t max_local_ranks = 4096;   // TUTTI_MAX_LOCAL_RANKS: ranks one process may hold as threads
  double timeout_s = 1800;
  double divergence_probe_s = 2;  // TUTTI_DIVERGENCE_PROBE: idle seconds before a wait asks the peers (0: never)
  TransportKind transport = TransportKind::kAuto;
  uint32_t shm_slots = 16;
  uint64_t shm_slot_size = 128 << 10;
  bool shm_single_copy = true;
  uint64_t shm_single_copy_threshold = 64 << 20;
  // Below the threshold, messages of 16 KiB or more choose the FIFO or single copy by the rates
  // measured on each connection (runtime/transport/single_copy_choice.hpp).
  bool shm_single_copy_adaptive = true;
  uint64_t shm_zero_copy_threshold = 32 << 10;
  bool huge_pages = true;  // TUTTI_HUGE_PAGES: one-shot outboxes, and FIFOs that full slots stream through, on huge pages
  int tcp_sockets = 2;
  uint64_t tcp_stripe_threshold = 256 << 10;
  int spin = 200;  // microseconds
  uint64_t mailbox_bytes = 256 << 10;  // data capacity of each rank's one-shot outbox (0: none)
  std::vector<FaultSpec> faults;      // TUTTI_FAULT (runtime/fault.hpp); none by default

  // Defaults from TUTTI_* variables (see docs/ENVIRONMENT.md).
  static CommOptions from_env();
};

}  // namespace tutti
