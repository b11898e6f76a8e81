"""In-process failure detection, scale up and new membership through the job's c10d store (issue #18,
items 1-2, 4): the runtime (store keys, heartbeat thread, links, process groups) of the pure rules in
:mod:`tenplex.elastic.membership`.

Each worker creates a :class:`Membership` after ``init_process_group``, given a ``TCPStore`` that
outlives the workers (the job's rendezvous store) and a job prefix. Then:

* a heartbeat thread (its own store connection, so a blocking wait of the main thread never
  delays it) reads the others' heartbeats and the job's news (failures flagged, joiners) every
  ``interval`` seconds, in one read where the store has :func:`peek`, and writes this member's
  heartbeat (a sequence number) every ``beat_every`` seconds (default a tenth of ``dead_after``:
  each write is a consensus round on a replicated store, and silence is judged over
  ``dead_after``). Every record in the store is signed with the job secret
  (:mod:`tenplex.elastic.job_secret`); one that does not verify is ignored. A death, or a failure
  flagged by another member, sets :meth:`Membership.failed` and calls ``on_failure``;
* a thread of its own (so that a store call waiting out an etcd election never delays it) watches
  TCP links to this member's ring neighbours at distance 1, 2, 4, ...
  (:func:`~tenplex.elastic.membership.link_targets`; :mod:`tenplex.elastic.liveness`):
  a process that dies while its host lives (killed, crashed) has its connections closed by its
  kernel, so its neighbours know within milliseconds, append its id to ``{prefix}/gone`` and flag
  the failure; the others read the list at their next heartbeat and in the agreement. A host that
  vanishes silently (power, network) is found the same way within ``link_timeout`` seconds: the
  links' TCP keepalive ends them when the peer's kernel stops answering. A member leaving on
  purpose (:meth:`close`) says goodbye on its links first;
* a link that is open says the process exists, however starved it is: a heartbeat thread can go
  without the GIL for seconds (measured: 0.62 s while the main thread imported torch and scipy
  beside 6 busy processes on 2 CPUs; a big pickle, a long C call, a loaded machine), and a
  verdict from that silence is a live member left out of the group (issue 29 item 7). So each
  member's heartbeat also names the neighbours its (authenticated) links to are open (it vouches
  for them): the others count that beat as theirs. A member whose count stands still for
  ``dead_after`` seconds (default 10) of this observer's own on-time observations (:class:`HeartbeatMonitor`) means
  dead: only members that no open link vouches for and that beat no more, e.g. one whose links
  could not be made. A hung but living process (deadlock, SIGSTOP) holds its links and is no
  death: a collective blocked on it fails after the group's ``timeout``;
* :meth:`Membership.guard` turns a ``RuntimeError`` raised by a collective (gloo: "Connection
  reset/closed by peer", nccl, ``DistError``) into :class:`~tenplex.errors.PeerFailure` and flags
  the failure in the store, so every member learns at once;
* :meth:`Membership.recover` destroys the broken group (nccl: aborts its communicators first),
  agrees with the other survivors on the next round and its members through the store alone, and
  re-forms the default group on the fresh prefix ``{prefix}/round{n}/pg``. It returns a
  :class:`NewMembership`; its ``alive`` is what :func:`tenplex.elastic.migrate.migrate` takes.

Members are named by their rank in the first group (``id``, stable over rounds); group rank i of
round n is ``members[i]``. The agreement rule is pure (:func:`propose`): in round n every member
of round n-1's candidates either joined (``{prefix}/round{n}/joined``, appended) or is dead by this
member's heartbeats; then the joined, live ones, ordered by ``order`` (default: by old rank), are
proposed with ``compare_set`` on ``{prefix}/round{n}/decision``: the first proposal stored wins and
every member reads that one. A member not in the decision raises :class:`~tenplex.errors.MembershipError`;
one of the decision that dies before the group forms sends the rest to round n+1; a round that
does not decide within ``agree_timeout`` raises MembershipError. Nothing waits without a bound.

Scale up: a fresh process creates ``Membership(store, prefix, backend=..., joiner=True)``: it
takes the next id, beats and registers under ``{prefix}/joiners``. The members' heartbeat threads
see the registration (the join counter travels in the heartbeats' ``multi_get``); at every step
boundary each member calls :meth:`Membership.join_due`, which agrees through the store on the
boundary after which all of them admit the joiners (:func:`join_boundary`: the first one a member
reaches knowing of them); there
``recover(join=True)`` runs the rounds above with the live joiners after the survivors
(:func:`propose`, ``fits``: as many as a layout allows), and the joiner's :meth:`Membership.admit`
waits for the decision that names it and regroups with them.

Which store: in tests and simulated nodes the :class:`~tenplex.train.launch.RendezvousStore`
process (``TCPStore(host, port, is_master=False)`` in every worker). Under torchrun the store must
outlive the failed node: the c10d rendezvous store run standalone (``--rdzv-conf is_host=false``,
the server in a process of its own, as ``RendezvousStore`` does), connected to directly from the
worker with the ``--rdzv-endpoint`` address; or, with no single point of failure, an etcd cluster
(``etcd://``, one member per host) behind torchrun's ``etcd-v2`` rendezvous. The store torchrun hands
workers (``MASTER_ADDR``:``MASTER_PORT``) lives on node 0 (its agent's, or with ``etcd-v2`` its rank-0
worker's) and dies with it; only the first group uses it (docs/inprocess.md, "No single point of failure").

gloo: ``abort()`` / ``shutdown()`` / ``_abort_process_group`` do not interrupt a collective
already blocked (measured, torch 2.13: the op waits for its timeout). What unblocks it is a peer
closing its connections: a survivor that catches the error destroys its group, and the peers
blocked on it fail at once ("Connection closed by peer"). A member blocked on a hung but living
peer waits for the group's ``timeout``; pass a short one to ``init_process_group`` (abandoning
an ``async_op`` collective does not help: ``destroy_process_group`` then waits for it to time out).

Use::

    m = Membership(store, f"job/{run_id}")
    while training:
        try:
            with m.guard():
                step()             # its collectives
            m.check()              # a death seen by the heartbeats between collectives
        except PeerFailure:
            nm = m.recover()       # the survivors' group is the default group again
            new = chooser(ptc, nm.world_size, old)
            shard = migrate(ptc, old, new, shard, alive=nm.alive, storage=url).shard
            old = new
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, MembershipError, PeerFailure, StoreInterrupted
from .job_secret import JobSecret, decode_beat, encode_beat
from .liveness import PeerLinks, link_host
from .membership import (Decision, HeartbeatMonitor, NewMembership, decode_decision, encode_decision, is_peer_error,
                         join_boundary, link_targets, old_ranks, propose)

__all__ = ["Membership", "MEMBERSHIP_STORE_ENV", "JOB_ENV", "membership_store", "job_key",
           "start_membership", "join_membership"]

log = logging.getLogger(__name__)

MEMBERSHIP_STORE_ENV = "TENPLEX_MEMBERSHIP_STORE"
JOB_ENV = "TENPLEX_JOB_ID"
JOBS_KEY = "tenplex/inproc/jobs"  # job key -> the membership prefix of the job's current launch

# ---------------------------------------------------------------------------------------------
# the store and thread adapter
# ---------------------------------------------------------------------------------------------
def peek(store: Any, keys: Sequence[str]) -> list[bytes | None]:
    """The values of ``keys``, None where missing, without waiting: one request on a store that has
    ``peek`` (:class:`~tenplex.elastic.etcd_store.EtcdStore`, where every request is an HTTP round
    trip and a read through the consensus); else c10d's ``check`` and ``get`` (a ``TCPStore``
    answers those in microseconds). A key deleted between a ``check`` and its ``get`` makes the
    ``get`` wait for it (RuntimeError after the store's timeout)."""
    own = getattr(store, "peek", None)
    if own is not None:
        return list(own(keys))
    keys = list(keys)
    if store.check(keys):
        return list(store.multi_get(keys))
    return [store.get(k) if store.check([k]) else None for k in keys]


@contextmanager
def _interruptible(store: Any, stop: Callable[[], bool]) -> Iterator[None]:
    """Calls to ``store`` inside the block give up (StoreInterrupted) once ``stop()`` is True, on a
    store that can (``EtcdStore.interrupt``: between a call's tries, e.g. while its cluster elects a
    leader); other stores' calls run to their end."""
    if not hasattr(store, "interrupt"):
        yield
        return
    before, store.interrupt = store.interrupt, stop
    try:
        yield
    finally:
        store.interrupt = before


def _store_host(store: Any) -> str | None:
    """The host of a ``TCPStore`` (through ``PrefixStore`` wrappers); None for other stores."""
    while store is not None and not hasattr(store, "host"):
        store = getattr(store, "underlying_store", None)
    return getattr(store, "host", None)


class _Publisher:
    """Writes the records that tell the other members of a death (a broken link's ``gone`` entry, a
    round's failure flag) in order, from a thread of its own on a connection of its own: a store slow
    to answer (an etcd cluster electing a new leader after its leader's host died) then delays the
    news, not this member's recovery (the heartbeat thread and the main thread's guard never wait on
    it; before, each waited for the election twice over). The members learn a death from their own
    links and collectives too; these records are for the ones that would not."""

    def __init__(self, store: Any, write: Callable[[Any, str, object], None], name: str) -> None:
        self._store, self._write = store, write
        self._queue: queue.SimpleQueue[tuple[str, object] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, key: str, payload: object) -> None:
        self._queue.put((key, payload))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, payload = item
            try:
                self._write(self._store, key, payload)
            except RuntimeError as e:  # the store itself gone: nothing left to tell
                log.error("could not record %s=%s in the membership store: %s", key, payload, e)

    def close(self, timeout: float) -> None:
        """Write what is queued (up to ``timeout`` seconds), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)


@dataclass(slots=True)
class _State:
    """What the heartbeat thread and the main thread share (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    watched: tuple[int, ...] = ()
    members: tuple[int, ...] = ()  # the current group's ids: a death among them is a failure
    pending: tuple[int, ...] = ()  # joiners registered and alive, not members yet
    joiners_raw: bytes = b""  # the joiners list when it was last read
    round: int = 0
    failed_at: float | None = None  # time.time()
    failed_mono: float | None = None
    reason: str = ""
    detect_s: float = 0.0


class Membership:
    """This worker's view of the job's members; see the module docstring.

    ``store``: a ``TCPStore`` (or a ``PrefixStore`` over one) that outlives workers; ``prefix``:
    the job's key prefix (one per job, or per restart of a job); ``rank`` / ``world_size``: this
    process in the current default group (default: from it); ``backend``: of the groups
    re-formed (default: the current group's). ``interval``: how often the news and the others'
    heartbeats are read; ``dead_after``: silence that means death for a member no open link vouches
    for; ``beat_every``: how often this member's heartbeat is written (default ``max(interval,
    dead_after / 10)``); ``link_timeout``: seconds
    after which a link whose peer's kernel answers nothing ends (a vanished host: its death is
    known that long after it vanished, plus one heartbeat for the members not linked to it);
    ``agree_timeout``: bound of one round's agreement and of the group
    start; ``max_rounds``: rounds one recovery may use; ``on_failure(reason)``: called from the
    heartbeat thread on the first failure it sees; ``order``: how a decision orders its members
    (ids in, ids out; default by previous rank); ``pg_timeout``: the new groups' collective timeout;
    ``fits(n)``: whether a group of n members can run (a layout fits): joiners are admitted only
    as far as it allows (default: any number). ``secret``: the job's (:meth:`JobSecret.resolve`,
    default: resolved from the environment), scoped to ``prefix``: it signs every record this
    member stores and keys its links' handshakes; records that do not verify are ignored (logged).

    ``joiner=True``: a fresh process asking to join the running job (scale up): it has no group and
    no state; it takes the next free id, starts its heartbeat and registers under
    ``{prefix}/joiners``; :meth:`admit` then waits for the round that takes it in. The members
    notice registrations through the heartbeat thread and, at a step boundary every member agrees
    on (:meth:`join_due`), form that round (:meth:`recover` with ``join=True``).
    """

    def __init__(self, store: Any, prefix: str, *, rank: int | None = None, world_size: int | None = None,
                 backend: str | None = None, interval: float = 0.2, dead_after: float = 10.0,
                 beat_every: float | None = None,
                 link_timeout: float = 3.0, agree_timeout: float = 20.0, max_rounds: int = 4,
                 start_timeout: float = 30.0, on_failure: Callable[[str], None] | None = None,
                 order: Callable[[Sequence[int]], Sequence[int]] | None = None,
                 pg_timeout: datetime.timedelta = datetime.timedelta(seconds=30), joiner: bool = False,
                 fits: Callable[[int], bool] | None = None, secret: JobSecret | None = None) -> None:
        import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

        if interval <= 0 or dead_after <= interval:
            raise ConfigError(f"need 0 < interval < dead_after, got interval={interval}, dead_after={dead_after}")
        beat_every = max(interval, dead_after / 10) if beat_every is None else beat_every
        if not interval <= beat_every < dead_after:
            raise ConfigError(f"need interval <= beat_every < dead_after, got interval={interval}, "
                              f"beat_every={beat_every}, dead_after={dead_after}")
        if joiner:
            if backend is None:
                raise ConfigError("a joiner has no process group yet: pass backend= (gloo or nccl)")
            self.rank, self.world_size, self.backend = -1, 0, backend
        else:
            initialized = dist.is_available() and dist.is_initialized()
            if rank is None or world_size is None or backend is None:
                if not initialized:
                    raise ConfigError("Membership needs rank, world_size and backend, or an initialised default "
                                      "group (call dist.init_process_group first)")
            self.rank = int(dist.get_rank() if rank is None else rank)
            self.world_size = int(dist.get_world_size() if world_size is None else world_size)
            self.backend = str(dist.get_backend() if backend is None else backend)
        self.store, self.prefix = store, prefix.rstrip("/")
        self.secret = (secret if secret is not None else JobSecret.resolve()).scoped(self.prefix)
        self._seq = 0  # this member's heartbeat sequence number
        self._beats: dict[int, tuple[int, frozenset[int]]] = {}  # newest verified heartbeat per member
        self._warned: set[str] = set()  # keys whose bad records were logged
        self.interval, self.dead_after, self.beat_every = interval, dead_after, beat_every
        self.agree_timeout, self.max_rounds = agree_timeout, max_rounds
        self.on_failure, self.order, self.pg_timeout, self.fits = on_failure, order, pg_timeout, fits
        self.id, nonce = -1, uuid.uuid4().hex
        if joiner:  # ids after the first group's ranks, one per joiner ever (the first member set the counter)
            self.id, self.round, self.members = self._take_id(store, nonce), -1, ()
        else:
            self.id, self.round, self.members = self.rank, 0, tuple(range(self.world_size))
            if self._claim(store, self._key("id", self.id), nonce) != nonce:
                log.warning("member %d: its id was claimed before in %s (a restarted member, or the prefix reused)",
                            self.id, self.prefix)
        self.monitor = HeartbeatMonitor(dead_after)
        self._state = _State(watched=tuple(m for m in self.members if m != self.id), members=self.members,
                             round=self.round)
        self._stop = threading.Event()
        self._hb_store = store.clone()  # its own connection: the main thread's blocking waits hold theirs
        # a get of a key deleted under it fails after this, not after the store's timeout (_read)
        self._hb_store.set_timeout(datetime.timedelta(seconds=max(2.0, min(5.0, dead_after / 4))))
        self._links = PeerLinks(self.id, link_host(_store_host(store)), timeout=link_timeout, secret=self.secret)
        self._put(self._hb_store, self._key("link", self.id), self._links.address)  # before the first heartbeat
        self._put_beat(self._hb_store, ())
        for k in ("joiners", "gone"):  # exist before any heartbeat reads them
            self._hb_store.append(self._key(k), "")
        self._failures_seen = self._flags(self._hb_store, self.round)
        news_store = store.clone()  # a record the store cannot take gives up as a heartbeat does, not after 30 s
        news_store.set_timeout(self._hb_store.timeout)
        self._news = _Publisher(news_store, self._add_entry, f"tenplex-news-{self.id}")
        if not joiner:
            if self.rank == 0:  # before any joiner can find this prefix (start_membership publishes it after)
                store.add(self._key("next_id"), self.world_size)
                self._put(store, self._key("round"), "0")
            keys = [self._hb_key(m) for m in self.members]
            try:
                self._hb_store.wait(keys, datetime.timedelta(seconds=start_timeout))
            except RuntimeError as e:
                raise MembershipError(f"not every member of {self.prefix} started its heartbeat within "
                                      f"{start_timeout} s (keys {keys}): {e}") from e
            self._relink(self.members)
        self._thread = threading.Thread(target=self._beat, name=f"tenplex-heartbeat-{self.id}", daemon=True)
        self._thread.start()
        # the links' own thread: a death is news the moment a link ends, even while a store call of the
        # heartbeat thread waits (an etcd write waits out the election after its leader's death)
        self._link_thread = threading.Thread(target=self._watch_links, name=f"tenplex-links-{self.id}", daemon=True)
        self._link_thread.start()
        if joiner:  # heartbeat first: the members watch it from the moment they read the registration
            self._add_entry(store, self._key("joiners"), self.id)
            log.info("joiner %d registered under %s", self.id, self.prefix)

    # -- keys ----------------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def _hb_key(self, member: int) -> str:
        return self._key("hb", member)

    def _failures_key(self, round: int) -> str:
        return self._key(f"round{round}", "failures")  # per round: late flags of a past round are no news

    # -- signed records (job_secret.JobSecret) -------------------------------------------------
    def _put(self, store: Any, key: str, payload: str) -> None:
        store.set(key, self.secret.sign(key, payload))

    def _add_entry(self, store: Any, key: str, payload: object) -> None:
        store.append(key, self.secret.entry(key, str(payload)))

    def _bad(self, key: str, what: str) -> None:
        """Log a record that did not verify (once per key: an outsider cannot flood the log)."""
        if key not in self._warned and len(self._warned) < 1024:
            self._warned.add(key)
            log.warning("member %d: ignored %s under %s: not signed with the job secret (another job, a stale "
                        "launch, or a process that is not part of the job)", self.id, what, key)

    def _open(self, key: str, raw: bytes | str | None) -> str | None:
        """The payload of a signed record read from ``key``; None (logged) when it does not verify."""
        payload = self.secret.open(key, raw)
        if payload is None and raw:
            self._bad(key, "a record")
        return payload

    def _get(self, store: Any, key: str) -> str | None:
        """The verified payload under ``key``; None when there is none or it does not verify."""
        return self._open(key, peek(store, [key])[0])

    def _ids(self, store: Any, key: str, raw: bytes | None = None) -> list[int]:
        """The ids in the signed list at ``key`` (each once, in order of arrival); bad entries logged."""
        raw = peek(store, [key])[0] if raw is None else raw
        if raw is None:
            return []
        good, bad = self.secret.entries(key, raw)
        if bad:
            self._bad(key, f"{bad} list entries")
        out = []
        for g in good:
            if g.lstrip("-").isdigit() and int(g) not in out:
                out.append(int(g))
        return out

    def _claim(self, store: Any, key: str, payload: str) -> str:
        """``compare_set`` a signed record: the first valid one stored under ``key`` wins and its payload
        is returned. A value there that does not verify (an outsider's) is replaced, not obeyed."""
        expected: bytes | str = ""
        for _ in range(16):
            raw = store.compare_set(key, expected, self.secret.sign(key, payload))
            got = self._open(key, raw)
            if got is not None:
                return got
            expected = raw
        raise MembershipError(f"member {self.id}: {key} keeps holding records that are not the job's")

    def _take_id(self, store: Any, nonce: str) -> int:
        """A joiner's id: the next value of ``{prefix}/next_id`` whose signed claim ``{prefix}/id/{id}``
        it wins (a counter that was set back, by mistake or by an outsider, cannot give it the id of
        a member or of another joiner)."""
        for _ in range(64):
            i = int(store.add(self._key("next_id"), 1)) - 1
            if i >= 0 and self._claim(store, self._key("id", i), nonce) == nonce:
                return i
        raise MembershipError(f"a joiner of {self.prefix} found no free member id in 64 tries")

    def _read(self, store: Any, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys`` (:func:`peek`), ``b""`` for keys that are missing: a key deleted
        (by a process that is not part of the job) is no news, not a store failure; RuntimeError only
        when the store itself does not answer."""
        try:
            got = peek(store, keys)
        except RuntimeError:  # c10d's get waits for a key deleted after its check: key by key
            store.check([self._hb_key(self.id)])  # raises when the store is gone
            got = []
            for k in keys:
                try:
                    got.append(peek(store, [k])[0])
                except RuntimeError:
                    store.check([self._hb_key(self.id)])
                    got.append(None)
        missing = [k for k, v in zip(keys, got) if v is None]
        out = [b"" if v is None else v for v in got]
        if missing and "deleted" not in self._warned:
            self._warned.add("deleted")
            log.warning("member %d: keys of the job were deleted (%s): read as empty, no news", self.id, missing)
        return out

    def _flags(self, store: Any, round: int) -> int:
        """How many members flagged a failure in ``round`` (creates its list)."""
        key = self._failures_key(round)
        store.append(key, "")
        return len(self._ids(store, key))

    def _put_beat(self, store: Any, vouch: Sequence[int]) -> None:
        """This member's next heartbeat: its sequence number and the peers its open links vouch for."""
        self._seq += 1
        self._beats[self.id] = (self._seq, frozenset(vouch))
        self._put(store, self._hb_key(self.id), encode_beat(self._seq, vouch))

    def _counters(self, raws: Sequence[bytes], watched: Sequence[int]) -> dict[int, int]:
        """What :class:`HeartbeatMonitor` observes, from the heartbeat records of ``watched``: per member,
        its newest verified sequence number plus those of the members vouching for it. A record that
        does not verify, or one not newer than the last seen (a replay), changes nothing."""
        for m, raw in zip(watched, raws):
            key = self._hb_key(m)
            payload = self._open(key, raw)
            beat = decode_beat(payload) if payload is not None else None
            if beat is not None and beat[0] > self._beats.get(m, (0, frozenset()))[0]:
                self._beats[m] = beat
        beats = self._beats
        return {m: beats.get(m, (0, frozenset()))[0] + sum(s for v, (s, who) in beats.items() if m in who and v != m)
                for m in watched}

    def _relink(self, members: Sequence[int]) -> None:
        """Link to this member's ``link_targets`` in ``members`` (successors at ring distance 1, 2, 4, ...)."""
        targets = link_targets(members, self.id)
        keys = [self._key("link", t) for t in targets]
        try:  # one read (peek: no wait for a key never set)
            raws = peek(self.store, keys)
        except RuntimeError as e:
            log.info("member %d: no link addresses of members %s (%s)", self.id, list(targets), e)
            raws = [None] * len(keys)
        peers: dict[int, str] = {}
        for nxt, key, raw in zip(targets, keys, raws):
            addr = self._open(key, raw)
            if addr:  # without one, its heartbeats (and the other members' links) watch it
                peers[nxt] = addr
        self._links.want(peers)

    def _links_broke(self, peers: frozenset[int]) -> None:
        """Link thread: ``peers``' links ended without a goodbye, so their processes are gone."""
        now = time.monotonic()
        with self._state.lock:
            rnd = self._state.round
            news = sorted(p for p in peers if p in self._state.watched and self.monitor.mark_dead(p, now))
            members = set(self._state.members)
            if news:
                self._state.pending = tuple(j for j in self._state.pending if j not in news)
        if not news:
            return
        for p in news:
            self._news.put(self._key("gone"), p)
        if members & set(news):
            self._fail(f"members {[p for p in news if p in members]} exited or their hosts vanished (their links "
                       f"to member {self.id} ended without a goodbye)", publish=True, round=rnd)
            if self.backend == "nccl":
                self._abort()

    @property
    def joining(self) -> bool:
        """Whether this process is a joiner not admitted yet."""
        return self.id not in self.members

    def pending(self) -> tuple[int, ...]:
        """Joiners registered, alive and not members yet, as the heartbeat thread last saw them."""
        with self._state.lock:
            return self._state.pending

    def join_due(self, step: int, *, propose: bool = True) -> bool:
        """At the boundary after ``step`` (every member, every step): whether the members admit the
        waiting joiners now (then call ``recover(join=True)``). One store call per member and step:
        its vote, ``compare_set`` on the boundary's own record (:func:`join_boundary`); the first vote
        stored decides for all. It is "admit" when that member knows of joiners a layout fits (and
        ``propose``: it wants them in, i.e. a step is left to run), so the joiners come in at the first
        boundary after a member learned of them."""
        record, done = join_boundary(step)
        pending = self.pending()
        admissible = propose and bool(pending) and (self.fits is None or any(
            self.fits(len(self.members) + k) for k in range(1, len(pending) + 1)))
        try:  # a failure learned meanwhile: the vote is given up (the recovery takes the joiners in)
            with _interruptible(self.store, lambda: self.failed):
                due = self._claim(self.store, self._key(f"round{self.round}", record),
                                  "1" if admissible else "0") == "1"
                if done is not None and self.members.index(self.id) == 0:  # no member reads it any more
                    self.store.delete_key(self._key(f"round{self.round}", done))
        except StoreInterrupted as e:
            log.info("member %d (round %d): the boundary after step %d: %s", self.id, self.round, step, e)
            return False
        if due:
            log.info("member %d (round %d): joiners %s admitted after step %d", self.id, self.round, list(pending),
                     step)
        return due

    # -- failure state -------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether this member knows of a failure since its group formed."""
        return self._state.failed_at is not None

    def linked(self) -> frozenset[int]:
        """Members this member holds an open link to (their processes exist; it vouches for them)."""
        return self._links.linked()

    def dead(self) -> frozenset[int]:
        """Member ids the heartbeats found dead (ever)."""
        with self._state.lock:
            return frozenset(self.monitor.dead)

    def _fail(self, reason: str, *, publish: bool, round: int | None = None) -> None:
        """Record the first failure of the current round (``round``: the one it was seen in; a
        failure seen in a round that has been replaced meanwhile is no news and is dropped)."""
        first = False
        with self._state.lock:
            if round is not None and round != self._state.round:
                return
            round = self._state.round
            if self._state.failed_at is None:
                self._state.failed_at, self._state.failed_mono = time.time(), time.monotonic()
                self._state.reason = reason
                first = True
        if first:
            log.warning("member %d (round %d): failure: %s", self.id, self.round, reason)
            if publish:
                self._news.put(self._failures_key(round), self.id)
            if self.on_failure is not None:
                try:
                    self.on_failure(reason)
                except Exception:  # a callback's bug must not kill the heartbeat
                    log.exception("on_failure callback raised")

    def check(self) -> None:
        """Raise PeerFailure if a failure is known (call between steps)."""
        if self._state.failed_at is not None:
            raise PeerFailure(f"member {self.id} (round {self.round}): {self._state.reason}")

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run collectives: a peer error they raise becomes PeerFailure, flagged to all members, and
        the broken group is destroyed right away (gloo: its closed connections fail the collectives
        of peers blocked on this member, which an abort would not)."""
        self.check()
        try:
            yield
        except PeerFailure:
            raise
        except RuntimeError as e:
            if not (is_peer_error(e) or self.failed):
                raise
            self._fail(f"collective failed: {str(e).splitlines()[0][:300]}", publish=True)
            self.destroy_group()  # at once: closing its connections fails the peers blocked on this member
            raise PeerFailure(f"member {self.id} (round {self.round}): a collective failed: {e}") from e

    # -- heartbeat thread ----------------------------------------------------------------------
    def _beat(self) -> None:
        store = self._hb_store
        st = self._state
        next_tick = time.monotonic() + self.interval
        write_at = time.monotonic() + self.beat_every  # the first heartbeat was written at the start
        while True:
            if self._stop.wait(max(0.0, next_tick - time.monotonic())):
                return
            now = time.monotonic()
            next_tick = max(next_tick + self.interval, now)
            try:
                with st.lock:
                    watched, rnd, baseline = st.watched, st.round, self._failures_seen
                if now >= write_at - self.interval / 2:  # the tick nearest to the write's time
                    write_at = max(write_at + self.beat_every, now)
                    self._put_beat(store, self._links.linked() & set(watched))  # open links: those processes exist
                gkey, jkey, fkey = self._key("gone"), self._key("joiners"), self._failures_key(rnd)
                vals = self._read(store, [*(self._hb_key(m) for m in watched), gkey, jkey, fkey])
                failures = len(self._ids(store, fkey, vals[-1]))
                # deaths others' links saw
                link_deaths = self._ids(store, gkey, vals[-3]) if failures > baseline else []
                registered = self._ids(store, jkey, vals[-2]) if vals[-2] != st.joiners_raw else None
            except RuntimeError as e:
                if self._stop.is_set():
                    return
                self._fail(f"the membership store is unreachable: {e}", publish=False)
                continue
            now = time.monotonic()
            with st.lock:
                if st.round != rnd:  # a recovery formed a new group while the store answered
                    continue
                seen = self._counters(vals[:len(watched)], watched)
                last = {m: self.monitor.last_alive(m) for m in watched}
                silent = self.monitor.observe(now, seen)
                exited = {g for g in link_deaths if g in watched and self.monitor.mark_dead(g, now)}
                found = silent | exited
                newly = found & set(st.members)  # a death in the group is a failure ...
                gone = found - newly  # ... one of a joiner not admitted yet is not: it is just left out
                if gone:
                    st.pending = tuple(j for j in st.pending if j not in gone)
                    st.watched = tuple(w for w in st.watched if w not in gone)
                    log.warning("member %d: joiners %s stopped their heartbeats before being admitted", self.id,
                                sorted(gone))
                if registered is not None:
                    st.joiners_raw = vals[-2]
                    fresh = tuple(j for j in registered if j != self.id and j not in st.members
                                  and j not in self.monitor.dead and j not in st.pending)
                    if fresh:
                        log.info("member %d: joiners %s registered", self.id, list(fresh))
                    st.pending += fresh
                    st.watched += tuple(j for j in fresh if j not in st.watched)
                if newly and st.failed_at is None:
                    st.detect_s = max(now - (last[m] or now) for m in newly)
            if newly:
                why = [f"members {sorted(newly & silent)} stopped their heartbeats"] if newly & silent else []
                why += [f"members {sorted(newly & exited)} exited or their hosts vanished (a link to them ended)"] \
                    if newly & exited else []
                self._fail("; ".join(why), publish=True, round=rnd)
                if self.backend == "nccl":
                    self._abort()
            elif failures > baseline and not self.failed:
                self._fail("another member flagged a failure", publish=False, round=rnd)
                if self.backend == "nccl":
                    self._abort()

    def _watch_links(self) -> None:
        """Link thread: poll the links (connect the wanted ones, answer handshakes) until stopped."""
        st = self._state
        while not self._stop.is_set():
            broken = self._links.poll(self.interval)  # returns at once when a link breaks
            if self._stop.is_set():
                return
            if broken:
                self._links_broke(broken)
            now = time.monotonic()
            with st.lock:  # linked peers live now: a death is dated from here, not from their last beat
                self.monitor.alive(self._links.linked() & set(st.watched), now)

    def _abort(self) -> None:
        """nccl: abort the communicators so that a blocked collective returns (not gloo: no effect)."""
        import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

        try:
            # private torch API, the documented way to abort nccl communicators in torch 2.x
            dist.distributed_c10d._abort_process_group()
        except (RuntimeError, ValueError, AssertionError) as e:
            log.warning("aborting the process group failed: %s", e)

    def close(self) -> None:
        """Stop the heartbeat and say goodbye on the links (then, its counter still, the others
        find this member dead after ``dead_after``; its goodbyes are no death)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 1)
        self._link_thread.join(timeout=5 * self.interval + 1)  # PeerLinks: one thread polls, then this one closes
        self._news.close(timeout=5 * self.interval + 1)
        self._links.close()  # goodbyes: the others do not take this member's exit for a death

    # -- recovery ------------------------------------------------------------------------------
    def destroy_group(self) -> None:
        """Drop the broken default group without exiting (nccl: abort its communicators first).

        Destroying a gloo group closes its connections: peers blocked on this member fail at once.
        """
        import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            self._abort()
            return
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError) as e:
            log.warning("destroying the process group failed: %s", e)

    def agree(self, round: int, candidates: Sequence[int], previous: Sequence[int] | None = None) -> Decision:
        """Join round ``round`` and return its decision (the store's first proposal).

        ``previous``: the ids holding state (default ``candidates``); registered joiners not among
        them are proposed after the survivors (:func:`propose`)."""
        store = self.store
        previous = tuple(candidates if previous is None else previous)
        base = self._key(f"round{round}")
        self._add_entry(store, f"{base}/joined", self.id)
        deadline = time.monotonic() + self.agree_timeout
        dkey = f"{base}/decision"
        jkey, rkey, gkey = f"{base}/joined", self._key("joiners"), self._key("gone")
        while True:
            raw = peek(store, [dkey, jkey, rkey, gkey])  # one read where the store can
            stored = self._open(dkey, raw[0])
            if stored is not None:
                d = decode_decision(stored)
                break
            joined = self._ids(store, jkey, raw[1] or b"")
            joiners = [j for j in self._ids(store, rkey, raw[2] or b"") if j not in previous]
            dead = self.dead() | set(self._ids(store, gkey, raw[3] or b""))  # a broken link's news before the
            # heartbeat thread reads it
            members = propose(candidates, joined, dead, self.order, joiners=joiners, fits=self.fits)
            if members is not None:
                d = decode_decision(self._claim(store, dkey, encode_decision(Decision(round, members, previous))))
                break
            if time.monotonic() > deadline:
                waiting = [c for c in candidates if c not in set(joined) and c not in dead]
                raise MembershipError(f"member {self.id}: round {round} did not decide within {self.agree_timeout} s; "
                                      f"members {waiting} neither joined nor stopped their heartbeats")
            time.sleep(0.01)
        if d.round != round:
            raise MembershipError(f"round {round}'s decision names round {d.round}; the store is shared by another job "
                                  f"(use a prefix of its own)")
        log.info("member %d: round %d decided: %s", self.id, round, list(d.members))
        return d

    def wait_decision(self, round: int, timeout: float) -> Decision:
        """The decision of round ``round`` once a member stored it (a joiner takes no part in the
        agreement: it holds no state and does not know the layout); MembershipError after ``timeout``."""
        dkey = self._key(f"round{round}", "decision")
        deadline = time.monotonic() + timeout
        while (stored := self._get(self.store, dkey)) is None:  # a record that does not verify is no decision
            if time.monotonic() > deadline:
                raise MembershipError(f"joiner {self.id}: no decision of round {round} within {timeout:.0f} s")
            time.sleep(0.02)
        d = decode_decision(stored)
        if d.round != round:
            raise MembershipError(f"round {round}'s decision names round {d.round}; the store is shared by another job "
                                  f"(use a prefix of its own)")
        return d

    def regroup(self, d: Decision) -> None:
        """Form the default group of decision ``d``; MembershipError (retry a round) when one of
        its members dies first."""
        import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

        base = self._key(f"round{d.round}")
        new_rank = d.members.index(self.id)
        store = self.store
        with self._state.lock:  # joiners and (for a joiner) the members: a death before the group forms is seen
            self._state.watched += tuple(m for m in d.members if m != self.id and m not in self._state.watched)
        self._put(store, f"{base}/ready/{self.id}", "1")
        deadline = time.monotonic() + self.agree_timeout
        keys = [f"{base}/ready/{m}" for m in d.members]
        while not all(v is not None and self._open(k, v) == "1" for k, v in zip(keys, peek(store, keys))):
            # every member ready (signed: an outsider's key is not), or one of them dead: never a blind wait
            gone = self.dead() & set(d.members)
            if gone:
                raise MembershipError(f"members {sorted(gone)} of round {d.round} died before its group formed")
            if time.monotonic() > deadline:
                raise MembershipError(f"round {d.round}: not every member was ready within {self.agree_timeout} s")
            time.sleep(0.01)
        try:  # every member is in: the group's rendezvous waits no longer than they take to connect
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"{base}/pg", store), rank=new_rank,
                                    world_size=len(d.members), timeout=self.pg_timeout)
            dev = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
            one = torch.ones(1, device=dev)
            dist.all_reduce(one)  # every member formed the group
            if int(one.item()) != len(d.members):
                raise MembershipError(f"round {d.round}: the check all_reduce gave {one.item()}, not {len(d.members)}")
        except RuntimeError as e:
            self.destroy_group()
            raise MembershipError(f"round {d.round}: the group of {list(d.members)} did not form: {e}") from e

    def recover(self, *, join: bool = False) -> NewMembership:
        """After a failure (or, ``join=True``, at the boundary :meth:`join_due` agreed): destroy
        the group, agree on the next round (the live members, then the live joiners), form its group.

        Raises MembershipError when this member is left out of the decision, when ``max_rounds``
        rounds do not form a group, or when a round does not decide in time.
        """
        t0 = time.monotonic()
        if self._state.failed_at is None and not join:
            self._fail("recover() called", publish=True)
        st = self._state
        failed_at = st.failed_at if st.failed_at is not None else time.time()
        self.destroy_group()
        return self._form(self.members, self.round + 1, t0, failed_at)

    def admit(self, timeout: float) -> NewMembership:
        """A joiner: wait up to ``timeout`` seconds for a round whose decision takes it in (the
        members' next join boundary, or a recovery from a failure), then form its group."""
        t0 = time.monotonic()
        failed_at = time.time()
        deadline = t0 + timeout
        rkey = self._key("round")
        try:
            self.store.wait([rkey], datetime.timedelta(seconds=max(0.1, timeout)))
        except RuntimeError as e:
            raise MembershipError(f"joiner {self.id}: {self.prefix} has no current round: {e}") from e
        while (cur := self._open(rkey, self.store.get(rkey))) is None or not cur.isdigit():
            if time.monotonic() > deadline:
                raise MembershipError(f"joiner {self.id}: {rkey} holds no round signed with the job secret")
            time.sleep(0.05)
        n = int(cur) + 1  # a stale value only means reading decisions already taken
        while True:
            d = self.wait_decision(n, deadline - time.monotonic())
            if self.id in d.members:
                break
            log.info("joiner %d: round %d formed without it (%s); waiting for round %d", self.id, n, list(d.members),
                     n + 1)
            n += 1
        return self._form(d.previous or d.members, n, t0, failed_at, decided=d)

    def _form(self, previous: tuple[int, ...], first_round: int, t0: float, failed_at: float,
              decided: Decision | None = None) -> NewMembership:
        """Rounds from ``first_round`` until one forms its group (``decided``: the first round's
        decision, already read). ``previous``: the ids holding state, by their rank."""
        st = self._state
        candidates = previous
        t_decided = t0
        for n in range(first_round, first_round + self.max_rounds):
            if decided is not None:
                d, decided = decided, None
            else:
                try:
                    d = self.agree(n, candidates, previous) if self.id in previous else \
                        self.wait_decision(n, self.agree_timeout)
                except MembershipError:
                    raise
                except RuntimeError as e:  # the store itself failed (DistStoreError ...)
                    raise MembershipError(f"member {self.id}: round {n}: the membership store failed: {e}") from e
            t_decided = time.monotonic()
            if self.id not in d.members:
                self.close()
                raise MembershipError(f"member {self.id} was left out of round {n} ({list(d.members)}): the others "
                                      f"found it dead; restart it as a new member")
            try:
                self.regroup(d)
            except MembershipError as e:
                log.warning("member %d: %s; trying round %d", self.id, e, n + 1)
                candidates = d.survivors
                continue
            t_end = time.monotonic()
            alive = old_ranks(previous, d.survivors)
            self.round, self.members = n, d.members
            with st.lock:
                detect_s = st.detect_s
                if st.failed_mono is not None and st.detect_s == 0.0:
                    gone = set(previous) - set(d.members)
                    seen = [self.monitor.last_alive(m) for m in gone]
                    seen_at = [s for s in seen if s is not None]
                    detect_s = max(0.0, st.failed_mono - min(seen_at)) if seen_at else 0.0
                st.members = d.members
                st.pending = tuple(j for j in st.pending if j not in d.members)
                st.watched = tuple(m for m in d.members if m != self.id) + st.pending
                st.failed_at = st.failed_mono = None
                st.reason, st.detect_s, st.round = "", 0.0, n
                self._failures_seen = self._flags(self.store, n)
            self._relink(d.members)
            if d.members.index(self.id) == 0:  # where a joiner starts looking for the round that admits it
                self._put(self.store, self._key("round"), str(n))
            res = NewMembership(n, d.members, alive, d.members.index(self.id), len(d.members), failed_at, detect_s,
                                t_decided - t0, t_end - t_decided,
                                n - first_round + 1, self.dead(), d.joiners)
            log.info("member %d: round %d formed: new rank %d of %d (old ranks %s, joiners %s); detect %.3fs "
                     "agree %.3fs regroup %.3fs", self.id, n, res.new_rank, res.world_size, list(alive),
                     list(d.joiners), res.detect_s, res.agree_s, res.regroup_s)
            return res
        raise MembershipError(f"member {self.id}: {self.max_rounds} rounds from {first_round} formed no group")


# ---------------------------------------------------------------------------------------------
# the job's store and prefix
# ---------------------------------------------------------------------------------------------
def membership_store(timeout_s: float = 30.0) -> Any:
    """A client of the job's long-lived store named by ``TENPLEX_MEMBERSHIP_STORE``: ``host:port`` (a
    ``TCPStore``), or ``etcd://host:port,host:port,...`` (an :class:`~tenplex.elastic.etcd_store.EtcdStore`
    over a replicated etcd cluster, this host's member first: no single point of failure; over TLS
    with the files ``TENPLEX_ETCD_CA_FILE`` / ``_CERT_FILE`` / ``_KEY_FILE`` name)."""
    import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

    from .etcd_store import ETCD_SCHEME, EtcdStore, EtcdTLS  # lazy: a torch.distributed.Store subclass

    spec = os.environ.get(MEMBERSHIP_STORE_ENV, "")
    if spec.startswith(ETCD_SCHEME):
        return EtcdStore.from_spec(spec, timeout=datetime.timedelta(seconds=timeout_s), tls=EtcdTLS.from_env())
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--in-process needs {MEMBERSHIP_STORE_ENV}=host:port (or etcd://host:port,...), a c10d "
                          f"store that outlives every worker (the standalone rendezvous store: torchrun's "
                          f"--rdzv-endpoint with is_host=false; or an etcd cluster); got {spec!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def job_key() -> str:
    """What names this job in the membership store, for joiners to find it: ``TENPLEX_JOB_ID``,
    else torchrun's run id, else the bootstrap address ``MASTER_ADDR:MASTER_PORT`` (the same
    in every worker and joiner of one job started with env://)."""
    for name in (JOB_ENV, "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise ConfigError(f"cannot name the job for joiners: set {JOB_ENV} (or MASTER_ADDR and MASTER_PORT)")
    return f"{addr}:{port}"


def start_membership(store: Any, *, interval: float = 0.1, dead_after: float = 10.0,
                     secret: JobSecret | None = None) -> Membership:
    """Every rank of the default group: a Membership under a prefix fresh for this group (a nonce
    from rank 0), so a restarted job never reads a previous launch's keys. Rank 0 then publishes
    the prefix under the job's key (:func:`job_key`) for joiners, signed. ConfigError on every rank
    when a rank's job secret (default: :meth:`JobSecret.resolve`) differs from rank 0's: its records
    would not verify, and the others would take it for dead."""
    import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

    secret = secret if secret is not None else JobSecret.resolve()
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, secret.fingerprint())
    other = [r for r, f in enumerate(prints) if f != prints[0]]
    if other:  # every rank refuses: none waits for members whose records it could not verify
        raise ConfigError(f"ranks {other} hold another job secret than rank 0 (rank {dist.get_rank()}'s: "
                          f"{secret.source}); give every worker the same TENPLEX_STORE_TOKEN (or token file)")
    box = [f"tenplex/inproc/{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    prefix = box[0]
    m = Membership(store, str(prefix), interval=interval, dead_after=dead_after, agree_timeout=20.0,
                   pg_timeout=datetime.timedelta(seconds=30), secret=secret)
    if dist.get_rank() == 0:
        key = f"{JOBS_KEY}/{job_key()}"
        store.set(key, secret.scoped(JOBS_KEY).sign(key, str(prefix)))
    return m


def join_membership(store: Any, backend: str, *, timeout_s: float, interval: float = 0.1,
                    dead_after: float = 10.0, secret: JobSecret | None = None) -> Membership:
    """A joiner: wait up to ``timeout_s`` for the job (:func:`job_key`) to publish its membership
    prefix (signed with the job secret), then register in it (``Membership(joiner=True)``);
    MembershipError when none appears."""
    secret = secret if secret is not None else JobSecret.resolve()
    key = f"{JOBS_KEY}/{job_key()}"
    deadline = time.monotonic() + timeout_s
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        while (prefix := secret.scoped(JOBS_KEY).open(key, store.get(key))) is None:
            if time.monotonic() > deadline:
                raise MembershipError(f"job {job_key()!r}: {key} holds no prefix signed with this joiner's job secret "
                                      f"({secret.source}); give it the job's TENPLEX_STORE_TOKEN")
            time.sleep(0.1)
    except RuntimeError as e:
        raise MembershipError(f"no running job {job_key()!r} published its membership within {timeout_s:.0f} s "
                              f"(key {key}): {e}") from e
    return Membership(store, prefix, backend=backend, interval=interval, dead_after=dead_after, agree_timeout=20.0,
                      pg_timeout=datetime.timedelta(seconds=30), joiner=True, secret=secret)
