"""The Gluon decode kernel (``kernels/_gluon_decode.py``): the deltas of an ``accumulate=True`` launch on an
sm_90 GPU, against the reference and the planar Triton kernel. It cannot run under the Triton interpreter:
on a machine without such a GPU only the backend choice is tested (the Triton kernel it falls back to is
tested under the interpreter in ``test_planar_kernel.py``)."""

import pytest
import torch

from hf_deltazip import kernels as K
from hf_deltazip.kernels import layout as L
from hf_deltazip.kernels import multi_delta as MD

from test_planar_kernel import check_accumulate

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")

from test_kernels import compiled, interpret  # noqa: E402,F401 - the shared fixtures


# --------------------------------------------------------------------------- everywhere
def test_backend_is_validated():
    with pytest.raises(ValueError, match="backend must be one of"):
        MD.set_default_backend("cuda")
    st = K.random_delta_stack(1, 8, 64, bits=4, group_size=32)
    x = torch.randn(2, 64)
    out = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="config.backend must be one of"):
        K.multi_delta_linear(x, None, None, st, torch.zeros(2, dtype=torch.int32), out=out, accumulate=True,
                             config=K.MultiDeltaConfig(backend="gluon"))


def test_gluon_launcher_refuses_an_unknown_split_rule():
    from hf_deltazip.kernels._gluon_decode import gluon_delta_accumulate

    st = L.prepare_stack(K.random_delta_stack(1, 64, 1024, bits=2, group_size=128))
    x = torch.randn(2, 1024, dtype=torch.bfloat16)
    seg = L.build_row_segments(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match='split_rule must be "rounds", "target" or "fixed"'):
        gluon_delta_accumulate(x, st, seg, torch.zeros(2, 64, dtype=torch.bfloat16), split_rule="even")


@pytest.mark.parametrize("rows, block_rows", [(1025, 8), (4, 65)])
def test_gluon_launcher_refuses_what_its_block_table_cannot_hold(rows, block_rows):
    from hf_deltazip.kernels._gluon_decode import gluon_delta_accumulate

    st = L.prepare_stack(K.random_delta_stack(1, 64, 1024, bits=2, group_size=128))
    x = torch.randn(rows, 1024, dtype=torch.bfloat16)
    seg = L.build_row_segments(torch.zeros(rows, dtype=torch.int32))
    with pytest.raises(ValueError, match="up to 1024 rows, 16383 deltas and row blocks of up to 64 rows"):
        gluon_delta_accumulate(x, st, seg, torch.zeros(rows, 64, dtype=torch.bfloat16), block_rows=block_rows)


def test_blocks_per_sm_gives_the_occupancy_nsight_compute_reported():
    from hf_deltazip.kernels.launch import blocks_per_sm

    # H100, 4 warps: Nsight Compute's block limits for the 2-bit build (208 registers, 71.81 KB dynamic shared
    # memory + 1 KB reserved: registers 2, shared memory 3) and the 4-bit one (168 registers, 73.86 KB: 3 and 3)
    assert blocks_per_sm(208, 73533, 4) == 2
    assert blocks_per_sm(168, 75633, 4) == 3
    assert blocks_per_sm(168, 120000, 4) == 1  # shared memory the limit
    assert blocks_per_sm(32, 0, 4) == 16  # threads the limit (2048 per SM)
    assert blocks_per_sm(255, 0, 8) == 1 and blocks_per_sm(256, 0, 16) == 0  # a program that does not fit


def test_default_backend_reaches_default_config():
    st = K.random_delta_stack(2, 64, 512, bits=2, group_size=128)
    try:
        assert K.default_config(8, 64, 512, st, torch.device("cpu")).backend == "auto"
        MD.set_default_backend("triton")
        assert K.default_config(8, 64, 512, st, torch.device("cpu")).backend == "triton"
    finally:
        MD.set_default_backend("auto")
    assert K.default_config(8, 64, 512, st, torch.device("cpu")).backend == "auto"


def test_gluon_is_not_chosen_off_hopper_or_for_unsupported_stacks():
    st = L.prepare_stack(K.random_delta_stack(2, 64, 1024, bits=2, group_size=128))
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    assert not MD.gluon_decode_supported(x, st)  # a CPU tensor
    if HOPPER:
        xc, stc = x.cuda(), st.to("cuda")
        assert MD.gluon_decode_supported(xc, stc)
        assert not MD.gluon_decode_supported(xc.float(), stc)  # float32 activations
        assert not MD.gluon_decode_supported(torch.randn(65, 1024, device="cuda", dtype=torch.bfloat16), stc)
        file_layout = K.random_delta_stack(2, 64, 1024, bits=2, group_size=128).to("cuda")
        assert not MD.gluon_decode_supported(xc, file_layout)
        per_row = L.prepare_stack(K.random_delta_stack(2, 64, 1024, bits=4, group_size=-1)).to("cuda")
        assert not MD.gluon_decode_supported(xc, per_row)


# --------------------------------------------------------------------------- sm_90
def _case(n, k, bits, gs, m, dtype, seed, u=8, with_base_rows=True):
    g = torch.Generator().manual_seed(seed)
    st = L.prepare_stack(K.random_delta_stack(u, n, k, bits=bits, group_size=gs, scale_range=(0.01, 0.03),
                                              generator=g)).to("cuda")
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype)
    lo = -1 if with_base_rows else 0
    rd = torch.randint(lo, u, (m,), generator=g).to("cuda", torch.int32)
    return x, w, b, st, rd


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("gs", [64, 128])
@pytest.mark.parametrize("m", [1, 7, 32, 45])
@pytest.mark.parametrize("n", [200, 256], ids=["out-rows-in-registers", "out-rows-by-cp.async"])
def test_gpu_gluon_accumulate_matches_reference(compiled, dtype, bits, gs, m, n):
    """Odd row counts, rows of the plain base, segments longer than a row block (45 rows over 8 deltas), output
    tiles cut by N = 200, both group sizes a k-step holds, against the reference; and equal to the Triton
    kernel's result to within the output's rounding. N = 200 leaves output rows that are not 16-byte aligned (the
    kernel reads what they hold into registers), N = 256 aligned ones (copied into shared memory)."""
    x, w, b, st, rd = _case(n, 1536 if bits == 4 else 1024, bits, gs, m, dtype, seed=m * bits + gs)
    assert MD.gluon_decode_supported(x, st)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    got = check_accumulate(x, w, b, st, rd, None, tol=tol)
    tri = check_accumulate(x, w, b, st, rd, K.MultiDeltaConfig(backend="triton"), tol=tol)
    base = (x.float() @ w.float().t() + b.float())
    d = rd >= 0
    if bool(d.any()):
        gap = float((got[d].float() - tri[d].float()).norm() / (tri[d].float() - base[d]).norm())
        assert gap < tol, gap


@needs_hopper
@pytest.mark.parametrize("bits,rule", [(2, "rounds"), (4, "rounds"), (2, "target")])
def test_gpu_gluon_split_k_and_lookup(compiled, bits, rule):
    """Few rows over one delta on a wide-K layer: the kernel splits K (partial sums added in a fixed order,
    counters reset for the next launch: two launches agree exactly) by either split rule; slot ids through
    a lookup table."""
    from hf_deltazip.kernels._gluon_decode import gluon_delta_accumulate

    x, w, b, st, _ = _case(512, 4096, bits, 128, 3, torch.bfloat16, seed=bits)
    slots = torch.tensor([5, -1, 5], dtype=torch.int32, device="cuda")
    lut = torch.full((9,), -1, dtype=torch.int32, device="cuda")
    lut[5 + 1] = 2  # slot 5 is delta 2 of this stack
    seg = L.build_row_segments(slots)
    base = (x.float() @ w.float().t() + b.float()).to(x.dtype)
    outs = []
    for _ in range(2):
        out = base.clone()
        gluon_delta_accumulate(x, st, seg, out, lut=lut, split_max=8, target=1024, split_rule=rule)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    idx = torch.tensor([2, -1, 2], dtype=torch.int32, device="cuda")
    ref = K.multi_delta_linear_reference(x, w, b, st, idx, out_dtype=torch.float32)
    assert torch.equal(outs[0][1], base[1])
    rows = torch.tensor([0, 2], device="cuda")
    err = float((outs[0][rows].float() - ref[rows]).norm() / (ref[rows] - base[rows].float()).norm())
    assert err < 3e-2, err
    one = base.clone()
    gluon_delta_accumulate(x, st, seg, one, lut=lut, split_max=1)  # no split: the same sums to rounding
    assert float((one.float() - outs[0].float()).abs().max()) <= float(base.float().abs().max()) * 2 ** -7


@needs_hopper
def test_gpu_gluon_bad_delta_ids_give_nan_rows(compiled):
    x, w, b, st, _ = _case(128, 1024, 2, 128, 4, torch.bfloat16, seed=3)
    rd = torch.tensor([0, 9, -1, -3], dtype=torch.int32, device="cuda")
    out = (x.float() @ w.float().t() + b.float()).to(x.dtype)
    before = out.clone()
    K.multi_delta_linear(x, None, None, st, rd, out=out, accumulate=True)
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()
    assert torch.equal(out[2], before[2]) and not torch.isnan(out[0]).any()


@needs_hopper
def test_gpu_gluon_graph_replay_follows_new_row_mix(compiled):
    x, w, b, st, _ = _case(1024, 2048, 2, 128, 32, torch.bfloat16, seed=11)
    rd = torch.zeros(32, dtype=torch.int32, device="cuda")
    seg = L.build_row_segments(rd)
    base = (x.float() @ w.float().t() + b.float()).to(x.dtype)
    out = base.clone()
    K.multi_delta_linear(x, None, None, st, rd, out=out, segments=seg, accumulate=True)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        L.build_row_segments(rd, out=seg)
        K.multi_delta_linear(x, None, None, st, rd, out=out, segments=seg, accumulate=True)
    g = torch.Generator().manual_seed(5)
    for mix in (torch.zeros(32), torch.arange(32) % 8, torch.randint(-1, 8, (32,), generator=g), torch.full((32,), -1)):
        rd.copy_(mix.to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = K.multi_delta_linear_reference(x, w, b, st, rd, out_dtype=torch.float32)
        d = rd >= 0
        assert torch.equal(out[~d], base[~d])
        if bool(d.any()):
            err = float((out[d].float() - ref[d]).norm() / (ref[d] - base[d].float()).norm())
            assert err < 3e-2, err


def test_the_gluon_kernel_takes_decode_steps_only(monkeypatch):
    """The choice itself, with the GPU check made to pass: steps of few rows per delta (or an unknown number, as
    in a captured decode step) take the Gluon kernel; prefills (many rows per delta), the Triton backend, a
    float32 output or a strided one do not."""
    monkeypatch.setattr(MD, "_gluon_available", lambda device: True)
    st = L.prepare_stack(K.random_delta_stack(4, 64, 1024, bits=2, group_size=128))
    x = torch.randn(32, 1024, dtype=torch.bfloat16)
    out = torch.zeros(32, 64, dtype=torch.bfloat16)
    auto = K.MultiDeltaConfig()
    assert MD.uses_gluon(x, st, out, auto, None) and MD.uses_gluon(x, st, out, auto, 8)
    assert not MD.uses_gluon(x, st, out, auto, 9)  # more rows per delta than one row block
    assert not MD.uses_gluon(x, st, out, K.MultiDeltaConfig(backend="triton"), None)
    assert not MD.uses_gluon(x, st, out.float(), auto, None)
    assert not MD.uses_gluon(x, st, torch.zeros(64, 32, dtype=torch.bfloat16).t(), auto, None)
    assert not MD.uses_gluon(torch.randn(65, 1024, dtype=torch.bfloat16), st, torch.zeros(65, 64, dtype=torch.bfloat16),
                             auto, None)  # more rows than a decode step
    shifted = torch.randn(32 * 1024 + 1, dtype=torch.bfloat16)[1:].view(32, 1024)
    assert not MD.uses_gluon(shifted, st, out, auto, None)  # rows not 16-byte aligned


def test_the_per_layer_bench_parses_variants_and_refuses_without_hopper():
    from hf_deltazip.bench import gluon_decode as bench

    assert bench._variant("4:8:4:64") == dict(num_warps=4, block_rows=8, stages=4, block_n=64)
    assert bench._variant("4:8:4:64:0:168") == dict(num_warps=4, block_rows=8, stages=4, block_n=64,
                                                     max_registers=168)
    assert bench._variant("8:16:3:128:4")["split_max"] == 4
    assert bench._variant("4:8:4:64:0:0:1") == dict(num_warps=4, block_rows=8, stages=4, block_n=64,
                                                     split_rule="target")
    assert bench._variant("4:8:0:64:0:-1") == dict(num_warps=4, block_rows=8, stages=None, block_n=64,
                                                    max_registers=0)  # the default stages, no register cap
    assert bench._variant("4:8:4:64:3:0:2:2") == dict(num_warps=4, block_rows=8, stages=4, block_n=64, split_max=3,
                                                       split_rule="fixed", per_sm=2)
    with pytest.raises(Exception, match="split rule"):
        bench._variant("4:8:4:64:0:0:3")
    with pytest.raises(Exception, match="warps:rows:stages:outputs"):
        bench._variant("4:8")
    if not HOPPER:
        with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
            bench.main(["--deltas", "1"])


def test_a_gluon_kernel_that_does_not_build_falls_back_to_triton(interpret, monkeypatch):
    """Another Triton whose Gluon API differs: the first launch warns, adds the deltas with the Triton kernel
    (here interpreted) exactly as that kernel alone does, and later launches do not try Gluon again; an error of
    the launch itself is not swallowed."""
    from triton.compiler.errors import CompilationError

    from hf_deltazip.kernels import _gluon_decode

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise CompilationError("src", None, "no such layout")

    monkeypatch.setattr(_gluon_decode, "gluon_delta_accumulate", broken)
    monkeypatch.setattr(MD, "_gluon_available", lambda device: MD._GLUON.get(MD._device_key(device), True))
    monkeypatch.setattr(MD, "gluon_decode_supported", lambda x, stack: MD._gluon_available(x.device))
    monkeypatch.setattr(MD, "_GLUON", {})
    g = torch.Generator().manual_seed(2)
    st = L.prepare_stack(K.random_delta_stack(3, 16, 512, bits=2, group_size=128, generator=g))
    x = torch.randn(5, 512, generator=g).to(torch.float16)
    rd = torch.tensor([0, 2, -1, 1, 0], dtype=torch.int32)
    start = torch.randn(5, 16, generator=g).to(torch.float16)
    cfg = K.MultiDeltaConfig(block_n=16, split_k=1, num_stages=1)
    want = K.multi_delta_linear(x, None, None, st, rd, out=start.clone(), accumulate=True,
                                config=K.MultiDeltaConfig(block_n=16, split_k=1, num_stages=1, backend="triton"))
    with pytest.warns(RuntimeWarning, match="does not build with this Triton"):
        got = K.multi_delta_linear(x, None, None, st, rd, out=start.clone(), accumulate=True, config=cfg)
    assert torch.equal(got, want) and calls == [1]
    again = K.multi_delta_linear(x, None, None, st, rd, out=start.clone(), accumulate=True, config=cfg)
    assert torch.equal(again, want) and calls == [1]  # not tried again on this device

    def crash(*args, **kwargs):
        raise ValueError("a launch error, not a build failure")

    monkeypatch.setattr(_gluon_decode, "gluon_delta_accumulate", crash)
    monkeypatch.setattr(MD, "_GLUON", {})
    with pytest.raises(ValueError, match="a launch error"):
        K.multi_delta_linear(x, None, None, st, rd, out=start.clone(), accumulate=True, config=cfg)


@pytest.mark.parametrize("field, setter, default, value, bad, bad_config", [
    ("gluon_block_rows", "set_gluon_block_rows", 8, 16, 12, 64),
    ("gluon_stages", "set_gluon_stages", 0, 2, 1, 5),  # 0: the launcher's stages
])
def test_gluon_launch_settings_are_chosen_and_validated(field, setter, default, value, bad, bad_config):
    """The library's default reaches default_config, a set value replaces it until reset (the setter returns the
    one it replaced), and values the kernel is not built for are refused, by the setter and in a config."""
    st = L.prepare_stack(K.random_delta_stack(2, 64, 512, bits=2, group_size=128))
    chosen = lambda: getattr(K.default_config(8, 64, 512, st, torch.device("cpu")), field)  # noqa: E731
    assert chosen() == default
    try:
        assert getattr(K, setter)(value) == default
        assert chosen() == value
    finally:
        getattr(K, setter)(default)
    assert chosen() == default
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        getattr(K, setter)(bad)
    with pytest.raises(ValueError, match=f"config.{field} must be one of"):
        K.multi_delta_linear(torch.randn(2, 512), None, None, st, torch.zeros(2, dtype=torch.int32),
                             out=torch.zeros(2, 64), accumulate=True, config=K.MultiDeltaConfig(**{field: bad_config}))


def test_larger_row_blocks_let_deltas_of_more_rows_take_the_gluon_kernel(monkeypatch):
    """A block of 16 rows lets a delta of up to 16 rows take the Gluon kernel (each block decodes the codes
    once); the default 8-row block does not."""
    st = L.prepare_stack(K.random_delta_stack(2, 64, 512, bits=2, group_size=128))
    monkeypatch.setattr(MD, "_gluon_available", lambda device: True)
    xb = torch.randn(32, 512, dtype=torch.bfloat16)
    out = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not MD.uses_gluon(xb, st, out, K.MultiDeltaConfig(), 16)
    assert MD.uses_gluon(xb, st, out, K.MultiDeltaConfig(gluon_block_rows=16), 16)
    assert not MD.uses_gluon(xb, st, out, K.MultiDeltaConfig(gluon_block_rows=16), 17)


@needs_hopper
@pytest.mark.parametrize("block_rows", [16, 32])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("m", [7, 45, 64])
@pytest.mark.parametrize("stages", [0, 2])
def test_gpu_gluon_larger_row_blocks_match_reference(compiled, block_rows, bits, m, stages):
    """Row blocks of 16 and 32, with the launcher's stages and with two: segments shorter and longer than a
    block, rows of the plain base, against the reference and the Triton kernel."""
    x, w, b, st, rd = _case(200, 1536 if bits == 4 else 1024, bits, 128, m, torch.bfloat16, seed=m + block_rows + bits,
                            u=3)
    cfg = K.MultiDeltaConfig(gluon_block_rows=block_rows, gluon_stages=stages)
    assert MD.uses_gluon(x, st, torch.empty(m, 200, device="cuda", dtype=torch.bfloat16), cfg, None)
    got = check_accumulate(x, w, b, st, rd, cfg, tol=3e-2)
    tri = check_accumulate(x, w, b, st, rd, K.MultiDeltaConfig(backend="triton"), tol=3e-2)
    base = (x.float() @ w.float().t() + b.float())
    d = rd >= 0
    gap = float((got[d].float() - tri[d].float()).norm() / (tri[d].float() - base[d]).norm())
    assert gap < 3e-2, gap
