#include "arena.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "allocator.h"
#include "fast_copy.h"
#include "numa.h"

namespace jcxl {
namespace {

Status ErrnoStatus(const std::string& what, int error) {
  Code code = Code::kIo;
  return Status(code, what + ": " + std::strerror(error));
}

uint64_t AlignDown(uint64_t value) { return value / kBlockBytes * kBlockBytes; }
uint64_t AlignUp(uint64_t value) {
  return (value + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
}

}  // namespace

// ------------------------------------------------------------------ memory

StatusOr<std::unique_ptr<MemoryArena>> MemoryArena::Create(
    uint64_t capacity, const std::vector<int>& nodes) {
  const uint64_t size =
      (capacity + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  // Over-reserve by one huge page and trim, so the base is 2 MiB aligned.
  const uint64_t mapped = size + kHugePageBytes;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    return Status(Code::kExhausted, "cannot reserve " + FormatBytes(size) +
                                        " of address space: " +
                                        std::strerror(errno));
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned =
      (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + mapped;
  if (end > aligned + size) {
    munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
  }
  char* base = reinterpret_cast<char*>(aligned);
  madvise(base, size, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  std::unique_ptr<MemoryArena> arena(new MemoryArena(base, size));
  arena->nodes_ = nodes;
  Status bound = numa::Bind(base, size, nodes);
  if (!bound.ok()) arena->bind_error_ = bound.message();
  return arena;
}

MemoryArena::~MemoryArena() { munmap(base_, size_); }

Status MemoryArena::Read(uint64_t offset, void* dst, uint64_t bytes, void*) {
  CopyLarge(dst, base_ + offset, bytes);
  return Status::Ok();
}

Status MemoryArena::Write(uint64_t offset, const void* src, uint64_t bytes,
                          void*) {
  CopyLarge(base_ + offset, src, bytes);
  return Status::Ok();
}

Status MemoryArena::Move(uint64_t from, uint64_t to, uint64_t bytes) {
  std::memmove(base_ + to, base_ + from, bytes);
  return Status::Ok();
}

void MemoryArena::Release(uint64_t offset, uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t begin = (offset + page - 1) / page * page;
  const uint64_t end = (offset + bytes) / page * page;
  if (end > begin) madvise(base_ + begin, end - begin, MADV_DONTNEED);
}

std::string MemoryArena::Describe() const {
  std::string nodes;
  for (int node : nodes_) {
    nodes += (nodes.empty() ? "" : ",") + std::to_string(node);
  }
  return "memory, " + FormatBytes(size_) + ", nodes [" + nodes + "]" +
         (bind_error_.empty() ? "" : " (binding failed: " + bind_error_ + ")");
}

// -------------------------------------------------------------------- file

StatusOr<std::unique_ptr<FileArena>> FileArena::Create(const std::string& path,
                                                       bool keep_file) {
  // The directory is opened once, never through a symbolic link, and the
  // file is made and later removed relative to it: a directory swapped for
  // a link meanwhile (by someone who can write its parent) is never
  // followed, neither here nor at removal.
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name =
      slash == std::string::npos ? path : path.substr(slash + 1);
  const int dir_fd =
      open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir_fd < 0) {
    return ErrnoStatus("cannot open the directory of nvme file " + path +
                           " (a symbolic link is refused)",
                       errno);
  }
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
  int fd = openat(dir_fd, name.c_str(), flags | O_DIRECT, 0600);
  bool direct = true;
  if (fd < 0 && errno == EINVAL) {  // e.g. tmpfs: no O_DIRECT
    fd = openat(dir_fd, name.c_str(), flags, 0600);
    direct = false;
  }
  if (fd < 0) {
    const int error = errno;
    close(dir_fd);
    return ErrnoStatus("cannot create nvme file " + path, error);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    unlinkat(dir_fd, name.c_str(), 0);
    close(dir_fd);
    return ErrnoStatus("cannot stat nvme file " + path, error);
  }
  std::unique_ptr<FileArena> arena(
      new FileArena(fd, dir_fd, name, path, direct, keep_file));
  arena->dev_ = st.st_dev;
  arena->ino_ = st.st_ino;
  return arena;
}

FileArena::~FileArena() {
  close(fd_);
  // Only the file this arena made: if it was removed or replaced meanwhile
  // (or a link put in its place), whatever is at the path now is not ours.
  struct stat st;
  if (!keep_ &&
      fstatat(dir_fd_, name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      st.st_dev == dev_ && st.st_ino == ino_) {
    unlinkat(dir_fd_, name_.c_str(), 0);
  }
  close(dir_fd_);
}

void FileArena::CheckSize() {
  std::lock_guard<std::mutex> lock(size_mu_);
  CheckSizeLocked();
}

void FileArena::CheckSizeLocked() {
  struct stat st;
  if (fstat(fd_, &st) != 0) return;  // the reads and writes will say why
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size >= written_end_) return;
  AddLostLocked(size, written_end_,
                "was cut to " + FormatBytes(size) +
                    " behind the pool's back (the pool had written " +
                    FormatBytes(written_end_) + ")");
  written_end_ = size;
}

void FileArena::AddLostLocked(uint64_t begin, uint64_t end,
                              const std::string& note) {
  if (end <= begin) return;
  // Merge with the lost ranges it touches.
  auto it = lost_.upper_bound(begin);
  if (it != lost_.begin() && std::prev(it)->second >= begin) --it;
  while (it != lost_.end() && it->first <= end) {
    begin = std::min(begin, it->first);
    end = std::max(end, it->second);
    it = lost_.erase(it);
  }
  lost_.emplace(begin, end);
  lost_note_ = note;
}

void FileArena::ForgetLost(uint64_t begin, uint64_t end) {
  if (lost_.empty() || end <= begin) return;
  auto it = lost_.upper_bound(begin);
  if (it != lost_.begin() && std::prev(it)->second > begin) --it;
  while (it != lost_.end() && it->first < end) {
    const uint64_t lo = it->first;
    const uint64_t hi = it->second;
    it = lost_.erase(it);
    if (lo < begin) lost_.emplace(lo, begin);
    if (hi > end) {
      lost_.emplace(end, hi);
      break;
    }
  }
}

Status FileArena::CheckNotLost(uint64_t offset, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(size_mu_);
  if (lost_.empty()) return Status::Ok();
  const uint64_t end = offset + bytes;
  auto it = lost_.upper_bound(offset);
  if (it != lost_.begin() && std::prev(it)->second > offset) --it;
  if (it == lost_.end() || it->first >= end) return Status::Ok();
  const uint64_t lo = std::max(offset, it->first);
  const uint64_t hi = std::min(end, it->second);
  return Status(Code::kIo, "nvme file " + path_ + " " + lost_note_ +
                               ": bytes [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + ") of this read are lost");
}

uint64_t FileArena::lost_bytes() const {
  std::lock_guard<std::mutex> lock(size_mu_);
  uint64_t total = 0;
  for (const auto& [begin, end] : lost_) total += end - begin;
  return total;
}

Status FileArena::ReadBlocks(uint64_t offset, char* dst, uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    ssize_t n = pread(fd_, dst + done, bytes - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("nvme read of " + path_ + " failed", errno);
    }
    if (n == 0) {  // past the end of the file
      uint64_t written_end;
      {
        std::lock_guard<std::mutex> lock(size_mu_);
        written_end = written_end_;
      }
      if (offset + done < written_end) {  // shrunk since CheckSize()
        CheckSize();
        return Status(Code::kIo,
                      "nvme file " + path_ + " ends at byte " +
                          std::to_string(offset + done) + ", before the " +
                          std::to_string(written_end) +
                          " bytes the pool wrote: it was truncated behind "
                          "the pool's back");
      }
      // Never written: reads as zeros.
      std::memset(dst + done, 0, bytes - done);
      break;
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status FileArena::WriteBlocks(uint64_t offset, const char* src,
                              uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    ssize_t n = pwrite(fd_, src + done, bytes - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      // ENOSPC (file system full), EFBIG (file size limit), EIO, ...
      return ErrnoStatus("nvme write of " + FormatBytes(bytes) + " at byte " +
                             std::to_string(offset + done) + " of " + path_ +
                             " failed",
                         errno);
    }
    done += static_cast<uint64_t>(n);
  }
  std::lock_guard<std::mutex> lock(size_mu_);
  written_end_ = std::max(written_end_, offset + bytes);
  return Status::Ok();
}

Status FileArena::Read(uint64_t offset, void* dst, uint64_t bytes,
                       void* bounce) {
  CheckSize();
  JCXL_RETURN_IF_ERROR(CheckNotLost(offset, bytes));
  const uint64_t begin = AlignDown(offset);
  const uint64_t end = AlignUp(offset + bytes);
  const bool aligned = begin == offset && end == offset + bytes &&
                       reinterpret_cast<uintptr_t>(dst) % kBlockBytes == 0;
  if (aligned) return ReadBlocks(offset, static_cast<char*>(dst), bytes);
  char* staging = static_cast<char*>(bounce);
  JCXL_RETURN_IF_ERROR(ReadBlocks(begin, staging, end - begin));
  std::memcpy(dst, staging + (offset - begin), bytes);
  return Status::Ok();
}

Status FileArena::Write(uint64_t offset, const void* src, uint64_t bytes,
                        void* bounce) {
  CheckSize();  // before this write may grow the file past a cut
  Status written = WriteRange(offset, src, bytes, bounce);
  if (written.ok()) {
    std::lock_guard<std::mutex> lock(size_mu_);
    ForgetLost(offset, offset + bytes);  // these bytes are whole again
  }
  return written;
}

Status FileArena::WriteRange(uint64_t offset, const void* src, uint64_t bytes,
                             void* bounce) {
  const uint64_t begin = AlignDown(offset);
  const uint64_t end = AlignUp(offset + bytes);
  const bool edges = begin != offset || end != offset + bytes;
  if (!edges && reinterpret_cast<uintptr_t>(src) % kBlockBytes == 0) {
    return WriteBlocks(offset, static_cast<const char*>(src), bytes);
  }
  char* staging = static_cast<char*>(bounce);
  std::unique_lock<std::mutex> lock(edge_mu_, std::defer_lock);
  if (edges) {
    lock.lock();
    // Keep the bytes of the first and last block that this write does not
    // cover (they belong to a neighbouring slice of the same object).
    JCXL_RETURN_IF_ERROR(ReadBlocks(begin, staging, kBlockBytes));
    if (end - kBlockBytes > begin) {
      JCXL_RETURN_IF_ERROR(ReadBlocks(end - kBlockBytes,
                                      staging + (end - kBlockBytes - begin),
                                      kBlockBytes));
    }
  }
  std::memcpy(staging + (offset - begin), src, bytes);
  return WriteBlocks(begin, staging, end - begin);
}

Status FileArena::Move(uint64_t from, uint64_t to, uint64_t bytes) {
  // Steps of up to 8 MiB, through a buffer no larger than the move needs
  // (compaction moves many small extents).
  const uint64_t step = std::min<uint64_t>(8ull << 20, AlignUp(bytes));
  void* raw = nullptr;
  if (posix_memalign(&raw, kBlockBytes, step + Arena::BounceBytes(step)) !=
      0) {
    return Status(Code::kExhausted, "no memory for a compaction buffer");
  }
  std::unique_ptr<void, decltype(&free)> buffer(raw, &free);
  char* scratch = static_cast<char*>(raw);
  char* bounce = scratch + step;
  for (uint64_t done = 0; done < bytes; done += step) {
    const uint64_t n = std::min(step, bytes - done);
    // Forward order is safe: `to` < `from`, so no unread byte is overwritten.
    Status moved = Read(from + done, scratch, n, bounce);
    if (moved.ok()) moved = Write(to + done, scratch, n, bounce);
    if (!moved.ok()) {
      // The extent now lives at `to`: what could not be moved there is lost.
      std::lock_guard<std::mutex> lock(size_mu_);
      AddLostLocked(to + done, to + bytes,
                    "lost bytes in compaction (" + moved.message() + ")");
      return moved;
    }
  }
  return Status::Ok();
}

void FileArena::Release(uint64_t offset, uint64_t bytes) {
  const uint64_t begin = AlignUp(offset);
  const uint64_t end = AlignDown(offset + bytes);
  std::lock_guard<std::mutex> lock(size_mu_);
  // A file cut short must be noticed before ftruncate may grow it back.
  CheckSizeLocked();
  ForgetLost(offset, offset + bytes);  // nothing there matters any more
  if (end <= begin) return;
  struct stat st;
  if (fstat(fd_, &st) == 0 && end >= static_cast<uint64_t>(st.st_size)) {
    if (ftruncate(fd_, static_cast<off_t>(begin)) == 0) {
      written_end_ = std::min(written_end_, begin);
      return;
    }
  }
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            static_cast<off_t>(begin), static_cast<off_t>(end - begin));
}

std::string FileArena::Describe() const {
  std::string out =
      "file " + path_ + (direct_io_ ? " (O_DIRECT)" : " (buffered)");
  const uint64_t lost = lost_bytes();
  std::lock_guard<std::mutex> lock(size_mu_);
  if (lost > 0) out += ", " + FormatBytes(lost) + " lost: it " + lost_note_;
  return out;
}

}  // namespace jcxl
