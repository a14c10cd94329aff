#pragma once
// GPUs and NVLinks as NVML reports them, for detect(). Reading (dlopen, C calls) and adding to a
// Topology are separate steps, so the second can be tested on any topology.

#include <optional>
#include <string>
#include <vector>

#include "topologies/topology.hpp"

namespace tutti::topo::nvml {

struct Gpu {
  std::string busid;  // "0000:1b:00.0", hwloc's form (see normalize_busid)
  std::string name;   // "NVIDIA H200"; empty if NVML would not say
  int sm = 0;         // compute capability major * 10 + minor; 0 if NVML would not say
};

// `count` active NVLinks from gpus[gpu] to the device at remote_busid (another GPU or an NVSwitch).
struct NvLinks {
  int gpu = 0;
  std::string remote_busid;
  int count = 0;
};

struct Report {
  std::vector<Gpu> gpus;
  std::vector<NvLinks> links;
};

// Loads NVML from `library` (a name for dlopen or a path) and reads every GPU and its active NVLinks.
// Never throws: when the library is missing, lacks a function or fails to initialise, returns
// nullopt with the reason in *why. A GPU whose PCI address cannot be read is skipped, and a link
// whose state or far end cannot be read counts as down; both are logged.
std::optional<Report> read(const std::string& library, std::string* why);

// Adds the report to `t`: a GPU that `t` already holds (same "pci.busid", as hwloc finds it) gains
// sm and name; any other becomes a GPU under `parent`, reached over PCIe. NVLinks between GPU pairs
// and to NVSwitches (any far end that is not one of the report's GPUs, as NCCL decides; one
// NVSwitch device per bus id) carry count * nvlink_gbps_per_link(sm).
void add_to(Topology& t, const Report& report, int host, int parent);

// NVML writes "00000000:1B:00.0" (eight-digit domain, upper case); hwloc and NCCL's XML use
// "0000:1b:00.0". Returns "" for text that is not domain:bus:device.function.
std::string normalize_busid(const char* nvml_busid);

}  // namespace tutti::topo::nvml
