"""Triton kernel of :func:`kernels.rms_norm.rms_norm` (imported lazily: needs triton).

One program per row: ``y = w * (x * rsqrt(mean(x^2) + eps))`` with the sum in float32, the normalised row
rounded to the input's dtype before the weight multiplies it, and that product computed in float32 and
rounded once to the output dtype: the roundings of transformers' Llama-style ``RMSNorm.forward``, in one
launch instead of eight.
"""

import triton
import triton.language as tl

# Only core builtins are used (no tl.sum from triton's standard library), so the launcher can reload this module
# to switch between compiled and interpreted mode within one process, as kernels/_multi_delta_triton.py explains.
try:
    from triton.language.standard import _sum_combine
except ImportError:  # pragma: no cover - other triton versions
    @triton.jit
    def _sum_combine(a, b):
        return a + b


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    var = tl.reduce(x * x, 0, _sum_combine) / N
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)
