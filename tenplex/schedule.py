"""Traffic-engineered transfer schedules for a plan (TE-CCL style; pure: no I/O).

A :class:`~tenplex.planner.Plan` says which pieces every new rank needs; this module decides
*how* they travel over a :class:`~tenplex.topology.Topology`: from which live replica (any
alive old holder of the interval, a super-source), along which links, through which host
memories (store-and-forward), in which epoch, and with one transmission serving several new
ranks that need the same piece (multicast). Pieces are aggregated into *commodities* (same
candidate sources, same destinations) and split into chunks, so a GPT-3 plan of 10^5 moves
becomes a few hundred commodities and a few thousand chunks.

Methods (see docs/schedule.md):

- ``milp``: time-expanded MILP over route options (TE-CCL with copy), integer chunks; small
  instances only.
- ``lp``: the LP of the fluid limit (min-congestion multicast routing with source choice over
  the same route options, solved by HiGHS), rounded to chunks and list-scheduled in epochs.
- ``greedy``: load-aware source choice on shortest-path trees, list-scheduled in epochs.
- ``auto``: greedy first (the fallback), then lp, then milp when small, within ``time_limit``;
  the best by simulated completion wins.

Also: :func:`simulate` (completion of a schedule), :func:`naive_completion` (every transfer at
once on its shortest path, max-min fair sharing), :func:`lower_bound` (cut bound with best
source choice and multicast) and :meth:`Schedule.rounds` (the transfer order for a transport).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import PlanError
from .planner import LOCAL, STORAGE, Plan, holder_classes
from .topology import Topology

__all__ = ["Commodity", "Demands", "Transfer", "Schedule", "schedule", "demands", "simulate", "naive_completion",
           "lower_bound", "validate", "METHODS"]

log = logging.getLogger(__name__)

METHODS = ("auto", "milp", "lp", "greedy")
_MAX_CHUNKS = 20000
_TARGET_CHUNKS = 2000
_TARGET_EPOCHS = 128
_MILP_MAX_VARS = 20000
_MILP_ROUNDS_MAX = 200_000  # option x epoch pairs beyond which even rounds take too long
_PACE = 0.9  # sources release chunks at this fraction of the lower bound's pace (see _schedule_demands)
_GOOD_ENOUGH = 1.03  # auto stops at the greedy schedule when it is this close to the lower bound


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Commodity:
    """Pieces with the same candidate sources and the same destinations, moved as one flow."""

    sources: tuple[str, ...]
    dests: tuple[str, ...]
    nbytes: int
    pieces: np.ndarray  # indices into Demands.piece_* columns, in byte order


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Demands:
    """A plan's non-local moves, grouped into pieces (one interval, all its destinations) and commodities."""

    commodities: tuple[Commodity, ...]
    piece_tensor: np.ndarray
    piece_start: np.ndarray
    piece_length: np.ndarray
    piece_nbytes: np.ndarray
    piece_row_ptr: np.ndarray  # rows[piece_row_ptr[p]:piece_row_ptr[p + 1]]: plan rows (moves) piece p serves
    rows: np.ndarray
    bytes_moved: int  # sum over moves (a multicast piece counted once per destination)

    def rows_of(self, piece: int) -> np.ndarray:
        """Plan rows (moves) that piece ``piece`` serves."""
        return self.rows[self.piece_row_ptr[piece] : self.piece_row_ptr[piece + 1]]

    @property
    def bytes_unique(self) -> int:
        return int(self.piece_nbytes.sum())

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
        return cls(tuple(coms), np.arange(n), np.zeros(n, dtype=np.int64), nb_arr.copy(), nb_arr,
                   np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                   int(sum(f[2] * len(f[1]) for f in flows)))


@dataclass(frozen=True, slots=True)
class Transfer:
    """One hop of one chunk: ``nbytes`` of ``tensor`` elements ``[start, start + length)`` over ``src -> dst``.

    ``round``: the epoch the hop starts in. ``src_rank``: the old rank sending it when ``src``
    is its GPU (-1 for host memory, storage or relays). ``new_ranks``: the new ranks on
    ``dst`` that keep the piece (empty when ``dst`` only forwards it).
    """

    round: int
    src: str
    dst: str
    tensor: str
    start: int
    length: int
    nbytes: int
    chunk: int
    src_rank: int
    new_ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Schedule:
    """Chunks assigned to links per epoch.

    Hop columns (one row per chunk and link): ``hop_chunk``, ``hop_link``, ``hop_parent``
    (the hop that brought the chunk to this link's tail, -1 at a source), ``hop_first`` /
    ``hop_last`` (epochs the chunk is on the link), ``hop_arrival`` (first epoch it can leave
    the link's head). Slice columns (``slice_hop``, ``slice_epoch``, ``slice_nbytes``): bytes
    a hop sends in each epoch. A chunk is ``chunk_nbytes`` bytes of commodity
    ``chunk_commodity`` starting at byte ``chunk_offset`` of the commodity's pieces.
    """

    plan: Plan | None
    topology: Topology
    demands: Demands
    method: str
    tau: float
    chunk_bytes: int
    chunk_commodity: np.ndarray
    chunk_offset: np.ndarray
    chunk_nbytes: np.ndarray
    hop_chunk: np.ndarray
    hop_link: np.ndarray
    hop_parent: np.ndarray
    hop_first: np.ndarray
    hop_last: np.ndarray
    hop_arrival: np.ndarray
    slice_hop: np.ndarray
    slice_epoch: np.ndarray
    slice_nbytes: np.ndarray
    solve_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_epochs(self) -> int:
        return int(self.hop_arrival.max()) if len(self.hop_arrival) else 0

    @property
    def makespan_s(self) -> float:
        """Completion in whole epochs (``num_epochs * tau``)."""
        return self.num_epochs * self.tau

    @property
    def completion_s(self) -> float:
        """Completion when every link runs its chunks as soon as possible in schedule order (:func:`simulate`)."""
        return simulate(self)

    def __repr__(self) -> str:
        return (f"Schedule({self.method}: {len(self.chunk_nbytes)} chunks of <= {self.chunk_bytes} B, "
                f"{len(self.hop_chunk)} hops, {self.num_epochs} epochs of {self.tau * 1e3:.3f} ms)")

    def rounds(self) -> list[list[Transfer]]:
        """The hops grouped by starting epoch, epochs in order (empty ones skipped).

        A transport runs the rounds one after another; inside a round it may run every
        transfer at once. A transfer's data is at its ``src`` before its round starts.
        """
        d = self.demands
        names = self.plan.tensor_names if self.plan is not None else ()
        itemsize = np.where(d.piece_length > 0, d.piece_nbytes // np.maximum(d.piece_length, 1), 1)
        starts = [np.concatenate([[0], np.cumsum(d.piece_nbytes[c.pieces])]) for c in d.commodities]
        dev_ranks: dict[str, list[int]] = {}
        if self.plan is not None:
            for r, dev in enumerate(self.plan.devices):
                dev_ranks.setdefault(f"gpu{int(dev)}", []).append(r)
        by_epoch: dict[int, list[Transfer]] = {}
        lk = self.topology.links
        order = np.lexsort((self.hop_chunk, self.hop_first))
        for h in order:
            c = int(self.hop_chunk[h])
            k = int(self.chunk_commodity[c])
            com = d.commodities[k]
            a = int(self.chunk_offset[c])
            b = a + int(self.chunk_nbytes[c])
            link = lk[int(self.hop_link[h])]
            src_rank = -1
            if self.hop_parent[h] < 0 and link.src.startswith("gpu"):
                src_rank = int(link.src[3:])
            keep = tuple(dev_ranks.get(link.dst, ())) if link.dst in com.dests else ()
            pre = starts[k]
            i0 = int(np.searchsorted(pre, a, side="right")) - 1
            while i0 < len(com.pieces) and pre[i0] < b:
                p = int(com.pieces[i0])
                lo, hi = max(a, int(pre[i0])), min(b, int(pre[i0 + 1]))
                sz = int(itemsize[p])
                if hi > lo:
                    tensor = names[int(d.piece_tensor[p])] if names else str(int(d.piece_tensor[p]))
                    by_epoch.setdefault(int(self.hop_first[h]), []).append(Transfer(
                        int(self.hop_first[h]), link.src, link.dst, tensor,
                        int(d.piece_start[p]) + (lo - int(pre[i0])) // sz, (hi - lo) // sz, hi - lo, c, src_rank,
                        tuple(r for r in keep if self._rank_needs(r, p))))
                i0 += 1
        return [by_epoch[e] for e in sorted(by_epoch)]

    def _rank_needs(self, new_rank: int, piece: int) -> bool:
        if self.plan is None:
            return True
        return bool(np.any(self.plan.columns["new_rank"][self.demands.rows_of(piece)] == new_rank))

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "tau_s": self.tau, "chunk_bytes": self.chunk_bytes,
                "chunks": len(self.chunk_nbytes), "hops": len(self.hop_chunk), "epochs": self.num_epochs,
                "commodities": len(self.demands.commodities), "solve_s": self.solve_seconds, **self.info}


# -- demands ------------------------------------------------------------------------------

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
        return Demands((), z, z, z, z, np.zeros(1, dtype=np.int64), z, 0)
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
    rp = _rep_pieces(plan, topology, np.flatnonzero(remote & is_rep[c["tensor"]]))
    # repeat the representatives' pieces for every tensor of their group, in tensor order
    rp_first = np.searchsorted(rp.tensor, np.arange(n_t + 1))
    n_p = (rp_first[1:] - rp_first[:-1])[rep]
    p_off = _excl_cumsum(n_p)
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
    return Demands(tuple(commodities), p_tensor, rp.start[src], rp.length[src], p_nbytes, ptr, rows,
                   int(c["nbytes"][remote].sum()))


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class _RepPieces:
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


def _rep_pieces(plan: Plan, topology: Topology, rows: np.ndarray) -> _RepPieces:
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
    kmax = 1
    ids_parts: list[np.ndarray] = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        c_start, _, c_ranks, _ = plan.group_classes[int(grp[a])]
        ci = np.searchsorted(c_start, row_start[a:b], side="right") - 1
        hr = c_ranks[np.maximum(ci, 0)]
        ids = np.where((hr >= 0) & alive[hr], hr, pad)
        ids[row_kind[a:b] == STORAGE] = pad
        ids[row_kind[a:b] == STORAGE, 0] = storage_id
        ids_parts.append(ids)
        kmax = max(kmax, ids.shape[1])
    ids_all = np.full((len(rows), kmax), pad, dtype=np.int64)
    pos = 0
    for ids in ids_parts:
        ids_all[pos : pos + len(ids), : ids.shape[1]] = ids
        pos += len(ids)
    cand_key = src_hash[ids_all].sum(1)
    # pieces: same tensor interval (one transmission can serve all its destinations)
    tens, start, length = c["tensor"][rows], c["start"][rows], c["length"][rows]
    porder = np.lexsort((length, start, tens))
    rows, tens, start, length = rows[porder], tens[porder], start[porder], length[porder]
    cand_key, ids_all = cand_key[porder], ids_all[porder]
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
        key = tuple(i for i in ids_all[r0].tolist() if i != pad)
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
    return _RepPieces(tens[pfirst], start[pfirst], length[pfirst], c["nbytes"][rows[pfirst]], ptr, rows,
                      inv.reshape(-1), sources, dests)


# -- routes ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class _Option:
    """A way to deliver a commodity's chunk to some of its destinations from one source."""

    commodity: int
    source: str
    paths: dict[str, tuple[str, ...]]  # destination -> node path
    links: np.ndarray  # distinct links used
    hop_link: np.ndarray
    hop_parent: np.ndarray
    dest_hop: dict[str, int]


def _merge(topology: Topology, paths: list[tuple[str, ...]]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Merge node paths into a forest of hops (shared prefixes carry one copy)."""
    hop_of: dict[tuple[str, ...], int] = {}
    links: list[int] = []
    parents: list[int] = []
    dest_hop: dict[str, int] = {}
    for path in paths:
        parent = -1
        for i in range(1, len(path)):
            key = path[: i + 1]
            h = hop_of.get(key)
            if h is None:
                h = hop_of[key] = len(links)
                links.append(topology.link_index[(path[i - 1], path[i])])
                parents.append(parent)
            parent = h
        dest_hop[path[-1]] = parent
    return np.asarray(links, dtype=np.int64), np.asarray(parents, dtype=np.int64), dest_hop


def _option(topology: Topology, k: int, source: str, paths: dict[str, tuple[str, ...]]) -> _Option:
    hl, hp, dh = _merge(topology, list(paths.values()))
    return _Option(k, source, paths, np.unique(hl), hl, hp, dh)


def _alt_path(topology: Topology, s: str, d: str, first: tuple[str, ...], ref: float) -> tuple[str, ...] | None:
    import networkx as nx

    used = set(zip(first, first[1:]))
    try:
        p = nx.dijkstra_path(topology.graph, s, d, weight=lambda u, v, a: (a["latency"] + ref / a["bandwidth"])
                             * (20.0 if (u, v) in used else 1.0))
    except nx.NetworkXNoPath:
        return None
    return tuple(p) if tuple(p) != first else None


def _options(topology: Topology, dem: Demands, ref: float, alt: bool) -> list[list[_Option]]:
    """Route options per commodity: per source a shortest-path tree to all destinations; with several
    destinations also per (source, destination) paths; with ``alt`` a second, link-avoiding path."""
    out: list[list[_Option]] = []
    memo: dict[tuple[str, tuple[str, ...]], _Option] = {}
    for k, com in enumerate(dem.commodities):
        opts = []
        for s in com.sources:
            _, sp = topology.shortest_paths(s, ref)
            missing = [d for d in com.dests if d not in sp]
            if missing:
                raise PlanError(f"the topology has no path from {s} to {missing[0]}")
            tree = memo.get((s, com.dests))
            if tree is None:
                tree = memo[(s, com.dests)] = _option(topology, k, s, {d: tuple(sp[d]) for d in com.dests})
            opts.append(dataclasses.replace(tree, commodity=k))
            for d in com.dests:
                if len(com.dests) > 1:
                    opts.append(_option(topology, k, s, {d: tuple(sp[d])}))
                if alt:
                    p = _alt_path(topology, s, d, tuple(sp[d]), ref)
                    if p is not None:
                        opts.append(_option(topology, k, s, {d: p}))
        out.append(opts)
    return out


# -- topology data and routes in bulk ----------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class _Routes:
    """Routes (forests of hops) concatenated: route r's hops are ``start[r]:start[r + 1]``, with
    parents as offsets within the route (-1 at a source); ``of_chunk``: the route of every chunk."""

    hop_link: np.ndarray
    hop_parent: np.ndarray
    start: np.ndarray
    of_chunk: np.ndarray

    @classmethod
    def of(cls, forests: list[tuple[np.ndarray, np.ndarray]], of_chunk: np.ndarray) -> _Routes:
        n = np.array([len(hl) for hl, _ in forests], dtype=np.int64)
        return cls(np.concatenate([hl for hl, _ in forests]), np.concatenate([hp for _, hp in forests]),
                   np.concatenate([[0], np.cumsum(n)]), of_chunk)


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class _Net:
    """Topology data the scheduler reuses: fastest paths between all node pairs for one message size."""

    nodes: list[str]
    idx: dict[str, int]
    host: np.ndarray  # host index per node, -1 where none
    dist: np.ndarray  # (nodes, nodes) path weight: sum of latency + ref / bandwidth
    link: np.ndarray  # (nodes, nodes) link index, -1 where none
    path: np.ndarray  # (nodes, nodes, depth) nodes after the source on the path, -1 padded
    depth: np.ndarray  # (nodes, nodes) links on the path
    latency: np.ndarray  # (nodes, nodes) latency along the path


@functools.lru_cache(maxsize=16)
def _net(topology: Topology, ref: float) -> _Net:
    """:class:`_Net` of ``topology`` for messages of ``ref`` bytes (cached: schedules reuse topologies)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    nodes, idx = list(topology.node_names), topology.node_index
    nn = len(nodes)
    u, v = topology.link_src, topology.link_dst
    link = np.full((nn, nn), -1, dtype=np.int64)
    link[u, v] = np.arange(len(u))
    w = topology.latency + ref / topology.bandwidth
    dist, pred = dijkstra(csr_matrix((w, (u, v)), shape=(nn, nn)), directed=True, return_predecessors=True)
    rows = np.arange(nn)[:, None]
    cur = np.broadcast_to(np.arange(nn), (nn, nn)).copy()
    alive = (cur != rows) & np.isfinite(dist)
    back = []  # back[i][s, d]: the node i links before d on the path s -> d
    lat = np.zeros((nn, nn))
    while alive.any():
        back.append(np.where(alive, cur, -1))
        prev = np.where(alive, pred[rows, cur], cur)
        lat += np.where(alive, topology.latency[link[np.maximum(prev, 0), cur]], 0.0)
        cur = prev
        alive &= cur != rows
    stacked = np.stack(back) if back else np.zeros((0, nn, nn), dtype=np.int64)
    depth = (stacked >= 0).sum(0)
    path = np.full((nn, nn, max(len(back), 1)), -1, dtype=np.int64)
    for j in range(len(back)):  # forward position j is back[depth - 1 - j]
        i = depth - 1 - j
        path[..., j] = np.where(i >= 0, stacked[np.maximum(i, 0), rows, np.arange(nn)], -1)
    host = np.array([-1 if topology.host_of(n) is None else int(topology.host_of(n)) for n in nodes], dtype=np.int64)
    return _Net(nodes, idx, host, dist, link, path, depth, lat)


def _forests(net: _Net, route: np.ndarray, src: np.ndarray, dst: np.ndarray, n_routes: int) -> _Routes:
    """Routes from (route, source node, destination node) entries: per route, the fastest paths
    from each entry's source to its destination, merged where they share a source and a prefix."""
    nn = len(net.nodes)
    dep = net.depth[src, dst]
    if np.any((dep == 0) & (src != dst)):
        bad = int(np.flatnonzero((dep == 0) & (src != dst))[0])
        raise PlanError(f"the topology has no path from {net.nodes[src[bad]]} to {net.nodes[dst[bad]]}")
    width = net.path.shape[2]
    valid = np.arange(width) < dep[:, None]
    nodes = net.path[src, dst][valid]
    prev = np.concatenate([src[:, None], net.path[src, dst][:, :-1]], axis=1)[valid]
    j = np.broadcast_to(np.arange(width), valid.shape)[valid]
    r, s = np.repeat(route, dep), np.repeat(src, dep)
    key = (r * nn + s) * nn + nodes
    key, first = np.unique(key, return_index=True)
    r, s, j, nodes, prev = r[first], s[first], j[first], nodes[first], prev[first]
    o = np.lexsort((nodes, j, s, r))  # per route, parents before children
    r, s, j, nodes, prev, key = r[o], s[o], j[o], nodes[o], prev[o], key[o]
    start = np.searchsorted(r, np.arange(n_routes + 1))
    by_key = np.argsort(key)
    pk = (r * nn + s) * nn + prev
    parent = np.where(j > 0, by_key[np.searchsorted(key[by_key], pk).clip(0, len(key) - 1)] - start[r], -1)
    return _Routes(net.link[prev, nodes], parent, start, np.zeros(0, dtype=np.int64))


# -- list scheduling in the time-expanded network --------------------------------------------

def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=x.dtype)
    np.cumsum(x[:-1], out=out[1:])
    return out


def _link_levels(parent_link: np.ndarray, child_link: np.ndarray, n_links: int) -> np.ndarray | None:
    """Level of every link in the graph "a chunk crosses link a, then link b" (longest path into
    it), or None when that graph has a cycle. Every hop's parent is on a link of a lower level,
    so the links of one level can be scheduled together once the lower levels are done."""
    key = np.unique(parent_link * n_links + child_link)
    pa, ch = key // n_links, key % n_links
    lev = np.zeros(n_links, dtype=np.int64)
    while True:
        new = lev.copy()
        np.maximum.at(new, ch, lev[pa] + 1)
        if np.array_equal(new, lev):
            return lev
        if new.max() >= n_links:
            return None
        lev = new


def _fifo(link: np.ndarray, ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Finish times of jobs sorted by link, each link serving its jobs one at a time in that order,
    each as soon as it is ready and the link is free: per link, ``fin_i = S_i + max_{j <= i}
    (ready_j - S_{j-1})`` with ``S`` the running sum of durations (a segmented cumulative max)."""
    cs = np.cumsum(dur)
    excl = cs - dur
    head = np.ones(len(link), dtype=bool)
    head[1:] = link[1:] != link[:-1]
    seg = np.cumsum(head) - 1
    base = excl[head][seg]
    val = ready - (excl - base)
    off = seg * (float(val.max() - val.min()) + 1.0)  # lifts every link's values above the previous link's
    return cs - base + (np.maximum.accumulate(val + off) - off)


def _by_level(lev: np.ndarray) -> list[np.ndarray]:
    """Indices grouped by level, lowest first, each group in index order."""
    order = np.argsort(lev, kind="stable")
    bounds = np.searchsorted(lev[order], np.arange(int(lev.max()) + 2))
    return [order[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if b > a]


def _list_schedule(topology: Topology, routes: _Routes, chunk_nb: np.ndarray, order: np.ndarray,
                   tau: float, release: np.ndarray) -> dict[str, np.ndarray]:
    """List-schedule chunks (priority ``order``, leaving their sources from epoch ``release``) along
    their routes in the time-expanded network.

    Links are taken level by level in the link graph of the routes (numpy over all hops of a
    level): each link sends its hops one at a time at full bandwidth, in order of arrival at its
    tail (epoch the parent hop delivers; ties by priority), without idling. Busy intervals of a
    link never overlap, so no epoch carries more than ``bandwidth * tau``; a chunk may leave a
    node from the epoch after it arrived completely (plus the link latency in epochs). Falls
    back to :func:`_list_schedule_seq` when the link graph has a cycle (e.g. traffic around a ring).
    """
    nl = len(topology.bandwidth)
    r_off = routes.start[:-1]
    n_r = np.diff(routes.start)
    cat_l, cat_p = routes.hop_link, routes.hop_parent
    inner = cat_p >= 0
    lev = _link_levels(cat_l[np.repeat(r_off, n_r)[inner] + cat_p[inner]], cat_l[inner], nl)
    if lev is None:
        log.info("route links form a cycle; list scheduling chunk by chunk")
        return _list_schedule_seq(topology, routes, chunk_nb, order, tau, release)
    rid = routes.of_chunk[order]
    nh = n_r[rid]
    base = np.repeat(_excl_cumsum(nh), nh)
    pos = np.arange(len(base)) - base
    src = np.repeat(r_off[rid], nh) + pos
    hop_link, par = cat_l[src], cat_p[src]
    hop_parent = np.where(par >= 0, base + par, -1)
    hop_chunk = np.repeat(order, nh)
    cap = topology.bandwidth * tau
    lat_ep = np.rint(topology.latency / tau).astype(np.int64)
    nb = chunk_nb[hop_chunk].astype(np.float64)
    dur = nb / cap[hop_link]
    start, fin = np.empty(len(base)), np.empty(len(base))
    arrival = np.zeros(len(base), dtype=np.int64)
    for idx in _by_level(lev[hop_link]):
        p = hop_parent[idx]
        ready = np.where(p >= 0, arrival[p], release[hop_chunk[idx]])
        o = np.lexsort((idx, ready, hop_link[idx]))  # per link: by arrival, then priority
        idx, ready = idx[o], ready[o].astype(np.float64)
        f = _fifo(hop_link[idx], ready, dur[idx])
        s = np.maximum(f - dur[idx], ready)
        start[idx], fin[idx] = s, f
        last = np.maximum(np.ceil(f - 1e-9) - 1, np.floor(s)).astype(np.int64)
        arrival[idx] = last + 1 + lat_ep[hop_link[idx]]
    # number hops by start time, so the order by (first epoch, index) is each link's sending order
    perm = np.argsort(start, kind="stable")
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    hop_link, hop_chunk, nb, start, fin = hop_link[perm], hop_chunk[perm], nb[perm], start[perm], fin[perm]
    hop_parent = np.where(hop_parent[perm] >= 0, inv[hop_parent[perm]], -1)
    first = np.floor(start).astype(np.int64)
    last = np.maximum(np.ceil(fin - 1e-9).astype(np.int64) - 1, first)
    n_sl = last - first + 1
    s_hop = np.repeat(np.arange(len(perm)), n_sl)
    s_epoch = first[s_hop] + (np.arange(len(s_hop)) - np.repeat(_excl_cumsum(n_sl), n_sl))
    s_nb = cap[hop_link[s_hop]] * np.clip(np.minimum(fin[s_hop], s_epoch + 1) - np.maximum(start[s_hop], s_epoch),
                                          0.0, None)
    ends = np.cumsum(n_sl) - 1
    s_nb[ends] += nb - np.bincount(s_hop, weights=s_nb, minlength=len(perm))  # rounding: exact bytes per hop
    return {"hop_chunk": hop_chunk, "hop_link": hop_link, "hop_parent": hop_parent, "hop_first": first,
            "hop_last": last, "hop_arrival": last + 1 + lat_ep[hop_link], "slice_hop": s_hop, "slice_epoch": s_epoch,
            "slice_nbytes": s_nb}


def _list_schedule_seq(topology: Topology, routes: _Routes, chunk_nb: np.ndarray, order: np.ndarray,
                       tau: float, release: np.ndarray) -> dict[str, np.ndarray]:
    """Place chunks (in ``order``) hop by hop at the earliest epoch with free capacity after they
    arrive at the link's tail (are released, at a source), spilling into later epochs when a chunk
    does not fit in one."""
    cap = (topology.bandwidth * tau).tolist()
    eps = [x * 1e-9 for x in cap]
    lat_ep = np.rint(topology.latency / tau).astype(np.int64).tolist()
    used: list[list[float]] = [[] for _ in cap]
    first_free = [0] * len(cap)
    h_chunk: list[int] = []
    h_link: list[int] = []
    h_parent: list[int] = []
    h_first: list[int] = []
    h_last: list[int] = []
    h_arr: list[int] = []
    s_hop: list[int] = []
    s_epoch: list[int] = []
    s_nb: list[float] = []
    cat_l, cat_p, rs = routes.hop_link.tolist(), routes.hop_parent.tolist(), routes.start.tolist()
    nbl = chunk_nb.astype(np.float64).tolist()
    rel = release.tolist()
    for c in order.tolist():
        r = int(routes.of_chunk[c])
        hl, hp = cat_l[rs[r] : rs[r + 1]], cat_p[rs[r] : rs[r + 1]]
        base = len(h_chunk)
        arrival: list[int] = []
        nb = nbl[c]
        tol = max(1e-9 * nb, 1e-12)
        for i, e in enumerate(hl):
            p = hp[i]
            row, capv, ep = used[e], cap[e], eps[e]
            t = max(first_free[e], arrival[p] if p >= 0 else rel[c])
            first = -1
            left = nb
            while True:
                if t >= len(row):
                    row.extend([0.0] * max(t + 1 - len(row), len(row)))
                free = capv - row[t]
                if free > ep:
                    take = free if free < left else left
                    row[t] += take
                    left -= take
                    s_hop.append(base + i)
                    s_epoch.append(t)
                    s_nb.append(take)
                    if first < 0:
                        first = t
                    if left <= tol:
                        break
                t += 1
            ff = first_free[e]
            while ff < len(row) and capv - row[ff] <= ep:
                ff += 1
            first_free[e] = ff
            arr = t + 1 + lat_ep[e]
            arrival.append(arr)
            h_chunk.append(c)
            h_link.append(e)
            h_parent.append(base + p if p >= 0 else -1)
            h_first.append(first)
            h_last.append(t)
            h_arr.append(arr)
    i64 = (lambda x: np.asarray(x, dtype=np.int64))
    return {"hop_chunk": i64(h_chunk), "hop_link": i64(h_link), "hop_parent": i64(h_parent),
            "hop_first": i64(h_first), "hop_last": i64(h_last), "hop_arrival": i64(h_arr),
            "slice_hop": i64(s_hop), "slice_epoch": i64(s_epoch), "slice_nbytes": np.asarray(s_nb, dtype=np.float64)}


def _chunks(dem: Demands, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split every commodity into chunks: (commodity, byte offset, bytes, index within commodity)."""
    total = np.array([c.nbytes for c in dem.commodities], dtype=np.int64)
    n = np.maximum(1, -(-total // chunk_bytes))
    com = np.repeat(np.arange(len(total), dtype=np.int64), n)
    idx = np.arange(len(com), dtype=np.int64) - np.repeat(_excl_cumsum(n), n)
    off = idx * chunk_bytes
    return com, off, np.minimum(chunk_bytes, total[com] - off), idx


def _spread(counts: list[int]) -> list[int]:
    """Interleave option indices in proportion to their counts: [2, 1] -> [0, 1, 0]."""
    keys = [((i + 0.5) / c, o) for o, c in enumerate(counts) for i in range(c)]
    keys.sort()
    return [o for _, o in keys]


def _largest_remainder(weights: np.ndarray, n: int) -> list[int]:
    w = np.maximum(np.asarray(weights, dtype=np.float64), 0)
    if n <= 0:
        return [0] * len(w)
    if w.sum() <= 0:
        w = np.ones(len(w))
    q = w / w.sum() * n
    base = np.floor(q).astype(np.int64)
    rest = n - int(base.sum())
    if rest > 0:
        base[np.argsort(-(q - base), kind="stable")[:rest]] += 1
    return base.tolist()


# -- solvers ----------------------------------------------------------------------------------

def _static_lp(topology: Topology, dem: Demands, opts: list[list[_Option]], time_limit: float) -> np.ndarray | None:
    """Fluid LP: min T s.t. every link's bytes / bandwidth <= T; every (commodity, destination) covered.

    Returns the fraction of each commodity sent on each option (flattened), or None.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    flat = [o for os_ in opts for o in os_]
    nv = len(flat) + 1
    rows, cols, vals = [], [], []
    bw = topology.bandwidth
    cost = np.zeros(nv)
    cost[-1] = 1.0
    total = sum(c.nbytes / bw.max() for c in dem.commodities) or 1.0
    cov_row: dict[tuple[int, str], int] = {}
    nl = len(bw)
    for j, o in enumerate(flat):
        v = dem.commodities[o.commodity].nbytes
        rows.extend(o.links.tolist())
        cols.extend([j] * len(o.links))
        vals.extend((v / bw[o.links]).tolist())
        cost[j] = 1e-3 * float((v / bw[o.links]).sum()) / total
        for d in o.paths:
            r = cov_row.setdefault((o.commodity, d), nl + len(cov_row))
            rows.append(r)
            cols.append(j)
            vals.append(-1.0)
    rows.extend(range(nl))
    cols.extend([nv - 1] * nl)
    vals.extend([-1.0] * nl)
    nr = nl + len(cov_row)
    a = coo_matrix((vals, (rows, cols)), shape=(nr, nv)).tocsr()
    b = np.concatenate([np.zeros(nl), -np.ones(len(cov_row))])
    bounds = [(0, 1)] * (nv - 1) + [(0, None)]
    res = linprog(cost, A_ub=a, b_ub=b, bounds=bounds, method="highs",
                  options={"time_limit": max(time_limit, 0.01), "presolve": True})
    if res.status != 0 or res.x is None:
        log.info("fluid LP did not solve (%s)", res.message)
        return None
    log.info("fluid LP: %d options, T = %.4f s", nv - 1, res.x[-1])
    return res.x[:-1]


def _assign_lp(dem: Demands, opts: list[list[_Option]], frac: np.ndarray, chunk_com: np.ndarray,
               chunk_idx: np.ndarray, topology: Topology) -> _Routes:
    """Round LP fractions to a route per chunk (a forest from one or several sources)."""
    of_chunk = np.zeros(len(chunk_com), dtype=np.int64)
    forests: list[tuple[np.ndarray, np.ndarray]] = []
    counts = np.bincount(chunk_com, minlength=len(dem.commodities))
    starts = np.concatenate([[0], np.cumsum(counts)])
    pos = 0
    cache: dict[tuple[int, ...], int] = {}
    for k, com in enumerate(dem.commodities):
        os_ = opts[k]
        f = frac[pos : pos + len(os_)]
        pos += len(os_)
        c0, n = int(starts[k]), int(counts[k])
        full = [i for i, o in enumerate(os_) if len(o.paths) == len(com.dests)]
        ft = float(sum(f[i] for i in full))
        m_full = min(n, int(round(min(ft, 1.0) * n))) if len(com.dests) > 1 else n
        seq_full = _spread(_largest_remainder(f[full], m_full)) if m_full else []
        rest = n - m_full
        per_dest: dict[str, list[int]] = {}
        if rest:
            for d in com.dests:
                cand = [i for i, o in enumerate(os_) if d in o.paths and i not in full]
                w = np.array([f[i] for i in cand])
                if not cand or w.sum() <= 1e-12:
                    cand = [i for i in full] or cand
                    w = np.array([f[i] for i in cand])
                per_dest[d] = [cand[j] for j in _spread(_largest_remainder(w, rest))]
        for j in range(n):
            if j < m_full:
                key: tuple[int, ...] = (full[seq_full[j]],)
            else:
                key = tuple(per_dest[d][j - m_full] for d in com.dests)
            hit = cache.get((k, *key))
            if hit is None:
                if len(key) == 1:
                    hl, hp = os_[key[0]].hop_link, os_[key[0]].hop_parent
                else:
                    hl, hp, _ = _merge(topology, [os_[i].paths[d] for i, d in zip(key, com.dests)])
                hit = cache[(k, *key)] = len(forests)
                forests.append((hl, hp))
            of_chunk[c0 + j] = hit
    return _Routes.of(forests, of_chunk)


def _greedy_choices(dem: Demands, opts: list[list[_Option]], topology: Topology,
                    ref: float) -> list[list[_Option]]:
    """Per commodity, one route per candidate source: destinations with a candidate source on their
    own host take it (the nearest one), the others the source's shortest-path tree."""
    out: list[list[_Option]] = []
    for k, com in enumerate(dem.commodities):
        trees = [o for o in opts[k] if len(o.paths) == len(com.dests)]
        local: dict[str, tuple[str, ...]] = {}
        for d in com.dests:
            h = topology.host_of(d)
            near = [(topology.shortest_paths(s, ref)[0][d], s) for s in com.sources
                    if h is not None and topology.host_of(s) == h]
            if near:
                local[d] = tuple(topology.shortest_paths(min(near)[1], ref)[1][d])
        if not local or len(com.sources) == 1:
            out.append(trees)
            continue
        rest = [d for d in com.dests if d not in local]
        choices = []
        for o in trees if rest else trees[:1]:
            paths = {**{d: o.paths[d] for d in rest}, **local}
            hl, hp, dh = _merge(topology, [paths[d] for d in com.dests])
            choices.append(_Option(k, o.source, paths, np.unique(hl), hl, hp, dh))
        out.append(choices)
    return out


def _greedy_routes(dem: Demands, net: _Net) -> tuple[_Routes, np.ndarray]:
    """Per commodity, one route per candidate source (commodity k's are ``cand[k]:cand[k + 1]``):
    destinations with a candidate source on their own host take the nearest one, the others the
    source's shortest-path tree (one route when every destination has a local source).

    Built for all commodities at once (the bulk form of :func:`_greedy_choices` over trees)."""
    coms = dem.commodities
    nk = len(coms)
    smax, dmax = max(len(c.sources) for c in coms), max(len(c.dests) for c in coms)
    srcs = np.full((nk, smax), -1, dtype=np.int64)
    dsts = np.full((nk, dmax), -1, dtype=np.int64)
    for k, c in enumerate(coms):
        srcs[k, : len(c.sources)] = [net.idx[x] for x in c.sources]
        dsts[k, : len(c.dests)] = [net.idx[x] for x in c.dests]
    n_src = (srcs >= 0).sum(1)
    hs = np.where(srcs >= 0, net.host[srcs], -2)
    hd = np.where(dsts >= 0, net.host[dsts], -3)
    same = (hs[:, None, :] == hd[:, :, None]) & (hd[:, :, None] >= 0)
    near = np.where(same, net.dist[srcs[:, None, :], dsts[:, :, None]], np.inf).argmin(2)  # first by name on ties
    local = same.any(2)
    loc = srcs[np.arange(nk)[:, None], near]
    n_routes = np.where((local | (dsts < 0)).all(1) & (n_src > 1), 1, n_src)
    rk = np.repeat(np.arange(nk), n_routes)
    rj = np.arange(len(rk)) - np.repeat(_excl_cumsum(n_routes), n_routes)
    e_src = np.where(local[rk], loc[rk], srcs[rk, rj][:, None]).reshape(-1)
    e_dst = dsts[rk].reshape(-1)
    e_route = np.repeat(np.arange(len(rk)), dmax)
    keep = e_dst >= 0
    return (_forests(net, e_route[keep], e_src[keep], e_dst[keep], len(rk)),
            np.concatenate([[0], np.cumsum(n_routes)]))


def _assign_greedy(routes: _Routes, cand: np.ndarray, chunk_com: np.ndarray, chunk_nb: np.ndarray,
                   chunk_key: np.ndarray, order: np.ndarray, topology: Topology) -> _Routes:
    """Per chunk (in priority ``order``), the candidate route with the lowest resulting
    ``max_e (load_e + chunk) / bandwidth_e``.

    Commodities with one route load their links in proportion to their progress (``chunk_key``,
    as in the fluid schedule), so only the chunks that have a choice are visited one by one.
    """
    nl = len(topology.bandwidth)
    n_cand = np.diff(cand)
    r_com = np.repeat(np.arange(len(n_cand)), n_cand)
    hop_route = np.repeat(np.arange(len(r_com)), np.diff(routes.start))
    com_bytes = np.bincount(chunk_com, weights=chunk_nb, minlength=len(n_cand))
    fixed = np.bincount(routes.hop_link, weights=np.where(n_cand[r_com[hop_route]] == 1,
                                                          com_bytes[r_com[hop_route]], 0.0), minlength=nl + 1)
    pick = cand[:-1][chunk_com]
    multi = order[n_cand[chunk_com[order]] > 1]
    if len(multi):
        n_hops = np.diff(routes.start)
        padded = np.full((len(r_com), int(n_hops.max())), nl, dtype=np.int64)  # link nl: none (no load, no limit)
        padded[hop_route, np.arange(len(hop_route)) - routes.start[hop_route]] = routes.hop_link
        inv_bw = np.append(1.0 / topology.bandwidth, 0.0)
        load = np.zeros(nl + 1)
        coms, nbs, keys = chunk_com[multi].tolist(), chunk_nb[multi].tolist(), chunk_key[multi].tolist()
        cl = cand.tolist()
        per_com: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for c, k, b, x in zip(multi.tolist(), coms, nbs, keys):
            got = per_com.get(k)
            if got is None:
                rows = padded[cl[k] : cl[k + 1]]
                got = per_com[k] = (rows, fixed[rows], inv_bw[rows])
            rows, fix, inv = got
            j = int((((fix * x + load[rows]) + b) * inv).max(1).argmin())
            load[rows[j]] += b  # a route's links are distinct (padding: link nl, never read)
            pick[c] += j
    return dataclasses.replace(routes, of_chunk=pick)


_Offsets = list[list[tuple[np.ndarray, dict[str, int]]]]  # per commodity, per option: hop offsets, arrivals


def _te_setup(topology: Topology, opts: list[list[_Option]],
              chunk_bytes: int) -> tuple[float, np.ndarray, np.ndarray, _Offsets]:
    """Epoch length, per-link capacity (chunks per epoch), latency (epochs) and every option's hop offsets.

    Epoch: the time the slowest used link needs for one chunk; capacity floor(bandwidth * tau /
    chunk); a hop takes one epoch plus its latency in epochs (store-and-forward).
    """
    used = np.unique(np.concatenate([o.links for os_ in opts for o in os_]))
    bw = topology.bandwidth
    tau = chunk_bytes / float(bw[used].min())
    cap = np.floor(bw * tau / chunk_bytes + 1e-9)
    lat_ep = np.rint(topology.latency / tau).astype(np.int64)
    offs = []
    for os_ in opts:
        row = []
        for o in os_:
            off = np.zeros(len(o.hop_link), dtype=np.int64)
            for i, p in enumerate(o.hop_parent):
                off[i] = 0 if p < 0 else off[p] + 1 + lat_ep[o.hop_link[p]]
            arr = {d: int(off[h] + 1 + lat_ep[o.hop_link[h]]) for d, h in o.dest_hop.items()}
            row.append((off, arr))
        offs.append(row)
    return tau, cap, lat_ep, offs


def _te_solve(opts: list[list[_Option]], offs: _Offsets, cap: np.ndarray,
              resv: np.ndarray, t0: int, t1: int, need: dict[tuple[int, str], int], exact: bool,
              time_limit: float) -> list[tuple[int, int, int, int]] | None:
    """One MILP over start epochs [t0, t1): x[k, option, t] chunks; capacity minus reservations ``resv``.

    ``exact``: every (commodity, destination) gets exactly ``need`` chunks (single shot, objective
    the sum of delivery epochs); otherwise at most ``need`` (a round: deliver as much as possible,
    early first). Returns (commodity, option, epoch, count) or None.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    nl, horizon = resv.shape
    var: list[tuple[int, int, int]] = []
    rows, cols, vals, cost = [], [], [], []
    cov: dict[tuple[int, str], int] = {}
    big = 10.0 * horizon
    for k, os_ in enumerate(opts):
        for oi, o in enumerate(os_):
            if any(need.get((k, d), 0) <= 0 for d in o.paths):
                continue
            off, arr = offs[k][oi]
            last = max(arr.values())
            for t in range(t0, min(t1, horizon - last)):
                j = len(var)
                var.append((k, oi, t))
                rows.extend((o.hop_link * horizon + t + off).tolist())
                cols.extend([j] * len(off))
                vals.extend([1.0] * len(off))
                cost.append(sum(t + a - (0 if exact else big) for a in arr.values()) + 1e-3 * len(off))
                for d in o.paths:
                    r = cov.setdefault((k, d), nl * horizon + len(cov))
                    rows.append(r)
                    cols.append(j)
                    vals.append(1.0)
    if not var or len(var) > _MILP_MAX_VARS:
        log.info("MILP round skipped: %d variables (limit %d)", len(var), _MILP_MAX_VARS)
        return None
    nr = nl * horizon + len(cov)
    a = coo_matrix((vals, (rows, cols)), shape=(nr, len(var))).tocsr()
    want = np.array([float(need[kd]) for kd in cov])
    ub = np.concatenate([np.maximum(np.repeat(cap, horizon) - resv.reshape(-1), 0), want])
    lb = np.concatenate([np.zeros(nl * horizon), want if exact else np.zeros(len(cov))])
    keep = np.flatnonzero(a.getnnz(axis=1))  # rows no variable touches
    ub_x = np.array([float(min(need[(k, d)] for d in opts[k][oi].paths)) for k, oi, _ in var])
    res = milp(np.asarray(cost), constraints=LinearConstraint(a[keep], lb[keep], ub[keep]),
               integrality=np.ones(len(var)), bounds=Bounds(0, ub_x),
               options={"time_limit": max(time_limit, 0.01), "mip_rel_gap": 1e-4})
    if res.x is None:
        log.info("MILP found no solution (%s)", res.message)
        return None
    x = np.rint(res.x).astype(np.int64)
    log.info("MILP epochs [%d, %d): %d variables, %d rows, status %s", t0, t1, len(var), len(keep), res.status)
    return [(*var[j], int(x[j])) for j in np.flatnonzero(x)]


def _te_extract(dem: Demands, opts: list[list[_Option]], offs: _Offsets,
                lat_ep: np.ndarray, sends: list[tuple[int, int, int, int]], chunk_com: np.ndarray,
                chunk_nb: np.ndarray) -> dict[str, Any]:
    """Chunk-level hops from (commodity, option, epoch, count) sends.

    Chunk i of commodity k, destination d, takes the i-th send instance covering d: full-coverage
    instances first in one canonical order, so a multicast instance serves the same chunk everywhere.
    """
    n_k = np.bincount(chunk_com, minlength=len(dem.commodities))
    inst: dict[int, list[tuple[int, int, int]]] = {}
    for k, oi, t, cnt in sends:
        for m in range(cnt):
            inst.setdefault(k, []).append((oi, t, m))
    chunk_first = np.concatenate([[0], np.cumsum(n_k)[:-1]])
    H: dict[str, list[int]] = {kk: [] for kk in ("chunk", "link", "parent", "first", "last", "arrival")}
    S: dict[str, list[Any]] = {"hop": [], "epoch": [], "nbytes": []}
    for k, com in enumerate(dem.commodities):
        os_ = opts[k]
        full = sorted(i for i in inst.get(k, []) if len(os_[i[0]].paths) == len(com.dests))
        part = sorted((i for i in inst.get(k, []) if len(os_[i[0]].paths) < len(com.dests)), key=lambda i: i[1])
        lists = {d: full + [i for i in part if d in os_[i[0]].paths] for d in com.dests}
        for ci in range(int(n_k[k])):
            c = int(chunk_first[k]) + ci
            seen: dict[tuple[int, int, int, int], int] = {}
            for d in com.dests:
                oi, t, m = lists[d][ci]
                o = os_[oi]
                off, _ = offs[k][oi]
                h = o.dest_hop[d]
                chain = []
                while h >= 0:
                    chain.append(h)
                    h = int(o.hop_parent[h])
                parent = -1
                for h in reversed(chain):
                    key = (oi, t, m, h)
                    if key not in seen:
                        e = int(o.hop_link[h])
                        ep = t + int(off[h])
                        seen[key] = len(H["chunk"])
                        H["chunk"].append(c)
                        H["link"].append(e)
                        H["parent"].append(parent)
                        H["first"].append(ep)
                        H["last"].append(ep)
                        H["arrival"].append(ep + 1 + int(lat_ep[e]))
                        S["hop"].append(seen[key])
                        S["epoch"].append(ep)
                        S["nbytes"].append(float(chunk_nb[c]))
                    parent = seen[key]
    out: dict[str, Any] = {f"hop_{kk}": np.asarray(v, dtype=np.int64) for kk, v in H.items()}
    out["slice_hop"] = np.asarray(S["hop"], dtype=np.int64)
    out["slice_epoch"] = np.asarray(S["epoch"], dtype=np.int64)
    out["slice_nbytes"] = np.asarray(S["nbytes"], dtype=np.float64)
    return out


def _milp(topology: Topology, dem: Demands, opts: list[list[_Option]], chunk_com: np.ndarray,
          chunk_nb: np.ndarray, chunk_bytes: int, horizon_s: float, deadline: float,
          window: int = 6) -> dict[str, Any] | None:
    """Time-expanded MILP over route options (TE-CCL with copy): x[k, option, t] integer chunks
    leaving in epoch t. Small instances in one shot (objective: sum of delivery epochs); larger
    ones in rounds of ``window`` epochs, each delivering as much as it can, the links its chunks
    will still use in later epochs reserved (the buffers carried forward)."""
    tau, cap, lat_ep, offs = _te_setup(topology, opts, chunk_bytes)
    n_k = np.bincount(chunk_com, minlength=len(dem.commodities))
    need = {(k, d): int(n_k[k]) for k, c in enumerate(dem.commodities) for d in c.dests}
    max_arr = max(max(a.values()) for row in offs for _, a in row)
    horizon = int(math.ceil(horizon_s / tau)) + max_arr + 1
    n_opts = sum(len(os_) for os_ in opts)
    sends: list[tuple[int, int, int, int]] | None
    if n_opts * horizon <= _MILP_MAX_VARS:
        resv = np.zeros((len(cap), horizon))
        sends = _te_solve(opts, offs, cap, resv, 0, horizon, need, True, deadline - time.perf_counter())
    elif n_opts * window <= _MILP_MAX_VARS and n_opts * horizon <= _MILP_ROUNDS_MAX:
        resv = np.zeros((len(cap), horizon))
        sends = []
        t0 = 0
        while any(v > 0 for v in need.values()):
            if time.perf_counter() >= deadline or t0 + max_arr >= horizon:
                log.info("MILP rounds stopped at epoch %d with %d chunk deliveries left", t0, sum(need.values()))
                return None
            got = _te_solve(opts, offs, cap, resv, t0, t0 + window, need, False, deadline - time.perf_counter())
            for k, oi, t, cnt in got or []:
                o = opts[k][oi]
                off, _ = offs[k][oi]
                np.add.at(resv, (o.hop_link, t + off), cnt)
                for d in o.paths:
                    need[(k, d)] -= cnt
            sends.extend(got or [])
            t0 += window
    else:
        log.info("MILP skipped: %d options x %d epochs", n_opts, horizon)
        return None
    if sends is None:
        return None
    out = _te_extract(dem, opts, offs, lat_ep, sends, chunk_com, chunk_nb)
    out["tau"] = tau
    return out


# -- public entry point -------------------------------------------------------------------------

def schedule(plan: Plan | Demands, topology: Topology, *, method: str = "auto", time_limit: float = 10.0,
             chunk_bytes: int | None = None, epochs: int = _TARGET_EPOCHS,
             dem: Demands | None = None) -> Schedule:
    """Schedule a plan's transfers (or bare :class:`Demands`) over ``topology``.

    Returns within about ``time_limit`` seconds: the greedy schedule is built first, the
    solvers get what time remains. ``method="auto"`` keeps the greedy schedule when it is
    within 3 % of the lower bound and otherwise tries the LP, then the MILP, for no longer than
    they could save (the greedy completion minus the lower bound), and only when that budget
    is at least twice what the greedy schedule took (the LP costs more): it never solves for
    seconds to shorten a transfer by milliseconds. ``chunk_bytes``: size pieces are split into (default:
    total bytes / 2000 as a power of two, at least 4 KiB; fewer chunks under a limit below
    0.5 s). ``epochs``: target number of epochs of the list-scheduled methods. ``dem``:
    demands computed before by :func:`demands`.
    """
    if isinstance(plan, Demands):
        dem, plan = plan, None
    if method not in METHODS:
        raise PlanError(f"unknown schedule method {method!r}: use one of {', '.join(METHODS)}")
    if time_limit <= 0:
        raise PlanError(f"time_limit must be positive, got {time_limit}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    if dem is None:
        assert plan is not None
        dem = demands(plan, topology)
    return _schedule_demands(plan, topology, dem, method, t0, deadline, chunk_bytes, epochs)


def _schedule_demands(plan: Plan | None, topology: Topology, dem: Demands, method: str, t0: float,
                      deadline: float, chunk_bytes: int | None, epochs: int) -> Schedule:
    total = dem.bytes_unique
    if chunk_bytes is None:  # fewer chunks when the time limit is short (list scheduling is ~50 us a chunk)
        target = min(_TARGET_CHUNKS, max(200, int((deadline - time.perf_counter()) * 4000)))
        chunk_bytes = max(4096, 1 << max(0, math.ceil(math.log2(max(total, 1) / target))))
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    n_chunks = sum(max(1, -(-c.nbytes // chunk_bytes)) for c in dem.commodities)
    if n_chunks > _MAX_CHUNKS:
        new = 1 << math.ceil(math.log2(total / _MAX_CHUNKS + 1))
        log.warning("chunk_bytes=%d gives %d chunks (> %d); using %d", chunk_bytes, n_chunks, _MAX_CHUNKS, new)
        chunk_bytes = new
    chunk_com, chunk_off, chunk_nb, chunk_idx = _chunks(dem, chunk_bytes)
    empty = np.zeros(0, dtype=np.int64)
    if not len(chunk_com):
        cols = {f"hop_{k}": empty for k in ("chunk", "link", "parent", "first", "last", "arrival")}
        return Schedule(plan, topology, dem, method, 1.0, chunk_bytes, empty, empty, empty, **cols,
                        slice_hop=empty, slice_epoch=empty, slice_nbytes=np.zeros(0),
                        solve_seconds=time.perf_counter() - t0, info={"lower_bound_s": 0.0})
    ref = float(chunk_bytes)
    small = len(dem.commodities) * max(len(c.sources) for c in dem.commodities) <= 64
    opts: list[list[_Option]] | None = None
    if small:  # greedy may also take a second, link-avoiding path
        opts = _options(topology, dem, ref, alt=True)
        choices = _greedy_choices(dem, opts, topology, ref)
        cands = _Routes.of([(o.hop_link, o.hop_parent) for cs in choices for o in cs], np.zeros(0, dtype=np.int64))
        cand = np.concatenate([[0], np.cumsum([len(cs) for cs in choices])])
    else:
        cands, cand = _greedy_routes(dem, _net(topology, ref))
    lb = lower_bound(dem, topology)
    # order: every commodity spread evenly over time (fluid rates), ties by commodity
    key = (chunk_idx + 0.5) / np.bincount(chunk_com)[chunk_com]
    order = np.lexsort((chunk_com, key))
    # release: chunk j of n leaves its source no earlier than j / n of the way through a slightly
    # faster-than-bound fluid schedule, so queues at shared links fill in priority order, not per source
    release = np.floor(chunk_idx / np.bincount(chunk_com)[chunk_com] * _PACE * epochs).astype(np.int64)
    candidates: list[tuple[float, str, dict[str, Any], float]] = []
    tau = max(lb, 1e-9) / max(epochs, 1)

    def finish(name: str, arrays: dict[str, Any], tau_: float) -> None:
        s = Schedule(plan, topology, dem, name, tau_, chunk_bytes, chunk_com, chunk_off, chunk_nb,
                     **{k: v for k, v in arrays.items() if k != "tau"})
        candidates.append((simulate(s), name, arrays, tau_))

    # greedy: always (the fallback)
    routes = _assign_greedy(cands, cand, chunk_com, chunk_nb, key, order, topology)
    finish("greedy", _list_schedule(topology, routes, chunk_nb, order, tau, release), tau)
    lp_t = None
    done = method == "auto" and candidates[0][0] <= _GOOD_ENOUGH * lb  # auto: stop improving
    if method == "auto":  # never spend longer improving a schedule than the improvement could save
        now = time.perf_counter()
        deadline = min(deadline, now + max(candidates[0][0] - lb, 0.0))
        # the LP takes 3 to 6 times as long as the greedy schedule (benchmark): a budget below
        # twice the time spent so far would be spent without a result
        done = done or deadline - now < 2 * (now - t0)
    if method in ("auto", "lp", "milp") and not done and time.perf_counter() < deadline:
        if opts is None:
            opts = _options(topology, dem, ref, alt=False)
        frac = _static_lp(topology, dem, opts, deadline - time.perf_counter())
        if frac is not None and time.perf_counter() < deadline:
            routes = _assign_lp(dem, opts, frac, chunk_com, chunk_idx, topology)
            arr = _list_schedule(topology, routes, chunk_nb, order, tau, release)
            if time.perf_counter() < deadline:
                finish("lp", arr, tau)
                lp_t = candidates[-1][0]
    done = done or (method == "auto" and lp_t is not None and lp_t <= _GOOD_ENOUGH * lb)
    if method in ("auto", "milp") and not done and time.perf_counter() < deadline:
        horizon = 1.5 * min(c[0] for c in candidates)
        arr = _milp(topology, dem, opts, chunk_com, chunk_nb, chunk_bytes, horizon, deadline)
        if arr is not None:
            finish("milp", arr, float(arr["tau"]))
    if method != "auto":
        wanted = [c for c in candidates if c[1] == method]
        pick = wanted[0] if wanted else min(candidates, key=lambda c: c[0])
        if not wanted:
            log.warning("method %s gave no schedule in time; falling back to %s", method, pick[1])
    else:
        pick = min(candidates, key=lambda c: (c[0], -len(c[1])))
    comp, name, arrays, tau_ = pick
    info = {"lower_bound_s": lb, "candidates": {c[1]: c[0] for c in candidates}}
    if lp_t is not None:
        info["lp_s"] = lp_t
    s = Schedule(plan, topology, dem, name, tau_, chunk_bytes, chunk_com, chunk_off, chunk_nb,
                 **{k: v for k, v in arrays.items() if k != "tau"}, solve_seconds=time.perf_counter() - t0,
                 info=info)
    log.info("scheduled %d chunks with %s in %.3fs: %.4fs (lower bound %.4fs)", len(chunk_com), name,
             s.solve_seconds, comp, lb)
    return s


@functools.lru_cache(maxsize=16)
def _min_latency(topology: Topology) -> np.ndarray:
    """(nodes, nodes) smallest latency of any path (inf: unreachable), in graph node order."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    nn = len(topology.node_names)
    # csgraph drops zero weights (no edge): zero-latency links get a weight far below any real one
    w = np.maximum(topology.latency, 1e-30)
    dist = dijkstra(csr_matrix((w, (topology.link_src, topology.link_dst)), shape=(nn, nn)), directed=True)
    return np.where(dist < 1e-20, 0.0, dist)


def _path_latency(topology: Topology, src: np.ndarray, dst: np.ndarray) -> float:
    """Longest latency of any destination's nearest source (a schedule cannot beat it).

    ``src``, ``dst``: (commodities, nodes) masks in graph node order."""
    lat = _min_latency(topology)
    keys = _dot(np.random.default_rng(3).random(src.shape[1]), src.T)  # one key per source set
    uk, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    near = np.stack([lat[src[i]].min(0) for i in first.tolist()])[inv.reshape(-1)]  # (commodities, nodes)
    near = np.where(dst & np.isfinite(near), near, 0.0)
    return float(near.max(initial=0.0))


# -- evaluation -------------------------------------------------------------------------------

def simulate(s: Schedule) -> float:
    """Seconds until the last chunk reaches its last destination when every link sends its chunks
    in the schedule's order (by starting epoch, then hop index), each as soon as it has arrived
    and the link is free.

    Vectorised over the links of one level of the link graph (see :func:`_link_levels`); chunk
    by chunk when that graph has a cycle.
    """
    if not len(s.hop_chunk):
        return 0.0
    bw, lat = s.topology.bandwidth, s.topology.latency
    inner = s.hop_parent >= 0
    lev = _link_levels(s.hop_link[s.hop_parent[inner]], s.hop_link[inner], len(bw))
    if lev is None:
        return _simulate_seq(s)
    rank = np.empty(len(s.hop_first), dtype=np.int64)
    rank[np.lexsort((np.arange(len(s.hop_first)), s.hop_first))] = np.arange(len(s.hop_first))
    dur = s.chunk_nbytes[s.hop_chunk] / bw[s.hop_link]
    done = np.zeros(len(s.hop_chunk))
    for idx in _by_level(lev[s.hop_link]):
        idx = idx[np.lexsort((rank[idx], s.hop_link[idx]))]
        p = s.hop_parent[idx]
        ready = np.where(p >= 0, done[p], 0.0)
        done[idx] = _fifo(s.hop_link[idx], ready, dur[idx]) + lat[s.hop_link[idx]]
    return float(done.max())


def _simulate_seq(s: Schedule) -> float:
    """:func:`simulate`, one hop at a time (any link graph)."""
    bw, lat = s.topology.bandwidth, s.topology.latency
    order = np.lexsort((np.arange(len(s.hop_first)), s.hop_first))
    freel = [0.0] * len(bw)
    readyl = [0.0] * len(s.hop_chunk)
    nbl = s.chunk_nbytes[s.hop_chunk].astype(np.float64).tolist()
    hop_link, hop_parent = s.hop_link.tolist(), s.hop_parent.tolist()
    bwl, latl = bw.tolist(), lat.tolist()
    end = 0.0
    for h in order.tolist():
        e = hop_link[h]
        p = hop_parent[h]
        start = max(freel[e], readyl[p] if p >= 0 else 0.0)
        fin = start + nbl[h] / bwl[e]
        freel[e] = fin
        readyl[h] = fin + latl[e]
        if readyl[h] > end:
            end = readyl[h]
    return end


def validate(s: Schedule) -> None:
    """Raise PlanError unless: per (link, epoch) bytes <= bandwidth * tau; a hop starts only after
    its chunk arrived at the link's tail; every chunk reaches every destination of its commodity."""
    topo, d = s.topology, s.demands
    cap = topo.bandwidth * s.tau
    if len(s.slice_hop):
        key = s.hop_link[s.slice_hop] * (int(s.slice_epoch.max()) + 1) + s.slice_epoch
        uk, inv = np.unique(key, return_inverse=True)
        sums = np.bincount(inv.reshape(-1), weights=s.slice_nbytes)
        links = uk // (int(s.slice_epoch.max()) + 1)
        bad = np.flatnonzero(sums > cap[links] * (1 + 1e-6) + 1e-6)
        if len(bad):
            i = bad[0]
            raise PlanError(f"link {topo.links[links[i]].src}->{topo.links[links[i]].dst} carries {sums[i]:.0f} B in "
                            f"epoch {uk[i] % (int(s.slice_epoch.max()) + 1)} > capacity {cap[links[i]]:.0f} B")
        per_hop = np.bincount(s.slice_hop, weights=s.slice_nbytes, minlength=len(s.hop_chunk))
        want = s.chunk_nbytes[s.hop_chunk]
        if not np.allclose(per_hop, want, rtol=1e-6, atol=1e-6):
            h = int(np.flatnonzero(~np.isclose(per_hop, want, rtol=1e-6, atol=1e-6))[0])
            raise PlanError(f"hop {h} sends {per_hop[h]:.0f} B of a {want[h]} B chunk")
        if np.any(s.slice_epoch < s.hop_first[s.slice_hop]) or np.any(s.slice_epoch > s.hop_last[s.slice_hop]):
            raise PlanError("a slice lies outside its hop's epochs")
    for h in range(len(s.hop_chunk)):
        p = int(s.hop_parent[h])
        lk = topo.links[int(s.hop_link[h])]
        com = d.commodities[int(s.chunk_commodity[int(s.hop_chunk[h])])]
        if p < 0:
            if lk.src not in com.sources:
                raise PlanError(f"hop {h} leaves {lk.src}, which does not hold the chunk (sources {com.sources})")
        else:
            if int(s.hop_chunk[p]) != int(s.hop_chunk[h]) or topo.links[int(s.hop_link[p])].dst != lk.src:
                raise PlanError(f"hop {h} does not continue its parent hop {p}")
            if s.hop_first[h] < s.hop_arrival[p]:
                raise PlanError(f"hop {h} leaves {lk.src} in epoch {s.hop_first[h]} before the chunk arrives "
                                f"(epoch {s.hop_arrival[p]})")
    reached: dict[int, set[str]] = {}
    for h in range(len(s.hop_chunk)):
        reached.setdefault(int(s.hop_chunk[h]), set()).add(topo.links[int(s.hop_link[h])].dst)
    for c in range(len(s.chunk_commodity)):
        com = d.commodities[int(s.chunk_commodity[c])]
        missing = set(com.dests) - reached.get(c, set())
        if missing:
            raise PlanError(f"chunk {c} never reaches {sorted(missing)}")


def _dot(w: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``w @ mask`` (weights of the rows set per column) with einsum: these products are tiny, and a
    multithreaded BLAS on a busy machine makes them milliseconds instead of microseconds."""
    return np.einsum("k,ku->u", w, mask.astype(np.float64))


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class _Cuts:
    """The node sets :func:`lower_bound` checks and the bandwidth into and out of each."""

    idx: dict[str, int]
    node_host: np.ndarray  # host column per node (the last column: no host)
    onehot: np.ndarray  # (nodes, hosts + 1)
    single: np.ndarray  # GPU and storage nodes
    single_in: np.ndarray
    single_out: np.ndarray
    unions: np.ndarray  # (unions, hosts + 1) bool
    union_in: np.ndarray
    union_out: np.ndarray


@functools.lru_cache(maxsize=16)
def _cuts(topology: Topology) -> _Cuts:
    """:class:`_Cuts` of ``topology`` (cached: schedules reuse topologies)."""
    import itertools

    nodes, idx = list(topology.node_names), topology.node_index
    bw = topology.bandwidth
    l_src, l_dst = topology.link_src, topology.link_dst
    single = np.array([idx[n] for n, kind in topology.graph.nodes(data="kind") if kind in ("gpu", "storage")],
                      dtype=np.int64)
    single_in = np.array([bw[(l_dst == j) & (l_src != j)].sum() for j in single])
    single_out = np.array([bw[(l_src == j) & (l_dst != j)].sum() for j in single])
    hosts = sorted({h for _, h in topology.graph.nodes(data="host") if h is not None})
    hpos = {h: i for i, h in enumerate(hosts)}
    node_host = np.array([hpos.get(topology.host_of(n), len(hosts)) if topology.host_of(n) is not None
                          else len(hosts) for n in nodes], dtype=np.int64)
    onehot = np.zeros((len(nodes), len(hosts) + 1), dtype=np.float64)
    onehot[np.arange(len(nodes)), node_host] = 1.0
    if len(hosts) <= 10:
        sizes = range(1, len(hosts) + (len(hosts) == 1))  # a proper union (the whole cluster has no cut)
        combos = [c for r in sizes for c in itertools.combinations(range(len(hosts)), r)]
    else:
        combos = [(a,) for a in range(len(hosts))] + list(itertools.combinations(range(len(hosts)), 2))
    u = np.zeros((len(combos), len(hosts) + 1), dtype=bool)
    for i, cmb in enumerate(combos):
        u[i, list(cmb)] = True
    lin = u[:, node_host[l_dst]] & ~u[:, node_host[l_src]]
    lout = u[:, node_host[l_src]] & ~u[:, node_host[l_dst]]
    return _Cuts(idx, node_host, onehot, single, single_in, single_out, u,
                 lin.astype(np.float64) @ bw, lout.astype(np.float64) @ bw)


def lower_bound(dem: Demands, topology: Topology) -> float:
    """Seconds no schedule can beat: the largest of a cut bound and a latency bound.

    Cut bound: for each GPU, storage, and every union of hosts (all unions up to 10 hosts, else
    single hosts and pairs), the bytes that must cross into (out of) the node set divided by
    the bandwidth of the links entering (leaving) it. A piece counts once per cut (multicast)
    and only when no candidate source (any live replica) is inside (for ingress) or some is
    outside (for egress), so the best choice of sources is assumed. Latency bound: the largest,
    over destinations, of the latency from the nearest source.
    """
    if not dem.commodities:
        return 0.0
    cut = _cuts(topology)
    nn = len(cut.node_host)
    # node sets (sources or destinations) are shared by many commodities: masks per distinct set
    set_id: dict[tuple[str, ...], int] = {}
    ps = np.array([set_id.setdefault(c.sources, len(set_id)) for c in dem.commodities], dtype=np.int64)
    pd = np.array([set_id.setdefault(c.dests, len(set_id)) for c in dem.commodities], dtype=np.int64)
    sets = np.zeros((len(set_id), nn), dtype=bool)
    for names, j in set_id.items():
        sets[j, [cut.idx[x] for x in names]] = True
    nb = np.array([c.nbytes for c in dem.commodities], dtype=np.float64)
    src, dst = sets[ps], sets[pd]  # (commodities, nodes)
    best = 0.0

    def worst(inn: np.ndarray, out: np.ndarray, bw_in: np.ndarray, bw_out: np.ndarray) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(inn > 0, inn / bw_in, 0.0)
            b = np.where(out > 0, out / bw_out, 0.0)
        return float(max(a.max(initial=0.0), b.max(initial=0.0)))

    if len(cut.single):  # single GPUs and storage
        s1, d1 = src[:, cut.single], dst[:, cut.single]
        inn = _dot(nb, d1 & ~s1)
        out = _dot(nb, (src.sum(1) == 1)[:, None] & s1 & ((dst.sum(1)[:, None] - d1) > 0))
        best = max(best, worst(inn, out, cut.single_in, cut.single_out))
    if len(cut.unions):  # unions of hosts (column H: nodes on no host, never inside a union)
        hosts_of = np.einsum("kn,nh->kh", sets, cut.onehot) > 0  # (sets, hosts + 1)
        in_u = np.einsum("kh,uh->ku", hosts_of, cut.unions, dtype=np.int64)  # (sets, unions): hosts inside
        cnt = hosts_of.sum(1)[:, None]
        s_in, d_in = in_u[ps], in_u[pd]
        inn = _dot(nb, (s_in == 0) & (d_in > 0))
        out = _dot(nb, (s_in == cnt[ps]) & (d_in < cnt[pd]))
        best = max(best, worst(inn, out, cut.union_in, cut.union_out))
    return max(best, _path_latency(topology, src, dst))


def naive_completion(plan: Plan | Demands, topology: Topology) -> float:
    """Every transfer starts at once on its shortest path from a fixed source (the plan's choice;
    for bare demands the first candidate), one copy per destination (no multicast); links are
    shared max-min fairly (progressive filling), one flow per (source, destination) pair."""
    if isinstance(plan, Demands):
        pairs: dict[tuple[str, str], float] = {}
        for c in plan.commodities:
            for d in c.dests:
                pairs[(c.sources[0], d)] = pairs.get((c.sources[0], d), 0.0) + c.nbytes
        names, nbytes = list(pairs), np.array(list(pairs.values()))
    else:
        c = plan.columns
        rows = np.flatnonzero(c["kind"] != LOCAL)
        if not len(rows):
            return 0.0
        src = np.where(c["kind"][rows] == STORAGE, -1, c["src_rank"][rows])
        dst = plan.devices[c["new_rank"][rows]]
        up, inv = np.unique(np.stack([src, dst], axis=1), axis=0, return_inverse=True)
        nbytes = np.bincount(inv.reshape(-1), weights=c["nbytes"][rows])
        names = [(topology.storage() if s_ == -1 else topology.gpu(s_), topology.gpu(d_)) for s_, d_ in up.tolist()]
    if not names:
        return 0.0
    paths, lat = [], []
    for sn, dn in names:
        _, sp = topology.shortest_paths(sn)
        p = topology.path_links(sp[dn])
        paths.append(p)
        lat.append(float(topology.latency[p].sum()))
    return _maxmin_completion(paths, nbytes, topology.bandwidth, np.asarray(lat))


def _maxmin_completion(paths: list[list[int]], nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> float:
    used = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in paths]))
    col = {int(e): i for i, e in enumerate(used)}
    a = np.zeros((len(paths), len(used)), dtype=np.float64)
    for f, p in enumerate(paths):
        a[f, [col[int(e)] for e in p]] = 1.0
    cap = bw[used]
    left = nbytes.astype(np.float64).copy()
    active = left > 0
    now = 0.0
    done = np.zeros(len(paths))
    while active.any():
        rate = np.zeros(len(paths))
        frozen = ~active
        capleft = cap.copy()
        while not frozen.all():
            n = a[~frozen].sum(0)
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(n > 0, capleft / n, np.inf)
            inc = float(share.min())
            rate[~frozen] += inc
            capleft -= inc * n
            sat = (n > 0) & (capleft <= cap * 1e-9)
            frozen |= (a[:, sat].sum(1) > 0)
        with np.errstate(divide="ignore"):
            t_left = np.where(active, left / np.maximum(rate, 1e-300), np.inf)
        dt = float(t_left.min())
        now += dt
        left[active] -= rate[active] * dt
        fin = active & (t_left <= dt * (1 + 1e-9))
        done[fin] = now
        left[fin] = 0
        active &= ~fin
    return float(np.max(done + lat))
