"""In-process rescale of a torch-native job (issue #18 item 5): survivors move their DTensor local shards
live to the mesh rebuilt for their number.

1. Pure: ``plan`` between two ``StateLayout`` s (FSDP2 x TP2 on 4 ranks, one dead, FSDP2 on the 3
   survivors) gives every piece its source: local where the survivor holds it, a live holder else,
   storage exactly for the elements whose only holder died (counted element by element here).
2. Spawned: 3 gloo processes run ``migrate`` on those layouts with the pieces only the dead rank held
   read from a checkpoint: every new local tensor bit-identical to the global tensor's box, bytes sent
   == the plan's peer bytes, bytes from storage == the plan's storage bytes.
3. End to end: ``examples/train_native.py --in-process`` on 4 workers (FSDP2 x TP2) with one worker
   SIGKILLed in the middle of a step; the survivors agree, rebuild the mesh and the model for 3
   workers, ``tenplex.rescale(url, state_dict, live=...)`` moves the state live, and every step's
   loss matches an uninterrupted single-process run within 1e-4 relative, with the same samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tenplex.checkpoint import save
from tenplex.mesh import MeshLayout, Replicate, Shard, StridedShard
from tenplex.planner import KIND_NAMES, STORAGE, plan
from tenplex.ptc import PTC
from tenplex.state_dict import state_layout_of
from tenplex.state_layout import Placed, StateLayout

from spawned import free_port, gloo_env, run_spawned
from test_state_dict import descriptions, global_tensor, local_of, same

ROOT = Path(__file__).resolve().parent.parent
DEAD = 3
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.w1": ((176, 64), torch.float32),   # colwise: FSDP2 over TP (StridedShard), panel order
    "model.w2": ((64, 176), torch.float32),   # rowwise: TP on dim 1, FSDP2 rows
    "model.emb": ((259, 16), torch.bfloat16),  # uneven rows (torch.chunk), small: dim order
    "model.norm": ((64,), torch.float32),     # TP-replicated, FSDP2 rows: two holders per element
    "optim.step": ((), torch.float32),        # a plain tensor every rank holds
}


def old_layout() -> StateLayout:
    mesh = MeshLayout.parse("dp_shard=2,tp=2")
    ranks = (0, 1, 2, 3)
    return StateLayout.of(4, {
        "model.w1": Placed(mesh, (StridedShard(0, 2), Shard(0)), ranks),
        "model.w2": Placed(mesh, (Shard(0), Shard(1)), ranks),
        "model.emb": Placed(mesh, (Shard(0), Shard(0)), ranks),
        "model.norm": Placed(mesh, (Shard(0), Replicate()), ranks),
        "optim.step": Placed.replicated(ranks),
    })


def new_layout() -> StateLayout:
    mesh = MeshLayout.parse("dp_shard=3")
    return StateLayout.of(3, {name: Placed(mesh, (Shard(0),) if shape else (Replicate(),), (0, 1, 2))
                              for name, (shape, _) in SHAPES.items()})


def collection() -> PTC:
    ptc, _ = state_layout_of(descriptions(old_layout(), SHAPES))
    return PTC(ptc.tensors.values(), num_layers=0, objects=["step"], meta={"kind": "state_dict"})


def only_dead_bytes(ptc: PTC, old: StateLayout, new: StateLayout, dead: int) -> int:
    """Bytes the new ranks need whose every old holder is ``dead``, counted element by element."""
    total = 0
    for name, spec in ptc.tensors.items():
        holders = np.zeros(spec.numel, dtype=np.int64)
        by_dead = np.zeros(spec.numel, dtype=bool)
        t = old.holder_table(spec)
        for r, s, n in zip(t.rank.tolist(), t.start.tolist(), t.length.tolist()):
            holders[s:s + n] += 1
            by_dead[s:s + n] |= r == dead
        orphan = (holders == 1) & by_dead
        u = new.holder_table(spec)
        total += sum(int(orphan[s:s + n].sum()) for s, n in zip(u.start.tolist(), u.length.tolist())) * spec.itemsize
    return total


def test_plan_between_state_layouts_reads_only_the_dead_ranks_own_pieces_from_storage() -> None:
    ptc, old, new = collection(), old_layout(), new_layout()
    moves = plan(ptc, old, new, alive=[0, 1, 2])
    s = moves.stats
    orphans = only_dead_bytes(ptc, old, new, DEAD)
    assert orphans > 0  # FSDP2 x TP2 keeps one copy of every TP-split element: the dead rank's own are gone
    assert s.bytes_storage == orphans
    assert s.bytes_needed == sum(spec.nbytes for spec in ptc.tensors.values()) + 2 * 4  # the scalar on 3 ranks
    assert s.bytes_moved == s.bytes_lower_bound
    c = moves.columns
    # the norm (two holders per element) never comes from storage: rank 2 still holds rank 3's half
    norm = moves.tensor_names.index("model.norm")
    assert not np.any((c["tensor"] == norm) & (c["kind"] == STORAGE))
    assert set(KIND_NAMES[k] for k in np.unique(c["kind"])) <= {"local", "same_host", "storage"}


def _migrate_worker(rank: int, port: int, url: str, q: Any) -> None:
    import torch.distributed as dist

    from tenplex.migrate import migrate
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
        ptc, old, new = collection(), old_layout(), new_layout()
        globals_ = {n: global_tensor(shape, dtype, 10 + i) for i, (n, (shape, dtype)) in enumerate(SHAPES.items())}
        held = {n: local_of(globals_[n], p, rank) for n, p in old.tensors}
        held["step"] = 7
        res = migrate(ptc, old, new, held, alive=[0, 1, 2], storage=url, step=4)
        bad = [n for n, p in new.tensors if not same(res.shard[n], local_of(globals_[n], p, rank))]
        q.put((rank, {"error": f"not bit-identical: {bad}" if bad else "", "sent": res.bytes_sent,
                      "received": res.bytes_received, "storage": res.bytes_storage, "local": res.bytes_local,
                      "step": res.shard["step"]}))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        import traceback
        q.put((rank, {"error": f"{e}\n{traceback.format_exc()}"}))


@pytest.mark.timeout(60)
def test_survivors_migrate_dtensor_shards_live_and_read_only_orphans_from_the_checkpoint(tmp_path: Path) -> None:
    """3 survivors of FSDP2 x TP2 move their local shards to FSDP2 over 3 ranks (about 3 s)."""
    ptc, old, new = collection(), old_layout(), new_layout()
    globals_ = {n: global_tensor(shape, dtype, 10 + i) for i, (n, (shape, dtype)) in enumerate(SHAPES.items())}
    url = str(tmp_path / "ckpt")
    for rank in range(4):  # the checkpoint of step 4 every rank wrote before rank 3 died
        shard: dict[str, Any] = {n: local_of(globals_[n], p, rank) for n, p in old.tensors}
        if rank == 0:
            shard["step"] = 7
        save(url, ptc, old, rank, shard, step=4)
    port = free_port()
    got = run_spawned(_migrate_worker, [(r, port, url) for r in range(3)], expect=3, timeout=50)
    errors = {r: v["error"] for r, v in got.items() if v.get("error")}
    assert not errors, errors
    s = plan(ptc, old, new, alive=[0, 1, 2]).stats
    assert sum(v["sent"] for v in got.values()) == sum(v["received"] for v in got.values()) \
        == s.bytes_same_host + s.bytes_cross_host
    assert sum(v["storage"] for v in got.values()) == s.bytes_storage == only_dead_bytes(ptc, old, new, DEAD)
    assert sum(v["local"] for v in got.values()) == s.bytes_local
    assert all(v["step"] == 7 for v in got.values())
