"""The layout of a torch-native state dict: every tensor's placement on its own named mesh (#17).

A ``ParallelConfig`` derives every tensor's partitioning from (DP, TP, PP) and the tensor's
spec. A torch-native job (DTensors from FSDP2, ``parallelize_module``, pipeline stages) says it
per tensor instead: each state-dict entry lives on a (sub-)mesh of the job's ranks with one
placement per mesh dim. ``StateLayout`` holds exactly that, and answers the questions
``tenplex.layout.ptc.PTC`` asks a layout (which ranks hold a tensor, which segments in canonical flat
order), so the checkpoint writer, the read planner and the planner work on it unchanged: one
representation (1-D intervals in canonical flat order) for both kinds of layout.

A tensor whose partitioning is known only as saved chunks (a ``torch.distributed.checkpoint``
checkpoint's metadata: per chunk its offsets and sizes, one row-major blob) is placed by
``Boxes`` instead: explicit boxes, one per holder rank, turned into the same segments.

Pure: no I/O and no torch.distributed (``tenplex.native.state_dict`` builds it from real DTensors).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Union

import numpy as np

from ..errors import ConfigError, LayoutError, SpecError
from .mesh import (
    NamedMesh,
    MeshPlacement,
    Replicate,
    Shard,
    StridedShard,
    box_segments,
    canonical_order,
    holder_table,
    local_box,
    PanelArg,
    panel_pieces,
)
from .ptc import PTC, Panels, Replicated, SegmentTable, Split, TensorSpec, dtype_from_str

__all__ = ["Placed", "Boxes", "Placement", "StateLayout", "spec_for", "boxes_split_dim", "placement_text",
           "parse_placement", "merge_replicas", "PANELS", "PANEL_DEGREES", "panel_cuts", "PANEL_MIN_ROWS",
           "PANEL_MIN_COLS", "NEW_DIM_PLACEMENTS"]

PANELS = 8
"""Panel count ``spec_for`` gives 2-D and higher tensors (the lcm of the TP sizes 1, 2, 4, 8: a TP
column shard of any of them is whole panels). Column counts it does not divide get unequal panels
(``panel_cuts``)."""
PANEL_DEGREES = (2, 4, 8)
"""The TP degrees whose ``torch.chunk`` column cuts unequal panels put their edges on."""


def panel_cuts(ncols: int) -> Panels:
    """Panels of ``ncols`` columns: ``PANELS`` equal ones when it divides ``ncols``, else unequal ones
    whose edges are the union of the ``torch.chunk`` cuts of ``PANEL_DEGREES`` (multiples of
    ``ceil(ncols / d)``; 669: widths 84, 84, 84, 83, 1, 84, 84, 84, 81), so every TP column shard of
    those degrees is whole panels."""
    if ncols % PANELS == 0:
        return Panels(1, PANELS)
    cuts = {0, ncols}
    for d in PANEL_DEGREES:
        size = -(-ncols // d)
        cuts.update(range(size, ncols, size))
    edges = tuple(sorted(cuts))
    return Panels(1, len(edges) - 1, edges)
PANEL_MIN_ROWS = 64
PANEL_MIN_COLS = 64
"""Smaller tensors keep the dim-permutation order: a few reads of them cost little either way."""


def placement_text(p: MeshPlacement) -> str:
    """``R``, ``S<dim>`` or ``SS<dim>/<split factor>``: a placement as a manifest stores it."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    return f"SS{p.dim}/{p.split_factor}"


def parse_placement(text: str) -> MeshPlacement:
    """Inverse of ``placement_text``; SpecError for anything else."""
    if not isinstance(text, str):
        raise SpecError(f"a placement is a string such as 'R', 'S0' or 'SS0/2', got {text!r}")
    try:
        if text == "R":
            return Replicate()
        if text.startswith("SS"):
            dim, sf = text[2:].split("/")
            return StridedShard(int(dim), int(sf))
        if text.startswith("S"):
            return Shard(int(text[1:]))
    except ValueError:
        pass
    raise SpecError(f"placement {text!r} is not 'R', 'S<dim>' or 'SS<dim>/<split factor>'")


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one tensor lives: ``mesh`` (its named device mesh), one placement per mesh dim, and
    ``ranks``: the job rank of every mesh rank (row-major, as ``DeviceMesh.mesh.flatten()``).

    A pipeline stage's tensors live on the stage's sub-mesh (its ranks only); a plain tensor every
    holder has whole lives on a one-dim mesh of its holders with ``Replicate()``.
    """

    mesh: NamedMesh
    placements: tuple[MeshPlacement, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(f"{len(self.placements)} placements for the {self.mesh.ndim}-dim mesh {self.mesh}: "
                              "give one per mesh dim")
        if len(self.ranks) != self.mesh.world_size:
            raise LayoutError(f"mesh {self.mesh} has {self.mesh.world_size} ranks but {len(self.ranks)} job ranks "
                              f"are given for them")
        if len(set(self.ranks)) != len(self.ranks) or any(r < 0 for r in self.ranks):
            raise LayoutError(f"the job ranks of mesh {self.mesh} must be distinct and >= 0, got {self.ranks}")

    @classmethod
    def replicated(cls, ranks: Sequence[int]) -> Placed:
        """A tensor every one of ``ranks`` holds whole (a plain, non-DTensor tensor)."""
        return cls(NamedMesh((("replica", len(ranks)),)), (Replicate(),), tuple(ranks))

    def to_json(self) -> list[Any]:
        return [[[n, s] for n, s in self.mesh.dims], [placement_text(p) for p in self.placements], list(self.ranks)]

    @classmethod
    def from_json(cls, obj: Any) -> Placed:
        try:
            dims, placements, ranks = obj
            if not all(type(r) is int for r in ranks):
                raise SpecError(f"job ranks {ranks!r} are not integers")
            return cls(NamedMesh(tuple((n, s) for n, s in dims)), tuple(parse_placement(p) for p in placements),
                       tuple(ranks))
        except (TypeError, ValueError) as e:
            if isinstance(e, SpecError):
                raise
            raise SpecError(f"a tensor's placement {obj!r} is not [mesh dims, placements, ranks] ({e})") from None


def merge_replicas(parts: Sequence[Placed], root: tuple[NamedMesh, Sequence[int]] | None = None) -> Placed:
    """One tensor that several disjoint sub-meshes of the same dims each hold whole, in the same
    placements (a replica per sub-mesh), as one ``Placed``: the sub-mesh dims plus ``Replicate()`` on
    the dims that tell the replicas apart. FSDP2 over the ``dp`` dim of a ``(dp, tp)`` mesh gives a
    module TP leaves alone one such replica per TP rank (ranks {0, 2} and {1, 3}); DCP saves it once.

    ``root``: the mesh the sub-meshes were sliced from and its job ranks (row-major). When every
    part is a slice of it along whole dims or adjacent groups of dims (a ``_flatten``-ed dim), the
    result is on the root's dims (a group as the part's one dim, the dims the replicas span named as
    the root names them, dims no replica varies dropped), so it remeshes by dim name; else (or
    without ``root``) on a new first dim ``replica`` of one coordinate per part, parts by first rank.
    LayoutError, saying which, when the parts differ in mesh dims or placements, or share ranks."""
    parts = list(parts)
    if not parts:
        raise LayoutError("merging the replicas of a tensor needs at least one part")
    first = parts[0]
    for p in parts[1:]:
        if p.mesh != first.mesh or p.placements != first.placements:
            raise LayoutError(f"replicas on different sub-meshes must have the same mesh dims and placements: "
                              f"{_placed_text(first)} vs {_placed_text(p)}")
    seen: dict[int, Placed] = {}
    for p in parts:
        for r in p.ranks:
            if r in seen and seen[r] is not p:
                raise LayoutError(f"job rank {r} is in two sub-meshes, {_placed_text(seen[r])} and {_placed_text(p)}: "
                                  "replicas of a tensor must be on disjoint sub-meshes")
            seen[r] = p
    if len(parts) == 1:
        return first
    parts.sort(key=lambda p: p.ranks[0])
    lifted = None if root is None else _lift(parts, root[0], tuple(int(r) for r in root[1]))
    if lifted is not None:
        return lifted
    name = "replica"
    while name in first.mesh.names:
        name = "_" + name
    return Placed(NamedMesh(((name, len(parts)),) + first.mesh.dims), (Replicate(),) + first.placements,
                  tuple(r for p in parts for r in p.ranks))


def _placed_text(p: Placed) -> str:
    return f"{[placement_text(q) for q in p.placements]} on {p.mesh} of job ranks {list(p.ranks)}"


def _lift(parts: list[Placed], root: NamedMesh, root_ranks: tuple[int, ...]) -> Placed | None:
    """``merge_replicas`` on the dims of ``root`` (job ranks ``root_ranks``), or None where the parts
    are not slices of it along whole dims or adjacent groups of them."""
    if len(root_ranks) != root.world_size or len(set(root_ranks)) != len(root_ranks):
        return None
    pos = {r: i for i, r in enumerate(root_ranks)}
    if any(r not in pos for p in parts for r in p.ranks):
        return None
    sub, first = parts[0].mesh, parts[0]
    # per sub dim, the adjacent root dims it runs over (innermost: the one its first step changes)
    groups: list[tuple[int, ...] | None] = []
    for i, (name, size) in enumerate(sub.dims):
        if size == 1:
            same = [j for j, (n, s) in enumerate(root.dims) if n == name and s == 1]
            groups.append(tuple(same) or None)  # None: a new size-1 dim after the previous sub dim
            continue
        step = [0] * sub.ndim
        step[i] = 1
        a, b = root.coords(pos[first.ranks[0]]), root.coords(pos[first.ranks[sub.rank(step)]])
        changed = [j for j in range(root.ndim) if a[j] != b[j]]
        if not changed:
            return None
        hi = lo = max(changed)
        n = root.sizes[hi]
        while n < size and lo > 0:
            lo -= 1
            n *= root.sizes[lo]
        if n != size:
            return None
        groups.append(tuple(range(lo, hi + 1)))
    owner: dict[int, int] = {}
    for i, g in enumerate(groups):
        for j in g or ():
            if j in owner:
                return None
            owner[j] = i
    entries: list[tuple[str, int]] = []  # ("sub", i) or ("root", j), in the merged mesh's dim order
    for i, g in enumerate(groups):  # new size-1 sub dims before any other come first
        if g is not None:
            break
        entries.append(("sub", i))
    for j in range(root.ndim):
        if j not in owner:
            entries.append(("root", j))
            continue
        i = owner[j]
        if j != groups[i][0]:  # type: ignore[index]
            continue
        entries.append(("sub", i))
        for k in range(i + 1, sub.ndim):  # new size-1 sub dims follow the sub dim before them
            if groups[k] is not None:
                break
            entries.append(("sub", k))
    if [i for kind, i in entries if kind == "sub"] != list(range(sub.ndim)):
        return None
    dims = [sub.dims[i] if kind == "sub" else root.dims[i] for kind, i in entries]
    try:
        merged = NamedMesh(tuple(dims))
    except ConfigError:
        return None
    # which root-only dims the parts span (kept) or share one coordinate of (dropped)
    spare = [k for k, (kind, _) in enumerate(entries) if kind == "root"]
    corners = {tuple(merged.coords(pos[p.ranks[0]])[k] for k in spare) for p in parts}
    values = {k: {c[n] for c in corners} for n, k in enumerate(spare)}
    if any(1 < len(v) < merged.sizes[k] for k, v in values.items()):
        return None
    keep = [k for k in range(merged.ndim) if k not in spare or len(values[k]) > 1]
    if len(corners) != len(parts) or math.prod(merged.sizes[k] for k in keep if k in spare) != len(parts):
        return None
    grid = np.asarray(root_ranks, dtype=np.int64).reshape(merged.sizes)
    fixed = tuple(slice(None) if k in keep else next(iter(values[k])) for k in range(merged.ndim))
    out = Placed(NamedMesh(tuple(merged.dims[k] for k in keep)),
                 tuple(first.placements[entries[k][1]] if entries[k][0] == "sub" else Replicate() for k in keep),
                 tuple(grid[fixed].ravel().tolist()))
    # the proof: every rank's coordinates on the sub dims are the ones its part gave it
    at = {r: out.mesh.coords(i) for i, r in enumerate(out.ranks)}
    subs = [n for n, k in enumerate(keep) if entries[k][0] == "sub"]
    for p in parts:
        for i, r in enumerate(p.ranks):
            if r not in at or tuple(at[r][n] for n in subs) != p.mesh.coords(i):
                return None
    if len(at) != sum(len(p.ranks) for p in parts):
        return None
    return out


BoxChunk = tuple[int, tuple[int, ...], tuple[int, ...]]
"""``(rank, offsets, sizes)``: the box ``rank`` holds, as global offsets and sizes per dim."""


@dataclass(frozen=True, slots=True)
class Boxes:
    """Where one tensor lives when only its chunks are known: ``chunks`` of ``(rank, offsets, sizes)``,
    each the box one rank holds, stored as one blob in the tensor's canonical order (a DCP chunk).

    At most one chunk per rank (give further chunks of one holder ranks of their own); chunks of
    different ranks may repeat each other (replicas). Usable wherever a ``Placed`` is.
    """

    chunks: tuple[BoxChunk, ...]

    def __post_init__(self) -> None:
        try:
            chunks = tuple((r, tuple(o), tuple(z)) for r, o, z in self.chunks)
        except (TypeError, ValueError):
            raise LayoutError(f"boxes are (rank, offsets, sizes) triples, got {self.chunks!r}") from None
        if not chunks:
            raise LayoutError("a tensor placed by boxes needs at least one chunk")
        ndim = len(chunks[0][1])
        seen: set[int] = set()
        for r, o, z in chunks:
            if not all(_nonneg_int(v) for v in (r, *o, *z)):
                raise LayoutError(f"chunk (rank {r!r}, offsets {list(o)}, sizes {list(z)}): the rank, offsets and "
                                  "sizes must be integers >= 0")
            if len(o) != ndim or len(z) != ndim:
                raise LayoutError(f"chunk of rank {r} has {len(o)} offsets and {len(z)} sizes; every chunk of the "
                                  f"tensor needs {ndim} of each (one per dim)")
            if r in seen:
                raise LayoutError(f"rank {r} holds two chunks of one tensor: give each chunk a rank of its own")
            seen.add(r)
        object.__setattr__(self, "chunks", tuple((int(r), tuple(map(int, o)), tuple(map(int, z)))
                                                 for r, o, z in chunks))

    @property
    def ndim(self) -> int:
        return len(self.chunks[0][1])

    @property
    def ranks(self) -> tuple[int, ...]:
        """The holder ranks, in chunk order."""
        return tuple(r for r, _, _ in self.chunks)

    def box(self, rank: int) -> tuple[tuple[range, ...], ...]:
        """The box ``rank`` holds (per dim, one global index range); LayoutError if it holds none."""
        for r, o, z in self.chunks:
            if r == rank:
                return tuple((range(a, a + n),) for a, n in zip(o, z))
        raise LayoutError(f"rank {rank} holds no chunk of this tensor (holders: {list(self.ranks)})")

    def check_shape(self, shape: Sequence[int]) -> None:
        """LayoutError unless every chunk lies inside a tensor of ``shape``."""
        shape = tuple(shape)
        if self.ndim != len(shape):
            raise LayoutError(f"chunks of {self.ndim} dims for a tensor of shape {list(shape)}")
        for r, o, z in self.chunks:
            if any(a + n > s for a, n, s in zip(o, z, shape)):
                raise LayoutError(f"rank {r}'s chunk (offsets {list(o)}, sizes {list(z)}) reaches outside the "
                                  f"tensor's shape {list(shape)}")

    def to_json(self) -> list[Any]:
        return ["boxes", [[r, list(o), list(z)] for r, o, z in self.chunks]]

    @classmethod
    def from_json(cls, obj: Any) -> Boxes:
        try:
            tag, chunks = obj
            if tag != "boxes":
                raise SpecError(f"a boxes placement starts with 'boxes', got {tag!r}")
            for c in chunks:
                r, o, z = c
                if not all(type(v) is int for v in (r, *o, *z)):
                    raise SpecError(f"chunk {c!r} holds values that are not integers")
            return cls(tuple((r, tuple(o), tuple(z)) for r, o, z in chunks))
        except (TypeError, ValueError) as e:
            if isinstance(e, (SpecError, LayoutError)):
                raise
            raise SpecError(f"a tensor's boxes {obj!r} are not ['boxes', [[rank, offsets, sizes], ...]] ({e})") from None


Placement = Union[Placed, Boxes]
"""A tensor's placement in a ``StateLayout``: on a named mesh (``Placed``) or as explicit boxes."""


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0


def boxes_split_dim(shape: Sequence[int], boxes: Boxes) -> int | None:
    """The dim ``d`` that the chunks split when they all span every other dim whole (None when they
    split several dims, or none)."""
    shape = tuple(shape)
    split = {d for _, o, z in boxes.chunks for d, (a, n, s) in enumerate(zip(o, z, shape)) if (a, n) != (0, s)}
    return split.pop() if len(split) == 1 else None


def spec_for(name: str, shape: Sequence[int], dtype: Any, placements: Sequence[MeshPlacement] | Boxes) -> TensorSpec:
    """The PTC spec of a state-dict tensor: its canonical flat order is the one ``mesh.canonical_order``
    picks for the placements it was saved with (``Split(d)`` when dim ``d > 0`` goes first), so a
    shard of the saving mesh is as few intervals as possible. For ``Boxes``: the natural order,
    unless every chunk is a slice of one dim ``d > 0`` (then ``d`` first).

    Panels: a tensor of >= 2 dims with at least ``PANEL_MIN_ROWS`` rows and ``PANEL_MIN_COLS``
    columns (dim 1), that no placement shards on a dim > 1, is stored in the panel order of
    ``panel_cuts`` (``PANELS`` equal panels, or unequal ones on the TP cuts): then both a row range (FSDP2,
    any uneven ``torch.chunk``) and a column range of whole panels (TP 1, 2, 4, 8 on dim 1), and
    rows of such a column range (FSDP2 over TP), are a few intervals each, whichever of them saved
    and whichever loads. (A split on dim 1 that panels do not align with costs one interval per row
    in its boundary panels only.)"""
    shape = tuple(shape)
    dt = dtype_from_str(dtype) if isinstance(dtype, str) else dtype
    paneled = len(shape) >= 2 and shape[0] >= PANEL_MIN_ROWS and shape[1] >= PANEL_MIN_COLS
    if isinstance(placements, Boxes):
        d = boxes_split_dim(shape, placements)
        if paneled and d != 1 and not any(a or n != s for _, o, z in placements.chunks
                                          for a, n, s in zip(o[2:], z[2:], shape[2:])):
            return TensorSpec(name, shape, dt, tp=panel_cuts(shape[1]))
        tp = Split(d) if d else Replicated()
        return TensorSpec(name, shape, dt, tp=tp)
    if paneled and not any(isinstance(p, (Shard, StridedShard)) and p.dim > 1 for p in placements):
        return TensorSpec(name, shape, dt, tp=panel_cuts(shape[1]))
    order = canonical_order(shape, tuple(placements))
    tp = Split(order[0]) if order and order[0] != 0 else Replicated()
    return TensorSpec(name, shape, dt, tp=tp)


def _order(spec: TensorSpec) -> tuple[int, ...]:
    d = spec.split_dim
    n = len(spec.shape)
    return tuple(range(n)) if d is None else (d,) + tuple(i for i in range(n) if i != d)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Every tensor's ``Placed`` (or ``Boxes``) over a job of ``world_size`` ranks.

    A ``ptc.Layout`` (``world_size``, ``check``, ``rank_tensors``, ``holder_table``, ``segments``,
    ``local_shape``, ``to_local_flat``, ``from_local_flat``); a rank's local tensors are unpadded DTensor locals,
    and FSDP2-over-TP tensors (``StridedShard``) are taken as FSDP2 stores them (the TP chunk
    first, then FSDP2's chunk of it: ``mesh.local_box(right_to_left=True)``).
    """

    world_size: int
    tensors: tuple[tuple[str, Placement], ...]
    _memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Derived lookups (by name, ranks by name, hash, digest), computed once: a layout of a few
    thousand tensors is asked about each of them many times per save and load."""

    def __hash__(self) -> int:
        if "hash" not in self._memo:
            self._memo["hash"] = hash((self.world_size, self.tensors))
        return self._memo["hash"]

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 1:
            raise LayoutError(f"a state-dict layout needs a world size >= 1, got {self.world_size!r}")
        tensors = tuple((str(n), p) for n, p in self.tensors)
        names = [n for n, _ in tensors]
        if len(set(names)) != len(names):
            raise LayoutError(f"tensor names repeat in the layout: {sorted({n for n in names if names.count(n) > 1})}")
        for name, placed in tensors:
            if not isinstance(placed, (Placed, Boxes)):
                raise LayoutError(f"{name}: expected a Placed or Boxes, got {type(placed).__name__}")
            bad = [r for r in placed.ranks if r >= self.world_size]
            if bad:
                raise LayoutError(f"{name} lives on ranks {bad} but the job has {self.world_size} ranks "
                                  f"(0..{self.world_size - 1})")
        # equal placements as one object (the layers' tensors and their optimizer states share a
        # few): the per-geometry memos below are keyed by the placement's identity, not its hash
        interned: dict[Placement, Placement] = {}
        tensors = tuple((n, interned.setdefault(p, p)) for n, p in tensors)
        object.__setattr__(self, "tensors", tensors)

    @classmethod
    def of(cls, world_size: int, tensors: Mapping[str, Placement] | Iterable[tuple[str, Placement]]) -> StateLayout:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls(world_size, tuple(items))

    @property
    def placed(self) -> dict[str, Placement]:
        """Every tensor's placement by name."""
        if "placed" not in self._memo:
            self._memo["placed"] = dict(self.tensors)
        return self._memo["placed"]

    def __str__(self) -> str:
        return f"state-dict layout of {self.world_size} ranks ({self.digest()})"

    def digest(self) -> str:
        """A short hash of the whole layout: rank indexes are bound to it."""
        if "digest" not in self._memo:
            self._memo["digest"] = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]
        return self._memo["digest"]

    # -- the Layout protocol (what PTC asks) and the questions behind it -------------------------
    def coords(self, rank: int) -> int:
        """Validate ``rank`` (LayoutError outside 0..world_size-1) and return it."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside the {self.world_size} ranks of this layout")
        return int(rank)

    def holds(self, name: str, rank: int) -> bool:
        if "ranks" not in self._memo:
            self._memo["ranks"] = {n: frozenset(p.ranks) for n, p in self.tensors}
        return rank in self._memo["ranks"].get(name, ())

    def rank_tensors(self, ptc: PTC, rank: int) -> list[str]:
        """Names of the tensors of ``ptc`` that ``rank`` holds, in collection order."""
        return [n for n in ptc.tensors if self.holds(n, rank)]

    def holder_table(self, spec: TensorSpec, num_layers: int = 0) -> SegmentTable:
        """Every (job rank, segment) of ``spec`` in its canonical order, sorted by rank (``num_layers``:
        unused, every tensor is placed here itself)."""
        placed = self.placed[spec.name]
        tables = self._memo.setdefault("tables", {})  # by geometry: no hash of the placement per call
        key = (spec.shape, spec.split_dim, spec.panels, id(placed))
        table = tables.get(key)
        if table is None:
            if isinstance(placed, Boxes):
                table = _box_table(spec.shape, _order(spec), placed, spec.panels)
            else:
                table = _table(spec.shape, _order(spec), placed, spec.panels)
            tables[key] = table
        return table

    def segments(self, spec: TensorSpec, rank: int) -> list[tuple[int, int, int]]:
        table = self.holder_table(spec)
        memo = self._memo.setdefault("segments", {})  # tables are shared by tensors of one geometry
        key = (id(table), rank)
        known = memo.get(key)
        if known is None or known[0] is not table:
            lo, hi = np.searchsorted(table.rank, [rank, rank + 1])
            known = memo[key] = (table, tuple(zip(table.local[lo:hi].tolist(), table.start[lo:hi].tolist(),
                                                  table.length[lo:hi].tolist())))
        return list(known[1])

    def local_box(self, spec: TensorSpec, rank: int) -> tuple[tuple[range, ...], ...]:
        """Per dim, the global index ranges ``rank``'s local tensor of ``spec`` holds, in local order."""
        boxes = self._memo.setdefault("boxes", {})  # asked 3-4 times per tensor by a load, about 45 us each
        key = (spec.shape, id(self.placed[spec.name]), rank)  # by geometry: tensors of one placement share it
        box = boxes.get(key)
        if box is None:
            placed = self.placed[spec.name]
            if isinstance(placed, Boxes):
                box = placed.box(rank)
            else:
                box = local_box(spec.shape, placed.mesh, placed.placements,
                                placed.mesh.coords(placed.ranks.index(rank)), right_to_left=True)
            boxes[key] = box
        return box

    def local_shape(self, spec: TensorSpec, rank: int) -> tuple[int, ...]:
        return tuple(sum(len(r) for r in ranges) for ranges in self.local_box(spec, rank))

    def panel_copies(self, spec: TensorSpec, rank: int) -> bool:
        """Whether ``rank``'s local tensor of a panel-ordered ``spec`` differs from its flat buffer
        (False when it holds one row or columns of one panel only: then it is one block already)."""
        memo = self._memo.setdefault("panel_copies", {})
        key = (spec.shape, spec.panels, id(self.placed[spec.name]), rank)
        if key not in memo:
            box = self.local_box(spec, rank)
            if sum(len(r) for r in box[0]) <= 1:
                memo[key] = False
            else:
                pieces = _pieces(spec.shape, box, spec.panels or 1)
                memo[key] = not (len(pieces) <= 1 and (not pieces or len(pieces[0][2][1][0]) == 1))
        return memo[key]

    def to_local_flat(self, spec: TensorSpec, rank: int, local: Any) -> Any:
        """``rank``'s natural local tensor of ``spec`` as its flat buffer; a panel-ordered one's the pieces of
        ``mesh.panel_pieces``, each permuted panel first, in a new tensor."""
        if spec.panels is None:
            return spec.local_to_flat(local)
        out = local.new_empty(local.numel())
        for pos, n, part, flat_shape in self._panel_parts(spec, rank, local):
            out[pos:pos + n].view(flat_shape).copy_(part.movedim(1, 0))
        return out

    def from_local_flat(self, spec: TensorSpec, rank: int, flat: Any, out: Any = None) -> Any:
        """Inverse of ``to_local_flat``: ``flat`` as ``rank``'s natural local tensor, copied into ``out``
        (a new tensor when None)."""
        if spec.panels is None:
            local = spec.local_from_flat(flat, self.local_shape(spec, rank))
            return local if out is None else out.copy_(local)
        if out is None:
            out = flat.new_empty(self.local_shape(spec, rank))
        for pos, n, part, flat_shape in self._panel_parts(spec, rank, out):
            part.movedim(1, 0).copy_(flat[pos:pos + n].view(flat_shape))
        return out

    def panel_views(self, spec: TensorSpec, rank: int, local: Any) -> list[tuple[int, int, Any]]:
        """Per panel piece of ``rank``'s natural local tensor ``local`` of a panel-ordered ``spec``: its
        offset and length in the flat buffer and its view of ``local`` as ``(panels, rows, inner)``,
        whose row-major index order is the flat buffer's (the parts of a ``checkpoint.part_reader.Scatter``)."""
        return [(pos, n, part.movedim(1, 0).view(flat_shape[0], flat_shape[1], -1))
                for pos, n, part, flat_shape in self._panel_parts(spec, rank, local)]

    def panel_byte_views(self, spec: TensorSpec, rank: int, shape: Sequence[int],
                         raw: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """``panel_views`` of a contiguous local tensor of ``shape`` given as its bytes ``raw`` (1-D
        uint8): each view a numpy byte view ``(panels, rows, W * inner bytes)``. Numpy strides,
        about a microsecond a piece where torch's ``narrow`` / ``unflatten`` cost about 50 (30 ms of
        a 444-tensor load)."""
        shape = tuple(int(n) for n in shape)
        if spec.panels is None:
            raise SpecError(f"{spec.name} is not panel-ordered")
        if shape != self.local_shape(spec, rank):
            raise LayoutError(f"{spec.name}: rank {rank}'s local tensor has shape {list(shape)}, its placements give "
                              f"{list(self.local_shape(spec, rank))}")
        inner = math.prod(shape[2:]) * spec.itemsize  # bytes of one column
        if raw.shape != (shape[0] * shape[1] * inner,) or raw.dtype != np.uint8:
            raise LayoutError(f"{spec.name}: {raw.shape} {raw.dtype} are not the bytes of a contiguous {list(shape)}")
        memo = self._memo.setdefault("panel_views", {})  # the views' geometry, per tensor geometry
        key = (spec.shape, spec.panels, spec.itemsize, id(self.placed[spec.name]), rank)
        geometry = memo.get(key)
        if geometry is None:
            geometry, pos = [], 0
            for col, ncols, pbox in _pieces(spec.shape, self.local_box(spec, rank), spec.panels):
                npan, width = len(pbox[1][0]), len(pbox[2][0])
                n = npan * shape[0] * width * inner // spec.itemsize
                geometry.append((pos, n, col * inner, (npan, shape[0], width * inner),
                                 (width * inner, shape[1] * inner, 1)))
                pos += n
            memo[key] = geometry
        # np.ndarray over raw's buffer: about 0.5 us a view, as_strided about 4
        return [(pos, n, np.ndarray(vshape, np.uint8, raw, offset, strides))
                for pos, n, offset, vshape, strides in geometry]

    def _panel_parts(self, spec: TensorSpec, rank: int, local: Any) -> list[tuple[int, int, Any, tuple[int, ...]]]:
        """Per panel piece: its offset and length in the flat buffer, its view of ``local`` as
        (rows, panels, W, ...) and the shape of its flat buffer (panels, rows, W, ...)."""
        count = spec.panels
        if count is None:
            raise SpecError(f"{spec.name} is not panel-ordered")
        shape = tuple(local.shape)
        if shape != self.local_shape(spec, rank):
            raise LayoutError(f"{spec.name}: rank {rank}'s local tensor has shape {list(shape)}, its placements give "
                              f"{list(self.local_shape(spec, rank))}")
        out, pos = [], 0
        for col, ncols, pbox in _pieces(spec.shape, self.local_box(spec, rank), count):
            npan, width = len(pbox[1][0]), len(pbox[2][0])
            part = local.narrow(1, col, ncols).unflatten(1, (npan, width))
            n = part.numel()
            out.append((pos, n, part, (npan, shape[0], width) + shape[2:]))
            pos += n
        return out

    def check(self, ptc: PTC, *, complete: bool = False) -> None:
        """LayoutError unless every tensor placed here is one of ``ptc``'s and its placement fits its shape.

        A layout may place a subset of the collection (a loading rank knows only its own tensors);
        ``complete``: it must place every tensor and give every element a holder (a saved layout)."""
        extra = sorted(set(self.placed) - set(ptc.tensors))
        if extra:
            raise LayoutError(f"the layout places {len(extra)} tensors the collection lacks, e.g. {extra[:5]}")
        for name, placed in self.tensors:
            spec = ptc.tensors[name]
            if isinstance(placed, Boxes):
                try:
                    placed.check_shape(spec.shape)
                except LayoutError as e:
                    raise LayoutError(f"{name}: {e}") from None
                continue
            for p in placed.placements:
                if not isinstance(p, Replicate) and p.dim >= len(spec.shape):
                    raise LayoutError(f"{name}: {p} shards dim {p.dim} but the tensor has shape {spec.shape}")
        if not complete:
            return
        missing = sorted(set(ptc.tensors) - set(self.placed))
        if missing:
            raise LayoutError(f"the layout places no holder of {len(missing)} tensors, e.g. {missing[:5]}")
        for name, placed in self.tensors:
            spec = ptc.tensors[name]
            table = self.holder_table(spec)
            starts = np.argsort(table.start, kind="stable")
            end = 0
            for s, n in zip(table.start[starts].tolist(), table.length[starts].tolist()):
                if s > end:
                    break
                end = max(end, s + n)
            if end < spec.numel:
                raise LayoutError(f"{name}: no rank of the layout holds element {end} (canonical order) of its "
                                  f"{spec.numel}")

    def remesh(self, dims: Mapping[str, int] | Sequence[tuple[str, int]]) -> StateLayout:
        """The layout this state dict takes on a new job mesh ``dims`` (names and sizes in the order the
        job builds it: ``init_device_mesh`` numbers its ranks row-major), predicted from the placements
        by mesh dim name, without building the model: what the survivors of a failure need to order
        themselves (``planner.locality_order``) before the new mesh exists.

        Per tensor, every new dim the tensor's mesh had keeps its placement (a ``StridedShard``'s split
        factor becomes the product of the new sizes of the dims after it that ``Shard`` the same tensor
        dim: FSDP2 over TP; ``Shard`` when none does), a new ``dp_replicate`` dim is ``Replicate()``
        (HSDP), a dim the new mesh lacks is dropped; a plain tensor every rank holds stays one. Every
        tensor's mesh is the new mesh, its ranks numbered row-major. LayoutError, naming the tensor,
        where this cannot be told: a tensor placed by
        ``Boxes`` or on a part of the job (a pipeline stage's sub-mesh), a new dim other than
        ``dp_replicate`` that its mesh lacks (TP appearing), a split factor this rule does not give."""
        items = dims.items() if isinstance(dims, Mapping) else dims
        mesh = NamedMesh(tuple((str(n), s) for n, s in items))
        world = mesh.world_size
        ranks = tuple(range(world))
        everyone = tuple(range(self.world_size))
        cache: dict[int, Placed] = {}  # by placement: the layers share a few
        out: list[tuple[str, Placement]] = []
        for name, placed in self.tensors:
            if id(placed) not in cache:
                cache[id(placed)] = _remesh(name, placed, mesh, ranks, everyone)
            out.append((name, cache[id(placed)]))
        return StateLayout(world, tuple(out))

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        meshes: dict[str, int] = {}
        table = []
        out_meshes = []
        for name, placed in self.tensors:
            if isinstance(placed, Boxes):
                table.append([name, *placed.to_json()])
                continue
            key = json.dumps([placed.to_json()[0], placed.to_json()[2]])
            if key not in meshes:
                meshes[key] = len(out_meshes)
                out_meshes.append([placed.to_json()[0], list(placed.ranks)])
            table.append([name, meshes[key], [placement_text(p) for p in placed.placements]])
        return {"world_size": self.world_size, "meshes": out_meshes, "tensors": table}

    @classmethod
    def from_json(cls, obj: Any) -> StateLayout:
        """The layout ``to_json`` wrote; SpecError / LayoutError saying what is wrong otherwise."""
        try:
            meshes = [(NamedMesh(tuple((n, s) for n, s in dims)), tuple(ranks)) for dims, ranks in obj["meshes"]]
            tensors = []
            for name, idx, placements in obj["tensors"]:
                if idx == "boxes" and isinstance(name, str):
                    tensors.append((name, Boxes.from_json([idx, placements])))
                    continue
                if not isinstance(name, str) or type(idx) is not int or not 0 <= idx < len(meshes):
                    raise SpecError(f"tensor entry {[name, idx]!r} names no mesh of the layout")
                mesh, ranks = meshes[idx]
                if not all(type(r) is int for r in ranks):
                    raise SpecError(f"job ranks {ranks!r} are not integers")
                tensors.append((name, Placed(mesh, tuple(parse_placement(p) for p in placements), ranks)))
            world = obj["world_size"]
            if type(world) is not int:
                raise SpecError(f"world_size {world!r} is not an integer")
            return cls(world, tuple(tensors))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, (SpecError, LayoutError)):
                raise
            raise SpecError(f"malformed state-dict layout ({type(e).__name__}: {e})") from None


def _pieces(shape: tuple[int, ...], box: tuple[tuple[range, ...], ...], count: PanelArg) -> list[Any]:
    return [] if any(sum(len(r) for r in b) == 0 for b in box) else panel_pieces(shape, box, count)


@lru_cache(maxsize=4096)
def _table(shape: tuple[int, ...], order: tuple[int, ...], placed: Placed,
           panels: PanelArg | None = None) -> SegmentTable:
    local = holder_table(shape, placed.mesh, placed.placements, order, right_to_left=True, panels=panels)
    ranks = np.asarray(placed.ranks, dtype=np.int64)[local.rank]
    by_rank = np.argsort(ranks, kind="stable")
    return SegmentTable.from_columns(ranks[by_rank], local.local[by_rank], local.start[by_rank],
                                     local.length[by_rank])


@lru_cache(maxsize=4096)
def _box_table(shape: tuple[int, ...], order: tuple[int, ...], boxes: Boxes,
               panels: PanelArg | None = None) -> SegmentTable:
    """Every holder's segments of its box, in canonical order (``order``), sorted by rank."""
    cols: list[tuple[np.ndarray, ...]] = []
    for r, o, z in sorted(boxes.chunks):
        local, start, length = box_segments(shape, tuple((range(a, a + n),) for a, n in zip(o, z)), order,
                                            panels=panels)
        cols.append((np.full(len(local), r, dtype=np.int64), local, start, length))
    if not cols:
        empty = np.zeros(0, dtype=np.int64)
        return SegmentTable.from_columns(empty, empty, empty, empty)
    return SegmentTable.from_columns(*(np.concatenate(c) for c in zip(*cols)))


#: The placement a tensor takes on a new mesh dim its old mesh lacked, by dim name (the rest are unknown).
NEW_DIM_PLACEMENTS: dict[str, MeshPlacement] = {"dp_replicate": Replicate()}


def _remesh(name: str, placed: Placement, mesh: NamedMesh, ranks: tuple[int, ...],
            everyone: tuple[int, ...]) -> Placed:
    """One tensor's ``StateLayout.remesh``."""
    if isinstance(placed, Boxes):
        raise LayoutError(f"{name} is placed by boxes (chunks of a saved checkpoint), not on a named mesh: its "
                          "layout on another mesh cannot be told")
    if placed == Placed.replicated(placed.ranks) and tuple(sorted(placed.ranks)) == everyone:
        return Placed.replicated(ranks)  # a plain tensor every rank holds
    if placed.ranks != everyone:
        raise LayoutError(f"{name} lives on job ranks {list(placed.ranks)[:8]} of the {len(everyone)}, not on the "
                          f"whole job's mesh numbered row-major (a pipeline stage's sub-mesh?): its layout on the mesh "
                          f"{mesh} cannot be told")
    old = dict(zip(placed.mesh.names, placed.placements))
    placements: list[MeshPlacement] = []
    for dim in mesh.names:
        if dim in old:
            placements.append(old[dim])
        elif dim in NEW_DIM_PLACEMENTS:
            placements.append(NEW_DIM_PLACEMENTS[dim])
        else:
            raise LayoutError(f"{name}: the new mesh {mesh} has a dim {dim!r} its mesh {placed.mesh} lacks, and "
                              f"its placement there cannot be told (only {sorted(NEW_DIM_PLACEMENTS)} can)")
    # FSDP2 over TP: the split factor is what the dims after it split the same tensor dim into
    for i, p in enumerate(placements):
        if not isinstance(p, StridedShard):
            continue
        j = placed.mesh.index(mesh.names[i])
        before = math.prod(s for (_, s), q in zip(placed.mesh.dims[j + 1:], placed.placements[j + 1:])
                           if q == Shard(p.dim))
        if before != p.split_factor:
            raise LayoutError(f"{name}: {p} on mesh dim {mesh.names[i]} of {placed.mesh}, but the dims after it split "
                              f"dim {p.dim} into {before}: its split factor on another mesh cannot be told")
        after = math.prod(s for (_, s), q in zip(mesh.dims[i + 1:], placements[i + 1:]) if q == Shard(p.dim))
        placements[i] = StridedShard(p.dim, after) if after > 1 else Shard(p.dim)
    return Placed(mesh, tuple(placements), ranks)
