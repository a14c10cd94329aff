#pragma once
// The progress engine of one rank: it advances every connection of the communicator and turns
// non-blocking tickets into blocking waits. A wait polls for TUTTI_SPIN microseconds after the last
// progress, then sleeps: on the
// rank's doorbell futex when only shared-memory peers are involved, in poll() when TCP sockets are.
// Every wait checks the abort flag and the communicator's error state each round and fails with
// Timeout after TUTTI_TIMEOUT seconds, naming what it waited for.

#include <atomic>
#include <functional>

#include "core/function_ref.hpp"
#include <memory>
#include <string>
#include <vector>

#include "runtime/comm_state.hpp"
#include "runtime/transport/connection.hpp"

namespace tutti {

class ProgressEngine {
 public:
  ProgressEngine(std::shared_ptr<CommState> state, double timeout_s, int spin_us, bool yield_always = false);
  void add(Connection* c);
  // Advances all connections once; true if anything moved. A transport error fails the communicator.
  bool progress();
  // Blocks until done() is true. `what` is called only to build an error message.
  void wait(FunctionRef<bool()> done, FunctionRef<std::string()> what);
  // Drives a state machine: step() advances it (after the connections moved) and returns whether it
  // made progress, setting `done` when finished. Sleeps only when neither moved.
  // `relieve`, when given, is called (like Connection::relieve) when nothing moved and the engine is
  // about to sleep; it returns whether it freed anything.
  void run(FunctionRef<bool(bool& done)> step, FunctionRef<std::string()> what, FunctionRef<bool()> relieve = {});
  // An engine with the same settings and no connections, for a worker thread that drives a subset
  // of the connections. `short_naps`: another thread may unblock this one without ringing a
  // socket, so a poll() sleep is kept short.
  std::unique_ptr<ProgressEngine> sibling(bool short_naps) const;
  // The polling window after the last progress, for this engine and its siblings (the calibration's
  // choice replaces TUTTI_SPIN's default once the communicator is made).
  void set_spin(int us) { spin_->store(us, std::memory_order_relaxed); }
  int spin() const { return spin_->load(std::memory_order_relaxed); }

 private:
  std::shared_ptr<CommState> state_;
  double timeout_s_;
  std::shared_ptr<std::atomic<int>> spin_;  // shared with siblings
  bool yield_always_;
  std::vector<Connection*> connections_;
  bool has_doorbell_ = false, has_fds_ = false;  // what the connections wait on (WaitSource)
  bool short_naps_ = false;
};

}  // namespace tutti
