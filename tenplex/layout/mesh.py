"""Named device meshes and DTensor placements, reduced to intervals in canonical flat order (#17).

A job's devices form a named mesh (``NamedMesh``: any dims in any order, e.g. HSDP + TP as
``dp_replicate=2,dp_shard=2,tp=2``) and a tensor's partitioning is one placement per mesh dim
(``Shard``, ``Replicate``, ``StridedShard``), with exactly the semantics of torch DTensor:

* mesh dims are applied left to right, each to the extent the previous ones left;
* ``Shard(d)`` splits the current extent of dim ``d`` like ``torch.chunk``: chunk size
  ``ceil(n / k)``, so later coordinates may get fewer rows or none (``chunk_range``);
* ``StridedShard(d, sf)`` (torch's ``_StridedShard``, which FSDP2 puts on its mesh dim when TP
  also shards dim ``d``) first chunks the current extent into ``sf`` pieces, chunks each piece
  into ``k``, and coordinate ``c`` holds chunk ``c`` of every piece, concatenated in piece order.

FSDP2 over TP really stores the TP chunk first and its own chunk of that (``right_to_left=True``),
which differs from ``StridedShard``'s arithmetic when the split dim does not divide evenly.

So a coordinate holds, per tensor dim, an ordered list of global index ranges (``local_box``),
and flattening its local tensor in the tensor's canonical order (``canonical_order``) gives the
same kind of segments ``(local_offset, global_offset, length)`` as ``tenplex.layout.ptc`` uses for
``ParallelConfig`` layouts (``segments``, ``holder_table``): one representation for both.

Pure: no I/O and no torch.distributed (``tenplex.native.dtensor`` converts real DTensors).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import numpy as np

from ..errors import ConfigError, LayoutError, SpecError
from .config import MAX_WORLD_SIZE
from .ptc import SegmentTable, dtype_from_str, dtype_to_str

__all__ = [
    "NamedMesh",
    "Shard",
    "Replicate",
    "StridedShard",
    "MeshPlacement",
    "TensorPlacement",
    "chunk_range",
    "local_box",
    "panel_pieces",
    "local_shape",
    "canonical_order",
    "segments",
    "holder_table",
    "box_segments",
]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---------------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NamedMesh:
    """A named device mesh: ``dims`` are ``(name, size)`` pairs, outermost first.

    Ranks are numbered row-major over the sizes, exactly as
    ``DeviceMesh(device_type, torch.arange(world).reshape(sizes), mesh_dim_names=names)`` numbers
    them: the last dim varies fastest.
    """

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        try:
            dims = tuple((name, size) for name, size in self.dims)
        except (TypeError, ValueError):
            raise ConfigError(f"a mesh is a sequence of (name, size) pairs, got {self.dims!r}") from None
        if not dims:
            raise ConfigError("a mesh needs at least one dimension, got none")
        for name, size in dims:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ConfigError(f"mesh dim name {name!r} is not an identifier (letters, digits, '_')")
            if not _positive_int(size):
                raise ConfigError(f"mesh dim {name} must have a positive integer size, got {size!r}")
        names = [n for n, _ in dims]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"mesh dim names must be unique, {dupes} repeat in {dims}")
        world = math.prod(s for _, s in dims)
        if world > MAX_WORLD_SIZE:
            raise ConfigError(
                f"mesh {'*'.join(f'{n}={s}' for n, s in dims)} = {world} ranks, more than the {MAX_WORLD_SIZE} "
                "(2**18) a layout may have: check the sizes"
            )
        object.__setattr__(self, "dims", dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def index(self, name: str) -> int:
        """Position of the mesh dim called ``name``."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError(f"mesh {self} has no dim {name!r}; its dims are {list(self.names)}") from None

    def size(self, name: str) -> int:
        return self.dims[self.index(name)][1]

    def coords(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of ``rank`` (row-major, last dim fastest)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is outside [0, {self.world_size}) for mesh {self}")
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(int(rank), size)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: Sequence[int]) -> int:
        """The rank at mesh coordinate ``coords`` (inverse of ``coords``)."""
        coords = tuple(coords)
        if len(coords) != self.ndim or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < s
            for c, s in zip(coords, self.sizes)
        ):
            raise ConfigError(f"coordinate {coords} does not fit mesh {self} (sizes {self.sizes})")
        rank = 0
        for c, size in zip(coords, self.sizes):
            rank = rank * size + int(c)
        return rank

    @classmethod
    def parse(cls, text: str) -> NamedMesh:
        """``"dp_shard=2,tp=2"`` -> the mesh (inverse of ``str``)."""
        dims = []
        for part in str(text).split(","):
            name, eq, size = part.partition("=")
            if not eq or not size.strip().isdigit():
                raise ConfigError(f"mesh {text!r}: {part.strip()!r} is not NAME=SIZE (e.g. 'dp_shard=2,tp=2')")
            dims.append((name.strip(), int(size)))
        return cls(tuple(dims))

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims)


# ---------------------------------------------------------------------------------------------
# Placements (torch.distributed.tensor's, as plain data)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dim ``dim`` over the mesh dim with ``torch.chunk`` semantics."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise SpecError(f"Shard.dim must be an integer >= 0 (normalise negative dims first), got {self.dim!r}")


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every coordinate of the mesh dim holds the whole current extent."""


@dataclass(frozen=True, slots=True)
class StridedShard:
    """torch's ``_StridedShard(dim, split_factor)``: the current extent of ``dim`` is chunked into
    ``split_factor`` pieces, each piece into as many chunks as the mesh dim has coordinates, and
    coordinate ``c`` holds chunk ``c`` of every piece, in piece order (FSDP2 over TP: the TP split
    is the "pieces", applied as if it happened first)."""

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise SpecError(f"StridedShard.dim must be an integer >= 0, got {self.dim!r}")
        if not _positive_int(self.split_factor):
            raise SpecError(f"StridedShard.split_factor must be a positive integer, got {self.split_factor!r}")


MeshPlacement = Union[Shard, Replicate, StridedShard]
_PLACEMENT_TYPES = (Shard, Replicate, StridedShard)


def chunk_range(size: int, chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` into ``chunks``.

    The chunk size is ``ceil(size / chunks)``; chunks past the end are empty (torch.chunk returns
    fewer chunks, DTensor and FSDP2 fill the rest with empty ones).
    """
    full = -(-size // chunks)
    return min(index * full, size), min((index + 1) * full, size)


def _check(shape: Sequence[int], mesh: NamedMesh, placements: Sequence[MeshPlacement]) -> tuple[int, ...]:
    shape = tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise LayoutError(f"shape {shape} must be non-negative integers")
    if len(placements) != mesh.ndim:
        raise LayoutError(
            f"{len(placements)} placements {tuple(placements)} for mesh {mesh} with {mesh.ndim} dims: "
            "give one placement per mesh dim"
        )
    for name, p in zip(mesh.names, placements):
        if not isinstance(p, _PLACEMENT_TYPES):
            raise SpecError(f"placement {p!r} on mesh dim {name} is not Shard, Replicate or StridedShard")
        if not isinstance(p, Replicate) and p.dim >= len(shape):
            raise LayoutError(f"{p} on mesh dim {name} shards dim {p.dim} but shape {shape} has {len(shape)} dims")
    return tuple(int(s) for s in shape)


def _take(ranges: Sequence[range], lo: int, hi: int) -> list[range]:
    """The global ranges at local positions ``[lo, hi)`` of a dim whose local positions run over ``ranges``."""
    out, pos = [], 0
    for r in ranges:
        if pos >= hi:
            break
        a, b = max(lo, pos), min(hi, pos + len(r))
        if a < b:
            out.append(range(r.start + a - pos, r.start + b - pos))
        pos += len(r)
    return out


def _merge(ranges: Sequence[range]) -> tuple[range, ...]:
    """Drop empty ranges and join ranges where one ends where the next starts."""
    out: list[range] = []
    for r in ranges:
        if not len(r):
            continue
        if out and out[-1].stop == r.start:
            out[-1] = range(out[-1].start, r.stop)
        else:
            out.append(r)
    return tuple(out)


def _right_to_left(mesh: NamedMesh, placements: Sequence[MeshPlacement]) -> list[tuple[int, MeshPlacement]]:
    """(mesh dim, placement) in the order FSDP2 really shards: each ``StridedShard`` becomes a plain
    ``Shard`` applied after the mesh dims to its right that shard the same tensor dim (the
    rightmost first), whose sizes multiply to its split factor."""
    keyed = []
    for i, p in enumerate(placements):
        if not isinstance(p, StridedShard):
            keyed.append(((i, 0, 0), i, p))
            continue
        right = [j for j in range(i + 1, len(placements))
                 if isinstance(placements[j], (Shard, StridedShard)) and placements[j].dim == p.dim]
        expected = math.prod(mesh.sizes[j] for j in right)
        if expected != p.split_factor:
            raise LayoutError(
                f"{p} on mesh dim {mesh.names[i]}: right-to-left sharding needs split_factor = the product of the "
                f"sizes of the mesh dims to its right sharding dim {p.dim} = "
                f"{'*'.join(str(mesh.sizes[j]) for j in right) or '1'} = {expected}, got {p.split_factor}"
            )
        keyed.append(((right[-1] if right else i, 1, -i), i, Shard(p.dim)))
    return [(i, p) for _, i, p in sorted(keyed, key=lambda x: x[0])]


def local_box(
    shape: Sequence[int],
    mesh: NamedMesh,
    placements: Sequence[MeshPlacement],
    coords: Sequence[int],
    *,
    right_to_left: bool = False,
) -> tuple[tuple[range, ...], ...]:
    """Per tensor dim, the global index ranges the mesh coordinate ``coords`` holds, in the order
    they appear in its local tensor (DTensor's ``compute_local_shape_and_global_offset``, with
    every offset rather than the first).

    ``right_to_left``: what FSDP2 over TP really stores instead (see ``_right_to_left``): the TP
    chunk first, then FSDP's chunk of it. It is DTensor's arithmetic whenever the split dim divides
    evenly, but not for uneven sizes (torch 2.13: 9 rows on ``dp_shard=4,tp=2`` put row 8 at
    (3, 1), where ``StridedShard``'s arithmetic says (3, 0)).
    """
    shape = _check(shape, mesh, placements)
    mesh.rank(coords)  # validates the coordinate
    steps = _right_to_left(mesh, placements) if right_to_left else list(enumerate(placements))
    box = [_merge([range(n)]) for n in shape]
    for i, p in steps:
        c, k = coords[i], mesh.sizes[i]
        if isinstance(p, Replicate):
            continue
        cur = box[p.dim]
        m = sum(len(r) for r in cur)
        if isinstance(p, Shard):
            pieces = [chunk_range(m, k, c)]
        else:
            pieces = []
            for j in range(p.split_factor):
                a0, a1 = chunk_range(m, p.split_factor, j)
                b0, b1 = chunk_range(a1 - a0, k, c)
                pieces.append((a0 + b0, a0 + b1))
        box[p.dim] = _merge([r for lo, hi in pieces for r in _take(cur, lo, hi)])
    return tuple(box)


def local_shape(
    shape: Sequence[int],
    mesh: NamedMesh,
    placements: Sequence[MeshPlacement],
    coords: Sequence[int],
    *,
    right_to_left: bool = False,
) -> tuple[int, ...]:
    """Shape of the local tensor at ``coords`` (DTensor's ``to_local().shape``)."""
    box = local_box(shape, mesh, placements, coords, right_to_left=right_to_left)
    return tuple(sum(len(r) for r in ranges) for ranges in box)


def canonical_order(shape: Sequence[int], placements: Sequence[MeshPlacement]) -> tuple[int, ...]:
    """The dim permutation that defines a tensor's canonical flat order.

    Rule: if exactly one tensor dim ``d > 0`` is sharded (by ``Shard`` or ``StridedShard`` on any
    mesh dims, dim 0 possibly sharded too), ``d`` moves to the front; otherwise the natural order.
    Why: it is ``TensorSpec``'s order for ``Split(dim=d)``, so a TP-only mesh gives the same
    intervals as ``ParallelConfig(tp=...)``; a row-wise TP shard (``Shard(1)`` of a weight) is one
    interval instead of one per row, the fewest possible; and whatever else splits dim 0 (FSDP2's
    rows of that shard) lies inside its TP shard's interval, as DP fragments do in ``tenplex.layout.ptc``.
    With two or more dims > 0 sharded no order makes every piece one interval: natural order.
    """
    split = {p.dim for p in placements if isinstance(p, (Shard, StridedShard)) and p.dim > 0}
    if len(split) == 1:
        d = split.pop()
        return (d,) + tuple(i for i in range(len(shape)) if i != d)
    return tuple(range(len(shape)))


def _check_order(order: Sequence[int], ndim: int) -> tuple[int, ...]:
    order = tuple(int(i) for i in order)
    if sorted(order) != list(range(ndim)):
        raise LayoutError(f"order {order} is not a permutation of the {ndim} dims 0..{ndim - 1}")
    return order


_EMPTY = np.zeros(0, dtype=np.int64)


def _segment_arrays(
    shape: tuple[int, ...], box: tuple[tuple[range, ...], ...], order: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local, start, length) of a local box flattened in ``order``, as maximal runs.

    Trailing dims the box covers fully fold into the dim before them (their runs join); the
    leading dims' global indices are combined by broadcasting, so the cost is O(runs) numpy.
    """
    gshape = [shape[d] for d in order]
    lbox = [box[d] for d in order]
    if any(not b for b in lbox):
        return _EMPTY, _EMPTY, _EMPTY
    j, block = len(gshape), 1  # dims j.. form the trailing block, of `block` elements
    tail = [(0, 1)]
    while j > 0 and tail == [(0, block)]:
        j -= 1
        tail = [(r.start * block, r.stop * block) for r in lbox[j]]
        block *= gshape[j]
    t = np.array(tail, dtype=np.int64).reshape(-1, 2)
    base = np.zeros(1, dtype=np.int64)
    stride = block
    for i in range(j - 1, -1, -1):  # innermost leading dim first, so strides grow
        idx = np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in lbox[i]]) * stride
        base = (idx[:, None] + base[None, :]).ravel()
        stride *= gshape[i]
    start = (base[:, None] + t[None, :, 0]).ravel()
    length = np.tile(t[:, 1] - t[:, 0], len(base))
    if len(start) > 1:  # join runs that continue each other across leading indices
        brk = np.empty(len(start), dtype=bool)
        brk[0] = True
        np.not_equal(start[1:], start[:-1] + length[:-1], out=brk[1:])
        keep = np.flatnonzero(brk)
        start, length = start[keep], np.add.reduceat(length, keep)
    local = np.zeros(len(length), dtype=np.int64)
    np.cumsum(length[:-1], out=local[1:])
    return local, start, length


PanelPiece = tuple[int, int, tuple[tuple[range, ...], ...]]
"""``(local column, columns, refined box)``: a run of a box's local columns that one panel range
holds, and the box over the panel view ``(R, P, W, *rest)`` it is (unequal panels: one panel, and
the columns within it)."""

PanelArg = Union[int, tuple[int, ...]]
"""How many equal panels (an int), or the column edges ``(0, e1, ..., C)`` of unequal ones."""


def panel_pieces(shape: Sequence[int], box: Sequence[Sequence[range]], count: PanelArg) -> list[PanelPiece]:
    """A box of a tensor of ``shape`` (R, C, ...) cut into the pieces the panel order sees: dim 1 cut
    into ``count`` panels of ``W = C // count`` columns, each column range of the box becomes at most
    three boxes over the panel view ``(R, count, W, *rest)`` (a partial first panel, whole panels, a
    partial last panel). Each piece: the local column where it starts, its number of columns, its
    refined box. A box's local flat buffer in panel order is its pieces' flat buffers (each the
    piece flattened in order ``(1, 0, 2, ...)``), concatenated in piece order. ``count`` the edges
    of unequal panels: one piece per panel a column range touches, its box ``(rows, (p,), columns
    within p, *rest)``."""
    if isinstance(count, tuple):
        return _unequal_panel_pieces(box, count)
    shape = tuple(shape)
    width = shape[1] // count
    rows, rest = tuple(box[0]), tuple(tuple(r) for r in box[2:])
    out: list[PanelPiece] = []
    pos = 0
    for r in box[1]:
        a, b = r.start, r.stop
        cuts = [a]
        first = -(-a // width) * width if width else b
        if a < first < b:
            cuts.append(first)
        last = (b // width) * width if width else a
        if max(a, first) < last < b:
            cuts.append(last)
        cuts.append(b)
        for lo, hi in zip(cuts, cuts[1:]):
            if hi <= lo:
                continue
            p0, p1 = lo // width, -(-hi // width)
            if p1 - p0 == 1:
                w = (range(lo - p0 * width, hi - p0 * width),)
            else:
                w = (range(0, width),)
            out.append((pos + lo - a, hi - lo, (rows, (range(p0, p1),), w, *rest)))
        pos += b - a
    return out


def _unequal_panel_pieces(box: Sequence[Sequence[range]], edges: tuple[int, ...]) -> list[PanelPiece]:
    rows, rest = tuple(box[0]), tuple(tuple(r) for r in box[2:])
    out: list[PanelPiece] = []
    pos = 0
    for r in box[1]:
        p = bisect.bisect_right(edges, r.start) - 1
        lo = r.start
        while lo < r.stop:
            hi = min(r.stop, edges[p + 1])
            out.append((pos + lo - r.start, hi - lo, (rows, (range(p, p + 1),), (range(lo - edges[p], hi - edges[p]),),
                                                      *rest)))
            lo, p = hi, p + 1
        pos += len(r)
    return out


def _piece_segments(shape: tuple[int, ...], pbox: tuple[tuple[range, ...], ...], panels: PanelArg
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_segment_arrays`` of one panel piece: over the view ``(P, R, W, *rest)`` (equal panels), or
    over its one panel ``(R, w, *rest)``, offset by the panels before it (unequal)."""
    if not isinstance(panels, tuple):
        view = (shape[0], panels, shape[1] // panels) + shape[2:]
        return _segment_arrays(view, pbox, (1, 0) + tuple(range(2, len(view))))
    p = pbox[1][0].start
    lo, hi = panels[p], panels[p + 1]
    inner = math.prod(shape[2:])
    local, start, length = _segment_arrays((shape[0], hi - lo) + shape[2:], (pbox[0],) + pbox[2:],
                                           tuple(range(len(shape))))
    return local, start + shape[0] * lo * inner, length


def _panel_segment_arrays(
    shape: tuple[int, ...], box: tuple[tuple[range, ...], ...], count: PanelArg
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_segment_arrays`` of a box in panel order (``panel_pieces``), maximal runs."""
    if len(shape) < 2 or any(sum(len(r) for r in b) == 0 for b in box):
        return _EMPTY, _EMPTY, _EMPTY
    rows = sum(len(r) for r in box[0])
    inner = math.prod(sum(len(r) for r in ranges) for ranges in box[2:])
    locs, starts, lengths = [], [], []
    pos = 0
    for _, ncols, pbox in panel_pieces(shape, box, count):
        local, start, length = _piece_segments(shape, pbox, count)
        locs.append(local + pos)
        starts.append(start)
        lengths.append(length)
        pos += rows * ncols * inner
    if not locs:
        return _EMPTY, _EMPTY, _EMPTY
    local, start, length = np.concatenate(locs), np.concatenate(starts), np.concatenate(lengths)
    if len(start) > 1:  # join runs that continue each other in both orders across pieces
        brk = np.empty(len(start), dtype=bool)
        brk[0] = True
        np.not_equal(start[1:], start[:-1] + length[:-1], out=brk[1:])
        brk[1:] |= local[1:] != local[:-1] + length[:-1]
        keep = np.flatnonzero(brk)
        local, start, length = local[keep], start[keep], np.add.reduceat(length, keep)
    return local, start, length


def _ordered_segment_arrays(
    shape: tuple[int, ...], box: tuple[tuple[range, ...], ...], order: tuple[int, ...], panels: PanelArg | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if panels:
        return _panel_segment_arrays(shape, box, panels)
    return _segment_arrays(shape, box, order)


def _check_panels(shape: tuple[int, ...], panels: PanelArg | None) -> PanelArg | None:
    if panels is None:
        return None
    if isinstance(panels, (tuple, list)):
        edges = tuple(int(e) for e in panels)
        if (len(shape) < 2 or len(edges) < 2 or edges[0] != 0 or edges[-1] != shape[1]
                or any(b <= a for a, b in zip(edges, edges[1:]))):
            raise SpecError(f"panel edges {list(edges)} must rise strictly from 0 to dim 1 of a tensor of >= 2 dims, "
                            f"got shape {shape}")
        return edges
    if isinstance(panels, bool) or not isinstance(panels, (int, np.integer)) or panels < 1:
        raise SpecError(f"a panel count is an integer >= 1, got {panels!r}")
    if len(shape) < 2 or shape[1] % panels:
        raise SpecError(f"{panels} panels need a tensor of >= 2 dims whose dim 1 they divide, got shape {shape}")
    return int(panels)


def box_segments(
    shape: Sequence[int], box: Sequence[Sequence[range]], order: Sequence[int], *, panels: PanelArg | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(local, start, length)`` arrays of a box (per dim, the global index ranges it holds) of a
    tensor of ``shape``: the box flattened in ``order`` (a permutation of the dims) as maximal runs of
    consecutive offsets into the global tensor flattened the same way; ``local`` is each run's offset
    in the box's own flat buffer. ``panels``: the panel order instead (``panel_pieces``; ``order``
    is then ignored)."""
    shape = tuple(int(s) for s in shape)
    order = _check_order(order, len(shape))
    panels = _check_panels(shape, panels)
    box = tuple(tuple(ranges) for ranges in box)
    if len(box) != len(shape):
        raise LayoutError(f"a box of {len(box)} dims for a tensor of shape {shape}")
    for d, (ranges, size) in enumerate(zip(box, shape)):
        if any(r.step != 1 or r.start < 0 or r.stop > size or r.start > r.stop for r in ranges):
            raise LayoutError(f"box dim {d} ranges {list(ranges)} do not lie in 0..{size}")
    return _ordered_segment_arrays(shape, box, order, panels)


def segments(
    shape: Sequence[int],
    mesh: NamedMesh,
    placements: Sequence[MeshPlacement],
    rank: int,
    order: Sequence[int] | None = None,
    *,
    right_to_left: bool = False,
) -> list[tuple[int, int, int]]:
    """Segments ``(local_off, global_off, length)`` of ``rank``'s local tensor: the local tensor
    permuted by ``order`` (default ``canonical_order``) and flattened row-major, as maximal runs of
    consecutive offsets into the global tensor flattened the same way. No padding (DTensor local
    tensors are unpadded)."""
    shape = _check(shape, mesh, placements)
    order = canonical_order(shape, placements) if order is None else _check_order(order, len(shape))
    box = local_box(shape, mesh, placements, mesh.coords(rank), right_to_left=right_to_left)
    local, start, length = _segment_arrays(shape, box, order)
    return list(zip(local.tolist(), start.tolist(), length.tolist()))


def holder_table(
    shape: Sequence[int],
    mesh: NamedMesh,
    placements: Sequence[MeshPlacement],
    order: Sequence[int] | None = None,
    *,
    right_to_left: bool = False,
    panels: PanelArg | None = None,
) -> SegmentTable:
    """Every rank's segments of the tensor (``segments`` for each rank of ``mesh``), sorted by rank;
    ``panels``: in the panel order of that many panels (``panel_pieces``) instead of ``order``."""
    shape = _check(shape, mesh, placements)
    order = canonical_order(shape, placements) if order is None else _check_order(order, len(shape))
    return _holder_table(shape, mesh, tuple(placements), order, right_to_left, _check_panels(shape, panels))


@lru_cache(maxsize=4096)
def _holder_table(
    shape: tuple[int, ...],
    mesh: NamedMesh,
    placements: tuple[MeshPlacement, ...],
    order: tuple[int, ...],
    right_to_left: bool,
    panels: PanelArg | None = None,
) -> SegmentTable:
    # Coordinates on replicating mesh dims do not change a piece: compute each distinct piece once.
    sharding = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    grid = np.arange(mesh.world_size, dtype=np.int64).reshape(mesh.sizes)
    cols: list[list[np.ndarray]] = [[], [], [], []]
    for key in itertools.product(*(range(mesh.sizes[i]) for i in sharding)):
        coords = [0] * mesh.ndim
        where: list[int | slice] = [slice(None)] * mesh.ndim
        for i, c in zip(sharding, key):
            coords[i] = where[i] = c
        box = local_box(shape, mesh, placements, coords, right_to_left=right_to_left)
        local, start, length = _ordered_segment_arrays(shape, box, order, panels)
        ranks = grid[tuple(where)].ravel()
        cols[0].append(np.repeat(ranks, len(local)))
        for col, values in zip(cols[1:], (local, start, length)):
            col.append(np.tile(values, len(ranks)))
    rank = np.concatenate(cols[0])
    by_rank = np.argsort(rank, kind="stable")
    return SegmentTable.from_columns(*(np.concatenate(c)[by_rank] for c in cols))


# ---------------------------------------------------------------------------------------------
# A tensor's placement
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """A tensor's global shape, dtype name and placements (one per dim of the mesh it lives on)."""

    shape: tuple[int, ...]
    dtype: str
    placements: tuple[MeshPlacement, ...]

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise SpecError(f"shape {shape} must be non-negative integers")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype", dtype_to_str(dtype_from_str(str(self.dtype))))
        placements = tuple(self.placements)
        for p in placements:
            if not isinstance(p, _PLACEMENT_TYPES):
                raise SpecError(f"placement {p!r} is not Shard, Replicate or StridedShard")
            if not isinstance(p, Replicate) and p.dim >= len(shape):
                raise SpecError(f"{p} shards dim {p.dim} but shape {self.shape} has {len(shape)} dims")
        object.__setattr__(self, "placements", placements)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def check(self, mesh: NamedMesh) -> None:
        """Raise LayoutError unless there is one placement per dim of ``mesh``."""
        _check(self.shape, mesh, self.placements)

    def canonical_order(self) -> tuple[int, ...]:
        return canonical_order(self.shape, self.placements)

    def local_box(self, mesh: NamedMesh, rank: int, *, right_to_left: bool = False) -> tuple[tuple[range, ...], ...]:
        return local_box(self.shape, mesh, self.placements, mesh.coords(rank), right_to_left=right_to_left)

    def local_shape(self, mesh: NamedMesh, rank: int, *, right_to_left: bool = False) -> tuple[int, ...]:
        return local_shape(self.shape, mesh, self.placements, mesh.coords(rank), right_to_left=right_to_left)

    def segments(self, mesh: NamedMesh, rank: int, *, right_to_left: bool = False) -> list[tuple[int, int, int]]:
        return segments(self.shape, mesh, self.placements, rank, right_to_left=right_to_left)

    def holder_table(self, mesh: NamedMesh, *, right_to_left: bool = False) -> SegmentTable:
        return holder_table(self.shape, mesh, self.placements, right_to_left=right_to_left)
