"""The lower bound a schedule is measured against: cuts with the best choice of sources and
multicast, and path latency (the naive baseline it is compared with is in naive.py)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

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
    # beyond _ALL_UNIONS hosts: single hosts, pairs joined by a link, and (per demands) pairs that
    # hold every replica of a piece; bandwidth into / out of each host and between linked pairs
    host_in: np.ndarray
    host_out: np.ndarray
    pair_bw: dict[tuple[int, int], float]


_ALL_UNIONS = 10  # hosts up to which the lower bound checks every union of hosts


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
    hs, hd = node_host[l_src], node_host[l_dst]
    across = hs != hd
    nh = len(hosts) + 1
    host_in = np.bincount(hd[across], weights=bw[across], minlength=nh)
    host_out = np.bincount(hs[across], weights=bw[across], minlength=nh)
    pair_bw: dict[tuple[int, int], float] = {}
    for a, b, w in zip(hs[across].tolist(), hd[across].tolist(), bw[across].tolist()):
        if a < len(hosts) and b < len(hosts):
            key = (min(a, b), max(a, b))
            pair_bw[key] = pair_bw.get(key, 0.0) + w
    if len(hosts) <= _ALL_UNIONS:
        sizes = range(1, len(hosts) + (len(hosts) == 1))  # a proper union (the whole cluster has no cut)
        combos = [c for r in sizes for c in itertools.combinations(range(len(hosts)), r)]
    else:
        combos = [(a,) for a in range(len(hosts))] + sorted(pair_bw)
    u, u_in, u_out = _unions(combos, nh, host_in, host_out, pair_bw)
    if len(hosts) <= _ALL_UNIONS:  # as before: the links crossing each union
        lin = u[:, hd] & ~u[:, hs]
        lout = u[:, hs] & ~u[:, hd]
        u_in, u_out = lin.astype(np.float64) @ bw, lout.astype(np.float64) @ bw
    return _Cuts(idx, node_host, onehot, single, single_in, single_out, u, u_in, u_out, host_in, host_out, pair_bw)


def _unions(combos: list[tuple[int, ...]], nh: int, host_in: np.ndarray, host_out: np.ndarray,
            pair_bw: dict[tuple[int, int], float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of unions of one or two hosts (``nh`` columns) and the bandwidth into and out of each:
    its hosts' less the links between them."""
    u = np.zeros((len(combos), nh), dtype=bool)
    for i, cmb in enumerate(combos):
        u[i, list(cmb)] = True
    inner = np.array([pair_bw.get((c[0], c[-1]), 0.0) if len(c) == 2 else 0.0 for c in combos])
    return u, u.astype(np.float64) @ host_in - inner, u.astype(np.float64) @ host_out - inner


def lower_bound(dem: Demands, topology: Topology) -> float:
    """Seconds no schedule can beat: the largest of a cut bound and a latency bound.

    Cut bound: for each GPU, storage, and every union of hosts (all unions up to 10 hosts, else
    single hosts and the pairs that can bound more than each of their hosts: joined by a link, or
    holding every replica of a piece), the bytes that must cross into (out of) the node set divided by
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
    unions, union_in, union_out = cut.unions, cut.union_in, cut.union_out
    hosts_of = np.einsum("kn,nh->kh", sets, cut.onehot) > 0  # (sets, hosts + 1)
    if len(cut.host_in) - 1 > _ALL_UNIONS:
        # a pair of hosts bounds more than each alone only through the links between them or
        # pieces whose every replica lies in the pair (egress): those pairs are added
        cnt_s = hosts_of[:, :-1].sum(1)
        two = {tuple(np.flatnonzero(hosts_of[j, :-1]).tolist()) for j in np.unique(ps).tolist() if cnt_s[j] == 2}
        extra = sorted(two - set(cut.pair_bw))
        if extra:
            u2, i2, o2 = _unions(extra, len(cut.host_in), cut.host_in, cut.host_out, cut.pair_bw)
            unions, union_in, union_out = np.vstack([unions, u2]), np.r_[union_in, i2], np.r_[union_out, o2]
    if len(unions):  # unions of hosts (column H: nodes on no host, never inside a union)
        in_u = np.einsum("kh,uh->ku", hosts_of, unions, dtype=np.int32)  # (sets, unions): hosts inside
        cnt = hosts_of.sum(1)[:, None]
        s_in, d_in = in_u[ps], in_u[pd]
        inn = _dot(nb, (s_in == 0) & (d_in > 0))
        out = _dot(nb, (s_in == cnt[ps]) & (d_in < cnt[pd]))
        best = max(best, worst(inn, out, union_in, union_out))
    return max(best, _path_latency(topology, src, dst))
