"""Bit, sparsity and quantization-grid primitives, each with its layout spelled out.

These are the plain-PyTorch references that the ``.dz`` format stores and that the Triton
kernels read. ``docs/format.md`` (section "Packed layouts") is the normative description;
the functions here implement it.

Layouts, for a delta matrix of shape ``[N, K]`` (output features x input features):

* **b-bit codes, b in {1, 2, 4, 8}** are packed along the last dimension, little-endian inside
  each byte: code ``i`` of a row lives in byte ``i // (8 // b)`` at bit ``(i % (8 // b)) * b``.
  A row is padded with zero codes to a whole byte. Read as little-endian 32-bit words, the same
  bytes hold 32 // b consecutive codes per word, which is what GPU kernels load.
* **3-bit codes** are two bit planes in one row: the low 2 bits packed as 2-bit codes
  (``ceil(n / 4)`` bytes), followed by the high bit packed as 1-bit codes (``ceil(n / 8)``
  bytes). Planes keep every code byte-aligned (no code straddles a byte) and give zstd
  repeated patterns to find.
* **2:4 sparsity**: in each group of 4 consecutive inputs, 2 values are kept. A row stores its
  ``K / 2`` kept codes (packed as above) and, separately, each kept value's position inside its
  group of 4 as a 2-bit code (``K / 2`` positions, packed as 2-bit codes: 1 bit per weight).
  Kept slot ``j`` belongs to input column ``4 * (j // 2) + position[j]``; positions within a
  group are strictly increasing.
* **Unstructured sparsity**: a bitmask packed as 1-bit codes (bit set = kept), plus the kept
  codes of the row in order. Rows have different counts, so kept codes are stored as one flat
  array; kernels get the dense form (pruned weights set to the zero point), see
  :func:`unpack_bitmask_codes`.
* **Grid**: ``w = (code - zero) * scale`` with ``scale`` and ``zero`` per output row and per
  group of ``group_size`` consecutive inputs (``group_size = -1``: one group per row). Zeros
  are integers in ``[0, 2**b - 1]``, stored as uint8; scales as float16 when every scale fits
  float16's normal range, else float32 (fine-tune deltas can be small enough to underflow
  float16). A value of exactly zero is always representable, so pruned weights decode to 0.
"""

from __future__ import annotations

import math

import torch

PACKABLE_BITS = (1, 2, 4, 8)
CODE_BITS = (2, 3, 4, 8)
_FP16_MIN_NORMAL = 6.103515625e-05
_FP16_MAX = 65504.0


# --------------------------------------------------------------------------- bit packing
def packed_nbytes(n: int, bits: int) -> int:
    """Bytes one row of ``n`` codes of ``bits`` bits takes (3-bit: both planes)."""
    if bits == 3:
        return math.ceil(n / 4) + math.ceil(n / 8)
    _check_packable(bits)
    return math.ceil(n * bits / 8)


def _check_packable(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS} for bit packing, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last dimension into uint8.

    Args:
        codes: integer tensor ``[..., n]`` with values in ``[0, 2**bits)``.
        bits: 1, 2, 4 or 8.
        check: refuse codes out of range (reads them back: a device synchronisation on a GPU). ``False``
            for codes in range by construction (from :func:`unpack_bits`); others would be corrupted.

    Returns:
        uint8 tensor ``[..., ceil(n * bits / 8)]``.
    """
    _check_packable(bits)
    n = codes.shape[-1]
    per_byte = 8 // bits
    if check and codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    c = codes.to(torch.uint8)  # in range, checked above: every shifted code below fits its byte
    pad = (-n) % per_byte
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, per_byte)
    out = c[..., 0].clone()
    for i in range(1, per_byte):
        out |= c[..., i] << (i * bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., nbytes]`` -> uint8 codes ``[..., n]``."""
    _check_packable(bits)
    per_byte = 8 // bits
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != math.ceil(n * bits / 8):
        raise ValueError(f"{n} codes of {bits} bits need {math.ceil(n * bits / 8)} bytes, got {packed.shape[-1]}")
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (i * bits)) & mask for i in range(per_byte)], dim=-1)  # uint8 throughout
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].contiguous()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack b-bit quantization codes (b in 2, 3, 4, 8) along the last dimension.

    3-bit codes become a low 2-bit plane followed by a high 1-bit plane in each row.
    """
    if bits == 3:
        if codes.numel() and int(codes.max()) >= 8:
            raise ValueError("codes out of range for 3-bit packing")
        c = codes.to(torch.int32)
        return torch.cat([pack_bits(c & 3, 2), pack_bits(c >> 2, 1)], dim=-1)
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits}")
    return pack_bits(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    if bits == 3:
        lo_bytes = math.ceil(n / 4)
        if packed.shape[-1] != lo_bytes + math.ceil(n / 8):
            raise ValueError(f"{n} 3-bit codes need {packed_nbytes(n, 3)} bytes, got {packed.shape[-1]}")
        lo = unpack_bits(packed[..., :lo_bytes].contiguous(), 2, n)
        hi = unpack_bits(packed[..., lo_bytes:].contiguous(), 1, n)
        return lo | (hi << 2)
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits}")
    return unpack_bits(packed, bits, n)


# --------------------------------------------------------------------------- 2:4 sparsity
def check_2of4_mask(mask: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``mask`` keeps exactly 2 of every 4 consecutive inputs."""
    if mask.shape[-1] % 4:
        raise ValueError(f"2:4 sparsity needs the input dimension to be a multiple of 4, got {mask.shape[-1]}")
    per_group = mask.reshape(*mask.shape[:-1], -1, 4).sum(-1)
    if not bool((per_group == 2).all()):
        raise ValueError("not a 2:4 mask: every group of 4 inputs must keep exactly 2")


def compress_2of4(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the 2-of-4 entries of ``values`` selected by ``mask``.

    Args:
        values: ``[N, K]`` tensor, ``K`` a multiple of 4.
        mask: bool ``[N, K]`` with exactly 2 True in every group of 4 inputs.

    Returns:
        ``(kept [N, K // 2], positions uint8 [N, K // 2])``; ``positions`` in ``0..3``, increasing
        inside each group.
    """
    check_2of4_mask(mask)
    n, k = values.shape
    pos = torch.arange(4, device=mask.device).expand(n, k // 4, 4)
    m = mask.reshape(n, k // 4, 4)
    # stable sort puts the kept positions first, in increasing order
    order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices[..., :2]
    positions = torch.gather(pos, -1, order).reshape(n, k // 2)
    cols = (torch.arange(k // 2, device=mask.device) // 2 * 4).expand(n, -1) + positions
    kept = torch.gather(values, 1, cols)
    return kept, positions.to(torch.uint8)


def expand_2of4(kept: torch.Tensor, positions: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """Inverse of :func:`compress_2of4`: scatter kept values back into a dense ``[N, K]`` row."""
    n = kept.shape[0]
    if kept.shape != (n, k // 2) or positions.shape != (n, k // 2) or k % 4:
        raise ValueError(f"2:4 shapes do not fit: kept {tuple(kept.shape)}, positions {tuple(positions.shape)}, K={k}")
    cols = (torch.arange(k // 2, device=kept.device) // 2 * 4).expand(n, -1) + positions.to(torch.int64)
    out = torch.full((n, k), fill, dtype=kept.dtype, device=kept.device)
    return out.scatter(1, cols, kept)


# --------------------------------------------------------------------------- unstructured
def pack_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., K]`` -> uint8 ``[..., ceil(K / 8)]``, bit ``k % 8`` of byte ``k // 8``."""
    return pack_bits(mask.to(torch.uint8), 1)


def unpack_bitmask(packed: torch.Tensor, k: int) -> torch.Tensor:
    return unpack_bits(packed, 1, k).bool()


def pack_bitmask_codes(codes: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unstructured sparsity: ``(bitmask [N, ceil(K/8)], kept codes flat [nnz])`` in row-major order."""
    if codes.shape != mask.shape:
        raise ValueError(f"codes {tuple(codes.shape)} and mask {tuple(mask.shape)} differ in shape")
    return pack_bitmask(mask), codes[mask]


def unpack_bitmask_codes(bitmask: torch.Tensor, kept: torch.Tensor, k: int, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dense codes ``[N, K]`` from a bitmask and kept codes; pruned entries get their group's zero point."""
    mask = unpack_bitmask(bitmask, k)
    if int(mask.sum()) != kept.numel():
        raise ValueError(f"bitmask keeps {int(mask.sum())} weights but {kept.numel()} codes are stored")
    dense = expand_groups(zeros, k, group_size).to(torch.uint8).clone()
    dense[mask] = kept.to(torch.uint8)
    return dense


# --------------------------------------------------------------------------- grid
def num_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else math.ceil(k / group_size)


def lowrank_group_size(k: int, group_size: int) -> int:
    """The grid a lowrank module's product is served on: ``group_size`` when it divides ``K``, else one per row."""
    return group_size if group_size == -1 or k % group_size == 0 else -1


def _by_group(t: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``[N, K]`` -> ``[N, G, g]`` (zero-padded to whole groups) and K: the per-group values then broadcast
    as ``[N, G, 1]`` instead of being expanded to ``[N, K]`` (the same arithmetic, element for element)."""
    n, k = t.shape
    g = k if group_size == -1 else group_size
    ng = num_groups(k, group_size)
    pad = ng * g - k
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(n, ng, g), k


def _ungroup(t: torch.Tensor, k: int) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)[:, :k].contiguous()


def expand_groups(per_group: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """``[N, G]`` -> ``[N, K]``: each column takes its group's value (the last group may be short)."""
    if group_size == -1:
        return per_group[:, :1].expand(-1, k)
    return per_group.repeat_interleave(group_size, dim=1)[:, :k]


def choose_scale_dtype(scales: torch.Tensor) -> torch.dtype:
    """float16 when every nonzero scale is a normal float16 number, else float32."""
    s = scales.abs()
    s = s[s > 0]
    if s.numel() == 0 or (float(s.min()) >= _FP16_MIN_NORMAL and float(s.max()) <= _FP16_MAX):
        return torch.float16
    return torch.float32


def compute_qparams(
    w: torch.Tensor, bits: int, group_size: int = -1, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points of the min-max grid that covers each group of ``w``.

    Args:
        w: ``[N, K]`` float tensor (a column block of it is fine with ``group_size=-1``).
        bits: 2, 3, 4 or 8.
        group_size: inputs per group, or -1 for one group per row.
        symmetric: zero point fixed at ``2**(bits-1)`` and range symmetric around 0.

    Returns:
        ``(scales [N, G], zeros [N, G])``; scales already rounded to their storage dtype
        (returned as float32), zeros as uint8 in ``[0, 2**bits - 1]``.
    """
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits}")
    maxq = (1 << bits) - 1
    wg, _ = _by_group(w.float(), group_size)  # zero padding never widens a grid that contains 0
    scale, zero = minmax_grid(wg.amin(-1), wg.amax(-1), maxq, symmetric)
    scale = scale.to(choose_scale_dtype(scale)).float()
    return scale, zero.to(torch.uint8)


def minmax_grid(xmin: torch.Tensor, xmax: torch.Tensor, maxq, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (both float, scale not yet rounded to a storage dtype) of the grid of
    ``maxq + 1`` codes covering ``[min(xmin, 0), max(xmax, 0)]`` (:func:`compute_qparams`' arithmetic).
    ``maxq`` is ``2**bits - 1``: an int, or a float tensor broadcasting against ``xmin`` (bits per row)."""
    xmin = xmin.clamp(max=0)
    xmax = xmax.clamp(min=0)
    if symmetric:
        xmax = torch.maximum(-xmin, xmax)
        # GPTQ's convention: 2**b codes spread over [-xmax, xmax], zero point at 2**(b-1)
        scale = 2 * xmax / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.zeros_like(scale) + (maxq + 1) // 2
    else:
        scale = (xmax - xmin) / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.minimum(torch.round(-xmin / scale).clamp(min=0), torch.as_tensor(maxq, dtype=scale.dtype,
                                                                                    device=scale.device))
    return scale, zero


def quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int = -1) -> torch.Tensor:
    """Round ``w [N, K]`` to the nearest code of its group's grid: uint8 codes ``[N, K]``."""
    wg, k = _by_group(w.float(), group_size)
    ng = wg.shape[1]
    s = scales.float()[:, :ng, None]
    z = zeros.float()[:, :ng, None]
    q = wg / s  # then in place: the same rounding and clamping, without three more [N, K] float temporaries
    q.round_().add_(z).clamp_(0, (1 << bits) - 1)
    return _ungroup(q.to(torch.uint8), k)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = -1, dtype=torch.float32) -> torch.Tensor:
    """``(code - zero) * scale`` for codes ``[N, K]``, computed in float32, returned in ``dtype``."""
    cg, k = _by_group(codes, group_size)
    ng = cg.shape[1]
    s = scales.float()[:, :ng, None]
    z = zeros.float()[:, :ng, None]
    out = cg.float()
    out = out.sub_(z).mul_(s) if out is not cg else (out - z).mul_(s)  # a float32 input is not written to
    return _ungroup(out.to(dtype), k)
