"""``python -m hf_deltazip.bench.admission``: where a DecodeEngine admission (one prefill round) waits.

An admission copies its prompts to the device, runs one batched prefill through the model (each row on its
delta) and reads the first tokens back. The read-back is the one wait it needs; any earlier wait for the
device (a copy out of pageable host memory, a host decision on a device value) makes the host stop
queueing the prefill until the GPU has finished everything before it: the decode step in flight
(``AdmissionPolicy(overlap_steps=True)``) and the prefill's own earlier layers. This bench reports, on a
random Llama of ``--shape`` shapes with ``--deltas`` random 2-bit deltas and ``--rows`` rows of which
``--busy`` are decoding:

* ``syncs``: the synchronising operations one admission runs before its read-back, by call site
  (``torch.cuda.set_sync_debug_mode``; GPU only);
* ``idle_ms``: wall milliseconds of an admission of ``--prompts`` prompts of ``--prompt-len`` tokens with
  the device idle before it, and ``gpu_busy_ms``: the device time of the same admission (``torch.profiler``):
  wall far above device time means the prefill is bound by the host;
* ``in_flight_ms``: the same admission right after a step was launched ahead (``overlap_steps``), and
  ``step_ms``: one decode step's wall time in that mode, for scale (with a step in flight, an admission
  that queues its prefill without waiting costs about ``idle_ms`` plus what is left of the step).

Run it with two installed packages in turn to compare them; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import traceback
import warnings

import torch

__all__ = ["measure", "main"]


def _sync_sites(fn) -> collections.Counter:
    """Synchronising CUDA operations ``fn`` runs, counted by their innermost call sites in this package."""
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "hf_deltazip" in f.filename or f"{os.sep}kernels{os.sep}" in f.filename]
        sites[" <- ".join(reversed(frames[-3:])) or "(outside the package)"] += 1

    with warnings.catch_warnings():  # puts showwarning back too
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def measure(shape: str = "8b", layers=None, deltas: int = 8, rows: int = 64, busy: int = 48, prompts: int = 6,
            prompt_len: int = 128, repeats: int = 3, device: str = "cuda") -> dict:
    from hf_deltazip import DeltaModel
    from hf_deltazip.bench.decode import _sync, build_base, profile_calls, random_delta
    from hf_deltazip.serving import AdmissionPolicy, DecodeEngine

    if busy + prompts > rows:
        raise ValueError(f"--busy {busy} plus --prompts {prompts} rows do not fit --rows {rows}")
    dev = torch.device(device)
    base = build_base(shape, device, layers=layers)
    dm = DeltaModel(base)
    dm.configure_cache(max_resident=deltas + 2)
    for i in range(deltas):
        dm.add_delta(random_delta(base, 2, 128, seed=i), f"d{i}")
    engine = DecodeEngine(dm, max_batch_size=rows, max_length=2 * prompt_len + 64 * repeats + 64)
    gen = torch.Generator().manual_seed(0)
    vocab = min(1000, base.config.vocab_size)

    def batch(n):
        return [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(n)]

    names = [f"d{i % deltas}" for i in range(rows)]
    engine.add(batch(busy), names[:busy], max_new_tokens=prompt_len + 64 * repeats + 32, eos_token_id=None)
    for _ in range(3):  # capture, warm up
        engine.step()

    def admit():
        handles = engine.add(batch(prompts), names[busy:busy + prompts], max_new_tokens=4, eos_token_id=None)
        for h in handles:
            engine.cancel(h)

    admit()  # the routing tables of this mix, the prefill's kernels
    engine.step()
    _sync()
    out = {"shape": shape, "layers": layers or base.config.num_hidden_layers, "deltas": deltas, "rows": rows,
           "busy": busy, "prompts": prompts, "prompt_len": prompt_len, "device": str(dev)}
    if dev.type == "cuda":
        sites = _sync_sites(admit)
        engine.step()
        out["syncs"] = dict(sites.most_common())
    idle = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        admit()
        idle.append((time.perf_counter() - t) * 1e3)
        engine.step()
    out["idle_ms"] = statistics.median(idle)
    out["gpu_busy_ms"] = profile_calls(admit, repeats, dev.type == "cuda")["gpu_busy_ms_per_step"]
    engine.step()
    engine.admission = AdmissionPolicy(overlap_steps=True)
    for _ in range(3):
        engine.step()
    ahead = []
    for _ in range(repeats):
        engine.step()  # leaves the next step in flight
        t = time.perf_counter()
        admit()
        ahead.append((time.perf_counter() - t) * 1e3)
    out["in_flight_ms"] = statistics.median(ahead)
    _sync()
    t = time.perf_counter()
    for _ in range(8):
        engine.step()
    _sync()
    out["step_ms"] = (time.perf_counter() - t) / 8 * 1e3
    out["ahead_steps"] = engine.stats.ahead_steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, 1b, 270m or tiny (a CPU smoke test)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    p.add_argument("--deltas", type=int, default=8)
    p.add_argument("--rows", type=int, default=64, help="the engine's rows")
    p.add_argument("--busy", type=int, default=48, help="rows decoding while the prompts are admitted")
    p.add_argument("--prompts", type=int, default=6, help="prompts per admission, each on its own delta (cycling)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    r = measure(args.shape, args.layers, args.deltas, args.rows, args.busy, args.prompts, args.prompt_len,
                args.repeats, args.device)
    print(f"{r['shape']} shapes, {r['layers']} layers, {r['deltas']} deltas, {r['busy']} of {r['rows']} rows decoding; "
          f"an admission of {r['prompts']} x {r['prompt_len']} tokens:")
    if "syncs" in r:
        print(f"  synchronising operations before the read-back: {sum(r['syncs'].values())}")
        for site, n in r["syncs"].items():
            print(f"    {n:4d}  {site}")
    print(f"  idle device before it: wall {r['idle_ms']:.1f} ms, device busy {r['gpu_busy_ms']:.1f} ms")
    print(f"  right after a step launched ahead: wall {r['in_flight_ms']:.1f} ms (a step: {r['step_ms']:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
