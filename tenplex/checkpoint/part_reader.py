"""The engine that executes read plans on one save attempt's files: ``PartReader``.

Local files are read with ``preadv`` through a small reused staging window (verified while it is in
the CPU cache, then copied into place); other fsspec filesystems with ranged reads (remote, async
ones with nearby pieces coalesced into GETs, many in flight). Every byte used is checked against its
part's CRCs first (``CrcWords``: version 4/5 words read by range). ``ShardReader`` is the protocol
every plan executor follows; ``Scatter`` a destination whose runs lie at strides in the caller's
tensor.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointCorruptError
from .catalog import local_path, read_sealed
from .format import (
    CRC_GROUP,
    MAX_BLOCK,
    Binding,
    crc32,
    crc_spans,
    index_name,
    prefix_words,
    verify_index,
)
from .read_plan import ReadItem, span_of

__all__ = ["ShardReader", "CONCURRENT_ENV", "PartReader", "CrcWords", "coalesce", "Scatter"]

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
"""Versions 4 and 5, local files and synchronous filesystems (which read data one piece at a time too): CRC
words of two pieces at most this many words apart are read as one range."""
_CRC_GAP_SHARE = 0.001
"""Versions 4 and 5, concurrent (async remote) reads: the words bridged between the CRC words a plan needs
total at most this share of its data bytes. Version 5 needs two words per piece, often far apart: with the
data's ``_GAP_SHARE`` (0.5 %) the bridged words cost more than the words themselves, 1.1 % of an FSDP2
4 -> 3 load of a narrow model; requests stay at most one per piece, all issued at once."""
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
            self._read_plain(items, buffers, on_read)
            return
        groups, chunk_of = self._local_groups(items, rank)
        writers = sorted({w for w, *_ in groups})
        fds = {w: self._fd(w, self.index(w)["path"]) for w in writers}
        paths = {w: self.index(w)["path"] for w in writers}
        stage = np.empty(max(_STAGE, MAX_BLOCK), dtype=np.uint8)
        views: dict[str, Scatter | np.ndarray] = {}  # each destination as a Scatter or its bytes

        def dest_of(i: int) -> Scatter | np.ndarray:
            name = items[i].tensor
            view = views.get(name)
            if view is None:
                buf = buffers[name]
                view = views[name] = buf if isinstance(buf, Scatter) else buf.view(torch.uint8).numpy()
            return view

        k, ahead, fetched = 0, 0, 0
        while k < len(groups):
            fetched, ahead = _advise(groups, max(fetched, k), ahead, fds)
            w, lo, hi, members = groups[k]
            end = k + 1  # groups done in this turn: [k, end)
            if hi > lo:
                end = self._read_groups(groups, k, fds[w], paths[w], chunk_of, items, dest_of, stage)
            for _, glo, ghi, gmembers in groups[k:end]:
                for i in gmembers:
                    on_read(i)
                ahead -= ghi - glo
            k = end

    def _read_plain(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor],
                    on_read: Callable[[int], None]) -> None:
        """A plan's reads one by one, in plan order (synchronous non-local filesystems, no ``posix_fadvise``)."""
        for i, item in enumerate(items):
            dest = buffers[item.tensor]
            if isinstance(dest, Scatter):
                tmp = torch.empty(item.length, dtype=dest.dtype)
                self.read_item(item, tmp)
                dest.put(item.dst, tmp)
            else:
                self.read_item(item, item.into(buffers))
            on_read(i)

    def _local_groups(self, items: Sequence[ReadItem], rank: int
                      ) -> tuple[list[tuple[int, int, int, list[int]]], list[dict[str, Any]]]:
        """A local plan's file ranges ``(writer, lo, hi, members)`` in reading order, and each item's
        chunk. Tensor by tensor (in the plan's tensor order), each tensor's pieces by writer turn
        (rank ``rank`` starts at its own place) and offset: every file is still read front to back, and
        a tensor read through a temporary (panel order, a split on dim > 0) is finished and its
        temporary freed before the next tensor's are filled, so the temporaries in flight are about one
        tensor's, not the whole shard's. Pieces whose rounded-out spans overlap share checksum blocks
        (a column slice of a row-major chunk: one small piece per row) and form one range, each block
        read once. A file read (almost) whole is switched to sequential read-ahead, which is faster
        than exact prefetching there and reads at most 1 % more than needed."""
        spans = []
        chunk_of: list[dict[str, Any]] = []  # each item's chunk in its (verified) index
        for i, item in enumerate(items):
            _, chunk, lo, hi = self._span(item)
            chunk_of.append(chunk)
            spans.append((item.writer, 0, 0, i) if item.b <= item.a else
                         (item.writer, chunk["offset"] + lo, chunk["offset"] + hi, i))
        writers = sorted({w for w, *_ in spans})
        turn = {w: (i - rank) % len(writers) for i, w in enumerate(writers)}
        first: dict[str, int] = {}
        for item in items:
            first.setdefault(item.tensor, len(first))
        spans.sort(key=lambda x: (first[items[x[3]].tensor], turn[x[0]], x[1], x[2], x[3]))
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
        for w in writers:
            idx = self.index(w)
            if wanted[w] >= _WHOLE_FILE * idx["file_size"]:
                os.posix_fadvise(self._fd(w, idx["path"]), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return groups, chunk_of

    def _read_groups(self, groups: Sequence[tuple[int, int, int, list[int]]], k: int, fd: int, path: str,
                     chunk_of: Sequence[dict[str, Any]], items: Sequence[ReadItem],
                     dest_of: Callable[[int], Scatter | np.ndarray], stage: np.ndarray) -> int:
        """Read, verify and place group ``k`` (of file ``path``, open as ``fd``) through the staging
        window: a large one in windows of whole blocks, a small one with the following groups that
        continue it in the file as one read. Returns the index of the first group not done."""
        w, lo, hi, members = groups[k]
        chunk, stage_view, end = chunk_of[members[0]], memoryview(stage), k + 1
        if hi - lo > _STAGE:  # a large piece (or pieces sharing blocks): windows of whole blocks
            block = chunk["block"]
            step = max(1, _STAGE // block) * block
            put = [(items[i], dest_of(i)) for i in members]
            for wlo in range(lo, hi, step):
                whi = min(hi, wlo + step)
                self._read_stage(fd, path, items[members[0]].tensor, stage_view, wlo, whi)
                self._put_stage(path, chunk, put, stage, wlo, whi)
            return end
        run_hi = hi
        while end < len(groups) and groups[end][0] == w and groups[end][1] == run_hi and groups[end][2] - lo <= _STAGE:
            run_hi = groups[end][2]
            end += 1
        self._read_stage(fd, path, items[members[0]].tensor, stage_view, lo, run_hi)
        if end == k + 1:
            self._put_stage(path, chunk, [(items[i], dest_of(i)) for i in members], stage, lo, hi)
            return end
        for _, glo, ghi, gmembers in groups[k:end]:
            self._put_stage(path, chunk_of[gmembers[0]], [(items[i], dest_of(i)) for i in gmembers],
                            stage[glo - lo :], glo, ghi)
        return end

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
        """Versions 4 and 5: read the CRC words that check what ``items`` read, before the data: each
        writer's words coalesced into few ranges (local files and synchronous filesystems: only ranges a
        few words apart; concurrent remote reads: gaps up to ``_CRC_GAP_SHARE`` of the planned bytes, all
        requests at once)."""
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
        if not self.concurrent:
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


def _advise(groups: Sequence[tuple[int, int, int, list[int]]], fetched: int, ahead: int,
            fds: Mapping[int, int]) -> tuple[int, int]:
    """Ask the kernel for the ranges of ``groups`` from ``fetched`` on while fewer than ``_PREFETCH``
    bytes are asked ahead (``ahead``), one ``POSIX_FADV_WILLNEED`` per run of touching ranges; returns
    the new ``(fetched, ahead)``."""
    if fetched >= len(groups) or ahead >= _PREFETCH:
        return fetched, ahead
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
    return fetched, ahead


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
# destinations at strides
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
