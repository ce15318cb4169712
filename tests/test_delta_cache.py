"""The delta cache: a resident budget, a host tier, on-demand loading, prefetch and thread safety."""

import copy
import shutil
import threading

import pytest
import torch

from hf_deltazip import DeltaModel, DeltaZipConfig, DeltaZipError, compress

from model_factory import base_model, calibration_ids, finetune


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-deltas")
    out = {}
    for i in range(1, 4):
        cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
        compress(base_model("llama"), finetune("llama", i), cfg, calibration=calibration_ids(n=4, length=16), progress=False).save_pretrained(root / f"d{i}")
        out[f"d{i}"] = root / f"d{i}"
    return out


@pytest.fixture(scope="module")
def reference(folders):
    """Every delta resident, no budget: what the cached model must reproduce."""
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    for name, folder in folders.items():
        model.load_delta(folder, delta_name=name)
    return model


IDS = calibration_ids(n=2, length=8, seed=21)


def logits(model, rows):
    with torch.no_grad():
        return model(input_ids=IDS, delta_names=rows).logits


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _close(got, want, device):
    """Equal to the reference within the device's tolerance (float32 on a CPU, bfloat16 on a GPU)."""
    tol = 1e-4 if device == "cpu" else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_resident_budget_evicts_least_recently_used(folders, reference):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.configure_cache(max_resident=2)
    for name, folder in folders.items():
        model.load_delta(folder, delta_name=name)
    assert model.deltas == ["d1", "d2", "d3"]
    assert sorted(model.resident_deltas) == ["d2", "d3"]  # d1 was evicted when d3 came in
    assert torch.equal(logits(model, ["d1", None]), logits(reference, ["d1", None]))  # loaded on demand
    assert sorted(model.resident_deltas) == ["d1", "d3"]  # d2 was the least recently used
    assert torch.equal(logits(model, ["d2", "d3"]), logits(reference, ["d2", "d3"]))
    assert sorted(model.resident_deltas) == ["d2", "d3"]
    assert set(model.memory_footprint()["deltas"]) == {"d2", "d3"}
    with pytest.raises(DeltaZipError, match="needs 3 deltas but at most 2"):
        model.generate(IDS[:1].repeat(3, 1), delta_names=["d1", "d2", "d3"], max_new_tokens=1)


def test_byte_budget(folders, reference):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(folders["d1"], delta_name="d1")
    one = model.memory_footprint()["deltas"]["d1"]
    model.configure_cache(max_resident_bytes=int(one * 1.5))
    model.load_delta(folders["d2"], delta_name="d2")
    assert model.resident_deltas == ["d2"]
    assert torch.equal(logits(model, ["d1", "d1"]), logits(reference, ["d1", "d1"]))
    with pytest.raises(DeltaZipError, match="do not fit the resident budget"):
        logits(model, ["d1", "d2"])


def test_host_tier_serves_evicted_deltas_without_the_file(folders, reference, tmp_path):
    local = {n: tmp_path / n for n in folders}
    for n, f in folders.items():
        shutil.copytree(f, local[n])
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.configure_cache(max_resident=1, max_host_bytes=10**9)
    model.load_delta(local["d1"], delta_name="d1")
    model.load_delta(local["d2"], delta_name="d2")
    assert model.resident_deltas == ["d2"] and set(model.memory_footprint()["host"]) == {"d1", "d2"}
    shutil.rmtree(local["d1"])  # the host copy must be enough
    assert torch.equal(logits(model, ["d1", None]), logits(reference, ["d1", None]))
    model.configure_cache(max_resident=1, max_host_bytes=0)
    assert model.memory_footprint()["host"] == {}


def test_registered_delta_loads_on_first_use_and_prefetch(folders, reference):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(folders["d1"], delta_name="d1", resident=False)
    model.load_delta(folders["d2"], delta_name="d2", resident=False)
    assert model.deltas == ["d1", "d2"] and model.resident_deltas == []
    future = model.prefetch(["d2"])
    assert future.result(timeout=60) == ["d2"]
    assert "d2" in model.memory_footprint()["host"] and model.resident_deltas == []
    assert torch.equal(logits(model, ["d2", "d1"]), logits(reference, ["d2", "d1"]))
    assert sorted(model.resident_deltas) == ["d1", "d2"]
    with pytest.raises(DeltaZipError, match="positive integer"):
        model.configure_cache(max_resident=0)


def test_concurrent_callers_get_their_own_deltas(folders, reference):
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.configure_cache(max_resident=1)
    for name, folder in folders.items():
        model.load_delta(folder, delta_name=name, resident=False)
    want = {n: logits(reference, [n, n]) for n in folders}
    errors = []

    def worker(name):
        try:
            for _ in range(3):
                got = logits(model, [name, name])
                if not torch.equal(got, want[name]):
                    errors.append(name)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []


def _kernel_model(folders, device, dtype, monkeypatch):
    if device == "cpu":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = DeltaModel(copy.deepcopy(base_model("llama")).to(device, dtype), use_kernels="always")
    model.configure_cache(max_resident=3)  # kernel stacks with room for three
    model.load_delta(folders["d1"], delta_name="d1")
    model.load_delta(folders["d2"], delta_name="d2", resident=False)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_uploads_into_free_room_ahead_of_use(folders, reference, device, monkeypatch):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = _kernel_model(folders, device, dtype, monkeypatch)
    version = model.layout_version.value
    assert model.prefetch(["d2"]).result(timeout=120) == ["d2"]
    assert sorted(model.resident_deltas) == ["d1", "d2"], "d2 was not uploaded ahead of use"
    assert "d2" not in model.memory_footprint()["host"]  # no host copy kept without a host budget
    with torch.no_grad():
        got = model(input_ids=IDS.to(device), delta_names=["d2", "d1"]).logits.float().cpu()
    _close(got, logits(reference, ["d2", "d1"]), device)
    # linear layers, embeddings and norms all took it into room kept for it: no new device tensors,
    # so a captured decode step stays valid (no re-capture)
    assert model.layout_version.value == version
    # evicting it and loading it back is in place too, and still right
    model.configure_cache(max_resident=1)
    assert model.resident_deltas == ["d1"] or model.resident_deltas == ["d2"]
    for rows in (["d1", "d2"][:1], ["d2"], ["d1"]):
        with torch.no_grad():
            got = model(input_ids=IDS[:1].to(device), delta_names=rows).logits.float().cpu()
        _close(got, logits(reference, rows + [None])[:1], device)
    assert model.layout_version.value == version
    full = _kernel_model(folders, device, dtype, monkeypatch)
    full.configure_cache(max_resident=1)
    assert full.prefetch(["d2"]).result(timeout=120) == ["d2"]
    assert full.resident_deltas == ["d1"], "a prefetch must not evict"


def _hosted(folders, monkeypatch, device="cpu"):
    """d1 and d2 on the device, d3 in host memory (read ahead, not uploaded); room for two, and a host tier
    that keeps an evicted delta's copy."""
    model = _kernel_model(folders, device, torch.float32 if device == "cpu" else torch.bfloat16, monkeypatch)
    model.configure_cache(max_resident=3, max_host_bytes=10**9)
    model.load_delta(folders["d3"], delta_name="d3", resident=False)
    model.prefetch(["d2", "d3"], to_device=False).result(timeout=120)
    model.cache.ensure_resident(["d2"])
    model.configure_cache(max_resident=2, max_host_bytes=10**9)
    assert sorted(model.resident_deltas) == ["d1", "d2"] and model.cache.state("d3") == "host"
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_stage_evicts_an_idle_delta_to_copy_a_waiting_one_in_ahead(folders, reference, monkeypatch, device):
    model = _hosted(folders, monkeypatch, device)
    cache = model.cache
    version = model.layout_version.value
    cache.acquire(["d1"])  # a running request holds d1
    assert cache.stage(["d3"], keep=["d1"]) == ["d3"]
    assert sorted(model.resident_deltas) == ["d1", "d3"]  # d2, idle, made room
    if device == "cuda":
        torch.cuda.synchronize()  # the side stream's copies too
    assert cache.is_ready("d3")
    with torch.no_grad():
        got = model(input_ids=IDS.to(device), delta_names=["d3", "d1"]).logits.float().cpu()
    _close(got, logits(reference, ["d3", "d1"]), device)
    assert model.layout_version.value == version  # in place: a captured decode step stays valid
    # nothing to evict: d1 is held, d3 is kept for a running request; d2 stays in host memory
    assert cache.state("d2") == "host"
    assert cache.stage(["d2"], keep=["d1", "d3"]) == []
    assert sorted(model.resident_deltas) == ["d1", "d3"] and cache.state("d2") == "host"
    # a delta a later waiting request needs is no victim either
    assert cache.stage(["d2", "d3"], keep=["d1"]) == []
    assert not cache.is_ready("d2")
    cache.release(["d1"])


@pytest.fixture(scope="module")
def tied_folders(tmp_path_factory):
    """Deltas of a base whose LM head is its input embedding (Gemma): the embedding's delta serves both."""
    from model_factory import MATRIX_VOCAB, matrix_finetune, matrix_model

    root = tmp_path_factory.mktemp("tied-deltas")
    cfg = DeltaZipConfig(bits=4, group_size=32, n_samples=4, seq_len=16)
    for i in (1, 2):
        delta = compress(matrix_model("gemma"), matrix_finetune("gemma", i), cfg,
                         calibration=calibration_ids(n=4, length=16, vocab=MATRIX_VOCAB), progress=False)
        assert delta.header.tied_embeddings and delta.modules["model.embed_tokens"].kind == "embedding"
        delta.save_pretrained(root / f"d{i}")
    return root


@pytest.mark.parametrize("device", DEVICES)
def test_stage_copies_a_tied_embedding_delta_in_ahead(tied_folders, monkeypatch, device):
    """A delta of a model with tied embeddings (every Gemma fine-tune) stages like any other: its embedding
    delta goes into room kept in the embedding's stack and in the LM head's, its norms into their tables, so
    a captured decode step stays valid, and it answers as when loaded up front."""
    from model_factory import MATRIX_VOCAB, matrix_model

    if device == "cpu":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = DeltaModel(copy.deepcopy(matrix_model("gemma")).to(device, dtype), use_kernels="always")
    model.configure_cache(max_resident=3, max_host_bytes=10**9)
    model.load_delta(tied_folders / "d1", delta_name="d1")
    model.load_delta(tied_folders / "d2", delta_name="d2", resident=False)
    model.prefetch(["d2"], to_device=False).result(timeout=120)
    cache = model.cache
    assert cache.state("d2") == "host"
    version = model.layout_version.value
    cache.acquire(["d1"])  # a running request holds d1
    assert cache.stage(["d2"], keep=["d1"]) == ["d2"]
    assert sorted(model.resident_deltas) == ["d1", "d2"]
    if device == "cuda":
        torch.cuda.synchronize()
    assert cache.is_ready("d2")
    reference = DeltaModel(copy.deepcopy(matrix_model("gemma")))
    for name in ("d1", "d2"):
        reference.load_delta(tied_folders / name, delta_name=name)
    ids = calibration_ids(n=3, length=8, seed=21, vocab=MATRIX_VOCAB)
    rows = ["d2", "d1", None]
    with torch.no_grad():
        got = model(input_ids=ids.to(device), delta_names=rows).logits.float().cpu()
        want = reference(input_ids=ids, delta_names=rows).logits
    _close(got, want, device)
    assert model.layout_version.value == version  # in place: no re-capture
    cache.release(["d1"])


def test_stage_makes_room_once_for_a_delta_the_stacks_cannot_take_ahead(folders, monkeypatch):
    """A delta that cannot go into the kernel stacks' room (a layout they keep none for, say) is placed at its admission
    instead. Staging it frees the room that admission would free (one idle delta, least recently used) and
    evicts nothing more in later rounds while that room stays free."""
    model = _hosted(folders, monkeypatch)
    monkeypatch.setattr(model.cache.placer, "can_attach_in_room", lambda slot, modules, params, header: False)
    for _ in range(3):
        assert model.cache.stage(["d3"]) == []
    assert model.resident_deltas == ["d2"] and model.cache.state("d3") == "host"  # d1, the oldest, made room
    assert model.cache.fits(["d2", "d3"])


def test_engine_reads_a_waiting_disk_only_delta_ahead_while_rows_run(folders, reference, monkeypatch):
    """While rows decode, a request whose delta is only on disk is passed over and its delta read on the
    prefetch thread (no row waits for the read); once in, the request is admitted and decodes as with the
    delta loaded up front. With no row running, such a request is admitted at once (read beside its prefill)."""
    import time

    from hf_deltazip.serving import DecodeEngine, Pending

    model = _kernel_model(folders, "cpu", torch.float32, monkeypatch)  # d1 on the device, d2 only on disk
    model.load_delta(folders["d3"], delta_name="d3", resident=False)
    eng = DecodeEngine(model, max_batch_size=4, max_length=32)
    eng.add([[1, 2, 3]], ["d1"], max_new_tokens=20, eos_token_id=None)
    waiting = [Pending(3, "d2"), Pending(3, "d1")]
    assert eng.pick(waiting) == [waiting[1]] and waiting[0].bypassed == 1
    for _ in range(600):
        if model.cache.state("d2") != "disk":
            break
        time.sleep(0.05)
    for _ in range(600):  # read, then uploaded into free room (or staged by the next round)
        if eng.pick(waiting[:1]) == waiting[:1]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the request for d2 was never admitted")
    assert model.cache.state("d2") == "device"
    prompt = IDS[0, :6].tolist()
    h = eng.add([prompt], ["d2"], max_new_tokens=3, eos_token_id=None)[0]
    while eng.active > 1:
        done = dict(eng.step())
        if h in done:
            break
    ref = reference.generate(IDS[:1, :6], delta_names=["d2"], max_new_tokens=3, do_sample=False)[0, 6:].tolist()
    assert done[h] == ref
    eng.reset()
    idle = [Pending(3, "d3")]
    assert eng.pick(idle) == idle and model.cache.state("d3") == "disk"  # nothing runs: admitted at once


def test_a_delta_whose_read_ahead_fails_is_left_to_its_admission_which_reports_it(folders, monkeypatch, tmp_path):
    import time

    from hf_deltazip.format import DZ_FILENAME
    from hf_deltazip.serving import DecodeEngine, Pending

    bad = tmp_path / "bad"
    shutil.copytree(folders["d3"], bad)
    model = _kernel_model(folders, "cpu", torch.float32, monkeypatch)
    model.load_delta(bad, delta_name="bad", resident=False)
    dz = bad / DZ_FILENAME
    dz.write_bytes(dz.read_bytes()[: dz.stat().st_size // 2])  # truncated after it was registered
    eng = DecodeEngine(model, max_batch_size=4, max_length=64)
    eng.add([[1, 2, 3]], ["d1"], max_new_tokens=50, eos_token_id=None)
    waiting = [Pending(3, "bad")]
    for _ in range(600):  # read ahead, which fails: then the request is no longer passed over
        if eng.pick(waiting) == waiting:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a request whose delta cannot be read was passed over for good")
    with pytest.raises(DeltaZipError):
        eng.add([[1, 2, 3]], ["bad"], max_new_tokens=2, eos_token_id=None)
    assert eng.active == 1  # the running row is untouched


@pytest.mark.parametrize("device", DEVICES)
def test_a_deferred_staging_writes_a_piece_per_step_and_serves_as_a_whole_one(folders, reference, monkeypatch, device):
    model = _hosted(folders, monkeypatch, device)
    cache = model.cache
    version = model.layout_version.value
    cache.acquire(["d1"])
    assert cache.stage(["d3"], keep=["d1"], defer=True) == ["d3"]
    # the room is made now (d2 evicted, d3's slot taken), the modules are written later
    assert sorted(model.resident_deltas) == ["d1", "d3"] and cache.state("d2") == "host"
    assert cache.staging_pending == ["d3"] and not cache.is_ready("d3")
    assert cache.stage(["d3"], keep=["d1"], defer=True) == []  # already under way: not begun twice
    pieces = 0
    while cache.advance_staging(steps=1):
        pieces += 1
        assert not cache.is_ready("d3")
    pieces += 1
    modules, params = cache.entry("d3").host if cache.entry("d3").host is not None else model.cache.placer.gather(
        cache.slot_of("d3"))
    assert pieces == len(modules) + len(params)  # one module (or stored parameter) per piece
    if device == "cuda":
        torch.cuda.synchronize()
    assert cache.staging_pending == [] and cache.is_ready("d3")
    with torch.no_grad():
        got = model(input_ids=IDS.to(device), delta_names=["d3", "d1"]).logits.float().cpu()
    _close(got, logits(reference, ["d3", "d1"]), device)
    assert model.layout_version.value == version  # in place: a captured decode step stays valid
    cache.release(["d1"])


def test_a_batch_that_needs_a_delta_still_being_staged_writes_the_rest_first(folders, reference, monkeypatch):
    model = _hosted(folders, monkeypatch)
    cache = model.cache
    assert cache.stage(["d3"], keep=["d1"], defer=True) == ["d3"]
    assert cache.advance_staging(steps=2) == 1  # partly written
    _close(logits(model, ["d3", "d1"]), logits(reference, ["d3", "d1"]), "cpu")  # the batch wrote the rest first
    assert cache.staging_pending == [] and cache.is_ready("d3")
    # finish_staging writes a named one at once; others wait
    cache.acquire(["d1"])
    assert cache.stage(["d2"], keep=["d1"], defer=True) == ["d2"]  # evicts d3, idle
    cache.finish_staging(["d3", "nope"])  # not being staged: nothing to do
    assert cache.staging_pending == ["d2"]
    cache.finish_staging(["d2"])
    assert cache.staging_pending == [] and cache.is_ready("d2")
    _close(logits(model, ["d2", "d1"]), logits(reference, ["d2", "d1"]), "cpu")
    cache.release(["d1"])


def test_evicting_or_deleting_a_delta_still_being_staged_takes_its_written_part_out(folders, reference, monkeypatch):
    model = _hosted(folders, monkeypatch)
    cache = model.cache
    cache.acquire(["d1"])
    assert cache.stage(["d3"], keep=["d1"], defer=True) == ["d3"]
    cache.advance_staging(steps=3)
    # a more urgent delta needs the room: the half-written d3 is the idle one, so it goes back to host memory
    assert cache.stage(["d2"], keep=["d1"], defer=True) == ["d2"]
    assert cache.state("d3") == "host" and cache.staging_pending == ["d2"]
    assert all(cache.slot_of("d2") not in m.slots() or m.names.get(cache.slot_of("d2")) != "d3"
               for _, m in cache.placer.wrappers())  # nothing of d3 left in the slot d2 now writes
    cache.finish_staging()
    _close(logits(model, ["d2", "d1"]), logits(reference, ["d2", "d1"]), "cpu")
    cache.release(["d1"])
    # d3 comes back whole on its next use (d2 evicted for it)
    _close(logits(model, ["d3", "d1"]), logits(reference, ["d3", "d1"]), "cpu")
    # deleting a delta mid-staging leaves nothing of it behind
    cache.acquire(["d1"])
    assert cache.stage(["d2"], keep=["d1"], defer=True) == ["d2"]
    cache.advance_staging(steps=2)
    model.delete_delta("d2")
    assert "d2" not in model.deltas and cache.staging_pending == []
    assert not any(m.names.get(s) == "d2" for _, m in cache.placer.wrappers() for s in m.slots())
    _close(logits(model, ["d3", "d1"]), logits(reference, ["d3", "d1"]), "cpu")
    cache.release(["d1"])


def test_engine_writes_a_staged_delta_inside_its_decode_steps(folders, reference, monkeypatch):
    """With ``AdmissionPolicy(stage_in_steps=True)`` and every row busy, a round only takes the waiting request's
    slot; each decode step writes a piece, the running rows decode as before, and once written the request is
    admitted and decodes as with its delta loaded up front."""
    from hf_deltazip.serving import AdmissionPolicy, DecodeEngine, Pending

    model = _hosted(folders, monkeypatch)
    cache = model.cache
    eng = DecodeEngine(model, max_batch_size=2, max_length=48, admission=AdmissionPolicy(stage_in_steps=True))
    prompt = IDS[0, :6].tolist()
    running = eng.add([prompt, prompt], ["d1", "d1"], max_new_tokens=12, eos_token_id=None)
    waiting = [Pending(6, "d3")]
    assert eng.pick(waiting) == []  # no free row
    assert cache.staging_pending == ["d3"] and eng.stats.staged == 1
    out = {}
    for _ in range(3):
        out.update(dict(eng.step()))
    assert cache.staging_pending == ["d3"] and eng.stats.stage_in_steps_s > 0  # one piece per step on a CPU
    while eng.active:
        out.update(dict(eng.step()))
    ref = reference.generate(IDS[:1, :6], delta_names=["d1"], max_new_tokens=12, do_sample=False)[0, 6:].tolist()
    assert out[running[0]] == ref and out[running[1]] == ref
    assert cache.staging_pending == ["d3"]  # nothing runs any more: nothing writes it
    assert eng.pick(waiting) == waiting  # nothing runs: admitted at once, the rest written at its admission
    h = eng.add([prompt], ["d3"], max_new_tokens=3, eos_token_id=None)[0]
    assert cache.staging_pending == [] and cache.is_ready("d3")
    done = {}
    while eng.active:
        done.update(dict(eng.step()))
    assert done[h] == reference.generate(IDS[:1, :6], delta_names=["d3"], max_new_tokens=3, do_sample=False)[0, 6:].tolist()


def test_a_round_that_leaves_rows_free_writes_a_staged_delta_at_once(folders, monkeypatch):
    """``stage_in_steps``: where a round leaves rows free while a waiting request's delta is still to be written
    inside the steps, the round writes it (the rows would run empty until then); the request gets a row next round."""
    from hf_deltazip.serving import AdmissionPolicy, DecodeEngine, Pending

    model = _hosted(folders, monkeypatch)
    eng = DecodeEngine(model, max_batch_size=3, max_length=48, admission=AdmissionPolicy(stage_in_steps=True))
    eng.add([IDS[0, :6].tolist()] * 2, ["d1", "d1"], max_new_tokens=8, eos_token_id=None)
    waiting = [Pending(6, "d3")]
    assert eng.pick(waiting) == []  # its delta is staged this round: passed over
    assert model.cache.staging_pending == [] and model.cache.is_ready("d3")  # but written at once: a row is free
    assert eng.pick(waiting) == waiting
    eng.reset()


def test_staging_and_evicting_copy_no_number_from_the_host(folders, monkeypatch):
    """Setting a table entry to a Python number copies it from pageable host memory, which on a GPU waits for the
    stream's queued work: once per module that made staging an 8B delta on an H100 host wait on its own copies
    (46 -> 17 ms for 56 modules when table entries were filled instead). No such copy, and no read back, may
    remain on the staging path (here the evicting one: a module's slot freed, another's taken)."""
    from hf_deltazip.bench.host_overhead import _CountOps

    model = _hosted(folders, monkeypatch)
    with _CountOps() as count:
        assert model.cache.stage(["d3"], keep=["d1"]) == ["d3"]
    assert count.counts["fill_"] > 0  # the table entries are written...
    assert not {"lift_fresh", "_local_scalar_dense", "item"} & set(count.counts), count.counts  # ...without a copy


def test_stage_leaves_deltas_only_on_disk_and_unknown_names_alone(folders, monkeypatch):
    model = _kernel_model(folders, "cpu", torch.float32, monkeypatch)  # d1 on the device, d2 only on disk
    assert model.cache.stage(["d2", "nope", None]) == []
    assert model.cache.state("d2") == "disk" and model.resident_deltas == ["d1"]
    with pytest.raises(DeltaZipError, match="no delta named 'nope'"):
        model.cache.is_ready("nope")


@pytest.mark.parametrize("piece_bytes", [1, 1 << 30])  # one module per piece; the whole delta in one piece
@pytest.mark.parametrize("direct_io", [False, True])  # through the page cache; past it (O_DIRECT)
def test_pipelined_cold_load_equals_a_whole_file_load_and_a_warm_delta(folders, reference, piece_bytes, direct_io,
                                                                       monkeypatch):
    """A delta only on disk, read a piece at a time while earlier pieces are placed, answers exactly as
    the same delta read whole, and as one loaded up front."""
    import threading

    from hf_deltazip.format import DeltaZipFile

    readers = set()
    real_decoded = DeltaZipFile._decoded

    def decoded(self, name, payload, out):
        readers.add(threading.current_thread().name.split("_")[0])
        return real_decoded(self, name, payload, out)

    monkeypatch.setattr(DeltaZipFile, "_decoded", decoded)
    piped = DeltaModel(copy.deepcopy(base_model("llama")))
    assert piped.cache.pipeline_loads  # the default (first tokens sooner on the H200)
    assert piped.cache.pipeline_direct_io is False  # the default: through the page cache
    piped.cache.pipeline_piece_bytes, piped.cache.pipeline_direct_io = piece_bytes, direct_io
    whole = DeltaModel(copy.deepcopy(base_model("llama")))
    whole.cache.pipeline_loads = False
    for model in (piped, whole):
        for name, folder in folders.items():
            model.load_delta(folder, delta_name=name, resident=False)
    rows = ["d1", "d3"]
    out = logits(piped, rows)
    assert "deltazip-load" in readers  # the streamed reader's pool checked it
    assert sorted(piped.resident_deltas) == ["d1", "d3"]
    assert torch.equal(out, logits(whole, rows))
    assert torch.equal(out, logits(reference, rows))
    e = piped.cache.entry("d1")
    assert e.nbytes == whole.cache.entry("d1").nbytes > 0


def test_pipelined_load_of_a_delta_for_another_base_places_nothing(folders, tmp_path):
    """The check runs piece by piece: a mismatch midway takes the pieces placed so far out again."""
    from hf_deltazip.errors import BaseMismatchError

    small = base_model("llama")
    model = DeltaModel(copy.deepcopy(small))
    model.cache.pipeline_loads = True
    model.cache.pipeline_piece_bytes = 1
    model.load_delta(folders["d1"], delta_name="d1", resident=False)
    # the base loses its last decoder layer's MLP after registration: later pieces no longer fit it
    model.base_model.model.layers[-1].mlp.down_proj = torch.nn.Linear(3, 3, bias=False)
    with pytest.raises((BaseMismatchError, DeltaZipError)):
        logits(model, ["d1", None])
    assert model.resident_deltas == []
    assert model.cache.slot_of("d1") is None


def test_a_pipelined_load_keeps_a_host_copy_only_for_the_host_tier(folders, reference, monkeypatch):
    from hf_deltazip.delta import read_packed
    from hf_deltazip.format import DZ_FILENAME, DeltaZipFile

    plain = DeltaModel(copy.deepcopy(base_model("llama")))
    plain.cache.pipeline_loads, plain.cache.pipeline_piece_bytes = True, 1
    plain.load_delta(folders["d1"], delta_name="d1", resident=False)
    assert torch.equal(logits(plain, ["d1", None]), logits(reference, ["d1", None]))
    assert plain.cache.entry("d1").host is None  # nothing kept: each piece is let go once placed

    tiered = DeltaModel(copy.deepcopy(base_model("llama")))
    tiered.cache.pipeline_loads, tiered.cache.pipeline_piece_bytes = True, 1
    tiered.configure_cache(max_resident=1, max_host_bytes=1 << 30)
    for name in ("d1", "d2"):
        tiered.load_delta(folders[name], delta_name=name, resident=False)
    assert torch.equal(logits(tiered, ["d1", None]), logits(reference, ["d1", None]))
    modules, params = tiered.cache.entry("d1").host  # the host tier holds the whole delta as the file has it
    with DeltaZipFile(folders["d1"] / DZ_FILENAME) as dz:
        want_modules, want_params = read_packed(dz, progress=False)
    assert modules.keys() == want_modules.keys() and params.keys() == want_params.keys()
    for n, p in want_modules.items():
        assert all(torch.equal(modules[n].tensors()[r], t) for r, t in p.tensors().items())
    assert all(torch.equal(params[n], t) for n, t in want_params.items())
    assert torch.equal(logits(tiered, ["d2", None]), logits(reference, ["d2", None]))  # d1 evicted to the host tier

    def no_reads(*a, **k):
        raise AssertionError("d1 should come back from host memory, not from its file")

    monkeypatch.setattr(DeltaZipFile, "stream_tensors", no_reads)
    monkeypatch.setattr(DeltaZipFile, "get_tensor", no_reads)
    assert torch.equal(logits(tiered, ["d1", None]), logits(reference, ["d1", None]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pipelined_cuda_load_lets_go_of_its_pinned_pieces(folders, reference, monkeypatch):
    """Every piece's pinned block is free again once its modules are on the GPU (so later pieces and later
    loads reuse it), and the delta answers as the reference does."""
    import gc
    import weakref

    from hf_deltazip.format import DeltaZipFile

    seen = []
    real = DeltaZipFile.stream_tensors

    def stream(self, *a, **k):
        for piece in real(self, *a, **k):
            seen.extend(weakref.ref(t) for t in piece.values())
            assert all(t.is_pinned() for t in piece.values() if t.numel())
            yield piece

    monkeypatch.setattr(DeltaZipFile, "stream_tensors", stream)
    model = _kernel_model(folders, "cuda", torch.float32, monkeypatch)
    model.cache.pipeline_loads, model.cache.pipeline_piece_bytes = True, 1 << 12
    model.cache.pipeline_direct_io = True  # staged past the page cache, then into the pinned pieces
    model.load_delta(folders["d3"], delta_name="d3", resident=False)
    rows = ["d3", "d1"]
    with torch.no_grad():
        got = model(input_ids=IDS.cuda(), delta_names=rows).logits.float().cpu()
    torch.cuda.synchronize()
    gc.collect()
    assert seen and all(r() is None for r in seen)
    want = logits(reference, rows)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_forward_and_generate_read_a_cold_delta_beside_their_first_pass(folders, reference, monkeypatch):
    """``model(...)`` and ``generate`` with a delta only on disk load it on a background thread while the first
    forward pass runs (each module waiting for its own tensors): the same logits and tokens as the delta loaded
    up front, nothing left held; by name per row and as the active delta."""
    from hf_deltazip.modeling.cache import DeltaCache

    threads = []
    real = DeltaCache._load_pipelined
    monkeypatch.setattr(DeltaCache, "_load_pipelined",
                        lambda self, *a, **k: threads.append(threading.current_thread().name) or real(self, *a, **k))
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(folders["d1"], delta_name="d1")  # every module the others change is wrapped already
    for name in ("d2", "d3"):
        model.load_delta(folders[name], delta_name=name, resident=False)
    threads.clear()
    assert torch.equal(logits(model, ["d2", None]), logits(reference, ["d2", None]))
    assert threads == ["deltazip-overlap"] and model.cache.entry("d2").holds == 0
    threads.clear()
    kw = dict(attention_mask=torch.ones_like(IDS), max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = reference.generate(IDS, delta_names=["d3", "d1"], **kw)
    assert torch.equal(model.generate(IDS, delta_names=["d3", "d1"], **kw), want)
    assert threads == ["deltazip-overlap"] and all(model.cache.entry(n).holds == 0 for n in ("d1", "d3"))
    # the active delta (no delta_names)
    active = DeltaModel(copy.deepcopy(base_model("llama")))
    active.load_delta(folders["d1"], delta_name="d1")
    active.load_delta(folders["d2"], delta_name="d2", resident=False)
    active.set_delta("d2")
    assert active.cache.state("d2").value == "disk"
    threads.clear()
    with torch.no_grad():
        got = active(input_ids=IDS).logits
    assert torch.equal(got, logits(reference, ["d2", "d2"]))
    assert threads == ["deltazip-overlap"] and active.cache.entry("d2").holds == 0


def test_a_forward_whose_cold_delta_is_corrupt_raises_and_holds_nothing(folders, tmp_path):
    from hf_deltazip.errors import DeltaZipFormatError

    from dz_factory import copy_with_corrupt_last_tensor

    bad = tmp_path / "bad"
    last = copy_with_corrupt_last_tensor(folders["d2"], bad)
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(folders["d1"], delta_name="d1")
    model.load_delta(bad, delta_name="bad", resident=False)
    with pytest.raises(DeltaZipFormatError, match=f"tensor {last!r}"):
        logits(model, ["bad", "d1"])
    assert model.cache.entry("bad").slot is None and model.cache.entry("bad").holds == 0
    assert model.cache.entry("d1").holds == 0 and model.resident_deltas == ["d1"]
    assert torch.equal(logits(model, ["d1", None]), logits(reference_of(folders, "d1"), ["d1", None]))


def reference_of(folders, name):
    m = DeltaModel(copy.deepcopy(base_model("llama")))
    m.load_delta(folders[name], delta_name=name)
    return m


def test_a_call_nested_in_an_overlapped_route_waits_for_that_load(folders, reference, monkeypatch):
    """``model(...)`` inside ``model.route(...)`` naming the delta the outer block is still reading, and another
    cold delta: the inner call waits for the outer load (no second load into its slot) and loads the other one
    into a slot of its own."""
    from hf_deltazip.modeling.cache import DeltaCache

    loads = []
    real = DeltaCache._load_pipelined
    monkeypatch.setattr(DeltaCache, "_load_pipelined",
                        lambda self, e, *a, **k: loads.append(e.name) or real(self, e, *a, **k))
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.load_delta(folders["d1"], delta_name="d1")
    for name in ("d2", "d3"):
        model.load_delta(folders[name], delta_name=name, resident=False)
    loads.clear()
    with torch.no_grad(), model.route(["d2", None]):
        outer = model.base_model(input_ids=IDS).logits
        assert not model.cache._inflight["d2"].handles  # each waiting hook removed itself once passed
        inner = model(input_ids=IDS, delta_names=["d2", "d3"]).logits
    assert loads == ["d2", "d3"]  # one load each
    assert torch.equal(outer, logits(reference, ["d2", None]))
    assert torch.equal(inner, logits(reference, ["d2", "d3"]))
    slots = {n: model.cache.slot_of(n) for n in ("d1", "d2", "d3")}
    assert None not in slots.values() and len(set(slots.values())) == 3
    assert all(model.cache.entry(n).holds == 0 for n in slots)
    assert not model.cache._inflight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cold_delta_read_beside_a_gpu_forward_and_generate_answers_as_preloaded(folders, dtype):
    """On the GPU the load thread's copies share the forward's stream: the same logits and tokens as the delta
    loaded before the call."""
    def make(cold):
        m = DeltaModel(copy.deepcopy(base_model("llama")).to("cuda", dtype))
        m.load_delta(folders["d1"], delta_name="d1")
        m.load_delta(folders["d2"], delta_name="d2", resident=not cold)
        m.cache.pipeline_piece_bytes = 1 << 10
        return m

    ids = IDS.cuda()
    ref = make(False)
    with torch.no_grad():
        want = ref(input_ids=ids, delta_names=["d2", "d1"]).logits.float()
        got = make(True)(input_ids=ids, delta_names=["d2", "d1"]).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    cold = make(True)
    assert torch.equal(cold.generate(ids, delta_names=["d2", "d1"], **kw), ref.generate(ids, delta_names=["d2", "d1"], **kw))
    assert cold.cache.entry("d2").holds == 0 and cold.cache.slot_of("d2") is not None


def test_cold_deltas_are_those_only_on_disk(folders):
    """``cold_deltas`` names what a pipelined load would read from disk: each delta whose state is "disk", in the
    order given, once; none with pipelined loads off; an unknown name is not its business."""
    model = DeltaModel(copy.deepcopy(base_model("llama")))
    model.configure_cache(max_resident=1, max_host_bytes=1 << 30)
    model.load_delta(folders["d1"], delta_name="d1")
    for name in ("d2", "d3"):
        model.load_delta(folders[name], delta_name=name, resident=False)
    cache = model.cache
    logits(model, ["d2", None])  # d2 comes in, d1 goes to the host tier
    states = {n: cache.state(n).value for n in ("d1", "d2", "d3")}
    assert states == {"d1": "host", "d2": "device", "d3": "disk"}
    names = ["d3", None, "d1", "d2", "d3", "nope"]
    assert cache.cold_deltas(names) == [n for n in dict.fromkeys(names) if n in states and states[n] == "disk"]
    cache.pipeline_loads = False
    assert cache.cold_deltas(names) == []
