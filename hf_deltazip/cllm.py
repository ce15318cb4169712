"""Consistency deltas: train a fine-tune to decode fast with Jacobi decoding, and ship it as a delta.

The recipe of consistency LLMs (CLLMs), on a fine-tune's own prompts:

1. :func:`collect_trajectories` - Jacobi-decode every prompt with the fine-tune and keep every block fed
   (the states of the Jacobi iteration) and the final output (the fixed point, i.e. the greedy output).
2. :func:`train_consistency` - train a full-parameter copy of the fine-tune with
   *consistency loss*: at every position of a recorded block, predict the fixed-point token, even though the
   guesses before it in the block were wrong (so later Jacobi steps accept more tokens), plus the
   *autoregressive loss* on prompt + fixed point (so the output, the task, stays what it was).
3. :func:`consistency_delta` - all of it, then compress the trained model as a delta over the fine-tune's
   base (:func:`hf_deltazip.compress`), and report tokens accepted per forward (before, after, and
   through the compressed delta) and how much of the fine-tune's gain over the base each keeps.

Example:
    >>> from hf_deltazip.cllm import ConsistencyConfig, consistency_delta
    >>> report = consistency_delta(base, finetune, prompts, eval_ids=held_out, config=ConsistencyConfig(steps=300))
    >>> report.delta.save_pretrained("ft-cllm-delta")
    >>> print(report.summary())
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import DeltaZipConfig
from .decoding import jacobi_generate
from .errors import DeltaZipError

__all__ = ["ConsistencyConfig", "Trajectory", "ConsistencyReport", "collect_trajectories", "train_consistency",
           "tokens_per_forward", "mean_nll", "consistency_delta"]


@dataclass
class ConsistencyConfig:
    """Settings of the consistency recipe.

    Attributes:
        block_size: Jacobi block the trajectories are collected with (and the model is trained for).
        max_new_tokens: tokens generated per prompt.
        steps: optimizer steps.
        batch_size: consistency examples per step (and as many autoregressive ones).
        lr: AdamW learning rate (the peak, with a schedule).
        lr_schedule: ``"cosine"``: down to zero at the last step along a half cosine, so the weights the run
            ends with are not those of one large late step; or ``"constant"``.
        warmup_steps: steps of linear warm-up from zero before the schedule (0: none; ``None``, the default:
            a tenth of ``steps``).
        weight_decay: AdamW weight decay.
        consistency_weight: weight of the consistency loss.
        ar_weight: weight of the autoregressive loss.
        ar_loss: ``"labels"``: cross-entropy on the fine-tune's greedy output (the fixed points); ``"distill"``:
            KL divergence from the fine-tune's own next-token distribution at the same positions, which
            carries the whole distribution rather than its argmax (one extra forward of the fine-tune, no
            gradient, per step).
        seed: sampling of the examples.

    The defaults are the recipe measured on a real pair (BENCHMARKS.md section 9: 200 steps of 16 at a peak of
    2e-5, cosine, 20 warm-up steps, on 96 of the task's prompts kept the whole exact-match gain in three runs
    out of three). With a third as many prompts it overfit them, and one run in three lost a tenth of the gain:
    give it about a hundred prompts.
    """

    block_size: int = 16
    max_new_tokens: int = 64
    steps: int = 200
    batch_size: int = 16
    lr: float = 2e-5
    lr_schedule: str = "cosine"
    warmup_steps: Optional[int] = None
    weight_decay: float = 0.0
    consistency_weight: float = 1.0
    ar_weight: float = 1.0
    ar_loss: str = "labels"
    seed: int = 0

    def __post_init__(self):
        for name in ("block_size", "max_new_tokens", "steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DeltaZipError(f"ConsistencyConfig.{name} must be an integer >= 1, got {value!r}")
        if self.ar_loss not in ("labels", "distill"):
            raise DeltaZipError(f"ConsistencyConfig.ar_loss must be 'labels' or 'distill', got {self.ar_loss!r}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise DeltaZipError(f"ConsistencyConfig.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.warmup_steps is None:
            self.warmup_steps = self.steps // 10
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise DeltaZipError(f"ConsistencyConfig.warmup_steps must be an integer in [0, steps), got "
                                f"{self.warmup_steps!r} with steps={self.steps}")
        if self.block_size < 2:
            raise DeltaZipError("ConsistencyConfig.block_size must be >= 2: a block of 1 has no guesses to train on")


@dataclass
class Trajectory:
    """One prompt's Jacobi iteration: ``blocks`` are ``(start, block)`` pairs, the block fed when
    ``output[:start]`` had been generated (``block[0] == output[start]``); ``output`` is the fixed point."""

    prompt: list
    output: list
    blocks: list = field(default_factory=list)


def _id_rows(prompts) -> list:
    if torch.is_tensor(prompts):
        if prompts.dim() != 2:
            raise DeltaZipError("prompts must be a [n, length] tensor or a list of token-id lists")
        return [list(map(int, r)) for r in prompts.tolist()]
    rows = [list(map(int, r.tolist() if torch.is_tensor(r) else r)) for r in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise DeltaZipError("prompts must be a non-empty list of non-empty token-id lists")
    return rows


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def collect_trajectories(model, prompts, *, block_size: int = 16, max_new_tokens: int = 64, **generate_kwargs) -> list:
    """Jacobi-decode each prompt (one at a time, never falling back to greedy) and keep its trajectory.

    Args:
        model: the fine-tune (a transformers causal LM).
        prompts: token-id lists (or a ``[n, length]`` tensor), without padding.
        block_size, max_new_tokens: of the Jacobi decode.
        generate_kwargs: ``eos_token_id``, ``pad_token_id``, ``generation_config``.

    Returns:
        One :class:`Trajectory` per prompt.
    """
    was_training = model.training
    model.eval()
    out = []
    for prompt in _id_rows(prompts):
        ids = torch.tensor([prompt], device=_device(model))
        res = jacobi_generate(model, ids, block_size=block_size, max_new_tokens=max_new_tokens, min_accept=None,
                              return_dict_in_generate=True, record_trajectories=True, **generate_kwargs)
        output = res.sequences[0, len(prompt):len(prompt) + res.stats.new_tokens[0]].tolist()
        out.append(Trajectory(prompt, output, [(start, block) for _, start, block in res.stats.trajectories]))
    model.train(was_training)
    return out


def _examples(trajectories: Sequence[Trajectory]) -> tuple:
    """(consistency examples, autoregressive examples): each ``(ids, labels)`` lists, -100 = no loss."""
    consistency, ar = [], []
    for t in trajectories:
        ar.append((t.prompt + t.output, [-100] * (len(t.prompt) - 1) + t.output + [-100]))
        for start, block in t.blocks:
            targets = t.output[start + 1:start + 1 + len(block)]
            if not targets:
                continue
            ids = t.prompt + t.output[:start] + list(block)
            labels = [-100] * (len(ids) - len(block)) + targets + [-100] * (len(block) - len(targets))
            consistency.append((ids, labels))
    return consistency, ar


def _batch(examples: list, device, pad: int) -> tuple:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, (i, lab) in enumerate(examples):
        ids[r, :len(i)] = torch.tensor(i)
        labels[r, :len(lab)] = torch.tensor(lab)
        mask[r, :len(i)] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def _loss(model, examples: list, pad: int) -> torch.Tensor:
    """Cross-entropy where the label at position i is the token the model should give *at* i."""
    ids, labels, mask = _batch(examples, _device(model), pad)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _distill_loss(student, teacher, examples: list, pad: int) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at the positions that carry a label."""
    ids, labels, mask = _batch(examples, _device(student), pad)
    where = labels != -100
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[where].float(), dim=-1)
    logp = F.log_softmax(student(input_ids=ids, attention_mask=mask).logits[where].float(), dim=-1)
    return F.kl_div(logp, target, log_target=True, reduction="batchmean")


def train_consistency(model: nn.Module, trajectories: Sequence[Trajectory], config: Optional[ConsistencyConfig] = None,
                      *, pad_token_id: int = 0, log=None) -> nn.Module:
    """Train a copy of ``model`` (all parameters) with the consistency loss plus the autoregressive loss.

    Args:
        model: the fine-tune the trajectories came from (left unchanged).
        trajectories: from :func:`collect_trajectories`.
        config: :class:`ConsistencyConfig` (steps, batch size, learning rate, loss weights).
        pad_token_id: the id right-padding uses (it never gets a loss).
        log: called as ``log(step, consistency_loss, ar_loss)`` every tenth of the run.

    Returns:
        The trained copy, in eval mode.
    """
    config = config or ConsistencyConfig()
    consistency, ar = _examples(trajectories)
    if not consistency:
        raise DeltaZipError("the trajectories hold no Jacobi block to learn from: generate more tokens per prompt "
                            "(ConsistencyConfig.max_new_tokens) or use more prompts")
    student = copy.deepcopy(model).train()
    teacher_was_training = model.training
    model.eval()  # the teacher of ar_loss="distill": its distribution without dropout
    opt = torch.optim.AdamW(student.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(config, step))
    rng = random.Random(config.seed)
    every = max(1, config.steps // 10)
    try:
        for step in range(config.steps):
            c_loss = _loss(student, rng.sample(consistency, min(config.batch_size, len(consistency))), pad_token_id)
            ar_batch = rng.sample(ar, min(config.batch_size, len(ar)))
            a_loss = (_distill_loss(student, model, ar_batch, pad_token_id) if config.ar_loss == "distill"
                      else _loss(student, ar_batch, pad_token_id))
            loss = config.consistency_weight * c_loss + config.ar_weight * a_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            if log is not None and (step % every == 0 or step == config.steps - 1):
                log(step, c_loss.item(), a_loss.item())
    finally:
        model.train(teacher_was_training)
    return student.eval()


def lr_factor(config: ConsistencyConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``config.lr``."""
    w = config.warmup_steps
    if step < w:
        return (step + 1) / (w + 1)
    if config.lr_schedule == "constant":
        return 1.0
    # cosine: 1 at the first step after warm-up, falling to 0.5 * (1 - cos(pi / n)) ~ 0 at the last one
    n = config.steps - w
    return 0.5 * (1.0 + math.cos(math.pi * (step - w + 1) / (n + 1)))


def tokens_per_forward(model, prompts, *, block_size: int = 16, max_new_tokens: int = 64, **generate_kwargs) -> float:
    """Mean tokens accepted per forward pass when Jacobi-decoding each prompt alone (no greedy fallback).

    ``model`` may be a causal LM or a :class:`~hf_deltazip.DeltaModel` (its active delta is used)."""
    device = _device(model)
    rates = []
    for prompt in _id_rows(prompts):
        ids = torch.tensor([prompt], device=device)
        res = model.generate(ids, decoding="jacobi", jacobi_block_size=block_size, max_new_tokens=max_new_tokens,
                             min_accept=None, return_dict_in_generate=True, **generate_kwargs) \
            if hasattr(model, "add_delta") else \
            jacobi_generate(model, ids, block_size=block_size, max_new_tokens=max_new_tokens, min_accept=None,
                            return_dict_in_generate=True, **generate_kwargs)
        rates.append(res.stats.tokens_per_forward)
    return sum(rates) / len(rates)


@torch.no_grad()
def mean_nll(model, sequences, *, batch_size: int = 8) -> float:
    """Mean negative log-likelihood per predicted token (nats) of token-id sequences, pooled."""
    rows = [r for r in _id_rows(sequences) if len(r) > 1]
    if not rows:
        raise DeltaZipError("mean_nll needs sequences of at least 2 tokens")
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        examples = [(r, r[1:] + [-100]) for r in chunk]
        n = sum(len(r) - 1 for r in chunk)
        total += float(_loss(model, examples, 0)) * n
        count += n
    return total / count


@dataclass
class ConsistencyReport:
    """What :func:`consistency_delta` made and measured.

    ``tpf_*``: tokens accepted per forward on the training prompts (Jacobi, no fallback) for the fine-tune,
    the consistency-trained model and the compressed consistency delta on the base. ``nll_*``: mean token NLL on
    the evaluation sequences; ``gain_kept*``: ``(nll_base - nll_x) / (nll_base - nll_finetune)``.
    """

    model: nn.Module
    delta: object
    tpf_finetune: float
    tpf_consistency: float
    tpf_delta: float
    nll_base: Optional[float] = None
    nll_finetune: Optional[float] = None
    nll_consistency: Optional[float] = None
    nll_delta: Optional[float] = None
    agreement: float = 0.0
    seconds: dict = field(default_factory=dict)

    def _gain(self, nll) -> Optional[float]:
        if None in (nll, self.nll_base, self.nll_finetune) or self.nll_base == self.nll_finetune:
            return None
        return (self.nll_base - nll) / (self.nll_base - self.nll_finetune)

    @property
    def gain_kept(self) -> Optional[float]:
        """Share of the fine-tune's gain the consistency-trained model keeps (uncompressed)."""
        return self._gain(self.nll_consistency)

    @property
    def gain_kept_delta(self) -> Optional[float]:
        """Share of the fine-tune's gain the compressed consistency delta keeps."""
        return self._gain(self.nll_delta)

    def as_dict(self) -> dict:
        keys = ("tpf_finetune", "tpf_consistency", "tpf_delta", "nll_base", "nll_finetune", "nll_consistency",
                "nll_delta", "agreement", "seconds")
        return {k: getattr(self, k) for k in keys} | {"gain_kept": self.gain_kept, "gain_kept_delta": self.gain_kept_delta}

    def summary(self) -> str:
        def pct(x):
            return "n/a" if x is None else f"{100 * x:.1f} %"

        return (f"tokens per forward: fine-tune {self.tpf_finetune:.2f}, consistency model {self.tpf_consistency:.2f}, "
                f"consistency delta {self.tpf_delta:.2f}\n"
                f"greedy agreement with the fine-tune on the training prompts: {100 * self.agreement:.1f} %\n"
                f"gain kept: consistency model {pct(self.gain_kept)}, consistency delta {pct(self.gain_kept_delta)}")


def _agreement(model, trajectories, block_size: int, generate_kwargs: dict) -> float:
    same = total = 0
    for t in trajectories:
        ids = torch.tensor([t.prompt], device=_device(model))
        out = jacobi_generate(model, ids, block_size=block_size, max_new_tokens=len(t.output), **generate_kwargs)
        new = out[0, len(t.prompt):].tolist()
        same += sum(a == b for a, b in zip(new, t.output))
        total += len(t.output)
    return same / max(total, 1)


def consistency_delta(
    base: nn.Module,
    finetune: nn.Module,
    prompts,
    *,
    eval_ids=None,
    config: Optional[ConsistencyConfig] = None,
    delta_config: Optional[DeltaZipConfig] = None,
    calibration=None,
    output_dir=None,
    log=None,
    **generate_kwargs,
) -> ConsistencyReport:
    """The whole recipe: trajectories, consistency training, compression as a delta over ``base``, report.

    Args:
        base: the base model the fine-tune was made from.
        finetune: the fine-tune (left unchanged).
        prompts: the fine-tune's own prompts (token-id lists) to collect trajectories on.
        eval_ids: held-out token-id sequences of the fine-tune's domain, for the gain kept (optional).
        config: :class:`ConsistencyConfig`.
        delta_config: how to compress (default ``DeltaZipConfig(bits=4)``).
        calibration: calibration data for :func:`hf_deltazip.compress` (default: the trajectories'
            prompt + output sequences).
        output_dir: if given, the trained model goes to ``output_dir/model`` and the delta to ``output_dir/delta``.
        log: called with progress lines.
        generate_kwargs: ``eos_token_id``, ``pad_token_id`` for decoding.
    """
    from .compression import compress
    from .modeling import DeltaModel

    config = config or ConsistencyConfig()
    say = log or (lambda *_: None)
    seconds = {}
    t0 = time.perf_counter()
    trajectories = collect_trajectories(finetune, prompts, block_size=config.block_size,
                                        max_new_tokens=config.max_new_tokens, **generate_kwargs)
    seconds["trajectories"] = time.perf_counter() - t0
    say(f"collected {sum(len(t.blocks) for t in trajectories)} Jacobi states from {len(trajectories)} prompts")
    t0 = time.perf_counter()
    pad = generate_kwargs.get("pad_token_id")
    student = train_consistency(finetune, trajectories, config, pad_token_id=0 if pad is None else pad,
                                log=lambda s, c, a: say(f"step {s}: consistency loss {c:.4f}, AR loss {a:.4f}"))
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    calib = calibration if calibration is not None else [t.prompt + t.output for t in trajectories]
    delta = compress(base, student, delta_config or DeltaZipConfig(bits=4), calibration=calib, progress=False)
    seconds["compress"] = time.perf_counter() - t0
    if output_dir is not None:
        out = Path(output_dir)
        student.save_pretrained(out / "model")
        delta.save_pretrained(out / "delta")
    t0 = time.perf_counter()
    dm = DeltaModel(copy.deepcopy(base))
    dm.add_delta(delta, "consistency")
    dm.set_delta("consistency")
    rows = [t.prompt for t in trajectories]
    measure = dict(block_size=config.block_size, max_new_tokens=config.max_new_tokens, **generate_kwargs)
    report = ConsistencyReport(
        model=student, delta=delta,
        tpf_finetune=tokens_per_forward(finetune, rows, **measure),
        tpf_consistency=tokens_per_forward(student, rows, **measure),
        tpf_delta=tokens_per_forward(dm, rows, **measure),
        agreement=_agreement(student, trajectories, config.block_size, generate_kwargs),
        seconds=seconds,
    )
    if eval_ids is not None:
        report.nll_base = mean_nll(base, eval_ids)
        report.nll_finetune = mean_nll(finetune, eval_ids)
        report.nll_consistency = mean_nll(student, eval_ids)
        report.nll_delta = mean_nll(dm, eval_ids)
    seconds["measure"] = time.perf_counter() - t0
    return report
