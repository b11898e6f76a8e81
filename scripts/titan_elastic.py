#!/usr/bin/env python3
"""torchtitan's trainer on 4 CPU workers, one SIGKILLed: in-process recovery vs torchtitan's own restart.

Runs ``examples/titan_elastic_job.py`` (torchtitan's Llama 3 and Trainer parts, FSDP2 2 x TP 2, gloo)
as a user would, ``--repeats`` times each way, worker 3 killed in the forward pass of step 3,
checkpoints every 2 steps on both paths:

* in process (``tenplex.train.titan.ElasticTrainer``): 4 workers started env:// with a membership
  store; ``recovery_s`` = the kill -> the end of the first step the 3 survivors commit (dp_shard 3);
* torchtitan's restart (``--stock``: its loop and DCP ``CheckpointManager``): ``torchrun
  --max-restarts 1`` restarts all 4, they load step 2's checkpoint; ``restart_s`` = the kill -> the
  end of the first step after the restart;
* ``losses_equal``: every committed step's loss within 1e-5 relative of an uninterrupted
  run's (the same 4 workers), every step once (both paths); ``bytes_storage``: bytes the in-process recovery
  read from the checkpoint (FSDP2 x TP holds each piece once: the dead worker's share);
* the same kill with HSDP 2 x 2 (``--hsdp``: each piece held by two workers, global batch 12):
  ``recovery_s_hsdp`` and ``bytes_storage_hsdp``, 0 when the survivors hold everything.

Each figure is {"median", "min", "max", "runs"}; the last line of ``--json`` is one JSON object, also
saved to docs/bench/titan_elastic.json, with the load average and each recovery's latency table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "examples" / "titan_elastic_job.py")
STEPS, KILL_STEP, REL_TOL = 8, 3, 1e-5
ARGS = ["--steps", str(STEPS), "--ckpt-every", "2"]
FSDP_TP = ["--global-batch", "6"]
HSDP = ["--hsdp", "--tp", "1", "--global-batch", "12"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _records(out: Path) -> list[dict[str, Any]]:
    log = out / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def run_spawned(out: Path, world: int, extra: list[str], timeout: float) -> list[int | None]:
    """``world`` workers env:// (as torchrun gives them) with a membership store that outlives them."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", _port(), is_master=True, wait_for_workers=False)
    port = _port()
    mesh = [] if "--hsdp" in extra else FSDP_TP
    procs = [subprocess.Popen([sys.executable, JOB, "--out", str(out), *ARGS, *mesh, "--events", str(out / "log.jsonl"),
                               *extra],
                              env=_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       TENPLEX_MEMBERSHIP_STORE=f"127.0.0.1:{store.port}"),
                              stdout=(out / f"worker{r}.log").open("w"), stderr=subprocess.STDOUT)
             for r in range(world)]
    return _wait(procs, timeout)


def run_torchrun(out: Path, timeout: float) -> list[int | None]:
    """torchtitan's own recovery: torchrun restarts every worker, which load the newest DCP checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
           JOB, "--out", str(out), *ARGS, *FSDP_TP, "--stock", "--kill-at", f"3:{KILL_STEP}",
           "--events", str(out / "log.jsonl")]
    # --standalone (c10d rendezvous) and no shared store: the restarted workers' groups bootstrap from the
    # new round's keys, not the dead round's addresses (else gloo's connectFullMesh is refused for 20 s)
    p = subprocess.Popen(cmd, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                         stdout=(out / "torchrun.log").open("w"), stderr=subprocess.STDOUT)
    return _wait([p], timeout)


def losses_equal(records: list[dict[str, Any]], reference: dict[int, float]) -> bool:
    """Every step committed once, in order, each loss within REL_TOL of the reference's (a restart's
    redone steps: the last record of each step)."""
    steps = [r for r in records if "loss" in r]
    last = {r["step"]: r["loss"] for r in steps}
    return sorted(last) == list(range(1, STEPS + 1)) and all(
        abs(loss - reference[s]) <= REL_TOL * abs(reference[s]) for s, loss in last.items())


def first_step_after(records: list[dict[str, Any]], t_kill: float, **match: Any) -> float:
    after = [r["t"] for r in records if "loss" in r and r["t"] > t_kill and all(r.get(k) == v for k, v in match.items())]
    return min(after) - t_kill


def stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def in_process_run(out: Path, extra: list[str], reference: dict[int, float],
                   timeout: float) -> tuple[float, int, dict[str, Any], bool]:
    """One in-process run of 4 workers (``extra`` flags), worker 3 killed in step KILL_STEP: kill -> first
    step on 3, bytes from storage, the recovery's latency table (with the bytes it moved live and those a
    torchft-style full-replica copy would move), whether the survivors ended cleanly with the reference's
    losses."""
    codes = run_spawned(out, 4, [*extra, "--kill-at", f"3:{KILL_STEP}"], timeout)
    recs, killed = _records(out), json.loads((out / "killed.json").read_text())["t"]
    rec = next(r for r in recs if r.get("event") == "recover")
    table = {**rec["latency"], "bytes_live": rec.get("bytes_live"), "bytes_full_replica": rec.get("bytes_full_replica")}
    return (first_step_after(recs, killed, world_size=3), rec["bytes_storage"], table,
            codes == [0, 0, 0, -9] and losses_equal(recs, reference))


def measure(repeats: int = 3, timeout: float = 400.0) -> dict[str, Any]:
    """The torchtitan job's figures over ``repeats`` (in process vs torchtitan's own restart, HSDP too);
    ``scripts/bench_recovery.py --json`` puts them beside the reference trainer's and the native job's."""
    work = Path(tempfile.mkdtemp(prefix="titan_elastic_"))
    ref = work / "reference"
    ref.mkdir()
    run_spawned(ref, 4, [], timeout)  # torchtitan's initialisation depends on the mesh: the same 4 workers
    reference = {r["step"]: r["loss"] for r in _records(ref) if "loss" in r}
    hsdp_ref = work / "reference_hsdp"
    hsdp_ref.mkdir()
    run_spawned(hsdp_ref, 4, HSDP, timeout)
    hsdp_reference = {r["step"]: r["loss"] for r in _records(hsdp_ref) if "loss" in r}
    recovery, restart, storage, equal, tables = [], [], [], [], []
    recovery_hsdp, storage_hsdp = [], []
    for i in range(repeats):
        ip, st = work / f"inprocess{i}", work / f"restart{i}"
        ip.mkdir()
        st.mkdir()
        rec_s, stored, table, same = in_process_run(ip, [], reference, timeout)
        recovery.append(rec_s)
        storage.append(stored)
        tables.append({"run": f"fsdp_tp {i}", **table})
        equal.append(same)
        codes = run_torchrun(st, timeout)
        recs, killed = _records(st), json.loads((st / "killed.json").read_text())["t"]
        restart.append(first_step_after(recs, killed, restart=1))
        equal.append(codes == [0] and losses_equal(recs, reference))
        hs = work / f"hsdp{i}"
        hs.mkdir()
        rec_s, stored, table, same = in_process_run(hs, HSDP, hsdp_reference, timeout)
        recovery_hsdp.append(rec_s)
        storage_hsdp.append(stored)
        tables.append({"run": f"hsdp {i}", **table})
        equal.append(same)
        print(f"repeat {i}: hsdp recovery {recovery_hsdp[-1]:.3f} s, bytes from storage {storage_hsdp[-1]}", flush=True)
        print(f"repeat {i}: recovery {recovery[-1]:.3f} s, restart {restart[-1]:.3f} s, "
              f"bytes from storage {storage[-1]}, losses equal {equal[-2:]}", flush=True)
    return {"recovery_s": stats(recovery), "restart_s": stats(restart), "losses_equal": all(equal),
            "bytes_storage": stats(storage), "recovery_s_hsdp": stats(recovery_hsdp),
            "bytes_storage_hsdp": stats(storage_hsdp),
            "speedup": statistics.median(restart) / statistics.median(recovery),
            "goal": {"recovery_s_max": 1.5, "speedup_min": 5.0},
            "goal_met": statistics.median(recovery) <= 1.5 and statistics.median(restart) >= 5 * statistics.median(recovery),
            "latency_tables": tables, "loadavg": list(os.getloadavg()), "repeats": repeats,
            "job": {"model": "torchtitan Llama 3, dim 64, 2 layers, vocab 256, seq 16", "workers": 4,
                    "mesh": "dp_shard 2 x tp 2 -> dp_shard 3 (hsdp: dp_replicate 2 x dp_shard 2 -> dp_shard 3)",
                    "kill": f"worker 3, forward pass of step {KILL_STEP}", "checkpoint_every": 2, "steps": STEPS},
            "work": str(work)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", default=str(ROOT / "docs" / "bench" / "titan_elastic.json"))
    p.add_argument("--timeout", type=float, default=400)
    args = p.parse_args()
    result = measure(args.repeats, args.timeout)
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
