// Tests of update programs run by the pool: register, run and wait; runs
// split over the workers and kept in order; objects pinned against Free,
// Compact and Close; nvme objects through staging; the errors of
// registering and starting; several threads at once (run under
// ThreadSanitizer too).
#include "host_update.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "numa.h"
#include "pool.h"
#include "pool_fixtures.h"
#include "test_util.h"
#include "update_program.h"

namespace jcxl {
namespace {

using Kind = UpdateInput::Kind;
using Op = UpdateOp;

PoolConfig Tiers(const std::string& nvme_dir, int update_threads = 2) {
  PoolConfig config;
  config.tiers[0].capacity = 64 * kMiB;
  config.tiers[0].nodes = {0};
  config.tiers[1].capacity = 64 * kMiB;
  config.tiers[1].emulated = true;
  config.tiers[1].link_bytes_per_second = 16e9;
  if (!nvme_dir.empty()) {
    config.tiers[2].capacity = 128 * kMiB;
    config.nvme_dir = nvme_dir;
  }
  config.update_threads = update_threads;
  return config;
}

int32_t Put(Pool& pool, TierKind tier, const std::vector<float>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  StatusOr<int32_t> handle =
      pool.objects().Allocate(tier, n * 4, {n}, "float32");
  CHECK_OK(handle);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Write(*handle, values.data(), n * 4, 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  return *handle;
}

std::vector<float> Get(Pool& pool, int32_t handle, int64_t n) {
  std::vector<float> out(n);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Read(handle, out.data(), n * 4, 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  return out;
}

std::vector<float> Iota(int64_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  for (int64_t k = 0; k < n; ++k) v[k] = scale * static_cast<float>(k % 9973);
  return v;
}

// x <- x * s0 + c.
UpdateProgram Affine(int64_t n, int32_t x, float c) {
  UpdateProgram p;
  p.num_elements = n;
  p.num_scalars = 1;
  p.inputs = {{Kind::kObject, x}, {Kind::kScalar, 0, 0},
              {Kind::kConstant, 0, 0, c}};
  p.code = {{Op::kMul, 0, 1}, {Op::kAdd, 3, 2}};
  p.outputs = {{4, x}};
  return p;
}

// The adam program of update_program_test.cc, in short: p, mu, nu updated
// from g with scalars lr, bc1, bc2.
UpdateProgram Adam(int64_t n, int32_t p, int32_t mu, int32_t nu, int32_t g) {
  UpdateProgram prog;
  prog.num_elements = n;
  prog.num_scalars = 3;
  prog.inputs = {{Kind::kObject, p},     {Kind::kObject, mu},
                 {Kind::kObject, nu},    {Kind::kObject, g},
                 {Kind::kScalar, 0, 0},  {Kind::kScalar, 0, 1},
                 {Kind::kScalar, 0, 2},  {Kind::kConstant, 0, 0, 0.9f},
                 {Kind::kConstant, 0, 0, 0.1f}, {Kind::kConstant, 0, 0, 0.999f},
                 {Kind::kConstant, 0, 0, 0.001f}, {Kind::kConstant, 0, 0, 1e-8f}};
  prog.code = {{Op::kMul, 7, 1},   {Op::kMul, 8, 3},   {Op::kAdd, 12, 13},
               {Op::kMul, 9, 2},   {Op::kMul, 3, 3},   {Op::kMul, 10, 16},
               {Op::kAdd, 15, 17}, {Op::kDiv, 14, 5},  {Op::kDiv, 18, 6},
               {Op::kSqrt, 20},    {Op::kAdd, 21, 11}, {Op::kDiv, 19, 22},
               {Op::kMul, 4, 23},  {Op::kSub, 0, 24}};
  prog.outputs = {{25, p}, {14, mu}, {18, nu}};
  return prog;
}

void AdamReference(std::vector<float>& p, std::vector<float>& mu,
                   std::vector<float>& nu, const std::vector<float>& g,
                   float lr, float bc1, float bc2) {
  for (size_t k = 0; k < p.size(); ++k) {
    mu[k] = 0.9f * mu[k] + 0.1f * g[k];
    nu[k] = 0.999f * nu[k] + 0.001f * (g[k] * g[k]);
    p[k] = p[k] - lr * ((mu[k] / bc1) / (std::sqrt(nu[k] / bc2) + 1e-8f));
  }
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(RegisterRunAndWait) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 300'001;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), mu(n), nu(n), g(n);
  for (int64_t k = 0; k < n; ++k) {
    p[k] = normal(rng);
    mu[k] = normal(rng);
    nu[k] = std::fabs(normal(rng));
    g[k] = normal(rng);
  }
  // Spread over both memory tiers: the cxl one is behind a link model,
  // which update programs do not go through.
  const int32_t hp = Put(*pool, TierKind::kHost, p);
  const int32_t hmu = Put(*pool, TierKind::kCxl, mu);
  const int32_t hnu = Put(*pool, TierKind::kCxl, nu);
  const int32_t hg = Put(*pool, TierKind::kHost, g);
  const std::vector<TierStats> tiers_before = pool->objects().Stats();
  CHECK_EQ(pool->updates().update_stats().threads,
           0);  // none until the first run
  StatusOr<int32_t> id =
      pool->updates().RegisterUpdate(Adam(n, hp, hmu, hnu, hg));
  CHECK_OK(id);
  for (int step = 1; step <= 2; ++step) {
    const float lr = 1e-3f, bc1 = 1 - std::pow(0.9f, step),
                bc2 = 1 - std::pow(0.999f, step);
    StatusOr<std::shared_ptr<UpdateRun>> run =
        pool->updates().StartUpdate(*id, {lr, bc1, bc2});
    CHECK_OK(run);
    CHECK_OK((*run)->Wait(kLongWaitNs));
    CHECK((*run)->done());
    CHECK_EQ((*run)->program_id(), *id);
    AdamReference(p, mu, nu, g, lr, bc1, bc2);
  }
  CHECK(SameBits(Get(*pool, hp, n), p));
  CHECK(SameBits(Get(*pool, hmu, n), mu));
  CHECK(SameBits(Get(*pool, hnu, n), nu));
  UpdateStats stats = pool->updates().update_stats();
  CHECK_EQ(stats.runs, 2u);
  CHECK_EQ(stats.failed, 0u);
  CHECK_EQ(stats.elements, 2u * n);
  CHECK_EQ(stats.bytes_read, 2u * n * 16);
  CHECK_EQ(stats.bytes_written, 2u * n * 12);
  CHECK_GT(stats.busy_ns, 0);
  CHECK_EQ(stats.threads, 2);
  // The tiers' link counters count only the Puts and Gets, not the runs.
  const std::vector<TierStats> tiers_after = pool->objects().Stats();
  CHECK_EQ(tiers_after[1].bytes_read - tiers_before[1].bytes_read,
           uint64_t(2 * n * 4));  // the two Gets of mu, nu
  CHECK_EQ(tiers_after[1].bytes_written, tiers_before[1].bytes_written);
  CHECK_OK(pool->updates().ReleaseUpdate(*id));
  CHECK_CODE(pool->updates().StartUpdate(*id, {1, 1, 1}), Code::kNotFound);
  CHECK_CODE(pool->updates().ReleaseUpdate(*id), Code::kNotFound);
}

TEST(RunsAreSplitOverTheWorkersAndKeepTheirOrder) {
  std::shared_ptr<Pool> pool = NewPool(Tiers("", 4));
  const int64_t n = 2'000'000;  // about 30 blocks of 64 Ki elements
  std::vector<float> x = Iota(n, 0.5f);
  const int32_t h = Put(*pool, TierKind::kHost, x);
  StatusOr<int32_t> doubled =
      pool->updates().RegisterUpdate(Affine(n, h, 0.0f));
  StatusOr<int32_t> plus_one =
      pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(doubled);
  CHECK_OK(plus_one);
  // Queued back to back (held, so that they are all queued before any
  // runs): each must see all of the one before it.
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  std::vector<std::shared_ptr<UpdateRun>> runs;
  for (int i = 0; i < 6; ++i) {
    StatusOr<std::shared_ptr<UpdateRun>> run =
        pool->updates().StartUpdate(i % 2 == 0 ? *doubled : *plus_one, {2.0f});
    CHECK_OK(run);
    runs.push_back(*run);
  }
  CHECK(!runs[0]->done());
  CHECK_OK(pool->test_hooks().HoldUpdates(false));
  for (auto& run : runs) CHECK_OK(run->Wait(kLongWaitNs));
  std::vector<float> want = x;
  for (float& v : want) {
    for (int i = 0; i < 3; ++i) v = (v * 2.0f) * 2.0f + 1.0f;
  }
  CHECK(SameBits(Get(*pool, h, n), want));
  // The first run was waiting for workers held back: every worker was free
  // to take its blocks. (The machine's other load may keep some away.)
  int most = 0;
  for (auto& run : runs) most = std::max(most, run->workers());
  CHECK_GT(most, 1);
  CHECK_EQ(pool->updates().update_stats().threads, 4);
}

TEST(IndependentRunsOverlapAndRunsSharingAnObjectWait) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 1000;  // one block each
  const std::vector<float> x = Iota(n), y = Iota(n, 2.0f);
  const int32_t hx = Put(*pool, TierKind::kHost, x);
  const int32_t hy = Put(*pool, TierKind::kHost, y);
  StatusOr<int32_t> on_x = pool->updates().RegisterUpdate(Affine(n, hx, 1.0f));
  StatusOr<int32_t> on_y = pool->updates().RegisterUpdate(Affine(n, hy, 1.0f));
  CHECK_OK(on_x);
  CHECK_OK(on_y);
  auto run_held = [&](std::vector<int32_t> ids) {
    CHECK_OK(pool->test_hooks().HoldUpdates(true));
    std::vector<std::shared_ptr<UpdateRun>> runs;
    for (int32_t id : ids) {
      StatusOr<std::shared_ptr<UpdateRun>> run =
          pool->updates().StartUpdate(id, {2.0f});
      CHECK_OK(run);
      runs.push_back(*run);
    }
    CHECK_OK(pool->test_hooks().HoldUpdates(false));
    for (auto& run : runs) CHECK_OK(run->Wait(kLongWaitNs));
  };
  // The second starts when the first's only block is taken, before the
  // first ends: it shares no object with it.
  run_held({*on_x, *on_y});
  CHECK_EQ(pool->updates().update_stats().overlapped, 1u);
  // Runs on one object: the second waits for the first to end.
  run_held({*on_x, *on_x, *on_y, *on_y});
  // The first run on y overlaps the first on x, as above; a second run
  // may or may not meet the other object's run still under way (timing).
  const uint64_t overlapped = pool->updates().update_stats().overlapped;
  CHECK(overlapped >= 2u && overlapped <= 3u);
  std::vector<float> want_x = x, want_y = y;
  for (float& v : want_x) v = ((v * 2.0f + 1.0f) * 2.0f + 1.0f) * 2.0f + 1.0f;
  for (float& v : want_y) v = ((v * 2.0f + 1.0f) * 2.0f + 1.0f) * 2.0f + 1.0f;
  CHECK(SameBits(Get(*pool, hx, n), want_x));
  CHECK(SameBits(Get(*pool, hy, n), want_y));
}

// Random runs over a few objects in memory and on nvme, each reading two
// and writing one or two of them, queued all at once and then started one
// by one: every object ends as if the runs had run one at a time in the
// order started (bit for bit). Under ThreadSanitizer a run that overlapped
// one it shares a memory object with is also a reported race.
TEST(RandomRunsEndAsTheirOrderStartedSays) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path()));
  const int64_t n = 1'100'000;  // nvme: two staged blocks; memory: eight
  constexpr int kObjects = 6;
  std::mt19937 rng(7);
  std::vector<std::vector<float>> want(kObjects);
  std::vector<int32_t> handles(kObjects);
  for (int k = 0; k < kObjects; ++k) {
    want[k] = Iota(n, 0.001f * (k + 1));
    handles[k] = Put(*pool, k % 2 == 0 ? TierKind::kHost : TierKind::kNvme,
                     want[k]);
  }
  std::uniform_int_distribution<int> pick(0, kObjects - 1);
  struct Step {
    int a, b, w1, w2;  // w2 < 0: one output
    int32_t id;
  };
  std::vector<Step> steps;
  for (int r = 0; r < 32; ++r) {
    Step step{pick(rng), pick(rng), pick(rng), -1, 0};
    if (rng() % 2 == 0) {
      do step.w2 = pick(rng); while (step.w2 == step.w1);
    }
    // w1 <- a * 0.5 + b; w2 <- b * 0.25.
    UpdateProgram p;
    p.num_elements = n;
    p.inputs = {{Kind::kObject, handles[step.a]},
                {Kind::kObject, handles[step.b]},
                {Kind::kConstant, 0, 0, 0.5f},
                {Kind::kConstant, 0, 0, 0.25f}};
    p.code = {{Op::kMul, 0, 2}, {Op::kAdd, 4, 1}, {Op::kMul, 1, 3}};
    p.outputs = {{5, handles[step.w1]}};
    if (step.w2 >= 0) p.outputs.push_back({6, handles[step.w2]});
    StatusOr<int32_t> id = pool->updates().RegisterUpdate(p);
    CHECK_OK(id);
    step.id = *id;
    steps.push_back(step);
  }
  auto reference = [&](const Step& step) {
    const std::vector<float> a = want[step.a], b = want[step.b];
    for (int64_t k = 0; k < n; ++k) {
      const float half = a[k] * 0.5f;
      want[step.w1][k] = half + b[k];
      if (step.w2 >= 0) want[step.w2][k] = b[k] * 0.25f;
    }
  };
  for (bool held : {true, false}) {
    if (held) CHECK_OK(pool->test_hooks().HoldUpdates(true));
    std::vector<std::shared_ptr<UpdateRun>> runs;
    for (const Step& step : steps) {
      StatusOr<std::shared_ptr<UpdateRun>> run =
          pool->updates().StartUpdate(step.id, {});
      CHECK_OK(run);
      runs.push_back(*run);
      reference(step);
    }
    if (held) CHECK_OK(pool->test_hooks().HoldUpdates(false));
    for (auto& run : runs) CHECK_OK(run->Wait(kLongWaitNs));
  }
  for (int k = 0; k < kObjects; ++k) {
    CHECK(SameBits(Get(*pool, handles[k], n), want[k]));
  }
  CHECK_EQ(pool->updates().update_stats().failed, 0u);
}

TEST(PinnedObjectsMakeFreeAndCompactWait) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 10'000;
  const int32_t h = Put(*pool, TierKind::kHost, Iota(n));
  const int32_t other = Put(*pool, TierKind::kHost, Iota(n));
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(id);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  StatusOr<std::shared_ptr<UpdateRun>> run =
      pool->updates().StartUpdate(*id, {3.0f});
  CHECK_OK(run);
  Status freed = pool->objects().Free(h, 20 * kMs);
  CHECK_CODE(freed, Code::kTimeout);
  CHECK_CONTAINS(freed.message(), "handle " + std::to_string(h));
  CHECK_CODE(pool->objects().Compact(20 * kMs), Code::kTimeout);
  CHECK_OK(
      pool->objects().Free(other, kLongWaitNs));  // not the program's: free now
  // Free waits for the run, which then finishes first.
  std::thread release([&] {
    usleep(20'000);
    pool->test_hooks().HoldUpdates(false);
  });
  CHECK_OK(pool->objects().Free(h, kLongWaitNs));
  CHECK_OK((*run)->Wait(kLongWaitNs));  // it ran before the free
  release.join();
  // Its object gone, the program's next start fails, naming it.
  Status started = pool->updates().StartUpdate(*id, {3.0f}).status();
  CHECK_CODE(started, Code::kNotFound);
  CHECK_CONTAINS(started.message(), "handle " + std::to_string(h));
  CHECK_CONTAINS(started.message(),
                 "update program " + std::to_string(*id) + ": input 0");
}

TEST(RegisterAndStartRefuseWhatTheyCannotRun) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path()));
  const int64_t n = 1000;
  const int32_t f32 = Put(*pool, TierKind::kHost, Iota(n));
  StatusOr<int32_t> ints =
      pool->objects().Allocate(TierKind::kHost, n * 4, {n}, "int32");
  StatusOr<int32_t> longer =
      pool->objects().Allocate(TierKind::kCxl, (n + 1) * 4, {n + 1}, "float32");
  StatusOr<int32_t> lying =
      pool->objects().Allocate(TierKind::kHost, n * 2, {n},
                               "float32");  // shape vs bytes
  CHECK_OK(ints);
  CHECK_OK(longer);
  CHECK_OK(lying);
  struct Case {
    int32_t handle;
    Code code;
    std::string want;
  } cases[] = {
      {*ints, Code::kInvalidArgument,
       "holds int32; update programs read and write float32 or bfloat16"},
      {*longer, Code::kInvalidArgument,
       "holds 1001 elements, but the program is for num_elements = 1000"},
      {*lying, Code::kInvalidArgument, "holds 2000 bytes, not the 4000"},
      {12345, Code::kNotFound, "handle 12345 is unknown to pool"},
  };
  for (const Case& c : cases) {
    // As an input, and as an output.
    UpdateProgram in = Affine(n, f32, 1.0f);
    in.inputs.push_back({Kind::kObject, c.handle});
    UpdateProgram out = Affine(n, f32, 1.0f);
    out.outputs.push_back({0, c.handle});
    for (int as_output = 0; as_output < 2; ++as_output) {
      Status status =
          pool->updates().RegisterUpdate(as_output ? out : in).status();
      CHECK_CODE(status, c.code);
      CHECK_CONTAINS(status.message(), c.want);
      CHECK_CONTAINS(status.message(), as_output ? "output 1" : "input 3");
    }
  }
  UpdateProgram none = Affine(n, f32, 1.0f);
  none.outputs.clear();
  CHECK_CONTAINS(pool->updates().RegisterUpdate(none).status().message(),
                 "no outputs");
  UpdateProgram bad = Affine(n, f32, 1.0f);
  bad.code[0].b = 40;
  CHECK_CODE(pool->updates().RegisterUpdate(bad), Code::kInvalidArgument);
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, f32, 1.0f));
  CHECK_OK(id);
  Status wrong = pool->updates().StartUpdate(*id, {1.0f, 2.0f}).status();
  CHECK_CODE(wrong, Code::kInvalidArgument);
  CHECK_CONTAINS(wrong.message(), "takes 1 scalars per run, but got 2");
  CHECK_CODE(pool->updates().StartUpdate(*id + 100, {1.0f}), Code::kNotFound);
  // Another pool's handle is unknown here.
  std::shared_ptr<Pool> other = NewPool(Tiers(""));
  const int32_t foreign = Put(*other, TierKind::kHost, Iota(n));
  CHECK_CODE(pool->updates().RegisterUpdate(Affine(n, foreign, 1.0f)),
             Code::kNotFound);
}

// bf16 objects of n elements from `values`.
int32_t PutBF16(Pool& pool, TierKind tier, const std::vector<float>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<uint16_t> h(n);
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, &values[k], 4);
    h[k] = static_cast<uint16_t>(u >> 16);  // exact: values are bf16s
  }
  StatusOr<int32_t> handle =
      pool.objects().Allocate(tier, n * 2, {n}, "bfloat16");
  CHECK_OK(handle);
  auto ticket = pool.transfers().Write(*handle, h.data(), n * 2, 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  return *handle;
}

std::vector<float> GetBF16(Pool& pool, int32_t handle, int64_t n) {
  std::vector<uint16_t> h(n);
  auto ticket = pool.transfers().Read(handle, h.data(), n * 2, 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  std::vector<float> out(n);
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t u = uint32_t{h[k]} << 16;
    std::memcpy(&out[k], &u, 4);
  }
  return out;
}

TEST(NvmeObjectsGoThroughStaging) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path(), 3));
  // 2.5 Mi elements: two full staging blocks and a tail that ends inside a
  // file block (10 MB and 5 MB are no multiples of 4 KiB).
  const int64_t n = 2'500'000;
  std::vector<float> x = Iota(n, 0.25f), y = Iota(n, -1.0f);
  std::vector<float> w(n);
  for (int64_t k = 0; k < n; ++k) w[k] = static_cast<float>(k % 256);
  const int32_t hx = Put(*pool, TierKind::kNvme, x);    // read and written
  const int32_t hy = Put(*pool, TierKind::kHost, y);    // read
  const int32_t hw = PutBF16(*pool, TierKind::kNvme, w);  // bf16, in place
  StatusOr<int32_t> hz = pool->objects().Allocate(TierKind::kNvme, n * 4, {n},
                                                  "float32");  // written only
  CHECK_OK(hz);
  // x <- x + y; w <- w + 1 (bf16); z <- x * 2 (the old x).
  UpdateProgram p;
  p.num_elements = n;
  p.inputs = {{Kind::kObject, hx}, {Kind::kObject, hy}, {Kind::kObject, hw},
              {Kind::kConstant, 0, 0, 1.0f}, {Kind::kConstant, 0, 0, 2.0f}};
  p.code = {{Op::kAdd, 0, 1}, {Op::kAdd, 2, 3}, {Op::kMul, 0, 4}};
  p.outputs = {{5, hx}, {6, hw}, {7, *hz}};
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(p);
  CHECK_OK(id);
  StatusOr<std::shared_ptr<UpdateRun>> run =
      pool->updates().StartUpdate(*id, {});
  CHECK_OK(run);
  CHECK_OK((*run)->Wait(kLongWaitNs));
  std::vector<float> want_x(n), want_w(n), want_z(n);
  for (int64_t k = 0; k < n; ++k) {
    want_x[k] = x[k] + y[k];
    want_w[k] = w[k] + 1.0f;  // exact in bf16 (at most 256)
    want_z[k] = x[k] * 2.0f;
  }
  CHECK(SameBits(Get(*pool, hx, n), want_x));
  CHECK(SameBits(GetBF16(*pool, hw, n), want_w));
  CHECK(SameBits(Get(*pool, *hz, n), want_z));
  CHECK(SameBits(Get(*pool, hy, n), y));  // untouched
  UpdateStats stats = pool->updates().update_stats();
  CHECK_EQ(stats.bytes_read, uint64_t(n) * (4 + 4 + 2));
  CHECK_EQ(stats.bytes_written, uint64_t(n) * (4 + 2 + 4));
}

TEST(NvmeErrorsFailTheRunNamingTheObject) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path()));
  const int64_t n = 100'000;
  const int32_t h = Put(*pool, TierKind::kNvme, Iota(n));
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(id);
  // The file cut short behind the pool's back: its bytes are lost.
  CHECK_EQ(truncate((dir.path() + "/tier.swap").c_str(), 0), 0);
  StatusOr<std::shared_ptr<UpdateRun>> run =
      pool->updates().StartUpdate(*id, {2.0f});
  CHECK_OK(run);
  Status status = (*run)->Wait(kLongWaitNs);
  CHECK_CODE(status, Code::kIo);
  CHECK_CONTAINS(status.message(), "program " + std::to_string(*id));
  CHECK_CONTAINS(status.message(), "reading handle " + std::to_string(h));
  CHECK_EQ(pool->updates().update_stats().failed, 1u);
}

TEST(CloseWaitsForARunInFlight) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 50'000;
  const int32_t h = Put(*pool, TierKind::kHost, Iota(n));
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(id);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  StatusOr<std::shared_ptr<UpdateRun>> run =
      pool->updates().StartUpdate(*id, {2.0f});
  CHECK_OK(run);
  std::thread release([&] {
    usleep(30'000);
    pool->test_hooks().HoldUpdates(false);
  });
  CHECK_OK(pool->Close(kLongWaitNs));  // waited for the run
  release.join();
  CHECK((*run)->done());
  CHECK_OK((*run)->Wait(0));
  CHECK_EQ(pool->updates().update_stats().runs, 1u);  // kept past Close
  CHECK_CODE(pool->updates().StartUpdate(*id, {2.0f}), Code::kClosed);
  CHECK_CODE(pool->updates().RegisterUpdate(Affine(n, h, 1.0f)), Code::kClosed);
}

TEST(CloseFailsRunsPastItsTimeout) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 50'000;
  const int32_t h = Put(*pool, TierKind::kHost, Iota(n));
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(id);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  auto first = pool->updates().StartUpdate(*id, {2.0f});
  auto second = pool->updates().StartUpdate(*id, {2.0f});
  CHECK_OK(first);
  CHECK_OK(second);
  CHECK_CODE(pool->Close(20 * kMs), Code::kTimeout);
  Status a = (*first)->Wait(kLongWaitNs), b = (*second)->Wait(kLongWaitNs);
  CHECK_CODE(a, Code::kClosed);
  CHECK_CONTAINS(a.message(), "the pool was closed while it ran");
  CHECK_CODE(b, Code::kClosed);
  CHECK_CONTAINS(b.message(), "the pool was closed before it ran");
}

TEST(AWaitThatTimesOutSaysSoAndTheRunGoesOn) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 5'000;
  const int32_t h = Put(*pool, TierKind::kHost, Iota(n));
  StatusOr<int32_t> id = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  CHECK_OK(id);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  auto run = pool->updates().StartUpdate(*id, {2.0f});
  CHECK_OK(run);
  Status waited = (*run)->Wait(5 * kMs);
  CHECK_CODE(waited, Code::kTimeout);
  CHECK_CONTAINS(waited.message(), "of program " + std::to_string(*id));
  CHECK_CONTAINS(waited.message(), "did not finish within 5 ms");
  CHECK_OK(pool->test_hooks().HoldUpdates(false));
  CHECK_OK((*run)->Wait(kLongWaitNs));
}

TEST(ConcurrentStartersFreersAndAllocators) {
  std::shared_ptr<Pool> pool = NewPool(Tiers("", 3));
  const int64_t n = 40'000;
  constexpr int kThreads = 3;
  constexpr int kRuns = 20;
  std::vector<int32_t> objects;
  std::vector<int32_t> programs;
  for (int t = 0; t < kThreads; ++t) {
    objects.push_back(Put(*pool, TierKind::kHost, std::vector<float>(n, 0)));
    StatusOr<int32_t> id =
        pool->updates().RegisterUpdate(Affine(n, objects[t], 1.0f));
    CHECK_OK(id);
    programs.push_back(*id);
  }
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRuns; ++r) {
        auto run = pool->updates().StartUpdate(programs[t], {1.0f});
        if (!run.ok() || !(*run)->Wait(kLongWaitNs).ok()) failed = true;
      }
    });
  }
  threads.emplace_back([&] {  // churn next to the runs
    for (int i = 0; i < 50; ++i) {
      StatusOr<int32_t> h = pool->objects().Allocate(TierKind::kHost, 64 * kKiB,
                                                     {16 * 1024}, "float32");
      if (!h.ok() || !pool->objects().Free(*h, kLongWaitNs).ok()) failed = true;
      (void)pool->updates().update_stats();
    }
  });
  for (std::thread& thread : threads) thread.join();
  CHECK(!failed);
  for (int t = 0; t < kThreads; ++t) {
    for (float v : Get(*pool, objects[t], n)) CHECK_EQ(v, float(kRuns));
  }
  CHECK_EQ(pool->updates().update_stats().runs, uint64_t(kThreads * kRuns));
}

// bfloat16 of a float32, round to nearest even (the copies' conversion).
uint16_t Bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet, its sign kept
    return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

bool CopyHolds(Pool& pool, int32_t copy, const std::vector<float>& source) {
  const int64_t n = static_cast<int64_t>(source.size());
  std::vector<uint16_t> got(n);
  StatusOr<std::shared_ptr<Ticket>> ticket =
      pool.transfers().Read(copy, got.data(), n * 2, 0, 0, 0);
  CHECK_OK(ticket);
  CHECK_OK((*ticket)->Wait(kLongWaitNs));
  for (int64_t k = 0; k < n; ++k) {
    if (got[k] != Bf16(source[k])) return false;
  }
  return true;
}

TEST(CopiesFollowTheirSourceWhateverWritesIt) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path()));
  const int64_t n = 100'003;
  for (TierKind tier : {TierKind::kHost, TierKind::kCxl, TierKind::kNvme}) {
    std::vector<float> w = Iota(n, 0.37f);
    const int32_t source = Put(*pool, tier, w);
    StatusOr<int32_t> copy = pool->updates().AllocateCopy(source, "bfloat16");
    CHECK_OK(copy);
    StatusOr<ObjectInfo> info = pool->objects().Info(*copy);
    CHECK_OK(info);
    CHECK_EQ(info->copy_of, source);
    CHECK_EQ(info->tier, tier);
    CHECK(CopyHolds(*pool, *copy, w));  // made on its first read
    // A write of part of the source.
    std::vector<float> part(1000, -3.25f);
    auto ticket = pool->transfers().Write(source, part.data(), 4000, 400, 0, 0);
    CHECK_OK(ticket);
    CHECK_OK((*ticket)->Wait(kLongWaitNs));
    std::fill(w.begin() + 100, w.begin() + 1100, -3.25f);
    CHECK(CopyHolds(*pool, *copy, w));
    // A program writing the source and the copy from one register leaves
    // the copy fresh: reading it runs nothing more.
    const int32_t g = Put(*pool, tier, std::vector<float>(n, 0.5f));
    UpdateProgram both;
    both.num_elements = n;
    both.inputs = {{Kind::kObject, source}, {Kind::kObject, g}};
    both.code = {{Op::kSub, 0, 1}};
    both.outputs = {{2, source}, {2, *copy}};
    StatusOr<int32_t> id = pool->updates().RegisterUpdate(both);
    CHECK_OK(id);
    auto run = pool->updates().StartUpdate(*id, {});
    CHECK_OK(run);
    CHECK_OK((*run)->Wait(kLongWaitNs));
    for (float& x : w) x -= 0.5f;
    const uint64_t runs = pool->updates().update_stats().runs;
    CHECK(CopyHolds(*pool, *copy, w));
    CHECK_EQ(pool->updates().update_stats().runs, runs);
    // One writing only the source leaves it stale, refreshed when read.
    UpdateProgram only = both;
    only.outputs = {{2, source}};
    StatusOr<int32_t> only_id = pool->updates().RegisterUpdate(only);
    CHECK_OK(only_id);
    run = pool->updates().StartUpdate(*only_id, {});
    CHECK_OK(run);
    CHECK_OK((*run)->Wait(kLongWaitNs));
    for (float& x : w) x -= 0.5f;
    CHECK(CopyHolds(*pool, *copy, w));
    CHECK_EQ(pool->updates().update_stats().runs, runs + 2);
    // Nothing else writes a copy.
    std::vector<uint16_t> zeros(n);
    CHECK_CODE(pool->transfers().Write(*copy, zeros.data(), n * 2, 0, 0, 0),
               Code::kInvalidArgument);
    UpdateProgram other = both;
    other.outputs = {{2, source}, {0, *copy}};
    CHECK_CODE(pool->updates().RegisterUpdate(other), Code::kInvalidArgument);
    CHECK_CODE(pool->updates().AllocateCopy(*copy, "bfloat16"),
               Code::kInvalidArgument);
    CHECK_CODE(pool->updates().AllocateCopy(source, "float16"),
               Code::kInvalidArgument);
    CHECK_OK(pool->updates().ReleaseUpdate(*id));
    CHECK_OK(pool->updates().ReleaseUpdate(*only_id));
    // A copy of a freed source can no longer be read.
    CHECK_OK(pool->objects().Free(source, kLongWaitNs));
    CHECK_CODE(pool->transfers().Read(*copy, zeros.data(), n * 2, 0, 0, 0),
               Code::kNotFound);
    CHECK_OK(pool->objects().Free(*copy, kLongWaitNs));
    CHECK_OK(pool->objects().Free(g, kLongWaitNs));
  }
}

TEST(ReadersOfAStaleCopyShareOneRefresh) {
  // Several readers of a copy whose source was just written (under
  // ThreadSanitizer): one refresh serves them all, and none writes the
  // copy while another reads it.
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 50'000;
  const int32_t source = Put(*pool, TierKind::kHost, std::vector<float>(n, 0));
  StatusOr<int32_t> copy = pool->updates().AllocateCopy(source, "bfloat16");
  CHECK_OK(copy);
  std::atomic<bool> failed{false};
  for (int round = 1; round <= 20; ++round) {
    std::vector<float> v(n, static_cast<float>(round));
    auto ticket = pool->transfers().Write(source, v.data(), n * 4, 0, 0, 0);
    CHECK_OK(ticket);
    CHECK_OK((*ticket)->Wait(kLongWaitNs));
    std::vector<std::thread> readers;
    for (int r = 0; r < 3; ++r) {
      readers.emplace_back([&] {
        if (!CopyHolds(*pool, *copy, v)) failed = true;
      });
    }
    for (std::thread& t : readers) t.join();
  }
  CHECK(!failed);
  CHECK_GE(pool->updates().update_stats().runs, 20u);  // one a round at least
}

// z <- x * s0 + c: reads x, writes z.
UpdateProgram AffineInto(int64_t n, int32_t x, int32_t z, float c) {
  UpdateProgram p = Affine(n, x, c);
  p.outputs = {{4, z}};
  return p;
}

// A run may outlive the step that started it: a read of what it writes
// and a write of what it reads wait for it, whatever thread asks.
TEST(TransfersWaitForTheRunsTheyFollow) {
  std::shared_ptr<Pool> pool = NewPool(Tiers(""));
  const int64_t n = 50'000;
  const std::vector<float> x = Iota(n), g = Iota(n, 0.5f);
  const int32_t hx = Put(*pool, TierKind::kHost, x);
  const int32_t hg = Put(*pool, TierKind::kCxl, g);
  const int32_t hz = Put(*pool, TierKind::kCxl, std::vector<float>(n, 0.0f));
  StatusOr<int32_t> on_x = pool->updates().RegisterUpdate(Affine(n, hx, 1.0f));
  StatusOr<int32_t> g_to_z =
      pool->updates().RegisterUpdate(AffineInto(n, hg, hz, 3.0f));
  CHECK_OK(on_x);
  CHECK_OK(g_to_z);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  StatusOr<std::shared_ptr<UpdateRun>> a =
      pool->updates().StartUpdate(*on_x, {2.0f});
  StatusOr<std::shared_ptr<UpdateRun>> b =
      pool->updates().StartUpdate(*g_to_z, {2.0f});
  CHECK_OK(a);
  CHECK_OK(b);
  std::vector<float> read_x;
  const std::vector<float> new_g(n, 7.0f);
  std::thread reader([&] { read_x = Get(*pool, hx, n); });
  std::thread writer([&] {
    StatusOr<std::shared_ptr<Ticket>> ticket =
        pool->transfers().Write(hg, new_g.data(), n * 4, 0, 0, 0);
    CHECK_OK(ticket);
    CHECK_OK((*ticket)->Wait(kLongWaitNs));
  });
  // Held: without the wait, both would be done with the old bytes by now.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(!(*a)->done());
  CHECK(!(*b)->done());
  CHECK_OK(pool->test_hooks().HoldUpdates(false));
  reader.join();
  writer.join();
  std::vector<float> want_x = x, want_z = g;
  for (float& v : want_x) v = v * 2.0f + 1.0f;
  for (float& v : want_z) v = v * 2.0f + 3.0f;
  CHECK(SameBits(read_x, want_x));
  CHECK(SameBits(Get(*pool, hz, n), want_z));  // from g before the write
  CHECK(SameBits(Get(*pool, hg, n), new_g));
  CHECK_OK(pool->updates().WaitForRuns(kLongWaitNs));
}

// A queued run a transfer waits for goes first, with the queued runs it
// follows (on a shared object) still before it; the others keep their
// order, and the objects end as the order started says.
TEST(ARunATransferWaitsForIsPromotedWithWhatItFollows) {
  std::shared_ptr<Pool> pool = NewPool(Tiers("", /*update_threads=*/1));
  const int64_t n = 1000;
  std::vector<int32_t> h;
  for (int k = 0; k < 5; ++k) {
    h.push_back(Put(*pool, TierKind::kHost, Iota(n, 1.0f + k)));
  }
  // w, then x, y, x -> z, v.
  std::vector<int32_t> ids;
  for (UpdateProgram p : {Affine(n, h[0], 1.0f), Affine(n, h[1], 1.0f),
                          Affine(n, h[2], 1.0f), AffineInto(n, h[1], h[3], 2.0f),
                          Affine(n, h[4], 1.0f)}) {
    StatusOr<int32_t> id = pool->updates().RegisterUpdate(std::move(p));
    CHECK_OK(id);
    ids.push_back(*id);
  }
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  std::vector<std::shared_ptr<UpdateRun>> runs;
  for (int32_t id : ids) {
    StatusOr<std::shared_ptr<UpdateRun>> run =
        pool->updates().StartUpdate(id, {2.0f});
    CHECK_OK(run);
    runs.push_back(*run);
  }
  // The first is under way (held); the rest queued in order.
  auto id = [&](int k) { return runs[k]->id(); };
  CHECK(pool->test_hooks().QueuedRuns() ==
        (std::vector<uint64_t>{id(1), id(2), id(3), id(4)}));
  pool->test_hooks().PromoteRun(id(3));
  CHECK(pool->test_hooks().QueuedRuns() ==
        (std::vector<uint64_t>{id(1), id(3), id(2), id(4)}));
  pool->test_hooks().PromoteRun(id(4));
  CHECK(pool->test_hooks().QueuedRuns() ==
        (std::vector<uint64_t>{id(4), id(1), id(3), id(2)}));
  pool->test_hooks().PromoteRun(id(0));  // under way: nothing moves
  CHECK(pool->test_hooks().QueuedRuns() ==
        (std::vector<uint64_t>{id(4), id(1), id(3), id(2)}));
  CHECK_OK(pool->test_hooks().HoldUpdates(false));
  for (auto& run : runs) CHECK_OK(run->Wait(kLongWaitNs));
  std::vector<float> x = Iota(n, 2.0f), z = x;
  for (float& v : x) v = v * 2.0f + 1.0f;
  for (size_t k = 0; k < z.size(); ++k) z[k] = x[k] * 2.0f + 2.0f;
  CHECK(SameBits(Get(*pool, h[1], n), x));
  CHECK(SameBits(Get(*pool, h[3], n), z));  // from x once updated
}

// A run that fails leaves what it writes unreadable, by name, and the
// queued runs that follow it on an object are not run; others run. A
// write of the whole object makes it readable again.
TEST(AFailedRunSkipsItsFollowersAndItsObjectsFailReads) {
  TempDir dir;
  std::shared_ptr<Pool> pool = NewPool(Tiers(dir.path()));
  const int64_t n = 100'000;
  const int32_t h = Put(*pool, TierKind::kNvme, Iota(n));
  const int32_t hz = Put(*pool, TierKind::kHost, std::vector<float>(n, 0.0f));
  const int32_t hx = Put(*pool, TierKind::kHost, Iota(n, 3.0f));
  StatusOr<int32_t> on_h = pool->updates().RegisterUpdate(Affine(n, h, 1.0f));
  StatusOr<int32_t> h_to_z =
      pool->updates().RegisterUpdate(AffineInto(n, h, hz, 1.0f));
  StatusOr<int32_t> z_to_z = pool->updates().RegisterUpdate(Affine(n, hz, 1.0f));
  StatusOr<int32_t> on_x = pool->updates().RegisterUpdate(Affine(n, hx, 1.0f));
  CHECK_OK(on_h);
  CHECK_OK(h_to_z);
  CHECK_OK(z_to_z);
  CHECK_OK(on_x);
  CHECK_EQ(truncate((dir.path() + "/tier.swap").c_str(), 0), 0);
  CHECK_OK(pool->test_hooks().HoldUpdates(true));
  std::vector<std::shared_ptr<UpdateRun>> runs;
  for (int32_t id : {*on_h, *h_to_z, *z_to_z, *on_x}) {
    StatusOr<std::shared_ptr<UpdateRun>> run =
        pool->updates().StartUpdate(id, {2.0f});
    CHECK_OK(run);
    runs.push_back(*run);
  }
  CHECK_OK(pool->test_hooks().HoldUpdates(false));
  CHECK_CODE(runs[0]->Wait(kLongWaitNs), Code::kIo);
  for (int k : {1, 2}) {  // z from h, then z from z: neither runs
    Status skipped = runs[k]->Wait(kLongWaitNs);
    CHECK(!skipped.ok());
    CHECK_CONTAINS(skipped.message(), "not run");
    CHECK_CONTAINS(skipped.message(), "reading handle " + std::to_string(h));
  }
  CHECK_OK(runs[3]->Wait(kLongWaitNs));
  std::vector<float> out(n);
  for (int32_t bad : {h, hz}) {
    StatusOr<std::shared_ptr<Ticket>> read =
        pool->transfers().Read(bad, out.data(), n * 4, 0, 0, 0);
    CHECK(!read.ok());
    CHECK_CONTAINS(read.status().message(), "cannot be read");
  }
  StatusOr<std::shared_ptr<UpdateRun>> refused =
      pool->updates().StartUpdate(*z_to_z, {2.0f});
  CHECK(!refused.ok());
  CHECK_CONTAINS(refused.status().message(), "cannot be used");
  // A part rewritten is not enough; the whole object is.
  const std::vector<float> fresh = Iota(n, 5.0f);
  StatusOr<std::shared_ptr<Ticket>> part =
      pool->transfers().Write(hz, fresh.data(), 4096, 0, 0, 0);
  CHECK_OK(part);
  CHECK_OK((*part)->Wait(kLongWaitNs));
  CHECK(!pool->transfers().Read(hz, out.data(), n * 4, 0, 0, 0).ok());
  StatusOr<std::shared_ptr<Ticket>> whole =
      pool->transfers().Write(hz, fresh.data(), n * 4, 0, 0, 0);
  CHECK_OK(whole);
  CHECK_OK((*whole)->Wait(kLongWaitNs));
  CHECK(SameBits(Get(*pool, hz, n), fresh));
  std::vector<float> want_x = Iota(n, 3.0f);
  for (float& v : want_x) v = v * 2.0f + 1.0f;
  CHECK(SameBits(Get(*pool, hx, n), want_x));
}

TEST(CpuListsParse) {
  CHECK(numa::ParseCpuList("0-3,8,10-11\n") ==
        (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  CHECK(numa::ParseCpuList("") == std::vector<int>{});
  CHECK(numa::ParseCpuList("3-1") == std::vector<int>{});
  CHECK(numa::ParseCpuList("x") == std::vector<int>{});
  CHECK(!numa::AllowedCpus().empty());
  // This machine's nodes with CPUs hold only allowed CPUs.
  for (const auto& [node, cpus] : numa::AllowedCpusByNode()) {
    CHECK_GE(node, 0);
    CHECK(!cpus.empty());
  }
}

TEST(DefaultWorkersAreOnePerCpuAndMoreWithAnNvmeTier) {
  TempDir dir;
  const int cpus = std::clamp(static_cast<int>(numa::AllowedCpus().size()),
                              1, kMaxDefaultUpdateThreads);
  for (bool nvme : {false, true}) {
    std::shared_ptr<Pool> pool = NewPool(Tiers(nvme ? dir.path() : "", 0));
    const int32_t h = Put(*pool, TierKind::kHost, Iota(1000));
    StatusOr<int32_t> id =
        pool->updates().RegisterUpdate(Affine(1000, h, 1.0f));
    CHECK_OK(id);
    StatusOr<std::shared_ptr<UpdateRun>> run =
        pool->updates().StartUpdate(*id, {2.0f});
    CHECK_OK(run);
    CHECK_OK((*run)->Wait(kLongWaitNs));
    CHECK_EQ(pool->updates().update_stats().threads,
             nvme ? std::max(cpus, kMinStagingUpdateThreads) : cpus);
  }
}

TEST(NegativeUpdateThreadsAreRefused) {
  PoolConfig config = Tiers("", -1);
  CHECK_CODE(Pool::Create(config), Code::kInvalidArgument);
}

}  // namespace
}  // namespace jcxl

JCXL_TEST_MAIN()
