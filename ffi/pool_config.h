// What a pool is made of: its tiers of memory outside the device (host
// DRAM, CXL memory, nvme files) and its workers (pool.h).
#ifndef JCXL_FFI_POOL_CONFIG_H_
#define JCXL_FFI_POOL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "allocator.h"

namespace jcxl {

enum class TierKind { kHost = 0, kCxl = 1, kNvme = 2 };
constexpr int kNumTiers = 3;
const char* TierName(TierKind kind);

struct TierConfig {
  uint64_t capacity = 0;       // 0: the tier is off
  std::vector<int> nodes;      // memory tiers: NUMA nodes (empty: unbound)
  std::vector<double> weights;  // per node, e.g. bandwidth; empty: equal
  bool emulated = false;        // no real hardware: say so everywhere
  double link_bytes_per_second = 0;  // > 0: emulate a link with this cap
  int64_t link_latency_ns = 0;
};

struct PoolConfig {
  TierConfig tiers[kNumTiers];
  std::string nvme_dir;         // the pool's own (private) directory
  bool keep_nvme_files = false;
  // A full tier spills to the next (host -> cxl -> nvme).
  bool spill = false;
  int copy_threads = 2;
  uint64_t chunk_bytes = 4ull << 20;
  std::vector<int> copy_cpus;   // CPUs for the copy workers (empty: any)
  // Update workers (host_update.h): 0: one per CPU the process may use, at
  // most kMaxDefaultUpdateThreads, at least kMinStagingUpdateThreads with
  // an nvme tier; started at the first update run.
  int update_threads = 0;
  // How long a transfer waits for the update runs it must follow (see
  // ObjectTable::AwaitRuns) before it fails.
  int64_t run_wait_ns = int64_t{1} << 60;
  HybridOptions allocator;
};

}  // namespace jcxl

#endif  // JCXL_FFI_POOL_CONFIG_H_
