#include "compiler/plan_file.hpp"

#include <fstream>

#include "compiler/msccl_xml.hpp"
#include "core/error.hpp"

namespace tutti::plan {

Plan load_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    if (path.size() >= 4 && path.substr(path.size() - 4) == ".xml") return import_msccl_xml(text);
    return parse_json(text);
  } catch (const Error& e) {
    rethrow_with_context(e, path);
  }
}

void save_file(const Plan& plan, const std::string& path) {
  std::ofstream out(path);
  TUTTI_CHECK(out.good(), InvalidArgument, "cannot write plan file {}", path);
  if (path.size() >= 4 && path.substr(path.size() - 4) == ".xml") out << export_msccl_xml(plan);
  else out << to_json(plan) << "\n";
}

}  // namespace tutti::plan
