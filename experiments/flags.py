"""The flags the experiments share, each defined once with one spelling.

A program defines the ones it takes on its own ``FlagValues`` (see
``common.flags_parser``), with its own default where it needs one:

  FLAGS = flags.FlagValues()
  _BATCH = shared_flags.batch(FLAGS, default=4)
  _LINK_BANDWIDTH = shared_flags.link_bandwidth(FLAGS)
  _LINK_LATENCY_US = shared_flags.link_latency_us(FLAGS)
  ...
  link = shared_flags.link(_LINK_BANDWIDTH, _LINK_LATENCY_US)

The emulated cxl link is ``--link_bandwidth`` (e.g. '16GB/s'; a list of
them, ``--link_bandwidths``) and ``--link_latency_us`` everywhere; their
defaults are ``jcxl.DEFAULT_CXL_LINK``'s.
"""

from __future__ import annotations

from typing import Any

from absl import flags

import jcxl

FlagHolder = flags.FlagHolder
_DEFAULT_LINK = jcxl.DEFAULT_CXL_LINK


def _define(kind: str, name: str, default: Any, help_text: str,
            flag_values: flags.FlagValues, **kwargs) -> FlagHolder:
  define = getattr(flags, f"DEFINE_{kind}")
  return define(name, default, help_text, flag_values=flag_values, **kwargs)


def n_layer(flag_values: flags.FlagValues = flags.FLAGS, *,
            default: int | None, help_text: str = "Blocks of the model.",
            **kwargs) -> FlagHolder[int]:
  return _define("integer", "n_layer", default, help_text, flag_values,
                 **kwargs)


def n_embd(flag_values: flags.FlagValues = flags.FLAGS, *,
           default: int | None, help_text: str = "Width of the model.",
           **kwargs) -> FlagHolder[int]:
  return _define("integer", "n_embd", default, help_text, flag_values,
                 **kwargs)


def batch(flag_values: flags.FlagValues = flags.FLAGS, *,
          default: int | None, help_text: str = "Sequences per step.",
          **kwargs) -> FlagHolder[int]:
  return _define("integer", "batch", default, help_text, flag_values,
                 **kwargs)


def seq_len(flag_values: flags.FlagValues = flags.FLAGS, *,
            default: int | None, help_text: str = "Tokens per sequence.",
            **kwargs) -> FlagHolder[int]:
  return _define("integer", "seq_len", default, help_text, flag_values,
                 **kwargs)


def seed(flag_values: flags.FlagValues = flags.FLAGS, *, default: int = 0,
         help_text: str = "Seed of the weights and the data.",
         **kwargs) -> FlagHolder[int]:
  return _define("integer", "seed", default, help_text, flag_values, **kwargs)


def steps(flag_values: flags.FlagValues = flags.FLAGS, *, default: int,
          help_text: str, **kwargs) -> FlagHolder[int]:
  return _define("integer", "steps", default, help_text, flag_values,
                 **kwargs)


def run_dir(flag_values: flags.FlagValues = flags.FLAGS, *,
            default: str | None,
            help_text: str = "Output directory; created if missing.",
            **kwargs) -> FlagHolder[str]:
  return _define("string", "run_dir", default, help_text, flag_values,
                 **kwargs)


def nvme_dir(flag_values: flags.FlagValues = flags.FLAGS, *,
             default: str | None,
             help_text: str = "Directory on a real disk (not tmpfs) for the "
             "nvme tier's file.", **kwargs) -> FlagHolder[str]:
  return _define("string", "nvme_dir", default, help_text, flag_values,
                 **kwargs)


def device_budget(flag_values: flags.FlagValues = flags.FLAGS, *,
                  default: str,
                  help_text: str = "Device memory a step may need, e.g. "
                  "'2GiB'.", **kwargs) -> FlagHolder[str]:
  return _define("string", "device_budget", default, help_text, flag_values,
                 **kwargs)


def json_out(flag_values: flags.FlagValues = flags.FLAGS, *,
             default: str | None = None,
             help_text: str = "Optional path to write the results to as JSON.",
             **kwargs) -> FlagHolder[str]:
  return _define("string", "json_out", default, help_text, flag_values,
                 **kwargs)


def dry_run(flag_values: flags.FlagValues = flags.FLAGS, *, help_text: str,
            **kwargs) -> FlagHolder[bool]:
  return _define("boolean", "dry_run", False, help_text, flag_values,
                 **kwargs)


def link_bandwidth(flag_values: flags.FlagValues = flags.FLAGS, *,
                   default: str = f"{_DEFAULT_LINK.bandwidth / 1e9:g}GB/s",
                   help_text: str = "Bandwidth of the emulated cxl link, e.g. "
                   "'16GB/s'.", **kwargs) -> FlagHolder[str]:
  return _define("string", "link_bandwidth", default, help_text, flag_values,
                 **kwargs)


def link_bandwidths(flag_values: flags.FlagValues = flags.FLAGS, *,
                    default: list[str],
                    help_text: str = "Bandwidths of the emulated cxl link, "
                    "one run each.", **kwargs) -> FlagHolder[list[str]]:
  return _define("list", "link_bandwidths", default, help_text, flag_values,
                 **kwargs)


def link_latency_us(flag_values: flags.FlagValues = flags.FLAGS, *,
                    default: float = _DEFAULT_LINK.latency_s * 1e6,
                    help_text: str = "Per-transfer latency of the emulated "
                    "cxl link, in microseconds.",
                    **kwargs) -> FlagHolder[float]:
  return _define("float", "link_latency_us", default, help_text, flag_values,
                 **kwargs)


def link(bandwidth: FlagHolder[str],
         latency_us: FlagHolder[float]) -> jcxl.LinkModel:
  """The emulated link the two flags describe.

  Raises:
    ValueError: naming the flag whose value is bad.
  """
  if not latency_us.value >= 0:
    raise ValueError(f"--{latency_us.name} must be >= 0, but got "
                     f"{latency_us.value}")
  return jcxl.LinkModel(
      jcxl.units.parse_bandwidth(bandwidth.value, name=f"--{bandwidth.name}"),
      latency_us.value * 1e-6)
