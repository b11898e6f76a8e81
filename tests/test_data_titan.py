"""torchtitan's Hugging Face text dataloader keeps its position across a DP mesh change through tenplex's
state (tenplex.data.titan): torchtitan's own dataset code, a local dataset and tokenizer the test writes."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from tenplex.data.titan import ElasticTitanDataloader

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, HuggingFaceTokenizer]:
    """60 documents of 3-30 words as a local JSON dataset (c4's layout: a "text" field) and a word-level
    tokenizer trained on them, in the files torchtitan's HuggingFaceTokenizer reads."""
    root = tmp_path_factory.mktemp("titan_data")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(50)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(60)]
    (root / "c4").mkdir()
    (root / "c4" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return str(root / "c4"), HuggingFaceTokenizer(tokenizer_path=str(root / "tok"))


def loader(corpus: tuple[str, Any], dp: int, rank: int, local: int, workers: int) -> ElasticTitanDataloader:
    path, tokenizer = corpus
    cfg = ElasticTitanDataloader.Config(dataset="c4_test", dataset_path=path, num_workers=workers, seed=7,
                                        prefetch_factor=2 if workers else None)
    return ElasticTitanDataloader(cfg, dp_world_size=dp, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ,
                                  local_batch_size=local)


def steps(loaders: list[ElasticTitanDataloader], n: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``n`` global batches of inputs (ranks' batches concatenated) and rank 0's state after them."""
    per_rank, state = [], None
    for lo in loaders:
        it = iter(lo)
        per_rank.append([next(it)[0]["input"] for _ in range(n)])
        if state is None:
            state = lo.state_dict()
        del it
    assert state is not None
    return [torch.cat([r[k] for r in per_rank]) for k in range(n)], state


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_torchtitans_loader_keeps_its_position_from_dp4_to_dp3(corpus: tuple[str, Any], workers: int) -> None:
    """DP 4 (local batch 3) for 3 steps, then rank 0's state into every rank of DP 3 (local batch 4): the
    packed sequences are those of an uninterrupted DP 1 run, each exactly once (through an epoch end)."""
    reference, _ = steps([loader(corpus, 1, 0, 12, 0)], 6)
    before, state = steps([loader(corpus, 4, r, 3, workers) for r in range(4)], 3)
    state = pickle.loads(pickle.dumps(state))
    after_loaders = [loader(corpus, 3, r, 4, workers) for r in range(3)]
    for lo in after_loaders:
        lo.load_state_dict(state)
    after, _ = steps(after_loaders, 3)
    got = torch.cat(before + after)
    assert torch.equal(got, torch.cat(reference))
    assert got.shape == (72, SEQ) and len({tuple(row.tolist()) for row in got}) > 60  # real, varied sequences


def test_torchtitans_own_loader_refuses_the_same_change(corpus: tuple[str, Any]) -> None:
    """What the elastic loader is for: torchtitan's HuggingFaceTextDataLoader asserts the DP size."""
    path, tokenizer = corpus
    cfg = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=path)
    old = HuggingFaceTextDataLoader(cfg, dp_world_size=4, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ,
                                    local_batch_size=3)
    next(iter(old))
    new = HuggingFaceTextDataLoader(cfg, dp_world_size=3, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ,
                                    local_batch_size=4)
    with pytest.raises(AssertionError, match="dataloader resharding is not supported"):
        new.load_state_dict(old.state_dict())
