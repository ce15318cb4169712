"""``python -m hf_deltazip.bench.compress_speed``: how long compressing an 8B-shaped delta takes.

Speed needs real shapes, not trained weights: the base is a random Llama with the layer shapes of an
8B model (hidden 4096, MLP 14336, 32 query and 8 key/value heads, vocabulary 128256), and the
fine-tune is the base plus a random delta (std 1e-3 of each weight's std). Calibration is
``n_samples x seq_len`` random tokens. Every decoder layer of a Llama costs the same, so the
benchmark builds ``--layers`` of them (a full 32-layer pair needs 64 GB of host memory just to
exist) and reports the per-layer time and ``embeddings + 32 x per-layer`` as the estimate for the
whole model; ``--layers 32`` measures it directly where memory allows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)


def build_models(layers: int, device: str, dtype=torch.bfloat16, seed: int = 0, shape: dict = LLAMA_8B):
    """A random Llama of ``shape`` (default 8B's) with ``layers`` layers, and it plus a small random delta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, num_hidden_layers=layers, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        base = LlamaForCausalLM(cfg).to(dtype)
    with torch.device(device):
        ft = LlamaForCausalLM(cfg).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for (name, pb), pf in zip(base.named_parameters(), ft.parameters()):
            noise = torch.randn(pb.shape, generator=gen, device=device, dtype=torch.float32)
            pf.copy_((pb.float() + noise * (pb.float().std() * 1e-3 + 1e-6)).to(dtype))
    return base.to("cpu").eval(), ft.to("cpu").eval()


def estimate_seconds(steps: dict, layer_times: list, n_layers: int = 32) -> tuple[float, float, float]:
    """(seconds before the layers, mean seconds per layer, estimate for ``n_layers`` layers).

    The estimate is the steps before the layers + ``n_layers`` x the mean of *every* measured layer
    (the first, slower one included) + packaging.
    """
    if not layer_times:
        raise ValueError("no layer was timed: build at least one layer")
    before = sum(s for name, s in steps.items() if name in ("load", "plan", "embeddings", "exact_params", "calibrate"))
    per_layer = sum(layer_times) / len(layer_times)
    return before, per_layer, before + n_layers * per_layer + steps.get("package", 0.0)


def main(argv=None) -> int:
    from ..compression import compress
    from ..config import DeltaZipConfig

    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.compress_speed", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--n-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--sparsity", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    base, ft = build_models(args.layers, args.device)
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, base.config.vocab_size, (args.n_samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    cfg = DeltaZipConfig(bits=args.bits, group_size=args.group_size, n_samples=args.n_samples, seq_len=args.seq_len,
                         sparsity=args.sparsity if args.sparsity != "2:4" else "2:4")
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    layers, steps = [], {}
    t1 = time.perf_counter()
    delta = compress(base, ft, cfg, calibration=ids, device=args.device, batch_size=args.batch_size, progress=False,
                     on_layer=layers.append, on_step=steps.__setitem__)
    t2 = time.perf_counter()
    layer_times = [r.seconds for r in layers]
    before_layers, per_layer, estimate_32 = estimate_seconds(steps, layer_times, 32)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "layers_built": args.layers, "calibration": f"{args.n_samples} x {args.seq_len}",
        "config": f"{args.bits}-bit g{args.group_size} sparsity={args.sparsity}",
        "build_s": build_s, "total_s": t2 - t1, "steps_s": steps, "before_layers_s": before_layers, "layer_s": layer_times,
        "hessian_s": [r.hessian_seconds for r in layers], "solver_s": [r.solver_seconds for r in layers],
        "per_layer_s": per_layer, "estimate_32_layers_s": estimate_32, "peak_gpu_gib": peak,
        "packed_bytes": delta.summary["packed_bytes"],
    }
    print(json.dumps(result, indent=2))
    print(f"\n8B-shaped compression ({result['config']}, {result['calibration']} calibration tokens, {result['device']}):")
    print(f"  embeddings + calibration capture: {before_layers:.1f} s; per decoder layer: {per_layer:.1f} s "
          f"(measured on {args.layers} layers: {', '.join(f'{t:.1f}' for t in layer_times)})")
    print(f"  estimate for 32 layers: {estimate_32 / 60:.1f} min (target <= 10 min); peak GPU memory {peak:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
