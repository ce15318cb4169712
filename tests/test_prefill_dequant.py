"""The dequant prefill route: a stack's delta written out dense on the device, and DeltaModel forwards
that run the base through one dense matmul plus ``x_rows @ dequant(delta)^T`` per delta."""

import copy

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.bench.pairs import tiny_model
from hf_deltazip.errors import DeltaZipError

pytest.importorskip("triton")

VOCAB = 96


@pytest.mark.parametrize("bits,group_size,n,k", [
    (2, 128, 33, 1024), (2, -1, 3, 1024), (4, 128, 17, 512), (4, -1, 8, 512), (4, 64, 7, 384),
    (8, 64, 5, 256), (3, 64, 9, 192),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_delta_of_a_stack_equals_the_reference_exactly(bits, group_size, n, k, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.kernels import dequantize_delta, prepare_stack, random_delta_stack
    from hf_deltazip.kernels.dequant import dequantize_stack_delta

    stack = prepare_stack(random_delta_stack(3, n, k, bits=bits, group_size=group_size, device="cpu"))
    assert (stack.layout_block > 0) == (bits != 3)  # 3-bit keeps the file layout: the PyTorch path
    for i in range(3):
        want = dequantize_delta(stack, i, dtype)
        assert torch.equal(dequantize_stack_delta(stack, i, dtype), want)
        out = torch.empty(n, k, dtype=dtype)
        assert dequantize_stack_delta(stack, i, dtype, out=out) is out and torch.equal(out, want)
    with pytest.raises(IndexError):
        dequantize_stack_delta(stack, 3, dtype)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_stack_delta(stack, 0, dtype, out=torch.empty(n, k + 1, dtype=dtype))


def test_dense_delta_of_a_2of4_stack_keeps_pruned_entries_zero(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.kernels import dequantize_delta, random_delta_stack
    from hf_deltazip.kernels.dequant import dequantize_stack_delta

    stack = random_delta_stack(2, 8, 256, bits=4, group_size=64, sparse_2of4=True, device="cpu")
    got = dequantize_stack_delta(stack, 1, torch.float32)
    assert torch.equal(got, dequantize_delta(stack, 1, torch.float32))
    assert int((got.view(8, 64, 4) != 0).sum(-1).max()) <= 2


@pytest.fixture(scope="module")
def planar_pair(tmp_path_factory):
    """A base whose layers have a planar layout (inputs a multiple of 256) and two deltas, 4- and 2-bit."""
    base = tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=256, num_layers=1)
    root = tmp_path_factory.mktemp("prefill")
    out = {}
    for name, seed, bits in (("four", 1, 4), ("two", 2, 2)):
        ft = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        ids = torch.randint(0, VOCAB, (4, 16), generator=gen)
        delta = compress(base, ft, DeltaZipConfig(bits=bits, group_size=128, n_samples=4, seq_len=16),
                         calibration=ids, progress=False)
        delta.save_pretrained(root / name)
        out[name] = root / name
    return base, out


def _model(base, paths, **kw):
    m = DeltaModel(copy.deepcopy(base), **kw)
    for name, path in paths.items():
        m.load_delta(path, delta_name=name)
    return m


def _spies(monkeypatch):
    from hf_deltazip.kernels import dequant, multi_delta

    calls = {"dequant": 0, "fused": 0, "dequant_launches": 0}
    real_d, real_ds, real_f = dequant.dequantize_stack_delta, dequant.dequantize_stack_deltas, multi_delta.multi_delta_linear

    def d(*a, **k):
        calls["dequant"] += 1
        calls["dequant_launches"] += 1
        return real_d(*a, **k)

    def ds(stack, which, *a, **k):  # deltas written out dense, and launches
        calls["dequant"] += which.shape[0]
        calls["dequant_launches"] += 1
        return real_ds(stack, which, *a, **k)

    def f(*a, **k):
        calls["fused"] += 1
        return real_f(*a, **k)

    monkeypatch.setattr(dequant, "dequantize_stack_delta", d)
    monkeypatch.setattr(dequant, "dequantize_stack_deltas", ds)
    monkeypatch.setattr(multi_delta, "multi_delta_linear", f)
    return calls


def _reference_and_kernel_models(planar_pair, monkeypatch):
    """(kernel call counts, a reference-route model, a kernel-route model), both with the two deltas."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base, paths = planar_pair
    calls = _spies(monkeypatch)
    return calls, _model(base, paths, use_kernels="never"), _model(base, paths, use_kernels="always")


def test_dequant_route_matches_the_fused_kernel_and_the_reference(planar_pair, monkeypatch):
    calls, ref, ker = _reference_and_kernel_models(planar_pair, monkeypatch)
    ids = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(5))
    rows = ["two", None, "four"]
    with torch.no_grad():
        want = ref(input_ids=ids, delta_names=rows).logits
        fused = ker(input_ids=ids, delta_names=rows).logits
        assert calls["fused"] and not calls["dequant"]  # the default route
        calls["fused"] = 0
        ker.configure_kernels(prefill="dequant", dequant_min_rows=8)  # 8 tokens per delta: dequant
        got = ker(input_ids=ids, delta_names=rows).logits
        assert calls["dequant"] == 2 * 8 and not calls["fused"]  # each delta once per linear layer (7 + LM head)
        calls["dequant"] = 0
        ker.configure_kernels(dequant_min_rows=9)  # fewer rows than that: back to the fused kernel
        again = ker(input_ids=ids, delta_names=rows).logits
        assert calls["fused"] and not calls["dequant"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, fused, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, fused)


def test_dequant_route_writes_a_format_class_of_deltas_in_one_launch(planar_pair, tmp_path, monkeypatch):
    """Two 2-bit deltas (one format class) with 2 and 1 rows and a 4-bit one: per linear layer one launch
    writes both 2-bit deltas out and one batched matmul (the 1-row delta padded) runs their rows; with the
    chunk cap under two deltas, one launch each. Logits equal the reference's either way."""
    from hf_deltazip.kernels import slot_stacks

    base, paths = planar_pair
    ft = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    delta = compress(base, ft, DeltaZipConfig(bits=2, group_size=128, n_samples=4, seq_len=16),
                     calibration=torch.randint(0, VOCAB, (4, 16), generator=gen), progress=False)
    delta.save_pretrained(tmp_path / "two_b")
    paths = {**paths, "two_b": tmp_path / "two_b"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = _spies(monkeypatch)
    ref, ker = _model(base, paths, use_kernels="never"), _model(base, paths, use_kernels="always")
    ker.configure_kernels(prefill="dequant", dequant_min_rows=8)
    ids = torch.randint(0, VOCAB, (5, 8), generator=torch.Generator().manual_seed(10))
    rows = ["two", "four", "two_b", None, "two"]
    with torch.no_grad():
        want = ref(input_ids=ids, delta_names=rows).logits
        got = ker(input_ids=ids, delta_names=rows).logits
        assert (calls["dequant"], calls["dequant_launches"], calls["fused"]) == (3 * 8, 2 * 8, 0)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        calls.update(dequant=0, dequant_launches=0)
        monkeypatch.setattr(slot_stacks, "DEQUANT_CHUNK_BYTES", 256 * 256 * 4)  # one float32 layer of 256 x 256
        again = ker(input_ids=ids, delta_names=rows).logits
    assert calls["dequant"] == 3 * 8 and calls["dequant_launches"] > 2 * 8
    torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-4)


def test_dense_deltas_of_a_stack_by_index_or_slot_equal_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.kernels import dequantize_delta, dequantize_stack_deltas, prepare_stack, random_delta_stack

    for bits, gs, n, k in ((2, 128, 33, 1024), (4, 64, 7, 384), (3, 64, 9, 192)):
        stack = prepare_stack(random_delta_stack(4, n, k, bits=bits, group_size=gs, device="cpu"))
        want = torch.stack([dequantize_delta(stack, i, torch.float16) for i in (3, 1, 1)])
        got = dequantize_stack_deltas(stack, torch.tensor([3, 1, 1], dtype=torch.int32), torch.float16)
        assert torch.equal(got, want), bits
        lut = torch.tensor([-1, -1, 3, 1, -1], dtype=torch.int32)  # slot 1 -> index 3, slot 2 -> index 1
        out = torch.empty(3, n, k, dtype=torch.float16)
        assert dequantize_stack_deltas(stack, torch.tensor([1, 2, 2], dtype=torch.int32), torch.float16, lut=lut,
                                       out=out) is out
        assert torch.equal(out, want), bits
        assert dequantize_stack_deltas(stack, torch.zeros(0, dtype=torch.int32)).shape == (0, n, k)
    with pytest.raises(ValueError, match="1-D int32 tensor"):
        dequantize_stack_deltas(stack, [0, 1])
    with pytest.raises(ValueError, match="1-D int32 tensor"):
        dequantize_stack_deltas(stack, torch.tensor([0, 1]))  # int64
    with pytest.raises(ValueError, match="out must be"):
        dequantize_stack_deltas(stack, torch.tensor([0], dtype=torch.int32), out=torch.empty(2, n, k))


def test_configure_kernels_refuses_bad_values():
    m = DeltaModel(tiny_model("llama", vocab_size=VOCAB, seed=0, hidden_size=64, num_layers=1))
    assert (m.kernel_policy.prefill, m.kernel_policy.prefill_split_min_rows) == ("auto", 1024)  # the defaults
    with pytest.raises(DeltaZipError, match='"auto", "fused", "dequant" or "split"'):
        m.configure_kernels(prefill="cublas")
    with pytest.raises(DeltaZipError, match="positive int"):
        m.configure_kernels(dequant_min_rows=0)
    for bad in (0, True, 8.0):
        with pytest.raises(DeltaZipError, match="prefill_split_min_rows must be a positive int"):
            m.configure_kernels(prefill="split", prefill_split_min_rows=bad)
    assert (m.kernel_policy.prefill, m.kernel_policy.prefill_split_min_rows) == ("auto", 1024)  # nothing changed
    with pytest.raises(DeltaZipError, match='decode must be "auto", "fused" or "split"'):
        m.configure_kernels(decode="dequant")
    with pytest.raises(DeltaZipError, match="decode_split_min_rows must be a positive int"):
        m.configure_kernels(decode_split_min_rows=0)
    for bad in (0, True, 2.0):
        with pytest.raises(DeltaZipError, match="decode_split_min_deltas must be a positive int"):
            m.configure_kernels(decode="split", decode_split_min_deltas=bad)
    policy = m.kernel_policy
    assert (policy.decode, policy.decode_split_min_rows, policy.decode_split_min_deltas) == ("auto", 1, 6)
    m.configure_kernels(prefill="dequant")
    assert (m.kernel_policy.prefill, m.kernel_policy.dequant_min_rows) == ("dequant", 64)
    m.configure_kernels(prefill_split_min_rows=256)
    kept = copy.deepcopy(m.kernel_policy)
    assert (kept.prefill, kept.prefill_split_min_rows) == ("dequant", 256)


def _base_spy(monkeypatch):
    """Records, per multi-delta kernel call, whether it read the base weight itself (the others add the deltas
    alone to an output that holds the base's product: ``base_weight=None, accumulate=True``)."""
    from hf_deltazip.kernels import multi_delta

    reads_base = []
    real = multi_delta.multi_delta_linear

    def f(x, base_weight, *a, **k):
        assert (base_weight is None) == bool(k.get("accumulate", False))
        reads_base.append(base_weight is not None)
        return real(x, base_weight, *a, **k)

    monkeypatch.setattr(multi_delta, "multi_delta_linear", f)
    return reads_base


# the planar pair's 7 linear layers (a 4-bit and a 2-bit class each) and its LM head (one class: both deltas
# store it with 4-bit embedding_bits)
LINEAR_LAYERS = 8
LAUNCHES = 2 * 7 + 1


def _three_rows(planar_pair, monkeypatch, seed):
    """(kernel model, spy, forward of three 8-token rows on "two", the base and "four", the reference model's
    logits, the kernel model's on the default route (fused at these 24 tokens)) for the route tests below."""
    _, ref, ker = _reference_and_kernel_models(planar_pair, monkeypatch)
    spy = _base_spy(monkeypatch)
    ids = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(seed))

    def forward(model):
        with torch.no_grad():
            return model(input_ids=ids, delta_names=["two", None, "four"]).logits

    return ker, spy, forward, forward(ref), forward(ker), (ref, ids)


def test_split_route_matches_the_fused_kernel_and_the_reference(planar_pair, monkeypatch):
    """prefill="split": the base by one dense matmul, the deltas added to it by the kernel, for
    batches whose every delta has dequant_min_rows tokens or more; fewer, and the fused kernel runs."""
    ker, reads_base, forward, want, fused, _ = _three_rows(planar_pair, monkeypatch, seed=5)
    # the default route: one launch per format class and layer, the first reading the base, the second adding
    # its deltas to that output
    assert len(reads_base) == LAUNCHES and sum(reads_base) == LINEAR_LAYERS
    reads_base.clear()
    ker.configure_kernels(prefill="split", dequant_min_rows=8)  # 8 tokens per delta: split
    got = forward(ker)
    assert len(reads_base) == LAUNCHES and not any(reads_base)  # the base by the dense matmul
    reads_base.clear()
    ker.configure_kernels(dequant_min_rows=9)  # fewer rows than that: back to the fused kernel
    again = forward(ker)
    assert sum(reads_base) == LINEAR_LAYERS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, fused, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, fused)
    assert ker.kernel_policy.prefill == "split" and copy.deepcopy(ker.kernel_policy).prefill == "split"


def test_auto_prefill_splits_forwards_of_prefill_split_min_rows_tokens(planar_pair, monkeypatch):
    """prefill="auto" (the default): the split route for forwards of prefill_split_min_rows tokens or more
    (every delta with dequant_min_rows of them), the fused kernel for smaller ones."""
    ker, reads_base, forward, want, fused, _ = _three_rows(planar_pair, monkeypatch, seed=9)
    assert ker.kernel_policy.prefill == "auto"
    assert sum(reads_base) == LINEAR_LAYERS  # 24 tokens < 1024: fused
    reads_base.clear()
    ker.configure_kernels(prefill_split_min_rows=24, dequant_min_rows=8)  # 3 rows x 8 tokens: split
    got = forward(ker)
    assert len(reads_base) == LAUNCHES and not any(reads_base)  # the base by the dense matmul
    reads_base.clear()
    ker.configure_kernels(dequant_min_rows=9)  # a delta with fewer tokens than that: fused
    assert torch.equal(forward(ker), fused) and sum(reads_base) == LINEAR_LAYERS
    reads_base.clear()
    ker.configure_kernels(prefill_split_min_rows=25, dequant_min_rows=8)  # fewer tokens in all: fused
    assert torch.equal(forward(ker), fused) and sum(reads_base) == LINEAR_LAYERS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, fused, rtol=1e-4, atol=1e-4)


def test_decode_split_route_matches_the_fused_kernel_and_the_reference(planar_pair, monkeypatch):
    """decode="split": every forward of decode_split_min_rows rows or more (one-token steps included) runs
    the base by one dense matmul and adds the deltas alone into its output; fewer rows, the fused kernel."""
    ker, reads_base, forward, want, fused, (ref, ids) = _three_rows(planar_pair, monkeypatch, seed=7)
    assert len(reads_base) == LAUNCHES and sum(reads_base) == LINEAR_LAYERS
    reads_base.clear()
    version = ker.layout_version.value
    ker.configure_kernels(decode="split")
    assert ker.layout_version.value > version  # captured decode steps took the other route: capture again
    got = forward(ker)
    assert len(reads_base) == LAUNCHES and not any(reads_base)
    reads_base.clear()
    ker.configure_kernels(decode_split_min_rows=25)  # 24 rows (3 x 8 tokens): the fused kernel again
    again = forward(ker)
    assert sum(reads_base) == LINEAR_LAYERS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, fused, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, fused)
    policy = copy.deepcopy(ker.kernel_policy)
    assert (policy.decode, policy.decode_split_min_rows) == ("split", 25)
    ker.configure_kernels(decode_split_min_rows=1)
    kw = dict(attention_mask=torch.ones_like(ids[:2, :5]), max_new_tokens=4, do_sample=False, pad_token_id=0,
              delta_names=["four", "two"])
    reads_base.clear()
    assert torch.equal(ker.generate(ids[:2, :5], **kw), ref.generate(ids[:2, :5], **kw))
    assert reads_base and not any(reads_base)  # prefill and one-token steps alike


def test_auto_decode_splits_forwards_of_decode_split_min_deltas_deltas(planar_pair, monkeypatch):
    """decode="auto" (the default): where the Gluon kernel would add the deltas (faked here), a forward routed
    on the host takes the split route when its rows carry decode_split_min_deltas distinct deltas or more,
    the fused kernel otherwise; a route the decode engine sets for its step overrides the count. Without
    the Gluon kernel (this CPU), always the fused kernel."""
    import threading

    import hf_deltazip.kernels as hk

    ker, reads_base, forward, want, fused, _ = _three_rows(planar_pair, monkeypatch, seed=11)
    policy = ker.kernel_policy
    assert policy.decode == "auto" and sum(reads_base) == LINEAR_LAYERS
    assert policy.decode_route(24, 2, "cpu") == "fused"
    monkeypatch.setattr(hk, "gluon_decode_available", lambda device: True)
    assert policy.decode_route(64, 6, "cuda") == "split"
    assert policy.decode_route(65, 6, "cuda") == "fused"  # more rows than the Gluon kernel takes: a prefill
    assert policy.decode_route(64, 5, "cuda") == "fused"
    version = ker.layout_version.value
    ker.configure_kernels(decode_split_min_deltas=2)  # this forward's rows carry "two" and "four"
    assert ker.layout_version.value > version
    reads_base.clear()
    got = forward(ker)
    assert len(reads_base) == LAUNCHES and not any(reads_base)
    reads_base.clear()
    ker.configure_kernels(decode_split_min_deltas=3)
    again = forward(ker)
    assert sum(reads_base) == LINEAR_LAYERS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, fused)
    reads_base.clear()
    with policy.step_route("split"):  # what the engine sets for a step: the count is not consulted
        assert torch.equal(forward(ker), got)
        seen = []
        t = threading.Thread(target=lambda: seen.append(policy.wants_decode_split(24, 2)))  # another thread
        t.start()
        t.join()
        assert seen == [False]
    assert not any(reads_base)
    with policy.step_route("fused"):
        assert torch.equal(forward(ker), fused)
    with pytest.raises(DeltaZipError, match="a step route"):
        with policy.step_route("dequant"):
            pass
    assert copy.deepcopy(policy).decode_split_min_deltas == 3


@pytest.mark.parametrize("route", ["dequant", "split"])
def test_generate_with_a_prefill_route_equals_the_reference(route, planar_pair, monkeypatch):
    calls, ref, ker = _reference_and_kernel_models(planar_pair, monkeypatch)
    reads_base = _base_spy(monkeypatch)
    ker.configure_kernels(prefill=route, dequant_min_rows=4)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0,
              delta_names=["four", "two"])
    want = ref.generate(ids, **kw)
    got = ker.generate(ids, **kw)
    if route == "dequant":
        assert calls["dequant"] and calls["fused"]  # prefill dequantized, one-token steps fused
    else:
        # prefill split (no launch reads the base, but the LM head's: it sees one row per prompt, under
        # dequant_min_rows), the 4 one-token steps after it fused (one launch per layer reads it)
        assert sum(reads_base) == 1 + 4 * LINEAR_LAYERS
    assert torch.equal(got, want)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_compiled_dequant_kernel_and_route_on_the_gpu(planar_pair, monkeypatch):
    """The compiled kernel writes exactly the reference's dense delta (bf16 too), and a bf16 prefill through
    the dequant route agrees with the fused kernel to bf16 rounding."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from hf_deltazip.kernels import dequantize_delta, dequantize_stack_deltas, prepare_stack, random_delta_stack
    from hf_deltazip.kernels.dequant import dequantize_stack_delta

    for bits, gs, n, k in ((2, 128, 1000, 4096), (4, 128, 1000, 3840), (8, 64, 33, 1024), (4, -1, 64, 512)):
        stack = prepare_stack(random_delta_stack(2, n, k, bits=bits, group_size=gs, device="cuda"))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(dequantize_stack_delta(stack, 1, dtype), dequantize_delta(stack, 1, dtype)), (bits, gs, dtype)
            both = dequantize_stack_deltas(stack, torch.tensor([1, 0], dtype=torch.int32, device="cuda"), dtype)
            assert torch.equal(both[0], dequantize_delta(stack, 1, dtype)) and torch.equal(both[1], dequantize_delta(stack, 0, dtype))
    base, paths = planar_pair
    model = _model(copy.deepcopy(base).to("cuda", torch.bfloat16), paths)
    ids = torch.randint(0, VOCAB, (3, 64), generator=torch.Generator().manual_seed(7)).cuda()
    rows = ["two", "four", "two"]
    with torch.no_grad():
        fused = model(input_ids=ids, delta_names=rows).logits.float()
        model.configure_kernels(prefill="dequant", dequant_min_rows=64)
        got = model(input_ids=ids, delta_names=rows).logits.float()
        model.configure_kernels(prefill="split")
        split = model(input_ids=ids, delta_names=rows).logits.float()
    assert float((got - fused).norm() / fused.norm()) < 1e-2
    assert float((split - fused).norm() / fused.norm()) < 1e-2
    # float32: the default route over layers of two format classes (the second class's launch adds its deltas
    # to the first's output, compiled) equals the reference; rows of the base between rows of deltas
    ref = _model(copy.deepcopy(base).to("cuda"), paths, use_kernels="never")
    ker = _model(copy.deepcopy(base).to("cuda"), paths, use_kernels="always")
    rows = ["two", None, "four"]
    with torch.no_grad():
        want, got = (m(input_ids=ids, delta_names=rows).logits for m in (ref, ker))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_dequant_route_on_a_transposed_layer_with_bias_changes(tmp_path, monkeypatch):
    """GPT-2's Conv1D layers (weights stored [in, out]) whose fine-tune also changed the biases: the dequant
    route reads the base transposed and adds each row's bias change, as the reference does."""
    from model_factory import base_model, calibration_ids, finetune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    compress(base_model("gpt2"), finetune("gpt2", 1), cfg, calibration=calibration_ids(n=4, length=16),
             progress=False).save_pretrained(tmp_path / "d")
    calls = _spies(monkeypatch)
    ref = _model(base_model("gpt2"), {"d": tmp_path / "d"}, use_kernels="never")
    ker = _model(base_model("gpt2"), {"d": tmp_path / "d"}, use_kernels="always")
    ker.configure_kernels(prefill="dequant", dequant_min_rows=4)
    ids = calibration_ids(n=2, length=6, seed=3)
    with torch.no_grad():
        want = ref(input_ids=ids, delta_names=["d", None]).logits
        got = ker(input_ids=ids, delta_names=["d", None]).logits
    assert calls["dequant"] and not calls["fused"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_dequant_route_builds_each_deltas_row_index_once_per_batch():
    # every layer gathers the same rows of a delta: the index is made once and shared (one host-to-device
    # copy per batch, not one per layer, which on a GPU waits for the stream each time)
    from hf_deltazip.modeling.routing import BatchRouting

    routing = BatchRouting.per_row([3, -1, 3])
    idx = routing.token_rows((0, 2), 4, torch.device("cpu"))
    assert idx.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert routing.token_rows((0, 2), 4, torch.device("cpu")) is idx
    assert routing.token_rows((1,), 4, torch.device("cpu")).tolist() == [4, 5, 6, 7]


def test_the_dequant_routes_gather_plan_pads_each_delta_to_the_most_rows_once_per_batch():
    from hf_deltazip.modeling.routing import BatchRouting

    routing = BatchRouting.per_row([3, 5, 3])
    cpu = torch.device("cpu")
    gather, keep, rows = routing.gather_plan(((0, 2), (1,)), 2, cpu)  # delta 3: rows 0 and 2; delta 5: row 1
    assert gather.tolist() == [0, 1, 4, 5, 2, 3, 2, 2]  # delta 5's two tokens padded with its first
    assert keep.tolist() == [0, 1, 2, 3, 4, 5] and rows.tolist() == [0, 1, 4, 5, 2, 3]
    assert routing.gather_plan(((0, 2), (1,)), 2, cpu)[0] is gather
    gather, keep, rows = routing.gather_plan(((0,), (1,)), 3, cpu)  # as many rows each: nothing padded
    assert keep is None and gather.tolist() == rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert routing.int32_on((4, 2), cpu).tolist() == [4, 2] and routing.int32_on((4, 2), cpu).dtype == torch.int32
    assert routing.int32_on((4, 2), cpu) is routing.int32_on((4, 2), cpu)
