"""A DP rank's remaining samples as byte files, without FUSE.

:class:`RankView` is what ``rank-<i>/`` of a mount shows: ``samples.bin`` (the rank's
remaining samples concatenated in consumption order), ``ids.txt`` (one sample id per line)
and ``offsets.txt`` (the byte offset of each sample in ``samples.bin``, one per line, then
the total size). All three are generated lazily by byte range: a read maps to samples by
binary search over prefix sums, so nothing is materialised whole.

:class:`RankReader` is the trainer's entry point: given an index, a :class:`DataState`, ``dp``
and ``dp_rank`` it yields the bytes of the rank's next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from ..errors import DataStateError
from .index import DataIndex, SourceReader
from .partition import DataState, rank_batch_ids, remaining_ids

__all__ = ["LineFile", "RankView", "RankReader", "rank_view"]

log = logging.getLogger(__name__)


def _decimal_widths(values: np.ndarray) -> np.ndarray:
    """Number of decimal digits of each non-negative int64 value."""
    v = np.asarray(values, dtype=np.int64)
    width = np.ones(v.shape, dtype=np.int64)
    p = 10
    for _ in range(18):
        big = v >= p
        if not big.any():
            break
        width += big
        p *= 10
    return width


class LineFile:
    """A text file of one decimal integer per line, generated lazily by byte range."""

    __slots__ = ("values", "_cum")

    def __init__(self, values: np.ndarray) -> None:
        self.values = np.asarray(values, dtype=np.int64)
        self._cum = np.zeros(len(self.values) + 1, dtype=np.int64)
        np.cumsum(_decimal_widths(self.values) + 1, out=self._cum[1:])

    @property
    def size(self) -> int:
        return int(self._cum[-1])

    def read(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        first = int(np.searchsorted(self._cum, offset, side="right")) - 1
        last = int(np.searchsorted(self._cum, end, side="left"))
        text = "".join(f"{v}\n" for v in self.values[first:last].tolist()).encode()
        base = int(self._cum[first])
        return text[offset - base : end - base]


class RankView:
    """The bytes of the samples ``ids`` concatenated in order, read from an index's sources."""

    __slots__ = ("index", "reader", "ids", "cum", "_pcum", "_fid", "_off", "_len", "_ids_file", "_offsets_file")

    def __init__(self, index: DataIndex, reader: SourceReader, ids: np.ndarray) -> None:
        self.index = index
        self.reader = reader
        self.ids = np.asarray(ids, dtype=np.int64)
        self._fid, self._off, self._len = index.sample_ranges(self.ids)  # pieces for a ``pieces`` index
        self._pcum = np.zeros(len(self._len) + 1, dtype=np.int64)
        np.cumsum(self._len, out=self._pcum[1:])
        if index.sample_start is None:
            self.cum = self._pcum
        else:  # sample boundaries among the pieces' boundaries
            first = np.zeros(len(self.ids) + 1, dtype=np.int64)
            np.cumsum(index.piece_counts(self.ids), out=first[1:])
            self.cum = self._pcum[first]
        self._ids_file: LineFile | None = None
        self._offsets_file: LineFile | None = None

    @property
    def size(self) -> int:
        """Size of ``samples.bin``."""
        return int(self.cum[-1])

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    @property
    def ids_file(self) -> LineFile:
        if self._ids_file is None:
            self._ids_file = LineFile(self.ids)
        return self._ids_file

    @property
    def offsets_file(self) -> LineFile:
        if self._offsets_file is None:
            self._offsets_file = LineFile(self.cum)
        return self._offsets_file

    def _groups(self, offset: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """Source reads (file, start, stop) covering ``[offset, end)``: adjacent samples coalesced."""
        f, s, e = self._group_arrays(offset, end)
        return f.tolist(), s.tolist(), e.tolist()

    def _group_arrays(self, offset: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cum = self._pcum
        i = int(np.searchsorted(cum, offset, side="right")) - 1
        j = int(np.searchsorted(cum, end, side="left"))
        f = self._fid[i:j]
        s = self._off[i:j].copy()
        e = s + self._len[i:j]
        s[0] += offset - int(cum[i])
        e[-1] -= int(cum[j]) - end
        if j - i == 1:
            return f, s, e
        brk = np.flatnonzero((f[1:] != f[:-1]) | (s[1:] != e[:-1])) + 1
        first = np.concatenate([np.zeros(1, np.int64), brk])
        last = np.concatenate([brk, np.array([j - i], np.int64)]) - 1
        return f[first], s[first], e[last]

    def source_pieces(self, offset: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``[offset, offset + size)`` as (descriptor, position, length) arrays of local source reads, in order.

        None when a piece lives on a remote source. Raises :class:`SourceReadError` when a
        source is missing or shorter than the pieces need. Used by the mount to let libfuse
        do the reads in C.
        """
        end = min(offset + size, self.size)
        if offset >= end:
            z = np.zeros(0, np.int64)
            return z, z, z
        f, s, e = self._group_arrays(offset, end)
        fids, inv = np.unique(f, return_inverse=True)
        need = np.zeros(len(fids), np.int64)
        np.maximum.at(need, inv, e)
        fds = self.reader.local_fds(fids.tolist(), need.tolist())
        if fds is None:
            return None
        return np.asarray(fds, np.int64)[inv], s, e - s

    def ranges(self, offset: int, size: int) -> tuple[list[int], list[int], list[int]]:
        """Source ranges (file ids, starts, stops) holding ``[offset, offset + size)``, in order."""
        end = min(offset + size, self.size)
        if offset >= end:
            return [], [], []
        return self._groups(offset, end)

    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)`` of ``samples.bin`` (short at the end)."""
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        fs, ss, es = self._groups(offset, end)
        if len(fs) == 1:
            return self.reader.read(fs[0], ss[0], es[0] - ss[0])
        buf = bytearray(end - offset)
        self._fill(memoryview(buf), fs, ss, es)
        return bytes(buf)

    def read_into(self, offset: int, buf: memoryview) -> int:
        """Read ``[offset, offset + len(buf))`` into ``buf`` (no intermediate copies); returns the count."""
        end = min(offset + len(buf), self.size)
        if offset >= end:
            return 0
        self._fill(buf, *self._groups(offset, end))
        return end - offset

    def _fill(self, buf: memoryview, fs: list[int], ss: list[int], es: list[int]) -> None:
        self.reader.read_many_into(fs, ss, es, buf)

    def sample(self, k: int) -> bytes:
        """Bytes of the ``k``-th sample of the view."""
        return self.read(int(self.cum[k]), int(self.cum[k + 1] - self.cum[k]))

    def __iter__(self) -> Iterator[bytes]:
        for k in range(len(self.ids)):
            yield self.sample(k)


def rank_view(index: DataIndex, reader: SourceReader, state: DataState, dp: int, dp_rank: int, *,
              num_epochs: int | None = None, end: int | None = None, micro_batch: int | None = None) -> RankView:
    """The view of DP rank ``dp_rank``'s remaining samples (exactly a mount's ``rank-<i>/``);
    ``micro_batch``: global batches split by whole micro-batches (``replica_samples``)."""
    if state.num_samples != index.num_samples:
        raise DataStateError(f"the data state has {state.num_samples} samples but the index {index.num_samples}: "
                         "use the index the job was started with")
    return RankView(index, reader, remaining_ids(state, dp, dp_rank, num_epochs=num_epochs, end=end,
                                                 micro_batch=micro_batch))


class RankReader:
    """A trainer rank's batches: ``next_batch()`` returns its slice of the next global batch as bytes.

    ``state`` is advanced by one global batch per call (every rank advances the same state).
    ``micro_batch``: the slice is the rank's share of whole micro-batches (``replica_samples``:
    uneven when ``dp`` does not divide them); None: equal slices.
    """

    def __init__(self, index: DataIndex, state: DataState, dp: int, dp_rank: int,
                 reader: SourceReader | None = None, micro_batch: int | None = None) -> None:
        if state.num_samples != index.num_samples:
            raise DataStateError(f"the data state has {state.num_samples} samples but the index {index.num_samples}: "
                             "use the index the job was started with")
        self.index = index
        self.state = state
        self.dp = dp
        self.dp_rank = dp_rank
        self.micro_batch = micro_batch
        self.reader = reader or SourceReader(index.files)

    def batch_ids(self) -> np.ndarray:
        return rank_batch_ids(self.state, self.dp, self.dp_rank, self.micro_batch)

    def next_batch(self) -> list[bytes]:
        """The bytes of each sample of this rank's part of the next global batch; advances the state."""
        ids = self.batch_ids()
        fid, off, ln = self.index.sample_ranges(ids)
        parts = [self.reader.read(int(f), int(o), int(n)) for f, o, n in zip(fid, off, ln)]
        if self.index.sample_start is None:
            out = parts
        else:
            ends = np.cumsum(self.index.piece_counts(ids)).tolist()
            out = [b"".join(parts[a:z]) for a, z in zip([0, *ends[:-1]], ends)]
        self.state = self.state.advance()
        return out

    def __iter__(self) -> Iterator[list[bytes]]:
        while True:
            yield self.next_batch()
