"""A device-side stack of compressed deltas for one linear layer, and its plain-PyTorch meaning.

A :class:`DeltaStack` holds ``U`` deltas of one *format class* (same bits, group size and
sparse layout) for one ``[N, K]`` linear layer, stacked along a leading delta axis so that one
kernel launch can serve every delta of a batch:

=============  ==========================================  =====================================
field          shape                                       dtype
=============  ==========================================  =====================================
``qweight``    ``[U, N, packed_nbytes(Kq, bits)]``          uint8 (``Kq = K``, or ``K // 2`` for 2:4)
``scales``     ``[U, N, G]``  (``G = num_groups(K, gs)``)   float16 or float32
``zeros``      ``[U, N, G]``                                uint8
``positions``  ``[U, N, ceil(K / 8)]`` (2:4 only)           uint8 (2-bit positions, packed)
=============  ==========================================  =====================================

The packed layouts are those of :mod:`hf_deltazip.packing`. For 2:4 deltas the quantization
groups are counted over the ``K`` dense inputs (a kept value at input column ``c`` uses group
``c // group_size``), exactly as for dense deltas. Unstructured-sparse deltas are stored densely
here (pruned codes = their group's zero point), so they need no separate class.

Everything in this module is plain PyTorch (no Triton): it defines what the kernels compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hf_deltazip.packing import (
    CODE_BITS,
    dequantize,
    expand_2of4,
    num_groups,
    packed_nbytes,
    unpack_bits,
    unpack_codes,
)

__all__ = ["DeltaStack", "build_delta_stack", "random_delta_stack", "dequantize_delta"]


@dataclass
class DeltaStack:
    """``U`` packed deltas of one format class for one linear layer (see the module docstring).

    Attributes:
        qweight: uint8 ``[U, N, packed_nbytes(Kq, bits)]`` packed codes.
        scales: float16 / float32 ``[U, N, G]`` grid scales.
        zeros: uint8 ``[U, N, G]`` grid zero points.
        positions: uint8 ``[U, N, ceil(K / 8)]`` packed 2-bit positions of the kept values of
            a 2:4 delta, or ``None`` for a dense delta.
        bits: code width: 2, 3, 4 or 8.
        group_size: inputs per quantization group, or -1 for one group per output row.
        in_features: ``K``, the layer's input width (dense).
        layout_block: 0 when ``qweight`` holds the file layout of :mod:`hf_deltazip.packing`;
            ``B > 0`` when it holds the planar kernel layout with blocks of ``B`` 16-bit elements
            (:func:`kernels.layout.repack_for_kernel`; dense 2-, 4- and 8-bit only). Same bytes.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    positions: Optional[torch.Tensor]
    bits: int
    group_size: int
    in_features: int
    layout_block: int = 0

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def sparse_2of4(self) -> bool:
        return self.positions is not None

    @property
    def num_deltas(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def kept_features(self) -> int:
        """``Kq``: codes stored per row (``K``, or ``K // 2`` for 2:4)."""
        return self.in_features // 2 if self.sparse_2of4 else self.in_features

    @property
    def num_groups(self) -> int:
        return num_groups(self.in_features, self.group_size)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes the stack occupies on its device (what one pass over it reads)."""
        n = self.qweight.numel() + self.scales.numel() * self.scales.element_size() + self.zeros.numel()
        if self.positions is not None:
            n += self.positions.numel()
        return n

    # ------------------------------------------------------------------ checks and moves
    def validate(self) -> None:
        """Raise ``ValueError`` unless every tensor has the shape, dtype and device it must have."""
        if self.bits not in CODE_BITS:
            raise ValueError(f"DeltaStack.bits must be one of {CODE_BITS}, got {self.bits}")
        if not (self.group_size == -1 or (self.group_size >= 32 and self.group_size & (self.group_size - 1) == 0)):
            raise ValueError(f"DeltaStack.group_size must be -1 or a power of two >= 32, got {self.group_size}")
        k = self.in_features
        if k <= 0:
            raise ValueError(f"DeltaStack.in_features must be positive, got {k}")
        if self.sparse_2of4 and k % 4:
            raise ValueError(f"a 2:4 delta needs in_features to be a multiple of 4, got {k}")
        if self.qweight.dim() != 3 or self.qweight.dtype != torch.uint8:
            raise ValueError(
                f"qweight must be uint8 [U, N, bytes], got {self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        u, n, nb = self.qweight.shape
        want_nb = packed_nbytes(self.kept_features, self.bits)
        if nb != want_nb:
            raise ValueError(
                f"qweight rows hold {nb} bytes but {self.kept_features} codes of {self.bits} bits need {want_nb}: "
                "pack them with hf_deltazip.packing.pack_codes"
            )
        g = self.num_groups
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != (u, n, g):
                raise ValueError(f"{name} must have shape {(u, n, g)} (U, N, groups), got {tuple(t.shape)}")
        if self.scales.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales must be float16 or float32, got {self.scales.dtype}")
        if self.zeros.dtype != torch.uint8:
            raise ValueError(f"zeros must be uint8, got {self.zeros.dtype}")
        if self.positions is not None:
            want = (u, n, math.ceil(k / 8))
            if tuple(self.positions.shape) != want or self.positions.dtype != torch.uint8:
                raise ValueError(
                    f"positions must be uint8 {want} (2-bit packed, K/2 per row), got "
                    f"{self.positions.dtype} {tuple(self.positions.shape)}"
                )
        if self.layout_block:
            from .layout import planar_block_for

            lb = self.layout_block
            if self.sparse_2of4 or planar_block_for(self.bits, k, self.group_size, lb) != lb:
                raise ValueError(
                    f"layout_block={lb} needs a dense 2-, 4- or 8-bit delta whose in_features is a multiple of "
                    f"16 // bits * {lb} and whose group_size is -1 or a multiple of {lb}; got bits={self.bits}, "
                    f"in_features={k}, group_size={self.group_size}, 2:4={self.sparse_2of4}"
                )
        named = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros, "positions": self.positions}
        devices = {t.device for t in named.values() if t is not None}
        if len(devices) != 1:
            raise ValueError(f"all DeltaStack tensors must be on one device, got {sorted(map(str, devices))}")
        for name, t in named.items():
            if t is not None and not t.is_contiguous():
                raise ValueError(f"DeltaStack.{name} must be contiguous: call .contiguous() on it")

    def to(self, device) -> "DeltaStack":
        """A copy of the stack on ``device``."""
        return DeltaStack(
            self.qweight.to(device),
            self.scales.to(device),
            self.zeros.to(device),
            None if self.positions is None else self.positions.to(device),
            self.bits,
            self.group_size,
            self.in_features,
            self.layout_block,
        )

    def select(self, start: int, stop: int) -> "DeltaStack":
        """The deltas ``start:stop`` as a stack of their own (views, no copy)."""
        return DeltaStack(
            self.qweight[start:stop],
            self.scales[start:stop],
            self.zeros[start:stop],
            None if self.positions is None else self.positions[start:stop],
            self.bits,
            self.group_size,
            self.in_features,
            self.layout_block,
        )

    # ------------------------------------------------------------------ meaning
    def codes(self, i: int) -> torch.Tensor:
        """Dense uint8 codes ``[N, K]`` of delta ``i``; pruned 2:4 entries take their group's zero point."""
        kq = self.kept_features
        codes = _unpack(self, i)
        if not self.sparse_2of4:
            return codes
        pos = unpack_bits(self.positions[i], 2, kq)
        n, k = self.out_features, self.in_features
        zero_cols = torch.arange(k, device=codes.device) // (k if self.group_size == -1 else self.group_size)
        dense = self.zeros[i].to(torch.uint8)[:, zero_cols].clone()
        cols = (torch.arange(kq, device=codes.device) // 2 * 4).expand(n, -1) + pos.to(torch.int64)
        return dense.scatter(1, cols, codes)

    def dequantize(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Delta ``i`` as a dense ``[N, K]`` matrix: ``(code - zero) * scale``, pruned entries 0."""
        return dequantize_delta(self, i, dtype)


def _unpack(stack: DeltaStack, i: int) -> torch.Tensor:
    """Codes of delta ``i`` in input order, whatever the stack's layout."""
    if stack.layout_block:
        from .layout import unpack_planar_codes

        return unpack_planar_codes(stack.qweight[i], stack.bits, stack.in_features, stack.layout_block)
    return unpack_codes(stack.qweight[i], stack.bits, stack.kept_features)


def dequantize_delta(stack: DeltaStack, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[N, K]`` delta ``i`` of ``stack``, computed in float32 with :mod:`hf_deltazip.packing`."""
    kq = stack.kept_features
    codes = _unpack(stack, i)
    if stack.sparse_2of4:
        pos = unpack_bits(stack.positions[i], 2, kq)
        k = stack.in_features
        kept = torch.ones_like(codes, dtype=torch.float32)
        mask = expand_2of4(kept, pos, k, fill=0.0)
        codes = expand_2of4(codes, pos, k, fill=0)
        w = dequantize(codes, stack.scales[i], stack.zeros[i], stack.group_size) * mask
    else:
        w = dequantize(codes, stack.scales[i], stack.zeros[i], stack.group_size)
    return w.to(dtype)


def build_delta_stack(
    qweights: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    zeros: Sequence[torch.Tensor],
    positions: Optional[Sequence[torch.Tensor]] = None,
    *,
    bits: int,
    group_size: int,
    in_features: int,
    device=None,
) -> DeltaStack:
    """Stack per-delta packed tensors of one format class into a :class:`DeltaStack`.

    Args:
        qweights: per delta, uint8 ``[N, packed_nbytes(Kq, bits)]`` (from ``pack_codes``).
        scales: per delta, ``[N, G]`` float16 or float32 (mixed dtypes are widened to float32).
        zeros: per delta, uint8 ``[N, G]``.
        positions: per delta, uint8 ``[N, ceil(K / 8)]`` (2-bit packed 2:4 positions), or ``None``.
        bits, group_size, in_features: the format class, shared by every delta.
        device: where the stack goes (default: where the first ``qweight`` is).

    Returns:
        The stacked, contiguous, validated :class:`DeltaStack`.

    Raises:
        ValueError: the lists differ in length, or a tensor's shape or dtype is wrong.

    Example:
        >>> stack = build_delta_stack([q0, q1], [s0, s1], [z0, z1], bits=4, group_size=128, in_features=4096)
    """
    u = len(qweights)
    if len(scales) != u or len(zeros) != u or (positions is not None and len(positions) != u):
        raise ValueError(
            f"got {u} qweights, {len(scales)} scales, {len(zeros)} zeros"
            + ("" if positions is None else f", {len(positions)} positions")
            + ": give one of each per delta"
        )
    if u == 0:
        raise ValueError("build_delta_stack needs at least one delta")
    device = torch.device(device) if device is not None else qweights[0].device
    sdtype = torch.float32 if any(s.dtype == torch.float32 for s in scales) else torch.float16
    for i, s in enumerate(scales):
        if s.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales[{i}] must be float16 or float32, got {s.dtype}")
    shapes = {tuple(q.shape) for q in qweights}
    if len(shapes) != 1:
        raise ValueError(f"every qweight of a stack must have one shape, got {sorted(shapes)}")
    return DeltaStack(
        torch.stack([q.to(device) for q in qweights]).contiguous(),
        torch.stack([s.to(device, sdtype) for s in scales]).contiguous(),
        torch.stack([z.to(device) for z in zeros]).contiguous(),
        None if positions is None else torch.stack([p.to(device) for p in positions]).contiguous(),
        bits,
        group_size,
        in_features,
    )


# the six ways to keep 2 of 4, as (first, second) positions
_PAIRS_2OF4 = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]], dtype=torch.int32)


def random_delta_stack(
    num_deltas: int,
    out_features: int,
    in_features: int,
    *,
    bits: int,
    group_size: int = 128,
    sparse_2of4: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    scale_range: tuple[float, float] = (1e-3, 4e-3),
    device="cpu",
    generator: Optional[torch.Generator] = None,
) -> DeltaStack:
    """A stack of random deltas (random packed bytes, positions, scales and zero points).

    For tests and benchmarks: every byte of ``qweight`` is random, which is a valid packing of
    random codes for every bit width (padding codes past ``Kq`` are random too, so kernels must
    mask them). Built directly on ``device`` without a host round trip.
    """
    dev = torch.device(device)
    n, k = out_features, in_features
    if sparse_2of4 and k % 4:
        raise ValueError(f"a 2:4 delta needs in_features to be a multiple of 4, got {k}")
    kq = k // 2 if sparse_2of4 else k
    gen_dev = generator.device if generator is not None else dev

    def _randint(high, shape):
        return torch.randint(0, high, shape, generator=generator, device=gen_dev, dtype=torch.int32).to(dev)

    qweight = _randint(256, (num_deltas, n, packed_nbytes(kq, bits))).to(torch.uint8)
    g = num_groups(k, group_size)
    lo, hi = scale_range
    u01 = torch.rand((num_deltas, n, g), generator=generator, device=gen_dev).to(dev)
    scales = (lo + (hi - lo) * u01).to(scale_dtype)
    zeros = _randint(1 << bits, (num_deltas, n, g)).to(torch.uint8)
    positions = None
    if sparse_2of4:
        pair = _PAIRS_2OF4.to(dev)[_randint(6, (num_deltas, n, k // 4)).long()]  # [U, N, K/4, 2]
        pos = pair.reshape(num_deltas, n, kq)
        pad = (-kq) % 4
        if pad:
            pos = torch.nn.functional.pad(pos, (0, pad))
        pos = pos.reshape(num_deltas, n, -1, 4)
        shifts = torch.arange(4, dtype=torch.int32, device=dev) * 2
        positions = (pos << shifts).sum(-1).to(torch.uint8)
    return DeltaStack(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), positions, bits, group_size, k)
