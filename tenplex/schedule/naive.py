"""The naive baseline: every (source, destination) flow starts at once on its shortest path from
a fixed source (the planner's choice; for bare demands the first candidate), one copy per
destination (no multicast, no relays chosen); links are shared max-min fairly and bytes cut
through (a fluid model). :func:`naive_completion` is its completion; :func:`naive_flows` also
gives its transfers as :class:`~tenplex.schedule.commodities.Demands` (one commodity per flow),
so that the scheduler can return the naive schedule itself when nothing it solved is faster."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..planner import LOCAL, STORAGE, Plan
from ..topology import Topology
from .commodities import Commodity, Demands


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class NaiveFlows:
    """One flow per (source node, destination node) pair, in (source, destination) order.

    ``paths``: link indices of each flow's shortest path; ``latency``: their latency.
    ``demands``: the flows as one commodity each (pieces: the plan rows, or the pieces of the
    bare demands, that the flow carries), so that a schedule can carry them.
    """

    nbytes: np.ndarray
    paths: list[np.ndarray]
    latency: np.ndarray
    demands: Demands

    def floor(self, topology: Topology) -> float:
        """A lower bound of :meth:`completion`, without simulating the sharing: per link, its bytes
        over its bandwidth plus the smallest latency of a flow through it (0 with no flows)."""
        if not len(self.nbytes):
            return 0.0
        n = np.array([len(p) for p in self.paths])
        links = np.concatenate(self.paths)
        load = np.bincount(links, weights=np.repeat(self.nbytes, n), minlength=len(topology.bandwidth))
        lat = np.full(len(topology.bandwidth), np.inf)
        np.minimum.at(lat, links, np.repeat(self.latency, n))
        used = np.unique(links)
        return float((load[used] / topology.bandwidth[used] + lat[used]).max())

    def completion(self, topology: Topology) -> float:
        """Seconds until the last flow ends: progressive filling, recomputed whenever a flow ends,
        plus each flow's path latency."""
        if not len(self.nbytes):
            return 0.0
        return maxmin_completion(self.paths, self.nbytes, topology.bandwidth, self.latency)


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
        flow_dem = Demands(tuple(coms), dem.piece_tensor, dem.piece_start, dem.piece_length, dem.piece_nbytes,
                           dem.piece_row_ptr, dem.rows, dem.bytes_moved)
    else:
        c = plan.columns
        rows = np.flatnonzero(c["kind"] != LOCAL)
        src = np.where(c["kind"][rows] == STORAGE, -1, c["src_rank"][rows])
        dst = plan.devices[c["new_rank"][rows]]
        width = int(dst.max(initial=0)) + 1
        pair = (src + 1) * width + dst  # flows in (source, destination) order; storage first
        key = np.flatnonzero(np.bincount(pair))
        lut = np.zeros(int(key[-1]) + 1 if len(key) else 0, dtype=np.int64)
        lut[key] = np.arange(len(key))
        inv = lut[pair]
        names = [(topology.storage() if s_ == 0 else topology.gpu(s_ - 1), topology.gpu(d_))
                 for s_, d_ in zip((key // width).tolist(), (key % width).tolist())]
        small = np.int16 if len(key) < 2**15 else np.int64  # stable sort of 16-bit keys is a radix sort
        order = np.argsort(inv.astype(small), kind="stable")  # pieces: the rows of each flow in plan order
        rows = rows[order]
        bounds = np.searchsorted(inv[order], np.arange(len(names) + 1))
        nb = c["nbytes"][rows]
        sums = np.add.reduceat(nb, bounds[:-1]) if len(nb) else np.zeros(0, dtype=np.int64)
        coms = [Commodity((s,), (d,), n, pieces) for (s, d), n, pieces
                in zip(names, sums.tolist(), np.split(np.arange(len(rows)), bounds[1:-1]))]
        flow_dem = Demands(tuple(coms), c["tensor"][rows], c["start"][rows], c["length"][rows], nb,
                           np.arange(len(rows) + 1), rows, int(nb.sum()))
    routes = [_path(topology, sn, dn) for sn, dn in names]
    nbytes = np.array([k.nbytes for k in flow_dem.commodities], dtype=np.float64)
    return NaiveFlows(nbytes, [r[0] for r in routes], np.array([r[1] for r in routes], dtype=np.float64), flow_dem)


@functools.lru_cache(maxsize=1 << 16)
def _path(topology: Topology, source: str, dest: str) -> tuple[np.ndarray, float]:
    """Links of the shortest path ``source -> dest`` and its latency (cached: schedules reuse topologies)."""
    _, sp = topology.shortest_paths(source)
    links = np.asarray(topology.path_links(sp[dest]), dtype=np.int64)
    links.setflags(write=False)  # shared by every call
    return links, float(topology.latency[links].sum())


def naive_completion(plan: Plan | Demands, topology: Topology) -> float:
    """Every transfer starts at once on its shortest path from a fixed source (the plan's choice;
    for bare demands the first candidate), one copy per destination (no multicast); links are
    shared max-min fairly (progressive filling), one flow per (source, destination) pair."""
    return naive_flows(plan, topology).completion(topology)


def maxmin_completion(paths: list[np.ndarray], nbytes: np.ndarray, bw: np.ndarray, lat: np.ndarray) -> float:
    """Completion of flows that all start at once on fixed paths (link indices), sharing links
    max-min fairly (progressive filling, recomputed whenever a flow ends), plus each path's latency."""
    n_hops = np.array([len(p) for p in paths], dtype=np.int64)
    links = np.concatenate(paths)
    used, inc_col = np.unique(links, return_inverse=True)
    inc_col = inc_col.reshape(-1)  # (flow, link) incidences: the link's column, and the flow
    inc_flow = np.repeat(np.arange(len(paths)), n_hops)
    cap = bw[used]
    left = nbytes.astype(np.float64).copy()
    active = left > 0
    now = 0.0
    done = np.zeros(len(paths))
    share = np.empty(len(used))
    while active.any():
        rate = np.zeros(len(paths))
        live = active.copy()  # flows whose rate still rises
        capleft = cap.copy()
        while live.any():
            n = np.bincount(inc_col[live[inc_flow]], minlength=len(used)).astype(np.float64)
            has = n > 0
            share.fill(np.inf)
            np.divide(capleft, n, out=share, where=has)
            inc = float(share.min())
            rate[live] += inc
            capleft -= inc * n
            sat = has & (capleft <= cap * 1e-9)
            live[inc_flow[sat[inc_col]]] = False
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
