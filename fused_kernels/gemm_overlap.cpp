// GEMM overlapped with a collective (tutti/fused.hpp): row-parallel GEMM -> reduce-scatter and
// all-gather -> column-parallel GEMM, the GEMM cut into row blocks that move as they are done.
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "core/datatype.hpp"
#include "core/error.hpp"
#include "fused_kernels/common.hpp"
#include "tutti/fused.hpp"
#include "tutti/kernel.hpp"

namespace tutti::fused {
namespace {

// inputs {a: rows x k, b: k x n}, outputs {c: rows x n}; scalars {rows, k, n} (constants of the plan).
void gemm_kernel(const KernelArgs& a) {
  require_float(a, "fused.gemm");
  const auto rows = static_cast<int64_t>(a.scalars[0]), k = static_cast<int64_t>(a.scalars[1]),
             n = static_cast<int64_t>(a.scalars[2]);
  if (rows < 1 || k < 1 || n < 1)
    throw InvalidArgument(fmt::format("kernel 'fused.gemm': {} x {} by {} x {}", rows, k, k, n));
  if (a.input_counts && (a.input_counts[0] != rows * k || a.input_counts[1] != k * n || a.output_counts[0] != rows * n))
    throw InvalidArgument(fmt::format("kernel 'fused.gemm' ({} x {} by {} x {}): operands of {}, {} and {} elements",
                                      rows, k, k, n, a.input_counts[0], a.input_counts[1], a.output_counts[0]));
  if (rows > INT_MAX || k > INT_MAX || n > INT_MAX)
    throw InvalidArgument(fmt::format("kernel 'fused.gemm': {} x {} by {} x {} is beyond BLAS's int", rows, k, k, n));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k),
              1.0f, static_cast<const float*>(a.inputs[0]), static_cast<int>(k), static_cast<const float*>(a.inputs[1]),
              static_cast<int>(n), 0.0f, static_cast<float*>(a.outputs[0]), static_cast<int>(n));
}

KernelId gemm_id() {
  // Cost: 2k flops per output element (k / 2 per output byte); against a copy of the output, about
  // k / 20 on the CPUs measured (sgemm at ~10x a copy's bytes per second in flops; docs/PERFORMANCE.md).
  // Mixed units: blocks of x and the weight are state buffers of their own units.
  static const KernelId id = [] {
    KernelDef def{"fused.gemm", {"rows", "k", "n"}, gemm_kernel, 40.0, 2, 1};
    def.cost_of = [](const double* s) { return std::max(1.0, s[1] / 20.0); };
    return register_once(std::move(def), true, DeviceKernel::kGemm);
  }();
  return id;
}

// About 512 KiB a block, at most 64.
int default_pieces(int64_t rows_per_rank, int64_t width) {
  return pieces_for(rows_per_rank, width * static_cast<int64_t>(sizeof(float)), 512 << 10, 64);
}

void check_shape(const Comm& comm, const char* op, int64_t rows, int64_t k, int64_t n, int pieces) {
  TUTTI_CHECK(rows >= 1 && k >= 1 && n >= 1 && rows % comm.size() == 0, InvalidArgument,
              "rank {}: {}: {} x {} by {} x {}: the rows do not split over {} ranks", comm.rank(), op, rows, k, k, n,
              comm.size());
  TUTTI_CHECK(pieces >= 1 && (rows / comm.size()) % pieces == 0, InvalidArgument,
              "rank {}: {}: {} rows per rank do not split into {} pieces", comm.rank(), op, rows / comm.size(), pieces);
}

}  // namespace

void gemm(const float* a, const float* b, float* c, int64_t rows, int64_t k, int64_t n) {
  const double s[3] = {static_cast<double>(rows), static_cast<double>(k), static_cast<double>(n)};
  const void* ins[2] = {a, b};
  void* outs[1] = {c};
  gemm_kernel(KernelArgs{ins, outs, rows * k, DataType::kFloat32, s});
}

namespace {
void check_program(const char* what, int nranks, int K, int64_t rows, int64_t k, int64_t n) {
  TUTTI_CHECK(nranks >= 1 && K >= 1 && k >= 1 && n >= 1 && rows >= static_cast<int64_t>(nranks) * K &&
                  rows % (static_cast<int64_t>(nranks) * K) == 0,
              InvalidArgument, "{}: {} x {} by {} x {} does not split into {} ranks x {} row blocks", what, rows, k, k, n,
              nranks, K);
}
}  // namespace

dsl::Program gemm_reduce_scatter_program(int nranks, int K, int64_t rows, int64_t k, int64_t n) {
  check_program("gemm_reduce_scatter_program", nranks, K, rows, k, n);
  const int N = nranks;
  const int64_t block = rows / (static_cast<int64_t>(N) * K);  // rows of a block
  const KernelId g = gemm_id();
  const std::vector<ScalarArg> dims = {ScalarArg(static_cast<double>(block)), ScalarArg(static_cast<double>(k)),
                                       ScalarArg(static_cast<double>(n))};
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = N;
  s.chunk_factor = K;  // the output piece: rows / N x n, in K blocks
  s.custom_input_chunks = 0;
  s.custom_output_chunks = K;
  // out block j of rank q: the sum over ranks r of gemm(x_r block (q, j), w_r).
  s.custom_post = [=](int q, int j) {
    Content c;
    for (int r = 0; r < N; ++r)
      c.merge(Content::apply(g, {Content::of_state(r, 0, q * K + j), Content::of_state(r, 1, 0)}, dims));
    return std::optional<Content>(c);
  };
  s.states = {StateBufferSpec{"x", N * K, block * k, {}}, StateBufferSpec{"w", 1, k * n, {}}};
  dsl::Program p(fmt::format("gemm_reduce_scatter_n{}_k{}", N, K), s);
  const dsl::Buffer x = dsl::Buffer::state("x"), w = dsl::Buffer::state("w"), out = dsl::Buffer::output(),
                    partial = dsl::Buffer::scratch("partial"), received = dsl::Buffer::scratch("received");
  // Rank r works through the owners r+1, r+2, ..., r: the blocks it sends first, its own last.
  for (int step = 1; step <= N; ++step)
    for (int r = 0; r < N; ++r) {
      const int q = (r + step) % N;
      for (int j = 0; j < K; ++j) {
        const int b = q * K + j;
        if (q == r) {
          p.apply(g, {p.chunk(r, x, b), p.chunk(r, w, 0)}, {p.chunk(r, out, j)}, dims);
        } else {
          p.apply(g, {p.chunk(r, x, b), p.chunk(r, w, 0)}, {p.chunk(r, partial, b)}, dims);
          p.chunk(r, partial, b).copy(q, received, r * K + j);  // waits in the owner's scratch for its own block
        }
      }
    }
  for (int q = 0; q < N; ++q)
    for (int j = 0; j < K; ++j)
      for (int r = 0; r < N; ++r)
        if (r != q) p.chunk(q, out, j).reduce(p.chunk(q, received, r * K + j));
  return p;
}

dsl::Program all_gather_gemm_program(int nranks, int K, int64_t rows, int64_t k, int64_t n) {
  check_program("all_gather_gemm_program", nranks, K, rows, k, n);
  const int N = nranks;
  const int64_t block = rows / (static_cast<int64_t>(N) * K);
  const KernelId g = gemm_id();
  const std::vector<ScalarArg> dims = {ScalarArg(static_cast<double>(block)), ScalarArg(static_cast<double>(k)),
                                       ScalarArg(static_cast<double>(n))};
  CollectiveSpec s;
  s.kind = Collective::kCustom;
  s.nranks = N;
  s.chunk_factor = K;  // the input piece: rows / N x k, in K blocks
  s.custom_input_chunks = K;
  s.custom_output_chunks = N * K;
  s.custom_post = [=](int, int i) { return std::optional<Content>(Content::of(i / K, i % K)); };  // the all-gather
  s.states = {StateBufferSpec{"w", 1, k * n, {}},
              StateBufferSpec{"y", N * K, block * n, [=](int r, int i) {
                                return std::optional<Content>(
                                    Content::apply(g, {Content::of(i / K, i % K), Content::of_state(r, 0, 0)}, dims));
                              }}};
  dsl::Program p(fmt::format("all_gather_gemm_n{}_k{}", N, K), s);
  const dsl::Buffer in = dsl::Buffer::input(), out = dsl::Buffer::output(), w = dsl::Buffer::state("w"),
                    y = dsl::Buffer::state("y");
  // Every block to every rank; each rank multiplies its own blocks first, then the others' as they come.
  for (int q = 0; q < N; ++q)
    for (int j = 0; j < K; ++j) {
      auto mine = p.chunk(q, in, j).copy(q, out, q * K + j);
      for (int step = 1; step < N; ++step) p.chunk(q, in, j).copy((q + step) % N, out, q * K + j);
      (void)mine;
    }
  for (int r = 0; r < N; ++r)
    for (int step = 0; step < N; ++step) {
      const int q = (r + N - step) % N;  // own first, then the ranks before it (whose blocks come first)
      for (int j = 0; j < K; ++j)
        p.apply(g, {p.chunk(r, out, q * K + j), p.chunk(r, w, 0)}, {p.chunk(r, y, q * K + j)}, dims);
    }
  return p;
}

GemmReduceScatter::GemmReduceScatter(Comm& comm, int64_t rows, int64_t k, int64_t n, int pieces)
    : comm_(comm), rows_(rows), k_(k), n_(n) {
  pieces_ = pieces > 0 ? pieces : default_pieces(rows / std::max(1, comm.size()), n);
  check_shape(comm, "GemmReduceScatter", rows, k, n, pieces_);
  plan_ = compile_plan(gemm_reduce_scatter_program(comm.size(), pieces_, rows, k, n));
}

Work GemmReduceScatter::run(const float* x, const float* w, float* out) {
  TUTTI_CHECK(x && w && out, InvalidArgument, "rank {}: GemmReduceScatter::run: a null buffer", comm_.rank());
  PlanCall call;
  call.output = out;
  call.count = static_cast<size_t>(rows_ / comm_.size() * n_);
  call.states = {const_cast<float*>(x), const_cast<float*>(w)};  // only read
  return run_plan(comm_, plan_, call);
}

void GemmReduceScatter::run_unfused(const float* x, const float* w, float* out) {
  product_.resize(static_cast<size_t>(rows_ * n_));
  gemm(x, w, product_.data(), rows_, k_, n_);
  comm_.reduce_scatter(product_.data(), out, static_cast<size_t>(rows_ / comm_.size() * n_), DataType::kFloat32,
                       RedOp::kSum)
      .wait();
}

AllGatherGemm::AllGatherGemm(Comm& comm, int64_t rows, int64_t k, int64_t n, int pieces)
    : comm_(comm), rows_(rows), k_(k), n_(n) {
  pieces_ = pieces > 0 ? pieces : default_pieces(rows / std::max(1, comm.size()), k);
  check_shape(comm, "AllGatherGemm", rows, k, n, pieces_);
  plan_ = compile_plan(all_gather_gemm_program(comm.size(), pieces_, rows, k, n));
}

Work AllGatherGemm::run(const float* x, const float* w, float* gathered, float* y) {
  TUTTI_CHECK(x && w && gathered && y, InvalidArgument, "rank {}: AllGatherGemm::run: a null buffer", comm_.rank());
  PlanCall call;
  call.input = x;
  call.output = gathered;
  call.count = static_cast<size_t>(rows_ / comm_.size() * k_);
  call.states = {const_cast<float*>(w), y};
  return run_plan(comm_, plan_, call);
}

void AllGatherGemm::run_unfused(const float* x, const float* w, float* gathered, float* y) {
  comm_.all_gather(x, gathered, static_cast<size_t>(rows_ / comm_.size() * k_), DataType::kFloat32).wait();
  gemm(gathered, w, y, rows_, k_, n_);
}

}  // namespace tutti::fused
