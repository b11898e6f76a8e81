"""One worker of the torchft side of ``scripts/bench_recovery.py --json`` (issue #31): the job of
``examples/train_native.py`` (native_llama's Llama, AdamW) trained the way torchft 0.2.0 trains it.

Each replica group is its own ``torchrun`` (2 workers: FSDP2 over the group, ``dp_shard=2``); the
groups are replicas of each other through torchft's ``Manager`` (its Lighthouse at
``TORCHFT_LIGHTHOUSE``): after the backward pass every worker averages its gradient shard with the
same shard of the other groups by ``Manager.allreduce`` (one flat buffer) and the
``OptimizerWrapper`` commits the step only when ``Manager.should_commit`` says every participant's
allreduce went through: HSDP, with torchft owning the replicate dimension. A group whose worker dies
is restarted by its torchrun (``--max-restarts``); it joins the next quorum and heals from a healthy
group by torchft's HTTP checkpoint transport (a full copy of the replica: each worker receives the
model and optimizer shards of the worker with the same group rank).

What torchft needed to run here (CPU, gloo): its own gloo process group
(``torchft.process_group.ProcessGroupGloo``), a store of each restart attempt's own (see
``_attempt_store``: with torchrun's one store, a restarted group's first attempt failed) and a state
dict of plain tensors. FSDP2's DTensors
are handed to torchft as their local shards (``to_local``), and filled in place on a heal: the
HTTP transport pickles what ``state_dict`` returns, and a healing group's workers hold the same
shards as the healthy group's workers of the same group rank. The optimizer state must exist before
the first heal (``init_optimizer_state``), since a heal fills it in place.

Writes one JSON line per event to ``--events`` (``O_APPEND``, one write per line): ``start`` (the
worker's state bytes), ``step`` (every step: committed or not, the manager's step after it, the
wall time at its end, whether it healed) and ``die`` (just before the SIGKILL of ``--die-at``).

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --nproc-per-node=2 scripts/torchft_job.py --events /tmp/ft.jsonl --steps 12
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import native_llama as nl  # noqa: E402 - the job's model, as examples/train_native.py uses it


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _attempt_store(rank: int, restart: int) -> int:
    """The port of a TCPStore of this restart attempt only, hosted by its rank 0 and found through
    torchrun's store (under a key of the attempt). torchrun's c10d rendezvous keeps one store for
    every attempt, and both gloo's default group and torchft's Manager (its server's address) write
    fixed keys there: a restarted group read the previous attempt's addresses, and its first restart
    failed (gloo ``connectFullMesh``: connection refused; or the Manager client's connect)."""
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key = f"torchft_job/attempt_{restart}/store_port"
    if rank == 0:
        global _OWN_STORE  # noqa: PLW0603 - kept alive for the process's life
        _OWN_STORE = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        agent.set(key, str(_OWN_STORE.port))
    return int(agent.get(key).decode())


_OWN_STORE: Any = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", required=True, help="the JSON lines file (torchrun takes --log for its own)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", default="12m", choices=("tiny", "12m"))
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--die-at", default="", help="GROUP:RANK:STEP: SIGKILL that worker in the forward pass of STEP "
                                                "(its first launch only)")
    p.add_argument("--timeout", type=float, default=10.0, help="the Manager's timeout for collectives and RPCs (s)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    group, ngroups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps({"group": group, "rank": rank, "restart": restart, "wall": time.time(), **record}) + "\n"
        fd = os.open(args.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store_port = _attempt_store(rank, restart)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", store_port, is_master=False), rank=rank,
                            world_size=size)
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp_shard",))
    cfg = nl.LlamaConfig(**{**nl.PRESETS[args.model].__dict__, "vocab_size": 259, "seq_len": args.seq_len})
    model = nl.parallelize(nl.reference_model(cfg, seed=0), mesh)
    inner = nl.make_optimizer(model)
    nl.init_optimizer_state(inner)  # a heal fills the state in place: it must exist
    params = list(model.parameters())

    def state_dict() -> dict[str, Any]:
        return {"params": [_local(q).detach() for q in params],
                "optim": [{k: _local(v) for k, v in inner.state[q].items()} for q in params]}

    @torch.no_grad()
    def load_state_dict(sd: dict[str, Any]) -> None:
        for q, v, st in zip(params, sd["params"], sd["optim"]):
            _local(q).copy_(v)
            for k, t in st.items():
                _local(inner.state[q][k]).copy_(t)

    state_bytes = sum(t.numel() * t.element_size() for t in state_dict()["params"]) + sum(
        t.numel() * t.element_size() for st in state_dict()["optim"] for t in st.values())
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"group{group}",
                      timeout=timedelta(seconds=args.timeout), rank=rank, world_size=size,
                      store_addr="127.0.0.1", store_port=store_port)
    optimizer = OptimizerWrapper(manager, inner)
    emit({"event": "start", "state_bytes": state_bytes, "params": sum(q.numel() for q in params)})
    die = None
    if args.die_at and restart == 0:
        g, r, s = (int(x) for x in args.die_at.split(":"))
        die = (g, r, s)
    gb = args.global_batch
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # starts the quorum (async: overlaps the forward pass)
        step = manager.current_step()
        # this group's share of the global batch, then this worker's (the batch of a dead group is lost)
        x, y = nl.dp_slice(nl.batch(step, gb, cfg.seq_len, cfg.vocab_size, seed=1), group * size + rank,
                           ngroups * size)
        if die == (group, rank, step):
            emit({"event": "die", "step": step})
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nl.loss_fn(model(x), y)
        loss.backward()
        grads = [_local(q.grad) for q in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        with torch.no_grad():
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        step = manager.current_step()  # after the quorum: a healed group's step is the healthy group's
        healed = manager._healing  # noqa: SLF001 - whether this step's quorum healed this group (for the record)
        optimizer.step()  # commits only when every participant's allreduce went through
        committed = manager.current_step() > step
        emit({"event": "step", "step": step, "committed": committed, "healed": bool(healed),
              "participants": manager.num_participants(), "loss": float(loss), "time_s": time.perf_counter() - t0})
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
