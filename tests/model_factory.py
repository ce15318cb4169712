"""Tiny bases and 'fine-tunes' (a few optimizer steps on random tokens) shared by the tests."""

import functools

import torch

from hf_deltazip.bench.pairs import resize_embeddings, tiny_model

VOCAB = 96
ARCHS = ("llama", "qwen2", "gpt2", "phi3")


def _finetune_steps(model, seed, steps=3, lr=3e-3):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    vocab = model.get_input_embeddings().weight.shape[0]
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    # plus a seeded nudge everywhere, so every parameter (norms, biases too) really changes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    return model.eval()


@functools.lru_cache(maxsize=None)
def base_model(arch, seed=0):
    return tiny_model(arch, vocab_size=VOCAB, seed=seed, hidden_size=64, num_layers=2)


@functools.lru_cache(maxsize=None)
def finetune(arch, seed, added_tokens=0):
    model = tiny_model(arch, vocab_size=VOCAB, seed=0, hidden_size=64, num_layers=2)
    if added_tokens:
        resize_embeddings(model, VOCAB + added_tokens, seed=seed)
    return _finetune_steps(model, seed)


def calibration_ids(n=8, length=24, seed=0, vocab=VOCAB):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))
