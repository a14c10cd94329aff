// The machine we run on. hwloc gives NUMA nodes, cores and PCI devices; NVML (topologies/nvml.hpp)
// gives GPUs' compute capability and NVLinks; network interfaces come from getifaddrs and sysfs.
// What cannot be read (containers, VMs, machines without a driver) is logged and skipped.
#include <hwloc.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <unistd.h>

#include <fstream>
#include <set>

#include "core/env.hpp"
#include "core/log.hpp"
#include "topologies/nvml.hpp"
#include "topologies/topology.hpp"

namespace tutti::topo {

DetectOptions DetectOptions::from_env() { return {env::get_string("TUTTI_NVML_LIBRARY")}; }

Topology detect() { return detect(DetectOptions::from_env()); }

Topology host_topology() {
  std::string file = env::get_string("TUTTI_TOPO_FILE");
  return file.empty() ? detect() : load_file(file);
}

Topology detect(const DetectOptions& options) {
  Topology t;
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  t.name = hostname;
  int host = t.add_device(DeviceType::kHost, hostname, -1, 0);
  std::vector<int> numas;
  std::vector<int> cores_per_numa;
  hwloc_topology_t hw;
  if (hwloc_topology_init(&hw) == 0) {
    hwloc_topology_set_io_types_filter(hw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(hw) == 0) {
      int nn = hwloc_get_nbobjs_by_type(hw, HWLOC_OBJ_NUMANODE);
      for (int i = 0; i < nn; ++i) {
        hwloc_obj_t obj = hwloc_get_obj_by_type(hw, HWLOC_OBJ_NUMANODE, i);
        int id = t.add_device(DeviceType::kNuma, fmt::format("numa{}", obj->os_index), host, host);
        t.devices[id].attrs["numaid"] = std::to_string(obj->os_index);
        int cores = hwloc_get_nbobjs_inside_cpuset_by_type(hw, obj->cpuset, HWLOC_OBJ_CORE);
        t.devices[id].attrs["cores"] = std::to_string(cores);
        if (obj->attr && obj->attr->numanode.local_memory)
          t.devices[id].attrs["memory_bytes"] = std::to_string(obj->attr->numanode.local_memory);
        numas.push_back(id);
        cores_per_numa.push_back(std::max(cores, 1));
      }
      for (hwloc_obj_t pci = hwloc_get_next_pcidev(hw, nullptr); pci; pci = hwloc_get_next_pcidev(hw, pci)) {
        unsigned cls = pci->attr->pcidev.class_id;
        bool is_gpu = (cls == 0x0300 || cls == 0x0302) && (pci->attr->pcidev.vendor_id == 0x10de || pci->attr->pcidev.vendor_id == 0x1002);
        bool is_nic = cls == 0x0200 || cls == 0x0207;
        if (!is_gpu && !is_nic) continue;
        int parent = numas.empty() ? host : numas.front();
        std::string busid = fmt::format("{:04x}:{:02x}:{:02x}.{}", pci->attr->pcidev.domain, pci->attr->pcidev.bus,
                                        pci->attr->pcidev.dev, pci->attr->pcidev.func);
        int id = t.add_device(is_gpu ? DeviceType::kGpu : DeviceType::kNic, busid, parent, host);
        t.devices[id].attrs["pci.busid"] = busid;
        double gbps = pci->attr->pcidev.linkspeed > 0 ? pci->attr->pcidev.linkspeed : pcie_gbps("16", 16);
        t.add_link(parent, id, LinkType::kPcie, gbps, 0.5);
      }
    } else {
      TUTTI_INFO(log::kGraph, "topology: hwloc could not load this machine's topology; assuming one NUMA node");
    }
    hwloc_topology_destroy(hw);
  }
  if (numas.empty()) {
    int id = t.add_device(DeviceType::kNuma, "numa0", host, host);
    t.devices[id].attrs["cores"] = std::to_string(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    numas.push_back(id);
    cores_per_numa.push_back(static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))));
  }
  for (size_t i = 0; i < numas.size(); ++i)
    for (size_t j = i + 1; j < numas.size(); ++j) t.add_link(numas[i], numas[j], LinkType::kSmp, 10, 0.6);
  // GPUs through NVML: hwloc sees PCI devices, not NVLinks or compute capabilities.
  if (!options.nvml_library.empty()) {
    std::string why;
    try {
      if (auto report = nvml::read(options.nvml_library, &why)) {
        nvml::add_to(t, *report, host, numas.front());
        TUTTI_INFO(log::kGraph, "topology: NVML ({}) reports {} GPU(s) and {} NVLink group(s)", options.nvml_library,
                   report->gpus.size(), report->links.size());
      }
    } catch (const std::exception& e) {  // detection goes on without NVML whatever happens there
      why = e.what();
    }
    if (!why.empty()) TUTTI_INFO(log::kGraph, "topology: no GPUs from NVML: {}", why);
  }
  // Network interfaces (not loopback), with their link speed where sysfs tells it.
  ifaddrs* list = nullptr;
  std::set<std::string> seen;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_name || (i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP) || !seen.insert(i->ifa_name).second) continue;
      int id = t.add_device(DeviceType::kNic, i->ifa_name, numas.front(), host);
      long mbps = 0;
      std::ifstream(std::string("/sys/class/net/") + i->ifa_name + "/speed") >> mbps;
      if (mbps <= 0) {
        TUTTI_INFO(log::kGraph, "topology: speed of {} unknown (virtual interface?); assuming 10 Gb/s", i->ifa_name);
        mbps = 10000;
      }
      t.devices[id].attrs["speed"] = std::to_string(mbps);
      t.add_link(numas.front(), id, LinkType::kPcie, pcie_gbps("8", 8), 0.5);
    }
    freeifaddrs(list);
  }
  // One rank per core, on its NUMA node; ranks on one NUMA node talk through shared memory.
  for (size_t i = 0; i < numas.size(); ++i) {
    t.devices[numas[i]].attrs["shm_gbps"] = "7";
    for (int c = 0; c < cores_per_numa[i]; ++c) t.rank_device.push_back(numas[i]);
  }
  return t;
}

}  // namespace tutti::topo
