"""The Gluon decode kernel per layer: decode steps of the split route, timed against the fused kernel.

``python -m hf_deltazip.bench.gluon_decode`` (an sm_90 GPU: H100 or H200). For each 8B layer shape, code
width and number of distinct deltas ``U`` in a step of ``--rows`` rows (each delta ``rows / U`` rows,
in random order), it times, with :func:`hf_deltazip.bench.kernels.time_calls` (CUDA graphs over copies
of the weights, so that L2 does not hold them):

* ``fused``: the planar Triton kernel, base and deltas in one launch (the default decode route);
* ``triton split``: cuBLAS for the base, then the planar Triton kernel adding the deltas alone (its
  default launch parameters, :func:`kernels.default_config`, with ``backend="triton"``);
* ``mm``: cuBLAS alone;
* per ``--variants`` entry ``warps:rows:stages:outputs[:split_max[:registers[:rule[:per_sm]]]]`` (stages 0: the launcher's default): cuBLAS
  plus the Gluon kernel (``split``) and the Gluon kernel alone, its error against the fused kernel's float32
  output (relative to the deltas' part), and the GB/s of the delta bytes it reads. ``rule``: how K is
  split, 0 (default) ``split_rule="rounds"``, 1 ``"target"`` (the first rule, for comparison), 2
  ``"fixed"`` (``split_max`` chunks); ``per_sm``: programs per SM (0 or absent: as many as fit);
  ``registers``: a cap per thread (0 or absent: the launcher's default for the format, -1: none).

Output: one line per cell and a JSON file (``--json``).
"""

from __future__ import annotations

import argparse
import json
import traceback
from dataclasses import replace

import torch


def _variant(text: str) -> dict:
    parts = [int(v) for v in text.split(":")]
    if len(parts) < 4:
        raise argparse.ArgumentTypeError(
            f"a variant is warps:rows:stages:outputs[:split_max[:registers[:rule[:per_sm]]]], got {text!r}")
    kw = dict(num_warps=parts[0], block_rows=parts[1], stages=parts[2] or None, block_n=parts[3])
    if len(parts) > 4 and parts[4]:
        kw["split_max"] = parts[4]
    if len(parts) > 5 and parts[5]:
        kw["max_registers"] = max(parts[5], 0)  # -1: no cap
    if len(parts) > 6:
        if parts[6] not in (0, 1, 2):
            raise argparse.ArgumentTypeError(
                f"a variant's split rule is 0 (rounds), 1 (target) or 2 (fixed), got {parts[6]}")
        kw["split_rule"] = ("rounds", "target", "fixed")[parts[6]]
    if len(parts) > 7 and parts[7]:
        kw["per_sm"] = parts[7]
    return kw


def _launch_kw(kw: dict) -> dict:
    """A variant's keyword arguments for gluon_delta_accumulate (``per_sm`` becomes ``target``)."""
    kw = dict(kw)
    per_sm = kw.pop("per_sm", None)
    if per_sm:
        from hf_deltazip.kernels.launch import sm_count

        kw["target"] = per_sm * sm_count(torch.device("cuda"))
    return kw


def _tag(kw: dict) -> str:
    return (f"{kw['num_warps']}w/{kw['block_rows']}r/{kw['stages'] or 'default '}st/{kw['block_n']}n/"
            f"split<={kw.get('split_max', 'auto')}/regs {kw.get('max_registers', 'default') or 'any'}/"
            f"{kw.get('split_rule', 'rounds')}"
            f"/{kw.get('per_sm', 'fit')} per SM")


def run(shapes, bits_list, deltas, rows: int, variants: list[dict], log=print) -> list[dict]:
    from hf_deltazip import kernels as K
    from hf_deltazip.kernels._gluon_decode import gluon_delta_accumulate

    from .kernels import read_bandwidth, time_calls

    dev = "cuda"
    rbw = read_bandwidth()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; streaming read {rbw / 1e9:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    umax = max(deltas)
    out_rows = []
    for bits in bits_list:
        for (n, k) in shapes:
            per = n * k * bits / 8
            copies = min(4, max(2, int(400e6 // (per * umax + n * k * 2)) + 1))
            sts = [K.prepare_stack(K.random_delta_stack(umax, n, k, bits=bits, group_size=128, device=dev,
                                                        scale_range=(1e-3, 4e-3))) for _ in range(copies)]
            bases = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            outs = [torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            g = sts[0].scales.shape[-1]
            # the Triton kernel as the split route launches it: its tuned defaults for this shape, not Gluon
            triton_cfg = replace(K.default_config(rows, n, k, sts[0], torch.device(dev)), backend="triton")
            for u in deltas:
                rd = (torch.arange(rows) % u)[torch.randperm(rows, generator=gen)].to(torch.int32).to(dev)
                seg = K.build_row_segments(rd)
                dbytes = u * (n * k * bits / 8 + n * g * 3)
                ref = K.multi_delta_linear(xs[0], bases[0], None, sts[0], rd, out_dtype=torch.float32, segments=seg)
                base_out = xs[0].float() @ bases[0].float().t()

                def fused(i):
                    K.multi_delta_linear(xs[i], bases[i], None, sts[i], rd, out=outs[i], segments=seg)

                def tsplit(i):
                    torch.mm(xs[i], bases[i].t(), out=outs[i])
                    K.multi_delta_linear(xs[i], None, None, sts[i], rd, out=outs[i], segments=seg, accumulate=True,
                                         config=triton_cfg)

                def mm(i):
                    torch.mm(xs[i], bases[i].t(), out=outs[i])

                t_f = time_calls([lambda i=i: fused(i) for i in range(copies)], rep_ms=30)
                t_ts = time_calls([lambda i=i: tsplit(i) for i in range(copies)], rep_ms=30)
                t_mm = time_calls([lambda i=i: mm(i) for i in range(copies)], rep_ms=30)
                row = dict(bits=bits, n=n, k=k, rows=rows, deltas=u, fused_us=t_f, triton_split_us=t_ts, mm_us=t_mm,
                           fused_GBps=(dbytes + n * k * 2) / t_f / 1e3, variants={})
                log(f"{bits}b {n}x{k} M={rows} U={u}: fused {t_f:.1f} us | triton split {t_ts:.1f} "
                    f"(deltas ~{t_ts - t_mm:.1f}) | mm {t_mm:.1f}")
                for vkw in variants:
                    kw, tag = _launch_kw(vkw), _tag(vkw)
                    try:
                        mm(0)
                        gluon_delta_accumulate(xs[0], sts[0], seg, outs[0], **kw)
                        torch.cuda.synchronize()
                        err = float((outs[0].float() - ref).norm() / (ref - base_out).norm())

                        def gs(i, kw=kw):
                            torch.mm(xs[i], bases[i].t(), out=outs[i])
                            gluon_delta_accumulate(xs[i], sts[i], seg, outs[i], **kw)

                        def ga(i, kw=kw):
                            gluon_delta_accumulate(xs[i], sts[i], seg, outs[i], **kw)

                        t_gs = time_calls([lambda i=i: gs(i) for i in range(copies)], rep_ms=30)
                        t_ga = time_calls([lambda i=i: ga(i) for i in range(copies)], rep_ms=30)
                        cell = dict(err=err, split_us=t_gs, alone_us=t_ga, delta_GBps=dbytes / t_ga / 1e3,
                                    vs_fused=t_f / t_gs, vs_triton_split=t_ts / t_gs)
                        log(f"    {tag}: err {err:.2e} | split {t_gs:.1f} us ({cell['vs_fused']:.2f}x fused, "
                            f"{cell['vs_triton_split']:.2f}x triton split) | alone {t_ga:.1f} us, "
                            f"{cell['delta_GBps']:.0f} GB/s ({cell['delta_GBps'] * 1e9 / rbw * 100:.0f} % of read)")
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported
                        cell = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                        traceback.print_exc()
                        log(f"    {tag}: ERROR {cell['error']}")
                    row["variants"][tag] = cell
                from hf_deltazip.kernels._gluon_decode import _RESIDENT

                row["programs_per_sm"] = {
                    f"{c['num_warps']}w/{c['BR']}r/{c['BN']}n/{c['BITS']}b/{c['STAGES']}st/"
                    f"regs {c.get('maxnreg', 'any')}": v
                    for c, v in ((dict(key[-1]), v) for key, v in _RESIDENT.items())}
                out_rows.append(row)
            log(f"    programs per SM so far (by launch): {row.get('programs_per_sm', {})}")
            del sts, bases
            torch.cuda.empty_cache()
    return out_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.gluon_decode", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336", help="N x K layer shapes, comma-separated")
    p.add_argument("--bits", default="2,4")
    p.add_argument("--deltas", default="1,5,8", help="distinct deltas per step, comma-separated")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--variants", default="4:8:0:64", type=lambda s: [_variant(v) for v in s.split(",")],
                   help="Gluon launch parameters, comma-separated: "
                        "warps:rows:stages:outputs[:split_max[:registers[:rule[:per_sm]]]]")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        raise SystemExit("the Gluon decode kernel needs an sm_90 GPU (H100 or H200): none here")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = run(shapes, [int(b) for b in args.bits.split(",")], [int(u) for u in args.deltas.split(",")], args.rows,
               args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
