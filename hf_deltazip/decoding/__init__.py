"""Decoding strategies that run on any transformers causal LM (and on a :class:`~hf_deltazip.DeltaModel`).

* :func:`jacobi_generate` - Jacobi (parallel fixed-point) decoding: several tokens per forward pass,
  output identical to greedy decoding.
"""

from .jacobi import JacobiGate, JacobiOutput, JacobiStats, jacobi_generate

__all__ = ["jacobi_generate", "JacobiGate", "JacobiOutput", "JacobiStats"]
