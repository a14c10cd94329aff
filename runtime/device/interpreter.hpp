#pragma once
// The device plan interpreter: one team of threads runs one plan block, step by step, over the
// rounds of a call. Compiled by nvcc for the CUDA kernel (runtime/cuda/cuda_backend.cu, a team is
// a thread block) and by the host compiler for the emulated device (runtime/device/emulated.cpp,
// a team is one CPU thread), so CI without a GPU runs the logic the GPU runs.
//
// Rounds. A FIFO slot holds one message, and the verifier proved the plan deadlock-free for FIFOs
// of `depth` messages, so every transfer of a step must fit one slot. A call is therefore cut into
// rounds: round k runs the whole plan on elements [k*R, (k+1)*R) of every piece of every buffer
// (input, output and scratch alike), with chunk geometry computed on that sub-range. NCCL's
// collectives are position-wise within pieces, so the rounds together are the call; user buffers
// and scratch regions of different rounds are disjoint, so rounds need no ordering beyond the
// FIFOs' own. R is chosen on the host so that the largest message of the plan fits a slot.
// Plans with state buffers (fused operations) run in one round, R = the whole call (abi.hpp, "One
// pass"): their statistics and norms are not position-wise; their compute steps run the device
// forms of their kernels (kernels.hpp) over whole chunks.
//
// Element semantics are core/element.hpp's, the ones the CPU executor uses; an n-ary reduce folds
// left to right and the received operand comes first (as the CPU transports' recv_reduce).

#include <cstdint>

#include "core/element.hpp"
#include "runtime/device/abi.hpp"
#include "runtime/device/fifo.hpp"
#include "runtime/device/kernels.hpp"
#include "plan/semantics.hpp"

namespace tutti::device {

using mem::Pack16;

#if defined(__CUDA_ARCH__)
struct Team {
  __device__ int rank() const { return static_cast<int>(threadIdx.x); }
  __device__ int size() const { return static_cast<int>(blockDim.x); }
  __device__ void sync() const { __syncthreads(); }
  __device__ bool sync_or(bool p) const { return __syncthreads_or(p) != 0; }
  // The sum of every thread's v, on every thread: warps first, then the warps' sums in warp order
  // (a fixed order, so the same inputs give the same double). Every thread must call it.
  __device__ double sum(double v) const {
    __shared__ double part[32];
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
    __syncthreads();  // an earlier sum may still read part[]
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      double t = 0;
      for (int w = 0; w < (static_cast<int>(blockDim.x) + 31) / 32; ++w) t += part[w];
      part[0] = t;
    }
    __syncthreads();
    return part[0];
  }
  // Scratch the block's threads share (the GEMM's tiles): one array per block, for one kernel at a
  // time (a kernel syncs the team before it returns).
  __device__ float* scratch() const {
    __shared__ float tiles[kGemmScratchFloats];
    return tiles;
  }
};
#else
struct Team {
  int rank() const { return 0; }
  int size() const { return 1; }
  void sync() const {}
  bool sync_or(bool p) const { return p; }
  double sum(double v) const { return v; }
  float* scratch() const {
    thread_local float tiles[kGemmScratchFloats];
    return tiles;
  }
};
#endif

// --- element types ------------------------------------------------------------------------------

template <class T>
struct NativeElem {
  using Bits = T;
  static TUTTI_HD Bits apply(int op, Bits a, Bits b) {
    switch (op) {
      case 1: return element::op_prod(a, b);
      case 2: return element::op_max(a, b);
      case 3: return element::op_min(a, b);
      default: return element::op_sum(a, b);  // sum, avg and premulsum combine as sum
    }
  }
  static TUTTI_HD Bits scale(Bits a, double s) { return element::op_prod(a, static_cast<T>(s)); }
};

template <class F>
struct MiniElem {
  using Bits = typename F::Bits;
  static TUTTI_HD Bits apply(int op, Bits a, Bits b) {
    return F::store(NativeElem<float>::apply(op, F::load(a), F::load(b)));
  }
  static TUTTI_HD Bits scale(Bits a, double s) { return F::store(F::load(a) * F::load(F::store(static_cast<float>(s)))); }
};

template <class E>
TUTTI_HD Pack16 combine(int op, Pack16 a, Pack16 b) {
  using Bits = typename E::Bits;
  constexpr int n = 16 / sizeof(Bits);
  Bits x[n], y[n];
  memcpy(x, &a, 16);
  memcpy(y, &b, 16);
  TUTTI_UNROLL
  for (int i = 0; i < n; ++i) x[i] = E::apply(op, x[i], y[i]);
  memcpy(&a, x, 16);
  return a;
}

template <class E>
TUTTI_HD Pack16 scale_pack(Pack16 a, double s) {
  using Bits = typename E::Bits;
  constexpr int n = 16 / sizeof(Bits);
  Bits x[n];
  memcpy(x, &a, 16);
  TUTTI_UNROLL
  for (int i = 0; i < n; ++i) x[i] = E::scale(x[i], s);
  memcpy(&a, x, 16);
  return a;
}

// --- one call's view of the plan ----------------------------------------------------------------

struct Round {
  int64_t begin = 0;  // first element of each piece in this round
  int64_t elems = 0;  // elements of each piece in this round
};

// Where chunk `index` of a canonical buffer starting at `base` lies in round `r`, and how many
// bytes it has. Every rank of a call has the same geometry, so this also places a peer's chunks.
TUTTI_HD unsigned char* chunk_in(unsigned char* base, const LaunchArgs& a, const Round& r, int64_t index, int64_t* bytes) {
  const int64_t C = a.chunk_factor;
  const int64_t piece = index / C, k = index % C;
  const int64_t b = (k * r.elems) / C, e = ((k + 1) * r.elems) / C;
  *bytes = (e - b) * a.esize;
  return base + (piece * a.count + r.begin + b) * a.esize;
}
// Buffers of the call's unit (input, output, scratch, state buffers of unit 0) have the call's
// geometry; a state buffer of unit u has u elements per chunk (a plan with one runs in one pass, so
// `r` is the whole call).
TUTTI_HD unsigned char* chunk_at(const LaunchArgs& a, const Round& r, uint8_t buf, int64_t index, int64_t* bytes) {
  if (buf >= kBufState) {
    const DevState& st = a.states[buf - kBufState];
    if (st.unit > 0) {
      *bytes = st.unit * a.esize;
      return st.base + index * st.unit * a.esize;
    }
    return chunk_in(st.base, a, r, index, bytes);
  }
  return chunk_in(a.bufs[buf], a, r, index, bytes);
}

// The elements of chunks [index, index + count) of a buffer, which are contiguous in one pass.
TUTTI_HD unsigned char* range_at(const LaunchArgs& a, const Round& r, const DevRef& ref, int64_t count, int64_t* elems) {
  int64_t first = 0, last = 0;
  unsigned char* begin = chunk_at(a, r, ref.buf, ref.index, &first);
  unsigned char* end = chunk_at(a, r, ref.buf, ref.index + count - 1, &last) + last;
  *elems = (end - begin) / a.esize;
  return begin;
}

// Whether this send lets the peer read its source in place (abi.hpp, "Direct reads").
TUTTI_HD bool sends_direct(const LaunchArgs& a, const DevStep& s, const FifoView* out) {
  if (!out || !out->direct || !s.stable_src || a.protocol != kProtoSimple || s.nsrcs != 1) return false;
  const uint8_t buf = a.srcs[s.first_src].buf;
  return buf < 32 && ((a.registered >> buf) & 1u) != 0;
}

TUTTI_HD Pack16 load_local(const unsigned char* p, int64_t u, int64_t valid) {
  Pack16 v{{0, 0}};
  const unsigned char* q = p + u * 16;
  if (valid >= 16 && (reinterpret_cast<uintptr_t>(q) & 15) == 0) return *reinterpret_cast<const Pack16*>(q);
  memcpy(&v, q, valid < 16 ? static_cast<size_t>(valid) : 16);
  return v;
}

TUTTI_HD void store_local(unsigned char* p, int64_t u, int64_t valid, Pack16 v) {
  unsigned char* q = p + u * 16;
  if (valid >= 16 && (reinterpret_cast<uintptr_t>(q) & 15) == 0) {
    *reinterpret_cast<Pack16*>(q) = v;
    return;
  }
  memcpy(q, &v, valid < 16 ? static_cast<size_t>(valid) : 16);
}

// Gives up a wait: abort, timeout, or another block's failure. Records the first cause.
struct WaitSite {
  int32_t block, step, peer;
  int64_t round;
  int32_t waits_for_block = -1;
};

TUTTI_HD bool keep_waiting(const LaunchArgs& a, const WaitSite& site, uint64_t& since) {
  if (mem::load_volatile(&a.status->failed) != 0) return false;
  int32_t cause = 0;
  if (a.abort) {
    const int32_t stop = mem::load_volatile(a.abort);
    cause = stop == 0 ? 0 : stop == kStopFailed ? kCommFailed : 1;
  }
  uint64_t now = mem::now_ns();
  if (since == 0) since = now;
  if (!cause && a.timeout_ns && now - since > a.timeout_ns) cause = 2;
  if (!cause) return true;
  if (mem::claim(&a.status->failed, cause)) {  // the host reads the site after the launch ends
    a.status->block = site.block;
    a.status->step = site.step;
    a.status->peer = site.peer;
    a.status->waits_for_block = site.waits_for_block;
    a.status->round = site.round;
  }
  return false;
}

// Thread 0's wait for *p >= target.
TUTTI_HD bool wait_ge(const LaunchArgs& a, const uint64_t* p, uint64_t target, const WaitSite& site) {
  uint64_t since = 0;
  int spins = 0;
  for (;;) {
    uint64_t v = mem::load_acquire(p);
    if (v >= target) return true;
    if (++spins % mem::kSpinsPerCheck == 0 && !keep_waiting(a, site, since)) return false;
    mem::pause(p, static_cast<uint32_t>(v), spins);
  }
}

// Thread 0 of a receiver: the stamp of message `seq` on `in` (its descriptor in Simple, its header
// line in LL, which it waits for) against this rank's call. False when the wait gave up or the
// message is another call's (Status::failed = kStampMismatch, naming the sender and its stamp).
TUTTI_HD bool stamp_matches(const LaunchArgs& a, const FifoView* in, uint64_t seq, const unsigned char* rslot,
                            const WaitSite& site) {
  uint64_t stamp = 0;
  if (a.protocol == kProtoLL) {
    uint64_t since = 0;
    int spins = 0;
    while (!mem::ll_load(rslot, static_cast<uint32_t>(seq), &stamp)) {
      if (++spins % mem::kSpinsPerCheck == 0 && !keep_waiting(a, site, since)) return false;
      mem::pause_word(rslot + 12, spins);
    }
  } else {
    stamp = mem::load_acquire(in->desc + ((seq - 1) % static_cast<uint64_t>(a.depth)) * kDescWords + kDescStamp);
  }
  if (stamp == a.stamp) return true;
  if (mem::claim(&a.status->failed, kStampMismatch)) {
    a.status->block = site.block;
    a.status->step = site.step;
    a.status->peer = in->peer;
    a.status->waits_for_block = -1;
    a.status->round = site.round;
    a.status->slot = 0;
    a.status->value = static_cast<int64_t>(stamp);
  }
  return false;
}

// --- the block interpreter ---------------------------------------------------------------------

template <class E>
struct BlockRun {
  const LaunchArgs& a;
  Team team;
  int32_t block;     // plan block
  int32_t instance;  // which copy of the plan: rounds instance, instance + instances, ...

  // The scale kernel's factor: a constant, or the call's value of its per-call scalar.
  TUTTI_HD double factor(const DevStep& s) const {
    if (s.nscalars == 0) return s.kernel_arg;
    const DevScalar sc = a.scalar_refs[s.first_scalar];
    return sc.slot >= 0 ? a.scalars[sc.slot] : sc.value;
  }

  // The Simple protocol's main loop: full 16-byte units of 16-byte aligned operands, four per
  // thread at a time with every load issued before the first use, so each warp keeps several
  // memory requests in flight. Returns how many units (from the first) it moved; the caller's
  // plain loop does the rest.
  static constexpr int kUnroll = 4;
  TUTTI_HD int64_t bulk(const DevStep& s, int64_t c, const Round& r, int nlocal, int64_t bytes, unsigned char* dst,
                        const unsigned char* src0, const unsigned char* rslot, unsigned char* sslot) {
    auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
    if ((dst && !aligned(dst)) || (src0 && !aligned(src0)) || (rslot && !aligned(rslot))) return 0;
    const unsigned char* more[3] = {nullptr, nullptr, nullptr};  // further local sources (reduce)
    const int first_more = rslot ? 0 : 1;                         // srcs[0] is acc's start when nothing arrives
    const int nmore = nlocal - first_more;
    if (nmore > 3) return 0;
    for (int k = 0; k < nmore; ++k) {
      int64_t nb = 0;
      const int idx = first_more + k;
      more[k] = idx == 0 ? src0 : chunk_at(a, r, a.srcs[s.first_src + idx].buf, a.srcs[s.first_src + idx].index + c, &nb);
      if (!aligned(more[k])) return 0;
    }
    if (!rslot && nlocal == 0) return 0;
    const int64_t T = team.size();
    const int64_t groups = (bytes / 16) / (kUnroll * T);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = g * kUnroll * T + team.rank();
      Pack16 acc[kUnroll], x[kUnroll];
      TUTTI_UNROLL
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t at = (base + j * T) * 16;
        acc[j] = rslot ? mem::load_slot(rslot + at) : *reinterpret_cast<const Pack16*>(src0 + at);
      }
      for (int k = 0; k < nmore; ++k) {
        TUTTI_UNROLL
        for (int j = 0; j < kUnroll; ++j) x[j] = *reinterpret_cast<const Pack16*>(more[k] + (base + j * T) * 16);
        TUTTI_UNROLL
        for (int j = 0; j < kUnroll; ++j) acc[j] = combine<E>(a.op, acc[j], x[j]);
      }
      if (s.op == plan::Opcode::kCompute && s.kernel == 1) {
        const double f = factor(s);
        TUTTI_UNROLL
        for (int j = 0; j < kUnroll; ++j) acc[j] = scale_pack<E>(acc[j], f);
      }
      TUTTI_UNROLL
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t at = (base + j * T) * 16;
        if (dst) *reinterpret_cast<Pack16*>(dst + at) = acc[j];
        if (sslot) mem::store_slot(sslot + at, acc[j]);
      }
    }
    return groups * kUnroll * T;
  }

  // A kernel of the fused operations (kernels.hpp) over its operands' ranges; `s.kernel` >= 2.
  // Operands: sources, then dst and the further outputs (check_operands fixed their shapes).
  // False (on every thread) when the kernel met a value out of range: Status::failed = kBadIndex.
  TUTTI_HD bool kernel_step(const DevStep& s, int32_t index, const Round& r, int64_t round_no) {
    double scalars[kMaxScalars];
    for (int32_t k = 0; k < s.nscalars && k < kMaxScalars; ++k) {
      const DevScalar sc = a.scalar_refs[s.first_scalar + k];
      scalars[k] = sc.slot >= 0 ? a.scalars[sc.slot] : sc.value;
    }
    int64_t n = 0, ignored = 0;
    auto in = [&](int k, int64_t* elems = nullptr) {
      return reinterpret_cast<const float*>(
          range_at(a, r, a.srcs[s.first_src + k], k == 0 ? s.count : 1, k == 0 ? &n : elems ? elems : &ignored));
    };
    // Where input 0 starts in its buffer, in elements (kernels that depend on positions), as the
    // CPU executor counts it; kernels run in one pass, so the round is the whole call.
    auto offset = [&] {
      if (s.offset_unit > 0) return s.offset_index * s.offset_unit;
      return exec::Geometry{a.count, a.chunk_factor, a.esize}.chunk_begin(s.offset_index);
    };
    auto out = [&](int k, int64_t* elems = nullptr) {
      const DevRef ref = k == 0 ? s.dst : a.srcs[s.first_src + s.nsrcs + k - 1];
      int64_t bytes = 0;
      float* p = reinterpret_cast<float*>(chunk_at(a, r, ref.buf, ref.index, &bytes));
      if (elems) *elems = bytes / a.esize;
      return p;
    };
    auto ints = [](const float* p) { return reinterpret_cast<const int32_t*>(p); };  // int32 tables in a float call
    BadIndex bad;
    bool ok = true;
    const float* g = in(0);
    switch (s.kernel) {
      case 2:  // DeviceKernel::kUnscaleSumsq
        unscale_sumsq(team, out(0), g, n, static_cast<float>(scalars[0]), out(1), nullptr);
        break;
      case 3:  // kUnscaleSumsqAcc
        unscale_sumsq(team, out(0), g, n, static_cast<float>(scalars[0]), out(1), in(1));
        break;
      case 4:  // kAdamw
        adamw(team, g, in(1), in(2), in(3), *in(4), out(0), out(1), out(2), n, scalars);
        break;
      case 6:  // kAdamwCast
        adamw_cast(team, g, in(1), in(2), in(3), *in(4), out(0), out(1), out(2), reinterpret_cast<uint16_t*>(out(3)), n,
                   scalars);
        break;
      case 5:  // kAdamwMasked
        adamw_masked(team, g, in(1), in(2), in(3), in(4), out(0), out(1), out(2), n, scalars);
        break;
      case 7: {  // kBiasDropoutResidual: inputs y, bias (a row), residual
        int64_t hidden = 0;
        const float* bias = in(1, &hidden);
        bias_dropout_residual(team, g, bias, in(2), out(0), n, hidden, offset(), scalars);
        break;
      }
      case 9:  // kGemm: inputs a, b; output c; constant scalars rows, k, n
        gemm(team, g, in(1), out(0), static_cast<int64_t>(scalars[0]), static_cast<int64_t>(scalars[1]),
             static_cast<int64_t>(scalars[2]));
        break;
      case 10: {  // kMoeGather: inputs x (a token table), index; output the block; constant scalar hidden
        int64_t slots = 0;
        const int32_t* idx = ints(in(1, &slots));
        const auto hidden = static_cast<int64_t>(scalars[0]);
        ok = moe_gather(team, g, idx, out(0), n / hidden, slots, hidden, &bad);
        break;
      }
      case 11:    // kMoeCombineFirst: inputs block, gate, index; output y
      case 12: {  // kMoeCombine: inputs block, gate, index, y
        int64_t slots = 0, y_elems = 0;
        const float* gate = in(1, &slots);
        const int32_t* idx = ints(in(2));
        float* y = out(0, &y_elems);
        const auto hidden = static_cast<int64_t>(scalars[0]);
        ok = moe_combine(team, g, gate, idx, s.kernel == 12 ? in(3) : nullptr, y, y_elems / hidden, slots, hidden, &bad);
        break;
      }
      case 13: {  // kElementwise: a user kernel's program over its data ranges
        const float* ins[element::kMaxOperands] = {};
        float* outs[element::kMaxOperands] = {};
        for (int k = 0; k < s.nsrcs && k < element::kMaxOperands; ++k) ins[k] = k == 0 ? g : in(k);
        for (int k = 0; k <= s.nouts && k < element::kMaxOperands; ++k) outs[k] = out(k);
        elementwise(team, a.code + s.first_code, s.ncode, ins, outs, n, scalars);
        break;
      }
      case 8: {  // kBiasDropoutResidualLn: inputs y, bias, residual, gamma, beta; outputs out, ln
        int64_t hidden = 0;
        const float* bias = in(1, &hidden);
        bias_dropout_residual_ln(team, g, bias, in(2), in(3), in(4), out(0), out(1), n, hidden, offset(), scalars);
        break;
      }
      default: break;
    }
    if (ok) return true;
    if (bad.slot >= 0 && mem::claim(&a.status->failed, kBadIndex)) {  // one thread of those that met one
      a.status->block = block;
      a.status->step = index;
      a.status->peer = -1;
      a.status->waits_for_block = -1;
      a.status->round = round_no;
      a.status->slot = bad.slot;
      a.status->value = bad.value;
    }
    return false;
  }

  // Runs one step in round `r`; false when a wait gave up or a kernel failed.
  TUTTI_HD bool step(const DevStep& s, int32_t index, const Round& r, int64_t round_no) {
    if (s.op == plan::Opcode::kCompute && s.kernel >= 2) return kernel_step(s, index, r, round_no);
    const plan::OpShape shape = plan::shape_of(s.op);
    const bool ll = a.protocol == kProtoLL;
    const FifoView* out = shape.send ? &a.send[instance * a.nsend + s.send_conn] : nullptr;
    const FifoView* in = shape.recv ? &a.recv[instance * a.nrecv + s.recv_conn] : nullptr;
    const uint64_t send_seq = out ? *out->count + 1 : 0;  // this message's number on its FIFO
    const uint64_t recv_seq = in ? *in->count + 1 : 0;
    WaitSite site{block, index, in ? in->peer : out ? out->peer : -1, round_no};

    const int64_t slot_size = ll ? a.ll_slot_bytes : a.slot_bytes;
    unsigned char* sslot = out ? (ll ? out->ll : out->simple) + ((send_seq - 1) % a.depth) * slot_size : nullptr;
    const unsigned char* rslot = in ? (ll ? in->ll : in->simple) + ((recv_seq - 1) % a.depth) * slot_size : nullptr;
    const uint32_t send_flag = static_cast<uint32_t>(send_seq), recv_flag = static_cast<uint32_t>(recv_seq);

    // Thread 0 waits for a free slot to send into (then, in LL, writes the message's header) and
    // for the message to receive, whose stamp it checks before any thread reads its data.
    bool failed = false;
    if (team.rank() == 0) {
      if (out && send_seq > static_cast<uint64_t>(a.depth))
        failed = !wait_ge(a, out->head, send_seq - static_cast<uint64_t>(a.depth), site);
      if (!failed && out && ll) mem::ll_store(sslot, a.stamp, send_flag);
      if (!failed && in && !ll) failed = !wait_ge(a, in->tail, recv_seq, site);
      if (!failed && in) failed = !stamp_matches(a, in, recv_seq, rslot, site);
    }
    if (team.sync_or(failed)) return false;
    if (ll) {  // data lines follow the header
      if (sslot) sslot += kLLHeaderBytes;
      if (rslot) rslot += kLLHeaderBytes;
    }

    // A direct send moves no data: its descriptor says where the peer reads it.
    const bool direct = sends_direct(a, s, out);
    if (out && !ll && team.rank() == 0) {
      uint64_t* d = out->desc + ((send_seq - 1) % a.depth) * kDescWords;
      d[0] = direct ? reinterpret_cast<uint64_t>(a.bufs[a.srcs[s.first_src].buf]) : 0;
      d[1] = direct ? static_cast<uint64_t>(a.srcs[s.first_src].index) : 0;
      d[kDescStamp] = a.stamp;
    }
    if (direct) {
      team.sync();
      if (team.rank() == 0) {
        mem::store_release(out->tail, send_seq);
        *out->count = send_seq;
        mem::fetch_add(&a.state->direct_messages, 1);
      }
      return true;
    }
    // A message read in place: the sender's buffer, placed with the call's geometry.
    unsigned char* remote = nullptr;
    int64_t remote_index = 0;
    if (in && !ll) {
      const uint64_t* d = in->desc + ((recv_seq - 1) % a.depth) * kDescWords;
      remote = reinterpret_cast<unsigned char*>(mem::load_acquire(d));
      remote_index = static_cast<int64_t>(mem::load_acquire(d + 1));
    }

    // Operands: which local sources combine, in order.
    const int sources = plan::op_info(s.op).local_sources;
    const int nlocal = sources == plan::kAllSources ? s.nsrcs : sources;
    int64_t offset = 0;  // data offset of the chunk in the message
    for (int64_t c = 0; c < s.count; ++c) {
      int64_t bytes = 0, b2 = 0;
      unsigned char* dst = s.dst.buf != kBufNone ? chunk_at(a, r, s.dst.buf, s.dst.index + c, &bytes) : nullptr;
      const unsigned char* src0 = nullptr;
      if (nlocal > 0) src0 = chunk_at(a, r, a.srcs[s.first_src].buf, a.srcs[s.first_src].index + c, &b2);
      if (!dst) bytes = b2;
      if (s.op == plan::Opcode::kCopy && src0 == dst) {  // a copy onto itself (in-place aliasing): nothing to move
        offset += (bytes + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
        continue;
      }
      const int64_t units = (bytes + 15) / 16;
      int64_t rb = 0;
      const unsigned char* rdata = remote ? chunk_in(remote, a, r, remote_index + c, &rb) : in ? rslot + offset : nullptr;
      int64_t done = 0;  // units the unrolled path moved
      if (!ll) done = bulk(s, c, r, nlocal, bytes, dst, src0, rdata, out ? sslot + offset : nullptr);
      for (int64_t u = done + team.rank(); u < units; u += team.size()) {
        const int64_t valid = bytes - u * 16;
        Pack16 acc{{0, 0}};
        int k = 0;
        if (in) {
          if (ll) {
            const unsigned char* line = rslot + (offset + u * 16) * 2;
            uint64_t lo = 0, hi = 0;
            uint64_t since = 0;
            int spins = 0;
            while (!mem::ll_load(line, recv_flag, &lo)) {
              if (++spins % mem::kSpinsPerCheck == 0 && !keep_waiting(a, site, since)) {
                failed = true;
                break;
              }
              mem::pause_word(line + 12, spins);
            }
            spins = 0;
            while (!failed && !mem::ll_load(line + 16, recv_flag, &hi)) {
              if (++spins % mem::kSpinsPerCheck == 0 && !keep_waiting(a, site, since)) {
                failed = true;
                break;
              }
              mem::pause_word(line + 28, spins);
            }
            if (failed) break;
            acc.w[0] = lo;
            acc.w[1] = hi;
          } else if (remote) {  // as a slot: never a stale cached line of the peer's memory
            const unsigned char* q = rdata + u * 16;
            acc = valid >= 16 && (reinterpret_cast<uintptr_t>(q) & 15) == 0 ? mem::load_slot(q) : load_local(rdata, u, valid);
          } else {
            acc = mem::load_slot(rslot + offset + u * 16);
          }
        } else if (nlocal > 0) {
          acc = load_local(src0, u, valid);
          k = 1;
        }
        for (; k < nlocal; ++k) {
          int64_t nb = 0;
          const unsigned char* p =
              k == 0 ? src0 : chunk_at(a, r, a.srcs[s.first_src + k].buf, a.srcs[s.first_src + k].index + c, &nb);
          acc = combine<E>(a.op, acc, load_local(p, u, valid));
        }
        if (s.op == plan::Opcode::kCompute && s.kernel == 1) acc = scale_pack<E>(acc, factor(s));
        if (dst) store_local(dst, u, valid, acc);
        if (out) {
          if (ll) {
            unsigned char* line = sslot + (offset + u * 16) * 2;
            mem::ll_store(line, acc.w[0], send_flag);
            mem::ll_store(line + 16, acc.w[1], send_flag);
          } else {
            mem::store_slot(sslot + offset + u * 16, acc);
          }
        }
      }
      if (failed) break;
      offset += (bytes + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    }
    // Every thread's loads and stores of the step are done: thread 0 publishes them.
    if (team.sync_or(failed)) return false;
    if (team.rank() == 0) {
      if (out) {
        if (!ll) mem::store_release(out->tail, send_seq);
        *out->count = send_seq;
      }
      if (in) {
        mem::store_release(in->head, recv_seq);
        *in->count = recv_seq;
      }
    }
    return true;
  }

  TUTTI_HD void run() {
    const DevBlock blk = a.blocks[block];
    const uint64_t epoch = a.state->epoch << 32;
    uint64_t* progress = a.progress + static_cast<int64_t>(instance) * a.nblocks;
    for (int64_t k = instance; k < a.rounds; k += a.instances) {
      Round r{k * a.round_elems, a.count - k * a.round_elems < a.round_elems ? a.count - k * a.round_elems : a.round_elems};
      for (int32_t i = 0; i < blk.nsteps; ++i) {
        const DevStep& s = a.steps[blk.first_step + i];
        bool failed = false;
        if (team.rank() == 0)
          for (int32_t d = 0; d < s.ndeps && !failed; ++d) {
            const DevDep dep = a.deps[s.first_dep + d];
            const uint64_t want = epoch | static_cast<uint64_t>(k * a.blocks[dep.block].nsteps + dep.step + 1);
            failed = !wait_ge(a, &progress[dep.block], want, WaitSite{block, i, -1, k, dep.block});
          }
        if (team.sync_or(failed)) return;
        if (!step(s, i, r, k)) return;
        if (s.signal && team.rank() == 0)
          mem::store_release(&progress[block], epoch | static_cast<uint64_t>(k * blk.nsteps + i + 1));
      }
    }
    // Peers may still be reading this rank's buffers in place: the call is not over for them until
    // they have consumed every such message (the block's connections are its own, so its count is
    // its last message on each).
    if (team.rank() != 0) return;
    for (int32_t i = 0; i < blk.nsteps; ++i) {
      const DevStep& s = a.steps[blk.first_step + i];
      if (s.send_conn < 0) continue;
      const FifoView* out = &a.send[instance * a.nsend + s.send_conn];
      if (sends_direct(a, s, out) && !wait_ge(a, out->head, *out->count, WaitSite{block, i, out->peer, a.rounds}))
        return;
    }
  }
};

// Runs thread block `id` of a launch (plan block id % nblocks of instance id / nblocks), then counts
// it finished; the last one of the launch advances the rank's epoch for the next launch (read by
// every block at its start).
template <class E>
TUTTI_HD void run_block(const LaunchArgs& a, int32_t id) {
  BlockRun<E>{a, Team{}, id % a.nblocks, id / a.nblocks}.run();
  Team team;
  team.sync();
  if (team.rank() == 0) {
    if (mem::fetch_add(&a.state->finished, 1) + 1 == static_cast<uint64_t>(a.nblocks) * a.instances) {
      a.state->finished = 0;
      a.state->epoch = a.state->epoch + 1;
    }
  }
}

// Calls f.template operator()<E>() with the element traits of `type` (a DataType value). The
// pragma lets host code pass a host-only f (the CUDA backend picks its kernel for a type with it).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class F>
TUTTI_HD void with_elem(int32_t type, F&& f) {
  switch (type) {
    case 0: f.template operator()<NativeElem<int8_t>>(); break;
    case 1: f.template operator()<NativeElem<uint8_t>>(); break;
    case 2: f.template operator()<NativeElem<int32_t>>(); break;
    case 3: f.template operator()<NativeElem<uint32_t>>(); break;
    case 4: f.template operator()<NativeElem<int64_t>>(); break;
    case 5: f.template operator()<NativeElem<uint64_t>>(); break;
    case 6: f.template operator()<MiniElem<element::HalfT>>(); break;
    case 7: f.template operator()<NativeElem<float>>(); break;
    case 8: f.template operator()<NativeElem<double>>(); break;
    case 9: f.template operator()<MiniElem<element::Bf16T>>(); break;
    case 10: f.template operator()<MiniElem<element::E4M3T>>(); break;
    default: f.template operator()<MiniElem<element::E5M2T>>(); break;
  }
}

}  // namespace tutti::device
