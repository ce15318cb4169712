"""Tests of the planar fast path: code layout, 2:4 densification, row segments, decode plan, kernel.

Interpreter tests run the Triton kernel on the CPU (``TRITON_INTERPRET=1``) on small, awkward
shapes in fp16 / fp32 against the plain-PyTorch reference; GPU tests (bf16 too) skip without CUDA.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

try:
    from hf_deltazip import kernels as K
except ImportError:  # pragma: no cover
    import kernels as K

from hf_deltazip import packing

try:
    from hf_deltazip.kernels import layout as L
except ImportError:  # pragma: no cover
    from kernels import layout as L

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


from test_kernels import compiled, interpret  # noqa: E402,F401 - the shared fixtures


# --------------------------------------------------------------------------- layout
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("block", [16, 32])
def test_repack_puts_plane_s_at_contiguous_inputs(bits, block):
    p = 16 // bits
    k = 3 * p * block
    g = torch.Generator().manual_seed(bits * block)
    codes = torch.randint(0, 1 << bits, (2, 5, k), generator=g, dtype=torch.int32).to(torch.uint8)
    q = packing.pack_codes(codes, bits)
    planar = L.repack_for_kernel(q, bits, k, block)
    assert planar.shape == q.shape and planar.dtype == torch.uint8
    # read it back as the kernel does: little-endian 16-bit elements, plane S at bits S*b
    elems = planar[..., 0::2].to(torch.int32) | (planar[..., 1::2].to(torch.int32) << 8)
    for j in range(3):
        for s in range(p):
            for i in (0, block // 2, block - 1):
                got = (elems[..., j * block + i] >> (s * bits)) & ((1 << bits) - 1)
                assert torch.equal(got.to(torch.uint8), codes[..., j * p * block + s * block + i])
    assert torch.equal(L.unpack_planar_codes(planar, bits, k, block), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("block", [16, 64])
def test_repack_by_byte_table_gives_the_bytes_of_the_shifts(bits, block):
    # off the CPU the repack looks each byte's codes up in a table and sums them shifted; on the CPU it unpacks
    # and packs with shifts and masks: both must give the same bytes (here both run on the CPU)
    p = 16 // bits
    k = 3 * p * block
    q = torch.randint(0, 256, (2, 5, packing.packed_nbytes(k, bits)), dtype=torch.int32).to(torch.uint8)
    rows = q.reshape(-1, q.shape[-1])
    assert torch.equal(L._repack_table(rows, bits, p, 3, block), L._repack_rows_shifts(rows, bits, p, 3, block))


def test_repack_by_table_in_chunks_matches_one_pass_and_refuses_what_is_not_packed_codes(monkeypatch):
    # large stacks go through the table a few rows at a time (the lookup's temporaries): the same bytes
    k = 8 * 32 * 3
    q = torch.randint(0, 256, (14, packing.packed_nbytes(k, 2)), dtype=torch.int32).to(torch.uint8)
    whole = L._repack_table(q, 2, 8, 3, 32)
    monkeypatch.setattr(L, "_REPACK_CHUNK_BYTES", 3 * q.shape[-1])  # 3 rows at a time: 5 chunks, the last short
    assert torch.equal(L._repack_table(q, 2, 8, 3, 32), whole)
    assert torch.equal(L.unpack_planar_codes(whole, 2, k, 32), packing.unpack_bits(q, 2, k))
    with pytest.raises(ValueError, match="768 codes of 2 bits need 192 bytes per row"):
        L.repack_for_kernel(q[..., :-1], 2, k, 32)
    with pytest.raises(ValueError, match="packed codes must be uint8"):
        L.repack_for_kernel(q.to(torch.int32), 2, k, 32)


@needs_cuda
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_repack_on_the_gpu_gives_the_cpus_bytes_from_a_side_stream_too(bits, monkeypatch):
    # the GPU's byte-table route against the CPU's shifts, the tables first made on a side stream (as staging
    # does) and then used on the main stream, and a stack taken in chunks (of 700 rows here)
    k = 16 // bits * 64 * 4
    q = torch.randint(0, 256, (3, 1000, packing.packed_nbytes(k, bits)), dtype=torch.int32).to(torch.uint8)
    want = L.repack_for_kernel(q, bits, k, 64)
    L._BYTE_CODES.clear()
    side = torch.cuda.Stream()
    qd = q.cuda()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = L.repack_for_kernel(qd[0], bits, k, 64)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(first.cpu(), want[0])
    monkeypatch.setattr(L, "_REPACK_CHUNK_BYTES", 700 * q.shape[-1])
    assert torch.equal(L.repack_for_kernel(qd, bits, k, 64).cpu(), want)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_repack_off_the_cpu_takes_four_tensor_operations(bits):
    # staging a delta repacks each of its layers between decode steps, one launch per operation on a GPU: the
    # index cast, the table lookup, the shifted sum; views are free (the byte tables are made once per device).
    # Meta tensors stand for the GPU's (off the CPU: the same route, the same operations)
    from hf_deltazip.bench.host_overhead import _VIEW_OPS, _CountOps

    k = 16 // bits * 32 * 2
    q = torch.empty((3, packing.packed_nbytes(k, bits)), dtype=torch.uint8, device="meta")
    L.repack_for_kernel(q, bits, k, 32)  # the tables
    with _CountOps() as c:
        assert L.repack_for_kernel(q, bits, k, 32).shape == q.shape
    computing = {o: n for o, n in c.counts.items() if o not in _VIEW_OPS}
    assert computing == {"_to_copy": 1, "index_select": 1, "mul": 1, "sum": 1}


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_repack_reads_no_value_back(bits):
    # staging and loading repack every layer on the device between decode steps: a value read back (a range
    # check) would wait for the running step there. Meta tensors hold no values: anything that reads one fails
    k = 16 // bits * 32 * 4
    q = torch.empty((3, 7, packing.packed_nbytes(k, bits)), dtype=torch.uint8, device="meta")
    assert L.repack_for_kernel(q, bits, k, 32).shape == q.shape
    with pytest.raises(RuntimeError, match="meta"):  # what the check on packing's own input would do
        packing.pack_bits(torch.empty((3, k), dtype=torch.uint8, device="meta"), bits)
    codes = torch.randint(0, 1 << bits, (3, k), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    assert torch.equal(packing.pack_bits(codes, bits, check=False), packing.pack_bits(codes, bits))
    with pytest.raises(ValueError, match="out of range"):
        packing.pack_bits(codes.to(torch.int32) + (1 << bits), bits)


def test_planar_block_for_rules():
    assert L.planar_block_for(4, 4096, 128) == L.default_planar_block(4) == 64
    assert L.planar_block_for(2, 4096, -1) == L.default_planar_block(2) == 64
    assert L.planar_block_for(2, 4096 + 256, -1) == 32  # not whole blocks of 512 inputs: blocks of 32
    assert L.planar_block_for(4, 4096, 32) == 32  # groups of 32: the default block would straddle them
    assert L.planar_block_for(3, 4096, 128) == 0  # 3-bit keeps the file layout
    assert L.planar_block_for(2, 4096 + 128, 128) == 0  # not whole blocks of 256
    assert L.planar_block_for(4, 4096, 32, block=64) == 0  # a plane would straddle groups
    with pytest.raises(ValueError, match="no planar layout"):
        L.repack_for_kernel(torch.zeros(2, 100, dtype=torch.uint8), 4, 200, 32)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("gs", [32, -1])
def test_densify_2of4_and_prepare_stack_keep_the_delta(bits, gs):
    g = torch.Generator().manual_seed(7)
    st = K.random_delta_stack(3, 9, 128, bits=bits, group_size=gs, sparse_2of4=True, generator=g)
    dense = L.prepare_stack(st, block=16)
    assert dense.positions is None and dense.layout_block == 16 and dense.bits == bits
    for i in range(3):
        want = st.dequantize(i)
        assert torch.equal(dense.dequantize(i), want)
        assert int((want == 0).sum()) >= 9 * 64  # half of every row pruned (zero codes may add more)
    # a 2:4 stack left sparse keeps its positions
    kept = L.prepare_stack(st, block=16, densify=False)
    assert kept is st


@pytest.mark.parametrize("bits,sparse,k", [(4, False, 512), (2, True, 512), (4, True, 512), (3, False, 512),
                                           (4, False, 320)])
def test_writing_deltas_one_by_one_matches_prepare_stack(bits, sparse, k):
    # what the layer code does: allocate a stack of kernel_stack_format, write each delta's packed
    # tensors with pack_for_stack; the result must equal prepare_stack of the whole file-layout stack
    g = torch.Generator().manual_seed(bits + k)
    st = K.random_delta_stack(3, 9, k, bits=bits, group_size=32, sparse_2of4=sparse, generator=g)
    fmt = L.kernel_stack_format(bits, 32, k, sparse)
    assert fmt.layout_block == L.planar_block_for(bits, k, 32) or (sparse and not fmt.densify)
    q = torch.empty((3, 9, fmt.row_bytes), dtype=torch.uint8)
    for i in range(3):
        q[i] = L.pack_for_stack(fmt, st.qweight[i], st.positions[i] if sparse else None, st.zeros[i], bits, 32, k)
    built = K.DeltaStack(q, st.scales, st.zeros, st.positions if fmt.has_positions else None, bits, 32, k,
                         layout_block=fmt.layout_block)
    whole = L.prepare_stack(st)
    assert torch.equal(built.qweight, whole.qweight) and built.layout_block == whole.layout_block
    for i in range(3):
        assert torch.equal(built.dequantize(i), st.dequantize(i))


def test_stack_rejects_a_layout_that_cannot_exist():
    st = K.random_delta_stack(1, 4, 96, bits=4, group_size=32)
    with pytest.raises(ValueError, match="layout_block=32"):
        K.DeltaStack(st.qweight, st.scales, st.zeros, None, 4, 32, 96, layout_block=32)


# --------------------------------------------------------------------------- row segments
@pytest.mark.parametrize(
    "rows",
    [[2], [-1, -1, -1], [1, 1, 1, 1], [3, -1, 0, 3, 0, -1, 3], [5, 0, 9, 0], list(range(16))[::-1]],
)
def test_row_segments_match_python(rows):
    rd = torch.tensor(rows, dtype=torch.int64)
    tab = L.build_row_segments(rd)
    assert tab.dtype == torch.int32 and tuple(tab.shape) == (4, len(rows))
    runs = L.segments_reference(rd)
    perm, sd, seg, segd = (t.tolist() for t in tab)
    assert perm == [r for _, rs in runs for r in rs]
    assert sd == [rows[r] for r in perm]
    assert seg == [t for t, (_, rs) in enumerate(runs) for _ in rs]
    assert segd == [d for d, _ in runs] + [-1] * (len(rows) - len(runs))
    buf = torch.full((4, len(rows)), 99, dtype=torch.int32)
    assert L.build_row_segments(rd, out=buf) is buf and torch.equal(buf, tab)


# --------------------------------------------------------------------------- decode plan
def _triton_module():
    import importlib

    return importlib.import_module(K.__name__ + "._multi_delta_triton")


def _emulate_plane(elems, bits, magic, s):
    """What the PTX of plane ``s`` computes on one packed pair of 16-bit elements, per lane."""
    import numpy as np

    T = _triton_module()
    plan = T.planar_plan(bits, magic)
    _, shift, e = plan[s]
    word = (elems[1] << 16) | elems[0]
    src = word >> shift
    mask = ((1 << bits) - 1) << e
    magic_bits = 0x6400 if magic == 1 else 0x4300
    lanes = []
    for lane in (0, 1):
        bits16 = ((src >> (16 * lane)) & mask) | magic_bits
        if magic == 1:
            lanes.append(float(np.array([bits16], dtype=np.uint16).view(np.float16)[0]))
        else:  # bf16 = the top half of an fp32
            lanes.append(float(np.array([bits16 << 16], dtype=np.uint32).view(np.float32)[0]))
    return lanes, e


@pytest.mark.parametrize("bits,magic", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)])
def test_decode_plan_gives_code_minus_zero_exactly(bits, magic):
    T = _triton_module()
    g = torch.Generator().manual_seed(bits + 10 * magic)
    dt = torch.float16 if magic == 1 else torch.bfloat16
    mag = T._PTX_MAGICF[magic]
    for _ in range(20):
        e0, e1 = (int(v) for v in torch.randint(0, 1 << 16, (2,), generator=g))
        z = int(torch.randint(0, 1 << bits, (1,), generator=g))
        for s in range(16 // bits):
            (v0, v1), e = _emulate_plane((e0, e1), bits, magic, s)
            c = torch.tensor(-(mag / (1 << e)) - z, dtype=torch.float64).to(dt)  # what the kernel passes
            assert float(c) == -(mag / (1 << e)) - z  # exact in the activation dtype
            for v, el in ((v0, e0), (v1, e1)):
                code = (el >> (s * bits)) & ((1 << bits) - 1)
                # fma: one rounding of v * 2^-e + c, exact here
                got = torch.tensor(v * 2.0**-e + float(c), dtype=torch.float64).to(dt)
                assert float(got) == code - z
        asm = T.planar_asm_args(bits, magic, False)
        used = {asm[f"A0{s}"] for s in range(16 // bits)}
        assert "trap;" not in used and all("lop3.b32" in a for a in used)


# --------------------------------------------------------------------------- kernel (interpreter)
def make_planar_case(m, n, k, u, bits, gs, dtype, block=16, rows=None, seed=0, bias=True, sparse=False):
    g = torch.Generator().manual_seed(seed)
    st = K.random_delta_stack(u, n, k, bits=bits, group_size=gs, sparse_2of4=sparse, scale_range=(0.01, 0.03),
                              generator=g)
    st = L.prepare_stack(st, block=block)
    assert st.layout_block == block
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    rd = torch.randint(-1, u, (m,), generator=g) if rows is None else torch.tensor(rows)
    return x, w, b, st, rd.to(torch.int32)


def check(x, w, b, st, rd, cfg, tol, segments=None):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.float32, device=x.device)
    y = K.multi_delta_linear(x, w, b, st, rd, out_dtype=torch.float32, out=out, config=cfg, segments=segments)
    assert y is out
    good = (rd >= -1) & (rd < st.num_deltas)
    ref = K.multi_delta_linear_reference(x, w, b, st, torch.where(good, rd, -1), out_dtype=torch.float32)
    base = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    assert not torch.isnan(y[good]).any(), "some outputs were never written"
    y, ref, base = y[good], ref[good], base[good]
    if bool((rd[good] >= 0).any()):
        err = float((y - ref).norm() / (ref - base).norm().clamp_min(1e-30))
        assert err < tol, err
    else:
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    return out


CFG = K.MultiDeltaConfig(block_n=16, block_k_base=32, split_k=1, swap_ab=True, num_stages=1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("gs", [32, 64, -1])
def test_planar_kernel_formats(interpret, bits, dtype, gs):
    # M, N odd; two k-steps per delta; groups of 32 put each plane of 16 inputs in its own pass
    k = 2 * (16 // bits) * 16
    x, w, b, st, rd = make_planar_case(7, 19, k, 3, bits, gs, dtype, seed=bits)
    check(x, w, b, st, rd, CFG, tol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("scale_w", [False, True], ids=["acc-scale", "weight-scale"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "noswap"])
def test_planar_kernel_split_k_and_scaling(interpret, scale_w, swap):
    x, w, b, st, rd = make_planar_case(9, 17, 256, 4, 4, 32, torch.float32, seed=3)
    cfg = K.MultiDeltaConfig(block_n=16, block_k_base=32, split_k=3, swap_ab=swap, num_stages=1,
                             scale_in_weights=scale_w)
    y1 = check(x, w, b, st, rd, cfg, tol=1e-5)
    y2 = K.multi_delta_linear(x, w, b, st, rd, out_dtype=torch.float32, config=cfg)
    assert torch.equal(y1, y2)  # split-K sums in a fixed order


@pytest.mark.parametrize(
    "rows",
    [[2], [-1, -1, -1], [1, 1, 1, 1, 1], [3, -1, 0, 3, 0, -1, 3], [0, 1, 2, 3, 0, 1, 2, 3, 0]],
)
def test_planar_kernel_row_mixes_with_given_segments(interpret, rows):
    x, w, b, st, rd = make_planar_case(len(rows), 17, 128, 4, 2, 64, torch.float16, rows=rows, seed=len(rows))
    check(x, w, b, st, rd, CFG, tol=1e-3, segments=L.build_row_segments(rd))


@pytest.mark.parametrize("block_m,m", [(16, 40), (32, 40), (16, 70)])
def test_planar_kernel_several_row_blocks(interpret, block_m, m):
    x, w, b, st, rd = make_planar_case(m, 17, 64, 5, 4, 32, torch.float16, seed=m)
    cfg = K.MultiDeltaConfig(block_m=block_m, block_n=16, block_k_base=32, split_k=2, num_stages=1)
    check(x, w, b, st, rd, cfg, tol=1e-3)


def test_planar_kernel_default_block(interpret):
    # the layout prepare_stack picks by default (64 elements per block at 4 bits)
    g = torch.Generator().manual_seed(11)
    st = L.prepare_stack(K.random_delta_stack(2, 17, 512, bits=4, group_size=128, scale_range=(0.01, 0.03),
                                              generator=g))
    assert st.layout_block == 64
    x = torch.randn(5, 512, generator=g).to(torch.float16)
    w = (0.05 * torch.randn(17, 512, generator=g)).to(torch.float16)
    check(x, w, None, st, torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32), CFG, tol=1e-3)


def test_planar_kernel_bad_ids_give_nan_rows_and_no_bias(interpret):
    x, w, b, st, rd = make_planar_case(4, 17, 64, 2, 4, 32, torch.float32, rows=[0, 5, -1, 1], bias=False)
    y = check(x, w, None, st, rd, CFG, tol=1e-5)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2, 3]]).any()


def test_planar_2of4_densified_matches_sparse_reference(interpret):
    x, w, b, st, rd = make_planar_case(6, 17, 128, 3, 2, 32, torch.float16, sparse=True, seed=5)
    check(x, w, b, st, rd, CFG, tol=1e-3)


def test_segments_argument_is_checked(interpret):
    x, w, b, st, rd = make_planar_case(3, 16, 64, 2, 4, 32, torch.float32)
    with pytest.raises(ValueError, match="segments must be"):
        K.multi_delta_linear(x, w, b, st, rd, segments=torch.zeros(4, 2, dtype=torch.int32))


def check_accumulate(x, w, b, st, rd, cfg, tol, segments=None, lookup=None):
    """``accumulate=True`` over ``out = x W^T + b``: each row's delta product added in place, rows of the plain
    base (-1, or not in the stack) unchanged, against the fused launch's reference."""
    out = (x.float() @ w.float().t() + (b.float() if b is not None else 0)).to(x.dtype)
    before = out.clone()
    y = K.multi_delta_linear(x, None, None, st, rd, out=out, config=cfg, segments=segments, segment_lookup=lookup,
                             accumulate=True)
    assert y is out
    idx = rd.long() if lookup is None else lookup[rd.long() + 1].long()
    ref = K.multi_delta_linear_reference(x, w, b, st, idx.to(torch.int32), out_dtype=torch.float32)
    base_rows = idx < 0
    assert torch.equal(out[base_rows], before[base_rows])  # the plain base's rows are left as they were
    if bool((~base_rows).any()):
        d = ~base_rows
        err = float((out[d].float() - ref[d]).norm() / (ref[d] - before[d].float()).norm().clamp_min(1e-30))
        assert err < tol, err
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("split", [1, 3])
def test_planar_kernel_accumulates_the_deltas_alone_into_out(interpret, bits, split):
    # the split route of decode steps: the base's product by one dense matmul, then only the deltas
    k = 2 * (16 // bits) * 16
    x, w, b, st, rd = make_planar_case(21, 19, k, 3, bits, 32, torch.float16, seed=40 + bits)
    cfg = replace(CFG, split_k=split)
    check_accumulate(x, w, b, st, rd, cfg, tol=2e-3, segments=L.build_row_segments(rd))


def test_planar_kernel_accumulate_with_a_slot_lookup_and_two_row_blocks(interpret):
    # rows carry slot ids; the stack holds some of them (lookup -1: another class's delta, left alone)
    x, w, b, st, _ = make_planar_case(33, 17, 128, 3, 4, 32, torch.float32, seed=9)
    slots = torch.tensor([(i * 5) % 6 - 1 for i in range(33)], dtype=torch.int32)  # -1..4
    lookup = torch.tensor([-1, 2, -1, 0, 1, -1], dtype=torch.int32)  # slot + 1 -> stack index
    cfg = K.MultiDeltaConfig(block_m=16, block_n=16, block_k_base=32, split_k=2, num_stages=1)
    check_accumulate(x, w, b, st, slots, cfg, tol=1e-5, segments=L.build_row_segments(slots), lookup=lookup)


def test_accumulate_on_the_file_layout_and_the_reference(interpret):
    # stacks without the planar kernel (3-bit) and the CPU reference take the launch over a zero base
    g = torch.Generator().manual_seed(2)
    st = K.random_delta_stack(2, 17, 64, bits=3, group_size=32, scale_range=(0.01, 0.03), generator=g)
    x = torch.randn(5, 64, generator=g)
    w = 0.05 * torch.randn(17, 64, generator=g)
    rd = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    check_accumulate(x, w, None, st, rd, CFG, tol=1e-5)


def test_accumulate_arguments_are_checked():
    x, w, b, st, rd = make_planar_case(3, 16, 64, 2, 4, 32, torch.float32)
    out = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="accumulate=True adds the deltas to out"):
        K.multi_delta_linear(x, None, None, st, rd, accumulate=True)  # no out
    with pytest.raises(ValueError, match="accumulate=True adds the deltas to out"):
        K.multi_delta_linear(x, w, None, st, rd, out=out, accumulate=True)  # a base weight besides
    with pytest.raises(ValueError, match="base_weight is None"):
        K.multi_delta_linear(x, None, None, st, rd, out=out)
    with pytest.raises(ValueError, match="out must be"):
        K.multi_delta_linear(x, None, None, st, rd, out=torch.zeros(3, 15), accumulate=True)


# --------------------------------------------------------------------------- GPU
def gpu_case(m, bits, dtype, seed):
    """A 1024 x 4096 layer on the GPU: 8 random deltas in the planar layout, x, base weight, bias, row ids."""
    g = torch.Generator().manual_seed(seed)
    st = K.random_delta_stack(8, 1024, 4096, bits=bits, group_size=128, scale_range=(0.01, 0.03), generator=g)
    st = L.prepare_stack(st).to("cuda")
    x = torch.randn(m, 4096, generator=g).to("cuda", dtype)
    w = (0.05 * torch.randn(1024, 4096, generator=g)).to("cuda", dtype)
    b = torch.randn(1024, generator=g).to("cuda", dtype)
    rd = torch.randint(-1, 8, (m,), generator=g).to("cuda", torch.int32)
    return x, w, b, st, rd


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("m", [1, 32])
def test_gpu_planar_accumulate(compiled, dtype, bits, m):
    x, w, b, st, rd = gpu_case(m, bits, dtype, seed=7 * m + bits)
    check_accumulate(x, w, b, st, rd, K.default_config(m, 1024, 4096, st, x.device),
                     tol=3e-2 if dtype == torch.bfloat16 else 1e-2)  # out rounded to the activation dtype


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 16, 33])
@pytest.mark.parametrize("scale_w", [False, True], ids=["acc", "w"])
def test_gpu_planar_real_sizes(compiled, dtype, bits, m, scale_w):
    x, w, b, st, rd = gpu_case(m, bits, dtype, seed=m + bits)
    cfg = K.MultiDeltaConfig(scale_in_weights=scale_w)
    tol = 1e-3 if not scale_w else (1e-2 if dtype == torch.bfloat16 else 2e-3)
    check(x, w, b, st, rd, cfg, tol=tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows_per_delta", [24, 128])
@pytest.mark.parametrize("n", [1024, 4096])
def test_gpu_prefill_default_tiles(compiled, dtype, bits, rows_per_delta, n):
    """The default launch for prefill-sized row blocks (no config: 32- or 64-row blocks; 2-bit 64-row blocks
    128 outputs on 8 warps, the rest four stages; K split only while the row blocks do not fill the GPU)
    on segments of one delta each, base rows among them, against the reference."""
    g = torch.Generator().manual_seed(bits * rows_per_delta + n)
    st = L.prepare_stack(K.random_delta_stack(4, n, 4096, bits=bits, group_size=128, scale_range=(0.01, 0.03),
                                              generator=g)).to("cuda")
    rows = [0] * rows_per_delta + [-1] * 7 + [1] * rows_per_delta + [2] * rows_per_delta + [3] * rows_per_delta
    x = torch.randn(len(rows), 4096, generator=g).to("cuda", dtype)
    w = (0.05 * torch.randn(n, 4096, generator=g)).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype)
    rd = torch.tensor(rows, dtype=torch.int32, device="cuda")
    check(x, w, b, st, rd, None, tol=1e-3, segments=L.build_row_segments(rd))


@needs_cuda
def test_gpu_planar_graph_replay_follows_new_row_mix(compiled):
    g = torch.Generator().manual_seed(1)
    st = L.prepare_stack(K.random_delta_stack(8, 2048, 4096, bits=2, group_size=128, scale_range=(0.01, 0.03),
                                              generator=g)).to("cuda")
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = 0.05 * torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    rd = (torch.arange(32) % 8).to("cuda", torch.int32)
    seg = L.build_row_segments(rd)
    out = torch.empty(32, 2048, dtype=torch.bfloat16, device="cuda")
    K.multi_delta_linear(x, w, b, st, rd, out=out, segments=seg)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        L.build_row_segments(rd, out=seg)  # once per step...
        K.multi_delta_linear(x, w, b, st, rd, out=out, segments=seg)  # ...shared by every layer
    for mix in (torch.arange(32) % 8, torch.full((32,), -1), torch.full((32,), 5), torch.randint(-1, 8, (32,))):
        rd.copy_(mix.to(rd))
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = K.multi_delta_linear_reference(x, w, b, st, rd, out_dtype=torch.float32)
        base = x.float() @ w.float().t() + b.float()
        if bool((rd >= 0).any()):
            err = float((out.float() - ref).norm() / (ref - base).norm())
            assert err < 2e-2, err
        else:
            assert torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert math.isfinite(float(out.float().sum()))


def test_sass_report_counts_the_delta_loop(compiled):
    # compiles the planar kernel for sm_90 here (no GPU) and reads the delta loop off the SASS
    import shutil

    import triton

    if not shutil.which(triton.knobs.nvidia.cuobjdump.path):
        pytest.skip("triton ships no cuobjdump here")
    from hf_deltazip.bench.kernels import sass_report

    (row,) = sass_report(formats=((4, False),), log=lambda *a: None)
    assert row["block"] == 64 and row["weights_per_thread"] == 128
    assert row["mix"].get("HGMMA", 0) >= 4 and row["mix"].get("LOP3", 0) >= 16  # MMAs and the decode
    assert 1.0 < row["instructions_per_weight"] < 10.0


@pytest.mark.parametrize("variant", ["pk1", "pm64n128", "pm128n64", "pm128n128", "pn128w8", "psw", "pn128w8sw"])
@pytest.mark.parametrize("bits", [2, 4])
def test_planar_kernel_prefill_variants_on_long_segments(interpret, variant, bits):
    """The launch variants the kernel bench offers for prefill shapes (row blocks of 64-128, x on the MMA's M
    side, no split-K) on segments of 60-140 rows of one delta, base rows among them."""
    from dataclasses import fields

    from hf_deltazip.bench.kernels import VARIANTS

    over = {k: v for k, v in VARIANTS[variant].items() if k in {f.name for f in fields(K.MultiDeltaConfig)}}
    cfg = replace(K.MultiDeltaConfig(block_k_base=32, num_stages=1), **over)
    rows = [0] * 140 + [-1] * 13 + [1] * 60 + [2] * 97
    x, w, b, st, rd = make_planar_case(len(rows), 40, 128, 3, bits, 32, torch.float16, rows=rows, seed=bits)
    check(x, w, b, st, rd, cfg, tol=1e-3, segments=L.build_row_segments(rd))
