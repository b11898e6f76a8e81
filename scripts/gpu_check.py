#!/usr/bin/env python
"""One prepared GPU check (``make gpu-check``): the CUDA paths of tenplex on one GPU, in one run.

A session lent a GPU runs it once (under 8 minutes on one H200, start-up included in no part):
it writes ``docs/gpu/<date>.json`` and prints a summary. The parts, each in its own process with
its own time budget (a part that fails or runs out of time is recorded, the others still run,
the JSON is always written):

- ``tests``: the repository's tests that skip without CUDA (found in tests/ by their
  ``skipif(not torch.cuda.is_available())``), nccl included (the trainer under torchrun, world 1);
- ``load``: the pinned and pageable host-to-device bandwidth, then ``tenplex.load_state_dict``
  into CUDA DTensors of a state two gloo processes saved on another mesh, bit for bit, its
  GB/s against the pinned bandwidth (goal >= 0.8x) and against the same load into CPU tensors;
- ``bubbles``: snapshot overhead in pipeline bubbles (``scripts/bench_bubbles_cuda.py``);
- ``memory``: ``estimate_memory`` with each recompute mode against the trainer's
  ``torch.cuda.max_memory_allocated`` (``scripts/measure_memory.py``), and the activations
  autograd keeps per mode (``scripts/measure_recompute.py``);
- ``live``: the in-process live move on one device: the survivor of ``tp=2`` alone in an nccl
  group of one moves its CUDA state to ``tp=1`` (``tenplex.rescale(..., live=...)``), the dead
  rank's half read from the checkpoint, bit for bit.

It checks what it needs first (CUDA, nccl, free GPU memory and disk) and stops with one line and
exit code 2 otherwise. ``--dry-run`` runs the same parts on CPU (gloo, small sizes, the JSON in a
temporary file unless ``--out``): CI runs it (tests/test_gpu_check.py) so that the script does not rot.

    python scripts/gpu_check.py [--dry-run] [--out PATH] [--parts tests,load,bubbles,memory,live]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from figures import spread  # noqa: E402 - the benchmarks' figure over repeats

GiB = 1 << 30
MIN_FREE_GPU = 24 * GiB  # the largest part (memory: llama-100m, seq 2048, micro-batch 8) peaked at 16 GiB on an H100
MIN_FREE_DISK = 12 * GiB  # two checkpoints (2 GiB of DTensors, llama-100m with Adam) and the trainer's
TOTAL_GOAL_S = 480.0  # issue 33: the whole check in <= 8 minutes on one GPU
LOAD_GOAL = 0.8  # in-place CUDA loads >= 0.8x the pinned host-to-device bandwidth


@dataclass(frozen=True)
class Ctx:
    """What a part runs on: the device, whether this is the CPU dry run, a scratch directory."""

    dry: bool
    work: Path

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry else torch.device("cuda", 0)


def sync(dev: torch.device) -> None:
    """Wait for ``dev``'s queued work before reading a clock (nothing to wait for on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (on the CPU)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# what the check needs
# ---------------------------------------------------------------------------------------------
def preflight(work: Path) -> dict[str, Any]:
    """The device's description; RuntimeError with one line naming what is missing."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                           "run on a GPU machine, or --dry-run for the CPU dry run")
    if not dist.is_nccl_available():
        raise RuntimeError(f"torch {torch.__version__} has no nccl backend; the nccl parts cannot run")
    free, total = torch.cuda.mem_get_info(0)
    if free < MIN_FREE_GPU:
        raise RuntimeError(f"cuda:0 has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB, the check needs "
                           f">= {MIN_FREE_GPU / GiB:.0f} GiB (other processes on it? nvidia-smi)")
    disk = shutil.disk_usage(work).free
    if disk < MIN_FREE_DISK:
        raise RuntimeError(f"{work} has {disk / GiB:.1f} GiB free, the check needs >= {MIN_FREE_DISK / GiB:.0f} GiB "
                           "(set TMPDIR)")
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_total": total,
            "memory_free": free, "count": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


# ---------------------------------------------------------------------------------------------
# part: the CUDA tests of the repository
# ---------------------------------------------------------------------------------------------
_SKIPIF_CUDA = re.compile(r"@pytest\.mark\.skipif\(\s*not torch\.cuda\.is_available\(\)")
_DEF = re.compile(r"^def (test_\w+)", re.M)


def cuda_tests(tests_dir: Path) -> list[str]:
    """Node ids of the tests that skip without CUDA (a ``skipif(not torch.cuda.is_available())``
    decorator on a test function), in file order."""
    ids = []
    for path in sorted(tests_dir.glob("test_*.py")):
        text = path.read_text()
        for m in _SKIPIF_CUDA.finditer(text):
            d = _DEF.search(text, m.end())
            if d is not None:
                ids.append(f"{path.relative_to(tests_dir.parent).as_posix()}::{d.group(1)}")
    return ids


def junit_outcomes(xml_path: Path) -> list[dict[str, Any]]:
    """Each test case of a pytest ``--junitxml`` report: id, outcome, seconds, message."""
    out = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome, message = {"failure": "failed"}.get(kind, kind), (el.get("message") or "")[:500]
                break
        path = case.get("classname", "").replace(".", "/") + ".py"
        out.append({"id": f"{path}::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time", 0)),
                    "message": message})
    return out


def part_tests(ctx: Ctx) -> dict[str, Any]:
    """pytest on the tests that skip without CUDA; on the GPU every one must pass (a skip fails)."""
    ids = cuda_tests(ROOT / "tests")
    if not ids:
        raise RuntimeError("no test in tests/ skips without CUDA: the pattern cuda_tests() looks for changed")
    report = ctx.work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}", *ids]
    print(f"pytest {' '.join(ids)}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, timeout=PARTS["tests"].budget(ctx.dry) - 10)
    cases = junit_outcomes(report)
    bad = [c for c in cases if c["outcome"] in ("failed", "error") or (not ctx.dry and c["outcome"] == "skipped")]
    if bad or res.returncode not in (0, 5) or len(cases) != len(ids):
        raise PartFailed(f"{len(bad)} of {len(ids)} CUDA tests did not pass (pytest rc {res.returncode}): "
                         + "; ".join(f"{c['id']}: {c['outcome']} {c['message'] or ''}"[:300] for c in bad),
                         {"tests": cases})
    return {"tests": cases, "passed": sum(c["outcome"] == "passed" for c in cases),
            "skipped": sum(c["outcome"] == "skipped" for c in cases)}


# ---------------------------------------------------------------------------------------------
# part: in-place loads into CUDA DTensors against the host-to-device bandwidth
# ---------------------------------------------------------------------------------------------
def load_tensors(dry: bool) -> dict[str, tuple[tuple[int, int], torch.dtype, int]]:
    """The DTensor state of the load part: name -> (global shape, dtype, the dim the savers split).
    2 GiB on a GPU (128 MiB a tensor, fp32 and bf16, split on rows and on columns), 2 MiB dry."""
    rows, cols = (256, 128) if dry else (8192, 4096)
    out = {}
    for i in range(16):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        shape = (rows, cols * (2 if dtype == torch.bfloat16 else 1))
        out[f"layers.{i // 2}.w{i % 2}"] = (shape, dtype, i % 2)
    return out


def global_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The deterministic global value of a tensor (the savers and the check draw the same)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(shape))
    return torch.randn(shape, generator=gen).to(dtype)


def _save_worker(rank: int, port: int, url: str, dry: bool) -> None:
    """One of the two gloo processes that save the load part's state as DTensors on a mesh of 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import tenplex

    torch.set_num_threads(4)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sd = {}
        for name, (shape, dtype, dim) in load_tensors(dry).items():
            local = global_tensor(name, shape, dtype).chunk(2, dim)[rank].contiguous()
            sd[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
        tenplex.save_state_dict(sd, url, step=1)
        dist.barrier()  # rank 0 holds the store: it leaves last
    finally:
        dist.destroy_process_group()


def save_on_two_ranks(url: str, dry: bool, timeout: float) -> float:
    """The load part's checkpoint, saved by 2 gloo processes on CPU; seconds taken. They are forked
    (a fork costs no imports): call this before the first CUDA call of the process."""
    import multiprocessing as mp

    from tenplex.train.launch import free_port

    t0 = time.perf_counter()
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_save_worker, args=(r, port, url, dry)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.perf_counter() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"the savers exited with {[p.exitcode for p in procs]} (timeout {timeout:.0f}s)")
    return time.perf_counter() - t0


def copy_bandwidth(dev: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    """GB/s of host-to-``dev`` copies of ``nbytes`` from pinned and from pageable memory (on CPU,
    both are host copies: the dry run's stand-in)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {}
    for kind in ("pinned", "pageable"):
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned" and dev.type == "cuda")
        rates = []
        for i in range(repeats + 1):
            sync(dev)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            sync(dev)
            if i:  # the first copy is a warm-up
                rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        out[f"{kind}_gbps"] = spread(rates)
        del src
    return out


def init_world_of_one(dev: torch.device) -> None:
    """A default process group of one: nccl on the GPU, gloo in the dry run."""
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def timed_loads(state: dict[str, Any], url: str, dev: torch.device, repeats: int) -> tuple[list[float], Any]:
    """Seconds of ``repeats`` in-place loads of ``state`` (zeroed before each), and the last result."""
    import tenplex

    times, res = [], None
    for _ in range(repeats):
        for t in state.values():
            (t.to_local() if hasattr(t, "to_local") else t).zero_()
        sync(dev)
        t0 = time.perf_counter()
        res = tenplex.load_state_dict(state, url)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times, res


def part_load(ctx: Ctx) -> dict[str, Any]:
    """Host-to-device bandwidth, then in-place loads of a state saved on a mesh of 2 into DTensors
    on a mesh of one on the device (bit for bit), and into CPU tensors for comparison."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dev, repeats = ctx.device, 1 if ctx.dry else 3
    url = str(ctx.work / "ckpt-load")
    figures: dict[str, Any] = {"device": str(dev)}
    figures["save_s"] = save_on_two_ranks(url, ctx.dry, timeout=PARTS["load"].budget(ctx.dry) / 2)  # forks: first
    figures.update(copy_bandwidth(dev, (8 << 20) if ctx.dry else GiB, 2 if ctx.dry else 5))
    print(f"saved in {figures['save_s']:.1f}s; host-to-device GB/s: pinned {figures['pinned_gbps']['median']:.1f}, "
          f"pageable {figures['pageable_gbps']['median']:.1f}", flush=True)
    specs = load_tensors(ctx.dry)
    init_world_of_one(dev)
    try:
        mesh = init_device_mesh(dev.type, (1,))
        state = {n: DTensor.from_local(torch.empty(shape, dtype=dt, device=dev), mesh, [Shard(0)], run_check=False)
                 for n, (shape, dt, _) in specs.items()}
        nbytes = sum(t.to_local().numel() * t.to_local().element_size() for t in state.values())
        times, res = timed_loads(state, url, dev, repeats)
        wrong = [n for n, (shape, dt, _) in specs.items() if not bitwise_equal(state[n].to_local(),
                                                                                global_tensor(n, shape, dt))]
        if wrong:
            raise RuntimeError(f"the loaded DTensors differ from the saved state in {wrong[:5]}")
        del state
        host = {n: torch.empty(shape, dtype=dt) for n, (shape, dt, _) in specs.items()}
        cpu_times, _ = timed_loads(host, url, torch.device("cpu"), repeats)
    finally:
        dist.destroy_process_group()
    rates = [nbytes / t / 1e9 for t in times]
    cpu_rates = [nbytes / t / 1e9 for t in cpu_times]
    figures.update({"bytes": nbytes, "bytes_read": res.bytes_read, "seconds": spread(times), "gbps": spread(rates),
                    "cpu_load_gbps": spread(cpu_rates), "bitwise_equal": True,
                    "ratio_to_pinned_h2d": statistics.median(rates) / figures["pinned_gbps"]["median"],
                    "ratio_to_cpu_load": statistics.median(rates) / statistics.median(cpu_rates),
                    "saved_layout": "2 gloo ranks, mesh (2,), Shard(0) / Shard(1) alternating",
                    "loaded_layout": f"mesh ({dev.type}, 1), Shard(0)"})
    return figures


# ---------------------------------------------------------------------------------------------
# part: bubble snapshots
# ---------------------------------------------------------------------------------------------
def part_bubbles(ctx: Ctx) -> dict[str, Any]:
    """``bench_bubbles_cuda.run``: 1 GiB of state, 10 ms forwards, 20 rounds (dry: tiny, on CPU)."""
    import bench_bubbles_cuda

    from tenplex.planning.memory import parse_size

    if ctx.dry:
        return bench_bubbles_cuda.run(parse_size("4MiB"), 0.002, 2, 2, parse_size("1MiB"), device="cpu", dim=128)
    return bench_bubbles_cuda.run(parse_size("1GiB"), 0.010, 20, 4, parse_size("4MiB"), device="cuda")


# ---------------------------------------------------------------------------------------------
# part: the memory estimator with each recompute mode
# ---------------------------------------------------------------------------------------------
def part_memory(ctx: Ctx) -> dict[str, Any]:
    """The trainer's measured peak per recompute mode beside ``estimate_memory``'s, and the
    activation bytes autograd saves per mode."""
    import measure_memory
    import measure_recompute

    from tenplex.planning.memory import RECOMPUTE

    # model, layout, global batch, micro batch, distributed optimizer, sequence length
    cases = [("tiny", "dp=1,tp=1,pp=1", 4, 2, False, None)] if ctx.dry else [
        ("llama-100m", "dp=1,tp=1,pp=1", 8, 8, False, 2048), ("llama-small", "dp=1,tp=1,pp=1", 16, 16, False, 4096)]
    rows = []
    for case in cases:
        for mode in ("selective",) if ctx.dry else RECOMPUTE:  # dry: one trainer process (the same loop)
            t0 = time.perf_counter()
            try:
                got = measure_memory.run_case(*case, work=ctx.work, recompute=mode)  # type: ignore[arg-type]
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"the trainer failed for {case} --recompute {mode}: "
                                   f"{(e.stderr or b'').decode(errors='replace')[-1500:]}") from e
            for r in got:
                print(f"{r['model']} seq {r['seq_len']} mb {r['micro_batch']} {mode}: measured "
                      f"{r['measured_bytes'] / GiB:.2f} GiB, estimated {r['estimated_bytes'] / GiB:.2f} GiB "
                      f"({r['ratio']:.2f}x, {r['method']}) in {time.perf_counter() - t0:.1f}s", flush=True)
            rows.extend(got)
    model = "tiny" if ctx.dry else "llama-100m"
    saved = {mode: measure_recompute.saved_bytes(model, 1, mode) for mode in RECOMPUTE}
    return {"rows": rows, "ratios": {f"{r['model']}/{r['seq_len']}/{r['recompute']}": r["ratio"] for r in rows},
            "saved_activation_bytes": {"model": model, "micro_batch": 1, "device": "cpu", **saved}}


# ---------------------------------------------------------------------------------------------
# part: the in-process live move on one device
# ---------------------------------------------------------------------------------------------
def trainer_state(ptc: Any, seed: int) -> dict[str, Any]:
    """Random global values of every tensor of ``ptc`` and its objects."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, spec in ptc.tensors.items():
        out[name] = torch.randn(spec.shape, generator=gen).to(spec.dtype) if spec.dtype.is_floating_point else \
            torch.randint(0, 100, spec.shape, generator=gen).to(spec.dtype)
    for obj in ptc.objects:
        out[obj] = {"value": 1234, "of": obj}
    return out


def part_live(ctx: Ctx) -> dict[str, Any]:
    """The survivor of tp=2 moves its device state to tp=1 in a group of one (``rescale(live=)``),
    the dead rank's half read from the checkpoint; bit for bit and on the device."""
    import torch.distributed as dist

    import tenplex
    from tenplex.elastic import LiveState
    from tenplex.train.trainer import trainer_ptc

    dev, step = ctx.device, 3
    model = "tiny" if ctx.dry else "llama-100m"
    ptc = trainer_ptc(model, distributed_optimizer=True)
    old, new = tenplex.ParallelConfig(tp=2), tenplex.ParallelConfig()
    glob = trainer_state(ptc, seed=5)
    url = str(ctx.work / "ckpt-live")
    old_shards = ptc.shard(glob, old)
    for r, shard in old_shards.items():
        tenplex.save(url, ptc, old, r, shard, step=step)
    held = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in old_shards[1].items()}
    del old_shards
    want = ptc.shard(glob, new)[0]
    init_world_of_one(dev)
    try:
        times, res = [], None
        for _ in range(1 if ctx.dry else 3):
            sync(dev)
            t0 = time.perf_counter()
            res = tenplex.rescale(url, ptc, parallel=new, live=LiveState(cfg=old, states={step: held}, alive=[1],
                                                                          sources=[url]))
            sync(dev)
            times.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    assert res is not None and res.shard is not None
    if not res.live or res.step != step:
        raise RuntimeError(f"rescale did not move the state live (live={res.live}, step {res.step}, want {step})")
    tensors = {n: t for n, t in want.items() if isinstance(t, torch.Tensor)}
    elsewhere = sorted(n for n in tensors if res.shard[n].device.type != dev.type)
    wrong = sorted(n for n, t in tensors.items() if not bitwise_equal(res.shard[n], t))
    if elsewhere or wrong:
        raise RuntimeError(f"moved state: not on {dev.type}: {elsewhere[:5]}; differs: {wrong[:5]}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"model": model, "old": str(old), "new": str(new), "alive": [1], "bytes": nbytes,
            "bytes_by_tier": res.bytes_by_tier, "seconds": spread(times),
            "gbps": spread([nbytes / t / 1e9 for t in times]), "timings": res.timings, "bitwise_equal": True,
            "backend": "nccl" if dev.type == "cuda" else "gloo", "device": str(dev)}


# ---------------------------------------------------------------------------------------------
# the parts, each in a process of its own
# ---------------------------------------------------------------------------------------------
class PartFailed(RuntimeError):
    """A part that ran but whose result fails its check; ``figures``: what it measured."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


@dataclass(frozen=True)
class Part:
    """A part of the check: its function and its time budgets (seconds, on the GPU and dry; the dry
    ones only stop a hang: on a loaded 2-CPU machine a dry part takes 2-15 s, at load 16 up to 30 s)."""

    run: Callable[[Ctx], dict[str, Any]]
    gpu_s: int
    dry_s: int
    what: str

    def budget(self, dry: bool) -> int:
        return self.dry_s if dry else self.gpu_s


PARTS: dict[str, Part] = {
    "tests": Part(part_tests, 110, 90, "the tests that skip without CUDA (nccl: the trainer under torchrun)"),
    "load": Part(part_load, 75, 90, "in-place load_state_dict into CUDA DTensors vs pinned host-to-device"),
    "bubbles": Part(part_bubbles, 45, 60, "snapshot overhead in pipeline bubbles (bench_bubbles_cuda)"),
    "memory": Part(part_memory, 130, 90, "estimate_memory per recompute mode vs max_memory_allocated"),
    "live": Part(part_live, 60, 60, "the in-process live move tp=2 -> tp=1 on one device (nccl world of 1)"),
}


def run_part_here(name: str, dry: bool, work: Path, result: Path) -> int:
    """The child's side: run one part and write {"figures", "error"} to ``result``."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"figures": None, "error": None}
    try:
        out["figures"] = PARTS[name].run(Ctx(dry, work))
    except Exception as e:  # noqa: BLE001 - recorded for the report; the other parts still run
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        out["figures"] = getattr(e, "figures", None)
    out["seconds"] = time.perf_counter() - t0
    result.write_text(json.dumps(out, default=str))
    return 0 if out["error"] is None else 1


def run_part(name: str, dry: bool, work: Path, budget: float) -> dict[str, Any]:
    """One part in a child process (its own session: a timeout kills it and everything it started),
    its output shown with a prefix; the part's record."""
    part_dir = work / name
    part_dir.mkdir()
    result = part_dir / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--work", str(part_dir),
           "--result", str(result), *(["--dry-run"] if dry else [])]
    tail: collections.deque[str] = collections.deque(maxlen=30)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, env=part_env(dry))

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  [{name}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        timed_out = True
    try:  # the part's session, whatever its end: trainers or savers it left behind would share the GPU
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    reader.join(timeout=5)
    rec: dict[str, Any] = {"status": "ok", "seconds": time.perf_counter() - t0, "budget_s": budget,
                           "what": PARTS[name].what, "figures": None, "error": None}
    got = json.loads(result.read_text()) if result.exists() else None
    if got is not None:
        rec.update(figures=got["figures"], error=got["error"], traceback=got.get("traceback"))
    if timed_out:
        rec.update(status="timeout", error=f"over its budget of {budget}s: killed")
    elif got is None:
        rec.update(status="failed", error=f"exited with {proc.returncode} and no result")
    elif got["error"] is not None:
        rec["status"] = "failed"
    if rec["status"] != "ok":
        rec["log_tail"] = list(tail)
    return rec


def part_env(dry: bool) -> dict[str, str]:
    """The parts' environment: the repository importable, gloo on loopback; CPU in the dry run, else the GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo (the savers, the dry run) on loopback: no hostname lookup
    if dry:
        env["TENPLEX_DEVICE"] = "cpu"
    else:
        env.pop("TENPLEX_DEVICE", None)
    return env


def headline(name: str, rec: dict[str, Any]) -> str:
    """The one figure of a part's summary line."""
    f = rec.get("figures") or {}
    try:
        if name == "tests":
            return f"{f['passed']} passed, {f['skipped']} skipped of {len(f['tests'])}"
        if name == "load":
            return (f"{f['bytes'] / GiB:.2f} GiB in {f['seconds']['median']:.3f}s = {f['gbps']['median']:.1f} GB/s, "
                    f"{f['ratio_to_pinned_h2d']:.2f}x pinned H2D ({f['pinned_gbps']['median']:.1f} GB/s; goal "
                    f">= {LOAD_GOAL}x), {f['ratio_to_cpu_load']:.2f}x the load into CPU tensors")
        if name == "bubbles":
            return (f"overhead blocking {f['overhead_paired']['blocking']:+.1%}, in bubbles "
                    f"{f['overhead_paired']['bubbles']:+.1%}, {f['bytes_in_bubbles_fraction']:.0%} of bytes in bubbles")
        if name == "memory":
            return "measured / estimated: " + ", ".join(f"{k} {v:.2f}" for k, v in f["ratios"].items())
        if name == "live":
            return (f"{f['bytes'] / GiB:.2f} GiB in {f['seconds']['median']:.3f}s ({f['gbps']['median']:.1f} GB/s), "
                    f"tiers {f['bytes_by_tier']}")
    except (KeyError, TypeError):
        pass
    return ""


def default_out(dry: bool) -> Path:
    """docs/gpu/<date>.json (with the time when that exists); a temporary file for the dry run."""
    if dry:
        return Path(tempfile.gettempdir()) / "tenplex-gpu-check-dry.json"
    out = ROOT / "docs" / "gpu" / f"{time.strftime('%Y-%m-%d', time.gmtime())}.json"
    return out if not out.exists() else out.with_name(f"{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json")


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages (None where the kernel does not say: some sandboxes)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def crc32_impl() -> str:
    """Which CRC32 the checkpoints use: ISA-L's (``isal``) or zlib's, about 8x slower (loads verify every byte)."""
    from tenplex.checkpoint.format import crc32

    return f"{crc32.__module__}.{crc32.__name__}"


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same parts on CPU with gloo and small sizes")
    ap.add_argument("--out", default=None, help="the JSON (default docs/gpu/<date>.json; dry: a temporary file)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                    help="another time budget for a part (repeatable)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: run this one part
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.part is not None:
        return run_part_here(a.part, a.dry_run, Path(a.work), Path(a.result))
    names = [p for p in a.parts.split(",") if p]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; the parts are {list(PARTS)}")
    budgets: dict[str, float] = {n: PARTS[n].budget(a.dry_run) for n in names}
    for item in a.budget:
        name, _, secs = item.partition("=")
        if name not in budgets or not re.fullmatch(r"\d+(\.\d*)?", secs):
            ap.error(f"--budget {item}: PART=SECONDS for one of the parts run, {list(budgets)}")
        budgets[name] = float(secs)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tenplex-gpu-check-"))
    try:
        device = {"name": "cpu (dry run)", "torch": torch.__version__} if a.dry_run else preflight(work)
    except RuntimeError as e:
        shutil.rmtree(work, ignore_errors=True)
        print(f"gpu_check: cannot run: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else default_out(a.dry_run)
    try:
        return check(budgets, a.dry_run, work, out, device, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check(budgets: dict[str, float], dry: bool, work: Path, out: Path, device: dict[str, Any], t0: float) -> int:
    """Every part of ``budgets`` (name -> seconds) in turn, the JSON rewritten after each; 0 when
    every part passed. ``t0``: when the run began (the checks before the parts count towards its time)."""
    names = list(budgets)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": dry, "commit": git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.platform(),
        "cpus": os.cpu_count(), "load_average_before": load_average(), "device": device,
        "crc32": crc32_impl(),
        "budget_s": budgets, "parts": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "dry run on CPU" if dry else f"on {device['name']}"
    print(f"gpu_check {mode}: {len(names)} parts, budgets {report['budget_s']} (sum "
          f"{sum(report['budget_s'].values())}s), JSON -> {out}", flush=True)
    if not report["crc32"].startswith("isal"):
        print(f"gpu_check: checkpoints verify with {report['crc32']}, not ISA-L's (isal is not installed): "
              "the load figures are slower than a tenplex install's", flush=True)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: {PARTS[name].what} (budget {budgets[name]}s)", flush=True)
        rec = run_part(name, dry, work, budgets[name])
        report["parts"][name] = rec
        print(f"[{i}/{len(names)}] {name}: {rec['status']} in {rec['seconds']:.1f}s"
              + (f": {rec['error']}" if rec["error"] else ""), flush=True)
        report["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(report, indent=1, default=str))
    load = (report["parts"].get("load") or {}).get("figures") or {}
    report["goals"] = {"total_s": report["seconds"], "total_le_480s": report["seconds"] <= TOTAL_GOAL_S,
                       "load_ratio_to_pinned_h2d": load.get("ratio_to_pinned_h2d"),
                       "load_ratio_ge_0.8": None if "ratio_to_pinned_h2d" not in load else
                       load["ratio_to_pinned_h2d"] >= LOAD_GOAL}
    report["load_average_after"] = load_average()
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\ngpu_check {mode}: {report['seconds']:.0f}s in all (goal <= {TOTAL_GOAL_S:.0f}s), JSON {out}")
    for name, rec in report["parts"].items():
        print(f"  {name:<8} {rec['status']:<7} {rec['seconds']:6.1f}s  {headline(name, rec) or rec['error'] or ''}")
    return 0 if all(r["status"] == "ok" for r in report["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
