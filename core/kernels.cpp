#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "core/datatype.hpp"
#include "core/element_program.hpp"
#include "core/error.hpp"
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

// The CPU form of a kernel that gives only an element-wise program: the device's evaluator, one
// thread, so both forms compute the same floats.
void element_cpu(const KernelArgs& a) {
  TUTTI_CHECK(a.kernel != nullptr, InvalidArgument,
              "an element-wise kernel ran without its definition (KernelArgs::kernel): run it through a plan");
  const KernelDef& def = *a.kernel;
  TUTTI_CHECK(a.type == DataType::kFloat32, InvalidArgument, "kernel '{}' is element-wise and takes float32 calls, not {}",
              def.name, name(a.type));
  // Compiled per call (a few dozen instructions against a chunk of elements) into a buffer each
  // thread keeps, so the hot path allocates nothing.
  thread_local std::vector<element::ElementCode> code;
  code = compile_elements(def);
  element::run_elements(code.data(), static_cast<int32_t>(code.size()), reinterpret_cast<const float* const*>(a.inputs),
                        reinterpret_cast<float* const*>(a.outputs), a.scalars, 0, a.count, 1);
}

// What register_kernel refuses in an element-wise program, naming the kernel and the instruction.
void check_program(const KernelDef& def) {
  const ElementProgram& p = def.element;
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}': element-wise program: {}", def.name, why));
  };
  const size_t length = p.code.size() + p.outputs.size();
  if (length > static_cast<size_t>(element::kMaxCode))
    fail(fmt::format("{} instructions and {} outputs; at most {} together (the device evaluates in a fixed array)",
                     p.code.size(), p.outputs.size(), element::kMaxCode));
  if (def.inputs > element::kMaxOperands || def.outputs > element::kMaxOperands)
    fail(fmt::format("{} inputs and {} outputs; at most {} each", def.inputs, def.outputs, element::kMaxOperands));
  if (p.outputs.size() != static_cast<size_t>(def.outputs))
    fail(fmt::format("{} output value(s) for {} output(s)", p.outputs.size(), def.outputs));
  if (def.mixed_units) fail("operands of mixed units (element-wise kernels take one element of every operand)");
  for (size_t i = 0; i < p.code.size(); ++i) {
    const ElementInstr& in = p.code[i];
    const auto op = static_cast<int32_t>(in.op);
    if (op < 0 || op > static_cast<int32_t>(ElementOp::kSelect)) fail(fmt::format("instruction {} has opcode {}", i, op));
    const int operands = in.op == ElementOp::kInput || in.op == ElementOp::kScalar || in.op == ElementOp::kConst ? 0
                         : in.op >= ElementOp::kNeg && in.op <= ElementOp::kTanh                                  ? 1
                         : in.op >= ElementOp::kFma                                                              ? 3
                                                                                                                 : 2;
    if (in.op == ElementOp::kInput && (in.a < 0 || in.a >= def.inputs))
      fail(fmt::format("instruction {} reads input {} of {}", i, in.a, def.inputs));
    if (in.op == ElementOp::kScalar && (in.a < 0 || static_cast<size_t>(in.a) >= def.scalars.size()))
      fail(fmt::format("instruction {} reads scalar {} of {}", i, in.a, def.scalars.size()));
    const int32_t refs[3] = {in.a, in.b, in.c};
    for (int k = 0; k < operands; ++k)
      if (refs[k] < 0 || static_cast<size_t>(refs[k]) >= i)
        fail(fmt::format("instruction {} uses value {}, which is not an earlier instruction's", i, refs[k]));
  }
  for (size_t k = 0; k < p.outputs.size(); ++k)
    if (p.outputs[k] < 0 || static_cast<size_t>(p.outputs[k]) >= p.code.size())
      fail(fmt::format("output {} is value {} of {}", k, p.outputs[k], p.code.size()));
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
  if (def.inputs < 1 || def.outputs < 1)
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}' has {} input(s) and {} output(s); at least 1 of each",
                                      def.name, def.inputs, def.outputs));
  if (!def.element.empty()) {
    check_program(def);
    if (def.device != DeviceKernel::kNone && def.device != DeviceKernel::kElementwise)
      throw InvalidArgument(fmt::format("register_kernel: kernel '{}' names a built-in device form and an element-wise "
                                        "program; one of them",
                                        def.name));
    def.device = DeviceKernel::kElementwise;
    if (!def.cpu) def.cpu = element_cpu;
  } else if (def.device == DeviceKernel::kElementwise) {
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}' asks for the element-wise device form without a "
                                      "program (KernelDef::element)",
                                      def.name));
  }
  if (!def.cpu) throw InvalidArgument(fmt::format("register_kernel: kernel '{}' has no CPU implementation", def.name));
  if (!def.stream && def.stream_state)
    throw InvalidArgument(fmt::format("register_kernel: kernel '{}' asks for {} bytes of stream state without a stream "
                                      "form (KernelDef::stream)",
                                      def.name, def.stream_state));
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

std::vector<element::ElementCode> compile_elements(const KernelDef& def) {
  std::vector<element::ElementCode> code;
  code.reserve(def.element.code.size() + def.element.outputs.size());
  for (const ElementInstr& in : def.element.code)
    code.push_back({static_cast<int32_t>(in.op), in.a, in.b, in.c, static_cast<float>(in.value)});
  for (size_t k = 0; k < def.element.outputs.size(); ++k)
    code.push_back({element::kStore, static_cast<int32_t>(k), def.element.outputs[k], 0, 0});
  return code;
}

const KernelDef& kernel_def(KernelId id) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (id < 0 || static_cast<size_t>(id) >= r.defs.size())
    throw InvalidArgument(fmt::format("no compute kernel has id {} ({} registered)", id, r.defs.size()));
  return r.defs[static_cast<size_t>(id)];
}

}  // namespace tutti
