#pragma once
// Plan files: tutti's JSON (plan/plan.hpp) or MSCCL's XML (compiler/msccl_xml.hpp), told apart by
// the name's extension.

#include <string>

#include "plan/plan.hpp"

namespace tutti::plan {

// .json or .xml (MSCCL): read with read_file's limits, parsed, and checked against Limits. Throws
// InvalidArgument naming the file.
Plan load_file(const std::string& path);
void save_file(const Plan& plan, const std::string& path);

}  // namespace tutti::plan
