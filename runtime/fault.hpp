#pragma once
// Fault injection (TUTTI_FAULT): failures made on purpose, at a chosen rank, call and step, so
// tests can show that each ends in an error on every rank within a bound, never in a hang or in
// wrong data reported as success. docs/RELIABILITY.md has the measured outcomes.
//
//   TUTTI_FAULT=KIND[:rank=R][:call=N][:step=S][:peer=P][:seconds=X][,KIND...]
//
// A fault fires on rank R (default 0) of a communicator at its N-th collective call (1-based,
// default 1; the calls every dispatcher path counts: plans, one-shot calls, custom plans), before
// the S-th instruction that rank starts in that call (default 0: before the call does anything;
// one-shot calls have no later step). Every communicator the process makes with the variable set
// carries the faults (split ones too), each counting its own calls. KIND is one of:
//   kill     SIGKILL this process (a crash: no goodbye, no abort notice)
//   stop     SIGSTOP this process; peers must report it after TUTTI_TIMEOUT (SIGCONT resumes it)
//   delay    sleep `seconds` (default 1): slowness, which must not be mistaken for failure
//   close    cut this rank's links to `peer` (default: every peer) as a crash of the link would:
//            the bootstrap connection without goodbye, and the TCP sockets; this rank fails too
//   drop     from now on, messages to `peer` (default: every peer) are sent into the void: sends
//            complete, nothing arrives (a black hole; the peer times out)
//   corrupt  flip one bit of the header of the next message to `peer` (default: every peer), after
//            its checksum is computed: the receiver must reject it (one-shot calls: the call header)

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tutti {

class Communicator;

enum class FaultKind { kKill, kStop, kDelay, kClose, kDrop, kCorrupt };

struct FaultSpec {
  FaultKind kind = FaultKind::kKill;
  int rank = 0;
  int64_t call = 1;
  int64_t step = 0;
  int peer = -1;  // -1: every peer
  double seconds = 1;
};

// Parses TUTTI_FAULT's syntax; throws InvalidArgument naming the part that is wrong.
std::vector<FaultSpec> parse_faults(const std::string& text);
std::string to_string(FaultKind kind);

// The faults of one rank of one communicator. The executor and dispatcher call it only when the
// communicator has one (Communicator::faults() is null otherwise), so it costs nothing unset.
class FaultInjector {
 public:
  // Null when no fault is meant for `rank`.
  static std::unique_ptr<FaultInjector> make(const std::vector<FaultSpec>& specs, int rank);
  // A collective call begins: counts it and fires its step-0 faults.
  void begin_call(Communicator& comm);
  // The call's `step`-th instruction (1-based) is about to start on this rank. Thread-safe (the
  // executor's workers start instructions concurrently).
  void at_step(Communicator& comm, int64_t step);

 private:
  void fire(Communicator& comm, const FaultSpec& f);
  std::vector<FaultSpec> specs_;
  std::mutex mutex_;  // at_step() comes from every worker of the rank
  std::vector<bool> fired_;
  int64_t calls_ = 0;
};

}  // namespace tutti
