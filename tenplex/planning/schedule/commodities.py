"""A plan's non-local moves as the scheduler sees them: pieces (one tensor interval, all its
destinations) grouped into commodities (same candidate sources, same destinations; pure: no I/O)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from ...errors import PlanError
from ..planner import LOCAL, STORAGE, Plan
from ..topology import Topology
from .arrays import Columns, excl_cumsum


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Commodity:
    """Pieces with the same candidate sources and the same destinations, moved as one flow."""

    sources: tuple[str, ...]
    dests: tuple[str, ...]
    nbytes: int
    pieces: np.ndarray  # indices into Demands.piece_* columns, in byte order


class FlowCommodities(Sequence[Commodity]):
    """One-source, one-destination commodities held as columns (``sources[i]``, ``dests[i]``,
    ``nbytes[i]``; pieces ``ptr[i]:ptr[i + 1]``), their :class:`Commodity` objects built on first
    access: the naive flows of a 16,384-GPU plan are 307,783, and building them took seconds of
    the scheduler's limit that it does not need them for."""

    __slots__ = ("sources", "dests", "nbytes", "ptr", "_built")

    def __init__(self, sources: list[str], dests: list[str], nbytes: np.ndarray, ptr: np.ndarray) -> None:
        if not len(sources) == len(dests) == len(nbytes) == len(ptr) - 1:
            raise PlanError(f"flow columns disagree: {len(sources)} sources, {len(dests)} destinations, "
                            f"{len(nbytes)} sizes, {len(ptr) - 1} piece ranges")
        self.sources, self.dests, self.nbytes, self.ptr = sources, dests, nbytes, ptr
        self._built: list[Commodity] | None = None

    def __len__(self) -> int:
        return len(self.nbytes)

    @overload
    def __getitem__(self, i: int) -> Commodity: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Commodity]: ...

    def __getitem__(self, i: int | slice) -> Commodity | Sequence[Commodity]:
        return self._objects()[i]

    def __iter__(self) -> Iterator[Commodity]:
        return iter(self._objects())

    def _objects(self) -> list[Commodity]:
        if self._built is None:
            ar = np.arange(int(self.ptr[-1]) if len(self.ptr) else 0)
            b = self.ptr.tolist()
            self._built = [Commodity((s,), (d,), n, ar[b[k]:b[k + 1]]) for k, (s, d, n)
                           in enumerate(zip(self.sources, self.dests, self.nbytes.tolist()))]
        return self._built


def commodity_nbytes(dem: Demands) -> np.ndarray:
    """Bytes of every commodity of ``dem`` (without building :class:`FlowCommodities`' objects)."""
    if isinstance(dem.commodities, FlowCommodities):
        return dem.commodities.nbytes
    return np.fromiter((c.nbytes for c in dem.commodities), dtype=np.int64, count=len(dem.commodities))


PIECE_COLUMNS = ("piece_tensor", "piece_start", "piece_length", "piece_nbytes", "piece_row_ptr", "rows")


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Demands:
    """A plan's non-local moves, grouped into pieces (one interval, all its destinations) and commodities.

    ``pieces``: the piece columns (:data:`PIECE_COLUMNS`, read as attributes): ``piece_tensor``,
    ``piece_start``, ``piece_length``, ``piece_nbytes``, and the plan rows (moves) piece ``p``
    serves, ``rows[piece_row_ptr[p]:piece_row_ptr[p + 1]]``; built on first read for the naive
    flows of a plan (their rows are the plan's non-local rows, 35.8 M at 131,072 GPUs)."""

    commodities: Sequence[Commodity]  # a tuple, or FlowCommodities (the naive flows of a plan)
    pieces: Columns
    bytes_moved: int  # sum over moves (a multicast piece counted once per destination)

    def __post_init__(self) -> None:
        if self.pieces.names != PIECE_COLUMNS:
            raise PlanError(f"demands need the piece columns {PIECE_COLUMNS}, got {self.pieces.names}")

    @property
    def piece_tensor(self) -> np.ndarray:
        return self.pieces["piece_tensor"]

    @property
    def piece_start(self) -> np.ndarray:
        return self.pieces["piece_start"]

    @property
    def piece_length(self) -> np.ndarray:
        return self.pieces["piece_length"]

    @property
    def piece_nbytes(self) -> np.ndarray:
        return self.pieces["piece_nbytes"]

    @property
    def piece_row_ptr(self) -> np.ndarray:
        return self.pieces["piece_row_ptr"]

    @property
    def rows(self) -> np.ndarray:
        return self.pieces["rows"]

    def rows_of(self, piece: int) -> np.ndarray:
        """Plan rows (moves) that piece ``piece`` serves."""
        return self.rows[self.piece_row_ptr[piece] : self.piece_row_ptr[piece + 1]]

    @property
    def bytes_unique(self) -> int:
        """Bytes of the pieces (each once; without building them for flow commodities, whose
        piece ranges split the pieces)."""
        if isinstance(self.commodities, FlowCommodities):
            return int(self.commodities.nbytes.sum())
        return int(self.piece_nbytes.sum())

    @classmethod
    def from_columns(cls, commodities: Sequence[Commodity], piece_tensor: np.ndarray, piece_start: np.ndarray,
                     piece_length: np.ndarray, piece_nbytes: np.ndarray, piece_row_ptr: np.ndarray, rows: np.ndarray,
                     bytes_moved: int) -> Demands:
        """Demands with their piece columns given."""
        cols = dict(zip(PIECE_COLUMNS, (piece_tensor, piece_start, piece_length, piece_nbytes, piece_row_ptr, rows)))
        return cls(commodities, Columns(PIECE_COLUMNS, cols), bytes_moved)

    @classmethod
    def of(cls, flows: list[tuple[tuple[str, ...], tuple[str, ...], int]]) -> Demands:
        """Demands without a plan: ``(candidate source nodes, destination nodes, bytes)`` per flow
        (flow i is tensor i, one byte per element)."""
        coms = []
        for i, (srcs, dsts, nb) in enumerate(flows):
            if nb <= 0 or not srcs or not dsts:
                raise PlanError(f"flow {i} needs sources, destinations and positive bytes, got {srcs}, {dsts}, {nb}")
            if set(srcs) & set(dsts):
                raise PlanError(f"flow {i}: a destination is also a source ({sorted(set(srcs) & set(dsts))})")
            coms.append(Commodity(tuple(srcs), tuple(dsts), int(nb), np.array([i])))
        n = len(flows)
        nb_arr = np.array([f[2] for f in flows], dtype=np.int64)
        return cls.from_columns(tuple(coms), np.arange(n), np.zeros(n, dtype=np.int64), nb_arr.copy(), nb_arr,
                                np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                int(sum(f[2] * len(f[1]) for f in flows)))



def _hashes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, n, dtype=np.uint64)


def demands(plan: Plan, topology: Topology) -> Demands:
    """Group a plan's non-local moves into pieces and commodities (candidate sources: every live holder).

    Tensors of one plan group (the layers of a stage) have the same moves, so the pieces and
    their commodities are found for one tensor per group and repeated for the others.
    """
    c = plan.columns
    remote = c["kind"] != LOCAL
    if not remote.any():
        z = np.zeros(0, dtype=np.int64)
        return Demands.from_columns((), z, z, z, z, np.zeros(1, dtype=np.int64), z, 0)
    n_t = len(plan.tensor_names)
    tbound = np.searchsorted(c["tensor"], np.arange(n_t + 1))  # plan rows are in tensor order
    rcum = np.concatenate([[0], np.cumsum(remote)])
    active = np.flatnonzero(rcum[tbound[1:]] > rcum[tbound[:-1]])  # tensors with non-local moves
    grp = plan.tensor_group[active]
    _, first = np.unique(grp, return_index=True)
    rep_of = np.zeros(int(grp.max()) + 1, dtype=np.int64)
    rep_of[grp[first]] = active[first]
    rep = rep_of[grp]  # each active tensor's representative (the group's first)
    is_rep = np.zeros(n_t, dtype=bool)
    is_rep[active[first]] = True
    rp = rep_pieces(plan, topology, np.flatnonzero(remote & is_rep[c["tensor"]]))
    # repeat the representatives' pieces for every tensor of their group, in tensor order
    rp_first = np.searchsorted(rp.tensor, np.arange(n_t + 1))
    n_p = (rp_first[1:] - rp_first[:-1])[rep]
    p_off = excl_cumsum(n_p)
    src = np.repeat(rp_first[rep] - p_off, n_p) + np.arange(int(n_p.sum()))  # representative piece of each piece
    p_tensor = np.repeat(active, n_p)
    p_nbytes = rp.nbytes[src]
    n_r = np.diff(rp.row_ptr)[src]
    ptr = np.concatenate([[0], np.cumsum(n_r)])
    shift = np.repeat(np.repeat(tbound[active] - tbound[rep], n_p), n_r)
    rows = rp.rows[np.repeat(rp.row_ptr[src] - ptr[:-1], n_r) + np.arange(int(ptr[-1]))] + shift
    com = rp.commodity[src]
    small = np.int16 if len(rp.sources) < 2**15 else np.int64  # stable sort of 16-bit keys is a radix sort
    corder = np.argsort(com.astype(small), kind="stable")
    cb = np.searchsorted(com[corder], np.arange(len(rp.sources) + 1))
    c_nbytes = np.add.reduceat(p_nbytes[corder], cb[:-1]) if len(corder) else np.zeros(0, dtype=np.int64)
    commodities = [Commodity(rp.sources[k], rp.dests[k], int(c_nbytes[k]), corder[cb[k] : cb[k + 1]])
                   for k in range(len(rp.sources))]
    commodities.sort(key=lambda k: (-k.nbytes, k.sources, k.dests))
    return Demands.from_columns(tuple(commodities), p_tensor, rp.start[src], rp.length[src], p_nbytes, ptr, rows,
                                int(c["nbytes"][remote].sum()))


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class RepPieces:
    """Pieces of some plan rows (sorted by tensor, start, length) and their commodities."""

    tensor: np.ndarray
    start: np.ndarray
    length: np.ndarray
    nbytes: np.ndarray
    row_ptr: np.ndarray
    rows: np.ndarray
    commodity: np.ndarray  # per piece
    sources: list[tuple[str, ...]]  # per commodity
    dests: list[tuple[str, ...]]


def rep_pieces(plan: Plan, topology: Topology, rows: np.ndarray) -> RepPieces:
    """Pieces (one tensor interval, all its destinations) of plan rows ``rows`` and their commodities
    (same candidate sources, every live holder, and same destinations)."""
    c = plan.columns
    old_w = plan.old.world_size
    alive = np.zeros(old_w + 1, dtype=bool)
    alive[list(plan.alive)] = True
    node_names = [topology.gpu(r) if alive[r] else "" for r in range(old_w)]
    node_names.append(topology.storage() if np.any(c["kind"][rows] == STORAGE) else "")
    nn = old_w + 2  # old ranks, storage, padding
    storage_id, pad = old_w, nn - 1
    src_hash = _hashes(nn, 1)
    src_hash[pad] = 0
    # rows of one plan group share the old layout's holder classes (the plan keeps them)
    grp = plan.tensor_group[c["tensor"][rows]]
    order = np.argsort(grp, kind="stable")
    rows = rows[order]
    grp = grp[order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(grp)) + 1, [len(rows)]])
    row_start, row_kind = c["start"][rows], c["kind"][rows]
    # holders per class, not per row (issue #20: rows x holders was 2.3 GB at 131,072 GPUs, 1,024 replicas)
    tables: list[np.ndarray] = [np.array([[storage_id]])]  # class 0: storage
    row_cls = np.zeros(len(rows), dtype=np.int64)
    n_cls = 1
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        c_start, _, c_ranks, _ = plan.group_classes[int(grp[a])]
        ci = np.searchsorted(c_start, row_start[a:b], side="right") - 1
        tables.append(np.where((c_ranks >= 0) & alive[c_ranks], c_ranks, pad))
        row_cls[a:b] = np.where(row_kind[a:b] == STORAGE, 0, n_cls + np.maximum(ci, 0))
        n_cls += len(c_ranks)
    # each table hashed at its own width (padding every class to the widest was (558,080 x 8,192) at
    # 131,072 GPUs with ZeRO-1: sharded optimizer classes of one holder beside replicated ones)
    cls_hash = np.concatenate([src_hash[t].sum(1) for t in tables])
    cls_off = np.cumsum([0] + [len(t) for t in tables])
    cand_key = cls_hash[row_cls]

    def holders(gid: int) -> np.ndarray:
        k = int(np.searchsorted(cls_off, gid, side="right")) - 1
        return tables[k][gid - int(cls_off[k])]

    # pieces: same tensor interval (one transmission can serve all its destinations)
    tens, start, length = c["tensor"][rows], c["start"][rows], c["length"][rows]
    porder = np.lexsort((length, start, tens))
    rows, tens, start, length = rows[porder], tens[porder], start[porder], length[porder]
    cand_key, row_cls = cand_key[porder], row_cls[porder]
    new_piece = np.ones(len(rows), dtype=bool)
    new_piece[1:] = (tens[1:] != tens[:-1]) | (start[1:] != start[:-1]) | (length[1:] != length[:-1])
    pfirst = np.flatnonzero(new_piece)
    ptr = np.concatenate([pfirst, [len(rows)]])
    dev = plan.devices[c["new_rank"][rows]]
    dst_hash = _hashes(int(dev.max()) + 1, 2)
    pdst = np.add.reduceat(dst_hash[dev], pfirst)
    pkey = cand_key[pfirst]
    # one 64-bit key per (source set, destination set); both halves are sums of random 64-bit values
    ckey = pkey * np.uint64(0x9E3779B97F4A7C15) + (pdst ^ (pdst >> np.uint64(29)))
    _, cfirst, inv = np.unique(ckey, return_index=True, return_inverse=True)
    src_names: dict[tuple[int, ...], tuple[str, ...]] = {}  # node sets recur: name each once
    dst_names: dict[tuple[int, ...], tuple[str, ...]] = {}
    sources, dests = [], []
    for p0 in cfirst.tolist():
        r0 = int(pfirst[p0])
        key = tuple(i for i in holders(int(row_cls[r0])).tolist() if i != pad)
        if key not in src_names:
            src_names[key] = tuple(sorted(node_names[i] for i in key))
        if not key:
            raise PlanError(f"a piece of {plan.tensor_names[int(tens[r0])]} has no live holder and is not read "
                            "from storage; the plan and its alive set disagree")
        sources.append(src_names[key])
        key = tuple(dev[ptr[p0] : ptr[p0 + 1]].tolist())
        if key not in dst_names:
            dst_names[key] = tuple(sorted(topology.gpu(x) for x in key))
        dests.append(dst_names[key])
    return RepPieces(tens[pfirst], start[pfirst], length[pfirst], c["nbytes"][rows[pfirst]], ptr, rows,
                      inv.reshape(-1), sources, dests)

