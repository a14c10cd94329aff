#include "runtime/communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <system_error>
#include <mutex>
#include <thread>

#include "core/env.hpp"
#include "core/log.hpp"
#include "core/reduce.hpp"
#include "runtime/huge_pages.hpp"
#include "runtime/rendezvous.hpp"
#include "runtime/transport/shm.hpp"
#include "runtime/transport/tcp.hpp"
#include "runtime/wire.hpp"

namespace tutti {
namespace {

// A word at a known address that peers read at setup to learn whether single copy works.

std::atomic<uint64_t> g_env_generation{0};

int env_int(std::initializer_list<const char*> foreign, std::string_view tutti_name, const char* what) {
  auto v = env::raw(tutti_name);
  if (!v) v = env::first_of(foreign);
  TUTTI_CHECK(v.has_value(), InvalidArgument,
              "{} is not set: run under tutti-run, mpirun or srun, or set {}", what, tutti_name);
  try {
    size_t used = 0;
    int x = std::stoi(*v, &used);
    if (used == v->size()) return x;
  } catch (const std::exception&) {
  }
  throw InvalidArgument(fmt::format("{} ('{}') is not an integer", what, *v));
}

}  // namespace

CommOptions CommOptions::from_env() {
  CommOptions o;
  o.init_timeout_s = env::get_seconds("TUTTI_INIT_TIMEOUT");
  o.max_ranks = env::get_int("TUTTI_MAX_RANKS");
  o.divergence_probe_s = env::get_seconds("TUTTI_DIVERGENCE_PROBE");
  o.max_local_ranks = env::get_int("TUTTI_MAX_LOCAL_RANKS");
  o.timeout_s = env::get_seconds("TUTTI_TIMEOUT");
  std::string t = env::get_string("TUTTI_TRANSPORT");
  if (t == "auto" || t.empty()) o.transport = TransportKind::kAuto;
  else if (t == "shm") o.transport = TransportKind::kShm;
  else if (t == "tcp") o.transport = TransportKind::kTcp;
  else throw InvalidArgument(fmt::format("TUTTI_TRANSPORT='{}': expected auto, shm or tcp", t));
  // Unset variables stay unset: the communicator fills them (the calibration's, else the defaults).
  if (env::is_set("TUTTI_SHM_SLOTS")) o.shm_slots = static_cast<uint32_t>(env::get_int("TUTTI_SHM_SLOTS"));
  if (env::is_set("TUTTI_SHM_SLOT_SIZE")) o.shm_slot_size = env::get_size("TUTTI_SHM_SLOT_SIZE");
  o.shm_single_copy = env::get_bool("TUTTI_SHM_CMA");
  if (env::is_set("TUTTI_SHM_CMA_THRESHOLD")) o.shm_single_copy_threshold = env::get_size("TUTTI_SHM_CMA_THRESHOLD");
  // A threshold the user sets is obeyed as it is: nothing below it goes by single copy.
  o.shm_single_copy_adaptive = env::get_bool("TUTTI_SHM_CMA_ADAPTIVE") && !env::is_set("TUTTI_SHM_CMA_THRESHOLD");
  o.shm_zero_copy_threshold = env::get_size("TUTTI_SHM_ZERO_COPY_THRESHOLD");
  o.huge_pages = env::get_bool("TUTTI_HUGE_PAGES");
  o.tcp_sockets = static_cast<int>(env::get_int("TUTTI_TCP_NSOCKS"));
  o.tcp_stripe_threshold = env::get_size("TUTTI_TCP_STRIPE_THRESHOLD");
  if (env::is_set("TUTTI_SPIN")) o.spin = static_cast<int>(env::get_int("TUTTI_SPIN"));
  o.mailbox_bytes = env::get_size("TUTTI_MAILBOX_SIZE");
  o.faults = parse_faults(env::get_string("TUTTI_FAULT"));
  o.socket_ifname = env::get_string("TUTTI_SOCKET_IFNAME");
  o.comm_secret = env::get_string("TUTTI_COMM_SECRET");
  if (auto p = env::raw("TUTTI_CALIBRATION_FILE"); p && !p->empty()) {
    o.calibration_file = *p;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    o.calibration_file = std::string(x) + "/tutti/calibration.json";
  } else {
    const char* home = std::getenv("HOME");
    o.calibration_file = std::string(home && *home ? home : "/tmp") + "/.cache/tutti/calibration.json";
  }
  TUTTI_CHECK(o.shm_slots.value_or(1) >= 1, InvalidArgument, "TUTTI_SHM_SLOTS must be at least 1");
  TUTTI_CHECK(o.shm_slot_size.value_or(64) >= 64, InvalidArgument, "TUTTI_SHM_SLOT_SIZE must be at least 64 bytes");
  TUTTI_CHECK(o.tcp_sockets >= 1 && o.tcp_sockets <= 64, InvalidArgument, "TUTTI_TCP_NSOCKS must be in 1..64");
  return o;
}

void check_world_size(int nranks, const CommOptions& options) {
  TUTTI_CHECK(nranks >= 1, InvalidArgument, "communicator size {} must be at least 1", nranks);
  TUTTI_CHECK(nranks <= options.max_ranks, InvalidArgument,
              "communicator size {} is more than TUTTI_MAX_RANKS={} (a damaged or absurd size? raise the limit for a "
              "job this large)",
              nranks, options.max_ranks);
}

void check_local_ranks(int nranks, const CommOptions& options) {
  check_world_size(nranks, options);
  TUTTI_CHECK(nranks <= options.max_local_ranks, InvalidArgument,
              "{} ranks as threads of one process is more than TUTTI_MAX_LOCAL_RANKS={}", nranks,
              options.max_local_ranks);
}

std::unique_ptr<Communicator> Communicator::create(const UniqueId& id, int nranks, int rank, const CommOptions& options,
                                                   uint64_t generation, std::shared_ptr<CommState> state) {
  check_world_size(nranks, options);
  TUTTI_CHECK(rank >= 0 && rank < nranks, InvalidArgument, "rank {} is out of range for {} ranks", rank, nranks);
  TUTTI_CHECK(id.valid(), InvalidArgument, "rank {}: the unique id is not valid (not made by tutti?)", rank);
  TUTTI_CHECK(!state || (state->rank() == rank && state->nranks() == nranks), InternalError,
              "rank {}: a communicator state for rank {} of {}", rank, state ? state->rank() : -1,
              state ? state->nranks() : -1);
  return std::unique_ptr<Communicator>(new Communicator(id, nranks, rank, options, generation, std::move(state)));
}

std::vector<std::unique_ptr<Communicator>> Communicator::create_local(int nranks, const CommOptions& options) {
  check_local_ranks(nranks, options);
  UniqueId id = create_unique_id(options.socket_ifname);
  std::vector<std::unique_ptr<Communicator>> comms(nranks);
  std::vector<std::exception_ptr> errors(nranks);
  // Made first, so a thread that cannot be started stops the ranks already in the rendezvous
  // (they would wait for it until TUTTI_INIT_TIMEOUT) instead of ending the process.
  std::vector<std::shared_ptr<CommState>> states;
  for (int r = 0; r < nranks; ++r) states.push_back(std::make_shared<CommState>(r, nranks));
  std::vector<std::thread> threads;
  try {
    for (int r = 0; r < nranks; ++r)
      threads.emplace_back([&, r] {
        try {
          comms[r] = create(id, nranks, r, options, 0, states[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
  } catch (const std::system_error& e) {
    for (auto& s : states) s->abort();
    for (auto& t : threads) t.join();
    throw SystemError(fmt::format("starting the thread of rank {} of {}: {}", threads.size(), nranks, e.what()),
                      e.code().value());
  }
  for (auto& t : threads) t.join();
  // Report the root cause: a rank's own error before the remote errors it caused elsewhere.
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const RemoteError&) {
      if (!first) first = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first) std::rethrow_exception(first);
  return comms;
}

std::unique_ptr<Communicator> Communicator::create_from_env(const CommOptions& options) {
  int rank = env_int({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, "TUTTI_RANK", "the rank");
  int size = env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, "TUTTI_SIZE", "the number of ranks");
  auto text = env::raw("TUTTI_COMM_ID");
  TUTTI_CHECK(text.has_value(), InvalidArgument,
              "rank {}: no rendezvous address: set TUTTI_COMM_ID or NCCL_COMM_ID=host:port (tutti-run sets it)", rank);
  UniqueId id = UniqueId::parse(*text, options.comm_secret);
  if (rank == 0 && text->find(':') != std::string::npos) ensure_persistent_root(id);
  return create(id, size, rank, options, g_env_generation.fetch_add(1));
}

Communicator::Communicator(const UniqueId& id, int nranks, int rank, const CommOptions& options, uint64_t generation,
                           std::shared_ptr<CommState> state)
    : options_(options), given_(options), state_(state ? std::move(state) : std::make_shared<CommState>(rank, nranks)) {
  log::set_thread_rank(rank);
  static std::once_flag once;
  std::call_once(once, [] {
    // NCCL prints its version at NCCL_DEBUG=VERSION, and among the INFO lines otherwise.
    if (log::settings().level == log::Level::kVersion) {
      TUTTI_LOG(kVersion, log::kInit, "tutti version {}", TUTTI_VERSION_STRING);
    } else {
      TUTTI_INFO(log::kInit, "tutti version {}, reductions on {}", TUTTI_VERSION_STRING, reduce_target_name());
    }
    sweep_stale_segments();
  });
  // The control segment: this rank's doorbell, then its one-shot outbox (runtime/mailbox.hpp).
  const bool use_mailbox = options_.mailbox_bytes > 0 && options_.transport != TransportKind::kTcp;
  control_ = ShmSegment::create("ctl", use_mailbox ? Mailbox::segment_bytes(options_.mailbox_bytes) : sizeof(Doorbell));
  state_->set_doorbell(new (control_.data()) Doorbell());
  if (use_mailbox) Mailbox::init(control_.data(), options_.mailbox_bytes);
  bootstrap_ = std::make_unique<Bootstrap>(state_, id.secret(), options_.timeout_s, options_.socket_ifname);
  PeerInfo self;
  self.rank = rank;
  self.host_hash = local_host_hash();
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  self.hostname = host;
  self.pid = getpid();
  self.control_shm = control_.name();
  self.probe_addr = single_copy_probe_address();
  bootstrap_->establish(id, generation, self, options_.init_timeout_s);
  int local = 1;
  for (int p = 0; p < nranks; ++p)
    if (p != rank && bootstrap_->peer(p).host_hash == self.host_hash) ++local;
  local_ranks_ = local;
  // Shared memory connects every pair of one host (ShmTransport::can_connect) unless TCP is forced.
  resolve_settings(nranks >= 2 && local == nranks && options_.transport != TransportKind::kTcp);

  // Each peer goes to the first transport of the registry that can connect the pair.
  transports_ = make_host_transports(options_);
  peer_transport_.assign(nranks, nullptr);
  peer_controls_.resize(nranks);
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    const PeerInfo& peer = bootstrap_->peer(p);
    for (auto& t : transports_)
      if (t->can_connect(self, peer)) {
        peer_transport_[p] = t.get();
        break;
      }
    if (!peer_transport_[p]) {
      std::string names;
      for (auto& t : transports_) names += fmt::format("{}{}", names.empty() ? "" : ", ", t->info().name);
      throw InvalidArgument(fmt::format("rank {}: no transport can connect to rank {} on host {} (TUTTI_TRANSPORT "
                                        "allows {})",
                                        rank, p, peer.hostname, names));
    }
    // Peers that share memory with this rank ring its doorbell and read its mailbox.
    if (peer_transport_[p]->info().registration == MemoryRegistration::kSharedSegment)
      peer_controls_[p] = ShmSegment::open(peer.control_shm, 0);
  }
  // More ranks on this host than cores: a polling waiter must hand its core to the ranks it waits
  // for, so it yields after every round (as Open MPI does when oversubscribed).
  bool oversubscribed = local > static_cast<int>(std::thread::hardware_concurrency());
  crowded_host_ = oversubscribed && local == nranks;
  engine_ = std::make_unique<ProgressEngine>(state_, options_.timeout_s, *options_.spin, oversubscribed);
  // The FIFO/single-copy choice times copies; with more ranks than cores a copy's time includes
  // other ranks' turns on the core, and single copy's sends wait for a receiver that may not be
  // running (4 processes on 2 cores: 1-2 MiB all-reduces up to 2x slower with it). The threshold
  // alone decides there.
  if (oversubscribed) options_.shm_single_copy_adaptive = false;
  // The mailbox needs every rank's outbox mapped here (a peer without one has a bare doorbell).
  bool every_peer_local = use_mailbox;
  for (int p = 0; p < nranks && every_peer_local; ++p)
    if (p != rank && (peer_controls_[p].size() == 0 || Mailbox::capacity_of(peer_controls_[p].size()) == 0))
      every_peer_local = false;
  if (every_peer_local && nranks > 1) {
    std::vector<Mailbox::Segment> segs(nranks);
    for (int p = 0; p < nranks; ++p) {
      const ShmSegment& s = p == rank ? control_ : peer_controls_[p];
      segs[p] = {s.data(), s.size()};
    }
    // Every outbox on huge pages (two entries map one): a record's pages beyond the first 16 KiB
    // (pre-faulted by the Mailbox) were otherwise faulted in at first touch, by every process's view,
    // record after record. On a crowded host one-shot calls reach 128 KiB (dispatcher.hpp): 4
    // processes on 2 cores, all-reduce of 32 / 128 KiB took 45 / 194 us before, 20 / 69 after; at 2
    // processes one-shot broadcasts of 64-256 KiB (TUTTI_ONESHOT_THRESHOLD) ran 2-3x slower on 4 KiB
    // pages. Small calls and setup cost no more (2 processes, all-reduce 8 B-8 KiB within 0.02 us).
    // Each rank moves its own outbox now; its views of the peers' once they have (below): a view
    // asked while its owner was still moving the pages was left on small pages.
    if (options_.huge_pages) back_segment_with_huge_pages(control_.data(), control_.size(), control_.data(), control_.size());
    mailbox_ = std::make_unique<Mailbox>(rank, std::move(segs), *engine_, *state_, oversubscribed);
  }
  faults_ = FaultInjector::make(options_.faults, rank);
  connect_channels(1);  // ends with a barrier: every peer has mapped our control segment
  if (mailbox_ && options_.huge_pages)
    for (int p = 0; p < nranks; ++p)
      if (p != rank) back_segment_with_huge_pages(peer_controls_[p].data(), peer_controls_[p].size(),
                                                  peer_controls_[p].data(), peer_controls_[p].size());
  control_.unlink();
  state_->set_hooks([b = bootstrap_.get()](const std::string& message) { b->notify_failure(message); },
                    [b = bootstrap_.get(), t = options_.timeout_s] { return b->liveness(std::min(1.0, t)); });
  state_->set_probe([this] { return diverged_peer(); }, options_.divergence_probe_s);
  TUTTI_INFO(log::kInit, "rank {}/{} ready (pid {}, generation {})", rank, nranks, getpid(), generation);
}

Communicator::~Communicator() {
  log::set_thread_rank(rank());
  if (!state_->interrupted()) {
    // Flush: a single-copy send is complete only once the peer has read it.
    try {
      engine_->wait(
          [&] {
            for (auto& channel : connections_)
              for (size_t p = 0; p < channel.size(); ++p)
                if (channel[p] && channel[p]->sends_pending() && !bootstrap_->peer_departed(static_cast<int>(p)))
                  return false;
            return true;
          },
          [] { return std::string("flushing sends before destroying the communicator"); });
    } catch (const Error& e) {
      TUTTI_WARN("rank {}: destroy could not flush: {}", rank(), e.what());
    }
  }
  if (state_->interrupted())
    for (auto& channel : connections_)
      for (auto& c : channel)
        if (c) c->withdraw();  // a peer may still be reading a failed call's buffers
  state_->clear_probe();
  state_->clear_hooks();
  bootstrap_->shutdown();
  connections_.clear();
}

void Communicator::revoke() { state_->revoke(); }

namespace {

std::mutex g_calibration_mutex;
CalibrationSource& calibration_source() {
  static CalibrationSource source;
  return source;
}

}  // namespace

void set_calibration_source(CalibrationSource source) {
  std::lock_guard lock(g_calibration_mutex);
  calibration_source() = std::move(source);
}

std::optional<ShmCalibration> find_shm_calibration(const std::string& file, int nranks) {
  CalibrationSource source;
  {
    std::lock_guard lock(g_calibration_mutex);
    source = calibration_source();
  }
  return source ? source(file, nranks) : std::nullopt;
}

void Communicator::resolve_settings(bool one_host_over_shm) {
  // A calibration describes n ranks on one host over shared memory, and the FIFO layout (like the
  // tile and the one-shot choice) must be the same on every rank: every rank of such a
  // communicator reads the same file, as for a decision table.
  if (one_host_over_shm) calibration_ = find_shm_calibration(options_.calibration_file, size());
  const ShmCalibration cal = calibration_.value_or(ShmCalibration{});
  const int n = size();
  if (!options_.shm_single_copy_threshold) {
    options_.shm_single_copy_threshold = cal.single_copy_threshold.value_or(CommOptions::kDefaultSingleCopyThreshold);
    if (cal.single_copy_threshold)
      TUTTI_INFO(log::kTuning, "rank {}: single copy from {} bytes (calibrated for {} ranks over shm)", rank(),
                 *cal.single_copy_threshold, n);
  }
  if (!options_.spin) {
    options_.spin = cal.spin_us.value_or(CommOptions::kDefaultSpin);
    if (cal.spin_us)
      TUTTI_INFO(log::kTuning, "rank {}: waits poll {} us before they sleep (calibrated for {} ranks over shm)", rank(),
                 *cal.spin_us, n);
  }
  // The FIFO layout is one choice: the calibration's only where neither half was set.
  if (!options_.shm_slots && !options_.shm_slot_size && cal.fifo_layout) {
    options_.shm_slots = cal.fifo_layout->first;
    options_.shm_slot_size = cal.fifo_layout->second;
    TUTTI_INFO(log::kTuning, "rank {}: plan channels' FIFOs of {} x {} bytes (calibrated for {} ranks over shm)", rank(),
               *options_.shm_slots, *options_.shm_slot_size, n);
  }
  if (!options_.shm_slots) options_.shm_slots = CommOptions::kDefaultShmSlots;
  if (!options_.shm_slot_size) options_.shm_slot_size = CommOptions::kDefaultShmSlotSize;
}

void Communicator::set_single_copy(uint64_t threshold, bool adaptive) {
  options_.shm_single_copy_threshold = threshold;
  options_.shm_single_copy_adaptive = adaptive;
  for (auto& channel : connections_)
    for (auto& c : channel)
      if (c) c->set_single_copy(threshold, adaptive);
}

void Communicator::set_spin(int us) {
  options_.spin = us;
  engine_->set_spin(us);
}

void Communicator::apply_faults(Connection& c, int peer) {
  if (injected_.empty()) return;
  if (injected_[peer] & kInjectedDrop) c.drop_sends();
  if (injected_[peer] & kInjectedCorrupt) c.corrupt_next_header();
}

void Communicator::inject(FaultKind kind, int peer) {
  if (injected_.empty()) injected_.assign(size(), 0);
  std::string whom = peer < 0 ? std::string("every peer") : fmt::format("rank {}", peer);
  // A cut link fails this rank at once (its own sockets are gone), but the peers must find out by
  // themselves, as after a crash: nothing is sent to them.
  if (kind == FaultKind::kClose)
    state_->fail(ErrorKind::kRemote, fmt::format("rank {} closed its connections to {} (TUTTI_FAULT=close)", rank(), whom),
                 /*tell_peers=*/false);
  for (int p = 0; p < size(); ++p) {
    if (p == rank() || (peer >= 0 && p != peer)) continue;
    if (kind == FaultKind::kDrop) injected_[p] |= kInjectedDrop;
    if (kind == FaultKind::kCorrupt) injected_[p] |= kInjectedCorrupt;
    for (auto& channel : connections_) {
      if (!channel[p]) continue;
      apply_faults(*channel[p], p);
      if (kind == FaultKind::kClose) channel[p]->sever();
    }
    if (kind == FaultKind::kClose) bootstrap_->sever(p);
  }
  if (mailbox_ && kind == FaultKind::kDrop) mailbox_->inject_drop();
  if (mailbox_ && kind == FaultKind::kCorrupt) mailbox_->inject_corrupt();
}

void Communicator::abort() {
  if (state_->aborted()) return;
  state_->abort();
  bootstrap_->notify_failure(fmt::format("rank {} aborted its communicator", rank()));
}

void Communicator::check_peer(int peer, const char* what) const {
  TUTTI_CHECK(peer >= 0 && peer < size() && peer != rank(), InvalidArgument, "rank {}: {}: peer {} is out of range (0..{}, not self)",
              rank(), what, peer, size() - 1);
}

Connection& Communicator::connection(int peer, int channel) {
  check_peer(peer, "connection");
  TUTTI_CHECK(channel >= 0 && channel < channels(), InvalidArgument,
              "rank {}: channel {} is not connected ({} channels; call ensure_channels)", rank(), channel, channels());
  return *connections_[channel][peer];
}

const char* Communicator::transport_to(int peer) const {
  if (peer == rank()) return "self";
  return peer_transport_.at(peer)->info().name;
}

void Communicator::ensure_channels(int n) {
  if (channels() < n) connect_channels(n);
}

// All new channels in one round: one allgather and one barrier however many channels a plan needs
// (a 32-channel plan of 8 ranks took seconds to start when each channel had its own).
void Communicator::connect_channels(int n) {
  const int me = rank(), nranks = size(), first = channels();
  std::vector<ChannelSetup> setups;
  for (int ch = first; ch < n; ++ch) setups.push_back({me, nranks, ch, *bootstrap_, options_, peer_controls_});
  std::vector<std::vector<int>> peers(transports_.size());  // per transport, the ranks it carries
  for (int p = 0; p < nranks; ++p)
    for (size_t t = 0; t < transports_.size(); ++t)
      if (p != me && peer_transport_[p] == transports_[t].get()) peers[t].push_back(p);
  wire::Writer w;
  for (const ChannelSetup& setup : setups)
    for (size_t t = 0; t < transports_.size(); ++t) transports_[t]->publish(setup, peers[t], w);
  auto all = bootstrap_->allgather(w.bytes(), BootstrapOp::kChannelSetup);
  std::vector<wire::Reader> published;
  for (int p = 0; p < nranks; ++p) published.emplace_back(all[p], fmt::format("channel setup from rank {}", p));
  for (const ChannelSetup& setup : setups) {
    std::vector<std::unique_ptr<Connection>> conns(nranks);
    for (size_t t = 0; t < transports_.size(); ++t) transports_[t]->connect(setup, peers[t], published, conns);
    for (size_t p = 0; p < conns.size(); ++p)
      if (conns[p]) {
        engine_->add(conns[p].get());
        // It may have changed since the transport was made.
        conns[p]->set_single_copy(*options_.shm_single_copy_threshold, options_.shm_single_copy_adaptive);
        apply_faults(*conns[p], static_cast<int>(p));
      }
    connections_.push_back(std::move(conns));
  }
  bootstrap_->barrier();  // everyone has mapped everything: names can go
  for (const ChannelSetup& setup : setups)
    for (auto& t : transports_) t->finish(setup);
  std::string counts;
  for (size_t t = 0; t < transports_.size(); ++t)
    counts += fmt::format("{}{} {} peers", t ? ", " : "", peers[t].size(), transports_[t]->info().name);
  TUTTI_INFO(log::kInit, "rank {}: channels {}..{} connected ({})", me, first, n - 1, counts);
}

void Communicator::wait_send(int peer, Ticket t, int channel) {
  Connection& c = connection(peer, channel);
  engine_->wait([&] { return c.send_done(t); },
                [&] { return fmt::format("waiting to send to rank {} on channel {}", peer, channel); });
}

void Communicator::wait_recv(int peer, Ticket t, int channel) {
  Connection& c = connection(peer, channel);
  engine_->wait([&] { return c.recv_done(t); },
                [&] { return fmt::format("waiting to receive from rank {} on channel {}", peer, channel); });
}

void Communicator::send(int peer, const void* data, size_t bytes, int channel) {
  TUTTI_CHECK(data || bytes == 0, InvalidArgument, "rank {}: send of {} bytes to rank {} from a null buffer", rank(),
              bytes, peer);
  wait_send(peer, connection(peer, channel).send(data, bytes), channel);
}

void Communicator::recv(int peer, void* data, size_t bytes, int channel) {
  TUTTI_CHECK(data || bytes == 0, InvalidArgument, "rank {}: receive of {} bytes from rank {} into a null buffer",
              rank(), bytes, peer);
  wait_recv(peer, connection(peer, channel).recv(data, bytes), channel);
}

namespace {
std::string describe_activity(uint64_t stamp) {
  if (stamp == kSplitStamp) return "a split (ncclCommSplit)";
  return describe_stamp(stamp);
}
}  // namespace

std::string Communicator::diverged_peer() {
  const CommState::Activity mine = state_->activity();
  if (mine.stamp == 0) return {};
  const auto theirs = bootstrap_->activities(std::min(1.0, options_.timeout_s > 0 ? options_.timeout_s : 1.0));
  if (state_->activity().seq != mine.seq) return {};  // this rank moved on meanwhile
  for (int p = 0; p < size(); ++p) {
    const auto& a = theirs[static_cast<size_t>(p)];
    if (!a || a->seq != mine.seq || a->stamp == 0 || a->stamp == mine.stamp) continue;
    return fmt::format("rank {}: rank {} is in {} while this rank is in {}, both at their collective call {}: every "
                       "rank must make the same calls (collective, count, datatype, op, root; split, shrink) in the "
                       "same order",
                       rank(), p, describe_activity(a->stamp), describe_activity(mine.stamp), mine.seq);
  }
  return {};
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::optional<CommOptions>& options) {
  CallActivity activity(*state_, kSplitStamp);
  wire::Writer w;
  w.put<int32_t>(color).put<int32_t>(key);
  auto all = bootstrap_->allgather(w.bytes(), BootstrapOp::kSplit);
  uint64_t tag = bootstrap_->next_tag(BootstrapOp::kSplit);
  if (color < 0) return nullptr;
  std::vector<std::pair<int, int>> members;  // (key, parent rank)
  for (int r = 0; r < size(); ++r) {
    wire::Reader rd(all[r], "split request");
    int c = rd.get<int32_t>(), k = rd.get<int32_t>();
    if (c == color) members.push_back({k, r});
  }
  std::sort(members.begin(), members.end());
  int new_rank = static_cast<int>(std::find(members.begin(), members.end(), std::make_pair(key, rank())) - members.begin());
  int leader = members[0].second;
  UniqueId id;
  if (rank() == leader) {
    id = create_unique_id(given_.socket_ifname);
    std::vector<unsigned char> bytes(id.bytes.begin(), id.bytes.end());
    for (auto& [k, r] : members)
      if (r != rank()) bootstrap_->send(r, tag, bytes);
  } else {
    auto bytes = bootstrap_->recv(leader, tag);
    TUTTI_CHECK(bytes.size() == UniqueId::kBytes, RemoteError, "rank {}: split: malformed id from rank {}", rank(), leader);
    std::copy(bytes.begin(), bytes.end(), id.bytes.begin());
  }
  return create(id, static_cast<int>(members.size()), new_rank, options ? *options : given_);
}

std::unique_ptr<Communicator> Communicator::shrink(const std::vector<int>& exclude, bool after_failure) {
  std::vector<bool> out(static_cast<size_t>(size()), false);
  for (int r : exclude) {
    TUTTI_CHECK(r >= 0 && r < size(), InvalidArgument, "rank {}: shrink: excluded rank {} is out of range (0..{})",
                rank(), r, size() - 1);
    out[r] = true;
  }
  TUTTI_CHECK(!out[rank()], InvalidArgument,
              "rank {}: shrink: this rank is in the exclusion list; only the ranks that remain call it", rank());
  std::vector<int> keep;
  for (int r = 0; r < size(); ++r)
    if (!out[r]) keep.push_back(r);
  const int leader = keep.front();
  const int new_rank = static_cast<int>(std::find(keep.begin(), keep.end(), rank()) - keep.begin());
  // Only the remaining ranks take part: every one of them draws the same tag, and the id goes from
  // the lowest to the others over the bootstrap's point-to-point links, never through an excluded rank.
  if (after_failure) revoke();
  const uint64_t tag = bootstrap_->next_tag(BootstrapOp::kShrink);
  UniqueId id;
  if (rank() == leader) {
    id = create_unique_id(given_.socket_ifname);
    std::vector<unsigned char> bytes(id.bytes.begin(), id.bytes.end());
    for (int r : keep)
      if (r != rank()) bootstrap_->send(r, tag, bytes, after_failure);
  } else {
    auto bytes = bootstrap_->recv(leader, tag, after_failure);
    TUTTI_CHECK(bytes.size() == UniqueId::kBytes, RemoteError, "rank {}: shrink: malformed id from rank {}", rank(),
                leader);
    std::copy(bytes.begin(), bytes.end(), id.bytes.begin());
  }
  return create(id, static_cast<int>(keep.size()), new_rank, given_);
}

}  // namespace tutti
