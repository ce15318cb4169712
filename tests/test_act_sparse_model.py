"""DeltaModel decode steps through the activation-sparse kernels (``set_activation_sparsity(kernels=...)``).

The kernels run under the Triton interpreter (``use_kernels="always"``, ``TRITON_INTERPRET=1``); the
reference is the same thresholded model computed in PyTorch (``kernels=False`` on a ``"never"`` model).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipError
from hf_deltazip.bench.decode import random_delta
from hf_deltazip.kernels import act_sparse as A
from hf_deltazip.modeling import activation_sparsity as S
from hf_deltazip.modeling.layers import DeltaLinear, map_packed

from model_factory import base_model, calibration_ids


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _delta(bits, seed, scale=50.0, device="cpu"):
    """Random packed deltas of every decoder linear, large enough to change the outputs."""
    d = random_delta(base_model("llama"), bits, 32, seed)
    return {n: map_packed(p.__class__(**{**p.__dict__, "scales": p.scales * scale}), lambda t: t.to(device))
            for n, p in d.items()}


#: the layers thresholded here (a few, to keep the interpreter's time down): attention and MLP, both blocks
LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj")


@pytest.fixture(scope="module")
def thresholds():
    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    model.add_delta(_delta(4, 1), "d4")
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.5, rank=4)
    return S.ActivationThresholds(0.5, {n: th.thresholds[n] for n in LAYERS}, rank=4)


@pytest.fixture(scope="module")
def centred_thresholds():
    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    model.add_delta(_delta(4, 1), "d4")
    th = S.calibrate_activation_thresholds(model, calibration_ids(), 0.5, rank=4, centre=True)
    return S.ActivationThresholds(0.5, {n: th.thresholds[n] for n in LAYERS}, rank=4,
                                  centres={n: th.centres[n] for n in LAYERS})


def _models(th, kernels, deltas=(("d4", 4, 1), ("d2", 2, 2)), capacity=None, base_rows=1):
    ker = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    ref = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    for m in (ker, ref):
        if capacity:
            m.configure_cache(max_resident=capacity)
        for name, bits, seed in deltas:
            m.add_delta(_delta(bits, seed), name)
    assert ker.set_activation_sparsity(th, kernels=kernels, strict=False,
                                       threshold_base_rows=base_rows) == len(th.thresholds)
    ref.set_activation_sparsity(th, strict=False, threshold_base_rows=base_rows)
    return ker, ref


class _Calls:
    def __init__(self, monkeypatch):
        self.base = self.delta = 0
        real_b, real_d = A.sparse_base_linear, A.sparse_delta_linear

        def base(*a, **k):
            self.base += 1
            return real_b(*a, **k)

        def delta(*a, **k):
            self.delta += 1
            return real_d(*a, **k)

        monkeypatch.setattr(A, "sparse_base_linear", base)
        monkeypatch.setattr(A, "sparse_delta_linear", delta)
        import hf_deltazip.kernels.slot_stacks as SS  # noqa: F401  (imports act_sparse lazily: patched above)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, DeltaLinear) and S.has_activation_sparsity(m.base_layer)]


def _decode_step(model, ids, rows):
    """One-token rows (what a decode step feeds each layer)."""
    with torch.no_grad():
        return model(input_ids=ids[:, :1], delta_names=rows).logits


def test_decode_steps_through_the_sparse_kernels_equal_the_thresholded_model(interpret, monkeypatch, thresholds):
    ker, ref = _models(thresholds, True, base_rows=None)  # the base thresholded in every step
    calls = _Calls(monkeypatch)
    ids = calibration_ids(n=4, length=6, seed=5)
    rows = ["d4", None, "d2", "d4"]
    got = _decode_step(ker, ids, rows)
    n = len(_linears(ker))
    assert n == len(thresholds.thresholds)
    assert calls.base == n  # every thresholded layer took the sparse base kernel ...
    assert calls.delta == 2 * n  # ... and one delta launch per format class
    want = _decode_step(ref, ids, rows)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    dense = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    for name, bits, seed in (("d4", 4, 1), ("d2", 2, 2)):
        dense.add_delta(_delta(bits, seed), name)
    assert not torch.allclose(_decode_step(dense, ids, rows), want, atol=1e-3)  # the thresholds do something
    # the model-speed bench's layer check: every thresholded layer compared, on the input it got in the model
    from hf_deltazip.bench.act_sparsity import _layer_errors

    assert _layer_errors(ker, thresholds, ids[:, :1], rows, True, base_rows=None) < 1e-4
    assert calls.base == 2 * n  # the checked forward on the kernel route; the layers again in PyTorch
    with pytest.raises(DeltaZipError, match="no thresholded delta layer"):
        _layer_errors(DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always"), thresholds,
                      ids[:, :1], [None] * 4, True, base_rows=None)
    ker.set_activation_sparsity(thresholds, kernels=True, strict=False, threshold_base_rows=None)
    # prompts (several tokens per row) take the ordinary route, thresholded in PyTorch
    before = calls.base
    with torch.no_grad():
        torch.testing.assert_close(ker(input_ids=ids, delta_names=rows).logits,
                                   ref(input_ids=ids, delta_names=rows).logits, atol=2e-4, rtol=2e-4)
    assert calls.base == before


def test_base_rows_alone_and_one_delta_for_every_row(interpret, monkeypatch, thresholds):
    ker, ref = _models(thresholds, True)
    calls = _Calls(monkeypatch)
    ids = calibration_ids(n=1, length=3, seed=6)
    for rows in ([None], ["d2"]):
        torch.testing.assert_close(_decode_step(ker, ids, rows), _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    assert calls.base == 2 * len(thresholds.thresholds) and calls.delta == len(thresholds.thresholds)
    ker.set_delta("d4")  # the active delta, no delta_names
    ref.set_delta("d4")
    with torch.no_grad():
        torch.testing.assert_close(ker(input_ids=ids[:, :1]).logits, ref(input_ids=ids[:, :1]).logits,
                                   atol=2e-4, rtol=2e-4)


def _layer_io(model, name, ids, rows, tokens=1):
    """The input and output of the delta layer ``name`` in one forward of ``rows`` (``tokens`` each: 1, a
    decode step)."""
    layer = model.base_model.get_submodule(name)
    assert isinstance(layer, DeltaLinear)
    seen = {}
    handle = layer.register_forward_hook(lambda mod, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :tokens], delta_names=rows)
    finally:
        handle.remove()
    return layer, seen["x"], seen["y"]


def _by_hand(model, layer, x, rows, threshold, base_exact):
    """``W x + b`` (or ``W x_kept + b``: then without the compensation) plus each row's ``Δ x_kept``."""
    w = layer.base_weight_nk().float()
    kept = torch.where(x.abs() > threshold, x, torch.zeros_like(x)).float()
    y = torch.nn.functional.linear(x.float() if base_exact else kept, w, layer.base_layer.bias)
    for r, name in enumerate(rows):
        if name is not None:
            slot = model._cache.slot_of(name)
            y[r] += torch.nn.functional.linear(kept[r], layer.merged_weight(slot, torch.float32) - w)
    return y


@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch", "kernels"])
def test_a_step_of_several_rows_multiplies_the_base_by_the_whole_input(interpret, monkeypatch, thresholds, kernels):
    """The default ``threshold_base_rows=1``: in a one-token step of several rows the base weights read the
    whole input (exact, no compensation needed) and each row's delta its thresholded input; a step of one row
    thresholds both; ``None`` thresholds the base at every row count, ``0`` at none."""
    ker, ref = _models(thresholds, True)
    model = ker if kernels else ref
    calls = _Calls(monkeypatch)
    ids = calibration_ids(n=4, length=3, seed=11)
    rows = ["d4", None, "d2", "d4"]
    for name in LAYERS:
        layer, x, got = _layer_io(model, name, ids, rows)
        want = _by_hand(model, layer, x, rows, thresholds.thresholds[name], base_exact=True)
        torch.testing.assert_close(got.float(), want, atol=2e-4, rtol=2e-4)
        # and the exact base is not what thresholding it would give
        assert not torch.allclose(_by_hand(model, layer, x, rows, thresholds.thresholds[name], False), want, atol=1e-3)
    assert calls.base == 0  # no sparse base kernel in a step of four rows
    steps = len(LAYERS)  # one decode step per layer checked, two format classes (4- and 2-bit) per layer
    assert calls.delta == (steps * 2 * len(LAYERS) if kernels else 0)  # each row's delta still reads kept inputs only
    # the base-only row is the plain base model's row, exactly as without thresholds
    plain = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    torch.testing.assert_close(_decode_step(model, ids, rows)[1], _decode_step(plain, ids, [None] * 4)[1],
                               atol=2e-4, rtol=2e-4)
    # kernel route and PyTorch route agree on the whole model, and layer by layer (the model-speed bench's check)
    torch.testing.assert_close(_decode_step(ker, ids, rows), _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    if kernels:
        from hf_deltazip.bench.act_sparsity import _layer_errors

        assert _layer_errors(ker, thresholds, ids[:, :1], rows, True) < 1e-4
        ker.set_activation_sparsity(thresholds, kernels=True, strict=False)

    one = ["d2"]
    before = calls.base
    layer, x, got = _layer_io(model, LAYERS[0], ids[:1], one)  # one row: the base is thresholded too
    assert calls.base == before + (len(LAYERS) if kernels else 0)
    assert not torch.allclose(got.float(), _by_hand(model, layer, x, one, thresholds.thresholds[LAYERS[0]], True),
                              atol=1e-3)
    model.set_activation_sparsity(thresholds, strict=False, threshold_base_rows=0)  # the base never thresholded
    layer, x, got = _layer_io(model, LAYERS[0], ids[:1], one)
    torch.testing.assert_close(got.float(), _by_hand(model, layer, x, one, thresholds.thresholds[LAYERS[0]], True),
                               atol=2e-4, rtol=2e-4)
    layer, x, got = _layer_io(model, LAYERS[1], ids, rows, tokens=3)  # nor in a pass of several tokens per row
    torch.testing.assert_close(got.float(), _by_hand(model, layer, x, rows, thresholds.thresholds[LAYERS[1]], True),
                               atol=2e-4, rtol=2e-4)
    model.set_activation_sparsity(thresholds, strict=False)  # the default: such a pass thresholds the base too
    layer, x, got = _layer_io(model, LAYERS[1], ids, rows, tokens=3)
    assert not torch.allclose(got.float(), _by_hand(model, layer, x, rows, thresholds.thresholds[LAYERS[1]], True),
                              atol=1e-3)
    model.set_activation_sparsity(thresholds, strict=False, threshold_base_rows=None)  # always thresholded
    layer, x, got = _layer_io(model, LAYERS[0], ids, rows)
    assert not torch.allclose(got.float(), _by_hand(model, layer, x, rows, thresholds.thresholds[LAYERS[0]], True),
                              atol=1e-3)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="threshold_base_rows"):
            model.set_activation_sparsity(thresholds, strict=False, threshold_base_rows=bad)


def test_captured_style_static_routing_gives_the_host_routed_result(interpret, thresholds):
    ker, _ = _models(thresholds, True)
    ids = calibration_ids(n=3, length=2, seed=7)
    rows = ["d2", None, "d4"]
    want = _decode_step(ker, ids, rows)
    slots = torch.tensor([ker._cache.slot_of(r) if r else -1 for r in rows], dtype=torch.int32)
    with torch.no_grad(), ker.route_static(slots):  # what a decode engine's step runs
        got = ker.base_model(input_ids=ids[:, :1]).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_delta_written_into_free_room_later_is_served_from_its_input_major_copy(interpret, thresholds):
    ker, ref = _models(thresholds, True, deltas=(("d4", 4, 1),), capacity=4)
    stacks = [m.stacks for m in _linears(ker)]
    for m, name, bits, seed in ((ker, "late", 4, 3), (ref, "late", 4, 3)):
        m.add_delta(_delta(bits, seed), name)
    ids = calibration_ids(n=2, length=2, seed=8)
    rows = ["late", "d4"]
    got = _decode_step(ker, ids, rows)
    assert [m.stacks for m in _linears(ker)] == stacks  # written in place, no rebuild
    assert all(m.stacks.input_major_ready for m in _linears(ker))
    torch.testing.assert_close(got, _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    ker.delete_delta("late")
    ref.delete_delta("late")
    ker.add_delta(_delta(4, 4), "again")  # the freed room, rewritten
    ref.add_delta(_delta(4, 4), "again")
    torch.testing.assert_close(_decode_step(ker, ids, ["again", "d4"]), _decode_step(ref, ids, ["again", "d4"]),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("base_rows", [None, 1])
def test_centred_thresholds_on_the_sparse_kernels_equal_the_pytorch_route(interpret, monkeypatch, centred_thresholds,
                                                                          base_rows):
    """Centred thresholds: the kernels threshold x - mu, the base adds W mu and each row's delta D mu (a table per
    layer, rewritten in place when a delta is written into free room or evicted); the result is the PyTorch
    route's, where a dropped input stands at its centre."""
    ker, ref = _models(centred_thresholds, True, deltas=(("d4", 4, 1),), capacity=4, base_rows=base_rows)
    calls = _Calls(monkeypatch)
    ids = calibration_ids(n=3, length=2, seed=9)
    rows = ["d4", None, "d4"]
    torch.testing.assert_close(_decode_step(ker, ids, rows), _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    n = len(_linears(ker))
    assert calls.delta == n and calls.base == (n if base_rows is None else 0)  # 3 rows: base on the whole input
    stacks = [m.stacks for m in _linears(ker)]
    for m in (ker, ref):
        m.add_delta(_delta(4, 3), "late")  # written into the room kept for it: its D mu row too
    rows = ["late", "d4", None]
    torch.testing.assert_close(_decode_step(ker, ids, rows), _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    assert [m.stacks for m in _linears(ker)] == stacks
    slot = ker._cache.slot_of("late")
    for m in (ker, ref):
        m.delete_delta("late")
    assert all(not m._centre_delta[1][slot + 1].any() for m in _linears(ker))  # its row cleared with it
    for m in (ker, ref):
        m.add_delta(_delta(4, 4), "again")
    rows = ["again", None, "d4"]
    torch.testing.assert_close(_decode_step(ker, ids, rows), _decode_step(ref, ids, rows), atol=2e-4, rtol=2e-4)
    plain = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    plain.add_delta(_delta(4, 1), "d4")
    plain.add_delta(_delta(4, 4), "again")
    plain.set_activation_sparsity(S.ActivationThresholds(0.5, centred_thresholds.thresholds, rank=4), strict=False,
                                  threshold_base_rows=base_rows)
    assert not torch.allclose(_decode_step(plain, ids, rows), _decode_step(ref, ids, rows), atol=1e-4)  # centres count


def test_three_bit_deltas_fall_back_to_the_dense_delta_kernel_on_thresholded_inputs(interpret, monkeypatch,
                                                                                   thresholds):
    ker, ref = _models(thresholds, True, deltas=(("d3", 3, 1),), base_rows=None)
    calls = _Calls(monkeypatch)
    assert not any(m.stacks.input_major_ready for m in _linears(ker))
    ids = calibration_ids(n=2, length=2, seed=9)
    torch.testing.assert_close(_decode_step(ker, ids, ["d3", None]), _decode_step(ref, ids, ["d3", None]),
                               atol=2e-4, rtol=2e-4)
    assert calls.base == len(thresholds.thresholds) and calls.delta == 0


def test_the_base_weight_is_held_input_major_and_laid_back_out(interpret, thresholds):
    ker, _ = _models(thresholds, True)
    plain = base_model("llama")
    before = ker.memory_footprint()
    lin = _linears(ker)
    for m in lin:
        w = m.base_layer.weight
        assert not w.is_contiguous() and w.t().is_contiguous()
    name = next(n for n, mod in ker.base_model.named_modules() if mod is lin[0])
    torch.testing.assert_close(lin[0].base_layer.weight, plain.get_submodule(name).weight, atol=0, rtol=0)
    merged = ker.merge_and_unload("d4")
    assert all(p.is_contiguous() for p in merged.parameters())
    ker.set_activation_sparsity(thresholds, kernels=False, strict=False)  # no input-major delta copies
    assert ker.memory_footprint()["deltas"]["d4"] < before["deltas"]["d4"]
    assert ker.memory_footprint()["base"] == before["base"]
    assert all(m.base_layer.weight.is_contiguous() for m in lin)
    ker.set_activation_sparsity(thresholds, kernels=True, strict=False)
    assert ker.memory_footprint() == before
    ker.set_activation_sparsity(None)
    assert all(m.base_layer.weight.is_contiguous() and not m._sparse for m in lin)
    torch.testing.assert_close(lin[0].base_layer.weight, plain.get_submodule(name).weight, atol=0, rtol=0)
    ids = calibration_ids(n=2, length=4, seed=3)
    dense = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    dense.add_delta(_delta(4, 1), "d4")
    dense.add_delta(_delta(2, 2), "d2")
    with torch.no_grad():
        assert torch.equal(ker(input_ids=ids, delta_names=["d4", "d2"]).logits,
                           dense(input_ids=ids, delta_names=["d4", "d2"]).logits)


def test_layers_a_later_delta_wraps_follow_the_setting(thresholds):
    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    first = {n: p for n, p in _delta(4, 1).items() if ".layers.0." in n}
    model.add_delta(first, "layer0")
    model.set_activation_sparsity(thresholds, kernels=True, strict=False)
    assert sorted(n for n, m in model.base_model.named_modules() if isinstance(m, DeltaLinear) and m._sparse) == [
        n for n in sorted(LAYERS) if ".layers.0." in n]
    model.add_delta(_delta(2, 2), "all")  # wraps layer 1's linears now
    late = model.base_model.get_submodule("model.layers.1.mlp.up_proj")
    assert isinstance(late, DeltaLinear) and late._sparse and late._base_input_major()
    assert not model.base_model.get_submodule("model.layers.1.mlp.down_proj")._sparse  # not thresholded
    v = model.layout_version.value
    model.set_activation_sparsity(thresholds, kernels=True, strict=False, rank=0)  # new thresholds, same route
    assert model.layout_version.value > v  # a captured decode step holds the old ones: it is captured again
    model.set_activation_sparsity(None)
    assert not late._sparse and late.base_layer.weight.is_contiguous()


def test_a_conv1d_base_is_read_in_place_and_keeps_its_bias(interpret, monkeypatch):
    """GPT-2's Conv1D stores its weight [in, out]: already input-major, so it is not moved; its bias and a
    compressed delta's rows come out as in the thresholded model."""
    from hf_deltazip import DeltaZipConfig, compress

    from model_factory import finetune

    cfg = DeltaZipConfig(n_samples=4, seq_len=16, bits=4, group_size=32)
    delta = compress(base_model("gpt2"), finetune("gpt2", 1), cfg, calibration=calibration_ids(n=4, length=16),
                     progress=False)
    full = S.calibrate_activation_thresholds(base_model("gpt2"), calibration_ids(), 0.5, rank=4)
    names = [n for n in full.thresholds if n.endswith(("attn.c_attn", "mlp.c_proj"))][:2]
    th = S.ActivationThresholds(0.5, {n: full.thresholds[n] for n in names}, rank=4)
    ker = DeltaModel(copy.deepcopy(base_model("gpt2")), use_kernels="always")
    ref = DeltaModel(copy.deepcopy(base_model("gpt2")), use_kernels="never")
    for m in (ker, ref):
        m.add_delta(delta, "ft")
    ker.set_activation_sparsity(th, kernels=True, strict=False)
    ref.set_activation_sparsity(th, strict=False)
    lin = _linears(ker)
    assert len(lin) == 2 and all(m.transposed and m._sparse and m.base_layer.weight.is_contiguous() for m in lin)
    assert all(m.base_layer.bias is not None for m in lin)
    calls = _Calls(monkeypatch)
    ids = calibration_ids(n=2, length=2, seed=12)
    torch.testing.assert_close(_decode_step(ker, ids, ["ft", None]), _decode_step(ref, ids, ["ft", None]),
                               atol=2e-4, rtol=2e-4)
    assert calls.base == 0 and calls.delta == 2  # two rows: the base by the dense matmul on the whole input
    torch.testing.assert_close(_decode_step(ker, ids[:1], ["ft"]), _decode_step(ref, ids[:1], ["ft"]),
                               atol=2e-4, rtol=2e-4)
    assert calls.base == 2 and calls.delta == 4  # one row: the sparse base kernel, reading the weight in place


def test_the_byte_budget_counts_the_input_major_copies(interpret, thresholds):
    from hf_deltazip.modeling.cache import CacheFullError

    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    for name, bits, seed in (("a", 4, 1), ("b", 4, 2)):
        model.add_delta(_delta(bits, seed), name)
    ids = calibration_ids(n=2, length=4, seed=5)
    _decode_step(model, ids, ["a", "b"])  # the kernel stacks built, "b" used last
    packed = model.memory_footprint()["deltas"]
    assert model.cache.resident_bytes() == sum(packed.values())
    # room for both deltas' packed bytes and one delta's copies, not both
    model.configure_cache(max_resident_bytes=sum(packed.values()) + packed["a"] // 2)
    assert sorted(model.resident_deltas) == ["a", "b"]
    model.set_activation_sparsity(thresholds, kernels=True, strict=False)
    assert model.resident_deltas == ["b"]  # the least recently used delta made room for the copies
    held = model.memory_footprint()["deltas"]["b"]
    layers = _linears(model)
    copy_b = sum(m.stacks.input_major_nbytes(m.stacks.slots.pop()) for m in layers)
    assert copy_b > 0 and held == packed["b"] + copy_b  # what sits on the device ...
    assert model.cache.resident_bytes() == held  # ... is what the budget counts
    # a delta coming back evicts the other: with its copies the budget holds one
    _decode_step(model, ids, ["a", None])
    assert model.resident_deltas == ["a"]
    assert model.cache.resident_bytes() == model.memory_footprint()["deltas"]["a"] <= model.cache.max_resident_bytes
    assert not model.cache.fits(["a", "b"])  # admission counts the evicted delta's copies too
    # deltas in use that cannot fit with their copies: refused, the kernels left off, the thresholds on
    model.set_activation_sparsity(None)
    assert model.cache.fits(["a", "b"])  # off the route a delta is its packed bytes
    model.configure_cache(max_resident_bytes=None)
    model.cache.acquire(["a", "b"])
    model.configure_cache(max_resident_bytes=sum(packed.values()) + packed["a"] // 2)
    with pytest.raises(CacheFullError, match="raise the budget"):
        model.set_activation_sparsity(thresholds, kernels=True, strict=False)
    assert not model.kernel_policy.sparse and not any(m._sparse for m in _linears(model))
    assert sorted(model.resident_deltas) == ["a", "b"]
    assert len(S.activation_sparsity_of(model)) == len(thresholds.thresholds)
    model.cache.release(["a", "b"])


def test_a_load_is_budgeted_with_the_copies_of_layers_it_wraps_first(interpret, thresholds):
    """Before a delta is read, its copies are estimated from the file's modules, layers no delta wrapped yet
    included (they join the route when wrapped); the estimate is what the stacks then hold."""
    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    model.add_delta({n: p for n, p in _delta(4, 1).items() if ".layers.0." in n}, "first")  # block 0 only
    model.set_activation_sparsity(thresholds, kernels=True, strict=False)
    assert "model.layers.1.mlp.up_proj" in thresholds.thresholds  # thresholded, not wrapped yet
    second = _delta(4, 2)
    estimate = model._placer.sparse_copy_estimate(second)
    model.add_delta(second, "second")
    _decode_step(model, calibration_ids(n=1, length=2, seed=3), ["second"])  # stacks built, copies made
    held = sum(m.stacks.input_major_nbytes(model.cache.slot_of("second")) for m in _linears(model))
    assert len(_linears(model)) == len(thresholds.thresholds) and estimate == held > 0


def test_bad_kernel_choices_are_refused(thresholds):
    never = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    never.add_delta(_delta(4, 1), "d4")
    with pytest.raises(DeltaZipError, match="needs the Triton kernels"):
        never.set_activation_sparsity(thresholds, kernels=True, strict=False)
    with pytest.raises(DeltaZipError, match="kernels must be"):
        never.set_activation_sparsity(thresholds, kernels="base", strict=False)
    assert S.activation_sparsity_of(never) == {}  # nothing installed by a refused call
    with pytest.raises(DeltaZipError, match="strict=False"):  # thresholds of a few layers only
        never.set_activation_sparsity(thresholds)
    assert never.set_activation_sparsity(thresholds, strict=False) == len(thresholds.thresholds)  # auto: off on the CPU
    assert all(not m._sparse and m.base_layer.weight.is_contiguous() for m in _linears(never))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("centre", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("base_rows", [None, 1], ids=["base-thresholded", "base-whole-input"])
@pytest.mark.parametrize("deltas", [(("d4", 4, 1), ("d2", 2, 2), ("d8", 8, 3)), (("d4", 4, 1), ("d3", 3, 2))],
                         ids=["input-major", "3-bit fallback"])
def test_compiled_sparse_route_matches_pytorch_thresholding_on_gpu(monkeypatch, deltas, base_rows, centre):
    """The compiled kernels in eager and in a decode engine's captured steps. Whole-model outputs in float32
    (in bf16 a rounding either way moves inputs across their thresholds, and the outputs part); bf16 (which the
    interpreter is not trusted with) layer by layer, on the inputs each layer got in the model. With
    ``threshold_base_rows=None`` the base of these four-row steps takes the sparse base kernel; with the
    default (1) the dense matmul on the whole input."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from hf_deltazip.bench.act_sparsity import _layer_errors
    from hf_deltazip.serving import DecodeEngine

    th = S.calibrate_activation_thresholds(copy.deepcopy(base_model("llama")), calibration_ids(), 0.5, rank=4,
                                           centre=centre)
    ids = calibration_ids(n=4, length=6, seed=5).cuda()
    rows = [deltas[0][0], None, deltas[1][0], deltas[-1][0]]
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = models[dtype] = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda", dtype))
        model.configure_cache(max_resident=4)
        for name, bits, seed in deltas:
            model.add_delta(_delta(bits, seed, device="cuda"), name)
    model = models[torch.float32]
    model.set_activation_sparsity(th, kernels=False, threshold_base_rows=base_rows)
    with torch.no_grad():
        want = model(input_ids=ids[:, :1], delta_names=rows).logits
    calls = _Calls(monkeypatch)
    # kernels on by default on a GPU
    assert model.set_activation_sparsity(th, threshold_base_rows=base_rows) == len(th.thresholds)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids[:, :1], delta_names=rows).logits, want, atol=1e-4, rtol=1e-4)
    assert _layer_errors(models[torch.bfloat16], th, ids[:, :1], rows, True, base_rows) < 2e-2
    if base_rows is None:
        assert calls.base >= 2 * len(th.thresholds)
    else:  # a step of four rows: the base by the dense matmul
        assert calls.base == 0
    assert calls.delta == (0 if len(deltas) == 2 else 3 * 2 * len(th.thresholds))
    outs = {}
    for kernels in (False, True):  # greedy decoding through captured steps
        model.set_activation_sparsity(th, kernels=kernels, threshold_base_rows=base_rows)
        engine = DecodeEngine(model, max_batch_size=4, max_length=32)
        engine.add([ids[i].tolist() for i in range(4)], rows, max_new_tokens=6)
        logits = []
        while engine.active:
            engine.step()
            logits.append(engine._logits.clone())
        assert engine.captures >= 1
        outs[kernels] = torch.stack(logits)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-4, rtol=1e-4)
