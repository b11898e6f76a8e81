#!/usr/bin/env python
"""Compare tenplex.estimate_memory with the reference trainer's measured peak memory.

For each layout, the trainer runs two steps under torchrun; every rank measures its peak
during the second step (CUDA: allocator peak; CPU: PyTorch's memory-profiler timeline of
every tensor allocation and free). The peak of each pipeline stage's most loaded rank is
compared with the estimate for that stage (fp32 training, the trainer's micro-batch count).
Writes docs/memory_measured.json and prints a markdown table.
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


def run_case(model: str, layout: str, gb: int, mb: int, dist_opt: bool, work: Path) -> list[dict]:
    cfg = ParallelConfig.parse(layout)
    out = work / f"{model}-{layout.replace(',', '_').replace('=', '')}-{int(dist_opt)}"
    args = ["-m", "tenplex.train", "--model", model, "--steps", "2", "--global-batch", str(gb), "--micro-batch",
            str(mb), "--parallel", layout, "--measure-memory", str(out)]
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
    est = estimate_memory(model, cfg, seq_len=_seq_len(model), micro_batch=mb, distributed_optimizer=dist_opt,
                          num_microbatches=ranks[0]["num_microbatches"], precision="fp32")
    rows = []
    for stage in est.stages:
        measured = max(r["peak_bytes"] for r in ranks if r["pp"] == stage.stage)
        state = max(r["state_bytes"] for r in ranks if r["pp"] == stage.stage)
        rows.append({"model": model, "layout": layout, "micro_batch": mb, "distributed_optimizer": dist_opt,
                     "stage": stage.stage, "estimated_bytes": stage.total_bytes,
                     "estimated_state_bytes": stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes,
                     "estimated_activation_bytes": stage.activation_bytes, "measured_bytes": measured,
                     "measured_state_bytes": state, "ratio": measured / stage.total_bytes,
                     "method": ranks[0]["method"]})
    return rows


def _seq_len(model: str) -> int:
    from tenplex.models import PRESETS

    return int(PRESETS[model]["seq_len"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "memory_measured.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tenplex-mem-") as tmp:
        for case in CASES:
            t0 = time.time()
            print(f"measuring {case[0]} {case[1]} ...", file=sys.stderr, flush=True)
            rows.extend(run_case(*case, work=Path(tmp)))
            print(f"  {time.time() - t0:.1f}s", file=sys.stderr)
    print("| model | layout | mb | dist-opt | stage | estimated MiB | measured MiB | measured / estimated |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layout']} | {r['micro_batch']} | {'yes' if r['distributed_optimizer'] else 'no'} "
              f"| {r['stage']} | {r['estimated_bytes'] / 2**20:.1f} | {r['measured_bytes'] / 2**20:.1f} "
              f"| {r['ratio']:.2f} |")
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                                          "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
