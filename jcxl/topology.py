"""NUMA topology: nodes, distances, memory tiers, CXL nodes (public module)."""

from jcxl._src.topology import Hmat as Hmat
from jcxl._src.topology import NumaNode as NumaNode
from jcxl._src.topology import Topology as Topology
from jcxl._src.topology import device_node as device_node
from jcxl._src.topology import discover as discover
from jcxl._src.topology import node_of_current_process as node_of_current_process

__all__ = ["Hmat", "NumaNode", "Topology", "device_node", "discover",
           "node_of_current_process"]
