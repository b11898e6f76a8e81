"""Reading checkpoints: listing save attempts, planning a shard's reads as data, executing the plan.

A load first computes its read plan, ``plan_reads``: a tuple of frozen ``ReadItem`` s (which
elements of which writer rank's chunk go where in the new rank's flat buffers), pure and
without I/O. A ``ShardReader`` then executes it: ``PartReader`` reads local files with
``preadv`` through a small reused staging window (verified while it is in the CPU cache, then
copied into the destination) and any fsspec filesystem with ranged reads (remote,
async ones with nearby pieces coalesced into GETs, many in flight), and verifies every
checksum block it reads; the tiered readers of ``tenplex.store.recovery``
execute the same plans across host stores and persistent storage. Every attempt is checked
(manifest, indexes, objects) before a byte of it is used, and ``load`` falls back to the
newest older step that verifies when a step is damaged.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import io
import logging
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from ..config import ParallelConfig
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from ..models import model_differences
from ..planner import intersect
from ..ptc import PAD, PTC, Layout
from .format import (
    MANIFEST_NAME,
    OBJECTS_NAME,
    RANK_INDEX_RE,
    REUSED_PREFIX,
    CRC_GROUP,
    MAX_BLOCK,
    Binding,
    Chunk,
    VERSION,
    Manifest,
    chunk_block,
    crc32,
    crc_spans,
    prefix_words,
    index_name,
    open_sealed_json,
    parse_step_dir,
    verify_index,
    verify_manifest,
    writer_assignment,
)

__all__ = ["LoadStats", "LoadResult", "StepInfo", "ScannedAttempt", "url_fs", "local_path", "read_sealed",
           "read_manifest_at", "read_part_chunks", "scan_attempts", "iter_candidates", "list_steps", "read_manifest",
           "ReadItem", "plan_reads",
           "shard_buffers", "ShardReader", "ShardSink", "Scatter", "PartReader", "CONCURRENT_ENV", "coalesce", "read_shard", "read_objects", "check_model",
           "load_with_reader", "load"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a load read: ``bytes_read`` counts data bytes fetched (checksum blocks and, on
    remote filesystems, bridged gaps included), ``ranges`` the data reads issued,
    ``metadata_bytes`` the JSON indexes, manifest and objects; ``bytes_needed`` is the real
    (non-padding) size of the loaded shard. Counts are of the attempt that was loaded."""

    bytes_needed: int
    bytes_read: int
    metadata_bytes: int
    ranges: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A loaded shard. ``skipped``: ``(step, save_id, reason)`` of every newer attempt passed
    over because it did not verify (damaged, or its save id was reused), newest first."""

    shard: dict[str, Any]
    step: int
    extra: Any
    ptc: PTC
    saved_layout: Layout
    stats: LoadStats
    skipped: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One save attempt of a step: ``path`` is its directory, ``save_id`` tells attempts apart.

    ``problem``: why an attempt whose manifest exists cannot be used (a manifest that fails
    verification, a reused save id); empty otherwise. Such an attempt is never ``complete``.
    """

    step: int
    complete: bool
    layout: Layout | None
    world_size: int | None
    ranks_done: int
    nbytes: int
    save_id: str = ""
    path: str = ""
    created: float = 0.0
    problem: str = ""


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def url_fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``url`` and its root path (no trailing slash)."""
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, root.rstrip("/")


def local_path(path: str) -> str:
    """A local filesystem's path without its ``file://`` protocol, for ``os`` calls."""
    return LocalFileSystem._strip_protocol(path)


def read_sealed(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int]:
    """A sealed JSON file, verified, and its size. A missing file is CheckpointCorruptError
    (callers read only files a listing showed)."""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing although its save attempt lists it") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{path} cannot be read ({e})") from None
    return open_sealed_json(raw, path), len(raw)


def read_manifest_at(fs: fsspec.AbstractFileSystem, sdir: str, *, step: int | None = None,
                     save_id: str | None = None, with_ptc: bool = True) -> Manifest:
    """The manifest of save attempt ``sdir``, verified (digest, schema, directory; see ``verify_manifest``)."""
    if step is None or save_id is None:
        parsed = parse_step_dir(sdir)
        if parsed:
            step, save_id = parsed
    path = f"{sdir}/{MANIFEST_NAME}"
    obj, nbytes = read_sealed(fs, path)
    return verify_manifest(obj, path, nbytes, step=step, save_id=save_id, with_ptc=with_ptc)


def read_part_chunks(sdir: str, rank: int, *, storage_options: Mapping[str, Any] | None = None,
                     manifest: Manifest | None = None) -> list[dict[str, Any]]:
    """The chunks of rank ``rank``'s part of save attempt ``sdir`` (a URL or path), verified, in file
    order: ``tensor, start, length, offset, block`` (bytes ``[offset, offset + length * itemsize)`` of
    the data file); version 4 derives them from the manifest (``part_chunks``), older versions list
    them (with ``crc32``) in the index. For tools and tests; loads use ``PartReader``."""
    fs, path = url_fs(sdir, storage_options)
    path = path.rstrip("/")
    full = (manifest or read_manifest_at(fs, path)).full()
    ipath = f"{path}/{index_name(rank)}"
    idx, _ = read_sealed(fs, ipath)
    return list(verify_index(idx, ipath, rank, Binding.of(full)).values())


# ---------------------------------------------------------------------------------------------
# listing
# ---------------------------------------------------------------------------------------------
ScannedAttempt = tuple[StepInfo, "Manifest | CheckpointError | None"]
"""A save attempt with its verified manifest, the error verifying it raised, or None (no manifest)."""


def _attempt_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[int, str, str]]:
    """``(step, save id, path)`` of every save attempt directory under ``root`` (one listing, nothing read)."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        path = entry.rstrip("/")
        parsed = parse_step_dir(path)
        if parsed:
            out.append((parsed[0], parsed[1], path))
    return out


def _scan_attempt(fs: fsspec.AbstractFileSystem, step: int, sid: str, path: str) -> ScannedAttempt | None:
    """One save attempt with its verified manifest, the error verifying it raised, or None (no
    manifest); None for a directory removed while listing."""
    try:
        files = fs.ls(path, detail=True)
    except FileNotFoundError:  # removed while listing
        return None
    names = {f["name"].rstrip("/").rsplit("/", 1)[-1]: f for f in files}
    names = {n: f for n, f in names.items() if ".tmp-" not in n}
    done = sum(1 for n in names if RANK_INDEX_RE.fullmatch(n))
    nbytes = sum(int(f.get("size") or 0) for n, f in names.items() if n.endswith(".safetensors"))
    layout = world = None
    complete = False
    created = 0.0
    problem = ""
    manifest: Manifest | CheckpointError | None = None
    if any(n.startswith(REUSED_PREFIX) for n in names):
        problem = (f"save id {sid} was used by two saves ({REUSED_PREFIX}* marker): its parts may mix them; "
                   "this attempt is never loaded")
    if MANIFEST_NAME in names:
        try:
            manifest = read_manifest_at(fs, path, step=step, save_id=sid, with_ptc=False)
            layout, world, created = manifest.layout, manifest.world_size, manifest.created
            complete = (not problem and OBJECTS_NAME in names
                        and all(index_name(r) in names for r in range(world)))
        except CheckpointError as e:
            problem = problem or str(e)
            manifest = e
    return StepInfo(step, complete, layout, world, done, nbytes, sid, path, created, problem), manifest


def _attempt_order(x: ScannedAttempt) -> tuple[int, bool, float]:
    return x[0].step, x[0].complete, x[0].created


def scan_attempts(fs: fsspec.AbstractFileSystem, root: str) -> list[ScannedAttempt]:
    """Every save attempt under ``root`` with its verified manifest, or the error verifying it
    raised, or None (no manifest); the newest complete attempt of a step sorts last."""
    scanned = (_scan_attempt(fs, *d) for d in _attempt_dirs(fs, root))
    return sorted((x for x in scanned if x is not None), key=_attempt_order)


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[StepInfo]:
    """Every save attempt under ``url``, oldest first, with its layout, whether it is complete
    and, where its manifest exists but it cannot be used, the problem."""
    fs, root = url_fs(url, storage_options)
    return [info for info, _ in scan_attempts(fs, root)]


def _usable(scan: Sequence[ScannedAttempt]) -> list[ScannedAttempt]:
    """The attempts of ``scan`` a load considers, newest first: complete ones (with their manifest)
    and, to be reported as skipped, unusable ones whose manifest exists (with the error verifying it
    raised, or None for a reused save id)."""
    pool = [(i, m if i.complete or isinstance(m, CheckpointError) else None) for i, m in scan
            if i.complete or i.problem]
    return sorted(pool, key=_attempt_order, reverse=True)


def _candidates(scan: list[ScannedAttempt], url: str, step: int | None) -> list[ScannedAttempt]:
    """``_usable`` attempts of ``scan`` (of ``step`` when given), newest first. Raises
    CheckpointNotFoundError when there is nothing to try or report."""
    infos = [i for i, _ in scan]
    pool = _usable([x for x in scan if step is None or x[0].step == step])
    if not pool:
        complete = sorted({i.step for i in infos if i.complete})
        if step is None:
            extra = f" ({len(infos)} incomplete steps found)" if infos else ""
            raise CheckpointNotFoundError(f"no complete checkpoint under {url}{extra}")
        state = "is incomplete" if any(i.step == step for i in infos) else "does not exist"
        raise CheckpointNotFoundError(
            f"checkpoint step {step} under {url} {state}; complete steps: {complete or 'none'}"
        )
    return pool


def iter_candidates(fs: fsspec.AbstractFileSystem, root: str, url: str, step: int | None) -> Iterator[ScannedAttempt]:
    """``_candidates`` of the attempts under ``root``, newest first, scanned one step at a time as the
    caller asks for more: a load that uses the newest step reads that step's manifests only, not
    every kept step's (25-100 ms each: 1.3 s of a load with 50 steps kept; #29 item 3). Raises
    CheckpointNotFoundError (after a full scan, for its message) when there is nothing to try."""
    dirs = [d for d in _attempt_dirs(fs, root) if step is None or d[0] == step]
    found = False
    for s in sorted({d[0] for d in dirs}, reverse=True):
        group = [_scan_attempt(fs, *d) for d in dirs if d[0] == s]
        for x in _usable([a for a in group if a is not None]):
            found = True
            yield x
    if not found:  # nothing usable: the full scan's error names what is there (or, after a race, the attempts)
        yield from _candidates(scan_attempts(fs, root), url, step)


def read_manifest(url: str, step: int | None = None, *,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verified manifest of ``step`` (default: the latest complete step), with ``ptc`` as a PTC.

    Only the manifest is checked here; ``load`` also verifies the data and falls back to an
    older step when it must.
    """
    fs, root = url_fs(url, storage_options)
    problems = []
    for info, manifest in iter_candidates(fs, root, url, step):
        if isinstance(manifest, Manifest):
            try:
                full = manifest.full()
            except CheckpointCorruptError as e:
                problems.append(f"step {info.step} ({info.save_id}): {e}")
                continue
            return {**full.raw, "ptc": full.ptc}
        if manifest is not None and not isinstance(manifest, CheckpointCorruptError):
            raise manifest  # a format version this tenplex does not read
        problems.append(f"step {info.step} ({info.save_id}): {info.problem}")
    raise CheckpointCorruptError(f"no complete checkpoint{'' if step is None else f' of step {step}'} under {url} "
                                 f"has a valid manifest: {'; '.join(problems)}")


# ---------------------------------------------------------------------------------------------
# read plans
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReadItem:
    """One read of a plan: elements [a, b) of writer rank ``writer``'s chunk of ``tensor`` that
    starts at global element ``chunk_start`` (``chunk_length`` elements; its key in the
    writer's index, in file ``rank-NNNNN.safetensors``), into elements [dst, dst + b - a) of
    the loading rank's flat buffer of ``tensor``. ``block``: the chunk's checksum block size by
    the format's rule; a reader verifies blocks ``blocks`` and reads ``span`` (bytes of the
    chunk, rounded out to whole blocks)."""

    tensor: str
    dst: int
    writer: int
    chunk_start: int
    chunk_length: int
    a: int
    b: int
    itemsize: int
    block: int

    @property
    def length(self) -> int:
        """Elements read."""
        return self.b - self.a

    @property
    def span(self) -> tuple[int, int]:
        """Bytes [lo, hi) of the chunk this read fetches: the elements' bytes rounded out to blocks."""
        return span_of(self.a, self.b, self.itemsize, self.block, self.chunk_length * self.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes this read fetches (checksum blocks included)."""
        lo, hi = self.span
        return hi - lo

    def into(self, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The elements of ``buffers[tensor]`` (a flat buffer, ``shard_buffers``) this read fills: a view."""
        return buffers[self.tensor][self.dst : self.dst + self.length]

    @property
    def blocks(self) -> range:
        """The checksum blocks of the chunk this read verifies."""
        lo, hi = self.span
        return range(lo // self.block, -(-hi // self.block))


def span_of(a: int, b: int, itemsize: int, block: int, nbytes: int) -> tuple[int, int]:
    """Bytes [lo, hi) of a chunk of ``nbytes`` to read for elements [a, b): rounded out to ``block``."""
    return (a * itemsize) // block * block, min(-(-(b * itemsize) // block) * block, nbytes)


def plan_reads(saved: PTC, old: Layout, new: Layout, rank: int, *,
               writers: Mapping[int, list[Chunk]] | None = None, version: int = VERSION) -> tuple[ReadItem, ...]:
    """The reads that give rank ``rank`` under ``new`` its tensors from chunks written under ``old``.

    Pure (no I/O): items in the order of the rank's tensors (``saved.rank_tensors``), each
    tensor's in the order of its flat buffer. Raises CheckpointCorruptError when the old
    layout's chunks do not cover an element the rank needs. ``writers``:
    ``writer_assignment(saved, old)`` when the caller has it; ``version``: the checkpoint's format
    version, whose block rule (``chunk_block``) gives each item's ``block``.
    """
    if writers is None:
        writers = writer_assignment(saved, old)
    rows: dict[str, list[tuple[int, int, int]]] = {}
    for w, chunks in writers.items():
        for name, _, start, ln in chunks:
            rows.setdefault(name, []).append((start, start + ln, w))
    # Tensors of one geometry (the layers' weights and their optimizer states: the same segments
    # and chunk bounds) cut into the same pieces: intersected once per geometry, 8-20 of 444 here.
    cuts: dict[tuple[Any, ...], list[tuple[int, int, int, int]]] = {}
    blocks: dict[tuple[Any, ...], int] = {}  # chunk_block by (geometry, chunk length)
    items: list[ReadItem] = []
    for name in saved.rank_tensors(new, rank):
        spec = saved.tensors[name]
        real = tuple((lo, g, ln) for lo, g, ln in saved.segments(name, new, rank) if g != PAD)
        if not real:
            continue
        chunks = sorted(rows.get(name, ()))
        key = (real, tuple((a, b) for a, b, _ in chunks))
        pieces = cuts.get(key)
        if pieces is None:
            pieces = cuts[key] = _cut(real, chunks, name, rank)
        itemsize = spec.itemsize
        for dst, c, s, e in pieces:
            cs, ce, w = chunks[c]
            bkey = (spec.shape, spec.panels, spec.split_dim, itemsize, ce - cs)
            block = blocks.get(bkey)
            if block is None:
                block = blocks[bkey] = chunk_block(spec, (ce - cs) * itemsize, version)
            items.append(ReadItem(name, dst, w, cs, ce - cs, s - cs, e - cs, itemsize, block))
    return tuple(items)


def _cut(real: Sequence[tuple[int, int, int]], chunks: Sequence[tuple[int, int, int]], name: str,
         rank: int) -> list[tuple[int, int, int, int]]:
    """The pieces of segments ``real`` (local offset, global start, length) in sorted disjoint
    ``chunks`` (start, end, writer): ``(dst, chunk index, start, end)``, global element ranges."""
    c_start = np.array([c[0] for c in chunks], dtype=np.int64)
    c_end = np.array([c[1] for c in chunks], dtype=np.int64)
    q_lo, q_start, q_len = (np.array(col, dtype=np.int64) for col in zip(*real))
    qi, ci, ps, pe = intersect(q_start, q_len, c_start, c_end)
    if int((pe - ps).sum()) != int(q_len.sum()):
        raise CheckpointCorruptError(f"{name}: the checkpoint does not cover every element rank {rank} needs")
    dst = q_lo[qi] + (ps - q_start[qi])
    return list(zip(dst.tolist(), ci.tolist(), ps.tolist(), pe.tolist()))


def shard_buffers(saved: PTC, cfg: ParallelConfig, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s flat buffers under ``cfg``, one per tensor, uninitialised except for the
    padding (zeros): a plan's reads fill the rest."""
    out = {}
    for name in saved.rank_tensors(cfg, rank):
        segs = saved.segments(name, cfg, rank)
        local = torch.empty(sum(ln for _, _, ln in segs), dtype=saved.tensors[name].dtype)
        for lo, g, ln in segs:
            if g == PAD:
                local[lo : lo + ln] = 0
        out[name] = local
    return out


class ShardReader(Protocol):
    """What executes a read plan: every reader of checkpoint data has these.

    ``bind`` is called before the first read; ``read_items`` reads every item of a plan into
    ``buffers`` (the flat buffers by tensor), verified, calling ``on_read(i)`` once item i's
    bytes are in place (checksums may still be running; a mismatch raises before it returns)
    so the caller may lay out a tensor whose reads are all in; after the last ``on_read`` of a
    tensor the reader no longer touches its buffer, which the caller may drop. ``rank``: the
    loading rank (readers may order reads by it). The counters cover what was read so far.
    A reader whose ``scatters`` attribute is true also takes ``Scatter`` buffers (``read_shard``
    gives other readers a temporary instead)."""

    @property
    def bytes_read(self) -> int: ...

    @property
    def metadata_bytes(self) -> int: ...

    @property
    def ranges(self) -> int: ...

    def bind(self, binding: Binding) -> None: ...

    def read_items(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor], *, rank: int,
                   on_read: Callable[[int], None]) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# the reader of one directory
# ---------------------------------------------------------------------------------------------
_PREFETCH = 64 << 20  # bytes a local load asks the kernel to fetch ahead of the reads
_WHOLE_FILE = 0.99  # the share of a file's data a load must need for sequential read-ahead
_CHECK_AHEAD = 64 << 20
"""Bytes read but not yet verified that a local load lets run ahead of its checksum thread: the
reads wait for older checks beyond it, so the buffers the checks still hold (temporaries of relaid
tensors, which are freed only once verified and finished) stay bounded when checksums are slower
than the reads."""
_SHARED_BLOCKS_MAX = 4 << 20  # bytes one group of pieces sharing checksum blocks may span (read in staging windows)
_STAGE = 192 << 10
"""Local pieces are read into one reused staging buffer of ``_STAGE`` bytes (a large piece in
windows of whole checksum blocks, small pieces that follow each other in a file together),
verified and copied into their destination (a flat buffer or a ``Scatter``), all in the reading
thread. The window is small enough to stay in a core's L2 cache (512 KiB here): the kernel's copy
out of the page cache then runs at about 10 GB/s, the checksums read it from the cache and numpy's
copy out streams to memory, where a ``preadv`` straight into a large destination ran at 2.5 GB/s
and the checksums then read it back from memory (measured on this 2-CPU EPYC: read, verify and
place 3.4-3.6 GB/s through a 64-192 KiB window, 1.7 GB/s through 256 KiB or more or straight into
the destination). A second thread for the checksums would only trade the GIL back and forth
(measured earlier: 25 % more CPU time)."""
# Remote (async fsspec) filesystems: pieces of one file closer than _MAX_GAP are fetched as one
# ranged GET, the gap bytes read and thrown away. A GET costs a round trip (about a millisecond
# on a LAN, tens to an object store) and a gap of 64 KiB costs less than that at 1 GB/s. Gaps
# are spent only while all of them stay under _GAP_SHARE of the planned bytes (smallest first),
# so a load reads at most 0.5 % more than without coalescing; a merged GET stops growing at
# _MAX_REQUEST, so one slow request never holds most of a shard; _IN_FLIGHT GETs run at once
# (S3 serves thousands a second per prefix; 16 fill a 10 Gb/s link with 32 MiB requests), so at
# most _IN_FLIGHT * _MAX_REQUEST bytes (512 MiB) are held besides the destination buffers.
_MAX_GAP = 64 << 10
_GAP_SHARE = 0.005
_MAX_REQUEST = 32 << 20
_IN_FLIGHT = 16
_CRC_GAP_WORDS = 2
"""Versions 4 and 5, local files: CRC words of two pieces at most this many words apart are read as one range."""
_CRC_GAP_SHARE = 0.001
"""Versions 4 and 5, remote files: the words bridged between the CRC words a plan needs total at most this
share of its data bytes (version 5 needs two words per piece, often far apart: with the data's 0.5 % the
bridged words cost more than the words themselves, 1.1 % of an FSDP2 4 -> 3 load)."""
CONCURRENT_ENV = "TENPLEX_CONCURRENT_READS"
"""Set to ``0`` to read remote pieces one by one, one GET each (the old path; for benchmarks)."""


def _nothing() -> None:
    return None


class PartReader:
    """Reads verified byte ranges of one save attempt's chunks (a ``ShardReader``): ``preadv``
    through a staging window for local files, ranged reads otherwise. ``concurrent``:
    coalesce a plan's pieces into fewer ranged reads and issue ``_IN_FLIGHT`` at once; by
    default on for async (remote) filesystems unless ``TENPLEX_CONCURRENT_READS=0``, off for
    synchronous ones such as ``memory://``, which read one range per piece."""

    def __init__(self, fs: fsspec.AbstractFileSystem, sdir: str, binding: Binding | None = None, *,
                 concurrent: bool | None = None) -> None:
        self.fs, self.sdir = fs, sdir
        self.local = isinstance(fs, LocalFileSystem)
        if concurrent is None:  # async filesystems (s3, gcs, http, ...); memory:// and the like read in place
            concurrent = bool(getattr(fs, "async_impl", False)) and os.environ.get(CONCURRENT_ENV, "1") != "0"
        self.concurrent = concurrent and not self.local
        self.binding = binding
        self.indexes: dict[int, dict[str, Any]] = {}
        self.handles: dict[int, int] = {}
        self.bytes_read = 0
        self.metadata_bytes = 0
        self.ranges = 0
        self.scatters = True  # buffers may be Scatters (read_shard gives other readers temporaries)

    def bind(self, binding: Binding) -> None:
        """What this attempt's indexes must agree with; set before the first read."""
        self.binding = binding

    def index(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s index, verified (digest, schema, binding) and checked against its data file's size."""
        if rank not in self.indexes:
            if self.binding is None:
                raise RuntimeError("PartReader.bind() must be called before the first read")
            path = f"{self.sdir}/{index_name(rank)}"
            idx, n = read_sealed(self.fs, path)
            self.metadata_bytes += n
            by_key = verify_index(idx, path, rank, self.binding)
            data_path = f"{self.sdir}/{idx['file']}"
            try:
                size = self.fs.size(data_path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{data_path} is missing although its index {path} exists") from None
            except OSError as e:
                raise CheckpointCorruptError(f"{data_path} cannot be read ({e})") from None
            if size != idx["file_size"]:
                raise CheckpointCorruptError(
                    f"{data_path} has {size} bytes but its index says {idx['file_size']}: the file is truncated "
                    "or was overwritten; load an earlier step or re-save this one"
                )
            idx["by_key"] = by_key
            idx["path"] = data_path
            if self.binding.version >= 4:  # the block CRCs are words at the data file's end, read by range
                words = CrcWords(self, rank, data_path, next(iter(by_key.values()))["crc_table"] if by_key else size,
                                 size)
                for c in by_key.values():
                    c["crcs"] = words
            self.indexes[rank] = idx
        return self.indexes[rank]

    def _fd(self, rank: int, path: str) -> int:
        if rank not in self.handles:
            fd = os.open(local_path(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if hasattr(os, "posix_fadvise"):  # no read-ahead past the pieces: read_items prefetches exactly
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.handles[rank] = fd
        return self.handles[rank]

    def _chunk(self, item: ReadItem) -> tuple[dict[str, Any], dict[str, Any]]:
        idx = self.index(item.writer)
        try:
            return idx, idx["by_key"][(item.tensor, item.chunk_start)]
        except KeyError:
            raise CheckpointCorruptError(
                f"{idx['path']}: no chunk of {item.tensor} at offset {item.chunk_start}; the index does not match "
                "the manifest"
            ) from None

    def _span(self, item: ReadItem) -> tuple[dict[str, Any], dict[str, Any], int, int]:
        """``item``'s index, chunk, and bytes [lo, hi) of the chunk it reads: its elements rounded
        out to the checksum blocks the (verified) index records."""
        idx, chunk = self._chunk(item)
        lo, hi = span_of(item.a, item.b, item.itemsize, chunk["block"], chunk["length"] * item.itemsize)
        return idx, chunk, lo, hi

    def read_item(self, item: ReadItem, out: torch.Tensor) -> None:
        """Read ``item`` into ``out`` (a contiguous 1-D tensor of its length) and verify it.

        The bytes are read once: local files with one ``preadv`` that scatters the rounded-out
        checksum blocks into small head/tail buffers and ``out`` itself; checksums are
        computed over those buffers in place.
        """
        self.fetch(item, out)()

    def fetch(self, item: ReadItem, out: torch.Tensor) -> Callable[[], None]:
        """Read ``item`` into ``out`` without verifying; returns the check to run before using it.
        The chunk's block size is the one its (verified) index records."""
        idx, chunk, lo, hi = self._span(item)
        itemsize, a, b = item.itemsize, item.a, item.b
        if b <= a:
            return _nothing
        body = memoryview(out.view(torch.uint8).numpy()).cast("B")
        head = bytearray(a * itemsize - lo)
        tail = bytearray(hi - b * itemsize)
        segs = [m for m in (memoryview(head), body, memoryview(tail)) if len(m)]
        if self.local:
            got = _preadv_full(self._fd(item.writer, idx["path"]), segs, chunk["offset"] + lo)
        else:
            raw = memoryview(self.fs.cat_file(idx["path"], start=chunk["offset"] + lo, end=chunk["offset"] + hi))
            got = min(len(raw), hi - lo)
            pos = 0
            for m in segs:
                n = max(0, min(len(m), got - pos))
                m[:n] = raw[pos : pos + n]
                pos += len(m)
        self.bytes_read += got
        self.ranges += 1
        if got != hi - lo:
            raise CheckpointCorruptError(f"{idx['path']}: short read of {item.tensor} ({got} of {hi - lo} bytes)")

        def verify() -> None:
            _check_blocks(idx["path"], item, chunk, segs, lo, hi)

        return verify

    def read_items(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor], *, rank: int = 0,
                   on_read: Callable[[int], None] = lambda i: None) -> None:
        """All of a plan's reads. Local files: in file order, with the kernel asked to fetch the
        exact ranges about ``_PREFETCH`` bytes ahead (``POSIX_FADV_WILLNEED``, one call per run of
        touching ranges), so the disk works while checksums are computed and nothing outside the
        needed blocks is read; a file read (almost) whole gets sequential read-ahead instead. Every
        range goes through the staging window (``_STAGE``): read, its checksum blocks verified,
        copied into place. Loading rank
        ``rank`` starts at its own place in the writer order, so ranks of one host that need the
        same parts fetch different ones first and then find the others' in the page cache."""
        self.prefetch_crcs(items)
        if self.concurrent:
            self._read_remote(items, buffers, rank, on_read)
            return
        if not self.local or not hasattr(os, "posix_fadvise"):
            for i, item in enumerate(items):
                dest = buffers[item.tensor]
                if isinstance(dest, Scatter):
                    tmp = torch.empty(item.length, dtype=dest.dtype)
                    self.read_item(item, tmp)
                    dest.put(item.dst, tmp)
                else:
                    self.read_item(item, item.into(buffers))
                on_read(i)
            return
        spans = []
        chunk_of: list[dict[str, Any]] = []  # each item's chunk in its (verified) index
        for i, item in enumerate(items):
            _, chunk, lo, hi = self._span(item)
            chunk_of.append(chunk)
            if item.b <= item.a:
                spans.append((item.writer, 0, 0, i))
                continue
            spans.append((item.writer, chunk["offset"] + lo, chunk["offset"] + hi, i))
        writers = sorted({w for w, *_ in spans})
        turn = {w: (i - rank) % len(writers) for i, w in enumerate(writers)}
        # tensor by tensor (in the plan's tensor order), each tensor's pieces by writer turn and
        # offset: every file is still read front to back, and a tensor read through a temporary
        # (panel order, a split on dim > 0) is finished and its temporary freed before the next
        # tensor's are filled, so the temporaries in flight are about one tensor's, not the
        # whole shard's (which they were in file order when tensors span several files)
        first: dict[str, int] = {}
        for item in items:
            first.setdefault(item.tensor, len(first))
        spans.sort(key=lambda x: (first[items[x[3]].tensor], turn[x[0]], x[1], x[2], x[3]))
        # Pieces whose rounded-out spans overlap share checksum blocks (a column slice of a
        # row-major chunk: one small piece per row, each rounded out to a whole block); they are
        # read as one range, each block once, and scattered from there.
        groups: list[tuple[int, int, int, list[int]]] = []
        for w, lo, hi, i in spans:
            if groups and groups[-1][0] == w and lo < groups[-1][2] and max(hi, groups[-1][2]) - groups[-1][1] \
                    <= _SHARED_BLOCKS_MAX:
                gw, glo, ghi, members = groups[-1]
                members.append(i)
                groups[-1] = (gw, glo, max(ghi, hi), members)
            else:
                groups.append((w, lo, hi, [i]))
        wanted: dict[int, int] = {}
        for w, lo, hi, _ in groups:
            wanted[w] = wanted.get(w, 0) + hi - lo
        for w in writers:  # a file read (almost) whole: sequential read-ahead, which is faster than
            idx = self.index(w)  # exact prefetching here and reads at most 1 % more than needed
            if wanted[w] >= _WHOLE_FILE * idx["file_size"]:
                os.posix_fadvise(self._fd(w, idx["path"]), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        ahead, fetched = 0, 0
        fds = {w: self._fd(w, self.index(w)["path"]) for w in writers}
        paths = {w: self.index(w)["path"] for w in writers}
        stage = np.empty(max(_STAGE, MAX_BLOCK), dtype=np.uint8)
        stage_view = memoryview(stage)
        views: dict[str, Scatter | np.ndarray] = {}  # each destination as a Scatter or its bytes

        def dest_of(i: int) -> Scatter | np.ndarray:
            name = items[i].tensor
            view = views.get(name)
            if view is None:
                buf = buffers[name]
                view = views[name] = buf if isinstance(buf, Scatter) else buf.view(torch.uint8).numpy()
            return view

        k = 0
        while k < len(groups):
            w, lo, hi, members = groups[k]
            fetched = max(fetched, k)
            if fetched < len(groups) and ahead < _PREFETCH:
                run: list[int] = []  # [writer, lo, hi] of touching groups: one WILLNEED each (a syscall)
                while fetched < len(groups) and ahead < _PREFETCH:
                    fw, flo, fhi, _ = groups[fetched]
                    if fhi > flo:
                        if run and (run[0] != fw or flo != run[2]):
                            os.posix_fadvise(fds[run[0]], run[1], run[2] - run[1], os.POSIX_FADV_WILLNEED)
                            run = []
                        run = [fw, run[1] if run else flo, fhi]
                    ahead += fhi - flo
                    fetched += 1
                if run:
                    os.posix_fadvise(fds[run[0]], run[1], run[2] - run[1], os.POSIX_FADV_WILLNEED)
            end = k + 1  # groups done in this turn: [k, end)
            if hi > lo:
                fd, path, chunk = fds[w], paths[w], chunk_of[members[0]]
                if hi - lo > _STAGE:  # a large piece (or pieces sharing blocks): windows of whole blocks
                    block = chunk["block"]
                    step = max(1, _STAGE // block) * block
                    put = [(items[i], dest_of(i)) for i in members]
                    for wlo in range(lo, hi, step):
                        whi = min(hi, wlo + step)
                        self._read_stage(fd, path, items[members[0]].tensor, stage_view, wlo, whi)
                        self._put_stage(path, chunk, put, stage, wlo, whi)
                else:  # with the following pieces that continue it in the file: one read
                    run_hi = hi
                    while (end < len(groups) and groups[end][0] == w and groups[end][1] == run_hi
                           and groups[end][2] - lo <= _STAGE):
                        run_hi = groups[end][2]
                        end += 1
                    self._read_stage(fd, path, items[members[0]].tensor, stage_view, lo, run_hi)
                    if end == k + 1:
                        self._put_stage(path, chunk, [(items[i], dest_of(i)) for i in members], stage, lo, hi)
                    else:
                        for _, glo, ghi, gmembers in groups[k:end]:
                            self._put_stage(path, chunk_of[gmembers[0]], [(items[i], dest_of(i)) for i in gmembers],
                                            stage[glo - lo :], glo, ghi)
            for _, glo, ghi, gmembers in groups[k:end]:
                for i in gmembers:
                    on_read(i)
                ahead -= ghi - glo
            k = end

    def _read_stage(self, fd: int, path: str, tensor: str, stage: memoryview, file_lo: int, file_hi: int) -> None:
        """Bytes [file_lo, file_hi) of data file ``path`` (open as ``fd``) into the front of ``stage``, unverified."""
        n = file_hi - file_lo
        try:
            got = os.preadv(fd, [stage[:n]], file_lo)  # one call almost always; the loop below when short
        except OSError as e:
            raise CheckpointCorruptError(f"cannot read checkpoint data: {e.strerror}") from e
        if 0 < got < n:
            got += _preadv_full(fd, [stage[got:n]], file_lo + got)
        self.bytes_read += got
        self.ranges += 1
        if got != n:
            raise CheckpointCorruptError(f"{path}: short read of {tensor} ({got} of {n} bytes)")

    @staticmethod
    def _put_stage(path: str, chunk: dict[str, Any], members: Sequence[tuple[ReadItem, Scatter | np.ndarray]],
                   raw: np.ndarray, file_lo: int, file_hi: int) -> None:
        """Verify bytes [file_lo, file_hi) of data file ``path``, at the front of ``raw`` (whole checksum
        blocks of ``chunk``, one chunk's), then copy the elements of ``members`` (plan items with their
        destinations: a ``Scatter``, or a flat buffer's bytes) they hold into place."""
        lo, hi = file_lo - chunk["offset"], file_hi - chunk["offset"]
        _check_blocks(path, members[0][0], chunk, [memoryview(raw[: hi - lo])], lo, hi)
        for item, dest in members:
            size = item.itemsize
            a, b = max(item.a * size, lo), min(item.b * size, hi)
            if a < b:
                if isinstance(dest, Scatter):
                    dest.put(item.dst + a // size - item.a, raw[a - lo : b - lo])
                else:
                    at = (item.dst - item.a) * size + a
                    dest[at : at + b - a] = raw[a - lo : b - lo]

    def _read_remote(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor], rank: int,
                     on_read: Callable[[int], None]) -> None:
        """A plan's reads from a remote filesystem: each file's pieces coalesced into ranged GETs
        (``coalesce``), ``_IN_FLIGHT`` of them at once, each scattered into the destination and
        verified as it arrives; ``bytes_read`` counts every byte fetched (gaps included) and
        ``ranges`` the GETs. Writers are visited from the loading rank's place on, as locally."""
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for i, item in enumerate(items):
            if item.b <= item.a:
                on_read(i)
                continue
            _, chunk, lo, hi = self._span(item)
            spans.setdefault(item.writer, []).append((chunk["offset"] + lo, chunk["offset"] + hi, i))
        writers = sorted(spans)
        turn = {w: (k - rank) % len(writers) for k, w in enumerate(writers)}
        planned = sum(hi - lo for pieces in spans.values() for lo, hi, _ in pieces)
        budget = int(_GAP_SHARE * planned)
        requests = [(w, lo, hi, members) for w in sorted(writers, key=turn.__getitem__)
                    for lo, hi, members in coalesce(spans[w], _MAX_GAP, budget, _MAX_REQUEST)]

        paths = {w: self.index(w)["path"] for w in writers}

        def get(w: int, lo: int, hi: int) -> bytes:
            return self.fs.cat_file(paths[w], start=lo, end=hi)

        with ThreadPoolExecutor(max_workers=_IN_FLIGHT, thread_name_prefix="tenplex-get") as pool:
            pending: dict[Future[bytes], tuple[int, int, int, list[tuple[int, int, int]]]] = {}
            nxt = 0
            try:
                while nxt < len(requests) or pending:
                    while nxt < len(requests) and len(pending) < _IN_FLIGHT:
                        w, lo, hi, _ = requests[nxt]
                        pending[pool.submit(get, w, lo, hi)] = requests[nxt]
                        nxt += 1
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        _, lo, hi, members = pending.pop(fut)
                        raw = memoryview(fut.result())  # a failed GET raises as a sequential read would
                        self.bytes_read += min(len(raw), hi - lo)
                        self.ranges += 1
                        for plo, phi, i in members:
                            self._scatter(items[i], raw[plo - lo : phi - lo], phi - plo, buffers)
                            on_read(i)
            finally:
                for fut in pending:
                    fut.cancel()

    def _scatter(self, item: ReadItem, raw: memoryview, want: int, buffers: Mapping[str, torch.Tensor]) -> None:
        """Copy ``item``'s elements from ``raw`` (its rounded-out span, ``want`` bytes unless the
        file ended early) into its destination and verify its checksum blocks."""
        idx, chunk, lo, hi = self._span(item)
        if len(raw) != want:
            raise CheckpointCorruptError(f"{idx['path']}: short read of {item.tensor} ({len(raw)} of {want} bytes)")
        head = item.a * item.itemsize - lo
        dest = buffers[item.tensor]
        if isinstance(dest, Scatter):
            _check_blocks(idx["path"], item, chunk, [raw], lo, hi)
            dest.put(item.dst, torch.frombuffer(bytearray(raw[head : head + item.length * item.itemsize]),
                                                dtype=torch.uint8))
            return
        body = memoryview(item.into(buffers).view(torch.uint8).numpy()).cast("B")
        body[:] = raw[head : head + len(body)]
        _check_blocks(idx["path"], item, chunk, [raw], lo, hi)

    def prefetch_crcs(self, items: Sequence[ReadItem]) -> None:
        """Version 4: read the CRC words of every block ``items`` read, before the data: each
        writer's words coalesced into few ranges (local files: only ranges a few words apart;
        remote ones: gaps up to ``_CRC_GAP_SHARE`` of the planned bytes, all requests at once)."""
        wanted: dict[int, list[tuple[int, int, int]]] = {}
        tables: dict[int, CrcWords] = {}
        planned = 0
        for item in items:
            if item.b <= item.a:
                continue
            _, chunk, lo, hi = self._span(item)
            words = chunk.get("crcs")
            if words is not None:
                pieces = wanted.setdefault(item.writer, [])
                at = chunk["crc_at"]
                if chunk["prefix"]:  # version 5: the words at the span's two ends
                    first, last = prefix_words(chunk["block"], lo, hi)
                    pieces.extend((at + j, at + j + 1, 0) for j in (first, last) if j is not None)
                else:
                    (k0, k1), (g0, g1), (t0, t1) = crc_spans(chunk["length"] * item.itemsize, chunk["block"], lo, hi)
                    for w0, a, b in ((at, k0, k1), (chunk["group_at"], g0, g1), (at, t0, t1)):
                        if b > a:
                            pieces.append((w0 + a, w0 + b, 0))
                tables[item.writer] = words
                planned += hi - lo
        if not wanted:
            return
        if self.local:
            gap, budget = _CRC_GAP_WORDS, 1 << 62
        else:
            gap, budget = _MAX_GAP // 4, int(_CRC_GAP_SHARE * planned) // 4
        ranges = [(w, lo, hi) for w, pieces in sorted(wanted.items())
                  for lo, hi, _ in coalesce(pieces, gap, budget, _MAX_REQUEST // 4)]
        if self.local:
            for w, lo, hi in ranges:
                tables[w].fetch([(lo, hi)])
            return
        ranges = [(w, lo, hi) for w, lo, hi in ranges if not tables[w].have[lo:hi].all()]
        if not ranges:
            return
        raws = self.fs.cat_ranges([tables[w].path for w, _, _ in ranges],  # concurrent on async filesystems
                                  [tables[w].offset + 4 * lo for w, lo, _ in ranges],
                                  [tables[w].offset + 4 * hi for w, _, hi in ranges], on_error="return")
        for (w, lo, hi), raw in zip(ranges, raws):
            if isinstance(raw, BaseException):
                raise raw  # a failed GET raises as a data read's would
            self.metadata_bytes += len(raw)
            tables[w].put(lo, hi, raw)

    def read_crc_words(self, rank: int, path: str, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of rank ``rank``'s data file ``path`` (its CRC table), counted as metadata."""
        if self.local:
            buf = bytearray(hi - lo)
            got = _preadv_full(self._fd(rank, path), [memoryview(buf)], lo)
            raw = bytes(buf[:got])
        else:
            raw = self.fs.cat_file(path, start=lo, end=hi)
        self.metadata_bytes += len(raw)
        return raw

    def close(self) -> None:
        for fd in self.handles.values():
            os.close(fd)
        self.handles.clear()


class CrcWords:
    """Version 4: the block CRC32 words of one data file (its ``CRC_TABLE``), read by word range on
    demand (``fetch``, ``words``) through the reader that counts the bytes."""

    def __init__(self, reader: PartReader, rank: int, path: str, offset: int, file_size: int) -> None:
        self.reader, self.rank, self.path, self.offset = reader, rank, path, offset
        n = max(0, (file_size - offset) // 4)
        self.buf = bytearray(4 * n)
        self.have = np.zeros(n, dtype=bool)

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Read the words [lo, hi) of each range that are not here yet (each range read whole)."""
        for lo, hi in ranges:
            if not self.have[lo:hi].all():
                self.put(lo, hi, self.reader.read_crc_words(self.rank, self.path, self.offset + 4 * lo,
                                                            self.offset + 4 * hi))

    def put(self, lo: int, hi: int, raw: bytes) -> None:
        """Words [lo, hi) read as ``raw`` (CheckpointCorruptError when the file ended early)."""
        if len(raw) != 4 * (hi - lo):
            raise CheckpointCorruptError(f"{self.path}: short read of its CRC table ({len(raw)} of {4 * (hi - lo)} "
                                         "bytes)")
        self.buf[4 * lo : 4 * hi] = raw
        self.have[lo:hi] = True

    def words(self, lo: int, hi: int) -> bytes:
        """Words [lo, hi) as big-endian bytes, read first if needed."""
        if hi > len(self.have):
            raise CheckpointCorruptError(f"{self.path}: CRC words [{lo}, {hi}) lie beyond its table")
        missing = np.flatnonzero(~self.have[lo:hi])
        if len(missing):
            self.fetch([(lo + int(missing[0]), lo + int(missing[-1]) + 1)])
        return bytes(self.buf[4 * lo : 4 * hi])


def _preadv_full(fd: int, segs: list[memoryview], offset: int) -> int:
    """``preadv`` into ``segs`` until they are full or the file ends; returns the bytes read."""
    total, segs = 0, list(segs)
    while segs:
        try:
            n = os.preadv(fd, segs, offset + total)
        except OSError as e:
            raise CheckpointCorruptError(f"cannot read checkpoint data: {e.strerror}") from e
        if n == 0:
            break
        total += n
        while segs and n >= len(segs[0]):
            n -= len(segs[0])
            segs.pop(0)
        if n:
            segs[0] = segs[0][n:]
    return total


def coalesce(pieces: Sequence[tuple[int, int, int]], max_gap: int, budget: int,
             max_request: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Byte ranges ``(lo, hi, tag)`` of one file merged into requests ``(lo, hi, members)``.

    Overlapping and touching pieces always merge (that reads less); across a gap of at most
    ``max_gap`` bytes they merge while the gaps bridged, smallest first, total at most
    ``budget`` bytes, and while the request stays within ``max_request`` bytes (a piece larger
    than that is a request of its own). Requests come in file order, each piece in exactly one.
    """
    order = sorted(pieces)
    gaps, end = [], order[0][1] if order else 0
    for lo, hi, _ in order[1:]:
        if 0 < lo - end <= max_gap:
            gaps.append(lo - end)
        end = max(end, hi)
    limit, spent = 0, 0
    for g, n in sorted(Counter(gaps).items()):  # the largest gap size whose gaps, with all smaller ones, fit
        if spent + g * n > budget:
            break
        spent += g * n
        limit = g
    out: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for lo, hi, tag in order:
        if out and lo - out[-1][1] <= limit and max(hi, out[-1][1]) - out[-1][0] <= max_request:
            rlo, rhi, members = out[-1]
            members.append((lo, hi, tag))
            out[-1] = (rlo, max(rhi, hi), members)
        else:
            out.append((lo, hi, [(lo, hi, tag)]))
    return out


def _check_blocks(path: str, item: ReadItem, chunk: dict[str, Any], segs: list[memoryview], lo: int,
                  hi: int) -> None:
    """CheckpointCorruptError unless bytes [lo, hi) of ``item``'s chunk (``lo`` on a block boundary),
    laid out across ``segs``, match the CRCs its part records (version 4: words of the data file's CRC
    table, seeded with the part's binding, groups of blocks inside the range by their group words
    (``crc_spans``); before: every block against the index's hex digits)."""
    block, seed = chunk["block"], chunk.get("seed", 0)
    table = chunk.get("crcs")
    if table is not None and chunk["prefix"]:
        _check_prefix(path, item, chunk, table, segs, lo, hi)
        return
    if table is None:
        checks = [(lo, hi, block, chunk.get("crc32_bytes"), lo // block)]
        if checks[0][3] is None:  # the index's hex digits as bytes, once per chunk (a race only computes it twice)
            checks = [(lo, hi, block, chunk.setdefault("crc32_bytes", bytes.fromhex(chunk["crc32"])), lo // block)]
    else:
        nbytes = chunk["length"] * item.itemsize
        (k0, k1), (g0, g1), (t0, t1) = crc_spans(nbytes, block, lo, hi)
        group = block * CRC_GROUP
        checks = [(a, b, size, table.words(at + x, at + y), 0) for a, b, size, at, x, y in (
            (k0 * block, min(k1 * block, hi), block, chunk["crc_at"], k0, k1),
            (g0 * group, min(g1 * group, hi), group, chunk["group_at"], g0, g1),
            (t0 * block, hi, block, chunk["crc_at"], t0, t1)) if y > x]
    for a, b, size, want, at in checks:
        if len(segs) == 1:
            raw = segs[0]
            got = [crc32(raw[p - lo : min(p + size, b) - lo], seed) for p in range(a, b, size)]
        else:
            got = _block_crcs(segs, lo, a, b, size, seed)
        if struct.pack(f">{len(got)}I", *got) != want[4 * at : 4 * (at + len(got))]:  # about 1 us
            words = np.frombuffer(want, dtype=">u4").tolist()
            bad = next(j for j, (g, w) in enumerate(zip(got, words[at:] + [None] * len(got))) if g != w)
            off = a + bad * size
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in {item.tensor} bytes [{off}, {min(off + size, chunk['length'] * item.itemsize)}) "
                f"of the chunk at offset {item.chunk_start}: the file is corrupted; load an earlier step"
            )


def _check_prefix(path: str, item: ReadItem, chunk: dict[str, Any], table: CrcWords, segs: list[memoryview],
                  lo: int, hi: int) -> None:
    """Version 5: bytes [lo, hi) of ``item``'s chunk (whole blocks, laid out across ``segs`` from ``lo``)
    against the prefix words at their two ends (``prefix_words``): one CRC32 over the bytes, started
    from the first word, must give the last."""
    seed, at = chunk["seed"], chunk["crc_at"]
    first, last = prefix_words(chunk["block"], lo, hi)
    crc = seed if first is None else int.from_bytes(table.words(at + first, at + first + 1), "big") ^ seed
    need = hi - lo
    for seg in segs:
        take = min(len(seg), need)
        crc = crc32(seg[:take], crc)
        need -= take
    if crc != int.from_bytes(table.words(at + last, at + last + 1), "big") ^ seed:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch in {item.tensor} bytes [{lo}, {hi}) of the chunk at offset {item.chunk_start}: "
            "the file is corrupted; load an earlier step"
        )


def _block_crcs(segs: list[memoryview], base: int, lo: int, hi: int, block: int, seed: int = 0) -> list[int]:
    """The CRC32 (from ``seed``) of each ``block`` bytes of [lo, hi), the chunk's bytes from ``base`` on
    laid out across ``segs``."""
    out, si, soff, skip = [], 0, 0, lo - base
    while skip:  # to ``lo``
        take = min(skip, len(segs[si]) - soff)
        soff += take
        skip -= take
        if soff == len(segs[si]):
            si, soff = si + 1, 0
    pos = lo
    while pos < hi:
        end = min(pos + block, hi)
        crc, need = seed, end - pos
        while need:
            seg = segs[si]
            take = min(need, len(seg) - soff)
            crc = crc32(seg[soff : soff + take], crc)
            soff += take
            need -= take
            if soff == len(seg):
                si, soff = si + 1, 0
        out.append(crc)
        pos = end
    return out


# ---------------------------------------------------------------------------------------------
# executing a plan
# ---------------------------------------------------------------------------------------------
class Scatter:
    """A flat buffer in canonical order that is not one range of memory: the caller's tensor, whose
    row-major memory holds the canonical order's runs at strides (a panel-ordered tensor's row shard:
    each panel's rows are every ``C``-th run of ``W`` elements). ``parts``: ``(pos, n, view)`` with
    flat elements [pos, pos + n) laid out in ``view`` (3-D, ``(panels, rows, inner)``, any strides
    but a contiguous last dim; or that view's bytes, a uint8 numpy array) in its row-major index
    order, parts in flat order and covering [0, numel). Readers copy verified bytes in (``put``) instead of reading into a temporary of the
    whole tensor. The copies go through numpy byte views (any dtype; a small one costs about a
    microsecond, a torch one about 15)."""

    def __init__(self, parts: Sequence[tuple[int, int, torch.Tensor | np.ndarray]], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.numel = sum(n for _, n, _ in parts)
        self.starts = [pos * self.itemsize for pos, _, _ in parts]
        self.parts = [(pos * self.itemsize, n * self.itemsize,
                       view if isinstance(view, np.ndarray) else view.view(torch.uint8).numpy())
                      for pos, n, view in parts]

    def put(self, dst: int, src: torch.Tensor | np.ndarray) -> None:
        """Flat elements [dst, dst + n) from ``src``: n elements of this dtype (a 1-D tensor), or
        their bytes (a 1-D uint8 array)."""
        if isinstance(src, torch.Tensor):
            src = src.contiguous().view(torch.uint8).numpy()
        pos = dst * self.itemsize
        while len(src):
            k = bisect.bisect_right(self.starts, pos) - 1
            start, n, view = self.parts[k]
            take = min(len(src), start + n - pos)
            _put_range(view, pos - start, src[:take])
            src, pos = src[take:], pos + take

    def fill(self, flat: torch.Tensor) -> None:
        """All of it from ``flat`` (a whole flat buffer)."""
        self.put(0, flat)


def _put_range(view: np.ndarray, s: int, src: np.ndarray) -> None:
    """Bytes [s, s + len(src)) of ``view`` (3-D) in its row-major index order from ``src``: at most
    a partial row, whole rows of one panel, whole panels, rows, a partial row (a few copies)."""
    _, rows, inner = view.shape
    e, per = s + len(src), rows * inner
    while s < e:
        p, rem = divmod(s, per)
        r, c = divmod(rem, inner)
        if c or e - s < inner:
            k = min(inner - c, e - s)
            view[p, r, c : c + k] = src[:k]
        elif r or e - s < per:
            nr = min(rows - r, (e - s) // inner)
            k = nr * inner
            view[p, r : r + nr] = src[:k].reshape(nr, inner)
        else:
            npan = (e - s) // per
            k = npan * per
            view[p : p + npan] = src[:k].reshape(npan, rows, inner)
        src, s = src[k:], s + k


class ShardSink(Protocol):
    """Where a load puts a rank's tensors instead of new ones (``tenplex.state_dict`` loads in place).

    ``buffer(name)``: the flat buffer, in the saved canonical order, that the reads fill (a view of
    the caller's tensor when its memory has that order, a ``Scatter`` of it when its memory holds
    that order's runs at strides, else a temporary); ``copies(name)``: whether ``finish`` copies (it
    then runs in a second thread as soon as the tensor's last read is in); ``finish(name, flat)``:
    the shard's value once every read of ``name`` is in (``flat``: what ``buffer`` gave)."""

    def buffer(self, name: str) -> torch.Tensor | Scatter: ...

    def copies(self, name: str) -> bool: ...

    def finish(self, name: str, flat: torch.Tensor) -> Any: ...


def read_shard(saved: PTC, old: Layout, cfg: Layout, rank: int, reader: ShardReader,
               writers: Mapping[int, list[Chunk]] | None = None,
               sink: ShardSink | None = None, version: int = VERSION) -> tuple[dict[str, Any], int]:
    """Rank ``rank``'s tensors under ``cfg`` from chunks written under ``old``: the plan
    (``plan_reads``), executed by ``reader``; which file (or tier) each read comes from is the
    reader's business. Returns the shard and the real (non-padding) bytes it needed.
    ``writers``: ``writer_assignment(saved, old)`` when the caller has it; ``sink``: where the
    tensors go (default: new tensors in their natural local shape); ``version``: the checkpoint's format version."""
    items = plan_reads(saved, old, cfg, rank, writers=writers, version=version)
    needed = sum(item.length * item.itemsize for item in items)
    if sink is None:
        buffers = shard_buffers(saved, cfg, rank)
        copies: Callable[[str], bool] = saved.relaid

        def finish(name: str, flat: torch.Tensor) -> Any:
            return saved.from_local_flat(name, cfg, flat, rank)
    else:
        buffers, copies, finish = _sink_buffers(sink, getattr(reader, "scatters", False))
    return _read_and_finish(saved.rank_tensors(cfg, rank), reader, items, buffers, copies, finish, rank), needed


def _sink_buffers(sink: ShardSink, scatters: bool) -> tuple[_LazyBuffers, Callable[[str], bool],
                                                              Callable[[str, Any], Any]]:
    """A sink's buffers, ``copies`` and ``finish`` for a reader; one that cannot ``scatters`` gets a
    temporary for each ``Scatter``, copied into it by ``finish``."""
    if scatters:
        return _LazyBuffers(sink.buffer), sink.copies, sink.finish
    later: dict[str, Scatter] = {}

    def make(name: str) -> torch.Tensor:
        out = sink.buffer(name)
        if isinstance(out, Scatter):
            later[name] = out
            return torch.empty(out.numel, dtype=out.dtype)
        return out

    def finish(name: str, flat: Any) -> Any:
        scatter = later.pop(name, None)
        if scatter is not None:
            scatter.fill(flat)
        return sink.finish(name, flat)

    return _LazyBuffers(make), lambda name: name in later or sink.copies(name), finish


class _LazyBuffers(dict):  # type: ignore[type-arg]
    """A sink's flat buffers, each made when its tensor's first read asks for it (or ``pop`` does),
    not all up front: a temporary made after earlier ones were freed reuses their memory, where
    temporaries all allocated at the start each touch fresh pages that the allocator keeps once
    freed (the process's peak memory grew with the whole shard). Thread-safe creation."""

    def __init__(self, make: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.make = make
        self.lock = threading.Lock()

    def __missing__(self, name: str) -> torch.Tensor:
        with self.lock:
            if not dict.__contains__(self, name):
                dict.__setitem__(self, name, self.make(name))
            return dict.__getitem__(self, name)

    def pop(self, name: str, *default: Any) -> torch.Tensor:  # type: ignore[override]
        if not default:
            self[name]  # noqa: B018 - made if no read asked for it yet (a tensor with nothing to read)
        return dict.pop(self, name, *default)


def _read_and_finish(names: Sequence[str], reader: ShardReader, items: Sequence[ReadItem],
                     buffers: dict[str, torch.Tensor], copies: Callable[[str], bool],
                     finish: Callable[[str, torch.Tensor], Any], rank: int) -> dict[str, Any]:
    """Execute ``items``; a tensor whose ``finish`` copies (split on a dim > 0: the file holds it
    split dim first; or a caller's tensor the reads cannot fill directly) is finished in a second
    thread as soon as its last piece is in, while later pieces are still being read. Each flat
    buffer is dropped once finished, so at most the tensors in flight exist twice (peak memory)."""
    count: dict[str, int] = {}
    for item in items:
        count[item.tensor] = count.get(item.tensor, 0) + 1
    done: dict[str, Any] = {}
    lock = threading.Lock()
    waiting = threading.Lock()
    queued: list[tuple[Any, int]] = []  # finishes submitted and not yet waited for, with their bytes
    ahead = [0]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenplex-relayout") as pool:

        def on_read(i: int) -> None:
            name = items[i].tensor
            with lock:
                count[name] -= 1
                if count[name]:
                    return
            if copies(name):  # the flat buffer's last references are the copy's (and the checksums')
                flat = buffers.pop(name)
                with waiting:  # bounded temporaries awaiting their copy (on_read may run in several threads)
                    done[name] = pool.submit(finish, name, flat)
                    queued.append((done[name], flat.numel() * flat.element_size()))
                    ahead[0] += queued[-1][1]
                    while ahead[0] > _CHECK_AHEAD and len(queued) > 1:
                        fut, n = queued.pop(0)
                        fut.result()
                        ahead[0] -= n

        reader.read_items(items, buffers, rank=rank, on_read=on_read)
        out = {name: fut.result() for name, fut in done.items()}
    for name in [n for n in names if n not in out]:  # cheap reshapes, no copy
        out[name] = finish(name, buffers.pop(name))
    return {name: out[name] for name in names}


def read_objects(sources: Sequence[tuple[fsspec.AbstractFileSystem, str]],
                 manifest: Manifest) -> tuple[dict[str, Any], Any, int]:
    """The small objects and ``extra`` of a save attempt, from the first directory of ``sources``
    whose ``objects.pt`` has the size and SHA-256 the manifest records (checked before
    unpickling) and holds objects of the saved PTC; and the bytes read to find it."""
    want = manifest.raw["objects"]
    objects_of = manifest.full().ptc.objects  # type: ignore[union-attr]
    errors = []
    nread = 0
    for fs, sdir in sources:
        path = f"{sdir}/{OBJECTS_NAME}"
        try:
            raw = fs.cat_file(path)
        except OSError as e:
            errors.append(f"{path} cannot be read ({e})")
            continue
        nread += len(raw)
        if len(raw) != want["size"]:
            errors.append(f"{path} has {len(raw)} bytes but its manifest says {want['size']}")
            continue
        if hashlib.sha256(raw).hexdigest() != want["sha256"]:
            errors.append(f"{path}: SHA-256 differs from the one its manifest records")
            continue
        try:
            payload = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
            errors.append(f"{path} cannot be read ({type(e).__name__}: {e})")
            continue
        if (not isinstance(payload, dict) or set(payload) != {"objects", "extra"}
                or not isinstance(payload["objects"], dict) or not set(payload["objects"]) <= set(objects_of)):
            errors.append(f"{path} does not hold the objects and extra of this checkpoint's PTC")
            continue
        return dict(payload["objects"]), payload["extra"], nread
    raise CheckpointCorruptError("; ".join(errors) + "; the objects file is damaged")


def check_model(saved: PTC, expected: PTC, where: str, *, allow_meta_change: bool = False) -> None:
    """CheckpointMismatchError unless ``saved`` has ``expected``'s tensors and, unless
    ``allow_meta_change``, its model settings (``meta["model"]``, where both record them; what
    ``expected`` leaves unstated, norm epsilon, RoPE or source config, is the checkpoint's:
    ``tenplex.models.model_differences``)."""
    if expected.fingerprint() != saved.fingerprint():
        diff = "; ".join(expected.diff(saved)) or "specs differ"
        raise CheckpointMismatchError(f"checkpoint {where} holds another model than the one requested: {diff}")
    if (expected.num_layers, expected.objects) != (saved.num_layers, saved.objects):
        raise CheckpointMismatchError(
            f"checkpoint {where} holds another model than the one requested: {saved.num_layers} layers and objects "
            f"{list(saved.objects)}, requested {expected.num_layers} layers and objects {list(expected.objects)}"
        )
    a, b = saved.meta.get("model"), expected.meta.get("model")
    if allow_meta_change or not isinstance(a, dict) or not isinstance(b, dict):
        return
    diffs = model_differences(a, b)  # the request's unstated hyperparameters and source config accept the saved ones
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {where} was saved with other model settings ({'; '.join(diffs)}); its tensors have the "
            "requested shapes, but training would continue another model: pass allow_meta_change=True to load "
            "it anyway"
        )


def load_with_reader(manifest: Manifest, where: str, cfg: Layout, rank: int, reader: ShardReader,
                     objects_from: Sequence[tuple[fsspec.AbstractFileSystem, str]], *, ptc: PTC | None,
                     allow_meta_change: bool = False, t0: float, sink: ShardSink | None = None,
                     check: Callable[[PTC], None] | None = None) -> LoadResult:
    """Check a verified ``manifest`` against ``ptc`` and ``cfg``, read the objects (from the
    first of ``objects_from``'s directories whose copy matches the manifest), then ``rank``'s
    shard through ``reader``. Shared by ``load`` and tiered recovery, whose readers differ.
    ``check(saved)``: the caller's own model check (raise to refuse), before anything is read."""
    manifest = manifest.full()
    saved, old = manifest.ptc, manifest.layout
    assert saved is not None
    if ptc is not None:
        check_model(saved, ptc, where, allow_meta_change=allow_meta_change)
    if check is not None:
        check(saved)
    saved.check(cfg)
    cfg.coords(rank)
    writers = writer_assignment(saved, old)
    reader.bind(Binding.of(manifest, writers))
    try:
        objects, extra, objects_bytes = read_objects(objects_from, manifest)  # small: fails fast, before the data
        shard, needed = read_shard(saved, old, cfg, rank, reader, writers=writers, sink=sink,
                                   version=manifest.raw["version"])
        shard.update(objects)
    finally:
        reader.close()
    stats = LoadStats(needed, reader.bytes_read, reader.metadata_bytes + objects_bytes, reader.ranges,
                      time.perf_counter() - t0)
    return LoadResult(shard, manifest.step, extra, saved, old, stats)


def load(
    url: str,
    cfg: Layout,
    rank: int,
    *,
    step: int | None = None,
    ptc: PTC | None = None,
    allow_meta_change: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    sink: ShardSink | None = None,
    check: Callable[[PTC], None] | None = None,
) -> LoadResult:
    """Load rank ``rank``'s shard under layout ``cfg`` from the newest complete save attempt
    that verifies (of ``step`` when given).

    Reads only the byte ranges this rank needs (rounded out to checksum blocks) and verifies
    them, with the manifest, the indexes it reads and the objects file. Attempts are tried
    newest first: one that fails any check (CheckpointCorruptError) is logged, reported in
    ``LoadResult.skipped`` and passed over, so a damaged newest step never blocks recovery
    from an intact older one; with ``step`` only that step's attempts are tried. Nothing
    partial is returned: when no attempt verifies, CheckpointCorruptError lists why.
    ``ptc``: the model the caller expects; a checkpoint of another model raises
    CheckpointMismatchError, and so do other model settings (``ptc.meta["model"]``, e.g.
    heads or norm eps) unless ``allow_meta_change``. Ranks that need different bytes can
    see different damage and resume from different steps: under a process group make them
    agree (``tenplex.elastic.agree_on_step``; docs/format.md, "Choosing a step").
    ``sink`` / ``check``: see ``ShardSink`` and ``load_with_reader`` (``tenplex.state_dict``'s in-place
    loads use them).
    """
    t0 = time.perf_counter()
    fs, root = url_fs(url, storage_options)
    skipped: list[tuple[int, str, str]] = []
    for info, manifest in iter_candidates(fs, root, url, step):
        if not isinstance(manifest, Manifest):
            if manifest is not None and not isinstance(manifest, CheckpointCorruptError):
                raise manifest  # a format version this tenplex does not read
            skipped.append((info.step, info.save_id, info.problem))
            continue
        reader = PartReader(fs, info.path)
        reader.metadata_bytes += manifest.nbytes
        try:
            result = load_with_reader(manifest, f"{url} step {info.step}", cfg, rank, reader, [(fs, info.path)],
                                      ptc=ptc, allow_meta_change=allow_meta_change, t0=t0, sink=sink, check=check)
        except CheckpointCorruptError as e:
            log.warning("checkpoint %s step %d (save %s) does not verify, trying an older one: %s", url, info.step,
                        info.save_id, e)
            skipped.append((info.step, info.save_id, str(e)))
            continue
        stats = result.stats
        log.debug("loaded step %d rank %d under %s: read %d of %d bytes needed in %.3fs", result.step, rank, cfg,
                  stats.bytes_read, stats.bytes_needed, stats.seconds)
        if skipped:
            log.warning("loaded step %d of %s after passing over %d newer attempts: %s", result.step, url,
                        len(skipped), "; ".join(f"step {s} ({sid}): {why}" for s, sid, why in skipped))
        return dataclasses.replace(result, skipped=tuple(skipped))
    raise CheckpointCorruptError(
        f"no complete checkpoint{'' if step is None else f' of step {step}'} under {url} verifies: "
        + "; ".join(f"step {s} ({sid}): {why}" for s, sid, why in skipped)
    )
