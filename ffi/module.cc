// The Python extension `jcxl._jcxl`: the pool, its tickets and a bare
// allocator (for trace replays), plus the table of XLA FFI targets that
// `jcxl` registers when it is imported.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator.h"
#include "host_update.h"
#include "pool.h"
#include "stream_handlers.h"
#include "update_handlers.h"
#include "update_program.h"
#ifdef JCXL_WITH_CUDA
#include <nanobind/stl/map.h>

#include "cuda/cuda_handlers.h"
#endif

namespace nb = nanobind;

namespace jcxl {
namespace {

// Carries a Status out of C++; translated into the Python exception class
// that jcxl._src.errors picks for its code.
struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)) {}
  const char* what() const noexcept override {
    return status.message().c_str();
  }
  Status status;
};

void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T Unwrap(StatusOr<T> result) {
  ThrowIfError(result.status());
  return std::move(*result);
}

// Python buffers lent to the copy engine for the length of a copy. The
// engine drops its reference on a worker thread, which must not take the
// GIL (a thread holding it may be joining that worker: Pool.close, or the
// pool's destructor), so the object is queued here and released by the next
// call into the extension, which holds the GIL.
class LentBuffers {
 public:
  // The engine's reference to `buffer` (GIL held).
  static std::shared_ptr<void> Lend(nb::handle buffer) {
    Py_INCREF(buffer.ptr());
    return std::shared_ptr<void>(buffer.ptr(), [](void* object) {
      std::lock_guard<std::mutex> lock(mu());
      returned().push_back(static_cast<PyObject*>(object));
    });
  }
  // Drops the references of copies done since the last call (GIL held).
  static void Release() {
    std::vector<PyObject*> done;
    {
      std::lock_guard<std::mutex> lock(mu());
      done.swap(returned());
    }
    for (PyObject* object : done) Py_DECREF(object);
  }

 private:
  // Never destroyed: workers may return buffers while the process exits.
  static std::mutex& mu() {
    static auto* mu = new std::mutex();
    return *mu;
  }
  static std::vector<PyObject*>& returned() {
    static auto* returned = new std::vector<PyObject*>();
    return *returned;
  }
};

int64_t SecondsToNs(double seconds) {
  if (!(seconds >= 0)) throw nb::value_error("timeout must be >= 0 seconds");
  return seconds > 1e9 ? INT64_MAX : static_cast<int64_t>(seconds * 1e9);
}

// Handler symbols by FFI target name, as capsules for jax.ffi.
nb::dict Capsules(
    std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> targets) {
  nb::dict out;
  for (const auto& [name, handler] : targets) {
    out[name] = nb::capsule(reinterpret_cast<void*>(handler));
  }
  return out;
}

// The core's plain result structs, bound read-only: Python reads their
// fields by name (jcxl/_src/pool.py turns them into its own types).
void BindResults(nb::module_& m) {
  nb::class_<AllocatorStats>(m, "AllocatorStats")
      .def_ro("capacity", &AllocatorStats::capacity)
      .def_ro("reserved", &AllocatorStats::reserved)
      .def_ro("live", &AllocatorStats::live)
      .def_ro("hole_bytes", &AllocatorStats::hole_bytes)
      .def_ro("largest_hole", &AllocatorStats::largest_hole)
      .def_ro("largest_free", &AllocatorStats::largest_free)
      .def_prop_ro("external_fragmentation",
                   &AllocatorStats::external_fragmentation)
      .def_ro("slab_objects", &AllocatorStats::slab_objects)
      .def_ro("extent_objects", &AllocatorStats::extent_objects)
      .def_ro("slab_spans", &AllocatorStats::slab_spans)
      .def_ro("allocations", &AllocatorStats::allocations)
      .def_ro("frees", &AllocatorStats::frees)
      .def_ro("alloc_ns_total", &AllocatorStats::alloc_ns_total)
      .def_ro("alloc_ns_max", &AllocatorStats::alloc_ns_max);

  nb::class_<ArenaStats>(m, "ArenaStats")
      .def_ro("node", &ArenaStats::node)
      .def_ro("weight", &ArenaStats::weight)
      .def_ro("description", &ArenaStats::description)
      .def_ro("allocator", &ArenaStats::allocator);

  // Tiers and directions as their indices (TierKind, Direction).
  nb::class_<TierStats>(m, "TierStats")
      .def_prop_ro("tier",
                   [](const TierStats& t) { return static_cast<int>(t.kind); })
      .def_ro("enabled", &TierStats::enabled)
      .def_ro("emulated", &TierStats::emulated)
      .def_ro("link_bytes_per_second", &TierStats::link_bytes_per_second)
      .def_ro("link_latency_ns", &TierStats::link_latency_ns)
      .def_ro("bytes_read", &TierStats::bytes_read)
      .def_ro("bytes_written", &TierStats::bytes_written)
      .def_ro("arenas", &TierStats::arenas);

  nb::class_<ObjectInfo>(m, "ObjectInfo")
      .def_ro("handle", &ObjectInfo::handle)
      .def_prop_ro("tier",
                   [](const ObjectInfo& o) { return static_cast<int>(o.tier); })
      .def_ro("node", &ObjectInfo::node)
      .def_ro("offset", &ObjectInfo::offset)
      .def_ro("bytes", &ObjectInfo::bytes)
      .def_ro("slab", &ObjectInfo::slab)
      .def_ro("shape", &ObjectInfo::shape)
      .def_ro("dtype", &ObjectInfo::dtype)
      .def_ro("copy_of", &ObjectInfo::copy_of);

  nb::class_<TransferRecord>(m, "TransferRecord")
      .def_ro("id", &TransferRecord::id)
      .def_ro("handle", &TransferRecord::handle)
      .def_ro("tier", &TransferRecord::tier)
      .def_ro("node", &TransferRecord::node)
      .def_prop_ro("to_pool",
                   [](const TransferRecord& r) {
                     return r.direction == Direction::kToPool;
                   })
      .def_ro("bytes", &TransferRecord::bytes)
      .def_ro("priority", &TransferRecord::priority)
      .def_ro("queued_ns", &TransferRecord::queued_ns)
      .def_ro("started_ns", &TransferRecord::started_ns)
      .def_ro("finished_ns", &TransferRecord::finished_ns)
      .def_ro("ok", &TransferRecord::ok);

  nb::class_<StreamWait>(m, "StreamWait")
      .def_ro("record", &StreamWait::record)
      .def_ro("wait_started_ns", &StreamWait::wait_started_ns)
      .def_ro("wait_ns", &StreamWait::wait_ns);

  nb::class_<WaitTotals>(m, "WaitTotals")
      .def_ro("bytes_to_pool", &WaitTotals::bytes_to_pool)
      .def_ro("bytes_from_pool", &WaitTotals::bytes_from_pool)
      .def_ro("wait_ns", &WaitTotals::wait_ns)
      .def_ro("transfers", &WaitTotals::transfers);

  nb::class_<UpdateStats>(m, "UpdateStats")
      .def_ro("runs", &UpdateStats::runs)
      .def_ro("failed", &UpdateStats::failed)
      .def_ro("elements", &UpdateStats::elements)
      .def_ro("bytes_read", &UpdateStats::bytes_read)
      .def_ro("bytes_written", &UpdateStats::bytes_written)
      .def_ro("busy_ns", &UpdateStats::busy_ns)
      .def_ro("threads", &UpdateStats::threads);
}

// Update programs (update_program.h), built from jcxl/_src/update_program.py's
// dataclasses and read back field by field. Ops, dtypes and kinds travel as
// their ints: ValidateUpdateProgram names a bad one (an enum binding would
// turn it into a bare TypeError).
void BindUpdatePrograms(nb::module_& m) {
  nb::class_<UpdateInput>(m, "UpdateInput")
      .def(
          "__init__",
          [](UpdateInput* self, int32_t kind, int32_t handle,
             int32_t scalar_index, float constant) {
            new (self) UpdateInput{static_cast<UpdateInput::Kind>(kind),
                                   handle, scalar_index, constant};
          },
          nb::arg("kind"), nb::arg("handle") = 0, nb::arg("scalar_index") = 0,
          nb::arg("constant") = 0.0f)
      .def_prop_ro("kind",
                   [](const UpdateInput& i) {
                     return static_cast<int32_t>(i.kind);
                   })
      .def_ro("handle", &UpdateInput::handle)
      .def_ro("scalar_index", &UpdateInput::scalar_index)
      .def_ro("constant", &UpdateInput::constant);

  nb::class_<UpdateInstr>(m, "UpdateInstr")
      .def(
          "__init__",
          [](UpdateInstr* self, int32_t op, int32_t a, int32_t b, int32_t c,
             int32_t dtype, int32_t imm) {
            new (self) UpdateInstr{static_cast<UpdateOp>(op), a, b, c,
                                   static_cast<UpdateDType>(dtype), imm};
          },
          nb::arg("op"), nb::arg("a") = -1, nb::arg("b") = -1,
          nb::arg("c") = -1, nb::arg("dtype") = 0, nb::arg("imm") = 0)
      .def_prop_ro("op",
                   [](const UpdateInstr& i) {
                     return static_cast<int32_t>(i.op);
                   })
      .def_ro("a", &UpdateInstr::a)
      .def_ro("b", &UpdateInstr::b)
      .def_ro("c", &UpdateInstr::c)
      .def_prop_ro("dtype",
                   [](const UpdateInstr& i) {
                     return static_cast<int32_t>(i.dtype);
                   })
      .def_ro("imm", &UpdateInstr::imm);

  nb::class_<UpdateOutput>(m, "UpdateOutput")
      .def(
          "__init__",
          [](UpdateOutput* self, int32_t reg, int32_t handle) {
            new (self) UpdateOutput{reg, handle};
          },
          nb::arg("reg"), nb::arg("handle"))
      .def_ro("reg", &UpdateOutput::reg)
      .def_ro("handle", &UpdateOutput::handle);

  nb::class_<UpdateProgram>(m, "UpdateProgram")
      .def(
          "__init__",
          [](UpdateProgram* self, int64_t num_elements, int32_t num_scalars,
             std::vector<UpdateInput> inputs, std::vector<UpdateInstr> code,
             std::vector<UpdateOutput> outputs, bool flush_denormals) {
            new (self) UpdateProgram{num_elements, num_scalars,
                                     std::move(inputs), std::move(code),
                                     std::move(outputs), flush_denormals};
          },
          nb::arg("num_elements"), nb::arg("num_scalars"), nb::arg("inputs"),
          nb::arg("code"), nb::arg("outputs"),
          nb::arg("flush_denormals") = false)
      .def_ro("num_elements", &UpdateProgram::num_elements)
      .def_ro("num_scalars", &UpdateProgram::num_scalars)
      .def_ro("inputs", &UpdateProgram::inputs)
      .def_ro("code", &UpdateProgram::code)
      .def_ro("outputs", &UpdateProgram::outputs)
      .def_ro("flush_denormals", &UpdateProgram::flush_denormals);

  // The table of ops (update_ops.h), from which jcxl/_src/update_program.py
  // builds its UpdateOp and map of JAX primitives.
  m.def(
      "update_ops",
      [] {
        nb::list ops;
        for (const UpdateOpInfo& info : kUpdateOps) {
          ops.append(nb::make_tuple(info.enumerator, info.name,
                                    static_cast<int32_t>(info.op), info.arity,
                                    info.traced));
        }
        return ops;
      },
      "The update-program ops: (enumerator, name, code, arity, traced) each, "
      "in code order.");

  m.def(
      "validate_update_program",
      [](const UpdateProgram& program) {
        ThrowIfError(ValidateUpdateProgram(program));
      },
      "Checks a program's structure (not its handles): ValueError if bad.");

  nb::class_<UpdateRun>(m, "UpdateRun")
      .def(
          "wait",
          [](UpdateRun& run, double timeout_s) {
            const int64_t timeout_ns = SecondsToNs(timeout_s);
            Status status;
            {
              nb::gil_scoped_release release;
              status = run.Wait(timeout_ns);
            }
            ThrowIfError(status);
          },
          nb::arg("timeout_s"))
      .def("done", &UpdateRun::done)
      .def_prop_ro("id", &UpdateRun::id)
      .def_prop_ro("program_id", &UpdateRun::program_id);
}

// An allocator alone, without memory, for replaying allocation traces:
// the hybrid allocator, or the first-fit baseline it is compared with.
class ReplayAllocator {
 public:
  ReplayAllocator(uint64_t capacity, const std::string& policy,
                  uint64_t alignment) {
    if (policy == "hybrid") {
      HybridOptions options;
      options.alignment = alignment;
      hybrid_ = std::make_unique<HybridAllocator>(capacity, options);
    } else if (policy == "first_fit") {
      baseline_ = std::make_unique<ExtentAllocator>(capacity, alignment,
                                                    FitPolicy::kFirstFit);
    } else {
      throw nb::value_error(
          ("policy must be 'hybrid' or 'first_fit', but got '" + policy + "'")
              .c_str());
    }
  }
  int64_t Allocate(uint64_t bytes) {
    const int64_t token = next_token_++;
    if (hybrid_) {
      live_[token] = Unwrap(hybrid_->Allocate(bytes));
    } else {
      const auto start = std::chrono::steady_clock::now();
      Allocation a;
      a.bytes = bytes;
      a.extent_offset = Unwrap(baseline_->Allocate(bytes));
      const uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count();
      baseline_ns_total_ += ns;
      baseline_ns_max_ = std::max(baseline_ns_max_, ns);
      baseline_live_ += bytes;
      ++baseline_allocations_;
      live_[token] = a;
    }
    return token;
  }
  void Free(int64_t token) {
    auto it = live_.find(token);
    if (it == live_.end()) throw nb::key_error("unknown allocation token");
    if (hybrid_) {
      ThrowIfError(hybrid_->Free(it->second));
    } else {
      ThrowIfError(baseline_->Free(it->second.extent_offset));
      baseline_live_ -= it->second.bytes;
    }
    live_.erase(it);
  }
  AllocatorStats Stats() {
    if (hybrid_) return hybrid_->Stats();
    AllocatorStats s;
    s.capacity = baseline_->capacity();
    s.reserved = baseline_->top();
    s.live = baseline_live_;
    s.hole_bytes = baseline_->hole_bytes();
    s.largest_hole = baseline_->largest_hole();
    s.largest_free = std::max(s.largest_hole, s.capacity - s.reserved);
    s.extent_objects = baseline_->live_extents();
    s.allocations = baseline_allocations_;
    s.alloc_ns_total = baseline_ns_total_;
    s.alloc_ns_max = baseline_ns_max_;
    return s;
  }

 private:
  std::unique_ptr<HybridAllocator> hybrid_;
  std::unique_ptr<ExtentAllocator> baseline_;
  std::map<int64_t, Allocation> live_;
  int64_t next_token_ = 1;
  uint64_t baseline_live_ = 0;
  uint64_t baseline_allocations_ = 0;
  uint64_t baseline_ns_total_ = 0;
  uint64_t baseline_ns_max_ = 0;
};

}  // namespace
}  // namespace jcxl

NB_MODULE(_jcxl, m) {
  using namespace jcxl;
  m.doc() = "jcxl's C++ core: the pool, its copy engine and FFI targets.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      nb::object errors = nb::module_::import_("jcxl._src.errors");
      nb::object cls =
          errors.attr("error_class")(static_cast<int>(e.status.code()));
      PyErr_SetString(cls.ptr(), e.status.message().c_str());
    }
  });

  BindResults(m);
  BindUpdatePrograms(m);

  nb::class_<TierConfig>(m, "TierConfig")
      .def(nb::init<>())
      .def_rw("capacity", &TierConfig::capacity)
      .def_rw("nodes", &TierConfig::nodes)
      .def_rw("weights", &TierConfig::weights)
      .def_rw("emulated", &TierConfig::emulated)
      .def_rw("link_bytes_per_second", &TierConfig::link_bytes_per_second)
      .def_rw("link_latency_ns", &TierConfig::link_latency_ns);

  nb::class_<PoolConfig>(m, "PoolConfig")
      .def(nb::init<>())
      .def("set_tier",
           [](PoolConfig& c, int tier, const TierConfig& t) {
             if (tier < 0 || tier >= kNumTiers) {
               throw nb::value_error("tier index out of range");
             }
             c.tiers[tier] = t;
           })
      .def_rw("nvme_dir", &PoolConfig::nvme_dir)
      .def_rw("keep_nvme_files", &PoolConfig::keep_nvme_files)
      .def_rw("spill", &PoolConfig::spill)
      .def_rw("copy_threads", &PoolConfig::copy_threads)
      .def_rw("chunk_bytes", &PoolConfig::chunk_bytes)
      .def_rw("copy_cpus", &PoolConfig::copy_cpus)
      .def_rw("update_threads", &PoolConfig::update_threads)
      .def_rw("run_wait_ns", &PoolConfig::run_wait_ns)
      .def_prop_rw(
          "slab_max_bytes",
          [](const PoolConfig& c) { return c.allocator.slab_max_bytes; },
          [](PoolConfig& c, uint64_t v) { c.allocator.slab_max_bytes = v; });

  nb::class_<Ticket>(m, "Ticket")
      .def(
          "wait",
          [](Ticket& t, double timeout_s) {
            const int64_t timeout_ns = SecondsToNs(timeout_s);
            Status status;
            {
              nb::gil_scoped_release release;
              status = t.Wait(timeout_ns);
            }
            LentBuffers::Release();
            ThrowIfError(status);
          },
          nb::arg("timeout_s"))
      .def("done",
           [](Ticket& t) {
             LentBuffers::Release();
             return t.done();
           })
      .def("cancel", &Ticket::Cancel)
      .def("record", &Ticket::record);

  nb::class_<Pool>(m, "Pool")
      .def_static(
          "create",
          [](const PoolConfig& config) { return Unwrap(Pool::Create(config)); })
      .def_prop_ro("id", &Pool::id)
      .def_prop_ro("closed", &Pool::closed)
      .def(
          "allocate",
          [](Pool& p, int tier, uint64_t bytes, std::vector<int64_t> shape,
             std::string dtype, double timeout_s) {
            if (tier < 0 || tier >= kNumTiers) {
              throw nb::value_error("tier index out of range");
            }
            const int64_t timeout_ns = SecondsToNs(timeout_s);
            StatusOr<int32_t> handle(0);
            {
              // It may wait for transfers, to compact a fragmented tier.
              nb::gil_scoped_release release;
              handle = p.objects().Allocate(static_cast<TierKind>(tier), bytes,
                                            std::move(shape), std::move(dtype),
                                            timeout_ns);
            }
            return Unwrap(std::move(handle));
          },
          nb::arg("tier"), nb::arg("bytes"), nb::arg("shape"), nb::arg("dtype"),
          nb::arg("timeout_s"))
      .def(
          "allocate_copy",
          [](Pool& p, int32_t source, std::string dtype, double timeout_s) {
            const int64_t timeout_ns = SecondsToNs(timeout_s);
            StatusOr<int32_t> handle(0);
            {
              nb::gil_scoped_release release;
              handle = p.updates().AllocateCopy(source, std::move(dtype),
                                                timeout_ns);
            }
            return Unwrap(std::move(handle));
          },
          nb::arg("source"), nb::arg("dtype"), nb::arg("timeout_s"))
      .def("free",
           [](Pool& p, int32_t handle, double timeout_s) {
             const int64_t timeout_ns = SecondsToNs(timeout_s);
             Status status;
             {
               nb::gil_scoped_release release;
               status = p.objects().Free(handle, timeout_ns);
             }
             ThrowIfError(status);
           })
      // `owner` holds the memory at `src` / `dst` (a numpy array): the
      // engine keeps a reference to it until the copy is done.
      .def(
          "write",
          [](Pool& p, int32_t handle, uintptr_t src, uint64_t bytes,
             uint64_t offset, int priority, uint64_t chunk_bytes,
             nb::handle owner) {
            LentBuffers::Release();
            std::shared_ptr<void> lent = LentBuffers::Lend(owner);
            StatusOr<std::shared_ptr<Ticket>> ticket(
                std::shared_ptr<Ticket>{});
            {
              // It waits for the update runs it follows (and compaction).
              nb::gil_scoped_release release;
              ticket = p.transfers().Write(
                  handle, reinterpret_cast<const void*>(src), bytes, offset,
                  priority, chunk_bytes, std::move(lent));
            }
            return Unwrap(std::move(ticket));
          },
          nb::arg("handle"), nb::arg("src"), nb::arg("bytes"),
          nb::arg("offset"), nb::arg("priority"), nb::arg("chunk_bytes"),
          nb::arg("owner"))
      .def(
          "read",
          [](Pool& p, int32_t handle, uintptr_t dst, uint64_t bytes,
             uint64_t offset, int priority, uint64_t chunk_bytes,
             nb::handle owner) {
            LentBuffers::Release();
            std::shared_ptr<void> lent = LentBuffers::Lend(owner);
            StatusOr<std::shared_ptr<Ticket>> ticket(
                std::shared_ptr<Ticket>{});
            {
              // It waits for the update runs it follows (and a refresh).
              nb::gil_scoped_release release;
              ticket = p.transfers().Read(
                  handle, reinterpret_cast<void*>(dst), bytes, offset,
                  priority, chunk_bytes, std::move(lent));
            }
            return Unwrap(std::move(ticket));
          },
          nb::arg("handle"), nb::arg("dst"), nb::arg("bytes"),
          nb::arg("offset"), nb::arg("priority"), nb::arg("chunk_bytes"),
          nb::arg("owner"))
      .def("info",
           [](Pool& p, int32_t handle) {
             return Unwrap(p.objects().Info(handle));
           })
      .def("handles", [](Pool& p) { return p.objects().Handles(); })
      .def("page_nodes",
           [](Pool& p, int32_t handle) {
             return Unwrap(p.objects().PageNodes(handle));
           })
      .def("compact",
           [](Pool& p, double timeout_s) {
             const int64_t timeout_ns = SecondsToNs(timeout_s);
             Status status;
             {
               nb::gil_scoped_release release;
               status = p.objects().Compact(timeout_ns);
             }
             ThrowIfError(status);
           })
      .def("inject_fault",
           [](Pool& p, int kind, int tier, int direction, uint64_t skip,
              int64_t count) {
             if (kind < 0 || kind > 2) {
               throw nb::value_error("fault kind must be 0, 1 or 2");
             }
             FaultSpec spec;
             spec.kind = static_cast<FaultSpec::Kind>(kind);
             spec.tier = tier;
             spec.direction = direction;
             spec.skip = skip;
             spec.count = count;
             ThrowIfError(p.test_hooks().InjectFault(spec));
           })
      .def_prop_ro("faults_injected",
                   [](Pool& p) { return p.test_hooks().faults_injected(); })
      .def("set_link",
           [](Pool& p, int tier, double bytes_per_second, int64_t latency_ns) {
             ThrowIfError(p.objects().SetLink(static_cast<TierKind>(tier),
                                              bytes_per_second, latency_ns));
           })
      .def("stats", [](Pool& p) { return p.objects().Stats(); })
      .def("drain_records",
           [](Pool& p) { return p.transfers().DrainRecords(); })
      .def(
          "register_update",
          [](Pool& p, UpdateProgram program) {
            return Unwrap(p.updates().RegisterUpdate(std::move(program)));
          },
          nb::arg("program"))
      .def(
          "release_update",
          [](Pool& p, int32_t id) {
            ThrowIfError(p.updates().ReleaseUpdate(id));
          },
          nb::arg("program_id"))
      .def(
          "start_update",
          [](Pool& p, int32_t id, std::vector<float> scalars) {
            StatusOr<std::shared_ptr<UpdateRun>> run(
                std::shared_ptr<UpdateRun>{});
            {
              // It waits for a compaction under way.
              nb::gil_scoped_release release;
              run = p.updates().StartUpdate(id, std::move(scalars));
            }
            return Unwrap(std::move(run));
          },
          nb::arg("program_id"), nb::arg("scalars"))
      .def("update_stats", [](Pool& p) { return p.updates().update_stats(); })
      .def(
          "wait_for_updates",
          [](Pool& p, double timeout_s) {
            const int64_t timeout_ns = SecondsToNs(timeout_s);
            Status status;
            {
              nb::gil_scoped_release release;
              status = p.updates().WaitForRuns(timeout_ns);
            }
            ThrowIfError(status);
          },
          nb::arg("timeout_s"),
          "Waits until every update run started on the pool is done.")
      .def(
          "hold_updates",
          [](Pool& p, bool hold) {
            ThrowIfError(p.test_hooks().HoldUpdates(hold));
          },
          nb::arg("hold"),
          "Test hook: while held, update workers take no new block.")
      .def("close", [](Pool& p, double timeout_s) {
        const int64_t timeout_ns = SecondsToNs(timeout_s);
        Status status;
        {
          nb::gil_scoped_release release;
          status = p.Close(timeout_ns);
        }
        LentBuffers::Release();  // the engine is gone: every copy is done
        ThrowIfError(status);
      });

  m.def("release_lent_buffers", &LentBuffers::Release,
        "Drops the copy engine's references to the buffers of copies that "
        "are done (every pool call does this too).");

  nb::class_<ReplayAllocator>(m, "ReplayAllocator")
      .def(nb::init<uint64_t, const std::string&, uint64_t>(),
           nb::arg("capacity"), nb::arg("policy"), nb::arg("alignment"))
      .def("allocate", &ReplayAllocator::Allocate)
      .def("free", &ReplayAllocator::Free)
      .def("stats", &ReplayAllocator::Stats);

  m.def("now_ns", &NowNs, "The copy engine's clock (steady, ns).");

  m.def("drain_stream_waits", &DrainStreamWaits);

  m.def("clear_stream_waits", &ClearStreamWaits,
        "Forgets the logged waits (not the totals) without returning them.");

  m.def("drain_wait_totals", &DrainWaitTotals,
        "Per object handle: its WaitTotals since the last call.");

  // XLA FFI targets, registered for the CPU platform by jcxl/__init__.py.
  m.def("registrations", []() {
    return Capsules({{"jcxl_fetch_start", kFetchStart},
                     {"jcxl_fetch_done", kFetchDone},
                     {"jcxl_fetch_start_into", kFetchStartInto},
                     {"jcxl_after", kAfter},
                     {"jcxl_store_start", kStoreStart},
                     {"jcxl_store_done", kStoreDone},
                     {"jcxl_update_start", kUpdateStart},
                     {"jcxl_update_done", kUpdateDone}});
  });

  // The same targets for XLA's CUDA platform, where jcxl was built with the
  // CUDA toolkit (ffi/cuda/); registered by registry.py when a GPU is there.
#ifdef JCXL_WITH_CUDA
  m.attr("cuda_built") = true;
  m.def("cuda_registrations", []() {
    return Capsules({{"jcxl_fetch_start", cuda::kCudaFetchStart},
                     {"jcxl_fetch_done", cuda::kCudaFetchDone},
                     {"jcxl_fetch_start_into", cuda::kCudaFetchStartInto},
                     {"jcxl_after", cuda::kCudaAfter},
                     {"jcxl_store_start", cuda::kCudaStoreStart},
                     {"jcxl_store_done", cuda::kCudaStoreDone},
                     {"jcxl_update_start", cuda::kCudaUpdateStart},
                     {"jcxl_update_done", cuda::kCudaUpdateDone}});
  });
  m.def("cuda_device_count", &cuda::DeviceCount);
  m.def("cuda_flush", &cuda::Flush,
        "Waits until every CUDA transfer so far is logged for the profiler.");
  m.def("cuda_counters", &cuda::Counters,
        "The CUDA transfers' paths so far (direct, direct_after_index, "
        "staged, staged_lock_failed, ...) and bounce-buffer reuse.");
  m.def(
      "cuda_memcpy_bandwidth",
      [](int ordinal, uint64_t bytes, bool to_device, int repeats) {
        const double rate =
            cuda::MemcpyBandwidth(ordinal, bytes, to_device, repeats);
        if (rate < 0) {
          throw std::runtime_error(
              "cudaMemcpyAsync bandwidth: CUDA error " +
              std::to_string(static_cast<int>(-rate)));
        }
        return rate;
      },
      nb::arg("ordinal"), nb::arg("bytes"), nb::arg("to_device"),
      nb::arg("repeats"),
      "Bytes/s of cudaMemcpyAsync between page-locked host memory and "
      "device `ordinal`.");
#else
  m.attr("cuda_built") = false;
#endif
}
