"""Delta reconstructions beyond uniform quantization, each fitted to a byte budget.

Like :mod:`hf_deltazip.compression.baselines`, each function maps a delta ``D [N, K]`` and a byte
budget to a :class:`~hf_deltazip.compression.baselines.Reconstruction` (the dense delta a loader
would rebuild and every byte it would store), so a benchmark can compare them with our method at
equal bytes. :func:`lowrank_module` stores the Delta-CoMe factors as a ``.dz`` module (the lowrank layout,
``sparsity="lowrank:x"``, which the byte budget may choose); low rank + residual is evaluation code only.

* :func:`mixed_precision_svd`: singular vectors in bands of falling precision (8, 4, 3, 2 bits,
  1 : 2 : 4 : 8 vectors), the Delta-CoMe idea that the top directions deserve more bits.
* :func:`lowrank_plus_residual`: a 16-bit low-rank part plus the residual quantized round-to-nearest
  at 2 bits, its largest-magnitude entries only, their positions Rice-coded.

Byte accounting: quantized factors use :func:`~hf_deltazip.compression.solver.storage_nbytes`
(codes + one 16-bit scale and one 8-bit zero point per row); 16-bit factors 2 bytes a value;
sparse positions the exact length of their Rice code (:func:`rice_nbytes`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .. import packing
from ..delta import PackedModule, lowrank_product
from .baselines import Reconstruction, rank_for_bytes, svd_baseline
from .solver import rtn_compress, storage_nbytes

__all__ = ["lowrank_plus_residual", "mixed_precision_factors", "mixed_precision_ranks", "mixed_precision_svd",
           "mixed_precision_nbytes", "rice_nbytes", "lowrank_module"]

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # U, S, V^T of a thin SVD
DELTA_COME_BITS = (8, 4, 3, 2)
DELTA_COME_SHARES = (1, 2, 4, 8)


def _check(delta: torch.Tensor, nbytes: int) -> tuple[int, int]:
    if delta.dim() != 2:
        raise ValueError(f"delta must be a 2-D [N, K] matrix, got shape {tuple(delta.shape)}")
    if nbytes < 0:
        raise ValueError(f"the byte budget must be >= 0, got {nbytes}")
    return int(delta.shape[0]), int(delta.shape[1])


# --------------------------------------------------------------------------- Rice-coded positions
def rice_nbytes(mask: torch.Tensor) -> int:
    """Bytes of the positions of ``mask``'s True entries (row-major) as Rice-coded gaps.

    Each gap ``g >= 0`` (zeros skipped since the previous kept entry) costs ``g >> p`` unary bits, a
    stop bit and ``p`` low bits; ``p`` is the best for this mask and stored in one byte, as is the
    count of kept entries (8 bytes).
    """
    flat = mask.reshape(-1).nonzero().flatten().to(torch.int64)
    if flat.numel() == 0:
        return 8
    gaps = torch.diff(flat, prepend=torch.tensor([-1], device=flat.device)) - 1
    best = None
    for p in range(0, 32):
        bits = int((gaps >> p).sum()) + gaps.numel() * (1 + p)
        best = bits if best is None or bits < best else best
        if (gaps >> p).max() == 0:
            break
    return 9 + math.ceil(best / 8)


# --------------------------------------------------------------------------- Delta-CoMe style
def _band_ranks(scale: int, limit: int, shares: Sequence[int]) -> list[int]:
    ranks, left = [], limit
    for s in shares:
        r = min(s * scale, left)
        ranks.append(r)
        left -= r
    return ranks


def mixed_precision_nbytes(shape: tuple[int, int], ranks: Sequence[int], bits: Sequence[int] = DELTA_COME_BITS) -> int:
    """Bytes of the banded factors: each band ``r`` vectors of ``U sqrt(S)`` and ``sqrt(S) V^T``, quantized per vector."""
    n, k = shape
    return sum(storage_nbytes(r, n, bits=b) + storage_nbytes(r, k, bits=b) for r, b in zip(ranks, bits) if r)


def mixed_precision_ranks(shape: tuple[int, int], nbytes: int, *, bits: Sequence[int] = DELTA_COME_BITS,
                          shares: Sequence[int] = DELTA_COME_SHARES) -> list[int]:
    """Directions per band of the largest banded SVD of a ``shape`` matrix whose factors fit ``nbytes``:
    band ``i`` holds ``shares[i] * s`` directions at ``bits[i]``, ``s`` as large as the budget allows, and
    what is left buys more directions at the last band's bits."""
    n, k = shape
    if len(bits) != len(shares):
        raise ValueError(f"bits {tuple(bits)} and shares {tuple(shares)} must have one entry per band")
    limit = min(n, k)
    lo, hi = 0, limit  # largest scale whose bytes fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mixed_precision_nbytes((n, k), _band_ranks(mid, limit, shares), bits) <= nbytes:
            lo = mid
        else:
            hi = mid - 1
    ranks = _band_ranks(lo, limit, shares)
    while sum(ranks) < limit and mixed_precision_nbytes((n, k), [*ranks[:-1], ranks[-1] + 1], bits) <= nbytes:
        ranks[-1] += 1
    return ranks


def mixed_precision_factors(
    delta: torch.Tensor, nbytes: int, *, bits: Sequence[int] = DELTA_COME_BITS, shares: Sequence[int] = DELTA_COME_SHARES,
    factors: Optional[Factors] = None,
) -> list:
    """The quantized factors of :func:`mixed_precision_svd`: one ``(bits, A, B)`` per non-empty band, ``A``
    the band's ``u_j sqrt(s_j)`` as rows ``[r, N]`` and ``B`` its ``sqrt(s_j) v_j`` ``[r, K]``, each a
    :class:`~hf_deltazip.compression.solver.SolverResult` with one symmetric grid per direction; the
    band's delta is ``A.dequantize().t() @ B.dequantize()``."""
    n, k = _check(delta, nbytes)
    ranks = mixed_precision_ranks((n, k), nbytes, bits=bits, shares=shares)
    if not sum(ranks):
        return []
    d = delta.detach().float()
    u, s, vh = factors if factors is not None else torch.linalg.svd(d, full_matrices=False)
    root = s.sqrt()
    out, start = [], 0
    for r, b in zip(ranks, bits):
        if not r:
            continue
        sl = slice(start, start + r)
        out.append((b, rtn_compress((u[:, sl] * root[sl]).t().contiguous(), bits=b),
                    rtn_compress((root[sl, None] * vh[sl]).contiguous(), bits=b)))
        start += r
    return out


def mixed_precision_svd(
    delta: torch.Tensor, nbytes: int, *, bits: Sequence[int] = DELTA_COME_BITS, shares: Sequence[int] = DELTA_COME_SHARES,
    factors: Optional[Factors] = None,
) -> Reconstruction:
    """The largest banded SVD that fits ``nbytes``: band ``i`` holds ``shares[i] * s`` singular
    directions quantized at ``bits[i]`` (top directions first), ``s`` as large as the budget allows;
    what is left of the budget buys more directions at the last band's bits.

    Each direction's two factors ``u_j sqrt(s_j)`` and ``sqrt(s_j) v_j`` are quantized round-to-nearest,
    one symmetric grid per vector. ``factors``: ``torch.linalg.svd(delta, full_matrices=False)`` if
    already computed (a benchmark reuses it across budgets).
    """
    bands = mixed_precision_factors(delta, nbytes, bits=bits, shares=shares, factors=factors)
    return Reconstruction(lowrank_product(bands, tuple(delta.shape), delta.device),
                          sum(a.nbytes() + b.nbytes() for _, a, b in bands))


#: band layouts :func:`lowrank_module` tries, as ``(bits, shares)``: Delta-CoMe's falling precision, one
#: precision for every direction, and two-band splits. Small or nearly low-rank deltas do best with few precise
#: directions; large deltas with a long spectrum with Delta-CoMe's bands
BAND_PATTERNS = (((8, 4, 3, 2), (1, 2, 4, 8)), ((8, 4), (1, 2)), ((4, 2), (1, 2)), ((8,), (1,)), ((4,), (1,)),
                 ((3,), (1,)), ((2,), (1,)))


def lowrank_module(delta: torch.Tensor, bits_per_weight: float, *, bits: int, group_size: int, symmetric: bool = True,
                   kind: str = "linear", transposed: bool = False, factors: Optional[Factors] = None,
                   hessian: Optional[torch.Tensor] = None, patterns=BAND_PATTERNS):
    """``delta [N, K]`` in the ``.dz`` lowrank layout (``sparsity="lowrank:x"``): banded, quantized singular
    directions (:func:`mixed_precision_factors`) in ``bits_per_weight * N * K / 8`` bytes (before zstd),
    served as ``bits``-bit codes on ``group_size`` groups of their product (a
    :class:`~hf_deltazip.delta.PackedModule` whose ``factors`` the file stores).

    Of the band layouts ``patterns``, the one whose product has the least error is kept: the OBS objective
    ``trace(E H E^T)`` with ``hessian`` (the module's calibration inputs), else the squared Frobenius error.
    """
    from .solver import objective

    n, k = _check(delta, 0)
    d = delta.detach().float()
    factors = factors if factors is not None else torch.linalg.svd(d, full_matrices=False)
    best = None
    for band_bits, shares in patterns:
        bands = mixed_precision_factors(d, int(bits_per_weight * n * k / 8), bits=band_bits, shares=shares,
                                        factors=factors)
        approx = lowrank_product(bands, (n, k), d.device)
        error = objective(d, approx, hessian) if hessian is not None else float((approx - d).pow(2).sum())
        if best is None or error < best[0]:
            best = (error, bands)
    # packed where the factors are; the module keeps them on the CPU
    return PackedModule.lowrank(best[1], (n, k), bits=bits, group_size=group_size, symmetric=symmetric, kind=kind,
                                transposed=transposed)


# --------------------------------------------------------------------------- low rank + residual
def lowrank_plus_residual(
    delta: torch.Tensor, nbytes: int, *, rank_share: float = 0.25, residual_bits: int = 2,
    value_dtype: torch.dtype = torch.bfloat16, factors: Optional[Factors] = None,
) -> Reconstruction:
    """A rank-``r`` part in 16 bits (``rank_share`` of the budget) plus the residual's largest entries.

    The residual ``D - A B`` is quantized at ``residual_bits`` with one grid per row, keeping as many
    of its largest-magnitude entries as the rest of the budget pays for (codes, grid and Rice-coded
    positions); if even a dense residual fits, it is stored dense. ``factors``: as for
    :func:`mixed_precision_svd`.
    """
    n, k = _check(delta, nbytes)
    if not 0.0 <= rank_share <= 1.0:
        raise ValueError(f"rank_share must be in [0, 1], got {rank_share}")
    d = delta.detach().float()
    rank = rank_for_bytes((n, k), int(rank_share * nbytes))
    lr = svd_baseline(d, rank, value_dtype=value_dtype, factors=factors)
    low = lr.delta
    used = lr.nbytes
    left = nbytes - used
    residual = d - low
    grid = storage_nbytes(n, k, bits=residual_bits) - n * packing.packed_nbytes(k, residual_bits)
    if storage_nbytes(n, k, bits=residual_bits) <= left:
        res = rtn_compress(residual, bits=residual_bits)
        return Reconstruction(low + res.dequantize(), used + res.nbytes())
    # kept codes cost residual_bits each; positions about log2(N K / nnz) + 2 bits each: solve, then
    # shrink until the exact Rice-coded size fits
    room = left - grid - 9
    if room <= 0:
        return Reconstruction(low, used)
    total = n * k
    nnz = min(total - 1, int(8 * room / (residual_bits + 2)))
    while nnz > 0:
        nnz = min(nnz, int(8 * room / (residual_bits + 2 + max(0.0, math.log2(total / nnz)))))
        mask = _top_mask(residual, nnz)
        size = packing.packed_nbytes(nnz, residual_bits) + grid + rice_nbytes(mask)
        if size <= left:
            res = rtn_compress(residual * mask, bits=residual_bits)
            rec = res.dequantize() * mask
            return Reconstruction(low + rec, used + size)
        nnz = int(nnz * 0.97)
    return Reconstruction(low, used)


def _top_mask(x: torch.Tensor, nnz: int) -> torch.Tensor:
    flat = x.abs().reshape(-1)
    idx = torch.topk(flat, nnz, sorted=False).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[idx] = True
    return mask.view_as(x)
