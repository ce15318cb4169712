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


def merged_by_hand(base, delta):
    """A copy of ``base`` plus each of ``delta``'s dequantized modules, its exact parameters as stored: the model a
    served delta must equal."""
    import copy

    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, mod in delta.modules.items():
            w = merged.get_submodule(name).weight
            d = mod.dequantize()
            w.copy_(w.float() + (d.t() if mod.transposed else d))  # transformers' Conv1D stores [K, N]
        for name, t in delta.params.items():
            merged.get_parameter(name).copy_(t)
    return merged


def calibration_ids(n=8, length=24, seed=0, vocab=VOCAB):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


# --- the architecture matrix (tests/test_architectures.py): one tiny config per decoder family ----------
MATRIX_VOCAB = 128
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _attention(**kw):
    """Shapes shared by the llama-like configs: hidden 32, 2 layers, 4 query and 2 key/value heads."""
    return dict(vocab_size=MATRIX_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0) | kw


def _matrix_configs():
    import transformers as t

    tokens = dict(vocab_size=MATRIX_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "llama": lambda: t.LlamaConfig(**_attention()),
        "mistral": lambda: t.MistralConfig(**_attention(sliding_window=8)),
        "qwen2": lambda: t.Qwen2Config(**_attention()),
        "qwen3": lambda: t.Qwen3Config(**_attention(head_dim=8)),
        "gemma": lambda: t.GemmaConfig(**_attention(head_dim=8)),  # tied, scaled embeddings, 1 + w norms
        "gemma2": lambda: t.Gemma2Config(**_attention(head_dim=8, sliding_window=8)),  # + soft-capping
        "gemma3_text": lambda: t.Gemma3TextConfig(**_attention(head_dim=8, sliding_window=8)),  # + q/k norms
        "phi3": lambda: t.Phi3Config(**_attention(num_key_value_heads=4, original_max_position_embeddings=64)),
        "gpt2": lambda: t.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **tokens),  # Conv1D, tied
        "gpt_neox": lambda: t.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64, **tokens),
        "opt": lambda: t.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                   max_position_embeddings=64, word_embed_proj_dim=32, **tokens),  # learned positions
        "falcon": lambda: t.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=64, **tokens),  # multi-query, parallel attention
        "mixtral": lambda: t.MixtralConfig(**_attention(num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**_attention(**moe, shared_expert_intermediate_size=32)),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**_attention(**moe, head_dim=8)),
    }


MATRIX_ARCHS = tuple(_matrix_configs())


@functools.lru_cache(maxsize=None)
def matrix_model(arch, seed=0, **config_kw):
    """A float32 random tiny model of ``arch`` (a key of :data:`MATRIX_ARCHS`); ``config_kw`` overrides its config."""
    from transformers import AutoModelForCausalLM

    config = _matrix_configs()[arch]()
    for key, value in config_kw.items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def matrix_finetune(arch, seed):
    """``matrix_model(arch)`` after a few steps on random tokens and a seeded nudge of every parameter."""
    import copy

    return _finetune_steps(copy.deepcopy(matrix_model(arch)), seed)
