"""A checkpoint of another format as the source (or destination) of an import or export.

Its filesystem (a local path or an fsspec URL with its ``storage_options``), the training step it holds
(``source_step``: its directory's name), its format (``detect_format``), the dtype of its state, and what an
import wrote (``ImportResult``): what ``hf_import``, ``dcp_import`` and ``hf_export`` share.

Every URL can carry fsspec ``storage_options``: ``storage_options`` for the tenplex checkpoint,
``source_storage_options`` for an import's source, ``out_storage_options`` for an export's
destination (each may also be a local path).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC, Layout
from ..urls import url_fs
from . import save

__all__ = ["ImportResult", "source_step", "import_step", "detect_format", "checked_options",
           "dir_entries", "state_dtype", "check_shapes", "save_global"]


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import wrote: the collection, the layout it was saved under, the step, bytes."""

    ptc: PTC
    layout: Layout
    step: int
    url: str
    source_format: str
    tensors: int
    nbytes: int


def checked_options(storage_options: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """fsspec ``storage_options`` as a dict (empty for None); ConfigError naming ``what`` unless a mapping of names."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise ConfigError(f"{what} must map option names (strings) to values, got {storage_options!r}")
    return dict(storage_options)



def dir_entries(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Full paths of the entries of directory ``path``."""
    return sorted(fs.ls(path, detail=False))


_SOURCE_STEP = re.compile(r"(?:step|checkpoint|global_step)[-_]?(\d+)")


def source_step(src: str | Path) -> int | None:
    """The training step a source checkpoint's directory name says (pure): torchtitan's ``step-5``,
    Hugging Face Trainer's ``checkpoint-500``, DeepSpeed's ``global_step500`` (``step_5`` too); a
    ``.safetensors`` file: its directory's. None when the name says none."""
    parts = str(src).replace("\\", "/").rstrip("/").rsplit("/", 2)
    name = parts[-2] if parts[-1].endswith(".safetensors") and len(parts) > 1 else parts[-1]
    m = _SOURCE_STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def import_step(src: str | Path, step: int | None, objects: Mapping[str, Any] | None = None) -> int:
    """``step`` when given, else the source's own: its directory name's (``source_step``), else the
    ``train_state.step`` torchtitan's CheckpointManager saves among a DCP checkpoint's ``objects``, else 0."""
    if step is not None:
        return step
    found = source_step(src)
    if found is None and objects is not None:
        saved = objects.get("train_state.step")
        found = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else None
    return 0 if found is None else found


def detect_format(src: str | Path, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """'dcp' for a directory with DCP's ``.metadata``, 'hf' for safetensors files (local or a URL)."""
    fs, path = url_fs(src, storage_options, options="source_storage_options")
    if fs.isdir(path):
        names = dir_entries(fs, path)
        if any(n.rsplit("/", 1)[-1] == ".metadata" for n in names):
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "hf"
    elif path.endswith(".safetensors") and fs.isfile(path):
        return "hf"
    raise CheckpointNotFoundError(
        f"{src} is neither a DCP checkpoint directory (with .metadata) nor a Hugging Face safetensors "
        "checkpoint (a .safetensors file or a directory holding them)")


def state_dtype(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    kinds = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(kinds) != 1:
        raise ConfigError(f"the checkpoint mixes dtypes {sorted(map(str, kinds))}: pass dtype= to cast")
    return kinds.pop()


def save_global(url: str, ptc: PTC, state: Mapping[str, Any], layout: ParallelConfig, step: int,
              extra: Any, storage_options: Mapping[str, Any] | None) -> int:
    """Shard the global state under ``layout`` and save every rank's part (in this process)."""
    opts = checked_options(storage_options, "storage_options")
    shards = ptc.shard(state, layout)
    written = 0
    for rank in range(layout.world_size):
        written += save(url, ptc, layout, rank, shards[rank], step=step, extra=extra,
                        storage_options=opts).bytes_written
        shards[rank] = {}
    return written


def check_shapes(ptc: PTC, state: Mapping[str, torch.Tensor]) -> None:
    for name, ts in ptc.tensors.items():
        got = tuple(state[name].shape)
        if got != ts.shape:
            raise CheckpointError(f"{name}: the source tensor has shape {got}, the model config implies {ts.shape}")
