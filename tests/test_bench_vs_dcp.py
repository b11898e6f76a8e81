"""Smoke test of scripts/bench_vs_dcp.py: one layout pair of a tiny GPT, real DCP and tenplex loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not os.environ.get("TENPLEX_BENCH_SMOKE"),
                    reason="26 s of the suite's 600 s budget: TENPLEX_BENCH_SMOKE=1 runs it (make bench runs the script)")
def test_bench_vs_dcp_quick_json(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_vs_dcp.py"), "--quick", "--pairs", "0", "--json",
           "--no-write", "--tmpdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    (pair,) = report["pairs"]
    for key in ("from", "to", "bytes_needed", "tenplex_bytes_read", "dcp_bytes_read", "tenplex_load_s", "dcp_load_s"):
        assert key in pair
    assert (pair["from"], pair["to"]) == ("dp=1,tp=2,pp=1", "dp=1,tp=4,pp=1")
    assert pair["tenplex_verified"] > 0 and pair["dcp_verified"] > 0 and not pair["verify_failures"]
    # tenplex reads only what it needs (plus checksum-block rounding); DCP reads whole saved chunks
    assert pair["tenplex_bytes_read"] <= 1.05 * pair["bytes_needed"]
    assert pair["dcp_bytes_read"] > 1.5 * pair["bytes_needed"]
    assert pair["tenplex_stats_bytes_read"] == pair["tenplex_bytes_read"]
    assert not list(tmp_path.iterdir())  # temporary checkpoints removed
