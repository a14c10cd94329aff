// NCCL's topology XML (NCCL_TOPO_FILE / NCCL_TOPO_DUMP_FILE): system > cpu > pci > {pci, gpu, nic > net},
// gpu > {nvlink, xgmi}. NVLink targets that are not GPUs are NVSwitches.
#include <fmt/format.h>

#include <pugixml.hpp>
#include <functional>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "topologies/topology.hpp"

namespace tutti::topo {
namespace {

int line_of(const std::string& text, ptrdiff_t offset) {
  int l = 1;
  for (ptrdiff_t i = 0; i < offset && i < static_cast<ptrdiff_t>(text.size()); ++i) l += text[i] == '\n';
  return l;
}

double smp_gbps(const Device& numa) {
  // NCCL's inter-socket figures: Skylake and later Intel 10 GB/s, older Intel and AMD 6 GB/s.
  auto v = numa.attrs.find("vendor");
  auto m = numa.attrs.find("modelid");
  if (v != numa.attrs.end() && v->second == "GenuineIntel" && m != numa.attrs.end() && std::atoi(m->second.c_str()) >= 85)
    return 10;
  return 6;
}

struct Importer {
  const std::string& text;
  std::vector<std::string>* warnings;
  Topology t;
  std::map<std::string, int> by_busid;
  struct PendingLink {
    int gpu;
    std::string target;
    int count;
    bool xgmi;
  };
  std::vector<PendingLink> pending;
  std::vector<std::pair<int, int>> ranked;  // (rank, gpu)

  void warn(const pugi::xml_node& n, const std::string& what) {
    if (warnings) warnings->push_back(fmt::format("line {}: {}", line_of(text, n.offset_debug()), what));
  }
  void copy_attrs(const pugi::xml_node& n, Device& d) {
    for (auto a : n.attributes()) d.attrs[a.name()] = a.value();
  }

  void pci(const pugi::xml_node& n, int parent, int host) {
    std::string cls = n.attribute("class").value();
    std::string speed = n.attribute("link_speed").value();
    int width = n.attribute("link_width").as_int(16);
    double bw = pcie_gbps(speed, width);
    pugi::xml_node gpu = n.child("gpu"), nic = n.child("nic");
    int id = -1;
    if (gpu) {
      id = t.add_device(DeviceType::kGpu, fmt::format("gpu{}", gpu.attribute("dev").as_int()), parent, host);
      copy_attrs(gpu, t.devices[id]);
      for (auto a : n.attributes()) t.devices[id].attrs[std::string("pci.") + a.name()] = a.value();
      if (gpu.attribute("rank")) ranked.push_back({gpu.attribute("rank").as_int(), id});
      for (auto l : gpu.children()) {
        std::string kind = l.name();
        if (kind == "nvlink" || kind == "xgmi")
          pending.push_back({id, l.attribute("target").value(), l.attribute("count").as_int(1), kind == "xgmi"});
        else if (l.type() == pugi::node_element)
          warn(l, fmt::format("unknown element <{}> in <gpu> ignored", kind));
      }
    } else if (nic) {
      for (auto net : nic.children("net")) {
        id = t.add_device(DeviceType::kNic, net.attribute("name").value(), parent, host);
        copy_attrs(net, t.devices[id]);
        for (auto a : n.attributes()) t.devices[id].attrs[std::string("pci.") + a.name()] = a.value();
        t.add_link(parent, id, LinkType::kPcie, bw, 0.5);
      }
      if (!by_busid.count(n.attribute("busid").value()) && id >= 0) by_busid[n.attribute("busid").value()] = id;
      return;
    } else if (cls.rfind("0x0604", 0) == 0) {
      id = t.add_device(DeviceType::kPciSwitch, fmt::format("pci{}", n.attribute("busid").value()), parent, host);
      for (auto a : n.attributes()) t.devices[id].attrs[std::string("pci.") + a.name()] = a.value();
    } else {
      warn(n, fmt::format("PCI device {} (class {}) is neither a GPU, a NIC nor a switch; ignored",
                          n.attribute("busid").value(), cls));
      return;
    }
    by_busid[n.attribute("busid").value()] = id;
    t.add_link(parent, id, LinkType::kPcie, bw, 0.5);
    for (auto c : n.children()) {
      std::string kind = c.name();
      if (kind == "pci") pci(c, id, host);
      else if (c.type() == pugi::node_element && kind != "gpu" && kind != "nic")
        warn(c, fmt::format("unknown element <{}> in <pci> ignored", kind));
    }
  }

  Topology run() {
    pugi::xml_document doc;
    pugi::xml_parse_result res = doc.load_string(text.c_str());
    if (!res)
      throw InvalidArgument(fmt::format("NCCL topology XML line {}: malformed XML: {}", line_of(text, res.offset),
                                        res.description()));
    pugi::xml_node sys = doc.child("system");
    TUTTI_CHECK(sys, InvalidArgument, "NCCL topology XML: no <system> element");
    int host = t.add_device(DeviceType::kHost, "host0", -1, 0);
    t.devices[host].attrs["version"] = sys.attribute("version").value();
    std::vector<int> numas;
    for (auto cpu : sys.children()) {
      if (cpu.type() != pugi::node_element) continue;
      if (std::string(cpu.name()) != "cpu") {
        warn(cpu, fmt::format("unknown element <{}> in <system> ignored", cpu.name()));
        continue;
      }
      int numa = t.add_device(DeviceType::kNuma, fmt::format("numa{}", cpu.attribute("numaid").as_int()), host, host);
      copy_attrs(cpu, t.devices[numa]);
      numas.push_back(numa);
      for (auto c : cpu.children()) {
        if (std::string(c.name()) == "pci") pci(c, numa, host);
        else if (std::string(c.name()) == "nic") {
          // A NIC directly under the CPU (no PCI path known).
          for (auto net : c.children("net")) {
            int id = t.add_device(DeviceType::kNic, net.attribute("name").value(), numa, host);
            copy_attrs(net, t.devices[id]);
            t.add_link(numa, id, LinkType::kPcie, pcie_gbps("16", 16), 0.5);
          }
        } else if (c.type() == pugi::node_element) {
          warn(c, fmt::format("unknown element <{}> in <cpu> ignored", c.name()));
        }
      }
    }
    for (size_t i = 0; i < numas.size(); ++i)
      for (size_t j = i + 1; j < numas.size(); ++j)
        t.add_link(numas[i], numas[j], LinkType::kSmp, std::min(smp_gbps(t.devices[numas[i]]), smp_gbps(t.devices[numas[j]])), 0.6);
    std::set<std::pair<int, int>> seen;
    std::map<std::string, int> switches;
    for (auto& pl : pending) {
      int sm = std::atoi(t.devices[pl.gpu].attrs["sm"].c_str());
      double per = pl.xgmi ? 48.0 : nvlink_gbps_per_link(sm);
      LinkType type = pl.xgmi ? LinkType::kXgmi : LinkType::kNvLink;
      auto it = by_busid.find(pl.target);
      int other;
      if (it != by_busid.end() && t.devices[it->second].type == DeviceType::kGpu) {
        other = it->second;
      } else if (!pl.xgmi) {
        auto sw = switches.find(pl.target);
        if (sw == switches.end()) {
          int id = t.add_device(DeviceType::kNvSwitch, fmt::format("nvswitch{}", switches.size()), 0, 0);
          t.devices[id].attrs["busid"] = pl.target;
          sw = switches.emplace(pl.target, id).first;
        }
        other = sw->second;
      } else {
        throw InvalidArgument(fmt::format("NCCL topology XML: xgmi link of {} to unknown GPU {}", t.devices[pl.gpu].name,
                                          pl.target));
      }
      auto key = std::minmax(pl.gpu, other);
      if (!seen.insert(key).second) continue;  // the peer listed the same link
      t.add_link(pl.gpu, other, type, per * pl.count, 0.7, pl.count);
    }
    std::sort(ranked.begin(), ranked.end());
    for (auto& [rank, gpu] : ranked) t.rank_device.push_back(gpu);
    if (t.rank_device.empty())
      for (auto& d : t.devices)
        if (d.type == DeviceType::kGpu) t.rank_device.push_back(d.id);
    return std::move(t);
  }
};

void emit_attrs(std::ostringstream& o, const std::map<std::string, std::string>& attrs, const std::string& prefix,
                bool with_prefix) {
  for (auto& [k, v] : attrs) {
    bool has = k.rfind(prefix, 0) == 0;
    if (with_prefix != has) continue;
    o << fmt::format(" {}=\"{}\"", with_prefix ? k.substr(prefix.size()) : k, v);
  }
}

}  // namespace

Topology import_nccl_xml(const std::string& text, std::vector<std::string>* warnings) {
  return Importer{text, warnings, {}, {}, {}, {}}.run();
}

std::string export_nccl_xml(const Topology& t) {
  std::ostringstream o;
  std::string version = "1";
  if (!t.devices.empty() && t.devices[0].attrs.count("version")) version = t.devices[0].attrs.at("version");
  o << "<system version=\"" << version << "\">\n";
  std::vector<std::vector<int>> children(t.devices.size());
  for (auto& d : t.devices)
    if (d.parent >= 0) children[d.parent].push_back(d.id);
  auto busid_of = [&](int id) {
    const Device& d = t.devices[id];
    auto it = d.attrs.find(d.type == DeviceType::kNvSwitch ? "busid" : "pci.busid");
    return it != d.attrs.end() ? it->second : fmt::format("0000:{:02x}:00.0", id);
  };
  std::function<void(int, int)> emit = [&](int id, int depth) {
    const Device& d = t.devices[id];
    std::string pad(static_cast<size_t>(depth) * 2, ' ');
    if (d.type == DeviceType::kPciSwitch || d.type == DeviceType::kGpu) {
      o << pad << "<pci";
      if (!d.attrs.count("pci.busid")) o << fmt::format(" busid=\"{}\"", busid_of(id));
      if (!d.attrs.count("pci.class")) o << (d.type == DeviceType::kGpu ? " class=\"0x030200\"" : " class=\"0x060400\"");
      emit_attrs(o, d.attrs, "pci.", true);
      o << ">\n";
      if (d.type == DeviceType::kGpu) {
        o << pad << "  <gpu";
        emit_attrs(o, d.attrs, "pci.", false);
        o << ">\n";
        for (auto& l : t.links) {
          if ((l.type != LinkType::kNvLink && l.type != LinkType::kXgmi) || (l.a != id && l.b != id)) continue;
          int other = l.a == id ? l.b : l.a;
          o << pad << fmt::format("    <{} target=\"{}\" count=\"{}\" tclass=\"{}\"/>\n",
                                  l.type == LinkType::kXgmi ? "xgmi" : "nvlink", busid_of(other), l.count,
                                  t.devices[other].type == DeviceType::kNvSwitch ? "0x068000" : "0x030200");
        }
        o << pad << "  </gpu>\n";
      }
      for (int c : children[id]) emit(c, depth + 1);
      o << pad << "</pci>\n";
    } else if (d.type == DeviceType::kNic) {
      o << pad << "<pci";
      if (!d.attrs.count("pci.busid")) o << fmt::format(" busid=\"{}\" class=\"0x020000\"", busid_of(id));
      emit_attrs(o, d.attrs, "pci.", true);
      o << ">\n" << pad << "  <nic>\n" << pad << "    <net";
      emit_attrs(o, d.attrs, "pci.", false);
      o << "/>\n" << pad << "  </nic>\n" << pad << "</pci>\n";
    }
  };
  for (auto& d : t.devices) {
    if (d.type != DeviceType::kNuma) continue;
    o << "  <cpu";
    emit_attrs(o, d.attrs, "pci.", false);
    o << ">\n";
    for (int c : children[d.id]) emit(c, 2);
    o << "  </cpu>\n";
  }
  o << "</system>\n";
  return o.str();
}

}  // namespace tutti::topo
