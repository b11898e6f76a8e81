"""Pure partitioning of a dataset's global sample order across steps and DP ranks.

The global order is a sequence of epochs; epoch ``e`` is a permutation of all sample ids:
with ``order="pcg64"`` (the default, what every checkpoint before the field existed means) the one
numpy's PCG64 generator seeded with ``(seed, e)`` draws, materialised whole (O(n) memory and time);
with ``order="feistel"`` a keyed bijection on ``[0, n)`` (:func:`feistel_ids`: a Feistel network on
the next even power of two, cycle-walking back into range) computed at any position in O(1) per
sample, so a loader restores its place at 10^9 samples without a pass over the list; index order
with ``shuffle=False``. Progress is the number of samples consumed globally; the global batch of
step ``k`` is positions ``[k*G, (k+1)*G)`` of the order, and DP rank ``i`` of ``dp`` takes the
contiguous ``i``-th slice of it (:func:`replica_samples`: equal slices, or with a micro-batch size
whole micro-batches as evenly as they go, counts differing by at most one micro-batch, so that
a DP size that does not divide the batch still sees every sample of a step exactly once).
Because the order depends on neither DP nor the step size, a job that changes its DP size
continues the same order from the same progress.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from typing import Any

import numpy as np

from ..errors import DataStateError

__all__ = [
    "DataState", "DataStateError", "sample_order", "global_batch_ids", "rank_batch_ids", "replica_samples", "stream_end",
    "rank_positions", "ids_at", "remaining_ids", "checked_int", "MAX_POSITION", "MAX_SAMPLES", "MAX_SEED",
    "ORDERS", "feistel_ids", "replica_slice", "loss_scale",
]

#: Positions (samples consumed globally) stay below 2**62, so ``position + batch`` never overflows
#: the int64 arrays the partitioning computes with.
MAX_POSITION = 1 << 62
#: At most 2**40 samples in a dataset (an index of them alone would take 16 TiB).
MAX_SAMPLES = 1 << 40
#: Seeds are 64-bit (numpy's PCG64 takes non-negative integers).
MAX_SEED = (1 << 64) - 1
#: The shuffled orders a DataState can name: "pcg64" (numpy's permutation, materialised per epoch) and
#: "feistel" (a keyed bijection computed per position, :func:`feistel_ids`).
ORDERS = ("pcg64", "feistel")


def checked_int(name: str, value: object, lo: int, hi: int, fix: str = "") -> int:
    """``value`` as an ``int`` in ``[lo, hi]``; raises :class:`DataStateError` for bools, floats, strings or
    out-of-range values (``fix`` is appended to the message)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DataStateError(f"{name} must be an integer, got {value!r} ({type(value).__name__})"
                             + (f": {fix}" if fix else ""))
    v = int(value)
    if v < lo or v > hi:
        bound = f">= {lo}" if v < lo else f"<= {hi}"
        raise DataStateError(f"{name} must be {bound}, got {v}" + (f": {fix}" if fix else ""))
    return v


@dataclass(frozen=True, slots=True)
class DataState:
    """Where a job is in its dataset: carried in every checkpoint as a PTC object."""

    num_samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    consumed: int = 0
    source: str = ""
    order: str = "pcg64"

    def __post_init__(self) -> None:
        if checked_int("num_samples", self.num_samples, -MAX_SAMPLES, MAX_SAMPLES) < 1:
            raise DataStateError(f"the dataset has no samples (num_samples={self.num_samples})")
        for name, lo, hi in (("num_samples", 1, MAX_SAMPLES), ("global_batch", 1, MAX_POSITION),
                             ("consumed", 0, MAX_POSITION), ("seed", 0, MAX_SEED)):
            object.__setattr__(self, name, checked_int(name, getattr(self, name), lo, hi))
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise DataStateError(f"shuffle must be true or false, got {self.shuffle!r}")
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        if not isinstance(self.source, str):
            raise DataStateError(f"source must be a string, got {self.source!r}")
        if self.order not in ORDERS:
            raise DataStateError(f"order must be one of {ORDERS}, got {self.order!r}")

    def advance(self, steps: int = 1) -> DataState:
        return self.at(self.consumed + steps * self.global_batch)

    def at(self, consumed: int) -> DataState:
        """This state at another position: only ``consumed`` is checked, the other fields were (a
        loader's sampler moves once a batch; a full re-validation was most of its cost per batch)."""
        new = object.__new__(DataState)
        for name in DataState.__slots__:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "consumed", checked_int("consumed", consumed, 0, MAX_POSITION))
        return new

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON; ``order`` only when it is not the default, so a state written before the
        field existed and one written now of the same order are the same JSON."""
        out = asdict(self)
        if out["order"] == ORDERS[0]:
            del out["order"]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DataState:
        return cls(**obj)


@lru_cache(maxsize=8)
def sample_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True, order: str = "pcg64") -> np.ndarray:
    """Sample ids of one epoch, in the order they are consumed."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    if order == "feistel":
        out = feistel_ids(np.arange(num_samples, dtype=np.int64), num_samples, seed, epoch)
    else:
        out = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)
    out.setflags(write=False)
    return out


_M64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (the round keys)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def _round_keys(seed: int, epoch: int) -> np.ndarray:
    base = _mix64((seed & _M64) ^ _mix64(epoch + 0x9E3779B97F4A7C15 & _M64))
    return np.array([_mix64(base + i * 0x9E3779B97F4A7C15 & _M64) for i in range(_ROUNDS)], dtype=np.uint64)


_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MULS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(f: np.ndarray, t: np.ndarray, mask: np.uint64) -> None:
    """The round function's mixing of ``f`` (a right half plus its round key), in place (``t`` scratch):
    splitmix64's finaliser cut to ``mask``."""
    s30, s27, s31 = _SHIFTS
    m1, m2 = _MULS
    np.right_shift(f, s30, out=t)
    f ^= t
    f *= m1
    np.right_shift(f, s27, out=t)
    f ^= t
    f *= m2
    np.right_shift(f, s31, out=t)
    f ^= t
    f &= mask


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the balanced Feistel network on ``2*half``-bit values (uint64 arrays wrap on overflow).
    In place on three buffers (a loader's sampler calls it on a few thousand ids: numpy's per-call cost,
    not the arithmetic, is what counts there)."""
    mask, h = np.uint64((1 << half) - 1), np.uint64(half)
    left, right = x >> h, x & mask
    f, t = np.empty_like(left), np.empty_like(left)
    for k in keys:
        np.add(right, k, out=f)
        _mix(f, t, mask)
        f ^= left
        left, right, f = right, f, left  # the old left's buffer takes the next round function
    left <<= h
    left |= right
    return left


#: Round tables (:func:`_round_table`) up to this many entries a round are built for any request, larger
#: ones (up to ``1 << _TABLE_HALF_MAX``) only for a request of at least as many ids (then building costs
#: about what the direct rounds would).
_TABLE_ENTRIES = 1 << 12
_TABLE_HALF_MAX = 16


@lru_cache(maxsize=8)
def _round_table(seed: int, epoch: int, half: int) -> np.ndarray:
    """Row ``k``: the round function of round ``k`` (the same arithmetic as :func:`_feistel`'s) at every
    right half ``[0, 2**half)``, int64, read-only. With it a round is a gather and an xor (2 numpy calls,
    not 11): a loader's sampler computes its ids a few thousand at a time, where the calls' cost is the
    cost, and the cycle-walk repeats the network on ever fewer ids (about 6 times at 27% out of range)."""
    keys = _round_keys(seed, epoch)
    f = np.arange(1 << half, dtype=np.uint64)[None, :] + keys[:, None]
    _mix(f, np.empty_like(f), np.uint64((1 << half) - 1))
    out = f.astype(np.int64)
    out.setflags(write=False)
    return out


def _feistel_table(x: np.ndarray, half: int, table: np.ndarray) -> np.ndarray:
    """:func:`_feistel` with the round functions looked up in ``table`` (:func:`_round_table`); int64."""
    left, right = x >> half, x & ((1 << half) - 1)
    f = np.empty_like(left)
    for row in table:
        np.take(row, right, out=f, mode="clip")  # every right half is in range: no bounds check
        f ^= left
        left, right, f = right, f, left
    left <<= half
    left |= right
    return left


def feistel_ids(positions: np.ndarray, num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Sample ids at the given in-epoch offsets (each in ``[0, num_samples)``) of epoch ``epoch``'s
    "feistel" order: a bijection on ``[0, num_samples)`` keyed by ``(seed, epoch)``. Pure, O(1) per offset.

    A 6-round Feistel network permutes ``[0, 4**half)`` (``4**half >= num_samples``, less than 4x it);
    an image outside the range is mapped again until it falls inside (cycle-walking: the cycle through
    an in-range value returns to the range, so this is a permutation of ``[0, num_samples)``).
    """
    pos = np.asarray(positions, dtype=np.int64)
    if num_samples <= 1 or pos.size == 0:
        return np.zeros_like(pos) if num_samples <= 1 else pos.copy()
    half = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    step: Callable[[np.ndarray], np.ndarray]
    if half <= _TABLE_HALF_MAX and 1 << half <= max(_TABLE_ENTRIES, pos.size):
        step = partial(_feistel_table, half=half, table=_round_table(seed, epoch, half))
        x, limit = pos, num_samples
    else:
        step = partial(_feistel, half=half, keys=_round_keys(seed, epoch))
        x, limit = pos.astype(np.uint64), np.uint64(num_samples)
    out = step(x)
    out_of_range = np.flatnonzero(out >= limit)
    while out_of_range.size:
        walked = step(out[out_of_range])
        out[out_of_range] = walked
        out_of_range = out_of_range[walked >= limit]
    return out.astype(np.int64, copy=False)


def _positions(state: DataState, start: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.int64)
    n, filled = state.num_samples, 0
    while filled < count:
        pos = start + filled
        epoch, offset = divmod(pos, n)
        take = min(count - filled, n - offset)
        if state.order == "feistel":
            ids = ids_at(np.arange(pos, pos + take, dtype=np.int64), n, state.seed, state.shuffle, state.order)
        else:
            ids = sample_order(n, state.seed, epoch, state.shuffle)[offset : offset + take]
        out[filled : filled + take] = ids
        filled += take
    return out


def global_batch_ids(state: DataState) -> np.ndarray:
    """Sample ids of the next global batch (the one starting at ``state.consumed``)."""
    return _positions(state, state.consumed, state.global_batch)


def replica_samples(global_batch: int, dp: int, micro_batch: int | None = None) -> tuple[int, ...]:
    """Samples each of ``dp`` replicas takes of a global batch (contiguous slices, replica order). Pure.

    Without ``micro_batch``: equal slices (``dp`` must divide the batch). With it: whole
    micro-batches as evenly as they go, the first replicas taking one more when ``dp`` does not
    divide their number (``tenplex.planning.layouts.batch_split``); the same equal slices whenever
    ``dp * micro_batch`` divides the batch, so an even layout reads what it always read.
    """
    dp = checked_int("dp", dp, 1, MAX_POSITION)
    return tuple(_slice_of(global_batch, dp, r, micro_batch)[1] for r in range(dp))


def replica_slice(global_batch: int, dp: int, dp_rank: int, micro_batch: int | None = None) -> tuple[int, int]:
    """(first position within a global batch, count) of DP rank ``dp_rank``'s slice (``replica_samples``), O(1)."""
    return _slice_of(global_batch, dp, dp_rank, micro_batch)


def _slice_of(global_batch: int, dp: int, dp_rank: int, micro_batch: int | None) -> tuple[int, int]:
    """(first position within a global batch, count) of DP rank ``dp_rank``'s slice (``replica_samples``), in O(1)."""
    if micro_batch is None:
        _check_dp(global_batch, dp, dp_rank)
        per = global_batch // dp
        return dp_rank * per, per
    micro_batch = checked_int("micro_batch", micro_batch, 1, MAX_POSITION)
    dp = checked_int("dp", dp, 1, MAX_POSITION)
    total, rest = divmod(global_batch, micro_batch)
    if rest:
        raise DataStateError(f"global batch {global_batch} is not a multiple of micro_batch {micro_batch} "
                             f"({global_batch} % {micro_batch} = {rest})")
    if dp > total:
        raise DataStateError(f"dp={dp} replicas cannot each take a micro-batch of the {total} in a global batch of "
                             f"{global_batch} (micro_batch {micro_batch}): use dp <= {total}")
    if not 0 <= checked_int("dp_rank", dp_rank, -MAX_POSITION, MAX_POSITION) < dp:
        raise DataStateError(f"dp_rank must be in [0, {dp}), got {dp_rank}")
    q, r = divmod(total, dp)
    return (dp_rank * q + min(dp_rank, r)) * micro_batch, (q + (dp_rank < r)) * micro_batch


def loss_scale(global_batch: int, dp: int, dp_rank: int, micro_batch: int = 1) -> float:
    """The factor DP rank ``dp_rank`` of ``dp`` multiplies its loss by (the mean over its own samples)
    so that a DP gradient reduction that averages over the ``dp`` ranks (FSDP2's and HSDP's default,
    DDP) yields the gradient of the mean over the global batch: ``count * dp / global_batch``, its
    slice's ``count`` (``replica_slice``). Exactly 1.0 when the slices are equal; with uneven slices
    (``dp`` does not divide the batch) a rank reading one sample more weighs more. Pure."""
    count = _slice_of(global_batch, dp, dp_rank, micro_batch)[1]
    return 1.0 if count * dp == global_batch else count * dp / global_batch


def rank_batch_ids(state: DataState, dp: int, dp_rank: int, micro_batch: int | None = None) -> np.ndarray:
    """DP rank ``dp_rank``'s contiguous slice of the next global batch (``replica_samples``)."""
    lo, count = _slice_of(state.global_batch, dp, dp_rank, micro_batch)
    return global_batch_ids(state)[lo : lo + count]


# ---------------------------------------------------------------------------------------------
# Remaining samples of a DP rank (the view a mount or a reader shows)
#
# Bound: a view starting at progress ``P`` ends at an absolute position ``end``. By default
# (``num_epochs=None``) ``end`` is the end of the global batch that holds the last sample of
# the epoch containing ``P``, so the view is whole global batches (the last one may reach into
# the next epoch, exactly as the trainer's batches do). With ``num_epochs=E`` the stream ends
# at ``E * num_samples``; when that is not a multiple of the global batch the final batch is
# partial and split contiguously across the DP ranks as evenly as possible, the first
# ``r % dp`` ranks taking one sample more (``numpy.array_split``). Nothing is dropped, so the
# union over ranks is exactly positions ``[P, end)``.
# ---------------------------------------------------------------------------------------------


def _check_dp(global_batch: int, dp: int, dp_rank: int | None = None) -> None:
    dp = checked_int("dp", dp, 1, MAX_POSITION)
    if global_batch % dp:
        raise DataStateError(
            f"global batch {global_batch} is not divisible by dp={dp} "
            f"({global_batch} % {dp} = {global_batch % dp}): choose a dp that divides it or change --global-batch"
        )
    if dp_rank is not None and not 0 <= checked_int("dp_rank", dp_rank, -MAX_POSITION, MAX_POSITION) < dp:
        raise DataStateError(f"dp_rank must be in [0, {dp}), got {dp_rank}")


def stream_end(num_samples: int, global_batch: int, consumed: int, num_epochs: int | None = None) -> int:
    """Absolute position (samples consumed globally) where a view starting at ``consumed`` ends."""
    if num_samples < 1 or global_batch < 1 or consumed < 0:
        raise DataStateError(f"bad stream: num_samples={num_samples}, global_batch={global_batch}, consumed={consumed}")
    if num_epochs is not None:
        num_epochs = checked_int("num_epochs", num_epochs, 0, MAX_POSITION)
        return max(consumed, num_epochs * num_samples)
    epoch_end = (consumed // num_samples + 1) * num_samples
    return consumed + -(-(epoch_end - consumed) // global_batch) * global_batch


def rank_positions(consumed: int, end: int, global_batch: int, dp: int, dp_rank: int,
                   micro_batch: int | None = None) -> np.ndarray:
    """Global positions in ``[consumed, end)`` that DP rank ``dp_rank`` takes, in consumption order
    (each whole global batch split by ``replica_samples``)."""
    first, per = _slice_of(global_batch, dp, dp_rank, micro_batch)
    if end < consumed:
        raise DataStateError(f"end {end} is before the progress {consumed}")
    full, rem = divmod(end - consumed, global_batch)
    starts = consumed + np.arange(full, dtype=np.int64) * global_batch + first
    out = (starts[:, None] + np.arange(per, dtype=np.int64)[None, :]).ravel()
    if rem:
        q, r = divmod(rem, dp)
        lo = consumed + full * global_batch + dp_rank * q + min(dp_rank, r)
        out = np.concatenate([out, np.arange(lo, lo + q + (dp_rank < r), dtype=np.int64)])
    return out


def ids_at(positions: np.ndarray, num_samples: int, seed: int, shuffle: bool = True, order: str = "pcg64") -> np.ndarray:
    """Sample ids at the given global positions of the order (any epochs); with ``order="feistel"``
    without materialising an epoch's permutation."""
    pos = np.asarray(positions, dtype=np.int64)
    epochs, offsets = np.divmod(pos, num_samples)
    if not shuffle or pos.size == 0:
        return offsets
    def epoch_ids(e: int, offs: np.ndarray) -> np.ndarray:
        if order == "feistel":
            return feistel_ids(offs, num_samples, seed, e)
        return sample_order(num_samples, seed, e, True)[offs]
    lo, hi = int(epochs.min()), int(epochs.max())
    if lo == hi:
        return epoch_ids(lo, offsets)
    out = np.empty_like(pos)
    for e in range(lo, hi + 1):
        mask = epochs == e
        if mask.any():
            out[mask] = epoch_ids(e, offsets[mask])
    return out


def remaining_ids(state: DataState, dp: int, dp_rank: int, *, num_epochs: int | None = None,
                  end: int | None = None, micro_batch: int | None = None) -> np.ndarray:
    """Sample ids DP rank ``dp_rank`` of ``dp`` consumes from ``state.consumed`` on, in order.

    The view ends at ``end`` (an absolute position) or at :func:`stream_end`'s bound; whole global
    batches are split by ``replica_samples(state.global_batch, dp, micro_batch)``.
    """
    if end is None:
        end = stream_end(state.num_samples, state.global_batch, state.consumed, num_epochs)
    pos = rank_positions(state.consumed, end, state.global_batch, dp, dp_rank, micro_batch)
    return ids_at(pos, state.num_samples, state.seed, state.shuffle, state.order)
