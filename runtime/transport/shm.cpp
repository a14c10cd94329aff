#include "runtime/transport/shm.hpp"

#include <chrono>

#include <sched.h>

#include <signal.h>

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <new>

#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/huge_pages.hpp"
#include "runtime/shared_buffers.hpp"

namespace tutti {

void init_fifo(void* at, const FifoLayout& layout, bool cma_ok) {
  auto* f = new (at) FifoControl();
  f->head.store(0);
  f->tail.store(0);
  f->cma_done.store(0);
  f->reading.store(0);
  f->withdrawn.store(0);
  f->cma_ok = cma_ok ? 1 : 0;
  f->slots = layout.slots;
  f->slot_size = layout.slot_size;
  for (FifoControl::Costs& c : f->costs) {
    c.recv.store(0);
    c.cma.store(0);
    c.send.store(0);
  }
}

namespace {

// 24 bits of a hash of every other word of the header (the sequence word is written separately).
uint32_t check_of(const SlotHeader& h) {
  return static_cast<uint32_t>(
      header_hash({h.message_bytes, h.offset, h.fragment_bytes, h.source_address, h.stamp, uint64_t(h.mode)}) >> 40);
}

constexpr uint64_t kProbeValue = 0x7475747469707262ull;
volatile uint64_t g_probe_word = kProbeValue;

const TransportInfo kShmInfo{"shm", WaitSource::kDoorbell, MemoryRegistration::kSharedSegment,
                             "the name of this rank's FIFO segment for the channel, its slot count and size"};

// One FIFO per direction and peer, in the receiver's segment (one segment per rank and channel).
class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const CommOptions& o) : options_(o) {}
  const TransportInfo& info() const override { return kShmInfo; }
  bool can_connect(const PeerInfo& self, const PeerInfo& peer) const override { return self.host_hash == peer.host_hash; }

  void publish(const ChannelSetup& s, const std::vector<int>& peers, wire::Writer& out) override {
    // The communicator's settings, resolved when it was made (the calibration's or the defaults).
    const FifoLayout layout{*s.options.shm_slots, *s.options.shm_slot_size / 64 * 64};
    layouts_.push_back(layout);
    ShmSegment own;
    if (!peers.empty()) {
      own = ShmSegment::create(fmt::format("ch{}", s.channel), layout.bytes() * peers.size());
      for (size_t i = 0; i < peers.size(); ++i) {
        const PeerInfo& peer = s.bootstrap.peer(peers[i]);
        bool same_process = peer.pid == getpid();
        bool cma = options_.shm_single_copy && (same_process || probe_single_copy(peer.pid, peer.probe_addr, kProbeValue));
        if (options_.shm_single_copy && !cma)
          TUTTI_INFO(log::kShm, "rank {}: single copy from rank {} is not permitted by the kernel; using the FIFO",
                     s.rank, peers[i]);
        init_fifo(static_cast<unsigned char*>(own.data()) + i * layout.bytes(), layout, cma);
      }
    }
    out.put_string(own.name()).put<uint32_t>(layout.slots).put<uint64_t>(layout.slot_size);
    out.put<uint64_t>(peers.size());
    own_.push_back(std::move(own));
  }

  void connect(const ChannelSetup& s, const std::vector<int>& peers, std::vector<wire::Reader>& published,
               std::vector<std::unique_ptr<Connection>>& conns) override {
    std::vector<ShmSegment> mapped(s.nranks);
    const ShmSegment& own = own_.at(static_cast<size_t>(s.channel));
    const FifoLayout& layout = layouts_.at(static_cast<size_t>(s.channel));
    for (int p = 0; p < s.nranks; ++p) {
      if (p == s.rank) continue;
      wire::Reader& r = published[p];
      std::string name = r.get_string();
      uint32_t slots = r.get<uint32_t>();
      uint64_t slot_size = r.get<uint64_t>(), count = r.get<uint64_t>();
      auto served = std::find(peers.begin(), peers.end(), p);
      if (served == peers.end()) continue;
      TUTTI_CHECK(slots == layout.slots && slot_size == layout.slot_size, InvalidArgument,
                  "rank {}: shared-memory FIFO settings differ from rank {} ({}x{} here, {}x{} there): set "
                  "TUTTI_SHM_SLOTS/TUTTI_SHM_SLOT_SIZE alike on every rank",
                  s.rank, p, layout.slots, layout.slot_size, slots, slot_size);
      mapped[p] = ShmSegment::open(name, layout.bytes() * count);
      // Our FIFO in p's segment: p lists its shared-memory peers by rank, without itself (the
      // ranks of one host, as here).
      size_t index = 0;
      for (int q : peers)
        if (q < s.rank && q != p) ++index;
      size_t mine = static_cast<size_t>(served - peers.begin());
      ShmEndpoint ep;
      ep.out = reinterpret_cast<FifoControl*>(static_cast<unsigned char*>(mapped[p].data()) + index * layout.bytes());
      ep.in = reinterpret_cast<FifoControl*>(static_cast<unsigned char*>(own.data()) + mine * layout.bytes());
      ep.peer_bell = static_cast<Doorbell*>(s.peer_controls[p].data());
      ep.peer_pid = s.bootstrap.peer(p).pid;
      ep.same_process = ep.peer_pid == getpid();
      ep.cma_threshold = *options_.shm_single_copy_threshold;
      ep.cma_adaptive = options_.shm_single_copy_adaptive;
      ep.zero_copy_threshold = options_.shm_zero_copy_threshold;
      ep.out_segment = mapped[p].data();
      ep.out_segment_bytes = mapped[p].size();
      ep.in_segment = own.data();
      ep.in_segment_bytes = own.size();
      ep.huge_pages = options_.huge_pages;
      conns[p] = std::make_unique<ShmConnection>(s.rank, p, s.channel, ep);
    }
    mapped_.push_back(std::move(mapped));
  }

  void finish(const ChannelSetup& s) override { own_.at(static_cast<size_t>(s.channel)).unlink(); }

 private:
  CommOptions options_;
  // By channel; slots hold whole elements, so a reducing receive can combine a fragment in place.
  std::vector<FifoLayout> layouts_;
  std::vector<ShmSegment> own_;                  // by channel (publish() is called in channel order)
  std::vector<std::vector<ShmSegment>> mapped_;  // [channel][rank]
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(const CommOptions& options) {
  return std::make_unique<ShmTransport>(options);
}

uint64_t single_copy_probe_address() { return reinterpret_cast<uint64_t>(&g_probe_word); }

const TransportInfo& ShmConnection::transport() const { return kShmInfo; }

bool probe_single_copy(int pid, uint64_t address, uint64_t expect) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(address), sizeof(got)};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) && got == expect;
}

namespace {
// A choice per class of messages (cost_class): class 0 applies from one slot up, the others to
// their own sizes.
std::vector<SingleCopyChoice> make_choices(const ShmEndpoint& ep) {
  std::vector<SingleCopyChoice> c;
  for (int k = 0; k < kCostClasses; ++k)
    c.emplace_back(k == 0 ? ep.out->slot_size : kSmallestChosen, ep.cma_threshold, ep.cma_adaptive,
                   k == 0 ? SingleCopyChoice::kBurst : SingleCopyChoice::kSubSlotBurst);
  return c;
}
}  // namespace

ShmConnection::ShmConnection(int rank, int peer, int channel, ShmEndpoint ep)
    : Connection(rank, peer, channel),
      ep_(ep),
      cma_(ep.out->cma_ok != 0),
      choices_(make_choices(ep)) {}

unsigned char* ShmConnection::slot(FifoControl* f, uint64_t index) const {
  FifoLayout l{f->slots, f->slot_size};
  return reinterpret_cast<unsigned char*>(f) + sizeof(FifoControl) + (index % f->slots) * l.stride();
}

namespace {

using Clock = std::chrono::steady_clock;
double ns_since(Clock::time_point t0) { return std::chrono::duration<double, std::nano>(Clock::now() - t0).count(); }
double cost_of(const std::atomic<uint64_t>& word) { return std::bit_cast<double>(word.load(std::memory_order_relaxed)); }
// Stores a measured cost where the peer reads it, only when it moved by more than 2 %: the peer's
// copy of the line then stays valid between changes (FifoControl::Costs).
void publish_cost(std::atomic<uint64_t>& word, double ns_per_mib) {
  const double was = cost_of(word);
  if (was == 0 || ns_per_mib < 0.98 * was || ns_per_mib > 1.02 * was)
    word.store(std::bit_cast<uint64_t>(ns_per_mib), std::memory_order_relaxed);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
// Maps the first `bytes` of every slot of a FIFO into this process at once. Left to first touch, a
// FIFO's slots fault in one by one over its first few dozen messages, each fault costing more than
// the message (16-256 KiB all-gathers ran 5-20x slower than later ones). Done on first use, not at
// setup, because most connections of a communicator never carry data; and only as deep into each
// slot as the messages so far reach, because a plan of many channels sends small messages through
// slots of 128 KiB (a 32-channel 8-rank plan populated 1 GiB for 1 MiB all-reduces). A hint: kernels
// without MADV_POPULATE_WRITE fault lazily as before.
void populate(FifoControl* f, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const FifoLayout l{f->slots, f->slot_size};
  const size_t depth = std::min(bytes, l.stride());
  for (uint32_t i = 0; i < f->slots; ++i) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(f) + sizeof(FifoControl) + i * l.stride();
    const uintptr_t begin = at / page * page, end = at + depth;
    (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
  }
}
}  // namespace

SlotHeader ShmConnection::read_header(const unsigned char* s) const {
  SlotHeader h;
  std::memcpy(&h, s, sizeof(h));
  if (h.check != check_of(h)) corrupt_header("shared-memory slot header");
  return h;
}

bool ShmConnection::progress() {
  bool moved = false;
  // Slots are populated as deep as the largest message so far reaches (header included); a FIFO
  // that whole slots stream through goes onto huge pages first, in each process's own view.
  const size_t full = ep_.out->slot_size + sizeof(SlotHeader);
  if (!sendq_.empty()) {
    const size_t need = sizeof(SlotHeader) + sendq_.back().bytes;
    if (need > out_populated_ && out_populated_ < full) {
      if (need >= full && ep_.huge_pages)
        back_segment_with_huge_pages(ep_.out_segment, ep_.out_segment_bytes, ep_.out, FifoLayout{ep_.out->slots, ep_.out->slot_size}.bytes());
      populate(ep_.out, need), out_populated_ = need;
    }
    moved |= progress_send();
  }
  if (!recvq_.empty()) {
    const size_t need = sizeof(SlotHeader) + recvq_.back().bytes;
    if (need > in_populated_ && in_populated_ < full) {
      if (need >= full && ep_.huge_pages)
        back_segment_with_huge_pages(ep_.in_segment, ep_.in_segment_bytes, ep_.in, FifoLayout{ep_.in->slots, ep_.in->slot_size}.bytes());
      populate(ep_.in, need), in_populated_ = need;
    }
    moved |= progress_recv();
  }
  return moved;
}

bool ShmConnection::relieve() {
  // Nothing posted to receive: release any single-copy sender that waits for us (eager semantics).
  if (recvq_.empty() && ep_.in->head.load(std::memory_order_acquire) != tail_) return pull_ahead();
  return false;
}

PairCosts ShmConnection::pair_costs(int cost_class) const {
  const FifoControl::Costs &out = ep_.out->costs[cost_class], &in = ep_.in->costs[cost_class];
  return {cost_of(out.send), cost_of(out.recv), cost_of(out.cma), cost_of(in.send), cost_of(in.recv), cost_of(in.cma)};
}

bool ShmConnection::progress_send() {
  FifoControl* f = ep_.out;
  const uint64_t slots = f->slots, slot_size = f->slot_size;
  bool moved = false;
  while (next_post_ < sendq_.size()) {
    if (head_ - tail_seen_ >= slots) {
      tail_seen_ = f->tail.load(std::memory_order_acquire);
      if (head_ - tail_seen_ >= slots) break;
    }
    Op& op = sendq_[next_post_];
    unsigned char* s = slot(f, head_);
    if (drop_.load(std::memory_order_relaxed)) {  // TUTTI_FAULT=drop: complete it unsent
      op.started = true;
      op.offset = op.bytes;
      op.aux = UINT64_MAX;
      ++next_post_;
      moved = true;
      continue;
    }
    SlotHeader h{op.bytes, op.offset, 0, 0, op.stamp, SlotMode::kInline, 0, 0, 0};
    SharedBufferRef shared;
    if (!op.started && op.bytes > 0 && op.bytes >= ep_.zero_copy_threshold) {
      if (ep_.same_process) {
        h.mode = SlotMode::kAddress;
        h.source_address = reinterpret_cast<uint64_t>(op.data);
      } else if (find_shared_buffer(op.data, op.bytes, shared) &&
                 sizeof(uint64_t) + shared.segment.size() < slot_size) {
        h.mode = SlotMode::kSegment;
        h.source_address = shared.offset;
        const uint64_t segment_bytes = shared.segment_bytes;
        std::memcpy(s + sizeof(SlotHeader), &segment_bytes, sizeof segment_bytes);
        std::memcpy(s + sizeof(SlotHeader) + sizeof segment_bytes, shared.segment.c_str(), shared.segment.size() + 1);
      }
    }
    if (h.mode == SlotMode::kInline && !op.started && cma_ && op.bytes > 0) {
      // Threads of one process, and messages under 16 KiB: the threshold alone.
      bool single = false;
      if (const int k = ep_.same_process ? -1 : cost_class(op.bytes, slot_size); k < 0) {
        single = op.bytes >= ep_.cma_threshold;
      } else {
        const PairCosts c = pair_costs(k);
        single = choices_[static_cast<size_t>(k)].single_copy(op.bytes, c);
        TUTTI_TRACE(log::kShm, "{}: {} bytes by {}; ns/MiB out send {:.0f} recv {:.0f} single {:.0f}, in send {:.0f} recv {:.0f} single {:.0f}",
                    where(), op.bytes, single ? "single copy" : "FIFO", c.send_out, c.recv_out, c.cma_out, c.send_in,
                    c.recv_in, c.cma_in);
      }
      if (single) {
        h.mode = SlotMode::kAddress;
        h.source_address = reinterpret_cast<uint64_t>(op.data);
      }
    }
    if (h.mode != SlotMode::kInline) {
      h.fragment_bytes = op.bytes;
      op.aux = cma_posted_++;
      op.offset = op.bytes;
    } else {
      h.fragment_bytes = std::min<uint64_t>(slot_size, op.bytes - op.offset);
      // The rates the choice compares: full slots, and messages under one slot by their size.
      if (const int k = measuring_sends() ? measured_class(h.fragment_bytes, op.bytes, slot_size) : -1; k >= 0) {
        const auto t0 = Clock::now();
        std::memcpy(s + sizeof(SlotHeader), op.data + op.offset, h.fragment_bytes);
        SingleCopyChoice& choice = choices_[static_cast<size_t>(k)];
        choice.sent(h.fragment_bytes, ns_since(t0));
        publish_cost(f->costs[k].send, choice.send_ns_per_mib());
      } else if (h.fragment_bytes) {
        std::memcpy(s + sizeof(SlotHeader), op.data + op.offset, h.fragment_bytes);
      }
      op.offset += h.fragment_bytes;
      op.aux = UINT64_MAX;
    }
    op.started = true;
    h.check = check_of(h);
    if (corrupt_.load(std::memory_order_relaxed)) {  // TUTTI_FAULT=corrupt
      h.message_bytes ^= 1ull << 3;
      corrupt_.store(false, std::memory_order_relaxed);
    }
    std::memcpy(s, &h, offsetof(SlotHeader, seq));
    std::atomic_ref<uint64_t>(reinterpret_cast<SlotHeader*>(s)->seq).store(head_ + 1, std::memory_order_release);
    f->head.store(++head_, std::memory_order_release);
    ring(*ep_.peer_bell);
    moved = true;
    if (op.offset == op.bytes) ++next_post_;
  }
  // Completion in order: inline messages are done once fully posted (the data lives in the FIFO),
  // by-reference ones once the receiver has read them.
  while (next_post_ > 0) {
    Op& op = sendq_.front();
    if (op.aux != UINT64_MAX && f->cma_done.load(std::memory_order_acquire) <= op.aux) break;
    sendq_.pop_front();
    --next_post_;
    ++sends_completed_;
    moved = true;
  }
  return moved;
}

void ShmConnection::copy_from_peer(unsigned char* dst, uint64_t src, size_t bytes) {
  if (ep_.same_process) {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
    return;
  }
  size_t done = 0;
  while (done < bytes) {
    iovec local{dst + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(src + done), bytes - done};
    ssize_t k = process_vm_readv(ep_.peer_pid, &local, 1, &remote, 1, 0);
    if (k <= 0) {
      if (k < 0 && errno == EINTR) continue;
      throw RemoteError(fmt::format("{}: single-copy read of {} bytes from pid {} failed: {}", where(), bytes,
                                    ep_.peer_pid, k < 0 ? std::strerror(errno) : "no progress"));
    }
    done += static_cast<size_t>(k);
  }
}

const unsigned char* ShmConnection::direct_source(const SlotHeader& h, const unsigned char* s) {
  if (h.mode == SlotMode::kAddress) return ep_.same_process ? reinterpret_cast<const unsigned char*>(h.source_address) : nullptr;
  uint64_t segment_bytes = 0;
  std::memcpy(&segment_bytes, s + sizeof(SlotHeader), sizeof segment_bytes);
  const char* name = reinterpret_cast<const char*>(s + sizeof(SlotHeader) + sizeof segment_bytes);
  auto it = mapped_.find(name);
  if (it == mapped_.end()) it = mapped_.emplace(name, ShmSegment::open(name, segment_bytes)).first;
  if (h.source_address + h.fragment_bytes > it->second.size())
    throw RemoteError(fmt::format("{}: zero-copy descriptor outside segment {} ({} + {} > {} bytes)", where(), name,
                                  h.source_address, h.fragment_bytes, it->second.size()));
  return static_cast<const unsigned char*>(it->second.data()) + h.source_address;
}

void ShmConnection::withdraw() {
  // Only the sender's memory is read by reference, and only through our FIFO to the peer.
  FifoControl* f = ep_.out;
  f->withdrawn.store(1, std::memory_order_seq_cst);
  // A read in progress is one memcpy or process_vm_readv: it ends soon, unless the reading process
  // died in it (its flag then stays set), which the pid check sees.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (f->reading.load(std::memory_order_seq_cst) != 0) {
    if (!ep_.same_process && ::kill(ep_.peer_pid, 0) != 0 && errno == ESRCH) return;
    if (std::chrono::steady_clock::now() > give_up) {
      TUTTI_WARN("{}: rank {} still reads this rank's buffer after 30 s; giving up waiting", where(), peer_);
      return;
    }
    sched_yield();
  }
}

void ShmConnection::take_reference(const SlotHeader& h, const unsigned char* s, const Op& op, unsigned char* to) {
  // The sender may be leaving a failed call, after which its buffer can be freed: announce the read,
  // then make sure the message was not withdrawn (FifoControl, "Withdrawal").
  FifoControl* in = ep_.in;
  in->reading.store(1, std::memory_order_seq_cst);
  struct Done {
    FifoControl* f;
    ~Done() { f->reading.store(0, std::memory_order_release); }
  } done{in};
  if (in->withdrawn.load(std::memory_order_seq_cst) != 0)
    throw RemoteError(fmt::format("{}: rank {} withdrew a {}-byte message before it was read (its call failed)",
                                  where(), peer_, h.fragment_bytes));
  if (const unsigned char* src = direct_source(h, s)) {
    if (to) std::memcpy(to, src, h.fragment_bytes);
    else deliver(op, 0, src, h.fragment_bytes);
  } else {
    // Every read by process_vm_readv is timed: its rate is what the sender's choice weighs.
    unsigned char* into = to ? to : op.reduce ? (bounce_.resize(h.fragment_bytes), bounce_.data()) : op.data;
    const auto t0 = Clock::now();
    copy_from_peer(into, h.source_address, h.fragment_bytes);
    if (const int k = cost_class(h.fragment_bytes, in->slot_size); measuring_receives() && k >= 0) {
      RateAverage& rate = cma_rate_[static_cast<size_t>(k)];
      rate.add(h.fragment_bytes, ns_since(t0));
      publish_cost(in->costs[k].cma, rate.ns_per_mib());
    }
    if (!to && op.reduce) deliver(op, 0, bounce_.data(), h.fragment_bytes);
  }
  FifoControl* f = ep_.in;
  f->tail.store(++tail_, std::memory_order_release);
  f->cma_done.fetch_add(1, std::memory_order_release);
}

bool ShmConnection::pull_ahead() {
  FifoControl* f = ep_.in;
  head_seen_ = f->head.load(std::memory_order_acquire);
  uint64_t last_cma = UINT64_MAX;
  for (uint64_t k = tail_; k < head_seen_; ++k) {
    SlotHeader h = read_header(slot(f, k));
    if (h.mode != SlotMode::kInline) last_cma = k;
  }
  if (last_cma == UINT64_MAX) return false;
  // Messages are published whole and in order, so every slot up to the descriptor completes a message.
  while (tail_ <= last_cma) {
    unsigned char* s = slot(f, tail_);
    SlotHeader h = read_header(s);
    if (h.offset == 0) {
      partial_.assign(h.message_bytes, 0);
      partial_filled_ = 0;
    }
    if (h.offset != partial_filled_ || h.message_bytes != partial_.size() || h.fragment_bytes > h.message_bytes - h.offset)
      throw RemoteError(fmt::format("{}: corrupt shared-memory slot while reading ahead", where()));
    partial_filled_ += h.fragment_bytes;
    if (h.mode != SlotMode::kInline) {
      take_reference(h, s, Op(nullptr, 0, 0), partial_.data());
    } else {
      if (h.fragment_bytes) std::memcpy(partial_.data() + h.offset, s + sizeof(SlotHeader), h.fragment_bytes);
      f->tail.store(++tail_, std::memory_order_release);
    }
    ring(*ep_.peer_bell);
    if (h.offset + h.fragment_bytes == h.message_bytes) early_.push_back({std::move(partial_), h.stamp});
  }
  return true;
}

bool ShmConnection::progress_recv() {
  FifoControl* f = ep_.in;
  bool moved = false;
  while (!recvq_.empty() && !early_.empty()) {
    Op& op = recvq_.front();
    std::vector<unsigned char>& m = early_.front().bytes;
    if (early_.front().stamp != op.stamp) stamp_mismatch(early_.front().stamp, op.stamp);
    if (m.size() != op.bytes)
      throw RemoteError(fmt::format("{}: message size mismatch: the peer sent {} bytes, the receive was posted for {}",
                                    where(), m.size(), op.bytes));
    deliver(op, 0, m.data(), m.size());
    early_.pop_front();
    recvq_.pop_front();
    ++recvs_completed_;
    moved = true;
  }
  while (!recvq_.empty()) {
    if (tail_ == head_seen_) {
      if (std::atomic_ref<uint64_t>(reinterpret_cast<SlotHeader*>(slot(f, tail_))->seq).load(std::memory_order_acquire) !=
          tail_ + 1)
        break;
      head_seen_ = tail_ + 1;
    }
    Op& op = recvq_.front();
    unsigned char* s = slot(f, tail_);
    SlotHeader h = read_header(s);
    if (h.offset == 0 && h.stamp != op.stamp) stamp_mismatch(h.stamp, op.stamp);
    if (h.message_bytes != op.bytes)
      throw RemoteError(fmt::format("{}: message size mismatch: the peer sent {} bytes, the receive was posted for {}",
                                    where(), h.message_bytes, op.bytes));
    if (h.offset != op.offset || h.fragment_bytes > op.bytes - op.offset)
      throw RemoteError(fmt::format("{}: corrupt shared-memory slot (offset {}, fragment {}, expected offset {})",
                                    where(), h.offset, h.fragment_bytes, op.offset));
    if (h.mode != SlotMode::kInline) {
      take_reference(h, s, op, nullptr);
      op.offset = op.bytes;
    } else {
      const int k = measuring_receives() && !op.reduce ? measured_class(h.fragment_bytes, h.message_bytes, f->slot_size) : -1;
      if (k >= 0) {
        const auto t0 = Clock::now();
        deliver(op, op.offset, s + sizeof(SlotHeader), h.fragment_bytes);
        RateAverage& rate = recv_rate_[static_cast<size_t>(k)];
        rate.add(h.fragment_bytes, ns_since(t0));
        publish_cost(f->costs[k].recv, rate.ns_per_mib());
      } else {
        deliver(op, op.offset, s + sizeof(SlotHeader), h.fragment_bytes);
      }
      op.offset += h.fragment_bytes;
      f->tail.store(++tail_, std::memory_order_release);
    }
    ring(*ep_.peer_bell);
    moved = true;
    if (op.offset == op.bytes) {
      recvq_.pop_front();
      ++recvs_completed_;
    }
  }
  return moved;
}

}  // namespace tutti
