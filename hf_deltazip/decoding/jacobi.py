"""Jacobi decoding: greedy output, several tokens per forward pass.

Greedy decoding is a fixed point: token ``t+1`` is the argmax of the model given tokens ``<= t``. Jacobi
decoding guesses the next ``n - 1`` tokens, runs *one* forward pass over the block
``[last accepted token, guess_1, ..., guess_{n-1}]`` and takes the argmax at every position. Every guess
that equals the argmax before it is what greedy would have produced, so the longest such prefix is
accepted, plus the one new token the model gives right after it (so a step never makes less progress
than a greedy step). The argmaxes after the accepted prefix become the next step's guesses (the Jacobi
iteration). The output is the greedy output token for token; a model trained for it (a *consistency*
model, :mod:`hf_deltazip.cllm`) accepts many tokens per step.

**Cache.** The key/value entries of rejected positions are dropped after every step (the cache is cut
back to the last accepted position). The rows of a batch accept different numbers of tokens but share
one cache length: the cache is cut to the shortest row, and the tokens another row accepted beyond it
are fed again at the head of that row's next block (they are known, so they cost block room, not
correctness). No holes are left in the cache, so positions, padding and sliding windows stay what
greedy decoding sees. A batch therefore advances at about the pace of its slowest unfinished row.

**Falling back to greedy.** A Jacobi step is one forward over ``n`` tokens per row. On a GPU that costs
about what a one-token step costs while the model is memory-bound, but not on a CPU, at large batch, or
where one-token steps replay a CUDA graph and wide ones do not. :class:`JacobiGate` decides: it times
each kind of step and, after every two Jacobi steps, compares their mean tokens per forward (over the
rows unfinished before the step; a row that ends inside the block counts the tokens it matched, not the
fewer it kept, so short answers do not read as poor convergence) with
``max(min_accept, wide step time / one-token step time)``.
Below it, the decoder runs plain greedy steps (one token per row, or the re-fed tokens) for ``backoff``
steps, then probes with one Jacobi step, judged with the one before it; each failed probe doubles
``backoff`` (from 4; quadruples it when the two steps accepted no guess at all), and ``backoff`` is at least what keeps the probes' extra time within 2 % of the
greedy steps between them (64 at most when the two kinds of step cost the same, 1024 at most in any
case). Step costs are medians of the last 9 steps of each kind, so a compile or a graph capture
inside one step does not count. A successful probe resets ``backoff``. ``min_accept=None`` never
falls back.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..errors import DeltaZipError
from .scope import sparsify_positions_from

__all__ = ["jacobi_generate", "JacobiOutput", "JacobiStats", "JacobiGate"]

# generate() options that mean something else than greedy decoding
_SAMPLING = ("do_sample", "num_beams", "num_return_sequences", "temperature", "top_k", "top_p", "penalty_alpha")


class JacobiGate:
    """Whether the next decode step should be a wide Jacobi step (see the module docstring).

    Call :meth:`wide` before each step and :meth:`record` after it, with the step's wall time (taken
    after the tokens were read back, so the device work is in it) and, for a Jacobi step, the mean
    number of tokens its rows accepted.

    Args:
        min_accept: tokens per Jacobi forward under which the decoder falls back for a while
            (``None``: never fall back).
        probe_budget: the probes' extra time (over one-token steps) as a share of the one-token steps
            between two probes, at most.
    """

    FIRST_BACKOFF, MAX_BACKOFF, WINDOW = 4, 64, 2  # WINDOW: Jacobi steps whose mean acceptance decides
    #: step times kept per kind; their median is the kind's cost once there are MIN_SAMPLES (a compile
    #: or a graph capture inside one step does not move a median)
    SAMPLES, MIN_SAMPLES = 9, 3
    LONGEST_WAIT = 1024  # one-token steps between probes, at most

    def __init__(self, min_accept: Optional[float] = 1.5, probe_budget: float = 0.02):
        self.min_accept = min_accept
        self.probe_budget = probe_budget
        self.backoff = self.FIRST_BACKOFF
        self.wait = 0  # one-token steps left before the next probe
        self.recent: deque = deque(maxlen=self.WINDOW)  # tokens per forward of the last Jacobi steps
        # the last step times of each kind: wide, one-token
        self.times = {True: deque(maxlen=self.SAMPLES), False: deque(maxlen=self.SAMPLES)}

    def cost(self, wide: bool) -> Optional[float]:
        """Median time of the last steps of one kind (``None`` until there are enough of them)."""
        t = sorted(self.times[wide])
        return t[len(t) // 2] if len(t) >= self.MIN_SAMPLES else None

    def wide(self) -> bool:
        """Whether the coming step should be a Jacobi step (a False counts down the wait)."""
        if self.min_accept is None:  # never falls back, whatever an earlier setting left waiting
            return True
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def threshold(self) -> Optional[float]:
        """Tokens per Jacobi forward that pay for a wide step: ``max(min_accept, wide / one-token time)``."""
        if self.min_accept is None:
            return None
        wide, narrow = self.cost(True), self.cost(False)
        return max(self.min_accept, wide / narrow) if wide and narrow else self.min_accept

    def record(self, wide: bool, seconds: float, accepted: Optional[float] = None) -> None:
        """Account for one finished step: its kind, wall time and (Jacobi) mean accepted tokens per row."""
        self.times[wide].append(seconds)
        if not wide or accepted is None or self.min_accept is None:
            return
        # kept across fallbacks: a probe is one Jacobi step, judged together with the one before it
        self.recent.append(accepted)
        if len(self.recent) < self.WINDOW:
            return
        mean = sum(self.recent) / self.WINDOW
        if mean < self.threshold():
            self.wait = self.backoff
            # not one guess accepted (only the token every step gains): the model shows no sign of
            # converging, so the wait grows four times as fast
            self.backoff = self._next_backoff(4 if mean <= 1.0 else 2)
        else:
            self.backoff = self.FIRST_BACKOFF

    def _next_backoff(self, factor: int = 2) -> int:
        nxt = min(factor * self.backoff, self.MAX_BACKOFF)
        wide, narrow = self.cost(True), self.cost(False)
        if wide and narrow and wide > narrow:  # keep the next probe's extra time within the budget
            nxt = max(nxt, math.ceil((wide - narrow) / (self.probe_budget * narrow)))
        return min(nxt, self.LONGEST_WAIT)


@dataclass
class JacobiStats:
    """What a Jacobi decode did.

    Attributes:
        forwards: forward passes after the prompt's (Jacobi and greedy steps).
        jacobi_forwards: of those, the wide Jacobi steps.
        new_tokens: tokens generated per row (up to and including end-of-sequence).
        row_forwards: forward passes each row was unfinished for.
        trajectories: with ``record_trajectories=True``, one ``(row, start, block)`` per row and Jacobi
            step: the block fed, whose first token is the row's generated token number ``start``.
        step_accepts: one entry per forward after the prompt's: ``None`` for a one-token step, else the
            mean tokens per row the Jacobi step matched (what :class:`JacobiGate` judged it by).
    """

    forwards: int = 0
    jacobi_forwards: int = 0
    new_tokens: list = field(default_factory=list)
    row_forwards: list = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    step_accepts: list = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        """Mean over rows of new tokens per forward pass (the prompt's forward, which gives the first
        token, counts as one, as in greedy decoding)."""
        per_row = [n / (f + 1) for n, f in zip(self.new_tokens, self.row_forwards) if n]
        return sum(per_row) / len(per_row) if per_row else 0.0


@dataclass
class JacobiOutput:
    """``sequences``: ``[batch, prompt + new]`` ids as ``generate`` returns them; ``stats``: :class:`JacobiStats`."""

    sequences: torch.Tensor
    stats: JacobiStats


def _as_list(x) -> list:
    if x is None:
        return []
    if torch.is_tensor(x):
        return [int(v) for v in x.flatten().tolist()]
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _settings(model, input_len: int, generation_config, max_new_tokens, max_length, eos_token_id, pad_token_id):
    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if max_new_tokens is None and max_length is None and gc is not None:
        max_new_tokens = getattr(gc, "max_new_tokens", None)
        max_length = getattr(gc, "max_length", None)
    if max_new_tokens is None:
        max_new_tokens = (max_length if max_length is not None else 20) - input_len
    if max_new_tokens < 1:
        raise DeltaZipError(f"nothing to generate: max_new_tokens={max_new_tokens} (the prompt has {input_len} "
                            "tokens); pass max_new_tokens=N")
    eos = _as_list(eos_token_id if eos_token_id is not None else getattr(gc, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(gc, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(max_new_tokens), set(eos), int(_as_list(pad)[0])


def _check_greedy(kwargs: dict) -> None:
    for key in _SAMPLING:
        value = kwargs.pop(key, None)
        if key == "do_sample" and value:
            raise DeltaZipError("jacobi decoding is greedy: do_sample=True is not supported; drop decoding='jacobi' to sample")
        if key in ("num_beams", "num_return_sequences") and value not in (None, 1):
            raise DeltaZipError(f"jacobi decoding is greedy with one sequence per row: {key}={value} is not supported")
    for key in ("past_key_values", "cache"):
        if key in kwargs:
            raise DeltaZipError(f"jacobi decoding manages its own cache (it drops rejected positions): do not pass {key}")
    if kwargs:
        raise DeltaZipError(f"jacobi decoding does not support {sorted(kwargs)}; it takes input_ids, attention_mask, "
                            "max_new_tokens, max_length, eos_token_id, pad_token_id and generation_config")


def _truncate_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer of a DynamicCache (full-attention layers)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4 and keys.shape[-2] > length:
            layer.keys = keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def _new_cache():
    from transformers import DynamicCache

    # full-attention layers everywhere (no config): a sliding-window layer drops old entries and cannot be
    # cut back; the model's mask still applies its windows.
    return DynamicCache()


def _forward_kwargs(model) -> set:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class _Rows:
    """Per-row host state: generated tokens, tokens accepted but not yet in the cache, next guesses."""

    def __init__(self, first: list, max_new: int, eos: set):
        self.max_new, self.eos = max_new, eos
        self.generated = [[] for _ in first]
        self.done = [False] * len(first)
        self.pending = [[] for _ in first]
        self.guesses = [[] for _ in first]
        for r, t in enumerate(first):
            self.pending[r] = [t]
            self.append(r, [t])

    def append(self, r: int, tokens: list) -> None:
        for t in tokens:
            if self.done[r]:
                return
            self.generated[r].append(t)
            if t in self.eos or len(self.generated[r]) >= self.max_new:
                self.done[r] = True

    def active(self) -> list:
        return [r for r, d in enumerate(self.done) if not d]

    def block(self, r: int, width: int, pad: int) -> list:
        if self.done[r]:
            return [pad] * width
        head = self.pending[r]
        fill = self.guesses[r][: width - len(head)]
        filler = fill[-1] if fill else head[-1]
        return head + fill + [filler] * (width - len(head) - len(fill))


@torch.no_grad()
def jacobi_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    block_size: int = 16,
    max_new_tokens: Optional[int] = None,
    max_length: Optional[int] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    generation_config=None,
    min_accept: Optional[float] = 1.5,
    gate: Optional[JacobiGate] = None,
    return_dict_in_generate: bool = False,
    record_trajectories: bool = False,
    **kwargs,
) -> Union[torch.Tensor, JacobiOutput]:
    """Greedy decoding of a transformers causal LM by Jacobi iteration (see the module docstring).

    Args:
        model: a causal LM (``AutoModelForCausalLM``), or the base model inside a routed
            :class:`~hf_deltazip.DeltaModel` (use ``DeltaModel.generate(..., decoding="jacobi")``).
        input_ids: ``[batch, prompt]`` token ids; several rows are left-padded, as for ``generate``.
        attention_mask: ``[batch, prompt]``, 0 on padding (default: all ones).
        block_size: tokens per row in one Jacobi forward (the last accepted one and ``block_size - 1``
            guesses); 1 is plain greedy decoding.
        max_new_tokens, max_length, eos_token_id, pad_token_id, generation_config: as for ``generate``
            (defaults from ``model.generation_config``).
        min_accept: tokens per forward under which the decoder falls back to greedy steps for a while;
            it also falls back while a wide step costs more than that many one-token steps (see
            :class:`JacobiGate`). ``None``: never.
        gate: a :class:`JacobiGate` carried over from earlier calls (its own ``min_accept`` then applies;
            the ``min_accept`` argument is not used): what it learned about this model's acceptance and step
            costs decides from the first step. ``None``: a fresh gate for this call.
        return_dict_in_generate: return a :class:`JacobiOutput` (ids and :class:`JacobiStats`).
        record_trajectories: keep every Jacobi block fed in ``stats.trajectories`` (for consistency training).

    Returns:
        ``[batch, prompt + new]`` ids, rows that ended early padded with ``pad_token_id``: exactly what
        ``model.generate(input_ids, attention_mask=..., do_sample=False)`` returns.

    Raises:
        DeltaZipError: sampling, beam search or another unsupported ``generate`` option; a bad block size.
    """
    _check_greedy(kwargs)
    if not isinstance(block_size, int) or block_size < 1:
        raise DeltaZipError(f"jacobi_block_size must be an integer >= 1, got {block_size!r}")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise DeltaZipError("jacobi decoding takes input_ids as a [batch, length] tensor")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise DeltaZipError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if bool((attention_mask[:, -1] == 0).any()):
        raise DeltaZipError("jacobi decoding needs left padding (the last prompt position of every row must be a "
                            "real token): set tokenizer.padding_side = 'left'")
    max_new, eos, pad = _settings(model, input_ids.shape[1], generation_config, max_new_tokens, max_length,
                                  eos_token_id, pad_token_id)
    device = input_ids.device
    batch = input_ids.shape[0]
    mask = attention_mask.to(device=device, dtype=torch.long)
    cache = _new_cache()
    params = _forward_kwargs(model)
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    prefill = dict(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   use_cache=True, **{cache_arg: cache})
    if "logits_to_keep" in params:
        prefill["logits_to_keep"] = 1
    first = model(**prefill).logits[:, -1].argmax(-1).tolist()
    rows = _Rows(first, max_new, eos)
    stats = JacobiStats(new_tokens=[0] * batch, row_forwards=[0] * batch)
    real = mask.sum(-1)  # real tokens in the cache per row (the next position id)
    if gate is None:
        gate = JacobiGate(min_accept)
    elif not isinstance(gate, JacobiGate):
        raise DeltaZipError(f"gate must be a JacobiGate (or None for a fresh one), got {type(gate).__name__}")

    while rows.active():
        active = rows.active()
        longest_head = max(len(rows.pending[r]) for r in active)
        jacobi = block_size > 1 and gate.wide()
        t0 = time.perf_counter()
        width = max(block_size, longest_head) if jacobi else longest_head
        blocks = [rows.block(r, width, pad) for r in range(batch)]
        ids = torch.tensor(blocks, dtype=torch.long, device=device)
        mask = torch.cat([mask, torch.ones(batch, width, dtype=torch.long, device=device)], dim=1)
        positions = real[:, None] + torch.arange(width, device=device)
        with sparsify_positions_from(0):  # decode steps, however wide: decode-only activation sparsity applies
            pred = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{cache_arg: cache}).logits.argmax(-1).tolist()
        seconds = time.perf_counter() - t0  # the read-back waited for the device
        stats.forwards += 1
        stats.jacobi_forwards += int(jacobi)

        valid, matched = {}, []
        for r in active:
            block, head = blocks[r], len(rows.pending[r])
            if record_trajectories and jacobi:
                stats.trajectories.append((r, len(rows.generated[r]) - head, list(block)))
            m = 0
            while head + m < width and block[head + m] == pred[r][head - 1 + m]:
                m += 1
            new = pred[r][head - 1 + m]
            rows.append(r, block[head:head + m] + [new])
            # what the step gave this row before end-of-sequence or max_new_tokens cut it: a row that
            # finishes two tokens into a block converged no worse than one that goes on
            matched.append(m + 1)
            stats.row_forwards[r] += 1
            valid[r] = head + m
            rows.guesses[r] = pred[r][head + m:]
            rows.pending[r] = block[:head + m] + [new]  # cut below, once the shared length is known
        still = [r for r in active if not rows.done[r]]
        keep = min((valid[r] for r in still), default=width)
        for r in still:
            rows.pending[r] = rows.pending[r][keep:]
        _truncate_cache(cache, mask.shape[1] - width + keep)
        mask = mask[:, : mask.shape[1] - width + keep]
        real = real + keep

        accepts = sum(matched) / len(matched) if jacobi else None
        stats.step_accepts.append(accepts)
        gate.record(jacobi, seconds, accepts)

    stats.new_tokens = [len(g) for g in rows.generated]
    width = max(stats.new_tokens)
    out = torch.full((batch, width), pad, dtype=input_ids.dtype, device=device)
    for r, g in enumerate(rows.generated):
        out[r, : len(g)] = torch.tensor(g, dtype=input_ids.dtype, device=device)
    sequences = torch.cat([input_ids, out], dim=1)
    return JacobiOutput(sequences, stats) if return_dict_in_generate else sequences
