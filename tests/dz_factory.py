"""Small, valid deltas built without a model, for format and CLI tests."""

import torch

from hf_deltazip.config import DeltaZipConfig
from hf_deltazip.delta import CompressedDelta, PackedModule
from hf_deltazip.packing import compute_qparams, quantize


def two_four_mask(n, k, gen):
    scores = torch.rand(n, k // 4, 4, generator=gen)
    keep = scores.argsort(-1)[..., :2]
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool)
    mask.scatter_(-1, keep, True)
    return mask.reshape(n, k)


def packed_module(n, k, bits, group_size, symmetric, layout, gen, kind="linear", scale=0.01):
    w = torch.randn(n, k, generator=gen) * scale
    scales, zeros = compute_qparams(w, bits, group_size, symmetric)
    codes = quantize(w, scales, zeros, bits, group_size)
    mask = None
    if layout == "2:4":
        mask = two_four_mask(n, k, gen)
    elif layout == "bitmask":
        mask = torch.rand(n, k, generator=gen) > 0.6
    if mask is not None:
        zero_codes = zeros.repeat_interleave(k if group_size == -1 else group_size, 1)[:, :k]
        codes = torch.where(mask, codes, zero_codes)
    return PackedModule.from_codes(
        codes, scales, zeros, mask, bits=bits, group_size=group_size, symmetric=symmetric,
        two_four=layout == "2:4", kind=kind,
    )


def small_delta(seed=0) -> CompressedDelta:
    gen = torch.Generator().manual_seed(seed)
    modules = {
        "model.layers.0.self_attn.q_proj": packed_module(24, 40, 4, 32, True, "dense", gen),
        "model.layers.0.mlp.up_proj": packed_module(36, 40, 2, -1, False, "2:4", gen),
        "model.layers.0.mlp.down_proj": packed_module(40, 36, 3, 32, False, "bitmask", gen),
        "model.embed_tokens": packed_module(50, 40, 8, -1, True, "dense", gen, kind="embedding"),
    }
    params = {
        "model.norm.weight": torch.randn(40, generator=gen),
        "model.layers.0.mlp.up_proj.bias": torch.randn(36, generator=gen).to(torch.bfloat16),
    }
    header = {
        "base_model": "tests/base", "base_revision": None, "finetuned_model": "tests/ft",
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "extra": {"finetune_num_params": 24 * 40 + 36 * 40 + 40 * 36 + 50 * 40 + 40 + 36},
    }
    return CompressedDelta(config=DeltaZipConfig(bits=4, zstd_level=3), modules=modules, params=params, header=header)


def copy_with_corrupt_last_tensor(folder, dest):
    """A copy of the delta folder ``folder`` at ``dest`` whose last stored tensor (in file order) has a flipped
    byte, so every piece read before it is fine. Returns that tensor's name."""
    import shutil

    from hf_deltazip.format import DZ_FILENAME, DeltaZipFile

    shutil.copytree(folder, dest)
    data = bytearray((dest / DZ_FILENAME).read_bytes())
    with DeltaZipFile(dest / DZ_FILENAME) as dz:
        last = dz.in_file_order()[-1]
        _, end = dz._spans[last]
    data[end - 1] ^= 0xFF
    (dest / DZ_FILENAME).write_bytes(bytes(data))
    return last
