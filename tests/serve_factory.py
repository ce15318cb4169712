"""A tiny served world for the HTTP tests: a llama base saved with its tokenizer, three compressed
fine-tunes (d3 carries its own tokenizer with another chat template), and greedy references."""

import copy
import socket

import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.bench.pairs import build_tokenizer, tiny_model

VOCAB = 300
KEY = "sk-test"
BASE = "tiny-base"
D3_TEMPLATE = ("{% for m in messages %}<|system|>{{ m['content'] }}<|eos|>{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def nudged(base, seed, scale=0.05):
    """A 'fine-tune': the base plus seeded noise everywhere (enough to change greedy answers)."""
    ft = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return ft


def build_world(root):
    """``root/base`` (model + tokenizer), ``root/d1..d3``; returns what the tests compare against."""
    tok = build_tokenizer(save_dir=root / "tok", vocab_size=VOCAB)
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=64, num_layers=2)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    own = copy.deepcopy(tok)
    own.chat_template = D3_TEMPLATE
    calib = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    for i in (1, 2, 3):
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        delta = compress(base, nudged(base, i), cfg, calibration=calib, progress=False,
                         tokenizer=own if i == 3 else None)
        delta.save_pretrained(root / f"d{i}")

    def delta_model():
        m = DeltaModel(copy.deepcopy(base))
        for i in (1, 2, 3):
            m.load_delta(root / f"d{i}", delta_name=f"d{i}", resident=False)
        return m

    return dict(root=root, tok=tok, own=own, delta_model=delta_model, reference=delta_model())


def expected(world, ids, name, n):
    """Greedy ``generate`` for one prompt on the reference model, cut at end-of-sequence, decoded; and its length."""
    model = world["reference"]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         delta_names=[name], max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    if world["tok"].eos_token_id in out:
        out = out[: out.index(world["tok"].eos_token_id)]
    return world["tok"].decode(out, skip_special_tokens=True), len(out)


def chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
