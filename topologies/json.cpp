#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "topologies/topology.hpp"

namespace tutti::topo {

using nlohmann::json;

std::string to_json(const Topology& t) {
  json j;
  j["format"] = "tutti-topology";
  j["version"] = 1;
  j["name"] = t.name;
  json devs = json::array();
  for (auto& d : t.devices)
    devs.push_back({{"id", d.id}, {"type", to_string(d.type)}, {"name", d.name}, {"parent", d.parent}, {"host", d.host},
                    {"attrs", d.attrs}});
  j["devices"] = devs;
  json links = json::array();
  for (auto& l : t.links)
    links.push_back({{"a", l.a}, {"b", l.b}, {"type", to_string(l.type)}, {"gbps", l.gbps}, {"latency_us", l.latency_us},
                     {"count", l.count}});
  j["links"] = links;
  j["ranks"] = t.rank_device;
  return j.dump(1);
}

namespace {
// An integer that fits an int: nlohmann converts floats and wide integers with a plain cast.
int int_of(const json& v, const char* what) {
  TUTTI_CHECK(v.is_number_integer() && (v.is_number_unsigned() ? v.get<uint64_t>() <= INT32_MAX
                                                                 : v.get<int64_t>() >= INT32_MIN && v.get<int64_t>() <= INT32_MAX),
              InvalidArgument, "topology JSON: {} is {}, not an integer of 32 bits", what, v.dump());
  return static_cast<int>(v.get<int64_t>());
}
}  // namespace

Topology parse_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number past double
    throw InvalidArgument(fmt::format("topology JSON: not valid JSON: {}", e.what()));
  }
  try {
    TUTTI_CHECK(j.is_object(), InvalidArgument, "topology JSON: the top level is not an object");
    TUTTI_CHECK(j.value("format", "") == "tutti-topology", InvalidArgument, "topology JSON: format is not 'tutti-topology'");
    TUTTI_CHECK(j.contains("version") && int_of(j["version"], "version") == 1, InvalidArgument,
                "topology JSON: version {} is not supported", j.value("version", json()).dump());
    Topology t;
    t.name = j.at("name").get<std::string>();
    for (auto& d : j.at("devices")) {
      Device dev;
      dev.id = int_of(d.at("id"), "a device's id");
      auto type = parse_device_type(d.at("type").get<std::string>());
      TUTTI_CHECK(type.has_value(), InvalidArgument, "topology JSON: device {} has unknown type '{}'", dev.id,
                  d.at("type").get<std::string>());
      TUTTI_CHECK(dev.id == static_cast<int>(t.devices.size()), InvalidArgument, "topology JSON: device ids must be 0..n-1 in order");
      dev.type = *type;
      dev.name = d.at("name");
      dev.parent = int_of(d.at("parent"), "a device's parent");
      dev.host = int_of(d.at("host"), "a device's host");
      dev.attrs = d.at("attrs").get<std::map<std::string, std::string>>();
      t.devices.push_back(dev);
    }
    for (auto& l : j.at("links")) {
      auto type = parse_link_type(l.at("type").get<std::string>());
      TUTTI_CHECK(type.has_value(), InvalidArgument, "topology JSON: link of unknown type '{}'", l.at("type").get<std::string>());
      Link link{int_of(l.at("a"), "a link's a"), int_of(l.at("b"), "a link's b"), *type, l.at("gbps").get<double>(),
                l.at("latency_us").get<double>(), int_of(l.at("count"), "a link's count")};
      TUTTI_CHECK(link.a >= 0 && link.b >= 0 && link.a < static_cast<int>(t.devices.size()) &&
                      link.b < static_cast<int>(t.devices.size()),
                  InvalidArgument, "topology JSON: link {}-{} names a device that does not exist", link.a, link.b);
      t.links.push_back(link);
    }
    TUTTI_CHECK(j.at("ranks").is_array(), InvalidArgument, "topology JSON: ranks is not an array");
    for (const json& r : j.at("ranks")) t.rank_device.push_back(int_of(r, "a rank's device"));
    for (int d : t.rank_device)
      TUTTI_CHECK(d >= 0 && d < static_cast<int>(t.devices.size()), InvalidArgument, "topology JSON: rank on device {}", d);
    return t;
  } catch (const json::exception& e) {
    throw InvalidArgument(fmt::format("topology JSON: {}", e.what()));
  }
}

Topology load_file(const std::string& path) {
  std::ifstream in(path);
  TUTTI_CHECK(in.good(), InvalidArgument, "cannot open topology file {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    Topology t = path.size() >= 4 && path.substr(path.size() - 4) == ".xml" ? import_nccl_xml(ss.str()) : parse_json(ss.str());
    if (t.name.empty()) t.name = path;
    return t;
  } catch (const Error& e) {
    rethrow_with_context(e, path);
  }
}

}  // namespace tutti::topo
