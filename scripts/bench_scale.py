"""Planning at scale (issue #20): survivor assignment and plans for Llama 3 405B on up to 131,072 GPUs.

    python scripts/bench_scale.py --json            # all sections, writes docs/bench/bench_scale.json
    python scripts/bench_scale.py --only plan_rank  # one section (names: see SECTIONS)

Every figure is measured in a fresh process (so holder tables are built, as after a restart): 3
runs, median and min-max, the child's peak RSS (``resource.getrusage``) and the load average.
Scenario: TP8 x PP16 x DP(n/128), one node (8 GPUs: one stage's TP group of one replica) lost,
new layout DP one smaller; ``zero``: distributed optimizer (ZeRO-1), ``rep``: replicated Adam.
Sections are functions that return rows; another section (chooser, scheduler) is one more function
in SECTIONS.
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tenplex import ParallelConfig, model_ptc  # noqa: E402
from tenplex.layout.models import PRESETS  # noqa: E402
from tenplex.layout.overlap import holder_classes, intersect  # noqa: E402
from tenplex.planning import assignment  # noqa: E402
from tenplex.planning.planner import locality_order, plan  # noqa: E402

LLAMA3_405B = dict(arch="llama", num_layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                   vocab=128256, seq_len=8192)
RUNS = 3


def ptc_405b(zero: bool):
    """The 405B PTC with Adam state (the preset where this branch has it, else its dimensions)."""
    if "llama3-405b" in PRESETS:
        return model_ptc("llama3-405b", optimizer=True, distributed_optimizer=zero)
    return model_ptc(**LLAMA3_405B, optimizer=True, distributed_optimizer=zero)


def scenario(gpus: int, zero: bool):
    """PTC, old and new layouts, the survivors (one node lost) and the lost node's first rank."""
    dp = gpus // 128
    old, new = ParallelConfig(dp=dp, tp=8, pp=16), ParallelConfig(dp=dp - 1, tp=8, pp=16)
    lost = old.rank(pp=5, dp=min(3, dp - 1), tp=0)
    survivors = [r for r in range(old.world_size) if not lost <= r < lost + 8]
    return ptc_405b(zero), old, new, survivors, lost


def dense_locality_order(ptc, old_cfg, new_cfg, survivors):
    """The previous locality_order: a dense new-rank x survivor byte matrix and linear_sum_assignment."""
    from scipy.optimize import linear_sum_assignment

    surv = np.asarray(survivors, dtype=np.int64)
    col = np.full(old_cfg.world_size, -1, dtype=np.int64)
    col[surv] = np.arange(len(surv))
    held = np.zeros((new_cfg.world_size, len(surv)))
    for name, spec in ptc.tensors.items():
        old_t, new_t = ptc.holders(name, old_cfg), ptc.holders(name, new_cfg)
        if len(old_t) == 0 or len(new_t) == 0:
            continue
        c_start, c_end, c_ranks, _ = holder_classes(name, old_t)
        qi, ci, ps, pe = intersect(new_t.start, new_t.length, c_start, c_end)
        for k in range(c_ranks.shape[1]):
            r = c_ranks[ci, k]
            ok = (r >= 0) & (col[np.maximum(r, 0)] >= 0)
            np.add.at(held, (new_t.rank[qi][ok], col[r[ok]]), (pe - ps)[ok] * spec.itemsize)
    rows, cols = linear_sum_assignment(held[: min(new_cfg.world_size, len(surv))], maximize=True)
    order = [int(surv[c]) for c in cols[np.argsort(rows)]]
    return order + [int(s) for s in surv if int(s) not in set(order)]


# -- measured things (each runs once in a child process and returns its figures) --------------------
def kept_bytes(ptc, old_cfg, new_cfg, survivors, order) -> int:
    """Bytes every new rank finds on the device it runs on under ``order`` (the assignment's value)."""
    surv = np.asarray(survivors, dtype=np.int64)
    rows = min(new_cfg.world_size, len(surv))
    w = assignment.survivor_weights(ptc, old_cfg, new_cfg, surv, rows)
    col = np.empty(old_cfg.world_size, dtype=np.int64)
    col[surv] = np.arange(len(surv))
    return w.value(np.arange(rows), col[np.asarray(order[:rows], dtype=np.int64)])


def one_locality(gpus: int, zero: bool, old: bool, prev_solver: bool = False) -> dict[str, Any]:
    """``old``: the dense LSA over the whole byte matrix; ``prev_solver``: this locality_order
    without the class duals (mixed components by dense LSA or the flow LP, as before them)."""
    ptc, old_cfg, new_cfg, surv, _ = scenario(gpus, zero)
    assignment.USE_DUALS = not prev_solver
    t = time.perf_counter()
    order = (dense_locality_order if old else locality_order)(ptc, old_cfg, new_cfg, surv)
    seconds = time.perf_counter() - t
    assignment.USE_DUALS = True
    stats = plan(ptc, old_cfg, new_cfg, alive=order, ranks=[0]).stats  # cheap check of the result
    return {"seconds": seconds, "rank0_bytes_moved": stats.bytes_moved,
            "kept_bytes": kept_bytes(ptc, old_cfg, new_cfg, surv, order)}


def one_plan(gpus: int, zero: bool, order: str, ranks: str, chooser: bool = False) -> dict[str, Any]:
    """A plan (whole or one rank's part) after one node lost; ``chooser``: first choose_layout for
    the GPUs left (timed, its layout reported; the plan is for the scenario's DP-one-smaller layout)."""
    ptc, old_cfg, new_cfg, surv, lost = scenario(gpus, zero)
    out: dict[str, Any] = {}
    t = time.perf_counter()
    if chooser:
        from tenplex.planning.layouts import choose_layout  # lazy: only this measurement needs the chooser

        c = choose_layout("llama3-405b", gpus - 8, gpu_mem="80GiB", global_batch=2048, seq_len=8192, micro_batch=1,
                          distributed_optimizer=zero, allow_idle=True, uneven_batch=True)
        out["chooser_seconds"] = time.perf_counter() - t
        out["chooser_layout"] = f"{c.cfg} (+{c.idle_gpus} idle)"
    if order == "locality":
        surv = locality_order(ptc, old_cfg, new_cfg, surv)
        out["assignment_seconds"] = time.perf_counter() - t
    t1 = time.perf_counter()
    p = plan(ptc, old_cfg, new_cfg, alive=surv, ranks=None if ranks == "all" else [lost])
    out["plan_seconds"] = time.perf_counter() - t1
    out["seconds"] = time.perf_counter() - t
    s = p.stats
    out.update(num_moves=s.num_moves, bytes_moved=s.bytes_moved, bytes_local=s.bytes_local,
               bytes_same_host=s.bytes_same_host, bytes_cross_host=s.bytes_cross_host, bytes_storage=s.bytes_storage,
               max_send_bytes=s.max_send_bytes)
    return out


def one_chooser(gpus: int, zero: bool) -> dict[str, Any]:
    """choose_layout for 405B on ``gpus`` GPUs (spares and uneven batches allowed), no current layout."""
    from tenplex.planning.layouts import choose_layout

    t = time.perf_counter()
    c = choose_layout("llama3-405b", gpus, gpu_mem="80GiB", global_batch=2048, seq_len=8192, micro_batch=1,
                      distributed_optimizer=zero, allow_idle=True, uneven_batch=True)
    return {"seconds": time.perf_counter() - t, "layout": str(c.cfg), "idle_gpus": c.idle_gpus,
            "recompute": c.recompute, "step_s": c.step_seconds}


def one_world_sizes() -> dict[str, Any]:
    """Every world size of the goals gets a layout: tiny 1-16 (gb 8), llama-100m 1-64 (gb 64), 405B
    at every multiple of 8 from 8,192 to 16,384 and at 16,376; the published 405B layout fits."""
    from tenplex.planning.layouts import choose_layout

    t = time.perf_counter()
    opts: dict[str, Any] = dict(gpu_mem="80GiB", allow_idle=True, uneven_batch=True)
    missing: list[str] = []
    counts = {}
    for model, top, gb, seq in (("tiny", 16, 8, 64), ("llama-100m", 64, 64, 128)):
        for n in range(1, top + 1):
            try:
                choose_layout(model, n, global_batch=gb, micro_batch=1, seq_len=seq, **opts)
            except Exception as e:  # noqa: BLE001 - counted and reported
                missing.append(f"{model}@{n}: {e}")
        counts[model] = top
    big = list(range(8192, 16385, 8)) + [16376]
    times = []
    for n in big:
        t1 = time.perf_counter()
        try:
            choose_layout("llama3-405b", n, global_batch=2048, micro_batch=1, seq_len=8192, **opts)
        except Exception as e:  # noqa: BLE001
            missing.append(f"llama3-405b@{n}: {e}")
        times.append(time.perf_counter() - t1)
    counts["llama3-405b"] = len(big)
    pub = choose_layout("llama3-405b", 16384, pin=ParallelConfig(dp=128, tp=8, pp=16), global_batch=2048,
                        micro_batch=1, seq_len=8192, gpu_mem="80GiB")
    return {"seconds": time.perf_counter() - t, "sizes": counts, "missing": missing[:20], "num_missing": len(missing),
            "chooser_405b_median_s": statistics.median(times), "chooser_405b_max_s": max(times),
            "published_feasible": pub.feasible, "published_recompute": pub.recompute,
            "published_peak_gib": (pub.peak_bytes or 0) / 2**30}


def one_simulate(layout: str, spare_hosts: int) -> dict[str, Any]:
    """tenplex simulate: the 54-day, 419-failure trace on 405B at 16,384 GPUs."""
    from tenplex.planning.simulate import SimulationSettings, draw_trace, simulate_trace

    settings = SimulationSettings("llama3-405b", 16384, global_batch=2048, seq_len=8192, hours=54 * 24.0,
                                  spare_hosts=spare_hosts, layout=ParallelConfig.parse(layout) if layout else None)
    res = simulate_trace(draw_trace(seed=0), settings)
    kinds: dict[str, int] = {}
    for e in res.events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return {"seconds": res.simulate_s, "events": len(res.events), "kinds": kinds,
            "shapes": sum(not e.cached for e in res.events), "goodput_tenplex": res.goodput_tenplex,
            "goodput_tenplex_restart": res.goodput_tenplex_restart,
            "goodput_checkpoint_restart": res.goodput_checkpoint_restart,
            "max_plan_s": max(e.chooser_s + e.assign_s + e.plan_s for e in res.events),
            "max_transfer_s": max(e.transfer_s for e in res.events)}


ONE: dict[str, Callable[..., dict[str, Any]]] = {"locality": one_locality, "plan": one_plan, "chooser": one_chooser,
                                                 "world_sizes": one_world_sizes, "simulate": one_simulate}


def measure(what: str, runs: int = RUNS, **kw: Any) -> dict[str, Any]:
    """``runs`` fresh child processes of ``what(**kw)``: median and min-max seconds, peak RSS, load."""
    done = []
    for _ in range(runs):
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps({"what": what, **kw})],
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["load_before"] = load
        done.append(res)
    secs = [r["seconds"] for r in done]
    row = {"what": what, **kw, "runs": runs, "median_s": statistics.median(secs), "min_s": min(secs),
           "max_s": max(secs), "peak_rss_gib": max(r["peak_rss_gib"] for r in done),
           "load_avg_1min": [round(r["load_before"], 2) for r in done], "last": done[-1]}
    for k in ("chooser_seconds", "assignment_seconds", "plan_seconds"):
        if k in done[0]:
            row[k.replace("seconds", "median_s")] = statistics.median(r[k] for r in done)
    print(f"{what} {kw}: median {row['median_s']:.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f}), "
          f"peak RSS {row['peak_rss_gib']:.2f} GiB, load {row['load_avg_1min']}", flush=True)
    return row


# -- sections -----------------------------------------------------------------------------------------
def section_locality() -> list[dict[str, Any]]:
    """locality_order, previous (dense LSA, where it finishes in reasonable time) and new."""
    rows = []
    for gpus in (1024, 4096, 16384, 131072):
        for zero in (False, True):
            if gpus <= 4096:
                rows.append(measure("locality", gpus=gpus, zero=zero, old=True))
            if zero and gpus >= 16384:  # the component solvers before the class duals: same bytes kept
                rows.append(measure("locality", gpus=gpus, zero=zero, old=False, prev_solver=True,
                                    runs=1 if gpus > 16384 else RUNS))
            rows.append(measure("locality", gpus=gpus, zero=zero, old=False))
    return rows


def section_plan_global() -> list[dict[str, Any]]:
    """The whole plan: survivors in rank order (what rescale() uses) and in locality order."""
    rows = []
    for gpus in (1024, 4096, 16384):
        for zero in (False, True):
            for order in ("rank", "locality") if gpus == 16384 else ("rank",):
                rows.append(measure("plan", gpus=gpus, zero=zero, order=order, ranks="all"))
    return rows


def section_plan_rank() -> list[dict[str, Any]]:
    """One rank's part (the new rank at the lost node's place), and at 131,072 GPUs chooser + assignment + part."""
    rows = []
    for gpus in (1024, 4096, 16384):
        for zero in (False, True):
            for order in ("rank", "locality"):
                rows.append(measure("plan", gpus=gpus, zero=zero, order=order, ranks="one"))
    for zero in (False, True):
        rows.append(measure("plan", gpus=131072, zero=zero, order="locality", ranks="one", chooser=True))
    return rows


def section_chooser() -> list[dict[str, Any]]:
    """choose_layout for 405B: 16,384 GPUs and one node lost (16,376), ZeRO-1 and replicated Adam."""
    return [measure("chooser", gpus=g, zero=z) for g in (16384, 16376) for z in (True, False)]


def section_world_sizes() -> list[dict[str, Any]]:
    """Every world size of the goals gets a layout (one run: a coverage check, timed)."""
    return [measure("world_sizes", runs=1)]


def section_simulate() -> list[dict[str, Any]]:
    """The 54-day, 419-failure trace on 405B, 16,384 GPUs: published layout with 16 and 2 spare hosts."""
    return [measure("simulate", layout="dp=128,tp=8,pp=16", spare_hosts=16),
            measure("simulate", layout="dp=128,tp=8,pp=16", spare_hosts=2, runs=1)]


SECTIONS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "locality": section_locality, "plan_global": section_plan_global, "plan_rank": section_plan_rank,
    "chooser": section_chooser, "world_sizes": section_world_sizes, "simulate": section_simulate,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="write docs/bench/bench_scale.json (merged with what is there)")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS), help="run only these sections")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_scale.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kw = json.loads(args.child)
        res = ONE[kw.pop("what")](**kw)
        res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(json.dumps(res))
        return
    out: dict[str, Any] = {}
    if args.json and Path(args.out).exists():
        out = json.loads(Path(args.out).read_text())
    out.setdefault("sections", {})
    out["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "runs": RUNS}
    for name in args.only or SECTIONS:
        print(f"== {name}: {SECTIONS[name].__doc__}", flush=True)
        out["sections"][name] = SECTIONS[name]()
        if args.json:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
