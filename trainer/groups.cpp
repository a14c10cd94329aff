#include "trainer/groups.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstring>

namespace tutti::train {

Coordinates coordinates_of(const Layout& layout, int w) {
  if (w < 0 || w >= layout.world())
    throw InvalidArgument(fmt::format("rank {} is outside a world of {} ({})", w, layout.world(), layout.describe()));
  return Coordinates{w % layout.tp, w / layout.tp};
}

int world_rank_of(const Layout& layout, Coordinates c) { return c.tp_rank + layout.tp * c.dp_rank; }

void Collectives::all_reduce(float* data, int64_t n, RedOp op) {
  if (size() == 1 || n == 0) return;
  tutti::Work w = all_reduce_async(data, n, op);
  wait(w);
}

void Collectives::all_gather(const float* in, float* out, int64_t n) {
  if (size() == 1) {
    if (n > 0 && in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  tutti::Work w = all_gather_async(in, out, n);
  wait(w);
}

void Collectives::reduce_scatter(const float* in, float* out, int64_t n, RedOp op) {
  if (size() == 1) {
    if (n > 0 && in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
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
  return comm_->all_reduce(data, data, static_cast<size_t>(n), DataType::kFloat32, op);
}

tutti::Work Collectives::reduce_scatter_async(const float* in, float* out, int64_t n, RedOp op) {
  if (size() == 1) {
    if (n > 0 && in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
    return {};
  }
  return comm_->reduce_scatter(in, out, static_cast<size_t>(n), DataType::kFloat32, op);
}

tutti::Work Collectives::all_gather_async(const float* in, float* out, int64_t n) {
  if (size() == 1) {
    if (n > 0 && in != out) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
    return {};
  }
  return comm_->all_gather(in, out, static_cast<size_t>(n), DataType::kFloat32);
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
  // Every rank takes part in both splits (split is collective over the world).
  tutti::Comm tp = world.split(g.at.dp_rank, g.at.tp_rank);
  tutti::Comm dp = world.split(g.at.tp_rank, g.at.dp_rank);
  if (layout.tp > 1) g.tp = Collectives(std::move(tp));
  if (layout.dp > 1) g.dp = Collectives(std::move(dp));
  return g;
}

Groups Groups::single(const Layout& layout) {
  Groups g;
  g.layout = layout;
  return g;
}

}  // namespace tutti::train
