"""experiments.big_model's verdicts and its Markdown report.

``summarize`` adds to a run's results what follows from its measured
figures (each step's lower bound and ratio, the warm steps' median and
worst, bytes per parameter against the minimum, whether the loss fell and
peak RSS stayed under its limit); ``markdown`` renders them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments import big_model_bounds as bounds
from jcxl.units import format_bytes

RSS_LIMIT = 0.3  # peak RSS over physical memory, at most


def summarize(results: dict[str, Any]) -> None:
  """The bound, the ratios, the bytes per parameter, the loss and memory
  verdicts, from the figures measured in the same run."""
  dd = _faster(results["dd"]["before"], results["dd"]["after"])
  rows = results["steps"]
  compute = results["compute_alone"]["seconds"]
  for row in rows:
    # The probes beside the step where there are any, else the run's dd.
    row["dd_reference"] = (_faster(row["dd_beside"]["before"],
                                   row["dd_beside"]["after"])
                           if "dd_beside" in row else dd)
    row["lower_bound_s"] = bounds.lower_bound(
        compute, row["disk_read"], row["disk_written"], row["dd_reference"])
    row["lower_bound_run_dd_s"] = bounds.lower_bound(
        compute, row["disk_read"], row["disk_written"], dd)
    row["bytes_per_param"] = bounds.bytes_per_param(
        row, results["parameters"], results["nvme_state_bytes"])
  results["dd_reference"] = dd
  results["dd_beside_steps"] = all("dd_beside" in r for r in rows)
  results["step_vs_bound"] = [r["step_s"] / r["lower_bound_s"] for r in rows]
  results["warm_step_vs_bound"] = bounds.warm_ratios(results["step_vs_bound"])
  results["warm_step_vs_bound"]["within_1_2"] = (
      results["warm_step_vs_bound"]["worst"] <= 1.2)
  results["warm_step_vs_run_dd_bound"] = bounds.warm_ratios(
      [r["step_s"] / r["lower_bound_run_dd_s"] for r in rows])
  warm = rows[-bounds.WARM_STEPS:] if len(rows) > bounds.WARM_STEPS else (
      rows[1:] or rows)
  results["bytes_per_param_warm"] = bounds.bytes_per_param(
      {k: float(np.mean([r[k] for r in warm])) for k in
       ("disk_read", "disk_written", "link_in", "link_out", "nvme_fetched",
        "nvme_stored")}, results["parameters"], results["nvme_state_bytes"])
  timed = rows[1:] or rows  # the first warms up
  nvme = {d: float(np.mean([r["nvme_gbps"][d] for r in timed]))
          for d in ("read", "write")}
  results["nvme_vs_dd"] = {
      "dd_read": dd["read"], "dd_write": dd["write"],
      "read": nvme["read"], "write": nvme["write"],
      "read_ratio": nvme["read"] / dd["read"],
      "write_ratio": nvme["write"] / dd["write"]}
  for tier, link in results.get("links", {}).items():
    rates = {d: float(np.mean([r["tier_gbps"][tier][d] for r in timed]))
             for d in ("read", "write")}
    results[f"{tier}_vs_link"] = {
        "link": link["bandwidth"], "read": rates["read"],
        "write": rates["write"], "read_ratio": rates["read"] / link["bandwidth"],
        "write_ratio": rates["write"] / link["bandwidth"]}
  k = max(1, len(rows) // 4)
  first = float(np.mean([r["loss"] for r in rows[:k]]))
  last = float(np.mean([r["loss"] for r in rows[-k:]]))
  results["loss"] = {"steps_averaged": k, "first_mean": first,
                     "last_mean": last, "falls": last < first}
  results["peak_rss_over_physical"] = (results["peak_rss_bytes"] /
                                       results["physical_memory_bytes"])
  results["peak_rss_within_limit"] = (results["peak_rss_over_physical"] <=
                                      RSS_LIMIT)
  results["peak_rss_over_state"] = (results["peak_rss_bytes"] /
                                    results["state_bytes"])


def _faster(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
  """Per direction, the faster of two dd measures (the stricter bound)."""
  return {d: max(a[d], b[d]) for d in ("read", "write")}


def _bytes_table(b: dict[str, Any]) -> list[str]:
  lines = ["| flow | bytes/param | minimum | over | where the excess goes |",
           "| --- | --- | --- | --- | --- |"]
  for name, f in b["flows"].items():
    excess = "; ".join(f"{k} {v:.2f}" for k, v in f["excess"].items())
    lines.append(f"| {name.replace('_', ' ')} | {f['measured']:.2f} | "
                 f"{f['minimum']:.2f} | {f['over_minimum']:.2f} | {excess} |")
  lines.append(f"| all | {b['measured']:.2f} | {b['minimum']:.2f} | "
               f"{b['measured'] - b['minimum']:.2f} | {b['ratio']:.2f}x the "
               "minimum |")
  return lines


def markdown(r: dict[str, Any]) -> str:
  c = r["config"]
  gb = lambda x: f"{x / 1e9:.2f}"
  size = ("" if r["full_size"] else
          " (SMALLER than the issue's run: a validation run)")
  w = r["warm_step_vs_bound"]
  rd = r["warm_step_vs_run_dd_bound"]
  ca = r["compute_alone"]
  disk = r["machine"].get("disk") or {}
  lines = [
      f"# big_model: {r['parameters'] / 1e9:.3f}B parameters, state "
      f"{r['state_over_physical']:.2f}x physical memory{size}",
      "",
      f"- date: {r['date']}; commit: {r['commit']}",
      f"- machine: {r['machine']['usable_cores']} cores "
      f"{r['machine']['cpu_model']}, {format_bytes(r['physical_memory_bytes'])}"
      f" memory; disk: {disk.get('device')} ({disk.get('fs_type')}), "
      f"{format_bytes(r['disk_free_bytes'])} free at the start; load "
      f"average {r['load_average']['start']} at the start, "
      f"{r['load_average'].get('end')} at the end",
      f"- config: width {c['n_embd']}, {c['n_layer']} blocks, {c['n_head']} "
      f"heads, byte vocab, {c['compute_dtype']} compute from fp32 master "
      f"weights, update={c['update']}, refetch={c['refetch']}, batch "
      f"{c['batch']} x {c['seq_len']} tokens, {c['steps']} steps, adamw lr "
      f"{c['learning_rate']} (warmup {c['warmup_steps']}), fast tier "
      f"{c['fast_tier']} {format_bytes(c['fast_capacity'])}, request "
      f"{format_bytes(c['chunk_bytes'])}",
      "- tiers: " + "; ".join(r["tiers"].values()),
      f"- {r.get('weight_copies') or 'weight copies: none'}",
      "",
      f"state {format_bytes(r['state_bytes'])} "
      f"({format_bytes(r['nvme_state_bytes'])} of it on nvme); peak RSS "
      f"{format_bytes(r['peak_rss_bytes'])} = "
      f"{r['peak_rss_over_physical']:.2f}x physical memory (limit "
      f"{RSS_LIMIT}: {'within' if r['peak_rss_within_limit'] else 'OVER'}), "
      f"{r['peak_rss_over_state']:.2f}x the state; init in the pool "
      f"{r['init']['seconds']:.0f} s (peak RSS "
      f"{format_bytes(r['init']['peak_rss_bytes'])}); compile "
      f"{r['compile_s']:.0f} s",
      "",
      f"loss: mean of the first {r['loss']['steps_averaged']} steps "
      f"{r['loss']['first_mean']:.4f}, of the last "
      f"{r['loss']['steps_averaged']} "
      f"{r['loss']['last_mean']:.4f}: "
      f"{'falls' if r['loss']['falls'] else 'DOES NOT FALL'}.",
      "",
      f"compute alone (the resident jax.jit step in a child process): "
      f"{ca['blocks_1_s']:.3f} s at 1 block, {ca['blocks_3_s']:.3f} s at 3, "
      f"so {ca['seconds']:.2f} s at {ca['n_layer']}"
      + (f" (timed whole: {ca['measured_whole_s']:.2f} s)"
         if "measured_whole_s" in ca else "") + ".",
      "",
      f"step / lower bound over the last {w['steps']} steps: median "
      f"{w['median']:.2f}, worst {w['worst']:.2f} (target 1.2: "
      f"{'met' if w['within_1_2'] else 'NOT met'}); the bound is max(compute "
      "alone, disk reads / dd's read rate + writes / its write rate), "
      + ("dd's rates the faster of the probes before and after each step "
         f"(their columns below); against dd before and after the run "
         f"(read {gb(r['dd_reference']['read'])}, write "
         f"{gb(r['dd_reference']['write'])} GB/s) the last "
         f"{rd['steps']} steps were median {rd['median']:.2f}, worst "
         f"{rd['worst']:.2f}."
         if r.get("dd_beside_steps") else
         f"dd read {gb(r['dd_reference']['read'])} GB/s, write "
         f"{gb(r['dd_reference']['write'])} GB/s (the faster of before and "
         "after the run)."),
      "",
      "| step | loss | step s | compute in step s | waits on copies s | "
      "host update s | nvme copies busy r/w s | disk read GB | disk written GB | "
      "link in/out GB | bytes/param | dd r/w GB/s | lower bound s | "
      "step / bound |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- | --- | --- |"]
  for i, (row, ratio) in enumerate(zip(r["steps"], r["step_vs_bound"])):
    lines.append(
        f"| {i + 1} | {row['loss']:.4f} | {row['step_s']:.2f} | "
        f"{row['compute_in_step_s']:.2f} | {row['waits_s']:.2f} | "
        f"{row['host_update_s']:.2f} | {row['disk_busy_read_s']:.2f} / "
        f"{row['disk_busy_write_s']:.2f} | {gb(row['disk_read'])} | "
        f"{gb(row['disk_written'])} | {gb(row['link_in'])} / "
        f"{gb(row['link_out'])} | {row['bytes_per_param']['measured']:.1f} | "
        f"{gb(row['dd_reference']['read'])} / "
        f"{gb(row['dd_reference']['write'])} | "
        f"{row['lower_bound_s']:.2f} | {ratio:.2f} |")
  lines += [
      "",
      "Compute in step: the step less its waits on the pool's copies "
      "(StepProfile; it includes the wait for the host update's last runs "
      "and, on this machine, the copies' CPU time). Waits on copies: reads "
      "and writes together (StepProfile.stall_s). Host update: its runs' "
      "time, start to end, summed (they overlap the step). nvme copies busy: "
      "the union of the times of the device's fetches from (stores to) "
      "nvme; the host update's own disk I/O is in its time.",
      "",
      f"Bytes per parameter per step, mean of the last {w['steps']} steps, "
      "against the data flow's minimum (the nvme state read and written "
      "once; bfloat16 weights in and gradients out once):",
      ""] + _bytes_table(r["bytes_per_param_warm"])
  v = r["nvme_vs_dd"]
  lines += [
      "",
      f"nvme tier during training (steps 2 on, busy time) vs dd O_DIRECT "
      f"with the same request size, same run (best of before/after): read "
      f"{gb(v['read'])} / {gb(v['dd_read'])} GB/s = {v['read_ratio']:.2f}, "
      f"write {gb(v['write'])} / {gb(v['dd_write'])} GB/s = "
      f"{v['write_ratio']:.2f}. dd before: read "
      f"{gb(r['dd']['before']['read'])}, write "
      f"{gb(r['dd']['before']['write'])}; after: read "
      f"{gb(r['dd']['after']['read'])}, write "
      f"{gb(r['dd']['after']['write'])} GB/s.",
      ""]
  for tier in r.get("links", {}):
    v = r[f"{tier}_vs_link"]
    lines += [
        f"{tier} tier during training (steps 2 on, busy time) vs its link's "
        f"{gb(v['link'])} GB/s: read {gb(v['read'])} GB/s = "
        f"{v['read_ratio']:.2f}, write {gb(v['write'])} GB/s = "
        f"{v['write_ratio']:.2f}.", ""]
  sw = r.get("swap")
  if sw:
    lines += [
        f"swap: SwapTotal {format_bytes(sw['swap_total_bytes'] or 0)}; this "
        f"process's VmSwap at most {format_bytes(sw['max_vm_swap_bytes'])} "
        f"(sampled every progress line and at the end): "
        f"{'nothing swapped' if sw['none_swapped'] else 'SWAPPED'}.", ""]
  ck = r["checkpoint"]
  if "skipped" in ck:
    lines.append(f"checkpoint: skipped: {ck['skipped']}.")
  else:
    where = ("at full size" if ck["size"] == "full" else
             f"NOT at full size ({ck['why']}), so at the largest size that "
             f"fits: {ck['n_layer']} blocks, {ck['parameters'] / 1e9:.3f}B "
             "parameters")
    lines.append(
        f"checkpoint {where}: the state ({format_bytes(ck['bytes'])}) saved "
        f"after the timed steps in {ck['save_s']:.0f} s, peak RSS "
        f"{format_bytes(ck['save_peak_rss_bytes'])}; restored in "
        f"{ck['restore_s']:.0f} s; the next step's loss from it "
        f"{ck['resumed_loss']:.6f} vs uninterrupted "
        f"{ck['uninterrupted_loss']:.6f}: "
        f"{'equal' if ck['equal'] else 'DIFFERENT'}.")
  lines += ["", "plan:", "```", r["plan"], "```", ""]
  return "\n".join(lines)
