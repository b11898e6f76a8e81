"""Parallelizable tensor collections: logical tensors plus how a (DP, TP, PP) layout partitions them.

Every partitioning is reduced to one idea: 1-D intervals over the tensor's *canonical flat
order*. The canonical order of a tensor moves its TP-split dimension to the front (a
replicated tensor keeps its natural order) and flattens row-major. In that order

* a TP shard is one contiguous interval (or one per fused block, plus zero padding for a
  padded vocabulary), and
* a DP fragment of the distributed optimizer is a contiguous range of the TP shard's
  canonical flat order, so again at most one interval per block.

A rank's piece of a tensor is therefore a short list of segments ``(local_offset,
global_offset, length)`` where ``global_offset == -1`` marks zero padding. Planning,
sharding, checkpoint layout and loading all work on these segments, never on N-d boxes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np
import torch

from ..errors import LayoutError, SpecError

__all__ = [
    "Layout",
    "ParallelGrid",
    "Replicated",
    "Split",
    "Panels",
    "TPSpec",
    "Placement",
    "TensorSpec",
    "SegmentTable",
    "PTC",
    "dtype_from_str",
    "dtype_to_str",
]

PAD = -1  # global offset of a zero-padding segment

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise SpecError(f"unsupported dtype {dtype}; supported: {', '.join(_DTYPES)}")
    return name


def dtype_from_str(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise SpecError(f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}") from None


# ---------------------------------------------------------------------------------------------
# Partition specs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Replicated:
    """Every TP rank holds the whole tensor."""


@dataclass(frozen=True, slots=True)
class Split:
    """Split along ``dim`` across TP ranks.

    ``blocks``: the dimension is a concatenation of blocks of these sizes (fused QKV under
    GQA, SwiGLU [gate; up]); each block is split separately and a rank holds its part of
    every block, in block order.
    ``pad_multiple``: vocabulary padding; the dimension is padded with zero rows to a
    multiple of ``pad_multiple * tp`` before splitting (padding is dropped on unshard).
    """

    dim: int = 0
    blocks: tuple[int, ...] | None = None
    pad_multiple: int | None = None

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise SpecError(f"Split.dim must be >= 0, got {self.dim}")
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
            if not self.blocks or any(b <= 0 for b in self.blocks):
                raise SpecError(f"Split.blocks must be positive sizes, got {self.blocks}")
            if self.pad_multiple is not None:
                raise SpecError(f"Split takes blocks or pad_multiple, not both (got blocks={self.blocks}, "
                                f"pad_multiple={self.pad_multiple})")
        if self.pad_multiple is not None and self.pad_multiple < 1:
            raise SpecError(f"Split.pad_multiple must be >= 1, got {self.pad_multiple}")


@dataclass(frozen=True, slots=True)
class Panels:
    """Not a TP split but a canonical order, for torch-native state dicts (``tenplex.layout.state_layout``):
    dim ``dim`` (the columns, only dim 1) of a tensor of shape ``(R, C, ...)`` cut into ``count``
    equal panels of ``W = C // count`` columns, stored panel after panel, each panel row-major: the
    order of ``t.reshape(R, count, W, ...).permute(1, 0, 2, ...).flatten()``. A row range is
    ``count`` intervals, a column range that panels align with one interval per run of whole
    panels, both together (rows of a column shard) one interval per panel. ``edges``: panels of
    unequal widths instead, the columns ``(0, e1, ..., C)`` where they start and end (for column
    counts that ``count`` does not divide: the union of the TP cuts, so TP shards are whole panels).
    ``ParallelConfig`` layouts do not take it (SpecError)."""

    dim: int = 1
    count: int = 1
    edges: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dim != 1:
            raise SpecError(f"Panels cuts dim 1 (the columns) only, got dim={self.dim}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise SpecError(f"Panels.count must be an integer >= 1, got {self.count!r}")
        if self.edges is not None:
            edges = tuple(self.edges)
            if (len(edges) != self.count + 1 or any(type(e) is not int for e in edges) or edges[0] != 0
                    or any(b <= a for a, b in zip(edges, edges[1:]))):
                raise SpecError(f"Panels.edges must be {self.count} + 1 = {self.count + 1} integers rising strictly "
                                f"from 0, got {self.edges!r}")
            object.__setattr__(self, "edges", edges)

    def bounds(self, ncols: int) -> tuple[int, ...]:
        """The column edges ``(0, ..., ncols)`` of the panels of a tensor of ``ncols`` columns."""
        if self.edges is not None:
            return self.edges
        return tuple(i * (ncols // self.count) for i in range(self.count + 1))


TPSpec = Union[Replicated, Split, Panels]

# Pipeline placement: a layer index, or one of these words.
Placement = Union[int, str]
_PLACEMENT_WORDS = ("first", "last", "both", "all")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One logical tensor: name, global shape, dtype and how layouts partition it.

    ``placement``: the transformer layer index it belongs to, ``"first"`` (embeddings),
    ``"last"`` (final norm, LM head), ``"both"`` (tied embedding: first and last stage) or
    ``"all"`` (every stage). ``dp_sharded``: the TP shard is split into equal flat fragments
    across DP ranks (distributed optimizer / ZeRO-1), padded with zeros to a multiple of DP.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    tp: TPSpec = field(default_factory=Replicated)
    placement: Placement = "all"
    dp_sharded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name:
            raise SpecError("a tensor needs a non-empty name")
        if any(s < 0 for s in self.shape):
            raise SpecError(f"{self.name}: negative size in shape {self.shape}")
        if isinstance(self.placement, bool) or not (
            (isinstance(self.placement, int) and self.placement >= 0) or self.placement in _PLACEMENT_WORDS
        ):
            raise SpecError(
                f"{self.name}: placement must be a layer index >= 0 or one of {_PLACEMENT_WORDS}, "
                f"got {self.placement!r}"
            )
        if isinstance(self.tp, Panels) and self.tp.edges is None and (len(self.shape) < 2
                                                                      or self.shape[1] % self.tp.count):
            raise SpecError(f"{self.name}: {self.tp.count} panels need >= 2 dims and a dim 1 they divide, "
                            f"got shape {self.shape}")
        if isinstance(self.tp, Panels) and self.tp.edges is not None and (len(self.shape) < 2
                                                                          or self.tp.edges[-1] != self.shape[1]):
            raise SpecError(f"{self.name}: panel edges {list(self.tp.edges)} need >= 2 dims and must end at dim 1, "
                            f"got shape {self.shape}")
        if isinstance(self.tp, Split):
            if self.tp.dim >= len(self.shape):
                raise SpecError(f"{self.name}: split dim {self.tp.dim} but the tensor has {len(self.shape)} dims")
            if self.tp.blocks is not None and sum(self.tp.blocks) != self.shape[self.tp.dim]:
                raise SpecError(
                    f"{self.name}: blocks {'+'.join(map(str, self.tp.blocks))} = {sum(self.tp.blocks)} "
                    f"but dim {self.tp.dim} has size {self.shape[self.tp.dim]}"
                )

    # -- shape arithmetic ---------------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def split_dim(self) -> int | None:
        return self.tp.dim if isinstance(self.tp, Split) else None

    @property
    def panels(self) -> int | tuple[int, ...] | None:
        """The panel count of a panel-ordered tensor (``Panels``), its column edges for unequal panels,
        else None (what ``mesh.panel_pieces`` takes)."""
        if not isinstance(self.tp, Panels):
            return None
        return self.tp.count if self.tp.edges is None else self.tp.edges

    @property
    def natural(self) -> bool:
        """Whether the canonical order is the natural row-major order (no split dim > 0, no panels),
        so a contiguous local tensor is its own flat buffer."""
        return self.split_dim in (None, 0) and self.panels is None

    def _no_panels(self, what: str) -> None:
        if isinstance(self.tp, Panels):
            raise SpecError(f"{self.name}: a panel-ordered tensor (Panels({self.tp.count})) is for state-dict "
                            f"layouts (tenplex.layout.state_layout.StateLayout); a ParallelConfig layout cannot {what} it")

    def _panel_view(self) -> tuple[int, ...]:
        assert isinstance(self.tp, Panels)
        return (self.shape[0], self.tp.count, self.shape[1] // self.tp.count) + self.shape[2:]

    def _panel_blocks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The columns of each panel of the global ``tensor`` (unequal panels)."""
        assert isinstance(self.tp, Panels)
        edges = self.tp.bounds(self.shape[1])
        return [tensor.narrow(1, a, b - a) for a, b in zip(edges, edges[1:])]

    def canonical_shape(self) -> tuple[int, ...]:
        if isinstance(self.tp, Panels) and self.tp.edges is not None:
            return (self.numel,)
        if isinstance(self.tp, Panels):
            v = self._panel_view()
            return (v[1], v[0]) + v[2:]
        d = self.split_dim
        if d is None:
            return self.shape
        return (self.shape[d],) + self.shape[:d] + self.shape[d + 1 :]

    def to_canonical(self, tensor: torch.Tensor) -> torch.Tensor:
        """The global tensor as a contiguous 1-D tensor in canonical order."""
        if isinstance(self.tp, Panels) and self.tp.edges is not None:
            return torch.cat([p.contiguous().reshape(-1) for p in self._panel_blocks(tensor.reshape(self.shape))])
        if isinstance(self.tp, Panels):
            return tensor.reshape(self._panel_view()).movedim(1, 0).contiguous().reshape(-1)
        d = self.split_dim
        t = tensor if d in (None, 0) else tensor.movedim(d, 0)
        return t.contiguous().reshape(-1)

    def from_canonical(self, flat: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Inverse of ``to_canonical`` for a (local) tensor with ``rows`` along the split dim."""
        if isinstance(self.tp, Panels) and self.tp.edges is not None:
            out = flat.new_empty(self.shape)
            pos = 0
            for part in self._panel_blocks(out):
                part.copy_(flat[pos:pos + part.numel()].view(part.shape))
                pos += part.numel()
            return out
        if isinstance(self.tp, Panels):
            v = self._panel_view()
            return flat.reshape((v[1], v[0]) + v[2:]).movedim(0, 1).contiguous().reshape(self.shape)
        d = self.split_dim
        if d is None:
            return flat.reshape(self.shape)
        cshape = self.canonical_shape()
        cshape = (cshape[0] if rows is None else rows,) + cshape[1:]
        t = flat.reshape(cshape)
        return t if d == 0 else t.movedim(0, d).contiguous()

    def check_tp(self, tp: int) -> None:
        """Raise LayoutError if ``tp`` cannot split this tensor (SpecError for a panel-ordered one)."""
        self._no_panels("split")
        if not isinstance(self.tp, Split) or self.tp.pad_multiple is not None:
            return
        d = self.tp.dim
        for size in self.tp.blocks or (self.shape[d],):
            if size % tp:
                what = "block" if self.tp.blocks else "dim"
                raise LayoutError(
                    f"tp={tp} does not divide {what} of size {size} along dim {d} of {self.name} "
                    f"(shape {self.shape}): {size} % {tp} = {size % tp}"
                )

    def padded_rows(self, tp: int) -> int:
        """Rows along the split dim after vocabulary padding (the dim itself without padding)."""
        assert isinstance(self.tp, Split)
        rows = self.shape[self.tp.dim]
        if self.tp.pad_multiple is None:
            return rows
        unit = self.tp.pad_multiple * tp
        return -(-rows // unit) * unit

    def tp_segments(self, tp: int, t: int) -> list[tuple[int, int, int]]:
        """Segments (local_off, global_off, length) of TP rank ``t``'s shard in canonical order."""
        self._no_panels("split")
        if not isinstance(self.tp, Split):
            return [(0, 0, self.numel)]
        self.check_tp(tp)
        rows = self.shape[self.tp.dim]
        row = self.numel // rows if rows else 0
        pieces: list[tuple[int, int]] = []  # (global_off or PAD, length)
        if self.tp.blocks is not None:
            start = 0
            for b in self.tp.blocks:
                per = b // tp
                pieces.append(((start + t * per) * row, per * row))
                start += b
        else:
            per = self.padded_rows(tp) // tp
            lo = t * per
            real = max(0, min(lo + per, rows) - lo)
            if real:
                pieces.append((lo * row, real * row))
            if per - real:
                pieces.append((PAD, (per - real) * row))
        out, local = [], 0
        for g, n in pieces:
            if n:
                out.append((local, g, n))
            local += n
        return out

    def local_rows(self, tp: int) -> int:
        assert isinstance(self.tp, Split)
        if self.tp.blocks is not None:
            return sum(b // tp for b in self.tp.blocks)
        return self.padded_rows(tp) // tp

    def tp_local_numel(self, tp: int) -> int:
        self._no_panels("split")
        if not isinstance(self.tp, Split):
            return self.numel
        rows = self.shape[self.tp.dim]
        row = self.numel // rows if rows else 0
        return self.local_rows(tp) * row

    def fragment_numel(self, cfg: ParallelGrid) -> int:
        """Length of one DP fragment (distributed optimizer), padding included."""
        return -(-self.tp_local_numel(cfg.tp) // cfg.dp)

    def segments(self, cfg: ParallelGrid, tp_index: int, dp_index: int) -> list[tuple[int, int, int]]:
        """Segments of the local shard held at (tp_index, dp_index) under ``cfg``."""
        segs = self.tp_segments(cfg.tp, tp_index)
        if not self.dp_sharded:
            return segs
        n = self.tp_local_numel(cfg.tp)
        c = -(-n // cfg.dp)
        f0, f1 = dp_index * c, (dp_index + 1) * c
        out = []
        for lo, g, ln in segs:
            s, e = max(lo, f0), min(lo + ln, f1)
            if e > s:
                out.append((s - f0, PAD if g == PAD else g + (s - lo), e - s))
        real_end = min(n, f1)
        if f1 > max(real_end, f0):  # zero padding that makes every fragment the same length
            start = max(real_end, f0)
            out.append((start - f0, PAD, f1 - start))
        return out

    def local_shape(self, cfg: ParallelGrid) -> tuple[int, ...]:
        """Natural shape of a rank's local shard (1-D for a DP-sharded tensor)."""
        self._no_panels("place")
        if self.dp_sharded:
            return (self.fragment_numel(cfg),)
        if not isinstance(self.tp, Split):
            return self.shape
        shape = list(self.shape)
        shape[self.tp.dim] = self.local_rows(cfg.tp)
        return tuple(shape)

    def local_to_flat(self, local: torch.Tensor) -> torch.Tensor:
        """A local shard (or a DP fragment) in canonical flat order: the split dim moved to the front,
        a reshape where that is the natural order. A panel-ordered tensor's needs its layout (SpecError)."""
        self._no_panels("lay out")
        if self.dp_sharded or self.natural:
            return local.contiguous().reshape(-1)
        return local.movedim(self.split_dim, 0).contiguous().reshape(-1)

    def local_from_flat(self, flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Inverse of ``local_to_flat`` for a local shard of natural shape ``shape``."""
        self._no_panels("lay out")
        d = self.split_dim
        if self.dp_sharded or d in (None, 0):
            return flat.reshape(shape)
        return flat.reshape((shape[d],) + shape[:d] + shape[d + 1:]).movedim(0, d).contiguous()

    # -- (de)serialisation ----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        tp: dict[str, Any] = {"kind": "replicated"}
        if isinstance(self.tp, Panels):
            tp = {"kind": "panels", "dim": self.tp.dim, "count": self.tp.count}
            if self.tp.edges is not None:
                tp["edges"] = list(self.tp.edges)
        if isinstance(self.tp, Split):
            tp = {"kind": "split", "dim": self.tp.dim}
            if self.tp.blocks is not None:
                tp["blocks"] = list(self.tp.blocks)
            if self.tp.pad_multiple is not None:
                tp["pad_multiple"] = self.tp.pad_multiple
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": dtype_to_str(self.dtype),
            "tp": tp,
            "placement": self.placement,
            "dp_sharded": self.dp_sharded,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorSpec:
        """The spec ``to_json`` wrote; SpecError (a ValueError) naming the field for anything else (a damaged file)."""

        def ints(v: Any) -> bool:
            return isinstance(v, list) and all(type(x) is int for x in v)

        if not isinstance(obj, Mapping):
            raise SpecError(f"a tensor spec must be an object, got {obj!r}")
        name = obj.get("name")
        where = f"tensor spec {name!r}"
        tpj = obj.get("tp")
        if not isinstance(name, str) or not isinstance(obj.get("dtype"), str):
            raise SpecError(f"{where}: name and dtype must be strings, got {type(name).__name__} and "
                            f"{type(obj.get('dtype')).__name__}")
        if not ints(obj.get("shape")):
            raise SpecError(f"{where}: shape {obj.get('shape')!r} is not a list of integers")
        if not isinstance(tpj, Mapping) or tpj.get("kind") not in ("replicated", "split", "panels"):
            raise SpecError(f"{where}: tp {tpj!r} is not {{kind: replicated|split|panels, ...}}")
        placement, dp_sharded = obj.get("placement"), obj.get("dp_sharded")
        if type(placement) not in (int, str) or type(dp_sharded) is not bool:
            raise SpecError(f"{where}: placement {placement!r} or dp_sharded {dp_sharded!r} has the wrong type")
        tp: TPSpec = Replicated()
        if tpj["kind"] == "panels":
            edges = tpj.get("edges")
            if type(tpj.get("dim")) is not int or type(tpj.get("count")) is not int or not (
                    edges is None or ints(edges)):
                raise SpecError(f"{where}: panels {tpj!r} needs an integer dim and count, integer edges")
            tp = Panels(dim=tpj["dim"], count=tpj["count"], edges=None if edges is None else tuple(edges))
        if tpj["kind"] == "split":
            blocks, pad = tpj.get("blocks"), tpj.get("pad_multiple")
            if type(tpj.get("dim")) is not int or not (blocks is None or ints(blocks)) or not (
                    pad is None or type(pad) is int):
                raise SpecError(f"{where}: split {tpj!r} needs an integer dim, integer blocks and pad_multiple")
            tp = Split(dim=tpj["dim"], blocks=tuple(blocks) if blocks else None, pad_multiple=pad)
        return cls(name=name, shape=tuple(obj["shape"]), dtype=dtype_from_str(obj["dtype"]), tp=tp,
                   placement=placement, dp_sharded=dp_sharded)


# ---------------------------------------------------------------------------------------------
# Segment tables: every holder of a tensor under a layout, as numpy columns
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SegmentTable:
    """Segments of one tensor held by every rank of a layout (zero padding excluded).

    Columns are numpy int64 arrays of equal length: ``rank``, ``local`` (offset in the
    rank's canonical flat shard), ``start`` (global canonical offset), ``length``.
    """

    rank: np.ndarray
    local: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)

    @classmethod
    def from_columns(cls, rank: Any, local: Any, start: Any, length: Any) -> SegmentTable:
        """A table from four equally long integer columns, stored as read-only contiguous int64
        arrays (tables are cached and shared, so nobody may change one in place)."""
        cols = [np.array(c, dtype=np.int64).reshape(-1) for c in (rank, local, start, length)]
        if len({len(c) for c in cols}) != 1:
            raise SpecError(f"segment table columns differ in length: {[len(c) for c in cols]}")
        for c in cols:
            c.setflags(write=False)
        return cls(*cols)


# ---------------------------------------------------------------------------------------------
# Layouts: what the collection asks of one
# ---------------------------------------------------------------------------------------------
@runtime_checkable
class Layout(Protocol):
    """Where every byte of a collection lives under a job of ``world_size`` ranks: which ranks hold
    each tensor and which segments of its canonical flat order. ``PTC`` asks only this;
    ``config.ParallelConfig`` derives the answers from (DP, TP, PP) and the specs,
    ``state_layout.StateLayout`` from a torch-native state dict's per-tensor placements.

    ``num_layers`` is the collection's layer count: a pipeline layout maps a layer-placed tensor to
    its stage by it, a layout that places every tensor itself ignores it."""

    @property
    def world_size(self) -> int: ...

    def check(self, ptc: PTC) -> None:
        """LayoutError / ConfigError / SpecError unless this layout can hold ``ptc``."""

    def rank_tensors(self, ptc: PTC, rank: int) -> list[str]:
        """Names of the tensors of ``ptc`` that ``rank`` holds, in collection order."""

    def holder_table(self, spec: TensorSpec, num_layers: int = 0) -> SegmentTable:
        """Every (rank, segment) holding real (non-padding) bytes of ``spec``, sorted by rank."""

    def segments(self, spec: TensorSpec, rank: int) -> list[tuple[int, int, int]]:
        """Segments (local_off, global_off or -1 for padding, length) of ``rank``'s shard of ``spec``."""

    def local_shape(self, spec: TensorSpec, rank: int) -> tuple[int, ...]:
        """Natural shape of ``rank``'s local tensor of ``spec``."""

    def to_local_flat(self, spec: TensorSpec, rank: int, local: torch.Tensor) -> torch.Tensor:
        """``rank``'s natural local tensor of ``spec`` in canonical flat order."""

    def from_local_flat(self, spec: TensorSpec, rank: int, flat: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of ``to_local_flat``: a tensor of ``local_shape(spec, rank)`` (a new one, or ``out``
        filled)."""


class ParallelGrid(Protocol):
    """What a spec's own DP/TP arithmetic and ``PTC.stages_of`` read of a (DP, TP, PP) layout
    (``config.ParallelConfig``): named structurally, so this module needs no import of it."""

    @property
    def dp(self) -> int: ...

    @property
    def tp(self) -> int: ...

    def stages_of(self, placement: Placement, num_layers: int) -> tuple[int, ...]:
        """The pipeline stages holding a tensor placed at ``placement`` of a ``num_layers``-layer model."""


# ---------------------------------------------------------------------------------------------
# The collection
# ---------------------------------------------------------------------------------------------
class PTC:
    """A parallelizable tensor collection: logical tensors, their partition specs, and the
    names of small global objects (step counter, scheduler, data position) carried along.

    >>> ptc = PTC([TensorSpec("w", (8, 4), tp=Split(0), placement=0)], num_layers=1)
    >>> shards = ptc.shard({"w": torch.zeros(8, 4)}, ParallelConfig(tp=2))  # any Layout
    """

    def __init__(
        self,
        tensors: Iterable[TensorSpec],
        *,
        num_layers: int | None = None,
        objects: Iterable[str] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        specs: dict[str, TensorSpec] = {}
        for spec in tensors:
            if spec.name in specs:
                raise SpecError(f"tensor {spec.name!r} is listed twice in the PTC")
            specs[spec.name] = spec
        layers = [s.placement for s in specs.values() if isinstance(s.placement, int)]
        inferred = max(layers) + 1 if layers else 0
        if num_layers is None:
            num_layers = inferred
        elif num_layers < inferred:
            raise SpecError(f"num_layers={num_layers} but a tensor belongs to layer {inferred - 1}")
        self.tensors: Mapping[str, TensorSpec] = specs
        self.num_layers: int = num_layers
        self.objects: tuple[str, ...] = tuple(objects)
        clash = set(self.objects) & set(specs)
        if clash:
            raise SpecError(f"names used both as tensor and object: {sorted(clash)}")
        self.meta: dict[str, Any] = dict(meta or {})
        self._fingerprint: str | None = None
        self._split_specs: list[TensorSpec] | None = None  # one spec per distinct (shape, split), for check()

    # -- basic facts --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"PTC({len(self.tensors)} tensors, {self.nbytes / 2**20:.1f} MiB, {self.num_layers} layers)"

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())

    def numel(self) -> int:
        return sum(s.numel for s in self.tensors.values())

    def check(self, cfg: Layout) -> None:
        """Raise LayoutError/ConfigError if ``cfg`` cannot hold this collection."""
        cfg.check(self)

    def distinct_specs(self) -> list[TensorSpec]:
        """One spec per distinct (shape, partition spec), in collection order: what a layout checks
        once instead of per tensor (a model's layers repeat a few shapes)."""
        if self._split_specs is None:
            distinct: dict[tuple[Any, Any], TensorSpec] = {}
            for spec in self.tensors.values():
                distinct.setdefault((spec.shape, spec.tp), spec)
            self._split_specs = list(distinct.values())
        return self._split_specs

    def stages_of(self, name: str, cfg: ParallelGrid) -> tuple[int, ...]:
        """The pipeline stages holding ``name`` under the (DP, TP, PP) layout ``cfg``."""
        return cfg.stages_of(self.tensors[name].placement, self.num_layers)

    def holders(self, name: str, cfg: Layout) -> SegmentTable:
        """Every (rank, segment) holding real (non-padding) bytes of ``name`` under ``cfg``."""
        return cfg.holder_table(self.tensors[name], self.num_layers)

    def rank_tensors(self, cfg: Layout, rank: int) -> list[str]:
        """Names of the tensors rank ``rank`` holds under ``cfg``, in collection order."""
        return cfg.rank_tensors(self, rank)

    def segments(self, name: str, cfg: Layout, rank: int) -> list[tuple[int, int, int]]:
        """Segments (local_off, global_off or -1 for padding, length) of ``rank``'s shard of ``name``."""
        return cfg.segments(self.tensors[name], rank)

    def local_shape(self, name: str, cfg: Layout, rank: int = 0) -> tuple[int, ...]:
        """Natural shape of ``rank``'s shard of ``name`` (the same for every rank under a ``ParallelConfig``)."""
        return cfg.local_shape(self.tensors[name], rank)

    def rank_nbytes(self, cfg: Layout, rank: int) -> int:
        """Bytes of real (non-padding) data that ``rank`` holds under ``cfg``."""
        total = 0
        for name in self.rank_tensors(cfg, rank):
            spec = self.tensors[name]
            total += spec.itemsize * sum(ln for _, g, ln in self.segments(name, cfg, rank) if g != PAD)
        return total

    # -- shard / unshard ------------------------------------------------------------------
    def shard_tensor(self, name: str, cfg: Layout, rank: int, flat: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s local shard of ``name`` from the tensor's canonical flat global form."""
        spec = self.tensors[name]
        segs = self.segments(name, cfg, rank)
        local = torch.zeros(sum(ln for _, _, ln in segs), dtype=spec.dtype)
        for lo, g, ln in segs:
            if g != PAD:
                local[lo : lo + ln] = flat[g : g + ln]
        return self.from_local_flat(name, cfg, local, rank)

    def from_local_flat(self, name: str, cfg: Layout, local: torch.Tensor, rank: int = 0,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Reshape a canonical flat local shard into its natural local shape (``rank``'s, under a
        state-dict layout, where local shapes differ between ranks); ``out``: copied into it."""
        spec = self.tensors[name]  # a layout of the user's need not take ``out`` unless it is asked for
        if out is None:
            return cfg.from_local_flat(spec, rank, local)
        return cfg.from_local_flat(spec, rank, local, out=out)

    def relaid(self, name: str) -> bool:
        """Whether a local shard's canonical (split dim first, or panel) order may differ from its
        natural row-major order, so converting between them is a strided copy, not a reshape."""
        spec = self.tensors[name]
        return not spec.dp_sharded and not spec.natural

    def to_local_flat(self, name: str, local: torch.Tensor, cfg: Layout | None = None, rank: int = 0) -> torch.Tensor:
        """A local shard in canonical flat order (inverse of ``from_local_flat``); a panel-ordered
        tensor's needs the state-dict layout ``cfg`` and the ``rank`` holding it (which columns it has)."""
        spec = self.tensors[name]
        if cfg is None:
            return spec.local_to_flat(local)
        return cfg.to_local_flat(spec, rank, local)

    def shard(self, global_state: Mapping[str, Any], cfg: Layout) -> dict[int, dict[str, Any]]:
        """Split global tensors into ``{rank: {name: local shard}}``; objects go to every rank."""
        self.check(cfg)
        missing = [n for n in self.tensors if n not in global_state]
        if missing:
            raise KeyError(f"global state lacks {len(missing)} tensors of the PTC, e.g. {missing[:3]}")
        flats = {}
        for name, spec in self.tensors.items():
            t = global_state[name]
            if tuple(t.shape) != spec.shape:
                raise SpecError(f"{name}: global tensor has shape {tuple(t.shape)}, the PTC says {spec.shape}")
            flats[name] = spec.to_canonical(t.to(spec.dtype))
        out: dict[int, dict[str, Any]] = {}
        for rank in range(cfg.world_size):
            shard: dict[str, Any] = {
                name: self.shard_tensor(name, cfg, rank, flats[name]) for name in self.rank_tensors(cfg, rank)
            }
            for obj in self.objects:
                if obj in global_state:
                    shard[obj] = global_state[obj]
            out[rank] = shard
        return out

    def unshard(self, shards: Mapping[int, Mapping[str, Any]], cfg: Layout) -> dict[str, Any]:
        """Rebuild the global tensors from every rank's shard (exact inverse of ``shard``)."""
        self.check(cfg)
        out: dict[str, Any] = {}
        for name, spec in self.tensors.items():
            flat = torch.empty(spec.numel, dtype=spec.dtype)
            covered: list[tuple[int, int]] = []
            for rank in sorted(shards):
                if name not in shards[rank]:
                    continue
                local = self.to_local_flat(name, shards[rank][name], cfg, rank)
                for lo, g, ln in self.segments(name, cfg, rank):
                    if g != PAD:
                        flat[g : g + ln] = local[lo : lo + ln]
                        covered.append((g, g + ln))
            gap = _first_gap(covered, spec.numel)
            if gap is not None:
                raise SpecError(f"cannot unshard {name}: no rank holds elements from {gap} (canonical order)")
            rows = spec.shape[spec.split_dim] if spec.split_dim is not None else None
            out[name] = spec.from_canonical(flat, rows=rows)
        for obj in self.objects:
            for rank in sorted(shards):
                if obj in shards[rank]:
                    out[obj] = shards[rank][obj]
                    break
        return out

    # -- identity and (de)serialisation --------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "objects": list(self.objects),
            "meta": self.meta,
            "tensors": [s.to_json() for s in self.tensors.values()],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PTC:
        """The PTC ``to_json`` wrote; SpecError (a ValueError) saying what is wrong for anything else (a damaged file)."""
        if not isinstance(obj, Mapping):
            raise SpecError(f"a PTC description must be an object, got {type(obj).__name__}")
        tensors, objects, meta = obj.get("tensors"), obj.get("objects", []), obj.get("meta")
        if not isinstance(tensors, list) or type(obj.get("num_layers")) is not int:
            raise SpecError(f"a PTC description needs a list of tensors and an integer num_layers, got tensors of "
                            f"type {type(tensors).__name__} and num_layers={obj.get('num_layers')!r}")
        if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
            raise SpecError(f"PTC objects {objects!r} must be a list of names")
        if meta is not None and not isinstance(meta, Mapping):
            raise SpecError(f"PTC meta {meta!r} must be an object")
        try:
            return cls((TensorSpec.from_json(t) for t in tensors), num_layers=obj["num_layers"], objects=objects,
                       meta=meta)
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # a description from_json did not foresee
            raise SpecError(f"malformed PTC description ({type(e).__name__}: {e})") from None

    def fingerprint(self) -> str:
        """Hash of the tensors' names, shapes, dtypes and specs (not of meta); computed once
        (the specs are frozen and the tensor mapping is not changed after construction)."""
        if self._fingerprint is None:
            body = json.dumps([s.to_json() for s in self.tensors.values()], sort_keys=True)
            self._fingerprint = hashlib.sha256(body.encode()).hexdigest()[:16]
        return self._fingerprint

    def diff(self, other: PTC, limit: int = 3) -> list[str]:
        """Human-readable differences to ``other`` (empty when the specs match)."""
        out = []
        mine, theirs = set(self.tensors), set(other.tensors)
        if mine - theirs:
            out.append(f"only in this model: {sorted(mine - theirs)[:limit]}")
        if theirs - mine:
            out.append(f"only in the other: {sorted(theirs - mine)[:limit]}")
        for name in sorted(mine & theirs):
            a, b = self.tensors[name].to_json(), other.tensors[name].to_json()
            if a != b:
                out.append(f"{name}: {a} != {b}")
                if len(out) > limit:
                    break
        return out


def _first_gap(intervals: list[tuple[int, int]], n: int) -> tuple[int, int] | None:
    pos = 0
    for a, b in sorted(intervals):
        if a > pos:
            return (pos, a)
        pos = max(pos, b)
    return (pos, n) if pos < n else None
