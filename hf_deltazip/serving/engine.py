"""`DecodeEngine`: a static-KV-cache decoder for continuous batching, with CUDA-graph decode steps.

The engine owns ``max_batch_size`` rows. :meth:`DecodeEngine.add` admits requests into free rows at
any time (one batched prefill; each row's first token comes out of it) and :meth:`DecodeEngine.step`
decodes one token for every active row. Rows finish on their own (``max_new_tokens`` or an
end-of-sequence token) and their row is free for the next request: continuous batching. With a
:class:`~hf_deltazip.DeltaModel` every row may use a different delta.

How it stays static (so one captured CUDA graph, per kernel route, serves every step):

* **KV cache**: per layer one ``[rows, kv_heads, max_length, head_dim]`` tensor. Every decode step
  writes all rows' new keys at one shared index (the write pointer) and each row sees its own
  entries through a per-row additive mask; a new request's prompt is placed just before the pointer.
  When the pointer reaches ``max_length`` the cache is shifted left past entries no row needs.
* **Inputs**: token ids, position ids (per row), the mask, the write pointer and the per-row delta
  slots live in fixed device buffers that are updated in place between steps.
* **Deltas**: the multi-delta kernel reads each row's slot on the device, and kernel stacks keep room
  for more deltas, so loading or evicting a delta changes table entries, not tensors. A change the
  stacks cannot absorb (a new format, a full stack) bumps the model's layout version and the step is
  captured again before its next replay.
* **Routes**: with ``KernelPolicy.decode="auto"`` (the default) a step whose rows carry many distinct
  deltas runs the split route (the base by one dense matmul, the deltas by the Gluon kernel) and other
  steps the fused kernel; the host knows each step's deltas, so the engine keeps one graph per route
  and replays the one the step needs (``stats.split_steps`` counts the split ones).

On a CPU, or for models whose deltas cannot run in a captured step (fine-tunes that add tokens or
replace norms), steps run eagerly with the same cache. Prefill always runs eagerly.

Where the time goes: :attr:`DecodeEngine.stats` (an :class:`EngineStats`) splits the engine's wall
time into prefill, waiting for deltas to become resident, and decode steps, with the share of decode
row-steps that were idle, the mean number of distinct deltas per step, and bytes read per step against
the floor the step cannot go below.

Admission: :meth:`DecodeEngine.pick` chooses which waiting requests to admit (see
:class:`AdmissionPolicy` for the fairness rule), and ``max_deltas="auto"`` (the default) caps the
distinct deltas per step from measured step costs.

Example:
    >>> engine = DecodeEngine(model, max_batch_size=16, max_length=512)
    >>> handles = engine.add([ids_a, ids_b], ["chat", None], max_new_tokens=32)
    >>> while engine.active:
    ...     for handle, tokens in engine.step():
    ...         print(handle, tokens)
"""

from __future__ import annotations

import inspect
import math
import threading
import time
import warnings
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..errors import DeltaZipError
from ..modeling.cache import Residency
from ..modeling.quantized import device_map_problem
from ..modeling.routing import BatchRouting, host_to_device
from ..modeling.tensor_parallel import tensor_parallel_problem
from ..decoding.jacobi import JacobiGate
from ..decoding.scope import sparsify_positions_from
from .attention import use_grouped_attention
from .norms import use_fused_norms

__all__ = ["AdmissionPolicy", "DecodeEngine", "EngineStats", "Finished", "Pending", "auto_max_deltas", "fit_step_costs"]

_MODEL_DEFAULT = object()  # eos_token_id not given: the model's generation config decides


@dataclass
class Finished:
    """A request that finished: its handle, the new tokens and why it stopped (``"eos"``, ``"length"``,
    ``"cancelled"`` or ``"aborted"``)."""

    handle: int
    tokens: list
    reason: str

    def __iter__(self):  # ``for handle, tokens in engine.step()``
        return iter((self.handle, self.tokens))


@dataclass
class EngineStats:
    """Where a :class:`DecodeEngine`'s time went since it was made (or since :meth:`DecodeEngine.reset_stats`).

    Wall times are measured on the host around work that ends in a device sync (the tokens are read
    back), so on a GPU they include the device's time.

    Attributes:
        prefill_s: seconds in prefill (batched forward passes over new prompts), loads excluded.
        load_s: seconds waiting for the deltas of new requests to become resident (read, decompress,
            upload) before their prefill could start; where a delta only on disk is read beside the
            prefill (``DeltaCache.overlap_loads``), until the read ended, the prefill so far included
            (the rest of that prefill counts as prefill).
        decode_s: seconds in decode steps.
        prefills, prefill_rows, prefill_tokens: prefill passes, requests admitted, padded prompt tokens.
        loads: admissions that had to bring at least one delta onto the device.
        staged: deltas :meth:`DecodeEngine.pick` started copying onto the device ahead of their requests'
            admission (``AdmissionPolicy.stage_ahead``), beside the decode steps instead of before a prefill.
        admission_s: seconds inside :meth:`DecodeEngine.pick` (choosing requests and staging deltas ahead: host
            work between decode steps, not in ``prefill_s`` or ``decode_s``); ``stage_s``: of those, staging.
        stage_in_steps_s: host seconds spent writing staged deltas inside decode steps (``stage_in_steps``),
            while the device computed them; part of ``decode_s``.
        decode_steps: decode steps run.
        row_steps: rows computed by decode steps (``max_batch_size`` per step).
        idle_row_steps: of those, rows with no request (computed and thrown away).
        distinct_deltas: summed over steps, the distinct deltas the active rows used.
        bytes_read: summed over steps, bytes a step reads as implemented: the base's weights, each
            distinct delta once and the whole static KV cache of every row.
        floor_bytes: summed over steps, the bytes a step cannot avoid: the base's weights, each distinct
            delta once, and only the KV entries the active rows attend to.
        captures: decode steps captured as CUDA graphs (a delta layout change costs one per route).
        split_steps: of the decode steps, those that took the split route (``KernelPolicy.decode``:
            ``"auto"`` takes it for steps of many distinct deltas).
        max_deltas_auto: the cap ``max_deltas="auto"`` has chosen so far (``None``: not measured yet).
        jacobi_steps: of the decode steps, Jacobi steps (a block of tokens per row, run eagerly).
        jacobi_row_steps, jacobi_tokens: Jacobi rows in those steps, and the tokens they accepted.
        ahead_steps: of the decode steps, those launched before the previous step's tokens were read back
            (``AdmissionPolicy.overlap_steps``). With it, ``decode_s`` is the host's time inside
            :meth:`DecodeEngine.step` (launching, waiting, reading back) plus, on a GPU, an admission's wait
            for the steps in flight before it (not in ``prefill_s``), and the step costs behind
            ``max_deltas="auto"`` are the device's time per step; a row's last step may be followed by one
            computed for it in vain (counted as one of its row-steps).
        prefill_device_s, decode_device_s: on a GPU, the device's time in prefills and in decode steps, from CUDA
            events around each (from the device starting its work to finishing it, whatever the host does
            meanwhile; a prefill's includes waiting for a delta read beside it, a Jacobi step's the host's work
            between its read-back and its last updates); ``None`` elsewhere. The wall time outside both is time
            the device waited (for the host, for loads, for arrivals).
    """

    prefill_s: float = 0.0
    load_s: float = 0.0
    decode_s: float = 0.0
    prefills: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    loads: int = 0
    staged: int = 0
    admission_s: float = 0.0
    stage_s: float = 0.0
    stage_in_steps_s: float = 0.0
    decode_steps: int = 0
    row_steps: int = 0
    idle_row_steps: int = 0
    distinct_deltas: int = 0
    bytes_read: int = 0
    floor_bytes: int = 0
    captures: int = 0
    split_steps: int = 0
    max_deltas_auto: Optional[int] = None
    jacobi_steps: int = 0
    jacobi_row_steps: int = 0
    jacobi_tokens: int = 0
    ahead_steps: int = 0
    prefill_device_s: Optional[float] = None
    decode_device_s: Optional[float] = None

    def add_device_s(self, field_name: str, seconds: float) -> None:
        """Add ``seconds`` of device time to ``prefill_device_s`` or ``decode_device_s`` (``None`` until then)."""
        setattr(self, field_name, (getattr(self, field_name) or 0.0) + seconds)

    @property
    def idle_row_s(self) -> float:
        """Decode time spent on idle rows: ``decode_s`` times the idle share of row-steps."""
        return self.decode_s * self.idle_row_steps / self.row_steps if self.row_steps else 0.0

    @property
    def mean_distinct_deltas(self) -> float:
        """Distinct deltas per decode step, on average."""
        return self.distinct_deltas / self.decode_steps if self.decode_steps else 0.0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_read / self.decode_steps if self.decode_steps else 0.0

    @property
    def floor_bytes_per_step(self) -> float:
        return self.floor_bytes / self.decode_steps if self.decode_steps else 0.0

    @property
    def step_ms(self) -> float:
        """Mean decode step time in milliseconds."""
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def jacobi_tokens_per_step(self) -> float:
        """Tokens a Jacobi row accepted per Jacobi step, on average (1.0 is what a greedy step gives)."""
        return self.jacobi_tokens / self.jacobi_row_steps if self.jacobi_row_steps else 0.0

    @property
    def floor_GBps(self) -> float:
        """Floor bytes per second of decode: compare with the device's copy bandwidth (an H200: ~4 TB/s)."""
        return self.floor_bytes / self.decode_s / 1e9 if self.decode_s else 0.0

    def as_dict(self) -> dict:
        """Every field and derived figure, for a JSON report."""
        out = dict(self.__dict__)
        for name in ("idle_row_s", "mean_distinct_deltas", "bytes_per_step", "floor_bytes_per_step", "step_ms", "floor_GBps",
                     "jacobi_tokens_per_step"):
            out[name] = getattr(self, name)
        return out


@dataclass(eq=False)  # compared by identity: two requests with equal fields are still two
class Pending:
    """A request waiting for a row, as :meth:`DecodeEngine.pick` sees it.

    Attributes:
        prompt_len: its prompt's tokens.
        delta: its delta name (``None``: the base).
        item: the caller's own object (returned untouched).
        bypassed: later requests admitted before it so far (kept up to date by ``pick``).
    """

    prompt_len: int
    delta: Optional[str]
    item: object = None
    bypassed: int = 0


DEFAULT_BYPASS_PER_ROW = 16  # AdmissionPolicy.max_bypass=None: this many later requests per row of the engine


@dataclass
class AdmissionPolicy:
    """How :meth:`DecodeEngine.pick` fills free rows from the waiting requests.

    Every admission round walks the waiting requests and repeatedly takes the oldest one whose delta
    is already in the step (a running row's, or one picked this round), else the oldest one at all;
    a request that does not fit (rows, KV cache, the resident budget, ``max_deltas``) is passed over.
    Preferring deltas already in the step adds rows without adding bytes to the step.

    **Fairness rule:** no request is passed over by more than ``max_bypass`` requests that arrived
    after it. Once a request has been bypassed ``max_bypass`` times, no later request is admitted
    before it: the rows that free up wait for it. ``max_bypass=0`` is strict first come, first served.

    **Prefill budget:** one round admits at most ``max_prefill_tokens`` padded prompt tokens (at least
    one request), so a burst of arrivals is prefilled over several rounds with decode steps between
    them and the running rows are never stalled by more than one bounded prefill.

    **Cost-aware admission** (``cost_aware=True``): once the engine has measured its decode step time
    as ``t(U) = a + b * U`` for ``U`` distinct deltas (:func:`fit_step_costs`), a request whose delta is
    not in the step is admitted only if the rows its delta brings raise the step's tokens per second:
    with ``r`` rows in the step and ``k`` rows the new delta can fill now (its waiting requests, up to
    the free rows), ``(r + k) / t(U + 1) >= r / t(U)``, i.e. ``k * t(U) >= r * b``. Otherwise the row
    stays free until enough rows of the step finish or enough requests for that delta queue. The
    fairness rule still holds: nothing later passes a request at the bound, so it is admitted once the
    step has drained enough (an empty step admits anything).

    **Coalesced prefills** (``min_free_rows=F``): while rows run, a round admits nothing until at least ``F``
    rows are free, or as many as there are waiting requests if fewer wait; so the rows that free up one by
    one are filled in fewer, larger prefills. Each prefill round costs a fixed part beside its prompts (the
    host's work and a pass over every layer), so fewer rounds leave more of the wall time to decoding; the
    rows that wait cost idle rows instead. A round held this way admits nobody, so no request is bypassed
    by it; an empty step admits at once. Measured on the saturating 8B trace at 64 rows (BENCHMARKS.md
    section 5): ``F=16`` made a third as many rounds and lowered the mean latency a little, but its
    throughput stayed within the replays' order effect (the idle rows took back the prefill time saved); off
    by default.

    **Staging ahead** (``stage_ahead=True``, the default): each round first starts copying the deltas that
    waiting requests need and that wait in host memory onto the device, on a side stream beside the decode
    steps, making room by evicting least recently used deltas no running or waiting request uses; while
    rows run, a delta only on disk is read into host memory on the cache's prefetch thread
    (:meth:`~hf_deltazip.DeltaModel.prefetch`) and staged in a later round. A request whose delta is still
    being read or copied is passed over until it is in (unless no row is running: then it is admitted at
    once, its delta read beside its prefill), so the running rows do not wait for it; it counts as bypassed
    like any other, and the fairness bound still holds. Where every delta is resident this does nothing.
    With ``stage_in_steps`` (off by default), while rows run a round only makes the room and takes the slot; the
    host work of writing the delta (a few operations per module: copies, the kernel layout, table rows) is
    done a module at a time after each decode step is launched, while the device computes it, instead of
    between steps where the device waits for it. A round that leaves rows free while a waiting request's delta
    is still being written that way writes the rest at once (the rows would otherwise run empty until it is in).

    Attributes:
        max_bypass: the bound K above (``None``: ``16 * max_batch_size`` of the engine; on a saturating
            8B trace of 32 deltas, 512 instead of 128 served 1.18x the tokens per second at a lower mean and
            p99 latency, BENCHMARKS.md section 5).
        prefer_running: prefer requests whose delta is already in the step (``False``: arrival order).
        max_prefill_tokens: padded prompt tokens per round (``None``: no limit).
        cost_aware: the rule above (``False``: any request that fits is admitted).
        step_cost_line: ``(a, b)`` in seconds for the rule instead of the engine's measurement (``None``:
            measured; until two different ``U`` have been seen, the rule admits as if it were off).
        stage_ahead: the staging above (``False``: a delta is put on the device when its request is admitted,
            before that request's prefill, while every row waits).
        min_free_rows: the coalescing above (``None``: a round admits into any free row).
        stage_in_steps: write staged deltas inside the decode steps as above (``False``: all at once in the
            round that stages them; on an 8B H100 trace it ran 1.03x the default as a second replay, within the
            replay-order effect, BENCHMARKS.md section 5).
        overlap_steps: launch each decode step before the previous step's tokens are read back, so the host's
            work between steps (reading tokens back, finishing rows, admission rounds, staging) runs while the
            device computes instead of between its steps (``False``: launch a step once the last one's tokens
            are in). It applies to :meth:`DecodeEngine.step` however rows are admitted. Sampled rows draw
            their tokens on the device, in the step; while a row decodes by Jacobi steps, its next input
            depends on the host, so steps are not launched ahead then. A request admitted while a step is in
            flight joins the step after it; a row that finishes has one more step computed for it in vain
            (a sampled row without a seed then draws once more from the global generator, so unseeded sampled
            rows may get other tokens than without this option). Greedy rows and seeded sampled rows get the
            same tokens either way. Off by default for now: one H100 A/B on the 8B serve trace measured 1.03-1.05x
            the throughput (BENCHMARKS.md section 5).
    """

    max_bypass: Optional[int] = None
    prefer_running: bool = True
    max_prefill_tokens: Optional[int] = 4096
    cost_aware: bool = False
    step_cost_line: Optional[tuple] = None
    stage_ahead: bool = True
    min_free_rows: Optional[int] = None
    stage_in_steps: bool = False
    overlap_steps: bool = False


def fit_step_costs(step_costs: dict, *, min_steps: int = 8) -> Optional[tuple]:
    """``(a, b)`` of ``t(U) = a + b * U`` fitted by least squares to the decode step times, each step one
    sample (each ``U`` seen in at least ``min_steps`` steps; a ``U`` seen in a few steps, such as a
    warm-up's, weighs as little as it was seen). ``None`` until two different ``U`` have been measured.

    Args:
        step_costs: ``U -> (steps, summed seconds)``.
    """
    points = [(u, n, total / n) for u, (n, total) in step_costs.items() if n >= min_steps]
    if len(points) < 2:
        return None
    steps = sum(n for _, n, _ in points)
    mu = sum(n * u for u, n, _ in points) / steps
    mt = sum(n * t for _, n, t in points) / steps
    var = sum(n * (u - mu) ** 2 for u, n, _ in points)
    b = sum(n * (u - mu) * (t - mt) for u, n, t in points) / var
    return mt - b * mu, b


def auto_max_deltas(step_costs: dict, *, min_steps: int = 8) -> Optional[int]:
    """The distinct-delta cap ``max_deltas="auto"`` uses, from measured decode step times.

    Fits ``t(U) = a + b * U`` (:func:`fit_step_costs`) and returns ``max(1, floor(a / b))``: the most
    deltas whose reads together cost no more than the rest of the step (the base's weights, the KV
    cache, launch overhead), so a step is at most about twice a single-delta step. ``None`` (no cap)
    until two different ``U`` have been measured, or when deltas measure as free (``b <= 0``).

    Args:
        step_costs: ``U -> (steps, summed seconds)``.
    """
    return _cap_of(fit_step_costs(step_costs, min_steps=min_steps))


def _cap_of(fit: Optional[tuple]) -> Optional[int]:
    """:func:`auto_max_deltas`' cap from a fitted ``(a, b)``."""
    if fit is None or fit[1] <= 0:
        return None
    a, b = fit
    return max(1, math.floor(a / b + 1e-9)) if a > 0 else 1  # the tolerance: a/b = 5 computed as 4.999...


@dataclass
class _Row:
    handle: int
    delta: Optional[str]
    start: int  # first cache index of the prompt
    max_new: int
    eos: frozenset
    sample: Optional[dict]
    generator: Optional[torch.Generator]
    tokens: list = field(default_factory=list)
    jacobi: int = 0  # block size of a Jacobi row (0: one token per step)
    guesses: list = field(default_factory=list)  # the row's next Jacobi guesses
    first_step: int = 0  # the first decode step (DecodeEngine._launched then) whose tokens are this row's


class _Span:
    """Two CUDA timing events around work queued on the current stream."""

    def __init__(self):
        self.first = torch.cuda.Event(enable_timing=True)
        self.last = torch.cuda.Event(enable_timing=True)
        self.first.record()

    @classmethod
    def start(cls, device) -> Optional["_Span"]:
        """A span starting now on a CUDA ``device``; ``None`` elsewhere."""
        return cls() if device.type == "cuda" else None

    def end(self) -> None:
        self.last.record()

    def seconds(self) -> float:
        """The device's time from the first event to the last (waits for the last)."""
        self.last.synchronize()
        return self.first.elapsed_time(self.last) / 1e3


@dataclass
class _Launched:
    """A decode step launched ahead of reading back its tokens (``AdmissionPolicy.overlap_steps``)."""

    step: int  # its number: rows with ``first_step <= step`` were in it
    used: tuple  # _step_usage() when it was launched
    tokens: torch.Tensor  # its greedy tokens, being copied to the host
    span: Optional[_Span]  # CUDA timing events before the step and after the copy (None: on the CPU, done)
    seconds: float  # host seconds of its launch (the step's cost on the CPU)
    sample: bool  # it captured no CUDA graph: a sample of a step's cost


class _StepCache:
    """The cache object handed to the model: ``update(k, v, layer_idx)`` is all a decoder calls on it.

    In ``prefill`` mode it keeps each layer's keys and values of the prompt (attention runs over the
    prompt alone); in decode mode it writes them at the shared write index and returns the whole cache.
    """

    def __init__(self, layers: int):
        self.layers = layers
        self.keys: list = []
        self.values: list = []
        self.write = None  # device long [1]
        self.prefill: Optional[list] = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.prefill is not None:
            self.prefill[layer_idx] = (key_states, value_states)
            return key_states, value_states
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write, key_states)
        v.index_copy_(2, self.write, value_states)
        return k, v

    # what transformers may ask of a cache it did not create
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.layers


class DecodeEngine:
    """Continuous-batching decoder over a static KV cache (see the module docstring).

    Args:
        model: a :class:`~hf_deltazip.DeltaModel` or a plain transformers causal LM (decoder-only,
            rotary or learned positions, attention that takes a 4-D additive mask: Llama, Qwen2,
            Mistral, Phi-3 and the like).
        max_batch_size: rows decoded together (each step computes all of them).
        max_length: cache length; a request needs ``prompt + max_new_tokens <= max_length``.
        cuda_graphs: capture decode steps as CUDA graphs (default: on CUDA devices).
        pad_token_id: token id fed to idle rows.
        max_deltas: most distinct deltas among the active rows. A decode step reads every delta its
            rows use, so its time grows with their number; :meth:`can_add` holds back requests for
            other deltas while the limit is reached, and they get in as rows of running deltas
            finish. ``"auto"`` (default): chosen by :func:`auto_max_deltas` from the decode step
            times measured so far (no cap until two different delta counts have been timed; see
            ``stats.max_deltas_auto``); ``None``: no limit; an integer: that limit.
        admission: the :class:`AdmissionPolicy` :meth:`pick` follows (default: prefer deltas in the
            step, ``max_bypass = 16 * max_batch_size``, 4096 prefill tokens per round).
        jacobi_min_accept: requests added with ``decoding="jacobi"`` are decoded by Jacobi steps while
            their rows accept at least this many tokens per step on average (over the last two Jacobi
            steps), and at least as many as a Jacobi step costs in one-token steps (a Jacobi step runs
            eagerly, an ordinary one may replay a CUDA graph); below it the engine takes ordinary
            steps for a while, then probes again, as :func:`~hf_deltazip.decoding.jacobi_generate`
            does (:class:`~hf_deltazip.decoding.jacobi.JacobiGate`). Each delta's Jacobi rows are judged on
            their own (:meth:`jacobi_gate`): a delta that falls back takes one token per step, also inside
            the wide steps of another delta whose rows still pay. ``None``: never fall back.
        fused_norms: run the model's Llama-style RMSNorms in one Triton launch each on CUDA
            (:func:`~hf_deltazip.serving.use_fused_norms`; ``fused_norms`` is then how many): 455 fewer
            launches per decode step at 8B shapes. The model keeps them after the engine;
            ``use_fused_norms(model, False)`` switches back. Outputs can differ from transformers' norm in the
            last bit of a 16-bit value (the sum of squares is added in another order). Not yet measured on a
            GPU, so off by default.

    Jacobi decoding (``add(..., decoding="jacobi", jacobi_block_size=n)``): a step feeds each Jacobi row
    its last token and ``n - 1`` guesses, writes all ``n`` keys at ``n`` cache indices and keeps, per row,
    only the entries of the accepted prefix visible (its mask hides the rest); the rows' output is the
    greedy output token for token. Other rows in the same step take one token. Holes left by rejected
    guesses are squeezed out when the cache runs out of room. Jacobi steps run eagerly (no CUDA graph).

    Attention: a grouped-query model on transformers' ``sdpa`` attention is switched to
    :func:`~hf_deltazip.serving.attention.grouped_sdpa_attention` (``grouped_attention`` is then True),
    which computes the same attention in one-token steps without copying keys and values once per query
    head (transformers before about 5.20 does, since the engine passes a mask). The model keeps it after
    the engine; ``model.set_attn_implementation("sdpa")`` switches back.
    """

    def __init__(self, model, *, max_batch_size: int = 32, max_length: int = 1024,
                 cuda_graphs: Optional[bool] = None, pad_token_id: int = 0,
                 max_deltas: Union[int, str, None] = "auto", admission: Optional[AdmissionPolicy] = None,
                 jacobi_min_accept: Optional[float] = 1.5, fused_norms: bool = False):
        from ..modeling import DeltaModel

        if max_batch_size < 1 or max_length < 2:
            raise DeltaZipError(f"max_batch_size must be >= 1 and max_length >= 2, got {max_batch_size} and {max_length}")
        self.delta_model = model if isinstance(model, DeltaModel) else None
        self.lm = model.base_model if self.delta_model is not None else model
        config = getattr(self.lm, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            raise DeltaZipError("DecodeEngine needs a decoder-only transformers causal LM")
        self.config = config
        windowed = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
        if windowed:
            raise DeltaZipError(
                f"DecodeEngine runs full attention only; this model has {sorted(set(windowed))} layers: "
                "use generate() for it"
            )
        problem = tensor_parallel_problem(self.lm) or device_map_problem(self.lm)
        if problem:
            raise DeltaZipError(problem)
        param = next(self.lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        if not self.dtype.is_floating_point:
            self.dtype = torch.float16
        self.max_batch_size, self.max_length = max_batch_size, max_length
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise DeltaZipError("cuda_graphs=True needs the model on a CUDA device")
        self.pad_token_id = pad_token_id
        if max_deltas != "auto" and max_deltas is not None and (not isinstance(max_deltas, int) or max_deltas < 1):
            raise DeltaZipError(f"max_deltas must be a positive integer, 'auto' or None (no limit), got {max_deltas!r}")
        self.max_deltas = max_deltas
        self.admission = admission if admission is not None else AdmissionPolicy()
        self.stats = EngineStats()
        self._step_costs: dict = {}  # distinct deltas -> (steps, seconds): max_deltas="auto", cost-aware admission
        self._step_fit: Optional[tuple] = None  # (a, b) of t(U) = a + b U fitted to _step_costs
        # a one-token step of a grouped-query model without a copy of the keys and values per query head
        # (the same arithmetic; see serving.attention): True when the model was switched to it
        self.grouped_attention = use_grouped_attention(self.lm)
        # Llama-style RMSNorms in one launch each instead of eight (serving.norms): the number switched
        self.fused_norms = use_fused_norms(self.lm) if fused_norms else 0
        self._base_bytes = _weight_bytes(self.lm)
        params = inspect.signature(self.lm.forward).parameters
        self._cache_kw = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._lock = threading.RLock()
        self._reading: set = set()  # deltas a staging round asked the cache to read from disk, not in yet
        self._unreadable: set = set()  # ... whose read failed: left to their admission, which reports why
        self._next_handle = 0
        self._rows: list[Optional[_Row]] = [None] * max_batch_size
        self._finished: list[Finished] = []
        self._ptr = 0  # host copy of the write index (of the next step to launch)
        self._launched = 0  # decode steps launched so far (numbers them: _Row.first_step)
        self._ahead: deque = deque()  # steps launched whose tokens are not read back yet (_Launched)
        self._graphs: dict = {}  # decode route (None: no kernels) -> (CUDA graph, layout version)
        self._graph_failed = False
        self.captures = 0  # decode steps captured as CUDA graphs so far (each layout change costs one)
        self._static_failed = False
        b, d = max_batch_size, self.device
        self._ids = torch.full((b, 1), pad_token_id, dtype=torch.long, device=d)
        self._positions = torch.zeros((b, 1), dtype=torch.long, device=d)
        self._slots = torch.full((b,), -1, dtype=torch.int32, device=d)
        self._mask = torch.full((b, 1, 1, max_length), self._neg, dtype=self.dtype, device=d)
        self._next = torch.zeros((b,), dtype=torch.long, device=d)
        self._logits = None
        self._cache = _StepCache(getattr(config, "num_hidden_layers", 0))
        self._cache.write = torch.zeros((1,), dtype=torch.long, device=d)
        # when Jacobi rows get wide steps: one gate per delta (a consistency delta stays wide while an
        # ordinary one beside it falls back); the gates of deltas with no Jacobi row are kept for later
        self._jacobi_min_accept = jacobi_min_accept
        self._jacobi_gates: dict = {}
        self._wide_deltas: frozenset = frozenset()  # deltas whose Jacobi rows the coming step widens
        self._consulted: dict = {}  # delta -> gate, the gates asked about the coming step

    # ------------------------------------------------------------------ public
    @property
    def jacobi_min_accept(self) -> Optional[float]:
        """Tokens per Jacobi step under which Jacobi rows fall back to one-token steps (see the class docstring)."""
        return self._jacobi_min_accept

    @jacobi_min_accept.setter
    def jacobi_min_accept(self, value: Optional[float]) -> None:
        self._jacobi_min_accept = value
        for gate in self._jacobi_gates.values():
            gate.min_accept = value

    def jacobi_gate(self, delta: Optional[str]) -> JacobiGate:
        """The fallback gate of ``delta``'s Jacobi rows (``None``: the base's), made on first use."""
        gate = self._jacobi_gates.get(delta)
        if gate is None:
            gate = self._jacobi_gates[delta] = JacobiGate(self._jacobi_min_accept)
        return gate

    @property
    def free(self) -> int:
        """Rows free for new requests."""
        return sum(r is None for r in self._rows)

    @property
    def active(self) -> int:
        """Rows decoding now."""
        return self.max_batch_size - self.free

    def tokens(self, handle: int, start: int = 0) -> list:
        """New tokens of an active request so far (from index ``start``: what a streaming caller has not seen)."""
        return list(self._row_of(handle).tokens[start:])

    def cancel(self, handle: int) -> bool:
        """Stop an active request now and free its row (and its hold on its delta).

        It is reported by the next :meth:`step` as finished with reason ``"cancelled"`` and the tokens it
        had. Returns ``False`` when no active request has this handle (it finished already).
        """
        with self._lock:
            row = self._row_index(handle)
            if row is None:
                return False
            self._release(row, "cancelled")
            return True

    @property
    def admission(self) -> AdmissionPolicy:
        """How :meth:`pick` fills free rows (:class:`AdmissionPolicy`); a new policy is checked when set."""
        return self._admission

    @admission.setter
    def admission(self, policy: AdmissionPolicy) -> None:
        if policy.max_bypass is not None and policy.max_bypass < 0:
            raise DeltaZipError(f"AdmissionPolicy.max_bypass must be >= 0 or None, got {policy.max_bypass}")
        floor = policy.min_free_rows
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int) or floor < 1):
            raise DeltaZipError(f"AdmissionPolicy.min_free_rows must be a positive number of rows or None, got {floor!r}")
        if floor is not None and floor > self.max_batch_size:
            raise DeltaZipError(f"AdmissionPolicy.min_free_rows={floor} is more rows than the engine has "
                                f"(max_batch_size={self.max_batch_size}): give at most {self.max_batch_size}")
        given = policy.step_cost_line
        if given is not None and not (len(given) == 2 and all(isinstance(v, (int, float)) for v in given)
                                      and given[0] >= 0 and given[1] > 0):
            raise DeltaZipError(f"AdmissionPolicy.step_cost_line must be (a, b) seconds with a >= 0 and b > 0 "
                                f"(a step of U distinct deltas takes a + b * U), got {given!r}")
        self._admission = policy

    def can_add(self, prompt_len: int, delta_names: Sequence = ()) -> bool:
        """Whether prompts of up to ``prompt_len`` tokens naming ``delta_names`` can be admitted now: a
        free row, cache room that active rows do not need, and the deltas fit the model's resident
        budget next to the deltas active rows use."""
        rows = [r for r in self._rows if r is not None]
        if len(rows) + max(len(delta_names), 1) > self.max_batch_size:
            return False
        if self.delta_model is not None and any(n is not None for n in delta_names):
            if not self.delta_model.cache.fits(delta_names):
                return False
            limit = self.delta_limit
            if limit is not None:
                running = {r.delta for r in rows} | set(delta_names)
                if len(running - {None}) > limit:
                    return False
        shift = min(r.start for r in rows) if rows else self._ptr
        ptr = max(self._ptr - shift, prompt_len)
        return all(ptr - (r.start - shift) + (r.max_new - len(r.tokens)) <= self.max_length for r in rows)

    @property
    def delta_limit(self) -> Optional[int]:
        """The distinct-delta cap in force now (``max_deltas``, or what ``"auto"`` has measured; ``None``: none)."""
        return self.stats.max_deltas_auto if self.max_deltas == "auto" else self.max_deltas

    @property
    def step_costs(self) -> dict:
        """The decode step times behind ``max_deltas="auto"`` and cost-aware admission: ``U -> (steps,
        summed seconds)`` for ``U`` distinct deltas in the step (steps that captured a graph left out)."""
        return dict(self._step_costs)

    def reset_stats(self) -> EngineStats:
        """Start :attr:`stats` afresh (e.g. after a warm-up); returns the old one. Step-cost samples for
        ``max_deltas="auto"`` and the chosen cap are kept."""
        with self._lock:
            old, self.stats = self.stats, EngineStats(max_deltas_auto=self.stats.max_deltas_auto)
            return old

    def pick(self, waiting: Sequence[Pending]) -> list:
        """Choose which of ``waiting`` (oldest first) to admit now, following :attr:`admission`.

        Returns the chosen ones, oldest first; pass their prompts to :meth:`add`. Updates each
        unchosen request's ``bypassed`` count, so give the same :class:`Pending` objects again next
        round (minus the admitted ones). See :class:`AdmissionPolicy` for the rule and its bound.
        """
        policy = self.admission
        bound = DEFAULT_BYPASS_PER_ROW * self.max_batch_size if policy.max_bypass is None else policy.max_bypass
        budget = policy.max_prefill_tokens
        with self._lock:
            t0 = time.perf_counter()
            try:
                return self._pick(waiting, policy, bound, budget)
            finally:
                self.stats.admission_s += time.perf_counter() - t0

    def _pick(self, waiting, policy, bound, budget) -> list:
        """:meth:`pick`'s work (caller holds the lock and times it)."""
        running = {r.delta for r in self._rows if r is not None}
        if policy.stage_ahead:
            t0 = time.perf_counter()
            copying = self._stage(waiting, running)
            self.stats.stage_s += time.perf_counter() - t0
        else:
            copying = set()
        free = self.free
        floor = policy.min_free_rows
        if floor is not None and running and free < min(floor, len(waiting)):
            return []  # coalescing: rows free up until a larger prefill round is worth it
        chosen: list = []  # indices into waiting
        taken = set()
        while len(chosen) < free:
            pick = self._next_pick(waiting, chosen, taken, running, bound, budget, copying)
            if pick is None:
                break
            chosen.append(pick)
            taken.add(pick)
            running.add(waiting[pick].delta)
        if len(chosen) < free and self.delta_model is not None:
            # rows left free: a delta still being written inside the steps is written now instead, so that its
            # requests can have those rows next round
            pending = set(self.delta_model.cache.staging_pending)
            late = [w.delta for j, w in enumerate(waiting) if j not in taken and w.delta in pending]
            if late:
                t0 = time.perf_counter()
                self.delta_model.cache.finish_staging(late)
                self.stats.stage_s += time.perf_counter() - t0
        for j, w in enumerate(waiting):
            if j not in taken:
                w.bypassed += sum(1 for i in chosen if i > j)
        return [waiting[i] for i in sorted(chosen)]

    def _stage(self, waiting, running) -> set:
        """Start copying the host-tier deltas of the oldest ``max_batch_size`` waiting requests onto the device
        and, while rows run, reading their disk-only ones into host memory (``AdmissionPolicy.stage_ahead``);
        returns the deltas still being read or copied, to pass over."""
        if self.delta_model is None:
            return set()
        cache = self.delta_model.cache
        wanted = list(dict.fromkeys(w.delta for w in waiting[: self.max_batch_size] if w.delta is not None))
        if not wanted or not cache.placer.uses_kernels():
            return set()
        busy = any(r is not None for r in self._rows)  # decode steps follow, to write deferred stagings in
        started = cache.stage(wanted, keep=[d for d in running if d is not None], defer=busy and self.admission.stage_in_steps)
        self.stats.staged += len(started)
        if not busy:  # nothing runs: a prefill may as well wait for its copies,
            return set()  # and a delta only on disk is read beside its prefill (DeltaCache.overlap_loads)
        cold = [d for d in wanted if d in cache and cache.state(d) is Residency.DISK
                and d not in self._reading and d not in self._unreadable]
        if cold:  # read them on the cache's prefetch thread instead of at admission, where every row would wait
            self._reading.update(cold)
            cache.prefetch(cold).add_done_callback(lambda f, names=tuple(cold): self._read_done(f, names))
        return {d for d in wanted if d in self._reading
                or (d in cache and cache.state(d) is Residency.DEVICE and not cache.is_ready(d))}

    def _read_done(self, future, names) -> None:
        if future.exception() is not None:
            self._unreadable.update(names)
        self._reading.difference_update(names)

    def _next_pick(self, waiting, chosen, taken, running, bound, budget, copying=frozenset()) -> Optional[int]:
        """The next request to admit this round, or ``None`` (one pass over ``waiting``)."""
        width = max((waiting[i].prompt_len for i in chosen), default=0)
        names = [waiting[i].delta for i in chosen]
        later_chosen = len(chosen)  # chosen requests after the current position
        worst = -1  # the most bypasses an earlier, unchosen request would have
        first_other = None
        prefer = self.admission.prefer_running
        worth = self._worth_adding(waiting, chosen, taken, running)
        for j, w in enumerate(waiting):
            if j in taken:
                later_chosen -= 1
                continue
            # admitting j passes over every earlier unchosen request: none may go over the bound
            if worst + 1 > bound:
                break
            if w.delta in copying:  # its delta is still being copied in: the step need not wait for it
                worst = max(worst, w.bypassed + later_chosen)
                continue
            if first_other is None or (prefer and w.delta in running):
                wide = max(width, w.prompt_len)
                fits = not (chosen and budget is not None and wide * (len(chosen) + 1) > budget)
                if fits and (w.delta in running or worth(w.delta)) and self.can_add(wide, names + [w.delta]):
                    if w.delta in running or not prefer:
                        return j
                    first_other = j
            worst = max(worst, w.bypassed + later_chosen)
        return first_other

    def _worth_adding(self, waiting, chosen, taken, running):
        """``delta -> bool``: whether a delta not in the step may join it now (``AdmissionPolicy.cost_aware``)."""
        fit = self.admission.step_cost_line or self._step_fit
        if not self.admission.cost_aware or fit is None or fit[1] <= 0:
            return lambda delta: True
        a, b = fit
        rows = sum(r is not None for r in self._rows) + len(chosen)
        t = a + b * len(running - {None})
        if t <= 0:  # a fit that says a step costs nothing: no basis for holding rows back
            return lambda delta: True
        free = self.max_batch_size - rows
        queued: dict = {}
        for j, w in enumerate(waiting):
            if j not in taken:
                queued[w.delta] = queued.get(w.delta, 0) + 1
        # a delta's k rows raise tokens per second iff (rows + k) / (t + b) >= rows / t
        return lambda delta: delta is None or min(free, queued.get(delta, 0)) * t >= rows * b

    def add(self, prompts: Sequence, delta_names: Optional[Sequence] = None, *,
            max_new_tokens: Union[int, Sequence[int]] = 32, eos_token_id=_MODEL_DEFAULT, do_sample: bool = False,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
            decoding: Optional[str] = None, jacobi_block_size: int = 16) -> list:
        """Admit requests into free rows: one batched prefill, which also picks each row's first token.

        Args:
            prompts: token ids per request (lists or 1-D tensors).
            delta_names: the delta of each request (``None``: the base); default all ``None``.
            max_new_tokens: per request, or one value for all.
            eos_token_id: an id or a list of ids that end a request (the token is not returned);
                default: the model's ``generation_config.eos_token_id``; ``None``: never stop early.
            do_sample, temperature, top_k, top_p, seed: sampling instead of greedy choice.
            decoding: ``"jacobi"`` decodes these (greedy) requests by Jacobi iteration, up to
                ``jacobi_block_size`` tokens per step each (see the class docstring); ``None``: one per step.

        Returns:
            One handle per request; :meth:`step` reports each finished request under its handle.
        """
        prompts = [p.reshape(-1).tolist() if torch.is_tensor(p) else list(p) for p in prompts]
        n = len(prompts)
        if n == 0:
            return []
        names = list(delta_names) if delta_names is not None else [None] * n
        news = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(names) != n or len(news) != n:
            raise DeltaZipError(f"{n} prompts but {len(names)} delta names and {len(news)} max_new_tokens: give one per prompt")
        if n > self.free:
            raise DeltaZipError(f"{n} requests but only {self.free} free rows: add fewer, or step() until rows finish")
        for p, m in zip(prompts, news):
            if not p:
                raise DeltaZipError("empty prompt")
            if m < 1 or len(p) + m > self.max_length:
                raise DeltaZipError(
                    f"a prompt of {len(p)} tokens with max_new_tokens={m} does not fit max_length={self.max_length}: "
                    "raise max_length or shorten the request"
                )
        if decoding not in (None, "jacobi"):
            raise DeltaZipError(f'decoding must be None or "jacobi", got {decoding!r}')
        if decoding == "jacobi" and do_sample:
            raise DeltaZipError("jacobi decoding is greedy: do_sample=True is not supported; drop decoding='jacobi' to sample")
        if decoding == "jacobi" and (not isinstance(jacobi_block_size, int) or not 1 <= jacobi_block_size <= self.max_length):
            raise DeltaZipError(f"jacobi_block_size must be an integer in [1, max_length={self.max_length}], got {jacobi_block_size!r}")
        if self.delta_model is None and any(x is not None for x in names):
            raise DeltaZipError("this engine runs a plain model: delta names must be None (use a DeltaModel for deltas)")
        for p, name in zip(prompts, names):
            self.check_prompt(p, name)
        if eos_token_id is _MODEL_DEFAULT:
            eos_token_id = getattr(getattr(self.lm, "generation_config", None), "eos_token_id", None)
        eos = frozenset([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else None
        block = jacobi_block_size if decoding == "jacobi" else 0
        with self._lock, self._model_lock():
            return self._admit(prompts, names, news, eos, sample, seed, block)

    def vocab_size(self, delta_name: Optional[str] = None) -> Optional[int]:
        """How many token ids a prompt answered with ``delta_name`` may use: the fine-tune's vocabulary where its
        delta records one (a fine-tune may add tokens), else the base's (``None``: the model's config does not
        say)."""
        if delta_name is not None and self.delta_model is not None:
            v = self.delta_model.cache.entry(delta_name).header.vocab_size_finetune
            if v:
                return int(v)
        cfg = getattr(self.lm, "config", None)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        v = getattr(cfg, "vocab_size", None)
        return int(v) if v else None

    def check_prompt(self, prompt: Sequence[int], delta_name: Optional[str] = None) -> None:
        """Raise :class:`DeltaZipError` if ``prompt`` is empty or holds a token id outside the vocabulary it will
        be answered with (:meth:`vocab_size`). :meth:`add` checks every prompt so; on a GPU such an id would stop
        the device with an assertion that no later request survives."""
        if not len(prompt):
            raise DeltaZipError("empty prompt")
        lo, hi = min(prompt), max(prompt)
        v = self.vocab_size(delta_name)
        if lo < 0 or (v is not None and hi >= v):
            what = "the base model" if delta_name is None else f"delta {delta_name!r}"
            bad = lo if lo < 0 else hi
            raise DeltaZipError(f"prompt token id {bad} is outside the vocabulary of {what} (ids 0 to {v - 1 if v else '?'}): "
                                "tokenize with the model's own tokenizer")

    def step(self) -> list:
        """Decode one token for every active row. Returns the requests that finished (as :class:`Finished`)."""
        with self._lock:
            if self.active:
                with self._model_lock():
                    self._decode()
            done, self._finished = self._finished, []
            return done

    def reset(self) -> list:
        """Abandon every active request (e.g. after a failed step); returns them as finished ``"aborted"``."""
        with self._lock:
            for row, r in enumerate(self._rows):
                if r is not None:
                    self._release(row, "aborted")
            done, self._finished = self._finished, []
            return done

    def run(self, prompts: Sequence, delta_names: Optional[Sequence] = None, **kwargs) -> list:
        """Generate for many requests (more than the rows, if need be) and return their new tokens in order."""
        prompts = list(prompts)
        names = list(delta_names) if delta_names is not None else [None] * len(prompts)
        results: dict = {}
        order: list = []
        i = 0
        while i < len(prompts) or self.active:
            take = min(self.free, len(prompts) - i)
            while take and not self.can_add(max(len(p) for p in prompts[i:i + take]), names[i:i + take]):
                take -= 1
            if take:
                part = dict(kwargs)
                if not isinstance(part.get("max_new_tokens", 0), int):
                    part["max_new_tokens"] = list(part["max_new_tokens"])[i:i + take]
                order += self.add(prompts[i:i + take], names[i:i + take], **part)
                i += take
            for f in self.step():
                results[f.handle] = f.tokens
        return [results[h] for h in order]

    # ------------------------------------------------------------------ internals
    def _row_index(self, handle: int) -> Optional[int]:
        for row, r in enumerate(self._rows):
            if r is not None and r.handle == handle:
                return row
        return None

    def _row_of(self, handle: int) -> _Row:
        row = self._row_index(handle)
        if row is None:
            raise DeltaZipError(f"no active request with handle {handle}")
        return self._rows[row]

    @property
    def _neg(self) -> float:
        return torch.finfo(self.dtype).min

    def _model_lock(self):
        return self.delta_model.cache.lock if self.delta_model is not None else nullcontext()

    def _loading(self, names) -> bool:
        """Whether a delta of ``names`` is still being read (beside the prefill, ``DeltaCache.acquire_overlapped``)."""
        cache = self.delta_model.cache
        return any(x is not None and cache.state(x) is not Residency.DEVICE for x in names)

    def _count_load(self, t0: float) -> float:
        """Count an admission's load from ``t0`` to now (its uploads done); returns now."""
        if self.device.type == "cuda":  # uploads on a side stream count as loading, not prefill
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats.loads += 1
        self.stats.load_s += now - t0
        return now

    def _admit(self, prompts, names, news, eos, sample, seed, block=0) -> list:
        n = len(prompts)
        width = max(len(p) for p in prompts)
        if not self.can_add(width):
            raise DeltaZipError(
                f"no room in the KV cache for a {width}-token prompt while the active rows finish: step() until "
                "some finish, or raise max_length"
            )
        if self._ptr >= self.max_length or self._ptr < width:
            self._compact()
            if self._ptr < width:
                self._ptr = width
                self._cache.write.fill_(self._ptr)
        rows = [i for i, r in enumerate(self._rows) if r is None][:n]
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        real = torch.zeros((n, width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            real[i, width - len(p):] = True
        top = ids.amax(1).tolist()  # each row's largest id, on the host: a vocabulary check reads no ids back
        started = _Span.start(self.device)  # before this prefill, after the steps in flight
        ids, real = host_to_device(ids, self.device), host_to_device(real, self.device)  # queued: no wait for a step in flight
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & real[:, None, :]
        mask = torch.full((n, 1, width, width), self._neg, dtype=self.dtype, device=self.device)
        mask.masked_fill_(allowed[:, None], 0.0)
        t0 = time.perf_counter()
        moved = False
        if self.delta_model is not None:  # held deltas stay resident (and keep their slots) until released
            cache = self.delta_model.cache
            moved = self._loading(names)
            # a delta only on disk is read while the prefill runs, each layer waiting for its own tensors
            acquired = cache.acquire_overlapped(names)
        else:
            acquired = nullcontext([-1] * n)
        self._cache.prefill = [None] * self._cache.layers
        try:
            with acquired as slots:
                if moved and not self._loading(names):  # loaded before the prefill: the load ends here
                    t0 = self._count_load(t0)
                    moved = False
                route = (self.delta_model.router.use(BatchRouting.per_row(slots, top)) if self.delta_model is not None
                         else nullcontext())
                kwargs = {self._cache_kw: self._cache, "use_cache": True}
                if self._keep_kw:
                    kwargs["logits_to_keep"] = 1
                with torch.no_grad(), route:  # a failure here releases the deltas (acquire_overlapped)
                    out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
                logits = out.logits[:, -1, :]
                prefill = self._cache.prefill
        finally:
            self._cache.prefill = None
        if moved:  # a delta read beside the prefill: until the read ended, the prefill included
            t0 = self._count_load(t0)
        if any(kv is None for kv in prefill):
            raise DeltaZipError("the model did not hand every layer's keys to the cache: this architecture is not supported by DecodeEngine")
        self._ensure_cache(prefill)
        lo, hi = self._ptr - width, self._ptr
        index = host_to_device(torch.tensor(rows), self.device)
        with torch.no_grad():
            for layer, (k, v) in enumerate(prefill):
                self._cache.keys[layer][index, :, lo:hi] = k.to(self.dtype)
                self._cache.values[layer][index, :, lo:hi] = v.to(self.dtype)
            row_mask = torch.full((n, 1, 1, self.max_length), self._neg, dtype=self.dtype, device=self.device)
            row_mask[:, 0, 0, lo:hi].masked_fill_(real, 0.0)
            self._mask[index] = row_mask
        handles = []
        generators = [self._generator(seed, i) for i in range(n)]
        if started is not None:
            started.end()
            if self._ahead:  # the wait for the steps in flight is decode time
                t = time.perf_counter()
                started.first.synchronize()
                waited = time.perf_counter() - t
                self.stats.decode_s += waited
                t0 += waited
        firsts = self._choose(logits, [sample] * n, generators)  # reads the tokens back: the prefill is done
        if started is not None:
            self.stats.add_device_s("prefill_device_s", started.seconds())
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefills += 1
        self.stats.prefill_rows += n
        self.stats.prefill_tokens += n * width
        for i, (row, p) in enumerate(zip(rows, prompts)):
            handle = self._next_handle
            self._next_handle += 1
            handles.append(handle)
            r = _Row(handle=handle, delta=names[i], start=hi - len(p), max_new=news[i], eos=eos,
                     sample=sample, generator=generators[i], jacobi=block if block > 1 else 0,
                     first_step=self._launched)
            self._rows[row] = r
            self._accept(row, firsts[i])
            if self._rows[row] is not None:  # fill_: a number assigned to a device tensor waits for the device
                self._ids[row].fill_(firsts[i])
                self._positions[row].fill_(len(p))
                self._slots[row:row + 1].fill_(-1 if self.delta_model is None else slots[i])
        return handles

    def _generator(self, seed, i):
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed + i)

    def _ensure_cache(self, prefill) -> None:
        if self._cache.keys:
            return
        for k, v in prefill:
            shape_k = (self.max_batch_size, k.shape[1], self.max_length, k.shape[3])
            shape_v = (self.max_batch_size, v.shape[1], self.max_length, v.shape[3])
            self._cache.keys.append(torch.zeros(shape_k, dtype=self.dtype, device=self.device))
            self._cache.values.append(torch.zeros(shape_v, dtype=self.dtype, device=self.device))

    def _accept(self, row: int, token: int) -> None:
        """Record a row's new token; finish the row on end-of-sequence or when it has all its tokens."""
        r = self._rows[row]
        if token in r.eos:
            self._release(row, "eos")
            return
        r.tokens.append(token)
        if len(r.tokens) >= r.max_new:
            self._release(row, "length")

    def _release(self, row: int, reason: str) -> None:
        r = self._rows[row]
        self._rows[row] = None
        self._finished.append(Finished(r.handle, r.tokens, reason))
        self._slots[row:row + 1].fill_(-1)  # idle rows read no delta
        self._ids[row].fill_(self.pad_token_id)
        if self.delta_model is not None:
            self.delta_model.cache.release([r.delta])

    def _compact(self) -> None:
        """Shift the cache left past the entries no active row needs, so the write index can go on."""
        starts = [r.start for r in self._rows if r is not None]
        shift = min(starts) if starts else self._ptr
        if shift <= 0:
            return
        keep = self.max_length - shift
        with torch.no_grad():
            for t in self._cache.keys + self._cache.values:
                t[:, :, :keep] = t[:, :, shift:].clone()
            self._mask[..., :keep] = self._mask[..., shift:].clone()
            self._mask[..., keep:] = self._neg
        for r in self._rows:
            if r is not None:
                r.start -= shift
        self._ptr -= shift
        self._cache.write.fill_(self._ptr)

    def _decode(self) -> None:
        if self._ahead:
            self._retire_unused()
        if self._ahead or self._may_launch_ahead():
            self._decode_ahead()
            return
        width = self._jacobi_width()
        if self._ptr + max(width, 1) > self.max_length:
            self._compact()
            if self._ptr + max(width, 1) > self.max_length:
                self._squeeze()  # Jacobi steps left holes: drop them
            if self._ptr >= self.max_length:  # cannot happen: admission checks prompt + max_new <= max_length
                raise DeltaZipError("the KV cache is full")
            width = min(width, self.max_length - self._ptr)
        t0 = time.perf_counter()
        used = self._step_usage()
        captures = self.captures
        accepted = None
        self._launched += 1
        span = _Span.start(self.device)
        if width > 1:
            accepted = self._jacobi_step(width)
            if span is not None:
                span.end()
            self._advance_staging()
        else:
            self._decode_step(used[1])
            self._advance_staging()  # host work while the device computes the step
            self._after_step(span)  # reads the tokens back: the step is done
        if span is not None:
            self.stats.add_device_s("decode_device_s", span.seconds())
        seconds = time.perf_counter() - t0
        # a step that captured a CUDA graph (and compiled its kernels) is no sample of a step's cost
        self._count_step(used, seconds, sample=self.captures == captures)
        for delta, gate in self._consulted.items():
            if width <= 1:
                gate.record(False, seconds)
            elif delta in self._wide_deltas:
                gate.record(True, seconds, accepted.get(delta))
            # a delta that rode along one token per step in another delta's wide step: no sample of either kind

    # -- steps launched ahead (AdmissionPolicy.overlap_steps)
    def _may_launch_ahead(self) -> bool:
        """Whether the next step may be launched before the last one's tokens are read back: asked for, and
        every active row's next input is the token its step picks on the device (no Jacobi blocks)."""
        if not self.admission.overlap_steps:
            return False
        return all(r is None or not r.jacobi for r in self._rows)

    def _in_step(self, job: _Launched) -> bool:
        return any(r is not None and r.first_step <= job.step for r in self._rows)

    def _retire_unused(self) -> None:
        """Read back (and count) the steps in flight whose rows have all finished since: nobody takes their tokens."""
        t0 = time.perf_counter()
        try:
            while self._ahead and not self._in_step(self._ahead[0]):
                self._retire(self._ahead.popleft(), accept=False)
        finally:
            self.stats.decode_s += time.perf_counter() - t0

    def _decode_ahead(self) -> None:
        """One token for every active row with the next step launched before this one's tokens are read back:
        launch a step if none is in flight, launch the next one if it may be, then read back the oldest."""
        t0 = time.perf_counter()
        try:
            if not self._ahead:
                self._launch()
            if self._may_launch_ahead() and self._room_for_step():
                self._launch()
                self.stats.ahead_steps += 1
            self._advance_staging()  # host work while the device computes
            self._retire(self._ahead.popleft())
        finally:
            self.stats.decode_s += time.perf_counter() - t0

    def _room_for_step(self) -> bool:
        """Whether the cache has an index for one more step (shifting it if that makes room)."""
        if self._ptr + 1 > self.max_length:
            self._compact()
        return self._ptr + 1 <= self.max_length

    def _launch(self) -> None:
        """Launch a one-token step, start copying its greedy tokens to the host, and set the next step's inputs
        on the device (this step's tokens, positions and write index one on) without waiting for it."""
        if not self._room_for_step():  # cannot happen: admission checks prompt + max_new <= max_length
            raise DeltaZipError("the KV cache is full")
        used = self._step_usage()
        captures = self.captures
        t0 = time.perf_counter()
        span = _Span.start(self.device)
        self._decode_step(used[1])
        self._draw(self._logits, self._next, self._sampling_rows())
        if span is not None:
            tokens = torch.empty(self._next.shape, dtype=self._next.dtype, pin_memory=True)
            tokens.copy_(self._next, non_blocking=True)
            span.end()
        else:
            tokens = self._next.clone()
        self._ptr += 1
        self._cache.write.add_(1)
        self._positions.add_(1)
        self._ids[:, 0].copy_(self._next)  # finished rows are set to the pad token when they are read back
        self._ahead.append(_Launched(self._launched, used, tokens, span, time.perf_counter() - t0,
                                     self.captures == captures))
        self._launched += 1

    def _retire(self, job: _Launched, accept: bool = True) -> None:
        """Read back a step launched ahead: its tokens go to the rows that were in it and are still active."""
        seconds = job.seconds
        if job.span is not None:
            seconds = job.span.seconds()
            self.stats.add_device_s("decode_device_s", seconds)
        self._count_step(job.used, seconds, sample=job.sample, wall=0.0)
        if not accept:
            return
        greedy = job.tokens.tolist()
        for i, r in enumerate(self._rows):
            if r is not None and r.first_step <= job.step:
                self._accept(i, greedy[i])

    # -- Jacobi steps
    def _advance_staging(self) -> None:
        """Write a module of each deferred staging (at least one piece), then more while the step just launched
        is still computing on the device (on a CPU the step is done by now: one piece per step)."""
        if self.delta_model is None:
            return
        cache = self.delta_model.cache
        if not cache.staging_pending:
            return
        t0 = time.perf_counter()
        more = None
        if self.device.type == "cuda":
            launched = torch.cuda.Event()
            launched.record(torch.cuda.current_stream(self.device))
            more = lambda: not launched.query()  # noqa: E731
        cache.advance_staging(steps=1, more=more)
        self.stats.stage_in_steps_s += time.perf_counter() - t0

    def _jacobi_width(self) -> int:
        """Tokens per row of the coming step: the widest block among the Jacobi rows whose delta's gate
        says wide (they are ``_wide_deltas``), or 1 (an ordinary step) while there are none. Each gate of a
        delta with Jacobi rows is asked once per step (``_consulted``)."""
        jacobi = {}
        for r in self._rows:
            if r is not None and r.jacobi > 1:
                jacobi[r.delta] = max(jacobi.get(r.delta, 0), r.jacobi)
        self._consulted = {d: self.jacobi_gate(d) for d in jacobi}
        self._wide_deltas = frozenset(d for d, gate in self._consulted.items() if gate.wide())
        return max((jacobi[d] for d in self._wide_deltas), default=1)

    def _jacobi_step(self, width: int) -> dict:
        """One forward over ``width`` tokens per row at cache indices ``[ptr, ptr + width)``; each row
        keeps (unmasks) the entries of the inputs it accepted. The Jacobi rows of the deltas in
        ``_wide_deltas`` get blocks; every other row takes one token. Returns, per delta with widened
        rows, the mean tokens its rows accepted."""
        b, dev, ptr = self.max_batch_size, self.device, self._ptr
        last = self._ids[:, 0].tolist()  # one read back; the blocks are built on the host and copied once
        host = [[t] * width for t in last]  # idle and one-token rows: their last token, then filler
        blocks = {}
        for i, r in enumerate(self._rows):
            if r is not None and r.jacobi > 1 and r.delta in self._wide_deltas:
                blocks[i] = [last[i]] + (r.guesses + [last[i]] * width)[: min(r.jacobi, width) - 1]
                host[i][: len(blocks[i])] = blocks[i]
        ids = torch.tensor(host, dtype=torch.long, device=dev)
        positions = self._positions + torch.arange(width, device=dev)
        mask = self._mask.expand(b, 1, width, self.max_length).clone()
        causal = torch.ones((width, width), dtype=torch.bool, device=dev).tril()
        mask[:, :, :, ptr:ptr + width] = torch.where(causal, 0.0, self._neg).to(self.dtype)
        names = [r.delta if r is not None else None for r in self._rows]
        route = self._host_route(names)
        write = self._cache.write  # a captured step reads this very tensor: put it back afterwards
        self._cache.write = torch.arange(ptr, ptr + width, device=dev)
        try:
            kwargs = {self._cache_kw: self._cache, "use_cache": True}
            # decode steps, however wide: decode-only activation sparsity thresholds them like one-token steps
            with torch.no_grad(), route, sparsify_positions_from(0):
                logits = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits
            nxt = logits.argmax(-1).tolist()
        finally:
            self._cache.write = write
        accepted = {}  # row -> its new tokens
        for i, r in enumerate(self._rows):
            if r is None:
                continue
            if i in blocks:
                block, row = blocks[i], nxt[i]
                a = 1
                while a < len(block) and block[a] == row[a - 1]:
                    a += 1
                accepted[i] = row[:a]
                r.guesses = row[a:len(block)]
            elif r.sample is not None:
                accepted[i] = self._choose(logits[i, :1].float(), [r.sample], [r.generator])
            else:
                accepted[i] = nxt[i][:1]
        # the rows' device state in three batched updates: each row sees the keys of the inputs it
        # accepted, its next input is its last new token, its positions move on by its count
        counts = torch.tensor([len(accepted.get(i, ())) for i in range(b)], device=dev)
        opened = torch.arange(width, device=dev)[None, :] < counts[:, None]
        self._mask[:, 0, 0, ptr:ptr + width].masked_fill_(opened, 0.0)
        self._ids[:, 0] = torch.tensor([accepted[i][-1] if i in accepted else last[i] for i in range(b)], device=dev)
        self._positions[:, 0] += counts
        for i, tokens in accepted.items():
            for t in tokens:
                self._accept(i, t)
                if self._rows[i] is None:
                    break
        accepted_counts = [len(accepted[i]) for i in blocks]
        self._ptr = ptr + width
        self._cache.write.fill_(self._ptr)
        self.stats.jacobi_steps += 1
        self.stats.jacobi_row_steps += len(accepted_counts)
        self.stats.jacobi_tokens += sum(accepted_counts)
        per_delta: dict = {}
        for i in blocks:
            per_delta.setdefault(names[i], []).append(len(accepted[i]))
        return {d: sum(c) / len(c) for d, c in per_delta.items()}

    def _squeeze(self) -> None:
        """Move each active row's visible cache entries together, right-aligned at a new write index,
        dropping the holes rejected Jacobi guesses left."""
        rows = [(i, r) for i, r in enumerate(self._rows) if r is not None]
        keep = {i: (self._mask[i, 0, 0, :self._ptr] == 0).nonzero().flatten() for i, _ in rows}
        ptr = max((len(k) for k in keep.values()), default=0)
        with torch.no_grad():
            for i, r in rows:
                idx, n = keep[i], len(keep[i])
                for t in self._cache.keys + self._cache.values:
                    t[i, :, ptr - n:ptr] = t[i, :, idx].clone()
                self._mask[i] = self._neg
                self._mask[i, 0, 0, ptr - n:ptr] = 0.0
                r.start = ptr - n
            for i, r in enumerate(self._rows):
                if r is None:
                    self._mask[i] = self._neg
        self._ptr = ptr
        self._cache.write.fill_(ptr)

    def _step_usage(self) -> tuple:
        """What the coming step works on: active rows, distinct deltas, their bytes, KV entries attended."""
        rows = [r for r in self._rows if r is not None]
        deltas = {r.delta for r in rows} - {None}
        nbytes = 0
        if self.delta_model is not None:
            cache = self.delta_model.cache
            nbytes = sum(cache.entry(n).nbytes or 0 for n in deltas if n in cache)
        entries = sum(self._ptr + 1 - r.start for r in rows)
        return len(rows), len(deltas), nbytes, entries

    def _count_step(self, used: tuple, seconds: float, sample: bool = True, wall: Optional[float] = None) -> None:
        """Count a decode step of ``seconds`` (``wall``: its part of ``decode_s``, if not those)."""
        rows, deltas, delta_bytes, entries = used
        st = self.stats
        st.decode_s += seconds if wall is None else wall
        st.decode_steps += 1
        st.row_steps += self.max_batch_size
        st.idle_row_steps += self.max_batch_size - rows
        st.distinct_deltas += deltas
        kv = sum(t.numel() * t.element_size() for t in self._cache.keys + self._cache.values)
        kv_per_entry = kv / (self.max_batch_size * self.max_length)
        st.bytes_read += self._base_bytes + delta_bytes + kv
        st.floor_bytes += self._base_bytes + delta_bytes + int(kv_per_entry * entries)
        st.captures = self.captures
        if deltas and sample:
            n, total = self._step_costs.get(deltas, (0, 0.0))
            self._step_costs[deltas] = (n + 1, total + seconds)
            if st.decode_steps % 16 == 0:
                self._step_fit = fit_step_costs(self._step_costs)
                if self.max_deltas == "auto":
                    st.max_deltas_auto = _cap_of(self._step_fit)

    def _route_of(self, deltas: int) -> Optional[str]:
        """The kernel route (``"split"`` or ``"fused"``) of a decode step whose rows carry ``deltas`` distinct
        deltas, as the model's ``KernelPolicy`` chooses it; ``None`` without kernels."""
        if self.delta_model is None or not self._wants_kernels():
            return None
        return self.delta_model.kernel_policy.decode_route(self.max_batch_size, deltas, self.device)

    @contextmanager
    def _route_scope(self, route: Optional[str]):
        with self.delta_model.kernel_policy.step_route(route) if route is not None else nullcontext():
            yield

    def _decode_step(self, deltas: int = 0) -> None:
        route = self._route_of(deltas)
        self.stats.split_steps += route == "split"
        if self.cuda_graphs and not self._graph_failed and self._graph_safe():
            version = self._layout_version()
            held = self._graphs.get(route)
            if held is None or held[1] != version:
                self._capture(version, route)
                held = self._graphs.get(route)
            if held is not None:
                held[0].replay()
            else:
                self._run_step(route)
        else:
            self._run_step(route)

    def _run_step(self, route: Optional[str] = None) -> None:
        """One eager decode step (CPU, or models a captured step cannot run)."""
        if self.delta_model is not None and self._graph_safe() and self._wants_kernels():
            try:
                with self._static_rows(), self._route_scope(route):
                    self._body()
                return
            except DeltaZipError:  # a module that needs host-side routing: route on the host from now on
                self._static_failed = True
        with self._host_route([r.delta if r is not None else None for r in self._rows]):
            self._body()

    def _host_route(self, names: list):
        """The routing of a step whose delta modules route rows on the host. A row's inputs are tokens picked from
        its own logits, so inside its vocabulary: the bounds passed spare an embedding delta reading them back."""
        if self.delta_model is None:
            return nullcontext()
        vocab = {n: self.vocab_size(n) for n in set(names)}  # a few distinct deltas, not one lookup per row
        if None in vocab.values():
            return self.delta_model.route(names)
        return self.delta_model.route(names, [vocab[n] - 1 for n in names])

    def _body(self) -> None:
        """The step a graph captures: open the write index in every row's mask, run the model, pick greedy tokens."""
        with torch.no_grad():
            self._mask.index_fill_(3, self._cache.write, 0.0)
            kwargs = {self._cache_kw: self._cache, "use_cache": True}
            out = self.lm(input_ids=self._ids, attention_mask=self._mask, position_ids=self._positions, **kwargs)
            logits = out.logits[:, -1, :]
            if self._logits is None or self._logits.shape != logits.shape:
                self._logits = torch.empty(logits.shape, dtype=torch.float32, device=self.device)
            self._logits.copy_(logits)
            self._next.copy_(logits.argmax(-1))

    def _after_step(self, span: Optional["_Span"] = None) -> None:
        self._draw(self._logits, self._next, self._sampling_rows())
        if span is not None:
            span.end()
        chosen = self._next.tolist()  # the one read-back of a step, sampled rows included
        self._ptr += 1
        self._cache.write.add_(1)
        self._positions.add_(1)
        self._ids[:, 0].copy_(self._next)  # next inputs stay on the device; finished rows are reset below
        for i, r in enumerate(self._rows):
            if r is not None:
                self._accept(i, chosen[i])

    def _sampling_rows(self) -> list:
        return [(i, r.sample, r.generator) for i, r in enumerate(self._rows) if r is not None and r.sample is not None]

    def _choose(self, logits: torch.Tensor, samples: list, generators: list) -> list:
        """Greedy or sampled next tokens for a few rows of logits (read back to the host)."""
        out = logits.argmax(-1)
        self._draw(logits, out, [(i, s, generators[i]) for i, s in enumerate(samples) if s is not None])
        return out.tolist()

    @staticmethod
    def _draw(logits: torch.Tensor, out: torch.Tensor, rows: list) -> None:
        """For each ``(i, sample, generator)`` of ``rows``, replace ``out[i]`` with a token drawn from row ``i`` of
        ``logits`` by the row's generator, on the logits' device: nothing is read back, so a step's draws queue
        behind it (one read-back per step, not one per sampled row)."""
        for i, s, generator in rows:
            row = logits[i].float() / max(s["temperature"], 1e-5)
            if s["top_k"]:
                kth = torch.topk(row, min(s["top_k"], row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if s["top_p"] < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                cum = sorted_logits.softmax(-1).cumsum(-1)
                drop = cum - sorted_logits.softmax(-1) > s["top_p"]
                row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            out[i:i + 1].copy_(torch.multinomial(row.softmax(-1), 1, generator=generator))

    # -- graphs
    def _wants_kernels(self) -> bool:
        return self.delta_model.uses_kernels(self.device)

    def _graph_safe(self) -> bool:
        if self.delta_model is None:
            return True
        return not self._static_failed and self.delta_model.graph_safe()

    def _layout_version(self):
        return None if self.delta_model is None else self.delta_model.layout_version.value

    @contextmanager
    def _static_rows(self):
        """Route every delta module by the device tensor of row slots (what a captured step reads)."""
        with self.delta_model.route_static(self._slots) if self.delta_model is not None else nullcontext():
            yield

    def _capture(self, version, route: Optional[str] = None) -> None:
        # graphs of an older layout are dropped (their memory with them) before another is captured
        self._graphs = {r: held for r, held in self._graphs.items() if held[1] == version and r != route}
        torch.cuda.synchronize(self.device)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self._static_rows(), self._route_scope(route):
                self._body()  # warm-up: compiles kernels, allocates workspaces (the step is idempotent)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with (torch.cuda.graph(graph, capture_error_mode="thread_local"), self._static_rows(),
                  self._route_scope(route)):
                self._body()
        except Exception as e:  # an architecture whose forward syncs with the host: decode eagerly
            self._graph_failed = True
            warnings.warn(f"DecodeEngine: CUDA graph capture failed ({e}); decoding without graphs")
            torch.cuda.synchronize(self.device)
            return
        self._graphs[route] = (graph, version)
        self.captures += 1


def _weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter once, less the input embedding
    table (a step gathers a row per token from it) unless the LM head shares it."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set()
    if embed is not None and getattr(embed, "weight", None) is not None:
        tied = head is not None and getattr(head, "weight", None) is embed.weight
        if not tied:
            skip.add(id(embed.weight))
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total
