"""Evaluating a schedule: its completion in continuous time (:func:`simulate`) and its validity in
the time-expanded model (:func:`validate`)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ...errors import PlanError
from ..topology import Topology
from .arrays import member, sort_order
from .commodities import Demands, FlowCommodities, commodity_nbytes
from .listsched import by_level, fifo, link_levels
from .naive import maxmin_completion


class HopSchedule(Protocol):
    """What simulating and validating read of a schedule (``result.Schedule``, whose
    ``completion_s`` runs :func:`simulate`): named structurally, so this module needs no import of it."""

    @property
    def topology(self) -> Topology: ...
    @property
    def demands(self) -> Demands: ...
    @property
    def method(self) -> str: ...
    @property
    def tau(self) -> float: ...
    @property
    def chunk_commodity(self) -> np.ndarray: ...
    @property
    def chunk_nbytes(self) -> np.ndarray: ...
    @property
    def hop_chunk(self) -> np.ndarray: ...
    @property
    def hop_link(self) -> np.ndarray: ...
    @property
    def hop_parent(self) -> np.ndarray: ...
    @property
    def hop_first(self) -> np.ndarray: ...
    @property
    def hop_last(self) -> np.ndarray: ...
    @property
    def hop_arrival(self) -> np.ndarray: ...
    @property
    def slice_hop(self) -> np.ndarray: ...
    @property
    def slice_epoch(self) -> np.ndarray: ...
    @property
    def slice_nbytes(self) -> np.ndarray: ...


def simulate(s: HopSchedule) -> float:
    """Seconds until the last chunk reaches its last destination.

    A schedule runs store-and-forward (:func:`store_and_forward`), except the naive one
    (method ``"naive"``, the scheduler's fallback): it runs as the naive baseline models it,
    every flow at once on its path, links shared max-min fairly, bytes cutting through
    (:func:`~tenplex.planning.schedule.naive.maxmin_completion`; its epochs only order it for a transport).
    """
    if not len(s.hop_chunk):
        return 0.0
    if s.method == "naive":
        return _simulate_naive(s)
    return store_and_forward(s)


def store_and_forward(s: HopSchedule) -> float:
    """Seconds until the last chunk reaches its last destination when every link sends its chunks
    in the schedule's order (by starting epoch, then hop index), each as soon as it has arrived
    and the link is free.

    Vectorised over the links of one level of the link graph (see :func:`link_levels`); chunk
    by chunk when that graph has a cycle.
    """
    if not len(s.hop_chunk):
        return 0.0
    bw, lat = s.topology.bandwidth, s.topology.latency
    inner = s.hop_parent >= 0
    lev = link_levels(s.hop_link[s.hop_parent[inner]], s.hop_link[inner], len(bw))
    if lev is None:
        return simulate_seq(s)
    rank = np.empty(len(s.hop_first), dtype=np.int64)
    rank[sort_order(s.hop_first)] = np.arange(len(s.hop_first))
    dur = s.chunk_nbytes[s.hop_chunk] / bw[s.hop_link]
    done = np.zeros(len(s.hop_chunk))
    for idx in by_level(lev[s.hop_link]):
        idx = idx[sort_order(s.hop_link[idx], rank[idx])]
        p = s.hop_parent[idx]
        ready = np.where(p >= 0, done[p], 0.0)
        done[idx] = fifo(s.hop_link[idx], ready, dur[idx]) + lat[s.hop_link[idx]]
    return float(done.max())


def simulate_seq(s: HopSchedule) -> float:
    """:func:`store_and_forward`, one hop at a time (any link graph)."""
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


def _simulate_naive(s: HopSchedule) -> float:
    """Completion of a naive schedule: its commodities (one source, one destination each) are the
    flows, each on the path of its chunks."""
    first = np.searchsorted(s.chunk_commodity, np.arange(len(s.demands.commodities)))  # a chunk of each
    is_first = np.zeros(len(s.chunk_commodity), dtype=bool)
    is_first[first] = True
    hops = np.flatnonzero(is_first[s.hop_chunk])
    hops = hops[sort_order(s.hop_chunk[hops], s.hop_first[hops])]  # a path's hops start epoch after epoch
    chunk = s.hop_chunk[hops]
    paths = np.split(s.hop_link[hops], np.flatnonzero(chunk[1:] != chunk[:-1]) + 1)
    topo = s.topology
    nbytes = commodity_nbytes(s.demands).astype(np.float64)
    latency = np.array([float(topo.latency[p].sum()) for p in paths])
    return maxmin_completion(paths, nbytes, topo.bandwidth, latency)


def validate(s: HopSchedule) -> None:
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
    if not len(s.hop_chunk) and not len(s.chunk_commodity):
        return
    nn = len(topo.node_names)
    idx = topo.node_index
    # candidate sources and destinations of every commodity, as sorted (commodity, node) keys
    coms = d.commodities
    if isinstance(coms, FlowCommodities):  # its columns, without building its objects
        n_src = n_dst = np.ones(len(coms), dtype=np.int64)
        src_node = np.fromiter((idx[x] for x in coms.sources), dtype=np.int64, count=len(coms))
        dst_node = np.fromiter((idx[x] for x in coms.dests), dtype=np.int64, count=len(coms))
    else:
        n_src = np.fromiter((len(c.sources) for c in coms), dtype=np.int64, count=len(coms))
        n_dst = np.fromiter((len(c.dests) for c in coms), dtype=np.int64, count=len(coms))
        src_node = np.fromiter((idx[x] for c in coms for x in c.sources), dtype=np.int64, count=int(n_src.sum()))
        dst_node = np.fromiter((idx[x] for c in coms for x in c.dests), dtype=np.int64, count=int(n_dst.sum()))
    src_keys = np.sort(np.repeat(np.arange(len(n_src)), n_src) * nn + src_node)
    tail, head = topo.link_src[s.hop_link], topo.link_dst[s.hop_link]
    com = s.chunk_commodity[s.hop_chunk]
    root = s.hop_parent < 0
    held = member(com[root] * nn + tail[root], src_keys)
    if not held.all():
        h = int(np.flatnonzero(root)[np.flatnonzero(~held)[0]])
        c = d.commodities[int(com[h])]
        raise PlanError(f"hop {h} leaves {topo.links[int(s.hop_link[h])].src}, which does not hold the chunk "
                        f"(sources {c.sources})")
    inner = np.flatnonzero(~root)
    p = s.hop_parent[inner]
    cont = (s.hop_chunk[p] == s.hop_chunk[inner]) & (head[p] == tail[inner])
    if not cont.all():
        h = int(inner[np.flatnonzero(~cont)[0]])
        raise PlanError(f"hop {h} does not continue its parent hop {int(s.hop_parent[h])}")
    early = s.hop_first[inner] < s.hop_arrival[p]
    if early.any():
        i = int(np.flatnonzero(early)[0])
        h, ph = int(inner[i]), int(p[i])
        raise PlanError(f"hop {h} leaves {topo.links[int(s.hop_link[h])].src} in epoch {s.hop_first[h]} before the "
                        f"chunk arrives (epoch {s.hop_arrival[ph]})")
    reached = np.sort(s.hop_chunk * nn + head)
    n_c = n_dst[s.chunk_commodity]
    want_chunk = np.repeat(np.arange(len(s.chunk_commodity)), n_c)
    d_ptr = np.concatenate([[0], np.cumsum(n_dst)])
    pos = np.arange(len(want_chunk)) - np.repeat(np.cumsum(n_c) - n_c, n_c) + np.repeat(d_ptr[s.chunk_commodity], n_c)
    got = member(want_chunk * nn + dst_node[pos], reached)
    if not got.all():
        c = int(want_chunk[np.flatnonzero(~got)[0]])
        com_c = d.commodities[int(s.chunk_commodity[c])]
        have = {topo.node_names[int(x)] for x in head[s.hop_chunk == c]}
        raise PlanError(f"chunk {c} never reaches {sorted(set(com_c.dests) - have)}")
