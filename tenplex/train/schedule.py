"""The 1F1B pipeline schedule as data (pure), so its idle periods are explicit."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, LayoutError

__all__ = ["Op", "one_f_one_b", "bubble_fraction"]


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a stage's schedule: ``kind`` is "F" (forward) or "B" (backward) of micro-batch ``mb``.

    ``wait``: the op first waits for a peer (the activation from the previous stage for F,
    the gradient from the next stage for B). Those waits are where the stage idles: the
    pipeline bubbles that side tasks may use.
    """

    kind: str
    mb: int
    wait: bool


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """Stage ``stage``'s ops: ``min(p - stage - 1, m)`` warm-up forwards, then alternate
    one forward and one backward, then the remaining backwards (cool-down)."""
    if not 0 <= stage < num_stages:
        raise LayoutError(f"stage {stage} is outside [0, {num_stages}) of a {num_stages}-stage pipeline")
    if num_microbatches < 1:
        raise ConfigError(f"need at least one micro-batch, got {num_microbatches}")
    p, m = num_stages, num_microbatches
    first, last = stage == 0, stage == p - 1
    warmup = min(p - stage - 1, m)
    ops: list[Op] = [Op("F", j, not first) for j in range(warmup)]
    for j in range(m - warmup):
        ops.append(Op("F", warmup + j, not first))
        ops.append(Op("B", j, not last))
    ops.extend(Op("B", j, not last) for j in range(m - warmup, m))
    return ops


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of an iteration under 1F1B (and GPipe): (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
