"""The command line: plan and inspect, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tenplex
from tenplex.cli import main, parse_ranks

ROOT = Path(__file__).resolve().parent.parent


def test_parse_ranks() -> None:
    assert parse_ranks("0-3,6,8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert parse_ranks("5") == [5]
    assert parse_ranks("none") == []


def test_rank_lists_are_bounded_before_they_are_listed() -> None:
    import argparse

    from tenplex.cli import parse_rank_ranges
    from tenplex.errors import PlanError

    assert parse_rank_ranges("0-999999999999") == (range(0, 10**12),)  # not listed
    with pytest.raises(PlanError, match="--alive names rank 999999999999, outside the old world of 8 ranks"):
        parse_ranks("0-999999999999", world_size=8)
    for text, match in (("5-1", "rank range 5-1 is empty: write the lower rank first"), ("", "names no rank"),
                        ("a-b", "cannot parse"), ("-3", "cannot parse")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_rank_ranges(text)


def test_plan_json_fields_match_library(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny", "--from", "dp=2,tp=2,pp=2", "--to", "dp=1,tp=4,pp=1",
                 "--alive", "0-3", "--gpus-per-host", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = tenplex.plan(tenplex.model_ptc("tiny"), tenplex.ParallelConfig(2, 2, 2), tenplex.ParallelConfig(1, 4, 1),
                       alive=[0, 1, 2, 3], gpus_per_host=4).stats
    for key in ("bytes_needed", "bytes_moved", "bytes_lower_bound", "bytes_cross_host", "max_send_bytes",
                "max_recv_bytes"):
        assert out[key] == getattr(ref, key), key
    assert out["bytes_moved"] == out["bytes_lower_bound"]
    assert out["bytes_storage"] > 0  # ranks 4-7 died, so stage 1 comes from storage
    assert out["plan_seconds"] >= 0


def test_plan_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama3-8b", "--from", "dp=2,tp=4,pp=2", "--to", "dp=1,tp=4,pp=2"]) == 0
    text = capsys.readouterr().out
    assert "bytes needed" in text and "lower bound" in text and "llama3-8b" in text


def test_plan_invalid_layout_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama3-8b", "--from", "dp=2,tp=3,pp=2", "--to", "dp=1,tp=4,pp=2"]) == 2
    assert "tp=3 does not divide heads=32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--from", "dp=x", "--to", "dp=1"])


def test_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ptc = tenplex.model_ptc("tiny")
    cfg = tenplex.ParallelConfig(dp=2, tp=1, pp=2)
    g = {n: torch.randn(s.shape) for n, s in ptc.tensors.items()}
    shards = ptc.shard(g, cfg)
    for r in range(cfg.world_size):
        tenplex.save(str(tmp_path), ptc, cfg, r, shards[r], step=5)
    for r in range(cfg.world_size - 1):  # step 6 is interrupted: rank 3 never finishes
        tenplex.save(str(tmp_path), ptc, cfg, r, shards[r], step=6)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["complete"]) for s in out["steps"]] == [(5, True), (6, False)]
    assert out["step"] == 5
    assert out["steps"][1]["ranks_done"] == 3
    assert out["tensors"]["embedding.word"]["shape"] == [259, 64]
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "dp=2,tp=1,pp=2" in text and "NO" in text


def test_inspect_empty(tmp_path: Path) -> None:
    assert main(["inspect", str(tmp_path)]) == 1


def test_inspect_passes_storage_options_to_fsspec(capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage-option k=v`` reaches the filesystem's constructor (a recording test filesystem), every
    time tenplex builds it for the URL; values are JSON when they parse, else strings."""
    from recording_fs import RecordingFileSystem

    RecordingFileSystem.reset()
    ptc, cfg = tenplex.model_ptc("tiny", optimizer=False), tenplex.ParallelConfig()
    shard = ptc.shard({n: torch.zeros(s.shape, dtype=s.dtype) for n, s in ptc.tensors.items()}, cfg)[0]
    tenplex.save("recfs://ck", ptc, cfg, 0, shard, step=7)
    RecordingFileSystem.calls.clear()
    opts = {"endpoint_url": "http://127.0.0.1:5000", "anon": False, "retries": 3, "client_kwargs": {"region": "x"}}
    assert main(["inspect", "recfs://ck", "--json", "--storage-option", "endpoint_url=http://127.0.0.1:5000",
                 "--storage-option", "anon=false", "--storage-option", "retries=3",
                 "--storage-option", 'client_kwargs={"region": "x"}']) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 7
    assert RecordingFileSystem.calls and all(c == opts for c in RecordingFileSystem.calls), RecordingFileSystem.calls


@pytest.mark.timeout(120)
def test_console_script_and_module_entry() -> None:
    res = subprocess.run([sys.executable, "-m", "tenplex", "plan", "--model", "tiny", "--from", "dp=1",
                          "--to", "tp=2", "--json"], capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["bytes_needed"] > 0


@pytest.mark.timeout(300)
def test_reshard_example_runs_and_verifies() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "reshard_example.py")], capture_output=True, text=True,
                         timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "correctness: OK" in res.stdout
    assert "(1.000x needed)" in res.stdout
