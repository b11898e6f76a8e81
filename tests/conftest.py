"""Shared test set-up: the hypothesis profile and strategies for small models and layouts.

The helpers below are imported by the test modules (``from conftest import ...``); they draw
model shapes that tp=1/2/4 can split and layouts (even or uneven, zero-layer stages
included) that are valid for a drawn shape.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from spawned import free_port

from tenplex import ParallelConfig

# Multi-process tests simulate hosts with gloo on CPU, also on a machine with GPUs (it may have
# fewer GPUs than a test starts workers); test_train.py::test_trainer_on_cuda runs the CUDA path.
os.environ.setdefault("TENPLEX_DEVICE", "cpu")

settings.register_profile(
    "tenplex",
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("tenplex")

# Tests pin their own example counts (kept small so the suite stays fast); set
# TENPLEX_HYPOTHESIS_SCALE=20 for a long bug hunt.
_SCALE = float(os.environ.get("TENPLEX_HYPOTHESIS_SCALE", "1"))


def examples(n: int) -> int:
    """``n`` hypothesis examples, times TENPLEX_HYPOTHESIS_SCALE."""
    return max(1, round(n * _SCALE))

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def model_kwargs(draw: st.DrawFn, max_layers: int = 4) -> dict[str, Any]:
    """Keyword arguments of ``model_ptc`` for a small random GPT or Llama."""
    arch = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = heads if arch == "gpt" else draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    head_dim = draw(st.integers(1, 3))
    optimizer = draw(st.booleans())
    return dict(
        arch=arch,
        num_layers=draw(st.integers(1, max_layers)),
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=draw(st.sampled_from([2, 4, 6, 8, 12])),
        vocab=draw(st.integers(1, 40)),
        seq_len=draw(st.integers(1, 6)),
        tied_embeddings=draw(st.sampled_from([None, True, False])),
        vocab_pad=draw(st.sampled_from([1, 2, 3, 8])),
        dtype=draw(st.sampled_from(DTYPES)),
        optimizer=optimizer,
        distributed_optimizer=optimizer and draw(st.booleans()),
    )


def valid_tps(kw: dict[str, Any]) -> list[int]:
    kv = kw.get("kv_heads") or kw["heads"]
    return [t for t in (1, 2, 4) if kw["heads"] % t == 0 and kv % t == 0 and kw["ffn_hidden"] % t == 0]


@st.composite
def layouts(draw: st.DrawFn, kw: dict[str, Any], max_world: int = 16, max_dp: int = 3) -> ParallelConfig:
    """A layout valid for the model ``kw``: even stages, or uneven stages (zero-layer stages allowed)."""
    layers = kw["num_layers"]
    tp = draw(st.sampled_from(valid_tps(kw)))
    if draw(st.booleans()):
        pp = draw(st.integers(1, min(layers, max(1, max_world // tp))))
        stages = None
    else:
        pp = draw(st.integers(1, min(layers + 2, max(1, max_world // tp))))
        cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, layers]
        stages = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    dp = draw(st.integers(1, max(1, min(max_dp, max_world // (tp * pp)))))
    return ParallelConfig(dp=dp, tp=tp, pp=pp, stages=stages)


@st.composite
def failure_plans(draw: st.DrawFn, max_layers: int = 4, max_world: int = 16) -> tuple[Any, int, int]:
    """A plan from one random layout of a random model to another after random failures, on hosts
    of 1, 2 or 4 GPUs: (plan, GPUs per host, GPUs the topology needs; fresh devices follow the old ones)."""
    import tenplex  # lazy: conftest is imported before the test modules set up anything

    kw = draw(model_kwargs(max_layers=max_layers))
    old, new = draw(layouts(kw, max_world=max_world)), draw(layouts(kw, max_world=max_world))
    alive = draw(st.lists(st.integers(0, old.world_size - 1), unique=True, max_size=old.world_size))
    gph = draw(st.sampled_from([1, 2, 4]))
    p = tenplex.plan(tenplex.model_ptc(**kw), old, new, alive=alive, gpus_per_host=gph)
    return p, gph, max(old.world_size, int(p.devices.max()) + 1)


def random_global(ptc: Any, seed: int = 0) -> dict[str, Any]:
    """Random global tensors for every tensor of ``ptc`` (plus the step counter object)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, spec in ptc.tensors.items():
        if spec.dtype.is_floating_point:
            out[name] = torch.randn(spec.shape, generator=gen).to(spec.dtype)
        elif spec.dtype == torch.bool:
            out[name] = torch.randint(0, 2, spec.shape, generator=gen).bool()
        else:
            out[name] = torch.randint(-100, 100, spec.shape, generator=gen).to(spec.dtype)
    for obj in ptc.objects:
        out[obj] = {"value": 1234, "of": obj}
    return out


def canonical_flat(spec: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Canonical flat order computed with plain torch (split dim moved to the front)."""
    if spec.split_dim is None:
        return tensor.reshape(-1)
    return tensor.movedim(spec.split_dim, 0).contiguous().reshape(-1)


def assert_same(a: Any, b: Any, what: str = "") -> None:
    """Bit-for-bit equality of two tensors (dtype, shape and every bit)."""
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype, f"{what}: {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype.is_floating_point:
        ia = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32 if a.element_size() == 4
                                 else torch.int64)
        ib = b.contiguous().view(ia.dtype)
        assert torch.equal(ia, ib), f"{what}: bits differ"
    else:
        assert torch.equal(a, b), f"{what}: values differ"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Totals of the hostile-input suites (``tests/hostile.py``), when any ran."""
    from hostile import report

    rows = report()
    if not rows:
        return
    terminalreporter.section("hostile inputs")
    for area, row in rows.items():
        terminalreporter.write_line(
            f"{area:>12}: tried {row['tried']}, refused {row['refused']}, detected {row['detected']}, "
            f"identical {row['identical']}, silent {row['silent']}")


# ---------------------------------------------------------------------------------------------
# fixtures shared by several test modules
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def recfs():  # type: ignore[no-untyped-def]
    """The recording test filesystem (``recfs://``, tests/recording_fs.py), emptied before and after."""
    from recording_fs import RecordingFileSystem

    RecordingFileSystem.reset()
    yield RecordingFileSystem
    RecordingFileSystem.reset()


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 with bucket ``ckpt`` (its credentials in the environment meanwhile);
    yields the storage options to reach it. moto's servers in one process share one backend: tests
    that start several write under prefixes of their own."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    boto3 = pytest.importorskip("boto3")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(k, v)
        port = free_port()
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt")
            yield {"key": "x", "secret": "y", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        finally:
            server.stop()


@pytest.fixture
def s3() -> Iterator[dict[str, Any]]:
    """``moto_s3`` for one test."""
    with moto_s3() as opts:
        yield opts


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A fresh ``TENPLEX_RUNTIME_DIR`` for a module's store or mount processes (inherited by them)."""
    d = str(tmp_path_factory.mktemp("rt"))
    old = os.environ.get("TENPLEX_RUNTIME_DIR")
    os.environ["TENPLEX_RUNTIME_DIR"] = d
    yield d
    if old is None:
        del os.environ["TENPLEX_RUNTIME_DIR"]
    else:
        os.environ["TENPLEX_RUNTIME_DIR"] = old
