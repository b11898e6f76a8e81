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
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..checkpoint import check_model
from ..checkpoint import LoadResult, ShardSink
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, TenplexError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout
from ..native.agree import agree_step
from ..native.state_dict import StepSource, UrlSource, describe_state_dict, load_state_dict_from
from ..options import with_overrides
from ..planning.choose import Chooser, check_fits, default_chooser, layout_options_for, pinned
from ..planning.planner import plan
from ..planning.topology import Topology
from ..store.recovery import Tier, TierScan, load_tiered, scan_tiers
from .live import LiveState, rescale_live, rescale_state_dict_live
from .result import RescaleResult

__all__ = ["RescaleOptions", "rescale", "agree_on_step", "env_world", "storage_tier"]

log = logging.getLogger(__name__)


def env_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) when run alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


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


class _TierSource:
    """The recovery tiers as a state dict's ``StepSource``: one scan, tiered loads (host stores first,
    each part from the cheapest tier with an intact copy); ``bytes_by_kind``: the last load's."""

    def __init__(self, tiers: Sequence[Tier], where: str, *, gpus_per_host: int, topology: Topology | None) -> None:
        self.tiers, self.where = list(tiers), where
        self.gpus_per_host, self.topology = gpus_per_host, topology
        self.scan: TierScan | None = None
        self.bytes_by_kind: dict[str, int] = {}

    def _scanned(self) -> TierScan:
        if self.scan is None:
            self.scan = scan_tiers(self.tiers)
        return self.scan

    def steps(self) -> list[int]:
        return sorted({u.step for u in self._scanned().usable})

    def load(self, layout: StateLayout, rank: int, *, step: int | None, sink: ShardSink,
             check: Callable[[PTC], None]) -> LoadResult:
        tiered = load_tiered(self.tiers, layout, rank, step=step, scan=self._scanned(), sink=sink, check=check,
                             gpus_per_host=self.gpus_per_host, topology=self.topology)
        self.bytes_by_kind = dict(tiered.bytes_by_kind)
        return tiered.result


def _rescale_state_dict(url: str | None, state_dict: MutableMapping[str, Any], live: LiveState | None,
                        o: RescaleOptions) -> RescaleResult:
    """``rescale`` for a torch-native job's ``state_dict`` (built for the new mesh, every rank of the
    default group together): moved live from the survivors' states, or loaded in place from ``tiers``
    (host stores, peers, persistent storage) or ``url``."""
    t0 = time.perf_counter()
    group = o.process_group if live is None else None  # a load: over the mesh's ranks alone (spares call nothing)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    if rank < 0:
        raise ConfigError("rescale(url, state_dict, process_group=...) without live=: a load by the mesh's ranks, "
                          "and this rank is not one of them (a spare holds no state: it loads nothing)")
    # the values of a state dict about to be filled do not matter (a joiner's step counters differ)
    if o.process_group is None or live is None:
        new_ptc, layout = describe_state_dict(state_dict, values=live is None, process_group=group)
    else:  # spares in a live move: the mesh's ranks describe, group rank 0 hands the spares the layout
        box = [None if dist.get_rank(o.process_group) < 0 else
               describe_state_dict(state_dict, values=False, process_group=o.process_group)]
        dist.broadcast_object_list(box, src=0)
        new_ptc, layout = box[0]
    timings = {"describe": time.perf_counter() - t0}
    if live is not None:
        moved = rescale_state_dict_live(state_dict, live, layout, new_ptc, gpus_per_host=o.gpus_per_host,
                                        timings=timings)
        if moved is not None:
            return moved
        if o.process_group is not None:
            raise TenplexError("no step is held by every survivor and stored where needed, and a load with spares "
                               "is not supported yet")
    found, where = _tiers_of(url, o.tiers, o.storage_options)
    source: StepSource | None = None
    if o.tiers:
        source = _TierSource(found, where, gpus_per_host=o.gpus_per_host, topology=o.topology)
    elif url:
        source = UrlSource(url, o.storage_options)
    if source is None or not source.steps():
        log.info("no checkpoint under %s: fresh start under %s", where, layout)
        return RescaleResult(layout, rank, world, 0, True, timings=timings, ptc=new_ptc)
    t1 = time.perf_counter()
    loaded = load_state_dict_from(state_dict, source, step=o.step, process_group=group)
    timings["load"] = time.perf_counter() - t1
    by_tier = source.bytes_by_kind if isinstance(source, _TierSource) else {"storage": loaded.bytes_read}
    result = RescaleResult(layout, rank, world, loaded.step, False, None, loaded.extra, None, None, loaded.stats,
                           timings, by_tier, loaded.skipped, ptc=new_ptc)
    log.info("%s", result.summary())
    return result


@dataclass(frozen=True)
class RescaleOptions:
    """The settings of ``rescale`` (every field optional; ``rescale``'s keywords override them).

    ``rank`` / ``world_size``: this worker (default: torchrun's environment, :func:`env_world`).
    ``parallel`` pins the layout; otherwise ``choose(ptc, world_size, previous_layout)`` picks it, by
    default ``tenplex.planning.layouts.choose_layout``
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

    A torch-native job's state dict takes ``tiers``, ``storage_options``, ``step``, ``gpus_per_host``
    and ``topology``; ``parallel``, ``choose``, ``layout_options``, ``rank`` and ``world_size`` do not
    apply to it (its mesh is the one it built the state dict for). ``process_group``: a torch-native
    job whose mesh holds only some ranks of the default group (the others spares), in a live move:
    the group of the mesh's ranks, which describe the state dict (group rank 0 hands the spares its
    layout); a spare passes an empty state dict and is given nothing. In a load (no ``live``: a
    restart) only the mesh's ranks call ``rescale``, collective over that group; the spares load nothing.
    """

    rank: int | None = None
    world_size: int | None = None
    parallel: ParallelConfig | None = None
    choose: Chooser | None = None
    layout_options: Mapping[str, Any] | None = None
    gpus_per_host: int = 8
    storage_options: Mapping[str, Any] | None = None
    tiers: Sequence[Tier] | None = None
    topology: Topology | None = None
    step: int | None = None
    allow_meta_change: bool = False
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ConfigError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world: 0 <= rank < world_size = {self.world_size}")
        if self.step is not None and self.step < 0:
            raise ConfigError(f"step must be >= 0, got {self.step}")
        if self.parallel is not None and self.choose is not None:
            raise ConfigError(f"parallel={self.parallel} pins the layout and choose= picks one: pass one of them")


def rescale(url: str | None, ptc: PTC | MutableMapping[str, Any], options: RescaleOptions | None = None, *,
            live: LiveState | None = None, **overrides: Any) -> RescaleResult:
    """Pick this worker's layout and move its state live from the survivors, or load it from the
    latest complete checkpoint.

    A torch-native job passes its ``state_dict`` (model and optimizer from ``get_state_dict`` plus
    anything else, built for the mesh it runs now: ``choose_mesh``) instead of a PTC: with ``live``
    (``LiveState(cfg=StateLayout, ptc=..., states=..., alive=..., sources=...)``, every rank of the
    survivors' default group) the state is moved live into it by the same ``plan`` and ``migrate``,
    pieces no survivor holds read from ``live.sources`` (``url``'s checkpoints); without (or when no
    step is held by every survivor and stored where needed) it is loaded in place from ``tiers``
    (host stores first, as below: ``tenplex.native.state_dict.load_state_dict_from`` over the tiers) or
    ``url`` (``load_state_dict``); no checkpoint: a fresh start. ``RescaleResult.cfg`` is then the state
    dict's ``StateLayout``, ``live`` says which path ran.

    ``live`` (in-process, after ``Membership.recover``; every process of the survivors' default
    group together): the layout is chosen for the group's size, ``plan`` with ``alive`` = the
    survivors gives every piece its source, and ``tenplex.elastic.migrate.migrate`` moves the state held
    in memory between the survivors; pieces no survivor holds are read from ``live.sources`` at
    the same step. The step is the newest one every survivor holds in memory and, for those
    pieces, a source holds complete (``live_step``); when there is none, the state is loaded as
    below (from ``tiers`` / ``url``) under the chosen layout and ``agree_on_step`` settles the
    ranks on one step. ``RescaleResult.live`` says which happened.

    ``url``: where the checkpoints are; None or "" (and no ``tiers``) is a fresh start that only
    chooses the layout. ``options`` (:class:`RescaleOptions`: the layout, the tiers, the step, ...);
    keywords override its fields (``rescale(url, ptc, parallel=cfg, step=5)``).
    """
    o = with_overrides(options or RescaleOptions(), overrides, "rescale")
    if not isinstance(ptc, PTC):  # a torch-native job's state dict, built for the mesh it runs now
        if not isinstance(ptc, MutableMapping):
            raise ConfigError(f"rescale() takes a PTC or a state dict, got {type(ptc).__name__}")
        if o.parallel is not None or o.choose is not None or o.layout_options or o.rank is not None or \
                o.world_size is not None:
            raise ConfigError("rescale(url, state_dict): the job chose its mesh (choose_mesh) and built the state dict "
                              "for it; parallel=, choose=, layout_options=, rank= and world_size= do not apply")
        return _rescale_state_dict(url, ptc, live, o)
    if o.process_group is not None:
        raise ConfigError("rescale(url, ptc): process_group= is a torch-native state dict's (its spares)")
    env_rank, env_size = env_world()
    rank = env_rank if o.rank is None else o.rank
    world = env_size if o.world_size is None else o.world_size
    chooser = (pinned(o.parallel) if o.parallel is not None else  # options checked before any I/O
               o.choose or default_chooser(layout_options_for(ptc, o.layout_options, gpus_per_host=o.gpus_per_host)))
    if live is not None:
        moved = rescale_live(ptc, live, chooser, gpus_per_host=o.gpus_per_host)
        if isinstance(moved, RescaleResult):
            return moved
        rank, world = dist.get_rank(), dist.get_world_size()
        pinned_here = dataclasses.replace(o, rank=rank, world_size=world, parallel=chooser(ptc, world, moved),
                                          choose=None)
        return agree_on_step(rescale(url, ptc, pinned_here), url, ptc, pinned_here)
    found, where = _tiers_of(url, o.tiers, o.storage_options)
    t0 = time.perf_counter()
    scan = scan_tiers(found) if found else TierScan([])  # one scan serves the step choice and the load
    if not o.tiers and found and found[0].name in scan.unavailable:
        # the scan passes over tiers it cannot list (a peer that is gone); a checkpoint URL that
        # cannot be read must not look like one without checkpoints: a fresh start would overwrite them
        raise scan.unavailable[found[0].name]
    timings = {"list": time.perf_counter() - t0}
    return _resume(found, scan, where, ptc, rank, world, chooser, step=o.step, allow_meta_change=o.allow_meta_change,
                   gpus_per_host=o.gpus_per_host, topology=o.topology, timings=timings)


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


def agree_on_step(result: RescaleResult, url: str | None, ptc: PTC, options: RescaleOptions | None = None, *,
                  group: Any = None, **overrides: Any) -> RescaleResult:
    """Make every rank of the initialised process group resume from the same step.

    ``rescale`` passes over damage it sees, and ranks read different bytes, so ranks can resume
    from different steps. This collective (call it on every rank right after
    ``init_process_group``, with the arguments given to ``rescale``) applies the one rule
    ``tenplex.native.agree.agree_step`` (``load_state_dict``'s too): the oldest step any rank resumed from;
    a rank that resumed from a newer one reloads, under the same layout, the newest step not newer
    than that which verifies for it, and the ranks repeat until they agree. Returns ``result`` when
    all ranks agree already, else the reloaded state.

    A fresh start needs every rank to find nothing. Ranks that find no step (a peer store slow to
    answer, tiers they cannot read) while others resumed look once more, under the layout the others
    chose from the saved one, then every rank raises CheckpointNotFoundError naming them: starting
    all of them fresh would discard the job's state. ``options`` / keywords: ``rescale``'s (its
    ``tiers``, ``storage_options``, ``allow_meta_change``, ``gpus_per_host`` and ``topology`` count).
    """
    o = with_overrides(options or RescaleOptions(), overrides, "agree_on_step")
    found, where = _tiers_of(url, o.tiers, o.storage_options)
    current = result

    def reload(bound: int, layouts: Sequence[Any]) -> int | None:
        nonlocal current
        seen = current
        if current.fresh:  # under the layout the others chose from the saved one (a blind rank's may differ)
            seen = dataclasses.replace(current, cfg=ParallelConfig.parse(layouts[0]))
        current = _newest_up_to(bound, seen, found, where, ptc, allow_meta_change=o.allow_meta_change,
                                gpus_per_host=o.gpus_per_host, topology=o.topology)
        return None if current.fresh else current.step

    agree_step(None if result.fresh else result.step, reload, hint=None if result.fresh else str(result.cfg),
               where=where, group=group)
    return current


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
            res = _resume(tiers, scan, where, ptc, current.rank, current.world_size, pinned(current.cfg),
                          step=step, timings={"list": listed}, **kw)
        except CheckpointCorruptError as e:
            skipped.append((step, "", str(e)))
            continue
        return dataclasses.replace(res, skipped=tuple(skipped) + res.skipped)
    log.warning("rank %d: no step up to %d verifies; all ranks start fresh", current.rank, bound)
    return dataclasses.replace(current, step=0, fresh=True, shard=None, extra=None, previous=None, plan_stats=None,
                               load_stats=None, bytes_by_tier={}, skipped=tuple(skipped))