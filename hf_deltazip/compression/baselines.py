"""Published delta-compression baselines, each with the bytes it would take to store.

Every baseline maps a delta ``D [N, K]`` to a :class:`Reconstruction`: the dense float32 delta a
loader would rebuild, and the bytes of what it would store (raw, before any lossless stage). The
``*_nbytes`` and ``*_for_bytes`` helpers let a benchmark give every method the same budget.

* :func:`rtn_baseline`: round-to-nearest on the packing grid (with magnitude pruning).
* :func:`sign_scale_baseline`: ``sign(D) * mean(|D|)``, the BitDelta form: 1 bit per weight + one scale.
* :func:`dare_baseline`: drop a random fraction ``p``, rescale the rest by ``1 / (1 - p)`` (DARE).
* :func:`svd_baseline`: the best rank-``r`` approximation (what LoRA extraction gives).

Values stored "in 16 bits" are rounded through ``value_dtype`` (bfloat16 by default) so the
reconstruction is what a loader would really see.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import packing
from .solver import Sparsity, rtn_compress

_VALUE_BYTES = 2  # kept values, factors and the one scale are stored in 16 bits


class Reconstruction(NamedTuple):
    """A baseline's output: the rebuilt delta ``[N, K]`` (float32) and its storage in bytes."""

    delta: torch.Tensor
    nbytes: int


def _shape(delta: torch.Tensor) -> tuple[int, int]:
    if delta.dim() != 2:
        raise ValueError(f"delta must be a 2-D [N, K] matrix, got shape {tuple(delta.shape)}")
    return int(delta.shape[0]), int(delta.shape[1])


def _check_16bit(value_dtype: torch.dtype) -> None:
    if value_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"value_dtype must be torch.float16 or torch.bfloat16 (16-bit storage), got {value_dtype}")


# --------------------------------------------------------------------------- round to nearest
def rtn_baseline(
    delta: torch.Tensor, *, bits: int, group_size: int = -1, symmetric: bool = True, sparsity: Sparsity = None
) -> Reconstruction:
    """Round-to-nearest (magnitude pruning first, if any); bytes as the ``.dz`` layouts store it."""
    _shape(delta)
    res = rtn_compress(delta, bits=bits, group_size=group_size, symmetric=symmetric, sparsity=sparsity)
    return Reconstruction(res.dequantize(), res.nbytes())


# --------------------------------------------------------------------------- sign + scale
def sign_scale_nbytes(shape: tuple[int, int]) -> int:
    """1 bit per weight (rows packed to whole bytes, as the 1-bit layout does) + one 16-bit scale."""
    n, k = shape
    return n * packing.packed_nbytes(k, 1) + _VALUE_BYTES


def sign_scale_baseline(delta: torch.Tensor, *, value_dtype: torch.dtype = torch.bfloat16) -> Reconstruction:
    """``sign(D) * mean(|D|)`` with one scale per matrix (BitDelta's starting point, before distillation).

    A weight of exactly 0 gets sign +1: one bit cannot store three values.
    """
    n, k = _shape(delta)
    _check_16bit(value_dtype)
    d = delta.detach().float()
    scale = d.abs().mean().to(value_dtype).float()
    sign = torch.where(d >= 0, 1.0, -1.0)
    return Reconstruction(sign * scale, sign_scale_nbytes((n, k)))


# --------------------------------------------------------------------------- DARE
_SEED_BYTES = 8


def _dare_mask_nbytes(shape: tuple[int, int], seeded_mask: bool) -> int:
    n, k = shape
    return _SEED_BYTES if seeded_mask else n * packing.packed_nbytes(k, 1)


def dare_nbytes(shape: tuple[int, int], p: float, *, seeded_mask: bool = False) -> int:
    """Kept values in 16 bits + where they are; exactly ``N*K - round(p*N*K)`` are kept.

    Where: a 1-bit-per-weight mask, or with ``seeded_mask`` the 8-byte seed of the random draw
    (DARE's mask is random: a loader that draws it again from the seed needs nothing else).
    """
    n, k = shape
    kept = n * k - int(math.floor(p * n * k + 0.5))
    return kept * _VALUE_BYTES + _dare_mask_nbytes(shape, seeded_mask)


def dare_p_for_bytes(shape: tuple[int, int], nbytes: int, *, seeded_mask: bool = False) -> float:
    """The smallest drop rate ``p`` whose :func:`dare_nbytes` fits in ``nbytes``.

    Raises:
        ValueError: ``nbytes`` is smaller than the mask (or seed) alone.
    """
    n, k = shape
    mask_bytes = _dare_mask_nbytes(shape, seeded_mask)
    if nbytes < mask_bytes:
        raise ValueError(f"{nbytes} bytes cannot hold DARE's {mask_bytes}-byte bitmask for a {n}x{k} delta: give a larger budget")
    kept = min(n * k, (nbytes - mask_bytes) // _VALUE_BYTES)
    return (n * k - kept) / (n * k)


def dare_baseline(
    delta: torch.Tensor,
    p: float,
    *,
    generator: Optional[torch.Generator] = None,
    value_dtype: torch.dtype = torch.bfloat16,
    seeded_mask: bool = False,
) -> Reconstruction:
    """Drop exactly ``round(p * N * K)`` weights chosen uniformly at random; scale the rest by ``1 / (1 - p)``.

    Args:
        delta: ``[N, K]``.
        p: drop rate in ``[0, 1)``.
        generator: for reproducible draws (a CPU generator; the draw is moved to the delta's device).
        value_dtype: 16-bit dtype the kept, rescaled values are stored in.
        seeded_mask: count the mask as the generator's seed (see :func:`dare_nbytes`).
    """
    n, k = _shape(delta)
    _check_16bit(value_dtype)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"DARE's drop rate p must be in [0, 1), got {p}")
    d = delta.detach().float()
    drop = int(math.floor(p * n * k + 0.5))
    keep = torch.ones(n * k, dtype=torch.bool)
    keep[torch.randperm(n * k, generator=generator, device=generator.device if generator is not None else "cpu").to(keep.device)[:drop]] = False
    keep = keep.view(n, k).to(d.device)
    kept_values = (d / (1.0 - p)).to(value_dtype).float()
    return Reconstruction(kept_values * keep, dare_nbytes((n, k), p, seeded_mask=seeded_mask))


# --------------------------------------------------------------------------- low rank
def svd_nbytes(shape: tuple[int, int], rank: int) -> int:
    """Two 16-bit factors ``[N, r]`` and ``[r, K]``: ``r * (N + K) * 2`` bytes."""
    n, k = shape
    return rank * (n + k) * _VALUE_BYTES


def rank_for_bytes(shape: tuple[int, int], nbytes: int) -> int:
    """The largest rank whose :func:`svd_nbytes` fits in ``nbytes`` (at most ``min(N, K)``)."""
    n, k = shape
    return max(0, min(min(n, k), nbytes // ((n + k) * _VALUE_BYTES)))


def svd_baseline(delta: torch.Tensor, rank: int, *, value_dtype: torch.dtype = torch.bfloat16,
                 factors: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> Reconstruction:
    """Truncated SVD: ``D ~ (U_r sqrt(S_r)) (sqrt(S_r) V_r^T)``, both factors stored in 16 bits.

    ``factors``: ``torch.linalg.svd(delta, full_matrices=False)`` if already computed.
    """
    n, k = _shape(delta)
    _check_16bit(value_dtype)
    if not 0 <= rank <= min(n, k):
        raise ValueError(f"rank must be in [0, {min(n, k)}] for a {n}x{k} delta, got {rank}")
    d = delta.detach().float()
    if rank == 0:
        return Reconstruction(torch.zeros_like(d), 0)
    u, s, vh = factors if factors is not None else torch.linalg.svd(d, full_matrices=False)
    root = s[:rank].sqrt()
    a = (u[:, :rank] * root).to(value_dtype).float()
    b = (root[:, None] * vh[:rank]).to(value_dtype).float()
    return Reconstruction(a @ b, svd_nbytes((n, k), rank))
