"""Llama-style RMSNorm in one launch: the normalisation of every decoder block, twice per block.

transformers' ``LlamaRMSNorm.forward`` (and Mistral's, Qwen2's, Qwen3's, Phi-3's) is eight small
operations in bfloat16 (a cast, a square, a mean, an add, a reciprocal square root, two products and a cast
back): in a decode step of an 8B model, 65 calls and 520 launches of the step's ~1,300, of which one launch
per call saves 455 (``python -m hf_deltazip.bench.host_overhead --step-ops``). :func:`rms_norm` computes the same in one launch per call (on CUDA, or on the CPU
under ``TRITON_INTERPRET=1``); :func:`rms_norm_reference` is the PyTorch formula it follows. The only
difference is the order of the sum of squares (float32 either way), so outputs agree to float32 rounding
before the cast to the model's dtype, and can differ in the last bit of a bfloat16 or float16 output.
"""

from __future__ import annotations

import torch

__all__ = ["kernel_runs_on", "rms_norm", "rms_norm_reference"]


def kernel_runs_on(device) -> bool:
    """Whether :func:`rms_norm` launches its kernel for tensors on ``device`` (CUDA, or any device under
    ``TRITON_INTERPRET=1``); elsewhere it computes :func:`rms_norm_reference`."""
    from .multi_delta import _interpreting

    return torch.device(device).type == "cuda" or _interpreting()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-style RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _kernel():
    from .multi_delta import triton_kernel

    return triton_kernel("rms_norm_kernel", module="_norm_triton")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_reference` over the last dimension of ``x`` in one Triton launch (where
    :func:`kernel_runs_on` ``x``'s device; elsewhere the reference itself).

    Raises:
        ValueError: ``weight`` is not one value per element of ``x``'s last dimension, or the tensors are on
            different devices.
    """
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must have shape [{n}] for inputs of shape {list(x.shape)}, got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} and weight on {weight.device}: put both on one device")
    if not kernel_runs_on(x.device):
        return rms_norm_reference(x, weight, eps)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = max(16, 1 << (n - 1).bit_length())
        warps = 1 if block <= 256 else (4 if block <= 2048 else 8)
        _kernel()[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), float(eps),
                                    BLOCK=block, num_warps=warps)
    return out.reshape(x.shape)
