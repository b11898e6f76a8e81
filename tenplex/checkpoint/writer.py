"""Writing checkpoints: one rank's part of a save attempt, incrementally, and ``save``.

``PartWriter`` lays out a rank's part (the chunks ``writer_assignment`` gives it, the
safetensors header), checksums the bytes it is given block by block and publishes the part:
the data file under its final name, rank 0's objects and manifest, then the rank index, whose
presence marks the part complete. ``save`` streams a whole shard through it; the bubble
``StoreWriteTask`` (``tenplex.elastic.bubbles``) writes the same part bucket by bucket in pipeline
bubbles. Every file is written once, under a temporary name first, and never replaced: a
writer that finds its own part already there refuses (the save id was reused) and marks the
attempt unusable.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError, CheckpointValueError, SpecError
from ..layout.models import HPARAMS, ModelSpec
from ..layout.ptc import PTC, Layout
from ..options import with_overrides
from ..urls import url_fs
from . import format as format_mod
from .catalog import local_path, read_manifest_at, scan_attempts
from .format import (
    CRC_GROUP,
    CRC_TABLE,
    FORMAT,
    MANIFEST_NAME,
    OBJECTS_NAME,
    REUSED_PREFIX,
    Chunk,
    chunk_block,
    block_crcs_hex,
    chunks_digest,
    crc_concat,
    crc_seed,
    check_save_id,
    check_step,
    crc32,
    data_name,
    index_name,
    index_object,
    manifest_object,
    parse_step_dir,
    rank_stem,
    safetensors_header,
    seal_json,
    step_dir,
    writer_assignment,
)

__all__ = ["SaveResult", "PartChunk", "PartWriter", "save", "default_save_id", "publish", "prune", "SaveOptions",
           "carry_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    rank: int
    bytes_written: int
    chunks: int
    seconds: float
    path: str = ""  # the save attempt's directory


# ---------------------------------------------------------------------------------------------
# save ids
# ---------------------------------------------------------------------------------------------
_NONCE_KEY = "tenplex/save-nonce"
# id(default process group) -> (a weak reference to the group, its launch nonce). Weak: a strong one kept the
# group alive past destroy_process_group until interpreter exit, where gloo's worker threads, freeing tensors
# without the GIL, were killed by the finalising interpreter (abort, "terminate called without an active exception").
_nonces: dict[int, tuple[Any, str]] = {}
_nonce_lock = threading.Lock()


def _launch_nonce() -> str:
    """A value every rank of this launch shares and another launch does not ("" without a process group).

    The first rank to ask sets a fresh uuid under a key of the default process group's store
    (``compare_set``: first writer wins, everyone reads the same value). No collective is
    involved, so a background save thread may ask. Asked once per process group.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    try:
        pg = dist.distributed_c10d._get_default_group()
        with _nonce_lock:
            hit = _nonces.get(id(pg))
            if hit is not None and hit[0]() is pg:
                return hit[1]
        value = dist.distributed_c10d._get_default_store().compare_set(_NONCE_KEY, "", uuid.uuid4().hex)
        nonce = value.decode() if isinstance(value, bytes) else str(value)
    except Exception as e:  # noqa: BLE001 - a store without compare_set: the environment alone
        log.warning("no launch nonce from the process group's store (%s); save ids depend on the environment only", e)
        return ""
    with _nonce_lock:
        _nonces[id(pg)] = (weakref.ref(pg), nonce)
    return nonce


def default_save_id(cfg: Layout, ptc: PTC) -> str:
    """An id every rank of one save attempt derives alike, without a collective.

    It changes with the launch (a nonce shared through the default process group's store
    when ``torch.distributed`` is initialised), torchrun's run id, restart count and master
    address, the layout and the model, so a relaunch never reuses the id of an earlier
    attempt. Without a process group only the environment distinguishes launches: pass
    ``save_id=`` explicitly where that is not enough.
    """
    env = os.environ
    key = "|".join((env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "0"),
                    env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""), _launch_nonce(), str(cfg),
                    ptc.fingerprint()))
    return hashlib.sha1(key.encode()).hexdigest()[:8]


# ---------------------------------------------------------------------------------------------
# write-once files
# ---------------------------------------------------------------------------------------------
def tmp_name(path: str) -> str:
    """A fresh temporary name next to ``path`` (listings skip names containing ``.tmp-``)."""
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def publish(fs: fsspec.AbstractFileSystem, tmp: str, path: str) -> bool:
    """Give ``tmp`` the name ``path`` unless ``path`` exists; never replaces a file. False (and
    ``tmp`` removed) when ``path`` exists. Local files: ``os.link`` (atomic); elsewhere an
    existence check, then a move."""
    if isinstance(fs, LocalFileSystem):
        src, dst = local_path(tmp), local_path(path)
        try:
            os.link(src, dst)
        except FileExistsError:
            os.unlink(src)
            return False
        except FileNotFoundError:
            raise CheckpointError(
                f"{tmp} or its directory vanished before it was named {path}: another process removed files of "
                "this save attempt while this rank wrote it (a store's GC or a clean-up; every file is left to "
                "its writer)") from None
        except OSError:  # a filesystem without hard links: check, then rename
            if os.path.exists(dst):
                os.unlink(src)
                return False
            os.rename(src, dst)
            return True
        os.unlink(src)
        return True
    fs.invalidate_cache(path.rsplit("/", 1)[0])  # listings cached by the filesystem may predate another writer
    if fs.exists(path):
        fs.rm(tmp)
        return False
    fs.mv(tmp, path)
    return True


def _write_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Write ``data`` as ``path`` so that readers see the whole file or nothing; never replaces
    an existing file (returns False then)."""
    tmp = tmp_name(path)
    with fs.open(tmp, "wb") as f:
        f.write(data)
    return publish(fs, tmp, path)


def _existing_files(fs: fsspec.AbstractFileSystem, sdir: str) -> set[str]:
    """Names of the published files of a save attempt's directory (temporary files left out)."""
    fs.invalidate_cache(sdir)
    try:
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(sdir, detail=False)} - {""}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _refuse_reuse(fs: fsspec.AbstractFileSystem, sdir: str, rank: int, save_id: str, found: Sequence[str]) -> NoReturn:
    """A save found files it was about to write: its save id was used before. Leave every file as
    it is, mark the attempt unusable (this save's other ranks may be adding their parts to the
    earlier attempt's, and an attempt that looks complete may be such a mix), and raise
    CheckpointError."""
    note = json.dumps({"rank": rank, "found": sorted(found), "time": time.time()}).encode()
    _write_once(fs, f"{sdir}/{REUSED_PREFIX}{rank_stem(rank)}", note)
    raise CheckpointError(
        f"save attempt {sdir} already holds {', '.join(sorted(found))} of rank {rank}: save id {save_id} was used "
        "by an earlier save (a relaunch with the same run id?). Every existing file was left untouched and the "
        "attempt is marked unusable, since it could now mix two saves; save again with a fresh save_id "
        "(default_save_id derives one per launch once torch.distributed is initialised)"
    )


# ---------------------------------------------------------------------------------------------
# rank 0's objects
# ---------------------------------------------------------------------------------------------
def _unsafe_part(value: Any, path: str) -> tuple[str, Any] | None:
    """The innermost part of ``value`` that ``torch.load(weights_only=True)`` cannot read back."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _unsafe_part(v, f"{path}[{k!r}]")
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _unsafe_part(v, f"{path}[{i}]")
            if found is not None:
                return found
    try:
        buf = io.BytesIO()
        torch.save(value, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - whatever fails, this part is the culprit
        return path, value
    return None


def _payload_bytes(objects: Mapping[str, Any], extra: Any) -> bytes:
    """The small objects and ``extra`` serialised with ``torch.save``, after checking that they
    load back with ``weights_only=True`` (what ``load`` does): a value that does not would make
    the checkpoint unreadable. CheckpointValueError names the offending value."""
    payload = {"objects": dict(objects), "extra": extra}
    buf = io.BytesIO()
    try:
        torch.save(payload, buf)
        raw = buf.getvalue()
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickling and unpickling fail in many ways
        parts = [("extra", extra), *((f"object {k!r}", v) for k, v in objects.items())]
        found = (f for name, v in parts if (f := _unsafe_part(v, name)) is not None)
        where, bad = next(found, ("the payload", payload))
        raise CheckpointValueError(
            f"{where} = {bad!r} ({type(bad).__module__}.{type(bad).__qualname__}) cannot be stored: loads read it "
            f"back with torch.load(weights_only=True), which refuses it ({type(e).__name__}); convert it to a plain "
            "Python value (float(x), int(x), str(x)), a list or dict of them, or a torch tensor"
        ) from None
    return raw


def _write_rank0_meta(fs: fsspec.AbstractFileSystem, sdir: str, ptc: PTC, cfg: Layout,
                      shard: Mapping[str, Any], *, step: int, save_id: str, extra: Any = None,
                      payload: bytes | None = None) -> int:
    """Rank 0's part of a save attempt: the small objects and ``extra`` (``payload``: their
    checked serialisation, when the caller made it), then the manifest, which records the
    objects file's size and SHA-256. Write-once. Returns bytes written."""
    if payload is None:
        payload = _payload_bytes({o: shard[o] for o in ptc.objects if o in shard}, extra)
    if not _write_once(fs, f"{sdir}/{OBJECTS_NAME}", payload):
        _refuse_reuse(fs, sdir, 0, save_id, [OBJECTS_NAME])
    mbytes = seal_json(manifest_object(ptc, cfg, step=step, save_id=save_id, payload=payload))
    if not _write_once(fs, f"{sdir}/{MANIFEST_NAME}", mbytes):
        _refuse_reuse(fs, sdir, 0, save_id, [MANIFEST_NAME])
    return len(mbytes) + len(payload)


def _write_index(fs: fsspec.AbstractFileSystem, sdir: str, rank: int, file_size: int,
                 chunks: list[dict[str, Any]] | int, *, step: int, save_id: str, cfg: Layout, fingerprint: str,
                 data: tuple[int, str] | None = None) -> int:
    """A rank part's index, bound to its step, save id, rank, layout and model; written last
    (write-once): its presence marks the part complete."""
    ibytes = seal_json(index_object(rank, file_size, chunks, step=step, save_id=save_id, cfg=cfg,
                                    fingerprint=fingerprint, data=data))
    if not _write_once(fs, f"{sdir}/{index_name(rank)}", ibytes):
        _refuse_reuse(fs, sdir, rank, save_id, [index_name(rank)])
    return len(ibytes)


# ---------------------------------------------------------------------------------------------
# one rank's part
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PartChunk:
    """A chunk of a rank's part: ``length`` elements of ``tensor`` from global offset ``start``,
    at ``local`` in the rank's canonical flat shard; ``offset``: its bytes' place in the data
    file (header included); ``block``: its checksum block size."""

    tensor: str
    local: int
    start: int
    length: int
    offset: int
    nbytes: int
    block: int


class PartWriter:
    """One rank's part of a save attempt, written incrementally.

    ``begin()`` creates the attempt's directory and refuses (``_refuse_reuse``) when this
    rank's files exist already. The data goes to a temporary file (``tmp``): either streamed
    (``stream``) or positioned (``write_at`` on a pre-sized local file from ``open_local``);
    both checksum each whole block as it passes. ``assigned``: this rank's chunks
    (``writer_assignment(ptc, cfg)[rank]``) when the caller has them. ``publish()`` then names the data file,
    writes rank 0's objects and manifest and, last, the rank index.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, sdir: str, ptc: PTC, cfg: Layout, rank: int, *,
                 step: int, save_id: str, assigned: Sequence[Chunk] | None = None) -> None:
        self.fs, self.sdir, self.ptc, self.cfg, self.rank = fs, sdir, ptc, cfg, rank
        self.step, self.save_id = step, save_id
        if assigned is None:  # the caller may have it: writer_assignment(ptc, cfg)[rank]
            assigned = writer_assignment(ptc, cfg)[rank]
        self.assigned = list(assigned)
        self.version = format_mod.VERSION  # read here: tests write older versions by setting it
        table = self.version >= 4  # versions 4 and 5: the block CRCs in the data file, last (``part_chunks``)
        blocks = [chunk_block(ptc.tensors[name], ln * ptc.tensors[name].itemsize, self.version)
                  for name, _, _, ln in assigned]
        sizes = [ln * ptc.tensors[name].itemsize for name, _, _, ln in assigned]
        groups = CRC_GROUP if self.version == 4 else 0  # version 4 also stores a word per group of blocks
        words = sum(-(-n // blk) + (-(-n // (blk * groups)) if groups else 0) for n, blk in zip(sizes, blocks))
        self.header, offsets = safetensors_header(
            [*((f"{name}@{start}", ptc.tensors[name].dtype, ln) for name, _, start, ln in assigned),
             *([(CRC_TABLE, torch.uint8, 4 * words)] if table else [])],
            {"format": FORMAT, "step": str(step), "save_id": save_id, "rank": str(rank)})
        base = len(self.header)
        self.chunks = tuple(PartChunk(name, lo, start, ln, base + b0, b1 - b0, blk)
                            for (name, lo, start, ln), (b0, b1), blk in zip(assigned, offsets, blocks))
        self.crc_offset = base + (offsets[-1][0] if table else offsets[-1][1] if offsets else 0)
        self.size = base + (offsets[-1][1] if offsets else 0)
        self.path = f"{sdir}/{data_name(rank)}"
        self.tmp = tmp_name(self.path)
        self.seed = crc_seed(step, save_id, rank) if table else 0
        self.crcs: list[list[int]] = [[0] * (-(-c.nbytes // c.block)) for c in self.chunks]
        self.group_crcs: list[dict[int, int]] = [{} for _ in self.chunks]
        """Version 4: the CRC32 of every group (``CRC_GROUP`` blocks) that one ``checksum`` call saw
        whole, taken over its bytes (one C call); the others are combined from their blocks'."""
        self.chained: list[tuple[int, int]] = [(0, self.seed) for _ in self.chunks]
        """Version 5: per chunk, the byte position its prefix CRC is known up to, and that CRC: a
        ``checksum`` call that starts there (calls in order, the usual case) continues the chain."""
        self.restarts: list[set[int]] = [set() for _ in self.chunks]
        """Version 5: the blocks where a ``checksum`` call out of order restarted the chain from the
        seed; ``crc_table`` corrects the words from each (``crc_concat``'s shift)."""

    def begin(self) -> None:
        """Create the attempt's directory; refuse when this rank's files are there already."""
        self.fs.makedirs(self.sdir, exist_ok=True)
        own = {data_name(self.rank), index_name(self.rank)} | (
            {MANIFEST_NAME, OBJECTS_NAME} if self.rank == 0 else set())
        found = own & _existing_files(self.fs, self.sdir)
        if found:  # the save id was used before: never write into that attempt
            _refuse_reuse(self.fs, self.sdir, self.rank, self.save_id, sorted(found))

    def checksum(self, i: int, a: int, view: memoryview) -> None:
        """Record the CRC32s of bytes [a, a + len(view)) of chunk ``i`` (``a`` on a block
        boundary; the range ends on one or at the chunk's end)."""
        block, crcs = self.chunks[i].block, self.crcs[i]
        seed = self.seed
        if self.version >= 5:  # prefix words: the chain from the chunk's start (or a restart) on
            at, crc = self.chained[i]
            if at != a:
                self.restarts[i].add(a // block)
                crc = seed
            for pos in range(a, a + len(view), block):
                crc = crcs[pos // block] = crc32(view[pos - a : pos - a + block], crc)
            self.chained[i] = (a + len(view), crc)
            return
        for pos in range(a, a + len(view), block):
            crcs[pos // block] = crc32(view[pos - a : pos - a + block], seed)
        if self.version >= 4:
            span, end = CRC_GROUP * block, a + len(view)
            groups = self.group_crcs[i]
            for g in range(-(-a // span), -(-end // span)):
                g_end = min((g + 1) * span, self.chunks[i].nbytes)
                if g_end <= end:
                    groups[g] = crc32(view[g * span - a : g_end - a], seed)

    def stream(self, flats: Mapping[str, torch.Tensor]) -> None:
        """Write the whole part to ``tmp`` in order, from each tensor's canonical flat shard
        (``PTC.to_local_flat``): streamed from the shard's own memory, no serialised copy."""
        with self.fs.open(self.tmp, "wb") as f:
            f.write(self.header)
            for i, c in enumerate(self.chunks):
                view = memoryview(flats[c.tensor][c.local : c.local + c.length].contiguous().view(torch.uint8)
                                  .numpy()).cast("B")
                f.write(view)
                self.checksum(i, 0, view)
            if self.version >= 4:
                f.write(self.crc_table())

    def open_local(self) -> int:
        """Create ``tmp`` (a local file) at its full size with the header written; returns its descriptor."""
        fd = os.open(local_path(self.tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, self.size)
        os.pwrite(fd, self.header, 0)
        return fd

    def write_at(self, fd: int, i: int, a: int, view: memoryview) -> None:
        """Write ``view`` as bytes [a, a + len(view)) of chunk ``i`` into ``fd`` (from ``open_local``), checksummed."""
        os.pwrite(fd, view, self.chunks[i].offset + a)
        self.checksum(i, a, view)

    def crc_table(self) -> bytes:
        """The data file's last entry (``CRC_TABLE``), big-endian words in file order. Version 5: every
        block's prefix word (``prefix_words``); version 4: every block CRC32, then every group's
        (``CRC_GROUP`` blocks), combined from its blocks' (``crc_concat``)."""
        seed = self.seed
        if self.version >= 5:
            words = []
            for c, crcs, restarts in zip(self.chunks, self.crcs, self.restarts):
                if restarts:
                    crcs = _rechain(crcs, restarts, c.block, c.nbytes, seed)
                words.extend(w ^ seed for w in crcs)
            return struct.pack(f">{len(words)}I", *words)
        words = [w for crcs in self.crcs for w in crcs]
        for c, crcs, whole in zip(self.chunks, self.crcs, self.group_crcs):
            for g in range(0, len(crcs), CRC_GROUP):
                if g // CRC_GROUP in whole:
                    words.append(whole[g // CRC_GROUP])
                    continue
                acc = crcs[g]
                for k in range(g + 1, min(g + CRC_GROUP, len(crcs))):
                    acc = crc_concat(acc, crcs[k], min(c.block, c.nbytes - k * c.block), seed)
                words.append(acc)
        return struct.pack(f">{len(words)}I", *words)

    def finish_local(self, fd: int) -> None:
        """Write the CRC table into ``fd`` (from ``open_local``) once every chunk is written."""
        if self.version >= 4:
            os.pwrite(fd, self.crc_table(), self.crc_offset)

    def publish(self, *, objects: Mapping[str, Any] | None = None, payload: bytes | None = None) -> int:
        """Name the data file, write rank 0's objects (``payload``, else serialised from
        ``objects``) and manifest, and last the index, which makes the part visible. Returns the
        bytes of the files written besides the data file."""
        if not publish(self.fs, self.tmp, self.path):
            _refuse_reuse(self.fs, self.sdir, self.rank, self.save_id, [data_name(self.rank)])
        written = 0
        if self.rank == 0:
            written += _write_rank0_meta(self.fs, self.sdir, self.ptc, self.cfg, objects or {}, step=self.step,
                                         save_id=self.save_id, payload=payload)
        if self.version < 4:  # versions 2 and 3: the chunks and their CRCs (hex) in the index
            return written + _write_index(
                self.fs, self.sdir, self.rank, self.size,
                [{"tensor": c.tensor, "start": c.start, "length": c.length, "offset": c.offset, "block": c.block,
                  "crc32": block_crcs_hex(crcs)} for c, crcs in zip(self.chunks, self.crcs)],
                step=self.step, save_id=self.save_id, cfg=self.cfg, fingerprint=self.ptc.fingerprint())
        return written + _write_index(self.fs, self.sdir, self.rank, self.size, len(self.chunks), step=self.step,
                                      save_id=self.save_id, cfg=self.cfg, fingerprint=self.ptc.fingerprint(),
                                      data=(len(self.header), chunks_digest(self.assigned)))


def _rechain(crcs: list[int], restarts: set[int], block: int, nbytes: int, seed: int) -> list[int]:
    """Version 5: the prefix CRCs of a chunk whose chain restarted from ``seed`` at blocks ``restarts``
    (checksum calls out of order): from each restart on, the known prefix's difference to the seed is
    carried through the bytes since the restart and XORed in (``crc_concat``'s rule)."""
    out, carry = list(crcs), 0
    for k in range(len(crcs)):
        if k in restarts:
            carry = (out[k - 1] ^ seed) if k else 0
        if carry:
            n = min(block, nbytes - k * block)
            carry = crc_concat(carry ^ seed, seed, n, seed) ^ seed  # the difference shifted through n bytes
            out[k] ^= carry
    return out


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """How ``save`` keeps steps and names the attempt: ``keep_last`` (remove steps older than the K
    newest complete ones; None keeps all), ``save_id`` (8 hex digits naming the attempt, the same on
    every rank; None: ``default_save_id``), ``storage_options`` (for the URL's fsspec filesystem)."""

    keep_last: int | None = None
    save_id: str | None = None
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise CheckpointValueError(f"keep_last must be >= 1, got {self.keep_last}")


def save(
    url: str,
    ptc: PTC,
    cfg: Layout,
    rank: int,
    shard: Mapping[str, Any],
    *,
    step: int,
    extra: Any = None,
    options: SaveOptions | None = None,
    **overrides: Any,
) -> SaveResult:
    """Save rank ``rank``'s shard of ``ptc`` under layout ``cfg`` as part of checkpoint ``step``.

    Every rank of the layout calls this with its own shard; the step becomes visible to
    ``load`` only once every rank's part is complete. Rank 0 also writes the manifest, the
    PTC's small objects and ``extra`` (plain Python values, lists and dicts of them, tensors:
    what ``torch.load(weights_only=True)`` reads back; checked up front on every rank), and
    with ``keep_last=K`` removes steps older than the K newest complete ones.
    ``step``: an int in [0, MAX_STEP). ``save_id`` (8 hex digits) names this save attempt;
    every rank must pass the same one. The default (``default_save_id``) differs between
    launches, restarts and layouts. A model description (``ptc.meta["model"]``) that leaves
    hyperparameters or the source config unstated is completed from the newest step under ``url``
    when that step holds the same model (``carry_model``): an imported model's configuration
    survives the job's own saves. Files are written once and never replaced: if this
    rank's part of the attempt exists already, the save id was reused and ``save`` raises
    CheckpointError without touching it (see ``_refuse_reuse``). ``options`` (:class:`SaveOptions`:
    ``keep_last``, ``save_id``, ``storage_options``), or its fields as keywords.
    """
    t0 = time.perf_counter()
    step = check_step(step)
    o = with_overrides(options or SaveOptions(), overrides, "save")
    keep_last, save_id, storage_options = o.keep_last, o.save_id, o.storage_options
    ptc.check(cfg)
    cfg.coords(rank)
    fs, root = url_fs(url, storage_options)
    save_id = check_save_id(save_id or default_save_id(cfg, ptc))

    expected = ptc.rank_tensors(cfg, rank)
    missing = [n for n in expected if n not in shard]
    if missing:
        raise CheckpointValueError(
            f"rank {rank} under {cfg} must hold {len(expected)} tensors; the shard lacks {missing[:3]}")
    flats = _LocalFlats(ptc, cfg, rank)
    for name in expected:
        t = shard[name]
        want = ptc.local_shape(name, cfg, rank)
        if tuple(t.shape) != want:
            raise CheckpointValueError(
                f"{name}: rank {rank}'s shard has shape {tuple(t.shape)}, layout {cfg} needs {want}")
        flats.add(name, t.detach().to("cpu", ptc.tensors[name].dtype))
    if rank == 0:
        payload = _payload_bytes({o: shard[o] for o in ptc.objects if o in shard}, extra)
        ptc = carry_model(fs, root, ptc)  # only rank 0 writes the manifest, which holds the description
    else:  # only rank 0 writes extra, but every rank learns of a value that cannot be stored
        _payload_bytes({}, extra)
        payload = None

    part = PartWriter(fs, step_dir(root, step, save_id), ptc, cfg, rank, step=step, save_id=save_id)
    part.begin()  # only once the shard is valid: no empty step dir on error
    part.stream(flats)
    written = part.size + part.publish(payload=payload)
    if rank == 0 and keep_last is not None:
        prune(fs, root, keep_last)
    result = SaveResult(step, rank, written, len(part.chunks), time.perf_counter() - t0, part.sdir)
    log.debug("saved step %d rank %d: %d chunks, %d bytes in %.3fs", step, rank, len(part.chunks), written,
              result.seconds)
    return result


_CARRIED: dict[tuple[str, str], dict[str, Any] | None] = {}  # (checkpoint URL, saving description) -> carried one
_CARRIED_MAX = 256


def carry_model(fs: fsspec.AbstractFileSystem, root: str, ptc: PTC) -> PTC:
    """``ptc`` with its model description completed by the newest save attempt's under ``root``.

    A ``ModelSpec`` description that leaves hyperparameters (norm epsilon, RoPE) or the source
    config unstated takes them from the newest attempt whose manifest verifies, when that attempt
    holds the same model (``ModelSpec.carried``): a job whose PTC was built from the dimensions
    keeps an imported model's configuration, step after step. Nothing is carried from another
    model, and a description that states everything is saved as it is. The answer is remembered
    per URL and description, so a job lists its directory once, not at every save.
    """
    mine = ptc.meta.get("model")
    if not isinstance(mine, dict):
        return ptc
    try:
        spec = ModelSpec.from_json(mine)
    except (SpecError, TypeError, KeyError):
        return ptc
    key = (fs.unstrip_protocol(root), json.dumps(mine, sort_keys=True))
    if key not in _CARRIED:
        if len(_CARRIED) >= _CARRIED_MAX:
            _CARRIED.clear()
        _CARRIED[key] = _newest_model(fs, root, spec)
    carried = _CARRIED[key]
    if carried is None:
        return ptc
    return PTC(ptc.tensors.values(), num_layers=ptc.num_layers, objects=ptc.objects,
               meta={**ptc.meta, "model": json.loads(json.dumps(carried))})  # the remembered one stays as it is


def _newest_model(fs: fsspec.AbstractFileSystem, root: str, spec: ModelSpec) -> dict[str, Any] | None:
    """``spec`` completed by the description of the newest attempt under ``root`` whose manifest
    verifies (JSON), or None when that holds another model, nothing new, or there is none."""
    if spec.source_config is not None and spec.norm_eps is not None:
        return None  # an imported model's own description: states everything there is to carry
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return None
    attempts = sorted((p, e.rstrip("/")) for e in entries if (p := parse_step_dir(e)))
    for _, path in reversed(attempts):
        try:
            saved = read_manifest_at(fs, path, with_ptc=True).ptc
        except (CheckpointError, OSError):  # no manifest (yet), or a damaged one: the next older attempt
            continue
        try:
            done = spec.carried(ModelSpec.from_json(saved.meta["model"]))
        except (AttributeError, SpecError, TypeError, KeyError):  # no model description there
            done = None
        if done is None or done == spec:
            return None
        log.info("the model description of %s carries over to the new save: %s", path,
                 ", ".join(n for n in (*HPARAMS, "source_config") if getattr(spec, n) is None
                           and getattr(done, n) is not None))
        return done.to_json()
    return None


class _LocalFlats(Mapping[str, torch.Tensor]):
    """Every local tensor's canonical flat shard (``PTC.to_local_flat``) as ``PartWriter.stream`` asks
    for them: a tensor whose canonical order is its natural one is a view of its memory; one that
    needs a copy (split on a dim > 0, panel order) is converted when first asked for and only the
    latest such copy is kept (the part's chunks come tensor by tensor), so a save holds at most
    one relaid copy at a time, not one per tensor."""

    def __init__(self, ptc: PTC, cfg: Layout, rank: int) -> None:
        self.ptc, self.cfg, self.rank = ptc, cfg, rank
        self.tensors: dict[str, torch.Tensor] = {}
        self.last: tuple[str, torch.Tensor] | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        self.tensors[name] = t.contiguous().reshape(-1) if not self.ptc.relaid(name) else t

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.ptc.relaid(name):
            return self.tensors[name]
        if self.last is None or self.last[0] != name:
            self.last = None  # drop the previous copy first
            self.last = (name, self.ptc.to_local_flat(name, self.tensors[name], self.cfg, self.rank))
        return self.last[1]

    def __iter__(self) -> Any:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def prune(fs: fsspec.AbstractFileSystem, root: str, keep_last: int) -> None:
    """Remove the save attempts of steps older than the ``keep_last`` newest complete ones, except
    an incomplete one begun after every kept one (its manifest is newer): a save under way, after a
    rollback to an older step, whose other ranks may still write into it (removed under them, their
    parts found their temporary files gone; issue 29 item 6)."""
    if keep_last < 1:
        raise CheckpointValueError(f"keep_last must be >= 1, got {keep_last}")
    infos = [info for info, _ in scan_attempts(fs, root)]
    complete = sorted({i.step for i in infos if i.complete})
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    kept_since = min(i.created for i in infos if i.complete and i.step >= oldest_kept)
    for info in infos:
        if info.step < oldest_kept and (info.complete or info.created <= kept_since):
            log.info("removing checkpoint step %d (keep_last=%d)", info.step, keep_last)
            fs.rm(info.path, recursive=True)
