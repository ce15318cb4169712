"""``python -m hf_deltazip.bench.host_overhead``: the host (Python) time of one eager delta layer call.

An eager decode step (``DeltaModel.generate`` at batch 1, a prefill, a Jacobi step) calls every delta
layer once, a few hundred calls per token, and at small shapes the host work per call can cost more
than the kernel. This bench times that host work alone, on any machine: a model with one decoder
layer, one random 4-bit delta on every linear layer, the kernel route forced on (under
``TRITON_INTERPRET=1`` on a CPU) and the Triton kernel replaced by a launch that does nothing, so what
is timed is everything ``DeltaLinear.forward`` does around the launch (routing, launch settings,
argument checks, the launch plan lookup). ``nn.Linear`` of the same size is timed beside it for scale
(its time includes its matmul). The kernel's own launch cost (Triton's JIT or the direct call, see
``kernels/launch.py``) is *not* included: measure that on a GPU with ``bench.decode``.

Prints one line per layer kind and, with ``--json``, writes them.

``--staging``: instead, the host time of staging one delta ahead of use (``DeltaCache.stage``: making room by
evicting the least recently used delta, then writing the new one into the kernel stacks' free room), on a model
of ``--layers`` decoder layers (32: an 8B model's 224 linear layers) at width ``--hidden``, every delta held in
host memory. On a GPU this work runs between decode steps while the GPU waits; here the copies are CPU copies of
small tensors, so what is timed is mostly Python. It also counts the tensor operations one staging dispatches
(``ops_per_stage``, through a ``TorchDispatchMode``; on a GPU most of them are a kernel launch or a copy each),
which unlike the time does not depend on the machine. On the CPU the codes are repacked for the kernel with
shifts and masks (29 operations per 2-bit layer, 17 of them computing), on a GPU with a byte table (10, 4 computing;
``kernels.layout.repack_for_kernel``), so a GPU's staging dispatches 19 fewer per 2-bit layer than counted here.

``--step-ops``: the tensor operations one decode step of the engine dispatches (``DecodeEngine.step()`` on a Llama
model of ``--layers`` decoder layers and ``--rows`` rows, eager on the CPU; on a GPU the computing ones are the kernel
launches of the captured step and of the few operations around it), with transformers' RMSNorm and with the fused one
(``DecodeEngine(fused_norms=True)``, its launch counted as one operation). Like ``ops_per_stage`` it does not depend
on the machine or on the model's width.

``--prefill-ops``: the tensor operations and Triton launches one prefill dispatches through each prefill route
(``fused``, ``split``, ``dequant``; ``DeltaModel.configure_kernels(prefill=...)``): ``--prompts`` prompts of
``--tokens`` tokens, each on its own random 2-bit delta, on a Llama of ``--layers`` decoder layers; the kernels
launch nothing. On a GPU each computing operation is a launch the host pays for while the prefill runs eagerly.

``--repack``: both ways of repacking one layer's codes for the kernel (``kernels.layout.repack_for_kernel``) at
8B layer shapes: the tensor operations each dispatches (the byte table's counted on meta tensors, which take the
GPU's route), and the CPU milliseconds each computes for (the reason the CPU keeps the shifts).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import time
from pathlib import Path

import torch

__all__ = ["measure", "measure_staging", "measure_repack", "measure_step_ops", "measure_prefill_ops", "main"]


class _NoLaunch:
    """Stands in for a Triton kernel: the same argument names; ``kernel[grid](...)`` does nothing but count itself in
    ``launches`` under ``name``."""

    def __init__(self, kernel, name: str, launches: collections.Counter):
        self.arg_names = list(kernel.arg_names)
        self.__name__ = getattr(kernel, "__name__", "kernel")
        self._name, self._launches = name, launches

    def __getitem__(self, grid):
        self._launches[self._name] += 1
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _kernels_launch_nothing():
    """Within the block the kernel route runs on the CPU and every Triton kernel launches nothing; yields a
    ``Counter`` of the launches by kernel name."""
    from ..kernels import multi_delta

    real = multi_delta.triton_kernel
    stand_ins: dict = {}
    launches = collections.Counter()

    def fake(name: str = "multi_delta_linear_kernel"):
        if name not in stand_ins:
            stand_ins[name] = _NoLaunch(real(name), name, launches)
        return stand_ins[name]

    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the kernel route on a CPU; no GPU is touched
    multi_delta.triton_kernel = fake
    try:
        yield launches
    finally:
        multi_delta.triton_kernel = real
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env


def _time_us(fn, calls: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three rounds: the host's quietest
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def measure(hidden: int = 256, calls: int = 2000) -> list:
    """``[{"layer", "shape", "nn_linear_us", "delta_linear_us"}]`` for each linear layer kind of a one-layer
    Llama of width ``hidden`` (a multiple of 256, so the deltas take the planar kernel layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..modeling import DeltaModel
    from ..modeling.layers import DeltaLinear
    from .decode import random_delta

    if hidden % 256:
        raise ValueError(f"hidden must be a multiple of 256, got {hidden}")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=hidden // 4, vocab_size=128)
    rows = []
    with _kernels_launch_nothing(), torch.no_grad():
        base = LlamaForCausalLM(cfg).eval()
        model = DeltaModel(base, use_kernels="always")
        model.add_delta(random_delta(base, 4, 128, seed=0), "d0")
        ids = torch.tensor([[1]])
        seen = {}

        def spy(module, args):
            seen.setdefault(module, (module.router.current, args[0]))

        layers = {n: m for n, m in model.base_model.named_modules() if isinstance(m, DeltaLinear)}
        hooks = [m.register_forward_pre_hook(spy) for m in layers.values()]
        model(ids, delta_names=["d0"])  # builds the stacks and launch plans; records each layer's routing and input
        for h in hooks:
            h.remove()
        for name, layer in layers.items():
            routing, x = seen[layer]
            plain = torch.nn.Linear(layer.in_features, layer.out_features)
            with layer.router.use(routing):
                rows.append({"layer": name.split(".")[-1], "shape": [layer.out_features, layer.in_features],
                             "nn_linear_us": _time_us(lambda: plain(x), calls),
                             "delta_linear_us": _time_us(lambda: layer(x), calls)})
    return rows


# operations that make a view of a tensor and compute nothing (no launch on a GPU)
_VIEW_OPS = ("view", "transpose", "_unsafe_view", "alias", "select", "slice")
# operations that launch nothing on a GPU: views, shape changes and allocations
_NO_LAUNCH_OPS = _VIEW_OPS + ("unsqueeze", "squeeze", "expand", "t", "permute", "as_strided", "detach", "_reshape_alias",
                              "split", "split_with_sizes", "unbind", "narrow", "empty", "empty_like", "empty_strided",
                              "lift_fresh", "promote_types")


class _CountOps:
    """Counts the tensor operations dispatched inside it (by name)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def measure_repack(bits_list=(2, 4), shapes=((4096, 4096), (14336, 4096), (4096, 14336)), repeats: int = 3) -> list:
    """Per code width and layer shape ``(N, K)``: the operations one repack dispatches by each route (all, and
    those that compute: not views) and the best CPU milliseconds of ``repeats`` (random codes)."""
    from ..kernels import layout as L

    rows = []
    for bits in bits_list:
        for n, k in shapes:
            block = L.planar_block_for(bits, k, 128)
            p, nblk = L._planar_perm(bits, k, block)
            q = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.int32).to(torch.uint8)
            row = {"bits": bits, "shape": [n, k]}
            for route, fn, dev in (("shifts", L._repack_rows_shifts, "cpu"), ("table", L._repack_table, "meta")):
                qd = q.to(dev)
                fn(qd, bits, p, nblk, block)  # the tables, once per device
                with _CountOps() as count:
                    fn(qd, bits, p, nblk, block)
                best = float("inf")
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn(q, bits, p, nblk, block)
                    best = min(best, time.perf_counter() - t)
                row[route] = {"ops": sum(count.counts.values()),
                              "computing_ops": sum(v for o, v in count.counts.items() if o not in _VIEW_OPS),
                              "cpu_ms": best * 1e3}
            rows.append(row)
    return rows


def measure_step_ops(layers: int = 32, rows: int = 64, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Operations one decode step dispatches, by norm route: ``{"transformers": {...}, "fused": {...}}``, each with
    ``total``, ``computing`` (all but views and allocations: a kernel launch each on a GPU), the norm kernel's
    launches counted among them, and the most frequent operations. The model is in ``dtype`` (as served: transformers'
    norm casts a 16-bit input to float32 and back, two operations more than in float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..kernels import rms_norm as RN
    from ..serving import DecodeEngine, norms

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, vocab_size=128)
    launches = []

    class CountedLaunch:  # the norm kernel: counted, launches nothing (the step's values are not looked at)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(1)

    real_runs, real_kernel = RN.kernel_runs_on, RN._kernel
    RN.kernel_runs_on = norms.kernel_runs_on = lambda device: True
    RN._kernel = lambda: CountedLaunch()
    out = {}
    try:
        with torch.no_grad():
            for route, fused in (("transformers", False), ("fused", True)):
                torch.manual_seed(0)
                engine = DecodeEngine(LlamaForCausalLM(cfg).to(dtype).eval(), max_batch_size=rows, max_length=32, fused_norms=fused)
                engine.add([[1, 2, 3]] * rows, max_new_tokens=16, eos_token_id=None)
                engine.step()  # the first step sets up what later steps reuse
                launches.clear()
                with _CountOps() as count:
                    engine.step()
                counts = count.counts
                computing = sum(v for o, v in counts.items() if o not in _NO_LAUNCH_OPS)
                out[route] = {"total": sum(counts.values()) + len(launches), "computing": computing + len(launches),
                              "norm_kernel_launches": len(launches), "norms_fused": engine.fused_norms,
                              "top": dict(counts.most_common(10))}
    finally:
        RN.kernel_runs_on = norms.kernel_runs_on = real_runs
        RN._kernel = real_kernel
    return out


def measure_staging(hidden: int = 256, layers: int = 32, deltas: int = 8) -> dict:
    """Host milliseconds to stage each of ``deltas`` host-tier deltas into a model of ``layers`` decoder layers:
    ``{"stage_ms": [...], "free_room_ms": [...], "modules": n, "ops_per_stage": {...}}``, the first with room for two
    resident deltas (each staging evicts the least recently used one), the second with room for all (no eviction);
    ``ops_per_stage``: the tensor operations of one more staging per setup (untimed), by setup, with the top ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..modeling import DeltaModel
    from .decode import random_delta

    if hidden % 256:
        raise ValueError(f"hidden must be a multiple of 256, got {hidden}")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=hidden // 4, vocab_size=128)
    names = [f"d{i}" for i in range(deltas + 3)]  # two resident, ``deltas`` timed, one counted
    out = {"ops_per_stage": {}}
    with _kernels_launch_nothing(), torch.no_grad():
        for key, room in (("stage_ms", 2), ("free_room_ms", len(names))):
            torch.manual_seed(0)  # the same base both times
            base = LlamaForCausalLM(cfg).eval()
            model = DeltaModel(base, use_kernels="always")
            model.configure_cache(max_resident=room)
            for i, n in enumerate(names):
                model.add_delta(random_delta(base, 2, 128, seed=i), n, resident=i < 2)
            cache = model.cache
            out["modules"] = len(cache.entry(names[2]).host[0])
            times = []
            for n in names[2:-1]:
                t = time.perf_counter()
                started = cache.stage([n])
                times.append((time.perf_counter() - t) * 1e3)
                if started != [n]:
                    raise RuntimeError(f"staging {n} did not start ({started}): the bench's model has no room kept for it")
            out[key] = times
            with _CountOps() as count:
                cache.stage([names[-1]])
            out["ops_per_stage"][key] = {"total": sum(count.counts.values()), "top": dict(count.counts.most_common(8))}
    return out


def measure_prefill_ops(layers: int = 32, deltas: int = 4, tokens: int = 128, hidden: int = 256) -> dict:
    """Operations and kernel launches one prefill dispatches by prefill route: ``{route: {...}}`` for ``"fused"``,
    ``"split"`` and ``"dequant"``, each with ``total`` and ``computing`` operations (Triton launches counted as
    computing operations), ``launches`` by kernel and the most frequent operations. A Llama of ``layers`` decoder
    layers at width ``hidden`` in bfloat16 with ``deltas`` random 2-bit deltas (group 128; one format class), one
    prompt of ``tokens`` tokens on each, every route forced for the whole forward; the kernels launch nothing
    (``_kernels_launch_nothing``), so the values are not looked at. Like ``--step-ops`` this does not depend on the
    machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..modeling import DeltaModel
    from .decode import random_delta

    if hidden % 256:
        raise ValueError(f"hidden must be a multiple of 256, got {hidden}")
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=hidden // 4, vocab_size=128)
    out = {}
    with _kernels_launch_nothing() as launches, torch.no_grad():
        torch.manual_seed(0)
        base = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        model = DeltaModel(base, use_kernels="always")
        names = [f"d{i}" for i in range(deltas)]
        for i, n in enumerate(names):
            model.add_delta(random_delta(base, 2, 128, seed=i), n)
        ids = torch.randint(0, cfg.vocab_size, (deltas, tokens), generator=torch.Generator().manual_seed(1))
        for route in ("fused", "split", "dequant"):
            model.configure_kernels(prefill=route, dequant_min_rows=1, prefill_split_min_rows=1)
            model(ids, delta_names=names)  # stacks, launch settings and the batch's index tensors, once
            launches.clear()
            with _CountOps() as count:
                model(ids, delta_names=names)
            counts = count.counts
            computing = sum(v for o, v in counts.items() if o not in _NO_LAUNCH_OPS)
            n_launch = sum(launches.values())
            out[route] = {"total": sum(counts.values()) + n_launch, "computing": computing + n_launch,
                          "launches": dict(launches), "top": dict(counts.most_common(8))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.host_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="model width (a multiple of 256)")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per round (best of 3 rounds)")
    p.add_argument("--staging", action="store_true", help="time staging a delta ahead of use instead (see above)")
    p.add_argument("--layers", type=int, default=32, help="--staging, --step-ops: decoder layers (default 32)")
    p.add_argument("--step-ops", action="store_true", help="count the operations of one decode step, both norm routes")
    p.add_argument("--rows", type=int, default=64, help="--step-ops: rows of the step (default 64)")
    p.add_argument("--deltas", type=int, default=8, help="--staging: deltas staged one after another (default 8)")
    p.add_argument("--repack", action="store_true", help="count and time the two ways of repacking codes (see above)")
    p.add_argument("--prefill-ops", action="store_true", help="count the operations of one prefill by prefill route")
    p.add_argument("--prompts", type=int, default=4, help="--prefill-ops: prompts, each on its own delta (default 4)")
    p.add_argument("--tokens", type=int, default=128, help="--prefill-ops: tokens per prompt (default 128)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.step_ops:
        res = measure_step_ops(args.layers, args.rows)
        print(f"operations of one decode step, {args.layers} decoder layers, {args.rows} rows, bfloat16 "
              f"(torch {torch.__version__}): "
              "all / computing (a kernel launch each on a GPU)")
        for route, r in res.items():
            print(f"{route} RMSNorm: {r['total']} / {r['computing']} (norm kernel launches {r['norm_kernel_launches']}); "
                  "most: " + ", ".join(f"{k} {v}" for k, v in r["top"].items()))
        t, f = res["transformers"]["computing"], res["fused"]["computing"]
        print(f"fused norms: {t - f} fewer computing operations per step ({f / t:.2f}x)")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    if args.prefill_ops:
        res = measure_prefill_ops(args.layers, args.prompts, args.tokens, args.hidden)
        print(f"operations of one prefill, {args.layers} decoder layers, {args.prompts} prompts of {args.tokens} tokens, "
              f"each on its own 2-bit delta, bfloat16 (torch {torch.__version__}): all / computing (a kernel launch each "
              "on a GPU, Triton launches included)")
        for route, r in res.items():
            print(f"{route}: {r['total']} / {r['computing']}; Triton launches: "
                  + ", ".join(f"{k} {v}" for k, v in r["launches"].items()) + "; most: "
                  + ", ".join(f"{k} {v}" for k, v in r["top"].items()))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    if args.repack:
        rows = measure_repack()
        print(f"repacking one layer's codes for the kernel (torch {torch.__version__}, {os.cpu_count()} CPUs): "
              "operations dispatched (computing ones), best CPU ms of 3")
        for r in rows:
            sh, tb = r["shifts"], r["table"]
            print(f"{r['bits']}-bit {r['shape'][0]}x{r['shape'][1]}: shifts (CPU route) {sh['ops']} ops "
                  f"({sh['computing_ops']}), {sh['cpu_ms']:.1f} ms; byte table (GPU route) {tb['ops']} ops "
                  f"({tb['computing_ops']}), {tb['cpu_ms']:.1f} ms on the CPU")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    if args.staging:
        res = measure_staging(args.hidden, args.layers, args.deltas)
        med = sorted(res["stage_ms"])[len(res["stage_ms"]) // 2]
        med_free = sorted(res["free_room_ms"])[len(res["free_room_ms"]) // 2]
        print(f"host time to stage one delta of {res['modules']} modules ({args.layers} layers, width {args.hidden}; "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs): median {med:.1f} ms evicting one, {med_free:.1f} ms "
              f"into free room; each: " + ", ".join(f"{v:.1f}" for v in res["stage_ms"]))
        for key, ops in res["ops_per_stage"].items():
            setup = "evicting one" if key == "stage_ms" else "into free room"
            print(f"tensor operations of one staging, {setup}: {ops['total']} ({ops['total'] / res['modules']:.1f} per "
                  f"module); most: " + ", ".join(f"{k} {v}" for k, v in ops["top"].items()))
        if args.json:
            Path(args.json).write_text(json.dumps({**res, "median_stage_ms": med, "median_free_room_ms": med_free},
                                                  indent=2))
        return 0
    rows = measure(args.hidden, args.calls)
    print(f"host time per call, one token, kernel launch excluded (torch {torch.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'layer':<10} {'shape':>12} {'nn.Linear us':>13} {'DeltaLinear us':>15}")
    for r in rows:
        print(f"{r['layer']:<10} {'x'.join(map(str, r['shape'])):>12} {r['nn_linear_us']:>13.1f} {r['delta_linear_us']:>15.1f}")
    mean = sum(r["delta_linear_us"] for r in rows) / len(rows)
    print(f"mean DeltaLinear host time: {mean:.1f} us per call")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "mean_delta_linear_us": mean}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
