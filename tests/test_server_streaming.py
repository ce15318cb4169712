"""DeltaServer hands out tokens as they are decoded, frees the row of a cancelled request and bounds its queue."""

import copy
import time

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, compress
from hf_deltazip.serving import DeltaServer, QueueFullError

from model_factory import base_model, calibration_ids, finetune


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    m = DeltaModel(copy.deepcopy(base_model("llama")))
    for i in (1, 2):
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16),
                 progress=False).save_pretrained(root / f"d{i}")
        m.load_delta(root / f"d{i}", delta_name=f"d{i}", resident=False)
    return m


def alone(model, ids, name, n):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         delta_names=[name], max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("continuous", [True, False])
def test_streamed_tokens_arrive_in_steps_and_add_up_to_the_answer(model, continuous):
    want = alone(model, [4, 5, 6], "d1", 12)
    calls = []
    with DeltaServer(model, max_batch_size=4, max_length=64, continuous=continuous) as server:
        stream = server.stream([4, 5, 6], "d1", max_new_tokens=12, eos_token_id=None)
        got = list(stream)
        future = server.submit([4, 5, 6], "d1", max_new_tokens=12, eos_token_id=None,
                               on_token=lambda ids, reason: calls.append((list(ids), reason)))
        assert future.result(timeout=60) == want
    assert got == want and stream.finish_reason == "length" and stream.future.result() == want
    assert [t for ids, _ in calls for t in ids] == want and calls[-1][1] == "length"
    assert all(reason is None for _, reason in calls[:-1])
    if continuous:  # one call per decode step (the first token comes out of the prefill)
        assert len([c for c in calls if c[0]]) == 12


def test_one_token_requests_finish_without_other_traffic(model):
    with DeltaServer(model, max_batch_size=2, max_length=32) as server:
        assert server.submit([1, 2, 3], "d2", max_new_tokens=1, eos_token_id=None).result(timeout=60) == \
            alone(model, [1, 2, 3], "d2", 1)


def test_cancelling_frees_the_row_and_a_full_queue_refuses(model):
    with DeltaServer(model, max_batch_size=1, max_length=4096, max_queue=1) as server:
        long = server.stream([3, 4, 5], "d1", max_new_tokens=4000, eos_token_id=None)
        first = next(iter(long))
        waiting = server.submit([6, 7], "d2", max_new_tokens=3, eos_token_id=None)  # no free row: it queues
        wait_until(lambda: server.waiting == 1)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            server.submit([8, 9], None, max_new_tokens=2)
        long.cancel()
        assert waiting.result(timeout=60) == alone(model, [6, 7], "d2", 3)
        rest = list(long)  # what was decoded before the cancel took effect, then the end
        stats = list(server.stats)
    assert long.finish_reason == "cancelled" and long.future.cancelled()
    cancelled = [s for s in stats if s.finish_reason == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].new_tokens == 1 + len(rest) < 4000
    assert first == alone(model, [3, 4, 5], "d1", 1)[0]
    assert model.cache.held == {}, "a cancelled request still holds its delta"


def test_a_callback_that_raises_cancels_only_its_request(model):
    with DeltaServer(model, max_batch_size=2, max_length=64) as server:
        def broken(ids, reason):
            raise RuntimeError("client bug")

        with pytest.warns(UserWarning, match="on_token raised"):
            bad = server.submit([1, 2], "d1", max_new_tokens=30, eos_token_id=None, on_token=broken)
            good = server.submit([1, 2], "d2", max_new_tokens=5, eos_token_id=None)
            assert good.result(timeout=60) == alone(model, [1, 2], "d2", 5)
            wait_until(lambda: server.running == 0)
    assert bad.cancelled()
