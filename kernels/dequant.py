"""Deltas of a stack as dense matrices, on the device: the prefill path's half of a linear layer.

A decode step has a few rows per delta, and the fused multi-delta kernel reads each delta's packed
codes once for them. A prefill has many rows (a prompt's tokens) per delta; there the layer can
instead run the base through one dense matmul and add ``x_rows @ dequant(delta)^T`` per delta
(see ``DeltaModel.configure_kernels(prefill="dequant")``). :func:`dequantize_stack_deltas` writes
several deltas of a stack dense with one Triton launch for planar stacks (the deltas picked by a device
tensor of stack indices, or of slots and the stack's lookup table, so the host never waits for the
device), :func:`dequantize_stack_delta` one; other layouts (file layout, 2:4 positions) and CPU tensors
outside the interpreter use the PyTorch reference (:func:`~.delta_stack.dequantize_delta`). Both compute
``(code - zero) * scale`` in float32 and round once to ``dtype``, so they agree exactly.
"""

from __future__ import annotations

import torch

from .delta_stack import DeltaStack, dequantize_delta

__all__ = ["dequantize_stack_delta", "dequantize_stack_deltas", "runs_dequant_kernel"]

_BN = 32


def runs_dequant_kernel(stack: DeltaStack) -> bool:
    """Whether :func:`dequantize_stack_deltas` runs the Triton kernel for ``stack`` (planar codes on a GPU or
    under the interpreter) rather than the PyTorch reference."""
    from .multi_delta import _interpreting

    return stack.layout_block > 0 and not stack.sparse_2of4 and (
        stack.qweight.device.type == "cuda" or _interpreting())


def _check_out(out, shape, dtype, device):
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} {list(shape)} tensor on {device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")


def _launch(stack: DeltaStack, sel_mode: int, count: int, out: torch.Tensor, q, s, z, sel=None, lut=None):
    from .multi_delta import triton_kernel

    n, k = stack.out_features, stack.in_features
    p = 16 // stack.bits
    blocks = k // (p * stack.layout_block)
    kern = triton_kernel("planar_dequant_kernel")
    q_row = stack.qweight.shape[-1] // 2
    kern[(-(-n // _BN), blocks, count)](
        q, s, z, sel if sel is not None else s, lut if lut is not None else s, out,
        n, k, q_row, s.shape[-1], stack.group_size if stack.group_size > 0 else k,
        stack.qweight.stride(0) // 2, stack.scales.stride(0), stack.zeros.stride(0),
        BITS=stack.bits, BKP=stack.layout_block, BN=_BN, SEL=sel_mode,
    )
    return out


def dequantize_stack_delta(stack: DeltaStack, index: int, dtype: torch.dtype = torch.float32,
                           out: torch.Tensor = None) -> torch.Tensor:
    """Delta ``index`` of ``stack`` as a dense ``[N, K]`` tensor of ``dtype`` (into ``out`` if given).

    Raises:
        IndexError: ``index`` is not a delta of the stack.
        ValueError: ``out`` has the wrong shape, dtype or device.
    """
    if not 0 <= index < stack.num_deltas:
        raise IndexError(f"delta {index} of a stack of {stack.num_deltas}")
    n, k = stack.out_features, stack.in_features
    _check_out(out, (n, k), dtype, stack.qweight.device)
    if not runs_dequant_kernel(stack):
        w = dequantize_delta(stack, index, dtype)
        if out is not None:
            out.copy_(w)
            return out
        return w
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=stack.qweight.device)
    return _launch(stack, 0, 1, out, stack.qweight[index], stack.scales[index], stack.zeros[index])


def dequantize_stack_deltas(stack: DeltaStack, which, dtype: torch.dtype = torch.float32, *,
                            lut: torch.Tensor = None, out: torch.Tensor = None) -> torch.Tensor:
    """Several deltas of ``stack`` as one dense ``[len(which), N, K]`` tensor of ``dtype`` (into ``out`` if given).

    ``which``: a 1-D int32 tensor on the stack's device of stack indices, or, with ``lut`` (the int32
    ``slot + 1 -> index`` table of a :class:`~.slot_stacks.SlotStacks` class), of slots; planar stacks take
    one launch for all of them and never read ``which`` back to the host, so the kernel does not check the
    indices (pass only deltas the stack holds). Other layouts dequantize one delta at a time through the
    PyTorch reference, which reads ``which`` back and refuses an index out of range (``IndexError``).

    Raises:
        ValueError: ``which`` is not a 1-D int32 tensor on the stack's device, or ``out`` has the wrong shape,
            dtype or device.
    """
    device = stack.qweight.device
    if not (torch.is_tensor(which) and which.dim() == 1 and which.dtype == torch.int32 and which.device == device):
        raise ValueError(f"which must be a 1-D int32 tensor on {device}, got "
                         f"{which.dtype if torch.is_tensor(which) else type(which).__name__}")
    if lut is not None and not (lut.dim() == 1 and lut.dtype == torch.int32 and lut.device == device):
        raise ValueError(f"lut must be a 1-D int32 tensor on {device}")
    n, k = stack.out_features, stack.in_features
    shape = (which.shape[0], n, k)
    _check_out(out, shape, dtype, device)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    if shape[0] == 0:
        return out
    if not runs_dequant_kernel(stack):
        idx = (lut[which.long() + 1] if lut is not None else which).tolist()
        for u, i in enumerate(idx):
            if not 0 <= i < stack.num_deltas:
                raise IndexError(f"delta {i} of a stack of {stack.num_deltas}")
            out[u].copy_(dequantize_delta(stack, i, dtype))
        return out
    return _launch(stack, 2 if lut is not None else 1, shape[0], out, stack.qweight, stack.scales, stack.zeros,
                   sel=which, lut=lut)
