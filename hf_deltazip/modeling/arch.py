"""Finding decoder layers and their linear modules in any transformers causal LM."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError

# Hints only: where well-known architectures keep their decoder layers. Anything else is found
# by looking for the largest ModuleList of identical blocks that hold linear layers.
LAYER_HINTS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "transformer.blocks")


def conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return None
    return Conv1D


def is_linear(module: nn.Module) -> bool:
    c = conv1d_class()
    return isinstance(module, nn.Linear) or (c is not None and isinstance(module, c))


def weight_as_nk(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]`` (transformers' Conv1D stores ``[in, out]``)."""
    c = conv1d_class()
    if c is not None and isinstance(module, c):
        return module.weight.t()
    return module.weight


def linear_modules(block: nn.Module) -> dict:
    """Relative name -> nn.Linear / Conv1D inside ``block``."""
    return {name: m for name, m in block.named_modules() if name and is_linear(m)}


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(prefix, layers)``: the model's decoder blocks.

    Raises:
        UnsupportedModelError: no list of identical blocks with linear layers was found.
    """
    for hint in LAYER_HINTS:
        try:
            sub = model.get_submodule(hint)
        except AttributeError:
            continue
        if isinstance(sub, nn.ModuleList) and len(sub) and linear_modules(sub[0]):
            return hint, sub
    best, best_size = None, -1
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(m) for m in mod}) != 1 or not linear_modules(mod[0]):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best_size:
            best, best_size = (name, mod), size
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found no decoder layers (a ModuleList of identical blocks with nn.Linear or "
            "Conv1D layers); hf-deltazip supports transformer causal LMs built that way"
        )
    return best
