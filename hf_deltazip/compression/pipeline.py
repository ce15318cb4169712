"""The layer walk: compress a fine-tune's delta, one decoder layer at a time, on reconstructed inputs.

For layer ``i`` the solver needs the inputs that layer sees in the *fine-tuned* model once every
delta upstream has been replaced by its compressed version. So the walk keeps the calibration
activations on the device and, for each layer: copies it to the device with the fine-tune's
weights, runs the activations through it to build one Hessian per distinct input (q/k/v and
gate/up share theirs), compresses each linear delta, sets the copy's weights to
``W_base + dequant(delta_hat)``, and runs the activations through again to get the next layer's
inputs. Only one decoder layer is on the device at a time.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import __version__
from ..config import DeltaZipConfig
from ..delta import CompressedDelta, PackedModule, recorded_location
from ..errors import DeltaZipError, UnsupportedModelError
from ..fingerprint import base_fingerprint
from ..modeling.arch import (
    conv1d_class,
    find_decoder_layers,
    is_linear,
    linear_modules,
    weight_as_nk,
)
from .calibration import calibration_length, prepare_calibration
from .solver import HessianAccumulator, obs_compress, relative_objective, rtn_compress

logger = logging.getLogger(__name__)

ModelLike = Union[str, os.PathLike, nn.Module]


class _StopForward(Exception):
    pass


def _load(model: ModelLike, what: str, **kwargs) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    except (OSError, ValueError) as e:
        raise DeltaZipError(f"could not load the {what} model {str(model)!r}: {e}") from e


def _base_commit(given, model: nn.Module, revision: Optional[str], load_kwargs: dict) -> Optional[str]:
    """The Hub commit of the base: as given, as transformers 4 records it, or from the Hub cache for a Hub id."""
    recorded = revision or getattr(getattr(model, "config", None), "_commit_hash", None)
    if recorded or not isinstance(given, (str, os.PathLike)) or recorded_location(given, model)[1] != "hub":
        return recorded
    from ..hub import cached_commit

    return cached_commit(os.fspath(given), load_kwargs.get("revision"), cache_dir=load_kwargs.get("cache_dir"))


def check_compatible(base: nn.Module, ft: nn.Module, vocab_params: set) -> None:
    """Raise unless ``ft`` is a fine-tune of ``base``'s architecture (same parameters and shapes).

    Parameters in ``vocab_params`` may have more rows in the fine-tune (tokens it added).
    """
    bt, ft_t = type(base).__name__, type(ft).__name__
    b_type = getattr(base.config, "model_type", None)
    f_type = getattr(ft.config, "model_type", None)
    if b_type != f_type or bt != ft_t:
        raise DeltaZipError(
            f"base ({bt}, model_type={b_type!r}) and fine-tune ({ft_t}, model_type={f_type!r}) are different "
            "architectures: a delta needs the fine-tune's own base model"
        )
    bp = dict(base.named_parameters())
    fp = dict(ft.named_parameters())
    missing = sorted(set(fp) - set(bp))
    extra = sorted(set(bp) - set(fp))
    if missing or extra:
        raise DeltaZipError(
            f"base and fine-tune have different parameters (only in fine-tune: {missing[:3]}, only in base: "
            f"{extra[:3]}): check that the fine-tune was trained from this base"
        )
    for name, p in fp.items():
        b = bp[name]
        if p.shape == b.shape:
            continue
        if name in vocab_params and p.dim() == 2 and p.shape[1] == b.shape[1] and p.shape[0] > b.shape[0]:
            continue
        raise DeltaZipError(
            f"shape mismatch for {name}: fine-tune {list(p.shape)} vs base {list(b.shape)}; "
            "check that the fine-tune was trained from this base"
        )


def _left_exact(config: DeltaZipConfig, module: str) -> bool:
    """Whether the settings keep ``module`` out of compression (what the fine-tune changed in it is stored exactly)."""
    decision = config.is_target(module)
    return decision is False or (decision is None and config.target_modules is not None)


def _check_fused_experts(ft: nn.Module, base_params: dict, layers_prefix: str, config: DeltaZipConfig) -> None:
    """Refuse changed parameters of more than two dimensions in the decoder layers unless they are skipped.

    transformers 5 stores a mixture-of-experts layer's experts as fused 3-D tensors
    (``mlp.experts.gate_up_proj``: ``[experts, out, in]``), which the solver does not quantize. Their
    delta is stored exactly (and served through the parameter-override path) only when the user asks
    for it with ``skip_modules``, since that stores the experts uncompressed.
    """
    changed = {}
    for name, p in ft.named_parameters():
        owner = name.rpartition(".")[0]
        if not name.startswith(layers_prefix + ".") or p.dim() <= 2 or _left_exact(config, owner):
            continue
        if not torch.equal(p.detach().cpu(), base_params[name].detach().cpu()):
            changed[name] = p
    if not changed:
        return
    name = next(iter(changed))
    owner = name.rpartition(".")[0]
    pattern = "*." + owner[len(layers_prefix) + 1 :].partition(".")[2]  # model.layers.0.mlp.experts -> *.mlp.experts
    mib = sum(p.numel() * p.element_size() for p in changed.values()) / 2**20
    raise UnsupportedModelError(
        f"{name} is a {changed[name].dim()}-D parameter (such as a mixture-of-experts layer's fused experts) that the "
        f"fine-tune changed, and hf-deltazip quantizes only nn.Linear and Conv1D deltas. Pass skip_modules=[{pattern!r}] to "
        f"store the expert deltas exactly instead ({len(changed)} tensors, {mib:.1f} MiB uncompressed; DeltaModel "
        "serves and merges them), or fine-tune with the experts frozen"
    )


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def _device_of(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _Captured:
    """One calibration batch's call into a decoder layer: hidden states plus the other arguments."""

    def __init__(self, args, kwargs):
        if args:
            self.hidden, self.args, self.positional = args[0], tuple(args[1:]), True
        else:
            self.hidden, self.args, self.positional = kwargs.pop("hidden_states"), (), False
        kwargs.pop("past_key_values", None)
        kwargs.pop("past_key_value", None)
        kwargs["use_cache"] = False
        self.kwargs = kwargs

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.positional:
            out = layer(hidden, *self.args, **self.kwargs)
        else:
            out = layer(*self.args, hidden_states=hidden, **self.kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


def _move_non_layer_params(model: nn.Module, layers_prefix: str, device) -> dict:
    """Move every parameter and buffer outside the decoder layers to ``device``; return their old data."""
    saved = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(layers_prefix + "."):
            continue
        saved[name] = t.data
        t.data = t.data.to(device)
    return saved


def _restore(model: nn.Module, saved: dict) -> None:
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, data in saved.items():
        tensors[name].data = data


@torch.no_grad()
def compress(
    base: ModelLike,
    finetuned: ModelLike,
    config: Optional[DeltaZipConfig] = None,
    calibration=None,
    tokenizer=None,
    *,
    device: Union[str, torch.device, None] = None,
    batch_size: int = 8,
    progress: bool = True,
    base_revision: Optional[str] = None,
    **load_kwargs,
) -> CompressedDelta:
    """Compress the delta between a fine-tune and its base.

    Args:
        base: the base model, a Hub id or a local path.
        finetuned: the full-parameter fine-tune of ``base`` (model, id or path).
        config: compression settings (default :class:`DeltaZipConfig()`).
        calibration: texts, chat records, token ids or a local ``.jsonl``/``.txt`` file; the inputs
            each layer's Hessian is built from. ``None`` falls back to round-to-nearest (no solver).
        tokenizer: tokenizes text calibration; loaded from ``finetuned`` when it is a path or id.
        device: where each layer is compressed (default: CUDA if available, else CPU).
        batch_size: calibration sequences per forward pass.
        progress: show a tqdm bar per layer.
        base_revision: recorded in the delta so loaders can fetch the same base.
        load_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` for ids and paths.

    Returns:
        :class:`~hf_deltazip.delta.CompressedDelta`; ``.summary`` has time, bytes and per-layer errors.

    Raises:
        DeltaZipError: incompatible models or bad calibration data.
        UnsupportedModelError: no decoder layers or unsupported layer types.
    """
    t0 = time.perf_counter()
    config = config or DeltaZipConfig()
    base_m = _load(base, "base", **load_kwargs)
    ft_m = _load(finetuned, "fine-tuned", **load_kwargs)
    base_m.eval()
    ft_m.eval()
    dev = _device_of(device)

    in_emb = ft_m.get_input_embeddings()
    out_emb = ft_m.get_output_embeddings()
    names = {id(m): n for n, m in ft_m.named_modules()}
    emb_names = []
    if in_emb is not None and isinstance(getattr(in_emb, "weight", None), torch.Tensor):
        emb_names.append(names[id(in_emb)])
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    if out_emb is not None and not tied and is_linear(out_emb):
        emb_names.append(names[id(out_emb)])
    vocab_params = {f"{n}.weight" for n in emb_names}
    check_compatible(base_m, ft_m, vocab_params)

    layers_prefix, ft_layers = find_decoder_layers(ft_m)
    base_layers = base_m.get_submodule(layers_prefix)
    base_params = dict(base_m.named_parameters())

    # which linear modules are compressed by the solver
    targets = {i: [rel for rel in linear_modules(layer) if not _left_exact(config, f"{layers_prefix}.{i}.{rel}")]
               for i, layer in enumerate(ft_layers)}
    covered = {f"{layers_prefix}.{i}.{rel}.weight" for i, rels in targets.items() for rel in rels}
    _check_fused_experts(ft_m, base_params, layers_prefix, config)

    modules: dict[str, PackedModule] = {}
    params: dict[str, torch.Tensor] = {}
    layer_errors: dict[str, float] = {}

    # -- embeddings and LM head
    emb_weight_names = set()
    if config.embeddings == "quantize":
        for name in emb_names:
            wname = f"{name}.weight"
            emb_weight_names.add(wname)
            w_ft = ft_m.get_parameter(wname).detach().float()
            w_b = _pad_rows(base_params[wname].detach().float(), w_ft.shape[0])
            delta = w_ft - w_b
            if not bool(delta.any()):
                continue
            res = rtn_compress(delta, bits=config.embedding_bits, group_size=config.embedding_group_size, symmetric=config.symmetric)
            modules[name] = PackedModule.from_codes(
                res.codes, res.scales, res.zeros, None, bits=res.bits, group_size=res.group_size,
                symmetric=res.symmetric, kind="embedding",
            )
            layer_errors[name] = float(((res.dequantize() - delta).norm() / delta.norm().clamp_min(1e-30)) ** 2)

    # -- exact parameters: everything else the fine-tune changed
    store_dtype = torch.float16 if config.norms_and_biases == "float16" else None
    for name, p in ft_m.named_parameters():
        if name in covered or name in emb_weight_names:
            continue
        b = base_params[name]
        if p.shape == b.shape and torch.equal(p.detach().cpu(), b.detach().cpu()):
            continue
        t = p.detach().cpu().clone()
        params[name] = t.to(store_dtype) if store_dtype is not None and t.is_floating_point() else t

    # -- the layer walk
    use_solver = calibration is not None
    if use_solver:
        if tokenizer is None and isinstance(finetuned, (str, os.PathLike)) and not isinstance(calibration, torch.Tensor):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(finetuned))
        seq_len = calibration_length(ft_m, config.seq_len)
        ids = prepare_calibration(calibration, tokenizer, n_samples=config.n_samples, seq_len=seq_len, seed=config.seed)
        vocab = ft_m.get_input_embeddings().weight.shape[0]
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise DeltaZipError(f"calibration token ids fall outside the fine-tune's vocabulary of {vocab}: wrong tokenizer?")
        captured = _capture_layer_inputs(ft_m, layers_prefix, ft_layers[0], ids, modules, base_params, dev, batch_size)
    else:
        logger.warning("no calibration data: compressing with round-to-nearest instead of the OBS solver")
        captured = None

    conv1d = conv1d_class()
    bar = tqdm(total=len(ft_layers), desc="compressing layers", disable=not progress, unit="layer")
    for i, ft_layer in enumerate(ft_layers):
        work = copy.deepcopy(ft_layer).to(dev)
        base_layer = base_layers[i]
        lin = linear_modules(work)
        hess = _layer_hessians(work, lin, targets[i], captured) if captured is not None else {}
        for rel in targets[i]:
            mod = lin[rel]
            full = f"{layers_prefix}.{i}.{rel}"
            settings = config.for_module(full)
            w_ft = weight_as_nk(mod).float()
            w_b = weight_as_nk(base_layer.get_submodule(rel)).to(dev).float()
            delta = w_ft - w_b
            sparsity = settings.sparsity
            if sparsity == "2:4" and delta.shape[1] % 4:
                logger.warning("%s: %d inputs is not a multiple of 4; stored dense instead of 2:4", full, delta.shape[1])
                sparsity = None
            if not bool(delta.any()):
                continue
            if rel in hess:
                h = hess[rel]
                res = obs_compress(delta, h, bits=settings.bits, group_size=settings.group_size,
                                   symmetric=settings.symmetric, sparsity=sparsity,
                                   block_size=settings.block_size, damp=settings.damp)
            else:
                h = None
                res = rtn_compress(delta, bits=settings.bits, group_size=settings.group_size,
                                   symmetric=settings.symmetric, sparsity=sparsity)
            approx = res.dequantize()
            modules[full] = PackedModule.from_codes(
                res.codes, res.scales, res.zeros, res.mask, bits=res.bits, group_size=res.group_size,
                symmetric=res.symmetric, two_four=sparsity == "2:4", kind="linear",
                transposed=conv1d is not None and isinstance(mod, conv1d),
            )
            if h is not None:
                layer_errors[full] = relative_objective(delta, approx, h)
            else:
                layer_errors[full] = float(((approx - delta).norm() / delta.norm().clamp_min(1e-30)) ** 2)
            new_w = (w_b + approx).to(mod.weight.dtype)
            mod.weight.data = new_w.t().contiguous() if modules[full].transposed else new_w
        if captured is not None:
            for c in captured:
                c.hidden = c.run(work, c.hidden)
        del work, hess
        bar.update(1)
    bar.close()

    n_params = sum(p.numel() for p in ft_m.parameters())
    base_name, base_source = recorded_location(base, base_m)  # what resolve_recorded_base finds again
    header = {
        "library_version": __version__,
        "base_model": base_name,
        "base_source": base_source,
        "base_revision": _base_commit(base, base_m, base_revision, load_kwargs),
        "base_fingerprint": base_fingerprint(base_m),
        "finetuned_model": recorded_location(finetuned, ft_m)[0],
        "model_type": getattr(ft_m.config, "model_type", None),
        "architectures": [type(ft_m).__name__],
        "model_config": ft_m.config.to_dict(),
        "extra": {
            "finetune_num_params": n_params,
            "vocab_size_base": int(base_m.get_input_embeddings().weight.shape[0]),
            "vocab_size_finetune": int(ft_m.get_input_embeddings().weight.shape[0]),
            "tied_embeddings": bool(tied),
            "layers_prefix": layers_prefix,
            "solver": "obs" if use_solver else "rtn",
            "calibration_tokens": int(ids.numel()) if use_solver else 0,
        },
    }
    gen_cfg = getattr(ft_m, "generation_config", None)
    delta = CompressedDelta(config=config, modules=modules, params=params, header=header, tokenizer=tokenizer,
                            generation_config=gen_cfg)
    packed = sum(m.nbytes for m in modules.values())
    exact = sum(t.numel() * t.element_size() for t in params.values())
    delta.summary = {
        "seconds": time.perf_counter() - t0,
        "device": str(dev),
        "packed_bytes": packed,
        "exact_param_bytes": exact,
        "finetune_fp16_bytes": 2 * n_params,
        "ratio_before_zstd": 2 * n_params / max(1, packed + exact),
        "relative_error": layer_errors,
    }
    return delta


def _capture_layer_inputs(model, layers_prefix, first_layer, ids, modules, base_params, dev, batch_size):
    """Run the calibration batches up to the first decoder layer (with compressed embeddings) and keep its inputs."""
    captured: list[_Captured] = []

    def hook(_mod, args, kwargs):
        captured.append(_Captured(args, dict(kwargs)))
        raise _StopForward

    saved = _move_non_layer_params(model, layers_prefix, dev)
    swapped = {}
    try:
        # the first layer must see what the compressed embeddings produce
        for name, mod in modules.items():
            if mod.kind != "embedding":
                continue
            p = model.get_parameter(f"{name}.weight")
            base_w = _pad_rows(base_params[f"{name}.weight"].detach().float().to(dev), p.shape[0])
            swapped[f"{name}.weight"] = p.data
            p.data = (base_w + mod.dequantize().to(dev)).to(p.dtype)
        handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for s in range(0, ids.shape[0], batch_size):
                try:
                    model(input_ids=ids[s : s + batch_size].to(dev), use_cache=False)
                except _StopForward:
                    pass
        finally:
            handle.remove()
    finally:
        for name, data in swapped.items():
            model.get_parameter(name).data = data
        _restore(model, saved)
    if not captured:
        raise UnsupportedModelError("the model's forward never reached its first decoder layer")
    for c in captured:  # detach from the model: it may be moved back to the CPU
        c.hidden = c.hidden.detach()
    return captured


def _layer_hessians(layer, lin: dict, targets: list, captured: list) -> dict:
    """One Hessian per distinct input tensor among the target modules of ``layer``."""
    leaders: dict = {}  # module rel name -> accumulator; modules fed the same tensor share one
    shared: dict = {}
    first_pass = {"on": True}
    seen_this_batch: dict = {}

    def make_hook(rel):
        def hook(_mod, args):
            x = args[0]
            if first_pass["on"]:
                key = (x.data_ptr(), tuple(x.shape))
                if key in seen_this_batch:
                    shared[rel] = seen_this_batch[key][0]
                    return
                acc = HessianAccumulator()
                leaders[rel] = acc
                shared[rel] = acc
                # keep x alive so no later tensor of this pass can reuse its address
                seen_this_batch[key] = (acc, x)
            if rel in leaders:
                leaders[rel].add(x)

        return hook

    handles = [lin[rel].register_forward_pre_hook(make_hook(rel)) for rel in targets]
    try:
        for c in captured:
            c.run(layer, c.hidden)
            seen_this_batch.clear()
            first_pass["on"] = False
    finally:
        for h in handles:
            h.remove()
    return {rel: acc.hessian for rel, acc in shared.items() if acc.n > 0}
