"""rescale(): what a worker calls at start-up, after torchrun's elastic agent (re)started it.

It reads the latest complete checkpoint, takes the world size from the environment, picks a
layout that is valid for the model and world size (memory-aware by default), plans the move
from the saved layout, loads this rank's state reading only the bytes it needs, and returns
the layout, the state and timings. A damaged newest step is passed over for the newest one
that verifies (reported in ``skipped``). With no checkpoint (or no URL) it says to start fresh.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import LoadStats, check_model, list_steps, load, read_manifest
from .config import ParallelConfig
from .errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, LayoutError
from .planner import PlanStats, plan
from .ptc import PTC
from .topology import Topology

__all__ = ["RescaleResult", "rescale", "agree_on_step", "env_world", "layout_options_for", "device_memory"]

log = logging.getLogger(__name__)

Chooser = Callable[[PTC, int, "ParallelConfig | None"], ParallelConfig]


@dataclass(frozen=True)
class RescaleResult:
    """Outcome of ``rescale``: the layout to run, the step reached and this rank's state."""

    cfg: ParallelConfig
    rank: int
    world_size: int
    step: int
    fresh: bool
    shard: dict[str, Any] | None = None
    extra: Any = None
    previous: ParallelConfig | None = None
    plan_stats: PlanStats | None = None
    load_stats: LoadStats | None = None
    timings: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # "local", "peer", "storage"
    skipped: tuple[tuple[int, str, str], ...] = ()  # (step, save id, reason) of newer attempts passed over

    def summary(self) -> str:
        if self.fresh:
            return f"fresh start under {self.cfg} ({self.world_size} ranks)"
        t = self.timings
        parts = [f"resumed step {self.step}: {self.previous} -> {self.cfg} ({self.world_size} ranks)",
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
    import torch

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
    argument, ``gpu_mem`` from this worker's device (:func:`device_memory`). The job's
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


def _default_chooser(layout_options: Mapping[str, Any]) -> Chooser:
    def choose(ptc: PTC, world: int, previous: ParallelConfig | None) -> ParallelConfig:
        from .layouts import choose_layout

        model = ptc.meta.get("model")
        if model is None:
            raise LayoutError("the PTC has no model description (meta['model']); pass parallel= or choose=")
        choice = choose_layout(ptc, world, current=previous, ptc=ptc, **dict(layout_options))
        return choice.cfg

    return choose


def rescale(
    url: str | None,
    ptc: PTC,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    parallel: ParallelConfig | None = None,
    choose: Chooser | None = None,
    layout_options: Mapping[str, Any] | None = None,
    gpus_per_host: int = 8,
    storage_options: Mapping[str, Any] | None = None,
    tiers: Sequence[Any] | None = None,
    topology: Topology | None = None,
    step: int | None = None,
    allow_meta_change: bool = False,
) -> RescaleResult:
    """Pick this worker's layout and load its state from the latest complete checkpoint.

    ``url``: where the checkpoints are; None or "" (and no ``tiers``) is a fresh start that
    only chooses the layout. ``parallel`` pins the layout; otherwise ``choose(ptc,
    world_size, previous_layout)`` picks it, by default ``tenplex.layouts.choose_layout``
    with ``layout_options`` completed by :func:`layout_options_for`: ``global_batch`` and
    ``micro_batch`` must be given (ConfigError naming them otherwise); ``seq_len``,
    ``precision`` and ``distributed_optimizer`` default to the PTC's, ``gpu_mem`` to this
    worker's device memory, ``gpus_per_host`` to the argument. Raises CheckpointMismatchError for a
    checkpoint of another model, or of other model settings (``ptc.meta["model"]``) unless
    ``allow_meta_change``, and LayoutError when no layout fits the world size.

    ``step``: resume from this step (default: the newest). The load falls back from a damaged
    attempt to the newest older one that verifies (only among ``step``'s attempts when
    given); ``RescaleResult.skipped`` lists what it passed over. Checkpoints that exist but of
    which none verifies raise CheckpointCorruptError rather than starting fresh.

    ``tiers`` (``tenplex.store.Tier``, cheapest first: this host's store, peer stores,
    persistent storage) switches to tiered recovery: the newest step whose parts all exist in
    some tier is loaded, each part from the cheapest tier holding an intact copy; ``url`` is
    then only used when ``tiers`` is empty. Reads from peer stores follow the recovery
    schedule's rounds (``tenplex.store.recovery.load_tiered``) over ``topology`` (default:
    hosts of ``gpus_per_host`` GPUs with ``RECOVERY_LINKS``).
    """
    env_rank, env_size = env_world()
    rank = env_rank if rank is None else rank
    world = env_size if world_size is None else world_size
    timings: dict[str, float] = {}
    chooser = None
    if parallel is None:  # options checked before any I/O
        chooser = choose or _default_chooser(layout_options_for(ptc, layout_options, gpus_per_host=gpus_per_host))
    t0 = time.perf_counter()
    scan = None
    damaged: list[str] = []
    steps: list[int] = []
    if tiers:
        from .store.recovery import scan_tiers

        scan = scan_tiers(tiers)  # one scan of the tiers serves the step choice and the load
        usable = [u for u in scan.usable if step is None or u.step == step]
        damaged = [f"step {s} ({sid}): {why}" for s, sid, why in scan.unusable if step is None or s == step]
        steps = [u.step for u in usable]
    elif url:
        infos = [i for i in list_steps(url, storage_options=storage_options) if step is None or i.step == step]
        damaged = [f"step {i.step} ({i.save_id}): {i.problem}" for i in infos if i.problem]
        steps = [i.step for i in infos if i.complete]
    timings["list"] = time.perf_counter() - t0
    where = ", ".join(f"{t.name}={t.url}" for t in tiers) if tiers else (url or "(no checkpoint URL)")
    if not steps and damaged:
        raise CheckpointCorruptError(f"checkpoints exist under {where} but none can be used (refusing to start "
                                     f"fresh): {'; '.join(damaged)}")
    if not steps and step is not None:
        raise CheckpointNotFoundError(f"no complete checkpoint of step {step} under {where}")
    previous = None
    if steps:
        if tiers:
            newest = usable[-1]
            manifest = {**newest.manifest, "ptc": newest.verified.ptc if newest.verified else PTC.from_json(
                newest.manifest["ptc"])}
        else:
            assert url
            manifest = read_manifest(url, steps[-1], storage_options=storage_options)
        saved: PTC = manifest["ptc"]
        check_model(saved, ptc, f"{where} step {manifest['step']}", allow_meta_change=allow_meta_change)
        previous = ParallelConfig.parse(manifest["layout"])

    t0 = time.perf_counter()
    if chooser is None:
        assert parallel is not None
        cfg = parallel
    else:
        cfg = chooser(ptc, world, previous)
    cfg.check_world_size(world)
    ptc.check(cfg)
    timings["choose"] = time.perf_counter() - t0

    if not steps:
        log.info("no checkpoint under %s: fresh start under %s", where, cfg)
        return RescaleResult(cfg, rank, world, 0, True, timings=timings)

    assert previous is not None
    t0 = time.perf_counter()
    by_kind: dict[str, int] = {}
    if tiers:
        from .store.recovery import load_tiered

        tiered = load_tiered(tiers, cfg, rank, ptc=ptc, step=step, scan=scan, allow_meta_change=allow_meta_change,
                             gpus_per_host=gpus_per_host, topology=topology)
        res, by_kind = tiered.result, tiered.bytes_by_kind
    else:
        assert url
        res = load(url, cfg, rank, step=step, ptc=ptc, allow_meta_change=allow_meta_change,
                   storage_options=storage_options)
        by_kind = {"storage": res.stats.bytes_read}
    timings["load"] = time.perf_counter() - t0
    if res.saved_layout != previous:  # fell back to an older step saved under another layout
        previous = res.saved_layout
    t0 = time.perf_counter()
    # What a live reconfiguration would move if the first ranks kept their state in memory.
    stats = plan(ptc, previous, cfg, gpus_per_host=gpus_per_host).stats
    timings["plan"] = time.perf_counter() - t0
    result = RescaleResult(cfg, rank, world, res.step, False, res.shard, res.extra, previous, stats, res.stats,
                           timings, by_kind, res.skipped)
    log.info("%s", result.summary())
    return result


def agree_on_step(result: RescaleResult, url: str | None, ptc: PTC, *, tiers: Sequence[Any] | None = None,
                  storage_options: Mapping[str, Any] | None = None, allow_meta_change: bool = False,
                  gpus_per_host: int = 8, topology: Topology | None = None, group: Any = None) -> RescaleResult:
    """Make every rank of the initialised process group resume from the same step.

    ``rescale`` passes over damage it sees, and ranks read different bytes (a damaged block or
    index may be read by some ranks only), so ranks can resume from different steps. This
    collective (call it on every rank right after ``init_process_group``, with the arguments
    given to ``rescale``) takes the oldest step any rank resumed from; a rank that resumed from
    a newer one reloads, under the same layout, the newest step not newer than that which
    verifies for it (fresh when none), and the ranks repeat until they agree. Returns
    ``result`` when all ranks agree already, else the reloaded state.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return result
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    current = result
    while True:
        mine = torch.tensor([-1 if current.fresh else current.step], dtype=torch.int64, device=device)
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        bound = int(lo.item())
        if bound == int(hi.item()):
            return current
        if int(mine.item()) > bound:
            log.warning("rank %d resumed from step %d, another rank from step %d: reloading", current.rank,
                        current.step, bound)
            current = _newest_up_to(bound, current, url, ptc, tiers=tiers, storage_options=storage_options,
                                    allow_meta_change=allow_meta_change, gpus_per_host=gpus_per_host,
                                    topology=topology)


def _newest_up_to(bound: int, current: RescaleResult, url: str | None, ptc: PTC, **kw: Any) -> RescaleResult:
    """This rank's state from the newest step <= ``bound`` that verifies for it (fresh when none)."""
    steps: list[int] = []
    if tiers := kw.get("tiers"):
        from .store.recovery import scan_tiers

        steps = sorted({u.step for u in scan_tiers(tiers).usable}, reverse=True)
    elif url:
        steps = sorted({i.step for i in list_steps(url, storage_options=kw.get("storage_options")) if i.complete},
                       reverse=True)
    skipped: list[tuple[int, str, str]] = list(current.skipped)
    for step in (s for s in steps if s <= bound):
        try:
            res = rescale(url, ptc, rank=current.rank, world_size=current.world_size, parallel=current.cfg,
                          step=step, **kw)
        except CheckpointCorruptError as e:
            skipped.append((step, "", str(e)))
            continue
        return RescaleResult(res.cfg, res.rank, res.world_size, res.step, res.fresh, res.shard, res.extra,
                             res.previous, res.plan_stats, res.load_stats, res.timings, res.bytes_by_tier,
                             tuple(skipped) + res.skipped)
    log.warning("rank %d: no step up to %d verifies; all ranks start fresh", current.rank, bound)
    return RescaleResult(current.cfg, current.rank, current.world_size, 0, True, timings=current.timings,
                         skipped=tuple(skipped))
