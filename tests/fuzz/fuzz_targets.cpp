// libFuzzer targets for every decoder of outside input (built with -DTUTTI_FUZZ=ON and clang; see
// tests/fuzz/README.md). One source, one target per FUZZ_TARGET value. The contract each checks:
// whatever the bytes, the decoder returns or throws a tutti::Error naming what is wrong; anything
// else (a crash, another exception, a sanitizer report, a run past libFuzzer's -timeout, an
// allocation past -rss_limit_mb) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "compiler/msccl_xml.hpp"
#include "plan/plan.hpp"
#include "compiler/verify.hpp"
#include "runtime/bootstrap.hpp"
#include "topologies/topology.hpp"
#include "tutti/types.hpp"

namespace {

void plan_then_verify(const tutti::plan::Plan& p) {
  tutti::plan::VerifyOptions o;
  o.fifo_depth = 4;  // the search for the smallest depth multiplies the time by its steps
  tutti::plan::verify(p, o);
}

void run(const std::string& text, const std::vector<unsigned char>& bytes) {
  using namespace tutti;
#if FUZZ_TARGET == 1
  (void)bytes;
  std::vector<std::string> warnings;
  plan_then_verify(plan::import_msccl_xml(text, &warnings));
#elif FUZZ_TARGET == 2
  (void)bytes;
  plan_then_verify(plan::parse_json(text));
#elif FUZZ_TARGET == 3
  (void)bytes;
  std::vector<std::string> warnings;
  topo::import_nccl_xml(text, &warnings);
#elif FUZZ_TARGET == 4
  (void)bytes;
  topo::parse_json(text);
#elif FUZZ_TARGET == 5
  (void)text;
  PeerInfo::decode(bytes);
#else
#error "FUZZ_TARGET must be 1..5"
#endif
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<unsigned char> bytes(data, data + size);
  try {
    run(text, bytes);
  } catch (const tutti::Error&) {  // refused with a message: the contract
  }
  return 0;
}
