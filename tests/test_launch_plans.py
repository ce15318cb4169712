"""Cached launch plans (``kernels/launch.py``): a repeated launch reuses its plan, a launch whose
shapes, settings or pointer alignment differ gets its own, and every call still computes the right
thing (interpreter on the CPU; the direct call of the compiled kernel on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

try:
    from hf_deltazip import kernels as K
    from hf_deltazip.kernels import launch as LP
    from hf_deltazip.kernels import multi_delta as MD
except ImportError:  # pragma: no cover
    import kernels as K
    from kernels import launch as LP
    from kernels import multi_delta as MD

from test_kernels import compiled, interpret  # noqa: F401 - the shared fixtures
from test_planar_kernel import CFG, check, make_planar_case

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _plans():
    return dict(MD._PLANAR_PLANS)


def test_tensor_key_holds_dtypes_and_alignment():
    t = torch.zeros(64, dtype=torch.float16)
    f = torch.zeros(64, dtype=torch.float32)
    assert LP.tensor_key(t, t[8:]) == ((torch.float16, torch.float16), True)  # 16 bytes in: still aligned
    assert LP.tensor_key(t, t[1:]) == ((torch.float16, torch.float16), (True, False))
    assert LP.tensor_key(t, f) != LP.tensor_key(t, t)


def test_plan_needs_every_argument(interpret):
    kern = MD.triton_kernel("planar_delta_linear_kernel")
    with pytest.raises(ValueError, match="no value for"):
        LP.LaunchPlan(kern, (1,), {"x_ptr": None}, ["x_ptr"], {})


def test_plan_cache_forgets_when_full(monkeypatch):
    monkeypatch.setattr(LP, "_MAX_PLANS", 3)
    cache = LP.plan_cache()
    for i in range(3):
        cache[i] = i
    cache[3] = 3
    assert list(cache) == [3]


def test_repeated_launch_reuses_its_plan_and_stays_right(interpret):
    MD._PLANAR_PLANS.clear()
    x, w, b, st, rd = make_planar_case(5, 48, 128, 3, 4, 32, torch.float16)
    first = check(x, w, b, st, rd, CFG, tol=2e-3).clone()
    assert len(MD._PLANAR_PLANS) == 1
    plan = next(iter(MD._PLANAR_PLANS.values()))
    # a new row mix on the same shapes: same plan, new (right) result
    rd2 = torch.flip(rd, [0])
    second = check(x, w, b, st, rd2, CFG, tol=2e-3)
    assert len(MD._PLANAR_PLANS) == 1 and next(iter(MD._PLANAR_PLANS.values())) is plan
    assert not torch.equal(first, second)


def test_other_shapes_settings_and_alignment_get_their_own_plans(interpret):
    MD._PLANAR_PLANS.clear()
    x, w, b, st, rd = make_planar_case(5, 48, 128, 3, 4, 32, torch.float16)
    check(x, w, b, st, rd, CFG, tol=2e-3)
    check(x[:3], w, b, st, rd[:3], CFG, tol=2e-3)  # fewer rows
    check(x, w, None, st, rd, CFG, tol=2e-3)  # no bias
    check(x, w, b, st, rd, MD.MultiDeltaConfig(block_n=32, block_k_base=32, split_k=2, num_stages=1), tol=2e-3)
    assert len(MD._PLANAR_PLANS) == 4
    # the same launch with a float16 output instead of float32: a kernel compiled for one cannot write the other
    y16 = K.multi_delta_linear(x, w, b, st, rd, config=CFG)
    assert y16.dtype == torch.float16 and len(MD._PLANAR_PLANS) == 5
    ref = K.multi_delta_linear_reference(x, w, b, st, rd, out_dtype=torch.float32)
    assert (y16.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    # a stack of the same format whose scales are float32: Triton compiles another kernel for it
    check(x, w, b, dataclasses.replace(st, scales=st.scales.float()), rd, CFG, tol=2e-3)
    assert len(MD._PLANAR_PLANS) == 6
    # the same rows starting 2 bytes into a buffer: Triton would specialize the pointer differently
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    xs = buf[1:].view_as(x)
    xs.copy_(x)
    assert xs.data_ptr() % 16 != 0
    check(xs, w, b, st, rd, CFG, tol=2e-3)
    assert len(MD._PLANAR_PLANS) == 7


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_direct_launch_matches_reference(compiled, dtype, monkeypatch):
    """The first call compiles through Triton's JIT, the next ones call the compiled kernel directly:
    every one right, for changing row mixes, output dtypes, scale dtypes, a misaligned input and inside
    a captured graph."""
    monkeypatch.setenv("DELTAZIP_DIRECT_LAUNCH", "1")
    MD._PLANAR_PLANS.clear()
    g = torch.Generator().manual_seed(3)
    from hf_deltazip.kernels import layout as L

    st = L.prepare_stack(K.random_delta_stack(6, 1000, 2048, bits=2, group_size=128, scale_range=(0.01, 0.03),
                                              generator=g)).to("cuda")
    w = (0.05 * torch.randn(1000, 2048, generator=g)).to("cuda", dtype)
    b = torch.randn(1000, generator=g).to("cuda", dtype)
    for i in range(4):
        x = torch.randn(3, 2048, generator=g).to("cuda", dtype)
        rd = torch.randint(-1, 6, (3,), generator=g).to("cuda", torch.int32)
        check(x, w, b, st, rd, None, tol=1e-2)
    plans = list(MD._PLANAR_PLANS.values())
    assert len(plans) == 1
    if LP._direct_allowed():
        assert plans[0][0]._compiled is not None, "the compiled kernel was not kept for direct calls"
    # the same shapes with the output in the activation dtype, then float32 again (the jacobi bench's mix of
    # logits and hidden states): each through its own compiled kernel
    for out_dtype in (dtype, torch.float32, dtype):
        y = K.multi_delta_linear(x, w, b, st, rd, out_dtype=out_dtype)
        ref = K.multi_delta_linear_reference(x, w, b, st, rd, out_dtype=torch.float32)
        assert y.dtype == out_dtype
        assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    torch.cuda.synchronize()
    assert len(MD._PLANAR_PLANS) == 2
    # a stack of the same shapes whose scales are float32 (what compress keeps where float16 would lose
    # them): the first direct-launch run reused the float16 kernel here and read past the buffer
    st32 = dataclasses.replace(st, scales=st.scales.float())
    for _ in range(2):
        y = K.multi_delta_linear(x, w, b, st32, rd, out_dtype=torch.float32)
        ref = K.multi_delta_linear_reference(x, w, b, st32, rd, out_dtype=torch.float32)
        assert (y - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    torch.cuda.synchronize()
    assert len(MD._PLANAR_PLANS) == 3
    buf = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")
    xs = buf[1:].view_as(x)
    xs.copy_(x)
    before = len(MD._PLANAR_PLANS)
    for _ in range(2):
        check(xs, w, b, st, rd, None, tol=1e-2)
    assert len(MD._PLANAR_PLANS) == before + 1
    # captured: the direct call must launch on the capture stream
    out = torch.empty(3, 1000, dtype=torch.float32, device="cuda")
    rd_dev = rd.clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.multi_delta_linear(x, w, b, st, rd_dev, out_dtype=torch.float32, out=out)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        K.multi_delta_linear(x, w, b, st, rd_dev, out_dtype=torch.float32, out=out)
    rd_dev.copy_(torch.flip(rd, [0]))
    graph.replay()
    torch.cuda.synchronize()
    ref = K.multi_delta_linear_reference(x, w, b, st, rd_dev, out_dtype=torch.float32)
    assert (out - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
