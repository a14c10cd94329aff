#include "runtime/transport/connection.hpp"

#include <fmt/format.h>

namespace tutti {

std::string Connection::where() const { return fmt::format("rank {}, connection to rank {} on channel {}", rank_, peer_, channel_); }

}  // namespace tutti
