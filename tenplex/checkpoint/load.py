"""Loading a rank's shard: pick the newest attempt that verifies, check the model, run the read plan.

``load`` tries the catalogue's candidates newest first (``catalog.iter_candidates``), passing over
attempts that fail a check; ``load_with_reader`` checks a verified manifest against the caller's
model and layout, reads the objects and runs ``read_shard`` (the plan of ``read_plan.plan_reads``
through a ``ShardReader``) into new tensors or a ``ShardSink``'s (``tenplex.native.state_dict`` loads in
place).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import torch

from ..errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointValueError
from ..layout.models import model_differences
from ..layout.ptc import PTC, Layout
from .catalog import iter_candidates, url_fs
from .format import (
    OBJECTS_NAME,
    VERSION,
    Binding,
    Chunk,
    Manifest,
    writer_assignment,
)
from .part_reader import PartReader, Scatter, ShardReader
from .read_plan import ReadItem, plan_reads, shard_buffers

__all__ = ["LoadStats", "LoadResult", "ReadOptions", "ShardSink", "read_shard", "read_objects", "check_model",
           "load_with_reader", "load"]

log = logging.getLogger(__name__)


_CHECK_AHEAD = 64 << 20
"""Bytes read but not yet verified that a local load lets run ahead of its checksum thread: the
reads wait for older checks beyond it, so the buffers the checks still hold (temporaries of relaid
tensors, which are freed only once verified and finished) stay bounded when checksums are slower
than the reads."""

@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a load read: ``bytes_read`` counts data bytes fetched (checksum blocks and, on
    remote filesystems, bridged gaps included), ``ranges`` the data reads issued,
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
    saved_layout: Layout
    stats: LoadStats
    skipped: tuple[tuple[int, str, str], ...] = ()


class ShardSink(Protocol):
    """Where a load puts a rank's tensors instead of new ones (``tenplex.native.state_dict`` loads in place).

    ``buffer(name)``: the flat buffer, in the saved canonical order, that the reads fill (a view of
    the caller's tensor when its memory has that order, a ``Scatter`` of it when its memory holds
    that order's runs at strides, else a temporary); ``copies(name)``: whether ``finish`` copies (it
    then runs in a second thread as soon as the tensor's last read is in); ``finish(name, flat)``:
    the shard's value once every read of ``name`` is in (``flat``: what ``buffer`` gave)."""

    def buffer(self, name: str) -> torch.Tensor | Scatter: ...

    def copies(self, name: str) -> bool: ...

    def finish(self, name: str, flat: torch.Tensor) -> Any: ...


def read_shard(saved: PTC, old: Layout, cfg: Layout, rank: int, reader: ShardReader,
               writers: Mapping[int, list[Chunk]] | None = None,
               sink: ShardSink | None = None, version: int = VERSION) -> tuple[dict[str, Any], int]:
    """Rank ``rank``'s tensors under ``cfg`` from chunks written under ``old``: the plan
    (``plan_reads``), executed by ``reader``; which file (or tier) each read comes from is the
    reader's business. Returns the shard and the real (non-padding) bytes it needed.
    ``writers``: ``writer_assignment(saved, old)`` when the caller has it; ``sink``: where the
    tensors go (default: new tensors in their natural local shape); ``version``: the checkpoint's format version."""
    items = plan_reads(saved, old, cfg, rank, writers=writers, version=version)
    needed = sum(item.length * item.itemsize for item in items)
    if sink is None:
        buffers = shard_buffers(saved, cfg, rank)
        copies: Callable[[str], bool] = saved.relaid

        def finish(name: str, flat: torch.Tensor) -> Any:
            return saved.from_local_flat(name, cfg, flat, rank)
    else:
        buffers, copies, finish = _sink_buffers(sink, getattr(reader, "scatters", False))
    return _read_and_finish(saved.rank_tensors(cfg, rank), reader, items, buffers, copies, finish, rank), needed


def _sink_buffers(sink: ShardSink, scatters: bool) -> tuple[_LazyBuffers, Callable[[str], bool],
                                                              Callable[[str, Any], Any]]:
    """A sink's buffers, ``copies`` and ``finish`` for a reader; one that cannot ``scatters`` gets a
    temporary for each ``Scatter``, copied into it by ``finish``."""
    if scatters:
        return _LazyBuffers(sink.buffer), sink.copies, sink.finish
    later: dict[str, Scatter] = {}

    def make(name: str) -> torch.Tensor:
        out = sink.buffer(name)
        if isinstance(out, Scatter):
            later[name] = out
            return torch.empty(out.numel, dtype=out.dtype)
        return out

    def finish(name: str, flat: Any) -> Any:
        scatter = later.pop(name, None)
        if scatter is not None:
            scatter.fill(flat)
        return sink.finish(name, flat)

    return _LazyBuffers(make), lambda name: name in later or sink.copies(name), finish


class _LazyBuffers(dict):  # type: ignore[type-arg]
    """A sink's flat buffers, each made when its tensor's first read asks for it (or ``pop`` does),
    not all up front: a temporary made after earlier ones were freed reuses their memory, where
    temporaries all allocated at the start each touch fresh pages that the allocator keeps once
    freed (the process's peak memory grew with the whole shard). Thread-safe creation."""

    def __init__(self, make: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.make = make
        self.lock = threading.Lock()

    def __missing__(self, name: str) -> torch.Tensor:
        with self.lock:
            if not dict.__contains__(self, name):
                dict.__setitem__(self, name, self.make(name))
            return dict.__getitem__(self, name)

    def pop(self, name: str, *default: Any) -> torch.Tensor:  # type: ignore[override]
        if not default:
            self[name]  # noqa: B018 - made if no read asked for it yet (a tensor with nothing to read)
        return dict.pop(self, name, *default)


def _read_and_finish(names: Sequence[str], reader: ShardReader, items: Sequence[ReadItem],
                     buffers: dict[str, torch.Tensor], copies: Callable[[str], bool],
                     finish: Callable[[str, torch.Tensor], Any], rank: int) -> dict[str, Any]:
    """Execute ``items``; a tensor whose ``finish`` copies (split on a dim > 0: the file holds it
    split dim first; or a caller's tensor the reads cannot fill directly) is finished in a second
    thread as soon as its last piece is in, while later pieces are still being read. Each flat
    buffer is dropped once finished, so at most the tensors in flight exist twice (peak memory)."""
    count: dict[str, int] = {}
    for item in items:
        count[item.tensor] = count.get(item.tensor, 0) + 1
    done: dict[str, Any] = {}
    lock = threading.Lock()
    waiting = threading.Lock()
    queued: list[tuple[Any, int]] = []  # finishes submitted and not yet waited for, with their bytes
    ahead = [0]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenplex-relayout") as pool:

        def on_read(i: int) -> None:
            name = items[i].tensor
            with lock:
                count[name] -= 1
                if count[name]:
                    return
            if copies(name):  # the flat buffer's last references are the copy's (and the checksums')
                flat = buffers.pop(name)
                with waiting:  # bounded temporaries awaiting their copy (on_read may run in several threads)
                    done[name] = pool.submit(finish, name, flat)
                    queued.append((done[name], flat.numel() * flat.element_size()))
                    ahead[0] += queued[-1][1]
                    while ahead[0] > _CHECK_AHEAD and len(queued) > 1:
                        fut, n = queued.pop(0)
                        fut.result()
                        ahead[0] -= n

        reader.read_items(items, buffers, rank=rank, on_read=on_read)
        out = {name: fut.result() for name, fut in done.items()}
    for name in [n for n in names if n not in out]:  # cheap reshapes, no copy
        out[name] = finish(name, buffers.pop(name))
    return {name: out[name] for name in names}


def read_objects(sources: Sequence[tuple[fsspec.AbstractFileSystem, str]],
                 manifest: Manifest) -> tuple[dict[str, Any], Any, int]:
    """The small objects and ``extra`` of a save attempt, from the first directory of ``sources``
    whose ``objects.pt`` has the size and SHA-256 the manifest records (checked before
    unpickling) and holds objects of the saved PTC; and the bytes read to find it."""
    want = manifest.raw["objects"]
    objects_of = manifest.full().ptc.objects  # type: ignore[union-attr]
    errors = []
    nread = 0
    for fs, sdir in sources:
        path = f"{sdir}/{OBJECTS_NAME}"
        try:
            raw = fs.cat_file(path)
        except OSError as e:
            errors.append(f"{path} cannot be read ({e})")
            continue
        nread += len(raw)
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
        return dict(payload["objects"]), payload["extra"], nread
    raise CheckpointCorruptError("; ".join(errors) + "; the objects file is damaged")


def check_model(saved: PTC, expected: PTC, where: str, *, allow_meta_change: bool = False) -> None:
    """CheckpointMismatchError unless ``saved`` has ``expected``'s tensors and, unless
    ``allow_meta_change``, its model settings (``meta["model"]``, where both record them; what
    ``expected`` leaves unstated, norm epsilon, RoPE or source config, is the checkpoint's:
    ``tenplex.layout.models.model_differences``)."""
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
    diffs = model_differences(a, b)  # the request's unstated hyperparameters and source config accept the saved ones
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {where} was saved with other model settings ({'; '.join(diffs)}); its tensors have the "
            "requested shapes, but training would continue another model: pass allow_meta_change=True to load "
            "it anyway"
        )


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What a load checks a checkpoint against and where it puts the tensors.

    ``ptc``: the model the caller expects (``check_model``; None: any); ``allow_meta_change``: accept
    other model settings with the same tensors; ``sink``: where the tensors go (``ShardSink``; None:
    new tensors); ``check(saved)``: the caller's own check of the saved model (raise to refuse), run
    before anything is read."""

    ptc: PTC | None = None
    allow_meta_change: bool = False
    sink: ShardSink | None = None
    check: Callable[[PTC], None] | None = None

    def __post_init__(self) -> None:
        if self.ptc is not None and not isinstance(self.ptc, PTC):
            raise CheckpointValueError(f"ReadOptions.ptc must be a PTC or None, got {type(self.ptc).__name__}")
        if not isinstance(self.allow_meta_change, bool):
            raise CheckpointValueError(f"ReadOptions.allow_meta_change must be a bool, got {self.allow_meta_change!r}")
        if self.check is not None and not callable(self.check):
            raise CheckpointValueError(f"ReadOptions.check must be callable or None, got {self.check!r}")
        missing = [m for m in ("buffer", "copies", "finish") if self.sink is not None and not hasattr(self.sink, m)]
        if missing:
            raise CheckpointValueError(f"ReadOptions.sink lacks {missing} of a ShardSink's 3 methods "
                                       f"(buffer, copies, finish): {3 - len(missing)} of 3 present")


def load_with_reader(manifest: Manifest, where: str, cfg: Layout, rank: int, reader: ShardReader,
                     objects_from: Sequence[tuple[fsspec.AbstractFileSystem, str]], *,
                     options: ReadOptions = ReadOptions(), t0: float) -> LoadResult:
    """Check a verified ``manifest`` against ``options`` (the expected model, the caller's check) and
    ``cfg``, read the objects (from the first of ``objects_from``'s directories whose copy matches the
    manifest), then ``rank``'s shard through ``reader`` into ``options.sink``. Shared by ``load`` and
    tiered recovery, whose readers differ."""
    manifest = manifest.full()
    saved, old = manifest.ptc, manifest.layout
    assert saved is not None
    if options.ptc is not None:
        check_model(saved, options.ptc, where, allow_meta_change=options.allow_meta_change)
    if options.check is not None:
        options.check(saved)
    saved.check(cfg)
    cfg.coords(rank)
    writers = writer_assignment(saved, old)
    reader.bind(Binding.of(manifest, writers))
    try:
        objects, extra, objects_bytes = read_objects(objects_from, manifest)  # small: fails fast, before the data
        shard, needed = read_shard(saved, old, cfg, rank, reader, writers=writers, sink=options.sink,
                                   version=manifest.raw["version"])
        shard.update(objects)
    finally:
        reader.close()
    stats = LoadStats(needed, reader.bytes_read, reader.metadata_bytes + objects_bytes, reader.ranges,
                      time.perf_counter() - t0)
    return LoadResult(shard, manifest.step, extra, saved, old, stats)


def load(
    url: str,
    cfg: Layout,
    rank: int,
    *,
    step: int | None = None,
    ptc: PTC | None = None,
    allow_meta_change: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    options: ReadOptions | None = None,
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
    ``options``: ``ReadOptions`` (its ``sink`` and ``check``: ``tenplex.native.state_dict``'s in-place loads);
    ``ptc`` and ``allow_meta_change`` go either here or there, not both.
    """
    if options is None:
        options = ReadOptions(ptc, allow_meta_change)
    elif ptc is not None or allow_meta_change:
        raise CheckpointValueError("load: pass ptc and allow_meta_change either as arguments or in options, not both")
    t0 = time.perf_counter()
    fs, root = url_fs(url, storage_options)
    skipped: list[tuple[int, str, str]] = []
    for info, manifest in iter_candidates(fs, root, url, step):
        if not isinstance(manifest, Manifest):
            if manifest is not None and not isinstance(manifest, CheckpointCorruptError):
                raise manifest  # a format version this tenplex does not read
            skipped.append((info.step, info.save_id, info.problem))
            continue
        reader = PartReader(fs, info.path)
        reader.metadata_bytes += manifest.nbytes
        try:
            result = load_with_reader(manifest, f"{url} step {info.step}", cfg, rank, reader, [(fs, info.path)],
                                      options=options, t0=t0)
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
