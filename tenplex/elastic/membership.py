"""The membership protocol of in-process recovery (issue #18, items 1-2, 4): pure, no I/O.

What every member decides from what it observed: which members are dead (:class:`HeartbeatMonitor`,
the caller passes the clock), who is in the next group (:func:`propose`, :class:`Decision` and its
store encoding), the old ranks of the new group's members (:func:`old_ranks`), the step boundary
joiners are admitted at (:func:`join_boundary`) and whether a collective's error is a peer's death
(:func:`is_peer_error`). The store, heartbeat thread and process groups that act on it are
:class:`tenplex.elastic.membership_runtime.Membership` (its docstring describes the whole mechanism).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, MembershipError

__all__ = ["NewMembership", "Decision", "HeartbeatMonitor", "propose", "link_targets", "encode_decision",
           "decode_decision", "old_ranks", "join_boundary", "parse_joined", "is_peer_error", "PEER_ERROR_MARKERS"]

#: Substrings of collective errors that mean a peer died or a connection broke (gloo, nccl).
PEER_ERROR_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                      "socket", "peer")


# ---------------------------------------------------------------------------------------------
# pure parts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NewMembership:
    """The group a recovery formed.

    ``round``: its number (the first group is round 0); ``members``: member ids (ranks in round
    0) by new rank; ``alive``: for each new rank, its rank in the previous group (what
    ``migrate(alive=...)`` takes); ``new_rank`` / ``world_size``: this process in the new group;
    ``joiners``: ids of the fresh members admitted in this round (they hold no state; they follow
    the survivors, so group rank ``len(alive) + j`` is ``joiners[j]``); ``failed_at``:
    ``time.time()`` when this process first learned of the failure (or of the join); timings in
    seconds: ``detect_s`` (from the dead peer last seen alive, its heartbeat moving or a link to it
    open, to that moment; 0 when no peer was found dead), ``agree_s`` (recovery start to decision),
    ``regroup_s`` (decision to a group that answered an all_reduce); ``rounds_tried``: rounds this
    recovery used.
    """

    round: int
    members: tuple[int, ...]
    alive: tuple[int, ...]
    new_rank: int
    world_size: int
    failed_at: float
    detect_s: float
    agree_s: float
    regroup_s: float
    rounds_tried: int = 1
    dead: frozenset[int] = frozenset()
    joiners: tuple[int, ...] = ()  # ids of fresh members (no state): group ranks len(alive) and up


@dataclass(frozen=True, slots=True)
class Decision:
    """The members of round ``round`` by new rank (ids), as stored under its decision key.

    ``previous``: the ids holding state going into the round, by their rank in that group (what a
    joiner needs to tell survivors' old ranks); members not in it are fresh joiners."""

    round: int
    members: tuple[int, ...]
    previous: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members):
            raise MembershipError(f"decision of round {self.round} lists a member twice: {list(self.members)}")
        if self.previous:
            held = [m in self.previous for m in self.members]
            if held != sorted(held, reverse=True):
                raise MembershipError(f"decision of round {self.round}: members {list(self.members)} must list the "
                                      f"state holders {list(self.previous)} before the joiners")

    @property
    def survivors(self) -> tuple[int, ...]:
        """Members that hold state (in ``previous``), by new rank; every member when ``previous`` is empty."""
        return tuple(m for m in self.members if not self.previous or m in self.previous)

    @property
    def joiners(self) -> tuple[int, ...]:
        """Fresh members (not in ``previous``), by new rank."""
        return self.members[len(self.survivors):]


def propose(candidates: Sequence[int], joined: Iterable[int], dead: Iterable[int],
            order: Callable[[Sequence[int]], Sequence[int]] | None = None,
            joiners: Iterable[int] = (), fits: Callable[[int], bool] | None = None) -> tuple[int, ...] | None:
    """The members to propose for a round, or None while a candidate is still neither joined nor dead.

    ``candidates``: the previous round's members by rank (they hold state); ``joined``: ids that
    joined this round; ``dead``: ids this member's heartbeats found dead; ``joiners``: fresh ids
    asking to join (no state, in order of arrival). Proposed: the joined, live candidates in
    candidate order followed by the live joiners that are not candidates, then ``order`` (given and
    returning those ids) applied, the candidates kept before the joiners (a joiner holds nothing:
    group ranks of survivors come first, as ``tenplex.elastic.migrate.migrate`` wants). Ids of ``joined``
    that are not candidates (late or unknown) are ignored; joiners alone (no live candidate) form
    no round: there would be no state. ``fits(n)``: whether a group of n can run (a layout fits);
    the last joiners are left out until it does (they wait for a later round), the survivors never
    are. Pure.
    """
    cand = list(candidates)
    j, d = set(joined), set(dead)
    if any(c not in j and c not in d for c in cand):
        return None
    members = [c for c in cand if c in j and c not in d]
    if not members:
        return None
    fresh: list[int] = []
    for x in joiners:
        if x not in d and x not in cand and x not in fresh:
            fresh.append(int(x))
    while fresh and fits is not None and not fits(len(members) + len(fresh)):
        fresh.pop()
    members += fresh
    if order is not None:
        ordered = [int(x) for x in order(members)]
        if sorted(ordered) != sorted(members):
            raise ConfigError(f"order must return the members it was given in some order: {members} -> {ordered}")
        held = set(cand)
        members = [x for x in ordered if x in held] + [x for x in ordered if x not in held]
    return tuple(members)


def link_targets(members: Sequence[int], me: int) -> tuple[int, ...]:
    """The members ``me`` opens liveness links to: its successors in ``members`` at ring distance 1,
    2, 4, ... (below the group's size). Each member is then linked with up to 2 log2(n) others, and
    in a group of up to 4 with every other one: most members learn of a death from their own link
    within milliseconds, not from the store's news (and the store may be what died with the host:
    an etcd cluster electing a new leader holds its writes 0.15-0.3 s). A plain ring (distance 1
    alone) left a member of 4 two links short, learning from the store or a failed collective."""
    if me not in members or len(members) < 2:
        return ()
    at, n = list(members).index(me), len(members)
    out: list[int] = []
    d = 1
    while d < n:
        peer = members[(at + d) % n]
        if peer not in out:
            out.append(peer)
        d *= 2
    return tuple(out)


def old_ranks(previous: Sequence[int], members: Sequence[int]) -> tuple[int, ...]:
    """For each new rank, the rank its member had in the group ``previous`` (ids by rank). Pure."""
    index = {m: i for i, m in enumerate(previous)}
    missing = [m for m in members if m not in index]
    if missing:
        raise MembershipError(f"members {missing} were not in the previous group {list(previous)}")
    return tuple(index[m] for m in members)


def encode_decision(d: Decision) -> str:
    """The store value of a decision (JSON)."""
    return json.dumps({"round": d.round, "members": list(d.members), "previous": list(d.previous)})


def decode_decision(raw: bytes | str) -> Decision:
    """A decision read back from the store; MembershipError when it is not one."""
    try:
        obj = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return Decision(int(obj["round"]), tuple(int(x) for x in obj["members"]),
                        tuple(int(x) for x in obj.get("previous", ())))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MembershipError(f"the store holds no valid membership decision ({raw!r}): {e}") from e


def parse_joined(raw: bytes | str) -> list[int]:
    """Ids appended as ``"id,"`` to a round's joined key, in order of arrival."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [int(x) for x in text.split(",") if x.strip()]


def join_boundary(step: int) -> tuple[str, str | None]:
    """(the record of ``step``'s boundary, the record no member reads any more) (pure). Every member
    ``compare_set`` s its vote on the boundary's own record ("1": admit the waiting joiners now) and
    obeys the first vote stored, so all admit them at the same boundary, the first one after a member
    that reaches it knows of them. The record two boundaries back can go: the members are at most one
    step apart (each step ends with a collective over the whole group), so every one voted there."""
    if type(step) is not int or step < 0:
        raise MembershipError(f"a step boundary is an integer >= 0, got {step!r}")
    return f"join_at/{step}", (f"join_at/{step - 2}" if step >= 2 else None)


def is_peer_error(e: BaseException) -> bool:
    """Whether a collective's exception says a peer died or a connection broke."""
    import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

    if isinstance(e, dist.DistError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in msg for m in PEER_ERROR_MARKERS)


class HeartbeatMonitor:
    """Which members are dead, from counters observed over time (pure: the caller passes the clock).

    A member is dead once its counter has not changed for ``dead_after`` seconds of observation.
    When the observer itself stalls (two observations more than ``dead_after / 2`` apart: its
    thread was starved or descheduled, its store call slow), the gap is not held against the
    others: their last-change times move forward by it, since a stalled observer cannot tell
    whether they beat meanwhile.
    """

    def __init__(self, dead_after: float) -> None:
        if dead_after <= 0:
            raise ConfigError(f"dead_after must be positive, got {dead_after}")
        self.dead_after = dead_after
        self.last_value: dict[int, int] = {}
        self.last_change: dict[int, float] = {}
        self.dead: dict[int, float] = {}  # id -> time found dead
        self.last_observe: float | None = None

    def observe(self, now: float, counters: Mapping[int, int]) -> frozenset[int]:
        """Record ``counters`` seen at ``now``; the ids newly found dead."""
        if self.last_observe is not None and now - self.last_observe > self.dead_after / 2:
            gap = now - self.last_observe
            for k in self.last_change:
                self.last_change[k] += gap
        self.last_observe = now
        newly: set[int] = set()
        for k, v in counters.items():
            if k in self.dead:
                continue
            if self.last_value.get(k) != v:
                self.last_value[k] = v
                self.last_change[k] = now
            elif now - self.last_change[k] > self.dead_after:
                self.dead[k] = now
                newly.add(k)
        return frozenset(newly)

    def alive(self, members: Iterable[int], now: float) -> None:
        """Record ``members`` alive at ``now`` by other evidence than their counters (an open link to
        them): their silence counts from ``now`` and :meth:`last_alive` says ``now``."""
        for k in members:
            if k not in self.dead and k in self.last_change:
                self.last_change[k] = max(self.last_change[k], now)

    def mark_dead(self, member: int, now: float) -> bool:
        """Record ``member`` dead by other evidence (its link broke); whether that is news."""
        if member in self.dead:
            return False
        self.dead[member] = now
        return True

    def last_alive(self, member: int) -> float | None:
        """When ``member`` was last seen alive: its counter moving, or :meth:`alive` (observer clock)."""
        return self.last_change.get(member)
