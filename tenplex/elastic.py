"""rescale(): what a worker calls at start-up, after torchrun's elastic agent (re)started it.

It reads the latest complete checkpoint, takes the world size from the environment, picks a
layout that is valid for the model and world size (memory-aware by default), plans the move
from the saved layout, loads this rank's state reading only the bytes it needs, and returns
the layout, the state and timings. A layout may use fewer ranks than the world (the default
chooser considers spares and uneven batch splits): ranks ``cfg.world_size`` and up are
spares, which load nothing (``RescaleResult.idle``) and take a place at the next rescale. A damaged newest step is passed over for the newest one
that verifies (reported in ``skipped``). With no checkpoint (or no URL) it says to start fresh.

There is one path: a checkpoint URL is a recovery tier (persistent storage), so every resume
is one scan of the tiers, one model check and one tiered load (``tenplex.store.recovery``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import MAX_STEP, LoadStats, check_model, list_steps
from .config import ParallelConfig
from .errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError, ConfigError, LayoutError
from .layouts import choose_layout
from .membership import old_ranks
from .migrate import migrate
from .models import model_spec
from .planner import STORAGE, Plan, PlanStats, locality_order, plan
from .ptc import PTC
from .state_dict import describe_state_dict, fill_state_dict, load_state_dict
from .state_layout import StateLayout
from .store.recovery import Tier, TierScan, load_tiered, scan_tiers
from .topology import Topology

__all__ = ["RescaleResult", "LiveState", "live_step", "live_order", "predict_layout", "rescale", "agree_on_step", "env_world", "layout_options_for", "device_memory",
           "default_chooser", "storage_tier", "MeshChooser", "mesh_dims", "choose_mesh", "check_fits"]

log = logging.getLogger(__name__)

Chooser = Callable[[PTC, int, "ParallelConfig | None"], ParallelConfig]


@dataclass(frozen=True)
class RescaleResult:
    """Outcome of ``rescale``: the layout to run, the step reached and this rank's state (for a
    torch-native state dict: ``cfg`` its ``StateLayout``, the state filled into the caller's dict)."""

    cfg: ParallelConfig | StateLayout
    rank: int
    world_size: int
    step: int
    fresh: bool
    shard: dict[str, Any] | None = None
    extra: Any = None
    previous: ParallelConfig | StateLayout | None = None
    plan_stats: PlanStats | None = None
    load_stats: LoadStats | None = None
    timings: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # "local", "peer", "storage"
    skipped: tuple[tuple[int, str, str], ...] = ()  # (step, save id, reason) of newer attempts passed over
    live: bool = False  # True: moved live between survivors (``bytes_by_tier``: "local", "live", "storage")
    storage_url: str | None = None  # live: where this rank read the pieces no survivor holds (None: nothing read)

    @property
    def idle(self) -> bool:
        """True when this rank has no place in the layout: a spare (holds and trains nothing, takes
        part in the job's collectives and the next rescale)."""
        return self.rank >= self.cfg.world_size

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """The ranks of the world the layout leaves as spares: ``cfg.world_size`` .. ``world_size - 1``."""
        return tuple(range(self.cfg.world_size, self.world_size))

    def _spares(self) -> str:
        n = len(self.idle_ranks)
        return f", {n} spare{'s' * (n != 1)}" if n else ""

    def summary(self) -> str:
        if self.fresh:
            return f"fresh start under {self.cfg} ({self.world_size} ranks{self._spares()})"
        t = self.timings
        if self.live:
            b = self.bytes_by_tier
            return (f"moved live at step {self.step}: {self.previous} -> {self.cfg} ({self.world_size} ranks"
                    f"{self._spares()}); "
                    f"choose {t.get('choose', 0):.3f}s plan {t.get('plan', 0):.3f}s agree {t.get('agree', 0):.3f}s "
                    f"migrate {t.get('migrate', 0):.3f}s; received {b.get('live', 0)} B live, "
                    f"{b.get('storage', 0)} B from storage")
        parts = [f"resumed step {self.step}: {self.previous} -> {self.cfg} ({self.world_size} ranks{self._spares()})",
                 f"choose {t.get('choose', 0):.3f}s plan {t.get('plan', 0):.3f}s load {t.get('load', 0):.3f}s"]
        if self.load_stats:
            parts.append(f"read {self.load_stats.bytes_read} B for {self.load_stats.bytes_needed} B needed")
        if self.skipped:
            parts.append("passed over " + ", ".join(f"step {s} ({sid}): {why}" for s, sid, why in self.skipped))
        return "; ".join(parts)


def env_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) when run alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_REQUIRED = ("global_batch", "micro_batch", "seq_len", "gpu_mem")


def device_memory() -> int:
    """Bytes of memory of this worker's accelerator: CUDA device 0, else the host's RAM."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 16 << 30


def layout_options_for(ptc: PTC, layout_options: Mapping[str, Any] | None = None, *,
                       gpus_per_host: int = 8) -> dict[str, Any]:
    """``layout_options`` completed with what the PTC and this machine say, for ``choose_layout``.

    Defaults: ``seq_len``, ``precision`` (from the dtype) and ``distributed_optimizer`` from the
    PTC's ``meta`` (``meta["model"]``, as ``model_ptc`` records it), ``gpus_per_host`` from the
    argument, ``recompute="none"`` (pass the mode the job runs with), ``gpu_mem`` from this worker's device (:func:`device_memory`),
    ``allow_idle=True`` and ``uneven_batch=True`` (every world size gets a layout: the fastest by the
    throughput model among those using every rank, uneven batch splits and spares; pass False to
    refuse them). The job's
    ``global_batch`` and ``micro_batch`` have no default: ConfigError names what is missing and
    how to pass it.
    """
    opts = dict(layout_options or {})
    model = ptc.meta.get("model")
    if isinstance(model, Mapping):
        if model.get("seq_len") is not None:
            opts.setdefault("seq_len", model["seq_len"])
        if model.get("dtype") in _PRECISION:
            opts.setdefault("precision", _PRECISION[model["dtype"]])
    if isinstance(ptc.meta.get("distributed_optimizer"), bool):
        opts.setdefault("distributed_optimizer", ptc.meta["distributed_optimizer"])
    opts.setdefault("gpus_per_host", gpus_per_host)
    # the layout must fit as the job runs: without recomputation unless the caller's job recomputes
    opts.setdefault("recompute", "none")
    # every world size gets a layout: spares and uneven DP splits, ranked by modelled throughput
    opts.setdefault("allow_idle", True)
    opts.setdefault("uneven_batch", True)
    if "gpu_mem" not in opts:
        opts["gpu_mem"] = device_memory()
    missing = [k for k in _REQUIRED if opts.get(k) is None]
    if missing:
        raise ConfigError(
            f"rescale() chooses the layout with tenplex.layouts.choose_layout, which needs {', '.join(_REQUIRED)}; "
            f"missing: {', '.join(missing)} (seq_len defaults to the PTC's meta['model'], gpu_mem to this machine's "
            "device memory): pass layout_options=dict(global_batch=..., micro_batch=...), or pin the layout with "
            "parallel=ParallelConfig(...), or pass choose="
        )
    return opts


def default_chooser(layout_options: Mapping[str, Any]) -> Chooser:
    """The chooser ``rescale`` uses by default: ``tenplex.layouts.choose_layout`` with
    ``layout_options`` (complete them with :func:`layout_options_for`)."""
    options = dict(layout_options)

    def choose(ptc: PTC, world: int, previous: ParallelConfig | None) -> ParallelConfig:
        if ptc.meta.get("model") is None:
            raise LayoutError("the PTC has no model description (meta['model']); pass parallel= or choose=")
        return choose_layout(ptc, world, current=previous, ptc=ptc, **options).cfg

    return choose


MeshChooser = Callable[[int], Mapping[str, int]]
"""A torch-native job's own rule: world size -> mesh dims (``{"dp_shard": 2, "tp": 2}``)."""

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh dim names ``mesh_dims`` uses, outermost first (torchtitan's order and names)."""


def mesh_dims(cfg: ParallelConfig, *, replicate: bool = False) -> dict[str, int]:
    """A (DP, TP, PP) layout as a torch-native mesh, outermost first, sizes of 1 left out:
    ``pp``, then the data-parallel dim (``dp_shard`` for FSDP2, ``dp_replicate`` with
    ``replicate=True`` for DDP-style replicas), then ``tp``."""
    dims = {"pp": cfg.pp, "dp_replicate" if replicate else "dp_shard": cfg.dp, "tp": cfg.tp}
    return {name: size for name, size in dims.items() if size > 1} or {"dp_shard": 1}


def choose_mesh(world_size: int, *, choose: MeshChooser | None = None, model: Any = None,
                **layout_options: Any) -> dict[str, int]:
    """The mesh a torch-native job runs on ``world_size`` ranks, at start-up or after a rescale.

    ``choose``: the job's own rule (its dims must multiply to ``world_size``). Else, with ``model``
    (a ``tenplex.models.ModelSpec``, preset name or PTC of a Llama/GPT-like model),
    ``tenplex.layouts.choose_layout`` picks the fastest (DP, TP, PP) that fits in memory
    (``layout_options``: ``global_batch``, ``micro_batch``, ``gpu_mem``, ...; the estimate models
    ZeRO-1 when ``distributed_optimizer=True``, an upper bound for FSDP2, which also shards the
    parameters) and ``mesh_dims`` names it. Else plain FSDP2 over every rank: ``{"dp_shard": world_size}``.
    ConfigError when the chosen dims do not multiply to the world size; LayoutError when nothing fits.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if choose is not None:
        dims = dict(choose(world_size))
    elif model is not None:
        if "seq_len" not in layout_options and not isinstance(model, PTC):
            layout_options["seq_len"] = model_spec(model).seq_len if isinstance(model, str) else model.seq_len
        dims = mesh_dims(choose_layout(model, world_size, **layout_options).cfg)
    else:
        dims = {"dp_shard": world_size}
    sizes = list(dims.values())
    if not dims or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"mesh dims {dims} must be names with positive integer sizes")
    product = 1
    for s in sizes:
        product *= s
    if product != world_size:
        raise ConfigError(f"mesh dims {dims} hold {'*'.join(map(str, sizes))} = {product} ranks, but the job has "
                          f"{world_size}: the chooser must use every rank")
    log.info("mesh for %d ranks: %s", world_size, dims)
    return dims


def storage_tier(url: str, storage_options: Mapping[str, Any] | None = None) -> Tier:
    """The checkpoints under ``url`` as the one tier of a recovery: persistent storage."""
    return Tier("storage", url, "storage", storage_options)


def _tiers_of(url: str | None, tiers: Sequence[Tier] | None,
              storage_options: Mapping[str, Any] | None) -> tuple[list[Tier], str]:
    """The tiers a resume reads (``tiers``, else ``url`` as storage, else none) and how to name them."""
    if tiers:
        return list(tiers), ", ".join(f"{t.name}={t.url}" for t in tiers)
    if url:
        return [storage_tier(url, storage_options)], url
    return [], "(no checkpoint URL)"


@dataclass(frozen=True)
class LiveState:
    """What a surviving process holds when ``rescale`` runs in-process after a peer failure.

    A fresh joiner of the group (scale up: group ranks ``len(alive)`` and up) passes ``cfg=None``
    and no ``states``: it learns the layout from group rank 0 and receives its whole shard.

    ``cfg``: the layout the job ran; ``states``: consistent copies of this process's shard under
    ``cfg`` by step (the trainer keeps the last few steps: a failure in the middle of a step
    leaves the working state mixed, never these); ``alive``: for each of the first ranks of the
    current default group (the survivors' group, ``Membership.recover``), its rank under ``cfg``;
    the ranks after them held nothing (spares of ``cfg``: fresh joiners, ``live_order``);
    ``sources``: checkpoint URLs, cheapest first (this host's store, then persistent storage),
    that pieces no survivor holds are read from.

    A torch-native job (``rescale(url, state_dict, live=...)``) passes ``cfg``: the ``StateLayout``
    its state dicts had before the failure and ``ptc``: their collection (both from
    ``tenplex.state_dict.describe_state_dict``, called while every rank was alive), and ``states``:
    per step, this rank's local tensors and values by flat key (``local_shard``, copied). Its
    joiners pass ``LiveState(cfg=None, states={}, alive=...)`` as well and learn the layout, the
    collection and the survivors' old ranks from group rank 0.
    """

    cfg: ParallelConfig | StateLayout | None
    states: Mapping[int, Mapping[str, Any]]
    alive: Sequence[int]
    sources: Sequence[str] = ()
    ptc: PTC | None = None


def live_step(held: Sequence[Sequence[int]], stored: Sequence[Sequence[int]],
              needs_storage: Sequence[bool]) -> int | None:
    """The step an in-process rescale moves: the newest one every survivor holds in memory
    (``held[r]``, survivors only: joiners hold nothing) and at which every rank that needs pieces
    no survivor holds (``needs_storage[r]``, every rank of the group) finds a complete checkpoint
    (``stored[r]``); None when there is none (then the state is loaded from the stores' and
    storage's newest common step). Pure."""
    if not held:
        return None
    common = set(held[0]).intersection(*map(set, held[1:]))
    for r, needs in enumerate(needs_storage):
        if needs:
            common &= set(stored[r])
    return max(common) if common else None


def live_order(ptc: PTC, cfg: ParallelConfig | StateLayout, choose: Chooser | MeshChooser,
               previous: Sequence[int], *,
               known: Mapping[tuple[tuple[str, int], ...], StateLayout] | None = None,
               ) -> Callable[[Sequence[int]], list[int]]:
    """A ``Membership(order=...)``: the survivors (member ids of the group ``previous``, ids by
    rank) ordered by ``locality_order`` for the layout ``choose`` picks for the new group's size,
    so that new rank i runs where most of its state already is; spares of ``cfg`` (ranks beyond its
    size, holding nothing) come after every survivor that holds state, then joiners (ids not in
    ``previous``, holding nothing either) in the order given: all of them fresh joiners of ``migrate``.

    A torch-native job passes its ``StateLayout`` (``describe_state_dict``) and its mesh rule
    (``choose_mesh``'s ``choose``: world size -> mesh dims): the new layout is the state dict's on
    that mesh as ``StateLayout.remesh`` predicts it (pure: every survivor computes the same order
    from what it holds, with no message). ``known``: layouts the job's state dicts had on earlier
    meshes (mesh dims as ``tuple(dims.items())`` -> ``describe_state_dict``'s layout): the one of the
    new mesh's exact dims is taken as it is, else one ``remesh`` can carry to them (a TP dim coming
    back after a shrink, pipeline stages on a mesh seen before). Where neither tells (a TP dim never
    seen), the survivors keep their old rank order (logged); a prediction the rebuilt model does
    not match costs bytes moved, never correctness (``rescale`` plans on the layout described)."""

    def order(members: Sequence[int]) -> list[int]:
        held = set(previous)
        ranks = old_ranks(previous, [m for m in members if m in held])
        joiners = [m for m in members if m not in held]
        holders = sorted(r for r in ranks if r < cfg.world_size)  # ties broken alike whatever the members' order
        spares = [r for r in ranks if r >= cfg.world_size]
        if isinstance(cfg, StateLayout):
            dims = tuple(choose_mesh(len(members), choose=choose).items())  # type: ignore[arg-type]
            try:
                new: ParallelConfig | StateLayout = predict_layout(cfg, dims, known or {})
            except LayoutError as e:
                log.warning("survivors in their old rank order: the state dict's layout for %d ranks cannot be "
                            "told before the model is rebuilt (%s)", len(members), e)
                return [previous[r] for r in holders + spares] + joiners
        else:
            new = choose(ptc, len(members), cfg)  # type: ignore[call-arg]
        return [previous[r] for r in locality_order(ptc, cfg, new, holders) + spares] + joiners

    return order


def predict_layout(cfg: StateLayout, dims: tuple[tuple[str, int], ...],
                   known: Mapping[tuple[tuple[str, int], ...], StateLayout]) -> StateLayout:
    """The layout a state dict will have on mesh ``dims`` (pure): ``known[dims]`` when the job ran on
    that mesh before, else ``cfg.remesh(dims)``, else the first of ``known`` (newest first) that
    ``remesh`` carries to ``dims``; raises ``cfg.remesh``'s LayoutError when none can tell."""
    if dims in known:
        return known[dims]
    first: LayoutError | None = None
    for layout in (cfg, *reversed(list(known.values()))):
        try:
            return layout.remesh(dims)
        except LayoutError as e:
            first = first or e
    assert first is not None
    raise first


def _stored_steps(sources: Sequence[str]) -> dict[int, str]:
    """Step -> the first source holding a complete attempt of it (unreadable sources skipped)."""
    out: dict[int, str] = {}
    for url in sources:
        try:
            infos = list_steps(url)
        except (OSError, ValueError) as e:
            log.warning("cannot list %s for pieces no survivor holds: %s", url, e)
            continue
        for info in infos:
            if info.complete:
                out.setdefault(info.step, url)
    return out


def _agree_live(moves: Plan, live: LiveState, rank: int, world: int,
                holders: int) -> tuple[int | None, str | None, bool]:
    """The step an in-process rescale moves (``live_step`` of every rank's view: one
    ``all_gather_object``), where this rank reads the pieces no survivor holds (migrate() wants a URL
    on every rank once any rank reads from storage; ranks that read nothing pass any) and whether it
    reads any. Step None: no step is held by every survivor and stored where needed."""
    c = moves.columns
    needs = bool(((c["kind"] == STORAGE) & (c["new_rank"] == rank)).any())
    stored = _stored_steps(live.sources) if needs else {}
    views: list[Any] = [None] * world
    dist.all_gather_object(views, (sorted(live.states) if rank < holders else None, sorted(stored), needs))
    step = live_step([v[0] for v in views if v[0] is not None], [v[1] for v in views], [v[2] for v in views])
    if step is None:
        log.warning("rank %d: no step is held by every survivor and stored where needed (held %s, stored %s); "
                    "loading from the stores and storage", rank, [v[0] for v in views], sorted(stored))
        return None, None, needs
    return step, (stored.get(step) if needs else (live.sources[0] if live.sources else None)), needs


def _rescale_live(ptc: PTC, live: LiveState, chooser: Chooser, *,
                  gpus_per_host: int) -> RescaleResult | ParallelConfig:
    """The live branch of ``rescale``: every process of the default group together; when no step
    is held by every survivor and stored where needed, the layout the job ran instead (the caller
    then loads).

    Group ranks ``< len(live.alive)`` hold state under ``live.cfg``; those after them (spares of
    ``live.cfg``, and processes that joined: ``LiveState(cfg=None)``) join ``migrate`` as fresh
    joiners. Ranks beyond both the holders and the new layout are spares that take no part in the
    move (a subgroup moves the state)."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    live = _live_for_group(live, rank, world)
    old = live.cfg
    cfg = chooser(ptc, world, old)
    check_fits(cfg, world)
    ptc.check(cfg)
    holders = len(live.alive)
    t1 = time.perf_counter()
    moves = plan(ptc, old, cfg, alive=list(live.alive), gpus_per_host=gpus_per_host)
    t2 = time.perf_counter()
    step, url, needs = _agree_live(moves, live, rank, world, holders)
    t3 = time.perf_counter()
    timings = {"choose": t1 - t0, "plan": t2 - t1, "agree": t3 - t2}
    if step is None:
        return old
    movers = max(cfg.world_size, holders)  # group ranks beyond both hold nothing and receive nothing
    # every rank calls new_group; the timeout is the trainer's default --pg-timeout (a new gloo group's is 30 min)
    group = dist.new_group(list(range(movers)), timeout=datetime.timedelta(seconds=60)) if movers < world else None
    if rank >= movers:
        result = RescaleResult(cfg, rank, world, step, False, None, None, old, moves.stats, None, timings,
                               {}, live=True)
        log.info("%s", result.summary())
        return result
    res = migrate(ptc, old, cfg, live.states[step] if rank < holders else None, alive=list(live.alive),
                  group=group, storage=url, step=step, plan=moves, gpus_per_host=gpus_per_host)
    timings.update({"migrate": res.seconds, **{f"migrate_{k}": v for k, v in res.timings.items()}})
    result = RescaleResult(cfg, rank, world, step, False, dict(res.shard) if rank < cfg.world_size else None, None,
                           old, moves.stats, None, timings,
                           {"local": res.bytes_local, "live": res.bytes_received, "storage": res.bytes_storage},
                           live=True, storage_url=url if needs else None)
    log.info("%s", result.summary())
    return result


def _same_model(old: PTC, new: PTC) -> None:
    """CheckpointMismatchError unless two state-dict collections have the same keys, global shapes and
    dtypes (their canonical orders may differ: the layouts they were described under chose them)."""
    a = {n: (t.shape, t.dtype) for n, t in old.tensors.items()}
    b = {n: (t.shape, t.dtype) for n, t in new.tensors.items()}
    problems = [f"{k}: held {list(a[k][0])} {a[k][1]}, rebuilt {list(b[k][0])} {b[k][1]}"
                for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    for what, keys in (("the survivors' state lacks", set(b) - set(a)),
                       ("the rebuilt state dict lacks", set(a) - set(b)),
                       ("objects differ:", set(old.objects) ^ set(new.objects))):
        if keys:
            problems.append(f"{what} {sorted(keys)[:5]}")
    if problems:
        raise CheckpointMismatchError("the state dict rebuilt for the new mesh is not the one the survivors hold: "
                                      + "; ".join(problems[:8]))


def _live_for_group(live: LiveState, rank: int, world: int) -> LiveState:
    """``live`` completed for every rank of the new group (both paths): group ranks ``<
    len(live.alive)`` hold state under ``live.cfg``; ranks after them (spares of the old layout, and
    fresh joiners: ``LiveState(cfg=None, states={})``) learn the layout, a torch-native job's
    collection and the holders' old ranks from group rank 0 (one ``broadcast_object_list``, only
    when the group has such ranks). ConfigError for a joiner with states, ranks that disagree, a
    joiner before a holder, or a group where no rank holds state."""
    if live.cfg is None and live.states:
        raise ConfigError(f"group rank {rank} joined (LiveState(cfg=None)) and must pass no states")
    if len(live.alive) > world:
        raise ConfigError(f"{len(live.alive)} survivors hold state but the group has {world} ranks")
    if len(live.alive) < world:
        box = [(live.cfg, live.ptc, list(live.alive)) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        old, ptc, alive = box[0]
        if live.cfg is not None and (live.cfg != old or list(live.alive) != alive):
            raise ConfigError(f"group rank {rank} ran {live.cfg} with holders {list(live.alive)}, group rank 0 "
                              f"says {old} with {alive}")
        if live.cfg is None and rank < len(alive):
            raise ConfigError(f"group rank {rank} joined (LiveState(cfg=None)), but group ranks below {len(alive)} "
                              f"are the holders {alive}: joiners come after them (order members with live_order)")
        live = dataclasses.replace(live, cfg=old, ptc=ptc, alive=tuple(alive))
    if live.cfg is None:
        raise ConfigError(f"no rank of the group of {world} holds state (group rank 0 passed LiveState(cfg=None)): "
                          "nothing to move live; start from the checkpoint (rescale without live)")
    return live


def _rescale_state_dict(url: str | None, state_dict: MutableMapping[str, Any], *, live: LiveState | None,
                        step: int | None, storage_options: Mapping[str, Any] | None,
                        gpus_per_host: int) -> RescaleResult:
    """``rescale`` for a torch-native job's ``state_dict`` (built for the new mesh, every rank of the
    default group together): moved live from the survivors' states, or loaded in place from ``url``."""
    t0 = time.perf_counter()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    # the values of a state dict about to be filled do not matter (a joiner's step counters differ)
    new_ptc, layout = describe_state_dict(state_dict, values=live is None)
    timings = {"describe": time.perf_counter() - t0}
    if live is not None:
        if live.cfg is not None and (not isinstance(live.cfg, StateLayout) or live.ptc is None):
            raise ConfigError("rescale(url, state_dict, live=...) needs LiveState(cfg=the StateLayout and ptc=the "
                              "collection the survivors' states have): describe_state_dict(state_dict) before a "
                              "failure; a joiner passes LiveState(cfg=None, states={}, alive=...)")
        live = _live_for_group(live, rank, world)
        old, ptc = live.cfg, live.ptc
        assert isinstance(old, StateLayout) and ptc is not None
        holders = len(live.alive)
        _same_model(ptc, new_ptc)
        layout.check(ptc, complete=True)
        t1 = time.perf_counter()
        moves = plan(ptc, old, layout, alive=list(live.alive), gpus_per_host=gpus_per_host)
        t2 = time.perf_counter()
        moved, src, needs = _agree_live(moves, live, rank, world, holders)
        timings.update({"plan": t2 - t1, "agree": time.perf_counter() - t2})
        if moved is not None:
            res = migrate(ptc, old, layout, live.states[moved] if rank < holders else None, alive=list(live.alive),
                          storage=src, step=moved, plan=moves, gpus_per_host=gpus_per_host)
            t3 = time.perf_counter()
            fill_state_dict(state_dict, res.shard)
            timings.update({"migrate": res.seconds, **{f"migrate_{k}": v for k, v in res.timings.items()},
                            "fill": time.perf_counter() - t3})
            result = RescaleResult(layout, rank, world, moved, False, None, None, old, moves.stats, None, timings,
                                   {"local": res.bytes_local, "live": res.bytes_received,
                                    "storage": res.bytes_storage}, live=True, storage_url=src if needs else None)
            log.info("%s", result.summary())
            return result
    if not url or not any(s.complete for s in list_steps(url, storage_options=storage_options)):
        log.info("no checkpoint under %s: fresh start under %s", url, layout)
        return RescaleResult(layout, rank, world, 0, True, timings=timings)
    t1 = time.perf_counter()
    loaded = load_state_dict(state_dict, url, step=step, storage_options=storage_options)
    timings["load"] = time.perf_counter() - t1
    result = RescaleResult(layout, rank, world, loaded.step, False, None, loaded.extra, None, None, loaded.stats,
                           timings, {"storage": loaded.bytes_read}, loaded.skipped)
    log.info("%s", result.summary())
    return result


def rescale(
    url: str | None,
    ptc: PTC | MutableMapping[str, Any],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    parallel: ParallelConfig | None = None,
    choose: Chooser | None = None,
    layout_options: Mapping[str, Any] | None = None,
    gpus_per_host: int = 8,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Tier] | None = None,
    topology: Topology | None = None,
    step: int | None = None,
    allow_meta_change: bool = False,
    live: LiveState | None = None,
) -> RescaleResult:
    """Pick this worker's layout and move its state live from the survivors, or load it from the
    latest complete checkpoint.

    A torch-native job passes its ``state_dict`` (model and optimizer from ``get_state_dict`` plus
    anything else, built for the mesh it runs now: ``choose_mesh``) instead of a PTC: with ``live``
    (``LiveState(cfg=StateLayout, ptc=..., states=..., alive=..., sources=...)``, every rank of the
    survivors' default group) the state is moved live into it by the same ``plan`` and ``migrate``,
    pieces no survivor holds read from ``live.sources`` (``url``'s checkpoints); without (or when no
    step is held by every survivor and stored where needed) it is loaded in place from ``url``
    (``load_state_dict``); no checkpoint: a fresh start. ``RescaleResult.cfg`` is then the state
    dict's ``StateLayout``, ``live`` says which path ran.

    ``live`` (in-process, after ``Membership.recover``; every process of the survivors' default
    group together): the layout is chosen for the group's size, ``plan`` with ``alive`` = the
    survivors gives every piece its source, and ``tenplex.migrate.migrate`` moves the state held
    in memory between the survivors; pieces no survivor holds are read from ``live.sources`` at
    the same step. The step is the newest one every survivor holds in memory and, for those
    pieces, a source holds complete (``live_step``); when there is none, the state is loaded as
    below (from ``tiers`` / ``url``) under the chosen layout and ``agree_on_step`` settles the
    ranks on one step. ``RescaleResult.live`` says which happened.

    ``url``: where the checkpoints are; None or "" (and no ``tiers``) is a fresh start that
    only chooses the layout. ``parallel`` pins the layout; otherwise ``choose(ptc,
    world_size, previous_layout)`` picks it, by default ``tenplex.layouts.choose_layout``
    (:func:`default_chooser`) with ``layout_options`` completed by :func:`layout_options_for`:
    ``global_batch`` and ``micro_batch`` must be given (ConfigError naming them otherwise);
    ``seq_len``, ``precision`` and ``distributed_optimizer`` default to the PTC's,
    ``gpu_mem`` to this worker's device memory, ``gpus_per_host`` to the argument. Raises
    CheckpointMismatchError for a checkpoint of another model, or of other model settings
    (``ptc.meta["model"]``) unless ``allow_meta_change``, and LayoutError when no layout fits
    the world size.

    ``step``: resume from this step (default: the newest). The load falls back from a damaged
    attempt to the newest older one that verifies (only among ``step``'s attempts when
    given); ``RescaleResult.skipped`` lists what it passed over. Checkpoints that exist but of
    which none verifies raise CheckpointCorruptError rather than starting fresh.

    Every resume is a tiered recovery (``tenplex.store.recovery``): ``tiers``
    (``tenplex.store.Tier``, cheapest first: this host's store, peer stores, persistent
    storage), or without them ``url`` as the one storage tier (:func:`storage_tier`, with
    ``storage_options``). One scan of the tiers (``scan_tiers``: one listing, each manifest
    read once) gives the steps and the newest manifest, whose model is checked once
    (``check_model``); the newest step whose parts all exist in some tier is loaded
    (``load_tiered``), each part from the cheapest tier holding an intact copy, and a step
    only ``url`` holds is read as ``tenplex.load`` reads it. Reads from peer stores follow the
    recovery schedule's rounds over ``topology`` (default: hosts of ``gpus_per_host`` GPUs
    with ``RECOVERY_LINKS``). ``plan_stats``: the repartition plan from the saved layout to
    the new one (what a live reconfiguration would move) on hosts of ``gpus_per_host`` GPUs
    (``topology``'s when given), computed once and handed to the recovery schedule.
    """
    if not isinstance(ptc, PTC):  # a torch-native job's state dict, built for the mesh it runs now
        if not isinstance(ptc, MutableMapping):
            raise ConfigError(f"rescale() takes a PTC or a state dict, got {type(ptc).__name__}")
        if parallel is not None or choose is not None or layout_options or tiers or rank is not None or \
                world_size is not None:
            raise ConfigError("rescale(url, state_dict): the job chose its mesh (choose_mesh) and built the state dict "
                              "for it; parallel=, choose=, layout_options=, tiers=, rank= and world_size= do not apply")
        return _rescale_state_dict(url, ptc, live=live, step=step, storage_options=storage_options,
                                   gpus_per_host=gpus_per_host)
    env_rank, env_size = env_world()
    rank = env_rank if rank is None else rank
    world = env_size if world_size is None else world_size
    chooser = (_pinned(parallel) if parallel is not None else  # options checked before any I/O
               choose or default_chooser(layout_options_for(ptc, layout_options, gpus_per_host=gpus_per_host)))
    if live is not None:
        moved = _rescale_live(ptc, live, chooser, gpus_per_host=gpus_per_host)
        if isinstance(moved, RescaleResult):
            return moved
        rank, world = dist.get_rank(), dist.get_world_size()
        new = chooser(ptc, world, moved)
        loaded = rescale(url, ptc, rank=rank, world_size=world, parallel=new, gpus_per_host=gpus_per_host,
                         storage_options=storage_options, tiers=tiers, topology=topology, step=step,
                         allow_meta_change=allow_meta_change)
        return agree_on_step(loaded, url, ptc, tiers=tiers, storage_options=storage_options,
                             allow_meta_change=allow_meta_change, gpus_per_host=gpus_per_host, topology=topology)
    found, where = _tiers_of(url, tiers, storage_options)
    t0 = time.perf_counter()
    scan = scan_tiers(found) if found else TierScan([])  # one scan serves the step choice and the load
    if not tiers and found and found[0].name in scan.unavailable:
        # the scan passes over tiers it cannot list (a peer that is gone); a checkpoint URL that
        # cannot be read must not look like one without checkpoints: a fresh start would overwrite them
        raise scan.unavailable[found[0].name]
    timings = {"list": time.perf_counter() - t0}
    return _resume(found, scan, where, ptc, rank, world, chooser, step=step, allow_meta_change=allow_meta_change,
                   gpus_per_host=gpus_per_host, topology=topology, timings=timings)


def check_fits(cfg: ParallelConfig, world: int) -> None:
    """ConfigError unless ``cfg`` fits in ``world`` ranks (ranks beyond its size are spares)."""
    if cfg.world_size > world:
        raise ConfigError(f"layout {cfg} needs dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.world_size} ranks but the "
                          f"world size is {world}: choose a layout of at most {world} ranks")


def _pinned(cfg: ParallelConfig) -> Chooser:
    return lambda ptc, world, previous: cfg


def _resume(tiers: list[Tier], scan: TierScan, where: str, ptc: PTC, rank: int, world: int, chooser: Chooser, *,
            step: int | None, allow_meta_change: bool, gpus_per_host: int, topology: Topology | None,
            timings: dict[str, float]) -> RescaleResult:
    """``rescale`` after the scan: check the newest usable step's model, choose, plan, load."""
    usable = [u for u in scan.usable if step is None or u.step == step]
    damaged = [f"step {s} ({sid}): {why}" for s, sid, why in scan.unusable if step is None or s == step]
    if not usable and damaged:
        raise CheckpointCorruptError(f"checkpoints exist under {where} but none can be used (refusing to start "
                                     f"fresh): {'; '.join(damaged)}")
    if not usable and step is not None:
        raise CheckpointNotFoundError(f"no complete checkpoint of step {step} under {where}")
    saved: PTC | None = None
    previous = None
    if usable:
        newest = usable[-1]
        saved = newest.verified.ptc if newest.verified else None
        saved = saved or PTC.from_json(newest.manifest["ptc"])
        check_model(saved, ptc, f"{where} step {newest.step}", allow_meta_change=allow_meta_change)
        previous = ParallelConfig.parse(newest.manifest["layout"])

    t0 = time.perf_counter()
    cfg = chooser(ptc, world, previous)
    check_fits(cfg, world)
    ptc.check(cfg)
    timings["choose"] = time.perf_counter() - t0
    if not usable:
        log.info("no checkpoint under %s: fresh start under %s", where, cfg)
        return RescaleResult(cfg, rank, world, 0, True, timings=timings)
    if rank >= cfg.world_size:  # a spare: nothing to load; the step the placed ranks resume (agree_on_step settles it)
        log.info("rank %d is a spare under %s (%d ranks): resuming step %d without state", rank, cfg, world,
                 usable[-1].step)
        return RescaleResult(cfg, rank, world, usable[-1].step, False, None, None, previous, timings=timings)

    assert saved is not None and previous is not None
    # The repartition from the saved layout: what a live reconfiguration would move (plan_stats),
    # and the pieces the recovery schedule routes between host stores (one plan for both).
    plan_gpus = topology.gpus_per_host if topology is not None else gpus_per_host
    t0 = time.perf_counter()
    moves = plan(saved, previous, cfg, gpus_per_host=plan_gpus)
    timings["plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # ptc=None: the model was checked above, on the manifest the load uses unless it falls back
    tiered = load_tiered(tiers, cfg, rank, step=step, scan=scan, gpus_per_host=gpus_per_host, topology=topology,
                         moves=moves)
    res = tiered.result
    timings["load"] = time.perf_counter() - t0
    if res.ptc is not saved:  # fell back to an older attempt: its model is checked too
        check_model(res.ptc, ptc, f"{where} step {res.step}", allow_meta_change=allow_meta_change)
    if res.saved_layout != previous:  # ... saved under another layout: the plan of that move
        previous = res.saved_layout
        t0 = time.perf_counter()
        moves = plan(res.ptc, previous, cfg, gpus_per_host=plan_gpus)
        timings["plan"] += time.perf_counter() - t0
    result = RescaleResult(cfg, rank, world, res.step, False, res.shard, res.extra, previous, moves.stats,
                           res.stats, timings, tiered.bytes_by_kind, res.skipped)
    log.info("%s", result.summary())
    return result


def agree_on_step(result: RescaleResult, url: str | None, ptc: PTC, *, tiers: Sequence[Tier] | None = None,
                  storage_options: Mapping[str, Any] | None = None, allow_meta_change: bool = False,
                  gpus_per_host: int = 8, topology: Topology | None = None, group: Any = None) -> RescaleResult:
    """Make every rank of the initialised process group resume from the same step.

    ``rescale`` passes over damage it sees, and ranks read different bytes (a damaged block or
    index may be read by some ranks only), so ranks can resume from different steps. This
    collective (call it on every rank right after ``init_process_group``, with the arguments
    given to ``rescale``) takes the oldest step any rank resumed from; a rank that resumed from
    a newer one reloads, under the same layout, the newest step not newer than that which
    verifies for it, and the ranks repeat until they agree. Returns ``result`` when all ranks
    agree already, else the reloaded state.

    A fresh start needs every rank to find nothing. Ranks that find no step (a peer store slow to
    answer, tiers they cannot read) while others resumed look once more, then every rank raises
    CheckpointNotFoundError naming them: starting all of them fresh would discard the job's state.
    """
    if not dist.is_initialized():
        return result
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    found, where = _tiers_of(url, tiers, storage_options)
    current = result
    retried = False
    while True:
        bound, newest, fresh = _steps_of_ranks(current, device, group)
        if not fresh and bound == newest or len(fresh) == dist.get_world_size(group):
            return current
        if fresh:
            # ranks that see no checkpoint while others resumed from one: a store slow to answer at
            # start-up, a rank that reads none of the tiers the others read. Starting everybody fresh
            # would discard the job's state: the blind ranks look once more, then every rank stops.
            if not retried:
                retried = True
                layouts: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(layouts, None if current.fresh else str(current.cfg), group=group)
                if current.fresh:  # under the layout the others chose from the saved one (a blind rank's may differ)
                    log.warning("rank %d sees no checkpoint under %s while other ranks resumed from step %d: "
                                "looking again", current.rank, where, bound)
                    seen = dataclasses.replace(current, cfg=ParallelConfig.parse(next(x for x in layouts if x)))
                    current = _newest_up_to(bound, seen, found, where, ptc, allow_meta_change=allow_meta_change,
                                            gpus_per_host=gpus_per_host, topology=topology)
                continue
            raise CheckpointNotFoundError(
                f"rank(s) {fresh} found no checkpoint step up to {bound} that they can read, while the other ranks "
                f"resumed from steps {bound}..{newest}: starting fresh would discard the job's state. Make every "
                f"rank reach the checkpoints (this rank reads {where}; the host stores of TENPLEX_STORES, --ckpt), "
                "then restart the job")
        if current.step > bound:
            log.warning("rank %d resumed from step %d, another rank from step %d: reloading", current.rank,
                        current.step, bound)
            current = _newest_up_to(bound, current, found, where, ptc, allow_meta_change=allow_meta_change,
                                    gpus_per_host=gpus_per_host, topology=topology)


def _steps_of_ranks(current: RescaleResult, device: torch.device, group: Any) -> tuple[int, int, list[int]]:
    """The oldest and newest step the ranks of ``group`` resumed from (fresh ones left out) and the
    group ranks that start fresh (a collective)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    lo = torch.tensor([MAX_STEP if current.fresh else current.step], dtype=torch.int64, device=device)
    hi = torch.tensor([-1 if current.fresh else current.step], dtype=torch.int64, device=device)
    fresh = torch.zeros(world, dtype=torch.int64, device=device)
    fresh[me] = int(current.fresh)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(fresh, group=group)
    return int(lo.item()), int(hi.item()), [r for r in range(world) if fresh[r]]


def _newest_up_to(bound: int, current: RescaleResult, tiers: list[Tier], where: str, ptc: PTC,
                  **kw: Any) -> RescaleResult:
    """This rank's state from the newest step <= ``bound`` that verifies for it (fresh when none),
    from one scan of the tiers."""
    t0 = time.perf_counter()
    scan = scan_tiers(tiers) if tiers else TierScan([])
    listed = time.perf_counter() - t0
    skipped: list[tuple[int, str, str]] = list(current.skipped)
    for step in sorted({u.step for u in scan.usable if u.step <= bound}, reverse=True):
        try:
            res = _resume(tiers, scan, where, ptc, current.rank, current.world_size, _pinned(current.cfg),
                          step=step, timings={"list": listed}, **kw)
        except CheckpointCorruptError as e:
            skipped.append((step, "", str(e)))
            continue
        return dataclasses.replace(res, skipped=tuple(skipped) + res.skipped)
    log.warning("rank %d: no step up to %d verifies; all ranks start fresh", current.rank, bound)
    return dataclasses.replace(current, step=0, fresh=True, shard=None, extra=None, previous=None, plan_stats=None,
                               load_stats=None, bytes_by_tier={}, skipped=tuple(skipped))
