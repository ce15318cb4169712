"""Deltas over a tensor-parallel base (``tp_plan="auto"``): two CPU ranks with gloo under torchrun.

Every rank's mixed-batch logits, greedy generations and merged model must equal the single-process
DeltaModel with the same deltas; each rank must hold only its shard of a sharded layer's delta; a delta
whose quantization groups straddle a row-parallel shard boundary, a fine-tune that adds tokens, the
decode engine and an in-place merge are refused with errors that say what to do instead. The worker
(tests/tp_worker.py) runs every scenario in one torchrun launch and saves each rank's results.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_deltazip import CompressedDelta, DeltaModel, DeltaZipConfig, compress
from hf_deltazip.delta import PackedModule
from hf_deltazip.modeling.tensor_parallel import TensorParallelError, TPShard

from model_factory import base_model, calibration_ids, finetune, matrix_finetune, matrix_model

ROWS = ["a", None, "b", "a"]
WORKER = Path(__file__).with_name("tp_worker.py")
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_archs() -> dict:
    """Qwen2 (q/k/v biases, changed by the fine-tune), Qwen3 (q/k norms, which the plan replicates) and Gemma
    (tied, scaled embeddings: the LM head shares the embedding's delta)."""
    return {"qwen2": (base_model("qwen2"), finetune("qwen2", 1)),
            "qwen3": (matrix_model("qwen3"), matrix_finetune("qwen3", 1)),
            "gemma": (matrix_model("gemma"), matrix_finetune("gemma", 1))}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    base_model("llama").save_pretrained(root / "base")
    settings = {"a": dict(bits=4, group_size=32),  # groups of 32: whole groups on each rank's 32 input columns
                "b": dict(bits=2, sparsity="2:4", group_size=-1),
                "wide": dict(bits=4, group_size=64)}  # o_proj's 64 inputs split 32/32: a group of 64 straddles
    for i, (name, kw) in enumerate(settings.items()):
        cfg = DeltaZipConfig(n_samples=8, seq_len=24, **kw)
        compress(base_model("llama"), finetune("llama", i + 1), cfg, calibration=calibration_ids(),
                 progress=False).save_pretrained(root / name)
    for arch, (base, tuned) in _other_archs().items():
        base.save_pretrained(root / f"{arch}-base")
        compress(base, tuned, DeltaZipConfig(n_samples=8, seq_len=24, bits=4, group_size=-1),
                 calibration=calibration_ids(), progress=False).save_pretrained(root / arch)
    compress(base_model("llama"), finetune("llama", 1, added_tokens=4), DeltaZipConfig(n_samples=8, seq_len=24, bits=4),
             calibration=calibration_ids(), progress=False).save_pretrained(root / "grown")
    ids = torch.randint(3, 90, (len(ROWS), 10), generator=torch.Generator().manual_seed(0))
    torch.save({"ids": ids, "rows": ROWS, "archs": list(_other_archs())}, root / "spec.pt")
    return root


@pytest.fixture(scope="module")
def ranks(root):
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(WORKER), str(root), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]


@pytest.fixture(scope="module")
def single(root):
    """The single-process reference: the same deltas over the whole base."""
    model = DeltaModel.from_pretrained(root / "a", base=root / "base", delta_name="a", dtype=torch.float32)
    model.load_delta(root / "b", delta_name="b")
    ids = torch.load(root / "spec.pt")["ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, delta_names=ROWS).logits
    gen = model.generate(ids, delta_names=ROWS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    merged = model.merge_and_unload("a")
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    return {"logits": logits, "generate": gen, "merged": merged.state_dict(), "merged_logits": merged_logits,
            "base_logits": model.base_model(input_ids=ids).logits.detach()}


def test_every_rank_computes_the_single_process_mixed_batch(ranks, single):
    for res in ranks:
        assert res["world"] == RANKS
        assert res["tp_plan_warnings"] == []  # tp_plan= goes to transformers as a DistributedConfig
        torch.testing.assert_close(res["logits"], single["logits"], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(res["base_logits"], single["base_logits"], atol=2e-5, rtol=1e-5)
        # with autograd on, a row-parallel layer runs the base's own forward and all-reduces its delta apart
        torch.testing.assert_close(res["grad_logits"], single["logits"], atol=2e-5, rtol=1e-5)
    # the deltas really change the rows they route (else equal logits would prove nothing)
    assert (single["logits"][0] - single["base_logits"][0]).abs().max() > 1e-3
    assert (single["logits"][2] - single["base_logits"][2]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma"])
def test_biases_norms_and_tied_embeddings_follow_the_plan(root, ranks, arch):
    model = DeltaModel.from_pretrained(root / arch, base=root / f"{arch}-base", delta_name="d", dtype=torch.float32)
    attn, slot = model.base_model.model.layers[0].self_attn, model.cache.slot_of("d")
    if arch == "gemma":  # the tied head carries the embedding's delta
        assert model.base_model.lm_head.packed[slot].kind == "embedding"
    else:  # the fine-tune's bias / norm weight, stored exactly
        assert (attn.q_proj if arch == "qwen2" else attn.q_norm).overrides[slot]
    ids = torch.load(root / "spec.pt")["ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, delta_names=["d", None, None, "d"]).logits
    merged = model.merge_and_unload("d").state_dict()
    for res in ranks:
        torch.testing.assert_close(res[f"{arch}_logits"], logits, atol=2e-5, rtol=1e-5)
        assert res[f"{arch}_merged"].keys() == merged.keys()
        for k, v in merged.items():
            assert torch.equal(res[f"{arch}_merged"][k], v), k


def test_an_in_memory_delta_is_sharded_like_the_same_delta_from_its_file(root, ranks):
    whole = CompressedDelta.from_pretrained(root / "b")
    for r, res in enumerate(ranks):
        assert torch.equal(res["added"][0], res["added"][1])
        saved = CompressedDelta.from_pretrained(root / "out" / f"saved{r}" / "b-again")
        assert saved.modules.keys() == whole.modules.keys()
        for name, p in whole.modules.items():
            assert torch.equal(saved.modules[name].dequantize(), p.dequantize()), name


def test_greedy_generate_with_delta_names_equals_single_process(ranks, single):
    for res in ranks:
        assert torch.equal(res["generate"], single["generate"])


def test_each_rank_keeps_only_its_shard_of_sharded_layers(root, ranks):
    for res in ranks:
        (q, q_base), (o, o_base), (down, down_base) = (res["shards"][n] for n in ("q_proj", "o_proj", "down_proj"))
        assert q == q_base and q[0] == 32  # colwise: half the 64 output rows
        assert o == o_base and o[1] == 32  # rowwise: half the 64 input columns
        assert down == down_base and down[1] * RANKS == 128
        # transformers 5.2x shards the embedding's vocabulary (embedding_rowwise): the delta follows; 5.17's
        # plan leaves it replicated: the delta stays whole
        assert res["embedding"] in [((48, 64), (48, 64)), ((96, 64), (96, 64))]
        assert res["lm_head"] == (48, 64)  # the gathered LM head: half the vocabulary rows, like its weight
    # each rank's bytes: about half the base and of each delta
    whole = DeltaModel.from_pretrained(root / "a", base=root / "base", delta_name="a", dtype=torch.float32)
    whole.load_delta(root / "b", delta_name="b")
    full = whole.memory_footprint()
    for res in ranks:
        fp = res["footprint"]
        assert 0.45 * full["base"] < fp["base"] < 0.75 * full["base"]
        share = 0.7 if res["embedding"][0][0] == 48 else 0.85  # a replicated embedding keeps its delta whole
        assert all(0.4 * full["deltas"][n] < fp["deltas"][n] < share * full["deltas"][n] for n in ("a", "b")), fp


def test_merge_and_unload_gathers_a_plain_model_equal_to_the_single_process_merge(ranks, single):
    for res in ranks:
        assert res["merged_types"] == ["Parameter"]  # plain tensors, no DTensor shards
        assert res["merged"].keys() == single["merged"].keys()
        for k, v in single["merged"].items():
            assert torch.equal(res["merged"][k], v), k
        torch.testing.assert_close(res["merged_logits"], single["merged_logits"], atol=1e-5, rtol=1e-5)
    assert ranks[0]["inplace"][0] == "TensorParallelError" and "inplace=False" in ranks[0]["inplace"][1]


def test_a_group_straddling_a_row_parallel_shard_is_refused_with_what_to_do(ranks):
    for res in ranks:
        kind, msg = res["wide"]
        assert kind == "TensorParallelError"
        assert "o_proj" in msg and "groups of 64" in msg and "group_size" in msg and "32" in msg


def test_a_fine_tune_that_adds_tokens_is_refused_and_told_to_load_without_tp_plan(ranks):
    for res in ranks:
        kind, msg = res["grown"]
        assert kind == "TensorParallelError" and "adds 4 tokens" in msg and "without tp_plan" in msg


def test_decode_engine_refuses_a_tensor_parallel_base_and_names_generate(ranks):
    for res in ranks:
        assert res["engine"] is not None and "DeltaModel.generate" in res["engine"][1]


# ------------------------------------------------------------------ shards of packed deltas, one process
def _packed(layout: str, n=8, k=32, bits=4, group=8, seed=0) -> PackedModule:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g)
    groups = -(-k // group) if group != -1 else 1
    scales = torch.rand(n, groups, generator=g) * 1e-2 + 1e-3
    zeros = torch.full((n, groups), 2 ** (bits - 1))
    mask = None
    if layout == "2:4":
        keep = torch.rand(n, k // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(n, k)
    elif layout == "bitmask":
        mask = torch.rand(n, k, generator=g) < 0.4
    elif layout == "rows":
        codes[::3] = 2 ** (bits - 1)  # rows equal to their zero point: not stored
    if mask is not None:
        codes = torch.where(mask, codes, zeros.repeat_interleave(group if group != -1 else k, 1)[:, :k])
    return PackedModule.from_codes(codes, scales, zeros, mask, bits=bits, group_size=group, symmetric=True,
                                   two_four=layout == "2:4", skip_zero_rows=layout == "rows")


@pytest.mark.parametrize("layout", ["dense", "2:4", "bitmask", "rows"])
@pytest.mark.parametrize("group", [8, -1])
def test_a_shard_dequantizes_to_exactly_its_block_of_the_whole_delta(layout, group):
    p = _packed(layout, group=group)
    whole = p.dequantize()
    for rank in range(2):
        rows = TPShard("m", "colwise", "rows", rank, 2, None, p.shape).take(p)
        cols = TPShard("m", "rowwise", "columns", rank, 2, None, p.shape).take(p)
        assert rows.sparsity == p.sparsity and cols.sparsity in (p.sparsity, "dense")
        assert torch.equal(rows.dequantize(), whole[4 * rank: 4 * rank + 4])
        assert torch.equal(cols.dequantize(), whole[:, 16 * rank: 16 * rank + 16])
        assert rows.scales.dtype == p.scales.dtype
        assert rows.nbytes < p.nbytes  # a packed shard, not a dense float copy
        # a shard placed again (after an eviction to the host) is not cut twice
        assert TPShard("m", "colwise", "rows", rank, 2, None, p.shape).take(rows) is rows


@pytest.mark.parametrize("k, group, fits", [(192, 128, "group_size=-1, or 32\\)"), (96, 64, "group_size=-1\\)")])
def test_a_shard_boundary_inside_a_group_is_refused_with_the_group_sizes_that_fit(k, group, fits):
    p = _packed("dense", k=k, group=group)  # over 2 ranks: k/2 columns each, a boundary inside a group
    with pytest.raises(TensorParallelError, match=rf"groups of {group} .*group_size that divides {k // 2} \({fits}"):
        TPShard("layers.0.o_proj", "rowwise", "columns", 0, 2, None, p.shape).take(p)
