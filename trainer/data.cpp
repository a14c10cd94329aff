#include "trainer/data.hpp"

#include <fmt/format.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tutti/types.hpp"

namespace tutti::train {

TokenStream load_text_bytes(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files as they are
  if (!f) throw InvalidArgument(fmt::format("data: cannot open '{}': {}", path, std::strerror(errno)));
  TokenStream s;
  s.source = path;
  unsigned char buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof buf);
    if (n < 0) {
      int code = 0;
      std::string why = gzerror(f, &code);
      gzclose(f);
      throw InvalidArgument(fmt::format("data: reading '{}': {}", path, why));
    }
    if (n == 0) break;
    s.tokens.insert(s.tokens.end(), buf, buf + n);
  }
  gzclose(f);
  if (s.tokens.empty()) throw InvalidArgument(fmt::format("data: '{}' is empty", path));
  return s;
}

TokenStream load_llmc_bin(const std::string& path, int vocab) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(fmt::format("data: cannot open '{}'", path));
  int32_t header[256];
  if (!in.read(reinterpret_cast<char*>(header), sizeof header))
    throw InvalidArgument(fmt::format("data: '{}' is shorter than llm.c's 1024-byte header", path));
  if (header[0] != 20240520)
    throw InvalidArgument(fmt::format("data: '{}': header magic is {}, not llm.c's 20240520", path, header[0]));
  if (header[1] != 1)
    throw InvalidArgument(fmt::format("data: '{}': header version is {}, only 1 (uint16 tokens) is read", path,
                                      header[1]));
  const int64_t count = header[2];
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  if (count <= 0 || size != 1024 + 2 * count)
    throw InvalidArgument(fmt::format("data: '{}': the header says {} tokens ({} bytes), the file has {} bytes", path,
                                      count, 1024 + 2 * count, size));
  TokenStream s;
  s.source = path;
  s.vocab = vocab;
  s.tokens.resize(static_cast<size_t>(count));
  in.read(reinterpret_cast<char*>(s.tokens.data()), 2 * count);
  for (int64_t i = 0; i < count; ++i)
    if (s.tokens[static_cast<size_t>(i)] >= vocab)
      throw InvalidArgument(fmt::format("data: '{}': token {} is {}, outside the vocabulary of {}", path, i,
                                        s.tokens[static_cast<size_t>(i)], vocab));
  return s;
}

TokenStream load_tokens(const std::string& path) {
  if (path.size() > 4 && path.compare(path.size() - 4, 4, ".bin") == 0) return load_llmc_bin(path);
  return load_text_bytes(path);
}

void split_train_val(const TokenStream& all, TokenStream& train, TokenStream& val) {
  const size_t cut = all.tokens.size() - all.tokens.size() / 10;
  train.vocab = val.vocab = all.vocab;
  train.source = all.source + " (first 90 %)";
  val.source = all.source + " (last 10 %)";
  train.tokens.assign(all.tokens.begin(), all.tokens.begin() + static_cast<std::ptrdiff_t>(cut));
  val.tokens.assign(all.tokens.begin() + static_cast<std::ptrdiff_t>(cut), all.tokens.end());
}

void cut_batch(const TokenStream& s, int64_t step, int batch, int first, int count, int T, int32_t* out) {
  const int64_t n = static_cast<int64_t>(s.tokens.size());
  if (n < T + 1)
    throw InvalidArgument(fmt::format("data: {} has {} tokens, fewer than one sequence of {} + 1", s.source, n, T));
  const int64_t usable = n - T;  // a sequence may start at [0, usable)
  for (int i = 0; i < count; ++i) {
    // SplitMix64 of the run-wide sequence number: batches spread over the whole stream (consecutive
    // windows would give each step one section of a document, and a loss that follows the sections).
    uint64_t z = static_cast<uint64_t>(step * batch + first + i) * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const int64_t start = static_cast<int64_t>(z % static_cast<uint64_t>(usable));
    for (int t = 0; t <= T; ++t) out[static_cast<int64_t>(i) * (T + 1) + t] = s.tokens[static_cast<size_t>(start + t)];
  }
}

}  // namespace tutti::train
