"""Activation sparsity: zero the small inputs of linear layers, with thresholds calibrated per layer.

Training-free magnitude sparsity (as in TEAL): for each linear layer, the threshold ``t`` below
which an input ``|x_k|`` is set to zero is the ``s``-quantile of ``|x|`` over calibration text,
so about a fraction ``s`` of that layer's inputs is dropped during decoding. Layers reading the
same tensor (q/k/v read the attention input, gate/up the MLP input) see the same distribution and
get the same threshold; o_proj and down_proj get their own. The LM head is left dense.

* :func:`calibrate_activation_thresholds` - thresholds for one or several target sparsities.
* :class:`ActivationThresholds` - the result; ``save(folder)`` writes (or adds a target to)
  ``activation_thresholds.json`` next to a delta or a base; :meth:`ActivationThresholds.load` reads it.
* :func:`install_activation_sparsity` / :func:`remove_activation_sparsity` - apply them to a plain
  transformers model (a pre-forward hook on each ``nn.Linear`` / ``Conv1D``), or to the base of a
  ``DeltaModel`` (``DeltaModel.set_activation_sparsity`` does this; its delta layers call
  :func:`sparsify_module_input` so delta rows see the same sparsified input).

Dropped inputs are exact zeros, so a kernel that skips their weight columns
(``hf_deltazip.kernels.act_sparse``) computes the same result as the dense matmul. On a GPU a
``DeltaModel`` runs its decode steps (one token per row, up to 16 rows; eager or captured) through
those kernels: the threshold and the compensation are applied inside them, the base weights are held
input-major in place, and each delta keeps an input-major copy (``DeltaModel.set_activation_sparsity``,
``kernels=``). Plain transformers models and prompts (several tokens per row) are thresholded in
PyTorch, which is slower than dense: there the option changes the results, not the speed.

**Low-rank compensation** (``rank``, 16 by default for new calibrations): what the dropped inputs
would have added is not thrown away entirely but passed through the layer's best rank-``r``
approximation, ``y = W x_kept + B (A x_dropped)`` with ``B A`` the top ``r`` singular directions of
``W`` (``A = S_r V_r^T``, ``B = U_r``; computed from the weight when the thresholds are installed,
no data needed). At rank 16 an 8B-shaped layer reads 0.5-2 % more weights (``r (in + out)``
against ``in * out``); on Gemma 3 270M it took the NLL increase of 40 % sparsity over whole documents
from +2.6 % to +1.0 % (H200, bf16; less so at a document's late positions: BENCHMARKS.md section 8).
Not supported on a tensor-parallel model (``rank=0`` there). In a ``DeltaModel`` the factors are the base weight's; a delta's
own dropped inputs are not compensated.

**Centred thresholds** (``calibrate_activation_thresholds(..., centre=True)``): each layer also records
its inputs' mean ``mu`` over the calibration tokens; an input is dropped when ``|x_j - mu_j|`` is at or
below the threshold and then stands at ``mu_j`` rather than 0, so the layer keeps ``W mu`` exactly and loses
only the deviations (the compensation passes those through ``B A``). The kernels threshold ``x - mu`` and
the layer adds ``W mu`` and each row's ``D mu`` (a per-slot table kept in step with loads). The centres are
saved beside the thresholds file (``activation_centres.safetensors``).

**Which weights.** In a ``DeltaModel`` decode step of several rows, the base weights serve every row and the
rows' kept inputs together cover nearly every column, so skipping columns saves the base no bytes;
``DeltaModel.set_activation_sparsity`` therefore thresholds the base's input only in steps of at most
``threshold_base_rows`` rows (1 by default) and lets it multiply the whole input, exactly, in larger ones,
where each row's delta still reads only the columns of its own kept inputs (:func:`base_sees_whole_input`).

**Which tokens.** By default every token's inputs are thresholded. ``decode_only=True`` leaves a forward
over several tokens per row (a prompt's prefill) dense and thresholds one-token decode steps only: the
sparse kernels pay only where decoding is memory-bound, and a dense prompt keeps what the answer attends
to exact. Jacobi decoding's wide steps are decode steps too: ``jacobi_generate`` and the decode engine run
them inside ``sparsify_positions_from(0)``, so their output stays the greedy output of the same model.
Since the thresholding is per token, a teacher-forced pass inside :func:`sparsify_positions_from(p)
<hf_deltazip.decoding.scope.sparsify_positions_from>` (positions before ``p`` dense, the rest
thresholded) scores exactly what decode-only generation after a ``p``-token prompt computes.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ..decoding.scope import decode_start, sparsify_positions_from
from ..errors import DeltaZipError
from ..fileio import atomic_write_bytes
from .arch import is_linear, weight_as_nk

__all__ = [
    "THRESHOLDS_FILENAME",
    "CENTRES_FILENAME",
    "ActivationThresholds",
    "calibrate_activation_thresholds",
    "install_activation_sparsity",
    "remove_activation_sparsity",
    "activation_sparsity_of",
    "sparsify_module_input",
    "add_sparsity_correction",
    "base_sees_whole_input",
    "set_input_rule",
    "low_rank_factors",
    "sparsify_positions_from",
    "sparsity_targets",
    "resolve_activation_sparsity",
    "target_modules",
]

THRESHOLDS_FILENAME = "activation_thresholds.json"
CENTRES_FILENAME = "activation_centres.safetensors"  # the centres of centred thresholds, beside the JSON
ALLOCATIONS = ("uniform", "measured")
MEASURED_LEVELS = (0.2, 0.4, 0.6, 0.8)
DEFAULT_RANK = 16  # the low-rank compensation's rank new calibrations record
_FORMAT = "hf-deltazip/activation-thresholds"
_VERSION = 2  # the newest file version read; 2: a target may be centred (older readers must refuse those)


def _target_key(sparsity: float) -> str:
    return f"{float(sparsity):.4f}"


def _check_rank(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"the compensation rank must be an integer >= 0 (0: none), got {rank!r}")
    return rank


def _check_sparsity(sparsity) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"activation sparsity must be a number in [0, 1) (the fraction of inputs dropped), got {sparsity!r}")
    return float(sparsity)


@dataclass(eq=False)  # __eq__ below: the centres are tensors
class ActivationThresholds:
    """Per-layer input thresholds for one target sparsity.

    Attributes:
        sparsity: the fraction of each layer's calibration inputs that falls at or below its threshold.
        thresholds: module name (as in the plain transformers model, e.g.
            ``model.layers.0.self_attn.q_proj``) -> threshold on ``|x|``.
        num_tokens: calibration tokens the thresholds were measured on (0: unknown).
        allocation: how the target was spread over the layers: ``"uniform"`` (every layer drops a fraction
            ``sparsity`` of its inputs) or ``"measured"`` (each layer its own fraction, their mean weighted by
            the layers' weight sizes equal to ``sparsity``; see :func:`calibrate_activation_thresholds`).
        layer_sparsity: module name -> the fraction of its calibration inputs its threshold drops (filled
            for ``"measured"``; empty for ``"uniform"``, where it is ``sparsity`` everywhere).
        rank: the rank of the low-rank compensation of the dropped inputs (0: none; see the module
            docstring). Files written before it existed read as 0.
        centres: module name -> its inputs' mean over the calibration tokens (a float32 vector of the
            layer's input size), for *centred* thresholds: an input ``x_j`` is dropped when
            ``|x_j - mu_j| <= threshold`` and then stands at ``mu_j`` instead of 0, so the layer keeps
            ``W mu`` exactly and loses only the deviations (see ``calibrate_activation_thresholds(centre=True)``).
            Empty: thresholds on ``|x_j|``, dropped inputs 0.
    """

    sparsity: float
    thresholds: dict = field(default_factory=dict)
    num_tokens: int = 0
    allocation: str = "uniform"
    layer_sparsity: dict = field(default_factory=dict)
    rank: int = 0
    centres: dict = field(default_factory=dict)

    def __post_init__(self):
        self.sparsity = _check_sparsity(self.sparsity)
        for name, t in self.thresholds.items():
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
                raise ValueError(f"threshold of {name!r} must be a finite number >= 0, got {t!r}")
        self.thresholds = {str(k): float(v) for k, v in self.thresholds.items()}
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        self.layer_sparsity = {str(k): _check_sparsity(v) for k, v in self.layer_sparsity.items()}
        self.rank = _check_rank(self.rank)
        centres = {}
        for name, c in self.centres.items():
            if str(name) not in self.thresholds:
                raise ValueError(f"a centre for {name!r}, which has no threshold")
            c = torch.as_tensor(c).detach().to("cpu", torch.float32)
            if c.dim() != 1 or c.numel() == 0 or not bool(torch.isfinite(c).all()):
                raise ValueError(f"the centre of {name!r} must be a non-empty finite vector, got shape {tuple(c.shape)}")
            centres[str(name)] = c
        self.centres = centres

    def __eq__(self, other) -> bool:
        if not isinstance(other, ActivationThresholds):
            return NotImplemented
        plain = ("sparsity", "thresholds", "num_tokens", "allocation", "layer_sparsity", "rank")
        return (all(getattr(self, f) == getattr(other, f) for f in plain) and self.centres.keys() == other.centres.keys()
                and all(torch.equal(c, other.centres[n]) for n, c in self.centres.items()))

    def save(self, folder: Union[str, os.PathLike]) -> Path:
        """Write these thresholds into ``folder/activation_thresholds.json`` (atomically), keeping
        the other targets already in the file. Returns the file's path.

        Next to a delta (a ``delta.dz`` in the folder) the file records which delta it was calibrated with;
        once another delta is saved into the folder, loading the thresholds is refused, and the next
        ``save`` starts a fresh file for the new delta. Centred thresholds keep their centres beside it in
        ``activation_centres.safetensors`` (written first; the JSON's version is then 2, which older
        releases refuse rather than apply the thresholds uncentred)."""
        path = Path(folder)
        if path.suffix != ".json":
            path = path / THRESHOLDS_FILENAME
        delta = _delta_beside(path)
        doc = _read(path, check_delta=False) if path.exists() else None
        fresh = doc is None or doc.get("delta") != delta  # none yet, or the targets of a delta saved there before
        if fresh:
            doc = {"format": _FORMAT, "version": 1, "targets": {}}
        if delta is not None:
            doc["delta"] = delta
        key = _target_key(self.sparsity)
        entry = {"num_tokens": self.num_tokens, "thresholds": self.thresholds}
        if self.allocation != "uniform":
            entry.update(allocation=self.allocation, layer_sparsity=self.layer_sparsity)
        if self.rank:
            entry["rank"] = self.rank
        # the centres beside the file (safetensors), this target's replacing what it had there before; written
        # first, so the JSON never names centres that are not on disk
        side = path.parent / CENTRES_FILENAME
        kept = {} if fresh or not side.exists() else {
            k: v for k, v in _read_centres(side).items() if not k.startswith(key + ":")}
        if self.centres:
            entry["centred"] = True
            kept.update({f"{key}:{name}": c.contiguous() for name, c in self.centres.items()})
        if kept or side.exists():
            from safetensors.torch import save as save_tensors

            atomic_write_bytes(side, save_tensors(kept))
        doc["targets"][key] = entry
        doc["version"] = 2 if any(t.get("centred") for t in doc["targets"].values()) else 1
        atomic_write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike], sparsity: float) -> "ActivationThresholds":
        """The thresholds for ``sparsity`` from a thresholds file (or a folder holding one).

        Raises:
            FileNotFoundError: no thresholds file there.
            DeltaZipError: the file is not a thresholds file, or has no target ``sparsity``
                (the message lists the ones it has).
        """
        sparsity = _check_sparsity(sparsity)
        path = _file(path)
        doc = _read(path)
        target = doc["targets"].get(_target_key(sparsity))
        if target is None:
            have = ", ".join(sorted(doc["targets"])) or "none"
            raise DeltaZipError(f"{path} has no thresholds for sparsity {sparsity} (it has: {have}); calibrate them "
                                f"with calibrate_activation_thresholds(model, texts, sparsity={sparsity}) and .save() them")
        centres = {}
        if target.get("centred"):
            side = path.parent / CENTRES_FILENAME
            if not side.is_file():
                raise DeltaZipError(f"{path} has centred thresholds for sparsity {sparsity} but {side.name} (their "
                                    "centres) is not beside it: copy it there, or calibrate again with "
                                    "calibrate_activation_thresholds(..., centre=True) and .save() them")
            prefix = _target_key(sparsity) + ":"
            centres = {k[len(prefix):]: v for k, v in _read_centres(side).items() if k.startswith(prefix)}
            lacking = sorted(set(target.get("thresholds", {})) - set(centres))
            if lacking:
                raise DeltaZipError(f"{side} lacks the centres of {lacking[:3]} for sparsity {sparsity}: calibrate "
                                    "again with calibrate_activation_thresholds(..., centre=True) and .save() them")
        try:
            return cls(sparsity, dict(target["thresholds"]), int(target.get("num_tokens", 0)),
                       target.get("allocation", "uniform"), dict(target.get("layer_sparsity", {})),
                       target.get("rank", 0), centres)
        except (TypeError, ValueError, KeyError) as e:
            raise DeltaZipError(f"{path}: bad thresholds for sparsity {sparsity}: {e}") from e


def _read_centres(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    try:
        return load_tensors(Path(path).read_bytes())
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise DeltaZipError(f"{path} is not a readable safetensors file of activation centres ({e}): delete it and "
                            "calibrate again with calibrate_activation_thresholds(..., centre=True)") from e


def _file(path) -> Path:
    path = Path(path)
    return path / THRESHOLDS_FILENAME if path.is_dir() else path


def _delta_beside(path: Path) -> Optional[str]:
    """The content id of the delta in the thresholds file's folder, if one is there (thresholds saved next to a
    delta are calibrated with it; a delta saved there later makes them stale)."""
    from ..format import DZ_FILENAME, DeltaZipFile

    dz = Path(path).parent / DZ_FILENAME
    if not dz.is_file():
        return None
    with DeltaZipFile(dz) as f:
        return f.content_id


def _read(path: Path, check_delta: bool = True) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DeltaZipError(f"{path} is not valid JSON ({e}): delete it and calibrate again") from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("targets"), dict):
        raise DeltaZipError(f"{path} is not an activation thresholds file (no format {_FORMAT!r})")
    if doc.get("version", 0) > _VERSION:
        raise DeltaZipError(f"{path} was written by a newer hf-deltazip (version {doc['version']}): upgrade to read it")
    if check_delta and doc.get("delta") is not None and doc["delta"] != _delta_beside(path):
        raise DeltaZipError(
            f"{path} holds thresholds calibrated with another delta than the one in its folder now (a delta was "
            "saved there after them): calibrate them again with calibrate_activation_thresholds(...) and .save() them"
        )
    return doc


def sparsity_targets(path: Union[str, os.PathLike]) -> list:
    """The target sparsities a thresholds file (or a folder holding one) has thresholds for."""
    return sorted(float(k) for k in _read(_file(path))["targets"])


# --------------------------------------------------------------------------- which modules
def _transformers_root(model: nn.Module) -> nn.Module:
    # a wrapper holding the transformers model as .base_model (DeltaModel): names are the inner model's
    from transformers import PreTrainedModel

    inner = dict(model.named_children()).get("base_model")
    if isinstance(inner, nn.Module) and not isinstance(model, PreTrainedModel):
        return inner
    return model


def target_modules(model: nn.Module) -> dict:
    """``{name: module}`` of the linear layers activation sparsity applies to: every ``nn.Linear`` /
    ``Conv1D`` but the output embedding (LM head), under its name in the plain transformers model
    (a ``DeltaModel``'s wrappers' ``.base_layer`` left out of the name)."""
    root = _transformers_root(model)
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    out = {}
    for name, mod in root.named_modules():
        if is_linear(mod) and mod is not head and not _wraps(mod, head):
            out[name.replace(".base_layer", "")] = mod
    return out


def _wraps(mod, head) -> bool:
    return head is not None and getattr(head, "base_layer", None) is mod


# --------------------------------------------------------------------------- applying
class _Rule:
    """What happens to one module's input: thresholding (and the low-rank compensation of what it
    drops), or recording for calibration."""

    def __init__(self, threshold: Optional[float] = None, recorder=None, decode_only: bool = False,
                 factors: Optional[tuple] = None, base_rows: Optional[int] = None,
                 centre: Optional[torch.Tensor] = None):
        self.threshold = threshold
        self.recorder = recorder
        self.decode_only = decode_only
        self.factors = factors  # (A [r, in], B [out, r]) or None
        self.base_rows = base_rows  # the base sees its whole input in one-token steps of more rows (None: never)
        self.centre = centre  # float32 [in] (centred thresholds: a dropped input stands at its centre) or None
        self.input_rule = None  # a callable replacing the thresholding (set_input_rule), or None
        self.handles = []
        self.last_out = None  # weakref to the last tensor produced: not processed twice
        self.pending = None  # (input, thresholded input) of the call in flight through the hooks
        self._kernel_factors = None  # ((dtype, device), the kernels' (A^T, B)), made on first use
        self._centres = {}  # (dtype, device) -> the centre there; (dtype, device, "w") -> (centre, W centre)

    def __getstate__(self):  # a pickled or deep-copied module's hook: no weak reference, nothing in flight
        return {**self.__dict__, "last_out": None, "pending": None, "handles": [], "_kernel_factors": None,
                "_centres": {}}

    def centre_as(self, dtype: torch.dtype, device) -> Optional[torch.Tensor]:
        """The centre in ``dtype`` on ``device`` (made once; ``None``: thresholds on ``|x|``)."""
        if self.centre is None:
            return None
        key = (dtype, torch.device(device))
        c = self._centres.get(key)
        if c is None:
            c = self._centres[key] = self.centre.to(device, dtype)
        return c

    def kernel_centre(self, module: nn.Module, dtype: torch.dtype, device) -> Optional[tuple]:
        """``(centre [in], W centre + bias [out])`` in ``dtype`` for the kernel route, where the kernels threshold
        ``x - centre`` and take the second as the layer's bias (made once per dtype and device; ``None``: not
        centred)."""
        if self.centre is None:
            return None
        key = (dtype, torch.device(device), "w")
        got = self._centres.get(key)
        if got is None:
            wc = _dense_weight(module).to(device).float() @ self.centre.to(device, torch.float32)
            bias = getattr(module, "bias", None)
            if bias is not None:
                wc = wc + bias.detach().to(device, torch.float32)
            got = self._centres[key] = (self.centre_as(dtype, device), wc.to(dtype))
        return got

    def kernel_lowrank(self, dtype: torch.dtype, device) -> Optional[tuple]:
        """The compensation's factors as the activation-sparse kernels take them (``lowrank=``), in ``dtype``
        on ``device`` (made once)"""
        if self.factors is None:
            return None
        key = (dtype, torch.device(device))
        if self._kernel_factors is None or self._kernel_factors[0] != key:
            from ..kernels.act_sparse import input_major_low_rank

            a, b = self.factors
            self._kernel_factors = (key, input_major_low_rank([(a.to(device, dtype), b.to(device, dtype))]))
        return self._kernel_factors[1]

    def base_exact(self, x) -> bool:
        """Whether the base multiplies all of ``x``: always with ``base_rows == 0``; else in a step of one token
        per row (what decoding feeds a layer) with more than ``base_rows`` rows, outside a
        :func:`sparsify_positions_from` block."""
        if self.base_rows is None or self.recorder is not None or self.threshold is None or not torch.is_tensor(x):
            return False
        if self.base_rows == 0:
            return True
        if x.dim() < 2 or (x.dim() >= 3 and x.shape[-2] != 1) or x.shape[-1] == 0 or decode_start() is not None:
            return False
        return x.numel() // x.shape[-1] > self.base_rows

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_rule is not None:
            return self.input_rule(x)
        c = self.centre_as(x.dtype, x.device)
        if c is None:
            return torch.where(x.abs() > self.threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return torch.where((x - c).abs() > self.threshold, x, c.expand_as(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(x) or (self.last_out is not None and self.last_out() is x):
            return x
        if self.recorder is not None:
            self.recorder(x)
            y = x
        else:
            start = decode_start()
            if start is not None and x.dim() >= 3:  # [..., tokens, features]: the prompt's part stays dense
                y = x.clone()
                y[..., start:, :] = self._drop(x[..., start:, :])
            elif self.decode_only and x.dim() >= 3 and x.shape[-2] > 1:  # a prefill (Jacobi steps set a start)
                y = x
            else:
                y = self._drop(x)
        self.last_out = weakref.ref(y)
        return y

    def correction(self, x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """``B (A (x - y))``: the dropped inputs through the layer's rank-r approximation (``None``: no factors)."""
        if self.factors is None or y is x:
            return None
        a, b = self.factors
        d = (x - y).to(a.dtype)
        return nn.functional.linear(nn.functional.linear(d, a), b)


_RULES: "weakref.WeakKeyDictionary[nn.Module, _Rule]" = weakref.WeakKeyDictionary()


def sparsify_module_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``module``'s installed activation sparsity leaves it (``x`` itself when none is)."""
    rule = _RULES.get(module)
    return x if rule is None else rule(x)


def has_activation_sparsity(module: nn.Module) -> bool:
    """Whether thresholds are installed on ``module`` (not a calibration's recorder)."""
    rule = _RULES.get(module)
    return rule is not None and rule.recorder is None


def kernel_sparsity(module: nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """``(threshold, lowrank, centre)`` when ``module``'s installed thresholds apply to all of ``x`` and the
    activation-sparse kernels can apply them (``lowrank``: the compensation's factors in kernel form, or
    ``None``; ``centre``: for centred thresholds ``(mu, W mu + bias)``, the kernels then threshold ``x - mu``
    and take ``W mu + bias`` as the bias (each delta's ``D mu`` is the caller's), else ``None``); ``None`` when nothing is installed,
    thresholds are being recorded, a prompt's part of ``x`` stays dense (``decode_start``), or the
    compensation's rank is above what the kernels take (``kernels.act_sparse.LOWRANK_MAX_RANK``; such layers
    stay on the PyTorch route)."""
    from ..kernels.act_sparse import LOWRANK_MAX_RANK

    rule = _RULES.get(module)
    if rule is None or rule.recorder is not None or rule.threshold is None or decode_start() is not None \
            or rule.input_rule is not None:
        return None
    if rule.factors is not None and rule.factors[0].shape[0] > LOWRANK_MAX_RANK:
        return None
    return rule.threshold, rule.kernel_lowrank(x.dtype, x.device), rule.kernel_centre(module, x.dtype, x.device)


def set_input_rule(module: nn.Module, rule: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Replace how the thresholds installed on ``module`` drop its inputs: ``rule(x)`` gives what the layer sees
    (``None``: the thresholds again). For trying other rules on the PyTorch route (``python -m
    hf_deltazip.bench.act_sparsity rotation`` thresholds in a rotated basis): the compensation sees
    ``x - rule(x)``, prompts stay dense as the thresholds were installed, and the activation-sparse kernels,
    which apply only thresholds, leave the module alone (:func:`kernel_sparsity` gives ``None``).

    Raises:
        ValueError: no thresholds are installed on ``module`` (:func:`install_activation_sparsity` first).
    """
    installed = _RULES.get(module)
    if installed is None or installed.recorder is not None:
        raise ValueError("no activation sparsity is installed on this module: install thresholds first "
                         "(install_activation_sparsity), then replace their rule")
    installed.input_rule = rule


def base_sees_whole_input(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module``'s installed thresholds leave its base weight the whole of ``x``: a one-token step of
    more rows than the ``threshold_base_rows`` they were installed with, or any forward when that was ``0``
    (only the deltas' inputs are then thresholded; see :func:`install_activation_sparsity`). ``False`` where
    no thresholds are installed or ``threshold_base_rows`` was ``None``."""
    rule = _RULES.get(module)
    return rule is not None and rule.base_exact(x)


def add_sparsity_correction(module: nn.Module, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor,
                            base_weight=None) -> torch.Tensor:
    """``out`` plus what the inputs ``module``'s thresholds dropped from ``x`` would add (``y`` is
    ``sparsify_module_input(module, x)``): through the low-rank compensation, or, in a step where the base
    sees its whole input (:func:`base_sees_whole_input`), through the whole base weight, ``base_weight()``
    (a callable giving it as ``[out, in]``); ``out`` itself when there is nothing to add. For a module whose
    forward the caller computes itself (a ``DeltaModel`` layer); plain modules get it from a hook."""
    rule = _RULES.get(module)
    if rule is not None and base_weight is not None and y is not x and rule.base_exact(x):
        w = base_weight()
        c = nn.functional.linear((x - y).to(w.dtype), w)
    else:
        c = None if rule is None else rule.correction(x, y)
    if c is None:
        return out
    n = c.shape[-1]
    if out.shape[-1] == n:
        return out + c.to(out.dtype)
    out = out.clone()
    out[..., :n] += c.to(out.dtype)  # an output padded wider than the layer (a delta's extra rows)
    return out


def _pre_hook(rule: _Rule, module, args):
    # bound to its rule: a hook carried over by a deep copy of the module (merge_and_unload) does nothing
    if _RULES.get(module) is not rule or not args or rule.base_exact(args[0]):
        return None
    y = rule(args[0])
    if y is args[0]:
        return None
    if rule.factors is not None:
        rule.pending = (args[0], y)
    return (y, *args[1:])


def _post_hook(rule: _Rule, module, args, out):
    if _RULES.get(module) is not rule or rule.pending is None:
        return None
    (x, y), rule.pending = rule.pending, None
    c = rule.correction(x, y)
    return None if c is None or not torch.is_tensor(out) else out + c.to(out.dtype)


def _install_rule(module: nn.Module, rule: _Rule) -> None:
    _uninstall(module)
    rule.handles = [module.register_forward_pre_hook(functools.partial(_pre_hook, rule))]
    if rule.factors is not None:
        rule.handles.append(module.register_forward_hook(functools.partial(_post_hook, rule)))
    _RULES[module] = rule


def _uninstall(module: nn.Module) -> None:
    old = _RULES.pop(module, None)
    if old is not None:
        for h in old.handles:
            h.remove()


def _dense_weight(module: nn.Module) -> torch.Tensor:
    """``[out, in]`` float weight of a linear layer (``Conv1D`` stores it ``[in, out]``; a bitsandbytes
    layer's is dequantized)."""
    from ..quantization import dequantize_module_weight, logical_weight_shape

    if logical_weight_shape(module) is not None:
        return dequantize_module_weight(module)
    w = weight_as_nk(module)
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise DeltaZipError(f"cannot take the low-rank compensation of a {type(module).__name__} with a "
                            f"{w.dtype} weight of shape {tuple(w.shape)}: install the thresholds with rank=0")
    return w.detach()


def _dense_weight_shape(module: nn.Module) -> tuple:
    """``(out, in)`` of a linear layer (without dequantizing a bitsandbytes weight)."""
    from ..quantization import logical_weight_shape

    shape = logical_weight_shape(module)
    return tuple(shape) if shape is not None else tuple(weight_as_nk(module).shape)


def low_rank_factors(weight: torch.Tensor, rank: int, seed: int = 0) -> tuple:
    """``(A [r, in], B [out, r])`` with ``B @ A`` the best rank-``r`` approximation of ``weight``
    ``[out, in]`` (its top singular directions: ``A = S_r V_r^T``, ``B = U_r``), in ``weight``'s dtype.
    Exact SVD for small weights, randomized (fixed seed, the global random state untouched) for large."""
    rank = _check_rank(rank)
    w = weight.detach().float()
    r = min(rank, *w.shape)
    if min(w.shape) <= 1024:
        u, sv, vh = torch.linalg.svd(w, full_matrices=False)
        v = vh.mH
    else:
        with torch.random.fork_rng(devices=[w.device] if w.device.type == "cuda" else []):
            torch.manual_seed(seed)
            u, sv, v = torch.svd_lowrank(w, q=min(r + 16, *w.shape), niter=6)
    a = (v[:, :r] * sv[:r]).mT.contiguous()
    return a.to(weight.dtype), u[:, :r].contiguous().to(weight.dtype)


def remove_activation_sparsity(model: nn.Module) -> None:
    """Turn activation sparsity off on every linear layer of ``model`` (no-op where it is off)."""
    for mod in _transformers_root(model).modules():
        _uninstall(mod)


def _check_base_rows(rows) -> Optional[int]:
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ValueError(f"threshold_base_rows must be None (every step) or an integer >= 0 (the most rows of a decode "
                         f"step whose base input is thresholded), got {rows!r}")
    return rows


def install_activation_sparsity(model: nn.Module, thresholds: Optional[ActivationThresholds], *,
                                strict: bool = True, decode_only: bool = False, rank: Optional[int] = None,
                                threshold_base_rows: Optional[int] = None) -> int:
    """Zero each target layer's inputs with ``|x| <= threshold`` (``None``: turn it off). Returns the
    number of layers thresholded.

    Works on a plain transformers model (a pre-forward hook on each layer) and on a ``DeltaModel``
    (prefer ``DeltaModel.set_activation_sparsity``). Replaces thresholds installed before.
    ``decode_only``: threshold decode steps only; a forward over several tokens per row (a prompt's
    prefill) stays dense, Jacobi steps count as decode steps (see the module docstring).
    ``rank``: the low-rank compensation's rank (``None``: the thresholds' own ``rank``; 0: none). Its
    factors are computed here from each layer's weight (a few seconds for an 8B model on a GPU).
    ``threshold_base_rows``: in a step of one token per row with more rows than this, the base weights
    multiply the whole input (exact: no thresholding, no compensation) and only a ``DeltaModel``'s deltas see
    the thresholded input; a plain model's layers are then not thresholded at all. ``0``: the base multiplies
    the whole input in every forward, prompts and teacher-forced passes included (what a ``DeltaModel``'s
    steps of several rows compute, for measuring their quality). ``None`` (the default here): every step is
    thresholded. Ignored on a tensor-parallel model (every step thresholded there).

    Raises:
        DeltaZipError: ``strict`` and a threshold names a module the model does not have, or the model
            has target layers without a threshold (thresholds of another model); a compensation rank on a
            tensor-parallel model (not supported).
        ValueError: ``threshold_base_rows`` is neither None nor an integer >= 0.
    """
    if thresholds is None:
        remove_activation_sparsity(model)
        return 0
    if not isinstance(thresholds, ActivationThresholds):
        raise TypeError(f"thresholds must be ActivationThresholds (see calibrate_activation_thresholds) or None, "
                        f"got {type(thresholds).__name__}")
    rank = thresholds.rank if rank is None else _check_rank(rank)
    base_rows = _check_base_rows(threshold_base_rows)
    from . import tensor_parallel

    sharded = tensor_parallel.tp_size(_transformers_root(model)) > 1
    if sharded:  # a sharded layer's base shard cannot add the exact product of the dropped inputs
        base_rows = None
    if rank:
        if sharded:
            raise DeltaZipError(
                "the low-rank compensation of dropped inputs is not supported on a tensor-parallel model (its "
                f"weights are sharded over the ranks); these thresholds ask for rank {rank}: install them with rank=0 "
                "(model.set_activation_sparsity(thresholds, rank=0)) or calibrate with rank=0")
    mods = target_modules(model)
    if strict:
        unknown = sorted(set(thresholds.thresholds) - set(mods))
        missing = sorted(set(mods) - set(thresholds.thresholds))
        if unknown or missing:
            what = (f"no module {unknown[:3]}" if unknown else "") + (" and " if unknown and missing else "") + (
                f"no threshold for {missing[:3]}" if missing else "")
            raise DeltaZipError(f"these thresholds do not fit this model ({what}{', ...' if len(unknown) > 3 or len(missing) > 3 else ''}): "
                                "calibrate them on this model, or pass strict=False to apply the ones that fit")
    chosen = [(name, mod, t) for name, mod in mods.items() if (t := thresholds.thresholds.get(name)) is not None]
    for name, mod, _ in chosen:
        c = thresholds.centres.get(name)
        if c is not None and c.numel() != _dense_weight_shape(mod)[1]:
            raise DeltaZipError(f"the centre of {name} has {c.numel()} entries but the layer takes "
                                f"{_dense_weight_shape(mod)[1]} inputs: these thresholds were calibrated on another "
                                "model; calibrate them on this one")
    factors = [low_rank_factors(_dense_weight(mod), rank) if rank else None for _, mod, _ in chosen]
    remove_activation_sparsity(model)  # only now: a refused call leaves what was installed before
    for (name, mod, t), f in zip(chosen, factors):
        _install_rule(mod, _Rule(threshold=t, decode_only=decode_only, factors=f, base_rows=base_rows,
                                 centre=thresholds.centres.get(name)))
    return len(chosen)


def activation_sparsity_of(model: nn.Module) -> dict:
    """``{name: threshold}`` of the layers of ``model`` thresholded now (empty: off)."""
    out = {}
    for name, mod in target_modules(model).items():
        rule = _RULES.get(mod)
        if rule is not None and rule.recorder is None:
            out[name] = rule.threshold
    return out


# --------------------------------------------------------------------------- calibration
class _Sampler:
    """Keeps a uniform random sample (at most ``per_call`` values of each call) of ``|x|``; with ``centre``,
    of ``x`` with each value's input feature, and every feature's sum, for thresholds on ``|x - mean|``."""

    def __init__(self, per_call: int, gen: torch.Generator, centre: bool = False):
        self.per_call = per_call
        self.gen = gen
        self.centre = centre
        self.parts: list = []
        self.feats: list = []  # centre: the input feature of each kept value
        self.total = None  # centre: float64 sum of the inputs, per feature
        self.rows = 0
        self.count = 0
        self.first = None

    def __call__(self, x: torch.Tensor) -> None:
        if self.first is None:  # a fingerprint of the first input: equal for layers that read one tensor
            d = x.detach().double()
            self.first = (tuple(x.shape), float(d.sum()), float(d.pow(2).sum()), float(d.reshape(-1)[0]))
        k = x.shape[-1]
        flat = x.detach().reshape(-1).float()
        v = flat if self.centre else flat.abs()
        idx = None
        if v.numel() > self.per_call:
            idx = torch.randint(0, v.numel(), (self.per_call,), generator=self.gen).to(v.device)
            v = v[idx]
        if self.centre:
            part = x.detach().reshape(-1, k).double().sum(0).cpu()
            self.total = part if self.total is None else self.total + part
            self.rows += flat.numel() // k
            pos = idx if idx is not None else torch.arange(flat.numel(), device=flat.device)
            self.feats.append((pos % k).cpu())
        self.parts.append(v.cpu())
        self.count += x.numel()

    def mean(self) -> torch.Tensor:
        """The inputs' mean per feature (float32; ``centre`` only)."""
        return (self.total / max(self.rows, 1)).float()

    def quantiles(self, qs: Sequence[float]) -> list:
        v = torch.cat(self.parts)
        if self.centre:
            v = (v - self.mean()[torch.cat(self.feats)]).abs()
        v = v.sort().values
        return [_quantile(v, q) for q in qs]


def _quantile(v: torch.Tensor, q: float) -> float:
    """The threshold that drops a fraction ``q`` of the sorted sample ``v`` (0: none, only exact zeros)."""
    return float(v[min(int(math.floor(q * v.numel())), v.numel() - 1)]) if q > 0 else 0.0


def _groups(samplers: dict) -> list:
    """Names of the modules that read one tensor (q/k/v, gate/up), grouped; one group per other module."""
    by_input: dict = {}
    for name, smp in samplers.items():
        by_input.setdefault(smp.first, []).append(name)
    return list(by_input.values())


def _allocate(costs: list, sizes: list, target: float, levels: Sequence[float]) -> list:
    """Greedy allocation: one level index per group, raising the group whose next level adds the least cost
    per weight element skipped, until the size-weighted mean level reaches ``target``. ``costs[g][i]`` is
    group ``g``'s cost at ``levels[i]`` (``levels[0] == 0``)."""
    total = float(sum(sizes))
    at = [0] * len(costs)
    reached = 0.0

    def push(heap, g):
        i = at[g]
        if i + 1 < len(levels):
            step = (costs[g][i + 1] - costs[g][i]) / (sizes[g] * (levels[i + 1] - levels[i]))
            heapq.heappush(heap, (step, g))

    heap: list = []
    for g in range(len(costs)):
        push(heap, g)
    while reached < target * total - 1e-9 and heap:
        _, g = heapq.heappop(heap)
        reached += sizes[g] * (levels[at[g] + 1] - levels[at[g]])
        at[g] += 1
        push(heap, g)
    if reached < target * total - 1e-9:
        raise DeltaZipError(f"activation sparsity {target} is above what the highest measured level allows")
    return at


def _mean_nll(model, batches: list, device, forward_kwargs: dict) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            ids = ids.to(device)
            logits = model(input_ids=ids, **forward_kwargs).logits[:, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             ids[:, 1:].reshape(-1), reduction="sum"))
            count += ids[:, 1:].numel()
    return total / max(count, 1)


def _measured_thresholds(model, samplers: dict, mods: dict, batches: list, device, targets: list, levels: list,
                         tokens: int, forward_kwargs: dict) -> dict:
    """``{target: ActivationThresholds}``: each group of layers reading one tensor thresholded alone at each of
    ``levels`` over the calibration batches; its cost there is the rise of the calibration NLL (non-decreasing in
    the level: a level cannot cost less than a lower one); then :func:`_allocate`."""
    groups = _groups(samplers)
    levels = [0.0] + sorted(levels)
    pooled = [torch.cat([p for n in g for p in samplers[n].parts]).sort().values for g in groups]
    dense = _mean_nll(model, batches, device, forward_kwargs)
    costs = []
    for g, v in zip(groups, pooled):
        row = [0.0]
        for q in levels[1:]:
            for n in g:
                _install_rule(mods[n], _Rule(threshold=_quantile(v, q)))
            try:
                row.append(max(row[-1], _mean_nll(model, batches, device, forward_kwargs) - dense))
            finally:
                for n in g:
                    _uninstall(mods[n])
        costs.append(row)
    sizes = [sum(mods[n].weight.numel() for n in g) for g in groups]
    out = {}
    for t in targets:
        at = _allocate(costs, sizes, t, levels)
        th, per = {}, {}
        for g, v, i in zip(groups, pooled, at):
            for n in g:
                th[n], per[n] = _quantile(v, levels[i]), levels[i]
        out[t] = ActivationThresholds(t, th, tokens, "measured", per)
    return out


def _batches(calibration, tokenizer, max_length: int, batch_size: int) -> Iterable[torch.Tensor]:
    if torch.is_tensor(calibration):
        ids = calibration if calibration.dim() == 2 else calibration[None]
        for i in range(0, ids.shape[0], batch_size):
            yield ids[i : i + batch_size, :max_length]
        return
    rows = list(calibration)
    if rows and isinstance(rows[0], str):
        if tokenizer is None:
            raise ValueError("calibration texts need a tokenizer: pass tokenizer=AutoTokenizer.from_pretrained(...) "
                             "or token ids instead")
        rows = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in rows]
    for r in rows:  # one sequence per pass: no padding enters the statistics
        r = list(r)[:max_length]
        if r:
            yield torch.tensor([r], dtype=torch.long)


def calibrate_activation_thresholds(model: nn.Module, calibration, sparsity: Union[float, Sequence[float]], *,
                                    tokenizer=None, max_length: int = 512, batch_size: int = 8,
                                    samples_per_call: int = 1 << 14, seed: int = 0, allocation: str = "uniform",
                                    levels: Sequence[float] = MEASURED_LEVELS, rank: int = DEFAULT_RANK,
                                    centre: bool = False, **forward_kwargs):
    """Measure per-layer input thresholds that drop a fraction ``sparsity`` of the layers' inputs.

    Runs ``model`` (a transformers causal LM, or a ``DeltaModel``: its active delta, or
    ``delta_names=`` in ``forward_kwargs``) densely over the calibration data and takes, for each
    target layer (:func:`target_modules`), a quantile of ``|x|``:

    * ``allocation="uniform"``: the ``sparsity``-quantile, every layer alike.
    * ``allocation="measured"``: each group of layers that read one tensor (q/k/v, gate/up; every other
      layer alone) its own fraction, one of ``levels`` (or 0), the mean weighted by weight size at least
      ``sparsity`` (so a sparse kernel skips as many weight bytes as with the uniform setting). The cost of
      each group at each level is measured: the calibration NLL with only that group thresholded, minus the
      dense NLL, one more pass over the calibration data per group and level; then the groups are raised
      greedily, cheapest added NLL per skipped weight first. On some models the loss of thresholding sits in
      a few layers (BENCHMARKS.md section 8), which this spares.

    Args:
        model: the model to calibrate (any activation sparsity on it is off while measuring).
        calibration: texts (with ``tokenizer``), a list of token-id lists, or a LongTensor ``[B, T]``.
        sparsity: a target in ``[0, 1)``, or several (one pass measures them all).
        tokenizer: turns texts into ids.
        max_length: tokens per sequence at most.
        batch_size: sequences per pass (tensor input only; lists run one sequence per pass).
        samples_per_call: values of ``|x|`` kept per layer and forward pass (a random subset).
        seed: for that subset.
        allocation: ``"uniform"`` or ``"measured"``, above.
        levels: ``"measured"``: the fractions a group may take besides 0; the largest caps every layer.
        rank: the low-rank compensation the thresholds are applied with (recorded in them; 0: none; see
            the module docstring). It does not change the thresholds.
        centre: *centred* thresholds (``allocation="uniform"`` only): each layer's inputs' mean ``mu`` over the
            calibration tokens is recorded, the threshold is the quantile of ``|x - mu|``, and a dropped input
            stands at ``mu_j`` instead of 0, so the layer keeps ``W mu`` exactly and drops only deviations. On
            Gemma 3 270M at 40 %, decode-only, it took the NLL rise from +6.07 % to +4.90 % (rank 16; no change at
            25 %), but thresholding every token (the prompt too) it is worse: a document's first position is far
            from the means (BENCHMARKS.md section 8). The centres are saved beside the thresholds
            (``activation_centres.safetensors``).

    Returns:
        :class:`ActivationThresholds`, or ``{sparsity: ActivationThresholds}`` for several targets.

    Example:
        >>> th = calibrate_activation_thresholds(model, texts, 0.4, tokenizer=tok)
        >>> th.save("my-delta")  # next to the delta; DeltaModel.from_pretrained(..., activation_sparsity=0.4)
    """
    many = not isinstance(sparsity, (int, float))
    targets = [_check_sparsity(s) for s in (sparsity if many else [sparsity])]
    if not targets:
        raise ValueError("give at least one target sparsity")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    rank = _check_rank(rank)
    if centre and allocation != "uniform":
        raise ValueError("centred thresholds (centre=True) are calibrated with allocation='uniform' only")
    if allocation == "measured":
        levels = [_check_sparsity(q) for q in levels if q > 0]
        if not levels or max(targets) > max(levels):
            raise ValueError(f"allocation='measured' cannot reach sparsity {max(targets)} with levels {levels}: "
                             "give a level at least as high as the target")
    mods = target_modules(model)
    if not mods:
        raise DeltaZipError(f"{type(model).__name__} has no linear layers to sparsify")
    before = {name: _RULES.get(m) for name, m in mods.items()}
    gen = torch.Generator().manual_seed(seed)
    samplers = {name: _Sampler(samples_per_call, gen, centre=centre) for name in mods}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tokens = 0
    was_training = model.training
    try:
        for name, mod in mods.items():
            _install_rule(mod, _Rule(recorder=samplers[name]))
        model.eval()
        with torch.no_grad():
            for ids in _batches(calibration, tokenizer, max_length, batch_size):
                model(input_ids=ids.to(device), **forward_kwargs)
                tokens += ids.numel()
    finally:
        model.train(was_training)
        for name, mod in mods.items():
            _uninstall(mod)
            if before[name] is not None:
                _install_rule(mod, before[name])
    if tokens == 0:
        raise ValueError("the calibration data is empty: give at least one non-empty sequence")
    unused = sorted(n for n, s in samplers.items() if not s.parts)
    if unused and len(unused) == len(samplers):
        raise DeltaZipError("no linear layer saw an input during calibration: is this a causal LM?")
    if allocation == "measured":
        was_training = model.training
        model.eval()
        for mod in mods.values():  # measured from the dense model, whatever was installed before
            _uninstall(mod)
        try:
            out = _measured_thresholds(model, {n: s for n, s in samplers.items() if s.parts}, mods,
                                       list(_batches(calibration, tokenizer, max_length, batch_size)), device,
                                       targets, levels, tokens, forward_kwargs)
        finally:
            model.train(was_training)
            for name, mod in mods.items():  # what was installed before calibrating
                _uninstall(mod)
                if before[name] is not None:
                    _install_rule(mod, before[name])
        for th in out.values():
            th.rank = rank
        return out if many else out[targets[0]]
    per_layer = {n: s.quantiles(targets) for n, s in samplers.items() if s.parts}
    centres = {n: s.mean() for n, s in samplers.items() if s.parts} if centre else {}
    out = {t: ActivationThresholds(t, {n: q[i] for n, q in per_layer.items()}, tokens, rank=rank, centres=centres)
           for i, t in enumerate(targets)}
    return out if many else out[targets[0]]


# --------------------------------------------------------------------------- DeltaModel.from_pretrained
def resolve_activation_sparsity(model: nn.Module, spec, folders: Sequence = (), calibration=None,
                                tokenizer=None, tokenizer_from: Sequence = ()) -> Optional[ActivationThresholds]:
    """The thresholds ``DeltaModel.from_pretrained(activation_sparsity=spec)`` asks for.

    ``spec``: ``None`` (off); :class:`ActivationThresholds`; a thresholds file or folder; or a target
    sparsity, read from the first of ``folders`` (the delta's folder, then a local base's) holding a
    thresholds file with that target, else calibrated on ``model`` from ``calibration`` when given
    (texts are tokenized with ``tokenizer``, or the first tokenizer found in ``tokenizer_from``).

    Raises:
        DeltaZipError: a target sparsity with no thresholds found and no calibration data (the message
            says how to make them).
    """
    if spec is None or isinstance(spec, ActivationThresholds):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        raise_if_missing = _file(spec)
        if not raise_if_missing.exists():
            raise FileNotFoundError(f"no activation thresholds file at {raise_if_missing}")
        targets = sparsity_targets(raise_if_missing)
        if len(targets) != 1:
            raise DeltaZipError(f"{raise_if_missing} has thresholds for {targets}: pass activation_sparsity=<one of them> "
                                "and put the file next to the delta, or load it with ActivationThresholds.load(path, s)")
        return ActivationThresholds.load(raise_if_missing, targets[0])
    s = _check_sparsity(spec)
    for folder in folders:
        if folder is None:
            continue
        f = _file(folder)
        if f.is_file() and s in [round(t, 4) for t in sparsity_targets(f)]:
            return ActivationThresholds.load(f, s)
    if calibration is not None:
        if tokenizer is None and not torch.is_tensor(calibration) and any(isinstance(c, str) for c in calibration):
            tokenizer = _first_tokenizer(tokenizer_from)
        return calibrate_activation_thresholds(model, calibration, s, tokenizer=tokenizer)
    where = ", ".join(str(f) for f in folders if f is not None) or "the delta folder"
    raise DeltaZipError(
        f"no activation thresholds for sparsity {s} in {where}: pass activation_calibration=<texts or token ids> to "
        f"calibrate them now, or make them once with calibrate_activation_thresholds(model, texts, {s}, tokenizer=tok)"
        f".save(delta_folder)")


def _first_tokenizer(sources: Sequence):
    from transformers import AutoTokenizer

    errors = []
    for src in sources:
        if src is None:
            continue
        try:
            return AutoTokenizer.from_pretrained(str(src))
        except (OSError, ValueError) as e:
            errors.append(f"{src}: {e}")
    raise DeltaZipError("activation_calibration has texts but no tokenizer was found (" + "; ".join(errors)
                        + "): pass token ids instead")
