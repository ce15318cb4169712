"""``python -m hf_deltazip.bench.decode``: end-to-end decode speed with U deltas, and cold start.

Speed needs real shapes, not trained weights. The base is a random Llama with 8B shapes (or 1B
shapes with ``--shape 1b``) in bf16 on the GPU; each delta is random packed codes in the stored layout
(4-bit, group 128 by default) on every linear layer of every decoder block.

* **Decode:** ``--rows`` rows spread evenly over U deltas (U = 1, 4, 16 by default), against the same
  batch through the plain base model (what one merged fine-tune costs), two ways: ``generate`` in eager
  mode (``--new-tokens`` tokens), and :class:`~hf_deltazip.serving.DecodeEngine` decode steps (static KV
  cache, CUDA graphs). Tokens/s counts every row's new tokens.
* **Cold start:** one delta saved as a real ``.dz`` folder and registered without loading it; with the
  file's pages evicted from the page cache, the time from a request naming it to that request's first
  token (read, decompress, upload into the kernel stack, prefill), on an engine already serving another
  delta. Also: bytes read, the file's plain sequential read speed with a cold cache (the disk's floor),
  the same read past the page cache (``O_DIRECT``, four 4 MB reads in flight; ``x_fastest_read`` is
  against the quicker of the two), and the read+decompress rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    # Gemma 3 270M's shapes (the real pairs' base) on a Llama block: where eager per-layer launch work shows
    "270m": dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # for a smoke test on the CPU
}


#: the linear layers a LoRA adapter of the PEFT baselines covers: every one of a Llama block
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


def _warm_engine(model, names, rows: int, prompt_len: int, steps: int, cuda_graphs=None):
    """A DecodeEngine with ``rows`` random prompts admitted (row i on delta ``names[i]``), room for ``steps``
    more decode steps, and three steps already run (graph capture, warm-up)."""
    from ..serving import DecodeEngine

    engine = DecodeEngine(model, max_batch_size=rows, max_length=prompt_len + steps + 8, cuda_graphs=cuda_graphs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    engine.add(prompts, names, max_new_tokens=steps + 1)
    for _ in range(3):  # capture and warm up
        engine.step()
    _sync()
    return engine


def _timed_steps(engine, steps: int) -> float:
    """Seconds for ``steps`` decode steps of ``engine``."""
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return time.perf_counter() - t


MIN_ENGINE_STEPS = 4  # three warm-up steps and at least one timed


def _engine_steps(text: str) -> int:
    n = int(text)
    if n < MIN_ENGINE_STEPS:
        raise argparse.ArgumentTypeError(f"at least {MIN_ENGINE_STEPS} (three warm-up steps and one timed), got {n}")
    return n


def fused_norms_tokens_per_s(model, names, rows: int, prompt_len: int, steps: int) -> float:
    """:func:`engine_tokens_per_s` with the model's RMSNorms in one launch each (``serving.use_fused_norms``),
    switched back afterwards."""
    from ..serving import use_fused_norms

    if not use_fused_norms(model):
        raise ValueError("the model has no Llama-style RMSNorm to fuse")
    try:
        return engine_tokens_per_s(model, names, rows, prompt_len, steps)
    finally:
        use_fused_norms(model, enable=False)


def engine_tokens_per_s(model, names, rows: int, prompt_len: int, steps: int) -> float:
    """Decode tokens/s of ``rows`` rows through a DecodeEngine (CUDA graphs on a GPU), prefill excluded: ``steps``
    steps, of which the first three warm up (graph capture) and the rest are timed."""
    if steps < MIN_ENGINE_STEPS:
        raise ValueError(f"engine timing needs at least {MIN_ENGINE_STEPS} steps (three warm-up steps and one timed), "
                         f"got {steps}")
    engine = _warm_engine(model, names, rows, prompt_len, steps)
    return rows * (steps - 3) / _timed_steps(engine, steps - 3)


#: kernel-name patterns of :func:`profile_calls`' kinds, first match wins
KERNEL_KINDS = (
    ("delta kernels", ("multi_delta", "delta_", "_planar", "act_sparse", "segment")),
    ("attention", ("attn", "attention", "flash", "sdpa", "softmax")),
    ("base matmuls (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def profile_calls(fn, calls: int, on_gpu: bool, top: int = 12) -> dict:
    """GPU time of ``calls`` calls of ``fn`` under ``torch.profiler``, per call: summed by kernel kind
    (:data:`KERNEL_KINDS`) and by kernel name (the ``top`` largest). On a CPU (a smoke test) the same for
    the host's operators, by each one's own time so nested operators are not counted twice."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    by_name: dict = {}
    for ev in prof.events():
        if on_gpu and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(ev, "device_time_total", 0) if on_gpu else ev.self_cpu_time_total
        d = by_name.setdefault(ev.name, [0.0, 0])
        d[0] += us
        d[1] += 1
    kinds: dict = {}
    for name, (us, n) in by_name.items():
        k = kinds.setdefault(kernel_kind(name), [0.0, 0])
        k[0] += us
        k[1] += n
    return {
        "gpu_busy_ms_per_step": sum(v[0] for v in by_name.values()) / calls / 1e3,
        "by_kind": {k: {"ms_per_step": v[0] / calls / 1e3, "launches_per_step": v[1] / calls}
                    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
        "top_kernels": [{"name": n[:120], "ms_per_step": v[0] / calls / 1e3, "launches_per_step": v[1] / calls}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def profile_engine_step(model, names, rows: int, prompt_len: int, steps: int = 16, cuda_graphs=None) -> dict:
    """Where one DecodeEngine decode step's GPU time goes (:func:`profile_calls` over ``steps`` steps after
    warm-up), against the step's wall time measured on its own without the profiler."""
    engine = _warm_engine(model, names, rows, prompt_len, 3 * steps + 8, cuda_graphs)
    wall_ms = 1e3 * _timed_steps(engine, steps) / steps
    prof = profile_calls(engine.step, steps, engine.device.type == "cuda")
    return {"rows": rows, "distinct_deltas": len(set(n for n in (names or []) if n is not None)),
            "cuda_graphs": engine.cuda_graphs, "wall_ms_per_step": wall_ms, **prof}


def profile_prefill(model, ids, names, calls: int = 3) -> dict:
    """Where one prefill forward's GPU time goes (row i with delta ``names[i]``; no KV cache kept), as
    :func:`profile_calls` gives it, with its median wall time from :func:`prefill_ms`."""
    kw = {} if names is None else {"delta_names": names}
    wall = prefill_ms(model, ids, names, repeats=calls)

    def forward():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, **kw)

    return {"rows": ids.shape[0], "tokens": ids.numel(), "wall_ms_per_step": wall,
            **profile_calls(forward, calls, ids.device.type == "cuda")}


def print_profile(label: str, prof: dict) -> None:
    graphs = f" (cuda graphs {prof['cuda_graphs']})" if "cuda_graphs" in prof else ""
    print(f"profile, {label}: wall {prof['wall_ms_per_step']:.2f} ms/step, GPU busy {prof['gpu_busy_ms_per_step']:.2f} "
          f"ms/step{graphs}", flush=True)
    for k, v in prof["by_kind"].items():
        print(f"  {k:24s} {v['ms_per_step']:8.3f} ms/step  {v['launches_per_step']:7.1f} launches", flush=True)
    for v in prof["top_kernels"]:
        print(f"    {v['ms_per_step']:8.3f} ms  x{v['launches_per_step']:6.1f}  {v['name']}", flush=True)


def prefill_ms(model, ids, names, repeats: int = 5) -> float:
    """Median milliseconds of one forward over ``ids`` (a prefill, no KV cache kept), row i with delta ``names[i]``."""
    kw = {} if names is None else {"delta_names": names}
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):  # the first one compiles
            _sync()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False, **kw)
            _sync()
            if i:
                times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def time_generate(model, ids, names, new_tokens, repeats=2, names_kwarg="delta_names"):
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    if names is not None:
        kwargs[names_kwarg] = names
    model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up, kernel compilation
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync()
        best = min(best, time.perf_counter() - t)
    return best


def peft_generate(base, ids, adapters: int, rank: int, new_tokens: int):
    """``(tokens/s, base)``: PEFT's mixed-adapter ``generate`` with ``adapters`` LoRA adapters (rank ``rank``,
    every linear layer of every block, random A and B), row i using adapter i % adapters, on ``base``.

    What Hugging Face users run today for many fine-tunes in one batch. The adapters are removed
    afterwards (``unload``), so the returned base is the plain model again.
    """
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, init_lora_weights=False)
    names = [f"a{i}" for i in range(adapters)]
    dtype = next(base.parameters()).dtype
    torch.manual_seed(0)
    pm = get_peft_model(base, lora, adapter_name=names[0])
    for n in names[1:]:
        pm.add_adapter(n, lora)
    pm.to(dtype=dtype).eval()
    rows = [names[i % adapters] for i in range(ids.shape[0])]
    with torch.no_grad():
        t = time_generate(pm, ids, rows, new_tokens, repeats=1, names_kwarg="adapter_names")
    return ids.shape[0] * new_tokens / t, pm.unload()


def drop_page_cache() -> bool:
    """Drop the whole page cache (needs root on Linux); ``False`` when not allowed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_file(path) -> bool:
    """Ask the kernel to drop ``path``'s pages from the page cache; ``False`` where that is not supported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def evict_from_page_cache(paths) -> str:
    """Make the next read of ``paths`` come from the disk. Returns how (for the report)."""
    if drop_page_cache():
        return "drop_caches"
    return "posix_fadvise(DONTNEED)" if all([evict_file(p) for p in paths]) else "not evicted"


def sequential_read_GBps(path: Path) -> float:
    """Plain sequential read of a file with a cold page cache: the disk's floor for a cold start."""
    evict_from_page_cache([path])
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                break
            n += got
    return n / (time.perf_counter() - t) / 1e9


def direct_sequential_read_GBps(path: Path, threads: int = 4, io_bytes: int = 4 << 20) -> Optional[float]:
    """The same read past the page cache (``O_DIRECT``), ``threads`` reads of ``io_bytes`` in flight at once,
    into page-aligned buffers; ``None`` where the OS or file system refuses direct reads."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return None
    evict_from_page_cache([path])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    size = os.fstat(fd).st_size
    bufs = [mmap.mmap(-1, io_bytes) for _ in range(threads)]  # page-aligned
    offsets = iter(range(0, size, io_bytes))
    lock = threading.Lock()

    def read(buf):
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            os.preadv(fd, [buf], off)

    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, bufs))
        return size / (time.perf_counter() - t) / 1e9
    except OSError:
        return None
    finally:
        os.close(fd)


def cold_start(dm, modules, workdir: Path, prompt_len: int, warm_name: str, bits: int = 4,
               readers: Optional[int] = None, repeats: int = 3) -> dict:
    """Save one delta as a .dz folder, register it, evict it from the page cache, then time a request.

    The cache's own setting (the headline) is timed ``repeats`` times, each after a plain read of the file
    (both move from one read to the next on a shared disk; medians are reported, with every run), then the
    other settings once each (a mode whose settings are the cache's defaults again is reported as the mode it
    equals, ``same_as``, not timed twice): pipelined loads (each piece of the file placed while the rest is read, the
    request's prefill beside the read: ``DeltaCache.overlap_loads``; also without that overlap) and
    whole-file loads, decoding into pinned and into pageable host memory (``DeltaCache.pinned_loads``);
    the pipelined load also through the page cache and past it (``pipeline_direct_io``), with other pieces
    (64 MB, or 16 MB where 64 MB is the cache's setting) and with one reader thread (two where the setting
    is one). Each is reported against the median plain read (``x_sequential_read``; the target is <= 1.2)
    and against the quicker of that and a direct read (``x_fastest_read``). The read alone is timed six
    ways: every tensor on its own thread (pinned and pageable, as the whole-file load reads) and streamed
    (pieces read front to back, the checks beside them, as the pipelined load reads) with 1, 2 and 4
    readers, and with 4 direct readers.
    """
    from ..config import DeltaZipConfig
    from ..delta import CompressedDelta
    from ..serving import DecodeEngine
    from ..fingerprint import base_fingerprint
    from ..format import DZ_FILENAME, DeltaZipFile

    cpu_modules = {n: p.__class__(**{**p.__dict__, "qweight": p.qweight.cpu(), "scales": p.scales.cpu(), "zeros": p.zeros.cpu()})
                   for n, p in modules.items()}
    # the base's weights under their own names: loaded deltas have wrapped its layers (``.base_layer.``)
    plain = {n.replace(".base_layer.", "."): p for n, p in dm.base_model.named_parameters()}
    header = {"base_model": "random-base", "model_type": "llama", "base_fingerprint": base_fingerprint(plain),
              "extra": {"finetune_num_params": sum(p.numel() for p in dm.base_model.parameters())}}
    delta = CompressedDelta(config=DeltaZipConfig(bits=bits, group_size=128, zstd_level=1), modules=cpu_modules, header=header)
    folder = workdir / "cold-delta"
    t = time.perf_counter()
    delta.save_pretrained(folder)
    save_s = time.perf_counter() - t
    del cpu_modules, delta
    dz = folder / DZ_FILENAME
    size = dz.stat().st_size
    disk = sequential_read_GBps(dz)
    direct = direct_sequential_read_GBps(dz)
    # read + decompress alone, cold
    evict_from_page_cache([dz])
    t = time.perf_counter()
    with DeltaZipFile(dz) as f:
        tensors = f.read_tensors(pin_memory=torch.cuda.is_available())
    read_s = time.perf_counter() - t
    del tensors
    evict_from_page_cache([dz])  # the same into pageable memory: what pinning the host buffers costs
    t = time.perf_counter()
    with DeltaZipFile(dz) as f:
        tensors = f.read_tensors(pin_memory=False)
    read_unpinned_s = time.perf_counter() - t
    del tensors
    # the streamed reader of the pipelined load (pieces read front to back, checks beside them) with 1, 2 and 4
    # pieces read at once; the pinned blocks page-locked first, as the cache does when a cold delta is registered
    if torch.cuda.is_available():
        blocks = [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
        del blocks
    streamed = {}
    for n, how in ((1, False), (2, False), (4, False), (4, True)):
        evict_from_page_cache([dz])
        t = time.perf_counter()
        with DeltaZipFile(dz) as f:
            for piece in f.stream_tensors(pin_memory=torch.cuda.is_available(), readers=n, direct_io=how):
                del piece
        streamed[n, how] = time.perf_counter() - t
    device = next(dm.parameters()).device
    engine = DecodeEngine(dm, max_batch_size=4, max_length=prompt_len + 16)
    prompt = torch.randint(0, 1000, (prompt_len,)).tolist()
    engine.run([prompt], [warm_name], max_new_tokens=4)  # the engine is up and its kernels are compiled
    # the cache's settings a load is timed with: its own (the headline), and each mode below changing some
    knobs = ("pipeline_loads", "pinned_loads", "pipeline_piece_bytes", "pipeline_readers", "pipeline_direct_io",
             "overlap_loads")
    saved = {k: getattr(dm.cache, k) for k in knobs}
    # --pipeline-readers: the cache's pipelined loads read with this many threads
    default = {**saved, "pipeline_readers": readers or saved["pipeline_readers"]}
    readers = default["pipeline_readers"]
    other_readers = 1 if readers != 1 else 2
    other_piece = (64 << 20) if default["pipeline_piece_bytes"] != (64 << 20) else (16 << 20)
    pipelined = dict(pipeline_loads=True, pinned_loads=True)
    modes = {
        "pipelined": pipelined,
        "pipelined_no_overlap": {**pipelined, "overlap_loads": False},  # the prefill waits for the whole delta
        "whole_file": dict(pipeline_loads=False, pinned_loads=True),
        "pipelined_page_cache": {**pipelined, "pipeline_direct_io": False},
        "pipelined_direct": {**pipelined, "pipeline_direct_io": True},
        f"pipelined_{other_readers}_reader" + ("s" if other_readers > 1 else ""):
            {**pipelined, "pipeline_readers": other_readers},
        "pipelined_pageable": dict(pipeline_loads=True, pinned_loads=False),
        "whole_file_pageable": dict(pipeline_loads=False, pinned_loads=False),
        f"pipelined_{other_piece >> 20}MB_pieces": {**pipelined, "pipeline_piece_bytes": other_piece},
    }
    # the first mode that is the cache's own setting carries the headline
    head_mode = next(m for m, c in modes.items() if all(default[k] == v for k, v in c.items()))

    def timed_load(changes, then_warm=False):
        """Register the delta with the cache's settings changed by ``changes``, evict its file, time a request
        naming it; ``then_warm``: also the same request once the delta is resident (what the cold start adds)."""
        for k, v in {**default, **changes}.items():
            setattr(dm.cache, k, v)
        dm.load_delta(folder, delta_name="cold", resident=False)  # registered: header checked, nothing loaded
        how = evict_from_page_cache([dz])
        _sync()
        engine.reset_stats()
        t0 = time.perf_counter()
        engine.add([prompt], ["cold"], max_new_tokens=4)  # returns with the request's first token
        _sync()
        first = time.perf_counter() - t0
        load = engine.stats.load_s
        while engine.active:
            engine.step()
        warm = None
        if then_warm:
            t0 = time.perf_counter()
            engine.add([prompt], ["cold"], max_new_tokens=4)
            _sync()
            warm = time.perf_counter() - t0
            while engine.active:
                engine.step()
        dm.delete_delta("cold")
        return {"request_to_first_token_s": first, "load_s": load, "page_cache": how}, warm

    runs = {}
    try:
        # the headline: the cache's default load and the disk's plain read, timed in turn ``repeats`` times
        # (both move from one read to the next on a shared disk), reported as medians with every run
        firsts, loads, reads, warm = [], [], [disk], None
        for r in range(repeats):
            if r:
                reads.append(sequential_read_GBps(dz))
            got, w = timed_load({}, then_warm=warm is None)
            warm = warm if w is None else w
            firsts.append(got["request_to_first_token_s"])
            loads.append(got["load_s"])
        disk = statistics.median(reads)
        disk_s = size / (disk * 1e9)
        fastest_read_s = min(disk_s, size / (direct * 1e9)) if direct else disk_s  # the median plain read or a direct one
        first = statistics.median(firsts)
        runs[head_mode] = {"request_to_first_token_s": first, "load_s": statistics.median(loads),
                           "page_cache": got["page_cache"], "x_sequential_read": first / disk_s,
                           "x_fastest_read": first / fastest_read_s, "runs_s": firsts,
                           "disk_sequential_read_runs_s": [size / (g * 1e9) for g in reads],
                           # each load against the plain read just before it
                           "x_sequential_read_runs": [f / (size / (g * 1e9)) for f, g in zip(firsts, reads)]}
        timed = {head_mode: default}  # the settings each timed mode ran with
        for mode, changes in modes.items():
            if mode in runs:
                continue
            settings = {**default, **changes}
            same = next((m for m, t in timed.items() if t == settings), None)
            if same is not None:  # the cache's defaults make it another mode (e.g. page-cache reads): not timed twice
                keep = ("request_to_first_token_s", "load_s", "page_cache", "x_sequential_read", "x_fastest_read")
                runs[mode] = {**{k: runs[same][k] for k in keep}, "same_as": same}
                continue
            got, _ = timed_load(changes)
            timed[mode] = settings
            runs[mode] = {**got, "x_sequential_read": got["request_to_first_token_s"] / disk_s,
                          "x_fastest_read": got["request_to_first_token_s"] / fastest_read_s}
    finally:
        for k, v in saved.items():
            setattr(dm.cache, k, v)
    return {"file_bytes": size, "bits": bits, "save_s": save_s, "disk_sequential_read_GBps": disk,
            "disk_sequential_read_s": disk_s, "disk_direct_read_GBps": direct,
            "disk_direct_read_s": size / (direct * 1e9) if direct else None, "fastest_read_s": fastest_read_s,
            "read_and_decompress_s": read_s,
            "read_and_decompress_GBps": size / read_s / 1e9,
            "read_and_decompress_unpinned_s": read_unpinned_s, "read_and_decompress_streamed_s": streamed[1, False],
            "read_and_decompress_streamed_2_readers_s": streamed[2, False],
            "read_and_decompress_streamed_4_readers_s": streamed[4, False],
            "read_and_decompress_streamed_direct_4_readers_s": streamed[4, True], "pipeline_readers": readers,
            "same_request_resident_s": warm,
            "request_to_first_token_s": runs[head_mode]["request_to_first_token_s"], **runs,
            "captures": engine.captures, "device": str(device)}


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
    p.add_argument("--engine-steps", type=_engine_steps, default=64,
                   help=f"decode steps run through the engine, the first three untimed (at least {MIN_ENGINE_STEPS})")
    p.add_argument("--prefill-len", type=int, default=128,
                   help="prompt tokens of the prefill timings (1, 4 and 16 requests, one delta each; 0: skip them)")
    p.add_argument("--cold-start", action="store_true")
    p.add_argument("--workdir", help="where the cold-start delta is written (a local disk)")
    p.add_argument("--cold-start-only", action="store_true", help="skip the decode measurements (implies --cold-start)")
    p.add_argument("--cold-start-repeats", type=int, default=3,
                   help="cold start: the default load and the plain read timed in turn this many times (medians)")
    p.add_argument("--pipeline-readers", type=int,
                   help="cold start: reader threads of the cache's pipelined loads (default: DeltaCache.pipeline_readers)")
    p.add_argument("--peft", action="store_true",
                   help="also time transformers + PEFT generate with max(--deltas) LoRA adapters in one mixed batch")
    p.add_argument("--lora-rank", type=int, default=16, help="--peft: rank of each LoRA adapter (default 16)")
    p.add_argument("--decode-split", action="store_true",
                   help="also time the engine on each decode route, DeltaModel.configure_kernels(decode='fused' / "
                        "'split' (base by cuBLAS), the latter with the Triton kernel too")
    p.add_argument("--fused-norms", action="store_true",
                   help="also time the engine with the model's RMSNorms in one Triton launch each (serving.use_fused_norms)")
    p.add_argument("--profile", action="store_true",
                   help="also profile engine decode steps (base alone and each U) and the prefills (base alone, fused and "
                   "dequant routes): GPU time per step by kernel kind")
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
    if args.cold_start_only:
        args.cold_start, args.deltas, args.peft = True, [1], False
    if not args.cold_start_only:
        t = time_generate(base, ids, None, args.new_tokens)
        result["decode"].append({"model": "base alone (one merged fine-tune)", "U": 0, "s": t,
                                 "tokens_per_s": args.rows * args.new_tokens / t})
        print(f"base alone: {args.rows * args.new_tokens / t:8.1f} tokens/s ({t:.2f} s)", flush=True)
        steps = args.engine_steps
        e = engine_tokens_per_s(base, None, args.rows, args.prompt_len, steps)
        result["decode"][-1]["engine_tokens_per_s"] = e
        print(f"base alone, engine (static cache, CUDA graphs): {e:8.1f} tokens/s", flush=True)
        if args.fused_norms:
            en = fused_norms_tokens_per_s(base, None, args.rows, args.prompt_len, steps)
            result["decode"][-1]["engine_tokens_per_s_fused_norms"] = en
            print(f"base alone, engine with fused norms: {en:8.1f} tokens/s ({en / e:.3f}x)", flush=True)
        if args.profile:
            prof = profile_engine_step(base, None, args.rows, args.prompt_len)
            result["decode"][-1]["profile"] = prof
            print_profile("base alone", prof)
        if args.peft:
            u = max(args.deltas)
            tps, base = peft_generate(base, ids, u, args.lora_rank, args.new_tokens)
            peft_tps = tps
            result["decode"].append({"model": f"transformers + PEFT, {u} LoRA adapters (rank {args.lora_rank}), mixed batch",
                                     "U": u, "tokens_per_s": tps, "peft": True})
            print(f"PEFT, {u} LoRA adapters of rank {args.lora_rank}, one mixed batch: {tps:8.1f} tokens/s", flush=True)
    dm = DeltaModel(base)
    dm.configure_cache(max_resident=max(args.deltas) + 2)  # stacks sized once, later loads go in place
    made = 0
    for u in sorted(args.deltas):
        while made < u:
            dm.add_delta(random_delta(base, args.bits, args.group_size, seed=made), f"d{made}")
            made += 1
        if args.cold_start_only:
            continue
        names = [f"d{i % u}" for i in range(args.rows)]
        t = time_generate(dm, ids, names, args.new_tokens)
        e = engine_tokens_per_s(dm, names, args.rows, args.prompt_len, steps)
        mem = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        result["decode"].append({"model": f"DeltaModel, {u} deltas", "U": u, "s": t,
                                 "tokens_per_s": args.rows * args.new_tokens / t, "engine_tokens_per_s": e, "gpu_gib": mem})
        print(f"U={u:3d}: generate {args.rows * args.new_tokens / t:8.1f} tokens/s, engine {e:8.1f} tokens/s, "
              f"GPU memory {mem:.1f} GiB", flush=True)
        en = None
        if args.fused_norms:
            en = fused_norms_tokens_per_s(dm, names, args.rows, args.prompt_len, steps)
            result["decode"][-1]["engine_tokens_per_s_fused_norms"] = en
            print(f"U={u:3d}: engine with fused norms {en:8.1f} tokens/s ({en / e:.3f}x)", flush=True)
        if args.decode_split:  # the same engine steps on each decode route (the figure above: the default)
            from ..kernels import multi_delta as md

            dm.configure_kernels(decode="fused")
            ef = engine_tokens_per_s(dm, names, args.rows, args.prompt_len, steps)
            dm.configure_kernels(decode="split")  # the base by cuBLAS, the deltas added
            es = engine_tokens_per_s(dm, names, args.rows, args.prompt_len, steps)
            md.set_default_backend("triton")  # the deltas by the planar Triton kernel instead of the Gluon one
            try:
                est = engine_tokens_per_s(dm, names, args.rows, args.prompt_len, steps)
            finally:
                md.set_default_backend("auto")
            dm.configure_kernels(decode="auto")
            route = dm.kernel_policy.decode_route(args.rows, u, base.device)
            result["decode"][-1].update(engine_tokens_per_s_fused=ef, engine_tokens_per_s_split=es,
                                        engine_tokens_per_s_split_triton=est, auto_decode_route=route)
            print(f"U={u:3d}: engine, decode='fused' {ef:8.1f} tokens/s; 'split' {es:8.1f} ({es / ef:.2f}x fused; "
                  f"deltas by the Triton kernel: {est:8.1f}, {est / ef:.2f}x); the default 'auto' took {route!r}: "
                  f"{e / ef:.2f}x fused", flush=True)
        if args.profile:
            prof = profile_engine_step(dm, names, args.rows, args.prompt_len)
            result["decode"][-1]["profile"] = prof
            print_profile(f"U={u}", prof)
        if args.peft and u == max(args.deltas) and not args.cold_start_only:
            result["decode"][-1]["engine_x_peft"] = e / peft_tps
            if en is not None:
                result["decode"][-1]["engine_fused_norms_x_peft"] = en / peft_tps
                print(f"U={u:3d} against PEFT, engine with fused norms: {en / peft_tps:.1f}x", flush=True)
            result["decode"][-1]["generate_x_peft"] = args.rows * args.new_tokens / t / peft_tps
            print(f"U={u:3d} against PEFT: engine {e / peft_tps:.1f}x, generate {args.rows * args.new_tokens / t / peft_tps:.1f}x",
                  flush=True)
    if not args.cold_start_only and args.prefill_len:
        # a prefill of R requests of --prefill-len tokens, each its own delta, every kernel route (and the base alone)
        result["prefill"] = []
        for r in sorted({1, min(4, max(args.deltas)), min(16, max(args.deltas))}):
            ids_p = torch.randint(0, 1000, (r, args.prefill_len), device=args.device)
            row = {"requests": r, "tokens": r * args.prefill_len, "base_ms": prefill_ms(dm, ids_p, [None] * r)}
            for route in ("fused", "dequant", "split"):
                dm.configure_kernels(prefill=route)
                row[f"{route}_ms"] = prefill_ms(dm, ids_p, [f"d{i}" for i in range(r)])
            dm.configure_kernels(prefill="auto")  # the default: which of the two it takes for this prefill
            split = dm.kernel_policy.wants_split(args.prefill_len, r * args.prefill_len)
            row["auto_route"] = "split" if split else "fused"
            if args.profile:
                row["profile"] = {"base": profile_prefill(dm, ids_p, [None] * r)}
                print_profile(f"prefill, {r} requests, base alone", row["profile"]["base"])
                for route in ("fused", "dequant"):
                    dm.configure_kernels(prefill=route)
                    row["profile"][route] = profile_prefill(dm, ids_p, [f"d{i}" for i in range(r)])
                    print_profile(f"prefill, {r} requests, {route}", row["profile"][route])
                dm.configure_kernels(prefill="auto")
            result["prefill"].append(row)
            print(f"prefill, {r} requests x {args.prefill_len} tokens, one delta each: base alone {row['base_ms']:.1f} ms, "
                  f"fused {row['fused_ms']:.1f} ms, dequant {row['dequant_ms']:.1f} ms, split {row['split_ms']:.1f} ms "
                  f"(the default, prefill='auto', takes {row['auto_route']})",
                  flush=True)
    if args.cold_start:
        for n in list(dm.deltas)[1:]:
            dm.delete_delta(n)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory(dir=args.workdir or os.environ.get("TMPDIR")) as d:
            result["cold_start"] = cold_start(dm, random_delta(base, args.bits, args.group_size, seed=999), Path(d),
                                              args.prompt_len, warm_name=dm.deltas[0], bits=args.bits,
                                              readers=args.pipeline_readers, repeats=args.cold_start_repeats)
        print("cold start:", json.dumps(result["cold_start"]), flush=True)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
