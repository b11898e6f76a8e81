"""Carry out a plan in one process: build every new rank's shard from old shards in memory.

Useful for single-process resharding (tests, offline conversion, the demo) and as the
reference semantics of a plan that distributed transports must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import PlanError
from .planner import KIND_NAMES, LOCAL, STORAGE, Plan

__all__ = ["reshard"]

StorageReader = Callable[[str, int, int], torch.Tensor]


def reshard(
    plan: Plan,
    old_shards: Mapping[int, Mapping[str, Any]],
    *,
    read_storage: StorageReader | None = None,
    ranks: list[int] | None = None,
) -> dict[int, dict[str, Any]]:
    """New shards ``{new_rank: {name: tensor}}`` built by following ``plan``.

    ``old_shards`` maps old ranks to their shards (only live ranks are read).
    ``read_storage(name, start, length)`` returns ``length`` elements of the tensor's
    canonical flat form from persistent storage; it is needed only if the plan has storage
    moves. Objects (non-tensors) are copied from the lowest old rank that has them.
    """
    ptc = plan.ptc
    flat_cache: dict[tuple[int, str], torch.Tensor] = {}

    def old_flat(rank: int, name: str) -> torch.Tensor:
        key = (rank, name)
        if key not in flat_cache:
            if rank not in old_shards or name not in old_shards[rank]:
                raise PlanError(f"plan reads {name} from old rank {rank}, which old_shards does not provide")
            flat_cache[key] = ptc.to_local_flat(name, old_shards[rank][name])
        return flat_cache[key]

    out: dict[int, dict[str, Any]] = {}
    c = plan.columns
    for r in ranks if ranks is not None else range(plan.new.world_size):
        dev = plan.device_of(r)
        locals_: dict[str, torch.Tensor] = {}
        for name in ptc.rank_tensors(plan.new, r):
            spec = ptc.tensors[name]
            n = sum(ln for _, _, ln in ptc.segments(name, plan.new, r))
            locals_[name] = torch.zeros(n, dtype=spec.dtype)  # padding stays zero
        idx = plan._order[plan._bounds[r] : plan._bounds[r + 1]]
        for i in idx:
            name = plan.tensor_names[c["tensor"][i]]
            kind, length = int(c["kind"][i]), int(c["length"][i])
            dst, src_off = int(c["dst_offset"][i]), int(c["src_offset"][i])
            if kind == STORAGE:
                if read_storage is None:
                    raise PlanError(f"plan needs {name} from storage but no read_storage was given")
                piece = read_storage(name, src_off, length)
            else:
                src = dev if kind == LOCAL else int(c["src_rank"][i])
                if kind != LOCAL and src == dev:
                    raise PlanError(f"{KIND_NAMES[kind]} move from the device itself")
                piece = old_flat(src, name)[src_off : src_off + length]
            locals_[name][dst : dst + length] = piece
        shard: dict[str, Any] = {name: ptc.from_local_flat(name, plan.new, t) for name, t in locals_.items()}
        for obj in ptc.objects:
            for old_rank in sorted(old_shards):
                if obj in old_shards[old_rank]:
                    shard[obj] = old_shards[old_rank][obj]
                    break
        out[r] = shard
    return out
