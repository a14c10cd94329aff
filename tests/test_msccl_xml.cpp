// MSCCL XML import/export on the public algorithm files, both dialects, and malformed input; JSON
// round trips.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "core/error.hpp"

using namespace tutti;
using namespace tutti::plan;

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> shared_xmls() {
  std::vector<std::string> v;
  for (auto& e : std::filesystem::directory_iterator(std::string(TUTTI_TESTDATA) + "/msccl"))
    if (e.path().extension() == ".xml") v.push_back(e.path().string());
  std::sort(v.begin(), v.end());
  return v;
}

TEST(MscclXml, EverySharedFileImportsVerifiesAndRoundTrips) {
  auto files = shared_xmls();
  ASSERT_EQ(files.size(), 6u) << "expected the six MSCCL algorithms of tests/data/msccl";
  for (auto& f : files) {
    SCOPED_TRACE(f);
    std::vector<std::string> warnings;
    Plan p = import_msccl_xml(read(f), &warnings);
    EXPECT_TRUE(warnings.empty()) << warnings.front();
    VerifyReport rep = verify(p);
    EXPECT_GT(rep.steps, 0);
    Plan again = import_msccl_xml(export_msccl_xml(p));
    EXPECT_TRUE(again == p) << "XML -> Plan -> XML -> Plan changed the plan";
    EXPECT_TRUE(parse_json(to_json(p)) == p) << "JSON round trip changed the plan";
  }
}

TEST(MscclXml, OriginalDialectWithoutExecutorAttributes) {
  std::string text = read(std::string(TUTTI_TESTDATA) + "/msccl/ncv4-ag_hier_4_LL.xml");
  std::string original = std::regex_replace(text, std::regex(R"( (outofplace|minBytes|maxBytes)="[0-9]+")"), "");
  ASSERT_EQ(original.find("minBytes"), std::string::npos);
  Plan a = import_msccl_xml(text), b = import_msccl_xml(original);
  EXPECT_EQ(b.min_bytes, 0u);
  EXPECT_EQ(b.max_bytes, UINT64_MAX);
  EXPECT_EQ(a.min_bytes, 64u);
  b.min_bytes = a.min_bytes;
  b.max_bytes = a.max_bytes;
  EXPECT_TRUE(a == b);
  EXPECT_NO_THROW(verify(b));
}

// RCCL's reading: inplace="1" and outofplace="1" together mean one schedule for both kinds of call
// (an out-of-place plan, which the dispatcher also runs in place); maxBytes="0" means no bound.
TEST(MscclXml, RcclDialectBothVariantsAndUnboundedMaxBytes) {
  std::string text = read(std::string(TUTTI_TESTDATA) + "/msccl/ncv4-ag_hier_4_LL.xml");
  std::string both = std::regex_replace(text, std::regex(R"(inplace="[01]" outofplace="[01]")"), R"(inplace="1" outofplace="1")");
  both = std::regex_replace(both, std::regex(R"(maxBytes="[0-9]+")"), R"(maxBytes="0")");
  ASSERT_NE(both.find(R"(inplace="1" outofplace="1")"), std::string::npos);
  Plan p = import_msccl_xml(both);
  EXPECT_FALSE(p.inplace);
  EXPECT_EQ(p.max_bytes, UINT64_MAX);
  EXPECT_NO_THROW(verify(p));
  std::string neither = std::regex_replace(text, std::regex(R"(inplace="[01]" outofplace="[01]")"), R"(inplace="0" outofplace="0")");
  try {
    import_msccl_xml(neither);
    FAIL() << "imported an algorithm that serves no call";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("serves no call"), std::string::npos) << e.what();
  }
}

TEST(MscclXml, BothReduceScatterSpellings) {
  Plan p = compile(algorithms::build("ring_reducescatter", 4)).plan;
  std::string xml = export_msccl_xml(p);
  EXPECT_NE(xml.find("coll=\"reducescatter\""), std::string::npos);
  std::string other = std::regex_replace(xml, std::regex("coll=\"reducescatter\""), "coll=\"reduce_scatter\"");
  Plan q = import_msccl_xml(other);
  EXPECT_EQ(q.collective, Collective::kReduceScatter);
  EXPECT_NO_THROW(verify(q));
}

const char* kHandWritten = R"(<algo name="hand" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="2" o_chunks="0" s_chunks="2">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="s" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="s" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="-1" chan="0">
      <step s="0" type="nop" srcbuf="i" srcoff="-1" dstbuf="o" dstoff="-1" cnt="0" depid="0" deps="0" hasdep="0"/>
      <step s="1" type="re" srcbuf="s" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="0" deps="1" hasdep="0"/>
      <step s="2" type="re" srcbuf="s" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="2" o_chunks="0" s_chunks="2">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="s" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="s" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="-1" chan="0">
      <step s="0" type="nop" srcbuf="i" srcoff="-1" dstbuf="o" dstoff="-1" cnt="0" depid="0" deps="0" hasdep="0"/>
      <step s="1" type="re" srcbuf="s" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="0" deps="1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
)";

TEST(MscclXml, NopChainsReChainsCountsAndHasdep) {
  Plan p = import_msccl_xml(kHandWritten);
  EXPECT_EQ(p.ranks[0].blocks[1].steps[0].op, Opcode::kNop);
  EXPECT_EQ(p.ranks[0].blocks[1].steps[1].op, Opcode::kReduce);
  EXPECT_EQ(p.ranks[1].blocks[1].steps[1].count(), 2);  // cnt > 1
  EXPECT_EQ(p.ranks[0].blocks[0].steps[1].remote->buffer, BufferKind::kInput);  // the sender's offsets
  EXPECT_NO_THROW(verify(p));
  // Export: hasdep marks exactly the steps others depend on.
  std::string xml = export_msccl_xml(p);
  std::regex hasdep1(R"(<step s="1" type="r"[^>]*hasdep="1")");
  EXPECT_TRUE(std::regex_search(xml, hasdep1)) << xml;
  // A step with several dependencies becomes a nop chain, an n-ary reduce a re chain.
  Plan multi = p;
  auto& re = multi.ranks[0].blocks[1].steps[1];
  re.deps.push_back({0, 0});
  re.srcs.push_back(Ref{BufferKind::kScratch, 0, 1});
  std::string chained = export_msccl_xml(multi);
  Plan back = import_msccl_xml(chained);
  EXPECT_EQ(back.ranks[0].blocks[1].steps.size(), 5u) << chained;  // nop, nop, re, re, re
}

TEST(MscclXml, MalformedXmlNamesTheLine) {
  std::string broken = std::string(kHandWritten).substr(0, 400);
  try {
    import_msccl_xml(broken);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MSCCL XML line"), std::string::npos) << e.what();
  }
  std::string bad_type = std::regex_replace(std::string(kHandWritten), std::regex("type=\"re\""), "type=\"rx\"");
  try {
    import_msccl_xml(bad_type);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("line 9: unknown step type 'rx'"), std::string::npos) << e.what();
  }
  std::string bad_number = std::regex_replace(std::string(kHandWritten), std::regex("cnt=\"2\""), "cnt=\"two\"");
  EXPECT_THROW(import_msccl_xml(bad_number), InvalidArgument);
  EXPECT_THROW(import_msccl_xml(""), InvalidArgument);
  EXPECT_THROW(import_msccl_xml("<notalgo/>"), InvalidArgument);
}

TEST(MscclXml, UnknownElementsAndAttributesAreReported) {
  std::string extra = std::regex_replace(std::string(kHandWritten), std::regex("<tb id=\"1\" send=\"-1\""),
                                         "<note/><tb color=\"red\" id=\"1\" send=\"-1\"");
  std::vector<std::string> warnings;
  Plan p = import_msccl_xml(extra, &warnings);
  ASSERT_EQ(warnings.size(), 4u);
  EXPECT_NE(warnings[0].find("unknown element <note>"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("unknown attribute color=\"red\""), std::string::npos) << warnings[1];
  EXPECT_NO_THROW(verify(p));
}

TEST(MscclXml, ExportRefusesWhatMscclCannotExpress) {
  Plan p = compile(algorithms::build("allpairs_allreduce", 4)).plan;  // blocks with several peers
  bool several = false;
  for (auto& b : p.ranks[0].blocks) {
    std::set<int> peers;
    for (auto& s : b.steps)
      if (s.send_peer >= 0) peers.insert(s.send_peer);
    several |= peers.size() > 1;
  }
  if (several) {
    EXPECT_THROW(export_msccl_xml(p), InvalidArgument);
  } else {
    EXPECT_NO_THROW(verify(import_msccl_xml(export_msccl_xml(p))));
  }
}

TEST(PlanJson, RoundTripsExactlyAndRejectsUnknownFields) {
  for (const char* name : {"ring_allreduce", "hier_alltoall", "tree_allreduce"}) {
    Plan p = compile(algorithms::build(name, 6, std::string(name) == "hier_alltoall" ? algorithms::Params{{"local", 2}}
                                                                                     : algorithms::Params{}))
                 .plan;
    EXPECT_TRUE(parse_json(to_json(p)) == p) << name;
  }
  std::string j = to_json(compile(algorithms::build("ring_allreduce", 2)).plan);
  std::string unknown = std::regex_replace(j, std::regex("\"chunk_factor\""), "\"chunkfactor\"");
  try {
    parse_json(unknown);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown field 'chunkfactor'"), std::string::npos) << e.what();
  }
  std::string version = std::regex_replace(j, std::regex("\"version\": 1"), "\"version\": 7");
  EXPECT_THROW(parse_json(version), InvalidArgument);
  EXPECT_THROW(parse_json("{"), InvalidArgument);
}

}  // namespace
