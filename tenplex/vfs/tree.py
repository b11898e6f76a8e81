"""The mount's file tree, free of FUSE: paths -> nodes, sizes, ``read(offset, size)``.

Directory tree (see docs/vfs.md)::

    /job.json             -> gen-NNNNNN/job.json   (symlink to the current generation)
    /rank-000             -> gen-NNNNNN/rank-000   (one symlink per DP rank of the current generation)
    /gen-NNNNNN/job.json
    /gen-NNNNNN/rank-iii/samples.bin | ids.txt | offsets.txt

With ``micro_batch`` a layout splits every global batch into whole micro-batches as evenly as
they go (``replica_samples``): a DP size that does not divide the batch still shows every
sample of a step exactly once, ranks differing by at most one micro-batch.

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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, overload

import numpy as np

from ..data.index import DataIndex, SourceReader
from ..data.partition import MAX_POSITION, MAX_SEED, DataState, checked_int, rank_positions, stream_end
from ..data.view import LineFile, RankView, rank_view
from ..errors import VfsError

__all__ = ["DataView", "Generation", "Node", "Names", "DatasetTree", "VfsError", "gen_name", "rank_name",
           "MAX_EPOCHS_AHEAD", "UNCHANGED"]

log = logging.getLogger(__name__)
RANK_FILES = ("samples.bin", "ids.txt", "offsets.txt")
DIR, FILE, LINK = "dir", "file", "link"
_UID, _GID = os.getuid(), os.getgid()
#: A view with ``num_epochs`` shows at most this many epochs beyond its progress: a view's
#: per-rank arrays cost about 40 bytes a sample, so its length must stay proportional to the index.
MAX_EPOCHS_AHEAD = 64
#: ``DatasetTree.reshard(num_epochs=UNCHANGED)`` keeps the current value (None is a value: through the epoch).
UNCHANGED: Any = type("Unchanged", (), {"__repr__": lambda self: "UNCHANGED"})()


def gen_name(g: int) -> str:
    return f"gen-{g:06d}"


def rank_name(i: int) -> str:
    return f"rank-{i:03d}"


@dataclass(frozen=True, slots=True)
class DataView:
    """What a generation shows: DP size, progress and the order's parameters; ``micro_batch``
    (None: equal slices) splits each global batch by whole micro-batches (``replica_samples``)."""

    dp: int
    progress: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        """Types and ranges that do not depend on the index (see :meth:`check` for the rest)."""
        fields = (("dp", 1, MAX_POSITION, "the data-parallel size, e.g. --dp 4"),
                  ("progress", 0, MAX_POSITION, "samples consumed globally (step x global batch)"),
                  ("global_batch", 1, MAX_POSITION, "samples per step, a multiple of dp"),
                  ("seed", 0, MAX_SEED, "the shuffle seed, a non-negative integer"))
        try:
            for name, lo, hi, what in fields:
                object.__setattr__(self, name, checked_int(name, getattr(self, name), lo, hi, what))
            if self.num_epochs is not None:
                object.__setattr__(self, "num_epochs", checked_int("num_epochs", self.num_epochs, 0, MAX_POSITION,
                                                                   "epochs to show, or null for the current one"))
            if self.micro_batch is not None:
                object.__setattr__(self, "micro_batch", checked_int(
                    "micro_batch", self.micro_batch, 1, MAX_POSITION,
                    "samples per micro-batch (uneven DP splits), or null for equal slices"))
        except ValueError as e:
            raise VfsError(str(e)) from None
        if not isinstance(self.shuffle, bool):
            raise VfsError(f"shuffle must be true or false, got {self.shuffle!r} ({type(self.shuffle).__name__})")

    def state(self, num_samples: int) -> DataState:
        return DataState(num_samples=num_samples, global_batch=self.global_batch, seed=self.seed,
                         shuffle=self.shuffle, consumed=self.progress)

    def check(self, num_samples: int) -> None:
        """Raise :class:`VfsError` unless this view can show an index of ``num_samples`` samples.

        Bounds keep a generation's memory proportional to the index whatever the request: dp and
        the global batch at most the samples, and a view at most :data:`MAX_EPOCHS_AHEAD` epochs long.
        """
        n = num_samples
        if n < 1:
            raise VfsError("the index has no samples")
        if self.dp > n:
            raise VfsError(f"dp={self.dp} is larger than the index's {n} samples: every rank needs samples, "
                           f"use dp <= {n}")
        if self.global_batch > n:
            raise VfsError(f"global batch {self.global_batch} is larger than the index's {n} samples (one step would "
                           f"repeat samples): use --global-batch <= {n}")
        if self.micro_batch is not None:
            try:  # the split's checks in O(1) (an empty range of rank 0's positions)
                rank_positions(self.progress, self.progress, self.global_batch, self.dp, 0, self.micro_batch)
            except ValueError as e:
                raise VfsError(str(e)) from None
        elif self.global_batch % self.dp:
            raise VfsError(
                f"global batch {self.global_batch} is not divisible by dp={self.dp} ({self.global_batch} % {self.dp} "
                f"= {self.global_batch % self.dp}): choose a dp that divides it or change --global-batch")
        if self.num_epochs is not None and self.num_epochs * n - self.progress > MAX_EPOCHS_AHEAD * n:
            raise VfsError(
                f"--epochs {self.num_epochs} shows {self.num_epochs * n - self.progress} samples after progress "
                f"{self.progress} (num_epochs * {n} - progress), more than {MAX_EPOCHS_AHEAD} epochs: use "
                f"--epochs <= {(self.progress + MAX_EPOCHS_AHEAD * n) // n} and remount later")


class Names(Sequence[str]):
    """A directory's entry names, never materialised: ``head``, ``rank-000`` .. ``rank-<ranks-1>``, ``tail``.

    A mount may have as many ranks as samples; listing them costs O(1) memory and a name by
    position O(1), so ``readdir`` can page through them (see ``FuseOps.readdir_with_offset``).
    """

    __slots__ = ("head", "ranks", "tail")

    def __init__(self, head: tuple[str, ...], ranks: int, tail: tuple[str, ...] = ()) -> None:
        self.head, self.ranks, self.tail = head, ranks, tail

    def __len__(self) -> int:
        return len(self.head) + self.ranks + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        n = len(self)
        k = i + n if i < 0 else i
        if not 0 <= k < n:
            raise IndexError(i)
        if k < len(self.head):
            return self.head[k]
        k -= len(self.head)
        return rank_name(k) if k < self.ranks else self.tail[k - self.ranks]

    def __iter__(self) -> Iterator[str]:
        yield from self.head
        for r in range(self.ranks):
            yield rank_name(r)
        yield from self.tail

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Names):
            return (self.head, self.ranks, self.tail) == (other.head, other.ranks, other.tail)
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.head, self.ranks, self.tail))

    def __repr__(self) -> str:
        return f"Names({self.head!r}, ranks={self.ranks}, tail={self.tail!r})"


@dataclass(frozen=True, slots=True)
class Node:
    """A path's node: a directory (``entries``), a file (``size``) or a symlink (``target``)."""

    kind: str
    size: int = 0
    entries: Sequence[str] = ()
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

    def __init__(self, number: int, layout: DataView, index: DataIndex, reader: SourceReader,
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
               **({"micro_batch": layout.micro_batch} if layout.micro_batch is not None else {}),
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
                                  self.layout.dp, rank, end=self.end, micro_batch=self.layout.micro_batch)
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

    def __init__(self, index: DataIndex, layout: DataView, *, reader: SourceReader | None = None, keep: int = 4,
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

    def _new_generation(self, number: int, layout: DataView) -> Generation:
        layout.check(self.index.num_samples)
        gen = Generation(number, layout, self.index, self.reader, self.extra)
        self._gens[number] = gen
        return gen

    def reshard(self, dp: int | None = None, progress: int | None = None, *, global_batch: int | None = None,
                seed: int | None = None, shuffle: bool | None = None, num_epochs: int | None = UNCHANGED,
                micro_batch: int | None = UNCHANGED) -> Generation:
        """Make a new generation (new DP size / progress) current; returns it.

        Unspecified fields keep their current values (``num_epochs=UNCHANGED`` keeps it; None
        shows through the current epoch; ``micro_batch=None``: equal slices again). The whole new layout is validated first: a bad
        request raises :class:`VfsError` and leaves the current generation as it was.
        """
        with self._lock:
            cur = self._current.layout
            layout = replace(cur, dp=cur.dp if dp is None else dp,
                             progress=cur.progress if progress is None else progress,
                             global_batch=cur.global_batch if global_batch is None else global_batch,
                             seed=cur.seed if seed is None else seed,
                             shuffle=cur.shuffle if shuffle is None else shuffle,
                             num_epochs=cur.num_epochs if num_epochs is UNCHANGED else num_epochs,
                             micro_batch=cur.micro_batch if micro_batch is UNCHANGED else micro_batch)
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
            names = Names(("job.json",), cur.layout.dp, tuple(gen_name(g) for g in self.generations()))
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
            return Node(DIR, entries=Names(("job.json",), gen.layout.dp), generation=gen.number, mtime=mtime)
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
