#include "arena.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

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
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = open(path.c_str(), flags | O_DIRECT, 0600);
  bool direct = true;
  if (fd < 0 && errno == EINVAL) {  // e.g. tmpfs: no O_DIRECT
    fd = open(path.c_str(), flags, 0600);
    direct = false;
  }
  if (fd < 0) return ErrnoStatus("cannot create nvme file " + path, errno);
  return std::unique_ptr<FileArena>(
      new FileArena(fd, path, direct, keep_file));
}

FileArena::~FileArena() {
  close(fd_);
  if (!keep_) unlink(path_.c_str());
}

Status FileArena::ReadBlocks(uint64_t offset, char* dst, uint64_t bytes) {
  uint64_t done = 0;
  while (done < bytes) {
    ssize_t n = pread(fd_, dst + done, bytes - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("nvme read of " + path_ + " failed", errno);
    }
    if (n == 0) {  // past the end of the file: never written, reads as zeros
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
      return ErrnoStatus("nvme write to " + path_ + " failed", errno);
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status FileArena::Read(uint64_t offset, void* dst, uint64_t bytes,
                       void* bounce) {
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
  constexpr uint64_t kStep = 8ull << 20;
  void* raw = nullptr;
  if (posix_memalign(&raw, kBlockBytes, kStep + Arena::BounceBytes(kStep)) !=
      0) {
    return Status(Code::kExhausted, "no memory for a compaction buffer");
  }
  std::unique_ptr<void, decltype(&free)> buffer(raw, &free);
  char* scratch = static_cast<char*>(raw);
  char* bounce = scratch + kStep;
  for (uint64_t done = 0; done < bytes; done += kStep) {
    const uint64_t n = std::min(kStep, bytes - done);
    // Forward order is safe: `to` < `from`, so no unread byte is overwritten.
    JCXL_RETURN_IF_ERROR(Read(from + done, scratch, n, bounce));
    JCXL_RETURN_IF_ERROR(Write(to + done, scratch, n, bounce));
  }
  return Status::Ok();
}

void FileArena::Release(uint64_t offset, uint64_t bytes) {
  const uint64_t begin = AlignUp(offset);
  const uint64_t end = AlignDown(offset + bytes);
  if (end <= begin) return;
  struct stat st;
  if (fstat(fd_, &st) == 0 && end >= static_cast<uint64_t>(st.st_size)) {
    if (ftruncate(fd_, static_cast<off_t>(begin)) == 0) return;
  }
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            static_cast<off_t>(begin), static_cast<off_t>(end - begin));
}

std::string FileArena::Describe() const {
  return "file " + path_ + (direct_io_ ? " (O_DIRECT)" : " (buffered)");
}

}  // namespace jcxl
