#pragma once
// A communicator: one rank's membership in a group of ranks, with a connection to every peer on
// each channel and the progress engine that drives them.
//
// Lifecycle (each step is collective over the ranks involved, like NCCL's):
// - create(): from a unique id, this rank's number and the size (ncclCommInitRank);
// - create_local(): N ranks as threads of this process (ncclCommInitAll);
// - create_from_env(): rank, size and comm id from tutti-run, mpirun or srun variables;
// - split(): new communicators by color and key (ncclCommSplit);
// - destruction: flushes pending sends, says goodbye to the peers, frees every resource;
// - abort(): from any thread; every wait of this rank fails with Aborted promptly and the peers
//   are told, so their waits fail with RemoteError instead of hanging.
//
// Thread safety: one thread at a time drives a communicator; abort() may come from any thread.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/bootstrap.hpp"
#include "runtime/comm_options.hpp"
#include "runtime/comm_state.hpp"
#include "runtime/fault.hpp"
#include "runtime/mailbox.hpp"
#include "runtime/progress.hpp"
#include "runtime/shm_segment.hpp"
#include "runtime/transport/connection.hpp"
#include "runtime/transport/transport.hpp"
#include "runtime/unique_id.hpp"

namespace tutti {

// Refuse, before anything is allocated for it, a communicator larger than options.max_ranks
// (TUTTI_MAX_RANKS), or (check_local_ranks) more ranks as threads of this process than
// options.max_local_ranks: InvalidArgument naming the size and the variable that raises the limit.
void check_world_size(int nranks, const CommOptions& options);
void check_local_ranks(int nranks, const CommOptions& options);

class Communicator {
 public:
  // `state`: made by the caller beforehand (rank and size as given), so another thread can abort()
  // it while this call is still in the rendezvous (ncclCommAbort of a non-blocking init); none:
  // a fresh one.
  static std::unique_ptr<Communicator> create(const UniqueId& id, int nranks, int rank,
                                              const CommOptions& options = CommOptions::from_env(),
                                              uint64_t generation = 0, std::shared_ptr<CommState> state = nullptr);
  static std::vector<std::unique_ptr<Communicator>> create_local(int nranks,
                                                                 const CommOptions& options = CommOptions::from_env());
  static std::unique_ptr<Communicator> create_from_env(const CommOptions& options = CommOptions::from_env());
  // Collective over this communicator. color < 0: takes part, gets no communicator (nullptr). The
  // new communicator has this one's options unless given others (alike on every rank of a color).
  std::unique_ptr<Communicator> split(int color, int key, const std::optional<CommOptions>& options = std::nullopt);
  // Collective over the ranks not in `exclude` (only they call it): a new communicator of them, in
  // rank order (ncclCommShrink). `after_failure` (NCCL_SHRINK_ABORT): this communicator may have
  // lost ranks; its calls in progress are stopped first (revoke) and the survivors meet despite the
  // recorded failure. Throws InvalidArgument for a rank out of range or a caller that is excluded.
  std::unique_ptr<Communicator> shrink(const std::vector<int>& exclude, bool after_failure = false);
  // The divergence probe (CommState::set_probe): asks the peers which collective call they are in
  // and names one at this rank's call number in another call; empty if none (or no conclusion).
  std::string diverged_peer();

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  void abort();
  // Stops every data-plane wait of this rank (they fail with Aborted) but keeps the bootstrap, so
  // split(), shrink() and destruction still work (ncclCommRevoke). Local: each rank revokes its own.
  void revoke();
  int rank() const { return state_->rank(); }
  int size() const { return state_->nranks(); }
  const CommOptions& options() const { return options_; }

  // Collective: makes sure channels 0..n-1 are connected.
  void ensure_channels(int n);
  int channels() const { return static_cast<int>(connections_.size()); }
  Connection& connection(int peer, int channel = 0);
  const char* transport_to(int peer) const;  // the name of the transport that carries it, or "self"
  int local_ranks() const { return local_ranks_; }  // ranks of this communicator on this host
  // Every rank on this host, and more of them than it has cores: the same on every rank (so choices
  // made from it agree), false whenever a rank is elsewhere.
  bool crowded_host() const { return crowded_host_; }
  const PeerInfo& peer_info(int peer) const { return bootstrap_->peer(peer); }

  // Blocking point-to-point helpers over channel `channel`.
  void send(int peer, const void* data, size_t bytes, int channel = 0);
  void recv(int peer, void* data, size_t bytes, int channel = 0);
  // Waits for tickets of connection(peer, channel).
  void wait_send(int peer, Ticket t, int channel = 0);
  void wait_recv(int peer, Ticket t, int channel = 0);
  void barrier() { bootstrap_->barrier(); }

  // The one-shot mailbox (runtime/mailbox.hpp) when every rank shares memory with this one over the
  // shm transport; null otherwise (other hosts, TUTTI_TRANSPORT=tcp, TUTTI_MAILBOX_SIZE=0).
  Mailbox* mailbox() { return mailbox_.get(); }
  ProgressEngine& engine() { return *engine_; }
  Bootstrap& bootstrap() { return *bootstrap_; }
  CommState& state() { return *state_; }
  // TUTTI_FAULT's faults for this rank, or null (runtime/fault.hpp).
  FaultInjector* faults() { return faults_.get(); }
  // The calibration of this machine the communicator took when it was made (every rank on this
  // host over shared memory, and a calibration for this many ranks: comm_options.hpp's
  // ShmCalibration), or none. Its values are already in options(); the CPU executor and the
  // dispatcher read theirs here.
  const std::optional<ShmCalibration>& calibration() const { return calibration_; }
  // For the calibration's sweeps only (collectives/calibrate.cpp measures one communicator under
  // several settings); nothing else changes a made communicator's settings. From what message size
  // shared-memory connections between processes read the sender's buffer directly (single copy)
  // instead of through the FIFO, and whether smaller messages of a FIFO slot or more choose by
  // measured rates (runtime/transport/single_copy_choice.hpp): this and later connections. Local.
  void set_single_copy(uint64_t threshold, bool adaptive);
  // Also for the calibration's sweeps: how long waits poll after the last progress before they
  // sleep (TUTTI_SPIN), from now on. Local.
  void set_spin(int us);
  // Carries out a close, drop or corrupt fault on the links to `peer` (-1: every peer).
  void inject(FaultKind kind, int peer);

 private:
  Communicator(const UniqueId& id, int nranks, int rank, const CommOptions& options, uint64_t generation,
               std::shared_ptr<CommState> state);
  void connect_channels(int n);  // collective: connects channels channels()..n-1
  void check_peer(int peer, const char* what) const;
  void apply_faults(Connection& c, int peer);  // drop/corrupt flags of `peer` on a new connection

  CommOptions options_;  // resolved: every setting set
  // As given: a split or shrink starts from these, so its communicator resolves its own settings
  // (the calibration for its own rank count) rather than inheriting this one's.
  CommOptions given_;
  std::shared_ptr<CommState> state_;
  ShmSegment control_;
  std::unique_ptr<Bootstrap> bootstrap_;
  std::unique_ptr<ProgressEngine> engine_;
  std::vector<ShmSegment> peer_controls_;  // by rank; mapped for peers reached through shared memory
  std::vector<std::unique_ptr<Transport>> transports_;  // registry order; they own their channels' memory
  std::vector<Transport*> peer_transport_;  // by rank: the first transport that can connect the pair
  std::vector<std::vector<std::unique_ptr<Connection>>> connections_;  // [channel][rank]
  int local_ranks_ = 1;
  std::optional<ShmCalibration> calibration_;
  // Fills the settings options_ leaves unset: the calibration's where it applies, else the defaults.
  void resolve_settings(bool one_host_over_shm);
  bool crowded_host_ = false;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<FaultInjector> faults_;
  static constexpr uint8_t kInjectedDrop = 1, kInjectedCorrupt = 2;
  std::vector<uint8_t> injected_;  // by peer: faults injected on its links (empty: none)
};

}  // namespace tutti
