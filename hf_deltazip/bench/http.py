"""``python -m hf_deltazip.bench.http``: what the HTTP layer costs.

One request trace (the serve benchmark's: Poisson arrivals at ``--rate``, Zipf popularity over
``--deltas`` random deltas, ``--prompt-len`` random token ids, exactly ``--new-tokens`` new tokens each)
is replayed twice against the same :class:`~hf_deltazip.DeltaModel`:

1. ``in-process``: :meth:`DeltaServer.submit` from this process (``on_token`` marks the first token);
2. ``http``: the OpenAI app of ``deltazip serve`` (FastAPI + uvicorn on 127.0.0.1, a fresh DeltaServer
   with the same settings), streamed ``/v1/completions`` with token-id prompts from an ``httpx`` client
   in this process (its event loop on its own thread; the GIL is shared, so this is an upper bound on
   the cost). ``--url`` replays against a server started elsewhere instead (``deltazip serve`` with the
   same base and deltas named ``d0``, ``d1``, ...).

Per system: requests completed, output tokens/s (all output tokens / (last finish - first arrival)),
p50 and p99 latency (finish - arrival) and time to first token; then HTTP throughput over in-process,
and whether both gave the same (greedy) answers. ``--shape tiny --device cpu`` is a smoke test.

Example:
    python -m hf_deltazip.bench.http --shape 8b --deltas 16 --rate 8 --requests 256 --json http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from typing import Optional

import torch

from .decode import SHAPES, build_base, random_delta
from .serve import make_trace, percentile, trace_summary

SYSTEMS = ("in-process", "http")


def id_tokenizer(vocab_size: int):
    """A tokenizer whose token ``i`` is the word ``t{i}`` (no end-of-sequence token: answers run to
    ``max_tokens``): decoding costs what it costs for a real vocabulary of that size, without training one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


def replay_in_process(server, trace, names, new_tokens: int) -> list:
    """Submit each request at its arrival time; returns ``(arrival, first token, finish, text)`` per request."""
    done = threading.Event()
    results: list = [None] * len(trace)
    left = [len(trace)]
    lock = threading.Lock()
    t0 = time.perf_counter()

    def track(i, arrival):
        first, tokens = [None], []

        def on_token(ids, reason):
            now = time.perf_counter() - t0
            if ids and first[0] is None:
                first[0] = now
            tokens.extend(ids)
            if reason is not None:
                results[i] = (arrival, first[0], now, server.tokenizer.decode(tokens))
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return on_token

    for i, r in enumerate(trace):
        wait = r.arrival - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        server.submit(r.prompt, names[r.delta], max_new_tokens=new_tokens, eos_token_id=None,
                      on_token=track(i, r.arrival))
    done.wait()
    return results


async def replay_http(url: str, trace, names, new_tokens: int, api_key: Optional[str] = None) -> list:
    """The same over HTTP: one streamed ``/v1/completions`` per request, sent at its arrival time."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(trace) + 1, max_keepalive_connections=len(trace) + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(r):
            await asyncio.sleep(max(0.0, r.arrival - (time.perf_counter() - t0)))
            body = {"model": names[r.delta], "prompt": r.prompt, "max_tokens": new_tokens, "temperature": 0,
                    "stream": True}
            first, pieces = None, []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    text = json.loads(line[6:])["choices"][0]["text"]
                    if text and first is None:
                        first = time.perf_counter() - t0
                    pieces.append(text)
            return r.arrival, first, time.perf_counter() - t0, "".join(pieces)

        return await asyncio.gather(*(one(r) for r in trace))


def summarize(results: list, new_tokens: int) -> dict:
    """Throughput and latency percentiles of one replay."""
    first_arrival = min(a for a, *_ in results)
    span = max(f for _, _, f, _ in results) - first_arrival
    latency = [f - a for a, _, f, _ in results]
    ttft = [t - a for a, t, _, _ in results if t is not None]
    tokens = new_tokens * len(results)
    return {"completed": len(results), "output_tokens": tokens, "tokens_per_s": tokens / span if span > 0 else None,
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.http", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape has")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--deltas", type=int, default=4)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=16, help="rows decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="replay the HTTP run against this server (deltazip serve) instead of starting one")
    p.add_argument("--api-key", help="bearer token for --url")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv=None) -> int:
    from ..modeling import DeltaModel
    from ..serving import DeltaServer
    from ..serving.openai_api import OpenAIService, ServeSettings
    from ..serving.openai_app import LocalBackend, create_app, serve_in_thread

    args = build_parser().parse_args(argv)
    base = build_base(args.shape, args.device, args.layers)
    vocab = base.config.vocab_size
    model = DeltaModel(base)
    model.configure_cache(max_resident=args.deltas)
    names = [f"d{i}" for i in range(args.deltas)]
    for i, n in enumerate(names):
        model.add_delta(random_delta(base, args.bits, args.group_size, seed=i), n)
    tokenizer = id_tokenizer(vocab)
    trace = make_trace(num_deltas=args.deltas, requests=args.requests, rate=args.rate, zipf=args.zipf,
                       prompt_len=args.prompt_len, vocab_size=vocab, seed=args.seed)
    warm = make_trace(num_deltas=args.deltas, requests=2 * args.batch, rate=1e6, zipf=0.0,
                      prompt_len=args.prompt_len, vocab_size=vocab, seed=args.seed + 1)

    def new_server():
        return DeltaServer(model, tokenizer, max_batch_size=args.batch,
                           max_length=2 * (args.prompt_len + args.new_tokens))

    answers, results = {}, {}
    with new_server() as server:
        replay_in_process(server, warm, names, args.new_tokens)  # compile, capture, allocate
        answers["in-process"] = replay_in_process(server, trace, names, args.new_tokens)
    if args.url:
        asyncio.run(replay_http(args.url, warm, names, args.new_tokens, args.api_key))
        answers["http"] = asyncio.run(replay_http(args.url, trace, names, args.new_tokens, args.api_key))
    else:
        service = OpenAIService(new_server(), ServeSettings(base_name="base", max_tokens_default=args.new_tokens))
        with serve_in_thread(create_app(LocalBackend(service))) as url:
            asyncio.run(replay_http(url, warm, names, args.new_tokens))
            answers["http"] = asyncio.run(replay_http(url, trace, names, args.new_tokens))
    for system in SYSTEMS:
        results[system] = summarize(answers[system], args.new_tokens)
    same = [a[3] for a in answers["in-process"]] == [a[3] for a in answers["http"]]
    ratio = (results["http"]["tokens_per_s"] or 0) / (results["in-process"]["tokens_per_s"] or float("inf"))
    report = {"args": vars(args), "trace": trace_summary(trace, args.deltas, args.zipf), "results": results,
              "http_over_in_process_throughput": ratio, "same_answers": same}
    print(f"{'system':<11} {'done':>5} {'tok/s':>9} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>9} {'ttft p99':>9}")
    for system, r in results.items():
        print(f"{system:<11} {r['completed']:>5} {r['tokens_per_s']:>9.1f} {r['latency_p50_s']:>8.3f} "
              f"{r['latency_p99_s']:>8.3f} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f}")
    print(f"HTTP / in-process throughput: {ratio:.3f}; same answers: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
