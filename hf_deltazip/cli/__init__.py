"""The ``deltazip`` command: ``info``, ``compress``, ``push``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .._version import __version__
from ..errors import DeltaZipError


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from ..config import CONFIG_NAME
    from ..format.folder import delta_bytes_report, load_folder_config
    from ..errors import DeltaZipFormatError
    from ..format import DeltaZipFile

    path = Path(args.path)
    if not path.exists():
        raise DeltaZipFormatError(path, "no such delta folder or .dz file")
    report = delta_bytes_report(path)
    folder = path if path.is_dir() else path.parent
    if path.is_dir() or (folder / CONFIG_NAME).exists():
        # cheap, so always: a config that contradicts the header is refused (a folder must have one)
        load_folder_config(folder, report["header"])
    if args.verify:
        with DeltaZipFile(report["path"]) as dz:
            report["verified_tensors"] = dz.verify()
    if args.json:
        report = dict(report)
        report["header"] = {k: v for k, v in report["header"].to_dict().items() if k not in ("base_fingerprint", "model_config")}
        print(json.dumps(report, indent=2, default=str))
        return 0
    h = report["header"]
    print(f"delta file:      {report['path']}")
    print(f"base model:      {h.base_model}" + (f" @ {h.base_revision}" if h.base_revision else ""))
    print(f"fine-tune:       {h.finetuned_model}")
    print(f"architecture:    {h.model_type} {h.architectures or ''}")
    print(f"library version: {h.library_version}")
    cfg = h.config
    budget = report["budget"]
    keys = ("bits", "sparsity", "group_size", "symmetric", "embeddings", "embedding_bits", "zstd_level")
    shown = [f"{k}={cfg.get(k)!r}" for k in keys if k in cfg]
    if budget:  # the budget's per-module choices are in the --verbose table
        shown = [f"target_ratio={budget.get('target_ratio')!r}", f"overrides: {len(cfg.get('overrides') or {})} modules"]
    elif "overrides" in cfg:
        shown.append(f"overrides={cfg['overrides']!r}")
    print("config:          " + ", ".join(shown))
    print("bytes:")
    for cat, n in report["categories"].items():
        print(f"  {cat:<22} {_fmt_bytes(n):>12}")
    print(f"  {'container and config':<22} {_fmt_bytes(report['container_and_config_bytes']):>12}")
    print(f"  {'total':<22} {_fmt_bytes(report['total_bytes']):>12}")
    print(f"  {'resident on a GPU':<22} {_fmt_bytes(report['resident_bytes']):>12}  (decoded layouts, no zstd)")
    if report["ratio"]:
        target = f" (target {budget['target_ratio']:g}x)" if budget.get("target_ratio") else ""
        print(f"fine-tune in 16-bit: {_fmt_bytes(report['finetune_fp16_bytes'])}; ratio {report['ratio']:.2f}x{target}")
    else:
        print("ratio: unknown (the file does not record the fine-tune's parameter count)")
    if args.verbose:
        print(f"\n{'module':<52} {'kind':<9} {'shape':<14} {'bits':>4} {'group':>5} {'sparsity':<8} {'bytes':>10} "
              f"{'bits/w':>7} {'GPU bytes':>10}")
        for m in report["modules"]:
            shape = "x".join(map(str, m["shape"]))
            print(
                f"{m['module']:<52} {m['kind']:<9} {shape:<14} {m['bits']:>4} {m['group_size']:>5} "
                f"{m['sparsity']:<8} {m['bytes']:>10} {m['bits_per_weight']:>7.3f} {m['resident_bytes']:>10}"
            )
    if args.verify:
        print(f"verified: {report['verified_tensors']} tensors match their checksums; the config agrees with the header")
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltazip", description="Compressed deltas of fine-tuned LLMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show what a .dz file or a delta folder holds")
    p.add_argument("path", help="a delta folder or a .dz file")
    p.add_argument("--verbose", "-v", action="store_true", help="add a per-module table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also decode every tensor and check its checksum (reads the whole file); exits 2 on any fault")
    p.set_defaults(func=cmd_info)

    _add_more_commands(sub)
    return parser


def _add_more_commands(sub) -> None:
    """Subcommands that live with the code they drive."""
    from ..serving import openai_app
    from . import bench, compress, demo, push

    for mod in (compress, demo, push, bench, openai_app):
        mod.add_parser(sub)


def main(argv=None) -> int:
    """Run ``deltazip``. Every failure is one line on stderr and a non-zero status, never a traceback.

    Exit status: 0 done, 2 an error (bad input, a corrupt delta, a failed download, ...), 130
    interrupted, 141 the reader of stdout went away (``deltazip info ... | head``). Set
    ``DELTAZIP_DEBUG=1`` to get the traceback of an unexpected error.
    """
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe must end in the handler below
        return status
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print("deltazip: interrupted", file=sys.stderr)
        return 130
    except (DeltaZipError, OSError, ValueError) as e:  # bad input: a file, a folder, a value
        if os.environ.get("DELTAZIP_DEBUG"):
            raise
        print(f"deltazip: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if os.environ.get("DELTAZIP_DEBUG"):
            raise
        print(f"deltazip: error: {type(e).__name__}: {_one_line(e)} (set DELTAZIP_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so that flushing it at exit raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
