// Direct access to a pool's memory for a DMA engine outside it (a GPU's
// copy engine, ffi/cuda/): the address of an object's bytes, lent from
// BeginDirect until EndDirect (the object pinned meanwhile), the memory
// arenas' mappings, and the page-locking the engine does on them.
#ifndef JCXL_FFI_DIRECT_ACCESS_H_
#define JCXL_FFI_DIRECT_ACCESS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "copy_engine.h"
#include "object_table.h"
#include "page_locks.h"
#include "status.h"

namespace jcxl {

class UpdateService;

// Bytes of a memory-tier object lent to a DMA engine outside the pool (a
// GPU's copy engine), from DirectAccess::BeginDirect until EndDirect.
struct DirectRange {
  char* address = nullptr;
  uint64_t bytes = 0;
  int32_t handle = 0;
  Direction direction = Direction::kFromPool;
  // The memory arena's mapping the bytes lie in (for PageLocks).
  char* region_base = nullptr;
  uint64_t region_bytes = 0;
};

// A memory arena's mapping, for a DMA engine to page-lock once.
struct MemoryRegion {
  char* base = nullptr;
  uint64_t bytes = 0;
};

class DirectAccess {
 public:
  DirectAccess(ObjectTable& table, UpdateService& updates)
      : table_(table), updates_(updates) {}
  DirectAccess(const DirectAccess&) = delete;
  DirectAccess& operator=(const DirectAccess&) = delete;

  // The address of bytes [offset, offset + bytes) of an object, for a copy
  // made by another engine (cudaMemcpyAsync). The object stays pinned, as
  // during a transfer (Free and Compact wait), until EndDirect, which also
  // counts the bytes as read or written. Refused (kInvalidArgument) where
  // the bytes must go through the copy engine: an nvme object, or a tier
  // behind a link model (an emulated or capped link).
  StatusOr<DirectRange> BeginDirect(int32_t handle, uint64_t bytes,
                                    uint64_t offset, Direction direction);
  void EndDirect(const DirectRange& range);
  // Page-locking for a DMA engine outside the pool (see page_locks.h): the
  // engine installs its locker and locks what its direct transfers touch;
  // freed pages in a locked chunk are never given back to the system, and
  // Close() unlocks every chunk before it unmaps the arenas (or, while a
  // direct range is still lent past its timeout, the last EndDirect does).
  PageLocks& page_locks() { return table_.page_locks_; }
  // Every memory arena's mapping (what BeginDirect addresses lie in).
  std::vector<MemoryRegion> MemoryRegions();
  // Runs `fn` in Close(), after the transfers in flight and before the
  // arenas are unmapped (to unregister them from a DMA engine).
  void OnClose(std::function<void()> fn);

 private:
  friend class Pool;

  ObjectTable& table_;
  UpdateService& updates_;
  std::vector<std::function<void()>> on_close_;  // under the table's mutex
};

}  // namespace jcxl

#endif  // JCXL_FFI_DIRECT_ACCESS_H_
