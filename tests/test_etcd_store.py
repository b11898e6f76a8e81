"""The membership store with no single point of failure (issue 31 item 3): a 3-member etcd cluster
(``tenplex.train.etcd.EtcdCluster``, Debian's etcd-server) behind the c10d ``Store`` adapter
``tenplex.elastic.etcd_store.EtcdStore``.

The adapter's contract is checked against the real cluster, operation by operation with c10d's
rules (``compare_set``'s three cases, ``wait`` / ``get`` timeouts, ``add`` without lost updates from
concurrent clients), then again after the leader, the member the client talks to, is SIGKILLed.
Then ``Membership`` over it: 4 gloo workers on 3 simulated hosts rendezvous through etcd; rank 0
and the etcd leader on its host are SIGKILLed together mid all_reduce; the 3 survivors agree on a
new membership through the 2 remaining members, form a new gloo group and all_reduce in it.
Skipped (with the reason) only where etcd is not installed: ``make setup`` installs it as root.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import datetime
import os
import queue
import signal
import time
from typing import Any

import pytest
import torch
from spawned import gloo_env, here, in_env, log_tails, reap, worker_context

from tenplex.errors import ConfigError, EtcdStoreError, PeerFailure, StoreInterrupted
from tenplex.train.etcd import EtcdCluster, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None,
                                reason="etcd is not installed (Debian etcd-server; `make setup` installs it as root)")

TIMEOUT = datetime.timedelta(seconds=15)


@pytest.fixture
def cluster() -> Any:
    with EtcdCluster(3) as c:
        yield c


def _store(cluster: EtcdCluster, first: int = 0, namespace: str = "t/") -> Any:
    from tenplex.elastic.etcd_store import EtcdStore

    return EtcdStore.from_spec(cluster.spec_for(first), namespace=namespace, timeout=TIMEOUT, request_timeout=1.0)


def _contract(s: Any) -> None:
    """Every c10d operation Membership and gloo's rendezvous use, with c10d's results."""
    s.set("a", "x")
    s.set("b", b"\x00\xffbin")
    assert s.get("a") == b"x" and s.get("b") == b"\x00\xffbin"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5 and s.add("n", 0) == 5 and s.get("n") == b"5"
    s.append("l", "1,")
    s.append("l", b"2,")
    assert s.get("l") == b"1,2,"
    # compare_set: a missing key is set when expected is empty, else expected comes back; a key
    # holding expected is set; otherwise its current value comes back, unchanged
    assert s.compare_set("c", "", "v1") == b"v1"
    assert s.compare_set("c", "", "v2") == b"v1" and s.get("c") == b"v1"
    assert s.compare_set("c", "v1", "v3") == b"v3" and s.get("c") == b"v3"
    assert s.compare_set("c", "nope", "v4") == b"v3"
    assert s.compare_set("missing", "q", "w") == b"q" and not s.check(["missing"])
    assert s.check(["a", "b"]) and not s.check(["a", "zz"])
    s.multi_set(["m1", "m2"], ["1", "2"])
    assert s.multi_get(["m1", "m2", "a"]) == [b"1", b"2", b"x"]
    s.wait(["a", "m1"], datetime.timedelta(seconds=1))
    t0 = time.monotonic()
    with pytest.raises(EtcdStoreError, match="did not appear"):
        s.wait(["never"], datetime.timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - t0 < 3
    if hasattr(s, "peek"):  # values or None in one read, no wait (Membership's polls)
        t0 = time.monotonic()
        assert s.peek(["a", "never", "l"]) == [b"x", None, b"1,2,"] and s.peek([]) == []
        assert time.monotonic() - t0 < 1
    assert s.delete_key("a") and not s.delete_key("a") and not s.check(["a"])
    assert s.num_keys() == 6  # b n l c m1 m2: a fresh namespace, only its own keys


@pytest.mark.timeout(90)
def test_store_contract_and_one_member_killed(cluster: EtcdCluster) -> None:
    from tenplex.elastic.etcd_store import EtcdStore, parse_etcd_spec

    with pytest.raises(ConfigError):
        parse_etcd_spec("127.0.0.1:2379")
    with pytest.raises(ConfigError):
        parse_etcd_spec("etcd://nohostport")
    s = _store(cluster)
    other = _store(cluster, first=1, namespace="u/")  # another namespace: its keys are not ours
    other.set("x", "1")
    _contract(s)
    assert other.num_keys() == 1
    # a key set while a get waits for it: the get returns it (gloo's rendezvous does exactly this)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(s.clone().get, "late")
        time.sleep(0.2)
        s.set("late", "here")
        assert fut.result(timeout=10) == b"here"
    # concurrent adds from 4 clients (clones, as the heartbeat thread's): no update lost
    clones = [s.clone() for _ in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: [c.add("ctr", 1) for _ in range(25)], clones))
    assert s.get("ctr") == b"100"

    # the member the client talks to, and the leader, dies: every operation goes on on the other two
    cluster.move_leader(0)
    cluster.kill(0)
    t0 = time.monotonic()
    assert s.add("ctr", 1) == 101
    first_s = time.monotonic() - t0
    assert s.failovers >= 1 and s.endpoints[0] == cluster.members[0].client_url
    after = _store(cluster, namespace="t2/")  # a new client, its first endpoint the dead member
    _contract(after)
    assert after.failovers >= 1
    assert other.get("x") == b"1"  # what was written before the death survived it
    assert cluster.leader() in (1, 2)
    # a majority down: the store says so within its timeout, it does not hang
    cluster.kill(1)
    short = EtcdStore(cluster.endpoints, namespace="t/", timeout=datetime.timedelta(seconds=1.5),
                      request_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(EtcdStoreError, match="no etcd endpoint"):
        short.set("z", "1")
    assert time.monotonic() - t0 < 6
    print(f"\nfirst operation after the leader's death: {first_s:.3f} s ({s.failovers} fail-overs)")


class _AnswerLosingProxy:
    """An endpoint that passes every request on to ``upstream`` and answers reads, but hangs up on a
    committed write without its answer: what a client sees when its member dies right after committing."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading
        import urllib.request

        self.forwarded = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = urllib.request.Request(upstream + self.path, body, {"Content-Type": "application/json"})
                answer = urllib.request.urlopen(req, timeout=5).read()  # noqa: S310 - the test's own etcd
                if b"request_put" not in body:  # reads are answered
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                proxy.forwarded += 1
                self.close_connection = True  # a committed write: no answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(60)
def test_an_add_whose_answer_was_lost_applies_once(cluster: EtcdCluster) -> None:
    """The client's first endpoint commits ``add`` / ``append`` and loses the answer; the client
    retries on the next member and must not apply them a second time (before the op record the
    counter read 2 and the list "7,7,")."""
    from tenplex.elastic.etcd_store import EtcdStore

    proxy = _AnswerLosingProxy(cluster.endpoints[0])
    try:
        for op in ("add", "append"):  # a fresh client each time: its first endpoint the proxy
            s = EtcdStore([proxy.url, *cluster.endpoints[1:]], namespace="once/", timeout=TIMEOUT,
                          request_timeout=2.0)
            assert (s.add("n", 1) == 1) if op == "add" else (s.append("l", "7,") is None)
            assert s.failovers >= 1 and proxy.forwarded >= 1
        reader = _store(cluster, first=2, namespace="once/")
        assert reader.get("n") == b"1" and reader.get("l") == b"7,"
        assert s.add("n", 2) == 3  # and later operations go on as usual
        s.close()
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_a_member_without_a_leader_says_so_at_once(cluster: EtcdCluster) -> None:
    """With a majority gone the last member has no leader: every request to it fails with etcd's own
    "no leader" answer (the client asks for a leader on every request), not by running into the
    client's time-out on a request the member would hold for seconds. Then the store's error names
    the cause."""
    from tenplex.elastic.etcd_store import EtcdStore

    cluster.kill(0)
    cluster.kill(2)
    s = EtcdStore([cluster.endpoints[1]], namespace="nl/", timeout=datetime.timedelta(seconds=3), request_timeout=2.0)
    deadline = time.monotonic() + 20
    while True:  # the member notices after its election time-out; until then a write hangs and times out
        with pytest.raises(EtcdStoreError) as err:
            s.set("k", "v")
        if "no leader" in str(err.value) or time.monotonic() > deadline:
            break
    assert "no leader" in str(err.value) and "timed out" not in str(err.value), err.value


@pytest.mark.timeout(90)
def test_a_call_held_up_by_an_election_gives_up_when_its_caller_learns_of_a_failure(cluster: EtcdCluster) -> None:
    """No leader (a majority killed): a write waits out the store's timeout, unless its ``interrupt`` turns
    True meanwhile (StoreInterrupted soon after). ``Membership.join_due`` votes that way: a member that
    learns of a failure during its boundary vote gives the vote up (no admission) and recovers, not after
    the election."""
    import threading

    from tenplex.elastic.etcd_store import EtcdStore
    from tenplex.elastic.membership_runtime import Membership

    m = Membership(_store(cluster, 1, "iv/"), "iv", rank=0, world_size=1, backend="gloo", interval=0.05,
                   dead_after=5.0)
    try:
        cluster.kill(0)
        cluster.kill(2)
        s = EtcdStore([cluster.endpoints[1]], namespace="iv2/", timeout=datetime.timedelta(seconds=3),
                      request_timeout=2.0)
        t0 = time.monotonic()
        with pytest.raises(EtcdStoreError) as plain:
            s.set("k", "v")
        assert not isinstance(plain.value, StoreInterrupted) and time.monotonic() - t0 >= 2.5
        s.interrupt = lambda: time.monotonic() > t1 + 0.3
        t1 = time.monotonic()
        with pytest.raises(StoreInterrupted):
            s.set("k", "v")
        assert time.monotonic() - t1 < 1.5
        threading.Timer(0.3, lambda: m._fail("a peer died", publish=False)).start()
        t2 = time.monotonic()
        assert m.join_due(1) is False  # the vote given up: no admission at this boundary
        assert m.failed and time.monotonic() - t2 < 1.5 and m.store.interrupt is None
    finally:
        m._stop.set()  # no goodbyes through a store without a leader


CUT_OFF_CLIENT = """
import datetime, json, sys, time
from tenplex.elastic.etcd_store import EtcdStore
s = EtcdStore(sys.argv[1].split(","), namespace="cut/", timeout=datetime.timedelta(seconds=20), request_timeout=0.5)
t0 = time.monotonic()
first = s.add("n", 1)
took = time.monotonic() - t0
s.append("l", "1,")
print(json.dumps({"first": first, "took": took, "n": int(s.get("n")), "l": s.get("l").decode(),
                  "cs": s.compare_set("c", "", "x").decode(), "failovers": s.failovers}))
"""


@pytest.mark.timeout(120)
def test_the_leaders_host_cut_off_the_network_a_client_on_another_host_carries_on() -> None:
    """Three hosts in network namespaces on a bridge (``netns.py``), one etcd member each; the leader's
    host loses its link (its etcd keeps running, cut off: the silent failure, no connection reset).
    A client on host 1 whose first endpoint is that member times out on it after ``request_timeout``,
    moves on, and its operations commit on the two others (the cut-off leader cannot commit alone)."""
    import subprocess
    import sys
    from pathlib import Path

    from tenplex.errors import NetnsUnavailableError
    from tenplex.train.netns import HostNetwork, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        network = HostNetwork.create(3)
    except NetnsUnavailableError as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    with network, EtcdCluster(3, nets=network.hosts) as c:
        c.move_leader(0)
        network.set_link(network.hosts[0], up=False)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        res = subprocess.run(network.hosts[1].command([sys.executable, "-c", CUT_OFF_CLIENT, ",".join(c.endpoints)]),
                             capture_output=True, text=True, timeout=90, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.splitlines()[-1])
        assert out["first"] == 1 and out["n"] == 1 and out["l"] == "1," and out["cs"] == "x", out
        assert out["failovers"] >= 1 and out["took"] < 10, out
        lead = c.members[1].status()["leader"]
        assert lead in {c.members[i].status()["header"]["member_id"] for i in (1, 2)}
    print(f"\nfirst operation with the leader's host cut off: {out['took']:.3f} s ({out['failovers']} fail-overs)")


# ---------------------------------------------------------------------------------------------
# Membership over etcd: rank 0 and the etcd leader on its host die together
# ---------------------------------------------------------------------------------------------
HOST_OF_RANK = (0, 1, 2, 2)  # 4 ranks on 3 hosts, one etcd member each; rank 0 shares host 0 with e0


def _worker(rank: int, spec: str, out: Any) -> None:
    """All_reduce loop under ``Membership`` over etcd until a peer dies; recover; all_reduce in the new group."""
    import traceback

    import torch.distributed as dist

    from tenplex.elastic.membership_runtime import MEMBERSHIP_STORE_ENV, Membership, membership_store

    torch.set_num_threads(1)
    res: dict[str, Any] = {"error": None}
    try:
        os.environ[MEMBERSHIP_STORE_ENV] = spec  # this host's etcd member first
        store = membership_store(timeout_s=20.0)
        dist.init_process_group("gloo", store=dist.PrefixStore("job/round0/pg", store), rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=20))
        m = Membership(store, "job", agree_timeout=15.0, pg_timeout=datetime.timedelta(seconds=10), dead_after=3.0)
        out.put(("ready", rank, os.getpid()))
        x = torch.ones(64)
        steps = 0
        try:
            while True:
                with m.guard():
                    dist.all_reduce(x)
                x.fill_(1.0)
                m.check()
                steps += 1
        except PeerFailure as e:
            res["caught_at"] = time.time()
            res["how"] = str(e)[:200]
        res["steps"] = steps
        nm = m.recover()
        res["nm"] = nm
        y = torch.full((1,), float(rank))
        with m.guard():
            dist.all_reduce(y)
        res["sum"] = float(y.item())
        res["recovered_at"] = time.time()
        m.close()
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
    out.put(("done", rank, res))


def _reports(q: Any, n: int, budget: float, what: str) -> list[tuple[str, int, Any]]:
    """``n`` reports ``(kind, rank, value)`` of ``n`` different ranks from ``q`` within ``budget`` seconds."""
    got: dict[int, tuple[str, int, Any]] = {}
    deadline = time.monotonic() + budget
    while len(got) < n:
        try:
            kind, rank, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"only ranks {sorted(got)} {what} within {budget} s (load average {os.getloadavg()})")
        got[rank] = (kind, rank, val)
    return list(got.values())


@pytest.mark.timeout(150)
def test_rank0_and_its_hosts_etcd_leader_killed_together_survivors_regroup(cluster: EtcdCluster) -> None:
    cluster.move_leader(0)  # the hardest member to lose: the leader, with rank 0 on its host
    ctx = worker_context()
    q = ctx.Queue()
    pids: dict[int, int] = {}
    with gloo_env():
        procs = [ctx.Process(target=in_env, args=(*here(), _worker, r, cluster.spec_for(HOST_OF_RANK[r]), q))
                 for r in range(4)]
    try:
        for p in procs:
            p.start()
        for kind, rank, val in _reports(q, 4, 60, "started"):
            if kind == "done":
                pytest.fail(f"rank {rank} ended before the failure: {val}")
            pids[rank] = val
        time.sleep(0.5)  # the all_reduce loop runs
        cluster.move_leader(0)  # again, at once when it is still the leader (a loaded machine may have moved it)
        t_kill = time.time()
        os.kill(pids[0], signal.SIGKILL)  # host 0 fails: its worker and its etcd member at once
        cluster.kill(0)
        results = {rank: val for _, rank, val in _reports(q, 3, 40, "recovered after the kill")}
    finally:
        reap(procs, timeout=5)
    errors = [f"rank {r}: {v['error']}" for r, v in results.items() if v.get("error")]
    assert not errors, "\n".join(errors)
    nms = {r: v["nm"] for r, v in results.items()}
    assert set(results) == {1, 2, 3}
    assert all(v["steps"] > 0 for v in results.values())
    assert {(nm.round, nm.members, nm.alive, nm.world_size) for nm in nms.values()} == {(1, (1, 2, 3), (1, 2, 3), 3)}
    assert sorted(nm.new_rank for nm in nms.values()) == [0, 1, 2]
    assert all(v["sum"] == 6.0 for v in results.values())  # old ranks 1 + 2 + 3 in the new group
    assert cluster.leader() in (1, 2)
    print("\n" + "; ".join(f"rank {r}: caught {v['caught_at'] - t_kill:.3f}s, regrouped and all_reduced "
                           f"{v['recovered_at'] - t_kill:.3f}s after the kill (agree {nms[r].agree_s:.3f}s, regroup "
                           f"{nms[r].regroup_s:.3f}s)" for r, v in sorted(results.items())))


# ---------------------------------------------------------------------------------------------
# the example job: rank 0 and its host's etcd leader die mid-step, the job goes on in process
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_native_job_recovers_in_process_when_rank0_and_its_hosts_etcd_leader_die(tmp_path: Any,
                                                                                  cluster: EtcdCluster) -> None:
    """``examples/train_native.py --in-process`` on 4 workers (FSDP2 x TP2) with its membership in etcd;
    worker 0 dies before its optimizer step of step 5 and the etcd leader on its host is SIGKILLed the
    moment it exits. The 3 survivors agree through the 2 remaining etcd members, move step 4's state live
    to dp_shard=3 (the pieces only worker 0 held from the checkpoint) and finish with the losses and
    samples of an uninterrupted run."""
    import torch.distributed as dist
    from test_native_inprocess import (BATCH, DEAD_AFTER, EVERY, STEPS, _workers, check_native_run,
                                       native_reference, only_dead_bytes)

    from tenplex.checkpoint import read_manifest
    from tenplex.layout.state_layout import StateLayout

    cluster.move_leader(0)
    rdzv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # env:// bootstrap only
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    procs = _workers(tmp_path, 4, ["--ckpt", str(ckpt), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
                                   "--global-batch", str(BATCH), "--log", str(log), "--in-process",
                                   "--dead-after", DEAD_AFTER, "--die-at", "0:5:optimizer"],
                     [cluster.spec_for(h) for h in HOST_OF_RANK])
    try:
        reference = native_reference(STEPS)
        deadline = time.monotonic() + 200
        while procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert procs[0].poll() is not None, "worker 0 never reached its --die-at point"
        cluster.move_leader(0)  # again, at once when it is still the leader (a loaded machine may have moved it)
        cluster.kill(0)  # host 0 is gone: its worker and its etcd member, the leader
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0], (codes, log_tails(tmp_path))
    recs = check_native_run(tmp_path, log, reference)
    assert len(recs) == 1, recs
    rec = recs[0]
    assert rec["live"] and rec["world_size"] == 3 and rec["mesh"] == {"dp_shard": 3}, rec
    old = read_manifest(str(ckpt), 4)
    new = read_manifest(str(ckpt), STEPS)
    expected = only_dead_bytes(old["ptc"], StateLayout.from_json(old["state_layout"]),
                               StateLayout.from_json(new["state_layout"]), 0)
    assert rec["bytes_storage"] == rec["plan_bytes_storage"] == expected > 0, (rec, expected)
    print(f"\nrecovery: {json.dumps({k: v for k, v in rec.items() if k.endswith('_s')})}")


def _rank0_agent(agents: list[Any]) -> int:
    """The index of the agent whose worker has RANK 0 (torchrun's rendezvous picks it)."""
    for i, a in enumerate(agents):
        for pid in a.worker_pids():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"RANK=0" in env:
                return i
    raise AssertionError("no worker with RANK=0 found")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_etcd_rendezvous_job_survives_the_loss_of_the_host_with_rank0_and_the_etcd_leader(
        tmp_path: Any) -> None:
    """The whole job on the 3-member etcd cluster, nothing on one host alone: two torchrun agents (2
    workers of ``train_native.py --in-process`` each) rendezvous with ``--rdzv-backend=etcd-v2``, each
    through its own host's etcd member, and keep their membership in etcd (``etcd://``, own member
    first); the third host runs only the third member. The host of rank 0 (agent, workers and its
    etcd member, made the leader) is SIGKILLed after 3 steps: the other agent keeps its workers (one
    start record) and they finish in process on dp_shard=2 with an uninterrupted run's losses."""
    pytest.importorskip("etcd", reason="torchrun's etcd-v2 rendezvous needs python-etcd (the test extras)")
    from test_native_inprocess import BATCH, DEAD_AFTER, EVERY, ROOT, SCRIPT, STEPS, check_native_run, native_reference

    from tenplex.train.launch import Agent, wait_for

    log = tmp_path / "log.jsonl"
    args = ["--steps", str(STEPS), "--ckpt-every", str(EVERY), "--global-batch", str(BATCH), "--ckpt",
            str(tmp_path / "ckpt"), "--log", str(log), "--in-process", "--dead-after", DEAD_AFTER]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}

    def records() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    with EtcdCluster(3, v2=True) as c:
        agents = [Agent(f"node{i}", c.members[i].client_url.removeprefix("http://"), args, nproc=2, min_nodes=1,
                        max_nodes=2, pid_dir=str(tmp_path / "pids"), log_path=str(tmp_path / f"node{i}.log"),
                        run_id=f"e{os.getpid()}", env={**env, "TENPLEX_MEMBERSHIP_STORE": c.spec_for(i)},
                        program=[SCRIPT], rdzv_backend="etcd-v2") for i in range(2)]
        try:
            reference = native_reference(STEPS)
            assert wait_for(lambda: sum(1 for r in records() if "loss" in r and r["world_size"] == 4) >= 3, 300), \
                (tmp_path / "node0.log").read_text()[-3000:]
            dead = _rank0_agent(agents)
            c.move_leader(dead)
            agents[dead].kill()  # host `dead` fails: its agent, its workers (rank 0 among them), its etcd leader
            c.kill(dead)
            assert wait_for(lambda: any(r.get("step") == STEPS - 1 for r in records()), 240), \
                (tmp_path / f"node{1 - dead}.log").read_text()[-4000:]
        finally:
            for a in agents:
                a.stop()
    assert sum(1 for r in records() if r.get("start")) == 1  # the surviving agent never restarted its workers
    rec = check_native_run(tmp_path, log, reference)
    assert len(rec) == 1 and rec[0]["live"] and rec[0]["world_size"] == 2 and rec[0]["mesh"] == {"dp_shard": 2}, rec
    assert rec[0]["bytes_live"] == rec[0]["plan_bytes_peer"] and rec[0]["bytes_storage"] == rec[0]["plan_bytes_storage"]
    print(f"\nrecovery: {json.dumps({k: v for k, v in rec[0].items() if k.endswith('_s')})}")
