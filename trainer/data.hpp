#pragma once
// Training data: token streams and the batches cut from them.
//
// Sources: the Jargon File from Debian's jargon-text package (public domain), as byte-level tokens
// (vocabulary 256), or llm.c's .bin token files (a header of 256 int32: magic 20240520, version 1,
// token count; then uint16 tokens, e.g. GPT-2-tokenized text). The last 10 % of a source is held
// out for validation.
//
// Batches are a function of the step: sequence i of step s starts at a position hashed from
// s * batch + i (spread over the whole stream), so every dp rank cuts its own sequences [d * batch / dp, ...)
// without talking to the others, and a run resumed at step s sees exactly what an uninterrupted
// run would have.

#include <cstdint>
#include <string>
#include <vector>

namespace tutti::train {

struct TokenStream {
  std::vector<uint16_t> tokens;
  int vocab = 256;  // ids are below this
  std::string source;
};

inline const char* kJargonFile = "/usr/share/doc/jargon-text/jargon.txt.gz";

// Bytes of a text file, gzipped or not. Throws InvalidArgument naming the file.
TokenStream load_text_bytes(const std::string& path);
// llm.c's format. Throws InvalidArgument naming the file and what is wrong (magic, version, a
// token count the file's size does not match, a token outside the vocabulary given).
TokenStream load_llmc_bin(const std::string& path, int vocab = 50257);
// Either, by extension (.bin: llm.c's format).
TokenStream load_tokens(const std::string& path);

// The first 90 % and the last 10 %.
void split_train_val(const TokenStream& all, TokenStream& train, TokenStream& val);

// Writes `count` sequences of T + 1 tokens, sequences [first, first + count) of step `step` of a
// run with `batch` sequences per step. Throws InvalidArgument when the stream is shorter than T + 1.
void cut_batch(const TokenStream& s, int64_t step, int batch, int first, int count, int T, int32_t* out);

}  // namespace tutti::train
