"""Admission: deltas already in the step go first, yet no request is bypassed more than K times;
the prefill budget; ``max_deltas="auto"`` from measured step costs; the engine's time split."""

import random

import pytest

from hf_deltazip import DeltaZipError
from hf_deltazip.serving import AdmissionPolicy, DecodeEngine, Pending, auto_max_deltas, fit_step_costs

from model_factory import base_model


@pytest.fixture(scope="module")
def lm():
    return base_model("llama")


def engine(lm, rows=4, **kw):
    return DecodeEngine(lm, max_batch_size=rows, max_length=64, **kw)


def occupy(eng, rows):
    """Fill ``rows`` rows with long-running requests for the base (delta ``None``): the delta in the step."""
    return eng.add([[1, 2, 3]] * rows, None, max_new_tokens=40, eos_token_id=None)


def test_pick_prefers_deltas_in_the_step(lm):
    eng = engine(lm, rows=4)
    occupy(eng, 2)
    waiting = [Pending(3, "b"), Pending(3, None), Pending(3, "c"), Pending(3, None)]
    picked = eng.pick(waiting)
    # two free rows: both go to the delta already running, although "b" arrived first
    assert [waiting.index(p) for p in picked] == [1, 3]
    assert waiting[0].bypassed == 2 and waiting[2].bypassed == 1


def test_arrival_order_when_preference_is_off(lm):
    eng = engine(lm, rows=4, admission=AdmissionPolicy(prefer_running=False))
    occupy(eng, 2)
    waiting = [Pending(3, "b"), Pending(3, None), Pending(3, "c")]
    assert [waiting.index(p) for p in eng.pick(waiting)] == [0, 1]


def test_bypass_bound_holds_under_a_stream_of_popular_requests(lm):
    """Rounds of arrivals for the running delta: the old request for another delta is admitted by
    the time K later ones have gone before it, and no request is ever bypassed more than K times."""
    k = 3
    eng = engine(lm, rows=2, admission=AdmissionPolicy(max_bypass=k))
    occupy(eng, 1)
    waiting = [Pending(3, "cold", item="cold-0")]
    rng = random.Random(0)
    admitted_at = None
    for round_ in range(12):
        waiting += [Pending(3, None, item=f"hot-{round_}-{i}") for i in range(rng.randint(1, 3))]
        picked = eng.pick(waiting)
        assert all(w.bypassed <= k for w in waiting)
        if any(p.item == "cold-0" for p in picked):
            admitted_at = round_
            break
        waiting = [w for w in waiting if w not in picked]
    assert admitted_at is not None and admitted_at <= k
    assert all(w.bypassed <= k for w in waiting)


def test_strict_fifo_with_zero_bypass(lm):
    eng = engine(lm, rows=4, admission=AdmissionPolicy(max_bypass=0))
    occupy(eng, 1)
    waiting = [Pending(3, "b"), Pending(3, None)]
    assert [waiting.index(p) for p in eng.pick(waiting)] == [0, 1]


def test_a_request_that_does_not_fit_blocks_later_ones_at_the_bound(lm):
    eng = engine(lm, rows=2, admission=AdmissionPolicy(max_bypass=1))
    occupy(eng, 1)
    # 70 tokens cannot fit max_length=64: it is passed over once, then nothing passes it
    waiting = [Pending(70, "b"), Pending(3, None), Pending(3, None)]
    assert [waiting.index(p) for p in eng.pick(waiting)] == [1]
    assert waiting[0].bypassed == 1
    assert eng.pick([waiting[0], waiting[2]]) == []


def test_prefill_budget_splits_a_burst_but_admits_one_long_prompt(lm):
    eng = engine(lm, rows=8, admission=AdmissionPolicy(max_prefill_tokens=12))
    waiting = [Pending(5, None) for _ in range(6)]
    assert len(eng.pick(waiting)) == 2  # 3 rows x 5 tokens would be 15 > 12
    assert len(eng.pick([Pending(30, None)])) == 1  # alone over the budget: still admitted


def test_auto_max_deltas_fits_step_costs():
    # t(U) = 10 ms + 2 ms * U: deltas cost as much as the rest of the step at U = 5
    costs = {u: (16, 16 * (0.010 + 0.002 * u)) for u in (1, 2, 4, 8)}
    assert auto_max_deltas(costs) == 5
    assert auto_max_deltas({1: (16, 0.2)}) is None  # one U measured: no cap yet
    assert auto_max_deltas({1: (3, 0.1), 4: (3, 0.4)}) is None  # too few steps
    assert auto_max_deltas({1: (16, 0.2), 4: (16, 0.2)}) is None  # deltas free: no cap


def test_bad_settings_are_refused(lm):
    with pytest.raises(DeltaZipError, match="max_deltas"):
        DecodeEngine(lm, max_batch_size=2, max_length=16, max_deltas=0)
    with pytest.raises(DeltaZipError, match="max_bypass"):
        DecodeEngine(lm, max_batch_size=2, max_length=16, admission=AdmissionPolicy(max_bypass=-1))


def test_stats_split_the_engine_time(lm):
    eng = engine(lm, rows=4)
    eng.add([[1, 2, 3], [4, 5]], max_new_tokens=5, eos_token_id=None)
    while eng.active:
        eng.step()
    st = eng.stats
    assert st.prefills == 1 and st.prefill_rows == 2 and st.prefill_tokens == 6
    assert st.decode_steps == 4  # the first token comes from the prefill
    assert st.row_steps == 16 and st.idle_row_steps == 8
    assert st.prefill_s > 0 and st.decode_s > 0 and st.load_s == 0 and st.loads == 0
    assert st.idle_row_s == pytest.approx(st.decode_s / 2)
    assert st.mean_distinct_deltas == 0  # the plain base
    weights = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    assert st.bytes_per_step > st.floor_bytes_per_step >= weights
    assert set(st.as_dict()) >= {"prefill_s", "decode_s", "load_s", "idle_row_s", "floor_GBps"}
    old = eng.reset_stats()
    assert old.decode_steps == 4 and eng.stats.decode_steps == 0


def test_fit_step_costs_recovers_the_line():
    costs = {u: (16, 16 * (0.010 + 0.002 * u)) for u in (1, 3, 6)}
    a, b = fit_step_costs(costs)
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    assert fit_step_costs({2: (16, 0.3)}) is None


def cost_aware(lm, rows, a, b, **kw):
    return engine(lm, rows=rows, admission=AdmissionPolicy(cost_aware=True, step_cost_line=(a, b), **kw))


def test_cost_aware_admission_holds_a_new_delta_until_it_brings_enough_rows(lm):
    # t(U) = 10 ms + 2 ms U; 6 rows in the step, none with a delta (U = 0, t = 10 ms)
    eng = cost_aware(lm, 8, 0.010, 0.002)
    occupy(eng, 6)
    # one row of "b": 7 rows in 12 ms (583 rows/s) < 6 rows in 10 ms (600): held, its row stays free
    lone = [Pending(3, "b")]
    assert eng.pick(lone) == []
    # two rows of "b": 8 rows in 12 ms (667 rows/s): both admitted
    pair = [Pending(3, "b"), Pending(3, "b")]
    assert [pair.index(p) for p in eng.pick(pair)] == [0, 1]
    # requests for the base add no delta bytes: never held
    assert len(eng.pick([Pending(3, None)])) == 1


def test_cost_aware_admission_is_off_by_default_and_admits_into_an_empty_step(lm):
    eng = engine(lm, rows=8)
    occupy(eng, 6)
    assert len(eng.pick([Pending(3, "b")])) == 1  # default policy: anything that fits
    empty = cost_aware(lm, 8, 0.010, 0.002)
    assert len(empty.pick([Pending(3, "b")])) == 1  # nothing running: any delta raises tokens per second


def test_cost_aware_admission_keeps_the_bypass_bound(lm):
    """A held request at the bound stops later ones too: rows wait for it rather than pass it again."""
    eng = cost_aware(lm, 4, 0.004, 0.002, max_bypass=1)
    occupy(eng, 2)  # a lone "cold" row: 3 rows in 6 ms, as many rows per second as 2 in 4 ms: admitted
    assert len(eng.pick([Pending(3, "cold")])) == 1
    eng = cost_aware(lm, 4, 0.004, 0.002, max_bypass=1)
    occupy(eng, 3)  # 3 rows in 4 ms (750/s) against 4 rows in 6 ms (667/s): "cold" is held
    waiting = [Pending(3, "cold"), Pending(3, None)]
    assert eng.pick(waiting) == [waiting[1]]  # the base request passes it once ...
    assert waiting[0].bypassed == 1
    later = [waiting[0], Pending(3, None)]
    assert eng.pick(later) == []  # ... and no more: the bound holds though a row is free


def test_bad_step_costs_are_refused(lm):
    for bad in ((0.01,), (0.01, 0.0), (-1.0, 0.002), ("a", 0.002)):
        with pytest.raises(DeltaZipError, match="step_cost_line"):
            DecodeEngine(lm, max_batch_size=2, max_length=16, admission=AdmissionPolicy(step_cost_line=bad))


def test_fit_weighs_each_step_so_a_few_warm_up_steps_cannot_tip_the_cap():
    # 10 ms + 2 ms U over thousands of steps, and 8 steps of 32 deltas 1.5x slower than the line (a warm-up's
    # full batch over every delta): fitted to the five means alike, the line would tip to a / b = 1.1 (a cap of
    # one delta per step); weighted by steps it moves little
    costs = {u: (1000, 1000 * (0.010 + 0.002 * u)) for u in (2, 4, 6, 8)}
    costs[32] = (8, 8 * 1.5 * (0.010 + 0.002 * 32))
    a, b = fit_step_costs(costs)
    assert a == pytest.approx(0.010, abs=0.002) and b == pytest.approx(0.002, rel=0.2)
    assert auto_max_deltas(costs) == 3


def test_steps_that_capture_a_graph_are_no_cost_samples(lm, monkeypatch):
    """A decode step that captured a CUDA graph (on a GPU: kernels compiled, the graph recorded) is left out
    of the step costs ``max_deltas="auto"`` fits; the other steps are in."""
    from hf_deltazip import DeltaModel
    from hf_deltazip.bench.decode import build_base, random_delta

    base = build_base("tiny", "cpu")
    dm = DeltaModel(base)
    dm.add_delta(random_delta(base, 4, 64, seed=0), "x")
    eng = DecodeEngine(dm, max_batch_size=2, max_length=16)
    real = eng._decode_step
    calls = []

    def step_that_captures_first(deltas):  # the CPU has no graphs: count the first step as a capture
        calls.append(deltas)
        if len(calls) == 1:
            eng.captures += 1
        real(deltas)

    monkeypatch.setattr(eng, "_decode_step", step_that_captures_first)
    eng.add([[1, 2, 3]], ["x"], max_new_tokens=6, eos_token_id=None)
    while eng.active:
        eng.step()
    assert calls == [1] * 5 and eng.step_costs[1][0] == 4  # each step told its distinct deltas


def test_default_bypass_bound_is_sixteen_per_row(lm):
    eng = engine(lm, rows=2)  # default policy: 16 x 2 = 32 later requests may pass a waiting one
    occupy(eng, 1)
    stuck = Pending(70, "b", bypassed=31)  # cannot fit max_length=64: passed over while the bound allows
    waiting = [stuck, Pending(3, None)]
    assert eng.pick(waiting) == [waiting[1]] and stuck.bypassed == 32
    assert eng.pick([stuck, Pending(3, None)]) == []


# ---------------------------------------------------------------------------------------------- staging ahead
def test_pick_stages_waiting_deltas_ahead_and_passes_over_copies_in_flight(monkeypatch):
    """Room for two deltas, one held by a running row: a round copies a waiting request's delta in ahead
    of its admission, evicting the idle one; a request whose delta is still being copied is passed over
    (and counted as bypassed) while rows run, and admitted once none do; ``stage_ahead=False`` copies
    nothing ahead."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.bench import serve
    from hf_deltazip.modeling import DeltaModel

    base = serve.build_base("tiny", "cpu")
    dm = DeltaModel(base, use_kernels="always")
    dm.configure_cache(max_resident=2)
    for i, n in enumerate(["d0", "d1", "d2"]):
        dm.add_delta(serve.random_delta(base, 4, 64, seed=i), n, resident=i < 2)
    eng = DecodeEngine(dm, max_batch_size=4, max_length=32)
    eng.add([[1, 2, 3]], ["d0"], max_new_tokens=20, eos_token_id=None)
    waiting = [Pending(3, "d2"), Pending(3, "d0")]
    assert eng.pick(waiting) == waiting  # the copy is done at once on the CPU
    assert eng.stats.staged == 1 and sorted(dm.resident_deltas) == ["d0", "d2"]  # d1 was idle: evicted
    assert dm.cache.state("d1") == "host"  # an in-memory delta keeps its host copy

    cache = dm.cache
    real_ready = cache.is_ready
    monkeypatch.setattr(cache, "is_ready", lambda n: n != "d1" and real_ready(n))  # d1's copy "in flight"
    waiting = [Pending(3, "d1"), Pending(3, "d0")]
    assert eng.pick(waiting) == [waiting[1]]
    assert eng.stats.staged == 2 and "d1" in dm.resident_deltas and waiting[0].bypassed == 1
    eng.reset()  # no row runs: a prefill may wait for the copy on the device
    assert eng.pick(waiting[:1]) == waiting[:1]

    eng.admission = AdmissionPolicy(stage_ahead=False)
    eng.add([[1, 2, 3]], ["d0"], max_new_tokens=20, eos_token_id=None)
    before = sorted(dm.resident_deltas)
    waiting = [Pending(3, "d2" if "d2" not in before else "d1")]
    assert dm.cache.state(waiting[0].delta) == "host"
    assert eng.pick(waiting) == waiting  # admitted: its delta goes on the device with its prefill
    assert eng.stats.staged == 2 and sorted(dm.resident_deltas) == before


def test_coalesced_admission_waits_for_enough_free_rows(lm):
    eng = engine(lm, rows=8, admission=AdmissionPolicy(min_free_rows=4))
    occupy(eng, 6)  # two rows free
    three = [Pending(3, None), Pending(3, "b"), Pending(3, None)]
    assert eng.pick(three) == []  # 2 free < min(4, 3 waiting): held, nobody passed over
    assert [w.bypassed for w in three] == [0, 0, 0]
    two = [Pending(3, "b"), Pending(3, None)]
    assert [two.index(p) for p in eng.pick(two)] == [0, 1]  # every waiting request fits the free rows: admitted
    # an empty step admits at once, whatever the floor
    assert len(engine(lm, rows=8, admission=AdmissionPolicy(min_free_rows=8)).pick([Pending(3, "b")])) == 1


def test_coalesced_admission_serves_every_request_in_fewer_prefill_rounds(lm):
    """Requests of unequal lengths free their rows one by one: with the floor the same requests are all
    served, in fewer prefill rounds, and each round fills at least the floor's rows or takes every waiting one."""
    rng = random.Random(0)
    lengths = [rng.randint(2, 12) for _ in range(24)]

    def serve(policy):
        eng = engine(lm, rows=6, admission=policy)
        waiting = [Pending(3, None, item=i) for i in range(len(lengths))]
        done, sizes = [], []
        while waiting or eng.active:
            picked = eng.pick(waiting)
            if picked:
                sizes.append((len(picked), len(waiting)))
                eng.add([[1, 2, 3]] * len(picked), None, max_new_tokens=[lengths[p.item] for p in picked],
                        eos_token_id=None)  # one prefill round
                waiting = [w for w in waiting if w not in picked]
            done += [h for h, _ in eng.step()] if eng.active else []
        return eng.stats.prefills, sizes, len(done)

    plain_rounds, _, plain_done = serve(AdmissionPolicy())
    rounds, sizes, done = serve(AdmissionPolicy(min_free_rows=4))
    assert plain_done == done == len(lengths)
    assert all(n >= min(4, waiting) for n, waiting in sizes[1:])
    assert rounds < plain_rounds


def test_min_free_rows_must_be_a_positive_number_the_engine_has(lm):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(DeltaZipError, match="min_free_rows"):
            DecodeEngine(lm, max_batch_size=2, max_length=16, admission=AdmissionPolicy(min_free_rows=bad))
    with pytest.raises(DeltaZipError, match=r"min_free_rows=3 is more rows than the engine has \(max_batch_size=2\)"):
        DecodeEngine(lm, max_batch_size=2, max_length=16, admission=AdmissionPolicy(min_free_rows=3))
    eng = DecodeEngine(lm, max_batch_size=2, max_length=16, admission=AdmissionPolicy(min_free_rows=2))
    # a policy set later (as the serve bench's variants do) is checked too, and a refused one changes nothing
    for bad in (AdmissionPolicy(min_free_rows=0), AdmissionPolicy(max_bypass=-1), AdmissionPolicy(step_cost_line=(1.0,))):
        with pytest.raises(DeltaZipError, match="AdmissionPolicy"):
            eng.admission = bad
    assert eng.admission.min_free_rows == 2


def test_pick_counts_its_time_and_the_staging_part_of_it(lm):
    eng = engine(lm, rows=4)
    occupy(eng, 2)
    assert eng.stats.admission_s == 0.0
    eng.pick([Pending(3, None)])
    assert eng.stats.admission_s > 0 and 0 <= eng.stats.stage_s <= eng.stats.admission_s
    quiet = engine(lm, rows=4, admission=AdmissionPolicy(stage_ahead=False))
    quiet.pick([Pending(3, None)])
    assert quiet.stats.admission_s > 0 and quiet.stats.stage_s == 0.0
    assert eng.reset_stats().admission_s > 0 and eng.stats.admission_s == 0.0
