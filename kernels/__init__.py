"""Triton kernels of hf-deltazip, each beside its plain-PyTorch reference.

Importing this package is cheap and needs no GPU: Triton is imported on the first launch.

* :func:`multi_delta_linear` - one linear layer for a batch whose rows use different deltas:
  ``y = x W_base^T + bias + x dequant(delta[row])^T`` in one launch (``multi_delta.py``).
* :class:`DeltaStack` / :func:`build_delta_stack` - the device-side stack of packed deltas that
  the kernel reads (``delta_stack.py``).
* :func:`prepare_stack` / :func:`repack_for_kernel` / :func:`densify_2of4` - the kernel layout of
  a stack (planar codes, 2:4 as dense codes), applied when deltas are written into a stack; and
  :func:`build_row_segments` - the per-step table of rows grouped by delta (``layout.py``).
"""

from .delta_stack import DeltaStack, build_delta_stack, dequantize_delta, random_delta_stack
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
    layer_bytes,
    multi_delta_linear,
    multi_delta_linear_reference,
)

__all__ = [
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
    "random_delta_stack",
    "MultiDeltaConfig",
    "auto_split_k",
    "default_config",
    "layer_bytes",
    "multi_delta_linear",
    "multi_delta_linear_reference",
]
