"""Activation-sparse decoding kernels: read only the weight rows of inputs that are kept.

With activation sparsity (TEAL-style magnitude thresholds, see
``hf_deltazip.modeling.activation_sparsity``) a decode step's input ``x`` is zero on 25-50 % of
its features, and at batch 1 every zero saves the bytes of one weight column. Two kernels use it:

* :func:`sparse_base_linear` - ``y = x W^T + bias`` for a few rows (batch 1 decoding), reading
  weight column ``k`` only when some row keeps input ``k``.
* :func:`sparse_delta_linear` - ``out[m] += x[m] dequant(delta[row_delta[m]])^T`` for mixed
  batches: rows are grouped into segments sharing a delta (:func:`kernels.layout.build_row_segments`)
  and each segment reads only the columns its own rows keep. With 8 distinct deltas in a batch of 8,
  each delta sees one row, so the delta part skips columns even when the base part cannot.

**Layout (and its memory cost).** Reading a column subset of a row-major ``[N, K]`` matrix touches
one 32-byte memory sector per kept element: no saving at 50 % sparsity. Both kernels therefore
read *input-major* weights, where input ``k``'s column is one contiguous row:

* base: ``W^T`` as a contiguous ``[K, N]`` tensor (:func:`input_major_weight`). It costs no memory
  when it *replaces* the row-major copy: ``nn.Linear`` computes the same with ``weight = Wt.t()``
  (a transposed view; cuBLAS reads either order at full speed). Keeping both doubles the layer.
* deltas: :class:`InputMajorDeltas` (:func:`input_major_deltas`): codes packed along the outputs,
  uint8 ``[U, K, ceil(N*b/8)]``, with scales and zero points ``[U, G, N]``: the same bytes as the
  file layout. A stack kept for the dense multi-delta kernel as well holds the codes twice
  (4-bit: a quarter of the base layer per delta; 2-bit: an eighth).

Skipping is exact: a skipped column contributes ``0 * w`` in the dense reference. Both kernels
accept ``threshold=``: inputs with ``|x| <= threshold`` are treated as zero inside the kernel
(no separate thresholding pass). The grids depend on shapes only (no host sync): safe to capture
in a CUDA graph. On Hopper the launches use programmatic dependent launch (each may begin while
the kernel before it drains; ``pdl=``). :func:`sparse_base_linears` multiplies up to three weights
that read the same input (q/k/v, gate/up) in one launch. Each launch sums its tiles in a float32
workspace that the kernel (or its finishing launch) leaves zero;
the workspaces, and the kept-input lists of the compacted walks (one small launch before the
kernel packs each row's kept inputs per tile), are kept per shape for the life of the process (a
captured graph holds their addresses), so launches of one shape must not run concurrently on two
streams. On a CPU tensor without ``TRITON_INTERPRET=1`` the public functions run the
references.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hf_deltazip.packing import num_groups, pack_bits, unpack_bits

from . import _interpreter_compat
from .delta_stack import DeltaStack
from .layout import SEGMENT_FIELDS, build_row_segments

__all__ = [
    "InputMajorDeltas",
    "input_major_weight",
    "input_major_deltas",
    "input_major_low_rank",
    "input_major_fields",
    "input_major_nbytes",
    "LOWRANK_MAX_RANK",
    "sparsify_input",
    "sparse_base_linear",
    "sparse_base_linears",
    "sparse_base_linear_reference",
    "sparse_delta_linear",
    "sparse_delta_linear_reference",
    "SPARSE_BASE_DEFAULTS",
    "SPARSE_BASE_MAX_ROWS",
    "SPARSE_DELTA_DEFAULTS",
    "SPARSE_DELTA_MIXED_ROWS",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BITS = (2, 4, 8)
#: rows one base program handles (a decode step at batch 1-16); more rows keep fewer zero columns
SPARSE_BASE_MAX_ROWS = 16
#: launch defaults of :func:`sparse_base_linear` as ``(block_n, block_k, num_warps)``: one row (the
#: compacted GEMV) and several rows (16-row MMA tiles)
SPARSE_BASE_DEFAULTS = {"one": (64, 128, 2), "rows": (64, 256, 2)}
#: launch defaults of :func:`sparse_delta_linear` as ``(block_n, num_warps, inner_k)``: for a call of
#: at least :data:`SPARSE_DELTA_MIXED_ROWS` rows (a mixed batch, one row per delta; 2-bit deltas their own)
#: and for fewer rows (batch 1 on one delta); the fastest compacted walks of the H200 sweeps (BENCHMARKS.md
#: section 8)
SPARSE_DELTA_DEFAULTS = {"mixed": (512, 2, 8), "mixed_2bit": (1024, 4, 8), "few": (128, 1, 16)}
SPARSE_DELTA_MIXED_ROWS = 4
#: the highest rank of the low-rank compensation (``lowrank=``) the base kernels take
LOWRANK_MAX_RANK = 64
#: inputs per kept-input list of the compacted base GEMV (lists are built in parallel, one per segment)
_BASE_SEGMENT = 1024


def sparsify_input(x: torch.Tensor, threshold: Optional[float]) -> torch.Tensor:
    """``x`` with every entry of ``|x| <= threshold`` set to zero (``None``: ``x`` unchanged)."""
    if threshold is None:
        return x
    # against a Python scalar the comparison is made in x's own dtype, the threshold rounded to it (as the
    # kernels compare), and nothing is copied to the device (safe inside a captured CUDA graph)
    return torch.where(x.abs() > float(threshold), x, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- layouts
def input_major_weight(weight: torch.Tensor) -> torch.Tensor:
    """A row-major ``[N, K]`` weight as the contiguous ``[K, N]`` copy :func:`sparse_base_linear` reads.

    To avoid holding the layer twice, give the layer ``weight = result.t()`` and drop the old copy
    (``nn.Linear`` and cuBLAS read the transposed view at the same speed)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got {tuple(weight.shape)}")
    return weight.t().contiguous()


def input_major_nbytes(out_features: int, in_features: int, bits: int, group_size: int, scale_bytes: int = 2) -> int:
    """Bytes of one delta of ``out_features x in_features`` in :class:`InputMajorDeltas` (codes, scales and
    zero points; 0 for bit widths the layout does not hold)."""
    if bits not in (2, 4, 8):
        return 0
    codes = in_features * -(-out_features * bits // 8)
    return codes + num_groups(in_features, group_size) * out_features * (scale_bytes + 1)


@dataclass(frozen=True)
class InputMajorDeltas:
    """``U`` deltas of one layer in the input-major layout :func:`sparse_delta_linear` reads.

    Attributes:
        qweight: uint8 ``[U, K, ceil(N*bits/8)]``: code of output ``n`` for input ``k`` at bits
            ``(n % P) * bits`` of byte ``n // P`` of row ``k`` (``P = 8 // bits``).
        scales: float16 / float32 ``[U, G, N]``; zeros: uint8 ``[U, G, N]`` (``G`` groups of inputs).
        bits: 2, 4 or 8; group_size: inputs per group (-1: one group).
        out_features: ``N``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    out_features: int

    @property
    def num_deltas(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def dequantize(self, i: int) -> torch.Tensor:
        """Delta ``i`` as a dense float32 ``[N, K]`` matrix."""
        n, k = self.out_features, self.in_features
        codes = unpack_bits(self.qweight[i], self.bits, n).float()  # [K, N]
        rows = torch.arange(k, device=codes.device) // (k if self.group_size == -1 else self.group_size)
        w = (codes - self.zeros[i].float()[rows]) * self.scales[i].float()[rows]
        return w.t()


def input_major_deltas(stack: DeltaStack) -> InputMajorDeltas:
    """A :class:`~kernels.delta_stack.DeltaStack` (any layout; 2:4 deltas as dense codes) re-laid out
    for :func:`sparse_delta_linear`. Same bytes per delta; a copy.

    Raises:
        ValueError: the stack's codes are 3-bit (no whole codes per byte along the outputs).
    """
    if stack.bits not in _BITS:
        raise ValueError(f"input-major deltas need 2-, 4- or 8-bit codes, got {stack.bits}-bit: keep the dense kernel")
    fields = [input_major_fields(stack, i) for i in range(stack.num_deltas)]
    return InputMajorDeltas(
        qweight=torch.stack([f[0] for f in fields]), scales=torch.stack([f[1] for f in fields]),
        zeros=torch.stack([f[2] for f in fields]),
        bits=stack.bits, group_size=stack.group_size, out_features=stack.out_features,
    )


def input_major_fields(stack: DeltaStack, i: int) -> tuple:
    """Delta ``i`` of ``stack`` (2-, 4- or 8-bit) in the input-major layout: ``(qweight [K, ceil(N*bits/8)],
    scales [G, N], zeros [G, N])``, the rows of :class:`InputMajorDeltas` (contiguous copies). Reads no value
    back (the stack's codes are in range): on a GPU it queues behind a running step instead of waiting for it."""
    codes = stack.codes(i).t().contiguous()
    return (pack_bits(codes, stack.bits, check=False), stack.scales[i].t().contiguous(),
            stack.zeros[i].t().contiguous())


# --------------------------------------------------------------------------- references
def sparse_base_linear_reference(x: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                 threshold: Optional[float] = None, lowrank: Optional[tuple] = None) -> torch.Tensor:
    """What :func:`sparse_base_linear` computes: ``sparsify(x) @ weight_t + bias`` in float32, plus
    ``(x - sparsify(x)) A^T B^T`` with ``lowrank = (A^T, B)``."""
    _check_base(x, weight_t, bias, None)
    _check_lowrank(lowrank, x, [weight_t.shape[1]], True)
    xs = sparsify_input(x, threshold)
    y = xs.float() @ weight_t.float()
    if bias is not None:
        y = y + bias.float()
    if lowrank is not None:
        at, b = lowrank
        y = y + ((x.float() - xs.float()) @ at.float()) @ b.float().t()
    return y.to(x.dtype)


def input_major_low_rank(factors: Sequence[tuple]) -> tuple:
    """The ``lowrank=`` argument of :func:`sparse_base_linear` / :func:`sparse_base_linears` from one
    ``(A [r, K], B [N_i, r])`` pair per weight (``B @ A`` approximating the weight ``[N_i, K]``, e.g.
    ``hf_deltazip.modeling.activation_sparsity.low_rank_factors``; one rank for all): ``(A^T [K, r * n],
    B [sum N_i, r])``, contiguous, in the factors' dtype."""
    factors = list(factors)
    if not factors:
        raise ValueError("give one (A, B) pair per weight")
    ranks = {a.shape[0] for a, _ in factors} | {b.shape[1] for _, b in factors}
    if len(ranks) != 1 or any(a.shape[1] != factors[0][0].shape[1] for a, _ in factors):
        raise ValueError(f"every (A [r, K], B [N, r]) pair needs the same r and K, got "
                         f"{[(tuple(a.shape), tuple(b.shape)) for a, b in factors]}")
    return (torch.cat([a for a, _ in factors]).t().contiguous(), torch.cat([b for _, b in factors]).contiguous())


def _split_lowrank(lowrank: Optional[tuple], sizes: Sequence[int]) -> list:
    """Per weight ``(A^T [K, r], B [N_i, r])`` of a grouped ``lowrank`` (``None`` each without)."""
    if lowrank is None:
        return [None] * len(sizes)
    at, b = lowrank
    r = b.shape[1]
    bs = b.split(list(sizes))
    return [(at[:, i * r:(i + 1) * r], bs[i]) for i in range(len(sizes))]


def _check_lowrank(lowrank, x, sizes: Sequence[int], finish_kernel: bool) -> None:
    if lowrank is None:
        return
    if not isinstance(lowrank, (tuple, list)) or len(lowrank) != 2:
        raise ValueError("lowrank must be (A^T [K, r * weights], B [N, r]) from input_major_low_rank(...)")
    at, b = lowrank
    k, n = x.shape[1], sum(sizes)
    for t in (at, b):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.device != x.device or not t.dtype.is_floating_point:
            raise ValueError("lowrank's A^T and B must be 2-D float tensors on x's device")
    r = b.shape[1]
    if tuple(at.shape) != (k, r * len(sizes)) or tuple(b.shape) != (n, r):
        raise ValueError(f"lowrank shapes {tuple(at.shape)} and {tuple(b.shape)} do not fit {len(sizes)} weight(s) "
                         f"[{k} -> {list(sizes)}]: want A^T [{k}, {len(sizes)} * r] and B [{n}, r]")
    if not 1 <= r <= LOWRANK_MAX_RANK:
        raise ValueError(f"the low-rank compensation's rank must be 1 to {LOWRANK_MAX_RANK} in the kernel, got {r}")
    if not finish_kernel:
        raise ValueError("lowrank needs the finishing launch: leave finish_kernel=True")


def sparse_delta_linear_reference(x: torch.Tensor, deltas: InputMajorDeltas, row_delta: torch.Tensor,
                                  out: Optional[torch.Tensor] = None,
                                  threshold: Optional[float] = None) -> torch.Tensor:
    """What :func:`sparse_delta_linear` computes, in plain PyTorch (host sync on ``row_delta``)."""
    _check_delta(x, deltas, row_delta, out)
    rd = row_delta.long()
    if rd.numel() and (int(rd.min()) < -1 or int(rd.max()) >= deltas.num_deltas):
        raise ValueError(f"row_delta values must be in [-1, {deltas.num_deltas}) (-1: no delta), got "
                         f"min {int(rd.min())}, max {int(rd.max())}")
    xs = sparsify_input(x, threshold).float()
    y = out.float() if out is not None else torch.zeros((x.shape[0], deltas.out_features), device=x.device)
    for u in torch.unique(rd[rd >= 0]).tolist():
        rows = (rd == u).nonzero().squeeze(1)
        y[rows] += xs[rows] @ deltas.dequantize(u).t()
    return y.to(out.dtype if out is not None else x.dtype)


# --------------------------------------------------------------------------- checks
def _check_x(x):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K]: flatten leading dims first, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def _check_out(out, m, n, x):
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype not in _FLOAT_DTYPES
                            or out.device != x.device or out.stride(1) != 1):
        raise ValueError(f"out must be a float [{m}, {n}] tensor on {x.device} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _check_base(x, weight_t, bias, out):
    _check_x(x)
    m, k = x.shape
    if weight_t.dim() != 2 or weight_t.shape[0] != k:
        raise ValueError(f"weight_t must be the input-major [K={k}, N] weight (input_major_weight(W)), "
                         f"got {tuple(weight_t.shape)}")
    if weight_t.dtype != x.dtype:
        raise ValueError(f"weight_t is {weight_t.dtype} but x is {x.dtype}: cast x to the weight's dtype")
    n = weight_t.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must be [N={n}] or None, got {tuple(bias.shape)}")
    _check_out(out, m, n, x)
    devices = {t.device for t in (x, weight_t, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"x, weight_t and bias must be on one device, got {sorted(map(str, devices))}")


def _check_delta(x, deltas, row_delta, out):
    _check_x(x)
    if not isinstance(deltas, InputMajorDeltas):
        raise TypeError(f"deltas must be InputMajorDeltas (see input_major_deltas), got {type(deltas).__name__}")
    m, k = x.shape
    if deltas.in_features != k:
        raise ValueError(f"the deltas are for {deltas.in_features} inputs but x has {k}")
    if deltas.bits not in _BITS:
        raise ValueError(f"deltas must have 2-, 4- or 8-bit codes, got {deltas.bits}")
    if row_delta.dim() != 1 or row_delta.shape[0] != m or row_delta.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_delta must be int32 or int64 [M={m}] (-1: no delta), got "
                         f"{row_delta.dtype} {tuple(row_delta.shape)}")
    _check_out(out, m, deltas.out_features, x)
    devices = {t.device for t in (x, deltas.qweight, row_delta)}
    if len(devices) != 1:
        raise ValueError(f"x, the deltas and row_delta must be on one device, got {sorted(map(str, devices))}")


# --------------------------------------------------------------------------- launchers
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel(name: str):
    from . import _act_sparse_triton as mod  # triton is imported here, on first use

    if _interpreting():
        _interpreter_compat.ensure()
    kern = getattr(mod, name)
    if (type(kern).__name__ == "InterpretedFunction") != _interpreting():  # TRITON_INTERPRET changed
        import importlib

        kern = getattr(importlib.reload(mod), name)
    return kern


_PDL_DEVICES: dict = {}


def _pdl_supported(x: torch.Tensor) -> bool:
    """Whether launches on ``x``'s device can use programmatic dependent launch (compiled, compute
    capability 9.0+, a triton with grid dependency control); cached per device."""
    if _interpreting() or x.device.type != "cuda":
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        from . import _act_sparse_triton as mod

        _PDL_DEVICES[index] = mod.gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


def _pdl(pdl: Optional[int], x: torch.Tensor) -> int:
    """The launch's programmatic-dependent-launch mode: ``pdl`` as given, or the default for ``x``'s device."""
    if pdl is None:
        return 2 if _pdl_supported(x) else 0
    if pdl not in (0, 1, 2):
        raise ValueError(f"pdl must be 0, 1, 2 or None, got {pdl!r}")
    if pdl and not _pdl_supported(x):
        raise ValueError("pdl needs a GPU of compute capability 9.0 or more (Hopper) and triton >= 3.3 "
                         "(triton.language.extra.cuda.gdc_wait): pass pdl=0 or None")
    return pdl


def _pdl_launch(pdl: int) -> dict:
    """The launch option that goes with a kernel's ``PDL`` argument."""
    return {"launch_pdl": True} if pdl else {}


def _runs_reference(x: torch.Tensor) -> bool:
    return x.device.type != "cuda" and not _interpreting()


def _thr(threshold: Optional[float], dtype: torch.dtype) -> tuple[float, bool]:
    """The threshold as the kernels take it: rounded to the activations' dtype, so that the kernel's
    float32 comparison ``|x| > thr`` drops exactly the inputs :func:`sparsify_input` drops (a float32
    ``0.6`` against float16 inputs would keep the inputs equal to float16's ``0.6001``)."""
    if threshold is None:
        return 0.0, False
    t = float(threshold)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"threshold must be a finite number >= 0 or None, got {threshold!r}")
    return float(torch.tensor(t, dtype=dtype)), True


def _dot_prec(x):
    return "ieee" if x.dtype == torch.float32 else "tf32"


# float32 partial sums and per-tile counters the kernels leave zero after every launch; one pair per
# (device, shape), kept for the life of the process: a captured CUDA graph holds their addresses
_WORKSPACES: dict = {}


def _workspace(device: torch.device, m: int, n: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index, m, n, counters)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (torch.zeros((m, n), dtype=torch.float32, device=device),
                                 torch.zeros(counters, dtype=torch.int32, device=device))
    return ws


# kept-input lists of compact_inputs_kernel: indices, values and counts per (device, rows, inputs,
# segment, dtype), rewritten by every launch and kept for the life of the process like the workspaces
_COMPACT: dict = {}


def _compacted(x: torch.Tensor, thr: float, use_thr: bool, seg: int, pdl: int = 0, lists: bool = True,
               lowrank: Optional[tuple] = None) -> tuple:
    """Launch :func:`compact_inputs_kernel` on ``x``: per row and per segment of ``seg`` inputs, the
    kept inputs' indices and values packed to the front of the segment, and their counts ``[M, cdiv(K, seg)]``
    (``lists``); with ``lowrank`` (``(A^T [K, RT], B)``) also each chunk's share of ``z = x_dropped A^T``,
    ``[M, chunks, RT]`` float32, by more programs of the same launch. Returns ``(idx, xv, cnt, z_parts)``
    (``z_parts`` ``None`` without)."""
    m, k = x.shape
    nseg = _cdiv(k, seg)
    key = (x.device.type, x.device.index, m, k, seg, x.dtype)
    buf = _COMPACT.get(key)
    if buf is None:
        buf = _COMPACT[key] = (torch.zeros((m, k), dtype=torch.int32, device=x.device),
                               torch.zeros((m, k), dtype=x.dtype, device=x.device),
                               torch.zeros((m, nseg), dtype=torch.int32, device=x.device))
    idx, xv, cnt = buf
    nl = nseg if lists else 0
    zp, lr, nlr = None, {}, 0
    if lowrank is not None:
        at = lowrank[0]
        rp = max(16, _next_pow2(at.shape[1]))
        lch = max(16, min(128, 8192 // rp))
        nlr = _cdiv(k, lch)
        zkey = ("z", x.device.type, x.device.index, m, nlr, at.shape[1])
        zp = _COMPACT.get(zkey)
        if zp is None:
            zp = _COMPACT[zkey] = torch.zeros((m, nlr, at.shape[1]), dtype=torch.float32, device=x.device)
        lr = dict(at_ptr=at, zp_ptr=zp, RT=at.shape[1], NLR=nlr, LR=True, RP=rp, LCH=lch)
    _kernel("compact_inputs_kernel")[(nl + nlr, m)](x, idx, xv, cnt, thr, k, x.stride(0), SEG=seg, THRESH=use_thr,
                                                    CH=min(1024, _next_pow2(seg)), PDL=pdl, NL=nl, num_warps=4,
                                                    **lr, **_pdl_launch(pdl))
    return idx, xv, cnt, zp


def _inner_k(inner_k: int, block_k: int) -> int:
    """The kernels' ``BKI``: ``inner_k``, or ``block_k`` (one step) for 0."""
    if inner_k == 0:
        return block_k
    if inner_k < 1 or inner_k & (inner_k - 1) or inner_k > block_k:
        raise ValueError(f"inner_k must be 0 or a power of two up to block_k={block_k}, got {inner_k}")
    return inner_k


def _check_blocks(block_n: int, block_k: int, block_m: Optional[int] = None) -> None:
    for name, v in (("block_n", block_n), ("block_k", block_k), ("block_m", block_m)):
        if v is not None and (v < 1 or v & (v - 1)):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if block_n < 16 or block_k < 16:
        raise ValueError(f"block_n and block_k must be at least 16, got {block_n} and {block_k}")
    if block_m is not None and 1 < block_m < 16:
        raise ValueError(f"block_m must be 1 (one row at a time, no MMA) or at least 16, got {block_m}")


def sparse_base_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                       threshold: Optional[float] = None, out: Optional[torch.Tensor] = None,
                       block_n: Optional[int] = None, block_k: Optional[int] = None, num_warps: Optional[int] = None,
                       mma: bool = False, compact: bool = True, pdl: Optional[int] = None,
                       finish_kernel: bool = True, lowrank: Optional[tuple] = None) -> torch.Tensor:
    """``y = x W^T + bias`` reading only the weight columns of inputs some row of ``x`` keeps.

    Args:
        x: ``[M, K]`` activations (float16 / bfloat16 / float32). Meant for decoding (``M`` of 1 to
            :data:`SPARSE_BASE_MAX_ROWS`): a column is read when *any* row in a block keeps it. One
            row runs without MMA (a GEMV); more rows use ``tl.dot`` on blocks of 16.
        weight_t: the input-major ``[K, N]`` weight, same dtype (:func:`input_major_weight`).
        bias: ``[N]`` or ``None``.
        threshold: inputs with ``|x| <= threshold`` count as zero (``None``: only exact zeros).
        out: optional ``[M, N]`` output.
        block_n, block_k, num_warps: the ``[block_k, block_n]`` weight tile of one program (powers
            of two, at least 16) and its warps. Memory is skipped per input whatever the tile.
            ``None``: :data:`SPARSE_BASE_DEFAULTS` for one row or several (the masked one-row walk:
            k-tiles of 256).
        mma: one row through ``tl.dot`` too, padded to 16 rows; ``False`` (default, faster on the
            H200): one row runs as a GEMV (a multiply and a sum across lanes).
        compact: one row without MMA: first pack the row's kept inputs into lists of 1024-input
            segments (one small extra launch), then give each program ``block_k`` *kept* inputs, so
            a program past the end of a list does nothing (the default: 99.4 against 102.7 µs per
            8B block at 50 % on the H200 with the finishing launch and PDL, BENCHMARKS.md section
            8; slower without them). ``False``: each program takes ``block_k`` consecutive inputs
            and masks the dropped ones. Ignored for more rows.
        pdl: programmatic dependent launch (Hopper and later): 0 off; 1 the launch may start
            before the kernel before it ends and waits for it inside; 2 the same, and this launch
            lets the next one start as its own last programs run (the same results; 3-13 µs less
            per 8B block on the H200, BENCHMARKS.md section 8). ``None`` (default): 2 on a GPU of
            compute capability 9.0 or more, else 0.
        finish_kernel: ``True`` (default): a second, small launch turns the float32 sums into the
            output (1.5-4 % faster per 8B block at 40-50 % on the H200 than the alternative);
            ``False``: the last program of each output tile does it, counting the tiles in with an
            atomic counter.
        lowrank: ``None``, or the low-rank compensation of the dropped inputs as ``(A^T, B)`` from
            :func:`input_major_low_rank`: ``y += (x - sparsify(x)) A^T B^T``, ``A^T`` ``[K, r]`` and ``B``
            ``[N, r]`` (``r`` at most 64). ``A`` is read once per call by the kernel that packs the kept
            inputs, ``B`` by the finishing launch (``finish_kernel`` must stay ``True``).

    Returns:
        ``[M, N]`` in ``out``'s dtype (default ``x.dtype``), accumulated in float32.
    """
    _check_base(x, weight_t, bias, out)
    block_n, block_k, num_warps = _base_tiles(block_n, block_k, num_warps, x, mma, compact)
    _check_blocks(block_n, block_k)
    _thr(threshold, x.dtype)  # a bad threshold or pdl is refused on every path
    pdl = _pdl(pdl, x)
    _check_lowrank(lowrank, x, [weight_t.shape[1]], finish_kernel)
    if _runs_reference(x):
        y = sparse_base_linear_reference(x, weight_t, bias, threshold, lowrank)
        return y if out is None else out.copy_(y)
    return _launch_base(x, [weight_t], bias, threshold, out, block_n, block_k, num_warps, mma, compact, pdl,
                        finish_kernel, lowrank)


def sparse_base_linears(x: torch.Tensor, weights_t: Sequence[torch.Tensor],
                        biases: Optional[Sequence[Optional[torch.Tensor]]] = None, *,
                        threshold: Optional[float] = None, out: Optional[torch.Tensor] = None,
                        block_n: Optional[int] = None, block_k: Optional[int] = None,
                        num_warps: Optional[int] = None, mma: bool = False, compact: bool = True,
                        pdl: Optional[int] = None, finish_kernel: bool = True,
                        lowrank: Optional[tuple] = None) -> tuple:
    """:func:`sparse_base_linear` for up to three weights that read the same input (q/k/v, gate/up),
    in one launch: the same result as one call per weight, with the launch and the tail of two
    fewer kernels. The weights stay separate tensors (nothing is concatenated).

    Args:
        x: ``[M, K]`` activations.
        weights_t: one to three input-major ``[K, N_i]`` weights (:func:`input_major_weight`).
        biases: ``None`` or one ``[N_i]`` bias or ``None`` per weight.
        out: optional ``[M, sum N_i]`` output; the weights' outputs are its column ranges in order.
        threshold, block_n, block_k, num_warps, mma, compact, pdl, finish_kernel: as
            :func:`sparse_base_linear` (one kept-input list serves every weight).
        lowrank: ``None`` or ``(A^T, B)`` of every weight at one rank ``r``, from
            :func:`input_major_low_rank`: ``A^T`` ``[K, r * len(weights_t)]`` (the weights' ``A^T`` side by
            side), ``B`` ``[sum N_i, r]`` (their ``B`` stacked).

    Returns:
        one ``[M, N_i]`` tensor per weight: column views of one ``[M, sum N_i]`` output.
    """
    weights_t = list(weights_t)
    if not 1 <= len(weights_t) <= 3:
        raise ValueError(f"sparse_base_linears takes one to three weights, got {len(weights_t)}")
    biases = [None] * len(weights_t) if biases is None else list(biases)
    if len(biases) != len(weights_t):
        raise ValueError(f"got {len(biases)} biases for {len(weights_t)} weights: give one (or None) per weight")
    if any(b is not None for b in biases) and any(b is None for b in biases):
        raise ValueError("give a bias for every weight or for none (a zero bias where a layer has none)")
    for w, b in zip(weights_t, biases):
        _check_base(x, w, b, None)
    sizes = [w.shape[1] for w in weights_t]
    block_n, block_k, num_warps = _base_tiles(block_n, block_k, num_warps, x, mma, compact)
    _check_blocks(block_n, block_k)
    _thr(threshold, x.dtype)
    pdl = _pdl(pdl, x)
    n = sum(sizes)
    _check_out(out, x.shape[0], n, x)
    _check_lowrank(lowrank, x, sizes, finish_kernel)
    bias = None if biases[0] is None else torch.cat([b.reshape(-1) for b in biases])
    if _runs_reference(x):
        parts = _split_lowrank(lowrank, sizes)
        y = torch.cat([sparse_base_linear_reference(x, w, b, threshold, lr)
                       for w, b, lr in zip(weights_t, biases, parts)], dim=1)
        y = y if out is None else out.copy_(y)
    else:
        y = _launch_base(x, weights_t, bias, threshold, out, block_n, block_k, num_warps, mma, compact, pdl,
                         finish_kernel, lowrank)
    return tuple(y.split(sizes, dim=1))


def _base_tiles(block_n: Optional[int], block_k: Optional[int], num_warps: Optional[int], x: torch.Tensor,
                mma: bool, compact: bool) -> tuple:
    """The base kernel's ``(block_n, block_k, num_warps)``: those given, the rest from
    :data:`SPARSE_BASE_DEFAULTS` (one row without MMA, or several rows); the masked one-row walk
    (``compact=False``) takes k-tiles of 256."""
    one = x.dim() == 2 and x.shape[0] == 1 and not mma
    dn, dk, dw = SPARSE_BASE_DEFAULTS["one" if one else "rows"]
    if block_k is None:
        block_k = 256 if one and not compact else dk
    return (dn if block_n is None else block_n), block_k, (dw if num_warps is None else num_warps)


def _launch_base(x, weights_t, bias, threshold, out, block_n, block_k, num_warps, mma, compact, pdl,
                 finish_kernel, lowrank=None):
    thr, use_thr = _thr(threshold, x.dtype)
    for w in weights_t:
        if w.stride(1) != 1:
            raise ValueError("weight_t must have contiguous rows: build it with input_major_weight(W)")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    sizes = [w.shape[1] for w in weights_t]
    n = sum(sizes)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=out.dtype))
    bm = 1 if m == 1 and not mma else SPARSE_BASE_MAX_ROWS
    use_compact = compact and bm == 1
    # compacted: lists per segment of `seg` inputs (compacted in parallel), block_k kept inputs a program
    seg = max(_BASE_SEGMENT, block_k)
    tiles = sum(_cdiv(s, block_n) for s in sizes)
    grid = (tiles, _cdiv(k, seg) * (seg // block_k) if use_compact else _cdiv(k, block_k), _cdiv(m, bm))
    ws, cnt = _workspace(x.device, m, n, grid[0] * grid[2])
    lowrank = lowrank if use_thr else None  # only exact zeros dropped: nothing to compensate
    if lowrank is not None and not (lowrank[0].is_contiguous() and lowrank[1].is_contiguous()):
        raise ValueError("lowrank's A^T and B must be contiguous (input_major_low_rank makes them so)")
    zp = None
    if use_compact:
        idx, xv, kc, zp = _compacted(x, thr, use_thr, seg, pdl, lowrank=lowrank)
    else:
        idx, xv, kc = cnt, x, cnt
        if lowrank is not None:  # the dropped inputs' z alone, one small launch before the sums
            zp = _compacted(x, thr, use_thr, seg, pdl, lists=False, lowrank=lowrank)[3]
    w0, w1, w2 = (weights_t + weights_t[-1:] * 2)[:3]
    _kernel("sparse_base_kernel")[grid](
        x, w0, bias if bias is not None else out, out, ws, ws.view(torch.int32), cnt, thr, idx, xv, kc,
        m, n, k, x.stride(0), w0.stride(0), out.stride(0),
        w1, w2, sizes[0], sizes[1] if len(sizes) > 1 else 0, w1.stride(0), w2.stride(0),
        HAS_BIAS=bias is not None, THRESH=use_thr, GEMV=bm == 1, COMPACT=use_compact, SEG=seg, BM=bm, BN=block_n,
        BK=block_k, DOT_PREC=_dot_prec(x), PDL=pdl, NG=len(weights_t), LAST_FINISHES=not finish_kernel,
        num_warps=num_warps, **_pdl_launch(pdl),
    )
    if finish_kernel:
        lr, block = {}, 1024
        if lowrank is not None:
            at, b = lowrank
            r = b.shape[1]
            rb = max(16, _next_pow2(r))
            block = max(64, min(1024, 4096 // rb))
            nseg = zp.shape[1]
            lr = dict(b_ptr=b, zp_ptr=zp, NSEG=nseg, RT=at.shape[1], R=r, N0=sizes[0],
                      N1=sizes[1] if len(sizes) > 1 else 0, LR=True, NG=len(sizes), RB=rb, SP=_next_pow2(nseg))
        _kernel("finish_rows_kernel")[(_cdiv(n, block), m)](
            ws.view(torch.int32), out, bias if bias is not None else out, n, out.stride(0), HAS_BIAS=bias is not None,
            BLOCK=block, PDL=pdl, num_warps=4, **lr, **_pdl_launch(pdl))
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sparse_delta_linear(x: torch.Tensor, deltas: InputMajorDeltas, row_delta: torch.Tensor, *,
                        out: Optional[torch.Tensor] = None, threshold: Optional[float] = None,
                        segments: Optional[torch.Tensor] = None, block_m: int = 1,
                        block_n: Optional[int] = None, block_k: int = 0, num_warps: Optional[int] = None,
                        inner_k: Optional[int] = None, compact: bool = True, pdl: Optional[int] = None,
                        segment_lookup: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[m] += x[m] @ dequant(deltas[row_delta[m]])^T``, each segment of rows sharing a delta
    reading only the delta columns its own rows keep.

    Args:
        x: ``[M, K]`` activations (float16 / bfloat16 / float32; magnitudes below ``2**64``: the one-row walks
            multiply ``x`` by ``2**64`` so that their products with codes read as float32 denormals are normal).
        deltas: the layer's deltas in the input-major layout (:func:`input_major_deltas`).
        row_delta: int32 / int64 ``[M]`` in ``[-1, U)``: each row's delta (``-1``: none, the row of
            ``out`` is left as it is). Rows with an id of ``U`` or more are left as they are too;
            ids below ``-1`` are not allowed (unchecked on the GPU: checking would wait for it).
        out: ``[M, N]`` to add into (typically the base part, e.g. from :func:`sparse_base_linear`);
            ``None``: a zero tensor of ``x.dtype`` (the delta part alone).
        threshold: inputs with ``|x| <= threshold`` count as zero (``None``: only exact zeros).
        segments: the step's :func:`~kernels.layout.build_row_segments` table of ``row_delta`` (built
            here when ``None``); build it once per step and share it between layers.
        block_m: 1 (default): each row of a segment on its own as a GEMV with no MMA (a mixed
            batch of distinct deltas has one row per delta); 16 or more: rows of a segment
            multiplied together with ``tl.dot`` (a segment of one row padded to 16).
        block_n, block_k, num_warps: the ``[block_k, block_n]`` tile of one program (powers of two,
            at least 16; ``block_k`` 0: the group size up to 128, so a tile reads one scale row).
            ``None``: the fastest on the H200 for the call's rows and bits (:data:`SPARSE_DELTA_DEFAULTS`).
        inner_k: one-row GEMV on codes read as int32 words with the tile inside one group: walk the
            tile in steps of ``inner_k`` inputs (a power of two up to ``block_k``; ``None``: as
            ``block_n``), the sum over inputs kept inside each lane and reduced once per tile; 0:
            the whole tile in one step. Other paths ignore it.
        compact: that same path (one row, int32 words, tile inside one group): first pack each
            row's kept inputs per tile into a list (one small extra launch), then walk only the
            kept ones, ``ceil(kept / inner_k)`` steps per tile instead of ``block_k / inner_k``;
            ``False``: walk every input of the tile and mask the dropped ones.
        pdl: programmatic dependent launch, as :func:`sparse_base_linear` (the compaction launch too).
        segment_lookup: int32 ``[T]``: when given, ``row_delta`` holds each row's *slot id* (``-1``: none),
            ``segments`` (required then) was built from those slot ids (one table shared by every layer
            of a step), and a row's delta is ``segment_lookup[slot + 1]`` (``-1``: not among these deltas),
            read in the kernel (as :func:`~kernels.multi_delta.multi_delta_linear`'s ``segment_lookup``).

    Returns:
        ``out``.
    """
    _check_delta(x, deltas, row_delta, out)
    if segment_lookup is not None:
        if segments is None:
            raise ValueError("segment_lookup needs segments=build_row_segments(row_delta) of the slot ids")
        if segment_lookup.dtype != torch.int32 or segment_lookup.dim() != 1 or segment_lookup.device != x.device:
            raise ValueError(f"segment_lookup must be a 1-D int32 tensor on {x.device}")
    m, k = x.shape
    kind = "few" if m < SPARSE_DELTA_MIXED_ROWS else "mixed_2bit" if deltas.bits == 2 else "mixed"
    d_bn, d_nw, d_ik = SPARSE_DELTA_DEFAULTS[kind]
    block_n = d_bn if block_n is None else block_n
    num_warps = d_nw if num_warps is None else num_warps
    inner_k = d_ik if inner_k is None else inner_k
    gs = deltas.group_size if deltas.group_size > 0 else k
    if block_k == 0:
        block_k = 128
        while block_k > 16 and gs % block_k:
            block_k //= 2
    _check_blocks(block_n, block_k, block_m)
    bki = _inner_k(inner_k, block_k)
    thr, use_thr = _thr(threshold, x.dtype)
    pdl = _pdl(pdl, x)
    if _runs_reference(x):
        if segment_lookup is not None:
            row_delta = segment_lookup[row_delta.long() + 1]
        y = sparse_delta_linear_reference(x, deltas, row_delta, out, threshold)
        return y if out is None else out.copy_(y)
    n = deltas.out_features
    if out is None:
        out = torch.zeros((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0 or deltas.num_deltas == 0:
        return out
    if segments is None:
        segments = build_row_segments(row_delta)
    elif tuple(segments.shape) != (SEGMENT_FIELDS, m) or segments.dtype != torch.int32 or segments.device != x.device:
        raise ValueError(f"segments must be the int32 [{SEGMENT_FIELDS}, {m}] table of build_row_segments(row_delta) "
                         f"on {x.device}, got {segments.dtype} {tuple(segments.shape)} on {segments.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    # segments past the last one exit at once; at most U + 1 segments exist (the base-only rows too), or, on
    # a table of slot ids, one per row
    grid = (_cdiv(n, block_n), _cdiv(k, block_k), m if segment_lookup is not None else min(m, deltas.num_deltas + 1))
    ws, cnt = _workspace(x.device, m, n, grid[0] * grid[2])
    q = deltas.qweight
    rb = q.shape[2]
    block_group = gs % block_k == 0
    # whole int32 words per packed row (every 8B shape): the one-row path reads words
    words = block_m == 1 and rb % 4 == 0 and q.is_contiguous() and q.data_ptr() % 4 == 0 and block_n * deltas.bits >= 32
    use_compact = compact and words and block_group
    idx, xv, kc, _ = _compacted(x, thr, use_thr, block_k, pdl) if use_compact else (cnt, x, cnt, None)
    _kernel("sparse_delta_kernel")[grid](
        x, q, q.view(torch.int32) if words else q, deltas.scales, deltas.zeros, segments.contiguous(), out, ws,
        ws.view(torch.int32), cnt, thr, idx, xv, kc, segment_lookup if segment_lookup is not None else cnt,
        m, n, k, deltas.num_deltas, rb, num_groups(k, deltas.group_size), gs,
        x.stride(0), out.stride(0),
        BITS=deltas.bits, THRESH=use_thr, BLOCK_GROUP=block_group, GEMV=block_m == 1, WORDS=words,
        COMPACT=use_compact, BM=block_m, LOOKUP=segment_lookup is not None,
        BN=block_n, BK=block_k, BKI=bki, MP=max(2, _next_pow2(m)), DOT_PREC=_dot_prec(x), PDL=pdl, num_warps=num_warps,
        **_pdl_launch(pdl),
    )
    return out


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())
