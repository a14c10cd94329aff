#include "collectives/oneshot.hpp"

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace tutti {
namespace {


// Bytes each rank publishes (the same on every rank, so the choice agrees everywhere).
int64_t published_bytes(Collective c, int64_t count, int64_t esize, int n) {
  switch (c) {
    case Collective::kReduceScatter:
    case Collective::kAllToAll: return count * n * esize;
    default: return count * esize;
  }
}

// Every rank publishes what it was called with ahead of its data, so mismatched calls (another
// collective, count, type, op or root) are caught on every call at the cost of 16 bytes in the
// same cache line, not only with TUTTI_CHECK's extra round trip.
struct CallHeader {
  uint8_t collective, type, op, unused;
  int32_t root;
  int64_t count;
};
static_assert(sizeof(CallHeader) == kOneshotHeaderBytes);
constexpr size_t kHeader = kOneshotHeaderBytes;
static_assert(kHeader == Mailbox::kStampBytes, "the call header is the mailbox's stamp");

// Bytes this rank publishes. Broadcast: only the root has something to say; the others publish
// their stamp, which the root checks later. Reduce: the root publishes its stamp only.
uint64_t own_bytes(Collective c, int64_t count, int64_t esize, int n, int rank, int root) {
  const bool publishes = c == Collective::kBroadcast ? rank == root : c != Collective::kReduce || rank != root;
  return publishes ? static_cast<uint64_t>(published_bytes(c, count, esize, n)) : 0;
}

// Which of the mailbox's rings a call takes: the deep one for calls whose senders wait for nobody
// (a broadcast's root, a reduce's senders), so that they may run ahead. A function of what the
// stamps agree on, so every rank chooses alike.
bool deep(const Mailbox& mb, Collective c, int64_t count, int64_t esize) {
  const bool runs_ahead = c == Collective::kBroadcast || c == Collective::kReduce;
  return mb.deep(static_cast<uint64_t>(published_bytes(c, count, esize, mb.size())), runs_ahead);
}

CallHeader header_of(Collective c, int64_t count, const Reduction& red, int root) {
  CallHeader h{};
  h.collective = static_cast<uint8_t>(c);
  h.type = static_cast<uint8_t>(red.type);
  h.op = reduces(c) ? static_cast<uint8_t>(red.op) : 0;
  h.root = c == Collective::kReduce || c == Collective::kBroadcast ? root : 0;
  h.count = count;
  return h;
}

std::string describe(const CallHeader& h) {
  const auto c = static_cast<Collective>(h.collective);
  std::string s = fmt::format("{} of {} {}", to_string(c), h.count, name(static_cast<DataType>(h.type)));
  if (reduces(c)) s += fmt::format(" ({})", name(static_cast<RedOp>(h.op)));
  if (c == Collective::kReduce || c == Collective::kBroadcast) s += fmt::format(" to root {}", h.root);
  return s;
}

std::string describe_stamp(const unsigned char* stamp) {
  CallHeader h;
  std::memcpy(&h, stamp, kHeader);
  return describe(h);
}

// Whom this rank reads in the call, and who reads this rank's record.
Mailbox::Call flow_of(Collective c, int rank, int root) {
  Mailbox::Call f;
  f.what = to_string(c);
  f.describe = describe_stamp;
  if (c == Collective::kBroadcast) {
    f.reads = rank == root ? Mailbox::kNobody : root;
    f.read_by = rank == root ? Mailbox::kEvery : Mailbox::kNobody;
  } else if (c == Collective::kReduce) {
    f.reads = rank == root ? Mailbox::kEvery : Mailbox::kNobody;
    f.read_by = rank == root ? Mailbox::kNobody : root;
  }
  return f;
}

}  // namespace

bool oneshot_fits(const Mailbox& mailbox, Collective c, int64_t count, int64_t esize) {
  switch (c) {
    case Collective::kAllReduce:
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kBroadcast:
    case Collective::kReduce:
    case Collective::kAllToAll: break;
    default: return false;
  }
  return count >= 0 && static_cast<uint64_t>(published_bytes(c, count, esize, mailbox.size())) + kHeader <= mailbox.capacity();
}

bool oneshot_has_room(Mailbox& mailbox, Collective c, int64_t count, int64_t esize) {
  return mailbox.has_room(deep(mailbox, c, count, esize));
}

bool start_oneshot(Mailbox& mb, Collective c, const void* input, int64_t count, const Reduction& red, int root) {
  const int n = mb.size(), rank = mb.rank();
  const int64_t esize = static_cast<int64_t>(size_of(red.type));
  TUTTI_CHECK(oneshot_fits(mb, c, count, esize), InvalidArgument,
              "rank {}: {} of {} elements does not fit the one-shot mailbox ({} bytes)", rank, to_string(c), count,
              mb.capacity());
  const size_t bytes = own_bytes(c, count, esize, n, rank, root);
  const CallHeader h = header_of(c, count, red, root);
  unsigned char* data = mb.open(to_string(c), deep(mb, c, count, esize));  // waits for room where this rank is far ahead
  if (c == Collective::kAllToAll || c == Collective::kReduceScatter) {
    // Peer r reads piece r; our own piece is read from the input (finish_oneshot), so it stays out.
    const size_t piece = static_cast<size_t>(count * esize), own = static_cast<size_t>(rank) * piece;
    const auto* in = static_cast<const unsigned char*>(input);
    if (own) std::memcpy(data, in, own);
    if (own + piece < bytes) std::memcpy(data + own + piece, in + own + piece, bytes - own - piece);
  } else if (bytes) {
    std::memcpy(data, input, bytes);
  }
  const Mailbox::Call f = flow_of(c, rank, root);
  mb.publish(reinterpret_cast<const unsigned char*>(&h), f.what, f.reads, f.read_by, f.describe);
  return mb.arrived();
}

void run_oneshot(Mailbox& mb, Collective c, const void* input, void* output, int64_t count, const Reduction& red,
                 int root) {
  start_oneshot(mb, c, input, count, red, root);
  finish_oneshot(mb, c, input, output, count, red, root);
}

void finish_oneshot(Mailbox& mb, Collective c, const void* input, void* output, int64_t count, const Reduction& red,
                    int root) {
  const int n = mb.size(), rank = mb.rank();
  const int64_t esize = static_cast<int64_t>(size_of(red.type));
  const size_t piece = static_cast<size_t>(count * esize);
  const auto* in = static_cast<const unsigned char*>(input);
  auto* out = static_cast<unsigned char*>(output);
  mb.wait();  // checks every stamp it reads against this rank's call
  // Own contributions are read from the user's input, which is still intact: in-place calls write
  // their output only below, and combine_n allows dst to alias a source exactly.
  auto from = [&](int r) { return r == rank ? in : mb.data(r); };
  auto reduce_at = [&](unsigned char* dst, size_t offset) {
    if (n == 2) {
      combine(red.op, red.type, dst, from(0) + offset, from(1) + offset, static_cast<size_t>(count));
      return;
    }
    thread_local std::vector<const void*> srcs;  // no allocation per call
    srcs.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) srcs[static_cast<size_t>(r)] = from(r) + offset;
    combine_n(red.op, red.type, dst, srcs, static_cast<size_t>(count));
  };
  if (count > 0) switch (c) {
      case Collective::kAllReduce: reduce_at(out, 0); break;
      case Collective::kReduce:
        if (rank == root) reduce_at(out, 0);
        break;
      case Collective::kReduceScatter: reduce_at(out, static_cast<size_t>(rank) * piece); break;
      case Collective::kBroadcast:
        if (out != from(root)) std::memcpy(out, from(root), piece);
        break;
      case Collective::kAllGather:
        for (int r = 0; r < n; ++r) {
          unsigned char* dst = out + static_cast<size_t>(r) * piece;
          if (dst != from(r)) std::memcpy(dst, from(r), piece);
        }
        break;
      case Collective::kAllToAll:
        // In place, out == in: the own piece stays; peers' pieces come from their outboxes, and our
        // other pieces are no longer needed here (peers read our outbox).
        for (int r = 0; r < n; ++r) {
          unsigned char* dst = out + static_cast<size_t>(r) * piece;
          const unsigned char* src = from(r) + static_cast<size_t>(rank) * piece;
          if (dst != src) std::memcpy(dst, src, piece);
        }
        break;
      default: throw InternalError(fmt::format("one-shot {}", to_string(c)));
    }
  mb.complete();  // the records read here may now be reused; throws a mismatch found in an earlier call
}

}  // namespace tutti
