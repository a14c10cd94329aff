// Machines we do not have, built the way their vendors document them. Bandwidths per direction.
#include <fmt/format.h>

#include "core/error.hpp"
#include "topologies/topology.hpp"

namespace tutti::topo {
namespace {

struct NodeParts {
  std::vector<int> gpus, nics;
};

int numa(Topology& t, int host, int id, const char* vendor, int model) {
  int n = t.add_device(DeviceType::kNuma, fmt::format("numa{}", id), host, host);
  t.devices[n].attrs = {{"numaid", std::to_string(id)}, {"vendor", vendor}, {"modelid", std::to_string(model)},
                        {"arch", "x86_64"}};
  return n;
}

int gpu(Topology& t, int parent, int host, int dev, int sm, double pcie) {
  int g = t.add_device(DeviceType::kGpu, fmt::format("gpu{}", dev), parent, host);
  t.devices[g].attrs = {{"dev", std::to_string(dev)}, {"sm", std::to_string(sm)}, {"gdr", "1"}};
  t.add_link(parent, g, LinkType::kPcie, pcie, 0.5);
  return g;
}

int nic(Topology& t, int parent, int host, const std::string& name, double gbps, double pcie) {
  int n = t.add_device(DeviceType::kNic, name, parent, host);
  t.devices[n].attrs = {{"name", name}, {"speed", fmt::format("{:.0f}", gbps * 8000)}};
  t.add_link(parent, n, LinkType::kPcie, pcie, 0.5);
  return n;
}

int pci_switch(Topology& t, int parent, int host, int id, double pcie) {
  int s = t.add_device(DeviceType::kPciSwitch, fmt::format("pcisw{}", id), parent, host);
  t.add_link(parent, s, LinkType::kPcie, pcie, 0.5);
  return s;
}

void smp(Topology& t, int a, int b, double gbps) { t.add_link(a, b, LinkType::kSmp, gbps, 0.6); }

// 8 GPUs behind 4 PCIe switches (2 GPUs and `nics_per_switch` NICs each), switches 0-1 on NUMA 0.
NodeParts switched_node(Topology& t, int host, int sm, double pcie, int nics_per_switch, double nic_gbps,
                        const char* vendor, int model) {
  NodeParts p;
  int n0 = numa(t, host, 0, vendor, model), n1 = numa(t, host, 1, vendor, model);
  smp(t, n0, n1, std::string(vendor) == "GenuineIntel" && model >= 85 ? 10 : 6);
  for (int s = 0; s < 4; ++s) {
    int sw = pci_switch(t, s < 2 ? n0 : n1, host, s, pcie);
    for (int k = 0; k < 2; ++k) p.gpus.push_back(gpu(t, sw, host, s * 2 + k, sm, pcie));
    for (int k = 0; k < nics_per_switch; ++k)
      p.nics.push_back(nic(t, sw, host, fmt::format("mlx5_{}", s * nics_per_switch + k), nic_gbps, pcie));
  }
  return p;
}

void nvswitches(Topology& t, int host, const NodeParts& p, int switches, const std::vector<int>& links_per_switch, int sm) {
  for (int s = 0; s < switches; ++s) {
    int sw = t.add_device(DeviceType::kNvSwitch, fmt::format("nvswitch{}", s), host, host);
    t.devices[sw].attrs["busid"] = fmt::format("0000:{:02x}:00.0", 0xf0 + s + 16 * (host % 8));
    for (int g : p.gpus) t.add_link(g, sw, LinkType::kNvLink, links_per_switch[s] * nvlink_gbps_per_link(sm), 0.7, links_per_switch[s]);
  }
}

NodeParts build_node(Topology& t, const std::string& name, int host) {
  const double gen3 = pcie_gbps("8", 16), gen4 = pcie_gbps("16", 16), gen5 = pcie_gbps("32", 16);
  if (name == "dgx1") {
    NodeParts p = switched_node(t, host, 70, gen3, 1, 12.5, "GenuineIntel", 79);
    // Hybrid cube-mesh: two fully connected quads (one doubled edge per GPU) plus doubled cross links.
    const int quad[6][3] = {{0, 1, 1}, {0, 2, 1}, {0, 3, 2}, {1, 2, 2}, {1, 3, 1}, {2, 3, 1}};
    for (int q = 0; q < 2; ++q)
      for (auto& e : quad)
        t.add_link(p.gpus[q * 4 + e[0]], p.gpus[q * 4 + e[1]], LinkType::kNvLink, e[2] * nvlink_gbps_per_link(70), 0.7, e[2]);
    for (int i = 0; i < 4; ++i) t.add_link(p.gpus[i], p.gpus[i + 4], LinkType::kNvLink, 2 * nvlink_gbps_per_link(70), 0.7, 2);
    return p;
  }
  if (name == "dgx-a100" || name == "ndv4") {
    NodeParts p = switched_node(t, host, 80, gen4, 2, 25, "AuthenticAMD", 49);
    nvswitches(t, host, p, 6, {2, 2, 2, 2, 2, 2}, 80);
    return p;
  }
  if (name == "dgx-h100" || name == "ndv5") {
    NodeParts p = switched_node(t, host, 90, gen5, 2, 50, "GenuineIntel", 143);
    nvswitches(t, host, p, 4, {5, 4, 4, 5}, 90);
    return p;
  }
  if (name == "ncv4") {
    NodeParts p;
    int n0 = numa(t, host, 0, "AuthenticAMD", 1), n1 = numa(t, host, 1, "AuthenticAMD", 1);
    smp(t, n0, n1, 6);
    for (int g = 0; g < 4; ++g) p.gpus.push_back(gpu(t, g < 2 ? n0 : n1, host, g, 80, gen4));
    p.nics.push_back(nic(t, n0, host, "mlx5_0", 25, gen4));
    // NVLink bridges join GPUs in pairs.
    for (int g = 0; g < 4; g += 2)
      t.add_link(p.gpus[g], p.gpus[g + 1], LinkType::kNvLink, 12 * nvlink_gbps_per_link(80), 0.7, 12);
    return p;
  }
  throw InvalidArgument(fmt::format("no preset '{}' (there are: dgx1, dgx-a100, ndv4, dgx-h100, ndv5, ncv4, pcie8, cpu-tcp)", name));
}

}  // namespace

std::vector<std::string> preset_names() { return {"dgx1", "dgx-a100", "ndv4", "dgx-h100", "ndv5", "ncv4", "pcie8", "cpu-tcp"}; }

Topology preset(const std::string& name, int nodes) {
  TUTTI_CHECK(nodes >= 1, InvalidArgument, "preset {}: --nodes {} must be at least 1", name, nodes);
  Topology t;
  t.name = nodes == 1 ? name : fmt::format("{}x{}", name, nodes);
  std::vector<NodeParts> parts;
  for (int n = 0; n < nodes; ++n) {
    int host = t.add_device(DeviceType::kHost, fmt::format("host{}", n), -1, 0);
    if (name == "cpu-tcp") {
      // A plain two-socket server: one rank per NUMA node, shared memory inside, 25 GbE outside.
      NodeParts p;
      int n0 = numa(t, host, 0, "GenuineIntel", 85), n1 = numa(t, host, 1, "GenuineIntel", 85);
      smp(t, n0, n1, 10);
      for (int d : {n0, n1}) t.devices[d].attrs.emplace("shm_gbps", "7");  // emplace: GCC 12 warns wrongly on = "7"
      p.gpus = {n0, n1};  // the rank devices
      p.nics.push_back(nic(t, n0, host, "eth0", 25.0 / 8, pcie_gbps("8", 8)));
      parts.push_back(p);
      continue;
    }
    if (name == "pcie8") {
      NodeParts p = switched_node(t, host, 80, pcie_gbps("16", 16), 0, 12.5, "GenuineIntel", 85);
      int numa0 = t.devices[p.gpus[0]].parent;
      numa0 = t.devices[numa0].parent;
      p.nics.push_back(nic(t, numa0, host, "eth0", 12.5, pcie_gbps("16", 16)));
      parts.push_back(p);
      continue;
    }
    parts.push_back(build_node(t, name, host));
  }
  // Fat tree between nodes with full bisection: every NIC reaches every NIC of the other nodes at
  // its own speed.
  const bool ethernet = name == "cpu-tcp" || name == "pcie8";
  std::vector<std::vector<int>> nics;
  for (auto& p : parts) nics.push_back(p.nics);
  const LinkType net = ethernet ? LinkType::kEthernet : LinkType::kIb;
  join_hosts(t, nics, [net](int, int) { return net; });
  for (auto& p : parts)
    for (int g : p.gpus) t.rank_device.push_back(g);
  return t;
}

}  // namespace tutti::topo
