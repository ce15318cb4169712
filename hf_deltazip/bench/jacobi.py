"""``python -m hf_deltazip.bench.jacobi``: Jacobi decoding of an ordinary and a consistency-trained delta.

For a base and a full fine-tune (``--base DIR --finetune DIR``, transformers folders; ``--tiny`` builds a
tiny counting pair on the spot for a CPU smoke test):

1. a consistency-trained copy of the fine-tune (:mod:`hf_deltazip.cllm`; trained here on ``--train-prompts``
   prompts, or read from ``--cllm DIR``);
2. both compressed as deltas over the base at each of ``--bits`` (4 and 2);
3. for each delta, at batch 1 (each evaluation prompt alone) and batch ``--batch`` (left-padded): greedy
   ``generate`` and Jacobi decoding, wall-clock time (median of ``--repeats`` calls of each, the two kinds
   run in turn so that a drift of the host's speed weighs on both), tokens accepted per forward,
   and every output compared with greedy token for token. A mismatch whose first differing token is
   decided by rounding (see :func:`_ties`) is counted as such, with its logit gap. The prompts of one
   delta and batch size run one after another on one ``DeltaModel``, whose Jacobi fallback gate is kept per
   delta between calls (as a deployed model's is): the warm-up run and the earlier prompts teach it;
4. the gain each delta keeps: mean token NLL on held-out prompts + the fine-tune's greedy continuations,
   against base and fine-tune. A consistency model is trained on such continuations and can score them
   better than the fine-tune itself (over 100 %), so this measure cannot show what it lost;
5. with ``--pair DIR`` (a real pair, :mod:`hf_deltazip.bench.real_pairs`), the *task* gain each model and
   delta keeps on the pair's held-out examples: exact match and answer NLL, against base and fine-tune.
   ``--pair`` also supplies ``--base`` (the folder beside it) and ``--finetune``.

Prints one correctness line and a table; ``--json PATH`` writes everything.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from ..cllm import ConsistencyConfig, collect_trajectories, mean_nll, train_consistency
from ..config import DeltaZipConfig


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_pair(fa, fb, repeats: int, warmup: bool):
    """``(output of fa, output of fb, seconds of each fa call, seconds of each fb call)``: the two run in turn,
    ``fa fb fb fa fa fb ...``, so that a drift of the host's speed during the measurement (another process,
    clock changes) weighs on both alike; one untimed call of each first if ``warmup``."""
    if warmup:
        fa()
        fb()
    outs, times = [None, None], ([], [])
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for k in order:
            fn = (fa, fb)[k]
            _sync()
            t = time.perf_counter()
            outs[k] = fn()
            _sync()
            times[k].append(time.perf_counter() - t)
    return outs[0], outs[1], times[0], times[1]


def tiny_pair(steps: int = 60):
    """A random tiny llama and a copy fine-tuned to count (3, 4, 5, ...): for smoke tests on the CPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ft = copy.deepcopy(base).train()
    opt = torch.optim.Adam(ft.parameters(), lr=1e-2)
    for step in range(steps):
        ids = counting_prompts(16, 24, seed=step)
        loss = ft(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return base, ft.eval()


def counting_prompts(n: int, length: int, seed: int) -> torch.Tensor:
    start = torch.randint(0, 120, (n, 1), generator=torch.Generator().manual_seed(seed))
    return 3 + (start + torch.arange(length)) % 120


def _text_prompts(tokenizer, path, n: int, tokens: int) -> list:
    if path:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
        records = [json.loads(ln) if ln.lstrip().startswith("{") else {"prompt": ln} for ln in lines]
        texts = [r.get("prompt") or r.get("text") or "" for r in records]
    else:
        from .pairs import stdlib_documents

        texts = [d[i:i + 4 * tokens] for d in stdlib_documents(seed=0, max_chars=200_000, held_out=True)
                 for i in range(0, len(d) - 4 * tokens, 8 * tokens)]
    rows = [tokenizer(t, add_special_tokens=True)["input_ids"][:tokens] for t in texts]
    rows = [r for r in rows if len(r) >= 4]
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} prompts found, {n} needed: pass --prompts FILE with more lines")
    return rows[:n]


def _pair_prompts(tokenizer, pair_dir, base_dir, n_train: int, n_eval: int) -> list:
    """Token ids of a real pair's own task prompts: ``n_train`` from its calibration stream (the text up
    to and including the last ``Answer:``), then ``n_eval`` of its held-out evaluation prompts."""
    from .real_pairs import load_real_pair

    pair = load_real_pair(pair_dir, base_dir=base_dir)
    marker = "Answer:"
    train = [t[: t.rindex(marker) + len(marker)] for t in pair.calibration if marker in t][:n_train]
    held = [ex.prompt for ex in pair.eval_examples][:n_eval]
    if len(train) < n_train or len(held) < n_eval:
        raise SystemExit(f"the pair has {len(train)} calibration and {len(held)} evaluation prompts; "
                         f"{n_train} and {n_eval} were asked for (--train-prompts / --eval-prompts)")
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in train + held]


def _left_pad(rows: list, pad: int, device):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _trim_pad(row: torch.Tensor, pad, width: int) -> torch.Tensor:
    """``row`` without the padding after its last generated token (the prompt, left-padded, is kept)."""
    if pad is None:
        return row
    keep = (row[width:] != pad).nonzero()
    return row[: width + (int(keep[-1]) + 1 if len(keep) else 0)]


def _ties(dm, name, ids, mask, greedy, jacobi, max_new_tokens: int, gen_kw: dict, details: list = None) -> tuple:
    """(rows whose Jacobi output differs from greedy, of which the first differing token is *within rounding*).

    A Jacobi step computes a block of positions in one forward, greedy one position per forward; in
    16-bit arithmetic the two orders round differently. At a row's first differing position the greedy
    logits (as greedy computed them, one token at a time) are compared with the same position computed
    by one forward over the whole prefix: the difference is counted as within rounding when the gap
    between greedy's token and Jacobi's token is no larger than the largest change of any logit between
    those two computations of the same thing. With ``details``, one record per differing row is appended."""
    differ = ties = 0
    width = mask.shape[1]
    pad = gen_kw.get("pad_token_id")
    step_logits = None
    for r in range(greedy.shape[0]):
        # a batch's tensor is as wide as its longest row: a row that ended early is padded to that width,
        # so the same row comes back wider when another row of its batch ran longer. Compare contents.
        g, j = _trim_pad(greedy[r], pad, width), _trim_pad(jacobi[r], pad, width)
        if g.shape == j.shape and torch.equal(g, j):
            continue
        differ += 1
        n = min(g.shape[0], j.shape[0])
        bad = (g[:n] != j[:n]).nonzero()
        if not len(bad):  # one stopped earlier: a real difference
            if details is not None:
                details.append({"delta": name, "new_token": n - width, "logit_gap": None, "rounding": None,
                                "within_rounding": False, "kind": "length"})
            continue
        p = int(bad[0])
        if step_logits is None:  # greedy again, untimed, keeping the logits of every step
            out = dm.generate(ids, attention_mask=mask, delta_names=[name] * ids.shape[0], do_sample=False,
                              max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True, **gen_kw)
            if not torch.equal(out.sequences, greedy):
                raise RuntimeError("greedy decoding is not deterministic here: the outputs cannot be compared")
            step_logits = out.logits
        stepped = step_logits[p - width][r].float()
        row_mask = torch.cat([mask[r], torch.ones(p - width, dtype=mask.dtype, device=mask.device)])[None, :p]
        with torch.no_grad():
            whole = dm(input_ids=g[None, :p], attention_mask=row_mask, delta_names=[name]).logits[0, -1].float()
        gap = float(stepped[int(g[p])] - stepped[int(j[p])])
        noise = float((stepped - whole).abs().max())
        within = gap <= noise
        ties += within
        if details is not None:
            details.append({"delta": name, "new_token": p - width, "logit_gap": gap, "rounding": noise,
                            "within_rounding": bool(within), "kind": "token"})
    return differ, ties


def run(args) -> dict:
    from .. import compress
    from ..modeling import DeltaModel

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.tiny:
        base, ft = tiny_pair()
        pad = 0
        prompts = counting_prompts(args.train_prompts + args.eval_prompts, 6, seed=500).tolist()
        gen_kw = dict(pad_token_id=0)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.finetune)
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        ft = AutoModelForCausalLM.from_pretrained(args.finetune, dtype=torch.float32)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        if args.task_prompts:
            prompts = _pair_prompts(tok, args.pair, args.base, args.train_prompts, args.eval_prompts)
        else:
            prompts = _text_prompts(tok, args.prompts, args.train_prompts + args.eval_prompts, args.prompt_tokens)
        gen_kw = dict(pad_token_id=pad)
    base, ft = base.to(device).eval(), ft.to(device).eval()
    train, held = prompts[:args.train_prompts], prompts[args.train_prompts:]
    result = {"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "seconds": {}}

    t = time.perf_counter()
    trajectories = collect_trajectories(ft, train, block_size=args.block, max_new_tokens=args.new_tokens, **gen_kw)
    if args.cllm:
        from transformers import AutoModelForCausalLM

        cllm = AutoModelForCausalLM.from_pretrained(args.cllm, dtype=torch.float32).to(device).eval()
    else:
        cfg = ConsistencyConfig(block_size=args.block, max_new_tokens=args.new_tokens, steps=args.cllm_steps,
                                batch_size=args.cllm_batch, lr=args.cllm_lr, lr_schedule=args.cllm_schedule,
                                warmup_steps=args.cllm_warmup, ar_loss=args.cllm_ar_loss)
        cllm = train_consistency(ft, trajectories, cfg, pad_token_id=pad,
                                 log=lambda s, c, a: print(f"  consistency step {s}: loss {c:.3f}, AR loss {a:.3f}"))
        if args.save_cllm:
            cllm.save_pretrained(args.save_cllm)
    result["seconds"]["cllm"] = time.perf_counter() - t

    # held-out text of the domain for the gain kept: the fine-tune's own greedy continuations of held-out prompts
    eval_rows = [t.prompt + t.output for t in collect_trajectories(ft, held, block_size=args.block,
                                                                    max_new_tokens=args.new_tokens, **gen_kw)]
    calib = [tr.prompt + tr.output for tr in trajectories]
    nll = {"base": mean_nll(base, eval_rows), "finetune": mean_nll(ft, eval_rows), "cllm (16-bit)": mean_nll(cllm, eval_rows)}

    t = time.perf_counter()
    deltas = {}
    for label, model in (("finetune", ft), ("cllm", cllm)):
        for bits in args.bits:
            cfg = DeltaZipConfig(bits=bits, group_size=32 if args.tiny else 128, seq_len=max(len(c) for c in calib))
            deltas[f"{label}-{bits}bit"] = compress(base, model, cfg, calibration=calib, progress=False)
    result["seconds"]["compress"] = time.perf_counter() - t
    dm = DeltaModel(base.to(dtype))
    for name, delta in deltas.items():
        dm.add_delta(delta, name)
    names = list(deltas)
    for name in names:
        with dm.route([name]):
            nll[name] = mean_nll(dm.base_model, eval_rows)
    gain = {k: (nll["base"] - v) / (nll["base"] - nll["finetune"]) for k, v in nll.items()}
    result["nll"], result["gain_kept"] = nll, gain
    if args.pair:
        result["task"] = task_scores(args.pair, args.base, tok, dm, {"finetune": ft, "cllm (16-bit)": cllm}, names)

    rows, checked, differ, ties, details = [], 0, 0, 0, []
    for name in names:
        for batch in args.batch:
            groups = [[p] for p in held[:args.b1_prompts]] if batch == 1 else \
                [held[i:i + batch] for i in range(0, len(held), batch)]
            g_time = j_time = 0.0
            accepted = forwards = new_tokens = steps = wide_steps = 0
            trace = []  # per call: the gate's view of each step of the last timed run
            g_runs, j_runs = [], []  # per group: the seconds of every timed call
            for gi, group in enumerate(groups):
                ids, mask = _left_pad(group, pad, device)
                names_b = [name] * len(group)
                greedy, jac, tgs, tjs = _timed_pair(
                    lambda: dm.generate(ids, attention_mask=mask, delta_names=names_b, do_sample=False,
                                        max_new_tokens=args.new_tokens, **gen_kw),
                    lambda: dm.generate(ids, attention_mask=mask, delta_names=names_b, decoding="jacobi",
                                        jacobi_block_size=args.block, max_new_tokens=args.new_tokens,
                                        min_accept=args.min_accept, return_dict_in_generate=True, **gen_kw),
                    args.repeats, gi == 0)
                g_time, j_time = g_time + statistics.median(tgs), j_time + statistics.median(tjs)
                g_runs.append(tgs)
                j_runs.append(tjs)
                accepted += sum(jac.stats.new_tokens)
                forwards += sum(f + 1 for f in jac.stats.row_forwards)
                steps, wide_steps = steps + jac.stats.forwards, wide_steps + jac.stats.jacobi_forwards
                trace.append(gate_trace(jac.stats.step_accepts))
                checked += len(group)
                d, ti = _ties(dm, name, ids, mask, greedy, jac.sequences, args.new_tokens, gen_kw, details)
                new_tokens += int((greedy[:, ids.shape[1]:] != pad).sum())
                differ, ties = differ + d, ties + ti
            # decode steps after the prompt's forward, and how many of them were wide (the fallback gate decides)
            rows.append(dict(delta=name, batch=batch, greedy_new_tokens=new_tokens, tokens_per_forward=accepted / max(forwards, 1),
                             greedy_s=g_time, jacobi_s=j_time, speedup=g_time / j_time, steps=steps, wide_steps=wide_steps,
                             gate_trace=" | ".join(trace), greedy_runs_s=g_runs, jacobi_runs_s=j_runs))
            print(f"  {name}, batch {batch}: {rows[-1]['tokens_per_forward']:.2f} tokens/forward, "
                  f"{wide_steps} of {steps} steps wide, greedy {g_time:.3f} s, "
                  f"Jacobi {j_time:.3f} s ({rows[-1]['speedup']:.2f}x); {differ} of {checked} outputs differ so far; "
                  f"steps: {rows[-1]['gate_trace']}", flush=True)
    result["rows"] = rows
    result["outputs_checked"], result["outputs_differ"], result["differ_within_rounding"] = checked, differ, ties
    result["differences"] = details
    return result


def gate_trace(step_accepts) -> str:
    """One call's steps as the Jacobi gate saw them: a Jacobi step as the mean tokens its rows matched
    (``4.5``), a one-token step as ``.``; e.g. ``1.0 4.5 . . . . 5.0``."""
    return " ".join("." if a is None else f"{a:.1f}" for a in step_accepts)


def task_scores(pair_dir, base_dir, tokenizer, dm, models: dict, delta_names: list, known: Optional[dict] = None) -> dict:
    """Exact match, text NLL (question and answer) and answer NLL on a real pair's held-out examples for the base (``dm`` with no delta),
    each plain model of ``models`` and each delta of ``dm``; gain kept of each against base and ``"finetune"``.
    ``dm=None``: no deltas, and ``models`` (or ``known``) holds the plain base as ``"base"``. ``known``: scores
    measured before (``{label: score}``, as this returns under ``"scores"``), not measured again."""
    from .metrics import answer_nll, exact_match, gain_kept, mean_token_nll
    from .real_pairs import load_real_pair

    pair = load_real_pair(pair_dir, base_dir=base_dir)
    # the answers as the pair trains them: after a space, then end-of-sequence
    answers = [(ex.prompt, " " + ex.answer + (tokenizer.eos_token or "")) for ex in pair.eval_examples]

    def score(model):
        return {"exact_match": exact_match(model, tokenizer, pair.eval_examples, max_new_tokens=pair.max_new_tokens),
                "task_nll": mean_token_nll(model, tokenizer, pair.eval_texts),
                "answer_nll": answer_nll(model, tokenizer, answers)}

    scores = dict(known or {})
    if dm is not None:
        for name in [None, *delta_names]:
            dm.set_delta(name)
            scores[name or "base"] = score(dm)
        dm.set_delta(None)
    elif "base" not in models and "base" not in scores:
        raise ValueError("task_scores: pass a DeltaModel as dm, or the base among models")
    for label, model in models.items():
        if label not in scores:
            scores[label] = score(model)
    base, ft = scores["base"], scores["finetune"]

    def share(c, b, f):  # NaN where the fine-tune does not beat the base (nothing to keep)
        return gain_kept(c, b, f) if f != b else float("nan")

    kept = {k: {"exact_match": share(v["exact_match"], base["exact_match"], ft["exact_match"]),
                "task_nll": share(-v["task_nll"], -base["task_nll"], -ft["task_nll"]),
                "answer_nll": share(-v["answer_nll"], -base["answer_nll"], -ft["answer_nll"])}
            for k, v in scores.items()}
    return {"pair": str(pair_dir), "task": pair.task, "examples": len(pair.eval_examples), "scores": scores,
            "gain_kept": kept}


def to_table(result: dict) -> str:
    lines = [f"correctness: {result['outputs_checked'] - result['outputs_differ']}/{result['outputs_checked']} outputs equal "
             f"to greedy ({result['outputs_differ']} differ, {result['differ_within_rounding']} of them within rounding)",
             "", "| delta | batch | greedy tokens | tokens/forward | wide steps | greedy s | jacobi s | speed-up | gain kept |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    other = [d for d in result.get("differences", []) if not d["within_rounding"]]
    if other:
        lines.insert(1, "differences beyond rounding: first differing token at new token "
                        + ", ".join(f"{d['new_token']} (gap {d['logit_gap']:.3g}, rounding {d['rounding']:.3g})"
                                    if d.get("kind", "token") == "token" else f"{d['new_token']} (one output ended there)"
                                    for d in other))
    for r in result["rows"]:
        wide = f"{r['wide_steps']}/{r['steps']}" if "steps" in r else ""
        lines.append(f"| {r['delta']} | {r['batch']} | {r.get('greedy_new_tokens', '')} | {r['tokens_per_forward']:.2f} | {wide} | {r['greedy_s']:.3f} | "
                     f"{r['jacobi_s']:.3f} | {r['speedup']:.2f}x | {100 * result['gain_kept'][r['delta']]:.1f} % |")
    lines.append(f"\ngain kept by the uncompressed consistency model: {100 * result['gain_kept']['cllm (16-bit)']:.1f} %")
    if "task" in result:
        t = result["task"]
        lines += ["", f"task gain kept on the pair's {t['examples']} held-out {t['task']} examples:", "",
                  "| model | exact match | EM gain kept | answer NLL | answer NLL gain kept | text NLL | text NLL gain kept |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k, v in t["scores"].items():
            g = t["gain_kept"][k]
            lines.append(f"| {k} | {v['exact_match']:.3f} | {100 * g['exact_match']:.1f} % | {v['answer_nll']:.4f} | "
                         f"{100 * g['answer_nll']:.1f} % | {v['task_nll']:.4f} | {100 * g['task_nll']:.1f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.jacobi", description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the base model folder")
    p.add_argument("--finetune", help="the fine-tune folder (with its tokenizer)")
    p.add_argument("--tiny", action="store_true", help="a tiny counting pair built here (CPU smoke test)")
    p.add_argument("--pair", help="a real pair folder (python -m hf_deltazip.bench.real_pairs --work WORK: WORK/dates): "
                                  "its fine-tune, and task scores on its held-out examples; the base defaults to WORK/base")
    p.add_argument("--cllm", help="a consistency-trained model folder (default: train one here)")
    p.add_argument("--save-cllm", help="save the consistency-trained model here")
    p.add_argument("--task-prompts", action="store_true",
                   help="with --pair: the pair's own task prompts (calibration prompts to train the consistency "
                        "model, held-out evaluation prompts to time) instead of held-out Python stdlib snippets")
    p.add_argument("--prompts", help="a .txt (one prompt a line) or .jsonl ({'prompt'|'text': ...}) file; "
                                     "default: held-out Python stdlib snippets")
    p.add_argument("--train-prompts", type=int, default=96,
                   help="prompts the consistency model trains on (32 overfit them: BENCHMARKS.md section 9)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts: the batch runs and the gain kept")
    p.add_argument("--b1-prompts", type=int, default=3, help="of those, how many run alone (batch 1)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--min-accept", type=lambda v: None if v == "none" else float(v), default=1.5,
                   help="tokens per forward under which Jacobi falls back to greedy steps for a while ('none': never)")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--cllm-steps", type=int, default=200)
    p.add_argument("--cllm-batch", type=int, default=16)
    p.add_argument("--cllm-lr", type=float, default=2e-5)
    p.add_argument("--cllm-schedule", choices=["constant", "cosine"], default="cosine",
                   help="learning-rate schedule of the consistency training (bench.cllm_recipe compares them)")
    p.add_argument("--cllm-warmup", type=int, default=None,
                   help="warm-up steps of the consistency training (default: a tenth of --cllm-steps)")
    p.add_argument("--cllm-ar-loss", choices=["labels", "distill"], default="labels",
                   help="the consistency training's autoregressive loss (ConsistencyConfig.ar_loss)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.pair:
        if args.tiny:
            p.error("--pair and --tiny exclude each other")
        args.base = args.base or str(Path(args.pair).parent / "base")
        args.finetune = args.finetune or str(Path(args.pair) / "finetuned")
    if not args.tiny and not (args.base and args.finetune):
        p.error("pass --base DIR --finetune DIR, --pair DIR, or --tiny")
    if args.task_prompts and (not args.pair or args.prompts):
        p.error("--task-prompts needs --pair DIR and no --prompts")
    report(run(args), to_table, args.json)
    return 0


def report(result: dict, table, path) -> None:
    """Print ``table(result)``; write ``result`` as JSON to ``path`` when given."""
    print(table(result))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
