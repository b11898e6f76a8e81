"""``tenplex bench bubbles``: the cost of snapshotting every step, blocking versus inside pipeline bubbles.

Runs the reference trainer with PP >= 2 under torchrun three times: no snapshot, a blocking
snapshot every step (copy the state, then write it to the host store, while training
waits), and a bubble snapshot every step (``tenplex.bubbles``: the snapshot is written into
the host store bucket by bucket during the 1F1B waits, the rest just before the optimizer
step; with ``--write 0`` both modes only copy the state to host memory).
Reports step times, overheads, the bubble fraction, the share of bubble time used and the
snapshots completed, and draws one iteration's timeline per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["run_bench", "main"]


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..bubbles import BubbleRuntime, SnapshotTask, StoreWriteTask
    from ..config import ParallelConfig
    from ..data.corpus import stdlib_corpus
    from ..elastic import RescaleResult
    from ..models import ModelSpec
    from ..store import HostStore
    from .parallel import init_distributed
    from .trainer import TrainConfig, Trainer, trainer_ptc

    cfg = ParallelConfig.parse(args.layout)
    tc = TrainConfig(model=args.model, steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch)
    ptc = trainer_ptc(tc.model, distributed_optimizer=False)
    spec = ModelSpec.from_json(ptc.meta["model"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    groups = init_distributed(cfg)
    trainer = Trainer(tc, ptc, groups, RescaleResult(cfg, rank, world, 0, True), stdlib_corpus(spec.seq_len))
    store = HostStore(args.store_dir, "")
    writer: list[threading.Thread] = []

    def write(step: int, snap: dict) -> None:
        if not args.write:
            return
        shard = {**snap, "optimizer.step": step, "data": trainer.data.to_json()}
        store.snapshot(ptc, cfg, rank, shard, step=step, replicate=False)

    runtime = BubbleRuntime(record=True)
    trainer.spans = []
    trainer.bubble_hook = runtime  # waits are timed in every mode
    task = None
    if args.mode == "bubbles":
        if args.write:  # the snapshot is written into the store in bubble-sized pieces
            task = StoreWriteTask(args.store_dir, ptc, cfg, rank, bucket_bytes=args.bucket_bytes)
        else:  # copied to host memory only
            task = SnapshotTask(bucket_bytes=args.bucket_bytes)
        runtime.register(task)
        trainer.snapshot_task = task
    times, losses = [], []
    blocking_s = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss, _ = trainer.train_step()
        if args.mode == "blocking":
            b0 = time.perf_counter()
            snap = {n: t.detach().to("cpu", copy=True) for n, t in trainer.state_tensors().items()}
            write(trainer.step, snap)
            blocking_s += time.perf_counter() - b0
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    for w in writer:
        w.join()
    if hasattr(task, "close"):
        task.close()
    warm = times[args.warmup:]
    out = {
        "rank": rank, "stage": cfg.coords(rank).pp, "mode": args.mode, "step_times": times,
        "median_step_s": statistics.median(warm), "losses": losses, "wait_s": runtime.wait_s,
        "task_s": runtime.used_s, "total_s": sum(times), "snapshots": task.completed if task else
        (args.steps if args.mode == "blocking" else 0),
        "bubble_bytes": task.bubble_bytes if task else 0, "blocking_bytes": task.blocking_bytes if task else 0,
        "spans": [[s.iteration, s.kind, s.start, s.end, s.label] for s in runtime.spans + trainer.spans
                  if s.iteration == args.steps - 2],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank-{rank:05d}.json").write_text(json.dumps(out))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def run_bench(*, model: str = "llama-small", pp: int = 2, steps: int = 12, warmup: int = 3, global_batch: int = 8,
              micro_batch: int = 2, bucket_bytes: int = 1 << 20, plot: str | None = None,
              write: bool = True) -> dict[str, Any]:
    """Run the three modes and summarise (see the module docstring)."""
    from .launch import free_port

    layout = f"dp=1,tp=1,pp={pp}"
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tenplex-bubbles-") as tmp:
        for mode in ("none", "blocking", "bubbles"):
            out = Path(tmp) / mode
            store_dir = tempfile.mkdtemp(prefix="tenplex-bubble-store-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                         else tmp)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
                   f"--master-port={free_port()}", "-m", "tenplex.train.bubble_bench", "--", "--worker",
                   "--mode", mode, "--model", model, "--layout", layout, "--steps", str(steps), "--warmup", str(warmup),
                   "--global-batch", str(global_batch), "--micro-batch", str(micro_batch), "--bucket-bytes",
                   str(bucket_bytes), "--store-dir", store_dir, "--out", str(out), "--write", str(int(write))]
            print(f"bubbles bench: {mode} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, capture_output=True, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[mode] = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
            subprocess.run(["rm", "-rf", store_dir], check=False)
    step = {m: max(r["median_step_s"] for r in rs) for m, rs in results.items()}
    m = global_batch // micro_batch
    bub = results["bubbles"]
    summary = {
        "model": model, "layout": layout, "num_microbatches": m, "steps": steps, "write_to_store": write,
        "step_s": step,
        "overhead_blocking": step["blocking"] / step["none"] - 1,
        "overhead_bubbles": step["bubbles"] / step["none"] - 1,
        "bubble_fraction": statistics.mean(r["wait_s"] / r["total_s"] for r in results["none"]),
        "bubble_fraction_theory": (pp - 1) / (m + pp - 1),
        "bubble_time_used": sum(r["task_s"] for r in bub) / max(sum(r["wait_s"] for r in bub), 1e-9),
        "snapshots_completed": min(r["snapshots"] for r in bub),
        "bytes_copied_in_bubbles": sum(r["bubble_bytes"] for r in bub),
        "bytes_copied_blocking": sum(r["blocking_bytes"] for r in bub),
        "losses_equal": all(a["losses"] == b["losses"] for a, b in zip(results["none"], bub)),
    }
    if plot:
        _plot(results["bubbles"], plot)
        summary["timeline_png"] = plot
    return summary


def _plot(ranks: list[dict], path: str) -> None:
    import matplotlib

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
    ap.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="dp=1,tp=1,pp=2", help=argparse.SUPPRESS)
    ap.add_argument("--store-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ap.add_argument("--write", type=int, default=1, help="1: also write each snapshot to the host store; "
                    "0: copy to host memory only")
    ap.add_argument("--plot", default=None, help="timeline PNG path (e.g. docs/bubbles_timeline.png)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    s = run_bench(model=args.model, pp=args.pp, steps=args.steps, warmup=args.warmup, global_batch=args.global_batch,
                  micro_batch=args.micro_batch, bucket_bytes=args.bucket_bytes, plot=args.plot, write=bool(args.write))
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['model']} {s['layout']}, {s['num_microbatches']} micro-batches, {s['steps']} steps, snapshots "
          f"{'copied to host memory and written to the host store' if s['write_to_store'] else 'copied to host memory'}")
    print(f"  step time: none {s['step_s']['none'] * 1e3:.1f} ms, blocking snapshot {s['step_s']['blocking'] * 1e3:.1f} ms,"
          f" bubble snapshot {s['step_s']['bubbles'] * 1e3:.1f} ms")
    print(f"  overhead: blocking {s['overhead_blocking'] * 100:+.1f}%, bubbles {s['overhead_bubbles'] * 100:+.1f}%")
    print(f"  bubble fraction {s['bubble_fraction'] * 100:.1f}% (1F1B theory {s['bubble_fraction_theory'] * 100:.1f}%),"
          f" bubble time used by snapshots {s['bubble_time_used'] * 100:.1f}%")
    print(f"  snapshots completed {s['snapshots_completed']}; copied in bubbles "
          f"{s['bytes_copied_in_bubbles']} B, before the update {s['bytes_copied_blocking']} B; "
          f"losses {'identical' if s['losses_equal'] else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
