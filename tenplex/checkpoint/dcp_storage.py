"""``torch.distributed.checkpoint`` storage that writes and reads the tenplex format (#17 item 6).

``dcp.save(state_dict, storage_writer=TenplexStorageWriter(url, step=...))`` writes an ordinary
tenplex checkpoint: each saving rank's chunks (as DCP's planner deduplicated them) become that
rank's part, placed by ``Boxes`` in a ``StateLayout``, and the non-tensor entries become objects;
``tenplex.load_state_dict`` then loads it under any mesh. ``dcp.load(state_dict,
storage_reader=TenplexStorageReader(url))`` reads a tenplex checkpoint whose layout is made of
``Boxes`` (what this writer and ``tenplex import`` of a DCP checkpoint write) or of ``Placed``
tensors whose local shards are single boxes, reading only the ranges DCP asks for.

Byte entries are unpickled on the writing rank and, under torch.distributed, gathered to rank 0
(collectively, over the default group) so rank 0 writes them with the manifest: they must be
values ``torch.load(weights_only=True)`` reads back (numbers, strings, lists, dicts, tensors).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CheckpointError, CheckpointValueError
from ..layout.mesh import local_box
from ..layout.ptc import PTC
from ..layout.state_layout import Boxes, Placed, StateLayout, spec_for
from .catalog import read_manifest
from .load import load
from .writer import save

__all__ = ["TenplexStorageWriter", "TenplexStorageReader"]

log = logging.getLogger(__name__)


def _plans_collection(plans: list[SavePlan]) -> tuple[PTC, StateLayout]:
    """The collection and layout of DCP's global save plans (pure): rank ``i`` holds the chunks of
    plan ``i``; byte entries become objects. CheckpointValueError for a rank with two chunks of one
    tensor or tensors that ranks describe differently."""
    chunks: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    described: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    objects: set[str] = set()
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                objects.add(fqn)
                continue
            td = item.tensor_data
            assert td is not None
            desc = (tuple(int(s) for s in td.size), td.properties.dtype)
            if described.setdefault(fqn, desc) != desc:
                raise CheckpointValueError(f"{fqn}: ranks save it with different global shapes or dtypes "
                                           f"({described[fqn]} and {desc})")
            if any(r == rank for r, _, _ in chunks.get(fqn, ())):
                raise CheckpointValueError(f"{fqn}: rank {rank} saves two chunks of it; the tenplex format takes "
                                           "one chunk per rank and tensor")
            chunks.setdefault(fqn, []).append((rank, tuple(int(x) for x in td.chunk.offsets),
                                               tuple(int(x) for x in td.chunk.sizes)))
    clash = sorted(objects & set(chunks))
    if clash:
        raise CheckpointValueError(f"{clash[:5]} are tensors on some ranks and other values on others")
    placed = {n: Boxes(tuple(c)) for n, c in sorted(chunks.items())}
    specs = [spec_for(n, described[n][0], described[n][1], b) for n, b in placed.items()]
    ptc = PTC(specs, num_layers=0, objects=sorted(objects), meta={"kind": "state_dict"})
    layout = StateLayout.of(max(1, len(plans)), placed)
    layout.check(ptc, complete=True)
    return ptc, layout


class TenplexStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves checkpoint ``step`` under the tenplex checkpoint ``url``."""

    def __init__(self, url: str | os.PathLike[str], *, step: int = 0, extra: Any = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.url, self.step, self.extra = str(url), step, extra
        self.storage_options = dict(storage_options or {})
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ptc, layout = _plans_collection(plans)
        save_id = uuid.uuid4().hex[:8]
        return [dataclasses.replace(p, storage_data=(i, ptc, layout, save_id)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank, ptc, layout, save_id = plan.storage_data
        shard: dict[str, Any] = {}
        objects: dict[str, Any] = {}
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                data.seek(0)
                objects[item.index.fqn] = torch.load(data, weights_only=False)  # as DCP's own load_bytes
            else:
                shard[item.index.fqn] = data.detach()
        if layout.world_size > 1 and dist.is_available() and dist.is_initialized():
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, objects)
            objects = {k: v for objs in every for k, v in objs.items()}
        if rank == 0:
            shard.update(objects)
        res = save(self.url, ptc, layout, rank, shard, step=self.step, extra=self.extra, save_id=save_id,
                   storage_options=self.storage_options)
        log.debug("rank %d wrote %d bytes of step %d to %s", rank, res.bytes_written, self.step, self.url)
        results = [WriteResult(index=item.index, size_in_bytes=int(item.tensor_storage_size() or 0),
                               storage_data=rank) for item in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing more to write: rank 0's part carries the manifest and objects."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _chunks(name: str, shape: tuple[int, ...], placed: Boxes | Placed) -> list[tuple[int, tuple[int, ...],
                                                                                   tuple[int, ...]]]:
    """Every distinct chunk of a tensor as ``(writer rank, offsets, sizes)``."""
    if isinstance(placed, Boxes):
        return list(placed.chunks)
    out, seen = [], set()
    for i, rank in enumerate(placed.ranks):
        box = local_box(shape, placed.mesh, placed.placements, placed.mesh.coords(i), right_to_left=True)
        if any(len(ranges) > 1 for ranges in box):
            raise CheckpointError(f"{name}: rank {rank}'s shard is not one box (strided placements "
                                  f"{placed.placements}); DCP chunks are boxes")
        off = tuple(r[0].start if r else 0 for r in box)
        size = tuple(len(r[0]) if r else 0 for r in box)
        if (off, size) not in seen:
            seen.add((off, size))
            out.append((rank, off, size))
    return out


class TenplexStorageReader(StorageReader):
    """A DCP ``StorageReader`` of the tenplex checkpoint ``url`` (step ``step``, default the newest)."""

    def __init__(self, url: str | os.PathLike[str], *, step: int | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.url, self.step = str(url), step
        self.storage_options = dict(storage_options or {})
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        manifest = read_manifest(self.url, self.step, storage_options=self.storage_options)
        if "state_layout" not in manifest:
            raise CheckpointError(f"{self.url} was saved under a ParallelConfig ({manifest['layout']}); DCP reads "
                                  "state-dict checkpoints (save_state_dict, tenplex import of DCP, this writer)")
        self.step = manifest["step"]
        ptc: PTC = manifest["ptc"]
        layout = StateLayout.from_json(manifest["state_layout"])
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for name, placed in layout.placed.items():
            spec = ptc.tensors[name]
            chunks = _chunks(name, spec.shape, placed)
            sd_md[name] = TensorStorageMetadata(
                TensorProperties(dtype=spec.dtype), torch.Size(spec.shape),
                [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for _, o, z in chunks])
            for rank, o, _ in chunks:
                storage[MetadataIndex(name, torch.Size(o))] = rank
        for name in ptc.objects:
            sd_md[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = 0
        log.debug("tenplex checkpoint %s step %s as DCP metadata: %d tensors, %d objects", self.url, self.step,
                  len(ptc), len(ptc.objects))
        return Metadata(state_dict_metadata=sd_md, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: tensors in rounds of at most one box per tensor (each round one
        tenplex load of exactly those boxes), byte entries from the checkpoint's objects."""
        rounds: list[list[Any]] = []
        count: dict[str, int] = {}
        byte_items = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                byte_items.append(item)
                continue
            k = count.get(item.storage_index.fqn, 0)
            count[item.storage_index.fqn] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(item)
        objects: dict[str, Any] | None = None
        for items in rounds or ([[]] if byte_items else []):
            boxes = {it.storage_index.fqn: Boxes(((0, tuple(int(a) + int(b) for a, b in zip(
                it.storage_index.offset, it.storage_offsets)), tuple(int(n) for n in it.lengths)),)) for it in items}
            res = load(self.url, StateLayout.of(1, boxes), 0, step=self.step, storage_options=self.storage_options)
            for it in items:
                target = planner.resolve_tensor(it).detach()
                target.copy_(res.shard[it.storage_index.fqn].view(target.shape))
                planner.commit_tensor(it, target)
            if objects is None:
                objects = {k: v for k, v in res.shard.items() if k not in boxes}
        for it in byte_items:
            buf = io.BytesIO()
            torch.save((objects or {})[it.storage_index.fqn], buf)
            buf.seek(0)
            planner.load_bytes(it, buf)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
