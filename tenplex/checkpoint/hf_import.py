"""``import_hf``: a Hugging Face Llama (``LlamaForCausalLM``) or GPT-2 (``GPT2LMHeadModel``) checkpoint
(``config.json`` plus ``*.safetensors``) becomes a tenplex checkpoint of the matching ``model_ptc``
(parameters only), saved under a layout (default ``dp=1,tp=1,pp=1``) and loadable under any layout.
Names are mapped by ``hf_mapping``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from ..layout.config import ParallelConfig
from ..layout.models import model_ptc
from ..urls import url_fs
from .hf_mapping import hf_config_to_spec, hf_to_tenplex
from .import_source import ImportResult, check_shapes, dir_entries, import_step, save_global, state_dtype

__all__ = ["read_hf_state", "import_hf"]

log = logging.getLogger(__name__)


def read_hf_state(src: str | Path, *, storage_options: Mapping[str, Any] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Every tensor of a Hugging Face safetensors checkpoint (all shards) and its config.json."""
    from safetensors.torch import load as load_bytes
    from safetensors.torch import load_file

    fs, path = url_fs(src, storage_options, options="source_storage_options")
    if fs.isfile(path):
        files, parent = [path], path.rsplit("/", 1)[0]
    else:
        files = [n for n in dir_entries(fs, path) if n.endswith(".safetensors")] if fs.isdir(path) else []
        parent = path.rstrip("/")
    if not files:
        raise CheckpointNotFoundError(f"no .safetensors files in {src}")
    local = isinstance(fs, LocalFileSystem)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(f) if local else load_bytes(fs.cat_file(f))
        dup = set(part) & set(state)
        if dup:
            raise CheckpointError(f"{f} repeats tensors of another shard, e.g. {sorted(dup)[:3]}")
        state.update(part)
    cfg_path = parent + "/config.json"
    if not fs.exists(cfg_path):
        return state, None
    try:
        config = json.loads(fs.cat_file(cfg_path))
    except ValueError as e:
        raise ConfigError(f"{cfg_path} is not JSON ({e}): write the model's config.json again") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{cfg_path} holds a {type(config).__name__}, not a JSON object")
    return state, config


def import_hf(src: str | Path, url: str, *, layout: ParallelConfig | None = None, step: int | None = None,
              dtype: torch.dtype | None = None, vocab_pad: int = 128,
              storage_options: Mapping[str, Any] | None = None,
              source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a Hugging Face Llama or GPT-2 safetensors checkpoint as a tenplex checkpoint.

    The source's ``config.json`` is kept in the model description (``meta["model"]``, the
    ``ModelSpec``'s ``source_config``, with its norm epsilon and RoPE as hyperparameters): a job's
    later saves of the same model carry it (``tenplex.checkpoint.carry_model``), and ``export_hf``
    writes it back. ``step``: default the source's (``source_step``: ``checkpoint-500``), else 0.
    ``storage_options``: fsspec options of the tenplex checkpoint ``url``;
    ``source_storage_options``: of ``src`` when it is a URL.
    """
    step = import_step(src, step)
    layout = layout or ParallelConfig()
    hf_state, config = read_hf_state(src, storage_options=source_storage_options)
    if config is None:
        raise ConfigError("the checkpoint has no config.json; tenplex needs it for the head counts "
                          "(write one with the model's save_pretrained or by hand)")
    dt = state_dtype(hf_state, dtype)
    spec = dataclasses.replace(hf_config_to_spec(config, dt, vocab_pad=vocab_pad), source_config=config)
    state = {k: v.to(dt) for k, v in hf_to_tenplex(hf_state, spec).items()}
    ptc = model_ptc(spec, optimizer=False)
    check_shapes(ptc, state)
    n = save_global(url, ptc, state, layout, step, extra={"imported_from": "hf"}, storage_options=storage_options)
    log.info("imported %s (%s, %d tensors) into %s under %s", src, config.get("model_type"), len(state), url, layout)
    return ImportResult(ptc, layout, step, url, "hf", len(state), n)
