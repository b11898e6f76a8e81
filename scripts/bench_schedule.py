"""Benchmark the transfer scheduler on GPT-3 2.7B / 6.7B (with Adam state, distributed optimizer).

Scale-down and scale-up between 16 and 64 GPUs on 2 to 8 hosts of 8 GPUs. For every case:
the schedule's completion (simulated), the naive baseline (every transfer at once, max-min fair
sharing), the lower bound, and the solver time. Writes docs/bench/bench_schedule.{json,md,png}.

    .venv/bin/python scripts/bench_schedule.py [--quick] [--spec nvlink=300GB/s,pcie=32GB/s,nic=50GB/s]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import tenplex
from tenplex import ParallelConfig
from tenplex.planning.schedule import demands, lower_bound, naive_completion, schedule
from tenplex.planning.topology import Topology

ROOT = Path(__file__).resolve().parent.parent

# (name, from, to, alive): alive None = every old GPU stays (planned resize); "lost" = the last
# hosts failed (their optimizer shards come from storage)
CASES = [
    ("down 32->16", "dp=4,tp=4,pp=2", "dp=2,tp=4,pp=2", "all"),
    ("down 64->32", "dp=8,tp=4,pp=2", "dp=4,tp=4,pp=2", "all"),
    ("down 64->32 reshape", "dp=8,tp=8,pp=1", "dp=4,tp=4,pp=2", "all"),
    ("down 64->48 host loss", "dp=8,tp=4,pp=2", "dp=6,tp=4,pp=2", "lost"),
    ("up 16->32", "dp=2,tp=4,pp=2", "dp=4,tp=4,pp=2", "all"),
    ("up 16->64", "dp=2,tp=4,pp=2", "dp=8,tp=4,pp=2", "all"),
    ("up 32->64 reshape", "dp=4,tp=4,pp=2", "dp=4,tp=8,pp=2", "all"),
]
MODELS = ["gpt3-2.7b", "gpt3-6.7b"]
REPEATS = 3


def run_case(model: str, name: str, a: str, b: str, alive_kind: str, spec: str, time_limit: float) -> dict:
    old, new = ParallelConfig.parse(a), ParallelConfig.parse(b)
    gpus = max(old.world_size, new.world_size)
    hosts = -(-gpus // 8)
    topo = Topology.from_spec(f"hosts={hosts},gpus=8,{spec}")
    alive = range(old.world_size) if alive_kind == "all" else range(new.world_size)
    ptc = tenplex.model_ptc(model, optimizer=True, distributed_optimizer=True)
    p = tenplex.plan(ptc, old, new, alive=alive, gpus_per_host=8)
    t0 = time.perf_counter()  # first call on this topology: includes analysing it (paths, cuts)
    schedule(p, topo, method="auto", time_limit=time_limit)
    t_cold = time.perf_counter() - t0
    t_dem = float("inf")
    for _ in range(REPEATS):  # the machine may be shared: the fastest of a few runs
        t0 = time.perf_counter()
        dem = demands(p, topo)
        t_dem = min(t_dem, time.perf_counter() - t0)
    lb = lower_bound(dem, topo)
    naive = naive_completion(p, topo)
    row = {"model": model, "case": name, "from": a, "to": b, "alive": alive_kind, "hosts": hosts,
           "gpus_old": old.world_size, "gpus_new": new.world_size, "moves": p.stats.num_moves,
           "bytes_moved": p.stats.bytes_moved, "bytes_distinct": dem.bytes_unique,
           "bytes_storage": p.stats.bytes_storage, "commodities": len(dem.commodities),
           "lower_bound_s": lb, "naive_s": naive, "demands_s": t_dem, "cold_solve_s": t_cold}
    for method in ("auto", "greedy", "lp"):
        solve = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            s = schedule(p, topo, method=method, time_limit=time_limit, dem=dem)
            solve = min(solve, time.perf_counter() - t0)
        comp = s.completion_s
        row[method] = {"method": s.method, "completion_s": comp, "solve_s": solve + t_dem,
                       "chunks": len(s.chunk_nbytes), "chunk_bytes": s.chunk_bytes, "epochs": s.num_epochs}
    auto = row["auto"]
    row["vs_lower_bound"] = auto["completion_s"] / lb
    row["naive_vs_schedule"] = naive / auto["completion_s"]
    row["solve_fraction"] = auto["solve_s"] / auto["completion_s"]
    row["cold_solve_fraction"] = t_cold / auto["completion_s"]
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{r['model'].removeprefix('gpt3-')} {r['case']}" for r in rows]
    x = range(len(rows))
    w = 0.27
    ax = axes[0]
    ax.bar([i - w for i in x], [r["auto"]["completion_s"] / r["lower_bound_s"] for r in rows], w,
           label="schedule (auto)")
    ax.bar(list(x), [r["greedy"]["completion_s"] / r["lower_bound_s"] for r in rows], w, label="greedy only")
    ax.bar([i + w for i in x], [r["naive_s"] / r["lower_bound_s"] for r in rows], w, label="naive (all at once, fair)")
    ax.axhline(1.1, color="k", ls="--", lw=0.8, label="1.1x lower bound")
    ax.set_ylabel("completion / lower bound")
    ax.set_xticks(list(x), labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylim(0.9, max(1.5, max(r["naive_s"] / r["lower_bound_s"] for r in rows) * 1.05))
    ax.legend(fontsize=8)
    ax.set_title("transfer completion vs lower bound")
    ax = axes[1]
    ax.bar([i - w / 2 for i in x], [r["auto"]["completion_s"] * 1e3 for r in rows], w, label="transfer (schedule)")
    ax.bar([i + w / 2 for i in x], [r["auto"]["solve_s"] * 1e3 for r in rows], w, label="solver (demands + schedule)")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_xticks(list(x), labels, rotation=70, ha="right", fontsize=7)
    ax.legend(fontsize=8)
    ax.set_title("transfer time vs solver time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_md(rows: list[dict], meta: dict, path: Path) -> None:
    lines = [
        "# Transfer-schedule benchmark",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}. Topology per case: "
        f"`hosts=H,gpus=8,{meta['spec']}` (H = enough hosts for the larger world). Models with Adam state, "
        "distributed optimizer. `all`: every old GPU stays alive (planned resize); `lost`: the last hosts "
        "failed, so their optimizer shards come from storage (10 GB/s).",
        "",
        "Completion is simulated (each link sends its chunks in schedule order, as soon as they have arrived);"
        " naive: every (source, destination) flow starts at once on its shortest path, links shared max-min "
        "fairly, no multicast, the planner's sources; lower bound: cut bound with the best choice of sources "
        "and multicast (see [schedule.md](schedule.md)). Solve time includes grouping the plan into demands, "
        "not planning itself nor importing scipy; it is the fastest of 3 runs (the machine is shared).",
        "",
        "| model | case | alive | moved | distinct | commodities | chunks | lower bound | schedule | naive |"
        " schedule / LB | naive / schedule | method | solve | solve / transfer | first call | first / transfer |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        a = r["auto"]
        lines.append(
            f"| {r['model']} | {r['case']} | {r['alive']} | {r['bytes_moved'] / 2**30:.1f} GiB | "
            f"{r['bytes_distinct'] / 2**30:.1f} GiB | {r['commodities']} | {a['chunks']} | "
            f"{r['lower_bound_s'] * 1e3:.0f} ms | {a['completion_s'] * 1e3:.0f} ms | {r['naive_s'] * 1e3:.0f} ms | "
            f"{r['vs_lower_bound']:.3f} | {r['naive_vs_schedule']:.2f} | {a['method']} | "
            f"{a['solve_s'] * 1e3:.0f} ms | {r['solve_fraction']:.2f} | {r['cold_solve_s'] * 1e3:.0f} ms | "
            f"{r['cold_solve_fraction']:.2f} |")
    worst = max(r["vs_lower_bound"] for r in rows)
    fast = sum(r["solve_fraction"] <= 0.1 for r in rows)
    ahead = [r for r in rows if r["naive_vs_schedule"] >= 1.05]
    lines += ["", "Against the issue's goals:", "",
              f"- within 1.1x of the lower bound: {sum(r['vs_lower_bound'] <= 1.1 for r in rows)} of {len(rows)} "
              f"cases (worst {worst:.3f}x);",
              f"- ahead of naive where links are unevenly loaded: {len(ahead)} of {len(rows)} cases by "
              f"{min((r['naive_vs_schedule'] for r in ahead), default=1):.2f}x to "
              f"{max((r['naive_vs_schedule'] for r in ahead), default=1):.2f}x (scale-up: multicast of the "
              "parameters to new DP replicas through host memory; scale-down: replica choice spreading NIC load); "
              "the others are bound by one link whichever schedule runs (storage after a host loss; the "
              "destination hosts' NICs in the reshape), so naive is already at the bound there;",
              f"- solver under a tenth of the transfer time: {fast} of {len(rows)} cases"
              + ("." if fast == len(rows) else
                 f"; the others take up to {max(r['solve_fraction'] for r in rows):.2f} of it (solve "
                 f"{min(r['auto']['solve_s'] for r in rows) * 1e3:.0f} to "
                 f"{max(r['auto']['solve_s'] for r in rows) * 1e3:.0f} ms, of which grouping the plan into "
                 f"demands {min(r['demands_s'] for r in rows) * 1e3:.0f} to "
                 f"{max(r['demands_s'] for r in rows) * 1e3:.0f} ms)."),
              f"- the first call on a topology also analyses it (shortest paths, cuts; cached for later "
              f"calls): {sum(r['cold_solve_fraction'] <= 0.1 for r in rows)} of {len(rows)} cases under a tenth "
              f"of the transfer, worst {max(r['cold_solve_fraction'] for r in rows):.2f} "
              f"({max(r['cold_solve_s'] for r in rows) * 1e3:.0f} ms); a job keeps its topology, so only its "
              "first rescale pays this.",
              "", f"Worst schedule / lower bound: {worst:.3f}. "
              f"Naive / schedule ranges {min(r['naive_vs_schedule'] for r in rows):.2f} to "
              f"{max(r['naive_vs_schedule'] for r in rows):.2f}. Solve / transfer ranges "
              f"{min(r['solve_fraction'] for r in rows):.2f} to {max(r['solve_fraction'] for r in rows):.2f}.",
              "", "Per method (completion / lower bound, solve time):", "",
              "| model | case | greedy | lp |", "|---|---|---:|---:|"]
    for r in rows:
        g, lp = r["greedy"], r["lp"]
        lines.append(f"| {r['model']} | {r['case']} | {g['completion_s'] / r['lower_bound_s']:.3f} "
                     f"({g['solve_s'] * 1e3:.0f} ms) | {lp['completion_s'] / r['lower_bound_s']:.3f} "
                     f"({lp['solve_s'] * 1e3:.0f} ms, {lp['method']}) |")
    lines += ["", "![completion and solver time](bench_schedule.png)", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="nvlink=300GB/s,pcie=32GB/s,nic=50GB/s")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="first model and three cases only")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    import scipy.optimize  # noqa: F401  (import once, outside the timings)
    import scipy.sparse.csgraph  # noqa: F401

    out = Path(args.out)
    rows = []
    models = MODELS[:1] if args.quick else MODELS
    cases = CASES[:3] if args.quick else CASES
    for model in models:
        for name, a, b, alive in cases:
            r = run_case(model, name, a, b, alive, args.spec, args.time_limit)
            rows.append(r)
            print(f"{model:10} {name:24} LB {r['lower_bound_s'] * 1e3:7.1f} ms  schedule "
                  f"{r['auto']['completion_s'] * 1e3:7.1f} ms ({r['vs_lower_bound']:.3f}x LB, {r['auto']['method']})"
                  f"  naive {r['naive_s'] * 1e3:7.1f} ms ({r['naive_vs_schedule']:.2f}x)  solve "
                  f"{r['auto']['solve_s'] * 1e3:6.0f} ms ({r['solve_fraction']:.2f} of transfer)", flush=True)
    meta = {"command": "python scripts/bench_schedule.py" + (" --quick" if args.quick else ""),
            "spec": args.spec, "machine": f"{platform.processor() or platform.machine()} "
            f"({platform.python_implementation()} {platform.python_version()})",
            "date": time.strftime("%Y-%m-%d")}
    (out / "bench_schedule.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_md(rows, meta, out / "bench_schedule.md")
    plot(rows, out / "bench_schedule.png")


if __name__ == "__main__":
    main()
