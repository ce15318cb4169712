"""What a PEFT user expects of DeltaModel: saving deltas (never the base), the active delta, the
public delta cache (residency states, holds, budgets), and objects that show themselves."""

import copy
import os
import stat

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaNotFoundError, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.delta import CompressedDelta
from hf_deltazip.modeling import CacheFullError, DeltaInUseError, Residency

from model_factory import base_model, calibration_ids, finetune

IDS = calibration_ids(n=2, length=8, seed=5)


@pytest.fixture(scope="module")
def deltas(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-deltas")
    out = {}
    for i, name in enumerate(("a", "b"), start=1):
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        delta = compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16),
                         progress=False)
        delta.save_pretrained(root / name)
        out[name] = (root / name, delta)
    return out


def fresh_base():
    return copy.deepcopy(base_model("llama"))


def greedy(model, **kwargs):
    with torch.no_grad():
        return model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=4, do_sample=False,
                              pad_token_id=0, **kwargs)


def test_the_loaded_delta_is_active(deltas):
    model = DeltaModel.from_pretrained(deltas["a"][0], base=fresh_base(), delta_name="a")
    assert model.active_delta == "a"
    merged_a = model.merge_and_unload("a")
    assert torch.equal(greedy(model), greedy(merged_a))
    assert torch.equal(greedy(model), greedy(model, delta_names=["a", "a"]))
    assert not torch.equal(greedy(model), greedy(base_model("llama")))
    # loading another delta keeps the active one (as PEFT's load_adapter does)
    model.load_delta(deltas["b"][0], delta_name="b")
    assert model.active_delta == "a"
    assert torch.equal(greedy(model), greedy(merged_a))
    # None per row still selects the base
    mixed = greedy(model, delta_names=[None, "b"])
    assert torch.equal(mixed[0], greedy(base_model("llama"))[0])
    assert torch.equal(mixed[1], greedy(model.merge_and_unload("b"))[1])
    model.set_delta(None)
    assert model.active_delta is None
    assert torch.equal(greedy(model), greedy(base_model("llama")))
    model.set_delta("b")
    assert torch.equal(greedy(model), greedy(model.merge_and_unload("b")))
    with pytest.raises(DeltaNotFoundError, match="no delta named 'zzz'"):
        model.set_delta("zzz")


def test_one_delta_loaded_is_used_and_several_unchosen_refuse_to_guess(deltas):
    model = DeltaModel(fresh_base())
    assert torch.equal(greedy(model), greedy(base_model("llama")))  # no delta: the base
    model.load_delta(deltas["a"][0], delta_name="a")
    assert model.active_delta == "a"
    assert torch.equal(greedy(model), greedy(model, delta_names=["a", "a"]))
    model.load_delta(deltas["b"][0], delta_name="b")
    assert model.active_delta is None
    with pytest.raises(DeltaZipError, match="none is active"):
        greedy(model)
    model.delete_delta("b")
    assert model.active_delta == "a"


def test_save_pretrained_writes_deltas_never_the_base(deltas, tmp_path):
    model = DeltaModel.from_pretrained(deltas["a"][0], base=fresh_base(), delta_name="a")
    model.add_delta(deltas["b"][1], "b")  # in memory: no folder behind it
    want = {n: model(input_ids=IDS, delta_names=[n, None]).logits for n in ("a", "b")}
    out = model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    for n in ("a", "b"):
        files = sorted(p.name for p in (out / n).iterdir())
        assert "delta.dz" in files and "deltazip_config.json" in files
        assert not any(f.endswith((".safetensors", ".bin")) and f != "delta.dz" for f in files), files
        assert "config.json" not in files  # no base model folder
        again = DeltaModel.from_pretrained(out / n, base=fresh_base(), delta_name=n)
        torch.testing.assert_close(again(input_ids=IDS, delta_names=[n, None]).logits, want[n], rtol=0, atol=0)
    # a file-backed delta is saved byte for byte
    assert (out / "a" / "delta.dz").read_bytes() == (deltas["a"][0] / "delta.dz").read_bytes()
    # files get the user's umask, like any other file they save
    umask = os.umask(0)
    os.umask(umask)
    mode = stat.S_IMODE((out / "a" / "delta.dz").stat().st_mode)
    assert mode == 0o666 & ~umask


def test_save_pretrained_default_goes_to_the_root_and_selected_only(deltas, tmp_path):
    model = DeltaModel.from_pretrained(deltas["a"][0], base=fresh_base())  # delta_name="default"
    model.load_delta(deltas["b"][0], delta_name="b")
    model.save_pretrained(tmp_path / "only", selected_deltas=["default"])
    # exactly the delta's own folder (with its generation config), no subfolder for "b", no base
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == sorted(p.name for p in deltas["a"][0].iterdir())
    again = DeltaModel.from_pretrained(tmp_path / "only", base=fresh_base())
    assert torch.equal(greedy(again), greedy(model, delta_names=["default", "default"]))
    with pytest.raises(DeltaNotFoundError):
        model.save_pretrained(tmp_path / "x", selected_deltas=["nope"])
    with pytest.raises(DeltaZipError, match="nothing to save"):
        DeltaModel(fresh_base()).save_pretrained(tmp_path / "empty")


def test_cache_states_holds_and_budget(deltas):
    model = DeltaModel(fresh_base())
    model.configure_cache(max_resident=1)
    model.load_delta(deltas["a"][0], delta_name="a")
    model.load_delta(deltas["b"][0], delta_name="b", resident=False)
    cache = model.cache
    assert cache.state("a") is Residency.DEVICE and cache.state("b") is Residency.DISK
    assert cache.fits(["a"]) and cache.fits(["b"])
    slots = cache.acquire(["a", None])
    assert slots == [cache.slot_of("a"), -1]
    assert not cache.fits(["b"]), "a is held: b cannot be resident beside it with max_resident=1"
    with pytest.raises(CacheFullError):
        cache.acquire(["b"])
    with pytest.raises(DeltaInUseError):
        model.delete_delta("a")
    cache.release(["a", None])
    assert cache.fits(["b"])
    assert cache.acquire(["b"]) == [cache.slot_of("b")]
    assert cache.state("a") is Residency.DISK and cache.state("b") is Residency.DEVICE  # a was evicted
    cache.release(["b"])
    model.configure_cache(max_resident=2, max_host_bytes=10**9)
    model(input_ids=IDS, delta_names=["a", "b"])
    model.configure_cache(max_resident=1, max_host_bytes=10**9)
    assert sorted(cache.state(n).value for n in ("a", "b")) == ["device", "host"]  # the evicted one kept a copy
    with pytest.raises(DeltaNotFoundError):
        cache.acquire(["nope"])


def test_a_delta_that_cannot_fit_the_byte_budget_evicts_nothing(deltas):
    # an 8-bit delta larger than the whole budget, with a 4-bit delta resident and idle: refused, and the
    # 4-bit delta stays on the device (evicting it would free room that cannot be enough)
    cfg = DeltaZipConfig(bits=8, group_size=32, n_samples=4, seq_len=16)
    big = compress(base_model("llama"), finetune("llama", 3), cfg, calibration=calibration_ids(n=4, length=16),
                   progress=False)
    model = DeltaModel(fresh_base())
    model.load_delta(deltas["a"][0], delta_name="a")
    model.add_delta(big, "big", resident=False)
    cache = model.cache
    small = cache.resident_bytes()
    model.configure_cache(max_resident_bytes=small + small // 2)
    assert cache.resident == ["a"]
    with pytest.raises(CacheFullError, match="more than the whole resident budget"):
        cache.acquire(["big"])
    assert cache.resident == ["a"] and cache.state("a") is Residency.DEVICE
    # two 4-bit deltas where the budget holds one, the first held: the second is refused, the first kept
    model.load_delta(deltas["b"][0], delta_name="b", resident=False)
    cache.acquire(["a"])
    with pytest.raises(CacheFullError, match="next to the deltas in use"):
        cache.acquire(["b"])
    assert cache.resident == ["a"] and cache.held == {"a": 1}
    cache.release(["a"])
    assert cache.acquire(["b"]) == [cache.slot_of("b")] and cache.resident == ["b"]  # idle, "a" makes room
    cache.release(["b"])
    with torch.no_grad():
        out = model(input_ids=IDS, delta_names=["b", "b"]).logits
    ref = model.merge_and_unload("b")
    torch.testing.assert_close(out, ref(input_ids=IDS).logits, atol=1e-4, rtol=1e-4)


def test_objects_show_themselves(deltas):
    model = DeltaModel.from_pretrained(deltas["a"][0], base=fresh_base(), delta_name="a")
    model.add_delta(deltas["b"][1], "b", resident=False)
    text = repr(model)
    assert text.splitlines()[1].strip().startswith("base=")
    assert "a (active): 4-bit, on cpu" in text and "b: 4-bit, on host" in text
    assert "deltas={a: 4-bit}" in text  # patched layers list their deltas, as PEFT lists adapters
    html = model._repr_html_()
    assert "<table>" in html and "<td>a</td>" in html and "<td>host</td>" in html and "in memory" in html
    assert isinstance(deltas["b"][1], CompressedDelta)


def test_loading_refuses_a_config_that_contradicts_the_header(deltas, tmp_path):
    import json
    import shutil

    from hf_deltazip import DeltaZipFormatError

    folder = tmp_path / "lying"
    shutil.copytree(deltas["a"][0], folder)
    cfg = json.loads((folder / "deltazip_config.json").read_text())
    cfg["bits"] = 2  # the file holds 4-bit codes
    (folder / "deltazip_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DeltaZipFormatError, match="bits is 2 but delta.dz was compressed with 4"):
        DeltaModel.from_pretrained(folder, base=fresh_base())
    model = DeltaModel(fresh_base())
    with pytest.raises(DeltaZipFormatError, match="bits is 2"):
        model.load_delta(folder, delta_name="x")
    assert model.deltas == []


def test_the_recorded_local_base_is_found_or_reported_missing_at_once(tmp_path):
    import time

    from hf_deltazip import BaseMismatchError

    base_dir = tmp_path / "models" / "base"
    base_model("llama").save_pretrained(base_dir)
    cfg = DeltaZipConfig(bits=4, group_size=32)
    delta = compress(base_dir, finetune("llama", 1), cfg, progress=False)  # round-to-nearest: no calibration needed
    delta.save_pretrained(tmp_path / "delta")
    model = DeltaModel.from_pretrained(tmp_path / "delta")  # base loaded from where it was recorded
    assert torch.equal(greedy(model), greedy(model.merge_and_unload()))
    base_dir.rename(tmp_path / "moved")
    start = time.perf_counter()
    with pytest.raises(BaseMismatchError, match="not there .*pass base="):
        DeltaModel.from_pretrained(tmp_path / "delta")
    assert time.perf_counter() - start < 5, "a missing local base must be reported at once, not retried on the Hub"


def test_zero_points_off_the_code_grid_are_refused_in_memory_and_from_a_file(deltas, tmp_path):
    """The kernels take a zero point's low bits and the reference path its value, so a zero point past
    ``2**bits - 1`` (which no compression writes) would make the two routes disagree: refused, naming the module."""
    import dataclasses

    from hf_deltazip import DeltaZipFormatError

    delta = deltas["a"][1]
    name = next(n for n, p in delta.modules.items() if p.kind == "linear" and p.bits == 4)
    bad = dict(delta.modules)
    zeros = bad[name].zeros.clone()
    zeros[0, 0] = 16  # 4-bit codes: zero points in [0, 15]
    bad[name] = dataclasses.replace(bad[name], zeros=zeros)
    damaged = CompressedDelta(config=delta.config, modules=bad, params=dict(delta.params), header=delta.header)
    model = DeltaModel(fresh_base())
    with pytest.raises(DeltaZipFormatError, match=rf"{name}: zero points up to 16, but those of 4-bit codes lie in \[0, 15\]"):
        model.add_delta(damaged, "bad")
    assert model.deltas == []
    damaged.save_pretrained(tmp_path / "bad")
    with pytest.raises(DeltaZipFormatError, match="zero points up to 16"):
        model.load_delta(tmp_path / "bad", delta_name="bad")
    assert model.deltas == []
    model.add_delta(delta, "a")  # the delta as compressed passes
    assert torch.equal(greedy(model), greedy(model.merge_and_unload("a")))


@pytest.mark.parametrize("case", ["missing module", "wrong shape", "missing parameter"])
def test_an_in_memory_delta_that_does_not_fit_the_base_is_refused_with_the_fix(case):
    """add_delta with packed modules or exact parameters the base lacks, or of another shape: a BaseMismatchError
    naming them and what to do, and nothing added."""
    from hf_deltazip import BaseMismatchError
    from hf_deltazip.bench.decode import random_delta

    delta = random_delta(base_model("llama"), 4, 32, 0)
    up, down = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    if case == "missing module":
        delta["model.layers.99.mlp.up_proj"] = delta.pop(up)
        match = r"base has no module 'model\.layers\.99\.mlp\.up_proj'; load the delta onto the base"
    elif case == "wrong shape":
        delta[up] = delta[down]  # [hidden, intermediate] codes where the base has [intermediate, hidden]
        match = r"model\.layers\.0\.mlp\.up_proj is \[\d+, \d+\] in the delta but \[\d+, \d+\] in the base; load the delta onto"
    else:  # a norm weight under a name the base does not have (no fingerprint recorded, so only this check sees it)
        delta = CompressedDelta(config=DeltaZipConfig(bits=4), modules=delta,
                                params={"model.layers.99.input_layernorm.weight": torch.ones(8)})
        match = r"base has no parameter 'model\.layers\.99\.input_layernorm\.weight'; load the delta onto the base"
    model = DeltaModel(fresh_base())
    model.add_delta(random_delta(base_model("llama"), 4, 32, 1), "fine")
    with pytest.raises(BaseMismatchError, match=match):
        model.add_delta(delta, "bad")
    assert model.deltas == ["fine"]


def test_from_pretrained_without_a_name_activates_the_delta_under_its_folder_name(deltas):
    folder, _ = deltas["a"]
    model = DeltaModel.from_pretrained(folder, base=fresh_base(), delta_name=None)
    assert model.deltas == ["a"] and model.active_delta == "a"
    assert torch.equal(greedy(model), greedy(model, delta_names=["a", "a"]))  # not the plain base
    assert not torch.equal(model(IDS).logits, fresh_base()(IDS).logits)
    with pytest.raises(DeltaZipError, match="non-empty str"):
        DeltaModel.from_pretrained(folder, base=fresh_base(), delta_name="")


def test_delta_names_must_be_strings_and_saving_needs_one_folder_name_each(deltas, tmp_path):
    _, delta = deltas["a"]
    model = DeltaModel(fresh_base())
    for bad in (None, 5, ""):
        with pytest.raises(DeltaZipError, match="non-empty str"):
            model.add_delta(delta, bad)
    assert model.deltas == []
    model.add_delta(delta, "../escaped")  # a served name may be anything; saving it under its name may not
    model.add_delta(delta, "org/chat")
    for name in ("../escaped", "org/chat"):
        with pytest.raises(DeltaZipError, match="one folder name"):
            model.save_pretrained(tmp_path / "root", selected_deltas=[name])
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "root").exists()
    model.add_delta(delta, "ok")
    assert model.save_pretrained(tmp_path / "root", selected_deltas="ok") == tmp_path / "root"  # a str is one name
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["ok"]
    with pytest.raises(DeltaZipError, match="selected_deltas is empty"):
        model.save_pretrained(tmp_path / "root", selected_deltas=[])


def test_rows_and_names_must_match_in_every_call_form(deltas):
    folder, _ = deltas["a"]
    model = DeltaModel(fresh_base())
    model.load_delta(folder, delta_name="a")
    kw = dict(attention_mask=torch.ones_like(IDS), max_new_tokens=2, do_sample=False, pad_token_id=0)
    for call in (lambda: model.generate(IDS, delta_names=[None], **kw),
                 lambda: model.generate(inputs=IDS, delta_names=[None], **kw),
                 lambda: model.generate(input_ids=IDS, delta_names=[None], **kw),
                 lambda: model(IDS, delta_names=["a", None, "a"])):
        with pytest.raises(DeltaZipError, match="delta names for a batch of 2 rows"):
            call()
    four = torch.cat([IDS, IDS])
    with model.route(["a", None]), pytest.raises(DeltaZipError, match="2 delta names for a batch of 4 rows"):
        model.base_model(four)
    with model.route(["a"]):  # one name: every row
        assert torch.equal(model.base_model(four).logits, model(four, delta_names=["a"] * 4).logits)
    # generate's own expansion (two sequences per prompt) repeats each row's delta
    beams = model.generate(IDS, delta_names=["a", None], num_beams=2, num_return_sequences=2, **kw)
    one = model.generate(IDS[:1], delta_names=["a"], num_beams=2, num_return_sequences=2,
                         **{**kw, "attention_mask": torch.ones_like(IDS[:1])})
    assert beams.shape[0] == 4 and torch.equal(beams[:2], one)


def test_merge_and_unload_takes_one_name(deltas):
    folder, _ = deltas["a"]
    model = DeltaModel(fresh_base())
    model.load_delta(folder, delta_name="a")
    with pytest.raises(DeltaZipError, match="merges one delta"):
        model.merge_and_unload(["a"])
    with pytest.raises(DeltaNotFoundError):
        model.merge_and_unload("")  # not the active delta in disguise


def test_a_delta_whose_file_was_replaced_after_loading_is_refused(deltas, tmp_path):
    import shutil

    (fa, _), (fb, delta_b) = deltas["a"], deltas["b"]
    work = tmp_path / "a"
    shutil.copytree(fa, work)
    model = DeltaModel(fresh_base())
    model.load_delta(work, delta_name="a", resident=False)  # registered, read when first used
    model.load_delta(fb, delta_name="default")
    with pytest.raises(DeltaZipError, match="is the folder delta 'a' is read from"):
        model.save_pretrained(work, selected_deltas=["default"])  # "default" goes into the folder itself
    model.load_delta(fb, delta_name="b")
    CompressedDelta.from_pretrained(work).save_pretrained(work)  # the same delta saved again: still 'a'
    assert torch.equal(model(IDS, delta_names=["a", "a"]).logits, model.merge_and_unload("a")(IDS).logits)
    model.cache.configure(max_resident=1)  # 'a' goes back to disk, to be read again
    model(IDS, delta_names=["b", "b"])
    delta_b.save_pretrained(work)  # another delta written over the folder behind the model's back
    with pytest.raises(DeltaZipError, match="was replaced by another delta after it was loaded"):
        model(IDS, delta_names=["a", "a"])
    model.delete_delta("a")
    model.load_delta(work, delta_name="a")  # loaded again: what the folder holds now
    assert torch.equal(model(IDS, delta_names=["a", "a"]).logits, model(IDS, delta_names=["b", "b"]).logits)
