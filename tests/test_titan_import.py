"""A checkpoint written by torchtitan's own CheckpointManager loads under another mesh (#17 item 6).

``scripts/titan_job.py --tp 2 --dp-shard 2 --then-check dp_shard=4`` runs torchtitan 0.3.0's
Llama 3 (TP2 x FSDP2 on 4 gloo ranks, 2 AdamW steps), saves model and optimizer with its
``CheckpointManager``, runs ``tenplex import`` on that checkpoint (DCP, partitioning kept), then on
the same 4 ranks under FSDP2 alone builds the model and optimizer again twice and fills one
state dict with ``tenplex.load_state_dict`` and the other with ``torch.distributed.checkpoint.load``
of the titan checkpoint. Checked here: every entry equal (DTensors as full tensors, bit for bit),
each rank read at most 1.01x the bytes it needed, and the imported data files hold exactly the
DCP checkpoint's tensor bytes (nothing replicated).

The script's 4 workers (``main`` with torchrun's variables: its ``worker``) are forked from the test
session's forkserver, which imported torch and DTensor once (``spawned.start_trainer``); as 4
``python scripts/titan_job.py`` processes most of the wall time was importing torch and torchtitan.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import tenplex
from tenplex.state_layout import Boxes, StateLayout

from spawned import free_port, log_tails, rank_env, start_trainer, wait_procs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # titan_job, imported by the forked workers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (optional: pip install torchtitan==0.3.0)"),
]


def test_titan_checkpoint_manager_checkpoint_loads_under_another_mesh(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    argv = ["--tp", "2", "--dp-shard", "2", "--spmd-backend", "partial_dtensor", "--dim", "256", "--steps", "2",
            "--out", str(out), "--then-check", "dp_shard=4"]
    port = free_port()  # the script's 4 workers, as its launcher starts them, forked from the session's forkserver
    procs = [start_trainer(argv, tmp_path / f"rank{r}.log", {**os.environ, "OMP_NUM_THREADS": "1", **rank_env(r, 4, port)},
                           main="titan_job:main") for r in range(4)]
    assert wait_procs(procs, 280) == [0] * 4, log_tails(tmp_path, "rank*.log")
    check = json.loads((out / "check.json").read_text())
    assert check["mesh"]["dp_shard"] == 4 and check["mesh"]["tp"] == 1
    assert check["import"]["format"] == "dcp"
    ranks = check["ranks"]
    assert len(ranks) == 4
    for r in ranks:
        assert r["mismatches"] == [], r
        assert r["dtensors"] > 0 and r["objects"] > 0
        assert r["bytes_read"] <= 1.01 * r["bytes_needed"], r
    sizes = check["sizes"]
    assert sizes["tenplex_data_payload_bytes"] == sizes["dcp_tensor_bytes"], sizes

    # the import kept the saving mesh's chunks: one pseudo writer rank per DCP file, tensors as Boxes
    manifest = tenplex.read_manifest(str(out / "tenplex"))
    layout = StateLayout.from_json(manifest["state_layout"])
    assert layout.world_size == 4
    assert all(isinstance(p, Boxes) for p in layout.placed.values())
    wo = layout.placed["layers.0.attention.wo.weight"]  # TP row-wise x FSDP2: 4 boxes of [128, 128]
    assert sorted(z for _, _, z in wo.chunks) == [(128, 128)] * 4
