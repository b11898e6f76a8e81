#!/usr/bin/env python
"""tenplex demo: a training job survives a node failure by changing its parallelism.

1. An uninterrupted single-process run of the reference trainer gives the reference losses.
2. The same job runs on 4 workers as two simulated nodes (two torchrun agents, 2 workers
   each, layout dp=1,tp=2,pp=2), checkpointing every few steps.
3. Midway, one node (its agent and its workers) is killed (or, with `--failure network`, its
   link goes down). By default the surviving workers recover in-process (`--in-process`): they
   find the failure, agree on the survivors through the rendezvous store, choose the layout for
   2 workers, move the state they hold live and read only the dead node's pieces from the host
   store on their node (each node runs a tenplex host store; workers snapshot every step and the
   stores replicate to each other); torchrun's agent is never involved. With `--restart`,
   torchrun's elastic agent on the surviving node restarts its workers with world size 2 and
   tenplex.rescale() loads each rank's share of the last checkpoint (the path before #18).
4. The report compares the losses with the uninterrupted run and breaks the recovery down;
   a loss-curve PNG with the failure marked is written to docs/.

Where the machine allows it (root, `ip netns`) each node runs in its own network namespace on
a private bridge (the rendezvous store on the bridge), so the rendezvous and gloo cross a real
network stack; otherwise, or with `--loopback`, all run on 127.0.0.1 and the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tenplex.cli import human_bytes  # noqa: E402
from tenplex.train.launch import (  # noqa: E402
    Agent, HostsConfig, RendezvousStore, free_port, read_train_log, start_hosts, wait_for,
)
from tenplex.train.netns import LOOPBACK, try_create  # noqa: E402




def plot(ref: dict[int, float], runs: list[dict], fail_wall: float, resumed_from: int, fail_step: int,
         out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib missing: no plot; `make demo` installs it)")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(list(ref), list(ref.values()), color="0.6", lw=3, label="uninterrupted (1 process)")
    before = [r for r in runs if r["world_size"] == 4]
    after = [r for r in runs if r["world_size"] == 2]
    if before:
        lb = f"4 workers, dp={before[0]['dp']},tp={before[0]['tp']},pp={before[0]['pp']}"
        ax.plot([r["step"] for r in before], [r["loss"] for r in before], "o-", ms=3, color="tab:blue", label=lb)
    if after:
        la = f"2 workers after the failure, dp={after[0]['dp']},tp={after[0]['tp']},pp={after[0]['pp']}"
        ax.plot([r["step"] for r in after], [r["loss"] for r in after], "s-", ms=3, color="tab:orange", label=la)
    ax.axvline(fail_step + 0.5, color="tab:red", ls="--", label=f"node failure after step {fail_step}")
    ax.axvspan(resumed_from + 0.5, fail_step + 0.5, color="tab:red", alpha=0.08, label="steps redone")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tenplex: training continues under a new layout after a node failure")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its agent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def report_restart(resume: dict, runs: list[dict], fail_wall: float, fail_step: int, before: dict) -> None:
    """The restart path: torchrun's agent restarted the survivors, rescale() loaded the checkpoint."""
    first_new = min((r for r in runs if r["wall"] > fail_wall), key=lambda r: r["wall"])
    t = resume["timings"]
    print(f"  layout before     {before['layout']} on {before['world_size']} workers (2 nodes)")
    print(f"  layout after      {resume['layout']} on {resume['world_size']} workers (1 node), chosen by "
          "rescale() (memory-aware, throughput-ranked)")
    print(f"  failure           after step {fail_step}; last complete checkpoint: step {resume['step']}; "
          f"steps redone: {fail_step - resume['step']}")
    print("  recovery          restart path (torchrun's agent restarts the survivors): failure -> first step "
          f"under the new layout: {first_new['wall'] - fail_wall:.1f}s")
    print(f"    detection, agent restart, rendezvous  {resume['process_start'] - fail_wall:6.2f}s")
    print(f"    worker start-up until rescale()        {resume['wall'] - resume['process_start'] - resume['startup_s']:6.2f}s")
    print(f"    rescale(): list {t.get('list', 0):.3f}s, choose {t.get('choose', 0):.3f}s, plan "
          f"{t.get('plan', 0):.3f}s, load {t.get('load', 0):.3f}s (rank 0); with process groups "
          f"{resume['startup_s']:.2f}s")
    print(f"    first step                             {first_new['wall'] - resume['wall']:6.2f}s")
    print(f"  bytes             read from the checkpoint {human_bytes(resume['bytes_read_all'])} for "
          f"{human_bytes(resume['bytes_needed_all'])} needed by all new ranks "
          f"({resume['bytes_read_all'] / max(resume['bytes_needed_all'], 1):.3f}x)")
    print(f"                    planner: a live move would send {human_bytes(resume['plan_bytes_moved'])} "
          "between GPUs (the rest stays in place)")


def report_live(rec: dict, runs: list[dict], fail_wall: float, fail_step: int, before: dict) -> None:
    """The in-process path: the survivors agreed, chose, planned and moved their state live."""
    first_new = min((r for r in runs if r["wall"] > rec["wall"]), key=lambda r: r["wall"])
    t = rec["timings"]
    print(f"  layout before     {before['layout']} on {before['world_size']} workers (2 nodes)")
    print(f"  layout after      {rec['layout']} on {rec['world_size']} workers (1 node), chosen by "
          "rescale() (memory-aware, throughput-ranked); new ranks on old ranks "
          f"{rec['alive']} (locality order)")
    print(f"  failure           after step {fail_step}; survivors held steps up to {rec['newest']} in memory and "
          f"moved step {rec['step']} (the newest every piece is available at); steps redone: "
          f"{fail_step - rec['step']}")
    total = first_new["wall"] - fail_wall
    print(f"  recovery          in-process: failure -> first step under the new layout: {total:.2f}s")
    print(f"    detection (kill -> a survivor knows)   {rec['failed_at'] - fail_wall:6.3f}s")
    print(f"    agreement on the survivors + regroup   {rec['agree_s']:6.3f}s + {rec['regroup_s']:.3f}s "
          "(the dead found by their closed links, not the heartbeat verdict)")
    print(f"    choose + plan + step agreement         {t.get('choose', 0):6.3f}s + {t.get('plan', 0):.3f}s + "
          f"{t.get('agree', 0):.3f}s")
    print(f"    live transfer (rounds) + local copies  {t.get('migrate_transfer', 0):6.3f}s + "
          f"{t.get('migrate_local', 0):.3f}s")
    print(f"    storage reads (overlapping the rounds) {t.get('migrate_storage', 0):6.3f}s")
    print(f"    groups, trainer, first step            {first_new['wall'] - rec['wall']:6.3f}s")
    print("    (each part: the slowest rank's; detection and agreement: new rank 0's)")
    print(f"  bytes             moved live between survivors {human_bytes(rec['bytes_live'])} (plan: "
          f"{human_bytes(rec['plan_bytes_peer'])} between devices, bytes_moved {human_bytes(rec['plan_bytes_moved'])}"
          f"); kept in place {human_bytes(rec['bytes_local'])}")
    where = ", ".join(rec.get("storage_urls") or []) or "nowhere"
    print(f"                    read from stores {human_bytes(rec['bytes_storage'])} (plan: "
          f"{human_bytes(rec['plan_bytes_storage'])}; pieces only the dead node held) from {where}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fail-after", type=int, default=12, help="kill a node once this step is done")
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "demo_loss.png"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--loopback", action="store_true",
                    help="run the nodes on 127.0.0.1 even where network namespaces are possible")
    ap.add_argument("--failure", choices=["kill", "network"], default="kill",
                    help="how node1 fails: SIGKILL of its processes, or its link going down (namespaces only)")
    ap.add_argument("--restart", action="store_true",
                    help="the restart path: torchrun's agent restarts the survivors, rescale() loads the checkpoint")
    args = ap.parse_args()
    # a SIGTERM unwinds like Ctrl-C, so the finally below removes processes, mount and namespaces
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    work = Path(tempfile.mkdtemp(prefix="tenplex-demo-"))
    common = ["--model", "tiny", "--steps", str(args.steps), "--global-batch", "8", "--micro-batch", "2",
              "--seed", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = None
    agents: list[Agent] = []
    hosts: list = []
    mnt = work / "data-mount"
    mounted = False
    network = None
    try:
        if args.loopback:
            reason = "--loopback"
        else:
            network, reason = try_create(2)
        if network is not None:
            where = ", ".join(f"{h.netns} at {h.address}" for h in network.hosts)
            print(f"network: each node in its own namespace ({where}), bridged in {network.switch.netns} "
                  f"({network.plan.subnet}), rendezvous store at {network.switch.address}")
        else:
            print(f"network: loopback (127.0.0.1, one port per node): {reason}")
            if args.failure == "network":
                print("--failure network needs network namespaces", file=sys.stderr)
                return 2
        nets = network.hosts if network is not None else [LOOPBACK, LOOPBACK]
        print(f"[1/3] uninterrupted reference run: 1 process, {args.steps} steps ...", flush=True)
        t0 = time.time()
        ref_log = work / "reference.jsonl"
        subprocess.run([sys.executable, "-m", "tenplex.train", *common, "--log", str(ref_log)], check=True,
                       env=env, timeout=600, capture_output=True)
        ref = {r["step"]: r for r in read_train_log(ref_log)[0]}
        print(f"      done in {time.time() - t0:.1f}s, final loss {ref[args.steps]['loss']:.4f}")

        print("[2/3] elastic run: 2 nodes x 2 workers (torchrun agents, c10d rendezvous), "
              f"checkpoint every {args.ckpt_every} steps ...", flush=True)
        log, ckpt = work / "elastic.jsonl", work / "ckpt"
        train = [*common, "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(ckpt), "--ckpt-every",
                 str(args.ckpt_every), "--log", str(log)]
        if os.path.exists("/dev/fuse") and shutil.which("fusermount3"):
            # the workers read their batches through the dataset VFS; rescale re-shards it in place
            from tenplex.data.corpus import stdlib_corpus
            from tenplex.layout.models import PRESETS
            from tenplex.data.batches import corpus_index

            index_path, _ = corpus_index(stdlib_corpus(int(PRESETS["tiny"]["seq_len"])))
            mnt.mkdir()
            mounted = True  # before the call: an interrupt while it mounts must still unmount
            subprocess.run([sys.executable, "-m", "tenplex", "mount", index_path, str(mnt), "--dp", "1",
                            "--global-batch", "8", "--seed", "7"], check=True, capture_output=True, timeout=120)
            train += ["--data-mount", str(mnt)]
            print(f"      batches come through a FUSE mount of the corpus index at {mnt}")
        else:
            print("      no FUSE here (/dev/fuse or fusermount3 missing): batches come from the index reader")
        store = RendezvousStore(net=network.switch if network is not None else LOOPBACK)
        run_id = f"demo{free_port()}"
        if args.restart:
            agents = [Agent(f"node{i}", store.endpoint, train, nproc=2, min_nodes=1, max_nodes=2,
                            pid_dir=str(work / "pids"), log_path=str(work / f"node{i}.log"), run_id=run_id, env=env,
                            net=nets[i])
                      for i in range(2)]
        else:
            # a host store per node; every worker snapshots each step, the stores replicate to each other
            print("      in-process recovery: host stores on both nodes, a snapshot every step", flush=True)
            train += ["--in-process", "--store", "auto", "--snapshot-every", "1"]
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            hosts = start_hosts(HostsConfig(2, str(work), train, nproc=2, endpoint=store.endpoint, run_id=run_id,
                                            env=env, store_dir=tempfile.mkdtemp(prefix="tenplex-demo-", dir=shm),
                                            network=network))
            agents = [h.agent for h in hosts]

        def four_worker_step() -> int:
            return max([r["step"] for r in read_train_log(log)[0] if r["world_size"] == 4] or [0])

        if not wait_for(lambda: four_worker_step() >= args.fail_after, 300):
            print("the 4-worker job did not reach the failure point; see", work, file=sys.stderr)
            return 1
        fail_step = four_worker_step()
        fail_wall = time.time()
        if args.failure == "network":
            network.set_link(network.hosts[1], up=False)
            print(f"      step {fail_step} done on 4 workers: node1's link is down (its processes run on, cut off)",
                  flush=True)
        elif hosts:
            hosts[1].kill()
            print(f"      step {fail_step} done on 4 workers: node1 killed (agent, 2 workers and its store, SIGKILL)",
                  flush=True)
        else:
            agents[1].kill()
            print(f"      step {fail_step} done on 4 workers: node1 killed (agent + 2 workers, SIGKILL)", flush=True)
        if hosts:
            # the survivors' agent, never told of the in-process recovery, would wait up to 300 s in
            # torchrun's exit barrier for the dead node's agent once its workers are done: the job is
            # done when node0's workers have exited (0 each)
            def workers_done() -> bool:
                return agents[0].proc.poll() is not None or not any(_alive(p) for p in agents[0].worker_pids())

            wait_for(lambda: max([r["step"] for r in read_train_log(log)[0]] or [0]) >= args.steps, 600)
            wait_for(workers_done, 120)
            rc = 0 if max(r["step"] for r in read_train_log(log)[0]) >= args.steps else 1
        else:
            rc = agents[0].wait(timeout=600)
        if rc != 0:
            print(f"the surviving node failed (exit {rc}); see {work / 'node0.log'}", file=sys.stderr)
            return 1
        total_s = time.time() - t0

        if args.failure == "network":
            agents[1].kill()  # cut off and of no use now; it would only time out later
        print("[3/3] report\n")
        runs, starts = read_train_log(log)
        final = {r["step"]: r for r in runs}  # steps redone after the restart replace the lost ones
        before = next(s for s in starts if s["world_size"] == 4)
        rel = max(abs(final[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref)
        samples = [x for s in sorted(final) for x in final[s]["samples"]]
        ref_samples = [x for s in sorted(ref) for x in ref[s]["samples"]]
        recovers = [s for s in starts if s.get("event") == "recover" and s["wall"] > fail_wall]
        if args.restart:
            resume = [s for s in starts if s["wall"] > fail_wall and s.get("event") == "start"][-1]
            report_restart(resume, runs, fail_wall, fail_step, before)
            resumed, world_after = resume["step"], resume["world_size"]
        else:
            if not recovers:
                print("the survivors did not recover in-process; see", work, file=sys.stderr)
                return 1
            report_live(recovers[0], runs, fail_wall, fail_step, before)
            resumed, world_after = recovers[0]["step"], recovers[0]["world_size"]
        print(f"  losses            final {final[args.steps]['loss']:.5f} vs uninterrupted "
              f"{ref[args.steps]['loss']:.5f}; max relative difference over all {args.steps} steps {rel:.1e}")
        if mounted:
            job = json.loads((mnt / "job.json").read_text())
            print(f"  dataset VFS       re-sharded in place: generation {job['generation']}, dp={job['dp']}, "
                  f"progress {job['progress']} samples")
        print(f"  data order        {len(samples)} samples, {'identical to' if samples == ref_samples else 'DIFFERENT FROM'}"
              f" the uninterrupted run, {len(samples) - len(set(samples))} repeated")
        if network is not None:
            to1, from1 = network.traffic(network.hosts[1])
            print(f"  network           namespaces on a bridge: node1's port carried {human_bytes(to1)} in, "
                  f"{human_bytes(from1)} out")
        else:
            print(f"  network           loopback ({reason})")
        print(f"  wall time         {total_s:.0f}s for the elastic run")
        ok = rel <= 1e-4 and samples == ref_samples and world_after == 2
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if plot({s: r["loss"] for s, r in ref.items()}, runs, fail_wall, resumed, fail_step, out):
            print(f"  plot              {out}")
        print(f"\nresult: {'OK' if ok else 'MISMATCH'}: training continued after the node failure "
              f"{'with the same losses and data as' if ok else 'but differs from'} the uninterrupted run")
        return 0 if ok else 1
    finally:
        for a in agents:
            a.stop()
        for h in hosts:
            h.stop()
            shutil.rmtree(os.path.dirname(os.path.dirname(h.store.root)), ignore_errors=True)
        if mounted:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=30)
        if store is not None:
            store.stop()
        if network is not None:
            network.close()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
