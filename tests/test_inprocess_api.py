"""The in-process runtime's library surface (issue 30, the trainer side): one ring and SIGTERM flush
(``tenplex.elastic.ring``), one recovery (``tenplex.elastic.inprocess``), a pure membership protocol beside its
runtime, one ``url_fs``, configuration objects that say what is wrong, and an example that uses
public names only."""

from __future__ import annotations

import ast
import importlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import tenplex
from tenplex.data import load_index
from tenplex.elastic.inprocess import RecoveryConfig
from tenplex.elastic.ring import HeldAs, StateRing, exit_on_sigterm, flush_ring
from tenplex.errors import ConfigError, DataIndexError
from tenplex.layout.config import ParallelConfig
from tenplex.layout.state_layout import StateLayout
from tenplex.train.bubble_bench import BenchConfig
from tenplex.train.launch import HostsConfig
from tenplex.urls import url_fs

ROOT = Path(__file__).resolve().parent.parent


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4, 3, generator=g), "step": step}


def test_flush_writes_the_newest_unwritten_states_as_they_were_taken() -> None:
    ring = StateRing(3)
    for step in range(1, 5):
        ring.record(step, _state(step))
    assert flush_ring(ring, lambda *a: None, where="nowhere") == []  # not described yet: nothing to write as
    held_as = HeldAs(ParallelConfig(dp=2, tp=1, pp=1), 1, "abcd1234")
    ring.held_as = held_as
    written: list[tuple[HeldAs, int, torch.Tensor]] = []

    def write(as_: HeldAs, step: int, state: Any) -> None:
        if step == 3:
            raise OSError("disk full")  # logged, and the next step is still written
        written.append((as_, step, state["w"].clone()))

    # the two newest of the ring (2, 3, 4) and the extra step 5 the ring lacks, step 5 already written
    assert flush_ring(ring, write, where="the test", extra={5: _state(5), 4: {"w": torch.zeros(1)}},
                      skip={5}, newest=3) == [4]
    assert [(a, s) for a, s, _ in written] == [(held_as, 4)]
    assert torch.equal(written[0][2], _state(4)["w"])  # the ring's copy, not the extra one for a step it holds
    ring.clear()
    assert ring.held_as is None and flush_ring(ring, write, where="the test") == []


def test_sigterm_flushes_the_ring_then_exits(tmp_path: Path) -> None:
    """A real SIGTERM to a process that installed ``exit_on_sigterm``: the ring's two newest states
    are on disk, bit-exact, and the process exits with 128 + 15."""
    code = textwrap.dedent(f"""
        import sys, time, torch
        from tenplex.layout.config import ParallelConfig
        from tenplex.elastic.ring import HeldAs, StateRing, exit_on_sigterm, flush_ring
        ring = StateRing(3)
        for step in range(1, 5):
            g = torch.Generator().manual_seed(step)
            ring.record(step, {{"w": torch.randn(64, 64, generator=g)}})
        ring.held_as = HeldAs(ParallelConfig(dp=1, tp=1, pp=1), 0, "s")
        def write(as_, step, state):
            torch.save(state["w"], f"{tmp_path}/step{{step}}-rank{{as_.rank}}.pt")
        assert exit_on_sigterm(lambda: flush_ring(ring, write, where="{tmp_path}"))
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM
    finally:
        p.kill()
        p.wait()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["step3-rank0.pt", "step4-rank0.pt"]
    for step in (3, 4):
        want = torch.randn(64, 64, generator=torch.Generator().manual_seed(step))
        assert torch.equal(torch.load(tmp_path / f"step{step}-rank0.pt"), want)


def test_sigterm_handler_is_refused_off_the_main_thread() -> None:
    import threading

    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(exit_on_sigterm(lambda: None)))
    t.start()
    t.join()
    assert out == [False]


def test_configuration_objects_say_what_is_wrong() -> None:
    assert RecoveryConfig(url="/ckpt").sources == ("/ckpt",)
    assert RecoveryConfig(url=None, sources=["/store", "/ckpt"], tiers=[]).sources == ("/store", "/ckpt")
    with pytest.raises(ConfigError, match="gpus_per_host must be an integer >= 1, got 0"):
        RecoveryConfig(url="/ckpt", gpus_per_host=0)
    with pytest.raises(ConfigError, match="join_timeout must be > 0"):
        RecoveryConfig(url="/ckpt", join_timeout=0)
    with pytest.raises(ConfigError, match=r"global_batch 6 is not a multiple of micro_batch 4: 6 % 4 = 2"):
        BenchConfig(global_batch=6, micro_batch=4)
    with pytest.raises(ConfigError, match="pp must be an integer >= 2, got 1"):
        BenchConfig(pp=1)
    with pytest.raises(ConfigError, match="nproc must be an integer >= 1, got 0"):
        HostsConfig(2, "/tmp/w", ["--steps", "3"], nproc=0, endpoint="127.0.0.1:1", run_id="r")
    assert HostsConfig(2, "/tmp/w", ["--steps", "3"], nproc=2, endpoint="e", run_id="r").train_args == \
        ("--steps", "3")
    with pytest.raises(ConfigError, match="rank must be an integer >= 0, got -1"):
        HeldAs(ParallelConfig(dp=2, tp=1, pp=1), -1, "s")
    with pytest.raises(ConfigError, match="pass ptc="):
        HeldAs(StateLayout.of(1, []), 0, "s")


def test_one_url_fs_gives_one_clear_error(tmp_path: Path) -> None:
    """Checkpoints, dataset indexes and the bare function name the URL or the options alike
    (before: a raw ValueError or TypeError from fsspec for a checkpoint URL)."""
    with pytest.raises(ConfigError, match=r"cannot use 'foo://x' \(.*\): pass a local path"):
        tenplex.list_steps("foo://x")
    with pytest.raises(ConfigError, match="storage_options must map option names"):
        tenplex.list_steps(str(tmp_path), storage_options=[("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(DataIndexError, match="cannot use index 'foo://x/i.npz'"):
        load_index("foo://x/i.npz")
    with pytest.raises(ConfigError, match="the URL must be a non-empty string"):
        url_fs("")
    fs, root = url_fs(tmp_path / "a/")
    assert root == str(tmp_path / "a") and fs.protocol[0] in ("file", "local")


def test_the_membership_protocol_is_pure() -> None:
    """``tenplex.elastic.membership`` decides (no store, no threads, no links): importing it loads none of
    the runtime (before: one module held both)."""
    code = ("import sys, tenplex.elastic.membership as m; "
            "print(' '.join(sorted(x for x in sys.modules if x.startswith('tenplex.')))); "
            "print(hasattr(m, 'Membership'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT,
                         timeout=120).stdout.splitlines()
    assert "tenplex.elastic.liveness" not in out[0].split() and "tenplex.elastic.membership_runtime" not in out[0].split(), out
    assert out[1] == "False"
    from tenplex.elastic.membership_runtime import Membership  # noqa: F401 - the runtime is where it is named


def test_the_example_uses_public_names_and_nothing_of_the_trainer() -> None:
    """``examples/train_native.py`` is a client of the library's surface: no ``tenplex.train``, no
    underscore names, every name it imports listed in its module's ``__all__`` (or the package's)."""
    tree = ast.parse((ROOT / "examples" / "train_native.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tenplex":
            mod = importlib.import_module(node.module)
            for alias in node.names:
                found.append((node.module, alias.name))
                assert not node.module.startswith("tenplex.train"), node.module
                assert not alias.name.startswith("_"), (node.module, alias.name)
                assert alias.name in getattr(mod, "__all__", ()), (node.module, alias.name)
    # the recovery, the ring and its SIGTERM flush are the runtime's (issue 31): the example uses it by its public name
    assert "ElasticRuntime" in tenplex.__all__ and "ElasticRuntime" in (ROOT / "examples" / "train_native.py").read_text()
