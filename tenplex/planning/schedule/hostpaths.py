"""Fastest paths on a cluster of identical hosts, each joined to the rest by one node (its portal,
e.g. the NIC; pure: no I/O).

A path between two hosts is the fastest path inside the source host to its portal, the fastest
path between the portals over the *core* (the nodes on no host, such as switches and storage,
and the portals) and the fastest path inside the destination host from its portal. This is
exact: a path leaves a host and enters one only through its portal, and a path that passed a
portal twice would hold a cycle. So one all-pairs table of the host graph serves every host,
and a Dijkstra per source portal runs on the small core graph, instead of one per GPU (or per
NVSwitch and host memory) on the whole topology: issue #20, 12 s of the 16,384-GPU schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import PlanError
from ..topology import Topology
from .arrays import excl_cumsum


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class HostPaths:
    """The tables :func:`host_paths` builds once per topology."""

    node_host: np.ndarray  # host row of every node, -1 for core nodes on no host
    node_local: np.ndarray  # index of every node within its host (by node order)
    portal: np.ndarray  # node of each host's portal
    p_loc: int  # the portal's local index (the same in every host)
    loc_links: np.ndarray  # (local, local, depth) local link indices of the fastest path, -1 padded
    loc_len: np.ndarray  # (local, local) links on it; -1 where there is no path
    host_links: np.ndarray  # (hosts, local links) the topology's link of each host's local link
    core_of: np.ndarray  # compact core index of every node, -1 off the core
    core_mat: Any  # the core graph (scipy CSR, compact indices)
    core_key: np.ndarray  # sorted tail * cores + head of the core links
    core_link: np.ndarray  # their link indices


def _weights(topology: Topology, ref: float) -> np.ndarray:
    return topology.latency + ref / topology.bandwidth


@functools.lru_cache(maxsize=8)
def host_paths(topology: Topology, ref: float) -> HostPaths | None:
    """:class:`HostPaths` of ``topology`` for messages of ``ref`` bytes, or None where its hosts
    are not identical (same nodes in the same order, same links, bandwidths and latencies) or
    one has no single portal (cached: schedules reuse topologies)."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    nn = len(topology.node_names)
    raw = [topology.graph.nodes[n].get("host") for n in topology.node_names]
    ids = sorted({h for h in raw if h is not None})
    if not ids:
        return None
    row_of = {h: i for i, h in enumerate(ids)}
    node_host = np.array([-1 if h is None else row_of[h] for h in raw], dtype=np.int64)
    n_hosts = len(ids)
    counts = np.bincount(node_host[node_host >= 0], minlength=n_hosts)
    if np.any(counts != counts[0]):
        return None
    n_loc = int(counts[0])
    on = np.flatnonzero(node_host >= 0)
    on = on[np.argsort(node_host[on], kind="stable")]  # by host, then node order
    node_local = np.full(nn, -1, dtype=np.int64)
    node_local[on] = np.tile(np.arange(n_loc), n_hosts)
    u, v = topology.link_src, topology.link_dst
    hu, hv = node_host[u], node_host[v]
    cross = hu != hv
    ends = np.concatenate([u[cross & (hu >= 0)], v[cross & (hv >= 0)]])
    ends = np.unique(ends)
    if len(ends) != n_hosts or len(np.unique(node_host[ends])) != n_hosts:
        return None  # a host with no portal, or with several
    portal = ends[np.argsort(node_host[ends])]
    p_loc = int(node_local[portal[0]])
    if np.any(node_local[portal] != p_loc):
        return None
    intra = np.flatnonzero(~cross & (hu >= 0))
    if len(intra) % n_hosts:
        return None
    k = len(intra) // n_hosts
    lu, lv = node_local[u[intra]], node_local[v[intra]]
    intra = intra[np.lexsort((lv, lu, hu[intra]))]
    host_links = intra.reshape(n_hosts, k)
    lu, lv = node_local[u[host_links]], node_local[v[host_links]]
    bw, lat = topology.bandwidth[host_links], topology.latency[host_links]
    for a in (lu, lv, bw, lat):
        if not np.array_equal(a, np.broadcast_to(a[0], a.shape)):
            return None  # hosts differ
    w = _weights(topology, ref)
    mat = csr_matrix((w[host_links[0]], (lu[0], lv[0])), shape=(n_loc, n_loc))
    dist, pred = dijkstra(mat, directed=True, return_predecessors=True)
    local_link = {(a, b): j for j, (a, b) in enumerate(zip(lu[0].tolist(), lv[0].tolist()))}
    paths: dict[tuple[int, int], list[int]] = {}
    for a in range(n_loc):
        for b in range(n_loc):
            if a == b or not np.isfinite(dist[a, b]):
                continue
            seq, cur = [], b
            while cur != a:
                prev = int(pred[a, cur])
                seq.append(local_link[(prev, cur)])
                cur = prev
            paths[(a, b)] = seq[::-1]
    depth = max((len(p) for p in paths.values()), default=1)
    loc_links = np.full((n_loc, n_loc, depth), -1, dtype=np.int64)
    loc_len = np.full((n_loc, n_loc), -1, dtype=np.int64)
    np.fill_diagonal(loc_len, 0)
    for (a, b), p in paths.items():
        loc_links[a, b, : len(p)] = p
        loc_len[a, b] = len(p)
    core = np.flatnonzero(node_host < 0)
    core = np.sort(np.concatenate([core, portal]))
    core_of = np.full(nn, -1, dtype=np.int64)
    core_of[core] = np.arange(len(core))
    nc = len(core)
    cl = np.flatnonzero((core_of[u] >= 0) & (core_of[v] >= 0))
    cu, cv = core_of[u[cl]], core_of[v[cl]]
    core_mat = csr_matrix((w[cl], (cu, cv)), shape=(nc, nc))
    key = cu * nc + cv
    order = np.argsort(key, kind="stable")
    return HostPaths(node_host, node_local, portal, p_loc, loc_links, loc_len, host_links, core_of, core_mat,
                     key[order], cl[order])


def host_flow_paths(hp: HostPaths, topology: Topology, src: np.ndarray, dst: np.ndarray,
                    walk: Any) -> tuple[np.ndarray, np.ndarray]:
    """Links of the fastest path of every ``src[i] -> dst[i]`` (node indices), concatenated in
    flow order, source to destination, and the flows' offsets into them (``ptr``). ``walk``: the
    batched Dijkstra walk of naive.py (``_walk``), run on the core graph for the distinct pairs
    of portals."""
    n = len(src)
    hs, hd = hp.node_host[src], hp.node_host[dst]
    same = (hs == hd) & (hs >= 0)
    ls, ld = hp.node_local[src], hp.node_local[dst]
    # segment A: inside the source host (to its portal, or to the destination on the same host)
    a_to = np.where(same, ld, hp.p_loc)
    has_a = (hs >= 0) & (src != dst)
    la = np.where(has_a, hp.loc_len[np.maximum(ls, 0), np.maximum(a_to, 0)], 0)
    # segment C: inside the destination host, from its portal
    has_c = (hd >= 0) & ~same
    lc = np.where(has_c, hp.loc_len[hp.p_loc, np.maximum(ld, 0)], 0)
    if np.any(la < 0) or np.any(lc < 0):
        bad = int(np.flatnonzero((la < 0) | (lc < 0))[0])
        raise PlanError(f"the topology has no path from {topology.node_names[src[bad]]} to "
                        f"{topology.node_names[dst[bad]]}")
    # segment B: between portals (or hostless ends) over the core
    cs = np.where(hs >= 0, hp.core_of[hp.portal[np.maximum(hs, 0)]], hp.core_of[src])
    ce = np.where(hd >= 0, hp.core_of[hp.portal[np.maximum(hd, 0)]], hp.core_of[dst])
    has_b = ~same & (cs != ce)
    nc = hp.core_mat.shape[0]
    pair_key = cs * nc + ce
    uniq, pair = np.unique(pair_key[has_b], return_inverse=True)
    pf, pl, pp, cost = walk(hp.core_mat, uniq // nc, uniq % nc, hp.core_key, hp.core_link, nc)
    if not np.all(np.isfinite(cost)):
        u_bad = int(np.flatnonzero(~np.isfinite(cost))[0])
        bad = int(np.flatnonzero(has_b)[np.flatnonzero(pair == u_bad)[0]])
        raise PlanError(f"the topology has no path from {topology.node_names[src[bad]]} to "
                        f"{topology.node_names[dst[bad]]}")
    o = np.lexsort((pp, pf))
    core_links = pl[o]
    core_ptr = np.searchsorted(pf[o], np.arange(len(uniq) + 1))
    lb = np.zeros(n, dtype=np.int64)
    fb = np.flatnonzero(has_b)
    lb[fb] = np.diff(core_ptr)[pair]
    total = la + lb + lc
    ptr = np.concatenate([[0], np.cumsum(total)])
    links = np.empty(int(ptr[-1]), dtype=np.int64)

    def fill(lens: np.ndarray, offset: np.ndarray, values: Any) -> None:
        f = np.flatnonzero(lens > 0)
        cnt = lens[f]
        fr = np.repeat(f, cnt)
        j = np.arange(int(cnt.sum())) - np.repeat(excl_cumsum(cnt), cnt)
        links[ptr[fr] + offset[fr] + j] = values(fr, j)

    zero = np.zeros(n, dtype=np.int64)
    fill(la, zero, lambda f, j: hp.host_links[hs[f], hp.loc_links[ls[f], a_to[f], j]])
    slot = np.zeros(n, dtype=np.int64)
    slot[fb] = pair
    fill(lb, la, lambda f, j: core_links[core_ptr[slot[f]] + j])
    fill(lc, la + lb, lambda f, j: hp.host_links[hd[f], hp.loc_links[hp.p_loc, ld[f], j]])
    return links, ptr
