"""Dynamic Adaptive Pipelining: the cost model, measured steps, and the
online tuner that chooses a step's schedule from them."""
