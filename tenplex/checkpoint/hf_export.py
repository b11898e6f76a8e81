"""``export_hf``: a tenplex GPT/Llama checkpoint back to one Hugging Face style ``model.safetensors`` plus
``config.json``: the source's own config when the model was imported from Hugging Face (kept in the model
description, ``ModelSpec.source_config``, which every later save of the same model carries; only the dtype
is updated), else a complete config of the model tenplex describes (``spec_to_hf_config``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec
from ..layout.ptc import PTC
from ..urls import url_fs
from . import LoadResult, load
from .hf_mapping import spec_to_hf_config, tenplex_to_hf
from .import_source import checked_options

__all__ = ["load_global", "export_hf"]

log = logging.getLogger(__name__)


def _load_global(url: str, step: int | None, storage_options: Mapping[str, Any] | None
                 ) -> tuple[LoadResult, dict[str, Any]]:
    one = ParallelConfig()
    res = load(url, one, 0, step=step, storage_options=checked_options(storage_options, "storage_options"))
    return res, res.ptc.unshard({0: res.shard}, one)


def load_global(url: str, *, step: int | None = None, storage_options: Mapping[str, Any] | None = None
                ) -> tuple[PTC, dict[str, Any], int]:
    """Every tensor of a tenplex checkpoint as a global (unsharded, unpadded) tensor."""
    res, state = _load_global(url, step, storage_options)
    return res.ptc, state, res.step


def _hf_config_of(extra: Any) -> Mapping[str, Any] | None:
    """The Hugging Face config an import by an older tenplex kept in ``extra`` (None for checkpoints
    of other origin, and for newer imports, which keep it in the model description)."""
    cfg = extra.get("hf_config") if isinstance(extra, Mapping) else None
    return cfg if isinstance(cfg, Mapping) else None


def export_hf(url: str, out: str | Path, *, step: int | None = None,
              storage_options: Mapping[str, Any] | None = None,
              out_storage_options: Mapping[str, Any] | None = None) -> Path | str:
    """Write a tenplex GPT/Llama checkpoint as Hugging Face safetensors (parameters only).

    ``out`` ending in ``.safetensors`` is the file written (``config.json`` goes beside it);
    otherwise ``out`` is a directory that receives ``model.safetensors`` and ``config.json``.
    ``config.json`` is the source's own when the model was imported from Hugging Face (its
    ``ModelSpec.source_config``, which the job's later saves of the same model carry; dtype
    updated), else ``spec_to_hf_config`` of the checkpoint's model. ``storage_options``: fsspec
    options of the checkpoint ``url``; ``out_storage_options``: of ``out`` when it is a URL.
    Returns the safetensors path (a URL for a remote ``out``).
    """
    from safetensors.torch import save as save_bytes
    from safetensors.torch import save_file

    res, state = _load_global(url, step, storage_options)
    mj = res.ptc.meta.get("model")
    if not mj:
        raise CheckpointError(f"{url} holds no GPT/Llama model description (meta.model); "
                              "only model_ptc collections can be exported to Hugging Face format")
    spec = ModelSpec.from_json(dict(mj))
    config = spec_to_hf_config(spec, spec.source_config or _hf_config_of(res.extra))
    hf = {k: v.contiguous() for k, v in tenplex_to_hf(state, spec).items()}
    fs, p = url_fs(out, out_storage_options, options="out_storage_options")
    path = p if p.endswith(".safetensors") else p.rstrip("/") + "/model.safetensors"
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    local = isinstance(fs, LocalFileSystem)
    if local:
        save_file(hf, path, metadata={"format": "pt"})
    else:
        fs.pipe_file(path, save_bytes(hf, metadata={"format": "pt"}))
    fs.pipe_file(parent + "/config.json", (json.dumps(config, indent=2) + "\n").encode())
    log.info("exported %s step %d (%d tensors) to %s", url, res.step, len(hf), path)
    return Path(path) if local else fs.unstrip_protocol(path)
