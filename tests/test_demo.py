from pathlib import Path

import pytest
import torch

from hf_deltazip import DeltaModel
from hf_deltazip.bench.metrics import mean_token_nll
from hf_deltazip.bench.pairs import load_pair
from hf_deltazip.bench.demo import run_demo


def test_demo_runs_end_to_end_and_reports_what_it_measured(tmp_path):
    lines = []
    out = run_demo(Path(tmp_path), log=lines.append, base_steps=20, ft_steps=20)
    assert set(out["results"]) == {"reverse", "sort"}
    for task, r in out["results"].items():
        # the sizes and the ratio, from the files on disk
        pair = load_pair(tmp_path / f"pair-{task}")
        folder = tmp_path / f"delta-{task}"
        on_disk = (folder / "delta.dz").stat().st_size + (folder / "deltazip_config.json").stat().st_size
        finetuned = pair.load_finetuned()
        n_params = sum(p.numel() for p in finetuned.parameters())
        assert r["bytes"] == on_disk and r["fp16_bytes"] == 2 * n_params
        assert r["ratio"] == pytest.approx(2 * n_params / on_disk) and r["ratio"] > 1

        # the NLLs, measured again: the compressed model as a plain merged model
        tok = pair.load_tokenizer()
        model = DeltaModel(pair.load_base())
        model.load_delta(folder, delta_name=task)
        with torch.no_grad():
            nll_b = mean_token_nll(pair.load_base(), tok, pair.eval_texts)
            nll_f = mean_token_nll(finetuned, tok, pair.eval_texts)
            nll_c = mean_token_nll(model.merge_and_unload(task), tok, pair.eval_texts)
        assert r["nll_base"] == pytest.approx(nll_b, rel=1e-4)
        assert r["nll_finetune"] == pytest.approx(nll_f, rel=1e-4)
        assert r["nll_compressed"] == pytest.approx(nll_c, rel=1e-3)
        assert nll_f < nll_b  # even 20 steps of fine-tuning move the task NLL
        assert r["gain_kept_nll"] == pytest.approx((nll_b - nll_c) / (nll_b - nll_f), rel=1e-2, abs=1e-3)
        assert r["gain_kept_nll"] > 0.9, (task, r)  # 4- and 3-bit deltas keep most of the gain (0.98 measured)
        em_b, em_f, em_c = r["exact_match_base"], r["exact_match_finetune"], r["exact_match_compressed"]
        assert em_b == pair.info["scores"]["base"]["exact_match"]
        assert em_f == pair.info["scores"]["finetuned"]["exact_match"]
        if em_f == em_b:
            assert r["gain_kept"] is None
        else:
            assert r["gain_kept"] == pytest.approx((em_c - em_b) / (em_f - em_b))
    assert [g["delta"] for g in out["generations"]] == ["reverse", "sort", None]
    text = "\n".join(lines)
    assert "one generate() call" in text and "ratio" in text
    for task, r in out["results"].items():
        assert f"{r['ratio']:>5.1f}x" in text and f"{r['nll_compressed']:.2f}" in text
