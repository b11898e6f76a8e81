"""The reference trainer's side of in-process recovery (issue #18; docs/inprocess.md).

With ``--in-process`` every worker watches its peers through a
:class:`~tenplex.elastic.membership_runtime.Membership` on the job's long-lived store and keeps its last
consistent states in a :class:`~tenplex.elastic.ring.StateRing`; a peer failure makes the survivors call
:func:`tenplex.elastic.inprocess.recover_in_process`, which agrees on the members and moves the state
live, and the run driver rebuilds its groups and trainer. What is the trainer's own is here: the
ring's per-step copy as a side task of the trainer's pipeline bubbles (:func:`ring_in_bubbles`)
and, after a failure, the ring settled on the trainer's working state (:func:`settle_ring`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..elastic.bubbles import BubbleRuntime, SnapshotTask
from ..elastic.ring import StateRing

__all__ = ["ring_in_bubbles", "settle_ring"]

log = logging.getLogger(__name__)


def ring_in_bubbles(ring: StateRing, trainer: Any, device: Any = None) -> SnapshotTask:
    """Make ``trainer``'s per-step state copy into ``ring`` a side task of its pipeline bubbles
    (``tenplex.elastic.bubbles``): the state after step k is copied while step k+1's stages wait for
    their neighbours' activations and gradients, and what is left before k+1's optimizer step
    changes it (the only blocking part; all of it with one stage). ``ring.keep`` buffer sets
    are used in turn, so the ring holds ``keep - 1`` finished states while a snapshot is under
    way; after a failure ``settle_ring`` keeps the working state instead."""
    task = SnapshotTask(name="ring", buffer_sets=ring.keep, on_begin=ring.release, on_complete=ring.adopt)
    runtime = BubbleRuntime(record=False, device=device)
    runtime.register(task)
    trainer.bubble_hook, trainer.snapshot_task = runtime, task
    return task


def settle_ring(ring: StateRing, trainer: Any) -> None:
    """After a failure, make the ring hold the newest consistent state of this rank. Outside the
    optimizer step (``trainer.updating``) the working state is the state after ``trainer.step``,
    and nothing changes it any more (the trainer is dropped for the recovery): the ring adopts it
    as it is, no copy (a snapshot task's copy under way is abandoned; measured: a 312 MB rank's
    copy was 0.3-0.4 s of its recovery at load 4). During the update it is half updated; the
    ring then already holds the state before it (the task finished before the update began)."""
    if getattr(trainer, "updating", False) or not hasattr(trainer, "consistent_state"):  # a Spare holds nothing
        return
    if trainer.step not in ring.states():
        ring.adopt(trainer.step, trainer.consistent_state())
