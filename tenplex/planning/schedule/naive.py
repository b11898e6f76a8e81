"""The naive baseline: every (source, destination) flow starts at once on its shortest path from
a fixed source (the planner's choice; for bare demands the first candidate), one copy per
destination (no multicast, no relays chosen); links are shared max-min fairly and bytes cut
through (a fluid model). :func:`naive_completion` is its completion; :func:`naive_flows` also
gives its transfers as :class:`~tenplex.planning.schedule.commodities.Demands` (one commodity per flow),
so that the scheduler can return the naive schedule itself when nothing it solved is faster."""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import PlanError
from ..planner import LOCAL, STORAGE, Plan
from ..topology import Topology
from .arrays import Columns, sort_order
from .commodities import PIECE_COLUMNS, Commodity, Demands, FlowCommodities
from .hostpaths import host_flow_paths, host_paths

log = logging.getLogger(__name__)

_REF = float(2**24)  # message size of the fastest paths (Topology.shortest_paths' default)
_BATCH = 512  # sources per Dijkstra call: (batch, nodes) predecessor rows
_HUB_NODES = 2500  # topology nodes beyond which fastest paths start from the sources' heads
_BLOCK = 1 << 22  # plan rows a block when keying a plan's flows (bounds the temporaries)
_PACK_BITS = 63  # bits a (pair key, row) sort value may take


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class NaiveFlows:
    """One flow per (source node, destination node) pair, in (source, destination) order.

    ``links``: link indices of every flow's shortest path, concatenated (flow i's are
    ``links[ptr[i]:ptr[i + 1]]``, source to destination); ``latency``: the paths' latency.
    ``demands``: the flows as one commodity each (pieces: the plan rows, or the pieces of the
    bare demands, that the flow carries), so that a schedule can carry them.
    """

    nbytes: np.ndarray
    links: np.ndarray
    ptr: np.ndarray
    latency: np.ndarray
    demands: Demands

    @property
    def paths(self) -> list[np.ndarray]:
        """Every flow's links (a list of views into ``links``)."""
        return np.split(self.links, self.ptr[1:-1]) if len(self.nbytes) else []

    def floor(self, topology: Topology) -> float:
        """A lower bound of :meth:`completion`, without simulating the sharing: per link, its bytes
        over its bandwidth plus the smallest latency of a flow through it (0 with no flows)."""
        if not len(self.nbytes):
            return 0.0
        n = np.diff(self.ptr)
        links = self.links
        load = np.bincount(links, weights=np.repeat(self.nbytes, n), minlength=len(topology.bandwidth))
        lat = np.full(len(topology.bandwidth), np.inf)
        np.minimum.at(lat, links, np.repeat(self.latency, n))
        used = np.unique(links)
        return float((load[used] / topology.bandwidth[used] + lat[used]).max())

    def completion(self, topology: Topology) -> float:
        """Seconds until the last flow ends: progressive filling, recomputed whenever a flow ends,
        plus each flow's path latency."""
        return self.bounds(topology)[1]

    def bounds(self, topology: Topology, deadline: float = math.inf) -> tuple[float, float]:
        """``(low, high)`` bounds of :meth:`completion`, both its value unless the progressive
        filling was still running at ``deadline`` (``time.perf_counter()``)."""
        if not len(self.nbytes):
            return 0.0, 0.0
        return _maxmin_flat(self.links, np.diff(self.ptr), self.nbytes, topology.bandwidth, self.latency,
                            deadline=deadline)


def naive_flows(plan: Plan | Demands, topology: Topology) -> NaiveFlows:
    """The naive baseline's flows of a plan (sources: the planner's) or of bare demands (sources:
    each commodity's first candidate)."""
    if isinstance(plan, Demands):
        dem = plan
        pairs: dict[tuple[str, str], list[int]] = {}
        for k, c in enumerate(dem.commodities):
            for d in c.dests:
                pairs.setdefault((c.sources[0], d), []).append(k)
        names = list(pairs)
        coms = [Commodity((s,), (d,), sum(dem.commodities[k].nbytes for k in ks),
                          np.concatenate([dem.commodities[k].pieces for k in ks])) for (s, d), ks in pairs.items()]
        flow_dem = Demands(tuple(coms), dem.pieces, dem.bytes_moved)
    else:
        c = plan.columns
        # one stable sort of the non-local rows by (source, destination): the flows and each one's
        # rows in plan order; the rows themselves are left to the demands' piece columns, built when
        # read (issue #20: 35.8 M rows at 131,072 GPUs, 1.6 GB of columns the scheduler never reads)
        rows, head, key, width = _flow_rows(plan, heads=True)
        bounds = np.r_[head, len(rows)]
        sums = _segment_sums(c["nbytes"], rows, head)
        del rows
        total = int(sums.sum())
        # node indices, not names, for the paths (issue #20: 666,000 name lookups at 16,384 GPUs)
        ks, kd = key // width, key % width
        idx = topology.node_index
        gpu_node = np.array([idx.get(topology.gpu(g), -1) for g in range(width)], dtype=np.int64)
        src_node = gpu_node[np.maximum(ks - 1, 0)]
        if np.any(ks == 0):
            src_node[ks == 0] = idx[topology.storage()]
        dst_node = gpu_node[kd]
        if np.any(src_node < 0) or np.any(dst_node < 0):
            g = int(np.r_[ks[src_node < 0] - 1, kd[dst_node < 0]][0])
            raise PlanError(f"the plan moves data from or to rank {g}, which has no GPU in the topology "
                            f"({len(topology.node_names)} nodes)")
        node_name = np.array(topology.node_names, dtype=object)
        coms = FlowCommodities(node_name[src_node].tolist(), node_name[dst_node].tolist(), sums, bounds)
        flow_dem = Demands(coms, Columns(PIECE_COLUMNS, build=functools.partial(_flow_pieces, plan)), total)
        links, ptr, latency = _paths_of(topology, src_node, dst_node)
        return NaiveFlows(sums.astype(np.float64), links, ptr, latency, flow_dem)
    idx = topology.node_index
    src_node = np.array([idx[a] for a, _ in names], dtype=np.int64)
    dst_node = np.array([idx[b_] for _, b_ in names], dtype=np.int64)
    links, ptr, latency = _paths_of(topology, src_node, dst_node)
    nbytes = np.array([k.nbytes for k in flow_dem.commodities], dtype=np.float64)
    return NaiveFlows(nbytes, links, ptr, latency, flow_dem)


def _flow_rows(plan: Plan, heads: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The non-local rows of ``plan`` sorted by (source, destination device) pair, plan order within a
    pair (source -1: storage); with ``heads``: where each pair's rows start, and the pairs as keys
    ``(source + 1) * width + destination``, with ``width`` (else empty).

    One in-place stable sort of ``key << bits | row`` (timsort: a plan's pairs are nearly sorted,
    0.06 % descents at 131,072 GPUs), the keys made in blocks of rows: no index or key column
    beside it (issue #20: 35.8 M non-local rows, 286 MB a column); a stable argsort of the keys
    where they do not fit 63 bits together."""
    c = plan.columns
    kind = c["kind"]
    nl = kind != LOCAL
    n = int(np.count_nonzero(nl))
    width = int(max(plan.devices.max(initial=0), c["src_rank"].max(initial=0))) + 1
    rbits = max(len(kind) - 1, 1).bit_length()
    packed = (width * (width + 1)).bit_length() + rbits <= _PACK_BITS
    storage = bool(np.any(kind == STORAGE))
    out = np.empty(n, dtype=np.int64)
    pos = 0
    for a in range(0, len(kind), _BLOCK):
        r = np.flatnonzero(nl[a : a + _BLOCK])
        r += a
        k = np.take(c["src_rank"], r)
        if storage:
            k[np.take(kind, r) == STORAGE] = -1
        k += 1
        k *= width
        k += np.take(plan.devices, np.take(c["new_rank"], r))
        if packed:
            k <<= rbits
            k |= r
        out[pos : pos + len(r)] = k
        pos += len(r)
    del nl
    empty = np.zeros(0, dtype=np.int64)
    if packed:
        out.sort(kind="stable")
        head, key = empty, empty
        if heads:
            head = _heads(out, rbits)
            key = out[head] >> rbits
        out &= (1 << rbits) - 1
        return out, head, key, width
    order = np.argsort(out, kind="stable")
    key = out[order]
    head = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if heads and n else empty
    key = key[head] if heads else empty
    return np.flatnonzero(kind != LOCAL)[order], head, key, width


def _segment_sums(values: np.ndarray, rows: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Sums of ``values[rows]`` over the segments starting at ``head`` (0 first), in blocks of rows."""
    sums = np.zeros(len(head), dtype=values.dtype)
    for a in range(0, len(rows), _BLOCK):
        b = min(a + _BLOCK, len(rows))
        lo, hi = np.searchsorted(head, [a, b])
        starts = np.r_[a, head[lo:hi]] if lo == len(head) or head[lo] != a else head[lo:hi]
        seg = np.searchsorted(head, starts, side="right") - 1  # the segment of each start
        sums[seg] += np.add.reduceat(np.take(values, rows[a:b]), starts - a)
    return sums


def _heads(packed: np.ndarray, rbits: int) -> np.ndarray:
    """Where the keys of sorted ``key << rbits | row`` values change (0 first), in blocks."""
    if not len(packed):
        return np.zeros(0, dtype=np.int64)
    out = [np.zeros(1, dtype=np.int64)]
    for a in range(0, len(packed) - 1, _BLOCK):
        k = packed[a : a + _BLOCK + 1] >> rbits
        out.append(np.flatnonzero(k[1:] != k[:-1]) + (a + 1))
    return np.concatenate(out)


def _flow_pieces(plan: Plan) -> dict[str, np.ndarray]:
    """The piece columns of a plan's naive flows (:func:`naive_flows`): one piece per non-local row,
    the rows sorted by (source, destination) pair, plan order within a pair."""
    c = plan.columns
    rows = _flow_rows(plan)[0]
    return {"piece_tensor": c["tensor"][rows], "piece_start": c["start"][rows], "piece_length": c["length"][rows],
            "piece_nbytes": c["nbytes"][rows], "piece_row_ptr": np.arange(len(rows) + 1), "rows": rows}


def flow_paths(topology: Topology, names: list[tuple[str, str]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Links of the fastest path of every (source, destination) pair (those of
    :meth:`Topology.shortest_paths`), and each path's latency.

    One Dijkstra per distinct source (scipy, in batches), the paths walked back from the
    predecessor rows for all pairs at once: no per-node dictionaries (issue #20: 8.8 s for the
    13,550 flows of 1,024 GPUs, most of it building them)."""
    idx = topology.node_index
    src = np.array([idx[a] for a, _ in names], dtype=np.int64)
    dst = np.array([idx[b] for _, b in names], dtype=np.int64)
    links, ptr, latency = _paths_of(topology, src, dst)
    return (np.split(links, ptr[1:-1]) if len(names) else []), latency


def _paths_of(topology: Topology, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`flow_paths` of node index pairs: links concatenated, each flow's offsets, latencies.
    On large clusters of identical hosts with one portal each, through :mod:`.hostpaths`."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.sparse import csr_matrix

    if not len(src):
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(0)
    nn = len(topology.node_index)
    hp = host_paths(topology, _REF) if nn > _HUB_NODES else None
    if hp is not None:
        links, ptr = host_flow_paths(hp, topology, src, dst, _hub_walk)
        links.setflags(write=False)
        return links, ptr, path_latency(topology.latency, links, ptr)
    u, v = topology.link_src.astype(np.int64), topology.link_dst.astype(np.int64)
    w = topology.latency + _REF / topology.bandwidth  # the weights of Topology.shortest_paths
    mat = csr_matrix((w, (u, v)), shape=(nn, nn))
    key = u * nn + v  # (tail, head) -> link: the last of parallel links, as Topology.link_index
    kord = np.lexsort((np.arange(len(key)), key))
    skey = key[kord]
    last = np.r_[skey[1:] != skey[:-1], True]
    skey, slink = skey[last], kord[last]
    hf, hl, hpos, best = _hub_walk(mat, src, dst, skey, slink, nn, nn > _HUB_NODES)
    if not np.all(np.isfinite(best)):
        bad = int(np.flatnonzero(~np.isfinite(best))[0])
        raise PlanError(f"the topology has no path from {topology.node_names[src[bad]]} to "
                        f"{topology.node_names[dst[bad]]}")
    o = np.lexsort((hpos, hf))  # per flow, source to destination
    hf, links = hf[o], hl[o].astype(np.int64)
    ptr = np.searchsorted(hf, np.arange(len(src) + 1))
    links.setflags(write=False)
    return links, ptr, path_latency(topology.latency, links, ptr)


def _hub_walk(mat: Any, src: np.ndarray, dst: np.ndarray, skey: np.ndarray, slink: np.ndarray, nn: int,
              hubs: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_walk` of the pairs ``src[i] -> dst[i]`` (its hop columns: pair, link, position to
    sort by; and each pair's weight), with ``hubs`` from the sources' heads where they are fewer."""
    sources = np.unique(src)
    # through hubs: a path leaves its source by one of the source's links, so where the sources'
    # heads are fewer (GPUs sharing a host's NVSwitch and memory), one Dijkstra per head, and per
    # pair the head with the shortest total (on large topologies only: ties may pick another of
    # equally fast paths than Topology.shortest_paths)
    heads = np.unique(mat.indices[np.concatenate([np.arange(mat.indptr[x], mat.indptr[x + 1]) for x in sources])])
    if hubs and 2 * len(heads) < len(sources):  # (a single Dijkstra per source below)
        deg = np.diff(mat.indptr)[src]
        cf = np.repeat(np.arange(len(src)), deg)  # candidates: (flow, first link)
        ci = np.arange(len(cf)) - np.repeat(np.cumsum(deg) - deg, deg) + np.repeat(mat.indptr[src], deg)
        ch, cw = mat.indices[ci].astype(np.int64), mat.data[ci]
        keep = (ch != src[cf]) & (src[cf] != dst[cf])
        cf, ch, cw = cf[keep], ch[keep], cw[keep]
        pf, pl, pp, cost = _walk(mat, ch, dst[cf], skey, slink, nn)
        cost = cost + cw
        best = np.full(len(src), np.inf)
        np.minimum.at(best, cf, cost)
        best[src == dst] = 0.0
        first = np.zeros(len(src), dtype=np.int64) - 1
        won = np.flatnonzero(cost == best[cf])
        first[cf[won[::-1]]] = won[::-1]  # the first candidate with the shortest total
        chosen = np.zeros(len(cf), dtype=bool)
        chosen[first[first >= 0]] = True
        on = chosen[pf]
        trivial = src == dst
        lead = np.flatnonzero(~trivial)
        first_link = slink[np.searchsorted(skey, src[lead] * nn + ch[first[lead]])]
        hop_flow = [cf[pf[on]], lead]
        hop_link = [pl[on], first_link]
        hop_pos = [pp[on], np.full(len(lead), -(1 << 30))]  # the first hop leads
    else:
        pf, pl, pp, best = _walk(mat, src, dst, skey, slink, nn)
        hop_flow, hop_link, hop_pos = [pf], [pl], [pp]
    hf, hl, hpos = (np.concatenate(x) if x else np.zeros(0, dtype=np.int64) for x in (hop_flow, hop_link, hop_pos))
    return hf, hl, hpos, best


def _walk(mat: Any, start: np.ndarray, dst: np.ndarray, skey: np.ndarray, slink: np.ndarray,
          nn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fastest paths ``start[i] -> dst[i]`` from one Dijkstra per distinct start (in batches),
    walked back from the predecessor rows for all pairs at once: per hop its pair, link and
    minus its distance from the destination; and each pair's path weight (inf: no path)."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.sparse.csgraph import dijkstra

    roots, row = np.unique(start, return_inverse=True)
    row = row.reshape(-1)
    cost = np.zeros(len(start))
    pairs, links, pos_ = [], [], []
    for b0 in range(0, len(roots), _BATCH):
        sel = np.flatnonzero((row >= b0) & (row < b0 + _BATCH))
        dist, pred = dijkstra(mat, directed=True, indices=roots[b0:b0 + _BATCH], return_predecessors=True)
        r, cur, s_ = row[sel] - b0, dst[sel].copy(), start[sel]
        cost[sel] = dist[r, cur]
        pos = 0
        reach = np.isfinite(cost[sel])
        on = (cur != s_) & reach
        while on.any():
            f = np.flatnonzero(on)
            prev = pred[r[f], cur[f]].astype(np.int64)
            pairs.append(sel[f])
            links.append(slink[np.searchsorted(skey, prev * nn + cur[f])])
            pos_.append(np.full(len(f), -pos))  # walked backwards: later hops first
            cur[f] = prev
            pos += 1
            on = (cur != s_) & reach
    return (*(np.concatenate(x) if x else np.zeros(0, dtype=np.int64) for x in (pairs, links, pos_)), cost)


def path_latency(latency: np.ndarray, links: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Latency of every path (path i: ``links[ptr[i]:ptr[i + 1]]``), summed from source to
    destination in that order."""
    n = np.diff(ptr)
    out = np.zeros(len(n))
    for j in range(int(n.max(initial=0))):
        has = np.flatnonzero(n > j)
        out[has] += latency[links[ptr[has] + j]]
    return out


def naive_completion(plan: Plan | Demands, topology: Topology) -> float:
    """Every transfer starts at once on its shortest path from a fixed source (the plan's choice;
    for bare demands the first candidate), one copy per destination (no multicast); links are
    shared max-min fairly (progressive filling), one flow per (source, destination) pair."""
    return naive_flows(plan, topology).completion(topology)


def naive_bounds(plan: Plan | Demands, topology: Topology, deadline: float = math.inf) -> tuple[float, float]:
    """``(low, high)`` bounds of :func:`naive_completion`, both its value unless computing it
    was still running at ``deadline`` (``time.perf_counter()``)."""
    return naive_flows(plan, topology).bounds(topology, deadline)


def maxmin_completion(paths: list[np.ndarray], nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> float:
    """Completion of flows that all start at once on fixed paths (link indices), sharing links
    max-min fairly (progressive filling, recomputed whenever a flow ends), plus each path's latency."""
    return maxmin_bounds(paths, nbytes, bw, lat)[1]


def maxmin_bounds(paths: list[np.ndarray], nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray, *,
                  deadline: float = math.inf, max_events: float = math.inf) -> tuple[float, float]:
    """``(low, high)`` bounds of :func:`maxmin_completion`, equal (its value) unless the
    progressive filling was still running at ``deadline`` (``time.perf_counter()``) or after
    ``max_events`` flow ends (for tests).

    Exact: the same progressive filling, float operation for float operation, but each level
    updates the live flows per link from the flows it freezes (through link -> flow and
    flow -> link index tables) instead of counting every (flow, link) incidence again (issue
    #20: 38 s for 13,550 flows, now ~6 s). Bounds from the state at time ``t`` when cut short:
    low: no flow beats its path's slowest link, no link its remaining bytes; high: under max-min
    fairness every unfinished flow has a saturated link on its path at every instant (so it ends
    by ``t`` plus the remaining bytes over the bandwidth of each link of its path, summed) on
    which its rate is the largest (so at least that link's bandwidth over its flows at ``t``)."""
    if not len(paths):
        return 0.0, 0.0
    n_hops = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
    return _maxmin_flat(np.concatenate(paths), n_hops, nbytes, bw, lat, deadline=deadline, max_events=max_events)


def _maxmin_flat(links: np.ndarray, n_hops: np.ndarray, nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray, *,
                 deadline: float = math.inf, max_events: float = math.inf) -> tuple[float, float]:
    """:func:`maxmin_bounds` of paths given as their links concatenated and each one's length."""
    nf = len(n_hops)
    if time.perf_counter() > deadline or max_events <= 0:
        # no time to fill: the bounds at time 0 straight from the incidences, without the set-up's
        # sorts and tables (the same figures: 2.5 s -> 0.6 s for 2.28 M flows at 131,072 GPUs)
        left = nbytes.astype(np.float64)
        lo, hi = _cut_short(0.0, left, left > 0, np.zeros(nf), lat, links, np.repeat(np.arange(nf), n_hops),
                            bw.astype(np.float64), len(bw))
        log.info("max-min fair completion not started by its deadline (%d flows): in [%.6f, %.6f]s", nf, lo, hi)
        return lo, hi
    used, col = np.unique(links, return_inverse=True)
    col = col.reshape(-1)  # (flow, link) incidences in flow order: the link's column
    ne = len(used)
    fptr = np.concatenate([[0], np.cumsum(n_hops)])
    inc_flow = np.repeat(np.arange(nf), n_hops)
    by_link = sort_order(col)
    lflow = inc_flow[by_link]  # incidences in link order: the flow
    lptr = np.searchsorted(col[by_link], np.arange(ne + 1)).tolist()
    flinks = np.full((nf, int(n_hops.max())), ne, dtype=np.int64)  # each flow's link columns, padded with ne
    flinks[inc_flow, np.arange(len(col)) - fptr[inc_flow]] = col
    cap = bw[used].astype(np.float64)
    tol = cap * 1e-9
    left = nbytes.astype(np.float64).copy()
    active = left > 0
    n_act = np.bincount(col[active[inc_flow]], minlength=ne).astype(np.float64)
    now = 0.0
    done = np.zeros(nf)
    share = np.empty(ne)
    stamp = np.zeros(nf, dtype=np.int64)
    events = 0
    while active.any():
        if time.perf_counter() > deadline or events >= max_events:
            return _cut_short_at(now, left, active, done, lat, col, inc_flow, cap, ne)
        rate = np.zeros(nf)
        live = active.copy()  # flows whose rate still rises
        n = n_act.copy()  # live flows per link
        capleft = cap.copy()
        level = 0.0  # the rate of every live flow
        has = n > 0
        while has.any():
            if time.perf_counter() > deadline:  # (an event of 2.28 M flows takes seconds: its levels look too)
                return _cut_short_at(now, left, active, done, lat, col, inc_flow, cap, ne)
            share.fill(np.inf)
            np.divide(capleft, n, out=share, where=has)
            inc = float(share.min())
            level += inc
            capleft -= inc * n
            sat = np.flatnonzero(has & (capleft <= tol)).tolist()
            fl = np.concatenate([lflow[lptr[e]:lptr[e + 1]] for e in sat])
            fl = fl[live[fl]]
            stamp[fl] = np.arange(len(fl))  # each flow once (it may cross several saturated links)
            fl = fl[stamp[fl] == np.arange(len(fl))]
            live[fl] = False
            rate[fl] = level
            n -= np.bincount(flinks[fl].reshape(-1), minlength=ne + 1)[:ne]
            has = n > 0
        with np.errstate(divide="ignore"):
            t_left = np.where(active, left / np.maximum(rate, 1e-300), np.inf)
        dt = float(t_left.min())
        now += dt
        left[active] -= rate[active] * dt
        fin = active & (t_left <= dt * (1 + 1e-9))
        done[fin] = now
        left[fin] = 0
        active &= ~fin
        n_act -= np.bincount(flinks[fin].reshape(-1), minlength=ne + 1)[:ne]
        events += 1
    end = float(np.max(done + lat))
    return end, end


def _cut_short_at(now: float, left: np.ndarray, active: np.ndarray, done: np.ndarray, lat: np.ndarray,
                  col: np.ndarray, inc_flow: np.ndarray, cap: np.ndarray, ne: int) -> tuple[float, float]:
    """:func:`_cut_short`, logged."""
    lo, hi = _cut_short(now, left, active, done, lat, col, inc_flow, cap, ne)
    log.info("max-min fair completion cut short at %.4fs of %d flows (%d left): in [%.6f, %.6f]s",
             now, len(left), int(active.sum()), lo, hi)
    return lo, hi


def _cut_short(now: float, left: np.ndarray, active: np.ndarray, done: np.ndarray, lat: np.ndarray,
               col: np.ndarray, inc_flow: np.ndarray, cap: np.ndarray, ne: int) -> tuple[float, float]:
    """Bounds of the completion from the state of the progressive filling at ``now``: see
    :func:`maxmin_bounds`."""
    fin = float(np.max(np.where(active, -np.inf, done + lat)))
    on = active[inc_flow]
    load = np.bincount(col[on], weights=left[inc_flow[on]], minlength=ne)  # bytes still to cross each link
    secs = load / cap
    lat_min = np.full(ne, np.inf)
    np.minimum.at(lat_min, col[on], lat[inc_flow[on]])
    slowest = np.full(len(left), np.inf)
    np.minimum.at(slowest, inc_flow, cap[col])
    lo = max(fin, float(np.max(np.where(active, now + left / slowest + lat, -np.inf))),
             float(np.max(np.where(load > 0, now + secs + lat_min, -np.inf))))
    lo *= 1 - 1e-9  # rounding: the filling's own arithmetic may land a little below
    path_secs = np.bincount(inc_flow[on], weights=secs[col[on]], minlength=len(left))
    # a flow's rate is the largest on its saturated bottleneck link, so at least that link's
    # bandwidth over its flows, whose number only falls
    crowd = np.bincount(col[on], minlength=ne) / cap
    worst = np.zeros(len(left))
    np.maximum.at(worst, inc_flow[on], crowd[col[on]])
    ends = now + np.minimum(path_secs, left * worst) * (1 + 1e-6) + lat
    hi = max(fin, float(np.max(np.where(active, ends, -np.inf))))
    return lo, hi
