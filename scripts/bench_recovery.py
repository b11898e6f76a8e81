#!/usr/bin/env python
"""Recovery after a host failure: from host stores (tenplex) versus persistent checkpoints only.

Two simulated hosts (a store process and a torchrun agent with 2 workers each, layout
dp=1,tp=2,pp=2) train; after a given step one host dies (store, agent and workers). Mode
"stores": snapshots go to the host stores every few steps (one replica on the other host)
and the survivor recovers from memory. Mode "persistent": only persistent checkpoints (a
local directory here) every K steps, as peers do. Reported per mode: recovery time (failure
to the first step finished after resuming), its parts, steps lost, bytes per tier.

`--json` runs the two paths of issue #18 side by side on the same job (host stores, a snapshot
every step): "in_process" (the survivors keep running, agree, move their state live and read
only the dead host's pieces from their host store) and "restart" (torchrun's agent restarts the
survivors, rescale() loads from the stores), `--repeats` times each (alternating), for tiny and
llama-100m (`--quick`: tiny only); it prints medians with min/max, every repeat and the load
average, and writes docs/bench/bench_inprocess.json (not with --quick).

`--join` measures scale up in-process (issue #18 item 4): 2 env:// workers (tiny, dp=2) and 2
processes started with `--join` beside them (the tests' pattern: a standalone membership store);
the workers admit the joiners at a step boundary and send them their state live; 4 workers go on
under dp=1,tp=2,pp=2. Reported per repeat: join boundary -> first step under the new layout and
its parts, bytes sent live against the plan's peer bytes, bytes from storage, losses against a
single-process run; medians with min/max over `--repeats`, the load average, docs/bench/bench_join.json.

`--json` also runs the torch-native job side by side with torchft (issue #31): examples/train_native.py's
12.1M-parameter Llama (native_llama's "12m"), AdamW, 4 gloo workers as HSDP 2 x 2, one worker SIGKILLed in a
forward pass. tenplex (`ElasticRuntime`, in process; scripts/bench_native_inprocess.py's run, worker 3 and,
with the membership store outside the job, worker 0) against torchft 0.2.0 on the same model and optimizer
(scripts/torchft_job.py: 2 replica groups of 2 workers, FSDP2 inside, each group under its own torchrun,
its Manager and a Lighthouse on 127.0.0.1 with a 1 s heartbeat timeout and with its default 5 s; one worker
of group 1 SIGKILLed in a forward pass). Reported per repeat: the kill -> the next step (tenplex: the
survivors' first step after the recovery; torchft: the surviving group's next committed step), tenplex's
latency table and bytes moved beside the bytes a full-replica copy would move, and torchft's heal (kill ->
the restarted group committing again) and the bytes of its full copy. `--native-only`: only this part.
The worker-3 run (`hsdp3_grow`) also grows back, as torchft's heal does: a replacement is started at the kill
(`train_native.py --join`, as torchrun's restart of torchft's group starts one); it registers, the survivors
admit it at their next step boundary and send it its shards live, and 4 workers go on. Reported per repeat
beside torchft's heal (`grow_back`): the kill -> the first step back at full size, the join's own time (its
round's start -> that step), the bytes the replacement received live (all it holds) against torchft's full
copy, the join's bytes from storage, and the losses against the same job uninterrupted (within 1e-5); and
the replacement's timeline (`joiner_timeline`: each mark of its start, from the benchmark's spawn to the first
step at full size, as seconds since the kill on the one clock the workers share). `goal`: issue #31's, the
rows where a worker dies and the survivors go on (`hsdp0`, `hsdp0_etcd`) below torchft's best kill -> next
step, back at full size before its best heal with fewer bytes than its full copy and equal losses;
`like_for_like`: the worker-3 row's kill -> next step against the same figure (its replacement's start-up on
the same 2 cores as the survivors', as torchft's restarted group shares them). A third run (`hsdp3_spare`,
its own row `spare`) is a different set-up: 5 workers, a mesh of 4, the 5th a spare running at the kill, which
the failure's own recovery promotes: the kill -> the first step on 4 trainers again (`spare_back_full_s`), the
bytes sent to the spare, the losses; torchft has no spare (its heal restarts the dead group).

The rank-0 kill once more with no single point of failure (`tenplex_hsdp0_etcd`, issue #31 item 3): the
job's membership on a 3-member etcd cluster (`tenplex.train.etcd.EtcdCluster`, one member per simulated
host on loopback ports; workers 0, 1, 2-3 on hosts 0, 1, 2, each its own host's member first), member e0
made the leader, and the moment worker 0 records its death e0 is SIGKILLed too (the leader check and
the kill take 10-30 ms). Reported per repeat as for the other rows, plus whether e0 was still the leader,
and the losses against the same job uninterrupted (within 1e-5). `--etcd-only`: this row alone, each
repeat followed by the TCPStore `hsdp0` run (`tcpstore`) for a comparison at the same load
(docs/bench/bench_native_etcd.json).

The torchtitan job (`torchtitan`, scripts/titan_elastic.py's `measure`; `--no-titan` leaves it out): its
own `Trainer` on 4 workers as FSDP2 2 x TP 2, worker 3 killed in a forward pass, the survivors in process as
FSDP2 3 against torchtitan's restart from its DCP checkpoint, and HSDP 2 x 2 -> FSDP2 3; each recovery's
latency table with the bytes moved live and those a full-replica copy would move (docs/bench/titan_elastic.json).

A run whose log shows a recovery that began before the kill (a failure verdict with no failure),
or whose figures are not all positive, is refused: the script exits with status 3 and says why
(issue 29 item 7: such a run once reported recovery_s -6.16 and detect_s -103.5 and exited 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))
import bench_native_inprocess as native  # noqa: E402 - the torch-native job's run, shared
import titan_elastic  # noqa: E402 - the torchtitan job's figures (--json)
from figures import spread as _spread  # noqa: E402 - a figure over repeats

from tenplex.cli import human_bytes  # noqa: E402
from tenplex.train.launch import (  # noqa: E402
    HostsConfig, RendezvousStore, free_port, kill_alive, read_train_log, start_hosts, wait_for,
)

REFUSED = 3  # the exit status of a refused run

#: Figures of a run (seconds) that are positive in every sound run, by mode.
POSITIVE = {
    "in_process": ("recovery_s", "detect_s", "agree_s", "regroup_s", "first_step_s", "first_step_compute_s",
                   "ready_s", "step_s"),
    "stores": ("recovery_s", "restart_s", "startup_s", "first_step_s", "first_step_compute_s", "ready_s", "step_s"),
    "native": ("recovery_s",),
    # the grow back of the native job (its kill, a replacement started at it, admitted live)
    "grow": ("kill_to_full_size_s", "join_s", "bytes_to_joiner"),
    # a spare running at the kill, promoted in the failure's own recovery
    "spare": ("spare_back_full_s", "bytes_to_spare"),
    "join": ("join_s", "agree_s", "regroup_s", "first_step_s", "first_step_compute_s", "step_s_before",
             "step_s_after"),
}
POSITIVE["persistent"] = POSITIVE["stores"]


class Refused(RuntimeError):
    """A run this benchmark will not report: its log contradicts what was done to it."""


def recovery_after(events: list[dict], t_fail: float, where: str) -> dict:
    """The first in-process recovery of ``events`` (the log's start/recover events), which must have
    begun after the kill at ``t_fail`` (``time.time()``); Refused for one that began before it (a
    member found dead with nobody killed: the heartbeat verdict of issue 29 item 7) or for none."""
    recs = [e for e in events if e.get("event") == "recover"]
    early = [e for e in recs if min(e["wall"], e["failed_at"]) <= t_fail]
    if early:
        e = early[0]
        raise Refused(f"{where}: an in-process recovery at step {e['step']} began {t_fail - e['failed_at']:.1f} s "
                      f"before the kill (a failure verdict with no failure)")
    if not recs:
        raise Refused(f"{where}: the log holds no in-process recovery after the kill")
    return recs[0]


def check_positive(out: dict, mode: str, where: str) -> dict:
    """``out`` if each of its figures ``POSITIVE[mode]`` is a positive number, else Refused naming them."""
    bad = {k: out.get(k) for k in POSITIVE[mode] if not (isinstance(out.get(k), (int, float)) and out[k] > 0)}
    if bad:
        raise Refused(f"{where}: figures that must be positive are not: "
                      + ", ".join(f"{k}={v!r}" for k, v in bad.items()))
    return out




def run(model: str, mode: str, *, steps: int, fail_after: int, snapshot_every: int, ckpt_every: int,
        extra: list[str], shm: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"tenplex-rec-{model}-{mode}-"))
    store_dir = tempfile.mkdtemp(prefix="tenplex-rec-", dir=shm) if os.path.isdir(shm) else str(work)
    log = work / "log.jsonl"
    args = ["--model", model, "--steps", str(steps), "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(work / "ckpt"),
            "--log", str(log), *extra]
    if mode in ("stores", "in_process"):
        args += ["--store", "auto", "--snapshot-every", str(snapshot_every), "--ckpt-every", str(10**6)]
        if mode == "in_process":
            args += ["--in-process"]
    else:
        args += ["--ckpt-every", str(ckpt_every)]
    rdzv = RendezvousStore()
    hosts = start_hosts(HostsConfig(2, str(work), args, nproc=2, endpoint=rdzv.endpoint, run_id=f"b{free_port()}",
                                    store_dir=store_dir))
    try:
        def four() -> int:
            return max([o["step"] for o in read_train_log(log)[0] if o["world_size"] == 4] or [0])

        if not wait_for(lambda: four() >= fail_after, 900):
            raise RuntimeError(f"{model}/{mode}: did not reach step {fail_after}; see {work}")
        fail_step, t_fail = four(), time.time()
        load_at_failure = os.getloadavg()[0]
        hosts[1].kill()
        if mode == "in_process":
            # the survivors' agent knows nothing of the recovery and would wait up to 300 s in torchrun's
            # exit barrier for the dead host's agent: done when the last step is logged and its workers exited
            wait_for(lambda: max([o["step"] for o in read_train_log(log)[0]] or [0]) >= steps, 1800)
            wait_for(lambda: not any(_running(p) for p in hosts[0].agent.worker_pids()), 120)
            rc = 0 if max(o["step"] for o in read_train_log(log)[0]) >= steps else 1
        else:
            rc = hosts[0].agent.wait(timeout=1800)
        if rc != 0:
            raise RuntimeError(f"{model}/{mode}: survivor failed ({rc}); see {work}")
    finally:
        for h in hosts:
            h.stop()
        rdzv.stop()
    runs, starts = read_train_log(log)
    step_s = sorted(r["time_s"] for r in runs if r["world_size"] == 4)
    final = {r["step"]: r for r in runs}
    where = f"{model}/{mode} (load {load_at_failure:.1f}; see {work})"
    if mode == "in_process":
        rec = recovery_after(starts, t_fail, where)
        first = min((r for r in runs if r["wall"] > rec["wall"]), key=lambda r: r["wall"])
        t = rec["timings"]
        persistent = any(str(work / "ckpt") in u for u in rec.get("storage_urls", []))
        out = {
            "model": model, "mode": mode, "fail_step": fail_step, "resumed_step": rec["step"],
            "steps_lost": fail_step - rec["step"], "recovery_s": first["wall"] - t_fail,
            "detect_s": rec["failed_at"] - t_fail, "agree_s": rec["agree_s"], "regroup_s": rec["regroup_s"],
            "choose_plan_s": t.get("choose", 0) + t.get("plan", 0) + t.get("agree", 0),
            "transfer_s": t.get("migrate_transfer", 0), "storage_s": t.get("migrate_storage", 0),
            "first_step_s": first["wall"] - rec["wall"], "first_step_compute_s": first["time_s"],
            "ready_s": first["wall"] - first["time_s"] - t_fail, "step_s": step_s[len(step_s) // 2],
            "layout_after": rec["layout"], "bytes_live": rec["bytes_live"], "plan_bytes_peer": rec["plan_bytes_peer"],
            "plan_bytes_moved": rec["plan_bytes_moved"], "bytes_storage": rec["bytes_storage"],
            "bytes_persistent": rec["bytes_storage"] if persistent else 0, "storage_urls": rec.get("storage_urls", []),
            "bytes_local": rec["bytes_local"], "load_at_failure": load_at_failure,
            # the recovery's latency table (issue #31 item 4) and what a torchft-style full-replica copy would move
            "latency": rec.get("latency") or {}, "bytes_full_replica": rec.get("bytes_full_replica", 0),
            "losses": {s: final[s]["loss"] for s in sorted(final)},
            "samples": [x for s in sorted(final) for x in final[s]["samples"]],
        }
    else:
        resume = [s for s in starts if s["wall"] > t_fail and s.get("event") == "start"][-1]
        first = min((r for r in runs if r["wall"] > t_fail), key=lambda r: r["wall"])
        out = {
            "model": model, "mode": mode, "fail_step": fail_step, "resumed_step": resume["step"],
            "steps_lost": fail_step - resume["step"],
            "recovery_s": first["wall"] - t_fail,
            "restart_s": resume["process_start"] - t_fail,
            "startup_s": resume["wall"] - resume["process_start"],
            "load_s": resume["timings"].get("load", 0.0),
            "first_step_s": first["wall"] - resume["wall"], "first_step_compute_s": first["time_s"],
            "ready_s": first["wall"] - first["time_s"] - t_fail,
            "step_s": step_s[len(step_s) // 2],
            "bytes_by_tier": resume.get("bytes_by_tier_all", {}),
            "bytes_needed": resume.get("bytes_needed_all", 0),
            "load_at_failure": load_at_failure,
            "losses": {s: final[s]["loss"] for s in sorted(final)},
            "samples": [x for s in sorted(final) for x in final[s]["samples"]],
        }
    check_positive(out, mode, where)
    # time to get back to where the failure struck: recovery plus redoing the lost steps
    out["time_to_catch_up_s"] = out["recovery_s"] + max(0, out["steps_lost"] - 1) * out["step_s"]
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(store_dir, ignore_errors=True)
    return out


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        return False


def side_by_side(cases: list[tuple[str, dict]], repeats: int, shm: str) -> dict:
    """Both paths of #18 on the same job, alternating, ``repeats`` times each."""
    models = {}
    for model, kw in cases:
        runs: dict[str, list[dict]] = {"in_process": [], "restart": []}
        for i in range(repeats):
            for mode in ("in_process", "restart"):
                print(f"{model} / {mode} {i + 1}/{repeats} (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr,
                      flush=True)
                r = run(model, "in_process" if mode == "in_process" else "stores", shm=shm, **kw)
                print(f"  recovery {r['recovery_s']:.2f}s, steps lost {r['steps_lost']}", file=sys.stderr, flush=True)
                runs[mode].append(r)
        ip, rs = runs["in_process"], runs["restart"]
        rel = max(abs(a["losses"][s] - b["losses"][s]) / abs(b["losses"][s])
                  for a in ip for b in rs for s in b["losses"])
        same_data = all(a["samples"] == rs[0]["samples"] for a in ip + rs)
        for r in ip + rs:
            r.pop("samples")
        models[model] = {
            "in_process_s": _spread([r["recovery_s"] for r in ip]),
            "restart_s": _spread([r["recovery_s"] for r in rs]),
            # the same without the first step's own compute (failure -> that step starts)
            "in_process_ready_s": _spread([r["ready_s"] for r in ip]),
            "restart_ready_s": _spread([r["ready_s"] for r in rs]),
            "speedup": statistics.median(r["recovery_s"] for r in rs) / statistics.median(r["recovery_s"] for r in ip),
            "bytes_live": _spread([r["bytes_live"] for r in ip]),
            "bytes_full_replica": _spread([r["bytes_full_replica"] for r in ip]),
            "latency": {k: _spread([r["latency"][k] for r in ip]) for k in (ip[0]["latency"] or {})
                        if all(isinstance(r["latency"].get(k), (int, float)) for r in ip)},
            "plan_bytes_peer": _spread([r["plan_bytes_peer"] for r in ip]),
            "bytes_storage": _spread([r["bytes_storage"] for r in ip]),
            "bytes_persistent": _spread([r["bytes_persistent"] for r in ip]),
            "steps_lost_in_process": _spread([r["steps_lost"] for r in ip]),
            "steps_lost_restart": _spread([r["steps_lost"] for r in rs]),
            "losses_equal": rel <= 1e-6 and same_data, "max_rel_loss_diff": rel, "same_samples": same_data,
            "load_at_failure": _spread([r["load_at_failure"] for r in ip + rs]),
            "in_process_runs": ip, "restart_runs": rs,
        }
    return models


JOIN_ARGS = ["--model", "tiny", "--global-batch", "8", "--micro-batch", "2", "--seed", "7", "--steps", "10",
             "--parallel", "dp=2,tp=1,pp=1/dp=1,tp=2,pp=2"]


def _trainer(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tenplex.train", *args], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, cwd=str(ROOT))


def run_join(work: Path, reference: dict[int, float]) -> dict:
    """One scale up: 2 joiners wait for the job, 2 workers start and admit them (see the module doc)."""
    rdzv = RendezvousStore()
    master = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "TENPLEX_MEMBERSHIP_STORE": rdzv.endpoint,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = work / "log.jsonl"
    procs: list[subprocess.Popen] = []
    try:
        for j in range(2):
            procs.append(_trainer([*JOIN_ARGS, "--in-process", "--join"], work / f"joiner{j}.log",
                                  {**base, "LOCAL_RANK": "0"}))
        if not wait_for(lambda: all("waiting for job" in (work / f"joiner{j}.log").read_text() for j in range(2)), 120):
            raise RuntimeError(f"the joiners did not start; see {work}")
        for r in range(2):
            procs.append(_trainer([*JOIN_ARGS, "--in-process", "--log", str(log)], work / f"worker{r}.log",
                                  {**base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)}))
        codes = [p.wait(timeout=300) for p in procs]
        if codes != [0, 0, 0, 0]:
            raise RuntimeError(f"exit codes {codes}; see {work}")
    finally:
        kill_alive(procs)
        rdzv.stop()
    runs, events = read_train_log(log)
    rec = [e for e in events if e.get("event") == "recover"][0]
    first = min((r for r in runs if r["wall"] > rec["wall"]), key=lambda r: r["wall"])
    t = rec["timings"]
    if any(e.get("event") == "recover" and e.get("reason") == "failure" for e in events):
        raise Refused(f"join: a recovery from a failure where nothing was killed (a failure verdict with no "
                      f"failure); see {work}")
    rel = max(abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]]) for r in runs)
    seen = [x for r in runs for x in r["samples"]]
    out = {"joined_after_step": rec["step"], "layout_before": rec["previous"], "layout_after": rec["layout"],
           "join_s": first["wall"] - rec["failed_at"], "agree_s": rec["agree_s"], "regroup_s": rec["regroup_s"],
           "choose_plan_s": t.get("choose", 0) + t.get("plan", 0) + t.get("agree", 0),
           "transfer_s": t.get("migrate_transfer", 0), "migrate_s": t.get("migrate", 0),
           "first_step_s": first["wall"] - rec["wall"], "first_step_compute_s": first["time_s"],
           "step_s_before": statistics.median(r["time_s"] for r in runs if r["world_size"] == 2),
           "step_s_after": statistics.median(r["time_s"] for r in runs if r["world_size"] == 4 and r is not first),
           "bytes_live": rec["bytes_live"], "plan_bytes_peer": rec["plan_bytes_peer"],
           "bytes_storage": rec["bytes_storage"], "max_rel_loss_diff": rel,
           "samples_once": len(seen) == len(set(seen)) == 8 * len(runs)}
    return check_positive(out, "join", f"join (see {work})")


def join_bench(repeats: int) -> dict:
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="tenplex-join-"))
    ref_log = work / "ref.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if _trainer([*JOIN_ARGS[:-2], "--log", str(ref_log)], work / "ref.log", env).wait(timeout=300) != 0:
        raise RuntimeError(f"the reference run failed; see {work}")
    reference = {r["step"]: r["loss"] for r in read_train_log(ref_log)[0]}
    runs = []
    for i in range(repeats):
        d = work / f"run{i}"
        d.mkdir()
        load = os.getloadavg()[0]
        print(f"join {i + 1}/{repeats} (load {load:.2f}) ...", file=sys.stderr, flush=True)
        r = run_join(d, reference)
        r["load"] = load
        print(f"  join -> first step {r['join_s']:.3f}s, {r['bytes_live']} B live", file=sys.stderr, flush=True)
        runs.append(r)
    shutil.rmtree(work, ignore_errors=True)
    keys = ("join_s", "agree_s", "regroup_s", "choose_plan_s", "transfer_s", "first_step_s", "first_step_compute_s",
            "step_s_before", "step_s_after", "bytes_live", "plan_bytes_peer", "bytes_storage", "max_rel_loss_diff")
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "command": f"python scripts/bench_recovery.py --join --repeats {repeats}", "repeats": repeats,
            "job": " ".join(JOIN_ARGS), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            **{k: _spread([r[k] for r in runs]) for k in keys},
            "bytes_live_equal_plan": all(r["bytes_live"] == r["plan_bytes_peer"] for r in runs),
            "losses_equal": all(r["max_rel_loss_diff"] <= 1e-6 for r in runs),
            "samples_once": all(r["samples_once"] for r in runs), "runs": runs}


# -- the torch-native job beside torchft (issue #31) --------------------------------------------------

NATIVE_MODEL = "12m"
TORCHFT_GROUPS, TORCHFT_GROUP_SIZE = 2, 2
TORCHFT_DIE = "1:1:5"  # group 1's worker 1, in the forward pass of step 5
HEAL_STEPS = 2  # the restarted group's committed steps the torchft run waits for before it is stopped
GROW_LOSS_RTOL = 1e-5  # a grow-back run's losses against the uninterrupted run (4 -> 3 -> 4 workers reduce in
#                        another order: not bit-equal), the bound issue #31 sets for the torchtitan job
GROW_LATENCY = ("agreement_s", "regroup_s", "rebuild_s", "choose_plan_s", "transfer_s", "first_step_s", "total_s")
GROW_KEYS = ("kill_to_full_size_s", "join_s", "bytes_to_joiner", "join_bytes_live", "join_bytes_storage",
             "max_rel_loss_diff")
SPARE_KEYS = ("spare_back_full_s", "bytes_to_spare", "spare_bytes_live", "spare_bytes_storage", "max_rel_loss_diff")
SPARE_SETUP = ("a different set-up from the replacement started at the kill: 5 workers, the mesh holds 4 (HSDP 2 x 2), "
               "the 5th waits as a spare and takes the killed worker's place in the failure's own recovery; torchft "
               "has no spare (its heal restarts the dead replica group)")


def torchft_figures(events: list[dict], where: str) -> dict:
    """The figures of one torchft run from its workers' events (scripts/torchft_job.py): the kill ->
    the surviving groups' next committed step (the step's end on its slowest worker), the kill ->
    the restarted group committing again (heal), the restarted group's state bytes (its full copy).
    Refused when the log lacks the kill, a committed step after it, or the heal."""
    kills = [e for e in events if e.get("event") == "die"]
    if len(kills) != 1:
        raise Refused(f"{where}: {len(kills)} kills in the log, expected 1")
    kill = kills[0]
    t_kill, dead = kill["wall"], kill["group"]
    early = [e for e in events if e.get("event") == "step" and e["group"] != dead and not e["committed"]
             and e["wall"] < t_kill]
    if early:
        raise Refused(f"{where}: group {early[0]['group']} failed to commit step {early[0]['step']} before the kill")

    def committed(group: int, after: float, restarted: bool) -> list[dict]:  # steps at or after the killed one
        return [e for e in events if e.get("event") == "step" and e["group"] == group and e["committed"]
                and e["wall"] > after and (e["restart"] > 0) == restarted and e["step"] >= kill["step"]]

    survivors = sorted({e["group"] for e in events if e.get("event") == "start"} - {dead})
    recovery, first_step = [], {}
    for g in survivors:
        after = committed(g, t_kill, False)
        if not after:
            raise Refused(f"{where}: group {g} committed no step after the kill")
        step = min(e["step"] for e in after)
        first_step[g] = step
        recovery.append(max(e["wall"] for e in after if e["step"] == step) - t_kill)
    healed = committed(dead, t_kill, True)
    if not healed:
        raise Refused(f"{where}: the restarted group {dead} committed no step")
    heal_step = min(e["step"] for e in healed)
    starts = {e["rank"]: e for e in events if e.get("event") == "start" and e["group"] == dead and e["restart"] > 0}
    full_copy = sum(e["state_bytes"] for e in starts.values())
    lost = sorted({e["step"] for e in events if e.get("event") == "step" and e["group"] in survivors
                   and not e["committed"] and e["wall"] > t_kill})
    out = {"recovery_s": max(recovery), "heal_s": max(e["wall"] for e in healed if e["step"] == heal_step) - t_kill,
           "killed_at_step": kill["step"], "next_committed_step": max(first_step.values()),
           "uncommitted_steps": lost, "heal_step": heal_step, "bytes_full_copy": full_copy,
           "restarts": max(e["restart"] for e in events if e.get("event") == "start")}
    if not (out["recovery_s"] > 0 and out["heal_s"] > 0 and full_copy > 0):
        raise Refused(f"{where}: figures that must be positive are not: {out}")
    return out


def _read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def torchft_run(heartbeat_ms: int, work: Path, *, steps: int = 400) -> dict:
    """One torchft run of the native job: a Lighthouse on 127.0.0.1, 2 replica groups of 2 workers
    each under their own torchrun (restarts allowed), one worker killed; stopped once the restarted
    group committed ``HEAL_STEPS`` steps (or after ``steps``)."""
    bindir = Path(sys.executable).parent
    lh_port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}", "NUM_REPLICA_GROUPS": str(TORCHFT_GROUPS),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    events = work / "events.jsonl"
    procs = [subprocess.Popen([str(bindir / "torchft_lighthouse"), "--min_replicas", "1", "--bind",
                               f"127.0.0.1:{lh_port}", "--heartbeat_timeout_ms", str(heartbeat_ms)],
                              stdout=(work / "lighthouse.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True)]
    load = os.getloadavg()[0]
    try:
        for g in range(TORCHFT_GROUPS):
            procs.append(subprocess.Popen(
                [str(bindir / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(TORCHFT_GROUP_SIZE),
                 "--max-restarts", "5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                 str(ROOT / "scripts" / "torchft_job.py"), "--events", str(events), "--steps", str(steps),
                 "--model", NATIVE_MODEL, "--global-batch", native.COMMON[native.COMMON.index("--global-batch") + 1],
                 "--die-at", TORCHFT_DIE],
                env={**env, "REPLICA_GROUP_ID": str(g)}, stdout=(work / f"group{g}.log").open("w"),
                stderr=subprocess.STDOUT, start_new_session=True))

        def healed() -> bool:
            ev = _read_events(events)
            return sum(1 for e in ev if e.get("event") == "step" and e["restart"] > 0 and e["committed"]) \
                >= HEAL_STEPS * TORCHFT_GROUP_SIZE

        ok = wait_for(lambda: healed() or any(p.poll() is not None for p in procs[1:]), 600)
    finally:
        for p in procs:  # each torchrun with its workers (its own session)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    where = f"torchft heartbeat {heartbeat_ms} ms (load {load:.1f}; see {work})"
    if not ok:
        raise RuntimeError(f"{where}: timed out")
    out = torchft_figures(_read_events(events), where)
    out["load"] = load
    return out


def tenplex_native_run(case: str, store_port: int, reference: dict[int, float] | None = None, **run_kw: Any) -> dict:
    """One tenplex run of the native job (scripts/bench_native_inprocess.py's, on the 12m model; ``run_kw``
    to its ``run_once``); a case with a replacement (``native.GROWS``) also its grow back and its losses against
    ``reference`` (the same job uninterrupted), refused when the log lacks the grow back."""
    load = os.getloadavg()[0]
    r = native.run_once(case, store_port, 10.0, model=NATIVE_MODEL, **run_kw)
    lat = r["latency"] or {}
    out = {"recovery_s": r["kill_to_next_step_s"], "load": load, "losses": r["losses"],
           "latency": {k: lat.get(k) for k in ("detection_s", "agreement_s", "regroup_s", "rebuild_s",
                                               "choose_plan_s", "transfer_s", "first_step_s", "total_s")},
           "bytes_live": r["bytes_live"], "bytes_storage": r["bytes_storage"], "bytes_local": r["bytes_local"],
           "bytes_full_replica": r["bytes_full_replica"], "steps_redone": r["steps_redone"],
           "mesh_after": r["mesh_after"], "parts": {k: r[k] for k in ("detect_s", "unwind_s", "release_s", "agree_s",
                                                                       "regroup_s", "rebuild_s", "rescale_s",
                                                                       "describe_s", "migrate_s", "ring_s",
                                                                       "first_step_s")}}
    where = f"tenplex native {case} (load {load:.1f})"
    if case in native.GROWS:
        out.update(grow_back(r, reference or {}, where))
    if case in native.SPARES:
        out.update(spare_back(r, reference or {}, where))
    return check_positive(out, "native", where)


def grow_back(r: dict, reference: dict[int, float], where: str) -> dict:
    """A grow-back run's figures (``native.grow_figures``'s, in ``r``) and its losses against the
    uninterrupted run's ``reference``, equal within ``GROW_LOSS_RTOL``; Refused when a figure is missing
    or not positive, or the steps logged are not the reference's."""
    out = {k: r[k] for k in ("kill_to_full_size_s", "join_s", "bytes_to_joiner", "join_bytes_live",
                             "join_bytes_storage", "full_size_step", "joined_after_step", "join_mesh")}
    out["join_latency"] = {k: (r.get("join_latency") or {}).get(k) for k in GROW_LATENCY}
    check_positive(out, "grow", where)
    if not r.get("joiner_timeline"):
        raise Refused(f"{where}: no timeline of the replacement (its joined record, the join's round start)")
    out["joiner_timeline"] = r["joiner_timeline"]
    return {**out, **_losses_against(r, reference, where)}


def spare_back(r: dict, reference: dict[int, float], where: str) -> dict:
    """A spare run's figures (``native.spare_figures``'s, in ``r``) and its losses against the same job
    uninterrupted; Refused as ``grow_back``."""
    out = {k: r[k] for k in ("spare_back_full_s", "bytes_to_spare", "spare_bytes_live", "spare_bytes_storage",
                             "spare_world_after")}
    check_positive(out, "spare", where)
    return {**out, **_losses_against(r, reference, where)}


def _losses_against(r: dict, reference: dict[int, float], where: str) -> dict:
    """The run's losses (``r["losses"]``, the last record per step) against ``reference``: the largest
    relative difference and whether it is within ``GROW_LOSS_RTOL``; Refused for other steps."""
    losses = {int(s): v for s, v in r["losses"].items()}
    if sorted(losses) != sorted(reference):
        raise Refused(f"{where}: steps logged {sorted(losses)} are not the uninterrupted run's {sorted(reference)}")
    rel = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference)
    return {"max_rel_loss_diff": rel, "losses_equal": rel <= GROW_LOSS_RTOL}


def _spreads(runs: list[dict], keys: Sequence[str]) -> dict:
    return {k: _spread([r[k] for r in runs]) for k in keys}


NATIVE_CASES = ("hsdp3_grow", "hsdp0", "hsdp3_spare")
HEARTBEATS = (1000, 5000)


def native_side_by_side(repeats: int, cases: Sequence[str] = NATIVE_CASES, heartbeats: Sequence[int] = HEARTBEATS,
                        join_delay: float = 0.0) -> dict:
    """tenplex and torchft on the native job, alternating, ``repeats`` times each (see the module doc);
    ``join_delay``: a grow case's replacement started that many seconds after the kill (diagnosis)."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    references = {}
    for c in cases:
        if c in native.GROWS or c in native.SPARES:  # the losses a run must match: the same job, uninterrupted
            print(f"native / {c}: the uninterrupted run (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr,
                  flush=True)
            references[c] = native.reference_losses(store.port, c, model=NATIVE_MODEL)
    runs: dict[str, list[dict]] = {**{f"tenplex_{c}": [] for c in cases}, **{f"torchft_{h}ms": [] for h in heartbeats}}
    for i in range(repeats):
        for c in cases:
            print(f"native / tenplex {c} {i + 1}/{repeats} (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr,
                  flush=True)
            r = tenplex_native_run(c, store.port, references.get(c),
                                   **({"join_delay": join_delay} if c in native.GROWS else {}))
            print(f"  kill -> next step {r['recovery_s']:.2f}s"
                  + (f", -> full size {r['kill_to_full_size_s']:.2f}s (join {r['join_s']:.2f}s, "
                     f"{r['bytes_to_joiner']:,} B to the joiner)" if c in native.GROWS else "")
                  + (f", spare promoted: 4 trainers after {r['spare_back_full_s']:.2f}s, {r['bytes_to_spare']:,} B "
                     f"to it" if c in native.SPARES else ""),
                  file=sys.stderr, flush=True)
            runs[f"tenplex_{c}"].append(r)
        for h in heartbeats:
            print(f"native / torchft heartbeat {h} ms {i + 1}/{repeats} (load {os.getloadavg()[0]:.2f}) ...",
                  file=sys.stderr, flush=True)
            work = Path(tempfile.mkdtemp(prefix="tenplex-torchft-"))
            r = torchft_run(h, work)
            shutil.rmtree(work, ignore_errors=True)
            print(f"  kill -> next committed step {r['recovery_s']:.2f}s, heal {r['heal_s']:.1f}s", file=sys.stderr,
                  flush=True)
            runs[f"torchft_{h}ms"].append(r)
    out: dict[str, Any] = {"model": f"native_llama {NATIVE_MODEL}", "job": " ".join(native.COMMON),
                           "layout": "HSDP dp_replicate=2 x dp_shard=2, 4 gloo workers"}
    for c in cases:
        rs = runs[f"tenplex_{c}"]
        out[f"tenplex_{c}"] = {
            "killed": native.CASES[c][1], **_spreads(rs, ("recovery_s", "load", "bytes_live", "bytes_storage",
                                                          "bytes_full_replica")),
            "latency": {k: _spread([r["latency"][k] for r in rs]) for k in rs[0]["latency"]
                        if all(isinstance(r["latency"][k], (int, float)) for r in rs)},
            "parts": {k: _spread([r["parts"][k] for r in rs]) for k in rs[0]["parts"]}, "runs": rs}
        if c in native.GROWS:
            lat = {k: _spread([r["join_latency"][k] for r in rs]) for k in GROW_LATENCY
                   if all(isinstance(r["join_latency"][k], (int, float)) for r in rs)}
            marks = {k: _spread([r["joiner_timeline"][k] for r in rs]) for k in native.JOINER_MARKS
                     if all(k in r["joiner_timeline"] for r in rs)}
            out[f"tenplex_{c}"].update(_spreads(rs, GROW_KEYS), losses_equal=all(r["losses_equal"] for r in rs),
                                       join_latency=lat, joiner_timeline=marks)
        if c in native.SPARES:
            out[f"tenplex_{c}"].update(_spreads(rs, SPARE_KEYS), losses_equal=all(r["losses_equal"] for r in rs),
                                       setup=SPARE_SETUP)
    for h in heartbeats:
        rs = runs[f"torchft_{h}ms"]
        out[f"torchft_{h}ms"] = {"heartbeat_timeout_ms": h, "killed": f"group:rank:step {TORCHFT_DIE}",
                                 **_spreads(rs, ("recovery_s", "heal_s", "bytes_full_copy", "load")), "runs": rs}
    if not heartbeats:  # tenplex alone (a narrowed run while developing): no goal to compare with
        return out
    best = min(statistics.median(r["recovery_s"] for r in runs[f"torchft_{h}ms"]) for h in heartbeats)

    def below(c: str) -> bool:
        return statistics.median(r["recovery_s"] for r in runs[f"tenplex_{c}"]) < best

    # the goal's rows (issue #31): a worker killed, the survivors go on, on the same 4-worker job as torchft's;
    # a grow case (its replacement starting at the kill on the same 2 cores, as torchft's restarted group does)
    # is the like-for-like comparison, shown beside the goal; a spare's row is another set-up (below)
    out["goal"] = {f"tenplex_{c}_below_torchft_best": below(c) for c in cases
                   if c not in native.SPARES and c not in native.GROWS}
    out["like_for_like"] = {f"tenplex_{c}_below_torchft_best": below(c) for c in cases if c in native.GROWS}
    out["torchft_best_s"] = best
    grows = [c for c in cases if c in native.GROWS]
    if grows:
        out["grow_back"] = grow_beside_heal(out, grows, heartbeats)
        out["goal"].update(out["grow_back"]["goal"])
    for c in (c for c in cases if c in native.SPARES):
        t = out[f"tenplex_{c}"]
        entry = out.setdefault("spare", {"setup": SPARE_SETUP})[f"tenplex_{c}"] = {
            **{k: t[k] for k in (*SPARE_KEYS, "losses_equal")},
            "before_torchft_best_heal": t["spare_back_full_s"]["median"] < min(
                out[f"torchft_{h}ms"]["heal_s"]["median"] for h in heartbeats),
            # shown, not a goal: 5 workers share the cores from the start, torchft's job runs 4
            "next_step_below_torchft_best": below(c)}
        # back at full size (the spare promoted at the failure) before torchft's heal, as a replacement's goal
        out["goal"][f"tenplex_{c}_full_size_before_torchft_heal"] = entry["before_torchft_best_heal"]
    return out


def grow_beside_heal(out: dict, grows: Sequence[str], heartbeats: Sequence[int]) -> dict:
    """tenplex's grow back (kill -> first step back at full size; the bytes to the replacement) beside
    torchft's heal (kill -> the restarted group committing; its full copy), from ``out``'s spreads;
    the goal: faster than torchft's fastest heal, fewer bytes than its full copy."""
    heal = {f"torchft_{h}ms": out[f"torchft_{h}ms"]["heal_s"] for h in heartbeats}
    full_copy = min(out[f"torchft_{h}ms"]["bytes_full_copy"]["median"] for h in heartbeats)
    best_heal = min(v["median"] for v in heal.values())
    g = {"torchft_heal_s": heal, "torchft_bytes_full_copy": {f"torchft_{h}ms": out[f"torchft_{h}ms"]["bytes_full_copy"]
                                                             for h in heartbeats},
         "torchft_best_heal_s": best_heal, "goal": {}}
    for c in grows:
        t = out[f"tenplex_{c}"]
        g[f"tenplex_{c}"] = {k: t[k] for k in (*GROW_KEYS, "losses_equal")}
        g["goal"][f"tenplex_{c}_full_size_before_torchft_heal"] = t["kill_to_full_size_s"]["median"] < best_heal
        g["goal"][f"tenplex_{c}_fewer_bytes_than_full_copy"] = t["bytes_to_joiner"]["median"] < full_copy
        g["goal"][f"tenplex_{c}_losses_equal"] = t["losses_equal"]
    return g


# -- the rank-0 host killed with its etcd member (issue #31 item 3) -------------------------------------

ETCD_HOST_OF_RANK = (0, 1, 2, 2)  # 4 workers on 3 simulated hosts, one etcd member each: rank 0 beside e0
ETCD_KEYS = ("recovery_s", "load", "bytes_live", "bytes_storage", "bytes_full_replica", "max_rel_loss_diff",
             "etcd_kill_s")


def etcd_rank0_run(store_port: int, reference: dict[int, float]) -> dict:
    """One ``hsdp0`` run of the native job with its membership on a fresh 3-member etcd cluster (each worker
    its own host's member first): the moment worker 0 (rank 0, the env:// store's host) records its death,
    its host's etcd member, made the leader before the run, is SIGKILLed too. The run's figures
    (:func:`tenplex_native_run`), whether the member killed was still the leader, how long the leader check
    and the kill took after the death was recorded, and the losses against ``reference`` (the same job
    uninterrupted, equal within ``GROW_LOSS_RTOL``). Refused for a run whose steps are not the reference's."""
    from tenplex.train.etcd import EtcdCluster  # lazy: only this row needs an etcd

    killed: dict[str, Any] = {}
    with EtcdCluster(3) as cluster:
        cluster.move_leader(0)

        def host0_fails() -> None:
            t0 = time.perf_counter()
            killed["leader"] = cluster.leader() == 0
            cluster.kill(0)
            killed["s"] = time.perf_counter() - t0

        r = tenplex_native_run("hsdp0", store_port, membership=[cluster.spec_for(h) for h in ETCD_HOST_OF_RANK],
                               on_kill=host0_fails)
    where = f"tenplex native hsdp0 on etcd (load {r['load']:.1f})"
    if "s" not in killed:
        raise Refused(f"{where}: etcd member e0 was never killed (no death recorded)")
    return {**r, "etcd_leader_killed": killed["leader"], "etcd_kill_s": killed["s"],
            **_losses_against(r, reference, where)}


def etcd_rank0_row(repeats: int, baseline: bool = False) -> dict:
    """The ``hsdp0`` row with the membership on etcd (:func:`etcd_rank0_run`), ``repeats`` times: per
    figure {"median","min","max","runs"}, the latency table and the parts likewise, and the runs. With
    ``baseline`` the same job with its membership in a TCPStore of this process is run after each repeat
    (``tcpstore``: its kill -> next step, load and bytes), for a comparison at the same load."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)  # the reference's
    print(f"native / hsdp0: the uninterrupted run (load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
    reference = native.reference_losses(store.port, "hsdp0", model=NATIVE_MODEL)
    rs, tcp = [], []
    for i in range(repeats):
        print(f"native / tenplex hsdp0 on etcd {i + 1}/{repeats} (load {os.getloadavg()[0]:.2f}) ...",
              file=sys.stderr, flush=True)
        rs.append(etcd_rank0_run(store.port, reference))
        print(f"  kill -> next step {rs[-1]['recovery_s']:.2f}s (the etcd leader killed: "
              f"{rs[-1]['etcd_leader_killed']}), losses equal {rs[-1]['losses_equal']}", file=sys.stderr, flush=True)
        if baseline:
            print(f"native / tenplex hsdp0 on a TCPStore {i + 1}/{repeats} (load {os.getloadavg()[0]:.2f}) ...",
                  file=sys.stderr, flush=True)
            tcp.append(tenplex_native_run("hsdp0", store.port))
            print(f"  kill -> next step {tcp[-1]['recovery_s']:.2f}s", file=sys.stderr, flush=True)

    def nested(field: str) -> dict:
        return {k: _spread([r[field][k] for r in rs]) for k in rs[0][field]
                if all(isinstance(r[field][k], (int, float)) for r in rs)}

    return {"killed": f"host 0: worker 0 ({native.CASES['hsdp0'][1]}: rank 0, the env:// store) and etcd member e0",
            "membership": "etcd, 3 members (one per simulated host, loopback ports), workers on hosts "
                          f"{list(ETCD_HOST_OF_RANK)}, each its own host's member first",
            **_spreads(rs, ETCD_KEYS), "latency": nested("latency"), "parts": nested("parts"),
            "etcd_leader_killed": [r["etcd_leader_killed"] for r in rs],
            "losses_equal": all(r["losses_equal"] for r in rs), "runs": rs,
            **({"tcpstore": {**_spreads(tcp, ("recovery_s", "load", "bytes_live", "bytes_storage")), "runs": tcp}}
               if tcp else {})}


def add_etcd_row(native_job: dict, repeats: int, baseline: bool = False) -> None:
    """``native_job["tenplex_hsdp0_etcd"]`` and its goal beside torchft's best (when ``native_job`` has it),
    or ``native_job["etcd_skipped"]`` with the reason where etcd is not installed."""
    from tenplex.train.etcd import etcd_binary  # lazy: only this row needs an etcd

    if etcd_binary() is None:
        native_job["etcd_skipped"] = "etcd is not installed (Debian etcd-server; make setup installs it as root)"
        return
    row = native_job["tenplex_hsdp0_etcd"] = etcd_rank0_row(repeats, baseline)
    if "torchft_best_s" in native_job:
        native_job.setdefault("goal", {})["tenplex_hsdp0_etcd_below_torchft_best"] = \
            row["recovery_s"]["median"] < native_job["torchft_best_s"]
    native_job.setdefault("goal", {})["tenplex_hsdp0_etcd_losses_equal"] = row["losses_equal"]


def _native_summary(n: dict) -> str:
    """The side-by-side lines: median [min, max] per system."""
    def fmt(d: dict) -> str:
        return f"{d['median']:.2f} s [{d['min']:.2f}, {d['max']:.2f}]"

    lines = [f"native job ({n['model']}, {n['layout']}): kill -> next step"]
    for k, v in n.items():
        if k.startswith("tenplex_"):
            lines.append(f"  {k}: {fmt(v['recovery_s'])}; bytes live {v['bytes_live']['median']:,.0f} vs full replica "
                         f"{v['bytes_full_replica']['median']:,.0f}; load {v['load']['median']:.1f}")
        elif k.startswith("torchft_") and isinstance(v, dict):
            lines.append(f"  {k}: {fmt(v['recovery_s'])}; heal {fmt(v['heal_s'])} copying "
                         f"{v['bytes_full_copy']['median']:,.0f} B; load {v['load']['median']:.1f}")
    for k, v in n.get("grow_back", {}).items():
        if k.startswith("tenplex_"):
            lines.append(f"  {k} back at full size: {fmt(v['kill_to_full_size_s'])} (join {fmt(v['join_s'])}); "
                         f"{v['bytes_to_joiner']['median']:,.0f} B to the joiner, "
                         f"{v['join_bytes_storage']['median']:,.0f} B from storage; losses equal {v['losses_equal']} "
                         f"(max rel {v['max_rel_loss_diff']['max']:.1e})"
                         f" vs torchft's best heal {n['grow_back']['torchft_best_heal_s']:.2f} s")
    for k, v in n.get("spare", {}).items():
        if k.startswith("tenplex_"):
            lines.append(f"  {k} (a spare running at the kill, 5 workers; torchft has no spare): 4 trainers again "
                         f"after {fmt(v['spare_back_full_s'])}, {v['bytes_to_spare']['median']:,.0f} B to the spare, "
                         f"{v['spare_bytes_storage']['median']:,.0f} B from storage; losses equal {v['losses_equal']}; "
                         f"before torchft's best heal {v['before_torchft_best_heal']}")
    lines.append(f"  goal (below torchft's best {n.get('torchft_best_s', float('nan')):.2f} s): {n.get('goal')}")
    if n.get("like_for_like"):
        lines.append(f"  like for like (a replacement starting at the kill on the same cores): {n['like_for_like']}")
    return "\n".join(lines)


def main() -> int:
    try:
        return _main()
    except Refused as e:
        print(f"bench_recovery: refused: {e}", file=sys.stderr)
        return REFUSED


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the host stores")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--json", action="store_true", help="in-process vs restart path, side by side (issue #18)")
    ap.add_argument("--repeats", type=int, default=3, help="--json, --join: runs of each path per model")
    ap.add_argument("--native-only", action="store_true",
                    help="--json: only the torch-native job beside torchft (not the reference trainer)")
    ap.add_argument("--etcd-only", action="store_true",
                    help="--json: only the native job's rank-0 row with its membership on etcd, each repeat "
                         "followed by the same job's with it in a TCPStore (not torchft)")
    ap.add_argument("--cases", default=",".join((*NATIVE_CASES, "hsdp0_etcd")),
                    help="--json: the native job's tenplex rows to run (hsdp0_etcd: the etcd row); a narrowed run "
                         "(any of --cases, --heartbeats, --join-delay changed) writes no file under --out")
    ap.add_argument("--heartbeats", default=",".join(map(str, HEARTBEATS)),
                    help="--json: torchft's heartbeat timeouts (ms) to run the native job with (empty: no torchft)")
    ap.add_argument("--join-delay", type=float, default=0.0,
                    help="--json: start hsdp3_grow's replacement this many seconds after the kill (diagnosis)")
    ap.add_argument("--join", action="store_true", help="scale up in-process: 2 workers admit 2 joiners (issue #18)")
    ap.add_argument("--no-titan", action="store_true",
                    help="--json: leave out the torchtitan job (scripts/titan_elastic.py's figures)")
    args = ap.parse_args()
    if args.join:
        result = join_bench(args.repeats)
        text = json.dumps(result, indent=1)
        print(text)
        (Path(args.out) / "bench_join.json").write_text(text + "\n")
        return 0
    if args.json:
        cases = [("tiny", dict(steps=16, fail_after=9, snapshot_every=1, ckpt_every=5,
                               extra=["--global-batch", "8", "--micro-batch", "2"]))]
        if not args.quick:
            cases.append(("llama-100m", dict(steps=11, fail_after=7, snapshot_every=1, ckpt_every=4,
                                             extra=["--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3"])))
        load_before = os.getloadavg()
        models = {} if args.native_only or args.etcd_only else side_by_side(cases, args.repeats, args.shm)
        chosen = args.cases.split(",")
        unknown = set(chosen) - {*NATIVE_CASES, "hsdp0_etcd"}
        if unknown:
            ap.error(f"--cases: unknown {sorted(unknown)}; choose from {[*NATIVE_CASES, 'hsdp0_etcd']}")
        heartbeats = tuple(int(h) for h in args.heartbeats.split(",") if h)
        narrowed = (set(chosen) != {*NATIVE_CASES, "hsdp0_etcd"} or heartbeats != HEARTBEATS
                    or args.join_delay != 0.0)
        native_cases = [c for c in NATIVE_CASES if c in chosen]
        native_job = native_side_by_side(args.repeats, native_cases, heartbeats, args.join_delay) \
            if not args.etcd_only and native_cases else {
                "model": f"native_llama {NATIVE_MODEL}", "job": " ".join(native.COMMON),
                "layout": "HSDP dp_replicate=2 x dp_shard=2, 4 gloo workers"}
        if args.etcd_only or "hsdp0_etcd" in chosen:
            add_etcd_row(native_job, args.repeats, baseline=args.etcd_only)
        titan = None if args.native_only or args.etcd_only or args.no_titan or args.quick else \
            titan_elastic.measure(args.repeats)
        result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "cpus": os.cpu_count(),
                  "command": " ".join(["python scripts/bench_recovery.py", *sys.argv[1:]]),
                  "repeats": args.repeats, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                  "models": models, "native": native_job, "torchtitan": titan}
        print(_native_summary(native_job), file=sys.stderr)
        if titan is not None:
            (Path(args.out) / "titan_elastic.json").write_text(json.dumps(titan, indent=1) + "\n")
            print(f"torchtitan, FSDP2 2 x TP 2 -> FSDP2 3: {titan['recovery_s']['median']:.2f} s in process vs "
                  f"{titan['restart_s']['median']:.2f} s torchtitan's restart ({titan['speedup']:.1f}x), "
                  f"{titan['bytes_storage']['median']:,.0f} B from storage, losses equal {titan['losses_equal']}",
                  file=sys.stderr)
        text = json.dumps(result, indent=1)
        if not args.quick and not narrowed:
            name = "bench_native_etcd.json" if args.etcd_only else \
                "bench_native_vs_torchft.json" if args.native_only else "bench_inprocess.json"
            (Path(args.out) / name).write_text(text + "\n")
        print(json.dumps(result))  # the last line: one JSON object
        return 0
    cases = [("tiny", dict(steps=16, fail_after=9, snapshot_every=1, ckpt_every=5,
                           extra=["--global-batch", "8", "--micro-batch", "2"]))]
    if not args.quick:
        cases.append(("llama-100m", dict(steps=11, fail_after=7, snapshot_every=1, ckpt_every=4,
                                         extra=["--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3"])))
    rows = []
    for model, kw in cases:
        for mode in ("stores", "persistent"):
            print(f"{model} / {mode} ...", file=sys.stderr, flush=True)
            r = run(model, mode, shm=args.shm, **kw)
            r.pop("samples")
            r.pop("losses")
            print(f"  recovery {r['recovery_s']:.1f}s, steps lost {r['steps_lost']}, tiers {r['bytes_by_tier']}",
                  file=sys.stderr, flush=True)
            rows.append(r)
    lines = ["| model | recovery from | failure after step | resumed at | steps lost | recovery s (failure -> first step) "
             "| restart + rendezvous s | start-up s | load s | step s | catch-up s | bytes local / peer / storage |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        t = r["bytes_by_tier"]
        lines.append(f"| {r['model']} | {'host stores' if r['mode'] == 'stores' else 'persistent checkpoint'} "
                     f"| {r['fail_step']} | {r['resumed_step']} | {r['steps_lost']} | {r['recovery_s']:.1f} "
                     f"| {r['restart_s']:.1f} | {r['startup_s']:.1f} | {r['load_s']:.2f} | {r['step_s']:.2f} "
                     f"| {r['time_to_catch_up_s']:.1f} | {human_bytes(t.get('local', 0))} / {human_bytes(t.get('peer', 0))}"
                     f" / {human_bytes(t.get('storage', 0))} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    if not args.quick:
        (out / "bench_recovery.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                                                             "machine": platform.platform(), "cpus": os.cpu_count(),
                                                             "rows": rows}, indent=1))
        (out / "bench_recovery.md").write_text(
            "# Recovery after a host failure\n\n"
            f"`python scripts/bench_recovery.py` on {platform.platform()}, {os.cpu_count()} CPUs, "
            f"{time.strftime('%Y-%m-%d')}.\n\n" + __doc__.split("\n", 1)[1] + "\n" + table + "\n\n"
            "catch-up = recovery + (steps lost - 1) x step time: when training is back where it was.\n"
            "Persistent storage here is a local directory (page-cached), so the load itself is fast in both\n"
            "modes; the difference is what peers lose: the steps since the last persistent checkpoint.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
