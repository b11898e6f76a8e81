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
  join round, and no step is redone.

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
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def run_once(case: str, store_port: int, dead_after: float, root: Path = ROOT, model: str = "tiny") -> dict[str, Any]:
    extra, die = CASES[case]
    with tempfile.TemporaryDirectory(prefix="bench-native-") as d:
        tmp = Path(d)
        log = tmp / "log.jsonl"
        port = free_port()
        procs = []
        workers = 4 if die else 2
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TENPLEX_MEMBERSHIP_STORE": f"127.0.0.1:{store_port}", "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "TENPLEX_DIE_RECORD": str(tmp / "die.jsonl"),
                "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(root / "examples" / "train_native.py"), *COMMON, "--model", model, *extra, "--ckpt", str(tmp / "ckpt"),
               "--log", str(log), "--in-process", "--dead-after", str(dead_after), *(["--die-at", die] if die else [])]
        if not die:  # the joiner waits for the job before it starts: admitted after the first step
            env = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE")}
            procs.append(subprocess.Popen([*cmd, "--join"], env={**env, "LOCAL_RANK": "0"},
                                          stdout=(tmp / "w2.log").open("w"), stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while "waiting for job" not in (tmp / "w2.log").read_text():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"join: the joiner did not start: {(tmp / 'w2.log').read_text()[-2000:]}")
                time.sleep(0.05)
        for r in range(workers):
            env = {**base, "RANK": str(r), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(r)}
            procs.append(subprocess.Popen(cmd, env=env, stdout=(tmp / f"w{r}.log").open("w"),
                                          stderr=subprocess.STDOUT))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        kills = [json.loads(line) for line in (tmp / "die.jsonl").read_text().splitlines()] if die else []
        if sorted(codes) != ([-9, 0, 0, 0] if die else [0, 0, 0]):
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
