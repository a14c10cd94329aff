#include "collectives/oneshot.hpp"

#include <cstring>
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
  return count >= 0 && static_cast<uint64_t>(published_bytes(c, count, esize, mailbox.size())) <= mailbox.capacity();
}

bool start_oneshot(Mailbox& mb, Collective c, const void* input, int64_t count, const Reduction& red, int root) {
  const int n = mb.size(), rank = mb.rank();
  const int64_t esize = static_cast<int64_t>(size_of(red.type));
  TUTTI_CHECK(oneshot_fits(mb, c, count, esize), InvalidArgument,
              "rank {}: {} of {} elements does not fit the one-shot mailbox ({} bytes)", rank, to_string(c), count,
              mb.capacity());
  // Broadcast: only the root has something to say; the others publish to keep the calls in step.
  const bool publishes = c != Collective::kBroadcast || rank == root;
  const size_t bytes = publishes ? static_cast<size_t>(published_bytes(c, count, esize, n)) : 0;
  if (bytes) std::memcpy(mb.outbox(), input, bytes);
  mb.publish(to_string(c));
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
  mb.wait(to_string(c));
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
  if (count == 0) return;
  switch (c) {
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
}

}  // namespace tutti
