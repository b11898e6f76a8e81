"""The smallest elastic torch-native job: the user's own loop with ``tenplex.ElasticRuntime``.

The loop of docs/your_model.md, runnable: a plain-torch Llama (``native_llama.py``) under FSDP2 over
every worker. Under torchrun (or any env:// launcher) with ``TENPLEX_MEMBERSHIP_STORE=host:port`` (a
c10d store that outlives the workers), a worker's death makes the others rebuild the model for
their number and continue in process from the newest state they hold. ``--kill-at RANK:STEP``
(testing) SIGKILLs that rank in the forward pass of that step (in its second layer, the first one's
all-gather done). ``--mesh N``: the mesh holds at most N workers; the others wait as spares and take a
dead worker's place; ``--spares K``: K of the workers there are wait as spares (after a restart with fewer
workers too). Without ``TENPLEX_MEMBERSHIP_STORE`` the job only checkpoints and resumes: the launcher's
restart is its recovery. ``--uneven``: a DP degree that does not divide the global batch runs too (4
workers, global batch 8, one dies: DP 3 reads 3, 3 and 2 samples), each rank's loss weighed by its share
(``rt.loss_scale``). ``--ids DIR`` (testing): every rank writes the sample ids it read at each step to
``DIR/rank<R>.jsonl``.

    TENPLEX_MEMBERSHIP_STORE=127.0.0.1:29400 torchrun --nproc-per-node=4 examples/elastic_loop.py --ckpt /tmp/c
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_llama as nl  # noqa: E402 - the user's model, next to this script

import tenplex  # noqa: E402
from tenplex.data import DataState, global_batch_ids, rank_batch_ids, stdlib_corpus  # noqa: E402
from tenplex.data.batches import IndexBatches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--log", default="", help="JSON lines: rank 0's steps and the runtime's events")
    p.add_argument("--kill-at", default="", help="testing: RANK:STEP, SIGKILL in that step's forward pass")
    p.add_argument("--mesh", type=int, default=0, help="at most this many workers train, the others are spares")
    p.add_argument("--uneven", action="store_true", help="allow DP degrees that do not divide the global batch")
    p.add_argument("--ids", default="", help="testing: a directory; each rank's sample ids per step go there")
    p.add_argument("--spares", type=int, default=0, help="this many workers wait as spares")
    args = p.parse_args()
    kill = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    first_rank = int(os.environ.get("RANK", "0"))
    cfg = dataclasses.replace(nl.PRESETS["tiny"], vocab_size=259, seq_len=16)
    corpus = stdlib_corpus(16)
    batches = IndexBatches(corpus)

    def log(record: dict[str, Any]) -> None:
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- the job with tenplex: build for a mesh, a mesh rule, the runtime, one `with step:` per step
    def build(mesh: Any) -> tuple[Any, Any]:
        model = nl.parallelize(nl.reference_model(cfg, seed=0), mesh)
        return model, nl.make_optimizer(model)

    rt = tenplex.ElasticRuntime(build, lambda world: {"dp_shard": min(world - args.spares, args.mesh or world)},
                                ckpt=args.ckpt, ckpt_every=2,
                                data=DataState(corpus.num_samples, args.global_batch, seed=1),
                                in_process="TENPLEX_MEMBERSHIP_STORE" in os.environ, dead_after=2.0, on_event=log,
                                uneven_dp=args.uneven)
    for step in rt.steps(args.steps):
        with step:
            # this rank's samples: an equal slice, or with --uneven its share (the first ranks one more)
            raw = batches.batch(rt.data, rt.dp_size, rt.dp_rank, micro_batch=1)
            if kill == (first_rank, rt.step):  # testing: die inside the forward pass, in its second layer
                rt.model.layers["1"].register_forward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            loss = nl.train_step(rt.model, rt.optimizer, raw[:, :-1], raw[:, 1:], group=rt.group,
                                 loss_scale=rt.loss_scale)  # 1.0 unless the split is uneven
            if args.ids:  # the ids of the rows read (the reader's: rank_batch_ids)
                with open(os.path.join(args.ids, f"rank{first_rank}.jsonl"), "a") as f:
                    f.write(json.dumps({"step": rt.step, "world_size": rt.world_size, "dp_rank": rt.dp_rank,
                                        "ids": rank_batch_ids(rt.data, rt.dp_size, rt.dp_rank, 1).tolist(),
                                        "loss_scale": rt.loss_scale, "t": time.time()}) + "\n")
            if rt.rank == 0:
                log({"step": rt.step, "loss": loss, "world_size": rt.world_size,
                     "samples": global_batch_ids(rt.data).tolist()})


if __name__ == "__main__":
    main()
