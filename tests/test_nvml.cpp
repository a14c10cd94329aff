// GPU and NVLink detection through NVML, against the fake library of tests/fake_nvml.cpp
// (FAKE_NVML_PATH), so it runs on machines without a GPU. Each test compares with detection
// without NVML on the same machine, so real GPUs that hwloc finds here do not change the outcome.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include <sys/wait.h>
#include <unistd.h>

#include "core/log.hpp"
#include "support/env.hpp"
#include "topologies/nvml.hpp"
#include "topologies/topology.hpp"

using namespace tutti;
using namespace tutti::topo;

namespace {

using test_support::ScopedEnv;

// Log lines of the GRAPH subsystem go to a file while this lives.
class CapturedLog {
 public:
  CapturedLog() {
    std::remove(path_.c_str());
    log::reload();
  }
  ~CapturedLog() { std::remove(path_.c_str()); }
  std::string text() const {
    std::stringstream ss;
    ss << std::ifstream(path_).rdbuf();
    return ss.str();
  }

 private:
  struct Reload {
    ~Reload() { log::reload(); }  // runs last, once the variables below are restored
  } reload_;
  std::string path_ = ::testing::TempDir() + "tutti-nvml-log-" + std::to_string(getpid()) + ".txt";
  ScopedEnv env_{{"TUTTI_DEBUG", "INFO"}, {"TUTTI_DEBUG_SUBSYS", "GRAPH"}, {"TUTTI_DEBUG_FILE", path_.c_str()}};
};

constexpr double kSm90Link = 20.6;  // GB/s per NVLink, NCCL's figure for sm 90

Topology without_nvml() { return detect(DetectOptions{""}); }

Topology with_fake(const char* scenario) {
  ScopedEnv env({{"TUTTI_NVML_LIBRARY", FAKE_NVML_PATH}, {"FAKE_NVML_SCENARIO", scenario}});
  return detect();
}

// NVML sessions the fake still has open (it is loaded by then: detection never unloads NVML).
int open_sessions() {
  void* lib = dlopen(FAKE_NVML_PATH, RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return -1;
  auto sessions = reinterpret_cast<int (*)()>(dlsym(lib, "fake_nvml_sessions"));
  int n = sessions ? sessions() : -1;
  dlclose(lib);  // only the reference RTLD_NOLOAD took
  return n;
}

int device_at(const Topology& t, const std::string& busid) {
  for (const Device& d : t.devices) {
    auto it = d.attrs.find(d.type == DeviceType::kNvSwitch ? "busid" : "pci.busid");
    if (it != d.attrs.end() && it->second == busid) return d.id;
  }
  return -1;
}

const Link* link_between(const Topology& t, int a, int b) {
  for (const Link& l : t.links)
    if ((l.a == a && l.b == b) || (l.a == b && l.b == a)) return &l;
  return nullptr;
}

const std::string kGpus[4] = {"fa00:1b:00.0", "fa00:43:00.0", "fa00:52:00.0", "fa00:61:00.0"};

}  // namespace

TEST(NvmlBusId, BecomesHwlocsForm) {
  EXPECT_EQ(nvml::normalize_busid("00000000:1B:00.0"), "0000:1b:00.0");
  EXPECT_EQ(nvml::normalize_busid("0000:1B:00.0"), "0000:1b:00.0");  // busIdLegacy
  EXPECT_EQ(nvml::normalize_busid("00000001:C3:1F.7"), "0001:c3:1f.7");
  EXPECT_EQ(nvml::normalize_busid("0000FA00:F3:00.0"), "fa00:f3:00.0");
  EXPECT_EQ(nvml::normalize_busid(""), "");
  EXPECT_EQ(nvml::normalize_busid("not a bus id"), "");
  EXPECT_EQ(nvml::normalize_busid("00000000:1B:00.0 "), "");
  EXPECT_EQ(nvml::normalize_busid(nullptr), "");
}

TEST(NvmlDetection, NvSwitchMachineHasItsGpusSwitchesAndLinkCounts) {
  const Topology base = without_nvml();
  const Topology t = with_fake("nvswitch");
  EXPECT_EQ(t.count(DeviceType::kGpu), base.count(DeviceType::kGpu) + 4);
  EXPECT_EQ(t.count(DeviceType::kNvSwitch), base.count(DeviceType::kNvSwitch) + 4);
  EXPECT_EQ(t.count(LinkType::kNvLink), base.count(LinkType::kNvLink) + 16);  // every GPU to every switch
  EXPECT_EQ(t.nranks(), base.nranks());  // ranks stay where the CPU executor runs them
  const int per_switch[4] = {5, 4, 4, 5};
  for (const std::string& busid : kGpus) {
    const int g = device_at(t, busid);
    ASSERT_GE(g, 0) << busid;
    const Device& d = t.devices[g];
    EXPECT_EQ(d.type, DeviceType::kGpu);
    EXPECT_EQ(d.attrs.at("sm"), "90");
    EXPECT_EQ(d.attrs.at("name"), "Fake H100 80GB HBM3");
    ASSERT_GE(d.parent, 0);
    EXPECT_EQ(t.devices[d.parent].type, DeviceType::kNuma);
    ASSERT_NE(link_between(t, g, d.parent), nullptr) << busid << " is not reached over PCIe";
    for (int s = 0; s < 4; ++s) {
      const int sw = device_at(t, fmt::format("fa00:f{}:00.0", 3 + s));
      ASSERT_GE(sw, 0);
      EXPECT_EQ(t.devices[sw].type, DeviceType::kNvSwitch);
      const Link* l = link_between(t, g, sw);
      ASSERT_NE(l, nullptr) << busid << " to switch " << s;
      EXPECT_EQ(l->type, LinkType::kNvLink);
      EXPECT_EQ(l->count, per_switch[s]);
      EXPECT_NEAR(l->gbps, per_switch[s] * kSm90Link, 1e-9);
    }
  }
  // GPUs on the same switches reach each other with all 18 links.
  Topology ranked = t;
  ranked.rank_device.clear();
  for (const std::string& busid : kGpus) ranked.rank_device.push_back(device_at(t, busid));
  EXPECT_NEAR(ranked.path(0, 3).gbps, 18 * kSm90Link, 1e-9);
  EXPECT_EQ(ranked.path(0, 3).hops, (std::vector<LinkType>{LinkType::kNvLink, LinkType::kNvLink}));
  // Exported for NCCL, the links name the switches' bus ids; the topology survives JSON.
  EXPECT_NE(export_nccl_xml(t).find("<nvlink target=\"fa00:f3:00.0\" count=\"5\""), std::string::npos);
  EXPECT_TRUE(parse_json(to_json(t)) == t);
  EXPECT_EQ(open_sessions(), 0) << "detection left NVML initialised";
}

TEST(NvmlDetection, MeshCountsTheActiveLinksOfEachPair) {
  const Topology base = without_nvml();
  const Topology t = with_fake("mesh");
  EXPECT_EQ(t.count(DeviceType::kGpu), base.count(DeviceType::kGpu) + 4);
  EXPECT_EQ(t.count(DeviceType::kNvSwitch), base.count(DeviceType::kNvSwitch));
  EXPECT_EQ(t.count(LinkType::kNvLink), base.count(LinkType::kNvLink) + 6);  // each pair once
  for (int a = 0; a < 4; ++a)
    for (int b = a + 1; b < 4; ++b) {
      const Link* l = link_between(t, device_at(t, kGpus[a]), device_at(t, kGpus[b]));
      ASSERT_NE(l, nullptr) << a << "-" << b;
      const int links = a == 0 && b == 1 ? 5 : 6;  // one link between GPUs 0 and 1 is down
      EXPECT_EQ(l->type, LinkType::kNvLink);
      EXPECT_EQ(l->count, links) << a << "-" << b;
      EXPECT_NEAR(l->gbps, links * kSm90Link, 1e-9) << a << "-" << b;
    }
  EXPECT_EQ(open_sessions(), 0);
}

TEST(NvmlDetection, GpusWithoutNvLinkAreAddedWithoutLinks) {
  const Topology base = without_nvml();
  const Topology t = with_fake("pcie");
  EXPECT_EQ(t.count(DeviceType::kGpu), base.count(DeviceType::kGpu) + 2);
  EXPECT_EQ(t.count(LinkType::kNvLink), base.count(LinkType::kNvLink));
  EXPECT_EQ(t.count(DeviceType::kNvSwitch), base.count(DeviceType::kNvSwitch));
  for (int k = 0; k < 2; ++k) {
    const int g = device_at(t, kGpus[k]);
    ASSERT_GE(g, 0);
    EXPECT_EQ(t.devices[g].attrs.at("sm"), "80");
    EXPECT_EQ(t.devices[g].attrs.at("name"), "Fake A100-PCIE-40GB");
  }
  EXPECT_EQ(device_at(t, kGpus[2]), -1);
  EXPECT_EQ(open_sessions(), 0);
}

TEST(NvmlDetection, WithoutADriverDetectionGoesOnAndSaysWhy) {
  const Topology base = without_nvml();
  CapturedLog log;
  const Topology t = with_fake("init-fails");
  const std::string text = log.text();
  EXPECT_TRUE(t == base);
  EXPECT_NE(text.find("no GPUs from NVML: nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)"), std::string::npos)
      << text;
  EXPECT_EQ(open_sessions(), 0);
}

TEST(NvmlDetection, AMissingLibraryLeavesDetectionAsWithoutNvml) {
  const Topology base = without_nvml();
  CapturedLog log;
  Topology t;
  {
    ScopedEnv env({{"TUTTI_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1"}});
    EXPECT_NO_THROW(t = detect());
  }
  EXPECT_TRUE(t == base);
  EXPECT_GE(t.count(DeviceType::kNuma), 1);
  EXPECT_GE(t.nranks(), 1);
  EXPECT_NE(log.text().find("no GPUs from NVML: cannot load /nonexistent/libnvidia-ml.so.1"), std::string::npos)
      << log.text();
}

TEST(NvmlDetection, ALibraryThatIsNotNvmlIsRefusedByName) {
  std::string why;
  EXPECT_FALSE(nvml::read("libm.so.6", &why).has_value());
  EXPECT_NE(why.find("libm.so.6 has no nvmlInit_v2"), std::string::npos) << why;
  // And through detection, which carries on.
  ScopedEnv env({{"TUTTI_NVML_LIBRARY", "libm.so.6"}});
  EXPECT_TRUE(detect() == without_nvml());
}

TEST(NvmlMerge, EnrichesTheGpuHwlocFoundInsteadOfAddingIt) {
  Topology t;
  t.name = "box";
  const int host = t.add_device(DeviceType::kHost, "box", -1, 0);
  const int numa = t.add_device(DeviceType::kNuma, "numa0", host, host);
  const int seen = t.add_device(DeviceType::kGpu, "0000:1b:00.0", numa, host);  // as detect() names hwloc's
  t.devices[seen].attrs["pci.busid"] = "0000:1b:00.0";
  t.add_link(numa, seen, LinkType::kPcie, 63, 0.5);
  nvml::Report r;
  r.gpus = {{"0000:1b:00.0", "NVIDIA H200", 90}, {"0000:43:00.0", "NVIDIA H200", 90}};
  r.links = {{0, "0000:43:00.0", 12}, {1, "0000:1b:00.0", 12}, {0, "0000:f3:00.0", 2}};
  nvml::add_to(t, r, host, numa);
  EXPECT_EQ(t.count(DeviceType::kGpu), 2);
  EXPECT_EQ(t.devices[seen].attrs.at("sm"), "90");
  EXPECT_EQ(t.devices[seen].attrs.at("name"), "NVIDIA H200");
  EXPECT_EQ(t.devices[seen].parent, numa);
  const int added = device_at(t, "0000:43:00.0");
  ASSERT_GE(added, 0);
  EXPECT_NE(added, seen);
  ASSERT_NE(link_between(t, numa, added), nullptr);
  EXPECT_EQ(link_between(t, numa, added)->type, LinkType::kPcie);
  // Both GPUs report their 12 links; they become one link of 12.
  EXPECT_EQ(t.count(LinkType::kNvLink), 2);
  const Link* pair = link_between(t, seen, added);
  ASSERT_NE(pair, nullptr);
  EXPECT_EQ(pair->count, 12);
  EXPECT_NEAR(pair->gbps, 12 * kSm90Link, 1e-9);
  const int sw = device_at(t, "0000:f3:00.0");
  ASSERT_GE(sw, 0);
  EXPECT_EQ(t.devices[sw].type, DeviceType::kNvSwitch);
  ASSERT_NE(link_between(t, seen, sw), nullptr);
  EXPECT_EQ(link_between(t, seen, sw)->count, 2);
}

// tutti-topo on a machine with these GPUs shows them, their switches and their NVLinks.
TEST(NvmlDetection, TuttiTopoShowsGpusAndNvLinks) {
  const std::string cmd = fmt::format("env TUTTI_NVML_LIBRARY='{}' FAKE_NVML_SCENARIO=nvswitch '{}' 2>&1", FAKE_NVML_PATH,
                                      TUTTI_TOPO_PATH);
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("4 NVSwitch(es)"), std::string::npos) << out;
  EXPECT_NE(out.find("gpu fa00:1b:00.0 sm=90 pci.busid=fa00:1b:00.0 [pcie"), std::string::npos) << out;
  EXPECT_NE(out.find("fa00:1b:00.0 <-> nvswitch0: nvlink x5, 103.0 GB/s"), std::string::npos) << out;
  EXPECT_NE(out.find("fa00:61:00.0 <-> nvswitch3: nvlink x5, 103.0 GB/s"), std::string::npos) << out;
}
