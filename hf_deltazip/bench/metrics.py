"""Quality metrics for a compressed fine-tune, model-agnostic.

Each function takes causal LMs that map ``input_ids`` (and ``attention_mask``) to an output with
``.logits`` of shape ``[batch, seq, vocab]``; :func:`exact_match` also needs ``generate``. Models are
put in eval mode for the call and restored after; nothing is trained. Texts are tokenized as given
(``add_special_tokens=False`` by default): write BOS into the text, or pass ``add_special_tokens=True``.

- :func:`mean_token_nll`: mean negative log-likelihood per predicted token.
- :func:`exact_match`: share of prompts whose greedy answer equals the reference.
- :func:`greedy_agreement`: share of positions where two models pick the same next token.
- :func:`kl_divergence`: mean per-token KL(p || q) between two models' next-token distributions.
- :func:`gain_kept`: ``(c - b) / (f - b)``, the share of the fine-tune's gain a compressed copy keeps.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

__all__ = ["exact_match", "gain_kept", "greedy_agreement", "kl_divergence", "mean_token_nll"]

IdsLike = torch.Tensor | Sequence[Sequence[int]]


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


@contextlib.contextmanager
def _eval_mode(*models) -> Iterator[None]:
    was_training = [getattr(m, "training", False) for m in models]
    for m in models:
        if hasattr(m, "eval"):
            m.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        for m, flag in zip(models, was_training):
            if flag:
                m.train()


def _as_id_lists(ids: IdsLike) -> list[list[int]]:
    if isinstance(ids, torch.Tensor):
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be 1-D or 2-D, got shape {tuple(ids.shape)}.")
        return [row.tolist() for row in ids]
    out = [list(map(int, row)) for row in ids]
    if any(not row for row in out):
        raise ValueError("input_ids holds an empty sequence: drop it or give it at least one token.")
    return out


def _pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with token 0 (masked out, so its value does not matter)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def _logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


def _tokenize(tokenizer, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string: wrap it in a list.")
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]


def mean_token_nll(
    model,
    tokenizer_or_ids: Any,
    texts: Sequence[str] | None = None,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    add_special_tokens: bool = False,
) -> float:
    """Mean negative log-likelihood (nats) per predicted token, pooled over all texts.

    Every token but the first of each sequence is predicted from the ones before it; the mean is over
    all those tokens together (longer texts weigh more), not a mean of per-text means.

    Args:
        model: a causal LM.
        tokenizer_or_ids: a tokenizer (then ``texts`` are tokenized with it), or already tokenized
            sequences (a list of id lists, or a 2-D tensor of equal-length rows; ``texts`` must be None).
        texts: the strings to score.
        batch_size: sequences per forward pass.
        max_length: truncate each sequence to this many tokens (``None``: no truncation).
        add_special_tokens: passed to the tokenizer.

    Returns:
        The mean NLL; its negative is a score where higher is better.

    Raises:
        ValueError: neither or both of tokenizer and ids given, or nothing to predict.
    """
    if hasattr(tokenizer_or_ids, "encode"):
        if texts is None:
            raise ValueError("mean_token_nll got a tokenizer but no texts: pass texts=[...].")
        rows = _tokenize(tokenizer_or_ids, texts, add_special_tokens)
    else:
        if texts is not None:
            raise ValueError("mean_token_nll got token ids and texts: pass one or the other.")
        rows = _as_id_lists(tokenizer_or_ids)
    if max_length is not None:
        rows = [r[:max_length] for r in rows]
    rows = [r for r in rows if len(r) >= 2]
    if not rows:
        raise ValueError("mean_token_nll has nothing to predict: every sequence is shorter than 2 tokens.")
    return _pooled_nll(model, rows, [1] * len(rows), batch_size)


def _pooled_nll(model, rows: list[list[int]], first: list[int], batch_size: int) -> float:
    """Mean NLL over the tokens ``rows[i][first[i]:]`` of every row, each predicted from the ones before it."""
    device = _device(model)
    total, count = 0.0, 0
    with _eval_mode(model):
        for start in range(0, len(rows), batch_size):
            ids, mask = _pad(rows[start : start + batch_size], device)
            logp = F.log_softmax(_logits(model, ids, mask)[:, :-1], dim=-1)
            nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
            # position j predicts token j + 1: a row's scored tokens are predicted from position first - 1 on
            pos = torch.arange(ids.shape[1] - 1, device=device)[None, :]
            lo = torch.tensor(first[start : start + batch_size], device=device)[:, None] - 1
            keep = mask[:, 1:].bool() & (pos >= lo)
            total += float(nll[keep].double().sum())
            count += int(keep.sum())
    return total / count


def answer_nll(model, tokenizer, examples: Sequence[tuple[str, str]], *, batch_size: int = 8) -> float:
    """Mean NLL (nats) per token of the *answers* only: each example is ``(prompt, continuation)``, the
    sequence is ``prompt + continuation`` and only the continuation's tokens are scored (pooled over all
    examples). A model that forgot how to predict the questions (a consistency model trained on answers)
    is not charged for it here, as :func:`mean_token_nll` of the whole text would charge it.

    Raises:
        ValueError: the prompt's tokens are not a prefix of the whole sequence's (the continuation would
            merge with the prompt's last token: start the continuation at a token boundary, e.g. a space),
            or nothing to score.
    """
    rows, starts = [], []
    for prompt, continuation in examples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full = tokenizer(prompt + continuation, add_special_tokens=False)["input_ids"]
        if full[: len(p)] != p or len(full) <= len(p):
            raise ValueError(f"the prompt {prompt[-30:]!r} does not tokenize as a prefix of prompt + continuation "
                             f"{continuation[:30]!r}: start the continuation at a token boundary")
        rows.append(full)
        starts.append(len(p))
    if not rows:
        raise ValueError("answer_nll got no examples")
    return _pooled_nll(model, rows, starts, batch_size)


def _example_fields(example) -> tuple[str, str]:
    if isinstance(example, dict):
        return example["prompt"], example["answer"]
    if hasattr(example, "prompt") and hasattr(example, "answer"):
        return example.prompt, example.answer
    prompt, answer = example
    return prompt, answer


def _groups_by_length(rows: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of rows, grouped so each group has one length (no padding needed) and <= batch_size."""
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(r), []).append(i)
    for length in sorted(by_len):
        idx = by_len[length]
        for start in range(0, len(idx), batch_size):
            yield idx[start : start + batch_size]


def _greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None, pad_token_id: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts ``[B, T]``: the new tokens ``[B, <= max_new_tokens]``,
    padded with ``pad_token_id`` after EOS (generation stops once every row has ended).

    Uses the model's ``generate`` (KV cache) when it has one, else a plain loop of full forwards.
    """
    if hasattr(model, "generate"):
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        return out[:, prompt.shape[1] :]
    ids = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        nxt = _logits(model, ids, torch.ones_like(ids))[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if bool(done.all()):
            break
    return ids[:, prompt.shape[1] :]


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def exact_match(
    model,
    tokenizer,
    examples: Sequence[Any],
    max_new_tokens: int = 32,
    *,
    batch_size: int = 32,
    add_special_tokens: bool = False,
) -> float:
    """Share of examples whose greedy answer equals the reference exactly.

    Each prompt is generated from greedily until EOS or ``max_new_tokens``; the new tokens are decoded
    with special tokens skipped, and compared to the answer after stripping surrounding whitespace on
    both sides. Prompts of equal token length are batched together, so no padding is involved.

    Args:
        model: a causal LM with ``generate``.
        tokenizer: its tokenizer (gives EOS and decoding).
        examples: items with ``.prompt`` and ``.answer``, dicts with those keys, or (prompt, answer)
            pairs. Prompts are the full model input (chat template already applied).
        max_new_tokens: generation budget per example.

    Returns:
        A fraction in [0, 1].
    """
    fields = [_example_fields(ex) for ex in examples]
    if not fields:
        raise ValueError("exact_match got no examples.")
    rows = _tokenize(tokenizer, [p for p, _ in fields], add_special_tokens)
    device = _device(model)
    correct = 0
    with _eval_mode(model):
        for idx in _groups_by_length(rows, batch_size):
            prompt = torch.tensor([rows[i] for i in idx], dtype=torch.long, device=device)
            new = _greedy(model, prompt, max_new_tokens, tokenizer.eos_token_id, _pad_id(tokenizer))
            for i, gen in zip(idx, new.tolist()):
                if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in gen:
                    gen = gen[: gen.index(tokenizer.eos_token_id)]
                text = tokenizer.decode(gen, skip_special_tokens=True)
                correct += text.strip() == fields[i][1].strip()
    return correct / len(fields)


def greedy_agreement(
    model_a,
    model_b,
    prompts_ids: IdsLike,
    max_new_tokens: int = 32,
    *,
    eos_token_id: int | None = None,
    batch_size: int = 32,
) -> float:
    """Share of next-token choices on which ``model_b`` agrees with ``model_a`` along ``model_a``'s path.

    ``model_a`` continues each prompt greedily (stopping after ``eos_token_id`` if given). Then both
    models are run teacher-forced on prompt + that continuation, and at every position that predicts a
    continuation token (EOS included, padding after it excluded) their argmax tokens are compared.
    ``model_a``'s teacher-forced argmax is its greedy choice, so a model agrees with itself exactly
    (1.0). Use the fine-tune as ``model_a`` and the compressed copy as ``model_b``.

    Args:
        model_a: the reference model (it makes the continuations).
        model_b: the model compared with it; same vocabulary.
        prompts_ids: prompts as a list of id lists or a 2-D tensor.
        max_new_tokens: continuation length.
        eos_token_id: stop a continuation after this token.

    Returns:
        A fraction in [0, 1].
    """
    rows = _as_id_lists(prompts_ids)
    if not rows:
        raise ValueError("greedy_agreement got no prompts.")
    device = _device(model_a)
    pad = 0 if eos_token_id is None else eos_token_id
    agree, total = 0, 0
    with _eval_mode(model_a, model_b):
        for idx in _groups_by_length(rows, batch_size):
            prompt = torch.tensor([rows[i] for i in idx], dtype=torch.long, device=device)
            new = _greedy(model_a, prompt, max_new_tokens, eos_token_id, pad)
            n_new = new.shape[1]
            if n_new == 0:
                continue
            keep = torch.ones_like(new, dtype=torch.bool)
            if eos_token_id is not None:  # positions after the first EOS are padding
                seen_eos = (new == eos_token_id).long().cumsum(dim=1)
                keep = (seen_eos == 0) | ((seen_eos == 1) & (new == eos_token_id))
            full = torch.cat([prompt, new], dim=1)
            mask = torch.ones_like(full)
            # logits at position t predict token t+1: the continuation is predicted by the last n_new
            # positions before the end.
            sl = slice(prompt.shape[1] - 1, full.shape[1] - 1)
            pick_a = _logits(model_a, full, mask)[:, sl].argmax(-1)
            pick_b = _logits(model_b, full.to(_device(model_b)), mask.to(_device(model_b)))[:, sl].argmax(-1)
            same = (pick_a == pick_b.to(pick_a.device)) & keep
            agree += int(same.sum())
            total += int(keep.sum())
    if total == 0:
        raise ValueError("greedy_agreement generated no tokens: raise max_new_tokens.")
    return agree / total


def kl_divergence(
    model_p,
    model_q,
    input_ids: IdsLike,
    attention_mask: torch.Tensor | None = None,
    *,
    batch_size: int = 8,
) -> float:
    """Mean over token positions of KL(p || q) between the two models' next-token distributions.

    ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` in nats, from float32 log-softmaxed logits, at
    every non-padding position (the last one included). Use the fine-tune as ``p`` and the compressed
    copy as ``q``.

    Args:
        model_p, model_q: causal LMs with the same vocabulary size.
        input_ids: a list of id lists (any lengths) or a 2-D tensor.
        attention_mask: for a tensor ``input_ids``, which positions count (default: all).

    Returns:
        The mean KL (>= 0; 0 for identical models).
    """
    rows = _as_id_lists(input_ids)
    if attention_mask is not None:
        if not isinstance(input_ids, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError("attention_mask must be a tensor of input_ids' shape (and input_ids a tensor).")
        rows = [[t for t, m in zip(r, mrow.tolist()) if m] for r, mrow in zip(rows, attention_mask)]
    if not rows or not any(rows):
        raise ValueError("kl_divergence got no tokens.")
    dev_p, dev_q = _device(model_p), _device(model_q)
    total, count = 0.0, 0
    with _eval_mode(model_p, model_q):
        for start in range(0, len(rows), batch_size):
            ids, mask = _pad(rows[start : start + batch_size], dev_p)
            logp = F.log_softmax(_logits(model_p, ids, mask), dim=-1)
            logq = F.log_softmax(_logits(model_q, ids.to(dev_q), mask.to(dev_q)), dim=-1).to(dev_p)
            if logp.shape != logq.shape:
                raise ValueError(
                    f"kl_divergence: the models' logits differ in shape ({tuple(logp.shape)} vs "
                    f"{tuple(logq.shape)}): compare models with the same vocabulary."
                )
            kl = (logp.exp() * (logp - logq)).sum(-1)
            keep = mask.bool()
            total += float(kl[keep].double().sum())
            count += int(keep.sum())
    return max(total / count, 0.0)


def gain_kept(score_compressed: float, score_base: float, score_finetune: float) -> float:
    """Share of the fine-tune's gain over the base that the compressed copy keeps.

    ``(c - b) / (f - b)``: 1 means as good as the fine-tune, 0 as good as the base; it can leave
    [0, 1]. Scores must be higher-is-better: pass ``-nll`` for an NLL.

    Raises:
        ValueError: ``score_finetune == score_base`` (no gain to keep), or a score is not finite.
    """
    c, b, f = float(score_compressed), float(score_base), float(score_finetune)
    if not all(math.isfinite(x) for x in (c, b, f)):
        raise ValueError(f"gain_kept needs finite scores, got compressed={c}, base={b}, finetune={f}.")
    if f == b:
        raise ValueError(
            f"gain_kept is undefined: the fine-tune scores the same as the base ({f}). "
            "Use a task on which the fine-tune beats its base."
        )
    return (c - b) / (f - b)
