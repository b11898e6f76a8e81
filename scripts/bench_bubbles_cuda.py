"""Bubble snapshots on one GPU: the CUDA path of ``SnapshotTask`` under ``BubbleRuntime``.

The reference trainer needs one GPU per pipeline stage (nccl), so on a one-GPU machine this
runs stage 0 of a two-stage 1F1B pipeline for real (forward and backward are chains of bf16
matrix products on the default stream, the optimizer step updates the state in place) and
stands in for stage 1 with a clock: stage 1 starts forward j when stage 0's forward j has
finished and it is free, and takes the same forward and backward times, so the gradient for
backward j "arrives" when stage 1 would have sent it. Stage 0 waits for it like for a
receive (the GPU idles, the host polls), and that wait is the bubble.

Per iteration, interleaved by round as in ``tenplex bench bubbles``: no snapshot; a blocking
snapshot (all buckets copied device-to-host into pinned buffers before the optimizer step);
a bubble snapshot (the same task, its buckets copied in the waits on a lowest-priority
stream, the rest before the optimizer step). Reports step-time medians and paired overheads,
bytes copied in the bubbles, per-op compute times (does the side stream slow compute?), and
checks that a bubble snapshot equals the state before the optimizer step bit for bit.

    python scripts/bench_bubbles_cuda.py [--state 1GiB] [--fwd-ms 10] [--rounds 30] [--json PATH]

``run(..., device="cpu", dim=128)`` runs the same loop on CPU with small matrices (no side stream,
no pinned buffers): ``scripts/gpu_check.py --dry-run`` keeps this path exercised in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from tenplex.elastic.bubbles import BubbleRuntime, SnapshotTask
from tenplex.planning.memory import parse_size
from tenplex.train.schedule import one_f_one_b


@dataclass
class _Arrival:
    """A gradient that arrives at ``at`` (perf_counter seconds): the emulated stage 1's send."""

    at: float

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.at

    def wait(self) -> None:
        while time.perf_counter() < self.at:
            pass


def _sync(dev: torch.device) -> None:
    """Wait for the device's queued work (timings and sends need it finished); nothing on CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _compute(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ w)
    return x


def _calibrate(x: torch.Tensor, w: torch.Tensor, target_s: float) -> int:
    _compute(x, w, 10)
    _sync(x.device)
    t0 = time.perf_counter()
    _compute(x, w, 50)
    _sync(x.device)
    return max(1, round(target_s / ((time.perf_counter() - t0) / 50)))


def run(state_bytes: int, fwd_s: float, rounds: int, m: int, bucket_bytes: int, *,
        device: str = "cuda", dim: int = 4096) -> dict:
    """The figures of ``rounds`` measured rounds (after 2 warm-up rounds) on ``device`` (``dim``:
    the side of the square bf16 matrices the emulated forward and backward multiply)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    n_tensors = 16
    numel = state_bytes // 4 // n_tensors
    gen = torch.Generator(device=dev).manual_seed(0)
    state = {f"t{i}": torch.randn(numel, device=dev, generator=gen) for i in range(n_tensors)}
    x = torch.randn(dim, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(dim, dim, device=dev, dtype=torch.bfloat16, generator=gen) / dim ** 0.5
    n_fwd = _calibrate(x, w, fwd_s)
    ops = one_f_one_b(2, m, 0)
    task = SnapshotTask(bucket_bytes=bucket_bytes)
    runtime = BubbleRuntime(stage=0, record=False, device=dev)
    runtime.register(task)
    modes = ("none", "blocking", "bubbles")
    times: dict[str, list[float]] = {k: [] for k in modes}
    compute: dict[str, dict[str, list[float]]] = {k: {"F": [], "B": []} for k in modes}
    waits: list[float] = []
    copied = {k: [0, 0] for k in modes}  # bytes copied in bubbles / before the optimizer step, per mode

    def iteration(mode: str, it: int, verify: bool = False) -> None:
        _sync(dev)
        b0, k0 = task.bubble_bytes, task.blocking_bytes
        t0 = time.perf_counter()
        runtime.begin_iteration(it)
        if mode != "none":
            task.begin(it, state)
        act: dict[int, float] = {}
        s1_free = t0
        grad: dict[int, float] = {}
        for op in ops:
            if op.kind == "B":
                if op.mb not in grad:  # stage 1: forward j once the activation is there, then backward j
                    s1_free = max(s1_free, act[op.mb]) + fwd_s
                    s1_free += 2 * fwd_s
                    grad[op.mb] = s1_free
                work = _Arrival(grad[op.mb])
                if mode == "bubbles":
                    w0 = time.perf_counter()
                    runtime(op, work)
                    waits.append(time.perf_counter() - w0)
                else:
                    work.wait()
            c0 = time.perf_counter()
            _compute(x, w, n_fwd if op.kind == "F" else 2 * n_fwd)
            _sync(dev)  # the send of the result: the next stage needs it finished
            c1 = time.perf_counter()
            compute[mode][op.kind].append(c1 - c0)
            if op.kind == "F":
                act[op.mb] = c1
        if mode != "none":
            snap = task.finish()
            if verify:
                assert snap is not None
                bad = [n for n, t in state.items() if not torch.equal(snap[n], t.cpu())]
                if bad:
                    raise AssertionError(f"bubble snapshot differs from the state in {bad}")
        for t in state.values():  # the optimizer step: the state changes only here
            t.mul_(0.999).add_(1e-3)
        _sync(dev)
        if not verify:
            times[mode].append(time.perf_counter() - t0)
            copied[mode][0] += task.bubble_bytes - b0
            copied[mode][1] += task.blocking_bytes - k0

    it = 0
    for r in range(rounds + 2):
        order = modes[r % 3:] + modes[: r % 3]
        for mode in order:
            iteration(mode, it)
            it += 1
        if r < 2:  # warm-up rounds: profiling, allocation of the pinned buffers
            for k in modes:
                times[k].clear()
                compute[k]["F"].clear()
                compute[k]["B"].clear()
                copied[k] = [0, 0]
    bubble_bytes, blocking_bytes = copied["bubbles"]
    iteration("bubbles", it, verify=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = {k: statistics.median([b / a - 1 for a, b in zip(times["none"], times[k])]) for k in ("blocking", "bubbles")}
    bub_per_iter = bubble_bytes / rounds
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "state_bytes": state_bytes,
        "bucket_bytes": bucket_bytes,
        "num_microbatches": m,
        "fwd_ms": fwd_s * 1e3,
        "rounds": rounds,
        "step_ms": {k: v * 1e3 for k, v in med.items()},
        "overhead_blocking": med["blocking"] / med["none"] - 1,
        "overhead_bubbles": med["bubbles"] / med["none"] - 1,
        "overhead_paired": paired,
        "bytes_in_bubbles_fraction": bubble_bytes / max(bubble_bytes + blocking_bytes, 1),  # bubble mode
        "bytes_in_bubbles_per_iteration": bub_per_iter,
        "snapshot_ms_blocking": (med["blocking"] - med["none"]) * 1e3,
        "d2h_gbps_blocking": state_bytes / max(med["blocking"] - med["none"], 1e-9) / 1e9,
        "compute_ms": {k: {op: statistics.median(v) * 1e3 for op, v in d.items()} for k, d in compute.items()},
        "bubble_wait_ms_median": statistics.median(waits) * 1e3 if waits else 0.0,
        "snapshot_equal": True,
        "stream_priority_range": list(torch.cuda.Stream.priority_range()) if dev.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default="1GiB", help="bytes of state on the GPU (default 1GiB)")
    ap.add_argument("--fwd-ms", type=float, default=10.0, help="forward time per micro-batch; backward is 2x")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--bucket", default="4MiB")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bubbles_cuda: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    out = run(parse_size(args.state), args.fwd_ms / 1e3, args.rounds, args.microbatches, parse_size(args.bucket))
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
