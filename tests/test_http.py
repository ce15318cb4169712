"""``deltazip serve``: the OpenAI-compatible HTTP API, driven by the real ``openai`` client on 127.0.0.1.

The world of tests/serve_factory.py; every answer is compared with ``DeltaModel.generate`` (greedy) on a
second DeltaModel that the server does not touch.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_deltazip.serving import DeltaServer  # noqa: E402
from hf_deltazip.serving.openai_api import OpenAIService, ServeSettings  # noqa: E402
from hf_deltazip.serving.openai_app import LocalBackend, create_app, serve_in_thread  # noqa: E402

from serve_factory import BASE, KEY, VOCAB, build_world, chat_ids, expected, free_port  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("http"))


def started(world, **server_kwargs):
    """A served app over a fresh DeltaModel; use as ``with started(world) as (url, service):``."""
    kwargs = dict(max_batch_size=8, max_length=128, max_queue=64)
    kwargs.update(server_kwargs)
    model = world["delta_model"]()
    model.configure_cache(max_resident=2, max_host_bytes=10**8)  # three deltas, room for two: LRU at work
    service = OpenAIService(DeltaServer(model, world["tok"], **kwargs), ServeSettings(base_name=BASE))

    class Running:
        def __enter__(self):
            self.ctx = serve_in_thread(create_app(LocalBackend(service), api_key=KEY))
            return self.ctx.__enter__(), service

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

    return Running()


@pytest.fixture(scope="module")
def served(world):
    with started(world) as (url, service):
        yield url, service


def client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


# ----------------------------------------------------------------------------------------- answers
def test_chat_and_completion_streamed_or_not_equal_greedy_generate(world, served):
    url, _ = served
    c = client(url)
    tok = world["tok"]
    for model in ("d1", "d2", BASE):
        name = None if model == BASE else model
        want, n = expected(world, chat_ids(tok, "def parse(x):"), name, 12)
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "def parse(x):"}],
                                      max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want and r.model == model
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(chat_ids(tok, "def parse(x):"))
        assert r.choices[0].finish_reason == ("length" if n == 12 else "stop")
        chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "def parse(x):"}],
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == want and chunks[-1].usage.completion_tokens == n
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
        assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1, "not streamed"

        want, n = expected(world, tok("import os\n")["input_ids"], name, 10)
        r = c.completions.create(model=model, prompt="import os\n", max_tokens=10, temperature=0)
        assert r.choices[0].text == want and r.usage.completion_tokens == n
        pieces = [ch.choices[0].text for ch in c.completions.create(model=model, prompt="import os\n", max_tokens=10,
                                                                    temperature=0, stream=True)]
        assert "".join(pieces) == want and len([p for p in pieces if p]) > 1
        # Jacobi decoding (an extension field): the same greedy answer, streamed or not
        jacobi = dict(decoding="jacobi", jacobi_block_size=4)
        r = c.completions.create(model=model, prompt="import os\n", max_tokens=10, temperature=0, extra_body=jacobi)
        assert r.choices[0].text == want and r.usage.completion_tokens == n
        pieces = [ch.choices[0].text for ch in c.completions.create(model=model, prompt="import os\n", max_tokens=10,
                                                                    temperature=0, stream=True, extra_body=jacobi)]
        assert "".join(pieces) == want
    outputs = {m: c.completions.create(model=m, prompt="import os\n", max_tokens=10, temperature=0).choices[0].text
               for m in ("d1", "d2", "d3", BASE)}
    assert len(set(outputs.values())) == 4, "the deltas answer alike: the test could not tell them apart"


def test_each_delta_answers_with_its_own_chat_template(world, served):
    url, _ = served
    message = [{"role": "user", "content": "class A:"}]
    own_ids = chat_ids(world["own"], "class A:")
    assert own_ids != chat_ids(world["tok"], "class A:")
    want, _ = expected(world, own_ids, "d3", 8)
    r = client(url).chat.completions.create(model="d3", messages=message, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(own_ids)


def test_many_concurrent_requests_over_three_deltas_match_generate(world, served):
    url, service = served
    tok = world["tok"]
    jobs = []
    for i in range(36):
        model = ("d1", "d2", "d3", BASE)[i % 4]
        prompt = ["def f", "import sys", "return x", "for i in", "class B", "while True"][i % 6] + str(i)
        jobs.append(dict(model=model, prompt=prompt, chat=i % 3 == 0, stream=i % 2 == 0, n=4 + i % 9))

    async def one(c, job):
        kw = dict(model=job["model"], max_tokens=job["n"], temperature=0, stream=job["stream"])
        if job["chat"]:
            r = await c.chat.completions.create(messages=[{"role": "user", "content": job["prompt"]}], **kw)
            if job["stream"]:
                return "".join([ch.choices[0].delta.content or "" async for ch in r])
            return r.choices[0].message.content
        r = await c.completions.create(prompt=job["prompt"], **kw)
        if job["stream"]:
            return "".join([ch.choices[0].text async for ch in r])
        return r.choices[0].text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, j) for j in jobs))

    before = len(service.server.stats)
    got = asyncio.run(all_at_once())
    for job, text in zip(jobs, got):
        name = None if job["model"] == BASE else job["model"]
        template = world["own"] if job["model"] == "d3" else tok
        ids = chat_ids(template, job["prompt"]) if job["chat"] else tok(job["prompt"])["input_ids"]
        assert text == expected(world, ids, name, job["n"])[0], job
    stats = list(service.server.stats)[before:]
    assert len(stats) == 36 and max(s.batch_size for s in stats) > 4, "the requests were not batched together"


# ----------------------------------------------------------------------------------------- bad input
def error_of(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "model"),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (json.dumps({"model": "d1", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": 5}]}).encode(), 400, "messages[0].content"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(), 400, "temperature"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "n": 3}).encode(), 400, "n"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "decoding": "beam"}).encode(), 400, "decoding"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "decoding": "jacobi"}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "hi"}], "decoding": "jacobi", "temperature": 0,
                 "jacobi_block_size": 0}).encode(), 400, "jacobi_block_size"),
    (json.dumps({"model": "d1", "messages": [{"role": "user", "content": "word " * 200}]}).encode(), 400, "messages"),
])
def test_bad_chat_bodies_get_openai_errors(served, body, status, param):
    url, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status
    assert error_of(r)["param"] == param


def test_the_client_sees_typed_errors_and_the_server_keeps_serving(world, served):
    url, _ = served
    c = client(url)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="d1", prompt="x " * 300, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="d1", prompt="x", max_tokens=128, stream=True)
    assert "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="d1", prompt=[VOCAB + 5], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    want, _ = expected(world, world["tok"]("x")["input_ids"], "d2", 3)
    assert c.completions.create(model="d2", prompt="x", max_tokens=3, temperature=0).choices[0].text == want


def test_stop_strings_end_the_answer_early(world, served):
    url, _ = served
    c = client(url)
    full = c.completions.create(model="d1", prompt="def g", max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]
    assert len(stop) == 3 and full.find(stop) >= 0
    cut = full[: full.find(stop)]
    r = c.completions.create(model="d1", prompt="def g", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="d1", prompt="def g", max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut


# ----------------------------------------------------------------------------------------- management
def test_models_load_unload_metrics_and_health(world, served):
    url, service = served
    c = client(url)
    auth = {"Authorization": f"Bearer {KEY}"}
    c.completions.create(model="d1", prompt="x", max_tokens=2, temperature=0)
    models = {m.id: m.model_extra["location"] for m in c.models.list().data}
    assert set(models) == {BASE, "d1", "d2", "d3"} and models[BASE] == "device"
    assert set(models.values()) <= {"device", "host", "disk"}

    r = httpx.post(f"{url}/v1/deltas/load", json={"name": "again", "path": str(world["root"] / "d2")}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["location"] == "disk"
    want, _ = expected(world, world["tok"]("x")["input_ids"], "d2", 4)
    assert c.completions.create(model="again", prompt="x", max_tokens=4, temperature=0).choices[0].text == want
    assert httpx.post(f"{url}/v1/deltas/load", json={"name": "again", "path": "x"}, headers=auth, timeout=60).status_code == 409
    bad = httpx.post(f"{url}/v1/deltas/load", json={"name": "gone", "path": str(world["root"] / "missing")}, headers=auth, timeout=60)
    assert bad.status_code in (400, 404) and error_of(bad)["param"] == "path"
    assert httpx.post(f"{url}/v1/deltas/unload", json={"name": "again"}, headers=auth, timeout=60).json()["deleted"]
    assert httpx.post(f"{url}/v1/deltas/unload", json={"name": "again"}, headers=auth, timeout=60).status_code == 404
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="again", prompt="x", max_tokens=2)

    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in ("deltazip_requests_total", "deltazip_generation_tokens_total", "deltazip_time_to_first_token_seconds_bucket",
                   "deltazip_request_latency_seconds_count", "deltazip_resident_deltas", "deltazip_cold_loads_total",
                   "deltazip_queue_length"):
        assert family in text, family
    assert 'deltazip_requests_total{model="d1",endpoint="completion",status="200"}' in text
    assert 'deltazip_cold_loads_total{model="again"} 1' in text  # registered on disk, loaded by its request
    assert 'deltazip_requests_total{model="",endpoint="completion",status="404"}' in text
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["deltas"] == 3


# ----------------------------------------------------------------------------------------- overload, disconnects
def test_full_queue_answers_429_and_a_client_that_leaves_frees_its_row(world):
    with started(world, max_batch_size=1, max_length=4096, max_queue=1) as (url, service):
        server = service.server
        c = client(url)
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": "d1", "prompt": "x", "max_tokens": 4000, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data:"))  # decoding: it holds the only row
            queued = {}
            t = threading.Thread(target=lambda: queued.update(
                text=c.completions.create(model="d2", prompt="x", max_tokens=3, temperature=0).choices[0].text))
            t.start()
            deadline = time.monotonic() + 60
            while server.waiting < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model=BASE, prompt="x", max_tokens=2)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
            for name in ("d1", "d2"):  # one decoding, one waiting for a row: neither may be pulled away
                r = httpx.post(f"{url}/v1/deltas/unload", json={"name": name}, timeout=60,
                               headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 409 and error_of(r)["code"] == "model_in_use"
        # the streaming client left after one event: its row goes to the queued request
        t.join(60)
        assert queued["text"] == expected(world, world["tok"]("x")["input_ids"], "d2", 3)[0]
        deadline = time.monotonic() + 60
        while server.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancelled = [s for s in server.stats if s.finish_reason == "cancelled"]
        assert len(cancelled) == 1 and cancelled[0].new_tokens < 4000
        assert 'deltazip_requests_cancelled_total{model="d1"} 1' in httpx.get(f"{url}/metrics", timeout=30).text

        # a client that gives up on a whole (non-streamed) answer frees its row too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5,
                       json={"model": "d2", "prompt": "x", "max_tokens": 4000, "temperature": 0})
        deadline = time.monotonic() + 60
        while len([s for s in server.stats if s.finish_reason == "cancelled"]) < 2:
            assert time.monotonic() < deadline, "the row of a client that left was not freed"
            time.sleep(0.05)
        assert [s for s in server.stats if s.finish_reason == "cancelled"][-1].new_tokens < 4000


# ----------------------------------------------------------------------------------------- the command
def test_the_serve_command_finishes_in_flight_requests_on_sigterm(world):
    root, port = world["root"], free_port()
    cmd = [sys.executable, "-m", "hf_deltazip.serving.openai_app", "--base", str(root / "base"),
           "--delta", f"d1={root / 'd1'}", "--base-name", BASE, "--host", "127.0.0.1", "--port", str(port),
           "--api-key", KEY, "--max-length", "256", "--dtype", "float32", "--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        want, n = expected(world, world["tok"]("x")["input_ids"], "d1", 30)
        c = client(url)
        stream = c.completions.create(model="d1", prompt="x", max_tokens=30, temperature=0, stream=True)
        pieces = [next(iter(stream)).choices[0].text]
        proc.send_signal(signal.SIGTERM)  # mid-stream: uvicorn stops accepting and lets this request finish
        pieces += [ch.choices[0].text for ch in stream]
        assert "".join(pieces) == want
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        assert "requests in flight finished; stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_http_benchmark_replays_a_trace_both_ways_with_the_same_answers(tmp_path):
    from hf_deltazip.bench.http import main

    out = tmp_path / "http.json"
    assert main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--deltas", "2", "--requests", "6",
                 "--rate", "200", "--prompt-len", "4", "--new-tokens", "4", "--batch", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_answers"] and report["http_over_in_process_throughput"] > 0
    for system in ("in-process", "http"):
        r = report["results"][system]
        assert r["completed"] == 6 and r["output_tokens"] == 24 and r["latency_p99_s"] >= r["latency_p50_s"] > 0


def test_the_subcommand_registers_and_refuses_bad_delta_specs():
    import argparse

    from hf_deltazip.errors import DeltaZipError
    from hf_deltazip.serving.openai_app import add_parser, cmd_serve

    parser = argparse.ArgumentParser(prog="deltazip")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "--base", "b", "--delta", "chat=./c", "--delta", "code"])
    assert args.func is cmd_serve and args.host == "127.0.0.1"
    with pytest.raises(DeltaZipError, match="NAME=PATH"):
        cmd_serve(args)
    args = parser.parse_args(["serve", "--base", "b", "--delta", "a=./x", "--delta", "a=./y"])
    with pytest.raises(DeltaZipError, match="given twice"):
        cmd_serve(args)
