// NUMA placement through the raw system calls (mbind, get_mempolicy,
// move_pages), so that jcxl needs no libnuma at run time.
#ifndef JCXL_FFI_NUMA_H_
#define JCXL_FFI_NUMA_H_

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "status.h"

namespace jcxl::numa {

// Binds the pages of [addr, addr + bytes) to `nodes` (MPOL_BIND for one node,
// MPOL_INTERLEAVE for several). Must run before the pages are first touched.
Status Bind(void* addr, size_t bytes, const std::vector<int>& nodes);

// The node each page of [addr, addr + bytes) sits on, as move_pages reports
// it: a node id, or a negative errno (-ENOENT: not yet backed by memory).
StatusOr<std::vector<int>> PageNodes(const void* addr, size_t bytes);

// Pins the calling thread to `cpus` (no-op for an empty list).
Status PinThreadToCpus(const std::vector<int>& cpus);

// The CPUs this process may run on (its affinity mask), ascending.
std::vector<int> AllowedCpus();

// The allowed CPUs of each NUMA node (from /sys/devices/system/node),
// leaving out nodes with none (CXL memory, other cgroups' CPUs). Empty
// where /sys does not say.
std::map<int, std::vector<int>> AllowedCpusByNode();

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}; an unparsable list -> empty.
std::vector<int> ParseCpuList(const std::string& text);

}  // namespace jcxl::numa

#endif  // JCXL_FFI_NUMA_H_
