"""Scheduler at the scale of the largest jobs (issue #20, item 5): one node lost mid-job, and full
re-layouts.

Cases (``--case``, default all): GPT-3 175B with a distributed optimizer, TP8 x PP16, on 1,024
GPUs (DP8 -> DP7) and 4,096 GPUs (DP32 -> DP31); Llama 3 405B, TP8 x PP16 x DP128 -> DP127 on
16,384 GPUs with ZeRO-1 and with replicated Adam (one node lost: the alive list is the default
device order, the first half of the devices, the lost host, the rest); Llama 3 405B on 16,384
GPUs re-laid out from TP8 x PP16 x DP128 to TP8 x PP8 x DP256 (every GPU alive, every byte of
state moves) with ZeRO-1 and with replicated Adam (``405b-pp8-*``); Llama 3 405B on 131,072 GPUs
(16,384 hosts), TP8 x PP16 x DP1024 -> DP1023, one node lost, replicated Adam and ZeRO-1
(``405b-131k-*``). The topology is the preset with 8 GPUs a host. Each run is a fresh process;
``--runs`` runs, median and min-max. Peak RSS: the process's (plan included, ``peak_rss_gib``)
and the peak while ``schedule()`` runs (``schedule_peak_rss_gib``: VmHWM reset before the call,
Linux ``/proc/self/clear_refs``; it includes the plan and topology the process holds). Per run: plan seconds, schedule seconds (``time_limit`` 10 s) and its CPU
seconds (near its wall time on an idle machine; the 2-core machine is often shared), method,
completion (``[low, high]`` where the naive completion was cut short at the limit), naive
and lower bound (computed after the timed call where the scheduler had no time for it:
``lower_bound_after_s``), the seconds rendering the hops took on their first read where the
scheduler left them for it (``render_after_s``), ``validate`` seconds, peak RSS during the schedule, and the
1-minute load average before and after the run. Writes the JSON (with the command) to
``--out``.

    .venv/bin/python scripts/bench_schedule_scale.py [--json] [--runs 3] [--case gpt3-1024 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES = ("gpt3-1024", "gpt3-4096", "405b-zero1", "405b-adam", "405b-pp8-zero1", "405b-pp8-adam", "405b-131k-adam",
         "405b-131k-zero1")
LLAMA3_405B = dict(arch="llama", num_layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                   vocab=128256, seq_len=8192)


def run_case(case: str, time_limit: float) -> dict[str, Any]:
    """One run of ``case`` in this process."""
    from tenplex.layout.config import ParallelConfig
    from tenplex.layout.models import model_ptc
    from tenplex.planning.planner import plan
    from tenplex.planning.schedule import demands, lower_bound, schedule, validate
    from tenplex.planning.topology import Topology

    if case.startswith("gpt3-"):
        gpus = int(case.split("-")[1])
        ptc = model_ptc("gpt3-175b", optimizer=True, distributed_optimizer=True)
    else:
        gpus = 131072 if "-131k-" in case else 16384
        ptc = model_ptc(**LLAMA3_405B, optimizer=True, distributed_optimizer=case.endswith("zero1"))
    dp = gpus // 128
    hosts = gpus // 8
    old = ParallelConfig(dp=dp, tp=8, pp=16)
    if "-pp8-" in case:  # a full re-layout: every GPU alive, every byte moves
        new, alive = ParallelConfig(dp=2 * dp, tp=8, pp=8), None
    else:  # one node lost mid-job
        new, alive = ParallelConfig(dp=dp - 1, tp=8, pp=16), list(range(gpus // 2)) + list(range(gpus // 2 + 8, gpus))
    t = time.perf_counter()
    p = plan(ptc, old, new, alive=alive, gpus_per_host=8)
    plan_s = time.perf_counter() - t
    rss_plan = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    topo = Topology.from_spec(f"hosts={hosts},gpus=8,nvlink=300GB/s,pcie=32GB/s,nic=50GB/s")
    rss_before = _vm("VmRSS")
    _reset_peak()
    t, cpu = time.perf_counter(), time.process_time()
    s = schedule(p, topo, time_limit=time_limit)
    solve, cpu = time.perf_counter() - t, time.process_time() - cpu
    sched_peak = _vm("VmHWM")
    rss_sched = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    info = s.info
    naive = info.get("naive_s", info.get("naive_bounds_s"))
    lo, hi = s.completion_bounds()
    render_after = None
    if not s.hops.built:  # the scheduler left the hops to their first read: here, untimed
        t = time.perf_counter()
        s.hops["hop_chunk"]
        render_after = time.perf_counter() - t
    t = time.perf_counter()
    validate(s)
    validate_s = time.perf_counter() - t
    lb, lb_after = info.get("lower_bound_s"), None
    if lb is None:  # the scheduler had no time to group the plan into demands: here, untimed
        t = time.perf_counter()
        lb = lower_bound(demands(p, topo), topo)
        lb_after = time.perf_counter() - t
    return {"case": case, "gpus": gpus, "plan_s": plan_s, "schedule_s": solve, "schedule_cpu_s": cpu, "method": s.method,
            "completion_s": lo if lo == hi else [lo, hi], "naive_s": naive, "naive_floor_s": info.get("naive_floor_s"),
            "lower_bound_s": lb, "lower_bound_after_s": lb_after, "lower_bound_skipped": info.get("lower_bound_skipped"),
            "store_and_forward_s": info.get("store_and_forward_s"), "candidates": info.get("candidates"),
            "render_after_s": render_after, "validate_s": validate_s, "chunks": len(s.chunk_nbytes), "hops": len(s.hop_chunk),
            "moves": len(p.columns["kind"]), "flows": len(s.demands.commodities) if s.method == "naive" else None,
            "skipped": info.get("skipped"), "peak_rss_gib": rss_sched, "plan_rss_gib": rss_plan,
            "rss_before_schedule_gib": rss_before, "schedule_peak_rss_gib": sched_peak}


def _vm(field: str) -> float | None:
    """``field`` of /proc/self/status (VmRSS, VmHWM) in GiB, or None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) so that it measures what follows (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="*", default=list(CASES), choices=CASES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "bench" / "bench_schedule_scale.json"),
                    help="where the JSON goes (default docs/bench/bench_schedule_scale.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args.time_limit)))
        return 0
    out: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "time_limit_s": args.time_limit,
                           "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cases": {}}
    for case in args.case:
        runs = []
        for _ in range(args.runs):
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--one", case, "--time-limit", str(args.time_limit)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                runs.append({"error": f"killed after {args.timeout:.0f} s", "load_avg": load,
                             "load_avg_after": os.getloadavg()[0]})
                continue
            if r.returncode:
                runs.append({"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"rc {r.returncode}",
                             "load_avg": load, "load_avg_after": os.getloadavg()[0]})
                continue
            runs.append({**json.loads(r.stdout.strip().splitlines()[-1]), "load_avg": load,
                         "load_avg_after": os.getloadavg()[0]})
            if not args.json:
                print(json.dumps(runs[-1]), flush=True)
        ok = [r for r in runs if "error" not in r]
        summary: dict[str, Any] = {"runs": runs}
        if ok:
            for key in ("plan_s", "schedule_s", "schedule_cpu_s", "validate_s", "peak_rss_gib", "schedule_peak_rss_gib",
                        "rss_before_schedule_gib", "load_avg", "load_avg_after"):
                if all(r.get(key) is not None for r in ok):  # (no /proc: no VmHWM)
                    summary[key] = _summary([r[key] for r in ok])
        out["cases"][case] = summary
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
