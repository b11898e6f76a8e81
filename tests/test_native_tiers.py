"""A torch-native job's ``rescale(url, state_dict, tiers=...)`` reads host stores (issue #30 item 3).

Before, the state-dict path refused ``tiers=`` (ConfigError: the torch-native path could not use
host stores). Here a real gloo world of 4 saves FSDP2-style DTensors (``dp_shard=4``) with
``save_state_dict`` into two real host stores on loopback (old rank r writes to host ``r % 2``); a
world of 2 on another mesh (``dp_shard=2``, one rank per host) rescales from the stores' tiers:
bit-exact, and every byte of a part on this rank's host is read from the local store, every other
one from the peer store over HTTP, none from persistent storage.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from spawned import free_port, run_spawned
from tenplex.store import StoreServer

TOKEN = "0123456789abcdef0123456789abcdef"
SHAPES = {"w": (8, 16), "b": (8,)}
OLD_WORLD, NEW_WORLD = 4, 2


def _global() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def _state_dict(world: int, values: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``{"model": {name: DTensor sharded on dim 0 over a (dp_shard=world) mesh}, "step": ...}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    glob = values or {k: torch.zeros(shape) for k, shape in SHAPES.items()}
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in glob.items()},
            "step": 5 if values is not None else -1}


def _worker(phase: str, rank: int, port: int, roots: list[str], urls: list[str], out: Any) -> None:
    import torch.distributed as dist

    from tenplex.elastic import rescale
    from tenplex.native.state_dict import save_state_dict
    from tenplex.store import HostStore, recovery_tiers

    res: dict[str, Any] = {"error": None}
    try:
        world = OLD_WORLD if phase == "save" else NEW_WORLD
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        if phase == "save":  # old rank r on host r % 2: writes its part into that host's store
            save_state_dict(_state_dict(world, _global()), roots[rank % 2], step=5)
        else:  # new rank r on host r: this host's store, the other's over HTTP, no persistent storage
            sd = _state_dict(world, None)
            tiers = recovery_tiers(HostStore(roots[rank], urls[rank], TOKEN), urls, None, token=TOKEN)
            got = rescale(None, sd, tiers=tiers, gpus_per_host=1)
            res.update(step=got.step, fresh=got.fresh, live=got.live, by_tier=dict(got.bytes_by_tier),
                       read=got.load_stats.bytes_read, needed=got.load_stats.bytes_needed, value=sd["step"],
                       local={k: v.to_local().clone() for k, v in sd["model"].items()})
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res["error"] = f"{type(e).__name__}: {e}"
    out.put((phase, rank, res))


@pytest.mark.timeout(180)
def test_state_dict_rescale_reads_host_store_tiers_bit_exact(tmp_path: Path) -> None:
    servers = [StoreServer(str(tmp_path / f"host{i}"), token=TOKEN, replicas=1) for i in range(2)]
    for s in servers:
        s.peers = [x.address for x in servers]
        s.start()
    try:
        roots, urls = [str(s.root) for s in servers], [s.address for s in servers]
        port = free_port()
        saved = run_spawned(_worker, [("save", r, port, roots, urls) for r in range(OLD_WORLD)], expect=OLD_WORLD,
                            timeout=120)
        assert all(not r["error"] for r in saved.values()), saved
        port = free_port()
        got = run_spawned(_worker, [("load", r, port, roots, urls) for r in range(NEW_WORLD)], expect=NEW_WORLD,
                          timeout=120)
    finally:
        for s in servers:
            s.shutdown()
    assert all(not r["error"] for r in got.values()), got
    glob = _global()
    rows = {k: shape[0] // NEW_WORLD for k, shape in SHAPES.items()}
    # one old part (a quarter of every tensor) per host: new rank r needs old ranks 2r (host 0) and 2r + 1 (host 1)
    part = sum(shape[0] // OLD_WORLD * (shape[1] if len(shape) > 1 else 1) * 4 for shape in SHAPES.values())
    for r in range(NEW_WORLD):
        res = got[("load", r)]
        assert (res["step"], res["fresh"], res["live"], res["value"]) == (5, False, False, 5)
        for k, t in glob.items():
            assert torch.equal(res["local"][k], t[r * rows[k]:(r + 1) * rows[k]]), (r, k)
        assert res["by_tier"] == {"local": part, "peer": part}, res["by_tier"]
        assert res["read"] == res["needed"] == 2 * part
