"""The mount's file tree, free of FUSE: paths -> nodes, sizes, ``read(offset, size)``.

Layout (see docs/vfs.md)::

    /job.json             -> gen-NNNNNN/job.json   (symlink to the current generation)
    /rank-000             -> gen-NNNNNN/rank-000   (one symlink per DP rank of the current generation)
    /gen-NNNNNN/job.json
    /gen-NNNNNN/rank-iii/samples.bin | ids.txt | offsets.txt

Every generation's files are immutable, so the kernel page cache is always valid for them;
a re-shard creates a new generation and re-points the symlinks. A file handle opened before
a re-shard keeps reading its generation (its generation is pinned while handles are open);
opens after it resolve the symlinks to the new generation.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..data.index import DataIndex, SourceReader
from ..data.partition import DataState, _check_dp, stream_end
from ..data.view import LineFile, RankView, rank_view
from ..errors import TenplexError

__all__ = ["Layout", "Generation", "Node", "DatasetTree", "VfsError", "gen_name", "rank_name"]

log = logging.getLogger(__name__)
RANK_FILES = ("samples.bin", "ids.txt", "offsets.txt")
DIR, FILE, LINK = "dir", "file", "link"
_UID, _GID = os.getuid(), os.getgid()


class VfsError(TenplexError, ValueError):
    """A mount or re-shard request is invalid (bad DP size, progress, mountpoint ...)."""


def gen_name(g: int) -> str:
    return f"gen-{g:06d}"


def rank_name(i: int) -> str:
    return f"rank-{i:03d}"


@dataclass(frozen=True, slots=True)
class Layout:
    """What a generation shows: DP size, progress and the order's parameters."""

    dp: int
    progress: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None

    def state(self, num_samples: int) -> DataState:
        return DataState(num_samples=num_samples, global_batch=self.global_batch, seed=self.seed,
                         shuffle=self.shuffle, consumed=self.progress)

    def check(self, num_samples: int) -> None:
        if self.progress < 0:
            raise VfsError(f"progress must be >= 0 samples, got {self.progress}")
        if self.global_batch < 1:
            raise VfsError(f"global batch must be >= 1, got {self.global_batch}")
        try:
            _check_dp(self.global_batch, self.dp)
        except ValueError as e:
            raise VfsError(str(e)) from None
        if num_samples < 1:
            raise VfsError("the index has no samples")


@dataclass(frozen=True, slots=True)
class Node:
    """A path's node: a directory (``entries``), a file (``size``) or a symlink (``target``)."""

    kind: str
    size: int = 0
    entries: tuple[str, ...] = ()
    target: str = ""
    generation: int = 0
    rank: int = -1
    name: str = ""
    mtime: float = 0.0

    def attrs(self) -> dict[str, Any]:
        """``stat``-like attributes (read-only)."""
        ns = int(self.mtime * 1e9)
        base = {"st_atime": ns, "st_mtime": ns, "st_ctime": ns, "st_uid": _UID, "st_gid": _GID}
        if self.kind == DIR:
            return {**base, "st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_size": 0}
        if self.kind == LINK:
            return {**base, "st_mode": stat.S_IFLNK | 0o777, "st_nlink": 1, "st_size": len(self.target)}
        return {**base, "st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self.size}


class Generation:
    """One immutable view: a layout, its ``job.json`` and the per-rank views (built lazily)."""

    def __init__(self, number: int, layout: Layout, index: DataIndex, reader: SourceReader,
                 extra: dict[str, Any] | None = None) -> None:
        self.number = number
        self.layout = layout
        self.index = index
        self.reader = reader
        self.created = time.time()
        self.end = stream_end(index.num_samples, layout.global_batch, layout.progress, layout.num_epochs)
        self._views: dict[int, RankView] = {}
        self._lock = threading.Lock()
        job = {"generation": number, "dp": layout.dp, "progress": layout.progress,
               "global_batch": layout.global_batch, "seed": layout.seed if layout.shuffle else None,
               "shuffle": layout.shuffle, "num_samples": index.num_samples, "num_epochs": layout.num_epochs,
               "end": self.end, "remaining": self.end - layout.progress,
               "index_checksum": index.checksum, "path": gen_name(number), **(extra or {})}
        self.job_json = (json.dumps(job, indent=1) + "\n").encode()

    def view(self, rank: int) -> RankView:
        v = self._views.get(rank)
        if v is None:
            with self._lock:
                v = self._views.get(rank)
                if v is None:
                    v = rank_view(self.index, self.reader, self.layout.state(self.index.num_samples),
                                  self.layout.dp, rank, end=self.end)
                    self._views[rank] = v
        return v

    def drop_views(self) -> None:
        with self._lock:
            self._views.clear()

    def file(self, rank: int, name: str) -> RankView | LineFile:
        v = self.view(rank)
        if name == "samples.bin":
            return v
        return v.ids_file if name == "ids.txt" else v.offsets_file


class DatasetTree:
    """The whole tree: generations, path lookup, open handles pinned to their generation."""

    def __init__(self, index: DataIndex, layout: Layout, *, reader: SourceReader | None = None, keep: int = 4,
                 extra: dict[str, Any] | None = None) -> None:
        self.index = index
        self.reader = reader or SourceReader(index.files)
        self.keep = keep
        self.extra = dict(extra or {})
        self._lock = threading.RLock()
        self._gens: dict[int, Generation] = {}
        self._pins: dict[int, int] = {}
        self._handles: dict[int, tuple[Generation, Any]] = {}
        self._fh = itertools.count(1)
        self._current: Generation = self._new_generation(1, layout)

    # -- generations ------------------------------------------------------------------------

    @property
    def current(self) -> Generation:
        return self._current

    def _new_generation(self, number: int, layout: Layout) -> Generation:
        layout.check(self.index.num_samples)
        gen = Generation(number, layout, self.index, self.reader, self.extra)
        self._gens[number] = gen
        return gen

    def reshard(self, dp: int | None = None, progress: int | None = None, *, global_batch: int | None = None,
                seed: int | None = None, shuffle: bool | None = None, num_epochs: int | None = -1) -> Generation:
        """Make a new generation (new DP size / progress) current; returns it.

        Unspecified fields keep their current values (``num_epochs=-1`` means unchanged).
        """
        with self._lock:
            cur = self._current.layout
            layout = replace(cur, dp=cur.dp if dp is None else dp,
                             progress=cur.progress if progress is None else progress,
                             global_batch=cur.global_batch if global_batch is None else global_batch,
                             seed=cur.seed if seed is None else seed,
                             shuffle=cur.shuffle if shuffle is None else shuffle,
                             num_epochs=cur.num_epochs if num_epochs == -1 else num_epochs)
            gen = self._new_generation(self._current.number + 1, layout)
            self._current = gen
            self._prune()
        log.info("generation %d: dp=%d progress=%d global_batch=%d", gen.number, layout.dp, layout.progress,
                 layout.global_batch)
        return gen

    def _prune(self) -> None:
        """Forget old unpinned generations; free the per-rank arrays of the others (rebuilt on demand)."""
        cur = self._current.number
        for g in list(self._gens):
            if g == cur or self._pins.get(g):
                continue
            if g <= cur - self.keep:
                del self._gens[g]
            else:
                self._gens[g].drop_views()

    def generations(self) -> list[int]:
        with self._lock:
            return sorted(self._gens)

    # -- paths ------------------------------------------------------------------------------

    def lookup(self, path: str) -> Node | None:
        """The node at ``path`` (absolute, ``/``-separated), or None when it does not exist."""
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            return None  # the kernel resolves these; never let them escape the tree
        cur = self._current
        mtime = cur.created
        if not parts:
            names = ("job.json", *(rank_name(i) for i in range(cur.layout.dp)),
                     *(gen_name(g) for g in self.generations()))
            return Node(DIR, entries=names, mtime=mtime)
        head = parts[0]
        if len(parts) == 1 and head == "job.json":
            return Node(LINK, target=f"{gen_name(cur.number)}/job.json", mtime=mtime)
        rank = _parse_rank(head)
        if rank is not None:
            if len(parts) != 1 or rank >= cur.layout.dp:
                return None
            return Node(LINK, target=f"{gen_name(cur.number)}/{head}", mtime=mtime)
        g = _parse_gen(head)
        gen = self._gens.get(g) if g is not None else None
        if gen is None:
            return None
        mtime = gen.created
        if len(parts) == 1:
            names = ("job.json", *(rank_name(i) for i in range(gen.layout.dp)))
            return Node(DIR, entries=names, generation=gen.number, mtime=mtime)
        if len(parts) == 2 and parts[1] == "job.json":
            return Node(FILE, size=len(gen.job_json), generation=gen.number, name="job.json", mtime=mtime)
        rank = _parse_rank(parts[1])
        if rank is None or rank >= gen.layout.dp:
            return None
        if len(parts) == 2:
            return Node(DIR, entries=RANK_FILES, generation=gen.number, rank=rank, mtime=mtime)
        if len(parts) == 3 and parts[2] in RANK_FILES:
            size = gen.file(rank, parts[2]).size
            return Node(FILE, size=size, generation=gen.number, rank=rank, name=parts[2], mtime=mtime)
        return None

    def _content(self, node: Node) -> Any:
        gen = self._gens.get(node.generation)
        if gen is None:
            raise FileNotFoundError(f"generation {node.generation} is gone")
        if node.name == "job.json":
            return _Bytes(gen.job_json)
        return gen.file(node.rank, node.name)

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Read a file by path (no handle; used by tests and tools)."""
        node = self.lookup(path)
        if node is None or node.kind != FILE:
            raise FileNotFoundError(path)
        return self._content(node).read(offset, size)

    # -- handles ----------------------------------------------------------------------------

    def open(self, path: str) -> int:
        """Open a file; the handle keeps its generation alive and readable until :meth:`release`."""
        with self._lock:
            node = self.lookup(path)
            if node is None or node.kind != FILE:
                raise FileNotFoundError(path)
            gen = self._gens[node.generation]
            fh = next(self._fh)
            self._handles[fh] = (gen, self._content(node))
            self._pins[gen.number] = self._pins.get(gen.number, 0) + 1
            return fh

    def read_handle(self, fh: int, offset: int, size: int) -> bytes:
        content = self._handle_content(fh)
        return content.read(offset, size)

    def _handle_content(self, fh: int) -> Any:
        try:
            return self._handles[fh][1]
        except KeyError:
            raise FileNotFoundError(f"no open file handle {fh}") from None

    def read_handle_into(self, fh: int, offset: int, buf: memoryview) -> int:
        """Read into ``buf`` (a FUSE reply buffer) from an open handle; returns the byte count."""
        content = self._handle_content(fh)
        if isinstance(content, RankView):
            return content.read_into(offset, buf)
        data = content.read(offset, len(buf))
        buf[: len(data)] = data
        return len(data)

    def source_pieces(self, fh: int, offset: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """An open ``samples.bin``'s bytes ``[offset, offset + size)`` as local source reads (see
        :meth:`RankView.source_pieces`); None for other files or remote sources (use :meth:`read_handle_into`)."""
        content = self._handle_content(fh)
        if isinstance(content, RankView):
            return content.source_pieces(offset, size)
        return None

    def release(self, fh: int) -> None:
        with self._lock:
            entry = self._handles.pop(fh, None)
            if entry is not None:
                g = entry[0].number
                self._pins[g] -= 1
                if not self._pins[g]:
                    del self._pins[g]
                self._prune()

    def open_handles(self) -> int:
        return len(self._handles)

    def status(self) -> dict[str, Any]:
        cur = self._current
        return {"generation": cur.number, **asdict(cur.layout), "num_samples": self.index.num_samples,
                "generations": self.generations(), "open_handles": self.open_handles()}


class _Bytes:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def size(self) -> int:
        return len(self.data)

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset : offset + size]


def _parse_rank(name: str) -> int | None:
    if name.startswith("rank-") and len(name) >= 8 and name[5:].isdigit():
        i = int(name[5:])
        return i if name == rank_name(i) else None
    return None


def _parse_gen(name: str) -> int | None:
    if name.startswith("gen-") and name[4:].isdigit():
        g = int(name[4:])
        return g if name == gen_name(g) else None
    return None
