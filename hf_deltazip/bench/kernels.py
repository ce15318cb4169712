"""Kernel benchmark: the multi-delta linear layer against its baselines (``deltazip bench kernels``).

Protocol (docs: REFERENCE section 5):

* Shapes of an 8B Llama (``N x K`` = out x in): 4096x4096, 1024x4096, 14336x4096, 4096x14336.
  Rows ``M`` in 1, 4, 16, 32, 64; distinct deltas ``U`` in 1, 4, 8, 16, 32 (only ``U <= M``:
  a batch cannot touch more deltas than it has rows); 2 and 4 bits, dense and 2:4; groups of 128.
* Baselines: cuBLAS bf16 on the base alone; ``U`` separate bf16 matmuls (``U`` merged fine-tunes,
  each on its own rows); torch's int4 matmul (``torch._weight_int4pack_mm``) once per delta.
* Timing: every variant is captured ``R`` times in one CUDA graph, each call on its own copy of
  the weights so that one replay streams more than 3x the 60 MB L2; ``triton.testing.do_bench``
  gives the median replay time (it also flushes L2 before each replay), divided by ``R``. Random
  data, never zeros. The kernel is checked against the reference before it is timed.
* Bytes counted per call: ``2NK`` (base) + each used delta once (codes, scales, zeros, positions)
  + activations in and out. Share = GB/s over a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Optional

import torch

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
ROWS = [1, 4, 16, 32, 64]
DELTAS = [1, 4, 8, 16, 32]
FORMATS = [(4, False), (2, False), (4, True), (2, True)]  # (bits, 2:4)
QUICK_SHAPES = [(4096, 4096), (4096, 14336)]
QUICK_ROWS = [1, 16, 32]
QUICK_DELTAS = [1, 4, 16]
L2_BYTES = 60 * 2**20
GROUP_SIZE = 128


def _kernels():
    try:
        from hf_deltazip import kernels as K
    except ImportError:  # the kernels folder not yet wired in as a subpackage
        import kernels as K
    return K


def _fmt_name(bits: int, sparse: bool) -> str:
    return f"{bits}b" + ("+2:4" if sparse else "")


# --------------------------------------------------------------------------- timing
def time_calls(calls: list[Callable[[], None]], warmup_ms: int = 10, rep_ms: int = 50) -> float:
    """Median microseconds of one call, the calls captured together in a CUDA graph."""
    import triton

    for c in calls[:2]:  # compile, allocate semaphores, warm cuBLAS
        c()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # one eager pass on the capture stream too
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


_READ_KERNEL = None


def _read_kernel():
    global _READ_KERNEL
    if _READ_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def stream_read(src, out, per_prog, BLOCK: tl.constexpr):
            # each program sums its contiguous slice (16-byte loads); one float out per program
            base = tl.program_id(0).to(tl.int64) * per_prog
            acc = tl.zeros([BLOCK], tl.float32)
            for i in range(0, per_prog, BLOCK):
                acc += tl.load(src + base + i + tl.arange(0, BLOCK))
            tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))

        _READ_KERNEL = stream_read
    return _READ_KERNEL


def read_bandwidth(nbytes: int = 2 * 2**30, programs_per_sm: int = 16) -> float:
    """Bytes per second of a plain streaming read (the ceiling of a layer that only reads):
    a Triton kernel sums a ``nbytes`` fp32 buffer, each program one contiguous slice."""
    import triton

    block = 4096
    programs = torch.cuda.get_device_properties(0).multi_processor_count * programs_per_sm
    per_prog = (nbytes // 4 // programs) // block * block
    src = torch.empty(per_prog * programs, dtype=torch.float32, device="cuda").normal_()
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    kern = _read_kernel()

    def go():
        kern[(programs,)](src, out, per_prog, BLOCK=block, num_warps=8)

    go()
    torch.cuda.synchronize()
    if not torch.allclose(out.double().sum(), src.double().sum(), rtol=1e-3, atol=1.0):
        raise RuntimeError("the streaming-read kernel summed wrongly")
    ms = triton.testing.do_bench(go, warmup=20, rep=100, return_mode="median")
    nb = src.numel() * 4
    del src, out
    return nb / (ms * 1e-3)


def _rows_for(m: int, u: int, gen: torch.Generator) -> torch.Tensor:
    """Each of the ``u`` deltas gets ``m // u`` or one more rows, in random order."""
    rd = torch.arange(m) % u
    return rd[torch.randperm(m, generator=gen)].to(torch.int32)


def _splits(m: int, u: int) -> list[tuple[int, int]]:
    base, extra = divmod(m, u)
    out, start = [], 0
    for j in range(u):
        c = base + (1 if j < extra else 0)
        out.append((start, start + c))
        start += c
    return out


# --------------------------------------------------------------------------- parallel compile
def _compile_one(job) -> str:
    """Worker: launch one kernel variant once on small data (fills Triton's on-disk cache)."""
    n, k, bits, sparse, cfg, m, layout, block = job
    try:
        K = _kernels()
        st = K.random_delta_stack(2, n, k, bits=bits, group_size=GROUP_SIZE, sparse_2of4=sparse, device="cuda")
        if layout == "planar":
            st = K.prepare_stack(st, block=block or None)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        rd = torch.zeros(m, dtype=torch.int32, device="cuda")
        K.multi_delta_linear(x, w, None, st, rd, config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return f"{type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers: int = 8, log=print) -> None:
    """Compile kernel variants in parallel processes before timing (one GPU, many CPU cores)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = list(dict.fromkeys(jobs))
    if not jobs:
        return
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
        for job, err in zip(jobs, ex.map(_compile_one, jobs)):
            if err:
                log(f"  compile failed for {job}: {err}")
    log(f"# compiled {len(jobs)} variants in {time.time() - t0:.0f} s")


# --------------------------------------------------------------------------- one shape
class ShapeBench:
    """Weights and activations of one layer shape, with enough copies to defeat the L2."""

    def __init__(self, n: int, k: int, max_rows: int, max_deltas: int, gen_seed: int = 0):
        self.n, self.k = n, k
        self.max_deltas = max_deltas
        torch.manual_seed(gen_seed)
        base_bytes = 2 * n * k
        self.copies = max(2, math.ceil(3 * L2_BYTES / base_bytes))
        self.x = [torch.randn(max_rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(self.copies)]
        self.base = [0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(self.copies)]
        self.out = [torch.empty(max_rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(self.copies)]
        self._merged = None
        self._int4 = None

    def merged(self) -> list[torch.Tensor]:
        """Distinct bf16 matrices standing for merged fine-tunes (a pool larger than the L2)."""
        if self._merged is None:
            pool = max(self.max_deltas, math.ceil(3 * L2_BYTES / (2 * self.n * self.k)))
            self._merged = [
                0.02 * torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16) for _ in range(pool)
            ]
        return self._merged

    def int4(self):
        """Packed int4 weights for ``torch._weight_int4pack_mm``, or ``None`` if torch lacks it."""
        if self._int4 is None:
            try:
                pool = max(self.max_deltas, math.ceil(3 * L2_BYTES / (self.n * self.k // 2)))
                ws = []
                for _ in range(pool):
                    raw = torch.randint(0, 256, (self.n, self.k // 2), dtype=torch.uint8, device="cuda")
                    packed = torch._convert_weight_to_int4pack(raw, 8)
                    sz = torch.rand(self.k // GROUP_SIZE, self.n, 2, device="cuda").to(torch.bfloat16) * 0.01
                    ws.append((packed, sz))
                x = self.x[0][:1]
                torch._weight_int4pack_mm(x, ws[0][0], GROUP_SIZE, ws[0][1])
                torch.cuda.synchronize()
                self._int4 = ws
            except Exception as e:  # noqa: BLE001 - any failure: report the baseline as missing
                print(f"  int4 baseline unavailable: {type(e).__name__}: {e}", flush=True)
                self._int4 = []
        return self._int4 or None

    def stacks(self, bits: int, sparse: bool, layout: str = "planar", block: int = 0):
        """One stack of ``max_deltas`` random deltas per weight copy; ``layout="planar"``: in the
        kernel layout the serving stacks use (:func:`kernels.prepare_stack`: 2:4 densified to
        codes of the same bits, planar codes), ``"file"``: as stored in a ``.dz`` file."""
        K = _kernels()
        out = []
        for _ in range(self.copies):
            st = K.random_delta_stack(
                self.max_deltas, self.n, self.k, bits=bits, group_size=GROUP_SIZE, sparse_2of4=sparse,
                device="cuda", scale_range=(1e-3, 4e-3),
            )
            out.append(K.prepare_stack(st, block=block or None) if layout == "planar" else st)
        return out


def run(
    shapes=SHAPES,
    rows=ROWS,
    deltas=DELTAS,
    formats=FORMATS,
    *,
    out_dir: Optional[str] = None,
    configs: Optional[dict] = None,
    config_for: Optional[Callable[[int, int], dict]] = None,
    baselines: bool = True,
    rep_ms: int = 50,
    layout: str = "planar",
    layout_block: int = 0,
    split_route: bool = False,
    log=print,
) -> dict:
    """Run the benchmark; returns ``{"meta": ..., "results": [...]}`` and writes it to ``out_dir``.

    ``configs`` maps a name to a :class:`MultiDeltaConfig` to time instead of the default one
    (each result row then carries the config's name); ``config_for(n, k)`` gives such a mapping
    per layer shape; a value may also be a function ``(m, n, k, stack) -> MultiDeltaConfig``.
    ``layout``: the stacks' layout (see :meth:`ShapeBench.stacks`); ``layout_block``: elements per
    planar block (0: :func:`kernels.default_planar_block`). ``split_route``: also time each planar cell as
    the split route (one cuBLAS matmul for the base, then the kernel adding the deltas alone into its output,
    ``multi_delta_linear(accumulate=True)``), as rows whose config name ends in ``|split``, checked against
    the fused launch's output.
    """
    if config_for is None:
        def config_for(n, k, _c=configs or {"default": None}):
            return _c
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    K = _kernels()
    import triton

    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    rbw = read_bandwidth()
    meta = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_GBps": bw / 1e9,
        "read_GBps": rbw / 1e9,
        "layout": layout if layout != "planar" else f"planar (blocks of {layout_block or 'default_planar_block(bits)'})",
        "group_size": GROUP_SIZE,
        "host": platform.node(),
    }
    log(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    log(f"# device-to-device copy: {bw / 1e9:.0f} GB/s (read + write); streaming read: {rbw / 1e9:.0f} GB/s")
    results = []
    max_rows, max_deltas = max(rows), max(deltas)
    dev = torch.device("cuda")
    jobs = []
    for n, k in shapes:
        for bits, sparse in formats:
            for name, cfg in config_for(n, k).items():
                for m in rows:
                    for u in deltas:
                        if u > m:
                            continue
                        stub = K.random_delta_stack(u, 1, k, bits=bits, group_size=GROUP_SIZE, sparse_2of4=sparse)
                        c = _resolve(cfg, m, n, k, stub, dev)
                        jobs.append((n, k, bits, sparse, c, 1 if m <= K.multi_delta.FUSED_SORT_MAX_M else m, layout,
                                     layout_block))
    precompile(jobs, log=log)
    for n, k in shapes:
        t0 = time.time()
        sb = ShapeBench(n, k, max_rows, max_deltas)
        base_t, sep_t, int4_t = {}, {}, {}
        if baselines:
            for m in rows:
                calls = [
                    (lambda i=i: torch.mm(sb.x[i][:m], sb.base[i].t(), out=sb.out[i][:m])) for i in range(sb.copies)
                ]
                base_t[m] = time_calls(calls, rep_ms=rep_ms)
            merged = sb.merged()
            int4 = sb.int4()
            for m in rows:
                for u in deltas:
                    if u > m:
                        continue
                    spl = _splits(m, u)
                    reps = max(1, min(len(merged) // u, 8))

                    def sep(i, spl=spl, u=u, m=m):
                        for j, (a, b) in enumerate(spl):
                            w = merged[(i * u + j) % len(merged)]
                            torch.mm(sb.x[i % sb.copies][a:b], w.t(), out=sb.out[i % sb.copies][a:b])

                    sep_t[(m, u)] = time_calls([lambda i=i: sep(i) for i in range(reps)], rep_ms=rep_ms)
                    if int4:
                        reps4 = max(1, min(len(int4) // u, 8))

                        def q4(i, spl=spl, u=u):
                            for j, (a, b) in enumerate(spl):
                                pw, sz = int4[(i * u + j) % len(int4)]
                                torch._weight_int4pack_mm(sb.x[i % sb.copies][a:b], pw, GROUP_SIZE, sz)

                        int4_t[(m, u)] = time_calls([lambda i=i: q4(i) for i in range(reps4)], rep_ms=rep_ms)
        for bits, sparse in formats:
            stacks = sb.stacks(bits, sparse, layout, layout_block)
            fmt = _fmt_name(bits, sparse)
            for name, cfg in config_for(n, k).items():
                errs = []
                try:
                    for m, u in ((min(rows), 1), (max(rows), 1), (max(rows), min(max(deltas), max(rows)))):
                        errs.append(_verify(sb, stacks[0], m, u, gen, _resolve(cfg, m, n, k, stacks[0], dev)))
                except Exception as e:  # noqa: BLE001 - e.g. a launch variant that needs more shared memory
                    log(f"  !! {n}x{k} {fmt} [{name}]: not timed, it does not run here: {type(e).__name__}: "
                        f"{str(e)[:200]}")
                    continue
                err = max(errs)
                scaled_w = any(getattr(_resolve(cfg, m, n, k, stacks[0], dev), "scale_in_weights", False)
                               for m in rows)
                ok = err < (1e-2 if scaled_w else 1e-3)
                if not ok:
                    log(f"  !! {n}x{k} {fmt} [{name}]: relative error {err:.2e} against the reference")
                for m in rows:
                    for u in deltas:
                        if u > m:
                            continue
                        rd = _rows_for(m, u, gen).cuda()
                        seg = K.build_row_segments(rd)  # once per step in serving, shared by all layers
                        sts = [s.select(0, u) for s in stacks]
                        c = _resolve(cfg, m, n, k, sts[0], dev)
                        calls = [
                            (lambda i=i: K.multi_delta_linear(
                                sb.x[i][:m], sb.base[i], None, sts[i % len(sts)], rd, out=sb.out[i][:m], config=c,
                                segments=seg))
                            for i in range(sb.copies)
                        ]
                        try:
                            us = time_calls(calls, rep_ms=rep_ms)
                        except Exception as e:  # noqa: BLE001 - a failing config is a result too
                            log(f"  !! {n}x{k} {fmt} M={m} U={u} [{name}]: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        nbytes = K.layer_bytes(m, n, k, sts[0])
                        row = {
                            "N": n, "K": k, "M": m, "U": u, "format": fmt, "config": name,
                            "us": us, "GBps": nbytes / (us * 1e-6) / 1e9,
                            "share": nbytes / (us * 1e-6) / bw,
                            "read_share": nbytes / (us * 1e-6) / rbw,
                            "floor_us": nbytes / rbw * 1e6,
                            "bf16_base_us": base_t.get(m), "bf16_sep_us": sep_t.get((m, u)),
                            "int4_sep_us": int4_t.get((m, u)),
                            "speedup_vs_sep": (sep_t[(m, u)] / us) if (m, u) in sep_t else None,
                            "max_rel_err": err, "correct": ok,
                        }
                        results.append(row)
                        if split_route and sts[0].layout_block:
                            results.append(_split_row(K, sb, sts, rd, seg, m, u, c, name, row, us, rep_ms, bw, rbw))
            del stacks
            torch.cuda.empty_cache()
        log(f"# {n}x{k} done in {time.time() - t0:.0f} s")
        del sb
        torch.cuda.empty_cache()
        _dump({"meta": meta, "results": results}, out_dir)  # partial results survive a timeout
    report = {"meta": meta, "results": results}
    _dump(report, out_dir)
    return report


def _split_row(K, sb, sts, rd, seg, m, u, c, name, row, fused_us, rep_ms, bw, rbw) -> dict:
    """One cell of the split route (see :func:`run`): timed like the fused launch, checked against it."""
    def split(i):
        x, out = sb.x[i][:m], sb.out[i][:m]
        torch.mm(x, sb.base[i].t(), out=out)
        K.multi_delta_linear(x, None, None, sts[i % len(sts)], rd, out=out, config=c, segments=seg, accumulate=True)

    split(0)
    got = sb.out[0][:m].float().clone()
    fused = K.multi_delta_linear(sb.x[0][:m], sb.base[0], None, sts[0], rd, out_dtype=torch.float32, config=c,
                                 segments=seg)
    base = sb.x[0][:m].float() @ sb.base[0].float().t()
    err = float((got - fused).norm() / (fused - base).norm().clamp_min(1e-30))
    us = time_calls([lambda i=i: split(i) for i in range(sb.copies)], rep_ms=rep_ms)
    nbytes = row["GBps"] * 1e9 * row["us"] * 1e-6
    return {**row, "config": f"{name}|split", "us": us, "GBps": nbytes / (us * 1e-6) / 1e9,
            "share": nbytes / (us * 1e-6) / bw, "read_share": nbytes / (us * 1e-6) / rbw,
            "speedup_vs_sep": (row["bf16_sep_us"] / us) if row.get("bf16_sep_us") else None,
            "speedup_vs_fused": fused_us / us, "max_rel_err": err, "correct": err < 2e-2}


def _resolve(cfg, m, n, k, stack, dev):
    """A config entry of :func:`run`: ``None`` (the default for this call), a config, or a function."""
    K = _kernels()
    if cfg is None:
        return K.default_config(m, n, k, stack, dev)
    if callable(cfg):
        return cfg(m, n, k, stack)
    return cfg


def _dump(report: dict, out_dir: Optional[str]) -> None:
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_kernels.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(out_dir, "bench_kernels.md"), "w") as f:
            f.write(markdown_table(report))


def _verify(sb, stack, m, u, gen, cfg) -> float:
    """Relative error of the kernel against the reference on the delta term (bf16 in, fp32 out)."""
    K = _kernels()
    st = stack.select(0, u)
    rd = _rows_for(m, u, gen).cuda()
    x = sb.x[0][:m]
    y = K.multi_delta_linear(x, sb.base[0], None, st, rd, out_dtype=torch.float32, config=cfg)
    ref = K.multi_delta_linear_reference(x, sb.base[0], None, st, rd, out_dtype=torch.float32)
    base = x.float() @ sb.base[0].float().t()
    return float((y - ref).norm() / (ref - base).norm())


def markdown_table(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"GPU {meta['gpu']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
        f"copy bandwidth {meta['copy_GBps']:.0f} GB/s, streaming read {meta.get('read_GBps', 0):.0f} GB/s "
        f"(the 100 % line); stacks in the {meta.get('layout', 'file')} layout; groups of {meta['group_size']}.",
        "",
        "| N x K | M | U | format | config | us | GB/s | % read | % copy | floor us | bf16 base us | U x bf16 us "
        "| U x int4 us | speed-up vs U x bf16 | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"

    for r in report["results"]:
        lines.append(
            f"| {r['N']}x{r['K']} | {r['M']} | {r['U']} | {r['format']} | {r['config']} | {f(r['us'])} | "
            f"{f(r['GBps'], 0)} | {100 * r.get('read_share', 0):.0f} | {100 * r['share']:.0f} | {f(r['floor_us'])} | "
            f"{f(r['bf16_base_us'])} | "
            f"{f(r['bf16_sep_us'])} | {f(r['int4_sep_us'])} | {f(r['speedup_vs_sep'], 2)} | "
            f"{'yes' if r['correct'] else 'NO'} |"
        )
    return "\n".join(lines + [""] + summary_lines(report) + split_lines(report)) + "\n"


def split_lines(report: dict) -> list[str]:
    """The split route against the fused launch of the same config, cell by cell (``--split-route``)."""
    rows = [r for r in report["results"] if "speedup_vs_fused" in r]
    if not rows:
        return []
    out = ["", "| N x K | M | U | format | config | fused us | split us | fused / split |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fused = r["us"] * r["speedup_vs_fused"]
        out.append(f"| {r['N']}x{r['K']} | {r['M']} | {r['U']} | {r['format']} | {r['config'][:-len('|split')]} | "
                   f"{fused:.1f} | {r['us']:.1f} | {r['speedup_vs_fused']:.2f} |")
    return out


def summary_lines(report: dict) -> list[str]:
    """The target checks of issue 12, per shape and config: dense 2/4-bit share of the streaming
    read at M, U <= 32; 2-bit over 4-bit speed at U = 16; U = 16, M = 16 against 16 bf16 matmuls."""
    res = report["results"]
    out = ["| N x K | config | 4b % read (M,U<=32) | 2b % read (M,U<=32) | 2b/4b speed, U=16 (M=16) "
           "| M=16,U=16 vs 16 x bf16: 4b | 2b |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["N"], r["K"], r["config"]) for r in res}, key=lambda t: (-t[0] * t[1], t))
    for n, k, cfg in keys:
        mine = {(r["M"], r["U"], r["format"]): r for r in res if (r["N"], r["K"], r["config"]) == (n, k, cfg)}

        def span(fmt):
            v = [100 * r.get("read_share", 0) for (m, u, f), r in mine.items() if f == fmt and m <= 32 and u <= 32]
            return f"{min(v):.0f}-{max(v):.0f}" if v else "-"

        r4, r2 = mine.get((16, 16, "4b")), mine.get((16, 16, "2b"))
        ratio = f"{r4['us'] / r2['us']:.2f}" if r4 and r2 else "-"
        sp4 = f"{r4['speedup_vs_sep']:.2f}" if r4 and r4.get("speedup_vs_sep") else "-"
        sp2 = f"{r2['speedup_vs_sep']:.2f}" if r2 and r2.get("speedup_vs_sep") else "-"
        out.append(f"| {n}x{k} | {cfg} | {span('4b')} | {span('2b')} | {ratio} | {sp4} | {sp2} |")
    return out


TUNE_CASES = [  # ((N, K), M, U, (bits, 2:4)): the headline cases and the corners, most important first
    ((4096, 4096), 16, 16, (4, False)),
    ((4096, 4096), 1, 1, (4, False)),
    ((4096, 4096), 16, 16, (2, False)),
    ((4096, 4096), 16, 16, (4, True)),
    ((1024, 4096), 32, 32, (4, False)),
    ((14336, 4096), 16, 16, (2, True)),
]


# launch policies the sweep tries: block sizes and pipeline depth, and how many programs per SM
# the K split aims for (shared memory per program bounds how many run at once)
POLICIES = {
    "bkb128 s4 w2": dict(block_k_base=128, num_stages=4, waves=2),
    "bkb64 s4 w2": dict(block_k_base=64, num_stages=4, waves=2),
    "bkb64 s4 w4": dict(block_k_base=64, num_stages=4, waves=4),
    "bkb64 s3 w4": dict(block_k_base=64, num_stages=3, waves=4),
    "bkb64 s2 w4": dict(block_k_base=64, num_stages=2, waves=4),
    "bkb64 s4 w8": dict(block_k_base=64, num_stages=4, waves=8),
    "bkb64 s3 w8": dict(block_k_base=64, num_stages=3, waves=8),
}


def policy_config(policy: dict, n: int, k: int):
    """The :class:`MultiDeltaConfig` a policy gives for an ``n x k`` layer."""
    K = _kernels()
    p = dict(policy)
    waves = p.pop("waves", 2)
    bn = p.get("block_n", 64)
    return K.MultiDeltaConfig(**p, split_k=K.auto_split_k(n, k, bn, torch.device("cuda"), waves))


def tune_configs(n: int, k: int) -> dict:
    """The launch parameters the tuning sweep tries for an ``n x k`` layer."""
    return {name: policy_config(pol, n, k) for name, pol in POLICIES.items()}


def best_policy(rows: list[dict], log=print) -> str:
    """The policy with the smallest geometric-mean time over the cases it ran correctly on all."""
    cases = {(r["N"], r["K"], r["M"], r["U"], r["format"]) for r in rows}
    score = {}
    for name in POLICIES:
        mine = [r for r in rows if r["config"] == name and r["err"] < 1e-3]
        if len(mine) == len(cases):
            score[name] = math.exp(sum(math.log(r["us"]) for r in mine) / len(mine))
    for name, sc in sorted(score.items(), key=lambda kv: kv[1]):
        log(f"#   {name:16s} geo-mean {sc:8.1f} us")
    return min(score, key=score.get) if score else "bkb128 s4 w2"


def tune(cases=TUNE_CASES, *, budget_s: float = 240, rep_ms: int = 40, log=print) -> list[dict]:
    """Time every :func:`tune_configs` entry on each case; stops starting cases after ``budget_s``."""
    K = _kernels()
    gen = torch.Generator().manual_seed(1)
    bw = copy_bandwidth()
    log(f"# tune: copy bandwidth {bw / 1e9:.0f} GB/s")
    precompile([(n, k, bits, sparse, cfg, m, "planar", 0) for (n, k), m, u, (bits, sparse) in cases
                for cfg in tune_configs(n, k).values()], log=log)
    t_start = time.time()
    out = []
    shape_cache = {}
    for (n, k), m, u, (bits, sparse) in cases:
        if time.time() - t_start > budget_s:
            log("# tune: time budget spent, skipping the remaining cases")
            break
        if (n, k) not in shape_cache:
            shape_cache.clear()
            torch.cuda.empty_cache()
            shape_cache[(n, k)] = ShapeBench(n, k, 64, 32)
        sb = shape_cache[(n, k)]
        stacks = sb.stacks(bits, sparse)
        rd = _rows_for(m, u, gen).cuda()
        sts = [s.select(0, u) for s in stacks]
        nbytes = K.layer_bytes(m, n, k, sts[0])
        for name, cfg in tune_configs(n, k).items():
            t0 = time.time()
            try:
                err = _verify(sb, stacks[0], m, u, gen, cfg)
                calls = [
                    (lambda i=i: K.multi_delta_linear(
                        sb.x[i][:m], sb.base[i], None, sts[i], rd, out=sb.out[i][:m], config=cfg))
                    for i in range(sb.copies)
                ]
                us = time_calls(calls, rep_ms=rep_ms)
            except Exception as e:  # noqa: BLE001 - a config that fails to build is a result
                log(f"  {n}x{k} M={m} U={u} {_fmt_name(bits, sparse)} [{name}]: {type(e).__name__}: {str(e)[:300]}")
                continue
            share = nbytes / (us * 1e-6) / bw
            row = {"N": n, "K": k, "M": m, "U": u, "format": _fmt_name(bits, sparse), "config": name,
                   "split": cfg.split_k, "us": us, "share": share, "err": err, "wall_s": time.time() - t0}
            out.append(row)
            log(f"  {n}x{k} M={m:2d} U={u:2d} {row['format']:7s} {name:20s} split={cfg.split_k:2d} "
                f"{us:8.1f} us {100 * share:5.1f}% err={err:.1e} ({row['wall_s']:.1f} s)")
        del stacks, sts
    return out


# launch variants on top of default_config (``--variants``): what the planar kernel was tuned with
VARIANTS = {
    "default": {},
    "sw": dict(scale_in_weights=True),
    "s2": dict(num_stages=2),
    "s4": dict(num_stages=4),
    "s5": dict(num_stages=5),
    "w2": dict(waves=2),
    "w8": dict(waves=8),
    "w4": dict(waves=4),  # the split before row blocks were counted (2-bit, and 4-bit below 8192 outputs)
    "w6": dict(waves=6),  # ... and 4-bit on layers of 8192 outputs or more
    "bn128": dict(block_n=128, num_warps=8),
    "bn128w4": dict(block_n=128, num_warps=4),
    "bn256": dict(block_n=256, num_warps=4),
    "bn256s2": dict(block_n=256, num_warps=4, num_stages=2),
    "bn128sw": dict(block_n=128, num_warps=4, scale_in_weights=True),
    "s2wv6": dict(num_stages=2, waves=6),
    "r96s2wv6": dict(max_registers=96, num_stages=2, waves=6),
    "r0": dict(max_registers=0),  # no cap (2-bit stacks with 16-row blocks have one by default)
    "r120": dict(max_registers=120),
    "r128": dict(max_registers=128),
    "r80wv6": dict(max_registers=80, waves=6),
    "r80wv8": dict(max_registers=80, waves=8),
    "r96wv5": dict(max_registers=96, waves=5),
    "r64s2wv8": dict(max_registers=64, num_stages=2, waves=8),
    "r80s2wv8": dict(max_registers=80, num_stages=2, waves=8),
    "r80s4wv6": dict(max_registers=80, num_stages=4, waves=6),
    # decode steps of 17-32 rows: one row block instead of two (the base and a straddling delta read once per tile)
    "bm32": dict(block_m=32),
    "bm32r0": dict(block_m=32, max_registers=0),
    "bm32wv8": dict(block_m=32, waves=8),
    "bm32s2wv8": dict(block_m=32, num_stages=2, waves=8),
    "ns64": dict(swap_ab=False),
    "ns64wv8": dict(swap_ab=False, waves=8),
    "ns128": dict(swap_ab=False, block_n=128, num_warps=4),
    "ns128wv8": dict(swap_ab=False, block_n=128, num_warps=4, waves=8),
    "ns128s4": dict(swap_ab=False, block_n=128, num_warps=4, num_stages=4),
    "ns128w8": dict(swap_ab=False, block_n=128, num_warps=8),
    "ns256w8": dict(swap_ab=False, block_n=256, num_warps=8),
    "ns128sw": dict(swap_ab=False, block_n=128, num_warps=4, scale_in_weights=True),
    "bn256sw": dict(block_n=256, num_warps=4, scale_in_weights=True),
    "bn32": dict(block_n=32),
    "bkb128": dict(block_k_base=128),
    "w8s4": dict(waves=8, num_stages=4),
    # prefill shapes (hundreds of rows per delta): bigger row blocks, the x tile on the MMA's M side, no split-K
    "pk1": dict(split_k=1),
    "pm64n128": dict(block_m=64, block_n=128, swap_ab=False, num_warps=8, split_k=1),
    # 128-row tiles: two stages (three need 272-288 KB of shared memory, more than the H200's 227 KB)
    "pm128n64": dict(block_m=128, block_n=64, swap_ab=False, num_warps=4, split_k=1, num_stages=2),
    "pm128n128": dict(block_m=128, block_n=128, swap_ab=False, num_warps=8, split_k=1, num_stages=2),
    # prefill, weights kept on the MMA's M side (the default's orientation): wider output tiles, two warpgroups,
    # fewer / more stages, the group scale folded into the decode (one accumulator, no per-group partial)
    "pn128w8": dict(block_n=128, num_warps=8, split_k=1),
    "pn128w8s2": dict(block_n=128, num_warps=8, split_k=1, num_stages=2),
    "pw8": dict(num_warps=8, split_k=1),
    "ps2": dict(num_stages=2, split_k=1),
    "ps4": dict(num_stages=4, split_k=1),
    "psw": dict(scale_in_weights=True, split_k=1),
    "pn128w8sw": dict(block_n=128, num_warps=8, split_k=1, scale_in_weights=True),
    # the same with K split as the default would for the tile count (few rows: one or two prompts)
    "pn128w8a": dict(block_n=128, num_warps=8),
    "ps4a": dict(num_stages=4),
}


def variant_config(name: str):
    """``(m, n, k, stack) -> MultiDeltaConfig``: :func:`kernels.default_config` with ``VARIANTS[name]``."""
    from dataclasses import replace as _replace

    K = _kernels()
    over = dict(VARIANTS[name])
    waves = over.pop("waves", None)

    def make(m, n, k, stack):
        cfg = _replace(K.default_config(m, n, k, stack, torch.device("cuda")), **over)
        if (waves is not None or "block_n" in over) and "split_k" not in over:
            cfg = _replace(cfg, split_k=K.auto_split_k(n, k, cfg.block_n, torch.device("cuda"), waves or 4.0))
        return cfg

    return make


# --------------------------------------------------------------------------- SASS
def _planar_cubin(bits: int, cfg, block: int, dtype: str = "bf16", group_size: int = GROUP_SIZE) -> bytes:
    """The planar kernel compiled for sm_90 (no GPU needed), as a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    K = _kernels()
    import importlib

    fn = K.multi_delta.triton_kernel("planar_delta_linear_kernel")  # compiled, not interpreted (reloads if needed)
    tmod = importlib.import_module(K.__name__ + "._multi_delta_triton")
    magic = 1 if dtype == "fp16" else 2
    planes = 16 // bits
    ptr = {"x_ptr": dtype, "w_ptr": dtype, "bias_ptr": dtype, "q_ptr": "u8", "s_ptr": "fp16", "z_ptr": "u8",
           "seg_ptr": "i32", "lut_ptr": "i32", "out_ptr": dtype, "ws_ptr": "fp32", "cnt_ptr": "i32"}
    sig = {name: "*" + t for name, t in ptr.items()}
    ints = ["M", "N", "K", "U", "QROW_E", "G", "LOG2_GS", "K_CHUNK", "stride_xm", "stride_wn", "stride_om"]
    sig.update({name: "i32" for name in ints})
    consts = dict(BITS=bits, HAS_BIAS=False, HAS_LUT=True, HAS_BASE=True, ACCUM=False, BM=cfg.block_m, BN=cfg.block_n, BKP=block,
                  BKB=min(cfg.block_k_base, planes * block), PPG=min(planes, group_size // block), SPLIT=4,
                  SWAP=cfg.swap_ab, MAGIC=magic, SCALE_W=cfg.scale_in_weights, DOT_PREC="tf32", FAST=True)
    consts.update(tmod.planar_asm_args(bits, magic, cfg.scale_in_weights))
    sig.update({name: "constexpr" for name in consts})
    names = fn.arg_names
    aligned = list(ptr) + ["N", "K", "QROW_E", "G", "K_CHUNK", "stride_xm", "stride_wn", "stride_om"]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_registers:
        opts["maxnreg"] = cfg.max_registers
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["cubin"]


def sass_loop_stats(cubin: bytes) -> dict:
    """Instruction mix of the largest loop that decodes codes (LOP3 and MMAs in its body)."""
    import re
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = triton.knobs.nvidia.cuobjdump.path
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ins = []  # (address, opcode, branch target or None)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            op = [t for t in m.group(2).split() if not t.startswith("@")][0]
            tgt = re.search(r"BRA\s+0x([0-9a-f]+)", m.group(2))
            ins.append((int(m.group(1), 16), op, int(tgt.group(1), 16) if tgt else None))
    body: list = []
    for addr, _, tgt in ins:  # a backward branch closes a loop
        if tgt is not None and tgt < addr:
            cand = [op for a, op, _ in ins if tgt <= a <= addr]
            if any(op.startswith("LOP3") for op in cand) and any("MMA" in op for op in cand) and len(cand) > len(body):
                body = cand
    mix: dict = {}
    for op in body:
        key = op.split(".")[0]
        mix[key] = mix.get(key, 0) + 1
    regs = re.search(r"REG:(\d+)", res)
    return {"loop": len(body), "mix": mix, "registers": int(regs.group(1)) if regs else None}


def sass_report(formats=((4, False), (2, False)), n: int = 4096, k: int = 4096, m: int = 16, u: int = 16,
                log=print) -> list[dict]:
    """Instructions per weight in the delta loop of the planar kernel with its default launch
    parameters, read from the SASS compiled for sm_90 on this machine (no GPU needed)."""
    K = _kernels()
    out = []
    for bits, sparse in formats:
        stub = K.prepare_stack(K.random_delta_stack(1, 8, k, bits=bits, group_size=GROUP_SIZE, sparse_2of4=sparse))
        cfg = K.default_config(m, n, k, stub, torch.device("cuda")) if torch.cuda.is_available() else None
        if cfg is None:  # the GPU defaults without a GPU: same rules, split from a 132-SM H200
            import dataclasses

            cfg = K.MultiDeltaConfig(block_m=16)
            if bits == 2:
                cfg = dataclasses.replace(cfg, max_registers=128)
        block = stub.layout_block
        st = sass_loop_stats(_planar_cubin(bits, cfg, block))
        weights = cfg.block_n * (16 // bits) * block / (32 * cfg.num_warps)  # per thread and k-step
        row = {"format": _fmt_name(bits, sparse), "block": block, "registers": st["registers"],
               "loop_instructions": st["loop"], "weights_per_thread": weights,
               "instructions_per_weight": st["loop"] / weights, "mix": st["mix"]}
        out.append(row)
        top = ", ".join(f"{op} {c}" for op, c in sorted(st["mix"].items(), key=lambda kv: -kv[1])[:8])
        log(f"{row['format']:7s} block {block:3d}  regs {st['registers']}  {st['loop']} instructions per thread "
            f"and k-step / {weights:.0f} weights = {row['instructions_per_weight']:.2f} per weight  ({top})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltazip bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset: 2 shapes, M in 1/16/32, U in 1/4/16")
    p.add_argument("--shapes", help="comma-separated NxK list, e.g. 4096x4096,1024x4096")
    p.add_argument("--rows", help="comma-separated M values")
    p.add_argument("--deltas", help="comma-separated U values")
    p.add_argument("--formats", help="comma-separated formats, e.g. 4b,2b,4b+2:4,2b+2:4")
    p.add_argument("--no-baselines", action="store_true", help="time the kernel only")
    p.add_argument("--layout", choices=["planar", "file"], default="planar",
                   help="stacks in the kernel layout (default) or as stored in files (the generic kernel)")
    p.add_argument("--layout-block", type=int, default=0,
                   help="16-bit elements per planar block (default: kernels.default_planar_block(bits))")
    p.add_argument("--variants", help="comma-separated launch variants to time instead of the default: "
                   + ", ".join(VARIANTS))
    p.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time per measurement")
    p.add_argument("--split-route", action="store_true",
                   help="also time the split route: cuBLAS for the base, the kernel adding the deltas alone")
    p.add_argument("--out", default=None, help="folder for bench_kernels.json / .md")
    p.add_argument("--tune", action="store_true", help="sweep launch parameters on a few cases instead")
    p.add_argument("--sass", action="store_true",
                   help="instructions per weight of the planar kernel's delta loop, from SASS compiled here for sm_90")
    p.add_argument("--tune-budget-s", type=float, default=240)
    p.add_argument("--auto-tune", action="store_true",
                   help="sweep the launch policies first, then run the benchmark with the best one")
    a = p.parse_args(argv)
    config_for = None
    if a.sass:
        sass_report()
        return 0
    if a.auto_tune:
        rows_t = tune(budget_s=a.tune_budget_s)
        name = best_policy(rows_t)
        print(f"# best launch policy: {name} {POLICIES[name]}", flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "tune_kernels.json"), "w") as f:
                json.dump({"rows": rows_t, "best": name}, f, indent=1)

        def config_for(n, k, _name=name):
            return {_name: policy_config(POLICIES[_name], n, k)}
    elif a.tune:
        rows = tune(budget_s=a.tune_budget_s)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "tune_kernels.json"), "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    shapes, rows, deltas = (QUICK_SHAPES, QUICK_ROWS, QUICK_DELTAS) if a.quick else (SHAPES, ROWS, DELTAS)
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.rows:
        rows = [int(v) for v in a.rows.split(",")]
    if a.deltas:
        deltas = [int(v) for v in a.deltas.split(",")]
    formats = FORMATS
    if a.formats:
        formats = [(int(s.split("b")[0]), s.endswith("+2:4")) for s in a.formats.split(",")]
    if a.variants:
        chosen = {v: variant_config(v) for v in a.variants.split(",")}

        def config_for(n, k, _c=chosen):
            return _c
    report = run(shapes, rows, deltas, formats, out_dir=a.out, config_for=config_for, baselines=not a.no_baselines,
                 rep_ms=a.rep_ms, layout=a.layout, layout_block=a.layout_block, split_route=a.split_route)
    sys.stdout.write(markdown_table(report))
    return 0 if all(r["correct"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
