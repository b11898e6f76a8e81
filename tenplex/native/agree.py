"""One rule for ranks that loaded different checkpoint steps: ``rescale`` and ``load_state_dict`` share it.

Ranks pass over damage they see and read different bytes (a damaged block or index may be read by
some ranks only), so they can load different steps. ``agree_step`` settles them on one: the oldest
step any rank loaded; a fresh start only when every rank found nothing (docs/format.md, "Choosing a
step").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointNotFoundError

__all__ = ["Reload", "agree_step"]

log = logging.getLogger(__name__)

Reload = Callable[[int, Sequence[Any]], "int | None"]
"""``reload(bound, hints)``: load this rank's state from the newest step <= ``bound`` that verifies
for it, and return that step (None: none does); ``hints``: the ``hint`` of every rank that holds a
step (a rank that found nothing reloads under the layout the others chose from the saved one)."""


def agree_step(step: int | None, reload: Reload, *, hint: Any = None, where: str = "", group: Any = None,
               gathered: Sequence[int | None] | None = None) -> int | None:
    """The step every rank of ``group`` (default: the default group) ends on, from the step each
    loaded (``step``; None: it found none). A collective (one ``all_gather_object`` per round).

    The oldest step any rank loaded wins: a rank that loaded a newer one reloads (``reload``) the
    newest step not newer than it that verifies for it, and the ranks repeat until they agree.
    Returns the agreed step; None, a fresh start, only when every rank found nothing. Ranks that find
    nothing while others loaded a step (a store slow to answer at start-up, tiers they cannot read)
    look once more (``reload`` with the others' ``hint``), then every rank raises
    CheckpointNotFoundError naming them: starting all of them fresh would discard the job's state.
    ``where``: what this rank reads, for that message. ``gathered``: every rank's ``step`` when the
    caller has gathered them already (its first round's collective is then skipped; no hints). Without
    a process group: ``step``.
    """
    if not dist.is_initialized():
        return step
    world = dist.get_world_size(group)
    retried = False
    views: list[Any] = [(s, None) for s in gathered] if gathered is not None else []
    while True:
        if not views:
            views = [None] * world
            dist.all_gather_object(views, (step, hint), group=group)
        found = [s for s, _ in views if s is not None]
        blind = [r for r, (s, _) in enumerate(views) if s is None]
        if not found:
            return None
        bound, newest = min(found), max(found)
        if not blind and bound == newest:
            return step
        hints = [h for s, h in views if s is not None]
        views = []
        if blind:
            if retried:
                raise CheckpointNotFoundError(
                    f"rank(s) {blind} found no checkpoint step up to {bound} that they can read, while the other "
                    f"ranks resumed from steps {bound}..{newest}: starting fresh would discard the job's state. Make "
                    f"every rank reach the checkpoints (this rank reads {where}; the host stores of TENPLEX_STORES, "
                    "--ckpt), then restart the job")
            retried = True
            if step is None:
                log.warning("rank %d sees no checkpoint under %s while other ranks resumed from step %d: looking "
                            "again", dist.get_rank(group), where, bound)
                step = reload(bound, hints)
            continue
        assert step is not None
        if step > bound:
            log.warning("rank %d resumed from step %d, another rank from step %d: reloading", dist.get_rank(group),
                        step, bound)
            step = reload(bound, hints)
