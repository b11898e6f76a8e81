"""A torch-native training job that uses tenplex: the example of docs/your_model.md.

The model is plain torch (``native_llama.py``: a Llama parallelized with torch's own TP and
FSDP2 APIs). tenplex adds one object, ``tenplex.ElasticRuntime``: given ``build(mesh)`` and the
job's mesh rule it builds the mesh for however many workers torchrun started, fills the freshly
built model and optimizer in place from the newest checkpoint (whatever mesh wrote it; a fresh
start without one) and saves every K steps; batches come from tenplex's dataset index reader, so a
rescale continues the same sample order.

    torchrun --nproc-per-node=4 examples/train_native.py --ckpt /tmp/ckpt --steps 12 --log /tmp/log.jsonl

Kill some workers (or a node) and let torchrun's elastic agent restart the rest: they pick a new
mesh and continue from the last checkpoint.

All of it goes through ``tenplex.ElasticRuntime``: the script gives it ``build(mesh)`` and its mesh
rule and keeps its own loop, one ``with step:`` per step.

``--in-process`` (with ``TENPLEX_MEMBERSHIP_STORE=host:port``, a c10d store that outlives the
workers): the survivors of a failure are not restarted. The runtime runs every step under
``Membership.guard()``; after each step this rank's local shards are copied into a ``StateRing``
(the step of the last checkpoint kept pinned). On a peer failure the survivors agree on a new group
(``Membership.recover``: the default group re-formed on a fresh store prefix), build the mesh and
the model for their number, and ``rescale(url, state_dict, live=LiveState(...))`` moves the state
live from the newest step every survivor holds; only pieces whose every holder died come from the
checkpoint (then at its step, which the ring keeps). A failure during that recovery exits with
code 75 (the launcher's restart path takes over). The recovery's latency table is logged after its
first step and is the ``latency`` of its record in ``--log``.

``--in-process --join`` (scale up without a restart): a process started beside the running job
(the same ``TENPLEX_MEMBERSHIP_STORE``, and ``TENPLEX_JOB_ID`` or the job's ``MASTER_ADDR`` /
``MASTER_PORT``, no ``RANK`` / ``WORLD_SIZE``) registers as a joiner. The workers notice it at a step
boundary (``Membership.join_due``), agree on a round with it and rebuild mesh and model for the
larger group; the joiner builds its own and receives its shards, the step and the data position
live from them (``LiveState(cfg=None)``), nothing from the checkpoint. A node joining under
torchrun is another matter: its agent and the running ones restart every worker (SIGTERM, a new
rendezvous). ``--in-process`` workers first write the newest states their ring holds into the
checkpoint (each its own part, ``tenplex.checkpoint.save``: no message), so the restarted job
resumes from the newest step every worker completed, not from the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_llama as nl  # noqa: E402 - the user's model, next to this script

import tenplex  # noqa: E402
from tenplex.data import DataState, global_batch_ids, stdlib_corpus  # noqa: E402
from tenplex.data.batches import IndexBatches  # noqa: E402
from tenplex.elastic.inprocess import JOIN_FAILED, DieAt  # noqa: E402

IMPORTED = time.time()  # benchmarks: a joiner's imports done (its timeline, see "joined" below)


def mesh_rule(world: int, *, hsdp: bool = False, most: int = 0) -> dict[str, int]:
    """This job's own rule: FSDP2 x TP2 (``hsdp``: 2 replicas of FSDP2, HSDP) when there are at least 4
    workers and an even number, else FSDP2 alone; ``most``: a mesh of at most that many ranks (the
    workers beyond it wait as spares)."""
    world = min(world, most) if most else world
    if world >= 4 and world % 2 == 0:
        return {"dp_replicate": 2, "dp_shard": world // 2} if hsdp else {"dp_shard": world // 2, "tp": 2}
    return {"dp_shard": world}


def held_bytes(obj: Any) -> int:
    """Bytes of the tensors this process holds in nested dicts and lists: a DTensor's local shard
    (no collective: the joiner alone calls it)."""
    if isinstance(obj, dict):
        return sum(held_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if isinstance(obj, DTensor) else obj
        return t.numel() * t.element_size()
    return 0


def emit(path: str, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint URL (a directory or any fsspec URL)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--log", default="", help="JSON lines: one per step (rank 0) and one per start and recovery")
    p.add_argument("--in-process", action="store_true",
                   help="survivors of a failure recover in-process (TENPLEX_MEMBERSHIP_STORE=host:port)")
    p.add_argument("--dead-after", type=float, default=0.8, help="--in-process: heartbeat silence that means death")
    p.add_argument("--join", action="store_true",
                   help="--in-process: join a running job (scale up): wait for it, be admitted at a step boundary "
                        "and receive the state live")
    p.add_argument("--join-timeout", type=float, default=120.0,
                   help=f"--join: seconds to wait for the job and for admission (then exit code {JOIN_FAILED})")
    p.add_argument("--model", default="tiny", choices=("tiny", "12m"), help="a preset of native_llama.py")
    p.add_argument("--hsdp", action="store_true", help="HSDP (2 replicas) instead of TP on 4 or more workers")
    p.add_argument("--mesh-most", type=int, default=0,
                   help="--in-process: a mesh of at most this many ranks; the other workers wait as spares")
    p.add_argument("--die-at", default="", help="testing: RANK:STEP:POINT, POINT forward, optimizer or save")
    args = p.parse_args()
    if args.join and not args.in_process:
        p.error("--join needs --in-process (the joiner is admitted by the running workers' membership)")
    who = "joiner" if args.join else f"rank {os.environ.get('RANK', '0')}"
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {who} %(message)s")
    if os.environ.get("TENPLEX_PID_DIR"):  # lets a simulated node failure kill this worker too
        Path(os.environ["TENPLEX_PID_DIR"], f"local-{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(
            str(os.getpid()))
    # testing: --die-at names ranks of the first group (a joiner: none)
    die = DieAt.hook(DieAt.parse(args.die_at), int(os.environ.get("RANK", "0"))) if not args.join else None
    cfg = dataclasses.replace(nl.PRESETS[args.model], vocab_size=259, seq_len=args.seq_len)
    corpus = stdlib_corpus(args.seq_len)
    batches = IndexBatches(corpus)
    rt: Any = None

    # what tenplex needs from the job: the model and optimizer built and parallelized for a mesh
    def build(mesh: Any) -> tuple[Any, Any]:
        model = nl.parallelize(nl.reference_model(cfg, seed=0).to(mesh.device_type), mesh)
        optimizer = nl.make_optimizer(model)
        if die is not None:  # testing: a kill after the backward pass, before this rank's optimizer step
            optimizer.register_step_pre_hook(lambda *_: die("optimizer", rt.step))
        return model, optimizer

    rt = tenplex.ElasticRuntime(
        build, lambda w: mesh_rule(w, hsdp=args.hsdp, most=args.mesh_most), ckpt=args.ckpt, data=DataState(corpus.num_samples,
                                                                                       args.global_batch, seed=1),
        ckpt_every=args.ckpt_every, in_process=args.in_process, join=args.join, dead_after=args.dead_after,
        join_timeout=args.join_timeout, on_event=lambda r: emit(args.log, r),
        before_save=(lambda s: die("save", s)) if die is not None else None)

    # train: the loop is the job's; the runtime recovers inside ``steps`` and commits each step at ``with`` exit
    trained = False  # benchmarks: whether this process ran a step before (a joiner or a spare: not before its place)
    for step in rt.steps(args.steps):
        with step:
            t0 = time.perf_counter()
            raw = batches.batch(rt.data, rt.dp_size, rt.dp_rank).to(rt.device)
            if die is not None:
                die("forward", rt.step)
            loss = nl.train_step(rt.model, rt.optimizer, raw[:, :-1], raw[:, 1:], group=rt.group)
            if rt.rank == 0:
                emit(args.log, {"step": rt.step, "loss": loss, "world_size": rt.world_size, "mesh": rt.dims,
                                "samples": global_batch_ids(rt.data).tolist(), "time_s": time.perf_counter() - t0, "wall": time.time(),
                                **({"after_recovery": rt.recovered} if rt.recovered is not None else {})})
            if not trained and rt.recovered is not None:
                # benchmarks: what a joiner (or a spare given a place) holds after its admission, all of it
                # received (it held nothing)
                held = held_bytes([rt.model.state_dict(), list(rt.optimizer.state.values())])
                emit(args.log, {"event": "joined", "rank": rt.rank, "bytes_held": held, "wall": time.time(),
                                "was": "joiner" if args.join else "spare",
                                "timeline": {"imports_done": IMPORTED, **rt.timeline}})
            trained = True


if __name__ == "__main__":
    main()
