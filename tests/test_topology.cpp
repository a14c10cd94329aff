// Topology model, NCCL topology XML and JSON formats, presets, detection.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "topologies/topology.hpp"

using namespace tutti;
using namespace tutti::topo;

namespace {

std::string read(const std::string& name) {
  std::ifstream in(std::string(TUTTI_TESTDATA) + "/nccl-topo/" + name);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Expect {
  const char* file;
  int gpus, numa, nics, nvlink, xgmi, nvswitch;
};

class SharedTopology : public ::testing::TestWithParam<Expect> {};

TEST_P(SharedTopology, ImportsWithTheRightCountsAndRoundTrips) {
  const Expect& e = GetParam();
  std::vector<std::string> warnings;
  Topology t = import_nccl_xml(read(e.file), &warnings);
  EXPECT_EQ(t.count(DeviceType::kGpu), e.gpus);
  EXPECT_EQ(t.count(DeviceType::kNuma), e.numa);
  EXPECT_EQ(t.count(DeviceType::kNic), e.nics);
  EXPECT_EQ(t.count(LinkType::kNvLink), e.nvlink);
  EXPECT_EQ(t.count(LinkType::kXgmi), e.xgmi);
  EXPECT_EQ(t.count(DeviceType::kNvSwitch), e.nvswitch);
  EXPECT_EQ(t.nranks(), e.gpus);
  // Sensible bandwidths: PCIe links 0.2..64 GB/s, GPU-to-GPU paths at least PCIe speed.
  for (auto& l : t.links) {
    if (l.type == LinkType::kPcie) {
      EXPECT_GE(l.gbps, 0.2);
      EXPECT_LE(l.gbps, 64);
    }
    EXPECT_GT(l.gbps, 0);
  }
  for (int r = 1; r < t.nranks(); ++r) EXPECT_GT(t.path(0, r).gbps, 0.2) << e.file << " rank " << r;
  Topology again = import_nccl_xml(export_nccl_xml(t));
  EXPECT_TRUE(again == t) << "NCCL XML round trip changed the topology of " << e.file;
  EXPECT_TRUE(parse_json(to_json(t)) == t) << "JSON round trip changed the topology of " << e.file;
}

// Counts read off the files: <gpu>, <cpu>, <net>, NVLink/xGMI peer pairs, NVLink targets that are switches.
INSTANTIATE_TEST_SUITE_P(
    NcclTopoFiles, SharedTopology,
    ::testing::Values(Expect{"ibm-h100-8gpu.xml", 8, 2, 8, 32, 0, 4}, Expect{"rccl-topo_4p1h.xml", 4, 1, 1, 0, 4, 0},
                      Expect{"rccl-topo_8p6l_2nic.xml", 8, 2, 2, 0, 24, 0}, Expect{"rccl-topo_8p_pcie.xml", 8, 1, 1, 0, 0, 0},
                      Expect{"rccl-topo_8p_rome_n2.xml", 8, 4, 1, 0, 8, 0}),
    [](const auto& info) {
      std::string s = info.param.file;
      for (char& c : s)
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      return s;
    });

TEST(Topology, H100NvSwitchesWorkInParallel) {
  Topology t = import_nccl_xml(read("ibm-h100-8gpu.xml"));
  Path p = t.path(0, 5);
  EXPECT_NEAR(p.gbps, 18 * 20.6, 0.5);  // 18 NVLinks of 20.6 GB/s
  EXPECT_EQ(p.hops.size(), 2u);
}

TEST(Topology, PresetsHaveTheirMachinesShape) {
  struct P {
    const char* name;
    int gpus, nvswitch, nvlink, nics;
    double gpu_gpu;  // path rank 0 -> 1
  };
  for (const P& p : {P{"dgx1", 8, 0, 16, 4, 20.0}, P{"dgx-a100", 8, 6, 48, 8, 240.0}, P{"ndv4", 8, 6, 48, 8, 240.0},
                     P{"dgx-h100", 8, 4, 32, 8, 18 * 20.6}, P{"ndv5", 8, 4, 32, 8, 18 * 20.6},
                     P{"ncv4", 4, 0, 2, 1, 240.0}, P{"pcie8", 8, 0, 0, 1, 31.5}}) {
    SCOPED_TRACE(p.name);
    Topology t = preset(p.name);
    EXPECT_EQ(t.count(DeviceType::kGpu), p.gpus);
    EXPECT_EQ(t.count(DeviceType::kNvSwitch), p.nvswitch);
    EXPECT_EQ(t.count(LinkType::kNvLink), p.nvlink);
    EXPECT_EQ(t.count(DeviceType::kNic), p.nics);
    EXPECT_EQ(t.nranks(), p.gpus);
    EXPECT_NEAR(t.path(0, 1).gbps, p.gpu_gpu, 0.6);
    EXPECT_TRUE(import_nccl_xml(export_nccl_xml(t)).count(LinkType::kNvLink) == p.nvlink);
    EXPECT_TRUE(parse_json(to_json(t)) == t);
  }
  Topology cpu = preset("cpu-tcp", 3);
  EXPECT_EQ(cpu.count(DeviceType::kHost), 3);
  EXPECT_EQ(cpu.nranks(), 6);
  EXPECT_NEAR(cpu.path(0, 1).gbps, 10.0, 0.1);    // across sockets (Skylake-class SMP)
  EXPECT_NEAR(cpu.path(0, 0).gbps, 7.0, 0.1);     // shared memory inside a NUMA node
  EXPECT_NEAR(cpu.path(0, 5).gbps, 3.125, 0.01);  // 25 GbE between hosts
}

TEST(Topology, MultiNodePresetsGoThroughTheNetwork) {
  Topology t = preset("dgx-h100", 4);
  EXPECT_EQ(t.count(DeviceType::kHost), 4);
  EXPECT_EQ(t.nranks(), 32);
  EXPECT_EQ(t.count(LinkType::kIb), 6 * 8 * 8);  // node pairs x NIC pairs
  Path inter = t.path(0, 31);
  EXPECT_NEAR(inter.gbps, 50, 0.1);  // NDR 400 Gb/s
  EXPECT_GT(inter.latency_us, t.path(0, 1).latency_us);
  EXPECT_THROW(preset("dgx2"), InvalidArgument);
  EXPECT_THROW(preset("dgx1", 0), InvalidArgument);
}

TEST(Topology, BadInputIsNamed) {
  try {
    import_nccl_xml("<system><cpu><pci busid=\"x\"");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("line 1"), std::string::npos) << e.what();
  }
  std::vector<std::string> warnings;
  import_nccl_xml("<system version=\"1\"><cpu numaid=\"0\"><fan/></cpu><rack/></system>", &warnings);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("unknown element <fan>"), std::string::npos);
  EXPECT_THROW(parse_json("{\"format\":\"tutti-topology\",\"version\":9}"), InvalidArgument);
  EXPECT_THROW(preset("dgx1").path(0, 99), InvalidArgument);
}

TEST(Topology, DetectionDescribesThisMachine) {
  Topology t = detect();
  EXPECT_EQ(t.count(DeviceType::kHost), 1);
  EXPECT_GE(t.count(DeviceType::kNuma), 1);
  EXPECT_GE(t.nranks(), 1);
  EXPECT_TRUE(parse_json(to_json(t)) == t);
  EXPECT_NE(to_json(t).find("\"type\": \"numa\""), std::string::npos);
}

}  // namespace

TEST(Topology, MergeJoinsHostViewsIntoOneWorld) {
  // Two hosts as their own detection would see them: a two-socket CPU box and an 8-GPU node.
  Topology cpu = preset("cpu-tcp"), gpu = preset("dgx-a100");
  Topology w = merge({cpu, gpu}, {0, 1, 1, 0, 1});
  EXPECT_EQ(w.count(DeviceType::kHost), 2);
  EXPECT_EQ(w.count(DeviceType::kGpu), 8);
  EXPECT_EQ(w.nranks(), 5);
  // Ranks of one host take that host's rank devices in order.
  EXPECT_EQ(w.devices[w.rank_device[0]].host, w.devices[w.rank_device[3]].host);
  EXPECT_NE(w.devices[w.rank_device[0]].host, w.devices[w.rank_device[1]].host);
  EXPECT_EQ(w.devices[w.rank_device[1]].type, DeviceType::kGpu);
  EXPECT_NE(w.rank_device[1], w.rank_device[2]);
  // Inside the GPU host NVLink, between hosts the slower NIC (25 GbE of the CPU box).
  EXPECT_GT(w.path(1, 2).gbps, 100);
  Path across = w.path(0, 1);
  EXPECT_NEAR(across.gbps, 25.0 / 8, 1e-9);
  EXPECT_NE(std::find(across.hops.begin(), across.hops.end(), LinkType::kEthernet), across.hops.end());
  // The merged world round-trips like any topology, and bad input is named.
  EXPECT_EQ(parse_json(to_json(w)), w);
  try {
    merge({cpu}, {0, 1});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 is on host 1, but 1 hosts were given"), std::string::npos) << e.what();
  }
}

TEST(Topology, MergeGivesAHostWithoutANicANetworkLink) {
  Topology bare;
  bare.name = "bare";
  int host = bare.add_device(DeviceType::kHost, "bare", -1, 0);
  int numa = bare.add_device(DeviceType::kNuma, "numa0", host, host);
  bare.rank_device = {numa, numa};
  Topology w = merge({bare, bare}, {0, 0, 1, 1});
  EXPECT_EQ(w.count(DeviceType::kNic), 2);
  EXPECT_NEAR(w.path(0, 2).gbps, 10.0 / 8, 1e-9);
  EXPECT_EQ(w.path(0, 1).hops, std::vector<LinkType>{LinkType::kShm});
}
