"""Byte counts and bandwidths as people write them ("2GiB", "16GB/s").

Example:
  >>> jcxl.units.parse_bytes("2GiB")
  2147483648
  >>> jcxl.units.format_bandwidth(jcxl.units.parse_bandwidth("16GB/s"))
  '16.0 GB/s'
"""

from jcxl._src.units import format_bandwidth as format_bandwidth
from jcxl._src.units import format_bytes as format_bytes
from jcxl._src.units import parse_bandwidth as parse_bandwidth
from jcxl._src.units import parse_bytes as parse_bytes

__all__ = ["format_bandwidth", "format_bytes", "parse_bandwidth",
           "parse_bytes"]
