#include "runtime/transport/connection.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace tutti {

std::string Connection::where() const { return fmt::format("rank {}, connection to rank {} on channel {}", rank_, peer_, channel_); }

}  // namespace tutti

namespace tutti {

void Connection::stamp_mismatch(CallStamp sent, CallStamp expected) const {
  throw InvalidUsage(fmt::format("{}: rank {} sent a message of {} but this rank runs {}: every rank must make the same "
                                 "calls (collective, count, datatype, op, root) in the same order",
                                 where(), peer_, describe_stamp(sent), describe_stamp(expected)));
}

void Connection::corrupt_header(const char* what) const {
  throw RemoteError(fmt::format("{}: corrupt {} from rank {} (checksum mismatch): the message was damaged in transit",
                                where(), what, peer_));
}

}  // namespace tutti
