"""Replaying a failure trace on a large job: layouts, planning, transfers and goodput.

A trace is a list of :class:`FailureEvent` (a JSON-lines file, or drawn from the failure rates
and classes the Llama 3 report gives for 16,384 H100s: 419 unexpected interruptions in 54
days). :func:`simulate_trace` replays it on a job of ``gpus`` GPUs in hosts of ``gpus_per_host``
with a pool of spare hosts (:class:`SimulationSettings`). A failed host goes to repair and comes back as a spare
``repair_h`` hours later; a spare replaces a failed host at once when one is free, else the job
shrinks to the GPUs it has and grows back when hosts return.

For every event it runs the real code, timed: the chooser (``choose_layout`` with spares and
uneven batches), the survivor assignment (``locality_order``), the planner and the transfer
scheduler over the cluster's topology. Events of the same shape (layouts before and after,
the pipeline stage of the failed host, how the job changes) reuse the first one's results
and are marked ``cached``. Over the run it compares the goodput of tenplex (in-process and
restart paths) with restarting from the last persistent checkpoint: see docs/scale.md for the
cost model and its parameters.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec, model_ptc
from .layouts import LayoutChoice, choose_layout
from .memory import resolve_model
from .planner import locality_order, plan
from .schedule import schedule
from .topology import Topology

__all__ = ["FailureClass", "FAILURE_CLASSES", "LLAMA3_COMPONENTS", "LLAMA3_INTERRUPTIONS", "LLAMA3_UNEXPECTED",
           "LLAMA3_DAYS", "LLAMA3_GPUS", "FailureEvent", "draw_trace", "read_trace", "CostModel",
           "SimulationSettings", "EventResult", "SimulationResult", "simulate_trace", "plot_simulation"]

log = logging.getLogger(__name__)

HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class FailureClass:
    """A class of interruption: its share of all of them, the hosts it takes out and for how
    long (``repair_h``; 0: the host is back at once, e.g. a crashed process). ``planned``: a
    planned stop (maintenance, upgrades), announced, so a checkpoint precedes it and no work is
    lost; the policies pay only its restart (tenplex.planning.policies)."""

    share: float
    hosts: int
    repair_h: float
    planned: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1 or self.hosts < 0 or self.repair_h < 0:
            raise ConfigError(f"a failure class needs 0 < share <= 1, hosts >= 0, repair_h >= 0, got {self}")


#: The Llama 3 report's root causes of its 419 unexpected interruptions in 54 days on 16,384 H100
#: (arXiv 2407.21783, table 5): component -> (count, class). The report's percentages are of 419
#: except the first (148 is 35.3 %, printed 30.1 %); the counts are what the classes' shares use.
LLAMA3_COMPONENTS: dict[str, tuple[int, str]] = {
    "faulty GPU": (148, "gpu"), "GPU HBM3 memory": (72, "gpu"), "software bug": (54, "software"),
    "network switch/cable": (35, "network"), "host maintenance": (32, "host"), "GPU SRAM memory": (19, "gpu"),
    "GPU system processor": (17, "gpu"), "NIC": (7, "network"), "NCCL watchdog timeouts": (7, "software"),
    "silent data corruption": (6, "gpu"), "GPU thermal interface and sensor": (6, "gpu"), "SSD": (3, "host"),
    "power supply": (3, "host"), "server chassis": (2, "host"), "IO expansion board": (2, "host"),
    "dependency": (2, "software"), "CPU": (2, "host"), "system memory": (2, "host"),
}
#: Interruptions of the Llama 3 run: 466 in all, 419 unexpected, so 47 planned.
LLAMA3_INTERRUPTIONS, LLAMA3_UNEXPECTED, LLAMA3_DAYS, LLAMA3_GPUS = 466, 419, 54.0, 16384

#: Hosts each class takes out and for how long; a process crash (software) restarts on its host.
_CLASS_HOSTS = {"gpu": (1, 24.0), "host": (1, 12.0), "network": (1, 4.0), "software": (0, 0.0)}


def _component_classes() -> dict[str, FailureClass]:
    """The classes' shares from the component counts of :data:`LLAMA3_COMPONENTS`."""
    total = sum(n for n, _ in LLAMA3_COMPONENTS.values())
    counts = {c: sum(n for n, k in LLAMA3_COMPONENTS.values() if k == c) for c in _CLASS_HOSTS}
    return {c: FailureClass(counts[c] / total, *_CLASS_HOSTS[c]) for c in _CLASS_HOSTS}


#: The Llama 3 component mix grouped by what a failure does to the job: GPU faults (faulty GPU,
#: HBM3, SRAM, system processor, thermal, silent data corruption: 268 of 419), other host hardware
#: and maintenance (46), network (switch and cable, NIC: 42), and software (bugs, NCCL watchdog,
#: dependencies: 63), whose process restarts on the same host.
FAILURE_CLASSES: dict[str, FailureClass] = _component_classes()


@dataclass(frozen=True, slots=True)
class FailureEvent:
    """An interruption at ``time_h`` hours into the run, of class ``cause`` (a key of the classes
    given to :func:`simulate_trace`)."""

    time_h: float
    cause: str

    def __post_init__(self) -> None:
        if not (isinstance(self.time_h, (int, float)) and math.isfinite(self.time_h) and self.time_h >= 0):
            raise ConfigError(f"a failure event's time_h must be a finite number >= 0, got {self.time_h!r}")


def draw_trace(*, days: float = 54.0, failures: int = 419, seed: int = 0,
               classes: Mapping[str, FailureClass] = FAILURE_CLASSES) -> list[FailureEvent]:
    """``failures`` interruptions at uniformly random times over ``days`` (a Poisson process
    conditioned on its count), each of a class drawn by the classes' shares. Pure given ``seed``."""
    if days <= 0 or failures < 0:
        raise ConfigError(f"draw_trace needs days > 0 and failures >= 0, got days={days}, failures={failures}")
    rng = np.random.default_rng(seed)
    names = list(classes)
    p = np.array([classes[n].share for n in names], dtype=np.float64)
    times = np.sort(rng.uniform(0.0, days * 24.0, failures))
    causes = rng.choice(len(names), size=failures, p=p / p.sum())
    return [FailureEvent(float(t), names[int(c)]) for t, c in zip(times, causes)]


def read_trace(path: str | Path) -> list[FailureEvent]:
    """A JSON-lines trace: one object per line with ``time_h`` and ``cause``; blank lines and
    lines starting with ``#`` are skipped."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
            out.append(FailureEvent(float(obj["time_h"]), str(obj["cause"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{i}: expected {{\"time_h\": hours, \"cause\": class}}, got {line!r} ({e})") \
                from None
    return sorted(out, key=lambda e: e.time_h)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds and rates the goodput comparison uses (docs/scale.md).

    ``detect_s``: failure to detection (heartbeats; all paths). ``restart_s``: relaunching
    every process and rendezvous (tenplex's restart path and checkpoint restart).
    ``ckpt_interval_h``: persistent checkpoint interval of the baseline; ``storage_bw``: bytes/s
    one GPU reads from persistent storage; ``host_store_bw``: bytes/s one GPU reads its state
    from the host stores after a restart (tenplex's restart path)."""

    detect_s: float = 1.0
    restart_s: float = 120.0
    ckpt_interval_h: float = 1.0
    storage_bw: float = 5e9
    host_store_bw: float = 25e9

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"CostModel.{f.name} must be a finite number >= 0, got {v!r}")
        if self.ckpt_interval_h <= 0 or self.storage_bw <= 0 or self.host_store_bw <= 0:
            raise ConfigError("CostModel.ckpt_interval_h, storage_bw and host_store_bw must be positive")


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    """The job, cluster and cost model a replay runs under (:func:`simulate_trace`).

    ``model``: a preset name or a ModelSpec; ``gpus``: the job's GPUs, in hosts of
    ``gpus_per_host``, with ``spare_hosts`` spare hosts. ``hours``: the run's length (None: the
    trace's last event, rounded up to a day). ``global_batch``, ``seq_len``, ``micro_batch``,
    ``gpu_mem``, ``distributed_optimizer``: what the chooser fits layouts to. ``topology``: link
    bandwidths of the cluster (``tenplex.planning.topology.Topology.from_spec`` without hosts and gpus,
    which come from the job). ``classes``: the failure classes the trace names; ``costs``: the
    goodput comparison's seconds and rates; ``schedule_limit``: seconds the transfer scheduler
    may take per event shape; ``seed``: which rank or host a failure hits. ``layout``: the
    starting layout (None: the chooser's best for ``gpus``; the chooser picks every later one).
    The one place a replay's choices live: further policies compared side by side go here.
    """

    model: ModelSpec | str
    gpus: int
    global_batch: int
    seq_len: int
    gpus_per_host: int = 8
    spare_hosts: int = 16
    hours: float | None = None
    micro_batch: int = 1
    gpu_mem: int | str = "80GiB"
    distributed_optimizer: bool = True
    topology: str = "nvlink=300GB/s,pcie=32GB/s,nic=50GB/s"
    classes: Mapping[str, FailureClass] = field(default_factory=lambda: dict(FAILURE_CLASSES))
    costs: CostModel = CostModel()
    schedule_limit: float = 10.0
    seed: int = 0
    layout: ParallelConfig | None = None

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "seq_len", "gpus_per_host", "micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"SimulationSettings.{name} must be an integer >= 1, got {v!r}")
        if self.gpus % self.gpus_per_host:
            raise ConfigError(f"gpus={self.gpus} is not a multiple of gpus_per_host={self.gpus_per_host} "
                              f"({self.gpus} % {self.gpus_per_host} = {self.gpus % self.gpus_per_host})")
        if not isinstance(self.spare_hosts, int) or self.spare_hosts < 0:
            raise ConfigError(f"SimulationSettings.spare_hosts must be an integer >= 0, got {self.spare_hosts!r}")
        if self.hours is not None and not (math.isfinite(self.hours) and self.hours > 0):
            raise ConfigError(f"SimulationSettings.hours must be a finite number > 0 or None, got {self.hours!r}")
        if not (math.isfinite(self.schedule_limit) and self.schedule_limit > 0):
            raise ConfigError(f"SimulationSettings.schedule_limit must be a finite number > 0, "
                              f"got {self.schedule_limit!r}")
        if not self.classes:
            raise ConfigError("SimulationSettings.classes is empty: a trace's causes need at least one class")

    @property
    def hosts(self) -> int:
        """Hosts of the job at full size."""
        return self.gpus // self.gpus_per_host

    def end_hours(self, trace: Sequence[FailureEvent]) -> float:
        """The run's length: ``hours``, else the trace's last event rounded up to a day."""
        if self.hours is not None:
            return self.hours
        return 24.0 * math.ceil(max([e.time_h for e in trace], default=0.0) / 24.0 + 1e-9)

    def check_trace(self, trace: Sequence[FailureEvent]) -> None:
        """ConfigError when the trace names a failure class the settings do not have."""
        unknown = sorted({e.cause for e in trace} - set(self.classes))
        if unknown:
            raise ConfigError(f"the trace names failure classes {unknown} that are not among {sorted(self.classes)}")


@dataclass(frozen=True, slots=True)
class EventResult:
    """One event of the replay. ``kind``: ``fail`` (a host lost, replaced by a spare or the job
    shrinks), ``restart`` (a process crash, same hosts) or ``grow`` (a repaired host rejoins).
    Times in seconds except ``time_h``; ``plan_s``: chooser + assignment + planner, measured;
    ``transfer_s``: the schedule's completion over the topology (the upper of
    ``transfer_bounds_s`` where the scheduler knew only bounds of it by its limit, else None);
    ``schedule_s``: the scheduler's time, measured (not part of the recovery: the naive
    transfer needs no schedule); ``recovery_s``: failure to the first step under the new layout
    on tenplex's in-process path; ``cached``: the figures are those of an earlier event of the
    same shape."""

    time_h: float
    kind: str
    cause: str
    gpus_lost: int
    layout_before: str
    layout_after: str
    idle_gpus: int
    chooser_s: float
    assign_s: float
    plan_s: float
    bytes_moved: int
    transfer_s: float
    recovery_s: float
    cached: bool
    transfer_bounds_s: tuple[float, float] | None = None
    schedule_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """A replay: its events and the goodput (useful tokens over those of an uninterrupted run at
    the starting layout) of tenplex in-process, tenplex with restarts, and checkpoint restart.
    ``step_s``: the starting layout's step; ``restart_recovery_s``: the restart path's mean seconds
    per event; ``ckpt_load_s``: the baseline's checkpoint load (what the policies of
    ``tenplex.planning.policies`` take from a replay); ``host_rates``: (hosts of the job, its
    throughput relative to the start) for every host count the replay ran at."""

    events: tuple[EventResult, ...]
    goodput_tenplex: float
    goodput_tenplex_restart: float
    goodput_checkpoint_restart: float
    simulate_s: float
    hours: float
    layout: str
    timeline: tuple[tuple[float, int, float], ...] = field(default=(), repr=False)
    step_s: float = 0.0
    restart_recovery_s: float = 0.0
    ckpt_load_s: float = 0.0
    host_rates: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"events": [e.to_json() for e in self.events], "goodput_tenplex": self.goodput_tenplex,
                "goodput_tenplex_restart": self.goodput_tenplex_restart,
                "goodput_checkpoint_restart": self.goodput_checkpoint_restart, "simulate_s": self.simulate_s,
                "hours": self.hours, "layout": self.layout,
                "timeline": [list(t) for t in self.timeline], "step_s": self.step_s,
                "restart_recovery_s": self.restart_recovery_s, "ckpt_load_s": self.ckpt_load_s,
                "host_rates": [list(h) for h in self.host_rates]}


@dataclass(slots=True)
class _Shape:
    """What one event shape costs (measured once)."""

    chooser_s: float
    assign_s: float
    plan_s: float
    bytes_moved: int
    transfer_s: float
    transfer_bounds_s: tuple[float, float] | None
    schedule_s: float


def simulate_trace(trace: Sequence[FailureEvent], settings: SimulationSettings, *,
                   progress: Callable[[str], None] | None = None) -> SimulationResult:
    """Replay ``trace`` on the job ``settings`` describe (see the module docstring);
    ``progress``: called with a line per event."""
    t_start = time.perf_counter()
    settings.check_trace(trace)
    replay = _Replay(settings, progress)
    end_h = settings.end_hours(trace)
    replay.run(trace, end_h)
    return replay.result(end_h, time.perf_counter() - t_start)


class _Replay:
    """The state of one replay: the job's hosts and layout, spares, the measured event shapes
    and the seconds each path lost; one method per kind of event."""

    def __init__(self, settings: SimulationSettings, progress: Callable[[str], None] | None) -> None:
        s = self.settings = settings
        self.progress = progress
        self.spec = resolve_model(s.model)
        self.choose_options: dict[str, Any] = dict(
            gpu_mem=s.gpu_mem, global_batch=s.global_batch, seq_len=s.seq_len, micro_batch=s.micro_batch,
            gpus_per_host=s.gpus_per_host, distributed_optimizer=s.distributed_optimizer, allow_idle=True,
            uneven_batch=True)
        self.ptc = model_ptc(self.spec, optimizer=True, distributed_optimizer=s.distributed_optimizer)
        self.choices: dict[int, tuple[LayoutChoice, float]] = {}
        if s.layout is not None:
            t0 = time.perf_counter()
            pinned = choose_layout(self.spec, s.gpus, pin=s.layout, **self.choose_options)
            self.choices[s.gpus] = (pinned, time.perf_counter() - t0)
        self.full, _ = self.choose(s.gpus)
        assert self.full.estimate is not None
        self.ideal_tps = self.full.tokens_per_second or 0.0
        self.step_s = self.full.step_seconds or 0.0
        self.shapes: dict[tuple[Any, ...], _Shape] = {}
        self.rng = np.random.default_rng(s.seed)
        # the job: its hosts (with their layout), spares
        self.current = self.full
        self.job_hosts = s.hosts
        self.spares = s.spare_hosts
        self.events: list[EventResult] = []
        self.timeline: list[tuple[float, int, float]] = [(0.0, self.full.cfg.world_size, 1.0)]
        self.host_rates: dict[int, float] = {s.hosts: 1.0}  # job hosts -> throughput relative to the start
        self.lost_s = {"tenplex": 0.0, "restart": 0.0, "ckpt": 0.0}  # seconds of full-speed training lost
        self.degraded: list[tuple[float, float]] = []  # (hours at this rate, tokens/s ratio to ideal)
        self.last_h, self.rate = 0.0, 1.0
        # the baseline: its checkpoint load reads the largest stage's state, per GPU in parallel
        self.load_s = _state_per_gpu(self.full) / s.costs.storage_bw
        self.ckpt_down_since: float | None = None  # hours: the baseline waits for hosts since then

    # -- the real code, timed ----------------------------------------------------------------------
    def choose(self, n: int) -> tuple[LayoutChoice, float]:
        """The chooser's layout of ``n`` GPUs and the seconds it took (once per ``n``)."""
        if n not in self.choices:
            t0 = time.perf_counter()
            self.choices[n] = (choose_layout(self.spec, n, **self.choose_options), time.perf_counter() - t0)
        return self.choices[n]

    def measure(self, old: ParallelConfig, new: ParallelConfig, lost: Sequence[int], key: tuple[Any, ...],
                old_world: int, gpus_after: int) -> tuple[_Shape, bool]:
        """Plan and schedule the move from ``old`` (ranks ``lost`` gone) to ``new``, the layout the
        chooser gave for ``gpus_after`` GPUs (its time counts as the event's); (shape, cached)."""
        if key in self.shapes:
            return self.shapes[key], True
        s = self.settings
        _, chooser_s = self.choose(gpus_after)
        gone = set(lost)
        survivors = [r for r in range(old.world_size) if r not in gone]
        t0 = time.perf_counter()
        alive = locality_order(self.ptc, old, new, survivors)  # new ranks beyond the survivors run on fresh devices
        assign_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        moves = plan(self.ptc, old, new, alive=alive, gpus_per_host=s.gpus_per_host)
        plan_s = time.perf_counter() - t0
        need = max(old_world, int(moves.devices.max()) + 1 if len(moves.devices) else 0)
        topo = Topology.from_spec(f"hosts={-(-need // s.gpus_per_host)},gpus={s.gpus_per_host},{s.topology}")
        sched = schedule(moves, topo, time_limit=s.schedule_limit)
        # the scheduler's own figure: at 16,384 GPUs the naive schedule's max-min fair completion
        # is known only within bounds by the limit (its exact value takes hours), then the upper one
        lo, hi = sched.completion_bounds()
        shape = _Shape(chooser_s, assign_s, plan_s, int(moves.stats.bytes_moved), hi,
                       None if lo == hi else (lo, hi), sched.solve_seconds)
        self.shapes[key] = shape
        return shape, False

    # -- accounting --------------------------------------------------------------------------------
    def advance(self, to_h: float) -> None:
        """The job ran at the current rate until ``to_h``."""
        self.degraded.append((to_h - self.last_h, self.rate))
        self.last_h = to_h

    def restart_cost(self, shape: _Shape, after: LayoutChoice) -> float:
        """Seconds the restart path loses: every process is relaunched, so every rank reads its
        whole state under the new layout (the largest stage's, all ranks at once) from the host
        stores, the bytes it lacks over the network (no sooner than the schedule's transfer);
        the same for a crash, a failed host and a returning one (docs/scale.md)."""
        costs = self.settings.costs
        reload = max(_state_per_gpu(after) / costs.host_store_bw, shape.transfer_s)
        return (costs.detect_s + costs.restart_s + shape.chooser_s + shape.assign_s + shape.plan_s + reload
                + self.step_s / 2)

    def record(self, time_h: float, kind: str, cause: str, lost_gpus: int, after: LayoutChoice,
               shape: _Shape, cached: bool) -> None:
        """One event from the current layout to ``after``: its record, and the seconds the two
        tenplex paths lose to it."""
        before = self.current
        transfer = shape.transfer_s
        recovery = self.settings.costs.detect_s + shape.chooser_s + shape.assign_s + shape.plan_s + transfer \
            + self.step_s / 2
        self.events.append(EventResult(
            time_h, kind, cause, lost_gpus, str(before.cfg), str(after.cfg), after.idle_gpus, shape.chooser_s,
            shape.assign_s, shape.plan_s, shape.bytes_moved, transfer, recovery, cached, shape.transfer_bounds_s,
            shape.schedule_s))
        self.lost_s["tenplex"] += recovery
        self.lost_s["restart"] += self.restart_cost(shape, after)
        if self.progress is not None:
            self.progress(f"{time_h:8.2f} h {kind:<7} {cause:<8} {before.cfg} -> {after.cfg} idle {after.idle_gpus}: "
                          f"plan {shape.plan_s:.2f}s transfer {transfer:.2f}s recovery {recovery:.2f}s"
                          f"{' (cached)' if cached else ''}")

    def mark_rate(self, t_h: float) -> None:
        """The current layout's throughput relative to the start, from ``t_h`` on."""
        self.rate = (self.current.tokens_per_second or 0.0) / self.ideal_tps if self.ideal_tps else 1.0
        self.host_rates[self.job_hosts] = self.rate
        self.timeline.append((t_h, self.current.cfg.world_size, self.rate))

    def ckpt_restart(self, since_ckpt_s: float) -> None:
        """The baseline restarts from its last checkpoint, unless it is down waiting for hosts."""
        if self.ckpt_down_since is None:
            c = self.settings.costs
            self.lost_s["ckpt"] += c.detect_s + c.restart_s + self.load_s + since_ckpt_s

    # -- events ------------------------------------------------------------------------------------
    def run(self, trace: Sequence[FailureEvent], end_h: float) -> None:
        """Replay the events up to ``end_h``; repaired hosts return as events of their own."""
        queue = [(e.time_h, 1, i, e) for i, e in enumerate(trace) if e.time_h <= end_h]
        heapq.heapify(queue)
        ckpt_interval_s = self.settings.costs.ckpt_interval_h * HOUR
        while queue:
            t_h, order, _, ev = heapq.heappop(queue)
            if t_h > end_h:
                break
            self.advance(t_h)
            if order == 0:
                self.host_returns(t_h)
                continue
            cls = self.settings.classes[ev.cause]
            since_ckpt_s = (t_h * HOUR) % ckpt_interval_s
            if cls.hosts == 0:
                self.process_crash(t_h, ev.cause, since_ckpt_s)
                continue
            heapq.heappush(queue, (t_h + cls.repair_h, 0, len(trace) + len(self.events), ev))
            self.host_fails(t_h, ev.cause, since_ckpt_s)
        self.advance(end_h)
        if self.ckpt_down_since is not None:
            self.lost_s["ckpt"] += (end_h - self.ckpt_down_since) * HOUR

    def host_returns(self, t_h: float) -> None:
        """A repaired host returns: to the job if it is short, else to the spares."""
        s = self.settings
        if self.job_hosts >= s.hosts:
            self.spares += 1
            self.mark_rate(t_h)
            return
        world_before = self.job_hosts * s.gpus_per_host
        self.job_hosts += 1
        after, _ = self.choose(self.job_hosts * s.gpus_per_host)
        key = ("grow", str(self.current.cfg), str(after.cfg))
        shape, cached = self.measure(self.current.cfg, after.cfg, (), key, world_before,
                                     self.job_hosts * s.gpus_per_host)
        self.record(t_h, "grow", "repair", 0, after, shape, cached)
        self.current = after
        if self.job_hosts == s.hosts and self.ckpt_down_since is not None:  # the baseline runs again: restart, load
            self.lost_s["ckpt"] += (t_h - self.ckpt_down_since) * HOUR + s.costs.restart_s + self.load_s
            self.ckpt_down_since = None
        self.mark_rate(t_h)

    def process_crash(self, t_h: float, cause: str, since_ckpt_s: float) -> None:
        """A process crash: same hosts, the crashed rank's state comes from its peers."""
        before = self.current
        world_before = self.job_hosts * self.settings.gpus_per_host
        victim = int(self.rng.integers(before.cfg.world_size))
        key = ("restart", str(before.cfg), _stage_of(before.cfg, victim, self.spec.num_layers))
        shape, cached = self.measure(before.cfg, before.cfg, [victim], key, world_before + 1, world_before)
        self.record(t_h, "restart", cause, 0, before, shape, cached)
        self.ckpt_restart(since_ckpt_s)

    def host_fails(self, t_h: float, cause: str, since_ckpt_s: float) -> None:
        """A host fails (it went to repair): a spare replaces it, else the job shrinks."""
        per_host = self.settings.gpus_per_host
        before = self.current
        world_before = self.job_hosts * per_host
        victim_host = int(self.rng.integers(self.job_hosts))
        lost = [r for r in range(victim_host * per_host, (victim_host + 1) * per_host) if r < before.cfg.world_size]
        stage = _stage_of(before.cfg, lost[0], self.spec.num_layers) if lost else -1
        if self.spares > 0:
            self.spares -= 1
            key = ("replace", str(before.cfg), stage)
            shape, cached = self.measure(before.cfg, before.cfg, lost, key, world_before + per_host, world_before)
            self.record(t_h, "fail", cause, per_host, before, shape, cached)
            self.ckpt_restart(since_ckpt_s)
        else:
            self.job_hosts -= 1
            after, _ = self.choose(self.job_hosts * per_host)
            key = ("shrink", str(before.cfg), str(after.cfg), stage)
            shape, cached = self.measure(before.cfg, after.cfg, lost, key, world_before, self.job_hosts * per_host)
            self.record(t_h, "fail", cause, per_host, after, shape, cached)
            self.current = after
            # the baseline cannot run short of hosts: it stops (losing the work since its last
            # checkpoint) until the job has all its hosts again
            if self.ckpt_down_since is None:
                self.lost_s["ckpt"] += self.settings.costs.detect_s + since_ckpt_s
                self.ckpt_down_since = t_h
        self.mark_rate(t_h)

    def result(self, end_h: float, simulate_s: float) -> SimulationResult:
        """The goodput of each path over the replay."""
        total_s = end_h * HOUR
        useful = sum(h * r for h, r in self.degraded) * HOUR  # full-speed-equivalent seconds while degraded
        goodput = {k: max(0.0, (useful - v) / total_s) for k, v in self.lost_s.items()}
        goodput["ckpt"] = max(0.0, (total_s - self.lost_s["ckpt"]) / total_s)  # it runs at full speed or not at all
        return SimulationResult(tuple(self.events), goodput["tenplex"], goodput["restart"], goodput["ckpt"],
                                simulate_s, end_h, str(self.full.cfg), tuple(self.timeline), self.step_s,
                                self.lost_s["restart"] / max(1, len(self.events)), self.load_s,
                                tuple(sorted(self.host_rates.items())))


def _state_per_gpu(choice: LayoutChoice) -> int:
    """Bytes of parameters and optimizer state on a GPU of the layout's largest stage."""
    assert choice.estimate is not None
    return max(st.param_bytes + st.optimizer_bytes for st in choice.estimate.stages)


def _stage_of(cfg: ParallelConfig, rank: int, num_layers: int) -> str:
    """The kind of pipeline stage of ``rank`` (ranks ordered tp, dp, pp): ``first`` (it holds the
    embedding), ``last`` (the head) or ``middle``; stages of one kind hold the same bytes per
    rank when their layer counts match, so their events are one shape."""
    stage = cfg.coords(rank).pp
    if stage == 0:
        return "first"
    if stage == cfg.pp - 1:
        return "last"
    return f"middle-{cfg.layers_per_stage(num_layers)[stage]}"


def plot_simulation(res: SimulationResult, path: str | Path) -> bool:
    """A PNG of the job's world size and its throughput relative to the start over time, the
    events marked; False (and nothing written) without matplotlib."""
    try:
        import matplotlib  # lazy: optional (the demo extras install it)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: optional, see above
    except ImportError:
        log.warning("matplotlib is not installed: no plot written to %s", path)
        return False
    t = [p[0] / 24.0 for p in res.timeline] + [res.hours / 24.0]
    world = [p[1] for p in res.timeline] + [res.timeline[-1][1]]
    rate = [p[2] for p in res.timeline] + [res.timeline[-1][2]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    a.step(t, world, where="post", color="tab:blue")
    a.set_ylabel("GPUs in the layout")
    b.step(t, rate, where="post", color="tab:green", label="throughput / start")
    b.axhline(res.goodput_tenplex, color="tab:green", ls="--", lw=1, label=f"goodput tenplex {res.goodput_tenplex:.3f}")
    b.axhline(res.goodput_checkpoint_restart, color="tab:red", ls="--", lw=1,
              label=f"goodput checkpoint restart {res.goodput_checkpoint_restart:.3f}")
    b.set_ylabel("relative throughput")
    b.set_xlabel("days")
    b.legend(loc="lower left", fontsize=8)
    for e in res.events:
        a.axvline(e.time_h / 24.0, color="0.85", lw=0.5, zorder=0)
    a.set_title(f"{len(res.events)} events, starting layout {res.layout}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
