r"""What DAP's tuning costs, on models it was not designed around.

For each model (configs other than those of experiments/dap.py), with its
parameters and adamw state in an EMULATED cxl tier:

* the first compile: the offloaded step's (trace, rewrite, XLA compile)
  over the resident ``jax.jit`` step's, both for the same arguments;
* DAP's tuning, from the first step until it settles: the steps (and of
  them those that ran the plan before while the next plans compiled on
  the compiling thread), the plans compiled and their compile seconds,
  and which limit, if any, settled it (see jcxl/_src/schedules/tuner.py);
* then --steps steps of DAP and of each fixed prefetch distance, in
  interleaved rounds (--block_steps steps of each a round, the last
  timed, in a shuffled order): DAP's step over the best fixed distance's
  (the lowest median), paired round by round, with a 90% bootstrap
  interval. DAP is slower beyond the machine's noise where the whole
  interval lies above 1.

The fixed distances compile before DAP's first step, so that DAP's
compiling thread competes with none of them. Writes --json_out.

  nice -n 10 python -m experiments.dap_cost --models=llama,vit,gpt2_deep \
      --steps=200 --json_out=runs/dap_cost.json
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import optax

import jcxl
from experiments import common as exp_common
from experiments import flags as shared_flags
from experiments import host_allocator
from jcxl.units import parse_bandwidth
from jcxl.units import parse_bytes
from models import common
from models import gpt2
from models import llama
from models import mlp
from models import vit

FLAGS = flags.FlagValues()

# Configs experiments/dap.py does not use (it runs a GPT-2 with a large
# vocabulary and MLPs whose blocks differ in width).
MODELS = {
    # Grouped-query attention, SwiGLU, rotary embeddings.
    "llama": (lambda: llama.tiny(vocab_size=512, dim=96, n_layers=3,
                                 n_heads=4, n_kv_heads=2, ffn_dim=256),
              llama, dict(batch_size=4, seq_len=64)),
    # Patches of 4x4: a long sequence for its width.
    "vit": (lambda: vit.tiny(image_size=32, patch_size=4, dim=64, depth=3,
                             num_heads=4, mlp_dim=192), vit,
            dict(batch_size=8)),
    # Narrow and deep, with a byte vocabulary.
    "gpt2_deep": (lambda: gpt2.tiny(n_embd=64, n_layer=6, n_head=4), gpt2,
                  dict(batch_size=4)),
    # Equal blocks, compute-heavy for their bytes.
    "mlp_even": (lambda: mlp.MLPConfig(in_dim=256, widths=(256,) * 6,
                                       out_dim=256), mlp,
                 dict(batch_size=256)),
}
FIXED = ("sync", "fixed:1", "fixed:2")

_MODELS = flags.DEFINE_list("models", ["llama", "vit", "gpt2_deep"],
                            f"models, of {sorted(MODELS)}", flag_values=FLAGS)
_FIXED = flags.DEFINE_list("fixed", list(FIXED), "fixed schedules DAP is "
                           "compared with", flag_values=FLAGS)
_STEPS = shared_flags.steps(
    FLAGS, default=200, help_text="steps of DAP (and of each fixed "
    "schedule) after DAP settled, in rounds of --block_steps each")
_BLOCK_STEPS = flags.DEFINE_integer(
    "block_steps", 2, "steps each schedule runs back to back a round, the "
    "last timed", flag_values=FLAGS)
_BANDWIDTH = shared_flags.link_bandwidth(FLAGS, default="2GB/s")
_LATENCY_US = shared_flags.link_latency_us(FLAGS)
_BUDGET = shared_flags.device_budget(FLAGS, default="1GiB")
_MAX_TUNING_STEPS = flags.DEFINE_integer(
    "max_tuning_steps", None, "DAP's tuning step limit (default: the "
    "tuner's)", flag_values=FLAGS)
_MAX_COMPILE_S = flags.DEFINE_float(
    "max_compile_s", None, "DAP's compile limit in seconds (default: the "
    "tuner's)", flag_values=FLAGS)
_JSON_OUT = shared_flags.json_out(FLAGS, default="runs/dap_cost.json")


@dataclasses.dataclass(frozen=True)
class Config:
  models: tuple[str, ...]
  fixed: tuple[str, ...]
  steps: int
  block_steps: int
  bandwidth: float
  latency_s: float
  device_budget: int
  max_tuning_steps: int | None
  max_compile_s: float | None
  json_out: str

  def validate(self) -> None:
    for m in self.models:
      if m not in MODELS:
        raise ValueError(f"--models: unknown model {m!r}; known: "
                         f"{sorted(MODELS)}")
    if not self.models or not self.fixed:
      raise ValueError("--models and --fixed must name at least one each")
    for s in self.fixed:
      if not (s == "sync" or s.startswith("fixed:")):
        raise ValueError(f"--fixed: {s!r} is not 'sync' or 'fixed:k'")
      jcxl.cxl_offload(lambda: None, schedule=s)  # raises on a bad one
    if self.steps < self.block_steps or self.block_steps < 1:
      raise ValueError("--block_steps must be >= 1 and --steps at least "
                       f"--block_steps, got {self.block_steps} and "
                       f"{self.steps}")
    exp_common.check_json_out(self.json_out, "runs/dap_cost.json")
    # The tuner's own checks name what is wrong with a limit.
    self.tuner_options(jcxl.planning.TunerOptions())

  def tuner_options(self, options: jcxl.planning.TunerOptions
                    ) -> jcxl.planning.TunerOptions:
    """`options` with the limits these flags set."""
    changes = {}
    if self.max_tuning_steps is not None:
      changes["max_tuning_steps"] = self.max_tuning_steps
    if self.max_compile_s is not None:
      changes["max_compile_s"] = self.max_compile_s
    return dataclasses.replace(options, **changes)


def config_from_flags() -> Config:
  return Config(
      models=tuple(_MODELS.value), fixed=tuple(_FIXED.value),
      steps=_STEPS.value, block_steps=_BLOCK_STEPS.value,
      bandwidth=parse_bandwidth(_BANDWIDTH.value, name="--link_bandwidth"),
      latency_s=_LATENCY_US.value * 1e-6,
      device_budget=parse_bytes(_BUDGET.value, name="--device_budget"),
      max_tuning_steps=_MAX_TUNING_STEPS.value,
      max_compile_s=_MAX_COMPILE_S.value, json_out=_JSON_OUT.value)


def _seconds(fn) -> float:
  started = time.perf_counter()
  fn()
  return time.perf_counter() - started


def run_model(name: str, config: Config) -> dict:
  build, family, batch_args = MODELS[name]
  model = build()
  params = common.init_params(model)
  tx = optax.adamw(1e-3)
  batch = family.example_batch(model, **batch_args)
  step_fn = exp_common.make_train_step(family.make_loss(model), tx)
  link = jcxl.LinkModel(config.bandwidth, config.latency_s)
  with jcxl.Pool(host="64MiB", cxl="4GiB", cxl_link=link) as pool:
    place = lambda: (jcxl.place(params, "cxl", pool=pool),
                     jcxl.place(tx.init(params), "cxl", pool=pool))
    resident_s = _seconds(lambda: jax.jit(step_fn).lower(
        params, tx.init(params), batch).compile())
    runs = {}
    for schedule in config.fixed:  # compiled before DAP's thread starts
      step = jcxl.cxl_offload(step_fn, schedule=schedule,
                              device_budget=config.device_budget)
      state = place()
      if schedule == config.fixed[0]:
        offloaded_s = _seconds(lambda: step.compile(*state, batch))
      *state, _ = step(*state, batch)
      runs[schedule] = [step, state]
    dap = jcxl.cxl_offload(step_fn, schedule="dap",
                           device_budget=config.device_budget)
    dap.tuner.options = config.tuner_options(dap.tuner.options)
    state, steps = place(), 0
    while not dap.tuner.converged:
      *state, loss = dap(*state, batch)
      steps += 1
    jax.block_until_ready(loss)
    runs["dap"] = [dap, state]
    times = {s: [] for s in runs}
    for n in range(config.steps // config.block_steps):
      for schedule in exp_common.shuffled(list(runs), n):
        step, state = runs[schedule]
        for k in range(config.block_steps):
          started = time.perf_counter()
          *state, loss = step(*state, batch)
          jax.block_until_ready(loss)
          if k == config.block_steps - 1:
            times[schedule].append(time.perf_counter() - started)
        runs[schedule][1] = state
    label = pool.stats()["cxl"].label()
  medians = {s: statistics.median(t) for s, t in times.items()}
  best = min(config.fixed, key=medians.get)
  paired = exp_common.worst_paired_ratio(times["dap"], {best: times[best]})
  cost = dap.tuner.costs[0]
  result = dict(
      model=name, cxl=label, first_compile_resident_s=resident_s,
      first_compile_offloaded_s=offloaded_s,
      first_compile_offloaded_over_resident=offloaded_s / resident_s,
      settled_after_steps=steps, settle_steps=cost.steps,
      settle_waited_steps=cost.waited_steps,
      settle_tuning_steps=cost.steps - cost.waited_steps,
      settle_compiles=cost.compiles, settle_compile_s=cost.compile_s,
      settle_limited=cost.limited or None,
      dap_plan={l.name: l.prefetch for l in dap.plan.layers},
      step_ms={s: m * 1e3 for s, m in medians.items()},
      best_fixed=best, dap_over_best_fixed_paired=paired,
      dap_slower_beyond_noise=paired["low"] > 1.0,
      timed_rounds=len(times["dap"]),
      tuner_history=[dataclasses.asdict(e) for e in dap.tuner.history])
  logging.info("%s: settled after %d steps (%d waited), %d compiles, "
               "%.1f s; dap / %s %.3f [%.3f, %.3f]", name, steps,
               cost.waited_steps, cost.compiles, cost.compile_s, best,
               paired["ratio"], paired["low"], paired["high"])
  return result


def _markdown(results: list[dict], title: str) -> str:
  out = [f"# DAP's tuning cost\n\n{title}\n",
         "| model | first compile offloaded / resident | steps to settle "
         "(waited for compiles) | compiles, s | limit | best fixed | "
         "dap / best fixed, paired [90%] | slower beyond noise |",
         "|---|---|---|---|---|---|---|---|"]
  for r in results:
    p = r["dap_over_best_fixed_paired"]
    out.append(
        f"| {r['model']} | {r['first_compile_offloaded_s']:.1f} / "
        f"{r['first_compile_resident_s']:.1f} s = "
        f"{r['first_compile_offloaded_over_resident']:.2f} | "
        f"{r['settle_steps']} ({r['settle_waited_steps']}) | "
        f"{r['settle_compiles']}, {r['settle_compile_s']:.1f} | "
        f"{r['settle_limited'] or '-'} | {r['best_fixed']} | "
        f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}] | "
        f"{'yes' if r['dap_slower_beyond_noise'] else 'no'} |")
  return "\n".join(out) + "\n"


def run(config: Config) -> dict:
  results = [run_model(name, config) for name in config.models]
  title = (f"cxl EMULATED ({config.bandwidth / 1e9:g} GB/s, "
           f"{config.latency_s * 1e6:g} us per transfer); "
           f"{jax.devices()[0].platform} as the device; {config.steps} "
           f"steps of each schedule after DAP settled, "
           f"{config.block_steps} a round, the last timed")
  print(_markdown(results, title))
  return {"title": title, "results": results}


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=exp_common.flags_parser(FLAGS, __doc__))
