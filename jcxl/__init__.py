"""jcxl: train JAX models larger than accelerator memory.

Parameters and optimizer state live in a tiered pool outside the device
(CXL memory, host DRAM, NVMe files) and stream into the jitted step.
"""

from jcxl._src.errors import CheckpointCorruptError as CheckpointCorruptError
from jcxl._src.errors import JcxlError as JcxlError
from jcxl._src.errors import PoolClosedError as PoolClosedError
from jcxl._src.errors import PoolExhaustedError as PoolExhaustedError
from jcxl._src.errors import PoolMismatchError as PoolMismatchError
from jcxl._src.errors import StepMismatchError as StepMismatchError
from jcxl._src.errors import TierIOError as TierIOError
from jcxl._src.errors import TransferTimeoutError as TransferTimeoutError
from jcxl._src.errors import UnknownHandleError as UnknownHandleError
from jcxl._src.offload.reports import LayerReport as LayerReport
from jcxl._src.offload.step import OffloadedStep as OffloadedStep
from jcxl._src.offload.step import cxl_offload as cxl_offload
from jcxl._src.placement import gather as gather
from jcxl._src.placement import place as place
from jcxl._src.link_model import DEFAULT_CXL_LINK as DEFAULT_CXL_LINK
from jcxl._src.link_model import LinkModel as LinkModel
from jcxl._src.pool import Pool as Pool
from jcxl._src.tier import Tier as Tier
from jcxl._src.transfers import TransferRecord as TransferRecord
from jcxl._src.pool_array import PoolArray as PoolArray
from jcxl._src.pool_init import init_in_pool as init_in_pool
from jcxl._src.pool_init import tiers_by_reads as tiers_by_reads
from jcxl._src.registry import cuda_available as cuda_available
from jcxl._src.schedules.plan import LayerPlan as LayerPlan
from jcxl._src.schedules.plan import LayerSchedule as LayerSchedule
from jcxl._src.schedules.plan import Plan as Plan
from jcxl._src.stream import fetch as fetch
from jcxl._src.stream import layer_scan as layer_scan
from jcxl._src.stream import store as store
from jcxl._src.stream import streamed_scan as streamed_scan
from jcxl import distributed as distributed
from jcxl import planning as planning
from jcxl import topology as topology
from jcxl import units as units

__all__ = [
    # Errors.
    "CheckpointCorruptError",
    "JcxlError",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolMismatchError",
    "StepMismatchError",
    "TierIOError",
    "TransferTimeoutError",
    "UnknownHandleError",
    # The pool and what lives in it.
    "DEFAULT_CXL_LINK",
    "LinkModel",
    "Pool",
    "PoolArray",
    "Tier",
    "TransferRecord",
    "gather",
    "init_in_pool",
    "place",
    "tiers_by_reads",
    # Streaming inside a jitted function.
    "fetch",
    "layer_scan",
    "store",
    "streamed_scan",
    # Offloaded steps and what they report.
    "LayerPlan",
    "LayerReport",
    "LayerSchedule",
    "OffloadedStep",
    "Plan",
    "cxl_offload",
    "cuda_available",
    # Modules.
    "checkpoint",
    "distributed",
    "planning",
    "topology",
    "units",
]


def __getattr__(name: str):
  # jcxl.checkpoint brings in Orbax (about a second to import): loaded on
  # first use, not with jcxl.
  # jcxl.experimental, outside the stable face, is not in __all__.
  if name in ("checkpoint", "experimental"):
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"jcxl.{name}")
  raise AttributeError(f"module 'jcxl' has no attribute {name!r}")
