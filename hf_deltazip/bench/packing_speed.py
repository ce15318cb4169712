"""Host-side speed of the code grids and bit packing (``python -m hf_deltazip.bench.packing_speed``).

Times, on one ``[N, K]`` float32 matrix (default: the 262,144 x 640 embedding of Gemma 3 270M), the steps
a delta goes through on the CPU when it is compressed or loaded: :func:`~hf_deltazip.packing.quantize`,
:func:`~hf_deltazip.packing.dequantize`, :func:`~hf_deltazip.packing.pack_bits` and
:func:`~hf_deltazip.packing.unpack_bits`, and the rebuild of a lowrank module's served codes from its
factors (:meth:`hf_deltazip.delta.PackedModule.from_factors`, what loading a lowrank module costs). Each
step: the best of ``--repeats`` runs, in seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(n: int = 262144, k: int = 640, bits: int = 4, group_size: int = 128, rank: int = 32, repeats: int = 3,
        log=print) -> dict:
    from hf_deltazip.delta import PackedModule
    from hf_deltazip.packing import compute_qparams, dequantize, pack_bits, quantize, unpack_bits

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    scales, zeros = compute_qparams(w, bits, group_size, True)
    codes = quantize(w, scales, zeros, bits, group_size)
    packed = pack_bits(codes, bits)

    def factor(rows, width):
        f = torch.randn(rows, width, generator=gen)
        s, z = compute_qparams(f, bits, -1, True)
        return PackedModule.from_codes(quantize(f, s, z, bits, -1), s, z, None, bits=bits, group_size=-1,
                                       symmetric=True, kind="factor")

    bands = ((bits, factor(rank, n), factor(rank, k)),)
    out = {"shape": [n, k], "bits": bits, "group_size": group_size, "rank": rank, "threads": torch.get_num_threads(),
           "quantize_s": _best(lambda: quantize(w, scales, zeros, bits, group_size), repeats),
           "dequantize_s": _best(lambda: dequantize(codes, scales, zeros, group_size), repeats),
           "pack_bits_s": _best(lambda: pack_bits(codes, bits), repeats),
           "unpack_bits_s": _best(lambda: unpack_bits(packed, bits, k), repeats),
           "lowrank_rebuild_s": _best(lambda: PackedModule.from_factors(bands, (n, k), bits=bits, group_size=group_size,
                                                                        kind="embedding"), repeats)}
    log(f"[{n} x {k}] {bits}-bit, groups of {group_size}, {out['threads']} threads: "
        f"quantize {out['quantize_s']:.3f} s, dequantize {out['dequantize_s']:.3f} s, "
        f"pack {out['pack_bits_s']:.3f} s, unpack {out['unpack_bits_s']:.3f} s, "
        f"lowrank rebuild (rank {rank}) {out['lowrank_rebuild_s']:.3f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.packing_speed", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="262144x640", help="N x K of the matrix")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--rank", type=int, default=32, help="rank of the lowrank module rebuilt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    n, k = (int(v) for v in args.shape.split("x"))
    result = run(n, k, args.bits, args.group_size, args.rank, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
