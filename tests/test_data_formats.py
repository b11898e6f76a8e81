"""The formats users have (#32 item 2): Megatron .bin/.idx with GPTDataset's indices, Hugging Face
datasets (Parquet, Arrow, on disk and S3, streaming), JSONL/text tokenised on the fly with local
tokenizers, and layout-independent packing; the FUSE mount serves a Megatron index's and a Hugging Face
dataset's samples."""

from __future__ import annotations

import base64
import json
import mmap
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_vfs_mount import mounted

from tenplex.cli import main
from tenplex.data import (
    DataIndex,
    DataState,
    HFSamples,
    MegatronIndexed,
    PackedDataset,
    Packing,
    SourceReader,
    StreamSlice,
    TextDocuments,
    TokenFile,
    hf_dataset,
    hf_index,
    load_index,
    megatron_gpt_dataset,
    megatron_index,
    megatron_packing,
    pack_documents,
    remaining_ids,
    write_megatron,
)
from tenplex.data.view import RankReader, RankView
from tenplex.errors import DataIndexError


# ------------------------------------------------------------------------------------------------
# references: Megatron-LM's algorithms written out the slow way
# ------------------------------------------------------------------------------------------------
def ref_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, extra: int = 1) -> np.ndarray:
    """Megatron-LM helpers.cpp ``build_sample_idx`` (drop_last_partial_sequence=True), loop for loop."""
    total = int(sizes[doc_idx].sum())
    num_samples = (total - extra) // seq_length
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - extra
                remaining = 0
            else:
                if d == len(doc_idx) - 1:
                    off = int(sizes[doc_idx[d]]) - extra
                    break
                d += 1
                off = 0
        out.append((d, off))
    return np.array(out, dtype=np.int64)


def ref_megatron(sizes: np.ndarray, seq_length: int, seed: int, num_samples: int | None):
    """GPTDataset's ``_build_document_sample_shuffle_indices`` (its epoch count and separate final epoch)."""
    tokens = int(sizes.sum())
    num_epochs = 1
    if num_samples is not None:
        while num_epochs * tokens < num_samples * seq_length + 1:
            num_epochs += 1
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens - 1) // seq_length
        per_epoch = (tokens - 1) // seq_length
        separate = num_samples - sans_final < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)

    def build(epochs: int) -> np.ndarray:
        doc = np.mgrid[0:epochs, 0:len(sizes)][1]
        doc[:] = np.arange(len(sizes))
        doc = doc.reshape(-1).astype(np.int32)
        rs.shuffle(doc)
        return doc

    doc = np.concatenate((build(num_epochs - 1), build(1))) if separate else build(num_epochs)
    si = ref_sample_index(sizes, doc, seq_length)
    total = si.shape[0] - 1
    first = np.arange(sans_final if separate else total, dtype=np.uint32)
    rs.shuffle(first)
    if separate:
        last = np.arange(sans_final, total, dtype=np.uint32)
        rs.shuffle(last)
        first = np.concatenate((first, last))
    return doc, si, first


def stream_tokens(docs: list[np.ndarray], doc_order: np.ndarray) -> np.ndarray:
    return np.concatenate([docs[d] for d in doc_order]).astype(np.int64)


def make_docs(rng: np.random.Generator, n: int, hi: int = 30, dtype=np.uint16) -> list[np.ndarray]:
    return [rng.integers(0, 60000, size=int(rng.integers(1, hi)), dtype=np.int64).astype(dtype) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# Megatron indexed datasets
# ------------------------------------------------------------------------------------------------
def test_megatron_files_follow_mmidx_byte_for_byte(tmp_path) -> None:  # type: ignore[no-untyped-def]
    docs = [np.array([1, 2, 3], np.int32), np.array([70000], np.int32), np.array([5, 6], np.int32)]
    write_megatron(str(tmp_path / "d"), docs, dtype=np.int32)
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, 4, 3, 4)  # version, int32 code, sequences, doc indices
    assert np.frombuffer(idx, np.int32, 3, 34).tolist() == [3, 1, 2]
    assert np.frombuffer(idx, np.int64, 3, 46).tolist() == [0, 12, 16]  # byte pointers
    assert np.frombuffer(idx, np.int64, 4, 70).tolist() == [0, 1, 2, 3]
    assert len(idx) == 70 + 32
    assert (tmp_path / "d.bin").read_bytes() == np.concatenate(docs).tobytes()
    src = MegatronIndexed(str(tmp_path / "d"))
    assert [src.doc_tokens(i).tolist() for i in range(3)] == [d.tolist() for d in docs]
    assert src.doc_tokens(0, 1, 3).tolist() == [2, 3]
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x00" + idx[9:40])
    with pytest.raises(DataIndexError, match="truncated"):
        MegatronIndexed(str(tmp_path / "bad"))


@settings(max_examples=examples(40))
@given(lengths=st.lists(st.integers(0, 25), min_size=1, max_size=30), seq_len=st.integers(1, 20),
       extra=st.sampled_from([0, 1]), seed=st.integers(0, 2**31))
def test_sample_index_matches_megatron_loop(lengths: list[int], seq_len: int, extra: int, seed: int) -> None:
    sizes = np.array(lengths, np.int32)
    order = np.random.default_rng(seed).permutation(len(sizes))
    if int(sizes.sum()) - extra < seq_len:
        with pytest.raises(DataIndexError):
            pack_documents(sizes, order, seq_len, extra)
        return
    got = pack_documents(sizes, order, seq_len, extra)
    ref = ref_sample_index(sizes, order, seq_len, extra)
    if extra == 1:
        assert np.array_equal(got, ref)
    # the tokens each row pair delimits are the same either way (extra=0 may name a document end differently)
    docs = [np.arange(s, dtype=np.int64) + 1000 * i for i, s in enumerate(lengths)]
    stream = stream_tokens(docs, order)
    packing = Packing(order, got, seq_len, extra)
    for k in range(len(packing)):
        tok = np.concatenate([docs[d][a:z] for d, a, z in packing.pieces(k)])
        assert np.array_equal(tok, stream[k * seq_len:(k + 1) * seq_len + extra])


@settings(max_examples=examples(15))
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(2, 16), num_samples=st.none() | st.integers(1, 400))
def test_megatron_gpt_samples_bit_exact(tmp_path_factory: pytest.TempPathFactory, seed: int, seq_len: int,
                                        num_samples: int | None) -> None:
    d = tmp_path_factory.mktemp("meg")
    docs = make_docs(np.random.default_rng(seed), 25)
    write_megatron(str(d / "x"), docs)
    ds = megatron_gpt_dataset(str(d / "x"), seq_len, seed=seed, num_samples=num_samples)
    sizes = np.array([len(x) for x in docs], np.int32)
    doc, si, shuf = ref_megatron(sizes, seq_len, seed, num_samples)
    assert np.array_equal(ds.packing.doc_order, doc) and np.array_equal(ds.packing.sample_index, si)
    assert np.array_equal(ds.packing.shuffle, shuf)
    stream = stream_tokens(docs, doc)
    for i in range(len(ds)):
        k = int(shuf[i])
        assert torch.equal(ds[i], torch.from_numpy(stream[k * seq_len:(k + 1) * seq_len + 1]))


def test_a_batch_is_its_samples_and_a_bad_packing_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``__getitems__`` (a loader's batch: samples spanning 1 to many documents, short ones in the middle)
    equals the pieces read one by one; an id out of range is an IndexError, and a packing built from
    other document lengths a DataIndexError, not a wrong or short sample."""
    docs = make_docs(np.random.default_rng(3), 300, hi=40)
    write_megatron(str(tmp_path / "x"), docs)
    ds = megatron_gpt_dataset(str(tmp_path / "x"), 24)
    ids = np.random.default_rng(4).permutation(len(ds)).tolist()
    got = ds.__getitems__(ids)
    assert all(torch.equal(t, torch.from_numpy(ds.packing.sample(ds.source, i))) for t, i in zip(got, ids))
    assert len({ds.packing.sample_index[k + 1, 0] - ds.packing.sample_index[k, 0] for k in range(len(ds))}) > 2
    for bad in (-1, len(ds)):
        with pytest.raises(IndexError):
            ds.__getitems__([0, bad])
    lengths = np.array([len(d) for d in docs]) + 1  # one token more a document than the .bin holds
    other = PackedDataset(ds.source, megatron_packing(lengths, 24))
    with pytest.raises(DataIndexError, match="differ from the lengths"):
        other.__getitems__(list(range(len(other))))


def test_megatron_reads_only_its_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    docs = make_docs(np.random.default_rng(1), 2000, hi=200)
    write_megatron(str(tmp_path / "x"), docs)
    ds = megatron_gpt_dataset(str(tmp_path / "x"), 64)
    src = ds.source
    assert isinstance(src.sequence_lengths, np.ndarray) and not src.sequence_lengths.flags.owndata  # a map, no copy
    assert ds[5].dtype == torch.int64 and len(ds[5]) == 65
    assert isinstance(src.flat_tokens()[0].base.obj, mmap.mmap)  # the .bin is mapped, not read


# ------------------------------------------------------------------------------------------------
# packing invariance: sample i does not depend on the layout
# ------------------------------------------------------------------------------------------------
def _layout_samples(ds: torch.utils.data.Dataset, dp: int, workers: int, g: int, seed: int) -> dict[int, torch.Tensor]:
    state = DataState(len(ds), g, seed=seed)
    out: dict[int, torch.Tensor] = {}
    for r in range(dp):
        ids = remaining_ids(state, dp, r, num_epochs=1).tolist()
        loader = torch.utils.data.DataLoader(ds, sampler=ids, batch_size=2, num_workers=workers)
        got = torch.cat([b for b in loader]) if ids else torch.zeros(0)
        for i, row in zip(ids, got):
            assert i not in out
            out[i] = row
    return out


@pytest.mark.timeout(120)
@settings(max_examples=examples(6))
@given(dps=st.lists(st.integers(1, 6), min_size=2, max_size=3), workers=st.sampled_from([0, 2]),
       seed=st.integers(0, 1000))
def test_packing_is_layout_independent(tmp_path_factory: pytest.TempPathFactory, dps: list[int], workers: int,
                                       seed: int) -> None:
    d = tmp_path_factory.mktemp("pack")
    docs = make_docs(np.random.default_rng(seed), 30)
    write_megatron(str(d / "x"), docs)
    ds = megatron_gpt_dataset(str(d / "x"), 8, seed=seed)
    ref = {i: ds[i] for i in range(len(ds))}
    for dp in dps:
        got = _layout_samples(ds, dp, workers, 12 * 5, seed)
        assert sorted(got) == list(range(len(ds)))
        assert all(torch.equal(got[i], ref[i]) for i in got)


def test_token_file_windows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = np.random.default_rng(2).integers(0, 2**32 - 1, size=1000, dtype=np.uint64).astype(np.uint32)
    path = str(tmp_path / "t.u32")
    tokens.tofile(path)
    src = TokenFile(path, "uint32")
    ds = PackedDataset(src, Packing.build(src.doc_lengths(), 10))
    assert len(ds) == (1000 - 1) // 10
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    got = torch.cat(list(torch.utils.data.DataLoader(ds, sampler=order, batch_size=8, num_workers=2)))
    assert torch.equal(got, torch.from_numpy(np.stack([tokens[k * 10:k * 10 + 11].astype(np.int64) for k in order])))


# ------------------------------------------------------------------------------------------------
# the FUSE mount serves a Megatron index's samples
# ------------------------------------------------------------------------------------------------
def test_megatron_index_view_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    docs = make_docs(np.random.default_rng(3), 60)
    write_megatron(str(tmp_path / "x"), docs)
    ds = megatron_gpt_dataset(str(tmp_path / "x"), 9, seed=5)
    index = megatron_index(ds)
    index.save(str(tmp_path / "idx.npz"))
    loaded = load_index(str(tmp_path / "idx.npz"))
    assert loaded.num_samples == len(ds) and loaded.kind == "pieces"
    ids = np.random.default_rng(0).permutation(len(ds))
    view = RankView(loaded, SourceReader(loaded.files), ids)
    blob = view.read(0, view.size)
    assert blob == b"".join(ds[int(i)].numpy().astype(np.uint16).tobytes() for i in ids)
    assert view.size == len(ds) * 10 * 2


def test_pieces_index_reader_and_corruption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    docs = make_docs(np.random.default_rng(6), 40)
    write_megatron(str(tmp_path / "x"), docs)
    ds = megatron_gpt_dataset(str(tmp_path / "x"), 5, seed=1)
    index = megatron_index(ds)
    state = DataState(len(ds), 6, seed=3)
    reader = RankReader(index, state, 3, 1)
    for _ in range(3):
        ids = reader.batch_ids()
        got = reader.next_batch()
        assert [np.frombuffer(b, np.uint16).astype(np.int64).tolist() for b in got] == [ds[int(i)].tolist()
                                                                                        for i in ids]
    bad = index.sample_start.copy()
    bad[3] = bad[4] + 1  # not rising
    with pytest.raises(DataIndexError, match="sample_start"):
        DataIndex(index.files, index.file_id, index.offset, index.length, "pieces", {}, bad)
    with pytest.raises(DataIndexError, match="sample_start"):
        DataIndex(index.files, index.file_id, index.offset, index.length, "pieces", {})
    path = str(tmp_path / "idx.npz")
    with open(path, "wb") as f:  # a pieces index whose sample_start is cut short
        np.savez(f, file_id=index.file_id, offset=index.offset, length=index.length,
                 sample_start=index.sample_start[:-2], meta=np.array(json.dumps(index.meta())))
    with pytest.raises(DataIndexError, match="not a tenplex dataset index"):
        load_index(path)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None, reason="no FUSE here")
def test_mount_serves_megatron_samples(tmp_path, runtime) -> None:  # type: ignore[no-untyped-def]
    docs = make_docs(np.random.default_rng(4), 80)
    write_megatron(str(tmp_path / "x"), docs)
    ds = megatron_gpt_dataset(str(tmp_path / "x"), 16, seed=2)
    assert main(["data", "index", str(tmp_path / "idx.npz"), str(tmp_path / "x"), "--megatron", "--seq-len", "16",
                 "--megatron-seed", "2"]) == 0
    mnt = str(tmp_path / "mnt")
    with mounted(str(tmp_path / "idx.npz"), mnt, "--dp", "3", "--global-batch", "6", "--seed", "7",
                 log=str(tmp_path / "mount.log")):
        state = DataState(len(ds), 6, seed=7)
        for r in range(3):
            ids = np.array(open(f"{mnt}/rank-{r:03d}/ids.txt").read().split(), dtype=np.int64)
            assert np.array_equal(ids, remaining_ids(state, 3, r))
            tokens = np.fromfile(f"{mnt}/rank-{r:03d}/samples.bin", dtype=np.uint16).reshape(len(ids), 17)
            assert all(np.array_equal(tokens[k].astype(np.int64), ds[int(i)].numpy()) for k, i in enumerate(ids))


# ------------------------------------------------------------------------------------------------
# Hugging Face datasets: Parquet / Arrow, local and S3, streaming
# ------------------------------------------------------------------------------------------------
def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 50000, size=int(rng.integers(1, 20))).tolist(),
             "text": " ".join(["doc", str(i)] * int(rng.integers(1, 4)))} for i in range(n)]


def _write_parquet(path: str, rows: list[dict], fs=None) -> None:  # type: ignore[no-untyped-def]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, filesystem=fs, row_group_size=16)


def _check_token_rows(samples: HFSamples, rows: list[dict]) -> None:
    assert len(samples) == len(rows)
    ids = np.random.default_rng(1).permutation(len(rows)).tolist()
    got = samples.__getitems__(ids)
    assert all(torch.equal(t, torch.tensor(rows[i]["input_ids"])) for t, i in zip(got, ids))
    assert samples.doc_lengths().tolist() == [len(r["input_ids"]) for r in rows]


def test_hf_parquet_and_arrow_on_disk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = _rows(70)
    _write_parquet(str(tmp_path / "a.parquet"), rows[:40])
    _write_parquet(str(tmp_path / "b.parquet"), rows[40:])
    ds = hf_dataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], cache_dir=str(tmp_path / "c"))
    _check_token_rows(HFSamples(ds, column="input_ids"), rows)
    ds.save_to_disk(str(tmp_path / "saved"))  # Arrow files + state.json
    _check_token_rows(HFSamples(hf_dataset(str(tmp_path / "saved")), column="input_ids"), rows)
    arrow = sorted(str(p) for p in (tmp_path / "saved").glob("*.arrow"))
    _check_token_rows(HFSamples(hf_dataset(arrow, cache_dir=str(tmp_path / "c2")), column="input_ids"), rows)
    packed = PackedDataset(HFSamples(ds, column="input_ids"), Packing.build(HFSamples(ds, column="input_ids")
                                                                          .doc_lengths(), 7))
    stream = np.concatenate([r["input_ids"] for r in rows])
    assert all(torch.equal(packed[k], torch.from_numpy(stream[k * 7:(k + 1) * 7 + 1])) for k in range(len(packed)))


def _index_rows(index: DataIndex, ids: np.ndarray) -> list[np.ndarray]:
    """The samples ``ids`` of an index read from its sources, in its ``dtype``."""
    fid, off, ln = index.sample_ranges(ids)
    with SourceReader(index.files) as r:
        return [np.frombuffer(r.read(int(f), int(o), int(n)), index.params["dtype"]) for f, o, n in zip(fid, off, ln)]


def _same_as_hf(index: DataIndex, ds) -> None:  # type: ignore[no-untyped-def]
    samples = HFSamples(ds, column="input_ids")
    got = _index_rows(index, np.arange(len(ds)))
    assert index.num_samples == len(ds) and all(np.array_equal(g, samples[i].numpy()) for i, g in enumerate(got))
    assert index.nbytes == int(samples.doc_lengths().sum()) * np.dtype(index.params["dtype"]).itemsize


def test_hf_index_is_the_rows_bytes_in_the_cache_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import datasets

    rows = _rows(70)
    _write_parquet(str(tmp_path / "a.parquet"), rows[:40])
    _write_parquet(str(tmp_path / "b.parquet"), rows[40:])
    ds = hf_dataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], cache_dir=str(tmp_path / "c"))
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    saved = hf_dataset(str(tmp_path / "saved"))
    i32 = ds.cast_column("input_ids", datasets.List(datasets.Value("int32")))
    for view in (ds, saved, ds.select(range(5, 30)), ds.shuffle(seed=3),  # slices, an indices mapping
                 saved.shuffle(seed=1).select(range(7, 50)).filter(lambda r: len(r["input_ids"]) > 5),
                 datasets.concatenate_datasets([saved.select(range(10, 30)), ds.select(range(40, 60))]), i32):
        index = hf_index(view, "input_ids")
        _same_as_hf(index, view)
        assert {f.url for f in index.files} <= {os.path.realpath(f["filename"]) for f in view.cache_files}
    assert hf_index(i32, "input_ids").params["dtype"] == "int32" and len(hf_index(saved, "input_ids").files) == 3
    with pytest.raises(DataIndexError, match="not a list of token ids"):
        hf_index(ds, "text")
    with pytest.raises(DataIndexError, match="nested list"):
        hf_index(datasets.Dataset.from_dict({"x": [[[1, 2]], [[3]]]}).map(lambda r: r), "x")
    with pytest.raises(DataIndexError, match="no tokens"):
        hf_index(ds.map(lambda r, i: {"input_ids": [] if i == 3 else r["input_ids"]}, with_indices=True))
    with pytest.raises(DataIndexError, match="not memory-mapped"):
        hf_index(datasets.concatenate_datasets([ds, datasets.Dataset.from_dict({"input_ids": [[1, 2]], "text": ["a"]},
                                                                               features=ds.features)]))
    with pytest.raises(DataIndexError, match="no cache files"):
        hf_index(datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}))


@pytest.mark.timeout(90)
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None, reason="no FUSE here")
def test_mount_serves_hf_samples(tmp_path, runtime) -> None:  # type: ignore[no-untyped-def]
    rows = _rows(50, seed=5)
    _write_parquet(str(tmp_path / "a.parquet"), rows)
    hf_dataset(str(tmp_path / "a.parquet"), cache_dir=str(tmp_path / "c")).shuffle(seed=2).save_to_disk(
        str(tmp_path / "saved"), num_shards=2)
    ds = hf_dataset(str(tmp_path / "saved"))
    samples = HFSamples(ds, column="input_ids")
    assert main(["data", "index", str(tmp_path / "idx.npz"), str(tmp_path / "saved"), "--hf", "--column",
                 "input_ids"]) == 0
    assert load_index(str(tmp_path / "idx.npz")).params == {"format": "hf", "column": "input_ids", "dtype": "int64"}
    mnt = str(tmp_path / "mnt")
    with mounted(str(tmp_path / "idx.npz"), mnt, "--dp", "3", "--global-batch", "6", "--seed", "7",
                 log=str(tmp_path / "mount.log")):
        state = DataState(len(ds), 6, seed=7)
        seen = []
        for r in range(3):
            ids = np.array(open(f"{mnt}/rank-{r:03d}/ids.txt").read().split(), dtype=np.int64)
            assert np.array_equal(ids, remaining_ids(state, 3, r))
            data = open(f"{mnt}/rank-{r:03d}/samples.bin", "rb").read()
            want = b"".join(samples[int(i)].numpy().tobytes() for i in ids)
            assert len(data) == int(samples.doc_lengths()[ids].sum()) * 8  # the bytes needed, nothing more
            assert data == want  # bit for bit, in the global order
            seen.extend(ids.tolist())
        assert set(seen) == set(range(len(ds)))  # every row served


@pytest.mark.timeout(120)
def test_hf_parquet_on_s3_and_streaming(tmp_path, s3) -> None:  # type: ignore[no-untyped-def]
    import s3fs

    rows = _rows(50, seed=2)
    fs = s3fs.S3FileSystem(**s3)
    _write_parquet("ckpt/formats/a.parquet", rows, fs=fs)
    url = "s3://ckpt/formats/a.parquet"
    ds = hf_dataset(url, storage_options=s3, cache_dir=str(tmp_path / "c"))
    _check_token_rows(HFSamples(ds, column="input_ids"), rows)
    ds.save_to_disk("s3://ckpt/formats/saved", storage_options=s3)  # Arrow files on S3
    _check_token_rows(HFSamples(hf_dataset("s3://ckpt/formats/saved", storage_options=s3), column="input_ids"), rows)
    arrow = sorted(f"s3://{p}" for p in fs.glob("ckpt/formats/saved/*.arrow"))
    remote_arrow = hf_dataset(arrow, storage_options=s3, cache_dir=str(tmp_path / "c3"))
    _check_token_rows(HFSamples(remote_arrow, column="input_ids"), rows)
    stream = hf_dataset(url, storage_options=s3, streaming=True)
    state = DataState(len(rows), 10, shuffle=False, consumed=20)
    for r in range(3):  # uneven: 10 samples a step over 3 ranks by micro-batches of 1
        ids = remaining_ids(state, 3, r, micro_batch=1)
        got = [row["input_ids"] for row in StreamSlice(stream, ids)]
        assert got == [rows[i]["input_ids"] for i in ids]
    loader = torch.utils.data.DataLoader(StreamSlice(stream, np.arange(5, 25)), batch_size=None, num_workers=2)
    assert sorted(tuple(b["input_ids"]) for b in loader) == sorted(tuple(r["input_ids"]) for r in rows[5:25])
    with pytest.raises(DataIndexError, match="ascending"):
        StreamSlice(stream, [3, 2])


# ------------------------------------------------------------------------------------------------
# JSONL and text tokenised on the fly with local tokenizers
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([r["text"] + " tenplex elastic data" for r in _rows(200)],
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(d))
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def tiktoken_encoding(tmp_path_factory):  # type: ignore[no-untyped-def]
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = {bytes([b]): b for b in range(256)}
    for tok in (b"do", b"doc", b" d", b" doc", b"te", b"ten"):
        ranks[tok] = len(ranks)
    path = tmp_path_factory.mktemp("tt") / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return tiktoken.Encoding("tiny", pat_str=r"""'s|'t| ?\w+| ?\d+| ?[^\s\w\d]+|\s+""",
                             mergeable_ranks=load_tiktoken_bpe(str(path)), special_tokens={"<|eot|>": len(ranks)})


def _write_texts(tmp_path) -> tuple[str, str, list[str]]:  # type: ignore[no-untyped-def]
    texts = [r["text"] + (" tenplex" * (i % 3)) for i, r in enumerate(_rows(40, seed=5))]
    jl, txt = str(tmp_path / "a.jsonl"), str(tmp_path / "a.txt")
    with open(jl, "w") as f:
        f.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    with open(txt, "w") as f:
        f.writelines(t + "\n\n" for t in texts)  # empty lines between documents are skipped
    return jl, txt, texts


@pytest.mark.parametrize("which", ["transformers", "tiktoken"])
def test_tokenised_jsonl_and_text_bit_exact(tmp_path, request, which: str) -> None:  # type: ignore[no-untyped-def]
    tok = request.getfixturevalue("hf_tokenizer" if which == "transformers" else "tiktoken_encoding")
    ref = (lambda t: tok(t, add_special_tokens=False)["input_ids"]) if which == "transformers" \
        else tok.encode_ordinary
    jl, txt, texts = _write_texts(tmp_path)
    import fsspec

    remote = f"memory://formats/{which}.jsonl"
    with fsspec.open(remote, "wb") as f, open(jl, "rb") as src:
        f.write(src.read())
    for docs in (TextDocuments([jl], tok), TextDocuments([txt], tok, field=None), TextDocuments([remote], tok)):
        assert len(docs) == len(texts)
        assert all(docs[i].tolist() == ref(t) for i, t in enumerate(texts))
        assert [t.tolist() for t in docs.__getitems__([3, 1])] == [ref(texts[3]), ref(texts[1])]
    eos = 99
    docs = TextDocuments([jl], tok, eos=eos)
    packed = PackedDataset(docs, Packing.build(docs.doc_lengths(), 6))
    stream = np.concatenate([[*ref(t), eos] for t in texts])
    assert len(packed) == (len(stream) - 1) // 6
    loader = torch.utils.data.DataLoader(packed, batch_size=4, num_workers=2)
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.from_numpy(np.stack([stream[k * 6:k * 6 + 7] for k in range(len(packed))])))


def test_hf_text_tokenised(tmp_path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = _rows(30)
    _write_parquet(str(tmp_path / "a.parquet"), rows)
    s = HFSamples(hf_dataset(str(tmp_path / "a.parquet"), cache_dir=str(tmp_path / "c")), tokenizer=hf_tokenizer)
    assert [s[i].tolist() for i in range(30)] == [hf_tokenizer(r["text"], add_special_tokens=False)["input_ids"]
                                                 for r in rows]
