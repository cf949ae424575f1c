r"""Train a byte-level GPT-2 whose weights and Adam state live in the pool.

The model's parameters and optax adamw state are placed in one tier of a
``jcxl.Pool`` (by default ``cxl``, emulated on DRAM behind a link model where
the machine has no CXL memory) and the train step is rewritten by
``jcxl.cxl_offload`` to stream them in layer by layer, under a device memory
budget smaller than the parameters and optimizer state together. The data are
bytes of the Python standard library's sources (``models/data.py``), so
nothing is downloaded. ``--mode=resident`` trains the same model with plain
``jax.jit`` and everything on the device, as the baseline: for the same
--seed the two modes compute the same losses.

Before training the program compiles the resident step (state donated) to
read its device memory need from ``memory_analysis()``, and logs it next to
the offloaded step's need and the budget. Every --log_every steps it prints
the step, the train loss (mean since the last line), tokens per second, the
stall share (time the step waited for transfers, from ``step.report()``,
over wall time) and the bytes streamed; every line names the tier the state
is in with the pool's own label (for an emulated cxl tier: EMULATED and the
link). The validation loss is computed every --eval_every steps and at the
end by an offloaded forward step (weights streamed, never all on the
device).

The run directory gets config.json (flags, emulation, machine),
metrics.jsonl and metrics.csv, plan.txt and plan.json (the streaming plan),
summary.json, and loss.png, throughput.png and layer_stall.png.

With --checkpoint_every=N it saves the params, the adamw state (with its
step count), the step and the data position every N steps into
<run_dir>/checkpoints/<step> (``jcxl.checkpoint``: Orbax's format, streamed
from the pool, written atomically; the newest --keep_checkpoints are kept).
--resume continues from the latest of them (--resume=PATH: from that
checkpoint), exactly: the training batches' random generator, seeded by
--seed, is replayed to the data position, and the resumed run computes the
losses the uninterrupted one would have:

  python -m experiments.train --checkpoint_every=50 --run_dir=runs/a
  python -m experiments.train --checkpoint_every=50 --run_dir=runs/a --resume

On several processes (hosts) every process runs the same command with
--coordinator_address, --num_processes and --process_id (or the environment
variables JCXL_COORDINATOR_ADDRESS, JCXL_NUM_PROCESSES, JCXL_PROCESS_ID, or
--distributed alone where JAX detects the cluster); see experiments/cluster.py.
With more than one device in all (--cpu_devices=N gives N CPU devices), the
state is sharded FSDP-style over every device of every process, each process
keeping its shards in its own pool, and the batch's rows over the devices;
process 0 prints and writes the run directory, and every process writes
process-<i>.json (its devices, shard bytes and pool). A process that fails
stops the others (jcxl.distributed.fail_together); one that dies is noticed
after --heartbeat_timeout_s.

  python -m experiments.train --model=gpt2-tiny --batch=8 \
      --cpu_devices=4 --coordinator_address=127.0.0.1:12345 \
      --num_processes=2 --process_id=0     # and --process_id=1 beside it

Command line (the defaults; about 2.5 minutes on a 2-core machine):

  python -m experiments.train --model=byte-gpt --steps=200 --batch=4 \
      --seq_len=64 --learning_rate=3e-3 --warmup_steps=20 --eval_every=50 \
      --eval_batches=8 --seed=0 --mode=cxl --tier=cxl --schedule=fixed:1 \
      --device_budget=72MiB --link_bandwidth=16GB/s --link_latency_us=2 \
      --log_every=10 --data_bytes=4MiB --run_dir=runs/train-<timestamp> \
      --checkpoint_every=0 --keep_checkpoints=2 --heartbeat_timeout_s=30

The program is split as flax's examples are: ``config`` (flags, models,
validation), ``runners`` (the resident and the offloaded steps and their
state), ``metrics`` (logged rows, progress lines, summary),
``checkpointing`` and ``trainer`` (the run and its loop).
"""

from experiments import common as _common
from experiments.train.config import CLUSTER as CLUSTER
from experiments.train.config import Config as Config
from experiments.train.config import FLAGS as FLAGS
from experiments.train.config import MODELS as MODELS
from experiments.train.config import RESUME_LATEST as RESUME_LATEST
from experiments.train.config import config_from_flags as config_from_flags
from experiments.train.trainer import main as main
from experiments.train.trainer import run as run

parse_flags = _common.flags_parser(FLAGS, __doc__)

__all__ = ["CLUSTER", "Config", "FLAGS", "MODELS", "RESUME_LATEST",
           "config_from_flags", "main", "parse_flags", "run"]
