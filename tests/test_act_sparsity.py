"""Activation sparsity: calibration, thresholds files, applying them (plain models and DeltaModel),
and the kernels that skip the weight columns of dropped inputs.

Kernel tests run under the Triton interpreter (``TRITON_INTERPRET=1``) on small, awkward shapes in
fp16 / fp32 against the plain-PyTorch reference given the same inputs (so the same mask).
"""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.kernels import prepare_stack, random_delta_stack
from hf_deltazip.kernels import act_sparse as A
from hf_deltazip.kernels.delta_stack import dequantize_delta
from hf_deltazip.modeling import activation_sparsity as S

from model_factory import base_model, calibration_ids, finetune

pytest.importorskip("triton")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tol(dtype):
    return dict(atol=2e-2, rtol=1e-2) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


def _sparse_x(m, k, gen, dtype, frac=0.5, dead=()):
    """Activations with about ``frac`` of the entries zero and the columns ``dead`` zero in every row."""
    x = torch.randn(m, k, generator=gen)
    x[torch.rand(m, k, generator=gen) < frac] = 0.0
    for lo, hi in dead:
        x[:, lo:hi] = 0.0
    return x.to(dtype)


# --------------------------------------------------------------------------- base kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 70, 150), (3, 33, 96), (17, 40, 70)])
def test_sparse_base_linear_matches_dense_reference(interpret, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = _sparse_x(m, k, gen, dtype, dead=[(32, 64)])
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    wt = A.input_major_weight(w)
    got = A.sparse_base_linear(x, wt, bias, block_n=32, block_k=32)
    dense = (x.float() @ w.float().t() + bias.float()).to(dtype)
    torch.testing.assert_close(got, dense, **_tol(dtype))
    # the workspace and counters are left zero: a second launch (other tiles too) gives the same
    torch.testing.assert_close(A.sparse_base_linear(x, wt, bias, block_n=32, block_k=32), got, atol=0, rtol=0)
    torch.testing.assert_close(A.sparse_base_linear(x, wt, bias, block_n=16, block_k=64), dense, **_tol(dtype))
    for mma in (True, False):  # one row through tl.dot (padded to 16 rows) or as a GEMV
        torch.testing.assert_close(A.sparse_base_linear(x, wt, bias, block_n=32, block_k=32, mma=mma), dense, **_tol(dtype))
    # the sums turned into the output by the last program of each tile instead of a second launch
    torch.testing.assert_close(A.sparse_base_linear(x, wt, bias, block_n=32, block_k=32, finish_kernel=False), got,
                               atol=0, rtol=0)
    for ws, counters in A._WORKSPACES.values():
        assert not ws.any() and not counters.any()
    # the threshold fused in the kernel: the same as thresholding x first
    got_t = A.sparse_base_linear(x, wt, None, threshold=0.7, block_n=32, block_k=32)
    ref_t = A.sparse_base_linear_reference(x, wt, None, threshold=0.7)
    torch.testing.assert_close(got_t, ref_t, **_tol(dtype))
    assert not torch.allclose(got_t.float(), (x.float() @ w.float().t()), atol=1e-3)  # the threshold did drop inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sparse_base_linear_never_reads_columns_of_dropped_inputs(interpret, dtype):
    gen = torch.Generator().manual_seed(3)
    m, n, k = 2, 48, 100
    x = torch.randn(m, k, generator=gen).to(dtype)
    dropped = (x.abs() <= 0.6).all(0)  # inputs no row keeps
    x[:, 10] = 0.0
    dropped[10] = True
    w = torch.randn(n, k, generator=gen).to(dtype)
    wt = A.input_major_weight(w)
    wt[dropped] = float("nan")  # reading any of these rows would poison the output
    got = A.sparse_base_linear(x, wt, threshold=0.6, block_n=16, block_k=32)
    assert torch.isfinite(got).all()
    clean = wt.clone()
    clean[dropped] = 0
    torch.testing.assert_close(got, A.sparse_base_linear_reference(x, clean, threshold=0.6), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,sizes", [(1, (40, 24, 24)), (1, (33, 16)), (3, (17, 50, 8))])
def test_weights_sharing_an_input_in_one_launch_give_one_call_per_weight(interpret, dtype, m, sizes):
    gen = torch.Generator().manual_seed(sum(sizes) + m)
    k = 100
    x = _sparse_x(m, k, gen, dtype, dead=[(32, 64)])
    ws = [(torch.randn(n, k, generator=gen) * 0.1).to(dtype) for n in sizes]
    wts = [A.input_major_weight(w) for w in ws]
    dropped = (x.abs() <= 0.6).all(0)
    for wt in wts:  # reading the row of an input no row keeps would poison that weight's outputs
        wt[dropped] = float("nan")
    clean = [wt.masked_fill(dropped[:, None], 0) for wt in wts]
    for biases in (None, [torch.randn(n, generator=gen).to(dtype) for n in sizes]):
        outs = A.sparse_base_linears(x, wts, biases, threshold=0.6, block_n=16, block_k=32)
        assert [tuple(o.shape) for o in outs] == [(m, n) for n in sizes]
        for i, o in enumerate(outs):
            b = None if biases is None else biases[i]
            assert torch.isfinite(o).all()
            torch.testing.assert_close(o, A.sparse_base_linear_reference(x, clean[i], b, threshold=0.6), **_tol(dtype))
            # the same launch settings, one weight per launch: the same sums in the same order
            torch.testing.assert_close(o, A.sparse_base_linear(x, wts[i], b, threshold=0.6, block_n=16, block_k=32),
                                       atol=0, rtol=0)
    out = torch.full((m, sum(sizes)), 7.0, dtype=dtype)  # a given output: the weights' column ranges in order
    views = A.sparse_base_linears(x, clean, threshold=0.6, out=out, block_n=32, block_k=64)
    assert all(v.data_ptr() == out[:, lo:].data_ptr() for v, lo in zip(views, [0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()]))
    torch.testing.assert_close(out, torch.cat([A.sparse_base_linear_reference(x, c, threshold=0.6) for c in clean], 1),
                               **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
# segment 32: five segments' shares of z summed (the last 22 wide); 1024: one
@pytest.mark.parametrize("m,sizes,r,segment", [(1, (70,), 5, 32), (1, (40, 24, 24), 3, 1024), (3, (33, 16), 16, 32),
                                               (1, (20,), 40, 32)])
def test_low_rank_compensation_in_the_sparse_base_kernel_matches_its_reference(interpret, monkeypatch, dtype, m,
                                                                               sizes, r, segment):
    """y = sparsify(x) W^T + (x - sparsify(x)) A^T B^T: z = x_dropped A^T summed by the list-packing launch
    per segment, B z added by the finishing launch, per weight of a grouped call; one row (compacted and
    masked walks) and several (MMA)."""
    monkeypatch.setattr(A, "_BASE_SEGMENT", segment)
    gen = torch.Generator().manual_seed(m * 100 + r + segment)
    k = 150
    x = _sparse_x(m, k, gen, dtype, frac=0.3)
    ws = [(torch.randn(n, k, generator=gen) * 0.1).to(dtype) for n in sizes]
    wts = [A.input_major_weight(w) for w in ws]
    factors = [((torch.randn(r, k, generator=gen) * 0.2).to(dtype), (torch.randn(n, r, generator=gen) * 0.2).to(dtype))
               for n in sizes]
    lr = A.input_major_low_rank(factors)
    assert lr[0].shape == (k, r * len(sizes)) and lr[1].shape == (sum(sizes), r)
    biases = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    xs = A.sparsify_input(x, 0.6).float()
    want = [xs @ w.float().t() + b.float() + (x.float() - xs) @ a.float().t() @ bb.float().t()
            for w, b, (a, bb) in zip(ws, biases, factors)]
    assert not torch.allclose(want[0], xs @ ws[0].float().t() + biases[0].float(), atol=1e-2)  # it adds something
    for kw in (dict(compact=True, block_k=32), dict(compact=False, block_k=32), dict(mma=True)):
        outs = A.sparse_base_linears(x, wts, biases, threshold=0.6, block_n=16, lowrank=lr, **kw)
        for o, wnt in zip(outs, want):
            torch.testing.assert_close(o, wnt.to(dtype), **_tol(dtype), msg=lambda e, kw=kw: f"{kw}: {e}")
        if len(sizes) == 1:
            one = A.sparse_base_linear(x, wts[0], biases[0], threshold=0.6, block_n=16, lowrank=lr, **kw)
            torch.testing.assert_close(one, outs[0], atol=0, rtol=0)
    monkeypatch.setattr(A, "_runs_reference", lambda x_: True)  # the plain-PyTorch path (a CPU tensor) agrees
    for o, wnt in zip(A.sparse_base_linears(x, wts, biases, threshold=0.6, lowrank=lr), want):
        torch.testing.assert_close(o, wnt.to(dtype), **_tol(dtype))
    for ws_, counters in A._WORKSPACES.values():
        assert not ws_.any() and not counters.any()


def test_low_rank_arguments_are_checked(interpret):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=gen)
    wt = A.input_major_weight(torch.randn(32, 64, generator=gen))
    a, b = torch.randn(4, 64, generator=gen), torch.randn(32, 4, generator=gen)
    lr = A.input_major_low_rank([(a, b)])
    with pytest.raises(ValueError, match="finish_kernel"):
        A.sparse_base_linear(x, wt, threshold=0.5, lowrank=lr, finish_kernel=False)
    with pytest.raises(ValueError, match="do not fit"):
        A.sparse_base_linear(x, wt, threshold=0.5, lowrank=(lr[0], lr[1][:30]))
    with pytest.raises(ValueError, match="do not fit"):
        A.sparse_base_linears(x, [wt, wt], threshold=0.5, lowrank=lr)
    with pytest.raises(ValueError, match="same r"):
        A.input_major_low_rank([(a, b), (a[:3], b[:, :3]), (a, b[:, :3])])
    big = A.input_major_low_rank([(torch.randn(65, 64), torch.randn(32, 65))])
    with pytest.raises(ValueError, match="1 to 64"):
        A.sparse_base_linear(x, wt, threshold=0.5, lowrank=big)
    # no threshold: only exact zeros are dropped, so there is nothing to compensate
    torch.testing.assert_close(A.sparse_base_linear(x, wt, lowrank=lr), A.sparse_base_linear(x, wt), atol=0, rtol=0)


def test_grouped_launch_and_pdl_refuse_what_they_cannot_do(interpret):
    x = torch.randn(1, 64, dtype=torch.float16)
    wt = A.input_major_weight(torch.randn(16, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="one to three weights"):
        A.sparse_base_linears(x, [wt] * 4)
    with pytest.raises(ValueError, match="one to three weights"):
        A.sparse_base_linears(x, [])
    with pytest.raises(ValueError, match="for every weight or for none"):
        A.sparse_base_linears(x, [wt, wt], [torch.zeros(16, dtype=torch.float16), None])
    with pytest.raises(ValueError, match="2 biases for 3 weights"):
        A.sparse_base_linears(x, [wt] * 3, [None, None])
    with pytest.raises(ValueError, match="input-major"):  # a weight of another input width
        A.sparse_base_linears(x, [wt, A.input_major_weight(torch.randn(16, 32, dtype=torch.float16))])
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        A.sparse_base_linears(x, [wt, wt], out=torch.empty(1, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        A.sparse_base_linear(x, wt, pdl=2)
    with pytest.raises(ValueError, match="pdl must be"):
        A.sparse_delta_linear(x, A.input_major_deltas(random_delta_stack(1, 16, 64, bits=4, group_size=32)),
                              torch.zeros(1, dtype=torch.int32), pdl=3)


# --------------------------------------------------------------------------- delta kernel
@pytest.mark.parametrize("dtype,bits,group_size,block_k", [
    (torch.float16, 4, 32, 32), (torch.float32, 4, 64, 32), (torch.float16, 2, -1, 32),
    (torch.float32, 8, 32, 64),  # k-blocks wider than a group: scales read per element
])
@pytest.mark.parametrize("n", [37, 80])  # packed rows of bytes; of whole int32 words (read as words)
def test_sparse_delta_linear_matches_reference_per_segment(interpret, dtype, bits, group_size, block_k, n):
    gen = torch.Generator().manual_seed(bits * 7 + group_size)
    m, k, u = 6, 128, 3
    stack = random_delta_stack(u, n, k, bits=bits, group_size=group_size, scale_range=(0.01, 0.03), generator=gen)
    deltas = A.input_major_deltas(stack)
    x = _sparse_x(m, k, gen, dtype, dead=[(64, 96)])
    row_delta = torch.tensor([2, -1, 0, 2, 1, 0])
    base = torch.randn(m, n, generator=gen).to(dtype)
    got = A.sparse_delta_linear(x, deltas, row_delta, out=base.clone(), block_n=64, block_k=block_k)
    want = base.float().clone()
    for r, d in enumerate(row_delta.tolist()):
        if d >= 0:
            want[r] += x[r].float() @ dequantize_delta(stack, d).t()
    torch.testing.assert_close(got, want.to(dtype), **_tol(dtype))
    assert torch.equal(got[1], base[1])  # a base-only row is left as it was
    # rows of a segment together through tl.dot (narrow and wide tiles); one row at a time (GEMV: on
    # rows of whole int32 words, n = 80, the codes are read as words and taken apart slot by slot)
    for kw in (dict(block_m=16, block_n=32, block_k=block_k), dict(block_m=1, block_n=32, block_k=block_k),
               dict(block_m=16, block_n=512 // bits, block_k=min(block_k, group_size if group_size > 0 else k)),
               # the words GEMV in steps of 8 inputs (tiles inside one group; a wider tile ignores it)
               dict(block_m=1, block_n=32, block_k=block_k, inner_k=8),
               dict(block_m=1, block_n=64, block_k=block_k, inner_k=block_k // 2)):
        got_kw = A.sparse_delta_linear(x, deltas, row_delta, out=base.clone(), **kw)
        torch.testing.assert_close(got_kw, want.to(dtype), **_tol(dtype), msg=lambda e, kw=kw: f"{kw}: {e}")
    with pytest.raises(ValueError, match="inner_k"):
        A.sparse_delta_linear(x, deltas, row_delta, block_k=32, inner_k=64)
    got_t = A.sparse_delta_linear(x, deltas, row_delta, threshold=0.5, block_n=64, block_k=block_k)
    torch.testing.assert_close(got_t, A.sparse_delta_linear_reference(x, deltas, row_delta, threshold=0.5), **_tol(dtype))


def test_a_segment_table_of_slot_ids_is_translated_by_the_lookup_in_the_kernel(interpret):
    """segment_lookup: one table built on slot ids serves every layer; each reads its own indices (slots not
    among its deltas are left alone)."""
    from hf_deltazip.kernels import build_row_segments

    gen = torch.Generator().manual_seed(11)
    m, n, k = 6, 40, 64
    stack = prepare_stack(random_delta_stack(2, n, k, bits=4, group_size=32, generator=gen))
    im = A.input_major_deltas(stack)
    slots = torch.tensor([5, -1, 2, 5, 7, 2], dtype=torch.int32)  # slot 7 lives in another stack
    lookup = torch.full((16,), -1, dtype=torch.int32)
    lookup[5 + 1], lookup[2 + 1] = 1, 0
    x = _sparse_x(m, k, gen, torch.float32)
    out0 = torch.randn(m, n, generator=gen)
    got = A.sparse_delta_linear(x, im, slots, out=out0.clone(), segments=build_row_segments(slots), segment_lookup=lookup,
                                threshold=0.3)
    want = A.sparse_delta_linear_reference(x, im, lookup[slots.long() + 1], out0.clone(), threshold=0.3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[[1, 4]], out0[[1, 4]])  # the base row and the other stack's row: untouched
    with pytest.raises(ValueError, match="segment_lookup needs segments"):
        A.sparse_delta_linear(x, im, slots, segment_lookup=lookup)


def test_each_segment_skips_only_the_columns_its_own_rows_drop(interpret):
    gen = torch.Generator().manual_seed(11)
    m, n, k = 4, 24, 128
    stack = random_delta_stack(2, n, k, bits=4, group_size=32, scale_range=(0.01, 0.03), generator=gen)
    x = torch.randn(m, k, generator=gen)
    row_delta = torch.tensor([1, 0, 1, 0])
    x[row_delta == 1, 32:64] = 0.0  # delta 1's rows drop group 1; delta 0's rows keep it
    poisoned = copy.deepcopy(A.input_major_deltas(stack))
    poisoned.scales[1, 1] = float("nan")  # delta 1, group 1: must never be read
    got = A.sparse_delta_linear(x, poisoned, row_delta, block_n=32, block_k=32)
    assert torch.isfinite(got).all()
    assert torch.isfinite(A.sparse_delta_linear(x, poisoned, row_delta, block_n=32, block_k=32, inner_k=8)).all()
    torch.testing.assert_close(got, A.sparse_delta_linear_reference(x, A.input_major_deltas(stack), row_delta),
                               atol=1e-4, rtol=1e-4)
    poisoned.scales[0, 1] = float("nan")  # delta 0's rows keep group 1: the kernel has to read it
    assert torch.isnan(A.sparse_delta_linear(x, poisoned, row_delta, block_n=32, block_k=32)[row_delta == 0]).any()


@pytest.mark.parametrize("block_m", [1, 16])
def test_a_segment_longer_than_a_row_block_and_the_workspace_left_zero(interpret, block_m):
    # 20 rows on one delta (two row blocks of 16 through tl.dot, or 20 one-row passes), 3 on another,
    # k not a multiple of the tile; afterwards every workspace and counter the kernels used is zero
    gen = torch.Generator().manual_seed(21)
    m, n, k = 23, 40, 96
    stack = random_delta_stack(2, n, k, bits=4, group_size=32, scale_range=(0.01, 0.03), generator=gen)
    deltas = A.input_major_deltas(stack)
    x = _sparse_x(m, k, gen, torch.float32)
    row_delta = torch.tensor([0] * 10 + [1] * 3 + [0] * 10)
    got = A.sparse_delta_linear(x, deltas, row_delta, block_m=block_m, block_n=16, block_k=32)
    torch.testing.assert_close(got, A.sparse_delta_linear_reference(x, deltas, row_delta), atol=1e-4, rtol=1e-4)
    base = A.sparse_base_linear(x[:1], A.input_major_weight(torch.randn(n, k, generator=gen)), block_n=16, block_k=64)
    assert base.shape == (1, n)
    for ws, counters in A._WORKSPACES.values():
        assert not ws.any() and not counters.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("segment", [32, 1024])  # the base's lists: five segments (the last 22 wide), or one
def test_compacted_kept_inputs_give_the_masked_walks_result_and_read_nothing_dropped(interpret, monkeypatch, dtype,
                                                                                     segment):
    # the compacted walks (the delta kernel's default) against the masked ones and the reference: a row
    # with every input dropped, one with none dropped, one at 70 %; k = 150, not a multiple of any tile
    monkeypatch.setattr(A, "_BASE_SEGMENT", segment)
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 150
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    wt = A.input_major_weight(w)
    rows = [torch.zeros(1, k, dtype=dtype), (torch.rand(1, k, generator=gen) + 0.5).to(dtype),
            _sparse_x(1, k, gen, dtype, frac=0.7)]
    for x in rows:
        dense = (x.float() @ w.float().t()).to(dtype)
        for bk in (16, 32, 64):  # chunks of a segment of 32: two, one; 64: segments of 64
            got = A.sparse_base_linear(x, wt, block_n=16, block_k=bk, compact=True)
            torch.testing.assert_close(got, dense, **_tol(dtype))
            torch.testing.assert_close(A.sparse_base_linear(x, wt, block_n=16, block_k=bk, compact=False), dense,
                                       **_tol(dtype))
    # the list itself: the kept inputs' indices in order, their values, and the count per segment
    x = rows[2]
    idx, xv, cnt, _ = A._compacted(x, 0.0, False, k)
    kept = (x[0] != 0).nonzero().squeeze(1)
    assert cnt.tolist() == [[kept.numel()]]
    assert torch.equal(idx[0, :kept.numel()].long(), kept) and torch.equal(xv[0, :kept.numel()], x[0, kept])
    idx, xv, cnt, _ = A._compacted(x, 0.0, False, 32)  # per tile of 32 inputs (the last one 22 wide)
    for s in range(5):
        ks = kept[(kept >= 32 * s) & (kept < 32 * s + 32)]
        assert cnt[0, s] == ks.numel() and torch.equal(idx[0, 32 * s:32 * s + ks.numel()].long(), ks)
    # poisoned weight rows of dropped inputs: the compacted walk never reads them
    poisoned = wt.clone()
    poisoned[x[0] == 0] = float("nan")
    assert torch.isfinite(A.sparse_base_linear(x, poisoned, block_n=16, block_k=32, compact=True)).all()

    # deltas: 4-bit g32 on whole int32 words (n = 80), three deltas, five rows (one base-only, one
    # with every input dropped), k = 96; compacted walks in steps of 8 and 32 against the masked walk
    n, k = 80, 96
    stack = random_delta_stack(3, n, k, bits=4, group_size=32, scale_range=(0.01, 0.03), generator=gen)
    deltas = A.input_major_deltas(stack)
    x = _sparse_x(5, k, gen, dtype, frac=0.6)
    x[3] = 0
    row_delta = torch.tensor([2, -1, 0, 1, 0])
    base = torch.randn(5, n, generator=gen).to(dtype)
    want = A.sparse_delta_linear_reference(x, deltas, row_delta, out=base.clone())
    for kw in (dict(inner_k=8), dict(inner_k=0), dict(inner_k=16, compact=False)):
        got = A.sparse_delta_linear(x, deltas, row_delta, out=base.clone(), block_n=32, block_k=32, **kw)
        torch.testing.assert_close(got, want, **_tol(dtype), msg=lambda e, kw=kw: f"{kw}: {e}")
    got_t = A.sparse_delta_linear(x, deltas, row_delta, threshold=0.8, block_n=32, block_k=32)
    torch.testing.assert_close(got_t, A.sparse_delta_linear_reference(x, deltas, row_delta, threshold=0.8),
                               **_tol(dtype))
    poisoned = copy.deepcopy(deltas)
    poisoned.scales[1] = float("nan")  # delta 1's only row drops every input: its scales are never read
    torch.testing.assert_close(A.sparse_delta_linear(x, poisoned, row_delta, out=base.clone(), block_n=32, block_k=32),
                               want, **_tol(dtype))
    for ws, counters in A._WORKSPACES.values():
        assert not ws.any() and not counters.any()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_delta_walks_keep_precision_for_tiny_and_huge_inputs(interpret, bits):
    # the word walks take codes apart as float32 denormals and scale x by 2**64: inputs from 1e-9 to 1e15
    # (float32) give the reference's sums to float32 rounding, none lost to underflow or overflow
    gen = torch.Generator().manual_seed(bits)
    n, k = 64, 64
    stack = random_delta_stack(2, n, k, bits=bits, group_size=32, scale_range=(0.01, 0.03), generator=gen)
    deltas = A.input_major_deltas(stack)
    mags = torch.tensor([1e-9, 1e-3, 1.0, 1e5, 1e15])
    x = torch.randn(len(mags), k, generator=gen) * mags[:, None]
    row_delta = torch.tensor([0, 1, 0, 1, 0])
    want = A.sparse_delta_linear_reference(x, deltas, row_delta)
    for kw in (dict(inner_k=8), dict(inner_k=16, compact=False)):
        got = A.sparse_delta_linear(x, deltas, row_delta, block_n=32, block_k=32, **kw)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got / mags[:, None], want / mags[:, None], atol=1e-5, rtol=1e-4,
                                   msg=lambda e, kw=kw: f"{kw}: {e}")


@pytest.mark.parametrize("planar", [False, True])
def test_input_major_deltas_hold_the_same_delta(planar):
    gen = torch.Generator().manual_seed(5)
    stack = random_delta_stack(2, 20, 256, bits=4, group_size=64, generator=gen)
    if planar:
        stack = prepare_stack(stack)
        assert stack.layout_block
    deltas = A.input_major_deltas(stack)
    assert deltas.qweight.shape == (2, 256, 10) and deltas.scales.shape == (2, 4, 20)
    for i in range(2):
        assert torch.equal(deltas.dequantize(i), dequantize_delta(stack, i))
    assert deltas.nbytes() == stack.nbytes()  # the same bytes, laid out by input


def test_kernel_inputs_are_checked():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    with pytest.raises(ValueError, match="input-major"):
        A.sparse_base_linear(x, w)  # [N, K] given where [K, N] is wanted
    with pytest.raises(ValueError, match="cast x"):
        A.sparse_base_linear(x.half(), A.input_major_weight(w))
    with pytest.raises(ValueError, match="threshold"):
        A.sparse_base_linear(x, A.input_major_weight(w), threshold=-1.0)
    with pytest.raises(ValueError, match="2-, 4- or 8-bit"):
        A.input_major_deltas(random_delta_stack(1, 8, 64, bits=3, group_size=32, generator=gen))
    deltas = A.input_major_deltas(random_delta_stack(2, 8, 64, bits=4, group_size=32, generator=gen))
    with pytest.raises(ValueError, match="row_delta"):
        A.sparse_delta_linear(x, deltas, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        A.sparse_delta_linear(x, deltas, torch.tensor([0, 5]))


# --------------------------------------------------------------------------- calibration and applying
def _inputs_of(model, name, ids):
    """The input tensor the layer ``name`` receives in a forward pass (after any pre-forward hooks)."""
    seen = []
    mod = S.target_modules(model)[name]
    h = mod.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    return seen[0]


def test_calibrated_thresholds_drop_the_target_fraction_per_layer():
    model = copy.deepcopy(base_model("llama"))
    ids = calibration_ids(n=8, length=24, seed=1)
    ths = S.calibrate_activation_thresholds(model, ids, [0.25, 0.5])
    names = set(S.target_modules(model))
    assert "lm_head" not in names and "model.layers.1.mlp.down_proj" in names
    for s, th in ths.items():
        assert set(th.thresholds) == names and th.num_tokens == ids.numel()
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            x = _inputs_of(model, name, ids)
            assert abs(float((x.abs() <= th.thresholds[name]).float().mean()) - s) < 0.02, (s, name)
    # q/k/v read one tensor: one threshold
    t = ths[0.5].thresholds
    assert t["model.layers.0.self_attn.q_proj"] == t["model.layers.0.self_attn.k_proj"] == t["model.layers.0.self_attn.v_proj"]
    assert ths[0.25].thresholds["model.layers.0.mlp.up_proj"] < t["model.layers.0.mlp.up_proj"]


def test_installed_thresholds_zero_small_inputs_and_remove_restores_dense_outputs():
    model = copy.deepcopy(base_model("gpt2"))  # Conv1D layers
    ids = calibration_ids(n=2, length=16, seed=2)
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    th = S.calibrate_activation_thresholds(model, ids, 0.4)
    name = "transformer.h.0.mlp.c_proj"
    arrived = []  # registered before the thresholding hook: sees the input before it
    h = S.target_modules(model)[name].register_forward_pre_hook(lambda m, args: arrived.append(args[0].clone()))
    assert S.install_activation_sparsity(model, th) == len(th.thresholds)
    assert S.activation_sparsity_of(model) == th.thresholds
    after = _inputs_of(model, name, ids)
    h.remove()
    before = arrived[0]
    t = th.thresholds[name]
    torch.testing.assert_close(after, torch.where(before.abs() > t, before, torch.zeros_like(before)))
    assert 0.3 < float((after == 0).float().mean()) < 0.5
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, dense)
    S.install_activation_sparsity(model, None)
    assert S.activation_sparsity_of(model) == {}
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense)


def test_decode_only_sparsity_leaves_prompts_dense_and_one_pass_reproduces_decoding():
    model = copy.deepcopy(base_model("llama")).eval()
    ids = calibration_ids(n=1, length=12, seed=5)
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.5)
    p = 5
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        S.install_activation_sparsity(model, th, decode_only=True)
        assert torch.equal(model(input_ids=ids).logits, dense)  # several tokens per row: a prefill, dense
        # a prompt of p tokens prefilled, then one token per step: those steps are thresholded
        from transformers import DynamicCache

        # the cache argument's name changed in transformers 5.2x; the cache object is updated in place
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = DynamicCache()
        steps = [model(input_ids=ids[:, :p], use_cache=True, **{key: cache}).logits[:, -1]]
        for t in range(p, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t:t + 1], use_cache=True, **{key: cache}).logits[:, -1])
        decoded = torch.stack(steps, dim=1)  # logits at positions p - 1 .. end
        assert not torch.allclose(decoded[:, 1:], dense[:, p:], atol=1e-3)
        # one teacher-forced pass with positions >= p thresholded computes the same
        with S.sparsify_positions_from(p):
            one_pass = model(input_ids=ids).logits
        torch.testing.assert_close(one_pass[:, p - 1:], decoded, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(one_pass[:, :p], dense[:, :p], atol=1e-5, rtol=1e-5)
        # every token thresholded (the default) differs from both on the prompt
        S.install_activation_sparsity(model, th)
        assert not torch.allclose(model(input_ids=ids).logits[:, :p], dense[:, :p], atol=1e-3)
    with pytest.raises(ValueError, match="position"):
        with S.sparsify_positions_from(-1):
            pass


def test_jacobi_decoding_under_decode_only_sparsity_equals_greedy_of_the_same_model():
    from hf_deltazip.decoding import jacobi_generate
    from hf_deltazip.serving import DecodeEngine

    model = copy.deepcopy(base_model("llama")).eval()
    S.install_activation_sparsity(model, S.calibrate_activation_thresholds(model, calibration_ids(), 0.5),
                                  decode_only=True)
    ids = calibration_ids(n=1, length=6, seed=8)
    greedy = model.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    dense = copy.deepcopy(base_model("llama")).eval().generate(ids, do_sample=False, max_new_tokens=20,
                                                               pad_token_id=0, eos_token_id=None)
    assert not torch.equal(greedy, dense)  # the thresholds change this model's greedy output
    # wide Jacobi steps are decode steps: thresholded like one-token steps, so the output is that greedy output
    got = jacobi_generate(model, ids, block_size=4, max_new_tokens=20, min_accept=None, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, greedy)
    engine = DecodeEngine(model, max_batch_size=2, max_length=64, cuda_graphs=False, jacobi_min_accept=None)
    out = engine.run([ids[0].tolist()], max_new_tokens=20, decoding="jacobi", jacobi_block_size=4, eos_token_id=None)
    assert out[0] == greedy[0, ids.shape[1]:].tolist()


def test_thresholds_file_keeps_every_target_and_refuses_what_it_lacks(tmp_path):
    model = copy.deepcopy(base_model("llama"))
    ths = S.calibrate_activation_thresholds(model, calibration_ids(), [0.25, 0.4])
    ths[0.25].save(tmp_path)
    path = ths[0.4].save(tmp_path)
    assert path.name == S.THRESHOLDS_FILENAME and S.sparsity_targets(tmp_path) == [0.25, 0.4]
    for s in (0.25, 0.4):
        assert S.ActivationThresholds.load(tmp_path, s) == ths[s]
    with pytest.raises(DeltaZipError, match="0.25, 0.4|0.2500, 0.4000"):
        S.ActivationThresholds.load(tmp_path, 0.5)
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(DeltaZipError, match="not an activation thresholds file"):
        S.ActivationThresholds.load(tmp_path / "other.json", 0.4)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        S.ActivationThresholds(1.5, {})
    with pytest.raises(DeltaZipError, match="do not fit this model"):
        S.install_activation_sparsity(copy.deepcopy(base_model("gpt2")), ths[0.4])
    assert S.install_activation_sparsity(model, ths[0.4], strict=True) > 0


def test_centred_calibration_records_each_inputs_mean_and_thresholds_its_deviations():
    model = copy.deepcopy(base_model("llama"))
    ids = calibration_ids(n=8, length=24, seed=1)
    th = S.calibrate_activation_thresholds(model, ids, 0.5, centre=True, samples_per_call=1 << 20)
    assert set(th.centres) == set(th.thresholds)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        x = _inputs_of(model, name, ids).reshape(-1, th.centres[name].numel())
        mu = x.double().mean(0).float()
        torch.testing.assert_close(th.centres[name], mu, rtol=1e-5, atol=1e-6)
        dev = (x - mu).abs()
        assert abs(float((dev <= th.thresholds[name]).float().mean()) - 0.5) < 0.02, name
    plain = S.calibrate_activation_thresholds(model, ids, 0.5, samples_per_call=1 << 20)
    assert plain.centres == {} and plain.thresholds != th.thresholds
    with pytest.raises(ValueError, match="allocation='uniform' only"):
        S.calibrate_activation_thresholds(model, ids, 0.5, centre=True, allocation="measured")
    with pytest.raises(ValueError, match="no threshold"):
        S.ActivationThresholds(0.5, {"a": 1.0}, centres={"b": torch.zeros(3)})
    with pytest.raises(ValueError, match="finite vector"):
        S.ActivationThresholds(0.5, {"a": 1.0}, centres={"a": torch.tensor([float("nan")])})


@pytest.mark.parametrize("rank", [0, 4])
def test_centred_thresholds_drop_inputs_to_their_centre_and_compensate_the_deviation(rank):
    model = copy.deepcopy(base_model("llama"))
    ids = calibration_ids(n=4, length=16, seed=3)
    th = S.calibrate_activation_thresholds(model, ids, 0.5, centre=True, rank=rank)
    name = "model.layers.1.mlp.down_proj"
    mod = S.target_modules(model)[name]
    x = _inputs_of(model, name, ids)
    with torch.no_grad():
        dense = mod(x)
    S.install_activation_sparsity(model, th)
    mu, t = th.centres[name], th.thresholds[name]
    y = torch.where((x - mu).abs() > t, x, mu.expand_as(x))
    assert 0.3 < float((y == mu).float().mean()) < 0.7
    with torch.no_grad():
        got = mod(x)
        want = torch.nn.functional.linear(y, mod.weight, mod.bias)
        if rank:
            a, b = S._RULES[mod].factors
            want = want + torch.nn.functional.linear(torch.nn.functional.linear(x - y, a), b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, dense, atol=1e-4)
    small = dict(th.centres)
    small[name] = small[name][:-1]  # a centre of another model's width
    with pytest.raises(DeltaZipError, match="calibrated on another model"):
        S.install_activation_sparsity(model, S.ActivationThresholds(0.5, th.thresholds, centres=small))
    assert S._RULES[mod].centre is not None  # the refused call left the installed thresholds


def test_centred_thresholds_round_trip_with_their_centres_beside_the_file(tmp_path):
    model = copy.deepcopy(base_model("llama"))
    ids = calibration_ids()
    centred = S.calibrate_activation_thresholds(model, ids, 0.4, centre=True)
    plain = S.calibrate_activation_thresholds(model, ids, 0.25)
    plain.save(tmp_path)
    doc = json.loads((tmp_path / S.THRESHOLDS_FILENAME).read_text())
    assert doc["version"] == 1 and not (tmp_path / S.CENTRES_FILENAME).exists()
    centred.save(tmp_path)
    doc = json.loads((tmp_path / S.THRESHOLDS_FILENAME).read_text())
    assert doc["version"] == 2 and doc["targets"]["0.4000"]["centred"] is True  # older readers refuse it
    assert S.ActivationThresholds.load(tmp_path, 0.4) == centred
    assert S.ActivationThresholds.load(tmp_path, 0.25) == plain and S.ActivationThresholds.load(tmp_path, 0.25).centres == {}
    again = S.calibrate_activation_thresholds(model, calibration_ids(n=2, seed=4), 0.4, centre=True)
    again.save(tmp_path)  # the target's centres replaced, the other target kept
    assert S.ActivationThresholds.load(tmp_path, 0.4) == again != centred
    (tmp_path / S.CENTRES_FILENAME).write_bytes(b"not safetensors")
    with pytest.raises(DeltaZipError, match="not a readable safetensors file"):
        S.ActivationThresholds.load(tmp_path, 0.4)
    (tmp_path / S.CENTRES_FILENAME).unlink()
    with pytest.raises(DeltaZipError, match="activation_centres.safetensors"):
        S.ActivationThresholds.load(tmp_path, 0.4)
    assert S.ActivationThresholds.load(tmp_path, 0.25) == plain  # an uncentred target needs no centres
    doc["version"] = 3
    (tmp_path / S.THRESHOLDS_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(DeltaZipError, match="newer hf-deltazip"):
        S.ActivationThresholds.load(tmp_path, 0.25)


def _dense_wt(mod):
    return mod.weight.detach().t() if not isinstance(mod, torch.nn.Linear) else mod.weight.detach()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # nn.Linear and transformers' Conv1D
def test_low_rank_compensation_passes_the_dropped_inputs_through_the_top_singular_directions(kind):
    model = copy.deepcopy(base_model(kind)).eval()
    ids = calibration_ids(n=2, length=12, seed=6)
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.5)
    assert th.rank == S.DEFAULT_RANK == 16  # new calibrations record the default compensation
    mods = S.target_modules(model)
    name = next(n for n in mods if n.endswith(("mlp.down_proj", "mlp.c_proj")))
    mod = mods[name]
    seen = []
    h = mod.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))  # before the rule's hook
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        for r in (0, 3):
            S.install_activation_sparsity(model, th, rank=r)
            seen.clear()
            got = []
            h2 = mod.register_forward_hook(lambda m, args, out: got.append(out.detach().clone()))
            model(input_ids=ids)
            h2.remove()
            x = seen[0]
            kept = torch.where(x.abs() > th.thresholds[name], x, torch.zeros_like(x))
            w = _dense_wt(mod)
            want = kept @ w.t() + (0 if mod.bias is None else mod.bias)
            if r:
                u, sv, vh = torch.linalg.svd(w.float(), full_matrices=False)
                want = want + (x - kept) @ (u[:, :r] * sv[:r] @ vh[:r]).t()
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-4)
        # a rank as large as the weight is exact: every layer computes W x, so the model is dense again
        S.install_activation_sparsity(model, th, rank=10_000)
        torch.testing.assert_close(model(input_ids=ids).logits, dense, atol=1e-4, rtol=1e-4)
        S.install_activation_sparsity(model, th, rank=0)
        assert not torch.allclose(model(input_ids=ids).logits, dense, atol=1e-3)
    h.remove()
    with pytest.raises(ValueError, match="rank"):
        S.install_activation_sparsity(model, th, rank=-1)
    with pytest.raises(ValueError, match="rank"):
        S.ActivationThresholds(0.4, {}, rank=1.5)


def test_compensation_is_refused_on_a_tensor_parallel_model(monkeypatch):
    from hf_deltazip.modeling import tensor_parallel

    model = copy.deepcopy(base_model("llama"))
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.4)
    S.install_activation_sparsity(model, th, rank=0)
    monkeypatch.setattr(tensor_parallel, "tp_size", lambda m: 2)
    with pytest.raises(DeltaZipError, match="tensor-parallel.*rank=0"):
        S.install_activation_sparsity(model, th)
    assert S.activation_sparsity_of(model) == th.thresholds  # a refused call keeps what was installed
    assert S.install_activation_sparsity(model, th, rank=0) == len(th.thresholds)


def test_low_rank_factors_of_a_large_weight_find_its_top_directions():
    # above 1024 on both sides the factors come from a seeded randomized SVD; the global random state is untouched
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(1100, 6, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(1030, 6, generator=gen))[0]
    w = (u * torch.tensor([50.0, 30, 20, 10, 5, 1])) @ v.t() + 1e-4 * torch.randn(1100, 1030, generator=gen)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = S.low_rank_factors(w, 5)
    assert torch.equal(torch.rand(1), before)
    assert a.shape == (5, 1030) and b.shape == (1100, 5)
    best = (u[:, :5] * torch.tensor([50.0, 30, 20, 10, 5])) @ v[:, :5].t()
    torch.testing.assert_close(b @ a, best, atol=2e-3, rtol=0)
    a2, b2 = S.low_rank_factors(w, 5)
    assert torch.equal(a, a2) and torch.equal(b, b2)  # deterministic


def test_thresholds_files_keep_the_compensation_rank(tmp_path):
    model = copy.deepcopy(base_model("llama"))
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.4, rank=8)
    th.save(tmp_path)
    back = S.ActivationThresholds.load(tmp_path, 0.4)
    assert back == th and back.rank == 8
    doc = json.loads((tmp_path / S.THRESHOLDS_FILENAME).read_text())
    del doc["targets"]["0.4000"]["rank"]  # a file from before the compensation existed: none
    (tmp_path / S.THRESHOLDS_FILENAME).write_text(json.dumps(doc))
    assert S.ActivationThresholds.load(tmp_path, 0.4).rank == 0


@pytest.fixture(scope="module")
def delta_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("act") / "delta"
    cfg = DeltaZipConfig(n_samples=8, seq_len=24, bits=4, group_size=32)
    compress(base_model("llama"), finetune("llama", 1), cfg, calibration=calibration_ids(), progress=False).save_pretrained(folder)
    return folder


def test_delta_model_applies_thresholds_to_base_and_delta_rows(delta_folder, tmp_path):
    ids = calibration_ids(n=3, length=12, seed=4)
    folder = tmp_path / "delta"
    import shutil

    shutil.copytree(delta_folder, folder)
    with pytest.raises(DeltaZipError, match="activation_calibration"):
        DeltaModel.from_pretrained(folder, base=copy.deepcopy(base_model("llama")), activation_sparsity=0.4)
    model = DeltaModel.from_pretrained(folder, base=copy.deepcopy(base_model("llama")), activation_sparsity=0.4,
                                       activation_calibration=calibration_ids())
    th = S.ActivationThresholds(0.4, S.activation_sparsity_of(model))
    assert len(th.thresholds) == len(S.target_modules(base_model("llama")))
    th.save(folder)
    model = DeltaModel.from_pretrained(folder, base=copy.deepcopy(base_model("llama")), activation_sparsity=0.4,
                                       activation_decode_only=True)
    assert S.activation_sparsity_of(model) == th.thresholds
    with torch.no_grad():  # decode-only: a forward over several tokens is dense
        torch.testing.assert_close(model(input_ids=ids[:1]).logits,
                                   model.merge_and_unload("default")(input_ids=ids[:1]).logits, atol=1e-5, rtol=1e-5)
    model = DeltaModel.from_pretrained(folder, base=copy.deepcopy(base_model("llama")), activation_sparsity=0.4)
    assert S.activation_sparsity_of(model) == th.thresholds
    rows = ["default", None, "default"]
    with torch.no_grad():
        mixed = model(input_ids=ids, delta_names=rows).logits
        for i, name in enumerate(rows):
            ref = copy.deepcopy(base_model("llama")) if name is None else model.merge_and_unload(name)
            assert S.activation_sparsity_of(ref) == {}  # merged copies come out dense
            dense = ref(input_ids=ids[i : i + 1]).logits[0]
            S.install_activation_sparsity(ref, th)
            torch.testing.assert_close(mixed[i], ref(input_ids=ids[i : i + 1]).logits[0], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(mixed[i], dense, atol=1e-3)
        model.set_activation_sparsity(None)
        plain = model(input_ids=ids, delta_names=rows).logits
        assert torch.equal(plain[0], model.merge_and_unload("default")(input_ids=ids[:1]).logits[0])


def test_delta_model_compensates_dropped_inputs_through_the_base_weights(delta_folder):
    """In a DeltaModel the compensation is the base weight's: y = (W + D) x_kept + B_W A_W x_dropped, for base
    and delta rows alike (a delta's own dropped inputs are not compensated)."""
    ids = calibration_ids(n=3, length=12, seed=4)
    model = DeltaModel.from_pretrained(delta_folder, base=copy.deepcopy(base_model("llama")))
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.4, rank=4)
    assert model.set_activation_sparsity(th) == len(th.thresholds)
    rows = ["default", None, "default"]
    plain = base_model("llama")
    with torch.no_grad():
        mixed = model(input_ids=ids, delta_names=rows).logits
        for i, name in enumerate(rows):
            ref = copy.deepcopy(plain) if name is None else model.merge_and_unload(name)
            mods, base_mods = S.target_modules(ref), S.target_modules(plain)
            hooks, stash = [], {}
            for n, mod in mods.items():  # the original input, then the merged layer on the kept inputs plus
                a, b = S.low_rank_factors(_dense_wt(base_mods[n]), 4)  # the base's rank-4 map of the dropped ones
                hooks.append(mod.register_forward_pre_hook(lambda m, args, n=n: stash.__setitem__(n, args[0])))
                hooks.append(mod.register_forward_hook(
                    lambda m, args, out, n=n, a=a, b=b: out + (stash[n] - args[0]) @ a.t() @ b.t()))
            S.install_activation_sparsity(ref, th, rank=0)  # its hooks after the ones above
            want = ref(input_ids=ids[i : i + 1]).logits[0]
            for h_ in hooks:
                h_.remove()
            torch.testing.assert_close(mixed[i], want, atol=1e-5, rtol=1e-5)
            S.install_activation_sparsity(ref, th, rank=0)
            assert not torch.allclose(mixed[i], ref(input_ids=ids[i : i + 1]).logits[0], atol=1e-4)
        model.set_activation_sparsity(th, rank=0)  # the rank can be overridden
        no_comp = model(input_ids=ids, delta_names=rows).logits
        assert not torch.allclose(no_comp, mixed, atol=1e-4)


def test_set_activation_sparsity_takes_a_thresholds_file(delta_folder, tmp_path):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(delta_folder, delta_name="d")
    th = S.calibrate_activation_thresholds(model, calibration_ids(), [0.3, 0.5])
    th[0.3].save(tmp_path)
    assert model.set_activation_sparsity(tmp_path) == len(th[0.3].thresholds)
    assert S.activation_sparsity_of(model) == th[0.3].thresholds
    th[0.5].save(tmp_path)  # two targets in the file: which one is ambiguous
    with pytest.raises(DeltaZipError, match="pass activation_sparsity"):
        model.set_activation_sparsity(tmp_path)
    model.set_activation_sparsity(S.ActivationThresholds.load(tmp_path, 0.5))
    assert S.activation_sparsity_of(model) == th[0.5].thresholds
    assert model.set_activation_sparsity(None) == 0 and S.activation_sparsity_of(model) == {}


# --------------------------------------------------------------------------- compiled (GPU)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernels_match_references_on_gpu(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 8, 1000, 4096 + 128
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(dtype)
    wt = A.input_major_weight(w)
    for rows in (1, m):
        got = A.sparse_base_linear(x[:rows], wt, threshold=0.6)
        torch.testing.assert_close(got, A.sparse_base_linear_reference(x[:rows], wt, threshold=0.6), atol=3e-2, rtol=2e-2)
    stack = prepare_stack(random_delta_stack(4, n, k, bits=4, group_size=128, device="cuda", generator=gen,
                                             scale_range=(0.01, 0.03)))
    deltas = A.input_major_deltas(stack)
    rd = torch.tensor([3, -1, 0, 3, 1, 1, 2, 0], device="cuda")
    base = torch.nn.functional.linear(x, w)
    got = A.sparse_delta_linear(x, deltas, rd, out=base.clone(), threshold=0.6)
    want = A.sparse_delta_linear_reference(x, deltas, rd, out=base, threshold=0.6)
    torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=2e-2)
    # programmatic dependent launch (on by default on Hopper) and the grouped base launch: the same sums up
    # to the order of the float32 atomic adds (one rounding of the output)
    # 2-bit deltas (their own default tiles for a mixed batch)
    d2 = A.input_major_deltas(prepare_stack(random_delta_stack(4, n, k, bits=2, group_size=128, device="cuda",
                                                               generator=gen, scale_range=(0.01, 0.03))))
    torch.testing.assert_close(A.sparse_delta_linear(x, d2, rd, out=base.clone(), threshold=0.6).float(),
                               A.sparse_delta_linear_reference(x, d2, rd, out=base, threshold=0.6).float(),
                               atol=6e-2, rtol=2e-2)
    # the word walks read codes as float32 denormals and scale x by 2**64: compiled, no flush to zero, no
    # overflow; rows from 1e-6 to 1e15 (float16: 1e3) against the reference, row by row relative to its size
    mags = torch.tensor([1e-6, 1e-3, 1.0, 1e15 if dtype == torch.bfloat16 else 1e3] * 2, device="cuda")
    xm = (x.float() * mags[:, None]).to(dtype)
    got_m = A.sparse_delta_linear(xm, deltas, rd)
    want_m = A.sparse_delta_linear_reference(xm, deltas, rd)
    assert torch.isfinite(got_m.float()).all()
    torch.testing.assert_close(got_m.float() / mags[:, None], want_m.float() / mags[:, None], atol=6e-2, rtol=2e-2)
    same = dict(atol=1e-2, rtol=1e-2)
    if torch.cuda.get_device_capability()[0] >= 9:
        for pdl in (0, 1, 2):
            torch.testing.assert_close(A.sparse_delta_linear(x, deltas, rd, out=base.clone(), threshold=0.6, pdl=pdl),
                                       got, **same)
            torch.testing.assert_close(A.sparse_base_linear(x[:1], wt, threshold=0.6, pdl=pdl),
                                       A.sparse_base_linear(x[:1], wt, threshold=0.6, pdl=0), **same)
    w2t = A.input_major_weight((torch.randn(300, k, generator=gen, device="cuda") * 0.02).to(dtype))
    for rows in (1, m):
        q, kv = A.sparse_base_linears(x[:rows], [wt, w2t], threshold=0.6)
        torch.testing.assert_close(q, A.sparse_base_linear_reference(x[:rows], wt, threshold=0.6), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(kv, A.sparse_base_linear_reference(x[:rows], w2t, threshold=0.6), atol=3e-2, rtol=2e-2)
    # the low-rank compensation (rank 16, the default): z per 1024-input segment by the packing launch, B z by
    # the finishing one; grouped (q/k/v-like: three weights) and alone, one row and eight, PDL on and off
    from hf_deltazip.modeling.activation_sparsity import low_rank_factors

    w3 = (torch.randn(200, k, generator=gen, device="cuda") * 0.02).to(dtype)
    ws3 = [w, (torch.randn(300, k, generator=gen, device="cuda") * 0.02).to(dtype), w3]
    lr3 = A.input_major_low_rank([low_rank_factors(wi, 16) for wi in ws3])
    lr1 = A.input_major_low_rank([low_rank_factors(w, 16)])
    for rows in (1, m):
        for pdl in ((0, 2) if torch.cuda.get_device_capability()[0] >= 9 else (0,)):
            one = A.sparse_base_linear(x[:rows], wt, threshold=0.6, lowrank=lr1, pdl=pdl)
            torch.testing.assert_close(one, A.sparse_base_linear_reference(x[:rows], wt, threshold=0.6, lowrank=lr1),
                                       atol=3e-2, rtol=2e-2)
            outs = A.sparse_base_linears(x[:rows], [A.input_major_weight(wi) for wi in ws3], threshold=0.6,
                                         lowrank=lr3, pdl=pdl)
            for o, wi, part in zip(outs, ws3, A._split_lowrank(lr3, [wi.shape[0] for wi in ws3])):
                torch.testing.assert_close(o, A.sparse_base_linear_reference(x[:rows], A.input_major_weight(wi),
                                                                             threshold=0.6, lowrank=part),
                                           atol=3e-2, rtol=2e-2)
        assert not torch.allclose(one.float(), A.sparse_base_linear(x[:rows], wt, threshold=0.6).float(), atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_inputs_equal_to_the_rounded_threshold_are_dropped_as_sparsify_input_drops_them(interpret, dtype):
    # 0.6 is not a float16 number: float16 inputs equal to float16(0.6) = 0.60009765625 lie above a
    # float32 0.6 but not above the threshold rounded to float16, which is what sparsify_input compares
    gen = torch.Generator().manual_seed(3)
    m, n, k = 3, 40, 64
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[:, ::5] = torch.tensor(0.6, dtype=dtype)
    assert (A.sparsify_input(x, 0.6)[:, ::5] == 0).all()
    w = torch.randn(n, k, generator=gen).to(dtype)
    got = A.sparse_base_linear(x, A.input_major_weight(w), threshold=0.6, block_n=32, block_k=32)
    torch.testing.assert_close(got, A.sparse_base_linear_reference(x, A.input_major_weight(w), threshold=0.6), **_tol(dtype))
    torch.testing.assert_close(got, (A.sparsify_input(x, 0.6).float() @ w.float().t()).to(dtype), **_tol(dtype))
    stack = random_delta_stack(2, n, k, bits=4, group_size=32, scale_range=(0.2, 0.3), generator=gen)
    deltas = A.input_major_deltas(stack)
    rd = torch.tensor([1, 0, 1])
    got = A.sparse_delta_linear(x, deltas, rd, threshold=0.6, block_n=32, block_k=32)
    torch.testing.assert_close(got, A.sparse_delta_linear_reference(x, deltas, rd, threshold=0.6), **_tol(dtype))


def test_quality_bench_scores_decode_only_sparsity_after_a_dense_prefix(tmp_path):
    from hf_deltazip.bench import act_sparsity as bench

    runs = {}
    for prefix in (None, 0.5):
        out = tmp_path / f"q{prefix}.json"
        argv = ["quality", "--tiny", "--sparsity", "0.5", "--device", "cpu", "--json", str(out)]
        assert bench.main(argv + (["--dense-prefix", str(prefix)] if prefix else [])) == 0
        runs[prefix] = json.loads(out.read_text())
    assert runs[0.5]["dense_prefix"] == 0.5 and runs[None]["dense_prefix"] is None
    def nll(result, s, ev):
        return next(r["nll"] for r in result["rows"] if r["model"] == "fine-tune" and r["sparsity"] == s and r["eval"] == ev)

    assert {r["eval"] for r in runs[None]["rows"]} == {"task"}
    assert {r["eval"] for r in runs[0.5]["rows"]} == {"task, decode-only", "task, every token"}
    # dense: the same second halves either way, other positions than the whole-sequence score
    assert nll(runs[0.5], 0.0, "task, decode-only") == nll(runs[0.5], 0.0, "task, every token") != nll(runs[None], 0.0, "task")
    # thresholded: a dense first half changes what the second half sees
    assert nll(runs[0.5], 0.5, "task, decode-only") != nll(runs[0.5], 0.5, "task, every token")
    with pytest.raises(SystemExit):
        bench.main(["quality", "--tiny", "--dense-prefix", "1.5"])
    with pytest.raises(SystemExit, match="real-pair"):  # no prompts to take the lengths of
        bench.main(["quality", "--tiny", "--sparsity", "0.5", "--dense-prefix", "prompt"])


def test_quality_bench_measures_centred_thresholds_and_saves_their_centres(tmp_path):
    from hf_deltazip.bench import act_sparsity as bench

    runs = {}
    for centre in (False, True):
        out = tmp_path / f"c{centre}.json"
        argv = ["quality", "--tiny", "--sparsity", "0.5", "--device", "cpu", "--json", str(out),
                "--save-thresholds", str(tmp_path / f"th{centre}")]
        assert bench.main(argv + (["--centre"] if centre else [])) == 0
        runs[centre] = json.loads(out.read_text())
    assert runs[True]["centred"] is True and runs[False]["centred"] is False
    assert "centred thresholds" in bench.quality_table(runs[True]) and "centred" not in bench.quality_table(runs[False])

    def nll(result):
        return next(r["nll"] for r in result["rows"] if r["model"] == "fine-tune" and r["sparsity"] == 0.5)

    assert nll(runs[True]) != nll(runs[False])
    saved = S.ActivationThresholds.load(tmp_path / "thTrue", 0.5)
    assert saved.centres and set(saved.centres) == set(saved.thresholds)
    assert (tmp_path / "thTrue" / S.CENTRES_FILENAME).is_file()
    assert S.ActivationThresholds.load(tmp_path / "thFalse", 0.5).centres == {}


def test_thresholds_beside_a_delta_go_stale_when_another_delta_is_saved_there(delta_folder, tmp_path):
    import shutil

    from hf_deltazip.delta import CompressedDelta

    folder = tmp_path / "d"
    shutil.copytree(delta_folder, folder)
    model = copy.deepcopy(base_model("llama"))
    ths = S.calibrate_activation_thresholds(model, calibration_ids(), [0.25, 0.4])
    ths[0.25].save(folder)
    ths[0.4].save(folder)
    assert S.ActivationThresholds.load(folder, 0.4) == ths[0.4]
    CompressedDelta.from_pretrained(folder).save_pretrained(folder)  # the same delta saved again: still its thresholds
    assert S.sparsity_targets(folder) == [0.25, 0.4]
    other = compress(base_model("llama"), finetune("llama", 2), DeltaZipConfig(bits=4, group_size=32), progress=False)
    other.save_pretrained(folder)  # another delta in the folder: the thresholds there are not its own
    with pytest.raises(DeltaZipError, match="calibrated with another delta"):
        S.ActivationThresholds.load(folder, 0.4)
    with pytest.raises(DeltaZipError, match="calibrated with another delta"):
        DeltaModel.from_pretrained(folder, base=copy.deepcopy(base_model("llama")), activation_sparsity=0.4)
    ths[0.4].save(folder)  # saved again: a fresh file for this delta, without the stale 0.25 target
    assert S.sparsity_targets(folder) == [0.4]
    assert S.ActivationThresholds.load(folder, 0.4) == ths[0.4]


def test_python_docs_texts_are_deterministic_english_prose():
    """`--texts python-docs`: general text for the NLL measurement that every CPython ships (no download)."""
    from pathlib import Path

    from hf_deltazip.bench import act_sparsity

    docs = act_sparsity.python_reference_documents()
    assert len(docs) >= 20 and all(len(d) >= 1500 for d in docs)
    assert docs == act_sparsity.python_reference_documents()  # the same order every run
    assert act_sparsity._texts_from_file(Path(act_sparsity.PYTHON_DOCS)) == docs
    assert docs != act_sparsity.python_reference_documents(seed=1)
    words = " ".join(docs).split()
    assert sum(w.lower() in {"the", "is", "of", "a"} for w in words) > len(words) / 20  # prose, not code


def test_quality_bench_scores_general_text_from_the_tokenizers_bos(tmp_path):
    """General text is scored as the model reads a document, with the special tokens its tokenizer adds (a
    Gemma base without its BOS scores far worse and reacts to thresholds differently)."""
    import argparse

    from tokenizers.processors import TemplateProcessing

    from hf_deltazip.bench import act_sparsity as bench
    from hf_deltazip.bench.pairs import BOS_TOKEN, build_tokenizer, tiny_model

    tok = build_tokenizer()
    bos = tok.convert_tokens_to_ids(BOS_TOKEN)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos)])
    folder = tmp_path / "base"
    tiny_model("llama", vocab_size=len(tok), seed=0, hidden_size=64, num_layers=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    texts = tmp_path / "docs.txt"
    texts.write_text("\n\n".join(f"Document {i} says that the value of x is {i * 7} and nothing more." for i in range(6)))
    args = argparse.Namespace(tiny=False, real_pair=None, pair=None, base=str(folder), finetune=str(folder),
                              texts=str(texts), max_length=8, calibration_texts=4)
    pair = bench._load_pair(args, "cpu", torch.float32)
    seqs = pair["calibration"] + pair["eval"]["text"]
    assert len(seqs) == 6 and all(s[0] == bos and 1 < len(s) <= 8 for s in seqs)
    assert sum(s.count(bos) for s in seqs) == 6  # one, first
    assert bench._ids(tok, ["Document 1"], 8) == [tok("Document 1", add_special_tokens=False)["input_ids"]]


def test_quality_bench_thresholds_only_the_layers_asked_for(tmp_path):
    """--layers: only the named layer kinds are thresholded (the others keep every input), so their NLL lies
    between dense and every layer thresholded; a name that matches nothing is refused."""
    from hf_deltazip.bench import act_sparsity as bench

    def run(extra):
        out = tmp_path / "r.json"
        assert bench.main(["quality", "--tiny", "--sparsity", "0.5", "--device", "cpu", "--json", str(out)] + extra) == 0
        r = json.loads(out.read_text())
        return {s: next(x["nll"] for x in r["rows"] if x["model"] == "fine-tune" and x["sparsity"] == s) for s in (0.0, 0.5)}, r

    every, _ = run([])
    mlp, r = run(["--layers", "gate_proj,up_proj,down_proj"])
    assert r["layers"] == ["gate_proj", "up_proj", "down_proj"]
    assert mlp[0.0] == every[0.0] and mlp[0.5] != every[0.5] and mlp[0.5] != mlp[0.0]
    th = S.calibrate_activation_thresholds(base_model("llama"), calibration_ids(), 0.5)
    only = bench._only(th, ["down_proj"])
    assert all((t == 0.0) != n.endswith("down_proj") for n, t in only.thresholds.items())
    one = bench._only(th, ["layers.1.mlp.up_proj", "layers.1.mlp.gate_proj"])
    assert {n for n, t in one.thresholds.items() if t > 0} == {"model.layers.1.mlp.up_proj", "model.layers.1.mlp.gate_proj"}
    with pytest.raises(DeltaZipError, match="matches no layer"):
        bench._only(th, ["c_fc"])
    with pytest.raises(DeltaZipError, match="matches no layer"):  # a part of a name is not a match
        bench._only(th, ["_proj"])


def test_measured_allocation_keeps_the_weighted_mean_and_spares_the_costly_layers(tmp_path, monkeypatch):
    """allocation="measured": each group of layers reading one tensor gets one of the levels, the size-weighted
    mean reaches the target (by at most one level step of the largest group), each threshold drops about its
    level of the calibration inputs, the file keeps it all; a group whose thresholding costs the most NLL is
    the one left densest."""
    model = copy.deepcopy(base_model("llama"))
    ids = calibration_ids(n=8, length=24, seed=1)
    th = S.calibrate_activation_thresholds(model, ids, 0.4, allocation="measured")
    mods = S.target_modules(model)
    assert th.allocation == "measured" and set(th.layer_sparsity) == set(th.thresholds) == set(mods)
    assert set(th.layer_sparsity.values()) <= {0.0, *S.MEASURED_LEVELS}
    size = {n: mods[n].weight.numel() for n in mods}
    total = sum(size.values())
    mean = sum(th.layer_sparsity[n] * size[n] for n in mods) / total
    assert 0.4 - 1e-9 <= mean <= 0.4 + 0.2 * 2 * size["model.layers.0.mlp.up_proj"] / total
    for layer in (0, 1):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        assert th.thresholds[attn + "q_proj"] == th.thresholds[attn + "k_proj"] == th.thresholds[attn + "v_proj"]
        assert th.layer_sparsity[mlp + "gate_proj"] == th.layer_sparsity[mlp + "up_proj"]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        x = _inputs_of(model, name, ids)
        assert abs(float((x.abs() <= th.thresholds[name]).float().mean()) - th.layer_sparsity[name]) < 0.03, name
    assert S.activation_sparsity_of(model) == {}  # calibrating leaves nothing installed
    th.save(tmp_path)
    assert S.ActivationThresholds.load(tmp_path, 0.4) == th

    # costs measured through the model: make one group's thresholding ruinous, and it stays dense
    costly = "model.layers.1.mlp.down_proj"
    real = S._mean_nll

    def nll(model_, batches, device, kw):
        rule = S._RULES.get(mods[costly])
        return real(model_, batches, device, kw) + (100.0 if rule is not None and rule.threshold > 0 else 0.0)

    monkeypatch.setattr(S, "_mean_nll", nll)
    th2 = S.calibrate_activation_thresholds(model, ids, 0.4, allocation="measured")
    assert th2.layer_sparsity[costly] == 0.0 and th.layer_sparsity[costly] > 0.0


def test_greedy_allocation_finds_the_cheapest_split_on_known_costs():
    import itertools

    levels = [0.0, 0.25, 0.5, 0.75]
    costs = [[0, 1, 3, 7], [0, 4, 9, 20], [0, 0.5, 1, 10]]  # convex: each step dearer than the last
    sizes = [1, 1, 2]
    at = S._allocate(costs, sizes, 0.5, levels)
    feasible = [c for c in itertools.product(range(4), repeat=3)
                if sum(levels[i] * s for i, s in zip(c, sizes)) >= 0.5 * sum(sizes) - 1e-9]
    best = min(sum(costs[g][i] for g, i in enumerate(c)) for c in feasible)
    assert sum(levels[i] * s for i, s in zip(at, sizes)) >= 0.5 * sum(sizes)
    assert sum(costs[g][i] for g, i in enumerate(at)) == best == 12
    with pytest.raises(DeltaZipError, match="highest measured level"):
        S._allocate(costs, sizes, 0.9, levels)


def test_bad_allocations_are_refused():
    model = base_model("llama")
    with pytest.raises(ValueError, match="allocation"):
        S.calibrate_activation_thresholds(model, calibration_ids(), 0.4, allocation="fisher")
    with pytest.raises(ValueError, match="levels"):
        S.calibrate_activation_thresholds(model, calibration_ids(), 0.6, allocation="measured", levels=(0.2, 0.5))
    with pytest.raises(ValueError, match="allocation"):
        S.ActivationThresholds(0.4, {}, 0, "other")


def test_quality_bench_runs_the_measured_allocation(tmp_path):
    from hf_deltazip.bench import act_sparsity as bench

    out = tmp_path / "m.json"
    assert bench.main(["quality", "--tiny", "--sparsity", "0.5", "--device", "cpu", "--allocation", "measured",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["allocation"] == "measured"
    assert {x["model"] for x in r["rows"]} == {"fine-tune", "DeltaModel (compressed delta)", "DeltaModel, delta only"}
    nll = {(x["model"], x["sparsity"]): x["nll"] for x in r["rows"]}
    # no thresholds: the compressed delta's NLL whichever weights would be thresholded
    assert nll[("DeltaModel, delta only", 0.0)] == nll[("DeltaModel (compressed delta)", 0.0)]
    # thresholds: the delta's inputs alone change the NLL, less than the base's and the delta's together
    dense = nll[("DeltaModel (compressed delta)", 0.0)]
    assert nll[("DeltaModel, delta only", 0.5)] != dense
    assert abs(nll[("DeltaModel, delta only", 0.5)] - dense) < abs(nll[("DeltaModel (compressed delta)", 0.5)] - dense)


def test_model_speed_table_gives_each_case_against_dense_and_both_memory_figures():
    from hf_deltazip.bench import act_sparsity as bench

    rows = [{"case": "8 deltas, batch 8", "rows": 8, "sparsity": s, "path": p, "tokens_per_s": tps, "vs_dense": tps / 344.8}
            for s, p, tps in ((0.0, "dense", 344.8), (0.4, "sparse kernels (kernels=True)", 369.2))]
    table = bench.model_speed_table({"shape": "Llama-3-8B (random weights)", "layers": 32, "device": "H200", "deltas": 8,
                                     "delta_bits": 4, "group_size": 128, "rank": 16, "steps": 64, "prompt_len": 32,
                                     "max_rel_error_vs_pytorch": 3.1e-3, "base_gib": 15.0, "delta_gib_each": 6.80,
                                     "delta_gib_each_packed": 3.40, "decode": "fused", "rows": rows})
    lines = table.splitlines()
    assert "dense steps decode='fused'" in table
    assert lines[-1].split()[-2:] == ["369.2", "1.07x"] and lines[-2].split()[-2:] == ["344.8", "1.00x"]
    assert "each delta 6.80 GiB with its input-major copy (kernels=True), 3.40 GiB without" in table
    assert "max error / max |y| = 3.10e-03" in table


def test_speed_table_gives_the_per_block_and_the_tokens_per_second_ratio():
    from hf_deltazip.bench import act_sparsity as bench

    rows = [{"case": "base, batch 1", "sparsity": s, "path": p, "block_us": us, "tokens_per_s": tps,
             "speedup_vs_dense": 148.0 / us, "tokens_per_s_vs_dense": tps / 200.0}
            for s, p, us, tps in ((0.0, "cuBLAS dense", 148.0, 200.0), (0.5, "sparse base kernel", 108.0, 270.0))]
    table = bench.speed_table({"shape": "Llama-3-8B block", "device": "H200", "delta_bits": 4, "group_size": 128,
                               "max_rel_error": 2.5e-3, "base_tiles": {"block_n": 64, "block_k": 256, "num_warps": 2},
                               "delta_tiles": None, "delta1_tiles": None, "rows": rows})
    last = table.splitlines()[-2].split()
    assert last[-4:] == ["108.0", "1.37x", "270.0", "1.35x"]  # per block, then tokens/s with the LM head
    assert "64x256 (n x k), 2 warps" in table and "delta, 8 rows defaults" in table


# ------------------------------------------------------------------ bench rotation mode (an experiment)
def _tiny_moments():
    from hf_deltazip.bench import act_sparsity as B
    from hf_deltazip.bench.pairs import tiny_model

    model = tiny_model("llama", vocab_size=256, seed=0, hidden_size=64, num_layers=2).float().eval()
    mods = S.target_modules(model)
    return model, mods, B.input_moments(model, mods, B._pattern_ids(6, 40, 256, seed=1))


def test_rotation_bases_are_orthogonal_and_blocked():
    from hf_deltazip.bench import act_sparsity as B

    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, 8, generator=g, dtype=torch.float64) * torch.arange(1, 9, dtype=torch.float64)
    cov = a.T @ a / 200
    eye = torch.eye(8)
    for q in (B.rotation_basis(cov, "pca"), B.rotation_basis(cov, "random"), B.rotation_basis(cov, "pca", block=4)):
        torch.testing.assert_close(q.T @ q, eye, atol=1e-5, rtol=0)
    q = B.rotation_basis(cov, "pca")
    var = torch.diag(q.double().T @ cov @ q.double())
    assert bool((var[1:] >= var[:-1] - 1e-9).all())  # ascending variance
    blocked = B.rotation_basis(cov, "pca", block=4)
    assert float(blocked[:4, 4:].abs().max()) == 0 and float(blocked[4:, :4].abs().max()) == 0
    with pytest.raises(ValueError, match="blocks of 3"):
        B.rotation_basis(cov, "pca", block=3)


def test_rotated_drop_keeps_everything_below_any_threshold_and_the_target_share():
    from hf_deltazip.bench import act_sparsity as B

    _model, mods, moments = _tiny_moments()
    name = next(iter(mods))
    x = moments[name]["rows"]
    keep_all = B.RotatedDrop(moments[name]["mean"], B.rotation_basis(moments[name]["cov"], "pca"), -1.0)
    torch.testing.assert_close(keep_all(x), x, atol=1e-4, rtol=1e-4)  # a rotation and back: the input itself
    drops = B.rotated_drops(moments, 0.4, "pca", head_dim=16)
    assert set(drops) == set(mods)
    for n, d in drops.items():  # 40 % of the rotated calibration entries at or under the threshold
        kept = float(d.kept(d.rotate(moments[n]["rows"])).float().mean())
        assert abs(kept - 0.6) < 0.02, (n, kept)
    assert B.rotated_drops(moments, 0.4, "raw", head_dim=16) == {}
    fold = B.rotated_drops(moments, 0.4, "pca-foldable", head_dim=16)
    assert not any(n.endswith("down_proj") for n in fold)
    o = next(d for n, d in fold.items() if n.endswith("o_proj"))
    assert float(o.basis[:16, 16:].abs().max()) == 0  # one basis per head
    mlp = B.rotated_drops(moments, 0.4, "pca-mlp", head_dim=16)
    assert {n.rsplit(".", 1)[-1] for n in mlp} == {"gate_proj", "up_proj", "o_proj"}
    static = B.rotated_drops(moments, 0.25, "pca-static", head_dim=16)[name]
    assert int(static.keep.sum()) == static.basis.shape[0] - round(0.25 * static.basis.shape[0])
    with pytest.raises(ValueError, match="unknown rotation"):
        B.rotated_drops(moments, 0.4, "hadamard", head_dim=16)


def test_rotation_mode_runs_and_records_every_variant(tmp_path):
    from hf_deltazip.bench import act_sparsity as B

    with pytest.raises(SystemExit):
        B.main(["rotation", "--tiny", "--rotations", "pca,hadamard"])
    out = tmp_path / "rot.json"
    assert B.main(["rotation", "--tiny", "--sparsity", "0,0.5", "--rotations", "raw,pca", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["sparsity"], r["rotation"]) for r in res["rows"]] == [(0.5, "raw"), (0.5, "pca")]
    for r in res["rows"]:
        assert r["relative"] == pytest.approx(r["nll"] / res["dense_nll"] - 1)
    with pytest.raises(DeltaZipError, match="--base"):
        B.main(["rotation", "--sparsity", "0.4"])


def test_an_input_rule_replaces_the_thresholds_and_keeps_the_kernels_off():
    """set_input_rule: the layer sees rule(x), the compensation gets x - rule(x), the kernels (which apply only
    thresholds) are not offered the layer, None restores the thresholds, and a layer without thresholds is
    refused."""
    lin = torch.nn.Linear(8, 4, bias=False)
    holder = torch.nn.Sequential(lin)
    x = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="install thresholds first"):
        S.set_input_rule(lin, lambda v: v)
    th = S.ActivationThresholds(0.5, {"0": 0.5}, 100, rank=0)
    assert S.install_activation_sparsity(holder, th, strict=False) == 1
    plain = lambda v: torch.nn.functional.linear(v, lin.weight)  # noqa: E731 - the layer without its hooks
    thresholded = plain(torch.where(x.abs() > 0.5, x, torch.zeros(())))
    torch.testing.assert_close(holder(x), thresholded)
    assert S.kernel_sparsity(lin, x) is not None
    S.set_input_rule(lin, lambda v: v * 0.5)
    torch.testing.assert_close(holder(x), plain(x * 0.5))
    assert S.kernel_sparsity(lin, x) is None
    S.set_input_rule(lin, None)
    torch.testing.assert_close(holder(x), thresholded)
