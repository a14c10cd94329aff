#include "runtime/progress.hpp"

#include <poll.h>
#include <sched.h>

#include <chrono>

#include "core/clock.hpp"
#include "core/error.hpp"

namespace tutti {

ProgressEngine::ProgressEngine(std::shared_ptr<CommState> state, double timeout_s, int spin, bool yield_always)
    : state_(std::move(state)),
      timeout_s_(timeout_s),
      spin_(std::make_shared<std::atomic<int>>(spin)),
      yield_always_(yield_always) {}

void ProgressEngine::add(Connection* c) {
  connections_.push_back(c);
  // How a sleeping rank hears of this connection: poll() its descriptors, or the doorbell.
  if (c->transport().wait == WaitSource::kFd) has_fds_ = true;
  else has_doorbell_ = true;
}

bool ProgressEngine::progress() {
  bool moved = false;
  for (Connection* c : connections_) {
    if (!c->wants_progress()) continue;
    try {
      moved |= c->progress();
    } catch (const Error& e) {
      // A broken connection breaks the communicator: every later wait must fail too.
      state_->fail(e.kind(), e.what());
      throw;
    }
  }
  return moved;
}

void ProgressEngine::wait(FunctionRef<bool()> done, FunctionRef<std::string()> what) {
  run(
      [&](bool& finished) {
        finished = done();
        return false;
      },
      what);
}

std::unique_ptr<ProgressEngine> ProgressEngine::sibling(bool short_naps) const {
  auto e = std::make_unique<ProgressEngine>(state_, timeout_s_, 0, yield_always_);
  e->spin_ = spin_;
  e->short_naps_ = short_naps;
  return e;
}

void ProgressEngine::run(FunctionRef<bool(bool& done)> step, FunctionRef<std::string()> what,
                         FunctionRef<bool()> relieve) {
  // A failed, aborted or revoked communicator fails every call, also one whose data would flow
  // without a single wait (the checks below run only while waiting).
  if (state_->interrupted()) state_->check_data(what());
  bool done = false;
  uint64_t rounds = 0;
  // Poll while work flows and for spin_ microseconds after it stops, then sleep; poll again as soon
  // as a wake-up brings work. Time-based, so a rank does not fall asleep between two messages of one
  // exchange (each wake-up costs tens of us, more where the hypervisor parks an idle vCPU).
  using Clock = std::chrono::steady_clock;
  const int spin = spin_->load(std::memory_order_relaxed);
  Doorbell* bell = state_->doorbell();
  std::vector<pollfd> fds;
  DivergenceProbe probe(*state_);  // a wait that makes no progress asks whether the ranks diverged
  while (true) {
    auto spin_until = Clock::now() + std::chrono::microseconds(spin);
    // Whether anything moved in the rounds since the clock was last read: the window restarts from
    // any progress, not only from progress in the round that happens to read the clock. (Counting
    // only that round, a rank in a long transfer fell asleep after one window and then slept
    // whenever the next slot was a few microseconds late: 2000 sleeps a second in a 16 MiB
    // all-gather.)
    bool moved_lately = false;
    while (spin > 0) {
      bool moved = progress();
      moved |= step(done);
      if (done) return;
      moved_lately |= moved;
      if (yield_always_) sched_yield();
      if ((++rounds & 31) == 0) {
        // what() formats a description of every block: only for the error.
        if (state_->interrupted()) state_->check_data(what());
        // The peer we wait for may share this core (the scheduler does not always spread ranks):
        // let it run.
        sched_yield();
        auto now = Clock::now();
        if (moved_lately) spin_until = now + std::chrono::microseconds(spin);
        else if (now >= spin_until) break;
        moved_lately = false;
      }
      cpu_relax();
    }
    // Sleep until something moves; the timeout counts from the last progress.
    Deadline deadline = Deadline::after(timeout_s_);
    while (true) {
      // Announce the sleep before the last look at the connections (see doorbell.hpp).
      uint32_t seen = bell ? prepare_sleep(*bell) : 0;
      struct Finish {
        Doorbell* bell;
        ~Finish() {
          if (bell) finish_sleep(*bell);
        }
      } finish{bell};
      if (state_->interrupted()) state_->check_data(what());
      bool moved = progress();
      moved |= step(done);
      if (done) return;
      if (!moved) {
        for (Connection* c : connections_) moved |= c->relieve();
        if (relieve) moved |= relieve();
      }
      // Back to polling, unless the ranks outnumber the cores: then a poller takes turns from the
      // ranks that have work (it yields the core every round, and each turn is a context switch).
      probe.tick(moved);
      if (moved && !yield_always_) break;
      if (moved) {
        deadline = Deadline::after(timeout_s_);
        continue;
      }
      if (deadline.expired()) {
        // The wait-for dump: what this rank waits on (every block, step, peer and byte count), and
        // which peers still answer. Recorded as the communicator's failure, which tells the peers.
        std::string message = fmt::format("rank {}: timed out after {} s (TUTTI_TIMEOUT) {}", state_->rank(),
                                          timeout_s_, what());
        std::string alive = state_->diagnose();
        if (!alive.empty()) message += "; " + alive;
        state_->fail(ErrorKind::kTimeout, message);
        throw Timeout(message);
      }
      if (has_fds_) {
        fds.clear();
        fds.push_back({state_->event_fd(), POLLIN, 0});
        for (Connection* c : connections_) c->poll_fds(fds);
        // With doorbell peers too, nobody rings a poll(): keep the nap short.
        ::poll(fds.data(), fds.size(), deadline.ms_left(has_doorbell_ || short_naps_ ? 1 : 100));
      } else if (bell) {
        sleep_prepared(*bell, seen, deadline.ms_left(100));
      }
    }
  }
}
}  // namespace tutti
