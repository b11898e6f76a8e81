"""Links whose breaking tells a peer's death (``tenplex.elastic.liveness``): real sockets, real processes.

A child process (forked from the test session's forkserver) links to this one (and this one to it)
and is then SIGKILLed: ``poll`` names it
within one poll, with no heartbeat involved. A child that closes its links on purpose (goodbye)
or exits after ``close()`` is not reported; a connection that is no member's link is ignored; an
unreachable peer is not declared dead (its heartbeats decide).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import pytest

from tenplex.elastic.liveness import PeerLinks, link_host

from spawned import here, in_env, worker_context

def _child_main(addr: str, mode: str, out: Any) -> None:
    """The peer: links to ``addr`` as member 7, says where it listens, that it linked (and closed)."""
    me = PeerLinks(7)
    me.want({1: addr})
    out.put(me.address)
    end = time.monotonic() + 30
    while time.monotonic() < end and 1 not in me.linked():
        me.poll(0.05)
    out.put("linked")
    if mode == "fork":  # a child (a data loader worker, say) that outlives this process by 20 s
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        out.put(pid)
    if mode == "bye":
        me.close()
        out.put("closed")
        time.sleep(0.5)
        sys.exit(0)
    while True:
        me.poll(0.2)


def _child(addr: str, mode: str) -> tuple[Any, Any, str]:
    """The peer as a process forked from the session's forkserver (``spawned.worker_context``):
    (process, its message queue, its address)."""
    ctx = worker_context()
    q = ctx.Queue()
    p = ctx.Process(target=in_env, args=(*here(), _child_main, addr, mode, q))
    p.start()
    child_addr = q.get(timeout=30)
    assert child_addr, "the child did not start"
    return p, q, child_addr


def _poll_until(links: PeerLinks, cond, timeout: float) -> set[int]:
    dead: set[int] = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond(dead):
        dead |= links.poll(0.05)
    return dead


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["kill", "bye", "fork"])
def test_a_killed_peer_is_named_at_once_and_a_goodbye_is_not_a_death(mode: str) -> None:
    """``fork``: the peer forked a child before it was killed; the child's copies of the link
    sockets are closed as it starts, so they do not keep the dead peer's links open."""
    me = PeerLinks(1)
    grandchild = None
    p, q, child_addr = _child(me.address, mode)
    try:
        me.want({7: child_addr})  # links both ways: each end sees the other's death
        _poll_until(me, lambda _: me.linked() == {7}, 30)
        assert me.linked() == {7}
        assert q.get(timeout=30) == "linked"
        if mode == "fork":
            grandchild = q.get(timeout=30)
        if mode in ("kill", "fork"):
            t0 = time.monotonic()
            p.kill()  # SIGKILL
            dead = _poll_until(me, lambda d: 7 in d, 10)
            assert dead == {7} and time.monotonic() - t0 < 2, (dead, time.monotonic() - t0)
            print(f"\nSIGKILL -> named dead in {time.monotonic() - t0:.4f} s")
            assert _poll_until(me, lambda _: not me.linked(), 5) <= {7}  # the other direction's link
            assert me.linked() == frozenset()
        else:
            assert q.get(timeout=30) == "closed"
            p.join(timeout=10)
            assert p.exitcode == 0
            assert _poll_until(me, lambda _: not me.linked(), 5) == set()  # both links ended quietly
            assert me.linked() == frozenset()
    finally:
        p.kill()
        p.join()
        me.close()
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_strangers_and_unreachable_peers_are_not_deaths() -> None:
    me = PeerLinks(1)
    try:
        host, port = me.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:  # not a member: a wrong hello
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert _poll_until(me, lambda _: False, 0.3) == set()
        assert _poll_until(me, lambda _: False, 0.2) == set()  # its close is no death either
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        closed.close()  # nobody listens there: connection refused
        me.want({3: f"127.0.0.1:{dead_port}"})
        assert _poll_until(me, lambda _: False, 0.3) == set()
        assert me.linked() == frozenset()
    finally:
        me.close()


def test_link_host() -> None:
    assert link_host(None) == "127.0.0.1" and link_host("localhost") == "127.0.0.1"
    assert link_host("127.0.0.1") == "127.0.0.1"


def test_a_goodbye_reaches_a_link_still_waiting_in_the_listeners_backlog() -> None:
    """Member 1 links to member 7, which closes before it ever polls: 1's connection still waits in
    7's listener backlog (connected, its handshake unanswered: not a link yet). ``close`` accepts it
    and says goodbye on it, so 1 sees no death (closing the listener alone resets it; before the
    handshake, issue 31, 1 named 7 dead)."""
    a, b = PeerLinks(1), PeerLinks(7)
    a.want({7: b.address})
    _poll_until(a, lambda _: False, 0.3)  # connected, hello sent
    assert a.linked() == frozenset()
    b.close()
    dead = _poll_until(a, lambda _: not a.linked(), 5)
    assert dead == set() and not a.linked()


def test_a_stranger_that_never_authenticates_is_dropped_and_no_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that sends nothing, or a member's hello but never the proof, is closed by the
    member after ``HANDSHAKE_S`` and never counts as a link; two members with different secrets do not
    link (each drops the other), two with the same secret do."""
    import tenplex.elastic.liveness as liveness
    from tenplex.elastic.job_secret import JobSecret

    monkeypatch.setattr(liveness, "HANDSHAKE_S", 0.3)
    me = PeerLinks(1)
    try:
        host, port = me.address.rsplit(":", 1)
        silent = socket.create_connection((host, int(port)), timeout=5)
        halfway = socket.create_connection((host, int(port)), timeout=5)
        halfway.sendall(b"TPL2" + (7).to_bytes(8, "big") + os.urandom(16))
        _poll_until(me, lambda _: False, 0.8)
        assert me.linked() == frozenset()
        assert silent.recv(64) == b""  # closed by the member
        answer = b""
        while chunk := halfway.recv(64):
            answer += chunk
        assert len(answer) == 60  # the member's answer to the hello, then it closed
        silent.close()
        halfway.close()
    finally:
        me.close()
    for secrets_, linked in (((b"one", b"two"), frozenset()), ((b"one", b"one"), frozenset({7}))):
        a = PeerLinks(1, secret=JobSecret.resolve(secrets_[0]))
        b = PeerLinks(7, secret=JobSecret.resolve(secrets_[1]))
        try:
            a.want({7: b.address})
            end = time.monotonic() + 1.0
            dead: set[int] = set()
            while time.monotonic() < end:
                dead |= a.poll(0.02) | b.poll(0.02)
            assert a.linked() == linked and dead == set(), (secrets_, a.linked(), dead)
        finally:
            a.close()
            b.close()
