"""The elastic runtime: ``rescale`` (restart path and live move), its result, the live state.

``rescale.py``: ``rescale`` and the restart path (scan the tiers, load, ``agree_on_step``);
``live.py``: the live move between survivors (``LiveState``, ``live_step``, ``live_order``);
``result.py``: ``RescaleResult``; ``runtime.py``: ``ElasticRuntime``, in-process elasticity for the
user's own loop (its latency table: ``latency.RecoveryTimes``). The choosers (``default_chooser``, ``choose_mesh``, ...) are
``tenplex.planning.choose``'s.
"""

from .live import LiveState, live_order, live_step
from .rescale import RescaleOptions, agree_on_step, env_world, rescale, storage_tier
from .result import RescaleResult
from .latency import RecoveryTimes  # noqa: E402 - after live/rescale: runtime imports them from the package
from .runtime import ElasticRuntime, RuntimeConfig  # noqa: E402

__all__ = ["RescaleResult", "RescaleOptions", "LiveState", "live_step", "live_order", "rescale", "agree_on_step",
           "env_world", "storage_tier", "ElasticRuntime", "RuntimeConfig", "RecoveryTimes"]
