r"""Dynamic Adaptive Pipelining against fixed and bucket prefetch schedules.

For each model (layers that differ in size and compute) and each emulated
cxl link bandwidth, trains the model with its parameters and adamw state
in the cxl tier under every schedule, and reports the median step time,
the compiled step's device need (checked against --device_budget) and the
cost model's predicted step time (from what the DAP run measured):

* ``sync``: each layer fetched right before it runs;
* ``fixed:k``: every layer k layers ahead;
* ``bucket``: DeepSpeed ZeRO-3's prefetch bucket (5e7 elements);
* ``dap``: tuned online (the steps it takes to converge are not timed);
* ``dap plan, unmeasured``: DAP's tuned plan run as a fixed plan, so that
  dap against it is what DAP's measuring costs.

After the rounds, DAP's plan (unmeasured) runs --solo_steps steps by
itself, back to back, as a plan runs in production: the predictions are
also checked against that step, since in the rounds each step follows
other programs' steps on other state.

The --tight_models also run at the middle bandwidth with a tight device
budget (what their sync step needs plus --tight_headroom): a fixed
distance whose step needs more is reported as over budget and not run,
while DAP plans per layer within it.

The schedules run in interleaved rounds (--steps of them, --block_steps
steps of each schedule a round, the last timed), each round's ratio DAP /
other cancelling the machine's load in that round. Where the first rounds
leave a fixed distance within 5% of DAP, DAP, its plan unmeasured and
those distances run up to --confirm_rounds more, until the 90% interval
of DAP's paired ratio lies on one side of the 3% target.

Then, on --slowdown_model at the middle bandwidth, the link slows by
--slowdown mid-run: the steps DAP takes to re-plan are counted and its step
time compared with a DAP run tuned from scratch on the slow link.

Writes results.csv, results.md, step_time.png, memory.png and stall.png
into --run_dir; the emulated link parameters are in every title.

  python -m experiments.dap --models=gpt2_bigvocab,wide_narrow,one_big \
      --link_bandwidths=0.5GB/s,2GB/s,16GB/s --steps=24 --run_dir=runs/dap
"""

from __future__ import annotations

import csv
import dataclasses
import os
import statistics
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import optax

import jcxl
from jcxl import planning
from jcxl.units import parse_bandwidth
from jcxl.units import parse_bytes
from experiments import common as exp_common
from experiments import flags as shared_flags
from experiments import host_allocator
from experiments import plots as exp_plots
from models import common
from models import gpt2
from models import mlp

_fmt = exp_common.format_or_dash  # a table cell, "-" for None

# The program's flags live in a FlagValues of their own (see
# experiments.common.flags_parser).
FLAGS = flags.FlagValues()

MODELS = {
    # A large vocabulary: the embedding/head layer dwarfs every block.
    "gpt2_bigvocab": lambda: gpt2.tiny(vocab_size=16384, n_embd=128,
                                       n_layer=4, n_ctx=64),
    # Blocks alternate narrow->wide and wide->narrow.
    "wide_narrow": lambda: mlp.wide_narrow(narrow=256, wide=2048,
                                           num_blocks=6),
    # Small blocks around one 1024 x 1024 block (4 MiB, 12 MiB with its
    # adamw state): under a tight budget only the small ones can be
    # fetched ahead.
    "one_big": lambda: mlp.MLPConfig(
        in_dim=256, widths=(256,) * 6 + (1024, 1024) + (256,) * 6,
        out_dim=256),
}
BATCHES = {"gpt2_bigvocab": 8, "wide_narrow": 256, "one_big": 256}
SCHEDULES = ("sync", "fixed:1", "fixed:2", "fixed:3", "bucket", "dap")
# DAP's tuned plan run as a fixed plan: DAP's measuring is what differs.
UNMEASURED = "dap plan, unmeasured"
# The target: DAP's step within 3% of the best fixed distance.
TARGET_RATIO = 1.03
# Fixed distances whose paired ratio DAP's first rounds put at least this
# high run the confirming rounds (those DAP beat by more are settled).
CONTENDER_RATIO = 0.95
CONFIRM_BATCH = 8

_MODELS = flags.DEFINE_list("models", list(MODELS), "models to run",
                            flag_values=FLAGS)
_BANDWIDTHS = shared_flags.link_bandwidths(
    FLAGS, default=["0.5GB/s", "2GB/s", "16GB/s"])
_LATENCY_US = shared_flags.link_latency_us(FLAGS)
_SCHEDULES = flags.DEFINE_list("schedules", list(SCHEDULES), "schedules",
                               flag_values=FLAGS)
_STEPS = shared_flags.steps(
    FLAGS, default=24, help_text="timed rounds per case (each schedule's "
    "--block_steps a round)")
_BLOCK_STEPS = flags.DEFINE_integer(
    "block_steps", 2, "steps each schedule runs back to back in a round, "
    "the last one timed, as a plan runs in production (on XLA:CPU a plan's "
    "steps back to back ran up to 25% faster than steps that alternate "
    "between plans; 1 alternates them)",
    flag_values=FLAGS)
_CONFIRM_ROUNDS = flags.DEFINE_integer(
    "confirm_rounds", 48, "most extra rounds, after --steps, of DAP, its "
    "plan unmeasured and the fixed distances the first rounds could not "
    f"tell it apart from, run in batches of {CONFIRM_BATCH} until the 90% "
    "interval of DAP's paired ratio over them lies on one side of "
    f"{TARGET_RATIO:g} (0: none)", flag_values=FLAGS)
_SOLO_STEPS = flags.DEFINE_integer(
    "solo_steps", 12, "steps DAP's tuned plan runs by itself, back to back "
    "and after 2 untimed ones, once the rounds are done: the run the "
    "predictions are also checked against (0: none)", flag_values=FLAGS)
_TUNE_STEPS = flags.DEFINE_integer(
    "tune_steps", 200, "most untimed steps DAP may tune for (twice that to "
    "re-plan after the link slows)", flag_values=FLAGS)
_BUDGET = shared_flags.device_budget(FLAGS, default="1GiB")
_TIGHT_MODELS = flags.DEFINE_list(
    "tight_models", ["one_big"],
    "models also run at the middle bandwidth with a tight device budget: "
    "what their sync step needs plus --tight_headroom", flag_values=FLAGS)
_TIGHT_HEADROOM = flags.DEFINE_string(
    "tight_headroom", "2MiB", "device memory over the sync step's need in "
    "the tight-budget runs", flag_values=FLAGS)
_SLOWDOWN = flags.DEFINE_float(
    "slowdown", 2.0, "factor the link slows by mid-run (0: skip)",
    flag_values=FLAGS)
_SLOWDOWN_MODEL = flags.DEFINE_string(
    "slowdown_model", "wide_narrow", "model whose link slows mid-run, at "
    "the middle bandwidth (one whose tuned step still waits on transfers: "
    "GPT-2's tuned plan hid a 2x slower link, 606 -> 630 ms, with nothing "
    "to re-plan)", flag_values=FLAGS)
_RUN_DIR = shared_flags.run_dir(FLAGS, default="runs/dap")


@dataclasses.dataclass(frozen=True)
class Config:
  models: tuple[str, ...]
  bandwidths: tuple[float, ...]
  latency_s: float
  schedules: tuple[str, ...]
  steps: int
  confirm_rounds: int
  solo_steps: int
  tune_steps: int
  block_steps: int
  device_budget: int
  tight_models: tuple[str, ...]
  tight_headroom: int
  slowdown: float
  slowdown_model: str
  run_dir: str

  def validate(self) -> None:
    for flag, models in (("--models", self.models),
                         ("--tight_models", self.tight_models),
                         ("--slowdown_model", (self.slowdown_model,))):
      for m in models:
        if m not in MODELS:
          raise ValueError(f"{flag}: unknown model {m!r}; known: "
                           f"{sorted(MODELS)}")
    for s in self.schedules:
      jcxl.cxl_offload(lambda: None, schedule=s)  # raises on a bad one
    if "dap" not in self.schedules:
      raise ValueError("--schedules must include dap (the others are "
                       "compared with it)")
    if self.steps < 1 or self.tune_steps < 1 or self.block_steps < 1:
      raise ValueError("--steps, --tune_steps and --block_steps must be "
                       ">= 1")
    for flag, value in (("--confirm_rounds", self.confirm_rounds),
                        ("--solo_steps", self.solo_steps)):
      if value < 0:
        raise ValueError(f"{flag} must be >= 0, got {value}")
    if self.slowdown and self.slowdown < 1:
      raise ValueError(f"--slowdown must be >= 1 (or 0), got {self.slowdown}")


def config_from_flags() -> Config:
  return Config(
      models=tuple(_MODELS.value),
      bandwidths=tuple(parse_bandwidth(b, name="--link_bandwidths")
                       for b in _BANDWIDTHS.value),
      latency_s=_LATENCY_US.value * 1e-6, schedules=tuple(_SCHEDULES.value),
      steps=_STEPS.value, confirm_rounds=_CONFIRM_ROUNDS.value,
      solo_steps=_SOLO_STEPS.value,
      tune_steps=_TUNE_STEPS.value,
      block_steps=_BLOCK_STEPS.value,
      device_budget=parse_bytes(_BUDGET.value, name="--device_budget"),
      tight_models=tuple(_TIGHT_MODELS.value),
      tight_headroom=parse_bytes(_TIGHT_HEADROOM.value,
                                 name="--tight_headroom"),
      slowdown=_SLOWDOWN.value, slowdown_model=_SLOWDOWN_MODEL.value,
      run_dir=_RUN_DIR.value)


class Case:
  """One model's state, step and batch, placed afresh for every run."""

  def __init__(self, name: str):
    config = MODELS[name]()
    self.name = name
    self.params = common.init_params(config)
    self.tx = optax.adamw(1e-3)
    family = gpt2 if name.startswith("gpt2") else mlp
    self.batch = family.example_batch(config, batch_size=BATCHES[name])
    self.step_fn = exp_common.make_train_step(family.make_loss(config),
                                              self.tx)
    # The step as the cost model sees it before anything runs, for the
    # offline predictions: each segment's compute measured in the sync
    # step on a throwaway host pool, and (for comparison) timed alone.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            ((self.params, self.tx.init(self.params)),
                             self.batch))
    self.timelines = {
        "measured": planning.measured_timeline(self.step_fn, *abstract)[0],
        "alone": planning.step_timeline(self.step_fn, *abstract,
                                        timed=True)[0]}

  def offline_predictions(self, plan: Any, link: jcxl.LinkModel
                          ) -> dict[str, float]:
    """The step time the cost model gives `plan` before anything ran, on
    each of the timelines: the emulated link, each transfer holding it for
    the copy engine's round trip (measured)."""
    links = {"cxl": planning.Link(
        link.bandwidth, link.latency_s,
        hold_s=planning.round_trip_seconds())}
    prefetch = {l.name: l.prefetch for l in plan.layers}
    chunks = {l.name: l.chunk_bytes for l in plan.layers}
    return {name: planning.simulate(timeline, prefetch, links, chunks).step_s
            for name, timeline in self.timelines.items()}

  def place(self, pool):
    return (jcxl.place(self.params, "cxl", pool=pool),
            jcxl.place(self.tx.init(self.params), "cxl", pool=pool))


def _timed(step, state, batch, n) -> tuple[float, Any]:
  times = []
  for _ in range(n):
    start = time.perf_counter()
    *state, loss = step(*state, batch)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - start)
  return statistics.median(times), state


def _interleaved(runs: dict[str, list], batch, rounds: int, order,
                 block: int = 1) -> dict[str, list[float]]:
  """Times `rounds` rounds of each run ([step, state, ...], its state
  updated in place), each round in `order(names, round)`, so that a shared
  machine's changing load falls on all of them alike. In a round each run
  takes `block` steps back to back; the last is timed."""
  times = {name: [] for name in runs}
  for n in range(rounds):
    for name in order(list(runs), n):
      if block > 1:
        _, runs[name][1] = _timed(runs[name][0], runs[name][1], batch,
                                  block - 1)
      seconds, runs[name][1] = _timed(runs[name][0], runs[name][1], batch, 1)
      times[name].append(seconds)
  return times


def _is_fixed(schedule: str) -> bool:
  """Whether `schedule` is a fixed prefetch distance (sync is distance 0)."""
  return schedule.startswith("fixed") or schedule == "sync"


def _confirm(runs: dict[str, list], times: dict[str, list[float]], batch,
             config: Config) -> int:
  """Runs more interleaved rounds (appended to `times`) of DAP, its plan
  unmeasured and the fixed distances whose paired ratio the rounds so far
  put at CONTENDER_RATIO or more, CONFIRM_BATCH at a time, until the 90%
  interval of DAP's largest paired ratio over them lies on one side of
  TARGET_RATIO or `config.confirm_rounds` were run. Where every plan runs
  within a few percent of the others, the first rounds cannot tell a 3%
  gap from the machine's noise; more rounds of the close ones can. Returns
  the rounds added."""
  contenders = [s for s in times if _is_fixed(s) and
                exp_common.worst_paired_ratio(
                    times["dap"], {s: times[s]})["ratio"] >= CONTENDER_RATIO]
  group = {s: runs[s] for s in ["dap", UNMEASURED] + contenders if s in runs}
  added = 0
  while contenders and added < config.confirm_rounds:
    verdict = exp_common.worst_paired_ratio(
        times["dap"], {s: times[s] for s in contenders})
    if verdict["high"] < TARGET_RATIO or verdict["low"] > TARGET_RATIO:
      break
    n = min(CONFIRM_BATCH, config.confirm_rounds - added)
    first = len(times["dap"])  # fresh orders, not the first rounds' again
    more = _interleaved(group, batch, n,
                        lambda names, r: exp_common.shuffled(names, first + r),
                        config.block_steps)
    for name, t in more.items():
      times[name] += t
    added += n
  return added


def _paired_over(times: list[float], others: dict[str, list[float]]) -> dict:
  """`exp_common.worst_paired_ratio` where some of `others` also ran the
  confirming rounds: each is paired with the rounds of `times` it shares
  (the first ones, or all), and the largest verdict is kept."""
  by_rounds: dict[int, dict[str, list[float]]] = {}
  for name, t in others.items():
    by_rounds.setdefault(len(t), {})[name] = t
  return max((exp_common.worst_paired_ratio(times[:n], group)
              for n, group in by_rounds.items()), key=lambda v: v["ratio"])


def _tune(step, state, batch, limit) -> tuple[int, Any, list]:
  """Runs untimed steps until DAP converges; returns the steps taken, the
  state, and the first measured step's profile and the last one of the
  plan it settled on."""
  profiles = []  # (the plan's compiled version, its profile)
  n = 0
  for n in range(1, limit + 1):
    version = step.tuner.version
    *state, _ = step(*state, batch)
    if step.last_profile is not None and (
        not profiles or profiles[-1][1] is not step.last_profile):
      profiles.append((version, step.last_profile))
    if step.tuner.converged:
      break
  kept = [p for v, p in profiles if v == step.tuner.version]
  ends = [profiles[0][1], (kept or [profiles[-1][1]])[-1]] if profiles else []
  return n, state, ends


def run_case(case: Case, bandwidth: float, budget: int,
             config: Config) -> dict:
  """Every schedule on one model, link and device budget, timed in
  interleaved rounds (a block of steps of each schedule per round) so
  that a shared machine's changing load falls on all of them alike. A
  schedule whose step needs more than the budget is not run (its need is
  reported)."""
  link = jcxl.LinkModel(bandwidth, config.latency_s)
  with jcxl.Pool(host="64MiB", cxl="4GiB", cxl_link=link) as pool:
    label = pool.stats()["cxl"].label()
    runs, over = {}, {}
    for schedule in ("dap",) + tuple(s for s in config.schedules
                                      if s != "dap"):
      step = jcxl.cxl_offload(case.step_fn, schedule=schedule,
                              device_budget=budget)
      runs[schedule] = [step, case.place(pool), 0]
    step, state, _ = runs["dap"]
    tuned, state, profiles = _tune(step, state, case.batch,
                                   config.tune_steps)
    runs["dap"][1:] = [state, tuned]
    # The tuned plan again, without the tuner: what staying on costs.
    runs[UNMEASURED] = [jcxl.cxl_offload(
        case.step_fn, schedule=step.plan.as_schedule(),
        device_budget=budget), case.place(pool), 0]
    for schedule, run_ in list(runs.items()):  # compile, warm up
      try:
        *run_[1], _ = run_[0](*run_[1], case.batch)
      except MemoryError:  # over the budget: reported, not run
        over[schedule] = runs.pop(schedule)
    times = _interleaved(runs, case.batch, config.steps, exp_common.shuffled,
                         config.block_steps)
    confirmed = _confirm(runs, times, case.batch, config)
    solo_s = None  # DAP's plan by itself
    if config.solo_steps and UNMEASURED in runs:
      run_ = runs[UNMEASURED]
      _, run_[1] = _timed(run_[0], run_[1], case.batch, 2)  # back on it
      solo_s, run_[1] = _timed(run_[0], run_[1], case.batch,
                               config.solo_steps)
    tuner = runs["dap"][0].tuner
    rows = []
    for schedule, (step, state, tuned) in {**runs, **over}.items():
      # Medians over the rounds every schedule ran (comparable); the
      # confirming rounds go into the paired ratios.
      median = (statistics.median(times[schedule][:config.steps])
                if schedule in runs else None)
      need = step.device_need(*state, case.batch)
      prefetch = ({l.name: l.prefetch for l in step.plan.layers}
                  if schedule in runs else None)
      predicted = tuner.predict(prefetch).step_s if prefetch else None
      offline = (case.offline_predictions(step.plan, link) if prefetch
                 else {})
      rows.append(dict(model=case.name, bandwidth_gbps=bandwidth / 1e9,
                       budget_mib=budget / 2**20, schedule=schedule,
                       step_ms=_ms(median), predicted_ms=_ms(predicted),
                       solo_ms=_ms(solo_s) if schedule == UNMEASURED else None,
                       round_ms=[t * 1e3 for t in times.get(schedule, [])],
                       confirm_rounds=confirmed,
                       offline_predicted_ms=_ms(offline.get("measured")),
                       offline_alone_predicted_ms=_ms(offline.get("alone")),
                       device_need=need, within_budget=need <= budget,
                       tune_steps=tuned, compiles=step.compiles))
      logging.info("%s %.2f GB/s, budget %.1f MiB, %s: %s ms (predicted %s),"
                   " need %d B", case.name, bandwidth / 1e9, budget / 2**20,
                   schedule, rows[-1]["step_ms"], rows[-1]["predicted_ms"],
                   need)
  stall = {"before": profiles[0], "after": profiles[-1]} if profiles else {}
  return {"rows": rows, "label": label, "stall": stall}


def _ms(seconds: float | None) -> float | None:
  return None if seconds is None else seconds * 1e3


def _over(predicted_ms: float, plain: dict | None) -> float | None:
  """`predicted_ms` over the plan's step run by itself (None: not run)."""
  solo = plain and plain["solo_ms"]
  return predicted_ms / solo if solo else None


def sync_need(case: Case) -> int:
  """Device bytes the model's sync step needs (nothing prefetched)."""
  with jcxl.Pool(host="64MiB", cxl="4GiB") as pool:
    step = jcxl.cxl_offload(case.step_fn, schedule="sync")
    return step.device_need(*case.place(pool), case.batch)


def _tuned_dap(case: Case, pool: jcxl.Pool, config: Config) -> tuple:
  """A DAP step on freshly placed state, run until its plan settles."""
  state = case.place(pool)
  step = jcxl.cxl_offload(case.step_fn, schedule="dap",
                          device_budget=config.device_budget)
  _, state, _ = _tune(step, state, case.batch, config.tune_steps)
  return step, state


def run_slowdown(case: Case, bandwidth: float, config: Config) -> dict:
  """DAP through a mid-run link slowdown, against DAP tuned on the slow link."""
  fast = jcxl.LinkModel(bandwidth, config.latency_s)
  slow = jcxl.LinkModel(bandwidth / config.slowdown, config.latency_s)
  with jcxl.Pool(host="64MiB", cxl="2GiB", cxl_link=fast) as pool:
    step, state = _tuned_dap(case, pool, config)
    before, state = _timed(step, state, case.batch, config.steps)
    pool.set_link("cxl", slow)
    seen = len(step.tuner.history)
    replanned_after = None
    # A settled plan is checked up to 32 steps apart; a drift is then
    # confirmed and re-planned (and raced again if the plan changed).
    for n in range(1, 2 * config.tune_steps + 1):
      *state, _ = step(*state, case.batch)
      events = [e.what for e in step.tuner.history[seen:]]
      if "drift" in events and step.tuner.converged:
        replanned_after = n
        break
    with jcxl.Pool(host="64MiB", cxl="2GiB", cxl_link=slow) as fresh_pool:
      fresh_step, fresh_state = _tuned_dap(case, fresh_pool, config)
      runs = {"after": [step, state], "fresh": [fresh_step, fresh_state]}
      times = _interleaved(runs, case.batch, config.steps,
                           exp_common.rotated, config.block_steps)
  after, fresh = (statistics.median(times[n]) for n in ("after", "fresh"))
  paired = exp_common.worst_paired_ratio(times["after"],
                                         {"fresh": times["fresh"]})
  return dict(model=case.name, fast_gbps=bandwidth / 1e9,
              slow_gbps=bandwidth / config.slowdown / 1e9,
              before_ms=before * 1e3, after_ms=after * 1e3,
              fresh_ms=fresh * 1e3, replanned_after_steps=replanned_after,
              after_over_fresh=paired["ratio"],
              after_over_fresh_low=paired["low"],
              after_over_fresh_high=paired["high"])


def _case_name(model: str, bandwidth_gbps: float, budget_mib: float,
               config: Config) -> str:
  name = f"{model} @ {bandwidth_gbps:g} GB/s"
  if budget_mib * 2**20 != config.device_budget:
    name += f", budget {budget_mib:.1f} MiB"
  return name


def _cases(rows: list[dict], config: Config) -> dict[str, list[dict]]:
  out: dict = {}
  for r in rows:
    out.setdefault(_case_name(r["model"], r["bandwidth_gbps"],
                              r["budget_mib"], config), []).append(r)
  return out


def summarize(rows: list[dict], stalls: dict, config: Config) -> list[dict]:
  """Per case: DAP against the best fixed distance within the budget."""
  out = []
  for name, group in _cases(rows, config).items():
    ran = [r for r in group if r["step_ms"] is not None]
    fixed = [r for r in ran if _is_fixed(r["schedule"])]
    dap = next(r for r in group if r["schedule"] == "dap")
    best = min(fixed, key=lambda r: r["step_ms"]) if fixed else None
    paired = _paired_over(
        dap["round_ms"], {r["schedule"]: r["round_ms"] for r in fixed}
    ) if fixed else None
    # Against the one fixed distance with the lowest median: the largest
    # of several noisy medians above sits over 1 even where DAP runs the
    # same plan as all of them.
    paired_best = _paired_over(
        dap["round_ms"], {best["schedule"]: best["round_ms"]}
    ) if fixed else None
    plain = next((r for r in ran if r["schedule"] == UNMEASURED), None)
    stall = stalls.get(name, {})
    out.append(dict(
        case=name, dap_ms=dap["step_ms"],
        confirm_rounds=dap["confirm_rounds"],
        best_fixed=best["schedule"] if best else None,
        best_fixed_ms=best["step_ms"] if best else None,
        dap_over_best_fixed=(dap["step_ms"] / best["step_ms"]
                             if best else None),
        # Round by round against the fixed distance that did best against
        # it, with a 90% interval: what the 3% target is judged on.
        dap_paired=paired,
        dap_paired_best=paired_best,
        # Faster only where the interval is below 1: not by noise.
        dap_beats_every_fixed=bool(paired) and paired["high"] < 1,
        fixed_over_budget=[r["schedule"] for r in group
                           if r["step_ms"] is None],
        dap_within_budget=dap["within_budget"],
        dap_predicted_over_measured=dap["predicted_ms"] / dap["step_ms"],
        dap_offline_over_measured=(dap["offline_predicted_ms"] /
                                   dap["step_ms"]),
        dap_offline_alone_over_measured=(dap["offline_alone_predicted_ms"] /
                                         dap["step_ms"]),
        # The same predictions against DAP's plan run by itself.
        plan_solo_ms=plain["solo_ms"] if plain else None,
        dap_predicted_over_solo=_over(dap["predicted_ms"], plain),
        dap_offline_over_solo=_over(dap["offline_predicted_ms"], plain),
        # The same plan against itself (DAP's measuring aside): how far
        # apart two runs of one plan come out here, round by round.
        dap_over_unmeasured=(_paired_over(
            dap["round_ms"], {UNMEASURED: plain["round_ms"]})
                             if plain else None),
        stall_before=(stall["before"].stall_fraction if stall else None),
        stall_after=(stall["after"].stall_fraction if stall else None)))
  return out


def _markdown(rows: list[dict], summary: list[dict], labels: dict,
              slowdown: dict | None) -> str:
  out = ["# DAP against fixed and bucket schedules", ""]
  out += [f"- {case}: cxl {label}" for case, label in labels.items()]
  out += ["", "Predicted: the cost model on what DAP measured (each "
          "segment's compute, the link). Offline: before anything runs on "
          "the cxl tier: the emulated link, each transfer holding it for "
          "the copy engine's round trip (measured), and each segment's "
          "compute measured in the sync step on a throwaway host pool, on "
          "zeros (`experiments.plan --measure_compute`); offline, alone: "
          "each segment's compute timed by itself on zeros instead.", "",
          "| model | link GB/s | budget MiB | schedule | step ms | "
          "predicted ms | predicted / measured | offline / measured | "
          "offline, alone / measured | device need MiB | within budget |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ran = r["step_ms"] is not None
    out.append(
        f"| {r['model']} | {r['bandwidth_gbps']:g} | {r['budget_mib']:.1f} | "
        f"{r['schedule']} | "
        + (f"{r['step_ms']:.2f} | {r['predicted_ms']:.2f} | "
           f"{r['predicted_ms'] / r['step_ms']:.3f} | "
           f"{r['offline_predicted_ms'] / r['step_ms']:.3f} | "
           f"{r['offline_alone_predicted_ms'] / r['step_ms']:.3f}" if ran
           else "over budget, not run | - | - | - | -")
        + f" | {r['device_need'] / 2**20:.1f} | {r['within_budget']} |")
  out += ["", "DAP against the best fixed prefetch distance (sync = 0) "
          "within the budget, per case. Medians: each schedule's median "
          "step, DAP's over the lowest. Paired: per fixed distance the "
          "median over rounds of DAP's step / its step in the same round, "
          "the largest of them, with a 90% bootstrap interval over rounds; "
          "and the same against the fixed distance with the lowest median "
          "alone. DAP against its own plan unmeasured, paired: how far apart "
          "two runs of one plan come out. Confirming rounds: run after the "
          "first ones for DAP, its plan unmeasured and the fixed distances "
          f"those put at {CONTENDER_RATIO:g} of DAP or closer, until the 90% "
          f"interval lay on one side of {TARGET_RATIO:g} (or the limit); "
          "the paired ratios use them, the medians do not. DAP's plan by "
          "itself: its unmeasured step's median over steps run back to "
          "back after the rounds, nothing else running in between (as a "
          "plan runs in production).",
          "",
          "| case | confirming rounds | dap ms | best fixed | ms | "
          "dap / best fixed, medians | "
          "dap / every fixed, paired, the largest [90%] | dap / best fixed, "
          "paired [90%] | dap faster than every fixed "
          "(paired, interval below 1) | fixed over budget | dap predicted "
          "/ measured | offline | offline, alone | dap's plan by itself ms "
          "| dap predicted / by itself | offline / by itself | dap / its "
          "plan unmeasured, paired [90%] | stall before -> after tuning |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
          "---|---|"]
  for c in summary:
    stall = (f"{c['stall_before']:.1%} -> {c['stall_after']:.1%}"
             if c["stall_before"] is not None else "-")
    out.append(
        f"| {c['case']} | {c['confirm_rounds']} | {c['dap_ms']:.2f} | "
        f"{c['best_fixed']} | "
        f"{c['best_fixed_ms']:.2f} | {c['dap_over_best_fixed']:.3f} | "
        f"{_paired(c['dap_paired'])} | {_paired(c['dap_paired_best'])} | "
        f"{'yes' if c['dap_beats_every_fixed'] else 'no'} | "
        f"{', '.join(c['fixed_over_budget']) or '-'} | "
        f"{c['dap_predicted_over_measured']:.3f} | "
        f"{c['dap_offline_over_measured']:.3f} | "
        f"{c['dap_offline_alone_over_measured']:.3f} | "
        f"{_fmt(c['plan_solo_ms'], '.2f')} | "
        f"{_fmt(c['dap_predicted_over_solo'], '.3f')} | "
        f"{_fmt(c['dap_offline_over_solo'], '.3f')} | "
        + f"{_paired(c['dap_over_unmeasured'])} | {stall} |")
  if slowdown:
    out += ["", f"Link slowdown ({slowdown['fast_gbps']:g} -> "
            f"{slowdown['slow_gbps']:g} GB/s) on {slowdown['model']}: re-planned "
            f"after {slowdown['replanned_after_steps']} steps; step "
            f"{slowdown['before_ms']:.2f} -> {slowdown['after_ms']:.2f} ms, "
            f"DAP tuned from scratch on the slow link {slowdown['fresh_ms']:.2f}"
            f" ms (paired ratio {slowdown['after_over_fresh']:.3f}, 90% "
            f"[{slowdown['after_over_fresh_low']:.3f}, "
            f"{slowdown['after_over_fresh_high']:.3f}])."]
  return "\n".join(out) + "\n"


def _paired(paired: dict | None) -> str:
  if not paired:
    return "-"
  return (f"{paired['ratio']:.3f} [{paired['low']:.3f}, {paired['high']:.3f}]"
          f" vs {paired['against']}")


def _plots(rows: list[dict], stalls: dict, title: str,
           config: Config) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  cases = _cases(rows, config)
  for key, fname, ylabel in (("step_ms", "step_time.png",
                              "step time (ms; 0: over budget, not run)"),
                             ("device_need", "memory.png",
                              "device need (bytes)")):
    width_in = max(6, 2.2 * len(cases))
    fig, ax = plt.subplots(figsize=(width_in, 4))
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    width = 0.8 / len(schedules)
    for j, s in enumerate(schedules):
      values = [next((r[key] or 0 for r in g if r["schedule"] == s), 0)
                for g in cases.values()]
      ax.bar([i + j * width for i in range(len(cases))], values, width,
             label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([n.replace(" @ ", "\n").replace(", ", "\n")
                        for n in cases], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, int(14 * width_in)), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(config.run_dir, fname))
    plt.close(fig)
  fig, axes = plt.subplots(1, max(1, len(stalls)), squeeze=False,
                           figsize=(6 * max(1, len(stalls)), 4))
  for ax, (case, profiles) in zip(axes[0], stalls.items()):
    for offset, (when, profile) in enumerate(profiles.items()):
      names = [l.name for l in profile.layers]
      ax.bar([i + 0.4 * offset for i in range(len(names))],
             [l.stall_s * 1e3 for l in profile.layers], 0.4,
             label=f"{when} tuning ({profile.stall_fraction:.0%} stalled)")
      ax.set_xticks(range(len(names)))
      ax.set_xticklabels(names, rotation=60, fontsize=6)
    ax.set_ylabel("stall per step (ms)")
    ax.set_title(f"{case}\n" + textwrap.fill(title, 90), fontsize=7)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(config.run_dir, "stall.png"))
  plt.close(fig)


def run(config: Config) -> dict:
  os.makedirs(config.run_dir, exist_ok=True)
  rows, labels, stalls = [], {}, {}
  cases = {name: Case(name) for name in config.models}
  mid = sorted(config.bandwidths)[len(config.bandwidths) // 2]
  for case in cases.values():
    points = [(bw, config.device_budget) for bw in config.bandwidths]
    if case.name in config.tight_models:
      points.append((mid, sync_need(case) + config.tight_headroom))
    for bw, budget in points:
      result = run_case(case, bw, budget, config)
      rows += result["rows"]
      name = _case_name(case.name, bw / 1e9, budget / 2**20, config)
      labels[name] = result["label"]
      if result["stall"]:
        stalls[name] = result["stall"]
  slowdown = None
  if config.slowdown:
    case = cases.get(config.slowdown_model) or Case(config.slowdown_model)
    slowdown = run_slowdown(case, mid, config)
  title = (f"cxl EMULATED (link bandwidths {[b / 1e9 for b in config.bandwidths]}"
           f" GB/s, {config.latency_s * 1e6:g} us per transfer); "
           f"{os.cpu_count()} cores, XLA:CPU as the device; {config.steps} "
           f"rounds of {config.block_steps} step(s) of each schedule back "
           "to back, the last timed, then up to "
           f"{config.confirm_rounds} confirming rounds of the close ones")
  with open(os.path.join(config.run_dir, "results.csv"), "w",
            newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({**r, "round_ms": " ".join(
        f"{t:.2f}" for t in r["round_ms"])} for r in rows)
  summary = summarize(rows, stalls, config)
  text = f"{title}\n\n" + _markdown(rows, summary, labels, slowdown)
  with open(os.path.join(config.run_dir, "results.md"), "w",
            encoding="utf-8") as f:
    f.write(text)
  exp_plots.if_available(_plots, rows, stalls, title, config)
  print(text)
  return {"rows": rows, "summary": summary, "slowdown": slowdown,
          "title": title}


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=exp_common.flags_parser(FLAGS, __doc__))
