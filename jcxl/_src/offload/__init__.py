"""The offload core: a step traced, analysed, rewritten to stream its
pool-resident state, compiled and cached (``cxl_offload``)."""
