"""The live move: survivors of a peer failure move their in-memory state to the new layout.

One path for ``ParallelConfig`` jobs and torch-native state dicts (``StateLayout``): complete the
group's view (``live_for_group``: joiners learn the old layout from group rank 0), plan with the
survivors as ``alive``, agree on the step every survivor holds (``live_step``), then
``tenplex.elastic.migrate.migrate`` moves the pieces; those no survivor holds are read from a source
checkpoint. ``live_order`` orders the survivors so that new ranks run where their state is.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import list_steps
from ..errors import CheckpointMismatchError, ConfigError, LayoutError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout
from ..native.state_dict import fill_state_dict, local_shard
from ..planning.choose import Chooser, MeshChooser, check_fits, choose_mesh, predict_layout
from ..planning.planner import STORAGE, Plan, locality_order, plan
from .membership import old_ranks
from .migrate import migrate
from .result import RescaleResult

__all__ = ["LiveState", "live_step", "live_order", "live_for_group", "same_model", "agree_live", "move_live",
           "rescale_live", "rescale_state_dict_live"]

log = logging.getLogger(__name__)


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
    ``tenplex.native.state_dict.describe_state_dict``, called while every rank was alive), and ``states``:
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
            dims = tuple(choose_mesh(len(members), choose=choose, spares=True).items())  # type: ignore[arg-type]
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


def agree_live(moves: Plan, live: LiveState, rank: int, world: int,
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


def move_live(ptc: PTC, live: LiveState, new: ParallelConfig | StateLayout, *, gpus_per_host: int,
              timings: dict[str, float], into: Mapping[str, Any] | None = None) -> RescaleResult | None:
    """The live move of both kinds of job, once the group's view is complete (``live_for_group``) and
    the new layout is chosen (a ``ParallelConfig``) or described (a state dict's ``StateLayout``):
    plan with the survivors as ``alive``, agree on the step (``agree_live``), ``migrate``. The
    result's ``shard`` is this rank's moved state (None for a spare of ``new``); None when no step is
    held by every survivor and stored where needed (the caller loads instead). Every process of the
    default group together.

    Group ranks ``< len(live.alive)`` hold state under ``live.cfg``; those after them (spares of
    ``live.cfg``, and processes that joined) join ``migrate`` as fresh joiners. Ranks beyond both
    the holders and the new layout are spares that take no part in the move (a subgroup moves the
    state). ``into``: this rank's new local tensors by flat key, written in place (``MigrationInputs.into``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    old, holders = live.cfg, len(live.alive)
    assert old is not None
    t1 = time.perf_counter()
    moves = plan(ptc, old, new, alive=list(live.alive), gpus_per_host=gpus_per_host)
    t2 = time.perf_counter()
    step, url, needs = agree_live(moves, live, rank, world, holders)
    timings.update({"plan": t2 - t1, "agree": time.perf_counter() - t2})
    if step is None:
        return None
    movers = max(new.world_size, holders)  # group ranks beyond both hold nothing and receive nothing
    # every rank calls new_group; the timeout is the trainer's default --pg-timeout (a new gloo group's is 30 min)
    group = dist.new_group(list(range(movers)), timeout=datetime.timedelta(seconds=60)) if movers < world else None
    if rank >= movers:
        return RescaleResult(new, rank, world, step, False, None, None, old, moves.stats, None, timings, {},
                             live=True)
    res = migrate(ptc, old, new, live.states[step] if rank < holders else None, alive=list(live.alive),
                  group=group, storage=url, step=step, plan=moves, gpus_per_host=gpus_per_host, into=into)
    timings.update({"migrate": res.seconds, **{f"migrate_{k}": v for k, v in res.timings.items()}})
    return RescaleResult(new, rank, world, step, False, dict(res.shard) if rank < new.world_size else None, None,
                         old, moves.stats, None, timings,
                         {"local": res.bytes_local, "live": res.bytes_received, "storage": res.bytes_storage},
                         live=True, storage_url=url if needs else None)


def rescale_live(ptc: PTC, live: LiveState, chooser: Chooser, *,
                 gpus_per_host: int) -> RescaleResult | ParallelConfig:
    """The live branch of ``rescale`` for a PTC job: the layout ``chooser`` picks for the group's
    size, moved live (``move_live``); when no step is held by every survivor and stored where
    needed, the layout the job ran instead (the caller then loads)."""
    t0 = time.perf_counter()
    live = live_for_group(live, dist.get_rank(), dist.get_world_size())
    assert isinstance(live.cfg, ParallelConfig)
    cfg = chooser(ptc, dist.get_world_size(), live.cfg)
    check_fits(cfg, dist.get_world_size())
    ptc.check(cfg)
    moved = move_live(ptc, live, cfg, gpus_per_host=gpus_per_host, timings={"choose": time.perf_counter() - t0})
    if moved is None:
        return live.cfg
    log.info("%s", moved.summary())
    return moved


def rescale_state_dict_live(state_dict: MutableMapping[str, Any], live: LiveState, layout: StateLayout,
                            described: PTC, *, gpus_per_host: int, timings: dict[str, float]) -> RescaleResult | None:
    """The live branch of ``rescale(url, state_dict)``: the survivors' state moved live
    (``move_live``) into ``state_dict``, built for the new mesh (``layout`` and ``described``: its
    ``describe_state_dict``), filled in place; None when no step is held by every survivor and stored
    where needed (the caller loads instead)."""
    if live.cfg is not None and (not isinstance(live.cfg, StateLayout) or live.ptc is None):
        raise ConfigError("rescale(url, state_dict, live=...) needs LiveState(cfg=the StateLayout and ptc=the "
                          "collection the survivors' states have): describe_state_dict(state_dict) before a "
                          "failure; a joiner passes LiveState(cfg=None, states={}, alive=...)")
    live = live_for_group(live, dist.get_rank(), dist.get_world_size())
    ptc = live.ptc
    assert isinstance(live.cfg, StateLayout) and ptc is not None
    same_model(ptc, described)
    layout.check(ptc, complete=True)
    # the rebuilt state dict's own local tensors receive the move (its Stateful values' tensors are
    # copies: those are filled as before)
    into = {k: v for k, v in local_shard(state_dict).items() if isinstance(v, torch.Tensor)}
    moved = move_live(ptc, live, layout, gpus_per_host=gpus_per_host, timings=timings, into=into)
    if moved is None:
        return None
    t0 = time.perf_counter()
    fill_state_dict(state_dict, moved.shard or {})
    timings["fill"] = time.perf_counter() - t0
    result = dataclasses.replace(moved, shard=None, ptc=described)
    log.info("%s", result.summary())
    return result


def same_model(old: PTC, new: PTC) -> None:
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


def live_for_group(live: LiveState, rank: int, world: int) -> LiveState:
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
