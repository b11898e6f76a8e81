"""Hostile inputs to the reference trainer: bad checkpoint options and URLs, resume steps, damaged
newest steps, other data, other model settings.

Each attempt ends in one outcome of the shared tally (area "trainer"): ``refused`` (exit code 2,
one ``error:`` line, before any step), ``detected`` (resumed from an earlier step and the start
record names the skipped one), ``identical`` (resumed with the losses of an uninterrupted run) or
``silent`` (anything else). Most cases run in-process through :func:`tenplex.train.run.main`
(the code path of ``python -m tenplex.train`` minus the interpreter start, single process); a
sample runs as real subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hostile import Tally

from tenplex.checkpoint import read_part_chunks
from tenplex.train.run import main

BASE = ["--model", "tiny", "--seed", "7", "--global-batch", "8", "--micro-batch", "2"]
REL_TOL = 1e-6  # one process, same layout: the same arithmetic


@pytest.fixture(autouse=True, scope="module")
def _alone() -> Iterator[None]:
    """One process alone, one thread (as the subprocess tests' OMP_NUM_THREADS=1: on a loaded
    2-core machine a second thread makes the tiny steps several times slower)."""
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                             "TORCHELASTIC_RESTART_COUNT") if k in os.environ}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    os.environ.update(saved)


def train(capsys: pytest.CaptureFixture, log: Path, *args: str) -> tuple[int, str]:
    """``main(argv)`` in-process: the exit code (argparse's SystemExit included) and stderr."""
    try:
        rc = main([*BASE, "--log", str(log), *args])
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


def records(log: Path) -> tuple[dict[int, float], list[dict]]:
    losses, starts = {}, []
    if log.exists():
        for line in log.read_text().splitlines():
            obj = json.loads(line)
            if "loss" in obj:
                losses[obj["step"]] = obj["loss"]
            elif obj.get("event") == "start":
                starts.append(obj)
    return losses, starts


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 5-step run (the losses to compare with) and a checkpoint of steps 2 and 4."""
    d = tmp_path_factory.mktemp("hostile-trainer")
    ref_log, log = d / "ref.jsonl", d / "ckpt.jsonl"
    assert main([*BASE, "--steps", "5", "--log", str(ref_log)]) == 0
    assert main([*BASE, "--steps", "4", "--ckpt", str(d / "ckpt"), "--ckpt-every", "2", "--log", str(log)]) == 0
    losses, _ = records(ref_log)
    return {"d": d, "ckpt": d / "ckpt", "ref": losses}


def resumed_outcome(rc: int, err: str, log: Path, ref: dict[int, float], newest: int) -> str:
    """The outcome of a resume from a checkpoint whose newest step is ``newest``."""
    if rc == 2 and "error:" in err and "Traceback" not in err:
        return "refused"
    losses, starts = records(log)
    if rc != 0 or not starts:
        return "silent"
    start = starts[-1]
    same = all(abs(losses[s] - ref[s]) <= REL_TOL * abs(ref[s]) for s in losses)
    if start["step"] < newest and any(s["step"] == newest for s in start["skipped"]) and same:
        return "detected"
    return "identical" if same and start["step"] > 0 else "silent"


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _damage(sdir: Path, how: str) -> None:
    part, index = sdir / "rank-00000.safetensors", sdir / "rank-00000.json"
    chunks = read_part_chunks(str(sdir), 0)
    if how == "data byte":
        _flip(part, chunks[0]["offset"] + 3)
    elif how == "last data byte":
        _flip(part, part.stat().st_size - 1)
    elif how == "safetensors header":  # not read by loads (the index has the offsets): harmless
        _flip(part, 12)
    elif how == "truncated part":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif how == "index byte":
        _flip(index, index.stat().st_size // 3)
    elif how == "index digest":
        _flip(index, index.stat().st_size - 5)
    elif how == "manifest byte":
        _flip(sdir / "manifest.json", 40)
    elif how == "objects byte":
        _flip(sdir / "objects.pt", (sdir / "objects.pt").stat().st_size // 2)
    elif how == "empty objects":
        (sdir / "objects.pt").write_bytes(b"")
    else:
        raise AssertionError(how)


DAMAGE = ["data byte", "last data byte", "safetensors header", "truncated part", "index byte", "index digest",
          "manifest byte", "objects byte", "empty objects"]


@pytest.mark.timeout(180)
def test_damaged_newest_step_and_chosen_steps(base: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each damage of the newest step (4) resumes from step 2 naming step 4 as skipped (or, for
    bytes no load reads, resumes step 4 unchanged); ``--resume-step 4`` of the damaged step is
    refused, ``--resume-step 2`` resumes it, a missing step is refused."""
    t = Tally.of("trainer")
    for how in DAMAGE:
        ckpt = tmp_path / how.replace(" ", "-")
        shutil.copytree(base["ckpt"], ckpt)
        _damage(next(ckpt.glob("step-000000000004-*")), how)
        log = tmp_path / f"{ckpt.name}.jsonl"
        rc, err = train(capsys, log, "--steps", "5", "--ckpt", str(ckpt))
        outcome = resumed_outcome(rc, err, log, base["ref"], newest=4)
        t.record(outcome, f"newest step: {how}")
        assert outcome in ("detected", "identical"), (how, rc, err[-1500:], records(log)[1])
        if how == "data byte":
            for step, want in (("4", "refused"), ("2", "identical"), ("3", "refused"), ("0", "refused")):
                log2 = tmp_path / f"resume-{step}.jsonl"
                rc, err = train(capsys, log2, "--steps", "5", "--ckpt", str(ckpt), "--resume-step", step)
                outcome = resumed_outcome(rc, err, log2, base["ref"], newest=4)
                t.record(outcome, f"--resume-step {step} (step 4 damaged)")
                assert outcome == want, (step, rc, err[-1500:])
                if step == "2":
                    assert records(log2)[1][-1]["step"] == 2 and records(log2)[1][-1]["resume_step"] == 2
    t.assert_none_silent()


def _ro_mount(path: Path) -> bool:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True,
                         timeout=30)
    return res.returncode == 0


@pytest.mark.timeout(180)
def test_bad_checkpoint_options_are_refused_before_training(base: dict, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    t = Tally.of("trainer")
    afile = tmp_path / "afile"
    afile.write_text("x")
    short = tmp_path / "short.u16"
    short.write_bytes(b"\x01\x00" * 10)  # fewer tokens than one sample
    ckpt = str(base["ckpt"])
    cases: list[tuple[list[str], str]] = [
        (["--ckpt", str(tmp_path / "c"), "--keep-last", "0"], "--keep-last must be an integer >= 1, got 0"),
        (["--ckpt", str(tmp_path / "c"), "--keep-last", "-3"], "--keep-last must be an integer >= 1"),
        (["--ckpt", str(tmp_path / "c"), "--ckpt-every", "-1"], "--ckpt-every must be an integer >= 0"),
        (["--store", str(tmp_path / "s"), "--snapshot-every", "-2"], "--snapshot-every must be an integer >= 0"),
        (["--snapshot-every", "2"], "needs a host store to snapshot to: pass --store"),
        (["--resume-step", "2"], "--resume-step needs checkpoints to resume from"),
        (["--ckpt", ckpt, "--resume-step", "-1"], "--resume-step must be an integer >= 0"),
        (["--ckpt", ckpt, "--resume-step", "x"], "invalid int value"),
        (["--ckpt", ""], "--ckpt is empty"),
        (["--store", ""], "--store is empty"),
        (["--steps", "-1"], "--steps must be an integer >= 0"),
        (["--global-batch", "0"], "--global-batch must be an integer >= 1"),
        (["--micro-batch", "0"], "--micro-batch must be an integer >= 1"),
        (["--ckpt", "/proc/tenplex-ckpt"], "--ckpt /proc/tenplex-ckpt: cannot create and write files there"),
        (["--ckpt", "/proc/self/status/ckpt"], "cannot create and write files there"),
        (["--ckpt", f"{afile}/ckpt"], "NotADirectoryError"),
        (["--ckpt", str(afile)], "cannot create and write files there"),
        (["--ckpt", "nope://bucket/ckpt"], "--ckpt nope://bucket/ckpt: cannot create and write files there"),
        (["--store", "/proc/tenplex-store"], "--store /proc/tenplex-store: cannot create and write files there"),
        (["--store", f"{afile}/store"], "NotADirectoryError"),
        (["--store", "auto"], "--store auto needs TENPLEX_STORE_ROOT"),
        (["--ckpt", ckpt, "--resume-step", "3"], "no complete checkpoint of step 3"),
        (["--ckpt", ckpt, "--resume-step", "999999999999999"], "no complete checkpoint of step 999999999999999"),
        (["--ckpt", ckpt, "--global-batch", "16"], "trained with global batch 8, not 16"),
        (["--ckpt", ckpt, "--parallel", "tp=x"], "error:"),
        (["--data", str(tmp_path / "missing.u16")], "does not exist"),
        (["--data", str(short)], "fewer than one sample"),
    ]
    ro = tmp_path / "ro"
    mounted = _ro_mount(ro)
    try:
        if mounted:
            cases.append((["--ckpt", str(ro / "ckpt")], "OSError: Read-only file system"))
        for args, fragment in cases:
            log = tmp_path / "refused.jsonl"
            rc, err = train(capsys, log, "--steps", "5", *args)
            lines = [ln for ln in err.splitlines() if "error:" in ln]
            ok = rc == 2 and len(lines) == 1 and fragment in lines[0] and "Traceback" not in err
            ok = ok and not records(log)[0]  # not a single step
            t.record("refused" if ok else "silent", " ".join(args))
            assert ok, (args, rc, err[-1500:])
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=False, timeout=30)
    assert not (tmp_path / "c").exists() and not (tmp_path / "s").exists()
    t.assert_none_silent()


def _tokens(path: Path, seed: int) -> None:
    import numpy as np

    np.random.default_rng(seed).integers(0, 256, 64 * 65, dtype=np.uint16).tofile(path)


@pytest.mark.timeout(180)
def test_other_data_and_model_settings(base: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Resuming on other data (same name and size; one token changed) or with other model
    settings is refused; the same bytes under another path, or the flags, resume."""
    from test_train import checkpoint_of

    from tenplex.train import trainer_ptc

    t = Tally.of("trainer")
    data = tmp_path / "tokens.u16"
    _tokens(data, 1)
    ckpt, log = tmp_path / "ckpt", tmp_path / "data.jsonl"
    assert train(capsys, log, "--steps", "2", "--data", str(data), "--ckpt", str(ckpt))[0] == 0
    ref_log = tmp_path / "data-ref.jsonl"
    assert train(capsys, ref_log, "--steps", "3", "--data", str(data))[0] == 0
    ref = records(ref_log)[0]
    saved = data.read_bytes()
    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    variants = {
        "other tokens, same name and size": lambda: _tokens(data, 2),
        "one token changed": lambda: data.write_bytes(saved[:100] + bytes([saved[100] ^ 1]) + saved[101:]),
        "one token changed, mtime put back": lambda: (data.write_bytes(saved[:7] + b"\x07" + saved[8:]),
                                                       os.utime(data, ns=(0, 1_000_000_000))),
        "same bytes, another path": lambda: (other_dir / "tokens.u16").write_bytes(saved),
    }
    for name, make in variants.items():
        data.write_bytes(saved)
        os.utime(data, ns=(0, 1_000_000_000))
        make()
        path = other_dir / "tokens.u16" if "another path" in name else data
        run_ckpt = tmp_path / f"ck-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(ckpt, run_ckpt)
        log = tmp_path / f"{run_ckpt.name}.jsonl"
        rc, err = train(capsys, log, "--steps", "3", "--data", str(path), "--ckpt", str(run_ckpt))
        outcome = resumed_outcome(rc, err, log, ref, newest=2)
        t.record(outcome, f"data: {name}")
        assert outcome == ("identical" if "another path" in name else "refused"), (name, rc, err[-1500:])
        if outcome == "refused":
            assert "--allow-data-change" in err

    # other model settings: checkpoints written by the trainer's classes with overrides of tiny
    for overrides, flags in (({"heads": 4, "kv_heads": 2}, []), ({"heads": 16, "kv_heads": 8}, []),
                             ({"kv_heads": 8}, []), ({}, ["--seq-len", "32"]),
                             ({}, ["--model", "llama-small"]), ({}, ["--distributed-optimizer"])):
        ptc = trainer_ptc("tiny", distributed_optimizer=False, **overrides)
        mckpt = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        checkpoint_of(mckpt, ptc)
        log = tmp_path / f"{mckpt.name}.jsonl"
        rc, err = train(capsys, log, "--steps", "3", "--ckpt", str(mckpt), *flags)
        what = f"model: {overrides or ' '.join(flags)}"
        ok = rc == 2 and "error:" in err and not records(log)[0]
        t.record("refused" if ok else "silent", what)
        assert ok, (what, rc, err[-1500:])
    t.assert_none_silent()


@pytest.mark.timeout(120)
def test_a_sample_as_real_processes(base: dict, tmp_path: Path) -> None:
    """The same refusals through ``python -m tenplex.train``: exit code 2 and one error line (finding
    1: ``--keep-last 0`` and ``--ckpt /proc/x`` printed thread tracebacks and exited 0)."""
    t = Tally.of("trainer")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (tmp_path / "afile").write_text("x")
    cases = [(["--ckpt", "/proc/tenplex-x", "--ckpt-every", "1"], "cannot create and write files there"),
             (["--ckpt", str(tmp_path / "afile" / "c"), "--ckpt-every", "1"], "NotADirectoryError"),
             (["--ckpt", str(base["ckpt"]), "--resume-step", "3"], "no complete checkpoint of step 3"),
             (["--ckpt", str(tmp_path / "c"), "--ckpt-every", "1", "--keep-last", "0"],
              "--keep-last must be an integer >= 1")]
    procs = [subprocess.Popen([sys.executable, "-m", "tenplex.train", *BASE, "--steps", "3", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for (args, fragment), p in zip(cases, procs):
        out, err = p.communicate(timeout=100)
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        ok = p.returncode == 2 and len(lines) == 1 and fragment in lines[0] and not out.strip()
        t.record("refused" if ok else "silent", "process: " + " ".join(args))
        assert ok and "Exception in thread" not in err, (args, p.returncode, out, err)
    assert not (tmp_path / "c").exists()
    t.assert_none_silent()
