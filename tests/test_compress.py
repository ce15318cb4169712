import json
import time

import pytest
import torch

from hf_deltazip import DeltaZipConfig, DeltaZipError, UnsupportedModelError, compress
from hf_deltazip.delta import CompressedDelta, resolve_recorded_base
from hf_deltazip.errors import BaseMismatchError
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile
from hf_deltazip.packing import check_2of4_mask

from model_factory import ARCHS, VOCAB, base_model, calibration_ids, finetune

CFG = dict(n_samples=8, seq_len=24, group_size=32)


def weight_nk(module):
    w = module.weight
    return w.t() if type(module).__name__ == "Conv1D" else w


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_compresses_and_reloads(arch, tmp_path):
    base, ft = base_model(arch), finetune(arch, 1)
    delta = compress(base, ft, DeltaZipConfig(bits=4, **CFG), calibration=calibration_ids(), progress=False)
    linear = [n for n, m in delta.modules.items() if m.kind == "linear"]
    assert linear, "no linear module was compressed"
    delta.save_pretrained(tmp_path)
    again = CompressedDelta.from_pretrained(tmp_path)
    assert set(again.modules) == set(delta.modules)
    for name, mod in delta.modules.items():
        # what the .dz decodes to is exactly the reconstruction the pipeline made
        assert torch.equal(again.modules[name].dequantize(), mod.dequantize())
        if mod.kind == "linear":
            rel_err = delta.summary["relative_error"][name]
            assert 0 <= rel_err < 0.05, (name, rel_err)
    # every changed non-compressed parameter is stored exactly
    compressed = {f"{n}.weight" for n in delta.modules}
    base_params = dict(base.named_parameters())
    for name, p in ft.named_parameters():
        if name in compressed:
            continue
        assert torch.equal(again.params[name], p.detach()), name
        assert not torch.equal(base_params[name], p)
    assert again.header["model_type"] == ft.config.model_type
    if arch == "gpt2":
        assert any(m.transposed for m in delta.modules.values())
        assert again.header["extra"]["tied_embeddings"] is True
        assert "lm_head" not in again.modules  # tied: stored once


def test_obs_beats_round_to_nearest_on_the_model_output():
    base, ft = base_model("llama"), finetune("llama", 1)
    calib = calibration_ids(n=16, length=32, seed=1)
    held_out = calibration_ids(n=4, length=32, seed=99)
    cfg = DeltaZipConfig(bits=2, group_size=-1, embeddings="exact", n_samples=16, seq_len=32)
    obs = compress(base, ft, cfg, calibration=calib, progress=False)
    rtn = compress(base, ft, cfg, calibration=None, progress=False)

    def output_error(delta):
        from hf_deltazip import DeltaModel
        import copy

        model = DeltaModel(copy.deepcopy(base))
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            delta.save_pretrained(d)
            model.load_delta(d, delta_name="x")
        with torch.no_grad():
            got = model(input_ids=held_out, delta_names=["x"] * 4).logits
            want = ft(input_ids=held_out).logits
        return float((got - want).pow(2).mean())

    assert output_error(obs) < 0.8 * output_error(rtn)


def test_two_four_and_unstructured_sparsity():
    base, ft = base_model("qwen2"), finetune("qwen2", 2)
    d24 = compress(base, ft, DeltaZipConfig(bits=2, sparsity="2:4", **CFG), calibration=calibration_ids(), progress=False)
    for name, mod in d24.modules.items():
        if mod.kind == "linear":
            assert mod.sparsity == "2:4"
            check_2of4_mask(mod.kept_mask())
    half = compress(base, ft, DeltaZipConfig(bits=3, sparsity=0.5, **CFG), calibration=calibration_ids(), progress=False)
    for name, mod in half.modules.items():
        if mod.kind == "linear":
            assert mod.sparsity == "bitmask"
            assert mod.nnz == mod.shape[0] * mod.shape[1] // 2


def test_per_module_overrides_and_skips():
    base, ft = base_model("llama"), finetune("llama", 1)
    cfg = DeltaZipConfig(bits=2, overrides={"*.mlp.down_proj": {"bits": 8}}, skip_modules=["*.layers.1.self_attn.*"], **CFG)
    delta = compress(base, ft, cfg, calibration=calibration_ids(), progress=False)
    assert delta.modules["model.layers.0.mlp.down_proj"].bits == 8
    assert delta.modules["model.layers.0.mlp.up_proj"].bits == 2
    assert "model.layers.1.self_attn.q_proj" not in delta.modules
    assert torch.equal(delta.params["model.layers.1.self_attn.q_proj.weight"], ft.model.layers[1].self_attn.q_proj.weight)


def test_added_tokens_are_compressed_rows():
    base, ft = base_model("llama"), finetune("llama", 3, added_tokens=5)
    delta = compress(base, ft, DeltaZipConfig(bits=4, **CFG), calibration=calibration_ids(), progress=False)
    emb = delta.modules["model.embed_tokens"]
    assert emb.kind == "embedding" and emb.shape[0] == VOCAB + 5
    assert delta.header["extra"]["vocab_size_base"] == VOCAB
    assert delta.header["extra"]["vocab_size_finetune"] == VOCAB + 5


def test_compression_is_deterministic(tmp_path):
    base, ft = base_model("phi3"), finetune("phi3", 1)
    for i in range(2):
        compress(base, ft, DeltaZipConfig(bits=3, **CFG), calibration=calibration_ids(), progress=False).save_pretrained(tmp_path / str(i))
    assert (tmp_path / "0" / DZ_FILENAME).read_bytes() == (tmp_path / "1" / DZ_FILENAME).read_bytes()


def test_calibration_from_texts_chat_records_and_files(tmp_path):
    from hf_deltazip.compression.calibration import prepare_calibration
    from hf_deltazip.bench.pairs import build_tokenizer

    tok = build_tokenizer(save_dir=tmp_path / "tok", vocab_size=300)
    texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 20]
    ids = prepare_calibration(texts, tok, n_samples=4, seq_len=16)
    assert ids.shape == (4, 16) and ids.dtype == torch.long
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi " * 30}]},
        {"text": "plain text " * 30},
    ]))
    from_file = prepare_calibration(jsonl, tok, n_samples=3, seq_len=8)
    assert from_file.shape[1] == 8 and 1 <= from_file.shape[0] <= 3
    whole = prepare_calibration(jsonl, tok, seq_len=100_000)  # shorter than one window: the whole stream
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi " * 30}], tokenize=False
    )
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert whole.shape[0] == 1 and whole[0, : len(chat_ids)].tolist() == chat_ids
    txt = tmp_path / "calib.txt"
    txt.write_text("x = 1\n" * 100)
    assert prepare_calibration(txt, tok, n_samples=2, seq_len=8).shape == (2, 8)
    with pytest.raises(DeltaZipError, match="not found"):
        prepare_calibration(tmp_path / "missing.jsonl", tok)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DeltaZipError, match="line 2"):
        prepare_calibration(tmp_path / "bad.jsonl", tok)
    with pytest.raises(DeltaZipError, match="need a tokenizer"):
        prepare_calibration(["text"], None)


def test_incompatible_models_are_rejected():
    with pytest.raises(DeltaZipError, match="different architectures"):
        compress(base_model("llama"), finetune("qwen2", 1), calibration=None, progress=False)
    from hf_deltazip.bench.pairs import tiny_model

    wider = tiny_model("llama", vocab_size=VOCAB, hidden_size=96, num_layers=2)
    with pytest.raises(DeltaZipError, match="shape mismatch"):
        compress(base_model("llama"), wider, calibration=None, progress=False)
    deeper = tiny_model("llama", vocab_size=VOCAB, hidden_size=64, num_layers=3)
    with pytest.raises(DeltaZipError, match="different parameters"):
        compress(base_model("llama"), deeper, calibration=None, progress=False)
    with pytest.raises(DeltaZipError, match="outside the fine-tune's vocabulary"):
        compress(base_model("llama"), finetune("llama", 1), calibration=calibration_ids(vocab=VOCAB * 3), progress=False)


def test_unsupported_models_are_rejected():
    class NoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 1, 3)

    from hf_deltazip.modeling.arch import find_decoder_layers

    with pytest.raises(UnsupportedModelError, match="found no decoder layers"):
        find_decoder_layers(NoLayers())


def test_a_local_base_is_recorded_where_it_will_still_be_found(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    models = tmp_path / "work" / "models"
    base_model("llama").save_pretrained(models / "base")
    finetune("llama", 1).save_pretrained(models / "ft")
    monkeypatch.chdir(tmp_path / "work")
    by_path = compress("models/base", "models/ft", DeltaZipConfig(bits=4, group_size=32), calibration=None, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained("models/base")  # a model loaded from a relative path
    by_model = compress(loaded, "models/ft", DeltaZipConfig(bits=4, group_size=32), calibration=None, progress=False)
    for delta in (by_path, by_model):
        assert delta.header["base_model"] == str((models / "base").resolve())
        assert delta.header["base_source"] == "local"
        assert delta.header["finetuned_model"] == str((models / "ft").resolve())
    by_path.save_pretrained(tmp_path / "delta")

    monkeypatch.chdir(tmp_path)  # loaded from elsewhere, the recorded base is still found
    with DeltaZipFile(tmp_path / "delta" / DZ_FILENAME) as dz:
        header = dz.header
    assert resolve_recorded_base(header) == str((models / "base").resolve())

    (models / "base").rename(models / "moved")
    start = time.perf_counter()
    with pytest.raises(BaseMismatchError) as err:
        resolve_recorded_base(header)
    assert time.perf_counter() - start < 1  # at once: no Hub lookup of a missing folder
    assert str((models / "base").resolve()) in str(err.value) and "pass base=" in str(err.value)


@pytest.mark.parametrize("header, expected", [
    ({"base_model": "org/base", "base_source": "hub", "base_revision": None}, "org/base"),
    ({"base_model": "org/base", "base_revision": None}, "org/base"),  # written before base_source
    ({"base_model": "./models/base", "base_revision": None}, "is not there"),
    ({"base_model": "models/base/v1", "base_revision": None}, "is not there"),
    ({"base_model": "/no/such/base", "base_revision": None}, "is not there"),
    ({"base_model": "org/base", "base_source": "local", "base_revision": None}, "is not there"),
    ({"base_model": None}, "records no base model"),
])
def test_resolve_recorded_base(header, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "/" in expected:
        assert resolve_recorded_base(header) == expected
    else:
        with pytest.raises(BaseMismatchError, match=expected):
            resolve_recorded_base(header)
    (tmp_path / "models" / "base").mkdir(parents=True)  # an old relative record that resolves here
    assert resolve_recorded_base({"base_model": "models/base"}) == str(tmp_path / "models" / "base")


def test_cli_compress_never_overwrites(tmp_path, capsys):
    from hf_deltazip.cli import main

    base_dir, ft_dir = tmp_path / "base", tmp_path / "ft"
    base_model("llama").save_pretrained(base_dir)
    finetune("llama", 1).save_pretrained(ft_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["compress", "--base", str(base_dir), "--finetuned", str(ft_dir), "--out", str(out), "--bits", "4",
            "--group-size", "32"]
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    fresh = tmp_path / "fresh"
    assert main(args[:6] + [str(fresh)] + args[7:]) == 0
    printed = capsys.readouterr().out
    assert "ratio" in printed and (fresh / DZ_FILENAME).is_file()


def test_compress_runs_named_steps_and_reports_every_layer():
    from hf_deltazip.compression import COMPRESSION_STEPS, LayerReport

    steps, layers = [], []
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    delta = compress(base_model("llama"), finetune("llama", 1), cfg, calibration=calibration_ids(n=4, length=16),
                     progress=False, on_layer=layers.append, on_step=lambda name, s: steps.append((name, s)))
    assert [name for name, _ in steps] == list(COMPRESSION_STEPS)
    assert all(s >= 0 for _, s in steps)
    assert [r.index for r in layers] == [0, 1] and all(isinstance(r, LayerReport) for r in layers)
    assert layers[0].name == "model.layers.0" and layers[0].num_layers == 2
    for r in layers:
        assert r.seconds >= r.hessian_seconds + r.solver_seconds - 1e-6
        # every linear module of the layer was compressed, and its error is the one in the summary
        assert sorted(r.relative_errors) == sorted(n for n in delta.modules if n.startswith(r.name + "."))
        for name, err in r.relative_errors.items():
            assert delta.summary["relative_error"][name] == err
    assert list(delta.summary["steps"]) == list(COMPRESSION_STEPS)
    assert [row["index"] for row in delta.summary["layers"]] == [0, 1]


@pytest.mark.parametrize("calibration, message", [
    ([], "calibration data is empty"),
    (torch.empty(0, 16, dtype=torch.long), r"no tokens \(token ids of shape \(0, 16\)\)"),
    (torch.empty(4, 0, dtype=torch.long), r"no tokens \(token ids of shape \(4, 0\)\)"),
    (torch.tensor([], dtype=torch.long), "no tokens"),
    (torch.rand(4, 16) * 90, "must be an integer tensor, got torch.float32"),
])
def test_unusable_calibration_data_is_refused_with_the_reason(calibration, message):
    cfg = DeltaZipConfig(bits=4, group_size=-1, n_samples=4, seq_len=16)
    with pytest.raises(DeltaZipError, match=message):
        compress(base_model("llama"), finetune("llama", 1), cfg, calibration=calibration, progress=False)
    with pytest.raises(DeltaZipError, match="batch_size must be a positive int"):
        compress(base_model("llama"), finetune("llama", 1), cfg, calibration=calibration_ids(), batch_size=0,
                 progress=False)
