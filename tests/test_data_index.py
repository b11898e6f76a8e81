"""Dataset index, source reader, lazy rank views and the trainer's RankReader (no FUSE)."""

from __future__ import annotations

import errno
import json
import os

import fsspec
import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.cli import main
from tenplex.data import (
    DataIndexError,
    DataState,
    IndexNotFoundError,
    LineFile,
    RankReader,
    SourceChangedError,
    SourceReader,
    SourceReadError,
    build_index,
    load_index,
    rank_batch_ids,
    rank_view,
    remaining_ids,
)


def write_jsonl(path: str, n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    lines = [(json.dumps({"i": i, "t": "x" * int(rng.integers(0, 40))}) + "\n").encode() for i in range(n)]
    with open(path, "wb") as f:
        f.write(b"".join(lines))
    return lines


@pytest.fixture
def jsonl_data(tmp_path):  # type: ignore[no-untyped-def]
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    samples = write_jsonl(a, 70, 1) + write_jsonl(b, 50, 2)
    index = build_index([a, b], kind="jsonl")
    return index, samples


def test_jsonl_index_and_roundtrip(tmp_path, jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, samples = jsonl_data
    assert index.num_samples == 120 and index.nbytes == sum(map(len, samples))
    out = str(tmp_path / "idx.npz")
    index.save(out)
    loaded = load_index(out)
    assert loaded.checksum == index.checksum and loaded.kind == "jsonl"
    with SourceReader(loaded.files) as r:
        got = [r.read(int(f), int(o), int(n)) for f, o, n in zip(loaded.file_id, loaded.offset, loaded.length)]
    assert got == samples


def test_jsonl_empty_lines_and_missing_final_newline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a":1}\n\n\n{"b":2}\nz')
    idx = build_index([str(p)], kind="jsonl")
    with SourceReader(idx.files) as r:
        assert [r.read(int(f), int(o), int(n)) for f, o, n in zip(idx.file_id, idx.offset, idx.length)] == [
            b'{"a":1}\n', b'{"b":2}\n', b"z"]


def test_records_and_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "r.bin"
    p.write_bytes(bytes(range(256)) * 4 + b"tail")
    idx = build_index([str(p)], kind="records", record_bytes=100)
    assert idx.num_samples == 10 and set(idx.length.tolist()) == {100} and idx.offset[3] == 300
    toks = np.arange(1000, dtype=np.uint32)
    t = tmp_path / "t.u32"
    toks.tofile(t)
    idx = build_index([str(t)], kind="tokens", seq_len=64, dtype="uint32")
    assert idx.num_samples == 1000 // 64  # non-overlapping, trailing tokens ignored
    with SourceReader(idx.files) as r:
        s3 = np.frombuffer(r.read(int(idx.file_id[3]), int(idx.offset[3]), int(idx.length[3])), np.uint32)
    assert np.array_equal(s3, toks[3 * 64:4 * 64])


def test_memory_url_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fs = fsspec.filesystem("memory")
    fs.pipe("/tenplex-test/data.bin", b"0123456789" * 10)
    try:
        idx = build_index(["memory://tenplex-test/data.bin"], kind="records", record_bytes=10)
        idx.save("memory://tenplex-test/idx.npz")
        loaded = load_index("memory://tenplex-test/idx.npz")
        with SourceReader(loaded.files) as r:
            assert r.read(0, 15, 10) == b"5678901234"
    finally:
        fs.rm("/tenplex-test", recursive=True)


def test_bad_inputs_give_clear_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(IndexNotFoundError, match="tenplex data index"):
        load_index(str(tmp_path / "nope.npz"))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an index")
    with pytest.raises(DataIndexError, match="not a tenplex dataset index"):
        load_index(str(bad))
    with pytest.raises(DataIndexError, match="does not exist"):
        build_index([str(tmp_path / "missing")], kind="jsonl")
    with pytest.raises(DataIndexError, match="record-bytes"):
        build_index([str(bad)], kind="records", record_bytes=0)
    with pytest.raises(DataIndexError, match="no samples"):
        build_index([str(bad)], kind="records", record_bytes=1000)


def test_changed_source_is_detected(tmp_path, jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, _ = jsonl_data
    out = str(tmp_path / "idx.npz")
    index.save(out)
    src = index.files[1].url
    with open(src, "ab") as f:
        f.write(b"{}\n")
    with pytest.raises(SourceChangedError, match=r"b.jsonl is \d+ bytes, was \d+ when indexed.*rebuild"):
        load_index(out)
    os.remove(src)
    with pytest.raises(SourceChangedError, match="missing"):
        load_index(out)
    assert load_index(out, verify=False).num_samples == 120


def test_short_or_missing_source_raises_eio(tmp_path, jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, _ = jsonl_data
    r = SourceReader(index.files)
    n = int(index.length[-1])
    r.read(1, int(index.offset[-1]), n)
    with open(index.files[1].url, "r+b") as f:
        f.truncate(index.files[1].size - 5)
    with pytest.raises(SourceReadError, match="shorter than indexed") as e:
        r.read(1, int(index.offset[-1]), n)
    assert e.value.errno == errno.EIO
    with pytest.raises(SourceReadError, match="shorter than indexed"):  # checked before C code reads the fds
        r.local_fds([1], [index.files[1].size])
    assert len(r.local_fds([1], [index.files[1].size - 5])) == 1
    os.remove(index.files[0].url)  # deleted while a descriptor is cached: reopened, then ENOENT -> EIO
    with pytest.raises(SourceReadError, match="cannot open"):
        r.read(0, 0, 5)
    r.close()


@settings(max_examples=examples(60))
@given(data=st.data())
def test_rank_view_reads_any_range(tmp_path_factory, data) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("v")
    a, b = str(d / "a.jsonl"), str(d / "b.jsonl")
    samples = write_jsonl(a, 30, 3) + write_jsonl(b, 20, 4)
    index = build_index([a, b], kind="jsonl")
    dp = data.draw(st.integers(1, 4))
    state = DataState(num_samples=50, global_batch=dp * data.draw(st.integers(1, 4)),
                      seed=data.draw(st.integers(0, 2)), shuffle=data.draw(st.booleans()),
                      consumed=data.draw(st.integers(0, 120)))
    rank = data.draw(st.integers(0, dp - 1))
    with SourceReader(index.files) as reader:
        view = rank_view(index, reader, state, dp, rank)
        ids = remaining_ids(state, dp, rank)
        whole = b"".join(samples[i] for i in ids)
        assert view.size == len(whole) and view.read(0, view.size + 10) == whole
        off = data.draw(st.integers(0, max(0, view.size)))
        size = data.draw(st.integers(0, 300))
        assert view.read(off, size) == whole[off:off + size]
        # the pieces the mount hands to libfuse's read_buf read the same bytes
        fds, pos, lens = view.source_pieces(off, size)
        assert b"".join(os.pread(int(f), int(n), int(p)) for f, p, n in zip(fds, pos, lens)) == whole[off:off + size]
        assert (lens > 0).all()
        ids_text = "".join(f"{i}\n" for i in ids).encode()
        offs_text = "".join(f"{o}\n" for o in view.cum).encode()
        for lf, text in ((view.ids_file, ids_text), (view.offsets_file, offs_text)):
            assert lf.size == len(text)
            o = data.draw(st.integers(0, len(text)))
            n = data.draw(st.integers(0, 50))
            assert lf.read(o, n) == text[o:o + n]
            assert lf.read(0, lf.size) == text


@settings(max_examples=examples(40))
@given(st.lists(st.integers(0, 10**15), max_size=30), st.integers(0, 400), st.integers(0, 100))
def test_line_file(values: list[int], off: int, size: int) -> None:
    text = "".join(f"{v}\n" for v in values).encode()
    lf = LineFile(np.array(values, dtype=np.int64))
    assert lf.size == len(text) and lf.read(off, size) == text[off:off + size]


def test_rank_reader_next_batch(jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, samples = jsonl_data
    state = DataState(num_samples=120, global_batch=8, seed=5, consumed=16)
    rr = RankReader(index, state, dp=4, dp_rank=2)
    for _ in range(20):  # crosses an epoch boundary
        expect = [samples[i] for i in rank_batch_ids(rr.state, 4, 2)]
        assert rr.next_batch() == expect
    assert rr.state.consumed == 16 + 20 * 8
    with pytest.raises(ValueError, match="index"):
        RankReader(index, DataState(num_samples=7, global_batch=1), 1, 0)


def test_cli_data_index(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "r.bin"
    p.write_bytes(b"x" * 1000)
    out = str(tmp_path / "i.npz")
    assert main(["data", "index", out, str(p), "--record-bytes", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 10
    assert main(["data", "index", out, str(p), "--tokens", "--seq-len", "10", "--dtype", "uint32"]) == 0
    assert load_index(out).num_samples == 1000 // 40
    assert main(["data", "index", out, str(tmp_path / "nope"), "--jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_truncated_or_garbled_index_names_the_file(tmp_path, jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, _ = jsonl_data
    good = tmp_path / "idx.npz"
    index.save(str(good))
    data = good.read_bytes()
    for name, blob in (("half", data[: len(data) // 2]), ("head", data[:30]), ("tail", data[-100:]),
                       ("flipped", data[:200] + bytes(b ^ 0xFF for b in data[200:260]) + data[260:])):
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(blob)
        with pytest.raises(DataIndexError, match=f"{name}.npz .*rebuild it with `tenplex data index`"):
            load_index(str(bad))


def test_index_with_ranges_outside_its_sources_is_refused(tmp_path, jsonl_data) -> None:  # type: ignore[no-untyped-def]
    index, _ = jsonl_data
    for field, value, match in (("file_id", 7, "names source file 7"), ("offset", 1 << 40, "outside its"),
                                ("length", 0, "outside its"), ("offset", -5, "outside its")):
        arrays = {"file_id": index.file_id.copy(), "offset": index.offset.copy(), "length": index.length.copy()}
        arrays[field] = arrays[field].astype(np.int64)
        arrays[field][3] = value
        np.savez(tmp_path / "x.npz", **arrays, meta=np.array(json.dumps(index.meta())))
        with pytest.raises(DataIndexError, match=f"x.npz is corrupt: sample 3 .*{match}"):
            load_index(str(tmp_path / "x.npz"))
    np.savez(tmp_path / "y.npz", file_id=index.file_id, offset=index.offset.astype(np.float64), length=index.length,
             meta=np.array(json.dumps(index.meta())))
    with pytest.raises(DataIndexError, match="offset must be a 1-D integer array"):
        load_index(str(tmp_path / "y.npz"))
    np.savez(tmp_path / "z.npz", file_id=index.file_id, offset=index.offset, length=index.length,
             meta=np.array(json.dumps([1, 2])))
    with pytest.raises(DataIndexError, match="z.npz is not a tenplex dataset index"):
        load_index(str(tmp_path / "z.npz"))


def test_sample_sizes_and_paths_are_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 100)
    for kw, match in ((dict(kind="records", record_bytes=10**30), "samples must be smaller than 4 GiB"),
                      (dict(kind="records", record_bytes=1 << 32), "samples must be smaller than 4 GiB"),
                      (dict(kind="records", record_bytes=True), "record-bytes must be >= 1"),
                      (dict(kind="tokens", seq_len=1 << 31, dtype="uint16"), "seq-len 2147483648 makes samples"),
                      (dict(kind="tokens", seq_len=2.5), "seq-len must be >= 1")):
        with pytest.raises(DataIndexError, match=match):
            build_index([str(src)], **kw)  # type: ignore[arg-type]
    with pytest.raises(DataIndexError, match="cannot use source file 'foo://x'"):
        build_index(["foo://x"], kind="jsonl")
    index = build_index([str(src)], kind="records", record_bytes=10)
    with pytest.raises(DataIndexError, match="cannot write the index .*check that its directory exists"):
        index.save(str(tmp_path / "missing" / "idx.npz"))
    assert not list(tmp_path.glob("**/*.tmp*"))
    with pytest.raises(DataIndexError, match="cannot use index 'foo://x/idx.npz'"):
        load_index("foo://x/idx.npz")
