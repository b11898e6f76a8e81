#!/usr/bin/env python
"""Recovery after a host failure: from host stores (tenplex) versus persistent checkpoints only.

Two simulated hosts (a store process and a torchrun agent with 2 workers each, layout
dp=1,tp=2,pp=2) train; after a given step one host dies (store, agent and workers). Mode
"stores": snapshots go to the host stores every few steps (one replica on the other host)
and the survivor recovers from memory. Mode "persistent": only persistent checkpoints (a
local directory here) every K steps, as peers do. Reported per mode: recovery time (failure
to the first step finished after resuming), its parts, steps lost, bytes per tier.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tenplex.cli import human_bytes  # noqa: E402
from tenplex.train.launch import RendezvousStore, free_port, read_train_log, start_hosts, wait_for  # noqa: E402




def run(model: str, mode: str, *, steps: int, fail_after: int, snapshot_every: int, ckpt_every: int,
        extra: list[str], shm: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"tenplex-rec-{model}-{mode}-"))
    store_dir = tempfile.mkdtemp(prefix="tenplex-rec-", dir=shm) if os.path.isdir(shm) else str(work)
    log = work / "log.jsonl"
    args = ["--model", model, "--steps", str(steps), "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(work / "ckpt"),
            "--log", str(log), *extra]
    if mode == "stores":
        args += ["--store", "auto", "--snapshot-every", str(snapshot_every), "--ckpt-every", str(10**6)]
    else:
        args += ["--ckpt-every", str(ckpt_every)]
    rdzv = RendezvousStore()
    hosts = start_hosts(2, str(work), args, nproc=2, endpoint=rdzv.endpoint, run_id=f"b{free_port()}",
                        store_dir=store_dir)
    try:
        def four() -> int:
            return max([o["step"] for o in read_train_log(log)[0] if o["world_size"] == 4] or [0])

        if not wait_for(lambda: four() >= fail_after, 900):
            raise RuntimeError(f"{model}/{mode}: did not reach step {fail_after}; see {work}")
        fail_step, t_fail = four(), time.time()
        hosts[1].kill()
        rc = hosts[0].agent.wait(timeout=1800)
        if rc != 0:
            raise RuntimeError(f"{model}/{mode}: survivor failed ({rc}); see {work}")
    finally:
        for h in hosts:
            h.stop()
        rdzv.stop()
    runs, starts = read_train_log(log)
    resume = [s for s in starts if s["wall"] > t_fail][-1]
    first = min((r for r in runs if r["wall"] > t_fail), key=lambda r: r["wall"])
    out = {
        "model": model, "mode": mode, "fail_step": fail_step, "resumed_step": resume["step"],
        "steps_lost": fail_step - resume["step"],
        "recovery_s": first["wall"] - t_fail,
        "restart_s": resume["process_start"] - t_fail,
        "startup_s": resume["wall"] - resume["process_start"],
        "load_s": resume["timings"].get("load", 0.0),
        "first_step_s": first["wall"] - resume["wall"],
        "step_s": sorted(r["time_s"] for r in runs if r["world_size"] == 4)[len([r for r in runs if r["world_size"] == 4]) // 2],
        "bytes_by_tier": resume.get("bytes_by_tier_all", {}),
        "bytes_needed": resume.get("bytes_needed_all", 0),
    }
    # time to get back to where the failure struck: recovery plus redoing the lost steps
    out["time_to_catch_up_s"] = out["recovery_s"] + max(0, out["steps_lost"] - 1) * out["step_s"]
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(store_dir, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the host stores")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    cases = [("tiny", dict(steps=16, fail_after=9, snapshot_every=1, ckpt_every=5,
                           extra=["--global-batch", "8", "--micro-batch", "2"]))]
    if not args.quick:
        cases.append(("llama-100m", dict(steps=11, fail_after=7, snapshot_every=1, ckpt_every=4,
                                         extra=["--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3"])))
    rows = []
    for model, kw in cases:
        for mode in ("stores", "persistent"):
            print(f"{model} / {mode} ...", file=sys.stderr, flush=True)
            r = run(model, mode, shm=args.shm, **kw)
            print(f"  recovery {r['recovery_s']:.1f}s, steps lost {r['steps_lost']}, tiers {r['bytes_by_tier']}",
                  file=sys.stderr, flush=True)
            rows.append(r)
    lines = ["| model | recovery from | failure after step | resumed at | steps lost | recovery s (failure -> first step) "
             "| restart + rendezvous s | start-up s | load s | step s | catch-up s | bytes local / peer / storage |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        t = r["bytes_by_tier"]
        lines.append(f"| {r['model']} | {'host stores' if r['mode'] == 'stores' else 'persistent checkpoint'} "
                     f"| {r['fail_step']} | {r['resumed_step']} | {r['steps_lost']} | {r['recovery_s']:.1f} "
                     f"| {r['restart_s']:.1f} | {r['startup_s']:.1f} | {r['load_s']:.2f} | {r['step_s']:.2f} "
                     f"| {r['time_to_catch_up_s']:.1f} | {human_bytes(t.get('local', 0))} / {human_bytes(t.get('peer', 0))}"
                     f" / {human_bytes(t.get('storage', 0))} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    if not args.quick:
        (out / "bench_recovery.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                                                             "machine": platform.platform(), "cpus": os.cpu_count(),
                                                             "rows": rows}, indent=1))
        (out / "bench_recovery.md").write_text(
            "# Recovery after a host failure\n\n"
            f"`python scripts/bench_recovery.py` on {platform.platform()}, {os.cpu_count()} CPUs, "
            f"{time.strftime('%Y-%m-%d')}.\n\n" + __doc__.split("\n", 1)[1] + "\n" + table + "\n\n"
            "catch-up = recovery + (steps lost - 1) x step time: when training is back where it was.\n"
            "Persistent storage here is a local directory (page-cached), so the load itself is fast in both\n"
            "modes; the difference is what peers lose: the steps since the last persistent checkpoint.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
