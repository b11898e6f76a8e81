"""Links between members whose breaking tells a peer's death at once (issue #18, item 1).

A killed or crashed process cannot say goodbye, but its kernel closes its sockets for it: the peer
at the other end of a TCP connection reads end-of-file (or a reset) within a round trip. The
heartbeats in :mod:`tenplex.elastic.membership` need ``dead_after`` seconds of silence to conclude the
same; these links make the common case, a process that died while its host lives (an OOM kill, a
GPU error that takes the process down, a SIGKILL), known in milliseconds, and the heartbeats stay
for what no connection reports (a host that lost power or its network: no FIN is ever sent).

Each member listens on one port and links to a few others (:class:`tenplex.elastic.membership_runtime.Membership`
uses a ring: every member links to its successor, so each is watched by two). A connection opens
with a hello naming the connector; a member that leaves on purpose sends a goodbye byte before
closing, so only a link that ends *without* one means death. Connects and hellos are non-blocking:
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
import logging
import math
import os
import select
import socket
import struct
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["PeerLinks", "link_host", "keep_alive", "LINK_HOST_ENV"]

log = logging.getLogger(__name__)

LINK_HOST_ENV = "TENPLEX_LINK_HOST"
"""The address a member listens on for its links (default: the interface that reaches the store)."""

_HELLO = struct.Struct("!4sq")  # magic, the connecting member's id
_MAGIC = b"TPLX"
_BYE = b"B"


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
    peer: int | None  # None until an accepted link's hello arrived
    outgoing: bool
    connected: bool = True
    inbox: bytearray = field(default_factory=bytearray)
    said_bye: bool = False


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
    from a peer's kernel after which its link ends (a vanished host; at least 1)."""

    def __init__(self, member: int, host: str = "127.0.0.1", timeout: float = 3.0) -> None:
        if not timeout >= 1:
            raise ConfigError(f"the link timeout must be at least 1 s (keepalive probes are 1 s apart), got {timeout}")
        self.member = member
        self.timeout = float(timeout)
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
        """Peers with an established link (either direction)."""
        return frozenset(ln.peer for ln in self._links if ln.peer is not None and ln.connected)

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
            try:
                s.send(_HELLO.pack(_MAGIC, self.member))  # 12 bytes into an empty send buffer: never partial
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
            if ln.peer is not None and not ln.said_bye:
                dead.add(ln.peer)
            self._drop(ln)
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
        if ln.peer is None:
            ln.inbox += data
            if len(ln.inbox) < _HELLO.size:
                return
            magic, peer = _HELLO.unpack(bytes(ln.inbox[: _HELLO.size]))
            if magic != _MAGIC:
                log.warning("member %d: a connection that is no member's link; closed", self.member)
                self._drop(ln)
                return
            ln.peer, data = int(peer), bytes(ln.inbox[_HELLO.size :])
            ln.inbox.clear()
        if _BYE in data:
            ln.said_bye = True

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
