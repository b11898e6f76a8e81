"""tenplex: change the (DP, TP, PP) parallelism of a running training job.

The public surface (``__all__``): layouts (:class:`ParallelConfig`), parallelizable tensor
collections (:class:`PTC`, :class:`TensorSpec` and its partition specs :class:`Replicated`,
:class:`Split`), model builders (:func:`model_ptc`), checkpoints (:func:`save`, :func:`load`,
:func:`list_steps`; a torch-native job's own state dict: :func:`save_state_dict`, :func:`load_state_dict`),
rescaling a job (:func:`rescale`, reading from :class:`Tier` s), in-process elasticity for your own
loop (:class:`ElasticRuntime`), the planner (:func:`plan`), choosing a
layout (:func:`choose_layout`, :func:`estimate_memory`), importing and exporting checkpoints of other
formats (:func:`import_hf`, :func:`import_dcp`, :func:`import_checkpoint`, :func:`export_hf`) and the
errors (:class:`TenplexError` and its main subclasses; every error class is in :mod:`tenplex.errors`).

Everything else is imported from its module (``from tenplex.planning.planner import Move``,
``from tenplex.checkpoint import read_manifest``).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .checkpoint import list_steps, load, save
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
    LayoutError,
    PlanError,
    SpecError,
    TenplexError,
)
from .layout.config import ParallelConfig
from .layout.ptc import PTC, Replicated, Split, TensorSpec
from .native.state_dict import load_state_dict, save_state_dict
from .planning.planner import plan

#: Names imported on first use (PEP 562), by the module that defines them: ``import tenplex`` for a
#: checkpoint load or save does not pay for rescaling, the store, layouts, interop, model presets and
#: networkx (0.3-1 s of a restarted job's start on a loaded host; #29 item 3).
_LAZY = {
    "rescale": "elastic",
    "ElasticRuntime": "elastic",
    "export_hf": "checkpoint.hf_export",
    "import_checkpoint": "checkpoint.auto_import",
    "import_dcp": "checkpoint.dcp_import",
    "import_hf": "checkpoint.hf_import",
    "choose_layout": "planning.layouts",
    "estimate_memory": "planning.memory",
    "model_ptc": "layout.models",
    "Tier": "store.recovery",
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from .elastic import ElasticRuntime, rescale
    from .checkpoint.auto_import import import_checkpoint
    from .checkpoint.dcp_import import import_dcp
    from .checkpoint.hf_export import export_hf
    from .checkpoint.hf_import import import_hf
    from .planning.layouts import choose_layout
    from .planning.memory import estimate_memory
    from .layout.models import model_ptc
    from .store.recovery import Tier


def __getattr__(name: str) -> Any:
    """A name of ``_LAZY``: imported from its module on first use, then kept in the package's namespace."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
    "ElasticRuntime",
    "Tier",
    # planning and choosing layouts
    "plan",
    "choose_layout",
    "estimate_memory",
    # checkpoints of other formats (Hugging Face safetensors, torch.distributed.checkpoint)
    "import_hf",
    "import_dcp",
    "import_checkpoint",
    "export_hf",
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

