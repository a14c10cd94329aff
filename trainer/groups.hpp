#pragma once
// Process groups carved from the world, in one documented order: tensor parallel innermost, then
// data parallel, then pipeline parallel outermost (Megatron-LM's order; context and expert parallel
// will slot in as tp-cp-ep-dp-pp, each dimension outside the previous ones):
//
//   world rank w = tp_rank + tp * (dp_rank + dp * pp_rank)
//   tp group of w: the tp ranks with w's dp_rank and pp_rank   (consecutive world ranks: one host's GPUs)
//   dp group of w: the dp ranks with w's tp_rank and pp_rank   (stride tp)
//   pp group of w: the pp ranks with w's tp_rank and dp_rank   (stride tp * dp)
//   embedding group: the first and last pp ranks of w's pp group (the tied embedding's gradient)
//   ep group of w: the ep consecutive dp ranks around w's (dp_rank = ep_rank + ep * edp_rank): they
//     split the experts; edp group: the dp ranks holding w's experts (stride tp * ep)
// Between neighbouring pp ranks each direction has a two-rank communicator of its own (Pipe), so a
// send to one neighbour never waits behind a receive from the other.
//
// Collectives wraps a group's tutti::Comm for the trainer's blocking and asynchronous calls on float
// buffers and counts the time spent waiting for them.

#include <cstdint>
#include <optional>
#include <vector>

#include "trainer/config.hpp"
#include "trainer/ops.hpp"
#include "tutti/tutti.hpp"

namespace tutti::train {

struct Coordinates {
  int tp_rank = 0, dp_rank = 0, pp_rank = 0;
  int ep_rank = 0, edp_rank = 0;  // dp_rank = ep_rank + ep * edp_rank
};
// The rank -> group table of a layout (checked by tests; also printed by tutti-train --verbose).
Coordinates coordinates_of(const Layout& layout, int world_rank);
int world_rank_of(const Layout& layout, Coordinates c);

class Collectives {
 public:
  Collectives() = default;  // a group of one: every call is a no-op (or a copy)
  explicit Collectives(tutti::Comm comm) : comm_(std::move(comm)) {}
  int size() const { return comm_ && comm_->valid() ? comm_->size() : 1; }
  int rank() const { return comm_ && comm_->valid() ? comm_->rank() : 0; }

  // Blocking, in place.
  void all_reduce(float* data, int64_t n, RedOp op = RedOp::kSum);
  // in: n floats per rank; out: size() * n in rank order.
  void all_gather(const float* in, float* out, int64_t n);
  // in: size() * n floats; out: this rank's n (the sum over ranks of its block).
  void reduce_scatter(const float* in, float* out, int64_t n, RedOp op = RedOp::kSum);

  // One double over the group (losses and norms), blocking.
  double all_reduce_value(double v, RedOp op = RedOp::kSum);

  // Asynchronous forms: the buffers are the caller's until wait() of the returned Work.
  tutti::Work all_reduce_async(float* data, int64_t n, RedOp op);
  tutti::Work reduce_scatter_async(const float* in, float* out, int64_t n, RedOp op);
  tutti::Work all_gather_async(const float* in, float* out, int64_t n);
  void wait(tutti::Work& work);  // counts the time it blocks

  double wait_seconds() const { return wait_s_; }
  // Buffers in `ops`'s memory when it is not the host's (the C++ API takes host buffers): calls go
  // through host copies, and the asynchronous forms complete before they return. Correct first;
  // device buffers in the C++ API are the fast path to come.
  void stage_through_host(Ops* ops) { stage_ = ops; }
  // The group's communicator (null for a group of one): for the fused operations (tutti/fused.hpp).
  tutti::Comm* comm() { return comm_ && comm_->valid() ? &*comm_ : nullptr; }

 private:
  // Runs `call` on host copies of [in, in + n_in) and [out, out + n_out) when staging.
  void copy(const float* in, float* out, int64_t n);  // in the buffers' memory
  template <class F>
  void staged(const float* in, int64_t n_in, float* out, int64_t n_out, F call);
  std::optional<tutti::Comm> comm_;
  Ops* stage_ = nullptr;
  double wait_s_ = 0;
};

// Point-to-point between neighbouring pipeline ranks: to[b] carries this rank's messages to pp rank b
// (this rank is its rank 0, b its rank 1), from[a] those of pp rank a to this one.
struct Pipe {
  std::vector<std::optional<tutti::Comm>> to, from;
  tutti::Work send(const float* data, int64_t n, int peer);  // asynchronous: data is the caller's until done
  void recv(float* data, int64_t n, int peer);               // blocking; counts the time it waits
  void wait(tutti::Work& work);                               // a send's, counted too
  double wait_seconds = 0;
};

// This rank's groups, made collectively from the world communicator (every rank calls it).
struct Groups {
  Layout layout;
  Coordinates at;
  Collectives tp, dp, pp, embedding, ep, edp;
  Pipe pipe;
  static Groups make(tutti::Comm& world, const Layout& layout);
  // For a single rank without a communicator.
  static Groups single(const Layout& layout);
};

}  // namespace tutti::train
