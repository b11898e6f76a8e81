"""Resharding checkpoints on any fsspec URL: safetensors data, JSON manifests, partial reads.

Layout of a checkpoint (see docs/format.md)::

    URL/step-000000000042-<id>/manifest.json          PTC spec, layout, step, objects' digest (rank 0)
    URL/step-000000000042-<id>/objects.pt             small objects and `extra` (rank 0)
    URL/step-000000000042-<id>/rank-00003.safetensors  the chunks rank 3 wrote
    URL/step-000000000042-<id>/rank-00003.json         their index: offsets and CRC32s; written
                                                       last, so its presence marks the part complete

``<id>`` names the save attempt (8 hex digits), so parts of an interrupted attempt are never
mixed with a later save of the same step. Every file is written once, under a temporary name
first, and never replaced: a save that finds its own part already there refuses (the save id
was reused) and marks an attempt it could mix with unusable.

Every chunk is one interval of a tensor's canonical flat order (see ``tenplex.ptc``), stored
as a 1-D safetensors tensor, so any piece a future layout needs is one contiguous byte
range. Replicated intervals are written once, by the least-loaded of their holders. CRC32s
cover fixed blocks of each chunk, so a load verifies exactly the blocks it reads. The
manifest and every rank index end in a SHA-256 digest of their own bytes; the manifest holds
the SHA-256 of ``objects.pt``; every index names its step, save id, rank, layout and model
fingerprint. A load checks all of that before it uses a byte, and falls back to the newest
older step that verifies when a step is damaged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import operator
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from .config import ParallelConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from .planner import holder_classes, intersect
from .ptc import PAD, PTC, Split

try:  # ISA-L's CRC32 (same polynomial and values as zlib's) runs about 8x faster; both release the GIL
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32

__all__ = ["SaveResult", "LoadStats", "LoadResult", "StepInfo", "save", "load", "list_steps", "read_manifest",
           "writer_assignment", "default_save_id", "seal_json", "open_sealed_json", "MAX_STEP"]

log = logging.getLogger(__name__)

FORMAT = "tenplex-checkpoint"
VERSION = 2
MAX_STEP = 10**12
"""Steps are in [0, MAX_STEP): directory names hold 12 digits."""
_STEP_RE = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")
_RANK_JSON_RE = re.compile(r"^rank-(\d{5})\.json$")
_REUSED_PREFIX = "reused-"  # marker files: the attempt's save id was used twice
_MIN_BLOCK, _MAX_BLOCK = 4096, 65536
_BLOCKS = frozenset(1 << k for k in range(12, 17))


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
    saved_layout: ParallelConfig
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
    layout: ParallelConfig | None
    world_size: int | None
    ranks_done: int
    nbytes: int
    save_id: str = ""
    path: str = ""
    created: float = 0.0
    problem: str = ""


# ---------------------------------------------------------------------------------------------
# paths and small I/O helpers
# ---------------------------------------------------------------------------------------------
def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs, root.rstrip("/")


def _step_dir(root: str, step: int, save_id: str) -> str:
    return f"{root}/step-{step:012d}-{save_id}"


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


def default_save_id(cfg: ParallelConfig, ptc: PTC) -> str:
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


def _rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def _local_path(path: str) -> str:
    return LocalFileSystem._strip_protocol(path)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


def _publish(fs: fsspec.AbstractFileSystem, tmp: str, path: str) -> bool:
    """Give ``tmp`` the name ``path`` unless ``path`` exists; never replaces a file. False (and
    ``tmp`` removed) when ``path`` exists. Local files: ``os.link`` (atomic); elsewhere an
    existence check, then a move."""
    if isinstance(fs, LocalFileSystem):
        src, dst = _local_path(tmp), _local_path(path)
        try:
            os.link(src, dst)
        except FileExistsError:
            os.unlink(src)
            return False
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
    tmp = _tmp_name(path)
    with fs.open(tmp, "wb") as f:
        f.write(data)
    return _publish(fs, tmp, path)


# ---------------------------------------------------------------------------------------------
# sealed JSON: a file whose last field is the SHA-256 of every byte before it
# ---------------------------------------------------------------------------------------------
_DIGEST_TAIL = re.compile(rb',"digest":"([0-9a-f]{64})"\}$')


def seal_json(obj: Mapping[str, Any]) -> bytes:
    """``obj`` as compact JSON whose last field ``digest`` is the SHA-256 of the bytes that
    precede it followed by ``}`` (i.e. of the JSON without the digest)."""
    if "digest" in obj:
        raise ValueError("a sealed JSON object cannot have its own 'digest' field")
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if not body.endswith(b"}") or body == b"{}":
        raise ValueError("seal_json needs a non-empty JSON object")
    return body[:-1] + b',"digest":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _parse_json(raw: bytes, path: str) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointCorruptError(f"{path} is not valid JSON ({e}); the file is damaged") from None


def open_sealed_json(raw: bytes, path: str) -> dict[str, Any]:
    """The object of a sealed JSON file (``seal_json``), after checking its digest.

    Raises CheckpointCorruptError when the bytes do not match their digest or are no JSON
    object, and CheckpointError for a checkpoint of format version 1 (no digests).
    """
    m = _DIGEST_TAIL.search(raw)
    if m is None:
        obj = _parse_json(raw, path)
        if isinstance(obj, dict) and obj.get("format") == FORMAT and obj.get("version") == 1 and "digest" not in obj:
            raise CheckpointError(
                f"{path} belongs to a checkpoint of format version 1, which carries no digests and cannot be "
                f"verified; this tenplex reads version {VERSION}: load it with the tenplex that wrote it and "
                "save it again, or start fresh"
            )
        raise CheckpointCorruptError(f"{path} does not end in its SHA-256 digest; the file is damaged or truncated")
    body = raw[: m.start()] + b"}"
    if hashlib.sha256(body).hexdigest().encode() != m.group(1):
        raise CheckpointCorruptError(f"{path}: SHA-256 digest mismatch; the file is damaged")
    obj = _parse_json(raw, path)
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{path} holds no JSON object")
    del obj["digest"]
    return obj


def _read_sealed(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int]:
    """A sealed JSON file, verified, and its size. A missing file is CheckpointCorruptError
    (callers read only files a listing showed)."""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing although its save attempt lists it") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{path} cannot be read ({e})") from None
    return open_sealed_json(raw, path), len(raw)


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
def check_step(step: Any) -> int:
    """``step`` as an int in [0, MAX_STEP), or CheckpointValueError (a ValueError) saying why not."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise CheckpointValueError(f"step must be a non-negative integer, got {step!r}") from None
    if not 0 <= value < MAX_STEP:
        raise CheckpointValueError(f"step must be in [0, {MAX_STEP}) (12 digits in directory names), got {value}")
    return value


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


def _existing(fs: fsspec.AbstractFileSystem, sdir: str) -> set[str]:
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
    _write_once(fs, f"{sdir}/{_REUSED_PREFIX}{_rank_stem(rank)}", note)
    raise CheckpointError(
        f"save attempt {sdir} already holds {', '.join(sorted(found))} of rank {rank}: save id {save_id} was used "
        "by an earlier save (a relaunch with the same run id?). Every existing file was left untouched and the "
        "attempt is marked unusable, since it could now mix two saves; save again with a fresh save_id "
        "(default_save_id derives one per launch once torch.distributed is initialised)"
    )


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
    PTC's small objects and ``extra`` (plain Python values, lists and dicts of them, tensors:
    what ``torch.load(weights_only=True)`` reads back; checked up front on every rank), and
    with ``keep_last=K`` removes steps older than the K newest complete ones.
    ``step``: an int in [0, MAX_STEP). ``save_id`` (8 hex digits) names this save attempt;
    every rank must pass the same one. The default (``default_save_id``) differs between
    launches, restarts and layouts. Files are written once and never replaced: if this
    rank's part of the attempt exists already, the save id was reused and ``save`` raises
    CheckpointError without touching it (see ``_refuse_reuse``).
    """
    t0 = time.perf_counter()
    step = check_step(step)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ptc.check(cfg)
    cfg.coords(rank)
    fs, root = _fs(url, storage_options)
    save_id = save_id or default_save_id(cfg, ptc)
    if not isinstance(save_id, str) or not re.fullmatch(r"[0-9a-f]{8}", save_id):
        raise CheckpointValueError(f"save_id must be 8 lowercase hex digits, got {save_id!r}")
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
    if rank == 0:
        payload = _payload_bytes({o: shard[o] for o in ptc.objects if o in shard}, extra)
    else:  # only rank 0 writes extra, but every rank learns of a value that cannot be stored
        _payload_bytes({}, extra)

    fs.makedirs(sdir, exist_ok=True)  # only once the shard is valid: no empty step dir on error
    stem = _rank_stem(rank)
    own = {f"{stem}.safetensors", f"{stem}.json"} | ({"manifest.json", "objects.pt"} if rank == 0 else set())
    found = own & _existing(fs, sdir)
    if found:
        _refuse_reuse(fs, sdir, rank, save_id, sorted(found))
    chunks = writer_assignment(ptc, cfg)[rank]
    head, offsets = safetensors_header(
        [(f"{name}@{start}", ptc.tensors[name].dtype, ln) for name, _, start, ln in chunks],
        {"format": FORMAT, "step": str(step), "save_id": save_id, "rank": str(rank)})
    index_chunks = []
    data_path = f"{sdir}/{stem}.safetensors"
    tmp = _tmp_name(data_path)
    with fs.open(tmp, "wb") as f:  # streamed from the shard's own memory: no serialised copy
        f.write(head)
        for (name, lo, start, ln), (b0, b1) in zip(chunks, offsets):
            view = _as_bytes(flats[name][lo : lo + ln])
            f.write(view)
            block = _block_bytes(b1 - b0)
            index_chunks.append({"tensor": name, "start": start, "length": ln, "offset": len(head) + b0,
                                 "block": block, "crc32": "".join(f"{c:08x}" for c in _crcs(view, block))})
    if not _publish(fs, tmp, data_path):
        _refuse_reuse(fs, sdir, rank, save_id, [f"{stem}.safetensors"])
    size = len(head) + (offsets[-1][1] if offsets else 0)
    written = size
    fingerprint = ptc.fingerprint()
    if rank == 0:
        written += write_rank0_meta(fs, sdir, ptc, cfg, shard, step=step, save_id=save_id, payload=payload)
    # last: marks this part complete
    written += write_index(fs, sdir, rank, size, index_chunks, step=step, save_id=save_id, cfg=cfg,
                           fingerprint=fingerprint)
    if rank == 0 and keep_last is not None:
        _prune(fs, root, keep_last)
    result = SaveResult(step, rank, written, len(chunks), time.perf_counter() - t0, sdir)
    log.debug("saved step %d rank %d: %d chunks, %d bytes in %.3fs", step, rank, len(chunks), written,
              result.seconds)
    return result


def write_rank0_meta(fs: fsspec.AbstractFileSystem, sdir: str, ptc: PTC, cfg: ParallelConfig,
                     shard: Mapping[str, Any], *, step: int, save_id: str, extra: Any = None,
                     payload: bytes | None = None) -> int:
    """Rank 0's part of a save attempt: the small objects and ``extra`` (``payload``: their
    checked serialisation, when the caller made it), then the manifest, which records the
    objects file's size and SHA-256. Write-once. Returns bytes written."""
    if payload is None:
        payload = _payload_bytes({o: shard[o] for o in ptc.objects if o in shard}, extra)
    if not _write_once(fs, f"{sdir}/objects.pt", payload):
        _refuse_reuse(fs, sdir, 0, save_id, ["objects.pt"])
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "save_id": save_id, "layout": str(cfg),
                "world_size": cfg.world_size, "created": time.time(), "fingerprint": ptc.fingerprint(),
                "objects": {"file": "objects.pt", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
                "ptc": ptc.to_json()}
    mbytes = seal_json(manifest)
    if not _write_once(fs, f"{sdir}/manifest.json", mbytes):
        _refuse_reuse(fs, sdir, 0, save_id, ["manifest.json"])
    return len(mbytes) + len(payload)


def write_index(fs: fsspec.AbstractFileSystem, sdir: str, rank: int, file_size: int, chunks: list[dict[str, Any]],
                *, step: int, save_id: str, cfg: ParallelConfig, fingerprint: str) -> int:
    """A rank part's index, bound to its step, save id, rank, layout and model; written last
    (write-once): its presence marks the part complete."""
    stem = _rank_stem(rank)
    index = {"format": FORMAT, "version": VERSION, "step": step, "save_id": save_id, "rank": rank,
             "layout": str(cfg), "world_size": cfg.world_size, "fingerprint": fingerprint,
             "file": f"{stem}.safetensors", "file_size": file_size, "chunks": chunks}
    ibytes = seal_json(index)
    if not _write_once(fs, f"{sdir}/{stem}.json", ibytes):
        _refuse_reuse(fs, sdir, rank, save_id, [f"{stem}.json"])
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
# manifests and listing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Manifest:
    """A manifest that passed its digest and schema checks and is bound to its directory.

    ``ptc`` is None after a listing, which checks everything but the PTC (the costly part
    for large models); ``full()`` checks that too."""

    raw: dict[str, Any]  # the JSON object, digest removed
    ptc: PTC | None
    layout: ParallelConfig
    nbytes: int
    path: str

    def full(self) -> Manifest:
        """This manifest with its PTC checked (CheckpointCorruptError if it does not pass)."""
        if self.ptc is not None:
            return self
        return verify_manifest(self.raw, self.path, self.nbytes, step=self.step, save_id=self.save_id)

    @property
    def step(self) -> int:
        return self.raw["step"]

    @property
    def save_id(self) -> str:
        return self.raw["save_id"]

    @property
    def world_size(self) -> int:
        return self.raw["world_size"]

    @property
    def created(self) -> float:
        return float(self.raw["created"])

    @property
    def fingerprint(self) -> str:
        return self.raw["fingerprint"]


_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MAX_LAYERS, _MAX_TENSOR_BYTES, _MAX_PAD = 1 << 20, 1 << 48, 1 << 16  # sizes beyond any model: a hostile manifest
_METADATA_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError,
                    RecursionError)


def _is_int(v: Any) -> bool:
    return type(v) is int


def verify_manifest(obj: dict[str, Any], path: str, nbytes: int, *, step: int | None = None,
                    save_id: str | None = None, with_ptc: bool = True) -> Manifest:
    """Check a (digest-verified) manifest object's schema and its binding to the directory
    (``step``, ``save_id`` from the directory name); the PTC too unless ``with_ptc`` is False.
    CheckpointCorruptError says what is wrong; CheckpointError for a format version this
    tenplex does not read."""

    def bad(what: str) -> NoReturn:
        raise CheckpointCorruptError(f"{path}: {what}; the manifest is damaged")

    if obj.get("format") != FORMAT:
        bad(f"format is {obj.get('format')!r}, not {FORMAT!r}")
    version = obj.get("version")
    if not _is_int(version):
        bad(f"version {version!r} is not an integer")
    if version != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version} is not supported; this tenplex reads "
                              f"version {VERSION}")
    try:
        s = obj["step"]
        if not _is_int(s) or not 0 <= s < MAX_STEP:
            bad(f"step {s!r} is not an integer in [0, {MAX_STEP})")
        if step is not None and s != step:
            bad(f"step {s} differs from its directory's step {step}")
        sid = obj["save_id"]
        if not isinstance(sid, str) or not re.fullmatch(r"[0-9a-f]{8}", sid):
            bad(f"save id {sid!r} is not 8 hex digits")
        if save_id is not None and sid != save_id:
            bad(f"save id {sid} differs from its directory's save id {save_id}")
        if not isinstance(obj["layout"], str):
            bad(f"layout {obj['layout']!r} is not a string")
        layout = ParallelConfig.parse(obj["layout"])
        if obj["world_size"] != layout.world_size or not _is_int(obj["world_size"]):
            bad(f"world size {obj['world_size']!r} differs from layout {layout}'s {layout.world_size}")
        created = obj["created"]
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            bad(f"created {created!r} is not a time")
        objects = obj["objects"]
        if (not isinstance(objects, dict) or objects.get("file") != "objects.pt" or not _is_int(objects.get("size"))
                or objects["size"] < 0 or not isinstance(objects.get("sha256"), str)
                or not _SHA256_RE.fullmatch(objects["sha256"])):
            bad(f"objects {objects!r} is not {{file: objects.pt, size, sha256}}")
        if not isinstance(obj["ptc"], dict) or not isinstance(obj["fingerprint"], str):
            bad("ptc is not an object or fingerprint not a string")
        if not with_ptc:
            return Manifest(obj, None, layout, nbytes, path)
        saved = PTC.from_json(obj["ptc"])
        if not 0 <= saved.num_layers <= _MAX_LAYERS:
            bad(f"num_layers {saved.num_layers} is not in [0, {_MAX_LAYERS}]")
        for spec in saved.tensors.values():
            pad = spec.tp.pad_multiple if isinstance(spec.tp, Split) else None
            if spec.nbytes > _MAX_TENSOR_BYTES or (pad is not None and pad > _MAX_PAD):
                bad(f"tensor {spec.name} claims {spec.nbytes} bytes (at most {_MAX_TENSOR_BYTES}) or a vocabulary "
                    f"padding multiple of {pad} (at most {_MAX_PAD})")
        if saved.fingerprint() != obj["fingerprint"]:
            bad(f"fingerprint {obj['fingerprint']!r} is not that of its PTC ({saved.fingerprint()})")
        saved.check(layout)
    except CheckpointError:
        raise
    except _METADATA_ERRORS as e:
        bad(f"{type(e).__name__}: {e}")
    return Manifest(obj, saved, layout, nbytes, path)


def _read_manifest(fs: fsspec.AbstractFileSystem, sdir: str, *, step: int | None = None,
                   save_id: str | None = None, with_ptc: bool = True) -> Manifest:
    """The manifest of save attempt ``sdir``, verified (digest, schema, directory; see ``verify_manifest``)."""
    if step is None or save_id is None:
        m = _STEP_RE.match(sdir.rstrip("/").rsplit("/", 1)[-1])
        if m:
            step, save_id = int(m.group(1)), m.group(2)
    path = f"{sdir}/manifest.json"
    obj, nbytes = _read_sealed(fs, path)
    return verify_manifest(obj, path, nbytes, step=step, save_id=save_id, with_ptc=with_ptc)


_Scanned = tuple[StepInfo, "Manifest | CheckpointError | None"]


def _scan_full(fs: fsspec.AbstractFileSystem, root: str) -> list[_Scanned]:
    """Every save attempt under ``root`` with its verified manifest, or the error verifying it
    raised, or None (no manifest)."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        path = entry.rstrip("/")
        m = _STEP_RE.match(path.rsplit("/", 1)[-1])
        if not m:
            continue
        step, sid = int(m.group(1)), m.group(2)
        try:
            files = fs.ls(path, detail=True)
        except FileNotFoundError:  # removed while listing
            continue
        names = {f["name"].rstrip("/").rsplit("/", 1)[-1]: f for f in files}
        names = {n: f for n, f in names.items() if ".tmp-" not in n}
        done = sum(1 for n in names if _RANK_JSON_RE.match(n))
        nbytes = sum(int(f.get("size") or 0) for n, f in names.items() if n.endswith(".safetensors"))
        layout = world = None
        complete = False
        created = 0.0
        problem = ""
        manifest: Manifest | CheckpointError | None = None
        if any(n.startswith(_REUSED_PREFIX) for n in names):
            problem = (f"save id {sid} was used by two saves ({_REUSED_PREFIX}* marker): its parts may mix them; "
                       "this attempt is never loaded")
        if "manifest.json" in names:
            try:
                manifest = _read_manifest(fs, path, step=step, save_id=sid, with_ptc=False)
                layout, world, created = manifest.layout, manifest.world_size, manifest.created
                complete = (not problem and "objects.pt" in names
                            and all(f"{_rank_stem(r)}.json" in names for r in range(world)))
            except CheckpointError as e:
                problem = problem or str(e)
                manifest = e
        out.append((StepInfo(step, complete, layout, world, done, nbytes, sid, path, created, problem), manifest))
    # attempts of one step: the newest complete one sorts last
    return sorted(out, key=lambda x: (x[0].step, x[0].complete, x[0].created))


def _scan(fs: fsspec.AbstractFileSystem, root: str) -> list[StepInfo]:
    return [info for info, _ in _scan_full(fs, root)]


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[StepInfo]:
    """Every save attempt under ``url``, oldest first, with its layout, whether it is complete
    and, where its manifest exists but it cannot be used, the problem."""
    fs, root = _fs(url, storage_options)
    return _scan(fs, root)


def _candidates(scan: list[_Scanned], url: str, step: int | None) -> list[_Scanned]:
    """The attempts a load considers, newest first: complete ones (with their manifest) and,
    to be reported as skipped, unusable ones whose manifest exists (with the error verifying
    it raised, or None for a reused save id). Raises CheckpointNotFoundError when there is
    nothing to try or report."""
    infos = [i for i, _ in scan]
    pool = [(i, m if i.complete or isinstance(m, CheckpointError) else None) for i, m in scan
            if i.complete or i.problem]
    if step is not None:
        pool = [x for x in pool if x[0].step == step]
    if not pool:
        complete = sorted({i.step for i in infos if i.complete})
        if step is None:
            extra = f" ({len(infos)} incomplete steps found)" if infos else ""
            raise CheckpointNotFoundError(f"no complete checkpoint under {url}{extra}")
        state = "is incomplete" if any(i.step == step for i in infos) else "does not exist"
        raise CheckpointNotFoundError(
            f"checkpoint step {step} under {url} {state}; complete steps: {complete or 'none'}"
        )
    return sorted(pool, key=lambda x: (x[0].step, x[0].complete, x[0].created), reverse=True)


def read_manifest(url: str, step: int | None = None, *,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verified manifest of ``step`` (default: the latest complete step), with ``ptc`` as a PTC.

    Only the manifest is checked here; ``load`` also verifies the data and falls back to an
    older step when it must.
    """
    fs, root = _fs(url, storage_options)
    scan = _scan_full(fs, root)
    problems = []
    for info, manifest in _candidates(scan, url, step):
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
# load
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Binding:
    """What every rank index of one save attempt must agree with: its verified manifest's step,
    save id, layout and model, and the chunks the layout assigns to each writer rank."""

    step: int
    save_id: str
    layout: str
    world_size: int
    fingerprint: str
    itemsize: Mapping[str, int]
    writers: Mapping[int, list[tuple[str, int, int, int]]]

    @classmethod
    def of(cls, manifest: Manifest, writers: Mapping[int, list[tuple[str, int, int, int]]] | None = None) -> Binding:
        saved = manifest.full().ptc
        assert saved is not None
        return cls(manifest.step, manifest.save_id, manifest.raw["layout"], manifest.world_size, manifest.fingerprint,
                   {n: t.itemsize for n, t in saved.tensors.items()},
                   writers if writers is not None else writer_assignment(saved, manifest.layout))


_HEX_RE = re.compile(r"[0-9a-f]*")


def verify_index(idx: Mapping[str, Any], path: str, rank: int, b: Binding) -> dict[tuple[str, int], dict[str, Any]]:
    """Check a (digest-verified) rank index against its binding; returns its chunks by
    (tensor, start). Every chunk must be one the saved layout assigns to ``rank``, with a
    legal block size, a CRC per block and its bytes inside the data file."""

    def bad(what: str) -> NoReturn:
        raise CheckpointCorruptError(f"{path}: {what}; the rank index is damaged or belongs to another save")

    if idx.get("format") != FORMAT or idx.get("version") != VERSION:
        bad(f"format {idx.get('format')!r} version {idx.get('version')!r} is not {FORMAT!r} version {VERSION}")
    for key, want in (("step", b.step), ("save_id", b.save_id), ("rank", rank), ("layout", b.layout),
                      ("world_size", b.world_size), ("fingerprint", b.fingerprint),
                      ("file", f"{_rank_stem(rank)}.safetensors")):
        got = idx.get(key)
        if type(got) is not type(want) or got != want:
            bad(f"{key} is {got!r} but the manifest and directory say {want!r}")
    size = idx.get("file_size")
    if not _is_int(size) or size < 0:
        bad(f"file_size {size!r} is not a byte count")
    chunks = idx.get("chunks")
    expected = {(name, start): ln for name, _, start, ln in b.writers.get(rank, ())}
    if not isinstance(chunks, list) or len(chunks) != len(expected):
        bad(f"it lists {len(chunks) if isinstance(chunks, list) else repr(chunks)} chunks, the saved layout assigns "
            f"{len(expected)} to rank {rank}")
    out: dict[tuple[str, int], dict[str, Any]] = {}
    itemsize, hexdigits = b.itemsize, _HEX_RE.fullmatch
    for c in chunks:  # the hot loop of metadata checks (thousands of chunks per index): kept lean
        try:
            t, st, ln, off, blk, crc = c["tensor"], c["start"], c["length"], c["offset"], c["block"], c["crc32"]
            known = type(t) is str and type(st) is int and type(ln) is int and expected.get((t, st)) == ln
        except (TypeError, KeyError):
            bad(f"chunk {c!r} is not an object with tensor, start, length, offset, block and crc32")
        if not known:
            bad(f"chunk {t!r}@{st!r} of {ln!r} elements is not one the saved layout assigns to rank {rank}")
        nbytes = ln * itemsize[t]
        if type(blk) is not int or blk not in _BLOCKS:
            bad(f"chunk {t}@{st}: block {blk!r} is not a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}]")
        if type(off) is not int or off < 0 or off + nbytes > size:
            bad(f"chunk {t}@{st}: bytes [{off!r}, {off!r}+{nbytes}) are not inside the data file's {size} bytes")
        if type(crc) is not str or len(crc) != 8 * -(-nbytes // blk) or not hexdigits(crc):
            bad(f"chunk {t}@{st}: crc32 must be {8 * -(-nbytes // blk)} hex digits (8 per {blk}-byte block)")
        out[(t, st)] = c
    if len(out) != len(chunks):
        bad("a chunk is listed twice")
    return out


class _Reader:
    """Reads verified byte ranges of chunks: ``preadv`` straight into the destination for local
    files, ranged reads otherwise."""

    def __init__(self, fs: fsspec.AbstractFileSystem, sdir: str, binding: Binding | None = None) -> None:
        self.fs, self.sdir = fs, sdir
        self.local = isinstance(fs, LocalFileSystem)
        self.binding = binding
        self.indexes: dict[int, dict[str, Any]] = {}
        self.handles: dict[int, int] = {}
        self.bytes_read = 0
        self.metadata_bytes = 0
        self.ranges = 0

    def bind(self, binding: Binding) -> None:
        """What this attempt's indexes must agree with; set before the first read."""
        self.binding = binding

    def index(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s index, verified (digest, schema, binding) and checked against its data file's size."""
        if rank not in self.indexes:
            if self.binding is None:
                raise RuntimeError("_Reader.bind() must be called before the first read")
            path = f"{self.sdir}/{_rank_stem(rank)}.json"
            idx, n = _read_sealed(self.fs, path)
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
    allow_meta_change: bool = False,
    storage_options: Mapping[str, Any] | None = None,
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
    """
    t0 = time.perf_counter()
    fs, root = _fs(url, storage_options)
    skipped: list[tuple[int, str, str]] = []
    for info, manifest in _candidates(_scan_full(fs, root), url, step):
        if not isinstance(manifest, Manifest):
            if manifest is not None and not isinstance(manifest, CheckpointCorruptError):
                raise manifest  # a format version this tenplex does not read
            skipped.append((info.step, info.save_id, info.problem))
            continue
        reader = _Reader(fs, info.path)
        reader.metadata_bytes += manifest.nbytes
        try:
            result = load_with_reader(manifest, f"{url} step {info.step}", cfg, rank, reader, [(fs, info.path)],
                                      ptc=ptc, allow_meta_change=allow_meta_change, t0=t0)
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


def check_model(saved: PTC, expected: PTC, where: str, *, allow_meta_change: bool = False) -> None:
    """CheckpointMismatchError unless ``saved`` has ``expected``'s tensors and, unless
    ``allow_meta_change``, its model settings (``meta["model"]``, where both record them)."""
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
    a, b = json.loads(json.dumps(a)), json.loads(json.dumps(b))  # tuples and lists alike
    diffs = [f"{k}: saved {a.get(k)!r}, requested {b.get(k)!r}" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k)]
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {where} was saved with other model settings ({'; '.join(diffs)}); its tensors have the "
            "requested shapes, but training would continue another model: pass allow_meta_change=True to load "
            "it anyway"
        )


def load_with_reader(manifest: Manifest, where: str, cfg: ParallelConfig, rank: int, reader: Any,
                     objects_from: Sequence[tuple[fsspec.AbstractFileSystem, str]], *, ptc: PTC | None,
                     allow_meta_change: bool = False, t0: float) -> LoadResult:
    """Check a verified ``manifest`` against ``ptc`` and ``cfg``, read the objects (from the
    first of ``objects_from``'s directories whose copy matches the manifest), then ``rank``'s
    shard through ``reader``. Shared by ``load`` and tiered recovery, whose readers differ."""
    manifest = manifest.full()
    saved, old = manifest.ptc, manifest.layout
    assert saved is not None
    if ptc is not None:
        check_model(saved, ptc, where, allow_meta_change=allow_meta_change)
    saved.check(cfg)
    cfg.coords(rank)
    writers = writer_assignment(saved, old)
    reader.bind(Binding.of(manifest, writers))
    try:
        objects, extra = read_objects(objects_from, manifest, reader)  # small: fails fast, before the data
        shard, needed = read_shard(saved, old, cfg, rank, reader, writers=writers)
        shard.update(objects)
    finally:
        reader.close()
    stats = LoadStats(needed, reader.bytes_read, reader.metadata_bytes, reader.ranges, time.perf_counter() - t0)
    return LoadResult(shard, manifest.step, extra, saved, old, stats)


def read_shard(saved: PTC, old: ParallelConfig, cfg: ParallelConfig, rank: int, reader: Any,
               writers: Mapping[int, list[tuple[str, int, int, int]]] | None = None) -> tuple[dict[str, Any], int]:
    """Rank ``rank``'s tensors under ``cfg`` from chunks written under ``old``, via ``reader``.

    ``reader.read(writer_rank, tensor, chunk_start, a, b, dtype, itemsize)`` returns elements
    [a, b) of a chunk; which file (or tier) it comes from is the reader's business.
    Returns the shard and the real (non-padding) bytes it needed. ``writers``:
    ``writer_assignment(saved, old)`` when the caller has it.
    """
    if writers is None:
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


def read_objects(sources: Sequence[tuple[fsspec.AbstractFileSystem, str]], manifest: Manifest,
                 reader: Any) -> tuple[dict[str, Any], Any]:
    """The small objects and ``extra`` of a save attempt, from the first directory of ``sources``
    whose ``objects.pt`` has the size and SHA-256 the manifest records (checked before
    unpickling) and holds objects of the saved PTC."""
    want = manifest.raw["objects"]
    objects_of = manifest.full().ptc.objects  # type: ignore[union-attr]
    errors = []
    for fs, sdir in sources:
        path = f"{sdir}/objects.pt"
        try:
            raw = fs.cat_file(path)
        except OSError as e:
            errors.append(f"{path} cannot be read ({e})")
            continue
        reader.metadata_bytes += len(raw)
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
        return dict(payload["objects"]), payload["extra"]
    raise CheckpointCorruptError("; ".join(errors) + "; the objects file is damaged")
