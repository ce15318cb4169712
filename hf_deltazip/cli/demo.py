"""``deltazip demo``: the offline demo (:func:`hf_deltazip.bench.demo.run_demo`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .compress import device_type


def cmd_demo(args) -> int:
    from ..bench.demo import run_demo

    progress = False if args.no_progress else None
    if args.workdir:
        run_demo(Path(args.workdir), size=args.size, device=args.device, progress=progress)
        return 0
    with tempfile.TemporaryDirectory(prefix="deltazip-demo-") as tmp:
        run_demo(Path(tmp), size=args.size, device=args.device, keep=False, progress=progress)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the offline demo: two fine-tunes, compressed, served in one batch")
    p.add_argument("--workdir", help="keep the models and deltas here (default: a temporary folder)")
    p.add_argument("--size", default="tiny", help="model size preset: tiny (CPU, ~1 min), small (CPU minutes)")
    p.add_argument("--device", default="cpu", type=device_type, help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--no-progress", dest="no_progress", action="store_true",
                   help="no progress bars (they are shown only on a terminal anyway)")
    p.set_defaults(func=cmd_demo)
