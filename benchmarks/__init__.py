"""Benchmark helpers: timing against baselines, machine descriptions, and
allocation traces replayed against the pool's allocator. Used by the
programs in experiments/; not part of the jcxl library."""
