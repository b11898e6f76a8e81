"""Hostile inputs to every subcommand: each must end in exit code 2, one ``error:`` line and no traceback.

Most cases run in-process through :func:`tenplex.cli.main` (the same code path as the console
script, minus the interpreter start); a representative subset runs as real ``python -m tenplex``
subprocesses. ``store serve`` belongs to the store's own hostile suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hostile import Tally
from spawned import free_port

import tenplex
from tenplex.cli import main
from tenplex.data import build_index

BIG = str(10**30)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("hostile-cli")
    src = d / "src.bin"
    src.write_bytes(bytes(range(256)) * 4)
    idx = d / "idx.npz"
    build_index([str(src)], kind="records", record_bytes=8).save(str(idx))  # 128 samples
    blob = idx.read_bytes()
    (d / "trunc.npz").write_bytes(blob[: len(blob) // 2])
    (d / "garbage.npz").write_bytes(b"PK\x03\x04 not really a zip")
    (d / "bad.json").write_text("{not json")
    (d / "list.json").write_text("[1, 2]")
    (d / "topo.json").write_text('{"gpus_per_host": "x"}')
    (d / "afile").write_text("a regular file")
    (d / "mnt").mkdir()
    (d / "empty").mkdir()
    ptc, cfg = tenplex.model_ptc("tiny"), tenplex.ParallelConfig()
    shard = ptc.shard({n: torch.zeros(s.shape, dtype=s.dtype) for n, s in ptc.tensors.items()}, cfg)[0]
    tenplex.save(str(d / "damaged"), ptc, cfg, 0, shard, step=1)
    (next((d / "damaged").glob("step-*")) / "manifest.json").write_text("[1, 2]")
    return {"d": str(d), "src": str(src), "idx": str(idx), "trunc": str(d / "trunc.npz"),
            "garbage": str(d / "garbage.npz"), "bad_json": str(d / "bad.json"), "list_json": str(d / "list.json"),
            "topo": str(d / "topo.json"), "afile": str(d / "afile"), "mnt": str(d / "mnt"),
            "empty": str(d / "empty"), "damaged": str(d / "damaged"), "port": str(free_port())}


# (argv with {placeholders}, fragment the error line must contain)
PLAN = ["plan", "--model", "tiny", "--to", "dp=1"]
EST = ["estimate", "--model", "tiny", "--seq-len", "8", "--micro-batch", "1"]
CONF = ["configs", "--model", "tiny", "--gpu-mem", "80GiB", "--seq-len", "8", "--micro-batch", "1"]
SCHED = ["schedule", "--model", "tiny", "--from", "dp=2", "--to", "dp=1"]
MOUNT = ["mount", "{idx}", "{mnt}"]
CASES: list[tuple[list[str], str]] = [
    # plan
    (["plan", "--model", "gpt5", "--from", "dp=1", "--to", "dp=2"], "unknown model preset 'gpt5'; known: tiny"),
    (["plan", "--model", "", "--from", "dp=1", "--to", "dp=2"], "unknown model preset"),
    ([*PLAN, "--from", "dp=999999999999"], "999999999999 ranks, more than the 262144"),
    ([*PLAN, "--from", f"dp={BIG},tp={BIG}"], "ranks, more than the 262144"),
    ([*PLAN, "--from", "dp=2", "--alive", "0-999999999"], "--alive names rank 999999999, outside the old world"),
    ([*PLAN, "--from", "dp=2", "--alive", "5-1"], "rank range 5-1 is empty: write the lower rank first (1-5)"),
    ([*PLAN, "--from", "dp=2", "--alive", ""], "names no rank"),
    ([*PLAN, "--from", "dp=2", "--alive=-3"], "cannot parse rank list"),
    ([*PLAN, "--from", "dp=2", "--alive", "0,0"], "alive lists a rank twice"),
    ([*PLAN, "--from", "dp=0"], "dp must be a positive integer"),
    ([*PLAN, "--from", "dp=1e3"], "is not an integer"),
    ([*PLAN, "--from", "dp=2,zz=1"], "cannot parse layout"),
    ([*PLAN, "--from", "dp=2", "--gpus-per-host", "0"], "outside [1, 262144]"),
    ([*PLAN, "--from", "dp=2", "--gpus-per-host", "nan"], "is not an integer"),
    (["plan", "--model", "llama3-8b", "--from", "tp=3", "--to", "tp=4"], "tp=3 does not divide heads=32"),
    # estimate
    ([*EST, "--mem-fraction", "-1"], "--mem-fraction: -1 is outside (0, 1]"),
    ([*EST, "--mem-fraction", "nan"], "--mem-fraction: nan is outside (0, 1]"),
    ([*EST, "--mem-fraction", "inf"], "outside (0, 1]"),
    ([*EST, "--mem-fraction", "1.5"], "outside (0, 1]"),
    (["estimate", "--model", "tiny", "--seq-len", "0", "--micro-batch", "1"], "seq_len must be a positive integer"),
    (["estimate", "--model", "tiny", "--seq-len", BIG, "--micro-batch", "1"], "seq_len=10000"),
    (["estimate", "--model", "tiny", "--seq-len", "8", "--micro-batch", BIG], "micro_batch=10000"),
    ([*EST, "--dp", str(10**24)], "ranks, more than the 262144"),
    ([*EST, "--cp", str(10**21)], "dp*tp*pp*cp = 1*1000000000000000000000"),
    ([*EST, "--num-microbatches", "-1"], "num_microbatches must be a positive integer"),
    ([*EST, "--gpu-mem", "1e400GiB"], "is not finite"),
    ([*EST, "--gpu-mem", "lots"], "cannot parse size 'lots'"),
    ([*EST, "--gpu-mem", "0"], "a size must be positive"),
    ([*EST, "--layout", "dp=1,pp=2,stages=1+1+1"], "stages lists 3 layer counts but pp=2"),
    ([*EST, "--pp", "99"], "pp=99 is larger than the model's 4 layers"),
    # configs
    ([*CONF, "--gpus", "0", "--global-batch", "8"], "--gpus: 0 is outside [1, 262144]"),
    ([*CONF, "--gpus", "1000000000000", "--global-batch", "8"], "--gpus: 1000000000000 is outside"),
    ([*CONF, "--gpus", "8", "--global-batch", "8", "--flops", "nan"], "flops must be positive"),
    ([*CONF, "--gpus", "8", "--global-batch", "-1"], "global_batch must be a positive integer"),
    ([*CONF, "--gpus", "8", "--global-batch", "8", "--horizon-steps", "0"], "horizon_steps must be >= 1"),
    ([*CONF, "--gpus", "8", "--global-batch", "8", "--cp", "3"], "cp=3 does not divide 8 GPUs"),
    ([*CONF, "--gpus", "8", "--global-batch", "8", "--from", "dp=999999999999"], "ranks, more than the 262144"),
    # schedule
    (["schedule", "--model", "tiny", "--from", "dp=8", "--to", "dp=4", "--topology", "hosts=1,gpus=2"],
     "the move uses 8 devices"),
    ([*SCHED, "--topology", "hosts=1000000000,gpus=8"], "hosts*gpus = 1000000000*8 = 8000000000 GPUs"),
    ([*SCHED, "--topology", "bogus"], "cannot parse topology spec item 'bogus'"),
    ([*SCHED, "--topology", "/nope.json"], "cannot read topology JSON /nope.json"),
    ([*SCHED, "--topology", "{topo}"], "topo.json is malformed"),
    ([*SCHED, "--topology", "hosts=1,gpus=8", "--time-limit", "nan"], "--time-limit: nan is outside"),
    ([*SCHED, "--topology", "hosts=1,gpus=8", "--time-limit", "-1"], "--time-limit: -1 is outside"),
    ([*SCHED, "--topology", "hosts=1,gpus=8", "--chunk-bytes", "0"], "a size must be positive"),
    ([*SCHED, "--topology", "hosts=1,gpus=8", "--alive", "9"], "--alive names rank 9, outside the old world of 2"),
    ([*SCHED, "--topology", "hosts=0,gpus=8"], "must both be >= 1"),
    # inspect
    (["inspect", "foo://bar"], "cannot use 'foo://bar' (Protocol not known: foo): pass a local path"),
    (["inspect", "http://127.0.0.1:{port}/"], "Cannot connect to host 127.0.0.1:{port}"),
    (["inspect", "{d}/nope"], "does not exist: check the path"),
    (["inspect", "{damaged}"], "does not end in its SHA-256 digest; the file is damaged"),
    (["inspect", "{empty}", "--step", "-1"], "--step: -1 is outside"),
    (["inspect", "{damaged}", "--step", BIG], "is outside [0, 9223372036854775807]"),
    # import / export
    (["import", "{d}/x", "{d}/y", "--hf-config", "/nope.json"], "cannot read --hf-config /nope.json: No such file"),
    (["import", "{d}/x", "{d}/y", "--hf-config", "{bad_json}"], "is not JSON"),
    (["import", "{d}/x", "{d}/y", "--hf-config", "{list_json}"], "holds a list, not a JSON object"),
    (["import", "{d}/nope", "{d}/y"], "is neither a DCP checkpoint directory"),
    (["import", "{d}/nope", "foo://y"], "cannot use 'foo://y'"),
    (["import", "{d}/nope", "{d}/y", "--step", "-1"], "--step: -1 is outside"),
    (["import", "{d}/nope", "{d}/y", "--format", "zip"], "invalid choice: 'zip'"),
    (["export", "foo://x", "{d}/out.safetensors"], "cannot use 'foo://x'"),
    (["export", "{d}/nope", "{d}/out.safetensors"], "no complete checkpoint under"),
    (["export", "{damaged}", "{d}/out.safetensors"], "does not end in its SHA-256 digest; the file is damaged"),
    (["export", "http://127.0.0.1:{port}/ck", "{d}/out.safetensors"], "Cannot connect to host"),
    (["export", "{damaged}", "{d}/out.safetensors", "--step", "x"], "--step: 'x' is not an integer"),
    # data index
    (["data", "index", "{d}/o.npz", "{src}", "--tokens", "--seq-len", BIG], "samples must be smaller than 4 GiB"),
    (["data", "index", "{d}/o.npz", "{src}", "--record-bytes", BIG], "samples must be smaller than 4 GiB"),
    (["data", "index", "{d}/o.npz", "{src}", "--record-bytes", "0"], "--record-bytes must be >= 1"),
    (["data", "index", "{d}/o.npz", "{src}", "--record-bytes", "-1"], "--record-bytes must be >= 1"),
    (["data", "index", "{d}/o.npz", "{src}", "--tokens"], "--seq-len must be >= 1 for --tokens"),
    (["data", "index", "{d}/o.npz", "{src}", "--record-bytes", "2000"], "no samples found"),
    (["data", "index", "{d}/o.npz", "/nope", "--jsonl"], "source file /nope does not exist"),
    (["data", "index", "{d}/o.npz", "{d}", "--jsonl"], "is a directory"),
    (["data", "index", "{afile}/sub/o.npz", "{src}", "--jsonl"], "cannot write the index"),
    (["data", "index", "foo://x/o.npz", "{src}", "--jsonl"], "cannot use index 'foo://x/o.npz'"),
    (["data", "index", "{d}/o.npz", "foo://x", "--jsonl"], "cannot use source file 'foo://x'"),
    (["data", "index", "{d}/o.npz", "http://127.0.0.1:{port}/x", "--jsonl"], "source file"),
    (["data", "index", "{d}/o.npz", "{src}", "--jsonl", "--record-bytes", "8"], "not allowed with argument"),
    # mount
    ([*MOUNT, "--dp", "0"], "dp must be >= 1"),
    ([*MOUNT, "--dp", "2", "--global-batch", "0"], "global_batch must be >= 1"),
    ([*MOUNT, "--dp", BIG, "--global-batch", BIG], "dp must be <="),
    ([*MOUNT, "--dp", "200", "--global-batch", "200"], "dp=200 is larger than the index's 128 samples"),
    ([*MOUNT, "--dp", "1", "--global-batch", "129"], "global batch 129 is larger than the index's 128 samples"),
    ([*MOUNT, "--dp", "3", "--global-batch", "4"], "not divisible by dp=3"),
    ([*MOUNT, "--dp", "1", "--progress", "-1"], "progress must be >= 0"),
    ([*MOUNT, "--dp", "1", "--progress", "1e300"], "invalid int value"),
    ([*MOUNT, "--dp", "1", "--seed", "-1"], "seed must be >= 0"),
    ([*MOUNT, "--dp", "1", "--epochs", "-1"], "num_epochs must be >= 0"),
    ([*MOUNT, "--dp", "1", "--epochs", "1000000000"], "more than 64 epochs"),
    ([*MOUNT, "--dp", "1", "--read-ahead-kib", "-1"], "--read-ahead-kib: -1 is outside"),
    ([*MOUNT, "--dp", "1", "--seed", "1", "--no-shuffle"], "not allowed with argument"),
    (["mount", "{trunc}", "{mnt}", "--dp", "1"], "trunc.npz is not a tenplex dataset index or is truncated"),
    (["mount", "{garbage}", "{mnt}", "--dp", "1"], "garbage.npz is not a tenplex dataset index"),
    (["mount", "{d}/none.npz", "{mnt}", "--dp", "1"], "no dataset index at"),
    (["mount", "foo://x.npz", "{mnt}", "--dp", "1"], "cannot use index 'foo://x.npz'"),
    (["mount", "{idx}", "{d}/nodir", "--dp", "1"], "does not exist: create it first (mkdir -p"),
    (["mount", "{idx}", "{afile}", "--dp", "1"], "is not a directory"),
    # remount, mount-store, bench, top level
    (["remount", "{mnt}", "--dp", "1"], "no tenplex mount serves"),
    (["remount", "{mnt}", "--dp", "x"], "invalid int value: 'x'"),
    (["mount-store", "/nope", "{mnt}"], "store root /nope is not a directory"),
    (["bench", "bubbles", "--nope"], "unrecognized arguments: --nope"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: command"),
    (["plan", "--model", "tiny", "--from", "dp=1"], "the following arguments are required: --to"),
    # storage options (inspect / import / export): appended here so that SUBPROCESS's indexes stay
    (["inspect", "{d}", "--storage-option", "anon"], "--storage-option: 'anon' is not KEY=VALUE"),
    (["inspect", "{d}", "--storage-option", "=1"], "'=1' is not KEY=VALUE"),
    (["inspect", "{d}", "--storage-option", "end point=x"], "option name 'end point' is not a keyword name"),
    (["inspect", "{damaged}", "--storage-option", "a=1", "--storage-option", "a=[2]"],
     "--storage-option a is given twice (1 and [2])"),
    (["inspect", "http://127.0.0.1:{port}/", "--storage-option", "client_kwargs=5"],
     "the filesystem refused the storage options --storage-option client_kwargs"),
    (["inspect", "http://127.0.0.1:{port}/", "--storage-option", "bogus_option=1"],
     "refused the storage options --storage-option bogus_option (ClientSession._request() got an unexpected"),
    (["import", "{d}/x", "{d}/y", "--source-storage-option", "x"], "--source-storage-option: 'x' is not KEY=VALUE"),
    (["import", "{d}/x", "{d}/y", "--storage-option", "9lives=1"], "option name '9lives' is not a keyword name"),
    (["import", "{d}/x", "{d}/y", "--source-storage-option", "k=1", "--source-storage-option", "k=1"],
     "--source-storage-option k is given twice"),
    (["import", "http://127.0.0.1:{port}/hf", "{d}/y", "--source-storage-option", "bogus_option=1"],
     "refused the storage options --source-storage-option bogus_option"),
    (["export", "{damaged}", "{d}/out.safetensors", "--out-storage-option", ""], "'' is not KEY=VALUE"),
    (["export", "{damaged}", "{d}/out.safetensors", "--storage-option", "t=1", "--storage-option", "t=2"],
     "--storage-option t is given twice (1 and 2)"),
    (["export", "http://127.0.0.1:{port}/ck", "{d}/out.safetensors", "--storage-option", "bogus_option=true"],
     "refused the storage options --storage-option bogus_option"),
    (["export", "{d}/nope", "foo://out", "--out-storage-option", "a=1"], "cannot use 'foo://out'"),
]
SUBPROCESS = {2, 4, 16, 48, 55, 93}  # indexes of CASES also run as real processes (each imports torch: ~2 s)


def _fill(args: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in args]


def _verdict(rc: object, err: str, fragment: str) -> str | None:
    """None when the run was refused cleanly, else what was wrong."""
    if "Traceback" in err:
        return "traceback: " + err.strip().splitlines()[-1]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    if rc != 2:
        return f"exit code {rc}"
    if len(lines) != 1 or not lines[0].startswith("tenplex"):
        return f"{len(lines)} error lines: {lines}"
    if fragment not in lines[0]:
        return f"message lacks {fragment!r}: {lines[0]}"
    return None


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    try:
        rc: object = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_every_subcommand_refuses_bad_inputs(files, capsys) -> None:  # type: ignore[no-untyped-def]
    t = Tally.of("cli")
    problems = []
    try:
        for argv, fragment in CASES:
            args, frag = _fill(argv, files), fragment.format(**files)
            why = _verdict(*_in_process(args, capsys), frag)
            what = "tenplex " + " ".join(args)
            t.record("refused" if why is None else "silent", what)
            if why:
                problems.append(f"{what}: {why}")
    finally:
        if os.path.ismount(files["mnt"]):  # a case that was accepted by mistake must not leave a mount behind
            subprocess.run(["fusermount3", "-u", "-z", files["mnt"]], capture_output=True, timeout=10)
    assert not problems, "\n".join(problems)
    t.assert_none_silent()


@pytest.mark.timeout(180)
def test_real_processes_refuse_bad_inputs(files) -> None:  # type: ignore[no-untyped-def]
    """A sample of the cases as ``python -m tenplex`` processes (run side by side)."""
    t = Tally.of("cli")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(tenplex.__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    procs = []
    for i in sorted(SUBPROCESS):
        argv, fragment = CASES[i]
        args = _fill(argv, files)
        procs.append((args, fragment.format(**files), subprocess.Popen(
            [sys.executable, "-m", "tenplex", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)))
    problems = []
    for args, fragment, proc in procs:
        _, err = proc.communicate(timeout=150)
        why = _verdict(proc.returncode, err, fragment)
        t.record("refused" if why is None else "silent", "python -m tenplex " + " ".join(args))
        if why:
            problems.append(f"{' '.join(args)}: {why}")
    assert not problems, "\n".join(problems)
    t.assert_none_silent()


def test_error_lines_are_single_lines() -> None:
    """A multi-line message (e.g. a mount process's log) is printed on one line."""
    from tenplex.cli import _one_line

    assert _one_line("a\n  b\n\nc") == "a | b | c"
    assert _one_line("") == "failed (no message)"
