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
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..config import CONFIG_NAME, DeltaZipConfig, lowrank_bits_per_weight
from ..delta import CompressedDelta, PackedModule, recorded_location
from ..errors import DeltaZipConfigError, DeltaZipError, TargetRatioTooLowError, UnsupportedModelError
from ..fingerprint import base_fingerprint
from ..format import DZ_FILENAME, DeltaHeader
from ..modeling.arch import (
    conv1d_class,
    find_decoder_layers,
    is_linear,
    linear_modules,
    weight_as_nk,
)
from .calibration import calibration_length, prepare_calibration
from .lowrank import lowrank_module
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


COMPRESSION_STEPS = ("load", "plan", "exact_params", "budget", "embeddings", "calibrate", "layers", "head", "package")
"""The named steps of :func:`compress`, in order (``on_step`` is called after each). ``budget`` does
nothing without ``target_ratio``; with it, the steps from ``embeddings`` on may run again (at most
:data:`BUDGET_ATTEMPTS` times in all) until the saved delta lands near the target."""

BUDGET_ATTEMPTS = 4
# an attempt this close to the target is kept at once (the promise is 5 %)
BUDGET_TOLERANCE = 0.03
_REDO_STEPS = ("embeddings", "calibrate", "layers", "head", "package")


@dataclass
class LayerReport:
    """What :func:`compress` did to one decoder layer (passed to its ``on_layer`` callback).

    Attributes:
        index, num_layers: this layer's position among the decoder layers.
        name: the layer's module name (e.g. ``model.layers.3``).
        seconds: wall time of the whole layer (Hessians, solver, next layer's inputs).
        hessian_seconds: building its Hessians from the calibration activations.
        solver_seconds: compressing its linear deltas.
        relative_errors: module name -> relative OBS objective (or relative error without calibration).
    """

    index: int
    num_layers: int
    name: str
    seconds: float
    hessian_seconds: float
    solver_seconds: float
    relative_errors: dict


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
    on_layer: Optional[Callable[[LayerReport], None]] = None,
    on_step: Optional[Callable[[str, float], None]] = None,
    base_quantization=None,
    budget_measurements=None,
    **load_kwargs,
) -> CompressedDelta:
    """Compress the delta between a fine-tune and its base.

    Runs the steps of :data:`COMPRESSION_STEPS`: ``load`` the two models, ``plan`` which modules the
    solver compresses, quantize the ``embeddings`` and LM head, keep the ``exact_params`` (norms,
    biases, ...), ``calibrate`` (the first decoder layer's inputs), walk the ``layers`` on
    reconstructed inputs, and ``package`` the delta.

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
        on_layer: called with a :class:`LayerReport` after each decoder layer.
        on_step: called with ``(step name, seconds)`` after each step.
        base_quantization: a ``BitsAndBytesConfig`` the base will be served with: the delta is made
            against the quantized base (see :mod:`.quantized_base`), so it absorbs part of its rounding.
        budget_measurements: a :class:`~hf_deltazip.compression.budget.BudgetMeasurements` shared by calls
            that differ only in ``config.target_ratio``: the first fills it, the others skip the measuring pass.
        load_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` for ids and paths.

    Returns:
        :class:`~hf_deltazip.delta.CompressedDelta`; ``.summary`` has time, bytes, each step's and each
        layer's seconds and per-module errors. With ``config.target_ratio`` (see
        :mod:`hf_deltazip.compression.budget`) it also has ``target_ratio``, ``reached_ratio`` (fine-tune
        in 16-bit over the bytes ``save_pretrained`` writes, measured by writing them), ``stored_bytes``,
        ``budget_attempts`` and ``budget_weighting`` (``"fisher"``; ``"output"`` where the Fisher pass was not
        asked for or ran out of memory; ``"frobenius"`` without calibration); ``delta.config.overrides``
        holds the setting chosen for each module.

    Raises:
        DeltaZipError: incompatible models or bad calibration data.
        UnsupportedModelError: no decoder layers or unsupported layer types.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DeltaZipError(
            f"batch_size must be a positive int (calibration sequences per forward pass), got {batch_size!r}")
    if base_quantization is not None:  # against the quantized base: hf_deltazip/compression/quantized_base.py
        from .quantized_base import compress_for_quantized_base

        return compress_for_quantized_base(
            compress, base, finetuned, base_quantization, lambda m: _load(m, "base", **load_kwargs), config=config,
            calibration=calibration, tokenizer=tokenizer, device=device, batch_size=batch_size, progress=progress,
            base_revision=base_revision, on_layer=on_layer, on_step=on_step, budget_measurements=budget_measurements,
            **load_kwargs)
    run = _Compression(base, finetuned, config or DeltaZipConfig(), calibration, tokenizer, device=device,
                       batch_size=batch_size, progress=progress, base_revision=base_revision,
                       on_layer=on_layer, load_kwargs=load_kwargs)
    run.budget_measurements = budget_measurements

    def step(name):
        t = time.perf_counter()
        getattr(run, name)()
        run.step_seconds[name] = run.step_seconds.get(name, 0.0) + time.perf_counter() - t
        if on_step is not None:
            on_step(name, time.perf_counter() - t)

    for name in COMPRESSION_STEPS:
        step(name)
    while run.budget_needs_another_attempt():
        for name in _REDO_STEPS:
            step(name)
    run.finish_budget()
    run.delta.summary["steps"] = dict(run.step_seconds)
    run.delta.summary["seconds"] = sum(run.step_seconds.values())
    return run.delta


class _Compression:
    """The state of one :func:`compress` call; one method per named step."""

    def __init__(self, base, finetuned, config, calibration, tokenizer, *, device, batch_size, progress,
                 base_revision, on_layer, load_kwargs):
        self.base, self.finetuned, self.config = base, finetuned, config
        self.calibration, self.tokenizer = calibration, tokenizer
        self.device, self.batch_size, self.progress = device, batch_size, progress
        self.base_revision, self.on_layer, self.load_kwargs = base_revision, on_layer, load_kwargs
        self.step_seconds: dict = {}
        self.modules: dict[str, PackedModule] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.layer_errors: dict[str, float] = {}
        self.layer_reports: list[LayerReport] = []
        self.captured = None
        self.ids = None
        self.warned_no_calibration = False
        self.target_ratio = config.target_ratio
        self.attempts: list = []  # (saved bytes, delta) of each budget attempt
        self.budget_measurements = None  # a BudgetMeasurements shared with other calls, if given
        self.weighting_used = None  # how the budget weighed errors: "fisher", "output" or "frobenius" (no calibration)

    def load(self) -> None:
        self.base_m = _load(self.base, "base", **self.load_kwargs)
        self.ft_m = _load(self.finetuned, "fine-tuned", **self.load_kwargs)
        self.base_m.eval()
        self.ft_m.eval()
        self.dev = _device_of(self.device)

    def plan(self) -> None:
        """Which tensors are embeddings, which linear modules the solver compresses; refuse what cannot work."""
        ft_m, config = self.ft_m, self.config
        in_emb, out_emb = ft_m.get_input_embeddings(), ft_m.get_output_embeddings()
        names = {id(m): n for n, m in ft_m.named_modules()}
        self.emb_names = []
        self.in_name = self.head_name = None
        if in_emb is not None and isinstance(getattr(in_emb, "weight", None), torch.Tensor):
            self.in_name = names[id(in_emb)]
            self.emb_names.append(self.in_name)
        self.tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
        if out_emb is not None and not self.tied and is_linear(out_emb):
            self.head_name = names[id(out_emb)]
            self.emb_names.append(self.head_name)
        # tensors the embeddings / head steps compress (the exact_params step leaves them alone)
        quantized = config.embeddings == "quantize"
        self.emb_weight_names = {f"{n}.weight" for n in self.emb_names} if quantized else set()
        check_compatible(self.base_m, ft_m, {f"{n}.weight" for n in self.emb_names})
        self.layers_prefix, self.ft_layers = find_decoder_layers(ft_m)
        self.base_layers = self.base_m.get_submodule(self.layers_prefix)
        self.base_params = dict(self.base_m.named_parameters())
        prefix = self.layers_prefix
        self.targets = {i: [rel for rel in linear_modules(layer) if not _left_exact(config, f"{prefix}.{i}.{rel}")]
                        for i, layer in enumerate(self.ft_layers)}
        self.covered = {f"{prefix}.{i}.{rel}.weight" for i, rels in self.targets.items() for rel in rels}
        _check_fused_experts(ft_m, self.base_params, prefix, config)

    def _vocab_delta(self, name: str) -> torch.Tensor:
        """The delta of an embedding or LM head ``[V_ft, D]`` (rows the fine-tune added count from zero)."""
        wname = f"{name}.weight"
        w_ft = self.ft_m.get_parameter(wname).detach().float()
        # the base may sit on another device than the fine-tune (a base loaded from a folder for the round trip)
        return w_ft - _pad_rows(self.base_params[wname].detach().float().to(w_ft.device), w_ft.shape[0])

    def _compress_vocab(self, name: str, hessian: Optional[torch.Tensor]) -> None:
        """One embedding or LM-head delta: the OBS solver when ``hessian`` is given, else round-to-nearest.
        Rows that decode to zero (tokens the fine-tune did not change) are not stored (the rows layout)."""
        delta = self._vocab_delta(name)
        if not bool(delta.any()):
            return
        settings = self.config.for_embedding(name)
        sparsity = settings.sparsity
        if sparsity == "2:4" and delta.shape[1] % 4:
            sparsity = None
        delta = delta.to(self.dev)  # the vocabulary's selection and grids: seconds on a GPU, minutes on a CPU
        bpw = lowrank_bits_per_weight(sparsity)
        if bpw is not None:  # factors of the whole [V, D] delta (an LM head's fine-tune moves it in few directions)
            module = lowrank_module(delta, bpw, bits=settings.bits, group_size=settings.group_size,
                                    symmetric=settings.symmetric, kind="embedding", hessian=hessian)
            approx = module.dequantize().to(delta.device).float()
        else:
            if hessian is not None:
                res = obs_compress(delta, hessian, bits=settings.bits, group_size=settings.group_size,
                                   symmetric=settings.symmetric, sparsity=sparsity, block_size=settings.block_size,
                                   damp=settings.damp)
            else:
                res = rtn_compress(delta, bits=settings.bits, group_size=settings.group_size,
                                   symmetric=settings.symmetric, sparsity=sparsity)
            approx = res.dequantize()
            module = PackedModule.from_codes(
                res.codes, res.scales, res.zeros, res.mask, bits=res.bits, group_size=res.group_size,
                symmetric=res.symmetric, two_four=sparsity == "2:4", kind="embedding", skip_zero_rows=True,
            )
        self.layer_errors[name] = (relative_objective(delta, approx, hessian) if hessian is not None else
                                   float(((approx - delta).norm() / delta.norm().clamp_min(1e-30)) ** 2))
        self.modules[name] = module

    # ------------------------------------------------------------------ the byte budget
    def budget(self) -> None:
        """With ``target_ratio``: measure every candidate setting of every module on the fine-tune's own
        activations, choose one per module for the byte budget, and record the choice as overrides."""
        if self.target_ratio is None:
            return
        ids = self._calibration_ids()
        shared = self.budget_measurements
        if shared is not None:
            key = self._measurement_key(ids)
            shared.check(key)
            if shared.key is not None:  # measured by an earlier call: only the allocation below is new
                self.weighting_used = shared.weighting
                self._allocate(shared.options)
                return
        measured = self._measure_candidates(ids)
        if shared is not None:
            shared.key, shared.options = key, measured
            shared.weighting = self.weighting_used
        self._allocate(measured)

    def _measurement_key(self, ids) -> dict:
        """What the budget's measurements depend on (see BudgetMeasurements)."""
        import hashlib

        from ..fingerprint import base_fingerprint

        cfg = self.config
        settings = {f: getattr(cfg, f) for f in ("budget_bits", "budget_sparsity", "budget_group_sizes", "symmetric",
                                                 "block_size", "damp", "zstd_level", "embeddings", "budget_weighting")}
        calib = None if ids is None else hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
        return {"settings": json.loads(json.dumps(settings, default=str)), "calibration": calib,
                "base": base_fingerprint(self.base_m), "finetuned": base_fingerprint(self.ft_m)}

    def _measure_candidates(self, ids) -> dict:
        """Every candidate setting of every module, solved on the fine-tune's own activations."""
        from . import budget as bud

        cfg, dev = self.config, self.dev
        captured = None
        if ids is not None:
            captured = _capture_layer_inputs(self.ft_m, self.layers_prefix, self.ft_layers[0], ids, {}, self.base_params,
                                             dev, self.batch_size)
        common = dict(symmetric=cfg.symmetric, block_size=cfg.block_size, damp=cfg.damp, zstd_level=cfg.zstd_level)
        measured = {}
        quantized = bool(self.emb_weight_names)
        fisher, tied_head = {}, None
        if ids is not None and cfg.budget_weighting == "fisher":
            watched = [f"{self.layers_prefix}.{i}.{rel}" for i, rels in self.targets.items() for rel in rels]
            out_emb = self.ft_m.get_output_embeddings()
            head = None if out_emb is None else next(n for n, m in self.ft_m.named_modules() if m is out_emb)
            try:
                fisher = output_fisher(self.ft_m, ids, watched + [n for n in (self.in_name, head) if n is not None],
                                       device=dev, batch_size=1, seed=cfg.seed)  # one sequence: backward memory
            except torch.cuda.OutOfMemoryError as e:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                logger.warning(
                    "budget_weighting='fisher': the backward pass of the fine-tune ran out of memory on %s (%s); the "
                    "budget weighs errors by the plain OBS objective instead. Lower seq_len, free device memory, "
                    "or pass budget_weighting='output' to skip the pass.", dev, str(e).splitlines()[0])
                fisher = {}
            tied_head = head if self.tied else None
        self.weighting_used = "fisher" if fisher else "output" if ids is not None else "frobenius"
        in_delta = None
        if quantized and self.in_name is not None:
            # on the compute device: a 262k-token vocabulary's magnitude sorts and grids take minutes on a CPU
            in_delta = self._vocab_delta(self.in_name).to(dev)
            if not bool(in_delta.any()):
                in_delta = None
            else:  # measured after the layers (a tied head's inputs are the last layer's outputs), listed first
                measured[self.in_name] = []
        bar = tqdm(total=len(self.ft_layers), desc="measuring settings", disable=not self.progress, unit="layer")
        for i, ft_layer in enumerate(self.ft_layers):
            work = copy.deepcopy(ft_layer).to(dev)
            lin = linear_modules(work)
            hess = _layer_hessians(work, lin, self.targets[i], captured) if captured is not None else {}
            base_layer = self.base_layers[i]
            for rel in self.targets[i]:
                delta = weight_as_nk(lin[rel]).float() - weight_as_nk(base_layer.get_submodule(rel)).to(dev).float()
                if bool(delta.any()):
                    name = f"{self.layers_prefix}.{i}.{rel}"
                    measured[name] = bud.measure_module(
                        delta, candidates=bud.candidates(cfg, "linear"), kind="linear", hessian=hess.get(rel),
                        row_weights=fisher.get(name) if hess.get(rel) is not None else None, **common)
            if captured is not None:
                for c in captured:
                    c.hidden = c.run(work, c.hidden)
            del work, hess
            bar.update(1)
        bar.close()
        if in_delta is not None:
            weights = bud.token_row_weights(ids, in_delta.shape[0]) if ids is not None else None
            head_terms = {}
            if tied_head in fisher:  # the tied head reads the same rows: its error counts too
                head_hessian = self._head_hessian(captured)
                if head_hessian is not None:
                    head_terms = dict(head_hessian=head_hessian, head_row_weights=fisher[tied_head])
            measured[self.in_name] = bud.measure_module(
                in_delta, candidates=bud.candidates(cfg, "embedding"), kind="embedding", row_weights=weights,
                col_weights=fisher.get(self.in_name), **head_terms, **common)
        if quantized and self.head_name is not None:
            delta = self._vocab_delta(self.head_name)
            if bool(delta.any()):
                measured[self.head_name] = bud.measure_module(
                    delta.to(dev), candidates=bud.candidates(cfg, "linear"), kind="embedding",
                    hessian=self._head_hessian(captured), row_weights=fisher.get(self.head_name), **common)
        del captured
        return measured

    def _allocate(self, measured: dict) -> None:
        """Choose one measured option per module for the byte budget (the allocation of the budget step)."""
        self.measured = measured
        self.fp16_bytes = 2 * sum(p.numel() for p in self.ft_m.parameters())
        self.target_bytes = self.fp16_bytes / self.target_ratio
        # bytes beside the modules' payloads: exact parameters, header, config, module records; the records
        # and overrides depend on the choice, so choose, measure them on skeletons, and choose again
        self.fixed_bytes = self._saved_bytes(self._package_with({}))
        self._choose(self.target_bytes - self.fixed_bytes)
        for _ in range(3):
            self.fixed_bytes = self._overhead_of(self.chosen)
            spent = sum(opt.nbytes for opt in self.chosen.values())
            if abs(self.fixed_bytes + spent - self.target_bytes) <= 0.005 * self.target_bytes:
                break
            self._choose(self.target_bytes - self.fixed_bytes)

    def _overhead_of(self, chosen: dict) -> int:
        """Bytes of the folder a choice gives, less its modules' payloads (measured on all-zero skeletons)."""
        from . import budget as bud
        from ..format.container import encoded_nbytes

        skeletons = {name: bud.skeleton(opt) for name, opt in chosen.items()}
        errors, self.layer_errors = self.layer_errors, dict.fromkeys(chosen, _TYPICAL_ERROR)
        try:
            size = self._saved_bytes(self._package_with(skeletons))
        finally:
            self.layer_errors = errors
        payload = sum(encoded_nbytes(t, self.config.zstd_level) for m in skeletons.values() for t in m.tensors().values())
        return size - payload

    def _choose(self, module_bytes: float, correcting: bool = False) -> None:
        from . import budget as bud

        try:
            chosen = bud.allocate(self.measured, module_bytes)
        except bud.BudgetUnreachable as e:
            near = e.cheapest + self.fixed_bytes <= self.target_bytes / (1 - BUDGET_TOLERANCE)
            if correcting or near:  # the cheapest settings are as close as it gets, and close enough
                chosen = bud.allocate(self.measured, e.cheapest)
            else:
                self._unreachable(e.cheapest)
        self._record_choice(chosen)

    def _unreachable(self, cheapest: int):
        from . import budget as bud

        # the overhead of the cheapest choice itself (its module records), not of the last choice made
        reachable = self.fp16_bytes / (cheapest + self._overhead_of(bud.allocate(self.measured, cheapest)))
        raise DeltaZipConfigError(
            f"target_ratio={self.target_ratio:g} is out of reach for this model: the smallest settings give "
            f"about {reachable:.1f}x; choose a lower target_ratio, or offer smaller settings (budget_bits, "
            f"budget_sparsity, budget_group_sizes)"
        )

    def _record_choice(self, chosen: dict) -> None:
        most = sum(min(opts, key=lambda o: o.error).nbytes for opts in self.measured.values())
        if self.fixed_bytes + most < self.target_bytes * (1 - 0.05):
            reached = self.fp16_bytes / (self.fixed_bytes + most)
            raise TargetRatioTooLowError(
                f"target_ratio={self.target_ratio:g} is below what the most accurate settings offered reach "
                f"({reached:.1f}x): choose a target_ratio of at least {reached:.1f}, or compress without one",
                reached,
            )
        self.chosen = chosen
        overrides = {k: v for k, v in self.config.overrides.items() if k not in chosen}
        overrides.update({name: opt.candidate.settings() for name, opt in chosen.items()})
        self.config = dataclasses.replace(self.config, overrides=overrides)

    def _package_with(self, modules: dict) -> CompressedDelta:
        saved = self.modules
        self.modules = modules
        try:
            self.package()
            return self.delta
        finally:
            self.modules = saved

    @staticmethod
    def _saved_bytes(delta: CompressedDelta) -> int:
        """Bytes of ``delta``'s folder as :meth:`CompressedDelta.save_pretrained` writes it (ratio bytes only)."""
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer, gen = delta.tokenizer, delta.generation_config
            delta.tokenizer = delta.generation_config = None
            try:
                delta.save_pretrained(tmp)
            finally:
                delta.tokenizer, delta.generation_config = tokenizer, gen
            return (Path(tmp) / DZ_FILENAME).stat().st_size + (Path(tmp) / CONFIG_NAME).stat().st_size

    def budget_needs_another_attempt(self) -> bool:
        """After a budgeted pass: keep it if it is near the target, else move the budget by the miss and redo."""
        if self.target_ratio is None:
            return False
        saved = self._saved_bytes(self.delta)
        self.attempts.append((saved, self.delta))
        miss = self.target_bytes - saved
        if abs(saved / self.target_bytes - 1) <= BUDGET_TOLERANCE or len(self.attempts) >= BUDGET_ATTEMPTS:
            return False
        spent = sum(opt.nbytes for opt in self.chosen.values())
        self._choose(spent + miss, correcting=True)
        self.modules, self.layer_errors, self.layer_reports = {}, {}, []
        self.captured = None
        return True

    def finish_budget(self) -> None:
        """Keep the budgeted attempt closest to the target and record what was asked and reached."""
        if self.target_ratio is None:
            return
        saved, delta = min(self.attempts, key=lambda a: abs(a[0] - self.target_bytes))
        reached = self.fp16_bytes / saved
        if abs(reached / self.target_ratio - 1) > 0.05:
            logger.warning("target_ratio %.3g: reached %.3gx after %d attempts (more than 5 %% off)",
                           self.target_ratio, reached, len(self.attempts))
        delta.summary.update(target_ratio=self.target_ratio, reached_ratio=reached, stored_bytes=saved,
                             ratio=reached, budget_attempts=len(self.attempts),
                             budget_weighting=self.weighting_used)
        self.delta = delta

    def embeddings(self) -> None:
        """Round-to-nearest delta of the input embeddings (rows the fine-tune added included; unchanged rows free)."""
        if self.emb_weight_names and self.in_name is not None:
            self._compress_vocab(self.in_name, None)

    def head(self) -> None:
        """The LM head's delta, with the OBS solver on its real inputs (the final norm's output on the
        calibration activations through the compressed layers); round-to-nearest without calibration
        or when the final norm cannot be found. A tied head is the input embedding: nothing to do."""
        if not self.emb_weight_names or self.head_name is None:
            return
        self._compress_vocab(self.head_name, self._head_hessian(self.captured))

    def _head_hessian(self, captured) -> Optional[torch.Tensor]:
        if captured is None:
            return None
        norm = _final_norm(self.ft_m, self.layers_prefix)
        if norm is None:
            logger.info("no final norm found before %s: its delta is rounded to nearest", self.head_name)
            return None
        norm = copy.deepcopy(norm).to(self.dev)
        acc = HessianAccumulator()
        for c in captured:
            acc.add(norm(c.hidden))
        return acc.hessian

    def exact_params(self) -> None:
        """Everything else the fine-tune changed (norms, biases, skipped modules), stored as it is."""
        store_dtype = torch.float16 if self.config.norms_and_biases == "float16" else None
        for name, p in self.ft_m.named_parameters():
            if name in self.covered or name in self.emb_weight_names:
                continue
            b = self.base_params[name]
            if p.shape == b.shape and torch.equal(p.detach().cpu(), b.detach().cpu()):
                continue
            t = p.detach().cpu().clone()
            self.params[name] = t.to(store_dtype) if store_dtype is not None and t.is_floating_point() else t

    def calibrate(self) -> None:
        """Tokenize the calibration data and capture the first decoder layer's inputs (compressed embeddings in)."""
        ids = self._calibration_ids()
        if ids is None:
            return
        self.captured = _capture_layer_inputs(self.ft_m, self.layers_prefix, self.ft_layers[0], ids, self.modules,
                                              self.base_params, self.dev, self.batch_size)

    def _calibration_ids(self) -> Optional[torch.Tensor]:
        """The calibration token ids ``[n_samples, seq_len]`` (tokenized once), or None without calibration."""
        if self.ids is not None:
            return self.ids
        if self.calibration is None:
            if not self.warned_no_calibration:
                logger.warning("no calibration data: compressing with round-to-nearest instead of the OBS solver")
            self.warned_no_calibration = True
            return None
        tokenizer, no_tokenizer = self.tokenizer, None
        if tokenizer is None and isinstance(self.finetuned, (str, os.PathLike)) and not isinstance(self.calibration, torch.Tensor):
            from transformers import AutoTokenizer

            try:
                tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(str(self.finetuned))
            except (OSError, ValueError, TypeError, ImportError) as e:  # token ids need none: known below
                why = str(e).splitlines()[0][:200]
                no_tokenizer = f"none could be loaded from the fine-tune {str(self.finetuned)!r}: {why}"
        seq_len = calibration_length(self.ft_m, self.config.seq_len)
        try:
            ids = prepare_calibration(self.calibration, tokenizer, n_samples=self.config.n_samples, seq_len=seq_len,
                                      seed=self.config.seed)
        except DeltaZipError as e:
            if no_tokenizer:
                raise DeltaZipError(f"{e} ({no_tokenizer})") from None
            raise
        vocab = self.ft_m.get_input_embeddings().weight.shape[0]
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise DeltaZipError(f"calibration token ids fall outside the fine-tune's vocabulary of {vocab}: wrong tokenizer?")
        self.ids = ids
        return ids

    def layers(self) -> None:
        """The walk: one decoder layer at a time on the device, on inputs through the compressed layers before it."""
        bar = tqdm(total=len(self.ft_layers), desc="compressing layers", disable=not self.progress, unit="layer")
        for i, ft_layer in enumerate(self.ft_layers):
            report = self._layer(i, ft_layer)
            self.layer_reports.append(report)
            if self.on_layer is not None:
                self.on_layer(report)
            bar.update(1)
        bar.close()

    def _sync(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return time.perf_counter()

    def _layer(self, i: int, ft_layer: nn.Module) -> LayerReport:
        t0 = self._sync()
        conv1d = conv1d_class()
        work = copy.deepcopy(ft_layer).to(self.dev)
        base_layer = self.base_layers[i]
        lin = linear_modules(work)
        hess = _layer_hessians(work, lin, self.targets[i], self.captured) if self.captured is not None else {}
        t1 = self._sync()
        errors = {}
        for rel in self.targets[i]:
            mod = lin[rel]
            full = f"{self.layers_prefix}.{i}.{rel}"
            settings = self.config.for_module(full)
            w_ft = weight_as_nk(mod).float()
            w_b = weight_as_nk(base_layer.get_submodule(rel)).to(self.dev).float()
            delta = w_ft - w_b
            sparsity = settings.sparsity
            if sparsity == "2:4" and delta.shape[1] % 4:
                logger.warning("%s: %d inputs is not a multiple of 4; stored dense instead of 2:4", full, delta.shape[1])
                sparsity = None
            if not bool(delta.any()):
                continue
            h = hess.get(rel)
            transposed = conv1d is not None and isinstance(mod, conv1d)
            bpw = lowrank_bits_per_weight(sparsity)
            if bpw is not None:  # factors of the delta itself; the served codes are what later layers see
                self.modules[full] = lowrank_module(delta, bpw, bits=settings.bits, group_size=settings.group_size,
                                                    symmetric=settings.symmetric, transposed=transposed, hessian=h)
                approx = self.modules[full].dequantize().to(self.dev)
            else:
                if h is not None:
                    res = obs_compress(delta, h, bits=settings.bits, group_size=settings.group_size,
                                       symmetric=settings.symmetric, sparsity=sparsity,
                                       block_size=settings.block_size, damp=settings.damp)
                else:
                    res = rtn_compress(delta, bits=settings.bits, group_size=settings.group_size,
                                       symmetric=settings.symmetric, sparsity=sparsity)
                approx = res.dequantize()
                self.modules[full] = PackedModule.from_codes(
                    res.codes, res.scales, res.zeros, res.mask, bits=res.bits, group_size=res.group_size,
                    symmetric=res.symmetric, two_four=sparsity == "2:4", kind="linear", transposed=transposed,
                )
            if h is not None:
                errors[full] = relative_objective(delta, approx, h)
            else:
                errors[full] = float(((approx - delta).norm() / delta.norm().clamp_min(1e-30)) ** 2)
            new_w = (w_b + approx).to(mod.weight.dtype)
            mod.weight.data = new_w.t().contiguous() if self.modules[full].transposed else new_w
        t2 = self._sync()
        if self.captured is not None:
            for c in self.captured:
                c.hidden = c.run(work, c.hidden)
        del work, hess
        t3 = self._sync()
        self.layer_errors.update(errors)
        return LayerReport(index=i, num_layers=len(self.ft_layers), name=f"{self.layers_prefix}.{i}", seconds=t3 - t0,
                           hessian_seconds=t1 - t0, solver_seconds=t2 - t1, relative_errors=errors)

    def package(self) -> None:
        """The header (base, fingerprint, architecture, facts loaders need) and the CompressedDelta."""
        base_m, ft_m = self.base_m, self.ft_m
        n_params = sum(p.numel() for p in ft_m.parameters())
        base_name, base_source = recorded_location(self.base, base_m)  # what resolve_recorded_base finds again
        header = DeltaHeader(
            library_version=__version__,
            base_model=base_name,
            base_source=base_source,
            base_revision=_base_commit(self.base, base_m, self.base_revision, self.load_kwargs),
            base_fingerprint=base_fingerprint(base_m),
            finetuned_model=recorded_location(self.finetuned, ft_m)[0],
            model_type=getattr(ft_m.config, "model_type", None),
            architectures=[type(ft_m).__name__],
            model_config=ft_m.config.to_dict(),
            config=self.config.to_dict(),
            extra={
                **({"budget": {"target_ratio": self.target_ratio}} if self.target_ratio is not None else {}),
                "finetune_num_params": n_params,
                "vocab_size_base": int(base_m.get_input_embeddings().weight.shape[0]),
                "vocab_size_finetune": int(ft_m.get_input_embeddings().weight.shape[0]),
                "tied_embeddings": bool(self.tied),
                "layers_prefix": self.layers_prefix,
                "solver": "obs" if self.ids is not None else "rtn",
                "calibration_tokens": int(self.ids.numel()) if self.ids is not None else 0,
            },
        )
        gen_cfg = getattr(ft_m, "generation_config", None)
        self.delta = CompressedDelta(config=self.config, modules=self.modules, params=self.params, header=header,
                                     tokenizer=self.tokenizer, generation_config=gen_cfg)
        packed = sum(m.nbytes for m in self.modules.values())
        exact = sum(t.numel() * t.element_size() for t in self.params.values())
        self.delta.summary = {
            "device": str(self.dev),
            "packed_bytes": packed,
            "exact_param_bytes": exact,
            "finetune_fp16_bytes": 2 * n_params,
            "ratio_before_zstd": 2 * n_params / max(1, packed + exact),
            "relative_error": self.layer_errors,
            "layers": [dataclasses.asdict(r) for r in self.layer_reports],
        }


# a relative error as the header's summary stores it: the width of a typical float's repr
_TYPICAL_ERROR = 0.012345678901234567


def _final_norm(model: nn.Module, layers_prefix: str) -> Optional[nn.Module]:
    """The norm between the last decoder layer and the LM head (``model.norm``, ``transformer.ln_f``, ...),
    or None when the model has none or does more there (a projection)."""
    parent_name = layers_prefix.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(parent, "project_out", None) is not None:
        return None
    for attr in ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm"):
        mod = getattr(parent, attr, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def output_fisher(model: nn.Module, ids: torch.Tensor, module_names, *, device, batch_size: int = 1,
                  seed: int = 0) -> dict:
    """The Fisher information of each output channel of the named modules on calibration tokens ``ids``.

    One forward and backward pass of ``model`` (on ``device``, moved back afterwards) with next-token
    labels drawn from the model's own predictions: for a linear module the mean over calibration tokens
    of the squared gradient of the log-likelihood with respect to each output channel (``[N]``); for an
    input embedding the same with respect to each column of the rows it looks up (``[D]``: its output
    scale, as Gemma's, included); for the LM head one value per vocabulary row. Weighting a module's
    squared output error by these values estimates the KL divergence it adds to the model's predictions
    (the budget's ``budget_weighting="fisher"``). Modules the pass never reaches get no entry.
    """
    mods = {name: model.get_submodule(name) for name in module_names}
    emb = model.get_input_embeddings()
    sums: dict = {}
    handles = []

    def add(name, g, scale=1.0):
        sq = g.detach().float().pow(2).reshape(-1, g.shape[-1]).sum(dim=0) * scale
        sums[name] = sq if name not in sums else sums[name] + sq

    def make_hook(name, mod):
        def hook(_mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return
            scale = 1.0
            if mod is emb:  # the gradient reaching a looked-up row is the output's, times the output scale
                rows = mod.weight[args[0]].float()
                scale = float(t.float().norm() / rows.norm().clamp_min(1e-30)) ** 2
                t.requires_grad_(True)  # parameters are frozen: the backward pass starts here
            if t.requires_grad:
                t.register_hook(lambda g: add(name, g, scale))

        return hook

    frozen = {p: p.requires_grad for p in model.parameters()}
    start = {p: p.device for p in model.parameters()}
    start.update({b: b.device for b in model.buffers()})
    single = len({d for d in start.values()}) == 1
    gen = torch.Generator().manual_seed(seed)
    n_tokens = 0
    try:
        for p in frozen:
            p.requires_grad_(False)
        if single:
            model.to(device)
        model_device = next(model.parameters()).device
        for name, mod in mods.items():
            handles.append(mod.register_forward_hook(make_hook(name, mod)))
        with torch.enable_grad():
            for s in range(0, ids.shape[0], batch_size):
                batch = ids[s : s + batch_size].to(model_device)
                logits = model(input_ids=batch, use_cache=False).logits.float()
                with torch.no_grad():
                    probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1).cpu()
                    labels = torch.multinomial(probs, 1, generator=gen).reshape(-1).to(logits.device)
                    del probs
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="sum")
                loss.backward()
                n_tokens += labels.numel()
                del logits, loss, labels
    finally:
        for h in handles:
            h.remove()
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        if single:
            model.to(next(iter(start.values())))
            if torch.device(device).type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()
    return {name: (v / max(n_tokens, 1)).cpu() for name, v in sums.items()}


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
