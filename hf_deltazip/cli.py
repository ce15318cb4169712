"""The ``deltazip`` command: ``info``, ``compress``, ``push``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DeltaZipError


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    from .delta import delta_bytes_report

    report = delta_bytes_report(args.path)
    if args.json:
        report = dict(report)
        report["header"] = {k: v for k, v in report["header"].items() if k not in ("base_fingerprint", "model_config")}
        print(json.dumps(report, indent=2, default=str))
        return 0
    h = report["header"]
    print(f"delta file:      {report['path']}")
    print(f"base model:      {h.get('base_model')}" + (f" @ {h['base_revision']}" if h.get("base_revision") else ""))
    print(f"fine-tune:       {h.get('finetuned_model')}")
    print(f"architecture:    {h.get('model_type')} {h.get('architectures') or ''}")
    print(f"library version: {h.get('library_version')}")
    cfg = h.get("config", {})
    keys = ("bits", "sparsity", "group_size", "symmetric", "embeddings", "embedding_bits", "zstd_level", "overrides")
    print("config:          " + ", ".join(f"{k}={cfg.get(k)!r}" for k in keys if k in cfg))
    print("bytes:")
    for cat, n in report["categories"].items():
        print(f"  {cat:<22} {_fmt_bytes(n):>12}")
    print(f"  {'container and config':<22} {_fmt_bytes(report['container_and_config_bytes']):>12}")
    print(f"  {'total':<22} {_fmt_bytes(report['total_bytes']):>12}")
    if report["ratio"]:
        print(f"fine-tune in 16-bit: {_fmt_bytes(report['finetune_fp16_bytes'])}; ratio {report['ratio']:.2f}x")
    else:
        print("ratio: unknown (the file does not record the fine-tune's parameter count)")
    if args.verbose:
        print(f"\n{'module':<52} {'kind':<9} {'shape':<14} {'bits':>4} {'group':>5} {'sparsity':<8} {'bytes':>10} {'bits/w':>7}")
        for m in report["modules"]:
            shape = "x".join(map(str, m["shape"]))
            print(
                f"{m['module']:<52} {m['kind']:<9} {shape:<14} {m['bits']:>4} {m['group_size']:>5} "
                f"{m['sparsity']:<8} {m['bytes']:>10} {m['bits_per_weight']:>7.3f}"
            )
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltazip", description="Compressed deltas of fine-tuned LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show what a .dz file or a delta folder holds")
    p.add_argument("path", help="a delta folder or a .dz file")
    p.add_argument("--verbose", "-v", action="store_true", help="add a per-module table")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_info)

    _add_more_commands(sub)
    return parser


def _add_more_commands(sub) -> None:
    """Subcommands that live with the code they drive."""
    for mod_name in ("compress_cli", "demo", "hub_cli", "bench_cli"):
        try:
            mod = __import__(f"hf_deltazip.{mod_name}", fromlist=["add_parser"])
        except ModuleNotFoundError as e:
            if e.name != f"hf_deltazip.{mod_name}":
                raise
            continue
        mod.add_parser(sub)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DeltaZipError as e:
        print(f"deltazip: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("deltazip: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
