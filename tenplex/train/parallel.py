"""Process groups of a (DP, TP, PP) layout and the autograd-aware collectives of Megatron TP."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..layout.config import ParallelConfig
from ..planning.choose import check_fits

__all__ = ["Groups", "local_device", "join_process_group", "init_distributed", "copy_to_tp",
           "reduce_from_tp", "all_reduce"]

log = logging.getLogger(__name__)


@dataclass
class Groups:
    """This rank's groups. ``None`` means a group of one (no communication needed).

    ``placed``: False for a spare, a rank beyond the layout's ``world_size`` (no TP or DP group).
    """

    cfg: ParallelConfig
    rank: int
    tp: Any
    dp: Any
    device: torch.device
    placed: bool = True

    @property
    def coords(self):  # noqa: ANN201 - Coords
        return self.cfg.coords(self.rank)

    def stage_rank(self, stage: int) -> int:
        """Global rank of the peer with this rank's (dp, tp) on pipeline stage ``stage``."""
        c = self.coords
        return self.cfg.rank(pp=stage, dp=c.dp, tp=c.tp)


def _uses_cuda() -> bool:
    """Whether this worker trains on CUDA: CUDA is available and ``TENPLEX_DEVICE`` is not ``cpu``."""
    return torch.cuda.is_available() and os.environ.get("TENPLEX_DEVICE", "") != "cpu"


def local_device() -> torch.device:
    """This worker's device: CUDA device LOCAL_RANK (made current) when ``_uses_cuda()``, else the
    CPU (its backend: nccl on CUDA, gloo on the CPU)."""
    if not _uses_cuda():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK {local} needs CUDA device {local} but this host has {torch.cuda.device_count()}: "
            f"start at most {torch.cuda.device_count()} workers per host (torchrun --nproc-per-node), or set "
            f"TENPLEX_DEVICE=cpu to train on CPU with gloo")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def join_process_group(*, timeout_s: float = 60.0) -> torch.device:
    """Join the job's default process group (torchrun's environment); return this rank's device.

    Without torchrun (WORLD_SIZE 1, no MASTER_ADDR) joins nothing. Uses nccl when CUDA is
    available (the device of LOCAL_RANK), gloo otherwise. Every rank's collectives can run
    once this returns: the trainer agrees on its start-up there, before it knows its layout.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized() and "MASTER_ADDR" not in os.environ:
        return local_device()
    if not dist.is_initialized():
        device = local_device()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
        return device
    # joined before (an in-process recovery re-formed the group): the device made current then
    return torch.device("cuda", torch.cuda.current_device()) if _uses_cuda() else torch.device("cpu")


def init_distributed(cfg: ParallelConfig, *, timeout_s: float = 60.0) -> Groups:
    """Join the job's process group (``join_process_group``, unless joined) and build TP and DP groups.

    The layout may use fewer ranks than the group: its groups are built over ranks
    ``0 .. cfg.world_size - 1`` (every rank of the default group calls ``new_group`` for each, as
    torch requires) and the ranks beyond it are spares (``Groups.placed`` False).
    Without torchrun (no WORLD_SIZE) and a one-rank layout, runs without torch.distributed.
    The TP and DP groups get the same ``timeout_s`` as the default group (torch's default for a
    new gloo group is 30 minutes: a rank blocked on a hung peer would wait that long).
    """
    # the current default group's size: after an in-process recovery it is the survivors', not torchrun's
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_fits(cfg, world)
    device = join_process_group(timeout_s=timeout_s)
    if not dist.is_initialized():
        return Groups(cfg, 0, None, None, device)
    rank = dist.get_rank()
    # every rank must create every group, in the same order: TP groups first, then DP groups
    tp_group = _own_group(rank, [[cfg.rank(pp=pp, dp=dp, tp=t) for t in range(cfg.tp)]
                                 for pp in range(cfg.pp) for dp in range(cfg.dp)], timeout_s)
    dp_group = _own_group(rank, [[cfg.rank(pp=pp, dp=d, tp=tp) for d in range(cfg.dp)]
                                 for pp in range(cfg.pp) for tp in range(cfg.tp)], timeout_s)
    if rank >= cfg.world_size:
        log.info("rank %d of %d: a spare under %s on %s", rank, world, cfg, device)
        return Groups(cfg, rank, None, None, device, placed=False)
    log.info("rank %d of %d: %s coords %s on %s", rank, world, cfg, cfg.coords(rank), device)
    return Groups(cfg, rank, tp_group, dp_group, device)


def _own_group(rank: int, groups: list[list[int]], timeout_s: float) -> Any:
    """Create every group of ``groups`` (collectively, in order) and return ``rank``'s; None for
    groups of one (no process group needed) or when ``rank`` is in none."""
    own = None
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) if len(ranks) > 1 else None
        if rank in ranks:
            own = g
    return own


def all_reduce(t: torch.Tensor, group: Any, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; a no-op for a group of one."""
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)
