#include "tutti/dsl.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.hpp"

namespace tutti::dsl {

std::string Buffer::describe() const {
  if (kind == BufferKind::kScratch) return fmt::format("scratch '{}'", name);
  if (is_state(kind)) return fmt::format("state '{}'", name);
  return to_string(kind);
}

ChunkRef ChunkRef::copy(int dst_rank, const Buffer& buffer, int index, Annotations a) const {
  return program_->record(Op{OpKind::kCopy, loc_, ChunkLoc{dst_rank, program_->resolve(buffer), index, loc_.count}, a});
}

ChunkRef ChunkRef::reduce(const ChunkRef& src, Annotations a) const {
  return program_->record(Op{OpKind::kReduce, src.loc_, loc_, a});
}

ChunkRef ChunkRef::then(KernelId kernel, std::vector<ScalarArg> scalars, const std::vector<ChunkRef>& inputs,
                        const std::vector<ChunkRef>& outputs, Annotations a) const {
  std::vector<ChunkRef> ins = {*this};
  ins.insert(ins.end(), inputs.begin(), inputs.end());
  return program_->apply(kernel, ins, outputs.empty() ? std::vector<ChunkRef>{*this} : outputs, std::move(scalars), a)[0];
}

std::vector<ChunkRef> Program::apply(KernelId kernel, const std::vector<ChunkRef>& inputs,
                                     const std::vector<ChunkRef>& outputs, std::vector<ScalarArg> scalars, Annotations a) {
  const KernelDef& def = kernel_def(kernel);
  TUTTI_CHECK(!inputs.empty() && !outputs.empty(), InvalidArgument, "apply '{}': no inputs or no outputs", def.name);
  const ChunkLoc& first = inputs[0].loc_;
  TUTTI_CHECK(inputs.size() == static_cast<size_t>(def.inputs) && outputs.size() == static_cast<size_t>(def.outputs),
              InvalidArgument, "apply: kernel '{}' takes {} input(s) and {} output(s), {} and {} given (rank {} {}[{}])",
              def.name, def.inputs, def.outputs, inputs.size(), outputs.size(), first.rank, first.buffer.describe(),
              first.index);
  TUTTI_CHECK(scalars.size() == def.scalars.size(), InvalidArgument,
              "apply: kernel '{}' takes {} scalar(s), {} given (rank {} {}[{}])", def.name, def.scalars.size(),
              scalars.size(), first.rank, first.buffer.describe(), first.index);
  if (!def.mixed_units) {
    std::vector<ChunkRef> all = inputs;
    all.insert(all.end(), outputs.begin(), outputs.end());
    for (const ChunkRef& r : all)
      TUTTI_CHECK(unit(r.loc_.buffer) == unit(first.buffer), InvalidArgument,
                  "apply: kernel '{}' takes operands of one size, but rank {} {} and {} have different units (a "
                  "kernel for statistics or rows declares mixed_units)",
                  def.name, first.rank, first.buffer.describe(), r.loc_.buffer.describe());
  }
  Op op{OpKind::kCompute, first, outputs[0].loc_, a};
  op.kernel = kernel;
  op.scalars = std::move(scalars);
  for (const ChunkRef& r : inputs) op.inputs.push_back(r.loc_);
  for (const ChunkRef& r : outputs) op.outputs.push_back(r.loc_);
  record(op);
  std::vector<ChunkRef> out;
  for (const ChunkLoc& l : op.outputs) out.push_back(ChunkRef(this, l));
  return out;
}

std::vector<ChunkRef> ChunkRef::split(int parts) const {
  TUTTI_CHECK(parts >= 1 && loc_.count % parts == 0, InvalidArgument,
              "split: {} chunks of rank {} {} cannot be split into {} equal parts", loc_.count, loc_.rank,
              loc_.buffer.describe(), parts);
  std::vector<ChunkRef> out;
  int each = loc_.count / parts;
  for (int i = 0; i < parts; ++i) {
    ChunkLoc l = loc_;
    l.index += i * each;
    l.count = each;
    out.push_back(ChunkRef(program_, l));
  }
  return out;
}

ChunkRef ChunkRef::operator[](int i) const {
  TUTTI_CHECK(i >= 0 && i < loc_.count, InvalidArgument, "chunk [{}] of a {}-chunk reference (rank {} {}[{}])", i,
              loc_.count, loc_.rank, loc_.buffer.describe(), loc_.index);
  ChunkLoc l = loc_;
  l.index += i;
  l.count = 1;
  return ChunkRef(program_, l);
}

Program::Program(std::string name, CollectiveSpec spec) : name_(std::move(name)), spec_(std::move(spec)) {
  TUTTI_CHECK(spec_.nranks >= 1, InvalidArgument, "program '{}': {} ranks", name_, spec_.nranks);
  TUTTI_CHECK(spec_.chunk_factor >= 1, InvalidArgument, "program '{}': chunk factor {}", name_, spec_.chunk_factor);
  TUTTI_CHECK(!spec_.has_root() || (spec_.root >= 0 && spec_.root < spec_.nranks), InvalidArgument,
              "program '{}': root {} is not a rank of {}", name_, spec_.root, spec_.nranks);
  state_.resize(spec_.nranks);
  for (int r = 0; r < spec_.nranks; ++r) {
    state_[r].input.resize(spec_.input_chunks());
    state_[r].output.resize(spec_.output_chunks());
    for (int i = 0; i < spec_.input_chunks(); ++i) slot(r, Buffer::input(), i) = spec_.precondition(r, i);
    state_[r].states.resize(spec_.states.size());
    for (size_t k = 0; k < spec_.states.size(); ++k)
      for (int i = 0; i < spec_.states[k].chunks; ++i)
        state_[r].states[k].push_back(Content::of_state(r, static_cast<int>(k), i));
  }
  TUTTI_CHECK(spec_.states.empty() || spec_.kind == Collective::kCustom, InvalidArgument,
              "program '{}': only custom collectives declare state buffers ({})", name_, spec_.describe());
  for (size_t k = 0; k < spec_.states.size(); ++k) {
    const StateBufferSpec& st = spec_.states[k];
    TUTTI_CHECK(st.chunks >= 0 && st.unit >= 0, InvalidArgument,
                "program '{}': state buffer '{}' has {} chunks of unit {}", name_, st.name, st.chunks, st.unit);
    for (size_t j = 0; j < k; ++j)
      TUTTI_CHECK(spec_.states[j].name != st.name, InvalidArgument, "program '{}': two state buffers are named '{}'",
                  name_, st.name);
  }
}

Buffer Program::resolve(const Buffer& buffer) const {
  if (!is_state(buffer.kind)) return buffer;
  TUTTI_CHECK(!buffer.name.empty(), InvalidArgument, "program '{}': a state buffer is named (Buffer::state(\"m\"))",
              name_);
  try {
    return Buffer{state_buffer(spec_.state_named(buffer.name)), buffer.name};
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("program '{}': {}", name_, e.what()));
  }
}

int64_t Program::unit(const Buffer& buffer) const {
  return is_state(buffer.kind) ? spec_.states.at(static_cast<size_t>(state_index(buffer.kind))).unit : 0;
}

ChunkRef Program::chunk(int rank, const Buffer& buffer, int index, int count) {
  ChunkLoc loc{rank, resolve(buffer), index, count};
  TUTTI_CHECK(rank >= 0 && rank < nranks(), InvalidArgument, "program '{}': chunk on rank {}, which does not exist ({} ranks)",
              name_, rank, nranks());
  check_range(loc, "chunk", buffer.kind == BufferKind::kScratch);
  return ChunkRef(this, loc);
}

ChunkRef Program::group(const std::vector<ChunkRef>& refs) {
  TUTTI_CHECK(!refs.empty(), InvalidArgument, "group of no chunks");
  ChunkLoc l = refs[0].loc();
  for (size_t i = 1; i < refs.size(); ++i) {
    const ChunkLoc& n = refs[i].loc();
    TUTTI_CHECK(n.rank == l.rank && n.buffer == l.buffer && n.index == l.index + l.count, InvalidArgument,
                "group: rank {} {}[{}] does not follow rank {} {}[{}..{}) contiguously", n.rank, n.buffer.describe(),
                n.index, l.rank, l.buffer.describe(), l.index, l.index + l.count);
    l.count += n.count;
  }
  return ChunkRef(this, l);
}

void Program::check_range(const ChunkLoc& loc, const char* what, bool growing) const {
  TUTTI_CHECK(loc.count >= 1, InvalidArgument, "program '{}': {} of {} chunks on rank {}", name_, what, loc.count, loc.rank);
  if (growing) {
    TUTTI_CHECK(loc.index >= 0, InvalidArgument, "program '{}': {}: rank {} {} index {} is negative", name_, what,
                loc.rank, loc.buffer.describe(), loc.index);
    return;
  }
  int size = loc.buffer.kind == BufferKind::kInput    ? spec_.input_chunks()
             : loc.buffer.kind == BufferKind::kOutput ? spec_.output_chunks()
                                                      : spec_.states.at(static_cast<size_t>(state_index(loc.buffer.kind))).chunks;
  TUTTI_CHECK(loc.index >= 0 && loc.index + loc.count <= size, InvalidArgument,
              "program '{}': {}: rank {} {}[{}..{}) is out of range: the {} has {} chunks", name_, what, loc.rank,
              loc.buffer.describe(), loc.index, loc.index + loc.count, loc.buffer.describe(), size);
}

Content& Program::slot(int rank, const Buffer& buffer, int index) {
  RankState& st = state_[rank];
  if (buffer.kind == BufferKind::kScratch) {
    auto it = std::find(scratch_names_.begin(), scratch_names_.end(), buffer.name);
    size_t id = static_cast<size_t>(it - scratch_names_.begin());
    if (it == scratch_names_.end()) scratch_names_.push_back(buffer.name);
    for (auto& rs : state_)
      if (rs.scratch.size() <= id) rs.scratch.resize(id + 1);
    auto& v = st.scratch[id];
    if (static_cast<int>(v.size()) <= index) v.resize(index + 1);
    return v[index];
  }
  if (is_state(buffer.kind)) return st.states.at(static_cast<size_t>(state_index(buffer.kind))).at(static_cast<size_t>(index));
  Location l = spec_.canonical(rank, buffer.kind, index);
  return l.buffer == BufferKind::kInput ? st.input.at(l.index) : st.output.at(l.index);
}

const Content& Program::content(int rank, const Buffer& buffer, int index) const {
  return const_cast<Program*>(this)->slot(rank, resolve(buffer), index);
}

int Program::scratch_chunks(int rank, const std::string& name) const {
  auto it = std::find(scratch_names_.begin(), scratch_names_.end(), name);
  if (it == scratch_names_.end()) return 0;
  const auto& s = state_.at(rank).scratch;
  size_t id = static_cast<size_t>(it - scratch_names_.begin());
  return id < s.size() ? static_cast<int>(s[id].size()) : 0;
}

std::string Program::op_name(const Op& op) const {
  const char* kind = op.kind == OpKind::kCopy ? "copy" : op.kind == OpKind::kReduce ? "reduce" : "compute";
  return fmt::format("program '{}' op #{} ({} rank {} {}[{}] -> rank {} {}[{}], {} chunk(s))", name_, op.id, kind,
                     op.src.rank, op.src.buffer.describe(), op.src.index, op.dst.rank, op.dst.buffer.describe(),
                     op.dst.index, op.src.count);
}

ChunkRef Program::record(Op op) {
  op.id = static_cast<int>(ops_.size());
  std::string what = op_name(op);
  TUTTI_CHECK(op.dst.rank >= 0 && op.dst.rank < nranks(), InvalidArgument, "{}: destination rank {} does not exist ({} ranks)",
              what, op.dst.rank, nranks());
  TUTTI_CHECK(op.src.rank >= 0 && op.src.rank < nranks(), InvalidArgument, "{}: source rank {} does not exist ({} ranks)",
              what, op.src.rank, nranks());
  TUTTI_CHECK(op.src.count == op.dst.count, InvalidArgument,
              "{}: reduce of chunks with different counts (destination {}, source {})", what, op.dst.count, op.src.count);
  check_range(op.src, what.c_str(), op.src.buffer.kind == BufferKind::kScratch);
  check_range(op.dst, what.c_str(), op.dst.buffer.kind == BufferKind::kScratch);
  // A chunk of a statistic (a state buffer with its own unit) is not a chunk of data: only kernels
  // turn one into the other.
  TUTTI_CHECK(op.kind == OpKind::kCompute || unit(op.src.buffer) == unit(op.dst.buffer), InvalidArgument,
              "{}: {} chunks hold {} and {} chunks hold {}: a copy or reduction needs the same size", what,
              op.src.buffer.describe(), unit(op.src.buffer) ? fmt::format("{} element(s)", unit(op.src.buffer)) : "the call's chunk",
              op.dst.buffer.describe(), unit(op.dst.buffer) ? fmt::format("{} element(s)", unit(op.dst.buffer)) : "the call's chunk");
  std::vector<Content> incoming;
  for (int k = 0; k < op.src.count; ++k) {
    const Content& c = slot(op.src.rank, op.src.buffer, op.src.index + k);
    TUTTI_CHECK(!c.empty(), InvalidArgument, "{}: reads rank {} {}[{}], which is empty (nothing was written there)", what,
                op.src.rank, op.src.buffer.describe(), op.src.index + k);
    incoming.push_back(c);
  }
  if (op.kind == OpKind::kReduce) {
    for (int k = 0; k < op.dst.count; ++k) {
      TUTTI_CHECK(!(op.src.rank == op.dst.rank &&
                    spec_.canonical(op.src.rank, op.src.buffer.kind, op.src.index + k) ==
                        spec_.canonical(op.dst.rank, op.dst.buffer.kind, op.dst.index + k) &&
                    op.src.buffer == op.dst.buffer),
                  InvalidArgument, "{}: reduces a chunk with itself", what);
      Content& d = slot(op.dst.rank, op.dst.buffer, op.dst.index + k);
      TUTTI_CHECK(!d.empty(), InvalidArgument, "{}: reduces into rank {} {}[{}], which is empty", what, op.dst.rank,
                  op.dst.buffer.describe(), op.dst.index + k);
      d.merge(incoming[k]);
    }
  } else if (op.kind == OpKind::kCompute) {
    // Every operand on one rank with the same count; every input read before any output is written.
    std::vector<std::vector<Content>> args;
    for (const ChunkLoc& l : op.inputs) {
      TUTTI_CHECK(l.rank == op.src.rank && l.count == op.src.count, InvalidArgument,
                  "{}: operands on rank {} with {} chunk(s) and on rank {} with {}", what, op.src.rank, op.src.count,
                  l.rank, l.count);
      check_range(l, what.c_str(), l.buffer.kind == BufferKind::kScratch);
      std::vector<Content> v;
      for (int k = 0; k < l.count; ++k) {
        const Content& c = slot(l.rank, l.buffer, l.index + k);
        TUTTI_CHECK(!c.empty(), InvalidArgument, "{}: reads rank {} {}[{}], which is empty", what, l.rank,
                    l.buffer.describe(), l.index + k);
        v.push_back(c);
      }
      args.push_back(std::move(v));
    }
    for (const ChunkLoc& l : op.outputs) {
      TUTTI_CHECK(l.rank == op.src.rank && l.count == op.src.count, InvalidArgument,
                  "{}: operands on rank {} with {} chunk(s) and on rank {} with {}", what, op.src.rank, op.src.count,
                  l.rank, l.count);
      check_range(l, what.c_str(), l.buffer.kind == BufferKind::kScratch);
    }
    for (size_t j = 0; j < op.outputs.size(); ++j)
      for (int k = 0; k < op.dst.count; ++k) {
        std::vector<Content> at_k;
        for (auto& v : args) at_k.push_back(v[static_cast<size_t>(k)]);
        slot(op.outputs[j].rank, op.outputs[j].buffer, op.outputs[j].index + k) =
            Content::apply(op.kernel, at_k, op.scalars, static_cast<int>(j));
      }
  } else {
    for (int k = 0; k < op.dst.count; ++k) slot(op.dst.rank, op.dst.buffer, op.dst.index + k) = incoming[k];
  }
  ops_.push_back(op);
  return ChunkRef(this, op.dst);
}

void Program::check_postcondition() const {
  for (int r = 0; r < nranks(); ++r) {
    for (int i = 0; i < spec_.output_chunks(); ++i) {
      auto want = spec_.postcondition(r, i);
      if (!want) continue;
      const Content& got = content(r, Buffer::output(), i);
      TUTTI_CHECK(got == *want, InvalidArgument,
                  "program '{}' ({}): postcondition fails at rank {} output[{}]: holds {}, should hold {}", name_,
                  spec_.describe(), r, i, got.describe(), want->describe());
    }
    for (size_t k = 0; k < spec_.states.size(); ++k)
      for (int i = 0; i < spec_.states[k].chunks; ++i) {
        auto want = spec_.state_postcondition(r, static_cast<int>(k), i);
        if (!want) continue;
        const Content& got = state_[r].states[k][static_cast<size_t>(i)];
        TUTTI_CHECK(got == *want, InvalidArgument,
                    "program '{}' ({}): postcondition fails at rank {} state '{}'[{}]: holds {}, should hold {}", name_,
                    spec_.describe(), r, spec_.states[k].name, i, got.describe(), want->describe());
      }
  }
}

}  // namespace tutti::dsl
