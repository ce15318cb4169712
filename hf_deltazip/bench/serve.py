"""``deltazip bench serve``: many fine-tunes of one base, one request trace, five ways to serve it.

**The trace.** ``--requests`` requests over ``--deltas`` N fine-tunes, generated once from ``--seed``
and replayed in real time by every system:

* popularity is Zipf: the fine-tune of popularity rank ``i`` (1-based; rank ``i`` is named
  ``d{i-1}``, so ``d0`` is the most popular) is picked with probability ``i^-a / H(N, a)``, where
  ``a`` is ``--zipf`` and ``H(N, a) = sum_{j=1..N} j^-a``;
* arrivals are Poisson at ``--rate`` requests per second (exponential gaps between arrivals);
* every prompt is ``--prompt-len`` random token ids and every answer exactly ``--new-tokens`` tokens
  (no end-of-sequence stop).

**The systems.** All decode through :class:`hf_deltazip.serving.DecodeEngine` (static KV cache,
continuous batching, CUDA-graph decode steps on CUDA) with at most ``--batch`` rows:

1. ``deltazip``: one :class:`~hf_deltazip.DeltaModel` with all N packed deltas on the GPU; requests
   are admitted first come, first served into any free row, each row with its own delta.
2. ``one-delta-loop``: the same model and engine, but only rows of one delta run at a time: take the
   delta of the oldest waiting request, admit that delta's requests (and its new arrivals while they
   run) until no row is active, then move on. Under overload a popular delta's arrivals can keep its
   turn going while the others wait: the report counts requests left waiting at the cap.
3. ``swap-cpu``: a plain transformers model; each fine-tune is a full 16-bit copy of the weights in
   pinned host memory, copied into the live parameters before a different fine-tune runs (same
   scheduler as 2). N full copies of an 8B model do not fit in host memory, so ``--host-buffers`` H
   copies are reused (fine-tune i uses copy i % H): the cost measured is the transfer.
4. ``swap-disk``: the same, reading each fine-tune from a safetensors file on local disk
   (``--disk-files`` F files reused, fine-tune i uses file i % F), with the file's pages evicted
   from the page cache (``posix_fadvise(DONTNEED)``, plus ``drop_caches`` when root) before each
   load, so the disk is read.
5. ``all-resident`` (the upper bound): N full copies on the GPU next to the model; switching is a
   device-to-device copy into the live parameters. Skipped when they do not fit.
6. ``peft``: what Hugging Face users run for many tunes today: transformers + PEFT, one LoRA adapter
   (rank ``--lora-rank``, default 16, on every linear layer) per fine-tune, waiting requests batched
   through ``generate(adapter_names=[...])`` (mixed adapters in one batch), a batch at a time
   (:class:`PeftBatcher`). Its TTFT is its batch's end: ``generate`` does not stream.

Systems 1-2 admit through :meth:`DecodeEngine.pick` (deltas already in the step first, no request
bypassed by more than K later ones; see :class:`~hf_deltazip.serving.AdmissionPolicy`).

**Where the time goes.** Per system, a second table splits the replay's wall time into prefill, loads
(deltas becoming resident; whole fine-tunes copied in for the swap systems), decode steps (and the
share of them spent on idle rows), and the rest (waiting for arrivals, host work between steps), with
the mean distinct deltas per decode step, bytes read per step against the floor (base weights + each
distinct delta once + only the KV entries rows attend to), and CUDA-graph captures
(:func:`time_split`, from the engine's :class:`~hf_deltazip.serving.EngineStats`).

**Real deltas.** ``--base DIR`` with ``--delta NAME=DIR`` (repeatable) or ``--delta-dir DIR`` (every
delta folder in it) serves real compressed fine-tunes of a pretrained base instead of random 8B-shaped
deltas; ``--deltas`` is then their number and popularity rank follows the order given. The swap
baselines move the same number of bytes (the base's size) with noise in place of the fine-tunes' weights.

Each system stops admitting after ``--max-seconds``; rows already running finish and the run is
reported as truncated. Per system: requests completed, output tokens/s (all output tokens / (last
finish - first arrival)), mean and p99 latency (finish - arrival) and time to first token (first
token - arrival), switches and seconds spent switching weights, peak GPU memory, and deltazip's
throughput over each baseline's.

Weights and deltas are random (speed does not depend on training). ``--shape tiny --device cpu`` is a
smoke test of the whole path on a CPU.

Example:
    deltazip bench serve --shape 8b --deltas 32 --bits 4 --rate 4 --requests 256 --json serve.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..serving.engine import Pending
from .decode import LORA_TARGETS, SHAPES, build_base, drop_page_cache, evict_file, random_delta

SYSTEMS = ("deltazip", "one-delta-loop", "swap-cpu", "swap-disk", "all-resident", "peft")
ZIPF_CONVENTION = "P(rank i) = i^-a / sum_j j^-a, i = 1..N (rank i is delta d{i-1})"
_GIB = 2**30


# ---------------------------------------------------------------------------------------------- trace
@dataclass
class Request:
    """One request of the trace."""

    id: int
    arrival: float  # seconds after the replay starts
    delta: int  # index of its fine-tune: popularity rank - 1
    prompt: list


def zipf_probabilities(n: int, a: float) -> list:
    """``p[i-1] = i^-a / H(n, a)``: the share of requests for the fine-tune of popularity rank ``i``."""
    if n < 1:
        raise ValueError(f"the number of deltas must be at least 1, got {n}")
    if a < 0:
        raise ValueError(f"the Zipf exponent must be >= 0 (0 = uniform), got {a}")
    weights = [i ** -a for i in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def make_trace(*, num_deltas: int, requests: int, rate: float, zipf: float, prompt_len: int,
               vocab_size: int, seed: int) -> list:
    """The request trace: Poisson arrivals at ``rate``/s, Zipf(``zipf``) popularity, random prompts.

    The same arguments always give the same trace (it draws from its own ``random.Random(seed)``).
    """
    if rate <= 0:
        raise ValueError(f"--rate must be positive (requests per second), got {rate}")
    if requests < 1 or prompt_len < 1:
        raise ValueError("--requests and --prompt-len must be at least 1")
    rng = random.Random(seed)
    cum = list(itertools.accumulate(zipf_probabilities(num_deltas, zipf)))
    ranks = list(range(num_deltas))
    trace, t = [], 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        delta = rng.choices(ranks, cum_weights=cum)[0]
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        trace.append(Request(i, t, delta, prompt))
    return trace


def trace_summary(trace: Sequence[Request], num_deltas: int, zipf: float) -> dict:
    counts = [0] * num_deltas
    for r in trace:
        counts[r.delta] += 1
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:])]
    return {"requests": len(trace), "duration_s": trace[-1].arrival, "requests_per_delta": counts,
            "rank1_share": counts[0] / len(trace), "rank1_share_expected": zipf_probabilities(num_deltas, zipf)[0],
            "distinct_deltas": sum(1 for c in counts if c), "offered_requests_per_s": len(trace) / trace[-1].arrival,
            "mean_gap_s": sum(gaps) / len(gaps) if gaps else None}


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class Outcome:
    """What happened to one request (times in seconds after the replay started)."""

    id: int
    delta: int
    arrival: float
    first_token: Optional[float] = None
    finish: Optional[float] = None
    tokens: list = field(default_factory=list)


@dataclass
class Replay:
    """The result of :func:`replay`: finished requests and what the scheduler did."""

    outcomes: list  # finished requests, in order of finishing
    submitted: int
    truncated: bool
    wall_s: float
    switches: int = 0  # times the running fine-tune changed (one-at-a-time systems)
    switch_s: float = 0.0  # seconds spent in ``switch`` (copying weights)
    switch_log: list = field(default_factory=list)  # what each ``switch`` call returned
    left_waiting: list = field(default_factory=list)  # arrived but never admitted (truncated runs)


def replay(engine, trace: Sequence[Request], names: Sequence, *, new_tokens: int, max_seconds: float,
           one_at_a_time: bool = False, switch: Optional[Callable[[int], object]] = None,
           clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> Replay:
    """Serve ``trace`` in real time through ``engine``; return every request's timings and tokens.

    Args:
        engine: a :class:`~hf_deltazip.serving.DecodeEngine` (or anything with ``add``, ``step``, ``free``
            and ``can_add``; with ``pick``, mixed admission follows the engine's admission policy).
        trace: the requests, sorted by arrival.
        names: ``names[r.delta]`` is the delta name the engine gets for request ``r`` (``None``: the
            model as it is, for systems that switch weights instead).
        new_tokens: tokens generated per request (no early stop).
        max_seconds: after this long no request is admitted; the rows already running finish.
        one_at_a_time: rows of only one fine-tune run together (the oldest waiting request's, until
            no row is active). ``False``: first come, first served into any free row.
        switch: called with a fine-tune index, and timed, before rows of a fine-tune other than the
            last one run (only with ``one_at_a_time``); its return value is kept in ``switch_log``.
    """
    pending = deque(trace)
    waiting: list = []  # arrived, not admitted, in arrival order
    live: dict = {}  # engine handle -> Outcome
    done: list = []
    current = None  # the fine-tune whose rows run (one_at_a_time)
    pend: dict = {}  # request id -> its Pending (bypass counts carry over between rounds)
    result = Replay(outcomes=done, submitted=len(trace), truncated=False, wall_s=0.0)
    t0 = clock()
    while True:
        now = clock() - t0
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        if not result.truncated and now > max_seconds and (pending or waiting):
            result.truncated = True  # stop admitting; what runs finishes
        if not result.truncated and waiting and engine.free > 0:
            if one_at_a_time:
                # a fine-tune's turn: the requests waiting for it when its turn starts; arrivals wait for
                # their next turn (else a popular fine-tune keeps the turn and the others starve)
                batch = []
                if not live:
                    if waiting[0].delta != current:
                        current = waiting[0].delta
                        result.switches += 1
                        if switch is not None:
                            s = clock()
                            result.switch_log.append(switch(current))
                            result.switch_s += clock() - s
                    batch = [r for r in waiting if r.delta == current][: engine.free]
            elif hasattr(engine, "pick"):  # the engine's admission policy (deltas in the step first, bounded bypass)
                for r in waiting:
                    if r.id not in pend:
                        pend[r.id] = Pending(len(r.prompt), names[r.delta], item=r)
                batch = [p.item for p in engine.pick([pend[r.id] for r in waiting])]
            else:  # first come, first served; a request whose delta cannot be resident yet lets others by
                batch = []
                for r in waiting:
                    if len(batch) >= engine.free:
                        break
                    if engine.can_add(len(r.prompt), [names[x.delta] for x in batch] + [names[r.delta]]):
                        batch.append(r)
            if batch:
                chosen = {r.id for r in batch}
                for i in chosen:
                    pend.pop(i, None)
                waiting = [r for r in waiting if r.id not in chosen]
                handles = engine.add([r.prompt for r in batch], [names[r.delta] for r in batch],
                                     max_new_tokens=new_tokens, eos_token_id=None)
                first = clock() - t0  # add() returns once every row has its first token
                for h, r in zip(handles, batch):
                    live[h] = Outcome(r.id, r.delta, r.arrival, first_token=first)
        if waiting and not live and not result.truncated:
            raise RuntimeError(f"the engine reports {engine.free} free rows and no request running, so nothing can "
                               "be admitted: check DecodeEngine.free")
        if live:
            finished = engine.step()
            now = clock() - t0
            for h, tokens in finished:
                out = live.pop(h)
                out.tokens = list(tokens)
                # a row whose only token came from add() finished there
                out.finish = out.first_token if len(out.tokens) <= 1 else now
                done.append(out)
            continue
        if result.truncated or not (pending or waiting):
            break
        if not waiting:  # idle until the next arrival (or the cap)
            sleep(max(0.0, min(pending[0].arrival, max_seconds + 1e-3) - (clock() - t0)))
    result.wall_s = clock() - t0
    result.left_waiting = waiting
    return result


def time_split(engine_stats, run: Replay) -> dict:
    """Where a replay's wall time went: prefill, loads (deltas becoming resident, or whole fine-tunes
    copied in by ``switch``), decode steps (of which idle rows), and the rest (waiting for arrivals,
    scheduling, host work between steps; of it, ``admission_s`` in the engine's ``pick``, ``stage_s`` of that
    staging deltas ahead; ``stage_in_steps_s``: staging written inside decode steps, part of decode, with
    ``AdmissionPolicy.stage_in_steps``); plus distinct deltas and bytes per decode step, and ``ahead_steps``: decode
    steps launched before the last one's tokens were read back (``AdmissionPolicy.overlap_steps``). On a GPU also the
    device's own time in prefills and decode steps (``prefill_device_s``, ``decode_device_s``, CUDA events) and
    ``device_idle_s``, the wall time outside both: what the device spent waiting for the host, loads or arrivals.

    ``engine_stats`` is the engine's :class:`~hf_deltazip.serving.EngineStats` for this replay alone
    (``None`` for an engine without one: only the switch time and the rest are known).
    """
    split = {"wall_s": run.wall_s, "switch_s": run.switch_s}
    if engine_stats is None:
        split.update(load_s=run.switch_s, other_s=run.wall_s - run.switch_s)
        return split
    st = engine_stats.as_dict()
    load = st["load_s"] + run.switch_s
    split.update({k: st[k] for k in ("prefill_s", "decode_s", "idle_row_s", "prefills", "decode_steps", "loads", "staged",
                                      "admission_s", "stage_s", "stage_in_steps_s", "mean_distinct_deltas", "bytes_per_step",
                                      "floor_bytes_per_step", "step_ms", "floor_GBps", "captures", "split_steps",
                                      "max_deltas_auto", "ahead_steps", "prefill_device_s", "decode_device_s")})
    split["load_s"] = load
    split["other_s"] = run.wall_s - load - st["prefill_s"] - st["decode_s"]
    if st["prefill_device_s"] is not None and st["decode_device_s"] is not None:
        split["device_idle_s"] = run.wall_s - st["prefill_device_s"] - st["decode_device_s"]
    return split


class PausableClock:
    """``time.perf_counter`` minus the time spent inside :meth:`paused` blocks.

    Preparing a measurement (evicting a file from the page cache) is not part of serving: with this
    clock driving :func:`replay`, the trace waits while it happens, as if it took no time.
    """

    def __init__(self):
        self.excluded = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.excluded

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: Replay, trace: Sequence[Request]) -> dict:
    """Throughput, latency and time to first token of one replay."""
    outs = run.outcomes
    tokens = sum(len(o.tokens) for o in outs)
    first_arrival = trace[0].arrival
    span = max((o.finish for o in outs), default=first_arrival) - first_arrival
    lat = [o.finish - o.arrival for o in outs]
    ttft = [o.first_token - o.arrival for o in outs]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {"requests": run.submitted, "completed": len(outs), "truncated": run.truncated,
            "output_tokens": tokens, "tokens_per_s": tokens / span if span > 0 else None,
            "latency_mean_s": mean(lat), "latency_p99_s": percentile(lat, 99),
            "ttft_mean_s": mean(ttft), "ttft_p99_s": percentile(ttft, 99),
            "switches": run.switches, "switch_s": run.switch_s, "wall_s": run.wall_s,
            # starvation shows here: requests that had arrived when the cap hit and were never admitted
            "left_waiting": len(run.left_waiting),
            "oldest_left_waiting_s": max((run.wall_s - r.arrival for r in run.left_waiting), default=None)}


# ---------------------------------------------------------------------------------------------- weights
class FlatWeights:
    """The parameters of a model laid end to end, so one buffer can hold a whole fine-tune."""

    def __init__(self, model):
        seen, self.names, self.params = set(), [], []
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.names.append(name)
            self.params.append(p)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"the model's parameters mix dtypes {sorted(map(str, dtypes))}: cast it to one dtype first")
        self.dtype = self.params[0].dtype
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.nbytes = n * self.params[0].element_size()

    def finetune(self, index: int):
        """Yield ``(offset, tensor)``: fine-tune ``index``'s weights (the base plus seeded random noise)."""
        device = self.params[0].device
        gen = torch.Generator(device=device).manual_seed(1_000_003 + index)
        for off, p in zip(self.offsets, self.params):
            noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(1e-3)
            yield off, (p.detach().float() + noise).to(self.dtype).reshape(-1)

    def fill(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        for off, t in self.finetune(index):
            flat[off: off + t.numel()].copy_(t)
        return flat

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        """Copy a fine-tune into the live parameters, in place (captured CUDA graphs stay valid)."""
        non_blocking = flat.device.type == "cuda" or flat.is_pinned()
        for off, p in zip(self.offsets, self.params):
            p.copy_(flat[off: off + p.numel()].view(p.shape), non_blocking=non_blocking)
        _sync(self.params[0].device)


# ---------------------------------------------------------------------------------------------- disk
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def write_safetensors(path: Path, weights: FlatWeights, index: int) -> int:
    """Write fine-tune ``index`` as a safetensors file, one tensor at a time; fsync it. Returns its size."""
    header, pos = {}, 0
    for name, p in zip(weights.names, weights.params):
        n = p.numel() * p.element_size()
        header[name] = {"dtype": _ST_NAMES[p.dtype], "shape": list(p.shape), "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in weights.finetune(index):
            f.write(memoryview(t.cpu().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be evicted: the loads must find the file on disk
    return path.stat().st_size


def _read_header(f, path, size: int) -> tuple:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: shorter than a safetensors header; delete it and run again")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
        raise ValueError(f"{path}: header length {n} runs past the end of the file; delete it and run again")
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _storage_read_bytes() -> Optional[int]:
    """Bytes this process has made the kernel fetch from storage (``/proc/self/io``), if the kernel says."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def filesystem_of(path: Path) -> Optional[str]:
    """The type of the filesystem holding ``path`` (``ext4``, ``xfs``, ``tmpfs``, ...), from ``/proc/mounts``."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    target, best = str(Path(path).resolve()), None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best[0])):
            best = (point, kind)
    return best[1] if best else None


class DiskLoader:
    """Read a safetensors file straight into a model's parameters through two pinned staging buffers.

    The file is read sequentially in ``chunk_bytes`` pieces; while the GPU copies one piece, the next
    is read into the other buffer. Every header entry is checked against the model before a byte moves.
    """

    def __init__(self, weights: FlatWeights, chunk_bytes: int = 64 << 20):
        self.weights = weights
        device = weights.params[0].device
        self.cuda = device.type == "cuda"
        self.staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.by_name = dict(zip(weights.names, weights.params))

    def _spans(self, header: dict, path) -> list:
        missing = set(self.by_name) - set(header)
        if missing:
            raise ValueError(f"{path}: no tensor for {sorted(missing)[:3]}...; delete the file and run again")
        spans = []
        for name, entry in header.items():
            p = self.by_name.get(name)
            if p is None:
                raise ValueError(f"{path}: tensor {name!r} is not a parameter of the model; delete the file and run again")
            b, e = entry["data_offsets"]
            if _ST_DTYPES.get(entry["dtype"]) != p.dtype or list(entry["shape"]) != list(p.shape) \
                    or e - b != p.numel() * p.element_size() or b < 0:
                raise ValueError(f"{path}: {name} is {entry} but the model has {p.dtype} {list(p.shape)}; "
                                 "delete the file and run again")
            spans.append((b, e, p.detach().view(-1).view(torch.uint8)))
        spans.sort(key=lambda s: s[0])
        return spans

    @torch.no_grad()
    def load(self, path: Path) -> int:
        """Copy every tensor of ``path`` into the parameter of the same name. Returns bytes read."""
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as f:
            header, start = _read_header(f, path, size)
            spans = self._spans(header, path)
            lo, hi = spans[0][0], spans[-1][1]
            if start + hi > size:
                raise ValueError(f"{path}: tensors run past the end of the file (truncated?); delete it and run again")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            f.seek(start + lo)
            chunk = self.staging[0].numel()
            events = [None, None]
            first_span = 0
            for k, c0 in enumerate(range(lo, hi, chunk)):
                c1 = min(c0 + chunk, hi)
                buf = self.staging[k % 2]
                if events[k % 2] is not None:
                    events[k % 2].synchronize()  # its previous piece has reached the GPU
                view = memoryview(buf.numpy())[: c1 - c0]
                got = 0
                while got < c1 - c0:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{path}: ended early; delete it and run again")
                    got += n
                while spans[first_span][1] <= c0:
                    first_span += 1
                j = first_span
                while j < len(spans) and spans[j][0] < c1:
                    b, e, dest = spans[j]
                    s0, s1 = max(b, c0), min(e, c1)
                    dest[s0 - b: s1 - b].copy_(buf[s0 - c0: s1 - c0], non_blocking=self.cuda)
                    j += 1
                if self.cuda:
                    events[k % 2] = torch.cuda.Event()
                    events[k % 2].record()
        _sync(self.weights.params[0].device)
        return hi - lo + start


# ---------------------------------------------------------------------------------------------- memory
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def host_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_free_bytes(device) -> Optional[int]:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def kv_cache_bytes(config, batch: int, max_length: int, elem: int = 2) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * max_length * batch * elem


def delta_bytes(model, bits: int, group_size: int) -> int:
    """Bytes of one random delta as :func:`random_delta` makes it (codes, fp16 scales, uint8 zeros)."""
    from ..modeling.arch import find_decoder_layers, linear_modules
    from ..packing import num_groups, packed_nbytes

    _, layers = find_decoder_layers(model)
    total = 0
    for layer in layers:
        for mod in linear_modules(layer).values():
            n, k = mod.weight.shape
            total += n * packed_nbytes(k, bits) + n * num_groups(k, group_size) * 3
    return total


def _free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # give freed pinned host buffers back to the system (the API moved between torch versions)
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def _peak_gib(device) -> Optional[float]:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / _GIB


class Skip(Exception):
    """A system that cannot run on this machine; the message says why and what would make it run."""


# ---------------------------------------------------------------------------------------------- systems
def _warm_up(engine, names: Sequence, vocab: int, prompt_len: int, steps: int) -> None:
    """Compile, capture and allocate outside the timed replay.

    A prefill of every size the replay can ask for (1 to all rows; kernels specialize on shapes),
    then decode steps of a full batch over many deltas and of a single row.
    """
    g = random.Random(12345)

    def serve(rows, new_tokens):
        prompts = [[g.randrange(vocab) for _ in range(prompt_len)] for _ in range(rows)]
        handles = set(engine.add(prompts, [names[i % len(names)] for i in range(rows)],
                                 max_new_tokens=new_tokens, eos_token_id=None))
        while handles:
            for h, _ in engine.step():
                handles.discard(h)

    rows = engine.free
    for k in range(1, rows + 1):
        serve(k, 1)  # answered by the prefill alone
    serve(rows, steps)
    serve(1, steps)


def _cache_length(args) -> int:
    """KV cache length: twice a request's length, so the engine shifts its cache at most once per request."""
    return 2 * (args.prompt_len + args.new_tokens)


def _admission(args, **changes):
    """The engine's :class:`~hf_deltazip.serving.AdmissionPolicy` from ``--max-bypass`` and ``--cost-aware``,
    with ``changes`` (an ``--admission-variant``'s fields) on top."""
    from ..serving import AdmissionPolicy

    fields = {"max_bypass": getattr(args, "max_bypass", None), "cost_aware": getattr(args, "cost_aware", False),
              "min_free_rows": getattr(args, "min_free_rows", None)}
    return AdmissionPolicy(**{**fields, **changes})


def _make_engine(model, args):
    from ..serving import DecodeEngine

    return DecodeEngine(model, max_batch_size=args.batch, max_length=_cache_length(args),
                        cuda_graphs=False if args.eager else None, max_deltas=args.max_deltas,
                        admission=_admission(args), fused_norms=getattr(args, "fused_norms", False))


_VARIANT_FIELDS = {"max_bypass": "count", "cost_aware": "bool", "prefer_running": "bool", "max_prefill_tokens": "count",
                   "stage_ahead": "bool", "min_free_rows": "rows", "stage_in_steps": "bool", "overlap_steps": "bool",
                   "prefill": "route"}
_PREFILL_ROUTES = ("auto", "fused", "dequant", "split")


def parse_admission_variant(text: str) -> dict:
    """``"max_bypass=512,cost_aware=on"`` -> ``{"max_bypass": 512, "cost_aware": True}`` (``--admission-variant``).

    Fields: ``max_bypass`` and ``max_prefill_tokens`` (a whole number >= 0, or ``none``), ``min_free_rows`` (a
    whole number >= 1, or ``none``), ``cost_aware``, ``prefer_running``, ``stage_ahead``, ``stage_in_steps`` and
    ``overlap_steps`` (``on``/``off``, ``true``/``false``, ``1``/``0``); and ``prefill`` (``auto``, ``fused``,
    ``dequant`` or ``split``), not an admission field but the model's prefill route for that replay
    (``DeltaModel.configure_kernels(prefill=...)``).
    """
    out = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not eq or key not in _VARIANT_FIELDS:
            raise ValueError(f"{part!r}: expected FIELD=VALUE with FIELD one of {', '.join(_VARIANT_FIELDS)}")
        if _VARIANT_FIELDS[key] == "route":
            if value not in _PREFILL_ROUTES:
                raise ValueError(f"{part!r}: {key} takes one of {', '.join(_PREFILL_ROUTES)}")
            out[key] = value
        elif _VARIANT_FIELDS[key] == "bool":
            if value not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError(f"{part!r}: {key} takes on or off")
            out[key] = value in ("on", "true", "1")
        elif value == "none":
            out[key] = None
        elif value.isdigit() and (_VARIANT_FIELDS[key] == "count" or int(value) >= 1):
            out[key] = int(value)
        else:
            least = 0 if _VARIANT_FIELDS[key] == "count" else 1
            raise ValueError(f"{part!r}: {key} takes a whole number >= {least} or none")
    if not out:
        raise ValueError(f"{text!r}: give at least one FIELD=VALUE")
    return out


def _variant_arg(text: str) -> tuple:
    try:
        return text, parse_admission_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run(name: str, engine, trace, names, args, *, one_at_a_time: bool, switch=None, clock=None,
         warm_names=None) -> tuple:
    device = args.device
    _warm_up(engine, warm_names or names, args.vocab_size, args.prompt_len, steps=min(args.new_tokens, 4))
    if switch is not None:
        switch(0)  # warm the copy path once; the replay's first switch is still timed
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if hasattr(engine, "reset_stats"):
        engine.reset_stats()  # the warm-up is not part of the split
    print(f"[{name}] replaying {len(trace)} requests ...", flush=True)
    run = replay(engine, trace, names, new_tokens=args.new_tokens, max_seconds=args.max_seconds,
                 one_at_a_time=one_at_a_time, switch=switch, clock=clock or PausableClock())
    stats = summarize(run, trace)
    stats["peak_gpu_gib"] = _peak_gib(device)
    stats["time_split"] = time_split(getattr(engine, "stats", None), run)
    if hasattr(engine, "step_costs"):  # what max_deltas="auto" has fitted its cap to, so far
        stats["step_costs"] = {str(u): {"steps": n, "mean_ms": 1e3 * total / n} for u, (n, total) in
                               sorted(engine.step_costs.items())}
    stats["grouped_attention"] = getattr(engine, "grouped_attention", None)  # one-token steps without per-head key copies
    print(f"[{name}] {stats['completed']}/{stats['requests']} requests, "
          f"{_fmt(stats['tokens_per_s'], '.1f')} tokens/s, mean latency {_fmt(stats['latency_mean_s'], '.2f')} s"
          + (" (truncated)" if run.truncated else ""), flush=True)
    return stats, run


def run_delta_systems(base, trace, args, wanted: Sequence[str], results: dict, skipped: dict, outcomes: dict) -> None:
    """``deltazip`` and ``one-delta-loop``: one DeltaModel with all N deltas, one engine."""
    from .. import kernels as K
    from ..modeling import DeltaModel

    real = getattr(args, "real_deltas", None)
    if real:  # a compressed file is smaller than its tensors once decompressed: twice its size as the estimate
        from ..format import DZ_FILENAME

        one = 2 * max((path / DZ_FILENAME).stat().st_size for path in real.values())
    else:
        one = delta_bytes(base, args.bits, args.group_size)
    kv = kv_cache_bytes(base.config, args.batch, _cache_length(args))
    free = device_free_bytes(args.device)
    resident = args.deltas if args.max_resident is None else min(args.max_resident, args.deltas)
    if args.max_resident is None and free is not None:
        resident = min(args.deltas, int((free - kv - 2 * _GIB) // one))  # as many as fit, the rest in host memory
    if resident < 1:
        for s in wanted:
            skipped[s] = (f"not even one delta of {one / _GIB:.1f} GiB fits next to the KV cache in "
                          f"{(free or 0) / _GIB:.1f} GiB: use --bits 2, --batch or --layers")
        return
    host = (args.deltas - resident) * one
    avail = host_available_bytes()
    if host and avail is not None and host > 0.8 * avail:
        for s in wanted:
            skipped[s] = (f"{args.deltas - resident} deltas that do not fit on the GPU need {host / _GIB:.1f} GiB of host "
                          f"memory, {avail / _GIB:.1f} GiB are free: use --bits 2 or fewer --deltas")
        return
    # random deltas (made on the GPU) get a host copy each up front, as deltas read from files have, so that an
    # eviction copies nothing back; where host memory allows and not all of them stay resident
    hosted = not real and resident < args.deltas and avail is not None and args.deltas * one < 0.6 * avail
    cap = {None: "", "auto": "distinct deltas per step capped from measured step costs (max_deltas='auto'); "}.get(
        args.max_deltas, f"at most {args.max_deltas} distinct deltas decoding at once; ")
    tier = cap + ("all deltas resident" if resident == args.deltas else
            f"{resident} of {args.deltas} deltas resident on the GPU (LRU), the others in pinned host memory, "
            "uploaded when a request needs them" + (
                " (every delta has a host copy: evicting one copies nothing back)" if hosted else ""))
    if getattr(args, "decode", "auto") != "auto":
        tier += f"; decode route {args.decode!r}"
    if getattr(args, "gluon_block_rows", None) is not None:
        tier += f"; Gluon decode kernel row blocks of {args.gluon_block_rows}"
    if getattr(args, "gluon_stages", None) is not None:
        tier += f"; Gluon decode kernel with {args.gluon_stages} copy stages"
    policy = ""  # the flags' admission policy, said of the runs that use it (a variant prints its own)
    if getattr(args, "max_bypass", None) is not None:
        policy += f"; fairness bound {args.max_bypass} (a request is passed over by at most that many later ones)"
    if getattr(args, "min_free_rows", None) is not None:
        policy += f"; prefills coalesced (while rows run, admission waits for {args.min_free_rows} free rows)"
    if getattr(args, "cost_aware", False):
        policy += "; cost-aware admission (a new delta joins the step only when its rows raise tokens per second)"
    how = {"deltazip": f"{tier}; continuous batching, every row its own delta",
           "one-delta-loop": f"{tier}; same engine, rows of one delta at a time"}
    dm = engine = block_rows_before = stages_before = None
    try:
        dm = DeltaModel(base)
        dm.configure_cache(max_resident=resident)  # before adding: the kernel stacks are sized once
        dm.configure_kernels(prefill=args.prefill, decode=getattr(args, "decode", "auto"))
        if getattr(args, "gluon_block_rows", None) is not None:  # before the first step builds its launch configs
            block_rows_before = K.set_gluon_block_rows(args.gluon_block_rows)
        if getattr(args, "gluon_stages", None) is not None:
            stages_before = K.set_gluon_stages(args.gluon_stages)
        if real:
            names = list(real)
            for i, (n, path) in enumerate(real.items()):  # popularity follows the order given
                dm.load_delta(path, delta_name=n, resident=i < resident)
        else:
            names = [f"d{i}" for i in range(args.deltas)]
            for i, n in enumerate(names):  # the most popular ones resident
                dm.add_delta(random_delta(base, args.bits, args.group_size, seed=i), n,
                             resident=i < resident and not hosted)
            if hosted:
                dm.cache.ensure_resident(names[:resident])
        engine = _make_engine(dm, args)
        runs = [(system, system, None) for system in wanted]
        if "deltazip" in wanted:  # the same model and engine (measured step costs kept), admission changed
            runs += [(f"deltazip[{text}]", "deltazip", fields) for text, fields in getattr(args, "admission_variant", [])]
        for name, system, fields in runs:
            fields = dict(fields or {})
            route = fields.pop("prefill", args.prefill)
            dm.configure_kernels(prefill=route)
            engine.admission = _admission(args, **fields)
            results[name], run = _run(name, engine, trace, names, args, one_at_a_time=system == "one-delta-loop",
                                      warm_names=names[:resident])
            results[name]["how"] = (how[system] + f"; prefill route {route!r}"
                                    + (f"; admission {engine.admission}" if fields else policy))
            results[name]["resident_deltas"] = resident
            outcomes[name] = run.outcomes
    except torch.cuda.OutOfMemoryError as e:
        for system in wanted:
            if system not in results:
                skipped[system] = f"out of GPU memory ({str(e).splitlines()[0]}): use --bits 2, fewer --deltas, --batch or --layers"
                print(f"[{system}] skipped: {skipped[system]}", flush=True)
    finally:
        if block_rows_before is not None:  # the setting before this run, for whatever runs next in this process
            K.set_gluon_block_rows(block_rows_before)
        if stages_before is not None:
            K.set_gluon_stages(stages_before)
        del engine, dm
        _free_memory(args.device)


def run_swap_systems(trace, args, wanted: Sequence[str], results: dict, skipped: dict, outcomes: dict) -> None:
    """``swap-cpu``, ``swap-disk`` and ``all-resident`` on a fresh plain model, one engine."""
    model = _base_model(args)
    weights = FlatWeights(model)
    names = [None] * args.deltas
    engine = _make_engine(model, args)
    try:
        for system in wanted:
            try:
                setup = {"swap-cpu": _setup_swap_cpu, "swap-disk": _setup_swap_disk,
                         "all-resident": _setup_all_resident}[system]
                clock = PausableClock()
                switch, info, cleanup = setup(model, weights, args, clock)
            except (Skip, torch.cuda.OutOfMemoryError) as e:
                skipped[system] = str(e) if isinstance(e, Skip) else f"out of GPU memory while preparing it: {str(e).splitlines()[0]}"
                print(f"[{system}] skipped: {e}", flush=True)
                continue
            try:
                stats, run = _run(system, engine, trace, names, args, one_at_a_time=True, switch=switch, clock=clock)
                stats.update(info)
                if system == "swap-disk":
                    stats.update(_disk_report(run.switch_log))
                results[system] = stats
                outcomes[system] = run.outcomes
            except torch.cuda.OutOfMemoryError as e:
                skipped[system] = f"out of GPU memory ({str(e).splitlines()[0]}): use fewer --deltas, --batch or --layers"
                print(f"[{system}] skipped: {skipped[system]}", flush=True)
            finally:
                cleanup()
                del switch
                _free_memory(args.device)
    finally:
        del engine, model
        _free_memory(args.device)


class PeftBatcher:
    """transformers + PEFT the way its users serve many LoRA fine-tunes: one model carrying every adapter,
    batches of waiting requests run through ``generate(adapter_names=[...])`` (PEFT's per-row mixed-adapter
    inference), a new batch once the last one is done (dynamic batching: no continuous admission).

    It has the engine interface :func:`replay` drives: :meth:`add` runs the whole batch (so a request's
    first token is known only when its batch ends: ``generate`` does not stream), :meth:`step` hands
    the answers back.
    """

    def __init__(self, model, max_batch_size: int, pad_token_id: int = 0):
        self.model, self.max_batch_size, self.pad_token_id = model, max_batch_size, pad_token_id
        self._done: list = []
        self._next = 0

    @property
    def free(self) -> int:
        return 0 if self._done else self.max_batch_size

    @property
    def active(self) -> int:
        return len(self._done)

    def can_add(self, prompt_len: int, delta_names: Sequence = ()) -> bool:
        return len(delta_names) <= self.free

    @torch.no_grad()
    def add(self, prompts, delta_names, max_new_tokens: int, eos_token_id=None) -> list:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                  adapter_names=list(delta_names), max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_token_id,
                                  eos_token_id=eos_token_id)
        handles = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        self._done = list(zip(handles, out[:, width:].tolist()))
        return handles

    def step(self) -> list:
        done, self._done = self._done, []
        return done


def run_peft_system(trace, args, results: dict, skipped: dict, outcomes: dict) -> None:
    """``peft``: one LoRA adapter (rank ``--lora-rank``, every linear layer of every block) per fine-tune."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        skipped["peft"] = "peft is not installed: pip install peft"
        print(f"[peft] skipped: {skipped['peft']}", flush=True)
        return
    model = _base_model(args)
    try:
        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS,
                          init_lora_weights=False)  # random A and B: every adapter changes the output
        names = [f"d{i}" for i in range(args.deltas)]
        torch.manual_seed(0)
        pm = get_peft_model(model, lora, adapter_name=names[0])
        for n in names[1:]:
            pm.add_adapter(n, lora)
        pm.to(dtype=next(model.parameters()).dtype).eval()
        batcher = PeftBatcher(pm, args.batch)
        batcher.add([[1] * args.prompt_len], [names[0]], max_new_tokens=2)  # warm-up
        batcher.step()
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        print(f"[peft] replaying {len(trace)} requests ...", flush=True)
        run = replay(batcher, trace, names, new_tokens=args.new_tokens, max_seconds=args.max_seconds)
        stats = summarize(run, trace)
        stats["peak_gpu_gib"] = _peak_gib(args.device)
        stats["time_split"] = time_split(None, run)
        stats["how"] = (f"transformers + PEFT, {args.deltas} LoRA adapters of rank {args.lora_rank} on "
                        f"{', '.join(LORA_TARGETS)}; batches of up to {args.batch} waiting requests through "
                        "generate(adapter_names=...) (mixed adapters per batch), a new batch when the last ends; "
                        "TTFT is the batch's end (generate does not stream)")
        results["peft"], outcomes["peft"] = stats, run.outcomes
        print(f"[peft] {stats['completed']}/{stats['requests']} requests, {_fmt(stats['tokens_per_s'], '.1f')} tokens/s",
              flush=True)
    except torch.cuda.OutOfMemoryError as e:
        skipped["peft"] = f"out of GPU memory ({str(e).splitlines()[0]}): use fewer --deltas or --batch"
        print(f"[peft] skipped: {skipped['peft']}", flush=True)
    finally:
        del model
        _free_memory(args.device)


def parse_real_deltas(specs: Sequence[str], folders: Sequence[str]) -> dict:
    """``NAME=DIR`` specs plus every delta folder inside each of ``folders`` -> ``{name: Path}``.

    Raises:
        ValueError: a spec without ``=``, a folder that is not a delta folder, or a name given twice.
    """
    from ..format import DZ_FILENAME

    out: dict = {}

    def put(name, path):
        path = Path(path)
        if not (path / DZ_FILENAME).is_file():
            raise ValueError(f"{path} holds no {DZ_FILENAME}: pass a folder made by save_pretrained of a compressed delta")
        if name in out:
            raise ValueError(f"two deltas named {name!r}: give each --delta a different NAME")
        out[name] = path

    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--delta {spec!r}: write it as NAME=DIR")
        put(name, path)
    for folder in folders:
        subs = sorted(d for d in Path(folder).iterdir() if (d / DZ_FILENAME).is_file()) if Path(folder).is_dir() else []
        if not subs:
            raise ValueError(f"--delta-dir {folder}: no delta folders (each with {DZ_FILENAME}) inside it")
        for d in subs:
            put(d.name, d)
    return out


def _base_model(args):
    """The base every system runs: a random Llama of ``--shape``, or the pretrained ``--base`` folder in bf16."""
    if args.base is None:
        return build_base(args.shape, args.device, args.layers)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16)
    return model.to(args.device).eval()


def _setup_swap_cpu(model, weights: FlatWeights, args, clock):
    h = args.host_buffers
    avail = host_available_bytes()
    if avail is not None and h * weights.nbytes > 0.9 * avail:
        raise Skip(f"{h} host copies of {weights.nbytes / _GIB:.1f} GiB do not fit in {avail / _GIB:.1f} GiB of free "
                   "host memory: use --host-buffers 1")
    pin = torch.device(args.device).type == "cuda"
    buffers = []
    for i in range(h):
        buf = torch.empty(weights.numel, dtype=weights.dtype, pin_memory=pin)
        buffers.append(weights.fill(buf, i))

    def switch(index):
        weights.load(buffers[index % h])

    info = {"how": f"full 16-bit copies in {'pinned ' if pin else ''}host memory copied into the live parameters; "
                   f"{h} copies reused (fine-tune i uses copy i % {h}): the cost measured is the transfer",
            "finetune_gib": weights.nbytes / _GIB, "host_buffers": h}
    return switch, info, buffers.clear


def _setup_swap_disk(model, weights: FlatWeights, args, clock: PausableClock):
    f_count = args.disk_files
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="deltazip-serve-", dir=os.environ.get("TMPDIR"))) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    if f_count * weights.nbytes > free - _GIB:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise Skip(f"{f_count} files of {weights.nbytes / _GIB:.1f} GiB do not fit in {free / _GIB:.1f} GiB free in "
                   f"{workdir}: pass --workdir on a larger local disk or --disk-files 1")
    fs = filesystem_of(workdir)
    if fs in ("tmpfs", "ramfs"):
        print(f"[swap-disk] warning: {workdir} is on {fs}, so its 'disk' reads are memory copies; pass --workdir on "
              "a local disk", flush=True)
    paths = [workdir / f"finetune-{i}.safetensors" for i in range(f_count)]
    t = time.perf_counter()
    try:
        for i, p in enumerate(paths):
            write_safetensors(p, weights, i)
    except BaseException:
        for p in paths:
            p.unlink(missing_ok=True)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    print(f"[swap-disk] wrote {f_count} x {weights.nbytes / _GIB:.1f} GiB to {workdir} in {time.perf_counter() - t:.1f} s",
          flush=True)
    loader = DiskLoader(weights)

    def switch(index):
        path = paths[index % f_count]
        t = time.perf_counter()
        with clock.paused():  # making the cache cold is the measurement's cost, not the server's
            dropped = drop_page_cache()
            evicted = evict_file(path)
        evict_s = time.perf_counter() - t
        io0 = _storage_read_bytes()
        t0 = time.perf_counter()
        nbytes = loader.load(path)
        s = time.perf_counter() - t0
        io1 = _storage_read_bytes()
        return {"file": path.name, "bytes": nbytes, "s": s, "GBps": nbytes / s / 1e9,
                "storage_read_bytes": None if io0 is None or io1 is None else io1 - io0,
                "drop_caches": dropped, "fadvise_dontneed": evicted, "evict_s_excluded": evict_s}

    def cleanup():
        loader.staging.clear()
        for p in paths:
            p.unlink(missing_ok=True)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)

    info = {"how": f"each fine-tune read from a safetensors file on local disk into the live parameters; "
                   f"{f_count} files reused (fine-tune i uses file i % {f_count})",
            "finetune_gib": weights.nbytes / _GIB, "disk_files": f_count, "workdir": str(workdir), "filesystem": fs}
    return switch, info, cleanup


def _disk_report(log: list) -> dict:
    loads = [x for x in log if x]
    if not loads:
        return {"loads": []}
    total = sum(x["bytes"] for x in loads)
    secs = sum(x["s"] for x in loads)
    storage = [x["storage_read_bytes"] for x in loads]
    measured = all(s is not None for s in storage)
    if any(x["drop_caches"] for x in loads):
        how = "whole page cache dropped (drop_caches) and the file evicted (posix_fadvise DONTNEED) before each load"
    elif all(x["fadvise_dontneed"] for x in loads):
        how = "the file evicted with posix_fadvise(DONTNEED) before each load (not root: drop_caches unavailable)"
    else:
        how = "NOT evicted (posix_fadvise unavailable): loads may come from the page cache"
    if measured:
        share = sum(storage) / total
        how += f"; the kernel reports {share:.0%} of the bytes read from storage"
        if share < 0.9:
            how += " (the rest came from a cache: treat GB/s as optimistic)"
    how += (f"; evicting took {sum(x['evict_s_excluded'] for x in loads):.2f} s in all, left out of every timing "
            "(the replay clock stops meanwhile)")
    return {"loads": loads, "page_cache": how, "disk_GBps_mean": total / secs / 1e9,
            "disk_GBps_min": min(x["GBps"] for x in loads), "disk_bytes_read": total,
            "storage_read_bytes": sum(storage) if measured else None}


def _setup_all_resident(model, weights: FlatWeights, args, clock):
    n = args.deltas
    free = device_free_bytes(args.device)
    # the engine's KV cache may not exist yet (it is made at the first request); 2 GiB for activations
    need = n * weights.nbytes + kv_cache_bytes(model.config, args.batch, _cache_length(args)) + 2 * _GIB
    if free is not None and need > free:
        raise Skip(f"{n} full fine-tunes need {n * weights.nbytes / _GIB:.1f} GiB but {free / _GIB:.1f} GiB are free "
                   "next to the model and KV cache: only a small shape fits (e.g. --shape 1b), or use fewer --deltas")
    copies = [weights.fill(torch.empty(weights.numel, dtype=weights.dtype, device=args.device), i) for i in range(n)]

    def switch(index):
        weights.load(copies[index])

    info = {"how": f"{n} full 16-bit copies kept on the {torch.device(args.device).type.upper()}; switching is a "
                   "device-to-device copy into the live parameters", "finetune_gib": weights.nbytes / _GIB}
    return switch, info, copies.clear


# ---------------------------------------------------------------------------------------------- report
def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(results: dict) -> str:
    rows = ["| system | completed | output tok/s | latency mean (s) | latency p99 (s) | TTFT mean (s) | TTFT p99 (s) "
            "| switches | switch s | peak GPU GiB | deltazip x |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        done = f"{r['completed']}/{r['requests']}" + (" (truncated)" if r["truncated"] else "")
        rows.append(f"| {name} | {done} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['latency_mean_s'], '.2f')} "
                    f"| {_fmt(r['latency_p99_s'], '.2f')} | {_fmt(r['ttft_mean_s'], '.3f')} | {_fmt(r['ttft_p99_s'], '.3f')} "
                    f"| {r['switches']} | {r['switch_s']:.2f} | {_fmt(r['peak_gpu_gib'], '.1f')} "
                    f"| {_fmt(r.get('deltazip_speedup'), '.2f')} |")
    return "\n".join(rows)


def split_table(results: dict) -> str:
    """Markdown: where each system's wall time went (see :func:`time_split`)."""
    rows = ["| system | wall s | prefill s | loads s (admissions) | staged ahead | decode s | of which idle rows s "
            "| of which staging s | other s | of which admission s (staging) | decode steps | step ms "
            "| distinct deltas / step | MB read / step | MB floor / step | floor GB/s | graph captures "
            "| device s: prefill / decode / idle |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mb = (lambda x: None if x is None else x / 1e6)
    for name, r in results.items():
        t = r.get("time_split", {})
        rows.append(f"| {name} | {_fmt(t.get('wall_s'), '.2f')} | {_fmt(t.get('prefill_s'), '.2f')} "
                    f"| {_fmt(t.get('load_s'), '.2f')} ({_fmt(t.get('loads'), 'd')}) | {_fmt(t.get('staged'), 'd')} "
                    f"| {_fmt(t.get('decode_s'), '.2f')} | {_fmt(t.get('idle_row_s'), '.2f')} "
                    f"| {_fmt(t.get('stage_in_steps_s'), '.2f')} | {_fmt(t.get('other_s'), '.2f')} | {_fmt(t.get('admission_s'), '.2f')} ({_fmt(t.get('stage_s'), '.2f')}) "
                    f"| {_fmt(t.get('decode_steps'), 'd')} | {_fmt(t.get('step_ms'), '.2f')} "
                    f"| {_fmt(t.get('mean_distinct_deltas'), '.2f')} | {_fmt(mb(t.get('bytes_per_step')), '.1f')} "
                    f"| {_fmt(mb(t.get('floor_bytes_per_step')), '.1f')} | {_fmt(t.get('floor_GBps'), '.0f')} "
                    f"| {_fmt(t.get('captures'), 'd')} | {_fmt(t.get('prefill_device_s'), '.2f')} / "
                    f"{_fmt(t.get('decode_device_s'), '.2f')} / {_fmt(t.get('device_idle_s'), '.2f')} |")
    return "\n".join(rows)


def _environment(args, argv) -> dict:
    import transformers

    device = torch.device(args.device)
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here, timeout=5).stdout.strip() or None
        if commit:  # a tree that differs from its commit is not that commit
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                   capture_output=True, text=True, cwd=here.parent, timeout=10).stdout.strip()
            commit += "+modified" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "command": "deltazip bench serve " + " ".join(argv)}


def _at_least(text: str, least: int) -> Optional[int]:
    """``text`` as a whole number if it is one and at least ``least``, else ``None``."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= least else None


def _min_free_rows_arg(text: str) -> int:
    value = _at_least(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(f"--min-free-rows takes a number of rows >= 1, got {text!r}")
    return value


def _max_bypass_arg(text: str) -> int:
    value = _at_least(text, 0)
    if value is None:
        raise argparse.ArgumentTypeError(f"--max-bypass takes a whole number >= 0 (0: first come, first served), got {text!r}")
    return value


def _max_deltas_arg(text: str):
    if text in ("auto", "none"):
        return None if text == "none" else text
    value = _at_least(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number, 'auto' or 'none'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltazip bench serve", description=__doc__.split("``: ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="random Llama shape of the base (default 8b)")
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape has (quick runs)")
    p.add_argument("--base", help="real mode: a pretrained base model folder (instead of a random --shape)")
    p.add_argument("--delta", action="append", default=[], metavar="NAME=DIR",
                   help="real mode: a compressed delta of --base (repeat; popularity rank follows the order)")
    p.add_argument("--delta-dir", action="append", default=[], metavar="DIR",
                   help="real mode: every delta folder inside DIR (sorted by name)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test with --shape tiny)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)} (default: all that fit)")
    p.add_argument("--deltas", type=int, default=32, help="number of fine-tunes N (default 32)")
    p.add_argument("--zipf", type=float, default=1.0, help=f"Zipf exponent a: {ZIPF_CONVENTION} (default 1.0)")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s (default 4)")
    p.add_argument("--requests", type=int, default=256, help="requests in the trace (default 256)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="output tokens per request, no early stop (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (default 0)")
    p.add_argument("--batch", type=int, default=32, help="most rows decoding at once (default 32)")
    p.add_argument("--bits", type=int, default=4, help="delta bits (default 4)")
    p.add_argument("--group-size", type=int, default=128, help="delta quantization group (default 128)")
    p.add_argument("--max-deltas", type=_max_deltas_arg, default="auto",
                   help="deltazip: most distinct deltas among the decoding rows: a number, 'none' (no limit) or "
                        "'auto' (default: the engine picks it from measured step costs)")
    p.add_argument("--max-bypass", type=_max_bypass_arg, help="deltazip: the fairness bound K, most later requests admitted before a "
                   "waiting one (default: the engine's, 16 x --batch)")
    p.add_argument("--cost-aware", action="store_true",
                   help="deltazip: admit a request for a delta not in the step only when its rows raise the step's tokens/s "
                        "(AdmissionPolicy.cost_aware)")
    p.add_argument("--min-free-rows", type=_min_free_rows_arg,
                   help="deltazip: while rows run, admit only once this many rows are free (or every waiting request "
                        "fits), so prefills come in fewer, larger rounds (AdmissionPolicy.min_free_rows; default: off)")
    p.add_argument("--admission-variant", action="append", default=[], type=_variant_arg, metavar="FIELD=VALUE,...",
                   help="deltazip: one more replay on the same model and engine with these AdmissionPolicy fields changed "
                        "(max_bypass, max_prefill_tokens, min_free_rows: a number or none; cost_aware, prefer_running, "
                        "stage_ahead, stage_in_steps, overlap_steps: on/off; and the model's prefill route: "
                        "prefill=auto/fused/dequant/split), reported "
                        "as deltazip[FIELD=VALUE,...]; repeatable")
    p.add_argument("--max-resident", type=int, help="deltas kept on the GPU (default: as many as fit; the others wait in pinned host memory)")
    p.add_argument("--lora-rank", type=int, default=16, help="peft: LoRA rank of each fine-tune's adapter (default 16)")
    p.add_argument("--host-buffers", type=int, default=2, help="swap-cpu: full host copies reused (default 2)")
    p.add_argument("--disk-files", type=int, default=2, help="swap-disk: safetensors files reused (default 2)")
    p.add_argument("--workdir", help="swap-disk: folder on a local disk for the files (default: a temporary folder)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="cap per system: admit no request after it (default 120)")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--fused-norms", action="store_true",
                   help="every system's engine runs the model's RMSNorms in one Triton launch each (DecodeEngine(fused_norms=True))")
    p.add_argument("--prefill", choices=["auto", "fused", "dequant", "split"], default="auto",
                   help="deltazip systems: how prefills run the deltas (DeltaModel.configure_kernels; default auto: "
                        "split from 1024 tokens per forward, else fused)")
    p.add_argument("--decode", choices=["auto", "fused", "split"], default="auto",
                   help="deltazip systems: how decode steps run (DeltaModel.configure_kernels; default auto: the "
                        "split route for steps of many distinct deltas where the Gluon kernel adds them)")
    p.add_argument("--gluon-block-rows", type=int, choices=[8, 16, 32],
                   help="deltazip systems: rows of one delta per block of the Gluon decode kernel, whose codes it decodes "
                        "once per block (kernels.set_gluon_block_rows; default: the library's, 8)")
    p.add_argument("--gluon-stages", type=int, choices=[2, 3, 4],
                   help="deltazip systems: copy-pipeline stages of the Gluon decode kernel (kernels.set_gluon_stages; "
                        "default: the library's, 3 for 2-bit codes, 4 for 4-bit)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--per-request", action="store_true", help="add every request's timings to the JSON")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}: pick from {', '.join(SYSTEMS)}")
    if not 1 <= args.deltas:
        p.error("--deltas must be at least 1")
    texts = [text for text, _ in args.admission_variant]
    if len(set(texts)) != len(texts):  # each variant is reported under its text: a repeat would replace the first
        p.error(f"--admission-variant {sorted({t for t in texts if texts.count(t) > 1})} given twice: each is reported "
                "under its text, so spell a repeat differently (on / 1 / true)")
    for flag in ("batch", "host_buffers", "disk_files", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU here: this benchmark is meant for one (--shape tiny --device cpu is a smoke test)")
    cfg = dict(SHAPES[args.shape])
    args.real_deltas = None
    if args.delta or args.delta_dir:
        if args.base is None:
            p.error("--delta and --delta-dir need --base: the folder of the model the deltas were compressed from")
        try:
            args.real_deltas = parse_real_deltas(args.delta, args.delta_dir)
        except (ValueError, OSError) as e:
            p.error(str(e))
        args.deltas = len(args.real_deltas)
    elif args.base is not None:
        p.error("--base needs deltas of it: add --delta NAME=DIR (repeatable) or --delta-dir DIR")
    if args.base is not None:
        from transformers import AutoConfig

        try:
            base_cfg = AutoConfig.from_pretrained(args.base)
        except (OSError, ValueError) as e:
            p.error(f"--base {args.base}: not a model folder ({e})")
        cfg = {"vocab_size": base_cfg.vocab_size, "num_hidden_layers": base_cfg.num_hidden_layers}
    args.vocab_size = cfg["vocab_size"]
    try:
        trace = make_trace(num_deltas=args.deltas, requests=args.requests, rate=args.rate, zipf=args.zipf,
                           prompt_len=args.prompt_len, vocab_size=args.vocab_size, seed=args.seed)
    except ValueError as e:
        p.error(str(e))

    env = _environment(args, argv)
    summary = trace_summary(trace, args.deltas, args.zipf)
    report = {
        "environment": env,
        "trace": {"deltas": args.deltas, "zipf_a": args.zipf, "zipf_convention": ZIPF_CONVENTION, "rate_per_s": args.rate,
                  "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "eos": "disabled", "seed": args.seed,
                  **summary},
        "model": {"shape": args.shape if args.base is None else f"pretrained {args.base}",
                  "layers": args.layers or cfg["num_hidden_layers"], "dtype": "bfloat16",
                  "delta_format": f"{args.bits}-bit, group {args.group_size}, dense" if not args.real_deltas else
                  "real compressed deltas: " + ", ".join(f"{n}={d}" for n, d in args.real_deltas.items()),
                  "batch": args.batch,
                  "kv_cache_length": _cache_length(args),
                  "max_seconds": args.max_seconds, "cuda_graphs": not args.eager and args.device.startswith("cuda")},
        "systems": {}, "skipped": {},
    }
    print(f"# deltazip bench serve: {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
          f"commit {env['commit']}, {env['date']}")
    print(f"# model: {'random Llama ' if args.base is None else ''}{report['model']['shape']} ({report['model']['layers']} layers) in bf16; deltas "
          f"{report['model']['delta_format']}; up to {args.batch} rows; cap {args.max_seconds:g} s per system")
    print(f"# trace: {args.requests} requests over {args.deltas} deltas, Zipf a={args.zipf:g} ({ZIPF_CONVENTION}); "
          f"Poisson {args.rate:g}/s over {summary['duration_s']:.1f} s (offered load {args.rate * args.new_tokens:g} "
          f"output tokens/s: a system that keeps up cannot exceed it); prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens (no eos); seed {args.seed}; d0 share {summary['rank1_share']:.2f} "
          f"(expected {summary['rank1_share_expected']:.2f}), {summary['distinct_deltas']} deltas requested", flush=True)

    results, skipped, outcomes = {}, report["skipped"], {}
    delta_systems = [s for s in SYSTEMS if s in systems and s in ("deltazip", "one-delta-loop")]
    swap_systems = [s for s in SYSTEMS if s in systems and s in ("swap-cpu", "swap-disk", "all-resident")]
    if delta_systems:
        base = _base_model(args)
        try:
            run_delta_systems(base, trace, args, delta_systems, results, skipped, outcomes)
        finally:
            del base
            _free_memory(args.device)
    if swap_systems:
        run_swap_systems(trace, args, swap_systems, results, skipped, outcomes)
    if "peft" in systems:
        run_peft_system(trace, args, results, skipped, outcomes)

    ordered = {}
    for s in SYSTEMS:  # each deltazip variant right after deltazip
        ordered.update({name: r for name, r in results.items() if name == s or (s == "deltazip" and name.startswith("deltazip["))})
    ours = ordered.get("deltazip", {}).get("tokens_per_s")
    for name, r in ordered.items():
        if ours and r["tokens_per_s"] and not name.startswith("deltazip"):
            r["deltazip_speedup"] = ours / r["tokens_per_s"]
            for v, rv in ordered.items():  # each variant against this baseline too
                if v.startswith("deltazip[") and rv["tokens_per_s"]:
                    r.setdefault("variant_speedups", {})[v] = rv["tokens_per_s"] / r["tokens_per_s"]
    report["systems"] = ordered
    if args.per_request:
        report["requests"] = {s: [asdict(o) | {"tokens": len(o.tokens)} for o in outs] for s, outs in outcomes.items()}

    print()
    print(markdown_table(ordered))
    for name, r in ordered.items():
        for v, x in r.get("variant_speedups", {}).items():
            print(f"- {v} / {name}: {x:.2f}x")
    print()
    print("Where the time goes (loads: deltas becoming resident, or whole fine-tunes copied in; other: waiting "
          "for arrivals and host work between steps):")
    print(split_table(ordered))
    for name, r in ordered.items():
        if name != "deltazip":
            disk = (f"; {r['workdir']} ({r['filesystem']}); {r['page_cache']}; {r['disk_GBps_mean']:.2f} GB/s mean, "
                    f"{r['disk_GBps_min']:.2f} GB/s slowest load") if "page_cache" in r else ""
            print(f"- {name}: {r['how']}{disk}")
    for name, why in skipped.items():
        print(f"- {name} skipped: {why}")
    for name, r in ordered.items():
        if r["truncated"]:
            print(f"- {name} truncated: still behind the trace after {args.max_seconds:g} s; its numbers cover the "
                  f"{r['completed']} requests it completed; {r['left_waiting']} had arrived and were never admitted "
                  f"(the oldest waited {_fmt(r['oldest_left_waiting_s'], '.1f')} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
