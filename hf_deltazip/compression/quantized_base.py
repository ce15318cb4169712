"""Compressing a delta for a base that will be served quantized (bitsandbytes 4-bit or 8-bit).

A delta made against the float base and served on a 4-bit base also carries the base's quantization
error. Here the delta is made against what the quantized base computes with: every linear layer that
transformers would quantize is replaced by its quantize -> dequantize round trip (bitsandbytes' own
quantizer, as on load), so the calibration inputs flow through the quantized base plus the deltas
already compressed, and ``Δ = W_ft − dequant(quant(W_base))`` absorbs part of the rounding.

The delta still records the float base (its name and fingerprint: users load that checkpoint with a
``quantization_config``) and, in ``extra["base_quantization"]``, the settings it was made for.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from ..delta import recorded_location
from ..fingerprint import base_fingerprint
from ..format import DeltaHeader
from ..quantization import quantization_settings, round_trip_weight

__all__ = ["round_trip_base", "compress_for_quantized_base"]


def round_trip_base(base: nn.Module, settings: dict) -> nn.Module:
    """A copy of ``base`` whose quantizable linear weights hold what bitsandbytes will compute with
    (every ``nn.Linear`` but the LM head and ``skip_modules``, as transformers quantizes)."""
    model = copy.deepcopy(base)
    head = model.get_output_embeddings()
    skip = set(settings.get("skip_modules", ()))
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or mod is head or any(s in name.split(".") or name == s for s in skip):
                continue
            mod.weight.copy_(round_trip_weight(mod.weight.detach(), settings))
    return model


def compress_for_quantized_base(compress: Callable, base, finetuned, base_quantization, load_base: Callable, **kwargs):
    """``compress(base, finetuned, **kwargs)`` against the round-tripped base; the header keeps the float
    base's fingerprint and records the quantization settings."""
    settings = quantization_settings(base_quantization)
    base_m = load_base(base)
    fingerprint = base_fingerprint(base_m)
    delta = compress(round_trip_base(base_m, settings), finetuned, **kwargs)
    header = delta.header if isinstance(delta.header, DeltaHeader) else DeltaHeader.from_dict(delta.header)
    header.base_fingerprint = fingerprint
    header.extra = {**header.extra, "base_quantization": settings}
    # the float checkpoint as given, so loaders find it again (not the in-memory round-tripped copy)
    header.base_model, header.base_source = recorded_location(base, base_m)
    delta.header = header
    return delta
