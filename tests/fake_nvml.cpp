// A stand-in for libnvidia-ml.so.1, so NVML detection is tested on machines without a GPU: load it
// with TUTTI_NVML_LIBRARY=<path of this library>. FAKE_NVML_SCENARIO, read by every nvmlInit_v2,
// chooses the machine:
//   nvswitch (default)  4 GPUs, sm 90, 18 NVLinks each to 4 NVSwitches (5, 4, 4 and 5 links), as
//                       on a DGX H100
//   mesh                4 GPUs, sm 90, 6 NVLinks between every pair; the last link between GPUs 0
//                       and 1 is down, so that pair has 5
//   pcie                2 GPUs, sm 80, no NVLink (every NVLink call answers NOT_SUPPORTED)
//   init-fails          nvmlInit_v2 answers DRIVER_NOT_LOADED, as on a machine without a driver
// Bus ids come in NVML's form ("0000FA00:1B:00.0": eight-digit domain, upper case).
// fake_nvml_sessions() tells how many nvmlInit_v2 calls nvmlShutdown has not ended, so tests can
// check that detection cleans up.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "topologies/nvml_api.hpp"

// The handle NVML hands out is a pointer to its own (here: our) struct.
struct nvmlDevice_st {
  int index;
};

namespace {

enum class Scenario { kNvSwitch, kMesh, kPcie, kInitFails };

constexpr int kMaxGpus = 4;
// PCI domain 0xfa00, which real machines do not use, so that on a machine with GPUs the fake ones
// never coincide with those hwloc finds.
const char* const kGpuBus[kMaxGpus] = {"0000FA00:1B:00.0", "0000FA00:43:00.0", "0000FA00:52:00.0", "0000FA00:61:00.0"};
const char* const kSwitchBus[4] = {"0000FA00:F3:00.0", "0000FA00:F4:00.0", "0000FA00:F5:00.0", "0000FA00:F6:00.0"};

nvmlDevice_st g_devices[kMaxGpus] = {{0}, {1}, {2}, {3}};

Scenario g_scenario = Scenario::kNvSwitch;
int g_sessions = 0;

int gpus() { return g_scenario == Scenario::kPcie ? 2 : kMaxGpus; }

bool valid(nvmlDevice_t d) { return g_sessions > 0 && d && d >= g_devices && d < g_devices + gpus(); }

void fill_pci(const char* busid, nvmlPciInfo_t* pci) {
  *pci = nvmlPciInfo_t{};
  std::snprintf(pci->busId, sizeof(pci->busId), "%s", busid);
  std::snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%s", busid + 4);  // "FA00:1B:00.0"
  std::sscanf(busid, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
  pci->pciDeviceId = 0x233010de;  // device id << 16 | vendor id (NVIDIA: 0x10de)
}

// Where link `l` of GPU `g` leads (a bus id).
const char* far_end(int g, unsigned l) {
  if (g_scenario == Scenario::kNvSwitch) return kSwitchBus[l < 5 ? 0 : l < 9 ? 1 : l < 13 ? 2 : 3];
  // Mesh: links 6k..6k+5 go to the k-th other GPU.
  int k = static_cast<int>(l) / 6;
  return kGpuBus[k < g ? k : k + 1];
}

// Mesh: the last link between GPUs 0 and 1 is down at both ends. Its far end is still reported (the
// cable is there), so only the state tells that it does not count.
bool up(int g, unsigned l) {
  return !(g_scenario == Scenario::kMesh && l == 5 && (g == 0 || g == 1));
}

}  // namespace

extern "C" {

nvmlReturn_t nvmlInit_v2(void) {
  const char* s = std::getenv("FAKE_NVML_SCENARIO");
  const std::string name = s ? s : "nvswitch";
  if (name == "nvswitch") g_scenario = Scenario::kNvSwitch;
  else if (name == "mesh") g_scenario = Scenario::kMesh;
  else if (name == "pcie") g_scenario = Scenario::kPcie;
  else if (name == "init-fails") g_scenario = Scenario::kInitFails;
  else return NVML_ERROR_UNKNOWN;
  if (g_scenario == Scenario::kInitFails) return NVML_ERROR_DRIVER_NOT_LOADED;
  ++g_sessions;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
  if (g_sessions == 0) return NVML_ERROR_UNINITIALIZED;
  --g_sessions;
  return NVML_SUCCESS;
}

const char* nvmlErrorString(nvmlReturn_t r) {
  return r == NVML_ERROR_DRIVER_NOT_LOADED ? "Driver Not Loaded" : "Fake NVML error";
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (g_sessions == 0) return NVML_ERROR_UNINITIALIZED;
  *count = static_cast<unsigned>(gpus());
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (g_sessions == 0) return NVML_ERROR_UNINITIALIZED;
  if (index >= static_cast<unsigned>(gpus())) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &g_devices[index];
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t* pci) {
  if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
  fill_pci(kGpuBus[device->index], pci);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
  const char* product = g_scenario == Scenario::kPcie ? "Fake A100-PCIE-40GB" : "Fake H100 80GB HBM3";
  if (length < std::strlen(product) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::snprintf(name, length, "%s", product);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int* major, int* minor) {
  if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
  *major = g_scenario == Scenario::kPcie ? 8 : 9;
  *minor = 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t* is_active) {
  if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
  if (g_scenario == Scenario::kPcie) return NVML_ERROR_NOT_SUPPORTED;
  if (link >= NVML_NVLINK_MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
  *is_active = up(device->index, link) ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t* pci) {
  if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
  if (g_scenario == Scenario::kPcie) return NVML_ERROR_NOT_SUPPORTED;
  if (link >= NVML_NVLINK_MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
  fill_pci(far_end(device->index, link), pci);
  return NVML_SUCCESS;
}

// Not NVML: for tests, the sessions still open.
int fake_nvml_sessions(void) { return g_sessions; }

}  // extern "C"

// The fake must have exactly the signatures tutti looks up.
static_assert(std::is_same_v<decltype(&nvmlInit_v2), nvmlInit_v2_fn>);
static_assert(std::is_same_v<decltype(&nvmlShutdown), nvmlShutdown_fn>);
static_assert(std::is_same_v<decltype(&nvmlErrorString), nvmlErrorString_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetCount_v2), nvmlDeviceGetCount_v2_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetHandleByIndex_v2), nvmlDeviceGetHandleByIndex_v2_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetPciInfo_v3), nvmlDeviceGetPciInfo_v3_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetName), nvmlDeviceGetName_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetCudaComputeCapability), nvmlDeviceGetCudaComputeCapability_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetNvLinkState), nvmlDeviceGetNvLinkState_fn>);
static_assert(std::is_same_v<decltype(&nvmlDeviceGetNvLinkRemotePciInfo_v2), nvmlDeviceGetNvLinkRemotePciInfo_v2_fn>);
