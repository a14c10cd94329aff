#pragma once
// Shared-memory transport between ranks of one host (processes or threads).
//
// Each direction of a connection is a FIFO of `slots` slots of `slot_size` bytes that lives in the
// receiver's segment. Small messages are copied through the slots (split over several when large);
// messages of at least `cma_threshold` bytes travel by single copy: the sender publishes its
// buffer's address in one slot and the receiver copies straight from the sender's memory with
// process_vm_readv (memcpy when both ranks are threads of one process), then acknowledges. Between
// processes, messages of 16 KiB or more below the threshold take whichever of the two the
// connection measures faster for messages of their size (single_copy_choice.hpp).
// Single copy is probed at setup and replaced by the FIFO when the kernel forbids it.
//
// Memory ordering (per FIFO):
// - sender: write slot header and payload; slot.seq.store(h + 1, release); head.store(h + 1,
//   release); ring the receiver's doorbell.
// - receiver: slot(t).seq.load(acquire) == t + 1 (or head.load(acquire) > t when reading ahead);
//   read the slot; tail.store(t + 1, release); ring the sender's.
// - sender: tail.load(acquire) before it reuses a slot, so the receiver's reads happened first.
// - single copy: receiver finishes reading, then cma_done.fetch_add(1, release); the sender's
//   buffer is reported done only after cma_done.load(acquire) passes the message's number.
//
// Eager semantics. Plans are verified as if every send completes once its message sits in the
// FIFO. A single-copy send, though, completes only when the receiver has read it, and a receiver may
// post that receive only after its own sends completed: a cycle the verifier cannot see. So a
// receiver that finds a single-copy descriptor in its FIFO with no receive posted for it pulls the
// message (and the inline ones queued before it) into private memory when it has nothing else to do
// (relieve(), called before the rank sleeps), so the common case, a receive posted a little late,
// still gets the single copy. Then every send
// completes without waiting for the receiving plan, exactly as verified; the price is a second copy
// only for messages that arrive before their receive.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/comm_options.hpp"
#include "runtime/comm_state.hpp"
#include "runtime/shm_segment.hpp"
#include "runtime/doorbell.hpp"
#include "runtime/transport/connection.hpp"
#include "runtime/transport/single_copy_choice.hpp"

namespace tutti {

struct alignas(64) FifoControl {
  alignas(64) std::atomic<uint64_t> head;      // slots published by the sender
  alignas(64) std::atomic<uint64_t> tail;      // slots released by the receiver
  alignas(64) std::atomic<uint64_t> cma_done;  // single-copy messages the receiver finished
  // Withdrawal of by-reference messages (ShmConnection::withdraw): the receiver sets `reading`
  // around every read of the sender's memory and checks `withdrawn` after setting it; a sender
  // whose call failed sets `withdrawn`, then waits until `reading` is clear. Both sides seq_cst, so
  // either the reader sees the withdrawal or the sender sees the read and waits for it to end.
  alignas(64) std::atomic<uint32_t> reading;
  std::atomic<uint32_t> withdrawn;
  alignas(64) uint32_t cma_ok;                 // receiver can read the sender's memory (set at setup)
  uint32_t slots;
  uint64_t slot_size;
  // Costs per class of messages (single_copy_choice.hpp, cost_class), which both ends read to
  // choose between the FIFO and single copy.
  // ns per MiB as double bits (0: not measured): the receiver's plain copies out of the class's
  // slots and its single-copy reads, the sender's copies into them. Relaxed: a stale value only
  // delays a choice. The receiver's and the sender's words on lines of their own, and each stored
  // only when it moves (publish_cost in shm.cpp): a message of 16 KiB takes 1-2 us, and a line both
  // ends write at every message would cross between the cores each time.
  struct Costs {
    alignas(64) std::atomic<uint64_t> recv;
    std::atomic<uint64_t> cma;
    alignas(64) std::atomic<uint64_t> send;
  };
  Costs costs[kCostClasses];
};

// How a slot carries its fragment.
enum class SlotMode : uint32_t {
  kInline = 0,   // the bytes follow the header
  kAddress = 1,  // single copy: source_address is the sender's buffer (process_vm_readv, or memcpy in-process)
  kSegment = 2,  // zero copy: source_address is an offset into the named segment that follows the header
};

struct SlotHeader {
  uint64_t message_bytes;  // whole message size (checked against the receive)
  uint64_t offset;         // where this fragment goes
  uint64_t fragment_bytes;
  uint64_t source_address;  // kAddress: sender's address; kSegment: offset in the segment
  // kSegment: the segment's size (8 bytes) and name follow the header, in the slot's payload (the
  // header stays 56 bytes, so an 8-byte message shares one cache line with it).
  CallStamp stamp;          // the call the message belongs to (runtime/call_stamp.hpp)
  SlotMode mode : 8;
  uint32_t check : 24;      // of the words above (check_of): a damaged header is an error
  uint32_t unused;
  // Written last (release): k + 1 for the k-th slot ever published. The receiver polls this word
  // in the slot itself rather than the FIFO's head, so a small message costs the receiver one cache
  // miss (header and payload share the line), not two dependent ones.
  uint64_t seq;
};
static_assert(sizeof(SlotHeader) == 56 && offsetof(SlotHeader, seq) == sizeof(SlotHeader) - 8);

struct FifoLayout {
  uint32_t slots;
  uint64_t slot_size;
  size_t stride() const { return (sizeof(SlotHeader) + slot_size + 63) / 64 * 64; }
  size_t bytes() const { return sizeof(FifoControl) + slots * stride(); }
};

// The shared-memory transport for the registry (runtime/transport/transport.hpp): ranks of one host.
std::unique_ptr<Transport> make_shm_transport(const CommOptions& options);
// The address of a word with a known value in this process, published at bootstrap so peers can
// probe whether the kernel lets them read this process's memory (single copy).
uint64_t single_copy_probe_address();

// Initialises a FIFO in freshly zeroed memory.
void init_fifo(void* at, const FifoLayout& layout, bool cma_ok);
// Whether this process can read `bytes` at `address` in process `pid` with process_vm_readv and
// finds `expect` there.
bool probe_single_copy(int pid, uint64_t address, uint64_t expect);

struct ShmEndpoint {
  FifoControl* out;  // FIFO to the peer (in the peer's segment)
  FifoControl* in;   // FIFO from the peer (in this rank's segment)
  Doorbell* peer_bell;
  int peer_pid;
  bool same_process;
  uint64_t cma_threshold;
  bool cma_adaptive;  // below cma_threshold, measured rates choose (single_copy_choice.hpp)
  // Messages of at least this many bytes go by reference when the receiver can read the source
  // directly: ranks that are threads of one process, or a source in a shared segment (ncclMemAlloc).
  uint64_t zero_copy_threshold;
  // The segments the two FIFOs live in, and whether FIFOs that full slots stream through are moved
  // onto huge pages (TUTTI_HUGE_PAGES; runtime/huge_pages.hpp).
  const void* out_segment = nullptr;
  size_t out_segment_bytes = 0;
  const void* in_segment = nullptr;
  size_t in_segment_bytes = 0;
  bool huge_pages = false;
};

class ShmConnection : public Connection {
 public:
  ShmConnection(int rank, int peer, int channel, ShmEndpoint ep);
  const TransportInfo& transport() const override;
  bool progress() override;
  bool relieve() override;
  void withdraw() override;
  bool can_single_copy() const override { return cma_ && !ep_.same_process; }
  // Whether copies are timed for the choice between FIFO and single copy (processes, adaptive): the
  // sender's into our FIFO to the peer, the receiver's out of the peer's (published for the peer).
  bool measuring_sends() const { return cma_ && !ep_.same_process && ep_.cma_adaptive; }
  bool measuring_receives() const { return ep_.in->cma_ok != 0 && !ep_.same_process && ep_.cma_adaptive; }
  void set_single_copy(uint64_t threshold, bool adaptive) override {
    ep_.cma_threshold = threshold;
    ep_.cma_adaptive = adaptive;
    for (SingleCopyChoice& c : choices_) {
      c.set_threshold(threshold);
      c.set_adaptive(adaptive);
    }
  }

 protected:
  // A single copy already announced reads the sender's buffer: it cannot move.
  bool can_own(const Op& op) const override { return !(op.started && op.aux != UINT64_MAX); }

 private:
  bool progress_send();
  bool progress_recv();
  // Both directions' measured costs of a class of messages, as both ends read them
  // (single_copy_choice.hpp).
  PairCosts pair_costs(int cost_class) const;
  bool pull_ahead();
  // Reads slot `index`'s header and checks its checksum.
  SlotHeader read_header(const unsigned char* slot) const;
  unsigned char* slot(FifoControl* f, uint64_t index) const;
  void copy_from_peer(unsigned char* dst, uint64_t src, size_t bytes);
  // Where this process can read a by-reference fragment in place, or nullptr (cross-process
  // kAddress: only process_vm_readv reaches it).
  const unsigned char* direct_source(const SlotHeader& h, const unsigned char* slot);
  // Takes a by-reference fragment into a receive (copy or reduce) and acknowledges it.
  void take_reference(const SlotHeader& h, const unsigned char* slot, const Op& op, unsigned char* to);

  ShmEndpoint ep_;
  bool cma_;
  // Between processes: FIFO or single copy for each message of 16 KiB or more, a choice per class
  // of messages (cost_class), and the receiver's measured costs of each class (published in ep_.in)
  // that the peer's choices read.
  std::vector<SingleCopyChoice> choices_;
  std::array<RateAverage, kCostClasses> recv_rate_, cma_rate_;
  size_t out_populated_ = 0, in_populated_ = 0;  // bytes of every FIFO slot mapped (populate() in shm.cpp)
  uint64_t head_ = 0, tail_seen_ = 0;  // sender side
  uint64_t tail_ = 0, head_seen_ = 0;  // receiver side
  uint64_t cma_posted_ = 0;
  size_t next_post_ = 0;  // index into sendq_ of the first message not fully posted
  struct Early {
    std::vector<unsigned char> bytes;
    CallStamp stamp;
  };
  std::deque<Early> early_;             // messages taken before their receive was posted
  std::vector<unsigned char> partial_;  // an early message still being assembled
  size_t partial_filled_ = 0;
  std::vector<unsigned char> bounce_;  // single-copy data for a reducing receive
  std::map<std::string, ShmSegment> mapped_;  // peers' segments seen in kSegment slots (kept mapped)
};

}  // namespace tutti
