"""The torchtitan placement dumps in tests/fixtures/titan/ are self-consistent (no torchtitan needed).

They were written by scripts/titan_job.py (torchtitan 0.3.0's own Llama 3, CPU/gloo) and are
the fixture for tenplex's DTensor -> partition mapping (issue #17 item 4(b)).  Checked here:
each rank's ``index_runs`` agree with its local shape and ``global_offset``; across ranks the
blocks tile every tensor exactly (each element held by as many ranks as the placements
replicate it); and the distinct blocks are exactly the chunks DCP stored in ``.metadata``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent / "fixtures" / "titan" / "partial_dtensor"
CONFIGS = sorted(p.name for p in ROOT.iterdir() if (p / "titan_metadata_keys.json").exists()) if ROOT.exists() else []


def _lines(path: Path):
    return [json.loads(x.rstrip(",")) for x in path.read_text().splitlines()[1:-1]]


def _replication(e) -> int:
    return math.prod(n for n, p in zip(e["mesh_shape"], e["placements"]) if p.startswith("Replicate"))


@pytest.mark.parametrize("config", CONFIGS)
def test_titan_placements_tile_and_match_metadata(config):
    d = ROOT / config
    meta = {e["key"]: e for e in _lines(d / "titan_metadata_keys.json")}
    ranks = sorted(d.glob("placements/titan_checkpoint.rank*.json"))
    summary = json.loads((d / "summary.json").read_text())
    assert len(ranks) == summary["world"]
    blocks: dict[str, Counter] = {}
    entry = {}
    for f in ranks:
        for e in _lines(f):
            if e["type"] != "DTensor":
                continue
            runs = e["index_runs"]
            assert all(len(r) <= 1 for r in runs), (config, e["key"], "non-contiguous local shard")
            if not all(runs):
                continue  # empty local shard
            assert [r[0][1] - r[0][0] for r in runs] == e["local_shape"] == e["computed_local_shape"]
            assert [r[0][0] for r in runs] == e["global_offset"]
            blocks.setdefault(e["key"], Counter())[tuple(tuple(r[0]) for r in runs)] += 1
            entry[e["key"]] = e
    assert blocks, config
    for key, cnt in blocks.items():
        e = entry[key]
        # every element is covered, each by `replication` ranks (PP: per-stage meshes)
        assert sum(math.prod(b - a for a, b in blk) * n for blk, n in cnt.items()) == \
            math.prod(e["global_shape"]) * _replication(e), (config, key)
        assert set(cnt.values()) == {_replication(e)}, (config, key, cnt)
        stored = {(tuple(c["offsets"]), tuple(c["sizes"])) for c in meta[key]["chunks"]}
        held = {(tuple(a for a, _ in blk), tuple(b - a for a, b in blk)) for blk in cnt}
        assert stored == held, (config, key)
