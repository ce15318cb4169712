"""``deltazip demo``: the whole product, offline, on a tiny model.

1. Train a tiny base on the Python standard library's source, then two full fine-tunes of it on two
   tasks (reverse a list of letters; sort it).
2. Compress each fine-tune's delta (4-bit and 3-bit, groups of 32).
3. Load both deltas onto one base and generate one batch whose rows ask for the first fine-tune,
   the second, and the plain base.
4. Print the compression ratios, the gain each compressed fine-tune keeps, and the outputs.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Optional


@contextlib.contextmanager
def quiet_other_libraries():
    """Turn off transformers' and huggingface_hub's progress bars and transformers' warnings, through
    their own switches, and put each back as it was on exit."""
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hub_bars = not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()  # which turns huggingface_hub's on too: restore those next
        if hub_bars:
            hub_utils.enable_progress_bars()
        else:
            hub_utils.disable_progress_bars()


def run_demo(workdir: Path, size: str = "tiny", device: str = "cpu", log=print, base_steps=300, ft_steps=300,
             keep: bool = True, progress: Optional[bool] = None) -> dict:
    """Run the demo in ``workdir``; ``progress``: tqdm bars while training and compressing (``None``: only on
    a terminal). Other libraries' progress bars and warnings are off while it runs."""
    with quiet_other_libraries():
        return _run_demo(workdir, size, device, log, base_steps, ft_steps, keep, progress)


def _run_demo(workdir, size, device, log, base_steps, ft_steps, keep, progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from .metrics import exact_match, gain_kept, mean_token_nll
    from .pairs import build_pair
    from ..compression import compress
    from ..config import DeltaZipConfig
    from ..format.folder import delta_bytes_report
    from ..modeling import DeltaModel

    t0 = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = {"reverse": DeltaZipConfig(bits=4, group_size=32, n_samples=32, seq_len=64),
            "sort": DeltaZipConfig(bits=3, group_size=32, n_samples=32, seq_len=64)}
    pairs = {}
    first = None
    for task in jobs:
        out = workdir / f"pair-{task}"
        if first is not None and not (out / "base").exists():
            # both fine-tunes start from one base: reuse it rather than train it again
            shutil.copytree(first / "base", out / "base")
            shutil.copytree(first / "tokenizer", out / "tokenizer")
        log(f"[{time.perf_counter() - t0:5.1f}s] building the base and the {task!r} fine-tune ({size}) in {out}")
        pairs[task] = build_pair(out, arch="llama", size=size, task=task, device=device,
                                 base_steps=base_steps, ft_steps=ft_steps, progress=progress)
        first = first or out

    results = {}
    deltas = {}
    for task, config in jobs.items():
        pair = pairs[task]
        tok = pair.load_tokenizer()
        calib = pair.calibration_texts(64)  # disjoint from the held-out examples
        log(f"[{time.perf_counter() - t0:5.1f}s] compressing the {task!r} delta: bits={config.bits}, sparsity={config.sparsity}")
        delta = compress(pair.base_dir, pair.finetuned_dir, config, calibration=calib, tokenizer=tok,
                         progress=progress if progress is not None else sys.stderr.isatty())
        folder = workdir / f"delta-{task}"
        delta.save_pretrained(folder)
        deltas[task] = folder
        report = delta_bytes_report(folder)
        results[task] = {"bytes": report["total_bytes"], "fp16_bytes": report["finetune_fp16_bytes"],
                         "ratio": report["ratio"]}

    base = AutoModelForCausalLM.from_pretrained(pairs["reverse"].base_dir, dtype=torch.float32)
    model = DeltaModel(base)
    for task, folder in deltas.items():
        model.load_delta(folder, delta_name=task)
    log(f"[{time.perf_counter() - t0:5.1f}s] loaded deltas {model.deltas} onto one base")

    for task in jobs:
        pair = pairs[task]
        tok = pair.load_tokenizer()
        examples = pair.eval_examples
        scores = pair.info["scores"]
        model.set_delta(task)
        em_c = exact_match(model, tok, examples, max_new_tokens=16)
        nll_c = mean_token_nll(model, tok, pair.eval_texts)
        model.set_delta(None)
        em_b, em_f = scores["base"]["exact_match"], scores["finetuned"]["exact_match"]
        nll_b, nll_f = scores["base"]["task_nll"], scores["finetuned"]["task_nll"]
        results[task].update(exact_match_base=em_b, exact_match_finetune=em_f, exact_match_compressed=em_c,
                             gain_kept=gain_kept(em_c, em_b, em_f) if em_f != em_b else None,
                             nll_base=nll_b, nll_finetune=nll_f, nll_compressed=nll_c,
                             gain_kept_nll=gain_kept(-nll_c, -nll_b, -nll_f) if nll_f != nll_b else None)

    tok = pairs["reverse"].load_tokenizer()
    prompts = [pairs["reverse"].eval_examples[0], pairs["sort"].eval_examples[0], pairs["reverse"].eval_examples[1]]
    rows = ["reverse", "sort", None]
    enc = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    out = model.generate(ids, attention_mask=mask, delta_names=rows, max_new_tokens=16, do_sample=False,
                         pad_token_id=pad, eos_token_id=tok.eos_token_id)
    generations = []
    for i, row in enumerate(rows):
        text = tok.decode(out[i, width:], skip_special_tokens=True).strip()
        question = prompts[i].prompt.split("<|user|>")[-1].split(tok.eos_token)[0].strip()
        generations.append({"delta": row, "prompt": question, "output": text, "expected": prompts[i].answer})

    log("")
    log("Exact match (EM) and mean token NLL on held-out task examples; gain kept = (compressed - base) / (fine-tune - base).")
    log(f"{'fine-tune':<9} {'delta bytes':>11} {'16-bit bytes':>12} {'ratio':>6} | {'EM base/ft/compressed':>22} {'kept':>5} | "
        f"{'NLL base/ft/compressed':>23} {'kept':>5}")
    for task, r in results.items():
        gk = f"{100 * r['gain_kept']:.0f}%" if r["gain_kept"] is not None else "n/a"
        gn = f"{100 * r['gain_kept_nll']:.0f}%" if r["gain_kept_nll"] is not None else "n/a"
        em = f"{r['exact_match_base']:.2f}/{r['exact_match_finetune']:.2f}/{r['exact_match_compressed']:.2f}"
        nll = f"{r['nll_base']:.2f}/{r['nll_finetune']:.2f}/{r['nll_compressed']:.2f}"
        log(f"{task:<9} {r['bytes']:>11,d} {r['fp16_bytes']:>12,d} {r['ratio']:>5.1f}x | {em:>22} {gk:>5} | {nll:>23} {gn:>5}")
    mem = model.memory_footprint()
    log(f"\nmemory: base {mem['base']:,d} bytes; " + ", ".join(f"{n} {b:,d} bytes" for n, b in mem["deltas"].items()))
    log("\none generate() call, one batch, a different delta per row:")
    for g in generations:
        name = g["delta"] or "(base)"
        log(f"  {name:<8} {g['prompt']!r:<28} -> {g['output']!r}   (task answer: {g['expected']!r})")
    where = f"files in {workdir}" if keep else "the temporary files are removed (pass --workdir to keep them)"
    log(f"\ndone in {time.perf_counter() - t0:.1f}s; {where}")
    return {"results": results, "generations": generations, "seconds": time.perf_counter() - t0}
