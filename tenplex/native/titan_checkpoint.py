"""torchtitan's ``CheckpointManager`` writing and reading tenplex checkpoints (#29 item 4).

``TenplexCheckpointManager`` is torchtitan 0.3.0's own ``CheckpointManager`` (same config, same
policies: interval, ``keep_latest_k`` purging, ``exclude_from_loading``, model-only first step
and last step, ``initial_load_path``) whose two storage calls are tenplex's:
``dcp_save`` is ``tenplex.save_state_dict`` and ``dcp_load`` is ``tenplex.load_state_dict`` of
the same state dict (its ``ModelWrapper`` tensors, its ``OptimizersContainer``, data loader, LR
scheduler and train state as ``Stateful`` values, as DCP takes them). Every
``{folder}/step-N`` directory is then an ordinary tenplex checkpoint holding step N: a job
resumes under any other mesh or world size, each rank reading only the byte ranges its shards
need. A job switches with its config only::

    from tenplex.native.titan_checkpoint import TenplexCheckpointManager
    config.checkpoint = TenplexCheckpointManager.Config(enable=True, folder="checkpoint", ...)

What stays torchtitan's: Hugging Face saves and loads (``last_save_in_hf``,
``initial_load_in_hf``), and an ``initial_load_path`` that is a DCP directory (a stock torchtitan
run's ``step-N``: read by DCP, so a job moves to tenplex mid-run). Saves are synchronous:
``async_mode`` other than ``"disabled"`` is refused (ConfigError).

This module imports torchtitan; nothing else in tenplex imports this module.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from ..checkpoint.catalog import list_steps
from ..checkpoint.import_source import source_step
from ..errors import ConfigError
from .state_dict import StateDictLoad, load_state_dict, save_state_dict

__all__ = ["TenplexCheckpointManager"]

log = logging.getLogger(__name__)


class TenplexCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose checkpoints are tenplex checkpoints (one per
    ``step-N`` directory). ``last_load``: what the newest load read (bytes read and needed)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint options, unchanged (``async_mode`` must stay ``"disabled"``)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        if config.enable and config.async_mode != AsyncMode.DISABLED:  # before torchtitan makes its gloo group
            raise ConfigError(f"checkpoint.async_mode={config.async_mode!r}: tenplex saves synchronously (every rank "
                              "writes its own part); set async_mode='disabled'")
        super().__init__(config, **kwargs)
        self.last_load: StateDictLoad | None = None

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> None:
        """``tenplex.save_state_dict`` of ``state_dict`` into the tenplex checkpoint ``checkpoint_id``
        (``{folder}/step-N``, saved as step N); Hugging Face saves stay torchtitan's."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = source_step(checkpoint_id)
        if step is None:
            raise ConfigError(f"{checkpoint_id}: a torchtitan checkpoint id names its step (step-N)")
        res = save_state_dict(state_dict, str(checkpoint_id), step=step)
        log.info("saved step %d to %s: %d bytes written by this rank", step, checkpoint_id, res.bytes_written)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """``tenplex.load_state_dict`` of the tenplex checkpoint ``checkpoint_id`` into ``state_dict``
        (its newest step that verifies; a subset of its keys when ``exclude_from_loading`` dropped
        some), then the model's own ``load_state_dict`` as torchtitan does after ``dcp.load``. A DCP
        directory (``.metadata``) or a Hugging Face load is torchtitan's own."""
        if from_hf or filesystem.isfile(filesystem.join(checkpoint_id, ".metadata")):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        self.last_load = load_state_dict(state_dict, str(checkpoint_id))
        res = self.last_load
        log.info("loaded step %d of %s: this rank read %d bytes for %d needed", res.step, checkpoint_id,
                 res.bytes_read, res.bytes_needed)
        if MODEL in self.states:  # as CheckpointManager.dcp_load: the model's hooks (fused weights) see the values
            self.states[MODEL].load_state_dict(state_dict)
        return None

    def _find_load_step(self, folder: str = "") -> int:
        """The newest ``step-N`` directory that holds a complete tenplex checkpoint of step N (or,
        as torchtitan's own rule, DCP metadata or a Hugging Face index)."""
        folder = folder or self.folder
        best = super()._find_load_step(folder)
        if not filesystem.isdir(folder):
            return best
        for name in filesystem.listdir(folder):
            step = source_step(name)
            if step is None or step <= best:
                continue
            path = filesystem.join(folder, os.path.basename(name.rstrip("/")))
            if any(i.complete and i.step == step for i in list_steps(path)):
                best = step
        return best
