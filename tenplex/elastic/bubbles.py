"""Side work inside pipeline bubbles (after FreeRide): run small steps while a stage waits for a peer.

The reference trainer's 1F1B schedule waits for activations (forward) and gradients
(backward) from neighbouring stages; those waits are the pipeline bubbles. ``BubbleRuntime``
is installed as the trainer's ``bubble_hook``: while a receive is pending it calls
``step()`` of registered iterative side tasks, but only while the bubble's predicted
remaining time exceeds the task's profiled step time times a margin, so training does not
wait for a side task (up to the accuracy of the profile). Bubble lengths are profiled per
schedule position over the first iterations; nothing runs until a position has been seen.
``BubbleRuntime.windows`` reports, per stage and iteration, when each wait started, how long
it was expected to last and the memory a side task may use; ``forecast()`` gives the same for
the next iteration.

Every side task declares the memory it may hold (``memory_bytes``); the runtime has a
per-stage budget (``memory_budget``, e.g. from ``side_task_memory_budget``), refuses a task
that does not fit when it is registered and throttles (gives no bubble time to) a task whose
footprint grows past what it was granted.

``SnapshotTask`` copies the rank's state in buckets into host buffers during the bubbles of
iteration k. Parameters and optimizer state change only at the optimizer step, so what it
copies is the state after step k-1; buckets not copied when the optimizer step starts are
copied then (the only blocking part), so every snapshot is consistent. On CUDA the copies
run on a dedicated stream of the lowest priority, into pinned buffers.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..checkpoint.format import check_step, chunk_block, step_dir, writer_assignment
from ..checkpoint.writer import PartWriter, default_save_id
from ..errors import CheckpointValueError, ConfigError, SideTaskMemoryError
from ..planning.memory import MemoryEstimate, parse_size
from ..urls import url_fs

__all__ = ["SideTask", "BubbleRuntime", "BubbleWindow", "SnapshotTask", "StoreWriteTask", "Span",
           "SideTaskMemoryError", "side_task_memory_budget"]

log = logging.getLogger(__name__)


class SideTask(Protocol):
    """An iterative side task: ``step()`` does one small unit of work. A task may set
    ``expected_step_s`` (the runtime's guess of its step time until it has measured one),
    ``next_step_s`` (the expected time of its next step, or None: for tasks whose steps differ
    in cost; the runtime then trusts it instead of its own average of past steps),
    ``memory_bytes`` (the most memory it holds; 0 when absent) and ``fit_memory(limit)`` (shrink
    to at most ``limit`` bytes where it can; returns the bytes it will hold)."""

    name: str

    def step(self) -> None: ...

    def is_finished(self) -> bool: ...


def side_task_memory_budget(est: MemoryEstimate, stage: int, device_bytes: int | str, *,
                            fraction: float = 0.8) -> int:
    """Bytes the side tasks of ``stage`` may use: what the planner's rule (training may use
    ``fraction`` of the device) leaves after the stage's estimated training memory; 0 if none."""
    return max(0, int(fraction * parse_size(device_bytes)) - est.stages[stage].total_bytes)


@dataclass(frozen=True, slots=True)
class Span:
    """A timed interval of one iteration: kind is "wait" (a bubble) or "task:<name>"."""

    iteration: int
    kind: str
    start: float
    end: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class BubbleWindow:
    """One idle period of a stage: ``start_s`` after the iteration began, expected to last
    ``expected_s`` (0 while still being profiled), measured ``measured_s`` (None in a forecast).
    ``memory_bytes``: what side tasks on the stage may use together (None: no budget);
    ``memory_free``: the part of it no registered task holds."""

    stage: int
    iteration: int
    position: str
    start_s: float
    expected_s: float
    measured_s: float | None
    memory_bytes: int | None
    memory_free: int | None

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass
class _Profile:
    """Exponential moving average of a duration, with the largest recent value as a guard."""

    ema: float = 0.0
    seen: int = 0

    def update(self, value: float, alpha: float = 0.3) -> None:
        self.ema = value if self.seen == 0 else (1 - alpha) * self.ema + alpha * value
        self.seen += 1


class BubbleRuntime:
    """Runs side tasks inside a stage's waits. Install with ``trainer.bubble_hook = runtime``.

    ``memory_budget``: bytes (or a size such as ``"2GiB"``) the side tasks of this stage may hold
    together; None means no limit. ``stage``: the pipeline stage, for the windows report.
    ``device``: the stage's device; on CUDA every ``step()`` runs with a dedicated stream of the
    lowest priority current (``self.stream``), so a task's kernels neither queue behind nor
    delay the training stream's (a task that must see the training stream's results waits on
    it itself, as ``SnapshotTask`` does).
    """

    def __init__(self, *, margin: float = 1.2, profile_iterations: int = 2, poll_s: float = 2e-4,
                 record: bool = True, default_step_s: float = 1e-3, stage: int = 0,
                 memory_budget: int | str | None = None, growth: float = 1.05,
                 device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else None
        self.stream: Any = None
        if dev is not None and dev.type == "cuda":  # lower priority = larger number
            self.stream = torch.cuda.Stream(dev, priority=max(torch.cuda.Stream.priority_range()))
        self.margin = margin
        self.growth = growth
        self.default_step_s = default_step_s
        self.profile_iterations = profile_iterations
        self.poll_s = poll_s
        self.record = record
        self.stage = stage
        self.memory_budget = None if memory_budget is None else (
            parse_size(memory_budget) if memory_budget else 0)
        self.tasks: list[Any] = []
        self.grants: dict[str, int] = {}
        self.bubbles: dict[tuple[str, int], _Profile] = {}
        self.starts: dict[tuple[str, int], _Profile] = {}
        self.task_time: dict[str, _Profile] = {}
        self.iteration = 0
        self.spans: list[Span] = []
        self.windows: list[BubbleWindow] = []
        self.wait_s = 0.0
        self.used_s = 0.0
        self._t_iter = time.perf_counter()
        self._throttled: set[str] = set()

    @property
    def memory_free(self) -> int | None:
        """Budget bytes not granted to a registered task (None: no budget)."""
        return None if self.memory_budget is None else self.memory_budget - sum(self.grants.values())

    def register(self, task: Any, *, memory_bytes: int | None = None) -> None:
        """Add a side task, granting it ``memory_bytes`` (default: the task's ``memory_bytes``).

        A task with ``fit_memory`` is first asked to fit what is left of the budget. Raises
        SideTaskMemoryError when the task needs more than that.
        """
        if task.name in self.grants:
            raise ConfigError(f"a side task named {task.name!r} is already registered")
        free = self.memory_free
        fitted = task.fit_memory(free) if free is not None and hasattr(task, "fit_memory") else None
        need = memory_bytes if memory_bytes is not None else int(
            fitted if fitted is not None else getattr(task, "memory_bytes", 0))
        if free is not None and need > free:
            held = ", ".join(f"{n} {b} B" for n, b in self.grants.items()) or "nothing"
            raise SideTaskMemoryError(
                f"side task {task.name!r} needs {need} B but stage {self.stage}'s side-task memory budget of "
                f"{self.memory_budget} B has {free} B left (granted: {held}); give BubbleRuntime a larger "
                f"memory_budget or make the task smaller")
        self.tasks.append(task)
        self.grants[task.name] = need
        self.task_time.setdefault(task.name, _Profile())
        log.debug("stage %d: side task %s granted %d B (budget %s)", self.stage, task.name, need, self.memory_budget)

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self._t_iter = time.perf_counter()

    def forecast(self) -> list[BubbleWindow]:
        """The profiled idle periods of the next iteration, in schedule order."""
        keys = sorted((k for k, p in self.bubbles.items() if p.seen >= self.profile_iterations),
                      key=lambda k: self.starts[k].ema)
        return [BubbleWindow(self.stage, self.iteration + 1, f"{k[0]}{k[1]}", self.starts[k].ema,
                             self.bubbles[k].ema, None, self.memory_budget, self.memory_free) for k in keys]

    def __call__(self, op: Any, work: Any) -> None:
        """The trainer's hook: called with a pending receive; returns when it has completed.

        Side-task steps run while the profiled bubble has time left for one more step (and,
        where the backend reports it, while the receive is still pending); then it waits.
        Gloo's receives report completion only once waited on, so the profile decides there.
        """
        key = (op.kind, op.mb)
        prof = self.bubbles.setdefault(key, _Profile())
        t0 = time.perf_counter()
        self.starts.setdefault(key, _Profile()).update(t0 - self._t_iter)
        predicted = prof.ema if prof.seen >= self.profile_iterations else 0.0
        ran = False
        while not work.is_completed():
            task = self._next_task(predicted - (time.perf_counter() - t0))
            if task is None:
                break
            ran = True
            s0 = time.perf_counter()
            if self.stream is None:
                task.step()
            else:
                with torch.cuda.stream(self.stream):
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
            # the peer was still busy: t1 - t0 is the whole bubble. Side work on a busy CPU can
            # itself delay the data (the transport's threads wait for a core), so a bubble that
            # ran side tasks may lengthen the profile only slowly, or it would feed on itself
            prof.update(t1 - t0 if not ran else min(t1 - t0, prof.ema * self.growth))
        else:  # the data was already there: the bubble was at most this long
            prof.ema = min(prof.ema, t1 - t0)
        self.wait_s += t1 - t0
        if self.record:
            self.spans.append(Span(self.iteration, "wait", t0, t1, f"{op.kind}{op.mb}"))
            self.windows.append(BubbleWindow(self.stage, self.iteration, f"{op.kind}{op.mb}", t0 - self._t_iter,
                                             predicted, t1 - t0, self.memory_budget, self.memory_free))

    def _next_task(self, remaining: float) -> Any:
        for task in self.tasks:
            if task.is_finished() or self._over_budget(task):
                continue
            nxt = getattr(task, "next_step_s", None)  # a task whose steps differ says what the next one costs
            if nxt is None:
                prof = self.task_time[task.name]
                nxt = max(prof.ema, 0.0 if prof.seen else getattr(task, "expected_step_s", self.default_step_s))
            need = nxt * self.margin
            if remaining > need:
                return task
        return None

    def _over_budget(self, task: Any) -> bool:
        """A task holding more than its grant gets no bubble time (its work then runs blocking)."""
        if self.memory_budget is None or getattr(task, "memory_bytes", 0) <= self.grants[task.name]:
            return False
        if task.name not in self._throttled:
            self._throttled.add(task.name)
            log.warning("stage %d: side task %s holds %d B, more than its %d B grant: it gets no bubble time",
                        self.stage, task.name, task.memory_bytes, self.grants[task.name])
        return True


@dataclass
class SnapshotTask:
    """Copies a state dict's tensors into host buffers, ``bucket_bytes`` at a time.

    ``begin(step, tensors)`` starts a snapshot of ``tensors`` (taken as they are now: call it
    before the iteration's optimizer step changes them); ``step()`` copies one bucket;
    ``finish()`` copies what is left (blocking) and returns ``{name: host copy}`` (plus the
    non-tensor values given to ``begin``), after which ``on_complete(step, snapshot)`` runs (e.g.
    a background write to the host store, or the in-process trainer's ring of consistent states).
    ``pending`` is true between ``begin`` and ``finish``.

    Memory: the host buffers, ``buffer_sets`` copies of the state (``state_bytes``, learnt at
    the first ``begin`` unless given), used in turn: a snapshot stays valid until its set is
    reused ``buffer_sets`` snapshots later, which ``on_begin(step, buffers)`` announces before
    the set is overwritten. With two sets a background writer may use a snapshot until the next
    one completes; under a ``memory_limit`` below two copies one set is used, and a snapshot is
    then valid only until the next ``begin``. A state larger than the limit raises
    SideTaskMemoryError.

    CUDA tensors are copied into pinned buffers with non-blocking copies on a dedicated stream
    of the lowest priority (one bucket in flight, so a step takes about one copy's time);
    ``finish`` waits for that stream's last copy before returning, hence before the optimizer
    step changes the tensors.
    """

    bucket_bytes: int = 1 << 20
    on_complete: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    on_begin: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    name: str = "snapshot"
    state_bytes: int = 0
    buffer_sets: int = 2
    memory_limit: int | None = None
    completed: int = 0
    blocking_bytes: int = 0
    bubble_bytes: int = 0

    @property
    def expected_step_s(self) -> float:
        """A conservative guess before the first measured step: a bucket at 1 GB/s."""
        return self.bucket_bytes / 1e9

    @property
    def memory_bytes(self) -> int:
        """Host buffer bytes: those allocated or, if more, those the next snapshot will need."""
        held = sum(t.nbytes for s in self._sets for t in s.values())
        return max(held, self.buffer_sets * self.state_bytes)

    def __post_init__(self) -> None:
        if self.buffer_sets < 1:
            raise ConfigError(f"buffer_sets must be at least 1, got {self.buffer_sets}")
        self._todo: list[tuple[str, torch.Tensor, int, int]] = []
        self._src: dict[str, torch.Tensor] = {}
        self._objects: dict[str, Any] = {}
        self._step = -1
        self._sets: list[dict[str, torch.Tensor]] = [{} for _ in range(self.buffer_sets)]
        self.buffers: dict[str, torch.Tensor] = self._sets[0]
        self._stream: Any = None  # torch.cuda.Stream of the lowest priority, made at the first CUDA snapshot
        self._copied: Any = None  # torch.cuda.Event after the last bucket issued on it

    def fit_memory(self, limit: int) -> int:
        """Use at most ``limit`` bytes of host buffers; returns the bytes it will hold (``limit``
        while the state's size is unknown)."""
        self.memory_limit = limit
        if not self.state_bytes:
            return limit
        self._fit_sets(self.state_bytes, raise_=False)
        return self.memory_bytes

    def _fit_sets(self, state: int, *, raise_: bool = True) -> None:
        if self.memory_limit is None or self.buffer_sets * state <= self.memory_limit:
            return
        if raise_ and state > self.memory_limit:
            raise SideTaskMemoryError(
                f"side task {self.name!r}: a snapshot of {state} B needs one host copy of the state but its memory "
                f"limit is {self.memory_limit} B; raise the stage's side-task memory budget")
        if self.buffer_sets > 1:
            log.info("%s: %d B of state, %d B memory limit: one host buffer set instead of %d",
                     self.name, state, self.memory_limit, self.buffer_sets)
            self.buffer_sets = 1
            for extra in self._sets[1:]:
                extra.clear()

    def begin(self, step: int, tensors: dict[str, Any]) -> None:
        """Start the snapshot of ``tensors`` (non-tensor values are kept as they are)."""
        self._step = step
        self._src = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        self._objects = {n: v for n, v in tensors.items() if not isinstance(v, torch.Tensor)}
        self.state_bytes = sum(t.nbytes for t in self._src.values())
        self._fit_sets(self.state_bytes)
        self._todo = []
        self.buffers = self._sets[self.completed % self.buffer_sets]
        if self.on_begin is not None:
            self.on_begin(step, self.buffers)  # the set about to be overwritten: its holder lets go of it
        cuda = [t.device for t in self._src.values() if t.is_cuda]
        if cuda:
            if self._stream is None:  # lower priority = larger number
                self._stream = torch.cuda.Stream(cuda[0], priority=max(torch.cuda.Stream.priority_range()))
            self._stream.wait_stream(torch.cuda.current_stream(cuda[0]))  # after the work that made the state
        for name, t in self._src.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            flat_n = t.numel()
            per = max(1, self.bucket_bytes // max(t.element_size(), 1))
            for lo in range(0, flat_n, per):
                self._todo.append((name, t, lo, min(flat_n, lo + per)))
        self._todo.reverse()  # pop from the end

    def is_finished(self) -> bool:
        return not self._todo

    @property
    def pending(self) -> bool:
        """A snapshot was begun and not finished."""
        return self._step >= 0

    def _copy_one(self) -> int:
        name, t, lo, hi = self._todo.pop()
        dst = self.buffers[name].view(-1)[lo:hi]
        src = t.detach().reshape(-1)[lo:hi]
        if t.is_cuda:
            if self._copied is not None:
                self._copied.synchronize()  # one bucket in flight
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        else:
            dst.copy_(src)
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
        if self._copied is not None:  # the pinned buffers are complete before the tensors may change
            self._copied.synchronize()
            self._copied = None
        snap: dict[str, Any] = {n: self.buffers[n] for n in self._src}
        snap.update(self._objects)
        self.completed += 1
        step, self._step = self._step, -1
        if self.on_complete is not None:
            self.on_complete(step, snap)
        return snap


class StoreWriteTask:
    """Writes a rank's snapshot straight into its host store in bubble-sized pieces.

    ``begin(step, shard)`` only records the shard (it runs at the start of an iteration, on the
    critical path). The steps, run in bubbles, then: write the previous snapshot's rank index
    (and, on rank 0, the manifest and objects), which makes that part visible; lay out this
    rank's part of the save attempt with the ``PartWriter`` that ``tenplex.save`` uses (same
    chunks, same checkpoint format: the safetensors file pre-sized, its header written); and
    write one bucket of whole checksum blocks per step straight from the live tensors,
    checksummed: a zero-copy view where the tensor's local order is the canonical one, else a copy of just
    the rows holding the bucket. ``finish()`` does what is left of this (before the optimizer
    step: the only blocking part); the snapshot's own index follows in the next iteration's
    first bubble, or at the next ``finish()`` or ``close()``. A snapshot is therefore visible
    one bubble after its step; ``completed`` counts the visible ones. The tensors must not
    change between ``begin`` and ``finish``: call ``finish`` before the optimizer step. CPU
    tensors only.

    Memory: ``memory_bytes``, the largest bucket it copies (tensors split on a dim > 0, whose
    local order differs from the checkpoint's: the bucket plus up to two rows); 0 when every
    bucket is a view. ``fit_memory(limit)`` shrinks the buckets (to one checksum block at least).
    """

    def __init__(self, root: str, ptc: Any, cfg: Any, rank: int, *, bucket_bytes: int = 1 << 20,
                 on_complete: Callable[[int, str], None] | None = None, name: str = "store-write") -> None:
        self.root, self.ptc, self.cfg, self.rank = root, ptc, cfg, rank
        self.name = name
        self.bucket_bytes = bucket_bytes
        self.on_complete = on_complete
        self.chunks = writer_assignment(ptc, cfg)[rank]
        relaid = [n for n, *_ in self.chunks if ptc.relaid(n)]
        shapes = {n: ptc.local_shape(n, cfg) for n in relaid}
        self._row_bytes = max((math.prod(s) // s[ptc.tensors[n].split_dim] * ptc.tensors[n].dtype.itemsize
                               for n, s in shapes.items()), default=0)
        self._max_block = max((chunk_block(ptc.tensors[n], ln * ptc.tensors[n].itemsize) for n, _, _, ln in self.chunks),
                              default=0)
        self.completed = 0
        self.bubble_bytes = 0
        self.blocking_bytes = 0
        self._todo: list[tuple[int, int, int]] = []
        self._fd = -1
        self._to_open = False  # begin() ran, the file is not laid out yet
        self._part: PartWriter | None = None  # the snapshot being written
        self._unpublished: tuple[PartWriter, dict[str, Any]] | None = None  # finished, its index not written yet
        self._cost: dict[str, float] = {}  # measured step costs: "publish", "open" (s); "fixed", "byte" (buckets)

    @property
    def expected_step_s(self) -> float:
        return self.bucket_bytes / 5e8  # a conservative 0.5 GB/s for copy + checksum

    @property
    def next_step_s(self) -> float | None:
        """Expected time of the next step from this task's own measurements: an index write, a
        file layout, or a bucket (seconds per byte times its bytes); None until measured."""
        if self._unpublished is not None:
            return self._cost.get("publish")
        if self._to_open:
            return self._cost.get("open")
        if self._todo and "byte" in self._cost:
            i, a, b = self._todo[-1]
            return self._cost["fixed"] + self._cost["byte"] * (b - a)
        return None

    def _measure(self, kind: str, seconds: float, nbytes: int = 0, count: int = 1) -> None:
        """Fold a measured step (or ``count`` buckets of ``nbytes`` together) into the cost model."""
        c = self._cost
        if kind != "bucket":
            c[kind] = seconds if kind not in c else 0.7 * c[kind] + 0.3 * seconds
            return
        # Buckets: decayed sums of time, bytes and calls, so the per-byte rate is a ratio of sums
        # weighted by bytes. A per-bucket rate would let one small bucket (a norm weight, a few KiB
        # at the per-call overhead) price every 1 MiB bucket at many ms, which then never fits a
        # bubble again and so is never measured again. A fixed part of 50 us per call covers that
        # overhead.
        c.setdefault("fixed", 5e-5)
        for key, v in (("t", seconds), ("n", float(nbytes)), ("k", float(count))):
            c[key] = v if key not in c else 0.7 * c[key] + v
        c["byte"] = max(c["t"] - c["fixed"] * c["k"], 0.0) / max(c["n"], 1.0)

    @property
    def memory_bytes(self) -> int:
        if not self._row_bytes:
            return 0
        return max(self.bucket_bytes, self._max_block) + 2 * self._row_bytes

    def fit_memory(self, limit: int) -> int:
        """Shrink the buckets so that a copied one fits ``limit`` bytes where possible; returns the bytes held."""
        if self.memory_bytes > limit:
            self.bucket_bytes = max(self._max_block, limit - 2 * self._row_bytes)
            log.info("%s: buckets of %d B to fit %d B of side-task memory", self.name, self.bucket_bytes, limit)
        return self.memory_bytes

    def is_finished(self) -> bool:
        return not (self._unpublished or self._to_open or self._todo)

    def begin(self, step: int, shard: dict[str, Any]) -> None:
        if self._to_open or self._fd >= 0:
            raise RuntimeError(f"{self.name}: begin({step}) before finish() of snapshot {self._step}")
        on_gpu = [n for n, t in shard.items() if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        if on_gpu:
            raise CheckpointValueError(
                f"{self.name}: StoreWriteTask writes from host memory, but {on_gpu[0]} is on "
                f"{shard[on_gpu[0]].device}; snapshot GPU state with SnapshotTask (pinned host buffers) and write the "
                "host copy from its on_complete")
        self._step, self._shard = step, shard
        self._to_open = True
        self._todo = []

    def _open(self) -> None:
        """Lay out this rank's part of the save attempt: pre-sized file, header, bucket list."""
        t0 = time.perf_counter()
        self._to_open = False
        step = check_step(self._step)
        save_id = default_save_id(self.cfg, self.ptc)
        fs, _ = url_fs(self.root, None)
        part = PartWriter(fs, step_dir(self.root.rstrip("/"), step, save_id), self.ptc, self.cfg, self.rank,
                          step=step, save_id=save_id, assigned=self.chunks)
        part.begin()  # refuses when the save id was used before: never write into that attempt
        self._part = part
        self._fd = part.open_local()  # published (write-once) with the index
        self._todo = []
        for i, c in enumerate(part.chunks):
            per = max(c.block, self.bucket_bytes // c.block * c.block)
            self._todo.extend((i, a, min(c.nbytes, a + per)) for a in range(0, c.nbytes, per))
        self._todo.reverse()
        self._measure("open", time.perf_counter() - t0)

    def _write_one(self) -> int:
        assert self._part is not None
        i, a, b = self._todo.pop()
        c = self._part.chunks[i]
        size = self.ptc.tensors[c.tensor].dtype.itemsize
        view = memoryview(self._canonical(c.tensor, c.local + a // size, c.local + b // size).view(torch.uint8)
                          .numpy()).cast("B")
        self._part.write_at(self._fd, i, a, view)
        return b - a

    def _canonical(self, name: str, e0: int, e1: int) -> torch.Tensor:
        """Elements [e0, e1) of the local shard in canonical flat order (``PTC.to_local_flat``),
        copying at most the rows that hold them."""
        local = self._shard[name].detach()
        if not self.ptc.relaid(name):
            return local.contiguous().reshape(-1)[e0:e1]
        rows = local.movedim(self.ptc.tensors[name].split_dim, 0)
        row = rows[0].numel()
        r0, r1 = e0 // row, -(-e1 // row)
        return rows[r0:r1].contiguous().reshape(-1)[e0 - r0 * row : e1 - r0 * row]

    def step(self) -> None:
        if self._unpublished is not None:
            self._publish()
        elif self._to_open:
            self._open()
        elif self._todo:
            t0 = time.perf_counter()
            n = self._write_one()
            self.bubble_bytes += n
            self._measure("bucket", time.perf_counter() - t0, n)

    def finish(self) -> str | None:
        """Do what the bubbles left (blocking: the tensors change next): the previous snapshot's
        index, this one's layout and remaining buckets; returns the save attempt's directory."""
        if not (self._to_open or self._fd >= 0):
            return None
        # measured like bubble steps: what runs here also informs what fits a bubble next time
        if self._unpublished is not None:
            self._publish()
        if self._to_open:
            self._open()
        if self._todo:
            t0, n, k = time.perf_counter(), 0, len(self._todo)
            while self._todo:
                n += self._write_one()
            self.blocking_bytes += n
            self._measure("bucket", time.perf_counter() - t0, n, k)
        assert self._part is not None
        self._part.finish_local(self._fd)  # the CRC table, now that every block is checksummed
        os.close(self._fd)
        self._fd = -1
        assert self._part is not None
        objects = {o: self._shard[o] for o in self.ptc.objects if o in self._shard}
        part, self._part = self._part, None
        self._unpublished = (part, objects)
        self._shard = {}
        return part.sdir

    def _publish(self) -> None:
        """Write the finished snapshot's rank index (rank 0: also manifest and objects): it becomes visible."""
        assert self._unpublished is not None
        t0 = time.perf_counter()
        part, objects = self._unpublished
        self._unpublished = None
        part.publish(objects=objects)
        self.completed += 1
        if self.on_complete is not None:
            self.on_complete(part.step, part.sdir)
        self._measure("publish", time.perf_counter() - t0)

    def close(self) -> None:
        """Make the last finished snapshot visible (write its index)."""
        if self._unpublished is not None:
            self._publish()
