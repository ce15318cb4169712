"""One rank of tests/test_tensor_parallel.py, run as ``torchrun --nproc-per-node 2 tp_worker.py ROOT OUT``.

It loads the deltas over a base sharded with ``tp_plan="auto"`` (gloo on the CPU), runs what the test
compares with the single-process model, and saves each rank's results to ``OUT/rank<r>.pt``.
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from hf_deltazip import CompressedDelta, DeltaModel, DeltaZipError
from hf_deltazip.modeling.tensor_parallel import local_tensor
from hf_deltazip.serving import DecodeEngine


def refusal(fn):
    """``(error class, message)`` of what ``fn`` raised, or ``None`` when it did not refuse."""
    try:
        fn()
    except DeltaZipError as e:
        return type(e).__name__, str(e)
    return None


def main(root: Path, out: Path) -> None:
    spec = torch.load(root / "spec.pt")
    ids, rows = spec["ids"], spec["rows"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DeltaModel.from_pretrained(root / "a", base=root / "base", delta_name="a", dtype=torch.float32,
                                           tp_plan="auto")
    res_warnings = [str(w.message) for w in caught if "tp_plan" in str(w.message)]
    model.load_delta(root / "b", delta_name="b")
    res = {"world": dist.get_world_size(), "tp_plan_warnings": res_warnings}
    layer = model.base_model.model.layers[0]
    slot = model.cache.slot_of("a")
    res["shards"] = {name: (tuple(mod.packed[slot].shape), tuple(mod.base_layer.weight.to_local().shape))
                     for name, mod in [("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                                       ("down_proj", layer.mlp.down_proj)]}
    res["footprint"] = model.memory_footprint()
    embed = model.base_model.model.embed_tokens
    res["embedding"] = (tuple(embed.packed[slot].shape), tuple(local_tensor(embed.base_layer.weight).shape))
    res["lm_head"] = tuple(model.base_model.lm_head.packed[slot].shape)
    with torch.no_grad():
        res["logits"] = model(input_ids=ids, delta_names=rows).logits
        res["base_logits"] = model(input_ids=ids, delta_names=[None] * len(rows)).logits
    res["grad_logits"] = model(input_ids=ids, delta_names=rows).logits.detach()  # the base's own TP forward
    res["generate"] = model.generate(ids, delta_names=rows, max_new_tokens=6, do_sample=False, pad_token_id=0)
    res["wide"] = refusal(lambda: model.load_delta(root / "wide", delta_name="wide"))
    res["grown"] = refusal(lambda: model.load_delta(root / "grown", delta_name="grown"))
    res["engine"] = refusal(lambda: DecodeEngine(model, max_batch_size=4, max_length=64))
    res["inplace"] = refusal(lambda: model.merge_and_unload("a", inplace=True))
    merged = model.merge_and_unload("a")
    res["merged"] = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    res["merged_types"] = sorted({type(p).__name__ for p in merged.parameters()})
    with torch.no_grad():
        res["merged_logits"] = merged(input_ids=ids).logits
    # a delta added from memory routes like the same delta read from its folder
    model.add_delta(CompressedDelta.from_pretrained(root / "b"), "b-again")
    with torch.no_grad():
        res["added"] = model(input_ids=ids[[2, 2]], delta_names=["b", "b-again"]).logits
    model.save_pretrained(out / f"saved{dist.get_rank()}", selected_deltas=["b-again"])  # whole, not this rank's shard
    # Qwen2: q/k/v biases, which a fine-tune changes (exact parameters: a colwise rank keeps its rows);
    # Qwen3: q/k norms, replicated by the plan ("replicated_with_grad_allreduce"), which a fine-tune changes
    for arch in spec["archs"]:
        other = DeltaModel.from_pretrained(root / arch, base=root / f"{arch}-base", delta_name="d",
                                           dtype=torch.float32, tp_plan="auto")
        with torch.no_grad():
            res[f"{arch}_logits"] = other(input_ids=ids, delta_names=["d", None, None, "d"]).logits
        res[f"{arch}_merged"] = {k: v.detach().clone() for k, v in other.merge_and_unload("d").state_dict().items()}
    torch.save(res, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    dist.destroy_process_group()
