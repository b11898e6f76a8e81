"""A torch-native training job that uses tenplex: the example of docs/your_model.md.

The model is plain torch (``native_llama.py``: a Llama parallelized with torch's own TP and
FSDP2 APIs). tenplex adds three calls: ``choose_mesh`` at start-up (the mesh for however many
workers torchrun started), ``load_state_dict`` (fill the freshly built model and optimizer in
place from the newest checkpoint, whatever mesh wrote it), ``save_state_dict`` every K steps;
batches come from tenplex's dataset index reader, so a rescale continues the same sample order.

    torchrun --nproc-per-node=4 examples/train_native.py --ckpt /tmp/ckpt --steps 12 --log /tmp/log.jsonl

Kill some workers (or a node) and let torchrun's elastic agent restart the rest: they pick a new
mesh and continue from the last checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_llama as nl  # noqa: E402 - the user's model, next to this script

import tenplex  # noqa: E402
from tenplex.data.corpus import stdlib_corpus  # noqa: E402
from tenplex.data.partition import DataState, global_batch_ids  # noqa: E402
from tenplex.elastic import choose_mesh  # noqa: E402
from tenplex.train.batches import IndexBatches  # noqa: E402


def mesh_rule(world: int) -> dict[str, int]:
    """This job's own rule: FSDP2 x TP2 when there are at least 4 workers, else FSDP2 alone."""
    return {"dp_shard": world // 2, "tp": 2} if world >= 4 and world % 2 == 0 else {"dp_shard": world}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint URL (a directory or any fsspec URL)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--log", default="", help="JSON lines: one per step (rank 0) and one per start")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("TENPLEX_PID_DIR"):  # lets a simulated node failure kill this worker too
        Path(os.environ["TENPLEX_PID_DIR"], f"local-{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(
            str(os.getpid()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    # 1. the mesh for this world size, then the model built and parallelized for it
    t0 = time.perf_counter()
    dims = choose_mesh(world, choose=mesh_rule)
    mesh = nl.build_mesh(dims, device)
    cfg = dataclasses.replace(nl.PRESETS["tiny"], vocab_size=259, seq_len=args.seq_len)
    model = nl.parallelize(nl.reference_model(cfg, seed=0).to(device), mesh)
    optimizer = nl.make_optimizer(model)
    dp_rank, dp = nl.dp_rank_and_size(mesh)

    corpus = stdlib_corpus(args.seq_len)
    batches = IndexBatches(corpus)
    data = DataState(corpus.num_samples, args.global_batch, seed=1)
    step = 0

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": step, "data": data.to_json()}

    # 2. resume: fill the new model and optimizer in place from the newest checkpoint
    start = {"start": True, "world_size": world, "mesh": dims, "step": 0, "fresh": True}
    if any(s.complete for s in tenplex.list_steps(args.ckpt)):
        sd = state()  # get_state_dict creates the optimizer state the load fills
        res = tenplex.load_state_dict(sd, args.ckpt)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step, data = sd["step"], DataState.from_json(sd["data"])
        start = {"start": True, "world_size": world, "mesh": dims, "step": step, "bytes_read": res.bytes_read,
                 "bytes_needed": res.bytes_needed, "load_s": res.seconds}
    start["startup_s"] = time.perf_counter() - t0
    if rank == 0 and args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps(start) + "\n")

    # 3. train; save every K steps
    while step < args.steps:
        raw = batches.batch(data, dp, dp_rank).to(device)
        loss = nl.train_step(model, optimizer, raw[:, :-1], raw[:, 1:])
        if rank == 0 and args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "world_size": world, "mesh": dims,
                                    "samples": global_batch_ids(data).tolist()}) + "\n")
        step, data = step + 1, data.advance()
        if step % args.ckpt_every == 0 or step == args.steps:
            tenplex.save_state_dict(state(), args.ckpt, step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
