"""tenplex: change the (DP, TP, PP) parallelism of a running training job.

The public surface: layouts (:class:`ParallelConfig`), parallelizable tensor collections
(:class:`PTC`, :class:`TensorSpec` and its partition specs), model builders
(:func:`model_ptc`), the planner (:func:`plan`) and checkpoints (:func:`save`, :func:`load`).
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
from .topology import Topology

__all__ = [
    "rescale",
    "RescaleResult",
    "save",
    "load",
    "list_steps",
    "read_manifest",
    "SaveResult",
    "LoadResult",
    "LoadStats",
    "StepInfo",
    "reshard",
    "schedule",
    "Schedule",
    "Transfer",
    "Topology",
    "Coords",
    "ParallelConfig",
    "TenplexError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointValueError",
    "CheckpointWriteError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "PRESETS",
    "ModelSpec",
    "model_ptc",
    "model_spec",
    "Move",
    "Plan",
    "PlanStats",
    "plan",
    "PTC",
    "Replicated",
    "Split",
    "TensorSpec",
    "estimate_memory",
    "MemoryEstimate",
    "StageMemory",
    "choose_layout",
    "rank_layouts",
    "valid_layouts",
    "LayoutChoice",
    "Hardware",
    "import_checkpoint",
    "import_dcp",
    "import_hf",
    "export_hf",
    "ImportResult",
]
