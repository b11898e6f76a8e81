"""Megatron-LM's indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``) as tenplex sources.

The ``.idx`` file (``MMIDIDX``, Megatron-LM ``megatron/core/datasets/indexed_dataset.py``): the
9-byte header ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` = 1, the token dtype code ``<B`` (1 uint8,
2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count ``<Q``, the
document count ``<Q``, then the sequence lengths (int32), the sequence byte pointers into the
``.bin`` (int64) and the document indices (int64: ``0`` then the sequence index ending each
document). The ``.bin`` file is the sequences' tokens back to back. Both are memory-mapped: opening
reads the 34-byte header only, a sample reads its own tokens.

:func:`megatron_packing` builds GPTDataset's document, sample and shuffle indices (Megatron-LM
``megatron/core/datasets/gpt_dataset.py``): every sequence is a document, the document index is
``num_epochs`` copies of all documents shuffled by ``numpy.random.RandomState(seed)``, the sample
index cuts ``seq_len + 1`` tokens per sample (``pack_documents``) and the shuffle index is a
permutation drawn next from the same random state; sample ``i`` equals Megatron's
``GPTDataset[i]["tokens"]`` plus its label token (``separate_final_epoch`` included: Megatron shuffles
a last epoch apart when fewer than 80% of its samples are asked for).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import DataIndexError
from .index import DataIndex, SourceFile
from .packing import Packing, PackedDataset, pack_documents, packed_pieces

__all__ = ["MegatronIndexed", "write_megatron", "megatron_packing", "megatron_gpt_dataset", "megatron_index",
           "MMIDIDX_HEADER", "MEGATRON_DTYPES"]

log = logging.getLogger(__name__)
MMIDIDX_HEADER = b"MMIDIDX\x00\x00"
#: Megatron's dtype codes.
MEGATRON_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                                        4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
                                        7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
_HEADER_BYTES = 34


def write_megatron(prefix: str, documents: Iterable[np.ndarray], dtype: Any = np.uint16) -> None:
    """Write ``PREFIX.bin`` / ``PREFIX.idx`` as Megatron's ``IndexedDatasetBuilder`` does: one sequence per
    document (the layout ``tools/preprocess_data.py`` writes for GPT data)."""
    dt = np.dtype(dtype)
    codes = {v: k for k, v in MEGATRON_DTYPES.items()}
    if dt not in codes:
        raise DataIndexError(f"Megatron has no dtype code for {dt}: use one of {sorted(str(d) for d in codes)}")
    lengths: list[int] = []
    with open(prefix + ".bin", "wb") as out:
        for doc in documents:
            arr = np.asarray(doc, dtype=dt)
            out.write(arr.tobytes(order="C"))
            lengths.append(int(arr.size))
    ln = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(ln), dtype=np.int64)
    np.cumsum(ln[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    doc_idx = np.arange(len(ln) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(MMIDIDX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", codes[dt]))
        f.write(struct.pack("<Q", len(ln)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(ln.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


class MegatronIndexed:
    """A memory-mapped Megatron indexed dataset; a :class:`~tenplex.data.packing.DocumentSource` of its sequences."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        try:
            with open(self.idx_path, "rb") as f:
                head = f.read(_HEADER_BYTES)
        except OSError as e:
            raise DataIndexError(f"cannot read the Megatron index {self.idx_path}: {e.strerror or e}") from None
        if len(head) < _HEADER_BYTES or head[:9] != MMIDIDX_HEADER:
            raise DataIndexError(f"{self.idx_path} is not a Megatron MMIDIDX index (header {head[:9]!r})")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in MEGATRON_DTYPES:
            raise DataIndexError(f"{self.idx_path}: version {version}, dtype code {code}: this reader takes "
                                 f"version 1 and codes {sorted(MEGATRON_DTYPES)}")
        self.dtype = MEGATRON_DTYPES[code]
        need = _HEADER_BYTES + n_seq * 12 + n_doc * 8
        size = os.path.getsize(self.idx_path)
        if size < need:
            raise DataIndexError(f"{self.idx_path} is {size} bytes, its counts ({n_seq} sequences, {n_doc} document "
                                 f"indices) need {need}: the file is truncated")
        mm = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, _HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, _HEADER_BYTES + 4 * n_seq)
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, _HEADER_BYTES + 12 * n_seq)
        if (self.sequence_pointers % self.dtype.itemsize).any():
            raise DataIndexError(f"{self.idx_path}: a sequence pointer is not a multiple of the {self.dtype} size")
        self._starts = self.sequence_pointers // self.dtype.itemsize  # token offset of each sequence
        self._bin: np.ndarray | None = None
        self._bin_pid = -1

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def _tokens(self) -> np.ndarray:
        """The ``.bin`` as a flat token array over a read-only memory map, mapped once per process (a forked
        loader worker maps its own); a plain ndarray, so slicing it costs no memmap bookkeeping."""
        if self._bin is None or self._bin_pid != os.getpid():
            size = os.path.getsize(self.bin_path)
            need = int(self._starts[-1] + self.sequence_lengths[-1]) if len(self) else 0
            if size // self.dtype.itemsize < need:
                raise DataIndexError(f"{self.bin_path} holds {size // self.dtype.itemsize} tokens, its index needs "
                                     f"{need}")
            if size:
                with open(self.bin_path, "rb") as f:
                    self._bin = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=self.dtype,
                                              count=size // self.dtype.itemsize)
            else:
                self._bin = np.zeros(0, self.dtype)
            self._bin_pid = os.getpid()
        return self._bin

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    def doc_lengths(self) -> np.ndarray:
        return self.sequence_lengths

    def flat_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``.bin``'s tokens (memory-mapped) and each sequence's token offset in it."""
        return self._tokens(), self._starts

    def doc_tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of sequence ``doc`` (a view of the memory map, no copy)."""
        base = int(self._starts[doc])
        end = int(self.sequence_lengths[doc]) if stop is None else stop
        return self._tokens()[base + start : base + end]


def megatron_packing(lengths: np.ndarray, seq_len: int, *, seed: int = 1234, num_samples: int | None = None,
                     shuffle_samples: bool = True, extra: int = 1) -> Packing:
    """GPTDataset's document, sample and shuffle indices over documents of ``lengths`` (see the module doc),
    ``separate_final_epoch`` included: when ``num_samples`` needs a last epoch of which fewer than 80% of
    an epoch's samples are used, that epoch's documents and samples are shuffled apart from the rest."""
    lengths = np.asarray(lengths)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DataIndexError(f"the dataset holds {tokens_per_epoch} tokens; packing needs at least 2")
    num_epochs, separate = 1, False
    if num_samples is not None:
        num_epochs = max(1, -(-(num_samples * seq_len + extra) // tokens_per_epoch))
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_len
        per_epoch = (tokens_per_epoch - extra) // seq_len
        separate = num_samples - sans_final < int(0.80 * per_epoch)  # type: ignore[operator]
    state = np.random.RandomState(seed)

    def documents(epochs: int) -> np.ndarray:
        order = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
        state.shuffle(order)
        return order

    doc_index = np.concatenate([documents(num_epochs - 1), documents(1)]) if separate else documents(num_epochs)
    sample_index = pack_documents(lengths, doc_index, seq_len, extra)
    shuffle = None
    if shuffle_samples:
        n = sample_index.shape[0] - 1
        dtype = np.uint32 if n < np.iinfo(np.uint32).max - 1 else np.int64
        cut = sans_final if separate else n
        first, last = np.arange(cut, dtype=dtype), np.arange(cut, n, dtype=dtype)
        state.shuffle(first)
        if separate:
            state.shuffle(last)
        shuffle = np.concatenate([first, last])
    return Packing(doc_index.astype(np.int64), sample_index, seq_len, extra, shuffle)


def megatron_gpt_dataset(prefix: str, seq_len: int, *, seed: int = 1234, num_samples: int | None = None,
                         shuffle_samples: bool = True) -> PackedDataset:
    """Megatron's GPT samples of ``PREFIX.bin``/``.idx``: item ``i`` is ``seq_len + 1`` tokens (int64 tensor)."""
    src = MegatronIndexed(prefix)
    return PackedDataset(src, megatron_packing(src.doc_lengths(), seq_len, seed=seed, num_samples=num_samples,
                                               shuffle_samples=shuffle_samples))


def megatron_index(dataset: PackedDataset) -> DataIndex:
    """A :class:`DataIndex` whose sample ``i`` is the bytes of ``dataset[i]`` in the ``.bin`` (its pieces), so the
    FUSE mount and :class:`~tenplex.data.view.RankView` serve the same samples (in the ``.bin``'s dtype)."""
    src = dataset.source
    if not isinstance(src, MegatronIndexed):
        raise DataIndexError(f"megatron_index takes a dataset over a MegatronIndexed source, got {type(src).__name__}")
    starts, doc, a, z = packed_pieces(dataset.packing, src.doc_lengths())
    item = src.dtype.itemsize
    offset = src.sequence_pointers[doc] + a * item
    length = (z - a) * item
    path = os.path.abspath(src.bin_path)
    return DataIndex((SourceFile(path, os.path.getsize(path)),), np.zeros(len(doc), np.uint32), offset,
                     length.astype(np.uint32), "pieces",
                     {"format": "megatron", "seq_len": dataset.packing.seq_len, "dtype": str(src.dtype)},
                     sample_start=starts)
