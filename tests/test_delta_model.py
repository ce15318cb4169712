import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from hf_deltazip import (
    BaseMismatchError,
    DeltaModel,
    DeltaNotFoundError,
    DeltaZipConfig,
    DeltaZipError,
    compress,
)
from hf_deltazip.modeling.layers import DeltaLinear

from model_factory import ARCHS, VOCAB, base_model, calibration_ids, finetune

SETTINGS = {
    "a": dict(bits=4, group_size=32),
    "b": dict(bits=2, sparsity="2:4", group_size=-1, symmetric=False),
    "c": dict(bits=3, sparsity=0.5, group_size=32),
}


@pytest.fixture(scope="module")
def saved_deltas(tmp_path_factory):
    """Three deltas (4-bit; 2-bit 2:4; 3-bit 50 % unstructured) per architecture, saved to disk."""
    root = tmp_path_factory.mktemp("deltas")
    out = {}
    for arch in ARCHS:
        for i, (name, settings) in enumerate(SETTINGS.items()):
            folder = root / f"{arch}-{name}"
            cfg = DeltaZipConfig(n_samples=8, seq_len=24, **settings)
            compress(base_model(arch), finetune(arch, i + 1), cfg, calibration=calibration_ids(), progress=False).save_pretrained(folder)
            out[arch, name] = folder
    return out


def load(arch, saved, names=("a", "b", "c")):
    model = DeltaModel(copy.deepcopy(base_model(arch)))
    for name in names:
        model.load_delta(saved[arch, name], delta_name=name)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_rows_equal_their_merged_fine_tunes_exactly(arch, saved_deltas):
    model = load(arch, saved_deltas)
    ids = calibration_ids(n=5, length=12, seed=7)
    rows = ["a", None, "b", "c", "a"]
    with torch.no_grad():
        mixed = model(input_ids=ids, delta_names=rows).logits
        for i, name in enumerate(rows):
            reference = base_model(arch) if name is None else model.merge_and_unload(name)
            alone = reference(input_ids=ids[i : i + 1]).logits[0]
            assert torch.equal(mixed[i], alone), (arch, i, name, (mixed[i] - alone).abs().max())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_with_left_padding_matches_each_merged_model(arch, saved_deltas):
    model = load(arch, saved_deltas)
    prompts = [calibration_ids(n=1, length=n, seed=s)[0] for n, s in ((9, 1), (5, 2), (7, 3))]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    rows = ["b", None, "a"]
    out = model.generate(ids, attention_mask=mask, delta_names=rows, max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    for i, name in enumerate(rows):
        ref_model = base_model(arch) if name is None else model.merge_and_unload(name)
        ref = ref_model.generate(ids[i : i + 1], attention_mask=mask[i : i + 1], max_new_tokens=6,
                                 do_sample=False, pad_token_id=0)
        assert torch.equal(out[i], ref[0]), (arch, name, out[i], ref[0])
    no_cache = model.generate(ids, attention_mask=mask, delta_names=rows, max_new_tokens=6, do_sample=False,
                              pad_token_id=0, use_cache=False)
    assert torch.equal(no_cache, out)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.chunks.append(None)


def test_default_delta_sampling_and_streamer(saved_deltas):
    model = load("qwen2", saved_deltas)
    merged = model.merge_and_unload("c")
    ids = calibration_ids(n=1, length=6, seed=4)
    model.set_delta("c")
    assert model.active_delta == "c"
    torch.manual_seed(0)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=20, max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(0)
    want = merged.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=20, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(got, want)
    streamer = Collect()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, streamer=streamer, pad_token_id=0,
                         delta_names=["a"])
    streamed = torch.cat([c.reshape(-1) for c in streamer.chunks[1:-1]])
    assert streamer.chunks[-1] is None and torch.equal(streamed, out[0, ids.shape[1]:])
    model.set_delta(None)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base_model("qwen2")(input_ids=ids).logits)


def test_added_tokens_and_tied_embeddings(tmp_path):
    for arch in ("llama", "gpt2"):
        ft = finetune(arch, 5, added_tokens=4)
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        compress(base_model(arch), ft, cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(tmp_path / arch)
        model = DeltaModel.from_pretrained(tmp_path / arch, base=copy.deepcopy(base_model(arch)), delta_name="big")
        ids = torch.tensor([[3, VOCAB + 2, 7, VOCAB + 3], [3, 5, 7, 9]])
        with torch.no_grad():
            mixed = model(input_ids=ids, delta_names=["big", None]).logits
            merged = model.merge_and_unload("big")
            assert merged.config.vocab_size == VOCAB + 4
            alone = merged(input_ids=ids[:1]).logits[0]
            base_alone = base_model(arch)(input_ids=ids[1:]).logits[0]
        assert torch.equal(mixed[0], alone)
        assert torch.equal(mixed[1, :, :VOCAB], base_alone)
        assert bool(torch.isinf(mixed[1, :, VOCAB:]).all())  # the base cannot produce the new tokens
        with pytest.raises(DeltaZipError, match=f"token id {VOCAB + 4} is outside this fine-tune's vocabulary of {VOCAB + 4}"):
            model(input_ids=torch.tensor([[3, VOCAB + 4]]), delta_names=["big"])


def test_the_engine_checks_a_prompt_against_its_fine_tunes_vocabulary_from_the_host(tmp_path):
    """The engine checks each prompt's ids on the host against the vocabulary it is answered with (the fine-tune's,
    with its added tokens, or the base's): a bad id fails the admission before any device work (on a GPU it would
    stop the device), its rows stay free and the requests already running go on. It also hands each row's largest
    id to the embedding, whose own check then reads nothing back from the device."""
    from hf_deltazip.modeling.routing import BatchRouting
    from hf_deltazip.serving import DecodeEngine

    routing = BatchRouting.per_row([0, -1], max_ids=[9, 4])
    assert routing.max_id_of([0, 1], 2) == 9 and routing.max_id_of([1], 2) == 4
    assert routing.max_id_of([2, 3], 4) == 4  # rows repeated (beams): row r is request r // 2
    assert BatchRouting.per_row([0, 1]).max_id_of([0], 2) is None  # unknown: the module reads them back
    with pytest.raises(DeltaZipError, match="2 rows but 1 max_ids"):
        BatchRouting.per_row([0, 1], max_ids=[3])
    ft = finetune("llama", 5, added_tokens=4)
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    compress(base_model("llama"), ft, cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(tmp_path)
    model = DeltaModel.from_pretrained(tmp_path, base=copy.deepcopy(base_model("llama")), delta_name="big")
    engine = DecodeEngine(model, max_batch_size=3, max_length=16)
    ok = engine.add([[3, VOCAB + 2, 7, VOCAB + 3]], ["big"], max_new_tokens=4, eos_token_id=None)
    assert engine.vocab_size("big") == VOCAB + 4 and engine.vocab_size() == VOCAB
    for prompt, name, bad in (([3, VOCAB + 4], "big", VOCAB + 4), ([3, VOCAB + 1], None, VOCAB + 1), ([5, -1], "big", -1)):
        with pytest.raises(DeltaZipError, match=rf"prompt token id {bad} is outside the vocabulary of "
                           + ("the base model" if name is None else "delta 'big'")):
            engine.add([[5, 6], prompt], [None, name], max_new_tokens=4)
    assert engine.free == 2
    # past the engine's check (as a plain forward would be), the embedding checks from the host's ids: no read-back
    routing = BatchRouting.per_row([model.cache.slot_of("big")], max_ids=[VOCAB + 4])
    with model.router.use(routing), pytest.raises(DeltaZipError, match=f"token id {VOCAB + 4} is outside this fine-tune's"):
        model.base_model(input_ids=torch.tensor([[3, 4]]))
    done = {}
    while engine.active:
        done.update((f.handle, f.tokens) for f in engine.step())
    merged = model.merge_and_unload("big")
    want = merged.generate(torch.tensor([[3, VOCAB + 2, 7, VOCAB + 3]]), max_new_tokens=4, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, 4:].tolist()
    assert done[ok[0]] == want


def test_merge_and_unload_saves_a_plain_checkpoint(saved_deltas, tmp_path):
    model = load("llama", saved_deltas, names=("a",))
    merged = model.merge_and_unload("a")
    assert not any(isinstance(m, DeltaLinear) for m in merged.modules())
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = calibration_ids(n=2, length=8, seed=3)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids, delta_names=["a", "a"]).logits)
    # the base and the delta are still usable after a copy-merge
    assert model.deltas == ["a"]
    inplace = model.merge_and_unload("a", inplace=True)
    assert model.deltas == [] and not any(isinstance(m, DeltaLinear) for m in inplace.modules())


def test_managing_deltas(saved_deltas):
    model = load("phi3", saved_deltas)
    assert model.deltas == ["a", "b", "c"]
    ids = calibration_ids(n=2, length=8, seed=5)
    with torch.no_grad():
        before = model(input_ids=ids, delta_names=["c", "a"]).logits
        with pytest.raises(DeltaNotFoundError, match="no delta named 'zz' is loaded"):
            model(input_ids=ids, delta_names=["zz", None])
        with pytest.raises(DeltaZipError, match="one name per row"):
            model(input_ids=ids, delta_names=["a"] * 3)
        model.delete_delta("b")
        assert model.deltas == ["a", "c"]
        assert torch.equal(model(input_ids=ids, delta_names=["c", "a"]).logits, before)
        with pytest.raises(DeltaNotFoundError):
            model(input_ids=ids, delta_names=["b", None])
        with pytest.raises(DeltaZipError, match="already loaded"):
            model.load_delta(saved_deltas["phi3", "a"], delta_name="a")
        model.load_delta(saved_deltas["phi3", "b"], delta_name="b2")
        merged_b = model.merge_and_unload("b2")
        assert torch.equal(model(input_ids=ids, delta_names=["b2", "b2"]).logits, merged_b(input_ids=ids).logits)


def test_memory_footprint_counts_packed_bytes(saved_deltas):
    model = load("llama", saved_deltas)
    mem = model.memory_footprint()
    fp16 = 2 * sum(p.numel() for p in base_model("llama").parameters())
    assert set(mem["deltas"]) == {"a", "b", "c"}
    for name, nbytes in mem["deltas"].items():
        assert 0 < nbytes < fp16 / 2, (name, nbytes)
    assert mem["deltas"]["b"] < mem["deltas"]["a"]  # 2-bit 2:4 is smaller than 4-bit
    assert mem["total"] == mem["base"] + sum(mem["deltas"].values())


def test_wrong_base_is_caught(saved_deltas, tmp_path):
    # a delta compressed from a base in memory records no base name: the errors name the fix without one
    with pytest.raises(BaseMismatchError, match="differ from those the delta was made against.*; load the delta onto "
                                                "the base it was compressed from"):
        DeltaModel.from_pretrained(saved_deltas["llama", "a"], base=base_model("llama", seed=1))
    with pytest.raises(BaseMismatchError, match="differ"):  # the fine-tune itself is not the base
        DeltaModel.from_pretrained(saved_deltas["llama", "a"], base=copy.deepcopy(finetune("llama", 1)))
    with pytest.raises(BaseMismatchError, match="for a 'llama' model but the base is 'qwen2'; load the delta onto the "
                                                "'llama' base it was compressed from") as err:
        DeltaModel.from_pretrained(saved_deltas["llama", "a"], base=base_model("qwen2"))
    assert "?" not in str(err.value) and "None" not in str(err.value)
    # a base in another dtype is still the same base
    half = copy.deepcopy(base_model("llama")).to(torch.bfloat16)
    model = DeltaModel.from_pretrained(saved_deltas["llama", "a"], base=half)
    assert model.deltas == ["default"]


def test_base_loaded_from_the_recorded_id(saved_deltas, tmp_path):
    base_dir = tmp_path / "base"
    base_model("gpt2").save_pretrained(base_dir)
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    compress(str(base_dir), finetune("gpt2", 1), cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(tmp_path / "d")
    model = DeltaModel.from_pretrained(tmp_path / "d")  # base=None: the recorded base path
    assert model.deltas == ["default"]
    with pytest.raises(DeltaZipError, match="no such delta folder"):
        DeltaModel.from_pretrained(tmp_path / "nope", base=base_model("gpt2"))
