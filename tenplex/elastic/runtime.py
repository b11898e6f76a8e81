"""``ElasticRuntime``: in-process elasticity for the user's own training loop (issue #31 item 1).

The user gives ``build(mesh) -> (model, optimizer)`` and a mesh rule (world size -> mesh dims, as
``tenplex.planning.choose.choose_mesh`` takes); the runtime owns the rest: the mesh, the resume
from the newest checkpoint, the membership and its liveness, the state ring and its pins, the
SIGTERM flush, joiners, the agreement, ``rescale(..., live=...)`` through
:func:`~tenplex.elastic.inprocess.recover_in_process` (the path the reference trainer recovers
through too) and the restart fallback (exit code ``RECOVERY_FAILED``). The loop stays the user's:

    rt = ElasticRuntime(build, rule, ckpt=url, data=DataState(n, batch, seed=1), ckpt_every=100)
    for step in rt.steps(total):
        with step:                                   # one call per step
            x = batches.batch(rt.data, rt.dp_size, rt.dp_rank)
            loss = train_step(rt.model, rt.optimizer, x)

Contract: read ``rt.model``, ``rt.optimizer``, ``rt.mesh``, ``rt.data``, ``rt.step``, ``rt.dp_rank``,
``rt.dp_size``, ``rt.group`` (and ``rt.loss_scale`` / ``rt.local_batch``: with ``uneven_dp`` a DP degree
that does not divide the global batch runs, each rank weighing its loss by its share) inside the
``with`` block of every step and keep no reference across steps:
after a recovery they are the rebuilt ones (a new mesh, a new model and optimizer holding the
survivors' state, possibly an earlier step and data position). A peer failure inside the block
(or in the runtime's work after it: the ring copy, the checkpoint) ends that step; the next
iteration of ``steps`` recovers in process before it yields, out of the failed step's frames, and
the step is redone on the new mesh. Leaving the block without an exception commits the step:
``step`` + 1, ``data`` advanced, this rank's state into the ring, the periodic checkpoint, the
joiners' boundary. A recovery builds the new model empty (``build`` on the meta device, then
``to_empty``; the optimizer's state created empty as the old one's) and the moved state lands in
its own tensors: nothing is initialised or copied twice (``RuntimeConfig.empty_rebuild``). Every
recovery's latency table (:class:`~tenplex.elastic.latency.RecoveryTimes`)
is logged after its first step and given to ``on_event`` with the recovery's record, whose bytes
are summed over the group there (one collective after the first step, not before it: during that
step ``recovered`` holds the record with those sums still None).

A process started with ``join=True`` (no ``RANK``/``WORLD_SIZE``; the job's
``TENPLEX_MEMBERSHIP_STORE`` and ``TENPLEX_JOB_ID`` or ``MASTER_ADDR``/``MASTER_PORT``) registers
first, then warms up (its first mesh and model, built empty) while the members reach their next step
boundary, is admitted there and receives its state live; its scipy import (the survivors' order at
a later failure) waits until after its first step. ``timeline`` holds the wall times of its start.

Spares: a rule may give a mesh of fewer ranks than the job has (5 workers, ``{"dp_shard": 4}``):
ranks ``0 .. n-1`` of the n the mesh holds train, the others wait as spares (the job's own
collectives beyond the mesh's dims go over ``rt.group``, not the default group). A spare is a member
(heartbeats, the agreement, the join boundaries) but holds no shard and runs no step: ``steps``
yields nothing on it (``rt.model``, ``rt.optimizer``, ``rt.mesh`` are None), it only follows the
step count (one small all-reduce per step with the trainers, which also tells it of a failure)
and learns the state dict's layout once per mesh (for the survivors' order). At its start a spare
builds the model once and drops it, as a joiner warms up, on a mesh of its own rank alone: the first
build's one-time costs are not paid in the recovery that gives it a place. The trainers describe
and save the state over the mesh's ranks alone. When a trainer dies, the recovery takes the spares
into the new group after the survivors; those the rule's mesh now holds receive their state live,
as a joiner does, and ``steps`` yields to them; the others stay spares. A restart (the launcher's
fallback) with spares picks its mesh by the same rule: the mesh's ranks load the newest checkpoint
under it (``rescale(process_group=)``, collective over them alone), the spares load nothing and take
the step and data position from rank 0. A spare's death moves nothing (the trainers keep their
places on the same mesh and the step they finished), but is recovered as any death is: the groups
are formed again and the model rebuilt (the mesh's groups die with the default group). Not done yet: joiners that would be spares (``fits``
refuses such joins: they wait), and with spares a recovery that finds no step to move live (none
held by every survivor and stored where needed) fails to the restart path instead of loading.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
# at import, before any process group exists: torch.distributed.nn.functional (DCP imports it) binds
# group.WORLD as its functions' default argument when imported; imported after init_process_group, it
# kept the first default group alive past its destruction, and the peers blocked on its connections
# waited until this process exited (measured: 40 s of a recovery, then the agreement timed out)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as torch_optimizer
from torch.overrides import TorchFunctionMode

from ..checkpoint import default_save_id, list_steps, save
from ..data.partition import DataState, loss_scale, replica_slice
from ..errors import ConfigError, LayoutError, PeerFailure
from ..native.dtensor import release_fsdp_groups, release_mesh
from ..native.state_dict import describe_state_dict, local_shard, save_state_dict
from ..planning.assignment import load_solvers
from ..planning.choose import MESH_DIMS, MeshChooser, choose_mesh, predict_layout
from ..planning.planner import plan
from .live import live_order
from .rescale import rescale
from .inprocess import JOIN_FAILED, RECOVERY_FAILED, LiveRecovery, RecoveryConfig, recover_in_process, summarized, \
    warm_up
from .latency import RESTART, RecoveryTimes
from .membership_runtime import Membership, join_membership, membership_store, start_membership
from .ring import HeldAs, StateRing, exit_on_sigterm, flush_ring

__all__ = ["ElasticRuntime", "RuntimeConfig", "Step", "dp_refusal"]

_GROUP_BEFORE_IMPORT = dist.is_initialized()  # see the imports above

log = logging.getLogger(__name__)

Build = Callable[[Any], tuple[Any, Any]]  # build(mesh) -> (model, optimizer)


@dataclass(frozen=True)
class RuntimeConfig:
    """How an :class:`ElasticRuntime` runs. ``ckpt``: the checkpoint URL (resume, periodic saves,
    pieces no survivor holds); ``ckpt_every``: steps between checkpoints (0: only the last step);
    ``in_process``: recover in process (needs ``TENPLEX_MEMBERSHIP_STORE``), else only save and
    resume (torchrun's restart is the recovery); ``join``: this process joins a running job;
    ``dead_after``: heartbeat silence (s) that means death; ``join_timeout``: seconds a joiner waits
    to be admitted; ``keep``: states the ring keeps; ``device``: "cuda" or "cpu" (default: cuda when
    available); ``before_save``: testing, called with the step before each checkpoint; ``extra_state``:
    returns the job's other ``Stateful`` objects by name (an LR scheduler, a data position, a trainer's
    counters: the ones the last ``build`` made), saved, kept in the ring and recovered beside model
    and optimizer (their ``state_dict()`` values must be equal on every rank); ``release``: called
    before a recovery frees the broken mesh, model and optimizer, to drop the job's own references to
    them and to what holds their process groups (a trainer's attributes): groups still referenced
    close their connections later, which the peers would take for a death;
    ``empty_rebuild``: at a recovery, ``build`` runs under ``torch.device("meta")`` and the model is
    materialised empty (``to_empty``) and the optimizer's state created empty, shaped as the old
    one's, since the recovery overwrites all of it (a model with non-persistent buffers, which no
    state dict restores, or one that does not materialise is built for real instead);
    ``uneven_dp``: the job's loss weights each DP rank by its share of the global batch (``rt.loss_scale``
    or ``rt.local_batch``, see ``docs/your_model.md``), so a DP degree that does not divide ``data``'s
    global batch may run (the first ranks read one sample more); off, every mesh's DP degree must
    divide it (a rank's mean loss under an averaging reduction is then the global batch's)."""

    ckpt: str
    ckpt_every: int = 0
    in_process: bool = True
    join: bool = False
    dead_after: float = 10.0
    join_timeout: float = 60.0
    keep: int = 3
    device: str | None = None
    before_save: Callable[[int], None] | None = None
    extra_state: Callable[[], Mapping[str, Any]] | None = None
    release: Callable[[], None] | None = None
    empty_rebuild: bool = True
    uneven_dp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ckpt, str) or not self.ckpt:
            raise ConfigError(f"ckpt must be a checkpoint URL, got {self.ckpt!r}")
        if type(self.ckpt_every) is not int or self.ckpt_every < 0:
            raise ConfigError(f"ckpt_every must be an integer >= 0, got {self.ckpt_every!r}")
        if self.join and not self.in_process:
            raise ConfigError("join=True needs in_process=True (the running job's membership admits the joiner)")
        if not self.dead_after > 0 or not self.join_timeout > 0:
            raise ConfigError(f"dead_after ({self.dead_after}) and join_timeout ({self.join_timeout}) must be > 0 s")
        if type(self.keep) is not int or self.keep < 2:
            raise ConfigError(f"keep must be an integer >= 2 (a state kept while the next is copied), got {self.keep!r}")


class Step:
    """The context of one training step (``with step:``): collectives in it that fail because a
    peer died end the step (suppressed: ``ElasticRuntime.steps`` recovers before the next
    iteration); a clean exit commits it."""

    def __init__(self, rt: ElasticRuntime, total: int) -> None:
        self.rt, self.total, self.number = rt, total, rt.step
        self._guard: contextlib.ExitStack | None = None

    def __enter__(self) -> Step:
        self._t0 = time.perf_counter()
        self._guard = contextlib.ExitStack()
        self._failed = False
        self.rt._in_step = True
        try:
            self._guard.enter_context(self.rt.guard())  # PeerFailure: a death the heartbeats found just now
        except PeerFailure as e:  # the block runs on a broken group: its result is not committed
            self.rt.failure, self._failed = str(e), True
            assert self.rt.membership is not None
            self.rt.membership.destroy_group()  # as the guard does: its collectives fail at once, and the peers' too
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        rt = self.rt
        rt._in_step = False
        assert self._guard is not None
        if self._failed:  # the step is redone after the recovery; a collective's error on the broken group is expected
            return kind is None or issubclass(kind, Exception)  # a bug of the job's comes back in the redone step
        try:
            if self._guard.__exit__(kind, exc, tb):
                return True
        except PeerFailure as e:  # a collective of the step failed: recover before the next one
            rt.failure = str(e)
            return True
        if isinstance(exc, PeerFailure):  # raised in the block itself (a block's _interrupt): the same
            rt.failure = str(exc)
            return True
        if kind is not None:
            return False  # the job's own error: not the runtime's to hide
        try:
            rt._commit(self.total, time.perf_counter() - self._t0)
        except PeerFailure as e:
            rt.failure = str(e)
        return True


class ElasticRuntime:
    """A torch-native job's elastic runtime: builds the mesh and the model for the workers there
    are, resumes, and recovers in process from failures and joins inside the user's loop (see the
    module docstring for the loop and the attributes it reads each step)."""

    def __init__(self, build: Build, mesh_rule: MeshChooser | None = None, *, ckpt: str, data: DataState | None = None,
                 config: RuntimeConfig | None = None, on_event: Callable[[dict[str, Any]], None] | None = None,
                 **options: Any) -> None:
        self.config = config or RuntimeConfig(ckpt=ckpt, **options)
        self.build_fn, self.rule, self.on_event = build, mesh_rule, on_event
        cfg = self.config
        self.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.backend = "nccl" if self.device == "cuda" else "gloo"
        self.step, self.data = 0, data
        self.model: Any = None
        self.optimizer: Any = None
        self.mesh: Any = None
        self.dims: dict[str, int] = {}
        self.failure: str | None = None  # why the next iteration regroups: a failure's message, "join", "joining"
        self.recovered: dict[str, Any] | None = None  # the in-process recovery whose first step is still to come
        self._latency_due: dict[str, Any] | None = None  # the record whose latency table the next step completes
        self.times: RecoveryTimes | None = None  # the last recovery's latency table
        self.membership: Membership | None = None
        self.ring: StateRing | None = None
        self.saved: set[int] = set()  # steps this launch checkpointed (complete on every rank)
        self._seen: dict[tuple[tuple[str, int], ...], Any] = {}  # the state dict's layout on every mesh run
        self._warmed = False
        self._warmed_build = False  # a first build paid (a joiner's or a spare's warm-up)
        self._filled: dict[str, Any] = {}
        # a recovery's figures this rank holds, summed over the group after its first step (``_summarize``)
        self._pending: tuple[LiveRecovery, dict[str, float], Any] | None = None
        self._parts: dict[str, float] = {}  # seconds of the recovery's parts on this rank (its record's "parts")
        self._optim_template: list[dict[str, Any] | None] | None = None  # the old optimizer's state, per parameter
        self._warm_template: list[dict[str, Any] | None] | None = None  # the warm-up optimizer's (no old one)
        self._done_at = 0.0  # perf_counter when the last recovery's state was in place
        self.spare = False  # this rank is beyond the mesh: it holds nothing and runs no step
        self._in_step = False  # inside a Step's block: a known death ends the step at the next module (_interrupt)
        self._placed: Any = None  # with spares: the process group of the mesh's ranks (saves, the layout's description)
        self._spare_mesh: Any = None  # a spare's handle of the mesh (its groups are released at a recovery)
        self._told = False  # with spares: the state dict's layout on this mesh went to (or came to) the spares
        # a joiner's start, as wall times (time.time(): the job's records and the kill are on the same clock)
        self.timeline: dict[str, float] = {"runtime_init": time.time()}
        t_start = time.perf_counter()
        if _GROUP_BEFORE_IMPORT:
            log.warning("the default process group existed before tenplex.elastic.runtime (and DCP) were imported: "
                        "torch.distributed.nn.functional may keep it alive past a failure, and peers blocked on "
                        "it wait; let the runtime create it, or import torch.distributed.checkpoint first")
        if cfg.join:
            self.rank, self.world_size = -1, 0
        else:
            if not dist.is_initialized():
                dist.init_process_group(self.backend)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if cfg.join:  # registered first: the members start admitting it while it warms up (see _warm_joiner)
            if (started := process_started_at()) is not None:
                self.timeline["process_start"] = started
            self.membership = self._joined()
            self.timeline["registered"] = time.time()
        # the survivors' locality order's scipy modules: imported now, not by a recovery (a joiner: after its
        # first step, off its admission's path; see _commit)
        self._warm_later = cfg.join
        if cfg.in_process and not cfg.join:
            load_solvers()
        if cfg.join:
            self._warm_joiner()
            self.timeline["warmed"] = time.time()
            self.failure = "joining"
        if cfg.in_process and not cfg.join:  # a first build's imports before the freeze (see _warm_alone)
            try:
                names = _mesh_dim_names(choose_mesh(self.world_size, choose=self.rule, spares=True))
            except (ConfigError, LayoutError):
                names = ()  # the build below says why
            if names:
                self._warm_alone(names, real=False)
        # the objects made so far never die: out of the collector's way, so that the gc.collect() of a
        # recovery (FSDP2's modules are reference cycles) only walks what was made since
        gc.freeze()
        self.start: dict[str, Any] = {"start": True, "world_size": self.world_size, "step": 0, "fresh": True}
        if not cfg.join:
            self._build(self.world_size)
            self._resume(t_start)
            if cfg.in_process:
                self.membership = start_membership(membership_store(), dead_after=cfg.dead_after)
        if self.membership is not None:  # a joiner's too: once admitted, it admits later joiners like the others
            self.membership.fits = self.fits
            self.ring = StateRing(cfg.keep)
            # SIGTERM (torchrun's agents restarting the workers): the newest states of the ring the
            # checkpoint lacks go there first (each rank its own part: no message), then exit
            exit_on_sigterm(lambda: flush_ring(self.ring, self._write, where=f"the checkpoint {cfg.ckpt}",
                                               skip=self.saved))
            if self.start.get("fresh") is False and not self.spare:  # fresh: the ring starts after the first step
                with self.guard():
                    self._remember()
                self.ring.pin(self.step)
        if self.rank == 0:
            self._emit(self.start)

    # -- what the loop reads -------------------------------------------------------------------
    @property
    def group(self) -> Any:
        """The process group of the mesh's ranks for the job's own collectives outside the mesh's dims
        (a loss all-reduce): None (the default group) unless the job has spares, which the default
        group includes and which run no step."""
        return self._placed

    @property
    def dp_rank(self) -> int:
        return self._dp()[0]

    @property
    def dp_size(self) -> int:
        return self._dp()[1]

    @property
    def local_batch(self) -> int:
        """Samples this DP rank reads of the step's global batch (``replica_slice``: with ``uneven_dp``
        the first ranks take one more); needs ``data``."""
        rank, size = self._dp()
        return replica_slice(self._global_batch(), size, rank, 1)[1]

    @property
    def loss_scale(self) -> float:
        """The factor for this rank's loss, the mean over its ``local_batch`` samples, under a DP gradient
        reduction that averages (FSDP2, HSDP, DDP): ``local_batch * dp_size / global_batch``, 1.0 when
        the DP degree divides the batch; the step's gradient and mean loss are then the global batch's.
        A job that sums instead (per-sample losses summed, divided by the global batch) needs no scale."""
        rank, size = self._dp()
        return loss_scale(self._global_batch(), size, rank)

    def _global_batch(self) -> int:
        if self.data is None:
            raise ConfigError("local_batch and loss_scale need the job's data position: "
                              "ElasticRuntime(data=DataState(...))")
        return self.data.global_batch

    def _dp(self) -> tuple[int, int]:
        """This rank's data-parallel index and the DP degree (dp_replicate * dp_shard, replicate major)."""
        rank, size = 0, 1
        for name in ("dp_replicate", "dp_shard"):
            if name in (self.mesh.mesh_dim_names or ()):
                sub = self.mesh[name]
                rank, size = rank * sub.size() + sub.get_local_rank(), size * sub.size()
        return rank, size

    def steps(self, total: int) -> Iterator[Step]:
        """One :class:`Step` per training step until ``step`` reaches ``total``, recovering in process
        (out of the failed step's frames) before the step after a failure or at a join boundary;
        closes the runtime at the end."""
        while True:
            if self.failure is not None:
                self._recover(self.failure)
            if self.step >= total:
                break
            if self.membership is not None:
                try:
                    self.membership.check()  # a death the heartbeats found between collectives
                except PeerFailure as e:
                    self.failure = str(e)
                    continue
            if self.spare:  # no step to run: follow the trainers' step, wait for a place
                self._follow(total)
                continue
            yield Step(self, total)
        self.close()

    def guard(self) -> Any:
        """The membership's guard around collectives (a peer error becomes PeerFailure)."""
        return self.membership.guard() if self.membership is not None else contextlib.nullcontext()

    def fits(self, n: int) -> bool:
        """Whether a group of n can run: the rule gives a mesh, and its data-parallel degree divides
        the global batch (with ``uneven_dp``: does not exceed it; ``dp_refusal``) (``Membership(fits=)``:
        joiners that would make the group unusable wait)."""
        try:
            dims = choose_mesh(n, choose=self.rule)  # a join leaving spares: not yet (the module docstring)
        except (ConfigError, LayoutError):
            return False
        return self.data is None or dp_refusal(dims, self.data.global_batch, self.config.uneven_dp) is None

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state: model, optimizer (``get_state_dict``), step, data position, and the
        ``extra_state`` objects (``Stateful``: a load fills them through ``load_state_dict``)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": self.step}
        if self.data is not None:
            sd["data"] = self.data.to_json()
        for name, obj in self._extra().items():
            if name in sd:
                raise ConfigError(f"extra_state names {name!r}, which the runtime's state dict uses: rename it")
            sd[name] = obj
        return sd

    def _extra(self) -> Mapping[str, Any]:
        return self.config.extra_state() if self.config.extra_state is not None else {}

    def _restore(self, sd: dict[str, Any], *, in_place: bool = False) -> bool:
        """Set ``sd`` (a ``state_dict()`` filled by a rescale) into the model and optimizer; ``in_place``:
        when every tensor of ``sd`` is the model's or the optimizer's own (``get_state_dict`` hands out
        their tensors, which the rescale filled), only the optimizer's hyperparameters are set and no
        tensor is copied onto itself. Returns whether it was so."""
        aliased = in_place and _aliases(sd, self.model, self.optimizer)
        if aliased:  # the survivors' hyperparameters (an LR schedule's lr, ...), as set_state_dict sets them
            for group, saved in zip(_param_groups(self.optimizer), sd["optim"].get("param_groups", ())):
                group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]
        if self.data is not None or "data" in sd:
            self.data = DataState.from_json(sd["data"])
        for name, obj in self._extra().items():  # values of another state dict than the objects': load them
            if sd.get(name) is not None and sd[name] is not obj:
                obj.load_state_dict(sd[name])
        return aliased

    def _build(self, world: int, dims: dict[str, int] | None = None, *, empty: bool = False) -> None:
        """The mesh for ``world`` ranks (the rule's dims, in torch's mesh dim order), then the user's
        model; ``empty``: built on the meta device and materialised uninitialised (``build_empty``),
        for a state the recovery overwrites whole."""
        self.dims = dims or choose_mesh(world, choose=self.rule, spares=True)
        why = dp_refusal(self.dims, self.data.global_batch, self.config.uneven_dp) if self.data is not None else None
        if why is not None:  # a loss weighting every rank alike would weigh the samples unevenly: refused
            raise ConfigError(f"{world} ranks: {why}")
        names = _mesh_dim_names(self.dims)
        shape = tuple(self.dims[d] for d in names)
        placed = math.prod(shape)
        t0 = time.perf_counter()
        self._told, self._placed, self.spare = False, None, self.rank >= placed
        if placed < world:  # ranks placed..world-1 wait as spares; every rank takes part in creating the groups
            self.mesh = DeviceMesh(self.device, torch.arange(placed).reshape(shape), mesh_dim_names=names)
            self._placed = dist.new_group(list(range(placed)))
            if self.spare:
                log.warning("rank %d of %d: a spare (the mesh %s holds ranks 0-%d)", self.rank, world, self.dims,
                            placed - 1)
                self._spare_mesh, self.mesh = self.mesh, None
                if not self._warmed_build:
                    self._warm_alone(names)
                return
        else:
            self.mesh = init_device_mesh(self.device, shape, mesh_dim_names=names)
        self._parts["mesh"] = time.perf_counter() - t0
        built = build_empty(self.build_fn, self.mesh, self.device) if empty else None
        self._parts["empty_build"] = float(built is not None)
        self.model, self.optimizer = built if built is not None else self.build_fn(self.mesh)
        for part in self.model if isinstance(self.model, (list, tuple)) else (self.model,):
            for module in part.modules() if isinstance(part, torch.nn.Module) else ():
                if module is part or next(module.children(), None) is not None:  # blocks, not every leaf op
                    module.register_forward_pre_hook(self._interrupt)

    def _interrupt(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook of the model's blocks: inside a step, a death the membership knows of ends
        the step at the next block (PeerFailure), not at the next collective with the dead rank. In
        HSDP the other replica's forward has none: it computed on for up to 0.17 s after learning."""
        if self._in_step and self.membership is not None and self.membership.failed:
            self.membership.check()

    def _resume(self, t0: float) -> None:
        """Fill the freshly built model and optimizer in place from the newest checkpoint, whatever
        mesh wrote it (``get_state_dict`` creates the optimizer state the load fills: on a fresh
        start it is not called, the first step's AdamW step count would advance)."""
        self.start.update(world_size=self.world_size, mesh=self.dims)
        resume = any(s.complete for s in list_steps(self.config.ckpt))
        if resume and self.spare:  # holds nothing: learns the step and data position the mesh's ranks loaded
            self._resumed_by_spare()
        elif resume:
            sd = self.state_dict()
            res = rescale(self.config.ckpt, sd, process_group=self._placed)  # with spares: the mesh's ranks alone
            self._restore(sd)
            if self._placed is not None:  # the spares wait for the step
                self._resumed_by_spare()
            assert res.load_stats is not None
            self.start.update(step=self.step, fresh=False, bytes_read=res.load_stats.bytes_read,
                              bytes_needed=res.load_stats.bytes_needed, load_s=res.timings["load"])
            self.saved.add(self.step)
            restart_s = time.perf_counter() - t0 - res.timings["load"]
            self.times = RecoveryTimes(RESTART, restart_s=max(0.0, restart_s), load_s=res.timings["load"],
                                       bytes_storage=res.load_stats.bytes_read)
            self._latency_due = self.start  # its table is logged after the first step (the start record: without it)
            self.start["latency"] = self.times.to_json()
        self.start["startup_s"] = time.perf_counter() - t0
        self._done_at = time.perf_counter()

    def _resumed_by_spare(self) -> None:
        """With spares, after a resume: rank 0 hands every rank the step and data position the mesh's
        ranks loaded (one broadcast over the whole group); a spare takes them (it loads nothing)."""
        box = [(self.step, None if self.data is None else self.data.to_json()) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if self.spare:
            self.step, data = box[0]
            self.data = None if data is None else DataState.from_json(data)
            self.start.update(step=self.step, fresh=False, spare=True)
            self.saved.add(self.step)

    def _remember(self, described: tuple[Any, Any] | None = None, state: dict[str, Any] | None = None) -> None:
        """The state after ``step`` into the ring, and (at a mesh's first step) the layout it has,
        with the survivors' order for a failure: where most of each new rank's state already is.
        ``described``: the state dict's (collection, layout) when known (a live rescale described
        the state dict it filled); else described here, collectively. ``state``: a ``state_dict()``
        whose tensors are the model's and the optimizer's own and whose values are current (the one a
        recovery filled in place): not made again."""
        assert self.ring is not None and self.membership is not None
        sd = self.state_dict() if state is None else state
        ring = self.ring
        if ring.held_as is None:
            t0 = time.perf_counter()  # collective: while every rank of this mesh is alive
            ptc, layout = described if described is not None else describe_state_dict(sd, process_group=self._placed)
            self._parts["describe"] = time.perf_counter() - t0
            ring.held_as = HeldAs(layout, self.rank, default_save_id(layout, ptc), ptc=ptc)
            self._order_by(ptc, layout)
        ring.record(self.step, local_shard(sd))

    def _order_by(self, ptc: Any, layout: Any) -> None:
        """The survivors' order for a failure from the state dict's layout on this mesh (``live_order``:
        where most of each new rank's state already is); warmed up once."""
        assert self.membership is not None
        self._seen[tuple(self.dims.items())] = layout
        self.membership.order = live_order(ptc, layout, self.rule, self.membership.members, known=self._seen)
        if not self._warmed and not self._warm_later:  # the scipy import and the assignment once, before any
            warm_up(ptc, layout, self.rule, self.membership.members)  # failure needs them
            self._warmed = True

    def _with_spares(self) -> None:
        """A trainer's and a spare's one exchange per step over the whole group (only when the job has
        spares): at a mesh's first step group rank 0 hands the spares the state dict's layout (they
        order the survivors as the trainers do); then an all-reduce, which the spare's step waits on
        (it fails there when a trainer dies)."""
        if self._placed is None:
            return
        if not self._told and self.ring is not None:  # no membership (in_process=False): no order to compute
            held = self.ring.held_as
            box = [(held.ptc, held.layout) if held is not None and self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if self.spare and box[0] is not None:
                self._order_by(*box[0])
            self._told = True
        dist.all_reduce(torch.zeros(1, device=self.device))

    def _follow(self, total: int) -> None:
        """A spare's step: wait for the trainers to commit it (``_with_spares``), then count it and read
        the joiners' boundary as they do; a trainer's failure ends it (recovered next)."""
        try:
            with self.guard():
                self._with_spares()
            self._summarize(None)  # a recovery's figures, as the trainers sum them at this step's end
        except PeerFailure as e:
            self.failure = str(e)
            return
        self.step += 1
        if self.data is not None:
            self.data = self.data.advance()
        self._boundary(total)

    def _write(self, held_as: HeldAs, step: int, shard: Mapping[str, Any]) -> None:
        """One of the ring's states into the checkpoint, as this rank's part (its values on rank 0)."""
        part = dict(shard) if held_as.rank == 0 else {k: v for k, v in shard.items() if isinstance(v, torch.Tensor)}
        save(self.config.ckpt, held_as.ptc, held_as.layout, held_as.rank, part, step=step, save_id=held_as.save_id)

    # -- a step's end --------------------------------------------------------------------------
    def _commit(self, total: int, step_s: float) -> None:
        """After a step's block: count it, keep its state, checkpoint, and read the joiners' boundary."""
        cfg = self.config
        first, self._latency_due, self.recovered = self._latency_due, None, None
        self.step += 1
        if self.data is not None:
            self.data = self.data.advance()
        if self.ring is not None:
            # the step's collectives all returned here: its state is this rank's whatever death is known by
            # now (a spare's: its step is not redone); a new mesh's first state is described collectively
            with self.guard() if self.ring.held_as is None else contextlib.nullcontext():
                self._remember()
        if (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or self.step == total:
            with self.guard():
                if cfg.before_save is not None:
                    cfg.before_save(self.step)
                save_state_dict(self.state_dict(), cfg.ckpt, step=self.step, process_group=self._placed)
            self.saved.add(self.step)
            if self.ring is not None:
                self.ring.pin(self.step)  # complete on every rank: pieces only a dead rank holds can come from it
        if self._placed is not None:
            with self.guard():
                self._with_spares()
        self._summarize(first)
        if first is not None and self.times is not None:
            self._first_step(first, step_s)
        if self._warm_later and self.ring is not None and self.ring.held_as is not None:
            self._warm_joined()
        self._boundary(total)

    def _boundary(self, total: int) -> None:
        """Scale up: every member reads the agreed boundary here (one store read), so all admit the
        waiting joiners after the same step; none is proposed with no step left to run."""
        if self.membership is not None and self.step < total and \
                self.membership.join_due(self.step, propose=self.step + 1 < total):
            self.failure = "join"

    def _first_step(self, record: dict[str, Any], step_s: float) -> None:
        """The latency table of the recovery this step was the first after: logged and emitted."""
        assert self.times is not None
        self.times = self.times.with_first_step(step_s)
        record["latency"] = self.times.to_json()
        if self.rank == 0:
            log.warning("%s", self.times.table())
            if record.get("event") == "recover":  # the start record went out at the start
                self._emit(record)

    def _summarize(self, record: dict[str, Any] | None) -> None:
        """After a recovery's first step (every rank of the new group, a spare in its ``_follow``): the
        recovery's figures summed over the group (one collective, off the first step's path) into its
        record and latency table, and, not timed, the same move planned in the survivors' old rank order
        (what the locality order saved). Nothing at the other steps (no recovery pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        rec, extra, old = pending
        with self.guard():
            rec = summarized(rec)
        assert rec.times is not None
        self.times = rec.times.with_extra(**extra)
        if record is None:
            return
        record.update({"bytes_live": rec.bytes["live"], "bytes_storage": rec.bytes["storage"],
                       "bytes_local": rec.bytes["local"], "bytes_full_replica": rec.full_replica})
        if self.rank == 0:  # the rank that emits the record
            res = rec.result
            ps = res.plan_stats
            by_rank = plan(old.ptc, old.layout, res.cfg,  # the survivors that held state (not the spares)
                           alive=sorted(a for a in rec.membership.alive if a < old.layout.world_size)).stats \
                if old else ps
            record["rank_order_plan_bytes_peer"] = by_rank.bytes_same_host + by_rank.bytes_cross_host if by_rank \
                else None

    def _emit(self, record: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(record)

    # -- joiners -------------------------------------------------------------------------------------
    def _warm_joiner(self) -> None:
        """A joiner's first mesh, model and state dict pay one-time costs (lazy imports, first
        FSDP2/TP set-up) the join would otherwise pay: paid now, alone, on a private 1-process group,
        after registering, while the members reach their next step boundary and agree on the round
        (they wait for it only at the round's group, if it is still warming up then); see ``_warm_on``."""
        dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            names = tuple(choose_mesh(4, choose=self.rule))
        except (ConfigError, LayoutError):
            names = ("dp_shard",)
        self._warm_on(init_device_mesh(self.device, (1,) * len(names), mesh_dim_names=names))
        dist.destroy_process_group()

    def _warm_alone(self, names: tuple[str, ...], *, real: bool = True) -> None:
        """A first build on a group of this rank's own (``use_local_synchronization``: no other rank
        takes part) and a mesh of ``names``, each of size 1 (see ``_warm_on``). A spare pays its first
        build so at its start, as a joiner does (``_warm_joiner``), not at the recovery that gives it a
        place, where the trainers wait for it in the state dict's description (12m Llama, 5 workers on
        2 CPU cores: 0.43 s of a 1.9 s recovery); a member of an in-process job before ``gc.freeze()``,
        so that the modules a first build and state dict import (FSDP2's and DCP's first use import
        torch._dynamo: some 200 modules) are frozen with the others, not walked by every recovery's
        collection (12m Llama, 4 workers on 2 CPU cores: 25-58 ms of it); ``real`` False (a member): a
        model that cannot be built on the meta device is not warmed (the whole model on one rank could
        exceed its memory)."""
        group = dist.new_group([self.rank], use_local_synchronization=True)
        self._warm_on(DeviceMesh.from_group([group] * len(names), self.device,
                                            torch.full((1,) * len(names), self.rank), mesh_dim_names=names),
                      real=real)
        dist.destroy_process_group(group)

    def _warm_on(self, mesh: DeviceMesh, *, real: bool = True) -> None:
        """Build the model on ``mesh`` (every dim of size 1), make its state dict, drop both: a first
        build's one-time costs (``torch._dynamo``'s import, which the meta device's first use makes, and
        FSDP2's and TP's first set-up: 0.5 s of the 12m Llama's on an idle CPU core). Built on the meta
        device and never materialised, so that the whole model on one rank costs no memory and its
        optimizer's state (``get_state_dict`` creates it by a step at learning rate 0) no arithmetic:
        0.11 s against 0.28 s materialised (a model that cannot be built on meta: built for real, or,
        ``real`` False, not warmed). The job's optimizer step hooks do not run for that step, its
        optimizers' own nor torch's global ones: the model is not the job's."""
        try:
            with _on_meta():  # as a recovery's rebuild runs it (``build_empty``)
                self.model, self.optimizer = self.build_fn(mesh)
            on_meta = True
        except (NotImplementedError, RuntimeError) as e:  # e.g. data copied out of a meta tensor
            if not real:
                log.info("warm-up: build(mesh) failed on the meta device (%s); not warmed", e)
                self.model = self.optimizer = None
                return
            log.info("warm-up: build(mesh) failed on the meta device (%s); built for real", e)
            self.model, self.optimizer = self.build_fn(mesh)
            on_meta = False
        hooks = [(o, o._optimizer_step_pre_hooks, o._optimizer_step_post_hooks)
                 for o in _optimizers(self.optimizer) if hasattr(o, "_optimizer_step_pre_hooks")]
        # torch's global step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook / _post_hook)
        global_hooks = [(d, dict(d)) for d in (getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
                                               getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
                        if isinstance(d, dict)]
        try:
            for o, _, _ in hooks:
                o._optimizer_step_pre_hooks, o._optimizer_step_post_hooks = type(o._optimizer_step_pre_hooks)(), \
                    type(o._optimizer_step_post_hooks)()
            for d, _ in global_hooks:
                d.clear()
            self.state_dict()
            # a rebuild without an old optimizer (a joiner's, a spare's place) primes its state from this
            # one's, as a survivor's from its old one's (``prime_optimizer``): no initialising step
            template = optimizer_template(self.optimizer)
            self._warm_template = None if template is None else [
                None if spec is None else {k: torch.zeros(v.shape, dtype=v.dtype, device=self.device)
                                           if isinstance(v, torch.Tensor) else v for k, v in spec.items()}
                for spec in template]
        except (NotImplementedError, RuntimeError) as e:
            if not on_meta:
                raise
            log.info("warm-up: the state dict failed on the meta device (%s)", e)
        finally:
            for o, pre, post in hooks:
                o._optimizer_step_pre_hooks, o._optimizer_step_post_hooks = pre, post
            for d, kept in global_hooks:
                d.update(kept)
            release_mesh(mesh)
            self.model = self.optimizer = None
        self._warmed_build = True

    def _warm_joined(self) -> None:
        """A joiner after its first step: the scipy import and the survivors' order's assignment the
        workers ran at their start, paid now (not on its admission's path, which the workers wait on;
        not by the first recovery it takes part in)."""
        assert self.ring is not None and self.ring.held_as is not None and self.membership is not None
        self._warm_later = False
        load_solvers()
        warm_up(self.ring.held_as.ptc, self.ring.held_as.layout, self.rule, self.membership.members)
        self._warmed = True
        gc.freeze()  # as at a start: the modules just imported never die
        self.timeline["solvers"] = time.time()

    def _joined(self) -> Membership:
        """Register with the running job (found through the membership store) as a joiner."""
        log.warning("joiner: waiting for job %s in the store %s", os.environ.get("TENPLEX_JOB_ID") or
                    "at MASTER_ADDR:MASTER_PORT", os.environ.get("TENPLEX_MEMBERSHIP_STORE"))
        try:
            m = join_membership(membership_store(), self.backend, timeout_s=self.config.join_timeout,
                                dead_after=self.config.dead_after)
        except Exception as e:  # noqa: BLE001 - no job to join: say so and exit
            log.error("joiner: %s", e)
            logging.shutdown()
            os._exit(JOIN_FAILED)
        log.warning("joiner %d: registered with %s; waiting to be admitted at the job's next step boundary",
                    m.id, m.prefix)
        return m

    # -- recovery ------------------------------------------------------------------------------
    def _rebuilt(self, nm: Any) -> dict[str, Any]:
        """The mesh, model and optimizer for the new group; the fresh model's state dict, whose
        values the recovery replaces by the survivors' state: nothing in it is initialised (the
        model built on the meta device and materialised empty, the optimizer's state created empty
        after the old one's, see ``RuntimeConfig.empty_rebuild``)."""
        self.rank, self.world_size = nm.new_rank, nm.world_size
        if "admitted" not in self.timeline and self.timeline.get("registered"):
            self.timeline["admitted"] = time.time()  # a joiner: its round's group formed
        t0 = time.perf_counter()
        self._parts = {}
        self._build(self.world_size, empty=self.config.empty_rebuild)
        t1 = time.perf_counter()
        if self.spare:  # a spare of the new mesh: nothing to fill (rescale gives it nothing)
            self._optim_template, self._filled = None, {}
            return self._filled
        if self._optim_template is not None:
            prime_optimizer(self.optimizer, self._optim_template)
        self._optim_template = None
        self._filled = self.state_dict()
        self._parts.update(build=t1 - t0, state_dict=time.perf_counter() - t1)
        return self._filled

    def _recover(self, reason: str) -> None:
        """Agree on the members (the survivors; at a join, the workers and the joiners), rebuild mesh
        and model for them, move the state live; exit RECOVERY_FAILED on failure (a joiner: JOIN_FAILED)."""
        m, ring = self.membership, self.ring
        assert m is not None and ring is not None
        joining = m.joining
        self.failure = None
        if self._latency_due is not None and self._latency_due.get("event") == "recover" and self.rank == 0:
            # the previous recovery's first step never ran: its record without it
            self._emit(self._latency_due)
        self._latency_due = self._pending = None
        try:
            if self.config.release is not None:
                self.config.release()
            record = self._recover_in_process(m, ring, reason)
        except Exception:  # noqa: BLE001 - any failure here: the launcher's restart takes over
            code = JOIN_FAILED if joining else RECOVERY_FAILED
            log.exception("%s: in-process %s failed; exiting with %d", f"joiner {m.id}" if joining else
                          f"rank {self.rank}", "admission" if joining else "recovery", code)
            logging.shutdown()
            os._exit(code)  # no clean-up that could wait on a dead peer
        self.recovered = self._latency_due = record
        if joining:
            self.timeline["in_place"] = time.time()
        if self.rank == 0:
            log.warning("recovered in-process: %s", {k: v for k, v in record.items() if k != "timings"})

    def _recover_in_process(self, m: Membership, ring: StateRing, reason: str) -> dict[str, Any]:
        t0, wall0 = time.perf_counter(), time.time()
        old = ring.held_as
        newest = max(ring.states()) if ring.states() else None
        # what the old optimizer's state looks like: the rebuilt one's is created empty after it
        self._optim_template = (optimizer_template(self.optimizer) or self._warm_template) \
            if self.config.empty_rebuild else None
        # the last references to the broken mesh groups (FSDP2's modules hold them in reference cycles):
        # freed, their connections close, and a survivor blocked in one of them with this rank fails (its
        # next block's all-gather, issued ahead): the mesh's groups first, then the default group, then
        # the collection
        spare = self.spare
        if self.model is not None:  # a model that failed in its forward pass outlives gc.collect(): not its groups
            release_fsdp_groups(self.model)
        self._drop_meshes(then=m.destroy_group)
        t_released = time.perf_counter()
        # the group-wide sums of the record wait for the first step's end (``_summarize``): not on its path
        rec = recover_in_process(m, ring, self._rebuilt,
                                 RecoveryConfig(url=self.config.ckpt, join_timeout=self.config.join_timeout,
                                                placed=lambda: self._placed),
                                 join=reason == "join", spare=spare, summarize=False)
        nm, res = rec.membership, rec.result
        t_restore = time.perf_counter()
        if self.spare:  # still (or now) a spare: no state; the step the others resume
            self.step = res.step
        else:
            self._parts["in_place"] = float(self._restore(self._filled, in_place=True))
        filled, self._filled = self._filled, {}
        t3 = time.perf_counter()  # the state is in place when rescale returned and the optimizer got it
        wall3 = rec.rescaled_at + (t3 - t_restore)
        try:  # not timed: whether the order was computed for the layout the rebuilt model has
            predicted = old is not None and predict_layout(old.layout, tuple(self.dims.items()), self._seen) == res.cfg
        except LayoutError:
            predicted = False
        ring.clear()
        t_rem = time.perf_counter()
        if not self.spare:
            # the state dict the rescale filled is the model's and optimizer's own (in place): the ring's copy from it
            self._remember((res.ptc, res.cfg) if res.ptc is not None else None,
                           state=filled if self._parts.get("in_place") else None)
            ring.pin(self.step)  # a checkpoint step when pieces came from storage; else the state the survivors held
        self._parts.update(restore=t3 - t_restore, remember=time.perf_counter() - t_rem)
        t4 = time.perf_counter()
        self._done_at = t4
        assert rec.times is not None
        extra = {"regroup_s": t_released - t0, "transfer_s": t3 - t_restore}
        self.times = rec.times.with_extra(**extra)
        self._pending = (rec, extra, old)
        ps = res.plan_stats
        return {"event": "recover", "reason": reason.splitlines()[0][:200], "world_size": self.world_size,
                "mesh": self.dims, "alive": list(nm.alive), "joiners": list(nm.joiners), "live": res.live,
                "step": self.step, "newest": newest,
                # the group's, summed after the first step (``_summarize``): None until then
                "bytes_live": None, "bytes_storage": None, "bytes_local": None, "bytes_full_replica": None,
                "plan_bytes_peer": ps.bytes_same_host + ps.bytes_cross_host if ps else None,
                "plan_bytes_storage": ps.bytes_storage if ps else None,
                "plan_bytes_moved": ps.bytes_moved if ps else None,
                "rank_order_plan_bytes_peer": None,
                "layout_predicted": predicted,
                "detect_s": nm.detect_s, "agree_s": nm.agree_s, "regroup_s": nm.regroup_s,
                "failed_at": nm.failed_at,  # wall: the failure (a join: this member's round start)
                # unwind: from learning of the failure to this recovery's start (the blocked collective
                # failing, leaving the step); ring: the bytes summed over the group, the new mesh's layout
                # described and its first state kept
                "unwind_s": max(0.0, wall0 - nm.failed_at), "release_s": t_released - t0,
                "recover_s": t_released - t0 + rec.recover_s, "rebuild_s": rec.rebuild_s,
                "rescale_s": rec.rescale_s + (t3 - t_restore), "ring_s": t4 - t3,
                "failure_to_state_s": wall3 - nm.failed_at + nm.detect_s,
                "timings": res.timings, "parts": self._parts}

    # -- the end -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the membership and free the mesh's groups while the interpreter runs: kept alive past
        the end of main by the modules (FSDP2's reference cycles), a gloo group's worker thread could
        still be dropping its last collective's tensors when the interpreter finalizes, which aborts
        the process after all its work."""
        if self.membership is not None:
            self.membership.close()
            self.membership = None
        self._drop_meshes()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _drop_meshes(self, then: Callable[[], None] | None = None) -> None:
        """Free the mesh's groups (a trainer's, or a spare's handle of it; gloo: destroyed, see
        ``release_mesh``) and drop the model, optimizer and mesh, collected now: groups still referenced
        close their connections later. ``then``: called after the groups' release, before the
        collection (a recovery destroys the default group there)."""
        for mesh in (self.mesh, self._spare_mesh):
            if mesh is not None:
                release_mesh(mesh, destroy=self.backend == "gloo")
        if then is not None:
            then()
        self.model = self.optimizer = self.mesh = self._spare_mesh = self._placed = None
        gc.collect()


def _mesh_dim_names(dims: Mapping[str, int]) -> tuple[str, ...]:
    """``dims``' names in torch's mesh dim order (``MESH_DIMS`` first, in its order, then the others). Pure."""
    return tuple(d for d in MESH_DIMS if d in dims) + tuple(d for d in dims if d not in MESH_DIMS)


def dp_refusal(dims: Mapping[str, int], global_batch: int, uneven: bool) -> str | None:
    """Why mesh ``dims``' data-parallel degree (``dp_replicate * dp_shard``) cannot split ``global_batch``,
    or None: it must divide it, or with ``uneven`` (``RuntimeConfig.uneven_dp``) not exceed it (every
    rank reads at least one sample). Pure."""
    dp = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
    if dp > global_batch:
        return f"the mesh {dict(dims)} has DP degree {dp}, more than the global batch of {global_batch} samples"
    if global_batch % dp and not uneven:
        return (f"the mesh {dict(dims)} has DP degree {dp}, which does not divide the global batch "
                f"({global_batch} % {dp} = {global_batch % dp}): weigh each rank's loss by its share "
                "(rt.loss_scale) and set uneven_dp=True, or give a mesh rule whose DP degree divides it")
    return None


def process_started_at() -> float | None:
    """This process's start as a wall time (``time.time()``), from Linux's /proc (10 ms ticks); None
    elsewhere. A joiner's timeline starts there: the interpreter and the job's imports come first."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime: ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


# -- an empty rebuild (issue #31: a recovery initialises nothing it overwrites) ---------------------
def build_empty(build: Build, mesh: Any, device: str) -> tuple[Any, Any] | None:
    """``build(mesh)`` under ``torch.device("meta")`` (no initialisation runs: the parameters have no
    data), then the model materialised uninitialised on ``device`` (``to_empty``: FSDP2 keeps its
    parameters' identity, so the optimizer built over them stays valid). None when the model cannot
    be used so: it has non-persistent buffers (the state dict does not restore them), or a parameter
    or buffer stays on meta, or the optimizer's parameters are not the model's."""
    try:
        with _on_meta():
            model, optimizer = build(mesh)
    except (NotImplementedError, RuntimeError) as e:  # e.g. data copied out of a meta tensor
        log.info("empty rebuild: build(mesh) failed on the meta device (%s); built for real", e)
        return None
    if any(getattr(m, "_non_persistent_buffers_set", None) for m in model.modules()):
        log.info("empty rebuild: the model has non-persistent buffers; built for real")
        return None
    model.to_empty(device=device)
    params = {id(p) for p in model.parameters()}
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors) or any(id(p) not in params or p.is_meta
                                               for g in _param_groups(optimizer) for p in g["params"]):
        log.info("empty rebuild: the model or its optimizer did not materialise; built for real")
        return None
    return model, optimizer


def _aliases(sd: Mapping[str, Any], model: Any, optimizer: Any) -> bool:
    """Whether every tensor of ``sd`` (by its local shard) shares its memory with a parameter, buffer
    or optimizer state tensor of ``model`` / ``optimizer``."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    own = [*model.parameters(), *model.buffers(),
           *(v for o in _optimizers(optimizer) for st in o.state.values() for v in st.values()
             if isinstance(v, torch.Tensor))]
    ptrs = {local(t).untyped_storage().data_ptr() for t in own}
    return all(t.untyped_storage().data_ptr() in ptrs for t in local_shard(sd).values()
               if isinstance(t, torch.Tensor) and t.numel() > 0)


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """A ``build`` on the meta device, as an empty rebuild and a warm-up run it: ``torch.device("meta")``,
    a ``Module.to`` that keeps the model there (``_to_keeps_meta``) and no weight init (``_NoDataOnMeta``)."""
    with torch.device("meta"), _to_keeps_meta(), _NoDataOnMeta():
        yield


class _NoDataOnMeta(TorchFunctionMode):
    """Inside an empty rebuild's ``build`` (on the meta device): the weight initialisation a build runs
    writes data a meta tensor does not have, and the recovery overwrites every element after
    ``to_empty``, so it is skipped: an in-place fill of a meta tensor (``normal_``, ``copy_``, the
    ``torch.nn.init`` functions' ops ...) returns the tensor as it is, and a random tensor asked for on
    the meta device is an empty one of its shape (torch computes both through Python decompositions on
    meta: 12 of the 12m Llama's 32 ms build). Everything else runs as it would."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        if func in _RANDOM and not set(kwargs) - _RANDOM_KW and \
                torch.device(kwargs.get("device") or torch.get_default_device()).type == "meta":
            return torch.empty(*args, dtype=kwargs.get("dtype"), device="meta",
                               requires_grad=kwargs.get("requires_grad", False))
        return func(*args, **kwargs)


# the value-only in-place ops of weight initialisation (torch.nn.init's among them): on a meta tensor,
# nothing to do (none changes a shape, dtype or stride)
_FILLS = frozenset(getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "fill_", "zero_", "copy_", "bernoulli_", "exponential_", "random_", "log_normal_",
    "cauchy_", "geometric_", "erfinv_", "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_",
    "fill_diagonal_", "addcmul_", "addcdiv_", "sqrt_", "abs_", "neg_", "exp_"))
_RANDOM = frozenset((torch.randn, torch.rand))  # (*size, generator=, dtype=, device=, requires_grad=)
_RANDOM_KW = frozenset(("generator", "dtype", "device", "requires_grad"))  # others (layout=, out=, ...): run as asked


@contextlib.contextmanager
def _to_keeps_meta() -> Iterator[None]:
    """``Module.to(device)`` of a module on the meta device leaves it there (a build's usual
    ``model.to("cuda")`` would raise: no data to copy; ``to_empty`` materialises it after the
    build); a dtype it names still applies."""
    original = torch.nn.Module.to

    def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type == "meta" or not any(t.is_meta for t in module.parameters()):
            return original(module, *args, **kwargs)
        return original(module, dtype=dtype) if dtype is not None else module

    torch.nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    """The optimizers ``build`` returned: one, or several (a list or tuple, as ``get_state_dict`` takes
    them: a torchtitan ``OptimizersContainer``'s, one per model part)."""
    return tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Every optimizer's ``param_groups``, in order (``get_state_dict``'s flattened order)."""
    return [g for o in _optimizers(optimizer) for g in o.param_groups]


def optimizer_template(optimizer: Any) -> list[dict[str, Any] | None] | None:
    """Per parameter (in ``param_groups`` order), what ``optimizer``'s state holds for it: for each key
    "param" (a tensor shaped as the parameter: ``exp_avg``), a small tensor (``step``: cloned) or a
    plain value; None for a parameter without state. None when there is no state yet."""
    if optimizer is None or not any(o.state for o in _optimizers(optimizer)):
        return None
    out: list[dict[str, Any] | None] = []
    for o in _optimizers(optimizer):
        for p in (p for g in o.param_groups for p in g["params"]):
            st = o.state.get(p)
            if not st:
                out.append(None)
                continue
            out.append({k: ("param", v.dtype) if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
                        else v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
    return out


def prime_optimizer(optimizer: Any, template: list[dict[str, Any] | None]) -> bool:
    """Create ``optimizer``'s state empty, as ``template`` (``optimizer_template`` of the optimizer it
    replaces) describes it, instead of DCP's initialising step (a whole optimizer step over zero
    gradients); the recovery fills it. False, leaving the state alone, when the parameters do not
    match the template (another number of them)."""
    params = [(o, p) for o in _optimizers(optimizer) for g in o.param_groups for p in g["params"]]
    if any(o.state for o in _optimizers(optimizer)) or len(params) != len(template):
        return False
    for (o, p), spec in zip(params, template):
        if spec is not None:
            o.state[p] = {k: torch.empty_like(p, dtype=v[1]) if isinstance(v, tuple) and v[:1] == ("param",)
                                  else v.clone() if isinstance(v, torch.Tensor) else v for k, v in spec.items()}
    return True
