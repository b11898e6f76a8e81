#!/usr/bin/env python
"""Bytes of activations autograd keeps in one forward pass of the reference trainer's stage,
per ``--recompute`` mode, beside the estimator's figure (docs/memory.md, "Activation
recomputation"). Deterministic: counts tensor storages, not process memory.

    python scripts/measure_recompute.py [--model llama-small] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tenplex  # noqa: E402
from tenplex.data.corpus import stdlib_corpus  # noqa: E402
from tenplex.layout.config import ParallelConfig  # noqa: E402
from tenplex.layout.models import model_spec  # noqa: E402
from tenplex.planning.memory import RECOMPUTE, estimate_memory  # noqa: E402
from tenplex.train import TrainConfig, Trainer, trainer_ptc  # noqa: E402
from tenplex.train.parallel import Groups  # noqa: E402


def saved_bytes(model: str, micro_batch: int, recompute: str) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    cfg = ParallelConfig()
    spec = model_spec(model)
    ptc = trainer_ptc(model, distributed_optimizer=False)
    tc = TrainConfig(model=model, steps=1, seed=7, recompute=recompute, global_batch=micro_batch,
                     micro_batch=micro_batch)
    fresh = tenplex.rescale(None, ptc, rank=0, world_size=1, parallel=cfg)
    trainer = Trainer(tc, ptc, Groups(cfg, 0, None, None, torch.device("cpu")), fresh, stdlib_corpus(spec.seq_len))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 256, (micro_batch, spec.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.model.forward(tokens)
    params = {p.untyped_storage().data_ptr() for p in trainer.params.values()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--micro-batch", type=int, default=2)
    a = ap.parse_args()
    spec = model_spec(a.model)
    print(f"{a.model}: one stage, seq {spec.seq_len}, micro-batch {a.micro_batch}, fp32")
    print(f"  {'recompute':<10} {'saved (measured)':>17} {'estimate':>10} {'+ transient':>12}")
    for mode in RECOMPUTE:
        st = estimate_memory(spec, ParallelConfig(), seq_len=spec.seq_len, micro_batch=a.micro_batch,
                             precision="fp32", recompute=mode, num_microbatches=1).stages[0]
        print(f"  {mode:<10} {saved_bytes(a.model, a.micro_batch, mode) / 1e6:>14.1f} MB {st.activation_bytes / 1e6:>7.1f} MB "
              f"{st.recompute_bytes / 1e6:>9.1f} MB")


if __name__ == "__main__":
    main()
