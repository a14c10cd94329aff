// Each documented plan limit (plan::Limits, docs/PLANS.md) broken once, in plan JSON, in MSCCL XML
// and in a plan made in memory: the importer refuses it naming the field and the limit, before
// allocating anything the file sized; numbers of the wrong kind are refused, not converted.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "collectives/algorithms/registry.hpp"
#include "compiler/compile.hpp"
#include "compiler/msccl_xml.hpp"
#include "plan/plan.hpp"
#include "core/error.hpp"

using namespace tutti;
using namespace tutti::plan;
using json = nlohmann::json;

namespace {

json ring4() { return json::parse(to_json(compile(algorithms::build("ring_allreduce", 4)).plan)); }

std::string refusal_json(const json& j) {
  try {
    parse_json(j.dump());
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

std::string refusal_xml(const std::string& xml, std::vector<std::string>* warnings = nullptr) {
  try {
    import_msccl_xml(xml, warnings);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_REFUSED(message, fragment) \
  EXPECT_NE((message).find(fragment), std::string::npos) << "message: " << (message)

TEST(PlanLimits, JsonFieldsBeyondTheirLimitsAreRefusedNamingThem) {
  ASSERT_EQ(refusal_json(ring4()), "");
  json j = ring4();
  j["nranks"] = 5000;
  EXPECT_REFUSED(refusal_json(j), "nranks is 5000 (allowed 1..4096)");
  j = ring4();
  j["chunk_factor"] = 1 << 17;
  EXPECT_REFUSED(refusal_json(j), "chunk_factor is 131072 (allowed 1..65536)");
  j = ring4();
  j["ranks"][1]["input_chunks"] = (1 << 20) + 1;
  EXPECT_REFUSED(refusal_json(j), "rank 1 input_chunks is 1048577 (allowed 0..1048576)");
  j = ring4();
  for (auto& r : j["ranks"]) r["input_chunks"] = r["output_chunks"] = 1 << 20;  // 4 ranks x 2^21 > 2^22 in all
  EXPECT_REFUSED(refusal_json(j), "chunks over all ranks and buffers is");
  j = ring4();
  j["ranks"][2]["scratch_chunks"] = 1 << 20;  // scratch per chunk of the largest buffer: at most max(64, 4n)
  EXPECT_REFUSED(refusal_json(j), "rank 2 scratch_chunks (per chunk of its largest buffer");
  j = ring4();
  j["ranks"][0]["blocks"][0]["channel"] = 32;
  EXPECT_REFUSED(refusal_json(j), "channel is 32 (allowed 0..31)");
  j = ring4();
  j["ranks"][0]["blocks"][0]["channel"] = -1;
  EXPECT_REFUSED(refusal_json(j), "channel is -1 (allowed 0..31)");
}

TEST(PlanLimits, JsonNumbersOfTheWrongKindAreRefusedNotConverted) {
  json j = ring4();
  j["nranks"] = 4.5;
  EXPECT_REFUSED(refusal_json(j), "'nranks' is 4.5, not an integer");
  j = ring4();
  j["nranks"] = 1e300;
  EXPECT_REFUSED(refusal_json(j), "'nranks' is 1e+300, not an integer");
  j = ring4();
  j["ranks"][0]["blocks"][0]["channel"] = 4294967296;  // 2^32: would wrap to channel 0
  EXPECT_REFUSED(refusal_json(j), "'channel' is 4294967296, not an integer in");
  j = ring4();
  j["ranks"][0]["blocks"] = "three";
  EXPECT_REFUSED(refusal_json(j), "rank 0: 'blocks' must be an array");
  j = ring4();
  j["ranks"][0]["blocks"][0]["steps"][0] = 7;
  EXPECT_REFUSED(refusal_json(j), "rank 0 block 0 step 0 must be an object");
  EXPECT_REFUSED(refusal_json(json::array()), "the top level is not an object");
  j = ring4();
  j.erase("ranks");
  EXPECT_REFUSED(refusal_json(j), "missing field 'ranks'");
}

TEST(PlanLimits, InMemoryPlansAreCheckedToo) {
  Plan p = compile(algorithms::build("ring_allreduce", 2)).plan;
  check_limits(p);
  Plan blocks = p;
  blocks.ranks[0].blocks.resize(static_cast<size_t>(Limits::kBlocksPerRank) + 1);
  EXPECT_THROW(check_limits(blocks), InvalidArgument);
  Plan operands = p;
  operands.ranks[0].blocks[0].steps[0].deps.assign(static_cast<size_t>(Limits::kOperandsPerStep) + 1, Dep{0, 0});
  try {
    check_limits(operands);
    ADD_FAILURE() << "4097 operands accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_REFUSED(std::string(e.what()), "rank 0 block 0 step 0 operands is 409");  // the step's own source too
    EXPECT_REFUSED(std::string(e.what()), "(allowed 0..4096)");
  }
}

const char* kXml = R"(<algo name="t" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="CHAN">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="ID" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="SEND" recv="0" chan="0">
      <step s="0" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>)";

std::string xml(const std::string& chan = "0", const std::string& id = "1", const std::string& send = "0",
                const std::string& ngpus = "2") {
  std::string s = kXml;
  auto put = [&](const std::string& key, const std::string& v) {
    for (size_t at = 0; (at = s.find(key, at)) != std::string::npos; at += v.size()) s.replace(at, key.size(), v);
  };
  put("CHAN", chan);
  put("\"ID\"", "\"" + id + "\"");
  put("SEND", send);
  put("ngpus=\"2\"", "ngpus=\"" + ngpus + "\"");
  return s;
}

TEST(PlanLimits, MscclXmlAttributesBeyondTheirLimitsAreRefusedNamingThem) {
  EXPECT_EQ(refusal_xml(xml()), "");
  EXPECT_REFUSED(refusal_xml(xml("32")), "<tb chan=32> (allowed 0..31)");
  EXPECT_REFUSED(refusal_xml(xml("-1")), "<tb chan=-1> (allowed 0..31)");
  EXPECT_REFUSED(refusal_xml(xml("1000000")), "<tb chan=1000000> (allowed 0..31)");
  EXPECT_REFUSED(refusal_xml(xml("0", "4294967297")), "attribute id=4294967297 is out of range");
  EXPECT_REFUSED(refusal_xml(xml("0", "1", "7")), "<tb send=7 recv=0> outside -1..1");
  EXPECT_REFUSED(refusal_xml(xml("0", "1", "0", "5000")), "ngpus=5000 (allowed 1..4096)");
  std::string big = xml();
  big.replace(big.find("i_chunks=\"2\""), 12, "i_chunks=\"100000000\"");
  EXPECT_REFUSED(refusal_xml(big), "rank 0 input_chunks is 100000000 (allowed 0..1048576)");
}

// Thousands of unknown elements: imported, with the warnings capped. (Their cost, quadratic before
// line numbers came from a table, is measured by tests/fuzz/mutate_plans.py, not by a timed test.)
TEST(PlanLimits, MscclXmlWithThousandsOfUnknownElementsWarnsBriefly) {
  std::string s = xml();
  std::string junk;
  for (int i = 0; i < 20000; ++i) junk += "<junk a=\"1\" b=\"2\"/>\n";
  s.insert(s.find("<gpu"), junk);
  std::vector<std::string> warnings;
  EXPECT_EQ(refusal_xml(s, &warnings), "");
  ASSERT_EQ(warnings.size(), Limits::kWarnings + 1);
  EXPECT_EQ(warnings.back(), "... and 19968 more warnings");
}

}  // namespace
