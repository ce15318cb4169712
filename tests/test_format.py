import json
import os
import random
import stat
import struct
import tracemalloc
import zlib

import pytest
import torch
from safetensors import safe_open

from hf_deltazip.config import DeltaZipConfig
from hf_deltazip.delta import CompressedDelta, delta_bytes_report, load_folder_config
from hf_deltazip.errors import DeltaZipFormatError
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile, atomic_write_bytes
from hf_deltazip.hub import delta_card_data

from dz_factory import small_delta


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("delta")
    delta = small_delta()
    delta.save_pretrained(folder)
    return folder, delta


def read_all(path):
    with DeltaZipFile(path) as dz:
        return dz.read_tensors(), {n: r.to_json() for n, r in dz.modules.items()}, dict(dz.params)


def test_round_trip_is_exact(saved):
    folder, delta = saved
    again = CompressedDelta.from_pretrained(folder)
    assert set(again.modules) == set(delta.modules)
    for name, mod in delta.modules.items():
        got = again.modules[name]
        assert got.record(name) == mod.record(name)
        for role, t in mod.tensors().items():
            assert torch.equal(got.tensors()[role], t) and got.tensors()[role].dtype == t.dtype
        assert torch.equal(got.dequantize(), mod.dequantize())
    for name, t in delta.params.items():
        assert again.params[name].dtype == t.dtype and torch.equal(again.params[name], t)
    assert again.config == delta.config
    assert again.header["base_model"] == "tests/base"


def test_a_config_that_contradicts_the_header_is_refused(tmp_path):
    small_delta().save_pretrained(tmp_path)
    path = tmp_path / "deltazip_config.json"
    data = json.loads(path.read_text())
    assert (data["bits"], data["group_size"]) == (4, 128)
    path.write_text(json.dumps({**data, "bits": 2, "group_size": 64}))
    with pytest.raises(DeltaZipFormatError) as err:
        CompressedDelta.from_pretrained(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{path}: contradicts delta.dz")
    assert "bits is 2 but delta.dz was compressed with 4" in message
    assert "group_size is 64 but delta.dz was compressed with 128" in message
    assert "set bits=4, group_size=128 in deltazip_config.json" in message
    with DeltaZipFile(tmp_path / DZ_FILENAME) as dz:
        header = dz.header
    with pytest.raises(DeltaZipFormatError, match="bits is 2"):
        load_folder_config(tmp_path, header)
    with pytest.raises(DeltaZipFormatError, match="bits is 2"):  # the model card would show 2-bit
        delta_card_data(tmp_path, "me/delta")


def test_settings_the_config_leaves_out_come_from_the_header(tmp_path):
    delta = small_delta()
    delta.config = DeltaZipConfig(bits=3, group_size=64, sparsity=0.5, zstd_level=3)
    delta.save_pretrained(tmp_path)
    (tmp_path / "deltazip_config.json").write_text(json.dumps({"bits": 3, "sparsity": 0.5}))
    again = CompressedDelta.from_pretrained(tmp_path)
    assert again.config == delta.config and again.config.group_size == 64  # not the default 128
    assert delta_card_data(tmp_path, "me/delta")["group_size"] == 64


def test_standard_safetensors_reader_lists_the_tensors(saved):
    folder, delta = saved
    with safe_open(folder / DZ_FILENAME, framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        payload = f.get_tensor("model.layers.0.self_attn.q_proj.qweight")
    assert "model.layers.0.self_attn.q_proj.scales" in keys and "param::model.norm.weight" in keys
    assert meta["format"] == "hf-deltazip" and meta["dz_format_version"] == "1"
    assert payload.dtype == torch.uint8
    header = json.loads(meta["dz_header"])
    assert header["tensors"]["model.layers.0.self_attn.q_proj.qweight"]["dtype"] == "uint8"


def test_lazy_and_parallel_reads_agree(saved):
    folder, _ = saved
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        parallel = dz.read_tensors(num_threads=4)
        for name in dz.tensors:
            assert torch.equal(dz.get_tensor(name), parallel[name])
        assert any(r.encoding == "zstd" for r in dz.tensors.values())


def test_file_order_follows_the_safetensors_offsets(saved):
    """``in_file_order`` sorts tensor names by where the safetensors header says their bytes start."""
    folder, _ = saved
    raw = (folder / DZ_FILENAME).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    starts = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        order = dz.in_file_order()
        assert sorted(order) == sorted(dz.tensors) and [starts[t] for t in order] == sorted(starts[t] for t in order)
        some = list(reversed(order))[:3]
        assert dz.in_file_order(some) == sorted(some, key=starts.get)


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path):
    path = tmp_path / "x.dz"
    atomic_write_bytes(path, b"good")

    def chunks():
        yield b"partial"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, chunks())
    assert path.read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["x.dz"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        small_delta().save_pretrained(tmp_path / "delta")
        atomic_write_bytes(tmp_path / "plain.bin", b"x")
    finally:
        os.umask(old)
    for path in (tmp_path / "delta" / DZ_FILENAME, tmp_path / "delta" / "deltazip_config.json", tmp_path / "plain.bin"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_replacing_a_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "x.dz"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["x.dz"]


def test_interrupted_save_keeps_earlier_delta(tmp_path, monkeypatch):
    delta = small_delta()
    delta.save_pretrained(tmp_path)
    before = (tmp_path / DZ_FILENAME).read_bytes()
    import hf_deltazip.fileio as fmt

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(fmt.os, "fsync", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        small_delta(seed=1).save_pretrained(tmp_path)
    assert (tmp_path / DZ_FILENAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["deltazip_config.json", DZ_FILENAME])



def test_a_save_that_fails_on_its_second_file_leaves_the_earlier_delta_whole(tmp_path, monkeypatch):
    # the .dz file is written first; the config after it runs out of disk: neither may replace the old pair
    # (a new .dz beside the old config does not load, or loads the wrong settings)
    import dataclasses

    import hf_deltazip.fileio as fileio

    old = small_delta()
    old.save_pretrained(tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = small_delta(seed=1)
    new.config = dataclasses.replace(new.config, zstd_level=3)
    real = fileio.atomic_write_bytes

    def full_disk(path, chunks):
        if "deltazip_config" in str(path):
            raise OSError(28, "No space left on device")
        return real(path, chunks)

    monkeypatch.setattr(fileio, "atomic_write_bytes", full_disk)
    with pytest.raises(OSError, match="No space left"):
        new.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files  # no temporary files left either
    monkeypatch.undo()
    back = CompressedDelta.from_pretrained(tmp_path)
    assert back.config == old.config and back.modules.keys() == old.modules.keys()
    assert all(torch.equal(back.params[k], t) for k, t in old.params.items())

@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"", "truncated"),
        (b"\x01\x00", "truncated"),
        (struct.pack("<Q", 1 << 40) + b"{}", "exceeds"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 8) + b'{"a":1} ', "not an hf-deltazip file"),
        (b"PK\x03\x04" + b"\x00" * 40, "truncated"),
    ],
)
def test_garbage_files_raise_format_errors(tmp_path, content, fragment):
    path = tmp_path / "bad.dz"
    path.write_bytes(content)
    with pytest.raises(DeltaZipFormatError) as err:
        DeltaZipFile(path)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(DeltaZipFormatError, match="file not found"):
        DeltaZipFile(tmp_path / "nope.dz")


# --------------------------------------------------------------------------- header surgery
def split(data):
    (hlen,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def join(st, payload, fix_crc=True):
    meta = st["__metadata__"]
    if fix_crc:
        meta["dz_header_crc32"] = str(zlib.crc32(meta["dz_header"].encode()))
    hb = json.dumps(st).encode()
    hb += b" " * ((-len(hb)) % 8)
    return struct.pack("<Q", len(hb)) + hb + payload


def edit_dz(data, fn, fix_crc=True):
    st, payload = split(data)
    dz = json.loads(st["__metadata__"]["dz_header"])
    fn(dz, st)
    st["__metadata__"]["dz_header"] = json.dumps(dz)
    return join(st, payload, fix_crc)


Q = "model.layers.0.self_attn.q_proj"


def _set(path, value):
    def fn(dz, st):
        node = dz
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return fn


HEADER_EDITS = [
    (_set(["tensors", f"{Q}.scales", "nbytes"], 1 << 39), "nbytes"),
    (_set(["tensors", f"{Q}.scales", "shape"], [1 << 20, 1 << 19]), "nbytes"),
    (_set(["tensors", f"{Q}.scales", "dtype"], "complex64"), "unknown dtype"),
    (_set(["tensors", f"{Q}.qweight", "encoding"], "lz4"), "unknown encoding"),
    (_set(["tensors", f"{Q}.qweight", "crc32"], 12345), "checksum mismatch"),
    (_set(["modules", Q, "bits"], 5), "bits 5"),
    (_set(["modules", Q, "bits"], 8), "qweight is"),
    (_set(["modules", Q, "group_size"], 16), "scales is"),
    (_set(["modules", Q, "sparsity"], "3:8"), "unknown sparsity"),
    (_set(["modules", Q, "tensors", "qweight"], "nope"), "qweight tensor"),
    (_set(["modules", Q, "shape"], [24, 1 << 45]), "bad shape"),
    (_set(["params", "model.norm.weight", "tensor"], "nope"), "does not name"),
    (lambda dz, st: dz["tensors"].pop(f"{Q}.zeros"), "exactly the stored tensors"),
]


@pytest.mark.parametrize("edit, fragment", HEADER_EDITS)
def test_header_edits_are_caught(saved, tmp_path, edit, fragment):
    data = (saved[0] / DZ_FILENAME).read_bytes()
    path = tmp_path / "edited.dz"
    path.write_bytes(edit_dz(data, edit))
    with pytest.raises(DeltaZipFormatError, match=fragment):
        read_all(path)


def test_unknown_version_and_stale_header_crc(saved, tmp_path):
    data = (saved[0] / DZ_FILENAME).read_bytes()
    st, payload = split(data)
    st["__metadata__"]["dz_format_version"] = "5"
    (tmp_path / "v5.dz").write_bytes(join(st, payload))
    with pytest.raises(DeltaZipFormatError, match="upgrade hf-deltazip"):
        DeltaZipFile(tmp_path / "v5.dz")
    (tmp_path / "crc.dz").write_bytes(edit_dz(data, _set(["base_model"], "other"), fix_crc=False))
    with pytest.raises(DeltaZipFormatError, match="dz_header checksum"):
        DeltaZipFile(tmp_path / "crc.dz")


def test_payload_offsets_are_checked(saved, tmp_path):
    data = (saved[0] / DZ_FILENAME).read_bytes()
    st, payload = split(data)
    name = f"{Q}.scales"
    b, e = st[name]["data_offsets"]
    st[name]["data_offsets"] = [b, e + 1 << 30]
    (tmp_path / "off.dz").write_bytes(join(st, payload))
    with pytest.raises(DeltaZipFormatError, match="do not fit"):
        DeltaZipFile(tmp_path / "off.dz")
    (tmp_path / "tail.dz").write_bytes(data + b"junk")
    with pytest.raises(DeltaZipFormatError, match="after the last payload"):
        DeltaZipFile(tmp_path / "tail.dz")


# --------------------------------------------------------------------------- fuzzing
def mutate(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    buf = bytearray(data)
    if kind == 0:  # one bit flip anywhere
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # several flips in the payloads
        (hlen,) = struct.unpack("<Q", data[:8])
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(8 + hlen, len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif kind == 2:  # truncation
        buf = buf[: rng.randrange(len(buf))]
    elif kind == 3:  # random bytes over a span
        i = rng.randrange(len(buf))
        for j in range(i, min(len(buf), i + rng.randint(1, 64))):
            buf[j] = rng.randrange(256)
    elif kind == 4:  # huge or wrong header length
        buf[:8] = struct.pack("<Q", rng.choice([0, 7, len(data), 1 << 62, rng.randrange(1 << 32)]))
    elif kind == 5:  # header edits with a valid header checksum
        def fn(dz, st):
            name = rng.choice(sorted(dz["tensors"]))
            field = rng.choice(["nbytes", "crc32", "shape", "encoding", "dtype"])
            value = {
                "nbytes": rng.choice([0, 1, 1 << 40, (1 << 63) - 1, -1, 3.5]),
                "crc32": rng.randrange(1 << 32),
                "shape": rng.choice([[], [1 << 30, 1 << 30], [-1], [rng.randrange(1, 99)]]),
                "encoding": rng.choice(["raw", "zstd", "gzip"]),
                "dtype": rng.choice(["uint8", "float32", "float64", "object"]),
            }[field]
            dz["tensors"][name][field] = value
            if rng.random() < 0.3:
                mod = rng.choice(sorted(dz["modules"]))
                key = rng.choice(["bits", "group_size", "shape", "nnz", "sparsity", "kind"])
                dz["modules"][mod][key] = rng.choice([2, 3, 4, 8, 64, -1, 1 << 40, "2:4", "dense", [4, 4], None])

        buf = bytearray(edit_dz(data, fn))
    else:  # safetensors offsets moved, or bytes appended
        if rng.random() < 0.5:
            st, payload = split(data)
            name = rng.choice([k for k in st if k != "__metadata__"])
            b, e = st[name]["data_offsets"]
            st[name]["data_offsets"] = [b + rng.randint(-4, 4), e + rng.choice([-1, 1, 1 << 40])]
            buf = bytearray(join(st, payload, fix_crc=False))
        else:
            buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(buf)


def test_fuzzed_files_load_identically_or_raise_format_error(saved, tmp_path):
    original = (saved[0] / DZ_FILENAME).read_bytes()
    ref_tensors, ref_modules, ref_params = read_all(saved[0] / DZ_FILENAME)
    declared = sum(t.numel() * t.element_size() for t in ref_tensors.values())
    rng = random.Random(1234)
    path = tmp_path / "fuzz.dz"
    outcomes = {"identical": 0, "rejected": 0}
    tracemalloc.start()
    try:
        for case in range(2000):
            data = mutate(original, rng)
            path.write_bytes(data)
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
            try:
                tensors, modules, params = read_all(path)
            except DeltaZipFormatError:
                outcomes["rejected"] += 1
                if case % 4 == 0:  # a streamed read rejects it too
                    with pytest.raises(DeltaZipFormatError):
                        stream_all(path, piece_bytes=1 << 10)
            else:
                assert modules == ref_modules and params == ref_params, f"case {case}: metadata changed silently"
                assert tensors.keys() == ref_tensors.keys(), f"case {case}"
                for name, t in tensors.items():
                    assert t.dtype == ref_tensors[name].dtype and torch.equal(t, ref_tensors[name]), f"case {case}: {name}"
                outcomes["identical"] += 1
                streamed, _, _ = stream_all(path, piece_bytes=1 << 10)
                assert streamed.keys() == tensors.keys() and all(torch.equal(streamed[n], tensors[n]) for n in tensors)
            _, peak = tracemalloc.get_traced_memory()
            # decoding allocates the declared tensors and copies of the file, never what a header claims
            assert peak - base < 8 * (declared + len(original)) + (1 << 20), f"case {case}: allocated {peak - base}"
    finally:
        tracemalloc.stop()
    assert outcomes["rejected"] > 1000 and outcomes["identical"] > 0, outcomes


def test_info_reports_bytes_and_ratio(saved, capsys):
    from hf_deltazip.cli import main

    folder, delta = saved
    report = delta_bytes_report(folder)
    assert report["total_bytes"] == (folder / DZ_FILENAME).stat().st_size + (folder / "deltazip_config.json").stat().st_size
    assert sum(report["categories"].values()) + report["container_and_config_bytes"] == report["total_bytes"]
    assert report["categories"]["embeddings and head"] > 0 and report["categories"]["masks"] > 0
    n = delta.header["extra"]["finetune_num_params"]
    assert report["ratio"] == pytest.approx(2 * n / report["total_bytes"])
    assert main(["info", str(folder), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "tests/base" in out and "model.layers.0.mlp.up_proj" in out and "ratio" in out
    assert main(["info", str(folder / "missing")]) == 2
    assert capsys.readouterr().err == f"deltazip: error: {folder / 'missing'}: no such delta folder or .dz file\n"


def test_the_header_is_typed_on_read_and_keeps_what_it_does_not_know(tmp_path):
    from hf_deltazip.format import DeltaHeader

    delta = small_delta()
    delta.header = DeltaHeader.from_dict({**delta.header.to_dict(), "written_by_a_newer_version": {"x": 1}})
    delta.save_pretrained(tmp_path / "d")
    with DeltaZipFile(tmp_path / "d" / DZ_FILENAME) as dz:
        header = dz.header
    assert isinstance(header, DeltaHeader)
    assert header.base_model == delta.header.base_model and header.tied_embeddings == delta.header.tied_embeddings
    assert header.unknown == {"written_by_a_newer_version": {"x": 1}}  # survives a save and a read
    assert header.config == delta.config.to_dict()
    assert dict(header) == header.to_dict()  # the read-only mapping is the JSON form
    for field_name, bad in (("base_model", 5), ("extra", []), ("architectures", "LlamaForCausalLM"),
                            ("base_source", "ftp")):
        with pytest.raises(ValueError, match=field_name):
            DeltaHeader.from_dict({field_name: bad})
    # a header field of the wrong type in a file is a format error, not a crash later
    path = tmp_path / "d" / DZ_FILENAME
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    st = json.loads(data[8 : 8 + hlen])
    dz_header = json.loads(st["__metadata__"]["dz_header"])
    dz_header["base_model"] = 5
    text = json.dumps(dz_header, sort_keys=True, separators=(",", ":"))
    st["__metadata__"]["dz_header"] = text
    st["__metadata__"]["dz_header_crc32"] = str(zlib.crc32(text.encode()))
    hb = json.dumps(st, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + hlen :])
    with pytest.raises(DeltaZipFormatError, match="base_model"):
        DeltaZipFile(path)


def _rows_delta():
    """small_delta with an embedding delta whose rows 0..39 are unchanged (stored in the rows layout)."""
    from hf_deltazip.compression.solver import rtn_compress
    from hf_deltazip.delta import PackedModule

    delta = small_delta()
    d = torch.zeros(50, 40)
    d[40:] = torch.randn(10, 40, generator=torch.Generator().manual_seed(3)) * 0.01
    res = rtn_compress(d, bits=4, group_size=-1)
    delta.modules["model.embed_tokens"] = PackedModule.from_codes(res.codes, res.scales, res.zeros, None, bits=4,
                                                                  group_size=-1, symmetric=True, kind="embedding",
                                                                  skip_zero_rows=True)
    return delta, res


def test_rows_layout_round_trips_and_its_records_are_checked(tmp_path):
    delta, res = _rows_delta()
    emb = delta.modules["model.embed_tokens"]
    assert emb.sparsity == "rows" and emb.nnz == 10 and emb.qweight.shape[0] == 10
    delta.save_pretrained(tmp_path / "ok")
    again = CompressedDelta.from_pretrained(tmp_path / "ok")
    assert torch.equal(again.modules["model.embed_tokens"].dequantize(), res.dequantize())
    report = delta_bytes_report(tmp_path / "ok")
    row = next(m for m in report["modules"] if m["module"] == "model.embed_tokens")
    assert row["sparsity"] == "rows" and row["resident_bytes"] == 50 * 20 + 50 * 3  # dense codes + scales + zeros on a GPU
    data = (tmp_path / "ok" / DZ_FILENAME).read_bytes()
    st, payload = split(data)
    assert st["__metadata__"]["dz_format_version"] == "2"
    cases = {
        "v1.dz": (lambda dz, st: st["__metadata__"].update(dz_format_version="1"), "does not exist in format version 1"),
        "nnz.dz": (_set(["modules", "model.embed_tokens", "nnz"], 11), "expected"),
        "nnz_big.dz": (_set(["modules", "model.embed_tokens", "nnz"], 51), "bad nnz"),
        "dense_nnz.dz": (_set(["modules", "model.layers.0.self_attn.q_proj", "nnz"], 3), "has none"),
    }
    for name, (fn, fragment) in cases.items():
        (tmp_path / name).write_bytes(edit_dz(data, fn))
        with pytest.raises(DeltaZipFormatError, match=fragment):
            DeltaZipFile(tmp_path / name)


# --------------------------------------------------------------------------- streamed reads
def stream_all(path, **kw):
    with DeltaZipFile(path) as dz:
        got = {}
        for piece in dz.stream_tensors(**kw):
            got.update(piece)
        return got, {n: r.to_json() for n, r in dz.modules.items()}, dict(dz.params)


@pytest.mark.parametrize("piece_bytes", [1, 300, 1 << 30])  # one tensor a piece; a few; the whole file
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("direct", [False, True])  # through the page cache; O_DIRECT reads of one block each
def test_streamed_pieces_equal_lazy_reads_in_file_order(saved, piece_bytes, threads, direct, monkeypatch):
    folder, _ = saved
    direct_reads = []
    real_direct = DeltaZipFile._pread_direct
    monkeypatch.setattr(DeltaZipFile, "_pread_direct",
                        lambda self, fd, mv, off: direct_reads.append(len(mv)) or real_direct(self, fd, mv, off))
    kw = dict(direct_io=True, io_bytes=4096) if direct else {}
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        order = dz.in_file_order()
        pieces = list(dz.stream_tensors(piece_bytes=piece_bytes, num_threads=threads, ahead=1, **kw))
        if direct and hasattr(os, "O_DIRECT"):  # every stored byte came through direct reads of at most io_bytes
            assert sum(direct_reads) >= os.path.getsize(folder / DZ_FILENAME) - dz._spans[order[0]][0]
            assert max(direct_reads) <= 4096
        else:
            assert not direct_reads
        assert [n for p in pieces for n in p] == order  # every tensor once, in file order
        for p in pieces:  # a piece stays under its size unless it is one tensor
            assert len(p) == 1 or sum(-(-dz.tensors[n].nbytes // 64) * 64 for n in p) <= piece_bytes
            for name, t in p.items():
                want = dz.get_tensor(name)
                assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), name
        assert (len(pieces) == len(order)) == (piece_bytes == 1)
        two = list(dz.stream_tensors(piece_bytes=piece_bytes, num_threads=threads, readers=2, **kw))
        assert [list(p) for p in two] == [list(p) for p in pieces]  # two readers: the same pieces, in order
        assert all(torch.equal(t, p[n]) for q, p in zip(two, pieces) for n, t in q.items())
        # a subset whose stored bytes are not contiguous is read run by run
        some = order[::3]
        got = {n: t for p in dz.stream_tensors(some, piece_bytes=1 << 20, **kw) for n, t in p.items()}
        assert list(got) == some and all(torch.equal(got[n], dz.get_tensor(n)) for n in some)


def test_streamed_reads_survive_short_reads(saved, monkeypatch):
    """``preadv`` may return fewer bytes than asked, ending mid-buffer: the rest is read after them."""
    folder, _ = saved
    want, _, _ = read_all(folder / DZ_FILENAME)
    real = os.preadv
    calls = []

    def short(fd, bufs, offset):
        calls.append(len(bufs))
        room = 7 + len(calls) % 5  # a few bytes a call, never at a buffer's end
        take = []
        for b in bufs:
            if room <= 0:
                break
            v = memoryview(b)[:room]
            take.append(v)
            room -= len(v)
        return real(fd, take, offset)

    monkeypatch.setattr(os, "preadv", short)
    got, _, _ = stream_all(folder / DZ_FILENAME, piece_bytes=1 << 12)
    assert max(calls) > 1 and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_corrupt_piece_raises_and_closing_early_stops_the_reader(saved, tmp_path):
    import threading

    folder, _ = saved
    data = bytearray((folder / DZ_FILENAME).read_bytes())
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        last = dz.in_file_order()[-1]
        b, e = dz._spans[last]
    data[e - 1] ^= 0xFF  # the last tensor's last byte: every piece before it is fine
    (tmp_path / "bad.dz").write_bytes(bytes(data))
    with DeltaZipFile(tmp_path / "bad.dz") as dz:
        stream = dz.stream_tensors(piece_bytes=1)
        first = next(stream)
        assert list(first) == [dz.in_file_order()[0]]
        with pytest.raises(DeltaZipFormatError, match=f"tensor {last!r}"):
            for _ in stream:
                pass
        stream = dz.stream_tensors(piece_bytes=1)
        next(stream)
        stream.close()  # the consumer gave up: the reader and the pool are shut down, not left running
    assert not [t for t in threading.enumerate() if t.name.startswith(("deltazip-read", "deltazip-load"))]
    # a file cut short after it was opened (checked then): the read that comes up short names it
    (tmp_path / "short.dz").write_bytes(bytes(data))
    with DeltaZipFile(tmp_path / "short.dz") as dz:
        os.truncate(tmp_path / "short.dz", b + 1)
        with pytest.raises(DeltaZipFormatError, match="truncated"):
            for _ in dz.stream_tensors(piece_bytes=1):
                pass


needs_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS")


@needs_direct
def test_direct_reads_fall_back_to_the_page_cache_where_refused(saved, monkeypatch):
    """A file system that refuses a direct read (EINVAL) gets the same tensors through the page cache."""
    import errno
    import fcntl

    folder, _ = saved
    want, _, _ = read_all(folder / DZ_FILENAME)
    real, refused = os.preadv, []

    def refuse_direct(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)
    got, _, _ = stream_all(folder / DZ_FILENAME, piece_bytes=300, direct_io=True, io_bytes=4096, readers=2)
    assert refused and got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    # any other error is the caller's to see
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        stream_all(folder / DZ_FILENAME, direct_io=True)


@needs_direct
def test_auto_direct_reads_only_a_file_mostly_out_of_the_page_cache(saved, monkeypatch):
    import hf_deltazip.format.container as container

    folder, _ = saved
    want, _, _ = read_all(folder / DZ_FILENAME)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a: opened.append(flags) or real_open(p, flags, *a))
    for cached, direct in ((0.0, True), (0.49, True), (0.5, False), (1.0, False), (None, False)):
        opened.clear()
        monkeypatch.setattr(container, "page_cache_fraction", lambda fd, size, c=cached: c)
        got, _, _ = stream_all(folder / DZ_FILENAME, piece_bytes=300, direct_io="auto")
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert any(f & os.O_DIRECT for f in opened) == direct, cached
    with pytest.raises(ValueError, match="direct_io"):
        stream_all(folder / DZ_FILENAME, direct_io="yes")
    with pytest.raises(ValueError, match="io_bytes"):
        stream_all(folder / DZ_FILENAME, direct_io=True, io_bytes=1000)


@needs_direct
def test_direct_reads_name_a_corrupt_tensor_and_a_file_cut_short(saved, tmp_path):
    import threading

    folder, _ = saved
    data = bytearray((folder / DZ_FILENAME).read_bytes())
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        order = dz.in_file_order()
        last = order[-1]
        b, e = dz._spans[last]
    data[e - 1] ^= 0xFF
    (tmp_path / "bad.dz").write_bytes(bytes(data))
    with DeltaZipFile(tmp_path / "bad.dz") as dz:
        stream = dz.stream_tensors(piece_bytes=1, direct_io=True, io_bytes=4096)
        assert list(next(stream)) == [order[0]]
        with pytest.raises(DeltaZipFormatError, match=f"tensor {last!r}"):
            for _ in stream:
                pass
        stream = dz.stream_tensors(piece_bytes=1, direct_io=True)
        next(stream)
        stream.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(("deltazip-read", "deltazip-load", "deltazip-piece"))]
    (tmp_path / "short.dz").write_bytes(bytes(data))
    with DeltaZipFile(tmp_path / "short.dz") as dz:
        os.truncate(tmp_path / "short.dz", b + 1)
        with pytest.raises(DeltaZipFormatError, match="truncated"):
            for _ in dz.stream_tensors(piece_bytes=1, direct_io=True, io_bytes=4096):
                pass


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_page_cache_fraction_sees_a_file_leave_the_page_cache(tmp_path):
    from hf_deltazip.format.container import page_cache_fraction

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        before = page_cache_fraction(fd, 1 << 20)
        if before is None:
            pytest.skip("this system does not report page cache residency")
        assert before == 1.0  # just written
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after = page_cache_fraction(fd, 1 << 20)
        if after > 0.5:
            pytest.skip("this file system kept the pages after POSIX_FADV_DONTNEED")
        os.pread(fd, 4096, 0)
        assert page_cache_fraction(fd, 1 << 20) > after  # reading brings pages back in
    finally:
        os.close(fd)
