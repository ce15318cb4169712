"""``deltazip bench quality|kernels|serve``: thin entry points to the benchmark scripts in hf_deltazip.bench."""

from __future__ import annotations

import argparse
import sys


def cmd_bench(args) -> int:
    if args.which == "quality":
        from ..bench.quality import main
    elif args.which == "serve":
        from ..bench.serve import main
    else:
        from ..bench.kernels import main
    try:
        return int(main(args.rest) or 0)
    except RuntimeError as e:  # e.g. a GPU benchmark on a machine without one
        print(f"deltazip bench {args.which}: {e}", file=sys.stderr)
        return 2


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: quality (gain kept vs ratio), kernels (GPU) or serve (many deltas, GPU)")
    p.add_argument("which", choices=["quality", "kernels", "serve"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")
    p.set_defaults(func=cmd_bench)
