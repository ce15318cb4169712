"""Triton kernels of hf-deltazip, each beside its plain-PyTorch reference.

Importing this package is cheap and needs no GPU: Triton is imported on the first launch.

* :func:`multi_delta_linear` - one linear layer for a batch whose rows use different deltas:
  ``y = x W_base^T + bias + x dequant(delta[row])^T`` in one launch (``multi_delta.py``).
* :class:`DeltaStack` / :func:`build_delta_stack` - the device-side stack of packed deltas that
  the kernel reads (``delta_stack.py``).
* :func:`prepare_stack` / :func:`repack_for_kernel` / :func:`densify_2of4` - the kernel layout of
  a stack (planar codes, 2:4 as dense codes), applied when deltas are written into a stack; and
  :func:`build_row_segments` - the per-step table of rows grouped by delta (``layout.py``).
* :func:`dequantize_stack_delta` / :func:`dequantize_stack_deltas` - one or several deltas of a stack written
  out dense on the device (several in one launch), for forwards with many rows per delta (prefills;
  ``dequant.py``).
* :class:`SlotStacks` - one layer's stacks per format class, with room to spare and the slot tables
  a captured CUDA graph reads, so deltas come and go without new tensors (``slot_stacks.py``).

This folder sits at the top of the source tree and installs as ``hf_deltazip.kernels``
(``pyproject.toml``'s ``package-dir``); it imports nothing from the rest of the package but the
packing primitives.
"""

import importlib.util

from .delta_stack import DeltaStack, build_delta_stack, dequantize_delta, random_delta_stack
from .dequant import dequantize_stack_delta, dequantize_stack_deltas
from .slot_stacks import PackedFields, SlotStacks, format_key
from .layout import (
    KernelStackFormat,
    build_row_segments,
    default_planar_block,
    densify_2of4,
    kernel_stack_format,
    pack_for_stack,
    planar_block_for,
    prepare_stack,
    repack_for_kernel,
    unpack_planar_codes,
)
from .multi_delta import (
    MultiDeltaConfig,
    auto_split_k,
    default_config,
    gluon_decode_available,
    layer_bytes,
    multi_delta_linear,
    multi_delta_linear_reference,
    set_default_backend,
    set_gluon_block_rows,
    set_gluon_stages,
)


def kernels_available() -> bool:
    """Whether Triton is installed (the kernels run on CUDA, or on the CPU under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


__all__ = [
    "kernels_available",
    "PackedFields",
    "SlotStacks",
    "format_key",
    "build_row_segments",
    "default_planar_block",
    "densify_2of4",
    "KernelStackFormat",
    "kernel_stack_format",
    "pack_for_stack",
    "planar_block_for",
    "prepare_stack",
    "repack_for_kernel",
    "unpack_planar_codes",
    "DeltaStack",
    "build_delta_stack",
    "dequantize_delta",
    "dequantize_stack_delta",
    "dequantize_stack_deltas",
    "random_delta_stack",
    "MultiDeltaConfig",
    "auto_split_k",
    "default_config",
    "gluon_decode_available",
    "layer_bytes",
    "multi_delta_linear",
    "multi_delta_linear_reference",
    "set_default_backend",
    "set_gluon_block_rows",
    "set_gluon_stages",
]
