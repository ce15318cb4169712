"""``python -m hf_deltazip.bench.quantized_base``: deltas over a bitsandbytes base (issue 16).

Two measurements:

* ``quality --base DIR --finetune DIR``: gain kept (negative mean token NLL on held-out text of the
  fine-tune's domain, REFERENCE section 3) in three cases at the same delta setting: the bf16 base with
  the ordinary delta; the 4-bit base with the ordinary delta; the 4-bit base with a delta compressed for
  the quantized base (``compress(..., base_quantization=...)``). Gain is measured against the bf16 base
  and the bf16 fine-tune, so a 4-bit case also pays for the base's own rounding. Target: a 4-bit case
  keeps at least 95 % of what the bf16 base keeps.
* ``speed``: GPU memory and decode tokens/s of an 8B-shaped Llama (random weights: speed needs shapes,
  not training) with 16 random 4-bit deltas, one per row, on a bf16, an 8-bit and a 4-bit (nf4, double
  quantization) base: ``generate`` (eager) and the DecodeEngine (CUDA graphs where the layers allow;
  bitsandbytes layers run its steps eagerly). Before timing, one layer's mixed batch is checked against
  the dequantized base plus each row's delta.

Both print a table and take ``--json PATH``. They need bitsandbytes and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from .decode import SHAPES, build_base, random_delta

QUANT = ("bf16", "int8", "nf4")


def _bnb_config(kind: str, dtype=torch.bfloat16):
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- quality
def _texts(path) -> list:
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return [r if isinstance(r, str) else r.get("text") or json.dumps(r) for r in rows]
    return [t for t in p.read_text().split("\n\n") if t.strip()]


def run_quality(base_dir: str, finetune_dir: str, eval_texts: list, *, calibration=None, quant: str = "nf4",
                bits: int = 4, group_size: int = 128, sparsity=None, device: str = "cuda", log=print) -> dict:
    """Gain kept in the three cases (see the module docstring); scores are mean token NLL (nats).

    ``eval_texts``: strings (tokenized with the fine-tune's tokenizer) or lists of token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..compression import compress
    from ..config import DeltaZipConfig
    from ..modeling import DeltaModel
    from .metrics import gain_kept, mean_token_nll

    tok = AutoTokenizer.from_pretrained(finetune_dir) if isinstance(eval_texts[0], str) else None
    cfg = DeltaZipConfig(bits=bits, group_size=group_size, **({"sparsity": sparsity} if sparsity else {}))
    load = dict(dtype=torch.bfloat16)

    def nll(model):
        return mean_token_nll(model, tok, eval_texts) if tok is not None else mean_token_nll(model, eval_texts)

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(base_dir, **load).to(device).eval()
    ft = AutoModelForCausalLM.from_pretrained(finetune_dir, **load).to(device).eval()
    scores = {"base bf16": nll(base), "fine-tune bf16": nll(ft)}
    log(f"[{time.perf_counter() - t0:6.1f}s] base {scores['base bf16']:.4f}, fine-tune {scores['fine-tune bf16']:.4f}")
    plain = compress(base, ft, cfg, calibration=calibration, tokenizer=tok, device=device, progress=False)
    for_q = compress(base_dir, ft, cfg, calibration=calibration, tokenizer=tok, device=device, progress=False,
                     base_quantization=_bnb_config(quant), **load)
    del ft
    log(f"[{time.perf_counter() - t0:6.1f}s] compressed: ordinary and for the {quant} base")
    dm = DeltaModel(base)
    dm.add_delta(plain, "plain")
    scores["bf16 base + delta"] = nll(_routed(dm, "plain"))
    del dm, base
    _free()
    qbase = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=_bnb_config(quant), device_map={"": device},
                                                 **load).eval()
    scores[f"{quant} base alone"] = nll(qbase)
    qm = DeltaModel(qbase)
    qm.add_delta(plain, "plain")
    qm.add_delta(for_q, "for_q")
    scores[f"{quant} base + delta"] = nll(_routed(qm, "plain"))
    scores[f"{quant} base + delta for {quant}"] = nll(_routed(qm, "for_q"))
    log(f"[{time.perf_counter() - t0:6.1f}s] scored")
    b, f = -scores["base bf16"], -scores["fine-tune bf16"]
    gains = {k: gain_kept(-v, b, f) for k, v in scores.items() if "+" in k or "alone" in k}
    ref = gains["bf16 base + delta"]
    rows = [{"case": k, "nll": scores[k], "gain_kept": g, "of_bf16": g / ref if ref else float("nan")}
            for k, g in gains.items()]
    return {"base": str(base_dir), "finetune": str(finetune_dir), "quantization": quant,
            "delta": f"{bits}-bit g{group_size}" + (f", {sparsity} sparse" if sparsity else ""),
            "eval_texts": len(eval_texts), "scores": scores, "rows": rows, "seconds": time.perf_counter() - t0}


def _routed(dm, name):
    dm.set_delta(name)
    return dm


# ---------------------------------------------------------------------------------------- speed
def quantize_decoder_linears(model, kind: str):
    """Replace every linear layer of the decoder blocks by a bitsandbytes one made from its weight (what
    loading with a ``BitsAndBytesConfig`` gives; the LM head stays 16-bit, as transformers keeps it)."""
    import bitsandbytes as bnb

    from ..modeling.arch import find_decoder_layers, linear_modules

    device = next(model.parameters()).device
    _, layers = find_decoder_layers(model)
    for layer in layers:
        for rel, mod in list(linear_modules(layer).items()):
            w = mod.weight.data.cpu()  # bitsandbytes quantizes when a weight moves from the CPU to the GPU
            with torch.device("meta"):
                if kind == "int8":
                    q = bnb.nn.Linear8bitLt(mod.in_features, mod.out_features, bias=False, has_fp16_weights=False,
                                            threshold=6.0)
                else:
                    q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=False, compute_dtype=torch.bfloat16,
                                          quant_type=kind, compress_statistics=True)
            if kind == "int8":
                q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False).to(device)
            else:
                q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type=kind, compress_statistics=True,
                                             module=q).to(device)
            parent_name, _, child = rel.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, q)
            del mod, w
        _free()
    return model


def check_one_layer(dm, rows: int) -> float:
    """Max |quantized-base layer output - (dequantized base + each row's delta)| on a mixed batch of one layer."""
    import torch.nn.functional as F

    from ..modeling.layers import DeltaLinear

    layer = next(m for m in dm.base_model.modules() if isinstance(m, DeltaLinear) and m.packed)
    names = [dm.deltas[i % len(dm.deltas)] for i in range(rows)]
    x = torch.randn(rows, 1, layer.in_features, device=layer.base_weight_nk().device, dtype=torch.bfloat16)
    with torch.no_grad(), dm.route(names):
        got = layer(x).float()
    slots = dm.cache.slots_for(names)
    with torch.no_grad():
        want = torch.stack([F.linear(x[i].float(), layer.merged_weight(s, torch.float32)) for i, s in enumerate(slots)])
    return float((got - want).abs().max() / want.abs().max())


def run_speed(*, shape="8b", layers=None, deltas=16, rows=16, prompt_len=64, new_tokens=32, engine_steps=32,
              bits=4, group_size=128, bases=QUANT, device="cuda", log=print) -> dict:
    """One row per base kind; ``device="cpu"`` with ``shape="tiny"`` is a smoke test (memory then reads 0)."""
    from ..modeling import DeltaModel
    from ..modeling.layers import map_packed
    from .decode import engine_tokens_per_s, time_generate

    cuda = device.startswith("cuda")
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape, "layers": layers or SHAPES[shape]["num_hidden_layers"],
           "deltas": deltas, "rows": rows, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "delta_format": f"{bits}-bit g{group_size}", "rows_table": []}
    t0 = time.perf_counter()

    def phase(kind, what):  # where the time goes (an 8B quantized row once ran for minutes unexplained)
        log(f"[{time.perf_counter() - t0:7.1f}s] {kind}: {what}")

    for kind in bases:
        _free()
        base = build_base(shape, device, layers)
        phase(kind, "base built")
        # shapes from the float base; kept in host memory until each is added (16 of them are ~56 GB at 8B)
        made = [{k: map_packed(p, lambda t: t.cpu()) for k, p in random_delta(base, bits, group_size, seed=i).items()}
                for i in range(deltas)]
        phase(kind, f"{deltas} random deltas made")
        if kind != "bf16":
            quantize_decoder_linears(base, kind)
            phase(kind, "decoder linears quantized")
        dm = DeltaModel(base)
        dm.configure_cache(max_resident=deltas + 2)
        for i in range(deltas):
            dm.add_delta(made[i], f"d{i}")
            made[i] = None
        _free()
        phase(kind, "deltas added")
        check = check_one_layer(dm, rows)
        phase(kind, "one layer checked")
        fp = dm.memory_footprint()
        resident = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
        names = [f"d{i % deltas}" for i in range(rows)]
        ids = torch.randint(0, 1000, (rows, prompt_len), device=device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time_generate(dm, ids, names, new_tokens)
        phase(kind, "generate timed")
        e = engine_tokens_per_s(dm, names, rows, prompt_len, engine_steps)
        row = {"base": kind, "base_gib": fp["base"] / 2**30, "deltas_gib": sum(fp["deltas"].values()) / 2**30,
               "resident_gib": resident, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               "generate_tokens_per_s": rows * new_tokens / t, "engine_tokens_per_s": e,
               "graph_safe": dm.graph_safe(), "check_rel_err": check}
        out["rows_table"].append(row)
        log(f"{kind:5s}: check {check:.1e}, resident {resident:.1f} GiB, generate {row['generate_tokens_per_s']:.1f} tok/s, "
            f"engine {e:.1f} tok/s")
        del dm, base
    return out


# ---------------------------------------------------------------------------------------- printing
def _table(result: dict) -> str:
    if "scores" in result:
        lines = ["| case | NLL | gain kept | of the bf16 case |", "|---|---:|---:|---:|"]
        lines += [f"| {r['case']} | {r['nll']:.4f} | {r['gain_kept']:.3f} | {r['of_bf16']:.3f} |" for r in result["rows"]]
        return "\n".join(lines)
    lines = ["| base | base GiB | deltas GiB | resident GiB | peak GiB | generate tok/s | engine tok/s | graphs | check |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {r['base']} | {r['base_gib']:.2f} | {r['deltas_gib']:.2f} | {r['resident_gib']:.2f} | {r['peak_gib']:.2f} | "
              f"{r['generate_tokens_per_s']:.1f} | {r['engine_tokens_per_s']:.1f} | {r['graph_safe']} | {r['check_rel_err']:.1e} |"
              for r in result["rows_table"]]
    return "\n".join(lines)


def _quality_inputs(parser, args) -> tuple:
    """(base, fine-tune, evaluation texts, calibration) from ``--pair`` or the explicit options."""
    if args.pair:
        from .real_pairs import real_pair_texts

        texts, calibration = real_pair_texts(args.pair)
        pair = Path(args.pair)
        return (args.base or str(pair.parent / "base"), args.finetune or str(pair / "finetuned"),
                _texts(args.eval_texts) if args.eval_texts else texts, args.calibration or calibration)
    missing = [f"--{n.replace('_', '-')}" for n in ("base", "finetune", "eval_texts") if not getattr(args, n)]
    if missing:
        parser.error(f"quality needs --pair DIR, or {', '.join(missing)}")
    return args.base, args.finetune, _texts(args.eval_texts), args.calibration


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.quantized_base", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality", help="gain kept: bf16 base, 4-bit base, 4-bit base with a delta made for it")
    q.add_argument("--pair", help="a real pair folder (python -m hf_deltazip.bench.real_pairs --work WORK: WORK/dates): "
                                  "its fine-tune, evaluation texts and calibration texts; the base defaults to WORK/base")
    q.add_argument("--base")
    q.add_argument("--finetune")
    q.add_argument("--eval-texts", help="held-out text of the fine-tune's domain (.txt, blank-line separated, or .jsonl)")
    q.add_argument("--calibration", help="calibration file for compress (.txt / .jsonl); default: round-to-nearest")
    q.add_argument("--quant", choices=["nf4", "fp4"], default="nf4")
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=128)
    q.add_argument("--sparsity")
    s = sub.add_parser("speed", help="memory and decode tokens/s, 8B shapes, 16 deltas, bf16 / 8-bit / 4-bit base")
    s.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    s.add_argument("--layers", type=int, help="fewer decoder layers (say so when reporting)")
    s.add_argument("--deltas", type=int, default=16)
    s.add_argument("--rows", type=int, default=16)
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument("--engine-steps", type=int, default=32)
    s.add_argument("--bases", nargs="+", choices=QUANT, default=list(QUANT))
    for a in (q, s):
        a.add_argument("--json")
    args = p.parse_args(argv)
    inputs = _quality_inputs(p, args) if args.what == "quality" else None  # argument errors before the GPU check
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this benchmark is meant for one")
    if inputs is not None:
        base, finetune, texts, calibration = inputs
        result = run_quality(base, finetune, texts, calibration=calibration, quant=args.quant,
                             bits=args.bits, group_size=args.group_size, sparsity=args.sparsity)
    else:
        result = run_speed(shape=args.shape, layers=args.layers, deltas=args.deltas, rows=args.rows,
                           new_tokens=args.new_tokens, engine_steps=args.engine_steps, bases=args.bases,
                           log=lambda m: print(m, flush=True))
    print(_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
