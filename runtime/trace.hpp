#pragma once
// TUTTI_TRACE=file.json: a Chrome/Perfetto trace of every instruction every block of every rank runs
// (start, duration, bytes, peer, plan). One file per process, written at exit: a process that hosts
// several ranks (threads) writes them all; when ranks are processes, "%r" in the name becomes the
// rank, and without it ".rank<R>" is added before the extension so processes do not overwrite each
// other. Open it in ui.perfetto.dev or chrome://tracing: one row per (rank, block).

#include <cstdint>
#include <string>

namespace tutti::trace {

bool enabled();
double now_us();
void record(int rank, int64_t block, const char* op, double start_us, double end_us, int64_t bytes, int peer,
            const std::string& plan);

}  // namespace tutti::trace
