#pragma once
// One-shot collectives over the mailbox (runtime/mailbox.hpp), for small messages when every rank
// of the communicator is on this host. Each rank publishes its whole input once and reads what it
// needs of every peer's: the data movement of the all-pairs plans (allpairs_allreduce and friends),
// without the plan interpreter, whose bookkeeping is most of the time of an 8-byte call.
//
// Who waits for whom follows the data: a broadcast's receivers wait for the root only and the root
// for nobody; a reduce's root waits for every rank and the others for nobody. So a loop of small
// broadcasts or reduces runs as a pipeline (up to Mailbox::depth() calls deep), as MPI's eager
// sends do, instead of in lock step.
//
// Reductions fold the contributions in rank order 0, 1, ..., n-1 on every rank, so every rank gets
// the same bits whatever the type and op. avg and premulsum are handled by the caller as for plans
// (the input is pre-scaled, the output divided): here they combine as sum.

#include <cstdint>

#include "core/reduce.hpp"
#include "tutti/collective.hpp"
#include "runtime/mailbox.hpp"

namespace tutti {

// Whether a call of `collective` with NCCL's `count` of `esize`-byte elements fits the mailbox.
// Bytes of every record the call itself takes (the mailbox's stamp): the collective, datatype, op,
// root and count each rank was called with, compared by every rank with its own (mismatches fail
// on every rank: in the call where it reads the other rank, else at a later call; mailbox.hpp).
inline constexpr size_t kOneshotHeaderBytes = 16;
bool oneshot_fits(const Mailbox& mailbox, Collective collective, int64_t count, int64_t esize);

// Whether this rank's part of such a call can start without waiting for the ranks that read it
// (its outbox is not full).
bool oneshot_has_room(Mailbox& mailbox, Collective collective, int64_t count, int64_t esize);

// Runs one call. input/output follow NCCL (in-place allowed exactly as NCCL defines it); output of
// a reduce's non-roots is not written. Collective: every rank calls it for the same call.
void run_oneshot(Mailbox& mailbox, Collective collective, const void* input, void* output, int64_t count,
                 const Reduction& reduction, int root);
// The same in two halves for callers that must not block (non-blocking communicators): start
// publishes this rank's contribution and returns whether every peer's is there too; finish waits
// for them (if it must) and writes the output. Between the two, the mailbox must not be used.
bool start_oneshot(Mailbox& mailbox, Collective collective, const void* input, int64_t count, const Reduction& reduction,
                   int root);
void finish_oneshot(Mailbox& mailbox, Collective collective, const void* input, void* output, int64_t count,
                    const Reduction& reduction, int root);

}  // namespace tutti
