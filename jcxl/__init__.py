"""jcxl: train JAX models larger than accelerator memory.

Parameters and optimizer state live in a tiered pool outside the device
(CXL memory, host DRAM, NVMe files) and stream into the jitted step.
"""

from jcxl._src.errors import CheckpointCorruptError as CheckpointCorruptError
from jcxl._src.errors import JcxlError as JcxlError
from jcxl._src.errors import PoolClosedError as PoolClosedError
from jcxl._src.errors import PoolExhaustedError as PoolExhaustedError
from jcxl._src.errors import PoolMismatchError as PoolMismatchError
from jcxl._src.errors import TierIOError as TierIOError
from jcxl._src.errors import TransferTimeoutError as TransferTimeoutError
from jcxl._src.errors import UnknownHandleError as UnknownHandleError
from jcxl._src.placement import gather as gather
from jcxl._src.placement import place as place
from jcxl._src.pool_init import init_in_pool as init_in_pool
from jcxl._src.pool_init import tiers_by_reads as tiers_by_reads
from jcxl._src.pool import LinkModel as LinkModel
from jcxl._src.pool import Pool as Pool
from jcxl._src.pool import Tier as Tier
from jcxl._src.pool_array import PoolArray as PoolArray
from jcxl._src.stream import fetch as fetch
from jcxl._src.stream import store as store
from jcxl._src.transform import cxl_offload as cxl_offload
from jcxl import distributed as distributed
from jcxl import topology as topology

__all__ = [
    "CheckpointCorruptError",
    "JcxlError",
    "LinkModel",
    "Pool",
    "PoolArray",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolMismatchError",
    "Tier",
    "TierIOError",
    "TransferTimeoutError",
    "UnknownHandleError",
    "checkpoint",
    "cxl_offload",
    "distributed",
    "fetch",
    "gather",
    "init_in_pool",
    "place",
    "store",
    "tiers_by_reads",
    "topology",
]


def __getattr__(name: str):
  # jcxl.checkpoint brings in Orbax (about a second to import): loaded on
  # first use, not with jcxl.
  if name == "checkpoint":
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("jcxl.checkpoint")
  raise AttributeError(f"module 'jcxl' has no attribute {name!r}")
