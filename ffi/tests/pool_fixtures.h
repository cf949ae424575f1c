// Helpers for the C++ tests that open pools.
#ifndef JCXL_FFI_TESTS_POOL_FIXTURES_H_
#define JCXL_FFI_TESTS_POOL_FIXTURES_H_

#include <memory>

#include "check.h"
#include "pool.h"

namespace jcxl {

// A new pool; the test fails (with the status) if it cannot be made.
inline std::shared_ptr<Pool> NewPool(const PoolConfig& config) {
  StatusOr<std::shared_ptr<Pool>> pool = Pool::Create(config);
  CHECK_OK(pool);
  return *pool;
}

}  // namespace jcxl

#endif  // JCXL_FFI_TESTS_POOL_FIXTURES_H_
