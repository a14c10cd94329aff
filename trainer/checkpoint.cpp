#include "trainer/checkpoint.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "trainer/groups.hpp"

namespace tutti::train {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr char kMagic[4] = {'T', 'C', 'K', 'P'};
constexpr uint32_t kVersion = 1;

std::string rank_file(int rank) { return fmt::format("rank_{:05d}.bin", rank); }

uint32_t crc_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uLong crc = crc32(0L, Z_NULL, 0);
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf), static_cast<uInt>(in.gcount()));
  }
  return static_cast<uint32_t>(crc);
}

// A field of the manifest, or an error naming it.
template <class T>
T field(const json& j, const std::string& path, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key))
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: {}{} is missing", path, where, key));
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: {}{} has the wrong type", path, where, key));
  }
}

struct RankData {
  std::vector<float> params, m, v;
};

RankData read_rank_file(const std::string& dir, const json& entry, int64_t expect_count) {
  const std::string name = field<std::string>(entry, dir, "name", "files[].");
  const std::string path = dir + "/" + name;
  if (!fs::exists(path)) throw InvalidArgument(fmt::format("checkpoint {}: {} is missing", dir, name));
  const auto bytes = static_cast<int64_t>(fs::file_size(path));
  const int64_t want = 16 + 8 + 3 * 4 * expect_count;
  if (bytes != field<int64_t>(entry, dir, "bytes", "files[].") || bytes != want)
    throw InvalidArgument(fmt::format("checkpoint {}: {} has {} bytes, expected {} for {} values", dir, name, bytes,
                                      want, expect_count));
  if (crc_of(path) != field<uint32_t>(entry, dir, "crc32", "files[]."))
    throw InvalidArgument(fmt::format("checkpoint {}: {} does not match its CRC-32 in manifest.json (damaged)", dir,
                                      name));
  std::ifstream in(path, std::ios::binary);
  char magic[4];
  uint32_t version = 0, rank = 0, pad = 0;
  int64_t count = 0;
  in.read(magic, 4);
  in.read(reinterpret_cast<char*>(&version), 4);
  in.read(reinterpret_cast<char*>(&rank), 4);
  in.read(reinterpret_cast<char*>(&pad), 4);
  in.read(reinterpret_cast<char*>(&count), 8);
  if (std::memcmp(magic, kMagic, 4) != 0 || version != kVersion || count != expect_count)
    throw InvalidArgument(fmt::format("checkpoint {}: {}: header (magic, version {}, count {}) is not a version {} "
                                      "rank file of {} values",
                                      dir, name, version, count, kVersion, expect_count));
  RankData d;
  for (auto* v : {&d.params, &d.m, &d.v}) {
    v->resize(static_cast<size_t>(count));
    in.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(count * 4));
  }
  return d;
}

}  // namespace

void save_checkpoint(const std::string& dir, Trainer& trainer, tutti::Comm* world, const CheckpointInfo& info) {
  const Layout& lay = trainer.groups().layout;
  const Coordinates at = trainer.groups().at;
  const int me = world ? world->rank() : 0;
  fs::create_directories(dir);
  Ops& ops = trainer.model().ops();
  // Without ZeRO the dp ranks hold the same values, except that ep ranks hold different experts.
  const bool writes = lay.zero > 0 || at.dp_rank < lay.ep;
  if (writes) {
    Trainer::State st = trainer.state();
    const int64_t n = trainer.optimizer_size();
    std::vector<float> p(static_cast<size_t>(n)), m(p.size()), v(p.size());
    ops.download(p.data(), st.params, n);
    ops.download(m.data(), st.m, n);
    ops.download(v.data(), st.v, n);
    const std::string tmp = dir + "/" + rank_file(me) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      const uint32_t version = kVersion, rank = static_cast<uint32_t>(me), pad = 0;
      out.write(kMagic, 4);
      out.write(reinterpret_cast<const char*>(&version), 4);
      out.write(reinterpret_cast<const char*>(&rank), 4);
      out.write(reinterpret_cast<const char*>(&pad), 4);
      out.write(reinterpret_cast<const char*>(&n), 8);
      for (auto* vec : {&p, &m, &v}) out.write(reinterpret_cast<const char*>(vec->data()), n * 4);
      if (!out) throw Error(ErrorKind::kSystem, fmt::format("checkpoint {}: writing {} failed", dir, tmp));
    }
    fs::rename(tmp, dir + "/" + rank_file(me));
  }
  // Rank 0 writes the manifest once every rank file is in place.
  if (world) {
    float token = 0;
    world->all_reduce(&token, &token, 1, DataType::kFloat32, RedOp::kSum).wait();
  }
  if (me != 0) return;
  json j;
  j["format"] = "tutti-train checkpoint";
  j["version"] = kVersion;
  j["model"] = {{"vocab", info.model.vocab}, {"seq", info.model.seq}, {"layers", info.model.layers},
                {"heads", info.model.heads}, {"channels", info.model.channels}, {"experts", info.model.experts},
                {"top_k", info.model.top_k}, {"capacity", info.model.capacity}, {"aux_loss", info.model.aux_loss},
                {"moe_group", info.model.moe_group}};
  j["layout"] = {{"tp", lay.tp}, {"dp", lay.dp},         {"sp", lay.sp}, {"ep", lay.ep},
                 {"zero", lay.zero}, {"pp", lay.pp}, {"vp", lay.vp},
                 {"microbatches", lay.microbatches}, {"schedule", to_string(lay.schedule)}};
  j["optim"] = {{"lr", info.optim.lr}, {"min_lr", info.optim.min_lr}, {"warmup", info.optim.warmup},
                {"steps", info.optim.steps}, {"beta1", info.optim.beta1}, {"beta2", info.optim.beta2},
                {"eps", info.optim.eps}, {"weight_decay", info.optim.weight_decay}, {"grad_clip", info.optim.grad_clip}};
  j["step"] = info.step;
  j["seed"] = info.seed;
  j["batch"] = info.batch;
  j["data"] = {{"source", info.data}, {"position", info.step}};
  json files = json::array();
  for (int w = 0; w < lay.world(); ++w) {
    if (lay.zero == 0 && coordinates_of(lay, w).dp_rank >= lay.ep) continue;
    const std::string path = dir + "/" + rank_file(w);
    files.push_back({{"rank", w}, {"name", rank_file(w)}, {"bytes", fs::file_size(path)}, {"crc32", crc_of(path)}});
  }
  j["files"] = files;
  std::ofstream(dir + "/manifest.json.tmp") << j.dump(2) << "\n";
  fs::rename(dir + "/manifest.json.tmp", dir + "/manifest.json");
}

CheckpointInfo read_checkpoint_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  if (!in) throw InvalidArgument(fmt::format("checkpoint {}: manifest.json is missing (an unfinished save?)", dir));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: not JSON: {}", dir, e.what()));
  }
  if (field<std::string>(j, dir, "format", "") != "tutti-train checkpoint")
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: format is not \"tutti-train checkpoint\"", dir));
  if (field<uint32_t>(j, dir, "version", "") != kVersion)
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: version {} (this build reads {})", dir,
                                      j["version"].dump(), kVersion));
  CheckpointInfo info;
  const json& m = j["model"];
  info.model.vocab = field<int>(m, dir, "vocab", "model.");
  info.model.seq = field<int>(m, dir, "seq", "model.");
  info.model.layers = field<int>(m, dir, "layers", "model.");
  info.model.heads = field<int>(m, dir, "heads", "model.");
  info.model.channels = field<int>(m, dir, "channels", "model.");
  if (m.contains("experts")) {  // mixtures of experts came later: a checkpoint without them is dense
    info.model.experts = field<int>(m, dir, "experts", "model.");
    info.model.top_k = field<int>(m, dir, "top_k", "model.");
    info.model.capacity = field<float>(m, dir, "capacity", "model.");
    info.model.aux_loss = field<float>(m, dir, "aux_loss", "model.");
    info.model.moe_group = field<int>(m, dir, "moe_group", "model.");
  }
  const json& l = j["layout"];
  info.layout.tp = field<int>(l, dir, "tp", "layout.");
  info.layout.dp = field<int>(l, dir, "dp", "layout.");
  info.layout.sp = field<bool>(l, dir, "sp", "layout.");
  info.layout.zero = field<int>(l, dir, "zero", "layout.");
  // Pipeline fields came later: a checkpoint without them had none.
  if (l.contains("pp")) {
    info.layout.pp = field<int>(l, dir, "pp", "layout.");
    info.layout.vp = field<int>(l, dir, "vp", "layout.");
    if (l.contains("ep")) info.layout.ep = field<int>(l, dir, "ep", "layout.");
    info.layout.microbatches = field<int>(l, dir, "microbatches", "layout.");
    try {
      info.layout.schedule = parse_schedule(field<std::string>(l, dir, "schedule", "layout."));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: layout.schedule: {}", dir, e.what()));
    }
  }
  const json& o = j["optim"];
  info.optim.lr = field<float>(o, dir, "lr", "optim.");
  info.optim.min_lr = field<float>(o, dir, "min_lr", "optim.");
  info.optim.warmup = field<int>(o, dir, "warmup", "optim.");
  info.optim.steps = field<int>(o, dir, "steps", "optim.");
  info.optim.beta1 = field<float>(o, dir, "beta1", "optim.");
  info.optim.beta2 = field<float>(o, dir, "beta2", "optim.");
  info.optim.eps = field<float>(o, dir, "eps", "optim.");
  info.optim.weight_decay = field<float>(o, dir, "weight_decay", "optim.");
  info.optim.grad_clip = field<float>(o, dir, "grad_clip", "optim.");
  info.step = field<int>(j, dir, "step", "");
  info.seed = field<uint64_t>(j, dir, "seed", "");
  info.batch = field<int>(j, dir, "batch", "");
  info.data = field<std::string>(j["data"], dir, "source", "data.");
  try {
    info.model.validate();
    info.layout.validate(info.model, info.layout.world(), info.batch);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: {}", dir, e.what()));
  }
  if (!j.contains("files") || !j["files"].is_array())
    throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: files is missing", dir));
  return info;
}

CheckpointInfo load_checkpoint(const std::string& dir, Trainer& trainer) {
  const CheckpointInfo info = read_checkpoint_manifest(dir);
  Gpt& model = trainer.model();
  const ModelConfig& mine = model.model();
  auto differs = [&](const char* what, int saved, int now) {
    if (saved != now)
      throw InvalidArgument(fmt::format("checkpoint {}/manifest.json: model.{} is {}, this run's is {}", dir, what, saved,
                                        now));
  };
  differs("vocab", info.model.vocab, mine.vocab);
  differs("seq", info.model.seq, mine.seq);
  differs("layers", info.model.layers, mine.layers);
  differs("heads", info.model.heads, mine.heads);
  differs("channels", info.model.channels, mine.channels);
  differs("experts", info.model.experts, mine.experts);

  // Whole tensors (parameters and both moments) from the saved ranks' files.
  const ParamLayout& now = model.layout();
  std::vector<std::vector<float>> whole_p(now.tensors().size()), whole_m(whole_p.size()), whole_v(whole_p.size());
  for (size_t i = 0; i < now.tensors().size(); ++i) {
    const Tensor& t = now.tensors()[i];
    whole_p[i].assign(static_cast<size_t>(t.rows * t.cols), 0.0f);
    whole_m[i] = whole_v[i] = whole_p[i];
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < now.tensors().size(); ++i) index[now.tensors()[i].name] = i;
  const json files = json::parse(std::ifstream(dir + "/manifest.json"))["files"];
  for (const json& entry : files) {
    const int w = field<int>(entry, dir, "rank", "files[].");
    const Coordinates c = coordinates_of(info.layout, w);
    const ParamLayout saved(info.model, info.layout.tp, c.tp_rank, info.layout.dp,
                            part_of(info.model, info.layout, c.pp_rank, c.ep_rank));
    const auto ranges = saved.optimizer_ranges(info.layout.zero, c.dp_rank);
    int64_t count = 0;
    for (auto [o, n] : ranges) count += n;
    const RankData d = read_rank_file(dir, entry, count);
    int64_t k = 0;
    for (auto [offset, n] : ranges)
      for (int64_t e = 0; e < n; ++e, ++k) {
        const Tensor* t = saved.tensor_at(offset + e);
        if (!t || !index.contains(t->name)) continue;  // group padding, or a tensor of another stage
        const size_t ti = index.at(t->name);
        const int64_t wi = saved.whole_index(*t, offset + e - t->offset);
        whole_p[ti][static_cast<size_t>(wi)] = d.params[static_cast<size_t>(k)];
        whole_m[ti][static_cast<size_t>(wi)] = d.m[static_cast<size_t>(k)];
        whole_v[ti][static_cast<size_t>(wi)] = d.v[static_cast<size_t>(k)];
      }
  }

  // This rank's shard of the new layout.
  for (size_t i = 0; i < now.tensors().size(); ++i) model.set_whole(now.tensors()[i].name, whole_p[i].data());
  trainer.params_changed();
  const Layout& lay = trainer.groups().layout;
  Trainer::State st = trainer.state();
  std::vector<float> m(static_cast<size_t>(trainer.optimizer_size()), 0.0f), v(m.size(), 0.0f);
  int64_t k = 0;
  for (auto [offset, n] : now.optimizer_ranges(lay.zero, trainer.groups().at.dp_rank))
    for (int64_t e = 0; e < n; ++e, ++k) {
      const Tensor* t = now.tensor_at(offset + e);
      if (!t) continue;
      const size_t ti = index.at(t->name);
      const int64_t wi = now.whole_index(*t, offset + e - t->offset);
      m[static_cast<size_t>(k)] = whole_m[ti][static_cast<size_t>(wi)];
      v[static_cast<size_t>(k)] = whole_v[ti][static_cast<size_t>(wi)];
    }
  Ops& ops = model.ops();
  ops.upload(st.m, m.data(), trainer.optimizer_size());
  ops.upload(st.v, v.data(), trainer.optimizer_size());
  trainer.set_step(info.step);
  return info;
}

}  // namespace tutti::train
