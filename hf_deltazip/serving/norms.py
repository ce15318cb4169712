"""RMSNorm in one launch for decode steps (:func:`use_fused_norms`).

A decode step of a Llama-style model runs two RMSNorms per decoder block and one before the LM head; in
transformers each is eight small operations in bfloat16, 520 launches per step at 8B shapes of the 1,082
outside the linear layers (``bench.host_overhead --step-ops``). :func:`use_fused_norms` points each such norm of a model at
:func:`~hf_deltazip.kernels.rms_norm.rms_norm`, one Triton launch, for inputs on a CUDA device (or on the
CPU under ``TRITON_INTERPRET=1``) outside autograd; anything else (CPU, gradients, ``vmap`` of a norm
whose weight a delta replaces) runs the module's own forward. Before switching a module it checks, on a
small input, that the module's forward computes the formula the kernel follows, so a transformers release
that changes its norm leaves that module alone.
"""

from __future__ import annotations

import types

import torch

from ..kernels.rms_norm import kernel_runs_on, rms_norm, rms_norm_reference

__all__ = ["use_fused_norms"]

_MARK = "_deltazip_fused_norm"


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not kernel_runs_on(x.device) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return not torch._C._functorch.is_batchedtensor(x)


def _follows_formula(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward is the Llama-style RMSNorm (checked on two random rows)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return False
    if weight.device.type == "meta" or "forward" in module.__dict__:  # offloaded, or run by a hook (accelerate)
        return False
    with torch.no_grad():
        x = torch.randn((2, weight.shape[0]), generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
        try:
            got = type(module).forward(module, x)
        except Exception:
            return False
        return torch.is_tensor(got) and torch.equal(got, rms_norm_reference(x, weight.detach(), eps))


def _fused_forward(self, hidden_states):
    if _fusable(hidden_states, self.weight):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def use_fused_norms(model: torch.nn.Module, enable: bool = True) -> int:
    """Run every Llama-style RMSNorm of ``model`` (``weight * x / rms(x)`` with ``variance_epsilon``, as
    Llama, Mistral, Qwen2/3 and Phi-3 have) in one Triton launch where it can (see the module docstring);
    ``enable=False`` puts their own forwards back. Returns the number of norms switched (or switched back)."""
    count = 0
    for module in model.modules():
        marked = getattr(module, _MARK, False)
        if not enable:
            if marked:
                del module.forward
                delattr(module, _MARK)
                count += 1
        elif marked:
            count += 1
        elif type(module).__name__.endswith("RMSNorm") and _follows_formula(module):
            module.forward = types.MethodType(_fused_forward, module)
            setattr(module, _MARK, True)
            count += 1
    return count
