"""The budget's Fisher weighting: output-channel Fisher information from one backward pass, and the
weighted errors the allocation compares."""

import copy

import pytest
import torch

from hf_deltazip import DeltaZipConfig, compress
from hf_deltazip.compression import BudgetMeasurements
from hf_deltazip.compression.budget import Candidate, measure_module, weighted_error
from hf_deltazip.compression.pipeline import output_fisher
from hf_deltazip.errors import DeltaZipConfigError

from hf_deltazip.bench.pairs import tiny_model

from model_factory import MATRIX_VOCAB, VOCAB, _finetune_steps, calibration_ids, matrix_model

BUDGET = dict(budget_bits=[2, 4], budget_sparsity=[None, 0.75], budget_group_sizes=[-1], n_samples=4, seq_len=16)


def _ids(n=4, length=16, vocab=MATRIX_VOCAB):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))


def _reference_fisher(model, ids, names, seed=0):
    """The same quantities by another route: outputs kept with retain_grad, labels drawn in one batch."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(False)
    outs = {}
    emb = model.get_input_embeddings()

    def make(name, mod):
        def hook(_m, args, out):
            if mod is emb:
                out.requires_grad_(True)
                outs["emb_rows"] = mod.weight[args[0]]
            out.retain_grad()
            outs[name] = out
        return hook

    handles = [model.get_submodule(n).register_forward_hook(make(n, model.get_submodule(n))) for n in names]
    with torch.enable_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
        labels = torch.multinomial(probs.detach(), 1, generator=torch.Generator().manual_seed(seed)).reshape(-1)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="sum").backward()
    for h in handles:
        h.remove()
    n = labels.numel()
    ref = {}
    for name in names:
        g = outs[name].grad.float().reshape(-1, outs[name].shape[-1])
        ref[name] = g.pow(2).sum(0) / n
    return ref, probs.detach(), labels, outs


def test_output_fisher_matches_a_direct_computation():
    """Per output channel: the mean squared gradient of the log-likelihood under labels drawn from the model;
    for the LM head that is (softmax - one-hot)^2 exactly; for a scaled embedding (Gemma) the gradient
    reaching a looked-up row, i.e. the output's times the scale."""
    model = matrix_model("gemma3_text")
    ids = _ids()
    names = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    got = output_fisher(model, ids, names, device="cpu", batch_size=len(ids), seed=0)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before  # left as it was
    ref, probs, labels, outs = _reference_fisher(model, ids, names)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1]).float()
    torch.testing.assert_close(got["lm_head"], (probs - onehot).pow(2).mean(0), rtol=1e-4, atol=1e-9)
    for name in names[1:3]:
        assert got[name].shape == (outs[name].shape[-1],)
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-12)
    scale = float(model.model.embed_tokens.embed_scale)  # Gemma multiplies the looked-up rows by sqrt(hidden)
    assert scale != 1.0
    torch.testing.assert_close(got["model.embed_tokens"], ref["model.embed_tokens"] * scale**2, rtol=1e-4, atol=1e-12)
    assert all(bool((v >= 0).all()) and float(v.sum()) > 0 for v in got.values())
    # batches and seeds: the same labels drawn in batches of 1 give the same head Fisher only for the same stream
    again = output_fisher(model, ids, names, device="cpu", batch_size=len(ids), seed=0)
    for name in names:
        assert torch.equal(again[name], got[name])


def test_weighted_error_on_known_inputs():
    delta = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    approx = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # errors: [1, 0], [0, 1], [0, 1]
    h = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    assert weighted_error(delta, approx, hessian=h) == pytest.approx(2 + 3 + 3)
    assert weighted_error(delta, approx, hessian=h, row_weights=torch.tensor([1.0, 0.5, 0.0])) == pytest.approx(2 + 1.5)
    assert weighted_error(delta, approx) == pytest.approx(3)
    assert weighted_error(delta, approx, row_weights=torch.tensor([2.0, 1.0, 1.0]),
                          col_weights=torch.tensor([10.0, 1.0])) == pytest.approx(20 + 1 + 1)


def test_measure_module_adds_a_tied_heads_error_to_the_embeddings():
    torch.manual_seed(0)
    delta = torch.randn(32, 8) * 1e-2
    rows, cols = torch.rand(32), torch.rand(8)
    head_h = torch.eye(8) * 3
    head_rows = torch.rand(32)
    cand = [Candidate(2, None, -1)]
    alone = measure_module(delta, candidates=cand, kind="embedding", row_weights=rows, col_weights=cols)[0]
    both = measure_module(delta, candidates=cand, kind="embedding", row_weights=rows, col_weights=cols,
                          head_hessian=head_h, head_row_weights=head_rows)[0]
    assert both.nbytes == alone.nbytes
    from hf_deltazip.compression.solver import rtn_compress

    approx = rtn_compress(delta, bits=2, group_size=-1, symmetric=True, sparsity=None).dequantize()
    e = delta - approx
    expected_head = float(((e @ head_h) * e).sum(1) @ head_rows)
    assert both.error == pytest.approx(alone.error + expected_head, rel=1e-5)


def test_fisher_budget_lands_on_the_target_and_differs_from_the_plain_objective():
    """Both weightings reach the ratio; they are measured separately (a BudgetMeasurements of one is refused
    for the other) and the Fisher one spends the bytes differently."""
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=128, num_layers=2)
    ft = _finetune_steps(tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=128, num_layers=2), 1)
    ids = calibration_ids(n=4, length=16)
    shared = BudgetMeasurements()
    deltas = {}
    for weighting in ("output", "fisher"):
        cfg = DeltaZipConfig(target_ratio=4, budget_weighting=weighting, **BUDGET)
        if weighting == "fisher":  # the measurements of the plain objective are not reused for the Fisher one
            with pytest.raises(DeltaZipConfigError, match="budget_measurements were made with other settings"):
                compress(base, ft, cfg, calibration=ids, progress=False, budget_measurements=shared)
        deltas[weighting] = compress(base, ft, cfg, calibration=ids, progress=False,
                                     budget_measurements=shared if weighting == "output" else None)
        assert abs(deltas[weighting].summary["reached_ratio"] / 4 - 1) <= 0.05
    assert deltas["fisher"].config.overrides != deltas["output"].config.overrides
    with pytest.raises(DeltaZipConfigError, match="budget_weighting must be one of"):
        DeltaZipConfig(budget_weighting="hessian")


def test_a_fisher_pass_that_runs_out_of_memory_falls_back_to_the_plain_objective(monkeypatch, caplog):
    """The budget still lands, says which weighting it used, and the warning names the way out."""
    import hf_deltazip.compression.pipeline as pipeline

    def no_memory(*_a, **_k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=128, num_layers=2)
    ft = _finetune_steps(tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=128, num_layers=2), 1)
    ids = calibration_ids(n=4, length=16)
    plain = compress(base, ft, DeltaZipConfig(target_ratio=4, budget_weighting="output", **BUDGET), calibration=ids,
                     progress=False)
    assert plain.summary["budget_weighting"] == "output"
    fisher = compress(base, ft, DeltaZipConfig(target_ratio=4, **BUDGET), calibration=ids, progress=False)
    assert fisher.summary["budget_weighting"] == "fisher"
    monkeypatch.setattr(pipeline, "output_fisher", no_memory)
    with caplog.at_level("WARNING", logger="hf_deltazip"):
        fell_back = compress(base, ft, DeltaZipConfig(target_ratio=4, **BUDGET), calibration=ids, progress=False)
    assert "ran out of memory" in caplog.text and "budget_weighting='output'" in caplog.text
    assert fell_back.summary["budget_weighting"] == "output"
    assert fell_back.config.overrides == plain.config.overrides  # exactly the plain objective's choice
    assert abs(fell_back.summary["reached_ratio"] / 4 - 1) <= 0.05
