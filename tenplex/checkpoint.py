"""Resharding checkpoints on any fsspec URL: safetensors data, JSON manifests, partial reads.

Layout of a checkpoint (see docs/format.md)::

    URL/step-000000000042-<id>/manifest.json          PTC spec, layout, step (rank 0)
    URL/step-000000000042-<id>/objects.pt             small objects and `extra` (rank 0)
    URL/step-000000000042-<id>/rank-00003.safetensors  the chunks rank 3 wrote
    URL/step-000000000042-<id>/rank-00003.json         their index: offsets and CRC32s; written
                                                       last, so its presence marks the part complete

``<id>`` names the save attempt (8 hex digits), so parts of an interrupted attempt are never
mixed with a later save of the same step.

Every chunk is one interval of a tensor's canonical flat order (see ``tenplex.ptc``), stored
as a 1-D safetensors tensor, so any piece a future layout needs is one contiguous byte
range. Replicated intervals are written once, by the least-loaded of their holders. CRC32s
cover fixed blocks of each chunk, so a load verifies exactly the blocks it reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from .config import ParallelConfig
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .planner import holder_classes, intersect
from .ptc import PAD, PTC

try:  # ISA-L's CRC32 (same polynomial and values as zlib's) runs about 8x faster; both release the GIL
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32

__all__ = ["SaveResult", "LoadStats", "LoadResult", "StepInfo", "save", "load", "list_steps", "read_manifest",
           "writer_assignment", "default_save_id"]

log = logging.getLogger(__name__)

FORMAT = "tenplex-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")
_MIN_BLOCK, _MAX_BLOCK = 4096, 65536


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    rank: int
    bytes_written: int
    chunks: int
    seconds: float
    path: str = ""  # the save attempt's directory


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a load read: ``bytes_read`` counts data bytes fetched (checksum blocks included),
    ``metadata_bytes`` the JSON indexes and manifest; ``bytes_needed`` is the real (non-padding)
    size of the loaded shard."""

    bytes_needed: int
    bytes_read: int
    metadata_bytes: int
    ranges: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LoadResult:
    shard: dict[str, Any]
    step: int
    extra: Any
    ptc: PTC
    saved_layout: ParallelConfig
    stats: LoadStats


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One save attempt of a step: ``path`` is its directory, ``save_id`` tells attempts apart."""

    step: int
    complete: bool
    layout: ParallelConfig | None
    world_size: int | None
    ranks_done: int
    nbytes: int
    save_id: str = ""
    path: str = ""
    created: float = 0.0


# ---------------------------------------------------------------------------------------------
# paths and small I/O helpers
# ---------------------------------------------------------------------------------------------
def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, root.rstrip("/")


def _step_dir(root: str, step: int, save_id: str) -> str:
    return f"{root}/step-{step:012d}-{save_id}"


def default_save_id(cfg: ParallelConfig, ptc: PTC) -> str:
    """An id every rank of one save attempt derives alike, without talking to the others.

    It changes with torchrun's run id and restart count and with the layout, so the parts
    of an interrupted attempt are never mixed with a later save of the same step.
    """
    key = "|".join((os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                    str(cfg), ptc.fingerprint()))
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def _rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def _write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` so that readers see the whole file or nothing."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def _read_json(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int]:
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    try:
        return json.loads(raw), len(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{path} is not valid JSON ({e}); the file is damaged") from None


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def safetensors_header(entries: list[tuple[str, torch.dtype, int]],
                       metadata: Mapping[str, str]) -> tuple[bytes, list[tuple[int, int]]]:
    """The 8-byte length and JSON header of a safetensors file of 1-D tensors stored in the given
    order, and each tensor's (start, end) byte offsets in the data section."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offsets, off = [], 0
    for key, dtype, n in entries:
        nbytes = n * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": [n], "data_offsets": [off, off + nbytes]}
        offsets.append((off, off + nbytes))
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def _block_bytes(nbytes: int) -> int:
    """Checksum block size of a chunk: about 1/32 of it, a power of two in [4 KiB, 64 KiB]."""
    b = _MIN_BLOCK
    while b < _MAX_BLOCK and b * 32 < nbytes:
        b *= 2
    return b


def _crcs(buf: memoryview, block: int) -> list[int]:
    return [crc32(buf[i : i + block]) for i in range(0, len(buf), block)]


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------------------------------------
# who writes what
# ---------------------------------------------------------------------------------------------
def writer_assignment(ptc: PTC, cfg: ParallelConfig) -> dict[int, list[tuple[str, int, int, int]]]:
    """For every rank, the chunks it writes: ``(tensor, local_offset, start, length)``.

    Each distinct interval is written once, by the holder (DP replica or tied copy) with the
    fewest bytes assigned so far, so writes are balanced. Pure and deterministic: every rank
    computes the same answer, and loaders use it to find chunks without listing files.
    """
    load = np.zeros(cfg.world_size + 1, dtype=np.float64)
    load[-1] = np.inf
    out: dict[int, list[tuple[str, int, int, int]]] = {r: [] for r in range(cfg.world_size)}
    for name, spec in ptc.tensors.items():
        table = ptc.holders(name, cfg)
        if len(table) == 0:
            continue
        c_start, c_end, c_ranks, c_local = holder_classes(name, table)
        for i in range(len(c_start)):
            ranks = c_ranks[i]
            col = int(np.argmin(load[ranks]))
            w = int(ranks[col])
            length = int(c_end[i] - c_start[i])
            load[w] += length * spec.itemsize
            out[w].append((name, int(c_local[i, col]), int(c_start[i]), length))
    return out


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def save(
    url: str,
    ptc: PTC,
    cfg: ParallelConfig,
    rank: int,
    shard: Mapping[str, Any],
    *,
    step: int,
    extra: Any = None,
    keep_last: int | None = None,
    save_id: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SaveResult:
    """Save rank ``rank``'s shard of ``ptc`` under layout ``cfg`` as part of checkpoint ``step``.

    Every rank of the layout calls this with its own shard; the step becomes visible to
    ``load`` only once every rank's part is complete. Rank 0 also writes the manifest, the
    PTC's small objects and ``extra`` (any value ``torch.save`` can store with plain types
    and tensors), and with ``keep_last=K`` removes steps older than the K newest complete ones.
    ``save_id`` (8 hex digits) names this save attempt; every rank must pass the same one.
    The default (``default_save_id``) differs between torchrun restarts and layouts.
    """
    t0 = time.perf_counter()
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ptc.check(cfg)
    cfg.coords(rank)
    fs, root = _fs(url, storage_options)
    save_id = save_id or default_save_id(cfg, ptc)
    if not re.fullmatch(r"[0-9a-f]{8}", save_id):
        raise ValueError(f"save_id must be 8 lowercase hex digits, got {save_id!r}")
    sdir = _step_dir(root, step, save_id)

    expected = ptc.rank_tensors(cfg, rank)
    missing = [n for n in expected if n not in shard]
    if missing:
        raise ValueError(f"rank {rank} under {cfg} must hold {len(expected)} tensors; the shard lacks {missing[:3]}")
    flats: dict[str, torch.Tensor] = {}
    for name in expected:
        t = shard[name]
        want = ptc.local_shape(name, cfg)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: rank {rank}'s shard has shape {tuple(t.shape)}, layout {cfg} needs {want}")
        flats[name] = ptc.to_local_flat(name, t.detach().to("cpu", ptc.tensors[name].dtype))

    fs.makedirs(sdir, exist_ok=True)  # only once the shard is valid: no empty step dir on error
    chunks = writer_assignment(ptc, cfg)[rank]
    head, offsets = safetensors_header(
        [(f"{name}@{start}", ptc.tensors[name].dtype, ln) for name, _, start, ln in chunks],
        {"format": FORMAT, "step": str(step), "rank": str(rank)})
    index_chunks = []
    data_path = f"{sdir}/{_rank_stem(rank)}.safetensors"
    with fs.open(data_path, "wb") as f:  # streamed from the shard's own memory: no serialised copy
        f.write(head)
        for (name, lo, start, ln), (b0, b1) in zip(chunks, offsets):
            view = _as_bytes(flats[name][lo : lo + ln])
            f.write(view)
            block = _block_bytes(b1 - b0)
            index_chunks.append({"tensor": name, "start": start, "length": ln, "offset": len(head) + b0,
                                 "block": block, "crc32": "".join(f"{c:08x}" for c in _crcs(view, block))})
    size = len(head) + (offsets[-1][1] if offsets else 0)
    written = size
    if rank == 0:
        written += write_rank0_meta(fs, sdir, ptc, cfg, shard, step=step, save_id=save_id, extra=extra)
    written += write_index(fs, sdir, rank, size, index_chunks)  # last: marks this part complete
    if rank == 0 and keep_last is not None:
        _prune(fs, root, keep_last)
    result = SaveResult(step, rank, written, len(chunks), time.perf_counter() - t0, sdir)
    log.debug("saved step %d rank %d: %d chunks, %d bytes in %.3fs", step, rank, len(chunks), written,
              result.seconds)
    return result


def write_rank0_meta(fs: fsspec.AbstractFileSystem, sdir: str, ptc: PTC, cfg: ParallelConfig,
                     shard: Mapping[str, Any], *, step: int, save_id: str, extra: Any = None) -> int:
    """Rank 0's part of a save attempt: the small objects, ``extra`` and the manifest. Returns bytes written."""
    objects = {o: shard[o] for o in ptc.objects if o in shard}
    buf = io.BytesIO()
    torch.save({"objects": objects, "extra": extra}, buf)
    _write_atomic(fs, f"{sdir}/objects.pt", buf.getvalue())
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "layout": str(cfg),
                "world_size": cfg.world_size, "save_id": save_id, "created": time.time(),
                "fingerprint": ptc.fingerprint(), "ptc": ptc.to_json()}
    mbytes = json.dumps(manifest).encode()
    _write_atomic(fs, f"{sdir}/manifest.json", mbytes)
    return len(mbytes) + len(buf.getvalue())


def write_index(fs: fsspec.AbstractFileSystem, sdir: str, rank: int, file_size: int,
                chunks: list[dict[str, Any]]) -> int:
    """A rank part's index; written last (atomically): its presence marks the part complete."""
    stem = _rank_stem(rank)
    index = {"format": FORMAT, "rank": rank, "file": f"{stem}.safetensors", "file_size": file_size, "chunks": chunks}
    ibytes = json.dumps(index).encode()
    _write_atomic(fs, f"{sdir}/{stem}.json", ibytes)
    return len(ibytes)


def _prune(fs: fsspec.AbstractFileSystem, root: str, keep_last: int) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    infos = _scan(fs, root)
    complete = sorted({i.step for i in infos if i.complete})
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for info in infos:
        if info.step < oldest_kept:
            log.info("removing checkpoint step %d (keep_last=%d)", info.step, keep_last)
            fs.rm(info.path, recursive=True)


# ---------------------------------------------------------------------------------------------
# listing
# ---------------------------------------------------------------------------------------------
def _scan(fs: fsspec.AbstractFileSystem, root: str) -> list[StepInfo]:
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        m = _STEP_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if not m:
            continue
        step, sid = int(m.group(1)), m.group(2)
        files = fs.ls(entry, detail=True)
        names = {f["name"].rstrip("/").rsplit("/", 1)[-1]: f for f in files}
        done = sum(1 for n in names if re.fullmatch(r"rank-\d{5}\.json", n))
        nbytes = sum(int(f.get("size") or 0) for n, f in names.items() if n.endswith(".safetensors"))
        layout = world = None
        complete = False
        created = 0.0
        if "manifest.json" in names:
            try:
                manifest, _ = _read_json(fs, f"{entry.rstrip('/')}/manifest.json")
                layout = ParallelConfig.parse(manifest["layout"])
                world = int(manifest["world_size"])
                created = float(manifest.get("created", 0.0))
                complete = all(f"{_rank_stem(r)}.json" in names for r in range(world)) and "objects.pt" in names
            except (CheckpointError, KeyError, ValueError):
                complete = False
        out.append(StepInfo(step, complete, layout, world, done, nbytes, sid, entry.rstrip("/"), created))
    # attempts of one step: the newest complete one sorts last
    return sorted(out, key=lambda i: (i.step, i.complete, i.created))


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[StepInfo]:
    """Every step under ``url``, oldest first, with its layout and whether it is complete."""
    fs, root = _fs(url, storage_options)
    return _scan(fs, root)


def _resolve_step(fs: fsspec.AbstractFileSystem, root: str, url: str, step: int | None) -> StepInfo:
    """The save attempt to read: the newest complete attempt of ``step`` (default: of the latest step)."""
    infos = _scan(fs, root)
    complete = [i.step for i in infos if i.complete]
    if step is None:
        if not complete:
            extra = f" ({len(infos)} incomplete steps found)" if infos else ""
            raise CheckpointNotFoundError(f"no complete checkpoint under {url}{extra}")
        step = complete[-1]
    if step not in complete:
        state = "is incomplete" if any(i.step == step for i in infos) else "does not exist"
        raise CheckpointNotFoundError(
            f"checkpoint step {step} under {url} {state}; complete steps: {sorted(set(complete)) or 'none'}"
        )
    return [i for i in infos if i.step == step and i.complete][-1]


def read_manifest(url: str, step: int | None = None, *,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of ``step`` (default: the latest complete step), with ``ptc`` as a PTC."""
    fs, root = _fs(url, storage_options)
    info = _resolve_step(fs, root, url, step)
    manifest, _ = _read_json(fs, f"{info.path}/manifest.json")
    _check_format(manifest, url)
    manifest["ptc"] = PTC.from_json(manifest["ptc"])
    return manifest


def _check_format(manifest: Mapping[str, Any], url: str) -> None:
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{url} is not a tenplex checkpoint of version {VERSION} "
            f"(format={manifest.get('format')!r}, version={manifest.get('version')!r})"
        )


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
class _Reader:
    """Reads verified byte ranges of chunks: ``preadv`` straight into the destination for local
    files, ranged reads otherwise."""

    def __init__(self, fs: fsspec.AbstractFileSystem, sdir: str) -> None:
        self.fs, self.sdir = fs, sdir
        self.local = isinstance(fs, LocalFileSystem)
        self.indexes: dict[int, dict[str, Any]] = {}
        self.handles: dict[int, int] = {}
        self.bytes_read = 0
        self.metadata_bytes = 0
        self.ranges = 0

    def index(self, rank: int) -> dict[str, Any]:
        if rank not in self.indexes:
            path = f"{self.sdir}/{_rank_stem(rank)}.json"
            idx, n = _read_json(self.fs, path)
            self.metadata_bytes += n
            data_path = f"{self.sdir}/{idx['file']}"
            try:
                size = self.fs.size(data_path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{data_path} is missing although its index {path} exists") from None
            if size != idx["file_size"]:
                raise CheckpointCorruptError(
                    f"{data_path} has {size} bytes but its index says {idx['file_size']}: the file is truncated "
                    "or was overwritten; load an earlier step or re-save this one"
                )
            idx["by_key"] = {(c["tensor"], c["start"]): c for c in idx["chunks"]}
            idx["path"] = data_path
            self.indexes[rank] = idx
        return self.indexes[rank]

    def _fd(self, rank: int, path: str) -> int:
        if rank not in self.handles:
            fd = os.open(LocalFileSystem._strip_protocol(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if hasattr(os, "posix_fadvise"):  # no read-ahead past the pieces: read_many prefetches exactly
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.handles[rank] = fd
        return self.handles[rank]

    def read(self, rank: int, name: str, chunk_start: int, a: int, b: int, dtype: torch.dtype,
             itemsize: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [a, b) of the chunk of ``name`` starting at global offset ``chunk_start``,
        verified, into ``out`` (a contiguous 1-D tensor of b - a elements) if given.

        The bytes are read once: local files with one ``preadv`` that scatters the rounded-out
        checksum blocks into small head/tail buffers and ``out`` itself; checksums are
        computed over those buffers in place.
        """
        out, verify = self._fetch(rank, name, chunk_start, a, b, dtype, itemsize, out)
        verify()
        return out

    def _fetch(self, rank: int, name: str, chunk_start: int, a: int, b: int, dtype: torch.dtype,
               itemsize: int, out: torch.Tensor | None) -> tuple[torch.Tensor, Callable[[], None]]:
        """Read without verifying; returns the destination and the check to run before using it."""
        idx = self.index(rank)
        try:
            chunk = idx["by_key"][(name, chunk_start)]
        except KeyError:
            raise CheckpointCorruptError(
                f"{idx['path']}: no chunk of {name} at offset {chunk_start}; the index does not match the manifest"
            ) from None
        block, nbytes = chunk["block"], chunk["length"] * itemsize
        lo = (a * itemsize) // block * block
        hi = min(-(-(b * itemsize) // block) * block, nbytes)
        if out is None:
            out = torch.empty(b - a, dtype=dtype)
        if b <= a:
            return out, _nothing
        body = memoryview(out.view(torch.uint8).numpy()).cast("B")
        head = bytearray(a * itemsize - lo)
        tail = bytearray(hi - b * itemsize)
        segs = [m for m in (memoryview(head), body, memoryview(tail)) if len(m)]
        if self.local:
            got = _preadv_full(self._fd(rank, idx["path"]), segs, chunk["offset"] + lo)
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
            raise CheckpointCorruptError(f"{idx['path']}: short read of {name} ({got} of {hi - lo} bytes)")

        def verify() -> None:
            crcs = chunk["crc32"]
            for k, got_crc in _block_crcs(segs, lo, hi, block):
                if got_crc != int(crcs[8 * k : 8 * k + 8], 16):
                    off = k * block
                    raise CheckpointCorruptError(
                        f"{idx['path']}: checksum mismatch in {name} bytes [{off}, {min(off + block, nbytes)}) of "
                        f"the chunk at offset {chunk_start}: the file is corrupted; load an earlier step"
                    )

        return out, verify

    reports_reads = True  # read_many calls on_read(i) as soon as request i's bytes are in place

    def read_many(self, reqs: list[ReadRequest | None], rank: int = 0,
                  on_read: Callable[[int], None] | None = None) -> None:
        """All of a load's reads. Local files: in file order, with the kernel asked to fetch the
        exact ranges about ``_PREFETCH`` bytes ahead (``POSIX_FADV_WILLNEED``), so the disk works
        while checksums are computed and nothing outside the needed blocks is read. Loading rank
        ``rank`` starts at its own place in the writer order, so ranks of one host that need the
        same parts fetch different ones first and then find the others' in the page cache.
        ``on_read(i)``: called once request i's bytes are in ``out`` (checksums may still be
        running; a mismatch raises here later); it may set ``reqs[i]`` to None."""
        if not self.local or not hasattr(os, "posix_fadvise"):
            for i, r in enumerate(reqs):
                assert r is not None
                self.read(r.writer, r.tensor, r.chunk_start, r.a, r.b, r.dtype, r.itemsize, out=r.out)
                if on_read is not None:
                    on_read(i)
            return
        spans = []
        for i, r in enumerate(reqs):
            assert r is not None
            idx = self.index(r.writer)
            chunk = idx["by_key"].get((r.tensor, r.chunk_start))
            if chunk is None or r.b <= r.a:
                spans.append((r.writer, 0, 0, i))
                continue
            block, nbytes = chunk["block"], chunk["length"] * r.itemsize
            lo = (r.a * r.itemsize) // block * block
            hi = min(-(-(r.b * r.itemsize) // block) * block, nbytes)
            spans.append((r.writer, chunk["offset"] + lo, chunk["offset"] + hi, i))
        writers = sorted({w for w, *_ in spans})
        wanted: dict[int, int] = {}
        for w, lo, hi, _ in spans:
            wanted[w] = wanted.get(w, 0) + hi - lo
        for w in writers:  # a file read (almost) whole: sequential read-ahead, which is faster than
            idx = self.index(w)  # exact prefetching here and reads at most 1 % more than needed
            if wanted[w] >= _WHOLE_FILE * idx["file_size"]:
                os.posix_fadvise(self._fd(w, idx["path"]), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        turn = {w: (i - rank) % len(writers) for i, w in enumerate(writers)}
        spans.sort(key=lambda x: (turn[x[0]], x[1], x[2], x[3]))
        ahead, fetched = 0, 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenplex-verify") as pool:
            checks = []
            for k, (w, lo, hi, i) in enumerate(spans):
                fetched = max(fetched, k)
                while fetched < len(spans) and ahead < _PREFETCH:
                    fw, flo, fhi, _ = spans[fetched]
                    if fhi > flo:
                        os.posix_fadvise(self._fd(fw, self.index(fw)["path"]), flo, fhi - flo,
                                         os.POSIX_FADV_WILLNEED)
                    ahead += fhi - flo
                    fetched += 1
                r = reqs[i]
                assert r is not None
                # checksums in a second thread (the CRC releases the GIL) while the next piece is read
                checks.append(pool.submit(self._fetch(r.writer, r.tensor, r.chunk_start, r.a, r.b, r.dtype,
                                                      r.itemsize, r.out)[1]))
                r = None
                if on_read is not None:
                    on_read(i)
                ahead -= hi - lo
            for c in checks:
                c.result()  # the first corrupt block raises

    def close(self) -> None:
        for fd in self.handles.values():
            os.close(fd)
        self.handles.clear()


_PREFETCH = 64 << 20
_WHOLE_FILE = 0.99  # the share of a file's data a load must need for sequential read-ahead


def _nothing() -> None:
    return None  # bytes a local load asks the kernel to fetch ahead of the reads


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


def _block_crcs(segs: list[memoryview], lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    """(block number, CRC32) of each checksum block of bytes [lo, hi) laid out across ``segs``."""
    out, si, soff, pos = [], 0, 0, lo
    while pos < hi:
        end = min(pos + block, hi)
        crc, need = 0, end - pos
        while need:
            seg = segs[si]
            take = min(need, len(seg) - soff)
            crc = crc32(seg[soff : soff + take], crc)
            soff += take
            need -= take
            if soff == len(seg):
                si, soff = si + 1, 0
        out.append((pos // block, crc))
        pos = end
    return out


def load(
    url: str,
    cfg: ParallelConfig,
    rank: int,
    *,
    step: int | None = None,
    ptc: PTC | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Load rank ``rank``'s shard under layout ``cfg`` from checkpoint ``step`` (default: latest complete).

    Reads only the byte ranges this rank needs (rounded out to checksum blocks) and verifies
    them. ``ptc``: the model the caller expects; a checkpoint of another model raises
    CheckpointMismatchError. Nothing partial is returned: any error raises.
    """
    t0 = time.perf_counter()
    fs, root = _fs(url, storage_options)
    info = _resolve_step(fs, root, url, step)
    step, sdir = info.step, info.path
    manifest, mbytes = _read_json(fs, f"{sdir}/manifest.json")
    reader = _Reader(fs, sdir)
    reader.metadata_bytes += mbytes
    result = load_with_reader(manifest, f"{url} step {step}", cfg, rank, reader, fs, sdir, ptc=ptc, t0=t0)
    stats = result.stats
    log.debug("loaded step %d rank %d under %s: read %d of %d bytes needed in %.3fs", step, rank, cfg,
              stats.bytes_read, stats.bytes_needed, stats.seconds)
    return result


def load_with_reader(manifest: Mapping[str, Any], where: str, cfg: ParallelConfig, rank: int, reader: Any,
                     fs: fsspec.AbstractFileSystem, sdir: str, *, ptc: PTC | None, t0: float) -> LoadResult:
    """Check ``manifest`` against ``ptc`` and ``cfg``, read ``rank``'s shard through ``reader`` and the
    objects from ``sdir``. Shared by ``load`` and tiered recovery, whose readers differ."""
    _check_format(manifest, where)
    saved = PTC.from_json(manifest["ptc"])
    if ptc is not None and ptc.fingerprint() != saved.fingerprint():
        diff = "; ".join(ptc.diff(saved)) or "specs differ"
        raise CheckpointMismatchError(f"checkpoint {where} holds another model than the one requested: {diff}")
    old = ParallelConfig.parse(manifest["layout"])
    saved.check(cfg)
    cfg.coords(rank)
    try:
        shard, needed = read_shard(saved, old, cfg, rank, reader)
        objects, extra = read_objects(fs, sdir, reader)
        shard.update(objects)
    finally:
        reader.close()
    stats = LoadStats(needed, reader.bytes_read, reader.metadata_bytes, reader.ranges, time.perf_counter() - t0)
    return LoadResult(shard, int(manifest["step"]), extra, saved, old, stats)


def read_shard(saved: PTC, old: ParallelConfig, cfg: ParallelConfig, rank: int, reader: Any) -> tuple[dict[str, Any], int]:
    """Rank ``rank``'s tensors under ``cfg`` from chunks written under ``old``, via ``reader``.

    ``reader.read(writer_rank, tensor, chunk_start, a, b, dtype, itemsize)`` returns elements
    [a, b) of a chunk; which file (or tier) it comes from is the reader's business.
    Returns the shard and the real (non-padding) bytes it needed.
    """
    writers = writer_assignment(saved, old)
    rows: dict[str, list[tuple[int, int, int]]] = {}
    for w, chunks in writers.items():
        for name, _, start, ln in chunks:
            rows.setdefault(name, []).append((start, start + ln, w))
    by_tensor: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, r in rows.items():
        arr = np.array(sorted(r), dtype=np.int64)
        by_tensor[name] = (arr[:, 0], arr[:, 1], arr[:, 2])
    locals_: dict[str, torch.Tensor] = {}
    reqs: list[ReadRequest] = []
    needed = 0
    for name in saved.rank_tensors(cfg, rank):
        spec = saved.tensors[name]
        segs = saved.segments(name, cfg, rank)
        local = torch.empty(sum(ln for _, _, ln in segs), dtype=spec.dtype)
        for lo, g, ln in segs:  # every real element is read below; only padding needs zeros
            if g == PAD:
                local[lo : lo + ln] = 0
        real = [(lo, g, ln) for lo, g, ln in segs if g != PAD]
        if real:
            c_start, c_end, c_writer = by_tensor[name]
            q_lo = np.array([s[0] for s in real], dtype=np.int64)
            q_start = np.array([s[1] for s in real], dtype=np.int64)
            q_len = np.array([s[2] for s in real], dtype=np.int64)
            qi, ci, ps, pe = intersect(q_start, q_len, c_start, c_end)
            if int((pe - ps).sum()) != int(q_len.sum()):
                raise CheckpointCorruptError(f"{name}: the checkpoint does not cover every element rank {rank} needs")
            for q, c, s, e in zip(qi.tolist(), ci.tolist(), ps.tolist(), pe.tolist()):
                cs = int(c_start[c])
                dst = int(q_lo[q]) + (s - int(q_start[q]))
                reqs.append(ReadRequest(int(c_writer[c]), name, cs, s - cs, e - cs, spec.dtype, spec.itemsize,
                                        local[dst : dst + (e - s)]))
            needed += int(q_len.sum()) * spec.itemsize
        locals_[name] = local
    if getattr(reader, "reports_reads", False):
        return _read_and_relayout(saved, cfg, rank, reader, reqs, locals_), needed
    if hasattr(reader, "read_many"):
        reader.read_many(reqs, rank=rank)
    else:
        for r in reqs:
            reader.read(r.writer, r.tensor, r.chunk_start, r.a, r.b, r.dtype, r.itemsize, out=r.out)
    reqs.clear()  # drop the views into the flat buffers, so each is freed once reshaped (peak memory)
    return {name: saved.from_local_flat(name, cfg, locals_.pop(name)) for name in list(locals_)}, needed


def _read_and_relayout(saved: PTC, cfg: ParallelConfig, rank: int, reader: Any, reqs: list[ReadRequest],
                       locals_: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Read every request; a tensor split on a dim > 0 is laid out in its natural shape (a strided
    copy: the file holds it split dim first) in a second thread as soon as its last piece is in,
    while later pieces are still being read. Each flat buffer is dropped once its copy is made,
    so at most the tensors in flight exist twice (peak memory)."""
    left: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        left.setdefault(r.tensor, []).append(i)
    count = {name: len(ix) for name, ix in left.items()}
    slots: list[ReadRequest | None] = list(reqs)
    reqs.clear()
    done: dict[str, Any] = {}
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenplex-relayout") as pool:

        def on_read(i: int) -> None:
            name = slots[i].tensor  # type: ignore[union-attr]
            with lock:
                count[name] -= 1
                if count[name]:
                    return
            for j in left.pop(name):
                slots[j] = None  # the flat buffer's last references are the relayout's (and the checksums')
            if saved.relaid(name):
                done[name] = pool.submit(saved.from_local_flat, name, cfg, locals_.pop(name))

        reader.read_many(slots, rank=rank, on_read=on_read)
        out = {name: fut.result() for name, fut in done.items()}
    for name in [n for n in saved.rank_tensors(cfg, rank) if n not in out]:  # cheap reshapes, no copy
        out[name] = saved.from_local_flat(name, cfg, locals_.pop(name))
    return {name: out[name] for name in saved.rank_tensors(cfg, rank)}



@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Elements [a, b) of writer ``writer``'s chunk of ``tensor`` that starts at ``chunk_start``, into ``out``."""

    writer: int
    tensor: str
    chunk_start: int
    a: int
    b: int
    dtype: torch.dtype
    itemsize: int
    out: torch.Tensor


def read_objects(fs: fsspec.AbstractFileSystem, sdir: str, reader: Any) -> tuple[dict[str, Any], Any]:
    """The small objects and ``extra`` rank 0 saved in ``sdir``."""
    raw = fs.cat_file(f"{sdir}/objects.pt")
    reader.metadata_bytes += len(raw)
    try:
        payload = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorruptError(f"{sdir}/objects.pt cannot be read ({e}); the file is damaged") from None
    return dict(payload.get("objects", {})), payload.get("extra")
