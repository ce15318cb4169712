"""Tests of ``deltazip bench serve``: the trace, the two schedulers, the disk path, and a real run.

The schedulers are checked on a simulated engine and clock (fast and exact); the end-to-end run
serves a tiny random Llama on the CPU through every system with the real DecodeEngine.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from hf_deltazip.bench import serve
from hf_deltazip.bench.serve import make_trace, replay, zipf_probabilities


def harmonic(n: int, a: float = 1.0) -> float:
    return sum(i ** -a for i in range(1, n + 1))


# ---------------------------------------------------------------------------------------------- trace
def test_zipf_probabilities_are_rank_to_the_minus_a_normalized():
    p = zipf_probabilities(4, 1.0)
    assert p == pytest.approx([1 / harmonic(4), 1 / 2 / harmonic(4), 1 / 3 / harmonic(4), 1 / 4 / harmonic(4)])
    assert zipf_probabilities(5, 0.0) == pytest.approx([0.2] * 5)  # a = 0: uniform
    assert zipf_probabilities(3, 2.0)[0] == pytest.approx(1 / harmonic(3, 2.0))


def test_trace_popularity_follows_the_stated_zipf_convention():
    n, count = 32, 20000
    trace = make_trace(num_deltas=n, requests=count, rate=10.0, zipf=1.0, prompt_len=1, vocab_size=16, seed=1)
    counts = [0] * n
    for r in trace:
        counts[r.delta] += 1
    # rank 1 (delta d0) gets 1 / H_32 of the requests (about 24.7 %), rank 2 half of that
    assert counts[0] / count == pytest.approx(1 / harmonic(n), abs=0.015)
    assert counts[1] / count == pytest.approx(1 / 2 / harmonic(n), abs=0.012)
    assert counts[0] > counts[3] > counts[15]


def test_trace_gaps_are_exponential_with_mean_one_over_rate():
    rate = 8.0
    trace = make_trace(num_deltas=4, requests=20000, rate=rate, zipf=1.0, prompt_len=1, vocab_size=16, seed=2)
    gaps = [trace[0].arrival] + [b.arrival - a.arrival for a, b in zip(trace, trace[1:])]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean


def test_same_seed_gives_the_same_trace():
    kw = dict(num_deltas=8, requests=50, rate=3.0, zipf=1.2, prompt_len=5, vocab_size=100)
    a, b, c = make_trace(seed=7, **kw), make_trace(seed=7, **kw), make_trace(seed=8, **kw)
    assert a == b
    assert a != c
    assert all(len(r.prompt) == 5 and all(0 <= t < 100 for t in r.prompt) for r in a)


def test_bad_trace_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="--rate"):
        make_trace(num_deltas=2, requests=1, rate=0, zipf=1.0, prompt_len=1, vocab_size=4, seed=0)
    with pytest.raises(ValueError, match="Zipf exponent"):
        zipf_probabilities(3, -1.0)


# ---------------------------------------------------------------------------------------------- schedulers
class SimClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class SimEngine:
    """The DecodeEngine interface on a simulated clock: a prefill costs 5 ms, a decode step 10 ms.

    Token ``j`` of a row is ``prompt[0] * 1000 + j``, so each request's answer is predictable. It
    records the delta names of the rows in every step, to check what a scheduler let run together.
    """

    def __init__(self, clock, max_batch_size=4):
        self.clock, self.max = clock, max_batch_size
        self.rows = {}  # handle -> [prompt, name, tokens, max_new]
        self.next = 0
        self.finished_in_add = []
        self.steps = []  # names of the active rows, per step

    @property
    def free(self):
        return self.max - len(self.rows)

    @property
    def active(self):
        return len(self.rows)

    def can_add(self, prompt_len, delta_names=()):
        return len(self.rows) + max(len(delta_names), 1) <= self.max

    def add(self, prompts, delta_names, max_new_tokens, eos_token_id=None):
        assert eos_token_id is None
        if len(prompts) > self.free:
            raise RuntimeError("more prompts than free rows")
        self.clock.t += 0.005
        handles = []
        for p, n in zip(prompts, delta_names):
            h, self.next = self.next, self.next + 1
            self.rows[h] = [p, n, [p[0] * 1000], max_new_tokens]
            handles.append(h)
            if max_new_tokens == 1:
                self.finished_in_add.append((h, self.rows.pop(h)[2]))
        return handles

    def step(self):
        self.clock.t += 0.010
        self.steps.append([r[1] for r in self.rows.values()])
        out, self.finished_in_add = self.finished_in_add, []
        for h, row in list(self.rows.items()):
            row[2].append(row[0][0] * 1000 + len(row[2]))
            if len(row[2]) == row[3]:
                out.append((h, self.rows.pop(h)[2]))
        return out


def _trace(n_requests=40, deltas=5, rate=200.0):
    trace = make_trace(num_deltas=deltas, requests=n_requests, rate=rate, zipf=1.0, prompt_len=3, vocab_size=50, seed=3)
    for r in trace:
        r.prompt[0] = r.id  # makes every answer distinct in SimEngine
    return trace


def _replay(trace, **kw):
    clock = SimClock()
    engine = SimEngine(clock)
    names = [f"d{i}" for i in range(5)]
    run = replay(engine, trace, names, clock=clock, sleep=clock.sleep, **kw)
    return run, engine


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_replay_answers_every_request_with_its_own_tokens_in_causal_order(one_at_a_time):
    trace = _trace()
    run, _ = _replay(trace, new_tokens=6, max_seconds=60, one_at_a_time=one_at_a_time)
    assert not run.truncated and len(run.outcomes) == len(trace)
    for o in run.outcomes:
        assert o.tokens == [o.id * 1000 + j for j in range(6)]
        assert o.arrival <= o.first_token <= o.finish
    assert sorted(o.id for o in run.outcomes) == [r.id for r in trace]
    stats = serve.summarize(run, trace)
    assert stats["output_tokens"] == 6 * len(trace)
    assert stats["latency_p99_s"] >= stats["latency_mean_s"] > stats["ttft_mean_s"] > 0


def test_mixed_batching_runs_many_deltas_together_and_never_switches():
    run, engine = _replay(_trace(), new_tokens=6, max_seconds=60)
    assert max(len(set(s)) for s in engine.steps) > 1
    assert run.switches == 0


def test_one_at_a_time_runs_one_delta_per_step_and_switches_when_it_changes():
    calls = []
    run, engine = _replay(_trace(), new_tokens=6, max_seconds=60, one_at_a_time=True, switch=calls.append)
    assert all(len(set(s)) == 1 for s in engine.steps)
    assert run.switches == len(calls) > 1
    assert all(a != b for a, b in zip(calls, calls[1:]))  # only called when the fine-tune changes
    # the first switch goes to the delta of the first request
    assert calls[0] == _trace()[0].delta


def test_one_token_answers_finish_inside_add():
    trace = _trace(n_requests=10)
    run, _ = _replay(trace, new_tokens=1, max_seconds=60)
    assert len(run.outcomes) == 10
    assert all(o.finish == o.first_token and len(o.tokens) == 1 for o in run.outcomes)


def test_max_seconds_stops_admitting_and_reports_truncation():
    trace = _trace(n_requests=200, rate=1000.0)  # far more than 4 rows at 10 ms a step can serve
    run, engine = _replay(trace, new_tokens=20, max_seconds=0.5)
    assert run.truncated
    assert 0 < len(run.outcomes) < len(trace)
    assert not engine.rows  # the rows already running were finished
    assert run.wall_s < 0.5 + 20 * 0.011
    stats = serve.summarize(run, trace)
    assert stats["completed"] == len(run.outcomes)
    assert stats["left_waiting"] > 0 and stats["oldest_left_waiting_s"] > 0


def test_percentile_interpolates_like_numpy():
    assert serve.percentile([], 99) is None
    assert serve.percentile([3.0], 99) == 3.0
    xs = [float(i) for i in range(1, 101)]
    assert serve.percentile(xs, 99) == pytest.approx(99.01)
    assert serve.percentile(xs, 50) == pytest.approx(50.5)


def test_pausable_clock_leaves_out_paused_time():
    clock = serve.PausableClock()
    t0 = clock()
    with clock.paused():
        start = clock()
        while clock() - start < 0.02:
            pass
    assert clock() - t0 < 0.02 + 0.005
    assert clock.excluded >= 0.02


# ---------------------------------------------------------------------------------------------- weights on disk
def _tiny_model():
    return serve.build_base("tiny", "cpu", layers=1)


def test_safetensors_file_round_trips_through_safetensors_and_the_loader(tmp_path):
    from safetensors.torch import load_file

    model = _tiny_model()
    weights = serve.FlatWeights(model)
    path = tmp_path / "ft.safetensors"
    size = serve.write_safetensors(path, weights, index=3)
    assert size == path.stat().st_size > weights.nbytes

    expected = weights.fill(torch.empty(weights.numel, dtype=weights.dtype), 3)
    loaded = load_file(path)  # the file is a standard safetensors file
    assert set(loaded) == set(weights.names)
    for name, off, p in zip(weights.names, weights.offsets, weights.params):
        assert torch.equal(loaded[name].reshape(-1), expected[off: off + p.numel()])

    before = [p.detach().clone() for p in weights.params]
    loader = serve.DiskLoader(weights, chunk_bytes=4096 + 37)  # pieces that cut through tensors
    assert loader.load(path) == size
    for p, b, off in zip(weights.params, before, weights.offsets):
        assert torch.equal(p.detach().reshape(-1), expected[off: off + p.numel()])
        assert not torch.equal(p.detach(), b)  # a fine-tune differs from the base


def test_loader_rejects_a_file_for_another_model(tmp_path):
    small = serve.FlatWeights(_tiny_model())
    path = tmp_path / "ft.safetensors"
    serve.write_safetensors(path, small, index=0)
    other = serve.FlatWeights(serve.build_base("tiny", "cpu", layers=2))
    with pytest.raises(ValueError, match="delete the file"):
        serve.DiskLoader(other).load(path)


def test_flat_weights_load_puts_a_finetune_in_place():
    model = _tiny_model()
    weights = serve.FlatWeights(model)
    ptrs = [p.data_ptr() for p in weights.params]
    flat = weights.fill(torch.empty(weights.numel, dtype=weights.dtype), 1)
    weights.load(flat)
    assert [p.data_ptr() for p in weights.params] == ptrs  # in place: captured graphs stay valid
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in weights.params]), flat)


# ---------------------------------------------------------------------------------------------- end to end
SMOKE = ["--shape", "tiny", "--device", "cpu", "--deltas", "3", "--requests", "6", "--rate", "40",
         "--prompt-len", "8", "--new-tokens", "4", "--batch", "4", "--bits", "4", "--group-size", "64",
         "--max-seconds", "60", "--seed", "5"]


def test_every_system_serves_the_whole_trace_on_cpu(tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = serve.main(SMOKE + ["--json", str(out), "--per-request", "--workdir", str(tmp_path / "disk")])
    assert rc == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "| system |" in printed and "Zipf a=1" in printed and "| prefill s |" in printed

    assert report["trace"]["zipf_convention"] == serve.ZIPF_CONVENTION
    assert report["trace"]["requests"] == 6 and report["model"]["shape"] == "tiny"
    assert {"device", "torch", "transformers", "commit", "date", "command"} <= set(report["environment"])
    assert list(report["systems"]) == list(serve.SYSTEMS), report["skipped"]
    for name, r in report["systems"].items():
        assert r["completed"] == r["requests"] == 6, name
        assert not r["truncated"]
        assert r["output_tokens"] == 6 * 4
        for key in ("tokens_per_s", "latency_mean_s", "latency_p99_s", "ttft_mean_s", "ttft_p99_s",
                    "switches", "switch_s", "peak_gpu_gib", "time_split"):
            assert key in r, (name, key)
        assert all(q["tokens"] == 4 for q in report["requests"][name])
        # throughput from the per-request times: tokens / (last finish - first arrival)
        reqs = report["requests"][name]
        span = max(q["finish"] for q in reqs) - min(q["arrival"] for q in reqs)
        assert r["tokens_per_s"] == pytest.approx(sum(q["tokens"] for q in reqs) / span)
    ours = report["systems"]["deltazip"]["tokens_per_s"]
    for name, r in report["systems"].items():
        if name != "deltazip":
            assert r["deltazip_speedup"] == pytest.approx(ours / r["tokens_per_s"]), name
    assert report["systems"]["deltazip"]["switches"] == 0
    for name in ("one-delta-loop", "swap-cpu", "swap-disk", "all-resident"):
        assert report["systems"][name]["switches"] >= 1
    disk = report["systems"]["swap-disk"]
    assert len(disk["loads"]) == disk["switches"] and "page_cache" in disk
    assert all(x["bytes"] > 0 and x["fadvise_dontneed"] for x in disk["loads"])
    assert not list((tmp_path / "disk").iterdir())  # the files are removed afterwards


def _tiny_with_deltas(device: str):
    """A tiny random base on ``device`` as a DeltaModel with three random 4-bit deltas, all resident, and their names."""
    from hf_deltazip.modeling import DeltaModel

    base = serve.build_base("tiny", device)
    dm = DeltaModel(base)
    names = [f"d{i}" for i in range(3)]
    for i, n in enumerate(names):
        dm.add_delta(serve.random_delta(base, 4, 64, seed=i), n)
    return dm, names


def test_deltazip_answers_match_each_request_served_alone():
    """Continuous batching over many deltas gives every request what the engine gives it alone."""
    from hf_deltazip.serving import DecodeEngine

    torch.manual_seed(0)
    dm, names = _tiny_with_deltas("cpu")
    trace = make_trace(num_deltas=3, requests=8, rate=100.0, zipf=1.0, prompt_len=6, vocab_size=1024, seed=4)
    engine = DecodeEngine(dm, max_batch_size=4, max_length=16)
    run = replay(engine, trace, names, new_tokens=5, max_seconds=60)
    assert len(run.outcomes) == len(trace)
    assert len({o.delta for o in run.outcomes}) > 1
    by_id = {r.id: r for r in trace}
    for o in run.outcomes:
        req = by_id[o.id]
        (h,) = engine.add([req.prompt], [names[req.delta]], max_new_tokens=5, eos_token_id=None)
        alone = None
        while alone is None:
            alone = dict(engine.step()).get(h)
        assert o.tokens == list(alone), o.id
    assert not math.isnan(serve.summarize(run, trace)["tokens_per_s"])


# ---------------------------------------------------------------------------------------------- time split, real deltas
def test_time_split_adds_up_to_the_wall_time():
    """The split of a replay through a real engine: prefill + loads + decode + other = wall."""
    from hf_deltazip.modeling import DeltaModel
    from hf_deltazip.serving import DecodeEngine

    base = serve.build_base("tiny", "cpu")
    dm = DeltaModel(base)
    dm.configure_cache(max_resident=2)
    names = [f"d{i}" for i in range(3)]
    for i, n in enumerate(names):
        dm.add_delta(serve.random_delta(base, 4, 64, seed=i), n, resident=i < 2)
    trace = make_trace(num_deltas=3, requests=6, rate=100.0, zipf=0.0, prompt_len=4, vocab_size=1024, seed=2)
    engine = DecodeEngine(dm, max_batch_size=4, max_length=16)
    run = replay(engine, trace, names, new_tokens=3, max_seconds=60)
    split = serve.time_split(engine.stats, run)
    parts = split["prefill_s"] + split["load_s"] + split["decode_s"] + split["other_s"]
    assert parts == pytest.approx(split["wall_s"])
    assert split["decode_steps"] > 0 and 0 < split["mean_distinct_deltas"] <= 2
    assert split["floor_bytes_per_step"] <= split["bytes_per_step"]
    # the engine's admission rounds are part of the rest, staging ahead part of them
    assert 0 < split["admission_s"] <= split["other_s"] and 0 <= split["stage_s"] <= split["admission_s"]
    assert split["stage_in_steps_s"] == 0  # off by default
    assert split["prefill_device_s"] is None and split["decode_device_s"] is None and "device_idle_s" not in split
    table = serve.split_table({"deltazip": {"time_split": split}}).splitlines()
    assert len(table) == 3 and table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert table[2].startswith("| deltazip |") and table[2].endswith("| - / - / - |")  # no device times on a CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_device_times_on_the_gpu_fit_inside_the_wall_time(overlap):
    """On a GPU the engine times its prefills and decode steps with CUDA events; their sum cannot exceed the
    replay's wall time (the stream runs one at a time), and the rest is the device waiting."""
    from hf_deltazip.serving import AdmissionPolicy, DecodeEngine

    dm, names = _tiny_with_deltas("cuda")
    trace = make_trace(num_deltas=3, requests=12, rate=100.0, zipf=0.0, prompt_len=4, vocab_size=1024, seed=2)
    engine = DecodeEngine(dm, max_batch_size=4, max_length=16, admission=AdmissionPolicy(overlap_steps=overlap))
    split = serve.time_split(engine.stats, replay(engine, trace, names, new_tokens=3, max_seconds=60))
    assert split["prefill_device_s"] > 0 and split["decode_device_s"] > 0
    assert 0 <= split["device_idle_s"] <= split["wall_s"]
    assert (split["ahead_steps"] > 0) == overlap


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    """A saved tiny base and two real compressed deltas of it."""
    from hf_deltazip import DeltaZipConfig, compress

    from model_factory import base_model, calibration_ids, finetune

    root = tmp_path_factory.mktemp("real")
    base_model("llama").save_pretrained(root / "base")
    for i, name in ((1, "chat"), (2, "code")):
        cfg = DeltaZipConfig(n_samples=4, seq_len=16, bits=4, group_size=32)
        compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16),
                 progress=False).save_pretrained(root / "deltas" / name)
    return root


def test_real_deltas_mode_serves_compressed_finetunes(real_pair, tmp_path):
    out = tmp_path / "real.json"
    rc = serve.main(["--base", str(real_pair / "base"), "--delta-dir", str(real_pair / "deltas"),
                     "--device", "cpu", "--systems", "deltazip,swap-cpu,peft", "--requests", "5", "--rate", "50",
                     "--prompt-len", "6", "--new-tokens", "3", "--batch", "4", "--max-seconds", "60",
                     "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["trace"]["deltas"] == 2
    assert "real compressed deltas: chat=" in report["model"]["delta_format"]
    assert list(report["systems"]) == ["deltazip", "swap-cpu", "peft"], report["skipped"]
    for name, r in report["systems"].items():
        assert r["completed"] == 5 and r["output_tokens"] == 15, name
        assert r["time_split"]["wall_s"] > 0
    assert report["systems"]["deltazip"]["time_split"]["mean_distinct_deltas"] > 0
    # the engine systems ran the tiny llama's grouped-query heads without per-head key copies; PEFT has no engine
    assert [r.get("grouped_attention") for r in report["systems"].values()] == [True, True, None]


def test_real_deltas_mode_refuses_bad_arguments(real_pair, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--delta", f"a={real_pair / 'deltas' / 'chat'}", "--device", "cpu"])
    assert "need --base" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--base", str(real_pair / "base"), "--delta", "no-equals-sign", "--device", "cpu"])
    assert "NAME=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--base", str(real_pair / "base"), "--delta", f"a={real_pair}", "--device", "cpu"])
    assert "holds no delta.dz" in capsys.readouterr().err


def test_max_deltas_flag_takes_a_number_auto_or_none():
    parse = serve.build_parser().parse_args
    assert parse([]).max_deltas == "auto"
    assert parse(["--max-deltas", "none"]).max_deltas is None
    assert parse(["--max-deltas", "4"]).max_deltas == 4
    with pytest.raises(SystemExit):
        parse(["--max-deltas", "0"])


def test_admission_variants_parse_and_refuse_bad_fields():
    assert serve.parse_admission_variant("max_bypass=512, cost_aware=on") == {"max_bypass": 512, "cost_aware": True}
    assert serve.parse_admission_variant("max_prefill_tokens=none,prefer_running=0") == {
        "max_prefill_tokens": None, "prefer_running": False}
    assert serve.parse_admission_variant("stage_ahead=off") == {"stage_ahead": False}
    assert serve.parse_admission_variant("stage_in_steps=on") == {"stage_in_steps": True}
    assert serve.parse_admission_variant("overlap_steps=on") == {"overlap_steps": True}
    assert serve.parse_admission_variant("min_free_rows=16") == {"min_free_rows": 16}
    assert serve.parse_admission_variant("min_free_rows=none") == {"min_free_rows": None}
    assert serve.parse_admission_variant("prefill=dequant,overlap_steps=on") == {"prefill": "dequant", "overlap_steps": True}
    for bad in ("", "max_bypass", "max_bypass=-3", "cost_aware=maybe", "speed=9", "min_free_rows=0", "prefill=fast"):
        with pytest.raises(ValueError):
            serve.parse_admission_variant(bad)
    parse = serve.build_parser().parse_args
    with pytest.raises(SystemExit):
        parse(SMOKE + ["--admission-variant", "max_bypass=lots"])
    with pytest.raises(SystemExit):  # a repeat would overwrite the first replay's results under the same name
        serve.main(SMOKE + ["--admission-variant", "overlap_steps=on", "--admission-variant", "overlap_steps=on"])
    args = parse(SMOKE + ["--cost-aware", "--max-bypass", "7"])
    eng = serve._make_engine(_tiny_model(), args)
    assert eng.admission.cost_aware and eng.admission.max_bypass == 7 and eng.admission.min_free_rows is None
    eng = serve._make_engine(_tiny_model(), parse(SMOKE + ["--min-free-rows", "3"]))
    assert eng.admission.min_free_rows == 3
    assert eng.fused_norms == 0
    assert serve._make_engine(_tiny_model(), parse(SMOKE + ["--fused-norms"])).fused_norms > 0
    for bad in ("0", "few"):
        with pytest.raises(SystemExit):
            parse(SMOKE + ["--min-free-rows", bad])


def test_admission_variants_replay_the_trace_on_the_same_engine(tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = serve.main(SMOKE + ["--systems", "deltazip,swap-cpu", "--admission-variant", "max_bypass=0",
                             "--admission-variant", "cost_aware=on,max_bypass=512",
                             "--admission-variant", "min_free_rows=2", "--admission-variant", "overlap_steps=on",
                             "--admission-variant", "prefill=dequant", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    names = ["deltazip", "deltazip[max_bypass=0]", "deltazip[cost_aware=on,max_bypass=512]", "deltazip[min_free_rows=2]",
             "deltazip[overlap_steps=on]", "deltazip[prefill=dequant]", "swap-cpu"]
    assert list(report["systems"]) == names
    for name in names:
        assert report["systems"][name]["completed"] == 6, name
    assert "cost_aware=True" in report["systems"][names[2]]["how"]
    assert "min_free_rows=2" in report["systems"][names[3]]["how"]
    assert report["systems"][names[4]]["time_split"]["ahead_steps"] > 0
    assert report["systems"]["deltazip"]["time_split"]["ahead_steps"] == 0
    assert "prefill route 'dequant'" in report["systems"][names[5]]["how"]
    assert "prefill route 'auto'" in report["systems"]["deltazip"]["how"]
    swap = report["systems"]["swap-cpu"]
    for v in names[1:5]:
        assert swap["variant_speedups"][v] == pytest.approx(report["systems"][v]["tokens_per_s"] / swap["tokens_per_s"])
    assert f"- {names[1]} / swap-cpu:" in capsys.readouterr().out


def test_max_bypass_flag_sets_the_engines_fairness_bound():
    parse = serve.build_parser().parse_args
    model = _tiny_model()
    default = serve._make_engine(model, parse(SMOKE))
    assert parse(SMOKE).max_bypass is None and default.admission.max_bypass is None  # the engine's 16 x batch
    strict = serve._make_engine(model, parse(SMOKE + ["--max-bypass", "0"]))
    assert strict.admission.max_bypass == 0 and strict.admission.prefer_running
    assert serve._make_engine(model, parse(SMOKE + ["--max-bypass", "512"])).admission.max_bypass == 512
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parse(["--max-bypass", bad])


@pytest.mark.parametrize("flag, bad, value, setter, default, said", [
    ("--gluon-block-rows", "12", 16, "set_gluon_block_rows", 8, "row blocks of 16"),
    ("--gluon-stages", "1", 2, "set_gluon_stages", 0, "with 2 copy stages"),
])
def test_gluon_launch_flags_are_set_for_the_run_and_restored(tmp_path, monkeypatch, flag, bad, value, setter, default,
                                                             said):
    from hf_deltazip import kernels as K

    parse = serve.build_parser().parse_args
    assert getattr(parse(SMOKE), flag[2:].replace("-", "_")) is None
    with pytest.raises(SystemExit):
        parse(SMOKE + [flag, bad])
    seen = []
    real = getattr(K, setter)
    monkeypatch.setattr(K, setter, lambda v: (seen.append(v), real(v))[1])
    out = tmp_path / "g.json"
    assert serve.main(SMOKE + [flag, str(value), "--json", str(out)]) == 0
    assert seen == [value, default]  # set for the deltazip run, the library's default again after it
    assert said in json.loads(out.read_text())["systems"]["deltazip"]["how"]


def test_a_variant_is_described_by_its_own_policy_not_the_flags(tmp_path):
    out = tmp_path / "m.json"
    assert serve.main(SMOKE + ["--min-free-rows", "2", "--admission-variant", "min_free_rows=none",
                               "--json", str(out)]) == 0
    systems = json.loads(out.read_text())["systems"]
    assert systems["deltazip"]["completed"] == systems["deltazip[min_free_rows=none]"]["completed"] == 6
    assert "prefills coalesced (while rows run, admission waits for 2 free rows)" in systems["deltazip"]["how"]
    variant = systems["deltazip[min_free_rows=none]"]["how"]
    assert "prefills coalesced" not in variant and "min_free_rows=None" in variant
