"""Choosers: the layout (a ``ParallelConfig``) or torch-native mesh a job runs on a world size.

What ``rescale`` and the trainers call to decide the survivors' (or a fresh job's) layout:
``default_chooser`` (``tenplex.planning.layouts.choose_layout`` with options ``layout_options_for``
completes from the PTC and this machine), ``choose_mesh`` / ``mesh_dims`` for a torch-native
job's mesh, ``predict_layout`` for a state dict's layout on a mesh it is not yet built for, and
``check_fits``. Decisions only: no checkpoint I/O.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError, LayoutError
from ..layout.config import ParallelConfig
from ..layout.models import model_spec
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout
from .layouts import choose_layout

__all__ = ["Chooser", "MeshChooser", "MESH_DIMS", "device_memory", "layout_options_for", "default_chooser", "mesh_dims",
           "choose_mesh", "predict_layout", "check_fits", "pinned"]

log = logging.getLogger(__name__)

Chooser = Callable[[PTC, int, "ParallelConfig | None"], ParallelConfig]

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
            f"rescale() chooses the layout with tenplex.planning.layouts.choose_layout, which needs {', '.join(_REQUIRED)}; "
            f"missing: {', '.join(missing)} (seq_len defaults to the PTC's meta['model'], gpu_mem to this machine's "
            "device memory): pass layout_options=dict(global_batch=..., micro_batch=...), or pin the layout with "
            "parallel=ParallelConfig(...), or pass choose="
        )
    return opts


def default_chooser(layout_options: Mapping[str, Any]) -> Chooser:
    """The chooser ``rescale`` uses by default: ``tenplex.planning.layouts.choose_layout`` with
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


def choose_mesh(world_size: int, *, choose: MeshChooser | None = None, model: Any = None, spares: bool = False,
                **layout_options: Any) -> dict[str, int]:
    """The mesh a torch-native job runs on ``world_size`` ranks, at start-up or after a rescale.

    ``choose``: the job's own rule (its dims must multiply to ``world_size``). Else, with ``model``
    (a ``tenplex.layout.models.ModelSpec``, preset name or PTC of a Llama/GPT-like model),
    ``tenplex.planning.layouts.choose_layout`` picks the fastest (DP, TP, PP) that fits in memory
    (``layout_options``: ``global_batch``, ``micro_batch``, ``gpu_mem``, ...; the estimate models
    ZeRO-1 when ``distributed_optimizer=True``, an upper bound for FSDP2, which also shards the
    parameters) and ``mesh_dims`` names it. Else plain FSDP2 over every rank: ``{"dp_shard": world_size}``.
    ConfigError when the chosen dims do not multiply to the world size (``spares``: when they multiply
    to more; the ranks beyond their product wait as spares); LayoutError when nothing fits.
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
    if product > world_size or (product < world_size and not spares):
        raise ConfigError(f"mesh dims {dims} hold {'*'.join(map(str, sizes))} = {product} ranks, but the job has "
                          f"{world_size}: the chooser must use " + (f"at most {world_size} ranks" if spares else "every rank"))
    log.info("mesh for %d ranks: %s", world_size, dims)
    return dims

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


def check_fits(cfg: ParallelConfig, world: int) -> None:
    """ConfigError unless ``cfg`` fits in ``world`` ranks (ranks beyond its size are spares)."""
    if cfg.world_size > world:
        raise ConfigError(f"layout {cfg} needs dp*tp*pp = {cfg.dp}*{cfg.tp}*{cfg.pp} = {cfg.world_size} ranks but the "
                          f"world size is {world}: choose a layout of at most {world} ranks")


def pinned(cfg: ParallelConfig) -> Chooser:
    """The chooser that always picks ``cfg`` (``rescale(parallel=cfg)``)."""
    return lambda ptc, world, previous: cfg
