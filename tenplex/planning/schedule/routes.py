"""Routes a chunk can take: per-commodity route options (shortest-path trees, per-destination and
link-avoiding paths), per-topology fastest-path tables and greedy routes built in bulk from them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ...errors import PlanError
from ..topology import Topology
from .arrays import excl_cumsum
from .commodities import Demands


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Option:
    """A way to deliver a commodity's chunk to some of its destinations from one source."""

    commodity: int
    source: str
    paths: dict[str, tuple[str, ...]]  # destination -> node path
    links: np.ndarray  # distinct links used
    hop_link: np.ndarray
    hop_parent: np.ndarray
    dest_hop: dict[str, int]


def merge_paths(topology: Topology, paths: list[tuple[str, ...]]) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
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


def _option(topology: Topology, k: int, source: str, paths: dict[str, tuple[str, ...]]) -> Option:
    hl, hp, dh = merge_paths(topology, list(paths.values()))
    return Option(k, source, paths, np.unique(hl), hl, hp, dh)


def _alt_path(topology: Topology, s: str, d: str, first: tuple[str, ...], ref: float) -> tuple[str, ...] | None:
    import networkx as nx  # lazy: 0.2-0.5 s that a checkpoint load or save (import tenplex) need not pay

    used = set(zip(first, first[1:]))
    try:
        p = nx.dijkstra_path(topology.graph, s, d, weight=lambda u, v, a: (a["latency"] + ref / a["bandwidth"])
                             * (20.0 if (u, v) in used else 1.0))
    except nx.NetworkXNoPath:
        return None
    return tuple(p) if tuple(p) != first else None


def route_options(topology: Topology, dem: Demands, ref: float, alt: bool) -> list[list[Option]]:
    """Route options per commodity: per source a shortest-path tree to all destinations; with several
    destinations also per (source, destination) paths; with ``alt`` a second, link-avoiding path."""
    out: list[list[Option]] = []
    memo: dict[tuple[str, tuple[str, ...]], Option] = {}
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
class Routes:
    """Routes (forests of hops) concatenated: route r's hops are ``start[r]:start[r + 1]``, with
    parents as offsets within the route (-1 at a source); ``of_chunk``: the route of every chunk."""

    hop_link: np.ndarray
    hop_parent: np.ndarray
    start: np.ndarray
    of_chunk: np.ndarray

    @classmethod
    def of(cls, forests: list[tuple[np.ndarray, np.ndarray]], of_chunk: np.ndarray) -> Routes:
        n = np.array([len(hl) for hl, _ in forests], dtype=np.int64)
        return cls(np.concatenate([hl for hl, _ in forests]), np.concatenate([hp for _, hp in forests]),
                   np.concatenate([[0], np.cumsum(n)]), of_chunk)


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Net:
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
def net_of(topology: Topology, ref: float) -> Net:
    """:class:`Net` of ``topology`` for messages of ``ref`` bytes (cached: schedules reuse topologies)."""
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
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
    return Net(nodes, idx, host, dist, link, path, depth, lat)


def _forests(net: Net, route: np.ndarray, src: np.ndarray, dst: np.ndarray, n_routes: int) -> Routes:
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
    return Routes(net.link[prev, nodes], parent, start, np.zeros(0, dtype=np.int64))


def greedy_choices(dem: Demands, opts: list[list[Option]], topology: Topology,
                    ref: float) -> list[list[Option]]:
    """Per commodity, one route per candidate source: destinations with a candidate source on their
    own host take it (the nearest one), the others the source's shortest-path tree."""
    out: list[list[Option]] = []
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
            hl, hp, dh = merge_paths(topology, [paths[d] for d in com.dests])
            choices.append(Option(k, o.source, paths, np.unique(hl), hl, hp, dh))
        out.append(choices)
    return out


def greedy_routes(dem: Demands, net: Net) -> tuple[Routes, np.ndarray]:
    """Per commodity, one route per candidate source (commodity k's are ``cand[k]:cand[k + 1]``):
    destinations with a candidate source on their own host take the nearest one, the others the
    source's shortest-path tree (one route when every destination has a local source).

    Built for all commodities at once (the bulk form of :func:`greedy_choices` over trees)."""
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
    rj = np.arange(len(rk)) - np.repeat(excl_cumsum(n_routes), n_routes)
    e_src = np.where(local[rk], loc[rk], srcs[rk, rj][:, None]).reshape(-1)
    e_dst = dsts[rk].reshape(-1)
    e_route = np.repeat(np.arange(len(rk)), dmax)
    keep = e_dst >= 0
    return (_forests(net, e_route[keep], e_src[keep], e_dst[keep], len(rk)),
            np.concatenate([[0], np.cumsum(n_routes)]))


