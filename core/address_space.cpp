#include "core/address_space.hpp"

#include <cstdlib>
#include <fstream>
#include <string>

namespace tutti {

// Kernel-side entries such as [vsyscall] (above 2^63) are not the process's.
uint64_t highest_mapping_end() {
  std::ifstream maps("/proc/self/maps");
  if (!maps) return UINT64_MAX;  // cannot tell: do not refuse
  uint64_t highest = 0;
  for (std::string line; std::getline(maps, line);) {  // "begin-end perms offset dev inode path"
    const size_t dash = line.find('-');
    if (dash == std::string::npos) continue;
    const uint64_t end = std::strtoull(line.c_str() + dash + 1, nullptr, 16);
    if (end <= uint64_t{1} << 63 && end > highest) highest = end;
  }
  return highest;
}

}  // namespace tutti
