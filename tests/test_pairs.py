"""Tests of the benchmark pairs (tokenizer, tiny models, build_pair) and the quality metrics.

Everything here runs on CPU in seconds: tiny models, a few optimizer steps.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.pytorch_utils import Conv1D

from hf_deltazip.bench import metrics, pairs
from hf_deltazip.bench.metrics import exact_match, gain_kept, greedy_agreement, kl_divergence, mean_token_nll
from hf_deltazip.errors import DeltaZipError

VOCAB = 512


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    pairs.build_tokenizer(path, vocab_size=VOCAB, seed=0)
    return path


@pytest.fixture()
def tokenizer(tokenizer_dir):
    return pairs.build_tokenizer(tokenizer_dir, vocab_size=VOCAB, seed=0)


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trips_text_and_has_special_tokens(tokenizer):
    text = 'def f(x):\n    return {"é": x ** 2}  # ünïcode → ok\n\tpass'
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == VOCAB
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("x = 1")["input_ids"][0] != tokenizer.bos_token_id  # no BOS added on its own
    # BPE merged something: common code needs fewer tokens than bytes
    assert len(ids) < len(text.encode())


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "reverse: a b c"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nreverse: a b c<|eos|><|assistant|>\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|user|>")]
    assert ids.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "\nreverse: a b c\n"


def test_tokenizer_cache_reloads_identically_and_refuses_other_settings(tokenizer_dir, tokenizer):
    again = pairs.build_tokenizer(tokenizer_dir, vocab_size=VOCAB, seed=0)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.chat_template == tokenizer.chat_template
    with pytest.raises(DeltaZipError, match="other|not"):
        pairs.build_tokenizer(tokenizer_dir, vocab_size=600, seed=0)


# ---------------------------------------------------------------------------------------------------
# Tiny models


@pytest.mark.parametrize("arch", pairs.ARCHS)
def test_tiny_model_forward_and_generate(arch):
    model = pairs.tiny_model(arch, vocab_size=VOCAB, seed=0)
    assert next(model.parameters()).dtype == torch.float32
    assert 100_000 <= pairs.param_count(model) <= 1_000_000
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, VOCAB)
    assert torch.isfinite(logits).all()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                         min_new_tokens=4, pad_token_id=0)
    assert out.shape == (1, 9) and torch.equal(out[:, :5], ids)


def test_tiny_models_have_the_layer_shapes_each_arch_stands_for():
    llama = pairs.tiny_model("llama", VOCAB).model.layers[0]
    attn = llama.self_attn
    assert attn.k_proj.out_features < attn.q_proj.out_features  # GQA
    assert attn.q_proj.bias is None

    qwen = pairs.tiny_model("qwen2", VOCAB).model.layers[0].self_attn
    assert qwen.q_proj.bias is not None and qwen.k_proj.bias is not None and qwen.v_proj.bias is not None
    assert qwen.k_proj.out_features < qwen.q_proj.out_features

    phi = pairs.tiny_model("phi3", VOCAB).model.layers[0]
    assert phi.self_attn.qkv_proj.out_features == 3 * 64
    assert phi.mlp.gate_up_proj.out_features == 2 * 128

    gpt2 = pairs.tiny_model("gpt2", VOCAB)
    block = gpt2.transformer.h[0]
    assert isinstance(block.attn.c_attn, Conv1D) and block.attn.c_attn.weight.shape == (64, 3 * 64)
    assert gpt2.lm_head.weight.data_ptr() == gpt2.transformer.wte.weight.data_ptr()  # tied


def test_tiny_model_is_deterministic_under_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = pairs.tiny_model("llama", VOCAB, seed=5).state_dict()
    assert torch.equal(torch.rand(3), expected_next)
    b = pairs.tiny_model("llama", VOCAB, seed=5).state_dict()
    c = pairs.tiny_model("llama", VOCAB, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_size_presets_and_unknown_names():
    cfg = pairs.tiny_config("llama", 1024, size="small")
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (pairs.SIZES["small"]["hidden_size"], pairs.SIZES["small"]["num_layers"])
    assert pairs.tiny_config("llama", 1024, size="small", num_layers=3).num_hidden_layers == 3
    with pytest.raises(DeltaZipError, match="arch"):
        pairs.tiny_config("bert", VOCAB)
    with pytest.raises(DeltaZipError, match="size"):
        pairs.tiny_config("llama", VOCAB, size="huge")


def test_resize_embeddings_is_deterministic_and_keeps_old_rows():
    base = pairs.tiny_model("llama", VOCAB)
    old = base.get_input_embeddings().weight.clone()
    a = pairs.resize_embeddings(pairs.tiny_model("llama", VOCAB), VOCAB + 4, seed=0)
    b = pairs.resize_embeddings(pairs.tiny_model("llama", VOCAB), VOCAB + 4, seed=0)
    for m in (a, b):
        assert m.get_input_embeddings().weight.shape == (VOCAB + 4, 64)
        assert m.get_output_embeddings().weight.shape == (VOCAB + 4, 64)
        assert torch.equal(m.get_input_embeddings().weight[:VOCAB], old)
    assert torch.equal(a.get_input_embeddings().weight, b.get_input_embeddings().weight)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    new_rows = a.get_input_embeddings().weight[VOCAB:]
    assert not torch.equal(new_rows[0], new_rows[1])


# ---------------------------------------------------------------------------------------------------
# Tasks and pairs


def test_task_examples_are_correct_deterministic_and_distinct(tokenizer):
    for task in pairs.TASKS:
        examples = pairs.make_task_examples(task, 50, tokenizer, seed=0)
        assert examples == pairs.make_task_examples(task, 50, tokenizer, seed=0)
        assert examples != pairs.make_task_examples(task, 50, tokenizer, seed=1)
        assert len({ex.prompt for ex in examples}) == 50
    ex = pairs.make_task_examples("reverse", 1, tokenizer)[0]
    content = ex.prompt.split("<|user|>\n", 1)[1].split("<|eos|>", 1)[0]
    op, symbols = content.split(": ")
    assert op == "reverse" and ex.answer == " ".join(symbols.split()[::-1])
    assert ex.prompt.endswith("<|assistant|>\n")
    ex = pairs.make_task_examples("sort", 1, tokenizer, seed=3)[0]
    assert ex.answer.split() == sorted(ex.prompt.split(": ", 1)[1].split("<|eos|>")[0].split())


def test_task_batches_put_the_loss_on_answers(tokenizer):
    batches = pairs._task_batches(tokenizer, "reverse", 0, 0, 4, held_out=set())
    ids, mask, weights = next(batches)
    assert ids.shape == mask.shape == weights.shape and ids.shape[0] == 4
    for row in range(4):
        answer = tokenizer.decode(ids[row][weights[row] == 1.0])
        prompt = tokenizer.decode(ids[row][: int((weights[row] < 1.0).logical_and(mask[row] == 1).sum())])
        assert prompt.startswith("<|bos|><|user|>\nreverse: ") and prompt.endswith("<|assistant|>\n")
        assert answer.endswith("<|eos|>")
        assert answer[: -len("<|eos|>")] == " ".join(prompt.split(": ")[1].split("<|eos|>")[0].split()[::-1])
        assert weights[row, 0] == 0 and (weights[row][mask[row] == 0] == 0).all()
        assert torch.allclose(weights[row][1 : len(tokenizer(prompt)["input_ids"])], torch.tensor(pairs.PROMPT_LOSS_WEIGHT))


def _weights(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


@torch.no_grad()
def _greedy_answer(model, tokenizer, prompt, max_new):
    """A plain greedy loop, one prompt at a time, up to EOS."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    new = []
    for _ in range(max_new):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        if nxt == tokenizer.eos_token_id:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_build_pair_is_reproducible_and_reused(tmp_path, monkeypatch):
    kw = dict(arch="llama", size="tiny", task="reverse", seed=0, base_steps=3, ft_steps=3, n_eval=6)
    first = pairs.build_pair(tmp_path / "a", **kw)
    second = pairs.build_pair(tmp_path / "b", **kw)

    for sub in ("base_dir", "finetuned_dir"):
        wa, wb = _weights(getattr(first, sub)), _weights(getattr(second, sub))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), sub
    base, ft = _weights(first.base_dir), _weights(first.finetuned_dir)
    # a full fine-tune: every tensor moved
    assert all(not torch.equal(base[k], ft[k]) for k in base)
    assert first.eval_examples == second.eval_examples and len(first.eval_examples) == 6
    assert first.eval_texts[0] == first.eval_examples[0].text + "<|eos|>"
    assert first.general_texts and first.general_texts == second.general_texts
    assert set(first.info["scores"]) == {"base", "finetuned"}
    # the recorded exact match is the share of held-out answers each model gives greedily
    tok = first.load_tokenizer()
    examples = first.eval_examples
    max_new = max(len(tok(ex.answer, add_special_tokens=False)["input_ids"]) for ex in examples) + 2
    greedy = {}
    for who, model in (("base", first.load_base()), ("finetuned", first.load_finetuned())):
        greedy[who] = [_greedy_answer(model, tok, ex.prompt, max_new) for ex in examples]
        expected = sum(a.strip() == ex.answer.strip() for a, ex in zip(greedy[who], examples)) / len(examples)
        assert first.info["scores"][who]["exact_match"] == expected, (who, greedy[who])
    # 3 training steps answer nothing right, so also score a known mix on this pair's own prompts:
    # every other answer replaced by the fine-tune's greedy one
    ft_answers = greedy["finetuned"]
    mixed = [pairs.TaskExample(ex.prompt, ft_answers[i] if i % 2 == 0 else ex.answer) for i, ex in enumerate(examples)]
    known = sum(i % 2 == 0 or ft_answers[i].strip() == ex.answer.strip() for i, ex in enumerate(examples)) / len(examples)
    assert known >= 0.5
    assert exact_match(first.load_finetuned(), tok, mixed, max_new_tokens=max_new) == known
    assert first.load_finetuned().config.model_type == "llama"
    calib = first.calibration_texts(5)
    assert len(calib) == 5 and calib == second.calibration_texts(5) and calib != first.calibration_texts(5, seed=1)
    held_out = {ex.text + "<|eos|>" for ex in first.eval_examples}
    assert not held_out & set(calib)
    assert len(first.load_tokenizer()) == VOCAB

    # a finished pair is loaded, not retrained
    def no_training(*args, **kwargs):
        raise AssertionError("build_pair retrained a finished pair")

    monkeypatch.setattr(pairs, "train_model", no_training)
    again = pairs.build_pair(tmp_path / "a", **kw)
    assert again.eval_examples == first.eval_examples and again.info == first.info
    with pytest.raises(DeltaZipError, match="another out_dir"):
        pairs.build_pair(tmp_path / "a", **{**kw, "seed": 1})


def test_build_pair_with_added_vocab_and_tied_embeddings(tmp_path):
    pair = pairs.build_pair(tmp_path / "g", arch="gpt2", task="sort", seed=1, base_steps=2, ft_steps=40,
                            n_eval=8, vocab_added=3)
    scores = pair.info["scores"]
    assert scores["finetuned"]["task_nll"] < scores["base"]["task_nll"] - 1.0  # 40 steps already teach the format
    base, ft = pair.load_base(resized=False), pair.load_finetuned()
    assert base.get_input_embeddings().weight.shape[0] == VOCAB
    assert ft.get_input_embeddings().weight.shape[0] == VOCAB + 3
    assert ft.lm_head.weight.data_ptr() == ft.transformer.wte.weight.data_ptr()
    assert len(pair.load_tokenizer()) == VOCAB + 3
    assert pair.info["finetuned_vocab_size"] == VOCAB + 3
    assert any("<|sym_" in ex.prompt for ex in pair.eval_examples)
    # load_base(resized=True) starts where the fine-tune started: same shape, same old rows
    resized = pair.load_base()
    assert resized.get_input_embeddings().weight.shape == ft.get_input_embeddings().weight.shape
    assert torch.equal(resized.get_input_embeddings().weight[:VOCAB], base.get_input_embeddings().weight)
    # the added tokens are real tokens for the fine-tune
    tok = pair.load_tokenizer()
    assert tok("<|sym_2|>", add_special_tokens=False)["input_ids"] == [VOCAB + 2]


# ---------------------------------------------------------------------------------------------------
# Metrics, against hand-computed values


class FnLM(torch.nn.Module):
    """A parameter-free 'LM' whose logits are ``fn(input_ids)``; it has no ``generate``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.fn(input_ids))


def next_token_lm(vocab, step_of):
    """Puts all its mass (logit 30) on ``step_of(t)`` after token ``t``."""

    def fn(ids):
        logits = torch.zeros(*ids.shape, vocab)
        targets = torch.tensor([[step_of(t) % vocab for t in row] for row in ids.tolist()])
        return logits.scatter(-1, targets[..., None], 30.0)

    return FnLM(fn)


def test_mean_token_nll_of_uniform_model_is_log_vocab():
    uniform = FnLM(lambda ids: torch.zeros(*ids.shape, 7))
    ids = [[1, 2, 3], [4, 5, 6, 0, 1]]
    assert mean_token_nll(uniform, ids) == pytest.approx(math.log(7), abs=1e-6)


def test_mean_token_nll_pools_tokens_and_ignores_padding(tokenizer):
    model = pairs.tiny_model("llama", VOCAB, seed=3)
    texts = ["x = 1\n", "def long_function_name(argument):\n    return argument\n", "y"]  # "y": nothing to predict
    rows = [tokenizer(t)["input_ids"] for t in texts]
    total, count = 0.0, 0
    for r in rows:
        ids = torch.tensor([r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += len(r) - 1
    expected = total / count
    assert mean_token_nll(model, tokenizer, texts, batch_size=2) == pytest.approx(expected, rel=1e-5)
    assert mean_token_nll(model, rows) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="texts"):
        mean_token_nll(model, tokenizer)


def test_kl_divergence_matches_hand_computation_and_is_zero_for_same_model():
    lp, lq = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 1.0, 0.5])
    p = FnLM(lambda ids: lp.expand(*ids.shape, 3))
    q = FnLM(lambda ids: lq.expand(*ids.shape, 3))
    pp, qq = lp.softmax(-1), lq.softmax(-1)
    expected = float((pp * (pp.log() - qq.log())).sum())
    assert kl_divergence(p, q, [[0, 1], [2, 1, 0]]) == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(q, p, torch.tensor([[0, 1, 2]])) != pytest.approx(expected, rel=1e-3)  # not symmetric

    model = pairs.tiny_model("qwen2", VOCAB, seed=0)
    other = pairs.tiny_model("qwen2", VOCAB, seed=1)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    assert kl_divergence(model, model, ids) == 0.0
    assert kl_divergence(model, other, ids) > 0.0
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    masked = kl_divergence(model, other, ids, attention_mask=mask)
    assert masked == pytest.approx(kl_divergence(model, other, [ids[0].tolist(), ids[1, :6].tolist()]), rel=1e-5)


def test_greedy_agreement_hand_computed_and_self_agreement():
    plus_one = next_token_lm(50, lambda t: t + 1)
    odd_only = next_token_lm(50, lambda t: t + 1 if t % 2 else t + 2)
    # plus_one's path from 11: 12 13 14 15; odd_only predicts after 11,12,13,14: 12, 14, 14, 16
    assert greedy_agreement(plus_one, odd_only, [[11]], max_new_tokens=4) == pytest.approx(0.5)
    # EOS (token 14) ends plus_one's path after 12 13 14: odd_only agrees on 12 and 14 -> 2/3
    assert greedy_agreement(plus_one, odd_only, [[11]], max_new_tokens=6, eos_token_id=14) == pytest.approx(2 / 3)

    model = pairs.tiny_model("phi3", VOCAB, seed=0)
    other = pairs.tiny_model("phi3", VOCAB, seed=1)
    prompts = [[1, 20, 30], [1, 40, 50], [1, 7, 8, 9, 10]]
    assert greedy_agreement(model, model, prompts, max_new_tokens=8, eos_token_id=2) == 1.0
    assert greedy_agreement(model, other, prompts, max_new_tokens=8, eos_token_id=2) < 1.0


def test_exact_match_counts_greedy_answers(tokenizer):
    plus_one = next_token_lm(VOCAB, lambda t: t + 1)
    starts = [300, 310, 320, 330]
    examples = []
    for i, t in enumerate(starts):
        prompt, answer = tokenizer.decode([t]), tokenizer.decode([t + 1, t + 2, t + 3])
        assert tokenizer(prompt)["input_ids"] == [t]
        examples.append((prompt, answer if i % 2 == 0 else answer + "!"))
    assert exact_match(plus_one, tokenizer, examples, max_new_tokens=3) == 0.5
    dict_examples = [{"prompt": p, "answer": a} for p, a in examples]
    assert exact_match(plus_one, tokenizer, dict_examples, max_new_tokens=3) == 0.5


def test_exact_match_with_generate_batches_prompts_of_any_length(tokenizer):
    model = pairs.tiny_model("gpt2", VOCAB, seed=2)
    prompts = ["reverse: a b", "sort: c a b", "x", "shift: a b c d e"]
    examples = []
    for prompt in prompts:  # reference: a plain greedy loop, one prompt at a time
        examples.append(pairs.TaskExample(prompt, _greedy_answer(model, tokenizer, prompt, 5)))
    assert exact_match(model, tokenizer, examples, max_new_tokens=5, batch_size=2) == 1.0
    examples[1] = pairs.TaskExample(examples[1].prompt, examples[1].answer + " wrong")
    assert exact_match(model, tokenizer, examples, max_new_tokens=5) == 0.75


def test_gain_kept_arithmetic_and_errors():
    assert gain_kept(0.5, 0.0, 1.0) == 0.5
    assert gain_kept(0.9, 0.1, 0.9) == pytest.approx(1.0)
    assert gain_kept(-2.0, -3.0, -1.0) == pytest.approx(0.5)  # negative NLLs
    assert gain_kept(0.0, 0.2, 0.6) == pytest.approx(-0.5)  # worse than the base
    with pytest.raises(ValueError, match="same as the base"):
        gain_kept(0.5, 0.3, 0.3)
    with pytest.raises(ValueError, match="finite"):
        gain_kept(float("nan"), 0.0, 1.0)


def test_metrics_restore_training_mode():
    model = pairs.tiny_model("llama", VOCAB).train()
    kl_divergence(model, model, [[1, 2, 3]])
    assert model.training
    assert metrics.mean_token_nll(model, [[1, 2, 3]]) > 0
    assert model.training
