#pragma once
// TUTTI_TRACE=file.json (CpuExecutorOptions::trace): a Chrome/Perfetto trace of every instruction every block of every rank runs
// (start, duration, bytes, peer, plan). One file per process, written at exit: a process that hosts
// several ranks (threads) writes them all; when ranks are processes, "%r" in the name becomes the
// rank, and without it ".rank<R>" is added before the extension so processes do not overwrite each
// other. Open it in ui.perfetto.dev or chrome://tracing: one row per (rank, block).

#include <cstdint>
#include <string>

namespace tutti::trace {

// Starts collecting for the process (CpuExecutorOptions::trace; the first call's path wins): events
// are written to `path` at exit. `ranks_are_processes`: another rank of the job runs in another
// process, so this one's file is told apart by its rank.
void start(const std::string& path, bool ranks_are_processes);
bool enabled();
double now_us();
void record(int rank, int64_t block, const char* op, double start_us, double end_us, int64_t bytes, int peer,
            const std::string& plan);

}  // namespace tutti::trace
