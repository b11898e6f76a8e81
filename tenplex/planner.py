"""Minimal-movement repartitioning plans (pure: no I/O, no processes).

A plan says, for every new rank and every tensor it holds, which pieces it needs and where
each comes from: its own device (already there), an old rank on the same host, an old rank
on another host, or persistent storage when every holder died. Overlaps are found per
tensor by sorting the old layout's segments and binary-searching the new ones
(``O((n + m) log n)``), never by comparing every chunk with every chunk.

Rules, in order: use bytes already on the same device; otherwise read from a live holder on
the same host; otherwise from any live holder; spread reads over all candidate holders
(DP replicas, tied copies) by the bytes each has been asked to send so far, so no source
becomes a hot spot; storage only when no live copy exists. Moved bytes therefore always
equal the lower bound (bytes a new rank needs that its device does not hold).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ParallelConfig
from .assignment import locality_order
from .errors import PlanError
from .overlap import holder_classes, intersect
from .ptc import PTC

__all__ = ["LOCAL", "SAME_HOST", "CROSS_HOST", "STORAGE", "KIND_NAMES", "Move", "PlanStats", "Plan", "plan", "holder_classes",
           "intersect", "device_assignment", "locality_order"]

log = logging.getLogger(__name__)

LOCAL, SAME_HOST, CROSS_HOST, STORAGE = 0, 1, 2, 3
KIND_NAMES = ("local", "same_host", "cross_host", "storage")


@dataclass(frozen=True, slots=True)
class Move:
    """One piece a new rank needs: ``length`` elements of ``tensor`` in canonical flat order.

    ``dst_offset``: where it goes in the new rank's canonical flat shard. ``src_rank``: the old
    rank that sends it (-1 for storage); ``src_offset``: where it sits in that rank's canonical
    flat shard (the global offset ``start`` for storage).
    """

    new_rank: int
    tensor: str
    kind: str
    src_rank: int
    src_offset: int
    dst_offset: int
    start: int
    length: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Byte counts of a plan (padding excluded: zeros are recreated, never moved)."""

    bytes_needed: int
    bytes_local: int
    bytes_same_host: int
    bytes_cross_host: int
    bytes_storage: int
    bytes_lower_bound: int
    max_send_bytes: int
    max_recv_bytes: int
    num_moves: int
    plan_seconds: float

    @property
    def bytes_moved(self) -> int:
        """Bytes that reach a new rank from anywhere but its own device."""
        return self.bytes_same_host + self.bytes_cross_host + self.bytes_storage

    def to_json(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["bytes_moved"] = self.bytes_moved
        return d


def device_assignment(old: ParallelConfig, new: ParallelConfig, alive: Sequence[int] | None) -> np.ndarray:
    """Device of every new rank: the i-th surviving device, then fresh devices numbered after the old ones."""
    if alive is None:
        alive = range(min(new.world_size, old.world_size))
    alive_arr = np.asarray(list(alive), dtype=np.int64)
    if len(np.unique(alive_arr)) != len(alive_arr):
        raise PlanError(f"alive lists a rank twice: {sorted(alive_arr.tolist())}")
    bad = alive_arr[(alive_arr < 0) | (alive_arr >= old.world_size)]
    if len(bad):
        raise PlanError(f"alive ranks {bad.tolist()} are outside the old world [0, {old.world_size})")
    n = new.world_size
    fresh = old.world_size + np.arange(max(0, n - len(alive_arr)), dtype=np.int64)
    return np.concatenate([alive_arr[:n], fresh])


class Plan:
    """The repartitioning from ``old`` to ``new``, stored as numpy columns (one row per move)."""

    _COLUMNS = ("new_rank", "tensor", "kind", "src_rank", "src_offset", "dst_offset", "start", "length", "nbytes")

    def __init__(self, ptc: PTC, old: ParallelConfig, new: ParallelConfig, alive: tuple[int, ...],
                 devices: np.ndarray, gpus_per_host: int, columns: dict[str, np.ndarray], stats: PlanStats,
                 tensor_group: np.ndarray, group_classes: tuple[tuple[np.ndarray, ...], ...]):
        self.ptc, self.old, self.new = ptc, old, new
        self.alive = alive
        self.devices = devices
        self.gpus_per_host = gpus_per_host
        self.tensor_names: tuple[str, ...] = tuple(ptc.tensors)
        self.columns = columns  # rows grouped by tensor, in tensor order
        self.stats = stats
        # tensors in one group (same old and new holder tables, same item size: the layers of a
        # stage) have the same moves but for the chosen sources; -1: the new layout holds none of it
        self.tensor_group = tensor_group
        self.group_classes = group_classes  # per group: holder_classes() of its old holder table
        order = np.argsort(columns["new_rank"], kind="stable")
        self._order = order
        self._bounds = np.searchsorted(columns["new_rank"][order], np.arange(new.world_size + 1))

    def __repr__(self) -> str:
        s = self.stats
        return (f"Plan({self.old} -> {self.new}: {s.num_moves} moves, needed {s.bytes_needed / 2**20:.1f} MiB, "
                f"moved {s.bytes_moved / 2**20:.1f} MiB)")

    def moves(self, new_rank: int) -> list[Move]:
        """Every piece ``new_rank`` needs, in tensor order."""
        if not 0 <= new_rank < self.new.world_size:
            raise PlanError(f"new rank {new_rank} is outside [0, {self.new.world_size})")
        idx = self._order[self._bounds[new_rank] : self._bounds[new_rank + 1]]
        c = self.columns
        return [
            Move(int(c["new_rank"][i]), self.tensor_names[c["tensor"][i]], KIND_NAMES[c["kind"][i]],
                 int(c["src_rank"][i]), int(c["src_offset"][i]), int(c["dst_offset"][i]), int(c["start"][i]),
                 int(c["length"][i]), int(c["nbytes"][i]))
            for i in idx
        ]

    def device_of(self, new_rank: int) -> int:
        return int(self.devices[new_rank])

    def sent_bytes(self) -> np.ndarray:
        """Bytes each old rank sends to peers (index = old rank)."""
        c = self.columns
        peer = (c["kind"] == SAME_HOST) | (c["kind"] == CROSS_HOST)
        return np.bincount(c["src_rank"][peer], weights=c["nbytes"][peer], minlength=self.old.world_size)

    def received_bytes(self) -> np.ndarray:
        """Bytes each new rank receives from peers or storage (index = new rank)."""
        c = self.columns
        remote = c["kind"] != LOCAL
        return np.bincount(c["new_rank"][remote], weights=c["nbytes"][remote], minlength=self.new.world_size)


def plan(
    ptc: PTC,
    old_cfg: ParallelConfig,
    new_cfg: ParallelConfig,
    *,
    alive: Sequence[int] | None = None,
    gpus_per_host: int = 8,
) -> Plan:
    """Plan the move of ``ptc`` from layout ``old_cfg`` to ``new_cfg``.

    ``alive``: old ranks whose devices survive (default: the first ``min(old, new)`` world
    size devices); new rank i runs on the i-th of them, and on fresh devices beyond. Old
    rank r ran on device r; device d sits on host ``d // gpus_per_host``.
    """
    t0 = time.perf_counter()
    if gpus_per_host < 1:
        raise PlanError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
    ptc.check(old_cfg)
    ptc.check(new_cfg)
    devices = device_assignment(old_cfg, new_cfg, alive)
    alive_t = tuple(int(a) for a in (range(min(new_cfg.world_size, old_cfg.world_size)) if alive is None else alive))
    alive_mask = np.zeros(old_cfg.world_size + 1, dtype=bool)  # last slot: "no holder" (-1)
    alive_mask[list(alive_t)] = True
    new_host = devices // gpus_per_host
    old_host = np.append(np.arange(old_cfg.world_size) // gpus_per_host, -2)

    parts: dict[str, list[np.ndarray]] = {k: [] for k in Plan._COLUMNS}
    class_cache: dict[int, tuple[Any, tuple[np.ndarray, ...]]] = {}
    sent = np.zeros(old_cfg.world_size + 1, dtype=np.float64)  # bytes each old rank sends so far
    set_hash = np.random.default_rng(0).integers(1, 2**63, old_cfg.world_size + 1, dtype=np.uint64)
    tensor_group = np.full(len(ptc.tensors), -1, dtype=np.int64)
    groups: dict[tuple[int, int, int], tuple[int, Any, Any]] = {}  # values keep new tables (so their ids) alive
    for ti, (name, spec) in enumerate(ptc.tensors.items()):
        old_t = ptc.holders(name, old_cfg)
        new_t = ptc.holders(name, new_cfg)
        if len(new_t) == 0:
            continue
        if id(old_t) not in class_cache:  # holder tables are shared by the layers of a stage
            class_cache[id(old_t)] = (old_t, holder_classes(name, old_t))
        classes = class_cache[id(old_t)][1]
        gkey = (id(old_t), id(new_t), spec.itemsize)
        tensor_group[ti] = groups.setdefault(gkey, (len(groups), new_t, classes))[0]
        c_start, c_end, c_ranks, c_local = classes
        qi, ci, ps, pe = intersect(new_t.start, new_t.length, c_start, c_end)
        if int((pe - ps).sum()) != int(new_t.length.sum()):
            raise PlanError(f"{name}: the old layout does not cover every element the new layout needs")
        nr = new_t.rank[qi]
        dev = devices[nr]
        hr = c_ranks[ci]  # (P, k) holder ranks, -1 padded
        live = alive_mask[hr]
        is_local = live & (hr == dev[:, None])
        same = live & (old_host[hr] == new_host[nr][:, None])
        any_local = is_local.any(1)
        any_same = same.any(1)
        cand = np.where(any_local[:, None], is_local, np.where(any_same[:, None], same, live))
        count = cand.sum(1)
        # Spread remote reads by bytes, not by count (a count rotation lets a repeating pattern
        # of big and small tensors pile the big ones on one replica): pieces with the same
        # candidate set take its candidates in turn, least-loaded first, loads carried across tensors.
        col = np.argmax(cand, axis=1)
        remote = np.flatnonzero(~any_local & (count > 0))
        if len(remote):
            rcand, rranks = cand[remote], hr[remote]
            key = np.where(rcand, set_hash[rranks], np.uint64(0)).sum(1)  # identifies the candidate set
            order = np.argsort(key, kind="stable")
            skey = key[order]
            first = np.searchsorted(skey, skey, side="left")
            idx = np.arange(len(order))
            is_head = first == idx
            heads = order[is_head]  # one piece per candidate set
            by_load = np.argsort(np.where(rcand[heads], sent[rranks[heads]], np.inf), axis=1, kind="stable")
            ranked = rranks[heads][np.arange(len(heads))[:, None], by_load]  # candidates, least-loaded first
            group = np.empty(len(remote), dtype=np.int64)
            group[order] = np.cumsum(is_head) - 1
            pos = np.empty(len(remote), dtype=np.int64)
            pos[order] = idx - first
            chosen = ranked[group, pos % count[remote]]
            col[remote] = np.argmax(rranks == chosen[:, None], axis=1)
            sent += np.bincount(chosen, weights=(pe - ps)[remote] * spec.itemsize, minlength=len(sent))
        rows = np.arange(len(qi))
        src = np.where(count > 0, hr[rows, col], -1)
        kind = np.where(any_local, LOCAL, np.where(count == 0, STORAGE, np.where(any_same, SAME_HOST, CROSS_HOST)))
        delta = ps - c_start[ci]
        src_off = np.where(count > 0, c_local[ci, col] + delta, ps)
        length = pe - ps
        parts["new_rank"].append(nr)
        parts["tensor"].append(np.full(len(qi), ti, dtype=np.int32))
        parts["kind"].append(kind.astype(np.int8))
        parts["src_rank"].append(src)
        parts["src_offset"].append(src_off)
        parts["dst_offset"].append(new_t.local[qi] + (ps - new_t.start[qi]))
        parts["start"].append(ps)
        parts["length"].append(length)
        parts["nbytes"].append(length * spec.itemsize)

    columns = {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in parts.items()}
    for arr in columns.values():
        arr.setflags(write=False)
    stats = _stats(columns, old_cfg, new_cfg, time.perf_counter() - t0)
    tensor_group.setflags(write=False)
    result = Plan(ptc, old_cfg, new_cfg, alive_t, devices, gpus_per_host, columns, stats, tensor_group,
                  tuple(g[2] for g in groups.values()))
    log.info("planned %s -> %s in %.3fs: %d moves, %.1f MiB moved of %.1f MiB needed",
             old_cfg, new_cfg, stats.plan_seconds, stats.num_moves, stats.bytes_moved / 2**20,
             stats.bytes_needed / 2**20)
    return result


def _stats(c: dict[str, np.ndarray], old: ParallelConfig, new: ParallelConfig, seconds: float) -> PlanStats:
    nbytes, kind = c["nbytes"], c["kind"]

    def total(k: int) -> int:
        return int(nbytes[kind == k].sum())

    local = total(LOCAL)
    needed = int(nbytes.sum())
    peer = (kind == SAME_HOST) | (kind == CROSS_HOST)
    sent = np.bincount(c["src_rank"][peer], weights=nbytes[peer], minlength=old.world_size) if peer.any() else [0]
    remote = kind != LOCAL
    recv = np.bincount(c["new_rank"][remote], weights=nbytes[remote], minlength=new.world_size) if remote.any() else [0]
    return PlanStats(
        bytes_needed=needed,
        bytes_local=local,
        bytes_same_host=total(SAME_HOST),
        bytes_cross_host=total(CROSS_HOST),
        bytes_storage=total(STORAGE),
        bytes_lower_bound=needed - local,
        max_send_bytes=int(np.max(sent)),
        max_recv_bytes=int(np.max(recv)),
        num_moves=len(nbytes),
        plan_seconds=seconds,
    )
