"""A cheap fingerprint of a base model's weights, to catch a delta applied to the wrong base.

docs/format.md, section 6: for every parameter, its shape, dtype and 8 values sampled at evenly
spaced flat indices. A base loaded in another dtype still matches (the recorded values are cast to
the loaded dtype before an exact comparison); a different base, or a fine-tune passed as base, does not.
"""

from __future__ import annotations

import torch

from .errors import BaseMismatchError

FINGERPRINT_VERSION = 1
SAMPLES = 8
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _sample(t: torch.Tensor) -> list:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return []
    count = min(SAMPLES, n)
    # integer arithmetic: float linspace rounds past the last index on tensors of 2**24+ elements
    idx = (torch.arange(count, dtype=torch.int64) * (n - 1)) // max(count - 1, 1)
    idx = idx.to(flat.device)
    return [float(v) for v in flat[idx].float().cpu()]


def _named_tensors(model_or_state_dict) -> dict:
    if isinstance(model_or_state_dict, dict):
        return dict(model_or_state_dict)
    return dict(model_or_state_dict.named_parameters())


def base_fingerprint(model_or_state_dict) -> dict:
    """The fingerprint of a model (or state dict) as stored in a ``.dz`` header."""
    params = {}
    for name, t in _named_tensors(model_or_state_dict).items():
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        if t.dtype in _FLOAT_DTYPES and t.device.type != "meta":
            entry["sample"] = _sample(t)
        params[name] = entry
    return {"version": FINGERPRINT_VERSION, "params": params}


def check_fingerprint(fingerprint: dict, model, *, base_name: str = "the base model", expected_base: str = "?") -> None:
    """Raise :class:`BaseMismatchError` unless ``model`` is the base ``fingerprint`` was taken from."""
    if not fingerprint or not fingerprint.get("params"):
        return
    actual = _named_tensors(model)
    hint = f"load the delta onto its own base: {expected_base!r}"
    for name, rec in fingerprint["params"].items():
        t = actual.get(name)
        if t is None:
            raise BaseMismatchError(f"{base_name} has no parameter {name!r} that the delta was made against; {hint}")
        if t.dtype not in _FLOAT_DTYPES:
            continue  # a quantized base (bitsandbytes) stores packed weights: only names can be checked
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
