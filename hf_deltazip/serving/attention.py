"""Grouped-query attention for decode steps without copying keys and values per query head.

transformers' ``sdpa`` attention gives PyTorch's ``scaled_dot_product_attention`` an attention mask
(DecodeEngine always passes one: rows sit at different positions of one static cache). With a mask,
transformers up to about 5.20 expands the keys and values of a grouped-query model to one copy per
query head (``repeat_kv``) before the call: at 8B shapes (8 key/value heads for 32 query heads), a
batch of 32 and a 512-entry cache, that writes and reads again about 17 GB in every decode step, as
much as the weights themselves. Newer releases fold the query heads of a one-token step into the
rows of their key/value head instead (the same arithmetic).

:func:`grouped_sdpa_attention` does that fold for one-token steps on every transformers version and
hands every other call to transformers' own ``sdpa`` function unchanged. :func:`use_grouped_attention`
registers it (transformers' ``AttentionInterface``, the documented way to add an attention function)
and switches a model that uses ``sdpa`` and has grouped-query heads to it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["GROUPED_SDPA", "grouped_sdpa_attention", "use_grouped_attention"]

#: the name the grouped function is registered under
GROUPED_SDPA = "deltazip_grouped_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs) -> tuple:
    """transformers' attention-function signature. A one-token step of a grouped-query layer (``query``
    ``[B, Hq, 1, D]``, ``key``/``value`` ``[B, Hkv, L, D]``, a mask shared by all heads) runs as
    ``[B, Hkv, Hq/Hkv, D]`` queries against the keys as they are; anything else goes to ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    plain = (groups <= 1 or q_len != 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("output_attentions") or heads != key.shape[1] * groups
             or (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, heads // groups, groups, dim), key, value, attn_mask=attention_mask,
        dropout_p=dropout, scale=scaling, is_causal=False,
    )
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`grouped_sdpa_attention` when it
    has grouped-query heads; returns whether the model now runs it. ``model.set_attn_implementation("sdpa")``
    undoes it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == GROUPED_SDPA:  # switched before (by another engine on this model)
        return True
    if current != "sdpa":
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not heads or not kv_heads or kv_heads >= heads:
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks sdpa gets, for generate() and friends
    model.set_attn_implementation(GROUPED_SDPA)
    return True
