"""The checkpoint format, in one place: names, the data file's layout, checksums and metadata schemas.

Every other module (the checkpoint writer and readers, the host stores, the store view,
bubble snapshots) takes the format from here: the step directory and rank part names, the
format tag and version, the safetensors header, the CRC block rule, the sealed-JSON rule,
the manifest and rank index schemas with their verification, and which rank writes which
chunk. Layout of a save attempt (see docs/format.md)::

    URL/step-000000000042-<id>/manifest.json          PTC spec, layout, step, objects' digest (rank 0)
    URL/step-000000000042-<id>/objects.pt             small objects and `extra` (rank 0)
    URL/step-000000000042-<id>/rank-00003.safetensors  the chunks rank 3 wrote
    URL/step-000000000042-<id>/rank-00003.json         their index: offsets and CRC32s; written
                                                       last, so its presence marks the part complete

No I/O here: the writer (``writer.py``) and the readers (``catalog.py``, ``part_reader.py``, ``load.py``) do that.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointValueError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC, Layout, Panels, SegmentTable, Split, TensorSpec
from ..layout.state_layout import StateLayout
from ..planning.planner import holder_classes

try:  # ISA-L's CRC32 (same polynomial and values as zlib's) runs about 8x faster; both release the GIL
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32

__all__ = ["FORMAT", "VERSION", "READ_VERSIONS", "MAX_STEP", "MANIFEST_NAME", "OBJECTS_NAME", "REUSED_PREFIX",
           "STEP_DIR_RE", "RANK_INDEX_RE", "PART_NAME_RE", "SAVE_ID_RE", "BLOCK_SIZES", "MIN_BLOCK", "MAX_BLOCK",
           "ROW_BLOCK_MIN", "ROW_BLOCK_SHARE", "Chunk", "crc32", "step_dir", "parse_step_dir",
           "rank_stem", "data_name", "index_name", "part_files", "check_step", "check_save_id", "seal_json",
           "open_sealed_json", "safetensors_header", "block_bytes", "panel_block", "row_block",
           "chunk_block", "block_crcs_hex", "CRC_TABLE", "CRC_GROUP", "crc_seed", "crc_concat", "chunks_digest",
           "part_chunks", "crc_spans", "PANEL_BLOCK_MIN", "PANEL_BLOCK_SHARE", "prefix_words",
           "writer_assignment", "manifest_object", "index_object", "Manifest",
           "verify_manifest", "Binding", "verify_index"]

FORMAT = "tenplex-checkpoint"
"""The format tag every manifest, rank index and safetensors header carries."""
VERSION = 5
"""The version this tenplex writes. Version 3 changed only the checksum block rule (``chunk_block``):
blocks of whole canonical rows (or of 1/2, 1/4, 1/8 of a row), at least ``ROW_BLOCK_MIN`` bytes,
instead of at least 4 KiB. Version 4 (same block rule) moved the block CRCs out of the rank index:
they are binary words at the end of the data file (``CRC_TABLE``), seeded with the part's binding
(``crc_seed``), and a load reads only the words of the blocks it reads; the index lists no chunks
(their offsets, blocks and words follow from ``writer_assignment``: ``part_chunks``), only their
count and digest (``chunks_digest``). Version 5: the table holds *prefix* words, one per block boundary
(``prefix_words``): any run of whole blocks is checked with the two words at its ends, whatever its
length, so blocks of panel-ordered tensors can be one panel row (``PANEL_BLOCK_MIN``) and a row cut
reads no byte it does not need."""
READ_VERSIONS = frozenset({2, 3, 4, 5})
"""The versions this tenplex reads (version 2: the block rule ``chunk_block(..., version=2)``; 2 and 3:
the chunks and their CRCs in the index)."""
CRC_TABLE = "__tenplex_crc32__"
"""Versions 4 and 5: the data file's last safetensors entry (``U8``, 4-byte big-endian words). Version 4:
the block CRC32s of its chunks, chunk after chunk in file order, then the CRC32s of their groups of
``CRC_GROUP`` blocks (the last group of a chunk may be shorter), chunk after chunk. Version 5: one prefix
word per block, chunk after chunk (``prefix_words``)."""
CRC_GROUP = 8
"""Version 4 (read only): blocks per group word. A load checks whole groups inside a piece by their group word and
only the blocks at its ends by theirs: about 1/8 of the CRC words for long pieces."""
MAX_STEP = 10**12
"""Steps are in [0, MAX_STEP): directory names hold 12 digits."""
MANIFEST_NAME, OBJECTS_NAME = "manifest.json", "objects.pt"
REUSED_PREFIX = "reused-"
"""Marker files ``reused-rank-NNNNN``: a save found its part already there (its save id was used twice)."""
STEP_DIR_RE = re.compile(r"step-([0-9]{12})-([0-9a-f]{8})")
"""A save attempt's directory name: step (12 digits) and save id (8 hex digits). Use ``.fullmatch``
(``$`` would allow a trailing newline)."""
RANK_INDEX_RE = re.compile(r"rank-([0-9]{5})\.json")
"""A rank part's index name (use ``.fullmatch``); its presence marks the part complete."""
PART_NAME_RE = re.compile(r"manifest\.json|objects\.pt|rank-[0-9]{5}\.(?:json|safetensors)")
"""Names of the files of a save attempt (use ``.fullmatch``)."""
SAVE_ID_RE = re.compile(r"[0-9a-f]{8}")
MIN_BLOCK, MAX_BLOCK = 4096, 65536
BLOCK_SIZES = frozenset(1 << k for k in range(12, 17))
"""The byte rule's checksum block sizes (``block_bytes``): powers of two in [MIN_BLOCK, MAX_BLOCK]."""
ROW_BLOCK_MIN = 256
"""Version 3: the smallest row block (``row_block``) of a chunk; its CRC (8 hex digits in the index)
costs 3 % of the block's bytes at most, and a piece that ends inside a block reads at most one
block beyond it."""
PANEL_BLOCK_MIN = 32
"""Version 5: the smallest row block of a panel-ordered tensor (at hidden sizes >= 64 in float32, one
panel row): a row cut (FSDP2 over any number of ranks) then starts and ends on block boundaries in each
of the 8 panels it crosses. Its words cost nothing to read but the two at each piece's ends; stored,
one 4-byte word per block (at most 1/8 of such narrow tensors' bytes, 1/64 from 256-byte rows on)."""
PANEL_BLOCK_SHARE = 4096
"""Version 5: a panel-ordered chunk's blocks hold at least 1/``PANEL_BLOCK_SHARE`` of it (whole panel
rows, at most ``MAX_BLOCK``), so a save computes at most a few thousand prefix words a chunk (one
CRC call each: on a 1.5 GB state, one-row blocks cost seconds) while a row cut's end blocks stay
within about 1/2048 of the chunk per panel."""
ROW_BLOCK_SHARE = 256
"""Version 3: a chunk is cut into about this many row blocks at most (larger chunks: larger blocks,
still whole rows, up to ``MAX_BLOCK``), so its index entry stays small."""

Chunk = tuple[str, int, int, int]
"""One chunk a rank writes: ``(tensor, local_offset, start, length)`` in elements."""


# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------
def _step_dir_name(step: int, save_id: str) -> str:
    """The directory name of save attempt ``save_id`` of ``step``."""
    return f"step-{step:012d}-{save_id}"


def step_dir(root: str, step: int, save_id: str) -> str:
    """The directory of save attempt ``save_id`` of ``step`` under ``root``."""
    return f"{root}/{_step_dir_name(step, save_id)}"


def parse_step_dir(name: str) -> tuple[int, str] | None:
    """``(step, save_id)`` of a step directory's name (its last path component), or None."""
    m = STEP_DIR_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return (int(m.group(1)), m.group(2)) if m else None


def rank_stem(rank: int) -> str:
    """``rank-NNNNN``: the stem of rank ``rank``'s part files."""
    return f"rank-{rank:05d}"


def data_name(rank: int) -> str:
    """The name of rank ``rank``'s data file."""
    return f"{rank_stem(rank)}.safetensors"


def index_name(rank: int) -> str:
    """The name of rank ``rank``'s index file."""
    return f"{rank_stem(rank)}.json"


def part_files(rank: int) -> list[str]:
    """The files rank ``rank`` writes into a save attempt, in the order a replica needs them."""
    own = [data_name(rank), index_name(rank)]
    return [MANIFEST_NAME, OBJECTS_NAME, *own] if rank == 0 else own


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


def check_save_id(save_id: Any) -> str:
    """``save_id`` if it is 8 lowercase hex digits, else CheckpointValueError."""
    if not isinstance(save_id, str) or not SAVE_ID_RE.fullmatch(save_id):
        raise CheckpointValueError(f"save_id must be 8 lowercase hex digits, got {save_id!r}")
    return save_id


# ---------------------------------------------------------------------------------------------
# sealed JSON: a file whose last field is the SHA-256 of every byte before it
# ---------------------------------------------------------------------------------------------
_DIGEST_TAIL = re.compile(rb',"digest":"([0-9a-f]{64})"\}$')


def seal_json(obj: Mapping[str, Any]) -> bytes:
    """``obj`` as compact JSON whose last field ``digest`` is the SHA-256 of the bytes that
    precede it followed by ``}`` (i.e. of the JSON without the digest)."""
    if "digest" in obj:
        raise CheckpointValueError("a sealed JSON object cannot have its own 'digest' field")
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if not body.endswith(b"}") or body == b"{}":
        raise CheckpointValueError("seal_json needs a non-empty JSON object")
    return body[:-1] + b',"digest":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


def _no_constants(name: str) -> NoReturn:
    raise CheckpointValueError(f"{name} is not JSON")  # caught below: the file is damaged


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
                f"verified; this tenplex reads versions {sorted(READ_VERSIONS)}: load it with the tenplex that wrote it and "
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


# ---------------------------------------------------------------------------------------------
# the data file: safetensors of 1-D chunks, CRC32 per block
# ---------------------------------------------------------------------------------------------
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


def block_bytes(nbytes: int) -> int:
    """Checksum block size of a chunk of ``nbytes``: about 1/32 of it, a power of two in [4 KiB, 64 KiB]."""
    b = MIN_BLOCK
    while b < MAX_BLOCK and b * 32 < nbytes:
        b *= 2
    return b


def panel_block(spec: TensorSpec) -> int | None:
    """Checksum block size of every chunk of a panel-ordered ``spec`` (R rows, panels of W columns):
    ``k`` rows of a panel, ``k`` the largest power of two dividing ``ceil(R / 8)``, halved while the
    block exceeds 64 KiB and doubled while it is under 4 KiB. A chunk starts at a row of a panel, and
    the row cuts of 2, 4 and 8 even shards (``R`` a multiple of 8) are multiples of ``R / 8``, so
    loading such a shard from a chunk saved under such a split reads no byte outside it (a block of
    a fixed byte size straddles those cuts: up to two blocks more per piece, 4-7 % of a load).
    None (the byte rule, ``block_bytes``) when ``spec`` is not panel-ordered or a panel row exceeds
    64 KiB."""
    if spec.panels is None:
        return None
    row = _panel_row(spec)
    if not 0 < row <= MAX_BLOCK:
        return None
    eighth = -(-spec.shape[0] // 8)
    k = (eighth & -eighth) or 1  # no rows: any block (the chunks are empty)
    while k > 1 and k * row > MAX_BLOCK:
        k //= 2
    while k * row < MIN_BLOCK:
        k *= 2
    return k * row


def _panel_row(spec: TensorSpec) -> int:
    """Bytes of a panel-ordered ``spec``'s row of a panel; unequal panels: of the gcd of their widths
    (blocks need not align with their rows: a piece reads at most a block more at each end)."""
    assert isinstance(spec.tp, Panels)
    edges = spec.tp.bounds(spec.shape[1])
    return math.gcd(*(b - a for a, b in zip(edges, edges[1:]))) * math.prod(spec.shape[2:]) * spec.itemsize


def _row_bytes(spec: TensorSpec) -> int:
    """Bytes of one row of ``spec``'s canonical order: what follows one index of its leading
    dimension (a panel's row for panel order, else the split dim's or dim 0's slab). A 0-d
    tensor's row is its one element."""
    if not spec.shape:
        return spec.itemsize
    if spec.panels is not None:
        return _panel_row(spec)
    lead = spec.shape[spec.split_dim or 0]
    return (math.prod(spec.shape) // lead if lead else 0) * spec.itemsize


def row_block(spec: TensorSpec, nbytes: int, version: int = VERSION) -> int | None:
    """Version 3: the checksum block of a chunk of ``nbytes`` of ``spec``: ``k`` whole canonical rows
    (``k`` the smallest power of two giving at least ``max(ROW_BLOCK_MIN, nbytes / ROW_BLOCK_SHARE)``
    bytes, halved while over ``MAX_BLOCK``; panel order: at least ``ROW_BLOCK_MIN`` whatever the
    chunk's size), or, for tensors not in panel order whose rows hold twice ``least =
    max(ROW_BLOCK_MIN, nbytes / (8 * ROW_BLOCK_SHARE))`` bytes or more, the smallest of ``1/2``,
    ``1/4``, ``1/8`` of a row that divides it into whole elements and keeps ``least`` bytes (at most
    about 2048 blocks a chunk). Chunks of row-split layouts start at a row, so
    a load that splits rows anywhere (uneven FSDP2 shards of any count, TP row shards) reads no byte of
    a block outside its rows beyond the ``k - 1`` rows of its end blocks, and a column half, quarter or
    eighth of row-major rows reads its bytes only. None (the byte rule, ``block_bytes``) for empty
    rows or rows over ``MAX_BLOCK``."""
    row = _row_bytes(spec)
    if not 0 < row <= MAX_BLOCK:
        return None
    if spec.panels is not None:  # a row cut crosses each panel of a chunk: small blocks whatever its size
        target = (max(PANEL_BLOCK_MIN, min(nbytes // PANEL_BLOCK_SHARE, MAX_BLOCK)) if version >= 5
                  else ROW_BLOCK_MIN)  # (TP column cuts fall on panels)
    else:
        target = max(ROW_BLOCK_MIN, min(nbytes // ROW_BLOCK_SHARE, MAX_BLOCK))
        least = max(ROW_BLOCK_MIN, min(nbytes // (8 * ROW_BLOCK_SHARE), MAX_BLOCK))
        if row >= 2 * least:  # a row's half, quarter or eighth: a TP column shard of row-ordered rows
            elems, parts = row // spec.itemsize, 1
            while parts < 8 and elems % (2 * parts) == 0 and row // (2 * parts) >= least:
                parts *= 2
            return row // parts
    k = 1
    while k * row < target:
        k *= 2
    while k > 1 and k * row > MAX_BLOCK:
        k //= 2
    return k * row


def chunk_block(spec: TensorSpec, nbytes: int, version: int = VERSION) -> int:
    """The checksum block size of a chunk of ``nbytes`` of ``spec`` under format ``version``: version
    3 ``row_block``, version 2 ``panel_block`` (panel-ordered tensors), else ``block_bytes``. Writers
    use it, indexes must record it."""
    if version >= 3:
        return row_block(spec, nbytes, version) or block_bytes(nbytes)
    return panel_block(spec) or block_bytes(nbytes)


def block_crcs_hex(crcs: list[int]) -> str:
    """A chunk's block CRC32s as a version 2/3 index stores them: 8 hex digits each."""
    return "".join(f"{c:08x}" for c in crcs)


def crc_seed(step: int, save_id: str, rank: int) -> int:
    """Versions 4 and 5: the start value of every block CRC32 of rank ``rank``'s part of attempt ``save_id``
    of ``step``, so a data file (with its CRC table) of another attempt or rank fails its checks."""
    return crc32(f"{FORMAT}/{step}/{save_id}/{rank}".encode())


def crc_concat(a: int, b: int, nbytes_b: int, seed: int) -> int:
    """The CRC32 from ``seed`` of bytes ``A + B`` given ``a`` and ``b``, those of ``A`` and of ``B``
    (``nbytes_b`` bytes) from ``seed``: ``B``'s CRC with ``a ^ seed`` carried through its length."""
    zeros = _ZEROS[:nbytes_b] if nbytes_b <= MAX_BLOCK else bytes(nbytes_b)
    return b ^ crc32(zeros, a ^ seed) ^ crc32(zeros, 0)


_ZEROS = memoryview(bytes(MAX_BLOCK))


def crc_spans(nbytes: int, block: int, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Version 4: which CRC words check bytes [lo, hi) of a chunk of ``nbytes`` (``lo`` on a block
    boundary, ``hi`` on one or the chunk's end): blocks ``[k0, k1)`` by their own words, groups
    ``[g0, g1)`` of ``CRC_GROUP`` blocks by theirs, then blocks ``[t0, t1)``; in that byte order."""
    k0, k1, last = lo // block, -(-hi // block), -(-nbytes // block)
    g0 = -(-k0 // CRC_GROUP)
    g1 = -(-k1 // CRC_GROUP) if k1 == last else k1 // CRC_GROUP
    if g1 <= g0:
        return (k0, k1), (g0, g0), (k1, k1)
    return (k0, g0 * CRC_GROUP), (g0, g1), (min(g1 * CRC_GROUP, k1), k1)


def prefix_words(block: int, lo: int, hi: int) -> tuple[int | None, int]:
    """Version 5: the CRC table words (relative to a chunk's first) that check bytes [lo, hi) of the
    chunk (``lo`` on a block boundary, ``hi`` on one or the chunk's end): the word of the boundary at
    ``lo`` (None at the chunk's start: the part's seed) and that at ``hi``. Word ``j`` is
    ``crc32(chunk[:(j + 1) * block], seed) ^ seed`` (the prefix up to the end of block ``j``), so the
    bytes check when ``crc32(bytes, start) == end ^ seed`` with ``start`` the first word ``^ seed``."""
    k0, k1 = lo // block, -(-hi // block)
    return (k0 - 1 if k0 else None), k1 - 1


def chunks_digest(assigned: list[Chunk]) -> str:
    """Versions 4 and 5: the SHA-256 (hex) of a rank's chunk list, recorded in its index so a reader whose
    ``writer_assignment`` differs from the writer's refuses the part instead of misreading it."""
    return hashlib.sha256("\n".join(f"{t}@{s}+{n}" for t, _, s, n in assigned).encode()).hexdigest()


def part_chunks(assigned: list[Chunk], specs: Mapping[str, TensorSpec], data_offset: int,
                version: int = VERSION) -> tuple[list[dict[str, Any]], int, int]:
    """Versions 4 and 5: a part's chunk entries derived from its assignment (the writer stores them in
    order from ``data_offset``): ``tensor, start, length, offset, block``, ``crc_at`` and (version 4)
    ``group_at``, the table's word of its first block and of its first group; with the table's byte
    offset and its word count."""
    out, off, words = [], data_offset, 0
    rule: dict[tuple[str, int], int] = {}
    for t, _, st, ln in assigned:
        spec = specs[t]
        nbytes = ln * spec.itemsize
        blk = rule.get((t, nbytes))
        if blk is None:
            blk = rule[(t, nbytes)] = chunk_block(spec, nbytes, version)
        out.append({"tensor": t, "start": st, "length": ln, "offset": off, "block": blk, "crc_at": words})
        off += nbytes
        words += -(-nbytes // blk)
    if version >= 5:  # prefix words only: no group words
        return out, off, words
    for c in out:
        c["group_at"] = words
        words += -(-c["length"] * specs[c["tensor"]].itemsize // (c["block"] * CRC_GROUP))
    return out, off, words


# ---------------------------------------------------------------------------------------------
# who writes what
# ---------------------------------------------------------------------------------------------
def writer_assignment(ptc: PTC, cfg: Layout) -> dict[int, list[Chunk]]:
    """For every rank, the chunks it writes: ``(tensor, local_offset, start, length)``.

    Each distinct interval is written once, by the holder (DP replica or tied copy) with the
    fewest bytes assigned so far, so writes are balanced. Pure and deterministic: every rank
    computes the same answer, and loaders use it to find chunks without listing files.
    """
    load = [0] * cfg.world_size  # bytes assigned so far (Python ints and lists: every rank of every
    out: dict[int, list[Chunk]] = {r: [] for r in range(cfg.world_size)}  # load runs this, numpy per class cost 40 ms)
    # Holder tables are cached and shared by tensors of one geometry (shape, order, placement: the
    # layers' weights and their optimizer states), so their classes are computed once per table:
    # 7-8 distinct tables among the 444 tensors of a 12-layer model, 30 of 56 ms of this function.
    classes: dict[int, tuple[SegmentTable, list[tuple[int, int, list[int], list[int]]]]] = {}
    for name, spec in ptc.tensors.items():
        table = ptc.holders(name, cfg)
        if len(table) == 0:
            continue
        known = classes.get(id(table))
        if known is None or known[0] is not table:
            c_start, c_end, c_ranks, c_local = holder_classes(name, table)
            known = classes[id(table)] = (table, list(zip(c_start.tolist(), c_end.tolist(), c_ranks.tolist(),
                                                          c_local.tolist())))
        itemsize, chunks = spec.itemsize, out
        for start, end, ranks, local in known[1]:
            col = 0  # the first holder with the fewest bytes (holders are listed first, -1 pads the rest)
            for j in range(1, len(ranks)):
                if ranks[j] >= 0 and load[ranks[j]] < load[ranks[col]]:
                    col = j
            w = ranks[col]
            load[w] += (end - start) * itemsize
            chunks[w].append((name, local[col], start, end - start))
    return out


# ---------------------------------------------------------------------------------------------
# the manifest and the rank indexes
# ---------------------------------------------------------------------------------------------
def manifest_object(ptc: PTC, cfg: Layout, *, step: int, save_id: str, payload: bytes) -> dict[str, Any]:
    """The manifest of a save attempt (before sealing); ``payload``: the objects file's bytes. A
    torch-native state dict's layout (``StateLayout``) is stored whole under ``state_layout``."""
    obj = {"format": FORMAT, "version": VERSION, "step": step, "save_id": save_id, "layout": str(cfg),
           "world_size": cfg.world_size, "created": time.time(), "fingerprint": ptc.fingerprint(),
           "objects": {"file": OBJECTS_NAME, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
           "ptc": ptc.to_json()}
    if isinstance(cfg, StateLayout):
        obj["state_layout"] = cfg.to_json()
    return obj


def index_object(rank: int, file_size: int, chunks: list[dict[str, Any]] | int, *, step: int, save_id: str,
                 cfg: Layout, fingerprint: str, data: tuple[int, str] | None = None) -> dict[str, Any]:
    """A rank part's index (before sealing), bound to its step, save id, rank, layout and model.
    Version 4 and later (``chunks`` a count): ``data`` is the data section's offset and the chunk
    list's digest (``chunks_digest``), stored instead of the chunks."""
    obj = {"format": FORMAT, "version": VERSION, "step": step, "save_id": save_id, "rank": rank,
           "layout": str(cfg), "world_size": cfg.world_size, "fingerprint": fingerprint,
           "file": data_name(rank), "file_size": file_size, "chunks": chunks}
    if isinstance(chunks, int):
        data_offset, digest = data if data is not None else (None, None)
        obj |= {"data_offset": data_offset, "chunks_sha256": digest}
    return obj


@dataclass(frozen=True, slots=True)
class Manifest:
    """A manifest that passed its digest and schema checks and is bound to its directory.

    ``ptc`` is None after a listing, which checks everything but the PTC (the costly part
    for large models); ``full()`` checks that too."""

    raw: dict[str, Any]  # the JSON object, digest removed
    ptc: PTC | None
    layout: Layout
    nbytes: int
    path: str

    def full(self) -> Manifest:
        """This manifest with its PTC checked (CheckpointCorruptError if it does not pass)."""
        if self.ptc is not None:
            return self
        return verify_manifest(self.raw, self.path, self.nbytes, step=self.step, save_id=self.save_id,
                               layout=self.layout)

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
                    save_id: str | None = None, with_ptc: bool = True, layout: Layout | None = None) -> Manifest:
    """Check a (digest-verified) manifest object's schema and its binding to the directory
    (``step``, ``save_id`` from the directory name); the PTC too unless ``with_ptc`` is False.
    ``layout``: the layout an earlier check of this same object derived (``Manifest.full`` after a
    listing), not parsed and digested again. CheckpointCorruptError says what is wrong;
    CheckpointError for a format version this tenplex does not read."""

    def bad(what: str) -> NoReturn:
        raise CheckpointCorruptError(f"{path}: {what}; the manifest is damaged")

    if obj.get("format") != FORMAT:
        bad(f"format is {obj.get('format')!r}, not {FORMAT!r}")
    version = obj.get("version")
    if not _is_int(version):
        bad(f"version {version!r} is not an integer")
    if version not in READ_VERSIONS:
        raise CheckpointError(f"{path}: checkpoint format version {version} is not supported; this tenplex reads "
                              f"versions {sorted(READ_VERSIONS)}")
    try:
        s = obj["step"]
        if not _is_int(s) or not 0 <= s < MAX_STEP:
            bad(f"step {s!r} is not an integer in [0, {MAX_STEP})")
        if step is not None and s != step:
            bad(f"step {s} differs from its directory's step {step}")
        sid = obj["save_id"]
        if not isinstance(sid, str) or not SAVE_ID_RE.fullmatch(sid):
            bad(f"save id {sid!r} is not 8 hex digits")
        if save_id is not None and sid != save_id:
            bad(f"save id {sid} differs from its directory's save id {save_id}")
        if not isinstance(obj["layout"], str):
            bad(f"layout {obj['layout']!r} is not a string")
        if layout is not None:
            pass  # derived from this object by an earlier check (Manifest.full)
        elif "state_layout" in obj:
            layout = StateLayout.from_json(obj["state_layout"])
            if str(layout) != obj["layout"]:
                bad(f"layout {obj['layout']!r} is not that of its state_layout ({layout})")
        else:
            layout = ParallelConfig.parse(obj["layout"])
        if obj["world_size"] != layout.world_size or not _is_int(obj["world_size"]):
            bad(f"world size {obj['world_size']!r} differs from layout {layout}'s {layout.world_size}")
        created = obj["created"]
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            bad(f"created {created!r} is not a time")
        objects = obj["objects"]
        if (not isinstance(objects, dict) or objects.get("file") != OBJECTS_NAME or not _is_int(objects.get("size"))
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
        if isinstance(layout, StateLayout):
            layout.check(saved, complete=True)
        else:
            saved.check(layout)
    except CheckpointError:
        raise
    except _METADATA_ERRORS as e:
        bad(f"{type(e).__name__}: {e}")
    return Manifest(obj, saved, layout, nbytes, path)


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
    writers: Mapping[int, list[Chunk]]
    specs: Mapping[str, TensorSpec] = field(default_factory=dict)
    """The saved tensors' specs, for the block rule (``chunk_block``) of their chunks."""
    version: int = VERSION
    """The attempt's format version (its manifest's): its indexes must have it, and its block rule."""

    @classmethod
    def of(cls, manifest: Manifest, writers: Mapping[int, list[Chunk]] | None = None) -> Binding:
        saved = manifest.full().ptc
        assert saved is not None
        return cls(manifest.step, manifest.save_id, manifest.raw["layout"], manifest.world_size, manifest.fingerprint,
                   {n: t.itemsize for n, t in saved.tensors.items()},
                   writers if writers is not None else writer_assignment(saved, manifest.layout),
                   saved.tensors, manifest.raw["version"])


_HEX_RE = re.compile(r"[0-9a-f]*")


def verify_index(idx: Mapping[str, Any], path: str, rank: int, b: Binding) -> dict[tuple[str, int], dict[str, Any]]:
    """Check a (digest-verified) rank index against its binding; returns its chunks by
    (tensor, start). Every chunk must be one the saved layout assigns to ``rank``, with a
    legal block size, a CRC per block and its bytes inside the data file."""

    def bad(what: str) -> NoReturn:
        raise CheckpointCorruptError(f"{path}: {what}; the rank index is damaged or belongs to another save")

    if idx.get("format") != FORMAT or idx.get("version") != b.version or type(idx.get("version")) is not int:
        bad(f"format {idx.get('format')!r} version {idx.get('version')!r} is not {FORMAT!r} version {b.version} "
            "(its manifest's)")
    for key, want in (("step", b.step), ("save_id", b.save_id), ("rank", rank), ("layout", b.layout),
                      ("world_size", b.world_size), ("fingerprint", b.fingerprint), ("file", data_name(rank))):
        got = idx.get(key)
        if type(got) is not type(want) or got != want:
            bad(f"{key} is {got!r} but the manifest and directory say {want!r}")
    size = idx.get("file_size")
    if not _is_int(size) or size < 0:
        bad(f"file_size {size!r} is not a byte count")
    if b.version >= 4:  # versions 4 and 5
        return _verify_index_v4(idx, rank, b, size, bad)
    chunks = idx.get("chunks")
    expected = {(name, start): ln for name, _, start, ln in b.writers.get(rank, ())}
    if not isinstance(chunks, list) or len(chunks) != len(expected):
        bad(f"it lists {len(chunks) if isinstance(chunks, list) else repr(chunks)} chunks, the saved layout assigns "
            f"{len(expected)} to rank {rank}")
    out: dict[tuple[str, int], dict[str, Any]] = {}
    itemsize, hexdigits, specs, version = b.itemsize, _HEX_RE.fullmatch, b.specs, b.version
    rule: dict[tuple[str, int], int] = {}  # chunk_block by (tensor, bytes): chunks of one tensor share a few
    for c in chunks:  # the hot loop of metadata checks (thousands of chunks per index): kept lean
        try:
            t, st, ln, off, blk, crc = c["tensor"], c["start"], c["length"], c["offset"], c["block"], c["crc32"]
            known = type(t) is str and type(st) is int and type(ln) is int and expected.get((t, st)) == ln
        except (TypeError, KeyError):
            bad(f"chunk {c!r} is not an object with tensor, start, length, offset, block and crc32")
        if not known:
            bad(f"chunk {t!r}@{st!r} of {ln!r} elements is not one the saved layout assigns to rank {rank}")
        nbytes = ln * itemsize[t]
        want = rule.get((t, nbytes))
        if want is None:
            want = rule[(t, nbytes)] = chunk_block(specs[t], nbytes, version)
        if type(blk) is not int or blk != want:
            bad(f"chunk {t}@{st}: block {blk!r} is not the format's {want} for {nbytes} bytes of this tensor "
                f"(version {version})")
        if type(off) is not int or off < 0 or off + nbytes > size:
            bad(f"chunk {t}@{st}: bytes [{off!r}, {off!r}+{nbytes}) are not inside the data file's {size} bytes")
        if type(crc) is not str or len(crc) != 8 * -(-nbytes // blk) or not hexdigits(crc):
            bad(f"chunk {t}@{st}: crc32 must be {8 * -(-nbytes // blk)} hex digits (8 per {blk}-byte block)")
        out[(t, st)] = c
    if len(out) != len(chunks):
        bad("a chunk is listed twice")
    return out


def _verify_index_v4(idx: Mapping[str, Any], rank: int, b: Binding, size: int,
                     bad: Callable[[str], NoReturn]) -> dict[tuple[str, int], dict[str, Any]]:
    """``verify_index`` of versions 4 and 5: the chunk count and digest are those of the saved layout's
    assignment, and the chunks (``part_chunks``) and their CRC table fill the data file exactly."""
    assigned = b.writers.get(rank, [])
    count, digest, base = idx.get("chunks"), idx.get("chunks_sha256"), idx.get("data_offset")
    if not _is_int(count) or count != len(assigned):
        bad(f"it counts {count!r} chunks, the saved layout assigns {len(assigned)} to rank {rank}")
    if not isinstance(digest, str) or digest != chunks_digest(assigned):
        bad(f"chunks_sha256 {digest!r} is not that of the chunks the saved layout assigns to rank {rank}")
    if not _is_int(base) or base < 8:
        bad(f"data_offset {base!r} is not a byte offset after the safetensors header's length")
    chunks, crc_offset, words = part_chunks(assigned, b.specs, base, b.version)
    if crc_offset + 4 * words != size:
        bad(f"data_offset {base} + {crc_offset - base} chunk bytes + {4 * words} CRC bytes ({words} blocks) is not "
            f"the data file's {size} bytes")
    seed = crc_seed(b.step, b.save_id, rank)
    out = {}
    for c in chunks:
        c["seed"], c["crc_table"], c["prefix"] = seed, crc_offset, b.version >= 5
        out[(c["tensor"], c["start"])] = c
    return out
