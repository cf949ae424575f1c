// The copies each XLA execution has in flight, so that no copy outlives the
// buffer it reads or writes.
//
// XLA:CPU ends an execution at the first FFI call that returns an error: it
// skips the calls not yet run (the `done`s among them) and frees the
// execution's buffers. A copy the execution started and no `done` waited for
// would go on writing into freed memory. So every stream handler files the
// copy it starts under its execution's RunId (the `ffi::RunId` context), and
// any jcxl handler about to return an error first calls Abort(run): it
// cancels each copy that execution has in flight and waits until none runs,
// and refuses the copies the execution may still start. Only then does the
// error reach XLA.
//
// A `done` takes its copy out (Take) and waits for it itself: XLA frees no
// buffer of an execution while one of its calls still runs, so a copy held
// by a running `done` is safe without Abort.
//
// Plain C++ (no XLA types), shared by the stream and update handlers through
// Get(), and tested under AddressSanitizer in ffi/tests.
#ifndef JCXL_FFI_EXECUTION_TRANSFERS_H_
#define JCXL_FFI_EXECUTION_TRANSFERS_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "copy_engine.h"
#include "status.h"

namespace jcxl {

// kInternal: execution `run` failed before; `what` says what was refused.
Status AlreadyFailed(int64_t run, const std::string& what);

class ExecutionTransfers {
 public:
  // The process's table (never destroyed: handlers may run at exit).
  static ExecutionTransfers& Get();

  // Files `ticket`, a copy into or out of `buffer` that execution `run`
  // started. If `run` failed already, the copy is stopped (see Stop) and
  // kInternal names the run: the caller fails too. A copy still filed at
  // `buffer` (an execution that failed for a reason jcxl never saw left it)
  // is stopped first.
  Status Add(int64_t run, const void* buffer, std::shared_ptr<Ticket> ticket);

  // Takes out the copy filed for `buffer`; null if there is none.
  std::shared_ptr<Ticket> Take(const void* buffer);

  // Fails execution `run`: cancels every copy it has in flight, waits until
  // none of them touches its buffer, and makes later Adds for `run` fail.
  // Returns how many copies it stopped.
  int Abort(int64_t run);

  // Whether execution `run` failed (as far as the bounded memory of failed
  // runs goes).
  bool failed(int64_t run);

  // Copies filed and not taken (all executions).
  size_t in_flight();

  // Cancels `ticket` and waits until its copy has stopped (the chunk under
  // way finishes; the rest never runs).
  static void Stop(const std::shared_ptr<Ticket>& ticket);

 private:
  struct Filed {
    int64_t run;
    std::shared_ptr<Ticket> ticket;
  };
  // Runs that failed are remembered, the last kMaxFailedRuns of them, so a
  // start racing its execution's failure on another thread is refused.
  // (JAX's run ids are a per-executable base plus a call counter: another
  // execution meets a remembered id only by a 32-bit coincidence.)
  static constexpr size_t kMaxFailedRuns = 4096;

  std::mutex mu_;
  std::unordered_map<const void*, Filed> filed_;
  std::unordered_set<int64_t> failed_;
  std::deque<int64_t> failed_order_;
};

}  // namespace jcxl

#endif  // JCXL_FFI_EXECUTION_TRANSFERS_H_
