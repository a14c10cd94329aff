// tutti-train: trains a GPT on tutti's collectives, alone or under a launcher.
//
//   tutti-train [--steps 200] [--layers 4 --heads 4 --channels 128 --seq 64] [--batch 16]
//               [--tp 1 --dp 1 --sp --zero 0] [--pp 1 --schedule 1f1b --microbatches 1 --vp 1]
//               [--data FILE] [--out DIR] ...
//   tutti-run -n 4 build/bin/tutti-train --tp 2 --dp 2 --zero 1 --steps 200
//   tutti-run -n 2 build/bin/tutti-train --pp 2 --schedule 1f1b --microbatches 8
//   tutti-run -n 4 build/bin/tutti-train --dp 4 --ep 2 --experts 4 --top-k 2 --capacity 1.25
//   tutti-train schedule --pp 4 --schedule interleaved --vp 2 [--microbatches 8] [--svg FILE]
//   tutti-train sample --checkpoint DIR [--tokens 300] [--prompt TEXT] [--temperature 0.8]
//
// Prints a line per step (loss, learning rate, gradient norm, tokens/s, MFU against a GEMM peak
// measured at start, time blocked on communication), the validation loss every --eval-every steps,
// and writes metrics.jsonl, loss.png (gnuplot) and checkpoints into --out.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "trainer/checkpoint.hpp"
#include "trainer/data.hpp"
#include "trainer/groups.hpp"
#include "trainer/trainer.hpp"

using namespace tutti;
using namespace tutti::train;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool launched() {
  for (const char* v : {"TUTTI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"})
    if (std::getenv(v)) return true;
  return false;
}

// FLOP/s of this rank's GEMMs at the model's widths: the peak MFU is measured against.
double gemm_peak(Ops& ops, int channels) {
  const int64_t n = 512, c = std::max(channels, 256), oc = 4 * c;
  float* a = ops.alloc(n * c);
  float* w = ops.alloc(oc * c);
  float* out = ops.alloc(n * oc);
  double best = 0;
  float sink = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = Clock::now();
    ops.matmul(out, a, w, nullptr, n, c, oc);
    ops.download(&sink, out, 1);  // a device's GEMM is asynchronous: wait for it
    const double s = seconds_since(t0);
    if (rep > 0 && s > 0) best = std::max(best, 2.0 * n * c * oc / s);  // the first one warms up
  }
  ops.release(a);
  ops.release(w);
  ops.release(out);
  return best;
}

// The loss curve from metrics.jsonl (the whole run, resumed parts included) through gnuplot.
void plot(const fs::path& metrics, const fs::path& png) {
  const fs::path train_dat = png.parent_path() / "loss.dat", val_dat = png.parent_path() / "val_loss.dat";
  {
    std::ifstream in(metrics);
    std::ofstream train(train_dat), val(val_dat);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("step")) continue;
      if (j.contains("loss")) train << j["step"] << " " << j["loss"] << "\n";
      if (j.contains("val_loss")) val << j["step"] << " " << j["val_loss"] << "\n";
    }
  }
  FILE* p = popen("gnuplot 2>/dev/null", "w");
  if (!p) {
    fmt::print(stderr, "tutti-train: gnuplot not found; no {}\n", png.string());
    return;
  }
  fmt::print(p,
             "set terminal pngcairo size 900,500\nset output '{}'\nset xlabel 'step'\nset ylabel 'loss'\nset grid\n"
             "plot '{}' with lines title 'train', '{}' with linespoints title 'validation'\n",
             png.string(), train_dat.string(), val_dat.string());
  if (pclose(p) != 0 || !fs::exists(png))
    fmt::print(stderr, "tutti-train: gnuplot failed; no {} (apt-get install gnuplot-nox)\n", png.string());
}

int sample(const std::string& dir, int tokens, const std::string& prompt, float temperature, uint64_t seed,
           int threads) {
  const CheckpointInfo info = read_checkpoint_manifest(dir);
  auto ops = make_cpu_ops(threads);
  Groups groups = Groups::single(Layout{});
  Trainer trainer(info.model, info.optim, groups, *ops, 1, info.seed);
  load_checkpoint(dir, trainer);
  Gpt& m = trainer.model();
  const int T = info.model.seq, V = info.model.vocab;
  std::vector<int32_t> text;
  for (unsigned char c : prompt) text.push_back(c % V);
  if (text.empty()) text.push_back('\n' % V);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> seq(static_cast<size_t>(T + 1));
  std::vector<float> row(static_cast<size_t>(V));
  fmt::print("{}", prompt);
  for (int k = 0; k < tokens; ++k) {
    // The last T tokens of the text (the model's window), the rest of the window unused.
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(text.size()) - T);
    const int64_t len = static_cast<int64_t>(text.size()) - start;
    std::fill(seq.begin(), seq.end(), 0);
    std::copy(text.begin() + start, text.end(), seq.begin());
    m.forward(seq.data());
    ops->download(row.data(), m.logits() + (len - 1) * V, V);  // rows t * B + b with B = 1
    const float mx = *std::max_element(row.begin(), row.end());
    double sum = 0;
    for (float& x : row) sum += (x = std::exp((x - mx) / std::max(temperature, 1e-3f)));
    double pick = std::uniform_real_distribution<double>(0, sum)(rng);
    int next = V - 1;
    for (int v = 0; v < V; ++v)
      if ((pick -= row[static_cast<size_t>(v)]) <= 0) {
        next = v;
        break;
      }
    text.push_back(next);
    std::fputc(next < 256 ? next : '?', stdout);
    std::fflush(stdout);
  }
  fmt::print("\n");
  return 0;
}

}  // namespace

// Prints a schedule's check: the time line, bubble against 1F1B's formula, activation peaks; and
// draws it as SVG.
int show_schedule(const Layout& layout, const std::string& svg) {
  const Schedule s = make_schedule(layout.schedule, layout.pp, layout.microbatches, layout.vp);
  const ScheduleReport rep = check_schedule(s);
  fmt::print("{} schedule, pp {}, vp {}, {} micro-batches: checked (every message matched, no deadlock)\n",
             to_string(s.kind), s.pp, s.vp, s.microbatches);
  fmt::print("time line (F forward, B backward, W weight gradient, then the micro-batch; lower case: odd chunks):\n{}",
             render_timeline(s, rep));
  fmt::print("bubble {:.3f} (1F1B's (p-1)/(m+p-1) = {:.3f}); makespan {} units (forward 1, backward 2)\n", rep.bubble,
             pipeline_bubble_formula(s.pp, s.microbatches), rep.makespan);
  std::string peaks;
  for (int p : rep.peak_activations) peaks += fmt::format(" {}", p);
  fmt::print("peak activations per rank, in micro-batch chunks of {} layer(s) each:{}\n", "L/(pp*vp)", peaks);
  if (!svg.empty()) {
    std::ofstream(svg) << render_svg(s, rep);
    fmt::print("picture: {}\n", svg);
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"tutti-train: train a GPT on tutti's collectives (alone, or under tutti-run / mpirun)"};
  app.require_subcommand(0, 1);
  ModelConfig model;
  Layout layout;
  OptimConfig optim;
  int batch = 16, eval_every = 50, eval_batches = 4, ckpt_every = 0, threads = 0;
  uint64_t seed = 1337;
  std::string data_path = kJargonFile, out_dir = "runs/tutti-train", resume;
  optim.steps = 200;
  optim.warmup = 10;
  optim.lr = 1e-3f;  // small models on bytes (nanoGPT's character-level settings)
  optim.min_lr = 1e-4f;
  app.add_option("--steps", optim.steps, "training steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--layers", model.layers, "transformer blocks")->capture_default_str();
  app.add_option("--heads", model.heads, "attention heads")->capture_default_str();
  app.add_option("--channels", model.channels, "width of the residual stream")->capture_default_str();
  app.add_option("--seq", model.seq, "tokens per sequence")->capture_default_str();
  app.add_option("--vocab", model.vocab, "vocabulary size (byte data: 256; llm.c .bin: 50257 or more)")
      ->capture_default_str();
  app.add_option("--batch", batch, "sequences per step, over all dp ranks")->capture_default_str();
  app.add_option("--lr", optim.lr, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", optim.min_lr, "final learning rate of the cosine schedule")->capture_default_str();
  app.add_option("--warmup", optim.warmup, "steps of linear warmup")->capture_default_str();
  app.add_option("--weight-decay", optim.weight_decay, "AdamW's decoupled weight decay (2-D tensors)")
      ->capture_default_str();
  app.add_option("--grad-clip", optim.grad_clip, "clip the global gradient norm to this (0: off)")
      ->capture_default_str();
  app.add_option("--seed", seed, "initialisation seed")->capture_default_str();
  app.add_option("--tp", layout.tp, "tensor-parallel ranks")->capture_default_str();
  app.add_option("--dp", layout.dp, "data-parallel ranks")->capture_default_str();
  app.add_flag("--sp", layout.sp, "sequence parallel (with --tp)");
  app.add_option("--zero", layout.zero, "ZeRO stage over the dp ranks (0-3)")->capture_default_str();
  app.add_option("--pp", layout.pp, "pipeline-parallel ranks")->capture_default_str();
  app.add_option("--ep", layout.ep, "expert-parallel ranks (split the dp ranks; needs --experts)")->capture_default_str();
  app.add_option("--experts", model.experts, "experts per layer's MLP (0: dense)")->capture_default_str();
  app.add_option("--top-k", model.top_k, "experts per token: 1 or 2")->capture_default_str();
  app.add_option("--capacity", model.capacity, "expert capacity factor (0: dropless)")->capture_default_str();
  app.add_option("--aux-loss", model.aux_loss, "the load-balancing loss's coefficient")->capture_default_str();
  app.add_option("--moe-group", model.moe_group, "sequences per routing group (0: a forward's batch)")
      ->capture_default_str();
  app.add_option("--vp", layout.vp, "model chunks per pipeline rank (interleaved)")->capture_default_str();
  CLI::Option* mb_opt =
      app.add_option("--microbatches", layout.microbatches, "micro-batches per step and dp rank")->capture_default_str();
  std::string schedule_name = "1f1b";
  app.add_option("--schedule", schedule_name, "pipeline schedule: gpipe, 1f1b, interleaved, zb-h1")
      ->capture_default_str();
  app.add_option("--threads", threads, "compute threads per rank (0: this host's cores over its ranks)");
  std::string device = "cpu";
  app.add_option("--device", device, "cpu, or cuda (GPU 0; ranks share it)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  bool bf16 = false;
  app.add_flag("--bf16", bf16, "with --device cuda: bfloat16 GEMMs on the tensor cores, float32 master weights");
  app.add_option("--data", data_path, "text (bytes, gzip or plain) or llm.c .bin tokens")->capture_default_str();
  app.add_option("--eval-every", eval_every, "validation loss every K steps (0: never)")->capture_default_str();
  app.add_option("--eval-batches", eval_batches, "batches of validation data per evaluation")->capture_default_str();
  app.add_option("--checkpoint-every", ckpt_every, "save a checkpoint every K steps (0: only at the end)");
  app.add_option("--resume", resume, "continue from this checkpoint directory (any layout)");
  app.add_option("--out", out_dir, "metrics.jsonl, loss.png and checkpoints go here")->capture_default_str();
  CLI::App* samp = app.add_subcommand("sample", "print text generated from a checkpoint");
  std::string ckpt, prompt;
  int gen_tokens = 300;
  float temperature = 0.8f;
  samp->add_option("--checkpoint", ckpt, "checkpoint directory")->required();
  samp->add_option("--tokens", gen_tokens, "tokens to generate")->capture_default_str();
  samp->add_option("--prompt", prompt, "text to start from");
  samp->add_option("--temperature", temperature, "softmax temperature")->capture_default_str();
  CLI::App* sched = app.add_subcommand("schedule", "check a pipeline schedule and print its time line");
  sched->fallthrough();  // --pp, --schedule, --vp, --microbatches are the main options
  std::string svg;
  sched->add_option("--svg", svg, "also draw the time line into this SVG file");
  CLI11_PARSE(app, argc, argv);

  try {
    layout.schedule = parse_schedule(schedule_name);
    if (sched->parsed()) {
      if (mb_opt->count() == 0) layout.microbatches = (std::max(8, 2 * layout.pp) + layout.pp - 1) / layout.pp * layout.pp;
      if (svg.empty()) svg = fmt::format("schedule_{}_pp{}.svg", to_string(layout.schedule), layout.pp);
      return show_schedule(layout, svg);
    }
    if (samp->parsed()) return sample(ckpt, gen_tokens, prompt, temperature, seed, threads);

    // Everything that can be refused is refused before any work.
    std::optional<Comm> world;
    int world_size = 1, me = 0;
    if (launched()) {
      world.emplace(Comm::from_env());
      world_size = world->size();
      me = world->rank();
    }
    layout.validate(model, world_size, batch);
    if (eval_batches < 1) throw InvalidArgument("--eval-batches must be at least 1");
    if (threads == 0)
      threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, world_size));
    TokenStream all = load_tokens(data_path);
    if (all.vocab > model.vocab)
      throw InvalidArgument(fmt::format("--vocab {} is smaller than the data's vocabulary of {} ({})", model.vocab,
                                        all.vocab, data_path));
    TokenStream train, val;
    split_train_val(all, train, val);

    Groups groups = world ? Groups::make(*world, layout) : Groups::single(layout);
    if (bf16 && device != "cuda") throw InvalidArgument("--bf16 needs --device cuda");
    auto ops = device == "cuda" ? make_cuda_ops(0, bf16) : make_cpu_ops(threads);
    Trainer trainer(model, optim, groups, *ops, batch, seed);
    int first = 0;
    if (!resume.empty()) {
      const CheckpointInfo saved = read_checkpoint_manifest(resume);
      // Batches are cut by step * batch: another batch size would not continue the same data.
      if (saved.batch != batch)
        throw InvalidArgument(fmt::format("--resume {}: the checkpoint was trained with --batch {}, this run asks for {}",
                                          resume, saved.batch, batch));
      first = load_checkpoint(resume, trainer).step;
    }
    const double peak = gemm_peak(*ops, model.channels);
    const fs::path out(out_dir), metrics = out / "metrics.jsonl";
    if (me == 0) {
      fs::create_directories(out);
      fmt::print("tutti-train: {} ({:.2f} M parameters), {} on {} rank(s) x {} thread(s); batch {} x {} tokens; data {} "
                 "({} train, {} validation tokens); {} GEMM peak {:.1f} GFLOP/s per rank\n",
                 model.describe(), model.parameters() / 1e6, layout.describe(), world_size, threads, batch, model.seq,
                 data_path, train.tokens.size(), val.tokens.size(), ops->name(), peak / 1e9);
    }
    std::ofstream jsonl;
    if (me == 0) jsonl.open(metrics, first > 0 ? std::ios::app : std::ios::trunc);
    const int per = batch / layout.dp;
    std::vector<int32_t> seqs(static_cast<size_t>(per) * (model.seq + 1));
    auto save = [&](int step) {
      CheckpointInfo info{model, layout, optim, step, seed, batch, data_path};
      const std::string dir = (out / fmt::format("checkpoint_{:06d}", step)).string();
      save_checkpoint(dir, trainer, world ? &*world : nullptr, info);
      if (me == 0) fmt::print("saved {}\n", dir);
    };
    double first_loss = 0, last_loss = 0;
    std::vector<double> bubbles;  // per step: the time ranks waited on neighbouring stages, mean over ranks
    int slots = 0;
    for (int step = first; step < optim.steps; ++step) {
      const auto t0 = Clock::now();
      cut_batch(train, step, batch, groups.at.dp_rank * per, per, model.seq, seqs.data());
      const StepResult r = trainer.step(seqs.data());
      const double dt = seconds_since(t0);
      const double tok_s = batch * static_cast<double>(model.seq) / dt;
      const double mfu = peak > 0 ? model.flops_per_token() * tok_s / (peak * world_size) : 0;
      if (step == first) first_loss = r.loss;
      last_loss = r.loss;
      if (layout.pp > 1) {
        double frac[2] = {r.pipeline_wait_s / dt, static_cast<double>(r.activation_slots)};
        world->all_reduce(frac, frac, 1, DataType::kFloat64, RedOp::kSum).wait();
        world->all_reduce(frac + 1, frac + 1, 1, DataType::kFloat64, RedOp::kMax).wait();
        bubbles.push_back(frac[0] / world_size);
        slots = static_cast<int>(frac[1]);
      }
      if (me == 0) {
        const std::string pipe = layout.pp > 1 ? fmt::format(" | pipeline wait {:.0f}% | {} activation slots",
                                                             100 * r.pipeline_wait_s / dt, r.activation_slots)
                                               : "";
        fmt::print("step {:5d}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:8.0f} tok/s | MFU {:5.1f}% | comm {:.1f} ms "
                   "({:.0f}%){}\n",
                   step + 1, optim.steps, r.loss, r.lr, r.grad_norm, tok_s, 100 * mfu, 1e3 * r.comm_wait_s,
                   100 * r.comm_wait_s / dt, pipe);
        jsonl << fmt::format("{{\"step\":{},\"loss\":{:.6f},\"lr\":{:.6e},\"grad_norm\":{:.6f},\"tokens_per_s\":{:.1f},"
                             "\"mfu\":{:.5f},\"comm_wait_s\":{:.6f},\"pipeline_wait_s\":{:.6f},\"step_s\":{:.6f}}}\n",
                             step + 1, r.loss, r.lr, r.grad_norm, tok_s, mfu, r.comm_wait_s, r.pipeline_wait_s, dt);
        jsonl.flush();
      }
      const bool last = step + 1 == optim.steps;
      if ((eval_every > 0 && (step + 1) % eval_every == 0) || last) {
        double v = 0;
        for (int k = 0; k < eval_batches; ++k) {
          cut_batch(val, k, batch, groups.at.dp_rank * per, per, model.seq, seqs.data());
          v += trainer.evaluate(seqs.data());
        }
        v /= eval_batches;
        if (me == 0) {
          fmt::print("step {:5d} | validation loss {:.4f}\n", step + 1, v);
          jsonl << fmt::format("{{\"step\":{},\"val_loss\":{:.6f}}}\n", step + 1, v);
          jsonl.flush();
        }
      }
      if ((ckpt_every > 0 && (step + 1) % ckpt_every == 0) || last) save(step + 1);
    }
    if (me == 0 && !bubbles.empty()) {
      // The first steps warm caches and allocate slots: the median of the second half.
      std::vector<double> late(bubbles.begin() + static_cast<std::ptrdiff_t>(bubbles.size() / 2), bubbles.end());
      std::nth_element(late.begin(), late.begin() + static_cast<std::ptrdiff_t>(late.size() / 2), late.end());
      const ScheduleReport& rep = trainer.schedule_report();
      fmt::print("pipeline {}: measured bubble {:.3f} (time waiting on neighbouring stages, mean over ranks, median "
                 "over the last {} steps); the checker predicts {:.3f} with equal stages; 1F1B's formula {:.3f}; "
                 "activation slots {} (predicted peak {})\n",
                 to_string(layout.schedule), late[late.size() / 2], late.size(), rep.bubble,
                 pipeline_bubble_formula(layout.pp, layout.microbatches), slots,
                 *std::max_element(rep.peak_activations.begin(), rep.peak_activations.end()));
    }
    if (me == 0) {
      jsonl.close();
      plot(metrics, out / "loss.png");
      fmt::print("done: loss {:.4f} -> {:.4f}; {} and {}\n", first_loss, last_loss, metrics.string(),
                 (out / "loss.png").string());
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "tutti-train: {}\n", e.what());
    return 1;
  }
}
