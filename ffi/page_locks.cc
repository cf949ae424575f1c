#include "page_locks.h"

#include <algorithm>
#include <utility>

namespace jcxl {

PageLocks::~PageLocks() { UnlockAll(); }

bool PageLocks::Install(std::shared_ptr<PageLocker> locker,
                        uint64_t chunk_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (locker_ || !locker || chunk_bytes == 0 || chunk_bytes % 4096) {
    return false;
  }
  locker_ = std::move(locker);
  chunk_bytes_ = chunk_bytes;
  return true;
}

bool PageLocks::installed() {
  std::lock_guard<std::mutex> lock(mu_);
  return locker_ != nullptr;
}

Status PageLocks::Ensure(char* region_base, uint64_t region_bytes,
                         char* address, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!locker_) {
    return Status(Code::kInvalidArgument, "no page locker installed");
  }
  char* const region_end = region_base + region_bytes;
  if (address < region_base || address > region_end ||
      bytes > static_cast<uint64_t>(region_end - address)) {
    return Status(Code::kInvalidArgument,
                  "range of " + std::to_string(bytes) +
                      " bytes lies outside its memory region");
  }
  if (bytes == 0) return Status::Ok();
  const uint64_t first = (address - region_base) / chunk_bytes_;
  const uint64_t last = (address + bytes - 1 - region_base) / chunk_bytes_;
  for (uint64_t k = first; k <= last; ++k) {
    char* start = region_base + k * chunk_bytes_;
    auto it = chunks_.find(start);
    if (it != chunks_.end()) {
      if (it->second.locked) continue;
      ++stats_.refused_ranges;
      return Status(Code::kInternal, "page-locking failed before: " +
                                         stats_.last_error);
    }
    Chunk chunk;
    chunk.bytes = std::min<uint64_t>(chunk_bytes_, region_end - start);
    StatusOr<bool> locked = locker_->Lock(start, chunk.bytes);
    chunk.locked = locked.ok();
    chunk.owned = locked.ok() && *locked;
    chunks_.emplace(start, chunk);
    if (!locked.ok()) {
      ++stats_.failed_chunks;
      ++stats_.refused_ranges;
      stats_.last_error = locked.status().message();
      return locked.status();
    }
    if (!chunk.owned) ++stats_.borrowed_chunks;
    ++stats_.locked_chunks;
    stats_.locked_bytes += chunk.bytes;
  }
  return Status::Ok();
}

std::vector<LockedPiece> PageLocks::Pieces(char* region_base, char* address,
                                           uint64_t bytes) {
  uint64_t chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    chunk = chunk_bytes_;
  }
  std::vector<LockedPiece> pieces;
  uint64_t done = 0;
  while (done < bytes) {
    char* at = address + done;
    const uint64_t into = (at - region_base) % chunk;
    const uint64_t n = std::min(bytes - done, chunk - into);
    pieces.push_back({at, n});
    done += n;
  }
  return pieces;
}

void PageLocks::ReleaseUnlocked(
    char* begin, uint64_t bytes,
    const std::function<void(char*, uint64_t)>& release) {
  std::lock_guard<std::mutex> lock(mu_);
  char* const end = begin + bytes;
  char* at = begin;
  // The first chunk that may overlap: the last one starting at or before
  // `begin`, then every one starting before `end`.
  auto it = chunks_.upper_bound(begin);
  if (it != chunks_.begin()) --it;
  for (; it != chunks_.end() && it->first < end; ++it) {
    char* chunk_end = it->first + it->second.bytes;
    if (!it->second.locked || chunk_end <= at) continue;
    char* lock_begin = std::max(it->first, at);
    if (lock_begin > at) release(at, lock_begin - at);
    char* lock_end = std::min(chunk_end, end);
    stats_.skipped_release_bytes += lock_end - lock_begin;
    at = lock_end;
  }
  if (at < end) release(at, end - at);
}

void PageLocks::UnlockAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [start, chunk] : chunks_) {
    if (chunk.owned) locker_->Unlock(start, chunk.bytes);
  }
  chunks_.clear();
  stats_.locked_bytes = 0;
  stats_.locked_chunks = 0;
  stats_.borrowed_chunks = 0;
}

PageLockStats PageLocks::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace jcxl
