"""In-process recovery of the reference trainer (issue #18): survivors keep their state and move it live.

With ``--in-process`` every worker watches its peers through a :class:`~tenplex.membership.Membership`
on the job's long-lived c10d store (``TENPLEX_MEMBERSHIP_STORE=host:port``: the standalone
rendezvous store; ``launch.Agent`` sets it). A peer failure during a step (forward, backward,
gradient sync, optimizer, the loss all-reduce) or between steps raises ``PeerFailure``; the
survivors then ``recover()`` (agree on the members, a fresh group), ``rescale(live=...)``
chooses the layout for the new world size and moves the state live from the newest step every
survivor holds (``StateRing``), reading only pieces no survivor holds from the host store,
then the checkpoint; the run driver rebuilds its groups and trainer and continues. Any error
during a recovery (a second failure, no group formed, a broken transfer) ends the process with
``RECOVERY_FAILED`` so that torchrun's agent restarts the job (the restart path).

Scale up by the same mechanism: a process started with ``--join`` (same store, same job key:
:func:`job_key`) finds the job's membership prefix (:func:`join_membership`), registers as a
joiner and waits; the members see the registration through their heartbeat thread, agree on a
step boundary (``Membership.join_due``), form a round of members + joiners, and
``rescale(live=...)`` sends the joiners their pieces (and the step and data position) live.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..bubbles import BubbleRuntime, SnapshotTask
from ..config import ParallelConfig
from ..choose import Chooser, MeshChooser, check_fits
from ..elastic import LiveState, RescaleResult, live_order, rescale
from ..errors import ConfigError, MembershipError, TenplexError
from ..membership import Membership, NewMembership
from ..ptc import PTC
from ..state_layout import StateLayout

__all__ = ["MEMBERSHIP_STORE_ENV", "JOB_ENV", "RECOVERY_FAILED", "JOIN_FAILED", "DIE_POINTS", "StateRing",
           "ring_in_bubbles", "settle_ring", "DieAt", "membership_store", "job_key", "start_membership",
           "join_membership", "layout_fits", "warm_up", "recover_live", "LiveRecovery"]

log = logging.getLogger(__name__)

MEMBERSHIP_STORE_ENV = "TENPLEX_MEMBERSHIP_STORE"
JOB_ENV = "TENPLEX_JOB_ID"
RECOVERY_FAILED = 75  # exit code of a worker whose in-process recovery failed: the launcher restarts it
JOIN_FAILED = 76  # exit code of a joiner that was not admitted (no job found, none took it in within its timeout)
JOBS_KEY = "tenplex/inproc/jobs"  # job key -> the membership prefix of the job's current launch
DIE_POINTS = ("forward", "backward", "optimizer", "save", "slow-save", "migrate")


class StateRing:
    """The last ``keep`` consistent states of this rank by step: CPU copies, either taken after a
    step completed (``record``, buffers reused) or made in the pipeline bubbles of the next step
    by a ``tenplex.bubbles.SnapshotTask`` with ``keep`` buffer sets (``adopt``/``release``; see
    ``ring_in_bubbles``). Survivors of a failure differ by at most one completed step (a rank
    cannot finish step k+1's all-reduce without every rank in it), so ``keep=2`` always leaves a
    step all of them hold; ``keep=3`` leaves two, one of them while the newest step's save may
    still be on its way to the stores.

    ``pin(step)`` keeps one step beyond the ring until another is pinned: the step of the last
    checkpoint complete on every rank, so that pieces only a dead rank held can be read from it at
    a step the survivors still hold. A torch-native job pins a recorded step after its synchronous
    save. The trainer writes in the background and cannot know when the others' writes finished:
    it holds (``hold``) the copy each write got (no new copy) until the step's all-reduce says every
    rank finished it (``confirm``: the oldest held step becomes the pinned one). A dead rank's
    write may still be under way after the survivors completed the next steps (the ring moved
    past the step before it); the pinned step is then the one the checkpoint has. Memory: the
    pinned state plus at most the held ones the writers had anyway (a rank starts a write only
    after its previous one finished)."""

    def __init__(self, keep: int = 3) -> None:
        if keep < 2:
            raise ConfigError(f"the state ring must keep at least 2 steps, got {keep}")
        self.keep = keep
        self._states: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._adopted: set[int] = set()  # steps whose buffers belong to a SnapshotTask, never reused here
        self._pinned: tuple[int, dict[str, Any]] | None = None
        self._held: OrderedDict[int, dict[str, Any]] = OrderedDict()  # written, not yet confirmed everywhere

    def record(self, step: int, state: Mapping[str, Any]) -> None:
        """Copy the state after ``step``: its tensors (into a dropped step's buffers when they fit;
        never into the pinned step's or a snapshot task's), its other values as they are."""
        if step in self._states:
            return
        reuse: dict[str, Any] = {}
        while len(self._states) >= self.keep:
            old, dropped = self._states.popitem(last=False)
            kept = [*self._held.values(), *([self._pinned[1]] if self._pinned is not None else [])]
            if old not in self._adopted and all(dropped is not st for st in kept):
                reuse = dropped
            self._adopted.discard(old)
        out: dict[str, Any] = {}
        for name, t in state.items():
            b = reuse.get(name)
            if not isinstance(t, torch.Tensor):
                out[name] = t
            elif isinstance(b, torch.Tensor) and b.shape == t.shape and b.dtype == t.dtype:
                out[name] = b.copy_(t.detach())
            else:
                out[name] = t.detach().to("cpu", copy=True)
        self._states[step] = out

    def adopt(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep the state after ``step`` as given, without a copy: a ``SnapshotTask``'s host buffers,
        filled in the pipeline bubbles of the next step (its ``on_complete``); they stay valid
        until ``release`` is called for them."""
        self._states.pop(step, None)
        while len(self._states) >= self.keep:
            self._adopted.discard(self._states.popitem(last=False)[0])
        self._states[step] = dict(state)
        self._adopted.add(step)

    def release(self, step: int, buffers: Mapping[str, Any]) -> None:
        """Forget the states held in ``buffers``: a ``SnapshotTask`` is about to overwrite them with
        ``step``'s state (its ``on_begin``)."""
        ptrs = {t.data_ptr() for t in buffers.values() if isinstance(t, torch.Tensor)}
        for s in [s for s, st in self._states.items()
                  if any(isinstance(t, torch.Tensor) and t.data_ptr() in ptrs for t in st.values())]:
            del self._states[s]
            self._adopted.discard(s)

    def pin(self, step: int, state: Mapping[str, Any] | None = None) -> None:
        """Keep step ``step`` until the next pin: the recorded state, or ``state`` (a copy nothing
        changes any more). ConfigError when neither is there."""
        if state is None:
            if step not in self._states or step in self._adopted:
                raise ConfigError(f"step {step} is not in the state ring as a recorded step (recorded: "
                                  f"{sorted(set(self._states) - self._adopted)}): record it first or pass its state")
            state = self._states[step]
        self._pinned = (step, state if isinstance(state, dict) else dict(state))  # the same dict: never reused

    def hold(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep ``state``, the copy of step ``step`` a write to storage got, until ``confirm``
        (a step held already keeps its first copy)."""
        self._held.setdefault(step, state if isinstance(state, dict) else dict(state))

    @property
    def oldest_held(self) -> int | None:
        """The held step the next ``confirm`` pins (None: none held)."""
        return next(iter(self._held), None)

    def confirm(self) -> None:
        """Every rank finished writing the oldest held step: it becomes the pinned step."""
        if self._held:
            self.pin(*self._held.popitem(last=False))

    def states(self) -> dict[int, dict[str, Any]]:
        """Every state this rank holds by step: the ring's, the pinned one, the held ones."""
        out = dict(self._states)
        if self._pinned is not None:
            out.setdefault(*self._pinned)
        for step, st in self._held.items():
            out.setdefault(step, st)
        return out

    def clear(self) -> None:
        self._states.clear()
        self._adopted.clear()
        self._held.clear()
        self._pinned = None


def ring_in_bubbles(ring: StateRing, trainer: Any, device: Any = None) -> SnapshotTask:
    """Make ``trainer``'s per-step state copy into ``ring`` a side task of its pipeline bubbles
    (``tenplex.bubbles``): the state after step k is copied while step k+1's stages wait for
    their neighbours' activations and gradients, and what is left before k+1's optimizer step
    changes it (the only blocking part; all of it with one stage). ``ring.keep`` buffer sets
    are used in turn, so the ring holds ``keep - 1`` finished states while a snapshot is under
    way; after a failure ``settle_ring`` keeps the working state instead."""
    task = SnapshotTask(name="ring", buffer_sets=ring.keep, on_begin=ring.release, on_complete=ring.adopt)
    runtime = BubbleRuntime(record=False, device=device)
    runtime.register(task)
    trainer.bubble_hook, trainer.snapshot_task = runtime, task
    return task


def settle_ring(ring: StateRing, trainer: Any) -> None:
    """After a failure, make the ring hold the newest consistent state of this rank. Outside the
    optimizer step (``trainer.updating``) the working state is the state after ``trainer.step``,
    and nothing changes it any more (the trainer is dropped for the recovery): the ring adopts it
    as it is, no copy (a snapshot task's copy under way is abandoned; measured: a 312 MB rank's
    copy was 0.3-0.4 s of its recovery at load 4). During the update it is half updated; the
    ring then already holds the state before it (the task finished before the update began)."""
    if getattr(trainer, "updating", False) or not hasattr(trainer, "consistent_state"):  # a Spare holds nothing
        return
    if trainer.step not in ring.states():
        ring.adopt(trainer.step, trainer.consistent_state())


@dataclass(frozen=True)
class DieAt:
    """Testing: SIGKILL this process at ``point`` of step ``step`` when its first-group rank is ``rank``
    (``slow-save``: its background write of step ``step`` hangs instead, the rank trains on)."""

    rank: int
    step: int
    point: str

    @staticmethod
    def parse(text: str | None) -> tuple[DieAt, ...]:
        """``RANK:STEP:POINT[,RANK:STEP:POINT...]``."""
        out = []
        for item in (text or "").split(","):
            if not item.strip():
                continue
            try:
                r, s, p = item.strip().split(":")
                d = DieAt(int(r), int(s), p)
            except ValueError:
                raise ConfigError(f"--die-at {item!r}: use RANK:STEP:POINT, POINT one of {', '.join(DIE_POINTS)}") \
                    from None
            if d.point not in DIE_POINTS:
                raise ConfigError(f"--die-at {item!r}: POINT must be one of {', '.join(DIE_POINTS)}")
            out.append(d)
        return tuple(out)

    @staticmethod
    def hook(items: Sequence[DieAt], rank: int) -> Callable[[str, int], None] | None:
        """``die(point, step)``, killing this process when ``(rank, step, point)`` is listed; None
        when nothing is listed (for any rank: ranks must agree on whether it exists, the
        ``migrate`` point runs after a barrier)."""
        if not items:
            return None
        mine = {(d.step, d.point) for d in items if d.rank == rank}

        def die(point: str, step: int) -> None:
            if (step, point) in mine and point == "slow-save":  # the write never finishes; the rank goes on
                log.error("rank %d: --die-at: the write of step %d hangs", rank, step)
                threading.Event().wait()
            if (step, point) in mine:
                log.error("rank %d: --die-at: SIGKILL at %s of step %d", rank, point, step)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)

        return die


def membership_store(timeout_s: float = 30.0) -> Any:
    """A client of the job's long-lived store named by ``TENPLEX_MEMBERSHIP_STORE`` (``host:port``)."""
    spec = os.environ.get(MEMBERSHIP_STORE_ENV, "")
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--in-process needs {MEMBERSHIP_STORE_ENV}=host:port, a c10d store that outlives every "
                          f"worker (the standalone rendezvous store: torchrun's --rdzv-endpoint with "
                          f"is_host=false); got {spec!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def job_key() -> str:
    """What names this job in the membership store, for joiners to find it: ``TENPLEX_JOB_ID``,
    else torchrun's run id, else the bootstrap address ``MASTER_ADDR:MASTER_PORT`` (the same
    in every worker and joiner of one job started with env://)."""
    for name in (JOB_ENV, "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise ConfigError(f"cannot name the job for joiners: set {JOB_ENV} (or MASTER_ADDR and MASTER_PORT)")
    return f"{addr}:{port}"


def start_membership(store: Any, *, interval: float = 0.1, dead_after: float = 10.0) -> Membership:
    """Every rank of the default group: a Membership under a prefix fresh for this group (a nonce
    from rank 0), so a restarted job never reads a previous launch's keys. Rank 0 then publishes
    the prefix under the job's key (:func:`job_key`) for joiners."""
    box = [f"tenplex/inproc/{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    m = Membership(store, str(box[0]), interval=interval, dead_after=dead_after, agree_timeout=20.0,
                   pg_timeout=datetime.timedelta(seconds=30))
    if dist.get_rank() == 0:
        store.set(f"{JOBS_KEY}/{job_key()}", str(box[0]))
    return m


def join_membership(store: Any, backend: str, *, timeout_s: float, interval: float = 0.1,
                    dead_after: float = 10.0) -> Membership:
    """A joiner: wait up to ``timeout_s`` for the job (:func:`job_key`) to publish its membership
    prefix, then register in it (``Membership(joiner=True)``); MembershipError when none appears."""
    key = f"{JOBS_KEY}/{job_key()}"
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise MembershipError(f"no running job {job_key()!r} published its membership within {timeout_s:.0f} s "
                              f"(key {key}): {e}") from e
    prefix = store.get(key).decode()
    return Membership(store, prefix, backend=backend, interval=interval, dead_after=dead_after, agree_timeout=20.0,
                      pg_timeout=datetime.timedelta(seconds=30), joiner=True)


def layout_fits(ptc: PTC, cfg: ParallelConfig, choose: Chooser) -> Callable[[int], bool]:
    """``Membership(fits=...)``: whether the chooser finds a layout for a group of n (cached), so
    that a joiner that would make the world size unusable is not admitted (it waits) instead of
    failing the round."""
    known: dict[int, bool] = {}

    def fits(n: int) -> bool:
        if n not in known:
            try:
                new = choose(ptc, n, cfg)
                check_fits(new, n)
                ptc.check(new)
                known[n] = True
            except TenplexError as e:
                log.warning("no layout for %d workers (%s): joiners that would make %d wait", n, e, n)
                known[n] = False
        return known[n]

    return fits


def warm_up(ptc: PTC, cfg: ParallelConfig | StateLayout, choose: Chooser | MeshChooser,
            members: Sequence[int]) -> float:
    """Run what a recovery runs first once at start-up (the chooser, ``locality_order`` and its
    scipy import, the holder tables) for one member fewer, so that a failure does not pay for it
    (measured: ~1 s of a recovery on a loaded 2-CPU VM was the first scipy.optimize import).
    Returns the seconds it took; a world size no layout fits is skipped. A torch-native job passes
    its ``StateLayout`` and mesh rule, as to ``live_order``."""
    t0 = time.perf_counter()
    if len(members) < 2:
        return 0.0
    try:
        live_order(ptc, cfg, choose, members)(list(members[:-1]))
    except TenplexError as e:
        log.info("warm-up for %d members skipped: %s", len(members) - 1, e)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class LiveRecovery:
    """One in-process recovery as this rank saw it: the new membership, the rescale result and
    seconds of ``recover`` (agreement and regroup) and ``rescale`` (choose, plan, step, migrate)."""

    membership: NewMembership
    result: RescaleResult
    recover_s: float
    rescale_s: float
    slowest: Mapping[str, float]  # the rescale timings, each the slowest rank's
    bytes: Mapping[str, int]  # summed over the new group: "live", "storage", "local"
    newest: int  # the newest step any survivor had completed (``result.step`` is the one moved)
    storage_urls: tuple[str, ...] = ()  # where survivors read pieces no survivor held


def recover_live(m: Membership, ring: StateRing, ptc: PTC, cfg: ParallelConfig | None, choose: Chooser, *,
                 sources: Sequence[str], url: str | None, tiers: Any, gpus_per_host: int,
                 before_migrate: Callable[[], None] | None = None, join: bool = False,
                 join_timeout: float = 60.0) -> LiveRecovery:
    """Agree on the members (the survivors ordered by locality for the layout ``choose`` picks,
    then the live joiners), then ``rescale(live=...)`` from the states in ``ring``. ``join``: at
    the boundary ``Membership.join_due`` agreed (nobody failed). A joiner (``m.joining``; ``cfg``
    None, an empty ring) waits up to ``join_timeout`` s to be admitted and receives its state.
    Raises on any failure (the caller exits)."""
    t0 = time.perf_counter()
    if m.joining:
        nm = m.admit(join_timeout)
    else:
        assert cfg is not None
        m.order = live_order(ptc, cfg, choose, m.members)
        nm = m.recover(join=join)
    t1 = time.perf_counter()
    if before_migrate is not None:  # testing: every survivor is past the regroup when this one dies
        dist.barrier()
        before_migrate()
    # the survivors that held state under cfg come first (live_order); spares of cfg after them hold nothing,
    # nor do joiners (a joiner knows neither: rescale gives it the layout and the holders of group rank 0)
    holders = [a for a in nm.alive if cfg is None or a < cfg.world_size]
    if list(nm.alive[: len(holders)]) != holders:
        raise TenplexError(f"the new group's order {list(nm.alive)} puts a spare of {cfg} before a rank holding "
                           "state (order the members with live_order)")
    live = LiveState(cfg, ring.states(), holders, tuple(sources))
    res = rescale(url, ptc, choose=choose, gpus_per_host=gpus_per_host, tiers=tiers, live=live)
    t2 = time.perf_counter()
    b = res.bytes_by_tier
    sums = torch.tensor([b.get("live", 0), b.get("storage", 0), b.get("local", 0)], dtype=torch.float64)
    dist.all_reduce(sums)
    newest = torch.tensor([max(ring.states(), default=-1)], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MAX)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (res.storage_url, res.timings))
    urls = [v[0] for v in views]
    slowest = {k: max(v[1].get(k, 0.0) for v in views) for k in res.timings}  # the recovery waits for the slowest
    return LiveRecovery(nm, res, t1 - t0, t2 - t1, slowest,
                        {"live": int(sums[0]), "storage": int(sums[1]), "local": int(sums[2])}, int(newest.item()),
                        tuple(sorted({u for u in urls if u})))
