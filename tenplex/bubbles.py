"""Side work inside pipeline bubbles (after FreeRide): run small steps while a stage waits for a peer.

The reference trainer's 1F1B schedule waits for activations (forward) and gradients
(backward) from neighbouring stages; those waits are the pipeline bubbles. ``BubbleRuntime``
is installed as the trainer's ``bubble_hook``: while a receive is pending it calls
``step()`` of registered iterative side tasks, but only while the bubble's predicted
remaining time exceeds the task's profiled step time times a margin, so training does not
wait for a side task (up to the accuracy of the profile). Bubble lengths are profiled per schedule position over the first
iterations; nothing runs until a position has been seen.

``SnapshotTask`` copies the rank's state in buckets into host buffers during the bubbles of
iteration k. Parameters and optimizer state change only at the optimizer step, so what it
copies is the state after step k-1; buckets not copied when the optimizer step starts are
copied then (the only blocking part), so every snapshot is consistent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["SideTask", "BubbleRuntime", "SnapshotTask", "StoreWriteTask", "Span"]

log = logging.getLogger(__name__)


class SideTask(Protocol):
    """An iterative side task: ``step()`` does one small unit of work. A task may set
    ``expected_step_s``: the runtime's guess of its step time until it has measured one."""

    name: str

    def step(self) -> None: ...

    def is_finished(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Span:
    """A timed interval of one iteration: kind is "wait" (a bubble) or "task:<name>"."""

    iteration: int
    kind: str
    start: float
    end: float
    label: str = ""


@dataclass
class _Profile:
    """Exponential moving average of a duration, with the largest recent value as a guard."""

    ema: float = 0.0
    seen: int = 0

    def update(self, value: float, alpha: float = 0.3) -> None:
        self.ema = value if self.seen == 0 else (1 - alpha) * self.ema + alpha * value
        self.seen += 1


class BubbleRuntime:
    """Runs side tasks inside a stage's waits. Install with ``trainer.bubble_hook = runtime``."""

    def __init__(self, *, margin: float = 1.2, profile_iterations: int = 2, poll_s: float = 2e-4,
                 record: bool = True, default_step_s: float = 1e-3) -> None:
        self.margin = margin
        self.default_step_s = default_step_s
        self.profile_iterations = profile_iterations
        self.poll_s = poll_s
        self.record = record
        self.tasks: list[Any] = []
        self.bubbles: dict[tuple[str, int], _Profile] = {}
        self.task_time: dict[str, _Profile] = {}
        self.iteration = 0
        self.spans: list[Span] = []
        self.wait_s = 0.0
        self.used_s = 0.0

    def register(self, task: Any) -> None:
        self.tasks.append(task)
        self.task_time.setdefault(task.name, _Profile())

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def __call__(self, op: Any, work: Any) -> None:
        """The trainer's hook: called with a pending receive; returns when it has completed.

        Side-task steps run while the profiled bubble has time left for one more step (and,
        where the backend reports it, while the receive is still pending); then it waits.
        Gloo's receives report completion only once waited on, so the profile decides there.
        """
        key = (op.kind, op.mb)
        prof = self.bubbles.setdefault(key, _Profile())
        t0 = time.perf_counter()
        predicted = prof.ema if prof.seen >= self.profile_iterations else 0.0
        while not work.is_completed():
            task = self._next_task(predicted - (time.perf_counter() - t0))
            if task is None:
                break
            s0 = time.perf_counter()
            task.step()
            s1 = time.perf_counter()
            self.task_time[task.name].update(s1 - s0)
            self.used_s += s1 - s0
            if self.record:
                self.spans.append(Span(self.iteration, f"task:{task.name}", s0, s1))
        w0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        if t1 - w0 > self.poll_s or prof.seen < self.profile_iterations:
            prof.update(t1 - t0)  # the peer was still busy: t1 - t0 is the whole bubble
        else:  # the data was already there: the bubble was at most this long
            prof.ema = min(prof.ema, t1 - t0)
        self.wait_s += t1 - t0
        if self.record:
            self.spans.append(Span(self.iteration, "wait", t0, t1, f"{op.kind}{op.mb}"))

    def _next_task(self, remaining: float) -> Any:
        for task in self.tasks:
            if task.is_finished():
                continue
            prof = self.task_time[task.name]
            guess = getattr(task, "expected_step_s", self.default_step_s)
            need = max(prof.ema, 0.0 if prof.seen else guess) * self.margin
            if remaining > need:
                return task
        return None


@dataclass
class SnapshotTask:
    """Copies a state dict's tensors into host buffers, ``bucket_bytes`` at a time.

    ``begin(step, tensors)`` starts a snapshot of ``tensors`` (taken as they are now: call it
    before the iteration's optimizer step changes them); ``step()`` copies one bucket;
    ``finish()`` copies what is left (blocking) and returns ``{name: host copy}``, after which
    ``on_complete(step, snapshot)`` runs (e.g. a background write to the host store). Two
    buffer sets alternate, so a background writer may use a snapshot until the next one
    completes.
    """

    bucket_bytes: int = 1 << 20
    on_complete: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    name: str = "snapshot"
    completed: int = 0
    blocking_bytes: int = 0
    bubble_bytes: int = 0

    @property
    def expected_step_s(self) -> float:
        """A conservative guess before the first measured step: a bucket at 1 GB/s."""
        return self.bucket_bytes / 1e9

    def __post_init__(self) -> None:
        self._todo: list[tuple[str, torch.Tensor, int, int]] = []
        self._src: dict[str, torch.Tensor] = {}
        self._step = -1
        self._sets: list[dict[str, torch.Tensor]] = [{}, {}]
        self.buffers: dict[str, torch.Tensor] = self._sets[0]

    def begin(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        self._step = step
        self._src = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        self._todo = []
        self.buffers = self._sets[self.completed % 2]
        for name, t in self._src.items():
            if name not in self.buffers or self.buffers[name].shape != t.shape or self.buffers[name].dtype != t.dtype:
                self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            flat_n = t.numel()
            per = max(1, self.bucket_bytes // max(t.element_size(), 1))
            for lo in range(0, flat_n, per):
                self._todo.append((name, t, lo, min(flat_n, lo + per)))
        self._todo.reverse()  # pop from the end

    def is_finished(self) -> bool:
        return not self._todo

    def _copy_one(self) -> int:
        name, t, lo, hi = self._todo.pop()
        dst = self.buffers[name].view(-1)
        dst[lo:hi].copy_(t.detach().reshape(-1)[lo:hi])
        return (hi - lo) * t.element_size()

    def step(self) -> None:
        if self._todo:
            self.bubble_bytes += self._copy_one()

    def finish(self) -> dict[str, torch.Tensor] | None:
        """Copy the remaining buckets (the blocking part) and complete the snapshot."""
        if self._step < 0:
            return None
        while self._todo:
            self.blocking_bytes += self._copy_one()
        snap = {n: self.buffers[n] for n in self._src}
        self.completed += 1
        step, self._step = self._step, -1
        if self.on_complete is not None:
            self.on_complete(step, snap)
        return snap


class StoreWriteTask:
    """Writes a rank's snapshot straight into its host store in bubble-sized pieces.

    ``begin(step, shard)`` lays out this rank's part of the save attempt exactly as
    ``tenplex.save`` would (same chunks, same checkpoint format): it pre-sizes the
    safetensors file and writes its header. ``step()`` writes one bucket of whole checksum
    blocks straight from the live tensors (no intermediate copy) and checksums it.
    ``finish()`` writes what is left (before the optimizer step: the only blocking part),
    then the rank index (and, on rank 0, the manifest and objects), which makes the part
    visible. The tensors must not change between ``begin`` and ``finish``: call ``finish``
    before the optimizer step.
    """

    name = "store-write"

    def __init__(self, root: str, ptc: Any, cfg: Any, rank: int, *, bucket_bytes: int = 1 << 20,
                 on_complete: Callable[[int, str], None] | None = None) -> None:
        from .checkpoint import writer_assignment

        self.root, self.ptc, self.cfg, self.rank = root, ptc, cfg, rank
        self.bucket_bytes = bucket_bytes
        self.on_complete = on_complete
        self.chunks = writer_assignment(ptc, cfg)[rank]
        self.completed = 0
        self.bubble_bytes = 0
        self.blocking_bytes = 0
        self._todo: list[tuple[int, int, int]] = []
        self._fd = -1
        self._publisher: threading.Thread | None = None

    @property
    def expected_step_s(self) -> float:
        return self.bucket_bytes / 5e8  # a conservative 0.5 GB/s for copy + checksum

    def is_finished(self) -> bool:
        return not self._todo

    def begin(self, step: int, shard: dict[str, Any]) -> None:
        from .checkpoint import _block_bytes, _step_dir, default_save_id, safetensors_header

        if self._publisher is not None:  # the previous snapshot's index must be out first
            self._publisher.join()
        self._step, self._shard = step, shard
        self._save_id = default_save_id(self.cfg, self.ptc)
        self._sdir = _step_dir(self.root.rstrip("/"), step, self._save_id)
        os.makedirs(self._sdir, exist_ok=True)
        entries, self._meta = [], []
        for name, lo, start, ln in self.chunks:
            entries.append((f"{name}@{start}", self.ptc.tensors[name].dtype, ln))
        head, offsets = safetensors_header(entries, {"format": "tenplex-checkpoint", "step": str(step),
                                                     "rank": str(self.rank)})
        for (name, lo, start, ln), (b0, b1) in zip(self.chunks, offsets):
            self._meta.append((name, lo, start, ln, b0, b1 - b0, _block_bytes(b1 - b0)))
        self._base = len(head)
        self._size = self._base + (offsets[-1][1] if offsets else 0)
        self._path = f"{self._sdir}/rank-{self.rank:05d}.safetensors"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self._size)
        os.pwrite(self._fd, head, 0)
        self._flat: dict[str, torch.Tensor] = {}
        self._crcs: list[list[int]] = [[0] * (-(-m[5] // m[6])) for m in self._meta]
        self._todo = []
        for i, (_, _, _, _, _, nbytes, block) in enumerate(self._meta):
            per = max(block, self.bucket_bytes // block * block)
            self._todo.extend((i, a, min(nbytes, a + per)) for a in range(0, nbytes, per))
        self._todo.reverse()

    def _write_one(self) -> int:
        import zlib

        i, a, b = self._todo.pop()
        name, lo, _, ln, off, nbytes, block = self._meta[i]
        if name not in self._flat:  # canonical flat view (a copy only for tensors split on dim > 0)
            self._flat[name] = self.ptc.to_local_flat(name, self._shard[name].detach())
        src = self._flat[name][lo : lo + ln]
        view = memoryview(src.contiguous().view(torch.uint8).numpy()).cast("B")[a:b]
        os.pwrite(self._fd, view, self._base + off + a)
        for pos in range(a, b, block):
            self._crcs[i][pos // block] = zlib.crc32(view[pos - a : min(pos - a + block, b - a)])
        return b - a

    def step(self) -> None:
        if self._todo:
            self.bubble_bytes += self._write_one()

    def finish(self) -> str | None:
        """Write the remaining buckets (blocking: the tensors change next), then publish the part's
        index and metadata in the background; returns the save attempt's directory."""
        if self._fd < 0:
            return None
        while self._todo:
            self.blocking_bytes += self._write_one()
        os.close(self._fd)
        self._fd = -1
        self._flat = {}
        objects = {o: self._shard[o] for o in self.ptc.objects if o in self._shard}
        self._publisher = threading.Thread(target=self._publish, args=(self._step, self._sdir, self._save_id,
                                                                       self._meta, self._crcs, objects), daemon=True)
        self._publisher.start()
        return self._sdir

    def _publish(self, step: int, sdir: str, save_id: str, meta: list, crcs: list, objects: dict) -> None:
        from .checkpoint import _fs, write_index, write_rank0_meta

        fs, _ = _fs(self.root, None)
        chunks = [{"tensor": name, "start": start, "length": ln, "offset": self._base + off, "block": block,
                   "crc32": "".join(f"{c:08x}" for c in cs)}
                  for (name, _, start, ln, off, _, block), cs in zip(meta, crcs)]
        if self.rank == 0:
            write_rank0_meta(fs, sdir, self.ptc, self.cfg, objects, step=step, save_id=save_id)
        write_index(fs, sdir, self.rank, self._size, chunks)
        self.completed += 1
        if self.on_complete is not None:
            self.on_complete(step, sdir)

    def close(self) -> None:
        """Wait until the last snapshot is published."""
        if self._publisher is not None:
            self._publisher.join()
