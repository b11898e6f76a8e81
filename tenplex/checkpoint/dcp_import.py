"""``import_dcp``: a ``torch.distributed.checkpoint`` directory (any sharding, DTensor or plain tensors)
becomes a tenplex checkpoint.

By default (no ``model`` and no Hugging Face names) it keeps the checkpoint's own partitioning: every DCP
chunk becomes the box of a pseudo writer rank (one per DCP file), the non-tensor entries become objects,
and the result is a state-dict checkpoint (``StateLayout`` of ``Boxes``) that ``tenplex.load_state_dict``
loads under any mesh, reading only what each rank needs. With a ``model`` (or ``hf_config``), tensors named
like tenplex's GPT/Llama collections (``embedding.word``, ``layers.{i}.attn.qkv.weight``,
``optimizer.exp_avg.*``) get their TP/PP partitioning under ``layout``; Hugging Face names are mapped first
(``hf_mapping``); any other tensor is imported replicated on every stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, TenplexError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec, model_ptc, model_spec, optimizer_names
from ..layout.ptc import PTC, TensorSpec
from ..layout.state_layout import Boxes, StateLayout, spec_for
from ..urls import url_fs
from . import save
from .hf_mapping import has_hf_names, hf_config_to_spec, hf_to_tenplex
from .import_source import (
    ImportResult,
    check_shapes,
    checked_options,
    import_step,
    save_global,
    state_dtype,
)
from .writer import default_save_id

__all__ = ["read_dcp_state", "DcpChunk", "dcp_chunk_layout", "import_dcp_chunks", "DcpNames", "import_dcp"]

log = logging.getLogger(__name__)


def read_dcp_state(src: str | Path, *, storage_options: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a DCP checkpoint as a full (unsharded) tensor, and its non-tensor items.

    Reads in this process without a process group (``no_dist``); whatever sharding the
    checkpoint was saved with, the result holds the global tensors. A URL (or any
    ``storage_options``) is read through fsspec (DCP's ``FsspecReader``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader, md = _dcp_metadata(src, storage_options)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            objects[fqn] = None
    want: dict[str, Any] = {**tensors, **objects}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, storage_reader=reader, no_dist=True)
    return {k: want[k] for k in tensors}, {k: want[k] for k in objects}


def _dcp_metadata(src: str | Path, storage_options: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """A DCP ``StorageReader`` of ``src`` (``FsspecReader`` for a URL or with options) and its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # public there (its __all__)

    opts = checked_options(storage_options, "source_storage_options")
    fs, path = url_fs(src, opts, options="source_storage_options")
    reader = (dcp.FileSystemReader(path) if isinstance(fs, LocalFileSystem) and not opts
              else FsspecReader(str(src), **opts))
    try:
        md = reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{src} has no DCP .metadata file") from None
    return reader, md


@dataclass(frozen=True, slots=True)
class DcpChunk:
    """One saved DCP chunk: the tensor, its box, the pseudo rank that holds it, DCP's index of it."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    index: Any  # torch.distributed.checkpoint.metadata.MetadataIndex


def dcp_chunk_layout(md: Any, *, strip_prefix: str = "") -> tuple[PTC, StateLayout, list[DcpChunk], list[Any]]:
    """The collection and layout of a DCP checkpoint's metadata with its partitioning kept (pure).

    Every chunk becomes the box of a pseudo writer rank: rank ``i`` holds the chunks stored in the
    ``i``-th DCP file (sorted by name); a file holding several chunks of one tensor gives the
    extra ones ranks of their own after those. Returns the PTC (tensors in DCP's dtypes, non-tensor
    entries as objects), the ``StateLayout`` of ``Boxes``, every chunk, and the DCP indexes of the
    non-tensor entries. CheckpointError for metadata it cannot place.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    storage = md.storage_data or {}
    files = sorted({info.relative_path for info in storage.values()})
    file_rank = {f: i for i, f in enumerate(files)}
    extra_rank = len(files)
    chunks: list[DcpChunk] = []
    byte_items: list[Any] = []
    specs: list[TensorSpec] = []
    layout: dict[str, Boxes] = {}
    objects: list[str] = []
    by_name: dict[str, list[Any]] = {}
    for index in storage:
        by_name.setdefault(index.fqn, []).append(index)
    for fqn, item in md.state_dict_metadata.items():
        name = fqn.removeprefix(strip_prefix)
        if isinstance(item, BytesStorageMetadata):
            objects.append(name)
            byte_items.extend((name, i) for i in by_name.get(fqn, []))
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{fqn}: DCP metadata of type {type(item).__name__} is neither a tensor nor bytes")
        found = {tuple(int(x) for x in i.offset): i for i in by_name.get(fqn, [])}
        held: set[int] = set()
        boxes = []
        for c in item.chunks:
            offsets, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            index = found.get(offsets)
            if index is None:
                raise CheckpointError(f"{fqn}: the DCP metadata lists a chunk at offsets {list(offsets)} but no "
                                      "storage entry for it (a damaged .metadata)")
            rank = file_rank[storage[index].relative_path]
            if rank in held:
                rank, extra_rank = extra_rank, extra_rank + 1
            held.add(rank)
            boxes.append((rank, offsets, sizes))
            chunks.append(DcpChunk(name, offsets, sizes, rank, index))
        placed = Boxes(tuple(boxes))
        specs.append(spec_for(name, tuple(int(x) for x in item.size), item.properties.dtype, placed))
        layout[name] = placed
    names = [s.name for s in specs] + objects
    if len(set(names)) != len(names):
        raise CheckpointError(f"names repeat after removing the prefix {strip_prefix!r}: "
                              f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
    ptc = PTC(specs, num_layers=0, objects=objects, meta={"kind": "state_dict", "imported_from": "dcp"})
    state_layout = StateLayout.of(max(extra_rank, 1), layout)
    try:
        state_layout.check(ptc, complete=True)
    except TenplexError as e:
        raise CheckpointError(f"the DCP checkpoint's chunks do not tile its tensors: {e}") from None
    return ptc, state_layout, chunks, byte_items


class _ChunkSink:
    """The three ``LoadPlanner`` calls a DCP ``StorageReader.read_data`` makes: tensors into
    preallocated chunk buffers, byte entries unpickled as DCP's own planner does."""

    def __init__(self, buffers: Mapping[Any, torch.Tensor]) -> None:
        self.buffers = buffers
        self.values: dict[Any, Any] = {}

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        return self.buffers[read_item.dest_index]

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.values[read_item.dest_index] = torch.load(value, weights_only=False)  # as DCP's DefaultLoadPlanner


def _read_chunks(reader: Any, md: Any, items: list[tuple[Any, torch.Size | None, torch.dtype | None]]) -> _ChunkSink:
    """Read the DCP entries ``items`` (index, chunk size and dtype, or None for byte entries) with
    ``reader``: each chunk once, into fresh buffers."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    buffers: dict[Any, torch.Tensor] = {}
    reads = []
    for index, size, dtype in items:
        if size is None:
            reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            continue
        buffers[index] = torch.empty(size, dtype=dtype)
        zero = torch.Size((0,) * len(size))
        reads.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zero, storage_index=index,
                              storage_offsets=zero, lengths=torch.Size(size)))
    sink = _ChunkSink(buffers)
    if reads:
        reader.read_data(LoadPlan(reads), sink).wait()
    return sink


def import_dcp_chunks(src: str | Path, url: str, *, step: int | None = None, strip_prefix: str = "",
                      storage_options: Mapping[str, Any] | None = None,
                      source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a DCP checkpoint keeping its partitioning: each DCP file becomes the part of one pseudo
    writer rank holding the same chunks (``dcp_chunk_layout``), so nothing is duplicated, and the
    result loads with ``tenplex.load_state_dict`` under any mesh (each rank reading only its
    ranges). Streams: one DCP file's chunks in memory at a time, each read once. ``step``: default
    the source's (``import_step``).
    """
    t0 = time.perf_counter()
    opts = checked_options(storage_options, "storage_options")
    reader, md = _dcp_metadata(src, source_storage_options)
    reader.set_up_storage_reader(md, True)
    ptc, layout, chunks, byte_items = dcp_chunk_layout(md, strip_prefix=strip_prefix)
    props = {fqn.removeprefix(strip_prefix): item.properties.dtype for fqn, item in md.state_dict_metadata.items()
             if hasattr(item, "chunks")}
    objs = _read_chunks(reader, md, [(i, None, None) for _, i in byte_items]).values
    objects = {name: objs[i] for name, i in byte_items}
    step = import_step(src, step, objects)
    per_rank: dict[int, list[DcpChunk]] = {r: [] for r in range(layout.world_size)}
    for c in chunks:
        per_rank[c.rank].append(c)
    save_id = default_save_id(layout, ptc)
    extra = {"imported_from": "dcp", "source": str(src)}
    written = 0
    for rank in range(layout.world_size):
        got = _read_chunks(reader, md, [(c.index, torch.Size(c.sizes), props[c.name]) for c in per_rank[rank]])
        shard: dict[str, Any] = {c.name: got.buffers[c.index] for c in per_rank[rank]}
        if rank == 0:
            shard.update(objects)
        written += save(url, ptc, layout, rank, shard, step=step, extra=extra, save_id=save_id,
                        storage_options=opts).bytes_written
        del got, shard
    nbytes = sum(s.nbytes for s in ptc.tensors.values())
    log.info("imported DCP checkpoint %s (%d tensors, %d objects, %d chunks in %d files) into %s keeping its "
             "partitioning: %d tensor bytes, %d written in %.2fs", src, len(ptc), len(objects), len(chunks),
             layout.world_size, url, nbytes, written, time.perf_counter() - t0)
    return ImportResult(ptc, layout, step, url, "dcp", len(ptc), written)


def _dcp_ptc(tensors: Mapping[str, torch.Tensor], spec: ModelSpec | None) -> PTC:
    """The collection for DCP tensors: the model's PTC (with optimizer state when present)
    plus every other tensor replicated on all stages."""
    if spec is None:
        specs = [TensorSpec(n, tuple(t.shape), t.dtype, placement="all") for n, t in tensors.items()]
        return PTC(specs, meta={"imported_from": "dcp"})
    params = model_ptc(spec, optimizer=False)
    opt_names = [n for p in params for n in optimizer_names(p).values()
                 if not (n.startswith("optimizer.main.") and spec.dtype == torch.float32)]
    have = [n for n in opt_names if n in tensors]
    if have and len(have) != len(opt_names):
        missing = sorted(set(opt_names) - set(have))
        raise CheckpointError(f"the DCP checkpoint has optimizer state for some parameters only; "
                              f"missing e.g. {missing[:3]}")
    base = model_ptc(spec, optimizer=bool(have))
    missing = [n for n in base if n not in tensors]
    if missing:
        raise CheckpointError(f"the DCP checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    extras = [TensorSpec(n, tuple(t.shape), t.dtype, placement="all") for n, t in tensors.items() if n not in base]
    if extras:
        log.info("importing %d tensors outside the model replicated on every stage", len(extras))
    return PTC(list(base.tensors.values()) + extras, num_layers=base.num_layers, objects=base.objects,
               meta={**base.meta, "imported_from": "dcp"})


@dataclass(frozen=True, slots=True)
class DcpNames:
    """What a DCP checkpoint's tensor names are, and so how ``import_dcp`` partitions them.

    ``keep_partitioning`` (default: when neither ``model`` nor ``hf_config`` is given and the names
    are not Hugging Face's): keep the checkpoint's chunks as they are (``import_dcp_chunks``); the
    result is loaded with ``tenplex.load_state_dict`` under any mesh, and the import's ``layout`` is not
    used. Otherwise the tensors are read whole and saved under ``layout``: ``model``: the ModelSpec (or
    preset name) whose tenplex-named tensors the checkpoint holds; their TP/PP partitioning then
    applies under every layout. ``hf_config``: the checkpoint holds Hugging Face names of this
    config (mapped as in ``import_hf``). Neither (``keep_partitioning=False``): every tensor is
    imported replicated (loadable under any layout, but not TP-split).
    ``strip_prefix`` is removed from every name first (e.g. ``"model."`` of a wrapped module).
    """

    model: ModelSpec | str | None = None
    hf_config: Mapping[str, Any] | None = None
    strip_prefix: str = ""
    keep_partitioning: bool | None = None

    def __post_init__(self) -> None:
        if self.keep_partitioning and (self.model is not None or self.hf_config is not None):
            raise ConfigError("keep_partitioning keeps the DCP checkpoint's own names and chunks: it takes no "
                              "model or hf_config")


def import_dcp(src: str | Path, url: str, *, names: DcpNames | None = None, layout: ParallelConfig | None = None,
               step: int | None = None, storage_options: Mapping[str, Any] | None = None,
               source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a torch.distributed.checkpoint directory as a tenplex checkpoint.

    ``names``: what the tensor names are and whether the chunks are kept (``DcpNames``; default: kept
    unless the names are Hugging Face's). ``layout``: the layout the tensors are saved under when the
    chunks are not kept. ``step``: default the source's (``source_step``: torchtitan's ``step-5``; else
    its saved ``train_state.step``), else 0.
    ``storage_options``: fsspec options of the tenplex checkpoint ``url``;
    ``source_storage_options``: of ``src`` when it is a URL.
    """
    names = names or DcpNames()
    model, hf_config, strip_prefix = names.model, names.hf_config, names.strip_prefix
    keep_partitioning = names.keep_partitioning
    if keep_partitioning is None:
        keep_partitioning = model is None and hf_config is None and not has_hf_names(
            k.removeprefix(strip_prefix) for k in _dcp_metadata(src, source_storage_options)[1].state_dict_metadata)
    if keep_partitioning:
        if layout is not None and layout != ParallelConfig():
            log.warning("importing %s with its own partitioning: layout %s is not used (load the result with "
                        "tenplex.load_state_dict under any mesh)", src, layout)
        return import_dcp_chunks(src, url, step=step, strip_prefix=strip_prefix, storage_options=storage_options,
                                 source_storage_options=source_storage_options)
    layout = layout or ParallelConfig()
    tensors, objects = read_dcp_state(src, storage_options=source_storage_options)
    step = import_step(src, step, objects)
    if strip_prefix:
        tensors = {k.removeprefix(strip_prefix): v for k, v in tensors.items()}
    spec: ModelSpec | None
    if hf_config is not None or has_hf_names(tensors):
        if hf_config is None:
            raise ConfigError("the DCP checkpoint holds Hugging Face names: pass the model's config.json (hf_config)")
        spec = dataclasses.replace(hf_config_to_spec(hf_config, state_dtype(tensors, None)),
                                   source_config=dict(hf_config))
        tensors = hf_to_tenplex(tensors, spec)
    else:
        spec = model_spec(model) if isinstance(model, str) else model
    ptc = _dcp_ptc(tensors, spec)
    check_shapes(ptc, tensors)
    state: dict[str, Any] = {n: tensors[n].to(ptc.tensors[n].dtype) for n in ptc.tensors}
    for o in ptc.objects:
        if o in objects:
            state[o] = objects[o]
    extra: dict[str, Any] = {"imported_from": "dcp",
                             "objects": {k: v for k, v in objects.items() if k not in ptc.objects}}
    n = save_global(url, ptc, state, layout, step, extra=extra, storage_options=storage_options)
    log.info("imported DCP checkpoint %s (%d tensors) into %s under %s", src, len(ptc), url, layout)
    return ImportResult(ptc, layout, step, url, "dcp", len(ptc), n)
