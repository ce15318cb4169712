import copy
import threading

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.serving import DeltaServer

from model_factory import base_model, calibration_ids, finetune


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    m = DeltaModel(copy.deepcopy(base_model("llama")))
    m.configure_cache(max_resident=2, max_host_bytes=10**8)
    for i in (1, 2, 3):
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(root / f"d{i}")
        m.load_delta(root / f"d{i}", delta_name=f"d{i}", resident=False)
    return m


def alone(model, ids, name, n=5):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         delta_names=[name], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("continuous", [True, False])
def test_requests_from_many_threads_match_one_at_a_time(model, continuous):
    prompts = [calibration_ids(n=1, length=3 + i % 4, seed=i)[0].tolist() for i in range(9)]
    names = ["d1", "d2", None, "d3", "d1", "d2", "d3", None, "d1"]
    want = [alone(model, p, n) for p, n in zip(prompts, names)]
    results = [None] * len(prompts)
    with DeltaServer(model, max_batch_size=2, max_wait_s=0.01, continuous=continuous, max_length=32) as server:
        def client(i):
            results[i] = server.submit(prompts[i], names[i], max_new_tokens=5, do_sample=False).result(timeout=120)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = list(server.stats)
    assert results == want
    assert len(stats) == 9 and max(s.batch_size for s in stats) == 2
    assert all(s.total >= s.queued >= 0 for s in stats)
    split = server.engine_stats
    if not continuous:
        assert split is None
    else:  # 9 requests admitted; a budget of 2 resident deltas over 3 named: some had to be loaded
        assert split.prefill_rows == 9 and split.decode_steps > 0 and split.prefill_s > 0 and split.decode_s > 0
        assert split.loads >= 1 and split.load_s > 0
        assert 0 < split.mean_distinct_deltas <= 2


def test_settings_split_batches_and_errors_reach_the_caller(model):
    with DeltaServer(model, max_batch_size=8) as server:
        a = server.submit([5, 6, 7], "d1", max_new_tokens=2)
        b = server.submit([5, 6, 7], "d1", max_new_tokens=4)
        assert len(a.result(timeout=60)) == 2 and len(b.result(timeout=60)) == 4
        with pytest.raises(DeltaZipError, match="no delta named 'nope'"):
            server.submit([1, 2], "nope")
        with pytest.raises(DeltaZipError, match="need a tokenizer"):
            server.submit("text", "d1")
        vocab = model.base_model.config.vocab_size
        for ids in ([1, vocab], [-2, 3]):  # refused at submit, not at admission, where it would fail its batch
            with pytest.raises(DeltaZipError, match=f"prompt token id {ids[0] if ids[0] < 0 else vocab} is outside"):
                server.submit(ids, "d1", max_new_tokens=2)
        bad = server.submit([1, 2, 3], "d1", max_new_tokens=2, num_beams=0)
        served = bad.exception(timeout=60)  # the very error generate() raises for these settings
        assert isinstance(served, Exception)
        with pytest.raises(type(served)) as direct:
            model.generate(torch.tensor([[1, 2, 3]]), delta_names=["d1"], max_new_tokens=2, num_beams=0, pad_token_id=0)
        assert str(direct.value) == str(served)
        assert server.generate([[1, 2, 3]], ["d2"], max_new_tokens=3) == [alone(model, [1, 2, 3], "d2", 3)]
    with pytest.raises(DeltaZipError, match="closed"):
        server.submit([1], None)


def test_a_short_request_joins_and_leaves_while_a_long_one_decodes(model):
    long_ids, short_ids = [3, 4, 5, 6], [7, 8]
    with DeltaServer(model, max_batch_size=4, max_length=64) as server:
        long = server.submit(long_ids, "d1", max_new_tokens=40)
        while not server.engine.active:  # the long request is decoding
            pass
        short = server.submit(short_ids, "d2", max_new_tokens=3)
        assert short.result(timeout=120) == alone(model, short_ids, "d2", 3)
        assert not long.done(), "the short request waited for the long one: admission is not continuous"
        assert long.result(timeout=120) == alone(model, long_ids, "d1", 40)
        stats = list(server.stats)
    assert [s.new_tokens for s in stats] == [3, 40]
    assert all(0 <= s.queued <= s.first_token <= s.total for s in stats)
    with pytest.raises(DeltaZipError, match="max_length"):
        with DeltaServer(model, max_length=8) as small:
            small.submit([1, 2, 3], "d1", max_new_tokens=6)


def test_models_the_engine_cannot_run_are_served_per_batch(model, monkeypatch):
    want = alone(model, [3, 4, 5], "d1", 3)
    config = model.base_model.config  # windowed layers: the engine refuses them
    monkeypatch.setattr(config, "layer_types", ["sliding_attention"] * config.num_hidden_layers, raising=False)
    monkeypatch.setattr(config, "sliding_window", 4096, raising=False)
    with pytest.warns(UserWarning, match="per batch"):
        server = DeltaServer(model, max_batch_size=2)
    with server:
        assert server.engine is None
        assert server.submit([3, 4, 5], "d1", max_new_tokens=3).result(timeout=120) == want
