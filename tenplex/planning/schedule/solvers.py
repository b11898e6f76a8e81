"""The solvers that route chunks: the fluid LP and its rounding to chunks, the greedy load-aware
assignment, and the time-expanded MILP (TE-CCL with copy, one shot or in rounds)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np

from ..topology import Topology
from .commodities import Demands
from .listsched import Chunks
from .routes import Option, Routes, merge_paths

log = logging.getLogger(__name__)

_MILP_MAX_VARS = 20000
_MILP_ROUNDS_MAX = 200_000  # option x epoch pairs beyond which even rounds take too long


def _spread(counts: list[int]) -> list[int]:
    """Interleave option indices in proportion to their counts: [2, 1] -> [0, 1, 0]."""
    keys = [((i + 0.5) / c, o) for o, c in enumerate(counts) for i in range(c)]
    keys.sort()
    return [o for _, o in keys]


def _largest_remainder(weights: np.ndarray, n: int) -> list[int]:
    w = np.maximum(np.asarray(weights, dtype=np.float64), 0)
    if n <= 0:
        return [0] * len(w)
    if w.sum() <= 0:
        w = np.ones(len(w))
    q = w / w.sum() * n
    base = np.floor(q).astype(np.int64)
    rest = n - int(base.sum())
    if rest > 0:
        base[np.argsort(-(q - base), kind="stable")[:rest]] += 1
    return base.tolist()


def static_lp(topology: Topology, dem: Demands, opts: list[list[Option]], time_limit: float) -> np.ndarray | None:
    """Fluid LP: min T s.t. every link's bytes / bandwidth <= T; every (commodity, destination) covered.

    Returns the fraction of each commodity sent on each option (flattened), or None.
    """
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    flat = [o for os_ in opts for o in os_]
    nv = len(flat) + 1
    rows, cols, vals = [], [], []
    bw = topology.bandwidth
    cost = np.zeros(nv)
    cost[-1] = 1.0
    total = sum(c.nbytes / bw.max() for c in dem.commodities) or 1.0
    cov_row: dict[tuple[int, str], int] = {}
    nl = len(bw)
    for j, o in enumerate(flat):
        v = dem.commodities[o.commodity].nbytes
        rows.extend(o.links.tolist())
        cols.extend([j] * len(o.links))
        vals.extend((v / bw[o.links]).tolist())
        cost[j] = 1e-3 * float((v / bw[o.links]).sum()) / total
        for d in o.paths:
            r = cov_row.setdefault((o.commodity, d), nl + len(cov_row))
            rows.append(r)
            cols.append(j)
            vals.append(-1.0)
    rows.extend(range(nl))
    cols.extend([nv - 1] * nl)
    vals.extend([-1.0] * nl)
    nr = nl + len(cov_row)
    a = coo_matrix((vals, (rows, cols)), shape=(nr, nv)).tocsr()
    b = np.concatenate([np.zeros(nl), -np.ones(len(cov_row))])
    bounds = [(0, 1)] * (nv - 1) + [(0, None)]
    res = linprog(cost, A_ub=a, b_ub=b, bounds=bounds, method="highs",
                  options={"time_limit": max(time_limit, 0.01), "presolve": True})
    if res.status != 0 or res.x is None:
        log.info("fluid LP did not solve (%s)", res.message)
        return None
    log.info("fluid LP: %d options, T = %.4f s", nv - 1, res.x[-1])
    return res.x[:-1]


def assign_lp(dem: Demands, opts: list[list[Option]], frac: np.ndarray, chunk_com: np.ndarray,
               chunk_idx: np.ndarray, topology: Topology) -> Routes:
    """Round LP fractions to a route per chunk (a forest from one or several sources)."""
    of_chunk = np.zeros(len(chunk_com), dtype=np.int64)
    forests: list[tuple[np.ndarray, np.ndarray]] = []
    counts = np.bincount(chunk_com, minlength=len(dem.commodities))
    starts = np.concatenate([[0], np.cumsum(counts)])
    pos = 0
    cache: dict[tuple[int, ...], int] = {}
    for k, com in enumerate(dem.commodities):
        os_ = opts[k]
        f = frac[pos : pos + len(os_)]
        pos += len(os_)
        c0, n = int(starts[k]), int(counts[k])
        full = [i for i, o in enumerate(os_) if len(o.paths) == len(com.dests)]
        ft = float(sum(f[i] for i in full))
        m_full = min(n, int(round(min(ft, 1.0) * n))) if len(com.dests) > 1 else n
        seq_full = _spread(_largest_remainder(f[full], m_full)) if m_full else []
        rest = n - m_full
        per_dest: dict[str, list[int]] = {}
        if rest:
            for d in com.dests:
                cand = [i for i, o in enumerate(os_) if d in o.paths and i not in full]
                w = np.array([f[i] for i in cand])
                if not cand or w.sum() <= 1e-12:
                    cand = [i for i in full] or cand
                    w = np.array([f[i] for i in cand])
                per_dest[d] = [cand[j] for j in _spread(_largest_remainder(w, rest))]
        for j in range(n):
            if j < m_full:
                key: tuple[int, ...] = (full[seq_full[j]],)
            else:
                key = tuple(per_dest[d][j - m_full] for d in com.dests)
            hit = cache.get((k, *key))
            if hit is None:
                if len(key) == 1:
                    hl, hp = os_[key[0]].hop_link, os_[key[0]].hop_parent
                else:
                    hl, hp, _ = merge_paths(topology, [os_[i].paths[d] for i, d in zip(key, com.dests)])
                hit = cache[(k, *key)] = len(forests)
                forests.append((hl, hp))
            of_chunk[c0 + j] = hit
    return Routes.of(forests, of_chunk)


def assign_greedy(routes: Routes, cand: np.ndarray, chunk_com: np.ndarray, chunk_nb: np.ndarray,
                   chunk_key: np.ndarray, order: np.ndarray, topology: Topology) -> Routes:
    """Per chunk (in priority ``order``), the candidate route with the lowest resulting
    ``max_e (load_e + chunk) / bandwidth_e``.

    Commodities with one route load their links in proportion to their progress (``chunk_key``,
    as in the fluid schedule), so only the chunks that have a choice are visited one by one.
    """
    nl = len(topology.bandwidth)
    n_cand = np.diff(cand)
    r_com = np.repeat(np.arange(len(n_cand)), n_cand)
    hop_route = np.repeat(np.arange(len(r_com)), np.diff(routes.start))
    com_bytes = np.bincount(chunk_com, weights=chunk_nb, minlength=len(n_cand))
    fixed = np.bincount(routes.hop_link, weights=np.where(n_cand[r_com[hop_route]] == 1,
                                                          com_bytes[r_com[hop_route]], 0.0), minlength=nl + 1)
    pick = cand[:-1][chunk_com]
    multi = order[n_cand[chunk_com[order]] > 1]
    if len(multi):
        n_hops = np.diff(routes.start)
        padded = np.full((len(r_com), int(n_hops.max())), nl, dtype=np.int64)  # link nl: none (no load, no limit)
        padded[hop_route, np.arange(len(hop_route)) - routes.start[hop_route]] = routes.hop_link
        inv_bw = np.append(1.0 / topology.bandwidth, 0.0)
        load = np.zeros(nl + 1)
        coms, nbs, keys = chunk_com[multi].tolist(), chunk_nb[multi].tolist(), chunk_key[multi].tolist()
        cl = cand.tolist()
        per_com: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for c, k, b, x in zip(multi.tolist(), coms, nbs, keys):
            got = per_com.get(k)
            if got is None:
                rows = padded[cl[k] : cl[k + 1]]
                got = per_com[k] = (rows, fixed[rows], inv_bw[rows])
            rows, fix, inv = got
            j = int((((fix * x + load[rows]) + b) * inv).max(1).argmin())
            load[rows[j]] += b  # a route's links are distinct (padding: link nl, never read)
            pick[c] += j
    return dataclasses.replace(routes, of_chunk=pick)


_Offsets = list[list[tuple[np.ndarray, dict[str, int]]]]  # per commodity, per option: hop offsets, arrivals


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _TimeExpanded:
    """The time-expanded network of the MILP: route options ``opts``, epoch length ``tau``,
    per-link capacity ``cap`` (chunks per epoch), latency ``lat_ep`` (epochs) and every option's
    hop offsets and arrivals ``offs``."""

    opts: list[list[Option]]
    tau: float
    cap: np.ndarray
    lat_ep: np.ndarray
    offs: _Offsets


def _te_setup(topology: Topology, opts: list[list[Option]], chunk_bytes: int) -> _TimeExpanded:
    """Epoch length, per-link capacity (chunks per epoch), latency (epochs) and every option's hop offsets.

    Epoch: the time the slowest used link needs for one chunk; capacity floor(bandwidth * tau /
    chunk); a hop takes one epoch plus its latency in epochs (store-and-forward).
    """
    used = np.unique(np.concatenate([o.links for os_ in opts for o in os_]))
    bw = topology.bandwidth
    tau = chunk_bytes / float(bw[used].min())
    cap = np.floor(bw * tau / chunk_bytes + 1e-9)
    lat_ep = np.rint(topology.latency / tau).astype(np.int64)
    offs = []
    for os_ in opts:
        row = []
        for o in os_:
            off = np.zeros(len(o.hop_link), dtype=np.int64)
            for i, p in enumerate(o.hop_parent):
                off[i] = 0 if p < 0 else off[p] + 1 + lat_ep[o.hop_link[p]]
            arr = {d: int(off[h] + 1 + lat_ep[o.hop_link[h]]) for d, h in o.dest_hop.items()}
            row.append((off, arr))
        offs.append(row)
    return _TimeExpanded(opts, tau, cap, lat_ep, offs)


def _te_solve(te: _TimeExpanded, resv: np.ndarray, t0: int, t1: int, need: dict[tuple[int, str], int], exact: bool,
              time_limit: float) -> list[tuple[int, int, int, int]] | None:
    """One MILP over start epochs [t0, t1): x[k, option, t] chunks; capacity minus reservations ``resv``.

    ``exact``: every (commodity, destination) gets exactly ``need`` chunks (single shot, objective
    the sum of delivery epochs); otherwise at most ``need`` (a round: deliver as much as possible,
    early first). Returns (commodity, option, epoch, count) or None.
    """
    # lazy: importing scipy takes ~0.45 s, which `import tenplex` should not pay
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    opts, offs, cap = te.opts, te.offs, te.cap
    nl, horizon = resv.shape
    var: list[tuple[int, int, int]] = []
    rows, cols, vals, cost = [], [], [], []
    cov: dict[tuple[int, str], int] = {}
    big = 10.0 * horizon
    for k, os_ in enumerate(opts):
        for oi, o in enumerate(os_):
            if any(need.get((k, d), 0) <= 0 for d in o.paths):
                continue
            off, arr = offs[k][oi]
            last = max(arr.values())
            for t in range(t0, min(t1, horizon - last)):
                j = len(var)
                var.append((k, oi, t))
                rows.extend((o.hop_link * horizon + t + off).tolist())
                cols.extend([j] * len(off))
                vals.extend([1.0] * len(off))
                cost.append(sum(t + a - (0 if exact else big) for a in arr.values()) + 1e-3 * len(off))
                for d in o.paths:
                    r = cov.setdefault((k, d), nl * horizon + len(cov))
                    rows.append(r)
                    cols.append(j)
                    vals.append(1.0)
    if not var or len(var) > _MILP_MAX_VARS:
        log.info("MILP round skipped: %d variables (limit %d)", len(var), _MILP_MAX_VARS)
        return None
    nr = nl * horizon + len(cov)
    a = coo_matrix((vals, (rows, cols)), shape=(nr, len(var))).tocsr()
    want = np.array([float(need[kd]) for kd in cov])
    ub = np.concatenate([np.maximum(np.repeat(cap, horizon) - resv.reshape(-1), 0), want])
    lb = np.concatenate([np.zeros(nl * horizon), want if exact else np.zeros(len(cov))])
    keep = np.flatnonzero(a.getnnz(axis=1))  # rows no variable touches
    ub_x = np.array([float(min(need[(k, d)] for d in opts[k][oi].paths)) for k, oi, _ in var])
    res = milp(np.asarray(cost), constraints=LinearConstraint(a[keep], lb[keep], ub[keep]),
               integrality=np.ones(len(var)), bounds=Bounds(0, ub_x),
               options={"time_limit": max(time_limit, 0.01), "mip_rel_gap": 1e-4})
    if res.x is None:
        log.info("MILP found no solution (%s)", res.message)
        return None
    x = np.rint(res.x).astype(np.int64)
    log.info("MILP epochs [%d, %d): %d variables, %d rows, status %s", t0, t1, len(var), len(keep), res.status)
    return [(*var[j], int(x[j])) for j in np.flatnonzero(x)]


def _te_extract(dem: Demands, te: _TimeExpanded, sends: list[tuple[int, int, int, int]],
                chunks: Chunks) -> dict[str, Any]:
    """Chunk-level hops from (commodity, option, epoch, count) sends.

    Chunk i of commodity k, destination d, takes the i-th send instance covering d: full-coverage
    instances first in one canonical order, so a multicast instance serves the same chunk everywhere.
    """
    opts, offs, lat_ep = te.opts, te.offs, te.lat_ep
    chunk_com, chunk_nb = chunks.commodity, chunks.nbytes
    n_k = np.bincount(chunk_com, minlength=len(dem.commodities))
    inst: dict[int, list[tuple[int, int, int]]] = {}
    for k, oi, t, cnt in sends:
        for m in range(cnt):
            inst.setdefault(k, []).append((oi, t, m))
    chunk_first = np.concatenate([[0], np.cumsum(n_k)[:-1]])
    H: dict[str, list[int]] = {kk: [] for kk in ("chunk", "link", "parent", "first", "last", "arrival")}
    S: dict[str, list[Any]] = {"hop": [], "epoch": [], "nbytes": []}
    for k, com in enumerate(dem.commodities):
        os_ = opts[k]
        full = sorted(i for i in inst.get(k, []) if len(os_[i[0]].paths) == len(com.dests))
        part = sorted((i for i in inst.get(k, []) if len(os_[i[0]].paths) < len(com.dests)), key=lambda i: i[1])
        lists = {d: full + [i for i in part if d in os_[i[0]].paths] for d in com.dests}
        for ci in range(int(n_k[k])):
            c = int(chunk_first[k]) + ci
            seen: dict[tuple[int, int, int, int], int] = {}
            for d in com.dests:
                oi, t, m = lists[d][ci]
                o = os_[oi]
                off, _ = offs[k][oi]
                h = o.dest_hop[d]
                chain = []
                while h >= 0:
                    chain.append(h)
                    h = int(o.hop_parent[h])
                parent = -1
                for h in reversed(chain):
                    key = (oi, t, m, h)
                    if key not in seen:
                        e = int(o.hop_link[h])
                        ep = t + int(off[h])
                        seen[key] = len(H["chunk"])
                        H["chunk"].append(c)
                        H["link"].append(e)
                        H["parent"].append(parent)
                        H["first"].append(ep)
                        H["last"].append(ep)
                        H["arrival"].append(ep + 1 + int(lat_ep[e]))
                        S["hop"].append(seen[key])
                        S["epoch"].append(ep)
                        S["nbytes"].append(float(chunk_nb[c]))
                    parent = seen[key]
    out: dict[str, Any] = {f"hop_{kk}": np.asarray(v, dtype=np.int64) for kk, v in H.items()}
    out["slice_hop"] = np.asarray(S["hop"], dtype=np.int64)
    out["slice_epoch"] = np.asarray(S["epoch"], dtype=np.int64)
    out["slice_nbytes"] = np.asarray(S["nbytes"], dtype=np.float64)
    return out


def solve_milp(topology: Topology, dem: Demands, opts: list[list[Option]], chunks: Chunks, horizon_s: float,
               deadline: float, window: int = 6) -> dict[str, Any] | None:
    """Time-expanded MILP over route options (TE-CCL with copy): x[k, option, t] integer chunks
    leaving in epoch t. Small instances in one shot (objective: sum of delivery epochs); larger
    ones in rounds of ``window`` epochs, each delivering as much as it can, the links its chunks
    will still use in later epochs reserved (the buffers carried forward)."""
    te = _te_setup(topology, opts, chunks.chunk_bytes)
    tau, cap, offs = te.tau, te.cap, te.offs
    n_k = np.bincount(chunks.commodity, minlength=len(dem.commodities))
    need = {(k, d): int(n_k[k]) for k, c in enumerate(dem.commodities) for d in c.dests}
    max_arr = max(max(a.values()) for row in offs for _, a in row)
    horizon = int(math.ceil(horizon_s / tau)) + max_arr + 1
    n_opts = sum(len(os_) for os_ in opts)
    sends: list[tuple[int, int, int, int]] | None
    if n_opts * horizon <= _MILP_MAX_VARS:
        resv = np.zeros((len(cap), horizon))
        sends = _te_solve(te, resv, 0, horizon, need, True, deadline - time.perf_counter())
    elif n_opts * window <= _MILP_MAX_VARS and n_opts * horizon <= _MILP_ROUNDS_MAX:
        resv = np.zeros((len(cap), horizon))
        sends = []
        t0 = 0
        while any(v > 0 for v in need.values()):
            if time.perf_counter() >= deadline or t0 + max_arr >= horizon:
                log.info("MILP rounds stopped at epoch %d with %d chunk deliveries left", t0, sum(need.values()))
                return None
            got = _te_solve(te, resv, t0, t0 + window, need, False, deadline - time.perf_counter())
            for k, oi, t, cnt in got or []:
                o = opts[k][oi]
                off, _ = offs[k][oi]
                np.add.at(resv, (o.hop_link, t + off), cnt)
                for d in o.paths:
                    need[(k, d)] -= cnt
            sends.extend(got or [])
            t0 += window
    else:
        log.info("MILP skipped: %d options x %d epochs", n_opts, horizon)
        return None
    if sends is None:
        return None
    out = _te_extract(dem, te, sends, chunks)
    out["tau"] = tau
    return out
