"""Triton kernels of :mod:`kernels.act_sparse` (imported lazily: needs triton).

Both kernels read weights in the *input-major* layout, one contiguous row of outputs per input
``k``: the base weight as ``W^T [K, N]`` and a delta as its codes ``[K, ceil(N*b/8)]`` packed along
the outputs with group scales and zero points ``[G, N]``. An input whose activation is zero for
every row a program handles then costs no weight bytes at all: the program loads the rows' inputs
of a k-block first, and the weight tile's load is masked by "some row keeps this input", so masked
lines are never requested from memory (a row-major ``[N, K]`` weight would need one 32-byte sector
per kept element instead). The k-loops have no branches, so Triton can pipeline their loads; a
k-block whose inputs are all dropped still runs its (tiny, decode-sized) MMA on zeros.

``sparse_base_kernel``: program ``(n-tile, row-block, k-split)``; rows ``[r*BM, r*BM + BM)`` of ``x``.
``sparse_delta_kernel``: program ``(n-tile, segment, k-split)``; the rows of one segment of the
step's row-segment table (:func:`kernels.layout.build_row_segments`: rows sorted by delta), added
into ``out`` (each output row belongs to exactly one segment, so no two programs write one element).
With ``SPLIT`` > 1 each k-split writes its own slice of an fp32 workspace (``stride_os`` apart) and
the launcher sums the slices: at batch 1 a layer has too few n-tiles to fill the GPU otherwise.
K_CHUNK is a multiple of BK.

``THRESH``: inputs with ``|x| <= thr`` count as zero (the thresholding fused into the kernel);
without it only exact zeros are skipped.
"""

import triton
import triton.language as tl


# Only core builtins and this module's own jit functions are used (no tl.max from triton's standard
# library): the launcher can then reload this module to switch between compiled and interpreted mode.
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _any(flags, axis: tl.constexpr):
    # any(flags) along ``axis`` of an int1 tensor, as int1
    return tl.reduce(flags.to(tl.int32), axis, _maximum) > 0


@triton.jit
def _kept_inputs(x_ptrs, row_ok, cols, K, thr, THRESH: tl.constexpr):
    # x tile [BM, BK] with dropped inputs zeroed, and whether any row keeps each input [BK]
    xt = tl.load(x_ptrs + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    if THRESH:
        keep = tl.abs(xt.to(tl.float32)) > thr
        xt = tl.where(keep, xt, 0.0)
    else:
        keep = xt != 0.0
    col_keep = _any(keep, 0)
    return xt, col_keep


@triton.jit
def _store_rows(out_ptr, rows, row_ok, stride_om, offs_n, nmask, acc, ACCUMULATE: tl.constexpr):
    # acc [BM, BN] into rows ``rows`` of out (added to what is there with ACCUMULATE)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    omask = row_ok[:, None] & nmask[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=omask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["M"])
def sparse_base_kernel(
    x_ptr, wt_ptr, bias_ptr, out_ptr, thr,
    M, N, K, K_CHUNK, stride_xm, stride_wk, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, THRESH: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_ok = rows < M
    k_begin = tl.program_id(2) * K_CHUNK  # this program's share of K (split-K: partial sums per split)
    k_end = tl.minimum(k_begin + K_CHUNK, K)
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(k_begin, k_end, BK):
        cols = k0 + tl.arange(0, BK)
        xt, col_keep = _kept_inputs(x_ptr + rows.to(tl.int64)[:, None] * stride_xm, row_ok, cols, k_end, thr, THRESH)
        # only the weight rows of inputs some row keeps are read (masked lines are never requested)
        wt = tl.load(wt_ptr + cols.to(tl.int64)[:, None] * stride_wk + offs_n[None, :],
                     mask=col_keep[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    _store_rows(out_ptr, rows, row_ok, stride_om, offs_n, nmask, acc, False)


@triton.jit(do_not_specialize=["M", "U"])
def sparse_delta_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, seg_ptr, out_ptr, thr,
    M, N, K, K_CHUNK, U, RB, G, GS, stride_xm, stride_om, stride_os,
    BITS: tl.constexpr, THRESH: tl.constexpr, BLOCK_GROUP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    P: tl.constexpr = 8 // BITS  # codes per byte (along the outputs)
    CMASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    t = tl.program_id(1)  # the segment this program serves
    u = tl.load(seg_ptr + 3 * M + t)
    if (u >= 0) & (u < U):
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        byte_col = offs_n // P
        shift = (offs_n % P) * BITS
        offs_k = tl.arange(0, BK)
        u64 = u.to(tl.int64)
        k_begin = tl.program_id(2) * K_CHUNK
        k_end = tl.minimum(k_begin + K_CHUNK, K)
        out_ptr += tl.program_id(2).to(tl.int64) * stride_os
        q_base = q_ptr + u64 * K * RB
        s_base = s_ptr + u64 * G * N
        z_base = z_ptr + u64 * G * N
        for r0 in range(0, M, BM):  # the segment's slots are contiguous: usually one chunk holds them all
            slots = r0 + tl.arange(0, BM)
            in_m = slots < M
            sel = in_m & (tl.load(seg_ptr + 2 * M + slots, mask=in_m, other=-1) == t)
            if _any(sel, 0):
                rows = tl.load(seg_ptr + slots, mask=sel, other=0)
                x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
                acc = tl.full([BM, BN], 0.0, tl.float32)
                for k0 in range(k_begin, k_end, BK):
                    cols = k0 + offs_k
                    xt, col_keep = _kept_inputs(x_rows, sel, cols, k_end, thr, THRESH)
                    wmask = col_keep[:, None] & nmask[None, :]
                    qb = tl.load(q_base + cols.to(tl.int64)[:, None] * RB + byte_col[None, :], mask=wmask, other=0)
                    code = ((qb.to(tl.int32) >> shift[None, :]) & CMASK).to(tl.float32)
                    if BLOCK_GROUP:  # the whole k-block inside one quantization group: one scale row
                        g = k0 // GS
                        kept_any = tl.reduce(col_keep.to(tl.int32), 0, _maximum)
                        gmask = nmask & ((offs_n * 0 + kept_any) > 0)  # a block no row keeps reads nothing
                        zf = tl.load(z_base + g * N + offs_n, mask=gmask, other=0).to(tl.float32)
                        sc = tl.load(s_base + g * N + offs_n, mask=gmask, other=0.0).to(tl.float32)
                        w = (code - zf[None, :]) * sc[None, :]
                    else:
                        gi = (cols // GS).to(tl.int64)[:, None] * N + offs_n[None, :]
                        zf = tl.load(z_base + gi, mask=wmask, other=0).to(tl.float32)
                        sc = tl.load(s_base + gi, mask=wmask, other=0.0).to(tl.float32)
                        w = (code - zf) * sc
                    acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=DOT_PREC)
                _store_rows(out_ptr, rows, sel, stride_om, offs_n, nmask, acc, True)
