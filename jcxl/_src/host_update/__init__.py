"""The host update: a step's optimizer update run next to the memory.

``cxl_offload(update='host'|'auto')`` runs each layer's elementwise
optimizer update on the host CPU, in place on the pool's objects, instead
of on the device (docs/host-update.md). `plan.plan_host_updates` is the one
pass over a traced step that does it, from these modules:

* ``ir``: the frozen records the passes return (a host update's node, its
  lowered program, its weight copies, each layer's choice);
* ``find``: finds the updates that can run on the host, and why others
  cannot;
* ``lower``: lowers an update to an update program, once;
* ``choose``: where each update runs ('auto': by measured rates);
* ``copies``: bfloat16 copies of float32 weights the update also writes;
* ``runtime``: the gradients' and copies' pool objects and the registered
  programs, made once and freed with the step;
* ``plan``: the pass itself, and the plan's lines about it;
* ``scan_casts``: widening casts moved out of a loop, so gradients leave
  the device narrow;
* ``sliced``: the device path's update of stacked or large state, run as a
  loop over slices.
"""
