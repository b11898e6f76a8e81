"""In-process recovery of the torch-native example job (issue #18 item 5), timed.

Runs ``examples/train_native.py --in-process`` on 4 gloo workers (env://, the membership store in this
process) ``--repeats`` times per case and SIGKILLs one worker mid-run:

- ``fsdp_tp``: ``dp_shard=2,tp=2``, worker 3 killed before its optimizer step of step 5; the 3
  survivors (``dp_shard=3``) move the checkpointed step 4 live, the dead worker's own shards from the
  checkpoint, and redo steps 4 and 5;
- ``hsdp``: ``dp_replicate=2,dp_shard=2``, worker 2 killed in the forward pass of step 5; the
  survivors move step 5 entirely live (every element has a replica);
- ``hsdp3``: the same with worker 3 killed: in their old rank order new ranks 1 and 2 would run
  away from most of their rows, the locality order (``elastic.live_order``) swaps them;
- ``hsdp0``: the same with worker 0 killed (the rank that hosts torchrun's env:// store; the
  membership store lives elsewhere, in this process);
- ``join``: scale up with no failure: a process started with ``--join`` waits for a job of 2 workers
  (``dp_shard=2``); they admit it after their first step, rebuild for ``dp_shard=3`` and send it its
  shards live (nothing from the checkpoint). "failure" below is then the moment the workers start the
  join round, and no step is redone;
- ``hsdp3_grow``: ``hsdp3`` with a replacement (issue #31): when worker 3 is killed a fresh process is
  started with ``--join`` (as torchrun's restart of torchft's replica group starts one); it registers,
  the 3 survivors (``dp_shard=3`` by then) admit it at their next step boundary and send it its shards
  live, and 4 workers go on as HSDP 2 x 2. Run for more steps (``GROW_STEPS``) so the replacement's
  start fits. Also reported: the kill -> the first step back at 4 workers (``kill_to_full_size_s``),
  the join's own time (its round's start -> that step, ``join_s``), the bytes the replacement holds
  after it (all received live: it held nothing; ``bytes_to_joiner``), the join's bytes live (every
  rank) and from storage, and the losses against an uninterrupted 4-worker run (:func:`reference_losses`),
  and the replacement's timeline (:func:`joiner_timeline`: process start, imports, registered, warmed
  up, the survivors' join round, admitted, state in place, the first step at 4, as seconds since the kill);
- ``hsdp3_spare``: ``hsdp3`` on 5 workers with a mesh of at most 4 (``--mesh-most 4``): the 5th waits as
  a spare, running at the kill; the failure's own recovery gives it worker 3's place and its shards, and
  the job runs on 4 trainers (HSDP 2 x 2) from the recovery's first step. Also reported: the kill -> that
  step (``spare_back_full_s``), the bytes the spare holds after it (``bytes_to_spare``), the recovery's
  bytes (:func:`spare_figures`).

The survivors' order, whether it was computed for the layout the rebuilt model has
(``layout_predicted``) and the peer bytes of the same move in the old rank order
(``rank_order_plan_bytes_peer``) come from the record too. ``--root`` runs the example of another
checkout (e.g. main's, to compare).

Per repeat, from the job's ``"recover"`` record (new rank 0's view): detection, agreement, regroup,
mesh + model rebuilt, ``rescale`` (describe, plan, step agreement, migrate), failure -> state moved,
the first step after it, bytes live / from storage against the plan's. Medians with min/max, the
load average before and after, the command; JSON to ``--out`` (default docs/bench/bench_native_inprocess.json).

    PYTHONPATH=. python scripts/bench_native_inprocess.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tenplex.train.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
CASES: dict[str, tuple[list[str], str | None]] = {
    "fsdp_tp": ([], "3:5:optimizer"), "hsdp": (["--hsdp"], "2:5:forward"), "hsdp3": (["--hsdp"], "3:5:forward"),
    "hsdp0": (["--hsdp"], "0:5:forward"),
    "join": ([], None)}
COMMON = ["--steps", "8", "--ckpt-every", "2", "--global-batch", "12"]
GROW_STEPS = 40  # hsdp3_grow: steps enough for the replacement's start (python, torch, its warm-up) to fit
CASES["hsdp3_grow"] = (["--hsdp", "--steps", str(GROW_STEPS)], CASES["hsdp3"][1])
GROWS = {"hsdp3_grow"}  # cases whose killed worker is replaced by a joiner started at the kill
# hsdp3_spare: hsdp3 with a 5th worker, a spare (the mesh holds at most 4), running at the kill
CASES["hsdp3_spare"] = (["--hsdp", "--mesh-most", "4"], CASES["hsdp3"][1])
SPARES = {"hsdp3_spare": 5}  # cases with spares: their workers (the mesh's 4 and the spares)


def _base_env(store_port: int, root: Path) -> dict[str, str]:
    """The environment every process of one run shares: a fresh env:// address, the membership store."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "TENPLEX_MEMBERSHIP_STORE": f"127.0.0.1:{store_port}", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _env(base: dict[str, str], rank: int | None, workers: int) -> dict[str, str]:
    """A worker's environment (env:// rank ``rank`` of ``workers``), or a joiner's (``rank`` None:
    no RANK / WORLD_SIZE, it finds the job through MASTER_ADDR / MASTER_PORT)."""
    if rank is None:
        return {**{k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE")}, "LOCAL_RANK": "0"}
    return {**base, "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank)}


def _wait_file(path: Path, procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: {path} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def _last_per_step(records: list[dict]) -> dict[int, dict]:
    """Rank 0's step records, the last one per step (a redone step's second run)."""
    return {r["step"]: r for r in records if "loss" in r}


#: The replacement's timeline, in the order of a run (``joiner_timeline``: seconds since the kill): started by
#: the benchmark, its process, its imports, the runtime created, registered, warmed up, the survivors' join
#: round started, its group formed, its state in place, the first step at full size ended (rank 0's), its
#: deferred scipy import and order warm-up done (after that step).
JOINER_MARKS = ("spawned", "process_start", "imports_done", "runtime_init", "registered", "warmed",
                "boundary", "admitted", "in_place", "full_size", "solvers")


def joiner_timeline(records: list[dict], kill: dict, spawned: float | None) -> dict[str, float] | None:
    """The replacement's marks (``JOINER_MARKS``) as seconds since the kill, on the one wall clock the
    workers share (one machine): from its ``"joined"`` record's timeline, the join's recover record
    (``failed_at``: the survivors' round start) and the first step at full size. None without them."""
    joined = [r for r in records if r.get("event") == "joined" and r.get("timeline")]
    joins = [r for r in records if r.get("event") == "recover" and r.get("joiners") and "failed_at" in r]
    full = [r for r in records if "loss" in r and r["step"] >= kill["step"] and r.get("world_size") == 4]
    if not (joined and joins and full):
        return None
    walls = {**joined[0]["timeline"], "boundary": joins[0]["failed_at"],
             "full_size": min(r["wall"] for r in full)}
    if spawned is not None:
        walls["spawned"] = spawned
    return {k: walls[k] - kill["wall"] for k in JOINER_MARKS if k in walls}


def grow_figures(records: list[dict], kill: dict, workers: int = 4) -> dict[str, Any]:
    """The grow back of an ``hsdp3_grow`` run from its log (rank 0's step and recover records and the
    replacement's ``"joined"`` record; ``kill``: the die record): the kill -> the first step at ``workers``
    from the killed one on (rank 0 may log the step before it after the kill), the join's
    own time (its round's start -> that step's end: the failure_to_state, ring and step time of the
    record, as ``failure_to_first_step_s``), bytes to the joiner, the join's bytes. A figure the log
    lacks (no join, no step at full size, no joiner record) is None: the caller refuses the run."""
    full = [r for r in records if "loss" in r and r["step"] >= kill["step"] and r.get("world_size") == workers]
    joins = [r for r in records if r.get("event") == "recover" and r.get("joiners")]
    joined = [r for r in records if r.get("event") == "joined"]
    first = min(full, key=lambda r: r["wall"]) if full else None
    rec = joins[0] if joins else None
    return {"kill_to_full_size_s": first["wall"] - kill["wall"] if first else None,
            "full_size_step": first["step"] if first else None,
            "join_s": rec["failure_to_state_s"] + rec["ring_s"] + first["time_s"] if rec and first else None,
            "joined_after_step": rec["step"] if rec else None, "join_latency": rec.get("latency") if rec else None,
            "bytes_to_joiner": joined[0]["bytes_held"] if joined else None,
            "join_bytes_live": rec["bytes_live"] if rec else None,
            "join_bytes_storage": rec["bytes_storage"] if rec else None, "join_mesh": rec["mesh"] if rec else None}


def spare_figures(records: list[dict], kill: dict, trainers: int = 4) -> dict[str, Any]:
    """A spare run's figures from its log (``kill``: the die record): the kill -> the end of the first
    step with ``trainers`` again, the spare promoted in the failure's own recovery (``spare_back_full_s``),
    the bytes the spare holds after it (all received: it held nothing; ``bytes_to_spare``), that
    recovery's bytes live and from storage. A figure the log lacks is None: the caller refuses the run."""
    full = [r for r in records if "loss" in r and r["step"] >= kill["step"] and r.get("wall", 0) > kill["wall"]
            and math.prod(r.get("mesh", {}).values()) == trainers]
    spare = [r for r in records if r.get("event") == "joined" and r.get("was") == "spare"]
    recs = [r for r in records if r.get("event") == "recover"]
    first = min(full, key=lambda r: r["wall"]) if full else None
    return {"spare_back_full_s": first["wall"] - kill["wall"] if first else None,
            "bytes_to_spare": spare[0]["bytes_held"] if spare else None,
            "spare_bytes_live": recs[0]["bytes_live"] if recs else None,
            "spare_bytes_storage": recs[0]["bytes_storage"] if recs else None,
            "spare_world_after": recs[0]["world_size"] if recs else None}


def reference_losses(store_port: int, case: str, root: Path = ROOT, model: str = "tiny") -> dict[int, float]:
    """The losses per step of ``case``'s job run uninterrupted on 4 workers (no kill, no joiner)."""
    extra, _ = CASES[case]
    with tempfile.TemporaryDirectory(prefix="bench-native-ref-") as d:
        tmp = Path(d)
        base = _base_env(store_port, root)
        cmd = [sys.executable, str(root / "examples" / "train_native.py"), *COMMON, "--model", model, *extra,
               "--ckpt", str(tmp / "ckpt"), "--log", str(tmp / "log.jsonl"), "--in-process", "--dead-after", "10"]
        procs = [subprocess.Popen(cmd, env=_env(base, r, 4), stdout=(tmp / f"w{r}.log").open("w"),
                                  stderr=subprocess.STDOUT) for r in range(4)]
        codes = [p.wait(timeout=600) for p in procs]
        if codes != [0, 0, 0, 0]:
            raise RuntimeError(f"{case} reference: exit codes {codes}\n{(tmp / 'w0.log').read_text()[-2000:]}")
        records = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    return {s: r["loss"] for s, r in _last_per_step(records).items()}


def _on_die(record: Path, procs: list[subprocess.Popen], hook: Callable[[], None]) -> threading.Thread:
    """A thread that calls ``hook`` the moment the die record appears (the killed worker's host takes
    more with it: its etcd member), polling every millisecond; gives up when every process has ended."""
    def watch() -> None:
        while not (record.exists() and record.stat().st_size):
            if all(p.poll() is not None for p in procs):
                return
            time.sleep(0.001)
        hook()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def run_once(case: str, store_port: int, dead_after: float, root: Path = ROOT, model: str = "tiny", *,
             membership: Sequence[str] | None = None, on_kill: Callable[[], None] | None = None,
             join_delay: float = 0.0) -> dict[str, Any]:
    """One run of ``case``. ``membership``: each rank's ``TENPLEX_MEMBERSHIP_STORE`` (e.g. an etcd cluster's
    spec with the rank's host's member first) instead of the TCPStore at ``store_port``; ``on_kill``: called
    the moment the killed worker records its death (what else its host takes down); ``join_delay``: a grow
    case's replacement is started that many seconds after the kill (diagnosis: the survivors' recovery
    without the replacement's start beside it)."""
    extra, die = CASES[case]
    with tempfile.TemporaryDirectory(prefix="bench-native-") as d:
        tmp = Path(d)
        log = tmp / "log.jsonl"
        procs = []
        spawned = None  # when the replacement was started (GROWS)
        workers = SPARES.get(case, 4 if die else 2)
        base = {**_base_env(store_port, root), "TENPLEX_DIE_RECORD": str(tmp / "die.jsonl")}
        cmd = [sys.executable, str(root / "examples" / "train_native.py"), *COMMON, "--model", model, *extra, "--ckpt", str(tmp / "ckpt"),
               "--log", str(log), "--in-process", "--dead-after", str(dead_after), *(["--die-at", die] if die else [])]
        if not die:  # the joiner waits for the job before it starts: admitted after the first step
            procs.append(subprocess.Popen([*cmd, "--join"], env=_env(base, None, workers),
                                          stdout=(tmp / "w2.log").open("w"), stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while "waiting for job" not in (tmp / "w2.log").read_text():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"join: the joiner did not start: {(tmp / 'w2.log').read_text()[-2000:]}")
                time.sleep(0.05)
        for r in range(workers):
            env = _env(base, r, workers) if membership is None else \
                {**_env(base, r, workers), "TENPLEX_MEMBERSHIP_STORE": membership[r]}
            procs.append(subprocess.Popen(cmd, env=env, stdout=(tmp / f"w{r}.log").open("w"), stderr=subprocess.STDOUT))
        watcher = _on_die(tmp / "die.jsonl", procs, on_kill) if on_kill is not None and die else None
        if case in GROWS:  # the replacement, started at the kill (the die record is written just before it)
            _wait_file(tmp / "die.jsonl", procs, 300, case)
            time.sleep(join_delay)
            spawned = time.time()
            procs.append(subprocess.Popen([*cmd, "--join"], env=_env(base, None, workers),
                                          stdout=(tmp / f"w{len(procs)}.log").open("w"), stderr=subprocess.STDOUT))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        if watcher is not None:
            watcher.join(timeout=10)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        kills = [json.loads(line) for line in (tmp / "die.jsonl").read_text().splitlines()] if die else []
        expected = [-9, *[0] * (len(procs) - 1)] if die else [0, 0, 0]
        if sorted(codes) != expected:
            tails = "\n".join((tmp / f"w{r}.log").read_text()[-2000:] for r in range(len(procs)))
            raise RuntimeError(f"{case}: exit codes {codes}\n{tails}")
    rec = next(r for r in records if r.get("event") == "recover")
    first = next(r for r in records if "after_recovery" in r)
    t = rec["timings"]
    return {
        "step_moved": rec["step"], "newest": rec["newest"], "steps_redone": rec["newest"] - rec["step"],
        "detect_s": rec["detect_s"], "unwind_s": rec["unwind_s"], "release_s": rec["release_s"],
        "recover_s": rec["recover_s"], "agree_s": rec["agree_s"],
        "regroup_s": rec["regroup_s"], "ring_s": rec["ring_s"],
        "rebuild_s": rec["rebuild_s"], "rescale_s": rec["rescale_s"], "describe_s": t.get("describe", 0.0),
        "plan_s": t.get("plan", 0.0), "step_agree_s": t.get("agree", 0.0), "migrate_s": t.get("migrate", 0.0),
        "failure_to_state_s": rec["failure_to_state_s"], "first_step_s": first["time_s"],
        # the first step starts after the ring's first state: both count
        "failure_to_first_step_s": rec["failure_to_state_s"] + rec["ring_s"] + first["time_s"],
        # the kill's own wall time (the dying worker's) to the end of the first step after the recovery
        **({"kill_to_next_step_s": first["wall"] - kills[0]["wall"]} if kills else {}),
        "latency": rec.get("latency"), "rank0_parts": rec.get("parts"),
        # a step's time after the recovery's first, on the same mesh (what the first step costs beyond one)
        "step_s_after": statistics.median([r["time_s"] for r in records if "time_s" in r and r is not first
                                           and r.get("world_size") == first.get("world_size")
                                           and r["step"] > first["step"]] or [float("nan")]), "bytes_full_replica": rec.get("bytes_full_replica"),
        "bytes_live": rec["bytes_live"], "bytes_storage": rec["bytes_storage"], "bytes_local": rec["bytes_local"],
        "plan_bytes_peer": rec["plan_bytes_peer"], "plan_bytes_storage": rec["plan_bytes_storage"],
        "live_equals_plan": rec["bytes_live"] == rec["plan_bytes_peer"],
        "storage_equals_plan": rec["bytes_storage"] == rec["plan_bytes_storage"],
        "mesh_after": rec["mesh"], "alive": rec["alive"],
        "rank_order_plan_bytes_peer": rec.get("rank_order_plan_bytes_peer"),
        "layout_predicted": rec.get("layout_predicted"),
        "losses": {s: r["loss"] for s, r in _last_per_step(records).items()},
        **({**grow_figures(records, kills[0]), "joiner_timeline": joiner_timeline(records, kills[0], spawned)}
           if case in GROWS else {}),
        **(spare_figures(records, kills[0]) if case in SPARES else {}),
    }


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dead-after", type=float, default=10.0, help="the job's heartbeat verdict (its default 10 s)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_native_inprocess.json"))
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose examples/train_native.py and tenplex run")
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    load_before = os.getloadavg()
    result: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "job": " ".join(COMMON), "root": args.root, "repeats": args.repeats, "dead_after": args.dead_after,
                              "loadavg_before": load_before,
                              "cases": {}}
    for case in args.cases.split(","):
        runs, failed = [], []
        for i in range(args.repeats):
            print(f"{case} {i + 1}/{args.repeats} (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
            try:
                runs.append(run_once(case, store.port, args.dead_after, Path(args.root)))
            except (RuntimeError, StopIteration) as e:  # e.g. a heartbeat verdict misfiring under load: reported
                print(f"{case} {i + 1}: failed: {str(e)[:300]}", file=sys.stderr, flush=True)
                failed.append({"load": os.getloadavg()[0], "error": str(e)[-3000:]})
        if not runs:
            result["cases"][case] = {"failed": failed}
            continue
        keys = [k for k, v in runs[0].items() if isinstance(v, float)]
        result["cases"][case] = {"runs": runs, **{k: summary([r[k] for r in runs]) for k in keys},
                                 "bytes": {k: runs[0][k] for k in ("bytes_live", "bytes_storage", "bytes_local",
                                                                   "plan_bytes_peer", "plan_bytes_storage",
                                                                   "rank_order_plan_bytes_peer")},
                                 "alive": [r["alive"] for r in runs],
                                 "layout_predicted": [r["layout_predicted"] for r in runs],
                                 "live_equals_plan": all(r["live_equals_plan"] for r in runs),
                                 "storage_equals_plan": all(r["storage_equals_plan"] for r in runs),
                                 "steps_redone": [r["steps_redone"] for r in runs], "failed": failed}
    result["loadavg_after"] = os.getloadavg()
    for case, c in result["cases"].items():
        if "runs" not in c:
            print(f"{case}: every repeat failed")
            continue
        f = c["failure_to_first_step_s"]
        print(f"{case}: failure -> first step {f['median']:.2f} s [{f['min']:.2f}, {f['max']:.2f}]; "
              f"detect {c['detect_s']['median']:.2f} unwind {c['unwind_s']['median']:.2f} "
              f"release {c['release_s']['median']:.2f} (then recover() {c['recover_s']['median']:.2f}: "
              f"agree {c['agree_s']['median']:.2f}) ring {c['ring_s']['median']:.2f} "
              f"rebuild {c['rebuild_s']['median']:.2f} rescale {c['rescale_s']['median']:.2f} "
              f"(migrate {c['migrate_s']['median']:.3f}) first step {c['first_step_s']['median']:.2f}; "
              f"bytes {c['bytes']}; live == plan {c['live_equals_plan']}, storage == plan {c['storage_equals_plan']}; "
              f"steps redone {c['steps_redone']}; failed repeats {len(c['failed'])}")
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
