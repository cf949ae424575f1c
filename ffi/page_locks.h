// Page-locking (registration with a DMA engine, such as cudaHostRegister) of
// a pool's memory arenas: lazily, in bounded chunks, only where a direct
// transfer needs it.
//
// Why chunks: an arena is a MAP_NORESERVE mapping of the tier's whole
// capacity; locking all of it would commit that capacity, stall the first
// transfer for seconds and fail outright on large mappings. A chunk is
// locked the first time a direct transfer touches it; a chunk that failed
// to lock is remembered and never tried again: its transfers go through the
// staged path instead (counted in stats()).
//
// The page-release rule: the pool gives a freed range's pages back to the
// system (madvise(MADV_DONTNEED)), after which the CPU sees fresh zero pages
// while a DMA engine still targets the locked ones. ReleaseUnlocked() hands
// out only the parts of a range outside every locked chunk, under the same
// lock that Ensure() takes, so a chunk is never locked while its pages are
// being released.
#ifndef JCXL_FFI_PAGE_LOCKS_H_
#define JCXL_FFI_PAGE_LOCKS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "status.h"

namespace jcxl {

// What locks pages for a DMA engine (the CUDA handlers install one; tests
// install one that records its calls and fails on demand).
class PageLocker {
 public:
  virtual ~PageLocker() = default;
  // true: this call locked the range, and Unlock will be called for it.
  // false: someone else had locked all of it (another library): usable for
  // DMA, but theirs to unlock, never jcxl's.
  virtual StatusOr<bool> Lock(char* address, uint64_t bytes) = 0;
  virtual void Unlock(char* address, uint64_t bytes) = 0;
};

struct PageLockStats {
  uint64_t locked_bytes = 0;
  uint64_t locked_chunks = 0;
  uint64_t borrowed_chunks = 0;  // locked by someone else: never unlocked
  uint64_t failed_chunks = 0;    // remembered: never tried again
  uint64_t refused_ranges = 0;   // Ensure calls that touched a failed chunk
  uint64_t skipped_release_bytes = 0;  // kept: they lie in locked chunks
  std::string last_error;
};

// A piece of a direct transfer that lies in one locked chunk.
struct LockedPiece {
  char* address = nullptr;
  uint64_t bytes = 0;
};

class PageLocks {
 public:
  static constexpr uint64_t kDefaultChunkBytes = 256ull << 20;

  PageLocks() = default;
  ~PageLocks();  // unlocks what is still locked
  PageLocks(const PageLocks&) = delete;
  PageLocks& operator=(const PageLocks&) = delete;

  // Installs the locker and its chunk size (a positive multiple of 4 KiB)
  // once; later calls keep the first. Returns whether this call installed.
  bool Install(std::shared_ptr<PageLocker> locker, uint64_t chunk_bytes);
  bool installed();

  // Locks the chunks of the region [region_base, region_base +
  // region_bytes) that [address, address + bytes) touches and that are not
  // locked yet. Ok: the whole range is locked. Otherwise the error of the
  // chunk that failed (now, or before: a failed chunk is not retried), and
  // the caller uses the staged path.
  Status Ensure(char* region_base, uint64_t region_bytes, char* address,
                uint64_t bytes);

  // [address, address + bytes) cut at chunk boundaries: one DMA per
  // registration (a copy must not span two of them).
  std::vector<LockedPiece> Pieces(char* region_base, char* address,
                                  uint64_t bytes);

  // Calls release(address, bytes) for each part of [begin, begin + bytes)
  // outside every locked chunk (all of it when nothing is installed).
  void ReleaseUnlocked(char* begin, uint64_t bytes,
                       const std::function<void(char*, uint64_t)>& release);

  // Unlocks every chunk this locked (the pool's Close, or its last
  // EndDirect after Close, before the arenas are unmapped) and forgets the
  // borrowed ones.
  void UnlockAll();

  PageLockStats stats();

 private:
  struct Chunk {
    uint64_t bytes = 0;
    bool locked = false;  // else failed
    bool owned = false;   // locked by this (else borrowed): unlock it
  };
  std::mutex mu_;
  std::shared_ptr<PageLocker> locker_;
  uint64_t chunk_bytes_ = kDefaultChunkBytes;
  std::map<char*, Chunk> chunks_;  // by chunk start address
  PageLockStats stats_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_PAGE_LOCKS_H_
