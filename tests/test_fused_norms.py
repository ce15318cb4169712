"""RMSNorm in one launch (kernels/rms_norm.py, serving/norms.py): the kernel against transformers' formula under
the Triton interpreter (float32 / float16) and on a GPU (bfloat16), the module switch, and the engine with it."""

import copy

import pytest
import torch

from hf_deltazip.kernels.rms_norm import rms_norm, rms_norm_reference
from hf_deltazip.serving import DecodeEngine, use_fused_norms

from model_factory import base_model, calibration_ids
from test_kernels import interpret  # noqa: F401 - the shared fixture

pytest.importorskip("triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (2, 3, 100), (5, 256)])
def test_kernel_matches_the_reference_under_the_interpreter(interpret, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype)
    got, want = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:  # float32 sums of squares in another order: a few units in the last place apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the sum of squares in another order: at most the last bit of a float16 value apart, mostly equal
        ulp = torch.finfo(dtype).eps * want.abs().float().clamp(min=torch.finfo(dtype).tiny)
        assert ((got.float() - want.float()).abs() <= 2 * ulp + 1e-7).all()
        assert (got == want).float().mean() > 0.9


def test_kernel_takes_strided_rows_and_promotes_like_the_module(interpret):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2 * 48, generator=g)[:, ::2]  # rows of 48 with a stride of 2
    w32 = torch.rand(48, generator=g) + 0.5
    # float32 sums of 48 squares in another order: a few units in the last place apart
    torch.testing.assert_close(rms_norm(x, w32, 1e-5), rms_norm_reference(x, w32, 1e-5), rtol=1e-5, atol=1e-6)
    h = torch.randn(3, 48, generator=g).half()
    out = rms_norm(h, w32, 1e-5)  # a float32 weight on float16 inputs gives float32, as transformers' formula
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_reference(h, w32, 1e-5), rtol=2e-3, atol=1e-6)  # float16 rounding
    assert rms_norm(torch.empty(0, 48), w32, 1e-5).shape == (0, 48)


def test_kernel_refuses_a_weight_that_does_not_fit():
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)


def test_outside_the_interpreter_on_a_cpu_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(3, 16), torch.rand(16)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def with_norm_weights(model, seed=0):
    """A copy of ``model`` whose norm weights are not all one (a fused norm that dropped them would pass)."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
    return model


def test_use_fused_norms_switches_llama_style_norms_only_and_back(interpret):
    model = with_norm_weights(base_model("llama"))
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    ids = calibration_ids(n=2, length=9)
    with torch.no_grad():
        want = model(ids).logits
    assert use_fused_norms(model) == len(norms) == 2 * model.config.num_hidden_layers + 1
    assert all("forward" in m.__dict__ for m in norms)
    calls = []
    import hf_deltazip.serving.norms as N

    real = N.rms_norm
    try:
        N.rms_norm = lambda *a: calls.append(1) or real(*a)
        with torch.no_grad():
            got = model(ids).logits
    finally:
        N.rms_norm = real
    assert len(calls) == len(norms)  # every norm ran the kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # under autograd the module's own forward runs
        model(ids).logits.sum().backward()
    assert norms[0].weight.grad is not None
    assert use_fused_norms(model) == len(norms)  # switched already: counted, not wrapped twice
    assert use_fused_norms(model, enable=False) == len(norms)
    assert not any("forward" in m.__dict__ for m in norms)
    assert use_fused_norms(copy.deepcopy(base_model("gpt2"))) == 0  # LayerNorm


def test_a_norm_with_another_formula_is_left_alone():
    class OddRMSNorm(torch.nn.Module):  # Gemma-style: the weight is added to one
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return rms_norm_reference(x, 1 + self.weight, self.variance_epsilon)

    model = torch.nn.Sequential(OddRMSNorm())
    assert use_fused_norms(model) == 0 and "forward" not in model[0].__dict__


def test_engine_with_fused_norms_answers_as_without(interpret):
    model = with_norm_weights(base_model("llama"), seed=1)
    ps = [calibration_ids(n=1, length=3 + i, seed=20 + i)[0].tolist() for i in range(4)]
    want = DecodeEngine(copy.deepcopy(model), max_batch_size=2, max_length=24).run(ps, max_new_tokens=5)
    fused = copy.deepcopy(model)
    engine = DecodeEngine(fused, max_batch_size=2, max_length=24, fused_norms=True)
    assert engine.fused_norms == 2 * model.config.num_hidden_layers + 1
    assert engine.run(ps, max_new_tokens=5) == want
    assert DecodeEngine(copy.deepcopy(model), max_batch_size=2, max_length=24).fused_norms == 0  # off by default


@cuda
def test_kernel_on_the_gpu_in_bfloat16_and_in_a_captured_engine():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4096, generator=g).to("cuda", torch.bfloat16)
    w = (1 + torch.randn(4096, generator=g) / 4).to("cuda", torch.bfloat16)
    got, want = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().float()
    assert ((got.float() - want.float()).abs() <= 2 * ulp + 1e-30).all() and (got == want).float().mean() > 0.99
    model = with_norm_weights(base_model("llama"), seed=2).to("cuda")  # float32: tokens comparable
    ps = [calibration_ids(n=1, length=3 + i, seed=30 + i)[0].tolist() for i in range(5)]
    want = DecodeEngine(copy.deepcopy(model), max_batch_size=4, max_length=32, cuda_graphs=False).run(ps, max_new_tokens=6)
    engine = DecodeEngine(copy.deepcopy(model), max_batch_size=4, max_length=32, fused_norms=True)
    assert engine.run(ps, max_new_tokens=6) == want and engine._graphs


def test_norms_a_delta_replaces_run_fused_with_the_deltas_weights(interpret, tmp_path):
    """A fine-tune's own norm weights (DeltaOverride) reach the fused norm: rows of two deltas and the base in one
    batch answer as each alone did before the switch."""
    from hf_deltazip import DeltaModel, DeltaZipConfig, compress

    from model_factory import finetune

    base = with_norm_weights(base_model("llama"), seed=3)
    model = DeltaModel(copy.deepcopy(base))
    for i in (1, 2):
        ft = copy.deepcopy(finetune("llama", i))
        with torch.no_grad():  # a fine-tune whose norms moved away from the base's
            for m in ft.modules():
                if type(m).__name__.endswith("RMSNorm"):
                    m.weight.mul_(1.5)
        cfg = DeltaZipConfig(n_samples=4, seq_len=16, bits=4, group_size=32)
        compress(base, ft, cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(tmp_path / f"d{i}")
        model.load_delta(tmp_path / f"d{i}", delta_name=f"d{i}")
    assert any(type(m).__name__ == "DeltaOverride" for m in model.base_model.modules()), "no norm delta: nothing tested"
    ps = [calibration_ids(n=1, length=4 + i, seed=40 + i)[0].tolist() for i in range(3)]
    names = ["d1", None, "d2"]
    want = DecodeEngine(model, max_batch_size=3, max_length=24).run(ps, names, max_new_tokens=5)
    engine = DecodeEngine(model, max_batch_size=3, max_length=24, fused_norms=True)
    assert engine.fused_norms == 2 * model.base_model.config.num_hidden_layers + 1
    assert engine.run(ps, names, max_new_tokens=5) == want
    use_fused_norms(model.base_model, enable=False)
