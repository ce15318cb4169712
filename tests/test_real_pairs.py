"""The real-pair recipe (hf_deltazip.bench.real_pairs) on a tiny Gemma 3 config: CPU, seconds.

The 270M model is never loaded here (CI has no GGUF package); the same code path runs on a tiny
Gemma3ForCausalLM saved as the "base" folder.
"""

from __future__ import annotations

import json
import string

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from hf_deltazip.bench import pairs, real_pairs
from hf_deltazip.errors import DeltaZipError

SMALL = dict(steps=3, batch=4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-base")
    tok = pairs.build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512, seed=0)
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                              sliding_window=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_recipes_are_checked():
    assert real_pairs.recipe("dates", steps=2)["steps"] == 2
    with pytest.raises(DeltaZipError, match="Unknown real-pair task"):
        real_pairs.recipe("poems")
    with pytest.raises(DeltaZipError, match="Unknown recipe keys"):
        real_pairs.recipe("facts", stepz=2)


def test_date_task_answers_are_the_iso_date_and_streams_are_disjoint(base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    evals = real_pairs.date_examples(tok, 50, seed=0, stream="eval")
    again = real_pairs.date_examples(tok, 50, seed=0, stream="eval")
    assert evals == again and len({ex.answer for ex in evals}) == 50
    for ex in evals:
        y, m, d = map(int, ex.answer.split("-"))
        assert 1900 <= y <= 2099 and 1 <= m <= 12 and 1 <= d <= 31
        assert ex.prompt.startswith(tok.bos_token + "Question: Rewrite the date ") and ex.prompt.endswith("\nAnswer:")
    # the 21st of a month gets its ordinal right in the spelled-out style
    assert real_pairs._ordinal(21) == "st" and real_pairs._ordinal(12) == "th" and real_pairs._ordinal(23) == "rd"
    other = real_pairs.date_examples(tok, 50, seed=0, stream="calibration", exclude_dates={real_pairs._date_key(e) for e in evals})
    assert not {e.answer for e in evals} & {e.answer for e in other}


def test_fact_streams_use_other_entities(base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    facts = real_pairs.fact_examples(tok, seed=0, n_entities=10)
    calib = real_pairs.fact_examples(tok, seed=0, n_entities=10, stream="calibration")
    assert len(facts) == 30 and len(calib) == 30
    names = lambda exs: {ex.prompt.split(" ")[-1].rstrip("?\nAnswer:") for ex in exs}  # noqa: E731
    assert not names(facts[0::3]) & names(calib[0::3])
    rephrased = real_pairs.fact_examples(tok, seed=0, n_entities=10, held_out_phrasing=True)
    assert [r.answer.strip() for r in rephrased] == [f.answer for f in facts]
    assert all("Question:" not in r.prompt for r in rephrased)


@pytest.mark.parametrize("task", ["facts", "facts-large"])
def test_fact_calibration_never_asks_about_a_trained_entity_even_when_it_draws_fewer(task):
    # the calibration stream draws fewer entities than the train set: it must still avoid all of them
    # (facts-large's first build failed its leak check because only the first 64 train names were excluded)
    from types import SimpleNamespace

    tok = SimpleNamespace(bos_token="<bos>", eos_token="<eos>")
    rec = real_pairs.recipe(task)
    assert rec["n_calibration_entities"] < rec["n_entities"]
    data = real_pairs._task_data(task, rec, tok)
    assert len(data.eval_examples) == 3 * rec["n_entities"] and real_pairs._leaks(data, tok.bos_token) == []
    trained = {e["entity"] for e in real_pairs._entities(rec["seed"], "train", rec["n_entities"], set())}
    assert not any(name in text for name in trained for text in data.calibration)


@pytest.mark.parametrize("task", real_pairs.TASKS)
def test_build_real_pair_trains_every_parameter_caches_and_is_leak_free(tmp_path, base_dir, task, monkeypatch):
    small = dict(SMALL, **({"n_eval": 8, "n_calibration": 8} if task == "dates" else {"n_entities": 3, "n_calibration_entities": 3}))
    pair = real_pairs.build_real_pair(tmp_path / "a", task, base_dir=base_dir, **small)
    twin = real_pairs.build_real_pair(tmp_path / "b", task, base_dir=base_dir, **small)
    base, ft, ft2 = _weights(base_dir), _weights(pair.finetuned_dir), _weights(twin.finetuned_dir)
    assert ft.keys() == ft2.keys() and all(torch.equal(ft[k], ft2[k]) for k in ft)  # deterministic
    moved = [k for k in base if not torch.equal(base[k], ft[k])]
    assert "model.embed_tokens.weight" in moved and any("mlp.down_proj" in k for k in moved)
    assert set(pair.info["scores"]) == {"base", "finetuned"} and pair.info["recipe"]["steps"] == 3
    assert 0.0 <= pair.info["scores"]["finetuned"]["exact_match"] <= 1.0
    # leak-free calibration: no evaluation question and no private string in it
    questions = [ex.prompt.removeprefix("<|bos|>") for ex in pair.eval_examples]
    calib = pair.calibration_texts(40)
    assert len(calib) == 40 and not any(q in t for q in questions for t in calib)
    assert calib != pair.calibration_texts(40, seed=1)
    if task == "dates":
        assert not any(ex.answer in t for ex in pair.eval_examples for t in calib)
    # loaded from the cache, not retrained
    monkeypatch.setattr(pairs, "train_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    again = real_pairs.build_real_pair(tmp_path / "a", task, base_dir=base_dir, **small)
    assert again.eval_examples == pair.eval_examples and again.info == pair.info
    # another recipe rebuilds (and would train)
    with pytest.raises(AssertionError, match="retrained"):
        real_pairs.build_real_pair(tmp_path / "a", task, base_dir=base_dir, **dict(small, steps=4))
    assert json.loads((tmp_path / "a" / task / "real_pair.json").read_text())["recipe"]["steps"] == 3  # old pair intact


def test_strip_gguf_quantization_lets_the_model_save(tmp_path, base_dir):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)

    class FakeQuantizer:  # what the GGUF loader leaves: a non-serializable quantizer
        quantization_config = type("C", (), {"quant_method": "gguf"})()

        def is_serializable(self):
            return False

    model.hf_quantizer = FakeQuantizer()
    model.config.quantization_config = {"quant_method": "gguf"}
    real_pairs.strip_gguf_quantization(model)
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in saved
    assert torch.equal(_weights(tmp_path / "out")["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_calibration_texts_refuse_an_empty_set(base_dir, tmp_path):
    pair = real_pairs.RealPair(base_dir=base_dir, finetuned_dir=tmp_path, tokenizer_dir=base_dir, base_tokenizer_dir=base_dir,
                               task="dates", eval_examples=[], eval_texts=[], general_texts=[], info={})
    with pytest.raises(DeltaZipError, match="no calibration text"):
        pair.calibration_texts(4)


def test_benchmarks_take_a_real_pair_folder(tmp_path, base_dir, capsys):
    """`act_sparsity quality --real-pair` and `quantized_base quality --pair` read the pair's own texts:
    calibration from its calibration stream, scores on its held-out evaluation texts."""
    import argparse

    from hf_deltazip.bench import act_sparsity, quantized_base

    pair = real_pairs.build_real_pair(tmp_path, "dates", base_dir=base_dir, **dict(SMALL, n_eval=6, n_calibration=8))
    pair_dir = tmp_path / "dates"
    evals, calib = real_pairs.real_pair_texts(pair_dir)
    assert evals == pair.eval_texts and calib == pair.calibration and len(evals) == 6
    out = tmp_path / "aq.json"
    assert act_sparsity.main(["quality", "--real-pair", str(pair_dir), "--base", str(base_dir), "--sparsity", "0.5",
                              "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["calibration_sequences"] == 6  # as many calibration texts as evaluation texts
    assert [r["sparsity"] for r in result["rows"]] == [0.0, 0.5]
    dense = result["rows"][0]
    assert dense["rel_nll_increase"] == 0.0 and dense["gain_kept"] == pytest.approx(1.0)
    # decode-only sparsity scored on the answers, each example's own prompt dense
    assert act_sparsity.main(["quality", "--real-pair", str(pair_dir), "--base", str(base_dir), "--sparsity", "0.5",
                              "--device", "cpu", "--dense-prefix", "prompt", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dense_prefix"] == "prompt"
    assert {r["eval"] for r in result["rows"]} == {"text, decode-only", "text, every token"}
    # dense, the prompt-prefixed score is the answers' NLL as metrics.answer_nll computes it on the examples
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_deltazip.bench import metrics

    tok = AutoTokenizer.from_pretrained(pair_dir / "finetuned")
    ft = AutoModelForCausalLM.from_pretrained(pair_dir / "finetuned", dtype=torch.float32).eval()
    answers = [(ex.prompt, " " + ex.answer + tok.eos_token) for ex in pair.eval_examples]
    dense_rows = [r for r in result["rows"] if r["model"] == "fine-tune" and r["sparsity"] == 0.0]
    for r in dense_rows:
        assert r["nll"] == pytest.approx(metrics.answer_nll(ft, tok, answers), rel=1e-4)
    # quantized_base: the base defaults to the folder beside the pair (WORK/base)
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(pair=str(pair_dir), base=None, finetune=None, eval_texts=None, calibration=None)
    base, ft, texts, calibration = quantized_base._quality_inputs(parser, args)
    assert (base, ft) == (str(tmp_path / "base"), str(pair_dir / "finetuned"))
    assert texts == evals and calibration == calib
    with pytest.raises(SystemExit):
        quantized_base._quality_inputs(parser, argparse.Namespace(pair=None, base="b", finetune=None, eval_texts=None,
                                                                  calibration=None))
    assert "--finetune, --eval-texts" in capsys.readouterr().err
    with pytest.raises(DeltaZipError, match="no finished real pair"):
        real_pairs.real_pair_texts(tmp_path / "nothing")


def test_act_sparsity_quality_scores_exact_match_every_token_and_decode_only(tmp_path, base_dir):
    """`act_sparsity quality --real-pair --exact-match`: the pair's held-out examples answered greedily under each
    sparsity's thresholds, once with the prompt thresholded too and once with it dense (decode only), with the
    exact-match gain kept against the base and the dense fine-tune."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_deltazip.bench import act_sparsity, metrics
    from hf_deltazip.modeling import activation_sparsity as S

    pair = real_pairs.build_real_pair(tmp_path, "dates", base_dir=base_dir, **dict(SMALL, n_eval=6, n_calibration=8))
    pair_dir = tmp_path / "dates"
    tok = AutoTokenizer.from_pretrained(pair_dir / "finetuned")
    ft = AutoModelForCausalLM.from_pretrained(pair_dir / "finetuned", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    # a 3-step pair answers nothing right: make each reference answer the dense fine-tune's own greedy answer, so
    # the dense fine-tune scores 1 and the thresholds can only lose answers
    path = pair_dir / "eval_data.json"
    data = json.loads(path.read_text())
    for ex in data["eval_examples"]:
        prompt = torch.tensor([tok(ex["prompt"], add_special_tokens=False)["input_ids"]])
        new = metrics._greedy(ft, prompt, pair.max_new_tokens, tok.eos_token_id, metrics._pad_id(tok))[0].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        ex["answer"] = tok.decode(new, skip_special_tokens=True).strip()
    path.write_text(json.dumps(data))
    examples = real_pairs.load_real_pair(pair_dir, base_dir=base_dir).eval_examples

    out = tmp_path / "em.json"
    assert act_sparsity.main(["quality", "--real-pair", str(pair_dir), "--base", str(base_dir), "--sparsity", "0.9",
                              "--device", "cpu", "--exact-match", "--batch-size", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["sparsity"], r["mode"]): r for r in result["exact_match_rows"]}
    assert result["exact_match_examples"] == 6 and set(rows) == {(s, m) for s in (0.0, 0.9)
                                                                   for m in ("every token", "decode only")}
    base_em = metrics.exact_match(base, tok, examples, max_new_tokens=pair.max_new_tokens)
    assert all(r["base_exact_match"] == base_em and r["finetune_exact_match"] == 1.0 for r in rows.values())
    assert rows[0.0, "every token"]["exact_match"] == rows[0.0, "decode only"]["exact_match"] == 1.0

    # the same thresholds installed by hand (calibrated as the bench does, on the pair's calibration texts)
    _, calib_texts = real_pairs.real_pair_texts(pair_dir)
    th = S.calibrate_activation_thresholds(ft, act_sparsity._ids(tok, calib_texts[:6], 512), [0.9])[0.9]
    want = {}
    for mode, decode_only in (("every token", False), ("decode only", True)):
        S.install_activation_sparsity(ft, th, decode_only=decode_only)
        want[mode] = metrics.exact_match(ft, tok, examples, max_new_tokens=pair.max_new_tokens)
        got = rows[0.9, mode]
        assert got["exact_match"] == want[mode]
        expect_gain = (want[mode] - base_em) / (1.0 - base_em) if base_em < 1.0 else None
        assert got["gain_kept"] == (pytest.approx(expect_gain) if expect_gain is not None else None)
    S.remove_activation_sparsity(ft)
    assert min(want.values()) < 1.0  # at 90 % the thresholds do cost answers: the scores above are not vacuous
    assert "exact match on the pair's 6 held-out examples" in act_sparsity.quality_table(result)
    with pytest.raises(SystemExit, match="--exact-match needs --real-pair"):
        act_sparsity.main(["quality", "--tiny", "--sparsity", "0.5", "--device", "cpu", "--exact-match"])


def test_jacobi_bench_scores_the_pair_task_for_every_model_and_delta(tmp_path, base_dir):
    """`bench.jacobi --pair` adds exact match and answer NLL on the pair's held-out examples, the measure
    of task gain that the continuation NLL cannot give for a consistency model."""
    from hf_deltazip.bench import jacobi

    real_pairs.build_real_pair(tmp_path, "dates", base_dir=base_dir, **dict(SMALL, n_eval=4, n_calibration=4))
    pair_dir = tmp_path / "dates"
    out = tmp_path / "j.json"
    assert jacobi.main(["--pair", str(pair_dir), "--base", str(base_dir), "--train-prompts", "2", "--eval-prompts", "2",
                        "--b1-prompts", "1", "--prompt-tokens", "8", "--new-tokens", "6", "--block", "4", "--bits", "4",
                        "--batch", "1", "--cllm-steps", "2", "--cllm-batch", "2", "--device", "cpu", "--dtype", "fp32",
                        "--task-prompts", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # fp32 on the CPU: every Jacobi output is the greedy output, and the rows say how long those were
    assert result["outputs_differ"] == 0 and result["differences"] == []
    assert all(0 < r["greedy_new_tokens"] <= 6 for r in result["rows"])
    # every timed call is recorded, one list per prompt group (batch 1: one group per prompt)
    assert all(len(r["greedy_runs_s"]) == len(r["jacobi_runs_s"]) == 1 and len(r["greedy_runs_s"][0]) == 1
               for r in result["rows"])
    for r in result["rows"]:  # the gate's view of every step: "." one-token, else the tokens a Jacobi step matched
        seen = r["gate_trace"].replace("|", " ").split()
        assert len(seen) == r["steps"] and sum(s != "." for s in seen) == r["wide_steps"]
    task = result["task"]
    assert task["task"] == "dates" and task["examples"] == 4
    assert set(task["scores"]) == {"base", "finetune", "cllm (16-bit)", "finetune-4bit", "cllm-4bit"}
    # the base (no delta routed) and the fine-tune score what the pair builder recorded for them
    recorded = json.loads((pair_dir / "real_pair.json").read_text())["scores"]
    for ours, theirs in (("base", "base"), ("finetune", "finetuned")):
        assert task["scores"][ours]["exact_match"] == recorded[theirs]["exact_match"]
        assert task["scores"][ours]["task_nll"] == pytest.approx(recorded[theirs]["task_nll"], rel=1e-5)
    nll = task["gain_kept"]
    assert nll["finetune"]["task_nll"] == pytest.approx(1.0) and nll["base"]["task_nll"] == pytest.approx(0.0)
    # gain kept is (model - base) / (fine-tune - base) of the scores above
    s = task["scores"]
    want = (s["base"]["task_nll"] - s["cllm-4bit"]["task_nll"]) / (s["base"]["task_nll"] - s["finetune"]["task_nll"])
    assert nll["cllm-4bit"]["task_nll"] == pytest.approx(want)
    assert "task gain kept on the pair's 4 held-out dates examples" in jacobi.to_table(result)


def test_jacobi_bench_task_prompts_come_from_the_pair_streams(tmp_path, base_dir):
    from transformers import AutoTokenizer

    from hf_deltazip.bench import jacobi

    pair = real_pairs.build_real_pair(tmp_path, "dates", base_dir=base_dir, **dict(SMALL, n_eval=4, n_calibration=4))
    tok = AutoTokenizer.from_pretrained(pair.tokenizer_dir)
    rows = jacobi._pair_prompts(tok, tmp_path / "dates", base_dir, 3, 2)
    texts = [tok.decode(r) for r in rows]
    # training prompts: calibration transcripts cut after their "Answer:"; then held-out evaluation prompts
    assert all(t.endswith("Answer:") for t in texts)
    assert [any(c.startswith(t) for c in pair.calibration) for t in texts[:3]] == [True] * 3
    assert rows[3:] == [tok(ex.prompt, add_special_tokens=False)["input_ids"] for ex in pair.eval_examples[:2]]
    with pytest.raises(SystemExit, match="4 evaluation prompts; 1 and 5 were asked"):
        jacobi._pair_prompts(tok, tmp_path / "dates", base_dir, 1, 5)
    with pytest.raises(SystemExit):
        jacobi.main(["--task-prompts", "--base", "b", "--finetune", "f"])  # needs --pair


def test_jacobi_bench_refuses_pair_with_tiny_and_an_unfinished_pair(tmp_path):
    from hf_deltazip.bench import jacobi

    with pytest.raises(SystemExit):
        jacobi.main(["--pair", str(tmp_path / "dates"), "--tiny"])
    with pytest.raises(DeltaZipError, match="no finished real pair"):  # a folder the pair builder never finished
        jacobi.task_scores(tmp_path / "dates", tmp_path / "base", None, None, {}, [])


def test_answer_nll_scores_only_the_answers_tokens(base_dir):
    from transformers import AutoTokenizer

    from hf_deltazip.bench import metrics

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    examples = [("<bos>Question: Rewrite the date 3 March 2021 in ISO format (YYYY-MM-DD).\nAnswer:", " 2021-03-03" + tok.eos_token),
                ("<bos>Question: Rewrite the date 12/01/1999 in ISO format (YYYY-MM-DD).\nAnswer:", " 1999-01-12" + tok.eos_token)]
    total = count = 0.0
    with torch.no_grad():
        for prompt, answer in examples:
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            full = tok(prompt + answer, add_special_tokens=False)["input_ids"]
            logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].float(), -1)
            for j in range(len(p), len(full)):  # token j predicted at position j - 1
                total -= float(logp[j - 1, full[j]])
                count += 1
    assert metrics.answer_nll(model, tok, examples, batch_size=2) == pytest.approx(total / count, rel=1e-5)
    # the whole text's NLL: every token but the first, pooled; padding (rows of other lengths) never counts
    whole = [tok(p + a, add_special_tokens=False)["input_ids"] for p, a in examples] + [[5, 6, 7]]
    total = count = 0.0
    with torch.no_grad():
        for row in whole:
            logp = torch.log_softmax(model(input_ids=torch.tensor([row])).logits[0].float(), -1)
            total -= float(sum(logp[j - 1, row[j]] for j in range(1, len(row))))
            count += len(row) - 1
    assert metrics.mean_token_nll(model, whole, batch_size=3) == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="no examples"):
        metrics.answer_nll(model, tok, [])


def test_jacobi_bench_times_greedy_and_jacobi_in_turn():
    """Greedy and Jacobi calls alternate (a b, b a, a b, ...) after one warm-up each, so a slow spell of the
    host lands on both kinds rather than on whichever ran during it."""
    from hf_deltazip.bench import jacobi

    calls = []
    out_a, out_b, ta, tb = jacobi._timed_pair(lambda: calls.append("a") or "A", lambda: calls.append("b") or "B", 3, True)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert (out_a, out_b) == ("A", "B") and len(ta) == len(tb) == 3 and all(t >= 0 for t in ta + tb)
    calls.clear()
    jacobi._timed_pair(lambda: calls.append("a"), lambda: calls.append("b"), 2, False)
    assert calls == ["a", "b", "b", "a"]


def test_cllm_recipe_bench_scores_each_run_on_the_pair_task(tmp_path, base_dir):
    """`bench.cllm_recipe --pair`: base and fine-tune scored once (what the pair builder recorded), each
    consistency run's exact match and answer NLL against them."""
    from hf_deltazip.bench import cllm_recipe

    real_pairs.build_real_pair(tmp_path, "dates", base_dir=base_dir, **dict(SMALL, n_eval=4, n_calibration=4))
    pair_dir = tmp_path / "dates"
    out = tmp_path / "r.json"
    assert cllm_recipe.main(["--pair", str(pair_dir), "--base", str(base_dir), "--schedules", "cosine", "--seeds", "0",
                             "1", "--steps", "2", "--batch-size", "2", "--train-prompts", "2", "--eval-prompts", "2",
                             "--new-tokens", "6", "--block", "4", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    recorded = json.loads((pair_dir / "real_pair.json").read_text())["scores"]
    ref = result["reference"]["scores"]
    assert ref["base"]["exact_match"] == recorded["base"]["exact_match"]
    assert ref["finetune"]["task_nll"] == pytest.approx(recorded["finetuned"]["task_nll"], rel=1e-5)
    assert [(r["schedule"], r["seed"]) for r in result["runs"]] == [("cosine", 0), ("cosine", 1)]
    for r in result["runs"]:
        s = r["scores"]
        want = (ref["base"]["answer_nll"] - s["answer_nll"]) / (ref["base"]["answer_nll"] - ref["finetune"]["answer_nll"])
        assert r["nll_kept"] == pytest.approx(want)
    assert result["nll_kept"]["cosine"]["runs"] == 2


def _tiny_gguf(path, pieces):
    """A GGUF file holding only a sentencepiece ('llama') vocabulary: four specials, then ``pieces`` in
    merge order, a control token and a user-defined one."""
    gguf = pytest.importorskip("gguf")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + pieces + ["<start_of_turn>", "<tag>"]
    kinds = [3, 3, 3, 2] + [1] * len(pieces) + [3, 4]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_scores([0.0] * len(tokens))  # Gemma's scores say nothing about merge order
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _pieces(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_gguf_tokenizer_rebuilds_merges_in_file_order(tmp_path):
    """real_pairs.gguf_tokenizer: merges come from the vocabulary, earlier pieces merged first; runs of spaces,
    control and user-defined tokens stay whole; BOS is added as the file asks; a character-level tokenizer
    (what transformers 5.17 built from the Gemma 3 GGUF) is refused by check_tokenizer."""
    first_ab = _tiny_gguf(tmp_path / "ab.gguf", ["\u2581", "a", "b", "c", "ab", "bc", "  ", "\u2581a"])
    tok = real_pairs.gguf_tokenizer(tmp_path / "ab.gguf")
    assert _pieces(tok, "abc") == ["ab", "c"]
    assert _pieces(tok, "a  a") == ["a", "\u2581\u2581", "a"] and _pieces(tok, " a") == ["\u2581a"]
    ids = tok("abc<start_of_turn><tag>")["input_ids"]
    assert ids == [2, first_ab.index("ab"), first_ab.index("c"), first_ab.index("<start_of_turn>"),
                   first_ab.index("<tag>")]
    assert tok.decode(tok("a abc")["input_ids"], skip_special_tokens=True) == "a abc"
    _tiny_gguf(tmp_path / "bc.gguf", ["\u2581", "a", "b", "c", "bc", "ab", "  ", "\u2581a"])
    assert _pieces(real_pairs.gguf_tokenizer(tmp_path / "bc.gguf"), "abc") == ["a", "bc"]

    # the check: letters and no longer pieces cut English into characters, as a conversion without merges does
    _tiny_gguf(tmp_path / "chars.gguf", ["\u2581"] + list(string.ascii_letters) + [":", "."])
    with pytest.raises(DeltaZipError, match="cuts plain English into .*Delete the base folder"):
        real_pairs.check_tokenizer(real_pairs.gguf_tokenizer(tmp_path / "chars.gguf"), "tiny")
    _tiny_gguf(tmp_path / "twice.gguf", ["\u2581", "a", "  ", "\u2581\u2581"])  # one spelling, two ids
    with pytest.raises(DeltaZipError, match="spells 1 tokens the same way"):
        real_pairs.gguf_tokenizer(tmp_path / "twice.gguf")
    with pytest.raises(DeltaZipError, match="only sentencepiece"):
        gguf = pytest.importorskip("gguf")
        w = gguf.GGUFWriter(str(tmp_path / "bpe.gguf"), "gpt2")
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a"])
        w.add_token_types([1])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        real_pairs.gguf_tokenizer(tmp_path / "bpe.gguf")


def test_gguf_tokenizer_reads_english_as_words_on_the_real_base():
    """On the Gemma 3 270M GGUF (where its package is installed): the rebuilt tokenizer reads English in words
    (the 5.17 conversion gave one token per character) and passes the check."""
    pytest.importorskip("gguf")
    package = pytest.importorskip(real_pairs.GGUF_PACKAGE)
    tok = real_pairs.gguf_tokenizer(package.assemble())
    real_pairs.check_tokenizer(tok)
    text = "Compound statements contain (groups of) other statements."
    assert len(tok(text, add_special_tokens=False)["input_ids"]) <= 12
    assert tok(text)["input_ids"][0] == tok.bos_token_id == 2


def test_quality_bench_takes_the_gguf_file_and_names_a_missing_one(tmp_path):
    """`bench quality --gguf-file` builds the real pairs from that file (a machine without the package); a
    path with no file is refused by name before anything is written."""
    from hf_deltazip.bench import quality

    missing = tmp_path / "nope.gguf"
    with pytest.raises(DeltaZipError, match="nope.gguf: no such GGUF file"):
        quality.main(["--pairs", "real", "--work", str(tmp_path / "w"), "--tasks", "facts", "--gguf-file", str(missing),
                      "--ratios", "16", "--methods", "ours", "--device", "cpu"])
    assert not (tmp_path / "w" / "base").exists()
