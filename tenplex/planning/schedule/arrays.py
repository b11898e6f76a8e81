"""Numpy helpers the scheduler's modules share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from ...errors import PlanError


class Columns:
    """Named numpy columns, given, or built all at once by ``build`` on the first read of any of
    them: what a caller may never read is not built inside the scheduler's time limit (issue #20:
    at 131,072 GPUs the naive schedule's 13.7 M hops took 4.3 s to render, and its flows' 35.8 M
    plan rows 1.6 GB to hold). ``built``: whether they exist yet (reading ``names`` builds nothing)."""

    __slots__ = ("names", "_build", "_cols")

    def __init__(self, names: Iterable[str], cols: Mapping[str, np.ndarray] | None = None,
                 build: Callable[[], Mapping[str, np.ndarray]] | None = None) -> None:
        self.names = tuple(names)
        if (cols is None) == (build is None):
            raise PlanError(f"columns {self.names}: give either their values or a function that builds them, "
                            f"not {'both' if build is not None else 'neither'}")
        self._build = build
        self._cols = None if cols is None else self._checked(cols)

    @property
    def built(self) -> bool:
        return self._cols is not None

    def __getitem__(self, name: str) -> np.ndarray:
        if self._cols is None:
            assert self._build is not None
            self._cols = self._checked(self._build())
            self._build = None  # (frees what the function holds: a plan's rows, a topology's paths)
        return self._cols[name]

    def _checked(self, cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.names if n not in cols]
        if missing:
            raise PlanError(f"columns {missing} missing: got {sorted(cols)} of {self.names}")
        return {n: cols[n] for n in self.names}


def excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=x.dtype)
    np.cumsum(x[:-1], out=out[1:])
    return out


def member(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which of ``keys`` are in the sorted array ``table``."""
    if not len(table):
        return np.zeros(len(keys), dtype=bool)
    i = np.searchsorted(table, keys).clip(0, len(table) - 1)
    return table[i] == keys


def sort_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort((index, *keys[::-1]))``: indices sorted by ``keys[0]``, then ``keys[1]``, ...,
    ties by index, for non-negative integer keys. Where the keys and the index fit in 63 bits
    together they are packed into one int64 and sorted by value (issue #20: a 3-key lexsort of
    6.2 M hops took 8 s, a sort of packed values 0.2 s; an argsort 1.3 s)."""
    n = len(keys[0]) if keys else 0
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    widths = [max(int(k.max()), 0).bit_length() for k in keys]
    ib = max(n - 1, 1).bit_length()
    if sum(widths) + ib > 63 or any(int(k.min()) < 0 for k in keys):
        return np.lexsort((np.arange(n), *keys[::-1]))
    packed = np.zeros(n, dtype=np.int64)
    for k, w in zip(keys, widths):
        packed <<= w
        packed |= k.astype(np.int64, copy=False)
    packed <<= ib
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    packed &= (1 << ib) - 1
    return packed
