// tutti-compile: builds, verifies and converts plans.
//
//   tutti-compile --list
//   tutti-compile --builtin NAME --ranks N [--param k=v ...] [--instances K] [--no-fuse] [-o plan.json|plan.xml]
//   tutti-compile --import FILE.{xml,json} [--verify] [-o FILE.{json,xml}]
//
// Verification prints what it proved (collective, ranks, chunks, steps, blocks, FIFO depth needed) or
// the violation, and the exit status is non-zero on any failure.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "compiler/plan_file.hpp"
#include "core/env.hpp"
#include "core/error.hpp"

using namespace tutti;

int main(int argc, char** argv) {
  CLI::App app{"tutti-compile: build, verify and convert collective plans"};
  bool list = false, verify_flag = false, no_fuse = false, batched = false;
  std::string builtin, import, output;
  int ranks = 0, instances = 1;
  int64_t fifo_depth = 0;
  std::vector<std::string> params;
  app.add_flag("--list", list, "list the built-in algorithms and their parameters");
  app.add_option("--builtin", builtin, "built-in algorithm to compile");
  app.add_option("--ranks", ranks, "number of ranks");
  app.add_option("--param,-p", params, "algorithm parameter k=v (repeatable)");
  app.add_option("--instances", instances, "replicate the plan K times on smaller chunks");
  app.add_flag("--batched", batched, "lay instances out in batches instead of interleaved");
  app.add_flag("--no-fuse", no_fuse, "skip instruction fusion");
  app.add_option("--import", import, "plan to read (.xml: MSCCL, .json: tutti)");
  app.add_flag("--verify", verify_flag, "verify the imported plan");
  app.add_option("--fifo-depth", fifo_depth, "verify with FIFOs of this many messages (default: find the minimum)");
  app.add_option("-o,--output", output, "write the plan (.json or .xml)");
  std::string min_bytes, max_bytes;
  app.add_option("--min-bytes", min_bytes, "smallest call (bytes, K/M/G) the plan is used for");
  app.add_option("--max-bytes", max_bytes, "largest call (bytes, K/M/G) the plan is used for");
  CLI11_PARSE(app, argc, argv);

  try {
    if (list) {
      for (const auto& b : algorithms::builtins()) {
        std::printf("%-20s %-14s %s\n", b.name.c_str(), to_string(b.collective), b.description.c_str());
        for (const auto& p : b.params)
          std::printf("%-20s   --param %s=%d  %s\n", "", p.name.c_str(), p.fallback, p.meaning.c_str());
      }
      return 0;
    }
    plan::VerifyOptions vopt;
    vopt.fifo_depth = fifo_depth;
    plan::Plan result;
    if (!builtin.empty()) {
      if (ranks < 1) throw InvalidArgument("--builtin needs --ranks N (N >= 1)");
      algorithms::Params given = algorithms::parse_params(params);
      dsl::Program program = algorithms::build(builtin, ranks, given);
      plan::CompileOptions copt;
      copt.fuse = !no_fuse;
      copt.instances = instances;
      copt.policy = batched ? plan::InstancePolicy::kBatched : plan::InstancePolicy::kInterleaved;
      copt.verify = vopt;
      plan::Compiled c = plan::compile(program, copt);
      std::printf("%s\n", c.report.summary(c.plan).c_str());
      std::printf("fusion: %lld steps in %lld blocks before, %lld steps in %lld blocks after\n",
                  static_cast<long long>(c.steps_before_fusion), static_cast<long long>(c.blocks_before_fusion),
                  static_cast<long long>(c.plan.steps()), static_cast<long long>(c.plan.blocks()));
      result = std::move(c.plan);
    } else if (!import.empty()) {
      std::vector<std::string> warnings;
      if (import.size() >= 4 && import.substr(import.size() - 4) == ".xml") {
        std::ifstream in(import);
        if (!in) throw InvalidArgument(fmt::format("cannot open {}", import));
        std::stringstream ss;
        ss << in.rdbuf();
        try {
          result = plan::import_msccl_xml(ss.str(), &warnings);
        } catch (const Error& e) {
          rethrow_with_context(e, import);
        }
      } else {
        result = plan::load_file(import);
      }
      for (const auto& w : warnings) std::fprintf(stderr, "%s: warning: %s\n", import.c_str(), w.c_str());
      if (verify_flag) {
        plan::VerifyReport rep = plan::certify(result, vopt);  // a saved plan states what was proved
        std::printf("%s\n", rep.summary(result).c_str());
      } else {
        std::printf("imported %s '%s': %d ranks, %lld steps in %lld blocks (not verified; add --verify)\n",
                    to_string(result.collective), result.name.c_str(), result.nranks,
                    static_cast<long long>(result.steps()), static_cast<long long>(result.blocks()));
      }
    } else {
      std::fprintf(stderr, "tutti-compile: give --list, --builtin or --import (see --help)\n");
      return 2;
    }
    // The size window the dispatcher uses the plan in (MSCCL's minBytes/maxBytes).
    auto size_of_flag = [](const char* flag, const std::string& v) {
      try {
        return env::parse_size(v);
      } catch (const std::exception&) {
        throw InvalidArgument(fmt::format("{} '{}' is not a size (bytes, or with K/M/G)", flag, v));
      }
    };
    if (!min_bytes.empty()) result.min_bytes = size_of_flag("--min-bytes", min_bytes);
    if (!max_bytes.empty()) result.max_bytes = size_of_flag("--max-bytes", max_bytes);
    if (result.min_bytes > result.max_bytes)
      throw InvalidArgument(fmt::format("the size window is empty: --min-bytes {} is above --max-bytes {}",
                                        result.min_bytes, result.max_bytes));
    if (!output.empty()) {
      plan::save_file(result, output);
      std::printf("wrote %s\n", output.c_str());
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "tutti-compile: %s\n", e.what());
    return 1;
  }
}
