"""Kernel-side layouts of a delta stack, and the per-step row-segment table (plain PyTorch).

Two things the fast path of :func:`kernels.multi_delta.multi_delta_linear` wants prepared ahead
of the launch, each a pure function:

* **Planar code layout** (:func:`repack_for_kernel`, applied once when a delta is written into a
  stack). The file format packs codes in input order (code ``j`` of a row at bits ``j*b`` of the
  row's bit string). The planar layout cuts each row into blocks of ``L = P * B`` inputs
  (``P = 16 // b`` codes per 16-bit element, ``B`` = ``block`` elements per block) and stores, in
  16-bit little-endian element ``i`` of block ``j``, bits ``S*b .. S*b + b - 1`` = the code of
  input ``j*L + S*B + i`` (plane ``S``). A decoded plane then multiplies the *contiguous* slice
  ``x[:, j*L + S*B : j*L + (S+1)*B]``, which the kernel loads straight into the MMA operand: no
  shuffling of activations between planes. Same bytes as the file layout.
* **Dense 2:4** (:func:`densify_2of4`): a 2:4 delta rewritten as dense codes of the same bits
  (pruned entries take their group's zero point, so they dequantize to exactly 0). At 2 bits this
  is the same number of bytes; at 4 bits a third more. It lets 2:4 deltas run on the dense path.
* **Stack writes** (:func:`kernel_stack_format` once per format class, then :func:`pack_for_stack`
  for each delta written into the stack): what the layer code calls; :func:`prepare_stack` does the
  same for a whole file-layout stack at once.
* **Row segments** (:func:`build_row_segments`, once per decode step): rows sorted by delta and
  cut into runs, in one static-shape int32 table, so the kernel does not sort rows in every
  program of every layer. Every op is a fixed-shape device op: safe to capture in a CUDA graph
  and replay with a new mix of deltas.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from hf_deltazip.packing import expand_2of4, num_groups, pack_bits, packed_nbytes, unpack_bits, unpack_codes

__all__ = [
    "PLANAR_BITS",
    "default_planar_block",
    "planar_block_for",
    "repack_for_kernel",
    "unpack_planar_codes",
    "densify_2of4",
    "KernelStackFormat",
    "kernel_stack_format",
    "pack_for_stack",
    "prepare_stack",
    "build_row_segments",
]

#: code widths with a planar layout (3-bit keeps the file layout and the generic kernel)
PLANAR_BITS = (2, 4, 8)
# 16-bit elements per row and planar block (measured on an H200, BENCHMARKS.md section 3: with
# blocks of 64 rather than 32, 4-bit runs up to 25 % faster; 2-bit, with its register cap, 3-18 %
# faster on large layers at 8 or more deltas, up to 16 % slower on 1024x4096 at 8-32 deltas)
_DEFAULT_BLOCK = {2: 64, 4: 64, 8: 64}
_FALLBACK_BLOCK = 32


def default_planar_block(bits: int) -> int:
    """Elements per planar block that the kernel runs fastest with for ``bits``-bit codes."""
    return _DEFAULT_BLOCK.get(bits, _FALLBACK_BLOCK)


def _codes_per_element(bits: int) -> int:
    return 16 // bits


def planar_block_for(bits: int, in_features: int, group_size: int, block: Optional[int] = None) -> int:
    """The planar block a ``bits``-bit dense delta of ``in_features`` inputs with groups of
    ``group_size`` can use: ``block``, or by default :func:`default_planar_block` and failing
    that 32; 0 when none fits (keep the file layout).

    Needs: ``bits`` in 2, 4, 8; ``in_features`` a multiple of ``16 // bits * block`` (whole
    blocks); every plane inside one quantization group (``group_size`` -1 or a multiple of
    ``block``); ``block`` a multiple of 16 (16-deep MMAs)."""
    if block is None:
        for cand in (default_planar_block(bits), _FALLBACK_BLOCK):
            if planar_block_for(bits, in_features, group_size, cand):
                return cand
        return 0
    if bits not in PLANAR_BITS or block <= 0 or block % 16:
        return 0
    if in_features % (_codes_per_element(bits) * block):
        return 0
    if group_size != -1 and group_size % block:
        return 0
    return block


def _planar_perm(bits: int, in_features: int, block: int) -> tuple[int, int]:
    p = _codes_per_element(bits)
    if planar_block_for(bits, in_features, -1, block) != block:
        raise ValueError(
            f"no planar layout for {bits}-bit codes, {in_features} inputs and blocks of {block} elements: "
            f"bits must be one of {PLANAR_BITS} and in_features a multiple of {p * block if bits in PLANAR_BITS else '?'}"
        )
    return p, in_features // (p * block)


_BYTE_CODES: dict = {}


def _byte_tables(bits: int, device: torch.device) -> tuple:
    """``(codes, shifts)`` on ``device``: uint8 ``[256, 8 // bits]``, the codes each byte value holds (code i at
    bits ``i * bits``), and uint8 ``[8 // bits]``, ``1 << (i * bits)``. Made there by device operations and kept
    (no copy from the host, which would wait for the device's running work)."""
    key = (bits, str(device))
    t = _BYTE_CODES.get(key)
    if t is None:
        at = torch.arange(8 // bits, dtype=torch.int32, device=device) * bits
        codes = (torch.arange(256, dtype=torch.int32, device=device)[:, None] >> at) & ((1 << bits) - 1)
        made = None
        if device.type == "cuda":  # made on whichever stream is current (staging: a side stream)
            made = torch.cuda.Event()
            made.record()
        t = _BYTE_CODES[key] = (codes.to(torch.uint8), (torch.ones_like(at) << at).to(torch.uint8), made)
    if t[2] is not None:  # later uses, on any stream, wait for the tables (a stream wait, not a host one)
        torch.cuda.current_stream(device).wait_event(t[2])
    return t[0], t[1]


def repack_for_kernel(qweight: torch.Tensor, bits: int, in_features: int, block: int) -> torch.Tensor:
    """File-layout packed codes ``uint8 [..., packed_nbytes(K, bits)]`` -> planar layout (same shape).

    Works on one delta ``[N, bytes]`` or a whole stack ``[U, N, bytes]``, on any device; take
    ``block`` from :func:`planar_block_for` (0 there: no planar layout for this shape). Off the CPU it computes
    with four tensor operations whatever the bits (each byte's codes from a 256-entry table, then each output byte
    as the sum of its codes shifted into place), where unpacking and packing with shifts and masks takes 17 for
    2-bit codes and 9 for 4-bit: staging a delta ahead repacks every layer between decode steps, one launch per
    operation on a GPU. On the CPU, where no launch is saved and the lookup computes 2.5-7x slower at 8B layer
    shapes (``python -m hf_deltazip.bench.host_overhead --repack``), the shifts stay.

    Raises:
        ValueError: the layout does not exist for these ``bits`` / ``in_features`` / ``block``, or ``qweight`` is
            not packed codes of that width.
    """
    p, nblk = _planar_perm(bits, in_features, block)
    if qweight.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {qweight.dtype}")
    nbytes = in_features * bits // 8
    if qweight.dim() == 0 or qweight.shape[-1] != nbytes:
        raise ValueError(f"{in_features} codes of {bits} bits need {nbytes} bytes per row, got shape "
                         f"{tuple(qweight.shape)}")
    rows = qweight.reshape(-1, nbytes)
    repack = _repack_rows_shifts if qweight.device.type == "cpu" else _repack_table
    return repack(rows, bits, p, nblk, block).reshape(qweight.shape)


_REPACK_CHUNK_BYTES = 64 << 20


def _repack_table(rows: torch.Tensor, bits: int, p: int, nblk: int, block: int) -> torch.Tensor:
    step = max(1, _REPACK_CHUNK_BYTES // rows.shape[-1])  # rows at a time: the lookup's temporaries are 9x the bytes
    if rows.shape[0] <= step:
        return _repack_rows_table(rows, bits, p, nblk, block)
    out = torch.empty_like(rows)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = _repack_rows_table(rows[i:i + step], bits, p, nblk, block)
    return out


def _repack_rows_table(rows: torch.Tensor, bits: int, p: int, nblk: int, block: int) -> torch.Tensor:
    per = 8 // bits  # codes per byte; an element's p planes fill p // per bytes
    table, shifts = _byte_tables(bits, rows.device)
    # [R, K // per, per]: input order (index_select takes int32 indices on every device: a quarter of int64's bytes)
    codes = table.index_select(0, rows.reshape(-1).to(torch.int32)).reshape(rows.shape[0], -1, per)
    # input j*L + S*B + i  ->  position (j, i, S) of the packed order; S splits into (byte, code in the byte)
    planar = codes.reshape(-1, nblk, p, block).transpose(-1, -2).reshape(-1, nblk, block, p // per, per)
    return (planar * shifts).sum(-1, dtype=torch.uint8).reshape(rows.shape)  # bit fields apart: a sum is an or


def _repack_rows_shifts(rows: torch.Tensor, bits: int, p: int, nblk: int, block: int) -> torch.Tensor:
    k = rows.shape[-1] * 8 // bits
    codes = unpack_bits(rows, bits, k)  # [R, K] in input order
    planar = codes.reshape(-1, nblk, p, block).transpose(-1, -2).reshape(-1, k)
    return pack_bits(planar, bits, check=False)  # unpacked codes: in range, and no device sync


def unpack_planar_codes(qweight: torch.Tensor, bits: int, in_features: int, block: int) -> torch.Tensor:
    """Inverse of :func:`repack_for_kernel`, unpacked: uint8 codes ``[..., K]`` in input order."""
    p, nblk = _planar_perm(bits, in_features, block)
    packed_order = unpack_bits(qweight, bits, in_features)
    lead = packed_order.shape[:-1]
    return packed_order.reshape(*lead, nblk, block, p).transpose(-1, -2).reshape(*lead, in_features).contiguous()


def densify_2of4(
    qweight: torch.Tensor,
    positions: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """A 2:4 delta's packed kept codes -> packed dense codes of the same ``bits`` (file layout).

    Pruned entries get their group's zero point, so ``(code - zero) * scale`` is exactly 0 there
    and the scales and zeros of the delta are reused unchanged. Works on ``[N, ...]`` or
    ``[U, N, ...]`` tensors (``qweight``: ``packed_nbytes(K // 2, bits)`` bytes per row,
    ``positions``: ``ceil(K / 8)``, ``zeros``: ``[..., G]``).
    """
    k = in_features
    kq = k // 2
    lead = qweight.shape[:-1]
    kept = unpack_codes(qweight, bits, kq).reshape(-1, kq)
    pos = unpack_bits(positions, 2, kq).reshape(-1, kq)
    dense = expand_2of4(kept, pos, k, fill=0).reshape(*lead, k)
    mask = expand_2of4(torch.ones_like(kept), pos, k, fill=0).bool().reshape(*lead, k)
    g = num_groups(k, group_size)
    col_group = torch.arange(k, device=zeros.device) // (k if group_size == -1 else group_size)
    zero_dense = zeros.to(torch.uint8)[..., col_group.clamp_max(g - 1)]
    codes = torch.where(mask, dense.to(torch.uint8), zero_dense)
    if bits == 3:
        from hf_deltazip.packing import pack_codes

        return pack_codes(codes, 3)
    return pack_bits(codes, bits)


@dataclass(frozen=True)
class KernelStackFormat:
    """How a stack of one format class is laid out for the fast path (see :func:`kernel_stack_format`).

    Attributes:
        layout_block: ``DeltaStack.layout_block`` of the stack (0: file layout, generic kernel).
        densify: 2:4 deltas are stored as dense codes (no ``positions`` tensor in the stack).
        row_bytes: bytes per output row of ``qweight`` in the stack (``qweight.shape[2]``).
        has_positions: the stack keeps a ``positions`` tensor (2:4 not densified).
    """

    layout_block: int
    densify: bool
    row_bytes: int
    has_positions: bool


def kernel_stack_format(bits: int, group_size: int, in_features: int, sparse_2of4: bool,
                        densify: bool = True, block: Optional[int] = None) -> KernelStackFormat:
    """The stack layout to allocate for deltas of one format class (call once per class).

    Dense 2-, 4- and 8-bit deltas (and 2:4 deltas, densified) get the planar layout when
    ``in_features`` allows it; everything else keeps the file layout.
    """
    dense = (not sparse_2of4) or densify
    lb = planar_block_for(bits, in_features, group_size, block) if dense else 0
    kq = in_features if dense else in_features // 2
    return KernelStackFormat(lb, sparse_2of4 and densify, packed_nbytes(kq, bits), not dense)


def pack_for_stack(fmt: KernelStackFormat, qweight: torch.Tensor, positions: Optional[torch.Tensor],
                   zeros: torch.Tensor, bits: int, group_size: int, in_features: int) -> torch.Tensor:
    """One delta's file-layout codes -> the bytes to write into a stack of format ``fmt``.

    ``qweight`` / ``positions`` / ``zeros`` as stored (``[N, ...]``, or ``[U, N, ...]``); returns
    uint8 ``[..., N, fmt.row_bytes]``. Scales, zeros (and positions, when the stack keeps them) are
    written unchanged.
    """
    q = qweight
    if positions is not None and fmt.densify:
        q = densify_2of4(q, positions, zeros, bits, group_size, in_features)
    if fmt.layout_block:
        q = repack_for_kernel(q, bits, in_features, fmt.layout_block)
    if q.shape[-1] != fmt.row_bytes:
        raise ValueError(f"packed rows of {q.shape[-1]} bytes do not fit a stack of {fmt.row_bytes}-byte rows")
    return q.contiguous()


def prepare_stack(stack, block: Optional[int] = None, densify: bool = True):
    """The layout the fast path wants for a whole :class:`~kernels.delta_stack.DeltaStack`.

    2:4 stacks become dense stacks of the same bits (``densify``), then dense stacks of 2, 4 or 8
    bits whose shape allows it get the planar layout (``stack.layout_block``: ``block``, default
    :func:`planar_block_for`'s choice). A stack that already has a kernel layout, or whose shape
    allows none, comes back unchanged.
    """
    if stack.layout_block:
        return stack
    fmt = kernel_stack_format(stack.bits, stack.group_size, stack.in_features, stack.sparse_2of4, densify, block)
    if not fmt.layout_block and not fmt.densify:
        return stack
    q = pack_for_stack(fmt, stack.qweight, stack.positions, stack.zeros, stack.bits, stack.group_size,
                       stack.in_features)
    pos = stack.positions if fmt.has_positions else None
    # a stack of the same type, re-laid out (DeltaStack validates the new layout)
    return dataclasses.replace(stack, qweight=q, positions=pos, layout_block=fmt.layout_block)


# --------------------------------------------------------------------------- row segments
SEGMENT_FIELDS = 4  # perm, sorted delta per slot, segment of each slot, delta of each segment


def build_row_segments(row_delta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Row-segment table of one decode step: int32 ``[4, M]`` on ``row_delta``'s device.

    Rows are stably sorted by delta id (``-1``, the base-only rows, first). Slot ``s`` of the
    sorted order holds row ``perm[s]``. Row 0: ``perm``; row 1: the delta of each slot; row 2:
    the index of the run ("segment") of equal deltas each slot belongs to; row 3: the delta of
    segment ``t`` for ``t`` below the number of segments (``-1`` after). Build it once per step
    for each ``row_delta`` (one per format class: the per-class lookup of the rows) and pass it to
    every layer's :func:`~kernels.multi_delta.multi_delta_linear` as ``segments=``.

    ``out``: an existing ``[4, M]`` int32 buffer to fill in place (static buffers for a CUDA
    graph: capture this call together with the layers and the table follows each new mix).
    """
    if row_delta.dim() != 1:
        raise ValueError(f"row_delta must be 1-D [M], got {tuple(row_delta.shape)}")
    m = row_delta.shape[0]
    dev = row_delta.device
    if out is None:
        out = torch.empty((SEGMENT_FIELDS, m), dtype=torch.int32, device=dev)
    elif tuple(out.shape) != (SEGMENT_FIELDS, m) or out.dtype != torch.int32 or out.device != dev:
        raise ValueError(f"out must be an int32 [{SEGMENT_FIELDS}, {m}] tensor on {dev}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if m == 0:
        return out
    rd = row_delta.to(torch.int32)
    sorted_d, perm = torch.sort(rd, stable=True)
    start = torch.ones_like(sorted_d, dtype=torch.bool)
    start[1:] = sorted_d[1:] != sorted_d[:-1]
    seg = torch.cumsum(start.to(torch.int32), 0, dtype=torch.int32) - 1
    seg_delta = torch.full_like(sorted_d, -1).scatter_(0, seg.long(), sorted_d)  # equal values per index
    out[0].copy_(perm)
    out[1].copy_(sorted_d)
    out[2].copy_(seg)
    out[3].copy_(seg_delta)
    return out


def segments_reference(row_delta: torch.Tensor) -> list[tuple[int, list[int]]]:
    """The runs of :func:`build_row_segments` in plain Python: ``[(delta, rows), ...]`` (tests)."""
    order = sorted(range(row_delta.shape[0]), key=lambda r: (int(row_delta[r]), r))
    runs: list[tuple[int, list[int]]] = []
    for r in order:
        d = int(row_delta[r])
        if runs and runs[-1][0] == d:
            runs[-1][1].append(r)
        else:
            runs.append((d, [r]))
    return runs
