"""DeltaModel through the Triton kernel path: under the interpreter on CPU, compiled on a GPU."""

import copy

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress

from model_factory import base_model, calibration_ids, finetune

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def two_deltas(tmp_path_factory):
    root = tmp_path_factory.mktemp("kdeltas")
    out = {}
    for arch in ("qwen2", "gpt2"):
        for name, seed, settings in (("four", 1, dict(bits=4, group_size=32)), ("two", 2, dict(bits=2, sparsity="2:4", group_size=-1))):
            cfg = DeltaZipConfig(n_samples=4, seq_len=16, **settings)
            compress(base_model(arch), finetune(arch, seed), cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(root / f"{arch}-{name}")
            out[arch, name] = root / f"{arch}-{name}"
    return out


def spy_kernel(monkeypatch):
    from hf_deltazip.kernels import multi_delta

    calls = []
    real = multi_delta.multi_delta_linear

    def wrapped(*a, **k):
        calls.append((a[3].bits, a[3].sparse_2of4))
        return real(*a, **k)

    monkeypatch.setattr(multi_delta, "multi_delta_linear", wrapped)
    return calls


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_kernel_path_matches_reference_path_under_interpreter(arch, two_deltas, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy_kernel(monkeypatch)
    ref = DeltaModel(copy.deepcopy(base_model(arch)), use_kernels="never")
    ker = DeltaModel(copy.deepcopy(base_model(arch)), use_kernels="always")
    for m in (ref, ker):
        m.load_delta(two_deltas[arch, "four"], delta_name="four")
        m.load_delta(two_deltas[arch, "two"], delta_name="two")
    ids = calibration_ids(n=3, length=5, seed=11)
    rows = ["two", None, "four"]
    with torch.no_grad():
        want = ref(input_ids=ids, delta_names=rows).logits
        got = ker(input_ids=ids, delta_names=rows).logits
    assert calls, "the kernel path was not taken"
    # decoder layers: one launch per format class (4-bit grouped; 2-bit 2:4, which the stacks hold as
    # dense codes of the same bits so it runs the dense path)
    assert {(4, False), (2, False)} <= set(calls) and (2, True) not in set(calls)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_bf16_on_gpu_matches_merged_fine_tunes(arch, two_deltas, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = spy_kernel(monkeypatch)
    model = DeltaModel(copy.deepcopy(base_model(arch)).to("cuda", torch.bfloat16))
    model.load_delta(two_deltas[arch, "four"], delta_name="four")
    model.load_delta(two_deltas[arch, "two"], delta_name="two")
    ids = calibration_ids(n=3, length=12, seed=11).cuda()
    rows = ["two", None, "four"]
    with torch.no_grad():
        got = model(input_ids=ids, delta_names=rows).logits.float()
        for i, name in enumerate(rows):
            ref_model = base_model(arch) if name is None else model.merge_and_unload(name).float().cpu()
            want = ref_model(input_ids=ids[i : i + 1].cpu()).logits[0]
            err = (got[i].cpu() - want).norm() / want.norm()
            assert err < 2e-2, (arch, name, float(err))
    assert calls
    out = model.generate(ids, attention_mask=torch.ones_like(ids), delta_names=rows, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (3, 16)


def test_kernel_launches_know_how_many_rows_share_a_delta(two_deltas, monkeypatch):
    """Outside captured steps a layer tells the kernel how many rows share each delta (a prefill's many
    rows share few deltas); on a GPU that sizes the kernel's row blocks, so the weights are read fewer times."""
    from hf_deltazip.kernels import multi_delta

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    real = multi_delta.multi_delta_linear

    def wrapped(*a, **k):
        seen.append(k.get("rows_per_delta"))
        return real(*a, **k)

    monkeypatch.setattr(multi_delta, "multi_delta_linear", wrapped)
    model = DeltaModel(copy.deepcopy(base_model("qwen2")), use_kernels="always")
    model.load_delta(two_deltas["qwen2", "four"], delta_name="four")
    model.load_delta(two_deltas["qwen2", "two"], delta_name="two")
    ids = calibration_ids(n=3, length=5, seed=11)  # 15 rows of activations per layer
    with torch.no_grad():
        model(input_ids=ids, delta_names=["four", "four", "four"])
        assert seen and set(seen) == {15}
        seen.clear()
        model(input_ids=ids, delta_names=["two", None, "four"])
        assert seen and set(seen) == {5}


def test_row_blocks_follow_the_rows_that_share_a_delta(monkeypatch):
    from hf_deltazip.kernels import multi_delta, random_delta_stack

    monkeypatch.setattr(multi_delta, "_sm_count", lambda device: 132)  # an H200's, for the config alone
    stack = random_delta_stack(32, 64, 256, bits=4, group_size=128)
    cuda = torch.device("cuda")
    # 128 rows spread over the stack's 32 deltas would be 4 per delta; a prefill's rows share one
    assert multi_delta.default_config(128, 4096, 4096, stack, cuda).block_m == 16
    assert multi_delta.default_config(128, 4096, 4096, stack, cuda, rows_per_delta=128).block_m == 64
    assert multi_delta.default_config(128, 4096, 4096, stack, cuda, rows_per_delta=20).block_m == 32


def test_prefill_sized_batches_do_not_split_k(monkeypatch):
    """Row blocks that fill the GPU on their own (many rows per delta) run with K unsplit; decode-sized batches
    (rows per delta <= 16) and a few large row blocks keep the split that gives about four programs per SM."""
    from hf_deltazip.kernels import multi_delta, random_delta_stack

    monkeypatch.setattr(multi_delta, "_sm_count", lambda device: 132)
    multi_delta._DEFAULT_CONFIGS.clear()
    stack = random_delta_stack(16, 64, 256, bits=2, group_size=128)
    cuda = torch.device("cuda")
    for m in (512, 2048):  # 32 and 128 rows per delta: 16-32 row blocks x 64 output tiles >= 4 x 132 programs
        assert multi_delta.default_config(m, 4096, 4096, stack, cuda).split_k == 1
    assert multi_delta.default_config(16, 4096, 4096, stack, cuda).split_k > 1  # decode: one row per delta
    assert multi_delta.default_config(32, 4096, 4096, stack, cuda, rows_per_delta=32).split_k > 1  # 2 row blocks
    multi_delta._DEFAULT_CONFIGS.clear()


def test_decode_steps_of_two_row_blocks_split_k_half_as_much(monkeypatch):
    """A decode step of 17-32 rows (one or a few per delta) runs two 16-row blocks; they share the programs per
    SM that one block of 16 rows gets from the K split, so K is split half as much. One block, and three or
    more, keep the split of one."""
    from hf_deltazip.kernels import layout, multi_delta, random_delta_stack

    monkeypatch.setattr(multi_delta, "_sm_count", lambda device: 132)
    multi_delta._DEFAULT_CONFIGS.clear()
    cuda = torch.device("cuda")
    for bits in (2, 4):
        stack = layout.prepare_stack(random_delta_stack(32, 64, 256, bits=bits, group_size=128))
        for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
            one = multi_delta.default_config(16, n, k, stack, cuda)
            waves = 6.0 if bits == 4 and n >= 8192 else 4.0
            assert one.split_k == multi_delta.auto_split_k(n, k, one.block_n, cuda, waves=waves)
            for m in (17, 24, 32):
                cfg = multi_delta.default_config(m, n, k, stack, cuda)
                assert cfg.block_m == 16
                assert cfg.split_k == multi_delta.auto_split_k(n, k, cfg.block_n, cuda, waves=waves / 2)
                assert cfg.split_k < one.split_k
            assert multi_delta.default_config(48, n, k, stack, cuda).split_k == one.split_k
    multi_delta._DEFAULT_CONFIGS.clear()


def test_prefill_row_blocks_take_the_prefill_tiles(monkeypatch):
    """Planar stacks with row blocks of 32-64 (prefills) get the tiles the prefill sweep measured fastest;
    decode-sized row blocks keep the decode tuning."""
    from hf_deltazip.kernels import layout, multi_delta, random_delta_stack

    monkeypatch.setattr(multi_delta, "_sm_count", lambda device: 132)
    multi_delta._DEFAULT_CONFIGS.clear()
    cuda = torch.device("cuda")
    two = layout.prepare_stack(random_delta_stack(4, 64, 256, bits=2, group_size=128))
    four = layout.prepare_stack(random_delta_stack(4, 64, 256, bits=4, group_size=128))
    assert two.layout_block and four.layout_block  # planar, as the model's stacks are
    cfg = multi_delta.default_config(512, 4096, 4096, two, cuda)  # 128 rows per delta: 64-row blocks
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.split_k) == (64, 128, 8, 1)  # 8 x 32 programs: a wave
    cfg = multi_delta.default_config(128, 4096, 4096, two, cuda, rows_per_delta=32)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.split_k) == (32, 64, 4, 1)
    cfg = multi_delta.default_config(512, 14336, 4096, four, cuda)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.split_k) == (64, 64, 4, 1)
    one = multi_delta.default_config(128, 4096, 4096, two, cuda, rows_per_delta=128)  # one prompt: 2 x 32 programs
    assert one.block_n == 128 and one.split_k > 1
    for stack in (two, four):  # decode: one row per delta, the decode tuning
        dec = multi_delta.default_config(16, 14336, 4096, stack, cuda)
        assert dec.block_m == 16 and dec.block_n == 64 and dec.num_warps == 4 and dec.split_k > 1
    multi_delta._DEFAULT_CONFIGS.clear()
