#!/usr/bin/env python3
"""Benchmark resharding: checkpoint save under layout A, partial load under layout B, planning.

For every layout pair the script saves a ~100M-parameter GPT with Adam state (fp32) under
layout A into a temporary directory of local files, loads every rank of layout B one after
the other in this process, and reports how many bytes the loads needed and actually read,
how long saving, loading and planning took, and how many bytes the planner moves. Loaded
shards are checked bit for bit against ``ptc.shard_tensor`` of the global state.

It then times the planner on GPT-3 175B with optimizer state at 1024 GPUs.

    python scripts/bench_reshard.py              # full run; writes docs/bench/bench_reshard.{md,json}
    python scripts/bench_reshard.py --quick      # small model, fewer pairs; writes nothing
    python scripts/bench_reshard.py --json       # one JSON object on stdout instead of the table

Progress goes to stderr, the table (or JSON) to stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tenplex
from tenplex import PTC, ParallelConfig, model_ptc
from tenplex import checkpoint as ckpt
from tenplex.layout import config as config_mod
from tenplex.layout.models import model_spec

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
GiB = 2**30


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def P(text: str) -> ParallelConfig:
    return ParallelConfig.parse(text)


@dataclass(frozen=True)
class Pair:
    name: str
    old: ParallelConfig
    new: ParallelConfig
    distributed_optimizer: bool = False


FULL_PAIRS = [
    Pair("dp shrink", P("dp=4"), P("dp=2")),
    Pair("tp grow", P("tp=2"), P("tp=4")),
    Pair("dp->tp", P("dp=2,tp=2"), P("dp=1,tp=4")),
    Pair("pp grow", P("pp=2"), P("pp=4")),
    Pair("8->8 dp->pp", P("dp=2,tp=2,pp=2"), P("dp=1,tp=2,pp=4")),
    Pair("8->4 dp shrink", P("dp=2,tp=2,pp=2"), P("dp=1,tp=2,pp=2")),
    Pair("dist-opt dp shrink", P("dp=4"), P("dp=2"), distributed_optimizer=True),
    Pair("dist-opt 8->8 dp->pp", P("dp=2,tp=2,pp=2"), P("dp=1,tp=2,pp=4"), distributed_optimizer=True),
]

QUICK_PAIRS = [
    Pair("dp shrink", P("dp=4"), P("dp=2")),
    Pair("dp->tp", P("dp=2,tp=2"), P("dp=1,tp=4")),
    Pair("8->8 dp->pp", P("dp=2,tp=2,pp=2"), P("dp=1,tp=2,pp=4")),
    Pair("dist-opt dp shrink", P("dp=4"), P("dp=2"), distributed_optimizer=True),
]

BIG_OLD = P("dp=8,tp=8,pp=16")
BIG_PAIRS = [
    ("1024->768 dp shrink", BIG_OLD, P("dp=6,tp=8,pp=16"), "default"),
    ("1024->768 dp shrink, keep whole replicas", BIG_OLD, P("dp=6,tp=8,pp=16"), "keep_dp_prefix"),
    ("1024->1024 dp<->tp", BIG_OLD, P("dp=16,tp=4,pp=16"), "default"),
]

QUICK_MODEL = dict(arch="gpt", num_layers=4, hidden=256, heads=8, vocab=5000, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def clear_caches() -> None:
    """Forget memoised segment tables so a plan is timed as a fresh process would see it."""
    for fn in (getattr(config_mod, "_holder_table", None), getattr(config_mod, "_stage_map", None)):
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def keep_dp_prefix(old: ParallelConfig, new: ParallelConfig) -> list[int] | None:
    """Survivors that keep whole DP replicas (dp index < new.dp) when only DP shrinks, else None."""
    if (old.tp, old.pp, old.stages) != (new.tp, new.pp, new.stages) or new.dp >= old.dp:
        return None
    return [r for r in range(old.world_size) if old.coords(r).dp < new.dp]


def time_plan(ptc: PTC, old: ParallelConfig, new: ParallelConfig, reps: int,
              alive: list[int] | None = None) -> dict[str, Any]:
    cold, warm, result = [], [], None
    for _ in range(reps):
        clear_caches()
        t0 = time.perf_counter()
        result = tenplex.plan(ptc, old, new, alive=alive)
        cold.append(time.perf_counter() - t0)
    for _ in range(reps):
        t0 = time.perf_counter()
        tenplex.plan(ptc, old, new, alive=alive)
        warm.append(time.perf_counter() - t0)
    assert result is not None
    s = result.stats
    return {
        "plan_s": min(cold),
        "plan_warm_s": min(warm),
        "plan_runs_s": cold,
        "num_moves": s.num_moves,
        "bytes_needed": s.bytes_needed,
        "bytes_moved": s.bytes_moved,
        "bytes_lower_bound": s.bytes_lower_bound,
        "bytes_local": s.bytes_local,
        "bytes_same_host": s.bytes_same_host,
        "bytes_cross_host": s.bytes_cross_host,
        "bytes_storage": s.bytes_storage,
        "max_send_bytes": s.max_send_bytes,
        "max_recv_bytes": s.max_recv_bytes,
    }


def make_global_state(ptc: PTC, seed: int) -> dict[str, Any]:
    """Random global tensors, stored in canonical flat order and exposed in natural shape.

    Each tensor is one contiguous canonical buffer; the natural-shape tensor is a view of it,
    so ``spec.to_canonical`` of it costs no copy and the state exists once in memory.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, spec in ptc.tensors.items():
        flat = torch.randn(spec.numel, generator=gen, dtype=torch.float32).to(spec.dtype)
        t = flat.reshape(spec.canonical_shape())
        d = spec.split_dim
        state[name] = t if d in (None, 0) else t.movedim(0, d)
        assert tuple(state[name].shape) == spec.shape
    for obj in ptc.objects:
        state[obj] = 1234
    return state


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def verify_rank(ptc: PTC, cfg: ParallelConfig, rank: int, shard: dict[str, Any], state: dict[str, Any]) -> None:
    want = set(ptc.rank_tensors(cfg, rank)) | set(ptc.objects)
    if set(shard) != want:
        raise AssertionError(f"rank {rank} under {cfg}: loaded names differ from the PTC's: "
                             f"missing {sorted(want - set(shard))[:3]}, extra {sorted(set(shard) - want)[:3]}")
    for name in ptc.rank_tensors(cfg, rank):
        spec = ptc.tensors[name]
        expected = ptc.shard_tensor(name, cfg, rank, spec.to_canonical(state[name]))
        if not bits_equal(shard[name], expected):
            raise AssertionError(f"rank {rank} under {cfg}: {name} differs from ptc.shard_tensor of the global state")
    for obj in ptc.objects:
        if shard[obj] != state[obj]:
            raise AssertionError(f"rank {rank} under {cfg}: object {obj} is {shard[obj]!r}, saved {state[obj]!r}")


def ranks_to_verify(mode: str, world: int) -> list[int]:
    if mode == "all":
        return list(range(world))
    if mode == "none":
        return []
    return sorted({0, world - 1})  # "ends": first and last rank (first/last stage, tied embedding)


# ---------------------------------------------------------------------------------------------
# one layout pair
# ---------------------------------------------------------------------------------------------
def warm_up(tmp_root: Path) -> None:
    """One small save and load, so that first-call costs (imports, allocator) stay out of the figures."""
    ptc = model_ptc("tiny")
    cfg = ParallelConfig(dp=2)
    state = make_global_state(ptc, 0)
    flats = {n: s.to_canonical(state[n]) for n, s in ptc.tensors.items()}
    url = str(tmp_root / "warm-up")
    for rank in range(cfg.world_size):
        shard = {n: ptc.shard_tensor(n, cfg, rank, flats[n]) for n in ptc.rank_tensors(cfg, rank)}
        ckpt.save(url, ptc, cfg, rank, {**shard, **{o: state[o] for o in ptc.objects}}, step=1)
    ckpt.load(url, ParallelConfig(tp=2), 1, ptc=ptc)
    tenplex.plan(ptc, cfg, ParallelConfig(tp=2))
    shutil.rmtree(url, ignore_errors=True)


def bench_pair(pair: Pair, model_kw: dict[str, Any], state: dict[str, Any], tmp_root: Path,
               verify: str, plan_reps: int, load_reps: int) -> dict[str, Any]:
    ptc = model_ptc(**model_kw, distributed_optimizer=pair.distributed_optimizer)
    old, new = pair.old, pair.new
    ptc.check(old)
    ptc.check(new)
    url = str(tmp_root / f"ckpt-{time.monotonic_ns()}")
    flats = {name: spec.to_canonical(state[name]) for name, spec in ptc.tensors.items()}
    out: dict[str, Any] = {"name": pair.name, "old": str(old), "new": str(new),
                           "old_world": old.world_size, "new_world": new.world_size,
                           "distributed_optimizer": pair.distributed_optimizer}
    try:
        # -- save every rank of the old layout --------------------------------------------
        loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        save_s, save_cpu, shard_s, written = [], 0.0, 0.0, 0
        for rank in range(old.world_size):
            t0 = time.perf_counter()
            shard: dict[str, Any] = {n: ptc.shard_tensor(n, old, rank, flats[n]) for n in ptc.rank_tensors(old, rank)}
            shard.update({o: state[o] for o in ptc.objects})
            shard_s += time.perf_counter() - t0
            t0, c0 = time.perf_counter(), time.process_time()
            res = ckpt.save(url, ptc, old, rank, shard, step=1)
            save_s.append(time.perf_counter() - t0)
            save_cpu += time.process_time() - c0
            written += res.bytes_written
            del shard
        gc.collect()
        disk = sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file())
        log(f"  saved {old} ({old.world_size} ranks): {written / MiB:.1f} MiB in {sum(save_s):.2f}s")

        # -- load every rank of the new layout, one after the other; best of load_reps passes --
        check = set(ranks_to_verify(verify, new.world_size))
        passes = []
        verified: list[int] = []
        for rep in range(load_reps):
            p = {"load_s": [], "load_cpu": 0.0, "stats_s": 0.0, "needed": 0, "read": 0, "meta": 0, "ranges": 0}
            for rank in range(new.world_size):
                t0, c0 = time.perf_counter(), time.process_time()
                res = ckpt.load(url, new, rank, ptc=ptc)
                p["load_s"].append(time.perf_counter() - t0)
                p["load_cpu"] += time.process_time() - c0
                st = res.stats
                p["stats_s"] += st.seconds
                p["needed"] += st.bytes_needed
                p["read"] += st.bytes_read
                p["meta"] += st.metadata_bytes
                p["ranges"] += st.ranges
                if rep == 0 and rank in check:
                    verify_rank(ptc, new, rank, res.shard, state)
                    verified.append(rank)
                del res
            passes.append(p)
            log(f"  loaded {new} ({new.world_size} ranks), pass {rep + 1}/{load_reps}: read {p['read'] / MiB:.1f} of "
                f"{p['needed'] / MiB:.1f} MiB needed in {sum(p['load_s']):.2f}s ({p['load_cpu']:.2f}s CPU)"
                + (f"; verified ranks {verified}" if rep == 0 else ""))
        if any((q["needed"], q["read"]) != (passes[0]["needed"], passes[0]["read"]) for q in passes):
            raise AssertionError(f"{pair.name}: repeated loads read different byte counts")
        best = min(passes, key=lambda q: sum(q["load_s"]))
        needed, read = best["needed"], best["read"]
        expect = sum(ptc.rank_nbytes(new, rank) for rank in range(new.world_size))
    finally:
        shutil.rmtree(url, ignore_errors=True)
        del flats
        gc.collect()

    if needed != expect:
        raise AssertionError(f"{pair.name}: LoadStats.bytes_needed sums to {needed} but ptc.rank_nbytes to {expect}")

    # -- plan -------------------------------------------------------------------------------
    pl = time_plan(ptc, old, new, plan_reps)
    alt = keep_dp_prefix(old, new)
    out.update({
        "model_bytes": ptc.nbytes,
        "bytes_written": written,
        "checkpoint_disk_bytes": disk,
        "save_s": sum(save_s),
        "save_max_rank_s": max(save_s),
        "save_cpu_s": save_cpu,
        "shard_build_s": shard_s,
        "bytes_needed": needed,
        "bytes_read": read,
        "read_over_needed": read / needed if needed else None,
        "metadata_bytes": best["meta"],
        "read_ranges": best["ranges"],
        "load_reps": load_reps,
        "load_s": sum(best["load_s"]),
        "load_max_rank_s": max(best["load_s"]),
        "load_cpu_s": best["load_cpu"],
        "load_stats_s": best["stats_s"],
        "load_mib_per_s": needed / MiB / sum(best["load_s"]),
        "load_passes_s": [sum(q["load_s"]) for q in passes],
        "load_passes_cpu_s": [q["load_cpu"] for q in passes],
        "loadavg_1m_before": loadavg,
        "verified_ranks": verified,
        "plan": pl,
        "plan_keep_replicas": None if alt is None else time_plan(ptc, old, new, 1, alive=alt),
    })
    if pl["bytes_needed"] != needed:
        out["warning"] = f"plan needs {pl['bytes_needed']} bytes but the loads needed {needed}"
        log(f"  WARNING: {out['warning']}")
    return out


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def machine_info(tmp_root: Path) -> dict[str, Any]:
    cpu_model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    fstype = None
    try:
        fstype = subprocess.run(["df", "--output=fstype", str(tmp_root)], capture_output=True, text=True,
                                check=True).stdout.split()[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    commit, dirty = None, []
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "tenplex"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout
        dirty = [line[3:] for line in status.splitlines() if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass
    import fsspec
    import safetensors

    return {
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "memory_bytes": mem,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "fsspec": fsspec.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tmp_dir_fstype": fstype,
        "git_commit": commit,
        "library_dirty": dirty,
    }


def _la(values: list[float] | None) -> str:
    return "?" if not values or values[0] is None else f"{values[0]:.2f}"


def _mib(b: float) -> str:
    return f"{b / MiB:,.1f}"


def pair_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["pair", "A -> B", "ranks", "needed MiB", "read MiB", "read/needed", "load sum s", "load max s",
            "load cpu s", "load MiB/s", "save s", "plan ms", "moved MiB", "lower bound MiB", "verified"]
    rows = []
    for r in results:
        pl = r["plan"]
        rows.append([
            r["name"], f"{r['old']} -> {r['new']}" + (" (dist-opt)" if r["distributed_optimizer"] else ""),
            f"{r['old_world']}->{r['new_world']}", _mib(r["bytes_needed"]), _mib(r["bytes_read"]),
            f"{r['read_over_needed']:.4f}", f"{r['load_s']:.2f}", f"{r['load_max_rank_s']:.2f}",
            f"{r['load_cpu_s']:.2f}", f"{r['load_mib_per_s']:,.0f}", f"{r['save_s']:.2f}", f"{pl['plan_s'] * 1e3:.1f}",
            _mib(pl["bytes_moved"]), _mib(pl["bytes_lower_bound"]),
            "all" if len(r["verified_ranks"]) == r["new_world"] else ",".join(map(str, r["verified_ranks"])) or "-",
        ])
    return head, rows


def big_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "A -> B", "plan s (best)", "plan s (warm)", "moves", "needed GiB", "moved GiB",
            "lower bound GiB", "max recv GiB"]
    rows = []
    for r in results:
        rows.append([r["name"], f"{r['old']} -> {r['new']}", f"{r['plan_s']:.3f}", f"{r['plan_warm_s']:.3f}",
                     f"{r['num_moves']:,}", f"{r['bytes_needed'] / GiB:,.0f}", f"{r['bytes_moved'] / GiB:,.0f}",
                     f"{r['bytes_lower_bound'] / GiB:,.0f}", f"{r['max_recv_bytes'] / GiB:,.1f}"])
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    ph, pr = pair_rows(report["pairs"])
    big_section = ""
    if report["planner_175b"]:
        bh, br = big_rows(report["planner_175b"])
        bm = report["big_model"]
        big_section = f"""## Planner on GPT-3 175B with optimizer state

Model: `gpt3-175b` (bf16 weights, fp32 main copy and Adam state): {bm['tensors']:,} tensors, {bm['bytes'] / GiB:,.0f} GiB.
Plan time is the best of {cfg['big_reps']} runs with caches cleared; "warm" re-plans with the segment tables cached.
"keep whole replicas" passes `alive` = the old ranks with DP index < 6 instead of the default first 768 devices.

{md_table(bh, br)}

"""
    mem = f"{m['memory_bytes'] / GiB:.0f} GiB" if m["memory_bytes"] else "?"
    keep = [r for r in report["pairs"] if r.get("plan_keep_replicas")]
    keep_lines = "".join(
        f"- {r['name']} ({r['old']} -> {r['new']}): the default survivors (devices 0..{r['new_world'] - 1}) move "
        f"{_mib(r['plan']['bytes_moved'])} MiB; passing `alive` = the old ranks with DP index < {P(r['new']).dp} "
        f"(whole replicas) moves {_mib(r['plan_keep_replicas']['bytes_moved'])} MiB.\n" for r in keep)
    return f"""# Resharding benchmark

Generated by `scripts/bench_reshard.py` on {report['date']}.

Command:

```
{report['command']}
```

Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {mem} RAM, torch {m['torch']} ({m['torch_threads']} threads),
numpy {m['numpy']}, safetensors {m['safetensors']}, fsspec {m['fsspec']}, Python {m['python']}, {m['platform']}.
Checkpoints on local files ({m['tmp_dir_fstype'] or 'unknown'} file system), tenplex at commit {m['git_commit']}
{'(with uncommitted changes to ' + ', '.join(m['library_dirty']) + ')' if m['library_dirty'] else '(clean)'}.

## Save under layout A, load every rank of layout B

Model: {cfg['model_desc']}: {cfg['model_tensors']} tensors, {cfg['model_bytes'] / MiB:,.1f} MiB
({cfg['model_params']:,} parameters; Adam `exp_avg` and `exp_avg_sq` included, fp32). Random global state, seed
{cfg['seed']}.

{md_table(ph, pr)}

- **needed**: real (non-padding) bytes of every new rank's shard, summed over ranks (`LoadStats.bytes_needed`);
  DP replicas count once per rank. **read**: data bytes the loads fetched, checksum-block rounding included
  (`LoadStats.bytes_read`). Metadata (JSON indexes, manifest, objects) is not in either column.
- **load sum / max**: wall time of `tenplex.checkpoint.load` over all new ranks, loaded one after the other in one
  process, and the slowest rank of that pass; the fastest of {cfg['load_reps']} passes. Files had just been written, so reads come from the page cache.
  **load cpu** is the process CPU time of those loads (less sensitive to other work on the machine).
  **load MiB/s** = needed / load sum.
- **save**: wall time of `tenplex.checkpoint.save` summed over the old ranks (building the shards is not included).
- **plan**: `tenplex.plan(ptc, A, B)`, best of {cfg['plan_reps']} with the segment-table caches cleared before each
  run; default survivors (the first min(|A|, |B|) devices). **moved** / **lower bound**: `PlanStats.bytes_moved` and
  `bytes_lower_bound`.
- **verified**: new ranks whose loaded shard was compared bit for bit with
  `ptc.shard_tensor(name, B, rank, spec.to_canonical(global))`.

Which devices survive matters when only DP shrinks (same pairs, planned with another `alive`):

{keep_lines}
{big_section}Machine load average (1 min) at start {_la(m['loadavg_at_start'])}, at the end {_la(report['loadavg_at_end'])},
before each pair {', '.join(_la([r['loadavg_1m_before']]) for r in report['pairs'])}; wall times on a busy
machine are inflated, CPU times much less so. Total run time: {report['total_s']:.0f} s. Raw figures:
`bench_reshard.json`.
"""


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model and fewer pairs (smoke test)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    ap.add_argument("--out", default=None,
                    help="directory for bench_reshard.md and .json (default: docs/bench/ in full mode, nothing in --quick)")
    ap.add_argument("--no-write", action="store_true", help="write no files")
    ap.add_argument("--tmpdir", default=None, help="where to put the temporary checkpoints (default: system temp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", choices=("all", "ends", "none"), default="all",
                    help="new ranks to check bit for bit: all, first and last, or none (default: all)")
    ap.add_argument("--plan-reps", type=int, default=3, help="repetitions of each plan timing (best is reported)")
    ap.add_argument("--load-reps", type=int, default=None,
                    help="passes over all new ranks; the fastest pass is reported (default: 2, 1 in --quick)")
    ap.add_argument("--skip-175b", action="store_true", help="skip the GPT-3 175B planner timings")
    args = ap.parse_args(argv)
    load_reps = args.load_reps if args.load_reps is not None else (1 if args.quick else 2)

    t_start = time.perf_counter()
    rel = os.path.relpath(Path(sys.argv[0]).resolve(), Path.cwd()) if sys.argv and sys.argv[0] else __file__
    command = " ".join(["python", shlex.quote(rel), *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    out_dir = None if args.no_write else (args.out if args.out is not None else (None if args.quick else "docs/bench/"))
    if out_dir is not None and not Path(out_dir).is_absolute():
        out_dir = str(Path.cwd() / out_dir)

    model_kw: dict[str, Any] = dict(QUICK_MODEL) if args.quick else {"preset": "gpt-100m"}
    pairs = QUICK_PAIRS if args.quick else FULL_PAIRS
    base = model_ptc(**model_kw)
    spec = model_spec(**model_kw)
    log(f"model {'quick GPT' if args.quick else 'gpt-100m'}: {base}, {spec.num_params():,} parameters")

    t0 = time.perf_counter()
    state = make_global_state(base, args.seed)
    log(f"global state: {sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)) / MiB:,.1f}"
        f" MiB in {time.perf_counter() - t0:.1f}s")

    tmp_root = Path(tempfile.mkdtemp(prefix="tenplex-bench-", dir=args.tmpdir))
    results = []
    try:
        machine = machine_info(tmp_root)
        warm_up(tmp_root)
        for i, pair in enumerate(pairs, 1):
            log(f"pair {i}/{len(pairs)}: {pair.name}: {pair.old} -> {pair.new}"
                + (" (distributed optimizer)" if pair.distributed_optimizer else ""))
            results.append(bench_pair(pair, model_kw, state, tmp_root, args.verify, args.plan_reps, load_reps))
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    del state
    gc.collect()

    big: list[dict[str, Any]] = []
    big_model: dict[str, Any] = {}
    if not args.skip_175b:
        ptc175 = model_ptc("gpt3-175b")
        big_model = {"preset": "gpt3-175b", "tensors": len(ptc175), "bytes": ptc175.nbytes,
                     "params": model_spec("gpt3-175b").num_params()}
        reps = 1 if args.quick else args.plan_reps
        for name, old, new, alive_rule in BIG_PAIRS:
            if args.quick and alive_rule != "default":
                continue
            log(f"175B plan: {name}: {old} -> {new} (best of {reps})")
            alive = keep_dp_prefix(old, new) if alive_rule == "keep_dp_prefix" else None
            r = time_plan(ptc175, old, new, reps, alive=alive)
            r.update({"name": name, "old": str(old), "new": str(new), "alive": alive_rule})
            big.append(r)
            log(f"  {r['plan_s']:.3f}s, {r['num_moves']:,} moves, {r['bytes_moved'] / GiB:,.0f} GiB moved")
        clear_caches()

    report = {
        "benchmark": "bench_reshard",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "quick": args.quick,
        "machine": machine,
        "config": {
            "model": {k: (str(v).removeprefix("torch.") if k == "dtype" else v) for k, v in model_kw.items()},
            "model_desc": "quick GPT (4 layers, hidden 256, vocab 5000, fp32)" if args.quick else "`gpt-100m` (fp32)",
            "model_tensors": len(base),
            "model_bytes": base.nbytes,
            "model_params": spec.num_params(),
            "seed": args.seed,
            "verify": args.verify,
            "plan_reps": args.plan_reps,
            "load_reps": load_reps,
            "big_reps": 1 if args.quick else args.plan_reps,
        },
        "pairs": results,
        "big_model": big_model,
        "planner_175b": big,
        "total_s": time.perf_counter() - t_start,
        "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }

    if args.json:
        print(json.dumps(report, indent=None))
    else:
        ph, pr = pair_rows(results)
        print(f"Save under A, load every rank of B ({report['config']['model_desc'].replace('`', '')}, "
              f"{base.nbytes / MiB:,.1f} MiB with Adam state):")
        print(text_table(ph, pr))
        if big:
            bh, br = big_rows(big)
            print(f"\nPlanner on GPT-3 175B with optimizer state ({big_model['bytes'] / GiB:,.0f} GiB):")
            print(text_table(bh, br))
        print(f"\nmachine: {machine['cpu_count']} CPUs, torch {machine['torch']}, load average "
              f"{_la(machine['loadavg_at_start'])} at start, {_la(report['loadavg_at_end'])} at end; "
              f"total {report['total_s']:.0f}s")

    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "bench_reshard.json").write_text(json.dumps(report, indent=2) + "\n")
        (Path(out_dir) / "bench_reshard.md").write_text(markdown(report))
        log(f"wrote {out_dir.rstrip('/')}/bench_reshard.md and bench_reshard.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
