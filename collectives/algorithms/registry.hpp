#pragma once
// Built-in algorithms, written with the DSL. Each has a name (used by tutti-compile and the
// dispatcher), the collective it implements, integer parameters with defaults, and a check of the
// rank counts it supports.

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tutti/dsl.hpp"

namespace tutti::algorithms {

struct Param {
  std::string name;
  int fallback;
  std::string meaning;
};

using Params = std::map<std::string, int>;

struct Builtin {
  std::string name;
  Collective collective;
  std::string description;
  std::vector<Param> params;
  // Empty when nranks/params are supported, else the reason.
  std::function<std::string(int nranks, const Params&)> supports;
  std::function<dsl::Program(int nranks, const Params&)> build;
};

const std::vector<Builtin>& builtins();
const Builtin& find_builtin(const std::string& name);  // throws InvalidArgument listing the names

// Fills defaults, rejects unknown parameters and unsupported rank counts (InvalidArgument naming them).
Params resolve(const Builtin& b, int nranks, const Params& given);
dsl::Program build(const std::string& name, int nranks, const Params& given = {});
// "k=v" strings (command lines) to Params; InvalidArgument names a malformed one.
Params parse_params(const std::vector<std::string>& kvs);

// The built-in plan the dispatcher runs for host memory where no table, plan file or forced
// algorithm decides and the call does not take the one-shot path: latency-bound sizes want few
// steps, bandwidth-bound ones want every byte to cross each link once. (The calibration measures
// the one-shot path against it.) `crowded`: every rank is on one host with more ranks than cores
// (Communicator::crowded_host), where a pipeline whose stages wait for ranks that are not running
// loses to fewer, longer steps.
std::string default_algorithm(Collective c, uint64_t bytes, int nranks, bool crowded);

// Families (one file each).
void register_allreduce(std::vector<Builtin>& out);
void register_allgather(std::vector<Builtin>& out);
void register_reducescatter(std::vector<Builtin>& out);
void register_rooted(std::vector<Builtin>& out);  // broadcast, reduce, gather, scatter
void register_alltoall(std::vector<Builtin>& out);

// Helpers shared by the algorithms.
CollectiveSpec spec_of(Collective c, int nranks, int chunk_factor, bool inplace, int root = 0);
// The buffer an algorithm works in: the input when in-place, else the output.
dsl::Buffer work_buffer(const dsl::Program& p);
// Out-of-place: copies every rank's input into its output at the same index (0 when in-place).
void copy_input_to_output(dsl::Program& p);
std::string needs_divisor(int nranks, int local, const char* param);

}  // namespace tutti::algorithms
