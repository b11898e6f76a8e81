"""tenplex: change the (DP, TP, PP) parallelism of a running training job.

The public surface (``__all__``): layouts (:class:`ParallelConfig`), parallelizable tensor
collections (:class:`PTC`, :class:`TensorSpec` and its partition specs :class:`Replicated`,
:class:`Split`), model builders (:func:`model_ptc`), checkpoints (:func:`save`, :func:`load`,
:func:`list_steps`; a torch-native job's own state dict: :func:`save_state_dict`, :func:`load_state_dict`), rescaling a job (:func:`rescale`, reading from :class:`Tier` s), the planner
(:func:`plan`), choosing a layout (:func:`choose_layout`, :func:`estimate_memory`) and the errors
(:class:`TenplexError` and its main subclasses; every error class is in :mod:`tenplex.errors`).

Everything else is imported from its module (``from tenplex.planner import Move``,
``from tenplex.checkpoint import read_manifest``); the names imported below but not in
``__all__`` stay reachable as ``tenplex.<name>`` for code written against earlier versions.
"""

import sys
import types
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .checkpoint import LoadResult, LoadStats, SaveResult, StepInfo, list_steps, load, read_manifest, save
from .config import Coords, ParallelConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CheckpointWriteError,
    ConfigError,
    LayoutError,
    PlanError,
    SpecError,
    TenplexError,
)
from .planner import Move, Plan, PlanStats, plan
from .ptc import PTC, Replicated, Split, TensorSpec
from .state_dict import StateDictLoad, load_state_dict, save_state_dict

#: Names imported on first use (PEP 562), by the module that defines them: ``import tenplex`` for a
#: checkpoint load or save no longer pays for rescaling, the store, layouts, interop, model presets and
#: networkx (0.3-1 s of a restarted job's start on a loaded host; #29 item 3).
_LAZY = {
    "RescaleResult": "elastic", "rescale": "elastic",
    "ImportResult": "interop", "export_hf": "interop", "import_checkpoint": "interop", "import_dcp": "interop",
    "import_hf": "interop",
    "Hardware": "layouts", "LayoutChoice": "layouts", "choose_layout": "layouts", "rank_layouts": "layouts",
    "valid_layouts": "layouts",
    "MemoryEstimate": "memory", "StageMemory": "memory", "estimate_memory": "memory",
    "PRESETS": "models", "ModelSpec": "models", "model_ptc": "models", "model_spec": "models",
    "Topology": "topology",
    "reshard": "reshard",
    "Schedule": "schedule", "Transfer": "schedule", "schedule": "schedule",
    "Tier": "store.recovery",
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from .elastic import RescaleResult, rescale
    from .interop import ImportResult, export_hf, import_checkpoint, import_dcp, import_hf
    from .layouts import Hardware, LayoutChoice, choose_layout, rank_layouts, valid_layouts
    from .memory import MemoryEstimate, StageMemory, estimate_memory
    from .reshard import reshard
    from .schedule import Schedule, Transfer, schedule
    from .models import PRESETS, ModelSpec, model_ptc, model_spec
    from .store.recovery import Tier
    from .topology import Topology


def __getattr__(name: str) -> Any:
    """A name of ``_LAZY``: imported from its module on first use, then kept in the package's namespace."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``tenplex.reshard`` and ``tenplex.schedule`` are the functions (as when they were imported
    eagerly), not the submodules of the same names: the import system binds a submodule to its
    parent's attribute when it first loads it, which this refuses for those two names."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # layouts
    "ParallelConfig",
    # parallelizable tensor collections and their partition specs
    "PTC",
    "TensorSpec",
    "Replicated",
    "Split",
    "model_ptc",
    # checkpoints
    "save",
    "load",
    "list_steps",
    # torch-native state dicts (DTensor, FSDP2, TP, PP), loaded in place
    "save_state_dict",
    "load_state_dict",
    # rescaling a running job
    "rescale",
    "Tier",
    # planning and choosing layouts
    "plan",
    "choose_layout",
    "estimate_memory",
    # errors
    "TenplexError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "SpecError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
]

