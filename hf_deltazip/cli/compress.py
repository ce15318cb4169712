"""``deltazip compress``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import BUDGET_WEIGHTINGS
from ..errors import DeltaZipError


def _sparsity(value: str):
    if value in ("none", "None", "0", ""):
        return None
    if value == "2:4" or value.startswith("lowrank:"):
        return value  # DeltaZipConfig checks the lowrank size
    try:
        return float(value)
    except ValueError:
        raise DeltaZipError(f'--sparsity must be "none", "2:4", a fraction such as 0.5 or "lowrank:x" such as '
                            f'lowrank:0.5, got {value!r}') from None


def device_type(value: str) -> str:
    """argparse ``type=`` for ``--device``: a device torch knows, and a GPU only where there is one."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value!r}: no CUDA GPU is available here; use cpu")
    return value


def cmd_compress(args) -> int:
    from ..compression import compress
    from ..config import DeltaZipConfig, read_config_json
    from ..format.folder import delta_bytes_report

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DeltaZipError(f"--out {out} is a file, not a folder: pass a new or empty folder for the delta")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise DeltaZipError(f"{out} exists and is not empty: choose another --out, or pass --overwrite to replace its delta")
    settings = read_config_json(args.config) if args.config else {}
    if not isinstance(settings, dict):
        raise DeltaZipError(f"--config {args.config} must hold a JSON object of settings, such as {{\"bits\": 4}}")
    for key in ("bits", "group_size", "n_samples", "seq_len", "zstd_level", "target_ratio", "budget_weighting"):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    if args.sparsity is not None:
        settings["sparsity"] = _sparsity(args.sparsity)
    if args.asymmetric:
        settings["symmetric"] = False
    config = DeltaZipConfig.from_dict(settings)
    load_kwargs = {}
    if args.dtype:
        import torch

        load_kwargs["dtype"] = getattr(torch, args.dtype)
    for flag, given in (("--base", args.base), ("--finetuned", args.finetuned)):  # before any model is loaded
        if str(given).startswith((".", "/", "~")) and not Path(given).expanduser().exists():
            raise DeltaZipError(f"{flag} {given}: no such folder (give a local model folder or a Hub id such as org/name)")
    if args.calibration is None:
        print("deltazip: no --calibration file: using round-to-nearest instead of the OBS solver (lower quality)")
    else:
        calibration = Path(args.calibration)
        if not calibration.is_file():
            raise DeltaZipError(f"--calibration {calibration}: no such file")
        if calibration.suffix not in (".jsonl", ".txt", ".md", ".text"):
            raise DeltaZipError(f"--calibration {calibration}: calibration files must be .jsonl (one record per line) "
                                "or .txt")
    if getattr(args, "base_quantization", None):  # nf4 / fp4 / int8: the delta is made for the quantized base
        from transformers import BitsAndBytesConfig

        q = args.base_quantization
        load_kwargs["base_quantization"] = (BitsAndBytesConfig(load_in_8bit=True) if q == "int8" else BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=q, bnb_4bit_use_double_quant=True))
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as e:
            raise DeltaZipError(f"--tokenizer {args.tokenizer}: could not load a tokenizer ({str(e).splitlines()[0][:200]})") from None
    delta = compress(args.base, args.finetuned, config, calibration=args.calibration, tokenizer=tokenizer,
                     device=args.device, batch_size=args.batch_size, **load_kwargs)
    delta.save_pretrained(out)
    report = delta_bytes_report(out)
    s = delta.summary
    errs = s["relative_error"]
    print(f"compressed in {s['seconds']:.1f} s on {s['device']}: {len(delta.modules)} modules, {len(delta.params)} exact parameters")
    for cat, n in report["categories"].items():
        print(f"  {cat:<22} {n:>12,d} bytes")
    print(f"  {'total':<22} {report['total_bytes']:>12,d} bytes; ratio {report['ratio']:.2f}x to the fine-tune in 16-bit"
          + (f" (target {config.target_ratio:g}x)" if config.target_ratio else ""))
    print(f"  {'resident on a GPU':<22} {report['resident_bytes']:>12,d} bytes (decoded layouts, no zstd)")
    if errs:
        worst = max(errs, key=errs.get)
        print(f"relative error per module: mean {sum(errs.values()) / len(errs):.4f}, worst {errs[worst]:.4f} ({worst})")
    print(f"saved to {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("compress", help="compress a fine-tune into a delta over its base")
    p.add_argument("--base", required=True, help="base model id or path")
    p.add_argument("--finetuned", required=True, help="fine-tuned model id or path")
    p.add_argument("--out", required=True, help="output folder (must be new or empty unless --overwrite)")
    p.add_argument("--bits", type=int, help="2, 3, 4 or 8")
    p.add_argument("--sparsity", help='"none", "2:4", a fraction pruned (e.g. 0.5), or "lowrank:x" (linear deltas as '
                                      'quantized singular directions taking x bits per weight)')
    p.add_argument("--group-size", dest="group_size", type=int, help="-1 (per row) or a power of two 32..1024")
    p.add_argument("--asymmetric", action="store_true", help="asymmetric grid")
    p.add_argument("--calibration", help="a local .jsonl or .txt file")
    p.add_argument("--tokenizer", help="tokenizer (folder or Hub id) for --calibration text (default: the fine-tune's)")
    p.add_argument("--n-samples", dest="n_samples", type=int)
    p.add_argument("--seq-len", dest="seq_len", type=int)
    p.add_argument("--zstd-level", dest="zstd_level", type=int)
    p.add_argument("--target-ratio", dest="target_ratio", type=float,
                   help="whole-file ratio to reach (e.g. 16): bits, sparsity and group size are then chosen per module")
    p.add_argument("--budget-weighting", dest="budget_weighting", choices=BUDGET_WEIGHTINGS,
                   help="with --target-ratio: weigh module errors by the Fisher information of their outputs "
                        "(fisher, the default) or use the plain OBS objective (output)")
    p.add_argument("--config", help="a deltazip_config.json to start from")
    p.add_argument("--device", type=device_type, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="dtype to load the models in")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--base-quantization", dest="base_quantization", choices=["nf4", "fp4", "int8"],
                   help="make the delta for this bitsandbytes base (4-bit with double quantization, or 8-bit)")
    p.add_argument("--overwrite", action="store_true", help="replace the delta already in --out")
    p.set_defaults(func=cmd_compress)
