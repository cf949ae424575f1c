"""A traced step as the passes over it see it.

* ``program``: the flat program (a jaxpr with call-like equations inlined,
  variables keyed by scope), and the reordering by layer;
* ``regions``: elementwise work on pool state, as the host update and the
  sliced update find it.
"""
