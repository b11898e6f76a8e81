"""A user's DataLoader with worker processes through ``ElasticRuntime``'s in-process recovery
(``examples/elastic_loader.py`` on 4 gloo workers, rank 3 SIGKILLed in step 3): every global batch of
the run is the uninterrupted run's, read exactly once by the ranks of the final attempt of each step
(DP 4 before the kill, DP 3 after)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spawned import free_port, log_tails, script_workers, wait_procs
from tenplex.data import ids_at, loader_state

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "elastic_loader.py")
STEPS, N, BATCH = 7, 40, 12  # 84 positions: through two epoch ends


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dataloader_with_workers_keeps_its_position_through_an_in_process_recovery(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = script_workers(SCRIPT, tmp_path, 4, ["--ckpt", str(tmp_path / "ckpt"), "--steps", str(STEPS),
                                                 "--samples", str(N), "--global-batch", str(BATCH),
                                                 "--log", str(logs), "--kill-at", "3:3"], store.port)
    codes = wait_procs(procs, 220)
    assert codes == [0, 0, 0, -9], (codes, log_tails(tmp_path))
    recs = [json.loads(line) for f in sorted(logs.iterdir()) for line in f.read_text().splitlines()]
    order = ids_at(np.arange(STEPS * BATCH), N, 1, True, loader_state(N, BATCH).order).tolist()
    worlds = set()
    for step in range(STEPS):
        attempts: dict[int, list[dict]] = {}
        for rec in recs:
            if rec["step"] == step:
                attempts.setdefault(rec["world_size"], []).append(rec)
        final = max(attempts.values(), key=lambda group: min(r["t"] for r in group))  # the last attempt's ranks
        worlds.add(final[0]["world_size"])
        got = [i for rec in sorted(final, key=lambda r: r["dp_rank"]) for i in rec["ids"]]
        assert got == order[step * BATCH : (step + 1) * BATCH], (step, attempts)
    assert worlds == {4, 3}, worlds  # the steps before the kill on 4 workers, after it on 3
