"""Planning a step offline: its layer timeline, the cost model, tiers.

Before a model runs (or where it does not fit this machine), a step can be
traced on abstract shapes into a timeline of layer ``Segment``s (the bytes
each layer fetches and the compute that follows), and the cost model asked
what a schedule would cost on a described set of links.

Example:
  >>> shapes = jax.eval_shape(init)  # the state, as ShapeDtypeStructs
  >>> segments, layer_bytes = jcxl.planning.step_timeline(
  ...     train_step, (shapes.params, shapes.opt_state), batch)
  >>> links = {"cxl": jcxl.planning.Link(bandwidth=32e9, latency_s=2e-6)}
  >>> choice = jcxl.planning.choose_schedule(segments, links,
  ...                                        prefetch_budget=1 << 30)
  >>> choice.prediction.step_s
  >>> step = jcxl.cxl_offload(train_step, schedule=jcxl.LayerSchedule.of(
  ...     choice.prefetch, choice.chunk_bytes))

Timelines:
  step_timeline: traced on abstract shapes; compute estimated from the
    equations, or timed segment by segment on this device (`timed=True`).
  measured_timeline: each segment's compute measured in the offloaded step
    itself, run on zeros from a throwaway host pool.

Cost model:
  Segment, Link: the timeline and a tier's link as the cost model sees them.
  simulate: a step's time and stalls under given prefetch distances.
  choose_schedule: the per-layer prefetch distances (and chunks) that
    minimize the simulated step within a device-memory budget.
  choose_tiers: which tier each layer's objects should sit in.

What a step hands back about its schedule (types to annotate with or test
against; users get them from a step, not by building them):
  StepProfile, LayerProfile: ``step.last_profile`` and
    ``step.measured_call(...)``: what a measured step did, per layer.
  Tuner, TunerEvent, TunerOptions: ``step.tuner`` under
    ``schedule="dap"``, its ``history``, and its knobs
    (``step.tuner.options = TunerOptions(...)``).

Measures of this machine:
  device_rates: the default device's matmul and elementwise rates.
  round_trip_seconds: what a waited-for fetch costs beyond its link (the
    copy engine's round trip), for ``Link.hold_s``.
  saved_residual_bytes: the activations a forward pass keeps for backward.
  device_need: device bytes a compiled step needs (what `device_budget` is
    checked against), from its ``memory_analysis()``.
"""

from jcxl._src.compute_measure import measured_timeline as measured_timeline
from jcxl._src.schedules.compute_estimate import device_rates as device_rates
from jcxl._src.schedules.costmodel import Choice as Choice
from jcxl._src.schedules.costmodel import Link as Link
from jcxl._src.schedules.costmodel import Prediction as Prediction
from jcxl._src.schedules.costmodel import Segment as Segment
from jcxl._src.schedules.costmodel import choose_schedule as choose_schedule
from jcxl._src.schedules.costmodel import choose_tiers as choose_tiers
from jcxl._src.schedules.costmodel import device_need as device_need
from jcxl._src.schedules.costmodel import simulate as simulate
from jcxl._src.jax_compat import saved_residual_bytes as saved_residual_bytes
from jcxl._src.offload.step import step_timeline as step_timeline
from jcxl._src.schedules.options import TunerOptions as TunerOptions
from jcxl._src.schedules.profile import LayerProfile as LayerProfile
from jcxl._src.schedules.profile import StepProfile as StepProfile
from jcxl._src.schedules.tuner import Tuner as Tuner
from jcxl._src.schedules.tuner import TunerEvent as TunerEvent
from jcxl._src.transfer_estimate import round_trip_seconds as round_trip_seconds

__all__ = [
    "Choice",
    "LayerProfile",
    "Link",
    "Prediction",
    "Segment",
    "StepProfile",
    "Tuner",
    "TunerEvent",
    "TunerOptions",
    "choose_schedule",
    "choose_tiers",
    "device_need",
    "device_rates",
    "measured_timeline",
    "round_trip_seconds",
    "saved_residual_bytes",
    "simulate",
    "step_timeline",
]
