"""``python -m hf_deltazip.bench.act_sparsity``: activation-sparse decoding, quality and speed.

**quality** (CPU or GPU): on a base / fine-tune pair, per-layer thresholds calibrated at each target
sparsity (0, 25, 40, 50 % by default; :mod:`hf_deltazip.modeling.activation_sparsity`), then the
fine-tune's mean token NLL on held-out text, its relative increase over the dense fine-tune, and
the *gain kept*: ``(nll_base - nll_sparse) / (nll_base - nll_finetune)`` against the dense base.
With ``--delta`` (or on the tiny pair, which compresses one) the same through ``DeltaModel``
with the compressed delta (the serving path: base and delta rows both see the sparsified input).
Pairs: ``--pair DIR`` (a :mod:`~hf_deltazip.bench.pairs` folder: its task and general texts),
``--base DIR --finetune DIR`` (plain model folders; held-out stdlib text unless ``--texts FILE``),
or ``--tiny`` (a tiny llama pair trained on the spot from token patterns, a CPU smoke test).
``--real-pair DIR --exact-match`` adds the greedy exact match of the pair's held-out examples at each
sparsity (and its gain kept against base and dense fine-tune), twice: every token thresholded, and
decode only (the prompt dense): on a pair of memorised facts the paraphrase NLL can fall under the
thresholds while answers are lost, so exact match is the measure there.

**speed** (H200): one decoder block's seven linear layers at 8B shapes (Llama-3-8B: 4096 hidden,
14336 MLP, 8 KV heads), random bf16 weights and random 4-bit deltas (group 128), timed as one CUDA
graph over the block's layers (the block's ~0.9 GB of weights stream through L2 every replay):

* batch 1, base only: cuBLAS dense vs :func:`~hf_deltazip.kernels.act_sparse.sparse_base_linear`
  at 0/25/40/50 % of inputs zero (random positions: what magnitude thresholds give), with and
  without programmatic dependent launch; and grouped: q/k/v and gate/up in one launch each
  (:func:`~hf_deltazip.kernels.act_sparse.sparse_base_linears`) against cuBLAS on the
  concatenated weights (what a model with fused projections runs);
* batch 1 with one delta: the fused planar multi-delta kernel (dense) vs sparse base + sparse delta;
* batch 8 with 8 distinct deltas: the fused planar kernel (dense) vs cuBLAS base (the union of 8
  rows' kept inputs is almost everything) + :func:`~hf_deltazip.kernels.act_sparse.sparse_delta_linear`
  per row.

Each row reports microseconds per block, and the decode tokens/s of the linear layers of a
32-block model plus the dense LM head (attention and norms not counted: small at short context).

**model-speed** (H200): the whole path a user runs. A random Llama of 8B shapes (32 blocks, bf16)
in a ``DeltaModel`` with 8 random deltas (``--bits``, group 128), thresholds calibrated on random
token ids at each target sparsity (rank-16 compensation by default), and the decode tokens/s of a
``DecodeEngine`` (CUDA graphs, attention and LM head included; prefill excluded) for batch 1 on the
base, batch 1 on one delta and batch 8 on 8 distinct deltas: dense, then
``set_activation_sparsity(thresholds)`` with the sparse kernels (``kernels=True``), and thresholding in PyTorch (``kernels=False``) at the highest target. A
decode-shaped forward checks the kernel route against ``kernels=False``.

**rotation** (CPU, an experiment; the library thresholds the inputs themselves): the real base
(``--base``, float32) on general text (the Python reference's topics, read with their BOS; first
half calibrates, second half scores), decode-only (the first half of each scored document dense,
the NLL over the rest), centred thresholds and the rank-``--rank`` compensation of the library,
except that the chosen layers threshold their centred input in another orthogonal basis
(:data:`ROTATIONS`): ``z = Q^T (x - mu)``, the entries of ``z`` at or under the layer's threshold
(the ``sparsity``-quantile of ``|z|`` over the calibration positions, the BOS left out) set to 0,
and ``mu + Q z`` passed on. A sparse kernel would then read the kept columns of ``W Q``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import DeltaZipError
from ..modeling import activation_sparsity as acts
from . import metrics

SPARSITIES = (0.0, 0.25, 0.4, 0.5)


# =============================================================================================== quality
PYTHON_DOCS = "python-docs"


def python_reference_documents(min_chars: int = 1500, seed: int = 0, limit: int = 48) -> list:
    """English prose that ships with every CPython: the topics of the language reference that ``help()``
    shows (``pydoc_data.topics``), each of at least ``min_chars`` characters, in a seeded order (at most
    ``limit``). General text for NLL measurements on machines with no data set to download."""
    import random

    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # a stripped Python
        raise DeltaZipError("the python-docs texts need the standard library's pydoc_data package: install the "
                            "full Python, or pass --texts a .jsonl or .txt file") from e
    docs = [text for _, text in sorted(topics.items()) if len(text) >= min_chars]
    random.Random(seed).shuffle(docs)
    return docs[:limit]


def _texts_from_file(path: Path) -> list:
    """A ``.jsonl`` file (one ``{"text": ...}`` per line) or plain text (documents split at blank lines);
    :data:`PYTHON_DOCS` instead of a path: :func:`python_reference_documents`."""
    if str(path) == PYTHON_DOCS:
        return python_reference_documents()
    raw = Path(path).read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    return [d for d in raw.split("\n\n") if d.strip()]


def _ids(tokenizer, texts, max_length: int, special: bool = False) -> list:
    """Token ids of ``texts``, at most ``max_length`` each. ``special``: with the tokens the tokenizer adds
    (a BOS for Gemma and Llama): general text is scored as a model reads a document; the pairs' texts carry
    their own."""
    return [tokenizer(t, add_special_tokens=special)["input_ids"][:max_length] for t in texts]


def _pattern_ids(n: int, length: int, vocab: int, seed: int) -> list:
    """Sequences ``a, a+d, a+2d, ... (mod vocab)``: a task a tiny model learns in a few steps."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, vocab, (n, 1), generator=g)
    d = torch.randint(1, 8, (n, 1), generator=g)
    return ((a + d * torch.arange(length)[None]) % vocab).tolist()


def tiny_pair(steps: int = 60, seed: int = 0) -> dict:
    """A tiny llama base and a fine-tune of it trained on :func:`_pattern_ids` (CPU, seconds)."""
    from .pairs import tiny_model

    vocab = 256
    base = tiny_model("llama", vocab_size=vocab, seed=seed, hidden_size=64, num_layers=2)
    ft = copy.deepcopy(base).train()
    opt = torch.optim.AdamW(ft.parameters(), lr=3e-3)
    for step in range(steps):
        ids = torch.tensor(_pattern_ids(16, 32, vocab, seed=1000 + step))
        loss = ft(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"base": base.eval(), "finetune": ft.eval(), "calibration": _pattern_ids(32, 32, vocab, seed=1),
            "eval": {"task": _pattern_ids(32, 32, vocab, seed=2)}, "name": "tiny llama (token patterns)"}


def _load_pair(args, device, dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt_lengths = examples = None

    if args.tiny:
        return tiny_pair()
    if args.real_pair:
        from .real_pairs import real_pair_texts

        pair_dir = Path(args.real_pair)
        eval_texts, calib_texts = real_pair_texts(pair_dir)
        n = min(len(eval_texts), len(calib_texts))
        tok = AutoTokenizer.from_pretrained(pair_dir / "finetuned")
        base_dir = Path(args.base) if args.base else pair_dir.parent / "base"
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        ft = AutoModelForCausalLM.from_pretrained(pair_dir / "finetuned", dtype=dtype)
        calib = _ids(tok, calib_texts[:n], args.max_length)
        evals = {"text": _ids(tok, eval_texts[:n], args.max_length)}
        name = f"{base_dir} -> {pair_dir / 'finetuned'}"
        prompt_lengths = _prompt_lengths(tok, pair_dir, base_dir, evals["text"])
        if getattr(args, "exact_match", False):
            from .real_pairs import load_real_pair

            real = load_real_pair(pair_dir, base_dir=base_dir)
            examples = (tok, real.eval_examples, real.max_new_tokens)
    elif args.pair:
        from .pairs import load_pair

        pair = load_pair(args.pair)
        tok = pair.load_tokenizer()
        base, ft = pair.load_base(), pair.load_finetuned()
        calib = _ids(tok, pair.calibration_texts(args.calibration_texts), args.max_length)
        evals = {"task": _ids(tok, pair.eval_texts, args.max_length),
                 "general": _ids(tok, pair.general_texts, args.max_length)}
        name = str(args.pair)
    else:
        if not (args.base and args.finetune):
            raise SystemExit("quality needs --tiny, --pair DIR, --real-pair DIR, or both --base DIR and --finetune DIR")
        tok = AutoTokenizer.from_pretrained(args.finetune)
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype)
        ft = AutoModelForCausalLM.from_pretrained(args.finetune, dtype=dtype)
        if args.texts:
            texts = _texts_from_file(Path(args.texts))
            half = max(1, len(texts) // 2)
            calib_texts, eval_texts = texts[:half], texts[half:] or texts[:half]
        else:
            from .pairs import stdlib_documents

            calib_texts = stdlib_documents(seed=0, max_chars=4000)[: args.calibration_texts]
            eval_texts = stdlib_documents(seed=0, max_chars=4000, held_out=True)[:32]
        calib = _ids(tok, calib_texts, args.max_length, special=True)
        evals = {"text": _ids(tok, eval_texts, args.max_length, special=True)}
        name = f"{args.base} -> {args.finetune}"
    out = {"base": base.to(device, dtype).eval(), "finetune": ft.to(device, dtype).eval(), "calibration": calib,
           "eval": evals, "name": name}
    if prompt_lengths is not None:
        out["prompt_lengths"] = {"text": prompt_lengths}
    if examples is not None:
        out["examples"] = examples
    return out


def _prompt_lengths(tok, pair_dir: Path, base_dir: Path, seqs: list) -> Optional[list]:
    """Tokens of each evaluation sequence's prompt, when the sequences are the pair's examples, prompt
    first (the date pair); ``None`` otherwise (the facts pair scores rephrased questions)."""
    from .real_pairs import load_real_pair

    examples = load_real_pair(pair_dir, base_dir=base_dir).eval_examples
    if len(examples) < len(seqs):
        return None
    lengths = []
    for ex, seq in zip(examples, seqs):
        p = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        if seq[:len(p)] != p or len(seq) <= len(p):
            return None
        lengths.append(len(p))
    return lengths


def _prefix_nll(model, seqs: list, dense_prefix, prompt_sparse: bool = False, lengths: Optional[list] = None) -> float:
    """Mean NLL of the tokens after each sequence's prompt: its first ``dense_prefix`` share, or
    ``lengths[i]`` tokens when ``dense_prefix`` is ``"prompt"``. The prompt runs dense (a prefill under
    decode-only sparsity; ``prompt_sparse``: thresholded too, as when every token is) and the rest
    thresholded, one sequence per pass."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            if len(seq) < 2:  # nothing after a prompt of at least one token
                continue
            cut = lengths[i] if dense_prefix == "prompt" else int(len(seq) * dense_prefix)
            p = min(max(1, cut), len(seq) - 1)
            ids = torch.tensor([seq], device=device)
            with acts.sparsify_positions_from(0 if prompt_sparse else p):
                logits = model(input_ids=ids).logits[0, p - 1:-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, p:], reduction="sum"))
            count += len(seq) - p
    if count == 0:
        raise ValueError("no sequence is long enough to score after its dense prefix")
    return total / count


def _nlls(model, evals: dict, batch_size: int, dense_prefix=None, lengths: Optional[dict] = None) -> dict:
    if dense_prefix:  # the same positions scored both ways: decode-only sparsity, and every token thresholded
        out = {}
        for k, ids in evals.items():
            n = (lengths or {}).get(k)
            out[f"{k}, decode-only"] = _prefix_nll(model, ids, dense_prefix, lengths=n)
            out[f"{k}, every token"] = _prefix_nll(model, ids, dense_prefix, prompt_sparse=True, lengths=n)
        return out
    return {k: metrics.mean_token_nll(model, ids, batch_size=batch_size) for k, ids in evals.items()}


def _only(th, layers):
    """``th`` with a threshold of 0 (nothing but exact zeros dropped: the layer stays dense) on every layer whose
    name does not end in one of ``layers`` at a dot (``q_proj``: every q_proj; ``layers.3.mlp.up_proj``: one
    layer) (``None``: ``th`` itself)."""
    if th is None or not layers:
        return th

    def picked(name):
        return any(name == x or name.endswith("." + x) for x in layers)

    if not any(picked(n) for n in th.thresholds):
        raise DeltaZipError(f"--layers {','.join(layers)} matches no layer; the layers end in "
                            f"{sorted({n.rsplit('.', 1)[-1] for n in th.thresholds})}")
    return acts.ActivationThresholds(th.sparsity, {n: (t if picked(n) else 0.0) for n, t in th.thresholds.items()},
                                     th.num_tokens, rank=th.rank, centres=th.centres)


def _sweep(model, calib, evals, sparsities, batch_size, save_dir=None, dense_prefix=None, lengths=None,
           layers=None, allocation="uniform", rank: int = acts.DEFAULT_RANK, base_rows=None,
           examples=None, em_out: Optional[dict] = None, centre: bool = False) -> dict:
    """NLL per eval set at each sparsity, thresholds calibrated on ``model`` itself (``dense_prefix``: see
    :func:`_prefix_nll`; ``layers``: see :func:`_only`; ``allocation``, ``rank``, ``centre``: see
    ``calibrate_activation_thresholds``; ``base_rows``: a ``DeltaModel``'s ``threshold_base_rows``).

    ``examples`` (``(tokenizer, examples, max_new_tokens)``): also the greedy exact match of the examples at
    each sparsity, written into ``em_out[sparsity]`` as ``{"every token": em, "decode only": em}`` (the
    prompt thresholded too, or the prompt dense and only the one-token steps thresholded)."""
    out = {}
    targets = [s for s in sparsities if s > 0]
    ths = (acts.calibrate_activation_thresholds(model, calib, targets, allocation=allocation, rank=rank, centre=centre)
           if targets else {})

    def install(th, decode_only=False):
        if hasattr(model, "set_activation_sparsity"):
            model.set_activation_sparsity(th, threshold_base_rows=base_rows, decode_only=decode_only)
        else:
            acts.install_activation_sparsity(model, th, decode_only=decode_only)

    for s in sparsities:
        th = _only(ths.get(s), layers)
        if th is not None and save_dir is not None:
            th.save(save_dir)
        install(th)
        out[s] = _nlls(model, evals, batch_size, dense_prefix, lengths)
        if examples is not None:
            tok, exs, max_new = examples
            every = metrics.exact_match(model, tok, exs, max_new_tokens=max_new, batch_size=batch_size)
            if th is not None:
                install(th, decode_only=True)
                dec = metrics.exact_match(model, tok, exs, max_new_tokens=max_new, batch_size=batch_size)
            else:
                dec = every
            em_out[s] = {"every token": every, "decode only": dec}
    acts.remove_activation_sparsity(model)
    return out


def _compress_tiny_delta(pair, folder: Path) -> Path:
    from ..compression import compress
    from ..config import DeltaZipConfig

    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=8, seq_len=32)
    calib = torch.tensor(pair["calibration"][:8])
    compress(pair["base"], pair["finetune"], cfg, calibration=calib, progress=False).save_pretrained(folder)
    return folder


def run_quality(args) -> dict:
    from ..modeling import DeltaModel

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if (device == "cuda" and not args.tiny) else torch.float32
    t0 = time.time()
    pair = _load_pair(args, device, dtype)
    base, ft = pair["base"], pair["finetune"]
    evals, calib = pair["eval"], pair["calibration"]
    sparsities = sorted(set([0.0] + list(args.sparsity)))
    prefix, lengths = args.dense_prefix, pair.get("prompt_lengths")
    if prefix == "prompt" and lengths is None:
        raise SystemExit("--dense-prefix prompt needs --real-pair with evaluation texts that start with their "
                         "examples' prompts (the date pair); give a share such as 0.7 instead")
    examples = pair.get("examples")
    if getattr(args, "exact_match", False) and examples is None:
        raise SystemExit("--exact-match needs --real-pair (a pair whose held-out examples have one exact answer each)")
    base_nll = _nlls(base, evals, args.batch_size, prefix, lengths)
    base_em = None
    if examples is not None:
        tok, exs, max_new = examples
        base_em = metrics.exact_match(base, tok, exs, max_new_tokens=max_new, batch_size=args.batch_size)
    ems = {"fine-tune": {}}
    ft_sweep = _sweep(ft, calib, evals, sparsities, args.batch_size, args.save_thresholds, prefix, lengths,
                      args.layers, args.allocation, args.rank, examples=examples, em_out=ems["fine-tune"],
                      centre=getattr(args, "centre", False))
    rows, em_rows = [], []
    for kind, sweep in [("fine-tune", ft_sweep)] + _delta_sweeps(args, pair, calib, evals, sparsities, DeltaModel,
                                                                  ems):
        for s in sparsities:
            for k in sweep[s]:  # the eval sets (with --dense-prefix: each scored two ways)
                nll, dense = sweep[s][k], ft_sweep[0.0][k]
                gain = _gain(nll, base_nll[k], dense)
                rows.append({"model": kind, "eval": k, "sparsity": s, "nll": nll, "base_nll": base_nll[k],
                             "finetune_nll": dense, "rel_nll_increase": nll / dense - 1.0, "gain_kept": gain})
            for mode, em in ems.get(kind, {}).get(s, {}).items():
                ft_em = ems["fine-tune"][0.0]["every token"]
                em_rows.append({"model": kind, "mode": mode, "sparsity": s, "exact_match": em, "base_exact_match": base_em,
                                "finetune_exact_match": ft_em, "gain_kept": _kept(em, base_em, ft_em)})
    out = {"mode": "quality", "pair": pair["name"], "device": device, "dtype": str(dtype).replace("torch.", ""),
           "calibration_sequences": len(calib), "dense_prefix": prefix, "layers": args.layers,
           "allocation": args.allocation, "rank": args.rank, "centred": bool(getattr(args, "centre", False)),
           "rows": rows,
           "seconds": round(time.time() - t0, 1)}
    if examples is not None:
        out.update(exact_match_examples=len(examples[1]), exact_match_rows=em_rows)
    return out


def _kept(score, base_score, ft_score) -> Optional[float]:
    """``metrics.gain_kept`` of a higher-is-better score, ``None`` where the fine-tune gained nothing."""
    try:
        return metrics.gain_kept(score, base_score, ft_score)
    except ValueError:
        return None


def _gain(nll, base_nll, ft_nll) -> Optional[float]:
    return _kept(-nll, -base_nll, -ft_nll)


def _delta_sweeps(args, pair, calib, evals, sparsities, delta_model_cls, ems: Optional[dict] = None) -> list:
    delta = args.delta
    tmp = None
    if delta is None and args.tiny:
        tmp = tempfile.TemporaryDirectory()
        delta = _compress_tiny_delta(pair, Path(tmp.name) / "delta")
    if delta is None:
        return []
    try:
        dm = delta_model_cls(copy.deepcopy(pair["base"]), use_kernels="auto")
        dm.load_delta(delta, delta_name="ft")
        dm.set_delta("ft")
        # base and delta thresholded (a decode step of one row), then the delta alone with the base exact (what
        # the steps of several rows compute: threshold_base_rows=0 applies that rule to every forward)
        ems = {} if ems is None else ems
        return [(name, _sweep(dm, calib, evals, sparsities, args.batch_size, dense_prefix=args.dense_prefix,
                              lengths=pair.get("prompt_lengths"), layers=args.layers, allocation=args.allocation,
                              rank=args.rank, base_rows=base_rows, examples=pair.get("examples"),
                              em_out=ems.setdefault(name, {}), centre=getattr(args, "centre", False)))
                for name, base_rows in (("DeltaModel (compressed delta)", None),
                                        ("DeltaModel, delta only", 0))]
    finally:
        if tmp is not None:
            tmp.cleanup()


def quality_table(result: dict) -> str:
    prefix = result.get("dense_prefix")
    scope = ("; each prompt dense, NLL over the answers" if prefix == "prompt" else
             f"; first {prefix:.0%} of each sequence dense, NLL over the rest" if prefix else "; every token thresholded")
    lines = [f"activation sparsity, quality: {result['pair']} ({result['device']}, {result['dtype']}, "
             f"{result['calibration_sequences']} calibration sequences{scope}"
             f"{'; only ' + ','.join(result['layers']) + ' thresholded' if result.get('layers') else ''}"
             f"; {result.get('allocation', 'uniform')} allocation over the layers"
             f"{'; centred thresholds (|x - mean| per input)' if result.get('centred') else ''}"
             f"; low-rank compensation of rank {result.get('rank', 0)})",
             f"{'model':<30} {'eval':<20} {'sparsity':>8} {'NLL':>8} {'rel. NLL':>9} {'gain kept':>9}"]
    for r in result["rows"]:
        gain = "n/a" if r["gain_kept"] is None else f"{r['gain_kept']:.3f}"
        lines.append(f"{r['model']:<30} {r['eval']:<20} {r['sparsity']:>8.0%} {r['nll']:>8.4f} "
                     f"{r['rel_nll_increase']:>+9.2%} {gain:>9}")
    if result.get("exact_match_rows"):
        first = result["exact_match_rows"][0]
        lines += ["", f"exact match on the pair's {result['exact_match_examples']} held-out examples (greedy; base "
                      f"{first['base_exact_match']:.3f}, fine-tune {first['finetune_exact_match']:.3f}; gain kept against "
                      f"them; decode only: the prompt dense, the one-token steps thresholded)",
                  f"{'model':<30} {'thresholded':<20} {'sparsity':>8} {'EM':>8} {'gain kept':>9}"]
        for r in result["exact_match_rows"]:
            gain = "n/a" if r["gain_kept"] is None else f"{r['gain_kept']:.3f}"
            lines.append(f"{r['model']:<30} {r['mode']:<20} {r['sparsity']:>8.0%} {r['exact_match']:>8.3f} {gain:>9}")
    return "\n".join(lines)


# =============================================================================================== speed
SHAPES_8B = {  # name: (out_features N, in_features K) of one Llama-3-8B decoder block
    "q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336),
}
LAYERS_8B, VOCAB_8B = 32, 128256
#: launch settings tried by ``speed --sweep``: (block_n, block_k, num_warps, mma, compact) of the base
#: kernel at batch 1 and (block_n, block_k, num_warps, block_m, inner_k, compact) of the delta kernel with
#: 8 distinct deltas. The masked walks (compact False) keep the fastest settings of the 2026-12-02/03 H200
#: sweeps (BENCHMARKS.md section 8) and one MMA variant for reference; the compacted walks (each program
#: gets kept inputs only) are tried around the fastest of the 2026-12-04 sweep.
BASE_SWEEP = ((64, 256, 2, False, False), (128, 128, 2, False, False), (256, 64, 4, True, False),
              (64, 128, 2, False, True), (64, 256, 2, False, True), (128, 128, 2, False, True),
              (64, 128, 1, False, True), (32, 128, 1, False, True), (128, 256, 4, False, True),
              (64, 256, 4, False, True), (32, 256, 2, False, True), (128, 128, 4, False, True))
DELTA_SWEEP = ((128, 128, 1, 1, 16, False), (256, 128, 2, 1, 16, False),
               (256, 128, 1, 1, 8, True), (128, 128, 1, 1, 8, True), (256, 128, 1, 1, 4, True),
               (512, 128, 1, 1, 8, True), (512, 128, 2, 1, 8, True), (256, 128, 2, 1, 8, True),
               (128, 128, 1, 1, 4, True), (512, 128, 1, 1, 4, True), (128, 128, 1, 1, 16, True),
               (256, 128, 1, 1, 2, True), (512, 128, 2, 1, 4, True), (256, 128, 2, 1, 4, True),
               (512, 128, 4, 1, 8, True), (1024, 128, 4, 1, 4, True), (512, 128, 2, 1, 16, True),
               (1024, 128, 4, 1, 8, True), (1024, 128, 2, 1, 8, True), (512, 128, 4, 1, 16, True),
               (1024, 128, 8, 1, 8, True), (1024, 128, 4, 1, 16, True), (2048, 128, 4, 1, 8, True),
               (2048, 128, 8, 1, 8, True))
#: the same for the delta kernel at batch 1 on one delta (far fewer programs per launch)
DELTA1_SWEEP = ((128, 128, 1, 1, 16, False), (64, 128, 1, 1, 16, False),
                (128, 128, 1, 1, 16, True), (128, 128, 1, 1, 8, True), (64, 128, 1, 1, 16, True),
                (64, 128, 1, 1, 8, True), (32, 128, 1, 1, 16, True), (256, 128, 1, 1, 8, True),
                (256, 128, 2, 1, 8, True), (128, 128, 2, 1, 8, True))


def _sparse_rows(m: int, k: int, sparsity: float, gen: torch.Generator, device) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, device=device)
    drop = torch.rand(m, k, generator=gen, device=device) < sparsity
    return x.masked_fill(drop, 0.0).to(torch.bfloat16)


def _block(device, bits: int, group_size: int, deltas: int, gen, rank: int = 0) -> dict:
    from ..kernels import act_sparse as A
    from ..kernels import prepare_stack, random_delta_stack

    layers = {}
    for name, (n, k) in SHAPES_8B.items():
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        stack = prepare_stack(random_delta_stack(deltas, n, k, bits=bits, group_size=group_size, device=device,
                                                 generator=gen))
        layers[name] = {"w": w, "wt": A.input_major_weight(w), "stack": stack, "im": A.input_major_deltas(stack)}
        if rank:  # the compensation's cost depends on its shapes only: random factors of the right size
            layers[name]["ab"] = ((torch.randn(rank, k, generator=gen, device=device) * 0.02).to(torch.bfloat16),
                                  (torch.randn(n, rank, generator=gen, device=device) * 0.02).to(torch.bfloat16))
            layers[name]["lr"] = A.input_major_low_rank([layers[name]["ab"]])
    return layers


def _check(layers, gen, device, base_cfg=None, delta_cfg=None) -> float:
    """Largest error of the sparse path (base + delta, with these launch settings) against the dense
    reference, relative to its scale."""
    from ..kernels import act_sparse as A
    from ..kernels import multi_delta_linear_reference

    worst = 0.0
    for lay in layers.values():
        k = lay["w"].shape[1]
        x = _sparse_rows(8, k, 0.5, gen, device)
        rd = torch.arange(8, device=device, dtype=torch.int32) % lay["stack"].num_deltas
        got = A.sparse_delta_linear(x, lay["im"], rd, out=torch.nn.functional.linear(x, lay["w"]).float(),
                                    **(delta_cfg or {}))
        ref = multi_delta_linear_reference(x, lay["w"], None, lay["stack"], rd, out_dtype=torch.float32)
        got1 = A.sparse_base_linear(x[:1], lay["wt"], **(base_cfg or {})).float()
        ref1 = (x[:1].float() @ lay["w"].float().t())
        if "lr" in lay:  # with the compensation, inputs below 0.5 dropped
            worst = max(worst, (A.sparse_base_linear(x[:1], lay["wt"], threshold=0.5, lowrank=lay["lr"],
                                                     **(base_cfg or {})).float()
                                - A.sparse_base_linear_reference(x[:1], lay["wt"], threshold=0.5,
                                                                 lowrank=lay["lr"]).float()).abs().max().item()
                        / ref1.abs().max().item())
        scale = ref.abs().max().item()
        worst = max(worst, (got - ref).abs().max().item() / scale, (got1 - ref1).abs().max().item() / scale)
    return worst


def run_speed(args) -> dict:
    from ..kernels import act_sparse as A
    from ..kernels import build_row_segments, multi_delta_linear
    from .kernels import time_calls

    if not torch.cuda.is_available():
        raise SystemExit("speed needs a CUDA GPU")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.time()
    layers = _block(device, args.bits, args.group_size, 8, gen, args.rank)
    err = max(_check(layers, gen, device), _check(layers, gen, device, {"compact": False}, {"compact": False}))
    head = (torch.randn(VOCAB_8B, 4096, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    xh = torch.randn(8, 4096, generator=gen, device=device).to(torch.bfloat16)
    head_us = {m: time_calls([lambda m=m: torch.nn.functional.linear(xh[:m], head)]) for m in (1, 8)}
    del head
    rows = []

    def add(case, m, sparsity, path, calls):
        us = time_calls(calls, rep_ms=args.rep_ms) * len(calls)  # one block
        step_us = LAYERS_8B * us + head_us[m]
        rows.append({"case": case, "rows": m, "sparsity": sparsity, "path": path, "block_us": us,
                     "tokens_per_s": m * 1e6 / step_us})

    rd1 = torch.zeros(1, dtype=torch.int32, device=device)
    rd8 = torch.arange(8, dtype=torch.int32, device=device)
    seg1, seg8 = build_row_segments(rd1), build_row_segments(rd8)
    xs = {s: {name: _sparse_rows(8, k, s, gen, device) for name, (_, k) in SHAPES_8B.items()} for s in args.sparsity}
    lin = torch.nn.functional.linear

    # x's zeros are the dropped inputs; with the compensation a threshold of 0 drops exactly them, and the
    # compensation runs on every call (the same work as at any threshold)
    lr_cfg = {"threshold": 0.0} if args.rank else {}

    def _lr(lowrank, comp=True):  # the compensation's arguments of one call (none without it)
        return {**lr_cfg, "lowrank": lowrank} if args.rank and comp else {}

    def base_calls(x, cfg, comp=True):
        return [lambda L=L, x=x[n][:1]: A.sparse_base_linear(x, L["wt"], **cfg, **_lr(L.get("lr"), comp))
                for n, L in layers.items()]

    # q/k/v and gate/up share their input: one launch each (sparse_base_linears); the dense baseline
    # of the same grouping multiplies by the concatenated weights (what a fused-projection model runs)
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    fused_w = {g: torch.cat([layers[n]["w"] for n in g]) for g in groups}
    fused_lr = {g: A.input_major_low_rank([layers[n]["ab"] for n in g]) for g in groups} if args.rank else {}

    def grouped_calls(x, cfg, comp=True):
        return [lambda g=g, x=x[g[0]][:1]: A.sparse_base_linears(x, [layers[n]["wt"] for n in g], **cfg,
                                                                  **_lr(fused_lr.get(g), comp))
                for g in groups]

    def delta1_calls(x, cfg):
        return [lambda L=L, x=x[n][:1]: A.sparse_delta_linear(x, L["im"], rd1, out=lin(x, L["w"]), segments=seg1, **cfg)
                for n, L in layers.items()]

    def delta8_calls(x, cfg):
        return [lambda L=L, x=x[n]: A.sparse_delta_linear(x, L["im"], rd8, out=lin(x, L["w"]), segments=seg8, **cfg)
                for n, L in layers.items()]

    # launch settings of the sparse kernels: the ones given, or the fastest of a sweep at the highest sparsity
    given = {k: v for k, v in (("block_n", args.block_n), ("block_k", args.block_k), ("num_warps", args.num_warps)) if v}
    base_cfg, delta_cfg, delta1_cfg = dict(given), dict(given), dict(given)
    sweep = {"base": [], "delta": [], "delta1": []}
    if args.sweep:
        top = xs[max(args.sparsity)]
        gs = args.group_size
        for bn, bk, nw, mma, compact in BASE_SWEEP:
            cfg = {"block_n": bn, "block_k": bk, "num_warps": nw, "mma": mma, "compact": compact}
            us = time_calls(base_calls(top, cfg), rep_ms=args.rep_ms) * len(SHAPES_8B)
            sweep["base"].append({**cfg, "us_per_block": us})
            print(f"sweep base {cfg}: {us:.1f} us/block", flush=True)
        for key, settings, calls, what in (("delta", DELTA_SWEEP, delta8_calls, "8 deltas"),
                                           ("delta1", DELTA1_SWEEP, delta1_calls, "1 delta")):
            for bn, bk, nw, bm, inner, compact in settings:
                bk = min(bk, gs) if gs > 0 else bk
                cfg = {"block_n": bn, "block_k": bk, "num_warps": nw, "block_m": bm, "inner_k": min(inner, bk),
                       "compact": compact}
                us = time_calls(calls(top, cfg), rep_ms=args.rep_ms) * len(SHAPES_8B)
                sweep[key].append({**cfg, "us_per_block": us})
                print(f"sweep {what} {cfg}: {us:.1f} us/block", flush=True)
        delta1_cfg = {k: v for k, v in min(sweep["delta1"], key=lambda r: r["us_per_block"]).items()
                      if k != "us_per_block"}
        base_cfg = {k: v for k, v in min(sweep["base"], key=lambda r: r["us_per_block"]).items() if k != "us_per_block"}
        delta_cfg = {k: v for k, v in min(sweep["delta"], key=lambda r: r["us_per_block"]).items() if k != "us_per_block"}
        # the chosen settings are right too
        err = max(err, _check(layers, gen, device, base_cfg, delta_cfg), _check(layers, gen, device, base_cfg, delta1_cfg))
    dense_x = xs[min(args.sparsity)]
    add("base, batch 1", 1, 0.0, "cuBLAS dense", [lambda L=L, x=dense_x[n][:1]: lin(x, L["w"]) for n, L in layers.items()])
    add("base, batch 1, grouped", 1, 0.0, "cuBLAS dense, q/k/v and gate/up concatenated",
        [lambda g=g, x=dense_x[g[0]][:1]: lin(x, fused_w[g]) for g in groups])
    add("1 delta, batch 1", 1, 0.0, "fused planar kernel (dense)",
        [lambda L=L, x=dense_x[n][:1]: multi_delta_linear(x, L["w"], None, L["stack"], rd1, segments=seg1)
         for n, L in layers.items()])
    add("8 deltas, batch 8", 8, 0.0, "fused planar kernel (dense)",
        [lambda L=L, x=dense_x[n]: multi_delta_linear(x, L["w"], None, L["stack"], rd8, segments=seg8)
         for n, L in layers.items()])
    variants = [("", base_cfg, delta1_cfg, delta_cfg)]
    if args.sweep:  # the fastest masked walks beside, for comparison
        def best(rows_, pred):
            r = min((r for r in rows_ if pred(r)), key=lambda r: r["us_per_block"])
            return {k: v for k, v in r.items() if k != "us_per_block"}

        def masked(r):
            return not r["compact"] and r["block_m"] == 1

        variants.append((", masked walk", best(sweep["base"], lambda r: not r["compact"] and not r["mma"]),
                         best(sweep["delta1"], masked), best(sweep["delta"], masked)))
    comp = f", rank-{args.rank} compensation" if args.rank else ""
    for s in args.sparsity:
        x = xs[s]
        for tag, bcfg, d1cfg, dcfg in variants:
            add("base, batch 1", 1, s, "sparse base kernel" + tag + comp, base_calls(x, bcfg))
            if not tag:
                if args.rank:
                    add("base, batch 1", 1, s, "sparse base kernel, no compensation", base_calls(x, bcfg, False))
                add("base, batch 1", 1, s, "sparse base kernel, no PDL" + comp, base_calls(x, {**bcfg, "pdl": 0}))
                add("base, batch 1, grouped", 1, s, "sparse base kernel, q/k/v and gate/up in one launch each" + comp,
                    grouped_calls(x, bcfg))
                if args.rank:
                    add("base, batch 1, grouped", 1, s, "sparse base kernel, q/k/v and gate/up in one launch each, "
                        "no compensation", grouped_calls(x, bcfg, False))
            add("1 delta, batch 1", 1, s, "sparse base + sparse delta" + tag + comp,
                [lambda L=L, x=x[n][:1], bcfg=bcfg, dcfg=d1cfg: A.sparse_delta_linear(
                    x, L["im"], rd1, out=A.sparse_base_linear(x, L["wt"], **bcfg, **_lr(L.get("lr"))), segments=seg1, **dcfg)
                 for n, L in layers.items()])
            add("8 deltas, batch 8", 8, s, "cuBLAS base + sparse delta" + tag, delta8_calls(x, dcfg))
    dense_ref = {r["case"]: r for r in rows if r["sparsity"] == 0.0 and "dense" in r["path"]}
    for r in rows:  # per block of linears, and in tokens/s (the dense LM head counted in both)
        r["speedup_vs_dense"] = dense_ref[r["case"]]["block_us"] / r["block_us"]
        r["tokens_per_s_vs_dense"] = r["tokens_per_s"] / dense_ref[r["case"]]["tokens_per_s"]
    return {"mode": "speed", "device": torch.cuda.get_device_name(), "shape": "Llama-3-8B block",
            "delta_bits": args.bits, "group_size": args.group_size, "rank": args.rank, "max_rel_error": err,
            "lm_head_us": head_us, "base_tiles": base_cfg, "delta_tiles": delta_cfg, "delta1_tiles": delta1_cfg,
            "sweep": sweep,
            "rows": rows, "seconds": round(time.time() - t0, 1)}


def _tiles(cfg: Optional[dict]) -> str:
    if not cfg:
        return "defaults"
    extra = "".join(f", {k} {v}" for k, v in cfg.items() if k not in ("block_n", "block_k", "num_warps"))
    return (f"{cfg.get('block_n', 'default')}x{cfg.get('block_k') or 'default'} (n x k), "
            f"{cfg.get('num_warps', 'default')} warps{extra}")


def speed_table(result: dict) -> str:
    lines = [f"activation sparsity, speed: {result['shape']} on {result['device']}, {result['delta_bits']}-bit deltas "
             f"g{result['group_size']}",
             f"correctness: sparse path vs dense reference, max error / max |y| = {result['max_rel_error']:.2e}",
             f"tiles: base {_tiles(result.get('base_tiles'))}; delta, 8 rows {_tiles(result.get('delta_tiles'))}; "
             f"delta, 1 row {_tiles(result.get('delta1_tiles'))}",
             f"{'case':<18} {'sparsity':>8} {'path':<44} {'us/block':>9} {'vs dense':>8} {'tok/s':>8} {'vs dense':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['case']:<18} {r['sparsity']:>8.0%} {r['path']:<44} {r['block_us']:>9.1f} "
                     f"{r['speedup_vs_dense']:>7.2f}x {r['tokens_per_s']:>8.1f} "
                     f"{r.get('tokens_per_s_vs_dense', float('nan')):>7.2f}x")
    lines.append("tok/s: 32 blocks of linear layers + the dense LM head (attention and norms not counted)")
    return "\n".join(lines)


# =============================================================================================== model speed
def run_model_speed(args) -> dict:
    from ..modeling import DeltaModel
    from .decode import build_base, engine_tokens_per_s, random_delta

    if not torch.cuda.is_available():
        raise SystemExit("model-speed needs a CUDA GPU")
    t0 = time.time()
    base = build_base("8b", "cuda", args.layers)
    gen = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 32000, (64,), generator=gen) for _ in range(16)]
    targets = [s for s in args.sparsity if s > 0]
    th = acts.calibrate_activation_thresholds(base, calib, targets, rank=args.rank, batch_size=4)  # on the base
    th = th if isinstance(th, dict) else {targets[0]: th}
    model = DeltaModel(base)
    decode = getattr(args, "decode", "auto")
    model.configure_kernels(decode=decode)  # the dense steps' route (the sparse ones take their own kernels)
    names = [f"d{i}" for i in range(args.deltas)]
    model.configure_cache(max_resident=len(names))  # the kernel stacks sized once
    for i, n in enumerate(names):
        model.add_delta(random_delta(base, args.bits, args.group_size, seed=i), n)
    ids = torch.randint(0, 32000, (8, 1), generator=gen).cuda()

    # the kernel route against thresholding in PyTorch, layer by layer on the inputs one decode-shaped forward of
    # mixed rows gives each layer (whole-model outputs are no check in bf16: a rounding either way moves inputs
    # across their thresholds, and a random model's logits amplify that)
    err = max(_layer_errors(model, th[max(targets)], ids, names[:7] + [None], True, base_rows)
              for base_rows in (1, None))
    cases = [("base, batch 1", [None]), ("1 delta, batch 1", names[:1]), (f"{len(names)} deltas, batch {len(names)}", names)]
    rows = []

    def measure(setting, sparsity, kernels, base_rows=1, which=cases):
        if sparsity:
            model.set_activation_sparsity(th[sparsity], kernels=kernels, threshold_base_rows=base_rows)
        else:
            model.set_activation_sparsity(None)
        for case, rows_names in which:
            tps = engine_tokens_per_s(model, rows_names, len(rows_names), args.prompt_len, args.steps)
            rows.append({"case": case, "rows": len(rows_names), "sparsity": sparsity, "path": setting,
                         "tokens_per_s": tps})
            print(f"{case:<20} {sparsity:>5.0%} {setting:<40} {tps:9.1f} tok/s", flush=True)

    measure("dense", 0.0, None)
    packed = model.memory_footprint()["deltas"][names[0]]  # no sparse route: the packed stacks alone
    for s in targets:
        measure("sparse kernels (kernels=True)", s, True)
        # the same with the base thresholded at every row count too (threshold_base_rows=None): its sparse kernel
        # in the steps of several rows, where the default multiplies it by the whole input
        measure("sparse kernels, base thresholded too", s, True, None, cases[-1:])
    mem = model.memory_footprint()  # the route on: the input-major copies held too
    measure("thresholds in PyTorch (kernels=False)", max(targets), False)
    dense = {r["case"]: r["tokens_per_s"] for r in rows if r["sparsity"] == 0.0}
    for r in rows:
        r["vs_dense"] = r["tokens_per_s"] / dense[r["case"]]
    profiles = {}
    if getattr(args, "profile", False):  # where the several-delta step's GPU time goes, dense and at each sparsity
        from .decode import print_profile, profile_engine_step

        for s in [0.0] + targets:
            if s:
                model.set_activation_sparsity(th[s], kernels=True)
            else:
                model.set_activation_sparsity(None)
            label = f"{len(names)} deltas, batch {len(names)}, {s:.0%}"
            profiles[label] = profile_engine_step(model, names, len(names), args.prompt_len)
            print_profile(label, profiles[label])
        model.set_activation_sparsity(None)
    return {"mode": "model-speed", "device": torch.cuda.get_device_name(), "layers": args.layers,
            "shape": "Llama-3-8B (random weights)", "delta_bits": args.bits, "group_size": args.group_size,
            "deltas": len(names), "decode": decode, "rank": args.rank, "steps": args.steps, "prompt_len": args.prompt_len,
            "max_rel_error_vs_pytorch": err, "base_gib": mem["base"] / 2**30,
            "delta_gib_each": mem["deltas"][names[0]] / 2**30, "delta_gib_each_packed": packed / 2**30, "rows": rows,
            **({"profiles": profiles} if profiles else {}), "seconds": round(time.time() - t0, 1)}


def _layer_errors(model, thresholds, ids, rows, kernels, base_rows=1) -> float:
    """Largest ``max |y_kernels - y_pytorch| / max |y_pytorch|`` over the thresholded delta layers of ``model``,
    each fed the input it got in one forward of ``ids`` with ``kernels`` (``delta_names=rows``); ``base_rows``:
    ``threshold_base_rows`` of both (see ``DeltaModel.set_activation_sparsity``)."""
    from ..modeling.layers import DeltaLinear

    model.set_activation_sparsity(thresholds, kernels=kernels, strict=False, threshold_base_rows=base_rows)
    mods = {n: m for n, m in model.base_model.named_modules()
            if isinstance(m, DeltaLinear) and acts.has_activation_sparsity(m.base_layer)}
    if not mods:
        raise DeltaZipError("no thresholded delta layer to compare: load a delta that touches the thresholded layers")
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n, (a[0].clone(), o.clone())))
             for n, m in mods.items()]
    try:
        with torch.no_grad():
            model(input_ids=ids, delta_names=rows)
    finally:
        for h in hooks:
            h.remove()
    model.set_activation_sparsity(thresholds, kernels=False, strict=False, threshold_base_rows=base_rows)
    worst = 0.0
    with torch.no_grad(), model.route(rows):
        for n, (x, y) in seen.items():
            ref = mods[n](x).float()
            worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
    if len(seen) != len(mods):
        raise DeltaZipError(f"only {len(seen)} of {len(mods)} thresholded layers ran in the checked forward")
    return worst


def model_speed_table(result: dict) -> str:
    lines = [f"activation sparsity through DeltaModel + DecodeEngine: {result['shape']}, {result['layers']} blocks, "
             f"on {result['device']}; {result['deltas']} {result['delta_bits']}-bit deltas g{result['group_size']}, "
             f"rank-{result['rank']} compensation; {result['steps']} decode steps after a {result['prompt_len']}-token prompt; "
             f"dense steps decode={result.get('decode', 'auto')!r}",
             f"kernel route vs kernels=False, per layer on its in-model input: max error / max |y| = "
             f"{result['max_rel_error_vs_pytorch']:.2e}",
             f"device memory: base {result['base_gib']:.1f} GiB, each delta {result['delta_gib_each']:.2f} GiB with its "
             f"input-major copy (kernels=True), {result.get('delta_gib_each_packed', float('nan')):.2f} GiB without",
             f"{'case':<20} {'sparsity':>8} {'path':<42} {'tok/s':>9} {'vs dense':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['case']:<20} {r['sparsity']:>8.0%} {r['path']:<42} {r['tokens_per_s']:>9.1f} "
                     f"{r['vs_dense']:>7.2f}x")
    return "\n".join(lines)


# =============================================================================================== cli
def _dense_prefix(text: str):
    """``--dense-prefix``: a share strictly between 0 and 1, or ``"prompt"``."""
    if text == "prompt":
        return text
    v = float(text)
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"a share strictly between 0 and 1, got {text}")
    return v


def _sparsities(text: str) -> list:
    vals = [float(v) for v in text.split(",") if v.strip()]
    for v in vals:
        if not 0.0 <= v < 1.0:
            raise argparse.ArgumentTypeError(f"sparsities must be in [0, 1), got {v}")
    return vals


# =============================================================================================== rotation
#: rotation experiments (``rotation`` mode): name -> what is thresholded in a rotated basis
ROTATIONS = {
    "raw": "the library's centred thresholds on the inputs themselves (no rotation)",
    "pca": "every layer: its centred input in the principal axes of its calibration inputs",
    "pca-foldable": "q/k/v and gate/up: the principal axes of the input they share; o: one basis per attention "
                    "head (foldable into v_proj and o_proj); down: no rotation",
    "pca-mlp": "gate/up: the principal axes of the input they share; o: one basis per attention head; q/k/v and "
               "down: no rotation (one online rotation per block, the MLP input's)",
    "pca-static": "every layer: the principal axes, and each token keeps the same top (1 - sparsity) of them "
                  "(no threshold)",
    "random": "every layer: a random orthogonal basis (spreads each input over every axis)",
}


def _parse_rotations(text: str) -> list:
    names = [v for v in text.split(",") if v]
    bad = [v for v in names if v not in ROTATIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown rotation {', '.join(bad) or text!r}: choose from {', '.join(ROTATIONS)}")
    return names


def input_moments(model, modules: dict, calibration: list, skip: int = 1, keep_rows: int = 48, seed: int = 0) -> dict:
    """Per module of ``modules``: the mean ``[in]`` and covariance ``[in, in]`` (float64) of its inputs over the
    ``calibration`` sequences (token-id lists, one pass each) without each sequence's first ``skip`` positions
    (the BOS: decode-only thresholding never sees it), and ``keep_rows`` random positions per sequence
    (float32) for quantiles."""
    gen = torch.Generator().manual_seed(seed)
    acc = {n: [0, 0, 0, []] for n in modules}

    def hook(name):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])[skip:].double().cpu()
            a = acc[name]
            a[0], a[1], a[2] = a[0] + x.sum(0), a[1] + x.T @ x, a[2] + x.shape[0]
            a[3].append(x[torch.randperm(x.shape[0], generator=gen)[:keep_rows]].float())
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for seq in calibration:
                model(input_ids=torch.tensor([seq], device=device))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n, (s1, s2, count, rows) in acc.items():
        if count < 2:
            raise DeltaZipError(f"{n} saw {count} calibration positions after the first {skip}: pass longer or "
                                "more calibration sequences")
        mean = s1 / count
        out[n] = {"mean": mean, "cov": s2 / count - torch.outer(mean, mean), "rows": torch.cat(rows)}
    return out


def rotation_basis(cov: torch.Tensor, kind: str, block: int = 0, seed: int = 0) -> torch.Tensor:
    """An orthogonal ``[in, in]`` float32 basis (columns): ``"pca"``, the eigenvectors of ``cov`` in ascending
    order of variance (``block``: one basis per diagonal block of that size, e.g. per attention head);
    ``"random"``: a seeded random orthogonal basis."""
    k = cov.shape[0]
    if kind == "random":
        q, _ = torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        return q.float()
    if kind != "pca":
        raise ValueError(f"kind must be 'pca' or 'random', got {kind!r}")
    if not block or block >= k:
        return torch.linalg.eigh(cov)[1].float()
    if k % block:
        raise ValueError(f"{k} inputs do not split into blocks of {block}")
    q = torch.zeros(k, k, dtype=torch.float64)
    for b in range(0, k, block):
        q[b:b + block, b:b + block] = torch.linalg.eigh(cov[b:b + block, b:b + block])[1]
    return q.float()


class RotatedDrop:
    """A thresholding rule in a rotated basis: ``z = Q^T (x - mu)``, the entries with ``|z| <= threshold``
    (or, with ``keep``, every entry outside it) set to 0, and ``mu + Q z`` returned."""

    def __init__(self, mean: torch.Tensor, basis: torch.Tensor, threshold: float, keep: Optional[torch.Tensor] = None):
        self.mean, self.basis, self.threshold, self.keep = mean.float(), basis.float(), float(threshold), keep

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean.to(x.device)) @ self.basis.to(x.device)

    def kept(self, z: torch.Tensor) -> torch.Tensor:
        if self.keep is not None:
            return self.keep.to(z.device).expand_as(z)
        return z.abs() > self.threshold

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = self.rotate(x)
        z = torch.where(self.kept(z), z, torch.zeros((), dtype=z.dtype, device=z.device))
        return (self.mean.to(x.device) + z @ self.basis.to(x.device).T).to(x.dtype)


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1].removesuffix("_proj")


#: the layer kinds each variant rotates (every kind where it is not named; ``raw``: none); these variants take one
#: basis per attention head for o_proj
_ROTATED_KINDS = {"raw": (), "pca-foldable": ("q", "k", "v", "o", "gate", "up"), "pca-mlp": ("o", "gate", "up")}


def rotated_drops(moments: dict, sparsity: float, variant: str, head_dim: int, seed: int = 0) -> dict:
    """``{module name: RotatedDrop}`` for a :data:`ROTATIONS` variant (``"raw"``: none), each threshold the
    ``sparsity``-quantile of ``|z|`` over the calibration rows (one sample of up to 2^20 values)."""
    if variant not in ROTATIONS:
        raise ValueError(f"unknown rotation {variant!r}: choose from {', '.join(ROTATIONS)}")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, m) in enumerate(sorted(moments.items())):
        kind, kinds = _kind(name), _ROTATED_KINDS.get(variant)
        if kinds is not None and kind not in kinds:
            continue
        block = head_dim if kinds and kind == "o" else 0
        basis = rotation_basis(m["cov"], "random" if variant == "random" else "pca", block=block, seed=seed + i)
        drop = RotatedDrop(m["mean"], basis, 0.0)
        k = basis.shape[0]
        if variant == "pca-static":  # eigh's ascending order: the last (1 - sparsity) axes carry the most variance
            keep = torch.zeros(k, dtype=torch.bool)
            keep[int(round(k * sparsity)):] = True
            drop.keep = keep
        else:
            z = drop.rotate(m["rows"]).abs().reshape(-1)
            z = z[torch.randperm(z.numel(), generator=gen)[:1 << 20]]
            drop.threshold = float(torch.quantile(z, sparsity)) if sparsity > 0 else -1.0
        out[name] = drop
    return out


def run_rotation(args) -> dict:
    """NLL of the real base on general text (decode-only: the first half of each document dense) with its
    inputs thresholded in each rotated basis of ``args.rotations``, against dense."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if args.tiny:
        from .pairs import tiny_model

        model = tiny_model("llama", vocab_size=256, seed=0, hidden_size=64, num_layers=2).float().eval()
        calib, evals = _pattern_ids(8, 48, 256, seed=1), _pattern_ids(8, 48, 256, seed=2)
        name = "tiny llama (random weights)"
    else:
        if not args.base:
            raise DeltaZipError("rotation needs --base FOLDER (a converted base, e.g. WORK/base of "
                                "hf_deltazip.bench.real_pairs) or --tiny")
        tok = AutoTokenizer.from_pretrained(args.base)
        model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
        texts = python_reference_documents()
        half = len(texts) // 2
        calib, evals = _ids(tok, texts[:half], args.max_length, True), _ids(tok, texts[half:], args.max_length, True)
        name = f"{args.base} (python-docs: {len(calib)} calibration, {len(evals)} scored documents, BOS included)"
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dense = _prefix_nll(model, evals, 0.5)
    mods = acts.target_modules(model)
    moments = input_moments(model, mods, calib)
    rows = []
    for sp in [s for s in args.sparsity if s > 0]:
        th = acts.calibrate_activation_thresholds(model, calib, sp, rank=args.rank, centre=True)
        for variant in args.rotations:
            t0 = time.time()
            drops = rotated_drops(moments, sp, variant, head_dim)
            acts.install_activation_sparsity(model, th, decode_only=True, rank=args.rank)
            try:
                for n, drop in drops.items():
                    acts.set_input_rule(mods[n], drop)  # the rule's compensation then sees x - drop(x)
                nll = _prefix_nll(model, evals, 0.5)
            finally:
                acts.install_activation_sparsity(model, None)
            rows.append({"sparsity": sp, "rotation": variant, "nll": nll, "relative": nll / dense - 1,
                         "seconds": time.time() - t0})
            print(f"  {sp:.2f} {variant}: NLL {nll:.4f} ({100 * (nll / dense - 1):+.2f} %)", flush=True)
    return {"model": name, "dense_nll": dense, "rank": args.rank, "head_dim": head_dim, "rows": rows,
            "rotations": {v: ROTATIONS[v] for v in args.rotations}}


def rotation_table(result: dict) -> str:
    lines = [f"{result['model']}; decode-only (first half of each document dense), centred thresholds, rank "
             f"{result['rank']} compensation; dense NLL {result['dense_nll']:.4f}", "",
             "| sparsity | rotation | NLL | relative |", "|---:|---|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['sparsity']:.2f} | {r['rotation']} | {r['nll']:.4f} | {100 * r['relative']:+.2f} % |")
    lines += [""] + [f"- {k}: {v}" for k, v in result["rotations"].items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.act_sparsity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality", help="NLL and gain kept at each sparsity")
    q.add_argument("--tiny", action="store_true", help="a tiny pair trained on the spot (CPU smoke test)")
    q.add_argument("--pair", help="a hf_deltazip.bench.pairs folder")
    q.add_argument("--real-pair", help="a hf_deltazip.bench.real_pairs folder (WORK/dates): its base (WORK/base, or "
                                       "--base) and fine-tune; calibrates on its calibration texts, scores on as many evaluation texts")
    q.add_argument("--base", help="base model folder")
    q.add_argument("--finetune", help="fine-tuned model folder (its tokenizer is used)")
    q.add_argument("--delta", help="also measure this compressed delta folder through DeltaModel")
    q.add_argument("--exact-match", action="store_true", help="with --real-pair: also the greedy exact match of the "
                   "pair's held-out examples at each sparsity, every token thresholded and decode only")
    q.add_argument("--texts", help="a .jsonl ({'text': ...} per line) or .txt file: first half calibrates, second half "
                                   f"scores; '{PYTHON_DOCS}': the Python language reference's topics (English prose "
                                   "that ships with CPython)")
    q.add_argument("--calibration-texts", type=int, default=64, help="calibration documents (default 64)")
    q.add_argument("--max-length", type=int, default=512)
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--save-thresholds", help="folder to save the fine-tune's thresholds in")
    q.add_argument("--allocation", choices=list(acts.ALLOCATIONS), default="uniform",
                   help="how each target is spread over the layers (calibrate_activation_thresholds; 'measured': "
                        "one more calibration pass per layer group and level)")
    q.add_argument("--centre", action="store_true", help="centred thresholds: each input is thresholded on its "
                   "distance from its calibration mean, and a dropped input stands at that mean "
                   "(calibrate_activation_thresholds(centre=True); uniform allocation only)")
    q.add_argument("--layers", type=lambda v: [x for x in v.split(",") if x],
                   help="threshold only the layers whose names end in one of these (comma list, e.g. "
                        "q_proj,k_proj,v_proj or layers.3.mlp.up_proj); the others stay dense: which layers the "
                        "loss comes from")
    q.add_argument("--dense-prefix", type=_dense_prefix, help="decode-only sparsity: run this share of each evaluation "
                   "sequence dense (as a prompt's prefill) and score the NLL of the rest, thresholded; 'prompt' "
                   "(--real-pair, date pair): each example's own prompt (default: every token thresholded, NLL "
                   "over all)")
    q.add_argument("--device", help="default: cuda when available")
    s = sub.add_parser("speed", help="layer time and decode tokens/s at 8B shapes (CUDA)")
    s.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    s.add_argument("--group-size", type=int, default=128)
    s.add_argument("--rep-ms", type=int, default=60)
    s.add_argument("--block-n", type=int, default=0, help="outputs per program of the sparse kernels (0: their "
                                                          "defaults)")
    s.add_argument("--block-k", type=int, default=0, help="inputs per program of the sparse kernels (0: their "
                                                          "defaults)")
    s.add_argument("--num-warps", type=int, help="warps of both sparse kernels (default: each kernel's own)")
    s.add_argument("--sweep", action="store_true", help="time the settings of BASE_SWEEP and DELTA_SWEEP at the "
                                                        "highest sparsity first and use the fastest (recorded in the JSON)")
    ms = sub.add_parser("model-speed", help="decode tokens/s through DeltaModel + DecodeEngine at 8B shapes (CUDA)")
    ms.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ms.add_argument("--group-size", type=int, default=128)
    ms.add_argument("--layers", type=int, default=32, help="decoder blocks (default 32, the 8B model's)")
    ms.add_argument("--deltas", type=int, default=8)
    ms.add_argument("--steps", type=int, default=64, help="decode steps timed per case (default 64)")
    ms.add_argument("--prompt-len", type=int, default=32)
    ms.add_argument("--decode", choices=("auto", "fused", "split"), default="auto",
                    help="the dense steps' route (DeltaModel.configure_kernels(decode=...); default auto)")
    ms.add_argument("--profile", action="store_true", help="also profile the steps of several deltas (dense and each "
                    "sparsity): GPU time per step by kernel kind")
    ro = sub.add_parser("rotation", help="decode-only NLL of a base with its inputs thresholded in rotated bases "
                        "(an experiment: the library thresholds the inputs themselves)")
    ro.add_argument("--base", help="base model folder (e.g. WORK/base of hf_deltazip.bench.real_pairs)")
    ro.add_argument("--tiny", action="store_true", help="a tiny random llama (CPU smoke test)")
    ro.add_argument("--rotations", type=_parse_rotations, default=list(ROTATIONS),
                    help=f"comma list of {', '.join(ROTATIONS)} (default: all)")
    ro.add_argument("--max-length", type=int, default=512)
    for sp in (q, s, ms, ro):
        sp.add_argument("--rank", type=int, default=acts.DEFAULT_RANK,
                        help=f"rank of the low-rank compensation of the dropped inputs (default "
                             f"{acts.DEFAULT_RANK}; 0: none)")
        sp.add_argument("--sparsity", type=_sparsities, default=list(SPARSITIES),
                        help="comma-separated fractions (default 0,0.25,0.4,0.5)")
        sp.add_argument("--json", help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.mode == "speed":
        args.sparsity = sorted(set([0.0] + args.sparsity))
    run, table = {"quality": (run_quality, quality_table), "speed": (run_speed, speed_table),
                  "model-speed": (run_model_speed, model_speed_table),
                  "rotation": (run_rotation, rotation_table)}[args.mode]
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
