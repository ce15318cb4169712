"""Jacobi decoding gives exactly the greedy output, on plain transformers models and on DeltaModel rows."""

import copy
import functools

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.decoding import JacobiGate, jacobi_generate

from model_factory import matrix_finetune, matrix_model

def repeat_ids(n, length, seed):
    """Rows of one random token (3..127) repeated."""
    token = torch.randint(3, 128, (n, 1), generator=torch.Generator().manual_seed(seed))
    return token.expand(n, length).clone()


@functools.lru_cache(maxsize=None)
def repeat_model():
    """A tiny llama trained to repeat the last token: its Jacobi guesses (the last token repeated) are
    right at once, so it accepts whole blocks. (On an ordinary model Jacobi gains about one token per step.)"""
    model = copy.deepcopy(matrix_model("llama"))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(40):
        ids = torch.cat([torch.randint(3, 128, (16, 4), generator=torch.Generator().manual_seed(step)),
                         repeat_ids(16, 16, seed=1000 + step)], dim=1)
        labels = ids.clone()
        labels[:, :4] = -100
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def padded_prompts(lengths, seed=0, vocab=128):
    """Left-padded random prompts of the given lengths (pad id 0) and their mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[r, width - n:] = 1
    return ids, mask


def greedy(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("arch, block_size", [("llama", 4), ("llama", 16), ("gemma3_text", 4), ("gemma3_text", 16),
                                              ("mistral", 16), ("qwen2", 16), ("gpt2", 4)])
def test_equals_greedy_token_for_token_on_padded_batches(arch, block_size):
    # gemma3_text and mistral have a sliding window of 8: 28 new tokens run well past it
    model = matrix_finetune(arch, 1)
    ids, mask = padded_prompts([9, 3, 6], seed=block_size)
    ref = greedy(model, ids, mask, max_new_tokens=28)
    for min_accept in (None, 1.5):
        out = jacobi_generate(model, ids, mask, block_size=block_size, max_new_tokens=28,
                              pad_token_id=0, min_accept=min_accept)
        assert torch.equal(out, ref), (arch, min_accept, out[:, 9:], ref[:, 9:])


def test_single_prompt_without_mask_and_defaults_from_generation_config():
    model = matrix_finetune("qwen2", 2)
    ids, _ = padded_prompts([5], seed=3)
    ref = greedy(model, ids, torch.ones_like(ids), max_new_tokens=12)  # eos from the model's config (2)
    assert torch.equal(jacobi_generate(model, ids, max_new_tokens=12), ref)


def test_a_model_that_repeats_accepts_whole_blocks_and_a_row_ending_early_is_padded():
    model = repeat_model()
    ids = torch.cat([padded_prompts([3, 3], seed=5)[0], repeat_ids(2, 3, seed=9)], dim=1)
    ref = greedy(model, ids, None, max_new_tokens=40)
    out = jacobi_generate(model, ids, block_size=8, max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.tokens_per_forward > 5, out.stats
    # row 1's token is now end-of-sequence: it stops at once, row 0 goes on, row 1 is padded
    eos = int(ref[1, 6])
    ref_eos = greedy(model, ids, None, max_new_tokens=40, eos_token_id=eos)
    out_eos = jacobi_generate(model, ids, block_size=8, max_new_tokens=40, eos_token_id=eos, pad_token_id=0,
                              return_dict_in_generate=True)
    assert torch.equal(out_eos.sequences, ref_eos)
    assert out_eos.stats.new_tokens == [40, 1] and (out_eos.sequences[1, 7:] == 0).all()


def test_max_new_tokens_is_exact_when_a_block_overshoots():
    model = repeat_model()
    ids = repeat_ids(1, 5, seed=4)
    for n in (1, 2, 7, 11):
        out = jacobi_generate(model, ids, block_size=16, max_new_tokens=n)
        assert torch.equal(out, greedy(model, ids, None, max_new_tokens=n))


def test_falls_back_to_greedy_steps_when_guesses_keep_failing():
    model = matrix_finetune("llama", 1)  # a random model: guesses are almost never right
    ids, mask = padded_prompts([6], seed=1)
    eager = jacobi_generate(model, ids, mask, max_new_tokens=60, min_accept=None,
                            return_dict_in_generate=True)
    backed_off = jacobi_generate(model, ids, mask, max_new_tokens=60,
                                 return_dict_in_generate=True)
    assert torch.equal(eager.sequences, backed_off.sequences)
    assert eager.stats.jacobi_forwards == eager.stats.forwards
    assert eager.stats.tokens_per_forward < 1.5
    # probes of 2 wide steps, then 4, 8, 16, ... greedy steps
    assert backed_off.stats.jacobi_forwards <= 10 < backed_off.stats.forwards
    # the stats say what the gate saw: one entry per step, None for the one-token steps
    accepts = backed_off.stats.step_accepts
    assert len(accepts) == backed_off.stats.forwards
    assert sum(a is not None for a in accepts) == backed_off.stats.jacobi_forwards
    assert accepts[:2] == eager.stats.step_accepts[:2] and all(a >= 1.0 for a in accepts if a is not None)


def test_a_gate_carried_across_calls_starts_the_next_call_where_the_last_one_left_off():
    model = matrix_finetune("llama", 1)  # guesses almost never right: the gate backs off
    ids, mask = padded_prompts([6], seed=2)
    want = greedy(model, ids, mask, max_new_tokens=30)
    gate = JacobiGate()
    first = jacobi_generate(model, ids, mask, max_new_tokens=30, gate=gate, return_dict_in_generate=True)
    second = jacobi_generate(model, ids, mask, max_new_tokens=30, gate=gate, return_dict_in_generate=True)
    fresh = jacobi_generate(model, ids, mask, max_new_tokens=30, return_dict_in_generate=True)
    for out in (first, second, fresh):
        assert torch.equal(out.sequences, want)
    assert first.stats.jacobi_forwards == fresh.stats.jacobi_forwards >= 3  # a fresh gate probes from scratch
    assert second.stats.jacobi_forwards <= 1  # the carried gate starts in its back-off: one probe at most
    with pytest.raises(DeltaZipError, match="JacobiGate"):
        jacobi_generate(model, ids, mask, max_new_tokens=4, gate=1.5)


def test_trajectories_record_the_blocks_fed():
    model = repeat_model()
    ids = repeat_ids(1, 4, seed=5)
    out = jacobi_generate(model, ids, block_size=6, max_new_tokens=20, min_accept=None,
                          return_dict_in_generate=True, record_trajectories=True)
    generated = out.sequences[0, 4:].tolist()
    assert len(out.stats.trajectories) == out.stats.jacobi_forwards
    for row, start, block in out.stats.trajectories:
        assert row == 0 and len(block) == 6 and block[0] == generated[start]


@pytest.fixture(scope="module")
def two_deltas():
    """A base llama with two compressed fine-tunes on it: the repeating model and a random nudge."""
    base = matrix_model("llama")
    cfg = DeltaZipConfig(bits=8, group_size=32, n_samples=8, seq_len=24)
    calib = repeat_ids(8, 24, seed=7)
    model = DeltaModel(copy.deepcopy(base))
    model.add_delta(compress(base, repeat_model(), cfg, calibration=calib, progress=False), "repeat")
    model.add_delta(compress(base, matrix_finetune("llama", 3), cfg, calibration=calib, progress=False), "other")
    return model


def test_delta_model_rows_with_their_own_deltas_advance_by_different_amounts(two_deltas):
    model = two_deltas
    ids = repeat_ids(3, 7, seed=11)
    ids[1, :3] = 0  # left padding on the middle row
    mask = (ids != 0).long()
    rows = ["repeat", "other", None]
    ref = model.generate(ids, attention_mask=mask, delta_names=rows, do_sample=False, max_new_tokens=24,
                         pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, delta_names=rows, decoding="jacobi", jacobi_block_size=8,
                         max_new_tokens=24, pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    # the same rows alone: the repeating row converges much faster than the others
    alone = [model.generate(ids[r:r + 1], attention_mask=mask[r:r + 1], delta_names=[rows[r]], decoding="jacobi",
                            jacobi_block_size=8, max_new_tokens=24, pad_token_id=0,
                            min_accept=None, return_dict_in_generate=True).stats for r in range(3)]
    assert alone[0].tokens_per_forward > 2 * max(alone[1].tokens_per_forward, alone[2].tokens_per_forward)


def test_delta_model_remembers_each_deltas_jacobi_acceptance_between_calls(two_deltas):
    model = two_deltas
    ids = repeat_ids(1, 7, seed=13)
    kw = dict(decoding="jacobi", jacobi_block_size=8, max_new_tokens=24, pad_token_id=0, return_dict_in_generate=True)
    model._jacobi_gates.clear()
    runs = {name: [model.generate(ids, delta_names=[name], **kw) for _ in range(2)] for name in ("other", "repeat")}
    for name, (a, b) in runs.items():
        ref = model.generate(ids, delta_names=[name], do_sample=False, max_new_tokens=24, pad_token_id=0)
        assert torch.equal(a.sequences, ref) and torch.equal(b.sequences, ref)
    # the delta Jacobi steps do not speed up: its second call starts in the back-off its first call reached
    assert runs["other"][1].stats.jacobi_forwards < runs["other"][0].stats.jacobi_forwards
    # the converging delta keeps its own gate: every step of its second call is wide
    assert runs["repeat"][1].stats.jacobi_forwards == runs["repeat"][1].stats.forwards
    assert len(model._jacobi_gates) == 2
    # an explicit fresh gate forgets; unloading a delta forgets every gate
    fresh = model.generate(ids, delta_names=["other"], gate=JacobiGate(), **kw)
    assert fresh.stats.jacobi_forwards == runs["other"][0].stats.jacobi_forwards
    model.delete_delta("other")
    try:
        assert model._jacobi_gates == {}
    finally:
        model.add_delta(compress(matrix_model("llama"), matrix_finetune("llama", 3),
                                 DeltaZipConfig(bits=8, group_size=32, n_samples=8, seq_len=24),
                                 calibration=repeat_ids(8, 24, seed=7), progress=False), "other")


def test_delta_model_active_delta_and_bad_decoding_name(two_deltas):
    model = two_deltas
    ids = repeat_ids(1, 5, seed=2)
    model.set_delta("repeat")
    try:
        ref = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
        assert torch.equal(model.generate(ids, decoding="jacobi", max_new_tokens=10,
                                          pad_token_id=0), ref)
        with pytest.raises(DeltaZipError, match="decoding must be"):
            model.generate(ids, decoding="lookahead")
    finally:
        model.set_delta(None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(do_sample=True), "do_sample"),
    (dict(num_beams=2), "num_beams"),
    (dict(block_size=0), "jacobi_block_size"),
    (dict(past_key_values=object()), "past_key_values"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_unsupported_options_are_refused_with_the_reason(kwargs, message):
    model = matrix_model("llama")
    ids, mask = padded_prompts([4, 4])
    with pytest.raises(DeltaZipError, match=message):
        jacobi_generate(model, ids, mask, **kwargs)


def test_right_padding_is_refused():
    model = matrix_model("llama")
    ids, mask = padded_prompts([4, 2])
    with pytest.raises(DeltaZipError, match="left padding"):
        jacobi_generate(model, ids.flip(1), mask.flip(1), max_new_tokens=4)


# ---------------------------------------------------------------------------- DecodeEngine and DeltaServer
def _alone(model, ids, n, name):
    """Greedy generate() of one prompt with its delta; the engine returns the tokens before end-of-sequence."""
    out = model.generate(torch.tensor([ids]), delta_names=[name], do_sample=False, max_new_tokens=n,
                         pad_token_id=0)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [i for i, t in enumerate(out) if t in eos]
    return out[: stops[0]] if stops else out


def test_engine_jacobi_rows_equal_greedy_beside_ordinary_rows_and_squeeze_their_holes(two_deltas, monkeypatch):
    from hf_deltazip.serving import DecodeEngine

    model = two_deltas
    ps = [repeat_ids(1, 3 + i % 4, seed=20 + i)[0].tolist() for i in range(7)]
    names = ["repeat", "other", "repeat", None, "repeat", "other", "repeat"]
    news = [30, 9, 25, 12, 18, 7, 30]
    want = [_alone(model, p, n, d) for p, n, d in zip(ps, news, names)]
    # a short cache: the holes rejected guesses leave must be squeezed out for the rows to finish
    engine = DecodeEngine(model, max_batch_size=3, max_length=48, jacobi_min_accept=None)
    squeezes = []
    real = engine._squeeze
    monkeypatch.setattr(engine, "_squeeze", lambda: (squeezes.append(engine._ptr), real()))
    got = engine.run(ps, names, max_new_tokens=news, decoding="jacobi", jacobi_block_size=8)
    assert got == want
    assert squeezes, "the cache was never squeezed: the test does not cover it"
    st = engine.stats
    assert st.jacobi_steps > 0 and st.jacobi_tokens_per_step > 2.0, st.as_dict()
    assert st.decode_steps < sum(news)  # fewer steps than one token per step would take
    # one-token requests decode in the same steps as Jacobi rows and still equal greedy
    mixed = DecodeEngine(model, max_batch_size=4, max_length=64)
    handles = mixed.add(ps[:2], names[:2], max_new_tokens=news[:2], decoding="jacobi", jacobi_block_size=8)
    handles += mixed.add(ps[2:4], names[2:4], max_new_tokens=news[2:4])
    done = {}
    while mixed.active:
        done.update({f.handle: f.tokens for f in mixed.step()})
    assert [done[h] for h in handles] == want[:4]


def test_engine_jacobi_falls_back_to_one_token_steps_on_a_model_that_never_converges():
    from hf_deltazip.serving import DecodeEngine

    model = matrix_finetune("llama", 1)  # random: guesses are almost never right
    ps = [padded_prompts([6], seed=s)[0][0].tolist() for s in (1, 2)]
    want = [greedy(model, torch.tensor([p]), None, max_new_tokens=40)[0, len(p):].tolist() for p in ps]
    engine = DecodeEngine(model, max_batch_size=2, max_length=64)
    assert engine.run(ps, max_new_tokens=40, decoding="jacobi", jacobi_block_size=8, eos_token_id=None) == want
    st = engine.stats
    # probes of two Jacobi steps between 4, 8, 16, ... one-token steps
    assert 0 < st.jacobi_steps <= 10 < st.decode_steps, st.as_dict()
    # switched to never falling back, the same requests take Jacobi steps only, with the same output
    engine.jacobi_min_accept = None
    engine.reset_stats()
    assert engine.run(ps, max_new_tokens=40, decoding="jacobi", jacobi_block_size=8, eos_token_id=None) == want
    assert engine.stats.jacobi_steps == engine.stats.decode_steps > 0


def test_engine_gates_jacobi_rows_per_delta_so_a_converging_delta_stays_wide_beside_one_that_falls_back(two_deltas):
    from hf_deltazip.decoding import JacobiGate
    from hf_deltazip.serving import DecodeEngine

    model = two_deltas
    ps = [repeat_ids(1, 5, seed=40 + i)[0].tolist() for i in range(2)]
    names, news = ["repeat", "other"], [64, 64]
    want = [_alone(model, p, n, d) for p, n, d in zip(ps, news, names)]
    engine = DecodeEngine(model, max_batch_size=2, max_length=200)
    assert engine.run(ps, names, max_new_tokens=news, decoding="jacobi", jacobi_block_size=8) == want
    repeat, other = engine.jacobi_gate("repeat"), engine.jacobi_gate("other")
    assert other.backoff > JacobiGate.FIRST_BACKOFF  # "other" failed its probes and backed off ...
    assert repeat.backoff == JacobiGate.FIRST_BACKOFF  # ... while "repeat" never fell back
    st = engine.stats
    # some wide steps widened the "repeat" row only ("other" took one token in them)
    assert 0 < st.jacobi_row_steps < 2 * st.jacobi_steps, st.as_dict()
    assert st.jacobi_tokens_per_step > 2.0, st.as_dict()
    engine.jacobi_min_accept = None  # the setting reaches every delta's gate
    assert repeat.min_accept is None and other.min_accept is None


def test_engine_and_server_refuse_bad_jacobi_requests_and_the_server_decodes_them(two_deltas):
    from hf_deltazip.serving import DecodeEngine, DeltaServer

    model = two_deltas
    engine = DecodeEngine(model, max_batch_size=2, max_length=64)
    ids = repeat_ids(1, 4, seed=3)[0].tolist()
    with pytest.raises(DeltaZipError, match="greedy"):
        engine.add([ids], ["repeat"], decoding="jacobi", do_sample=True)
    with pytest.raises(DeltaZipError, match="decoding must be"):
        engine.add([ids], ["repeat"], decoding="lookahead")
    with pytest.raises(DeltaZipError, match="jacobi_block_size"):
        engine.add([ids], ["repeat"], decoding="jacobi", jacobi_block_size=0)
    assert engine.active == 0
    want = _alone(model, ids, 20, "repeat")
    with DeltaServer(model, max_batch_size=2, max_length=64) as server:
        assert server.engine is not None
        got = server.submit(ids, "repeat", max_new_tokens=20, decoding="jacobi", jacobi_block_size=8).result(timeout=120)
        assert got == want
        assert server.engine_stats.jacobi_steps > 0


def test_bench_classifies_a_difference_by_the_logit_gap_against_rounding():
    """The Jacobi bench's check: an output that differs from greedy at a clear choice (fp32, runner-up token
    put in) is counted as a difference beyond rounding, with greedy's own logit gap recorded."""
    from hf_deltazip.bench.jacobi import _left_pad, _ties

    base, ft = matrix_model("llama"), matrix_finetune("llama", seed=1)
    dm = DeltaModel(copy.deepcopy(base))
    dm.add_delta(compress(base, ft, DeltaZipConfig(bits=4, group_size=32), progress=False), "ft")
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10, 11]], 0, "cpu")
    kw = dict(pad_token_id=0)
    out = dm.generate(ids, attention_mask=mask, delta_names=["ft", "ft"], do_sample=False, max_new_tokens=6,
                      output_logits=True, return_dict_in_generate=True, **kw)
    greedy = out.sequences
    assert _ties(dm, "ft", ids, mask, greedy, greedy.clone(), 6, kw, []) == (0, 0)
    width, step = ids.shape[1], 2
    logits = out.logits[step][1].float()
    runner_up = int(logits.topk(2).indices[1])
    other = greedy.clone()
    other[1, width + step] = runner_up
    details = []
    assert _ties(dm, "ft", ids, mask, greedy, other, 6, kw, details) == (1, 0)
    (d,) = details
    assert d["new_token"] == step and not d["within_rounding"]
    assert d["logit_gap"] == pytest.approx(float(logits.max() - logits[runner_up]))
    assert 0 <= d["rounding"] < d["logit_gap"]


def test_bench_compares_contents_not_the_padded_width_of_a_batch():
    """A row that ended early comes back padded to its batch's width: the same tokens padded to another
    width are equal; a row that stops where the other goes on is a difference of length."""
    from hf_deltazip.bench.jacobi import _ties

    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids)
    kw = dict(pad_token_id=0)
    greedy = torch.tensor([[5, 6, 7, 11, 12, 2, 0, 0]])  # ended at eos (2), padded by its batch
    same = torch.tensor([[5, 6, 7, 11, 12, 2, 0, 0, 0, 0, 0]])  # the same row in a wider batch
    assert _ties(None, "ft", ids, mask, greedy, same, 8, kw, []) == (0, 0)
    longer = torch.tensor([[5, 6, 7, 11, 12, 2, 13, 0]])
    details = []
    assert _ties(None, "ft", ids, mask, greedy, longer, 8, kw, details) == (1, 0)
    assert details == [{"delta": "ft", "new_token": 3, "logit_gap": None, "rounding": None,
                        "within_rounding": False, "kind": "length"}]


def _under_gate(gate, steps, seconds, accepted):
    """Indices of the wide steps among ``steps`` decode steps under ``gate``: a wide one takes ``seconds``
    and accepts ``accepted`` tokens per row, a one-token step takes 1 s."""
    wide = []
    for i in range(steps):
        w = gate.wide()
        gate.record(w, seconds if w else 1.0, accepted if w else None)
        if w:
            wide.append(i)
    return wide


def test_gate_weighs_accepted_tokens_against_what_a_jacobi_step_costs():
    from hf_deltazip.decoding import JacobiGate

    # wide steps as cheap as one-token steps: min_accept decides. Two Jacobi steps, then one-step probes
    # (judged with the step before) after 4, 8, 16, 32, 64, 64 one-token steps
    cheap = JacobiGate(min_accept=1.5)
    assert _under_gate(cheap, 200, 1.0, 1.2) == [0, 1, 6, 15, 32, 65, 130, 195]
    assert _under_gate(cheap, 70, 1.0, 3.0)[-3:] == [67, 68, 69]  # converging: the probe after the wait takes over
    assert cheap.backoff == JacobiGate.FIRST_BACKOFF
    # a wide step costing 3 one-token steps needs 3 tokens per forward, whatever min_accept says, and
    # the probes are spaced so that each one's extra 2 s stay within 2 % of the one-token steps before it
    dear = JacobiGate(min_accept=1.5)
    for seconds in (1.0, 1.0, 40.0):  # one-token steps, one of them with a graph capture in it
        dear.record(False, seconds)
    dear.record(True, 50.0, 1.0)  # the first Jacobi step compiles its kernels
    assert dear.threshold() == 1.5  # costs count from 3 steps of each kind on
    assert _under_gate(dear, 300, 3.0, 2.5) == [0, 1, 6, 107, 208]
    assert dear.threshold() == pytest.approx(3.0)
    assert dear.cost(False) == 1.0  # the median ignores the capture
    # min_accept=None never falls back
    never = JacobiGate(min_accept=None)
    never.record(False, 1.0)
    assert _under_gate(never, 20, 10.0, 1.0) == list(range(20))
    # however dear the probes, the wait between them stays bounded
    slow = JacobiGate(min_accept=1.5)
    for _ in range(3):
        slow.record(False, 1.0)
    assert _under_gate(slow, 3000, 100.0, 1.0)[:5] == [0, 1, 6, 23, 1048]


def test_gate_backs_off_faster_when_no_guess_is_ever_accepted():
    from hf_deltazip.decoding import JacobiGate

    # an ordinary delta, 11 steps a call (short answers in a batch of 8), a wide step costing 1.5 one-token
    # steps: the first call pays the two judging steps and one probe; the next call runs no wide step,
    # because two steps that accepted nothing at all quadruple the wait instead of doubling it
    gate = JacobiGate(min_accept=1.5)
    first, second = _under_gate(gate, 11, 1.5, 1.0), _under_gate(gate, 11, 1.5, 1.0)
    assert first == [0, 1, 6] and second == []
    # some guesses accepted, though too few to pay: the wait doubles, and the second call probes
    slower = JacobiGate(min_accept=1.5)
    assert _under_gate(slower, 11, 1.5, 1.2) == [0, 1, 6] and _under_gate(slower, 11, 1.5, 1.2) == [4]


def test_short_answers_of_a_converging_model_keep_the_gate_wide():
    # a model that accepts whole blocks, asked for two tokens a call: each call's one Jacobi step keeps a
    # single token (the answer ends there) but matched its whole block; a gate carried across the calls
    # must read that as convergence, not as a step that gained one token, and never fall back
    model = repeat_model()
    ids = repeat_ids(1, 5, seed=6)
    gate = JacobiGate()
    want = greedy(model, ids, None, max_new_tokens=2)
    for _ in range(8):
        out = jacobi_generate(model, ids, block_size=8, max_new_tokens=2, gate=gate, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        assert out.stats.jacobi_forwards == out.stats.forwards == 1
        assert out.stats.step_accepts == [8.0]  # the whole block matched, though one token was kept
    assert gate.backoff == JacobiGate.FIRST_BACKOFF and gate.wait == 0
