"""``python -m hf_deltazip.bench.decode``: end-to-end decode speed with U deltas, and cold start.

Speed needs real shapes, not trained weights. The base is a random Llama with 8B shapes (or 1B
shapes with ``--shape 1b``) in bf16 on the GPU; each delta is random packed codes in the stored layout
(4-bit, group 128 by default) on every linear layer of every decoder block.

* **Decode:** ``generate`` of ``--new-tokens`` tokens for a batch of ``--rows`` rows spread evenly over
  U deltas (U = 1, 4, 16 by default), against the same batch through the plain base model (what one
  merged fine-tune costs). Tokens/s counts every row's new tokens. Eager mode: no CUDA graphs.
* **Cold start:** one delta saved as a real ``.dz`` folder; time from ``load_delta`` to the first
  token of a request that names it, with the page cache dropped first when the process may do so
  (root on Linux), plus bytes read and the decode rate of the file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # for a smoke test on the CPU
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_base(shape: str, device: str, layers=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def random_delta(model, bits: int, group_size: int, seed: int) -> dict:
    """name -> PackedModule of random codes for every linear layer in the decoder blocks."""
    from ..delta import PackedModule
    from ..modeling.arch import find_decoder_layers, linear_modules
    from ..packing import num_groups, packed_nbytes

    prefix, layers = find_decoder_layers(model)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for i, layer in enumerate(layers):
        for rel, mod in linear_modules(layer).items():
            rel = rel.replace(".base_layer", "")  # the layer may already carry delta wrappers
            n, k = mod.weight.shape
            g = num_groups(k, group_size)
            q = torch.randint(0, 256, (n, packed_nbytes(k, bits)), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
            scales = (torch.rand(n, g, generator=gen, device=device) * 2e-4 + 1e-4).to(torch.float16)
            zeros = torch.full((n, g), 1 << (bits - 1), dtype=torch.uint8, device=device)
            out[f"{prefix}.{i}.{rel}"] = PackedModule(kind="linear", shape=(n, k), bits=bits, group_size=group_size,
                                                     symmetric=True, sparsity="dense", transposed=False,
                                                     qweight=q, scales=scales, zeros=zeros)
    return out


def attach(dm, name: str, modules: dict) -> None:
    """Put an in-memory delta on a DeltaModel (the benchmark skips files for its U random deltas)."""
    slot = dm._free_slot()
    dm._attach(slot, modules, {}, {"extra": {}})
    dm._slots[name] = slot
    dm._info[name] = {"path": None, "config": None, "header": {}, "host": None, "validated": True,
                      "used": next(dm._clock), "nbytes": sum(p.nbytes for p in modules.values())}


def time_generate(model, ids, names, new_tokens, repeats=2):
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    if names is not None:
        kwargs["delta_names"] = names
    model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up, kernel compilation
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync()
        best = min(best, time.perf_counter() - t)
    return best


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cold_start(dm_factory, modules, workdir: Path, prompt_len: int) -> dict:
    """Save one delta as a .dz folder, then time load_delta -> first token with a cold page cache."""
    from ..config import DeltaZipConfig
    from ..delta import CompressedDelta
    from ..fingerprint import base_fingerprint

    dm = dm_factory()
    cpu_modules = {n: p.__class__(**{**p.__dict__, "qweight": p.qweight.cpu(), "scales": p.scales.cpu(), "zeros": p.zeros.cpu()})
                   for n, p in modules.items()}
    header = {"base_model": "random-8b", "model_type": "llama", "base_fingerprint": base_fingerprint(dm._plain_params()),
              "extra": {"finetune_num_params": sum(p.numel() for p in dm.base_model.parameters())}}
    delta = CompressedDelta(config=DeltaZipConfig(bits=4, group_size=128, zstd_level=1), modules=cpu_modules, header=header)
    folder = workdir / "cold-delta"
    t = time.perf_counter()
    delta.save_pretrained(folder)
    save_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in folder.iterdir())
    dropped = drop_page_cache()
    ids = torch.randint(0, 1000, (1, prompt_len), device=next(dm.parameters()).device)
    _sync()
    t0 = time.perf_counter()
    dm.load_delta(folder, delta_name="cold")
    _sync()
    t1 = time.perf_counter()
    dm.generate(ids, attention_mask=torch.ones_like(ids), delta_names=["cold"], max_new_tokens=1, do_sample=False, pad_token_id=0)
    _sync()
    t2 = time.perf_counter()
    return {"file_bytes": size, "save_s": save_s, "page_cache_dropped": dropped, "load_s": t1 - t0,
            "first_token_s": t2 - t1, "request_to_first_token_s": t2 - t0, "read_and_decode_GBps": size / (t1 - t0) / 1e9}


def main(argv=None) -> int:
    from ..modeling import DeltaModel

    p = argparse.ArgumentParser(prog="python -m hf_deltazip.bench.decode", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape has (quick runs)")
    p.add_argument("--deltas", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--cold-start", action="store_true")
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this benchmark is meant for one (--device cpu --shape tiny is a smoke test)")

    base = build_base(args.shape, args.device, args.layers)
    ids = torch.randint(0, 1000, (args.rows, args.prompt_len), device=args.device)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "shape": args.shape, "layers": base.config.num_hidden_layers,
              "rows": args.rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "format": f"{args.bits}-bit g{args.group_size}", "decode": []}
    t = time_generate(base, ids, None, args.new_tokens)
    result["decode"].append({"model": "base alone (one merged fine-tune)", "U": 0, "s": t,
                             "tokens_per_s": args.rows * args.new_tokens / t})
    print(f"base alone: {args.rows * args.new_tokens / t:8.1f} tokens/s ({t:.2f} s)", flush=True)
    dm = DeltaModel(base)
    made = 0
    for u in sorted(args.deltas):
        while made < u:
            attach(dm, f"d{made}", random_delta(base, args.bits, args.group_size, seed=made))
            made += 1
        names = [f"d{i % u}" for i in range(args.rows)]
        t = time_generate(dm, ids, names, args.new_tokens)
        mem = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        result["decode"].append({"model": f"DeltaModel, {u} deltas", "U": u, "s": t,
                                 "tokens_per_s": args.rows * args.new_tokens / t, "gpu_gib": mem})
        print(f"U={u:3d}: {args.rows * args.new_tokens / t:8.1f} tokens/s ({t:.2f} s), GPU memory {mem:.1f} GiB", flush=True)
    if args.cold_start:
        for n in list(dm._slots):
            dm.delete_delta(n)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
            result["cold_start"] = cold_start(lambda: dm, random_delta(base, args.bits, args.group_size, seed=999), Path(d), args.prompt_len)
        print("cold start:", json.dumps(result["cold_start"]), flush=True)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
