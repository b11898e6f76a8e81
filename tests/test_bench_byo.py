"""Smoke test of scripts/bench_byo.py: one pair (FSDP2 4 -> FSDP2 2) of the tiny torch-native Llama,
real tenplex and DCP saves and loads in spawned gloo worlds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bench_byo_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "byo.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_byo.py"), "--quick", "--pairs", "fsdp4-fsdp2",
           "--json", str(out), "--tmpdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=58, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (pair,) = json.loads(out.read_text())
    for key in ("from", "to", "bytes_needed", "tenplex_bytes_read", "dcp_bytes_read", "tenplex_load_s", "dcp_load_s",
                "tenplex_load_warm_s", "dcp_load_warm_s", "tenplex_peak_mib", "dcp_peak_mib", "tenplex_save_s",
                "dcp_save_s", "identical", "tenplex_load_s_min", "tenplex_load_s_max", "dcp_load_s_min",
                "dcp_load_s_max", "tenplex_stats_bytes_read"):
        assert key in pair, key
    assert (pair["from"], pair["to"]) == ("dp_shard=4", "dp_shard=2")
    assert pair["identical"] is True and pair["tensors_compared"] > 0
    assert pair["tenplex_bytes_read"] >= pair["tenplex_stats_bytes_read"] >= pair["bytes_needed"] > 0
    assert pair["dcp_bytes_read"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["byo.json"]  # temporary checkpoints removed
