"""DecodeEngine: continuous batching over a static KV cache gives what generate() gives, row by row."""

import copy

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress
from hf_deltazip.modeling import CacheFullError
from hf_deltazip.serving import DecodeEngine

from model_factory import base_model, calibration_ids, finetune


@pytest.fixture(scope="module")
def delta_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for i, settings in ((1, dict(bits=4, group_size=32)), (2, dict(bits=3, group_size=32)), (3, dict(bits=4, group_size=32))):
        cfg = DeltaZipConfig(n_samples=4, seq_len=16, **settings)
        compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16),
                 progress=False).save_pretrained(root / f"d{i}")
        out[f"d{i}"] = root / f"d{i}"
    return out


def alone(model, ids, n, **kw):
    """generate() for one prompt; the engine returns the tokens before end-of-sequence, so strip it."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [i for i, t in enumerate(out) if t in eos]
    return out[: stops[0]] if stops else out


def prompts(count, seed=0):
    return [calibration_ids(n=1, length=2 + (i * 3) % 7, seed=seed + i)[0].tolist() for i in range(count)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "phi3"])
def test_plain_model_matches_generate_with_rows_joining_and_cache_shifts(arch, monkeypatch):
    model = base_model(arch)
    ps = prompts(7) + [[1, 5, 7, 9], [8, 9, 10, 11, 12]]  # the last one meets qwen2's eos
    news = [5, 9, 3, 12, 1, 7, 4, 6, 6]
    want = [alone(model, p, n) for p, n in zip(ps, news)]
    engine = DecodeEngine(model, max_batch_size=3, max_length=20)
    shifts = []
    real = engine._compact

    def spy():
        before = engine._ptr
        real()
        shifts.append(before - engine._ptr)

    monkeypatch.setattr(engine, "_compact", spy)
    assert engine.run(ps, max_new_tokens=news) == want
    assert any(s > 0 for s in shifts), "the cache was never shifted: the test does not cover it"
    assert engine.active == 0 and engine.free == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "steps-launched-ahead"])
def test_each_row_uses_its_own_delta(delta_dirs, overlap):
    from hf_deltazip.serving import AdmissionPolicy

    model = DeltaModel(copy.deepcopy(base_model("llama")))
    for name, path in delta_dirs.items():
        model.load_delta(path, delta_name=name)
    ps = prompts(6, seed=3)
    names = ["d1", "d2", None, "d3", "d1", "d2"]
    news = [6, 3, 7, 2, 5, 6]
    want = [alone(model, p, n, delta_names=[d]) for p, d, n in zip(ps, names, news)]
    engine = DecodeEngine(model, max_batch_size=4, max_length=24, admission=AdmissionPolicy(overlap_steps=overlap))
    assert engine.run(ps, names, max_new_tokens=news) == want
    assert (engine.stats.ahead_steps > 0) == overlap
    assert not any(model.cache.held.values()), "a finished row still holds its delta"


def test_kernel_route_with_device_side_rows_under_interpreter(delta_dirs, monkeypatch):
    """The path a captured step takes (slots read on the device, no host routing) gives the same tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    ker = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    for m in (ref, ker):
        for name in ("d1", "d2"):
            m.load_delta(delta_dirs[name], delta_name=name)
    seen = []
    from hf_deltazip.modeling import DeltaLinear

    real = DeltaLinear._forward_kernel

    def spy(self, x, batch, routing, *rest):
        seen.append(routing.is_static and ker.router.current is routing)
        return real(self, x, batch, routing, *rest)

    monkeypatch.setattr(DeltaLinear, "_forward_kernel", spy)
    ps = prompts(4, seed=9)
    names = ["d2", None, "d1", "d2"]
    want = DecodeEngine(ref, max_batch_size=4, max_length=24).run(ps, names, max_new_tokens=5)
    got = DecodeEngine(ker, max_batch_size=4, max_length=24).run(ps, names, max_new_tokens=5)
    assert got == want
    assert any(seen), "decode steps did not take the device-side route"


def test_auto_decode_route_is_chosen_per_step_by_its_distinct_deltas(delta_dirs, monkeypatch):
    """decode="auto" (the default): the engine counts each step's distinct deltas and runs the step on the
    split route from decode_split_min_deltas of them (where the Gluon kernel would add the deltas; faked
    here, the Triton kernel adds them under the interpreter), on the fused kernel below; the tokens are
    the reference path's either way."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import hf_deltazip.kernels as hk
    from hf_deltazip.modeling.routing import KernelPolicy

    monkeypatch.setattr(hk, "gluon_decode_available", lambda device: True)
    ref = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    ker = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always")
    for m in (ref, ker):
        for name in ("d1", "d2"):
            m.load_delta(delta_dirs[name], delta_name=name)
    ker.configure_kernels(decode_split_min_deltas=2)
    routes = []
    real = KernelPolicy.wants_decode_split

    def spy(self, rows, deltas=None, device=None):
        routes.append(real(self, rows, deltas, device))
        return routes[-1]

    monkeypatch.setattr(KernelPolicy, "wants_decode_split", spy)
    ps = prompts(4, seed=9)
    names, news = ["d2", None, "d1", "d2"], [5, 5, 2, 7]  # "d1" leaves early: the last steps carry one delta
    want = DecodeEngine(ref, max_batch_size=4, max_length=24).run(ps, names, max_new_tokens=news)
    engine = DecodeEngine(ker, max_batch_size=4, max_length=24)
    assert engine.run(ps, names, max_new_tokens=news) == want
    st = engine.stats
    assert 0 < st.split_steps < st.decode_steps
    assert True in routes and False in routes
    routes.clear()
    ker.configure_kernels(decode="fused")  # one route for every step
    engine = DecodeEngine(ker, max_batch_size=4, max_length=24)
    assert engine.run(ps, names, max_new_tokens=news) == want
    assert engine.stats.split_steps == 0 and True not in routes


def test_eos_sampling_and_finished_reasons(delta_dirs):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(delta_dirs["d1"], delta_name="d1")
    p = prompts(1, seed=5)[0]
    greedy = alone(model, p, 6, delta_names=["d1"])
    engine = DecodeEngine(model, max_batch_size=2, max_length=32)
    handle = engine.add([p], ["d1"], max_new_tokens=6, eos_token_id=greedy[3])[0]
    done = []
    while engine.active:
        done += engine.step()
    assert [(f.handle, f.tokens, f.reason) for f in done] == [(handle, greedy[:3], "eos")]
    a = engine.run([p, p], ["d1", "d1"], max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=4)
    b = engine.run([p, p], ["d1", "d1"], max_new_tokens=8, do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=4)
    assert a == b and len(a[0]) == 8


def sampled_alone(model, ids, n, seed, temperature, top_k, top_p, **kw):
    """Tokens drawn for one prompt from a generator seeded as the engine seeds a request's (``seed`` plus its index
    in the call), with transformers' own warpers in generate()'s order, recomputing the whole sequence each time."""
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    g = torch.Generator().manual_seed(seed)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            scores = model(input_ids=torch.tensor([seq]), **kw).logits[:, -1].float()
            for w in warpers:
                scores = w(torch.tensor([seq]), scores)
            seq.append(int(torch.multinomial(scores.softmax(-1)[0], 1, generator=g)))
    return seq[len(ids):]


@pytest.mark.parametrize("overlap,kernels", [(False, True), (True, True), (True, False)])
def test_sampled_rows_draw_as_transformers_warpers_with_one_read_back_per_step(delta_dirs, overlap, kernels, monkeypatch):
    """Sampled rows (temperature, top-k, top-p, each request its own seeded generator) draw their tokens on the
    device inside the step: the tokens are those of transformers' warpers with the same generator, a step reads
    nothing back but its token list (no read of a number per sampled row), and with ``overlap_steps`` the steps
    are launched ahead while sampled rows run. Either route of a step: the kernels' (under the interpreter), whose
    steps read each row's slot on the device, as on a GPU; or the one routed on the host, whose embedding deltas
    check ids against their vocabulary from bounds the engine passes instead of reading the ids back."""
    if kernels:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_deltazip.serving import AdmissionPolicy

    ref = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="never")
    model = DeltaModel(copy.deepcopy(base_model("llama")), use_kernels="always" if kernels else "never")
    for m in (ref, model):
        m.load_delta(delta_dirs["d1"], delta_name="d1")
    ps = prompts(3, seed=11)
    settings = dict(temperature=0.7, top_k=12, top_p=0.8)
    want = [sampled_alone(ref, ps[0], 6, 21, **settings, delta_names=["d1"]),
            sampled_alone(ref, ps[1], 6, 22, **settings, delta_names=[None])]
    engine = DecodeEngine(model, max_batch_size=3, max_length=32, admission=AdmissionPolicy(overlap_steps=overlap))
    handles = engine.add(ps[:2], ["d1", None], max_new_tokens=6, do_sample=True, seed=21, eos_token_id=None, **settings)
    greedy = engine.add([ps[2]], ["d1"], max_new_tokens=6, eos_token_id=None)
    reads = []

    class ReadBacks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _READ_BACKS:
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    done = {}
    with ReadBacks():
        while engine.active:
            done.update((f.handle, f.tokens) for f in engine.step())
    assert [done[h] for h in handles] == want
    assert done[greedy[0]] == alone(ref, ps[2], 6, delta_names=["d1"], eos_token_id=None)
    assert reads == []
    assert (engine.stats.ahead_steps > 0) == overlap


def test_held_deltas_are_not_evicted_and_bad_requests_fail_clearly(delta_dirs):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.configure_cache(max_resident=2)
    for name, path in delta_dirs.items():
        model.load_delta(path, delta_name=name, resident=False)
    engine = DecodeEngine(model, max_batch_size=4, max_length=24)
    p = prompts(3, seed=1)
    engine.add(p[:2], ["d1", "d2"], max_new_tokens=4, eos_token_id=None)  # both rows run 4 steps
    assert model.cache.held == {"d1": 1, "d2": 1}
    assert not engine.can_add(len(p[2]), ["d3"])
    with pytest.raises(CacheFullError, match="resident budget"):
        engine.add([p[2]], ["d3"], max_new_tokens=4)  # d1 and d2 are in use: d3 must wait
    assert sorted(model.resident_deltas) == ["d1", "d2"]
    while engine.active:
        engine.step()
    engine.add([p[2]], ["d3"], max_new_tokens=4)  # now one of them can go
    assert "d3" in model.resident_deltas
    assert [f.reason for f in engine.reset()] == ["aborted"] and engine.free == 4 and not model.cache.held
    with pytest.raises(DeltaZipError, match="max_length"):
        engine.add([list(range(1, 20))], [None], max_new_tokens=10)
    with pytest.raises(DeltaZipError, match="free rows"):
        engine.add(prompts(5), [None] * 5, max_new_tokens=2)
    with pytest.raises(DeltaZipError, match="plain model"):
        DecodeEngine(base_model("llama"), max_length=16).add([p[0]], ["d1"], max_new_tokens=2)
    with pytest.raises(DeltaZipError, match="CUDA"):
        DecodeEngine(base_model("llama"), cuda_graphs=True)
    windowed = copy.deepcopy(base_model("llama"))
    windowed.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(DeltaZipError, match="full attention only"):
        DecodeEngine(windowed)


def test_max_deltas_bounds_the_deltas_decoding_together(delta_dirs):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    for name, path in delta_dirs.items():
        model.load_delta(path, delta_name=name)
    engine = DecodeEngine(model, max_batch_size=4, max_length=32, max_deltas=2)
    p = prompts(4, seed=6)
    engine.add(p[:2], ["d1", "d2"], max_new_tokens=3)
    assert not engine.can_add(8, ["d3"]) and engine.can_add(8, ["d1", None])
    names = ["d3", "d1", "d2", "d3"]
    want = [alone(model, q, 4, delta_names=[n]) for q, n in zip(p, names)]
    while engine.active:
        engine.step()
    assert engine.run(p, names, max_new_tokens=4) == want
    with pytest.raises(DeltaZipError, match="max_deltas"):
        DecodeEngine(model, max_deltas=0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_graph_steps_match_eager_steps_as_deltas_come_and_go(delta_dirs):
    def make():
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda", torch.bfloat16))
        m.configure_cache(max_resident=3)
        for name, path in delta_dirs.items():
            m.load_delta(path, delta_name=name, resident=False)
        return m

    ps = prompts(8, seed=2)
    names = ["d1", "d2", None, "d3", "d1", "d3", "d2", None]
    eager = DecodeEngine(make(), max_batch_size=4, max_length=32, cuda_graphs=False).run(ps, names, max_new_tokens=6)
    model = make()
    engine = DecodeEngine(model, max_batch_size=4, max_length=32, cuda_graphs=True)
    assert engine.run(ps, names, max_new_tokens=6) == eager
    assert engine._graphs, "no graph was captured"
    model.delete_delta("d3")  # frees its place in the stacks
    model.load_delta(delta_dirs["d3"], delta_name="d3")  # written back into room kept for it
    assert engine.run(ps, names, max_new_tokens=6) == eager
    assert engine.captures == 1, "loading and evicting deltas (embeddings and norms too) must not re-capture"


@cuda
def test_auto_route_keeps_one_graph_per_route(delta_dirs):
    """decode="auto" on a GPU whose split route takes the Gluon kernel: steps of many distinct deltas replay
    the split route's graph and the others the fused one's; each is captured once and gives the tokens the
    same routes give eagerly."""
    import hf_deltazip.kernels as hk

    if not hk.gluon_decode_available(torch.device("cuda")):
        pytest.skip("the split route has no Gluon kernel on this GPU: decode='auto' is the fused route here")

    def make():
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda", torch.bfloat16))
        m.configure_cache(max_resident=3)
        m.configure_kernels(decode_split_min_deltas=2)
        for name, path in delta_dirs.items():
            m.load_delta(path, delta_name=name)
        return m

    ps = prompts(8, seed=5)
    names, news = ["d1", "d3", "d1", "d3", "d2", None, "d1", "d3"], [6, 3, 8, 2, 5, 7, 4, 9]
    eager = DecodeEngine(make(), max_batch_size=4, max_length=32, cuda_graphs=False)
    want = eager.run(ps, names, max_new_tokens=news)
    engine = DecodeEngine(make(), max_batch_size=4, max_length=32, cuda_graphs=True)
    assert engine.run(ps, names, max_new_tokens=news) == want
    assert set(engine._graphs) == {"split", "fused"} and engine.captures == 2
    assert 0 < engine.stats.split_steps < engine.stats.decode_steps
    assert engine.stats.split_steps == eager.stats.split_steps


@cuda
def test_deltas_cycling_through_a_small_budget_never_recapture(delta_dirs):
    """Two real deltas of one format (linear, embedding and norm deltas) through a 1-delta budget: every
    admission evicts one and writes the other into its room; the captured step stays valid. (A delta of
    a format no resident delta has needs a stack of its own: that first load is a layout change.)"""
    def make(budget):
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda"))  # float32: tokens comparable
        m.configure_cache(max_resident=budget)
        for name in ("d1", "d3"):
            m.load_delta(delta_dirs[name], delta_name=name, resident=False)
        return m

    ps = prompts(7, seed=4)
    names = ["d1", "d3", "d1", "d3", "d3", "d1", "d3"]
    want = DecodeEngine(make(2), max_batch_size=2, max_length=32, cuda_graphs=False).run(ps, names, max_new_tokens=5)
    model = make(1)
    engine = DecodeEngine(model, max_batch_size=2, max_length=32, cuda_graphs=True)
    version = None
    got = []
    for p, n in zip(ps, names):  # one request at a time: each needs its delta resident, evicting another
        got += engine.run([p], [n], max_new_tokens=5)
        version = model.layout_version.value if version is None else version
        assert model.layout_version.value == version
    assert got == want
    assert engine.captures == 1


@cuda
def test_server_on_gpu_continuous_with_graphs_prefetch_and_eviction(delta_dirs):
    """Continuous admission, captured steps, deltas coming and going under a 2-delta budget."""
    from hf_deltazip.serving import DeltaServer

    def make():
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda"))  # float32: exact enough to compare tokens
        m.configure_cache(max_resident=2, max_host_bytes=10**8)
        for name, path in delta_dirs.items():
            m.load_delta(path, delta_name=name, resident=False)
        return m

    ps = prompts(9, seed=8)
    names = ["d1", "d2", "d3", None, "d3", "d1", "d2", "d2", "d3"]
    ref = DecodeEngine(make(), max_batch_size=1, max_length=32, cuda_graphs=False)
    want = [ref.run([p], [n], max_new_tokens=5)[0] for p, n in zip(ps, names)]
    with DeltaServer(make(), max_batch_size=4, max_length=32) as server:
        futures = [server.submit(p, n, max_new_tokens=5) for p, n in zip(ps, names)]
        got = [f.result(timeout=300) for f in futures]
        assert server.engine._graphs
    assert got == want


def test_one_token_steps_of_a_grouped_query_model_attend_without_copying_keys_per_query_head(monkeypatch):
    """The engine switches a GQA model on sdpa to grouped attention: one-token steps never reach
    transformers' sdpa function (which copies keys and values once per query head when given a mask,
    as the engine always does), prefills still do, and the tokens are generate()'s."""
    import transformers.integrations.sdpa_attention as sdpa
    from types import SimpleNamespace

    from hf_deltazip.serving.attention import GROUPED_SDPA, grouped_sdpa_attention

    model = copy.deepcopy(base_model("llama"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    want = [alone(model, p, 6) for p in prompts(3, seed=2)]
    seen = []
    original = sdpa.sdpa_attention_forward

    def recording(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", recording)
    engine = DecodeEngine(model, max_batch_size=3, max_length=32)
    assert engine.grouped_attention and model.config._attn_implementation == GROUPED_SDPA
    assert engine.run(prompts(3, seed=2), max_new_tokens=6) == want
    assert seen and 1 not in seen  # prefills (several tokens) only
    assert [alone(model, p, 6) for p in prompts(3, seed=2)] == want  # generate() after the switch
    # the function itself: a one-token step equals attention over keys/values repeated per query head
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 8, generator=gen) for h, n in ((6, 1), (2, 5), (2, 5)))
    mask = torch.zeros(2, 1, 1, 5)
    mask[0, ..., :2] = float("-inf")
    got, _ = grouped_sdpa_attention(SimpleNamespace(num_key_value_groups=3), q, k, v, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=mask, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(got, ref)
    # a model without grouped heads keeps sdpa
    gpt2 = copy.deepcopy(base_model("gpt2"))
    assert not DecodeEngine(gpt2, max_batch_size=2, max_length=32).grouped_attention
    assert gpt2.config._attn_implementation == "sdpa"


def test_a_cold_delta_is_read_while_its_prefill_runs_and_answers_the_same(delta_dirs, monkeypatch):
    """A delta only on disk is read on a background thread while the prefill runs: each changed module
    computes only once its own tensors are placed, some compute before the last piece is in, and the
    tokens are those of the delta loaded up front."""
    import threading
    import time

    from hf_deltazip.format import DeltaZipFile
    from hf_deltazip.modeling import DeltaModule
    from hf_deltazip.modeling.cache import DeltaCache

    ps = prompts(2, seed=5)
    ref = DeltaModel(copy.deepcopy(base_model("llama")))
    for name in ("d1", "d2"):
        ref.load_delta(delta_dirs[name], delta_name=name)
    want = DecodeEngine(ref, max_batch_size=2, max_length=24).run(ps, ["d2", "d1"], max_new_tokens=5)

    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(delta_dirs["d1"], delta_name="d1")  # every module it changes is wrapped already
    model.load_delta(delta_dirs["d2"], delta_name="d2", resident=False)
    model.cache.pipeline_piece_bytes = 1  # one tensor a piece
    events, threads = [], set()
    real_stream, real_load = DeltaZipFile.stream_tensors, DeltaCache._load_pipelined

    def slow_stream(self, *a, **k):
        for piece in real_stream(self, *a, **k):
            time.sleep(0.002)  # a slow disk: the forward catches up with the reads
            yield piece

    def load(self, e, needed, slot=None, placed=None):
        threads.add(threading.current_thread().name)

        def spy(names):
            events.append(("placed", tuple(names or ())))
            placed(names)
        return real_load(self, e, needed, slot=slot, placed=spy if placed else None)

    monkeypatch.setattr(DeltaZipFile, "stream_tensors", slow_stream)
    monkeypatch.setattr(DeltaCache, "_load_pipelined", load)
    for name, mod in model.base_model.named_modules():
        if isinstance(mod, DeltaModule):
            mod.register_forward_hook(lambda m, a, out, n=name.replace(".base_layer", ""): events.append(("forward", n)))
    engine = DecodeEngine(model, max_batch_size=2, max_length=24)
    assert engine.run(ps, ["d2", "d1"], max_new_tokens=5) == want
    assert threads == {"deltazip-overlap"} and model.cache.entry("d2").slot is not None
    assert model.cache.entry("d2").holds == 0 and engine.stats.loads == 1
    placed_at = {n: i for i, (kind, names) in enumerate(events) if kind == "placed" for n in names}
    first_forward = {}
    for i, (kind, n) in enumerate(events):
        if kind == "forward":
            first_forward.setdefault(n, i)
    assert placed_at and all(first_forward[n] > placed_at[n] for n in placed_at)  # computed after its own tensors
    last_placed = max(placed_at.values())
    assert any(i < last_placed for n, i in first_forward.items()), "nothing computed while the file was read"


def test_an_overlapped_load_that_fails_raises_its_error_and_leaves_nothing_held(delta_dirs, tmp_path):
    from hf_deltazip.errors import DeltaZipFormatError

    from dz_factory import copy_with_corrupt_last_tensor

    bad = tmp_path / "bad"
    last = copy_with_corrupt_last_tensor(delta_dirs["d2"], bad)  # the prefill has begun when it is read
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(delta_dirs["d1"], delta_name="d1")
    model.load_delta(bad, delta_name="bad", resident=False)
    model.cache.pipeline_piece_bytes = 1
    engine = DecodeEngine(model, max_batch_size=2, max_length=24)
    with pytest.raises(DeltaZipFormatError, match=f"tensor {last!r}"):
        engine.add(prompts(1), ["bad"], max_new_tokens=3)
    assert model.cache.entry("bad").slot is None and model.cache.entry("bad").holds == 0
    assert model.cache.entry("d1").holds == 0 and engine.active == 0
    assert model.resident_deltas == ["d1"]
    # the engine and the other delta are unharmed
    ref = DeltaModel(copy.deepcopy(base_model("llama")))
    ref.load_delta(delta_dirs["d1"], delta_name="d1")
    ps = prompts(2, seed=9)
    assert engine.run(ps, ["d1", None], max_new_tokens=4) == [alone(ref, p, 4, delta_names=[n]) for p, n in zip(ps, ["d1", None])]


def test_overlap_falls_back_to_a_plain_load_where_it_cannot_overlap(delta_dirs, monkeypatch):
    """The first delta of a model wraps its modules, which is not done under a running forward; with
    overlap_loads off the load is plain too. Both answer as the delta loaded up front."""
    import threading
    import time

    from hf_deltazip.modeling.cache import DeltaCache

    threads = []
    real = DeltaCache._load_pipelined
    monkeypatch.setattr(DeltaCache, "_load_pipelined",
                        lambda self, *a, **k: threads.append(threading.current_thread().name) or real(self, *a, **k))
    ref = DeltaModel(copy.deepcopy(base_model("llama")))
    ref.load_delta(delta_dirs["d3"], delta_name="d3")
    ps = prompts(2, seed=11)
    want = [alone(ref, p, 4, delta_names=["d3"]) for p in ps]
    first = DeltaModel(copy.deepcopy(base_model("llama")))
    first.load_delta(delta_dirs["d3"], delta_name="d3", resident=False)
    threads.clear()
    assert DecodeEngine(first, max_batch_size=2, max_length=24).run(ps, ["d3", "d3"], max_new_tokens=4) == want
    assert threads == [threading.current_thread().name]  # loaded on the engine's thread, before the prefill
    off = DeltaModel(copy.deepcopy(base_model("llama")))
    off.load_delta(delta_dirs["d1"], delta_name="d1")
    off.load_delta(delta_dirs["d3"], delta_name="d3", resident=False)
    off.cache.overlap_loads = False
    threads.clear()

    def slow_prefill(mod, args, kwargs):  # a prefill (several tokens a row) that takes 0.3 s
        if kwargs["input_ids"].shape[1] > 1:
            time.sleep(0.3)
    off.base_model.register_forward_pre_hook(slow_prefill, with_kwargs=True)
    engine = DecodeEngine(off, max_batch_size=2, max_length=24)
    assert engine.run(ps, ["d3", "d3"], max_new_tokens=4) == want
    assert threads == [threading.current_thread().name]
    # a load done before the prefill counts as loading, the prefill as prefill
    assert engine.stats.loads == 1 and engine.stats.load_s < 0.3 <= engine.stats.prefill_s


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_overlapped_cold_load_on_the_gpu_answers_as_a_plain_one(delta_dirs, dtype):
    """On the GPU the load thread's copies share the prefill's stream: the overlapped load gives the
    tokens of the same load done before the prefill, captured steps included."""
    def make(overlap):
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda", dtype))
        m.load_delta(delta_dirs["d1"], delta_name="d1")
        m.load_delta(delta_dirs["d3"], delta_name="d3", resident=False)
        m.cache.overlap_loads, m.cache.pipeline_piece_bytes = overlap, 1 << 10
        return m

    ps = prompts(3, seed=21)
    names = ["d3", "d1", "d3"]
    want = DecodeEngine(make(False), max_batch_size=3, max_length=32).run(ps, names, max_new_tokens=6)
    model = make(True)
    engine = DecodeEngine(model, max_batch_size=3, max_length=32)
    assert engine.run(ps, names, max_new_tokens=6) == want
    assert model.cache.entry("d3").slot is not None and engine.stats.loads == 1


# -- steps launched ahead of reading back the last one's tokens (AdmissionPolicy.overlap_steps)
def ahead(**kw):
    from hf_deltazip.serving import AdmissionPolicy

    return AdmissionPolicy(overlap_steps=True, **kw)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_steps_launched_ahead_give_generates_tokens_with_rows_joining_mid_flight_and_cache_shifts(arch, monkeypatch):
    model = base_model(arch)
    ps = prompts(7) + [[1, 5, 7, 9], [8, 9, 10, 11, 12]]
    news = [5, 9, 3, 12, 1, 7, 4, 6, 6]
    want = [alone(model, p, n) for p, n in zip(ps, news)]
    engine = DecodeEngine(model, max_batch_size=3, max_length=20, admission=ahead())
    joined, shifts = [], []
    admit, compact = engine._admit, engine._compact

    def spy_admit(*a, **k):
        joined.append(len(engine._ahead))  # steps in flight while a request joins
        return admit(*a, **k)

    def spy_compact():
        before = engine._ptr
        compact()
        shifts.append(before - engine._ptr)

    monkeypatch.setattr(engine, "_admit", spy_admit)
    monkeypatch.setattr(engine, "_compact", spy_compact)
    assert engine.run(ps, max_new_tokens=news) == want
    assert any(joined), "no request joined while a step was in flight: the test does not cover it"
    assert any(s > 0 for s in shifts), "the cache was never shifted: the test does not cover it"
    assert engine.stats.ahead_steps > 0 and engine.active == 0 and engine.free == 3


@cuda
def test_steps_launched_ahead_on_the_gpu_with_graphs_and_evictions_answer_as_eager_steps(delta_dirs):
    """Captured steps launched ahead while rows finish, their deltas are evicted and others are written in."""
    def make():
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda"))  # float32: tokens comparable
        m.configure_cache(max_resident=2)
        for name, path in delta_dirs.items():
            m.load_delta(path, delta_name=name, resident=False)
        return m

    ps = prompts(9, seed=6)
    names = ["d1", "d2", "d3", None, "d3", "d1", "d2", "d2", "d3"]
    news = [5, 7, 3, 6, 4, 8, 2, 5, 6]
    want = DecodeEngine(make(), max_batch_size=2, max_length=32, cuda_graphs=False).run(ps, names, max_new_tokens=news)
    engine = DecodeEngine(make(), max_batch_size=2, max_length=32, cuda_graphs=True, admission=ahead())
    assert engine.run(ps, names, max_new_tokens=news) == want
    assert engine.stats.ahead_steps > 0 and engine._graphs


def test_sampled_jacobi_eos_and_cancelled_rows_among_steps_launched_ahead_answer_as_without(delta_dirs):
    """Rows whose next input the host decides (Jacobi blocks) stop steps being launched ahead while they run;
    sampled rows draw on the device and ride along; end-of-sequence and cancel still finish rows whose next step
    is in flight."""
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(delta_dirs["d1"], delta_name="d1")
    ps = prompts(4, seed=7)
    greedy = alone(model, ps[0], 8, delta_names=["d1"])
    stop = next(i for i in range(3, 8) if greedy.index(greedy[i]) == i)  # a token first met at index >= 3

    def script(engine):
        out = {}
        first = engine.add(ps[:2], ["d1", None], max_new_tokens=8, eos_token_id=greedy[stop])
        for _ in range(2):
            out.update((f.handle, (f.tokens, f.reason)) for f in engine.step())
        sampled = engine.add([ps[2]], ["d1"], max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, seed=3)
        out.update((f.handle, (f.tokens, f.reason)) for f in engine.step())
        engine.cancel(first[1])
        while engine.active:
            out.update((f.handle, (f.tokens, f.reason)) for f in engine.step())
        jacobi = engine.add([ps[3]], [None], max_new_tokens=7, decoding="jacobi", jacobi_block_size=4)
        out.update((f.handle, (f.tokens, f.reason)) for f in engine.step())  # read back what was in flight
        late = engine.add([ps[0]], ["d1"], max_new_tokens=8, eos_token_id=None)
        while engine.active:
            out.update((f.handle, (f.tokens, f.reason)) for f in engine.step())
        return [out[h] for h in first + sampled + jacobi + late], engine.stats

    want, _ = script(DecodeEngine(model, max_batch_size=3, max_length=40))
    got, stats = script(DecodeEngine(model, max_batch_size=3, max_length=40, admission=ahead()))
    assert got == want
    assert want[0] == (greedy[:stop], "eos") and want[1][1] == "cancelled" and want[4] == (greedy, "length")
    assert want[3][0] == alone(model.base_model, ps[3], 7) and want[3][1] == "length"
    assert stats.ahead_steps > 0


def _running_engine(delta_dirs, base, **kw):
    """An engine over ``base`` with the three deltas (embedding, norm and linear parts) that has run a step of two
    requests (compiled, its cache and routing tables built), the six prompts and names of the admission tests, and
    their tokens from a fresh engine."""
    model = DeltaModel(base, **kw)
    for name, path in delta_dirs.items():
        model.load_delta(path, delta_name=name)
    ps = prompts(6, seed=8)
    names = ["d1", "d2", None, "d3", "d1", "d2"]
    want = DecodeEngine(model, max_batch_size=4, max_length=32).run(ps, names, max_new_tokens=4)
    engine = DecodeEngine(model, max_batch_size=4, max_length=32)
    engine.add(ps[:2], names[:2], max_new_tokens=4)
    engine.step()
    return engine, ps, names, want


@cuda
def test_an_admission_queues_its_prefill_without_waiting_for_the_gpu(delta_dirs):
    """Admitting requests whose deltas are resident waits for the device only when it reads the first tokens
    back: a host copy or a host decision before then would make a prefill wait for the step in flight, and
    each prefill layer for the one before it."""
    engine, ps, names, want = _running_engine(delta_dirs, copy.deepcopy(base_model("llama")).to("cuda", torch.bfloat16))
    choose = engine._choose

    def read_back(*args, **kwargs):  # the one wait an admission needs
        torch.cuda.set_sync_debug_mode(0)
        return choose(*args, **kwargs)

    engine._choose = read_back
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handles = engine.add(ps[2:4], names[2:4], max_new_tokens=4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine._choose = choose
    done = {}
    while engine.active:
        done.update((f.handle, f.tokens) for f in engine.step())
    assert [done[h] for h in handles] == want[2:4]


_READ_BACKS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
               "unique_consecutive", "repeat_interleave"}


def test_an_admission_reads_nothing_back_before_its_first_tokens(delta_dirs, monkeypatch):
    """The GPU test above on a CPU (the kernels' routes under the interpreter): every operation an admission
    dispatches before it reads its first tokens back is counted, and none may need the device's data on the host
    (a read of a number, a boolean mask's nonzero, a unique, ...), each of which would make a prefill wait for the
    decode step in flight. Deltas with embedding, norm and linear parts, so every host-routed module runs."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    engine, ps, names, want = _running_engine(delta_dirs, copy.deepcopy(base_model("llama")).half(), use_kernels="always")
    seen = []

    class ReadBacks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _READ_BACKS or (name.startswith("index") and any(
                    torch.is_tensor(i) and i.dtype == torch.bool for a in args if isinstance(a, (list, tuple)) for i in a)):
                site = [f for f in traceback.extract_stack() if "hf_deltazip" in f.filename][-1:]
                seen.append(f"{name} at {site[0].filename}:{site[0].lineno}" if site else name)
            return func(*args, **(kwargs or {}))

    mode = ReadBacks()
    choose = engine._choose

    def read_back(*args, **kwargs):  # the one wait an admission needs
        mode.__exit__(None, None, None)
        return choose(*args, **kwargs)

    engine._choose = read_back
    mode.__enter__()
    handles = engine.add(ps[2:4], names[2:4], max_new_tokens=4)
    engine._choose = choose
    assert seen == []
    done = {}
    while engine.active:
        done.update((f.handle, f.tokens) for f in engine.step())
    assert [done[h] for h in handles] == want[2:4]
