#include "topologies/topology.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <queue>
#include <set>

#include "core/error.hpp"
#include "core/log.hpp"

namespace tutti::topo {
namespace {
constexpr const char* kDeviceNames[] = {"host", "cpu", "numa", "gpu", "nic", "pci-switch", "nvswitch"};
constexpr const char* kLinkNames[] = {"nvlink", "xgmi", "pcie", "smp", "ib", "ethernet", "shm", "tcp"};
}  // namespace

const char* to_string(DeviceType t) { return kDeviceNames[static_cast<int>(t)]; }
const char* to_string(LinkType t) { return kLinkNames[static_cast<int>(t)]; }

std::optional<DeviceType> parse_device_type(const std::string& s) {
  for (int i = 0; i < static_cast<int>(std::size(kDeviceNames)); ++i)
    if (s == kDeviceNames[i]) return static_cast<DeviceType>(i);
  return std::nullopt;
}

std::optional<LinkType> parse_link_type(const std::string& s) {
  for (int i = 0; i < static_cast<int>(std::size(kLinkNames)); ++i)
    if (s == kLinkNames[i]) return static_cast<LinkType>(i);
  return std::nullopt;
}

int Topology::add_device(DeviceType type, std::string name, int parent, int host) {
  Device d;
  d.id = static_cast<int>(devices.size());
  d.type = type;
  d.name = std::move(name);
  d.parent = parent;
  d.host = type == DeviceType::kHost ? d.id : host;
  devices.push_back(std::move(d));
  return devices.back().id;
}

void Topology::add_link(int a, int b, LinkType type, double gbps, double latency_us, int count) {
  TUTTI_CHECK(a >= 0 && b >= 0 && a < static_cast<int>(devices.size()) && b < static_cast<int>(devices.size()) && a != b,
              InvalidArgument, "topology '{}': link between devices {} and {} (of {})", name, a, b, devices.size());
  links.push_back({std::min(a, b), std::max(a, b), type, gbps, latency_us, count});
}

int Topology::count(DeviceType t) const {
  return static_cast<int>(std::count_if(devices.begin(), devices.end(), [&](const Device& d) { return d.type == t; }));
}

int Topology::count(LinkType t) const {
  return static_cast<int>(std::count_if(links.begin(), links.end(), [&](const Link& l) { return l.type == t; }));
}

Path Topology::path(int ra, int rb) const {
  TUTTI_CHECK(ra >= 0 && ra < nranks() && rb >= 0 && rb < nranks(), InvalidArgument,
              "topology '{}': ranks {} and {} (it maps {} ranks)", name, ra, rb, nranks());
  int src = rank_device[ra], dst = rank_device[rb];
  Path p;
  if (src == dst) {
    // Two ranks on one device (CPU ranks on a NUMA node): shared memory at its copy bandwidth.
    auto it = devices[src].attrs.find("shm_gbps");
    p.gbps = it != devices[src].attrs.end() ? std::atof(it->second.c_str()) : std::numeric_limits<double>::infinity();
    auto lat = devices[src].attrs.find("shm_latency_us");  // calibrated (collectives/calibrate.hpp)
    p.latency_us = lat != devices[src].attrs.end() ? std::atof(lat->second.c_str()) : 0.3;
    p.devices = {src};
    p.hops = {LinkType::kShm};
    return p;
  }
  // Widest path, ties broken by latency: a Dijkstra over (-bandwidth, latency).
  const size_t n = devices.size();
  std::vector<std::vector<size_t>> adj(n);
  for (size_t i = 0; i < links.size(); ++i) {
    adj[links[i].a].push_back(i);
    adj[links[i].b].push_back(i);
  }
  std::vector<double> bw(n, -1), lat(n, std::numeric_limits<double>::infinity());
  std::vector<int> prev_link(n, -1);
  using Item = std::tuple<double, double, int>;  // (-bw, latency, device)
  std::priority_queue<Item, std::vector<Item>, std::greater<>> q;
  bw[src] = std::numeric_limits<double>::infinity();
  lat[src] = 0;
  q.push({-bw[src], 0, src});
  while (!q.empty()) {
    auto [nb, l, d] = q.top();
    q.pop();
    if (-nb < bw[d] || (-nb == bw[d] && l > lat[d])) continue;
    for (size_t li : adj[d]) {
      const Link& e = links[li];
      int o = e.a == d ? e.b : e.a;
      // GPUs are endpoints, never transit; a NIC is entered only as the last device or to leave
      // the host over the network (NIC to NIC).
      const DeviceType ot = devices[o].type, dt = devices[d].type;
      if (o != dst && ot == DeviceType::kGpu) continue;
      if (o != dst && ot == DeviceType::kNic && dt == DeviceType::kNic) {
        // leaving a host: fine
      } else if (d != src && dt == DeviceType::kNic && ot != DeviceType::kNic) {
        // arrived from the network: only continue into this host
      }
      double b = std::min(bw[d], e.gbps), t = lat[d] + e.latency_us;
      if (b > bw[o] || (b == bw[o] && t < lat[o])) {
        bw[o] = b;
        lat[o] = t;
        prev_link[o] = static_cast<int>(li);
        q.push({-b, t, o});
      }
    }
  }
  TUTTI_CHECK(bw[dst] > 0, InvalidArgument, "topology '{}': no path between rank {} and rank {}", name, ra, rb);
  p.gbps = bw[dst];
  // NVSwitches work in parallel: GPUs on the same switches reach each other with all their links.
  auto switched = [&](int gpu) {
    double sum = 0;
    std::set<int> switches;
    for (const Link& e : links)
      if (e.type == LinkType::kNvLink && (e.a == gpu || e.b == gpu)) {
        int o = e.a == gpu ? e.b : e.a;
        if (devices[o].type == DeviceType::kNvSwitch) sum += e.gbps, switches.insert(o);
      }
    return std::make_pair(sum, switches);
  };
  if (devices[src].type == DeviceType::kGpu && devices[dst].type == DeviceType::kGpu) {
    auto [sa, wa] = switched(src);
    auto [sb, wb] = switched(dst);
    if (!wa.empty() && wa == wb) p.gbps = std::max(p.gbps, std::min(sa, sb));
  }
  p.latency_us = lat[dst];
  for (int d = dst; d != src;) {
    const Link& e = links[prev_link[d]];
    p.devices.push_back(d);
    p.hops.push_back(e.type);
    d = e.a == d ? e.b : e.a;
  }
  p.devices.push_back(src);
  std::reverse(p.devices.begin(), p.devices.end());
  std::reverse(p.hops.begin(), p.hops.end());
  return p;
}

double nvlink_gbps_per_link(int sm) {
  // NCCL's per-link figures (graph/topo.h): SM60 18, SM70 20, SM80 20, SM90 20.6, SM100 40.1.
  if (sm >= 100) return 40.1;
  if (sm >= 90) return 20.6;
  if (sm >= 70) return 20.0;
  return 18.0;
}

double pcie_gbps(const std::string& link_speed, int width) {
  double gts = std::atof(link_speed.c_str());
  if (gts <= 0) gts = 16;
  if (width <= 0) width = 16;
  double encoding = gts >= 8 ? 128.0 / 130.0 : 0.8;  // 128b/130b from gen3, 8b/10b before
  return gts * encoding / 8.0 * width;
}

}  // namespace tutti::topo

namespace tutti::topo {

void join_hosts(Topology& t, const std::vector<std::vector<int>>& nics_per_host,
                const std::function<LinkType(int, int)>& net) {
  auto speed = [&](int nic) { return std::atof(t.devices[nic].attrs["speed"].c_str()) / 8000; };  // Mb/s -> GB/s
  for (size_t a = 0; a < nics_per_host.size(); ++a)
    for (size_t b = a + 1; b < nics_per_host.size(); ++b)
      for (int na : nics_per_host[a])
        for (int nb : nics_per_host[b]) {
          const LinkType type = net(na, nb);
          t.add_link(na, nb, type, std::min(speed(na), speed(nb)), type == LinkType::kIb ? 2.0 : 10.0);
        }
}

Topology merge(const std::vector<Topology>& hosts, const std::vector<int>& host_of_rank) {
  Topology w;
  w.name = hosts.size() == 1 ? hosts[0].name : fmt::format("{} hosts", hosts.size());
  std::vector<size_t> offset;
  std::vector<std::vector<int>> nics(hosts.size());
  std::set<int> ib;  // NICs that are InfiniBand HCAs (ibverbs names, or a GUID)
  for (size_t h = 0; h < hosts.size(); ++h) {
    const Topology& v = hosts[h];
    TUTTI_CHECK(!v.rank_device.empty(), InvalidArgument, "topology merge: host {} ({}) maps no rank devices", h, v.name);
    const int base = static_cast<int>(w.devices.size());
    offset.push_back(static_cast<size_t>(base));
    for (const Device& d : v.devices) {
      Device c = d;
      c.id += base;
      if (c.parent >= 0) c.parent += base;
      c.host += base;
      w.devices.push_back(c);
      if (d.type == DeviceType::kNic) {
        nics[h].push_back(c.id);
        if (d.name.rfind("mlx", 0) == 0 || d.attrs.count("guid")) ib.insert(c.id);
      }
    }
    for (Link l : v.links) {
      l.a += base;
      l.b += base;
      w.links.push_back(l);
    }
    if (nics[h].empty() && hosts.size() > 1) {
      int parent = v.rank_device.front() + base;
      int nic = w.add_device(DeviceType::kNic, "net0", parent, w.devices[static_cast<size_t>(parent)].host);
      w.devices[static_cast<size_t>(nic)].attrs["speed"] = "10000";
      w.add_link(parent, nic, LinkType::kPcie, pcie_gbps("8", 8), 0.5);
      nics[h].push_back(nic);
      TUTTI_INFO(log::kGraph, "topology: host {} ({}) shows no network interface; assuming one of 10 Gb/s", h, v.name);
    }
  }
  join_hosts(w, nics, [&](int a, int b) { return ib.count(a) && ib.count(b) ? LinkType::kIb : LinkType::kEthernet; });
  std::vector<size_t> next(hosts.size(), 0);  // local rank index per host
  for (size_t r = 0; r < host_of_rank.size(); ++r) {
    const int h = host_of_rank[r];
    TUTTI_CHECK(h >= 0 && static_cast<size_t>(h) < hosts.size(), InvalidArgument,
                "topology merge: rank {} is on host {}, but {} hosts were given", r, h, hosts.size());
    const auto& devs = hosts[static_cast<size_t>(h)].rank_device;
    w.rank_device.push_back(devs[next[static_cast<size_t>(h)]++ % devs.size()] + static_cast<int>(offset[static_cast<size_t>(h)]));
  }
  return w;
}

}  // namespace tutti::topo
