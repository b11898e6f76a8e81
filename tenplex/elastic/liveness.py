"""Links between members whose breaking tells a peer's death at once (issue #18, item 1).

A killed or crashed process cannot say goodbye, but its kernel closes its sockets for it: the peer
at the other end of a TCP connection reads end-of-file (or a reset) within a round trip. The
heartbeats in :mod:`tenplex.elastic.membership` need ``dead_after`` seconds of silence to conclude the
same; these links make the common case, a process that died while its host lives (an OOM kill, a
GPU error that takes the process down, a SIGKILL), known in milliseconds, and the heartbeats stay
for what no connection reports (a host that lost power or its network: no FIN is ever sent).

Each member listens on one port and links to a few others (:class:`tenplex.elastic.membership_runtime.Membership`
uses a ring with chords: every member links to its successors at distance 1, 2, 4, ...). A connection opens
with a challenge-response in both directions, keyed by the job secret
(:class:`tenplex.elastic.job_secret.JobSecret`): the connector sends its id and a fresh nonce, the
acceptor answers with its id, its own nonce and an HMAC over both ids and both nonces, the connector
checks it (the acceptor is the member it wanted) and answers with its HMAC (the connector is a member).
Only a link that passed it counts: it vouches for its peer (:meth:`PeerLinks.linked`) and its end can
mean death. A connection that fails the handshake or does not finish it within
``HANDSHAKE_S`` seconds is dropped, logged, and is no death, so a process without the secret can
neither pose as a member nor make one look dead. A member that leaves on purpose sends a goodbye byte
before closing, so only an authenticated link that ends *without* one means death. Connects and hellos are non-blocking:
one select loop (the heartbeat thread's) serves them all, so an unreachable peer never stalls the
heartbeats. A peer that cannot be reached is not declared dead here (a firewall looks the same);
its heartbeats decide.

A host that vanishes silently (power, a cut cable: no FIN, no reset) is found by the links too:
every link has TCP keepalive on, so the kernel probes an idle link and ends it (``ETIMEDOUT``) when
the peer's kernel has answered nothing for ``timeout`` seconds (``TCP_USER_TIMEOUT``, probes 1 s
apart: ``timeout`` - 1 to ``timeout`` + 1 s after the cut; measured 2.55-2.67 s with 3 s on a cut
veth, ``tests/test_netns.py``). A live peer's kernel
answers the probes whatever its process does: a process starved of the CPU or the GIL (a long C
call, a loaded machine) or stopped (SIGSTOP) keeps its links, so a link that is open means the
process exists. (A process that is alive but hung holds its links too: that is not a death, the
collectives' timeout is what catches it.) Forked children close their copies of the sockets
(``os.register_at_fork``), so a child cannot keep a dead parent's links open.
"""

from __future__ import annotations

import errno
import functools
import hmac
import logging
import math
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError
from .job_secret import JobSecret

__all__ = ["PeerLinks", "link_host", "keep_alive", "LINK_HOST_ENV", "HANDSHAKE_S"]

log = logging.getLogger(__name__)

LINK_HOST_ENV = "TENPLEX_LINK_HOST"
"""The address a member listens on for its links (default: the interface that reaches the store)."""

_HELLO = struct.Struct("!4sq16s")  # magic, the connecting member's id, its nonce
_REPLY = struct.Struct("!4sq16s32s")  # magic, the accepting member's id, its nonce, its HMAC
_PROOF = 32  # the connector's HMAC
_IDS = struct.Struct("!qq")  # (connector, acceptor): what both HMACs cover, with both nonces
_MAGIC = b"TPL2"
_BYE = b"B"
HANDSHAKE_S = 10.0
"""Seconds an accepted connection may take to authenticate before it is dropped."""
_MAX_PENDING = 64  # accepted connections still in their handshake; the oldest is dropped beyond


def link_host(store_host: str | None) -> str:
    """The local address peers reach this process at: ``$TENPLEX_LINK_HOST``, else the address of
    the interface a packet to ``store_host`` leaves from (the store is reachable from every member,
    so is that interface), else loopback."""
    env = os.environ.get(LINK_HOST_ENV)
    if env:
        return env
    if not store_host or store_host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((store_host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    peer: int | None  # outgoing: the member wanted; accepted: None until authenticated
    outgoing: bool
    connected: bool = True
    inbox: bytearray = field(default_factory=bytearray)
    said_bye: bool = False
    authed: bool = False  # the handshake passed: only then does the link vouch, and its end mean death
    nonce: bytes = b""  # this end's nonce
    claim: int | None = None  # accepted: the id the connector claims, until its proof arrives
    peer_nonce: bytes = b""
    opened: float = field(default_factory=time.monotonic)


def keep_alive(sock: socket.socket, timeout: float) -> None:
    """Make the kernel end ``sock`` once its peer's kernel has answered nothing for ``timeout``
    seconds, idle or not: keepalive probes every second after one idle second, and
    ``TCP_USER_TIMEOUT`` (which also bounds unacknowledged data) of ``timeout``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, math.ceil(timeout) - 1)),
                        ("TCP_USER_TIMEOUT", int(timeout * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:  # Linux has them all; elsewhere the system's keepalive defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def _forget_after_fork(ref: weakref.ReferenceType[PeerLinks]) -> None:
    links = ref()
    if links is not None:
        links._forget()


class PeerLinks:
    """This member's links (see the module docstring). ``want`` may be called from any thread;
    ``poll`` from one thread only (it owns the sockets). ``timeout``: seconds without an answer
    from a peer's kernel after which its link ends (a vanished host; at least 1). ``secret``: the
    job's (scoped) key the handshakes use; default: the unauthenticated mode's public key."""

    def __init__(self, member: int, host: str = "127.0.0.1", timeout: float = 3.0,
                 secret: JobSecret | None = None) -> None:
        if not timeout >= 1:
            raise ConfigError(f"the link timeout must be at least 1 s (keepalive probes are 1 s apart), got {timeout}")
        self.member = member
        self.timeout = float(timeout)
        self.secret = secret if secret is not None else JobSecret.unauthenticated()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._wanted: dict[int, str] = {}
        self._changed = False
        self._links: list[_Link] = []
        self._closed = False
        os.register_at_fork(after_in_child=functools.partial(_forget_after_fork, weakref.ref(self)))

    def want(self, peers: Mapping[int, str]) -> None:
        """Link to exactly these peers (id -> ``host:port``) from now on: the next ``poll`` connects
        to new ones and says goodbye to outgoing links no longer wanted (links peers opened to this
        member stay: they end with the peer's goodbye or death)."""
        with self._lock:
            self._wanted = {int(k): str(v) for k, v in peers.items() if int(k) != self.member}
            self._changed = True

    def linked(self) -> frozenset[int]:
        """Peers with an established, authenticated link (either direction). Any thread: a copy of the
        list is read, which the polling thread may change meanwhile."""
        return frozenset(ln.peer for ln in list(self._links) if ln.peer is not None and ln.authed)

    def poll(self, timeout: float) -> frozenset[int]:
        """Wait up to ``timeout`` seconds for link events; the peers whose link ended without a goodbye."""
        if self._closed:
            return frozenset()
        self._apply()
        readers = [self._listener] + [ln.sock for ln in self._links if ln.connected]
        writers = [ln.sock for ln in self._links if not ln.connected]
        try:
            r, w, _ = select.select(readers, writers, [], max(0.0, timeout))
        except (OSError, ValueError):  # a socket closed under us (close() from another thread)
            return frozenset()
        dead: set[int] = set()
        by_sock = {ln.sock: ln for ln in self._links}
        for s in w:
            ln = by_sock[s]
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                log.info("member %d: no link to member %s (%s); its heartbeats watch it", self.member, ln.peer,
                         os.strerror(err))
                self._drop(ln)
                continue
            ln.connected = True
            ln.nonce = os.urandom(16)
            try:
                s.send(_HELLO.pack(_MAGIC, self.member, ln.nonce))  # 28 bytes into an empty buffer: never partial
            except OSError:
                self._drop(ln)
        for s in r:
            if s is self._listener:
                self._accept()
                continue
            ln = by_sock.get(s)
            if ln is None or ln not in self._links:
                continue
            try:
                data = s.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset: the peer's kernel closed it with data unread, as for a kill
                data = b""
            if data:
                self._received(ln, data)
                continue
            if ln.authed and not ln.said_bye:
                dead.add(ln.peer)
            self._drop(ln)
        self._expire()
        return frozenset(dead)

    def close(self) -> None:
        """Say goodbye on every link and close them (peers then do not take this for a death).

        Links peers opened that still wait in the listener's backlog are accepted first and told
        goodbye too: closing the listener would reset them, which their peers would take for a
        death. Each link's unread input is drained after the goodbye and its end of the stream shut,
        so that its close is a FIN after the goodbye byte, not a reset that could overtake it."""
        if self._closed:
            return
        self._closed = True
        for _ in range(2):  # the second pass: connections that arrived during the first
            self._accept()
            for ln in list(self._links):
                self._bye(ln, last=True)
        self._listener.close()

    # -- internals ---------------------------------------------------------------------------------
    def _forget(self) -> None:
        """In a forked child: close this process's copies of the sockets, silently (the parent's
        links stay as they are; the child must not keep them open after the parent's death)."""
        self._closed = True
        for s in [self._listener, *(ln.sock for ln in self._links)]:
            try:
                s.close()
            except OSError:
                pass
        self._links = []

    def _apply(self) -> None:
        with self._lock:
            if not self._changed:
                return
            wanted, self._changed = dict(self._wanted), False
        for ln in list(self._links):
            if ln.outgoing and ln.peer not in wanted:
                self._bye(ln)
        have = {ln.peer for ln in self._links if ln.outgoing}
        for peer, addr in wanted.items():
            if peer in have:
                continue
            host, _, port = addr.rpartition(":")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            keep_alive(s, self.timeout)
            rc = s.connect_ex((host, int(port)))
            if rc not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                log.info("member %d: no link to member %d at %s (%s)", self.member, peer, addr, os.strerror(rc))
                s.close()
                continue
            self._links.append(_Link(s, peer, outgoing=True, connected=False))

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.debug("member %d: accept failed: %s", self.member, e)
                return
            s.setblocking(False)
            keep_alive(s, self.timeout)
            self._links.append(_Link(s, None, outgoing=False))

    def _received(self, ln: _Link, data: bytes) -> None:
        if not ln.authed:
            ln.inbox += data
            if not self._handshake(ln):
                return
            data = bytes(ln.inbox)
            ln.inbox.clear()
        if _BYE in data:
            ln.said_bye = True

    def _handshake(self, ln: _Link) -> bool:
        """Advance ``ln``'s handshake with the bytes in its inbox (consumed); whether it passed now.
        A link that fails it is dropped: no member is named, so its end is no death."""
        mac = self.secret.link_mac
        try:
            if ln.outgoing:
                if len(ln.inbox) < _REPLY.size:
                    return False
                magic, peer, nonce, theirs = _REPLY.unpack(bytes(ln.inbox[: _REPLY.size]))
                ids = _IDS.pack(self.member, peer)
                if magic != _MAGIC or peer != ln.peer or not hmac.compare_digest(
                        theirs, mac(b"accept", ids, ln.nonce, nonce)):
                    return self._refuse(ln, f"the process at member {ln.peer}'s link address")
                ln.sock.send(mac(b"connect", ids, nonce, ln.nonce))  # 32 bytes: never partial
                del ln.inbox[: _REPLY.size]
            else:
                if ln.claim is None:
                    if len(ln.inbox) < _HELLO.size:
                        return False
                    magic, peer, nonce = _HELLO.unpack(bytes(ln.inbox[: _HELLO.size]))
                    if magic != _MAGIC:
                        return self._refuse(ln, "a connection that is no member's link")
                    ln.claim, ln.peer_nonce, ln.nonce = int(peer), nonce, os.urandom(16)
                    ids = _IDS.pack(ln.claim, self.member)
                    ln.sock.send(_REPLY.pack(_MAGIC, self.member, ln.nonce, mac(b"accept", ids, nonce, ln.nonce)))
                    del ln.inbox[: _HELLO.size]
                if len(ln.inbox) < _PROOF:
                    return False
                proof = bytes(ln.inbox[:_PROOF])
                if not hmac.compare_digest(proof, mac(b"connect", _IDS.pack(ln.claim, self.member), ln.nonce,
                                                      ln.peer_nonce)):
                    return self._refuse(ln, f"a connection claiming to be member {ln.claim}")
                del ln.inbox[:_PROOF]
                ln.peer = ln.claim
        except OSError:  # the other end went away mid-handshake: it was never a link
            self._drop(ln)
            return False
        ln.authed = True
        return True

    def _refuse(self, ln: _Link, who: str) -> bool:
        log.warning("member %d: %s failed the link handshake (no job secret, or another one); dropped, not a "
                    "death", self.member, who)
        self._drop(ln)
        return False

    def _expire(self) -> None:
        """Drop accepted connections that did not authenticate within ``HANDSHAKE_S`` (and the oldest
        beyond ``_MAX_PENDING``): a stranger cannot hold this member's sockets."""
        pending = [ln for ln in self._links if not ln.outgoing and not ln.authed]
        now = time.monotonic()
        for i, ln in enumerate(pending):
            if now - ln.opened > HANDSHAKE_S or i < len(pending) - _MAX_PENDING:
                self._drop(ln)

    def _bye(self, ln: _Link, *, last: bool = False) -> None:
        """Goodbye on ``ln``, then close it; ``last`` (this member closes): shut the sending side
        and drain what the peer sent (its hello), so that the close does not reset the link."""
        if ln.connected:
            try:
                ln.sock.send(_BYE)
                if last:
                    ln.sock.shutdown(socket.SHUT_WR)
                    while ln.sock.recv(4096):
                        pass
            except OSError:  # nothing (more) to read (EAGAIN), or the peer is gone
                pass
        self._drop(ln)

    def _drop(self, ln: _Link) -> None:
        try:
            ln.sock.close()
        except OSError:
            pass
        if ln in self._links:
            self._links.remove(ln)
