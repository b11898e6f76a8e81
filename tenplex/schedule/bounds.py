"""What a schedule is measured against: the lower bound (cuts with the best choice of sources and
multicast, path latency) and the naive baseline (every flow at once, max-min fair sharing)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from ..planner import LOCAL, STORAGE, Plan
from ..topology import Topology
from .commodities import Demands


@functools.lru_cache(maxsize=16)
def _min_latency(topology: Topology) -> np.ndarray:
    """(nodes, nodes) smallest latency of any path (inf: unreachable), in graph node order."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
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
