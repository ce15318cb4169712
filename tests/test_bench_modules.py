"""CPU smoke tests of the benchmark scripts: quality (end to end on a tiny pair), the reconstructions
it compares at equal bytes, and the pure-Python pieces of decode, compress_speed and kernels."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from hf_deltazip.bench import budget, compress_speed, decode, kernels, pairs, quality
from hf_deltazip.compression import baselines as bl
from hf_deltazip.compression import lowrank
from hf_deltazip.compression.solver import storage_nbytes
from hf_deltazip.packing import packed_nbytes


def _delta(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g) @ torch.randn(16, k, generator=g) * 0.01 + torch.randn(n, k, generator=g) * 1e-3


# --------------------------------------------------------------------------- reconstructions at a budget
@pytest.mark.parametrize("method", ["RTN", "DARE", "SVD", "Delta-CoMe", "LR+residual"])
@pytest.mark.parametrize("bpw", [2.0, 1.0, 0.5])
def test_every_method_fits_its_byte_budget_and_beats_storing_nothing(method, bpw):
    d = _delta()
    budget = int(bpw * d.numel() / 8)
    try:
        rec = quality.reconstruct(method, d, budget)
    except ValueError as e:  # only RTN's bitmask cannot fit at 1 bit per weight and below
        assert method == "RTN" and bpw <= 1.0, e
        return
    assert 0 < rec.nbytes <= budget
    assert rec.nbytes >= 0.5 * budget, f"{method} left most of its budget unused"  # SVD: whole ranks
    if method == "DARE":  # unbiased, not small: kept values are scaled by 1 / (1 - p)
        kept = rec.delta != 0
        assert torch.allclose(rec.delta[kept], d[kept] * d.numel() / int(kept.sum()), rtol=1e-2)
    else:
        assert float((rec.delta - d).norm()) < float(d.norm())


def test_reconstruction_bytes_match_their_formulas():
    d = _delta()
    n, k = d.shape
    assert quality.reconstruct("sign+scale", d, 0).nbytes == n * packed_nbytes(k, 1) + 2
    svd = quality.reconstruct("SVD", d, 3 * (n + k) * 2 + 5)
    assert svd.nbytes == 3 * (n + k) * 2 and torch.linalg.matrix_rank(svd.delta) == 3
    dare = quality.reconstruct("DARE", d, 1000 * 2 + 8)  # seeded mask: 8 bytes, then 2 bytes a kept value
    assert dare.nbytes == 1000 * 2 + 8 and int((dare.delta != 0).sum()) == 1000
    mp = lowrank.mixed_precision_svd(d, 6000)
    ranks = [r for r in range(1, 97) if lowrank.mixed_precision_nbytes((n, k), [r, 2 * r, 4 * r, 8 * r]) <= 6000]
    assert mp.nbytes <= 6000 and ranks  # the bands of the largest fitting scale fit
    dense = lowrank.lowrank_plus_residual(d, 10**7)  # a budget that pays for a dense residual
    assert dense.nbytes == bl.svd_nbytes((n, k), min(n, k)) + storage_nbytes(n, k, bits=2) or dense.nbytes <= 10**7
    with pytest.raises(ValueError, match="unknown method"):
        quality.reconstruct("zip", d, 100)
    nothing = quality.reconstruct("SVD", d, 10)  # below one rank: the matrix's delta is dropped
    assert nothing.nbytes == 0 and not nothing.delta.any()


def test_rice_coded_positions_on_known_masks():
    m = torch.zeros(4, 8, dtype=torch.bool)
    m.view(-1)[:3] = True  # gaps 0, 0, 0: one stop bit each at p = 0
    assert lowrank.rice_nbytes(m) == 9 + 1
    m = torch.zeros(1, 64, dtype=torch.bool)
    m[0, [7, 15, 23, 31]] = True  # gaps of 7: p = 3 -> 4 bits each
    assert lowrank.rice_nbytes(m) == 9 + 2
    assert lowrank.rice_nbytes(torch.zeros(3, 3, dtype=torch.bool)) == 8


def test_delta_come_gives_top_directions_more_bits_than_plain_svd_at_equal_bytes():
    d = _delta(128, 256, seed=1)
    budget = int(1.0 * d.numel() / 8)
    mp, svd = quality.reconstruct("Delta-CoMe", d, budget), quality.reconstruct("SVD", d, budget)
    assert mp.nbytes <= budget and svd.nbytes <= budget
    assert (mp.delta - d).norm() < (svd.delta - d).norm()


# --------------------------------------------------------------------------- ladder, estimates, gains
def test_estimate_ratio_on_hand_computed_shapes():
    shapes = {"linear": [(64, 128)], "embedding": [(512, 64)], "params": 64 * 128 + 512 * 64 + 100, "exact": 400}
    settings = dict(bits=4, group_size=-1, embedding_bits=2, embedding_group_size=-1)
    lin = 64 * (128 // 2) + 64 * 3  # 4-bit codes + a 2-byte scale and a 1-byte zero point per row
    emb = 512 * (64 // 4) + 512 * 3
    assert quality.estimate_ratio(settings, shapes) == pytest.approx(2 * shapes["params"] / (lin + emb + 400))


def test_our_config_walks_the_ladder_and_is_the_one_switch():
    cfgs = [quality.our_config(r, n_samples=4) for r in (2, 4, 8, 48)]
    assert all(c.n_samples == 4 for c in cfgs)
    names = [quality.ladder_name(c) for c in cfgs]
    assert names[0] == "4-bit g128" and names[-1] == quality.OUR_LADDER[-1][0]
    bits = [c.bits for c in cfgs]
    assert bits == sorted(bits, reverse=True)
    with pytest.raises(ValueError, match="ratio must be > 1"):
        quality.our_config(1)
    # measured ratios (zstd included) take precedence over the estimate
    measured = {name: 10.0 * (i + 1) for i, (name, _) in enumerate(quality.OUR_LADDER)}
    assert quality.ladder_name(quality.our_config(21, measured=measured)) == quality.OUR_LADDER[1][0]
    assert quality.ladder_name(quality.our_config(8, measured=measured)) == quality.OUR_LADDER[0][0]


def test_gains_on_known_scores():
    base, ft = {"exact_match": 0.2, "task_nll": 3.0}, {"exact_match": 0.8, "task_nll": 1.0}
    g = quality.gains({"exact_match": 0.65, "task_nll": 1.5}, base, ft)
    assert g["gain_kept_em"] == pytest.approx(0.75) and g["gain_kept_nll"] == pytest.approx(0.75)
    g = quality.gains({"exact_match": 0.2, "task_nll": 2.0}, dict(base, exact_match=0.8), ft)
    assert "gain_kept_em" not in g and g["gain_kept_nll"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- quality end to end
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return pairs.build_pair(tmp_path_factory.mktemp("pair"), arch="llama", size="tiny", task="sort", base_steps=10,
                            ft_steps=30, n_eval=8)


def test_quality_end_to_end_on_a_tiny_pair(tiny_pair, tmp_path):
    result = quality.run_quality(tiny_pair, ratios=(4, 8), device="cpu", n_calibration=8, seq_len=32, log=lambda m: None)
    rows, p = result["rows"], result["pair"]
    fp16 = p["fp16_bytes"]
    assert fp16 == 2 * tiny_pair.info["finetuned_params"]
    at4 = [r for r in rows if r["target_ratio"] == 4]
    ours = next(r for r in at4 if r["method"] == "ours")
    assert ours["ratio"] == pytest.approx(fp16 / ours["bytes"]) and ours["ratio"] >= quality.REACH * 4
    for r in at4:  # equal bytes: every method within ours' bytes (RTN is our very layout)
        if r["method"] in ("DARE", "SVD", "Delta-CoMe", "LR+residual"):
            assert r["bytes"] <= ours["bytes"], r
            assert r["bytes"] >= 0.6 * ours["bytes"], r
    assert {r["method"] for r in at4} >= {"ours", "RTN", "DARE", "SVD", "Delta-CoMe", "LR+residual"}
    # 8x: beyond the fixed ladder on this pair; the other methods still run at that budget
    out = [r for r in rows if r["target_ratio"] == 8]
    assert [r["method"] for r in out if r.get("out_of_reach")] == ["ours"]
    assert {r["method"] for r in out if not r.get("out_of_reach")} >= {"DARE", "SVD", "Delta-CoMe", "LR+residual"}
    assert all(r["bytes"] <= fp16 / 8 for r in out if not r.get("out_of_reach"))
    sign = next(r for r in rows if r["method"] == "sign+scale")
    assert sign["bytes"] < ours["bytes"]  # 1 bit a weight, below ours at 4x
    # GPU-resident bytes beside the file's: RTN has our very layout and settings, so the same resident bytes
    rtn = next(r for r in at4 if r["method"] == "RTN")
    assert ours["resident_bytes"] > 0 and rtn["resident_bytes"] == ours["resident_bytes"]
    # the gain formula on the recorded scores
    b, f = p["base"]["task_nll"], p["finetune"]["task_nll"]
    for r in rows:
        if not r.get("out_of_reach"):
            assert r["gain_kept_nll"] == pytest.approx((b - r["task_nll"]) / (b - f))
            assert 0.0 <= r["agreement"] <= 1.0 and r["kl"] >= 0.0
    md = quality.to_markdown(result, "deltazip bench quality --pairs tiny")
    assert f"4× ours {ours['resident_bytes']:,d}" in md  # the resident bytes are in the Markdown too
    table, _, judged = md.partition("Ours against the best baseline")
    assert "| target | method |" in table and "commit" in table and table.count("\n| ") == len(rows) + 1
    # the verdict table below it: a header and one line per target where ours and a baseline both ran
    assert judged.count("\n| ") == len(quality.verdicts(result)) + 1 >= 2
    if quality.plot([result], tmp_path / "q.png"):
        assert (tmp_path / "q.png").stat().st_size > 1000


def test_quality_refuses_unknown_methods(tiny_pair):
    with pytest.raises(ValueError, match="unknown methods"):
        quality.run_quality(tiny_pair, methods=("ours", "gzip"), log=lambda m: None)


# --------------------------------------------------------------------------- decode, compress_speed, kernels
def test_decode_random_delta_has_the_stored_layout_and_generates_on_cpu():
    model = decode.build_base("tiny", "cpu").float()
    mods = decode.random_delta(model, bits=4, group_size=64, seed=0)
    assert len(mods) == 2 * 7
    for m in mods.values():
        n, k = m.shape
        assert tuple(m.qweight.shape) == (n, packed_nbytes(k, 4)) and tuple(m.scales.shape) == (n, k // 64)
    ids = torch.randint(0, 1000, (2, 5))
    assert decode.time_generate(model, ids, None, new_tokens=3, repeats=1) > 0


def test_decode_peft_baseline_runs_mixed_adapters_and_gives_the_base_back():
    pytest.importorskip("peft")
    model = decode.build_base("tiny", "cpu").float()
    before = {n: p.clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 1000, (3, 5))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    tps, back = decode.peft_generate(model, ids, adapters=2, rank=4, new_tokens=3)
    assert tps > 0
    # the adapters are gone: the same modules, the same weights, the same greedy output
    assert not any("lora" in n for n, _ in back.named_modules())
    assert {n: p for n, p in back.named_parameters()}.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in back.named_parameters())
    got = back.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_decode_bench_times_both_decode_routes_and_every_prefill_route(tmp_path, monkeypatch):
    # --decode-split on the CPU (kernels through the interpreter): each U row gets the split route's engine
    # tokens/s beside the fused one, and the model is back on the fused route afterwards
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_deltazip.modeling import DeltaModel

    routes = []
    real = DeltaModel.configure_kernels

    def spy(self, **kw):
        routes.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(DeltaModel, "configure_kernels", spy)
    out = tmp_path / "split.json"
    assert decode.main(["--shape", "tiny", "--device", "cpu", "--deltas", "1", "2", "--rows", "4", "--prompt-len", "8",
                        "--new-tokens", "2", "--engine-steps", "4", "--prefill-len", "4", "--decode-split",
                        "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = [r for r in result["decode"] if r["model"].startswith("DeltaModel")]
    assert [r["U"] for r in rows] == [1, 2] and all("engine_tokens_per_s_split" in r for r in rows)
    assert all(r[k] > 0 for r in rows for k in ("engine_tokens_per_s", "engine_tokens_per_s_fused",
                                                 "engine_tokens_per_s_split", "engine_tokens_per_s_split_triton"))
    assert all("engine_tokens_per_s_split_triton" in r for r in rows)  # the deltas by the Triton kernel too
    assert all("engine_tokens_per_s_fused" in r and r["auto_decode_route"] == "fused" for r in rows)  # no Gluon here
    # each route timed, then the model left on the default
    assert [kw["decode"] for kw in routes if "decode" in kw] == ["fused", "split", "auto"] * 2
    from hf_deltazip.kernels import multi_delta as md

    assert md._DEFAULT_BACKEND[0] == "auto"  # the kernel choice put back
    # the prefill table: 1 and 2 prompts of 4 tokens, every route timed, the model left on the default route,
    # which takes the fused kernel below 1024 tokens
    assert [kw["prefill"] for kw in routes if "prefill" in kw] == ["fused", "dequant", "split", "auto"] * 2
    assert [(r["requests"], r["auto_route"]) for r in result["prefill"]] == [(1, "fused"), (2, "fused")]
    assert all(r[f"{route}_ms"] > 0 for r in result["prefill"] for route in ("base", "fused", "dequant", "split"))


def test_decode_bench_times_the_engine_with_fused_norms_and_switches_them_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the norm kernel through the interpreter
    from hf_deltazip.serving import norms

    switched = []
    real = norms.use_fused_norms

    def spy(model, enable=True):
        n = real(model, enable)
        switched.append((enable, n))
        return n

    monkeypatch.setattr(norms, "use_fused_norms", spy)
    monkeypatch.setattr("hf_deltazip.serving.use_fused_norms", spy)
    out = tmp_path / "norms.json"
    assert decode.main(["--shape", "tiny", "--device", "cpu", "--deltas", "2", "--rows", "2", "--prompt-len", "6",
                        "--new-tokens", "2", "--engine-steps", "4", "--prefill-len", "0", "--fused-norms",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["decode"]
    assert [r["U"] for r in rows] == [0, 2]
    assert all(r["engine_tokens_per_s_fused_norms"] > 0 and r["engine_tokens_per_s"] > 0 for r in rows)
    # switched on and back for the base alone and for the delta model, the same norms each time
    assert [e for e, _ in switched] == [True, False, True, False] and len({n for _, n in switched}) == 1
    assert switched[0][1] > 0


def test_decode_cold_start_times_every_load_mode_from_a_real_file(tmp_path):
    # the cold-start bench end to end on the CPU: a .dz file written, read back six ways (pipelined or
    # whole, pinned or pageable host buffers, smaller pieces, two readers), each request answered, the temporary folder removed
    out = tmp_path / "cold.json"
    assert decode.main(["--shape", "tiny", "--device", "cpu", "--cold-start-only", "--workdir", str(tmp_path),
                        "--bits", "4", "--group-size", "64", "--json", str(out)]) == 0
    cold = json.loads(out.read_text())["cold_start"]
    modes = ("pipelined", "pipelined_no_overlap", "whole_file", "pipelined_page_cache", "pipelined_direct", "pipelined_pageable",
             "whole_file_pageable", "pipelined_64MB_pieces",
             "pipelined_1_reader")  # the cache reads with four threads by default; the bench times one too
    for mode in modes:
        run = cold[mode]
        assert run["request_to_first_token_s"] > 0 and 0 < run["load_s"] <= run["request_to_first_token_s"]
        assert run["x_sequential_read"] == pytest.approx(run["request_to_first_token_s"] / cold["disk_sequential_read_s"])
        assert run["x_fastest_read"] == pytest.approx(run["request_to_first_token_s"] / cold["fastest_read_s"])
    # page-cache reads are the cache's default: that mode is the headline's, not timed twice
    assert cold["pipelined_page_cache"]["same_as"] == "pipelined" and "same_as" not in cold["pipelined_direct"]
    assert cold["pipelined_page_cache"]["request_to_first_token_s"] == cold["pipelined"]["request_to_first_token_s"]
    # the disk's floor: the quicker of the plain read through the page cache and the direct read
    if cold["disk_direct_read_s"] is not None:
        assert cold["fastest_read_s"] == pytest.approx(min(cold["disk_sequential_read_s"], cold["disk_direct_read_s"]))
        assert cold["read_and_decompress_streamed_direct_4_readers_s"] > 0
    # the headline is the cache's default mode: pipelined, pinned; the median of three loads, each timed after
    # a plain read of the file, against the median read
    assert cold["request_to_first_token_s"] == cold["pipelined"]["request_to_first_token_s"]
    head = cold["pipelined"]
    assert len(head["runs_s"]) == len(head["disk_sequential_read_runs_s"]) == len(head["x_sequential_read_runs"]) == 3
    assert head["request_to_first_token_s"] == statistics.median(head["runs_s"])
    assert cold["disk_sequential_read_s"] == pytest.approx(statistics.median(head["disk_sequential_read_runs_s"]))
    assert head["x_sequential_read_runs"] == pytest.approx(
        [f / d for f, d in zip(head["runs_s"], head["disk_sequential_read_runs_s"])])
    assert cold["file_bytes"] > 0 and cold["bits"] == 4 and not list(tmp_path.glob("tmp*"))
    assert cold["read_and_decompress_streamed_s"] > 0 and cold["read_and_decompress_streamed_2_readers_s"] > 0


def test_budget_synthetic_finetune_changes_what_it_says():
    from hf_deltazip.bench.pairs import tiny_model

    base = tiny_model("llama", vocab_size=200, seed=0, hidden_size=64, num_layers=1)
    before = {n: p.clone() for n, p in base.named_parameters()}
    ft = budget.synthetic_finetune(base, embed_rows=0.05)
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())  # the base is left alone
    emb_name = next(n for n, p in base.named_parameters() if p is base.get_input_embeddings().weight)
    for (name, pb), pf in zip(base.named_parameters(), ft.parameters()):
        changed = (pf != pb).any(-1) if pb.ndim == 2 else (pf != pb)
        if name == emb_name:
            assert int(changed.sum()) == 10  # 5 % of 200 rows, the others exactly the base's
        else:
            assert bool(changed.all()), name
        if pb.ndim == 2 and name != emb_name:
            rel = float((pf - pb).std() / pb.std())
            assert 0.005 < rel < 0.05, name


def test_budget_lands_on_the_target_and_counts_every_byte_of_the_folder(tmp_path):
    from hf_deltazip.bench.pairs import tiny_model
    from hf_deltazip.compression import BudgetMeasurements

    base = tiny_model("llama", vocab_size=96, seed=0, hidden_size=128, num_layers=2)
    ft = budget.synthetic_finetune(base)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    shared = BudgetMeasurements()
    rows = [budget.land(base, ft, r, ids, tmp_path, measurements=shared, **quality.BUDGET_CANDIDATES) for r in (4.0, 8.0)]
    assert len(shared) > 0
    fp16 = 2 * sum(p.numel() for p in ft.parameters())
    for row in rows:
        folder = tmp_path / f"target-{row['target']:g}x"
        assert row["folder_bytes"] == sum(f.stat().st_size for f in folder.iterdir())
        assert row["reached"] == pytest.approx(fp16 / row["folder_bytes"])
        assert row["within_5_percent"] and abs(row["off"]) <= 0.05


def test_compress_speed_estimate_uses_the_mean_of_every_layer():
    steps = {"load": 1.0, "plan": 0.5, "embeddings": 2.0, "calibrate": 0.5, "package": 3.0, "layers": 99.0}
    before, per, est = compress_speed.estimate_seconds(steps, [4.0, 2.0, 3.0], 32)
    assert (before, per, est) == (4.0, 3.0, 4.0 + 32 * 3.0 + 3.0)
    with pytest.raises(ValueError, match="no layer"):
        compress_speed.estimate_seconds(steps, [])


def test_compress_speed_models_differ_by_a_small_delta():
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64)
    base, ft = compress_speed.build_models(1, "cpu", dtype=torch.float32, shape=shape)
    for (name, pb), pf in zip(base.named_parameters(), ft.parameters()):
        if pb.ndim < 2:  # norms start at one value: their noise is absolute (1e-6)
            assert 0 < float((pf - pb).abs().max()) < 1e-4, name
            continue
        rel = float((pf - pb).float().std() / (pb.float().std() + 1e-6))
        assert 0 < rel < 1e-2, name


def test_kernels_row_split_and_tables():
    gen = torch.Generator().manual_seed(0)
    rows = kernels._rows_for(10, 3, gen)
    assert sorted(torch.bincount(rows).tolist()) == [3, 3, 4]
    assert kernels._splits(10, 3) == [(0, 4), (4, 7), (7, 10)]
    res = [dict(N=64, K=128, M=16, U=16, format=fmt, config="c", us=us, GBps=100.0, read_share=0.5, share=0.4,
                floor_us=1.0, bf16_base_us=2.0, bf16_sep_us=32.0, int4_sep_us=None, speedup_vs_sep=32.0 / us,
                correct=True) for fmt, us in (("4b", 8.0), ("2b", 4.0))]
    report = {"meta": dict(gpu="X", sms=1, torch="t", triton="t", date="d", copy_GBps=200.0, read_GBps=180.0,
                           group_size=128), "results": res}
    md = kernels.markdown_table(report)
    assert "| 64x128 | 16 | 16 | 4b | c | 8.0 |" in md and "| 64x128 | c | 50-50 | 50-50 | 2.00 | 4.00 | 8.00 |" in md
    assert "fused / split" not in md  # no split-route rows, no split table
    res.append({**res[0], "config": "c|split", "us": 5.0, "speedup_vs_fused": 8.0 / 5.0})
    assert "| 64x128 | 16 | 16 | 4b | c | 8.0 | 5.0 | 1.60 |" in kernels.markdown_table(report)


def test_quality_with_the_byte_budget_for_ours(tiny_pair):
    """``ours="budget"``: ours at R is DeltaZipConfig(target_ratio=R), landing within 5 % of R; RTN keeps the
    chosen per-module settings; a ratio the budget cannot reach is reported with its reason, not raised."""
    # the tiny pair's header is most of its file: the budget reaches about 5.1-6.5x there
    partials = []
    result = quality.run_quality(tiny_pair, ratios=(6, 1000), methods=("ours", "RTN", "DARE"), device="cpu",
                                 n_calibration=8, seq_len=32, ours="budget", log=lambda m: None, on_row=partials.append)
    rows = result["rows"]
    # after every row the results so far, so a stopped run keeps what it measured
    assert partials and all(p["partial"] and p["rows"] == rows[:len(p["rows"])] for p in partials)
    assert [len(p["rows"]) for p in partials] == sorted({len(p["rows"]) for p in partials})  # one more row each time
    assert "partial" not in result and len(partials) == sum(not r.get("out_of_reach") for r in rows)
    ours6 = next(r for r in rows if r["target_ratio"] == 6 and r["method"] == "ours")
    assert ours6["setting"] == "budget 6x" and abs(ours6["ratio"] / 6 - 1) <= 0.05
    assert ours6["budget_weighting"] == "fisher"  # the default; the layouts chosen, counted per module
    assert sum(ours6["layouts"].values()) > 0 and set(ours6["layouts"]) <= {"dense", "rows", "bitmask", "2:4", "lowrank"}
    rtn6 = next(r for r in rows if r["target_ratio"] == 6 and r["method"] == "RTN")
    assert abs(rtn6["bytes"] / ours6["bytes"] - 1) < 0.1  # the same layout, only the solver differs
    far = next(r for r in rows if r["target_ratio"] == 1000 and r["method"] == "ours")
    assert far["out_of_reach"] and "out of reach" in far["reason"]
    assert "out of reach (target_ratio=1000" in quality.to_markdown(result, "cmd")


def test_quality_verdicts_against_the_best_baseline_on_known_rows():
    def row(target, method, em, kl, **kw):
        return {"target_ratio": target, "method": method, "gain_kept_em": em, "gain_kept_nll": 1.0, "kl": kl, **kw}

    rows = [row(16, "ours", 1.0, 0.01), row(16, "RTN", 1.0, 0.02), row(16, "Delta-CoMe", 1.0, 0.005),
            row(16, "DARE", 0.9, 0.001),  # lowest KL, but keeps less: not the best baseline
            row(32, "ours", 0.95, 0.3), row(32, "Delta-CoMe", 0.9, 0.2),
            row(48, "ours", 0.5, 1.0), row(48, "SVD", 0.6, 2.0),
            row(64, "ours", None, None, out_of_reach=True), row(64, "DARE", 0.1, 3.0),
            row(3, "sign+scale", 0.2, 4.0),
            {"target_ratio": 8, "method": "ours", "gain_kept_em": None, "gain_kept_nll": 0.99, "kl": 0.1},
            {"target_ratio": 8, "method": "RTN", "gain_kept_em": None, "gain_kept_nll": 0.98, "kl": 0.05}]
    got = {c["target_ratio"]: c for c in quality.verdicts({"rows": rows})}
    assert set(got) == {16, 32, 48, 8}  # no ours row at 64x, no baseline beside sign+scale
    # at 16x two baselines tie ours at 100 %: the best is the one with the lower KL, which beats ours'
    assert (got[16]["best"], got[16]["verdict"], got[16]["lowest_kl_method"]) == ("Delta-CoMe", "tie, higher KL", "DARE")
    assert (got[32]["verdict"], got[48]["verdict"]) == ("more", "less")
    assert (got[8]["ours"], got[8]["best_gain"], got[8]["verdict"]) == (0.99, 0.98, "more")  # NLL where EM has no gain
    rows[2]["kl"] = 0.05
    assert quality.verdicts({"rows": rows})[0]["verdict"] == "tie, lower KL"


def test_host_overhead_bench_times_every_layer_and_puts_the_kernel_back(monkeypatch):
    """bench.host_overhead swaps the Triton kernel for a launch that does nothing while it times the host
    work of each delta layer kind, then restores the kernel and the interpreter setting."""
    import os

    from hf_deltazip.bench import host_overhead
    from hf_deltazip.kernels import multi_delta

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real = multi_delta.triton_kernel
    rows = host_overhead.measure(hidden=256, calls=5)
    assert [r["layer"] for r in rows] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert all(r["delta_linear_us"] > 0 and r["nn_linear_us"] > 0 for r in rows)
    assert rows[1]["shape"] == [64, 256] and rows[6]["shape"] == [256, 512]
    assert multi_delta.triton_kernel is real and "TRITON_INTERPRET" not in os.environ
    with pytest.raises(ValueError, match="multiple of 256"):
        host_overhead.measure(hidden=100)


def test_host_overhead_counts_a_decode_steps_operations_with_either_norm_and_puts_the_kernel_back(tmp_path):
    """bench.host_overhead --step-ops: every norm of the step (two per layer and the last) runs as one counted launch
    with fused norms, the step computes seven operations fewer per norm (transformers' bfloat16 norm is eight), and
    the kernel functions are put back."""
    import json

    from hf_deltazip.bench import host_overhead
    from hf_deltazip.kernels import rms_norm as RN
    from hf_deltazip.serving import norms

    real = (RN.kernel_runs_on, RN._kernel, norms.kernel_runs_on)
    out = tmp_path / "ops.json"
    assert host_overhead.main(["--step-ops", "--layers", "2", "--rows", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    t, f = res["transformers"], res["fused"]
    assert t["norm_kernel_launches"] == 0 and f["norm_kernel_launches"] == f["norms_fused"] == 5
    assert t["computing"] - f["computing"] == 7 * 5  # eight operations per norm become one launch
    assert (RN.kernel_runs_on, RN._kernel, norms.kernel_runs_on) == real


def test_host_overhead_counts_a_prefills_operations_by_route_and_puts_the_kernel_back(monkeypatch, tmp_path):
    """bench.host_overhead --prefill-ops: each route launches one Triton kernel per linear layer whatever the number
    of prompts (the dequant route's deltas, one format class, written out in one launch), so the dequant route
    dispatches as many operations for three prompts on three deltas as for two; the kernel is put back."""
    import json
    import os

    from hf_deltazip.bench import host_overhead
    from hf_deltazip.kernels import multi_delta

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real = multi_delta.triton_kernel
    two = host_overhead.measure_prefill_ops(layers=1, deltas=2, tokens=4)
    out = tmp_path / "p.json"
    assert host_overhead.main(["--prefill-ops", "--layers", "1", "--prompts", "3", "--tokens", "4", "--json", str(out)]) == 0
    three = json.loads(out.read_text())
    assert two["fused"]["launches"] == {"planar_delta_linear_kernel": 7}
    assert two["dequant"]["launches"] == three["dequant"]["launches"] == {"planar_dequant_kernel": 7}
    assert two["dequant"]["computing"] == three["dequant"]["computing"]
    assert two["split"]["top"]["mm"] >= 7  # the base's own matmul per layer
    assert multi_delta.triton_kernel is real and "TRITON_INTERPRET" not in os.environ


def test_host_overhead_staging_stages_every_delta_into_kept_room_and_restores_the_cache(monkeypatch, tmp_path):
    """bench.host_overhead --staging: each host-tier delta is staged, evicting one or into free room, into room the
    stacks kept (the bench refuses a staging that did not start), the interpreter setting is put back, and the JSON
    has each time."""
    import json

    import os

    from hf_deltazip.bench import host_overhead

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = host_overhead.measure_staging(hidden=256, layers=2, deltas=3)
    assert res["modules"] == 14 and len(res["stage_ms"]) == len(res["free_room_ms"]) == 3
    assert all(t > 0 for t in res["stage_ms"] + res["free_room_ms"])
    # one more staging per setup, counted: every module's codes are copied into the stack
    for key in ("stage_ms", "free_room_ms"):
        ops = res["ops_per_stage"][key]
        assert ops["total"] >= ops["top"].get("copy_", 0) >= res["modules"]
    assert "TRITON_INTERPRET" not in os.environ
    out = tmp_path / "s.json"
    assert host_overhead.main(["--staging", "--layers", "1", "--deltas", "2", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["stage_ms"]) == 2


def test_host_overhead_repack_counts_both_routes(tmp_path):
    """bench.host_overhead --repack: the byte table (the GPU's route) dispatches 4 computing operations whatever
    the bits, the shifts (the CPU's) more, both timed; the JSON has a row per width and shape."""
    import json

    from hf_deltazip.bench import host_overhead

    rows = host_overhead.measure_repack(bits_list=(2, 4), shapes=((64, 1024),), repeats=1)
    assert [(r["bits"], r["shape"]) for r in rows] == [(2, [64, 1024]), (4, [64, 1024])]
    assert [r["table"]["computing_ops"] for r in rows] == [4, 4]
    assert [r["shifts"]["computing_ops"] for r in rows] == [17, 9]
    assert all(r[route]["cpu_ms"] > 0 for r in rows for route in ("table", "shifts"))
    out = tmp_path / "r.json"
    assert host_overhead.main(["--repack", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 6


def test_cllm_recipe_bench_trains_every_schedule_and_seed_and_summarises(tmp_path):
    """bench.cllm_recipe on the tiny pair: one run per schedule and seed, each scored, and per schedule the
    lowest and mean gain kept over its runs."""
    import json

    from hf_deltazip.bench import cllm_recipe

    out = tmp_path / "r.json"
    assert cllm_recipe.main(["--tiny", "--seeds", "0", "1", "--steps", "4", "--train-prompts", "3", "--eval-prompts",
                             "2", "--new-tokens", "8", "--block", "4", "--batch-size", "2", "--warmup", "1",
                             "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(x["schedule"], x["seed"]) for x in r["runs"]] == [("constant", 0), ("constant", 1), ("cosine", 0),
                                                                 ("cosine", 1)]
    for sched in ("constant", "cosine"):
        kept = [x["nll_kept"] for x in r["runs"] if x["schedule"] == sched]
        assert r["nll_kept"][sched] == pytest.approx({"runs": 2, "lowest": min(kept), "mean": sum(kept) / 2})
    assert all(x["tokens_per_forward"] >= 1.0 and len(x["losses"]) == 4 for x in r["runs"])
    # the distilled autoregressive loss: recorded with the run, and the first step's AR loss is the KL of the
    # fine-tune's copy from itself (0), where the labels' cross-entropy is not
    assert cllm_recipe.main(["--tiny", "--schedules", "cosine", "--seeds", "0", "--steps", "4", "--train-prompts", "3",
                             "--eval-prompts", "2", "--new-tokens", "8", "--block", "4", "--batch-size", "2",
                             "--ar-loss", "distill", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["args"]["ar_loss"] == "distill" and [x["seed"] for x in d["runs"]] == [0]
    assert d["runs"][0]["losses"][0][2] == pytest.approx(0.0, abs=1e-5) and r["runs"][2]["losses"][0][2] > 1e-3
    with pytest.raises(SystemExit):
        cllm_recipe.main(["--seeds", "0"])  # neither --pair nor --tiny


def test_decode_cold_start_takes_the_number_of_reader_threads(tmp_path, monkeypatch):
    from hf_deltazip.modeling.cache import DeltaCache

    used, direct, overlapped = [], [], []  # the readers, direct-read setting and thread of each streamed load
    real = DeltaCache._load_pipelined

    def load(self, *a, **k):
        import threading

        used.append(self.pipeline_readers)
        direct.append(self.pipeline_direct_io)
        overlapped.append(threading.current_thread().name == "deltazip-overlap")
        return real(self, *a, **k)

    monkeypatch.setattr(DeltaCache, "_load_pipelined", load)
    out = tmp_path / "cold.json"
    assert decode.main(["--shape", "tiny", "--device", "cpu", "--cold-start-only", "--workdir", str(tmp_path),
                        "--bits", "2", "--group-size", "64", "--pipeline-readers", "2", "--json", str(out)]) == 0
    cold = json.loads(out.read_text())["cold_start"]
    assert cold["read_and_decompress_streamed_4_readers_s"] > 0 and cold["pipeline_readers"] == 2
    assert cold["request_to_first_token_s"] == cold["pipelined"]["request_to_first_token_s"]
    assert "pipelined_1_reader" in cold  # the comparison row: one reader
    # pipelined (3 repeats), without overlap, direct, one reader, pageable, other pieces (page-cache reads
    # are the default, so that mode is the headline's, not loaded again): --pipeline-readers where not varied
    assert used == [2, 2, 2, 2, 2, 1, 2, 2]
    assert direct == [False] * 4 + [True] + [False] * 3  # the cache's default (3 repeats), then each way
    assert overlapped == [True] * 3 + [False] + [True] * 4  # read beside the prefill, but for the row without


def test_a_ratio_below_the_budgets_floor_scores_ours_at_its_most_accurate_delta(tiny_pair):
    """A target that leaves more bytes than the most accurate offered settings use: compress() refuses it with
    TargetRatioTooLowError and the ratio those settings reach; the bench then scores ours there (fewer bytes than
    the budget) and gives the baselines R's whole budget."""
    from hf_deltazip import TargetRatioTooLowError

    result = quality.run_quality(tiny_pair, ratios=(1.5,), methods=("ours", "RTN", "DARE"), device="cpu",
                                 n_calibration=8, seq_len=32, ours="budget", log=lambda m: None)
    rows = {r["method"]: r for r in result["rows"]}
    ours = rows["ours"]
    assert not ours.get("out_of_reach") and ours["target_ratio"] == 1.5
    assert ours["ratio"] > 1.5 * 1.05 and "most accurate offered" in ours["setting"]
    fp16 = ours["bytes"] * ours["ratio"]
    assert ours["bytes"] < rows["DARE"]["bytes"] <= fp16 / 1.5 and rows["DARE"]["bytes"] > 0.9 * fp16 / 1.5
    assert abs(rows["RTN"]["bytes"] / ours["bytes"] - 1) < 0.1  # our layout, without the solver
    # the error itself: a DeltaZipConfigError that carries the reachable ratio, named in its message
    from hf_deltazip import DeltaZipConfig, compress
    from hf_deltazip.errors import DeltaZipConfigError

    with pytest.raises(TargetRatioTooLowError) as info:
        compress(tiny_pair.base_dir, tiny_pair.finetuned_dir, DeltaZipConfig(target_ratio=1.5, **quality.BUDGET_CANDIDATES),
                 progress=False)
    assert isinstance(info.value, DeltaZipConfigError) and info.value.reachable > 1.5
    assert f"at least {info.value.reachable:.1f}" in str(info.value)


def test_decode_kernel_kinds_sort_the_kernels_a_step_launches():
    assert decode.kernel_kind("planar_delta_linear_kernel") == "delta kernels"
    assert decode.kernel_kind("sparse_delta_kernel") == "delta kernels"
    assert decode.kernel_kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "base matmuls (cuBLAS)"
    assert decode.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "base matmuls (cuBLAS)"
    assert decode.kernel_kind("void flash_fwd_splitkv_kernel<...>") == "attention"
    assert decode.kernel_kind("void at::native::elementwise_kernel<128, 2>") == "other"


def test_decode_profile_of_engine_steps_adds_up_on_cpu():
    from hf_deltazip import DeltaModel

    model = decode.build_base("tiny", "cpu").float()
    dm = DeltaModel(model)
    dm.add_delta(decode.random_delta(model, bits=4, group_size=64, seed=0), "d0")
    dm.add_delta(decode.random_delta(model, bits=4, group_size=64, seed=1), "d1")
    prof = decode.profile_engine_step(dm, ["d0", "d1", "d0"], rows=3, prompt_len=5, steps=2)
    assert prof["rows"] == 3 and prof["distinct_deltas"] == 2 and prof["cuda_graphs"] is False
    assert prof["wall_ms_per_step"] > 0 and prof["gpu_busy_ms_per_step"] > 0
    total = sum(v["ms_per_step"] for v in prof["by_kind"].values())
    assert total == pytest.approx(prof["gpu_busy_ms_per_step"], rel=1e-6)
    assert prof["top_kernels"] and prof["top_kernels"][0]["ms_per_step"] >= prof["top_kernels"][-1]["ms_per_step"]


def test_decode_profile_of_a_prefill_forward_adds_up_on_cpu():
    from hf_deltazip import DeltaModel

    model = decode.build_base("tiny", "cpu").float()
    dm = DeltaModel(model)
    dm.add_delta(decode.random_delta(model, bits=4, group_size=64, seed=0), "d0")
    ids = torch.randint(0, 100, (2, 6))
    prof = decode.profile_prefill(dm, ids, ["d0", None], calls=2)
    assert prof["rows"] == 2 and prof["tokens"] == 12 and prof["wall_ms_per_step"] > 0
    total = sum(v["ms_per_step"] for v in prof["by_kind"].values())
    assert total == pytest.approx(prof["gpu_busy_ms_per_step"], rel=1e-6)


@pytest.mark.parametrize("flag, levels", [
    ([], list(quality.LOWRANK_LEVELS)),               # left out: the default levels
    (["--lowrank"], list(quality.LOWRANK_LEVELS)),    # bare: the default levels too (it once meant none, silently)
    (["--lowrank", "none"], []),
    (["--lowrank", "0.25", "1"], [0.25, 1.0]),
])
def test_quality_cli_lowrank_levels(monkeypatch, flag, levels):
    seen = {}

    class Stop(Exception):
        pass

    def fake_run_quality(pair, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(quality, "_pairs", lambda args: ["pair"])
    monkeypatch.setattr(quality, "run_quality", fake_run_quality)
    with pytest.raises(Stop):
        quality.main(["--ours", "budget", "--ratios", "32", *flag])
    assert seen["lowrank"] == levels


@pytest.mark.parametrize("bad", [["--lowrank", "two"], ["--lowrank", "0"], ["--lowrank", "none", "0.5"]])
def test_quality_cli_refuses_bad_lowrank_levels(bad, capsys):
    with pytest.raises(SystemExit):
        quality.main(["--ours", "budget", *bad])
    assert "--lowrank" in capsys.readouterr().err


def test_decode_bench_refuses_fewer_engine_steps_than_it_warms_up():
    """Three engine steps warm up (graph capture) and are not timed: fewer than four would time none (the
    tokens per second came out negative)."""
    from hf_deltazip.bench import decode

    with pytest.raises(SystemExit):
        decode.main(["--shape", "tiny", "--device", "cpu", "--engine-steps", "3"])
    with pytest.raises(ValueError, match="at least 4 steps"):
        decode.engine_tokens_per_s(None, [None], 1, 4, 3)


def test_admission_bench_times_an_admission_idle_and_behind_a_step_in_flight(tmp_path):
    """bench.admission on the CPU: the admitted prompts are cancelled again so the busy rows keep decoding, the
    overlap mode launched steps ahead, and a row budget that cannot hold the prompts is refused."""
    from hf_deltazip.bench import admission

    out = tmp_path / "adm.json"
    assert admission.main(["--shape", "tiny", "--rows", "6", "--busy", "3", "--prompts", "2", "--prompt-len", "8",
                           "--deltas", "2", "--repeats", "2", "--device", "cpu", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["layers"], got["busy"], got["prompts"]) == (2, 3, 2) and "syncs" not in got  # sync sites: GPU only
    assert min(got["idle_ms"], got["gpu_busy_ms"], got["in_flight_ms"], got["step_ms"]) > 0
    assert got["ahead_steps"] > 0
    with pytest.raises(ValueError, match="do not fit --rows"):
        admission.measure("tiny", rows=4, busy=3, prompts=2, device="cpu")
