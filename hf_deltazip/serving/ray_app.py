"""The OpenAI-compatible app on a Ray Serve cluster: one :class:`DeltaServer` per replica, requests routed
to a replica that holds their delta.

Two deployments:

* ``DeltaReplica`` (``num_replicas`` of them, one GPU each by default): a :class:`~hf_deltazip.DeltaModel`
  on the base, a :class:`DeltaServer` (continuous batching, every row its own delta) and an
  :class:`~hf_deltazip.serving.openai_api.OpenAIService`. Deltas are Ray Serve *multiplexed models*:
  ``@serve.multiplexed`` loads a delta onto a replica the first time one of its requests lands there
  (at most ``max_deltas_per_replica``, least recently used unloaded beyond), and Serve's router sends
  later requests for that delta to replicas that already hold it. Requests of different deltas still
  share one replica's batches: there is no ``@serve.batch`` (it would split batches by model id).
* ``OpenAIIngress`` (one replica, no GPU): the same FastAPI app as ``deltazip serve``
  (:func:`hf_deltazip.serving.openai_app.create_app`). It knows which deltas exist (name -> folder or
  Hub id, changed by ``/v1/deltas/load`` and ``/v1/deltas/unload``), copies the body's ``model`` into
  ``handle.options(multiplexed_model_id=...)`` and streams the replica's answer back. A client that
  leaves cancels the call, which cancels the replica's request and frees its row.

``/metrics`` on the ingress counts requests, tokens, cold loads, time to first token and latency as the
replicas report them per request; per-replica queue and residency gauges are in Ray Serve's own metrics
(``ray_serve_num_multiplexed_models``, ``ray_serve_replica_processing_queries``, ...).

Example (a cluster with GPUs; see the README for several machines)::

    from ray import serve
    from hf_deltazip.serving.ray_app import build_app

    serve.run(build_app(base="org/base", deltas={"chat": "org/chat-delta", "code": "s3-synced/code"},
                        num_replicas=4), name="deltazip", route_prefix="/")
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Optional

from ray import serve

from .openai_api import APIError, Metrics, OpenAIService, ServeSettings

__all__ = ["build_app", "deployments", "DeltaReplica", "RayBackend"]

REPLICA = "DeltaReplica"
_SUMMARY = "_deltazip_summary"  # the last item of a replica's answer: what the ingress's metrics record


class DeltaReplica:
    """One replica: a DeltaModel on the base, its DeltaServer and the OpenAI service over it.

    Args:
        base: the base model (Hub id or folder); its tokenizer is loaded from ``tokenizer`` or there.
        base_name: the ``model`` value that asks for the base.
        device, dtype: where and how the base is loaded (default: CUDA when available, ``"auto"``).
        server_kwargs: for :class:`DeltaServer` (``max_batch_size``, ``max_length``, ``max_queue``, ...).
        max_resident, max_host_bytes: the delta cache's budgets (:meth:`DeltaModel.configure_cache`).
    """

    def __init__(self, base: str, *, base_name: str = "base", tokenizer: Optional[str] = None,
                 device: Optional[str] = None, dtype: str = "auto", server_kwargs: Optional[dict] = None,
                 max_resident: Optional[int] = None, max_host_bytes: int = 0, max_tokens_default: int = 256):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..modeling import DeltaModel
        from .server import DeltaServer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        model = DeltaModel(AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype).to(device).eval())
        if max_resident is not None or max_host_bytes:
            model.configure_cache(max_resident=max_resident, max_host_bytes=max_host_bytes)
        server = DeltaServer(model, AutoTokenizer.from_pretrained(tokenizer or base), **(server_kwargs or {}))
        self.service = OpenAIService(server, ServeSettings(base_name=base_name, max_tokens_default=max_tokens_default))
        self.paths: dict = {}  # delta name -> where to load it from (sent by the ingress with each request)

    async def use_delta(self, name: str) -> "_LoadedDelta":
        """Load delta ``name`` here (the multiplexed loader, see :func:`deployments`)."""
        if name not in self.service.model.deltas:
            await asyncio.to_thread(self.service.load, name, self.paths[name])
        return _LoadedDelta(self.service, name)

    async def respond(self, endpoint: str, body, path: Optional[str] = None):
        """Answer one request (a streaming call): :meth:`OpenAIService.respond`'s items, then a summary."""
        name = serve.get_multiplexed_model_id()
        if name:
            self.paths[name] = path
            try:
                await self.load_multiplexed(name)
            except APIError as e:
                yield e.status, e.body()
                return
        summary: dict = {}
        sent = False
        async with aclosing(self.service.respond(endpoint, body, on_finish=summary.update)) as answers:
            async for item in answers:
                if summary and not sent:  # ahead of the last answer, so the ingress has it when that goes out
                    sent = True
                    yield {_SUMMARY: summary}
                yield item
        if summary and not sent:
            yield {_SUMMARY: summary}

    def gauges(self) -> dict:
        """Queue length, running requests and where each delta lives, on this replica."""
        return self.service.gauges()

    def render_metrics(self) -> str:
        """This replica's own ``/metrics`` text (reach one replica with ``handle.options(multiplexed_model_id=...)``)."""
        return self.service.render_metrics()


class _LoadedDelta:
    """What the multiplexed loader returns: Serve calls ``__del__`` when it evicts the delta from this replica."""

    def __init__(self, service: OpenAIService, name: str):
        self.service, self.name = service, name
        self.unloaded = False

    def __del__(self):  # Serve calls it on eviction, Python again on collection: act once
        if self.unloaded:
            return
        self.unloaded = True
        try:
            self.service.unload(self.name)
        except Exception:  # in use by running requests, or gone already: it stays until asked for again
            pass


class RayBackend:
    """The app's backend on Ray: requests go to ``DeltaReplica`` through a multiplexed handle."""

    def __init__(self, deltas: dict, base_name: str):
        self.deltas = dict(deltas)
        self.base_name = base_name
        self.counters = Metrics()
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            app = serve.get_replica_context().app_name
            self._handle = serve.get_deployment_handle(REPLICA, app_name=app)
        return self._handle

    async def respond(self, endpoint: str, body):
        model = body.get("model") if isinstance(body, dict) else None
        options = {"stream": True}
        if isinstance(model, str) and model != self.base_name:
            if model not in self.deltas:
                self.counters.request("", endpoint, 404)
                yield 404, APIError(404, f"The model '{model}' does not exist: GET /v1/models lists the base "
                                         f"({self.base_name!r}) and the deltas", param="model",
                                    code="model_not_found").body()
                return
            options["multiplexed_model_id"] = model
        answers = self.handle.options(**options).respond.remote(endpoint, body, self.deltas.get(model))
        first = True
        try:
            async for item in answers:
                if isinstance(item, dict) and _SUMMARY in item:
                    s = item[_SUMMARY]
                    self.counters.finished(s["model"], s["prompt_tokens"], s["tokens"], s["ttft"], s["latency"], s["reason"])
                    if s["cold"]:
                        self.counters.cold_load(s["model"])
                    continue
                if first:
                    first = False
                    status = item[0]
                    self.counters.request(model if status != 404 else "", endpoint, status)
                yield item
        finally:
            answers.cancel()  # the client left (or all is sent): the replica's request stops, its row is freed

    async def models(self) -> list:
        created = int(time.time())
        rows = [{"id": self.base_name, "object": "model", "created": created, "owned_by": "deltazip",
                 "root": self.base_name, "parent": None, "location": "device"}]
        return rows + [{"id": n, "object": "model", "created": created, "owned_by": "deltazip", "root": n,
                        "parent": self.base_name, "location": "loaded on demand by a replica", "source": p}
                       for n, p in self.deltas.items()]

    async def load(self, name, path, resident: bool) -> dict:
        if not isinstance(name, str) or not name or name == self.base_name:
            raise APIError(400, f"pick a delta name other than {self.base_name!r} (the base)", param="name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "give the delta's folder or Hub id as 'path' (reachable from every replica)", param="path")
        if name in self.deltas:
            raise APIError(409, f"a delta named {name!r} is registered already: unload it first", param="name",
                           code="model_exists")
        self.deltas[name] = path  # replicas load it when its first request reaches them
        return {"id": name, "object": "model", "location": "disk"}

    async def unload(self, name) -> dict:
        if name not in self.deltas:
            raise APIError(404, f"no delta named {name!r} is registered", param="name", code="model_not_found")
        del self.deltas[name]  # replicas drop it as their multiplexed LRU evicts it
        return {"id": name, "object": "model", "deleted": True}

    async def metrics(self) -> str:
        return self.counters.render({})

    async def health(self) -> dict:
        return {"status": "ok", "deltas": len(self.deltas)}

    def close(self) -> None:
        pass


def build_app(*, base: str, deltas: dict, base_name: str = "base", api_key: Optional[str] = None,
              num_replicas: int = 1, max_deltas_per_replica: int = 16, replica_actor_options: Optional[dict] = None,
              max_ongoing_requests: int = 256, **replica_kwargs):
    """The Serve application: ``serve.run(build_app(...), name=..., route_prefix="/")``.

    Args:
        base: the base model (Hub id, or a folder every node can read).
        deltas: ``{name: folder or Hub id}`` served as ``model=name`` (every node must reach them).
        base_name: the ``model`` value that asks for the base.
        api_key: require ``Authorization: Bearer <api_key>`` on ``/v1`` routes.
        num_replicas: ``DeltaReplica`` count (one DeltaServer each).
        max_deltas_per_replica: deltas a replica holds at once (Serve's multiplexing LRU).
        replica_actor_options: Ray actor options of a replica (default: ``{"num_gpus": 1}`` when the
            cluster has GPUs, else ``{"num_cpus": 1}``).
        max_ongoing_requests: requests Serve hands one replica at once (its DeltaServer batches them);
            keep it at least the replica's ``max_batch_size`` plus its ``max_queue``.
        replica_kwargs: for :class:`DeltaReplica` (``server_kwargs``, ``device``, ``dtype``, ``max_resident``, ...).
    """
    import ray

    if replica_actor_options is None:
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        replica_actor_options = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    replica_cls, ingress_cls = deployments(max_deltas_per_replica, dict(deltas), base_name, api_key)
    replica = replica_cls.options(num_replicas=num_replicas, ray_actor_options=replica_actor_options,
                                  max_ongoing_requests=max_ongoing_requests)
    return ingress_cls.bind(replica.bind(base, base_name=base_name, **replica_kwargs))


def deployments(max_deltas_per_replica: int, deltas: dict, base_name: str, api_key: Optional[str]):
    """The two Serve deployments, with the multiplexing limit and the ingress's settings built in:
    ``(DeltaReplica deployment, OpenAIIngress deployment)``."""

    class Replica(DeltaReplica):
        @serve.multiplexed(max_num_models_per_replica=max_deltas_per_replica)
        async def load_multiplexed(self, name: str):
            return await self.use_delta(name)

    def ingress_app():  # built on the ingress replica (a plain function: Serve calls it there)
        from .openai_app import create_app

        return create_app(RayBackend(deltas, base_name), api_key=api_key)

    @serve.ingress(ingress_app)
    class Ingress:
        def __init__(self, replica):  # the bound replica deployment: Serve deploys it with this app
            self.replica = replica

    return (serve.deployment(name=REPLICA)(Replica),
            # the ingress only forwards: let it hold many requests (Serve's default is a handful)
            serve.deployment(name="OpenAIIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=4096)(Ingress))
