"""Sequence packing whose samples do not depend on the layout.

Documents (token arrays of any length) are concatenated in a document order and cut into
samples of ``seq_len + extra`` tokens, consecutive samples sharing ``extra`` tokens (``extra=1``:
inputs plus shifted targets, as Megatron-LM's GPTDataset builds them). The cut is a *packing
index* computed once over the document lengths: row ``k`` of ``sample_index`` is (position in the
document order, token offset in that document) where sample ``k`` starts, row ``k + 1`` where it
ends, exactly the ``sample_idx`` array of Megatron's ``build_sample_idx``. Sample ``i`` is thus a
pure function of the documents and ``i``: any DP size, worker count or resharding sampler that
asks for sample ``i`` gets the same tokens.

:class:`DocumentSource` is what a format provides (document lengths and token slices);
:class:`PackedDataset` is the torch map-style dataset over a source and a packing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import DataIndexError

__all__ = ["DocumentSource", "Packing", "PackedDataset", "TokenFile", "pack_documents", "packed_pieces"]

log = logging.getLogger(__name__)


@runtime_checkable
class DocumentSource(Protocol):
    """Documents of token ids: ``doc_lengths()`` (int array, one per document) and a slice reader."""

    def doc_lengths(self) -> np.ndarray: ...

    def doc_tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray: ...


class TokenFile:
    """A flat pre-tokenized file (``uint16``/``uint32``/... tokens back to back) as one document, memory-mapped:
    ``PackedDataset(TokenFile(path), Packing.build(TokenFile(path).doc_lengths(), seq_len))`` is its windows of
    ``seq_len + 1`` tokens, consecutive windows sharing one token (Megatron's cut of one long document)."""

    def __init__(self, path: str, dtype: str = "uint16") -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise DataIndexError(f"cannot read the token file {path}: {e.strerror or e}") from None
        self._n = size // self.dtype.itemsize
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"path": self.path, "dtype": str(self.dtype)}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"], state["dtype"])  # type: ignore[misc]

    def doc_lengths(self) -> np.ndarray:
        return np.array([self._n], dtype=np.int64)

    def flat_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self._n,)).view(np.ndarray) \
                if self._n else np.zeros(0, self.dtype)
        return self._map, np.zeros(1, dtype=np.int64)

    def doc_tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.flat_tokens()[0][start:stop]


def pack_documents(lengths: np.ndarray, doc_order: np.ndarray, seq_len: int, extra: int = 1) -> np.ndarray:
    """Megatron's sample index over ``doc_order`` (document ids, repeats allowed): int64 ``(n + 1, 2)``.

    Sample ``k`` covers stream tokens ``[k * seq_len, (k + 1) * seq_len + extra)``; partial last
    samples are dropped (Megatron's ``drop_last_partial_sequence``). Vectorised: one cumulative
    sum and one binary search, no pass per sample.
    """
    if seq_len < 1 or extra not in (0, 1):
        raise DataIndexError(f"packing needs seq_len >= 1 and extra in (0, 1), got seq_len={seq_len}, extra={extra}")
    order = np.asarray(doc_order, dtype=np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)[order]
    if order.size == 0:
        raise DataIndexError("packing needs at least one document")
    if (sizes < 0).any():
        raise DataIndexError("document lengths must be >= 0")
    ends = np.cumsum(sizes)
    total = int(ends[-1])
    n = (total - extra) // seq_len
    if n < 1:
        raise DataIndexError(f"the documents hold {total} tokens, fewer than one sample of {seq_len} + {extra}")
    pos = np.arange(n + 1, dtype=np.int64) * seq_len
    at = np.minimum(np.searchsorted(ends, pos, side="right"), order.size - 1)
    out = np.empty((n + 1, 2), dtype=np.int64)
    out[:, 0] = at
    out[:, 1] = pos - (ends[at] - sizes[at])
    out[0] = (0, 0)
    return out


@dataclass(frozen=True, eq=False)
class Packing:
    """A packing index: ``doc_order`` (document ids in stream order), ``sample_index`` (``pack_documents``)
    and optionally ``shuffle`` (sample ``i`` is packed sample ``shuffle[i]``, Megatron's shuffle index)."""

    doc_order: np.ndarray
    sample_index: np.ndarray
    seq_len: int
    extra: int = 1
    shuffle: np.ndarray | None = None

    def __post_init__(self) -> None:
        si = self.sample_index
        if si.ndim != 2 or si.shape[1] != 2 or si.shape[0] < 2:
            raise DataIndexError(f"sample_index must be (n + 1, 2) with n >= 1, got shape {si.shape}")
        if self.shuffle is not None and len(self.shuffle) != si.shape[0] - 1:
            raise DataIndexError(f"the shuffle index has {len(self.shuffle)} entries for {si.shape[0] - 1} samples")

    @classmethod
    def build(cls, lengths: np.ndarray, seq_len: int, *, doc_order: np.ndarray | None = None,
              extra: int = 1) -> Packing:
        """Pack the documents in ``doc_order`` (default: document order)."""
        order = np.arange(len(lengths), dtype=np.int64) if doc_order is None else np.asarray(doc_order, np.int64)
        return cls(order, pack_documents(lengths, order, seq_len, extra), seq_len, extra)

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def pieces(self, i: int) -> list[tuple[int, int, int | None]]:
        """(document id, start, stop or None for the document's end) of sample ``i``, in order."""
        k = int(self.shuffle[i]) if self.shuffle is not None else int(i)
        b, bo, e, eo = self.sample_index[k : k + 2].ravel().tolist()
        order = self.doc_order
        if b == e:
            return [(int(order[b]), bo, eo + self.extra)]
        out: list[tuple[int, int, int | None]] = [(int(order[b]), bo, None)]
        out.extend((int(order[j]), 0, None) for j in range(b + 1, e))
        out.append((int(order[e]), 0, eo + self.extra))
        return out

    def sample(self, source: DocumentSource, i: int) -> np.ndarray:
        """The tokens of sample ``i`` (``seq_len + extra`` of them, int64) read from ``source``."""
        out = np.empty(self.seq_len + self.extra, dtype=np.int64)
        pos = 0
        for d, a, z in self.pieces(i):
            t = source.doc_tokens(d, a, z)
            out[pos : pos + len(t)] = t
            pos += len(t)
        if pos != len(out):
            raise DataIndexError(f"sample {i} read {pos} tokens, expected {len(out)}: the documents differ from "
                                 "the lengths the packing was built from")
        return out


def packed_pieces(packing: Packing, lengths: np.ndarray, ids: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of samples ``ids`` (default: all) at once: (sample_start (len + 1), doc, start, stop) with the
    pieces of the ``k``-th sample at ``[sample_start[k], sample_start[k + 1])``; zero-length pieces dropped.
    Vectorised, for indexes and batches."""
    if ids is None:
        ids = np.arange(len(packing), dtype=np.int64)
    n = len(ids)
    k = packing.shuffle[ids].astype(np.int64) if packing.shuffle is not None else np.asarray(ids, np.int64)
    si = packing.sample_index
    b, bo, e, eo = si[k, 0], si[k, 1], si[k + 1, 0], si[k + 1, 1]
    count = e - b + 1
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(count, out=first[1:])
    total = int(first[-1])
    owner = np.repeat(np.arange(n, dtype=np.int64), count)
    j = b[owner] + (np.arange(total, dtype=np.int64) - first[owner])  # position in the document order
    doc = packing.doc_order[j].astype(np.int64)
    start = np.where(j == b[owner], bo[owner], 0)
    stop = np.where(j == e[owner], eo[owner] + packing.extra, np.asarray(lengths)[doc])
    keep = stop > start
    kept = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner[keep], minlength=n), out=kept[1:])
    return kept, doc[keep], start[keep], stop[keep]


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset: item ``i`` is packed sample ``i`` as a 1-D int64 tensor of ``seq_len + extra`` tokens.

    A source with ``flat_tokens()`` (one token array and each document's offset in it, as a Megatron
    ``.bin``) is read by slicing that array directly: a sample costs about what slicing a memory map
    costs a plain dataset.
    """

    def __init__(self, source: DocumentSource, packing: Packing) -> None:
        self.source = source
        self.packing = packing
        self._n = len(packing)
        self._flat = getattr(source, "flat_tokens", None)
        self._tokens: tuple[np.ndarray, memoryview, memoryview, memoryview, memoryview | None] | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"source": self.source, "packing": self.packing}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["source"], state["packing"])  # type: ignore[misc, arg-type]

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.__getitems__([i])[0]

    def __getitems__(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """The samples ``ids`` (what a ``DataLoader`` asks for a batch), each copied into its row of one int64
        array: a sample's packing rows are read as Python ints through memoryviews and its pieces sliced
        from the flat tokens, so a batch makes no numpy call but its copies (a loader worker comes to each
        batch with cold caches after the batch before was shared with the main process: there a dozen
        distinct numpy calls a batch cost more than the copies, ~4 us a sample on 2 loaded cores)."""
        if self._flat is None:
            for i in ids:
                self._check(i)
            return [torch.from_numpy(self.packing.sample(self.source, int(i))) for i in ids]
        tokens, ostart, olen, rows, shuffle = self._index()
        p = self.packing
        width, extra = p.seq_len + p.extra, p.extra
        out = np.empty((len(ids), width), dtype=np.int64)
        for row, i in enumerate(ids):
            k = 2 * (shuffle[self._check(i)] if shuffle is not None else self._check(i))
            b, e = rows[k], rows[k + 2]  # first and last document position; token offsets in them next
            start = ostart[b] + rows[k + 1]
            if b == e and rows[k + 3] - rows[k + 1] + extra == width and rows[k + 3] + extra <= olen[b]:
                out[row] = tokens[start : start + width]  # one document: one slice
                continue
            try:
                at = self._copy_pieces(out[row], b, e, start, ostart[e] + rows[k + 3] + extra)
            except ValueError:  # a piece longer than the row has room for
                at = -1
            if at != width:
                held = f"{at} of its {width}" if at >= 0 else f"more than its {width}"
                raise DataIndexError(f"sample {i}: its documents hold {held} tokens: the documents differ from the "
                                     "lengths the packing was built from")
        return list(torch.from_numpy(out).unbind(0))

    def _check(self, i: int) -> int:
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} of {self._n}")
        return i

    def _index(self) -> tuple[np.ndarray, memoryview, memoryview, memoryview, memoryview | None]:
        """The flat tokens (mapped once; a forked loader worker inherits the read-only map), per position of
        the document order its token offset and length, the sample index's rows flat and the shuffle index,
        the last four as memoryviews (an item is a Python int)."""
        if self._tokens is None:
            p = self.packing
            tokens, starts = self._flat()  # type: ignore[misc]
            lengths = np.asarray(self.source.doc_lengths())
            shuffle = None if p.shuffle is None else memoryview(np.ascontiguousarray(p.shuffle))
            self._tokens = (tokens, memoryview(np.ascontiguousarray(starts[p.doc_order])),
                            memoryview(np.ascontiguousarray(lengths[p.doc_order])),
                            memoryview(np.ascontiguousarray(p.sample_index).reshape(-1)), shuffle)
        return self._tokens

    def _copy_pieces(self, row: np.ndarray, b: int, e: int, start: int, stop: int) -> int:
        """Copy the sample from document position ``b`` to ``e`` (token offsets ``start`` to ``stop`` in the
        flat tokens) into ``row``; returns the tokens its documents hold of it (the row's size if they match
        the packing)."""
        tokens, ostart, olen, _, _ = self._index()
        if b == e:
            at = min(stop, ostart[b] + olen[b]) - start
            if at == row.size:
                row[:] = tokens[start:stop]
            return at
        at = ostart[b] + olen[b] - start
        row[:at] = tokens[start : start + at]
        for j in range(b + 1, e):
            a, n = ostart[j], olen[j]
            row[at : at + n] = tokens[a : a + n]
            at += n
        tail = min(stop - ostart[e], olen[e])  # not past the document's end
        row[at:] = tokens[ostart[e] : ostart[e] + tail]
        return at + tail
