"""`DecodeEngine`: a static-KV-cache decoder for continuous batching, with CUDA-graph decode steps.

The engine owns ``max_batch_size`` rows. :meth:`DecodeEngine.add` admits requests into free rows at
any time (one batched prefill; each row's first token comes out of it) and :meth:`DecodeEngine.step`
decodes one token for every active row. Rows finish on their own (``max_new_tokens`` or an
end-of-sequence token) and their row is free for the next request: continuous batching. With a
:class:`~hf_deltazip.DeltaModel` every row may use a different delta.

How it stays static (so one captured CUDA graph serves every step):

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

On a CPU, or for models whose deltas cannot run in a captured step (fine-tunes that add tokens or
replace norms), steps run eagerly with the same cache. Prefill always runs eagerly.

Example:
    >>> engine = DecodeEngine(model, max_batch_size=16, max_length=512)
    >>> handles = engine.add([ids_a, ids_b], ["chat", None], max_new_tokens=32)
    >>> while engine.active:
    ...     for handle, tokens in engine.step():
    ...         print(handle, tokens)
"""

from __future__ import annotations

import inspect
import threading
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..errors import DeltaZipError
from ..modeling.quantized import device_map_problem
from ..modeling.routing import BatchRouting

__all__ = ["DecodeEngine", "Finished"]

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
class _Row:
    handle: int
    delta: Optional[str]
    start: int  # first cache index of the prompt
    max_new: int
    eos: frozenset
    sample: Optional[dict]
    generator: Optional[torch.Generator]
    tokens: list = field(default_factory=list)


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
        max_deltas: most distinct deltas among the active rows (``None``: no limit). A decode step
            reads every delta its rows use, so its time grows with their number; :meth:`can_add`
            holds back requests for other deltas while the limit is reached, and they get in (oldest
            first, when the caller admits in arrival order) as rows of running deltas finish.
    """

    def __init__(self, model, *, max_batch_size: int = 32, max_length: int = 1024,
                 cuda_graphs: Optional[bool] = None, pad_token_id: int = 0, max_deltas: Optional[int] = None):
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
        problem = device_map_problem(self.lm)
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
        if max_deltas is not None and max_deltas < 1:
            raise DeltaZipError(f"max_deltas must be a positive integer or None, got {max_deltas}")
        self.max_deltas = max_deltas
        params = inspect.signature(self.lm.forward).parameters
        self._cache_kw = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._lock = threading.RLock()
        self._next_handle = 0
        self._rows: list[Optional[_Row]] = [None] * max_batch_size
        self._finished: list[Finished] = []
        self._ptr = 0  # host copy of the write index
        self._graph = None
        self._graph_version = None
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

    # ------------------------------------------------------------------ public
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
            if self.max_deltas is not None:
                running = {r.delta for r in rows} | set(delta_names)
                if len(running - {None}) > self.max_deltas:
                    return False
        shift = min(r.start for r in rows) if rows else self._ptr
        ptr = max(self._ptr - shift, prompt_len)
        return all(ptr - (r.start - shift) + (r.max_new - len(r.tokens)) <= self.max_length for r in rows)

    def add(self, prompts: Sequence, delta_names: Optional[Sequence] = None, *,
            max_new_tokens: Union[int, Sequence[int]] = 32, eos_token_id=_MODEL_DEFAULT, do_sample: bool = False,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None) -> list:
        """Admit requests into free rows: one batched prefill, which also picks each row's first token.

        Args:
            prompts: token ids per request (lists or 1-D tensors).
            delta_names: the delta of each request (``None``: the base); default all ``None``.
            max_new_tokens: per request, or one value for all.
            eos_token_id: an id or a list of ids that end a request (the token is not returned);
                default: the model's ``generation_config.eos_token_id``; ``None``: never stop early.
            do_sample, temperature, top_k, top_p, seed: sampling instead of greedy choice.

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
        if self.delta_model is None and any(x is not None for x in names):
            raise DeltaZipError("this engine runs a plain model: delta names must be None (use a DeltaModel for deltas)")
        if eos_token_id is _MODEL_DEFAULT:
            eos_token_id = getattr(getattr(self.lm, "generation_config", None), "eos_token_id", None)
        eos = frozenset([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else None
        with self._lock, self._model_lock():
            return self._admit(prompts, names, news, eos, sample, seed)

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

    def _admit(self, prompts, names, news, eos, sample, seed) -> list:
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
        ids, real = ids.to(self.device), real.to(self.device)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & real[:, None, :]
        mask = torch.full((n, 1, width, width), self._neg, dtype=self.dtype, device=self.device)
        mask.masked_fill_(allowed[:, None], 0.0)
        if self.delta_model is not None:  # held deltas stay resident (and keep their slots) until released
            slots = self.delta_model.cache.acquire(names)
        route = self.delta_model.router.use(BatchRouting.per_row(slots)) if self.delta_model is not None else nullcontext()
        self._cache.prefill = [None] * self._cache.layers
        try:
            kwargs = {self._cache_kw: self._cache, "use_cache": True}
            if self._keep_kw:
                kwargs["logits_to_keep"] = 1
            with torch.no_grad(), route:
                out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
            logits = out.logits[:, -1, :]
            prefill = self._cache.prefill
        except BaseException:
            if self.delta_model is not None:
                self.delta_model.cache.release(names)
            raise
        finally:
            self._cache.prefill = None
        if any(kv is None for kv in prefill):
            raise DeltaZipError("the model did not hand every layer's keys to the cache: this architecture is not supported by DecodeEngine")
        self._ensure_cache(prefill)
        lo, hi = self._ptr - width, self._ptr
        index = torch.tensor(rows, device=self.device)
        with torch.no_grad():
            for layer, (k, v) in enumerate(prefill):
                self._cache.keys[layer][index, :, lo:hi] = k.to(self.dtype)
                self._cache.values[layer][index, :, lo:hi] = v.to(self.dtype)
            row_mask = torch.full((n, 1, 1, self.max_length), self._neg, dtype=self.dtype, device=self.device)
            row_mask[:, 0, 0, lo:hi].masked_fill_(real, 0.0)
            self._mask[index] = row_mask
        handles = []
        generators = [self._generator(seed, i) for i in range(n)]
        firsts = self._choose(logits, [sample] * n, generators)
        for i, (row, p) in enumerate(zip(rows, prompts)):
            handle = self._next_handle
            self._next_handle += 1
            handles.append(handle)
            r = _Row(handle=handle, delta=names[i], start=hi - len(p), max_new=news[i], eos=eos,
                     sample=sample, generator=generators[i])
            self._rows[row] = r
            self._accept(row, firsts[i])
            if self._rows[row] is not None:
                self._ids[row, 0] = firsts[i]
                self._positions[row, 0] = len(p)
                self._slots[row] = -1 if self.delta_model is None else slots[i]
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
        self._slots[row] = -1  # idle rows read no delta
        self._ids[row, 0] = self.pad_token_id
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
        if self._ptr >= self.max_length:
            self._compact()
            if self._ptr >= self.max_length:  # cannot happen: admission checks prompt + max_new <= max_length
                raise DeltaZipError("the KV cache is full")
        if self.cuda_graphs and not self._graph_failed and self._graph_safe():
            version = self._layout_version()
            if self._graph is None or self._graph_version != version:
                self._capture(version)
            if self._graph is not None:
                self._graph.replay()
            else:
                self._run_step()
        else:
            self._run_step()
        self._after_step()

    def _run_step(self) -> None:
        """One eager decode step (CPU, or models a captured step cannot run)."""
        if self.delta_model is not None and self._graph_safe() and self._wants_kernels():
            try:
                with self._static_rows():
                    self._body()
                return
            except DeltaZipError:  # a module that needs host-side routing: route on the host from now on
                self._static_failed = True
        names = [r.delta if r is not None else None for r in self._rows]
        route = self.delta_model.route(names) if self.delta_model is not None else nullcontext()
        with route:
            self._body()

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

    def _after_step(self) -> None:
        greedy = self._next.tolist()
        sampling = [i for i, r in enumerate(self._rows) if r is not None and r.sample is not None]
        chosen = dict(zip(sampling, self._choose(self._logits[sampling], [self._rows[i].sample for i in sampling],
                                                 [self._rows[i].generator for i in sampling]))) if sampling else {}
        self._ptr += 1
        self._cache.write.add_(1)
        self._positions.add_(1)
        self._ids[:, 0].copy_(self._next)  # next inputs stay on the device; sampled rows and finished rows below
        for i, token in chosen.items():
            self._ids[i, 0] = token
        for i, r in enumerate(self._rows):
            if r is not None:
                self._accept(i, chosen.get(i, greedy[i]))

    def _choose(self, logits: torch.Tensor, samples: list, generators: list) -> list:
        """Greedy or sampled next tokens for a few rows of logits."""
        out = logits.argmax(-1).tolist()
        for i, s in enumerate(samples):
            if s is None:
                continue
            row = logits[i].float() / max(s["temperature"], 1e-5)
            if s["top_k"]:
                kth = torch.topk(row, min(s["top_k"], row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if s["top_p"] < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                cum = sorted_logits.softmax(-1).cumsum(-1)
                drop = cum - sorted_logits.softmax(-1) > s["top_p"]
                row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            out[i] = int(torch.multinomial(row.softmax(-1), 1, generator=generators[i]))
        return out

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

    def _capture(self, version) -> None:
        self._graph = None
        torch.cuda.synchronize(self.device)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self._static_rows():
                self._body()  # warm-up: compiles kernels, allocates workspaces (the step is idempotent)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"), self._static_rows():
                self._body()
        except Exception as e:  # an architecture whose forward syncs with the host: decode eagerly
            self._graph_failed = True
            warnings.warn(f"DecodeEngine: CUDA graph capture failed ({e}); decoding without graphs")
            torch.cuda.synchronize(self.device)
            return
        self._graph, self._graph_version = graph, version
        self.captures += 1
