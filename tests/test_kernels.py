"""Tests of the multi-delta linear kernel against its plain-PyTorch reference.

The interpreter tests run the Triton kernel on the CPU (``TRITON_INTERPRET=1``, switched on per
test: the launcher reloads the kernel module when the mode changes) on tiny, awkward shapes.
The GPU tests run compiled kernels at real sizes and skip cleanly without CUDA.
"""

from __future__ import annotations


import pytest
import torch

try:  # the package path, once the lead has wired kernels/ in as hf_deltazip.kernels
    from hf_deltazip import kernels as K
except ImportError:  # pragma: no cover - until then, the top-level folder
    import kernels as K

from hf_deltazip import packing

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# small launch parameters, so the interpreter runs few programs and splits K
TINY = K.MultiDeltaConfig(block_n=16, block_k=64, block_k_base=32, split_k=2, swap_ab=False, num_stages=1)
TINY_SWAP = K.MultiDeltaConfig(block_n=16, block_k=32, block_k_base=32, split_k=1, swap_ab=True, num_stages=1)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def make_case(m, n, k, u, bits, group_size, sparse, dtype, row_delta=None, device="cpu", seed=0, bias=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # scales large enough that the delta term dominates the output: a wrong delta cannot hide
    stack = K.random_delta_stack(
        u, n, k, bits=bits, group_size=group_size, sparse_2of4=sparse, scale_range=(0.01, 0.03), generator=g
    ).to(device)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    if row_delta is None:
        row_delta = torch.randint(-1, u, (m,), generator=g)
    return x, w, b, stack, row_delta.to(device)


def rel_err(y, ref, base):
    """Error relative to the delta term (the part the kernel dequantizes)."""
    return float((y.float() - ref.float()).norm() / (ref.float() - base.float()).norm().clamp_min(1e-30))


def check(x, w, b, stack, rd, config, tol):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.float32, device=x.device)
    y = K.multi_delta_linear(x, w, b, stack, rd, out_dtype=torch.float32, out=out, config=config)
    assert y is out
    assert not torch.isnan(y).any(), "some outputs were never written"
    ref = K.multi_delta_linear_reference(x, w, b, stack, rd, out_dtype=torch.float32)
    base = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    if bool((rd >= 0).any()):
        assert rel_err(y, ref, base) < tol
    else:
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    return y


# --------------------------------------------------------------------------- interpreter
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "2:4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_formats_awkward_shape(interpret, bits, sparse, dtype):
    # M odd, N odd, K = 72 is a multiple of neither the group (32) nor the k-step
    x, w, b, stack, rd = make_case(7, 17, 72, 3, bits, 32, sparse, dtype, seed=bits)
    config = TINY_SWAP if bits in (3, 8) else TINY
    check(x, w, b, stack, rd, config, tol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize(
    "m,rows",
    [
        (1, [2]),
        (3, [-1, -1, -1]),  # base model only
        (3, [1, 1, 1]),  # one delta for every row
        (7, [3, -1, 0, 3, 0, -1, 3]),  # deltas 1 and 2 unused: empty segments
    ],
)
def test_row_mixes(interpret, m, rows):
    rd = torch.tensor(rows, dtype=torch.int32)
    x, w, b, stack, rd = make_case(m, 17, 72, 4, 4, 32, False, torch.float16, row_delta=rd)
    check(x, w, b, stack, rd, TINY, tol=1e-3)


def test_whole_row_groups_and_no_bias(interpret):
    x, w, b, stack, rd = make_case(5, 33, 200, 4, 4, -1, False, torch.float32, bias=False)
    check(x, w, None, stack, rd, K.MultiDeltaConfig(block_n=16, block_k=128, block_k_base=64, split_k=1), tol=1e-5)


def test_group_smaller_than_k_step(interpret):
    # 2-bit 2:4 needs 128 inputs per k-step for a 16-deep MMA: groups of 64 are scaled per element
    x, w, b, stack, rd = make_case(5, 17, 256, 2, 2, 64, True, torch.float16)
    check(x, w, b, stack, rd, K.MultiDeltaConfig(block_n=16, block_k=128, block_k_base=64, split_k=1), tol=1e-3)


@pytest.mark.parametrize("bits,sparse", [(2, False), (4, False), (4, True), (8, False)])
@pytest.mark.parametrize("wide", [True, False], ids=["16-bit", "8-bit"])
def test_packed_element_widths(interpret, bits, sparse, wide):
    # k-steps of 128 inputs: codes are read as 16-bit elements (8 planes for 2-bit) or as bytes
    x, w, b, stack, rd = make_case(5, 17, 256, 3, bits, 128, sparse, torch.float16)
    cfg = K.MultiDeltaConfig(block_n=16, block_k=128, block_k_base=64, split_k=1, wide_elements=wide, num_stages=1)
    check(x, w, b, stack, rd, cfg, tol=1e-3)


@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("m", [40, 70])
def test_larger_row_blocks(interpret, block_m, m):
    x, w, b, stack, rd = make_case(m, 17, 72, 3, 4, 32, False, torch.float16)
    cfg = K.MultiDeltaConfig(block_m=block_m, block_n=16, block_k=32, block_k_base=32, split_k=2, num_stages=1)
    check(x, w, b, stack, rd, cfg, tol=1e-3)


def test_many_rows_use_device_argsort(interpret):
    # above 64 rows the launcher sorts with torch.argsort; several 16-row blocks
    x, w, b, stack, rd = make_case(70, 17, 64, 4, 4, 32, False, torch.float16)
    check(x, w, b, stack, rd, TINY, tol=1e-3)


def test_split_k_is_deterministic(interpret):
    x, w, b, stack, rd = make_case(7, 17, 256, 3, 4, 32, False, torch.float32)
    cfg = K.MultiDeltaConfig(block_n=16, block_k=32, block_k_base=32, split_k=4, num_stages=1, swap_ab=False)
    y1 = check(x, w, b, stack, rd, cfg, tol=1e-5)
    y2 = K.multi_delta_linear(x, w, b, stack, rd, out_dtype=torch.float32, config=cfg)
    assert torch.equal(y1, y2)


def test_bad_delta_id_gives_nan_rows(interpret):
    rd = torch.tensor([0, 5, -1], dtype=torch.int64)
    x, w, b, stack, rd = make_case(3, 17, 64, 2, 4, 32, False, torch.float32, row_delta=rd)
    y = K.multi_delta_linear(x, w, b, stack, rd, config=TINY)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()
    with pytest.raises(ValueError, match=r"row_delta values must be in \[-1, 2\)"):
        K.multi_delta_linear_reference(x, w, b, stack, rd)


# --------------------------------------------------------------------------- stack and reference
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "2:4"])
def test_build_delta_stack_round_trips_packing(bits, sparse):
    torch.manual_seed(bits)
    n, k, gs = 9, 72, 32
    qs, ss, zs, ps, dense = [], [], [], [], []
    for _ in range(2):
        delta = 0.01 * torch.randn(n, k)
        if sparse:
            mask = torch.zeros(n, k // 4, 4, dtype=torch.bool)
            keep = torch.rand(n, k // 4, 4).argsort(-1)[..., :2]
            mask.scatter_(-1, keep, True)
            delta = delta * mask.reshape(n, k)
        scale, zero = packing.compute_qparams(delta, bits, gs, symmetric=False)
        codes = packing.quantize(delta, scale, zero, bits, gs)
        dense.append(packing.dequantize(codes, scale, zero, gs))
        if sparse:
            kept, pos = packing.compress_2of4(codes, mask.reshape(n, k))
            codes = kept
            ps.append(packing.pack_bits(pos, 2))
        qs.append(packing.pack_codes(codes, bits))
        ss.append(scale.to(packing.choose_scale_dtype(scale)))
        zs.append(zero)
    stack = K.build_delta_stack(qs, ss, zs, ps if sparse else None, bits=bits, group_size=gs, in_features=k)
    assert stack.num_deltas == 2 and stack.sparse_2of4 == sparse
    for i in range(2):
        want = dense[i] * (mask_of(stack, i) if sparse else 1)
        assert torch.allclose(stack.dequantize(i), want, atol=1e-7)
        if sparse:  # the dense codes put the zero point wherever 2:4 pruned
            assert torch.allclose(packing.dequantize(stack.codes(i), stack.scales[i], stack.zeros[i], gs), want)


def mask_of(stack, i):
    pos = packing.unpack_bits(stack.positions[i], 2, stack.kept_features)
    return packing.expand_2of4(torch.ones(pos.shape), pos, stack.in_features)


def test_stack_rejects_wrong_shapes():
    st = K.random_delta_stack(2, 8, 64, bits=4, group_size=32)
    with pytest.raises(ValueError, match="need 32"):
        K.DeltaStack(st.qweight[..., :-1].contiguous(), st.scales, st.zeros, None, 4, 32, 64)
    with pytest.raises(ValueError, match="scales must have shape"):
        K.DeltaStack(st.qweight, st.scales[:, :, :1].contiguous(), st.zeros, None, 4, 32, 64)
    with pytest.raises(ValueError, match="group_size"):
        K.DeltaStack(st.qweight, st.scales, st.zeros, None, 4, 48, 64)
    with pytest.raises(ValueError, match="one of each per delta"):
        K.build_delta_stack([st.qweight[0]], [], [], bits=4, group_size=32, in_features=64)


def test_launcher_names_what_is_wrong(compiled):
    x, w, b, stack, rd = make_case(3, 16, 64, 2, 4, 32, False, torch.float32)
    with pytest.raises(ValueError, match="cast x to the base weight's dtype"):
        K.multi_delta_linear(x.half(), w, b, stack, rd)
    with pytest.raises(ValueError, match=r"base_weight must be \[N, K=64\]"):
        K.multi_delta_linear(x, w[:, :32], b, stack, rd)
    with pytest.raises(ValueError, match="delta stack is for a 16x64 layer"):
        K.multi_delta_linear(x, w[:8], b[:8], stack, rd)
    with pytest.raises(ValueError, match="row_delta must be int32 or int64"):
        K.multi_delta_linear(x, w, b, stack, rd.float())
    with pytest.raises(TypeError, match="DeltaStack"):
        K.multi_delta_linear(x, w, b, stack.qweight, rd)


def test_cpu_without_interpreter_uses_reference(compiled):
    x, w, b, stack, rd = make_case(5, 16, 64, 3, 2, 32, True, torch.float32)
    y = K.multi_delta_linear(x, w, b, stack, rd)
    assert torch.equal(y, K.multi_delta_linear_reference(x, w, b, stack, rd))


# --------------------------------------------------------------------------- GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits,sparse", [(4, False), (2, False), (4, True), (2, True), (3, False), (8, False)])
@pytest.mark.parametrize("m", [1, 16, 33, 100])
def test_gpu_real_sizes(compiled, dtype, bits, sparse, m):
    x, w, b, stack, rd = make_case(m, 1024, 4096, 8, bits, 128, sparse, dtype, device="cuda", seed=m)
    check(x, w, b, stack, rd, None, tol=1e-3)


@needs_cuda
@pytest.mark.parametrize("bits,sparse", [(4, False), (2, True), (4, True)])
@pytest.mark.parametrize(
    "cfg",
    [
        K.MultiDeltaConfig(split_k=1),
        K.MultiDeltaConfig(split_k=3),
        K.MultiDeltaConfig(swap_ab=False, block_n=32),
        K.MultiDeltaConfig(fast_dequant=False),
        K.MultiDeltaConfig(wide_elements=False),
        K.MultiDeltaConfig(block_n=128, num_warps=8),
        K.MultiDeltaConfig(block_m=32, block_k_base=64, num_stages=3),
        K.MultiDeltaConfig(block_m=64, block_k_base=64, num_stages=3),
    ],
    ids=["split1", "split3", "noswap", "nofast", "bytes", "bn128", "bm32", "bm64"],
)
def test_gpu_configs_agree(compiled, bits, sparse, cfg):
    x, w, b, stack, rd = make_case(24, 4096, 1024, 4, bits, 128, sparse, torch.bfloat16, device="cuda")
    check(x, w, b, stack, rd, cfg, tol=1e-3)


@needs_cuda
def test_gpu_graph_replay_follows_new_row_mix(compiled):
    x, w, b, stack, rd = make_case(32, 2048, 4096, 8, 4, 128, False, torch.bfloat16, device="cuda")
    out = torch.empty(32, 2048, dtype=torch.bfloat16, device="cuda")
    K.multi_delta_linear(x, w, b, stack, rd, out=out)  # warm-up: compiles, allocates semaphores
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.multi_delta_linear(x, w, b, stack, rd, out=out)
    base = x.float() @ w.float().t() + b.float()
    for mix in (torch.arange(32) % 8, torch.full((32,), -1), torch.full((32,), 5), torch.randint(-1, 8, (32,))):
        rd.copy_(mix.to(rd))
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = K.multi_delta_linear_reference(x, w, b, stack, rd, out_dtype=torch.float32)
        base = x.float() @ w.float().t() + b.float()
        if bool((rd >= 0).any()):
            assert rel_err(out, ref, base) < 2e-2  # bf16 output
        else:
            assert torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
