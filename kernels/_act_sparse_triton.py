"""Triton kernels of :mod:`kernels.act_sparse` (imported lazily: needs triton).

Both kernels read weights in the *input-major* layout, one contiguous row of outputs per input
``k``: the base weight as ``W^T [K, N]`` and a delta as its codes ``[K, ceil(N*b/8)]`` packed along
the outputs with group scales and zero points ``[G, N]``.

**One tile per program, split over K, finished by the last program.** Program ``(n-tile, k-tile,
r)`` reads one ``[BK, BN]`` weight tile: it loads its rows' inputs of the k-tile first and masks the
tile's load by "some row keeps this input", so the lines of dropped inputs are never requested from
memory. A tile whose inputs are all dropped loads nothing. There is no loop over K: a decode-sized
launch then has thousands of independent tiles in flight (what hides memory latency when the
addresses of a load depend on the load before it), and the bytes read follow the kept inputs.

The tiles' partial sums go into a float32 workspace ``[M, N]`` with atomic adds. Each program then
counts itself in on a per-(n-tile, r) counter; the program that brings the count to the number of
k-tiles reads the sums back with atomic exchanges on the workspace's int32 view (which also zero
them), adds the bias or the
output already there, stores the output in its dtype and resets the counter. One launch per layer:
no memset and no reduction kernel, and the workspace and counters are left zero for the next call
(the launcher keeps them per shape). Launches that share a workspace must run one after another
(one stream). The base GEMV's default instead leaves the sums to ``finish_rows_kernel``, launched
right after it (no counters; slightly faster on the H200). Workspace sums are only ever read back
with atomics: plain loads in the next kernel were seen to miss some of the atomic adds.

``PDL`` (Hopper): the launch may begin before the kernel before it has ended; every program waits
for it (``gdc_wait``) before its first memory access, and with ``PDL == 2`` lets the next launch
begin in turn. (One exception: ``finish_rows_kernel`` reads the low-rank compensation's ``B`` and
``z`` before it waits; ``B`` is constant and ``z`` was written two launches back, by a kernel that had
ended before the sums' kernel could let this one begin.)

**Low-rank compensation** (``LR``, the base GEMV): ``y += B (A x_dropped)``. The list-packing launch
has extra programs, one per chunk of 16-128 inputs, that write their chunk's share of ``z = A
x_dropped`` (rank-sized, no atomics); the finishing launch sums the shares and adds ``B z`` per
output, choosing the weight's slice of ``z`` in a grouped launch. ``NG`` (base kernel): up to three weights sharing ``x`` (q/k/v, gate/up), their
output tiles one after another along program axis 0, in one launch.

``sparse_base_kernel``: ``r`` is a block of ``BM`` rows of ``x``.
``sparse_delta_kernel``: ``r`` is a segment of the step's row-segment table
(:func:`kernels.layout.build_row_segments`: rows sorted by delta); its rows are added into ``out``.

``GEMV`` (``BM == 1``): one row's ``[BK]`` inputs times the ``[BK, BN]`` tile, a multiply and a sum
over the k-tile, no MMA; in the delta kernel each row of a segment then reads the tile itself (a
segment of one row is what a mixed batch of distinct deltas has). Otherwise ``tl.dot`` on
``BM >= 16`` rows (one row padded to 16 too). ``WORDS`` (delta GEMV): packed code rows are whole
int32 words, read as words (vector loads) and taken apart in registers; code ``j`` of word ``w`` is
output ``w * (32 / BITS) + j``, so each ``j`` is a strided slice of the tile's outputs. (Words
through ``tl.dot``, eight small MMAs per tile, were measured and dropped: 1.3-6x slower than the GEMV.)

``BKI < BK`` (delta GEMV on words, tile inside one group): the tile is walked in ``[BKI]``-input steps,
each step's codes taken apart as ``[BKI, word, slot]`` and summed over inputs inside each lane; the sum
across lanes happens once per tile instead of once per slot (measured 1.8x faster on the H200). The same
walk for the base GEMV was slower than one step (its loads are no longer all in flight at once) and is
not offered. The compacted walk (``COMPACT``) instead adds each step's sum over its inputs into a
``[word, slot]`` accumulator: fewer registers, so more programs per SM, which paid once the codes were
taken apart with one shift per word instead of one per code (``_codes_f32``; BENCHMARKS.md section 8).

``BLOCK_GROUP`` (delta kernel): the k-tile lies in one quantization group, so the tile reads one scale
row and one zero row and computes ``s * (x.codes - z * sum(x))``; otherwise every element is
dequantized with its own group's scale.

``THRESH``: inputs with ``|x| <= thr`` count as zero (the thresholding fused into the kernel);
without it only exact zeros are skipped.

**Compacted inputs** (``COMPACT``). ``compact_inputs_kernel`` writes, per row and per segment of
``SEG`` inputs, the indices and values of the kept inputs packed to the front of the segment's span,
and their count. The delta GEMV walks its tile's list (``SEG = BK``, one quantization group) in
``BKI`` steps, so its work is ``ceil(kept / BKI)`` steps instead of ``BK / BKI``, each step issuing
the next one's loads first. The base GEMV can read the lists of segments of ``SEG >= 1024`` inputs
in chunks of ``BK`` (program ``(n-tile, segment, chunk)`` gathers the weight rows of ``BK`` kept
inputs; a chunk past its segment's count does nothing); on the H200 that was slower than the
masked tile (the gather waits on the index load), so it is not the default.
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper and later; triton >= 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: the launcher never sets PDL
    gdc_launch_dependents = gdc_wait = None


# Only core builtins and this module's own jit functions are used (no tl.max from triton's standard
# library): the launcher can then reload this module to switch between compiled and interpreted mode.
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _any(flags, axis: tl.constexpr):
    # any(flags) along ``axis`` of an int1 tensor, as int1
    return tl.reduce(flags.to(tl.int32), axis, _maximum) > 0


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    # launched early (PDL > 0): wait for the kernels before this one (its inputs, the workspaces) before
    # any memory access; PDL == 2: and let the next launch begin as this one's last programs run
    if PDL > 0:
        gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()


@triton.jit
def _kept_inputs(x_rows, row_ok, cols, kmask, thr, THRESH: tl.constexpr):
    # x tile [BM, BK] with dropped inputs zeroed, and whether any row keeps each input [BK]
    xt = tl.load(x_rows[:, None] + cols[None, :], mask=row_ok[:, None] & kmask[None, :], other=0.0)
    if THRESH:
        keep = tl.abs(xt.to(tl.float32)) > thr
        xt = tl.where(keep, xt, 0.0)
    else:
        keep = xt != 0.0
    return xt, _any(keep, 0)


@triton.jit
def _count_in(cnt_ptr):
    # count this program in; True for the last one (all threads' workspace adds are issued before)
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _finish_rows(wsi_ptr, out_ptr, rows, row_ok, N, stride_om, offs_n, nmask, bias_ptr,
                 HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr):
    # read the rows' sums back from the workspace (zeroing it) and write them out
    omask = row_ok[:, None] & nmask[None, :]
    # through the workspace's int32 view (float32 bits): the interpreter exchanges integers only
    w_ptrs = wsi_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    bits = tl.atomic_xchg(w_ptrs, tl.where(omask, 0, 0), mask=omask, sem="acq_rel", scope="gpu")
    acc = tl.where(omask, bits.to(tl.float32, bitcast=True), 0.0)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=omask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _kept_input_row(x_row, cols, kmask, thr, THRESH: tl.constexpr):
    # one row's inputs [BK] with dropped ones zeroed, and which are kept
    xv = tl.load(x_row + cols, mask=kmask, other=0.0)
    if THRESH:
        keep = tl.abs(xv.to(tl.float32)) > thr
        xv = tl.where(keep, xv, 0.0)
    else:
        keep = xv != 0.0
    return xv, keep


@triton.jit(do_not_specialize=["K"])
def compact_inputs_kernel(x_ptr, idx_ptr, xv_ptr, cnt_ptr, thr, K, stride_xm,
                          SEG: tl.constexpr, THRESH: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = 0,
                          at_ptr=None, zp_ptr=None, RT=0, NL=0, NLR=0, LR: tl.constexpr = False,
                          RP: tl.constexpr = 16, LCH: tl.constexpr = 64):
    # programs (s < NL, m): the kept inputs of row m in [s*SEG, s*SEG + SEG), packed to the front of that
    # span of idx/xv (row m's span is [m*K, m*K + K)); their count in cnt[m, s]. LR, programs
    # (NL + j, m): chunk j of LCH inputs' share of z = A x_dropped, the dropped inputs through the [K, RT]
    # input-major A^T of the low-rank compensation, into zp[m, j, :] (each program its own slot: no atomics,
    # nothing to zero; many small programs, so reading A^T hides behind the lists)
    _pdl_enter(PDL)
    s = tl.program_id(0)
    m = tl.program_id(1)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    if s < NL:
        out0 = m.to(tl.int64) * K + s * SEG
        n = tl.full([], 0, tl.int32)
        for c0 in range(0, SEG, CH):
            cols = s * SEG + c0 + tl.arange(0, CH)
            xv, keep = _kept_input_row(x_row, cols, (cols < K) & (c0 + tl.arange(0, CH) < SEG), thr, THRESH)
            k32 = keep.to(tl.int32)
            pos = n + tl.associative_scan(k32, 0, _add) - 1
            tl.store(idx_ptr + out0 + pos, cols, mask=keep)
            tl.store(xv_ptr + out0 + pos, xv, mask=keep)
            n += tl.reduce(k32, 0, _add)
        tl.store(cnt_ptr + m * NL + s, n)
    if LR:
        if s >= NL:
            j = s - NL
            rr = tl.arange(0, RP)
            rmask = rr < RT
            cols = j * LCH + tl.arange(0, LCH)
            km = cols < K
            xf = tl.load(x_row + cols, mask=km, other=0.0).to(tl.float32)
            dropped = tl.where(tl.abs(xf) > thr, 0.0, xf)  # what _kept_input_row zeroes
            a = tl.load(at_ptr + cols.to(tl.int64)[:, None] * RT + rr[None, :], mask=km[:, None] & rmask[None, :],
                        other=0.0)
            z = tl.reduce(dropped[:, None] * a.to(tl.float32), 0, _add)
            tl.store(zp_ptr + (m.to(tl.int64) * NLR + j) * RT + rr, z, mask=rmask)


@triton.jit(do_not_specialize=["M"])
def sparse_base_kernel(
    x_ptr, wt_ptr, bias_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, thr, idx_ptr, xv_ptr, kc_ptr,
    M, N, K, stride_xm, stride_wk, stride_om,
    wt1_ptr, wt2_ptr, N0, N1, stride_wk1, stride_wk2,
    HAS_BIAS: tl.constexpr, THRESH: tl.constexpr, GEMV: tl.constexpr, COMPACT: tl.constexpr, SEG: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = 0,
    NG: tl.constexpr = 1, LAST_FINISHES: tl.constexpr = True,
):
    _pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    # the weight this n-tile reads: with NG weights sharing x, their output tiles one after another
    wbase = wt_ptr
    swk = tl.full([], 0, tl.int64) + stride_wk
    g_off = tl.full([], 0, tl.int32)
    g_n = tl.full([], 0, tl.int32) + N
    tile = pid_n
    if NG > 1:
        t0 = (N0 + BN - 1) // BN
        g_n = tl.full([], 0, tl.int32) + N0
        if pid_n >= t0:
            wbase = wt1_ptr
            swk = tl.full([], 0, tl.int64) + stride_wk1
            g_off = tl.full([], 0, tl.int32) + N0
            g_n = tl.full([], 0, tl.int32) + N1
            tile = pid_n - t0
            if NG > 2:
                t1 = (N1 + BN - 1) // BN
                if tile >= t1:
                    wbase = wt2_ptr
                    swk = tl.full([], 0, tl.int64) + stride_wk2
                    g_off = tl.full([], 0, tl.int32) + N0 + N1
                    g_n = tl.full([], 0, tl.int32) + N - N0 - N1
                    tile = tile - t1
    wn = tile * BN + tl.arange(0, BN)  # the tile's columns of its own weight
    offs_n = g_off + wn  # and of the output, the workspace and the bias
    nmask = wn < g_n
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    cols = pid_k * BK + tl.arange(0, BK)
    kmask = cols < K
    w_ptrs = wbase + cols.to(tl.int64)[:, None] * swk + wn[None, :]
    if COMPACT:  # one row's kept inputs: chunk pid_k % (SEG // BK) of segment pid_k // (SEG // BK)'s list
        seg = pid_k // (SEG // BK)
        start = (pid_k % (SEG // BK)) * BK
        kept = tl.load(kc_ptr + pid_m * ((K + SEG - 1) // SEG) + seg)
        if start < kept:
            jj = start + tl.arange(0, BK)
            j = pid_m.to(tl.int64) * K + seg * SEG + jj
            jm = jj < kept
            ii = tl.load(idx_ptr + j, mask=jm, other=0)
            xv = tl.load(xv_ptr + j, mask=jm, other=0.0)
            wt = tl.load(wbase + ii.to(tl.int64)[:, None] * swk + wn[None, :],
                         mask=jm[:, None] & nmask[None, :], other=0.0, eviction_policy="evict_first")
            part = tl.reduce(xv.to(tl.float32)[:, None] * wt.to(tl.float32), 0, _add)
            tl.atomic_add(ws_ptr + pid_m.to(tl.int64) * N + offs_n, part, mask=nmask, sem="relaxed", scope="gpu")
    elif GEMV:  # one row: a [BK] x [BK, BN] product without MMA
        xv, keep = _kept_input_row(x_ptr + pid_m.to(tl.int64) * stride_xm, cols, kmask, thr, THRESH)
        if _any(keep, 0):
            # only the weight rows of kept inputs are read (masked lines are never requested)
            wt = tl.load(w_ptrs, mask=keep[:, None] & nmask[None, :], other=0.0, eviction_policy="evict_first")
            part = tl.reduce(xv.to(tl.float32)[:, None] * wt.to(tl.float32), 0, _add)
            tl.atomic_add(ws_ptr + pid_m.to(tl.int64) * N + offs_n, part, mask=nmask, sem="relaxed", scope="gpu")
    else:
        xt, col_keep = _kept_inputs(x_ptr + rows.to(tl.int64) * stride_xm, row_ok, cols, kmask, thr, THRESH)
        if _any(col_keep, 0):
            wt = tl.load(w_ptrs, mask=col_keep[:, None] & nmask[None, :], other=0.0, eviction_policy="evict_first")
            part = tl.dot(xt, wt, input_precision=DOT_PREC)
            tl.atomic_add(ws_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], part,
                          mask=row_ok[:, None] & nmask[None, :], sem="relaxed", scope="gpu")
    if LAST_FINISHES:  # otherwise finish_rows_kernel, launched next, writes the output
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if _count_in(counter) == tl.num_programs(1) - 1:  # the last k-tile of this (n-tile, row block)
            _finish_rows(wsi_ptr, out_ptr, rows, row_ok, N, stride_om, offs_n, nmask, bias_ptr, HAS_BIAS, False)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _low_rank_part(b_ptr, zp_ptr, r, offs, nm, NSEG, RT, R, z0, RB: tl.constexpr, SP: tl.constexpr):
    # [BLOCK] outputs' B[offs, :] . z[z0 : z0 + R], z summed over the row's NSEG segment slots
    jj = tl.arange(0, RB)
    jm = jj < R
    ss = tl.arange(0, SP)
    zt = tl.load(zp_ptr + (r * NSEG + ss.to(tl.int64))[:, None] * RT + z0 + jj[None, :],
                 mask=(ss < NSEG)[:, None] & jm[None, :], other=0.0)
    z = tl.reduce(zt, 0, _add)
    bt = tl.load(b_ptr + offs.to(tl.int64)[:, None] * R + jj[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
    return tl.reduce(bt.to(tl.float32) * z[None, :], 1, _add)


@triton.jit
def finish_rows_kernel(wsi_ptr, out_ptr, bias_ptr, N, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = 0, b_ptr=None, zp_ptr=None, NSEG=1, RT=0, R=0, N0=0, N1=0,
                       LR: tl.constexpr = False, NG: tl.constexpr = 1, RB: tl.constexpr = 16,
                       SP: tl.constexpr = 16):
    # program (n-block, row): out = workspace (+ bias) in out's dtype, the workspace zeroed again. The
    # kernel before it (the sums' atomic adds) has ended, so no counter is needed; the sums are still read
    # with atomic exchanges: plain loads here were seen to miss some of the adds on the H200 (1 800 of
    # 14 336 outputs wrong, intermittently), atomics on the same words never were
    # (not _finish_rows: its acq_rel exchanges on a [1, BLOCK] tile made this launch ~3 us slower, 99.5 -> 121.7
    # us per 8B block at 50 % on the H200; after a kernel boundary relaxed exchanges suffice)
    # LR: plus the low-rank compensation B z of the weight each output belongs to (NG weights side by side:
    # outputs [0, N0) the first, [N0, N0 + N1) the second, the rest the third; z of weight g at g * R).
    # Computed before waiting for the sums' kernel: B is constant, and z was written by the list-packing
    # launch, which ended before that kernel passed its own wait and let this launch begin (PDL), or before
    # it in stream order (no PDL); so it runs while the sums are still being added
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nm = offs < N
    r = tl.program_id(1).to(tl.int64)
    if LR:
        lr = _low_rank_part(b_ptr, zp_ptr, r, offs, nm, NSEG, RT, R, 0, RB, SP)
        if NG > 1:
            lr = tl.where(offs >= N0, _low_rank_part(b_ptr, zp_ptr, r, offs, nm, NSEG, RT, R, R, RB, SP), lr)
        if NG > 2:
            lr = tl.where(offs >= N0 + N1, _low_rank_part(b_ptr, zp_ptr, r, offs, nm, NSEG, RT, R, 2 * R, RB, SP), lr)
    _pdl_enter(PDL)
    bits = tl.atomic_xchg(wsi_ptr + r * N + offs, tl.where(nm, 0, 0), mask=nm, sem="relaxed", scope="gpu")
    acc = tl.where(nm, bits.to(tl.float32, bitcast=True), 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=nm, other=0.0).to(tl.float32)
    if LR:
        acc += lr
    tl.store(out_ptr + r * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _delta_row_words(x_row, cols, kmask, thr, q32_base, s_base, z_base, RW, N, GS, k0, wcol, ws_row,
                     BITS: tl.constexpr, CMASK: tl.constexpr, THRESH: tl.constexpr,
                     BLOCK_GROUP: tl.constexpr):
    # one row times one [BK, BN] tile of a delta, the codes read as int32 words ([BK, BN / (32/BITS)]:
    # vector loads) and taken apart in registers: code j of word w is output w * (32/BITS) + j
    P32: tl.constexpr = 32 // BITS
    xv, keep = _kept_input_row(x_row, cols, kmask, thr, THRESH)
    if _any(keep, 0):
        words = tl.load(q32_base + cols.to(tl.int64)[:, None] * RW + wcol[None, :],
                        mask=keep[:, None] & (wcol < RW)[None, :], other=0, eviction_policy="evict_first")
        xf = xv.to(tl.float32)
        for j in tl.static_range(P32):
            n_j = wcol * P32 + j
            nm = n_j < N
            # code as a float without an int->float conversion: OR-ed into the mantissa of 2**23 it
            # reads as 2**23 + code; minus 2**23 + zero leaves code - zero exactly
            cm = (((words >> (j * BITS)) & CMASK) | 0x4B000000).to(tl.float32, bitcast=True)
            if BLOCK_GROUP:  # one scale and one zero per output
                g = k0 // GS
                sc = tl.load(s_base + g * N + n_j, mask=nm, other=0.0).to(tl.float32)
                zm = tl.load(z_base + g * N + n_j, mask=nm, other=0).to(tl.float32) + 8388608.0
                part = sc * tl.reduce(xf[:, None] * (cm - zm[None, :]), 0, _add)
            else:
                gi = (cols // GS).to(tl.int64)[:, None] * N + n_j[None, :]
                gm = keep[:, None] & nm[None, :]
                sc = tl.load(s_base + gi, mask=gm, other=0.0).to(tl.float32)
                zm = tl.load(z_base + gi, mask=gm, other=0).to(tl.float32) + 8388608.0
                part = tl.reduce(xf[:, None] * ((cm - zm) * sc), 0, _add)
            tl.atomic_add(ws_row + n_j, part, mask=nm, sem="relaxed", scope="gpu")


@triton.jit
def _codes_f32(words, BITS: tl.constexpr, CMASK: tl.constexpr):
    # int32 words [R, W] taken apart into [R, W, 32 / BITS] float32 values code_j * 2**(BITS * (j % H) - 149),
    # H = 16 / BITS the codes of a 16-bit half (code j at bits BITS * j): each half's codes are masked where
    # they lie (one shift per word brings the upper half down, none per code), and the masked bits, below
    # 2**16, read as a float32 denormal: exact, with no int->float conversion and no subtraction. The
    # products use _x_scaled(x) so that they are normal floats again; _code_unscale undoes both
    # scalings once per tile. (GPU float32 multiply-adds keep denormal operands unless compiled to flush
    # them; Triton does not, and the compiled tests would catch it.)
    H: tl.constexpr = 16 // BITS
    halves = tl.join(words, words >> 16)  # [R, W, 2]; the sign bits the shift brings in are masked off
    masks = CMASK << (tl.arange(0, H) * BITS)
    v = (halves[:, :, :, None] & masks[None, None, None, :]).to(tl.float32, bitcast=True)
    return tl.reshape(v, (v.shape[0], v.shape[1], 2 * H))


@triton.jit
def _x_scaled(xf):
    # x * 2**64 (exact; finite for |x| < 2**64): brings the products with _codes_f32 values, x * code * 2**-85
    # and more, back to normal floats (for |x * code| >= 2**-41; smaller products add less than 2**-64 each)
    return xf * 18446744073709551616.0


@triton.jit
def _code_unscale(BITS: tl.constexpr):
    # [32 / BITS]: 2**(149 - 64 - BITS * (j % H)), what turns sums of _x_scaled(x) * _codes_f32 values back
    # into sums of x * code
    H: tl.constexpr = 16 // BITS
    return tl.exp2((85 - (tl.arange(0, 2 * H) % H) * BITS).to(tl.float32))


@triton.jit
def _add_group_tile(acc, xsum, k0, s_base, z_base, N, GS, wcol, ws_row, P32: tl.constexpr, BITS: tl.constexpr):
    # one row's sums over a tile inside one group, acc [BKI, W, P32] (_x_scaled(x) . _codes_f32 values) and xsum [BKI],
    # into the workspace: s * (x.c - z * sum(x)) per output (output of word w, slot j: w * P32 + j)
    n3 = wcol[:, None] * P32 + tl.arange(0, P32)[None, :]
    nm = n3 < N
    g = k0 // GS
    sc = tl.load(s_base + g * N + n3, mask=nm, other=0.0).to(tl.float32)
    zf = tl.load(z_base + g * N + n3, mask=nm, other=0).to(tl.float32)
    xc = tl.reduce(acc, 0, _add) * _code_unscale(BITS)[None, :]
    part = sc * (xc - zf * tl.reduce(xsum, 0, _add))
    tl.atomic_add(ws_row + n3, part, mask=nm, sem="relaxed", scope="gpu")


@triton.jit
def _delta_row_words_loop(x_row, k0, K, thr, q32_base, s_base, z_base, RW, N, GS, wcol, ws_row,
                          BITS: tl.constexpr, CMASK: tl.constexpr, THRESH: tl.constexpr,
                          BK: tl.constexpr, BKI: tl.constexpr, W: tl.constexpr):
    # one row times one [BK, BN] tile inside one quantization group, in [BKI] steps: the codes of a
    # step as [BKI, W, 32/BITS] (word, slot), summed over k inside each lane; one reduction at the end,
    # then s * (x.c - z * sum(x)) per output (output of word w, slot j: w * (32/BITS) + j)
    P32: tl.constexpr = 32 // BITS
    acc = tl.full([BKI, W, P32], 0.0, tl.float32)
    xsum = tl.full([BKI], 0.0, tl.float32)
    kept = tl.full([BKI], 0, tl.int32)
    for kk in range(0, BK, BKI):
        c = k0 + kk + tl.arange(0, BKI)
        xv, keep = _kept_input_row(x_row, c, c < K, thr, THRESH)
        words = tl.load(q32_base + c.to(tl.int64)[:, None] * RW + wcol[None, :],
                        mask=keep[:, None] & (wcol < RW)[None, :], other=0, eviction_policy="evict_first")
        cm = _codes_f32(words, BITS, CMASK)
        xf = xv.to(tl.float32)
        acc += _x_scaled(xf)[:, None, None] * cm
        xsum += xf
        kept += keep.to(tl.int32)
    if tl.reduce(kept, 0, _add) > 0:  # a group no input of the row keeps: its scales are never read
        _add_group_tile(acc, xsum, k0, s_base, z_base, N, GS, wcol, ws_row, P32, BITS)


@triton.jit
def _kept_words(idx_row, xv_row, j0, kept, q32_base, RW, wcol, BKI: tl.constexpr):
    # entries [j0, j0 + BKI) of a compacted list (past `kept`: zeros, nothing read): the inputs' values
    # and their rows of packed codes as int32 words [BKI, W]
    j = j0 + tl.arange(0, BKI)
    jm = j < kept
    c = tl.load(idx_row + j, mask=jm, other=0)
    xv = tl.load(xv_row + j, mask=jm, other=0.0)
    words = tl.load(q32_base + c.to(tl.int64)[:, None] * RW + wcol[None, :],
                    mask=jm[:, None] & (wcol < RW)[None, :], other=0, eviction_policy="evict_first")
    return xv, words


@triton.jit
def _delta_row_words_compact(idx_row, xv_row, kept, k0, q32_base, s_base, z_base, RW, N, GS, wcol, ws_row,
                             BITS: tl.constexpr, CMASK: tl.constexpr, BKI: tl.constexpr, W: tl.constexpr):
    # as _delta_row_words_loop, over the tile's compacted kept inputs only: ceil(kept / BKI) steps, each
    # step's sum over its inputs added at once (a [W, P32] accumulator instead of [BKI, W, P32]: fewer
    # registers, more programs per SM; 541 against 600 us per 8B block with 8 deltas at 40 % on the H200)
    P32: tl.constexpr = 32 // BITS
    acc = tl.full([W, P32], 0.0, tl.float32)
    xsum = tl.full([1], 0.0, tl.float32)
    # each step issues the next step's loads before it decodes its own codes (software pipelining by hand)
    xn, wn = _kept_words(idx_row, xv_row, 0, kept, q32_base, RW, wcol, BKI)
    for kk in range(0, kept, BKI):
        xf = xn.to(tl.float32)
        words = wn
        xn, wn = _kept_words(idx_row, xv_row, kk + BKI, kept, q32_base, RW, wcol, BKI)
        cm = _codes_f32(words, BITS, CMASK)
        acc += tl.reduce(_x_scaled(xf)[:, None, None] * cm, 0, _add)
        xsum += tl.reduce(xf, 0, _add)
    if kept > 0:
        _add_group_tile(acc[None, :, :], xsum, k0, s_base, z_base, N, GS, wcol, ws_row, P32, BITS)


@triton.jit
def _delta_tile(x_ptr, stride_xm, rows, row_ok, cols, kmask, thr, q_base, s_base, z_base, RB, N, GS,
                k0, offs_n, nmask, byte_col, shift, ws_ptr,
                BITS: tl.constexpr, CMASK: tl.constexpr, THRESH: tl.constexpr, BLOCK_GROUP: tl.constexpr,
                DOT_PREC: tl.constexpr):
    # block rows times one [BK, BN] tile of a delta (codes read byte by byte), through tl.dot
    xt, col_keep = _kept_inputs(x_ptr + rows.to(tl.int64) * stride_xm, row_ok, cols, kmask, thr, THRESH)
    if _any(col_keep, 0):
        wmask = col_keep[:, None] & nmask[None, :]
        qb = tl.load(q_base + cols.to(tl.int64)[:, None] * RB + byte_col[None, :], mask=wmask, other=0,
                     eviction_policy="evict_first")
        code = (qb.to(tl.int32) >> shift[None, :]) & CMASK
        if BLOCK_GROUP:  # the whole k-tile inside one quantization group: one scale row, one zero row
            g = k0 // GS
            zf = tl.load(z_base + g * N + offs_n, mask=nmask, other=0).to(tl.float32)
            sc = tl.load(s_base + g * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
            # x . ((c - z) * s) = s * (x . c - z * sum(x)): the codes go into the product as they are
            xc = tl.dot(xt, code.to(xt.dtype), input_precision=DOT_PREC)
            xs = tl.reduce(xt.to(tl.float32), 1, _add)
            part = sc[None, :] * (xc - zf[None, :] * xs[:, None])
        else:
            gi = (cols // GS).to(tl.int64)[:, None] * N + offs_n[None, :]
            zf = tl.load(z_base + gi, mask=wmask, other=0).to(tl.float32)
            sc = tl.load(s_base + gi, mask=wmask, other=0.0).to(tl.float32)
            part = tl.dot(xt, ((code.to(tl.float32) - zf) * sc).to(xt.dtype), input_precision=DOT_PREC)
        tl.atomic_add(ws_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], part,
                      mask=row_ok[:, None] & nmask[None, :], sem="relaxed", scope="gpu")


@triton.jit
def _delta_row_bytes(x_row, cols, kmask, thr, q_base, s_base, z_base, RB, N, GS, k0, offs_n, nmask,
                     byte_col, shift, ws_row,
                     BITS: tl.constexpr, CMASK: tl.constexpr, THRESH: tl.constexpr, BLOCK_GROUP: tl.constexpr):
    # one row times one [BK, BN] tile of a delta whose packed rows are not whole int32 words
    xv, keep = _kept_input_row(x_row, cols, kmask, thr, THRESH)
    if _any(keep, 0):
        wmask = keep[:, None] & nmask[None, :]
        qb = tl.load(q_base + cols.to(tl.int64)[:, None] * RB + byte_col[None, :], mask=wmask, other=0,
                     eviction_policy="evict_first")
        code = ((qb.to(tl.int32) >> shift[None, :]) & CMASK).to(tl.float32)
        xf = xv.to(tl.float32)
        if BLOCK_GROUP:
            g = k0 // GS
            zf = tl.load(z_base + g * N + offs_n, mask=nmask, other=0).to(tl.float32)
            sc = tl.load(s_base + g * N + offs_n, mask=nmask, other=0.0).to(tl.float32)
            part = sc * (tl.reduce(xf[:, None] * code, 0, _add) - zf * tl.reduce(xf, 0, _add))
        else:
            gi = (cols // GS).to(tl.int64)[:, None] * N + offs_n[None, :]
            zf = tl.load(z_base + gi, mask=wmask, other=0).to(tl.float32)
            sc = tl.load(s_base + gi, mask=wmask, other=0.0).to(tl.float32)
            part = tl.reduce(xf[:, None] * ((code - zf) * sc), 0, _add)
        tl.atomic_add(ws_row + offs_n, part, mask=nmask, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "U"])
def sparse_delta_kernel(
    x_ptr, q_ptr, q32_ptr, s_ptr, z_ptr, seg_ptr, out_ptr, ws_ptr, wsi_ptr, cnt_ptr, thr, idx_ptr, xv_ptr, kc_ptr,
    lookup_ptr, M, N, K, U, RB, G, GS, stride_xm, stride_om,
    BITS: tl.constexpr, THRESH: tl.constexpr, BLOCK_GROUP: tl.constexpr, GEMV: tl.constexpr,
    WORDS: tl.constexpr, COMPACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKI: tl.constexpr,
    MP: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = 0, LOOKUP: tl.constexpr = False,
):
    _pdl_enter(PDL)
    P: tl.constexpr = 8 // BITS  # codes per byte (along the outputs)
    CMASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t = tl.program_id(2)  # the segment this program serves
    u = tl.load(seg_ptr + 3 * M + t)
    if LOOKUP:  # the table was built on slot ids: this stack's index of the slot (-1: not here)
        u = tl.load(lookup_ptr + u + 1, mask=u >= -1, other=-1)
    if (u >= 0) & (u < U):
        # the segment's slots are one contiguous run of the sorted order: find its start and length
        slots = tl.arange(0, MP)
        sel = (slots < M) & (tl.load(seg_ptr + 2 * M + slots, mask=slots < M, other=-1) == t)
        first = tl.reduce(tl.where(sel, slots, MP), 0, _minimum)
        count = tl.reduce(sel.to(tl.int32), 0, _add)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        byte_col = offs_n // P
        shift = (offs_n % P) * BITS
        k0 = pid_k * BK
        cols = k0 + tl.arange(0, BK)
        kmask = cols < K
        u64 = u.to(tl.int64)
        q_base = q_ptr + u64 * K * RB
        s_base = s_ptr + u64 * G * N
        z_base = z_ptr + u64 * G * N
        if GEMV:  # each row of the segment on its own (a segment of one row is the usual case)
            for r in range(0, count):
                row = tl.load(seg_ptr + first + r).to(tl.int64)
                W: tl.constexpr = BN * BITS // 32
                if COMPACT:  # WORDS and BLOCK_GROUP hold (the launcher checks)
                    _delta_row_words_compact(idx_ptr + row * K + k0, xv_ptr + row * K + k0,
                                             tl.load(kc_ptr + row * tl.num_programs(1) + pid_k), k0,
                                             q32_ptr + u64 * K * (RB // 4), s_base, z_base, RB // 4, N, GS,
                                             pid_n * W + tl.arange(0, W), ws_ptr + row * N, BITS, CMASK, BKI, W)
                elif WORDS and BLOCK_GROUP and BKI < BK:
                    _delta_row_words_loop(x_ptr + row * stride_xm, k0, K, thr, q32_ptr + u64 * K * (RB // 4),
                                          s_base, z_base, RB // 4, N, GS, pid_n * W + tl.arange(0, W),
                                          ws_ptr + row * N, BITS, CMASK, THRESH, BK, BKI, W)
                elif WORDS:
                    _delta_row_words(x_ptr + row * stride_xm, cols, kmask, thr, q32_ptr + u64 * K * (RB // 4),
                                     s_base, z_base, RB // 4, N, GS, k0, pid_n * W + tl.arange(0, W),
                                     ws_ptr + row * N, BITS, CMASK, THRESH, BLOCK_GROUP)
                else:
                    _delta_row_bytes(x_ptr + row * stride_xm, cols, kmask, thr, q_base, s_base, z_base, RB, N, GS,
                                     k0, offs_n, nmask, byte_col, shift, ws_ptr + row * N,
                                     BITS, CMASK, THRESH, BLOCK_GROUP)
        else:
            for r0 in range(0, count, BM):  # usually one pass: a segment of at most BM rows
                rr = r0 + tl.arange(0, BM)
                row_ok = rr < count
                rows = tl.load(seg_ptr + first + rr, mask=row_ok, other=0)
                _delta_tile(x_ptr, stride_xm, rows, row_ok, cols, kmask, thr, q_base, s_base, z_base, RB, N, GS,
                            k0, offs_n, nmask, byte_col, shift, ws_ptr, BITS, CMASK, THRESH, BLOCK_GROUP, DOT_PREC)
        counter = cnt_ptr + t * tl.num_programs(0) + pid_n
        if _count_in(counter) == tl.num_programs(1) - 1:  # the last k-tile of this (n-tile, segment)
            for r0 in range(0, count, BM):
                rr = r0 + tl.arange(0, BM)
                row_ok = rr < count
                rows = tl.load(seg_ptr + first + rr, mask=row_ok, other=0)
                _finish_rows(wsi_ptr, out_ptr, rows, row_ok, N, stride_om, offs_n, nmask, out_ptr, False, True)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
