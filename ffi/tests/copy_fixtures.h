// Helpers for the C++ tests that hand copies to the copy engine.
#ifndef JCXL_FFI_TESTS_COPY_FIXTURES_H_
#define JCXL_FFI_TESTS_COPY_FIXTURES_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "arena.h"
#include "check.h"
#include "copy_engine.h"

namespace jcxl {

// A memory arena of `bytes`; the test fails if it cannot be made.
inline std::unique_ptr<MemoryArena> NewMemoryArena(uint64_t bytes) {
  StatusOr<std::unique_ptr<MemoryArena>> arena = MemoryArena::Create(bytes, {});
  CHECK_OK(arena);
  return std::move(*arena);
}

// A copy of `bytes` between `buffer` and the arena at `offset`.
inline TransferRequest Request(Arena* arena, uint64_t offset, void* buffer,
                               uint64_t bytes, Direction direction,
                               int priority = 0) {
  TransferRequest request;
  request.arena = arena;
  request.arena_offset = offset;
  request.buffer = buffer;
  request.bytes = bytes;
  request.direction = direction;
  request.priority = priority;
  return request;
}

}  // namespace jcxl

#endif  // JCXL_FFI_TESTS_COPY_FIXTURES_H_
