"""The lowrank layout (``sparsity="lowrank:x"``): Delta-CoMe factors stored, codes of their product served."""

import copy

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.compression.lowrank import lowrank_module, mixed_precision_svd
from hf_deltazip.compression.solver import objective, rtn_compress
from hf_deltazip.delta import CompressedDelta, PackedModule
from hf_deltazip.errors import DeltaZipConfigError, DeltaZipFormatError
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile, ModuleRecord, write_dz

from hf_deltazip.bench.pairs import tiny_model

from model_factory import VOCAB, base_model, calibration_ids, finetune, merged_by_hand


def _low_rank_finetune(base, rank=2, seed=3, scale=0.05):
    """A copy of ``base`` whose every decoder linear weight moved by an exact rank-``rank`` delta."""
    ft = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in ft.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                n, k = mod.weight.shape
                u, v = torch.randn(n, rank, generator=gen), torch.randn(rank, k, generator=gen)
                mod.weight.add_(scale * (u @ v) / k ** 0.5)
    return ft


def test_a_module_keeps_its_factors_in_the_file_and_rebuilds_the_served_codes_on_load(tmp_path):
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(96, 3, generator=gen) @ torch.randn(3, 64, generator=gen) * 0.01
    m = lowrank_module(d, 2.0, bits=4, group_size=32)
    assert m.factors is not None and m.sparsity == "dense"  # kernels, merges and references read dense codes
    # of the band layouts tried, the kept one is at least as close as Delta-CoMe's own bands ...
    product = sum(a.dequantize().t() @ b.dequantize() for _, a, b in m.factors)
    ref = mixed_precision_svd(d, int(2.0 * d.numel() / 8)).delta
    assert float((product - d).norm()) <= float((ref - d).norm()) + 1e-6
    # ... and the served delta is exactly that product rounded to the module's own grid
    assert torch.equal(m.dequantize(), rtn_compress(product, bits=4, group_size=32).dequantize())
    assert float((m.dequantize() - d).norm() / d.norm()) < 0.2
    # the file holds the factors only: far fewer bytes than the codes the GPU holds
    rec = m.record("x")
    assert rec.sparsity == "lowrank" and sum(r for r, _ in rec.bands) >= 3
    assert sorted(m.tensors()) == sorted(f"{side}.{role}" for side in "ab" for role in ("qweight", "scales", "zeros"))
    assert m.nbytes < m.resident_nbytes
    write_dz(tmp_path / "a.dz", {rec.tensors[r]: t for r, t in m.tensors().items()}, {"x": rec}, {}, {"base_model": "b"})
    with DeltaZipFile(tmp_path / "a.dz") as dz:
        assert dz.format_version == 3
        back = PackedModule.from_record(dz.modules["x"], {r: dz.get_tensor(t) for r, t in dz.modules["x"].tensors.items()})
    assert torch.equal(back.dequantize(), m.dequantize())
    assert back.record("x").bands == rec.bands
    assert "lowrank" in repr(back) and back.info()["resident_bytes"] == m.resident_nbytes


@pytest.mark.parametrize("use_kernels", ["never", "always"])
def test_a_lowrank_delta_round_trips_and_serves_like_the_merged_model(use_kernels, tmp_path, monkeypatch):
    if use_kernels == "always":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = base_model("llama")
    ft = _low_rank_finetune(base)
    cfg = DeltaZipConfig(sparsity="lowrank:1.0", bits=8, group_size=32, n_samples=8, seq_len=24)
    delta = compress(base, ft, cfg, calibration=calibration_ids(), progress=False)
    linear = [n for n in delta.modules if ".layers." in n]
    assert linear and all(delta.modules[n].factors is not None for n in linear)
    delta.save_pretrained(tmp_path)
    with DeltaZipFile(tmp_path / DZ_FILENAME) as dz:
        assert {dz.modules[n].sparsity for n in linear} == {"lowrank"}
    again = CompressedDelta.from_pretrained(tmp_path)
    for name, mod in delta.modules.items():
        assert torch.equal(again.modules[name].dequantize(), mod.dequantize()), name
    # a rank-2 delta is kept nearly exactly by its top directions, served on an 8-bit grid
    for n in linear:
        d = (ft.get_submodule(n).weight - base.get_submodule(n).weight).detach().float()
        assert float((delta.modules[n].dequantize() - d).norm() / d.norm()) < 0.02, n
    merged = merged_by_hand(base, delta)
    model = DeltaModel(copy.deepcopy(base), use_kernels=use_kernels)
    model.load_delta(tmp_path, delta_name="lr")
    ids = calibration_ids(n=2, length=10, seed=5)
    with torch.no_grad():
        got = model(input_ids=ids, delta_names=["lr", None]).logits
        want = merged(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.merge_and_unload("lr")(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


def test_the_budget_chooses_lowrank_where_the_delta_is_low_rank():
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=256, num_layers=2)  # linears outweigh the rest
    ft = _low_rank_finetune(base)
    common = dict(target_ratio=12, budget_bits=[2, 4], budget_group_sizes=[-1], n_samples=8, seq_len=24)
    plain = compress(base, ft, DeltaZipConfig(budget_sparsity=[None, 0.75, 0.9], **common),
                     calibration=calibration_ids(), progress=False)
    mixed = compress(base, ft, DeltaZipConfig(budget_sparsity=[None, 0.75, 0.9, "lowrank:0.25", "lowrank:0.5"], **common),
                     calibration=calibration_ids(), progress=False)
    chosen = {n: s["sparsity"] for n, s in mixed.config.overrides.items() if ".layers." in n}
    assert sum(str(s).startswith("lowrank:") for s in chosen.values()) >= len(chosen) // 2, chosen
    for name in chosen:
        if str(chosen[name]).startswith("lowrank:"):
            assert mixed.modules[name].factors is not None and mixed.modules[name].bits == 4
    assert abs(mixed.summary["reached_ratio"] / 12 - 1) <= 0.05

    def error(delta):
        total = 0.0
        for n in chosen:
            d = (ft.get_submodule(n).weight - base.get_submodule(n).weight).detach().float()
            total += float((delta.modules[n].dequantize() - d).pow(2).sum() / d.pow(2).sum())
        return total

    assert error(mixed) < 0.1 * error(plain), (error(mixed), error(plain))
    # and only lowrank candidates reach 20x on this model
    with pytest.raises(DeltaZipConfigError, match="out of reach"):
        compress(base, ft, DeltaZipConfig(budget_sparsity=[None, 0.75, 0.9], **{**common, "target_ratio": 20}),
                 calibration=calibration_ids(), progress=False)


def test_lowrank_is_offered_to_linear_layers_and_embeddings():
    from hf_deltazip.compression.budget import candidates

    cfg = DeltaZipConfig(target_ratio=8, budget_bits=[2, 3], budget_sparsity=[None, "2:4", "lowrank:0.5"],
                         budget_group_sizes=[64, -1])
    for kind in ("linear", "embedding"):
        lr = [c for c in candidates(cfg, kind) if c.sparsity == "lowrank:0.5"]
        assert [(c.bits, c.group_size) for c in lr] == [(3, 64)], kind  # served once, at the most precise grid offered
    assert not any(c.sparsity == "2:4" for c in candidates(cfg, "embedding"))  # the lookup reads dense rows


def _vocab_finetune(base, rank=2, seed=4, scale=0.02):
    """A copy of ``base`` whose input embedding (tied to the LM head when the model ties them) moved by an exact
    rank-``rank`` delta, and whose decoder linears moved a little."""
    ft = _low_rank_finetune(base, rank=1, scale=0.01)
    emb = ft.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb.add_(scale * torch.randn(emb.shape[0], rank, generator=gen) @ torch.randn(rank, emb.shape[1], generator=gen))
    return ft


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_lowrank_vocabulary_delta_serves_like_the_merged_model(tied, tmp_path):
    """``lowrank:x`` on the embedding (and an untied LM head) through overrides: the factors are stored, the
    served codes of their product are what DeltaModel adds, as a merge does."""
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=64, num_layers=2, tie_word_embeddings=tied)
    ft = _vocab_finetune(base)
    if not tied:
        with torch.no_grad():
            ft.lm_head.weight.add_(0.02 * torch.randn(VOCAB, 1, generator=torch.Generator().manual_seed(9))
                                   @ torch.randn(1, 64, generator=torch.Generator().manual_seed(8)))
    vocab = {"sparsity": "lowrank:2", "bits": 8, "group_size": -1}
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=8, seq_len=24,
                         overrides={"model.embed_tokens": vocab, "lm_head": vocab})
    delta = compress(base, ft, cfg, calibration=calibration_ids(), progress=False)
    vocab_names = [n for n, m in delta.modules.items() if m.kind == "embedding"]
    assert len(vocab_names) == (1 if tied else 2), vocab_names
    for n in vocab_names:
        m = delta.modules[n]
        assert m.factors is not None and m.nbytes < m.resident_nbytes, n
        d = (ft.get_submodule(n).weight - base.get_submodule(n).weight).detach().float()
        assert float((m.dequantize() - d).norm() / d.norm()) < 0.05, n  # a rank-2 delta on an 8-bit grid
    delta.save_pretrained(tmp_path)
    with DeltaZipFile(tmp_path / DZ_FILENAME) as dz:
        assert dz.format_version == 4  # lowrank embeddings are new in version 4
        assert {dz.modules[n].sparsity for n in vocab_names} == {"lowrank"}
    again = CompressedDelta.from_pretrained(tmp_path)
    for n in vocab_names:
        assert torch.equal(again.modules[n].dequantize(), delta.modules[n].dequantize()), n
    if tied:  # a reader of version 3 did not know lowrank embeddings: a file stamped 3 that has one is refused
        from test_format import edit_dz

        data = (tmp_path / DZ_FILENAME).read_bytes()
        (tmp_path / "v3.dz").write_bytes(edit_dz(data, lambda dz, st: st["__metadata__"].update(dz_format_version="3")))
        with pytest.raises(DeltaZipFormatError, match="format version 3"):
            DeltaZipFile(tmp_path / "v3.dz")
    model = DeltaModel(copy.deepcopy(base))
    model.load_delta(tmp_path, delta_name="v")
    ids = calibration_ids(n=2, length=10, seed=5)
    with torch.no_grad():
        got = model(input_ids=ids, delta_names=["v", None]).logits
        want = merged_by_hand(base, delta)(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], plain[1], rtol=1e-4, atol=1e-4)


def test_the_budget_chooses_lowrank_for_a_low_rank_embedding_delta():
    """At a tight budget the embedding's few-direction delta goes to the lowrank layout, which keeps it far
    closer than quantized rows at the same bytes."""
    base = tiny_model("llama", vocab_size=1024, seed=0, hidden_size=128, num_layers=2)
    ft = _vocab_finetune(base, rank=1, scale=0.05)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # full-rank moves of the linears: lowrank cannot take them cheaply
        for name, mod in ft.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                mod.weight.add_(0.01 * torch.randn(mod.weight.shape, generator=gen))
    common = dict(target_ratio=14, budget_bits=[2, 4], budget_group_sizes=[-1], n_samples=8, seq_len=24)
    delta = compress(base, ft, DeltaZipConfig(budget_sparsity=[None, 0.9, 0.98, "lowrank:0.25"], **common),
                     calibration=calibration_ids(), progress=False)
    name = next(n for n, m in delta.modules.items() if m.kind == "embedding")
    assert str(delta.config.overrides[name]["sparsity"]) == "lowrank:0.25"
    d = (ft.get_submodule(name).weight - base.get_submodule(name).weight).detach().float()
    assert float((delta.modules[name].dequantize() - d).norm() / d.norm()) < 0.1
    assert abs(delta.summary["reached_ratio"] / 14 - 1) <= 0.05


@pytest.mark.parametrize("bad", ["lowrank:0", "lowrank:abc", "lowrank:17", "lowrank", "low-rank:1"])
def test_bad_lowrank_settings_are_refused(bad):
    with pytest.raises(DeltaZipConfigError, match="lowrank:x"):
        DeltaZipConfig(sparsity=bad)


@pytest.mark.parametrize("bands", [[[3, 5]], [[0, 4]], [[40, 4], [40, 2]], "3x4"])
def test_a_file_with_bad_lowrank_bands_is_refused(tmp_path, bands):
    gen = torch.Generator().manual_seed(0)
    m = lowrank_module(torch.randn(64, 48, generator=gen) * 0.01, 2.0, bits=4, group_size=16)
    rec = m.record("x")
    bad = ModuleRecord(**{**rec.__dict__, "bands": bands})
    write_dz(tmp_path / "a.dz", {rec.tensors[r]: t for r, t in m.tensors().items()}, {"x": bad}, {}, {"base_model": "b"})
    with pytest.raises(DeltaZipFormatError, match="bad lowrank bands"):
        DeltaZipFile(tmp_path / "a.dz")


def test_the_objective_of_a_lowrank_option_is_that_of_the_served_codes():
    from hf_deltazip.compression.budget import Candidate, measure_module

    gen = torch.Generator().manual_seed(1)
    d = torch.randn(64, 4, generator=gen) @ torch.randn(4, 48, generator=gen) * 0.01
    x = torch.randn(200, 48, generator=gen)
    h = 2 * x.t() @ x / x.shape[0]
    (opt,) = measure_module(d, candidates=[Candidate(4, "lowrank:1.0", 16)], kind="linear", hessian=h)
    served = lowrank_module(d, 1.0, bits=4, group_size=16)
    assert opt.error == pytest.approx(objective(d, served.dequantize(), h), rel=1e-6)
    assert opt.candidate.settings()["sparsity"] == "lowrank:1.0"
    # an embedding's lowrank option: the plain squared error of the same served codes (no inputs to weigh it)
    (emb,) = measure_module(d, candidates=[Candidate(4, "lowrank:1.0", 16)], kind="embedding")
    assert emb.error == pytest.approx(float((lowrank_module(d, 1.0, bits=4, group_size=16, kind="embedding").dequantize()
                                            - d).pow(2).sum()), rel=1e-6)
    assert emb.layout[0] == "embedding" and emb.layout[2] == "lowrank"


def test_lowrank_on_transposed_conv1d_layers_serves_like_the_merged_model(tmp_path):
    base, ft = base_model("gpt2"), finetune("gpt2", 1)
    delta = compress(base, ft, DeltaZipConfig(sparsity="lowrank:4", bits=8, group_size=-1, n_samples=8, seq_len=24),
                     calibration=calibration_ids(), progress=False)
    conv = [n for n, p in delta.modules.items() if p.transposed]
    assert conv and all(delta.modules[n].factors is not None for n in conv)
    delta.save_pretrained(tmp_path)
    model = DeltaModel(copy.deepcopy(base))
    model.load_delta(tmp_path, delta_name="x")
    ids = calibration_ids(n=2, length=10, seed=5)
    with torch.no_grad():
        got = model(input_ids=ids, delta_names=["x", "x"]).logits
        want = merged_by_hand(base, delta)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
