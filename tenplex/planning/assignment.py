"""Survivor assignment: which surviving device each new rank runs on (pure: no I/O, no processes).

``locality_order`` maximises the bytes every new rank finds on its own device, the optimum of an
assignment over the matrix of bytes survivor ``s`` holds of new rank ``i``'s shard, without ever
building that matrix. Under (DP, TP, PP) layouts the matrix has structure:

* a tensor that is not DP-sharded is held alike by every DP replica, so its bytes depend on the
  ranks' (stage, TP index) only: a small class matrix ``A[new class, old class]``;
* the DP-sharded fragments (distributed optimizer) overlap few others: a sparse matrix ``Z``.

``W[i, s] = A[class(i), class(s)] + Z[i, s]``. (A torch-native job's ``StateLayout`` s have no such
classes: ``W = Z``, built from the layouts' interval overlaps, where a plain tensor every rank
holds whole adds the same to every pair and is left out.) The bipartite graph splits into connected components
(usually one per (stage, TP index) pair that share data); each is solved exactly:

* one uniform class block (``A`` constant over the component, the common case of a DP change):
  a full matching with the best sparse matching of ``Z`` (scipy's LAPJVsp), the rest in order;
* a mixed block (ZeRO: fragments of TP-replicated tensors link every TP index of a stage, whose
  TP blocks are diagonal): the class duals (``_dual_matching``): integral duals of the small
  class-level transportation problem bound every matching by the dual objective plus the best
  sparse matching of ``Z`` minus the reduced costs; that matching, completed over tight class
  pairs, reaches the bound (checked in exact integers) in the cases met in practice;
* where the duals do not certify: ``scipy.optimize.linear_sum_assignment`` on the component's
  dense block when small, else the min-cost flow through class hubs (new rank -> its class -> old
  class -> survivor, plus direct ``Z`` edges) as a linear program (HiGHS; a network matrix, so its
  vertex optimum is integral).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import PlanError
from ..layout.config import ParallelConfig
from ..layout.overlap import holder_classes, intersect
from ..layout.ptc import PTC, Layout

__all__ = ["SurvivorWeights", "survivor_weights", "max_weight_assignment", "locality_order", "load_solvers"]

log = logging.getLogger(__name__)

#: A component with at most this many (new rank, survivor) pairs is solved densely.
DENSE_LIMIT = 1 << 21
#: Try the class-dual construction (``_dual_matching``) before the dense and flow solvers on a
#: component with at least ``DUAL_MIN`` (new rank, survivor) pairs (below, a dense LSA is cheaper
#: than its class LP).
USE_DUALS = True
DUAL_MIN = 1 << 12


class SurvivorWeights:
    """``W[i, s] = A[row_class[i], col_class[s]] + Z[i, s]``: bytes survivor ``s`` (an index into the
    survivors) holds of new rank ``i``'s shard, for new ranks ``0 .. rows - 1``.

    ``z_row``, ``z_col``, ``z_bytes``: the sparse part, one entry per pair (no duplicates).
    """

    def __init__(self, row_class: np.ndarray, col_class: np.ndarray, a: np.ndarray,
                 z_row: np.ndarray, z_col: np.ndarray, z_bytes: np.ndarray) -> None:
        self.row_class, self.col_class, self.a = row_class, col_class, a
        self.z_row, self.z_col, self.z_bytes = z_row, z_col, z_bytes

    @property
    def rows(self) -> int:
        return len(self.row_class)

    @property
    def cols(self) -> int:
        return len(self.col_class)

    def dense(self, rows: np.ndarray | None = None, cols: np.ndarray | None = None, a: np.ndarray | None = None
              ) -> np.ndarray:
        """The dense block ``W[rows][:, cols]`` (all by default; class matrix ``a``, default ``self.a``)."""
        rows = np.arange(self.rows) if rows is None else rows
        cols = np.arange(self.cols) if cols is None else cols
        a = self.a if a is None else a
        w = a[self.row_class[rows]][:, self.col_class[cols]].astype(np.int64)
        rpos = np.full(self.rows, -1, dtype=np.int64)
        rpos[rows] = np.arange(len(rows))
        cpos = np.full(self.cols, -1, dtype=np.int64)
        cpos[cols] = np.arange(len(cols))
        ok = (rpos[self.z_row] >= 0) & (cpos[self.z_col] >= 0)
        w[rpos[self.z_row[ok]], cpos[self.z_col[ok]]] += self.z_bytes[ok]
        return w

    def value(self, rows: np.ndarray, cols: np.ndarray) -> int:
        """Total weight of the pairs ``(rows[k], cols[k])``."""
        total = int(self.a[self.row_class[rows], self.col_class[cols]].sum())
        key = self.z_row * self.cols + self.z_col
        order = np.argsort(key)
        want = rows.astype(np.int64) * self.cols + cols
        pos = np.minimum(np.searchsorted(key[order], want), max(len(key) - 1, 0))
        if len(key):
            hit = key[order][pos] == want
            total += int(self.z_bytes[order][pos][hit].sum())
        return total


def _uniform_tensor(old_cfg: Any, new_cfg: Any, dp_sharded: bool) -> bool:
    """Whether a tensor's bytes depend only on the ranks' (stage, TP index) under both layouts."""
    return isinstance(old_cfg, ParallelConfig) and isinstance(new_cfg, ParallelConfig) and not dp_sharded


def _classes(cfg: Any, ranks: np.ndarray) -> np.ndarray:
    """Class (stage * tp + TP index) of every rank of a (DP, TP, PP) layout."""
    return (ranks // (cfg.tp * cfg.dp)) * cfg.tp + ranks % cfg.tp


def _same_everywhere(name: str, c_ranks: np.ndarray, new_t: Any, survivors: np.ndarray, rows: int) -> bool:
    """Whether every survivor holds one interval of a tensor (one old class) and every new rank
    ``< rows`` needs one and the same interval (one new class): a plain tensor every rank holds
    (AdamW's ``step``), a constant on every pair that would make the matrix dense."""
    if len(c_ranks) != 1 or not np.isin(survivors, c_ranks[0]).all():
        return False
    _, _, n_ranks, _ = holder_classes(name, new_t)
    return len(n_ranks) == 1 and bool(np.isin(np.arange(rows), n_ranks[0]).all())


def survivor_weights(ptc: PTC, old_cfg: Layout, new_cfg: Layout, survivors: np.ndarray, rows: int) -> SurvivorWeights:
    """The bytes every surviving old rank holds of every new rank ``< rows``'s shard, as class
    matrix plus sparse part (see the module docstring); vectorised per group of tensors that share
    their holder tables (the layers of a stage)."""
    world_old = old_cfg.world_size
    col_of = np.full(world_old + 1, -1, dtype=np.int64)  # last slot: no holder (-1)
    col_of[survivors] = np.arange(len(survivors))
    structured = isinstance(old_cfg, ParallelConfig) and isinstance(new_cfg, ParallelConfig)
    if structured:
        row_class = _classes(new_cfg, np.arange(rows, dtype=np.int64))
        col_class = _classes(old_cfg, survivors)
        a = np.zeros((new_cfg.pp * new_cfg.tp, old_cfg.pp * old_cfg.tp), dtype=np.int64)
        new_rep = np.zeros(new_cfg.world_size, dtype=bool)  # DP index 0 stands for its class
        new_rep[(np.arange(new_cfg.world_size) // new_cfg.tp) % new_cfg.dp == 0] = True
        old_rep = np.zeros(world_old + 1, dtype=bool)
        old_rep[:-1] = (np.arange(world_old) // old_cfg.tp) % old_cfg.dp == 0
    else:
        row_class = np.zeros(rows, dtype=np.int64)
        col_class = np.zeros(len(survivors), dtype=np.int64)
        a = np.zeros((1, 1), dtype=np.int64)
    # tensors that share both holder tables contribute alike: one pass per group, weighted by item sizes
    groups: dict[tuple[int, int], list[Any]] = {}
    for name, spec in ptc.tensors.items():
        old_t, new_t = ptc.holders(name, old_cfg), ptc.holders(name, new_cfg)
        if len(old_t) == 0 or len(new_t) == 0:
            continue
        g = groups.setdefault((id(old_t), id(new_t)), [name, old_t, new_t, 0, spec.dp_sharded])
        g[3] += spec.itemsize
    classes: dict[int, tuple[np.ndarray, ...]] = {}
    z_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for name, old_t, new_t, itemsize, dp_sharded in groups.values():
        if id(old_t) not in classes:
            classes[id(old_t)] = holder_classes(name, old_t)
        c_start, c_end, c_ranks, _ = classes[id(old_t)]
        if not structured and _same_everywhere(name, c_ranks, new_t, survivors, rows):
            continue  # the same bytes on every (new rank, survivor) pair: no assignment prefers any
        uniform = _uniform_tensor(old_cfg, new_cfg, dp_sharded)
        sel = new_rep[new_t.rank] if uniform else new_t.rank < rows
        nr = new_t.rank[sel]
        qi, ci, ps, pe = intersect(new_t.start[sel], new_t.length[sel], c_start, c_end)
        if not len(qi):
            continue
        hr = c_ranks[ci]  # (pieces, holders), -1 padded
        nbytes = np.broadcast_to(((pe - ps) * itemsize)[:, None], hr.shape)
        rr = np.broadcast_to(nr[qi][:, None], hr.shape)
        if uniform:
            ok = old_rep[hr]
            np.add.at(a, (_classes(new_cfg, rr[ok]), _classes(old_cfg, hr[ok])), nbytes[ok])
        else:
            ok = col_of[hr] >= 0
            z_parts.append((rr[ok], col_of[hr[ok]], nbytes[ok]))
    if z_parts:
        zr, zc, zb = (np.concatenate(p) for p in zip(*z_parts))
        key, inv = np.unique(zr * len(survivors) + zc, return_inverse=True)
        z_bytes = np.bincount(inv.reshape(-1), weights=zb, minlength=len(key)).astype(np.int64)
        z_row, z_col = key // len(survivors), key % len(survivors)
    else:
        z_row = z_col = z_bytes = np.zeros(0, dtype=np.int64)
    return SurvivorWeights(row_class, col_class, a, z_row, z_col, z_bytes)


def _sparse_matching(rows: np.ndarray, cols: np.ndarray, w: np.ndarray, n_rows: int, n_cols: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A maximum-weight (not necessarily full) matching of positive edges ``(rows, cols, w)``.

    The standard reduction to a full matching: left = rows + mirror columns, right = columns +
    mirror rows; an edge, its mirror, and a zero-gain edge from every node to its own mirror (left
    unmatched). Costs ``big - w`` (``big - 0`` elsewhere): no cost is zero, and every full matching
    has ``n_rows + n_cols`` edges, so the least cost is the largest weight.
    """
    from scipy import sparse  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching  # lazy: the same

    keep = w > 0
    rows, cols, w = rows[keep], cols[keep], w[keep].astype(np.float64)
    if not len(w):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    big = float(w.max()) + 1.0
    n = n_rows + n_cols
    ids_r, ids_c = np.arange(n_rows), np.arange(n_cols)
    left = np.concatenate([rows, n_rows + cols, ids_r, n_rows + ids_c])
    right = np.concatenate([cols, n_cols + rows, n_cols + ids_r, ids_c])
    cost = np.concatenate([big - w, np.full(len(w) + n, big)])
    graph = sparse.csr_matrix((cost, (left, right)), shape=(n, n))
    match = min_weight_full_bipartite_matching(graph)[1]  # right node of every left node
    real = np.flatnonzero(match[:n_rows] < n_cols)
    return real, match[real].astype(np.int64)


def _flow_matching(w: SurvivorWeights, a: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight matching of a component through class hubs, as a min-cost flow LP.

    Arcs: source -> row (cap 1); row -> its class hub; row hub -> column hub (cost ``-A``, uncapped);
    column hub -> column; column -> sink (cap 1); and row -> column directly (cost ``-(A + Z)``)
    for the sparse pairs. A direct arc is never worse than the hub path, so the flow optimum is
    the matching optimum; the constraint matrix is a network matrix, so HiGHS's vertex is integral.
    """
    from scipy import sparse  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay
    from scipy.optimize import linprog  # lazy: the same

    nr, nc = len(rows), len(cols)
    rpos = np.full(w.rows, -1, dtype=np.int64)
    rpos[rows] = np.arange(nr)
    cpos = np.full(w.cols, -1, dtype=np.int64)
    cpos[cols] = np.arange(nc)
    rcls, rcls_of = np.unique(w.row_class[rows], return_inverse=True)
    ccls, ccls_of = np.unique(w.col_class[cols], return_inverse=True)
    hub = a[rcls][:, ccls]
    hb, ha = np.nonzero(hub > 0)
    zk = (rpos[w.z_row] >= 0) & (cpos[w.z_col] >= 0)
    zr, zc = rpos[w.z_row[zk]], cpos[w.z_col[zk]]
    zw = w.z_bytes[zk] + a[w.row_class[w.z_row[zk]], w.col_class[w.z_col[zk]]]
    # nodes: rows [0, nr), cols [nr, nr + nc), row hubs, column hubs (source and sink implicit)
    off_rh, off_ch = nr + nc, nr + nc + len(rcls)
    n_nodes = off_ch + len(ccls)
    tails = [np.full(nr, -1), np.arange(nr), off_rh + hb, off_ch + ccls_of, np.arange(nc) + nr, zr]
    heads = [np.arange(nr), off_rh + rcls_of, off_ch + ha, nr + np.arange(nc), np.full(nc, -1), nr + zc]
    costs = [np.zeros(nr), np.zeros(nr), -hub[hb, ha].astype(np.float64), np.zeros(nc), np.zeros(nc),
             -zw.astype(np.float64)]
    tail, head, cost = np.concatenate(tails), np.concatenate(heads), np.concatenate(costs)
    scale = float(np.gcd.reduce(np.abs(cost[cost != 0]).astype(np.int64))) if np.any(cost != 0) else 1.0
    ub = np.ones(len(cost))
    ub[2 * nr : 2 * nr + len(hb)] = np.inf
    arcs = np.arange(len(cost))
    inner_t, inner_h = tail >= 0, head >= 0
    # conservation at every node: inflow - outflow = 0
    a_eq = sparse.csr_matrix(
        (np.concatenate([np.ones(inner_h.sum()), -np.ones(inner_t.sum())]),
         (np.concatenate([head[inner_h], tail[inner_t]]), np.concatenate([arcs[inner_h], arcs[inner_t]]))),
        shape=(n_nodes, len(cost)))
    res = linprog(cost / scale, A_eq=a_eq, b_eq=np.zeros(n_nodes), bounds=np.stack([np.zeros(len(cost)), ub], 1),
                  method="highs-ds")
    if res.status != 0:
        raise PlanError(f"the survivor assignment's flow problem did not solve: {res.message}")
    x = np.rint(res.x).astype(np.int64)
    if np.abs(res.x - x).max(initial=0) > 1e-6:
        raise PlanError("the survivor assignment's flow solution is not integral; report this layout pair")
    # pairs: direct arcs, then hub flows split among the rows and columns each hub path carries
    direct = x[len(cost) - len(zr):] > 0
    pr, pc = [zr[direct]], [zc[direct]]
    row_free = np.ones(nr, dtype=bool)
    row_free[zr[direct]] = False
    col_free = np.ones(nc, dtype=bool)
    col_free[zc[direct]] = False
    # A hub path's rows (columns) are interchangeable within their class: take the lowest free ones.
    flow = x[2 * nr : 2 * nr + len(hb)]
    need_r = np.bincount(hb, weights=flow, minlength=len(rcls)).astype(np.int64)
    need_c = np.bincount(ha, weights=flow, minlength=len(ccls)).astype(np.int64)
    r_by = [np.flatnonzero(row_free & (rcls_of == b))[: need_r[b]] for b in range(len(rcls))]
    c_by = [np.flatnonzero(col_free & (ccls_of == k))[: need_c[k]] for k in range(len(ccls))]
    r_at, c_at = np.zeros(len(rcls), dtype=np.int64), np.zeros(len(ccls), dtype=np.int64)
    for b, k, f in zip(hb.tolist(), ha.tolist(), flow.tolist()):
        if f:
            pr.append(r_by[b][r_at[b] : r_at[b] + f])
            pc.append(c_by[k][c_at[k] : c_at[k] + f])
            r_at[b] += f
            c_at[k] += f
    return rows[np.concatenate(pr).astype(np.int64)], cols[np.concatenate(pc).astype(np.int64)]


def _positions(w: SurvivorWeights, rows: np.ndarray, cols: np.ndarray, z_idx: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``rows`` and ``cols`` of the sparse entries ``z_idx`` (all in them)."""
    rpos = np.empty(w.rows, dtype=np.int64)
    rpos[rows] = np.arange(len(rows))
    cpos = np.empty(w.cols, dtype=np.int64)
    cpos[cols] = np.arange(len(cols))
    return rpos[w.z_row[z_idx]], cpos[w.z_col[z_idx]]


def _lookup_sorted(keys: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, found) of every ``want`` in the sorted ``keys``."""
    if not len(keys):
        return np.zeros(len(want), dtype=np.int64), np.zeros(len(want), dtype=bool)
    at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    return at, keys[at] == want


def _class_duals(block: np.ndarray, n_rows: np.ndarray, n_cols: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``_solve_duals`` of the class problem, cached (the stages of a layout repeat the same few)."""
    block, n_rows, n_cols = (np.ascontiguousarray(x, dtype=np.int64) for x in (block, n_rows, n_cols))
    return _cached_duals(block.tobytes(), block.shape, n_rows.tobytes(), n_cols.tobytes())


@lru_cache(maxsize=1024)
def _cached_duals(block: bytes, shape: tuple[int, int], n_rows: bytes, n_cols: bytes
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    out = _solve_duals(np.frombuffer(block, dtype=np.int64).reshape(shape), np.frombuffer(n_rows, dtype=np.int64),
                       np.frombuffer(n_cols, dtype=np.int64))
    if out is not None:
        for x in out:
            x.setflags(write=False)
    return out


def _solve_duals(block: np.ndarray, n_rows: np.ndarray, n_cols: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Integral duals of the class-level problem: ``u, v >= 0`` with ``u[b] + v[k] >= block[b, k]``,
    minimising ``n_rows . u + n_cols . v`` (the transportation problem of ``block`` with ``n_rows`` rows
    and ``n_cols`` columns per class: its matrix is totally unimodular, so an integral optimum
    exists). None when the LP's vertex does not round to a feasible integral point."""
    from scipy import sparse  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay
    from scipy.optimize import linprog  # lazy: the same

    hb, hk = np.nonzero(block > 0)
    nb, nk = block.shape
    if not len(hb):
        return np.zeros(nb, dtype=np.int64), np.zeros(nk, dtype=np.int64)
    scale = int(np.gcd.reduce(block[hb, hk]))
    arcs = np.arange(len(hb))
    a_ub = sparse.csr_matrix((-np.ones(2 * len(hb)), (np.concatenate([arcs, arcs]), np.concatenate([hb, nb + hk]))),
                             shape=(len(hb), nb + nk))
    res = linprog(np.concatenate([n_rows, n_cols]).astype(np.float64), A_ub=a_ub,
                  b_ub=-(block[hb, hk] // scale).astype(np.float64), bounds=(0, None), method="highs-ds")
    if res.status != 0:
        return None
    x = np.rint(res.x).astype(np.int64) * scale
    u, v = x[:nb], x[nb:]
    if np.any(u < 0) or np.any(v < 0) or np.any(u[hb] + v[hk] < block[hb, hk]):
        return None
    return u, v


def _dual_matching(w: SurvivorWeights, a: np.ndarray, rows: np.ndarray, cols: np.ndarray, z_idx: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """Maximum-weight matching of a component from the class structure's duals, or None when
    this construction cannot prove its result optimal (the caller then solves it otherwise).

    With integral class duals ``u, v`` (``u[b] + v[k] >= A[b, k]``) and reduced costs
    ``r[b, k] = u[b] + v[k] - A[b, k] >= 0``, every matching ``M`` weighs
    ``sum_M (A + Z) <= n_rows . u + n_cols . v + sum_M (Z - r)`` (each matched row and column adds
    at most its class dual), so ``W(M) <= U + Y*`` with ``U`` the dual objective and ``Y*`` the
    best sparse matching of ``Z - r`` over the entries where it is positive. The matching of
    ``Y*``, completed over tight class pairs (``r = 0``) so that every row and column of a class
    with a positive dual is matched, reaches that bound; it is returned only when its weight,
    counted exactly, equals ``U + Y*``. In the common case (a TP block diagonal of weights far
    larger than the ZeRO fragments that link TP indices) this is the optimum of a few sparse
    matchings instead of one of the whole component.
    """
    rcls, rc_of = np.unique(w.row_class[rows], return_inverse=True)
    ccls, cc_of = np.unique(w.col_class[cols], return_inverse=True)
    rc_of, cc_of = rc_of.reshape(-1), cc_of.reshape(-1)
    n_r, n_c = np.bincount(rc_of, minlength=len(rcls)), np.bincount(cc_of, minlength=len(ccls))
    block = a[np.ix_(rcls, ccls)]
    duals = _class_duals(block, n_r, n_c)
    if duals is None:
        return None
    u, v = duals
    red = u[:, None] + v[None, :] - block
    bound = int(n_r @ u + n_c @ v)
    # the sparse part, in component positions, and its gain over the reduced cost
    zr, zc = _positions(w, rows, cols, z_idx)
    z_bytes = w.z_bytes[z_idx]
    y = z_bytes - red[rc_of[zr], cc_of[zc]]
    mr, mc = _sparse_matching(zr, zc, y, len(rows), len(cols))
    z_key = zr * len(cols) + zc
    z_order = np.argsort(z_key)
    z_key = z_key[z_order]

    def z_of(pr: np.ndarray, pc: np.ndarray, values: np.ndarray) -> int:
        at, hit = _lookup_sorted(z_key, pr * len(cols) + pc)
        return int(values[z_order[at[hit]]].sum())

    y_best = z_of(mr, mc, y)
    # complete over tight class pairs: every row (column) of a class with a positive dual matched
    free_r = np.ones(len(rows), dtype=bool)
    free_r[mr] = False
    free_c = np.ones(len(cols), dtype=bool)
    free_c[mc] = False
    left_r = np.bincount(rc_of[free_r], minlength=len(rcls))
    left_c = np.bincount(cc_of[free_c], minlength=len(ccls))
    flow = _completion(red == 0, block > 0, left_r, left_c, u > 0, v > 0)
    if flow is None:
        return None
    pr, pc = [mr], [mc]
    r_by = [np.flatnonzero(free_r & (rc_of == b)) for b in range(len(rcls))]
    c_by = [np.flatnonzero(free_c & (cc_of == k)) for k in range(len(ccls))]
    r_at, c_at = np.zeros(len(rcls), dtype=np.int64), np.zeros(len(ccls), dtype=np.int64)
    for b, k in zip(*np.nonzero(flow)):
        f = int(flow[b, k])
        pr.append(r_by[b][r_at[b] : r_at[b] + f])
        pc.append(c_by[k][c_at[k] : c_at[k] + f])
        r_at[b] += f
        c_at[k] += f
    pr_all, pc_all = np.concatenate(pr).astype(np.int64), np.concatenate(pc).astype(np.int64)
    # the certificate, in exact integers: this matching's weight equals the bound
    weight = int(block[rc_of[pr_all], cc_of[pc_all]].sum()) + z_of(pr_all, pc_all, z_bytes)
    if weight != bound + y_best:
        log.debug("class duals did not certify a component of %d x %d (%d < %d)", len(rows), len(cols), weight,
                  bound + y_best)
        return None
    keep = block[rc_of[pr_all], cc_of[pc_all]] > 0
    keep[: len(mr)] = True
    return rows[pr_all[keep]], cols[pc_all[keep]]


def _completion(tight: np.ndarray, positive: np.ndarray, left_r: np.ndarray, left_c: np.ndarray,
                must_r: np.ndarray, must_c: np.ndarray) -> np.ndarray | None:
    """Class-level flow over tight, positive class pairs within ``left_r`` rows and ``left_c``
    columns per class that uses every row of a ``must_r`` class and every column of a ``must_c``
    class, or None when there is none. Greedy first (exact when each class has one tight pair),
    else the LP of the most must-ends covered (a transportation matrix: integral vertex)."""
    from scipy import sparse  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay
    from scipy.optimize import linprog  # lazy: the same

    arcs = tight & positive
    flow = np.zeros(tight.shape, dtype=np.int64)
    lr, lc = left_r.copy(), left_c.copy()
    for b, k in zip(*np.nonzero(arcs)):
        f = min(lr[b], lc[k])
        flow[b, k] = f
        lr[b] -= f
        lc[k] -= f
    if not (lr[must_r].any() or lc[must_c].any()):
        return flow
    hb, hk = np.nonzero(arcs)
    nb, nk = tight.shape
    idx = np.arange(len(hb))
    a_ub = sparse.csr_matrix((np.ones(2 * len(hb)), (np.concatenate([hb, nb + hk]), np.concatenate([idx, idx]))),
                             shape=(nb + nk, len(hb)))
    gain = must_r[hb].astype(np.float64) + must_c[hk]
    res = linprog(-gain, A_ub=a_ub, b_ub=np.concatenate([left_r, left_c]).astype(np.float64), bounds=(0, None),
                  method="highs-ds")
    if res.status != 0:
        return None
    f = np.rint(res.x).astype(np.int64)
    flow = np.zeros(tight.shape, dtype=np.int64)
    flow[hb, hk] = f
    if (np.any(f < 0) or np.any(flow.sum(1) > left_r) or np.any(flow.sum(0) > left_c)
            or np.any(flow.sum(1)[must_r] != left_r[must_r]) or np.any(flow.sum(0)[must_c] != left_c[must_c])):
        return None
    return flow


def _components(w: SurvivorWeights, a: np.ndarray, rows: np.ndarray, cols: np.ndarray, z_idx: np.ndarray
                ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Connected components (rows, cols, sparse entries; rows and cols ascending) of the graph of
    positive weights between ``rows`` and ``cols`` under the class matrix ``a``; components
    without a row or without a column are left out (nothing to match)."""
    from scipy import sparse  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay
    from scipy.sparse.csgraph import connected_components  # lazy: the same

    rcls, rc_of = np.unique(w.row_class[rows], return_inverse=True)
    ccls, cc_of = np.unique(w.col_class[cols], return_inverse=True)
    nr, nc, nb = len(rows), len(cols), len(rcls)
    hb, ha = np.nonzero(a[rcls][:, ccls] > 0)
    zr, zc = _positions(w, rows, cols, z_idx)
    # nodes: rows, cols, row classes, column classes
    src = np.concatenate([zr, np.arange(nr), nr + np.arange(nc), nr + nc + hb])
    dst = np.concatenate([nr + zc, nr + nc + rc_of, nr + nc + nb + cc_of, nr + nc + nb + ha])
    n = nr + nc + nb + len(ccls)
    graph = sparse.csr_matrix((np.ones(len(src), dtype=np.int8), (src, dst)), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    row_lab, col_lab, z_lab = label[:nr], label[nr : nr + nc], label[zr]
    labels = np.intersect1d(row_lab, col_lab)
    r_order = np.argsort(row_lab, kind="stable")
    c_order = np.argsort(col_lab, kind="stable")
    z_order = np.argsort(z_lab, kind="stable")
    rl, cl, zl = row_lab[r_order], col_lab[c_order], z_lab[z_order]
    out = []
    for lab in labels.tolist():
        r = r_order[np.searchsorted(rl, lab) : np.searchsorted(rl, lab, side="right")]
        c = c_order[np.searchsorted(cl, lab) : np.searchsorted(cl, lab, side="right")]
        z = z_order[np.searchsorted(zl, lab) : np.searchsorted(zl, lab, side="right")]
        out.append((rows[r], cols[c], z_idx[z]))
    return out


def _solve(w: SurvivorWeights, a: np.ndarray, rows: np.ndarray, cols: np.ndarray, z_idx: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight matching between ``rows`` and ``cols`` (ascending) under the class matrix
    ``a`` and the sparse entries ``z_idx``, component by component."""
    out_r, out_c = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for r, c, z in _components(w, a, rows, cols, z_idx):
        mr, mc = _solve_component(w, a, r, c, z)
        out_r.append(mr)
        out_c.append(mc)
    return np.concatenate(out_r).astype(np.int64), np.concatenate(out_c).astype(np.int64)


def _solve_component(w: SurvivorWeights, a: np.ndarray, rows: np.ndarray, cols: np.ndarray, z_idx: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-weight matching of one connected component."""
    from scipy.optimize import linear_sum_assignment  # lazy: scipy costs 0.5-1 s of start-up every worker need not pay

    rcls, ccls = np.unique(w.row_class[rows]), np.unique(w.col_class[cols])
    block = a[np.ix_(rcls, ccls)]
    c0 = int(block.min())
    if c0 > 0:
        # Every pair gains c0, so the optimum is a full matching: take c0 off the block, match
        # what is left (it may split into smaller components), complete in order.
        a = a.copy()
        a[np.ix_(rcls, ccls)] -= c0
        mr, mc = _solve(w, a, rows, cols, z_idx)
        fr = np.setdiff1d(rows, mr)
        fc = np.setdiff1d(cols, mc)
        k = min(len(fr), len(fc))
        return np.concatenate([mr, fr[:k]]), np.concatenate([mc, fc[:k]])
    if not block.any():  # only the sparse part
        rpos = np.searchsorted(rows, w.z_row[z_idx])
        cpos = np.searchsorted(cols, w.z_col[z_idx])
        mr, mc = _sparse_matching(rpos, cpos, w.z_bytes[z_idx], len(rows), len(cols))
        return rows[mr], cols[mc]
    if USE_DUALS and len(rows) * len(cols) >= DUAL_MIN:
        found = _dual_matching(w, a, rows, cols, z_idx)
        if found is not None:
            return found
    if len(rows) * len(cols) <= DENSE_LIMIT:
        dense = w.dense(rows, cols, a).astype(np.float64)
        r, c = linear_sum_assignment(dense, maximize=True)
        keep = dense[r, c] > 0
        return rows[r[keep]], cols[c[keep]]
    return _flow_matching(w, a, rows, cols)


def load_solvers() -> None:
    """Import the scipy parts ``locality_order`` uses now (0.5-1 s on a loaded 2-CPU VM): at a job's
    start-up, before its ``gc.freeze()``, so that neither a recovery nor the collector pays for them."""
    import scipy.optimize  # noqa: F401  # lazy: what this function is for
    import scipy.sparse.csgraph  # noqa: F401  # lazy: the same


def max_weight_assignment(w: SurvivorWeights) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (new rank, survivor index) of a maximum-weight matching of ``w`` (pairs of weight 0 left out)."""
    return _solve(w, w.a, np.arange(w.rows), np.arange(w.cols), np.arange(len(w.z_row)))


def locality_order(ptc: PTC, old_cfg: Layout, new_cfg: Layout, survivors: Sequence[int]) -> list[int]:
    """``survivors`` reordered so that new rank i runs where most of its state already is.

    Pass the result as ``plan(..., alive=...)``: new rank i then runs on its i-th entry (new ranks
    beyond the survivors run on fresh devices). The assignment maximises the bytes kept in place,
    the optimum ``scipy.optimize.linear_sum_assignment`` finds on the dense matrix of bytes each
    surviving device holds of each new rank's shard, found here from that matrix's structure (see
    the module docstring); new ranks with nothing in place take the remaining survivors in order,
    and survivors left over keep their order at the end.

    Layouts are ``ParallelConfig`` s or a torch-native job's ``StateLayout`` s. A ``StateLayout``
    has no (stage, TP index) classes: its matrix is all sparse part, built from the holder tables'
    interval overlaps (the planner's ``overlap`` code, one pass per group of tensors sharing both
    tables) and solved per connected component by a sparse full matching (scipy's
    ``min_weight_full_bipartite_matching``, LAPJVsp).
    """
    surv = np.asarray(list(survivors), dtype=np.int64)
    if len(np.unique(surv)) != len(surv) or (len(surv) and (surv.min() < 0 or surv.max() >= old_cfg.world_size)):
        raise PlanError(f"survivors must be distinct old ranks in [0, {old_cfg.world_size}), got {surv.tolist()}")
    rows = min(new_cfg.world_size, len(surv))
    w = survivor_weights(ptc, old_cfg, new_cfg, surv, rows)
    mr, mc = max_weight_assignment(w)
    col = np.full(rows, -1, dtype=np.int64)
    col[mr] = mc
    used = np.zeros(len(surv), dtype=bool)
    used[mc] = True
    free_rows = np.flatnonzero(col < 0)
    free_cols = np.flatnonzero(~used)
    col[free_rows] = free_cols[: len(free_rows)]
    used[free_cols[: len(free_rows)]] = True
    log.debug("locality order: %d new ranks on survivors, %d of them matched", rows, len(mr))
    return surv[col].tolist() + surv[~used].tolist()
