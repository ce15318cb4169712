"""A cheap fingerprint of a base model's weights, to catch a delta applied to the wrong base.

docs/format.md, section 6: for every parameter, its shape, dtype and 8 values sampled at evenly
spaced flat indices. A base loaded in another dtype still matches (the recorded values are cast to
the loaded dtype before an exact comparison); a different base, or a fine-tune passed as base, does not.

A base quantized by bitsandbytes (4-bit nf4/fp4, 8-bit) is checked on its dequantized weights: each
sampled value must lie within the rounding its quantizer can make there (half the widest step of the
grid times that block's or row's absmax). That still refuses another checkpoint, but a fine-tune passed
as a quantized base can pass (its weights differ from the base's by less than 4-bit rounding).
"""

from __future__ import annotations

from typing import Optional

import torch

from .errors import BaseMismatchError
from .quantization import dequantize_param, quantized_param_kind, rounding_bound

FINGERPRINT_VERSION = 1
SAMPLES = 8
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _sample_indices(n: int) -> torch.Tensor:
    count = min(SAMPLES, n)
    # integer arithmetic: float linspace rounds past the last index on tensors of 2**24+ elements
    return (torch.arange(count, dtype=torch.int64) * (n - 1)) // max(count - 1, 1)


def _sample(t: torch.Tensor) -> list:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return []
    idx = _sample_indices(flat.numel()).to(flat.device)
    return [float(v) for v in flat[idx].float().cpu()]


def _quantized_shape(t: torch.Tensor, kind: str) -> list:
    """The ``[out, in]`` shape a bitsandbytes weight stands for (4-bit ones hold packed bytes)."""
    if kind == "4bit" and t.quant_state is not None:
        return list(t.quant_state.shape)
    return list(t.shape)


def _named_tensors(model_or_state_dict) -> dict:
    if isinstance(model_or_state_dict, dict):
        return dict(model_or_state_dict)
    return dict(model_or_state_dict.named_parameters())


def base_fingerprint(model_or_state_dict) -> dict:
    """The fingerprint of a model (or state dict) as stored in a ``.dz`` header."""
    params = {}
    for name, t in _named_tensors(model_or_state_dict).items():
        kind = quantized_param_kind(t)
        if kind is not None:  # the original values are gone: shape and format only
            params[name] = {"shape": _quantized_shape(t, kind), "dtype": f"bitsandbytes-{kind}"}
            continue
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        if t.dtype in _FLOAT_DTYPES and t.device.type != "meta":
            entry["sample"] = _sample(t)
        params[name] = entry
    return {"version": FINGERPRINT_VERSION, "params": params}


def load_onto_hint(base_model: Optional[str], model_type: Optional[str] = None) -> str:
    """The fix a base-mismatch error names: the delta's own base, by name where the delta records one."""
    if base_model:
        return f"load the delta onto its own base: {base_model!r}"
    kind = f"{model_type!r} " if model_type else ""
    return f"load the delta onto the {kind}base it was compressed from (the delta does not record its name)"


def check_fingerprint(fingerprint: dict, model, *, base_name: str = "the base model",
                      expected_base: Optional[str] = None) -> None:
    """Raise :class:`BaseMismatchError` unless ``model`` is the base ``fingerprint`` was taken from
    (``expected_base``: that base's name, when the delta records one)."""
    if not fingerprint or not fingerprint.get("params"):
        return
    actual = _named_tensors(model)
    hint = load_onto_hint(expected_base)
    for name, rec in fingerprint["params"].items():
        t = actual.get(name)
        if t is None:
            raise BaseMismatchError(f"{base_name} has no parameter {name!r} that the delta was made against; {hint}")
        kind = quantized_param_kind(t)
        if kind is not None:
            _check_quantized(name, rec, t, kind, base_name, hint)
            continue
        if t.dtype not in _FLOAT_DTYPES:
            continue
        if list(t.shape) != list(rec["shape"]):
            raise BaseMismatchError(
                f"{base_name}: {name} has shape {list(t.shape)} but the delta was made against {rec['shape']}; {hint}"
            )
        sample = rec.get("sample")
        if not sample or t.device.type == "meta":
            continue
        expected = torch.tensor(sample, dtype=torch.float32).to(t.dtype)
        got = torch.tensor(_sample(t), dtype=torch.float32).to(t.dtype)
        if not torch.equal(expected, got):
            raise BaseMismatchError(
                f"{base_name}: the weights of {name} differ from those the delta was made against "
                f"(another checkpoint, or the fine-tune itself?); {hint}"
            )


def _check_quantized(name: str, rec: dict, t: torch.Tensor, kind: str, base_name: str, hint: str) -> None:
    """A bitsandbytes weight against the float base's record: its logical shape, then each sampled
    value within the quantizer's rounding of the dequantized weight."""
    shape = _quantized_shape(t, kind)
    if shape != list(rec["shape"]):
        raise BaseMismatchError(f"{base_name}: {name} has shape {shape} but the delta was made against {rec['shape']}; {hint}")
    sample = rec.get("sample")
    if not sample or t.device.type == "meta":
        return
    deq = dequantize_param(t)
    if deq is None:  # an 8-bit weight whose row scales already moved into its module's state: shape only
        return
    idx = _sample_indices(deq.numel()).to(deq.device)
    got = deq.reshape(-1)[idx].float()
    bound = rounding_bound(t, deq, idx)
    expected = torch.tensor(sample, dtype=torch.float32, device=got.device)
    if bool(((expected - got).abs() > bound).any()):
        raise BaseMismatchError(
            f"{base_name}: the dequantized weights of {name} are further from those the delta was made against "
            f"than {kind} rounding explains (another checkpoint?); {hint}"
        )
