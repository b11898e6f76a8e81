"""JSONL and plain text tokenised on the fly, with a tokenizer loaded from local files.

:class:`TextDocuments` indexes the lines of JSONL or text files (any fsspec URL, the ``jsonl``
kind of :func:`~tenplex.data.index.build_index`: one document per non-empty line) and tokenises
a document when it is read: item ``i`` is document ``i``'s token ids. It is also a
:class:`~tenplex.data.packing.DocumentSource`, so ``PackedDataset(docs, Packing.build(...))`` packs
it into fixed-length samples (the lengths are computed once, by one batched pass of the tokenizer).

Tokenizers (:func:`encoder`): a ``tiktoken.Encoding`` (e.g. built from a local BPE ranks file with
``tiktoken.load.load_tiktoken_bpe``), a ``transformers`` tokenizer (``AutoTokenizer.from_pretrained``
of a local directory), a ``tokenizers.Tokenizer``, or any callable ``list[str] -> list[list[int]]``.
No hub access is needed or attempted.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import DataIndexError
from .index import DataIndex, SourceReader, build_index

__all__ = ["TextDocuments", "encoder"]

log = logging.getLogger(__name__)
Encode = Callable[[list[str]], list[list[int]]]
_LENGTH_BATCH = 1024


def encoder(tokenizer: Any) -> Encode:
    """A batch encoder ``list[str] -> list[list[int]]`` for a tiktoken, transformers or tokenizers tokenizer
    (no special tokens added), or ``tokenizer`` itself when it is another callable."""
    if hasattr(tokenizer, "encode_ordinary_batch"):  # tiktoken.Encoding
        return lambda texts: tokenizer.encode_ordinary_batch(texts)
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    if hasattr(tokenizer, "batch_decode") and callable(tokenizer):  # transformers PreTrainedTokenizer(Fast)
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    if callable(tokenizer):
        return tokenizer
    raise DataIndexError(f"cannot tokenise with a {type(tokenizer).__name__}: pass a tiktoken Encoding, a "
                         "transformers or tokenizers tokenizer, or a callable list[str] -> list[list[int]]")


class TextDocuments(torch.utils.data.Dataset):
    """Documents of JSONL (``field`` of each line's object) or text files (each line), tokenised when read.

    ``eos``: a token id appended to every document (Megatron's ``--append-eod``). Item ``i`` is a 1-D
    int64 tensor; ``__getitems__`` tokenises a batch in one call, as the DataLoader asks for it.
    """

    def __init__(self, files: Sequence[str] | DataIndex, tokenizer: Any, *, field: str | None = "text",
                 eos: int | None = None) -> None:
        self.index = files if isinstance(files, DataIndex) else build_index(list(files), kind="jsonl")
        if self.index.kind != "jsonl":
            raise DataIndexError(f"TextDocuments reads a jsonl (line) index, got kind {self.index.kind!r}")
        self.tokenizer = tokenizer
        self.field = field
        self.eos = eos
        self._encode = encoder(tokenizer)
        self._reader: SourceReader | None = None
        self._pid = -1
        self._lengths: np.ndarray | None = None
        self._last: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None, "_encode": None, "_pid": -1, "_last": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._encode = encoder(self.tokenizer)

    def __len__(self) -> int:
        return self.index.num_samples

    def _source(self) -> SourceReader:
        if self._reader is None or self._pid != os.getpid():  # one reader (and descriptors) per loader worker
            self._reader = SourceReader(self.index.files)
            self._pid = os.getpid()
        return self._reader

    def texts(self, ids: Sequence[int]) -> list[str]:
        """The text of documents ``ids``: the JSON field, or the line without its newline."""
        fid, off, ln = self.index.sample_ranges(np.asarray(ids, dtype=np.int64))
        reader = self._source()
        out = []
        for f, o, n in zip(fid.tolist(), off.tolist(), ln.tolist()):
            raw = reader.read(f, o, n)
            if self.field is None:
                out.append(raw.decode("utf-8").rstrip("\r\n"))
                continue
            try:
                out.append(json.loads(raw)[self.field])
            except (ValueError, KeyError, TypeError) as e:
                raise DataIndexError(f"{self.index.files[f].url} at byte {o}: no string field {self.field!r} in "
                                     f"this line ({type(e).__name__}: {e})") from None
        return out

    def encode(self, ids: Sequence[int]) -> list[list[int]]:
        toks = self._encode(self.texts(ids))
        if self.eos is not None:
            toks = [[*t, self.eos] for t in toks]
        return toks

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.encode([int(i)])[0], dtype=torch.int64)

    def __getitems__(self, ids: Sequence[int]) -> list[torch.Tensor]:
        return [torch.tensor(t, dtype=torch.int64) for t in self.encode(list(ids))]

    def doc_lengths(self) -> np.ndarray:
        """Tokens per document (tokenises every document once, in batches; cached)."""
        if self._lengths is None:
            n = len(self)
            out = np.empty(n, dtype=np.int64)
            for a in range(0, n, _LENGTH_BATCH):
                ids = range(a, min(n, a + _LENGTH_BATCH))
                out[a : a + len(ids)] = [len(t) for t in self.encode(ids)]
            self._lengths = out
            log.info("tokenised %d documents: %d tokens", n, int(out.sum()))
        return self._lengths

    def doc_tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens ``[start, stop)`` of document ``doc`` (the last document read is kept: packed samples
        read a document's tail and the next sample its rest)."""
        if self._last is None or self._last[0] != doc:
            self._last = (doc, np.asarray(self.encode([doc])[0], dtype=np.int64))
        return self._last[1][start:stop]
