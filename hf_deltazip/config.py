"""`DeltaZipConfig`: every setting of a compression, validated, and saved as JSON."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from .display import delta_table_html, html_section
from .errors import DeltaZipConfigError

CONFIG_NAME = "deltazip_config.json"
FORMAT_VERSION = 1

ALLOWED_BITS = (2, 3, 4, 8)
STORAGE_CHOICES = ("quantize", "exact")
EXACT_CHOICES = ("exact", "float16")
BUDGET_WEIGHTINGS = ("fisher", "output")

# The settings that may differ from one module to another (``overrides``).
MODULE_SETTINGS = ("bits", "sparsity", "group_size", "symmetric", "block_size", "damp")

Sparsity = Union[None, str, float]


def _check_bits(bits, where="bits"):
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ALLOWED_BITS:
        raise DeltaZipConfigError(f"{where} must be one of {list(ALLOWED_BITS)}, got {bits!r}")


def lowrank_bits_per_weight(sparsity) -> Optional[float]:
    """``x`` of a ``"lowrank:x"`` setting (factors of ``x`` bits per weight of the module), else None."""
    if isinstance(sparsity, str) and sparsity.startswith("lowrank:"):
        try:
            x = float(sparsity[len("lowrank:"):])
        except ValueError:
            return None
        return x if 0 < x <= 16 and math.isfinite(x) else None
    return None


def _check_sparsity(sparsity, where="sparsity"):
    if sparsity is None or sparsity == "2:4" or lowrank_bits_per_weight(sparsity) is not None:
        return
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not (0 < float(sparsity) < 1):
        raise DeltaZipConfigError(
            f'{where} must be None (dense), "2:4", a fraction of weights to prune in (0, 1), or "lowrank:x" '
            f'(a low-rank delta whose factors take x bits per weight, 0 < x <= 16), got {sparsity!r}'
        )


def _check_group_size(group_size, where="group_size"):
    ok = (
        isinstance(group_size, int)
        and not isinstance(group_size, bool)
        and (group_size == -1 or (32 <= group_size <= 1024 and group_size & (group_size - 1) == 0))
    )
    if not ok:
        raise DeltaZipConfigError(
            f"{where} must be -1 (one scale per output row) or a power of two from 32 to 1024, got {group_size!r}"
        )


def _check_positive_int(value, where):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DeltaZipConfigError(f"{where} must be a positive integer, got {value!r}")


def _check_bool(value, where):
    if not isinstance(value, bool):
        raise DeltaZipConfigError(f"{where} must be true or false, got {value!r}")


def _check_damp(value, where="damp"):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < 1) or math.isnan(value):
        raise DeltaZipConfigError(f"{where} must be a number in (0, 1) (a fraction of the mean Hessian diagonal), got {value!r}")


def _check_patterns(value, where):
    if value is None:
        return
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise DeltaZipConfigError(f"{where} must be a list of glob patterns such as ['*.mlp.*'], got {value!r}")


@dataclass(frozen=True)
class ModuleSettings:
    """The resolved compression settings of one module (the config with its overrides applied)."""

    bits: int
    sparsity: Sparsity
    group_size: int
    symmetric: bool
    block_size: int
    damp: float


@dataclass(repr=False)
class DeltaZipConfig:
    """How a fine-tune's delta is compressed.

    Every field is validated when the config is made; a bad value raises
    :class:`~hf_deltazip.errors.DeltaZipConfigError` naming the allowed values.

    Example:
        >>> from hf_deltazip import DeltaZipConfig
        >>> config = DeltaZipConfig(bits=2, sparsity="2:4", overrides={"*.lm_head": {"bits": 4}})
        >>> config.for_module("model.layers.0.mlp.up_proj").bits
        2
    """

    bits: int = field(default=4, metadata={"help": "Bits per kept delta weight: 2, 3, 4 or 8."})
    sparsity: Sparsity = field(
        default=None,
        metadata={"help": 'None (dense), "2:4" (2 of every 4 inputs kept), a fraction in (0, 1) pruned unstructured, or '
                          '"lowrank:x": singular directions in bands of 8/4/3/2 bits taking x bits per weight (linear layers, and '
                          'embeddings and the LM head through overrides or the budget; served as bits-bit codes on '
                          'group_size groups rebuilt from them on load).'},
    )
    group_size: int = field(
        default=128, metadata={"help": "Inputs sharing one scale and zero point; -1 = one per output row."}
    )
    symmetric: bool = field(default=True, metadata={"help": "Symmetric grid (fixed zero point) or asymmetric."})
    block_size: int = field(default=128, metadata={"help": "Columns the OBS solver updates together (not the group size)."})
    damp: float = field(default=0.01, metadata={"help": "Hessian damping, as a fraction of its mean diagonal."})
    n_samples: int = field(default=128, metadata={"help": "Calibration sequences."})
    seq_len: int = field(default=512, metadata={"help": "Tokens per calibration sequence."})
    target_modules: Optional[list] = field(
        default=None,
        metadata={"help": "Glob patterns of linear modules to compress; None = every linear layer in the decoder blocks."},
    )
    skip_modules: list = field(default_factory=list, metadata={"help": "Glob patterns of modules never compressed."})
    embeddings: str = field(
        default="quantize",
        metadata={"help": '"quantize" (round-to-nearest, per row) or "exact" for input embeddings and the LM head.'},
    )
    embedding_bits: int = field(default=4, metadata={"help": "Bits for the embedding and LM-head deltas."})
    embedding_group_size: int = field(default=128, metadata={"help": "Group size of the embedding and LM-head deltas."})
    norms_and_biases: str = field(
        default="exact", metadata={"help": '"exact" (the fine-tune\'s values as they are) or "float16".'}
    )
    zstd_level: int = field(default=9, metadata={"help": "zstd level, 1 (fast) to 22 (small); 0 = no zstd."})
    overrides: dict = field(
        default_factory=dict,
        metadata={"help": "Glob pattern -> partial settings (bits, sparsity, group_size, symmetric, block_size, damp)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed for calibration sampling."})
    target_ratio: Optional[float] = field(
        default=None,
        metadata={"help": "Whole-file compression ratio to reach (fine-tune in 16-bit / every byte of the saved "
                          "delta); bits, sparsity and group size are then chosen per module (overrides ignored "
                          "for the modules it decides). None = the fixed settings above."},
    )
    # the default candidates are the ones the quality benchmark measured on real pairs (BENCHMARKS.md section 1):
    # from 16x up a module has about one bit per weight or less to spend, so per-row grids and pruning up to 98 %
    budget_bits: list = field(
        default_factory=lambda: [2, 3, 4], metadata={"help": "Bits the target_ratio budget may choose from."})
    budget_sparsity: list = field(
        default_factory=lambda: [None, 0.75, 0.9, 0.95, 0.98],
        metadata={"help": 'Sparsities the budget may choose from (None = dense; "2:4" is not offered to input embeddings; '
                          '"lowrank:x" is offered once, served at the largest budget_bits on the smallest '
                          'budget_group_sizes).'})
    budget_group_sizes: list = field(
        default_factory=lambda: [-1],
        metadata={"help": "Group sizes the budget may choose from (-1: one per output row)."})
    budget_weighting: str = field(
        default="fisher",
        metadata={"help": '"fisher": the budget weights each output channel\'s error by its Fisher information on the '
                          'calibration text (an estimate of the KL divergence a module\'s error adds; needs one '
                          'backward pass of the fine-tune); "output": the plain OBS objective (squared output error).'})
    format_version: int = field(default=FORMAT_VERSION, metadata={"help": "Version of this config's JSON layout."})

    def __post_init__(self):
        if isinstance(self.sparsity, int) and not isinstance(self.sparsity, bool):
            self.sparsity = float(self.sparsity) if self.sparsity else None
        _check_bits(self.bits)
        _check_sparsity(self.sparsity)
        _check_group_size(self.group_size)
        _check_bool(self.symmetric, "symmetric")
        _check_positive_int(self.block_size, "block_size")
        _check_damp(self.damp)
        _check_positive_int(self.n_samples, "n_samples")
        _check_positive_int(self.seq_len, "seq_len")
        _check_patterns(self.target_modules, "target_modules")
        _check_patterns(self.skip_modules, "skip_modules")
        if self.target_modules is not None:
            self.target_modules = list(self.target_modules)
        self.skip_modules = list(self.skip_modules)
        if self.embeddings not in STORAGE_CHOICES:
            raise DeltaZipConfigError(f"embeddings must be one of {list(STORAGE_CHOICES)}, got {self.embeddings!r}")
        _check_bits(self.embedding_bits, "embedding_bits")
        _check_group_size(self.embedding_group_size, "embedding_group_size")
        if self.norms_and_biases not in EXACT_CHOICES:
            raise DeltaZipConfigError(
                f"norms_and_biases must be one of {list(EXACT_CHOICES)}, got {self.norms_and_biases!r}"
            )
        if isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int) or not 0 <= self.zstd_level <= 22:
            raise DeltaZipConfigError(f"zstd_level must be an integer from 0 (off) to 22, got {self.zstd_level!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise DeltaZipConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.target_ratio is not None:
            r = self.target_ratio
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 1:
                raise DeltaZipConfigError(
                    f"target_ratio must be a number above 1 (e.g. 16 for a delta 1/16 of the fine-tune in 16-bit) "
                    f"or None, got {r!r}"
                )
            self.target_ratio = float(r)
        if self.budget_weighting not in BUDGET_WEIGHTINGS:
            raise DeltaZipConfigError(
                f"budget_weighting must be one of {list(BUDGET_WEIGHTINGS)}, got {self.budget_weighting!r}")
        for name, check in (("budget_bits", _check_bits), ("budget_sparsity", _check_sparsity),
                            ("budget_group_sizes", _check_group_size)):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
                raise DeltaZipConfigError(f"{name} must be a non-empty list, got {values!r}")
            for v in values:
                check(v, f"{name} entry")
            setattr(self, name, list(values))
        if self.format_version != FORMAT_VERSION:
            raise DeltaZipConfigError(
                f"format_version {self.format_version!r} is not supported by this hf-deltazip "
                f"(it reads version {FORMAT_VERSION}); upgrade hf-deltazip"
            )
        if not isinstance(self.overrides, dict):
            raise DeltaZipConfigError(f"overrides must map glob patterns to settings, got {self.overrides!r}")
        self.overrides = {str(k): dict(v) for k, v in self.overrides.items()} if all(
            isinstance(v, dict) for v in self.overrides.values()
        ) else _raise_overrides(self.overrides)
        for pattern, settings in self.overrides.items():
            unknown = set(settings) - set(MODULE_SETTINGS)
            if unknown:
                raise DeltaZipConfigError(
                    f"overrides[{pattern!r}] has unknown settings {sorted(unknown)}; allowed: {list(MODULE_SETTINGS)}"
                )
            self._resolve(dict(settings), where=f"overrides[{pattern!r}]")
        if self.sparsity == "2:4" and self.group_size != -1 and self.group_size % 4:
            raise DeltaZipConfigError("2:4 sparsity needs group_size divisible by 4")

    # ------------------------------------------------------------------ module resolution
    def _resolve(self, extra: dict, where: str) -> ModuleSettings:
        values = {name: getattr(self, name) for name in MODULE_SETTINGS}
        values.update(extra)
        _check_bits(values["bits"], f"{where}.bits")
        _check_sparsity(values["sparsity"], f"{where}.sparsity")
        _check_group_size(values["group_size"], f"{where}.group_size")
        _check_bool(values["symmetric"], f"{where}.symmetric")
        _check_positive_int(values["block_size"], f"{where}.block_size")
        _check_damp(values["damp"], f"{where}.damp")
        return ModuleSettings(**values)

    def _matching_overrides(self, name: str) -> dict:
        extra: dict = {}
        for pattern, settings in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                extra.update(settings)
        return extra

    def for_module(self, name: str) -> ModuleSettings:
        """Settings of module ``name``: the defaults, then every matching override in order."""
        return self._resolve(self._matching_overrides(name), where=name)

    def for_embedding(self, name: str) -> ModuleSettings:
        """Settings of an embedding or LM-head delta: ``embedding_bits`` and ``embedding_group_size``
        (dense), then every override matching ``name`` (how a byte budget records its choice)."""
        extra = {"bits": self.embedding_bits, "group_size": self.embedding_group_size, "sparsity": None}
        extra.update(self._matching_overrides(name))
        return self._resolve(extra, where=name)

    def is_target(self, name: str) -> Optional[bool]:
        """Whether a linear module is compressed: False if skipped, True if targeted, None if no pattern decides."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.skip_modules):
            return False
        if self.target_modules is None:
            return None
        return any(fnmatch.fnmatchcase(name, p) for p in self.target_modules)

    # ------------------------------------------------------------------ display
    _ALWAYS_SHOWN = ("bits", "sparsity", "group_size")

    def _changed_settings(self) -> dict:
        """The settings that differ from a default ``DeltaZipConfig()``, in field order."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def key_settings(self) -> dict:
        """``bits``, ``sparsity``, ``group_size`` and every other setting that differs from the default."""
        shown = {name: getattr(self, name) for name in self._ALWAYS_SHOWN}
        shown.update(self._changed_settings())
        return shown

    def __repr__(self) -> str:
        shown = {k: repr(v) for k, v in self.key_settings().items()}
        if self.target_ratio is not None and len(self.overrides) > 3:  # one per module: the count says enough
            shown["overrides"] = f"<{len(self.overrides)} modules>"
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")"

    def _repr_html_(self) -> str:
        changed = self._changed_settings()
        rows = [(f.name, repr(getattr(self, f.name)), "changed" if f.name in changed else "",
                 f.metadata.get("help", "")) for f in dataclasses.fields(self)]
        return html_section(type(self).__name__, delta_table_html(rows, columns=["setting", "value", "", "meaning"]))

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "DeltaZipConfig":
        if not isinstance(data, dict):
            raise DeltaZipConfigError(f"a DeltaZipConfig is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(
                f"DeltaZipConfig: ignoring unknown keys {unknown} (written by a newer hf-deltazip?)", stacklevel=2
            )
        return cls(**{k: v for k, v in data.items() if k in known})

    def save_pretrained(self, save_directory: Union[str, os.PathLike]) -> Path:
        """Write ``deltazip_config.json`` into ``save_directory`` (atomically) and return its path."""
        from .fileio import atomic_write_bytes

        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CONFIG_NAME
        atomic_write_bytes(path, self.to_json_string().encode())
        return path

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "DeltaZipConfig":
        """Read a config from a folder holding ``deltazip_config.json`` or from the JSON file itself."""
        return cls.from_dict(read_config_json(path))


def read_config_json(path: Union[str, os.PathLike]) -> dict:
    """The JSON object in ``deltazip_config.json`` (``path`` is that file or the folder holding it), unvalidated."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise DeltaZipConfigError(f"{p} not found: is this an hf-deltazip delta folder?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DeltaZipConfigError(f"{p} is not valid JSON ({e}); re-save the config") from None


def _raise_overrides(overrides):
    raise DeltaZipConfigError(f"overrides must map glob patterns to dicts of settings, got {overrides!r}")
