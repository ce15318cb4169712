"""The OBS-family solver (GPTQ / SparseGPT) applied to one delta matrix.

For a linear layer with delta ``D [N, K]`` (output x input features) and calibration inputs ``X``
that the layer really sees, :func:`obs_compress` looks for a quantized (and optionally pruned)
``Dhat`` on the :mod:`hf_deltazip.packing` grid that keeps ``||X Dhat^T - X D^T||^2`` small. It
walks the input columns once: each column is pruned or quantized, and the error it leaves is pushed
onto the columns not yet done through the upper Cholesky factor of ``H^-1``, ``H = 2 X^T X / n``.

:func:`rtn_compress` is the same output without a Hessian: magnitude pruning and round-to-nearest.
It serves embeddings and the LM head, and is the baseline the solver must beat.

Everything is computed in float32 on the delta's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .. import packing
from ..errors import DeltaZipConfigError, DeltaZipError

Sparsity = Union[None, str, float]

_MAX_DAMP_RETRIES = 8


# --------------------------------------------------------------------------- result
@dataclass
class SolverResult:
    """A compressed delta on the packing grid, in dense (unpacked) form.

    Attributes:
        codes: uint8 ``[N, K]``; pruned positions hold their group's zero point, so they decode to 0.
        scales: float32 ``[N, G]``, already rounded to their storage dtype (float16 or float32).
        zeros: uint8 ``[N, G]`` zero points in ``[0, 2**bits - 1]``.
        mask: bool ``[N, K]`` (True = kept), or None when nothing is pruned.
        bits: 2, 3, 4 or 8.
        group_size: inputs per quantization group, or -1 for one group per row.
        symmetric: whether the grid is symmetric (zero point ``2**(bits-1)``).
        sparsity: None, ``"2:4"`` or the fraction of weights pruned (unstructured).
        damp: the relative damping the solver finally used (it grows when Cholesky fails);
            None for round-to-nearest.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    mask: Optional[torch.Tensor]
    bits: int
    group_size: int
    symmetric: bool
    sparsity: Sparsity
    damp: Optional[float] = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        g = packing.num_groups(k, self.group_size)
        assert self.codes.dtype == torch.uint8, self.codes.dtype
        assert self.scales.shape == (n, g) and self.scales.dtype == torch.float32, (self.scales.shape, self.scales.dtype)
        assert self.zeros.shape == (n, g) and self.zeros.dtype == torch.uint8, (self.zeros.shape, self.zeros.dtype)
        assert self.mask is None or (self.mask.shape == (n, k) and self.mask.dtype == torch.bool)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reconstructed delta ``[N, K]``: ``(code - zero) * scale``, times the mask."""
        w = packing.dequantize(self.codes, self.scales, self.zeros, self.group_size)
        if self.mask is not None:
            w = w * self.mask
        return w.to(dtype)

    def nbytes(self) -> int:
        """Bytes of the packed tensors the ``.dz`` format stores for this delta (before zstd).

        See :func:`storage_nbytes`; scales count 2 bytes each if they fit float16, else 4.
        """
        n, k = self.shape
        nnz = None if self.mask is None else int(self.mask.sum())
        scale_bytes = 2 if packing.choose_scale_dtype(self.scales) == torch.float16 else 4
        return storage_nbytes(
            n, k, bits=self.bits, group_size=self.group_size, sparsity=self.sparsity, nnz=nnz, scale_bytes=scale_bytes
        )


def storage_nbytes(
    n: int,
    k: int,
    *,
    bits: int,
    group_size: int = -1,
    sparsity: Sparsity = None,
    nnz: Optional[int] = None,
    scale_bytes: int = 2,
) -> int:
    """Bytes of the packed tensors of one ``[N, K]`` delta in the ``.dz`` layouts (before zstd).

    Dense: ``N * packed(K, bits)`` codes. 2:4: ``N * (packed(K/2, bits) + packed(K/2, 2))`` (kept codes
    and their 2-bit positions). Unstructured: a ``N * ceil(K/8)`` bitmask plus ``packed(nnz, bits)``
    for the kept codes (``nnz`` defaults to ``N*K - round(fraction*N*K)``, which the solver hits
    exactly). Every layout adds ``N * G`` scales of ``scale_bytes`` and ``N * G`` uint8 zero points.
    """
    _check_options(bits, group_size, sparsity, k)
    g = packing.num_groups(k, group_size)
    grid = n * g * (scale_bytes + 1)
    if sparsity is None:
        return n * packing.packed_nbytes(k, bits) + grid
    if sparsity == "2:4":
        return n * (packing.packed_nbytes(k // 2, bits) + packing.packed_nbytes(k // 2, 2)) + grid
    if nnz is None:
        nnz = n * k - _round_half_up(sparsity * n * k)
    return n * packing.packed_nbytes(k, 1) + packing.packed_nbytes(nnz, bits) + grid


# --------------------------------------------------------------------------- objective
def objective(delta: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``trace((D - A) H (D - A)^T)``: with ``H = 2 X^T X / n`` this is ``2/n * ||X A^T - X D^T||^2``."""
    _check_matrix("delta", delta)
    if approx.shape != delta.shape:
        raise ValueError(f"approx {tuple(approx.shape)} and delta {tuple(delta.shape)} differ in shape")
    k = delta.shape[1]
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a delta with {k} inputs, got {tuple(hessian.shape)}")
    e = delta.float() - approx.to(delta.device).float()
    return float(((e @ hessian.to(e.device).float()) * e).sum())


def relative_objective(delta: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """:func:`objective` divided by ``trace(D H D^T)`` (0 = exact, 1 = as bad as storing nothing)."""
    num = objective(delta, approx, hessian)
    den = objective(delta, torch.zeros_like(delta), hessian)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# --------------------------------------------------------------------------- Hessian
class HessianAccumulator:
    """Running ``H = 2 X^T X / n`` over every input row a layer sees.

    One accumulator serves all layers that read the same input (q/k/v; gate/up). The sum
    ``X^T X`` is kept in float32 on the device of the first input (or ``device``), and
    :attr:`hessian` divides by the row count when asked.

    Example:
        >>> acc = HessianAccumulator()
        >>> acc.add(torch.randn(2, 7, 16))        # [batch, seq, K]: 14 rows
        >>> acc.add(torch.randn(5, 16), mask=torch.tensor([1, 1, 0, 1, 0]).bool())
        >>> acc.n, acc.hessian.shape
        (17, torch.Size([16, 16]))
    """

    def __init__(self, in_features: Optional[int] = None, *, device: Union[str, torch.device, None] = None):
        self.in_features = in_features
        self.n = 0
        self._xtx: Optional[torch.Tensor] = None
        if in_features is not None and device is not None:
            self._xtx = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """Add the rows of ``x [..., K]`` (any leading shape, any float dtype).

        Args:
            x: layer inputs; every leading index is one row (token).
            mask: optional bool tensor of shape ``x.shape[:-1]``; rows where it is False (padding)
                are skipped.
        """
        if not x.is_floating_point():
            raise ValueError(f"layer inputs must be floating point, got {x.dtype}")
        if x.dim() < 1:
            raise ValueError("layer inputs need at least one dimension (the input features)")
        k = x.shape[-1]
        if self.in_features is None:
            self.in_features = k
        elif k != self.in_features:
            raise ValueError(f"this accumulator holds {self.in_features} input features, got inputs with {k}")
        rows = x.detach().reshape(-1, k)
        if mask is not None:
            if tuple(mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"mask must have the inputs' leading shape {tuple(x.shape[:-1])}, got {tuple(mask.shape)}")
            rows = rows[mask.reshape(-1).to(device=rows.device, dtype=torch.bool)]
        if self._xtx is None:
            self._xtx = torch.zeros(k, k, dtype=torch.float32, device=x.device)
        if rows.shape[0] == 0:
            return
        rows = rows.to(device=self._xtx.device, dtype=torch.float32)
        self._xtx.addmm_(rows.t(), rows)
        self.n += rows.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """``2 X^T X / n`` in float32 ``[K, K]`` (a new tensor)."""
        if self._xtx is None or self.n == 0:
            raise ValueError("no input rows were added to this HessianAccumulator: run calibration data through the layer first")
        return self._xtx * (2.0 / self.n)


# --------------------------------------------------------------------------- checks
def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _check_matrix(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [N, K] matrix, got shape {tuple(t.shape)}")


def _check_options(bits: int, group_size: int, sparsity: Sparsity, k: int) -> None:
    if bits not in packing.CODE_BITS:
        raise DeltaZipConfigError(f"bits must be one of {packing.CODE_BITS}, got {bits!r}")
    if not isinstance(group_size, int) or not (group_size == -1 or (group_size >= 1 and group_size & (group_size - 1) == 0)):
        raise DeltaZipConfigError(f"group_size must be -1 (one group per row) or a power of two, got {group_size!r}")
    if sparsity is None:
        return
    if isinstance(sparsity, str):
        if sparsity != "2:4":
            raise DeltaZipConfigError(f"sparsity must be None, '2:4' or a fraction in (0, 1), got {sparsity!r}")
        if k % 4:
            raise DeltaZipConfigError(f"2:4 sparsity needs the input dimension to be a multiple of 4, got K={k}; use a fraction instead")
        return
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 < float(sparsity) < 1.0:
        raise DeltaZipConfigError(f"sparsity must be None, '2:4' or a fraction in (0, 1), got {sparsity!r}")


# --------------------------------------------------------------------------- round to nearest
def magnitude_mask(delta: torch.Tensor, sparsity: Sparsity) -> Optional[torch.Tensor]:
    """The keep-mask :func:`rtn_compress` prunes ``delta`` with at ``sparsity`` (``None`` when dense)."""
    _check_matrix("delta", delta)
    _check_options(4, -1, sparsity, delta.shape[1])
    return _magnitude_mask(delta.detach().float(), sparsity)


def _magnitude_mask(w: torch.Tensor, sparsity: Sparsity) -> Optional[torch.Tensor]:
    """Keep-mask of magnitude pruning: 2 largest of every 4 inputs, or exactly the target count."""
    n, k = w.shape
    if sparsity is None:
        return None
    if sparsity == "2:4":
        a = w.abs().reshape(n, k // 4, 4)
        prune = torch.argsort(a, dim=-1, stable=True)[..., :2]
        keep = torch.ones_like(a, dtype=torch.bool).scatter_(-1, prune, False)
        return keep.reshape(n, k)
    count = _round_half_up(float(sparsity) * n * k)
    return _prune_smallest(w.abs().flatten(), count).reshape(n, k)


def _prune_smallest(a: torch.Tensor, count: int) -> torch.Tensor:
    """Keep-mask of ``a`` (1-D) with its ``count`` smallest entries dropped, ties dropped lowest index
    first: exactly what a stable ascending sort would drop, found by selection instead of a sort
    (a 262k-token embedding's 168M magnitudes: seconds instead of minutes on a CPU)."""
    if count <= 0 or count >= a.numel():
        return torch.full((a.numel(),), count <= 0, dtype=torch.bool, device=a.device)
    t = torch.kthvalue(a, count).values  # the count-th smallest
    below = a < t
    ties = a == t
    need = count - int(below.sum())  # of the entries equal to t, the first `need` by index are dropped
    return ~(below | (ties & (torch.cumsum(ties, 0, dtype=torch.int64 if a.numel() >= 2**31 else torch.int32) <= need)))


def rtn_compress(
    delta: torch.Tensor,
    *,
    bits: int,
    group_size: int = -1,
    symmetric: bool = True,
    sparsity: Sparsity = None,
    keep_mask: Optional[torch.Tensor] = None,
) -> SolverResult:
    """Round-to-nearest with magnitude pruning: no Hessian needed.

    Args:
        delta: ``[N, K]`` delta (any float dtype, any device).
        bits: 2, 3, 4 or 8.
        group_size: -1 (one group per row) or a power of two.
        symmetric: symmetric grid (zero point ``2**(bits-1)``) or asymmetric min-max grid.
        sparsity: None; ``"2:4"`` (keep the 2 largest of every 4 inputs); or a fraction in (0, 1)
            of the matrix's weights to prune, smallest magnitudes first (exactly ``round(f*N*K)``).
        keep_mask: the magnitude mask of ``sparsity`` for this very ``delta``, computed once by
            :func:`magnitude_mask` and shared by several calls (settings differing in bits or
            group size only); ``None``: computed here.

    Returns:
        :class:`SolverResult`; the grid is fitted to the kept weights only.
    """
    _check_matrix("delta", delta)
    n, k = delta.shape
    _check_options(bits, group_size, sparsity, k)
    w = delta.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("delta has NaN or infinite values: check the fine-tune's weights")
    if keep_mask is not None and (sparsity is None or tuple(keep_mask.shape) != (n, k) or keep_mask.dtype != torch.bool):
        raise ValueError(f"keep_mask must be the bool [{n}, {k}] magnitude mask of the sparsity given, got "
                         f"{keep_mask.dtype} {tuple(keep_mask.shape)} with sparsity {sparsity!r}")
    mask = keep_mask.to(w.device) if keep_mask is not None else _magnitude_mask(w, sparsity)
    if mask is not None:
        w = w * mask
    scales, zeros = packing.compute_qparams(w, bits, group_size, symmetric)
    codes = packing.quantize(w, scales, zeros, bits, group_size)
    if mask is not None:
        codes = torch.where(mask, codes, packing.expand_groups(zeros, k, group_size))
    return SolverResult(codes.contiguous(), scales, zeros, mask, bits, group_size, symmetric, sparsity)


# --------------------------------------------------------------------------- OBS
def _inverse_cholesky_upper(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor ``U`` of ``(H + lam * mean(diag H) * I)^-1`` (``U^T U = H^-1``).

    Damping starts at ``damp`` and grows tenfold while either factorization fails.
    """
    k = h.shape[0]
    mean_diag = torch.diagonal(h).mean()
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    lam = float(damp)
    for _ in range(_MAX_DAMP_RETRIES):
        l, info = torch.linalg.cholesky_ex(h + (lam * mean_diag) * eye)
        if int(info) == 0:
            u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(l), upper=True)
            if int(info) == 0 and bool(torch.isfinite(u).all()):
                return u, lam
        lam = max(lam * 10.0, 1e-4)
    raise DeltaZipError(
        f"the Hessian is not positive definite even with damping {lam / 10:g} x mean(diag H): "
        "check the calibration inputs for NaN/inf, or raise `damp`"
    )


def obs_compress(
    delta: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int,
    group_size: int = -1,
    symmetric: bool = True,
    sparsity: Sparsity = None,
    block_size: int = 128,
    damp: float = 0.01,
    static_groups: bool = False,
    generator: Optional[torch.Generator] = None,
) -> SolverResult:
    """Quantize (and prune) one delta with the OBS update of GPTQ / SparseGPT.

    Columns are visited left to right in blocks of ``block_size``. In each column, pruned weights
    (chosen by the OBS saliency ``w^2 / [H^-1]_ii^2``) become 0 and kept weights are rounded to their
    group's grid; the error is pushed onto the columns not yet done (inside the block at once, onto
    later blocks when the block ends). A group's grid is fitted when its first column comes up, to the
    group's weights as the earlier errors left them (weights already known to be pruned excluded;
    ``static_groups=True`` fits the weights as given instead).

    Args:
        delta: ``[N, K]`` delta (output x input features), any float dtype and device.
        hessian: ``[K, K]`` ``2 X^T X / n`` of the layer's inputs (see :class:`HessianAccumulator`).
        bits: 2, 3, 4 or 8.
        group_size: -1 (one group per row) or a power of two.
        symmetric: symmetric grid (zero point ``2**(bits-1)``) or asymmetric min-max grid.
        sparsity: None; ``"2:4"`` (at the start of every 4 columns, the 2 of each row's 4 weights with
            the lowest saliency are pruned); or a fraction in (0, 1): each block prunes its share of
            the lowest-saliency weights (as SparseGPT does), exactly ``round(f*N*K)`` in total.
        block_size: columns per OBS block (a speed knob, not the quantization group); rounded up
            to a multiple of 4 for 2:4.
        damp: damping ``damp * mean(diag H)`` added to the diagonal; multiplied by 10 and retried
            while the Cholesky factorization fails.
        static_groups: fit each group's grid to the delta as given instead of to the error-updated
            weights. The pushed errors grow later weights and so widen their grids; at 2 bits with
            small groups fitting the original weights is often better, at 3+ bits rarely.
        generator: unused; the solver draws no random numbers (ties are broken by column order).

    Returns:
        :class:`SolverResult` with the damping finally used in ``damp``.

    Raises:
        DeltaZipConfigError: an option value is not allowed.
        ValueError: shapes do not fit, or the inputs are not finite.
        DeltaZipError: the Hessian could not be factorized even with large damping.

    Example::

        acc = HessianAccumulator()
        acc.add(x)                                   # the layer's inputs, [..., K]
        res = obs_compress(delta, acc.hessian, bits=4, group_size=128, sparsity="2:4")
        approx = res.dequantize()                    # [N, K] float32
    """
    del generator  # deterministic by construction
    return obs_compress_many(delta, hessian, [(bits, sparsity)], group_size=group_size, symmetric=symmetric,
                             block_size=block_size, damp=damp, static_groups=static_groups)[0]


# --------------------------------------------------------------------------- OBS, many settings at once
def obs_compress_many(
    delta: torch.Tensor,
    hessian: torch.Tensor,
    settings: Sequence[tuple[int, Sparsity]],
    *,
    group_size: int = -1,
    symmetric: bool = True,
    block_size: int = 128,
    damp: float = 0.01,
    static_groups: bool = False,
    max_elements: int = 1 << 28,
) -> list[SolverResult]:
    """:func:`obs_compress` of one delta under several ``(bits, sparsity)`` settings in one pass.

    OBS updates never cross rows, so the settings' copies of the delta are stacked as rows and share one
    inverse Hessian and one column loop (one pass for the 2:4 settings, whose blocks are whole groups of
    4, one for the others): the byte budget measures its candidates this way (a per-column loop per
    setting is launch-bound on a GPU: 15 settings x 126 modules of a 270M model took over ten minutes).
    :func:`obs_compress` is this function with one setting. A result can differ from the one-setting
    result only by the rounding of the block updates' matrix products, whose summation order may depend on
    the number of rows (on the CPU they have been bit-identical).

    Args:
        settings: ``(bits, sparsity)`` pairs; see :func:`obs_compress` for the other arguments.
        max_elements: stacked weights per pass at most (more settings take several passes).

    Returns:
        one :class:`SolverResult` per setting, in order.
    """
    _check_matrix("delta", delta)
    n, k = delta.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a delta with {k} inputs, got {tuple(hessian.shape)}")
    settings = list(settings)
    for bits, sparsity in settings:
        _check_options(bits, group_size, sparsity, k)
    if not isinstance(block_size, int) or block_size < 1:
        raise DeltaZipConfigError(f"block_size must be a positive integer, got {block_size!r}")
    if not damp >= 0.0:
        raise DeltaZipConfigError(f"damp must be >= 0, got {damp!r}")
    if not settings:
        return []
    device = delta.device
    w0 = delta.detach().to(dtype=torch.float32)
    h = hessian.detach().to(device=device, dtype=torch.float32).clone()
    if not bool(torch.isfinite(w0).all()):
        raise ValueError("delta has NaN or infinite values: check the fine-tune's weights")
    if not bool(torch.isfinite(h).all()):
        raise ValueError("hessian has NaN or infinite values: check the calibration inputs")
    dead = torch.diagonal(h) == 0
    torch.diagonal(h)[dead] = 1.0
    hinv, damp_used = _inverse_cholesky_upper(h, damp)
    del h
    per_pass = max(1, max_elements // max(1, n * k))
    out: dict[int, SolverResult] = {}
    for two4 in (False, True):
        idx = [i for i, (_, sp) in enumerate(settings) if (sp == "2:4") == two4]
        for s0 in range(0, len(idx), per_pass):
            part = idx[s0:s0 + per_pass]
            results = _obs_pass(w0, dead, hinv, damp_used, [settings[i] for i in part], group_size, symmetric,
                                -(-block_size // 4) * 4 if two4 else block_size, two4, static_groups)
            out.update(zip(part, results))
    return [out[i] for i in range(len(settings))]


def _obs_pass(w0, dead, hinv, damp_used, settings, group_size, symmetric, block_size, two4, static_groups):
    """One stacked pass of :func:`obs_compress_many`: settings' copies of ``w0`` as rows, a grid size per row."""
    n, k = w0.shape
    c_n = len(settings)
    device = w0.device
    w = w0.repeat(c_n, 1)
    # Inputs that never fire carry no information: their weights cannot matter to the objective.
    w[:, dead] = 0.0
    w_static = w.clone() if static_groups else None
    bits_rows = torch.tensor([b for b, _ in settings], device=device).repeat_interleave(n)[:, None]
    maxq = ((1 << bits_rows) - 1).float()
    fractions = [None if s is None or two4 else float(s) for _, s in settings]
    sparse = two4 or any(f is not None for f in fractions)
    g = k if group_size == -1 else group_size
    ng = packing.num_groups(k, group_size)
    codes = torch.empty(c_n * n, k, dtype=torch.uint8, device=device)
    scales = torch.empty(c_n * n, ng, dtype=torch.float32, device=device)
    zeros = torch.empty(c_n * n, ng, dtype=torch.uint8, device=device)
    mask = torch.ones(c_n * n, k, dtype=torch.bool, device=device) if sparse else None
    scale_col = zero_col = zero_f = None

    def qparams(current):  # packing.compute_qparams(current, bits, -1, symmetric), with bits per row
        scale, zero = packing.minmax_grid(current.amin(-1, keepdim=True), current.amax(-1, keepdim=True), maxq,
                                          symmetric)
        for j in range(c_n):  # each setting's scales rounded to its own storage dtype
            rows = slice(j * n, (j + 1) * n)
            scale[rows] = scale[rows].to(packing.choose_scale_dtype(scale[rows])).float()
        return scale, zero.to(torch.uint8)

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        b = i2 - i1
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d1 = torch.diagonal(hinv1)
        if sparse and not two4:
            # each setting's share of its target in this block (SparseGPT), so the running total stays
            # on round(f * N * cols); the lowest saliency w^2 / [H^-1]_ii^2 goes first
            saliency = (w1 ** 2 / d1 ** 2).reshape(c_n, n * b)
            order = torch.argsort(saliency, dim=1, stable=True)
            counts = torch.tensor([0 if f is None else _round_half_up(f * n * i2) - _round_half_up(f * n * i1)
                                   for f in fractions], device=device)
            pruned = torch.arange(n * b, device=device)[None, :] < counts[:, None]
            keep = torch.ones_like(pruned).scatter_(1, order, ~pruned)
            mask[:, i1:i2] = keep.view(c_n * n, b)
        for i in range(b):
            c = i1 + i
            if two4 and c % 4 == 0:  # the 2 of each row's 4 weights with the lowest saliency
                sal4 = w1[:, i:i + 4] ** 2 / d1[i:i + 4] ** 2
                prune = torch.argsort(sal4, dim=1, stable=True)[:, :2]
                mask[:, c:c + 4] = torch.ones(c_n * n, 4, dtype=torch.bool, device=device).scatter_(1, prune, False)
            if c % g == 0:
                ge = min(c + g, k)
                if w_static is not None:
                    current = w_static[:, c:ge]
                else:
                    current = w1[:, i:min(ge, i2) - i1]
                    if ge > i2:  # the group runs past this block: apply the block's pending updates
                        later = w[:, i2:ge] - err1[:, :i] @ hinv[i1:c, i2:ge]
                        current = torch.cat([current, later], dim=1)
                if mask is not None:
                    current = current * mask[:, c:ge]
                scale_col, zero_col = qparams(current)
                zero_f = zero_col.float()  # once per group, not per column
                scales[:, c // g] = scale_col[:, 0]
                zeros[:, c // g] = zero_col[:, 0]
            col = w1[:, i:i + 1]
            code = torch.minimum((torch.round(col / scale_col) + zero_f).clamp(min=0), maxq).to(torch.uint8)
            if mask is not None:
                code = torch.where(mask[:, c:c + 1], code, zero_col)
            q = (code.float() - zero_f) * scale_col
            codes[:, c] = code[:, 0]
            e = (col - q) / d1[i]
            w1[:, i:] -= e * hinv1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        if i2 < k:
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    results = []
    for j, (bits, sparsity) in enumerate(settings):
        rows = slice(j * n, (j + 1) * n)
        m = None if sparsity is None else mask[rows].clone()
        results.append(SolverResult(codes[rows].clone(), scales[rows].clone(), zeros[rows].clone(), m, bits,
                                    group_size, symmetric, sparsity, damp=damp_used))
    return results
