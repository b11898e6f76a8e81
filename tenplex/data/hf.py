"""Hugging Face ``datasets`` as tenplex sources: Arrow / Parquet on disk or any fsspec URL, streaming too.

:func:`hf_dataset` opens files (``.parquet``, ``.arrow``) or a ``save_to_disk`` directory, local or
remote (``s3://...`` with ``storage_options``), with the packaged builders only (no hub access).
:class:`HFSamples` is the torch map-style dataset over a ``datasets.Dataset``: item ``i`` is row
``i``'s token column as an int64 tensor, its text tokenised on the fly, or the row itself; it is a
:class:`~tenplex.data.packing.DocumentSource` for packing. :class:`StreamSlice` reads a streaming
``datasets.IterableDataset`` (no random access) at the stream positions a rank owns. :func:`hf_index`
indexes a token column's rows as byte ranges of the dataset's own Arrow cache files, so the FUSE mount
serves the same samples as :class:`HFSamples`.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import DataIndexError
from ..urls import url_fs
from .index import DataIndex, SourceFile
from .text import encoder

__all__ = ["hf_dataset", "HFSamples", "StreamSlice", "hf_index"]

log = logging.getLogger(__name__)
_FORMATS = {".parquet": "parquet", ".arrow": "arrow"}
_STREAM_BATCH = 256


def _is_saved_dataset(url: str, storage_options: dict[str, Any] | None) -> bool:
    fs, path = url_fs(url, storage_options, what="dataset", error=DataIndexError)
    return bool(fs.isdir(path) and fs.exists(path.rstrip("/") + "/state.json"))


def hf_dataset(paths: str | Sequence[str], *, storage_options: dict[str, Any] | None = None, streaming: bool = False,
               split: str = "train", cache_dir: str | None = None) -> Any:
    """A ``datasets.Dataset`` (``IterableDataset`` with ``streaming``) over Parquet or Arrow files, or a
    ``save_to_disk`` directory, at local paths or fsspec URLs. Local ``.arrow`` files are memory-mapped
    where they are; other files go through the packaged builder (which converts into ``cache_dir``)."""
    import datasets  # lazy: datasets is an optional dependency and slow to import

    files = [paths] if isinstance(paths, str) else list(paths)
    storage_options = copy.deepcopy(storage_options)  # datasets adds its own entries to the dict it is given
    if not files:
        raise DataIndexError("no dataset files given")
    if len(files) == 1 and _is_saved_dataset(files[0], storage_options):
        ds = datasets.load_from_disk(files[0], storage_options=storage_options)
        return ds.to_iterable_dataset() if streaming else ds
    kinds = {_FORMATS.get(os.path.splitext(f.split("?")[0])[1]) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise DataIndexError(f"cannot tell the format of {files[:3]}: give .parquet or .arrow files (one format), "
                             "or one save_to_disk directory")
    kind = kinds.pop()
    if kind == "arrow" and not streaming and all("://" not in f for f in files):  # mapped in place, no cache copy
        return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
    return datasets.load_dataset(kind, data_files=files, split=split, streaming=streaming,
                                 storage_options=storage_options, cache_dir=cache_dir)


class HFSamples(torch.utils.data.Dataset):
    """Map-style view of a ``datasets.Dataset``: ``column`` of token ids (int64 tensor per row), or
    ``text_column`` tokenised with ``tokenizer``, or (neither) the row as a dict."""

    def __init__(self, dataset: Any, *, column: str | None = None, tokenizer: Any = None,
                 text_column: str = "text") -> None:
        self.dataset = dataset
        self.column = column
        self.tokenizer = tokenizer
        self.text_column = text_column
        if column is not None and tokenizer is not None:
            raise DataIndexError("give column (token ids) or tokenizer (for text_column), not both")
        want = column if column is not None else (text_column if tokenizer is not None else None)
        if want is not None and want not in dataset.column_names:
            raise DataIndexError(f"the dataset has no column {want!r}; it has {dataset.column_names}")
        self._rows = dataset.with_format("numpy", columns=[column]) if column is not None else dataset
        self._encode = encoder(tokenizer) if tokenizer is not None else None
        self._lengths: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_encode": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._encode = encoder(self.tokenizer) if self.tokenizer is not None else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, ids: Sequence[int]) -> list[Any]:
        ids = [int(i) for i in ids]
        if self.column is not None:
            return [torch.from_numpy(np.array(t, dtype=np.int64)) for t in self._rows[ids][self.column]]
        if self._encode is not None:
            toks = self._encode(self.dataset[ids][self.text_column])
            return [torch.tensor(t, dtype=torch.int64) for t in toks]
        batch = self.dataset[ids]
        return [{k: v[j] for k, v in batch.items()} for j in range(len(ids))]

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def doc_lengths(self) -> np.ndarray:
        """Tokens per row (Arrow list lengths for a token column; one tokenizer pass for text); cached."""
        if self._lengths is None:
            if self.column is None and self._encode is None:
                raise DataIndexError("doc_lengths needs a token column or a tokenizer")
            import pyarrow.compute as pc  # lazy: pyarrow comes with datasets, an optional dependency

            name = self.column if self.column is not None else self.text_column
            parts = []
            for batch in self.dataset.with_format("arrow", columns=[name]).iter(batch_size=65536):
                if self.column is not None:
                    parts.append(pc.list_value_length(batch.column(0)).to_numpy(zero_copy_only=False))
                else:
                    parts.append(np.array([len(t) for t in self._encode(batch.column(0).to_pylist())]))
            self._lengths = np.concatenate(parts).astype(np.int64)
        return self._lengths

    def doc_tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.__getitems__([doc])[0].numpy()[start:stop]


class StreamSlice(torch.utils.data.IterableDataset):
    """The rows of a streaming dataset at ``positions`` (ascending stream positions, e.g. a rank's
    ``remaining_ids`` without shuffling): the stream is skipped to the first and read in order.

    In a ``DataLoader`` with workers, worker ``w`` of ``W`` yields positions ``w, w + W, ...`` of the list
    (each worker reads the stream itself: streams have no random access).
    """

    def __init__(self, stream: Any, positions: Sequence[int] | np.ndarray) -> None:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (np.diff(pos) <= 0).any():
            raise DataIndexError("a stream is read in order: positions must be strictly ascending (use the order "
                                 "without shuffling, within one epoch)")
        self.stream = stream
        self.positions = pos

    def __len__(self) -> int:
        return int(self.positions.size)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        mine = self.positions if info is None else self.positions[info.id :: info.num_workers]
        if not mine.size:
            return
        first = p = int(mine[0])
        k = 0
        # ``iter`` (batches) rather than ``__iter__``: in a loader worker the latter keeps only that worker's shards
        for batch in self.stream.skip(first).iter(batch_size=_STREAM_BATCH):
            names = list(batch)
            rows = len(batch[names[0]]) if names else 0
            hit = mine[k : k + rows] - p
            hit = hit[hit < rows]
            for j in hit.tolist():
                yield {n: batch[n][j] for n in names}
            k += len(hit)
            p += rows
            if k == mine.size:
                return
        raise DataIndexError(f"the stream ended at position {p} before position {int(mine[k])}")


def _file_maps(paths: set[str]) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's memory maps of ``paths`` (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DataIndexError(f"hf_index finds the Arrow buffers' file offsets in /proc/self/maps (Linux): "
                             f"{e.strerror or e}") from None
    out = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5] in paths:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, int(parts[2], 16), parts[5]))
    return out


def _token_type(ds: Any, column: str) -> Any:
    """The Arrow value type of ``column``, a list of integers; refuse what is not one contiguous run per row."""
    import pyarrow as pa  # lazy: pyarrow comes with datasets, an optional dependency

    if column not in ds.column_names:
        raise DataIndexError(f"the dataset has no column {column!r}; it has {ds.column_names}")
    t = ds.data.schema.field(column).type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise DataIndexError(f"column {column!r} is {t}, not a list of token ids: hf_index serves a row as its "
                             "values' bytes, which only a list of integers keeps in one contiguous run (tokenise "
                             "text first, e.g. ds.map(...) to an input_ids column)")
    if not pa.types.is_integer(t.value_type):
        raise DataIndexError(f"column {column!r} is {t}: its values are {t.value_type}, not integers; a nested "
                             "list or strings keep a row's values in several buffers (offsets and data), so a "
                             "row is not one byte range of the file")
    return t


def _chunk_ranges(chunk: Any, maps: list[tuple[int, int, int, str]], files: dict[str, int],
                  item: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(file id, offset, length) of each row of a list chunk, from its values buffer's place in a file map."""
    if chunk.null_count or chunk.values.null_count:
        raise DataIndexError("the token column has null rows or null values: a null has no bytes to serve; fill "
                             "or drop them (ds.filter(...).flatten_indices())")
    values = chunk.values
    offsets = chunk.offsets.to_numpy().astype(np.int64)
    if offsets[-1] == offsets[0]:  # only empty rows (refused by the caller): no bytes to place
        return np.zeros(len(chunk), np.int64), np.zeros(len(chunk), np.int64), np.zeros(len(chunk), np.int64)
    buf = values.buffers()[1]
    addr = buf.address + values.offset * item
    hit = [m for m in maps if m[0] <= addr and addr + max(buf.size - values.offset * item, 1) <= m[1]]
    if not hit:
        raise DataIndexError("the token column is not memory-mapped from the dataset's cache files (an in-memory "
                             "dataset): save it with ds.save_to_disk(DIR) and index datasets.load_from_disk(DIR)")
    start, _end, file_off, path = hit[0]
    at = file_off + (addr - start)
    a, z = int(offsets[0]) * item, min(int(offsets[-1]) * item, int(offsets[0]) * item + 64)
    with open(path, "rb") as f:  # the file holds what the map shows there (a cheap check of the arithmetic)
        if os.pread(f.fileno(), z - a, at + a) != buf.slice(values.offset * item + a, z - a).to_pybytes():
            raise DataIndexError(f"{path} does not hold the token column's bytes at offset {at + a}: the file changed "
                                 "since the dataset was loaded; load it again")
    return np.full(len(chunk), files[path], np.int64), at + offsets[:-1] * item, np.diff(offsets) * item


def hf_index(ds: Any, column: str = "input_ids") -> DataIndex:
    """A :class:`DataIndex` (kind ``pieces``, one piece a sample) whose sample ``i`` is the bytes of ``ds[i][column]``
    (a list of integers, in the column's dtype) in the dataset's own Arrow cache files, so the FUSE mount serves
    the samples of :class:`HFSamples` (``HFSamples(ds, column=column)[i]`` is their values as int64).

    ``datasets`` memory-maps its cache files (uncompressed Arrow IPC streams), so a row's list values are one
    contiguous run of a file: its offset is the values buffer's address less the start of its map
    (``/proc/self/maps``). Slices and concatenations of files are followed, and so is an indices mapping
    (``select``, ``shuffle``, ``filter``); nulls, empty rows, in-memory tables and non-integer columns are refused.
    """
    import pyarrow as pa  # lazy: pyarrow comes with datasets, an optional dependency

    if not hasattr(ds, "cache_files") or not hasattr(ds, "data"):
        raise DataIndexError(f"hf_index takes a non-streaming datasets.Dataset, got {type(ds).__name__} (a stream "
                             "has no cache files: load it without streaming=True)")
    vtype = _token_type(ds, column).value_type
    dtype = np.dtype(vtype.to_pandas_dtype())
    paths = [os.path.realpath(f["filename"]) for f in ds.cache_files]
    if not paths:
        raise DataIndexError("the dataset has no cache files (built in memory): save it with ds.save_to_disk(DIR) "
                             "and index datasets.load_from_disk(DIR)")
    files = {p: k for k, p in enumerate(dict.fromkeys(paths))}
    maps = _file_maps(set(files))
    col = ds.data.table.column(column)
    parts = [_chunk_ranges(c, maps, files, dtype.itemsize) for c in col.chunks if len(c)]
    fid, off, ln = (np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64) for k in range(3))
    mapping = getattr(ds, "_indices", None)  # select / shuffle / filter: row i of ds is physical row indices[i]
    if mapping is not None:
        rows = mapping.column(0).to_numpy().astype(np.int64) if isinstance(mapping, pa.Table) else \
            np.asarray(mapping.table.column(0).to_numpy(), np.int64)
        fid, off, ln = fid[rows], off[rows], ln[rows]
    if len(fid) != len(ds):
        raise DataIndexError(f"hf_index found {len(fid)} rows in the cache files, the dataset has {len(ds)}")
    empty = np.flatnonzero(ln == 0)
    if empty.size:
        raise DataIndexError(f"row {int(empty[0])} (and {empty.size - 1} more) has no tokens: a sample of the mount "
                             "is at least one byte; drop empty rows (ds.filter(lambda r: len(r[column]) > 0))")
    if (ln >= 1 << 32).any():
        raise DataIndexError("a row is 4 GiB or larger; samples must be smaller")
    used, fid = np.unique(fid, return_inverse=True)  # drop cache files no row is in (an indices file)
    names = list(files)
    srcs = tuple(SourceFile(names[k], os.path.getsize(names[k])) for k in used.tolist())
    return DataIndex(srcs, fid.astype(np.uint32), off, ln.astype(np.uint32), "pieces",
                     {"format": "hf", "column": column, "dtype": str(dtype)},
                     sample_start=np.arange(len(fid) + 1, dtype=np.int64))
