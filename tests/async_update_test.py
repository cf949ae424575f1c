"""cxl_offload(update='host', async_update=True): the step returns while its
host updates run; whatever uses their objects next (the next step's fetches
and stores, ``pool.get``) waits for them. The values are the synchronous
step's, bit for bit, and a failed update fails what reads its objects."""

from __future__ import annotations

import os
import threading
import time

from experiments.common import make_train_step as make_step
import jax
import jcxl
import numpy as np
import optax
import pytest

from tests.host_update_test import OPTIMIZERS
from tests.host_update_test import _bf16_compute
from tests.host_update_test import batches
from tests.host_update_test import mlp

STEPS = 8
# Steps at which the update workers are held as the step is called: it
# must return with none of its runs done, and what comes next (the next
# step, the final read) must wait for them.
HELD = (3, STEPS - 1)
_RELEASE_AFTER_S = 0.2


def train(pool, params, loss_fn, tx, data, tier, async_update, held=()):
  """The losses and the final state (read at once, with ``gather``)."""
  step = jcxl.cxl_offload(make_step(loss_fn, tx), update="host",
                          async_update=async_update)
  p = jcxl.place(params, tier, pool=pool)
  s = jcxl.place(tx.init(params), tier, pool=pool)
  losses, releases = [], []
  for i, x in enumerate(data):
    if i in held:
      pool.updates.wait()
      runs = pool.updates.stats().runs
      pool.updates._hold(True)
      p, s, loss = step(p, s, x)
      loss = float(loss)
      # Returned with its updates queued: none ran.
      assert pool.updates.stats().runs == runs
      release = threading.Thread(target=_release, args=(pool,))
      release.start()
      releases.append(release)
    else:
      p, s, loss = step(p, s, x)
      loss = float(loss)
    losses.append(loss)
  state = jcxl.gather((p, s))  # waits for the last step's updates
  for release in releases:
    release.join()
  return losses, state


def _release(pool):
  time.sleep(_RELEASE_AFTER_S)
  pool.updates._hold(False)


def assert_async_is_sync(pool, params, loss_fn, tx, data, tier):
  """The same losses and final state, bit for bit, with and without
  async_update (held where HELD says)."""
  want = train(pool, params, loss_fn, tx(), data, tier, async_update=False)
  got = train(pool, params, loss_fn, tx(), data, tier, async_update=True,
              held=HELD)
  assert got[0] == want[0]
  for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]),
                  strict=True):
    np.testing.assert_array_equal(x, y)


class AsyncUpdateTest:

  @pytest.mark.parametrize("name", sorted(OPTIMIZERS))
  @pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
  def test_equals_the_synchronous_step(self, name, scan):
    params, loss_fn = mlp(scan)
    data = batches(STEPS)
    with jcxl.Pool(host="64MiB", cxl="256MiB") as pool:
      assert_async_is_sync(pool, params, loss_fn, OPTIMIZERS[name], data,
                           "cxl")

  @pytest.mark.parametrize("name", ["adam", "clip_adamw", "sgd_momentum"])
  def test_nvme_state_with_bfloat16_copies(self, name, tmp_path):
    params, loss_fn = mlp(scan=False)
    bf16_loss = _bf16_compute(loss_fn)
    data = batches(STEPS)
    with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      assert_async_is_sync(pool, params, bf16_loss, OPTIMIZERS[name], data,
                           "nvme")

  def test_a_failed_update_fails_what_reads_its_objects(self, tmp_path):
    params, loss_fn = mlp(scan=False)
    tx = optax.adam(1e-2)
    data = batches(3)
    with jcxl.Pool(host="64MiB", cxl="64MiB", nvme="64MiB",
                   nvme_dir=tmp_path) as pool:
      step = jcxl.cxl_offload(make_step(loss_fn, tx), update="host",
                              async_update=True)
      p = jcxl.place(params, "nvme", pool=pool)
      s = jcxl.place(tx.init(params), "nvme", pool=pool)
      p, s, _ = step(p, s, data[0])
      pool.updates.wait()
      pool.updates._hold(True)
      p, s, loss = step(p, s, data[1])
      float(loss)  # the step is over; its updates wait
      # The state's bytes lost behind the pool's back, under the updates.
      os.truncate(os.path.join(pool.nvme_dir, "tier.swap"), 0)
      pool.updates._hold(False)
      pool.updates.wait()
      assert pool.updates.stats().failed > 0
      with pytest.raises(ValueError, match="cannot be read: .*update run"):
        pool.get(p["layer0"]["w"].local_handles[0][1])
      # The next step refuses rather than train on what is left.
      with pytest.raises(jax.errors.JaxRuntimeError,
                         match="cannot be read: update run"):
        float(step(p, s, data[2])[2])

  def test_async_update_must_be_a_bool(self):
    with pytest.raises(TypeError, match="async_update must be True or False"):
      jcxl.cxl_offload(lambda p: p, async_update="yes")
