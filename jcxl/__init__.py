"""jcxl: train JAX models larger than accelerator memory.

Parameters and optimizer state live in a tiered pool outside the device
(CXL memory, host DRAM, NVMe files) and stream into the jitted step.
"""

from jcxl._src.errors import JcxlError as JcxlError
from jcxl._src.errors import PoolClosedError as PoolClosedError
from jcxl._src.errors import PoolExhaustedError as PoolExhaustedError
from jcxl._src.errors import TierIOError as TierIOError
from jcxl._src.errors import TransferTimeoutError as TransferTimeoutError
from jcxl._src.errors import UnknownHandleError as UnknownHandleError
from jcxl._src.pool import LinkModel as LinkModel
from jcxl._src.pool import Pool as Pool
from jcxl._src.pool import Tier as Tier
from jcxl import topology as topology

__all__ = [
    "JcxlError",
    "LinkModel",
    "Pool",
    "PoolClosedError",
    "PoolExhaustedError",
    "Tier",
    "TierIOError",
    "TransferTimeoutError",
    "UnknownHandleError",
    "topology",
]
