"""Schedules: how far ahead, and in what pieces, an offloaded step fetches
each layer, and who chooses it.

From the bottom up: the cost model (costmodel, compute_estimate), the plan
records and the schedule spec (plan), measured steps (profile), the DAP
tuner and its parts (options, model, race, drift, tuner, agreement,
compile_ahead), and the schedulers a step asks (scheduler: the protocol and
the static one; dap: the adaptive one). The offload core depends on this
package; nothing here imports it."""
