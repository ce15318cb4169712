"""bitsandbytes-quantized linear layers, as primitives: recognise one, read its weight back as floats,
bound the rounding its quantizer made, and predict what it will hold (the quantize -> dequantize round
trip of a float weight).

Nothing here imports bitsandbytes at import time: a module can only be a bitsandbytes layer once
bitsandbytes has been imported (by transformers, when it loads a quantized base), so until then every
check answers "not quantized" without importing it.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from .errors import DeltaZipError

__all__ = [
    "bnb_kind", "quantized_param_kind", "logical_weight_shape", "dequantize_module_weight", "dequantize_param",
    "rounding_bound", "round_trip_weight", "quantization_settings",
]


def _bnb_nn():
    if "bitsandbytes" not in sys.modules:
        return None
    import bitsandbytes.nn as bnn

    return bnn


def bnb_kind(module: nn.Module) -> Optional[str]:
    """``"4bit"`` (``Linear4bit``: nf4 / fp4), ``"8bit"`` (``Linear8bitLt``) or ``None`` (not bitsandbytes)."""
    bnn = _bnb_nn()
    if bnn is None:
        return None
    if isinstance(module, bnn.Linear4bit):
        return "4bit"
    if isinstance(module, bnn.Linear8bitLt):
        return "8bit"
    return None


def quantized_param_kind(t: torch.Tensor) -> Optional[str]:
    """``"4bit"`` / ``"8bit"`` for a bitsandbytes weight parameter (``Params4bit`` / ``Int8Params``), else ``None``."""
    bnn = _bnb_nn()
    if bnn is None:
        return None
    if isinstance(t, bnn.Params4bit):
        return "4bit"
    if isinstance(t, bnn.Int8Params):
        return "8bit"
    return None


def logical_weight_shape(module: nn.Module) -> Optional[tuple]:
    """``(out, in)`` of a bitsandbytes linear layer (its ``weight`` holds packed codes), else ``None``."""
    if bnb_kind(module) is None:
        return None
    return (module.out_features, module.in_features)


def _int8_row_scales(module: Optional[nn.Module], w: torch.Tensor) -> Optional[torch.Tensor]:
    # bitsandbytes keeps the per-row absmax on the parameter until the first forward, then on the module's state
    scb = getattr(w, "SCB", None)
    if scb is None and module is not None:
        scb = getattr(getattr(module, "state", None), "SCB", None)
    return scb


def dequantize_param(t: torch.Tensor, module: Optional[nn.Module] = None, dtype=torch.float32) -> Optional[torch.Tensor]:
    """The float ``[out, in]`` weight a bitsandbytes parameter stands for (``None`` when it cannot be
    read back: an 8-bit weight whose row scales moved to a module that was not given)."""
    kind = quantized_param_kind(t)
    if kind == "4bit":
        import bitsandbytes.functional as bf

        state = t.quant_state
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacked it for its AVX512-BF16 CPU kernel on a forward; saving puts it back
            if module is None:
                return None
            module.state_dict()
            t, state = module.weight, module.weight.quant_state
        if state is None:
            return None
        return bf.dequantize_4bit(t.data, state).to(dtype)
    if kind == "8bit":
        scb = _int8_row_scales(module, t)
        if scb is None:
            return None
        return t.data.to(dtype) * (scb.to(t.device, dtype)[:, None] / 127.0)
    raise DeltaZipError(f"not a bitsandbytes weight: {type(t).__name__}")


def dequantize_module_weight(module: nn.Module, dtype=None) -> torch.Tensor:
    """The float ``[out, in]`` weight a ``Linear4bit`` / ``Linear8bitLt`` computes with (default dtype:
    its compute dtype, else float32)."""
    if bnb_kind(module) is None:
        raise DeltaZipError(f"{type(module).__name__} is not a bitsandbytes linear layer")
    if dtype is None:
        dtype = getattr(module, "compute_dtype", None) or (module.bias.dtype if module.bias is not None else torch.float32)
    w = dequantize_param(module.weight, module, torch.float32)
    if w is None:
        raise DeltaZipError(f"{type(module).__name__}: its quantization state is missing; was it moved off its device?")
    return w.to(dtype)


def rounding_bound(t: torch.Tensor, dequantized: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
    """For each flat index, how far the original float value can lie from ``dequantized`` there: half the
    widest gap of the quantization grid, scaled by that value's block (4-bit) or row (8-bit) absmax,
    plus a margin for the double-quantized block scales. A different checkpoint misses it by far more."""
    flat = dequantized.reshape(-1).float()
    kind = quantized_param_kind(t)
    if kind == "4bit":
        state = t.quant_state
        code = state.code.float().sort().values
        half_gap = float((code[1:] - code[:-1]).max()) / 2
        block = state.blocksize
        starts = (flat_idx // block) * block
        absmax = torch.stack([flat[s: s + block].abs().max() for s in starts.tolist()])
        return absmax * (half_gap + 0.03) + 1e-6
    if kind == "8bit":
        k = dequantized.shape[-1]
        rows = dequantized.reshape(-1, k)
        absmax = rows.abs().max(dim=1).values[flat_idx // k]
        return absmax * (0.5 / 127 * 1.05) + 1e-6
    raise DeltaZipError(f"not a bitsandbytes weight: {type(t).__name__}")


def quantization_settings(config) -> dict:
    """The JSON facts of a ``BitsAndBytesConfig`` (or a dict of its fields) that decide the stored weights."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if d.get("load_in_4bit"):
        out = {"method": "bitsandbytes", "bits": 4, "quant_type": d.get("bnb_4bit_quant_type", "fp4"),
               "double_quant": bool(d.get("bnb_4bit_use_double_quant", False))}
    elif d.get("load_in_8bit"):
        out = {"method": "bitsandbytes", "bits": 8}
    else:
        raise DeltaZipError(
            "base_quantization must be a BitsAndBytesConfig with load_in_4bit=True or load_in_8bit=True, "
            f"got {d.get('quant_method', type(config).__name__)} without either"
        )
    skip = d.get("llm_int8_skip_modules")
    if skip:
        out["skip_modules"] = list(skip)
    return out


def round_trip_weight(w: torch.Tensor, settings: dict) -> torch.Tensor:
    """What a bitsandbytes layer made from float weight ``w`` ``[out, in]`` computes with: quantized the
    way transformers quantizes it on load, then dequantized, in ``w``'s dtype."""
    import bitsandbytes.functional as bf

    if settings["bits"] == 4:
        q, state = bf.quantize_4bit(w.contiguous(), blocksize=64, compress_statistics=settings["double_quant"],
                                    quant_type=settings["quant_type"])
        return bf.dequantize_4bit(q, state).to(w.dtype)
    if settings["bits"] == 8:
        q, scb, _ = bf.int8_vectorwise_quant(w.contiguous().half())  # Int8Params quantizes from float16
        return (q.float() * (scb.float()[:, None] / 127.0)).to(w.dtype)
    raise DeltaZipError(f"bitsandbytes quantizes to 4 or 8 bits, not {settings['bits']}")
