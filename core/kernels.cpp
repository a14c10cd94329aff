#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <mutex>

#include "core/datatype.hpp"
#include "core/reduce.hpp"
#include "tutti/kernel.hpp"

namespace tutti {
namespace {

void identity_cpu(const KernelArgs& a) {
  if (a.count > 0 && a.outputs[0] != a.inputs[0])
    std::memmove(a.outputs[0], a.inputs[0], static_cast<size_t>(a.count) * size_of(a.type));
}

void scale_cpu(const KernelArgs& a) {
  unsigned char factor[8] = {};
  store_value(a.type, factor, a.scalars[0]);
  scale(a.type, a.outputs[0], a.inputs[0], factor, static_cast<size_t>(a.count));
}

// A deque: definitions never move, so references handed out stay valid while others register.
struct Registry {
  std::mutex mu;
  std::deque<KernelDef> defs;
  Registry() {
    defs.push_back(KernelDef{"identity", {}, identity_cpu, 1.0});
    defs.back().device = DeviceKernel::kIdentity;
    defs.push_back(KernelDef{"scale", {"factor"}, scale_cpu, 1.0});
    defs.back().device = DeviceKernel::kScale;
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

KernelId register_kernel(KernelDef def) {
  const bool well_formed = !def.name.empty() && def.name.find_first_not_of(
                                                    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") ==
                                                    std::string::npos;
  if (!well_formed)
    throw InvalidArgument(fmt::format("register_kernel: '{}' is not a kernel name (letters, digits, '_', '.', '-')",
                                      def.name));
  if (!def.cpu) throw InvalidArgument(fmt::format("register_kernel: kernel '{}' has no CPU implementation", def.name));
  if (def.inputs < 1 || def.outputs < 1)
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}' has {} input(s) and {} output(s); at least 1 of each",
                                      def.name, def.inputs, def.outputs));
  if (!(def.copy_cost > 0))
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}': copy_cost {} is not positive", def.name,
                                      def.copy_cost));
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  for (const KernelDef& d : r.defs)
    if (d.name == def.name) throw InvalidArgument(fmt::format("register_kernel: kernel '{}' is registered already", def.name));
  r.defs.push_back(std::move(def));
  return static_cast<KernelId>(r.defs.size() - 1);
}

std::optional<KernelId> find_kernel(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  for (size_t i = 0; i < r.defs.size(); ++i)
    if (r.defs[i].name == name) return static_cast<KernelId>(i);
  return std::nullopt;
}

const KernelDef& kernel_def(KernelId id) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (id < 0 || static_cast<size_t>(id) >= r.defs.size())
    throw InvalidArgument(fmt::format("no compute kernel has id {} ({} registered)", id, r.defs.size()));
  return r.defs[static_cast<size_t>(id)];
}

}  // namespace tutti
