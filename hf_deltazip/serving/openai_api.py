"""The OpenAI-compatible protocol over a :class:`DeltaServer`, independent of any web framework.

:class:`OpenAIService` turns request bodies of ``/v1/chat/completions`` and ``/v1/completions`` into
:class:`DeltaServer` requests and their tokens back into OpenAI responses or server-sent-event chunks.
The ``model`` field names a delta, or the base (its served name). The FastAPI app
(:mod:`hf_deltazip.serving.openai_app`) and the Ray Serve deployment (:mod:`hf_deltazip.serving.ray_app`)
both drive one of these per process or replica.

Every problem with a request is an :class:`APIError`: an HTTP status (4xx for the caller's mistakes) and
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

from ..errors import DeltaZipError
from ..modeling.cache import DeltaInUseError, Residency
from .server import DeltaServer, QueueFullError

__all__ = ["APIError", "OpenAIService", "Metrics", "ServeSettings"]

# OpenAI's finish reasons for the server's
_FINISH = {"eos": "stop", "length": "length", "stop": "stop"}


class APIError(Exception):
    """An answer other than 200: ``status`` and the OpenAI error body (:meth:`body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServeSettings:
    """What a served model accepts.

    Attributes:
        base_name: the ``model`` value that asks for the plain base.
        max_tokens_default: ``max_tokens`` when a request gives none (capped by the room left in the context).
    """

    base_name: str = "base"
    max_tokens_default: int = 256


# --------------------------------------------------------------------------------------------- metrics
class Histogram:
    """A Prometheus histogram per label value (cumulative buckets, sum, count)."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.series: dict = {}

    def observe(self, label: str, value: float) -> None:
        counts, total = self.series.get(label, ([0] * (len(self.buckets) + 1), 0.0))
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        counts[i] += 1
        self.series[label] = (counts, total + value)

    def lines(self, name: str, label: str) -> list:
        out = []
        for value, (counts, total) in sorted(self.series.items()):
            running = 0
            for bound, c in zip(self.buckets + (math.inf,), counts):
                running += c
                le = "+Inf" if bound == math.inf else repr(float(bound))
                out.append(f'{name}_bucket{{{label}="{_escape(value)}",le="{le}"}} {running}')
            out.append(f'{name}_sum{{{label}="{_escape(value)}"}} {total}')
            out.append(f'{name}_count{{{label}="{_escape(value)}"}} {running}')
        return out


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Counters and histograms of one process, written in the Prometheus text format by :meth:`render`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict = {}  # (model, endpoint, status) -> count
        self.prompt_tokens: dict = {}
        self.generation_tokens: dict = {}
        self.cold_loads: dict = {}
        self.cancelled: dict = {}
        self.ttft = Histogram(_LATENCY_BUCKETS)
        self.latency = Histogram(_LATENCY_BUCKETS)

    @staticmethod
    def _bump(table: dict, key, n=1) -> None:
        table[key] = table.get(key, 0) + n

    def request(self, model: str, endpoint: str, status: int) -> None:
        with self.lock:
            self._bump(self.requests, (model, endpoint, str(status)))

    def finished(self, model: str, prompt_tokens: int, tokens: int, ttft: Optional[float], latency: float,
                 reason: str) -> None:
        with self.lock:
            self._bump(self.prompt_tokens, model, prompt_tokens)
            self._bump(self.generation_tokens, model, tokens)
            if ttft is not None:
                self.ttft.observe(model, ttft)
            self.latency.observe(model, latency)
            if reason == "cancelled":
                self._bump(self.cancelled, model)

    def cold_load(self, model: str) -> None:
        with self.lock:
            self._bump(self.cold_loads, model)

    def render(self, gauges: dict) -> str:
        """The text format; ``gauges``: ``queue_length``, ``running``, ``residency`` ({delta: state})."""
        out = []

        def family(name, kind, help_text, rows):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(rows)

        with self.lock:
            family("deltazip_requests_total", "counter", "HTTP requests answered, by model, endpoint and status.",
                   [f'deltazip_requests_total{{model="{_escape(m)}",endpoint="{e}",status="{s}"}} {n}'
                    for (m, e, s), n in sorted(self.requests.items())])
            for name, table, text in (("deltazip_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                                      ("deltazip_generation_tokens_total", self.generation_tokens, "Tokens generated."),
                                      ("deltazip_cold_loads_total", self.cold_loads,
                                       "Delta loads: requests that found their delta off the device, none "
                                       "for it in flight."),
                                      ("deltazip_requests_cancelled_total", self.cancelled,
                                       "Requests stopped early (client gone, stop string)."),):
                family(name, "counter", text, [f'{name}{{model="{_escape(m)}"}} {n}' for m, n in sorted(table.items())])
            family("deltazip_time_to_first_token_seconds", "histogram", "Seconds from arrival to the first token.",
                   self.ttft.lines("deltazip_time_to_first_token_seconds", "model"))
            family("deltazip_request_latency_seconds", "histogram", "Seconds from arrival to the last token.",
                   self.latency.lines("deltazip_request_latency_seconds", "model"))
        residency = gauges.get("residency", {})
        family("deltazip_queue_length", "gauge", "Requests waiting for a decode row.", [f"deltazip_queue_length {gauges.get('queue_length', 0)}"])
        family("deltazip_running_requests", "gauge", "Requests decoding now.", [f"deltazip_running_requests {gauges.get('running', 0)}"])
        family("deltazip_resident_deltas", "gauge", "Deltas on the device.",
               [f"deltazip_resident_deltas {sum(1 for s in residency.values() if s == Residency.DEVICE.value)}"])
        family("deltazip_delta_residency", "gauge", "1 for where each loaded delta lives (device, host, disk).",
               [f'deltazip_delta_residency{{delta="{_escape(n)}",state="{s}"}} 1' for n, s in sorted(residency.items())])
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --------------------------------------------------------------------------------------------- requests
@dataclass
class _Job:
    """One validated request on its way through the server."""

    endpoint: str  # "chat" or "completion"
    model: str  # as the caller named it
    delta: Optional[str]  # None: the base
    tokenizer: object
    ids: list
    max_tokens: int
    sampling: dict
    stop: list
    stream: bool
    include_usage: bool
    arrived: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIService:
    """A :class:`~hf_deltazip.DeltaModel` behind a :class:`DeltaServer`, spoken to in the OpenAI protocol.

    Args:
        server: the server whose model holds the deltas (and whose tokenizer is the base's).
        settings: the base's served name and defaults (:class:`ServeSettings`).

    Each delta answers with its own tokenizer when its folder carries one (``tokenizer_config.json``;
    :class:`~hf_deltazip.CompressedDelta` saves the fine-tune's), else with the base's: its chat template,
    its end-of-sequence token, its decoding.

    Example:
        >>> service = OpenAIService(DeltaServer(model, tokenizer, max_queue=256), ServeSettings(base_name="llama"))
        >>> async def ask(body):
        ...     async for status, response in service.respond("chat", body):  # one item: not streamed
        ...         return status, response
        >>> asyncio.run(ask({"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}))
        (200, {'id': 'chatcmpl-...', 'object': 'chat.completion', ...})
    """

    def __init__(self, server: DeltaServer, settings: Optional[ServeSettings] = None):
        if server.tokenizer is None:
            raise DeltaZipError("the OpenAI service needs the base tokenizer: DeltaServer(model, tokenizer)")
        self.server = server
        self.model = server.model
        self.settings = settings or ServeSettings()
        self.metrics = Metrics()
        self.max_length = server.engine.max_length if server.engine is not None else _context_of(self.model)
        self._tokenizers: dict = {}  # delta name -> its own tokenizer (absent: the base's)
        self._in_flight: dict = {}  # delta name -> requests submitted and not finished (queued ones too)
        self._in_flight_lock = threading.Lock()
        for name in self.model.deltas:
            self._find_tokenizer(name)

    # ---------------------------------------------------------------- models
    def list_models(self) -> list:
        """``/v1/models`` entries: the base, then every loaded delta with where it lives now."""
        created = int(time.time())
        out = [{"id": self.settings.base_name, "object": "model", "created": created, "owned_by": "deltazip",
                "root": self.settings.base_name, "parent": None, "location": "device"}]
        cache = self.model.cache
        for name in self.model.deltas:
            try:
                state = cache.state(name).value
            except DeltaZipError:  # unloaded meanwhile
                continue
            out.append({"id": name, "object": "model", "created": created, "owned_by": "deltazip",
                        "root": name, "parent": self.settings.base_name, "location": state})
        return out

    def load(self, name: str, path: str, *, resident: bool = False) -> dict:
        """Load a delta (a folder or Hub id) under ``name``; it is read when first asked for unless ``resident``."""
        if not isinstance(name, str) or not name or name == self.settings.base_name:
            raise APIError(400, f"pick a delta name other than {self.settings.base_name!r} (the base)", param="name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "give the delta's folder or Hub id as 'path'", param="path")
        if name in self.model.deltas:
            raise APIError(409, f"a delta named {name!r} is loaded already: unload it first", param="name",
                           code="model_exists")
        try:
            self.model.load_delta(path, delta_name=name, resident=resident)
        except DeltaZipError as e:
            raise APIError(400, f"could not load {path!r}: {e}", param="path", code="load_failed") from None
        except OSError as e:
            raise APIError(404, f"could not read {path!r}: {e}", param="path", code="not_found") from None
        try:
            self._find_tokenizer(name)
        except Exception as e:  # a broken tokenizer beside the delta: do not serve it half-configured
            self.model.delete_delta(name)
            raise APIError(400, f"the tokenizer in {path!r} does not load: {e}", param="path", code="load_failed") from None
        return {"id": name, "object": "model", "location": self.model.cache.state(name).value}

    def unload(self, name: str) -> dict:
        """Forget a delta. 409 while requests use it (decoding or waiting for a row)."""
        if name not in self.model.deltas:
            raise APIError(404, f"no delta named {name!r} is loaded", param="name", code="model_not_found")
        with self._in_flight_lock:
            busy = self._in_flight.get(name, 0)
            try:
                if busy:
                    raise DeltaInUseError(f"{busy} requests for delta {name!r} are in flight")
                self.model.delete_delta(name)
            except DeltaInUseError as e:
                raise APIError(409, f"{e}: unload it once they finish", param="name", code="model_in_use") from None
        self._tokenizers.pop(name, None)
        return {"id": name, "object": "model", "deleted": True}

    def submit(self, job: _Job, on_token) -> tuple:
        """Queue a validated job on the server: ``(future, cold)``, ``cold`` when it makes its delta load
        (not on the device, and no other request for it in flight that loads it already). Every
        :meth:`submit` is matched by one :meth:`release`."""
        with self._in_flight_lock:  # counted as it is queued: unload() must not pull its delta from under it
            try:
                cold = (job.delta is not None and self.model.cache.state(job.delta) is not Residency.DEVICE
                        and not self._in_flight.get(job.delta))
            except DeltaZipError:  # unloaded since the request was validated
                raise APIError(404, f"The model '{job.model}' does not exist (it was just unloaded)", param="model",
                               code="model_not_found") from None
            try:
                future = self.server.submit(job.ids, job.delta, on_token=on_token, max_new_tokens=job.max_tokens,
                                            eos_token_id=job.tokenizer.eos_token_id, **job.sampling)
            except QueueFullError as e:
                raise APIError(429, f"{e}", type="rate_limit_exceeded", code="queue_full") from None
            except DeltaZipError as e:  # the prompt does not fit after all
                raise APIError(400, f"{e}") from None
            self._in_flight[job.delta] = self._in_flight.get(job.delta, 0) + 1
        if cold:
            self.metrics.cold_load(job.model)
        return future, cold

    def release(self, job: _Job) -> None:
        """The job is over (finished, failed or cancelled)."""
        with self._in_flight_lock:
            self._in_flight[job.delta] -= 1

    def gauges(self) -> dict:
        cache = self.model.cache
        residency = {}
        for name in self.model.deltas:
            try:
                residency[name] = cache.state(name).value
            except DeltaZipError:
                pass
        return {"queue_length": self.server.waiting, "running": self.server.running, "residency": residency}

    def render_metrics(self) -> str:
        return self.metrics.render(self.gauges())

    def _find_tokenizer(self, name: str) -> None:
        path = self.model.cache.entry(name).path
        if path is not None and (Path(path) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            self._tokenizers[name] = AutoTokenizer.from_pretrained(str(path))

    def tokenizer_for(self, model: Optional[str]):
        return self._tokenizers.get(model, self.server.tokenizer)

    # ---------------------------------------------------------------- requests
    async def respond(self, endpoint: str, body, on_finish=None) -> AsyncIterator:
        """Answer one request. Yields ``(status, dict)`` once for an error or a whole response; for a
        stream, ``(200, None)`` first and then the server-sent-event strings (``"data: ...\\n\\n"``).

        Consumers that stop iterating early (a client gone) cancel the request: its row is freed.
        ``on_finish(summary)`` is called once the request is over with what the metrics record
        (``model``, ``prompt_tokens``, ``tokens``, ``ttft``, ``latency``, ``reason``, ``cold``).
        """
        try:
            job = self.prepare(endpoint, body)
            run = _Run(self, job, on_finish)
        except APIError as e:
            self.metrics.request(self._model_label(body), endpoint, e.status)
            yield e.status, e.body()
            return
        self.metrics.request(job.model, endpoint, 200)
        try:
            if not job.stream:
                try:
                    text, reason = await run.collect()
                except Exception as e:  # the model failed: the server's fault, not the caller's
                    yield 500, APIError(500, f"generation failed: {e}", type="server_error").body()
                    return
                yield 200, self._response(job, text, reason, run.count)
                return
            yield 200, None
            try:
                async for piece, reason in run.pieces():
                    yield _sse(self._chunk(job, piece, reason))
            except Exception as e:  # headers are sent: the error goes into the stream
                yield _sse(APIError(500, f"generation failed: {e}", type="server_error").body())
                return
            if job.include_usage:
                yield _sse(self._usage_chunk(job, run.count))
            yield "data: [DONE]\n\n"
        finally:
            run.close()

    def _model_label(self, body) -> str:
        """The metrics label of a request's model: only names served here (no label per typo)."""
        model = body.get("model") if isinstance(body, dict) else None
        return model if model == self.settings.base_name or model in self.model.deltas else ""

    def prepare(self, endpoint: str, body) -> _Job:
        """Validate a request body; raises :class:`APIError` with what is wrong."""
        arrived = time.perf_counter()
        if endpoint not in ("chat", "completion"):
            raise APIError(404, f"unknown endpoint {endpoint!r}")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required: a delta name or the base's name", param="model")
        if model == self.settings.base_name:
            delta = None
        elif model in self.model.deltas:
            delta = model
        else:
            raise APIError(404, f"The model '{model}' does not exist: GET /v1/models lists the base "
                                f"({self.settings.base_name!r}) and the loaded deltas", param="model",
                           code="model_not_found")
        for key, ok in (("n", lambda v: v in (None, 1)), ("best_of", lambda v: v in (None, 1)),
                        ("echo", lambda v: not v), ("logprobs", lambda v: not v), ("top_logprobs", lambda v: not v),
                        ("tools", lambda v: not v), ("suffix", lambda v: v is None)):
            if not ok(body.get(key)):
                raise APIError(400, f"{key!r}={body.get(key)!r} is not supported by this server", param=key,
                               code="unsupported_parameter")
        tokenizer = self.tokenizer_for(delta)
        ids = self._chat_ids(body, tokenizer) if endpoint == "chat" else self._prompt_ids(body, tokenizer)
        room = self.max_length - len(ids)
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_length} tokens; the prompt has "
                                f"{len(ids)}. Shorten the prompt.", param="messages" if endpoint == "chat" else "prompt",
                           code="context_length_exceeded")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(key)
        if max_tokens is None:
            max_tokens = min(self.settings.max_tokens_default, room)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise APIError(400, f"{key!r} must be a positive integer, got {max_tokens!r}", param=key)
        if max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_length} tokens; the prompt has "
                                f"{len(ids)} and {key}={max_tokens} asks for more than the {room} left. Ask for fewer.",
                           param=key, code="context_length_exceeded")
        sampling = self._sampling(body)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        return _Job(endpoint, model, delta, tokenizer, ids, max_tokens, sampling, stop, stream,
                    bool(options.get("include_usage")), arrived)

    def _chat_ids(self, body: dict, tokenizer) -> list:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content")
            plain.append({"role": m["role"], "content": content})
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        try:
            ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that rejects these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _prompt_ids(self, body: dict, tokenizer) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            vocab = len(tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids = list(prompt)
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    @staticmethod
    def _sampling(body: dict) -> dict:
        temperature = body.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else temperature
        top_p = body.get("top_p", 1.0)
        top_p = 1.0 if top_p is None else top_p
        seed = body.get("seed")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
            raise APIError(400, f"'temperature' must be a number in [0, 2], got {temperature!r}", param="temperature")
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise APIError(400, f"'top_p' must be a number in (0, 1], got {top_p!r}", param="top_p")
        if seed is not None and not _is_int(seed):
            raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
        decoding = body.get("decoding")  # an extension (the OpenAI client's extra_body): Jacobi decoding
        if decoding is not None:
            block = body.get("jacobi_block_size", 16)
            if decoding != "jacobi":
                raise APIError(400, f"'decoding' must be \"jacobi\" or absent, got {decoding!r}", param="decoding")
            if temperature != 0:
                raise APIError(400, "'decoding': 'jacobi' is greedy: set 'temperature' to 0", param="temperature")
            if not _is_int(block) or not 1 <= block <= 256:
                raise APIError(400, f"'jacobi_block_size' must be an integer in [1, 256], got {block!r}",
                               param="jacobi_block_size")
            return {"do_sample": False, "decoding": "jacobi", "jacobi_block_size": block}
        if temperature == 0:
            return {"do_sample": False}
        out = {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p)}
        if seed is not None:
            out["seed"] = seed
        return out

    # ---------------------------------------------------------------- responses
    def _response(self, job: _Job, text: str, reason: str, count: int) -> dict:
        usage = _usage(job, count)
        if job.endpoint == "chat":
            return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": job.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": _FINISH.get(reason, reason), "logprobs": None}], "usage": usage}
        return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [{"index": 0, "text": text, "finish_reason": _FINISH.get(reason, reason), "logprobs": None}],
                "usage": usage}

    def _chunk(self, job: _Job, piece: Optional[str], reason: Optional[str]) -> dict:
        finish = _FINISH.get(reason, reason) if reason else None
        if job.endpoint == "chat":
            delta = {} if piece is None else {"role": "assistant", "content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                    "model": job.model, "choices": [choice]}
        choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [choice]}

    def _usage_chunk(self, job: _Job, count: int) -> dict:
        obj = "chat.completion.chunk" if job.endpoint == "chat" else "text_completion"
        prefix = "chatcmpl" if job.endpoint == "chat" else "cmpl"
        return {"id": f"{prefix}-{job.id}", "object": obj, "created": job.created, "model": job.model, "choices": [],
                "usage": _usage(job, count)}

    def close(self) -> None:
        """Finish the requests in flight and stop the server."""
        self.server.close()


class _Run:
    """One job submitted to the server; its tokens arrive on an asyncio queue (filled from the worker thread)."""

    def __init__(self, service: OpenAIService, job: _Job, on_finish=None):
        self.service, self.job, self.on_finish = service, job, on_finish
        self.loop = asyncio.get_running_loop()
        self.parts: asyncio.Queue = asyncio.Queue()
        self.tokens: list = []
        self.count = 0  # tokens the caller got (up to a stop string)
        self.first: Optional[float] = None
        self.reason: Optional[str] = None
        self.finished = False
        self.text = ""  # the answer's text so far, decoded incrementally
        self._window = (0, 0)  # tokens [a, b) already turned into text, decoded again as the context of the next ones
        self.future, self.cold = service.submit(job, self._on_token)

    def _on_token(self, tokens: list, reason: Optional[str]) -> None:  # worker thread
        self.loop.call_soon_threadsafe(self.parts.put_nowait, (tokens, reason))

    async def pieces(self):
        """Yields ``(text, None)`` as text is decoded, then ``(None, finish_reason)``; honours stop strings."""
        sent = ""
        while self.reason is None:
            tokens, reason = await self.parts.get()
            if self.first is None and tokens:
                self.first = time.perf_counter()
            self.tokens += tokens
            if reason == "error":
                self.finish("error")
                raise self.future.exception()
            text = self._full_text() if reason is not None else self._decoded()
            cut = _first_stop(text, self.job.stop, len(sent))
            if cut is not None:
                text, reason = text[:cut], "stop"
                self.future.cancel()  # frees the row
            elif reason is None:
                text = _stable_prefix(text, self.job.stop)  # hold back a half-decoded character or a stop's start
            if reason is not None:
                self.finish(reason)
            if len(text) > len(sent) and text.startswith(sent):
                yield text[len(sent):], None
                sent = text
        yield None, self.reason

    def _decoded(self) -> str:
        """The text of the tokens so far, decoding only the newest ones (with a few before them as context,
        so a tokenizer that drops a word's leading space at the start of a text still spaces them right)."""
        a, b = self._window
        decode = self.job.tokenizer.decode
        before = decode(self.tokens[a:b], skip_special_tokens=True)
        now = decode(self.tokens[a:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.text += now[len(before):]
            self._window = (b, len(self.tokens))
        return self.text

    def _full_text(self) -> str:
        """The whole answer decoded at once: the final text is exactly what ``tokenizer.decode`` gives."""
        self.text = self.job.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self.text

    async def collect(self):
        pieces = []
        async for piece, reason in self.pieces():
            if piece is not None:
                pieces.append(piece)
        return "".join(pieces), self.reason

    def finish(self, reason: str) -> None:
        self.reason = reason
        self.count = len(self.tokens)
        self.finished = True
        self.service.release(self.job)
        summary = dict(model=self.job.model, prompt_tokens=len(self.job.ids), tokens=self.count,
                       ttft=None if self.first is None else self.first - self.job.arrived,
                       latency=time.perf_counter() - self.job.arrived, reason=reason, cold=self.cold)
        self.service.metrics.finished(**{k: v for k, v in summary.items() if k != "cold"})
        if self.on_finish is not None:
            self.on_finish(summary)

    def close(self) -> None:
        """The consumer is done (or gone): cancel the request if it still runs."""
        if not self.finished:
            self.future.cancel()
            self.finish("cancelled")


def _first_stop(text: str, stops: list, start: int) -> Optional[int]:
    """Where the first stop string begins in ``text`` (searching from a little before ``start``)."""
    found = [i for s in stops for i in [text.find(s, max(0, start - len(s) + 1))] if i >= 0]
    return min(found) if found else None


def _stable_prefix(text: str, stops: list) -> str:
    """The part of ``text`` safe to send: no trailing replacement character (a multi-byte character
    split across tokens) and no tail that could be the start of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return text[:end]


def _usage(job: _Job, count: int) -> dict:
    return {"prompt_tokens": len(job.ids), "completion_tokens": count, "total_tokens": len(job.ids) + count}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _context_of(model) -> int:
    config = getattr(getattr(model, "base_model", model), "config", None)
    return int(getattr(config, "max_position_embeddings", 0) or 2048)
