"""A load's read plan, as data: which elements of which writer's chunk go where in a rank's buffers.

``plan_reads`` is pure (no I/O): a tuple of frozen ``ReadItem`` s for one rank under a new layout,
from the chunks the saved layout assigned (``writer_assignment``), each carrying its chunk's checksum
block by the format's rule; ``shard_buffers`` gives the flat buffers they fill. Readers
(``part_reader.PartReader``, the tiered readers of ``tenplex.store.recovery``) execute such plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointCorruptError
from ..layout.config import ParallelConfig
from ..layout.ptc import PAD, PTC, Layout
from ..planning.planner import intersect
from .format import (
    VERSION,
    Chunk,
    chunk_block,
    writer_assignment,
)

__all__ = ["ReadItem", "span_of", "plan_reads", "shard_buffers"]

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
