"""torchtitan's Hugging Face text dataloader, elastic: its position survives a change of the DP mesh.

torchtitan's ``HuggingFaceTextDataLoader`` splits the documents by DP rank
(``split_dataset_by_node``), packs each rank's into ``seq_len`` sequences with a rank-local token
buffer, and refuses a state saved under another DP size. :class:`ElasticTitanDataloader` takes the
same config and arguments; underneath, torchtitan's own ``HuggingFaceTextDataset`` packs the whole
document stream in tenplex's global order (``ElasticIterable``, seeded "feistel" shuffle, epochs), so
packed sequence ``k`` is the same on every rank and under every layout, and DP rank ``r`` of ``dp``
yields sequences ``[r * local_batch_size, (r + 1) * local_batch_size)`` of every global batch of
``dp * local_batch_size`` sequences. The state (document position, packing buffers, the packed
sequence a rank reached and the first of its next step) names global positions only, so the state
saved by any rank of DP N loads into every rank of DP M and the run continues with the next global
batch: every packed sequence exactly once, in the uninterrupted order. With worker processes the
global batch (``local_batch_size * dp``) must stay the same across the change (each worker resumes
its own steps); with ``num_workers`` 0 it may change.
The price: every rank (and every worker) tokenizes the whole document stream, ``dp * num_workers``
times the tokenizing of torchtitan's split (cheap next to a step; a pre-packed map-style dataset
through :class:`~tenplex.data.loader.ElasticBatchSampler` avoids it).

Imports torchtitan; imported by nothing in tenplex.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

from ..errors import DataStateError
from .loader import ElasticBatchSampler, ElasticIterable
from .partition import DataState, checked_int

__all__ = ["ElasticTitanDataloader", "PackedSequences"]

log = logging.getLogger(__name__)


class PackedSequences(IterableDataset):
    """DP rank ``dp_rank``'s share of the packed sequences of ``text`` (a ``HuggingFaceTextDataset``
    reading every document in tenplex's order): ``local_batch`` consecutive sequences of every global
    batch of ``dp_size * local_batch``; worker ``w`` of ``W`` takes steps ``w, w + W, ...``."""

    def __init__(self, text: HuggingFaceTextDataset, local_batch: int, dp_size: int, dp_rank: int) -> None:
        super().__init__()
        self.text, self.local_batch, self.dp_size, self.dp_rank = text, local_batch, dp_size, dp_rank
        self.position = 0  # the next packed sequence (global)
        self._next_mine: int | None = None  # in an iteration: the first sequence of this worker's next step

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp_size

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        g, lo = self.global_batch, self.dp_rank * self.local_batch
        if self._next_mine is None:
            self._next_mine = self.position + w * g
        for item in self.text:
            k = self.position
            self.position += 1
            step_offset = k - self._next_mine
            if lo <= step_offset < lo + self.local_batch:
                if step_offset == lo + self.local_batch - 1:  # counted before it is yielded: at a batch boundary
                    self._next_mine += workers * g           # the state points at this worker's next step
                yield item
        self._next_mine = None

    def state_dict(self) -> dict[str, Any]:
        sd = {"text": copy.deepcopy(self.text.state_dict()), "position": self.position, "global_batch": self.global_batch}
        if self._next_mine is not None:
            sd["next_mine"] = self._next_mine
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.text.load_state_dict(copy.deepcopy(sd["text"]))
        self.position = checked_int("position", sd["position"], 0, 1 << 62)
        nxt = sd.get("next_mine")
        info = get_worker_info()
        if nxt is not None and info is not None and info.num_workers > 1 and sd["global_batch"] != self.global_batch:
            raise DataStateError(f"a worker's state of global batch {sd['global_batch']} loaded into global batch "
                                 f"{self.global_batch} with {info.num_workers} workers: its steps would not line up; "
                                 "keep the global batch (local_batch_size * dp) or use num_workers 0 or 1")
        self._next_mine = None if nxt is None or sd["global_batch"] != self.global_batch else \
            checked_int("next_mine", nxt, 0, 1 << 62)


class ElasticTitanDataloader(ParallelAwareDataloader):
    """torchtitan's ``HuggingFaceTextDataLoader`` (same config and arguments) whose state loads under
    any DP size (module docstring). ``config.seed`` seeds the document order."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        seed: int = 0
        """Seed of tenplex's document order."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, seq_len: int,
                 local_batch_size: int, **kwargs: Any) -> None:
        text = HuggingFaceTextDataset(dataset_name=config.dataset, dataset_path=config.dataset_path,
                                      tokenizer=tokenizer, seq_len=seq_len, infinite=config.infinite)
        docs = text._original_data  # noqa: SLF001 - the documents it loaded (its DP 1 split: all of them)
        if not hasattr(docs, "__len__"):
            raise DataStateError(f"dataset {config.dataset!r} is streamed (no length): the elastic order needs a "
                                 "map-style dataset (load it without streaming=True)")
        order = ElasticBatchSampler(DataState(len(docs), 1, seed=config.seed, order="feistel"))
        # torchtitan's packing reads this instead of its rank's split: every document, in tenplex's order
        text._data = ElasticIterable(docs, order, split_workers=False)  # noqa: SLF001 - the attribute it reads
        kw = {"num_workers": config.num_workers, "persistent_workers": config.persistent_workers,
              "pin_memory": config.pin_memory, "prefetch_factor": config.prefetch_factor,
              "snapshot_every_n_steps": kwargs.get("snapshot_every_n_steps", 1), "batch_size": local_batch_size}
        super().__init__(PackedSequences(text, local_batch_size, dp_world_size, dp_rank), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, **kw)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by any DP rank of any DP size (its own rank's entry when present)."""
        if not state_dict:
            return
        own = f"dp_rank_{self.dp_rank}"
        keys = [own] if own in state_dict else sorted(k for k in state_dict if k.startswith("dp_rank_"))
        if not keys:
            log.warning("dataloader state without a dp_rank_* entry: starting from the beginning")
            return
        StatefulDataLoader.load_state_dict(self, pickle.loads(state_dict[keys[0]]))  # noqa: S301 - the job's own state
