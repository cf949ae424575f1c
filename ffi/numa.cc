#include "numa.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
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

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

std::vector<int> ParseCpuList(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(),
                              [](char c) {
                                return std::isspace(
                                    static_cast<unsigned char>(c));
                              }),
               item.end());
    if (item.empty()) continue;
    const size_t dash = item.find('-');
    char* end = nullptr;
    const long first = std::strtol(item.c_str(), &end, 10);
    long last = first;
    if (dash != std::string::npos) {
      if (end != item.c_str() + dash) return {};
      last = std::strtol(item.c_str() + dash + 1, &end, 10);
    }
    if (*end != '\0' || first < 0 || last < first || last >= CPU_SETSIZE) {
      return {};
    }
    for (long cpu = first; cpu <= last; ++cpu) {
      cpus.push_back(static_cast<int>(cpu));
    }
  }
  return cpus;
}

std::map<int, std::vector<int>> AllowedCpusByNode() {
  std::map<int, std::vector<int>> out;
  const std::vector<int> allowed = AllowedCpus();
  const std::string root = "/sys/devices/system/node";
  DIR* dir = opendir(root.c_str());
  if (dir == nullptr) return out;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind("node", 0) != 0 || name.size() == 4 ||
        name.find_first_not_of("0123456789", 4) != std::string::npos) {
      continue;
    }
    std::ifstream file(root + "/" + name + "/cpulist");
    std::string text;
    if (!file || !std::getline(file, text)) continue;
    std::vector<int> cpus;
    for (int cpu : ParseCpuList(text)) {
      if (std::binary_search(allowed.begin(), allowed.end(), cpu)) {
        cpus.push_back(cpu);
      }
    }
    if (!cpus.empty()) out[std::atoi(name.c_str() + 4)] = std::move(cpus);
  }
  closedir(dir);
  return out;
}

}  // namespace jcxl::numa
