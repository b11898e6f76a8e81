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

from .checkpoint import LoadResult, LoadStats, SaveResult, StepInfo, list_steps, load, read_manifest, save
from .config import Coords, ParallelConfig
from .elastic import RescaleResult, rescale
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
from .interop import ImportResult, export_hf, import_checkpoint, import_dcp, import_hf
from .layouts import Hardware, LayoutChoice, choose_layout, rank_layouts, valid_layouts
from .memory import MemoryEstimate, StageMemory, estimate_memory
from .models import PRESETS, ModelSpec, model_ptc, model_spec
from .planner import Move, Plan, PlanStats, plan
from .ptc import PTC, Replicated, Split, TensorSpec
from .reshard import reshard
from .schedule import Schedule, Transfer, schedule
from .state_dict import StateDictLoad, load_state_dict, save_state_dict
from .topology import Topology

from .store.recovery import Tier

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

