#pragma once
// Random point-to-point traffic for transport tests: every rank sends `messages` messages of random
// sizes to every peer and receives as many from each, all posted at once, then checks every byte.
// Sizes and contents depend only on (seed, sender, receiver, index), so both sides agree.

#include <cstddef>
#include <cstdint>

#include "runtime/communicator.hpp"

namespace tutti::test_support {

struct ExchangeSpec {
  uint64_t seed = 1;
  int messages = 12;           // per ordered pair
  size_t max_bytes = 4 << 20;  // random sizes are log-uniform in [min_bytes, max_bytes]
  size_t min_bytes = 1;
  size_t big_bytes = 64 << 20; // one message from rank 0 to rank 1 has exactly this size
  int channel = 0;
};

size_t message_bytes(const ExchangeSpec& spec, int src, int dst, int index);
unsigned char message_byte(int src, int dst, int index, size_t offset);

// Throws tutti::Error on transport failure and std::runtime_error on wrong data (naming the
// sender, message and offset). Returns the bytes received.
size_t random_exchange(Communicator& comm, const ExchangeSpec& spec);

}  // namespace tutti::test_support
