"""The elastic runtime: ``rescale`` (restart path and live move), its result, the live state.

``rescale.py``: ``rescale`` and the restart path (scan the tiers, load, ``agree_on_step``);
``live.py``: the live move between survivors (``LiveState``, ``live_step``, ``live_order``);
``result.py``: ``RescaleResult``; ``runtime.py``: ``ElasticRuntime``, in-process elasticity for the
user's own loop (its latency table: ``latency.RecoveryTimes``). The choosers (``default_chooser``, ``choose_mesh``, ...) are
``tenplex.planning.choose``'s.
"""

from typing import TYPE_CHECKING, Any

from .live import LiveState, live_order, live_step
from .rescale import RescaleOptions, agree_on_step, env_world, rescale, storage_tier
from .result import RescaleResult
from .latency import RecoveryTimes

if TYPE_CHECKING:
    from .runtime import ElasticRuntime, RuntimeConfig


def __getattr__(name: str) -> Any:
    """``ElasticRuntime`` and ``RuntimeConfig`` on first use (PEP 562): importing the package (or its
    pure ``membership`` protocol) does not start the membership runtime, its links and DCP."""
    if name in ("ElasticRuntime", "RuntimeConfig"):
        from . import runtime  # lazy: the runtime's imports (membership links, DCP) on first use

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["RescaleResult", "RescaleOptions", "LiveState", "live_step", "live_order", "rescale", "agree_on_step",
           "env_world", "storage_tier", "ElasticRuntime", "RuntimeConfig", "RecoveryTimes"]
