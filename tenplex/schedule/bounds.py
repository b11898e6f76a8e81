"""The lower bound a schedule is measured against: cuts with the best choice of sources and
multicast, and path latency (the naive baseline it is compared with is in naive.py)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from ..topology import Topology
from .commodities import Demands


def _min_latency(topology: Topology, sources: np.ndarray) -> np.ndarray:
    """(sources, nodes) smallest latency of any path from each source (inf: unreachable)."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    nn = len(topology.node_names)
    # csgraph drops zero weights (no edge): zero-latency links get a weight far below any real one
    w = np.maximum(topology.latency, 1e-30)
    dist = dijkstra(csr_matrix((w, (topology.link_src, topology.link_dst)), shape=(nn, nn)), directed=True,
                    indices=sources)
    return np.where(dist < 1e-20, 0.0, dist)


def _path_latency(topology: Topology, ps: np.ndarray, dk: np.ndarray, dn: np.ndarray, outside: np.ndarray,
                  set_ptr: np.ndarray, set_nodes: np.ndarray) -> float:
    """Longest latency of any destination's nearest source (a schedule cannot beat it).

    ``ps``: each commodity's source set; ``dk``, ``dn``: (commodity, destination node) pairs,
    ``outside``: which of them is not a source of its commodity; sets as CSR rows. Beyond
    ``_LAT_CELLS`` (sources x nodes) the latency of the fastest link into each destination (the
    bound is microseconds where cut bounds are seconds)."""
    nn = len(topology.node_names)
    used = np.unique(ps)
    srcs = np.unique(np.concatenate([set_nodes[set_ptr[j]:set_ptr[j + 1]] for j in used.tolist()]))
    if len(srcs) * nn > _LAT_CELLS:
        inb = np.full(nn, np.inf)
        real = topology.link_src != topology.link_dst
        np.minimum.at(inb, topology.link_dst[real], topology.latency[real])
        lat = inb[dn[outside]]
        return float(lat[np.isfinite(lat)].max(initial=0.0))
    lat = _min_latency(topology, srcs)
    row = np.full(nn, -1, dtype=np.int64)
    row[srcs] = np.arange(len(srcs))
    order = np.argsort(ps[dk], kind="stable")  # destination pairs grouped by source set
    bounds = np.searchsorted(ps[dk][order], np.r_[used, np.iinfo(np.int64).max])
    best = 0.0
    for i, j in enumerate(used.tolist()):
        near = lat[row[set_nodes[set_ptr[j]:set_ptr[j + 1]]]].min(0)[dn[order[bounds[i]:bounds[i + 1]]]]
        best = max(best, float(near[np.isfinite(near)].max(initial=0.0)))
    return best


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
_LAT_CELLS = 4_000_000  # sources x nodes of the exact latency bound


@functools.lru_cache(maxsize=16)
def _cuts(topology: Topology) -> _Cuts:
    """:class:`_Cuts` of ``topology`` (cached: schedules reuse topologies)."""
    nodes, idx = list(topology.node_names), topology.node_index
    bw = topology.bandwidth
    l_src, l_dst = topology.link_src, topology.link_dst
    single = np.array([idx[n] for n, kind in topology.graph.nodes(data="kind") if kind in ("gpu", "storage")],
                      dtype=np.int64)
    real = l_src != l_dst  # (a per-node mask over all links was quadratic: 5 s at 16,384 GPUs)
    single_in = np.bincount(l_dst[real], weights=bw[real], minlength=len(nodes))[single]
    single_out = np.bincount(l_src[real], weights=bw[real], minlength=len(nodes))[single]
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
    # node sets (sources or destinations) are shared by many commodities: one row per distinct set
    set_id: dict[tuple[str, ...], int] = {}
    ps = np.array([set_id.setdefault(c.sources, len(set_id)) for c in dem.commodities], dtype=np.int64)
    pd = np.array([set_id.setdefault(c.dests, len(set_id)) for c in dem.commodities], dtype=np.int64)
    size = np.array([len(names) for names in set_id], dtype=np.int64)
    set_ptr = np.concatenate([[0], np.cumsum(size)])
    set_nodes = np.array([cut.idx[x] for names in set_id for x in names], dtype=np.int64)
    nb = np.array([c.nbytes for c in dem.commodities], dtype=np.float64)
    nk = len(nb)
    # (commodity, destination) pairs, and whether the destination is also a source of it
    dk = np.repeat(np.arange(nk), size[pd])
    dn = set_nodes[np.arange(len(dk)) - np.repeat(_excl(size[pd]), size[pd]) + np.repeat(set_ptr[pd], size[pd])]
    sk = np.repeat(np.arange(nk), size[ps])
    s_keys = np.sort(sk * nn + set_nodes[np.arange(len(sk)) - np.repeat(_excl(size[ps]), size[ps])
                                         + np.repeat(set_ptr[ps], size[ps])])
    outside = ~np.isin(dk * nn + dn, s_keys)
    best = 0.0

    def worst(inn: np.ndarray, out: np.ndarray, bw_in: np.ndarray, bw_out: np.ndarray) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(inn > 0, inn / bw_in, 0.0)
            b = np.where(out > 0, out / bw_out, 0.0)
        return float(max(a.max(initial=0.0), b.max(initial=0.0)))

    if len(cut.single):  # single GPUs and storage
        pos = np.full(nn, -1, dtype=np.int64)
        pos[cut.single] = np.arange(len(cut.single))
        m = outside & (pos[dn] >= 0)
        inn = np.bincount(pos[dn[m]], weights=nb[dk[m]], minlength=len(cut.single))
        s0 = set_nodes[set_ptr[:-1][ps]]  # the first source
        rest = size[pd] - np.bincount(dk[~outside], minlength=nk)  # destinations that are not a source
        m = (size[ps] == 1) & (pos[s0] >= 0) & (rest > 0)
        out = np.bincount(pos[s0[m]], weights=nb[m], minlength=len(cut.single))
        best = max(best, worst(inn, out, cut.single_in, cut.single_out))
    unions, union_in, union_out = cut.unions, cut.union_in, cut.union_out
    hosts_of = np.zeros((len(size), len(cut.host_in)), dtype=bool)  # (sets, hosts + 1)
    hosts_of[np.repeat(np.arange(len(size)), size), cut.node_host[set_nodes]] = True
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
        if len(cut.host_in) - 1 > _ALL_UNIONS:  # single hosts and pairs: two columns each
            first = unions.argmax(1)
            second = unions.shape[1] - 1 - unions[:, ::-1].argmax(1)
            in_u = hosts_of[:, first].astype(np.int32) + (hosts_of[:, second] & (second != first))
        else:
            in_u = np.einsum("kh,uh->ku", hosts_of, unions, dtype=np.int32)  # (sets, unions): hosts inside
        cnt = hosts_of.sum(1)[:, None]
        s_in, d_in = in_u[ps], in_u[pd]
        inn = _dot(nb, (s_in == 0) & (d_in > 0))
        out = _dot(nb, (s_in == cnt[ps]) & (d_in < cnt[pd]))
        best = max(best, worst(inn, out, union_in, union_out))
    return max(best, _path_latency(topology, ps, dk, dn, outside, set_ptr, set_nodes))


def _excl(x: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums."""
    return np.concatenate([[0], np.cumsum(x)[:-1]]) if len(x) else x
