"""Test setup: 8 virtual CPU devices, so sharded paths run on this machine."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
