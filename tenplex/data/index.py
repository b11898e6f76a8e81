"""Dataset index: every sample is a byte range ``(file, offset, length)`` in a source file.

Sources are fsspec URLs (local paths, ``memory://``, ``s3://`` ...). Three ways to cut them:

- ``records``: fixed-size records of ``record_bytes``; trailing bytes that do not fill a
  record are ignored (logged).
- ``jsonl``: one sample per line, the trailing ``\\n`` included, so that a concatenation of
  samples is again JSONL; empty lines are skipped.
- ``tokens``: flat token files (``uint16``/``uint32``) cut into sequences of ``seq_len``
  tokens. Consecutive samples do **not** overlap (stride = ``seq_len``); a sample never
  crosses a file boundary and trailing tokens are ignored. For inputs plus shifted targets
  index with ``seq_len + 1`` (as :class:`~tenplex.data.corpus.TokenCorpus` does).
- ``pieces``: a sample is several byte ranges read back to back (a packed sample spanning
  documents, e.g. :func:`~tenplex.data.megatron.megatron_index`): the three columns are then
  pieces and ``sample_start`` (int64, ``num_samples + 1``) says which pieces form sample ``i``
  (``[sample_start[i], sample_start[i + 1])``).

On disk an index is one uncompressed ``.npz``: ``file_id`` (uint32), ``offset`` (int64),
``length`` (uint32) (and ``sample_start`` for ``pieces``) and a JSON ``meta`` string with the source
URLs, their sizes and a checksum of those sizes, so a changed source is detected when the index is
opened.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from ..errors import DataIndexError, IndexNotFoundError, SourceChangedError, SourceReadError
from ..urls import url_fs
from .partition import MAX_SAMPLES

__all__ = [
    "DataIndex", "SourceFile", "SourceReader", "build_index", "load_index",
    "DataIndexError", "IndexNotFoundError", "SourceChangedError", "SourceReadError",
]

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
KINDS = ("records", "jsonl", "tokens", "pieces")
TOKEN_DTYPES = ("uint16", "uint32")
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One source file of an index: its URL and its size when indexed."""

    url: str
    size: int


def sizes_checksum(files: Sequence[SourceFile]) -> str:
    """sha256 of the sources' URLs and sizes (detects a changed source)."""
    text = "".join(f"{f.url}\t{f.size}\n" for f in files)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True, eq=False)
class DataIndex:
    """Samples as byte ranges: ``file_id[i]``, ``offset[i]``, ``length[i]`` of sample ``i`` (of piece ``i`` when
    ``sample_start`` is given: sample ``i`` is pieces ``[sample_start[i], sample_start[i + 1])``)."""

    files: tuple[SourceFile, ...]
    file_id: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    sample_start: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("file_id", "offset", "length"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
                raise DataIndexError(f"index column {name} must be a 1-D integer array, got "
                                     f"{getattr(a, 'dtype', type(a).__name__)} of shape {getattr(a, 'shape', '?')}")
        n = len(self.file_id)
        if len(self.offset) != n or len(self.length) != n:
            raise DataIndexError(f"index arrays differ in length ({n}, {len(self.offset)}, {len(self.length)})")
        if (self.sample_start is None) != (self.kind != "pieces"):
            raise DataIndexError(f"an index of kind {self.kind!r} {'needs' if self.kind == 'pieces' else 'takes no'} "
                                 "sample_start column")
        if self.sample_start is not None:
            st = self.sample_start
            if st.ndim != 1 or st.dtype.kind not in "iu" or len(st) < 1 or st[0] != 0 or st[-1] != n \
                    or (np.diff(st.astype(np.int64)) < 0).any():
                raise DataIndexError(f"sample_start must rise from 0 to the {n} pieces, got {len(st)} entries "
                                     f"from {st[:1].tolist()} to {st[-1:].tolist()}")
        if self.num_samples > MAX_SAMPLES:
            raise DataIndexError(f"an index holds at most {MAX_SAMPLES} samples, this one {self.num_samples}")
        if self.kind not in KINDS:
            raise DataIndexError(f"unknown index kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    def check_ranges(self) -> None:
        """Raise :class:`DataIndexError` unless every sample is a non-empty range inside its recorded source."""
        if not self.num_samples:
            raise DataIndexError("the index has no samples")
        if self.sample_start is not None and (np.diff(self.sample_start) < 1).any():
            raise DataIndexError(f"sample {int(np.flatnonzero(np.diff(self.sample_start) < 1)[0])} has no pieces")
        nf = len(self.files)
        fid = self.file_id.astype(np.int64)
        bad = np.flatnonzero((fid < 0) | (fid >= nf))
        if bad.size:
            raise DataIndexError(f"sample {int(bad[0])} names source file {int(fid[bad[0]])} but the index lists {nf}")
        off, ln = self.offset.astype(np.int64), self.length.astype(np.int64)
        sizes = np.array([f.size for f in self.files], dtype=np.int64)
        bad = np.flatnonzero((off < 0) | (ln < 1) | (off > sizes[fid] - ln))
        if bad.size:
            i = int(bad[0])
            what = "piece" if self.sample_start is not None else "sample"
            raise DataIndexError(f"{what} {i} is bytes [{int(off[i])}, +{int(ln[i])}) of {self.files[fid[i]].url}, "
                                 f"outside its {int(sizes[fid[i]])} bytes")

    @property
    def num_samples(self) -> int:
        return int(len(self.file_id) if self.sample_start is None else len(self.sample_start) - 1)

    @property
    def checksum(self) -> str:
        return sizes_checksum(self.files)

    @property
    def nbytes(self) -> int:
        """Total bytes of all samples."""
        return int(self.length.sum(dtype=np.int64))

    def meta(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "kind": self.kind, "params": self.params,
                "files": [[f.url, f.size] for f in self.files], "checksum": self.checksum,
                "num_samples": self.num_samples}

    def save(self, url: str) -> None:
        """Write the index to ``url`` (write-then-rename for local paths)."""
        buf = io.BytesIO()
        extra = {} if self.sample_start is None else {"sample_start": self.sample_start.astype(np.int64)}
        np.savez(buf, file_id=self.file_id.astype(np.uint32), offset=self.offset.astype(np.int64),
                 length=self.length.astype(np.uint32), meta=np.array(json.dumps(self.meta())), **extra)
        data = buf.getvalue()
        fs, path = url_fs(url, what="index", error=DataIndexError)
        try:
            if _is_local(fs):
                tmp = f"{path}.tmp{os.getpid()}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            else:
                fs.pipe_file(path, data)
        except OSError as e:
            raise DataIndexError(f"cannot write the index {url}: {e.strerror or e}; check that its directory exists "
                                 "and is writable") from None
        log.info("wrote index %s: %d samples in %d files", url, self.num_samples, len(self.files))

    def verify(self) -> None:
        """Raise :class:`SourceChangedError` if any source's size differs from when indexed."""
        problems = []
        for f in self.files:
            fs, path = url_fs(f.url, what="source file", error=DataIndexError)
            try:
                size = int(fs.size(path))
            except (FileNotFoundError, OSError):
                problems.append(f"{f.url} is missing (was {f.size} bytes)")
                continue
            if size != f.size:
                problems.append(f"{f.url} is {size} bytes, was {f.size} when indexed")
        if problems:
            raise SourceChangedError(
                "the dataset's source files changed since the index was built: " + "; ".join(problems)
                + ". Restore them or rebuild the index with `tenplex data index`."
            )

    def sample_ranges(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file_id, offset, length) columns of the given samples' byte ranges, as int64: one per sample, or
        for ``pieces`` each sample's pieces in order (:meth:`piece_counts` says how many)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.sample_start is not None:
            st = self.sample_start.astype(np.int64)
            counts = st[ids + 1] - st[ids]
            first = np.zeros(len(ids) + 1, np.int64)
            np.cumsum(counts, out=first[1:])
            ids = np.repeat(st[ids] - first[:-1], counts) + np.arange(int(first[-1]), dtype=np.int64)
        return (self.file_id[ids].astype(np.int64), self.offset[ids].astype(np.int64),
                self.length[ids].astype(np.int64))

    def piece_counts(self, ids: np.ndarray) -> np.ndarray:
        """Byte ranges per sample of ``ids`` (all ones unless ``pieces``)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.sample_start is None:
            return np.ones(len(ids), np.int64)
        return self.sample_start[ids + 1].astype(np.int64) - self.sample_start[ids]


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def load_index(url: str, *, verify: bool = True) -> DataIndex:
    """Open an index written by :func:`build_index`; with ``verify`` check the sources' sizes."""
    fs, path = url_fs(url, what="index", error=DataIndexError)
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise IndexNotFoundError(
            f"no dataset index at {url}: build one with `tenplex data index {url} FILE... --jsonl` "
            "(or --record-bytes N, or --tokens --seq-len S)"
        ) from None
    except IsADirectoryError:
        raise IndexNotFoundError(f"{url} is a directory, not an index file written by `tenplex data index`") from None
    except OSError as e:
        raise DataIndexError(f"cannot read the index {url}: {e.strerror or e}; check the path") from None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if not isinstance(meta, dict) or not isinstance(meta.get("files"), list):
                raise DataIndexError("its meta is not an object with a list of files")
            files = tuple(SourceFile(str(u), int(s)) for u, s in meta["files"])
            index = DataIndex(files, z["file_id"], z["offset"], z["length"], str(meta["kind"]),
                              dict(meta.get("params") or {}),
                              z["sample_start"] if "sample_start" in z.files else None)
    except DataIndexError as e:
        raise DataIndexError(f"{url} is not a tenplex dataset index ({e}); rebuild it with "
                             "`tenplex data index`") from None
    except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DataIndexError(f"{url} is not a tenplex dataset index or is truncated ({type(e).__name__}: {e}); "
                             "rebuild it with `tenplex data index`") from None
    if meta.get("version") != FORMAT_VERSION:
        raise DataIndexError(f"{url} has index format version {meta.get('version')}, this tenplex reads "
                             f"{FORMAT_VERSION}; rebuild it with `tenplex data index`")
    if meta.get("checksum") != index.checksum:
        raise DataIndexError(f"{url}: the checksum of the recorded source sizes does not match; the index file "
                             "is corrupt, rebuild it with `tenplex data index`")
    try:
        index.check_ranges()
    except DataIndexError as e:
        raise DataIndexError(f"{url} is corrupt: {e}; rebuild it with `tenplex data index`") from None
    if verify:
        index.verify()
    return index


def _sample_size(option: str, value: object, item: int, where: str = "") -> int:
    """A sample-size option (records of bytes, sequences of ``item``-byte tokens) as an int whose samples
    stay under 4 GiB (lengths are stored as uint32)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataIndexError(f"{option} must be >= 1{where}, got {value}")
    if int(value) * item >= 1 << 32:
        raise DataIndexError(f"{option} {value} makes samples of {int(value) * item} bytes; samples must be smaller "
                             f"than 4 GiB ({1 << 32} bytes): use a smaller {option}")
    return int(value)


def _full_url(url: str) -> str:
    fs, path = url_fs(url, what="source file", error=DataIndexError)
    return os.path.abspath(path) if _is_local(fs) else url


def _jsonl_ranges(url: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of the non-empty lines of a file (newline included), streamed in chunks."""
    ends: list[np.ndarray] = []
    pos = 0
    with fsspec.open(url, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            ends.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10).astype(np.int64) + pos + 1)
            pos += len(chunk)
    if pos != size:
        raise DataIndexError(f"{url} changed while being indexed ({size} -> {pos} bytes); index it again")
    line_end = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    tail = bool(size) and (line_end.size == 0 or int(line_end[-1]) != size)
    if tail:  # a last line without a newline is kept as it is
        line_end = np.concatenate([line_end, np.array([size], np.int64)])
    line_start = np.concatenate([np.zeros(1, np.int64), line_end[:-1]])
    length = line_end - line_start
    keep = length > 1  # "\n" alone is an empty line
    if tail:
        keep[-1] = True
    return line_start[keep], length[keep]


def build_index(files: Sequence[str], *, kind: str, record_bytes: int | None = None, seq_len: int | None = None,
                dtype: str = "uint16") -> DataIndex:
    """Index the samples of ``files`` (fsspec URLs), in file order then offset order."""
    if not files:
        raise DataIndexError("no source files given: pass one or more files to index")
    params: dict[str, Any] = {}
    if kind == "records":
        record_bytes = _sample_size("--record-bytes", record_bytes, 1)
        params["record_bytes"] = record_bytes
    elif kind == "tokens":
        if dtype not in TOKEN_DTYPES:
            raise DataIndexError(f"--dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        seq_len = _sample_size("--seq-len", seq_len, np.dtype(dtype).itemsize, " for --tokens")
        params.update(seq_len=seq_len, dtype=dtype)
    elif kind != "jsonl":
        raise DataIndexError(f"unknown index kind {kind!r}: use --record-bytes N, --jsonl or --tokens")
    srcs: list[SourceFile] = []
    fids, offs, lens = [], [], []
    for i, url in enumerate(files):
        full = _full_url(url)
        fs, path = url_fs(full, what="source file", error=DataIndexError)
        try:
            size = int(fs.size(path))
        except FileNotFoundError:
            raise DataIndexError(f"source file {url} does not exist: check the path") from None
        except OSError as e:
            raise DataIndexError(f"cannot read source file {url}: {e}; check the path or URL") from None
        if fs.isdir(path):
            raise DataIndexError(f"source {url} is a directory: pass the files in it (e.g. {url}/*)")
        srcs.append(SourceFile(full, size))
        if kind == "records":
            n, tail = divmod(size, record_bytes)  # type: ignore[operator]
            if tail:
                log.warning("%s: %d trailing bytes do not fill a record of %d and are ignored", url, tail, record_bytes)
            off = np.arange(n, dtype=np.int64) * record_bytes
            ln = np.full(n, record_bytes, dtype=np.int64)
        elif kind == "tokens":
            item = np.dtype(dtype).itemsize
            stride = seq_len * item  # type: ignore[operator]
            n, tail = divmod(size, stride)
            if tail:
                log.warning("%s: %d trailing bytes do not fill a sequence of %d tokens and are ignored",
                            url, tail, seq_len)
            off = np.arange(n, dtype=np.int64) * stride
            ln = np.full(n, stride, dtype=np.int64)
        else:
            off, ln = _jsonl_ranges(full, size)
        if (ln >= 1 << 32).any():
            raise DataIndexError(f"{url}: a sample is 4 GiB or larger; samples must be smaller")
        fids.append(np.full(len(off), i, dtype=np.uint32))
        offs.append(off)
        lens.append(ln)
    index = DataIndex(tuple(srcs), np.concatenate(fids), np.concatenate(offs),
                      np.concatenate(lens).astype(np.uint32), kind, params)
    if index.num_samples == 0:
        raise DataIndexError(f"no samples found in {len(files)} file(s): check the files and the --record-bytes / "
                             "--seq-len options")
    return index


class SourceReader:
    """Reads byte ranges of an index's sources; thread-safe.

    Local files are read with ``os.pread`` on cached descriptors (reopened when the file was
    deleted or replaced); other URLs with ``fs.cat_file``. A missing or short source raises
    :class:`SourceReadError` (errno EIO).
    """

    def __init__(self, files: Sequence[SourceFile]) -> None:
        self.files = tuple(files)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._remote: dict[int, tuple[Any, str]] = {}
        self._local = []
        for f in self.files:
            fs, path = url_fs(f.url, what="source file", error=DataIndexError)
            self._local.append(path if _is_local(fs) else None)
            if not _is_local(fs):
                self._remote[len(self._local) - 1] = (fs, path)

    def _fd(self, fid: int) -> int:
        fd = self._fds.get(fid)
        if fd is not None:
            try:
                if os.fstat(fd).st_nlink > 0:
                    return fd
            except OSError:
                pass
        path = self._local[fid]
        assert path is not None
        with self._lock:
            old = self._fds.get(fid)
            if old is not None and old != fd:
                return old
            try:
                new = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                raise SourceReadError(f"cannot open source {path}: {e.strerror}") from e
            self._fds[fid] = new
            # the old descriptor (deleted file) is left open: another thread may be reading from it
        return new

    def local_fds(self, fids: Sequence[int], need: Sequence[int]) -> list[int] | None:
        """Descriptors of local sources ``fids`` after checking each holds ``need[k]`` bytes; None if one is remote.

        For callers that hand the descriptors to C code (the mount's ``read_buf``), so a
        missing or shrunk source is reported here as :class:`SourceReadError` rather than
        as a short read.
        """
        out = []
        for fid, n in zip(fids, need):
            if fid in self._remote:
                return None
            fd = self._fd(fid)
            size = os.fstat(fd).st_size
            if size < n:
                raise SourceReadError(
                    f"source {self.files[fid].url} is shorter than indexed: {size} bytes, reads need {n} (indexed "
                    f"size {self.files[fid].size}); rebuild the index with `tenplex data index`")
            out.append(fd)
        return out

    def read(self, fid: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of source ``fid``."""
        if fid in self._remote:
            fs, path = self._remote[fid]
            try:
                data = fs.cat_file(path, start=offset, end=offset + length)
            except (FileNotFoundError, OSError) as e:
                raise SourceReadError(f"cannot read {self.files[fid].url} [{offset}, {offset + length}): {e}") from e
        else:
            fd = self._fd(fid)
            try:
                data = os.pread(fd, length, offset)
            except OSError as e:
                raise SourceReadError(f"cannot read {self.files[fid].url}: {e.strerror}") from e
            if len(data) < length and data:
                # pread may return short on some filesystems; finish the range
                more = [data]
                got = len(data)
                while got < length:
                    chunk = os.pread(fd, length - got, offset + got)
                    if not chunk:
                        break
                    more.append(chunk)
                    got += len(chunk)
                data = b"".join(more)
        if len(data) != length:
            raise SourceReadError(
                f"source {self.files[fid].url} is shorter than indexed: wanted [{offset}, {offset + length}), got "
                f"{len(data)} bytes (indexed size {self.files[fid].size}); rebuild the index with `tenplex data index`"
            )
        return data

    def read_into(self, fid: int, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset`` of source ``fid`` (``os.preadv`` for local files)."""
        length = len(buf)
        if fid in self._remote:
            buf[:] = self.read(fid, offset, length)
            return
        fd = self._fd(fid)
        got = 0
        try:
            while got < length:
                n = os.preadv(fd, [buf[got:]], offset + got)
                if not n:
                    break
                got += n
        except OSError as e:
            raise SourceReadError(f"cannot read {self.files[fid].url}: {e.strerror}") from e
        if got != length:
            raise SourceReadError(
                f"source {self.files[fid].url} is shorter than indexed: wanted [{offset}, {offset + length}), got "
                f"{got} bytes (indexed size {self.files[fid].size}); rebuild the index with `tenplex data index`"
            )

    def read_many_into(self, fids: list[int], starts: list[int], stops: list[int], buf: memoryview) -> None:
        """Fill ``buf`` with the ranges ``[starts[k], stops[k])`` of sources ``fids[k]``, back to back."""
        fds: dict[int, int] = {}
        pos = 0
        preadv = os.preadv
        for f, a, b in zip(fids, starts, stops):
            n = b - a
            fd = fds.get(f)
            if fd is None:
                if f in self._remote:
                    self.read_into(f, a, buf[pos : pos + n])
                    pos += n
                    continue
                fd = fds[f] = self._fd(f)
            try:
                got = preadv(fd, [buf[pos : pos + n]], a)
            except OSError as e:
                raise SourceReadError(f"cannot read {self.files[f].url}: {e.strerror}") from e
            if got != n:
                self.read_into(f, a + got, buf[pos + got : pos + n])  # finishes a short read or raises
            pos += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
