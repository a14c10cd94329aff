#include "trainer/groups.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace tutti::train {

Coordinates coordinates_of(const Layout& layout, int w) {
  if (w < 0 || w >= layout.world())
    throw InvalidArgument(fmt::format("rank {} is outside a world of {} ({})", w, layout.world(), layout.describe()));
  Coordinates c{w % layout.tp, (w / layout.tp) % layout.dp, w / (layout.tp * layout.dp)};
  c.ep_rank = c.dp_rank % layout.ep;
  c.edp_rank = c.dp_rank / layout.ep;
  return c;
}

int world_rank_of(const Layout& layout, Coordinates c) {
  return c.tp_rank + layout.tp * (c.dp_rank + layout.dp * c.pp_rank);
}

tutti::Work Pipe::send(const float* data, int64_t n, int peer) {
  auto& c = to.at(static_cast<size_t>(peer));
  if (!c) throw InvalidUsage(fmt::format("pipeline: no connection to pp rank {}", peer));
  return c->send(data, static_cast<size_t>(n), DataType::kFloat32, 1);
}

void Pipe::wait(tutti::Work& work) {
  const auto t0 = std::chrono::steady_clock::now();
  work.wait();
  wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Pipe::recv(float* data, int64_t n, int peer) {
  auto& c = from.at(static_cast<size_t>(peer));
  if (!c) throw InvalidUsage(fmt::format("pipeline: no connection from pp rank {}", peer));
  const auto t0 = std::chrono::steady_clock::now();
  c->recv(data, static_cast<size_t>(n), DataType::kFloat32, 0).wait();
  wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class F>
void Collectives::staged(const float* in, int64_t n_in, float* out, int64_t n_out, F call) {
  std::vector<float> hin(static_cast<size_t>(n_in)), hout(static_cast<size_t>(n_out));
  stage_->download(hin.data(), in, n_in);
  const bool same = in == out;
  call(hin.data(), same ? hin.data() : hout.data());
  stage_->upload(out, same ? hin.data() : hout.data(), n_out);
}

void Collectives::all_reduce(float* data, int64_t n, RedOp op) {
  if (size() == 1 || n == 0) return;
  if (stage_) {
    staged(data, n, data, n, [&](float* hin, float*) {
      tutti::Work w = comm_->all_reduce(hin, hin, static_cast<size_t>(n), DataType::kFloat32, op);
      wait(w);
    });
    return;
  }
  tutti::Work w = all_reduce_async(data, n, op);
  wait(w);
}

void Collectives::all_gather(const float* in, float* out, int64_t n) {
  if (size() == 1) {
    if (n > 0 && in != out) copy(in, out, n);
    return;
  }
  if (stage_) {
    staged(in, n, out, n * size(), [&](float* hin, float* hout) {
      tutti::Work w = comm_->all_gather(hin, hout, static_cast<size_t>(n), DataType::kFloat32);
      wait(w);
    });
    return;
  }
  tutti::Work w = all_gather_async(in, out, n);
  wait(w);
}

void Collectives::reduce_scatter(const float* in, float* out, int64_t n, RedOp op) {
  if (size() == 1) {
    if (n > 0 && in != out) copy(in, out, n);
    return;
  }
  if (stage_) {
    // The output may lie inside the input (in place): stage the input, write back the output.
    std::vector<float> hin(static_cast<size_t>(n * size())), hout(static_cast<size_t>(n));
    stage_->download(hin.data(), in, n * size());
    tutti::Work w = comm_->reduce_scatter(hin.data(), hout.data(), static_cast<size_t>(n), DataType::kFloat32, op);
    wait(w);
    stage_->upload(out, hout.data(), n);
    return;
  }
  tutti::Work w = reduce_scatter_async(in, out, n, op);
  wait(w);
}

double Collectives::all_reduce_value(double v, RedOp op) {
  if (size() == 1) return v;
  double out = 0;
  tutti::Work w = comm_->all_reduce(&v, &out, 1, DataType::kFloat64, op);
  wait(w);
  return out;
}

tutti::Work Collectives::all_reduce_async(float* data, int64_t n, RedOp op) {
  if (size() == 1 || n == 0) return {};
  if (stage_) return all_reduce(data, n, op), tutti::Work{};
  return comm_->all_reduce(data, data, static_cast<size_t>(n), DataType::kFloat32, op);
}

tutti::Work Collectives::reduce_scatter_async(const float* in, float* out, int64_t n, RedOp op) {
  if (size() == 1 || stage_) return reduce_scatter(in, out, n, op), tutti::Work{};
  return comm_->reduce_scatter(in, out, static_cast<size_t>(n), DataType::kFloat32, op);
}

tutti::Work Collectives::all_gather_async(const float* in, float* out, int64_t n) {
  if (size() == 1 || stage_) return all_gather(in, out, n), tutti::Work{};
  return comm_->all_gather(in, out, static_cast<size_t>(n), DataType::kFloat32);
}

void Collectives::copy(const float* in, float* out, int64_t n) {
  if (stage_) stage_->copy(out, in, n);
  else std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
}

void Collectives::wait(tutti::Work& work) {
  const auto t0 = std::chrono::steady_clock::now();
  work.wait();
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Groups Groups::make(tutti::Comm& world, const Layout& layout) {
  if (layout.world() != world.size())
    throw InvalidArgument(fmt::format("layout {} needs {} ranks, the world has {}", layout.describe(), layout.world(),
                                      world.size()));
  Groups g;
  g.layout = layout;
  g.at = coordinates_of(layout, world.rank());
  const Coordinates& c = g.at;
  // Every rank takes part in every split (split is collective over the world).
  tutti::Comm tp = world.split(c.dp_rank + layout.dp * c.pp_rank, c.tp_rank);
  tutti::Comm dp = world.split(c.tp_rank + layout.tp * c.pp_rank, c.dp_rank);
  const int line = c.tp_rank + layout.tp * c.dp_rank;  // the pp group's colour
  tutti::Comm pp = world.split(line, c.pp_rank);
  const int edp_size = layout.dp / layout.ep;
  tutti::Comm ep = world.split(c.tp_rank + layout.tp * (c.edp_rank + edp_size * c.pp_rank), c.ep_rank);
  tutti::Comm edp = world.split(c.tp_rank + layout.tp * (c.ep_rank + layout.ep * c.pp_rank), c.edp_rank);
  if (layout.tp > 1) g.tp = Collectives(std::move(tp));
  if (layout.dp > 1) g.dp = Collectives(std::move(dp));
  if (layout.ep > 1) g.ep = Collectives(std::move(ep));
  if (edp_size > 1 && layout.ep > 1) g.edp = Collectives(std::move(edp));
  if (layout.pp > 1) {
    g.pp = Collectives(std::move(pp));
    const bool ends = c.pp_rank == 0 || c.pp_rank == layout.pp - 1;
    g.embedding = Collectives(world.split(ends ? line : -1, c.pp_rank));
    // One communicator per direction between neighbours: pp rank a to pp rank b, for b = a +- 1
    // (around the ring, which the interleaved schedule uses).
    g.pipe.to.resize(static_cast<size_t>(layout.pp));
    g.pipe.from.resize(static_cast<size_t>(layout.pp));
    std::vector<std::pair<int, int>> edges;
    for (int a = 0; a < layout.pp; ++a)
      for (int b : {(a + 1) % layout.pp, (a + layout.pp - 1) % layout.pp})
        if (std::find(edges.begin(), edges.end(), std::pair{a, b}) == edges.end()) edges.emplace_back(a, b);
    for (auto [a, b] : edges) {
      const bool in = c.pp_rank == a || c.pp_rank == b;
      tutti::Comm edge = world.split(in ? line : -1, c.pp_rank == a ? 0 : 1);
      if (c.pp_rank == a) g.pipe.to[static_cast<size_t>(b)] = std::move(edge);
      else if (c.pp_rank == b) g.pipe.from[static_cast<size_t>(a)] = std::move(edge);
    }
  }
  return g;
}

Groups Groups::single(const Layout& layout) {
  Groups g;
  g.layout = layout;
  return g;
}

}  // namespace tutti::train
