#!/usr/bin/env python
"""Failure verdicts under load (issue 29 item 7): unprovoked recoveries counted beside busy processes.

Each run starts ``--busy`` processes spinning (``python -c 'while 1: pass'``, each ending by
itself after 10 minutes) beside one of:

* ``world``: 4 gloo members (forked from a forkserver that imported torch) with a
  ``tenplex.elastic.membership_runtime.Membership`` at the library's defaults (heartbeat every 0.1 s, as the
  trainer's), each doing what makes the trainer's heartbeat thread wait for the GIL: the first
  ``import scipy.optimize`` (the trainer's ``warm_up``), then steps of an all_reduce, a 2 MB
  ``torch.save`` and a pickle. After ``--calm-s`` seconds member 3 is SIGKILLed: the three others
  must recover (one round of members 0-2 that answers an all_reduce).
* ``trainer`` (every ``--trainer-every``-th run): the reference trainer, 4 fresh ``python -m
  tenplex.train --in-process`` workers (tiny model, env://, their real start-up under load), rank 3
  killed in step 5's forward pass (``--die-at``): one recovery to 3 workers at step 4, all steps.

Counted: ``unprovoked`` (a failure seen or a recovery begun before the kill, or a trainer's second
recovery with one kill: a live member found dead by its silent heartbeats; goal 0) and ``unrecovered`` (the kill not followed by the
expected recovery; goal 0). Prints JSON (every run, the counts, load averages); exits 1 if either
count is not 0.

    PYTHONPATH=. python scripts/stress_liveness.py --runs 50 --busy 5
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tenplex.train.launch import RendezvousStore, free_port, kill_alive, read_train_log  # noqa: E402

WORLD = 4
TRAINER_ARGS = ["--model", "tiny", "--steps", "8", "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3",
                "--seed", "7", "--parallel", "dp=2,tp=2,pp=1/dp=1,tp=1,pp=3", "--ckpt-every", "1", "--in-process",
                "--die-at", "3:5:forward"]
SPIN = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"  # busy, and gone if we are killed
KILLED_STEP = 5  # the trainer's victim dies in this step's forward: the survivors recover at step 4


def _member(rank: int, port: int, out: Any) -> None:
    """A member of the ``world`` scenario (see the module docstring); reports ("done", rank, result)."""
    import torch
    import torch.distributed as dist

    from tenplex.errors import MembershipError, PeerFailure
    from tenplex.elastic.membership_runtime import Membership

    torch.set_num_threads(1)
    res: dict[str, Any] = {"error": None}
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore("w/pg", store), rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=30))
        m = Membership(store, "w", interval=0.1, agree_timeout=20.0, pg_timeout=datetime.timedelta(seconds=30),
                       start_timeout=60.0)
        import scipy.optimize  # noqa: F401  # lazy: the trainer's warm_up import, seconds of held GIL under load

        out.put(("ready", rank, os.getpid()))
        blob = {"w": torch.randn(512, 1024)}
        x = torch.ones(1 << 16)
        steps = 0
        try:
            while True:
                with m.guard():
                    dist.all_reduce(x)
                x.fill_(1.0)
                torch.save(blob, io.BytesIO())
                pickle.dumps(list(range(100_000)))
                m.check()
                steps += 1
        except PeerFailure as e:
            res.update(failed_at=time.time(), reason=str(e)[:300], steps=steps)
        try:
            nm = m.recover()
            y = torch.ones(1)
            dist.all_reduce(y)
            res.update(members=list(nm.members), sum=float(y.item()))
            m.close()
            dist.destroy_process_group()
        except MembershipError as e:
            res["membership_error"] = str(e)[:300]
    except BaseException as e:  # reported: the run counts as not recovered
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    out.put(("done", rank, res))


def _drain(q: Any, seconds: float, enough: Any, got: Any) -> None:
    """Hand each message of ``q`` to ``got`` until ``enough()`` or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while not enough() and time.monotonic() < deadline:
        try:
            got(*q.get(timeout=1))
        except queue.Empty:
            pass


def run_world(ctx: Any, calm_s: float) -> dict[str, Any]:
    rdzv = RendezvousStore()
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, rdzv.port, q)) for r in range(WORLD)]
    pids: dict[int, int] = {}
    done: dict[int, dict] = {}
    t_kill = None

    def got(kind: str, rank: int, val: Any) -> None:
        (pids if kind == "ready" else done)[rank] = val  # "done" before the kill: a failure seen before it

    try:
        for p in procs:
            p.start()
        _drain(q, 120, lambda: len(pids) == WORLD, got)
        if len(pids) == WORLD:
            time.sleep(calm_s)
            t_kill = time.time()
            os.kill(pids[WORLD - 1], signal.SIGKILL)
        _drain(q, 60, lambda: len(set(done) - {WORLD - 1}) == WORLD - 1, got)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        rdzv.stop()
    survivors = {r: done.get(r, {"error": "no report"}) for r in range(WORLD - 1)}
    early = {r: round(v["failed_at"] - t_kill, 3) for r, v in done.items()
             if "failed_at" in v and (t_kill is None or v["failed_at"] < t_kill)}
    recovered = t_kill is not None and all(v.get("members") == [0, 1, 2] and v.get("sum") == 3.0
                                           for v in survivors.values())
    detect = [round(v["failed_at"] - t_kill, 3) for v in survivors.values() if t_kill and "failed_at" in v]
    problems = {r: v.get("error") or v.get("membership_error") for r, v in survivors.items()
                if v.get("error") or v.get("membership_error")}
    return {"scenario": "world", "unprovoked": bool(early or t_kill is None), "recovered": recovered,
            "early_failures_s": early, "detect_s": detect, "problems": problems,
            "reasons": sorted({str(v.get("reason", ""))[:120] for v in survivors.values()})}


def run_trainer(work: Path) -> dict[str, Any]:
    rdzv = RendezvousStore()
    master = free_port()
    log = work / "log.jsonl"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "TENPLEX_MEMBERSHIP_STORE": rdzv.endpoint,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = []
    try:
        for r in range(WORLD):
            env = {**base, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r)}
            procs.append(subprocess.Popen([sys.executable, "-m", "tenplex.train", *TRAINER_ARGS, "--ckpt",
                                           str(work / "ckpt"), "--log", str(log)], env=env, cwd=str(ROOT),
                                          stdout=(work / f"worker{r}.log").open("w"), stderr=subprocess.STDOUT))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        kill_alive(procs)
        rdzv.stop()
    records, events = read_train_log(log)
    steps = {r["step"] for r in records}
    rec = [(e["step"], e["world_size"]) for e in events if e.get("event") == "recover"]
    unprovoked = [r for r in rec if r[0] < KILLED_STEP - 1] + rec[1:]  # before the kill, or a second one
    recovered = codes == [0, 0, 0, -9] and rec == [(KILLED_STEP - 1, 3)] and max(steps, default=0) == 8
    return {"scenario": "trainer", "unprovoked": bool(unprovoked), "recovered": recovered, "codes": codes,
            "recoveries": rec, "tail": "" if recovered else
            (work / "worker0.log").read_text()[-1500:] if (work / "worker0.log").exists() else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--busy", type=int, default=5, help="spinning processes beside each run")
    ap.add_argument("--calm-s", type=float, default=4.0, help="world: seconds of steps before the kill")
    ap.add_argument("--trainer-every", type=int, default=10, help="every N-th run is a trainer run (0: none)")
    ap.add_argument("--budget-s", type=float, default=1800, help="stop starting runs after this many seconds")
    ap.add_argument("--out", help="append each run's record to this JSON-lines file as it ends")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tenplex.elastic.membership_runtime"])
    work = Path(tempfile.mkdtemp(prefix="tenplex-stress-liveness-"))
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        for i in range(args.runs):
            if time.monotonic() - t0 > args.budget_s:
                break
            trainer = args.trainer_every > 0 and (i + 1) % args.trainer_every == 0
            busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
            t = time.monotonic()
            try:
                d = work / f"run{i}"
                d.mkdir()
                r = run_trainer(d) if trainer else run_world(ctx, args.calm_s)
            finally:
                load = os.getloadavg()[0]
                for p in busy:
                    p.kill()
                    p.wait()
            r.update(run=i, load=round(load, 2), seconds=round(time.monotonic() - t, 1))
            runs.append(r)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
            print(f"run {i + 1}/{args.runs} {r['scenario']}: unprovoked={r['unprovoked']} recovered={r['recovered']} "
                  f"load {load:.1f} {r['seconds']}s" + (f" {r.get('early_failures_s') or r.get('problems') or ''}"
                                                        if r["unprovoked"] or not r["recovered"] else ""),
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {s: [r for r in runs if r["scenario"] == s] for s in ("world", "trainer")}
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(["scripts/stress_liveness.py", *sys.argv[1:]]),
              "cpus": os.cpu_count(), "busy": args.busy, "runs": len(runs),
              "unprovoked": sum(r["unprovoked"] for r in runs),
              "unrecovered": sum(not r["recovered"] for r in runs),
              **{f"{s}_runs": len(v) for s, v in by.items()},
              **{f"{s}_unprovoked": sum(r["unprovoked"] for r in v) for s, v in by.items()},
              "load": {"min": min((r["load"] for r in runs), default=0),
                       "max": max((r["load"] for r in runs), default=0)},
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "seconds": round(time.monotonic() - t0), "every_run": runs}
    print(json.dumps(result, indent=1))
    return 0 if result["unprovoked"] == 0 and result["unrecovered"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
