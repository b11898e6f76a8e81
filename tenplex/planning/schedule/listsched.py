"""List scheduling of chunks along their routes in the time-expanded network, level by level of
the link graph (and chunk by chunk when it has a cycle); chunks of a commodity."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ...errors import PlanError
from ..topology import Topology
from .arrays import excl_cumsum, sort_order
from .commodities import Demands, commodity_nbytes
from .routes import Routes

log = logging.getLogger(__name__)


def link_levels(parent_link: np.ndarray, child_link: np.ndarray, n_links: int) -> np.ndarray | None:
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


def fifo(link: np.ndarray, ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
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


def by_level(lev: np.ndarray) -> list[np.ndarray]:
    """Indices grouped by level, lowest first, each group in index order."""
    order = sort_order(lev)
    bounds = np.searchsorted(lev[order], np.arange(int(lev.max()) + 2))
    return [order[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if b > a]


def list_schedule(topology: Topology, routes: Routes, chunk_nb: np.ndarray, order: np.ndarray,
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
    lev = link_levels(cat_l[np.repeat(r_off, n_r)[inner] + cat_p[inner]], cat_l[inner], nl)
    if lev is None:
        log.info("route links form a cycle; list scheduling chunk by chunk")
        return _list_schedule_seq(topology, routes, chunk_nb, order, tau, release)
    rid = routes.of_chunk[order]
    nh = n_r[rid]
    base = np.repeat(excl_cumsum(nh), nh)
    pos = np.arange(len(base)) - base
    src = np.repeat(r_off[rid], nh) + pos
    hop_link, par = cat_l[src], cat_p[src]
    hop_parent = np.where(par >= 0, base + par, -1)
    n_hops = len(base)
    del rid, base, pos, src, par  # (peak memory: 13.7 M hops at 131,072 GPUs)
    hop_chunk = np.repeat(order, nh)
    cap = topology.bandwidth * tau
    lat_ep = np.rint(topology.latency / tau).astype(np.int64)
    nb = chunk_nb[hop_chunk].astype(np.float64)
    dur = nb / cap[hop_link]
    start, fin = np.empty(n_hops), np.empty(n_hops)
    arrival = np.zeros(n_hops, dtype=np.int64)
    done: list[np.ndarray] = []
    for idx in by_level(lev[hop_link]):
        p = hop_parent[idx]
        ready = np.where(p >= 0, arrival[p], release[hop_chunk[idx]])
        o = sort_order(hop_link[idx], ready)  # per link: by arrival, then priority
        idx, ready = idx[o], ready[o].astype(np.float64)
        f = fifo(hop_link[idx], ready, dur[idx])
        s = np.maximum(f - dur[idx], ready)
        start[idx], fin[idx] = s, f
        last = np.maximum(np.ceil(f - 1e-9) - 1, np.floor(s)).astype(np.int64)
        arrival[idx] = last + 1 + lat_ep[hop_link[idx]]
        done.append(idx)
    # number hops in the order they were placed: level by level, per link in its sending order, so
    # the order by (first epoch, index) is each link's sending order (no sort by start time: 2 s
    # at 6.2 M hops)
    perm = np.concatenate(done)
    del done, arrival, dur
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    hop_link, hop_chunk, nb, start, fin = hop_link[perm], hop_chunk[perm], nb[perm], start[perm], fin[perm]
    par = hop_parent[perm]
    del hop_parent
    hop_parent = np.where(par >= 0, inv[par], -1)
    del par, inv, perm
    first = np.floor(start).astype(np.int64)
    last = np.maximum(np.ceil(fin - 1e-9).astype(np.int64) - 1, first)
    n_sl = last - first + 1
    if np.all(n_sl == 1):  # every hop within one epoch (one chunk a flow at 131,072 GPUs): a slice a hop
        s_hop, s_epoch, s_nb = np.arange(n_hops), first.copy(), nb
    else:
        s_hop = np.repeat(np.arange(n_hops), n_sl)
        s_epoch = first[s_hop] + (np.arange(len(s_hop)) - np.repeat(excl_cumsum(n_sl), n_sl))
        s_nb = cap[hop_link[s_hop]] * np.clip(np.minimum(fin[s_hop], s_epoch + 1) - np.maximum(start[s_hop], s_epoch),
                                              0.0, None)
        ends = np.cumsum(n_sl) - 1
        s_nb[ends] += nb - np.bincount(s_hop, weights=s_nb, minlength=n_hops)  # rounding: exact bytes per hop
    return {"hop_chunk": hop_chunk, "hop_link": hop_link, "hop_parent": hop_parent, "hop_first": first,
            "hop_last": last, "hop_arrival": last + 1 + lat_ep[hop_link], "slice_hop": s_hop, "slice_epoch": s_epoch,
            "slice_nbytes": s_nb}


def _list_schedule_seq(topology: Topology, routes: Routes, chunk_nb: np.ndarray, order: np.ndarray,
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


def split_chunks(dem: Demands, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split every commodity into chunks: (commodity, byte offset, bytes, index within commodity)."""
    total = commodity_nbytes(dem).astype(np.int64)
    n = np.maximum(1, -(-total // chunk_bytes))
    com = np.repeat(np.arange(len(total), dtype=np.int64), n)
    idx = np.arange(len(com), dtype=np.int64) - np.repeat(excl_cumsum(n), n)
    off = idx * chunk_bytes
    return com, off, np.minimum(chunk_bytes, total[com] - off), idx


@dataclass(frozen=True, slots=True, eq=False)
class Chunks:
    """Demands cut into chunks of at most ``chunk_bytes``: per chunk its commodity, byte offset,
    bytes and index within its commodity (the columns of :func:`split_chunks`)."""

    commodity: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    index: np.ndarray
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise PlanError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        sizes = (len(self.commodity), len(self.offset), len(self.nbytes), len(self.index))
        if len(set(sizes)) != 1:
            raise PlanError(f"chunk columns of different lengths (commodity, offset, nbytes, index): {sizes}")

    @classmethod
    def split(cls, dem: Demands, chunk_bytes: int) -> Chunks:
        """Every commodity of ``dem`` in chunks of ``chunk_bytes`` (:func:`split_chunks`)."""
        return cls(*split_chunks(dem, chunk_bytes), chunk_bytes)
