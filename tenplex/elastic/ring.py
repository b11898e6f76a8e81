"""The in-memory state ring of in-process recovery: the last consistent states of this rank.

:class:`StateRing` keeps CPU copies of this rank's state after the last few steps (plus the last
step checkpointed on every rank), so that the survivors of a failure always share a step to move
live (``tenplex.elastic.rescale(live=...)``). :class:`HeldAs` says what those states are (the
layout they were taken under, the rank and save id they are written as), set together with them.
:func:`flush_ring` writes the newest ones to storage when the process is told to stop
(:func:`exit_on_sigterm`): a restarted job resumes from the newest step every worker completed,
not from the last periodic checkpoint. Used by the reference trainer and by a torch-native job
alike (docs/inprocess.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import ConfigError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout

__all__ = ["StateRing", "HeldAs", "RingWriter", "flush_ring", "exit_on_sigterm"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldAs:
    """What the states of a :class:`StateRing` are: ``layout``, the layout they were taken under
    (a ``ParallelConfig``, or a torch-native job's ``StateLayout`` with ``ptc``, its collection from
    ``describe_state_dict``); ``rank``, this process's rank (>= the layout's world size: a spare,
    holding nothing); ``save_id``, the attempt id
    every rank of that layout writes them under (``default_save_id``)."""

    layout: Union[ParallelConfig, StateLayout]
    rank: int
    save_id: str
    ptc: PTC | None = None

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 0:  # a spare's rank is beyond the layout's ranks
            raise ConfigError(f"rank must be an integer >= 0, got {self.rank!r}")
        if isinstance(self.layout, StateLayout) and self.ptc is None:
            raise ConfigError("a StateLayout's states need their collection: pass ptc= (describe_state_dict)")


class StateRing:
    """The last ``keep`` consistent states of this rank by step: CPU copies, either taken after a
    step completed (``record``, buffers reused) or made in the pipeline bubbles of the next step
    by a ``tenplex.elastic.bubbles.SnapshotTask`` with ``keep`` buffer sets (``adopt``/``release``; see
    ``ring_in_bubbles``). Survivors of a failure differ by at most one completed step (a rank
    cannot finish step k+1's all-reduce without every rank in it), so ``keep=2`` always leaves a
    step all of them hold; ``keep=3`` leaves two, one of them while the newest step's save may
    still be on its way to the stores.

    ``pin(step)`` keeps one step beyond the ring until another is pinned: the step of the last
    checkpoint complete on every rank, so that pieces only a dead rank held can be read from it at
    a step the survivors still hold. A torch-native job pins a recorded step after its synchronous
    save. The trainer writes in the background and cannot know when the others' writes finished:
    it holds (``hold``) the copy each write got (no new copy) until the step's all-reduce says every
    rank finished it (``confirm``: the oldest held step becomes the pinned one). A dead rank's
    write may still be under way after the survivors completed the next steps (the ring moved
    past the step before it); the pinned step is then the one the checkpoint has. Memory: the
    pinned state plus at most the held ones the writers had anyway (a rank starts a write only
    after its previous one finished)."""

    def __init__(self, keep: int = 3) -> None:
        if keep < 2:
            raise ConfigError(f"the state ring must keep at least 2 steps, got {keep}")
        self.keep = keep
        self._states: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._adopted: set[int] = set()  # steps whose buffers belong to a SnapshotTask, never reused here
        self._pinned: tuple[int, dict[str, Any]] | None = None
        self._held: OrderedDict[int, dict[str, Any]] = OrderedDict()  # written, not yet confirmed everywhere
        #: what the states are (layout, rank, save id): set with them, so that a flush or a recovery
        #: never pairs them with a later layout or rank
        self.held_as: HeldAs | None = None

    def record(self, step: int, state: Mapping[str, Any]) -> None:
        """Copy the state after ``step``: its tensors (into a dropped step's buffers when they fit;
        never into the pinned step's or a snapshot task's), its other values as they are."""
        if step in self._states:
            return
        reuse: dict[str, Any] = {}
        while len(self._states) >= self.keep:
            old, dropped = self._states.popitem(last=False)
            kept = [*self._held.values(), *([self._pinned[1]] if self._pinned is not None else [])]
            if old not in self._adopted and all(dropped is not st for st in kept):
                reuse = dropped
            self._adopted.discard(old)
        out: dict[str, Any] = {}
        for name, t in state.items():
            b = reuse.get(name)
            if not isinstance(t, torch.Tensor):
                out[name] = t
            elif isinstance(b, torch.Tensor) and b.shape == t.shape and b.dtype == t.dtype:
                out[name] = b.copy_(t.detach())
            else:
                out[name] = t.detach().to("cpu", copy=True)
        self._states[step] = out

    def adopt(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep the state after ``step`` as given, without a copy: a ``SnapshotTask``'s host buffers,
        filled in the pipeline bubbles of the next step (its ``on_complete``); they stay valid
        until ``release`` is called for them."""
        self._states.pop(step, None)
        while len(self._states) >= self.keep:
            self._adopted.discard(self._states.popitem(last=False)[0])
        self._states[step] = dict(state)
        self._adopted.add(step)

    def release(self, step: int, buffers: Mapping[str, Any]) -> None:
        """Forget the states held in ``buffers``: a ``SnapshotTask`` is about to overwrite them with
        ``step``'s state (its ``on_begin``)."""
        ptrs = {t.data_ptr() for t in buffers.values() if isinstance(t, torch.Tensor)}
        for s in [s for s, st in self._states.items()
                  if any(isinstance(t, torch.Tensor) and t.data_ptr() in ptrs for t in st.values())]:
            del self._states[s]
            self._adopted.discard(s)

    def pin(self, step: int, state: Mapping[str, Any] | None = None) -> None:
        """Keep step ``step`` until the next pin: the recorded state, or ``state`` (a copy nothing
        changes any more). ConfigError when neither is there."""
        if state is None:
            if step not in self._states or step in self._adopted:
                raise ConfigError(f"step {step} is not in the state ring as a recorded step (recorded: "
                                  f"{sorted(set(self._states) - self._adopted)}): record it first or pass its state")
            state = self._states[step]
        self._pinned = (step, state if isinstance(state, dict) else dict(state))  # the same dict: never reused

    def hold(self, step: int, state: Mapping[str, Any]) -> None:
        """Keep ``state``, the copy of step ``step`` a write to storage got, until ``confirm``
        (a step held already keeps its first copy)."""
        self._held.setdefault(step, state if isinstance(state, dict) else dict(state))

    @property
    def oldest_held(self) -> int | None:
        """The held step the next ``confirm`` pins (None: none held)."""
        return next(iter(self._held), None)

    def confirm(self) -> None:
        """Every rank finished writing the oldest held step: it becomes the pinned step."""
        if self._held:
            self.pin(*self._held.popitem(last=False))

    def states(self) -> dict[int, dict[str, Any]]:
        """Every state this rank holds by step: the ring's, the pinned one, the held ones."""
        out = dict(self._states)
        if self._pinned is not None:
            out.setdefault(*self._pinned)
        for step, st in self._held.items():
            out.setdefault(step, st)
        return out

    def clear(self) -> None:
        """Forget every state and what they were taken as (a recovery starts the ring afresh)."""
        self._states.clear()
        self._adopted.clear()
        self._held.clear()
        self._pinned = None
        self.held_as = None


RingWriter = Callable[[HeldAs, int, Mapping[str, Any]], None]
"""``write(held_as, step, state)``: put one state of the ring where a restart finds it."""


def flush_ring(ring: StateRing, write: RingWriter, *, where: str, skip: Collection[int] = (),
               extra: Mapping[int, Mapping[str, Any]] | None = None, newest: int = 2) -> list[int]:
    """Write the ``newest`` newest states ``ring`` holds (and ``extra``: completed steps not copied
    into it yet), oldest first, leaving out the steps in ``skip`` (already written), as
    ``ring.held_as`` says, into ``where`` (named in the log: "the host store DIR"). Workers are at most one step apart, so with ``newest=2`` every worker
    writes the newest step all of them completed (each its own part: no message); a step only some
    reached stays incomplete. Nothing when the ring's states are not described yet. A failed write is
    logged, not raised (the caller exits anyway; the restart loads what is there). Returns the steps
    written."""
    held_as = ring.held_as
    if held_as is None:
        return []
    states = {**(extra or {}), **ring.states()}
    done = []
    for step, state in sorted(states.items())[-newest:]:
        if step in skip:
            continue
        try:
            write(held_as, step, state)
            done.append(step)
            log.warning("rank %d: SIGTERM: step %d's state is in %s", held_as.rank, step, where)
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("rank %d: SIGTERM: could not write step %d to %s", held_as.rank, step, where)
    return done


def exit_on_sigterm(flush: Callable[[], object]) -> bool:
    """On SIGTERM (torchrun's agents restarting the workers, e.g. for a joining node) call ``flush``
    (e.g. :func:`flush_ring`), then exit at once with 128 + the signal (no clean-up that could wait
    on a peer). Handlers can only be set from the main thread: False (nothing set) elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def terminated(signum: int, frame: Any) -> None:
        try:
            flush()
        finally:
            logging.shutdown()
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    return True
