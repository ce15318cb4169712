"""``deltazip bench quality``: gain kept against whole-file compression ratio, ours and the baselines.

On a base / fine-tune pair from :mod:`hf_deltazip.bench.pairs` (REFERENCE section 3):

* our method at several settings (8, 4, 3 bits; 2 bits with 2:4; unstructured sparsity; ...), each
  saved to a real ``.dz`` folder whose every byte is counted;
* at the byte budget of each of our settings, the published baselines applied to every compressed
  matrix (linear layers, embeddings, LM head) with the same exact parameters (norms, biases):
  round-to-nearest, DARE (random drop and rescale) and low-rank SVD; plus sign + one scale per
  matrix (BitDelta form) at its own fixed budget.

For each: exact match on the held-out task, mean token NLL on held-out task text, gain kept by each
score, greedy agreement with the fine-tune and KL(fine-tune || compressed).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from ..compression import compress
from ..compression import baselines as bl
from ..config import DeltaZipConfig
from ..delta import delta_bytes_report
from ..modeling import DeltaModel
from ..modeling.arch import conv1d_class
from . import metrics
from .pairs import build_pair

OUR_SETTINGS = {
    "8-bit g128": dict(bits=8, group_size=128),
    "4-bit g128": dict(bits=4, group_size=128),
    "3-bit g128": dict(bits=3, group_size=128),
    "4-bit per-row": dict(bits=4, group_size=-1, embedding_group_size=1024),
    "3-bit per-row": dict(bits=3, group_size=-1, embedding_bits=3, embedding_group_size=1024),
    "2-bit + 2:4": dict(bits=2, sparsity="2:4", group_size=-1, embedding_bits=3, embedding_group_size=1024),
    "2-bit per-row": dict(bits=2, group_size=-1, embedding_bits=2, embedding_group_size=1024),
    "4-bit + 50% sparse": dict(bits=4, sparsity=0.5, group_size=-1, embedding_bits=3, embedding_group_size=1024),
    "2-bit + 75% sparse": dict(bits=2, sparsity=0.75, group_size=-1, embedding_bits=2, embedding_group_size=1024),
    "2-bit + 85% sparse": dict(bits=2, sparsity=0.85, group_size=-1, embedding_bits=2, embedding_group_size=1024),
    "2-bit + 90% sparse": dict(bits=2, sparsity=0.9, group_size=-1, embedding_bits=2, embedding_group_size=1024),
}
QUICK_SETTINGS = ("4-bit g128", "2-bit + 2:4", "2-bit + 75% sparse")


def _score(model, pair, tok, ft, prompts, device) -> dict:
    out = {
        "exact_match": metrics.exact_match(model, tok, pair.eval_examples, max_new_tokens=24),
        "task_nll": metrics.mean_token_nll(model, tok, pair.eval_texts),
    }
    if ft is not None:
        out["agreement"] = metrics.greedy_agreement(ft, model, prompts, max_new_tokens=16, eos_token_id=tok.eos_token_id)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in pair.eval_texts[:64]]
        out["kl"] = metrics.kl_divergence(ft, model, ids)
    return out


def _gains(scores: dict, base: dict, ft: dict) -> dict:
    out = {}
    if ft["exact_match"] != base["exact_match"]:
        out["gain_kept_em"] = metrics.gain_kept(scores["exact_match"], base["exact_match"], ft["exact_match"])
    out["gain_kept_nll"] = metrics.gain_kept(-scores["task_nll"], -base["task_nll"], -ft["task_nll"])
    return out


def _matrices(base, ft, delta_modules: list) -> dict:
    """name -> (base [N,K], ft [N,K]) of every matrix our method compressed."""
    c = conv1d_class()
    out = {}
    for name in delta_modules:
        mb, mf = base.get_submodule(name), ft.get_submodule(name)
        tb, tf = mb.weight.detach(), mf.weight.detach()
        if c is not None and isinstance(mf, c):
            tb, tf = tb.t(), tf.t()
        out[name] = (tb.float(), tf.float())
    return out


def _baseline_model(base, ft, mats: dict, method: str, bits_per_weight: float, device):
    """A copy of the fine-tune whose compressed matrices are replaced by base + the baseline's delta."""
    model = copy.deepcopy(ft)
    c = conv1d_class()
    total = 0
    for name, (wb, wf) in mats.items():
        delta = (wf - wb).to(device)
        shape = tuple(delta.shape)
        budget = int(bits_per_weight * delta.numel() / 8)
        if method == "sign+scale":
            rec = bl.sign_scale_baseline(delta)
        elif method == "DARE":
            p = min(max(bl.dare_p_for_bytes(shape, budget), 0.0), 0.999)
            rec = bl.dare_baseline(delta, p, generator=torch.Generator(device=delta.device).manual_seed(0))
        elif method == "SVD":
            rank = max(bl.rank_for_bytes(shape, budget), 1)
            rec = bl.svd_baseline(delta, rank)
        else:
            raise ValueError(method)
        total += rec.nbytes
        mod = model.get_submodule(name)
        w = (wb.to(device) + rec.delta.to(device))
        if c is not None and isinstance(mod, c):
            w = w.t()
        mod.weight.data = w.contiguous().to(mod.weight.dtype).to(mod.weight.device)
    return model, total


def run_quality(
    workdir: Path,
    *,
    arch: str = "llama",
    size: str = "tiny",
    task: str = "sort",
    device: str = "cpu",
    settings: Optional[list] = None,
    baselines: bool = True,
    n_calibration: int = 128,
    seq_len: int = 256,
    log=print,
) -> dict:
    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    pair = build_pair(workdir / f"pair-{arch}-{size}-{task}", arch=arch, size=size, task=task, device=device,
                      log=lambda m: log(f"  pair: {m}"))
    log(f"[{time.perf_counter() - t0:6.1f}s] pair ready: {pair.info['finetuned_params']:,d} parameters")
    tok = pair.load_tokenizer()
    base = pair.load_base(device)
    ft = pair.load_finetuned(device)
    prompts = [tok(ex.prompt, add_special_tokens=False)["input_ids"] for ex in pair.eval_examples[:64]]
    s_base = _score(base, pair, tok, None, prompts, device)
    s_ft = _score(ft, pair, tok, None, prompts, device)
    log(f"[{time.perf_counter() - t0:6.1f}s] base {s_base}; fine-tune {s_ft}")
    calib = pair.calibration_texts(n_calibration * 4)  # disjoint from the held-out examples
    fp16_bytes = 2 * pair.info["finetuned_params"]
    rows = []
    names = settings or list(OUR_SETTINGS)
    for name in names:
        cfg = DeltaZipConfig(n_samples=n_calibration, seq_len=seq_len, **OUR_SETTINGS[name])
        t1 = time.perf_counter()
        delta = compress(pair.base_dir, pair.finetuned_dir, cfg, calibration=calib, tokenizer=tok, device=device, progress=False)
        secs = time.perf_counter() - t1
        with tempfile.TemporaryDirectory() as d:
            delta.save_pretrained(d)
            report = delta_bytes_report(d)
            model = DeltaModel(pair.load_base(device))
            model.load_delta(d, delta_name="x")
            merged = model.merge_and_unload("x")
        scores = _score(merged, pair, tok, ft, prompts, device)
        row = {"method": "ours", "setting": name, "bytes": report["total_bytes"], "ratio": fp16_bytes / report["total_bytes"],
               "compress_s": secs, **scores, **_gains(scores, s_base, s_ft)}
        rows.append(row)
        log(f"[{time.perf_counter() - t0:6.1f}s] ours {name}: {_fmt_row(row)}")
        if not baselines:
            continue
        exact_bytes = report["categories"]["other parameters"]
        mats = _matrices(base, ft, list(delta.modules))
        n_weights = sum(wb.numel() for wb, _ in mats.values())
        bpw = 8 * (report["total_bytes"] - exact_bytes) / n_weights
        # round-to-nearest with our very layout and settings: our pipeline without calibration
        rtn = compress(pair.base_dir, pair.finetuned_dir, cfg, calibration=None, device=device, progress=False)
        with tempfile.TemporaryDirectory() as d:
            rtn.save_pretrained(d)
            rtn_bytes = delta_bytes_report(d)["total_bytes"]
            model = DeltaModel(pair.load_base(device))
            model.load_delta(d, delta_name="x")
            merged = model.merge_and_unload("x")
        s = _score(merged, pair, tok, ft, prompts, device)
        rows.append({"method": "RTN", "setting": name, "bytes": rtn_bytes, "ratio": fp16_bytes / rtn_bytes, **s, **_gains(s, s_base, s_ft)})
        log(f"[{time.perf_counter() - t0:6.1f}s]   RTN: {_fmt_row(rows[-1])}")
        for method in ("DARE", "SVD"):
            try:
                model, nbytes = _baseline_model(base, ft, mats, method, bpw, device)
            except ValueError as e:  # e.g. DARE's bitmask alone is larger than the budget
                log(f"[{time.perf_counter() - t0:6.1f}s]   {method}: cannot be built at this budget ({e})")
                continue
            total = nbytes + exact_bytes
            s = _score(model, pair, tok, ft, prompts, device)
            rows.append({"method": method, "setting": f"= {name} bytes", "bytes": total, "ratio": fp16_bytes / total,
                         **s, **_gains(s, s_base, s_ft)})
            log(f"[{time.perf_counter() - t0:6.1f}s]   {method}: {_fmt_row(rows[-1])}")
            del model
    if baselines:
        mats = _matrices(base, ft, list(delta.modules))
        model, nbytes = _baseline_model(base, ft, mats, "sign+scale", 1.0, device)
        total = nbytes + exact_bytes
        s = _score(model, pair, tok, ft, prompts, device)
        rows.append({"method": "sign+scale", "setting": "1 bit + 1 scale / matrix", "bytes": total,
                     "ratio": fp16_bytes / total, **s, **_gains(s, s_base, s_ft)})
        log(f"[{time.perf_counter() - t0:6.1f}s]   sign+scale: {_fmt_row(rows[-1])}")
    return {
        "pair": {"arch": arch, "size": size, "task": task, "params": pair.info["finetuned_params"],
                 "fp16_bytes": fp16_bytes, "base": s_base, "finetune": s_ft},
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "device": _device_name(device),
    }


def _fmt_row(r: dict) -> str:
    gk = r.get("gain_kept_em")
    return (f"ratio {r['ratio']:.1f}x, EM {r['exact_match']:.3f}"
            + (f" (gain kept {100 * gk:.1f}%)" if gk is not None else "")
            + f", NLL {r['task_nll']:.3f} (gain kept {100 * r['gain_kept_nll']:.1f}%), agree {r.get('agreement', float('nan')):.3f}, KL {r.get('kl', float('nan')):.4f}")


def _device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()})"


def to_markdown(result: dict, command: str) -> str:
    p = result["pair"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    lines = [
        f"Pair: {p['arch']} `{p['size']}` ({p['params']:,d} parameters), task `{p['task']}`. "
        f"Base: EM {p['base']['exact_match']:.3f}, NLL {p['base']['task_nll']:.3f}; "
        f"fine-tune: EM {p['finetune']['exact_match']:.3f}, NLL {p['finetune']['task_nll']:.3f}.",
        f"Hardware: {result['device']}; date {time.strftime('%Y-%m-%d')}; commit {commit}; command `{command}`; "
        f"{result['seconds']:.0f} s in all.",
        "",
        "| method | setting | bytes | ratio | EM | gain kept (EM) | NLL | gain kept (NLL) | greedy agreement | KL(ft‖c) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        gk = r.get("gain_kept_em")
        lines.append(
            f"| {r['method']} | {r['setting']} | {r['bytes']:,d} | {r['ratio']:.1f}× | {r['exact_match']:.3f} | "
            f"{'' if gk is None else f'{100 * gk:.1f}%'} | {r['task_nll']:.3f} | {100 * r['gain_kept_nll']:.1f}% | "
            f"{r.get('agreement', float('nan')):.3f} | {r.get('kl', float('nan')):.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, marker in (("ours", "o"), ("RTN", "s"), ("DARE", "^"), ("SVD", "v"), ("sign+scale", "x")):
        pts = sorted((r["ratio"], 100 * r.get("gain_kept_em", r["gain_kept_nll"])) for r in result["rows"] if r["method"] == method)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("whole-file compression ratio (fine-tune in 16-bit / delta bytes)")
    ax.set_ylabel("gain kept, exact match (%)")
    ax.axhline(95, color="grey", lw=0.5, ls="--")
    ax.axhline(90, color="grey", lw=0.5, ls=":")
    ax.set_title(f"{result['pair']['arch']} {result['pair']['size']}, task {result['pair']['task']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltazip bench quality", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/quality", help="pairs and results go here")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="tiny", help="tiny | small | 50m | 100m")
    p.add_argument("--task", default="sort")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # argparse formats help strings with %: the settings' names ("75% sparse") need theirs doubled
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SETTINGS)}".replace("%", "%%"))
    p.add_argument("--settings", nargs="*", help=f"a subset of: {', '.join(OUR_SETTINGS)}".replace("%", "%%"))
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--n-calibration", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", help="write JSON, Markdown and a plot with this path prefix")
    args = p.parse_args(argv)
    settings = list(QUICK_SETTINGS) if args.quick else args.settings
    result = run_quality(Path(args.workdir), arch=args.arch, size=args.size, task=args.task, device=args.device,
                         settings=settings, baselines=not args.no_baselines, n_calibration=args.n_calibration,
                         seq_len=args.seq_len)
    command = "deltazip bench quality " + " ".join(argv if argv is not None else __import__("sys").argv[3:])
    md = to_markdown(result, command.strip())
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(md)
        if plot(result, out.with_suffix(".png")):
            print(f"plot: {out.with_suffix('.png')}")
    return 0
