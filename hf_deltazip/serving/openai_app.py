"""``deltazip serve``: the OpenAI-compatible HTTP API (FastAPI + uvicorn) over one :class:`DeltaServer`.

Routes (see docs/http.md):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``model`` names a delta or the base;
  ``"stream": true`` answers with server-sent events.
* ``GET /v1/models``: the base and the deltas, each with ``location`` (``device``, ``host`` or ``disk``).
* ``POST /v1/deltas/load`` ``{"name", "path", "resident"?}`` and ``POST /v1/deltas/unload`` ``{"name"}``.
* ``GET /metrics`` (Prometheus text format) and ``GET /health``.

With ``--api-key`` every ``/v1`` route wants ``Authorization: Bearer <key>``. Errors are OpenAI-style
bodies with a 4xx status; a full queue answers 429. On SIGINT/SIGTERM the server stops accepting,
finishes the requests in flight, then exits.

Example:
    deltazip serve --base org/base --delta chat=org/chat-delta --delta code=./code-delta --port 8000
    python -m hf_deltazip.serving.openai_app --base org/base --delta chat=./chat-delta
"""


import argparse
import asyncio
import hmac
import importlib
import json
import logging
import sys
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Iterator, Optional

from ..errors import DeltaZipError
from .openai_api import APIError, OpenAIService, ServeSettings

__all__ = ["create_app", "serve_in_thread", "add_parser", "cmd_serve", "build_service"]


class LocalBackend:
    """What the app calls: an :class:`OpenAIService` in this process (Ray's backend has the same methods)."""

    def __init__(self, service: OpenAIService):
        self.service = service

    def respond(self, endpoint: str, body):
        return self.service.respond(endpoint, body)

    async def models(self) -> list:
        return self.service.list_models()

    async def load(self, name, path, resident: bool) -> dict:
        return await asyncio.to_thread(self.service.load, name, path, resident=resident)

    async def unload(self, name) -> dict:
        return await asyncio.to_thread(self.service.unload, name)

    async def metrics(self) -> str:
        return self.service.render_metrics()

    async def health(self) -> dict:
        return {"status": "ok", "deltas": len(self.service.model.deltas), **self.service.gauges()}

    def close(self) -> None:
        self.service.close()


def create_app(backend, *, api_key: Optional[str] = None):
    """The FastAPI app over a backend (:class:`LocalBackend` or Ray's ingress backend).

    Args:
        backend: has ``respond(endpoint, body)`` (an async iterator, see :meth:`OpenAIService.respond`),
            ``models()``, ``load()``, ``unload()``, ``metrics()``, ``health()`` and ``close()``.
        api_key: if given, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(backend.close)  # after uvicorn drained the connections: finish what is queued
        logging.getLogger("uvicorn.error").info("deltazip: requests in flight finished; stopped")

    app = FastAPI(title="hf-deltazip", lifespan=lifespan)

    def error(e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # unknown routes, wrong methods: OpenAI-style bodies too
        return error(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return error(APIError(400, f"invalid request: {exc.errors()}"))

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key, refuse=error)

    async def read_json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None

    async def complete(request: Request, endpoint: str):
        try:
            body = await read_json(request)
        except APIError as e:
            return error(e)
        answers = backend.respond(endpoint, body)
        first = asyncio.ensure_future(answers.__anext__())
        while not (await asyncio.wait({first}, timeout=0.25))[0]:  # a whole answer may take a while
            if await request.is_disconnected():  # nobody waits for it: stop it, free its row
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                await answers.aclose()
                return Response(status_code=499)
        status, payload = first.result()
        if status != 200 or payload is not None:  # an error, or a whole (non-streamed) response
            await answers.aclose()
            return JSONResponse(payload, status_code=status)
        # closing the iterator (the client left, or the stream ended) cancels the request: its row is freed
        return StreamingResponse(answers, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": await backend.models()}

    @app.post("/v1/deltas/load")
    async def load(request: Request):
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object {name, path, resident?}")
            resident = body.get("resident", False)
            if not isinstance(resident, bool):
                raise APIError(400, "'resident' must be true or false", param="resident")
            return await backend.load(body.get("name"), body.get("path"), resident)
        except APIError as e:
            return error(e)

    @app.post("/v1/deltas/unload")
    async def unload(request: Request):
        try:
            body = await read_json(request)
            name = body.get("name") if isinstance(body, dict) else None
            if not isinstance(name, str):
                raise APIError(400, "the body must be a JSON object {name}", param="name")
            return await backend.unload(name)
        except APIError as e:
            return error(e)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await backend.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        return await backend.health()

    return app


class _BearerAuth:
    """ASGI middleware: ``/v1`` routes want ``Authorization: Bearer <api_key>``. (A plain ASGI layer, not
    Starlette's BaseHTTPMiddleware, so that handlers still see a client disconnect.)"""

    def __init__(self, app, *, api_key: str, refuse):
        self.app, self.key, self.refuse = app, api_key.encode(), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = self.refuse(APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                                                code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------- running
@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 60) -> Iterator[str]:
    """Run ``app`` with uvicorn on a background thread; yields its base URL; stops it (gracefully) on exit."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=timeout)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="deltazip-http", daemon=True)
    thread.start()
    try:
        deadline = timeout
        while not server.started:
            if not thread.is_alive():
                raise DeltaZipError("the HTTP server did not start (see the log above)")
            thread.join(0.01)
            deadline -= 0.01
            if deadline <= 0:
                raise DeltaZipError(f"the HTTP server did not start within {timeout} s")
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def build_service(args) -> OpenAIService:
    """The model, its deltas, the tokenizer and the :class:`DeltaServer` that ``deltazip serve`` runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..modeling import DeltaModel
    from .server import DeltaServer

    deltas = _parse_delta_specs(args.delta)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = DeltaModel(base.to(device).eval())
    if args.max_resident is not None or args.max_host_bytes:
        model.configure_cache(max_resident=args.max_resident, max_host_bytes=args.max_host_bytes)
    for name, path in deltas:
        model.load_delta(path, delta_name=name, resident=False)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base)
    server = DeltaServer(model, tokenizer, max_batch_size=args.max_batch_size, max_length=args.max_length,
                         max_queue=args.max_queue)
    settings = ServeSettings(base_name=args.base_name or args.base.rstrip("/").split("/")[-1],
                             max_tokens_default=args.max_tokens_default)
    return OpenAIService(server, settings)


def _parse_delta_specs(specs) -> list:
    """``--delta NAME=PATH`` values as ``(name, path)`` pairs."""
    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise DeltaZipError(f"--delta {spec!r}: write NAME=PATH_OR_HUB_ID, e.g. --delta chat=org/chat-delta")
        if name in dict(out):
            raise DeltaZipError(f"--delta {name!r} is given twice: one name per delta")
        out.append((name, path))
    return out


def add_parser(sub) -> None:
    """Register ``deltazip serve`` on the ``deltazip`` command's subparsers."""
    p = sub.add_parser("serve", help="serve the base and its deltas over an OpenAI-compatible HTTP API")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the base model (Hub id or folder)")
    p.add_argument("--delta", action="append", metavar="NAME=PATH",
                   help="a delta to serve as model NAME (folder or Hub id); repeat for more")
    p.add_argument("--base-name", help="the 'model' value that asks for the plain base (default: the base's last path part)")
    p.add_argument("--tokenizer", help="the base tokenizer (default: --base)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    p.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together")
    p.add_argument("--max-length", type=int, default=2048, help="context per row: prompt + max_tokens")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a row before 429s")
    p.add_argument("--max-tokens-default", type=int, default=256, help="max_tokens of requests that give none")
    p.add_argument("--max-resident", type=int, help="most deltas on the device at once (LRU beyond)")
    p.add_argument("--max-host-bytes", type=int, default=0, help="host memory for evicted deltas' copies")
    p.add_argument("--graceful-timeout", type=float, default=60.0,
                   help="seconds to finish in-flight requests on shutdown")


def cmd_serve(args) -> int:
    try:
        importlib.import_module("fastapi")
        import uvicorn
    except ImportError as e:
        raise DeltaZipError(f"deltazip serve needs FastAPI and uvicorn ({e}): pip install 'hf-deltazip[serve]'") from None
    _parse_delta_specs(args.delta)  # a typo fails before the model loads
    service = build_service(args)
    app = create_app(LocalBackend(service), api_key=args.api_key)
    print(f"deltazip serve: {service.settings.base_name!r} and deltas {service.model.deltas} on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.graceful_timeout)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="deltazip serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except DeltaZipError as e:
        print(f"deltazip serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
