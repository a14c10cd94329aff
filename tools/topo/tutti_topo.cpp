// tutti-topo: shows a topology.
//
//   tutti-topo                                  the machine we run on, as a tree
//   tutti-topo --preset dgx-h100 [--nodes 2]    a preset (dgx1, dgx-a100, ndv4, dgx-h100, ndv5, ncv4, pcie8, cpu-tcp)
//   tutti-topo --load FILE.{xml,json}           an NCCL topology XML or a tutti topology JSON
//   tutti-run -n N tutti-topo --world           every rank's host merged through the bootstrap (rank 0 prints)
//   ... [--json | --export-nccl-xml | --dot]    output format (default: readable tree)

#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>

#include "collectives/tuner.hpp"
#include "core/error.hpp"
#include "runtime/communicator.hpp"
#include "topologies/topology.hpp"

using namespace tutti;
using namespace tutti::topo;

namespace {

void print_tree(const Topology& t) {
  std::printf("topology %s: %d host(s), %d NUMA node(s), %d GPU(s), %d NIC(s), %d NVSwitch(es), %d rank(s)\n",
              t.name.c_str(), t.count(DeviceType::kHost), t.count(DeviceType::kNuma), t.count(DeviceType::kGpu),
              t.count(DeviceType::kNic), t.count(DeviceType::kNvSwitch), t.nranks());
  std::vector<std::vector<int>> kids(t.devices.size());
  for (auto& d : t.devices)
    if (d.parent >= 0) kids[d.parent].push_back(d.id);
  auto uplink = [&](const Device& d) -> std::string {
    for (auto& l : t.links)
      if ((l.a == d.id && l.b == d.parent) || (l.b == d.id && l.a == d.parent))
        return fmt::format(" [{} {:.1f} GB/s]", to_string(l.type), l.gbps);
    return "";
  };
  std::function<void(int, int)> show = [&](int id, int depth) {
    const Device& d = t.devices[id];
    std::string extra;
    for (const char* k : {"sm", "speed", "cores", "busid", "pci.busid"})
      if (d.attrs.count(k)) extra += fmt::format(" {}={}", k, d.attrs.at(k));
    std::printf("%*s%s %s%s%s\n", depth * 2, "", to_string(d.type), d.name.c_str(), extra.c_str(), uplink(d).c_str());
    for (int c : kids[id]) show(c, depth + 1);
  };
  for (auto& d : t.devices)
    if (d.parent < 0) show(d.id, 0);
  std::printf("links between devices:\n");
  for (auto& l : t.links) {
    if (l.type == LinkType::kPcie) continue;
    std::printf("  %s <-> %s: %s x%d, %.1f GB/s, %.1f us\n", t.devices[l.a].name.c_str(), t.devices[l.b].name.c_str(),
                to_string(l.type), l.count, l.gbps, l.latency_us);
  }
  if (t.nranks() > 1) {
    Path p = t.path(0, t.nranks() - 1);
    std::printf("rank 0 -> rank %d: %.1f GB/s bottleneck, %.1f us, %zu hop(s)\n", t.nranks() - 1, p.gbps, p.latency_us,
                p.hops.size());
  }
}

void print_dot(const Topology& t) {
  std::printf("graph \"%s\" {\n  node [shape=box];\n", t.name.c_str());
  for (auto& d : t.devices)
    std::printf("  d%d [label=\"%s\\n%s\"%s];\n", d.id, to_string(d.type), d.name.c_str(),
                d.type == DeviceType::kGpu ? ", style=filled, fillcolor=palegreen" : "");
  for (auto& l : t.links)
    std::printf("  d%d -- d%d [label=\"%s %.0f\"%s];\n", l.a, l.b, to_string(l.type), l.gbps,
                l.type == LinkType::kNvLink || l.type == LinkType::kXgmi ? ", color=green" : "");
  std::printf("}\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tutti-topo: show a topology (detected, preset or loaded)"};
  std::string preset_name, load;
  int nodes = 1;
  bool json = false, xml = false, dot = false, world = false;
  app.add_option("--preset", preset_name, "preset machine: dgx1, dgx-a100, ndv4, dgx-h100, ndv5, ncv4, pcie8, cpu-tcp");
  app.add_option("--nodes", nodes, "nodes of the preset, joined by a fat tree");
  app.add_option("--load", load, "NCCL topology XML or tutti topology JSON");
  app.add_flag("--json", json, "print tutti's JSON");
  app.add_flag("--export-nccl-xml", xml, "print NCCL's topology XML");
  app.add_flag("--dot", dot, "print a Graphviz graph");
  app.add_flag("--world", world, "under a launcher: the world topology of all ranks' hosts, merged through the bootstrap");
  CLI11_PARSE(app, argc, argv);
  try {
    Topology t;
    if (world) {
      auto comm = Communicator::create_from_env();
      t = tuning::live_topology(*comm);
      if (comm->rank() != 0) return 0;
    } else {
      t = !load.empty() ? load_file(load) : !preset_name.empty() ? preset(preset_name, nodes) : host_topology();
    }
    if (json) std::printf("%s\n", to_json(t).c_str());
    else if (xml) std::printf("%s", export_nccl_xml(t).c_str());
    else if (dot) print_dot(t);
    else print_tree(t);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "tutti-topo: %s\n", e.what());
    return 1;
  }
}
