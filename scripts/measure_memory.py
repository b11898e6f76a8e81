#!/usr/bin/env python
"""Compare tenplex.estimate_memory with the reference trainer's measured peak memory.

For each layout, the trainer runs two steps under torchrun; every rank measures its peak
during the second step (CUDA: allocator peak; CPU: PyTorch's memory-profiler timeline of
every tensor allocation and free). The peak of each pipeline stage's most loaded rank is
compared with the estimate for that stage (fp32 training, the trainer's micro-batch count).
Writes docs/bench/memory_measured.json and prints a markdown table. ``--gpu`` runs one-rank layouts
with long sequences on the CUDA device instead (docs/bench/memory_measured_gpu.json); without it
the workers run on CPU with gloo even where CUDA is present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tenplex import ParallelConfig, estimate_memory  # noqa: E402
from tenplex.train.launch import free_port  # noqa: E402

CASES = [
    # model, layout, global batch, micro batch, distributed optimizer
    ("llama-small", "dp=1,tp=1,pp=1", 8, 4, False),
    ("llama-small", "dp=1,tp=2,pp=1", 8, 4, False),
    ("llama-small", "dp=1,tp=1,pp=2", 8, 4, False),
    ("llama-small", "dp=2,tp=1,pp=1", 8, 4, True),
    ("llama-small", "dp=1,tp=2,pp=2", 8, 2, False),
    ("tiny", "dp=1,tp=1,pp=1", 8, 2, False),
    ("tiny", "dp=2,tp=2,pp=1", 8, 2, False),
]

# --gpu: one CUDA device, so one-rank layouts; longer sequences and larger micro-batches make
# activations the larger share (model, layout, global batch, micro batch, dist. opt., seq len)
GPU_CASES = [
    ("llama-100m", "dp=1,tp=1,pp=1", 8, 4, False, 1024),
    ("llama-100m", "dp=1,tp=1,pp=1", 8, 8, False, 2048),
    ("llama-100m", "dp=1,tp=1,pp=1", 8, 8, False, 4096),
    ("llama-small", "dp=1,tp=1,pp=1", 16, 16, False, 4096),
    ("llama-small", "dp=1,tp=1,pp=1", 8, 8, False, 256),
]


def run_case(model: str, layout: str, gb: int, mb: int, dist_opt: bool, seq_len: int | None = None, *,
             work: Path, recompute: str = "none") -> list[dict]:
    """The trainer's measured peak of each stage beside ``estimate_memory``'s (``recompute``: the
    trainer's ``--recompute`` and the estimator's mode)."""
    cfg = ParallelConfig.parse(layout)
    seq_len = seq_len or _seq_len(model)
    out = work / f"{model}-{layout.replace(',', '_').replace('=', '')}-{int(dist_opt)}-{mb}-{seq_len}-{recompute}"
    args = ["-m", "tenplex.train", "--model", model, "--steps", "2", "--global-batch", str(gb), "--micro-batch",
            str(mb), "--parallel", layout, "--measure-memory", str(out), "--seq-len", str(seq_len),
            "--recompute", recompute]
    if dist_opt:
        args.append("--distributed-optimizer")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cfg.world_size == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cfg.world_size}", f"--master-port={free_port()}", "-m", "tenplex.train", "--",
               *args[2:]]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=env)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    est = estimate_memory(model, cfg, seq_len=seq_len, micro_batch=mb, distributed_optimizer=dist_opt,
                          num_microbatches=ranks[0]["num_microbatches"], precision="fp32", recompute=recompute)
    rows = []
    for stage in est.stages:
        measured = max(r["peak_bytes"] for r in ranks if r["pp"] == stage.stage)
        state = max(r["state_bytes"] for r in ranks if r["pp"] == stage.stage)
        rows.append({"model": model, "layout": layout, "micro_batch": mb, "seq_len": seq_len,
                     "distributed_optimizer": dist_opt, "recompute": recompute,
                     "stage": stage.stage, "estimated_bytes": stage.total_bytes,
                     "estimated_state_bytes": stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes,
                     "estimated_activation_bytes": stage.activation_bytes, "measured_bytes": measured,
                     "measured_state_bytes": state, "ratio": measured / stage.total_bytes,
                     "method": ranks[0]["method"]})
    return rows


def _seq_len(model: str) -> int:
    from tenplex.layout.models import PRESETS

    return int(PRESETS[model]["seq_len"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="default: docs/bench/memory_measured.json (--gpu: _gpu.json)")
    ap.add_argument("--gpu", action="store_true", help="the one-GPU cases on CUDA (the trainer's allocator peak)")
    args = ap.parse_args()
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("measure_memory --gpu: no CUDA device; nothing to measure", file=sys.stderr)
            return 0
    else:
        os.environ["TENPLEX_DEVICE"] = "cpu"  # the workers inherit it: CPU and gloo, as many ranks as a case needs
    out_path = args.out or str(ROOT / "docs" / "bench" / ("memory_measured_gpu.json" if args.gpu else "memory_measured.json"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tenplex-mem-") as tmp:
        for case in GPU_CASES if args.gpu else CASES:
            t0 = time.time()
            print(f"measuring {case[0]} {case[1]} ...", file=sys.stderr, flush=True)
            rows.extend(run_case(*case, work=Path(tmp)))  # type: ignore[arg-type]
            print(f"  {time.time() - t0:.1f}s", file=sys.stderr)
    print("| model | layout | seq | mb | dist-opt | stage | estimated MiB (state + act.) | measured MiB (state) "
          "| measured / estimated |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layout']} | {r['seq_len']} | {r['micro_batch']} "
              f"| {'yes' if r['distributed_optimizer'] else 'no'} | {r['stage']} "
              f"| {r['estimated_bytes'] / 2**20:.1f} ({r['estimated_state_bytes'] / 2**20:.1f} + "
              f"{r['estimated_activation_bytes'] / 2**20:.1f}) | {r['measured_bytes'] / 2**20:.1f} "
              f"({r['measured_state_bytes'] / 2**20:.1f}) | {r['ratio']:.2f} |")
    device = None
    if args.gpu:
        import torch

        device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    Path(out_path).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                                          "cpus": os.cpu_count(), "device": device, "rows": rows}, indent=1))
    print(f"\nwrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
