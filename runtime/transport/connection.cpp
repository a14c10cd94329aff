#include "runtime/transport/connection.hpp"

#include <fmt/format.h>

namespace tutti {

std::string Connection::where() const { return fmt::format("rank {}, peer {}, channel {}", rank_, peer_, channel_); }

}  // namespace tutti
