#!/usr/bin/env python3
"""Bring your own model: tenplex's ``save_state_dict`` / ``load_state_dict`` versus DCP on a torch-native job (#17 item 7).

The model is ``examples/native_llama.py`` (a plain-torch Llama, parallelized with torch's own TP,
FSDP2, HSDP and pipelining APIs; ``--preset 100m``: 110.5M parameters, fp32) with AdamW state
from one real optimizer step. For every pair (from-mesh -> to-mesh), in one run:

* save: a gloo world of the from-mesh (one spawned process per rank, CPU) builds the model,
  parallelizes it (PP: ``pipeline_stage``, the stage modules keep global FQNs), takes one
  training step and saves the same state dict, ``get_state_dict(model, optimizer)`` plus a step
  counter (``flatten_optimizer_state_dict=True``: param groups keyed by parameter name, the same
  under PP on every stage), with ``tenplex.save_state_dict`` and with ``dcp.save`` (``FileSystemWriter``,
  ``sync_files=False``: tenplex does not fsync either, so both leave the data in the page cache;
  ``--dcp-sync-files`` for DCP's default). Save time: the slowest rank, barrier to return.
* load: a NEW gloo world of the to-mesh builds the model twice (different seeds), parallelizes
  both, creates their optimizer state and takes their state dicts; every tensor of the two is
  overwritten with a different fill value first. One is loaded with ``tenplex.load_state_dict``,
  the other with ``dcp.load`` (``FileSystemReader``), each once unmeasured (first-call imports),
  then ``--repeats`` times cold (``sync; echo 1 > /proc/sys/vm/drop_caches`` before, when this
  process may write it) and right after warm (the files just read are in the shared page
  cache); which system goes first alternates between repeats. Own copy per rank (what separate
  hosts see, each with its own page cache and storage path; ``--no-own`` skips it): rank 0 copies
  both saved directories once per new rank (``cp -a``), then ``--repeats`` times per system, the
  order alternating, the page cache is dropped (after sync) and every rank loads from its own
  copy, so every byte a rank reads comes from storage (``read_bytes`` of /proc/self/io, per rank;
  ``fincore`` of the copies before each load says how much of them was still cached); the copies
  are removed afterwards. Then every tensor's
  ``full_tensor()`` and every other value is compared between the two state dicts:
  ``identical`` (bit for bit).
* per load and rank: the wall time (barrier to return; the slowest rank is reported), the
  bytes passed through read syscalls (delta of ``rchar`` in /proc/self/io: data and metadata,
  the same measure for both; gloo's socket traffic is not counted), and the peak host memory
  of the load (freed heap returned to the OS with ``malloc_trim``, then ``5`` written to
  /proc/self/clear_refs resets VmHWM; VmHWM after minus VmRSS before; the largest rank).
  Bytes are summed over ranks; ``bytes_needed`` is the size of the ranks' local tensors, summed.

Medians over the repeats, with min and max. The load average is printed at start and end.

Small states (#29 item 3, "no fixed cost"): ``--sizes 1,4,18,35`` runs each pair (default: FSDP2 4 -> 2,
TP 2 -> FSDP2 2 x TP 2, and the sub-mesh pattern both ways: FSDP2 over ``dp_shard`` of a (dp_shard, tp)
mesh whose embedding, norms and head are not TP-parallelized, ``parallelize_submesh``) on a model
(``config_for``) whose state dict is about that many MiB. Saves are timed ``--repeats`` times too,
the order alternating (``*_save_s`` with min/max); each new world also times its imports of
``torch.distributed.checkpoint`` and then ``tenplex`` (``*_import_s``) and its first load of each,
tenplex's first (``*_load_first_s``); ratios are tenplex / DCP of the medians (``save_ratio``,
``load_ratio``, ``load_warm_ratio``, ``load_first_ratio``). A tenplex save that fails is reported
(``tenplex_save_error``) and its pair's loads skipped. ``--kept K``: K steps under tenplex's URL
(the loaded one newest; ``tenplex_ckpt_bytes`` counts all of them).

    python scripts/bench_byo.py                       # 100m, 3 repeats, all pairs
    python scripts/bench_byo.py --sizes 1,4,18,35 --no-own --json /tmp/small.json   # small states
    python scripts/bench_byo.py --json docs/bench/bench_byo.json
    python scripts/bench_byo.py --quick --pairs fsdp4-fsdp2 --json /tmp/x.json   # tiny, 1 repeat

Progress goes to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

from tenplex.train.launch import free_port  # noqa: E402

MiB = 2**20
TIMED_STEP = 1000  # tenplex's checkpoint step of the timed saves (--kept saves older steps below it)


def log(msg: str) -> None:
    print(f"[bench_byo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Pair:
    key: str
    title: str
    old: dict[str, int]
    new: dict[str, int]
    old_submesh: bool = False  # save under sub-mesh FSDP2 x TP (parallelize_submesh)
    new_submesh: bool = False  # load under it


PAIRS = [
    Pair("fsdp4-fsdp2", "FSDP2 4 -> FSDP2 2", {"dp_shard": 4}, {"dp_shard": 2}),
    Pair("tp2-fsdp2tp2", "TP 2 -> FSDP2 2 x TP 2", {"tp": 2}, {"dp_shard": 2, "tp": 2}),
    Pair("hsdp2x2-tp4", "HSDP 2x2 -> TP 4", {"dp_replicate": 2, "dp_shard": 2}, {"tp": 4}),
    Pair("pp2-tp2", "PP 2 -> PP 1 x TP 2", {"pp": 2}, {"tp": 2}),
    # FSDP2 over the dp dim of a (dp, tp) mesh, embedding/head/norms not TP-parallelized (#29 item 1)
    Pair("submesh2x2-fsdp2", "sub-mesh FSDP2 2 x TP 2 (non-TP embedding) -> FSDP2 2",
         {"dp_shard": 2, "tp": 2}, {"dp_shard": 2}, old_submesh=True),
    Pair("tp2-submesh2x2", "TP 2 -> sub-mesh FSDP2 2 x TP 2 (non-TP embedding)",
         {"tp": 2}, {"dp_shard": 2, "tp": 2}, new_submesh=True),
]
SMALL_PAIRS = "fsdp4-fsdp2,tp2-fsdp2tp2,submesh2x2-fsdp2,tp2-submesh2x2"  # --sizes default pairs (#29 item 3)


def config_for(mib: float) -> dict[str, Any]:
    """A native_llama config (4 layers, vocab 1003, 8 heads / 4 KV heads) whose state dict (fp32
    parameters and AdamW's two moments) is about ``mib`` MiB: the smallest ``dim`` (a multiple of
    16) that reaches it."""
    vocab, layers = 1003, 4

    def state_mib(dim: int) -> float:
        ffn = 8 * ((8 * dim // 3 + 7) // 8)
        params = 2 * vocab * dim + dim + layers * (3 * dim * dim + 3 * dim * ffn + 2 * dim)
        return 12 * params / MiB  # fp32 parameter + exp_avg + exp_avg_sq

    dim = 16
    while state_mib(dim) < mib:
        dim += 16
    return {"dim": dim, "n_layers": layers, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 8 * ((8 * dim // 3 + 7) // 8),
            "vocab_size": vocab, "seq_len": 16}


def dims_text(dims: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in dims.items())


def world_of(dims: dict[str, int]) -> int:
    n = 1
    for v in dims.values():
        n *= v
    return n


# ---------------------------------------------------------------------------------------------
# /proc measurements
# ---------------------------------------------------------------------------------------------
def proc_io(field: str) -> int:
    """A counter of /proc/self/io: ``rchar`` (bytes through read syscalls, page cache hits
    included) or ``read_bytes`` (bytes this process caused to be fetched from storage)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/io")


def rchar() -> int:
    return proc_io("rchar")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), so that a load's peak is not
    hidden by memory an earlier load freed but the process still holds."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_caches() -> str | None:
    """Drop the page cache (after sync); None when done, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------
# the job (in the spawned ranks)
# ---------------------------------------------------------------------------------------------
def job_config(job: dict[str, Any]) -> Any:
    """The job's model config: ``job["config"]`` (a size of --sizes) or the preset."""
    import native_llama as nl

    return nl.LlamaConfig(**job["config"]) if job.get("config") else nl.PRESETS[job["preset"]]


def parallelize_submesh(model: Any, mesh: Any) -> Any:
    """Hugging Face's TP-plan pattern under FSDP2 x TP: the blocks' projections TP-sharded on
    ``mesh["tp"]`` (no sequence parallelism), embedding, norms and head left whole, then FSDP2
    over ``mesh["dp_shard"]`` of every block and the root: the embedding is a DTensor on the dp
    sub-mesh, one replica per TP rank (#29 item 1)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, mesh["tp"], plan)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    model.loss_parallel = False
    return model


def build(cfg: Any, dims: dict[str, int], seed: int, *, train: bool,
          submesh: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """The model on mesh ``dims`` (PP: this rank's stage; ``submesh``: ``parallelize_submesh``), its
    AdamW and ``get_state_dict`` of both. ``train``: one real step (loss, backward, AdamW); else the
    optimizer state is created without one."""
    import native_llama as nl
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = nl.Llama(cfg).init_weights(seed=seed)
    mesh = nl.build_mesh(dims)
    pp = dims.get("pp", 1)
    if pp > 1:
        model, _stage, runner = nl.pipeline_stage(model, mesh, n_microbatches=pp)
    elif submesh:
        model = runner = parallelize_submesh(model, mesh)
    else:
        model = nl.parallelize(model, mesh)
        runner = model
    opt = nl.make_optimizer(model)
    if train:
        seq = min(cfg.seq_len, 32)
        dp_rank, dp_size = nl.dp_rank_and_size(mesh)
        tokens, targets = nl.dp_slice(nl.batch(0, 2 * dp_size * pp, seq, cfg.vocab_size, seed=0), dp_rank, dp_size)
        nl.train_step(runner, opt, tokens, targets)
    else:
        nl.init_optimizer_state(opt)
    # flattened optimizer state: param groups keyed by parameter name, so that pipeline stages
    # (which hold different parameters) save consistent values under every key
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return model, opt, {"model": msd, "optim": osd, "step": 7 if train else -1}


def local_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from tenplex.native.state_dict import flatten_state_dict

    out = {}
    for k, (_, _, v) in flatten_state_dict(sd).items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to_local() if isinstance(v, DTensor) else v
    return out


def _max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sum(x: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t[0])


def _gather(x: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def worker(rank: int, world: int, port: int, phase: str, job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_dt.timedelta(seconds=job["timeout"]))
    if rank == 0:
        log(f"  {job['pair']} {phase}: world of {world} up")
    try:
        result = (save_phase if phase == "save" else load_phase)(rank, job)
        if rank == 0:
            Path(job["result"]).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # done: leave without the interpreter's finalization, during which a gloo group the models' reference
    # cycles keep alive can abort the process (docs/your_model.md, "Exit cleanly under gloo")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_phase(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    """Save the trained state with both systems ``job["repeats"]`` times, the order alternating (the
    first repeat's first save pays that system's first-call costs: ``*_save_first_s``). Repeat 0
    writes the directories the load phase reads; later repeats write beside them and are removed.
    A tenplex save that fails (on every rank alike: ``save_state_dict`` raises everywhere) is
    reported as ``tenplex_save_error`` instead of ending the run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import tenplex

    _model, _opt, sd = build(job_config(job), job["old"], seed=0, train=True, submesh=job["old_submesh"])
    dist.barrier()
    if rank == 0:
        log(f"  {job['pair']}: trained one step; saving")
    times: dict[str, list[float]] = {"tenplex": [], "dcp": []}
    error: str | None = None
    for rep in range(job["repeats"]):
        order = ("tenplex", "dcp") if rep % 2 == 0 else ("dcp", "tenplex")
        for name in order:
            if name == "tenplex" and error is not None:
                continue
            where = job["tenplex_url" if name == "tenplex" else "dcp_dir"] + ("" if rep == 0 else f".rep{rep}")
            dist.barrier()
            t0 = time.perf_counter()
            try:
                if name == "tenplex":
                    tenplex.save_state_dict(sd, where, step=TIMED_STEP)
                else:
                    dcp.save(sd, storage_writer=FileSystemWriter(where, sync_files=job["dcp_sync"]))
            except Exception as e:  # noqa: BLE001 - a known failure (sub-mesh save, #29 item 1) is reported
                if name == "dcp":
                    raise
                error = f"{type(e).__name__}: {e}"[:600]
                if rank == 0:
                    log(f"  {job['pair']}: tenplex save failed: {error[:200]}")
                continue
            times[name].append(_max(time.perf_counter() - t0))
            dist.barrier()
            if rank == 0 and rep > 0:
                shutil.rmtree(where, ignore_errors=True)
    if error is None:  # older steps kept beside the loaded one (--kept): what a training run's directory holds
        for older in range(job.get("kept", 1) - 1):
            tenplex.save_state_dict(sd, job["tenplex_url"], step=TIMED_STEP - 1 - older)
    out: dict[str, Any] = {"tenplex_save_error": error}
    for name, ts in times.items():
        out[f"{name}_save_runs"] = ts
        out[f"{name}_save_s"] = statistics.median(ts) if ts else None
    return out


def _measure(fn: Any) -> dict[str, Any]:
    import torch.distributed as dist

    trim_heap()
    dist.barrier()
    rss0 = status_kib("VmRSS")
    reset_hwm()
    r0, d0 = rchar(), proc_io("read_bytes")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    r1, d1 = rchar(), proc_io("read_bytes")
    hwm = status_kib("VmHWM")
    dist.barrier()
    per_rank = _gather((r1 - r0, d1 - d0))
    return {"s": _max(dt), "rchar": _sum(r1 - r0), "disk": _sum(d1 - d0), "rank_rchar": [r for r, _ in per_rank],
            "rank_disk": [d for _, d in per_rank], "peak_mib": _max((hwm - rss0) / 1024), "out": out}


def make_copies(job: dict[str, Any], world: int) -> tuple[list[str], list[str]]:
    """``world`` copies (``cp -a``) of the saved tenplex and DCP directories under ``job["own_dir"]``,
    one per new rank (separate hosts each read their own storage); returns their paths."""
    import subprocess

    root = Path(job["own_dir"])
    tenplex_urls, dcp_dirs = [], []
    for r in range(world):
        (root / str(r)).mkdir(parents=True, exist_ok=True)
        for src, name, out in ((job["tenplex_url"], "tenplex", tenplex_urls), (job["dcp_dir"], "dcp", dcp_dirs)):
            dst = root / str(r) / name
            subprocess.run(["cp", "-a", src, str(dst)], check=True)
            out.append(str(dst))
    return tenplex_urls, dcp_dirs


def resident_bytes(paths: list[str]) -> int | None:
    """Bytes of the files under ``paths`` in the page cache (util-linux ``fincore``), None without it."""
    import subprocess

    files = [str(f) for p in paths for f in Path(p).rglob("*") if f.is_file()]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(x) for x in out.split())


def _bits(t: Any) -> Any:
    import torch

    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype.is_floating_point else t


def load_phase(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    # each system's import in this fresh process (part of what a restarted job pays): wall and CPU time,
    # the CPU time less disturbed by other processes on a loaded host
    t0, c0 = time.perf_counter(), time.process_time()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    t1, c1 = time.perf_counter(), time.process_time()
    import tenplex
    from tenplex.native.state_dict import flatten_state_dict
    t2, c2 = time.perf_counter(), time.process_time()
    imports = {"dcp": _max(t1 - t0), "tenplex": _max(t2 - t1), "dcp_cpu": _max(c1 - c0), "tenplex_cpu": _max(c2 - c1)}

    cfg = job_config(job)
    models = {"tenplex": build(cfg, job["new"], seed=1, train=False, submesh=job["new_submesh"]),
              "dcp": build(cfg, job["new"], seed=2, train=False, submesh=job["new_submesh"])}
    sds = {name: m[2] for name, m in models.items()}
    for name, fill in (("tenplex", float("nan")), ("dcp", -3.0)):  # nothing survives but what a load writes
        for t in local_tensors(sds[name]).values():
            t.fill_(fill)
        sds[name]["step"] = -1
    locals_ = local_tensors(sds["tenplex"])
    bytes_needed = _sum(sum(t.numel() * t.element_size() for t in locals_.values()))
    if rank == 0:
        log(f"  {job['pair']}: built two state dicts; loading")

    def load(name: str) -> Any:
        if name == "tenplex":
            return lambda: tenplex.load_state_dict(sds["tenplex"], job["tenplex_url"])
        return lambda: dcp.load(sds["dcp"], storage_reader=FileSystemReader(job["dcp_dir"]))

    first = {}  # first calls (lazy imports, first collectives; what a restarted job pays once), tenplex's first
    for name in ("tenplex", "dcp"):
        first[name] = _measure(load(name))["s"]
    if job.get("profile"):  # one more (warm) load of each under cProfile, rank 0's stats kept
        import cProfile
        import pstats

        for name in ("tenplex", "dcp"):
            prof = cProfile.Profile()
            _measure(lambda: prof.runcall(load(name)))
            if rank == 0:
                path = f"{job['profile']}.{job['pair']}.{name}"
                prof.dump_stats(path + ".prof")
                with open(path + ".txt", "w") as f:
                    pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
                    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
    cold_note = None
    runs: dict[str, list[dict[str, Any]]] = {"tenplex": [], "dcp": []}
    for rep in range(job["repeats"]):
        order = ("tenplex", "dcp") if rep % 2 == 0 else ("dcp", "tenplex")
        for name in order:
            dist.barrier()
            if rank == 0:
                cold_note = drop_caches()
            cold = _measure(load(name))
            warm = _measure(load(name))
            stats = None
            if name == "tenplex":
                res = cold["out"]
                stats = _sum(res.bytes_read)
                assert _sum(res.bytes_needed) == bytes_needed, (res.bytes_needed, bytes_needed)
            runs[name].append({"cold_s": cold["s"], "warm_s": warm["s"], "rchar": cold["rchar"], "disk": cold["disk"],
                               "rchar_warm": warm["rchar"], "peak_mib": cold["peak_mib"],
                               "peak_warm_mib": warm["peak_mib"], "stats_bytes_read": stats})
            log(f"  {job['pair']} rep {rep + 1} {name}: cold {cold['s']:.3f} s, warm {warm['s']:.3f} s, "
                f"{cold['rchar'] / MiB:.1f} MiB read, peak {cold['peak_mib']:.0f} MiB") if rank == 0 else None

    # own copy per rank: every new rank loads from its own copy of both checkpoints, page cache
    # dropped before each load, so every byte a rank reads comes from storage (separate hosts)
    own: dict[str, list[dict[str, Any]]] = {"tenplex": [], "dcp": []}
    own_resident: list[int | None] = []
    if job.get("own"):
        world = dist.get_world_size()
        paths: list[Any] = [None]
        if rank == 0:
            log(f"  {job['pair']}: copying both checkpoints {world}x (cp -a) for the own-copy loads")
            paths = [make_copies(job, world)]
        dist.broadcast_object_list(paths, src=0)
        tenplex_urls, dcp_dirs = paths[0]
        copies = tenplex_urls + dcp_dirs

        def load_own(name: str) -> Any:
            if name == "tenplex":
                return lambda: tenplex.load_state_dict(sds["tenplex"], tenplex_urls[rank])
            return lambda: dcp.load(sds["dcp"], storage_reader=FileSystemReader(dcp_dirs[rank]))

        for rep in range(job["repeats"]):
            order = ("tenplex", "dcp") if rep % 2 == 0 else ("dcp", "tenplex")
            for name in order:
                dist.barrier()
                if rank == 0:
                    cold_note = drop_caches() or cold_note
                    own_resident.append(resident_bytes(copies))
                m = _measure(load_own(name))
                own[name].append({"s": m["s"], "rchar": m["rchar"], "disk": m["disk"], "rank_rchar": m["rank_rchar"],
                                  "rank_disk": m["rank_disk"], "peak_mib": m["peak_mib"]})
                log(f"  {job['pair']} own rep {rep + 1} {name}: {m['s']:.3f} s, {m['rchar'] / MiB:.1f} MiB read, "
                    f"{m['disk'] / MiB:.1f} MiB from storage, resident before {own_resident[-1]}") if rank == 0 else None
        dist.barrier()
        if rank == 0:
            shutil.rmtree(job["own_dir"], ignore_errors=True)

    # bit identity of the two loaded state dicts
    flat = {name: flatten_state_dict(sd) for name, sd in sds.items()}
    diffs = []
    if set(flat["tenplex"]) != set(flat["dcp"]):
        diffs.append(f"keys differ: {sorted(set(flat['tenplex']) ^ set(flat['dcp']))[:5]}")
    n_tensors, tensor_diffs = 0, 0
    for key in sorted(set(flat["tenplex"]) & set(flat["dcp"])):
        a, b = flat["tenplex"][key][2], flat["dcp"][key][2]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            n_tensors += 1
            fa = a.full_tensor() if isinstance(a, DTensor) else a
            fb = b.full_tensor() if isinstance(b, DTensor) else b
            if fa.dtype != fb.dtype or fa.shape != fb.shape or not torch.equal(_bits(fa), _bits(fb)):
                diffs.append(f"{key}: tensors differ")
                tensor_diffs += 1
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            diffs.append(f"{key}: {a!r} != {b!r}"[:300])
    if sds["tenplex"]["step"] != 7:
        diffs.append(f"step: tenplex loaded {sds['tenplex']['step']!r}, saved 7")
    all_diffs = [d for ds in _gather(diffs) for d in ds]
    tensors_identical = _sum(tensor_diffs) == 0
    return {"tensors_identical": tensors_identical, "bytes_needed": bytes_needed, "runs": runs, "own": own,
            "first": first, "imports": imports,
            "own_resident": own_resident, "cold": cold_note is None, "cold_note": cold_note,
            "identical": not all_diffs, "diffs": sorted(set(all_diffs))[:20], "tensors_compared": n_tensors}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def run_world(world: int, phase: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, phase, job), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed = None
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            failed = f"timed out after {timeout:.0f} s"
            break
        if p.exitcode != 0 and failed is None:
            failed = f"a rank exited with {p.exitcode}"
            break
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        raise RuntimeError(f"{phase} world of {world} ({job['pair']}): {failed}")
    return json.loads(Path(job["result"]).read_text())


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_pair(pair: Pair, args: argparse.Namespace, root: Path, size_mib: float | None = None) -> dict[str, Any]:
    """One pair (at ``size_mib``, a --sizes entry, or the preset): save world, then load world."""
    config = config_for(size_mib) if size_mib is not None else None
    tdir = root / (pair.key if size_mib is None else f"{pair.key}-{size_mib:g}")
    tdir.mkdir(parents=True)
    job = {"pair": pair.key, "preset": args.preset, "config": config, "old_submesh": pair.old_submesh,
           "new_submesh": pair.new_submesh, "old": pair.old,
           "new": pair.new, "tenplex_url": str(tdir / "tenplex"), "dcp_dir": str(tdir / "dcp"),
           "dcp_sync": args.dcp_sync_files, "repeats": args.repeats, "timeout": args.timeout, "profile": args.profile,
           "result": str(tdir / "result.json"), "own": not args.no_own, "own_dir": str(tdir / "own"),
           "kept": args.kept}
    load0 = os.getloadavg()
    log(f"{pair.title}{'' if size_mib is None else f' ({size_mib:g} MiB)'}: save in a world of "
        f"{world_of(pair.old)} ({dims_text(pair.old)})")
    saved = run_world(world_of(pair.old), "save", job, args.timeout)
    row: dict[str, Any] = {
        "pair": pair.key, "title": pair.title, "from": dims_text(pair.old), "to": dims_text(pair.new),
        "preset": args.preset if config is None else None, "size_mib": size_mib, "config": config,
        "repeats": args.repeats, "kept": args.kept, "dcp_sync_files": args.dcp_sync_files,
        "tenplex_bytecode": not args.no_compile,
        "loadavg_start": list(load0),
        "tenplex_save_error": saved["tenplex_save_error"]}
    for name in ("tenplex", "dcp"):
        ts = saved[f"{name}_save_runs"]
        row[f"{name}_save_runs"] = ts
        if ts:
            row[f"{name}_save_s"], row[f"{name}_save_s_min"], row[f"{name}_save_s_max"] = spread(ts)
    if saved["tenplex_save_error"] is not None:  # nothing of tenplex's to load
        row.update(identical=False, tensors_identical=False, diffs=[], loadavg_end=list(os.getloadavg()))
        shutil.rmtree(tdir, ignore_errors=True)
        return row
    row["save_ratio"] = row["tenplex_save_s"] / row["dcp_save_s"]
    log(f"{pair.title}: load in a new world of {world_of(pair.new)} ({dims_text(pair.new)})")
    loaded = run_world(world_of(pair.new), "load", job, args.timeout)
    runs = loaded["runs"]
    row.update({
        "bytes_needed": loaded["bytes_needed"],
        "tenplex_ckpt_bytes": du(tdir / "tenplex"), "dcp_ckpt_bytes": du(tdir / "dcp"),
        "tenplex_load_first_s": loaded["first"]["tenplex"], "dcp_load_first_s": loaded["first"]["dcp"],
        "tenplex_import_s": loaded["imports"]["tenplex"], "dcp_import_s": loaded["imports"]["dcp"],
        "tenplex_import_cpu_s": loaded["imports"]["tenplex_cpu"], "dcp_import_cpu_s": loaded["imports"]["dcp_cpu"],
        "identical": loaded["identical"], "tensors_identical": loaded["tensors_identical"], "diffs": loaded["diffs"], "tensors_compared": loaded["tensors_compared"],
        "cold": loaded["cold"], "cold_note": loaded["cold_note"] or "page cache dropped before every cold load",
    })
    for name in ("tenplex", "dcp"):
        rs = runs[name]
        row[f"{name}_bytes_read"] = int(statistics.median(r["rchar"] for r in rs))
        for key, col in (("cold_s", "load_s"), ("warm_s", "load_warm_s"), ("peak_mib", "peak_mib"),
                         ("peak_warm_mib", "peak_warm_mib")):
            med, lo, hi = spread([r[key] for r in rs])
            row[f"{name}_{col}"] = med
            row[f"{name}_{col}_min"] = lo
            row[f"{name}_{col}_max"] = hi
    for col in ("load_s", "load_warm_s", "load_first_s"):  # tenplex / DCP of the medians
        row[f"{col[:-2]}_ratio"] = row[f"tenplex_{col}"] / row[f"dcp_{col}"]
    row["tenplex_stats_bytes_read"] = int(statistics.median(r["stats_bytes_read"] for r in runs["tenplex"]))
    for name in ("tenplex", "dcp"):  # shared page cache, cold: what came from storage (all ranks)
        row[f"{name}_disk_bytes"] = int(statistics.median(r["disk"] for r in runs[name]))
    own = loaded["own"]
    row["own"] = bool(own["tenplex"])
    if own["tenplex"]:
        for name in ("tenplex", "dcp"):
            rs = own[name]
            med, lo, hi = spread([r["s"] for r in rs])
            row[f"{name}_load_own_s"], row[f"{name}_load_own_s_min"], row[f"{name}_load_own_s_max"] = med, lo, hi
            med, lo, hi = spread([r["peak_mib"] for r in rs])
            row[f"{name}_peak_own_mib"], row[f"{name}_peak_own_mib_min"], row[f"{name}_peak_own_mib_max"] = med, lo, hi
            row[f"{name}_bytes_read_own"] = int(statistics.median(r["rchar"] for r in rs))
            row[f"{name}_disk_bytes_own"] = int(statistics.median(r["disk"] for r in rs))
            # per rank (median over the repeats): through read syscalls, and fetched from storage
            row[f"{name}_rank_bytes_read_own"] = [int(statistics.median(v)) for v in zip(*(r["rank_rchar"] for r in rs))]
            row[f"{name}_rank_disk_bytes_own"] = [int(statistics.median(v)) for v in zip(*(r["rank_disk"] for r in rs))]
        res = [x for x in loaded["own_resident"] if x is not None]
        row["own_resident_before_max"] = max(res) if res else None  # copies' bytes in the page cache before a load
    row["loadavg_end"] = list(os.getloadavg())
    shutil.rmtree(tdir, ignore_errors=True)
    return row


def _fmt_s(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f} ({row[key + '_min']:.3f}-{row[key + '_max']:.3f})"


def _fmt_m(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.0f} ({row[key + '_min']:.0f}-{row[key + '_max']:.0f})"


def _what(row: dict[str, Any]) -> str:
    return row["preset"] if row.get("size_mib") is None else f"~{row['size_mib']:g} MiB (dim {row['config']['dim']})"


def table(row: dict[str, Any]) -> str:
    mb = lambda n: f"{n / MiB:.1f} MiB"  # noqa: E731
    head = f"### {row['title']}  ({row['from']} -> {row['to']}, {_what(row)}, median (min-max) of {row['repeats']})"
    if row.get("tenplex_save_error"):
        return "\n".join([head, "", f"tenplex save FAILED: {row['tenplex_save_error']}", "",
                          f"DCP save (s): {_fmt_s(row, 'dcp_save_s')}", ""])
    lines = [
        head,
        "",
        "| | tenplex | DCP |",
        "|---|---:|---:|",
        f"| save (s) | {_fmt_s(row, 'tenplex_save_s')} | {_fmt_s(row, 'dcp_save_s')} |",
        f"| import in the new world (s; DCP's first) | {row['tenplex_import_s']:.3f} | {row['dcp_import_s']:.3f} |",
        f"| import, CPU time (s) | {row['tenplex_import_cpu_s']:.3f} | {row['dcp_import_cpu_s']:.3f} |",
        f"| first load in the new world (s) | {row['tenplex_load_first_s']:.3f} | {row['dcp_load_first_s']:.3f} |",
        f"| checkpoint size | {mb(row['tenplex_ckpt_bytes'])} | {mb(row['dcp_ckpt_bytes'])} |",
        f"| load, cold (s) | {_fmt_s(row, 'tenplex_load_s')} | {_fmt_s(row, 'dcp_load_s')} |",
        f"| load, warm (s) | {_fmt_s(row, 'tenplex_load_warm_s')} | {_fmt_s(row, 'dcp_load_warm_s')} |",
        f"| bytes read (rchar, all ranks) | {mb(row['tenplex_bytes_read'])} | {mb(row['dcp_bytes_read'])} |",
        f"| read / needed ({mb(row['bytes_needed'])}) | {row['tenplex_bytes_read'] / row['bytes_needed']:.3f} | "
        f"{row['dcp_bytes_read'] / row['bytes_needed']:.3f} |",
        f"| peak load memory, cold (MiB, max rank) | {_fmt_m(row, 'tenplex_peak_mib')} | {_fmt_m(row, 'dcp_peak_mib')} |",
        f"| peak load memory, warm (MiB, max rank) | {_fmt_m(row, 'tenplex_peak_warm_mib')} | "
        f"{_fmt_m(row, 'dcp_peak_warm_mib')} |",
        f"| from storage, cold (read_bytes, all ranks) | {mb(row['tenplex_disk_bytes'])} | {mb(row['dcp_disk_bytes'])} |",
    ]
    if row.get("own"):
        lines += [
            f"| load, own copy per rank (s) | {_fmt_s(row, 'tenplex_load_own_s')} | {_fmt_s(row, 'dcp_load_own_s')} |",
            f"| own copy: bytes read (all ranks) | {mb(row['tenplex_bytes_read_own'])} | {mb(row['dcp_bytes_read_own'])} |",
            f"| own copy: from storage per rank (MiB) | {' / '.join(f'{b / MiB:.0f}' for b in row['tenplex_rank_disk_bytes_own'])} | "
            f"{' / '.join(f'{b / MiB:.0f}' for b in row['dcp_rank_disk_bytes_own'])} |",
            f"| peak load memory, own copy (MiB, max rank) | {_fmt_m(row, 'tenplex_peak_own_mib')} | {_fmt_m(row, 'dcp_peak_own_mib')} |",
        ]
    lines += [
        "",
        f"tenplex's own bytes_read: {mb(row['tenplex_stats_bytes_read'])}; identical: {row['identical']} "
        f"(tensors: {row['tensors_identical']}, {row['tensors_compared']} compared){'' if row['identical'] else ' ' + '; '.join(row['diffs'])}; "
        f"cold: {row['cold_note']}; own copies' bytes in the page cache before a load: {row.get('own_resident_before_max')}; "
        f"load average {row['loadavg_start'][0]:.2f} -> {row['loadavg_end'][0]:.2f}",
        "",
    ]
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per pair and size: tenplex and DCP times side by side, ratios tenplex / DCP."""
    lines = ["| pair | state | save s tenplex / DCP | ratio | load warm s tenplex / DCP | ratio | "
             "load cold s tenplex / DCP | ratio | import + first load s tenplex / DCP | ratio |",
             "|---|---|---|---:|---|---:|---|---:|---|---:|"]
    for r in rows:
        state = _what(r) if r.get("bytes_needed") is None else f"{_what(r)}, {r['bytes_needed'] / MiB:.1f} MiB"
        if r.get("tenplex_save_error"):
            lines.append(f"| {r['title']} | {state} | FAILED / {_fmt_s(r, 'dcp_save_s')} | | | | | | | |")
            continue
        ft, fd = r["tenplex_import_s"] + r["tenplex_load_first_s"], r["dcp_import_s"] + r["dcp_load_first_s"]
        lines.append(
            f"| {r['title']} | {state} | {_fmt_s(r, 'tenplex_save_s')} / {_fmt_s(r, 'dcp_save_s')} | "
            f"{r['save_ratio']:.2f} | {_fmt_s(r, 'tenplex_load_warm_s')} / {_fmt_s(r, 'dcp_load_warm_s')} | "
            f"{r['load_warm_ratio']:.2f} | {_fmt_s(r, 'tenplex_load_s')} / {_fmt_s(r, 'dcp_load_s')} | "
            f"{r['load_ratio']:.2f} | {ft:.3f} / {fd:.3f} | {ft / fd:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m", help="native_llama preset (default 100m; tiny for seconds)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="--preset tiny --repeats 1")
    ap.add_argument("--pairs", default=None, help=f"comma-separated, of {[p.key for p in PAIRS]} (default: all; "
                    f"with --sizes {SMALL_PAIRS})")
    ap.add_argument("--sizes", metavar="MIB,...", help="instead of the preset, models whose state dict is about "
                    "this many MiB each (config_for: 4 layers, vocab 1003, dim to fit), e.g. 1,4,18,64")
    ap.add_argument("--json", metavar="PATH", help="write the list of per-pair results here")
    ap.add_argument("--tmpdir", help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--dcp-sync-files", action="store_true", help="DCP's default fsync of every file at save")
    ap.add_argument("--profile", metavar="PREFIX", help="also profile one warm load of each (cProfile, rank 0): "
                    "PREFIX.<pair>.<system>.{prof,txt}")
    ap.add_argument("--no-own", action="store_true", help="skip the own-copy-per-rank loads (each new rank "
                    "loading its own cp -a copy of the checkpoints, page cache dropped)")
    ap.add_argument("--no-compile", action="store_true", help="do not compile tenplex to bytecode first (as pip "
                    "install does, and as torch's is): with PYTHONDONTWRITEBYTECODE=1 every new world then compiles "
                    "tenplex from source, which its import time shows")
    ap.add_argument("--kept", type=int, default=1, help="tenplex: steps kept under the URL, the loaded one the "
                    "newest (older steps saved after the timed saves; DCP loads its one directory)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per world, seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.repeats = "tiny", 1
    if args.pairs is None:
        args.pairs = SMALL_PAIRS if args.sizes else "all"
    chosen = PAIRS if args.pairs == "all" else [p for k in args.pairs.split(",") for p in PAIRS if p.key == k.strip()]
    if not chosen or (args.pairs != "all" and len(chosen) != len(args.pairs.split(","))):
        ap.error(f"--pairs: choose from {[p.key for p in PAIRS]}")
    sizes: list[float | None] = [float(x) for x in args.sizes.split(",")] if args.sizes else [None]
    if not args.no_compile:  # __pycache__ beside the sources (git ignores it), read even under PYTHONDONTWRITEBYTECODE
        import compileall

        compileall.compile_dir(str(REPO / "tenplex"), quiet=1)
    la = os.getloadavg()
    print(f"load average at start: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}  ({os.cpu_count()} CPUs); tenplex "
          f"{'from source' if args.no_compile else 'compiled to bytecode first'}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_byo_", dir=args.tmpdir) as tmp:
        for size in sizes:
            for pair in chosen:
                row = run_pair(pair, args, Path(tmp), size)
                rows.append(row)
                print(table(row), flush=True)
    print(summary(rows), flush=True)
    la = os.getloadavg()
    print(f"load average at end: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0 if all(r["tensors_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
