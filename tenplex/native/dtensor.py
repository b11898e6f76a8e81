"""Thin adapter from torch's DeviceMesh / DTensor to ``tenplex.layout.mesh``'s pure types.

Imports torch.distributed.tensor at module top (this module is for code that has DTensors);
``tenplex.layout.mesh`` does all the arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types as pt

from ..errors import SpecError
from ..layout.mesh import NamedMesh, MeshPlacement, Replicate, Shard, StridedShard, TensorPlacement
from ..layout.ptc import dtype_to_str

__all__ = ["mesh_of", "mesh_ranks", "root_mesh", "placement_of", "from_dtensor_spec", "tensor_placement",
           "release_mesh", "release_fsdp_groups"]


def mesh_of(device_mesh: DeviceMesh) -> NamedMesh:
    """The named mesh of ``device_mesh`` (unnamed dims are called ``dim0``, ``dim1``, ...).

    Mesh rank ``r`` of the result is the device at row-major position ``r`` of
    ``device_mesh.mesh``; ``mesh_ranks`` gives its global rank (they differ for a sub-mesh).
    """
    names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(device_mesh.ndim))
    return NamedMesh(tuple(zip(names, (int(s) for s in device_mesh.shape))))


def mesh_ranks(device_mesh: DeviceMesh) -> tuple[int, ...]:
    """Global (process group) rank of every mesh rank of ``mesh_of(device_mesh)``."""
    return tuple(int(r) for r in device_mesh.mesh.reshape(-1).tolist())


def root_mesh(device_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh ``device_mesh`` was sliced or flattened from (``mesh["dp"]``'s ``mesh``), None when it is
    a root itself or this torch does not say. Ranks holding one tensor on different slices of a root
    (a replica per TP rank) say so through it: ``state_layout.merge_replicas``."""
    get = getattr(device_mesh, "_get_root_mesh", None)  # private (torch 2.13); without it replicas merge on a new dim
    root = get() if callable(get) else None
    return root if isinstance(root, DeviceMesh) and root is not device_mesh else None


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def placement_of(placement: pt.Placement, ndim: int) -> MeshPlacement:
    """tenplex's form of one torch placement of a tensor with ``ndim`` dims (negative dims normalised)."""
    if isinstance(placement, pt._StridedShard):  # not a Shard subclass in torch 2.13, checked first anyway
        return StridedShard(_dim(placement.dim, ndim), int(placement.split_factor))
    if isinstance(placement, pt.Shard):
        return Shard(_dim(placement.dim, ndim))
    if isinstance(placement, pt.Replicate):
        return Replicate()
    raise SpecError(
        f"placement {placement} holds no stored value (a pending reduction such as Partial): "
        "redistribute the tensor to Shard/Replicate before saving it"
    )


def from_dtensor_spec(dt: DTensor) -> TensorPlacement:
    """Global shape, dtype and placements of a DTensor (its mesh: ``mesh_of(dt.device_mesh)``)."""
    ndim = len(dt.shape)
    return TensorPlacement(tuple(int(s) for s in dt.shape), dtype_to_str(dt.dtype),
                           tuple(placement_of(p, ndim) for p in dt.placements))


def tensor_placement(value: Any, mesh: NamedMesh) -> TensorPlacement:
    """The placement of a state-dict value on ``mesh``: a DTensor's own, or ``Replicate()`` on every
    mesh dim for a plain tensor (every rank holds all of it, e.g. an optimizer step counter)."""
    if isinstance(value, DTensor):
        return from_dtensor_spec(value)
    if isinstance(value, torch.Tensor):
        return TensorPlacement(tuple(value.shape), dtype_to_str(value.dtype), (Replicate(),) * mesh.ndim)
    raise SpecError(f"expected a tensor or DTensor, got {type(value).__name__}")


def _clear_sharding_caches() -> None:
    """DTensor's sharding propagation caches (Python and fast path) emptied, as
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does, without importing that module:
    it imports torch._dynamo and torch._inductor (measured: 1-2.5 s of every worker's start on a loaded
    2-CPU host, on a joiner's path to its admission)."""
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clear = getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None)
    if clear is not None:
        clear()
    fast = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast is not None:
        fast()


def release_mesh(device_mesh: DeviceMesh, *, destroy: bool = False) -> int:
    """Drop the process groups a broken ``device_mesh`` keeps (its root mesh's group registry), so that
    gloo closes their connections once the modules holding them are freed too (``gc.collect()``: FSDP2's
    hooks make reference cycles). DTensor's sharding cache keeps meshes alive after their groups were
    destroyed; a survivor blocked in one of their collectives with this rank would wait for the group
    timeout. Its sharding propagation caches are cleared too: they compare meshes by value, so a later
    mesh equal to a dead one (the 4-worker mesh again after a join) got cached results naming the dead
    one's groups ("Could not resolve the process group registered under the name ..."). ``destroy``:
    torch.distributed's own references to them go too (``destroy_process_group(group)``, never the
    default group's): once the modules' are dropped (``release_fsdp_groups``), a gloo group closes its
    connections here, not at the collection (gloo only: an nccl group with a dead peer is aborted, a
    destroy could wait on it). Returns how many groups were dropped (0 when this torch keeps none there)."""
    _clear_sharding_caches()
    root = getattr(device_mesh, "_root_mesh", None) or device_mesh
    registry = getattr(root, "_pg_registry", None)
    if not isinstance(registry, dict):
        return 0
    n = len(registry)
    if destroy and dist.is_initialized():
        world = dist.group.WORLD
        for pg in registry.values():
            if pg is not world and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                with contextlib.suppress(ValueError, RuntimeError):  # not (or no longer) registered
                    dist.destroy_process_group(pg)
    registry.clear()
    return n


def release_fsdp_groups(model: Any) -> int:
    """Drop the process groups FSDP2 keeps in ``model``'s modules (each param group's mesh infos; a
    list or tuple of model parts too). A module that failed inside its forward pass (a peer died
    during an all-gather) is not freed by ``gc.collect()``: the part of its autograd graph built so
    far keeps it (measured with a transformers Llama and the repo's own, killed in decoder layer 1:
    no Python referrer outside the model's own cycle), and with it the gloo groups, whose open
    connections left a survivor blocked on this rank waiting until this process exited. Dropped
    here, the groups are freed with the mesh's (``release_mesh``). Returns how many were dropped."""
    dropped = 0
    for part in model if isinstance(model, (list, tuple)) else (model,):
        for module in part.modules() if hasattr(part, "modules") else ():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None)
            for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
                for name in ("shard_process_group", "replicate_process_group"):
                    if getattr(info, name, None) is not None:
                        object.__setattr__(info, name, None)  # a frozen dataclass in some torch versions
                        dropped += 1
    return dropped
