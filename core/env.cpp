#include "core/env.hpp"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "core/error.hpp"

namespace tutti::env {
namespace {

constexpr Variable kVariables[] = {
    {"TUTTI_DEBUG", "NCCL_DEBUG", "WARN", "Log level: NONE, VERSION, WARN, INFO, ABORT, TRACE."},
    {"TUTTI_DEBUG_SUBSYS", "NCCL_DEBUG_SUBSYS", "INIT,ENV",
     "Comma-separated subsystems logged at INFO/TRACE: INIT, COLL, P2P, SHM, NET, BOOTSTRAP, ENV, ALLOC, "
     "CALL, GRAPH, TUNING, ALL; a leading ^ inverts the set."},
    {"TUTTI_DEBUG_FILE", "NCCL_DEBUG_FILE", "",
     "Write the log to this file instead of stderr; %h is replaced by the host name and %p by the pid."},
    {"TUTTI_COMM_ID", "NCCL_COMM_ID", "",
     "Rendezvous address. host:port (rank 0 listens there) or the hex form of a unique id (set by tutti-run)."},
    {"TUTTI_COMM_SECRET", "", "",
     "Shared secret for a host:port TUTTI_COMM_ID (required with one: a bare host:port is refused without it)."},
    {"TUTTI_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "",
     "Network interfaces to use, NCCL syntax: prefix list, ^ excludes, = exact match (e.g. eth0, ^docker, =veth1)."},
    {"TUTTI_RANK", "", "", "This process's rank (also read: OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID)."},
    {"TUTTI_SIZE", "", "", "Number of ranks (also read: OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS)."},
    {"TUTTI_LOCAL_RANK", "", "",
     "Rank among the processes of this host (also read: OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)."},
    {"TUTTI_MAX_RANKS", "", "1048576",
     "Largest communicator a rank agrees to join: a larger nranks is refused at once (a corrupted or absurd size "
     "would otherwise allocate per-rank state for it). Far above any job that exists; raise it for a larger one."},
    {"TUTTI_MAX_LOCAL_RANKS", "", "4096",
     "Most ranks one process may hold as threads (ncclCommInitAll, Comm::create_local): a thread and its buffers "
     "each, so more is refused at once instead of exhausting the process."},
    {"TUTTI_INIT_TIMEOUT", "", "120", "Seconds a rank waits for all ranks to arrive at communicator creation."},
    {"TUTTI_TIMEOUT", "", "1800", "Seconds any other blocking wait may last before it fails; 0 waits forever."},
    {"TUTTI_DIVERGENCE_PROBE", "", "2",
     "Seconds a wait may make no progress before it asks the peers which collective call they are in (then at "
     "doubling intervals); ranks at the same call number in different calls fail at once naming both, instead of "
     "at TUTTI_TIMEOUT. 0 never asks."},
    {"TUTTI_FAULT", "", "",
     "Faults injected on purpose, for testing: KIND[:rank=R][:call=N][:step=S][:peer=P][:seconds=X], comma-separated; "
     "KIND is kill, stop, delay, close, drop or corrupt (docs/RELIABILITY.md)."},
    {"TUTTI_TRANSPORT", "", "auto", "auto (shm within a host, tcp across hosts), shm, or tcp for every peer."},
    {"TUTTI_SHM_SLOTS", "", "16",
     "Slots in each shared-memory FIFO. 2 MiB per direction keeps both ranks of a 2-core exchange busy; 1 MiB "
     "left them waiting for each other (docs/PERFORMANCE.md)."},
    {"TUTTI_SHM_SLOT_SIZE", "", "128K", "Bytes per shared-memory FIFO slot."},
    {"TUTTI_SHM_CMA", "", "1", "Use single-copy process_vm_readv for shared-memory messages between processes, where measured faster or from TUTTI_SHM_CMA_THRESHOLD up (0 disables)."},
    {"TUTTI_SHM_ZERO_COPY_THRESHOLD", "", "32K",
     "Shared-memory messages of at least this size go by reference when the receiver can read the source in place "
     "(ranks that are threads of one process, or buffers from ncclMemAlloc): one copy, no system call."},
    {"TUTTI_SHM_CMA_THRESHOLD", "", "64M",
     "Smallest message always sent by single copy instead of through the FIFO. Unset, the value tutti-tune "
     "--calibrate measured for this machine and rank count is used, else 64M, and smaller messages of 16 KiB "
     "or more choose by measured rates (TUTTI_SHM_CMA_ADAPTIVE); set, it alone decides."},
    {"TUTTI_SHM_CMA_ADAPTIVE", "", "1",
     "Between processes, messages of at least 16 KiB and below TUTTI_SHM_CMA_THRESHOLD go by FIFO or by "
     "single copy, whichever each connection measures faster for messages of their size (full slots; under a "
     "slot, powers of two), trying the other now and then: which one wins "
     "depends on how near the two cores are, which a VM changes at run time (docs/ARCHITECTURE.md). Off where a "
     "host has more ranks than cores (a copy's time then includes other ranks' turns). 0: the threshold alone "
     "decides."},
    {"TUTTI_TCP_NSOCKS", "", "2", "TCP sockets per peer and channel; large messages are striped across them."},
    {"TUTTI_TCP_STRIPE_THRESHOLD", "", "256K", "Smallest TCP message striped across all sockets of a peer."},
    {"TUTTI_SPIN", "", "200",
     "Microseconds a wait keeps polling after the last progress before it sleeps on a futex (or in poll()). "
     "With more ranks than cores on the host, polling yields the core after every round. Unset, the window "
     "tutti-tune --calibrate chose for this machine and rank count is used (shared memory), else 200."},
    {"TUTTI_MAILBOX_SIZE", "", "256K",
     "Data capacity of each rank's one-shot mailbox (runtime/mailbox.hpp), used for small collectives when every "
     "rank is on this host; 0 turns the mailbox off."},
    {"TUTTI_ONESHOT_THRESHOLD", "", "8K",
     "Largest collective (nccl-tests' size) the dispatcher runs through the one-shot mailbox instead of a plan "
     "(a tuning table or TUTTI_ALGO overrides it; 0: never). Unset, the per-collective thresholds "
     "tutti-tune --calibrate measured for this machine and rank count are used, else 8K."},
    {"TUTTI_DEVICE", "", "auto",
     "Which buffers the NCCL API runs on the device executor: auto (device memory, recognised with "
     "cudaPointerGetAttributes, on the CUDA device; host memory on the CPU executor) or emulated (every buffer, on "
     "the emulated device: CPU threads running the CUDA interpreter's code, for tests without a GPU)."},
    {"TUTTI_DEVICE_SLOT_SIZE", "", "512K",
     "Bytes per slot of a device FIFO (Simple protocol). A call runs in rounds sized so that each transfer of the "
     "plan fits one slot."},
    {"TUTTI_DEVICE_LL_SLOT_SIZE", "", "32K", "Bytes per slot of a device FIFO in the LL protocol (a 32-byte header with the call's stamp, then lines that are half data)."},
    {"TUTTI_DEVICE_FIFO_DEPTH", "", "8",
     "Slots per device FIFO. A plan that the verifier proves deadlock-free only with deeper FIFOs is refused."},
    {"TUTTI_DEVICE_INSTANCES", "", "0",
     "Copies of a plan in one device launch, each with its own FIFOs, taking the call's rounds in turn (more thread "
     "blocks move more bytes at once); 0 picks about one thread block per multiprocessor over the ranks of a GPU."},
    {"TUTTI_DEVICE_THREADS", "NCCL_NTHREADS", "512", "CUDA threads per thread block of the plan interpreter (a multiple of 32, at most 512)."},
    {"NCCL_BUFFSIZE", "", "",
     "NCCL's buffer per connection (bytes): when TUTTI_DEVICE_SLOT_SIZE is not set, device FIFO slots are this size "
     "divided by TUTTI_DEVICE_FIFO_DEPTH (NCCL splits its buffer into 8 steps the same way)."},
    {"NCCL_MIN_NCHANNELS", "", "",
     "Fewest device plan instances (tutti's counterpart of NCCL's channels) when TUTTI_DEVICE_INSTANCES is 0."},
    {"NCCL_MAX_NCHANNELS", "", "",
     "Most device plan instances when TUTTI_DEVICE_INSTANCES is 0 (they are also capped by what fits on the GPU)."},
    {"TUTTI_TOPO_FILE", "NCCL_TOPO_FILE", "",
     "This host's topology from a file (NCCL's topology XML or tutti's JSON) instead of detection, for the tuner's "
     "model and tutti-topo."},
    {"TUTTI_DEVICE_STAGING", "NCCL_P2P_DISABLE", "0",
     "1: device buffers travel through host memory over the host transports (shm, tcp) even between ranks that "
     "could share GPU memory, as between hosts. Blocking and slower; for machines where peer access is broken, and "
     "tests."},
    {"TUTTI_PROTO", "NCCL_PROTO", "",
     "Device protocol for every plan: Simple or LL (LL128 runs as Simple); unset: the plan's own, Simple by "
     "default. NCCL's ^ exclusion lists are accepted: ^LL forces Simple."},
    {"TUTTI_TILE_SIZE", "", "1M",
     "Largest piece a plan instruction moves at once; larger chunks are pipelined in tiles. Each by-reference "
     "(zero-copy) tile costs a round trip with the receiver, so tiles are larger than FIFO slots."},
    {"TUTTI_STREAM_THRESHOLD", "", "",
     "Collectives whose output buffer is at least this large write their received and copied data into it with "
     "non-temporal stores (core/copy.hpp), around the caches; 0: never. Unset: the host's last-level cache "
     "divided by the ranks on this host (at least 1M; 8M where the cache size is unknown)."},
    {"TUTTI_ALGO", "NCCL_ALGO", "",
     "Force an algorithm: a built-in name (ring_allreduce) or its family (ring, rhd, allpairs, tree, hier, rd, bruck, "
     "chain, pairwise), or the name of a loaded plan."},
    {"TUTTI_PLAN_DIR", "", "", "Directory of tutti JSON plans (and MSCCL XML) to load, verify and use in their size windows."},
    {"MSCCL_XML_FILES", "", "", "Colon-separated MSCCL algorithm XML files to load, verify and use (MSCCL's variable)."},
    {"MSCCL_ALGO_DIR", "", "", "Directory of MSCCL algorithm XML files to load (MSCCL's variable)."},
    {"TUTTI_TRACE", "", "",
     "Write a Chrome/Perfetto trace of every plan instruction to this JSON file at exit (%r: the rank; with "
     "ranks as processes and no %r, .rankN is added)."},
    {"TUTTI_CHECK", "", "0", "1: every collective first checks that all ranks called it with the same arguments."},
    {"TUTTI_TUNING_FILE", "", "",
     "Decision table (JSON, from tutti-tune or TUTTI_TUNE=1) the dispatcher consults before its fixed size windows; "
     "TUTTI_TUNE=1 also saves what it measures there (rank 0 writes)."},
    {"TUTTI_CALIBRATION_FILE", "", "",
     "Cost-model calibration (tutti-tune --calibrate) per transport and rank count, read by tutti-sim --topo live; "
     "default $XDG_CACHE_HOME/tutti/calibration.json or ~/.cache/tutti/calibration.json."},
    {"TUTTI_TUNE", "", "0",
     "1: the first call of a collective at a size the table does not cover measures the model's best candidates and "
     "every fixed algorithm on the live communicator (a few milliseconds), and uses the fastest from then on."},
    {"TUTTI_PIPELINE_DEPTH", "", "4", "Tiles in flight per reducing receive (staging slots per block)."},
    {"TUTTI_STREAM_EPILOGUES", "", "1",
     "1: a kernel that follows a reducing receive in a plan (a reduction's epilogue) and has a stream form runs on "
     "each range of the chunk as it is combined, while it is in the cache; 0: as a pass of its own."},
    {"TUTTI_HUGE_PAGES", "", "1",
     "1: host buffers of 4 MiB or more that a call reads or writes are moved onto 2 MiB transparent huge pages (MADV_COLLAPSE, "
     "Linux 6.1) on first use, which saves TLB misses and speeds single-copy reads 2-3x, and so are the shared-memory "
     "FIFOs that whole slots stream through and the one-shot outboxes; 0: left as they are (runtime/huge_pages.hpp)."},
    {"TUTTI_NVML_LIBRARY", "", "libnvidia-ml.so.1",
     "NVIDIA's management library, loaded at run time to detect GPUs and their NVLinks (a name for dlopen or a path); "
     "empty: topology detection does not use NVML. Without it (no driver), detection goes on with hwloc alone."},
    {"TUTTI_WORKERS", "", "0",
     "Threads per rank that run a plan's blocks (spread by channel; the calling thread is one of them). 0: the "
     "host's cores divided by the ranks on the host, at least 1."},
};

const Variable& lookup(std::string_view name) {
  for (const auto& v : kVariables)
    if (v.name == name) return v;
  throw InternalError(fmt::format("environment variable {} is not declared in core/env.cpp", name));
}

}  // namespace

std::span<const Variable> variables() { return kVariables; }

std::optional<std::string> raw(std::string_view name) {
  const Variable& v = lookup(name);
  if (const char* s = std::getenv(std::string(v.name).c_str())) return std::string(s);
  if (!v.alias.empty())
    if (const char* s = std::getenv(std::string(v.alias).c_str())) return std::string(s);
  return std::nullopt;
}

bool is_set(std::string_view name) {
  auto value = raw(name);
  return value && !value->empty();
}

std::string get_string(std::string_view name) {
  auto value = raw(name);
  return value ? *value : std::string(lookup(name).fallback);
}

int64_t get_int(std::string_view name) {
  std::string text = get_string(name);
  try {
    size_t used = 0;
    int64_t v = std::stoll(text, &used, 0);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw InvalidArgument(fmt::format("environment variable {}='{}' is not an integer", name, text));
}

bool get_bool(std::string_view name) {
  std::string text = get_string(name);
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off" || lower.empty()) return false;
  throw InvalidArgument(fmt::format("environment variable {}='{}' is not a boolean (0/1)", name, text));
}

std::optional<std::string> first_of(std::initializer_list<const char*> foreign_names) {
  for (const char* n : foreign_names)
    if (const char* s = std::getenv(n)) return std::string(s);
  return std::nullopt;
}

uint64_t parse_size(std::string_view text) {
  std::string s(text);
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    uint64_t mult = 1;
    std::string suffix = s.substr(used);
    if (suffix == "K" || suffix == "k" || suffix == "KiB") mult = 1ull << 10;
    else if (suffix == "M" || suffix == "m" || suffix == "MiB") mult = 1ull << 20;
    else if (suffix == "G" || suffix == "g" || suffix == "GiB") mult = 1ull << 30;
    else if (!suffix.empty() && suffix != "B") throw std::invalid_argument("suffix");
    if (v < 0) throw std::invalid_argument("negative");
    return static_cast<uint64_t>(v * static_cast<double>(mult));
  } catch (const std::exception&) {
    throw InvalidArgument(fmt::format("'{}' is not a size (examples: 4096, 64K, 16M, 1G)", text));
  }
}

uint64_t get_size(std::string_view name) {
  std::string text = get_string(name);
  try {
    return parse_size(text);
  } catch (const Error&) {
    throw InvalidArgument(fmt::format("environment variable {}='{}' is not a size (examples: 64K, 16M)", name, text));
  }
}

double get_seconds(std::string_view name) {
  std::string text = get_string(name);
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used == text.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  throw InvalidArgument(fmt::format("environment variable {}='{}' is not a number of seconds", name, text));
}

std::vector<std::string> split_list(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(sep, start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start) out.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace tutti::env
