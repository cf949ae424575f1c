r"""Planning without running: placement, schedule and step time for a model
on a described machine, and the largest model of its family that fits.

From the model's train step (traced on abstract shapes: nothing is
allocated) and a hardware description, it prints

* the placement: which tier each layer's parameters and adamw state sit in
  (the layers with the least compute to hide their transfers behind go to
  the fastest tier with room);
* the per-layer schedule (prefetch distance, chunk) the cost model chooses
  within the device memory, and the predicted step time and stall;
* the largest model of the family (more layers) whose state fits the pool
  tiers and whose step fits the device.

Compute is timed segment by segment on this machine's device (each
segment's work compiled as one program and run on zeros, where its arrays
fit in 1 GiB; estimated from its equations where not); with
--device_tflops, it is estimated from the equations at this machine's
measured rates and scaled to that rate; with --measure_compute, each
segment's compute is measured in the step itself, run here with every
leaf fetched right before its use from a throwaway host pool (it sees
what the compiler makes of the whole step, which segments timed alone do
not; it needs the state in host memory). Activations are the residuals
the forward pass saves for the backward pass. With --validate, a small
model is also planned for this machine (its cxl tier EMULATED behind
--link_bandwidth, each transfer holding the link for the copy engine's
measured round trip) and run: the step time predicted from measured and
from timed-alone compute, and the measured one, are printed.

  python -m experiments.plan --model=gpt2:medium --batch=8 --seq_len=1024 \
      --device_memory=80GiB --device_tflops=400 --host_link=64GB/s \
      --cxl=256GiB@32GB/s,256GiB@32GB/s --nvme=4TiB@7GB/s --host_dram=64GiB
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import optax

import jcxl
from jcxl import planning
from jcxl.units import format_bandwidth
from jcxl.units import format_bytes
from jcxl.units import parse_bandwidth
from jcxl.units import parse_bytes
from experiments import common as exp_common
from experiments import flags as shared_flags
from experiments import host_allocator
from models import common
from models import gpt2
from models import llama

FLAGS = flags.FlagValues()
FAMILIES = {"gpt2": (gpt2, "n_layer", "n_ctx"),
            "llama": (llama, "n_layers", "max_seq_len")}

_MODEL = flags.DEFINE_string("model", "gpt2:small",
                             "family:preset, e.g. gpt2:medium, llama:llama3_1b",
                             flag_values=FLAGS)
_BATCH = shared_flags.batch(FLAGS, default=4)
_SEQ = shared_flags.seq_len(FLAGS, default=256)
_DEVICE_MEMORY = flags.DEFINE_string("device_memory", "2GiB",
                                     "device memory", flag_values=FLAGS)
_TFLOPS = flags.DEFINE_float(
    "device_tflops", 0.0, "device matmul TFLOP/s (0: this machine's)",
    flag_values=FLAGS)
_HOST_LINK = flags.DEFINE_string("host_link", "16GB/s",
                                 "device <-> host link bandwidth",
                                 flag_values=FLAGS)
_HOST_DRAM = flags.DEFINE_string("host_dram", "0",
                                 "host DRAM given to the pool",
                                 flag_values=FLAGS)
_CXL = flags.DEFINE_list("cxl", ["64GiB@16GB/s"],
                         "CXL cards as capacity@bandwidth", flag_values=FLAGS)
_NVME = flags.DEFINE_string("nvme", "", "NVMe as capacity@bandwidth",
                            flag_values=FLAGS)
_LATENCY_US = shared_flags.link_latency_us(
    FLAGS, help_text="latency per transfer of every link, in microseconds "
    "(--validate: of the emulated cxl link)")
_MAX_LAYERS = flags.DEFINE_integer(
    "max_layers", 256, "deepest model the largest-model search plans",
    flag_values=FLAGS)
_VALIDATE = flags.DEFINE_bool("validate", False,
                              "also run a small model here: predicted vs "
                              "measured step time", flag_values=FLAGS)
_VALIDATE_LINK = shared_flags.link_bandwidth(
    FLAGS, default="1GB/s", help_text="bandwidth of the emulated cxl link "
    "--validate runs on")
_MEASURE_COMPUTE = flags.DEFINE_bool(
    "measure_compute", False,
    "measure each segment's compute in the step run here (sync, on a "
    "throwaway host pool, on zeros: needs the state in host memory and a "
    "dozen steps' time) instead of timing segments alone",
    flag_values=FLAGS)
_JSON_OUT = shared_flags.json_out(FLAGS, default="")


def _capacity_at(text: str, flag: str) -> tuple[int, float]:
  match = re.fullmatch(r"([^@]+)@([^@]+)", text.strip())
  if not match:
    raise ValueError(f"{flag}: expected capacity@bandwidth (e.g. "
                     f"256GiB@32GB/s), got {text!r}")
  return (parse_bytes(match.group(1), name=flag),
          parse_bandwidth(match.group(2), name=flag))


@dataclasses.dataclass(frozen=True)
class Config:
  family: str
  preset: str
  batch: int
  seq_len: int
  device_memory: int
  device_tflops: float
  host_link: float
  host_dram: int
  cxl: tuple[tuple[int, float], ...]
  nvme: tuple[int, float] | None
  latency_s: float
  max_layers: int
  run_validation: bool
  validate_link: float
  json_out: str
  measure_compute: bool = False
  hold_s: float = 0.0  # per transfer, holding its link (see planning.Link)

  def validate(self) -> None:
    if self.batch < 1 or self.seq_len < 1 or self.max_layers < 1:
      raise ValueError("--batch, --seq_len and --max_layers must be >= 1")
    if not (self.host_dram or self.cxl or self.nvme):
      raise ValueError("no pool tier: give --host_dram, --cxl or --nvme")
    if self.measure_compute and self.device_tflops:
      raise ValueError("--measure_compute measures this machine's device: "
                       "give it or --device_tflops, not both")


def config_from_flags() -> Config:
  family, _, preset = _MODEL.value.partition(":")
  if family not in FAMILIES:
    raise ValueError(f"--model: unknown family {family!r}; known: "
                     f"{sorted(FAMILIES)}")
  module = FAMILIES[family][0]
  if preset not in module.PRESETS:
    raise ValueError(f"--model: unknown {family} preset {preset!r}; known: "
                     f"{sorted(module.PRESETS)}")
  return Config(
      family=family, preset=preset, batch=_BATCH.value, seq_len=_SEQ.value,
      device_memory=parse_bytes(_DEVICE_MEMORY.value, name="--device_memory"),
      device_tflops=_TFLOPS.value,
      host_link=parse_bandwidth(_HOST_LINK.value, name="--host_link"),
      host_dram=parse_bytes(_HOST_DRAM.value, name="--host_dram"),
      cxl=tuple(_capacity_at(c, "--cxl") for c in _CXL.value),
      nvme=_capacity_at(_NVME.value, "--nvme") if _NVME.value else None,
      latency_s=_LATENCY_US.value * 1e-6, max_layers=_MAX_LAYERS.value,
      run_validation=_VALIDATE.value,
      validate_link=parse_bandwidth(_VALIDATE_LINK.value,
                                    name="--link_bandwidth"),
      json_out=_JSON_OUT.value, measure_compute=_MEASURE_COMPUTE.value)


def tiers_of(config: Config) -> list[tuple[str, planning.Link, int]]:
  """The pool's tiers as the device sees them, fastest first: each behind
  the host link, the CXL cards interleaved (their bandwidths add up)."""
  link = lambda bw: planning.Link(min(bw, config.host_link),
                                   config.latency_s, config.hold_s)
  tiers = []
  if config.host_dram:
    tiers.append(("host", link(config.host_link), config.host_dram))
  if config.cxl:
    tiers.append(("cxl", link(sum(bw for _, bw in config.cxl)),
                  sum(cap for cap, _ in config.cxl)))
  if config.nvme:
    tiers.append(("nvme", link(config.nvme[1]), config.nvme[0]))
  return sorted(tiers, key=lambda t: -t.__getitem__(1).bandwidth)


@dataclasses.dataclass
class Model:
  """A model's abstract train step: what the cost model needs."""
  config: Any
  segments: list[planning.Segment]
  layer_bytes: dict[str, int]
  activation_bytes: int
  params: int


def abstract_model(family: str, model_config: Any, batch: int,
                   seq_len: int, compute_scale: float,
                   compute: str = "estimated") -> Model:
  """The model's train step as the cost model sees it, its compute
  "estimated" from its equations, each segment's work "timed" alone on
  this machine's device (see ``step_timeline``), or "measured" in the
  step run here (see ``jcxl.planning.measured_timeline``)."""
  module = FAMILIES[family][0]
  params = jax.eval_shape(lambda: common.init_params(model_config))
  tx = optax.adamw(1e-4)
  opt_state = jax.eval_shape(tx.init, params)
  data = jax.eval_shape(lambda: module.example_batch(
      model_config, batch_size=batch, seq_len=seq_len))
  loss_fn = module.make_loss(model_config)
  step = exp_common.make_train_step(loss_fn, tx)
  if compute == "measured":
    segments, layer_bytes = planning.measured_timeline(
        step, (params, opt_state), data)
  else:
    segments, layer_bytes = planning.step_timeline(
        step, (params, opt_state), data, timed=compute == "timed")
  segments = [dataclasses.replace(s, compute_s=s.compute_s * compute_scale)
              for s in segments]
  return Model(model_config, segments, layer_bytes,
               planning.saved_residual_bytes(loss_fn, params, data),
               common.count_params(model_config))


def hide_seconds(segments: Sequence[planning.Segment]) -> dict[str, float]:
  """Per layer: the compute before each of its fetches (what a prefetch
  of distance 1 hides the fetch behind)."""
  out: dict[str, float] = {}
  for before, seg in zip(segments, segments[1:]):
    if seg.nbytes:
      out[seg.name] = out.get(seg.name, 0.0) + before.compute_s
  return out


def placed(segments: Sequence[planning.Segment],
           placement: dict[str, str]) -> list[planning.Segment]:
  """The segments, each fetched from the tier its layer is placed in."""
  return [dataclasses.replace(s, tier=placement.get(s.name, s.tier))
          for s in segments]


def plan_model(model: Model, config: Config) -> dict:
  tiers = tiers_of(config)
  placement = planning.choose_tiers(model.layer_bytes,
                                    hide_seconds(model.segments), tiers)
  segments = placed(model.segments, placement)
  links = {name: link for name, link, _ in tiers}
  # On the device: activations, and (as the runtime holds them) the layer
  # in use and the one being written back; prefetch gets the rest.
  largest = max(s.nbytes for s in segments)
  base = model.activation_bytes + 2 * largest
  budget = config.device_memory - base
  if budget < 0:
    raise MemoryError(
        f"{model.params:,} parameters: activations "
        f"{format_bytes(model.activation_bytes)} and two layers "
        f"{format_bytes(2 * largest)} need {format_bytes(base)}, over the "
        f"device's {format_bytes(config.device_memory)}")
  choice = planning.choose_schedule(segments, links, prefetch_budget=budget)
  return dict(placement=placement, choice=choice, device_base=base,
              links=links, segments=segments)


def _fits(model: Model, config: Config) -> bool:
  try:
    plan_model(model, config)
    return True
  except MemoryError:
    return False


def model_config_of(config: Config) -> Any:
  """The preset, its positions table long enough for --seq_len."""
  module, _, ctx_field = FAMILIES[config.family]
  model_config = module.preset(config.preset)
  if config.family == "gpt2":  # learned positions must cover the sequence
    model_config = dataclasses.replace(
        model_config, **{ctx_field: max(config.seq_len,
                                        getattr(model_config, ctx_field))})
  return model_config


def largest_depth(config: Config, compute_scale: float) -> tuple[Model, int]:
  """The deepest model of the family that fits (doubling, then bisecting);
  returns it and how many depths were planned."""
  depth_field = FAMILIES[config.family][1]
  base_config = model_config_of(config)

  def at(depth):
    return abstract_model(config.family, dataclasses.replace(
        base_config, **{depth_field: depth}), config.batch, config.seq_len,
        compute_scale)

  lo, hi, tried = 0, 1, 0
  best = None
  while hi <= config.max_layers:  # double until a depth no longer fits
    tried += 1
    model = at(hi)
    if not _fits(model, config):
      break
    lo, best, hi = hi, model, hi * 2
  hi = min(hi, config.max_layers + 1)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    tried += 1
    model = at(mid)
    if _fits(model, config):
      lo, best = mid, model
    else:
      hi = mid
  return best, tried


def print_plan(title: str, model: Model, planned: dict) -> None:
  choice = planned["choice"]
  print(f"\n== {title}: {model.params / 1e6:.1f}M parameters")
  width = max([len("layer")] + [len(name) for name in model.layer_bytes])
  print(f"{'layer':{width}s} {'state':>10s} {'tier':6s} {'prefetch':>8s} "
        f"{'chunk':>10s}")
  for name, nbytes in model.layer_bytes.items():
    chunk = choice.chunk_bytes.get(name, 0)
    print(f"{name:{width}s} {format_bytes(nbytes):>10s} "
          f"{planned['placement'][name]:6s} "
          f"{choice.prefetch.get(name, 0):8d} "
          f"{format_bytes(chunk) if chunk else 'pool':>10s}")
  pred = choice.prediction
  print(f"predicted step {pred.step_s * 1e3:.1f} ms, stall "
        f"{pred.total_stall_s / pred.step_s:.1%}; device: activations "
        f"{format_bytes(model.activation_bytes)}, base "
        f"{format_bytes(planned['device_base'])}, prefetch peak "
        f"{format_bytes(pred.peak_prefetch_bytes)}")
  for reason in choice.reasons[:8]:
    print(f"  {reason}")


def validate_here(config: Config) -> dict:
  """Plans a small model for this machine and runs it: predicted vs
  measured step time (the cxl tier EMULATED behind --link_bandwidth), the
  compute measured in the step and timed segment by segment."""
  model_config = gpt2.tiny(vocab_size=4096, n_embd=128, n_layer=4, n_ctx=64)
  # Each transfer here also holds the link for the copy engine's round
  # trip (measured).
  round_trip = planning.round_trip_seconds()
  here = dataclasses.replace(
      config, host_dram=0, nvme=None, host_link=config.validate_link,
      cxl=((1 << 40, config.validate_link),), device_memory=1 << 30,
      hold_s=round_trip)
  models = {compute: abstract_model("gpt2", model_config, 8, 64, 1.0,
                                    compute=compute)
            for compute in ("measured", "timed")}
  planned = plan_model(models["measured"], here)
  choice = planned["choice"]
  # The same plan on the segments timed alone.
  alone = planning.simulate(
      placed(models["timed"].segments, planned["placement"]),
      choice.prefetch, planned["links"], choice.chunk_bytes).step_s
  link = jcxl.LinkModel(config.validate_link, config.latency_s)
  params = common.init_params(model_config)
  tx = optax.adamw(1e-4)
  train_step = exp_common.make_train_step(gpt2.make_loss(model_config), tx)
  batch = gpt2.example_batch(model_config, batch_size=8, seq_len=64)

  schedule = jcxl.LayerSchedule.of(choice.prefetch, choice.chunk_bytes,
                                   name="plan")
  with jcxl.Pool(host="16MiB", cxl="1GiB", cxl_link=link) as pool:
    label = pool.stats()["cxl"].label()
    state = (jcxl.place(params, "cxl", pool=pool),
             jcxl.place(tx.init(params), "cxl", pool=pool))
    step = jcxl.cxl_offload(train_step, schedule=schedule)
    for _ in range(3):  # compile, warm up
      *state, loss = step(*state, batch)
    times = []
    for _ in range(10):
      start = time.perf_counter()
      *state, loss = step(*state, batch)
      jax.block_until_ready(loss)
      times.append(time.perf_counter() - start)
  measured = statistics.median(times)
  predicted = choice.prediction.step_s
  print(f"\n== validation on this machine ({label}): gpt2 "
        f"{models['measured'].params / 1e6:.1f}M, measured "
        f"{measured * 1e3:.1f} ms; predicted before the run (each transfer "
        f"holding the link for the copy engine's round trip, "
        f"{round_trip * 1e6:.0f} us): {predicted * 1e3:.1f} ms (ratio "
        f"{predicted / measured:.2f}) from each segment's compute measured in "
        f"the sync step on a host pool, {alone * 1e3:.1f} ms (ratio "
        f"{alone / measured:.2f}) from each segment timed alone")
  return dict(label=label, predicted_s=predicted, predicted_alone_s=alone,
              measured_s=measured)


def run(config: Config) -> dict:
  matmul_rate, _ = planning.device_rates()
  scale = (matmul_rate / (config.device_tflops * 1e12)
           if config.device_tflops else 1.0)
  model_config = model_config_of(config)
  tiers = tiers_of(config)
  print("machine: device " + format_bytes(config.device_memory) +
        (f", {config.device_tflops:g} TFLOP/s" if config.device_tflops else
         f", this machine's {matmul_rate / 1e12:.3f} TFLOP/s") + "; tiers: " +
        ", ".join(f"{n} {format_bytes(c)} at {format_bandwidth(l.bandwidth)}"
                  for n, l, c in tiers))
  # Compute is timed or measured where the plan is for this machine's
  # device; the depth search below needs memory alone, and is estimated.
  compute = ("estimated" if config.device_tflops else
             "measured" if config.measure_compute else "timed")
  print("compute: " + {
      "estimated": "estimated from the step's equations at this machine's "
                   f"rates, scaled to {config.device_tflops:g} TFLOP/s",
      "timed": "each segment's work timed alone on this machine's device, "
               "on zeros",
      "measured": "each segment's compute measured in the sync step run "
                  "on this machine's device, on zeros"}[compute])
  model = abstract_model(config.family, model_config, config.batch,
                         config.seq_len, scale, compute=compute)
  results: dict[str, Any] = {"model": f"{config.family}:{config.preset}",
                             "params": model.params}
  try:
    planned = plan_model(model, config)
    print_plan(f"{config.family}:{config.preset}", model, planned)
    results["predicted_step_s"] = planned["choice"].prediction.step_s
    results["placement"] = planned["placement"]
    results["prefetch"] = planned["choice"].prefetch
  except MemoryError as e:
    print(f"\n{config.family}:{config.preset} does not fit: {e}")
    results["error"] = str(e)
  biggest, tried = largest_depth(config, scale)
  if biggest is None:
    print("\nno depth of this family fits")
  else:
    depth = getattr(biggest.config, FAMILIES[config.family][1])
    capped = " (--max_layers: the search stopped there)" if (
        depth == config.max_layers) else ""
    print(f"\nlargest that fits: {depth} layers, "
          f"{biggest.params / 1e6:.1f}M parameters ({tried} depths planned)"
          f"{capped}")
    results["largest"] = {"layers": depth, "params": biggest.params}
  if config.run_validation:
    results["validation"] = validate_here(config)
  return results


def main(argv: Sequence[str]) -> None:
  exp_common.run_program(argv, config_from_flags, run)


if __name__ == "__main__":
  host_allocator.start()
  app.run(main, flags_parser=exp_common.flags_parser(FLAGS, __doc__))
