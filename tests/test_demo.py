from pathlib import Path

from hf_deltazip.demo import run_demo


def test_demo_runs_end_to_end_and_reports_what_it_measured(tmp_path):
    lines = []
    out = run_demo(Path(tmp_path), log=lines.append, base_steps=20, ft_steps=20)
    assert set(out["results"]) == {"reverse", "sort"}
    for r in out["results"].values():
        assert r["ratio"] == r["fp16_bytes"] / r["bytes"] and r["ratio"] > 1
        assert r["nll_finetune"] < r["nll_base"]  # even 20 steps of fine-tuning move the task NLL
    assert [g["delta"] for g in out["generations"]] == ["reverse", "sort", None]
    text = "\n".join(lines)
    assert "one generate() call" in text and "ratio" in text
