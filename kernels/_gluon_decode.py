"""Gluon kernel (Hopper, sm_90): the deltas of a decode step, added to what the output already holds.

The ``accumulate=True`` launch of :func:`kernels.multi_delta.multi_delta_linear` for decode steps
(:attr:`~kernels.multi_delta.MultiDeltaConfig.backend`): the base's product is already in ``out``
(one dense matmul), and this kernel adds each row's delta. Work items are (row block, output tile,
K chunk): a row block is up to ``BR`` rows of one delta, taken from the step's segment table
(``kernels.layout.build_row_segments``) on the device; a fixed grid of programs loops over the items,
so a captured CUDA graph serves every mix, and K is split as the step's mix needs (the split whose
rounds of items the programs finish soonest). Every program packs the step's row blocks (first row, rows,
delta) into one int32 each, held across the lanes of each warp, so an item finds its block with one reduction
inside a warp. Per item:

* the zero points and scales of the item's K range are read once into shared memory; unsplit, what the
  item's output rows hold is copied into shared memory with the first k-step (``cp.async``), so its latency
  hides behind the k-loop;
* a ring of ``STAGES`` shared-memory buffers, filled with ``cp.async`` ``STAGES - 1`` k-steps ahead,
  holds each k-step's packed codes ``[BN, BKP]`` (the planar layout, ``kernels/layout.py``) and the
  block's rows of ``x`` cut into planes ``[P * BR, BKP]``;
* the codes are read into registers in the wgmma A-operand layout, each plane is decoded there
  (``lop3`` + packed ``fma``: the planar Triton kernel's PTX; the ``fma``'s ``-(magic + zero)`` is built from
  the zero point's bits with one integer multiply-add) and multiplied by its slice of ``x``
  with an asynchronous wgmma; a group's decode overlaps the previous group's MMAs
  (``warpgroup_mma_wait`` keeps one group in flight), which plain Triton does not allow for a
  register A operand; each quantization group's product lands in one of two alternating
  accumulators and is scaled into the result once its MMAs are done;
* one K chunk: the item adds its product to the output rows it owns; several: float32 partial sums,
  and the last item of the (block, tile) adds them in split order (deterministic) and resets its
  counter for the next launch.

Gluon kernels do not run under the Triton interpreter: on the CPU the planar Triton kernel (tested
there) does this work; this one is tested on an sm_90 GPU (``tests/test_gluon_decode.py``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait


@gluon.jit
def _plane(q, cz, ASM: gl.constexpr, CDT: gl.constexpr):
    return gl.inline_asm_elementwise(ASM, "=r,r,r", [q, cz], dtype=cz.dtype, is_pure=True, pack=2)


@gluon.jit
def _shr(q, ASM: gl.constexpr):
    return gl.inline_asm_elementwise(ASM, "=r,r", [q], dtype=gl.uint16, is_pure=True, pack=2)


@gluon.jit
def _issue(x_ptr, q_ptr, xs, qs, stage, x_rows, x_cols, x_mask, q_off, offs_e, k0,
           P: gl.constexpr, BKP: gl.constexpr):
    # codes of this k-step: [BN, BKP] uint16 elements; x: [P * BR, BKP], row p*BR + r = row r's inputs
    # k0 + p*BKP + i (plane p)
    k0 = gl.multiple_of(k0, P * BKP)
    e_idx = (k0 // (P * BKP)) * BKP + offs_e
    async_copy.async_copy_global_to_shared(qs.index(stage), q_ptr + q_off + e_idx[None, :])
    async_copy.async_copy_global_to_shared(xs.index(stage), x_ptr + x_rows + (k0 + x_cols), mask=x_mask)
    async_copy.commit_group()


@gluon.jit
def _decode_plane(q, zi, S: gl.constexpr, BITS: gl.constexpr, PW: gl.constexpr, MAGICF: gl.constexpr,
                  CDT: gl.constexpr, A0: gl.constexpr, A1: gl.constexpr, A2: gl.constexpr, A3: gl.constexpr,
                  A4: gl.constexpr, A5: gl.constexpr, A6: gl.constexpr, A7: gl.constexpr,
                  H1: gl.constexpr, H2: gl.constexpr, H3: gl.constexpr):
    # plane S of the packed elements q: code - zero in the activation dtype (the planar kernel's PTX), given
    # -(MAGICF * 2^-E + zero) with E = (S % PW) * BITS. That value is built from its bits, not converted:
    # MAGICF * 2^-E is a power of two 2^(MANT - E) whose mantissa bit E is worth 1, so for a zero point below
    # 2^(MANT - E) (every zero point of a BITS-bit grid, [0, 2^BITS - 1], since E <= MANT - BITS) the sum is
    # the sign, the exponent of 2^(MANT - E), and the zero point shifted up by E in the mantissa: one integer
    # multiply-add per zero point (the bits do not overlap), where a conversion, a subtraction and a rounding stood
    E: gl.constexpr = (S % PW) * BITS
    if MAGICF == 1024.0:  # float16: 10 mantissa bits, exponent bias 15
        CB: gl.constexpr = 0x8000 | ((15 + 10 - E) << 10)
    else:  # bfloat16: 7 mantissa bits, exponent bias 127
        CB: gl.constexpr = 0x8000 | ((127 + 7 - E) << 7)
    czc = (zi * (1 << E) + CB).to(gl.int16).to(CDT, bitcast=True)
    cz, q = gl.broadcast(czc[:, None], q)
    if S // PW == 0:
        src = q
    elif S // PW == 1:
        src = _shr(q, H1)
    elif S // PW == 2:
        src = _shr(q, H2)
    else:
        src = _shr(q, H3)
    if S == 0:
        d = _plane(src, cz, A0, CDT)
    elif S == 1:
        d = _plane(src, cz, A1, CDT)
    elif S == 2:
        d = _plane(src, cz, A2, CDT)
    elif S == 3:
        d = _plane(src, cz, A3, CDT)
    elif S == 4:
        d = _plane(src, cz, A4, CDT)
    elif S == 5:
        d = _plane(src, cz, A5, CDT)
    elif S == 6:
        d = _plane(src, cz, A6, CDT)
    else:
        d = _plane(src, cz, A7, CDT)
    return d


# M, U and the split limits change between calls, and a value of 1 would otherwise be specialised away
@gluon.jit(do_not_specialize=["M", "U", "SPLIT_MAX", "TARGET"])
def gluon_delta_decode_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, seg_ptr, lut_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, U, QROW_E, G, stride_xm, stride_om, SPLIT_MAX, TARGET,
    HAS_LUT: gl.constexpr, OUT_ASYNC: gl.constexpr, BITS: gl.constexpr, BKP: gl.constexpr, BR: gl.constexpr,
    MP: gl.constexpr,
    STAGES: gl.constexpr, PPG: gl.constexpr, MAGICF: gl.constexpr, PW: gl.constexpr, GC: gl.constexpr,
    BN: gl.constexpr, SPLIT_RULE: gl.constexpr,
    A0: gl.constexpr, A1: gl.constexpr, A2: gl.constexpr, A3: gl.constexpr,
    A4: gl.constexpr, A5: gl.constexpr, A6: gl.constexpr, A7: gl.constexpr,
    H1: gl.constexpr, H2: gl.constexpr, H3: gl.constexpr,
    num_warps: gl.constexpr,
):
    CDT: gl.constexpr = x_ptr.dtype.element_ty
    SDT: gl.constexpr = s_ptr.dtype.element_ty
    P: gl.constexpr = 16 // BITS
    LB: gl.constexpr = P * BKP
    NG: gl.constexpr = P // PPG  # quantization groups per k-step
    ITEM_COST: gl.constexpr = 8  # an item's start and finish, in k-steps (the K split's cost model)
    SPLIT_COST: gl.constexpr = 8  # what a split item adds: its float32 partial sums out, the last one's back in

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BR, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_a: gl.constexpr = gl.SliceLayout(1, a_l)
    row_c: gl.constexpr = gl.SliceLayout(1, mma)
    col_c: gl.constexpr = gl.SliceLayout(0, mma)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    o_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])  # [BR, BN] output rows, 8 bytes a copy
    g_l: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, num_warps], [0, 1])
    sq_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    sv_l: gl.constexpr = gl.SliceLayout(1, sq_l)  # one entry per sorted slot
    st_l: gl.constexpr = gl.SliceLayout(0, sq_l)
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    xs = gl.allocate_shared_memory(CDT, [STAGES, P * BR, BKP], sl)
    qs = gl.allocate_shared_memory(gl.uint16, [STAGES, BN, BKP], sl)
    zs = gl.allocate_shared_memory(gl.uint8, [GC, BN], flat)  # an item's zero points and scales, group-major
    ss = gl.allocate_shared_memory(SDT, [GC, BN], flat)
    ODT: gl.constexpr = out_ptr.dtype.element_ty
    os_ = gl.allocate_shared_memory(ODT, [BR, BN], flat)  # what the item's output rows hold before it adds
    zsv = zs._reinterpret(gl.uint8, [GC, BN], flat1)
    ssv = ss._reinterpret(SDT, [GC, BN], flat1)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_tiles = (N + BN - 1) // BN
    nk_all = (K + LB - 1) // LB

    # ---------------------------------------------------------------- row blocks of this step
    # Sorted slots of the segment table; a block is up to BR consecutive slots of one segment whose delta
    # is in this stack. Every program derives the same list.
    offs_s = gl.arange(0, MP, layout=sv_l)
    offs_t = gl.arange(0, MP, layout=st_l)
    ok_s = offs_s < M
    d_s = gl.load(seg_ptr + M + offs_s, mask=ok_s, other=-1)
    sg_s = gl.load(seg_ptr + 2 * M + offs_s, mask=ok_s, other=-1)
    sg_t = gl.load(seg_ptr + 2 * M + offs_t, mask=offs_t < M, other=-2)
    if HAS_LUT:  # the table holds slot ids: this stack's index of each is lut[slot + 1] (-1: not in this stack)
        d_s = gl.load(lut_ptr + d_s + 1, mask=ok_s, other=-1)
    live = ok_s & (d_s >= 0) & (d_s < U)
    before = offs_t[None, :] < offs_s[:, None]
    # the slots of its segment before it (its place inside the segment) and from it on, in one reduction
    both = gl.sum(gl.where(sg_t[None, :] == sg_s[:, None], gl.where(before, 1, 65536), 0), axis=1)
    pos = both & 65535
    is_start = live & ((pos % BR) == 0)
    start_t = gl.convert_layout(is_start, st_l)
    rank = gl.sum((start_t[None, :] & before).to(gl.int32), axis=1)
    # what an item needs of its block, packed into one int32 per starting slot: the first slot (10 bits), the
    # rows (7 bits: up to BR from there, to the segment's end) and the delta's index in the stack (the rest);
    # held along the lanes of every warp (two slots per thread), so an item finds its block with one reduction
    # inside each warp, where four reductions across the warps (each through shared memory and a barrier) stood
    info_s = (d_s << 17) | (gl.minimum(both >> 16, BR) << 10) | offs_s
    info_t = gl.convert_layout(gl.where(is_start, info_s, 0), st_l)
    rank_t = gl.convert_layout(rank, st_l)
    n_blocks = gl.sum(start_t.to(gl.int32), axis=0)

    # the K split follows the step's mix, in whole k-steps
    work = gl.maximum(n_tiles * n_blocks, 1)
    if SPLIT_RULE == 0:
        # the split whose items the programs finish soonest: each program takes every nprog-th item, so
        # the step lasts (rounds of items) x (k-steps per item + ITEM_COST, what starting and finishing an
        # item costs in k-steps: its first loads wait out the memory latency, and so does its output);
        # measured on an H100, an item costs about eight k-steps beside its own, so K is split only where
        # the step has far fewer items than programs (BENCHMARKS.md section 3); a split item costs SPLIT_COST
        # more (without it, 4-bit 4096x14336 at 1.3 items per program took two chunks and ran 19 % slower)
        steps = nk_all
        split = nk_all * 0 + 1
        best = ((work + nprog - 1) // nprog) * (nk_all + ITEM_COST)
        for s in range(2, gl.minimum(SPLIT_MAX, nk_all) + 1):
            st = (nk_all + s - 1) // s
            sp = (nk_all + st - 1) // st
            cost = ((work * sp + nprog - 1) // nprog) * (st + ITEM_COST + SPLIT_COST)
            if cost < best:  # ties keep the smaller split (fewer partial sums)
                best = cost
                steps = st
                split = sp
    elif SPLIT_RULE == 1:  # the first rule: about TARGET work items in all
        want = gl.minimum(gl.maximum((TARGET + work - 1) // work, 1), SPLIT_MAX)
        steps = (nk_all + want - 1) // want
        split = (nk_all + steps - 1) // steps
    else:  # SPLIT_MAX chunks (fewer where K has fewer k-steps)
        steps = (nk_all + SPLIT_MAX - 1) // SPLIT_MAX
        split = (nk_all + steps - 1) // steps
    total = n_blocks * n_tiles * split

    offs_e = gl.arange(0, BKP, layout=gl.SliceLayout(0, ld_l))
    offs_xr = gl.arange(0, P * BR, layout=gl.SliceLayout(1, ld_l))  # plane p, row r: p * BR + r
    x_cols = ((offs_xr // BR) * BKP)[:, None] + offs_e[None, :]
    offs_rc = gl.arange(0, BR, layout=col_c)
    offs_gg = gl.arange(0, GC, layout=gl.SliceLayout(1, g_l))

    for w in range(pid, total, nprog):
        pid_s = w % split
        t = w // split
        pid_n = t % n_tiles
        b = t // n_tiles
        info = gl.sum(gl.where(start_t & (rank_t == b), info_t, 0), axis=0)  # block b's first slot is its only one
        bstart = info & 1023
        cnt = (info >> 10) & 127
        u = info >> 17
        k_begin = pid_s * steps * LB
        k_end = gl.minimum(k_begin + steps * LB, K)
        nk = (k_end - k_begin + LB - 1) // LB
        u64 = u.to(gl.int64) * N
        # zero points and scales of every group of this item's K range: their loads go out first, so their latency
        # overlaps the row table's and the copies' (stored into shared memory once the last item is done with it)
        offs_gn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, g_l))
        gch0 = k_begin // (PPG * BKP)
        g_ok = (offs_gg < steps * NG) & ((gch0 + offs_gg) < G)
        g_off = (u64 + gl.minimum(offs_gn, N - 1).to(gl.int64))[None, :] * G + (gch0 + offs_gg)[:, None]
        zv = gl.load(z_ptr + g_off, mask=g_ok[:, None], other=0)
        sv = gl.load(s_ptr + g_off, mask=g_ok[:, None], other=0.0)

        offs_n_q = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld_l))
        q_off = (u64 + gl.minimum(offs_n_q, N - 1).to(gl.int64))[:, None] * QROW_E
        offs_n_c = pid_n * BN + gl.arange(0, BN, layout=row_c)
        nmask_c = offs_n_c < N

        xr_ok = (offs_xr % BR) < cnt
        xr = gl.load(seg_ptr + bstart + offs_xr % BR, mask=xr_ok, other=0)
        x_rows = (xr.to(gl.int64) * stride_xm)[:, None]
        x_mask, _unused = gl.broadcast(xr_ok[:, None], x_cols)

        # the output rows this item adds to (only this item writes them)
        r_ok = offs_rc < cnt
        rows_c = gl.load(seg_ptr + bstart + offs_rc, mask=r_ok, other=0)
        o_off = rows_c.to(gl.int64)[None, :] * stride_om + offs_n_c.to(gl.int64)[:, None]
        o_mask = nmask_c[:, None] & r_ok[None, :]

        gl.thread_barrier()  # the last item's reads of shared memory are done
        if not OUT_ASYNC:  # output rows not 16-byte aligned: read into registers now, added after the k-loop
            prev = gl.load(out_ptr + o_off, mask=o_mask & (split == 1), other=0.0).to(gl.float32)
        elif split == 1:
            # unsplit, what the rows hold is copied into shared memory in the first k-step's commit group: its
            # latency hides behind the k-loop and no registers hold it meanwhile (read into registers here, it
            # was spilled under the register cap, and the spill waited out the load)
            offs_or = gl.arange(0, BR, layout=gl.SliceLayout(1, o_l))
            offs_on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, o_l))
            or_ok = offs_or < cnt
            rows_o = gl.load(seg_ptr + bstart + offs_or, mask=or_ok, other=0)
            async_copy.async_copy_global_to_shared(
                os_, out_ptr + rows_o.to(gl.int64)[:, None] * stride_om + offs_on[None, :],
                mask=or_ok[:, None] & (offs_on < N)[None, :])
        for j in gl.static_range(STAGES - 1):  # prologue: STAGES - 1 k-steps in flight
            if j < nk:
                _issue(x_ptr, q_ptr, xs, qs, j, x_rows, x_cols, x_mask, q_off, offs_e, k_begin + j * LB, P, BKP)
            else:
                async_copy.commit_group()
        zs.store(zv)
        ss.store(sv)

        acc = gl.zeros([BN, BR], gl.float32, mma)
        pa = gl.zeros([BN, BR], gl.float32, mma)
        pb = gl.zeros([BN, BR], gl.float32, mma)
        for kk in range(0, nk):
            stage = kk % STAGES
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()  # every thread's copies landed; every MMA of the last k-step is done
            fence_async_shared()
            nxt = kk + STAGES - 1
            if nxt < nk:  # refill the stage the last k-step used
                _issue(x_ptr, q_ptr, xs, qs, nxt % STAGES, x_rows, x_cols, x_mask, q_off, offs_e,
                       k_begin + nxt * LB, P, BKP)
            else:
                async_copy.commit_group()
            q = qs.index(stage).load(a_l)
            xst = xs.index(stage)
            g0 = kk * NG
            for S in gl.static_range(P):
                if S % PPG == 0:  # first plane of a quantization group: its zero point and scale
                    zi = zsv.index(g0 + S // PPG).load(row_a).to(gl.int32)
                    sc = ssv.index(g0 + S // PPG).load(row_c).to(gl.float32)
                d = _decode_plane(q, zi, S, BITS, PW, MAGICF, CDT, A0, A1, A2, A3, A4, A5, A6, A7, H1, H2, H3)
                xb = xst.slice(S * BR, BR).permute((1, 0))
                # a group's planes accumulate in one of two alternating products, scaled into acc once the
                # group's MMAs are done: the next group's decode overlaps them
                if (S // PPG) % 2 == 0:
                    pa = warpgroup_mma(d, xb, pa, use_acc=S % PPG > 0, is_async=True)
                else:
                    pb = warpgroup_mma(d, xb, pb, use_acc=S % PPG > 0, is_async=True)
                if S % PPG == PPG - 1:
                    if (S // PPG) % 2 == 0:
                        pa, pb = warpgroup_mma_wait(num_outstanding=PPG, deps=(pa, pb))
                        if S >= PPG:
                            acc += pb * sc_prev[:, None]
                    else:
                        pb, pa = warpgroup_mma_wait(num_outstanding=PPG, deps=(pb, pa))
                        acc += pa * sc_prev[:, None]
                    sc_prev = sc
            if (NG - 1) % 2 == 0:
                pa, pb = warpgroup_mma_wait(num_outstanding=0, deps=(pa, pb))
                acc += pa * sc_prev[:, None]
            else:
                pb, pa = warpgroup_mma_wait(num_outstanding=0, deps=(pb, pa))
                acc += pb * sc_prev[:, None]
        async_copy.wait_group(0)

        # ---------------------------------------------------------- add into the output
        if split == 1:  # what the output held landed in shared memory before the first k-step (or in registers)
            if OUT_ASYNC:
                prev = os_.permute((1, 0)).load(mma).to(gl.float32)
            gl.store(out_ptr + o_off, (prev + acc).to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            # partial sums by row; the last item of this (block, tile) adds them up in split order
            # (deterministic), adds them to the output and resets the counter for the next launch
            w_off = rows_c.to(gl.int64)[None, :] * N + offs_n_c.to(gl.int64)[:, None]
            split_stride = M.to(gl.int64) * N
            gl.store(ws_ptr + pid_s * split_stride + w_off, acc, mask=o_mask)
            gl.thread_barrier()
            tile = b * n_tiles + pid_n
            arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split - 1:
                res = gl.load(out_ptr + o_off, mask=o_mask, other=0.0).to(gl.float32)
                for sp in range(0, split):
                    res += gl.load(ws_ptr + sp * split_stride + w_off, mask=o_mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=o_mask)
                gl.atomic_xchg(cnt_ptr + tile, 0)

    # rows whose delta id is out of range (no lookup table) come out NaN, as from the other kernels
    if not HAS_LUT:
        if pid == 0:
            bad = ok_s & ((d_s < -1) | (d_s >= U))
            n_bad = gl.sum(bad.to(gl.int32), axis=0)
            if n_bad > 0:
                rows_all = gl.load(seg_ptr + offs_s, mask=ok_s, other=0)
                for n0 in range(0, N, MP):
                    nn = n0 + offs_t
                    bp = out_ptr + rows_all.to(gl.int64)[:, None] * stride_om + nn[None, :]
                    gl.store(bp, gl.full([MP, MP], float("nan"), gl.float32, sq_l).to(out_ptr.dtype.element_ty),
                             mask=bad[:, None] & (nn < N)[None, :])


# ------------------------------------------------------------------------------------------------ host side
_SPLIT_RULES = ("rounds", "target", "fixed")


def gluon_delta_accumulate(x, stack, segments, out, *, lut=None, split_max=None, target=None, num_warps=4,
                           block_rows=8, stages=None, block_n=64, max_registers=None, split_rule="rounds"):
    """``out[m] += x[m] @ dequant(stack[delta of m])^T`` for a planar stack (bf16/fp16 ``x``, sm_90 GPU).

    ``segments``: :func:`kernels.layout.build_row_segments` of the rows' deltas (``lut``: of their slot
    ids, a row's stack index being ``lut[slot + 1]``). ``target`` programs loop over the work items
    (default: as many as the SMs hold at once, from the registers and shared memory the kernel compiled
    to; two per SM for 2-bit codes in bf16, three for 4-bit, on an H100); K is split as the step's mix
    needs, into at most ``split_max`` chunks per row block and output tile: ``split_rule="rounds"``
    (default) takes the split the programs finish soonest (rounds of items times k-steps per item).
    ``"target"`` is the first launch, kept for comparison: three programs per SM whatever they hold,
    K split for about ``target`` items in all; ``"fixed"``: ``split_max`` chunks (for measuring). The
    other arguments are launch parameters; the defaults are what was measured (BENCHMARKS.md section 3):
    for 2-bit codes three stages and at most 168 registers per thread (``max_registers=0``: no cap), so
    that an SM holds three programs instead of two; for 4-bit codes four stages, no cap. Rows whose delta
    id is out of range (without ``lut``) come out NaN. Zero points must lie on the grid, ``[0, 2**bits - 1]``
    (what the compressor writes, and all that ``DeltaModel`` accepts: adding or loading a delta refuses others;
    the kernel builds ``-(magic + zero)`` from its bits).
    """
    import torch

    from ._multi_delta_triton import planar_asm_args
    from .launch import semaphores, sm_count

    m, k = x.shape
    n = stack.out_features
    bits, bkp = stack.bits, stack.layout_block
    if split_rule not in _SPLIT_RULES:
        raise ValueError(f'split_rule must be "rounds", "target" or "fixed", got {split_rule!r}')
    if bkp != 64 or bits not in (2, 4):
        raise ValueError("the Gluon decode kernel needs a planar stack (blocks of 64) of 2- or 4-bit codes")
    if stack.num_deltas >= 1 << 14 or m > 1024 or not 1 <= block_rows <= 64:
        # an item's block is packed into one int32: its first row (10 bits), rows (7) and delta (14)
        raise ValueError(f"the Gluon decode kernel takes up to 1024 rows, 16383 deltas and row blocks of up to 64 "
                         f"rows; got {m} rows, {stack.num_deltas} deltas, blocks of {block_rows}: split the call")
    if stages is None:
        stages = 3 if bits == 2 else 4
    if max_registers is None:
        max_registers = 168 if bits == 2 else 0
    gs = k if stack.group_size == -1 else stack.group_size
    magic = 1 if x.dtype == torch.float16 else 2
    asm = planar_asm_args(bits, magic, False)
    lb = (16 // bits) * bkp
    nk = (k + lb - 1) // lb
    if split_max is None:
        split_max = min(nk, 16)
    bn = block_n
    n_tiles = (n + bn - 1) // bn
    gc = 1 << max(0, (nk * lb // gs - 1).bit_length())  # groups of the largest K chunk (split 1)
    mp = 1 << max(5, (m - 1).bit_length())
    ws = torch.empty((split_max, m, n), dtype=torch.float32, device=x.device) if split_max > 1 else out
    cnt = semaphores(x.device, n_tiles * m)  # the split-K counters the Triton kernels share (each reset to 0)
    args = (x, stack.qweight.view(torch.uint16), stack.scales, stack.zeros, segments,
            segments if lut is None else lut, out, ws, cnt,
            m, n, k, stack.num_deltas, stack.qweight.shape[-1] // 2, stack.scales.shape[-1], x.stride(0),
            out.stride(0), split_max, 0)
    # what the output rows hold is copied 8 bytes at a time where Triton sees them 16-byte aligned
    out_async = out.stride(0) % 16 == 0 and out.data_ptr() % 16 == 0
    kw = dict(HAS_LUT=lut is not None, OUT_ASYNC=out_async, BITS=bits, BKP=bkp, BR=block_rows, MP=mp, STAGES=stages, PPG=gs // bkp,
              MAGICF=asm["MAGICF"], PW=asm["PW"], GC=gc, BN=bn, SPLIT_RULE=_SPLIT_RULES.index(split_rule),
              A0=asm["A00"], A1=asm["A01"], A2=asm["A02"], A3=asm["A03"], A4=asm["A04"], A5=asm["A05"],
              A6=asm["A06"], A7=asm["A07"], H1=asm["H1"], H2=asm["H2"], H3=asm["H3"], num_warps=num_warps,
              **({"maxnreg": max_registers} if max_registers else {}))
    if target is None:  # persistent programs: as many as the SMs hold at once (the first rule: three per SM)
        per_sm = 3 if split_rule == "target" else _resident_programs(args, kw, x, out, lut)
        target = per_sm * sm_count(x.device)
    args = args[:-1] + (target,)
    # never more programs than the largest step can use
    gluon_delta_decode_kernel[(max(1, min(target, n_tiles * m * split_max)),)](*args, **kw)
    return out


_RESIDENT: dict = {}


def _resident_programs(args, kw, x, out, lut) -> int:
    """Programs of this launch's compiled kernel that one SM holds at once (cached per device, dtypes and
    constexpr arguments; compiling it if need be, without a launch)."""
    import torch

    from .launch import blocks_per_sm

    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (dev, x.dtype, args[2].dtype, args[3].dtype, out.dtype, lut is None, tuple(sorted(kw.items())))
    n = _RESIDENT.get(key)
    if n is None:
        ck = gluon_delta_decode_kernel.warmup(*args, grid=(1,), **kw)
        try:
            ck.run  # noqa: B018 - loading the launcher fills in the registers the kernel compiled to
            props = torch.cuda.get_device_properties(dev)
            n = blocks_per_sm(ck.n_regs, ck.metadata.shared, kw["num_warps"],
                              regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                              shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472))
        except (AttributeError, TypeError):  # another Triton's compiled-kernel object: Hopper's usual two
            n = 2
        n = _RESIDENT[key] = max(1, n)
    return n
