"""Which positions of a forward pass are decode steps.

A forward over several tokens per row is a prompt's prefill unless a decoder says otherwise: Jacobi
decoding's wide steps are decode steps, and a teacher-forced pass can stand for a prefill of ``p``
tokens followed by decode steps. :func:`sparsify_positions_from` says so for the code inside it;
decode-only activation sparsity (:mod:`hf_deltazip.modeling.activation_sparsity`) reads it with
:func:`decode_start`.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Optional

__all__ = ["sparsify_positions_from", "decode_start"]

_DECODE_FROM: contextvars.ContextVar = contextvars.ContextVar("hf_deltazip_decode_from", default=None)


@contextmanager
def sparsify_positions_from(position: int):
    """Inside this block, sequence positions ``>= position`` of every forward pass are decode steps (their
    inputs are thresholded by activation sparsity, decode-only or not) and the ones before are a prefill
    (left dense): one teacher-forced pass then computes what decode-only sparsity computes when a
    ``position``-token prompt is prefilled and the rest decoded; ``0`` marks a whole forward (a Jacobi step)
    as decoding."""
    if not isinstance(position, int) or position < 0:
        raise ValueError(f"position must be an integer >= 0, got {position!r}")
    token = _DECODE_FROM.set(position)
    try:
        yield
    finally:
        _DECODE_FROM.reset(token)


def decode_start() -> Optional[int]:
    """The position set by the innermost :func:`sparsify_positions_from` (``None`` outside one)."""
    return _DECODE_FROM.get()
