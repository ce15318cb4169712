"""Deltas over a base dispatched by accelerate (``device_map`` with CPU and disk offload), on the CPU.

An offloaded layer's weight exists only while its accelerate hook runs, so each delta layer lets the
base compute itself and adds its delta; the outputs must equal the same deltas over the base loaded
whole, row for row in a mixed batch.
"""

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.modeling.quantized import execution_device
from hf_deltazip.serving import DecodeEngine

from model_factory import base_model, calibration_ids, finetune

ROWS = ["a", None, "b", "a"]
OFFLOAD = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
           "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dmap")
    base_model("llama").save_pretrained(root / "base")
    for i, name in enumerate(("a", "b")):
        cfg = DeltaZipConfig(n_samples=8, seq_len=24, bits=4, group_size=32)
        compress(base_model("llama"), finetune("llama", i + 1), cfg, calibration=calibration_ids(),
                 progress=False).save_pretrained(root / name)
    return root


def load(folders, tmp_path, **kw):
    model = DeltaModel.from_pretrained(folders / "a", base=folders / "base", delta_name="a", dtype=torch.float32, **kw)
    model.load_delta(folders / "b", delta_name="b")
    return model


def ids():
    return torch.randint(3, 90, (len(ROWS), 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("device_map", ["offload", "auto"])
def test_mixed_batch_over_an_offloaded_base_equals_the_whole_base(folders, tmp_path, device_map):
    dm = OFFLOAD if device_map == "offload" else "auto"
    model = load(folders, tmp_path, device_map=dm, offload_folder=str(tmp_path / "offload"))
    whole = load(folders, tmp_path)
    if device_map == "offload":
        down = model.base_model.model.layers[1].mlp.down_proj
        assert down.base_layer.weight.device.type == "meta"  # really offloaded to disk
        assert execution_device(down.base_layer).type == "cpu"
        assert down.packed[0].qweight.device.type == "cpu"  # the delta lives where its layer computes
    x = ids()
    xm = x.to(model.base_model.device)  # "auto" puts the whole tiny model on a GPU when there is one
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=xm, delta_names=ROWS).logits.cpu(),
                                   whole(input_ids=x, delta_names=ROWS).logits, atol=1e-5, rtol=1e-5)
    kw = dict(delta_names=ROWS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(xm, **kw).cpu(), whole.generate(x, **kw))


def test_decode_engine_refuses_an_offloaded_base_and_says_what_to_use(folders, tmp_path):
    model = load(folders, tmp_path, device_map=OFFLOAD, offload_folder=str(tmp_path / "offload"))
    with pytest.raises(DeltaZipError, match="DeltaModel.generate"):
        DecodeEngine(model, max_batch_size=4, max_length=64)


def test_decode_engine_accepts_a_base_mapped_to_one_device(folders, tmp_path):
    model = load(folders, tmp_path, device_map={"": "cpu"})
    DecodeEngine(model, max_batch_size=4, max_length=64)  # one device: nothing to refuse


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_with_cpu_offload_keeps_deltas_on_the_execution_device_and_matches_the_gpu_model(folders, tmp_path):
    gpu_offload = {**{k: 0 for k in OFFLOAD}, "model.layers.1": "cpu"}
    model = load(folders, tmp_path, device_map=gpu_offload)
    whole = load(folders, tmp_path, device_map={"": 0})
    down = model.base_model.model.layers[1].mlp.down_proj
    assert execution_device(down.base_layer).type == "cuda"
    assert all(t.device.type == "cuda" for t in down.packed[0].tensors().values())
    x = ids().cuda()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x, delta_names=ROWS).logits,
                                   whole(input_ids=x, delta_names=ROWS).logits, atol=1e-4, rtol=1e-4)
    kw = dict(delta_names=ROWS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(x, **kw), whole.generate(x, **kw))
