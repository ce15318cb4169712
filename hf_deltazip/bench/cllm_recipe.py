"""``python -m hf_deltazip.bench.cllm_recipe``: how reliably the consistency recipe keeps a fine-tune's task.

One consistency run can keep 100 % of a task's exact-match gain and the next, same command, 94 %
(BENCHMARKS.md section 9). This bench trains the consistency model of :mod:`hf_deltazip.cllm` several
times, per learning-rate schedule (``--schedules constant cosine``) and per seed (``--seeds 0 1 2``: the
order the examples are drawn in, and torch's seed), all from one set of Jacobi trajectories of the
fine-tune, and reports for each run:

- with ``--pair DIR`` (a real pair, :mod:`hf_deltazip.bench.real_pairs`): exact match and answer NLL on
  the pair's held-out examples, and the share of the fine-tune's gain over the base each keeps (the
  consistency model in 16 bits: compressing it changes these little, section 9);
- tokens accepted per Jacobi forward on the held-out prompts (no fallback), the speed the recipe buys;
- with ``--tiny`` (a tiny counting pair built on the spot, a CPU smoke test): the gain kept in mean
  token NLL of held-out continuations instead of the task scores.

Then, per schedule, the lowest and the mean gain kept over the seeds: a recipe meets a ">= 95 % kept"
target reliably when its lowest run does. Prints a table; ``--json PATH`` writes everything.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..cllm import ConsistencyConfig, collect_trajectories, mean_nll, tokens_per_forward, train_consistency
from .jacobi import _pair_prompts, counting_prompts, report, task_scores, tiny_pair
from .metrics import gain_kept


def _summary(runs: list, key: str) -> dict:
    out = {}
    for sched in dict.fromkeys(r["schedule"] for r in runs):
        vals = [r[key] for r in runs if r["schedule"] == sched and r.get(key) is not None and r[key] == r[key]]
        if vals:
            out[sched] = {"runs": len(vals), "lowest": min(vals), "mean": sum(vals) / len(vals)}
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    if args.tiny:
        base, ft = tiny_pair()
        prompts = counting_prompts(args.train_prompts + args.eval_prompts, 6, seed=500).tolist()
        tok, pad = None, 0
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.finetune)
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        ft = AutoModelForCausalLM.from_pretrained(args.finetune, dtype=torch.float32)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        prompts = _pair_prompts(tok, args.pair, args.base, args.train_prompts, args.eval_prompts)
    base, ft = base.to(device).eval(), ft.to(device).eval()
    train, held = prompts[:args.train_prompts], prompts[args.train_prompts:]
    gen_kw = dict(pad_token_id=pad)
    result = {"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "runs": []}

    t = time.perf_counter()
    trajectories = collect_trajectories(ft, train, block_size=args.block, max_new_tokens=args.new_tokens, **gen_kw)
    result["trajectory_s"] = time.perf_counter() - t
    result["finetune_tokens_per_forward"] = tokens_per_forward(ft, held, block_size=args.block,
                                                               max_new_tokens=args.new_tokens, **gen_kw)
    if args.tiny:
        eval_rows = [tr.prompt + tr.output for tr in collect_trajectories(
            ft, held, block_size=args.block, max_new_tokens=args.new_tokens, **gen_kw)]
        ref = {"base": mean_nll(base, eval_rows), "finetune": mean_nll(ft, eval_rows)}
    else:
        ref = task_scores(args.pair, args.base, tok, None, {"base": base, "finetune": ft}, [])
    result["reference"] = ref

    for sched in args.schedules:
        for seed in args.seeds:
            cfg = ConsistencyConfig(block_size=args.block, max_new_tokens=args.new_tokens, steps=args.steps,
                                    batch_size=args.batch_size, lr=args.lr, lr_schedule=sched,
                                    warmup_steps=args.warmup, ar_loss=args.ar_loss, seed=seed)
            torch.manual_seed(seed)
            t = time.perf_counter()
            losses = []
            cllm = train_consistency(ft, trajectories, cfg, pad_token_id=pad,
                                     log=lambda s, c, a: losses.append((s, c, a)))
            row = {"schedule": sched, "seed": seed, "train_s": time.perf_counter() - t, "losses": losses,
                   "tokens_per_forward": tokens_per_forward(cllm, held, block_size=args.block,
                                                            max_new_tokens=args.new_tokens, **gen_kw)}
            if args.tiny:
                nll = mean_nll(cllm, eval_rows)
                row.update(nll=nll, em_kept=None, nll_kept=gain_kept(-nll, -ref["base"], -ref["finetune"]))
            else:
                s = task_scores(args.pair, args.base, tok, None, {"cllm": cllm}, [], known=ref["scores"])
                row.update(scores=s["scores"]["cllm"], em_kept=s["gain_kept"]["cllm"]["exact_match"],
                           nll_kept=s["gain_kept"]["cllm"]["answer_nll"])
            result["runs"].append(row)
            print(f"  {sched} seed {seed}: EM kept {_pct(row['em_kept'])}, NLL kept {_pct(row['nll_kept'])}, "
                  f"{row['tokens_per_forward']:.2f} tokens/forward ({row['train_s']:.0f} s)", flush=True)
            del cllm
    result["em_kept"] = _summary(result["runs"], "em_kept")
    result["nll_kept"] = _summary(result["runs"], "nll_kept")
    return result


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f} %"


def to_table(result: dict) -> str:
    a = result["args"]
    nll_name = "NLL gain kept (held-out continuations)" if a["tiny"] else "answer NLL gain kept"
    lines = [f"consistency recipe: {a['steps']} steps of {a['batch_size']}, peak lr {a['lr']}, warm-up {a['warmup']}, "
             f"autoregressive loss {a.get('ar_loss', 'labels')}; "
             f"{a['train_prompts']} training prompts, block {a['block']}; "
             f"the fine-tune itself: {result['finetune_tokens_per_forward']:.2f} tokens/forward", "",
             f"| schedule | seed | EM gain kept | {nll_name} | tokens / forward | train s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['schedule']} | {r['seed']} | {_pct(r['em_kept'])} | {_pct(r['nll_kept'])} | "
                     f"{r['tokens_per_forward']:.2f} | {r['train_s']:.0f} |")
    lines += ["", "| schedule | runs | EM kept: lowest / mean | NLL kept: lowest / mean |", "|---|---:|---|---|"]
    for sched, n in result["nll_kept"].items():
        em = result["em_kept"].get(sched)
        em_s = f"{_pct(em['lowest'])} / {_pct(em['mean'])}" if em else "-"
        lines.append(f"| {sched} | {n['runs']} | {em_s} | {_pct(n['lowest'])} / {_pct(n['mean'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.cllm_recipe", description=__doc__.splitlines()[0])
    p.add_argument("--pair", help="a real pair folder (python -m hf_deltazip.bench.real_pairs --work WORK: WORK/dates); "
                                  "its base is WORK/base unless --base says otherwise")
    p.add_argument("--base", help="the base model folder (default: the folder beside --pair)")
    p.add_argument("--tiny", action="store_true", help="a tiny counting pair built here (CPU smoke test)")
    p.add_argument("--schedules", nargs="+", default=["constant", "cosine"], choices=["constant", "cosine"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-prompts", type=int, default=96,
                   help="prompts the consistency model trains on (32 overfit them: BENCHMARKS.md section 9)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for tokens per forward")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=0, help="warm-up steps (every schedule)")
    p.add_argument("--ar-loss", choices=["labels", "distill"], default="labels",
                   help="the autoregressive loss: the fine-tune's greedy tokens, or its whole distribution (KL)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if bool(args.pair) == bool(args.tiny):
        p.error("pass --pair DIR or --tiny")
    if args.pair:
        args.base = args.base or str(Path(args.pair).parent / "base")
        args.finetune = str(Path(args.pair) / "finetuned")
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps")
    report(run(args), to_table, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
