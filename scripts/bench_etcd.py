"""How long the membership store stops taking writes when its etcd leader dies (#31 item 3).

    python scripts/bench_etcd.py                 # the cluster's own raft timings and two slower ones, 5 trials each
    python scripts/bench_etcd.py --json          # also writes docs/bench/bench_etcd.json; last line: one JSON object

Per trial: a fresh 3-member ``EtcdCluster`` (loopback ports, data on /dev/shm) with the given raft timings
(heartbeat, election time-out in ms); member e0 made the leader; a client (``EtcdStore``) whose first
endpoint is e1 writes a key; e0 is SIGKILLed and the same client writes again at once.
``write_after_kill_s``: the kill -> that write returning (what a job's failure record or agreement waits
for); ``elected_s``: the kill -> e1 first reporting a leader other than e0 (``/v3/maintenance/status``
polled every 5 ms from another thread). Each figure over the trials: {"median", "min", "max", "runs"}.
``--burn N`` runs N CPU-bound processes beside every trial (a loaded host) and reports the elections
that no death caused (``spurious_terms``: raft terms gained by an idle cluster over ``--idle-s`` s).
Per setting also ``request_ms``: how long a write and a 3-key read take on the healthy cluster (300
each; with ``--burn``, beside the burners), against the store's first request time-out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from figures import spread

from tenplex.elastic.etcd_store import _FIRST_TRY_S, EtcdStore, parse_etcd_spec
from tenplex.train.etcd import ELECTION_MS, HEARTBEAT_MS, EtcdCluster

ROOT = Path(__file__).resolve().parent.parent


def _term(cluster: EtcdCluster, i: int) -> int:
    return int(cluster.members[i].status()["header"]["raft_term"])


def trial(raft_ms: tuple[int, int]) -> dict[str, float]:
    """One leader kill under ``raft_ms``: the seconds to the next write and to the new leader."""
    with EtcdCluster(3, raft_ms=raft_ms) as c:
        c.move_leader(0)
        store = EtcdStore(parse_etcd_spec(c.spec_for(1)), namespace="bench/")
        store.set("before", "1")
        old = c.members[1].status()["leader"]
        seen: dict[str, float] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    leader = c.members[1].status(timeout=0.2).get("leader")
                    if leader and leader != old and "elected" not in seen:
                        seen["elected"] = time.perf_counter()
                        return
                except OSError:
                    pass  # no answer in 0.2 s: ask again
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        killed = time.perf_counter()
        c.kill(0)
        store.set("after", "1")
        wrote = time.perf_counter()
        watcher.join(10)
        stop.set()
        return {"write_after_kill_s": wrote - killed, "elected_s": seen.get("elected", float("nan")) - killed}


def idle_terms(raft_ms: tuple[int, int], seconds: float) -> int:
    """Raft terms an idle cluster gains in ``seconds`` (elections no death caused)."""
    with EtcdCluster(3, raft_ms=raft_ms) as c:
        store = EtcdStore(parse_etcd_spec(c.spec_for(1)), namespace="idle/")
        first, end = _term(c, 1), time.monotonic() + seconds
        while time.monotonic() < end:  # a write every 20 ms, as a job's heartbeats keep it busy
            store.append("k", "x,")
            time.sleep(0.02)
        return _term(c, 1) - first


def request_ms(raft_ms: tuple[int, int], n: int = 300) -> dict[str, float]:
    """Milliseconds one write and one 3-key ``peek`` take on a healthy cluster (a client on a follower,
    ``n`` of each 10 ms apart): p50, p90, p99 and the worst, beside the store's first request
    time-out (``_FIRST_TRY_S``: a request slower than it is retried on another member)."""
    with EtcdCluster(3, raft_ms=raft_ms) as c:
        store = EtcdStore(parse_etcd_spec(c.spec_for(1)), namespace="lat/")
        writes, reads = [], []
        for i in range(n):
            t = time.perf_counter()
            store.set("k", str(i))
            writes.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.peek(["k", "a", "b"])
            reads.append(time.perf_counter() - t)
            time.sleep(0.01)
        store.close()

    def q(xs: list[float], p: float) -> float:
        return round(1e3 * sorted(xs)[max(0, int(p * len(xs)) - 1)], 2)

    return {**{f"write_p{int(p * 100)}": q(writes, p) for p in (0.5, 0.9, 0.99)}, "write_max": q(writes, 1.0),
            **{f"peek_p{int(p * 100)}": q(reads, p) for p in (0.5, 0.9, 0.99)}, "peek_max": q(reads, 1.0),
            "first_try_ms": 1e3 * _FIRST_TRY_S, "failovers": store.failovers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--raft", default=f"{HEARTBEAT_MS}/{ELECTION_MS},25/250,50/500",
                    help="heartbeat/election ms settings, comma-separated (the first: the cluster's own)")
    ap.add_argument("--burn", type=int, default=0, help="CPU-bound processes beside every trial")
    ap.add_argument("--idle-s", type=float, default=30.0, help="with --burn: seconds of the idle-cluster check")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    settings = [tuple(int(x) for x in s.split("/")) for s in args.raft.split(",")]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burn)]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "burn": args.burn,
                              "command": " ".join(["python", *sys.argv]), "loadavg_before": os.getloadavg(),
                              "settings": {}}
    try:
        for hb, el in settings:
            runs = []
            for i in range(args.trials):
                runs.append(trial((hb, el)))
                print(f"raft {hb}/{el} ms, trial {i + 1}/{args.trials}: write {runs[-1]['write_after_kill_s']:.3f} s "
                      f"after the kill, leader elected after {runs[-1]['elected_s']:.3f} s "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            row: dict[str, Any] = {k: spread([r[k] for r in runs]) for k in runs[0]}
            row["request_ms"] = request_ms((hb, el))
            if args.burn:
                row["spurious_terms"] = idle_terms((hb, el), args.idle_s)
            result["settings"][f"{hb}/{el}"] = row
    finally:
        for b in burners:
            b.kill()
    result["loadavg_after"] = os.getloadavg()
    for name, row in result["settings"].items():
        w, e = row["write_after_kill_s"], row["elected_s"]
        print(f"raft {name} ms: write after the leader's kill {w['median']:.3f} s [{w['min']:.3f}, {w['max']:.3f}], "
              f"new leader {e['median']:.3f} s [{e['min']:.3f}, {e['max']:.3f}]"
              + (f", {row['spurious_terms']} spurious elections" if "spurious_terms" in row else ""))
        ms = row["request_ms"]
        print(f"  requests on the healthy cluster (ms): write p50 {ms['write_p50']} p99 {ms['write_p99']} max "
              f"{ms['write_max']}, peek p50 {ms['peek_p50']} p99 {ms['peek_p99']} max {ms['peek_max']}; "
              f"first try {ms['first_try_ms']:.0f} ms, {ms['failovers']} time-outs")
    if args.json:
        text = json.dumps(result)
        if not args.burn:
            (Path(args.out) / "bench_etcd.json").write_text(json.dumps(result, indent=1) + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
