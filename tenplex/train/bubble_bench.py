"""``tenplex bench bubbles``: the cost of snapshotting every step, blocking versus inside pipeline bubbles.

Runs the reference trainer with PP >= 2 under torchrun and interleaves three modes step by
step in one launch (round r runs the three in an order rotated by r, so load changes on a
shared machine hit every mode alike): no snapshot, a blocking snapshot (the same task and the
same bytes as the bubble snapshot, all of it done before the optimizer step while training
waits) and a bubble snapshot (``tenplex.elastic.bubbles``: bucket by bucket during the 1F1B waits, the
rest before the optimizer step). With ``--write 1`` both snapshot modes write the rank's part
into the host store (``StoreWriteTask``: the same file ``tenplex.save`` writes); with
``--write 0`` they copy the state to host memory (``SnapshotTask``). Warm-up rounds are
excluded. Reports per mode the median step time and its spread, the overheads (also paired
per round), the bubble fraction, the share of bubble time used, the snapshots completed, the
side-task memory budget and one iteration's bubble windows; a second launch without
snapshots checks that the losses are unchanged. Draws one iteration's timeline per stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..data.corpus import stdlib_corpus
from ..elastic import rescale
from ..elastic.bubbles import BubbleRuntime, SnapshotTask, StoreWriteTask, side_task_memory_budget
from ..errors import ConfigError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec
from ..planning.choose import device_memory
from ..planning.memory import estimate_memory, parse_size, resolve_model
from .launch import free_port
from .parallel import init_distributed
from .trainer import TrainConfig, Trainer, trainer_ptc

__all__ = ["BenchConfig", "run_bench", "main"]

MODES = ("none", "blocking", "bubbles")


def _sequence(mode: str, warmup: int, rounds: int) -> list[str]:
    """The mode of every step: ``rounds + warmup`` rounds of the three modes, rotated each round."""
    if mode != "interleave":
        return [mode] * (3 * (warmup + rounds))
    return [MODES[(i + r) % 3] for r in range(warmup + rounds) for i in range(3)]


class _OnlyWhenActive:
    """A side task that takes bubble time only while ``active`` (the bench interleaves modes)."""

    def __init__(self, task: Any) -> None:
        self.task, self.active = task, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def is_finished(self) -> bool:
        return not self.active or self.task.is_finished()


def _budget(text: str, ptc: Any, cfg: Any, stage: int, micro_batch: int, num_mb: int) -> int | None:
    """The stage's side-task memory budget: a size, "none", or "auto" (what the memory
    estimator's 80 % rule leaves of this machine's device, host RAM on CPU)."""
    if text == "none":
        return None
    if text != "auto":
        return parse_size(text)
    spec = resolve_model(ptc)
    est = estimate_memory(spec, cfg, seq_len=spec.seq_len, micro_batch=micro_batch, num_microbatches=num_mb,
                          distributed_optimizer=False, precision="fp32" if "32" in str(spec.dtype) else "bf16")
    return side_task_memory_budget(est, stage, device_memory())


def _worker(args: argparse.Namespace) -> int:
    cfg = ParallelConfig.parse(args.layout)
    modes = _sequence(args.mode, args.warmup, args.rounds)
    tc = TrainConfig(model=args.model, steps=len(modes), global_batch=args.global_batch, micro_batch=args.micro_batch)
    ptc = trainer_ptc(tc.model, distributed_optimizer=False)
    spec = ModelSpec.from_json(ptc.meta["model"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    groups = init_distributed(cfg)
    fresh = rescale(None, ptc, rank=rank, world_size=world, parallel=cfg)  # a fresh start: the layout, no I/O
    trainer = Trainer(tc, ptc, groups, fresh, stdlib_corpus(spec.seq_len))
    stage = cfg.coords(rank).pp
    budget = _budget(args.memory_budget, ptc, cfg, stage, args.micro_batch, trainer.num_mb)
    runtime = BubbleRuntime(record=True, stage=stage, memory_budget=budget, device=groups.device)
    trainer.spans = []
    trainer.bubble_hook = runtime  # waits are timed in every mode

    def make(name: str) -> Any:  # the same task for both snapshot modes: same buckets, bytes and files
        if args.write:
            return StoreWriteTask(args.store_dir, ptc, cfg, rank, bucket_bytes=args.bucket_bytes, name=name)
        state = sum(t.nbytes for t in trainer.state_tensors().values())
        return SnapshotTask(bucket_bytes=args.bucket_bytes, name=name, state_bytes=state)

    tasks = {"bubbles": make("snapshot"), "blocking": make("snapshot-blocking")}
    gated = _OnlyWhenActive(tasks["bubbles"])  # bubble time in bubble-snapshot steps only, as when every
    runtime.register(gated)  # step snapshots (each step then also publishes the previous snapshot)
    if budget is not None:  # the blocking snapshot gets the same sizing, but never bubble time
        tasks["blocking"].fit_memory(runtime.grants["snapshot"])
    steps = []
    last_bubbles = max((i for i, m in enumerate(modes) if m == "bubbles"), default=-1)
    for i, mode in enumerate(modes):
        trainer.snapshot_task = tasks.get(mode)
        gated.active = mode == "bubbles"
        w0, u0 = runtime.wait_s, runtime.used_s
        t0 = time.perf_counter()
        loss, _ = trainer.train_step()
        steps.append({"mode": mode, "s": time.perf_counter() - t0, "loss": loss, "wait_s": runtime.wait_s - w0,
                      "task_s": runtime.used_s - u0})
    for task in tasks.values():
        if hasattr(task, "close"):
            task.close()
    out = {
        "rank": rank, "stage": stage, "steps": steps, "warmup_steps": 3 * args.warmup if args.mode == "interleave"
        else 0, "memory_budget": budget, "memory_granted": runtime.grants.get("snapshot"),
        "memory_held": tasks["bubbles"].memory_bytes, "bucket_bytes": tasks["bubbles"].bucket_bytes,
        "snapshots": {m: t.completed for m, t in tasks.items()},
        "bubble_bytes": {m: t.bubble_bytes for m, t in tasks.items()},
        "blocking_bytes": {m: t.blocking_bytes for m, t in tasks.items()},
        "spans": [[s.iteration, s.kind, s.start, s.end, s.label] for s in runtime.spans + trainer.spans
                  if s.iteration == last_bubbles],
        "windows": [w.to_json() for w in runtime.windows if w.iteration == last_bubbles],
        "trace": {"modes": modes, "spans": [[s.iteration, s.kind, s.start, s.end, s.label]
                                            for s in runtime.spans + trainer.spans],
                  "windows": [w.to_json() for w in runtime.windows]} if args.trace else None,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank-{rank:05d}.json").write_text(json.dumps(out))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class BenchConfig:
    """What :func:`run_bench` measures: ``model`` over a ``pp``-stage pipeline (dp=1, tp=1),
    ``rounds`` interleaved rounds after ``warmup`` ones, ``global_batch`` samples in micro-batches of
    ``micro_batch``, snapshots in buckets of ``bucket_bytes`` (``write``: to the host store, else to
    host memory only) within ``memory_budget`` per stage; ``plot``: a timeline PNG path, ``trace``:
    a JSON path for every iteration's spans and bubble windows."""

    model: str = "llama-small"
    pp: int = 2
    rounds: int = 20
    warmup: int = 2
    global_batch: int = 4
    micro_batch: int = 1
    bucket_bytes: int = 1 << 20
    write: bool = True
    memory_budget: str = "auto"
    plot: str | None = None
    trace: str | None = None

    def __post_init__(self) -> None:
        for name, least in (("pp", 2), ("rounds", 1), ("warmup", 0), ("global_batch", 1), ("micro_batch", 1),
                            ("bucket_bytes", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}"
                                  + (" (a pipeline of one stage has no bubbles)" if name == "pp" else ""))
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"global_batch {self.global_batch} is not a multiple of micro_batch {self.micro_batch}: "
                              f"{self.global_batch} % {self.micro_batch} = {self.global_batch % self.micro_batch}")


def _launch(mode: str, tmp: str, c: BenchConfig, device: str) -> list[dict]:
    """Run the ``pp`` workers of one pass in ``mode``; each rank's record."""
    pp, write = c.pp, c.write
    out = Path(tmp) / mode
    store_dir = tempfile.mkdtemp(prefix="tenplex-bubble-store-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
           f"--master-port={free_port()}", "-m", "tenplex.train.bubble_bench", "--", "--worker",
           "--mode", mode, "--model", c.model, "--layout", f"dp=1,tp=1,pp={pp}", "--rounds", str(c.rounds),
           "--warmup", str(c.warmup), "--global-batch", str(c.global_batch), "--micro-batch", str(c.micro_batch),
           "--bucket-bytes", str(c.bucket_bytes), "--store-dir", store_dir, "--out", str(out),
           "--write", str(int(write)), "--memory-budget", c.memory_budget] + (["--trace", "1"] if c.trace else [])
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({"TENPLEX_DEVICE": "cpu"} if device == "cpu" else {})}
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800, env=env)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"bubbles bench ({mode}) failed:\n{e.stderr.decode(errors='replace')[-3000:]}") from None
    finally:
        subprocess.run(["rm", "-rf", store_dir], check=False)
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def _bench_device(pp: int, write: bool) -> tuple[str, bool]:
    """The workers' device, as the trainer picks it: one GPU per stage, else CPU (gloo).

    With fewer GPUs than stages the bench runs on CPU (the workers get ``TENPLEX_DEVICE=cpu``);
    on GPUs snapshots copy to pinned host memory (``StoreWriteTask`` writes from host memory).
    """
    gpus = torch.cuda.device_count() if os.environ.get("TENPLEX_DEVICE", "") != "cpu" else 0
    if 0 < gpus < pp:
        print(f"bubbles bench: {gpus} CUDA device(s) for {pp} stages: running the stages on CPU with gloo",
              file=sys.stderr, flush=True)
        return "cpu", write
    if gpus and write:
        print("bubbles bench: GPU state: snapshots copy to pinned host memory (--write 0)", file=sys.stderr,
              flush=True)
        return "cuda", False
    return ("cuda" if gpus else "cpu"), write


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run the interleaved modes and a reference without snapshots; summarise (see the module docstring)."""
    device, write = _bench_device(config.pp, config.write)
    config = dataclasses.replace(config, write=write)
    model, pp, rounds, warmup, plot, trace = (config.model, config.pp, config.rounds, config.warmup, config.plot,
                                              config.trace)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tenplex-bubbles-") as tmp:
        print("bubbles bench: interleaved modes ...", file=sys.stderr, flush=True)
        ranks = _launch("interleave", tmp, config, device)
        print("bubbles bench: reference without snapshots ...", file=sys.stderr, flush=True)
        ref = _launch("none", tmp, config, device)
    load_after = os.getloadavg()
    skip = ranks[0]["warmup_steps"]
    n = len(ranks[0]["steps"])
    modes = [ranks[0]["steps"][i]["mode"] for i in range(n)]
    step_s = [max(r["steps"][i]["s"] for r in ranks) for i in range(n)]  # the pipeline's step time
    per_mode = {m: _spread([step_s[i] for i in range(skip, n) if modes[i] == m]) for m in MODES}
    rounds_s = [{modes[i]: step_s[i] for i in range(k, k + 3)} for k in range(skip, n, 3)]
    paired = {m: _spread([r[m] / r["none"] - 1 for r in rounds_s]) for m in ("blocking", "bubbles")}

    def frac(r: dict, mode: str, key: str, den: str) -> float:
        xs = [s for s in r["steps"][skip:] if s["mode"] == mode]
        return sum(s[key] for s in xs) / max(sum(s[den] for s in xs), 1e-9)

    m = config.global_batch // config.micro_batch
    summary = {
        "model": model, "layout": f"dp=1,tp=1,pp={pp}", "device": device, "num_microbatches": m, "rounds": rounds,
        "warmup_rounds": warmup, "write_to_store": write, "bucket_bytes": ranks[0]["bucket_bytes"],
        "step_s": per_mode, "overhead_blocking": per_mode["blocking"]["median"] / per_mode["none"]["median"] - 1,
        "overhead_bubbles": per_mode["bubbles"]["median"] / per_mode["none"]["median"] - 1,
        "overhead_paired": paired,
        "bubble_fraction": statistics.mean(frac(r, "none", "wait_s", "s") for r in ranks),
        "bubble_fraction_theory": (pp - 1) / (m + pp - 1),
        "bubble_time_used": statistics.mean(frac(r, "bubbles", "task_s", "wait_s") for r in ranks),
        "snapshots_completed": min(r["snapshots"]["bubbles"] for r in ranks),
        "snapshots_expected": modes.count("bubbles"),
        "bytes_copied_in_bubbles": sum(r["bubble_bytes"]["bubbles"] for r in ranks),
        "bytes_copied_blocking": sum(r["blocking_bytes"]["bubbles"] for r in ranks),
        "bytes_per_blocking_snapshot": sum(r["blocking_bytes"]["blocking"] for r in ranks)
        / max(min(r["snapshots"]["blocking"] for r in ranks), 1),
        "losses_equal": [s["loss"] for s in ranks[0]["steps"]] == [s["loss"] for s in ref[0]["steps"]],
        "memory": [{"stage": r["stage"], "budget": r["memory_budget"], "granted": r["memory_granted"],
                    "held": r["memory_held"]} for r in ranks],
        "windows": [w for r in ranks for w in r["windows"]],
        "loadavg_before": load_before, "loadavg_after": load_after,
    }
    if plot:
        _plot(ranks, plot)
        summary["timeline_png"] = plot
    if trace:
        Path(trace).write_text(json.dumps([{"rank": r["rank"], "stage": r["stage"], "steps": r["steps"], **r["trace"]}
                                           for r in ranks]))
        summary["trace"] = trace
    return summary


def _plot(ranks: list[dict], path: str) -> None:
    import matplotlib  # here: an optional dependency, needed only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.8 * len(ranks)))
    t_min = min(s[2] for r in ranks for s in r["spans"])
    colors = {"F": "tab:blue", "B": "tab:green", "wait": "0.85", "snapshot-blocking": "tab:red"}
    for r in ranks:
        y = r["stage"]
        for _, kind, a, b, label in sorted(r["spans"], key=lambda s: (s[1] != "wait", s[2])):
            c = colors.get(kind, "tab:orange" if kind.startswith("task:") else "0.5")
            h = 0.3 if kind.startswith("task:") else 0.7
            ax.broken_barh([((a - t_min) * 1e3, (b - a) * 1e3)], (y - h / 2, h), color=c)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               ("tab:blue", "tab:green", "0.85", "tab:orange", "tab:red")]
    ax.legend(handles, ["forward", "backward", "bubble (waiting for a peer)", "snapshot step in a bubble",
                        "snapshot rest before the update"], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)
    ax.set_yticks([r["stage"] for r in ranks], [f"stage {r['stage']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms within one iteration")
    ax.set_title("1F1B iteration with snapshot steps in the bubbles")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tenplex bench bubbles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="interleave", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="dp=1,tp=1,pp=2", help=argparse.SUPPRESS)
    ap.add_argument("--store-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds (one step of each mode per round)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds, excluded")
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ap.add_argument("--memory-budget", default="auto", help="side-task memory per stage: a size (e.g. 512MiB), "
                    "'none', or 'auto' (what the memory estimator's 80%% rule leaves of the device)")
    ap.add_argument("--write", type=int, default=1, help="1: write each snapshot to the host store; "
                    "0: copy to host memory only")
    ap.add_argument("--plot", default=None, help="timeline PNG path (e.g. docs/bench/bubbles_timeline.png)")
    ap.add_argument("--trace", default=None, help="JSON path for every iteration's spans and bubble windows "
                    "per rank (for analysis)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    try:
        config = BenchConfig(model=args.model, pp=args.pp, rounds=args.rounds, warmup=args.warmup,
                             global_batch=args.global_batch, micro_batch=args.micro_batch,
                             bucket_bytes=args.bucket_bytes, plot=args.plot, write=bool(args.write),
                             memory_budget=args.memory_budget, trace=args.trace)
    except ConfigError as e:
        ap.error(str(e))  # exits 2
    s = run_bench(config)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['model']} {s['layout']}, {s['num_microbatches']} micro-batches, {s['rounds']} interleaved rounds "
          f"(+{s['warmup_rounds']} warm-up), snapshots "
          f"{'written to the host store' if s['write_to_store'] else 'copied to host memory'}; load average "
          f"{s['loadavg_before'][0]:.2f} before, {s['loadavg_after'][0]:.2f} after")
    for mode, st in s["step_s"].items():
        print(f"  {mode:9s} step median {st['median'] * 1e3:7.1f} ms  (p25 {st['p25'] * 1e3:.1f}, "
              f"p75 {st['p75'] * 1e3:.1f}, min {st['min'] * 1e3:.1f}, max {st['max'] * 1e3:.1f})")
    for mode in ("blocking", "bubbles"):
        p = s["overhead_paired"][mode]
        print(f"  overhead {mode}: {s[f'overhead_{mode}'] * 100:+.1f}% of medians; paired per round median "
              f"{p['median'] * 100:+.1f}% (p25 {p['p25'] * 100:+.1f}%, p75 {p['p75'] * 100:+.1f}%)")
    print(f"  bubble fraction {s['bubble_fraction'] * 100:.1f}% (1F1B theory {s['bubble_fraction_theory'] * 100:.1f}%),"
          f" bubble time used by snapshots {s['bubble_time_used'] * 100:.1f}%")
    print(f"  snapshots completed {s['snapshots_completed']}/{s['snapshots_expected']}; bytes in bubbles "
          f"{s['bytes_copied_in_bubbles']}, before the update {s['bytes_copied_blocking']}, per blocking snapshot "
          f"{s['bytes_per_blocking_snapshot']:.0f}; losses {'identical' if s['losses_equal'] else 'DIFFER'}")
    for mem in s["memory"]:
        print(f"  stage {mem['stage']}: side-task memory budget {mem['budget']} B, snapshot granted "
              f"{mem['granted']} B, holds {mem['held']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
