"""Pure partitioning of a dataset's global sample order across steps and DP ranks.

The global order is a sequence of epochs; epoch ``e`` is a permutation of all sample ids
drawn by numpy's PCG64 generator seeded with ``(seed, e)`` (or index order with
``shuffle=False``). Progress is the number of samples consumed globally; the global batch of
step ``k`` is positions ``[k*G, (k+1)*G)`` of the order, and DP rank ``i`` of ``dp`` takes the
contiguous ``i``-th slice of it. Because the order depends on neither DP nor the step size,
a job that changes its DP size continues the same order from the same progress.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["DataState", "sample_order", "global_batch_ids", "rank_batch_ids"]


@dataclass(frozen=True, slots=True)
class DataState:
    """Where a job is in its dataset: carried in every checkpoint as a PTC object."""

    num_samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    consumed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"the dataset has no samples (num_samples={self.num_samples})")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {self.consumed}")

    def advance(self, steps: int = 1) -> DataState:
        return DataState(**{**asdict(self), "consumed": self.consumed + steps * self.global_batch})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DataState:
        return cls(**obj)


@lru_cache(maxsize=8)
def sample_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Sample ids of one epoch, in the order they are consumed."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)
    order.setflags(write=False)
    return order


def _positions(state: DataState, start: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.int64)
    n, filled = state.num_samples, 0
    while filled < count:
        pos = start + filled
        epoch, offset = divmod(pos, n)
        take = min(count - filled, n - offset)
        out[filled : filled + take] = sample_order(n, state.seed, epoch, state.shuffle)[offset : offset + take]
        filled += take
    return out


def global_batch_ids(state: DataState) -> np.ndarray:
    """Sample ids of the next global batch (the one starting at ``state.consumed``)."""
    return _positions(state, state.consumed, state.global_batch)


def rank_batch_ids(state: DataState, dp: int, dp_rank: int) -> np.ndarray:
    """DP rank ``dp_rank``'s contiguous slice of the next global batch."""
    if state.global_batch % dp:
        raise ValueError(
            f"global batch {state.global_batch} is not divisible by dp={dp} "
            f"({state.global_batch} % {dp} = {state.global_batch % dp})"
        )
    per = state.global_batch // dp
    return global_batch_ids(state)[dp_rank * per : (dp_rank + 1) * per]
