"""`DeltaServer`: many callers, many deltas, one base: requests are queued and run in shared batches.

By default admission is continuous: a worker thread runs a :class:`~hf_deltazip.engine.DecodeEngine`
(static KV cache, CUDA-graph decode steps on a GPU) and, between two decode steps, puts waiting
requests into free rows; a request's row is freed the step it finishes. Every row uses its own delta.
While requests wait, their deltas are prefetched (read and decompressed on a CPU thread, uploaded on a
side stream). Requests with generation options the engine does not implement (beam search, logits
processors, ...) run through :meth:`DeltaModel.generate` as their own batch between decode steps;
``continuous=False`` runs every request that way (dynamic batching per batch).

Streaming: :meth:`DeltaServer.stream` gives a :class:`TokenStream` that yields token ids as they are
decoded, and ``submit(..., on_token=callback)`` calls ``callback(new_ids, finish_reason)`` from the
worker thread (the form an event loop wants). Cancelling a request's Future (``future.cancel()``, or
:meth:`TokenStream.cancel`) drops it from the queue or frees its row before the next decode step.
``max_queue`` bounds the requests waiting for a row: :meth:`submit` raises :class:`QueueFullError`
past it.

Admission (continuous mode) follows the engine's :class:`~hf_deltazip.serving.AdmissionPolicy`:
waiting requests whose delta is already decoding go first (they add rows, not bytes, to a step), but
no request is passed over by more than ``max_bypass`` later ones (default ``16 * max_batch_size``);
one round prefills at most ``max_prefill_tokens`` prompt tokens, so a burst of arrivals does not stall
the decoding rows for long. :attr:`DeltaServer.engine_stats` says where the time went (prefill,
loads, decode steps, idle rows; distinct deltas and bytes per step).

Example:
    >>> server = DeltaServer(model, tokenizer, max_batch_size=16)
    >>> futures = [server.submit("reverse: a b c", delta_name=n, max_new_tokens=8) for n in ("chat", "code", None)]
    >>> [f.result() for f in futures]
    >>> for token_id in server.stream("reverse: a b c", delta_name="chat", max_new_tokens=8):
    ...     print(tokenizer.decode([token_id]), end="")
    >>> server.close()
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..errors import DeltaZipError
from ..modeling.cache import CacheFullError, Residency
from .engine import Pending


class QueueFullError(DeltaZipError):
    """The server's queue of waiting requests is full (``max_queue``): retry later or raise the limit."""


#: ``on_token(new_ids, finish_reason)``: ``finish_reason`` is ``None`` while the request decodes, then one of
#: ``"eos"``, ``"length"``, ``"cancelled"`` or ``"error"`` (the Future holds the exception) in the last call.
TokenCallback = Callable[[list, Optional[str]], None]


@dataclass
class _Request:
    ids: list
    delta: Optional[str]
    kwargs: dict
    text: bool
    future: Future
    on_token: Optional[TokenCallback] = None
    sent: int = 0  # tokens handed to on_token so far
    submitted: float = field(default_factory=time.perf_counter)
    bypassed: int = 0  # later requests admitted before it (the engine's fairness bound applies)


class TokenStream:
    """The tokens of one request as they are decoded: iterate it for token ids (it blocks while the
    request decodes and ends when it finishes). Made by :meth:`DeltaServer.stream`.

    Attributes:
        future: the request's Future (all new tokens, or a string for a text prompt, once finished).
        finish_reason: ``None`` until the iteration ends, then ``"eos"``, ``"length"`` or ``"cancelled"``.
    """

    def __init__(self):
        self.future: Optional[Future] = None
        self.finish_reason: Optional[str] = None
        self._parts: "queue.Queue[tuple]" = queue.Queue()
        self._ready: deque = deque()

    def push(self, tokens: list, finish_reason: Optional[str]) -> None:
        """The :data:`TokenCallback` the server calls (from its worker thread)."""
        self._parts.put((list(tokens), finish_reason))

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        while not self._ready:
            if self.finish_reason is not None:
                raise StopIteration
            tokens, reason = self._parts.get()
            self._ready.extend(tokens)
            if reason == "error":
                self.finish_reason = reason
                raise self.future.exception()
            self.finish_reason = reason
        return self._ready.popleft()

    def cancel(self) -> None:
        """Stop the request: its row is freed before the next decode step; the iteration ends."""
        self.future.cancel()


@dataclass
class RequestStats:
    """Timing of one finished request (seconds from submission)."""

    queued: float  # until its prefill started
    total: float  # until its last token
    batch_size: int  # rows decoding when it was admitted (continuous) or its batch's size
    new_tokens: int
    first_token: float = float("nan")  # until its first token (continuous admission)
    finish_reason: str = ""  # "eos", "length" or "cancelled"


# generate() options the engine implements; others take the generate() path
_ENGINE_OPTIONS = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "seed", "pad_token_id",
                   "decoding", "jacobi_block_size"}


class DeltaServer:
    """Serve :class:`~hf_deltazip.DeltaModel` requests from many threads in shared batches.

    Args:
        model: the model with every delta the requests may name already loaded (resident or not).
        tokenizer: needed for text prompts and decoded answers; token-id prompts work without one.
        max_batch_size: most requests in one batch.
        max_wait_s: how long the worker waits for more requests before it starts a batch.
        pad_token_id: padding for left-padded batches (default: the tokenizer's, else 0).
        continuous: admit requests between decode steps (default) instead of per batch.
        max_length: KV-cache length per row in continuous mode (prompt + new tokens must fit).
        cuda_graphs: capture decode steps as CUDA graphs (default: on CUDA).
        max_deltas: most distinct deltas decoding at once (continuous mode). Each step reads every
            delta its rows use: a limit trades some latency for throughput. ``"auto"`` (default): the
            engine picks it from measured step costs (see :func:`~hf_deltazip.serving.engine.auto_max_deltas`);
            ``None``: no limit.
        admission: the engine's :class:`~hf_deltazip.serving.engine.AdmissionPolicy` (which waiting
            requests get free rows; the fairness bound); default: its defaults.
        max_queue: most requests waiting for a row (``None``: no limit); :meth:`submit` raises
            :class:`QueueFullError` beyond it, so an overloaded server answers at once instead of late.
        max_stats: most :class:`RequestStats` kept in :attr:`stats` (the latest ones; ``None``: all).
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 32, max_wait_s: float = 0.002,
                 pad_token_id: Optional[int] = None, continuous: bool = True, max_length: int = 1024,
                 cuda_graphs: Optional[bool] = None, max_deltas="auto", admission=None,
                 max_queue: Optional[int] = None, max_stats: Optional[int] = 100_000):
        if max_batch_size < 1:
            raise DeltaZipError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_queue is not None and max_queue < 1:
            raise DeltaZipError(f"max_queue must be a positive integer or None, got {max_queue}")
        from ..modeling import DeltaModel

        self.model = model
        self._has_deltas = isinstance(model, DeltaModel)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id
        self.stats: "deque[RequestStats]" = deque(maxlen=max_stats)
        self.max_queue = max_queue
        self._submit_lock = threading.Lock()
        self._queue: "queue.Queue[Optional[_Request]]" = queue.Queue()
        self._held: list[_Request] = []
        self._closed = False
        self.engine = None
        if continuous:
            from .engine import DecodeEngine

            try:
                self.engine = DecodeEngine(model, max_batch_size=max_batch_size, max_length=max_length,
                                           cuda_graphs=cuda_graphs, pad_token_id=self.pad_token_id, max_deltas=max_deltas,
                                           admission=admission)
            except DeltaZipError as e:  # an architecture the engine cannot run: batch per batch instead
                warnings.warn(f"DeltaServer: {e}; admitting requests per batch (continuous=False)")
                continuous = False
        self._running: dict = {}  # engine handle -> (request, admitted at, batch size, first token at)
        self._prefetched: set = set()
        self._worker = threading.Thread(target=self._run_continuous if continuous else self._run,
                                        name="deltazip-server", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public
    def submit(self, prompt, delta_name: Optional[str] = None, *, on_token: Optional[TokenCallback] = None,
               **generate_kwargs) -> Future:
        """Queue one request; the Future gives the new tokens (a string for a text prompt, else ids).

        Args:
            prompt: text (needs the tokenizer) or a list / 1-D tensor of token ids.
            delta_name: the delta to answer with; ``None`` for the plain base.
            on_token: called from the worker thread as ``on_token(new_ids, finish_reason)`` each time
                the request has new tokens (one per decode step; all at once for requests that take
                the ``generate()`` path) and a last time with its finish reason (see :data:`TokenCallback`).
                Keep it short: it runs between decode steps. If it raises, the request is cancelled.
            generate_kwargs: ``max_new_tokens``, ``do_sample``, ``temperature``, ``decoding="jacobi"``
                (with ``jacobi_block_size``), ... (requests batch together only with requests of equal
                settings; Jacobi rows decode in the same steps as the others).

        Cancelling the returned Future (``future.cancel()``) stops the request: it leaves the queue, or
        its row is freed before the next decode step.

        Raises:
            QueueFullError: ``max_queue`` requests are waiting already.
            DeltaZipError: the server is closed, the delta is not loaded, the prompt is empty or too long or
                holds a token id outside the vocabulary it would be answered with.
        """
        if self._closed:
            raise DeltaZipError("this DeltaServer is closed")
        if delta_name is not None and delta_name not in self.model.deltas:
            raise DeltaZipError(f"no delta named {delta_name!r} is loaded; loaded: {self.model.deltas}")
        text = isinstance(prompt, str)
        if text:
            if self.tokenizer is None:
                raise DeltaZipError("text prompts need a tokenizer: DeltaServer(model, tokenizer)")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise DeltaZipError("empty prompt")
        if self.engine is not None:  # here, not at admission, where it would fail the requests batched with it
            self.engine.check_prompt(ids, delta_name)
        if self.engine is not None and set(generate_kwargs) <= _ENGINE_OPTIONS:
            need = len(ids) + generate_kwargs.get("max_new_tokens", 20)
            if need > self.engine.max_length:
                raise DeltaZipError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens is {need}, over max_length={self.engine.max_length}: "
                    "raise DeltaServer(max_length=...) or ask for fewer tokens"
                )
        future: Future = Future()
        with self._submit_lock:
            if self.max_queue is not None and self.waiting >= self.max_queue:
                raise QueueFullError(f"{self.waiting} requests are waiting (max_queue={self.max_queue}): retry later")
            self._queue.put(_Request(ids, delta_name, dict(generate_kwargs), text, future, on_token))
        return future

    def stream(self, prompt, delta_name: Optional[str] = None, **generate_kwargs) -> TokenStream:
        """Queue one request and get its tokens as they are decoded (see :class:`TokenStream`)."""
        stream = TokenStream()
        stream.future = self.submit(prompt, delta_name, on_token=stream.push, **generate_kwargs)
        return stream

    @property
    def waiting(self) -> int:
        """Requests queued and not decoding yet."""
        return self._queue.qsize() + len(self._held)

    @property
    def engine_stats(self):
        """Where the decode engine's time went (an :class:`~hf_deltazip.serving.engine.EngineStats`:
        prefill, loads, decode steps, idle rows, distinct deltas and bytes per step); ``None`` when
        requests are admitted per batch (``continuous=False``)."""
        return None if self.engine is None else self.engine.stats

    @property
    def running(self) -> int:
        """Requests decoding now (continuous admission)."""
        return len(self._running)

    def generate(self, prompts: Sequence, delta_names: Sequence, **generate_kwargs) -> list:
        """Submit several requests and wait for all of them."""
        if len(prompts) != len(delta_names):
            raise DeltaZipError(f"{len(prompts)} prompts but {len(delta_names)} delta names: give one per prompt")
        futures = [self.submit(p, d, **generate_kwargs) for p, d in zip(prompts, delta_names)]
        return [f.result() for f in futures]

    def close(self, timeout: Optional[float] = 60) -> None:
        """Finish the queued requests and stop the worker."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ worker
    def _take(self) -> list:
        """The next batch: waiting requests with the settings of the oldest one."""
        pending = self._held
        self._held = []
        if not pending:
            item = self._queue.get()
            if item is None:
                return []
            pending.append(item)
        deadline = time.perf_counter() + self.max_wait_s
        stop = False
        while True:
            timeout = deadline - time.perf_counter()
            try:
                item = self._queue.get(timeout=max(timeout, 0)) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            pending.append(item)
        pending = self._drop_cancelled(pending)
        if not pending:
            if stop:
                self._queue.put(None)
            return self._take() if not stop else []
        key = _settings_key(pending[0].kwargs)
        batch = [r for r in pending if _settings_key(r.kwargs) == key][: self.max_batch_size]
        chosen = set(map(id, batch))
        self._held = [r for r in pending if id(r) not in chosen]
        if stop:
            self._queue.put(None)
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                if self._held:
                    continue
                return
            waiting = [r.delta for r in self._held if r.delta is not None]
            if waiting and self._has_deltas:
                try:
                    self.model.prefetch(list(dict.fromkeys(waiting)))
                except Exception:
                    pass
            self._finish_batch(batch)

    # ------------------------------------------------------------------ continuous admission
    def _run_continuous(self) -> None:
        engine = self.engine
        stop = False
        while True:
            # wait for work only when nothing runs
            block = not self._running and not self._held and not stop
            try:
                item = self._queue.get(timeout=None) if block else self._queue.get_nowait()
                while True:
                    if item is None:
                        stop = True
                    else:
                        self._held.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            self._held = self._drop_cancelled(self._held)
            if stop and not self._held and not self._running:
                return
            other = [r for r in self._held if not set(r.kwargs) <= _ENGINE_OPTIONS]
            if other:  # options only generate() has: their own batch, between two decode steps
                self._held = [r for r in self._held if set(r.kwargs) <= _ENGINE_OPTIONS]
                for key in dict.fromkeys(_settings_key(r.kwargs) for r in other):
                    self._finish_batch([r for r in other if _settings_key(r.kwargs) == key])
            self._admit()
            self._stream_progress()  # first tokens come out of add()'s prefill
            self._prefetch_waiting()
            self._cancel_running()
            if not self._running:
                continue
            try:
                finished = engine.step()  # also reports rows that finished inside add()
            except BaseException as e:  # the running requests see the error; the server keeps going
                for r, *_rest in list(self._running.values()):
                    self._fail(r, e)
                self._running.clear()
                engine.reset()
                continue
            done = time.perf_counter()
            for f in finished:
                entry = self._running.pop(f.handle, None)
                if entry is None:  # cancelled by us: settled already
                    continue
                r, admitted, rows, first = entry
                self.stats.append(RequestStats(admitted - r.submitted, done - r.submitted, rows, len(f.tokens),
                                               first - r.submitted, f.reason))
                self._resolve(r, f.tokens, f.reason)
            self._stream_progress()

    def _drop_cancelled(self, requests: list) -> list:
        """Requests whose caller has not cancelled them; the cancelled ones hear so."""
        keep = []
        for r in requests:
            if r.future.cancelled():
                self._notify(r, [], "cancelled")
            else:
                keep.append(r)
        return keep

    def _cancel_running(self) -> None:
        """Free the rows of running requests whose caller cancelled them."""
        for handle, (r, admitted, rows, first) in list(self._running.items()):
            if r.future.cancelled():
                try:
                    tokens = self.engine.tokens(handle)
                except DeltaZipError:  # finished inside add(); the next step() reports it, unclaimed
                    tokens = []
                self.engine.cancel(handle)
                del self._running[handle]
                now = time.perf_counter()
                self.stats.append(RequestStats(admitted - r.submitted, now - r.submitted, rows, len(tokens),
                                               first - r.submitted, "cancelled"))
                self._notify(r, tokens[r.sent:], "cancelled")

    def _stream_progress(self) -> None:
        """Hand the tokens decoded since the last call to the running requests that stream."""
        for handle, (r, *_rest) in list(self._running.items()):
            if r.on_token is None:
                continue
            try:
                new = self.engine.tokens(handle, r.sent)
            except DeltaZipError:  # finished inside add(): the next step() reports it whole
                continue
            if new and not self._notify(r, new, None):
                r.future.cancel()  # a callback that fails: stop decoding for it

    def _notify(self, r: _Request, tokens: list, reason: Optional[str]) -> bool:
        """Call the request's ``on_token``; False when it raised (it is called no more)."""
        if r.on_token is None:
            return True
        r.sent += len(tokens)
        try:
            r.on_token(tokens, reason)
            return True
        except Exception as e:  # the caller's bug must not stop the worker
            warnings.warn(f"DeltaServer: on_token raised {e!r}; cancelling that request")
            r.on_token = None
            return False

    def _admit(self) -> None:
        """Put waiting requests into free rows as the engine's admission policy picks them (deltas
        already in the step first, no request bypassed more than a bounded number of times), grouped
        by their sampling settings."""
        engine = self.engine
        pending = [Pending(len(r.ids), r.delta, r, r.bypassed) for r in self._held]
        picked = engine.pick(pending)
        for p in pending:
            p.item.bypassed = p.bypassed
        waiting = [p.item for p in picked]
        admitted = set()
        for key in dict.fromkeys(_settings_key(r.kwargs) for r in waiting):
            group = [r for r in waiting if _settings_key(r.kwargs) == key]
            kwargs = dict(group[0].kwargs)
            kwargs.pop("pad_token_id", None)
            kwargs.setdefault("max_new_tokens", 20)
            if "eos_token_id" not in kwargs and self.tokenizer is not None:
                kwargs["eos_token_id"] = self.tokenizer.eos_token_id
            started = time.perf_counter()
            try:
                handles = engine.add([r.ids for r in group], [r.delta for r in group], **kwargs)
            except CacheFullError as e:
                if engine.active:
                    break  # the deltas in use fill the resident budget: wait for rows to finish
                for r in group:
                    self._fail(r, e)
                    admitted.add(id(r))
                continue
            except DeltaZipError as e:
                for r in group:
                    self._fail(r, e)
                    admitted.add(id(r))
                continue
            first = time.perf_counter()
            for h, r in zip(handles, group):
                self._running[h] = (r, started, engine.active, first)
                admitted.add(id(r))
            # requests that finished inside add() are reported by the next step()
        self._held = [r for r in self._held if id(r) not in admitted]

    def _prefetch_waiting(self) -> None:
        if not self._has_deltas:  # a plain transformers model: nothing to prefetch
            return
        cache = self.model.cache
        loaded = {n for n in cache.names if cache.state(n) is not Residency.DISK}
        self._prefetched -= loaded  # asked for and arrived: may be asked for again once evicted
        names = [r.delta for r in self._held if r.delta is not None]
        names = [n for n in dict.fromkeys(names) if n not in loaded and n not in self._prefetched]
        if names:
            self._prefetched.update(names)
            try:
                self.model.prefetch(names)
            except Exception:  # prefetching is an optimisation: the request loads its delta when admitted
                self._prefetched.difference_update(names)

    def _finish_batch(self, batch: list) -> None:
        batch = self._drop_cancelled(batch)
        if not batch:
            return
        started = time.perf_counter()
        try:
            outputs = self._run_batch(batch)
        except BaseException as e:  # the callers see the error; the server keeps going
            for r in batch:
                self._fail(r, e)
            return
        done = time.perf_counter()
        for r, (out, reason) in zip(batch, outputs):
            self.stats.append(RequestStats(started - r.submitted, done - r.submitted, len(batch), len(out),
                                           finish_reason=reason))
            self._resolve(r, out, reason)

    def _resolve(self, r: _Request, out: list, reason: str) -> None:
        self._notify(r, out[r.sent:], reason)
        try:
            r.future.set_result(self.tokenizer.decode(out, skip_special_tokens=True) if r.text else out)
        except InvalidStateError:  # cancelled by its caller meanwhile
            pass

    def _fail(self, r: _Request, error: BaseException) -> None:
        try:
            r.future.set_exception(error)
        except InvalidStateError:
            return
        self._notify(r, [], "error")

    def _run_batch(self, batch: list) -> list:
        """``generate()`` for one batch: per request its new tokens (up to end-of-sequence) and why it stopped."""
        device = next(self.model.parameters()).device
        width = max(len(r.ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.ids):] = torch.tensor(r.ids)
            mask[i, width - len(r.ids):] = 1
        kwargs = dict(batch[0].kwargs)
        kwargs.setdefault("pad_token_id", self.pad_token_id)
        eos = kwargs.get("eos_token_id", getattr(self.tokenizer, "eos_token_id", None))
        if eos is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        stops = set([eos] if isinstance(eos, int) else eos or [])
        with torch.no_grad():
            out = self.model.generate(ids.to(device), attention_mask=mask.to(device),
                                      delta_names=[r.delta for r in batch], **kwargs)
        results = []
        for row in out[:, width:].tolist():  # the tokens before end-of-sequence, as the engine returns them
            ends = [i for i, t in enumerate(row) if t in stops]
            results.append((row[: ends[0]], "eos") if ends else (row, "length"))
        return results


def _settings_key(kwargs: dict):
    return tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
