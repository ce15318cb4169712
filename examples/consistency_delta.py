"""Make a consistency delta: a fine-tune retrained to decode in fewer Jacobi steps, stored over its base.

    # your pair: transformers folders, and a file of the fine-tune's own prompts (one per line)
    python examples/consistency_delta.py --base ./base --finetune ./ft --prompts prompts.txt --out ./ft-cllm

    # a tiny pair built on the spot (a model fine-tuned to count), on the CPU in about a minute
    python examples/consistency_delta.py --demo --out /tmp/cllm-demo

Then serve it like any delta, with Jacobi decoding turned on per call:

    model = DeltaModel.from_pretrained("./ft-cllm/delta", base="./base")
    model.generate(ids, decoding="jacobi", jacobi_block_size=16, max_new_tokens=256)
"""

import argparse
import json
from pathlib import Path

import torch

from hf_deltazip import DeltaZipConfig
from hf_deltazip.cllm import ConsistencyConfig, consistency_delta


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the base model folder")
    p.add_argument("--finetune", help="the fine-tune folder (with its tokenizer)")
    p.add_argument("--prompts", help="the fine-tune's prompts, one per line (about a hundred: with 32 the "
                                     "consistency model overfit them and lost part of the task)")
    p.add_argument("--eval", help="held-out text of the fine-tune's domain, one per line (for the gain kept)")
    p.add_argument("--demo", action="store_true", help="build a tiny counting pair instead")
    p.add_argument("--out", required=True, help="the trained model goes to OUT/model, the delta to OUT/delta")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-5)
    args = p.parse_args()

    if args.demo:
        from hf_deltazip.bench.jacobi import counting_prompts, tiny_pair

        base, ft = tiny_pair()
        prompts, eval_ids, gen = counting_prompts(2, 4, seed=500), counting_prompts(4, 20, seed=900), {"pad_token_id": 0}
        config = ConsistencyConfig(block_size=8, max_new_tokens=16, steps=35, batch_size=8, lr=6e-3, consistency_weight=2.0,
                                lr_schedule="constant", warmup_steps=0)
        delta_config = DeltaZipConfig(bits=args.bits, group_size=32, seq_len=24)
    else:
        if not (args.base and args.finetune and args.prompts):
            p.error("pass --base, --finetune and --prompts (or --demo)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = "cuda" if torch.cuda.is_available() else "cpu"
        tok = AutoTokenizer.from_pretrained(args.finetune)
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).to(device).eval()
        ft = AutoModelForCausalLM.from_pretrained(args.finetune, dtype=torch.float32).to(device).eval()

        def lines(path):
            return [tok(t)["input_ids"] for t in Path(path).read_text().splitlines() if t.strip()]

        prompts = lines(args.prompts)
        eval_ids = lines(args.eval) if args.eval else None
        gen = {"pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
        config = ConsistencyConfig(block_size=args.block, max_new_tokens=args.new_tokens, steps=args.steps, lr=args.lr)
        delta_config = DeltaZipConfig(bits=args.bits)

    report = consistency_delta(base, ft, prompts, eval_ids=eval_ids, config=config, delta_config=delta_config,
                               output_dir=args.out, log=print, **gen)
    print(report.summary())
    Path(args.out, "report.json").write_text(json.dumps(report.as_dict(), indent=2))


if __name__ == "__main__":
    main()
