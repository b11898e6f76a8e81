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

from ..errors import PlanError
from ..layout.config import ParallelConfig
from ..layout.overlap import holder_classes, intersect
from ..layout.ptc import PTC, Layout
from .assignment import locality_order

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


def device_assignment(old: Layout, new: Layout, alive: Sequence[int] | None) -> np.ndarray:
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
    """The repartitioning from ``old`` to ``new``, stored as numpy columns (one row per move).

    ``ranks``: None for the whole plan; else the new ranks whose part this is (the moves they
    receive and the moves their devices send, each a row of the whole plan), and ``stats`` count
    the part's rows.
    """

    _COLUMNS = ("new_rank", "tensor", "kind", "src_rank", "src_offset", "dst_offset", "start", "length", "nbytes")

    def __init__(self, ptc: PTC, old: Layout, new: Layout, alive: tuple[int, ...],
                 devices: np.ndarray, gpus_per_host: int, columns: dict[str, np.ndarray], stats: PlanStats,
                 tensor_group: np.ndarray, group_classes: tuple[tuple[np.ndarray, ...], ...],
                 ranks: tuple[int, ...] | None = None):
        self.ptc, self.old, self.new = ptc, old, new
        self.alive = alive
        self.devices = devices
        self.gpus_per_host = gpus_per_host
        self.tensor_names: tuple[str, ...] = tuple(ptc.tensors)
        self.columns = columns  # rows grouped by tensor, in tensor order
        self.stats = stats
        self.ranks = ranks
        # tensors in one group (same old and new holder tables, same item size: the layers of a
        # stage) have the same moves but for the chosen sources; -1: the new layout holds none of it
        # (in a part: or the part does not touch it)
        self.tensor_group = tensor_group
        self.group_classes = group_classes  # per group: holder_classes() of its old holder table
        self._index: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def _order(self) -> np.ndarray:
        """Rows sorted by new rank (stable: tensor order within a rank); built on first use."""
        return self._rank_index()[0]

    @property
    def _bounds(self) -> np.ndarray:
        return self._rank_index()[1]

    def _rank_index(self) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None:
            nr = self.columns["new_rank"]
            order = np.argsort(nr, kind="stable")
            self._index = order, np.searchsorted(nr[order], np.arange(self.new.world_size + 1))
        return self._index

    def __repr__(self) -> str:
        s = self.stats
        part = "" if self.ranks is None else f", part of new ranks {list(self.ranks)}"
        return (f"Plan({self.old} -> {self.new}{part}: {s.num_moves} moves, needed {s.bytes_needed / 2**20:.1f} MiB, "
                f"moved {s.bytes_moved / 2**20:.1f} MiB)")

    def moves(self, new_rank: int) -> list[Move]:
        """Every piece ``new_rank`` needs, in tensor order (in a part: those among its rows)."""
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


class _Context:
    """What source selection needs about the devices: liveness, hosts, names of candidate sets."""

    def __init__(self, old: Any, devices: np.ndarray, alive: tuple[int, ...], gpus_per_host: int):
        self.world_old = old.world_size
        self.devices = devices
        self.alive_mask = np.zeros(self.world_old + 1, dtype=bool)  # last slot: "no holder" (-1)
        self.alive_mask[np.asarray(alive, dtype=np.int64)] = True
        self.new_host = devices // gpus_per_host
        self.old_host = np.append(np.arange(self.world_old) // gpus_per_host, 0)
        self.n_hosts = int(max(self.new_host.max(initial=0), self.old_host.max(initial=0))) + 1
        self.n_devices = int(max(devices.max(initial=0) + 1, self.world_old))  # fresh devices count too
        # a candidate set is named by the sum of its members' random 64-bit hashes
        self.set_hash = np.random.default_rng(0).integers(1, 2**63, self.world_old + 1, dtype=np.uint64)
        self.set_hash[-1] = 0


class _Holders:
    """An old holder table's classes with the lookups source selection needs: the live holders of
    every class (ranks ascending), those per (class, host), and (class, rank) membership."""

    def __init__(self, name: str, table: Any, ctx: _Context, offset: int):
        self.classes = holder_classes(name, table)
        c_start, _, c_ranks, c_local = self.classes
        self.c_start = c_start
        n_cls = len(c_start)
        cls = np.repeat(np.arange(n_cls, dtype=np.int64), c_ranks.shape[1])
        rank, local = c_ranks.reshape(-1), c_local.reshape(-1)
        live = ctx.alive_mask[rank] & (rank >= 0)
        self.e_cls, self.e_rank, self.e_local = cls[live], rank[live], local[live]  # by class, then rank
        self.offset = offset  # of these entries in the plan's concatenated entries
        self.live_ptr = np.searchsorted(self.e_cls, np.arange(n_cls + 1))
        h = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(ctx.set_hash[self.e_rank], dtype=np.uint64)])
        self.live_hash = h[self.live_ptr[1:]] - h[self.live_ptr[:-1]]
        self.key_local = self.e_cls * ctx.n_devices + self.e_rank
        sh = self.e_cls * ctx.n_hosts + ctx.old_host[self.e_rank]
        first = np.ones(len(sh), dtype=bool)
        first[1:] = sh[1:] != sh[:-1]
        self.sh_ptr = np.flatnonzero(first)
        self.sh_key = sh[self.sh_ptr]
        self.sh_cnt = np.diff(np.append(self.sh_ptr, len(sh)))
        self.sh_hash = h[self.sh_ptr + self.sh_cnt] - h[self.sh_ptr]


def _lookup(keys: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, found) of every ``want`` in the sorted ``keys``."""
    if not len(keys):
        return np.zeros(len(want), dtype=np.int64), np.zeros(len(want), dtype=bool)
    pos = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    return pos, keys[pos] == want


_KEYS = ("new_rank", "kind", "dst_offset", "start", "length", "nbytes", "delta", "cand", "count", "set", "qi", "ci")


def _pieces(h: _Holders, ctx: _Context, new_t: Any, qi: np.ndarray, ci: np.ndarray, ps: np.ndarray,
            pe: np.ndarray, itemsize: int) -> dict[str, np.ndarray]:
    """Kind, candidate set (first entry, size, name) and fixed columns of every piece: new table
    row ``qi`` x class ``ci``. Sources: the device itself, else the live holders on its host, else
    every live holder, else storage."""
    nr = new_t.rank[qi]
    pos, is_local = _lookup(h.key_local, ci * ctx.n_devices + ctx.devices[nr])
    g, any_same = _lookup(h.sh_key, ci * ctx.n_hosts + ctx.new_host[nr])
    live_cnt = h.live_ptr[ci + 1] - h.live_ptr[ci]
    kind = np.where(is_local, LOCAL, np.where(live_cnt == 0, STORAGE, np.where(any_same, SAME_HOST, CROSS_HOST)))
    sh_ptr = h.sh_ptr[g] if len(h.sh_ptr) else g
    sh_cnt = h.sh_cnt[g] if len(h.sh_ptr) else g
    sh_hash = h.sh_hash[g] if len(h.sh_ptr) else np.zeros(len(g), dtype=np.uint64)
    length = pe - ps
    return {
        "new_rank": nr, "kind": kind.astype(np.int8), "dst_offset": new_t.local[qi] + (ps - new_t.start[qi]),
        "start": ps, "length": length, "nbytes": length * itemsize, "delta": ps - h.c_start[ci],
        "cand": h.offset + np.where(is_local, pos, np.where(any_same, sh_ptr, h.live_ptr[ci])),
        "count": np.where(is_local, 1, np.where(any_same, sh_cnt, live_cnt)),
        "set": np.where(any_same, sh_hash, h.live_hash[ci]), "qi": qi, "ci": ci,
    }


def _choose(set_key: np.ndarray, nbytes: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Which candidate (index in its set, ranks ascending) every remote piece reads from.

    The pieces of one candidate set, in plan order (tensor, new table row, class), form a stream;
    it is cut into ``count`` equal byte ranges and a piece goes to the candidate whose range holds
    its midpoint. Each candidate so sends its share of the set's bytes to within half a piece at
    either end, and a rank finds the choices of the streams through its own device without the
    rest of the plan (each member of a set holds every piece of its stream).
    """
    order = np.argsort(set_key, kind="stable")
    b = nbytes[order]
    before = np.cumsum(b) - b
    key = set_key[order]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    starts = np.flatnonzero(first)
    run = np.cumsum(first) - 1
    totals = np.diff(np.append(before[starts], before[-1] + b[-1]))
    pos = before - before[starts][run]
    j = np.empty(len(order), dtype=np.int64)
    j[order] = ((2 * pos + b) * count[order]) // (2 * totals[run])
    return np.minimum(j, count - 1)


def _choices(rows: dict[str, np.ndarray], mask: np.ndarray | None = None) -> np.ndarray:
    """Candidate index of every row: streams over the remote rows with more than one candidate
    (and in ``mask``; the others: 0)."""
    j = np.zeros(len(rows["kind"]), dtype=np.int64)
    multi = (rows["count"] > 1) & (rows["kind"] != LOCAL) & (rows["kind"] != STORAGE)
    if mask is not None:
        multi &= mask
    sel = np.flatnonzero(multi)
    if len(sel):
        j[sel] = _choose(rows["set"][sel], rows["nbytes"][sel], rows["count"][sel])
    return j


class _Planner:
    """Groups of tensors (same old and new holder tables and item size: the layers of a stage),
    their holder indexes and pieces, shared by the whole plan and by a part."""

    def __init__(self, ptc: PTC, old: Any, new: Any, ctx: _Context):
        self.ptc, self.old, self.new, self.ctx = ptc, old, new, ctx
        self.names = list(ptc.tensors)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.groups: dict[tuple[int, int, int], int] = {}
        self.info: list[tuple[Any, Any, int, _Holders, str]] = []  # old table, new table, itemsize, holders, a name
        self.holders: dict[int, _Holders] = {}
        self.entries: list[tuple[np.ndarray, np.ndarray]] = []
        self.n_entries = 0
        self.tensor_group = np.full(len(self.names), -1, dtype=np.int64)
        self.seen: set[int] = set()
        self.cache: dict[tuple[int, str, int], dict[str, np.ndarray]] = {}
        self.by_stage: dict[tuple[int, int], list[int]] = {}  # (id(layout), stage) -> tensor indices
        self.runs: list[tuple[int, int]] | None = None

    def tensors_of(self, cfg: Any, rank: int) -> list[int]:
        """Indices of the tensors ``rank`` holds under ``cfg`` (ascending)."""
        if not isinstance(cfg, ParallelConfig):
            return sorted(self.index[n] for n in self.ptc.rank_tensors(cfg, rank))
        if self.runs is None:  # runs of consecutive tensors with one placement (a layer's tensors)
            placements = [spec.placement for spec in self.ptc.tensors.values()]
            cuts = [0] + [i for i in range(1, len(placements)) if placements[i] != placements[i - 1]]
            self.runs = list(zip(cuts, cuts[1:] + [len(placements)]))
        stage = cfg.coords(rank).pp
        key = (id(cfg), stage)
        if key not in self.by_stage:
            stages: dict[Any, tuple[int, ...]] = {}
            out: list[int] = []
            for a, b in self.runs:
                placement = self.ptc.tensors[self.names[a]].placement
                if placement not in stages:
                    stages[placement] = self.ptc.stages_of(self.names[a], cfg)
                if stage in stages[placement]:
                    out.extend(range(a, b))
            self.by_stage[key] = out
        return self.by_stage[key]

    def group_of(self, ti: int) -> int:
        """The group of tensor ``ti`` (-1: the new layout holds none of it)."""
        if ti in self.seen:
            return int(self.tensor_group[ti])
        self.seen.add(ti)
        name = self.names[ti]
        spec = self.ptc.tensors[name]
        old_t, new_t = self.ptc.holders(name, self.old), self.ptc.holders(name, self.new)
        if len(new_t) == 0:
            return -1
        if id(old_t) not in self.holders:  # holder tables are shared by the layers of a stage
            h = _Holders(name, old_t, self.ctx, self.n_entries)
            self.holders[id(old_t)] = h
            self.entries.append((h.e_rank, h.e_local))
            self.n_entries += len(h.e_rank)
        key = (id(old_t), id(new_t), spec.itemsize)
        if key not in self.groups:
            self.groups[key] = len(self.info)
            self.info.append((old_t, new_t, spec.itemsize, self.holders[id(old_t)], name))
        self.tensor_group[ti] = self.groups[key]
        return self.groups[key]

    def entry_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """Rank and local offset of every live holder entry of every group's classes."""
        if not self.entries:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate([e[0] for e in self.entries]), np.concatenate([e[1] for e in self.entries])

    def pieces(self, g: int, view: str = "all", who: int = -1) -> dict[str, np.ndarray]:
        """Pieces of group ``g``: every new table row against every class (``all``), the rows of
        new rank ``who`` (``rank``), or every row against the classes old rank ``who`` holds (``holder``)."""
        key = (g, view, who)
        if key in self.cache:
            return self.cache[key]
        _, new_t, itemsize, h, name = self.info[g]
        c_start, c_end = h.classes[0], h.classes[1]
        rows = classes = None
        if view == "rank":
            rows = np.flatnonzero(new_t.rank == who)
        elif view == "holder":
            classes = np.unique(h.e_cls[h.e_rank == who])
            c_start, c_end = c_start[classes], c_end[classes]
        q_start, q_len = (new_t.start, new_t.length) if rows is None else (new_t.start[rows], new_t.length[rows])
        qi, ci, ps, pe = intersect(q_start, q_len, c_start, c_end)
        if classes is None and int((pe - ps).sum()) != int(q_len.sum()):
            raise PlanError(f"{name}: the old layout does not cover every element the new layout needs")
        qi = qi if rows is None else rows[qi]
        ci = ci if classes is None else classes[ci]
        out = self.cache[key] = _pieces(h, self.ctx, new_t, qi, ci, ps, pe, itemsize)
        return out

    def rows(self, tensors: Sequence[int], view: str = "all", who: int = -1) -> dict[str, np.ndarray]:
        """The pieces of ``tensors`` (ascending), as rows in plan order with their tensor index."""
        per = [(ti, self.pieces(g, view, who)) for ti in tensors if (g := self.group_of(ti)) >= 0]
        if not per:
            return {k: np.zeros(0, dtype=np.uint64 if k == "set" else np.int64) for k in (*_KEYS, "tensor")}
        out = {k: np.concatenate([p[k] for _, p in per]) for k in _KEYS}
        out["tensor"] = np.repeat(np.array([ti for ti, _ in per], dtype=np.int64), [len(p["qi"]) for _, p in per])
        return out


def _row_key(rows: dict[str, np.ndarray]) -> np.ndarray:
    """A row's identity in the whole plan: (tensor, new table row, class)."""
    return (rows["tensor"] * (1 << 24) + rows["qi"]) * (1 << 24) + rows["ci"]


def _device_rows(planner: _Planner, x: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every piece any new rank reads from a class old rank ``x`` holds, with the candidate index of
    those whose candidate set contains ``x``: complete streams, since every member of a set holds
    every class of it."""
    rows = planner.rows(planner.tensors_of(planner.old, x), "holder", x)
    ctx = planner.ctx
    in_set = (rows["kind"] != SAME_HOST) | (ctx.new_host[rows["new_rank"]] == ctx.old_host[x])
    return rows, _choices(rows, in_set)


def _part(planner: _Planner, ranks: Sequence[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rows the new ranks ``ranks`` receive and rows their devices send (plan order, each once),
    with their candidate indices."""
    ctx = planner.ctx
    found: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
    by_device: dict[int, tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]] = {}

    def device(x: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        if x not in by_device:
            rows, j = _device_rows(planner, x)
            key = _row_key(rows)
            order = np.argsort(key)
            by_device[x] = rows, j, key[order], order
        return by_device[x]

    for r in ranks:
        rows = planner.rows(planner.tensors_of(planner.new, r), "rank", r)
        j = np.zeros(len(rows["kind"]), dtype=np.int64)
        multi = np.flatnonzero((rows["count"] > 1) & (rows["kind"] != LOCAL) & (rows["kind"] != STORAGE))
        if len(multi):  # a set's stream, as its first member sees it
            e_rank = planner.entry_columns()[0]
            members = e_rank[rows["cand"][multi]]
            for x in np.unique(members).tolist():
                mine = multi[members == x]
                _, dj, keys, order = device(x)
                pos, ok = _lookup(keys, _row_key({k: rows[k][mine] for k in ("tensor", "qi", "ci")}))
                if not ok.all():
                    raise PlanError("a part's piece is missing from its source's streams; the plan is inconsistent")
                j[mine] = dj[order[pos]]
        found.append((rows, j))
        d = int(ctx.devices[r])
        if d < ctx.world_old:
            drows, dj, _, _ = device(d)
            e_rank = planner.entry_columns()[0]
            peer = (drows["kind"] == SAME_HOST) | (drows["kind"] == CROSS_HOST)
            src = np.where(peer, e_rank[np.where(peer, drows["cand"] + dj, 0)] if len(e_rank) else -1, -1)
            sends = peer & (src == d)
            found.append(({k: v[sends] for k, v in drows.items()}, dj[sends]))
    found.append((planner.rows([]), np.zeros(0, dtype=np.int64)))
    rows = {k: np.concatenate([f[0][k] for f in found]) for k in (*_KEYS, "tensor")}
    j = np.concatenate([f[1] for f in found])
    key = _row_key(rows)
    _, first = np.unique(key, return_index=True)  # sorted by key: plan order
    return {k: v[first] for k, v in rows.items()}, j[first]


def _sources(rows: dict[str, np.ndarray], sel: np.ndarray, j: np.ndarray, e_rank: np.ndarray, e_local: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """Source rank (-1: storage) and offset in its shard of the rows ``sel`` with candidate indices ``j``."""
    kind, start = rows["kind"][sel], rows["start"][sel]
    if not len(e_rank):
        return np.full(len(sel), -1, dtype=np.int64), start.copy()
    storage = kind == STORAGE
    idx = np.where(storage, 0, rows["cand"][sel] + j)
    return (np.where(storage, -1, e_rank[idx]),
            np.where(storage, start, e_local[idx] + rows["delta"][sel]))


def _whole(planner: _Planner) -> dict[str, np.ndarray]:
    """The whole plan's columns. The tensors of a group (the layers of a stage) share their
    pieces but for the chosen sources: every column but those is a concatenation of the groups'
    arrays, the sources of single-candidate pieces are computed once per group, and only the
    pieces with several candidates (in plan order, as ``_choices`` sees them) are chosen per row."""
    tensors = [(ti, g) for ti in range(len(planner.names)) if (g := planner.group_of(ti)) >= 0]
    e_rank, e_local = planner.entry_columns()
    per_group: dict[int, tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]] = {}
    for g in sorted({g for _, g in tensors}):
        p = planner.pieces(g)
        multi = np.flatnonzero((p["count"] > 1) & (p["kind"] != LOCAL) & (p["kind"] != STORAGE))
        n = len(p["kind"])
        src, src_off = _sources(p, np.arange(n), np.zeros(n, dtype=np.int64), e_rank, e_local)
        per_group[g] = (p, multi, src, src_off)
    if not tensors:
        empty = planner.rows([])
        return {"new_rank": empty["new_rank"], "tensor": empty["tensor"].astype(np.int32),
                "kind": empty["kind"].astype(np.int8), "src_rank": empty["new_rank"].copy(),
                "src_offset": empty["start"].copy(), "dst_offset": empty["dst_offset"], "start": empty["start"],
                "length": empty["length"], "nbytes": empty["nbytes"]}
    groups = [per_group[g] for _, g in tensors]
    counts = np.array([len(q[0]["kind"]) for q in groups], dtype=np.int64)
    columns = {k: np.concatenate([q[0][k] for q in groups]) for k in ("new_rank", "kind", "dst_offset", "start",
                                                                      "length", "nbytes")}
    columns["kind"] = columns["kind"].astype(np.int8, copy=False)
    columns["tensor"] = np.repeat(np.array([ti for ti, _ in tensors], dtype=np.int32), counts)
    src = np.concatenate([q[2] for q in groups])
    src_off = np.concatenate([q[3] for q in groups])
    offsets = np.cumsum(counts) - counts
    multi = [(o, q) for o, q in zip(offsets.tolist(), groups) if len(q[1])]
    if multi:
        pos = np.concatenate([o + q[1] for o, q in multi])
        sub = {k: np.concatenate([q[0][k][q[1]] for _, q in multi]) for k in ("set", "nbytes", "count", "kind",
                                                                              "start", "cand", "delta")}
        j = _choose(sub["set"], sub["nbytes"], sub["count"])
        src[pos], src_off[pos] = _sources(sub, np.arange(len(pos)), j, e_rank, e_local)
    columns["src_rank"], columns["src_offset"] = src, src_off
    return {k: columns[k] for k in Plan._COLUMNS}


def plan(
    ptc: PTC,
    old_cfg: Layout,
    new_cfg: Layout,
    *,
    alive: Sequence[int] | None = None,
    gpus_per_host: int = 8,
    ranks: Sequence[int] | None = None,
) -> Plan:
    """Plan the move of ``ptc`` from layout ``old_cfg`` to ``new_cfg`` (``ParallelConfig`` s or a
    torch-native job's ``StateLayout`` s: the same interval arithmetic on their holder tables).

    ``alive``: old ranks whose devices survive (default: the first ``min(old, new)`` world
    size devices); new rank i runs on the i-th of them, and on fresh devices beyond. Old
    rank r ran on device r; device d sits on host ``d // gpus_per_host``.

    ``ranks``: only the part of these new ranks: the moves they receive and the moves their
    devices send, computed from the tensors those devices hold and need, not from the whole plan.
    Every row is the whole plan's row, so the parts of all ranks together are the plan.
    """
    t0 = time.perf_counter()
    if gpus_per_host < 1:
        raise PlanError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
    ptc.check(old_cfg)
    ptc.check(new_cfg)
    devices = device_assignment(old_cfg, new_cfg, alive)
    alive_t = tuple((np.arange(min(new_cfg.world_size, old_cfg.world_size)) if alive is None
                     else np.asarray(alive, dtype=np.int64)).tolist())
    ranks_t = None
    if ranks is not None:
        ranks_t = tuple(sorted({int(r) for r in ranks}))
        bad = [r for r in ranks_t if not 0 <= r < new_cfg.world_size]
        if bad:
            raise PlanError(f"ranks {bad} are outside the new world [0, {new_cfg.world_size})")
    planner = _Planner(ptc, old_cfg, new_cfg, _Context(old_cfg, devices, alive_t, gpus_per_host))
    if ranks_t is None:
        columns = _whole(planner)
    else:
        rows, j = _part(planner, ranks_t)
        e_rank, e_local = planner.entry_columns()
        src, src_off = _sources(rows, np.arange(len(j)), j, e_rank, e_local)
        columns = {
            "new_rank": rows["new_rank"], "tensor": rows["tensor"].astype(np.int32),
            "kind": rows["kind"].astype(np.int8), "src_rank": src, "src_offset": src_off,
            "dst_offset": rows["dst_offset"], "start": rows["start"], "length": rows["length"],
            "nbytes": rows["nbytes"],
        }
    for arr in columns.values():
        arr.setflags(write=False)
    stats = _stats(columns, old_cfg, new_cfg, time.perf_counter() - t0)
    planner.tensor_group.setflags(write=False)
    result = Plan(ptc, old_cfg, new_cfg, alive_t, devices, gpus_per_host, columns, stats, planner.tensor_group,
                  tuple(info[3].classes for info in planner.info), ranks_t)
    log.info("planned %s -> %s%s in %.3fs: %d moves, %.1f MiB moved of %.1f MiB needed", old_cfg, new_cfg,
             "" if ranks_t is None else f" (ranks {list(ranks_t)})", stats.plan_seconds, stats.num_moves,
             stats.bytes_moved / 2**20, stats.bytes_needed / 2**20)
    return result


def _stats(c: dict[str, np.ndarray], old: Layout, new: Layout, seconds: float) -> PlanStats:
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
