"""Tests for benchmarks.alloc_trace: model shapes, traces and their replay."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from benchmarks import alloc_trace
from experiments import alloc_trace as program
from jcxl import PoolExhaustedError

FRAGMENTATION_LIMIT = 0.05
LIVE_OVER_RESERVED_LIMIT = 0.95


@functools.lru_cache(maxsize=None)
def _trace(model: str, steps: int = 2, seed: int = 0) -> alloc_trace.Trace:
  return alloc_trace.build_trace(
      alloc_trace.TraceConfig(model=model, steps=steps, seed=seed))


@functools.lru_cache(maxsize=None)
def _replay(model: str, policy: str) -> alloc_trace.ReplayResult:
  return alloc_trace.replay(_trace(model), policy)


def _without_times(result: alloc_trace.ReplayResult) -> dict:
  fields = dataclasses.asdict(result)
  for name in ("mean_alloc_ns", "p99_alloc_ns", "max_alloc_ns"):
    del fields[name]
  return fields


class ModelShapesTest:

  @pytest.mark.parametrize("model", alloc_trace.MODEL_NAMES)
  def test_parameter_count_matches_published(self, model):
    shapes = alloc_trace.model_shapes(model)
    assert (shapes.parameter_count
            == alloc_trace.PUBLISHED_PARAMETER_COUNTS[model])

  def test_gpt2_small_is_124m(self):
    assert alloc_trace.model_shapes("gpt2").parameter_count == 124_439_808

  def test_gpt2_head_is_tied_and_llama_head_is_not(self):
    gpt2 = dict(alloc_trace.model_shapes("gpt2").params)
    llama = dict(alloc_trace.model_shapes("llama-7b").params)
    assert "wte" in gpt2 and not any("lm_head" in n for n in gpt2)
    assert llama["output"] == (4096, 32000)
    assert llama["h.31.feed_forward.w2"] == (11008, 4096)

  def test_unknown_model_raises_value_error_naming_the_choices(self):
    with pytest.raises(ValueError, match=r"'gpt2'.*'llama-7b', but got 'gpt3'"):
      alloc_trace.model_shapes("gpt3")

  def test_unknown_dtype_raises(self):
    with pytest.raises(ValueError, match="dtype must be one of"):
      alloc_trace.dtype_bytes("int4")


class TraceTest:

  def test_step_zero_allocates_parameters_and_both_moments(self):
    trace = _trace("gpt2")
    step0 = [e for e in trace.events if e.step == 0]
    assert all(e.nbytes for e in step0)
    state = [e for e in step0 if not trace.labels[e.key].startswith("tokens")]
    params = alloc_trace.model_shapes("gpt2").parameter_count
    # float32 parameters, mu and nu, and Adam's int32 step count.
    assert sum(e.nbytes for e in state) == 3 * params * 4 + 4
    assert len(step0) - len(state) == 1  # the first batch of tokens

  def test_only_state_and_small_objects_outlive_the_last_step(self):
    trace = _trace("llama-7b")
    live = {}
    for e in trace.events:
      if e.nbytes:
        live[e.key] = e.nbytes
      else:
        del live[e.key]
    labels = sorted({trace.labels[k].split(".")[0] for k in live})
    assert labels == ["adam", "loss", "mu", "nu", "param", "tokens"]

  def test_gradients_are_freed_in_reverse_layer_order(self):
    trace = _trace("gpt2", steps=1)
    freed = [trace.labels[e.key] for e in trace.events if not e.nbytes]
    layers = [int(n.split(".")[2]) for n in freed
              if n.startswith("grad.h.") and n.endswith("c_attn.w")]
    assert layers == list(reversed(range(12)))

  def test_build_is_deterministic_and_seeded(self):
    config = alloc_trace.TraceConfig(model="gpt2", steps=2, seed=3)
    assert alloc_trace.build_trace(config) == alloc_trace.build_trace(config)
    other = alloc_trace.build_trace(dataclasses.replace(config, seed=4))
    assert other.events != alloc_trace.build_trace(config).events

  @pytest.mark.parametrize("field, value, match", [
      ("model", "gpt3", "model must be one of"),
      ("steps", -1, "steps must be >= 0"),
      ("batch", 0, "batch must be >= 1"),
      ("seq_len", 8, "seq_len must be >= 64"),
      ("dtype", "float8", "dtype must be one of"),
  ])
  def test_bad_config_raises(self, field, value, match):
    config = dataclasses.replace(
        alloc_trace.TraceConfig(model="gpt2"), **{field: value})
    with pytest.raises(ValueError, match=match):
      alloc_trace.build_trace(config)


class ReplayTest:

  @pytest.mark.parametrize("model", ["gpt2", "llama-7b"])
  def test_hybrid_fragmentation_is_low_at_peaks_and_end(self, model):
    result = _replay(model, "hybrid")
    assert len(result.peaks) == 3  # step 0 and two training steps
    for point in result.peaks + (result.final,):
      assert point.external_fragmentation < FRAGMENTATION_LIMIT, point
      assert point.live_over_reserved > LIVE_OVER_RESERVED_LIMIT, point

  def test_peak_live_matches_the_trace(self):
    result = _replay("gpt2", "hybrid")
    assert result.peak_live == _trace("gpt2").peak_live
    assert max(p.live for p in result.peaks) == result.peak_live
    assert result.peak_reserved >= result.peak_live

  def test_replay_is_deterministic(self):
    first = alloc_trace.replay(_trace("gpt2"), "hybrid")
    again = alloc_trace.replay(_trace("gpt2"), "hybrid")
    assert _without_times(first) == _without_times(again)

  def test_first_fit_baseline_replays_the_same_trace(self):
    hybrid = _replay("gpt2", "hybrid")
    first_fit = _replay("gpt2", "first_fit")
    assert hybrid.allocations == first_fit.allocations
    assert hybrid.peak_live == first_fit.peak_live
    assert hybrid.alignment == 4096 and first_fit.alignment == 16

  def test_default_capacity_is_one_and_a_half_peaks(self):
    trace = _trace("gpt2")
    capacity = alloc_trace.default_capacity(trace)
    assert capacity == math.ceil(trace.peak_live * 1.5 / 2**20) * 2**20

  def test_too_small_capacity_raises_pool_exhausted(self):
    with pytest.raises(PoolExhaustedError):
      alloc_trace.replay(_trace("gpt2"), "hybrid", capacity=2**30)

  def test_unknown_policy_raises(self):
    with pytest.raises(ValueError, match="policy must be one of"):
      alloc_trace.replay(_trace("gpt2"), "buddy")


class ComparisonTest:

  def test_table_has_a_row_per_model_and_allocator(self):
    comparison = alloc_trace.Comparison(
        model="gpt2", trace_events=len(_trace("gpt2").events),
        results={p: _replay("gpt2", p) for p in alloc_trace.POLICIES})
    rows = alloc_trace.table_rows([comparison])
    assert [r["allocator"] for r in rows] == ["hybrid", "first_fit"]
    text = alloc_trace.format_table(rows)
    assert all(c in text for c in alloc_trace.TABLE_COLUMNS)
    markdown = alloc_trace.format_table(rows, markdown=True)
    assert markdown.count("\n") == 3

  def test_exhausted_replay_is_reported_not_raised(self, monkeypatch):
    monkeypatch.setattr(alloc_trace, "default_capacity", lambda t: 2**30)
    comparison = alloc_trace.compare(
        alloc_trace.TraceConfig(model="gpt2", steps=1))
    assert all(isinstance(r, str) for r in comparison.results.values())
    rows = alloc_trace.table_rows([comparison])
    assert rows[0]["objects"].startswith("exhausted: ")

  def test_write_results(self, tmp_path):
    comparison = alloc_trace.Comparison(
        model="gpt2", trace_events=len(_trace("gpt2").events),
        results={"hybrid": _replay("gpt2", "hybrid")})
    csv_path, md_path = alloc_trace.write_results([comparison], str(tmp_path))
    lines = open(csv_path).read().splitlines()
    assert lines[0].split(",") == list(alloc_trace.CSV_COLUMNS)
    assert len(lines) == 1 + 3 + 1  # header, three step peaks, the end
    assert "| gpt2" in open(md_path).read()


class ProgramConfigTest:

  def _config(self, **changes) -> program.Config:
    config = program.Config(models=("gpt2",), steps=3, dtype="float32",
                            batch=8, seed=0, donate=True, run_dir=None)
    return dataclasses.replace(config, **changes)

  def test_unknown_model_is_rejected_with_the_choices(self):
    with pytest.raises(ValueError, match=r"'gpt2-xl'.*but got 'gpt-5'"):
      self._config(models=("gpt2", "gpt-5")).validate()

  def test_no_models_is_rejected(self):
    with pytest.raises(ValueError, match="at least one model"):
      self._config(models=()).validate()
