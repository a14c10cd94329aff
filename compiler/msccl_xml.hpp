#pragma once
// MSCCL algorithm XML, both dialects:
// - msccl-tools' original: <algo name proto nchannels nchunksperloop ngpus coll inplace>;
// - the executor fork's: the same plus outofplace, minBytes and maxBytes.
// Collective names "reduce_scatter" and "reducescatter" are both read. Steps: s, r, rcs, rrs, rrc,
// rrcs, cpy, re, nop, with cnt > 1, depid/deps and hasdep.
//
// Import rules (what the MSCCL executor does with each field):
// - receives (r, rcs) write dstbuf/dstoff; their srcbuf/srcoff are the *sender's* offsets and are kept
//   only as `remote` (informational);
// - reducing receives (rrs, rrc, rrcs) take the local operand from srcbuf/srcoff and store to
//   dstbuf/dstoff;
// - re is dst = dst (+) src; nop steps are kept as nop instructions so step numbers, and thus
//   dependencies, mean the same as in the file.
// Export writes the executor dialect; a step with several dependencies becomes a chain of nops, an
// n-ary reduce a chain of re steps, and hasdep is computed.

#include <string>
#include <vector>

#include "plan/plan.hpp"

namespace tutti::plan {

// Throws InvalidArgument with the line number for malformed XML or impossible values. Unknown
// elements and attributes do not stop the import; they are appended to *warnings (if given).
Plan import_msccl_xml(const std::string& text, std::vector<std::string>* warnings = nullptr);

// Throws InvalidArgument when the plan uses what MSCCL cannot express (compute steps, a block with
// two send or two receive peers).
std::string export_msccl_xml(const Plan& plan);

}  // namespace tutti::plan
