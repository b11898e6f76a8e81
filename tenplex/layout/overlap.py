"""Interval arithmetic shared by the planner and the survivor assignment (pure, numpy-vectorised).

A layout's segments of one tensor are grouped into disjoint *classes* (identical intervals that DP
replicas or tied copies hold), and a second layout's segments are intersected with them by binary
search, so no chunk is ever compared with every other chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PlanError

__all__ = ["intersect", "holder_classes"]


def intersect(
    q_start: np.ndarray, q_len: np.ndarray, c_start: np.ndarray, c_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Overlaps of query intervals with sorted, disjoint class intervals.

    Returns ``(query_index, class_index, piece_start, piece_end)`` for every non-empty
    overlap, queries in order. Cost is ``O((q + c) log c + overlaps)``.
    """
    q_end = q_start + q_len
    i0 = np.searchsorted(c_start, q_start, side="right") - 1
    i0 = np.maximum(i0, 0)
    i1 = np.searchsorted(c_start, q_end, side="left")
    counts = np.maximum(i1 - i0, 0)
    qi = np.repeat(np.arange(len(q_start)), counts)
    first = np.cumsum(counts) - counts
    ci = i0[qi] + (np.arange(len(qi)) - first[qi])
    ps = np.maximum(q_start[qi], c_start[ci])
    pe = np.minimum(q_end[qi], c_end[ci])
    keep = pe > ps
    return qi[keep], ci[keep], ps[keep], pe[keep]


def holder_classes(name: str, table: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Group an old layout's segments into disjoint intervals with their holders.

    Returns sorted starts, ends, a (classes, k) matrix of holder ranks (-1 padded) and the
    matching matrix of offsets in the holders' local shards.
    """
    order = np.lexsort((table.rank, table.start))
    start, length = table.start[order], table.length[order]
    ranks, local = table.rank[order], table.local[order]
    new_class = np.ones(len(start), dtype=bool)
    new_class[1:] = start[1:] != start[:-1]
    cid = np.cumsum(new_class) - 1
    firsts = np.flatnonzero(new_class)
    c_start, c_len = start[firsts], length[firsts]
    if np.any(length != c_len[cid]):
        raise PlanError(f"{name}: replicas of one piece disagree on its length; the layout spec is inconsistent")
    c_end = c_start + c_len
    if np.any(c_end[:-1] > c_start[1:]):
        raise PlanError(f"{name}: pieces of the old layout overlap; the layout spec is inconsistent")
    pos = np.arange(len(start)) - firsts[cid]
    k = int(pos.max()) + 1 if len(pos) else 1
    c_ranks = np.full((len(firsts) + 1, k), -1, dtype=np.int64)
    c_local = np.zeros((len(firsts) + 1, k), dtype=np.int64)
    c_ranks[cid, pos] = ranks
    c_local[cid, pos] = local
    return c_start, c_end, c_ranks[:-1], c_local[:-1]

