"""Save and load torch-native state dicts (DTensors, plain tensors, other values) the DCP way (#17).

``save_state_dict(state_dict, url, step=...)`` and ``load_state_dict(state_dict, url)`` are
called by every rank, like ``torch.distributed.checkpoint.save`` / ``load``, with the state dict
the job already has (``get_state_dict(model, optimizer)`` plus anything else). tenplex derives
the layout from the values themselves: a DTensor's mesh and placements (FSDP2, HSDP, TP,
FSDP2 over TP, pipeline stages on sub-meshes, a replica per sub-mesh where ranks hold one tensor
on different sub-meshes of the same dims), a plain tensor is held whole by the ranks that
have it, anything else is a small object. The result is an ordinary tenplex checkpoint (the
same atomic steps, checksums and partial reads as ``tenplex.save``), and a load under any other
mesh or world size reads only the byte ranges each rank's local tensors need, straight into the
caller's memory.

Keys: nested dicts are flattened with ``.`` (``{"model": {"w": t}}`` is ``model.w``), as DCP does.
Values that differ between ranks under one key (an RNG state) are saved from one of them: give
such values per-rank keys.

``Stateful`` values (``torch.distributed.checkpoint.stateful.Stateful``: an object with
``state_dict()`` and ``load_state_dict()``, such as a module, an optimizer, torchtitan's
``OptimizersContainer``) at the top level of the state dict are treated as DCP treats them: a save
stores ``value.state_dict()`` under the value's key, a load fills ``value.state_dict()`` in place
and then calls ``value.load_state_dict`` with it. Loads may ask for a subset of the checkpoint's
keys (DCP's rule; ``strict=True`` refuses that).
"""

from __future__ import annotations

import gc
import logging
import pickle
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..checkpoint.catalog import list_steps
from ..checkpoint.load import LoadResult, LoadStats, ReadOptions, ShardSink, load
from ..checkpoint.part_reader import Scatter
from ..checkpoint.writer import SaveResult, save
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CheckpointWriteError,
    LayoutError,
)
from ..layout.mesh import NamedMesh
from ..layout.ptc import PTC, TensorSpec, dtype_to_str
from ..layout.state_layout import Placed, StateLayout, merge_replicas, parse_placement, placement_text, spec_for
from .agree import agree_step

__all__ = ["StateDictLoad", "save_state_dict", "load_state_dict", "flatten_state_dict", "state_layout_of",
           "describe_state_dict", "local_shard", "fill_state_dict", "is_stateful", "stateful_view", "StepSource",
           "UrlSource", "load_state_dict_from"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StateDictLoad:
    """What ``load_state_dict`` loaded: the step, the ``extra`` saved with it, the data bytes this rank
    read and the bytes its tensors needed (``bytes_read / bytes_needed`` is the read amplification),
    and the newer attempts passed over because they did not verify; ``stats``: the reader's own counts."""

    step: int
    extra: Any
    bytes_read: int
    bytes_needed: int
    seconds: float
    skipped: tuple[tuple[int, str, str], ...] = ()
    stats: LoadStats | None = None


# ---------------------------------------------------------------------------------------------
# flattening
# ---------------------------------------------------------------------------------------------
Leaf = tuple[MutableMapping[str, Any], str, Any]
"""A state-dict value with the mapping that holds it and its key there (to replace it in place)."""


def flatten_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Leaf]:
    """Every leaf of a nested state dict by its dotted key (DCP's flattening of nested dicts).
    CheckpointValueError for keys that are not strings or that two paths share."""
    out: dict[str, Leaf] = {}

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise CheckpointValueError(f"state dict key {key!r} under {prefix or 'the top level'!r} is not a "
                                           "string: use string keys (module and parameter names)")
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, Mapping) and value and not isinstance(value, torch.Tensor):
                walk(value, name)
                continue
            if name in out:
                raise CheckpointValueError(f"two entries of the state dict flatten to the key {name!r}: rename one")
            out[name] = (mapping, key, value)  # type: ignore[assignment]

    if not isinstance(state_dict, Mapping):
        raise CheckpointValueError(f"a state dict is a mapping of names to values, got {type(state_dict).__name__}")
    walk(state_dict, "")
    return out


def is_stateful(value: Any) -> bool:
    """``isinstance(value, torch.distributed.checkpoint.stateful.Stateful)`` without importing DCP (0.4 s):
    that runtime-checkable protocol asks for non-None ``state_dict`` and ``load_state_dict`` attributes."""
    return getattr(value, "state_dict", None) is not None and getattr(value, "load_state_dict", None) is not None


def stateful_view(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A shallow copy of ``state_dict`` with every top-level ``Stateful`` value replaced by its
    ``state_dict()`` (what DCP's ``save`` and ``load`` do, top level only), and those values by key:
    a load fills the copy, then hands each its part (``load_state_dict``)."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointValueError(f"a state dict is a mapping of names to values, got {type(state_dict).__name__}")
    statefuls = {k: v for k, v in state_dict.items() if is_stateful(v)}
    if not statefuls:
        return dict(state_dict), statefuls
    view = {k: (v.state_dict() if k in statefuls else v) for k, v in state_dict.items()}
    return view, statefuls


def _local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    from torch.distributed.tensor import DTensor  # lazy: 1.5 s of imports every trainer process need not pay

    return value.to_local() if isinstance(value, DTensor) else value


def _describe(value: torch.Tensor, group: Any, meshes: dict[int, Any], *,
              root: bool = False) -> tuple[Any, ...]:
    """A tensor's global shape, dtype and (DTensors) mesh, placements and job ranks, as plain data;
    ``root``: and, sixth, the dims and job ranks of the mesh its mesh was sliced from (None for a
    root, or one with ranks outside ``group``): how ranks holding one tensor on different slices
    (a replica per TP rank) are merged into one placement. ``meshes``: a cache by DeviceMesh object
    over one state dict (its tensors share a few meshes, and ``DeviceMesh.mesh`` costs about 0.5 ms:
    0.2 s for a 444-tensor state dict)."""
    from torch.distributed.tensor import DTensor  # lazy: 1.5 s of imports every trainer process need not pay

    from .dtensor import mesh_of, mesh_ranks, placement_of  # lazy: the same

    shape, dtype = tuple(int(s) for s in value.shape), dtype_to_str(value.dtype)
    if not isinstance(value, DTensor):
        return (shape, dtype, None, None, None, None) if root else (shape, dtype, None, None, None)
    device_mesh = value.device_mesh
    known = meshes.get(id(device_mesh))
    if known is None or known[0] is not device_mesh:
        ranks = _job_ranks(mesh_ranks(device_mesh), group)
        known = meshes[id(device_mesh)] = [device_mesh, [list(d) for d in mesh_of(device_mesh).dims], list(ranks),
                                           _UNKNOWN]
    if root and known[3] is _UNKNOWN:
        known[3] = _root_of(device_mesh, group)
    placements = [placement_text(placement_of(p, len(shape))) for p in value.placements]
    desc = (shape, dtype, [list(d) for d in known[1]], placements, list(known[2]))
    return desc + (known[3],) if root else desc


_UNKNOWN = object()


def _job_ranks(ranks: Sequence[int], group: Any) -> tuple[int, ...]:
    """Global ranks as ranks of ``group`` (themselves for the default group)."""
    if group is None:
        return tuple(ranks)
    return tuple(dist.get_group_rank(group, r) for r in ranks)


def _root_of(device_mesh: Any, group: Any) -> list[Any] | None:
    """``[dims, job ranks]`` of the root mesh ``device_mesh`` was sliced from, None when it is a root
    or some rank of the root is outside ``group``."""
    from .dtensor import mesh_of, mesh_ranks, root_mesh  # lazy: 1.5 s of imports every trainer process need not pay

    root = root_mesh(device_mesh)
    if root is None:
        return None
    try:
        ranks = _job_ranks(mesh_ranks(root), group)
    except (RuntimeError, ValueError):  # a rank of the root outside the process group
        return None
    if any(r < 0 for r in ranks):
        return None
    return [[list(d) for d in mesh_of(root).dims], list(ranks)]


_FIELDS = ("global shape", "dtype", "mesh dims", "placements", "mesh's job ranks")
"""What a description says, in its order; ``_text`` shows every one of them, so two ranks whose
descriptions differ never print the same text."""


def state_layout_of(descriptions: list[dict[str, tuple[Any, ...]]]) -> tuple[PTC, StateLayout]:
    """The collection and layout of a state dict from every rank's ``{key: description}`` (pure:
    every rank computes the same from the same gathered list). Ranks that hold one key on different,
    disjoint sub-meshes of the same dims and placements hold replicas of it (FSDP2 over ``dp`` of a
    ``(dp, tp)`` mesh, for a module TP leaves alone): one placement of them all
    (``state_layout.merge_replicas``), as DCP saves them. CheckpointValueError names a key that ranks
    describe differently, and the fields that differ."""
    world = len(descriptions)
    first: dict[str, tuple[int, tuple[Any, ...]]] = {}
    variants: dict[str, list[tuple[int, tuple[Any, ...]]]] = {}  # keys described differently: each distinct one
    holders: dict[str, list[int]] = {}
    for rank, descs in enumerate(descriptions):
        for key, desc in descs.items():
            known = first.get(key)
            if known is None:
                first[key] = (rank, desc)
            elif known[1] != desc:
                found = variants.setdefault(key, [known])
                if all(d[:5] != desc[:5] for _, d in found):  # the root mesh is a hint, not a field
                    found.append((rank, desc))
            holders.setdefault(key, []).append(rank)
    specs, placed = [], {}
    merges: dict[tuple[Any, ...], Placed] = {}  # the keys of a module and its optimizer states share one
    for key in sorted(first):
        found = variants.get(key, [first[key]])
        desc = found[0][1]
        shape, dtype, dims = desc[:3]
        if len(found) == 1:
            p = _placed(desc, holders[key])
        else:
            signature = tuple((_frozen(d), _frozen_root(d)) for _, d in found)
            if signature not in merges:
                merges[signature] = _merged(key, found)
            p = merges[signature]
        if dims is not None:
            if set(p.ranks) != set(holders[key]):
                raise CheckpointValueError(
                    f"{key} is a DTensor on ranks {sorted(p.ranks)} but ranks {sorted(holders[key])} hold it: pass "
                    "every rank of its mesh the same state-dict entry")
        specs.append(spec_for(key, shape, dtype, p.placements))
        placed[key] = p
    return PTC(specs, num_layers=0), StateLayout.of(world, placed)


def _frozen(desc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A description's five fields as a hashable value (the root mesh is a hint, not a field)."""
    return tuple(tuple(tuple(d) if isinstance(d, list) else d for d in f) if isinstance(f, list) else f
                 for f in desc[:5])


def _merged(key: str, found: list[tuple[int, tuple[Any, ...]]]) -> Placed:
    """The one placement of ``key`` that ranks describe on different sub-meshes: their replicas merged,
    or CheckpointValueError naming the first two ranks whose descriptions differ, and in what."""
    (r0, d0) = found[0]
    for r1, d1 in found[1:]:
        fields = [name for name, a, b in zip(_FIELDS, _frozen(d0), _frozen(d1)) if a != b]
        if d0[2] is None or fields != [_FIELDS[4]]:
            raise CheckpointValueError(
                f"{key}: ranks disagree on its {' and '.join(fields)}: rank {r0} has {_text(d0)} but rank {r1} has "
                f"{_text(d1)}; every rank holding a key must agree on its global shape, dtype and placement")
    roots = {_frozen_root(d) for _, d in found}
    root = roots.pop() if len(roots) == 1 else None
    try:
        return merge_replicas([_placed(d, ()) for _, d in found],
                              None if root is None else (NamedMesh(root[0]), root[1]))
    except LayoutError as e:
        raise CheckpointValueError(f"{key}: ranks disagree on its {_FIELDS[4]}, sub-meshes that are not replicas of "
                                   f"one another ({e}): rank {r0} has {_text(d0)} but rank {found[1][0]} has "
                                   f"{_text(found[1][1])}") from None


def _frozen_root(desc: tuple[Any, ...]) -> tuple[tuple[tuple[str, int], ...], tuple[int, ...]] | None:
    """A description's root mesh (``_root_of``) as ``(dims, job ranks)`` tuples; None without one."""
    root = desc[5] if len(desc) > 5 else None
    return None if root is None else (tuple(tuple(d) for d in root[0]), tuple(root[1]))


def _placed(desc: tuple[Any, ...], holders: Sequence[int]) -> Placed:
    """A description's placement: its DTensor mesh, placements and ranks, or (a plain tensor) held
    whole by ``holders``."""
    _, _, dims, placements, ranks = desc[:5]
    if dims is None:
        return Placed.replicated(holders)
    return Placed(NamedMesh(tuple((n, s) for n, s in dims)), tuple(parse_placement(t) for t in placements),
                  tuple(ranks))


def _text(desc: tuple[Any, ...]) -> str:
    """Every field of a description (``_FIELDS``), as a message shows it."""
    shape, dtype, dims, placements, ranks = desc[:5]
    where = "a plain tensor" if dims is None else \
        f"placements {placements} on mesh {','.join(f'{n}={s}' for n, s in dims)} of job ranks {list(ranks)}"
    return f"shape {list(shape)} {dtype}, {where}"


_ERRORS = {c.__name__: c for c in (CheckpointValueError, CheckpointMismatchError, CheckpointCorruptError,
                                   CheckpointNotFoundError, CheckpointWriteError)}


def _gather_or_raise(value: Any, failure: Exception | None, world: int, group: Any, what: str) -> list[Any]:
    """Every rank's ``value`` (``all_gather_object``), or, when the local step before it failed on any
    rank (``failure``), an error on every rank: a failing rank raises its own, the others one of
    the first failure's class (CheckpointError if it is not a checkpoint error) naming every
    failing rank. So no rank is left waiting in a later collective for one that has raised."""
    error = None if failure is None else (type(failure).__name__, str(failure))
    got: list[Any] = [(value, error)]
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, (value, error), group=group)
    failed = [(r, e) for r, (_, e) in enumerate(got) if e is not None]
    if failure is not None:
        raise failure
    if failed:
        cls = _ERRORS.get(failed[0][1][0], CheckpointError)
        raise cls(f"{what} failed on {len(failed)} of {world} ranks: "
                  + "; ".join(f"rank {r}: {name}: {text}" for r, (name, text) in failed))
    return [v for v, _ in got]


def _world(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gathered(state_dict: Mapping[str, Any], process_group: Any, what: str, *,
              values: bool = True) -> tuple[PTC, StateLayout, dict[str, torch.Tensor], dict[str, Any]]:
    """The collection and layout of every rank's ``state_dict`` (one ``all_gather_object`` of what each
    holds), this rank's tensors by flat key and every rank's non-tensor values merged (``values``
    False: only their keys gathered, values None). A state dict one rank cannot describe fails every
    rank (none waits in the gather)."""
    _, world = _world(process_group)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    descs: dict[str, tuple[Any, ...]] = {}
    failure: Exception | None = None
    try:
        leaves = flatten_state_dict(stateful_view(state_dict)[0])
        tensors = {k: v for k, (_, _, v) in leaves.items() if isinstance(v, torch.Tensor)}
        objects = {k: (v if values else None) for k, (_, _, v) in leaves.items() if not isinstance(v, torch.Tensor)}
        meshes: dict[int, tuple[Any, ...]] = {}
        descs = {k: _describe(v, process_group, meshes, root=True) for k, v in tensors.items()}
        if world > 1:
            pickle.dumps(objects)  # all_gather_object pickles before its collective: fail here, not alone there
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised on each
        failure = e
    gathered = _gather_or_raise((descs, objects), failure, world, process_group, what)
    ptc, layout = _collection([g[0] for g in gathered], [g[1] for g in gathered])
    merged = _merged_objects([g[1] for g in gathered])  # every rank refuses values that differ, not only rank 0
    return ptc, layout, tensors, merged


def describe_state_dict(state_dict: Mapping[str, Any], *, process_group: Any = None,
                        values: bool = True) -> tuple[PTC, StateLayout]:
    """The collection and ``StateLayout`` of the job's state dicts, as ``save_state_dict`` would save
    them (collective: one small ``all_gather_object``). An in-process rescale plans the move between
    two of them: the layout the survivors held (described before the failure, while every rank was
    alive) and the one of the model rebuilt for the new mesh. ``values`` False: the non-tensor
    entries' values are neither gathered nor compared between ranks (a state dict about to be
    filled, whose step counters a fresh joiner does not know yet), only their keys."""
    ptc, layout, _, _ = _gathered(state_dict, process_group, "describing the state dict", values=values)
    return ptc, layout


def local_shard(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's part of ``state_dict`` by flat key: DTensors as their local tensors, plain tensors and
    other values as they are (the same memory: copy it to keep a consistent state). ``Stateful`` values
    as their ``state_dict()``."""
    leaves = flatten_state_dict(stateful_view(state_dict)[0])
    return {k: (_local_tensor(v) if isinstance(v, torch.Tensor) else v) for k, (_, _, v) in leaves.items()}


def fill_state_dict(state_dict: MutableMapping[str, Any], shard: Mapping[str, Any]) -> None:
    """Write ``shard`` (flat key -> local tensor or value, as ``local_shard`` gives it) into ``state_dict``
    in place: tensors copied into the local tensors the state dict holds (shapes must match; a shard
    tensor that is that local tensor's memory already, as a move ``into`` them gives it, is not copied), other
    values replaced in their dicts; ``Stateful`` values then get theirs through ``load_state_dict``.
    CheckpointMismatchError names keys the shard lacks."""
    view, statefuls = stateful_view(state_dict)
    leaves = flatten_state_dict(view)
    missing = sorted(set(leaves) - set(shard))
    if missing:
        raise CheckpointMismatchError(f"the state to fill in lacks {len(missing)} keys of the state dict, e.g. "
                                      f"{missing[:5]}")
    for k, (container, key, value) in leaves.items():
        if isinstance(value, torch.Tensor):
            loc = _local_tensor(value).detach()
            src = shard[k]
            if tuple(src.shape) != tuple(loc.shape):
                raise CheckpointMismatchError(f"{k}: the state to fill in has shape {list(src.shape)}, this rank's "
                                              f"local tensor {list(loc.shape)}")
            if src.data_ptr() != loc.data_ptr() or src.stride() != loc.stride():  # else written in place already
                loc.copy_(src)
        else:
            container[key] = shard[k]
    _hand_back(state_dict, view, statefuls)


def _hand_back(state_dict: MutableMapping[str, Any], view: Mapping[str, Any], statefuls: Mapping[str, Any]) -> None:
    """After a load into ``stateful_view(state_dict)``: each ``Stateful`` value gets its filled part
    (``load_state_dict``), other top-level values go back into ``state_dict`` (as DCP's ``load``)."""
    for k, v in view.items():
        if k in statefuls:
            statefuls[k].load_state_dict(v)
        else:
            state_dict[k] = v


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def save_state_dict(state_dict: Mapping[str, Any], url: str, *, step: int, extra: Any = None,
                    process_group: Any = None, storage_options: Mapping[str, Any] | None = None) -> SaveResult:
    """Save every rank's ``state_dict`` as checkpoint ``step`` under ``url`` (collective over the default
    group or ``process_group``; without torch.distributed, one process saves alone).

    One small collective gathers what each rank holds (keys, global shapes, placements, and the
    non-tensor values); every distinct piece is then written once, by the least-loaded of the ranks
    holding it (replicas deduplicated, nothing gathered to one rank). Returns when every rank's part
    is written; CheckpointWriteError lists every rank's failure when any failed (no rank returns
    normally then, and the step stays invisible to loads). A state dict that one rank cannot
    describe (a non-string key, a Partial DTensor) fails every rank before anything is written.
    """
    rank, world = _world(process_group)
    ptc, layout, tensors, merged = _gathered(state_dict, process_group, f"saving step {step} to {url}")
    shard: dict[str, Any] = {k: _local_tensor(v) for k, v in tensors.items()}
    if rank == 0:
        shard.update(merged)
    error: str | None = None
    result: SaveResult | None = None
    try:
        result = save(url, ptc, layout, rank, shard, step=step, extra=extra, storage_options=storage_options)
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised on each
        error = f"{type(e).__name__}: {e}"
        failure = e
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=process_group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        text = "; ".join(f"rank {r}: {e}" for r, e in failed)
        if len(failed) == 1 and isinstance(failure, CheckpointError):
            raise failure
        raise CheckpointWriteError(f"saving step {step} to {url} failed on {len(failed)} of {world} ranks: {text}")
    assert result is not None
    return result


def _same(a: Any, b: Any) -> bool:
    """Whether two state-dict values are equal (tensors by value, containers element-wise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a usable ==
        return False


def _merged_objects(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's non-tensor values as one dict. A key whose value differs between ranks would be
    saved from one rank only, silently dropping the others': CheckpointValueError names it."""
    merged: dict[str, tuple[int, Any]] = {}
    for rank, objs in enumerate(objects):
        for k, v in objs.items():
            if k not in merged:
                merged[k] = (rank, v)
            elif not _same(merged[k][1], v):
                raise CheckpointValueError(
                    f"state dict entry {k!r} differs between rank {merged[k][0]} ({merged[k][1]!r:.80}) and rank {rank} "
                    f"({v!r:.80}): only one value per key is saved. Give per-rank values per-rank keys; for optimizer "
                    "state under pipeline parallelism use get_state_dict(..., options=StateDictOptions("
                    "flatten_optimizer_state_dict=True)), whose param groups are keyed by parameter name")
    return {k: v for k, (_, v) in merged.items()}


def _collection(descs: list[dict[str, tuple[Any, ...]]], objects: list[dict[str, Any]]) -> tuple[PTC, StateLayout]:
    ptc, layout = state_layout_of(descs)
    names = sorted({k for objs in objects for k in objs})
    clash = sorted(set(names) & set(ptc.tensors))
    if clash:
        raise CheckpointValueError(f"{clash[:5]} are tensors on some ranks and other values on others")
    layout.check(ptc, complete=True)
    return PTC(ptc.tensors.values(), num_layers=0, objects=names, meta={"kind": "state_dict"}), layout


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
class _InPlace:
    """A ``ShardSink`` that reads into the caller's tensors: straight into their memory when it is a
    contiguous CPU tensor in the saved canonical order, as a ``Scatter`` of it when that is a
    panel-ordered tensor's row or column shard (each panel's rows are runs at a stride: the reader
    copies verified windows into them, no temporary of the tensor), else through one temporary per
    tensor (CUDA tensors, tensors stored split on a dim > 0)."""

    def __init__(self, locals_: Mapping[str, torch.Tensor], layout: StateLayout, rank: int) -> None:
        self.locals = locals_
        self.layout, self.rank = layout, rank
        self.saved = PTC([])
        self.direct: set[str] = set()

    def bind(self, saved: PTC) -> None:
        """The attempt about to be read (its canonical orders decide what can be read in place)."""
        self.saved, self.direct = saved, set()

    def _natural(self, spec: TensorSpec) -> bool:
        if spec.panels is not None:
            return not self.layout.panel_copies(spec, self.rank)
        return spec.split_dim in (None, 0)

    def buffer(self, name: str) -> torch.Tensor | Scatter:
        spec, loc = self.saved.tensors[name], self.locals[name]
        if loc.device.type == "cpu" and loc.is_contiguous():
            if self._natural(spec):
                self.direct.add(name)
                return loc.view(-1)
            if spec.panels is not None:
                self.direct.add(name)
                raw = loc.reshape(-1).view(torch.uint8).numpy()
                return Scatter(self.layout.panel_byte_views(spec, self.rank, loc.shape, raw), spec.dtype)
        return torch.empty(loc.numel(), dtype=spec.dtype)

    def copies(self, name: str) -> bool:
        return name not in self.direct

    def finish(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        loc = self.locals[name]
        if name in self.direct:
            return loc
        spec = self.saved.tensors[name]
        d = spec.split_dim
        if spec.panels is not None and self.layout.panel_copies(spec, self.rank):
            if loc.device.type == "cpu":
                self.layout.from_local_flat(spec, self.rank, flat, loc)
            else:
                loc.copy_(self.layout.from_local_flat(spec, self.rank, flat, torch.empty(loc.shape, dtype=flat.dtype)))
        elif d in (None, 0) or spec.panels is not None:
            loc.copy_(flat.view(loc.shape))
        else:
            shape = (loc.shape[d],) + tuple(loc.shape[:d]) + tuple(loc.shape[d + 1:])
            loc.copy_(flat.view(shape).movedim(0, d))
        return loc


def load_state_dict(state_dict: MutableMapping[str, Any], url: str, *, step: int | None = None,
                    strict: bool = False, storage_options: Mapping[str, Any] | None = None) -> StateDictLoad:
    """Fill every rank's ``state_dict`` in place from checkpoint ``step`` (default: the newest that
    verifies) under ``url``, whatever mesh and world size saved it. Collective over the default
    group when torch.distributed is initialised.

    Tensors (DTensors on any mesh, plain tensors, CPU or CUDA) are written into the caller's
    memory, reading only the byte ranges this rank's local tensors need; other values are replaced
    in their dicts. A top-level ``Stateful`` value (``state_dict()`` and ``load_state_dict()``: a
    module, an optimizer, torchtitan's containers) is loaded as DCP loads it: its ``state_dict()``
    is filled, then handed to its ``load_state_dict``.

    Keys: as ``dcp.load``, the state dict may ask for a subset of the checkpoint's keys (the others
    are not read: a job that drops its data loader's or LR scheduler's state); ``strict=True``
    refuses that. Keys of the state dict that the checkpoint lacks are always refused.
    CheckpointMismatchError names the keys when the state dict does not match the checkpoint
    (keys missing, other global shapes or dtypes); nothing is read then.
    A failed read may leave tensors partly overwritten: load again (an older step) before using them.
    When any rank fails (its state dict, its check or its reads), every rank raises: that rank its
    own error, the others one of its class naming it.
    """
    return load_state_dict_from(state_dict, UrlSource(url, storage_options), step=step, strict=strict)


class StepSource(Protocol):
    """Where a state dict is loaded from: a checkpoint URL (``UrlSource``) or the recovery tiers
    (``tenplex.elastic``'s host stores, peers and persistent storage). ``where`` names it."""

    where: str

    def load(self, layout: StateLayout, rank: int, *, step: int | None, sink: ShardSink,
             check: Callable[[PTC], None]) -> LoadResult:
        """``rank``'s shard under ``layout`` from the newest attempt that verifies (of ``step`` when
        given), read through ``sink`` after ``check`` accepted the saved collection."""
        ...

    def steps(self) -> list[int]:
        """The steps with a complete attempt (candidates when ranks must agree on an older one)."""
        ...


@dataclass(frozen=True)
class UrlSource:
    """The checkpoints under ``url`` (``tenplex.checkpoint.load``)."""

    url: str
    storage_options: Mapping[str, Any] | None = None

    @property
    def where(self) -> str:
        return self.url

    def load(self, layout: StateLayout, rank: int, *, step: int | None, sink: ShardSink,
             check: Callable[[PTC], None]) -> LoadResult:
        return load(self.url, layout, rank, step=step, storage_options=self.storage_options,
                    options=ReadOptions(sink=sink, check=check))

    def steps(self) -> list[int]:
        return sorted({i.step for i in list_steps(self.url, storage_options=self.storage_options) if i.complete})


def load_state_dict_from(state_dict: MutableMapping[str, Any], source: StepSource, *, step: int | None = None,
                         strict: bool = False, process_group: Any = None) -> StateDictLoad:
    """``load_state_dict`` from any ``StepSource`` (a URL, the recovery tiers): the same checks,
    in-place reads and agreement of the ranks on one step (``tenplex.native.agree.agree_step``).
    ``process_group``: the ranks that hold the state (a job's mesh, its spares left out), collective
    over them alone; ranks are its ranks (default: the default group)."""
    t0 = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # a load allocates many small objects and frees them: no collector passes over the job's heap
    try:
        return _load_state_dict(state_dict, source, step, strict, t0, process_group)
    finally:
        if collecting:
            gc.enable()


def _load_state_dict(state_dict: MutableMapping[str, Any], source: StepSource, step: int | None, strict: bool,
                     t0: float, group: Any) -> StateDictLoad:
    rank, world = _world(group)
    url = source.where
    where = f"loading {url}"
    mine: list[str] = []
    failure: Exception | None = None
    try:  # a state dict one rank cannot describe fails every rank (none waits in a later collective)
        view, statefuls = stateful_view(state_dict)
        leaves = flatten_state_dict(view)
        tensors = {k: v for k, (_, _, v) in leaves.items() if isinstance(v, torch.Tensor)}
        meshes: dict[int, tuple[Any, ...]] = {}
        descs = {k: _describe(v, group, meshes) for k, v in tensors.items()}
        placements: dict[Any, Placed] = {}  # one Placed per distinct placement (a few among hundreds of tensors)

        def placed(desc: tuple[Any, ...]) -> Placed:
            _, _, dims, texts, ranks = desc
            key = None if dims is None else (tuple(map(tuple, dims)), tuple(texts), tuple(ranks))
            if key not in placements:
                placements[key] = _placed(desc, [rank])
            return placements[key]

        layout = StateLayout.of(world, {k: placed(d) for k, d in descs.items()})
        # detached: the same memory, written without autograd (parameters require grad)
        locals_ = {k: _local_tensor(v).detach() for k, v in tensors.items()}
        mine = sorted(leaves)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised on each
        failure = e
    wanted = set().union(*_gather_or_raise(mine, failure, world, group, where))

    sink = _InPlace(locals_, layout, rank)

    def check(saved: PTC) -> None:
        _check_against(saved, descs, set(leaves) - set(tensors), wanted, url, layout, locals_, rank, strict)
        sink.bind(saved)

    result: LoadResult | None = None
    try:  # a rank whose check or read fails (its keys, its bytes) fails every rank, none waits below
        result = source.load(layout, rank, step=step, sink=sink, check=check)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised on each
        failure = e
    steps = _gather_or_raise(None if result is None else result.step, failure, world, group, where)
    assert result is not None
    if len(set(steps)) > 1:  # ranks saw different damage: the rule rescale's agree_on_step applies too

        def reload(bound: int, _: Sequence[Any]) -> int | None:
            nonlocal result
            for s in sorted((s for s in source.steps() if s <= bound), reverse=True):
                try:
                    result = source.load(layout, rank, step=s, sink=sink, check=check)
                except CheckpointCorruptError as e:
                    log.warning("rank %d: step %d of %s does not verify: %s", rank, s, url, e)
                    continue
                return result.step
            return None

        log.warning("ranks loaded steps %s of %s; agreeing on the oldest", sorted(set(steps)), url)
        agree_step(result.step, reload, where=url, group=group, gathered=steps)
    for k, (container, key, _) in leaves.items():
        if k not in tensors and k in result.shard:
            container[key] = result.shard[k]
    _hand_back(state_dict, view, statefuls)
    s = result.stats
    return StateDictLoad(result.step, result.extra, s.bytes_read, s.bytes_needed, time.perf_counter() - t0,
                         result.skipped, s)


def _check_against(saved: PTC, descs: Mapping[str, tuple[Any, ...]], objects: set[str], wanted: set[str], url: str,
                   layout: StateLayout, locals_: Mapping[str, torch.Tensor], rank: int, strict: bool) -> None:
    """CheckpointMismatchError unless the state dicts (``wanted``: every rank's keys) ask for keys the
    checkpoint has (``strict``: exactly its keys), with its global shapes and dtypes, and this rank's
    local tensors have the shapes their placements give."""
    have = set(saved.tensors) | set(saved.objects)
    problems = []
    extra = sorted(wanted - have)
    if extra:
        problems.append(f"the checkpoint lacks {len(extra)} keys of the state dict, e.g. {extra[:5]}")
    missing = sorted(have - wanted) if strict else []
    if missing:
        problems.append(f"the state dict lacks {len(missing)} keys of the checkpoint, e.g. {missing[:5]} (strict=True; "
                        "the default loads a subset of the keys, as dcp.load)")
    kinds = sorted(k for k in objects if k in saved.tensors) + sorted(k for k in descs if k in saved.objects)
    if kinds:
        problems.append(f"{kinds[:5]} are tensors on one side and other values on the other")
    for k, desc in descs.items():
        spec = saved.tensors.get(k)
        if spec is None:
            continue
        shape, dtype = tuple(desc[0]), desc[1]
        if spec.shape != shape or dtype_to_str(spec.dtype) != dtype:
            problems.append(f"{k}: the checkpoint has shape {list(spec.shape)} {dtype_to_str(spec.dtype)}, the state "
                            f"dict {list(shape)} {dtype}")
        else:
            want = layout.local_shape(spec, rank)
            got = tuple(locals_[k].shape)
            if want != got:
                problems.append(f"{k}: rank {rank}'s local tensor has shape {list(got)} but its placements give "
                                f"{list(want)} (a padded or otherwise unusual local tensor)")
    if problems:
        raise CheckpointMismatchError(
            f"the state dict does not match checkpoint {url}: " + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Build the model and optimizer the checkpoint was saved from (and run one optimizer step, or use "
            "get_state_dict, so the optimizer state exists) before loading")
