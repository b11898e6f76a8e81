"""Samples per second through tenplex's sources and rank order vs the plain torch DataLoader a user writes (#32).

    python scripts/bench_data.py              # 3 runs per format, prints a table
    python scripts/bench_data.py --json       # also writes docs/bench/bench_data.json; last line: one JSON object

Three formats over the same files, both sides in ``DataLoader(batch_size, num_workers)``:

- ``jsonl_tokenized``: JSONL whose text is tokenised on the fly by a transformers tokenizer loaded from a
  local directory. Plain: a Dataset holding the file's lines, ``json.loads`` + the tokenizer per item.
  tenplex: :class:`tenplex.data.TextDocuments` (byte-range index, batched tokenisation).
- ``megatron_bin``: a Megatron ``.bin``/``.idx``, samples of ``seq_len + 1`` tokens. Plain: numpy memmap of
  the ``.bin`` cut into consecutive windows. tenplex: :func:`tenplex.data.megatron_gpt_dataset` (GPTDataset's
  shuffled documents and sample index).
- ``parquet``: a Parquet file of token rows. Plain: ``datasets`` + ``with_format("torch")``. tenplex:
  :class:`tenplex.data.HFSamples` over the same ``datasets.Dataset``.

The plain side shuffles with ``shuffle=True``; the tenplex side reads through the resharding sampler a
job uses, :class:`tenplex.data.ElasticBatchSampler` (rank 0 of DP 1, the "feistel" order). A pass times ``--samples`` samples
(default ``PASS_SAMPLES``: 24,000 of the ``.bin``, half its file, 6,000 of the others; about 0.6 s a pass on
2 cores each) after every worker's first batch is in: worker start-up, which
a job pays once an epoch (never with ``persistent_workers``), is excluded on both sides. (The ``.bin``'s
pass was 6,000 samples, 0.17 s: its runs' ratios spread 0.84-1.07 within one invocation on a shared
machine, wider than the goal's margin; with 24,000 samples, 0.94-1.05.) (Before: 1500
samples after worker 0's first batch only; worker 1's first batch came 4-8 ms later and the first ~16
batches ran 1.2-2x slower than the steady state on both sides, a large share of a 55 ms window.) A run
is ``--pairs`` adjacent (plain, tenplex) passes in alternating
order and its figures are the medians over its pairs. ``ratio`` is tenplex's samples/s over plain's.
``fetch_us_*``: microseconds a sample to fetch and collate a batch in-process (what a worker does), the
minimum of ``--fetch-rounds`` alternating rounds per run, and ``fetch_ratio`` plain's over tenplex's.
``cpu_us_*``: CPU microseconds a sample of a whole pass, the main process and its workers together (their
start-up, their batches' hand-off to the main process, the sampler), the median over a run's pairs, and
``cpu_ratio`` plain's over tenplex's: on a loaded machine, where loader rates swing with the scheduler,
these two are the stable comparisons (the in-process fetch alone missed a worker's cost: in a worker each
batch starts with cold caches, where a dozen numpy calls a batch cost ~4 us a sample).
``restore_ms_per_rank``: a run over 10^9 samples (global batch 1024, "feistel" order) stops in its fourth
epoch under DP 8; every rank of DP 6 (uneven: 6 does not divide 1024) decodes the saved JSON, loads it
(``ElasticBatchSampler.load_state_dict``) and computes its first batch's ids: ms per rank, over
``--restore-repeats`` x 6 rank restores (goal <= 10 ms; no pass over the sample list). For contrast the same
restore in the PCG64 order (the permutation materialised, O(n)) at 10^7 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tenplex.data import (  # noqa: E402
    DataState,
    ElasticBatchSampler,
    HFSamples,
    TextDocuments,
    hf_dataset,
    loader_state,
    megatron_gpt_dataset,
    sample_order,
    write_megatron,
)

OUT = ROOT / "docs" / "bench" / "bench_data.json"
WORDS = ("tenplex elastic data loader sample shard rank layout epoch token parallel tensor pipeline model "
         "checkpoint resume state order batch worker stream packed document megatron arrow parquet").split()


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def tenplex_sampler(num_samples: int, batch: int, seed: int = 0) -> ElasticBatchSampler:
    """The batches rank 0 of DP 1 reads through the resharding sampler, one epoch."""
    return ElasticBatchSampler(loader_state(num_samples, batch, seed=seed), 1, 0, num_epochs=1)


RESTORE_N, RESTORE_BATCH, RESTORE_DP = 10**9, 1024, (8, 6)


def _restore_ms(saved: str, start: DataState, dp: int, rank: int) -> float:
    """One rank's restore: decode the saved state, load it, compute its first batch's ids (ms)."""
    sampler = ElasticBatchSampler(start, dp, rank)
    t0 = time.perf_counter()
    sampler.load_state_dict(json.loads(saved))
    ids = next(iter(sampler))
    ms = (time.perf_counter() - t0) * 1e3
    assert len(ids) in (start.global_batch // dp, start.global_batch // dp + 1)
    return ms


def _restores(num_samples: int, order: str, repeats: int) -> list[float]:
    old_dp, new_dp = RESTORE_DP
    start = DataState(num_samples, RESTORE_BATCH, seed=1234, order=order)
    old = ElasticBatchSampler(start, old_dp, 0)
    consumed = 3 * num_samples + 1_234_567 * RESTORE_BATCH % num_samples
    old.load_state_dict({"data": {**start.to_json(), "consumed": consumed}})
    saved = json.dumps(old.state_dict())
    runs = []
    for _ in range(repeats):
        for r in range(new_dp):
            sample_order.cache_clear()  # each rank restores cold (its own process): no permutation kept
            runs.append(_restore_ms(saved, start, new_dp, r))
    return runs


def restore_ms_per_rank(repeats: int = 5) -> dict[str, Any]:
    """Restoring the data position under a new layout, ms per rank at 10^9 samples (issue #32's goal)."""
    feistel = _restores(RESTORE_N, "feistel", repeats)
    pcg = _restores(10**7, "pcg64", max(1, repeats // 2))
    return {**spread(feistel), "num_samples": RESTORE_N, "global_batch": RESTORE_BATCH,
            "dp": "%d->%d" % RESTORE_DP, "order": "feistel", "goal_ms": 10.0,
            "pcg64_at_1e7": spread(pcg)}


def pad_collate(batch: list[Any]) -> torch.Tensor:
    if isinstance(batch[0], dict):
        batch = [b["input_ids"] for b in batch]
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)


# ------------------------------------------------------------------------------------------------
# the files and the two sides of each format
# ------------------------------------------------------------------------------------------------
def make_tokenizer(d: str, texts: list[str]) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    return AutoTokenizer.from_pretrained(d)


class PlainJsonl(torch.utils.data.Dataset):
    """What a user writes: the lines in memory, json + tokenizer per item."""

    def __init__(self, path: str, tokenizer: Any) -> None:
        with open(path) as f:
            self.lines = f.readlines()
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> torch.Tensor:
        text = json.loads(self.lines[i])["text"]
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class PlainBin(torch.utils.data.Dataset):
    """What a user writes for a token .bin: a memmap cut into windows of seq_len + 1."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict[str, Any]:
        # a worker maps the file itself (a memmap pickles as its whole array under spawn or forkserver)
        return {**self.__dict__, "tokens": None}

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = self.seq_len
        return torch.from_numpy(self.tokens[i * s : (i + 1) * s + 1].astype(np.int64))


PASS_SAMPLES = {"jsonl_tokenized": 6000, "megatron_bin": 24000, "parquet": 6000}


def build_formats(d: str, scale: float, seq_len: int) -> dict[str, tuple[Any, Any, Callable | None]]:
    """name -> (plain dataset, tenplex dataset, collate)."""
    rng = random.Random(0)
    n_docs = int(20000 * scale)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) for _ in range(n_docs)]
    jl = os.path.join(d, "docs.jsonl")
    with open(jl, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = make_tokenizer(os.path.join(d, "tok"), texts)
    out: dict[str, tuple[Any, Any, Callable | None]] = {
        "jsonl_tokenized": (PlainJsonl(jl, tok), TextDocuments([jl], tok), pad_collate)}

    nrng = np.random.default_rng(0)
    lengths = nrng.integers(50, 3000, size=int(32000 * scale))  # ~48,000 samples
    docs = [nrng.integers(0, 50000, size=int(k), dtype=np.int64).astype(np.uint16) for k in lengths]
    write_megatron(os.path.join(d, "meg"), docs)
    out["megatron_bin"] = (PlainBin(os.path.join(d, "meg.bin"), seq_len),
                           megatron_gpt_dataset(os.path.join(d, "meg"), seq_len), None)

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = int(8000 * scale)
    ids = nrng.integers(0, 50000, size=(rows, 513), dtype=np.int64)
    pq.write_table(pa.table({"input_ids": list(ids)}), os.path.join(d, "tokens.parquet"))
    ds = hf_dataset(os.path.join(d, "tokens.parquet"), cache_dir=os.path.join(d, "hf"))
    out["parquet"] = (ds.with_format("torch"), HFSamples(ds, column="input_ids"), pad_collate)
    return out


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of its reaped children (a loader's workers, once shut down)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def samples_per_second(loader: Iterable[Any], batch: int, samples: int,
                       workers: int) -> tuple[float, float, float]:
    """(samples/s over ``samples`` samples after every worker's first batch, CPU us a sample of the whole
    pass: the main process and the workers from their start to their shutdown, over the samples received;
    of it the main process's, which receives every batch from the workers)."""
    m0, c0 = _cpu_s()
    it = iter(loader)
    for _ in range(max(1, workers)):  # every worker started and its first batch in (the loader's round robin)
        next(it)
    t0 = time.perf_counter()
    got = 0
    for _ in it:
        got += batch
        if got >= samples:
            break
    rate = got / (time.perf_counter() - t0)
    m1 = _cpu_s()[0]
    del it  # the workers shut down and reaped: their CPU time is in RUSAGE_CHILDREN
    m2, c2 = _cpu_s()
    per = 1e6 / (got + batch * max(1, workers))
    return rate, (m2 - m0 + c2 - c0) * per, (m1 - m0) * per


def fetch_us(plain: Any, tplx: Any, collate: Callable | None, batch: int, rounds: int, seed: int) -> dict[str, float]:
    """Microseconds a sample to fetch and collate a batch in this process (what a loader worker does), both
    sides alternating ``rounds`` times over the same random ids; the minimum per side (robust to load)."""
    collate = collate or torch.utils.data.default_collate
    rng = np.random.default_rng(seed)
    n = min(len(plain), len(tplx))
    best = {"plain": float("inf"), "tenplex": float("inf")}
    for _ in range(rounds):
        ids = rng.integers(0, n, size=batch).tolist()
        for name, ds in (("plain", plain), ("tenplex", tplx)):
            t0 = time.perf_counter()
            collate(ds.__getitems__(ids) if hasattr(ds, "__getitems__") else [ds[i] for i in ids])
            best[name] = min(best[name], (time.perf_counter() - t0) / batch * 1e6)
    return best


def run_format(plain: Any, tplx: Any, collate: Callable | None, args: argparse.Namespace,
               samples: int) -> dict[str, Any]:
    """``args.runs`` runs; a run is ``args.pairs`` adjacent (plain, tenplex) passes in alternating order, its
    figures the medians over its pairs (adjacent passes see the same machine load, so the ratio is stable
    on a shared machine where absolute rates are not)."""
    n = min(len(plain), len(tplx), samples + args.batch * max(1, args.workers))
    kw = dict(batch_size=args.batch, num_workers=args.workers, collate_fn=collate,
              prefetch_factor=4 if args.workers else None)
    ratios, t_sps, p_sps, t_us, p_us, t_cpu, p_cpu, t_main, p_main = [], [], [], [], [], [], [], [], []
    for r in range(args.runs):
        us = fetch_us(plain, tplx, collate, args.batch, args.fetch_rounds, r)
        t_us.append(us["tenplex"])
        p_us.append(us["plain"])
        pr, pt, pp, ct, cp, mt, mp = [], [], [], [], [], [], []
        for k in range(args.pairs):
            sampler = tenplex_sampler(len(tplx), args.batch, seed=r * args.pairs + k)
            tkw = {k: v for k, v in kw.items() if k != "batch_size"}
            sides = [("plain", lambda: torch.utils.data.DataLoader(plain, shuffle=True, **kw)),
                     ("tenplex", lambda: torch.utils.data.DataLoader(tplx, batch_sampler=sampler, **tkw))]
            if (r + k) % 2:
                sides.reverse()
            got = {name: samples_per_second(make(), args.batch, n - args.batch * max(1, args.workers), args.workers)
                   for name, make in sides}
            pt.append(got["tenplex"][0])
            pp.append(got["plain"][0])
            pr.append(got["tenplex"][0] / got["plain"][0])
            ct.append(got["tenplex"][1])
            cp.append(got["plain"][1])
            mt.append(got["tenplex"][2])
            mp.append(got["plain"][2])
        ratios.append(statistics.median(pr))
        t_cpu.append(statistics.median(ct))
        p_cpu.append(statistics.median(cp))
        t_main.append(statistics.median(mt))
        p_main.append(statistics.median(mp))
        t_sps.append(statistics.median(pt))
        p_sps.append(statistics.median(pp))
    return {"ratio": spread(ratios), "tenplex_sps": spread(t_sps), "plain_sps": spread(p_sps), "samples": n,
            "pairs_per_run": args.pairs, "fetch_us_tenplex": spread(t_us), "fetch_us_plain": spread(p_us),
            "fetch_ratio": spread([b / a for a, b in zip(t_us, p_us)]), "cpu_us_tenplex": spread(t_cpu),
            "cpu_us_plain": spread(p_cpu), "cpu_ratio": spread([b / a for a, b in zip(t_cpu, p_cpu)]),
            "cpu_main_us_tenplex": spread(t_main), "cpu_main_us_plain": spread(p_main)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help=f"write {OUT.relative_to(ROOT)}; last line one JSON object")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=5, help="adjacent (plain, tenplex) passes per run")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fetch-rounds", type=int, default=100, help="alternating in-process fetches per run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--samples", type=int, help="samples timed per pass (default: PASS_SAMPLES, per format)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--scale", type=float, default=1.0, help="size of the generated files")
    ap.add_argument("--only", nargs="*", help="formats to run")
    ap.add_argument("--restore-repeats", type=int, default=5, help="restores of the 6 ranks at 10^9 samples")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="bench_data") as d:
        formats = build_formats(d, args.scale, args.seq_len)
        res: dict[str, Any] = {}
        for name, (plain, tplx, collate) in formats.items():
            if args.only and name not in args.only:
                continue
            load = os.getloadavg()[0]
            samples = args.samples or PASS_SAMPLES[name]
            res[name] = {**run_format(plain, tplx, collate, args, samples), "load_avg_1min": round(load, 2)}
            r = res[name]
            print(f"{name:>16}: ratio {r['ratio']['median']:.3f} [{r['ratio']['min']:.3f}, {r['ratio']['max']:.3f}]"
                  f"  tenplex {r['tenplex_sps']['median']:.0f}/s  plain {r['plain_sps']['median']:.0f}/s"
                  f"  fetch ratio {r['fetch_ratio']['median']:.3f} ({r['fetch_us_tenplex']['median']:.2f} vs "
                  f"{r['fetch_us_plain']['median']:.2f} us)  cpu ratio {r['cpu_ratio']['median']:.3f} "
                  f"({r['cpu_us_tenplex']['median']:.1f} vs {r['cpu_us_plain']['median']:.1f} us; main process "
                  f"{r['cpu_main_us_tenplex']['median']:.1f} vs {r['cpu_main_us_plain']['median']:.1f})"
                  f"  (load {load:.2f})", flush=True)
    restore = restore_ms_per_rank(args.restore_repeats)
    print(f"restore at 1e9 samples, DP 8 -> 6: {restore['median']:.3f} ms/rank [{restore['min']:.3f}, "
          f"{restore['max']:.3f}] over {restore['runs']} rank restores (goal <= 10 ms); PCG64 order at 1e7: "
          f"{restore['pcg64_at_1e7']['median']:.0f} ms", flush=True)
    out = {"formats": res, "restore_ms_per_rank": restore, "load_avg_1min": round(os.getloadavg()[0], 2),
           "config": {k: v for k, v in vars(args).items() if k != "json"}, "cpus": os.cpu_count(),
           "goal": "ratio >= 0.95"}
    if args.json:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out))


if __name__ == "__main__":
    main()
