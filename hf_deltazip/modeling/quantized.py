"""Bases that do not hold plain weights on one device: bitsandbytes-quantized (4-bit nf4/fp4, 8-bit)
and accelerate-dispatched (``device_map``: several devices, CPU or disk offload).

A :class:`~.layers.DeltaLinear` over such a layer cannot read the base weight (packed codes, or a
weight that only exists while its accelerate hook runs), so it lets the layer compute the base itself
(``base_layer(x)``, through bitsandbytes or the hook) and adds each row's delta on top:
``y = base(x) + x · dequant(Δ_u)ᵀ``. The delta sits on the layer's execution device.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch import nn

from ..quantization import bnb_kind, dequantize_module_weight

__all__ = [
    "base_runs_itself", "execution_device", "unhooked", "is_quantized_model", "dequantize_model", "device_map_problem",
]


def _hook(module: nn.Module):
    return getattr(module, "_hf_hook", None)  # accelerate's documented attribute for a module's hook


def base_runs_itself(module: nn.Module) -> bool:
    """Whether the base layer must compute its own output (quantized, or run through an accelerate hook)."""
    return bnb_kind(module) is not None or _hook(module) is not None


def execution_device(module: nn.Module) -> Optional[torch.device]:
    """Where ``module`` computes: its accelerate hook's execution device (offloaded weights are brought
    there for each forward), else the device of its first parameter that is not on ``meta``."""
    hook = _hook(module)
    for h in getattr(hook, "hooks", [hook]) if hook is not None else []:
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def unhooked(module: nn.Module, device) -> nn.Module:
    """``module`` itself, or, when an accelerate hook runs it, a shallow copy without the hook whose
    offloaded parameters are read from the hook's weights map onto ``device``: what
    ``torch.func.functional_call`` with a fine-tune's parameters needs (the hook would put the base's back)."""
    hook = _hook(module)
    if hook is None:
        return module
    clone = copy.copy(module)
    clone.__dict__.pop("forward", None)  # accelerate's wrapper, set on the instance
    clone.__dict__.pop("_hf_hook", None)
    clone.__dict__["_parameters"] = dict(clone.__dict__["_parameters"])
    weights = getattr(hook, "weights_map", None)
    for name, p in list(clone.named_parameters(recurse=False)):
        if p.device.type == "meta" and weights is not None:
            setattr(clone, name, nn.Parameter(weights[name].to(device), requires_grad=False))
    return clone


def is_quantized_model(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` is a bitsandbytes one."""
    return any(bnb_kind(m) is not None for m in model.modules())


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every bitsandbytes linear layer of ``model`` (in place) by an ``nn.Linear`` holding its
    dequantized weight in its compute dtype; the config forgets the quantization. Returns ``model``."""
    for name, mod in list(model.named_modules()):
        if bnb_kind(mod) is None:
            continue
        w = dequantize_module_weight(mod)
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if mod.bias is not None:
                lin.bias.copy_(mod.bias.to(w.dtype))
        lin.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lin)
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    for attr in ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit"):
        if getattr(model, attr, False):
            setattr(model, attr, False)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    return model


def warn_merge_dequantizes() -> None:
    warnings.warn(
        "merge_and_unload on a bitsandbytes base: the merged model is dequantized (every quantized layer "
        "becomes an nn.Linear in its compute dtype), so it equals base + delta exactly. To serve it quantized "
        "again, save it and load it with quantization_config: re-quantizing rounds the merged weights, "
        "delta included.",
        stacklevel=3,
    )


def device_map_problem(model: nn.Module) -> Optional[str]:
    """Why a static-cache decode engine cannot run ``model`` (spread over devices or offloaded), or ``None``."""
    dm = getattr(model, "hf_device_map", None)
    if not dm:
        return None
    places = {str(v) for v in dm.values()}
    if len(places) <= 1 and not places & {"disk", "meta"}:
        return None
    return (f"the base is dispatched over {sorted(places)} (device_map / offload): the decode engine keeps one "
            "KV cache and one set of decode buffers on a single device. Use DeltaModel.generate(..., "
            "delta_names=[...]) for device-mapped or offloaded bases, or load the base onto one GPU "
            "(device_map={'': 0}, quantized with BitsAndBytesConfig if it does not fit)")
