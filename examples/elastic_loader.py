"""A user's DataLoader (2 worker processes) made elastic: its position survives an in-process recovery.

The loop of docs/data.md, runnable: ``ElasticRuntime`` carries the data position (``rt.data``, a
``DataState`` in tenplex's "feistel" order) through its checkpoints and recoveries; the loader reads
the batch of that position for this rank of the current DP size (``ElasticLoader.batch_for``), so a
recovery onto fewer workers continues with the next global batch. A tiny replicated linear model
(gradients all-reduced, as DDP does) stands in for the user's. ``--kill-at RANK:STEP`` (testing)
SIGKILLs that rank in that step; ``--log DIR`` writes each rank's batches to ``DIR/rank<R>.jsonl``.

    TENPLEX_MEMBERSHIP_STORE=127.0.0.1:29400 torchrun --nproc-per-node=4 examples/elastic_loader.py --ckpt /tmp/c
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import tenplex
from tenplex.data import ElasticBatchSampler, ElasticLoader, loader_state


class Squares:
    """The user's map-style dataset: sample ``i`` is ``(i, features)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.tensor([i % 7, i % 5, i % 3, 1.0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--log", default="")
    p.add_argument("--kill-at", default="", help="testing: RANK:STEP, SIGKILL in that step")
    args = p.parse_args()
    kill = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    first_rank = int(os.environ.get("RANK", "0"))

    def build(mesh: Any) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    # --- the data, elastic: a sampler for this rank, a DataLoader with workers, the position in rt.data
    dataset = Squares(args.samples)
    sampler = ElasticBatchSampler(loader_state(dataset, args.global_batch, seed=1))
    # workers from a forkserver, not forked from a process holding the job's sockets: forked ones would keep
    # a killed rank's connections open until they notice their parent is gone, and the peers wait on them
    # (persistent: started once, they serve every epoch and every layout after a recovery)
    loader = ElasticLoader(dataset, sampler, num_workers=args.workers, persistent_workers=args.workers > 0,
                           multiprocessing_context="forkserver" if args.workers else None)
    rt = tenplex.ElasticRuntime(build, lambda world: {"dp_replicate": world}, ckpt=args.ckpt, ckpt_every=2,
                                data=loader.data, dead_after=2.0)
    for step in rt.steps(args.steps):
        with step:
            ids, x = loader.batch_for(rt.data, rt.dp_size, rt.dp_rank)
            if kill == (first_rank, rt.step):
                os.kill(os.getpid(), signal.SIGKILL)
            loss = rt.model(x).square().mean()
            loss.backward()
            for prm in rt.model.parameters():
                dist.all_reduce(prm.grad, group=rt.mesh.get_group())
            rt.optimizer.step()
            rt.optimizer.zero_grad()
            if args.log:
                with open(os.path.join(args.log, f"rank{first_rank}.jsonl"), "a") as f:
                    f.write(json.dumps({"step": rt.step, "world_size": rt.world_size, "dp_rank": rt.dp_rank,
                                        "ids": ids.tolist(), "t": time.time()}) + "\n")


if __name__ == "__main__":
    main()
