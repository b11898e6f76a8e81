"""The lower bound a schedule is measured against: cuts with the best choice of sources and
multicast, and path latency (the naive baseline it is compared with is in naive.py)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from ..topology import Topology
from .arrays import excl_cumsum, member
from .commodities import Demands, commodity_nbytes


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
    single: np.ndarray  # GPU and storage nodes
    single_in: np.ndarray
    single_out: np.ndarray
    unions: np.ndarray  # (unions, hosts + 1) bool; up to _ALL_UNIONS hosts (else none: see _host_cuts)
    union_in: np.ndarray
    union_out: np.ndarray
    # beyond _ALL_UNIONS hosts: single hosts, pairs joined by a link, and (per demands) pairs that
    # hold every replica of a piece (_host_cuts); bandwidth into / out of each host and between linked pairs
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
    if len(hosts) <= _ALL_UNIONS:  # every union: masks, and the links crossing each
        sizes = range(1, len(hosts) + (len(hosts) == 1))  # a proper union (the whole cluster has no cut)
        combos = [c for r in sizes for c in itertools.combinations(range(len(hosts)), r)]
        u = np.zeros((len(combos), nh), dtype=bool)
        for i, cmb in enumerate(combos):
            u[i, list(cmb)] = True
        lin = u[:, hd] & ~u[:, hs]
        lout = u[:, hs] & ~u[:, hd]
        u_in, u_out = lin.astype(np.float64) @ bw, lout.astype(np.float64) @ bw
    else:  # single hosts and pairs without masks (_host_cuts): a (unions, hosts) mask was 268 M cells at 16,384 hosts
        u, u_in, u_out = np.zeros((0, nh), dtype=bool), np.zeros(0), np.zeros(0)
    return _Cuts(idx, node_host, single, single_in, single_out, u, u_in, u_out, host_in, host_out, pair_bw)


def _host_cuts(cut: _Cuts, ps: np.ndarray, pd: np.ndarray, size: np.ndarray, set_nodes: np.ndarray,
               nb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bytes into and out of every single host and every pair of hosts that can bound more than
    its hosts alone (joined by a link, or holding every replica of some piece), and the bandwidth
    into and out of each: the cut bound of :func:`lower_bound` beyond ``_ALL_UNIONS`` hosts.

    Sparse: from the distinct (node set, host) incidences, never a (sets, unions) table (issue
    #20: 13 GB and 26 s at 16,384 hosts). A commodity counts once per union: ingress when some
    destination and no candidate source is inside, egress when every candidate source is
    inside (none on storage) and some destination outside."""
    nh = len(cut.host_in)
    h_n = nh - 1  # column of the nodes on no host
    n_sets = len(size)
    key = np.unique(np.repeat(np.arange(n_sets), size) * nh + cut.node_host[set_nodes])
    inc_set, inc_host = key // nh, key % nh
    ptr = np.searchsorted(inc_set, np.arange(n_sets + 1))
    n_hosts = np.diff(ptr)  # hosts of every set (the column of no host included)
    nk = len(nb)

    def hosts_of(sets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, host) of every host of ``sets[row]``."""
        cnt = n_hosts[sets]
        row = np.repeat(np.arange(len(sets)), cnt)
        return row, inc_host[np.repeat(ptr[sets], cnt) + np.arange(int(cnt.sum())) - np.repeat(excl_cumsum(cnt), cnt)]

    def has(sets: np.ndarray, hosts: np.ndarray) -> np.ndarray:
        return member(sets * nh + hosts, key)

    dk, dh = hosts_of(pd)  # (commodity, destination host)
    real = dh < h_n
    dk, dh = dk[real], dh[real]
    src_in = has(ps[dk], dh)
    inn = np.bincount(dh[~src_in], weights=nb[dk[~src_in]], minlength=h_n)
    h1 = inc_host[ptr[ps]]  # a source set's first host
    one = (n_hosts[ps] == 1) & (h1 < h_n)
    go = one & (n_hosts[pd] > has(pd, h1))
    out = np.bincount(h1[go], weights=nb[go], minlength=h_n)
    # pairs: joined by a link, or the hosts of a source set of two hosts
    h2 = inc_host[np.minimum(ptr[ps] + 1, len(inc_host) - 1)]  # its second (where it has one)
    two = np.flatnonzero((n_hosts[ps] == 2) & (h2 < h_n))
    pk = np.unique(np.r_[h1[two] * nh + h2[two],
                         np.array([a * nh + b for a, b in cut.pair_bw], dtype=np.int64)])
    pa, pb = pk // nh, pk % nh
    inner = np.array([cut.pair_bw.get((a, b), 0.0) for a, b in zip(pa.tolist(), pb.tolist())])
    bw_in = np.r_[cut.host_in[:h_n], cut.host_in[pa] + cut.host_in[pb] - inner]
    bw_out = np.r_[cut.host_out[:h_n], cut.host_out[pa] + cut.host_out[pb] - inner]
    if not len(pk):
        return inn, out, bw_in, bw_out
    # host -> pairs holding it (CSR)
    ph = np.r_[pa, pb]
    po = np.argsort(ph, kind="stable")
    h_ptr = np.searchsorted(ph[po], np.arange(h_n + 1))
    h_pair = np.r_[np.arange(len(pk)), np.arange(len(pk))][po]

    def pairs_of(rows: np.ndarray, hosts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cnt = h_ptr[hosts + 1] - h_ptr[hosts]
        at = np.repeat(h_ptr[hosts], cnt) + np.arange(int(cnt.sum())) - np.repeat(excl_cumsum(cnt), cnt)
        return np.repeat(rows, cnt), h_pair[at]

    k2, p2 = pairs_of(dk, dh)  # commodities with a destination in the pair, once each
    kp = np.unique(k2 * len(pk) + p2)
    k2, p2 = kp // len(pk), kp % len(pk)
    free = ~has(ps[k2], pa[p2]) & ~has(ps[k2], pb[p2])
    p_in = np.bincount(p2[free], weights=nb[k2[free]], minlength=len(pk))
    k1, p1 = pairs_of(np.flatnonzero(one), h1[one])  # every source on one host of the pair
    at = np.searchsorted(pk, h1[two] * nh + h2[two])  # or on both
    k1, p1 = np.r_[k1, two], np.r_[p1, at]
    inside = has(pd[k1], pa[p1]).astype(np.int64) + has(pd[k1], pb[p1])
    go = n_hosts[pd[k1]] > inside
    p_out = np.bincount(p1[go], weights=nb[k1[go]], minlength=len(pk))
    return np.r_[inn, p_in], np.r_[out, p_out], bw_in, bw_out


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
    nb = commodity_nbytes(dem).astype(np.float64)
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
    if len(cut.host_in) - 1 > _ALL_UNIONS:  # single hosts and pairs, sparse
        best = max(best, worst(*_host_cuts(cut, ps, pd, size, set_nodes, nb)))
    elif len(cut.unions):  # every union of hosts (column H: nodes on no host, never inside a union)
        hosts_of = np.zeros((len(size), len(cut.host_in)), dtype=bool)  # (sets, hosts + 1)
        hosts_of[np.repeat(np.arange(len(size)), size), cut.node_host[set_nodes]] = True
        in_u = np.einsum("kh,uh->ku", hosts_of, cut.unions, dtype=np.int32)  # (sets, unions): hosts inside
        cnt = hosts_of.sum(1)[:, None]
        s_in, d_in = in_u[ps], in_u[pd]
        inn = _dot(nb, (s_in == 0) & (d_in > 0))
        out = _dot(nb, (s_in == cnt[ps]) & (d_in < cnt[pd]))
        best = max(best, worst(inn, out, cut.union_in, cut.union_out))
    return max(best, _path_latency(topology, ps, dk, dn, outside, set_ptr, set_nodes))


def _excl(x: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums."""
    return np.concatenate([[0], np.cumsum(x)[:-1]]) if len(x) else x
