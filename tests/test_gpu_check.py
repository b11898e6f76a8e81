"""scripts/gpu_check.py (``make gpu-check``, issue 33 item 3) does not rot: its dry run runs every
part on CPU (gloo, small sizes) and each part's own checks hold (the loads and the live move bit
for bit, every recompute mode measured, the CUDA tests found); without CUDA the real run stops
with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _script():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "scripts"))  # the script puts it there too when imported
    import gpu_check  # lazy: a script, importable only with scripts/ on the path

    return gpu_check


def test_finds_the_tests_that_need_cuda() -> None:
    """Every test that skips without CUDA, and only those, by node id."""
    ids = _script().cuda_tests(REPO / "tests")
    assert {"tests/test_train.py::test_trainer_on_cuda",
            "tests/test_bubbles.py::test_cuda_side_steps_run_on_a_lowest_priority_stream",
            "tests/test_bubbles_memory.py::test_cuda_snapshot_copies_on_a_lowest_priority_stream_into_pinned_buffers",
            } <= set(ids)
    for node in ids:
        path, name = node.split("::")
        text = (REPO / path).read_text()
        before = text[: text.index(f"def {name}(")]
        assert "skipif(not torch.cuda.is_available()" in before[before.rfind("\n\n"):], node


@pytest.mark.timeout(450)
def test_dry_run_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=440, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == ["tests", "load", "bubbles", "memory", "live"]
    assert all(p["status"] == "ok" and p["error"] is None for p in parts.values()), parts
    assert report["dry_run"] is True and report["goals"]["total_le_480s"] is True
    tests = parts["tests"]["figures"]["tests"]
    assert len(tests) >= 3 and all(t["outcome"] == "skipped" for t in tests)  # no CUDA here
    load = parts["load"]["figures"]
    assert load["bitwise_equal"] and load["bytes"] == 2 << 20 and load["bytes_read"] >= load["bytes"]
    assert load["pinned_gbps"]["median"] > 0
    assert report["goals"]["load_ratio_to_pinned_h2d"] == load["ratio_to_pinned_h2d"]
    assert parts["bubbles"]["figures"]["snapshot_equal"] is True
    mem = parts["memory"]["figures"]
    assert [r["recompute"] for r in mem["rows"]] == ["selective"]  # the GPU run measures every mode
    assert mem["rows"][0]["measured_bytes"] > 0 and mem["rows"][0]["estimated_bytes"] > 0
    saved = mem["saved_activation_bytes"]
    assert saved["full"] < saved["selective"] < saved["none"]
    live = parts["live"]["figures"]
    tiers = live["bytes_by_tier"]
    assert live["bitwise_equal"] and tiers["live"] == 0 and tiers["local"] > 0 and tiers["storage"] > 0
    assert "gpu_check dry run on CPU" in res.stdout and "[5/5] live: ok" in res.stdout
    print(f"\ndry run in {seconds:.1f}s: " + ", ".join(f"{n} {p['seconds']:.1f}s" for n, p in parts.items()))


@pytest.mark.timeout(120)
def test_a_part_over_its_budget_is_killed_and_the_next_runs(tmp_path: Path) -> None:
    """A part that runs over is recorded as a timeout with its output, the next part still runs, the
    JSON holds both and the exit code says that a part failed."""
    out = tmp_path / "dry.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "bubbles,live", "--budget", "bubbles=0.5",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=110,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert parts["bubbles"]["status"] == "timeout" and parts["bubbles"]["budget_s"] == 0.5
    assert "over its budget of 0.5s" in parts["bubbles"]["error"] and "log_tail" in parts["bubbles"]
    assert parts["live"]["status"] == "ok" and parts["live"]["figures"]["bitwise_equal"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_real_run_stops_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "real.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert res.stderr.startswith("gpu_check: cannot run: no CUDA device") and res.stderr.count("\n") == 1, res.stderr
    assert not out.exists()
