// tutti-device-reduce-bench: how fast the device interpreter's own loops move bytes, against the
// device's copy. One rank, no peers: a one-step plan `output = input[0] (op) input[1]` (reduce) or
// `output = input[0]` (copy), run over a large buffer by as many thread blocks as the device has
// multiprocessors (instances taking rounds in turn), timed over several launches. Prints, per data
// type, GB/s counting bytes read and written, and the ratio to a device-to-device copy measured in
// the same run. Checks the first and last elements of the result against the CPU reduction.
//
//   tutti-device-reduce-bench [--bytes B] [--iters N] [--device cuda|emulated]

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/reduce.hpp"
#include "runtime/device/abi.hpp"
#include "runtime/device/backend.hpp"

using namespace tutti;
using namespace tutti::device;

namespace {

struct Image {
  DevBlock block;
  DevStep step;
  DevRef srcs[2];
  uint64_t progress[256];
};

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"device interpreter copy and reduce rates"};
  std::string bytes_text = "1G", device = "cuda";
  int iters = 10;
  app.add_option("--bytes", bytes_text, "bytes of each operand");
  app.add_option("--iters", iters, "timed launches per measurement")->check(CLI::PositiveNumber);
  app.add_option("--device", device, "cuda or emulated")->check(CLI::IsMember({"cuda", "emulated"}));
  CLI11_PARSE(app, argc, argv);
  try {
    const size_t bytes = env::parse_size(bytes_text) / 16 * 16;
    std::unique_ptr<Backend> be;
    if (device == "emulated") {
      be = make_emulated_backend();
    } else {
#ifdef TUTTI_HAVE_CUDA
      if (cuda_device_count() == 0) throw InvalidUsage("no CUDA device here (try --device emulated)");
      be = make_cuda_backend(0);
#else
      throw InvalidUsage("this build has no CUDA (try --device emulated)");
#endif
    }
    auto* in = static_cast<unsigned char*>(be->alloc(2 * bytes));
    auto* out = static_cast<unsigned char*>(be->alloc(bytes));
    auto* state = static_cast<RankState*>(be->alloc(sizeof(RankState)));
    void* status_view = nullptr;
    auto* status = static_cast<Status*>(be->alloc_host(sizeof(Status), &status_view));
    std::memset(status, 0, sizeof(Status));
    auto* image = static_cast<Image*>(be->alloc(sizeof(Image)));
    void* staging_view = nullptr;  // the result, read back where the host can see it
    auto* staging = static_cast<unsigned char*>(be->alloc_host(bytes, &staging_view));
    const int instances = std::min(256, std::max(1, be->processors()));

    auto time = [&](auto&& launch) {
      launch();  // warm-up
      be->synchronize(nullptr);
      double t0 = seconds();
      for (int i = 0; i < iters; ++i) launch();
      be->synchronize(nullptr);
      return (seconds() - t0) / iters;
    };
    double copy_s = time([&] { be->copy(out, in, bytes, nullptr); });
    std::printf("# %s, %d thread blocks, %zu bytes per operand\n", be->name(), instances, bytes);
    std::printf("# device copy (cudaMemcpyAsync): %.1f GB/s (read + write)\n", 2.0 * bytes / copy_s / 1e9);
    std::printf("#%9s %8s %12s %10s %8s\n", "type", "step", "time (us)", "GB/s", "/ copy");
    int bad = 0;
    for (int t = 0; t < kNumDataTypes; ++t) {
      const DataType type = static_cast<DataType>(t);
      const int64_t es = static_cast<int64_t>(size_of(type)), count = static_cast<int64_t>(bytes) / es;
      // Input: two pieces of small values; the result is checked at both ends.
      std::vector<unsigned char> host(2 * bytes);
      for (int64_t i : {int64_t{0}, int64_t{1}, count - 1, count, count + 1, 2 * count - 1})
        store_value(type, host.data() + i * es, static_cast<double>(i % 5));
      be->upload(in, host.data(), 2 * bytes);
      for (int reduce = 0; reduce < 2; ++reduce) {
        Image img{};
        img.block = {0, 1};
        img.step.op = reduce ? plan::Opcode::kReduce : plan::Opcode::kCopy;
        img.step.nsrcs = reduce ? 2 : 1;
        img.step.count = 1;
        img.step.dst = DevRef{0, kBufOutput};
        img.srcs[0] = DevRef{0, kBufInput};
        img.srcs[1] = DevRef{1, kBufInput};
        be->upload(image, &img, sizeof(Image));
        LaunchArgs a;
        a.blocks = &image->block;
        a.steps = &image->step;
        a.srcs = image->srcs;
        a.progress = image->progress;
        a.state = state;
        a.status = static_cast<Status*>(status_view);
        a.nblocks = 1;
        a.type = t;
        a.op = static_cast<int32_t>(RedOp::kSum);
        a.esize = es;
        a.count = count;
        a.chunk_factor = 1;
        a.round_elems = std::max<int64_t>(1, (count + instances - 1) / instances);
        a.rounds = (count + a.round_elems - 1) / a.round_elems;
        a.instances = static_cast<int32_t>(std::min<int64_t>(instances, a.rounds));
        a.bufs[kBufInput] = in;
        a.bufs[kBufOutput] = out;
        double s = time([&] { be->launch(a, 512, nullptr); });
        double moved = (reduce ? 3.0 : 2.0) * static_cast<double>(bytes);
        std::printf("%10s %8s %12.1f %10.1f %8.2f\n", std::string(name(type)).c_str(), reduce ? "reduce" : "copy",
                    s * 1e6, moved / s / 1e9, (moved / s) / (2.0 * bytes / copy_s));
        be->copy(staging, out, bytes, nullptr);
        be->synchronize(nullptr);
        for (int64_t i : {int64_t{0}, int64_t{1}, count - 1}) {
          std::vector<unsigned char> want(static_cast<size_t>(es));
          if (reduce) combine(RedOp::kSum, type, want.data(), host.data() + i * es, host.data() + (count + i) * es, 1);
          else std::memcpy(want.data(), host.data() + i * es, static_cast<size_t>(es));
          if (std::memcmp(staging + i * es, want.data(), static_cast<size_t>(es)) != 0) ++bad;
        }
      }
    }
    std::printf("# %s\n", bad ? "WRONG results" : "results checked: ok");
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutti-device-reduce-bench: %s\n", e.what());
    return 1;
  }
}
