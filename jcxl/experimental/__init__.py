"""jcxl's lower layers, for code that builds on the runtime itself.

Not part of the stable face: what is here may change between releases, as
in ``jax.experimental``.

  updates: the host update's program IR (``Program``, ``Instr``, ...),
    which ``cxl_offload(update='host')`` builds from a step and
    ``pool.updates`` registers and runs.
"""

from jcxl.experimental import updates as updates

__all__ = ["updates"]
