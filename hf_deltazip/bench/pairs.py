"""Trained base / fine-tune pairs for quality benchmarks, built offline.

Quality cannot be measured on random weights: it needs a base and a full-parameter fine-tune that
clearly beats it on its own task. No model hub is reachable, so this module builds such pairs from
nothing:

1. a byte-level BPE tokenizer trained on the Python standard library's own source
   (:func:`build_tokenizer`);
2. a small causal LM of a chosen architecture and size (:func:`tiny_config`, :func:`tiny_model`);
3. a base pre-trained on stdlib source, then a fine-tune that updates *every* parameter on a synthetic
   exact-match task (:func:`build_pair`).

Everything is deterministic under ``seed`` on a given machine and software stack (the stdlib text is
that of the running Python, so another Python version gives another, equally valid, pair).

Example::

    from hf_deltazip.bench.pairs import build_pair
    from hf_deltazip.bench.metrics import exact_match, mean_token_nll

    pair = build_pair("/tmp/pairs/llama-small", arch="llama", size="small")
    tok, ft = pair.load_tokenizer(), pair.load_finetuned()
    print(exact_match(ft, tok, pair.eval_examples), mean_token_nll(ft, tok, pair.eval_texts))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from hf_deltazip.bench import metrics
from hf_deltazip.errors import DeltaZipError

__all__ = [
    "ARCHS",
    "SIZES",
    "TASKS",
    "Pair",
    "TaskExample",
    "build_pair",
    "build_tokenizer",
    "load_pair",
    "make_task_examples",
    "param_count",
    "resize_embeddings",
    "stdlib_documents",
    "tiny_config",
    "tiny_model",
]

# --------------------------------------------------------------------------------------------------
# Tokenizer

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Every turn ends with EOS, so a fine-tune learns to stop after its answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TOKENIZER_TRAIN_CHARS = 3_000_000
_TOKENIZER_INFO = "deltazip_tokenizer.json"

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _stdlib_files(seed: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py") if not _EXCLUDED_DIRS & set(f.relative_to(root).parts[:-1])
    )
    if not files:
        raise DeltaZipError(
            f"No Python source found under the stdlib folder {root}: building a pair needs the "
            "standard library's .py files (install the full Python, not a stripped one)."
        )
    random.Random(seed).shuffle(files)
    return files


def stdlib_documents(seed: int = 0, max_chars: int | None = None, *, held_out: bool = False) -> list[str]:
    """Source files of the running Python's standard library, in a seeded order.

    Args:
        seed: shuffles the file order (so picks which files fill ``max_chars``).
        max_chars: stop once this many characters are collected (``None``: all of them).
        held_out: return files from the *other* end of the order. The last 5 % of files are never
            returned with ``held_out=False``, so held-out text is disjoint from training text.

    Returns:
        One string per file.
    """
    files = _stdlib_files(seed)
    n_held = max(1, len(files) // 20)
    files = files[-n_held:][::-1] if held_out else files[:-n_held]
    docs: list[str] = []
    total = 0
    for path in files:
        if max_chars is not None and total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(text)
            total += len(text)
    return docs


def build_tokenizer(
    save_dir: str | os.PathLike | None = None, vocab_size: int = 512, seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on stdlib source, deterministically.

    The tokenizer has ``<|pad|>`` (id 0), ``<|bos|>`` (1), ``<|eos|>`` (2) and the chat role tokens
    ``<|system|>``, ``<|user|>``, ``<|assistant|>``; it adds no special token on its own when encoding
    (the chat template writes BOS). Its chat template renders
    ``<|bos|><|user|>\\n{content}<|eos|>`` per turn and ``<|assistant|>\\n`` as generation prompt.

    Args:
        save_dir: if given, the tokenizer is loaded from there when it was built before with the same
            ``vocab_size`` and ``seed``, else trained and saved there.
        vocab_size: total vocabulary size (special tokens and the 256 byte tokens included).
        seed: picks which stdlib files it is trained on.

    Returns:
        A ``PreTrainedTokenizerFast``.

    Raises:
        DeltaZipError: ``save_dir`` holds a tokenizer built with other settings.
    """
    n_fixed = 3 + len(ROLE_TOKENS) + 256
    if vocab_size < n_fixed:
        raise DeltaZipError(f"vocab_size={vocab_size} is too small: use at least {n_fixed} (bytes + special tokens).")
    settings = {"vocab_size": vocab_size, "seed": seed}
    if save_dir is not None:
        save_dir = Path(save_dir)
        info_path = save_dir / _TOKENIZER_INFO
        if info_path.exists():
            built = json.loads(info_path.read_text())
            if built != settings:
                raise DeltaZipError(
                    f"{save_dir} holds a tokenizer built with {built}, not {settings}: "
                    "pass another save_dir or delete that folder."
                )
            return AutoTokenizer.from_pretrained(save_dir)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_documents(seed, _TOKENIZER_TRAIN_CHARS), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
        (save_dir / _TOKENIZER_INFO).write_text(json.dumps(settings))
    return tokenizer


# --------------------------------------------------------------------------------------------------
# Models

ARCHS = ("llama", "qwen2", "gpt2", "phi3")

# Architecture shape and training recipe of each size. "kv_heads" is for llama/qwen2 (GQA);
# phi3 and gpt2 use full multi-head attention, like Phi-3-mini and GPT-2.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=4, kv_heads=2, intermediate_size=128, vocab_size=512,
        max_positions=256, seq_len=64, base_batch=16, base_steps=600, base_lr=3e-3,
        ft_batch=32, ft_steps=300, ft_lr=1e-3, n_eval=64,
    ),
    "small": dict(
        hidden_size=384, num_layers=6, num_heads=6, kv_heads=2, intermediate_size=1024, vocab_size=1024,
        max_positions=512, seq_len=128, base_batch=8, base_steps=400, base_lr=1e-3,
        ft_batch=32, ft_steps=300, ft_lr=5e-4, n_eval=200,
    ),
    "50m": dict(
        hidden_size=640, num_layers=12, num_heads=10, kv_heads=2, intermediate_size=1728, vocab_size=4096,
        max_positions=512, seq_len=256, base_batch=32, base_steps=2000, base_lr=6e-4,
        ft_batch=32, ft_steps=600, ft_lr=2e-4, n_eval=200,
    ),
    "100m": dict(
        hidden_size=768, num_layers=12, num_heads=12, kv_heads=4, intermediate_size=2304, vocab_size=8192,
        max_positions=512, seq_len=256, base_batch=32, base_steps=2000, base_lr=6e-4,
        ft_batch=32, ft_steps=600, ft_lr=2e-4, n_eval=200,
    ),
}


def _size(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise DeltaZipError(f"Unknown size {size!r}: pick one of {sorted(SIZES)}.")
    return SIZES[size]


def tiny_config(
    arch: str,
    vocab_size: int,
    *,
    size: str = "tiny",
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
    tie_word_embeddings: bool | None = None,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
) -> PretrainedConfig:
    """A small ``transformers`` config of one of :data:`ARCHS`.

    Shapes come from the ``size`` preset (:data:`SIZES`; "tiny" is hidden 64, 2 layers) unless given.

    - ``llama``: separate q/k/v/o and gate/up/down, GQA (``num_kv_heads`` < ``num_heads``).
    - ``qwen2``: like llama, plus q/k/v biases.
    - ``phi3``: fused ``qkv_proj`` and fused ``gate_up_proj``; multi-head attention unless
      ``num_kv_heads`` is given.
    - ``gpt2``: ``Conv1D`` layers (weights stored transposed), fused ``c_attn``, learned positions,
      tied embeddings; ``intermediate_size`` defaults to 4 x hidden.

    Dropout is off everywhere, so training is deterministic.

    Raises:
        DeltaZipError: unknown ``arch`` or ``size``, or heads that do not divide the hidden size.
    """
    preset = _size(size)
    hidden = hidden_size if hidden_size is not None else preset["hidden_size"]
    layers = num_layers if num_layers is not None else preset["num_layers"]
    heads = num_heads if num_heads is not None else preset["num_heads"]
    positions = max_position_embeddings if max_position_embeddings is not None else preset["max_positions"]
    if hidden % heads:
        raise DeltaZipError(f"hidden_size={hidden} is not a multiple of num_heads={heads}: change one of them.")
    tokens = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
            n_inner=intermediate_size if intermediate_size is not None else 4 * hidden,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
            **tokens,
        )
    if arch not in ARCHS:
        raise DeltaZipError(f"Unknown arch {arch!r}: pick one of {list(ARCHS)}.")
    if num_kv_heads is not None:
        kv = num_kv_heads
    else:
        kv = heads if arch == "phi3" else preset["kv_heads"]
    if heads % kv:
        raise DeltaZipError(f"num_heads={heads} is not a multiple of num_kv_heads={kv}: change one of them.")
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=intermediate_size if intermediate_size is not None else preset["intermediate_size"],
        max_position_embeddings=positions, tie_word_embeddings=bool(tie_word_embeddings),
        attention_dropout=0.0, initializer_range=0.02, **tokens,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    return Phi3Config(**common, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=positions)


def tiny_model(arch: str, vocab_size: int = 512, seed: int = 0, **kw) -> PreTrainedModel:
    """A randomly initialised float32 causal LM from :func:`tiny_config` (``kw`` goes there).

    The same ``seed`` gives the same weights; the global torch RNG is left as it was.
    """
    config = tiny_config(arch, vocab_size, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def param_count(model: torch.nn.Module) -> int:
    """Number of parameters, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())


def resize_embeddings(model: PreTrainedModel, new_vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """Grow the token embeddings (and an untied LM head) to ``new_vocab_size`` rows, in place.

    New rows are the mean of the old rows plus small seeded noise, so the result is deterministic.
    :func:`build_pair` starts its fine-tune from exactly this; use it to score a base on a vocabulary
    that the fine-tune grew.
    """
    old = model.get_input_embeddings().weight.shape[0]
    if new_vocab_size < old:
        raise DeltaZipError(f"resize_embeddings only grows the vocabulary ({old} -> {new_vocab_size} asked).")
    if new_vocab_size == old:
        return model
    model.resize_token_embeddings(new_vocab_size, mean_resizing=False)
    gen = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        mats = [model.get_input_embeddings().weight]
        head = model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != mats[0].data_ptr():
            mats.append(head.weight)
        for w in mats:
            rows = w[:old]
            noise = torch.randn(new_vocab_size - old, w.shape[1], generator=gen) * rows.std(dim=0) * 0.1
            w[old:] = (rows.mean(dim=0) + noise).to(w.dtype)
    return model


# --------------------------------------------------------------------------------------------------
# Tasks

TASKS = ("reverse", "sort", "shift", "mix")
_LETTERS = tuple("abcdefhimnop")  # single tokens with a leading space, even at vocab 512
_MIN_LEN, _MAX_LEN = 2, 6


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One exact-match example: ``prompt`` is the full model input (chat template applied, ending
    with the generation prompt); ``answer`` is what greedy generation must produce before EOS."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The whole transcript without the final EOS (add ``tokenizer.eos_token`` for training)."""
        return self.prompt + self.answer


def _apply_op(op: str, seq: list[str], symbols: Sequence[str]) -> list[str]:
    if op == "reverse":
        return seq[::-1]
    if op == "sort":
        order = {s: i for i, s in enumerate(symbols)}
        return sorted(seq, key=order.__getitem__)
    if op == "shift":  # each symbol becomes the next one in the alphabet, cyclically
        return [symbols[(symbols.index(s) + 1) % len(symbols)] for s in seq]
    raise DeltaZipError(f"Unknown task {op!r}: pick one of {list(TASKS)}.")


def _task_symbols(vocab_added: int) -> list[str]:
    return list(_LETTERS) + _added_tokens(vocab_added)


def _added_tokens(n: int) -> list[str]:
    return [f"<|sym_{i}|>" for i in range(n)]


def _random_example(task: str, rng: random.Random, symbols: Sequence[str], tokenizer) -> TaskExample:
    op = rng.choice(("reverse", "sort", "shift")) if task == "mix" else task
    seq = [rng.choice(symbols) for _ in range(rng.randint(_MIN_LEN, _MAX_LEN))]
    content = f"{op}: {' '.join(seq)}"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return TaskExample(prompt=prompt, answer=" ".join(_apply_op(op, seq, symbols)))


def make_task_examples(
    task: str, n: int, tokenizer, *, seed: int = 0, stream: str = "eval", vocab_added: int = 0,
    exclude: set[str] | None = None,
) -> list[TaskExample]:
    """``n`` distinct examples of ``task``, deterministic in (``task``, ``seed``, ``stream``).

    Tasks work on space-separated letters (plus the fine-tune's added tokens when ``vocab_added``):
    ``reverse`` reverses them, ``sort`` sorts them, ``shift`` maps each to the next letter (z -> a),
    ``mix`` picks one of the three per example. ``exclude`` lists prompts to skip (the held-out set).
    """
    if task not in TASKS:
        raise DeltaZipError(f"Unknown task {task!r}: pick one of {list(TASKS)}.")
    rng = random.Random(f"{task}/{seed}/{stream}")
    symbols = _task_symbols(vocab_added)
    exclude = exclude or set()
    seen: set[str] = set()
    out: list[TaskExample] = []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            return out
        ex = _random_example(task, rng, symbols, tokenizer)
        if ex.prompt not in seen and ex.prompt not in exclude:
            seen.add(ex.prompt)
            out.append(ex)
    raise DeltaZipError(f"Could not draw {n} distinct {task!r} examples: ask for fewer.")


# --------------------------------------------------------------------------------------------------
# Pairs


@dataclasses.dataclass
class Pair:
    """A trained base and a full-parameter fine-tune of it, with the data to score them.

    Attributes:
        base_dir: the base (``save_pretrained`` folder, safetensors, with the base tokenizer).
        finetuned_dir: the fine-tune (same layout, with the fine-tune's tokenizer).
        tokenizer_dir: the tokenizer to evaluate with: the fine-tune's, a superset of the base's
            (the two are identical unless ``vocab_added`` > 0).
        base_tokenizer_dir: the base's tokenizer.
        task: the fine-tune's task (one of :data:`TASKS`).
        eval_examples: held-out exact-match examples (never trained on).
        eval_texts: held-out transcripts of the task domain (for mean token NLL).
        general_texts: held-out stdlib source chunks (how much general ability the fine-tune kept).
        info: build settings, parameter counts, timings and the scores measured at build time.
    """

    base_dir: Path
    finetuned_dir: Path
    tokenizer_dir: Path
    base_tokenizer_dir: Path
    task: str
    eval_examples: list[TaskExample]
    eval_texts: list[str]
    general_texts: list[str]
    info: dict[str, Any]

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """The evaluation (fine-tune's) tokenizer."""
        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def calibration_texts(self, n: int, *, seed: int = 0) -> list[str]:
        """``n`` task transcripts (prompt + answer + EOS) for calibrating a compressor: drawn from a
        stream of their own, disjoint from :attr:`eval_examples`, deterministic in ``seed``."""
        tokenizer = self.load_tokenizer()
        examples = make_task_examples(
            self.task, n, tokenizer, seed=self.info["settings"]["seed"], stream=f"calibration/{seed}",
            vocab_added=self.info["settings"]["vocab_added"], exclude={ex.prompt for ex in self.eval_examples},
        )
        return [ex.text + tokenizer.eos_token for ex in examples]

    def load_finetuned(self, device: str | torch.device = "cpu") -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(self.finetuned_dir, dtype=torch.float32).to(device).eval()

    def load_base(self, device: str | torch.device = "cpu", *, resized: bool = True) -> PreTrainedModel:
        """The base; with ``resized`` (default) its vocabulary is grown like the fine-tune's, so it can
        be scored with :meth:`load_tokenizer` (a no-op unless ``vocab_added`` > 0)."""
        model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        if resized:
            resize_embeddings(model, self.info["finetuned_vocab_size"], seed=self.info["settings"]["seed"])
        return model.to(device).eval()


_PAIR_INFO = "pair.json"  # written last: its presence marks a finished pair
_BASE_INFO = "deltazip_base.json"  # written after the base is saved: lets a rerun skip base training
_EVAL_DATA = "eval_data.json"


def build_pair(
    out_dir: str | os.PathLike,
    *,
    arch: str = "llama",
    size: str = "tiny",
    task: str = "sort",
    seed: int = 0,
    base_steps: int | None = None,
    ft_steps: int | None = None,
    device: str | torch.device = "cpu",
    vocab_added: int = 0,
    n_eval: int | None = None,
    evaluate: bool = True,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> Pair:
    """Build (or reuse) a base / full fine-tune pair in ``out_dir``.

    The base is trained from scratch with the causal LM loss on stdlib source; the fine-tune starts
    from it and trains every parameter on ``task`` (loss on the answers as in supervised fine-tuning,
    prompt tokens weighted :data:`PROMPT_LOSS_WEIGHT`). With
    ``vocab_added`` > 0 the fine-tune first adds that many tokens (``<|sym_0|>``, ...) to the
    tokenizer, grows the embeddings (:func:`resize_embeddings`) and uses the new tokens as extra task
    symbols, so every new row is trained. Tied embeddings stay tied (gpt2 ties them).

    Layout: ``out_dir/tokenizer`` (base tokenizer), ``out_dir/base``, ``out_dir/finetuned``,
    ``out_dir/eval_data.json``, and ``out_dir/pair.json`` (settings, parameter counts, timings and
    scores), written last. A finished pair with the same settings is loaded instead of rebuilt; a
    finished base is reused when only the fine-tune is missing.

    Args:
        out_dir: folder of the pair (created).
        arch: one of :data:`ARCHS`.
        size: one of :data:`SIZES` ("tiny": CPU seconds; "small": CPU minutes; "50m"/"100m": GPU).
        task: one of :data:`TASKS`. "sort" (the default) is learned fastest: about 0.94 exact match
            at "small" after its 300 steps, where "reverse" reaches about 0.6.
        seed: seeds the tokenizer's files, the initial weights, the data order and the tasks.
        base_steps, ft_steps: optimizer steps (default: the size's recipe).
        device: where to train, e.g. "cpu" or "cuda" (bf16 autocast on CUDA; weights stay float32).
        vocab_added: new tokens that the fine-tune adds.
        n_eval: held-out examples (default: the size's recipe).
        evaluate: score base and fine-tune into ``pair.info["scores"]`` (exact match, NLL).
        log: called with progress lines (default: silent).
        progress: a tqdm bar per training run (``None``: only when stderr is a terminal).

    Returns:
        The :class:`Pair`.

    Raises:
        DeltaZipError: ``out_dir`` holds a pair built with other settings, or an argument is unknown.
    """
    preset = _size(size)
    if arch not in ARCHS:
        raise DeltaZipError(f"Unknown arch {arch!r}: pick one of {list(ARCHS)}.")
    if task not in TASKS:
        raise DeltaZipError(f"Unknown task {task!r}: pick one of {list(TASKS)}.")
    if vocab_added < 0:
        raise DeltaZipError(f"vocab_added={vocab_added} must be >= 0.")
    say = log or (lambda _msg: None)
    out = Path(out_dir)
    settings = dict(
        arch=arch, size=size, task=task, seed=seed,
        base_steps=preset["base_steps"] if base_steps is None else base_steps,
        ft_steps=preset["ft_steps"] if ft_steps is None else ft_steps,
        vocab_added=vocab_added, n_eval=preset["n_eval"] if n_eval is None else n_eval,
    )
    if (out / _PAIR_INFO).exists():
        return load_pair(out, expect=settings)

    device = torch.device(device)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir, base_dir, ft_dir = out / "tokenizer", out / "base", out / "finetuned"
    tokenizer = build_tokenizer(tok_dir, vocab_size=preset["vocab_size"], seed=seed)
    timings: dict[str, float] = {}

    # ---- base
    base_settings = {k: settings[k] for k in ("arch", "size", "seed", "base_steps")}
    base_info_path = base_dir / _BASE_INFO
    if base_info_path.exists() and json.loads(base_info_path.read_text())["settings"] == base_settings:
        say(f"reusing base in {base_dir}")
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        timings["base_train_s"] = json.loads(base_info_path.read_text())["train_s"]
    else:
        base = tiny_model(arch, len(tokenizer), seed=seed, size=size)
        t0 = time.perf_counter()
        batches = _lm_batches(tokenizer, seed, settings["base_steps"], preset["base_batch"], preset["seq_len"])
        train_model(base, batches, settings["base_steps"], preset["base_lr"], 0.1, device, say, "base", progress)
        timings["base_train_s"] = time.perf_counter() - t0
        base.to("cpu").save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        write_json(base_info_path, {"settings": base_settings, "train_s": timings["base_train_s"]})

    # ---- fine-tune
    ft_tokenizer = build_tokenizer(tok_dir, vocab_size=preset["vocab_size"], seed=seed)
    if vocab_added:
        ft_tokenizer.add_tokens(_added_tokens(vocab_added))
    eval_examples = make_task_examples(task, settings["n_eval"], ft_tokenizer, seed=seed, vocab_added=vocab_added)
    eval_texts = [ex.text + ft_tokenizer.eos_token for ex in eval_examples]
    general_texts = _general_texts(seed)
    write_json(out / _EVAL_DATA, {
        "eval_examples": [dataclasses.asdict(ex) for ex in eval_examples],
        "eval_texts": eval_texts, "general_texts": general_texts,
    })

    ft = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    resize_embeddings(ft, len(ft_tokenizer), seed=seed)
    t0 = time.perf_counter()
    batches = _task_batches(ft_tokenizer, task, seed, vocab_added, preset["ft_batch"], {ex.prompt for ex in eval_examples})
    train_model(ft, batches, settings["ft_steps"], preset["ft_lr"], 0.0, device, say, "finetune", progress)
    timings["ft_train_s"] = time.perf_counter() - t0
    ft.to("cpu")
    ft.generation_config.eos_token_id = ft_tokenizer.eos_token_id
    ft.save_pretrained(ft_dir)
    ft_tokenizer.save_pretrained(ft_dir)

    info: dict[str, Any] = {
        "settings": settings,
        "recipe": {k: preset[k] for k in ("seq_len", "base_batch", "base_lr", "ft_batch", "ft_lr")},
        "base_vocab_size": len(tokenizer),
        "finetuned_vocab_size": len(ft_tokenizer),
        "base_params": param_count(base),
        "finetuned_params": param_count(ft),
        "tied_embeddings": bool(getattr(ft.config, "tie_word_embeddings", False)),
        "delta_rel_norm": delta_rel_norm(base, ft),
        "timings": timings,
        "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
    }
    if evaluate:
        t0 = time.perf_counter()
        base_eval = resize_embeddings(base.to("cpu"), len(ft_tokenizer), seed=seed).to(device).eval()
        info["scores"] = {
            name: _score(model.to(device).eval(), ft_tokenizer, eval_examples, eval_texts, general_texts)
            for name, model in (("base", base_eval), ("finetuned", ft))
        }
        timings["eval_s"] = time.perf_counter() - t0
        say(f"scores: {info['scores']}")
    write_json(out / _PAIR_INFO, info)
    return load_pair(out)


def load_pair(out_dir: str | os.PathLike, *, expect: dict[str, Any] | None = None) -> Pair:
    """Load a pair that :func:`build_pair` finished in ``out_dir``.

    Raises:
        DeltaZipError: no finished pair there, or (with ``expect``) one built with other settings.
    """
    out = Path(out_dir)
    if not (out / _PAIR_INFO).exists():
        raise DeltaZipError(f"{out} holds no finished pair (no {_PAIR_INFO}): build it with build_pair().")
    info = json.loads((out / _PAIR_INFO).read_text())
    if expect is not None and info["settings"] != expect:
        raise DeltaZipError(
            f"{out} holds a pair built with {info['settings']}, not {expect}: "
            "pass another out_dir or delete that folder."
        )
    data = json.loads((out / _EVAL_DATA).read_text())
    return Pair(
        base_dir=out / "base",
        finetuned_dir=out / "finetuned",
        tokenizer_dir=out / "finetuned",
        base_tokenizer_dir=out / "tokenizer",
        task=info["settings"]["task"],
        eval_examples=[TaskExample(**ex) for ex in data["eval_examples"]],
        eval_texts=data["eval_texts"],
        general_texts=data["general_texts"],
        info=info,
    )


# --------------------------------------------------------------------------------------------------
# Training internals

# input_ids, attention_mask, and the loss weight of each token as a target (0: not predicted)
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
PROMPT_LOSS_WEIGHT = 0.1


def _lm_batches(tokenizer, seed: int, steps: int, batch: int, seq_len: int) -> Iterator[Batch]:
    """Random windows of the tokenized stdlib stream, ``<|bos|> file <|eos|>`` per file."""
    need = max(steps * batch * seq_len, 50_000)
    # ~0.4 tokens per character at a 512 vocabulary, fewer at larger ones; 3x covers both.
    docs = stdlib_documents(seed, max_chars=3 * need)
    stream: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        stream += [tokenizer.bos_token_id, *enc.ids, tokenizer.eos_token_id]
    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    ones = torch.ones(batch, seq_len, dtype=torch.long)
    weights = torch.ones(batch, seq_len)
    weights[:, 0] = 0.0
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
        ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        yield ids, ones, weights


def _task_batches(tokenizer, task: str, seed: int, vocab_added: int, batch: int, held_out: set[str]) -> Iterator[Batch]:
    """Endless fresh task examples (held-out prompts skipped), right-padded.

    The answer and its EOS carry the loss, as in supervised fine-tuning; prompt tokens carry
    :data:`PROMPT_LOSS_WEIGHT` of it, so the fine-tune also learns the task's text (its held-out NLL
    drops) without the random prompt symbols drowning the answer's signal. Prompt and answer are
    tokenized apart, exactly as generation sees them.
    """
    rng = random.Random(f"{task}/{seed}/train")
    symbols = _task_symbols(vocab_added)
    while True:
        examples: list[TaskExample] = []
        while len(examples) < batch:
            ex = _random_example(task, rng, symbols, tokenizer)
            if ex.prompt not in held_out:
                examples.append(ex)
        yield example_batch(tokenizer, examples)


def example_batch(tokenizer, examples: Sequence[TaskExample], *, answer_prefix: str = "") -> Batch:
    """One right-padded training batch of ``prompt + answer_prefix + answer + EOS`` transcripts.

    The answer and its EOS carry the loss, as in supervised fine-tuning; prompt tokens carry
    :data:`PROMPT_LOSS_WEIGHT` of it. Prompt and answer are tokenized apart, exactly as generation
    sees them.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    prompts = tokenizer([ex.prompt for ex in examples], add_special_tokens=False)["input_ids"]
    answers = tokenizer([answer_prefix + ex.answer for ex in examples], add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    weights = torch.zeros((len(examples), width))
    for row, (p, a) in enumerate(zip(prompts, answers)):
        seq = [*p, *a, eos]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        weights[row, 1 : len(p)] = PROMPT_LOSS_WEIGHT
        weights[row, len(p) : len(seq)] = 1.0
    return ids, mask, weights


def train_model(model, batches: Iterator[Batch], steps: int, lr: float, weight_decay: float, device, say, name: str,
           progress: bool | None = None) -> None:
    """AdamW, linear warm-up then cosine decay to 10 %, gradient clipping at 1; the loss is the
    weighted mean next-token NLL."""
    model.to(device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    bar = tqdm(range(steps), desc=f"training {name}", unit="step", leave=False,
               disable=None if progress is None else not progress)
    for step in bar:
        ids, mask, weights = (t.to(device) for t in next(batches))
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * weights[:, 1:]).sum() / weights[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            say(f"{name} step {step + 1}/{steps} loss {loss.item():.4f}")
    model.eval()


def _general_texts(seed: int, n: int = 16, chars: int = 1500) -> list[str]:
    texts: list[str] = []
    for doc in stdlib_documents(seed, held_out=True):
        for start in range(0, len(doc) - chars + 1, chars):
            texts.append(doc[start : start + chars])
            if len(texts) == n:
                return texts
    return texts


def _score(model, tokenizer, examples, texts, general_texts) -> dict[str, float]:
    max_new = max(len(tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) for ex in examples) + 2
    return {
        "exact_match": metrics.exact_match(model, tokenizer, examples, max_new_tokens=max_new),
        "task_nll": metrics.mean_token_nll(model, tokenizer, texts),
        "general_nll": metrics.mean_token_nll(
            model, tokenizer, general_texts, max_length=min(512, model.config.max_position_embeddings)
        ),
    }


def delta_rel_norm(base, ft) -> float:
    """||W_ft - W_base|| / ||W_base|| over all parameters of the base's shape (new rows excluded)."""
    num = den = 0.0
    base_params = dict(base.named_parameters())
    for name, p in ft.named_parameters():
        b = base_params[name].detach().to("cpu")
        f = p.detach().to("cpu")[tuple(slice(0, s) for s in b.shape)]
        num += float((f - b).double().pow(2).sum())
        den += float(b.double().pow(2).sum())
    return math.sqrt(num / den)


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__

_train = train_model  # the name older callers use
