#pragma once
// The topology contract (DESIGN.md 3.3): devices (hosts, CPU sockets / NUMA nodes, GPUs, NICs, PCIe
// switches, NVSwitches), links between them (type, GB/s per direction, latency, count), which device
// each rank runs on, and paths between ranks with their bottleneck bandwidth and summed latency.
// Sources: NCCL's topology XML, our JSON, presets for machines we do not have, detection.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tutti::topo {

enum class DeviceType { kHost, kCpu, kNuma, kGpu, kNic, kPciSwitch, kNvSwitch };
const char* to_string(DeviceType t);  // "host", "cpu", "numa", "gpu", "nic", "pci-switch", "nvswitch"
std::optional<DeviceType> parse_device_type(const std::string& s);

enum class LinkType { kNvLink, kXgmi, kPcie, kSmp, kIb, kEthernet, kShm, kTcp };
const char* to_string(LinkType t);  // "nvlink", "xgmi", "pcie", "smp", "ib", "ethernet", "shm", "tcp"
std::optional<LinkType> parse_link_type(const std::string& s);

struct Device {
  int id = 0;
  DeviceType type = DeviceType::kHost;
  std::string name;
  int parent = -1;  // the device it hangs under (host -> cpu/numa -> pci-switch -> gpu/nic); -1 for hosts
  int host = 0;     // index of its host device
  std::map<std::string, std::string> attrs;  // e.g. busid, sm, speed (kept for export)
  bool operator==(const Device&) const = default;
};

struct Link {
  int a = 0, b = 0;  // device ids; links are bidirectional, bandwidth is per direction
  LinkType type = LinkType::kPcie;
  double gbps = 0;        // GB/s per direction, all `count` lanes/links together
  double latency_us = 0;
  int count = 1;          // NVLink/xGMI links, or 1
  bool operator==(const Link&) const = default;
};

struct Path {
  double gbps = 0;        // bottleneck bandwidth
  double latency_us = 0;  // sum over hops
  std::vector<int> devices;
  std::vector<LinkType> hops;
};

class Topology {
 public:
  std::string name;
  std::vector<Device> devices;
  std::vector<Link> links;
  std::vector<int> rank_device;  // rank -> device

  int add_device(DeviceType type, std::string name, int parent, int host);
  void add_link(int a, int b, LinkType type, double gbps, double latency_us, int count = 1);
  int count(DeviceType t) const;
  int count(LinkType t) const;  // links of this type (each pair once)
  int nranks() const { return static_cast<int>(rank_device.size()); }
  // Widest path (then lowest latency) between the devices of two ranks. Throws InvalidArgument for
  // a rank out of range or ranks with no path.
  Path path(int rank_a, int rank_b) const;
  bool operator==(const Topology&) const = default;
};

// Per-generation link speeds, as NCCL models them.
double nvlink_gbps_per_link(int sm);
double pcie_gbps(const std::string& link_speed, int width);

// Formats. Importers throw InvalidArgument naming the line/field; unknown elements or attributes are
// appended to *warnings.
Topology import_nccl_xml(const std::string& text, std::vector<std::string>* warnings = nullptr);
std::string export_nccl_xml(const Topology& t);
std::string to_json(const Topology& t);
Topology parse_json(const std::string& text);
Topology load_file(const std::string& path);  // .xml (NCCL) or .json

// Presets: dgx1, dgx-a100, ndv4, dgx-h100, ndv5, ncv4, pcie8, cpu-tcp; nodes >= 1 joins copies with
// a fat tree (NICs of every node reach every other node's NICs at NIC speed).
std::vector<std::string> preset_names();
Topology preset(const std::string& name, int nodes = 1);

// Joins hosts with a full-bisection fat tree: every NIC of a host reaches every NIC of the other
// hosts at the slower one's speed (attr "speed", Mb/s), over the link type net(nic_a, nic_b).
void join_hosts(Topology& t, const std::vector<std::vector<int>>& nics_per_host,
                const std::function<LinkType(int, int)>& net);

// One world topology from each host's own view (what detect() sees there): hosts[h] is one view per
// distinct host, host_of_rank[r] the view of rank r's host. A host's ranks take its view's rank
// devices in order; hosts are joined by join_hosts (Ethernet, or IB where a NIC says so). A host
// without a NIC gets a 10 Gb/s one, with a logged note. InvalidArgument for an index out of range.
Topology merge(const std::vector<Topology>& hosts, const std::vector<int>& host_of_rank);

// What detection takes from the environment, read once at the edge (tests pass their own).
struct DetectOptions {
  std::string nvml_library;  // TUTTI_NVML_LIBRARY: where to load NVML from; empty: do not use NVML
  static DetectOptions from_env();
};

// The machine we run on: NUMA nodes and cores (hwloc), PCI GPUs and NICs (hwloc), GPUs with their
// compute capability and NVLinks, to each other and to NVSwitches (NVML, loaded at run time),
// network interfaces (getifaddrs, sysfs). Ranks stay on the NUMA nodes (the CPU executor's view).
// Anything unreadable, NVML included, is logged (GRAPH) and skipped, never an error.
Topology detect(const DetectOptions& options);
Topology detect();  // detect(DetectOptions::from_env())
// This host as the tuner and tools see it: the file TUTTI_TOPO_FILE (NCCL_TOPO_FILE) names when set,
// as NCCL reads its topology XML, else detect(). A file that cannot be read is an InvalidArgument.
Topology host_topology();

}  // namespace tutti::topo
