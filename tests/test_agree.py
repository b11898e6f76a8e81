"""One agree-on-step rule (issue #30 item 3): ``load_state_dict`` settles ranks as ``agree_on_step`` does.

Ranks that saw different damage load different steps. Before, ``load_state_dict`` reloaded exactly
the oldest step any rank loaded; a rank for which that step was damaged too raised alone while the
others returned with it. Now the ranks apply ``tenplex.native.agree.agree_step``: a rank reloads the newest
step not newer than the bound that verifies for it, and the ranks repeat until they agree.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from spawned import free_port, run_spawned

SHAPE = (8, 256)
STEPS = (18, 19, 20)


def _values(step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(step))


def _worker(phase: str, rank: int, port: int, url: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tenplex.native.state_dict import load_state_dict, save_state_dict

    res: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        if phase == "save":
            for step in STEPS:
                save_state_dict({"w": distribute_tensor(_values(step), mesh, [Shard(0)])}, url, step=step)
        else:
            sd = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)])}
            got = load_state_dict(sd, url)
            res.update(step=got.step, local=sd["w"].to_local().clone())
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res["error"] = f"{type(e).__name__}: {e}"
    out.put((phase, rank, res))


def _damage(url: str, step: int, rank: int) -> None:
    """Flip the last data byte of ``rank``'s part of ``step`` (only that rank reads it)."""
    (part,) = Path(url).glob(f"step-{step:012d}-*/rank-{rank:05d}.safetensors")
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))


@pytest.mark.timeout(180)
def test_ranks_agree_on_the_newest_step_every_rank_can_load(tmp_path: Path) -> None:
    """Step 20 is damaged for rank 0 only and step 19 for rank 1 only: rank 0 falls back to 19, rank 1
    loads 20. Before, rank 1 reloaded exactly step 19, failed and raised alone (rank 0 returned step
    19). Now both end on step 18, bit for bit."""
    url = str(tmp_path / "ckpt")
    port = free_port()
    saved = run_spawned(_worker, [("save", r, port, url) for r in range(2)], expect=2, timeout=120)
    assert all(not r["error"] for r in saved.values()), saved
    _damage(url, 20, 0)
    _damage(url, 19, 1)
    port = free_port()
    got = run_spawned(_worker, [("load", r, port, url) for r in range(2)], expect=2, timeout=120)
    assert all(not r["error"] for r in got.values()), got
    want = _values(18)
    for r in range(2):
        assert got[("load", r)]["step"] == 18
        assert torch.equal(got[("load", r)]["local"], want[r * 4:(r + 1) * 4])
