"""Which (DP, TP, PP) layout to run on a given number of GPUs: enumerate, check memory, rank.

Every factorisation ``dp * tp * pp * cp == gpus`` is a candidate. Candidates the model or the
batch cannot take are rejected with the reason; the rest get a memory estimate
(:func:`tenplex.planning.memory.estimate_memory`) and are rejected when a stage needs more than 80 %
of the GPU's memory. Feasible layouts are ranked by a simple throughput model (compute
inflated by the 1F1B bubble, plus TP and DP communication) plus, when the job is being
reconfigured from a current layout, the time to move its state amortised over
``horizon_steps``. Pure arithmetic apart from calling the planner; see docs/memory.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, replace
from dataclasses import fields as fields_of
from typing import Any

import numpy as np

from ..data.partition import replica_samples
from ..errors import ConfigError, LayoutError
from ..layout.config import MAX_WORLD_SIZE, ParallelConfig
from ..layout.models import ModelSpec, model_ptc
from ..layout.ptc import PTC
from .memory import GiB, PRECISIONS, RECOMPUTE, MemoryEstimate, estimate_memory, parse_size, recompute_flops, resolve_model
from .planner import CROSS_HOST, SAME_HOST, STORAGE, Plan, plan

__all__ = ["Hardware", "LayoutChoice", "LayoutSearch", "valid_layouts", "rank_layouts", "choose_layout", "divisors", "step_time",
           "reconfig_time", "batch_split"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hardware:
    """Constants of the throughput model, per GPU.

    ``flops``: effective (achieved, not peak) dense bf16 FLOP/s; ``intra_host_bw``: NVLink
    bytes/s; ``inter_host_bw``: network bytes/s; ``storage_bw``: bytes/s one GPU reads from
    persistent storage when a piece has no live holder.
    """

    flops: float = 400e12
    intra_host_bw: float = 300e9
    inter_host_bw: float = 50e9
    storage_bw: float = 5e9

    def __post_init__(self) -> None:
        for name in ("flops", "intra_host_bw", "inter_host_bw", "storage_bw"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"Hardware.{name} must be positive, got {value!r}")


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """One candidate layout: its memory estimate, whether it fits and, if so, what it costs.

    ``reason`` says why an infeasible layout was rejected (None when feasible). Times are in
    seconds; ``bytes_moved`` / ``bytes_cross_host`` / ``reconfig_seconds`` describe the move
    from the current layout (None without one, for infeasible layouts, and for feasible ones
    whose step time alone is above the best score: they cannot win, so they are not planned).
    ``recompute``: the activation recomputation the layout needs to fit (``RECOMPUTE``);
    ``idle_gpus``: GPUs of the job the layout leaves as spares; ``micro_batches``: micro-batches
    of the most loaded DP replica (``batch_split`` gives every replica's).
    """

    cfg: ParallelConfig
    estimate: MemoryEstimate | None
    feasible: bool
    reason: str | None = None
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    bytes_moved: int | None = None
    bytes_cross_host: int | None = None
    reconfig_seconds: float | None = None
    score: float | None = None
    recompute: str = "none"
    idle_gpus: int = 0
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if self.feasible == (self.reason is not None):
            raise LayoutError(f"{self.cfg}: feasible={self.feasible} but reason={self.reason!r}; "
                             "exactly the infeasible choices carry a reason")

    @property
    def peak_bytes(self) -> int | None:
        return None if self.estimate is None else self.estimate.peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": str(self.cfg),
            "dp": self.cfg.dp,
            "tp": self.cfg.tp,
            "pp": self.cfg.pp,
            "feasible": self.feasible,
            "reason": self.reason,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "peak_bytes": self.peak_bytes,
            "peak_stage": None if self.estimate is None else self.estimate.peak_stage,
            "bytes_moved": self.bytes_moved,
            "bytes_cross_host": self.bytes_cross_host,
            "reconfig_seconds": self.reconfig_seconds,
            "score": self.score,
            "recompute": self.recompute,
            "idle_gpus": self.idle_gpus,
            "micro_batches": self.micro_batches,
        }


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_ints(**values: Any) -> None:
    """ConfigError naming the first of ``values`` that is not a positive integer."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_gpus(gpus: int) -> None:
    _positive_ints(gpus=gpus)
    if gpus > MAX_WORLD_SIZE:
        raise ConfigError(f"gpus={gpus} is more than the {MAX_WORLD_SIZE} GPUs a layout may have: check --gpus")


def batch_split(global_batch: int, micro_batch: int, dp: int) -> tuple[int, ...]:
    """Micro-batches of each DP replica when ``global_batch`` samples (a multiple of
    ``micro_batch``) are split over ``dp`` replicas as evenly as whole micro-batches allow:
    counts differ by at most one, the first replicas take the extra ones: the split the trainer's
    data follows (``tenplex.data.partition.replica_samples``). Pure."""
    if global_batch % micro_batch:
        raise LayoutError(f"global batch {global_batch} is not a multiple of micro_batch {micro_batch} "
                          f"({global_batch} % {micro_batch} = {global_batch % micro_batch})")
    total = global_batch // micro_batch
    if not 1 <= dp <= total:
        raise LayoutError(f"dp={dp} replicas cannot each take a micro-batch of the {total} in a global batch of "
                          f"{global_batch} (micro_batch {micro_batch})")
    return tuple(n // micro_batch for n in replica_samples(global_batch, dp, micro_batch))  # the data's split


def _structural_reason(spec: ModelSpec, cfg: ParallelConfig, *, global_batch: int, micro_batch: int,
                       gpus_per_host: int, uneven_batch: bool = False) -> str | None:
    """Why ``cfg`` cannot run the model or the batch at all (None if it can); memory is checked later."""
    assert spec.kv_heads is not None and spec.ffn_hidden is not None
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    for what, value in (("heads", spec.heads), ("kv_heads", spec.kv_heads), ("ffn_hidden", spec.ffn_hidden)):
        if value % tp:
            return f"tp={tp} does not divide {what}={value} ({value} % {tp} = {value % tp})"
    if tp > gpus_per_host:
        return f"tp={tp} spans hosts of {gpus_per_host} GPUs (TP must stay within a host)"
    if cfg.stages is not None:
        if sum(cfg.stages) != spec.num_layers:
            return (f"stages {'+'.join(map(str, cfg.stages))} = {sum(cfg.stages)} layers "
                    f"but the model has {spec.num_layers}")
    elif pp > spec.num_layers:
        return f"pp={pp} is more than the model's {spec.num_layers} layers"
    if uneven_batch:
        if global_batch % micro_batch:
            return f"global batch {global_batch} not divisible by micro_batch={micro_batch}"
        if dp * micro_batch > global_batch:
            return f"dp*micro_batch={dp}*{micro_batch}={dp * micro_batch} is more than the global batch {global_batch}"
    elif global_batch % (dp * micro_batch):
        return f"global batch {global_batch} not divisible by dp*micro_batch={dp}*{micro_batch}={dp * micro_batch}"
    return None


def _candidates(spec: ModelSpec, gpus: int, *, global_batch: int, micro_batch: int, gpus_per_host: int,
                allow_idle: bool = False, uneven_batch: bool = False) -> Iterator[tuple[ParallelConfig, str | None]]:
    """The layouts to consider, by tp then pp, with the reason each cannot run (None if it can).

    Default: every (dp, tp, pp) with dp*tp*pp == gpus. ``allow_idle``: every tp up to a host's
    GPUs and pp up to the model's layers, each with the most DP replicas that fit in ``gpus`` and
    take the batch (a divisor of its micro-batch count, or with ``uneven_batch`` any count up
    to it); the GPUs left over wait as spares. Replica counts tried per (tp, pp): the ends of
    the two ranges in which the step-time model is monotone in dp. With p stages and M
    micro-batches a step, compute x bubble is K/dp + const and DP traffic 2 G (1 - 1/dp) / bw,
    so the step is (K - 2 G / bw) / dp + const while bw stays the same: within the counts whose
    DP groups stay in a host (tp*dp divides it) and within those that span hosts the best is at
    an end (1 and the largest local count; the smallest spanning count and the most). Memory
    only falls with more replicas. tests/test_layouts.py checks this against brute force."""
    if not allow_idle:
        for tp in divisors(gpus):
            for pp in divisors(gpus // tp):
                cfg = ParallelConfig(dp=gpus // (tp * pp), tp=tp, pp=pp)
                yield cfg, _structural_reason(spec, cfg, global_batch=global_batch, micro_batch=micro_batch,
                                              gpus_per_host=gpus_per_host, uneven_batch=uneven_batch)
        return
    total = max(1, global_batch // micro_batch)
    for tp in range(1, min(gpus, gpus_per_host) + 1):
        for pp in range(1, min(spec.num_layers, gpus // tp) + 1):
            most = min(gpus // (tp * pp), total)
            counts = range(1, most + 1) if uneven_batch else divisors(total)
            counts = [d for d in counts if d <= most]

            def local(d: int, tp: int = tp, pp: int = pp) -> bool:  # DP groups (ranks tp-dp-pp) within a host
                return tp * d <= gpus_per_host and (pp == 1 or gpus_per_host % (tp * d) == 0)

            near = [d for d in counts if local(d)]
            far = [d for d in counts if not local(d)]
            ends = sorted({e for side in (near, far) if side for e in (side[0], side[-1])}, reverse=True)
            for dp in ends:
                cfg = ParallelConfig(dp=dp, tp=tp, pp=pp)
                yield cfg, _structural_reason(spec, cfg, global_batch=global_batch, micro_batch=micro_batch,
                                              gpus_per_host=gpus_per_host, uneven_batch=uneven_batch)


def valid_layouts(
    model: ModelSpec | str | PTC,
    gpus: int,
    *,
    global_batch: int,
    micro_batch: int,
    gpus_per_host: int = 8,
) -> list[ParallelConfig]:
    """Every layout of ``gpus`` GPUs the model and batch allow (memory not checked), by tp then pp.

    Valid: dp*tp*pp == gpus; tp divides heads, kv_heads and ffn_hidden and is at most a
    host's GPUs; pp at most the number of layers; global_batch divisible by dp*micro_batch.
    """
    spec = resolve_model(model)
    _check_gpus(gpus)
    _positive_ints(global_batch=global_batch, micro_batch=micro_batch, gpus_per_host=gpus_per_host)
    return [cfg for cfg, reason in _candidates(spec, gpus, global_batch=global_batch, micro_batch=micro_batch,
                                                gpus_per_host=gpus_per_host) if reason is None]


def _dp_spans_hosts(cfg: ParallelConfig, cp: int, gpus_per_host: int) -> bool:
    """True when some data-parallel group (ranks ordered tp-cp-dp-pp) has ranks on two hosts."""
    t, d = cfg.tp, cfg.dp * cp  # gradients are reduced over DP x CP
    first = (np.arange(cfg.pp) * t * d)[:, None] + np.arange(t)[None, :]  # each group's first rank
    return bool((first // gpus_per_host != (first + t * (d - 1)) // gpus_per_host).any())


def step_time(
    spec: ModelSpec,
    est: MemoryEstimate,
    *,
    global_batch: int,
    gpus_per_host: int,
    hardware: Hardware,
    micro_batches: int | None = None,
) -> tuple[float, dict[str, float]]:
    """Estimated seconds per training step of ``est``'s layout and the terms that make it up.

    compute = (6 N tokens + recomputation FLOPs, ``recompute_flops``) / (gpus flops); TP = per micro-batch and layer, sequence parallelism
    all-gathers and reduce-scatters an (s/c) x b x h activation 4 times forward and 4 times
    backward, each moving (t-1)/t of it, over NVLink. Both run inside the pipeline, so both
    are divided by (1 - bubble), bubble = (p-1)/(m+p-1). The DP gradient all-reduce
    2(d-1)/d x gradient bytes of the most loaded stage then runs over the network when the DP
    group spans hosts, else over NVLink. ``micro_batches``: those of the most loaded replica
    (default ``global_batch / (dp micro_batch)``); with an uneven split every replica runs as
    long as that one, so compute counts ``dp x micro_batches`` micro-batches.
    """
    cfg, cp = est.cfg, est.cp
    m = global_batch // (cfg.dp * est.micro_batch) if micro_batches is None else micro_batches
    layers = max(s.layers for s in est.stages)
    compute, tp_comm, bubble = _pipeline_terms(spec, cfg, cp, m, est.seq_len, est.micro_batch, est.precision,
                                               est.recompute, layers, hardware,
                                               global_batch if micro_batches is None else None)
    pipeline = (compute + tp_comm) / (1 - bubble)
    ranks = cfg.dp * cp
    grad = max(s.grad_bytes for s in est.stages)
    bw = hardware.inter_host_bw if _dp_spans_hosts(cfg, cp, gpus_per_host) else hardware.intra_host_bw
    dp_comm = 2 * (ranks - 1) / ranks * grad / bw
    terms = {"compute": compute, "tp_comm": tp_comm, "bubble": bubble, "dp_comm": dp_comm}
    return pipeline + dp_comm, terms


def _pipeline_terms(spec: ModelSpec, cfg: ParallelConfig, cp: int, m: int, seq_len: int, micro_batch: int,
                    precision: str, recompute: str, layers: int, hardware: Hardware,
                    global_batch: int | None = None) -> tuple[float, float, float]:
    """(compute, tp_comm, bubble) of ``step_time``: the terms that need no memory estimate.
    Tokens: ``global_batch`` sequences, else every replica's ``m`` micro-batches."""
    t, p, d = cfg.tp, cfg.pp, cfg.dp
    tokens = (d * m * micro_batch if global_batch is None else global_batch) * seq_len
    compute = (6 * spec.num_params() * tokens + recompute_flops(spec, tokens, recompute)) / (
        cfg.world_size * cp * hardware.flops)
    tp_bytes = 8 * (t - 1) / t * (seq_len / cp) * micro_batch * spec.hidden * PRECISIONS[precision][3]
    tp_comm = layers * m * tp_bytes / hardware.intra_host_bw
    return compute, tp_comm, (p - 1) / (m + p - 1)


def reconfig_time(moves: Plan, hardware: Hardware) -> float:
    """Seconds to carry out a plan: the slowest new rank's bytes over its links (ranks receive in parallel)."""
    c = moves.columns
    n = moves.new.world_size
    total = np.zeros(n)
    for kind, bw in ((SAME_HOST, hardware.intra_host_bw), (CROSS_HOST, hardware.inter_host_bw),
                     (STORAGE, hardware.storage_bw)):
        sel = c["kind"] == kind
        if sel.any():
            total += np.bincount(c["new_rank"][sel], weights=c["nbytes"][sel], minlength=n) / bw
    return float(total.max()) if n else 0.0


def _size_text(n: float, digits: str = ".1f") -> str:
    """92.1 GiB, 3.0 MiB: the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:{digits}} {unit}"
    return f"{n:.0f} B"


def _memory_reason(est: MemoryEstimate, gpu_mem: int, fraction: float) -> str | None:
    if est.fits(gpu_mem, fraction):
        return None
    i = est.peak_stage
    need = est.stages[i].total_bytes
    return (f"stage {i} needs {_size_text(need)} = {100 * need / gpu_mem:.0f}% of {_size_text(gpu_mem, '.4g')} "
            f"> {100 * fraction:.0f}%")


@dataclass(frozen=True, slots=True)
class LayoutSearch:
    """What ranks a job's layouts (:func:`rank_layouts`, :func:`choose_layout`): its batch and GPUs,
    the throughput model's constants and the search's options; validated here, once.

    ``gpu_mem``: bytes or a size such as ``"80GiB"`` (stored as bytes). ``cp``: context-parallel
    size (the layouts use ``gpus / cp`` ranks). ``mem_fraction``: the share of ``gpu_mem`` a stage
    may use. ``horizon_steps``: steps a reconfiguration's cost is amortised over. ``recompute``: a
    mode of ``RECOMPUTE``, or ``"auto"``: per layout the cheapest that fits. ``allow_idle``: also
    layouts that leave GPUs idle as spares (``LayoutChoice.idle_gpus``); ``uneven_batch``: replicas
    may take micro-batch counts that differ by one (``batch_split``).
    """

    gpu_mem: int | str
    global_batch: int
    seq_len: int
    micro_batch: int
    gpus_per_host: int = 8
    cp: int = 1
    distributed_optimizer: bool = True
    precision: str = "bf16"
    mem_fraction: float = 0.8
    horizon_steps: int = 1000
    hardware: Hardware = Hardware()
    recompute: str = "auto"
    allow_idle: bool = False
    uneven_batch: bool = False

    def __post_init__(self) -> None:
        _positive_ints(global_batch=self.global_batch, micro_batch=self.micro_batch, gpus_per_host=self.gpus_per_host,
                       cp=self.cp)
        object.__setattr__(self, "gpu_mem", parse_size(self.gpu_mem))
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.horizon_steps < 1:
            raise ConfigError(f"horizon_steps must be >= 1, got {self.horizon_steps}")
        if self.recompute != "auto" and self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be 'auto' or one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @classmethod
    def of(cls, search: LayoutSearch | None = None, **fields: Any) -> LayoutSearch:
        """``search`` with ``fields`` replaced, or a new one of ``fields``; ConfigError naming the fields
        for a missing or unknown one."""
        known = [f.name for f in fields_of(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ConfigError(f"unknown layout search options {unknown}; LayoutSearch has {', '.join(known)}")
        if search is not None:
            return replace(search, **fields) if fields else search
        missing = [f.name for f in fields_of(cls) if f.default is MISSING and f.name not in fields]
        if missing:
            raise ConfigError(f"ranking layouts needs {', '.join(missing)} (LayoutSearch's fields without a default)")
        return cls(**fields)

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The recomputation modes a layout tries, cheapest compute first."""
        return RECOMPUTE if self.recompute == "auto" else (self.recompute,)

    def micro_batches(self, cfg: ParallelConfig) -> int:
        """Micro-batches of ``cfg``'s most loaded replica (all equal when the split is even)."""
        return -(-self.global_batch // (cfg.dp * self.micro_batch))


def rank_layouts(
    model: ModelSpec | str | PTC,
    gpus: int,
    search: LayoutSearch | None = None,
    *,
    current: ParallelConfig | None = None,
    ptc: PTC | None = None,
    alive: list[int] | tuple[int, ...] | None = None,
    only: list[ParallelConfig] | None = None,
    best_only: bool = False,
    **options: Any,
) -> list[LayoutChoice]:
    """Every candidate layout of ``gpus`` GPUs: feasible ones best first, then the rejected ones.

    ``search``: a :class:`LayoutSearch`; ``options``: its fields (replacing ``search``'s, or making one).
    Feasible ones are sorted by ``step_seconds + reconfig_seconds / horizon_steps``; the
    reconfiguration cost is planned from ``current`` with ``ptc`` (built from the model, with
    Adam state, when not given) and ``alive``, in order of step time until no remaining
    layout can beat the best score. Rejected ones keep the enumeration order (tp, then pp) and
    say why in ``reason``. ``only``: evaluate these layouts (e.g. with uneven stages) instead of
    enumerating. ``best_only``: return only the best feasible layout, evaluating candidates in
    order of a bound on their step time until none left can beat it (what ``choose_layout``
    needs; much faster at thousands of GPUs); when none is feasible, every candidate as without it.
    """
    spec = resolve_model(model)
    _check_gpus(gpus)
    s = LayoutSearch.of(search, **options)
    if gpus % s.cp:
        raise LayoutError(f"cp={s.cp} does not divide {gpus} GPUs ({gpus} % {s.cp} = {gpus % s.cp})")
    if current is not None and ptc is None:
        ptc = model if isinstance(model, PTC) else model_ptc(spec, optimizer=True,
                                                             distributed_optimizer=s.distributed_optimizer)
    ranking = _Ranking(spec, gpus, s, current, ptc, alive)
    candidates = ranking.candidates(only)
    if best_only:
        top = ranking.best(candidates)
        if top is not None:
            log.info("%d GPUs: best %s of %d candidates", gpus, top.cfg, len(candidates))
            return [top]
    return ranking.all(candidates)


class _Ranking:
    """One ``rank_layouts`` call's candidates, their evaluation and their order."""

    def __init__(self, spec: ModelSpec, gpus: int, search: LayoutSearch, current: ParallelConfig | None,
                 ptc: PTC | None, alive: list[int] | tuple[int, ...] | None) -> None:
        self.spec, self.gpus, self.s = spec, gpus, search
        self.current, self.ptc, self.alive = current, ptc, alive

    def candidates(self, only: list[ParallelConfig] | None) -> list[tuple[ParallelConfig, str | None]]:
        """The layouts to evaluate with the reason each cannot run (None if it can)."""
        s, spec, gpus = self.s, self.spec, self.gpus
        shape = dict(global_batch=s.global_batch, micro_batch=s.micro_batch, gpus_per_host=s.gpus_per_host,
                     uneven_batch=s.uneven_batch)
        if only is None:
            return list(_candidates(spec, gpus // s.cp, allow_idle=s.allow_idle, **shape))
        out = []
        for cfg in only:
            if cfg.world_size * s.cp > gpus or (cfg.world_size * s.cp < gpus and not s.allow_idle):
                raise ConfigError(f"layout {cfg} with cp={s.cp} needs dp*tp*pp*cp = {cfg.world_size}*{s.cp} = "
                                  f"{cfg.world_size * s.cp} GPUs but there are {gpus}")
            out.append((cfg, _structural_reason(spec, cfg, **shape)))
        return out

    def evaluate(self, cfg: ParallelConfig, reason: str | None) -> LayoutChoice:
        """``cfg``'s memory estimate (the cheapest recomputation that fits) and step time."""
        s = self.s
        idle = self.gpus - cfg.world_size * s.cp
        if reason is not None:
            return LayoutChoice(cfg, None, False, reason, idle_gpus=idle)
        m = s.micro_batches(cfg)
        modes = s.recompute_modes
        for mode in modes:  # cheapest compute first
            est = estimate_memory(self.spec, cfg, seq_len=s.seq_len, micro_batch=s.micro_batch, cp=s.cp,
                                  distributed_optimizer=s.distributed_optimizer, num_microbatches=m,
                                  precision=s.precision, gpus_per_host=s.gpus_per_host, recompute=mode)
            reason = _memory_reason(est, s.gpu_mem, s.mem_fraction)  # type: ignore[arg-type]
            if reason is None:
                break
        step, _ = step_time(self.spec, est, global_batch=s.global_batch, gpus_per_host=s.gpus_per_host,
                            hardware=s.hardware, micro_batches=m)
        tps = s.global_batch * s.seq_len / step
        common: dict[str, Any] = dict(recompute=est.recompute, idle_gpus=idle, micro_batches=m)
        if reason is not None:
            if len(modes) > 1:
                reason += f" even with {est.recompute} recomputation"
            return LayoutChoice(cfg, est, False, reason, step, tps, **common)
        return LayoutChoice(cfg, est, True, None, step, tps, score=step, **common)

    def with_move(self, choice: LayoutChoice) -> LayoutChoice:
        """``choice`` with the cost of moving the state there from ``current`` added to its score."""
        assert self.ptc is not None and self.current is not None
        moves = plan(self.ptc, self.current, choice.cfg, alive=self.alive, gpus_per_host=self.s.gpus_per_host)
        seconds = reconfig_time(moves, self.s.hardware)
        return replace(choice, bytes_moved=moves.stats.bytes_moved, bytes_cross_host=moves.stats.bytes_cross_host,
                       reconfig_seconds=seconds,
                       score=choice.score + seconds / self.s.horizon_steps)  # type: ignore[operator]

    def bound(self, cfg: ParallelConfig) -> float:
        """A lower bound on ``cfg``'s step time: no DP traffic, the cheapest recomputation."""
        s = self.s
        layers = max(cfg.layers_per_stage(self.spec.num_layers))
        compute, tp_comm, bubble = _pipeline_terms(self.spec, cfg, s.cp, s.micro_batches(cfg), s.seq_len,
                                                   s.micro_batch, s.precision, s.recompute_modes[0], layers,
                                                   s.hardware)
        return (compute + tp_comm) / (1 - bubble)

    def best(self, candidates: list[tuple[ParallelConfig, str | None]]) -> LayoutChoice | None:
        """The best feasible layout, candidates evaluated in order of their bound until the bound
        reaches the best score (no later one can win); None when none is feasible."""
        valid = sorted((self.bound(cfg), i, cfg) for i, (cfg, reason) in enumerate(candidates) if reason is None)
        top: LayoutChoice | None = None
        for lower, _, cfg in valid:
            if top is not None and lower > top.score:  # type: ignore[operator]
                break
            choice = self.evaluate(cfg, None)
            if choice.feasible and self.current is not None and (top is None or choice.score < top.score):
                choice = self.with_move(choice)
            if choice.feasible and (top is None or (choice.score, choice.idle_gpus, cfg.tp, cfg.pp)
                                    < (top.score, top.idle_gpus, top.cfg.tp, top.cfg.pp)):
                top = choice
        return top

    def all(self, candidates: list[tuple[ParallelConfig, str | None]]) -> list[LayoutChoice]:
        """Every candidate evaluated: the feasible best first, then the rejected in enumeration order."""
        feasible: list[LayoutChoice] = []
        rejected: list[LayoutChoice] = []
        for cfg, reason in candidates:
            choice = self.evaluate(cfg, reason)
            (feasible if choice.feasible else rejected).append(choice)
        if self.current is not None:
            feasible.sort(key=lambda c: (c.score, c.cfg.tp, c.cfg.pp))
            best = float("inf")
            for i, choice in enumerate(feasible):
                if choice.step_seconds is not None and choice.step_seconds >= best:
                    break  # score >= step time: no later layout can beat the best any more
                feasible[i] = self.with_move(choice)
                best = min(best, feasible[i].score)  # type: ignore[type-var]
        feasible.sort(key=lambda c: (c.score, c.idle_gpus, c.cfg.tp, c.cfg.pp))
        log.info("%d GPUs: %d feasible layouts of %d candidates%s", self.gpus, len(feasible), len(candidates),
                 f", best {feasible[0].cfg}" if feasible else "")
        return feasible + rejected


def choose_layout(
    model: ModelSpec | str | PTC,
    gpus: int,
    search: LayoutSearch | None = None,
    *,
    pin: ParallelConfig | None = None,
    rank: Callable[[list[LayoutChoice]], list[LayoutChoice]] | None = None,
    **options: Any,
) -> LayoutChoice:
    """The best feasible layout of ``gpus`` GPUs (``search`` and ``options`` as for :func:`rank_layouts`).

    ``pin`` forces a layout: it is checked like any candidate (world size, model, batch,
    memory) and returned, or rejected with LayoutError. ``rank`` reorders (or filters) the
    feasible choices, best first, e.g. to prefer layouts that move fewer bytes. Raises
    LayoutError listing every rejection when nothing fits.
    """
    if pin is not None:
        (choice,) = rank_layouts(model, gpus, search, only=[pin], **options)
        if not choice.feasible:
            raise LayoutError(f"pinned layout {pin} cannot run: {choice.reason}")
        return choice
    choices = rank_layouts(model, gpus, search, best_only=rank is None, **options)
    feasible = [c for c in choices if c.feasible]
    if not feasible:
        reasons = "; ".join(f"{c.cfg}: {c.reason}" for c in choices)
        raise LayoutError(f"no layout of {gpus} GPUs fits {_name(model)}: {reasons}")
    if rank is not None:
        feasible = list(rank(list(feasible)))
        if not feasible:
            raise LayoutError("the rank function returned no layout")
        bad = [c for c in feasible if not isinstance(c, LayoutChoice) or not c.feasible]
        if bad:
            raise LayoutError(f"the rank function returned something other than a feasible LayoutChoice: {bad[0]!r}")
    best = feasible[0]
    log.info("chose %s for %d GPUs: %.3f s/step, peak %.1f GiB", best.cfg, gpus, best.step_seconds or 0.0,
             (best.peak_bytes or 0) / GiB)
    return best


def _name(model: object) -> str:
    if isinstance(model, str):
        return model
    spec = resolve_model(model)  # type: ignore[arg-type]
    return f"{spec.arch} L={spec.num_layers} h={spec.hidden}"
