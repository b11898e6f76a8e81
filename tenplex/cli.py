"""The ``tenplex`` command line.

Every bad input ends in one line ``tenplex CMD: error: <what went wrong and the fix>`` on
stderr and exit code 2 (argparse's convention): argument types check ranges and URLs up
front, and :func:`main` turns the library's errors about user input (``TenplexError``,
``ValueError``, ``OSError`` from paths and hosts) into that line. A traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .checkpoint import list_steps, read_manifest
from .checkpoint.auto_import import import_checkpoint
from .checkpoint.dcp_import import DcpNames
from .checkpoint.hf_export import export_hf
from .checkpoint.import_source import detect_format
from .data.hf import hf_dataset, hf_index
from .data.index import build_index, load_index
from .data.megatron import megatron_gpt_dataset, megatron_index
from .errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DataIndexError,
    PlanError,
    TenplexError,
)
from .layout.config import MAX_WORLD_SIZE, ParallelConfig
from .layout.models import model_ptc
from .planning.layouts import Hardware, LayoutSearch, rank_layouts
from .planning.memory import RECOMPUTE, estimate_memory, parse_size
from .planning.planner import locality_order, plan
from .planning.policies import (PolicyJob, PolicyResult, compare_policies, draw_failures,
                                policies_from_replay)
from .planning.schedule import demands, lower_bound, naive_bounds, schedule
from .planning.simulate import (CostModel, FailureEvent, SimulationResult, SimulationSettings, draw_trace,
                               plot_simulation, read_trace, simulate_trace)
from .planning.topology import Topology
from .store import StoreOptions, serve
from .urls import url_fs
from .vfs.control import remount
from .vfs.fuse import check_fuse, check_mountpoint, mount, spawn_mount
from .vfs.store_view import mount_store
from .vfs.tree import DataView

__all__ = ["main", "human_bytes", "parse_ranks", "parse_rank_ranges"]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parse_rank_ranges(text: str) -> tuple[range, ...]:
    """'0-3,6,8-9' -> (range(0, 4), range(6, 7), range(8, 10)): the ranks, not listed (``0-999999999`` is
    three numbers until checked against a world size); ``none`` is the empty list."""
    if text.strip().lower() == "none":
        return ()
    out: list[range] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot parse rank list {text!r}: use e.g. 0-3,6,8-9") from None
        if hi < lo:
            raise argparse.ArgumentTypeError(f"rank range {part} is empty: write the lower rank first ({hi}-{lo})")
        out.append(range(lo, hi + 1))
    if not out:
        raise argparse.ArgumentTypeError(f"rank list {text!r} names no rank: use e.g. 0-3,6 (or none for no survivor)")
    return tuple(out)


def parse_ranks(text: str, world_size: int | None = None) -> list[int]:
    """'0-3,6,8-9' -> [0, 1, 2, 3, 6, 8, 9]; with ``world_size`` every rank must be below it (checked
    before listing, so a typo such as 0-999999999 costs nothing)."""
    ranges = parse_rank_ranges(text)
    return _listed(ranges, world_size) if world_size is not None else [i for r in ranges for i in r]


def _listed(ranges: Sequence[range], world_size: int) -> list[int]:
    """The ranks of ``ranges`` after checking each lies in the old world ``[0, world_size)``."""
    for r in ranges:
        if r.start < 0 or r.stop > world_size:
            raise PlanError(f"--alive names rank {r.stop - 1 if r.stop > world_size else r.start}, outside the old "
                            f"world of {world_size} ranks [0, {world_size}): list survivors of the old layout")
    if sum(len(r) for r in ranges) > world_size:
        raise PlanError(f"--alive lists more ranks than the old world's {world_size}: list each survivor once")
    return [i for r in ranges for i in r]


def _layout(text: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except TenplexError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except TenplexError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value
    parse.__name__ = "int"
    return parse


def _float_in(lo: float, hi: float, *, lo_open: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi):
            raise argparse.ArgumentTypeError(f"{text} is outside {'(' if lo_open else '['}{lo}, {hi}]")
        return value
    parse.__name__ = "float"
    return parse


def _url(text: str) -> str:
    """An argparse type: a local path or an fsspec URL whose protocols are known and installed.

    Only the protocols are checked here: the filesystem is built by the command, with the
    ``--storage-option`` values it may need."""
    if not text:
        raise argparse.ArgumentTypeError("empty path: pass a local path or a URL")
    parts = text.split("::")
    try:
        for i, part in enumerate(parts):
            protocol = fsspec.core.split_protocol(part)[0] or (part if i < len(parts) - 1 else "file")
            fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"cannot use {text!r} ({e}): pass a local path or a URL of an installed "
                                         "fsspec protocol (file://, memory://, s3://, http://, ...)") from None
    return text


def _storage_option(text: str) -> tuple[str, object]:
    """An argparse type: ``KEY=VALUE`` of an fsspec storage option; VALUE is JSON when it parses
    (``anon=false``, ``client_kwargs={"region_name": "x"}``), else the string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE: write e.g. endpoint_url=http://127.0.0.1:5000 "
                                         "or anon=false")
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"option name {key!r} is not a keyword name (letters, digits, _): "
                                         "use the filesystem's parameter name, e.g. endpoint_url")
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _add_storage_option(p: argparse.ArgumentParser, flag: str, dest: str, what: str) -> None:
    p.add_argument(flag, dest=dest, type=_storage_option, action="append", default=[], metavar="KEY=VALUE",
                   help=f"fsspec storage option of {what}, repeatable; VALUE is read as JSON when it parses, "
                        f"else as a string (e.g. {flag} endpoint_url=http://127.0.0.1:5000 {flag} anon=false)")


def _storage_options(pairs: Sequence[tuple[str, object]], flag: str) -> dict[str, object]:
    """The options of repeated ``flag KEY=VALUE`` arguments (a key given twice is an error)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{flag} {key} is given twice ({json.dumps(out[key])} and {json.dumps(value)}): "
                              "give each option once")
        out[key] = value
    return out


def _given(**flags: dict[str, object]) -> str:
    """'--storage-option a, --out-storage-option b' for the options given (keyword: flag name with _)."""
    return ", ".join(f"--{flag.replace('_', '-')} {key}" for flag, opts in flags.items() for key in opts)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_in_package(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


@contextmanager
def _storage_errors(given: str) -> Iterator[None]:
    """A TypeError raised inside a filesystem library while storage options were given (``given``,
    from ``_given``): the options are what it refused (e.g. aiohttp's "unexpected keyword argument")."""
    try:
        yield
    except TypeError as e:
        if not given or _raised_in_package(e):
            raise
        raise ConfigError(f"the filesystem refused the storage options {given} ({e}): pass only parameters its "
                          "fsspec implementation takes") from e


_POS = _int_in(1, MAX_WORLD_SIZE)
_STEP = _int_in(0, (1 << 63) - 1)


def _cmd_estimate(args: argparse.Namespace) -> int:
    cfg = args.layout or ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp)
    est = estimate_memory(args.model, cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, cp=args.cp,
                          distributed_optimizer=not args.no_distributed_optimizer,
                          num_microbatches=args.num_microbatches, precision=args.precision,
                          recompute=args.recompute)
    limit = args.mem_fraction * args.gpu_mem
    if args.json:
        out = est.to_json()
        out["gpu_mem"] = args.gpu_mem
        out["mem_fraction"] = args.mem_fraction
        out["fits"] = est.fits(args.gpu_mem, args.mem_fraction)
        for s in out["stages"]:
            s["fraction"] = s["total_bytes"] / args.gpu_mem
            s["feasible"] = s["total_bytes"] <= limit
        print(json.dumps(out))
        return 0
    print(f"{args.model}: {cfg}, cp={args.cp}, seq {args.seq_len}, micro-batch {args.micro_batch}, "
          f"{est.num_microbatches} micro-batches, {args.precision}, recompute {args.recompute}, "
          f"{'distributed' if not args.no_distributed_optimizer else 'replicated'} optimizer; "
          f"GPU {human_bytes(args.gpu_mem)}, limit {args.mem_fraction:.0%}")
    head = ("stage", "layers", "params", "weights", "grads", "optimizer", "activations", "total", "of GPU", "fits")
    print("  " + f"{head[0]:>5} {head[1]:>6} {head[2]:>14} " + " ".join(f"{h:>12}" for h in head[3:8])
          + f" {head[8]:>7} {head[9]:>5}")
    for s in est.stages:
        cells = (s.param_bytes, s.grad_bytes, s.optimizer_bytes, s.activation_bytes, s.total_bytes)
        print("  " + f"{s.stage:>5} {s.layers:>6} {s.params:>14,} " + " ".join(f"{human_bytes(c):>12}" for c in cells)
              + f" {s.total_bytes / args.gpu_mem:>7.0%} {'yes' if s.total_bytes <= limit else 'NO':>5}")
    first = est.stages[0]
    print(f"  activations per layer and micro-batch: {human_bytes(first.activation_bytes_per_layer)}; "
          f"peak {human_bytes(est.peak_bytes)} on stage {est.peak_stage}: "
          f"{'fits' if est.fits(args.gpu_mem, args.mem_fraction) else 'does NOT fit'}")
    return 0


def _cmd_configs(args: argparse.Namespace) -> int:
    hw = Hardware(flops=args.flops, intra_host_bw=args.intra_host_bw, inter_host_bw=args.inter_host_bw)
    search = LayoutSearch(gpu_mem=args.gpu_mem, global_batch=args.global_batch, seq_len=args.seq_len,
                          micro_batch=args.micro_batch, gpus_per_host=args.gpus_per_host, cp=args.cp,
                          distributed_optimizer=not args.no_distributed_optimizer, precision=args.precision,
                          horizon_steps=args.horizon_steps, hardware=hw, recompute=args.recompute,
                          allow_idle=args.allow_idle, uneven_batch=args.uneven_batch)
    choices = rank_layouts(args.model, args.gpus, search, current=args.from_)
    feasible = [c for c in choices if c.feasible]
    if args.json:
        out = {"model": args.model, "gpus": args.gpus, "gpu_mem": args.gpu_mem, "global_batch": args.global_batch,
               "seq_len": args.seq_len, "micro_batch": args.micro_batch, "cp": args.cp,
               "from": str(args.from_) if args.from_ else None,
               "best": str(feasible[0].cfg) if feasible else None,
               "layouts": [c.to_json() for c in choices]}
        print(json.dumps(out))
        return 0 if feasible else 1
    print(f"{args.model} on {args.gpus} GPUs ({args.gpus_per_host} per host, {human_bytes(args.gpu_mem)} each), "
          f"global batch {args.global_batch}, seq {args.seq_len}, micro-batch {args.micro_batch}"
          + (f", from {args.from_}" if args.from_ else ""))
    if feasible:
        moved = args.from_ is not None
        print(f"  {'#':>3} {'layout':<22} {'step':>9} {'tokens/s':>12} {'peak':>12} {'of GPU':>7} {'recompute':>9} "
              f"{'idle':>5}" + (f" {'moved':>12} {'cross-host':>12} {'reconfig':>9}" if moved else ""))
        for i, c in enumerate(feasible, 1):
            assert c.step_seconds is not None and c.tokens_per_second is not None and c.peak_bytes is not None
            line = (f"  {i:>3} {str(c.cfg):<22} {c.step_seconds:>8.3f}s {c.tokens_per_second:>12,.0f} "
                    f"{human_bytes(c.peak_bytes):>12} {c.peak_bytes / args.gpu_mem:>7.0%} {c.recompute:>9} "
                    f"{c.idle_gpus:>5}")
            if moved:
                line += (f" {human_bytes(c.bytes_moved or 0):>12} {human_bytes(c.bytes_cross_host or 0):>12} "
                         f"{c.reconfig_seconds or 0:>8.2f}s")
            print(line)
    else:
        print("  no layout fits")
    rejected = [c for c in choices if not c.feasible]
    if rejected:
        print("  rejected:")
        for c in rejected:
            print(f"      {str(c.cfg):<22} {c.reason}")
    return 0 if feasible else 1


def _cmd_plan(args: argparse.Namespace) -> int:
    ptc = model_ptc(args.model, optimizer=not args.no_optimizer, distributed_optimizer=args.distributed_optimizer)
    alive = None if args.alive is None else _listed(args.alive, args.from_.world_size)
    if args.locality:
        survivors = alive if alive is not None else list(range(min(args.from_.world_size, args.to.world_size)))
        alive = locality_order(ptc, args.from_, args.to, survivors)
    result = plan(ptc, args.from_, args.to, alive=alive, gpus_per_host=args.gpus_per_host)
    s = result.stats
    if args.json:
        out = {"model": args.model, "from": str(args.from_), "to": str(args.to), **s.to_json()}
        print(json.dumps(out))
        return 0
    rows = [
        ("bytes needed", s.bytes_needed),
        ("kept local", s.bytes_local),
        ("moved within hosts", s.bytes_same_host),
        ("moved across hosts", s.bytes_cross_host),
        ("from storage", s.bytes_storage),
        ("moved (total)", s.bytes_moved),
        ("lower bound", s.bytes_lower_bound),
        ("max sent by one old rank", s.max_send_bytes),
        ("max received by one new rank", s.max_recv_bytes),
    ]
    print(f"{args.model}: {args.from_} ({args.from_.world_size} GPUs) -> {args.to} ({args.to.world_size} GPUs), "
          f"{len(ptc)} tensors, {human_bytes(ptc.nbytes)}")
    for label, value in rows:
        print(f"  {label:<30} {human_bytes(value):>12}")
    print(f"  {'moves':<30} {s.num_moves:>12}")
    print(f"  {'plan time':<30} {s.plan_seconds:>11.3f}s")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.trace:
        trace = read_trace(args.trace)
    elif args.mttf:
        trace = draw_failures(args.gpus, 24.0 * args.days, seed=args.seed)
    else:
        trace = draw_trace(days=args.days, failures=args.failures, seed=args.seed)
    costs = CostModel(restart_s=args.restart_s, ckpt_interval_h=args.ckpt_interval_h, storage_bw=args.storage_bw)
    say = None if args.json else (lambda line: print(line, flush=True))
    if say:
        print(f"{args.model} on {args.gpus} GPUs ({args.gpus_per_host} per host, {args.spare_hosts} spare hosts): "
              f"{len(trace)} interruptions over {args.days if not args.trace else 'the trace'} days", flush=True)
    settings = SimulationSettings(args.model, args.gpus, args.global_batch, args.seq_len,
                                  gpus_per_host=args.gpus_per_host, spare_hosts=args.spare_hosts,
                                  hours=None if args.trace else 24.0 * args.days, micro_batch=args.micro_batch,
                                  gpu_mem=args.gpu_mem, topology=args.topology, costs=costs,
                                  schedule_limit=args.schedule_limit, seed=args.seed, layout=args.layout)
    res = simulate_trace(trace, settings, progress=say)
    if args.plot:
        plot_simulation(res, args.plot)
    compared = _compare_policies(args, trace, settings, res) if args.policies else None
    if args.json:
        out = res.to_json()
        if compared is not None:
            out["policies"] = {name: r.to_json() for name, r in compared.items()}
        print(json.dumps(out))
        return 0
    print(f"goodput: tenplex in-process {res.goodput_tenplex:.4f}, tenplex restart {res.goodput_tenplex_restart:.4f}, "
          f"checkpoint restart {res.goodput_checkpoint_restart:.4f} (simulated in {res.simulate_s:.1f} s)")
    for r in (compared or {}).values():
        committed = "" if r.committed is None else f", {r.committed:.3f} of steps committed"
        print(f"  policy {r.name:<22} goodput {r.goodput:.4f}, stalled {r.stalled_h:.2f} h{committed}")
    return 0


def _compare_policies(args: argparse.Namespace, trace: list[FailureEvent], settings: SimulationSettings,
                      res: SimulationResult) -> dict[str, PolicyResult]:
    """``--policies``: the five policies on the replay's trace, with the costs the replay measured
    (tenplex.planning.policies.policies_from_replay)."""
    c = settings.costs
    policies = policies_from_replay(res, restart_s=c.restart_s, detect_s=c.detect_s, interval_h=c.ckpt_interval_h,
                                    groups=ParallelConfig.parse(res.layout).dp,
                                    heal_s=res.ckpt_load_s * c.storage_bw / c.host_store_bw, swap_s=args.standby_swap_s)
    job = PolicyJob(settings.gpus, res.hours, max(res.step_s, 1e-3), gpus_per_host=settings.gpus_per_host,
                    spare_hosts=settings.spare_hosts, classes=settings.classes)
    return compare_policies(trace, job, policies, seed=settings.seed)


def _cmd_schedule(args: argparse.Namespace) -> int:
    import scipy.optimize  # noqa: F401  (loaded here so that solve_s times the solve, not imports)
    import scipy.sparse.csgraph  # noqa: F401

    if args.topology.endswith(".json"):
        try:
            topo = Topology.from_json(args.topology)
        except TenplexError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # raw errors of a malformed file
            raise ConfigError(f"topology JSON {args.topology} is malformed ({type(e).__name__}: {e}): give "
                              "{\"spec\": \"hosts=..,gpus=..\"} or gpus_per_host, nodes and links "
                              "(docs/schedule.md)") from None
    else:
        topo = Topology.from_spec(args.topology)
    ptc = model_ptc(args.model, optimizer=not args.no_optimizer, distributed_optimizer=args.distributed_optimizer)
    gph = args.gpus_per_host or topo.gpus_per_host
    alive = None if args.alive is None else _listed(args.alive, args.from_.world_size)
    result = plan(ptc, args.from_, args.to, alive=alive, gpus_per_host=gph)
    need = max(args.from_.world_size, int(result.devices.max()) + 1 if len(result.devices) else 0)
    if need > topo.num_gpus:
        raise PlanError(f"the move uses {need} devices (old layout {args.from_} on devices "
                        f"0..{args.from_.world_size - 1}, new layout {args.to} up to device "
                        f"{int(result.devices.max())}) but the topology has "
                        f"{topo.num_gpus} GPUs: pass a topology with at least {need} GPUs "
                        f"(e.g. hosts={-(-need // topo.gpus_per_host)},gpus={topo.gpus_per_host})")
    s = schedule(result, topo, method=args.method, time_limit=args.time_limit, chunk_bytes=args.chunk_bytes)
    # the naive figures the scheduler found (auto), else computed here in the same time limit
    if "naive_s" in s.info:
        naive_lo = naive_hi = s.info["naive_s"]
    elif "naive_bounds_s" in s.info:
        naive_lo, naive_hi = s.info["naive_bounds_s"]
    else:
        naive_lo, naive_hi = naive_bounds(result, topo, deadline=time.perf_counter() + args.time_limit)
    if s.method == "naive":  # its completion is the naive one
        done_lo, done_hi = naive_lo, naive_hi
    else:
        done_lo = done_hi = s.completion_s
    completion = done_hi if done_lo == done_hi else None
    naive = naive_hi if naive_lo == naive_hi else None
    lb = s.info.get("lower_bound_s")
    if lb is None:  # the scheduler had no time to group the plan into demands (issue #20): here, after it
        lb = lower_bound(demands(result, topo), topo)
    rounds = s.num_epochs
    if args.json:
        out = {"model": args.model, "from": str(args.from_), "to": str(args.to), "topology": topo.name,
               "completion_s": completion, "naive_s": naive, "lower_bound_s": lb, "solve_s": s.solve_seconds,
               **({} if completion is not None else {"completion_bounds_s": [done_lo, done_hi]}),
               **({} if naive is not None else {"naive_bounds_s": [naive_lo, naive_hi]}),
               "method": s.method, "rounds": rounds, "bytes_moved": result.stats.bytes_moved,
               "bytes_sent_once": s.demands.bytes_unique, **{k: v for k, v in s.to_json().items()
                                                           if k not in ("method", "solve_s", "lower_bound_s")}}
        print(json.dumps(out))
        return 0
    print(f"{args.model}: {args.from_} -> {args.to} on {topo!r}")
    print(f"  {'moved':<26} {human_bytes(result.stats.bytes_moved):>12} "
          f"({human_bytes(s.demands.bytes_unique)} distinct, multicast)")
    print(f"  {'commodities / chunks':<26} {len(s.demands.commodities):>5} / {len(s.chunk_nbytes)} of "
          f"{human_bytes(s.chunk_bytes)}")
    print(f"  {'method':<26} {s.method:>12}")
    print(f"  {'completion':<26} {_ms(done_lo, done_hi)}  ({rounds} rounds of {s.tau * 1e3:.3f} ms)")
    print(f"  {'naive (all at once)':<26} {_ms(naive_lo, naive_hi)}" +
          (f"  ({naive / completion:.2f}x)" if completion and naive is not None else ""))
    print(f"  {'lower bound':<26} {lb * 1e3:>10.2f}ms" + (f"  (completion {completion / lb:.3f}x)"
                                                          if lb and completion is not None else ""))
    print(f"  {'solve time':<26} {s.solve_seconds * 1e3:>10.2f}ms")
    return 0


def _ms(lo: float, hi: float) -> str:
    """Seconds as milliseconds, or their range where only bounds are known (a computation cut short)."""
    return f"{hi * 1e3:>10.2f}ms" if lo == hi else f"{lo * 1e3:.2f} to {hi * 1e3:.2f}ms (bounds: cut short at the time limit)"


@contextmanager
def _checkpoint_errors(url: str) -> Iterator[None]:
    """One error naming ``url`` for raw exceptions of the checkpoint reader on a damaged checkpoint (e.g. a
    manifest that is JSON of another shape: TypeError, KeyError)."""
    try:
        yield
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        raise CheckpointCorruptError(f"the checkpoint under {url} is damaged or not a tenplex checkpoint "
                                     f"({type(e).__name__}: {e}); use an earlier step or save it again") from e


def _cmd_inspect(args: argparse.Namespace) -> int:
    opts = _storage_options(args.storage_option, "--storage-option")
    fs, path = url_fs(args.url, opts, options="--storage-option")
    if isinstance(fs, LocalFileSystem) and not fs.exists(path):
        raise CheckpointNotFoundError(f"{args.url} does not exist: check the path")
    with _checkpoint_errors(args.url), _storage_errors(_given(storage_option=opts)):
        return _inspect(args, opts)


def _inspect(args: argparse.Namespace, opts: dict[str, object]) -> int:
    steps = list_steps(args.url, storage_options=opts)
    if not steps:
        print(f"no checkpoint steps under {args.url}", file=sys.stderr)
        return 1
    summary = []
    for info in steps:
        summary.append({"step": info.step, "complete": info.complete, "layout": str(info.layout) if info.layout else None,
                        "world_size": info.world_size, "ranks_done": info.ranks_done, "data_bytes": info.nbytes,
                        "problem": info.problem or None})
    complete = [i.step for i in steps if i.complete]
    damaged = [i for i in steps if i.problem]
    if not complete and damaged:  # nothing loadable: say why, as an error (exit 2)
        raise CheckpointCorruptError(f"no usable step under {args.url}: " + "; ".join(
            f"step {i.step} ({i.save_id}): {i.problem}" for i in damaged[-3:]))
    manifest = None
    if args.step is not None or complete:
        manifest = read_manifest(args.url, args.step, storage_options=opts)
    if args.json:
        out: dict[str, object] = {"url": args.url, "steps": summary}
        if manifest is not None:
            ptc = manifest["ptc"]
            out["step"] = manifest["step"]
            out["tensors"] = {n: {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                                  "bytes": s.nbytes} for n, s in ptc.tensors.items()}
        print(json.dumps(out))
        return 0
    print(f"{args.url}")
    print(f"  {'step':>10}  {'complete':<8}  {'layout':<24} {'ranks':>9}  {'data':>12}")
    for s in summary:
        ranks = f"{s['ranks_done']}/{s['world_size'] if s['world_size'] is not None else '?'}"
        print(f"  {s['step']:>10}  {'yes' if s['complete'] else 'NO':<8}  {s['layout'] or '?':<24} {ranks:>9}  "
              f"{human_bytes(s['data_bytes']):>12}" + (f"  unusable: {s['problem']}" if s["problem"] else ""))
    if manifest is not None:
        ptc = manifest["ptc"]
        model = ptc.meta.get("model", {})
        print(f"step {manifest['step']}: layout {manifest['layout']}, {len(ptc)} tensors, {human_bytes(ptc.nbytes)}"
              + (f", model {model.get('arch')} L={model.get('num_layers')} h={model.get('hidden')}" if model else ""))
        if ptc.objects:
            print(f"  objects: {', '.join(ptc.objects)}")
        names = list(ptc.tensors) if args.tensors else sorted(ptc.tensors, key=lambda n: -ptc.tensors[n].nbytes)[:10]
        if not args.tensors:
            print("  largest tensors (--tensors lists all):")
        for n in names:
            s = ptc.tensors[n]
            print(f"  {n:<50} {str(list(s.shape)):<16} {str(s.dtype).removeprefix('torch.'):<9} {human_bytes(s.nbytes):>12}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    hf_config = None
    if args.hf_config:
        try:
            with open(args.hf_config) as f:
                hf_config = json.load(f)
        except OSError as e:
            raise TenplexError(f"cannot read --hf-config {args.hf_config}: {e.strerror or e}; pass the "
                               "checkpoint's config.json") from None
        except ValueError as e:
            raise TenplexError(f"--hf-config {args.hf_config} is not JSON ({e}); pass the checkpoint's "
                               "config.json") from None
        if not isinstance(hf_config, dict):
            raise TenplexError(f"--hf-config {args.hf_config} holds a {type(hf_config).__name__}, not a JSON object; "
                               "pass the checkpoint's config.json")
    src_opts = _storage_options(args.source_storage_option, "--source-storage-option")
    opts = _storage_options(args.storage_option, "--storage-option")
    url_fs(args.src, src_opts, options="--source-storage-option")
    url_fs(args.dst, opts, options="--storage-option")
    kw: dict = {"layout": args.layout, "step": args.step, "storage_options": opts,
                "source_storage_options": src_opts}
    fmt = args.format
    if fmt == "auto":
        with _storage_errors(_given(source_storage_option=src_opts)):
            fmt = detect_format(args.src, storage_options=src_opts)
    if fmt == "dcp":
        kw["names"] = DcpNames(model=args.model, hf_config=hf_config, strip_prefix=args.strip_prefix,
                               keep_partitioning=args.keep_partitioning)
    with _storage_errors(_given(source_storage_option=src_opts, storage_option=opts)):
        res = import_checkpoint(args.src, args.dst, fmt=fmt, **kw)
    if args.json:
        print(json.dumps({"format": res.source_format, "url": res.url, "layout": str(res.layout),
                          "step": res.step, "tensors": res.tensors, "bytes_written": res.nbytes}))
    else:
        print(f"imported {args.src} ({res.source_format}, {res.tensors} tensors) into {res.url} "
              f"step {res.step} under {res.layout}: {human_bytes(res.nbytes)} written")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    opts = _storage_options(args.storage_option, "--storage-option")
    out_opts = _storage_options(args.out_storage_option, "--out-storage-option")
    url_fs(args.src, opts, options="--storage-option")
    url_fs(args.dst, out_opts, options="--out-storage-option")
    with _checkpoint_errors(args.src), _storage_errors(_given(storage_option=opts, out_storage_option=out_opts)):
        path = export_hf(args.src, args.dst, step=args.step, storage_options=opts, out_storage_options=out_opts)
    print(f"exported {args.src} to {path} (Hugging Face safetensors, config.json beside it)")
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex plan``."""
    p = sub.add_parser("plan", help="plan the move of a model's state between two layouts")
    p.add_argument("--model", required=True, help="model preset, e.g. gpt3-175b, llama3-8b, tiny")
    p.add_argument("--from", dest="from_", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--to", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--alive", type=parse_rank_ranges, default=None,
                   help="old ranks whose devices survive, e.g. 0-5,8 (default: the first new-world-size)")
    p.add_argument("--gpus-per-host", type=_POS, default=8)
    p.add_argument("--locality", action="store_true",
                   help="place new ranks on the survivors that already hold most of their state")
    _add_state_options(p)
    p.set_defaults(func=_cmd_plan)


def _add_state_options(p: argparse.ArgumentParser) -> None:
    """The options ``plan`` and ``schedule`` share: which state the model carries, and JSON output."""
    p.add_argument("--no-optimizer", action="store_true", help="parameters only, no Adam state")
    p.add_argument("--distributed-optimizer", action="store_true", help="optimizer state sharded across DP")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_estimate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex estimate``."""
    p = sub.add_parser("estimate", help="estimate per-GPU memory of every pipeline stage of a layout")
    p.add_argument("--model", required=True, help="model preset, e.g. llama3-8b")
    p.add_argument("--layout", type=_layout, default=None, metavar="LAYOUT",
                   help="dp=..,tp=..,pp=..[,stages=A+B] (instead of --dp/--tp/--pp; allows uneven stages)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--num-microbatches", type=int, default=None, help="micro-batches per step (default: pp)")
    p.add_argument("--gpu-mem", type=_size, default=_size("80GiB"), help="GPU memory, e.g. 80GiB, 80GB (default 80GiB)")
    p.add_argument("--mem-fraction", type=_float_in(0, 1), default=0.8,
                   help="usable fraction of GPU memory, in (0, 1] (default 0.8)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="activation recomputation: none, selective (norms, MLP activation) or full (default none)")
    p.add_argument("--no-distributed-optimizer", action="store_true", help="optimizer state replicated across DP")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_estimate)


def _add_configs_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex configs``."""
    p = sub.add_parser("configs",
                       help="list the layouts of N GPUs: ranked by estimated speed, rejected ones with the reason")
    p.add_argument("--model", required=True, help="model preset, e.g. llama3-70b")
    p.add_argument("--gpus", type=_POS, required=True)
    p.add_argument("--gpu-mem", type=_size, required=True, help="GPU memory, e.g. 80GiB, 80GB")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--gpus-per-host", type=_POS, default=8)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--from", dest="from_", type=_layout, default=None, metavar="LAYOUT",
                   help="current layout: also plan the move of the state to each candidate")
    p.add_argument("--horizon-steps", type=int, default=1000, help="steps over which a move's cost is amortised")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--no-distributed-optimizer", action="store_true", help="optimizer state replicated across DP")
    p.add_argument("--flops", type=float, default=400e12, help="effective FLOP/s per GPU")
    p.add_argument("--intra-host-bw", type=float, default=300e9, help="bytes/s within a host")
    p.add_argument("--inter-host-bw", type=float, default=50e9, help="bytes/s between hosts, per GPU")
    p.add_argument("--recompute", choices=("auto", *RECOMPUTE), default="auto",
                   help="activation recomputation; auto: per layout the cheapest that fits (default)")
    p.add_argument("--allow-idle", action="store_true",
                   help="also layouts that leave some of the GPUs idle as spares")
    p.add_argument("--uneven-batch", action="store_true",
                   help="DP replicas may take micro-batch counts that differ by one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_configs)


def _add_schedule_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex schedule``."""
    p = sub.add_parser("schedule", help="schedule a plan's transfers over a cluster topology (TE-CCL style)")
    p.add_argument("--model", required=True, help="model preset, e.g. gpt3-2.7b")
    p.add_argument("--from", dest="from_", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--to", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--topology", required=True,
                   help="spec (hosts=4,gpus=8,nvlink=300GB/s,pcie=32GB/s,nic=50GB/s) or a .json file")
    p.add_argument("--alive", type=parse_rank_ranges, default=None,
                   help="old ranks whose devices survive, e.g. 0-5,8 (default: the first new-world-size)")
    p.add_argument("--method", choices=("auto", "milp", "lp", "greedy"), default="auto")
    p.add_argument("--time-limit", type=_float_in(0, 86400), default=10.0,
                   help="seconds the scheduler may take (default 10)")
    p.add_argument("--chunk-bytes", type=_size, default=None, help="chunk size, e.g. 16MiB (default: automatic)")
    p.add_argument("--gpus-per-host", type=_POS, default=None, help="default: the topology's")
    _add_state_options(p)
    p.set_defaults(func=_cmd_schedule)


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex simulate``."""
    p = sub.add_parser("simulate", help="replay a failure trace on a large job: layouts, planning, goodput")
    p.add_argument("--model", default="llama3-405b", help="model preset (default llama3-405b)")
    p.add_argument("--gpus", type=_POS, default=16384, help="GPUs of the job (default 16384)")
    p.add_argument("--layout", type=_layout, default=None, metavar="LAYOUT",
                   help="starting layout, e.g. dp=128,tp=8,pp=16 (default: the chooser's best)")
    p.add_argument("--gpus-per-host", type=_POS, default=8)
    p.add_argument("--spare-hosts", type=_int_in(0, MAX_WORLD_SIZE), default=16, help="spare hosts (default 16)")
    p.add_argument("--global-batch", type=_POS, default=2048, help="sequences per step (default 2048)")
    p.add_argument("--seq-len", type=_POS, default=8192)
    p.add_argument("--micro-batch", type=_POS, default=1)
    p.add_argument("--gpu-mem", type=_size, default=_size("80GiB"))
    p.add_argument("--trace", default=None, help="JSON-lines trace ({\"time_h\": .., \"cause\": ..} per line); "
                   "default: drawn from the Llama 3 rates")
    p.add_argument("--days", type=_float_in(0, 3650), default=54.0, help="length of a drawn trace (default 54)")
    p.add_argument("--failures", type=_int_in(0, 10**6), default=419, help="interruptions of a drawn trace (419)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mttf", action="store_true",
                   help="draw the trace at the rate of the MTTF curve fitted to Meta's points for --gpus "
                        "(tenplex.planning.policies.meta_mttf) instead of --failures")
    p.add_argument("--topology", default="nvlink=300GB/s,pcie=32GB/s,nic=50GB/s",
                   help="link bandwidths (hosts and gpus come from the job)")
    p.add_argument("--restart-s", type=_float_in(0, 86400, lo_open=False), default=120.0,
                   help="seconds to relaunch every process (restart paths; default 120)")
    p.add_argument("--ckpt-interval-h", type=_float_in(0, 1000), default=1.0,
                   help="persistent checkpoint interval of the baseline (default 1 h)")
    p.add_argument("--storage-bw", type=_size, default=_size("5GB"), help="per-GPU storage read bytes/s (5GB)")
    p.add_argument("--schedule-limit", type=_float_in(0, 600), default=10.0, help="scheduler time limit (10 s)")
    p.add_argument("--plot", default=None, help="write a PNG of world size and goodput over time")
    p.add_argument("--policies", action="store_true",
                   help="also replay the trace under the five policies side by side (tenplex in-process and restart "
                        "path, checkpoint restart, torchft-style replica groups, standby spares) with the costs the "
                        "replay measured")
    p.add_argument("--standby-swap-s", type=_float_in(0, 86400, lo_open=False), default=20.0,
                   help="seconds a standby host takes over a failed one's role (--policies; default 20, TrainMover's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_simulate)


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex inspect``."""
    p = sub.add_parser("inspect", help="list a checkpoint's steps, layouts, completeness and tensors")
    p.add_argument("url", type=_url, help="checkpoint URL (local path, memory://, s3://, ...)")
    p.add_argument("--step", type=_STEP, default=None, help="step to describe (default: latest complete)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    _add_storage_option(p, "--storage-option", "storage_option", "the checkpoint URL")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_inspect)


def _add_import_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex import``."""
    p = sub.add_parser("import", help="import a DCP or Hugging Face (Llama, GPT-2) checkpoint as a tenplex checkpoint")
    p.add_argument("src", type=_url, help="DCP checkpoint directory, HF model directory or .safetensors file "
                                         "(local path or URL)")
    p.add_argument("dst", type=_url, help="tenplex checkpoint URL to write")
    p.add_argument("--format", choices=("auto", "dcp", "hf"), default="auto")
    p.add_argument("--layout", type=_layout, default=ParallelConfig(), metavar="LAYOUT",
                   help="layout to save under (default dp=1,tp=1,pp=1; loads under any layout)")
    p.add_argument("--step", type=_STEP, default=None,
                   help="step number of the imported checkpoint (default: the source's, from its directory name "
                        "step-N (torchtitan), checkpoint-N (HF Trainer) or global_stepN, else a torchtitan DCP "
                        "checkpoint's train_state.step; else 0)")
    p.add_argument("--model", default=None,
                   help="DCP: model preset whose tenplex-named tensors the checkpoint holds (e.g. tiny)")
    p.add_argument("--hf-config", default=None, help="DCP: config.json of a checkpoint holding Hugging Face names")
    p.add_argument("--strip-prefix", default="", help="DCP: prefix removed from every tensor name, e.g. model.")
    p.add_argument("--keep-partitioning", action=argparse.BooleanOptionalAction, default=None,
                   help="DCP: keep the checkpoint's own chunks (one part per DCP file; load with "
                        "tenplex.load_state_dict under any mesh). Default: on unless --model or --hf-config is "
                        "given or the names are Hugging Face's; --no-keep-partitioning imports whole tensors "
                        "under --layout (replicated unless --model)")
    _add_storage_option(p, "--storage-option", "storage_option", "the tenplex checkpoint URL (dst)")
    _add_storage_option(p, "--source-storage-option", "source_storage_option", "the source (src) when it is a URL")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_import)


def _add_export_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex export``."""
    p = sub.add_parser("export", help="export a tenplex GPT/Llama checkpoint as Hugging Face safetensors")
    p.add_argument("src", type=_url, help="tenplex checkpoint URL")
    p.add_argument("dst", type=_url, help="output .safetensors file, or a directory (model.safetensors + "
                                         "config.json); local path or URL")
    p.add_argument("--step", type=_STEP, default=None, help="step to export (default: latest complete)")
    _add_storage_option(p, "--storage-option", "storage_option", "the tenplex checkpoint URL (src)")
    _add_storage_option(p, "--out-storage-option", "out_storage_option", "the output (dst) when it is a URL")
    p.set_defaults(func=_cmd_export)


def _add_store_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex store serve``."""
    p = sub.add_parser("store", help="the per-host tensor store")
    store_sub = p.add_subparsers(dest="store_command", required=True)
    q = store_sub.add_parser("serve", help="serve a host's snapshots to its peers over HTTP (byte ranges)")
    q.add_argument("--root", default="/dev/shm/tenplex-store", help="directory (default on tmpfs)")
    q.add_argument("--listen", default="127.0.0.1:7700", help="HOST:PORT (port 0: a free one)")
    q.add_argument("--token-file", default=None,
                   help="file holding the shared token (mode 0600); default: TENPLEX_STORE_TOKEN, "
                        "TENPLEX_STORE_TOKEN_FILE, else the user's token file, generated when missing")
    q.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: visible in ps
    q.add_argument("--peers", default="", help="comma-separated URLs of all host stores (replication ring)")
    q.add_argument("--replicas", type=int, default=1, help="copies of each snapshot on the next hosts of the ring")
    q.add_argument("--keep-last", type=int, default=2, help="complete steps kept (>= 1)")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds a connection may idle or stall")
    q.add_argument("--max-connections", type=int, default=128, help="connections served at once")
    q.set_defaults(func=_cmd_store_serve)


def _add_mount_store_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex mount-store``."""
    p = sub.add_parser("mount-store", help="show a host store's snapshots as files (FUSE, read-only)")
    p.add_argument("root", help="the store's root directory")
    p.add_argument("mountpoint")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(func=_cmd_mount_store)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex bench bubbles``."""
    p = sub.add_parser("bench", help="built-in benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    q = bench_sub.add_parser("bubbles", help="snapshot overhead: none vs blocking vs in pipeline bubbles "
                             "(options: tenplex bench bubbles --help)", add_help=False)
    q.set_defaults(func=_cmd_bench_bubbles)


def build_parser() -> argparse.ArgumentParser:
    """The ``tenplex`` command line: one subparser per command, each registered by its ``_add_*_parser``."""
    parser = argparse.ArgumentParser(prog="tenplex", description="Change the parallelism of a running training job.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_plan_parser, _add_estimate_parser, _add_configs_parser, _add_schedule_parser,
                _add_simulate_parser, _add_inspect_parser, _add_import_parser, _add_export_parser, _add_store_parser,
                _add_data_parser, _add_mount_parser, _add_remount_parser, _add_mount_store_parser, _add_bench_parser):
        add(sub)
    return parser


def _cmd_mount_store(args: argparse.Namespace) -> int:
    mount_store(args.root, args.mountpoint, debug=args.debug)
    return 0


def _cmd_bench_bubbles(args: argparse.Namespace) -> int:
    # lazy: the benchmark loads the reference trainer (torch.distributed, the model code), which no other command needs
    from .train.bubble_bench import main as bench_main

    return bench_main(args.rest)


def _add_data_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex data index``."""
    p = sub.add_parser("data", help="dataset indexes (samples as byte ranges in files)")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    q = data_sub.add_parser("index", help="index the samples of files (local paths or fsspec URLs)")
    q.add_argument("out", help="index file to write (.npz), local path or URL")
    q.add_argument("files", nargs="+", help="source files, in this order")
    kind = q.add_mutually_exclusive_group(required=True)
    kind.add_argument("--record-bytes", type=int, default=None, metavar="N", help="fixed-size records of N bytes")
    kind.add_argument("--jsonl", action="store_true", help="one sample per non-empty line (newline included)")
    kind.add_argument("--tokens", action="store_true",
                      help="token files cut into non-overlapping sequences of --seq-len tokens")
    kind.add_argument("--megatron", action="store_true",
                      help="one Megatron PREFIX (.bin/.idx): GPTDataset's samples of --seq-len + 1 tokens")
    kind.add_argument("--hf", action="store_true",
                      help="a Hugging Face dataset (Parquet files or one save_to_disk directory): row i's --column "
                           "token ids, as bytes of its Arrow cache files")
    q.add_argument("--column", default="input_ids", help="the token-id column (with --hf; default input_ids)")
    q.add_argument("--cache-dir", default=None,
                   help="where datasets converts Parquet to Arrow (with --hf; the index reads those files: keep them)")
    q.add_argument("--seq-len", type=int, default=None, help="tokens per sample (with --tokens or --megatron)")
    q.add_argument("--megatron-seed", type=int, default=1234,
                   help="GPTDataset's random seed for its document and sample shuffles (default 1234, Megatron's)")
    q.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16", help="token dtype (with --tokens)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_cmd_data_index)


def _add_mount_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex mount``."""
    p = sub.add_parser("mount", help="mount a dataset index as per-DP-rank files (FUSE, read-only)")
    p.add_argument("index", help="index written by `tenplex data index`")
    p.add_argument("mountpoint", help="an existing empty directory")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--progress", type=int, default=0, help="samples consumed globally (default 0)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (default: dp)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    order.add_argument("--no-shuffle", action="store_true", help="index order in every epoch")
    p.add_argument("--epochs", type=int, default=None,
                   help="show samples up to the end of this many epochs (default: through the current epoch)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="split each global batch by whole micro-batches of this size, ranks differing by at most "
                        "one (a dp that does not divide the batch; default: equal slices)")
    p.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    p.add_argument("--read-ahead-kib", type=_int_in(0, 1 << 20), default=1024,
                   help="kernel read-ahead of the mount (KiB; needs root; 0 keeps libfuse's 128)")
    p.add_argument("--debug", action="store_true", help="libfuse debug output")
    p.set_defaults(func=_cmd_mount)


def _add_remount_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``tenplex remount``."""
    p = sub.add_parser("remount", help="re-shard a running mount in place (new DP size and progress)")
    p.add_argument("mountpoint")
    p.add_argument("--dp", type=int, default=None, help="new data-parallel size")
    p.add_argument("--progress", type=int, default=None, help="samples consumed globally")
    p.add_argument("--global-batch", type=int, default=None, help="new global batch (default: unchanged)")
    p.add_argument("--seed", type=int, default=None, help="new shuffle seed (default: unchanged)")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="shuffle or keep index order (default: unchanged)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="split global batches by whole micro-batches of this size (0: equal slices; default: "
                        "unchanged)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_remount)


def _cmd_data_index(args: argparse.Namespace) -> int:
    kind = ("records" if args.record_bytes is not None else "jsonl" if args.jsonl
            else "pieces" if args.megatron or args.hf else "tokens")
    if args.hf:
        index = hf_index(hf_dataset(args.files, cache_dir=args.cache_dir), args.column)
    elif args.megatron:
        if len(args.files) != 1 or args.seq_len is None or args.seq_len < 1:
            raise DataIndexError("--megatron takes one PREFIX (of PREFIX.bin and PREFIX.idx) and --seq-len >= 1")
        index = megatron_index(megatron_gpt_dataset(args.files[0], args.seq_len, seed=args.megatron_seed))
    else:
        index = build_index(args.files, kind=kind, record_bytes=args.record_bytes, seq_len=args.seq_len,
                            dtype=args.dtype)
    index.save(args.out)
    if args.json:
        print(json.dumps({"out": args.out, "kind": kind, "num_samples": index.num_samples,
                          "files": len(index.files), "bytes": index.nbytes, "checksum": index.checksum}))
    else:
        print(f"{args.out}: {index.num_samples} samples ({kind}), {human_bytes(index.nbytes)} in "
              f"{len(index.files)} file(s)")
    return 0


def _cmd_mount(args: argparse.Namespace) -> int:
    layout = DataView(dp=args.dp, progress=args.progress,
                    global_batch=args.dp if args.global_batch is None else args.global_batch,
                    seed=args.seed, shuffle=not args.no_shuffle, num_epochs=args.epochs,
                    micro_batch=args.micro_batch)
    if args.foreground:
        mount(args.index, args.mountpoint, layout, debug=args.debug, read_ahead_kib=args.read_ahead_kib)
        return 0
    # check what we can here, so errors are printed by this process; the child serves the mount
    check_mountpoint(args.mountpoint)
    check_fuse()
    layout.check(load_index(args.index).num_samples)
    argv = ["mount", args.index, os.path.abspath(args.mountpoint), "--dp", str(args.dp), "--progress",
            str(args.progress), "--global-batch", str(layout.global_batch)]
    argv += ["--no-shuffle"] if args.no_shuffle else ["--seed", str(args.seed)]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    if args.micro_batch is not None:
        argv += ["--micro-batch", str(args.micro_batch)]
    argv += ["--read-ahead-kib", str(args.read_ahead_kib)]
    pid = spawn_mount(argv, args.mountpoint)
    print(f"mounted {args.index} at {os.path.abspath(args.mountpoint)} (pid {pid}); "
          f"unmount with fusermount3 -u {args.mountpoint}")
    return 0


def _cmd_remount(args: argparse.Namespace) -> int:
    extra = {} if args.micro_batch is None else {"micro_batch": args.micro_batch or None}
    st = remount(args.mountpoint, dp=args.dp, progress=args.progress, global_batch=args.global_batch, seed=args.seed,
                 shuffle=args.shuffle, **extra)
    if args.json:
        print(json.dumps(st))
    else:
        print(f"{args.mountpoint}: generation {st['generation']}, dp={st['dp']}, progress={st['progress']}, "
              f"global batch {st['global_batch']}")
    return 0


def _cmd_store_serve(args: argparse.Namespace) -> int:
    if args.token is not None:
        raise ConfigError("--token puts the secret in the process list: pass --token-file FILE (mode 0600) or set "
                          "TENPLEX_STORE_TOKEN")
    serve(args.root, args.listen, StoreOptions(
        token_file=args.token_file, peers=[u for u in args.peers.split(",") if u.strip()], replicas=args.replicas,
        keep_last=args.keep_last, timeout=args.timeout, max_connections=args.max_connections))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and getattr(args, "func", None) is not _cmd_bench_bubbles:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except (TenplexError, ValueError) as e:  # bad user input: configs, presets, URLs, files (ConfigError is one)
        message = str(e)
    except OSError as e:  # a path or host given by the user: missing, unreadable, unreachable
        message = _os_error(e)
    print(f"tenplex {args.command}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _os_error(e: OSError) -> str:
    what = f"{e.strerror or e}: {e.filename}" if e.filename else str(e) or type(e).__name__
    return f"{what} ({type(e).__name__}); check the path or URL and, for a server, that it is up"


def _one_line(message: str) -> str:
    """The message on one line (multi-line texts joined with ' | ')."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " | ".join(lines) or "failed (no message)"


if __name__ == "__main__":
    sys.exit(main())
