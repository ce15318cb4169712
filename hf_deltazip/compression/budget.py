"""A byte budget: bits, sparsity and group size chosen per module to reach a whole-file ratio.

``DeltaZipConfig(target_ratio=R)`` asks for a saved delta folder of ``fp16 bytes / R`` bytes. For every
module the compressor tries each :class:`Candidate` on the module's real delta and calibration inputs
(:func:`measure_module`): the cost is the candidate's packed tensors after zstd, byte for byte what the
``.dz`` file would hold, and the error is the OBS objective ``trace((D - A) H (D - A)^T)`` (the output
error the module would add on its calibration inputs), or, for an input embedding, the row errors
weighted by how often calibration text uses each token. :func:`allocate` then picks one option per
module with a Lagrange multiplier (minimise ``error + lambda * bytes``, bisection on ``lambda``) and
spends what is left greedily on the upgrades that buy the most error per byte.

The errors of all modules are in the same unit (a squared output error per calibration token), so
one multiplier trades them against each other; without calibration data every error is the plain
squared Frobenius error of the delta. With ``budget_weighting="fisher"`` (the default) each output
channel's error is also weighted by its Fisher information, the mean squared gradient of the
fine-tune's log-likelihood with respect to that channel on the calibration text (labels drawn from the
fine-tune's own predictions): the weighted errors estimate how much each module's error moves the
model's output distribution (second-order KL), so a squared error in a layer the output barely depends
on costs less than the same error where it does. A tied LM head's error is then counted with the
embedding's (the head's output channels are the vocabulary, weighted the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..config import Sparsity, lowrank_bits_per_weight
from ..delta import PackedModule
from ..errors import DeltaZipConfigError
from ..format.container import encoded_nbytes
from .solver import magnitude_mask, obs_compress, obs_compress_many, rtn_compress

__all__ = [
    "Candidate",
    "candidates",
    "Option",
    "measure_module",
    "skeleton",
    "allocate",
    "token_row_weights",
    "weighted_error",
    "BudgetUnreachable",
]


@dataclass(frozen=True)
class Candidate:
    """One setting the budget may give a module."""

    bits: int
    sparsity: Sparsity
    group_size: int

    def settings(self) -> dict:
        """As a ``DeltaZipConfig.overrides`` entry."""
        return {"bits": self.bits, "sparsity": self.sparsity, "group_size": self.group_size}


def candidates(config, kind: str) -> tuple:
    """The settings ``config.budget_bits`` x ``budget_sparsity`` x ``budget_group_sizes`` offer a module.

    Linear layers (the LM head included) get every one (every layout the kernels serve). Input embeddings
    (``kind="embedding"``) get no 2:4: the embedding lookup on the GPU reads dense rows. Both get the lowrank
    layout (served as dense codes of the factors' product): a fine-tune moves a vocabulary's delta in few
    directions, which a handful of singular vectors store in a fraction of what quantized rows take.
    """
    lowrank = [s for s in config.budget_sparsity if lowrank_bits_per_weight(s) is not None]
    sparsities = [s for s in config.budget_sparsity if s not in lowrank and (kind == "linear" or s != "2:4")]
    out = [Candidate(b, s, g) for b in config.budget_bits for s in sparsities for g in config.budget_group_sizes]
    if lowrank:  # served at the most precise grid offered: one candidate per factor size
        groups = [g for g in config.budget_group_sizes if g != -1]
        served = (max(config.budget_bits), min(groups) if groups else -1)
        out += [Candidate(served[0], s, served[1]) for s in lowrank]
    return tuple(out)


@dataclass(frozen=True)
class Option:
    """A measured candidate: ``nbytes`` in the file (packed + zstd), ``error`` as described above, and
    ``layout`` (what :func:`skeleton` needs to rebuild its records without its codes)."""

    candidate: Candidate
    nbytes: int
    error: float
    layout: tuple = ()
    bands: tuple = ()  # the lowrank layout: (directions, bits) of each band, most precise first


def skeleton(option: Option) -> PackedModule:
    """A module with ``option``'s layout, shapes and dtypes, all zeros: its records in a ``.dz`` header are
    those the real module gets, so a folder of skeletons measures the header and config bytes of a choice."""
    kind, shape, sparsity, nnz, symmetric, tensors = option.layout
    zeros = {role: torch.zeros(t_shape, dtype=dtype) for role, t_shape, dtype in tensors}
    c = option.candidate
    if sparsity == "lowrank":  # the factors' tensors are what the file holds; the served codes are not stored
        empty = torch.zeros(0, dtype=torch.uint8)
        return PackedModule(kind=kind, shape=shape, bits=c.bits, group_size=c.group_size, symmetric=symmetric,
                            sparsity="dense", transposed=False, qweight=empty, scales=empty, zeros=empty,
                            factors=PackedModule.split_factors(zeros, option.bands, shape))
    return PackedModule(kind=kind, shape=shape, bits=c.bits, group_size=c.group_size, symmetric=symmetric,
                        sparsity=sparsity, transposed=False, nnz=nnz, qweight=zeros["qweight"],
                        scales=zeros["scales"], zeros=zeros["zeros"], positions=zeros.get("positions"),
                        mask=zeros.get("mask"))


def token_row_weights(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Weight of each embedding row in the error: twice its share of calibration tokens, smoothed by one
    count per row so rows the calibration never uses still cost something (``H = 2 X^T X / n`` for one-hot X)."""
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=vocab)[:vocab].double()
    return (2.0 * (counts + 1.0) / (counts.sum() + vocab)).float()


def weighted_error(
    delta: torch.Tensor,
    approx: torch.Tensor,
    *,
    hessian: Optional[torch.Tensor] = None,
    row_weights: Optional[torch.Tensor] = None,
    col_weights: Optional[torch.Tensor] = None,
) -> float:
    """The error of ``approx`` for ``delta [N, K]``: each row's OBS objective ``e_n H e_n^T`` (with ``hessian``)
    or its squared error weighted by ``col_weights [K]`` (without), summed with ``row_weights [N]`` (1 if None).

    With ``H = 2 X^T X / n`` from a module's calibration inputs and ``row_weights`` the Fisher information
    of its output channels (:func:`~hf_deltazip.compression.pipeline.output_fisher`), this is the
    second-order increase of the model's KL divergence caused by the module's output error (up to a
    factor shared by every module), so errors of modules in different layers compare."""
    e = delta.float() - approx.to(delta.device).float()
    if hessian is not None:
        per_row = ((e @ hessian.to(e.device).float()) * e).sum(dim=1)
    else:
        sq = e.pow(2)
        per_row = (sq @ col_weights.to(sq.device).float()) if col_weights is not None else sq.sum(dim=1)
    if row_weights is not None:
        return float((per_row.double() * row_weights.to(per_row.device).double()).sum())
    return float(per_row.double().sum())


def measure_module(
    delta: torch.Tensor,
    *,
    candidates: Sequence[Candidate],
    kind: str,
    hessian: Optional[torch.Tensor] = None,
    row_weights: Optional[torch.Tensor] = None,
    col_weights: Optional[torch.Tensor] = None,
    head_hessian: Optional[torch.Tensor] = None,
    head_row_weights: Optional[torch.Tensor] = None,
    symmetric: bool = True,
    block_size: int = 128,
    damp: float = 0.01,
    zstd_level: int = 9,
) -> list:
    """Every candidate applicable to ``delta [N, K]``, solved and packed, as :class:`Option` s.

    Args:
        delta: the module's weight delta.
        candidates: settings to try; those the shape cannot take (2:4 with K not a multiple of 4) are skipped.
        kind: ``"linear"`` or ``"embedding"`` (an embedding that stays dense is stored as its changed rows).
        hessian: ``[K, K]`` from the module's calibration inputs: the OBS solver and its objective.
            None: round-to-nearest, error weighted by ``row_weights`` and ``col_weights`` (or plain Frobenius).
        row_weights: ``[N]`` weights of the rows' errors (an input embedding: how often calibration text
            uses each token; a linear layer: the Fisher information of each output channel).
        col_weights: ``[K]`` weights of an input embedding's columns (the Fisher information of the
            embedding's output channels); used without ``hessian`` only.
        head_hessian, head_row_weights: a tied LM head's inputs and output-channel Fisher information:
            the head's error (:func:`weighted_error` of the same rows) is added to the embedding's.
    """
    def error_of(approx: torch.Tensor) -> float:
        err = weighted_error(delta, approx, hessian=hessian, row_weights=row_weights, col_weights=col_weights)
        if head_hessian is not None:
            err += weighted_error(delta, approx, hessian=head_hessian, row_weights=head_row_weights)
        return err

    k = delta.shape[1]
    options = []
    lowrank = [c for c in candidates if lowrank_bits_per_weight(c.sparsity) is not None]
    if lowrank:
        options += _measure_lowrank(delta, lowrank, hessian, symmetric, zstd_level, error_of, kind)
    candidates = [c for c in candidates if c not in lowrank and not (c.sparsity == "2:4" and k % 4)]
    solved, masks = {}, {}
    if hessian is not None:  # one stacked OBS pass per group size (2:4 goes one by one)
        for gs in dict.fromkeys(c.group_size for c in candidates):
            batch = [c for c in candidates if c.group_size == gs and c.sparsity != "2:4"]
            results = obs_compress_many(delta, hessian, [(c.bits, c.sparsity) for c in batch], group_size=gs,
                                        symmetric=symmetric, block_size=block_size, damp=damp)
            solved.update(zip(batch, results))
    for cand in candidates:
        if cand in solved:
            res = solved.pop(cand)
        elif hessian is not None:
            res = obs_compress(delta, hessian, bits=cand.bits, group_size=cand.group_size, symmetric=symmetric,
                               sparsity=cand.sparsity, block_size=block_size, damp=damp)
        else:  # one magnitude mask per sparsity, shared by the candidates that differ in bits or groups
            if cand.sparsity not in masks:
                masks[cand.sparsity] = magnitude_mask(delta, cand.sparsity)
            res = rtn_compress(delta, bits=cand.bits, group_size=cand.group_size, symmetric=symmetric,
                               sparsity=cand.sparsity, keep_mask=masks[cand.sparsity])
        packed = PackedModule.from_codes(res.codes, res.scales, res.zeros, res.mask, bits=res.bits,
                                         group_size=res.group_size, symmetric=res.symmetric,
                                         two_four=cand.sparsity == "2:4", kind=kind,
                                         skip_zero_rows=kind == "embedding")
        nbytes = sum(encoded_nbytes(t, zstd_level) for t in packed.tensors().values())
        error = error_of(res.dequantize())
        layout = (kind, tuple(packed.shape), packed.sparsity, packed.nnz, packed.symmetric,
                  tuple((role, tuple(t.shape), t.dtype) for role, t in packed.tensors().items()))
        options.append(Option(cand, nbytes, error, layout))
    return options


def _measure_lowrank(delta, candidates, hessian, symmetric, zstd_level, error_of, kind="linear") -> list:
    """The lowrank candidates of one module: one SVD shared by every factor size; the error is that of the
    served codes (the factors' product rounded to the candidate's grid), as kernels and merges see it."""
    from .lowrank import lowrank_module

    d = delta.detach().float()
    factors = torch.linalg.svd(d, full_matrices=False)
    out = []
    for cand in candidates:
        packed = lowrank_module(d, lowrank_bits_per_weight(cand.sparsity), bits=cand.bits, group_size=cand.group_size,
                                symmetric=symmetric, factors=factors, hessian=hessian, kind=kind)
        error = error_of(packed.dequantize().to(d.device))
        nbytes = sum(encoded_nbytes(t, zstd_level) for t in packed.tensors().values())
        layout = (kind, tuple(packed.shape), "lowrank", None, packed.symmetric,
                  tuple((role, tuple(t.shape), t.dtype) for role, t in packed.tensors().items()))
        out.append(Option(cand, nbytes, error, layout, tuple((int(a.shape[0]), b) for b, a, _ in packed.factors)))
    return out


def _frontier(options: list) -> list:
    """The options no other option beats on both bytes and error, cheapest first."""
    out: list = []
    for opt in sorted(options, key=lambda o: (o.nbytes, o.error)):
        if not out or opt.error < out[-1].error:
            out.append(opt)
    return out


def allocate(measured: dict, budget_bytes: float) -> dict:
    """One option per module with total bytes at most ``budget_bytes`` and the smallest total error found.

    Args:
        measured: module name -> list of :class:`Option`.
        budget_bytes: bytes the modules may take together.

    Returns:
        module name -> the chosen :class:`Option`.

    Raises:
        DeltaZipConfigError: even the cheapest option of every module exceeds the budget.
    """
    fronts = {name: _frontier(opts) for name, opts in measured.items() if opts}
    if not fronts:
        return {}
    cheapest = sum(f[0].nbytes for f in fronts.values())
    if cheapest > budget_bytes:
        raise BudgetUnreachable(cheapest)

    def pick(lam: float) -> dict:
        return {name: min(f, key=lambda o: o.error + lam * o.nbytes) for name, f in fronts.items()}

    def total(choice: dict) -> int:
        return sum(o.nbytes for o in choice.values())

    best = pick(0.0)
    if total(best) > budget_bytes:
        lo, hi = 0.0, 1.0
        while total(pick(hi)) > budget_bytes:
            hi *= 10.0
            if hi > 1e300:
                best = {name: f[0] for name, f in fronts.items()}
                break
        else:
            for _ in range(200):
                mid = math.sqrt(lo * hi) if lo > 0 else hi / 1e6
                if total(pick(mid)) > budget_bytes:
                    lo = mid
                else:
                    hi = mid
                if lo > 0 and hi / lo < 1 + 1e-9:
                    break
            best = pick(hi)
    # spend what is left on the upgrades that remove the most error per byte
    spare = budget_bytes - total(best)
    while True:
        step = None
        for name, f in fronts.items():
            cur = best[name]
            for opt in f:
                extra = opt.nbytes - cur.nbytes
                if extra <= 0 or extra > spare or opt.error >= cur.error:
                    continue
                gain = (cur.error - opt.error) / extra
                if step is None or gain > step[0]:
                    step = (gain, name, opt)
        if step is None:
            return best
        _, name, opt = step
        spare -= opt.nbytes - best[name].nbytes
        best[name] = opt


class BudgetMeasurements:
    """What the budget step measured for one pair of models: every candidate of every module, which does
    not depend on the target ratio. Pass one object as ``compress(..., budget_measurements=m)`` to several
    calls that differ only in ``target_ratio``: the first fills it, the others reuse it and skip the
    measuring pass (the most expensive part of a budgeted compression).

    ``key`` records what the measurements depend on (the candidate sets, the solver settings, the
    calibration tokens, the models' parameter fingerprints); a call whose key differs is refused.
    """

    def __init__(self):
        self.key: Optional[dict] = None
        self.options: dict = {}
        self.weighting: str = "output"  # the weighting the errors were measured with (see budget_weighting)

    def __len__(self) -> int:
        return len(self.options)

    def __repr__(self) -> str:
        return f"BudgetMeasurements({len(self.options)} modules measured)"

    def check(self, key: dict) -> None:
        """Refuse measurements made for another pair, calibration or candidate set."""
        if self.key is not None and self.key != key:
            changed = sorted(k for k in set(self.key) | set(key) if self.key.get(k) != key.get(k))
            raise DeltaZipConfigError(
                f"budget_measurements were made with other {', '.join(changed)}; use a new BudgetMeasurements() "
                f"for this compression (they can only be shared by calls that differ in target_ratio)")


class BudgetUnreachable(DeltaZipConfigError):
    """The cheapest candidates still exceed the budget (``cheapest`` bytes)."""

    def __init__(self, cheapest: int):
        super().__init__(f"the cheapest settings need {cheapest} bytes")
        self.cheapest = cheapest
