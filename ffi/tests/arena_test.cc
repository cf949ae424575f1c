// Tests of the memory and file arenas: byte-exact round trips at aligned and
// unaligned offsets, moves, release, the file arena's edge read-modify-write
// under concurrent writers, and the file's lifetime.
#include "arena.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "test_util.h"
#include "fast_copy.h"
#include "numa.h"

namespace jcxl {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// A kBlockBytes-aligned heap buffer, as the copy engine hands arenas.
struct Buffer {
  explicit Buffer(uint64_t bytes)
      : data(static_cast<char*>(
            aligned_alloc(kBlockBytes, (bytes + kBlockBytes - 1) /
                                           kBlockBytes * kBlockBytes))) {}
  ~Buffer() { free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data;
};

// Where file arenas are tested: the build tree, /tmp (which may be tmpfs
// elsewhere), and /dev/shm (tmpfs: the buffered fallback).
std::vector<std::string> FileArenaParents() {
  std::vector<std::string> parents = {BuildDir()};
  for (const char* extra : {"/tmp", "/dev/shm"}) {
    if (access(extra, W_OK) == 0) parents.push_back(extra);
  }
  return parents;
}

std::unique_ptr<FileArena> NewFileArena(const std::string& path,
                                        bool keep = false) {
  StatusOr<std::unique_ptr<FileArena>> arena = FileArena::Create(path, keep);
  CHECK_OK(arena);
  return std::move(*arena);
}

TEST(MemoryArenaRoundTrips) {
  StatusOr<std::unique_ptr<MemoryArena>> created = MemoryArena::Create(
      6 * kMiB + 123, {});
  CHECK_OK(created);
  MemoryArena& arena = **created;
  CHECK_EQ(reinterpret_cast<uintptr_t>(arena.base()) % kHugePageBytes, 0u);
  CHECK(arena.bind_error().empty());
  CHECK_CONTAINS(arena.Describe(), "8.00 MiB");  // rounded up to huge pages
  // Untouched memory reads as zeros.
  std::vector<char> zeros(4096, 0), got(4096, 1);
  CHECK_OK(arena.Read(5 * kMiB, got.data(), got.size(), nullptr));
  CHECK(got == zeros);
  for (uint64_t offset : {uint64_t{0}, uint64_t{1}, uint64_t{4095},
                          uint64_t{12345}, 6 * kMiB + 100}) {
    const std::vector<char> data = Pattern(7777, offset);
    CHECK_OK(arena.Write(offset, data.data(), data.size(), nullptr));
    std::vector<char> back(data.size());
    CHECK_OK(arena.Read(offset, back.data(), back.size(), nullptr));
    CHECK(back == data);
  }
  // Compaction moves overlap: `to` below `from` by less than the length.
  const std::vector<char> data = Pattern(300000, 9);
  CHECK_OK(arena.Write(1 * kMiB + 5000, data.data(), data.size(), nullptr));
  CHECK_OK(arena.Move(1 * kMiB + 5000, 1 * kMiB + 1000, data.size()));
  std::vector<char> back(data.size());
  CHECK_OK(arena.Read(1 * kMiB + 1000, back.data(), back.size(), nullptr));
  CHECK(back == data);
  // Release drops whole pages inside the range and keeps the partial ones.
  CHECK_OK(arena.Write(0, data.data(), 3 * 4096, nullptr));
  arena.Release(100, 2 * 4096);  // only page 1 lies inside entirely
  CHECK_OK(arena.Read(0, back.data(), 3 * 4096, nullptr));
  CHECK(std::memcmp(back.data(), data.data(), 4096) == 0);
  CHECK(std::memcmp(back.data() + 4096, zeros.data(), 4096) == 0);
  CHECK(std::memcmp(back.data() + 8192, data.data() + 8192, 4096) == 0);
}

TEST(MemoryArenaBoundToNodeZero) {
  // This machine has one NUMA node: binding to node 0 is real, and touched
  // pages land there.
  StatusOr<std::unique_ptr<MemoryArena>> created =
      MemoryArena::Create(4 * kMiB, {0});
  CHECK_OK(created);
  MemoryArena& arena = **created;
  CHECK_EQ(arena.bind_error(), std::string());
  CHECK_CONTAINS(arena.Describe(), "nodes [0]");
  const std::vector<char> data = Pattern(3 * 4096, 1);
  CHECK_OK(arena.Write(4096, data.data(), data.size(), nullptr));
  StatusOr<std::vector<int>> nodes = numa::PageNodes(arena.base(), 5 * 4096);
  CHECK_OK(nodes);
  CHECK_EQ(nodes->size(), 5u);
  // With huge pages the untouched neighbours may be backed too.
  for (int i = 1; i <= 3; ++i) CHECK_EQ((*nodes)[i], 0);
  // A node that cannot exist: the arena still works, and says why it is
  // not bound.
  StatusOr<std::unique_ptr<MemoryArena>> bad =
      MemoryArena::Create(4 * kMiB, {5000});
  CHECK_OK(bad);
  CHECK_CONTAINS((*bad)->bind_error(), "out of range");
  CHECK_CONTAINS((*bad)->Describe(), "binding failed");
}

// Random reads and writes, aligned and not, at offsets and through buffers
// that are aligned or not, checked against a byte image of the file.
void FileRoundTrips(const std::string& parent) {
  TempDir dir(parent);
  CHECK(dir.ok());
  std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
  std::fprintf(stderr, "  %s\n", arena->Describe().c_str());
  constexpr uint64_t kSize = 2 * kMiB;
  std::vector<char> image(kSize, 0);
  constexpr uint64_t kMaxIo = 70000;
  Buffer io(kMaxIo + kBlockBytes);
  Buffer bounce(Arena::BounceBytes(kMaxIo));
  std::mt19937_64 rng(parent.size());
  for (int i = 0; i < 200; ++i) {
    const bool aligned = rng() % 3 == 0;
    uint64_t offset = rng() % (kSize - kMaxIo);
    uint64_t bytes = 1 + rng() % kMaxIo;
    uint64_t shift = rng() % 2 ? rng() % 64 : 0;  // buffer misalignment
    if (aligned) {
      offset = offset / kBlockBytes * kBlockBytes;
      bytes = (bytes + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
      bytes = std::min<uint64_t>(bytes, kMaxIo / kBlockBytes * kBlockBytes);
      shift = 0;
    }
    char* buffer = io.data + shift;
    if (rng() % 2) {
      std::memcpy(buffer, Pattern(bytes, rng()).data(), bytes);
      CHECK_OK(arena->Write(offset, buffer, bytes, bounce.data));
      std::memcpy(&image[offset], buffer, bytes);
    } else {
      CHECK_OK(arena->Read(offset, buffer, bytes, bounce.data));
      CHECK(std::memcmp(buffer, &image[offset], bytes) == 0);
    }
  }
  // Everything, in one aligned read.
  Buffer all(kSize);
  CHECK_OK(arena->Read(0, all.data, kSize, bounce.data));
  CHECK(std::memcmp(all.data, image.data(), kSize) == 0);
}

TEST(FileArenaRoundTripsAtArbitraryOffsets) {
  for (const std::string& parent : FileArenaParents()) {
    std::fprintf(stderr, "  in %s\n", parent.c_str());
    FileRoundTrips(parent);
  }
}

TEST(FileArenaUsesDirectIoWhereItCan) {
  TempDir disk(BuildDir());
  CHECK(disk.ok());
  std::unique_ptr<FileArena> on_disk = NewFileArena(disk.path() + "/a");
  CHECK(on_disk->direct_io());  // the build tree is on ext4 here
  CHECK_CONTAINS(on_disk->Describe(), "O_DIRECT");
  // tmpfs takes O_DIRECT since Linux 6.6; before, the arena falls back to
  // buffered I/O. Either way it says which it uses.
  if (access("/dev/shm", W_OK) == 0) {
    TempDir shm("/dev/shm");
    CHECK(shm.ok());
    std::unique_ptr<FileArena> in_memory = NewFileArena(shm.path() + "/a");
    CHECK_CONTAINS(in_memory->Describe(),
                   in_memory->direct_io() ? "O_DIRECT" : "buffered");
  }
}

TEST(FileArenaEdgeWritesKeepNeighbouringBytes) {
  for (const std::string& parent : FileArenaParents()) {
    TempDir dir(parent);
    CHECK(dir.ok());
    std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
    Buffer bounce(Arena::BounceBytes(64 * 1024));
    const std::vector<char> base = Pattern(5 * kBlockBytes, 1);
    CHECK_OK(arena->Write(0, base.data(), base.size(), bounce.data));
    std::vector<char> expected = base;
    // Inside one block; across one boundary; across three blocks with both
    // ends unaligned; an aligned start with an unaligned end.
    struct Slice {
      uint64_t offset, bytes;
    };
    for (Slice slice : {Slice{10, 20}, Slice{4090, 12}, Slice{4097, 12000},
                        Slice{8192, 5}, Slice{20479, 1}}) {
      const std::vector<char> data = Pattern(slice.bytes, slice.offset);
      CHECK_OK(arena->Write(slice.offset, data.data(), data.size(),
                            bounce.data));
      std::memcpy(&expected[slice.offset], data.data(), data.size());
      std::vector<char> back(expected.size());
      CHECK_OK(arena->Read(0, back.data(), back.size(), bounce.data));
      CHECK(back == expected);
    }
  }
}

TEST(FileArenaConcurrentWritesToAdjacentSlices) {
  // Two writers own the two halves of one range; the split falls inside a
  // block, so each write read-modify-writes the block the other also writes.
  for (const std::string& parent : FileArenaParents()) {
    TempDir dir(parent);
    CHECK(dir.ok());
    std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
    constexpr uint64_t kBegin = 1000;
    constexpr uint64_t kSplit = 3 * kBlockBytes + 777;
    constexpr uint64_t kEnd = 7 * kBlockBytes + 5;
    constexpr int kRounds = 60;
    Status errors[2];
    auto writer = [&](int who, uint64_t begin, uint64_t end) {
      Buffer bounce(Arena::BounceBytes(end - begin));
      for (int round = 1; round <= kRounds; ++round) {
        const std::vector<char> data = Pattern(end - begin, who * 1000 + round);
        Status status = arena->Write(begin, data.data(), data.size(),
                                     bounce.data);
        if (!status.ok()) errors[who] = status;
      }
    };
    std::thread first(writer, 0, kBegin, kSplit);
    std::thread second(writer, 1, kSplit, kEnd);
    first.join();
    second.join();
    CHECK_OK(errors[0]);
    CHECK_OK(errors[1]);
    Buffer bounce(Arena::BounceBytes(kEnd));
    std::vector<char> back(kEnd - kBegin);
    CHECK_OK(arena->Read(kBegin, back.data(), back.size(), bounce.data));
    CHECK(std::memcmp(back.data(), Pattern(kSplit - kBegin, kRounds).data(),
                      kSplit - kBegin) == 0);
    CHECK(std::memcmp(back.data() + (kSplit - kBegin),
                      Pattern(kEnd - kSplit, 1000 + kRounds).data(),
                      kEnd - kSplit) == 0);
  }
}

TEST(FileArenaMoveAndRelease) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
  Buffer bounce(Arena::BounceBytes(9 * kMiB));
  // Longer than the move's 8 MiB step, and overlapping its destination.
  const std::vector<char> data = Pattern(9 * kMiB + 4096, 3);
  const uint64_t from = 3 * kBlockBytes;
  const uint64_t to = 1 * kBlockBytes;
  CHECK_OK(arena->Write(from, data.data(), data.size(), bounce.data));
  CHECK_OK(arena->Move(from, to, data.size()));
  std::vector<char> back(data.size());
  CHECK_OK(arena->Read(to, back.data(), back.size(), bounce.data));
  CHECK(back == data);
  // Releasing a middle range punches a hole that reads as zeros; releasing
  // the tail truncates the file.
  const uint64_t end = from + data.size();
  arena->Release(to + 100, 4 * kBlockBytes);  // blocks 2..4 whole
  std::vector<char> head(6 * kBlockBytes);
  CHECK_OK(arena->Read(0, head.data(), head.size(), bounce.data));
  CHECK(std::memcmp(head.data() + to, data.data(), kBlockBytes) == 0);
  for (uint64_t i = 2 * kBlockBytes; i < 5 * kBlockBytes; ++i) {
    CHECK_EQ(static_cast<int>(head[i]), 0);
  }
  CHECK(std::memcmp(head.data() + 5 * kBlockBytes,
                    data.data() + 4 * kBlockBytes, kBlockBytes) == 0);
  struct stat st;
  CHECK_EQ(stat(arena->path().c_str(), &st), 0);
  CHECK_EQ(static_cast<uint64_t>(st.st_size), end);
  arena->Release(8 * kBlockBytes, end - 8 * kBlockBytes);
  CHECK_EQ(stat(arena->path().c_str(), &st), 0);
  CHECK_EQ(static_cast<uint64_t>(st.st_size), 8 * kBlockBytes);
  // Reads past the end of the file see zeros.
  std::vector<char> tail(10000, 1);
  CHECK_OK(arena->Read(8 * kBlockBytes - 10, tail.data(), tail.size(),
                       bounce.data));
  CHECK(std::memcmp(tail.data(), data.data() + 8 * kBlockBytes - 10 - to,
                    10) == 0);
  for (size_t i = 10; i < tail.size(); ++i) {
    CHECK_EQ(static_cast<int>(tail[i]), 0);
  }
}

TEST(FileArenaFileIsRemovedUnlessKept) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  const std::string gone = dir.path() + "/gone";
  const std::string kept = dir.path() + "/kept";
  {
    std::unique_ptr<FileArena> a = NewFileArena(gone, /*keep=*/false);
    std::unique_ptr<FileArena> b = NewFileArena(kept, /*keep=*/true);
    Buffer bounce(Arena::BounceBytes(4096));
    const std::vector<char> data = Pattern(100, 1);
    CHECK_OK(b->Write(5, data.data(), data.size(), bounce.data));
    CHECK(Exists(gone));
    CHECK(Exists(kept));
    // The file is created exclusively: a second arena on it is refused.
    StatusOr<std::unique_ptr<FileArena>> twice = FileArena::Create(gone, false);
    CHECK_CODE(twice, Code::kIo);
    CHECK_CONTAINS(twice.status().message(), gone);
  }
  CHECK(!Exists(gone));
  CHECK(Exists(kept));
  // What a kept file holds is still there.
  struct stat st;
  CHECK_EQ(stat(kept.c_str(), &st), 0);
  CHECK_EQ(static_cast<uint64_t>(st.st_size), kBlockBytes);
}

// Someone else cuts the file short: the bytes cut off read as an error
// naming the file (never as zeros, never SIGBUS), the rest still reads
// back, and writing the lost bytes again makes them whole.
TEST(FileArenaTruncatedBehindItsBackFailsReadsOfTheLostBytes) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
  Buffer bounce(Arena::BounceBytes(1 * kMiB));
  const std::vector<char> low = Pattern(1 * kMiB, 1);
  const std::vector<char> high = Pattern(1 * kMiB, 2);
  CHECK_OK(arena->Write(0, low.data(), low.size(), bounce.data));
  CHECK_OK(arena->Write(1 * kMiB, high.data(), high.size(), bounce.data));
  CHECK_EQ(truncate(arena->path().c_str(), 1 * kMiB + 4096), 0);
  std::vector<char> back(1 * kMiB);
  CHECK_OK(arena->Read(0, back.data(), back.size(), bounce.data));
  CHECK(back == low);
  Status lost = arena->Read(1 * kMiB, back.data(), back.size(), bounce.data);
  CHECK_CODE(lost, Code::kIo);
  CHECK_CONTAINS(lost.message(), arena->path());
  CHECK_CONTAINS(lost.message(), "behind the pool's back");
  CHECK_EQ(arena->lost_bytes(), 1 * kMiB - 4096);
  CHECK_CONTAINS(arena->Describe(), "lost");
  // The part below the cut is intact.
  CHECK_OK(arena->Read(1 * kMiB, back.data(), 4096, bounce.data));
  CHECK(std::memcmp(back.data(), high.data(), 4096) == 0);
  // Cut to nothing, then a write that grows the file again: the hole it
  // leaves below must not read as zeros.
  CHECK_EQ(truncate(arena->path().c_str(), 0), 0);
  CHECK_OK(arena->Write(3 * kMiB, high.data(), 4096, bounce.data));
  CHECK_CODE(arena->Read(0, back.data(), 4096, bounce.data), Code::kIo);
  CHECK_CODE(arena->Read(1 * kMiB, back.data(), 4096, bounce.data), Code::kIo);
  // Written again: whole again.
  CHECK_OK(arena->Write(0, low.data(), low.size(), bounce.data));
  CHECK_OK(arena->Read(0, back.data(), back.size(), bounce.data));
  CHECK(back == low);
  CHECK_EQ(arena->lost_bytes(), 1 * kMiB);
  // Released (freed) ranges are no longer lost either.
  arena->Release(1 * kMiB, 2 * kMiB);
  CHECK_EQ(arena->lost_bytes(), 0u);
}

// A write that the file system refuses (here: the process's file size limit
// makes write() fail with EFBIG, as a full disk fails it with ENOSPC) is an
// error naming the file; what was written before still reads back.
TEST(FileArenaWriteRefusedByTheFileSystemFails) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  std::unique_ptr<FileArena> arena = NewFileArena(dir.path() + "/arena");
  Buffer bounce(Arena::BounceBytes(1 * kMiB));
  const std::vector<char> data = Pattern(1 * kMiB, 3);
  CHECK_OK(arena->Write(0, data.data(), data.size(), bounce.data));
  struct rlimit saved;
  CHECK_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  void (*saved_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = saved;
  limit.rlim_cur = 2 * kMiB;
  CHECK_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  const Status refused =
      arena->Write(2 * kMiB - 4096, data.data(), data.size(), bounce.data);
  setrlimit(RLIMIT_FSIZE, &saved);
  signal(SIGXFSZ, saved_handler);
  CHECK_CODE(refused, Code::kIo);
  CHECK_CONTAINS(refused.message(), arena->path());
  CHECK_CONTAINS(refused.message(), std::strerror(EFBIG));
  std::vector<char> back(data.size());
  CHECK_OK(arena->Read(0, back.data(), back.size(), bounce.data));
  CHECK(back == data);
}

// The arena removes its own file only: not one that took its name after
// the original was removed.
TEST(FileArenaRemovesOnlyItsOwnFile) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  const std::string path = dir.path() + "/arena";
  {
    std::unique_ptr<FileArena> arena = NewFileArena(path);
    Buffer bounce(Arena::BounceBytes(4096));
    const std::vector<char> data = Pattern(4096, 4);
    CHECK_OK(arena->Write(0, data.data(), data.size(), bounce.data));
    CHECK_EQ(unlink(path.c_str()), 0);
    // Removed, yet still readable through the open file.
    std::vector<char> back(4096);
    CHECK_OK(arena->Read(0, back.data(), back.size(), bounce.data));
    CHECK(back == data);
    FILE* other = std::fopen(path.c_str(), "w");
    CHECK(other != nullptr);
    std::fclose(other);
  }
  CHECK(Exists(path));
}

// An existing file or symbolic link where the arena's file goes is refused
// and left alone (O_CREAT | O_EXCL).
TEST(FileArenaRefusesAnExistingLink) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  const std::string target = dir.path() + "/target";
  const std::string link = dir.path() + "/arena";
  FILE* file = std::fopen(target.c_str(), "w");
  CHECK(file != nullptr);
  std::fputs("keep me", file);
  std::fclose(file);
  CHECK_EQ(symlink(target.c_str(), link.c_str()), 0);
  StatusOr<std::unique_ptr<FileArena>> arena = FileArena::Create(link, false);
  CHECK_CODE(arena, Code::kIo);
  struct stat st;
  CHECK_EQ(stat(target.c_str(), &st), 0);
  CHECK_EQ(st.st_size, 7);
  CHECK_EQ(lstat(link.c_str(), &st), 0);
  CHECK(S_ISLNK(st.st_mode));
}

// The file's directory is opened once without following a link, and the
// file made and removed relative to it: a directory swapped for a link
// (before the arena is made, or while it lives) is never followed.
TEST(FileArenaNeverFollowsASwappedDirectory) {
  TempDir dir(BuildDir());
  CHECK(dir.ok());
  const std::string elsewhere = dir.path() + "/elsewhere";
  const std::string pool_dir = dir.path() + "/pool";
  CHECK_EQ(mkdir(elsewhere.c_str(), 0700), 0);
  CHECK_EQ(symlink(elsewhere.c_str(), pool_dir.c_str()), 0);
  StatusOr<std::unique_ptr<FileArena>> refused =
      FileArena::Create(pool_dir + "/tier.swap", false);
  CHECK_CODE(refused, Code::kIo);
  CHECK_CONTAINS(refused.status().message(), "symbolic link");
  CHECK(!Exists(elsewhere + "/tier.swap"));

  CHECK_EQ(unlink(pool_dir.c_str()), 0);
  CHECK_EQ(mkdir(pool_dir.c_str(), 0700), 0);
  {
    std::unique_ptr<FileArena> arena =
        NewFileArena(pool_dir + "/tier.swap", /*keep=*/false);
    // Swapped while the arena lives: the pool's directory moves away and a
    // link to another one, holding a file of that name, takes its place.
    const std::string moved = dir.path() + "/moved";
    CHECK_EQ(rename(pool_dir.c_str(), moved.c_str()), 0);
    CHECK_EQ(symlink(elsewhere.c_str(), pool_dir.c_str()), 0);
    FILE* file = std::fopen((elsewhere + "/tier.swap").c_str(), "w");
    CHECK(file != nullptr);
    std::fclose(file);
  }
  CHECK(Exists(elsewhere + "/tier.swap"));  // not ours: left alone
  CHECK(!Exists(dir.path() + "/moved/tier.swap"));  // ours: removed
}

TEST(FileArenaInMissingDirectoryFails) {
  StatusOr<std::unique_ptr<FileArena>> arena =
      FileArena::Create("./no/such/dir/arena", false);
  CHECK_CODE(arena, Code::kIo);
  CHECK_CONTAINS(arena.status().message(), "no/such/dir");
}

TEST(StreamingCopyIsExactAtEveryAlignment) {
  const uint64_t bytes = kStreamingCopyMinBytes + 1000;
  std::vector<char> src = Pattern(bytes + 128, 11);
  std::vector<char> dst(bytes + 128);
  for (uint64_t src_offset : {0, 1, 17, 63}) {
    for (uint64_t dst_offset = 0; dst_offset < 64; ++dst_offset) {
      for (uint64_t n : {bytes, bytes - 63, uint64_t{4097}}) {
        std::fill(dst.begin(), dst.end(), 0x5a);
        CopyLarge(dst.data() + dst_offset, src.data() + src_offset, n);
        CHECK(std::memcmp(dst.data() + dst_offset, src.data() + src_offset,
                          n) == 0);
        // Not one byte outside the destination range is touched.
        CHECK(std::all_of(dst.begin(), dst.begin() + dst_offset,
                          [](char c) { return c == 0x5a; }));
        CHECK(std::all_of(dst.begin() + dst_offset + n, dst.end(),
                          [](char c) { return c == 0x5a; }));
      }
    }
  }
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
