// GPUs and NVLinks from NVML, loaded at run time so that tutti builds and runs where there is no
// NVIDIA driver. What NCCL's topology detection asks NVML (src/graph/xml.cc), in the same way: each
// link index up to NVML_NVLINK_MAX_LINKS that is active, grouped by the PCI address at its far end.
#include "topologies/nvml.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <type_traits>

#include "core/log.hpp"
#include "topologies/nvml_api.hpp"

namespace tutti::topo::nvml {
namespace {

struct Api {
  nvmlInit_v2_fn init = nullptr;
  nvmlShutdown_fn shutdown = nullptr;
  nvmlErrorString_fn error_string = nullptr;  // optional: only for messages
  nvmlDeviceGetCount_v2_fn get_count = nullptr;
  nvmlDeviceGetHandleByIndex_v2_fn get_handle = nullptr;
  nvmlDeviceGetPciInfo_v3_fn get_pci = nullptr;
  nvmlDeviceGetName_fn get_name = nullptr;
  nvmlDeviceGetCudaComputeCapability_fn get_cc = nullptr;
  nvmlDeviceGetNvLinkState_fn link_state = nullptr;
  nvmlDeviceGetNvLinkRemotePciInfo_v2_fn link_remote = nullptr;

  std::string describe(nvmlReturn_t r) const {
    const char* text = error_string ? error_string(r) : nullptr;
    const int code = static_cast<int>(r);
    return text ? fmt::format("{} (NVML error {})", text, code) : fmt::format("NVML error {}", code);
  }
};

// Resolves every function of `api`; returns the name of the first one `lib` lacks, or nullptr.
const char* resolve(void* lib, Api& api) {
  const char* missing = nullptr;
  auto need = [&](const char* name, auto& fn) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn && !missing) missing = name;
  };
  need("nvmlInit_v2", api.init);
  need("nvmlShutdown", api.shutdown);
  need("nvmlDeviceGetCount_v2", api.get_count);
  need("nvmlDeviceGetHandleByIndex_v2", api.get_handle);
  need("nvmlDeviceGetPciInfo_v3", api.get_pci);
  need("nvmlDeviceGetName", api.get_name);
  need("nvmlDeviceGetCudaComputeCapability", api.get_cc);
  need("nvmlDeviceGetNvLinkState", api.link_state);
  need("nvmlDeviceGetNvLinkRemotePciInfo_v2", api.link_remote);
  api.error_string = reinterpret_cast<nvmlErrorString_fn>(dlsym(lib, "nvmlErrorString"));
  return missing;
}

// NVML fills busId; busIdLegacy holds the same address in the older four-digit form.
std::string busid_of(const nvmlPciInfo_t& pci) {
  std::string b = normalize_busid(pci.busId);
  return b.empty() ? normalize_busid(pci.busIdLegacy) : b;
}

Report read_devices(const Api& api, unsigned count) {
  Report report;
  std::vector<nvmlDevice_t> handles;
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev = nullptr;
    nvmlPciInfo_t pci{};
    nvmlReturn_t r = api.get_handle(i, &dev);
    if (r == NVML_SUCCESS) r = api.get_pci(dev, &pci);
    Gpu g{busid_of(pci), "", 0};
    if (r != NVML_SUCCESS || g.busid.empty()) {
      // Without its PCI address a GPU can be matched neither to hwloc's view nor to NVLink ends.
      TUTTI_INFO(log::kGraph, "topology: NVML GPU {} skipped: no PCI address ({})", i,
                 r != NVML_SUCCESS ? api.describe(r) : fmt::format("bus id '{}'", pci.busId));
      continue;
    }
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
    if (api.get_name(dev, name, sizeof(name)) == NVML_SUCCESS) g.name = name;
    int major = 0, minor = 0;
    if (api.get_cc(dev, &major, &minor) == NVML_SUCCESS) g.sm = major * 10 + minor;
    report.gpus.push_back(g);
    handles.push_back(dev);
  }
  for (size_t k = 0; k < handles.size(); ++k) {
    std::map<std::string, int> per_remote;  // far end -> active links (ordered: the same topology every run)
    for (unsigned l = 0; l < NVML_NVLINK_MAX_LINKS; ++l) {
      nvmlEnableState_t active = NVML_FEATURE_DISABLED;
      nvmlReturn_t r = api.link_state(handles[k], l, &active);
      // NOT_SUPPORTED: a GPU without NVLink; INVALID_ARGUMENT: beyond this GPU's links. Both normal.
      if (r != NVML_SUCCESS && r != NVML_ERROR_NOT_SUPPORTED && r != NVML_ERROR_INVALID_ARGUMENT)
        TUTTI_INFO(log::kGraph, "topology: NVLink {} of GPU {}: state unknown ({}); counted as down", l,
                   report.gpus[k].busid, api.describe(r));
      if (r != NVML_SUCCESS || active != NVML_FEATURE_ENABLED) continue;
      nvmlPciInfo_t remote{};
      r = api.link_remote(handles[k], l, &remote);
      const std::string far = r == NVML_SUCCESS ? busid_of(remote) : "";
      if (far.empty()) {
        TUTTI_INFO(log::kGraph, "topology: NVLink {} of GPU {} is up but its far end is unknown ({}); counted as down", l,
                   report.gpus[k].busid, r != NVML_SUCCESS ? api.describe(r) : fmt::format("bus id '{}'", remote.busId));
        continue;
      }
      ++per_remote[far];
    }
    for (const auto& [far, n] : per_remote) report.links.push_back({static_cast<int>(k), far, n});
  }
  return report;
}

}  // namespace

std::string normalize_busid(const char* text) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  int used = 0;
  if (!text || std::sscanf(text, "%x:%x:%x.%x%n", &domain, &bus, &device, &function, &used) != 4 || text[used] != '\0')
    return "";
  return fmt::format("{:04x}:{:02x}:{:02x}.{}", domain, bus, device, function);  // detect.cpp's form for hwloc
}

std::optional<Report> read(const std::string& library, std::string* why) {
  // Never unloaded: NCCL keeps NVML loaded too, and unloading a library that may have started
  // threads is not safe. Loading it again only counts a reference.
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    *why = fmt::format("cannot load {}: {}", library, err ? err : "unknown error");
    return std::nullopt;
  }
  Api api;
  if (const char* missing = resolve(lib, api)) {
    *why = fmt::format("{} has no {} (not NVML, or older than API version 12?)", library, missing);
    return std::nullopt;
  }
  nvmlReturn_t r = api.init();
  if (r != NVML_SUCCESS) {
    *why = fmt::format("nvmlInit_v2 failed: {}", api.describe(r));
    return std::nullopt;
  }
  unsigned count = 0;
  r = api.get_count(&count);
  std::optional<Report> report;
  if (r == NVML_SUCCESS) report = read_devices(api, count);
  else *why = fmt::format("nvmlDeviceGetCount_v2 failed: {}", api.describe(r));
  api.shutdown();  // NVML counts initialisations; this one is ours to end
  return report;
}

void add_to(Topology& t, const Report& report, int host, int parent) {
  std::map<std::string, int> gpu_at;  // bus id -> device id, for every GPU in t (hwloc's too)
  for (const Device& d : t.devices) {
    auto it = d.attrs.find("pci.busid");
    if (d.type == DeviceType::kGpu && it != d.attrs.end()) gpu_at[it->second] = d.id;
  }
  std::vector<int> ids;  // report.gpus[k] -> device id
  for (const Gpu& g : report.gpus) {
    auto it = gpu_at.find(g.busid);
    int id = it != gpu_at.end() ? it->second : -1;
    if (id < 0) {
      // hwloc did not see it (a container without /sys/bus/pci, for instance). The PCIe link is
      // assumed gen4 x16, as detect() assumes for a PCI device of unknown speed.
      id = t.add_device(DeviceType::kGpu, g.busid, parent, host);
      t.devices[id].attrs["pci.busid"] = g.busid;
      t.add_link(parent, id, LinkType::kPcie, pcie_gbps("16", 16), 0.5);
      gpu_at[g.busid] = id;
    }
    if (g.sm > 0) t.devices[id].attrs["sm"] = std::to_string(g.sm);
    if (!g.name.empty()) t.devices[id].attrs["name"] = g.name;
    ids.push_back(id);
  }
  std::map<std::string, int> switch_at;  // bus id -> NVSwitch device id
  std::set<std::pair<int, int>> seen;
  for (const NvLinks& l : report.links) {
    const int a = ids[static_cast<size_t>(l.gpu)];
    int b;
    if (auto g = gpu_at.find(l.remote_busid); g != gpu_at.end()) {
      b = g->second;
    } else if (auto s = switch_at.find(l.remote_busid); s != switch_at.end()) {
      b = s->second;
    } else {
      b = t.add_device(DeviceType::kNvSwitch, fmt::format("nvswitch{}", switch_at.size()), host, host);
      t.devices[b].attrs["busid"] = l.remote_busid;  // NVSwitches keep it unprefixed (nccl_xml.cpp)
      switch_at[l.remote_busid] = b;
    }
    if (a == b || !seen.insert(std::minmax(a, b)).second) continue;  // the peer GPU reports the same links
    const int sm = report.gpus[static_cast<size_t>(l.gpu)].sm;
    t.add_link(a, b, LinkType::kNvLink, l.count * nvlink_gbps_per_link(sm), 0.7, l.count);  // 0.7 us: presets.cpp
  }
}

}  // namespace tutti::topo::nvml
