"""Live migration vs reading the new shard from a checkpoint (the restart path's read).

A job of 4 ranks (dp=2, tp=2) loses rank 1; the 3 survivors move to pp=3. Live: each survivor
calls ``tenplex.elastic.migrate`` with the shard it holds (gloo, CPU, one process per rank): local
pieces copied, pieces of live ranks sent point to point, pieces only the dead rank held read
from the checkpoint. Checkpoint: each survivor calls ``tenplex.load`` of its new shard from the
same local checkpoint (in the page cache: both paths read it from memory). Two states per
model: with the distributed optimizer (the dead rank's optimizer fragments exist nowhere
else, so some bytes must come from storage) and without (every byte is live).

Times are the slowest rank's, per repeat after a barrier; median and spread (min, max) of
``--repeats``. Printed as a table; ``--json [PATH]`` also writes them (default
docs/bench/bench_migrate.json) with the load average before and after.

    PYTHONPATH=. python scripts/bench_migrate.py [--models tiny,llama-100m] [--repeats 3] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tenplex  # noqa: E402
from tenplex import ParallelConfig  # noqa: E402
from tenplex.train.launch import free_port  # noqa: E402
from tenplex.train.trainer import trainer_ptc  # noqa: E402

OLD = ParallelConfig(dp=2, tp=2)
NEW = ParallelConfig(pp=3)
ALIVE = [0, 2, 3]
SAVE_ID = "00be0c40"


def _global(ptc: tenplex.PTC, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in ptc.tensors.items()}
    for obj in ptc.objects:
        out[obj] = {"of": obj}
    return out


def _worker(rank: int, port: int, model: str, dist_opt: bool, url: str, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    from tenplex.elastic.migrate import exchange_plan, migrate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(ALIVE))
    res: dict[str, Any] = {"error": None, "migrate_s": [], "load_s": [], "plan_s": 0.0}
    try:
        ptc = trainer_ptc(model, distributed_optimizer=dist_opt)
        shard = tenplex.load(url, OLD, ALIVE[rank]).shard  # what this survivor holds
        t0 = time.perf_counter()
        plan = tenplex.plan(ptc, OLD, NEW, alive=ALIVE, gpus_per_host=8)
        ex = exchange_plan(plan)
        res["plan_s"] = time.perf_counter() - t0
        mx = torch.zeros(1, dtype=torch.float64)
        for _ in range(repeats):
            dist.barrier()
            r = migrate(ptc, OLD, NEW, shard, alive=ALIVE, plan=plan, exchange=ex, storage=url)
            mx[0] = r.seconds
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            res["migrate_s"].append(float(mx[0]))
            res.update(sent=r.bytes_sent, received=r.bytes_received, local=r.bytes_local, storage=r.bytes_storage,
                       storage_read=r.storage_read.bytes_read if r.storage_read else 0, timings=dict(r.timings))
            del r
            dist.barrier()
            t0 = time.perf_counter()
            loaded = tenplex.load(url, NEW, rank)
            mx[0] = time.perf_counter() - t0
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            res["load_s"].append(float(mx[0]))
            res["load_read"] = loaded.stats.bytes_read
            del loaded
    except BaseException as e:  # reported to the parent
        import traceback

        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        out.put((rank, res))
        dist.destroy_process_group()


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_case(model: str, dist_opt: bool, repeats: int, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ptc = trainer_ptc(model, distributed_optimizer=dist_opt)
    url = str(work / f"{model}-{int(dist_opt)}")
    glob = _global(ptc, 0)
    for r, shard in ptc.shard(glob, OLD).items():
        tenplex.save(url, ptc, OLD, r, shard, step=1, save_id=SAVE_ID)
    del glob
    plan = tenplex.plan(ptc, OLD, NEW, alive=ALIVE, gpus_per_host=8)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, model, dist_opt, url, repeats, q)) for r in range(len(ALIVE))]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        while len(results) < len(procs):
            try:
                rank, res = q.get(timeout=600)
            except queue.Empty:
                raise SystemExit(f"{model}: only ranks {sorted(results)} reported within 600 s") from None
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {res['error']}" for r, res in results.items() if res["error"]]
    if errors:
        raise SystemExit("\n".join(errors))
    s = plan.stats
    rs = [results[r] for r in range(len(ALIVE))]
    sent = sum(x["sent"] for x in rs)
    assert sent == s.bytes_moved - s.bytes_storage, (sent, s.bytes_moved, s.bytes_storage)
    mig, load = rs[0]["migrate_s"], rs[0]["load_s"]
    return {
        "model": model, "distributed_optimizer": dist_opt, "old": str(OLD), "new": str(NEW), "alive": ALIVE,
        "state_bytes": ptc.nbytes, "plan_bytes_needed": s.bytes_needed, "plan_bytes_moved": s.bytes_moved,
        "bytes_local": sum(x["local"] for x in rs), "bytes_live": sent, "bytes_storage": s.bytes_storage,
        "storage_bytes_read": sum(x["storage_read"] for x in rs),
        "load_bytes_read": sum(x["load_read"] for x in rs),
        "plan_s": max(x["plan_s"] for x in rs),
        "migrate_s": _stats(mig), "load_s": _stats(load), "migrate_runs_s": mig, "load_runs_s": load,
        "speedup_median": statistics.median(load) / statistics.median(mig),
        "rank0_timings_last_s": rs[0]["timings"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,llama-100m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", nargs="?", const=str(ROOT / "docs" / "bench" / "bench_migrate.json"), default=None,
                    help="write the figures here (default docs/bench/bench_migrate.json)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    load_before = os.getloadavg()
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-migrate-") as tmp:
        for model in args.models.split(","):
            for dist_opt in (True, False):
                c = run_case(model, dist_opt, args.repeats, Path(tmp))
                cases.append(c)
                m, ld = c["migrate_s"], c["load_s"]
                print(f"{model:>11} dist_opt={int(dist_opt)}: migrate {m['median'] * 1e3:7.1f} ms "
                      f"[{m['min'] * 1e3:.1f}, {m['max'] * 1e3:.1f}]  load {ld['median'] * 1e3:7.1f} ms "
                      f"[{ld['min'] * 1e3:.1f}, {ld['max'] * 1e3:.1f}]  x{c['speedup_median']:.2f}  "
                      f"live {c['bytes_live'] / 2**20:.1f} MiB, storage {c['bytes_storage'] / 2**20:.1f} MiB "
                      f"(read {c['storage_bytes_read'] / 2**20:.1f}), load read {c['load_bytes_read'] / 2**20:.1f} MiB",
                      flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "torch": torch.__version__,
              "backend": "gloo (CPU, loopback)", "repeats": args.repeats, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "cases": cases}
    print(f"load average before {load_before}, after {report['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
