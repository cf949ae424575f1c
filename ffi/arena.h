// The storage behind one tier on one NUMA node: a range of memory (host and
// cxl tiers) or a file (nvme tier). The allocator hands out offsets; the
// arena moves bytes at those offsets.
#ifndef JCXL_FFI_ARENA_H_
#define JCXL_FFI_ARENA_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "status.h"

namespace jcxl {

// Alignment of O_DIRECT transfers and of the bounce buffers that serve them.
constexpr uint64_t kBlockBytes = 4096;
// The arena's base alignment: transparent huge pages back every aligned 2 MiB.
constexpr uint64_t kHugePageBytes = 2ull << 20;

class Arena {
 public:
  virtual ~Arena() = default;
  // Copies arena bytes [offset, offset + bytes) to `dst`. `bounce` is a
  // caller-owned buffer aligned to kBlockBytes of at least
  // BounceBytes(bytes) bytes (used by file arenas only).
  virtual Status Read(uint64_t offset, void* dst, uint64_t bytes,
                      void* bounce) = 0;
  virtual Status Write(uint64_t offset, const void* src, uint64_t bytes,
                       void* bounce) = 0;
  // Moves bytes within the arena (compaction: `to` < `from`).
  virtual Status Move(uint64_t from, uint64_t to, uint64_t bytes) = 0;
  // Gives the backing of [offset, offset + bytes) back to the system.
  virtual void Release(uint64_t offset, uint64_t bytes) = 0;
  // Memory arenas: the address of offset 0; file arenas: nullptr.
  virtual char* base() const { return nullptr; }
  // Bytes mapped at base() (0 for an arena that is not in memory).
  virtual uint64_t mapped_bytes() const { return 0; }
  virtual std::string Describe() const = 0;
  static uint64_t BounceBytes(uint64_t chunk_bytes) {
    return chunk_bytes + 2 * kBlockBytes;
  }
};

// Anonymous memory reserved without commitment (pages are backed on first
// touch), 2 MiB aligned and advised for huge pages, bound to NUMA `nodes`.
class MemoryArena : public Arena {
 public:
  static StatusOr<std::unique_ptr<MemoryArena>> Create(
      uint64_t capacity, const std::vector<int>& nodes);
  ~MemoryArena() override;

  Status Read(uint64_t offset, void* dst, uint64_t bytes,
              void* bounce) override;
  Status Write(uint64_t offset, const void* src, uint64_t bytes,
               void* bounce) override;
  Status Move(uint64_t from, uint64_t to, uint64_t bytes) override;
  void Release(uint64_t offset, uint64_t bytes) override;
  char* base() const override { return base_; }
  uint64_t mapped_bytes() const override { return size_; }
  std::string Describe() const override;
  // Empty when binding worked, else why it did not (still usable).
  const std::string& bind_error() const { return bind_error_; }

 private:
  MemoryArena(char* base, uint64_t size) : base_(base), size_(size) {}
  char* base_;
  uint64_t size_;
  std::vector<int> nodes_;
  std::string bind_error_;
};

// A file in the pool's private directory, read and written with O_DIRECT
// where the file system allows it, with pread/pwrite only (never mapped: a
// file cut short behind the pool's back must give an error, not SIGBUS).
//
// The arena remembers how far it has written the file. Should the file
// shrink below that (truncated by someone else), the bytes cut off are
// recorded as lost: reads that touch them fail with kIo naming the file,
// until new writes replace them; the rest of the file stays readable.
class FileArena : public Arena {
 public:
  static StatusOr<std::unique_ptr<FileArena>> Create(const std::string& path,
                                                     bool keep_file);
  ~FileArena() override;

  Status Read(uint64_t offset, void* dst, uint64_t bytes,
              void* bounce) override;
  Status Write(uint64_t offset, const void* src, uint64_t bytes,
               void* bounce) override;
  Status Move(uint64_t from, uint64_t to, uint64_t bytes) override;
  void Release(uint64_t offset, uint64_t bytes) override;
  std::string Describe() const override;
  bool direct_io() const { return direct_io_; }
  const std::string& path() const { return path_; }
  // Bytes recorded as lost to a truncation and not written again since.
  uint64_t lost_bytes() const;

 private:
  FileArena(int fd, int dir_fd, std::string name, std::string path,
            bool direct, bool keep)
      : fd_(fd),
        dir_fd_(dir_fd),
        name_(std::move(name)),
        path_(std::move(path)),
        direct_io_(direct),
        keep_(keep) {}
  Status ReadBlocks(uint64_t offset, char* dst, uint64_t bytes);
  Status WriteBlocks(uint64_t offset, const char* src, uint64_t bytes);
  Status WriteRange(uint64_t offset, const void* src, uint64_t bytes,
                    void* bounce);
  // Compares the file's size with what was written; records a loss.
  void CheckSize();
  // kIo if [offset, offset + bytes) holds lost bytes.
  Status CheckNotLost(uint64_t offset, uint64_t bytes);
  // The *Locked helpers and ForgetLost run with size_mu_ held.
  void CheckSizeLocked();
  void AddLostLocked(uint64_t begin, uint64_t end, const std::string& note);
  // [begin, end) is no longer lost (written again, or freed).
  void ForgetLost(uint64_t begin, uint64_t end);

  int fd_;
  int dir_fd_;        // the file's directory, opened without following links
  std::string name_;  // the file's name in it
  std::string path_;
  bool direct_io_;
  bool keep_;
  dev_t dev_ = 0;  // the file's identity: only this file is ever removed
  ino_t ino_ = 0;
  mutable std::mutex size_mu_;  // guards written_end_, lost_, lost_note_
  uint64_t written_end_ = 0;  // the file is at least this long
  std::map<uint64_t, uint64_t> lost_;  // begin -> end, disjoint ranges
  std::string lost_note_;  // what shrank the file, for messages
  // Writes whose ends fall inside a block read-modify-write that block;
  // this lock keeps two such writes from interleaving.
  std::mutex edge_mu_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_ARENA_H_
