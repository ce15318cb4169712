"""Triton kernels of hf-deltazip, each beside its plain-PyTorch reference.

Importing this package is cheap and needs no GPU: Triton is imported on the first launch.

* :func:`multi_delta_linear` - one linear layer for a batch whose rows use different deltas:
  ``y = x W_base^T + bias + x dequant(delta[row])^T`` in one launch (``multi_delta.py``).
* :class:`DeltaStack` / :func:`build_delta_stack` - the device-side stack of packed deltas that
  the kernel reads (``delta_stack.py``).
"""

from .delta_stack import DeltaStack, build_delta_stack, dequantize_delta, random_delta_stack
from .multi_delta import (
    MultiDeltaConfig,
    auto_split_k,
    default_config,
    layer_bytes,
    multi_delta_linear,
    multi_delta_linear_reference,
)

__all__ = [
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
