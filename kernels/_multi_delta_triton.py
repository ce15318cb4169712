"""Triton kernel of :func:`kernels.multi_delta.multi_delta_linear` (imported lazily: needs triton).

One launch computes, for every row ``m`` of ``x``::

    y[m] = x[m] @ W_base^T + bias + x[m] @ dequant(delta[row_delta[m]])^T

Program ``(n-tile, row-block, k-split)``:

1. *Sort on the device.* The program ranks the rows by delta id (``-1`` first, stable), either
   in registers (``FUSED_SORT``, ``M <= 64``: an ``M x M`` comparison) or from a permutation the
   launcher made with ``torch.argsort``. Row block ``r`` is sorted slots ``[r*BM, r*BM + BM)``,
   so each block holds a few contiguous segments of rows that share a delta.
2. *Base pass.* ``acc += x[block rows] @ W[n-tile]^T`` over this split's K range: the base tile
   is read once per row block (once in all when ``M <= BM``).
3. *Delta passes.* One flat loop over (segment, k-step), so that the software pipeline does not
   drain between deltas: each step loads the packed codes of the segment's delta for the
   n-tile, turns them into centred integer codes ``code - zero`` in the activation dtype
   (exact), and multiplies them with the segment's rows only (others masked to zero). The
   group scale multiplies the fp32 partial product per k-step (``PER_ELEM``: per element, for
   groups smaller than a k-step).
4. *Epilogue.* ``SPLIT == 1``: add bias and store the rows where they came from. ``SPLIT > 1``:
   store the fp32 partial, count arrivals on a per-tile semaphore, and the last program of the
   tile sums the partials in split order (deterministic), adds bias, stores, and resets the
   semaphore (so the next launch, and a replayed CUDA graph, find it at zero).

The grid is ``cdiv(N, BN) * cdiv(M, BM) * SPLIT``: it depends on the shapes only, never on
which deltas the rows ask for, so a captured CUDA graph stays right when the mix changes.

Codes are read plane by plane: a packed element (a byte, or with ``EW == 16`` a little-endian
pair of bytes) holds ``P = EW // b`` codes, and plane ``S`` of a k-step is code ``S`` of each
element, i.e. inputs ``k0 + P*i + S``. The dot product over the k-step is the sum over planes of
``x[:, k0 + P*i + S] . plane_S`` (the inputs are loaded once and split into planes in registers),
so no code moves between lanes. 16-bit elements put two codes of one plane into one 32-bit
register with no byte shuffling, which the inline-PTX decode (``FAST``) turns into two centred
fp16/bf16 codes with one ``lop3`` and one packed add.
3-bit codes add their high bit plane (``code = lo + 4*hi`` is linear). A 2:4 delta is walked in
slot space: kept slot ``j`` sits at input ``4*(j//2) + pos[j]``, so its contribution is
``sum_r x[:, 4*(j//2) + r] . where(pos == r, code - zero, 0)`` over ``r = 0..3``.
"""

import triton
import triton.language as tl


# Only core builtins and this module's own jit functions are used below (no tl.sum, tl.cdiv, ...
# from triton's standard library): the launcher can then reload this module to switch between
# compiled and interpreted mode within one process (the tests do). Sums reduce with the standard
# library's own combine function, which the interpreter recognises and runs with numpy.
@triton.jit
def _add(a, b):
    return a + b


try:
    from triton.language.standard import _sum_combine
except ImportError:  # pragma: no cover - other triton versions
    _sum_combine = _add


@triton.jit
def _sum(x, axis):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def _mma(acc, xt, wt, SWAP: tl.constexpr, DOT_PREC: tl.constexpr):
    # xt [BM, k], wt [BN, k] -> acc [BM, BN] (or [BN, BM] when SWAP: the weight is the MMA's A
    # operand, which lets Hopper take it straight from registers)
    if SWAP:
        return tl.dot(wt, tl.trans(xt), acc, input_precision=DOT_PREC)
    else:
        return tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)


@triton.jit
def _zero_code(z, MAGIC: tl.constexpr, CDT: tl.constexpr):
    # what gets subtracted from a raw code to centre it
    if MAGIC == 1:
        return (z + 1024).to(tl.float16)
    elif MAGIC == 2:
        return (z + 128).to(tl.bfloat16)
    else:
        return z


@triton.jit
def _centre(code, zc, MAGIC: tl.constexpr, CDT: tl.constexpr):
    # code - zero, exact, in the activation dtype. MAGIC avoids int->float conversions (slow on
    # the GPU): OR-ing a code into the mantissa of 1024.0 (fp16) or 128.0 (bf16, codes < 128)
    # gives 1024 + code; subtracting 1024 + zero leaves code - zero exactly.
    if MAGIC == 1:
        return (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - zc
    elif MAGIC == 2:
        return (code | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - zc
    else:
        return (code - zc).to(CDT)


@triton.jit
def _inb(idx, bound, EVEN_K: tl.constexpr):
    # idx < bound, known true when K is a whole number of k-steps (keeps loads vectorised)
    if EVEN_K:
        return tl.full(idx.shape, 1, tl.int1)
    else:
        return idx < bound


@triton.jit
def _load_x(row_ptrs, cols, row_mask, K, EVEN_K: tl.constexpr):
    # rows x cols tile of a row-major matrix whose rows are given by pointers
    return tl.load(row_ptrs + cols[None, :], mask=row_mask[:, None] & _inb(cols, K, EVEN_K)[None, :], other=0.0)


@triton.jit
def _plane(part, d, pb, ratio, xa, xb, xc, xd, offs_i, S: tl.constexpr, P: tl.constexpr,
           SPARSE: tl.constexpr, PER_ELEM: tl.constexpr, SWAP: tl.constexpr, DOT_PREC: tl.constexpr,
           CDT: tl.constexpr):
    # part += x . d for plane S (d: centred codes [BN, BKP] of stored slots P*i + S).
    # Dense: xa holds the plane's inputs. 2:4: xa..xd hold input 4*(slot//2) + r for r = 0..3.
    if PER_ELEM:
        d = (d.to(tl.float32) * ratio).to(CDT)
    if SPARSE:
        # one masked product per possible position; the first slot of a pair is never at
        # position 3 and the second never at 0 (positions increase), so skip those
        pos = (pb >> (((P * offs_i + S) % 4) * 2)[None, :]) & 3
        FIRST: tl.constexpr = (P % 2 == 0) and (S % 2 == 0)
        SECOND: tl.constexpr = (P % 2 == 0) and (S % 2 == 1)
        if not SECOND:
            part = _mma(part, xa, tl.where(pos == 0, d, d * 0), SWAP, DOT_PREC)
        part = _mma(part, xb, tl.where(pos == 1, d, d * 0), SWAP, DOT_PREC)
        part = _mma(part, xc, tl.where(pos == 2, d, d * 0), SWAP, DOT_PREC)
        if not FIRST:
            part = _mma(part, xd, tl.where(pos == 3, d, d * 0), SWAP, DOT_PREC)
    else:
        part = _mma(part, xa, d, SWAP, DOT_PREC)
    return part


@triton.jit
def _decode(qi, hb, zc, offs_i, S: tl.constexpr, PB: tl.constexpr, BITS: tl.constexpr,
            MAGIC: tl.constexpr, CDT: tl.constexpr):
    # plain-Triton decode of plane S: centred codes in the activation dtype
    code = (qi >> (S * PB)) & ((1 << PB) - 1)
    if BITS == 3:
        code = code | (((hb >> (4 * (offs_i % 2) + S)[None, :]) & 1) << 2)
    return _centre(code, zc, MAGIC, CDT)


# Inline PTX decode (GPU only; the interpreter takes the plain path). One instance gets 32 bits
# of packed codes: four bytes (EW 8, pack=4) or two 16-bit elements (EW 16, pack=2). Per output
# register (two codes of one plane, one per 16-bit lane): lop3 masks the codes and ORs in the
# exponent of 1024.0 (fp16) / 128.0 (bf16), and one packed add of -(1024 + zero) (-(128 + zero))
# leaves the centred codes. With bytes, prmt first spreads bytes 0,1 (2,3) into the two lanes.
_PTX_ADD = {1: "add.f16x2 {d}, {a}, {z};", 2: "fma.rn.bf16x2 {d}, {a}, one, {z};"}
_PTX_MAGIC = {1: "0x64006400", 2: "0x43004300"}
_PTX_MASK = {2: "0x00030003", 4: "0x000f000f", 8: "0x00ff00ff"}


def _ptx_bytes(nbits, magic, n_planes):
    q, z0, z1 = f"${2 * n_planes}", f"${2 * n_planes + 1}", f"${2 * n_planes + 2}"
    lines = ["{", ".reg .b32 zr, one, t0, t1, u0, u1;", "mov.b32 zr, 0;", "mov.b32 one, 0x3F803F80;",
             f"prmt.b32 t0, {q}, zr, 0x4140;", f"prmt.b32 t1, {q}, zr, 0x4342;"]
    for s in range(n_planes):
        src0, src1 = "t0", "t1"
        if s:
            lines += [f"shr.b32 u0, t0, {s * nbits};", f"shr.b32 u1, t1, {s * nbits};"]
            src0, src1 = "u0", "u1"
        lines += [f"lop3.b32 u0, {src0}, {_PTX_MASK[nbits]}, {_PTX_MAGIC[magic]}, 0xea;",
                  f"lop3.b32 u1, {src1}, {_PTX_MASK[nbits]}, {_PTX_MAGIC[magic]}, 0xea;",
                  _PTX_ADD[magic].format(d=f"${2 * s}", a="u0", z=z0),
                  _PTX_ADD[magic].format(d=f"${2 * s + 1}", a="u1", z=z1)]
    return "\n".join(lines + ["}"])


def _ptx_halves(nbits, magic, n_planes):
    q, z = f"${n_planes}", f"${n_planes + 1}"
    lines = ["{", ".reg .b32 one, t;", "mov.b32 one, 0x3F803F80;"]
    for s in range(n_planes):
        src = q
        if s:
            lines.append(f"shr.b32 t, {q}, {s * nbits};")
            src = "t"
        lines += [f"lop3.b32 t, {src}, {_PTX_MASK[nbits]}, {_PTX_MAGIC[magic]}, 0xea;",
                  _PTX_ADD[magic].format(d=f"${s}", a="t", z=z)]
    return "\n".join(lines + ["}"])


_B4_F16 = tl.constexpr(_ptx_bytes(4, 1, 2))
_B4_BF16 = tl.constexpr(_ptx_bytes(4, 2, 2))
_B2_F16 = tl.constexpr(_ptx_bytes(2, 1, 4))
_B2_BF16 = tl.constexpr(_ptx_bytes(2, 2, 4))
_B8_F16 = tl.constexpr(_ptx_bytes(8, 1, 1))
_H4_F16 = tl.constexpr(_ptx_halves(4, 1, 4))
_H4_BF16 = tl.constexpr(_ptx_halves(4, 2, 4))
_H2_F16 = tl.constexpr(_ptx_halves(2, 1, 8))
_H2_BF16 = tl.constexpr(_ptx_halves(2, 2, 8))
_H8_F16 = tl.constexpr(_ptx_halves(8, 1, 2))


@triton.jit
def _asm_planes(q, negz, ASM_F16: tl.constexpr, ASM_BF16: tl.constexpr, CONSTRAINTS: tl.constexpr,
                NOUT: tl.constexpr, PACK: tl.constexpr, MAGIC: tl.constexpr):
    if MAGIC == 1:
        if NOUT == 1:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz],
                dtype=tl.float16, is_pure=True, pack=PACK)
        elif NOUT == 2:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz],
                dtype=(tl.float16, tl.float16),
                is_pure=True, pack=PACK)
        elif NOUT == 4:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=PACK)
        else:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=PACK)
    else:
        if NOUT == 2:
            return tl.inline_asm_elementwise(
                ASM_BF16, CONSTRAINTS, [q, negz],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=PACK)
        elif NOUT == 4:
            return tl.inline_asm_elementwise(
                ASM_BF16, CONSTRAINTS, [q, negz],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=PACK)
        else:
            return tl.inline_asm_elementwise(
                ASM_BF16, CONSTRAINTS, [q, negz],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=PACK)


def _ptx_sparse(nbits, magic, planes, halves):
    """Decode 2:4 planes and split each by position: per plane S, three outputs
    ``where(pos == r, code - zero, 0)`` for the three positions slot S can have (r = 0, 1, 2 for
    the first slot of a pair, 1, 2, 3 for the second). The mask of each 16-bit lane comes from a
    prmt table lookup indexed by the lane's position: no compares, no selects."""
    regs = 1 if halves else 2
    n_out = len(planes) * 3 * regs
    q = f"${n_out}"
    zs = [f"${n_out + 1}"] if halves else [f"${n_out + 1}", f"${n_out + 2}"]
    pos = f"${n_out + 2}" if halves else f"${n_out + 3}"
    lines = ["{", ".reg .b32 zr, one, tb0, tb1, tb2, tb3, t0, t1, p0, p1, d, p, s, m;", "mov.b32 zr, 0;",
             "mov.b32 one, 0x3F803F80;", "mov.b32 tb0, 0x000000FF;", "mov.b32 tb1, 0x0000FF00;",
             "mov.b32 tb2, 0x00FF0000;", "mov.b32 tb3, 0xFF000000;"]
    if halves:
        srcs = [(q, pos, zs[0])]
    else:
        lines += [f"prmt.b32 t0, {q}, zr, 0x4140;", f"prmt.b32 t1, {q}, zr, 0x4342;",
                  f"prmt.b32 p0, {pos}, zr, 0x4140;", f"prmt.b32 p1, {pos}, zr, 0x4342;"]
        srcs = [("t0", "p0", zs[0]), ("t1", "p1", zs[1])]
    for k, S in enumerate(planes):
        rs = (0, 1, 2) if S % 2 == 0 else (1, 2, 3)
        for h, (tq, tp, tz) in enumerate(srcs):
            src = tq
            if S:
                lines.append(f"shr.b32 d, {tq}, {S * nbits};")
                src = "d"
            lines += [f"lop3.b32 d, {src}, {_PTX_MASK[nbits]}, {_PTX_MAGIC[magic]}, 0xea;",
                      _PTX_ADD[magic].format(d="d", a="d", z=tz),
                      f"shr.b32 p, {tp}, {2 * S};",
                      "and.b32 p, p, 0x00030003;",  # lane positions p0 (bits 0-1), p1 (16-17)
                      "shr.b32 s, p, 8;",
                      "or.b32 s, s, p;",  # p0 at bits 0-1, p1 at 8-9
                      "mul.lo.u32 s, s, 0x11;"]  # selector: bytes 0,1 <- p0, bytes 2,3 <- p1
            for j, r in enumerate(rs):
                out = f"${(3 * k + j) * regs + h}"
                lines += [f"prmt.b32 m, tb{r}, zr, s;", f"and.b32 {out}, d, m;"]
    return "\n".join(lines + ["}"])


_S4H_F16 = tl.constexpr(_ptx_sparse(4, 1, (0, 1, 2, 3), True))
_S4H_BF16 = tl.constexpr(_ptx_sparse(4, 2, (0, 1, 2, 3), True))
_S4B_F16 = tl.constexpr(_ptx_sparse(4, 1, (0, 1), False))
_S4B_BF16 = tl.constexpr(_ptx_sparse(4, 2, (0, 1), False))
_S2B01_F16 = tl.constexpr(_ptx_sparse(2, 1, (0, 1), False))
_S2B01_BF16 = tl.constexpr(_ptx_sparse(2, 2, (0, 1), False))
_S2B23_F16 = tl.constexpr(_ptx_sparse(2, 1, (2, 3), False))
_S2B23_BF16 = tl.constexpr(_ptx_sparse(2, 2, (2, 3), False))
_C12 = tl.constexpr(",".join(["=r"] * 12) + ",r,r,r")
_C12B = tl.constexpr(",".join(["=r"] * 12) + ",r,r,r,r")


@triton.jit
def _asm_sparse(q, negz, pos, ASM_F16: tl.constexpr, ASM_BF16: tl.constexpr, CONSTRAINTS: tl.constexpr,
                NOUT: tl.constexpr, PACK: tl.constexpr, MAGIC: tl.constexpr):
    if MAGIC == 1:
        if NOUT == 6:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz, pos],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16),
                is_pure=True, pack=PACK)
        else:
            return tl.inline_asm_elementwise(
                ASM_F16, CONSTRAINTS, [q, negz, pos],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=PACK)
    else:
        if NOUT == 6:
            return tl.inline_asm_elementwise(
                ASM_BF16, CONSTRAINTS, [q, negz, pos],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=PACK)
        else:
            return tl.inline_asm_elementwise(
                ASM_BF16, CONSTRAINTS, [q, negz, pos],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=PACK)


@triton.jit
def _sparse3(part, xa, xb, xc, xd, m0, m1, m2, ratio, S: tl.constexpr, PER_ELEM: tl.constexpr,
             SWAP: tl.constexpr, DOT_PREC: tl.constexpr, CDT: tl.constexpr):
    # plane S already split by position: m0..m2 hold positions 0..2 (S even) or 1..3 (S odd)
    if PER_ELEM:
        m0 = (m0.to(tl.float32) * ratio).to(CDT)
        m1 = (m1.to(tl.float32) * ratio).to(CDT)
        m2 = (m2.to(tl.float32) * ratio).to(CDT)
    if S % 2 == 0:
        part = _mma(part, xa, m0, SWAP, DOT_PREC)
        part = _mma(part, xb, m1, SWAP, DOT_PREC)
        part = _mma(part, xc, m2, SWAP, DOT_PREC)
    else:
        part = _mma(part, xb, m0, SWAP, DOT_PREC)
        part = _mma(part, xc, m1, SWAP, DOT_PREC)
        part = _mma(part, xd, m2, SWAP, DOT_PREC)
    return part


@triton.jit
def _finish(res, bias_ptr, offs_n, nmask, bad2, out_ptr, o_off, o_mask, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
            ACCUM: tl.constexpr):
    # + bias, NaN for rows with a bad delta id, store in the output dtype; ACCUM: added to what the output
    # holds (the base's product, computed before this launch)
    if ACCUM:
        res += tl.load(out_ptr + o_off, mask=o_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        if SWAP:
            res += b[:, None]
        else:
            res += b[None, :]
    res = tl.where(bad2, float("nan"), res)
    tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _epilogue(acc, rows, slot, valid, bad, offs_n, nmask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_om,
              pid_n, pid_r, pid_s, n_rblocks, BM: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
              HAS_BIAS: tl.constexpr, ACCUM: tl.constexpr):
    # SPLIT == 1: add bias and store the rows where they came from. SPLIT > 1: store the fp32
    # partial, count arrivals on the tile's semaphore; the last program sums the partials in split
    # order (deterministic), adds bias, stores, and resets the semaphore for the next launch.
    offs_n64 = offs_n.to(tl.int64)
    if SWAP:
        o_off = rows.to(tl.int64)[None, :] * stride_om + offs_n64[:, None]
        o_mask = valid[None, :] & nmask[:, None]
        bad2 = bad[None, :]
        ws_off = slot.to(tl.int64)[None, :] * N + offs_n64[:, None]
    else:
        o_off = rows.to(tl.int64)[:, None] * stride_om + offs_n64[None, :]
        o_mask = valid[:, None] & nmask[None, :]
        bad2 = bad[:, None]
        ws_off = slot.to(tl.int64)[:, None] * N + offs_n64[None, :]
    if SPLIT == 1:
        _finish(acc, bias_ptr, offs_n, nmask, bad2, out_ptr, o_off, o_mask, SWAP, HAS_BIAS, ACCUM)
    else:
        split_stride = n_rblocks * BM * N  # ws is [SPLIT, n_rblocks * BM, N] fp32
        tl.store(ws_ptr + pid_s * split_stride + ws_off, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        tile = pid_n * n_rblocks + pid_r
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            res = acc * 0.0
            for s in tl.static_range(SPLIT):  # fixed order: deterministic sums
                res += tl.load(ws_ptr + s * split_stride + ws_off, mask=o_mask, other=0.0, cache_modifier=".cg")
            _finish(res, bias_ptr, offs_n, nmask, bad2, out_ptr, o_off, o_mask, SWAP, HAS_BIAS, ACCUM)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


# M and U change with every batch: keep them out of specialisation (one compile per layer shape)
@triton.jit(do_not_specialize=["M", "U"])
def multi_delta_linear_kernel(
    x_ptr, w_ptr, bias_ptr, q_ptr, s_ptr, z_ptr, pos_ptr, rd_ptr, perm_ptr,
    out_ptr, ws_ptr, cnt_ptr,
    M, N, K, U, KQ, QROW_E, G, PROW, LO_BYTES, LOG2_GS, K_CHUNK,
    stride_xm, stride_wn, stride_om,
    BITS: tl.constexpr, SPARSE: tl.constexpr, HAS_BIAS: tl.constexpr,
    FUSED_SORT: tl.constexpr, MP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr,
    SPLIT: tl.constexpr, SWAP: tl.constexpr, PER_ELEM: tl.constexpr, MAGIC: tl.constexpr,
    DOT_PREC: tl.constexpr, FAST: tl.constexpr, EVEN_K: tl.constexpr, EW: tl.constexpr,
):
    CDT: tl.constexpr = x_ptr.dtype.element_ty
    # ---------------------------------------------------------------- program -> work
    pid = tl.program_id(0)
    n_tiles = (N + BN - 1) // BN
    n_rblocks = (M + BM - 1) // BM
    pid_s = pid % SPLIT
    t = pid // SPLIT
    pid_r = t % n_rblocks  # row blocks of one n-tile run side by side: its base tile hits L2
    pid_n = t // n_rblocks

    # ---------------------------------------------------------------- sort rows by delta
    offs_bm = tl.arange(0, BM)
    slot = pid_r * BM + offs_bm
    valid = slot < M
    if FUSED_SORT:
        offs_mp = tl.arange(0, MP)
        keys = tl.load(rd_ptr + offs_mp, mask=offs_mp < M, other=1 << 30).to(tl.int32)
        before = (keys[None, :] < keys[:, None]) | (
            (keys[None, :] == keys[:, None]) & (offs_mp[None, :] < offs_mp[:, None])
        )
        rank = _sum(before.to(tl.int32), axis=1)  # stable rank of each row
        hit = rank[None, :] == slot[:, None]  # [BM, MP]
        rows = _sum(tl.where(hit, offs_mp[None, :], 0), axis=1)
        dl = _sum(tl.where(hit, keys[None, :], 0), axis=1)
    else:
        rows = tl.load(perm_ptr + slot, mask=valid, other=0).to(tl.int32)
        dl = tl.load(rd_ptr + rows, mask=valid, other=-1).to(tl.int32)
    rows = tl.where(valid, rows, 0)
    dl = tl.where(valid, dl, -1)
    is_delta = valid & (dl >= 0) & (dl < U)
    # segments of this block: a slot starts one when no earlier slot has its delta
    earlier = offs_bm[None, :] < offs_bm[:, None]  # [j, j'] : j' < j
    dup = _sum(((dl[None, :] == dl[:, None]) & earlier).to(tl.int32), axis=1) > 0
    first = is_delta & (dup == 0)
    seg_ord = _sum((first[None, :] & earlier).to(tl.int32), axis=1)  # segments before slot j
    n_seg = _sum(first.to(tl.int32), axis=0)

    # ---------------------------------------------------------------- base pass
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    k_begin = pid_s * K_CHUNK
    k_end = tl.minimum(k_begin + K_CHUNK, K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    if SWAP:
        acc = tl.full([BN, BM], 0.0, tl.float32)
    else:
        acc = tl.full([BM, BN], 0.0, tl.float32)
    offs_kb = tl.arange(0, BKB)
    w_rows = w_ptr + offs_n64[:, None] * stride_wn  # [BN, 1]
    for k0 in range(k_begin, k_end, BKB):
        cols = k0 + offs_kb
        xt = _load_x(x_rows, cols, valid, K, EVEN_K)
        wt = _load_x(w_rows, cols, nmask, K, EVEN_K)
        acc = _mma(acc, xt, wt, SWAP, DOT_PREC)

    # ---------------------------------------------------------------- delta passes
    PB: tl.constexpr = 2 if BITS <= 3 else BITS  # bits per code in the primary plane
    P: tl.constexpr = EW // PB  # codes per packed element
    SLOTS: tl.constexpr = BK // 2 if SPARSE else BK  # stored codes per k-step
    BKP: tl.constexpr = SLOTS // P  # packed elements per row per k-step
    tl.static_assert(BKP >= 16, "a k-step must give 16-deep MMAs")
    tl.static_assert(not (SPARSE and P == 8), "2:4 with 8 codes per element is not supported")
    if EW == 16:
        qe_ptr = q_ptr.to(tl.pointer_type(tl.uint16))
    else:
        qe_ptr = q_ptr
    offs_i = tl.arange(0, BKP)
    prim_elems = (KQ + P - 1) // P
    hi_bytes = (KQ + 7) // 8
    pos_bytes = (KQ + 3) // 4
    nk = tl.maximum((k_end - k_begin + BK - 1) // BK, 0)
    if SPARSE:
        colrel = 4 * ((P * offs_i) // 2)  # first input of each slot's group of 4 (plane 0)
    else:
        colrel = P * offs_i
    offs_k = tl.arange(0, BK)
    q_rows = offs_n64 * QROW_E  # per-row offsets, hoisted: the loop adds the delta's base
    p_rows = offs_n64 * PROW
    g_rows = offs_n64 * G
    t_seg = 0
    kk = 0
    for it in range(0, n_seg * nk):
        k0 = k_begin + kk * BK
        u = _sum(tl.where(first & (seg_ord == t_seg), dl, 0), axis=0)
        sel = is_delta & (dl == u)
        u64 = u.to(tl.int64) * N  # first row of delta u in the [U*N, ...] planes
        slot0 = k0 // 2 if SPARSE else k0
        eidx = tl.multiple_of(slot0 // P, 16) + offs_i  # k-steps start on whole 16-element rows
        qe = tl.load(qe_ptr + u64 * QROW_E + q_rows[:, None] + eidx[None, :],
                     mask=nmask[:, None] & _inb(eidx, prim_elems, EVEN_K)[None, :], other=0)
        hb = qe
        if BITS == 3:
            hidx = slot0 // 8 + offs_i // 2
            hb = tl.load(q_ptr + u64 * QROW_E + q_rows[:, None] + LO_BYTES + hidx[None, :],
                         mask=nmask[:, None] & _inb(hidx, hi_bytes, EVEN_K)[None, :], other=0).to(tl.int32)
        pb = qe  # placeholder when dense
        if SPARSE:
            pidx = tl.multiple_of(slot0 // 4, 16) + (P * offs_i) // 4
            pb = tl.load(pos_ptr + u64 * PROW + p_rows[:, None] + pidx[None, :],
                         mask=nmask[:, None] & _inb(pidx, pos_bytes, EVEN_K)[None, :], other=0).to(tl.int32)
        g_base = u64 * G + g_rows
        g0 = k0 >> LOG2_GS
        s0 = tl.load(s_ptr + g_base + g0, mask=nmask, other=1.0).to(tl.float32)
        if PER_ELEM:
            # a k-step spans several groups: scale each element by its group's scale relative
            # to the first group's, and the product by the first group's (keeps fp16 in range)
            gcol = (k0 + colrel) >> LOG2_GS
            gm = nmask[:, None] & (gcol < G)[None, :]
            s_el = tl.load(s_ptr + g_base[:, None] + gcol[None, :], mask=gm, other=1.0).to(tl.float32)
            z_el = tl.load(z_ptr + g_base[:, None] + gcol[None, :], mask=gm, other=0).to(tl.int32)
            s0 = tl.where(s0 == 0.0, 1.0, s0)
            ratio = s_el / s0[:, None]
            zc = _zero_code(z_el, MAGIC, CDT)
        else:
            z0 = tl.load(z_ptr + g_base + g0, mask=nmask, other=0).to(tl.int32)
            zc = _zero_code(z0, MAGIC, CDT)[:, None]
            ratio = s0  # unused

        # centred codes of each plane (2:4 with FAST: decoded and split by position further down)
        if FAST and SPARSE:
            pass
        elif FAST:
            negz = tl.broadcast_to(-zc, [BN, BKP])
            if EW == 8:
                if BITS == 4:
                    d0, d1 = _asm_planes(qe, negz, _B4_F16, _B4_BF16, "=r,=r,=r,=r,r,r,r", 2, 4, MAGIC)
                elif BITS == 2:
                    d0, d1, d2, d3 = _asm_planes(qe, negz, _B2_F16, _B2_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", 4, 4,
                                                 MAGIC)
                else:
                    d0 = _asm_planes(qe, negz, _B8_F16, _B8_F16, "=r,=r,r,r,r", 1, 4, MAGIC)
            else:
                if BITS == 4:
                    d0, d1, d2, d3 = _asm_planes(qe, negz, _H4_F16, _H4_BF16, "=r,=r,=r,=r,r,r", 4, 2, MAGIC)
                elif BITS == 2:
                    d0, d1, d2, d3, d4, d5, d6, d7 = _asm_planes(qe, negz, _H2_F16, _H2_BF16,
                                                                 "=r,=r,=r,=r,=r,=r,=r,=r,r,r", 8, 2, MAGIC)
                else:
                    d0, d1 = _asm_planes(qe, negz, _H8_F16, _H8_F16, "=r,=r,r,r", 2, 2, MAGIC)
        else:
            qi = qe.to(tl.int32)
            d0 = _decode(qi, hb, zc, offs_i, 0, PB, BITS, MAGIC, CDT)
            if P >= 2:
                d1 = _decode(qi, hb, zc, offs_i, 1, PB, BITS, MAGIC, CDT)
            if P >= 4:
                d2 = _decode(qi, hb, zc, offs_i, 2, PB, BITS, MAGIC, CDT)
                d3 = _decode(qi, hb, zc, offs_i, 3, PB, BITS, MAGIC, CDT)
            if P == 8:
                d4 = _decode(qi, hb, zc, offs_i, 4, PB, BITS, MAGIC, CDT)
                d5 = _decode(qi, hb, zc, offs_i, 5, PB, BITS, MAGIC, CDT)
                d6 = _decode(qi, hb, zc, offs_i, 6, PB, BITS, MAGIC, CDT)
                d7 = _decode(qi, hb, zc, offs_i, 7, PB, BITS, MAGIC, CDT)

        # the matching inputs: one contiguous load, split into planes in registers
        if SPARSE and P == 1:  # 8-bit 2:4: slots 2g, 2g+1 share inputs 4g..4g+3: gather them
            cb = k0 + 4 * (offs_i // 2)
            xa0 = _load_x(x_rows, cb, sel, K, EVEN_K)
            xa1 = _load_x(x_rows, cb + 1, sel, K, EVEN_K)
            xa2 = _load_x(x_rows, cb + 2, sel, K, EVEN_K)
            xa3 = _load_x(x_rows, cb + 3, sel, K, EVEN_K)
        else:
            xt = _load_x(x_rows, k0 + offs_k, sel, K, EVEN_K)  # [BM, BK]
        if not SPARSE:  # plane S holds inputs P*i + S
            if P == 1:
                xp0 = xt
            elif P == 2:
                xp0, xp1 = tl.split(tl.reshape(xt, [BM, BKP, 2]))
            elif P == 4:  # input 4i + 2a + b
                y0, y1 = tl.split(tl.reshape(xt, [BM, BKP, 2, 2]))
                xp0, xp2 = tl.split(y0)
                xp1, xp3 = tl.split(y1)
            else:  # input 8i + 4a + 2b + c
                y0, y1 = tl.split(tl.reshape(xt, [BM, BKP, 2, 2, 2]))
                z00, z10 = tl.split(y0)
                z01, z11 = tl.split(y1)
                xp0, xp4 = tl.split(z00)
                xp2, xp6 = tl.split(z10)
                xp1, xp5 = tl.split(z01)
                xp3, xp7 = tl.split(z11)
        elif P == 2:  # slot 2i + S sits at input 4i + r, r = 2a + b
            y0, y1 = tl.split(tl.reshape(xt, [BM, BKP, 2, 2]))
            xa0, xa2 = tl.split(y0)
            xa1, xa3 = tl.split(y1)
        elif P == 4:  # slot 4i + S sits at input 8i + 4c + r, c = S // 2, r = 2a + b
            y0, y1 = tl.split(tl.reshape(xt, [BM, BKP, 2, 2, 2]))
            z00, z10 = tl.split(y0)
            z01, z11 = tl.split(y1)
            xa0, xb0 = tl.split(z00)
            xa2, xb2 = tl.split(z10)
            xa1, xb1 = tl.split(z01)
            xa3, xb3 = tl.split(z11)

        if SWAP:
            part = tl.full([BN, BM], 0.0, tl.float32)
        else:
            part = tl.full([BM, BN], 0.0, tl.float32)
        if FAST and SPARSE:
            negz = tl.broadcast_to(-zc, [BN, BKP])
            if P == 2:  # two elements share a position byte: bring each one's half down
                pb = pb >> (((P * offs_i) % 4) * 2)[None, :]
            if EW == 16:  # 4-bit, four planes in one pass
                pos16 = pb.to(tl.uint16)
                m00, m01, m02, m10, m11, m12, m20, m21, m22, m30, m31, m32 = _asm_sparse(
                    qe, negz, pos16, _S4H_F16, _S4H_BF16, _C12, 12, 2, MAGIC)
            elif BITS == 4:  # bytes, two planes
                pos8 = pb.to(tl.uint8)
                m00, m01, m02, m10, m11, m12 = _asm_sparse(qe, negz, pos8, _S4B_F16, _S4B_BF16, _C12B, 6, 4, MAGIC)
            else:  # 2-bit bytes, four planes in two passes
                pos8 = pb.to(tl.uint8)
                m00, m01, m02, m10, m11, m12 = _asm_sparse(qe, negz, pos8, _S2B01_F16, _S2B01_BF16, _C12B, 6, 4, MAGIC)
                m20, m21, m22, m30, m31, m32 = _asm_sparse(qe, negz, pos8, _S2B23_F16, _S2B23_BF16, _C12B, 6, 4, MAGIC)
            part = _sparse3(part, xa0, xa1, xa2, xa3, m00, m01, m02, ratio, 0, PER_ELEM, SWAP, DOT_PREC, CDT)
            part = _sparse3(part, xa0, xa1, xa2, xa3, m10, m11, m12, ratio, 1, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P == 4:
                part = _sparse3(part, xb0, xb1, xb2, xb3, m20, m21, m22, ratio, 2, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _sparse3(part, xb0, xb1, xb2, xb3, m30, m31, m32, ratio, 3, PER_ELEM, SWAP, DOT_PREC, CDT)
        elif SPARSE:
            part = _plane(part, d0, pb, ratio, xa0, xa1, xa2, xa3, offs_i, 0, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P >= 2:
                part = _plane(part, d1, pb, ratio, xa0, xa1, xa2, xa3,
                    offs_i, 1, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P >= 4:
                part = _plane(part, d2, pb, ratio, xb0, xb1, xb2, xb3,
                    offs_i, 2, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _plane(part, d3, pb, ratio, xb0, xb1, xb2, xb3,
                    offs_i, 3, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
        else:
            part = _plane(part, d0, pb, ratio, xp0, xp0, xp0, xp0, offs_i, 0, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P >= 2:
                part = _plane(part, d1, pb, ratio, xp1, xp1, xp1, xp1,
                    offs_i, 1, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P >= 4:
                part = _plane(part, d2, pb, ratio, xp2, xp2, xp2, xp2,
                    offs_i, 2, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _plane(part, d3, pb, ratio, xp3, xp3, xp3, xp3,
                    offs_i, 3, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
            if P == 8:
                part = _plane(part, d4, pb, ratio, xp4, xp4, xp4, xp4,
                    offs_i, 4, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _plane(part, d5, pb, ratio, xp5, xp5, xp5, xp5,
                    offs_i, 5, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _plane(part, d6, pb, ratio, xp6, xp6, xp6, xp6,
                    offs_i, 6, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
                part = _plane(part, d7, pb, ratio, xp7, xp7, xp7, xp7,
                    offs_i, 7, P, SPARSE, PER_ELEM, SWAP, DOT_PREC, CDT)
        if SWAP:
            acc += part * s0[:, None]
        else:
            acc += part * s0[None, :]
        kk += 1  # next k-step; past the last one, next segment
        wrap = kk == nk
        kk = tl.where(wrap, 0, kk)
        t_seg = tl.where(wrap, t_seg + 1, t_seg)

    # ---------------------------------------------------------------- epilogue
    bad = valid & ((dl < -1) | (dl >= U))  # out-of-range delta ids give NaN rows, never a bad read
    _epilogue(acc, rows, slot, valid, bad, offs_n, nmask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_om,
              pid_n, pid_r, pid_s, n_rblocks, BM, SPLIT, SWAP, HAS_BIAS, False)


# =====================================================================================================
# Planar kernel: dense 2-, 4- and 8-bit codes in the planar layout (kernels/layout.py), rows given by
# a per-step row-segment table (kernels.layout.build_row_segments).
#
# Element i of the k-step's block holds, in bits S*b.., the code of input k0 + S*BKP + i, so plane S
# is an MMA with the contiguous activation slice x[:, k0 + S*BKP : k0 + (S+1)*BKP] (loaded straight
# into the MMA operand: no register shuffles of x). Decode of one plane, per 32-bit register (two
# codes): `lop3` masks the code in place and ORs in the exponent of 1024.0 (fp16) / 128.0 (bf16),
# giving MAGIC + code * 2^e; one packed fma with 2^-e and -(MAGIC * 2^-e + zero) leaves code - zero
# exactly. Codes sit in place while they fit the mantissa (fp16: 10 bits, bf16: 7), otherwise a
# shared `shr` brings the next window down (1 - 1.4 instructions per weight in all).
# =====================================================================================================
_PTX_MAGICF = {1: 1024.0, 2: 128.0}
_MANT_BITS = {1: 10, 2: 7}


def planar_window(bits: int, magic: int) -> int:
    """Codes of one 16-bit element decoded per window (in place, without a shift)."""
    return max(1, _MANT_BITS[magic] // bits)


def planar_plan(bits: int, magic: int):
    """Per plane S: (S, right shift of the element, bit offset e of the code after the shift)."""
    pw = planar_window(bits, magic)
    return [(s, (s // pw) * pw * bits, (s % pw) * bits) for s in range(16 // bits)]


def _pow2_bits(e: int, magic: int) -> int:
    # 2^-e as a packed pair of fp16 / bf16
    h = ((15 - e) << 10) if magic == 1 else ((127 - e) << 7)
    return h | (h << 16)


def _ptx_plane(bits: int, magic: int, e: int, scaled: bool) -> str:
    """One plane, two codes per register: $0 = out, $1 = element pair (already shifted), $2 =
    -(MAGIC * 2^-e + zero) pair, $3 (scaled) = group scale pair."""
    mask = ((1 << bits) - 1) << e
    mask |= mask << 16
    fma = "fma.rn.f16x2" if magic == 1 else "fma.rn.bf16x2"
    dst = "d" if scaled else "$0"
    lines = ["{", ".reg .b32 m, k, d;", f"mov.b32 k, 0x{_pow2_bits(e, magic):08x};",
             f"lop3.b32 m, $1, 0x{mask:08x}, {_PTX_MAGIC[magic]}, 0xea;",
             f"{fma} {dst}, m, k, $2;"]
    if scaled:
        lines += ["mov.b32 k, 0x80008000;", f"{fma} $0, d, $3, k;"]  # d * scale + (-0.0)
    return "\n".join(lines + ["}"])


def _ptx_table(scaled: bool) -> tuple:
    # index: magic * 64 + bits * 8 + e // 2 (only the combinations the plans use are filled)
    out = {}
    for magic in (1, 2):
        for bits in (2, 4, 8):
            if _MANT_BITS[magic] < bits:
                continue
            for _, _, e in planar_plan(bits, magic):
                out[(magic, bits, e)] = _ptx_plane(bits, magic, e, scaled)
    return out


_PLANE_ASM = _ptx_table(False)
_PLANE_ASM_S = _ptx_table(True)
_SHR_ASM = {sh: f"shr.b32 $0, $1, {sh};" for sh in range(2, 16, 2)}


@triton.jit
def _asm_shr(q, ASM: tl.constexpr):
    # a packed pair of 16-bit elements shifted right as one 32-bit word (down to window WIN): the
    # bits a lane gets from its neighbour lie above every code bit read afterwards. Pure: the
    # repeated calls of one window fold into one instruction.
    return tl.inline_asm_elementwise(ASM, "=r,r", [q], dtype=tl.uint16, is_pure=True, pack=2)


@triton.jit
def _asm_plane(q, c, s, ASM: tl.constexpr, SCALED: tl.constexpr, MAGIC: tl.constexpr):
    if MAGIC == 1:
        if SCALED:
            return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [q, c, s], dtype=tl.float16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(ASM, "=r,r,r", [q, c], dtype=tl.float16, is_pure=True, pack=2)
    else:
        if SCALED:
            return tl.inline_asm_elementwise(ASM, "=r,r,r,r", [q, c, s], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(ASM, "=r,r,r", [q, c], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit(do_not_specialize=["M", "U"])
def planar_delta_linear_kernel(
    x_ptr, w_ptr, bias_ptr, q_ptr, s_ptr, z_ptr, seg_ptr, lut_ptr,
    out_ptr, ws_ptr, cnt_ptr,
    M, N, K, U, QROW_E, G, LOG2_GS, K_CHUNK,
    stride_xm, stride_wn, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LUT: tl.constexpr, HAS_BASE: tl.constexpr, ACCUM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, BKB: tl.constexpr, PPG: tl.constexpr,
    SPLIT: tl.constexpr, SWAP: tl.constexpr, MAGIC: tl.constexpr, MAGICF: tl.constexpr, PW: tl.constexpr,
    SCALE_W: tl.constexpr, DOT_PREC: tl.constexpr, FAST: tl.constexpr,
    A00: tl.constexpr, A01: tl.constexpr, A02: tl.constexpr, A03: tl.constexpr,
    A04: tl.constexpr, A05: tl.constexpr, A06: tl.constexpr, A07: tl.constexpr,
    H1: tl.constexpr, H2: tl.constexpr, H3: tl.constexpr,
):
    CDT: tl.constexpr = x_ptr.dtype.element_ty
    P: tl.constexpr = 16 // BITS  # planes (codes per 16-bit element)
    LB: tl.constexpr = P * BKP  # inputs per k-step
    pid = tl.program_id(0)
    n_tiles = (N + BN - 1) // BN
    n_rblocks = (M + BM - 1) // BM
    pid_s = pid % SPLIT
    t = pid // SPLIT
    pid_r = t % n_rblocks
    pid_n = t // n_rblocks

    # ------------------------------------------------ rows of this block (sorted slots)
    offs_bm = tl.arange(0, BM)
    slot = pid_r * BM + offs_bm
    valid = slot < M
    rows = tl.load(seg_ptr + slot, mask=valid, other=0)
    sd = tl.load(seg_ptr + M + slot, mask=valid, other=-1)
    if HAS_LUT:  # the table holds the rows' slot ids: this stack's index of each (lut[slot + 1], -1 if none)
        sd = tl.load(lut_ptr + sd + 1, mask=valid, other=-1)
    seg_lo = tl.load(seg_ptr + 2 * M + pid_r * BM)  # segments of the block's first and last slots
    seg_hi = tl.load(seg_ptr + 2 * M + tl.minimum(pid_r * BM + BM, M) - 1)
    n_seg = seg_hi - seg_lo + 1

    # ------------------------------------------------ base pass
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    k_begin = pid_s * K_CHUNK
    k_end = tl.minimum(k_begin + K_CHUNK, K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if SWAP:
        acc = tl.full([BN, BM], 0.0, tl.float32)
    else:
        acc = tl.full([BM, BN], 0.0, tl.float32)
    if HAS_BASE:  # off: the deltas alone (the base's product is already in the output, ACCUM)
        offs_kb = tl.arange(0, BKB)
        w_rows = w_ptr + offs_n64[:, None] * stride_wn
        for k0 in range(k_begin, k_end, BKB):
            cols = k0 + offs_kb
            xt = tl.load(x_rows + cols[None, :], mask=valid[:, None], other=0.0)
            wt = tl.load(w_rows + cols[None, :], mask=nmask[:, None], other=0.0)
            acc = _mma(acc, xt, wt, SWAP, DOT_PREC)

    # ------------------------------------------------ delta passes: one flat loop over (segment, k-step)
    qe_ptr = q_ptr.to(tl.pointer_type(tl.uint16))
    offs_i = tl.arange(0, BKP)
    nk = tl.maximum((k_end - k_begin + LB - 1) // LB, 0)
    q_rows = offs_n64 * QROW_E
    g_rows = offs_n64 * G
    t_seg = 0
    kk = 0
    for it in range(0, n_seg * nk):
        k0 = k_begin + kk * LB
        u = tl.load(seg_ptr + 3 * M + seg_lo + t_seg)
        if HAS_LUT:
            u = tl.load(lut_ptr + u + 1)
        un = offs_n * 0 + u
        nlive = nmask & (un >= 0) & (un < U)  # nothing is read for the -1 segment or a bad id
        sel = valid & (sd == u) & (sd >= 0) & (sd < U)  # rows of this segment
        u64 = tl.maximum(tl.minimum(u, U - 1), 0).to(tl.int64) * N
        eidx = (k0 // LB) * BKP + offs_i
        qe = tl.load(qe_ptr + u64 * QROW_E + q_rows[:, None] + eidx[None, :],
                     mask=nlive[:, None] & (offs_i < BKP)[None, :], other=0)
        g_base = u64 * G + g_rows
        g0 = k0 >> LOG2_GS
        if SWAP:
            part = tl.full([BN, BM], 0.0, tl.float32)
        else:
            part = tl.full([BM, BN], 0.0, tl.float32)
        for S in tl.static_range(P):
            if S % PPG == 0:  # first plane of a quantization group: its zero point and scale
                gi = g0 + S // PPG
                zf = tl.load(z_ptr + g_base + gi, mask=nmask, other=0).to(tl.float32)
                sc = tl.load(s_ptr + g_base + gi, mask=nmask, other=0.0).to(tl.float32)
                if SCALE_W:
                    sw = tl.broadcast_to(sc.to(CDT)[:, None], [BN, BKP])
            if FAST:
                if S // PW == 0:
                    src = qe
                elif S // PW == 1:
                    src = _asm_shr(qe, H1)
                elif S // PW == 2:
                    src = _asm_shr(qe, H2)
                else:
                    src = _asm_shr(qe, H3)
                # -(MAGIC * 2^-e + zero), e = the code's bit offset inside its window
                cz = tl.broadcast_to((-(MAGICF / (1 << ((S % PW) * BITS))) - zf).to(CDT)[:, None], [BN, BKP])
                if SCALE_W:
                    sarg = sw
                else:
                    sarg = cz
                if S == 0:
                    d = _asm_plane(src, cz, sarg, A00, SCALE_W, MAGIC)
                elif S == 1:
                    d = _asm_plane(src, cz, sarg, A01, SCALE_W, MAGIC)
                elif S == 2:
                    d = _asm_plane(src, cz, sarg, A02, SCALE_W, MAGIC)
                elif S == 3:
                    d = _asm_plane(src, cz, sarg, A03, SCALE_W, MAGIC)
                elif S == 4:
                    d = _asm_plane(src, cz, sarg, A04, SCALE_W, MAGIC)
                elif S == 5:
                    d = _asm_plane(src, cz, sarg, A05, SCALE_W, MAGIC)
                elif S == 6:
                    d = _asm_plane(src, cz, sarg, A06, SCALE_W, MAGIC)
                else:
                    d = _asm_plane(src, cz, sarg, A07, SCALE_W, MAGIC)
            else:
                code = (qe.to(tl.int32) >> (S * BITS)) & ((1 << BITS) - 1)
                if SCALE_W:
                    d = ((code.to(tl.float32) - zf[:, None]) * sc[:, None]).to(CDT)
                else:
                    d = (code.to(tl.float32) - zf[:, None]).to(CDT)
            xs = tl.load(x_rows + (k0 + S * BKP + offs_i)[None, :], mask=sel[:, None], other=0.0)
            if SCALE_W:
                acc = _mma(acc, xs, d, SWAP, DOT_PREC)
            else:
                part = _mma(part, xs, d, SWAP, DOT_PREC)
                if S % PPG == PPG - 1:  # last plane of the group: scale the group's product once
                    if SWAP:
                        acc += part * sc[:, None]
                        part = tl.full([BN, BM], 0.0, tl.float32)
                    else:
                        acc += part * sc[None, :]
                        part = tl.full([BM, BN], 0.0, tl.float32)
        kk += 1
        wrap = kk == nk
        kk = tl.where(wrap, 0, kk)
        t_seg = tl.where(wrap, t_seg + 1, t_seg)

    bad = valid & ((sd < -1) | (sd >= U))
    _epilogue(acc, rows, slot, valid, bad, offs_n, nmask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, stride_om,
              pid_n, pid_r, pid_s, n_rblocks, BM, SPLIT, SWAP, HAS_BIAS, ACCUM)


def planar_asm_args(bits: int, magic: int, scaled: bool) -> dict:
    """The constexpr PTX strings the planar kernel needs for ``bits`` and the activation kind."""
    table = _PLANE_ASM_S if scaled else _PLANE_ASM
    args = {}
    plan = planar_plan(bits, magic) if magic in (1, 2) and _MANT_BITS[magic] >= bits else []
    for s in range(8):
        key = (magic, bits, plan[s][2]) if s < len(plan) else None
        args[f"A0{s}"] = table.get(key, "trap;")
    pw = planar_window(bits, magic) if magic in (1, 2) else 1
    for w in (1, 2, 3):
        args[f"H{w}"] = _SHR_ASM.get(w * pw * bits, "trap;")
    args["PW"] = pw
    args["MAGICF"] = _PTX_MAGICF.get(magic, 1.0)
    return args


@triton.jit
def planar_dequant_kernel(
    q_ptr, s_ptr, z_ptr, sel_ptr, lut_ptr, out_ptr,
    N, K, QROW_E, G, GS, Q_STRIDE, S_STRIDE, Z_STRIDE,
    BITS: tl.constexpr, BKP: tl.constexpr, BN: tl.constexpr, SEL: tl.constexpr,
):
    """Deltas of a planar stack as dense ``[N, K]`` matrices: ``(code - zero) * scale``.

    Program ``(n-tile, planar block j, u)``: loads the block's ``BN x BKP`` 16-bit elements of the ``u``-th
    delta asked for once and writes each of its ``P`` planes (inputs ``j*P*BKP + S*BKP + i``) with that plane's
    group (planes never straddle a group: the planar layout requires it) into ``out[u]``. ``GS``: the group size
    (``K`` for one group per row). Which delta is the ``u``-th: ``SEL = 0``, the one the pointers point at
    (``u`` is 0); ``1``, stack index ``sel[u]``; ``2``, slot ``sel[u]``, whose stack index is ``lut[slot + 1]``.
    ``*_STRIDE``: elements from one delta to the next (codes in 16-bit elements).
    """
    P: tl.constexpr = 16 // BITS
    pid_n = tl.program_id(0)
    j = tl.program_id(1)
    u = tl.program_id(2)
    if SEL == 0:
        d = u.to(tl.int64) * 0
    elif SEL == 1:
        d = tl.load(sel_ptr + u).to(tl.int64)
    else:
        d = tl.load(lut_ptr + tl.load(sel_ptr + u) + 1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    offs_i = tl.arange(0, BKP)
    qe_ptr = q_ptr.to(tl.pointer_type(tl.uint16)) + d * Q_STRIDE
    zd_ptr = z_ptr + d * Z_STRIDE
    sd_ptr = s_ptr + d * S_STRIDE
    od_ptr = out_ptr + u.to(tl.int64) * N * K
    qe = tl.load(qe_ptr + offs_n64[:, None] * QROW_E + (j * BKP + offs_i)[None, :], mask=nmask[:, None], other=0)
    q32 = qe.to(tl.int32)
    for S in tl.static_range(P):
        k0 = j * (P * BKP) + S * BKP
        gi = k0 // GS
        zf = tl.load(zd_ptr + offs_n64 * G + gi, mask=nmask, other=0).to(tl.float32)
        sc = tl.load(sd_ptr + offs_n64 * G + gi, mask=nmask, other=0.0).to(tl.float32)
        code = (q32 >> (S * BITS)) & ((1 << BITS) - 1)
        dq = (code.to(tl.float32) - zf[:, None]) * sc[:, None]
        tl.store(od_ptr + offs_n64[:, None] * K + (k0 + offs_i)[None, :], dq.to(od_ptr.dtype.element_ty),
                 mask=nmask[:, None])
