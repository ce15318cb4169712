"""The byte budget (``target_ratio``), embeddings stored as changed rows, the LM head through the solver."""

import copy
import itertools

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.bench.pairs import tiny_model
from hf_deltazip.compression.budget import Candidate, Option, allocate
from hf_deltazip.compression.solver import rtn_compress
from hf_deltazip.config import read_config_json
from hf_deltazip.delta import CompressedDelta
from hf_deltazip.errors import DeltaZipConfigError
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile
from hf_deltazip.format.folder import delta_bytes_report

from model_factory import VOCAB, _finetune_steps, base_model, calibration_ids, finetune, merged_by_hand

# a small candidate set keeps each budgeted compression to seconds; 2:4 and unstructured are both in it
BUDGET = dict(budget_bits=[2, 4], budget_sparsity=[None, "2:4", 0.75], budget_group_sizes=[128],
              n_samples=8, seq_len=24)
LAYOUT = {None: ("dense", "rows"), "2:4": ("2:4",), 0.75: ("bitmask",)}


def _pair(hidden=128):
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=hidden, num_layers=2)
    ft = _finetune_steps(tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=hidden, num_layers=2), 1)
    return base, ft


@pytest.fixture(scope="module")
def pair():
    return _pair()


@pytest.fixture(scope="module")
def budgeted(pair, tmp_path_factory):
    """Deltas compressed for target ratios 4 and 5.5, saved."""
    out = {}
    for ratio in (4, 5.5):
        delta = compress(*pair, DeltaZipConfig(target_ratio=ratio, **BUDGET), calibration=calibration_ids(), progress=False)
        folder = tmp_path_factory.mktemp(f"r{int(ratio)}")
        delta.save_pretrained(folder)
        out[ratio] = (delta, folder)
    return out


@pytest.mark.parametrize("ratio", [4, 5.5])
def test_target_ratio_lands_within_5_percent_of_the_saved_folder(ratio, budgeted):
    delta, folder = budgeted[ratio]
    report = delta_bytes_report(folder)
    assert abs(report["ratio"] / ratio - 1) <= 0.05, report["ratio"]
    # the report object and the saved folder agree on what was reached
    assert delta.summary["target_ratio"] == ratio
    assert delta.summary["reached_ratio"] == pytest.approx(report["ratio"], rel=1e-12)
    assert report["budget"] == {"target_ratio": ratio}
    # the choice is recorded per module as overrides, and they say what the .dz holds
    saved = read_config_json(folder)
    assert saved["target_ratio"] == ratio
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        records = dz.modules
    assert set(records) <= set(saved["overrides"])
    for name, rec in records.items():
        choice = saved["overrides"][name]
        assert (rec.bits, rec.group_size) == (choice["bits"], choice["group_size"]), name
        assert rec.sparsity in LAYOUT[choice["sparsity"]], (name, rec.sparsity, choice)
    # GPU-resident bytes are reported beside file bytes: a bitmask layout is expanded on the device
    for m in report["modules"]:
        if m["sparsity"] in ("dense", "2:4"):
            assert m["resident_bytes"] >= m["bytes"]
    assert report["resident_bytes"] > 0


def test_a_tighter_budget_chooses_smaller_settings(budgeted):
    small, large = budgeted[5.5][0], budgeted[4][0]
    assert sum(m.nbytes for m in small.modules.values()) < sum(m.nbytes for m in large.modules.values())


@pytest.mark.parametrize("use_kernels", ["never", "always"])
def test_budgeted_delta_serves_like_the_merged_model(use_kernels, pair, budgeted, monkeypatch):
    if use_kernels == "always":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    base, _ = pair
    delta, folder = budgeted[5.5]
    merged = merged_by_hand(base, delta)
    model = DeltaModel(copy.deepcopy(base), use_kernels=use_kernels)
    model.load_delta(folder, delta_name="budget")
    ids = calibration_ids(n=2, length=10, seed=5)
    with torch.no_grad():
        got = model(input_ids=ids, delta_names=["budget", "budget"]).logits
        want = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_unreachable_target_is_refused_with_the_reachable_ratio():
    cfg = DeltaZipConfig(target_ratio=1000, budget_bits=[2], budget_sparsity=[0.9], budget_group_sizes=[-1],
                         n_samples=4, seq_len=16)
    with pytest.raises(DeltaZipConfigError, match=r"out of reach.*smallest settings give about"):
        compress(base_model("llama"), finetune("llama", 1), cfg, calibration=calibration_ids(n=4, length=16),
                 progress=False)


@pytest.mark.parametrize("bad", [dict(target_ratio=0.5), dict(target_ratio="16"), dict(target_ratio=float("nan")),
                                 dict(budget_bits=[5]), dict(budget_sparsity=[1.5]), dict(budget_group_sizes=[]),
                                 dict(budget_group_sizes=[100])])
def test_bad_budget_settings_are_refused(bad):
    with pytest.raises(DeltaZipConfigError, match=next(iter(bad)).split("_")[-1]):
        DeltaZipConfig(**bad)


def test_allocate_finds_the_best_choice_within_the_budget():
    gen = torch.Generator().manual_seed(0)
    measured = {}
    for m in range(5):
        sizes = sorted(torch.randint(10, 200, (4,), generator=gen).tolist())
        errors = sorted(torch.rand(4, generator=gen).tolist(), reverse=True)
        measured[f"m{m}"] = [Option(Candidate(b, None, -1), s, e) for b, s, e in zip((2, 3, 4, 8), sizes, errors)]
    for budget in (300, 450, 600):
        chosen = allocate(measured, budget)
        spent = sum(o.nbytes for o in chosen.values())
        assert spent <= budget
        # brute force over every combination: the allocation is optimal or within a few percent of it
        best = min(sum(o.error for o in combo) for combo in itertools.product(*measured.values())
                   if sum(o.nbytes for o in combo) <= budget)
        assert sum(o.error for o in chosen.values()) <= best * 1.05 + 1e-12
    with pytest.raises(DeltaZipConfigError):
        allocate(measured, 5)


def test_unchanged_embedding_rows_cost_nothing_and_old_files_still_read(tmp_path):
    base, ft = base_model("llama"), copy.deepcopy(finetune("llama", 1))
    changed = [3, 17, 40]
    with torch.no_grad():  # the fine-tune touched only three tokens' rows
        emb_b, emb_f = base.get_input_embeddings().weight, ft.get_input_embeddings().weight
        keep = torch.ones(emb_f.shape[0], dtype=torch.bool)
        keep[changed] = False
        emb_f[keep] = emb_b[keep]
    delta = compress(base, ft, DeltaZipConfig(bits=4, group_size=32, embedding_group_size=32), progress=False)
    emb = delta.modules["model.embed_tokens"]
    assert emb.sparsity == "rows" and emb.nnz == len(changed)
    full = rtn_compress(emb_f.detach() - emb_b.detach(), bits=4, group_size=32)
    assert torch.equal(emb.dequantize(), full.dequantize())  # exactly what storing every row would decode to
    assert emb.nbytes < full.nbytes() / 10
    delta.save_pretrained(tmp_path / "rows")
    again = CompressedDelta.from_pretrained(tmp_path / "rows")
    assert torch.equal(again.modules["model.embed_tokens"].dequantize(), emb.dequantize())
    assert torch.equal(emb.to_dense_layout().dequantize(), emb.dequantize())
    with DeltaZipFile(tmp_path / "rows" / DZ_FILENAME) as dz:
        assert dz.format_version == 2
    # a delta without the rows layout is written as version 1, which older readers know
    dense = compress(base, finetune("llama", 1), DeltaZipConfig(bits=4, group_size=32, embedding_group_size=32), progress=False)
    dense.save_pretrained(tmp_path / "dense")
    with DeltaZipFile(tmp_path / "dense" / DZ_FILENAME) as dz:
        assert dz.format_version == 1
        assert all(rec.sparsity != "rows" for rec in dz.modules.values())


def test_the_lm_head_is_solved_on_its_real_inputs():
    base, ft = base_model("llama"), finetune("llama", 1)
    assert not ft.config.tie_word_embeddings
    ids = calibration_ids(n=8, length=24)
    cfg = DeltaZipConfig(embedding_bits=2, embedding_group_size=-1, n_samples=8, seq_len=24)
    delta = compress(base, ft, cfg, calibration=ids, progress=False)
    head = delta.modules["lm_head"]
    with torch.no_grad():
        x = ft(input_ids=ids, output_hidden_states=True).hidden_states[-1].reshape(-1, ft.config.hidden_size)
    d = ft.lm_head.weight.detach() - base.lm_head.weight.detach()
    rtn = rtn_compress(d, bits=2, group_size=-1).dequantize()
    err_obs = (x @ (head.dequantize() - d).t()).pow(2).sum()
    err_rtn = (x @ (rtn - d).t()).pow(2).sum()
    assert err_obs < 0.8 * err_rtn, (float(err_obs), float(err_rtn))


def test_the_recorded_choice_reproduces_the_delta(pair, budgeted):
    delta, folder = budgeted[4]
    saved = DeltaZipConfig.from_pretrained(folder)
    fixed = DeltaZipConfig.from_dict({**saved.to_dict(), "target_ratio": None})  # the overrides alone
    again = compress(*pair, fixed, calibration=calibration_ids(), progress=False)
    assert set(again.modules) == set(delta.modules)
    for name, mod in delta.modules.items():
        assert torch.equal(again.modules[name].dequantize(), mod.dequantize()), name


def test_measurements_shared_across_target_ratios_give_the_same_deltas(pair, budgeted):
    """A BudgetMeasurements filled by one call is reused by the next (no second measuring pass), and the
    deltas equal those of independent calls; measurements of another pair are refused."""
    from hf_deltazip.compression import BudgetMeasurements

    shared = BudgetMeasurements()
    seconds = {}
    for ratio in (4, 5.5):
        delta = compress(*pair, DeltaZipConfig(target_ratio=ratio, **BUDGET), calibration=calibration_ids(),
                         progress=False, budget_measurements=shared)
        seconds[ratio] = delta.summary["steps"]["budget"]
        alone = budgeted[ratio][0]
        assert delta.config.overrides == alone.config.overrides
        assert delta.summary["reached_ratio"] == pytest.approx(alone.summary["reached_ratio"], rel=1e-12)
        for name, p in alone.modules.items():
            for role, t in p.tensors().items():
                assert torch.equal(delta.modules[name].tensors()[role], t), (ratio, name, role)
    assert len(shared) > 0
    assert seconds[5.5] < seconds[4] / 3  # the second call only allocates
    other = _pair(hidden=64)
    with pytest.raises(DeltaZipConfigError, match="budget_measurements were made with other base, finetuned"):
        compress(*other, DeltaZipConfig(target_ratio=4, **BUDGET), calibration=calibration_ids(), progress=False,
                 budget_measurements=shared)
