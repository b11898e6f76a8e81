"""Recovery policies side by side on one failure trace, and the failure process at any scale.

:func:`simulate_trace` (tenplex.planning.simulate) runs the real chooser, planner and scheduler
per event; this module takes what a recovery costs as figures (from such a replay, or from a
publication) and replays one trace under several policies at once, in event time, so that a 54-day
trace at 131,072 GPUs takes a second:

- :class:`StallPolicy`: tenplex in process or its restart path (or FT-HSDP, whose other replicas
  go on after a stall): every event stalls the job for the path's recovery; a lost host is
  replaced by a spare, else the job re-lays out onto the hosts it has (throughput in proportion)
  and grows back when they return.
- :class:`CheckpointRestartPolicy`: restart from the last persistent checkpoint (interval, the
  blocking part of a save, restart, the load at storage bandwidth); without a spare it waits for
  the host, or, with ``replica_hosts``, restarts on the whole DP replicas left.
- :class:`ReplicaGroupPolicy`: torchft style, step by step: a failure fails the step it lands in
  (no group commits it), its replica group drops out and rejoins after a restart and a peer copy
  (heal), the global batch shrinks meanwhile; a membership change costs a quorum.
- :class:`StandbyPolicy`: a standby host takes the failed one's role at once (TrainMover), else
  the job waits for a repaired host.

Stalls queue: an event landing in a stall adds its own (what FT-HSDP's "stall per failure"
measures). The failure process: :class:`MttfCurve` (a job-level rate plus a per-GPU rate, fitted
to Meta's mean time to failure against scale) and the Llama 3 component mix for the classes.
docs/scale.md, "Policies side by side", has the calibration against published runs.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from ..errors import ConfigError
from .simulate import FAILURE_CLASSES, HOUR, FailureClass, FailureEvent, SimulationResult, draw_trace

__all__ = ["MttfCurve", "META_MTTF_POINTS", "fit_mttf", "meta_mttf", "draw_failures", "PolicyJob",
           "StallPolicy", "CheckpointRestartPolicy", "ReplicaGroupPolicy", "StandbyPolicy", "Policy",
           "PolicyResult", "replay_policy", "compare_policies", "policies_from_replay"]

#: Meta's mean time to failure against the GPUs of a job (arXiv 2410.21680): 7.9 h at 1,024,
#: 1.8 h at 16,384, about 14 min at 131,072.
META_MTTF_POINTS: tuple[tuple[int, float], ...] = ((1024, 7.9), (16384, 1.8), (131072, 14.0 / 60.0))


def _check_numbers(obj: Any, positive: Sequence[str] = ()) -> None:
    """ConfigError unless every float field of ``obj`` is finite and >= 0 (> 0 for ``positive``)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v) or v < 0 or (f.name in positive and v <= 0):
            raise ConfigError(f"{type(obj).__name__}.{f.name} must be a finite number "
                              f"{'> 0' if f.name in positive else '>= 0'}, got {v!r}")


@dataclass(frozen=True, slots=True)
class MttfCurve:
    """Failures of a job of ``gpus`` GPUs arrive at ``job_rate_h + gpus * gpu_rate_h`` per hour: a
    rate every job has whatever its size (its software, its scheduler) plus one per GPU (hardware
    in series)."""

    job_rate_h: float
    gpu_rate_h: float

    def __post_init__(self) -> None:
        _check_numbers(self)
        if self.job_rate_h + self.gpu_rate_h <= 0:
            raise ConfigError(f"MttfCurve needs a positive rate, got job_rate_h={self.job_rate_h} + "
                              f"gpu_rate_h={self.gpu_rate_h} = {self.job_rate_h + self.gpu_rate_h}")

    def rate_h(self, gpus: int) -> float:
        """Failures per hour of a job of ``gpus`` GPUs."""
        return self.job_rate_h + gpus * self.gpu_rate_h

    def mttf_h(self, gpus: int) -> float:
        """Mean time to failure in hours of a job of ``gpus`` GPUs."""
        return 1.0 / self.rate_h(gpus)


def fit_mttf(points: Sequence[tuple[int, float]]) -> MttfCurve:
    """The :class:`MttfCurve` whose largest relative error over ``points`` ((gpus, MTTF hours))
    is least (two parameters; with three points one degree of freedom is left to check it)."""
    if len(points) < 2 or any(g < 1 or m <= 0 for g, m in points):
        raise ConfigError(f"fit_mttf needs >= 2 points (gpus >= 1, MTTF > 0 h), got {list(points)}")
    import scipy.optimize  # lazy: only the fit needs it (the CLI imports this module)

    gpus = np.array([g for g, _ in points], dtype=np.float64)
    mttf = np.array([m for _, m in points], dtype=np.float64)
    (g0, m0), (g1, m1) = (gpus[0], mttf[0]), (gpus[-1], mttf[-1])
    b0 = max((1 / m1 - 1 / m0) / (g1 - g0), 1e-12) if g1 != g0 else 1 / (m0 * g0)
    a0 = max(1 / m0 - b0 * g0, 1e-6)

    def worst(x: np.ndarray) -> float:
        a, b = np.exp(x)
        return float(np.max(np.abs(1.0 / (a + b * gpus) / mttf - 1.0)))

    res = scipy.optimize.minimize(worst, np.log([a0, b0]), method="Nelder-Mead",
                                  options={"xatol": 1e-9, "fatol": 1e-12, "maxiter": 20000})
    a, b = np.exp(res.x)
    return MttfCurve(float(a), float(b))


@functools.lru_cache(maxsize=1)
def meta_mttf() -> MttfCurve:
    """:func:`fit_mttf` of :data:`META_MTTF_POINTS` (fitted once per process)."""
    return fit_mttf(META_MTTF_POINTS)


def draw_failures(gpus: int, hours: float, *, curve: MttfCurve | None = None, seed: int = 0,
                  classes: Mapping[str, FailureClass] = FAILURE_CLASSES) -> list[FailureEvent]:
    """A Poisson process at ``curve``'s rate for ``gpus`` GPUs (default :func:`meta_mttf`) over
    ``hours``, each event of a class drawn by the classes' shares (the Llama 3 component mix)."""
    if gpus < 1 or not (math.isfinite(hours) and hours > 0):
        raise ConfigError(f"draw_failures needs gpus >= 1 and hours > 0, got gpus={gpus}, hours={hours}")
    rate = (curve or meta_mttf()).rate_h(gpus)
    count = int(np.random.default_rng([seed, 1]).poisson(rate * hours))
    return draw_trace(days=hours / 24.0, failures=count, seed=seed, classes=classes)


@dataclass(frozen=True, slots=True)
class PolicyJob:
    """The job every policy replays a trace on: ``gpus`` in hosts of ``gpus_per_host``, a pool
    of ``spare_hosts``, a run of ``hours``, steps of ``step_s``; ``classes``: what each cause of
    the trace does (hosts lost, repair time, planned)."""

    gpus: int
    hours: float
    step_s: float
    gpus_per_host: int = 8
    spare_hosts: int = 16
    classes: Mapping[str, FailureClass] = field(default_factory=lambda: dict(FAILURE_CLASSES))

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_host"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"PolicyJob.{name} must be an integer >= 1, got {v!r}")
        if self.gpus % self.gpus_per_host:
            raise ConfigError(f"PolicyJob: gpus={self.gpus} is not a multiple of gpus_per_host={self.gpus_per_host} "
                              f"({self.gpus} % {self.gpus_per_host} = {self.gpus % self.gpus_per_host})")
        if not isinstance(self.spare_hosts, int) or self.spare_hosts < 0:
            raise ConfigError(f"PolicyJob.spare_hosts must be an integer >= 0, got {self.spare_hosts!r}")
        _check_numbers(self, positive=("hours", "step_s"))

    @property
    def hosts(self) -> int:
        """Hosts of the job at full size."""
        return self.gpus // self.gpus_per_host


@dataclass(frozen=True, slots=True)
class StallPolicy:
    """A stall per event: tenplex in process (``recovery_s``: detection, chooser, assignment, plan,
    transfer, half a step redone), its restart path (the same plus relaunch and reload), or
    FT-HSDP's stall while a replica drops out: each event stalls the job ``recovery_s``; a host
    returning to a shrunk job costs the same. ``relayout_efficiency``:
    throughput per GPU of a shrunk layout relative to the full one (1.0: in proportion to the
    hosts); ``host_rates``: (hosts, throughput relative to the full job) where a replay measured
    it (the chooser's layout for those hosts), which then takes precedence."""

    name: str
    recovery_s: float
    relayout_efficiency: float = 1.0
    host_rates: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_numbers(self)
        if self.relayout_efficiency > 1:
            raise ConfigError(f"StallPolicy.relayout_efficiency must be <= 1, got {self.relayout_efficiency}")
        if any(h < 0 or not 0 <= r <= 1 for h, r in self.host_rates):
            raise ConfigError(f"StallPolicy.host_rates needs hosts >= 0 and 0 <= rate <= 1, got {self.host_rates}")

    def rate(self, hosts: int, full: int) -> float:
        """Throughput relative to the full job on ``hosts`` of its ``full`` hosts."""
        if hosts >= full:
            return 1.0
        return dict(self.host_rates).get(hosts, hosts / full * self.relayout_efficiency)


@dataclass(frozen=True, slots=True)
class CheckpointRestartPolicy:
    """Restart from the last persistent checkpoint: every ``interval_h`` of running time a save
    blocks training ``write_s``; an event costs the running time since the last save (none for a
    planned one) plus ``detect_s + restart_s + load_s``. Without a spare: ``replica_hosts`` None
    waits for the host's repair (the layout is fixed); else it restarts on the whole DP replicas
    (of ``replica_hosts`` hosts) it has, the checkpoint resharded along DP."""

    name: str = "checkpoint restart"
    interval_h: float = 1.0
    write_s: float = 0.0
    detect_s: float = 1.0
    restart_s: float = 120.0
    load_s: float = 0.0
    replica_hosts: int | None = None

    def __post_init__(self) -> None:
        _check_numbers(self, positive=("interval_h",))
        if self.replica_hosts is not None and (not isinstance(self.replica_hosts, int) or self.replica_hosts < 1):
            raise ConfigError(f"CheckpointRestartPolicy.replica_hosts must be None or an integer >= 1, "
                              f"got {self.replica_hosts!r}")
        if self.write_s >= self.interval_h * HOUR:
            raise ConfigError(f"CheckpointRestartPolicy: a save of write_s={self.write_s} s does not fit its "
                              f"interval of {self.interval_h} h = {self.interval_h * HOUR} s")

    @property
    def event_s(self) -> float:
        """Seconds an event stalls the job, besides the work lost since the last save."""
        return self.detect_s + self.restart_s + self.load_s


@dataclass(frozen=True, slots=True)
class ReplicaGroupPolicy:
    """torchft style: ``groups`` replica groups run synchronous steps of the job's ``step_s``
    (plus ``quorum_s`` when the membership changed); a failure fails the step it lands in (no
    group commits it) and takes its group out for ``restart_s + heal_s`` (the peer copy) or, a
    host lost without a spare, until the host's repair; the group rejoins at the next step."""

    name: str = "replica groups"
    groups: int = 1
    restart_s: float = 120.0
    heal_s: float = 5.0
    quorum_s: float = 1.0

    def __post_init__(self) -> None:
        _check_numbers(self)
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ConfigError(f"ReplicaGroupPolicy.groups must be an integer >= 1, got {self.groups!r}")


@dataclass(frozen=True, slots=True)
class StandbyPolicy:
    """A standby host (one of the job's spares) takes a failed host's role, same layout, in
    ``swap_s`` (TrainMover, FlashRecovery); a process crash restarts in place in the same time;
    with no standby free the job waits for a repaired host and then swaps."""

    name: str = "standby"
    swap_s: float = 20.0

    def __post_init__(self) -> None:
        _check_numbers(self)


Policy = Union[StallPolicy, CheckpointRestartPolicy, ReplicaGroupPolicy, StandbyPolicy]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy over a trace: ``goodput`` (useful work over that of the run at full size without
    failures), ``stalled_h`` (hours the whole job stood still), ``events`` replayed, the mean
    stall per event; for replica groups, ``committed`` (steps committed over steps run)."""

    name: str
    goodput: float
    stalled_h: float
    events: int
    mean_stall_s: float
    committed: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class _Hosts:
    """The job's hosts and spares over a replay: a failed host goes to repair and returns to the
    job if it is short, else to the spares."""

    def __init__(self, job: PolicyJob) -> None:
        self.full = job.hosts
        self.hosts = job.hosts
        self.spares = job.spare_hosts
        self.repairs: list[float] = []

    def lose(self, t_h: float, cls: FailureClass) -> bool:
        """``cls.hosts`` hosts fail at ``t_h``; True when spares replaced all of them."""
        replaced = True
        for _ in range(cls.hosts):
            heapq.heappush(self.repairs, t_h + cls.repair_h)
            if self.spares > 0:
                self.spares -= 1
            else:
                self.hosts -= 1
                replaced = False
        return replaced

    def next_return(self) -> float:
        return self.repairs[0] if self.repairs else math.inf

    def host_returns(self) -> bool:
        """The next repaired host returns; True when it rejoins a short job."""
        heapq.heappop(self.repairs)
        if self.hosts < self.full:
            self.hosts += 1
            return True
        self.spares += 1
        return False


class _Clock:
    """Useful work over a replay: the job runs at ``rate`` (of full speed) outside stalls; stalls
    queue. ``save_every_s``/``save_s``: periodic blocking saves (checkpoint restart)."""

    def __init__(self, save_every_s: float = math.inf, save_s: float = 0.0) -> None:
        self.now_s = self.free_s = 0.0
        self.rate = 1.0
        self.useful_s = self.stalled_s = 0.0
        self.since_start_s = 0.0  # running seconds since the last (re)start: saves every save_every_s of it
        self.save_every_s, self.save_s = save_every_s, save_s
        self.stalls = 0

    def advance(self, to_s: float) -> None:
        run = max(0.0, to_s - max(self.now_s, self.free_s))
        if self.rate > 0:
            self.since_start_s += run
            self.useful_s += run * self.rate * (1.0 - self.save_s / self.save_every_s)
        self.now_s = to_s

    def stall(self, seconds: float) -> None:
        start = max(self.now_s, self.free_s)
        self.free_s = start + seconds
        self.stalled_s += seconds
        self.stalls += 1

    def lose_since_save(self) -> None:
        """A restart from the last save: the running time since it is redone."""
        if math.isfinite(self.save_every_s):
            kept = 1.0 - self.save_s / self.save_every_s
            self.useful_s -= (self.since_start_s % self.save_every_s) * self.rate * kept
        self.since_start_s = 0.0


def _events(trace: Sequence[FailureEvent], job: PolicyJob) -> list[tuple[float, FailureClass]]:
    unknown = sorted({e.cause for e in trace} - set(job.classes))
    if unknown:
        raise ConfigError(f"the trace names failure classes {unknown} that are not among {sorted(job.classes)}")
    return [(e.time_h, job.classes[e.cause]) for e in sorted(trace, key=lambda e: e.time_h)
            if e.time_h < job.hours]


def _replay_events(trace: Sequence[FailureEvent], job: PolicyJob, clock: _Clock, on_event: Any,
                   on_return: Any) -> _Hosts:
    """Events and host returns in time order: ``on_event(t_h, cls, replaced)``, ``on_return(t_h, rejoined)``."""
    hosts = _Hosts(job)
    for t_h, cls in _events(trace, job) + [(job.hours, None)]:
        while hosts.next_return() <= t_h:
            r_h = hosts.next_return()
            clock.advance(r_h * HOUR)
            on_return(r_h, hosts.host_returns(), hosts)
        clock.advance(t_h * HOUR)
        if cls is not None:
            on_event(t_h, cls, hosts.lose(t_h, cls), hosts)
    return hosts


def _tenplex(trace: Sequence[FailureEvent], job: PolicyJob, p: StallPolicy) -> _Clock:
    clock = _Clock()

    def on_event(t_h: float, cls: FailureClass, replaced: bool, hosts: _Hosts) -> None:
        clock.stall(p.recovery_s)
        if not replaced:
            clock.rate = p.rate(hosts.hosts, hosts.full)

    def on_return(t_h: float, rejoined: bool, hosts: _Hosts) -> None:
        if rejoined:
            clock.stall(p.recovery_s)
            clock.rate = p.rate(hosts.hosts, hosts.full)

    _replay_events(trace, job, clock, on_event, on_return)
    return clock


def _ckpt(trace: Sequence[FailureEvent], job: PolicyJob, p: CheckpointRestartPolicy) -> _Clock:
    clock = _Clock(p.interval_h * HOUR, p.write_s)

    def runnable(hosts: _Hosts) -> float:
        if hosts.hosts == hosts.full:
            return 1.0
        if p.replica_hosts is None:
            return 0.0
        return (hosts.hosts // p.replica_hosts) * p.replica_hosts / hosts.full

    def on_event(t_h: float, cls: FailureClass, replaced: bool, hosts: _Hosts) -> None:
        if clock.rate == 0:  # waiting for hosts: nothing runs, nothing to lose
            return
        if not cls.planned:
            clock.lose_since_save()
        clock.since_start_s = 0.0
        clock.rate = runnable(hosts)
        clock.stall(p.event_s if clock.rate > 0 else p.detect_s)  # restart, or stop and wait for hosts

    def on_return(t_h: float, rejoined: bool, hosts: _Hosts) -> None:
        if not rejoined:
            return
        rate = runnable(hosts)
        if rate > clock.rate:  # more hosts usable: a planned restart onto them (it saves first: nothing lost)
            clock.since_start_s = 0.0
            clock.rate = rate
            clock.stall(p.event_s)

    _replay_events(trace, job, clock, on_event, on_return)
    return clock


def _standby(trace: Sequence[FailureEvent], job: PolicyJob, p: StandbyPolicy) -> _Clock:
    clock = _Clock()

    def on_event(t_h: float, cls: FailureClass, replaced: bool, hosts: _Hosts) -> None:
        if replaced:
            if clock.rate > 0:
                clock.stall(p.swap_s)
        else:
            clock.rate = 0.0  # no standby: the job waits for a repaired host

    def on_return(t_h: float, rejoined: bool, hosts: _Hosts) -> None:
        if rejoined and hosts.hosts == hosts.full:
            clock.rate = 1.0
            clock.stall(p.swap_s)

    _replay_events(trace, job, clock, on_event, on_return)
    return clock


def _replica_groups(trace: Sequence[FailureEvent], job: PolicyJob, p: ReplicaGroupPolicy,
                    seed: int) -> tuple[float, float, int]:
    """Step by step: (useful seconds, committed fraction, stalls)."""
    events = _events(trace, job)
    times = [t * HOUR for t, _ in events]
    down = np.zeros(p.groups)  # seconds until each group is back
    hosts = _Hosts(job)
    end_s = job.hours * HOUR
    t, i = 0.0, 0
    live_before = p.groups
    useful = 0.0
    steps = committed = 0
    while t < end_s:
        live = int(np.count_nonzero(down <= t))
        if live == 0:  # every group is out: wait for the first back
            t = float(down.min())
            continue
        if live == live_before:  # steps without a change until the next failure or rejoin: in bulk
            rejoin = down[down > t]
            change = min(times[i] if i < len(times) else end_s, float(rejoin.min()) if len(rejoin) else end_s, end_s)
            n = int((change - t) // job.step_s)
            if n > 0:
                steps += n
                committed += n
                useful += n * job.step_s * live / p.groups
                t += n * job.step_s
                continue
        dur = min(job.step_s + (p.quorum_s if live != live_before else 0.0), end_s - t)
        live_before = live
        failed = False
        while i < len(times) and times[i] < t + dur:
            t_f, cls = times[i], events[i][1]
            while hosts.next_return() * HOUR <= t_f:
                hosts.host_returns()
            # the group an event hits depends on the event alone (its time), so that traces with
            # fewer events are the same replay less those events
            g = int(np.random.default_rng([seed, 2, int(t_f * 1e3)]).integers(p.groups))
            back = t_f + p.restart_s + p.heal_s
            if not hosts.lose(t_f / HOUR, cls):  # no spare: the group waits for its host's repair
                back += cls.repair_h * HOUR
            failed = failed or down[g] <= t  # a recovering group's failure fails no step
            down[g] = max(down[g], back)
            i += 1
        if dur >= job.step_s:  # (the run's end cuts the last one short: not a step)
            steps += 1
            if not failed:
                committed += 1
                useful += job.step_s * live / p.groups
        t += dur
    return useful, committed / max(1, steps), i


def replay_policy(trace: Sequence[FailureEvent], job: PolicyJob, policy: Policy, *, seed: int = 0) -> PolicyResult:
    """One policy over ``trace`` on ``job`` (see the module docstring); ``seed``: which replica
    group a failure hits."""
    total_s = job.hours * HOUR
    n = len(_events(trace, job))
    if isinstance(policy, ReplicaGroupPolicy):
        useful, committed, _ = _replica_groups(trace, job, policy, seed)
        return PolicyResult(policy.name, useful / total_s, 0.0, n, 0.0, committed)
    if isinstance(policy, StallPolicy):
        clock = _tenplex(trace, job, policy)
    elif isinstance(policy, CheckpointRestartPolicy):
        clock = _ckpt(trace, job, policy)
    elif isinstance(policy, StandbyPolicy):
        clock = _standby(trace, job, policy)
    else:
        raise ConfigError(f"replay_policy: unknown policy {policy!r}")
    return PolicyResult(policy.name, max(0.0, clock.useful_s / total_s), clock.stalled_s / HOUR, n,
                        clock.stalled_s / max(1, clock.stalls))


def compare_policies(trace: Sequence[FailureEvent], job: PolicyJob, policies: Sequence[Policy], *,
                     seed: int = 0) -> dict[str, PolicyResult]:
    """Every policy on the same trace and job, by name."""
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ConfigError(f"compare_policies: policy names must differ, got {names}")
    return {p.name: replay_policy(trace, job, p, seed=seed) for p in policies}


def policies_from_replay(res: SimulationResult, *, restart_s: float, detect_s: float, interval_h: float,
                         groups: int, heal_s: float, swap_s: float, write_s: float = 0.0) -> list[Policy]:
    """The five policies with the costs a planner-driven replay (``simulate_trace``) measured:
    tenplex's two paths at their mean recovery over the replay's events, checkpoint restart with
    the replay's load (saves every ``interval_h`` blocking ``write_s``), replica groups of
    ``groups`` with a peer copy of ``heal_s``, a standby swap of ``swap_s``."""
    inproc = float(np.mean([e.recovery_s for e in res.events])) if res.events else detect_s + res.step_s / 2
    restart = res.restart_recovery_s if res.events else inproc + restart_s
    rates = res.host_rates
    return [StallPolicy("tenplex in-process", inproc, host_rates=rates),
            StallPolicy("tenplex restart path", restart, host_rates=rates),
            CheckpointRestartPolicy(interval_h=interval_h, write_s=write_s, detect_s=detect_s, restart_s=restart_s,
                                    load_s=res.ckpt_load_s),
            ReplicaGroupPolicy(groups=groups, restart_s=restart_s, heal_s=heal_s),
            StandbyPolicy(swap_s=swap_s)]
