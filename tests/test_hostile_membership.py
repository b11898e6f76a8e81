"""Hostile processes against a running job's membership: none can join, trigger a recovery, or make a
member look dead (issue 31, item 5).

Three members (``Membership`` in spawned processes, the job secret in their environment) share a
real c10d store on 127.0.0.1 and link to each other. This test process plays the outsider: it reaches
the store and the members' link ports but has no secret. It writes join requests, heartbeats,
failure flags, deaths and decisions into the job's keys, opens links that it drops abruptly, and
replays valid records it captured. After each attempt every member's view (failed, dead, pending
joiners, round, members, links, whether a join is due) must be what it was; each attempt is
recorded in the ``membership`` tally (``refused``: ignored; ``silent``: a view changed). Then a real
SIGKILL is still known by the others within 2 s and the recovery forms the legitimate group.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hostile import Tally
from spawned import gloo_env, here, in_env, reap, worker_context

from tenplex.train.launch import RendezvousStore

WORLD = 3
DEAD_AFTER = 2.0  # heartbeat silence that means death here
SETTLE = 0.3  # seconds after an attempt before the views are compared (6 heartbeats)
KILL_BOUND = 2.0  # a SIGKILLed member is known by the others within this (links: milliseconds)
STORE_TIMEOUT = 5.0  # the members' store client timeout: a read of a deleted key fails after this
PREFIX = "hostile/job"


def _member(rank: int, port: int, token: str, out: Any, ctl: Any) -> None:
    """Member ``rank``: its Membership (the secret from the environment), then answers ``ctl`` commands."""
    os.environ["TENPLEX_STORE_TOKEN"] = token
    import torch.distributed as dist

    from tenplex.elastic.membership_runtime import Membership

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT))
        m = Membership(store, PREFIX, rank=rank, world_size=WORLD, backend="gloo", interval=0.05,
                       dead_after=DEAD_AFTER, agree_timeout=15.0, pg_timeout=datetime.timedelta(seconds=15))
    except BaseException as e:  # reported to the test
        out.put((rank, "error", f"{type(e).__name__}: {e}"))
        return
    out.put((rank, "ready", os.getpid()))
    while True:
        cmd = ctl.get()
        try:
            if cmd == "view":
                out.put((rank, "view", {"failed": m.failed, "dead": sorted(m.dead()), "pending": list(m.pending()),
                                        "round": m.round, "members": list(m.members), "linked": sorted(m.linked()),
                                        "join_due": m.join_due(5, propose=False)}))
            elif cmd == "recover":
                nm = m.recover()
                out.put((rank, "recovered", {"round": nm.round, "members": list(nm.members), "alive": list(nm.alive)}))
            elif cmd == "exit":
                m.close()
                if dist.is_initialized():
                    dist.destroy_process_group()
                out.put((rank, "bye", None))
                return
        except BaseException as e:  # reported to the test
            out.put((rank, "error", f"{type(e).__name__}: {e}"))


class Job:
    """The members' processes and how to ask them for their views (a queue each way per member: a
    member killed while it holds a shared queue's lock would block the others' answers)."""

    def __init__(self, port: int, token: str) -> None:
        ctx = worker_context()
        self.out = [ctx.Queue() for _ in range(WORLD)]
        self.ctl = [ctx.Queue() for _ in range(WORLD)]
        with gloo_env():
            self.procs = [ctx.Process(target=in_env, args=(*here(), _member, r, port, token, self.out[r], self.ctl[r]))
                          for r in range(WORLD)]
        for p in self.procs:
            p.start()
        self.pids = dict(self._collect("ready", range(WORLD), 60))

    def _collect(self, kind: str, ranks: Any, timeout: float) -> dict[int, Any]:
        got = {}
        deadline = time.monotonic() + timeout
        for r in ranks:
            while r not in got:
                try:
                    rank, k, v = self.out[r].get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"member {r} did not answer {kind!r} in {timeout} s") from None
                assert k != "error", f"member {rank}: {v}"
                if k == kind:
                    got[rank] = v
        return got

    def ask(self, cmd: str, ranks: Any = range(WORLD), timeout: float = 30) -> dict[int, Any]:
        for r in ranks:
            self.ctl[r].put(cmd)
        return self._collect({"view": "view", "recover": "recovered", "exit": "bye"}[cmd], ranks, timeout)

    def views(self, ranks: Any = range(WORLD)) -> dict[int, Any]:
        return self.ask("view", ranks)

    def close(self) -> None:
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        try:
            self.ask("exit", alive, timeout=10)
        except AssertionError:
            pass
        reap(self.procs)


def _calm(rank: int) -> dict[str, Any]:
    return {"failed": False, "dead": [], "pending": [], "round": 0, "members": list(range(WORLD)),
            "linked": [r for r in range(WORLD) if r != rank], "join_due": False}


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[tuple[Job, Any]]:
    """A running job of ``WORLD`` members with a secret, whose views are calm; the outsider's store client."""
    import torch.distributed as dist

    runtime = tmp_path / "runtime"  # the outsider (this process) has no secret: no token anywhere
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENPLEX_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("TENPLEX_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TENPLEX_STORE_TOKEN_FILE", raising=False)
    token = os.urandom(24).hex()
    rdzv = RendezvousStore()
    j = None
    try:
        j = Job(rdzv.port, token)
        deadline = time.monotonic() + 20
        while (v := j.views()) != {r: _calm(r) for r in range(WORLD)} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert v == {r: _calm(r) for r in range(WORLD)}, v
        store = dist.TCPStore("127.0.0.1", rdzv.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        yield j, (store, rdzv.port, token)
    finally:
        if j is not None:
            j.close()
        rdzv.stop()


def _judge(t: Tally, j: Job, what: str, expect: dict[int, Any] | None = None, settle: float = SETTLE) -> None:
    """Record ``what``: refused when every member's view is still ``expect`` (default: calm)."""
    time.sleep(settle)
    expect = expect or {r: _calm(r) for r in range(WORLD)}
    got = j.views(expect)
    if got == expect:
        t.record("refused", what)
    else:
        t.record("silent", f"{what}: {got}")


def _store_op(port: int, op: str, *args: Any) -> None:
    """One store operation on a fresh connection (the server drops a connection whose request fails,
    e.g. ``add`` on a value that is no number)."""
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    try:
        getattr(s, op)(*args)
    except (RuntimeError, ValueError):
        pass


def _fake_mac() -> str:
    return os.urandom(32).hex()


# ---------------------------------------------------------------------------------------------
# an outsider writes the job's keys
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_outsider_store_writes_neither_join_nor_fail_nor_kill(job: tuple[Job, Any]) -> None:
    """Join requests, heartbeats, failure flags, deaths and a join boundary, in the old plain format,
    as junk and as records with a made-up HMAC, and keys deleted: every member's view stays calm, also
    ``DEAD_AFTER`` (no heartbeat verdict) and ``STORE_TIMEOUT`` (no read stuck on a deleted key) later."""
    j, (_, port, _) = job
    t = Tally.of("membership")
    k = f"{PREFIX}/".__add__
    attempts: list[tuple[str, list[tuple[str, ...]]]] = [
        ("join request (plain id, join counter)", [("add", k("next_id"), "1"), ("set", k("hb/7"), "1"),
                                                   ("append", k("joiners"), "7,"), ("add", k("join_requests"), "1")]),
        ("join request (forged HMAC)", [("set", k("hb/8"), f"m1:{_fake_mac()}:1;"),
                                        ("append", k("joiners"), f",m1:{_fake_mac()}:8,")]),
        ("heartbeat junk", [("set", k("hb/1"), "garbage")]),
        ("heartbeat plain counter", [("set", k("hb/2"), "5")]),
        ("heartbeat forged HMAC, high sequence", [("set", k("hb/0"), f"m1:{_fake_mac()}:999999999;1.2")]),
        ("failure flag (counter)", [("add", k("round0/failures"), "1")]),
        ("failure flag (plain entry)", [("append", k("round0/failures"), "0,")]),
        ("failure flag (forged HMAC)", [("append", k("round0/failures"), f",m1:{_fake_mac()}:1,")]),
        ("death by broken link (gone list)", [("append", k("gone"), "2,"),
                                              ("append", k("gone"), f",m1:{_fake_mac()}:1,")]),
        ("join boundary", [("set", k("round0/join_at/5"), "1"),
                           ("set", k("round0/join_at/5"), f"m1:{_fake_mac()}:1")]),
        ("heartbeat deleted", [("delete_key", k("hb/1"), "")]),
        ("failure flags deleted", [("delete_key", k("round0/failures"), "")]),
        ("joiners list deleted", [("delete_key", k("joiners"), "")]),
        ("next round's decision", [("set", k("round1/decision"),
                                    '{"round": 1, "members": [0], "previous": [0, 1, 2]}')]),
    ]
    for what, ops in attempts:
        for op, key, value in ops:
            _store_op(port, op, key, *([int(value)] if op == "add" else [] if op == "delete_key" else [value]))
        _judge(t, j, f"store: {what}")
    _judge(t, j, f"store: no verdict {STORE_TIMEOUT} s after the writes (deleted keys: no store failure)",
           settle=max(DEAD_AFTER, STORE_TIMEOUT) + SETTLE)
    t.assert_none_silent()


# ---------------------------------------------------------------------------------------------
# an outsider connects to a member's link port
# ---------------------------------------------------------------------------------------------
def _link_addresses(store: Any) -> dict[int, tuple[str, int]]:
    """The members' link ports, read from the store as any process can (the records are signed, not secret)."""
    out = {}
    for r in range(WORLD):
        host, port = store.get(f"{PREFIX}/link/{r}").decode().rsplit(":", 2)[-2:]  # (a signed record: m1:MAC:host:port)
        out[r] = (host, int(port))
    return out


def _abort(s: socket.socket) -> None:
    """Close with a reset, as the kernel does for a killed process with unread data."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.mark.timeout(120)
def test_outsider_links_dropped_abruptly_are_no_deaths(job: tuple[Job, Any]) -> None:
    """To each member's link port: a connection reset at once, one that says the pre-handshake hello of
    another member then resets, one that starts the handshake as another member (its hello and nonce),
    reads the member's answer and resets without a proof, and one that sends a wrong proof. None is a
    death, none removes a member's real links."""
    j, (store, _, _) = job
    t = Tally.of("membership")
    addrs = _link_addresses(store)
    for target, (host, port) in addrs.items():
        claimed = (target + 1) % WORLD  # a member that does link to ``target``
        tries = {
            "reset at once": [],
            "old hello as a member, reset": [struct.pack("!4sq", b"TPLX", claimed)],
            "hello as a member, no proof, reset": [struct.pack("!4sq16s", b"TPL2", claimed, os.urandom(16))],
            "hello as a member, wrong proof, reset": [struct.pack("!4sq16s", b"TPL2", claimed, os.urandom(16)),
                                                      os.urandom(32)],
        }
        for what, msgs in tries.items():
            s = socket.create_connection((host, port), timeout=5)
            for msg in msgs:
                s.sendall(msg)
                if len(msg) == 28:  # the member answers a hello with its id, nonce and HMAC
                    s.settimeout(2)
                    try:
                        s.recv(64)
                    except OSError:
                        pass
            time.sleep(0.05)
            _abort(s)
            _judge(t, j, f"link to member {target}: {what}", settle=0.2)
    _judge(t, j, f"links: no heartbeat verdict {DEAD_AFTER} s later", settle=DEAD_AFTER + SETTLE)
    t.assert_none_silent()


# ---------------------------------------------------------------------------------------------
# an outsider replays valid records; a real death is still known at once
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_replayed_records_change_nothing_and_a_real_kill_is_still_known(job: tuple[Job, Any]) -> None:
    """Records the outsider captured from the job's store (an older heartbeat of member 1, member 0's
    heartbeat under member 2's key and as a joiner entry, round 0's failure flags into round 1) and
    records a previous launch of the same job signed with the same secret (a joiner, a failure flag, a
    death, a join boundary, a decision for the next round excluding member 1) change no view. Then
    member 2 is SIGKILLed: 0 and 1 know within ``KILL_BOUND`` s, and their recovery forms the group
    (0, 1), not the planted decision."""
    from tenplex.elastic.job_secret import JobSecret, encode_beat
    from tenplex.elastic.membership import Decision, encode_decision

    j, (store, port, token) = job
    t = Tally.of("membership")
    k = f"{PREFIX}/".__add__
    old_hb1, hb0 = store.get(k("hb/1")), store.get(k("hb/0"))
    time.sleep(0.3)  # member 1 beat since: its captured record is an old one
    previous = JobSecret.resolve(token).scoped("hostile/previous-launch")  # what that launch signed
    prev = {name: previous.sign(f"hostile/previous-launch/{name}", payload) for name, payload in
            [("hb/1", encode_beat(10**9, [0, 2])), ("round0/join_at/5", "1"),
             ("round1/decision", encode_decision(Decision(1, (0,), (0, 1, 2))))]}
    entry = {name: previous.entry(f"hostile/previous-launch/{name}", payload) for name, payload in
             [("joiners", "9"), ("round0/failures", "0"), ("gone", "1")]}
    assert previous.open("hostile/previous-launch/round0/join_at/5", prev["round0/join_at/5"]) == "1"  # genuine records
    replays: list[tuple[str, list[tuple[str, str, Any]]]] = [
        ("member 1's older heartbeat", [("set", k("hb/1"), old_hb1)]),
        ("member 0's heartbeat under member 2's key", [("set", k("hb/2"), hb0)]),
        ("member 0's heartbeat as a joiner entry", [("append", k("joiners"), b"," + hb0 + b",")]),
        ("a previous launch's heartbeat (high sequence)", [("set", k("hb/1"), prev["hb/1"])]),
        ("a previous launch's joiner", [("append", k("joiners"), entry["joiners"])]),
        ("a previous launch's failure flag", [("append", k("round0/failures"), entry["round0/failures"])]),
        ("a previous launch's death of member 1", [("append", k("gone"), entry["gone"])]),
        ("a previous launch's join boundary", [("set", k("round0/join_at/5"), prev["round0/join_at/5"])]),
        ("a previous launch's decision for round 1", [("set", k("round1/decision"), prev["round1/decision"])]),
    ]
    for what, ops in replays:
        for op, key, value in ops:
            _store_op(port, op, key, value)
        _judge(t, j, f"replay: {what}")
    _judge(t, j, f"replay: no heartbeat verdict {DEAD_AFTER} s later", settle=DEAD_AFTER + SETTLE)

    t_kill = time.monotonic()
    os.kill(j.pids[2], signal.SIGKILL)
    while True:
        v = j.views((0, 1))
        if all(x["failed"] and x["dead"] == [2] for x in v.values()):
            break
        assert time.monotonic() - t_kill < KILL_BOUND, f"SIGKILL not known within {KILL_BOUND} s: {v}"
        time.sleep(0.02)
    print(f"\nSIGKILL of member 2 known by members 0 and 1 after {time.monotonic() - t_kill:.3f} s")
    rec = j.ask("recover", (0, 1), timeout=60)
    assert rec == {r: {"round": 1, "members": [0, 1], "alive": [0, 1]} for r in (0, 1)}, rec

    after = {r: {"failed": False, "dead": [2], "pending": [], "round": 1, "members": [0, 1], "linked": [1 - r],
                 "join_due": False} for r in (0, 1)}
    _judge(t, j, "after the recovery", after)
    got = {name: store.get(k(name))
           for name in ("round0/failures", "round1/joined", "round1/decision", "round1/ready/0")}
    for what, ops in [("round 0's flags into round 1", [("append", k("round1/failures"), got["round0/failures"])]),
                      ("round 1's joined entries as joiners", [("append", k("joiners"), got["round1/joined"])]),
                      ("round 1's joined entries into round 2", [("append", k("round2/joined"), got["round1/joined"])]),
                      ("round 1's decision for round 2", [("set", k("round2/decision"), got["round1/decision"])]),
                      ("round 1's ready record for round 2", [("set", k("round2/ready/0"), got["round1/ready/0"])])]:
        for op, key, value in ops:
            _store_op(port, op, key, value)
        _judge(t, j, f"replay after the recovery: {what}", after)
    t.assert_none_silent()


def test_records_verify_only_under_their_key_scope_and_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A record verifies under the key, scope (job launch) and secret it was signed for only; list
    entries survive junk appended around them and count once; no secret: a public key, or ConfigError
    in strict mode."""
    from tenplex.elastic.job_secret import JobSecret, decode_beat, encode_beat
    from tenplex.errors import ConfigError

    a, b, c = (JobSecret.resolve(s).scoped(p) for s, p in (("s1", "p/x"), ("s2", "p/x"), ("s1", "p/y")))
    r = a.sign("p/x/hb/1", encode_beat(3, [2, 0]))
    assert a.open("p/x/hb/1", r) == "3;0.2" and decode_beat("3;0.2") == (3, frozenset({0, 2}))
    assert a.open("p/x/hb/2", r) is None and b.open("p/x/hb/1", r) is None and c.open("p/x/hb/1", r) is None
    assert a.open("k", b"\xff") is None and a.open("k", "m1:zz:1") is None and decode_beat("x") is None
    lst = "junk" + a.entry("k", "1") + "m1:xx" + a.entry("k", "2") + a.entry("k", "1")
    assert a.entries("k", lst) == (["1", "2"], 2)
    assert a.fingerprint() != b.fingerprint() and "s1" not in repr(a)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENPLEX_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("TENPLEX_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TENPLEX_STORE_TOKEN_FILE", raising=False)
    assert not JobSecret.resolve().authenticated
    monkeypatch.setenv("TENPLEX_MEMBERSHIP_STRICT", "1")
    with pytest.raises(ConfigError, match="TENPLEX_MEMBERSHIP_STRICT=1 and no job secret"):
        JobSecret.resolve()
    monkeypatch.setenv("TENPLEX_STORE_TOKEN", "t0k3n")
    assert JobSecret.resolve().authenticated and JobSecret.resolve().key == JobSecret.resolve("t0k3n").key


@pytest.mark.timeout(120)
def test_a_counter_set_back_gives_a_joiner_no_members_id(job: tuple[Job, Any]) -> None:
    """The outsider sets the joiner id counter back to 0 (and plants junk claims): a joiner with the
    secret still takes a fresh id (3: ids 0-2 are the members' claims), and the members see it pending."""
    import torch.distributed as dist

    from tenplex.elastic.job_secret import JobSecret
    from tenplex.elastic.membership_runtime import Membership

    j, (store, port, token) = job
    store.set(f"{PREFIX}/next_id", "0")
    store.set(f"{PREFIX}/id/3", "junk")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    joiner = Membership(client, PREFIX, backend="gloo", interval=0.05, dead_after=DEAD_AFTER, joiner=True,
                        secret=JobSecret.resolve(token))
    try:
        assert joiner.id == 3
        deadline = time.monotonic() + 10
        while (v := j.views()) != {r: {**_calm(r), "pending": [3]} for r in range(WORLD)}:
            assert time.monotonic() < deadline, v
            time.sleep(0.1)
    finally:
        joiner.close()


def _starter(rank: int, port: int, token: str, out: Any) -> None:
    """Rank ``rank`` of 2 with ``token`` as its secret: ``start_membership``; reports its refusal or its id."""
    os.environ["TENPLEX_STORE_TOKEN"] = token
    os.environ["TENPLEX_JOB_ID"] = f"secrets-{port}"
    import torch.distributed as dist

    from tenplex.elastic.membership_runtime import start_membership
    from tenplex.errors import ConfigError

    res: dict[str, Any] = {"error": None}
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=20))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        try:
            m = start_membership(store, interval=0.05, dead_after=1.0)
            res["id"] = m.id
            dist.barrier()
            m.close()
        except ConfigError as e:
            res["refused"] = str(e)
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
    out.put((rank, res))


@pytest.mark.timeout(60)
def test_workers_with_different_secrets_refuse_to_start_together() -> None:
    """A worker given another token than rank 0's: every rank refuses at ``start_membership`` with the
    ranks that differ (none waits for heartbeats it could not verify); with the same token they start."""
    from spawned import free_port, run_spawned

    for tokens, refused in ((("tok-a", "tok-b"), True), (("tok-a", "tok-a"), False)):
        port = free_port()
        res = run_spawned(_starter, [(r, port, tokens[r]) for r in range(2)], expect=2, timeout=45)
        assert all(v["error"] is None for v in res.values()), res
        if refused:
            why = "ranks [1] hold another job secret than rank 0"
            assert all(why in v.get("refused", "") for v in res.values()), res
        else:
            assert sorted(v.get("id") for v in res.values()) == [0, 1], res
