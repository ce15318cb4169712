"""One delta of a stack as a dense matrix, on the device: the prefill path's half of a linear layer.

A decode step has a few rows per delta, and the fused multi-delta kernel reads each delta's packed
codes once for them. A prefill has many rows (a prompt's tokens) per delta; there the layer can
instead run the base through one dense matmul and add ``x_rows @ dequantize_stack_delta(...)^T``
per delta (see ``DeltaModel.configure_kernels(prefill="dequant")``). :func:`dequantize_stack_delta`
writes the dense ``[N, K]`` delta with one Triton launch for planar stacks; other layouts (file
layout, 2:4 positions) and CPU tensors outside the interpreter use the PyTorch reference
(:func:`~.delta_stack.dequantize_delta`). Both compute ``(code - zero) * scale`` in float32 and
round once to ``dtype``, so they agree exactly.
"""

from __future__ import annotations

import torch

from .delta_stack import DeltaStack, dequantize_delta

__all__ = ["dequantize_stack_delta"]

_BN = 32


def dequantize_stack_delta(stack: DeltaStack, index: int, dtype: torch.dtype = torch.float32,
                           out: torch.Tensor = None) -> torch.Tensor:
    """Delta ``index`` of ``stack`` as a dense ``[N, K]`` tensor of ``dtype`` (into ``out`` if given).

    Raises:
        IndexError: ``index`` is not a delta of the stack.
        ValueError: ``out`` has the wrong shape, dtype or device.
    """
    from .multi_delta import _interpreting, triton_kernel

    if not 0 <= index < stack.num_deltas:
        raise IndexError(f"delta {index} of a stack of {stack.num_deltas}")
    n, k = stack.out_features, stack.in_features
    if out is not None and (tuple(out.shape) != (n, k) or out.dtype != dtype or out.device != stack.qweight.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} [{n}, {k}] tensor on {stack.qweight.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
    runs_kernel = stack.layout_block > 0 and not stack.sparse_2of4 and (
        stack.qweight.device.type == "cuda" or _interpreting())
    if not runs_kernel:
        w = dequantize_delta(stack, index, dtype)
        if out is not None:
            out.copy_(w)
            return out
        return w
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=stack.qweight.device)
    q, s, z = stack.qweight[index], stack.scales[index], stack.zeros[index]
    p = 16 // stack.bits
    blocks = k // (p * stack.layout_block)
    kern = triton_kernel("planar_dequant_kernel")
    kern[(-(-n // _BN), blocks)](
        q, s, z, out, n, k, q.shape[-1] // 2, s.shape[-1], stack.group_size if stack.group_size > 0 else k,
        BITS=stack.bits, BKP=stack.layout_block, BN=_BN,
    )
    return out
