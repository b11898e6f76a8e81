#!/usr/bin/env python3
"""tenplex versus PyTorch Distributed Checkpoint (DCP): resharding loads and load planning.

Part 1 (loads). The same model and Adam state (``gpt-100m`` fp32, about 124M parameters and
1.5 GB with optimizer state; ``--quick``: a 4-layer GPT) are saved under layout A and loaded
under layout B by both systems. Every phase runs in fresh processes (one per rank, spawned
with torch.multiprocessing, gloo on CPU): save (tenplex then DCP in the same processes),
tenplex load, DCP load. For DCP every tensor is a DTensor on a DeviceMesh
``(pp, dp, tp)`` sliced to the rank's own stage, with placements that reproduce the PTC's
TP split (see docs/benchmarks.md for the mapping). Both write to and read from local files
through the same counting fsspec filesystem (``count://``): data bytes are those read from
``*.safetensors`` / ``*.distcp`` files, metadata bytes everything else. Between phases both
checkpoints' pages are evicted from the page cache (posix_fadvise DONTNEED) so that both
loads start cold. Three load modes: "native" (each system's own local-file reader, all
ranks reading one directory, so ranks share the page cache and a byte several ranks read
comes from storage once), "fsspec" (both through the counting filesystem) and "own copy per
rank" (each rank reads its own copy of both checkpoints, as ranks on separate hosts would:
nothing is shared, every byte a rank reads comes from storage). Peak memory: the growth of ``ru_maxrss`` of each (fresh) load process
from just before the load (and before DCP's destination tensors are allocated) to just
after it; the largest over ranks. Every loaded tensor is checked bit for bit.

Part 2 (planning at scale). ``tenplex.plan`` for llama3-70b 64 -> 128 GPUs and GPT-3 175B
at 1024 GPUs versus DCP's load planning (``planner_helpers.create_read_items_for_chunk_list``,
the resharding step of ``DefaultLoadPlanner.create_local_plan``) on equivalent metadata,
timed for a few new ranks and extrapolated to all.

    python scripts/bench_vs_dcp.py            # full run; writes docs/bench/bench_vs_dcp.{md,json,png}
    python scripts/bench_vs_dcp.py --quick    # small model, writes nothing
    python scripts/bench_vs_dcp.py --json     # one JSON object on stdout

Progress goes to stderr, the table (or JSON) to stdout.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

import tenplex
from tenplex import PTC, ParallelConfig, Split, model_ptc
from tenplex.layout.ptc import PAD, TensorSpec
from tenplex.train.launch import free_port

REPO = Path(__file__).resolve().parent.parent
LOAD_MODES = ("native", "fsspec", "hosts")
MiB = 2**20


def log(msg: str) -> None:
    print(f"[bench_vs_dcp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def P(text: str) -> ParallelConfig:
    return ParallelConfig.parse(text)


@dataclass(frozen=True)
class Pair:
    name: str
    old: ParallelConfig
    new: ParallelConfig


PAIRS = [
    Pair("TP 2->4", P("tp=2"), P("tp=4")),
    Pair("DP 4->2", P("dp=4"), P("dp=2")),
    Pair("TPxDP dp=4 -> dp=2,tp=2", P("dp=4"), P("dp=2,tp=2")),
    Pair("PP tp=2,pp=2 -> pp=4", P("tp=2,pp=2"), P("pp=4")),
    Pair("TPxDP dp=2,tp=2 -> dp=4", P("dp=2,tp=2"), P("dp=4")),  # not by default (every rank needs the whole model)
]
DEFAULT_PAIRS = 4
QUICK_MODEL = dict(arch="gpt", num_layers=4, hidden=256, heads=8, vocab=5000, seq_len=256, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# a counting fsspec filesystem (local files underneath), used by both systems
# ---------------------------------------------------------------------------------------------
COUNTS = {"data": 0, "meta": 0, "calls": 0}


def _bucket(path: str) -> str:
    return "data" if str(path).endswith((".safetensors", ".distcp")) else "meta"


class _CountingFile(io.RawIOBase):
    def __init__(self, f: Any, path: str) -> None:
        self.f, self.kind = f, _bucket(path)

    def _add(self, n: int) -> None:
        COUNTS[self.kind] += n
        COUNTS["calls"] += 1

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self._add(len(b))
        return b

    def readinto(self, buf: Any) -> int:
        n = self.f.readinto(buf)
        self._add(n or 0)
        return n

    def readall(self) -> bytes:
        return self.read(-1)

    def write(self, b: Any) -> int:
        return self.f.write(b)

    def seek(self, off: int, whence: int = 0) -> int:
        return self.f.seek(off, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return self.f.writable()

    def flush(self) -> None:
        if not self.f.closed:
            self.f.flush()

    def close(self) -> None:
        super().close()
        self.f.close()


class CountingFileSystem(AbstractFileSystem):
    """Local files under ``count://``; every byte read through it is counted (COUNTS)."""

    protocol = "count"
    root_marker = "/"
    cachable = False

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return path[len("count://"):] if path.startswith("count://") else path

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        return self.local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kw: Any) -> Any:
        return self.local.info(self._strip_protocol(path))

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode:
            return io.BufferedReader(_CountingFile(open(path, "rb"), path), buffer_size=1)  # noqa: SIM115
        return self.local._open(path, mode)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        path = self._strip_protocol(path)
        data = self.local.cat_file(path, start=start, end=end)
        COUNTS[_bucket(path)] += len(data)
        COUNTS["calls"] += 1
        return data

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.local.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kw: Any) -> None:
        self.local.makedirs(self._strip_protocol(path), exist_ok=True)

    def mv(self, path1: str, path2: str, **kw: Any) -> None:
        self.local.mv(self._strip_protocol(path1), self._strip_protocol(path2))

    def rm_file(self, path: str) -> None:
        self.local.rm_file(self._strip_protocol(path))

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self.local.rm(self._strip_protocol(path), recursive=recursive)


fsspec.register_implementation("count", CountingFileSystem, clobber=True)


def evict(root: Path) -> None:
    """Drop a directory's file pages from the page cache, so the next read comes from storage."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # write dirty pages back first: DONTNEED drops clean pages only
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------------------------
# deterministic global tensors, computed piecewise from global indices
# ---------------------------------------------------------------------------------------------
def _salt(name: str) -> int:
    return zlib.crc32(name.encode()) % 65521


def values(idx: torch.Tensor, name: str) -> torch.Tensor:
    """Element values of tensor ``name`` at natural (row-major) flat indices ``idx``; -1 -> 0."""
    v = ((idx * 40503 + _salt(name)) % 65521).to(torch.float32) - 32760.0
    return torch.where(idx < 0, torch.zeros((), dtype=torch.float32), v)


def tenplex_local(ptc: PTC, name: str, cfg: ParallelConfig, rank: int) -> torch.Tensor:
    """``rank``'s tenplex shard of ``name`` under ``cfg`` (natural local shape)."""
    spec = ptc.tensors[name]
    idx = torch.arange(spec.numel, dtype=torch.int64).reshape(spec.shape)
    canon = spec.to_canonical(idx)
    segs = ptc.segments(name, cfg, rank)
    local = torch.full((sum(ln for _, _, ln in segs),), -1, dtype=torch.int64)
    for lo, g, ln in segs:
        if g != PAD:
            local[lo : lo + ln] = canon[g : g + ln]
    return ptc.from_local_flat(name, cfg, values(local, name))


# ---------------------------------------------------------------------------------------------
# the DCP side: DTensor placements equivalent to the PTC's TP split
# ---------------------------------------------------------------------------------------------
def dcp_view_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Fused equal blocks ([q; k; v] of GPT) are saved as a (blocks, rows, ...) tensor whose
    Shard(1) equals the PTC's per-block split; every other tensor keeps its shape."""
    if isinstance(spec.tp, Split) and spec.tp.blocks is not None:
        b = spec.tp.blocks
        if len(set(b)) != 1 or spec.tp.dim != 0:
            raise ValueError(f"{spec.name}: unequal fused blocks have no single DTensor placement; split the tensor")
        return (len(b), b[0]) + spec.shape[1:]
    return spec.shape


def dcp_shard_dim(spec: TensorSpec) -> int | None:
    if not isinstance(spec.tp, Split):
        return None
    return 1 if spec.tp.blocks is not None else spec.tp.dim


def dcp_local(spec: TensorSpec, name: str, mesh: Any, placements: Any) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = dcp_view_shape(spec)
    lshape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
    idx = torch.arange(spec.numel, dtype=torch.int64).reshape(shape)
    for d, (o, n) in enumerate(zip(off, lshape)):
        idx = idx.narrow(d, o, n)
    return values(idx.contiguous(), name)


def dcp_state(ptc: PTC, cfg: ParallelConfig, rank: int, mesh: Any, fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for name in ptc.rank_tensors(cfg, rank):
        spec = ptc.tensors[name]
        d = dcp_shard_dim(spec)
        placements = (Replicate(), Replicate() if d is None else Shard(d))
        shape = dcp_view_shape(spec)
        if fill:
            local = dcp_local(spec, name, mesh, placements)
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = torch.empty(compute_local_shape_and_global_offset(shape, mesh, placements)[0])
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        out[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                       stride=stride)
    return out


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------
def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stage_mesh(cfg: ParallelConfig, rank: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
    return mesh["dp", "tp"]


def _read_bytes() -> int:
    """Bytes this process caused to be fetched from the block device (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _load_once(phase: str, mode: str, ptc: PTC, cfg: ParallelConfig, rank: int, mesh: Any,
               tdir: Path, reference: dict[str, torch.Tensor] | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One load of this rank's shard, measured and verified. ``mode``: "native" (each system's
    own local-file path: tenplex's mmap slices, DCP's FileSystemReader) or "fsspec" (both
    through the counting filesystem). Verified against the deterministic global tensors, or
    against ``reference`` (the same system's earlier load) when given."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    pre = "count://" if mode == "fsspec" else ""
    base = tdir / f"host-{rank:02d}" if mode == "hosts" else tdir  # "hosts": this rank's own copy
    res: dict[str, Any] = {}
    for k in ("data", "meta", "calls"):
        COUNTS[k] = 0
    rss0, io0 = _maxrss(), _read_bytes()
    t0 = time.perf_counter()
    if phase == "load_tenplex":
        out = tenplex.load(f"{pre}{base}/tenplex", cfg, rank, ptc=ptc)
        t1 = time.perf_counter()
        loaded = {n: out.shard[n] for n in ptc.rank_tensors(cfg, rank)}
        res["stats_bytes_read"] = out.stats.bytes_read
        res["bytes_needed"] = out.stats.bytes_needed
        assert out.shard["optimizer.step"] == 100
    else:
        state = dcp_state(ptc, cfg, rank, mesh, fill=False)
        reader = FsspecReader(f"{pre}{base}/dcp") if mode == "fsspec" else dcp.FileSystemReader(f"{base}/dcp")
        dcp.load(state, storage_reader=reader)
        t1 = time.perf_counter()
        loaded = {n: t.to_local() for n, t in state.items()}
    res["load_s"] = t1 - t0
    res["storage_read"] = _read_bytes() - io0
    res["peak_rss_growth"] = _maxrss() - rss0
    res["data_bytes"], res["meta_bytes"], res["read_calls"] = COUNTS["data"], COUNTS["meta"], COUNTS["calls"]
    torch.distributed.barrier()  # every rank done loading before any verifies (no CPU stolen from a load)
    bad = []
    for n, t in loaded.items():  # bit for bit against the deterministic global tensors
        if reference is not None:
            want = reference[n]
        elif phase == "load_tenplex":
            want = tenplex_local(ptc, n, cfg, rank)
        else:
            want = dcp_local(ptc.tensors[n], n, mesh, state[n].placements)
        if not torch.equal(t, want):
            bad.append(n)
    res["verified"] = len(loaded) - len(bad)
    res["bad"] = bad[:5]
    return res, loaded


WARM_PTC = PTC([TensorSpec("w", (64,), torch.float32)])


def _warm(rank: int, cfg: ParallelConfig, mesh: Any, tdir: Path, *, save: bool, dcp_side: bool = False) -> None:
    """Save (or load) a one-tensor checkpoint with both systems, so that the measured load is
    not the first call in its process (lazy imports, first collectives, code paths)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate

    if save:
        tenplex.save(f"{tdir}/warm-tenplex", WARM_PTC, cfg, rank, {"w": torch.ones(64)}, step=0, save_id="0000beef")
        dcp.save({"w": DTensor.from_local(torch.ones(64), mesh, (Replicate(), Replicate()))},
                 storage_writer=dcp.FileSystemWriter(f"{tdir}/warm-dcp", sync_files=False))
    elif dcp_side:
        st = {"w": DTensor.from_local(torch.zeros(64), mesh, (Replicate(), Replicate()))}
        dcp.load(st, storage_reader=dcp.FileSystemReader(f"{tdir}/warm-dcp"))
        assert bool((st["w"].to_local() == 1).all())
    else:
        assert bool((tenplex.load(f"{tdir}/warm-tenplex", cfg, rank).shard["w"] == 1).all())


def worker(rank: int, world: int, port: int, phase: str, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ptc = PTC.from_json(spec["ptc"])
    tdir = Path(spec["tmp"])
    turl, durl = f"count://{tdir}/tenplex", f"count://{tdir}/dcp"
    res: dict[str, Any] = {"rank": rank}
    try:
        if phase == "save":
            cfg = P(spec["old"])
            mesh = _stage_mesh(cfg, rank)
            shard = {n: tenplex_local(ptc, n, cfg, rank) for n in ptc.rank_tensors(cfg, rank)}
            shard["optimizer.step"] = 100
            dist.barrier()
            t0 = time.perf_counter()
            tenplex.save(turl, ptc, cfg, rank, shard, step=100, save_id="0000beef")
            dist.barrier()
            res["tenplex_save_s"] = time.perf_counter() - t0
            del shard
            state = dcp_state(ptc, cfg, rank, mesh, fill=True)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(durl, sync_files=False))
            dist.barrier()
            res["dcp_save_s"] = time.perf_counter() - t0
            _warm(rank, cfg, mesh, tdir, save=True)
        else:
            cfg = P(spec["new"])
            mesh = _stage_mesh(cfg, rank) if phase == "load_dcp" else None
            _warm(rank, cfg, mesh, tdir, save=False, dcp_side=phase == "load_dcp")
            ref = None
            for mode in ("native", "fsspec", "hosts"):  # native first: the process is fresh, so maxrss is its own
                if rank == 0:
                    evict(tdir)
                dist.barrier()
                res[mode], ref = _load_once(phase, mode, ptc, cfg, rank, mesh, tdir, ref)
                dist.barrier()
        (tdir / f"result-{phase}-{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def run_phase(phase: str, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    tdir = Path(spec["tmp"])
    for f in tdir.glob(f"result-{phase}-*.json"):
        f.unlink()
    mp.start_processes(worker, args=(world, free_port(), phase, spec), nprocs=world, join=True,
                       start_method="spawn")
    return [json.loads((tdir / f"result-{phase}-{r}.json").read_text()) for r in range(world)]


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def bench_pair(pair: Pair, ptc: PTC, tmp_root: Path) -> dict[str, Any]:
    tdir = Path(tempfile.mkdtemp(prefix="vsdcp-", dir=tmp_root))
    spec = {"ptc": ptc.to_json(), "tmp": str(tdir), "old": str(pair.old), "new": str(pair.new)}
    try:
        log(f"{pair.name}: save under {pair.old} ({pair.old.world_size} processes)")
        saves = run_phase("save", pair.old.world_size, spec)
        for r in range(pair.new.world_size):  # one copy of both checkpoints per new rank: see module docstring
            for system in ("tenplex", "dcp"):
                shutil.copytree(tdir / system, tdir / f"host-{r:02d}" / system)
        log(f"{pair.name}: tenplex load under {pair.new} ({pair.new.world_size} processes)")
        tl = run_phase("load_tenplex", pair.new.world_size, spec)
        log(f"{pair.name}: DCP load under {pair.new}")
        dl = run_phase("load_dcp", pair.new.world_size, spec)
        needed = sum(r["native"]["bytes_needed"] for r in tl)
        S = lambda rs, mode, k: sum(r[mode][k] for r in rs)  # noqa: E731
        M = lambda rs, mode, k: max(r[mode][k] for r in rs)  # noqa: E731
        out = {
            "name": pair.name, "from": str(pair.old), "to": str(pair.new),
            "bytes_needed": needed,
            "tenplex_bytes_read": S(tl, "fsspec", "data_bytes"),
            "dcp_bytes_read": S(dl, "fsspec", "data_bytes"),
            "tenplex_meta_bytes": S(tl, "fsspec", "meta_bytes"),
            "dcp_meta_bytes": S(dl, "fsspec", "meta_bytes"),
            "tenplex_stats_bytes_read": S(tl, "fsspec", "stats_bytes_read"),
            "tenplex_storage_read": S(tl, "native", "storage_read"),
            "dcp_storage_read": S(dl, "native", "storage_read"),
            "tenplex_load_s": M(tl, "native", "load_s"),
            "dcp_load_s": M(dl, "native", "load_s"),
            "tenplex_load_s_fsspec": M(tl, "fsspec", "load_s"),
            "dcp_load_s_fsspec": M(dl, "fsspec", "load_s"),
            "tenplex_load_s_hosts": M(tl, "hosts", "load_s"),
            "dcp_load_s_hosts": M(dl, "hosts", "load_s"),
            "tenplex_storage_read_hosts": S(tl, "hosts", "storage_read"),
            "dcp_storage_read_hosts": S(dl, "hosts", "storage_read"),
            "tenplex_peak_mem": M(tl, "native", "peak_rss_growth"),
            "dcp_peak_mem": M(dl, "native", "peak_rss_growth"),
            "tenplex_save_s": max(r["tenplex_save_s"] for r in saves),
            "dcp_save_s": max(r["dcp_save_s"] for r in saves),
            "tenplex_ckpt_bytes": _dir_bytes(tdir / "tenplex"),
            "dcp_ckpt_bytes": _dir_bytes(tdir / "dcp"),
            "tenplex_verified": sum(r[m]["verified"] for r in tl for m in LOAD_MODES),
            "dcp_verified": sum(r[m]["verified"] for r in dl for m in LOAD_MODES),
            "verify_failures": [b for r in tl + dl for m in LOAD_MODES for b in r[m]["bad"]],
        }
        if out["verify_failures"]:
            raise AssertionError(f"{pair.name}: loaded tensors differ: {out['verify_failures']}")
        out["tenplex_read_ratio"] = out["tenplex_bytes_read"] / needed
        out["dcp_read_ratio"] = out["dcp_bytes_read"] / needed
        out["load_speedup"] = out["dcp_load_s"] / out["tenplex_load_s"]
        out["load_speedup_fsspec"] = out["dcp_load_s_fsspec"] / out["tenplex_load_s_fsspec"]
        out["load_speedup_hosts"] = out["dcp_load_s_hosts"] / out["tenplex_load_s_hosts"]
        log(f"{pair.name}: needed {needed / MiB:.0f} MiB; read tenplex {out['tenplex_read_ratio']:.3f}x, "
            f"DCP {out['dcp_read_ratio']:.3f}x; load {out['tenplex_load_s']:.2f}s vs {out['dcp_load_s']:.2f}s "
            f"(through fsspec {out['tenplex_load_s_fsspec']:.2f}s vs {out['dcp_load_s_fsspec']:.2f}s; own copy per "
            f"rank {out['tenplex_load_s_hosts']:.2f}s vs {out['dcp_load_s_hosts']:.2f}s)")
        return out
    finally:
        shutil.rmtree(tdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# part 2: planning at scale
# ---------------------------------------------------------------------------------------------
PLAN_CASES = [
    ("llama3-70b 64 -> 128 GPUs", "llama3-70b", P("dp=1,tp=8,pp=8"), P("dp=2,tp=8,pp=8")),
    ("llama3-70b 64 -> 128 GPUs, PP 8 -> 16", "llama3-70b", P("dp=1,tp=8,pp=8"), P("dp=1,tp=8,pp=16")),
    ("gpt3-175b 1024 GPUs dp<->tp", "gpt3-175b", P("dp=8,tp=8,pp=16"), P("dp=16,tp=4,pp=16")),
    ("gpt3-175b 1024 -> 768 GPUs", "gpt3-175b", P("dp=8,tp=8,pp=16"), P("dp=6,tp=8,pp=16")),
    ("llama3-70b 64 -> 128 GPUs, dist. optimizer", "llama3-70b", P("dp=1,tp=8,pp=8"), P("dp=2,tp=8,pp=8"), True),
    ("gpt3-175b 1024 GPUs dp<->tp, dist. optimizer", "gpt3-175b", P("dp=8,tp=8,pp=16"), P("dp=16,tp=4,pp=16"), True),
]


def _dcp_tensors(spec: TensorSpec) -> list[tuple[str, tuple[int, ...], int | None]]:
    """DCP (torchtitan-style) tensors for one PTC tensor: fused blocks become separate tensors
    (wq/wk/wv, w1/w3), each Shard(0); others keep their shape and shard dim."""
    if isinstance(spec.tp, Split) and spec.tp.blocks is not None:
        return [(f"{spec.name}.{i}", (b,) + spec.shape[1:], 0) for i, b in enumerate(spec.tp.blocks)]
    return [(spec.name, spec.shape, spec.split_dim)]


def _chunk(shape: tuple[int, ...], dim: int | None, tp: int, t: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch.chunk-style Shard(dim) piece t of tp (what DTensor computes)."""
    if dim is None:
        return (0,) * len(shape), shape
    n = shape[dim]
    per = -(-n // tp)
    lo, hi = min(t * per, n), min((t + 1) * per, n)
    off = [0] * len(shape)
    size = list(shape)
    off[dim], size[dim] = lo, hi - lo
    return tuple(off), tuple(size)


def _box(shape: tuple[int, ...], shards: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes after applying ``(dim, parts, index)`` Shard placements in mesh order
    (DTensor's ``compute_local_shape_and_global_offset``: each shard chunks the current piece)."""
    off, size = [0] * len(shape), list(shape)
    for dim, parts, i in shards:
        n = size[dim]
        per = -(-n // parts)
        lo, hi = min(i * per, n), min((i + 1) * per, n)
        off[dim] += lo
        size[dim] = hi - lo
    return tuple(off), tuple(size)


def _shards(dp_sharded: bool, dim: int | None, cfg: ParallelConfig, d: int, t: int) -> list[tuple[int, int, int]]:
    out = [(0, cfg.dp, d)] if dp_sharded else []  # FSDP/ZeRO-style Shard(0) over the DP mesh dim
    return out + ([(dim, cfg.tp, t)] if dim is not None else [])


def dcp_plan_time(ptc: PTC, old: ParallelConfig, new: ParallelConfig, sample_ranks: int) -> dict[str, Any]:
    """Time DCP's resharding (``create_read_items_for_chunk_list``) for some new ranks.

    The saved metadata holds, per tensor, the distinct chunks of ``old``: one per TP rank for
    DP-replicated tensors (DCP saves replicas once), one per (DP, TP) rank for DP-sharded
    optimizer state (placements ``(Shard(0), Shard(d))`` on the (dp, tp) mesh). For each sampled
    new rank, every tensor it holds under ``new`` is planned as ``create_local_plan`` would.
    Building the metadata is not timed.
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    md: dict[str, TensorStorageMetadata] = {}
    for spec in ptc.tensors.values():
        for fqn, shape, dim in _dcp_tensors(spec):
            chunks = []
            for d in range(old.dp if spec.dp_sharded else 1):
                for t in range(old.tp if dim is not None else 1):
                    off, size = _box(shape, _shards(spec.dp_sharded, dim, old, d, t))
                    if all(size):
                        chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
            md[fqn] = TensorStorageMetadata(TensorProperties(dtype=spec.dtype), torch.Size(shape), chunks)
    world = new.world_size
    step = max(1, world // sample_ranks)
    ranks = list(range(0, world, step))[:sample_ranks]
    times, items = [], 0
    for r in ranks:
        c = new.coords(r)
        t0 = time.perf_counter()
        for name in ptc.rank_tensors(new, r):
            spec = ptc.tensors[name]
            for fqn, shape, dim in _dcp_tensors(spec):
                off, size = _box(shape, _shards(spec.dp_sharded, dim, new, c.dp, c.tp))
                items += len(create_read_items_for_chunk_list(
                    fqn, md[fqn], [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))]))
        times.append(time.perf_counter() - t0)
    mean = sum(times) / len(times)
    return {"dcp_ranks_timed": len(ranks), "dcp_per_rank_s": mean, "dcp_max_rank_s": max(times),
            "dcp_all_ranks_s": mean * world, "dcp_read_items_sampled": items}


def bench_plans(reps: int, sample_ranks: int) -> list[dict[str, Any]]:
    out = []
    for name, preset, old, new, *dist in PLAN_CASES:
        ptc = model_ptc(preset, distributed_optimizer=bool(dist and dist[0]))
        best = math.inf
        for _ in range(reps):
            for fn in (getattr(tenplex.layout.config, "_holder_table", None), getattr(tenplex.layout.config, "_stage_map", None)):
                if fn is not None:
                    fn.cache_clear()
            t0 = time.perf_counter()
            p = tenplex.plan(ptc, old, new)
            best = min(best, time.perf_counter() - t0)
        row = {"name": name, "model": preset, "distributed_optimizer": bool(dist and dist[0]),
               "from": str(old), "to": str(new), "gpus_from": old.world_size,
               "gpus_to": new.world_size, "tensors": len(ptc), "tenplex_plan_s": best,
               "tenplex_bytes_moved": p.stats.bytes_moved}
        row.update(dcp_plan_time(ptc, old, new, sample_ranks))
        log(f"plan {name}: tenplex {best:.2f}s (all ranks, one process); DCP {row['dcp_per_rank_s']:.3f}s per rank, "
            f"{row['dcp_all_ranks_s']:.1f}s over all {new.world_size} ranks")
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / MiB:,.0f}"


def pair_table(pairs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["pair", "from", "to", "needed MiB", "read/needed tenplex", "read/needed DCP",
            "storage read/needed tenplex", "storage read/needed DCP", "load s tenplex", "load s DCP",
            "DCP/tenplex load", "fsspec load s tenplex", "fsspec load s DCP", "own copy load s tenplex",
            "own copy load s DCP", "DCP/tenplex own copy", "peak MiB tenplex", "peak MiB DCP",
            "save s tenplex", "save s DCP"]
    rows = [[p["name"], p["from"], p["to"], _mib(p["bytes_needed"]), f"{p['tenplex_read_ratio']:.3f}x",
             f"{p['dcp_read_ratio']:.3f}x", f"{p['tenplex_storage_read'] / p['bytes_needed']:.3f}x",
             f"{p['dcp_storage_read'] / p['bytes_needed']:.3f}x", f"{p['tenplex_load_s']:.2f}",
             f"{p['dcp_load_s']:.2f}", f"{p['load_speedup']:.2f}x", f"{p['tenplex_load_s_fsspec']:.2f}",
             f"{p['dcp_load_s_fsspec']:.2f}", f"{p['tenplex_load_s_hosts']:.2f}", f"{p['dcp_load_s_hosts']:.2f}",
             f"{p['load_speedup_hosts']:.2f}x", _mib(p["tenplex_peak_mem"]), _mib(p["dcp_peak_mem"]),
             f"{p['tenplex_save_s']:.2f}", f"{p['dcp_save_s']:.2f}"] for p in pairs]
    return head, rows


def plan_table(plans: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["case", "from", "to", "tenplex plan s (all ranks)", "DCP s per rank", "DCP s all ranks (extrapolated)",
            "ranks timed"]
    rows = [[p["name"], p["from"], p["to"], f"{p['tenplex_plan_s']:.2f}", f"{p['dcp_per_rank_s']:.3f}",
             f"{p['dcp_all_ranks_s']:.1f}", str(p["dcp_ranks_timed"])] for p in plans]
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(r) for r in rows])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])


def plot(pairs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["name"] for p in pairs]
    x = range(len(names))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (key_t, key_d, title) in zip(axes, [
        ("tenplex_read_ratio", "dcp_read_ratio", "bytes read / bytes needed"),
        ("tenplex_load_s", "dcp_load_s", "load time (s, slowest rank, shared page cache)"),
        ("tenplex_load_s_hosts", "dcp_load_s_hosts", "load time (s, slowest rank, own copy per rank)"),
        ("tenplex_peak_mem", "dcp_peak_mem", "peak RSS growth during load (MiB, largest rank)"),
    ]):
        scale = MiB if "mem" in key_t else 1
        ax.bar([i - 0.2 for i in x], [p[key_t] / scale for p in pairs], 0.4, label="tenplex")
        ax.bar([i + 0.2 for i in x], [p[key_d] / scale for p in pairs], 0.4, label="DCP")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# tenplex versus DCP",
        "",
        f"Generated by `{report['command']}` on {report['date']} ({m['cpus']} CPUs, torch {m['torch']}, "
        f"{m['python']}; tenplex at {report.get('git', 'unknown')}). Model: {report['model']} ({report['params'] / 1e6:.0f}M parameters, Adam state, fp32, "
        f"{report['model_bytes'] / MiB:,.0f} MiB in all). Method: docs/benchmarks.md.",
        "",
        "## Resharding loads",
        "",
        md_table(*pair_table(report["pairs"])),
        "",
        "![tenplex vs DCP](bench_vs_dcp.png)",
        "",
    ]
    if report.get("plans"):
        lines += ["## Load planning at scale", "", md_table(*plan_table(report["plans"])), ""]
    return "\n".join(lines)


def _git_state() -> str:
    """The commit measured, and the tracked files modified in the working tree."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.split()
    except OSError:
        return "unknown"
    return head + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4-layer GPT, writes nothing unless --out is given")
    ap.add_argument("--model", default="gpt-100m", help="model preset (default gpt-100m)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--out", default=None, help="write <out>.md/.json/.png (default docs/bench/bench_vs_dcp unless --quick)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--pairs", default=None,
                    help=f"comma-separated indexes into PAIRS (default 0-{DEFAULT_PAIRS - 1}; {len(PAIRS) - 1} is "
                         "dp=2,tp=2 -> dp=4)")
    ap.add_argument("--skip-plans", action="store_true", help="skip the planning-at-scale part")
    ap.add_argument("--plan-reps", type=int, default=2)
    ap.add_argument("--sample-ranks", type=int, default=4, help="new ranks DCP planning is timed for")
    args = ap.parse_args(argv)

    if args.quick:
        ptc = model_ptc(**QUICK_MODEL)
        model = "quick GPT (4 layers, hidden 256, vocab 5000)"
    else:
        ptc = model_ptc(args.model, dtype=torch.float32)
        model = args.model
    pairs = PAIRS[:DEFAULT_PAIRS] if args.pairs is None else [PAIRS[int(i)] for i in args.pairs.split(",")]
    tmp_root = Path(args.tmpdir or tempfile.gettempdir())
    log(f"{model}: {ptc}")
    results = [bench_pair(p, ptc, tmp_root) for p in pairs]
    plans = [] if (args.skip_plans or args.quick) else bench_plans(args.plan_reps, args.sample_ranks)
    params = sum(s.numel for n, s in ptc.tensors.items() if not n.startswith("optimizer."))
    report = {
        "command": "python scripts/bench_vs_dcp.py" + (" --quick" if args.quick else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "git": _git_state(),
        "model": model, "params": params, "model_bytes": ptc.nbytes,
        "bytes_counted": "data bytes read through a counting fsspec filesystem (count://) by both systems",
        "pairs": results, "plans": plans,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(text_table(*pair_table(results)))
        if plans:
            print()
            print(text_table(*plan_table(plans)))
    out = args.out or (None if args.quick else str(REPO / "docs" / "bench" / "bench_vs_dcp"))
    if out and not args.no_write:
        Path(out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(out + ".md").write_text(markdown(report))
        plot(results, Path(out + ".png"))
        log(f"wrote {out}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
