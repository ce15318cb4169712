"""Deltas over a bitsandbytes base (4-bit nf4 / fp4 with double quantization, 8-bit), on the CPU.

The reference is the same base dequantized into plain ``nn.Linear`` layers, carrying the same deltas:
each row of a mixed batch must come out as the dequantized base plus its delta. bitsandbytes' CPU
4-bit kernel for AVX512-BF16 machines computes in bfloat16 even for float32 inputs, so the tests turn it
off (``support_avx512bf16_for_cpu = False``, a public attribute) to compare float32 with float32.
"""

import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install hf-deltazip[test])")

from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from hf_deltazip import BaseMismatchError, CompressedDelta, DeltaModel, DeltaZipConfig, DeltaZipError, compress  # noqa: E402
from hf_deltazip.fingerprint import base_fingerprint, check_fingerprint  # noqa: E402
from hf_deltazip.modeling.quantized import dequantize_model, is_quantized_model  # noqa: E402

from model_factory import base_model, calibration_ids, finetune  # noqa: E402

QUANT = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}
ROWS = ["a", None, "b", "a"]
# LLM.int8 also rounds the activations to int8 (from float16): 8-bit cannot match a float matmul to 1e-4
ATOL = {"nf4-double": 2e-4, "fp4": 2e-4, "int8": 3e-2}
# transformers places a bitsandbytes model on the GPU when one exists: these tests compare on the CPU
CPU = {"": "cpu"}


def qconfig(kind):
    return BitsAndBytesConfig(**QUANT[kind], bnb_4bit_compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qbase")
    base_model("llama").save_pretrained(root / "base")
    base_model("llama", seed=5).save_pretrained(root / "other")
    settings = {"a": dict(bits=4, group_size=32), "b": dict(bits=2, sparsity="2:4", group_size=-1, symmetric=False)}
    for i, (name, s) in enumerate(settings.items()):
        cfg = DeltaZipConfig(n_samples=8, seq_len=24, **s)
        compress(base_model("llama"), finetune("llama", i + 1), cfg, calibration=calibration_ids(),
                 progress=False).save_pretrained(root / name)
    return root


def fp32_kernels(model):
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def quantized_base(folders, kind, where="base"):
    return fp32_kernels(AutoModelForCausalLM.from_pretrained(folders / where, quantization_config=qconfig(kind),
                                                             dtype=torch.float32, device_map=CPU))


def with_deltas(base, folders, **kw):
    model = DeltaModel(base, **kw)
    for name in ("a", "b"):
        model.load_delta(folders / name, delta_name=name)
    return model


def dequantized_reference(folders, kind):
    """The dequantized base with the same deltas. Its weights are the quantized values, not the ones the
    deltas were made against, so the deltas go in without their base fingerprint."""
    model = DeltaModel(dequantize_model(quantized_base(folders, kind)))
    for name in ("a", "b"):
        delta = CompressedDelta.from_pretrained(folders / name, progress=False)
        delta.header = {**dict(delta.header), "base_fingerprint": {}}
        model.add_delta(delta, name)
    return model


def ids():
    return torch.randint(3, 90, (len(ROWS), 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", sorted(QUANT))
def test_mixed_batch_on_a_quantized_base_equals_the_dequantized_base_plus_each_delta(folders, kind):
    model = DeltaModel.from_pretrained(folders / "a", base=folders / "base", delta_name="a",
                                       quantization_config=qconfig(kind), dtype=torch.float32, device_map=CPU)
    fp32_kernels(model)
    model.load_delta(folders / "b", delta_name="b")
    assert is_quantized_model(model.base_model)
    ref = dequantized_reference(folders, kind)
    assert not is_quantized_model(ref.base_model)
    x = ids()
    with torch.no_grad():
        got = model(input_ids=x, delta_names=ROWS).logits
        want = ref(input_ids=x, delta_names=ROWS).logits
        base_only = ref(input_ids=x, delta_names=[None] * len(ROWS)).logits
    torch.testing.assert_close(got, want, atol=ATOL[kind], rtol=1e-4)
    assert (want[0] - base_only[0]).abs().max() > 10 * ATOL[kind]  # the delta really moved row 0
    with torch.no_grad():  # a base row of a mixed batch is exactly the quantized base alone
        plain = model(input_ids=x[1:2], delta_names=[None]).logits
    torch.testing.assert_close(got[1:2], plain, atol=1e-5, rtol=1e-5)
    if kind == "int8":
        return
    out = model.generate(x, delta_names=ROWS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref_out = ref.generate(x, delta_names=ROWS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref_out)


def test_activation_sparsity_compensates_through_the_dequantized_base_weights(folders):
    """The low-rank compensation of dropped inputs takes its factors from what a 4-bit layer computes with
    (its dequantized weight): the quantized DeltaModel gives the dequantized one's outputs."""
    from hf_deltazip.modeling import activation_sparsity as S

    kind = "nf4-double"
    model = with_deltas(fp32_kernels(quantized_base(folders, kind)), folders)
    ref = dequantized_reference(folders, kind)
    ref.set_delta("a")  # calibrated through delta a
    th = S.calibrate_activation_thresholds(ref, calibration_ids(), 0.4, rank=4)
    assert model.set_activation_sparsity(th) == ref.set_activation_sparsity(th) == len(th.thresholds)
    x = ids()
    with torch.no_grad():
        got = model(input_ids=x, delta_names=ROWS).logits
        want = ref(input_ids=x, delta_names=ROWS).logits
        ref.set_activation_sparsity(th, rank=0)
        uncompensated = ref(input_ids=x, delta_names=ROWS).logits
    torch.testing.assert_close(got, want, atol=ATOL[kind], rtol=1e-4)
    assert (want - uncompensated).abs().max() > 10 * ATOL[kind]  # the compensation changed the outputs


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_merge_and_unload_on_a_quantized_base_gives_the_dequantized_merged_model(folders, kind):
    model = with_deltas(quantized_base(folders, kind), folders)
    x = ids()
    with torch.no_grad():
        want = model(input_ids=x, delta_names=["a"] * len(ROWS)).logits
    with pytest.warns(UserWarning, match="dequantized"):
        merged = model.merge_and_unload("a")
    assert not is_quantized_model(merged)
    assert getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, want, atol=ATOL[kind], rtol=1e-4)
        # the quantized model and its other delta are untouched
        torch.testing.assert_close(model(input_ids=x, delta_names=["a"] * len(ROWS)).logits, want)
    with pytest.warns(UserWarning, match="dequantized"):
        inplace = model.merge_and_unload("b", inplace=True)
    assert inplace is model.base_model and not is_quantized_model(inplace) and model.deltas == []


def test_fingerprint_of_a_quantized_base_accepts_its_base_and_refuses_another(folders):
    record = base_fingerprint(base_model("llama"))
    for kind in ("nf4-double", "fp4", "int8"):
        q = AutoModelForCausalLM.from_pretrained(folders / "base", quantization_config=qconfig(kind), dtype=torch.float32,
                                                 device_map=CPU)
        check_fingerprint(record, dict(q.named_parameters()))
        other = AutoModelForCausalLM.from_pretrained(folders / "other", quantization_config=qconfig(kind),
                                                     dtype=torch.float32, device_map=CPU)
        # only the quantized weights: the float embeddings would give the other base away on their own
        only_q = {"version": record["version"],
                  "params": {n: r for n, r in record["params"].items() if "layers" in n and "proj" in n}}
        with pytest.raises(BaseMismatchError, match="rounding"):
            check_fingerprint(only_q, dict(other.named_parameters()))
    with pytest.raises(BaseMismatchError):
        DeltaModel.from_pretrained(folders / "a", base=folders / "other", quantization_config=qconfig("nf4-double"),
                                   dtype=torch.float32)


def test_fingerprint_taken_of_a_quantized_model_records_logical_shapes(folders):
    q = quantized_base(folders, "nf4-double")
    fp = base_fingerprint(q)
    entry = fp["params"]["model.layers.0.self_attn.q_proj.weight"]
    assert entry == {"shape": [64, 64], "dtype": "bitsandbytes-4bit"}
    check_fingerprint(fp, dict(q.named_parameters()))


def test_kernel_route_adds_deltas_to_the_quantized_base(folders, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.kernels import kernels_available

    if not kernels_available():
        pytest.skip("triton is not importable here")
    ref = with_deltas(quantized_base(folders, "nf4-double"), folders, use_kernels="never")
    ker = with_deltas(quantized_base(folders, "nf4-double"), folders, use_kernels="always")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ker(input_ids=x, delta_names=ROWS).logits,
                                   ref(input_ids=x, delta_names=ROWS).logits, atol=2e-4, rtol=1e-4)
    assert not ker.graph_safe()  # bitsandbytes layers are not captured: the engine steps them eagerly


def test_warning_free_load(folders):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        quantized_base(folders, "int8")


def test_compress_for_a_quantized_base_absorbs_part_of_its_rounding(folders, tmp_path):
    """A delta made against the 4-bit base's round trip brings the 4-bit base closer to the fine-tune
    than the ordinary delta does; it still loads onto the float checkpoint quantized."""
    qc = qconfig("nf4-double")
    cfg = DeltaZipConfig(n_samples=8, seq_len=24, bits=4, group_size=32)
    made = compress(folders / "base", finetune("llama", 1), cfg, calibration=calibration_ids(), progress=False,
                    base_quantization=qc, dtype=torch.float32)
    assert made.header.extra["base_quantization"] == {"method": "bitsandbytes", "bits": 4, "quant_type": "nf4",
                                                      "double_quant": True}
    assert made.header.base_fingerprint == base_fingerprint(base_model("llama"))
    made.save_pretrained(tmp_path / "q")
    model = DeltaModel(quantized_base(folders, "nf4-double"))
    model.load_delta(folders / "a", delta_name="plain")
    model.load_delta(tmp_path / "q", delta_name="for_q")
    x = ids()
    with torch.no_grad():
        want = finetune("llama", 1)(input_ids=x).logits
        err = {n: (model(input_ids=x, delta_names=[n] * len(ROWS)).logits - want).pow(2).mean().item()
               for n in ("plain", "for_q")}
    assert err["for_q"] < err["plain"]
    with pytest.raises(DeltaZipError, match="load_in_4bit=True or load_in_8bit=True"):
        compress(folders / "base", finetune("llama", 1), cfg, progress=False, base_quantization={"x": 1})


def test_speed_benchmark_runs_on_tiny_shapes_and_checks_its_layer():
    from hf_deltazip.bench.quantized_base import _table, run_speed

    result = run_speed(shape="tiny", deltas=2, rows=2, prompt_len=8, new_tokens=2, engine_steps=4,
                       bases=("bf16", "int8", "nf4"), device="cpu", log=lambda m: None)
    rows = {r["base"]: r for r in result["rows_table"]}
    assert set(rows) == {"bf16", "int8", "nf4"}
    assert rows["bf16"]["check_rel_err"] < 1e-2 and rows["nf4"]["check_rel_err"] < 1e-2
    assert rows["int8"]["check_rel_err"] < 5e-2  # LLM.int8 rounds the activations too
    assert rows["nf4"]["base_gib"] < rows["int8"]["base_gib"] < rows["bf16"]["base_gib"]
    assert all(r["engine_tokens_per_s"] > 0 for r in rows.values())
    assert "| nf4 |" in _table(result)


def test_quality_benchmark_scores_the_three_cases(folders):
    from hf_deltazip.bench.quantized_base import run_quality

    finetune("llama", 1).save_pretrained(folders / "ft1")
    texts = calibration_ids(n=4, length=24, seed=7).tolist()
    result = run_quality(str(folders / "base"), str(folders / "ft1"), texts, calibration=calibration_ids(),
                         bits=4, group_size=32, device="cpu", log=lambda m: None)
    cases = [r["case"] for r in result["rows"]]
    assert cases == ["bf16 base + delta", "nf4 base alone", "nf4 base + delta", "nf4 base + delta for nf4"]
    assert result["rows"][0]["of_bf16"] == pytest.approx(1.0)
    assert all(r["nll"] > 0 for r in result["rows"])


def test_decode_engine_on_a_quantized_base_decodes_what_generate_does(folders):
    from hf_deltazip.serving import DecodeEngine

    model = with_deltas(quantized_base(folders, "nf4-double"), folders)
    x = ids()
    want = model.generate(x, delta_names=ROWS, max_new_tokens=5, do_sample=False, pad_token_id=0)[:, x.shape[1]:]
    engine = DecodeEngine(model, max_batch_size=len(ROWS), max_length=32)
    done = engine.run([row.tolist() for row in x], ROWS, max_new_tokens=5)
    assert [list(t) for t in done] == want.tolist()


def test_cli_compress_for_a_quantized_base(folders, tmp_path):
    from hf_deltazip.cli import main
    from hf_deltazip.format import DZ_FILENAME, DeltaHeader, DeltaZipFile

    finetune("llama", 1).save_pretrained(tmp_path / "ft")
    out = tmp_path / "delta"
    assert main(["compress", "--base", str(folders / "base"), "--finetuned", str(tmp_path / "ft"), "--out", str(out),
                 "--bits", "4", "--group-size", "32", "--base-quantization", "fp4", "--dtype", "float32"]) == 0
    with DeltaZipFile(out / DZ_FILENAME) as dz:
        header = dz.header
    assert isinstance(header, DeltaHeader)
    assert header.extra["base_quantization"] == {"method": "bitsandbytes", "bits": 4, "quant_type": "fp4",
                                                 "double_quant": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_gpu_kernel_route_over_a_quantized_base_matches_the_reference_route(folders, kind):
    def on_gpu(use_kernels):
        base = AutoModelForCausalLM.from_pretrained(folders / "base", quantization_config=qconfig(kind),
                                                    dtype=torch.float32, device_map={"": 0})
        return with_deltas(base, folders, use_kernels=use_kernels)

    ker, ref = on_gpu("auto"), on_gpu("never")
    assert ker.uses_kernels()
    x = ids().cuda()
    with torch.no_grad():
        torch.testing.assert_close(ker(input_ids=x, delta_names=ROWS).logits, ref(input_ids=x, delta_names=ROWS).logits,
                                   atol=ATOL[kind], rtol=1e-3)
