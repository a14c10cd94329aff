#include "runtime/device/device_executor.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "plan/semantics.hpp"
#include "runtime/wire.hpp"

namespace tutti::device {

namespace {
constexpr int64_t kFifoHeader = 128;  // tail and head, each on its own 64-byte line

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
}  // namespace

DeviceOptions DeviceOptions::from_env() {
  DeviceOptions o;
  o.slot_bytes = static_cast<int64_t>(env::get_size("TUTTI_DEVICE_SLOT_SIZE"));
  o.ll_slot_bytes = static_cast<int64_t>(env::get_size("TUTTI_DEVICE_LL_SLOT_SIZE"));
  o.fifo_depth = env::get_int("TUTTI_DEVICE_FIFO_DEPTH");
  // NCCL's buffer per connection, cut into slots as NCCL cuts it into steps (ours only if not set).
  if (!env::raw("TUTTI_DEVICE_SLOT_SIZE") && env::raw("NCCL_BUFFSIZE") && o.fifo_depth >= 1)
    o.slot_bytes = static_cast<int64_t>(env::get_size("NCCL_BUFFSIZE")) / o.fifo_depth / 16 * 16;
  if (env::raw("NCCL_MIN_NCHANNELS")) o.min_instances = static_cast<int>(env::get_int("NCCL_MIN_NCHANNELS"));
  if (env::raw("NCCL_MAX_NCHANNELS")) o.max_instances = static_cast<int>(env::get_int("NCCL_MAX_NCHANNELS"));
  TUTTI_CHECK(o.min_instances >= 1 && o.max_instances >= o.min_instances, InvalidArgument,
              "NCCL_MIN_NCHANNELS ({}) and NCCL_MAX_NCHANNELS ({}) must satisfy 1 <= min <= max", o.min_instances,
              o.max_instances);
  o.threads = static_cast<int>(env::get_int("TUTTI_DEVICE_THREADS"));
  o.instances = static_cast<int>(env::get_int("TUTTI_DEVICE_INSTANCES"));
  TUTTI_CHECK(o.instances >= 0, InvalidArgument, "TUTTI_DEVICE_INSTANCES must be 0 (automatic) or a count, not {}",
              o.instances);
  o.timeout_s = env::get_seconds("TUTTI_TIMEOUT");
  o.host_staging = env::get_bool("TUTTI_DEVICE_STAGING");
  TUTTI_CHECK(o.slot_bytes >= 256 && o.slot_bytes % 16 == 0, InvalidArgument,
              "TUTTI_DEVICE_SLOT_SIZE (or NCCL_BUFFSIZE / TUTTI_DEVICE_FIFO_DEPTH) must be a multiple of 16 bytes and at "
              "least 256, not {}",
              o.slot_bytes);
  TUTTI_CHECK(o.ll_slot_bytes >= 256 && o.ll_slot_bytes % 32 == 0, InvalidArgument,
              "TUTTI_DEVICE_LL_SLOT_SIZE must be a multiple of 32 bytes and at least 256, not {}", o.ll_slot_bytes);
  TUTTI_CHECK(o.fifo_depth >= 1, InvalidArgument, "TUTTI_DEVICE_FIFO_DEPTH must be at least 1, not {}", o.fifo_depth);
  TUTTI_CHECK(o.threads >= 32 && o.threads <= device::kMaxBlockThreads && o.threads % 32 == 0, InvalidArgument,
              "TUTTI_DEVICE_THREADS (or NCCL_NTHREADS) must be a multiple of 32 between 32 and {}, not {}",
              device::kMaxBlockThreads, o.threads);
  std::string proto = env::get_string("TUTTI_PROTO");
  std::string p;
  for (char ch : proto) p += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (p.empty()) {
  } else if (p == "simple" || p == "ll128" || p == "^ll" || p == "^ll,ll128" || p == "^ll128,ll") {
    o.protocol = kProtoSimple;
  } else if (p == "ll" || p == "^simple" || p == "^simple,ll128" || p == "^ll128,simple") {
    o.protocol = kProtoLL;
  } else if (p != "^ll128") {
    throw InvalidArgument(fmt::format("TUTTI_PROTO/NCCL_PROTO: '{}' is not Simple, LL, LL128 or an exclusion of them",
                                      proto));
  }
  return o;
}

struct DeviceExecutor::Channel {
  unsigned char* inbox = nullptr;  // this rank's FIFOs, one per sender, fifo_stride_ apart
  uint64_t* counts = nullptr;      // [0, n): messages sent to each peer; [n, 2n): received from each
  std::vector<unsigned char*> peer_inbox;  // by rank
  std::vector<bool> opened;                // mapped with Backend::open (closed at the end)
};

struct DeviceExecutor::Uploaded {
  DevicePlan plan;
  int instances = 1;
  int64_t fifo_depth = 1;
  int32_t max_steps = 0;
  void* memory = nullptr;
  LaunchArgs base;  // plan arrays, FIFO views and progress filled in
};

// A one-step plan: send the input to `peer`, or receive the output from it, on device channel 0.
struct DeviceExecutor::P2pPlan {
  void* memory = nullptr;
  LaunchArgs base;
};

DeviceExecutor::DeviceExecutor(Communicator& comm, std::unique_ptr<Backend> backend, const DeviceOptions& options)
    : comm_(comm), backend_(std::move(backend)), options_(options) {
  fifo_stride_ = round_up(kFifoHeader + options_.fifo_depth * (options_.slot_bytes + options_.ll_slot_bytes + kDescWords * 8), 256);
  state_ = static_cast<RankState*>(backend_->alloc(sizeof(RankState)));
  p2p_state_ = static_cast<RankState*>(backend_->alloc(sizeof(RankState)));
  void* view = nullptr;
  status_host_ = static_cast<Status*>(backend_->alloc_host(sizeof(Status), &view));
  status_dev_ = static_cast<Status*>(view);
  abort_host_ = static_cast<int32_t*>(backend_->alloc_host(sizeof(int32_t), &view));
  abort_dev_ = static_cast<int32_t*>(view);
  std::memset(status_host_, 0, sizeof(Status));
  *abort_host_ = 0;
  comm_.state().add_stop_word(abort_host_, kStopFailed);
}

void DeviceExecutor::close() {
  if (aborted_ || closed_) return;
  // A failed communicator has no barrier to close with, and a peer's kernel may not have seen the
  // failure yet: the memory stays allocated, as after an abort.
  if (comm_.state().failed()) {
    aborted_ = true;
    return;
  }
  backend_->synchronize(nullptr);  // this rank's launches
  if (log::enabled(log::Level::kInfo, log::kInit))
    if (uint64_t n = direct_messages()) TUTTI_INFO(log::kInit, "rank {}: peers read {} messages in place", comm_.rank(), n);
  if (!channels_.empty() && comm_.size() > 1) {
    try {
      comm_.bootstrap().barrier();
    } catch (const Error&) {
      if (!comm_.state().failed()) throw;
      aborted_ = true;  // a peer failed while this rank waited to close: as above
      return;
    }
  }
  closed_ = true;
}

DeviceExecutor::~DeviceExecutor() {
  comm_.state().remove_stop_word(abort_host_);
  // Peers map this rank's FIFOs: free them only once every rank has closed (close()). After an
  // abort, or without close(), a peer's kernel may still use them, so the memory stays allocated.
  if (!closed_ && (aborted_ || (!channels_.empty() && comm_.size() > 1))) {
    TUTTI_WARN("rank {}: device executor {}: its device memory stays allocated", comm_.rank(),
               aborted_ ? "aborted" : "destroyed without close()");
    return;
  }
  if (!closed_) {
    try {
      backend_->synchronize(nullptr);  // no peers: only this rank's own launches use the memory
    } catch (const std::exception& e) {
      TUTTI_WARN("rank {}: device executor: {}", comm_.rank(), e.what());
      return;
    }
  }
  for (auto& [id, u] : plans_) backend_->release(u->memory);
  for (auto& [key, u] : p2p_) backend_->release(u->memory);
  backend_->release(p2p_state_);
  for (auto& ch : channels_) {
    for (size_t r = 0; r < ch->peer_inbox.size(); ++r)
      if (ch->opened[r]) backend_->close(ch->peer_inbox[r]);
    backend_->release(ch->inbox);
    backend_->release(ch->counts);
  }
  backend_->release(scratch_);
  for (void* t : temps_) backend_->release(t);
  backend_->release(state_);
  backend_->release_host(status_host_);
  backend_->release_host(abort_host_);
}

void DeviceExecutor::abort() {
  aborted_ = true;
  std::atomic_ref<int32_t>(*abort_host_).store(kStopAbort, std::memory_order_release);
}

void DeviceExecutor::check() {
  Status s;
  std::memcpy(&s, status_host_, sizeof(Status));
  if (s.failed == 0) return;
  std::string waiting = s.failed == kStampMismatch ? std::string()
                        : s.peer >= 0              ? fmt::format(" (waiting for rank {})", s.peer)
                        : s.waits_for_block >= 0 ? fmt::format(" (waiting for block {} of this rank)", s.waits_for_block)
                                                 : std::string();
  std::string where = fmt::format("rank {}: device plan '{}' stopped at block {} step {}{} in round {}", comm_.rank(),
                                  last_plan_, s.block, s.step, waiting, s.round);
  if (s.failed == 1) throw Aborted(where + ": the communicator was aborted");
  if (s.failed == kCommFailed) {  // this rank's or a peer's failure, which the communicator holds
    comm_.state().check(where);
    throw RemoteError(where + ": the communicator failed");
  }
  // A failure of this rank's launch: the communicator fails, so that peers waiting for this rank
  // (a broadcast's root, which only sends) stop now rather than at TUTTI_TIMEOUT.
  auto fail = [&](auto error) {
    comm_.state().fail(error.kind(), error.what());
    throw error;
  };
  if (s.failed == kBadIndex)
    fail(InvalidArgument(fmt::format("{}: an index table's slot {} names token {}, outside its token table", where,
                                     s.slot, s.value)));
  if (s.failed == kStampMismatch)
    fail(InvalidUsage(fmt::format("{}: rank {} sent a message of {} but this rank runs {}: every rank must make the "
                                  "same calls (collective, count, datatype, op, root) in the same order",
                                  where, s.peer, describe_stamp(static_cast<CallStamp>(s.value)),
                                  describe_stamp(last_stamp_))));
  fail(Timeout(fmt::format("{}: no progress for {} s (TUTTI_TIMEOUT)", where, options_.timeout_s)));
}

void DeviceExecutor::copy(void* dst, const void* src, size_t bytes, void* stream) {
  backend_->copy(dst, src, bytes, stream);
}

void DeviceExecutor::scale(DataType t, void* dst, const void* src, const void* scalar, size_t n, void* stream) {
  backend_->scale(t, dst, src, scalar, n, stream);
}

void DeviceExecutor::divide(DataType t, void* dst, const void* src, uint64_t d, size_t n, void* stream) {
  backend_->divide(t, dst, src, d, n, stream);
}

void* DeviceExecutor::temp(int slot, size_t bytes, void* stream) {
  TUTTI_CHECK(slot == 0 || slot == 1, InternalError, "device temp slot {}", slot);
  if (temp_bytes_[slot] < bytes) {
    TUTTI_CHECK(!backend_->capturing(stream), InvalidUsage,
                "rank {}: a collective needs more temporary device memory inside a CUDA graph capture than any call "
                "before it; run it at this size once before capturing it",
                comm_.rank());
    backend_->release_async(temps_[slot], stream);
    temps_[slot] = nullptr;
    temps_[slot] = backend_->alloc_async(bytes, stream);
    temp_bytes_[slot] = bytes;
  }
  return temps_[slot];
}

void DeviceExecutor::ensure_channels(int n) {
  const int nranks = comm_.size(), me = comm_.rank();
  while (static_cast<int>(channels_.size()) < n) {
    auto ch = std::make_unique<Channel>();
    ch->inbox = static_cast<unsigned char*>(backend_->alloc(static_cast<size_t>(fifo_stride_ * nranks)));
    ch->counts = static_cast<uint64_t*>(backend_->alloc(sizeof(uint64_t) * 2 * static_cast<size_t>(nranks)));
    ch->peer_inbox.assign(static_cast<size_t>(nranks), nullptr);
    ch->opened.assign(static_cast<size_t>(nranks), false);
    ch->peer_inbox[me] = ch->inbox;
    if (nranks > 1) {
      wire::Writer w;
      std::vector<unsigned char> handle = backend_->share(ch->inbox);
      w.put<int32_t>(static_cast<int32_t>(getpid()))
          .put<int32_t>(backend_->device())
          .put<uint64_t>(comm_.peer_info(me).host_hash)
          .put<uint8_t>(options_.host_staging ? 1 : 0)
          .put<uint64_t>(reinterpret_cast<uint64_t>(ch->inbox))
          .put<uint64_t>(static_cast<uint64_t>(fifo_stride_))
          .put_bytes(handle.data(), handle.size());
      auto all = comm_.bootstrap().allgather(w.bytes(), BootstrapOp::kDeviceSetup);
      struct Peer {
        int32_t pid, dev;
        uint64_t host;
        bool staging;
        uint64_t ptr, stride;
        std::vector<unsigned char> handle;
      };
      std::vector<Peer> peers(static_cast<size_t>(nranks));
      for (int r = 0; r < nranks; ++r) {
        wire::Reader rd(all[r], "device channel setup");
        Peer& q = peers[r];
        q.pid = rd.get<int32_t>();
        q.dev = rd.get<int32_t>();
        q.host = rd.get<uint64_t>();
        q.staging = rd.get<uint8_t>() != 0;
        q.ptr = rd.get<uint64_t>();
        q.stride = rd.get<uint64_t>();
        q.handle = rd.get_bytes();
      }
      // Every rank sees every rank's host and setting, so all reach the same decision: device FIFOs
      // for everyone, or host staging for everyone (a plan needs every rank on one path).
      for (const Peer& q : peers) staged_ = staged_ || q.staging || q.host != peers[me].host;
      std::map<std::pair<uint64_t, int32_t>, int> per_device;  // (host, device) -> ranks
      for (const Peer& q : peers) ++per_device[{q.host, q.dev}];
      peer_transport_.assign(static_cast<size_t>(nranks), nullptr);
      peer_device_.assign(static_cast<size_t>(nranks), -1);
      for (int r = 0; r < nranks; ++r) peer_device_[r] = peers[r].dev;
      const auto& table = device_transports();  // cuda-p2p, cuda-ipc, host-staged
      for (int r = 0; r < nranks && !staged_; ++r) {
        if (r == me) continue;
        const Peer& q = peers[r];
        TUTTI_CHECK(static_cast<int64_t>(q.stride) == fifo_stride_, InvalidUsage,
                    "rank {}: rank {} uses device FIFOs of another size ({} bytes per peer, here {}): set "
                    "TUTTI_DEVICE_* alike on every rank",
                    me, r, q.stride, fifo_stride_);
        if (q.pid == static_cast<int32_t>(getpid())) {
          if (q.dev != backend_->device()) backend_->reach(q.dev);
          ch->peer_inbox[r] = reinterpret_cast<unsigned char*>(q.ptr);
          peer_transport_[r] = &table[0];
        } else {
          ch->peer_inbox[r] = static_cast<unsigned char*>(backend_->open(q.handle, q.dev));
          ch->opened[r] = true;
          peer_transport_[r] = &table[1];
        }
      }
      if (staged_)
        for (int r = 0; r < nranks; ++r) peer_transport_[r] = &table[2];
      // The most ranks any GPU holds: the same number on every rank, so every rank picks the same
      // instance count.
      for (auto& [where, count] : per_device) ranks_on_device_ = std::max(ranks_on_device_, count);
    }
    channels_.push_back(std::move(ch));
    if (staged_)
      TUTTI_INFO(log::kInit,
                 "rank {}: device buffers go through host memory (some ranks share no GPU memory, or "
                 "TUTTI_DEVICE_STAGING=1)",
                 me);
    else
      TUTTI_INFO(log::kInit, "rank {}: device channel {} connected ({} peers, {} on {})", me, channels_.size() - 1,
                 nranks - 1, fifo_stride_, backend_->name());
  }
}

DeviceExecutor::Uploaded& DeviceExecutor::upload(const PreparedPlan& pp, void* stream) {
  if (auto it = plans_.find(pp.id); it != plans_.end()) return *it->second;
  TUTTI_CHECK(!backend_->capturing(stream), InvalidUsage,
              "rank {}: plan '{}' runs for the first time inside a CUDA graph capture; its first call uploads it, "
              "which a capture does not allow: run the collective once before capturing it",
              comm_.rank(), pp.plan.name);
  auto u = std::make_unique<Uploaded>();
  const int me = comm_.rank();
  u->plan = flatten(pp, me);
  u->fifo_depth = pp.plan.fifo_depth;
  // Before anything collective: a refused plan must fail on every rank alone, not hang.
  TUTTI_CHECK(u->fifo_depth <= options_.fifo_depth, InvalidArgument,
              "plan '{}' is deadlock-free only with FIFOs of {} messages; device FIFOs hold {} "
              "(TUTTI_DEVICE_FIFO_DEPTH)",
              pp.plan.name, u->fifo_depth, options_.fifo_depth);
  for (const DevBlock& b : u->plan.blocks) u->max_steps = std::max(u->max_steps, b.nsteps);
  // The same on every rank: instance i of one rank exchanges with instance i of the others. Every
  // thread block of every rank on a GPU must be resident at once (they wait for each other), so the
  // instances share the GPU's blocks among the ranks on it.
  ensure_channels(1);  // learns which ranks share this GPU
  const int nblocks = u->plan.max_blocks;
  const int resident = backend_->resident_blocks(options_.threads);
  TUTTI_CHECK(nblocks * ranks_on_device_ <= resident, InvalidArgument,
              "plan '{}' runs {} thread blocks on each of up to {} ranks sharing a GPU, more than a GPU runs at once "
              "({} of {} threads): use fewer ranks per GPU, or fewer threads per block (TUTTI_DEVICE_THREADS)",
              pp.plan.name, nblocks, ranks_on_device_, resident, options_.threads);
  // Automatic instances leave some multiprocessors free (an eighth, at least 2): at 512 threads a
  // block of the interpreter fills a multiprocessor's registers, and a kernel of the user's or of
  // host staging's proxy that holds one would keep a block of the plan waiting for it.
  const int processors = backend_->processors();
  const int spare = std::min(processors - 1, std::max(2, processors / 8));
  u->instances = options_.instances > 0
                     ? options_.instances
                     : std::clamp((processors - spare) / (nblocks * ranks_on_device_), options_.min_instances,
                                  options_.max_instances);
  u->instances = std::min(u->instances, std::max(1, resident / (nblocks * ranks_on_device_)));
  // Device channel 0 is reserved for point-to-point calls; instance i's plan channel c is
  // 1 + i * channels + c.
  ensure_channels(1 + u->instances * u->plan.channels);
  std::vector<FifoView> sends, recvs;
  for (int instance = 0; instance < u->instances; ++instance) {
    const size_t base = static_cast<size_t>(1 + instance * u->plan.channels);
    for (auto& k : u->plan.sends) sends.push_back(view(*channels_.at(base + k.channel), k.peer, true));
    for (auto& k : u->plan.recvs) recvs.push_back(view(*channels_.at(base + k.channel), k.peer, false));
  }
  // One allocation: the plan's arrays, the FIFO views and the blocks' progress words.
  std::vector<unsigned char> image;
  auto put = [&](const void* data, size_t bytes) {
    size_t at = static_cast<size_t>(round_up(static_cast<int64_t>(image.size()), 16));
    image.resize(at + bytes);
    if (bytes) std::memcpy(image.data() + at, data, bytes);
    return at;
  };
  const DevicePlan& d = u->plan;
  size_t o_blocks = put(d.blocks.data(), d.blocks.size() * sizeof(DevBlock));
  size_t o_steps = put(d.steps.data(), d.steps.size() * sizeof(DevStep));
  size_t o_srcs = put(d.srcs.data(), d.srcs.size() * sizeof(DevRef));
  size_t o_deps = put(d.deps.data(), d.deps.size() * sizeof(DevDep));
  size_t o_scalars = put(d.scalars.data(), d.scalars.size() * sizeof(DevScalar));
  size_t o_code = put(d.code.data(), d.code.size() * sizeof(element::ElementCode));
  size_t o_send = put(sends.data(), sends.size() * sizeof(FifoView));
  size_t o_recv = put(recvs.data(), recvs.size() * sizeof(FifoView));
  std::vector<uint64_t> zeros(d.blocks.size() * static_cast<size_t>(u->instances), 0);
  size_t o_progress = put(zeros.data(), zeros.size() * sizeof(uint64_t));
  // Other ranks may have launched this call already: nothing here may synchronize the device.
  u->memory = backend_->alloc_async(image.size(), stream);
  backend_->upload_async(u->memory, image.data(), image.size(), stream);
  auto* base = static_cast<unsigned char*>(u->memory);
  LaunchArgs& a = u->base;
  a.blocks = reinterpret_cast<const DevBlock*>(base + o_blocks);
  a.steps = reinterpret_cast<const DevStep*>(base + o_steps);
  a.srcs = reinterpret_cast<const DevRef*>(base + o_srcs);
  a.deps = reinterpret_cast<const DevDep*>(base + o_deps);
  a.scalar_refs = reinterpret_cast<const DevScalar*>(base + o_scalars);
  a.code = reinterpret_cast<const element::ElementCode*>(base + o_code);
  a.send = reinterpret_cast<const FifoView*>(base + o_send);
  a.recv = reinterpret_cast<const FifoView*>(base + o_recv);
  a.progress = reinterpret_cast<uint64_t*>(base + o_progress);
  a.nblocks = static_cast<int32_t>(d.blocks.size());
  a.instances = u->instances;
  a.nsend = static_cast<int32_t>(d.sends.size());
  a.nrecv = static_cast<int32_t>(d.recvs.size());
  return *(plans_[pp.id] = std::move(u));
}

FifoView DeviceExecutor::view(const Channel& ch, int peer, bool send) const {
  const int me = comm_.rank();
  unsigned char* fifo = send ? ch.peer_inbox[peer] + fifo_stride_ * me : ch.inbox + fifo_stride_ * peer;
  FifoView v;
  v.tail = reinterpret_cast<uint64_t*>(fifo);
  v.head = reinterpret_cast<uint64_t*>(fifo + 64);
  v.simple = fifo + kFifoHeader;
  v.ll = v.simple + options_.fifo_depth * options_.slot_bytes;
  v.desc = reinterpret_cast<uint64_t*>(v.ll + options_.fifo_depth * options_.ll_slot_bytes);
  v.count = ch.counts + (send ? 0 : comm_.size()) + peer;
  v.peer = peer;
  // Ranks of one process on one GPU address each other's memory whatever allocated it (peer access
  // between GPUs does not reach stream-ordered pools or cuMem allocations, which user buffers may be).
  v.direct = send && peer != me && peer_transport_.at(peer) == &device_transports()[0] &&
                     peer_device_.at(peer) == backend_->device()
                 ? 1
                 : 0;
  return v;
}

void DeviceExecutor::register_memory(const void* p, size_t bytes) {
  TUTTI_CHECK(p && bytes > 0, InvalidArgument, "rank {}: registering {} bytes at {}", comm_.rank(), bytes, p);
  std::lock_guard lock(registered_mu_);
  registered_.push_back({static_cast<const unsigned char*>(p), bytes});
}

void DeviceExecutor::deregister_memory(const void* p, size_t bytes) {
  std::lock_guard lock(registered_mu_);
  auto it = std::find_if(registered_.begin(), registered_.end(),
                         [&](const auto& r) { return r.first == p && r.second == bytes; });
  TUTTI_CHECK(it != registered_.end(), InvalidArgument, "rank {}: {} bytes at {} are not registered", comm_.rank(),
              bytes, p);
  registered_.erase(it);
}

bool DeviceExecutor::registered(const void* p, size_t bytes) const {
  auto* q = static_cast<const unsigned char*>(p);
  std::lock_guard lock(registered_mu_);
  for (const auto& [base, n] : registered_)
    if (q && bytes > 0 && q >= base && q + bytes <= base + n) return true;
  return false;
}

uint64_t DeviceExecutor::direct_messages() {
  RankState s[2];
  backend_->synchronize(nullptr);
  backend_->copy(&s[0], state_, sizeof(RankState), nullptr);
  backend_->copy(&s[1], p2p_state_, sizeof(RankState), nullptr);
  backend_->synchronize(nullptr);
  return s[0].direct_messages + s[1].direct_messages;
}

const char* DeviceExecutor::transport_to(int peer) const {
  if (peer == comm_.rank()) return "self";
  TUTTI_CHECK(peer >= 0 && peer < comm_.size() && static_cast<size_t>(peer) < peer_transport_.size() &&
                  peer_transport_[peer],
              InvalidArgument, "rank {}: no device transport to rank {} (not connected yet, or out of range)",
              comm_.rank(), peer);
  return peer_transport_[peer]->name;
}

void DeviceExecutor::check_device_call(const DevicePlan& d, const PreparedPlan& pp, const ExecArgs& args,
                                       int32_t protocol) const {
  const plan::Plan& p = pp.plan;
  TUTTI_CHECK(!d.float_kernels || args.reduction.type == DataType::kFloat32, InvalidArgument,
              "plan '{}' runs kernels of float32 data; the call's type is {}", p.name, name(args.reduction.type));
  TUTTI_CHECK(args.scalars.size() >= static_cast<size_t>(d.scalar_slots), InvalidArgument,
              "rank {}: plan '{}' reads per-call scalar {}, but the call passes {} scalar(s)", comm_.rank(), p.name,
              d.scalar_slots - 1, args.scalars.size());
  if (!d.one_pass) return;
  TUTTI_CHECK(d.half_unit == 0 || args.count == 2 * d.half_unit * p.chunk_factor, InvalidArgument,
              "plan '{}' writes 16-bit values into chunks of {} floats, which hold {} of them; the call's chunks have {} "
              "elements",
              p.name, d.half_unit, 2 * d.half_unit, args.count / p.chunk_factor);
  for (int64_t row : d.row_units)
    TUTTI_CHECK(args.count % p.chunk_factor == 0 && (args.count / p.chunk_factor) % row == 0, InvalidArgument,
                "plan '{}' runs kernels on rows of {} elements; the call's count {} does not cut into {} chunks of "
                "whole rows",
                p.name, row, args.count, p.chunk_factor);
  for (const DevicePlan::OperandLength& l : d.lengths) {
    const bool whole = l.unit > 0 || args.count % p.chunk_factor == 0;
    const int64_t have = l.unit > 0 ? l.unit * l.chunks : args.count / p.chunk_factor * l.chunks;
    TUTTI_CHECK(whole && have == l.want, InvalidArgument,
                "plan '{}' runs kernel '{}' on operand {} of {} elements; at the call's count {} it has {}", p.name,
                l.kernel, l.operand, l.want, args.count,
                whole ? std::to_string(have) : std::string("chunks of unequal lengths"));
  }
  // One round over the whole call (abi.hpp, "One pass"): every message must fit a slot as it is.
  const int64_t capacity = protocol == kProtoLL ? ll_capacity(options_.ll_slot_bytes) : options_.slot_bytes;
  const int64_t esize = static_cast<int64_t>(size_of(args.reduction.type));
  const int64_t chunk_bytes = (args.count + p.chunk_factor - 1) / p.chunk_factor * esize;
  const int64_t largest = std::max(d.max_message_chunks * round_up(chunk_bytes, kChunkAlign),
                                   d.max_unit_message_chunks * round_up(d.max_unit * esize, kChunkAlign));
  TUTTI_CHECK(largest <= capacity, InvalidArgument,
              "plan '{}' has state buffers, so it runs in one pass on the device, and its messages of up to {} bytes at "
              "this count do not fit device slots of {} bytes: cut the call into more pieces, or raise "
              "TUTTI_DEVICE_SLOT_SIZE",
              p.name, largest, capacity);
  TUTTI_CHECK(static_cast<int>(args.states.size()) == d.nstates, InvalidArgument,
              "plan '{}' has {} state buffers; the call passes {}", p.name, d.nstates, args.states.size());
  TUTTI_CHECK(args.scalars.size() <= static_cast<size_t>(kMaxScalars), InvalidArgument,
              "plan '{}': the call passes {} scalars; a device launch carries at most {}", p.name, args.scalars.size(),
              kMaxScalars);
}

void DeviceExecutor::run(const PreparedPlan& pp, const ExecArgs& args) {
  const plan::Plan& p = pp.plan;
  void* const stream = args.stream;
  TUTTI_CHECK(!staged_, InvalidUsage,
              "rank {}: plan '{}': device FIFOs are not connected because some ranks share no GPU memory; "
              "device calls of this communicator go through host staging",
              comm_.rank(), p.name);
  check();
  check_call(pp, comm_.size(), args);
  // The options' protocol (TUTTI_PROTO) first, then the call's, then the plan's.
  const tutti::Protocol wanted = args.protocol != tutti::Protocol::kAuto ? args.protocol : p.protocol;
  const int32_t protocol = options_.protocol ? *options_.protocol : wanted == tutti::Protocol::kLL ? kProtoLL : kProtoSimple;
  // What this device refuses of the call, before the plan's first upload (which is collective), so
  // that a refused call fails on every rank alone instead of hanging.
  if (auto it = plans_.find(pp.id); it != plans_.end()) check_device_call(it->second->plan, pp, args, protocol);
  else check_device_call(flatten(pp, comm_.rank()), pp, args, protocol);
  Uploaded& u = upload(pp, stream);
  if (u.plan.blocks.empty()) return;
  const int threads = options_.threads;

  LaunchArgs a = u.base;
  a.protocol = protocol;
  a.op = static_cast<int32_t>(args.reduction.op);
  a.type = static_cast<int32_t>(args.reduction.type);
  a.esize = static_cast<int64_t>(size_of(args.reduction.type));
  a.count = args.count;
  a.chunk_factor = p.chunk_factor;
  a.depth = options_.fifo_depth;
  a.slot_bytes = options_.slot_bytes;
  a.ll_slot_bytes = options_.ll_slot_bytes;
  a.timeout_ns = static_cast<uint64_t>(options_.timeout_s * 1e9);
  a.stamp = call_stamp(p, args);
  last_stamp_ = a.stamp;
  // Rounds: the largest message of the plan (max_message_chunks chunks, each padded to 16 bytes)
  // must fit one slot.
  const int64_t capacity = a.protocol == kProtoLL ? ll_capacity(a.ll_slot_bytes) : a.slot_bytes;
  const int64_t per_chunk = capacity / u.plan.max_message_chunks / kChunkAlign * kChunkAlign;
  const int64_t chunk_elems = per_chunk / a.esize;
  TUTTI_CHECK(chunk_elems >= 1, InvalidArgument,
              "plan '{}' sends messages of {} chunks, which do not fit device slots of {} bytes (TUTTI_DEVICE_SLOT_SIZE)",
              p.name, u.plan.max_message_chunks, capacity);
  a.round_elems = chunk_elems * p.chunk_factor;
  if (u.plan.one_pass) a.round_elems = args.count;  // one round over the whole call (abi.hpp, "One pass")
  a.nstates = u.plan.nstates;
  for (int k = 0; k < u.plan.nstates; ++k)
    a.states[k] = DevState{static_cast<unsigned char*>(args.states[static_cast<size_t>(k)]), p.states[static_cast<size_t>(k)].unit};
  a.nscalars = static_cast<int32_t>(std::min<size_t>(args.scalars.size(), kMaxScalars));
  for (int k = 0; k < a.nscalars; ++k) a.scalars[k] = args.scalars[static_cast<size_t>(k)];
  // Several instances share the rounds: rounds small enough that each gets some (but chunks of at
  // least 4 KiB, below which a round costs more in flags than it moves).
  if (u.instances > 1 && !u.plan.one_pass) {
    const int64_t C = p.chunk_factor;
    int64_t share = (args.count + u.instances - 1) / u.instances;
    share = std::max(share, C * std::max<int64_t>(1, 4096 / a.esize));
    share = (share + C - 1) / C * C;
    a.round_elems = std::min(a.round_elems, share);
  }
  a.rounds = std::max<int64_t>(1, (args.count + a.round_elems - 1) / a.round_elems);
  // Instances beyond the rounds would only start, find nothing and count themselves finished.
  a.instances = static_cast<int32_t>(std::min<int64_t>(u.instances, a.rounds));
  TUTTI_CHECK(a.rounds * u.max_steps < (int64_t{1} << 32) - 1, InvalidArgument,
              "count {} needs {} rounds of plan '{}': too many for the device's progress words; use larger slots",
              args.count, a.rounds, p.name);
  // Scratch: pieces of `count` elements, like the user's buffers, so rounds never share a region.
  exec::Geometry g{args.count, p.chunk_factor, a.esize};
  size_t scratch = u.plan.scratch_chunks > 0 ? static_cast<size_t>(g.chunk_end(u.plan.scratch_chunks - 1) * a.esize) : 0;
  if (scratch > scratch_bytes_) {
    TUTTI_CHECK(!backend_->capturing(stream), InvalidUsage,
                "rank {}: plan '{}' needs more scratch inside a CUDA graph capture than any call before it; run the "
                "collective at this size once before capturing it",
                comm_.rank(), p.name);
    backend_->release_async(scratch_, stream);
    scratch_ = nullptr;
    scratch_ = backend_->alloc_async(scratch, stream);
    scratch_bytes_ = scratch;
  }
  a.bufs[kBufInput] = static_cast<unsigned char*>(const_cast<void*>(args.input));
  a.bufs[kBufOutput] = static_cast<unsigned char*>(args.output);
  a.bufs[kBufScratch] = static_cast<unsigned char*>(scratch_);
  // Registered user buffers may be read in place by peers (scratch is never registered).
  const exec::Geometry geo{args.count, p.chunk_factor, a.esize};
  const CollectiveSpec& spec = pp.spec;
  const size_t in_bytes = spec.input_chunks() > 0 ? static_cast<size_t>(geo.bytes(0, spec.input_chunks())) : 0;
  const size_t out_bytes = spec.output_chunks() > 0 ? static_cast<size_t>(geo.bytes(0, spec.output_chunks())) : 0;
  // The compiler proved a send's source stable for the plan's own aliasing: an out-of-place plan
  // given overlapping buffers (an in-place rooted call) may write a sent chunk through the other
  // buffer, so its peers read copies.
  const auto* ib = static_cast<const unsigned char*>(args.input);
  const auto* ob = static_cast<const unsigned char*>(args.output);
  const bool overlap = ib && ob && in_bytes && out_bytes && ib < ob + out_bytes && ob < ib + in_bytes;
  if (p.inplace || !overlap) {
    if (registered(args.input, in_bytes)) a.registered |= 1u << kBufInput;
    if (registered(args.output, out_bytes)) a.registered |= 1u << kBufOutput;
  }
  a.state = state_;
  a.status = status_dev_;
  a.abort = abort_dev_;
  last_plan_ = p.name;
  backend_->launch(a, threads, stream);
  check();
}

}  // namespace tutti::device

namespace tutti::device {

// Point-to-point transfers of up to this many bytes use LL (both sides decide alike from the size,
// which NCCL requires to match).
constexpr size_t kP2pLLBytes = 64 << 10;

void DeviceExecutor::run_p2p(const std::vector<P2pTransfer>& ops, void* stream) {
  check();
  const int me = comm_.rank();
  TUTTI_CHECK(!staged_, InvalidUsage,
              "rank {}: device FIFOs are not connected because some ranks share no GPU memory; point-to-point calls "
              "on device buffers of this communicator go through host staging",
              me);
  std::vector<const P2pTransfer*> self_sends, self_recvs;
  for (const P2pTransfer& op : ops) {
    TUTTI_CHECK(op.peer >= 0 && op.peer < comm_.size(), InvalidArgument, "rank {}: peer {} is out of range (0..{})", me,
                op.peer, comm_.size() - 1);
    if (op.peer == me) (op.send ? self_sends : self_recvs).push_back(&op);
  }
  TUTTI_CHECK(self_sends.size() == self_recvs.size(), InvalidUsage,
              "rank {}: {} send(s) to itself but {} receive(s) from itself in one group", me, self_sends.size(),
              self_recvs.size());
  for (size_t i = 0; i < self_sends.size(); ++i) {
    TUTTI_CHECK(self_sends[i]->bytes == self_recvs[i]->bytes, InvalidUsage,
                "rank {}: send to itself of {} bytes meets a receive of {} bytes", me, self_sends[i]->bytes,
                self_recvs[i]->bytes);
    backend_->copy(self_recvs[i]->buffer, self_sends[i]->buffer, self_sends[i]->bytes, stream);
  }
  ensure_channels(1);
  std::vector<LaunchArgs> launches;
  std::vector<int> lanes;
  std::map<std::pair<int, bool>, int> lane_of;
  for (const P2pTransfer& op : ops) {
    if (op.peer == me) continue;
    auto key = std::make_pair(op.peer, op.send);
    std::unique_ptr<P2pPlan>& pp = p2p_[key];
    if (!pp) {
      pp = std::make_unique<P2pPlan>();
      DevBlock block{0, 1};
      DevStep step;
      step.op = op.send ? plan::Opcode::kSend : plan::Opcode::kRecv;
      step.count = 1;
      DevRef ref{0, op.send ? kBufInput : kBufOutput};
      if (op.send) {
        step.nsrcs = 1;
        step.send_conn = 0;
      } else {
        step.dst = ref;
        step.recv_conn = 0;
      }
      step.stable_src = op.send ? 1 : 0;  // nothing writes a send's buffer during the call
      FifoView v = view(*channels_[0], op.peer, op.send);
      struct Image {
        DevBlock block;
        DevStep step;
        DevRef ref;
        FifoView view;
        uint64_t progress;
      } image{block, step, ref, v, 0};
      pp->memory = backend_->alloc_async(sizeof(Image), stream);
      backend_->upload_async(pp->memory, &image, sizeof(Image), stream);
      auto* img = static_cast<Image*>(pp->memory);
      LaunchArgs& a = pp->base;
      a.blocks = &img->block;
      a.steps = &img->step;
      a.srcs = &img->ref;
      a.send = op.send ? &img->view : nullptr;
      a.recv = op.send ? nullptr : &img->view;
      a.nsend = op.send ? 1 : 0;
      a.nrecv = op.send ? 0 : 1;
      a.progress = &img->progress;
      a.nblocks = 1;
    }
    LaunchArgs a = pp->base;
    a.protocol = options_.protocol ? *options_.protocol : op.bytes <= kP2pLLBytes ? kProtoLL : kProtoSimple;
    a.type = static_cast<int32_t>(DataType::kUint8);
    a.esize = 1;
    a.count = static_cast<int64_t>(op.bytes);
    a.chunk_factor = 1;
    a.depth = options_.fifo_depth;
    a.slot_bytes = options_.slot_bytes;
    a.ll_slot_bytes = options_.ll_slot_bytes;
    a.round_elems = (a.protocol == kProtoLL ? ll_capacity(a.ll_slot_bytes) : a.slot_bytes) / kChunkAlign * kChunkAlign;
    a.rounds = std::max<int64_t>(1, (a.count + a.round_elems - 1) / a.round_elems);
    a.timeout_ns = static_cast<uint64_t>(options_.timeout_s * 1e9);
    a.bufs[op.send ? kBufInput : kBufOutput] = static_cast<unsigned char*>(op.buffer);
    if (op.send && registered(op.buffer, op.bytes)) a.registered = 1u << kBufInput;
    a.state = p2p_state_;
    a.status = status_dev_;
    a.abort = abort_dev_;
    launches.push_back(a);
    auto [it, fresh] = lane_of.emplace(key, static_cast<int>(lane_of.size()));
    lanes.push_back(it->second);
  }
  last_plan_ = "point-to-point";
  last_stamp_ = 0;
  if (!launches.empty()) backend_->launch_group(launches, lanes, options_.threads, stream);
  check();
}

}  // namespace tutti::device
