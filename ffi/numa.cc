#include "numa.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace jcxl::numa {
namespace {

// From <linux/mempolicy.h>; spelled out to avoid needing kernel headers.
constexpr int kMpolBind = 2;
constexpr int kMpolInterleave = 3;
constexpr unsigned kMpolMfMove = 1u << 1;
constexpr int kMaxNode = 1024;

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

Status Bind(void* addr, size_t bytes, const std::vector<int>& nodes) {
  if (nodes.empty() || bytes == 0) return Status::Ok();
  std::vector<unsigned long> mask(kMaxNode / (8 * sizeof(unsigned long)), 0);
  const int bits = 8 * sizeof(unsigned long);
  for (int node : nodes) {
    if (node < 0 || node >= kMaxNode) {
      return Status(Code::kInvalidArgument,
                    "numa node " + std::to_string(node) + " is out of range");
    }
    mask[node / bits] |= 1ul << (node % bits);
  }
  const int mode = nodes.size() == 1 ? kMpolBind : kMpolInterleave;
  long rc = syscall(SYS_mbind, addr, bytes, mode, mask.data(),
                    static_cast<unsigned long>(kMaxNode + 1), kMpolMfMove);
  if (rc != 0) {
    return Status(Code::kInternal,
                  std::string("mbind failed: ") + std::strerror(errno));
  }
  return Status::Ok();
}

StatusOr<std::vector<int>> PageNodes(const void* addr, size_t bytes) {
  const size_t page = PageSize();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(addr) + bytes;
  std::vector<void*> pages;
  for (uintptr_t p = begin; p < end; p += page) {
    pages.push_back(reinterpret_cast<void*>(p));
  }
  std::vector<int> status(pages.size(), 0);
  if (pages.empty()) return status;
  // nodes == nullptr: only query where each page is.
  long rc = syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr,
                    status.data(), 0);
  if (rc != 0) {
    return Status(Code::kInternal,
                  std::string("move_pages failed: ") + std::strerror(errno));
  }
  return status;
}

Status PinThreadToCpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return Status::Ok();
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return Status(Code::kInternal,
                  std::string("pthread_setaffinity_np failed: ") +
                      std::strerror(rc));
  }
  return Status::Ok();
}

}  // namespace jcxl::numa
