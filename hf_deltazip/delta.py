"""In-memory deltas: one packed module (:class:`PackedModule`) and a whole fine-tune (:class:`CompressedDelta`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from . import __version__
from .config import CONFIG_NAME, DeltaZipConfig, read_config_json
from .errors import BaseMismatchError, DeltaZipError, DeltaZipFormatError
from .format import DZ_FILENAME, DeltaZipFile, ModuleRecord, write_dz
from .packing import (
    choose_scale_dtype,
    compress_2of4,
    dequantize,
    expand_2of4,
    expand_groups,
    pack_bits,
    pack_codes,
    unpack_bits,
    unpack_codes,
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass
class PackedModule:
    """One compressed weight delta ``[N, K]`` in its stored layout (docs/format.md, section 3)."""

    kind: str
    shape: tuple
    bits: int
    group_size: int
    symmetric: bool
    sparsity: str  # "dense" | "2:4" | "bitmask"
    transposed: bool
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    positions: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    nnz: Optional[int] = None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        mask: Optional[torch.Tensor],
        *,
        bits: int,
        group_size: int,
        symmetric: bool,
        two_four: bool = False,
        kind: str = "linear",
        transposed: bool = False,
    ) -> "PackedModule":
        """Pack dense codes ``[N, K]`` (pruned entries hold the zero point) and their grid.

        ``mask`` (bool, True = kept) selects the sparse layout: 2:4 when ``two_four``, else a bitmask.
        """
        n, k = codes.shape
        codes = codes.to(torch.uint8).cpu()
        scales = scales.float().cpu()
        scales = scales.to(choose_scale_dtype(scales))
        zeros = zeros.to(torch.uint8).cpu()
        common = dict(kind=kind, shape=(n, k), bits=bits, group_size=group_size, symmetric=symmetric,
                      transposed=transposed, scales=scales, zeros=zeros)
        if mask is None:
            return cls(sparsity="dense", qweight=pack_codes(codes, bits), **common)
        mask = mask.bool().cpu()
        if two_four:
            kept, positions = compress_2of4(codes, mask)
            return cls(sparsity="2:4", qweight=pack_codes(kept, bits), positions=pack_bits(positions, 2), **common)
        kept = codes[mask]
        return cls(
            sparsity="bitmask",
            qweight=pack_codes(kept.reshape(1, -1), bits).reshape(-1),
            mask=pack_bits(mask.to(torch.uint8), 1),
            nnz=int(kept.numel()),
            **common,
        )

    # ------------------------------------------------------------------ decoding
    def kept_mask(self) -> Optional[torch.Tensor]:
        n, k = self.shape
        if self.sparsity == "bitmask":
            return unpack_bits(self.mask, 1, k).bool()
        if self.sparsity == "2:4":
            pos = unpack_bits(self.positions, 2, k // 2)
            return expand_2of4(torch.ones(n, k // 2, dtype=torch.bool, device=pos.device), pos, k, fill=False)
        return None

    def dense_codes(self) -> torch.Tensor:
        """Codes ``[N, K]`` with pruned weights at their group's zero point (the device layout)."""
        n, k = self.shape
        if self.sparsity == "dense":
            return unpack_codes(self.qweight, self.bits, k)
        zero_codes = expand_groups(self.zeros, k, self.group_size).to(torch.uint8)
        if self.sparsity == "2:4":
            kept = unpack_codes(self.qweight, self.bits, k // 2)
            pos = unpack_bits(self.positions, 2, k // 2)
            dense = expand_2of4(kept, pos, k)
            return torch.where(self.kept_mask(), dense, zero_codes)
        mask = self.kept_mask()
        if int(mask.sum()) != self.nnz:
            raise DeltaZipFormatError("<module>", f"bitmask keeps {int(mask.sum())} weights, nnz says {self.nnz}")
        kept = unpack_codes(self.qweight.reshape(1, -1), self.bits, self.nnz).reshape(-1)
        dense = zero_codes.clone()
        dense[mask] = kept
        return dense

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The delta ``[N, K]`` this module stores."""
        return dequantize(self.dense_codes(), self.scales, self.zeros, self.group_size, dtype)

    def to_dense_layout(self) -> "PackedModule":
        """Bitmask layout -> dense layout (what kernels read); other layouts are returned as they are."""
        if self.sparsity != "bitmask":
            return self
        return PackedModule(
            kind=self.kind, shape=self.shape, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
            sparsity="dense", transposed=self.transposed, qweight=pack_codes(self.dense_codes(), self.bits),
            scales=self.scales, zeros=self.zeros,
        )

    # ------------------------------------------------------------------ storage
    def tensors(self) -> dict:
        out = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        if self.positions is not None:
            out["positions"] = self.positions
        if self.mask is not None:
            out["mask"] = self.mask
        return out

    def record(self, name: str) -> ModuleRecord:
        return ModuleRecord(
            kind=self.kind, shape=tuple(self.shape), bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, sparsity=self.sparsity, transposed=self.transposed,
            tensors={role: f"{name}.{role}" for role in self.tensors()}, nnz=self.nnz,
        )

    @classmethod
    def from_record(cls, rec: ModuleRecord, tensors: dict) -> "PackedModule":
        return cls(
            kind=rec.kind, shape=tuple(rec.shape), bits=rec.bits, group_size=rec.group_size, symmetric=rec.symmetric,
            sparsity=rec.sparsity, transposed=rec.transposed, qweight=tensors["qweight"], scales=tensors["scales"],
            zeros=tensors["zeros"], positions=tensors.get("positions"), mask=tensors.get("mask"), nnz=rec.nnz,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())



@dataclass
class CompressedDelta:
    """A compressed fine-tune: packed module deltas, exactly stored parameters and metadata.

    Made by :func:`hf_deltazip.compress`; saved with :meth:`save_pretrained`; loaded onto a base by
    :class:`hf_deltazip.DeltaModel`.
    """

    config: DeltaZipConfig
    modules: dict = field(default_factory=dict)  # name -> PackedModule
    params: dict = field(default_factory=dict)  # name -> tensor (the fine-tune's exact value)
    header: dict = field(default_factory=dict)  # base_model, base_fingerprint, model_config, ...
    tokenizer: object = None
    generation_config: object = None
    summary: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: Union[str, os.PathLike], num_threads: Optional[int] = None) -> Path:
        """Write ``deltazip_config.json``, ``delta.dz`` and, when known, the tokenizer and generation config.

        Every file is written atomically: an interrupted save keeps an earlier good delta intact.
        """
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, records = {}, {}
        for name, mod in self.modules.items():
            rec = mod.record(name)
            records[name] = rec
            for role, t in mod.tensors().items():
                tensors[rec.tensors[role]] = t
        params = {}
        for name, t in self.params.items():
            tensors[f"param::{name}"] = t
            params[name] = f"param::{name}"
        header = dict(self.header)
        header.setdefault("library_version", __version__)
        header["config"] = self.config.to_dict()
        header.setdefault("extra", {})
        write_dz(directory / DZ_FILENAME, tensors, records, params, header, self.config.zstd_level, num_threads)
        self.config.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(directory)
        return directory

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike], **hub_kwargs) -> "CompressedDelta":
        """Read a delta folder (or Hub id) fully into memory."""
        folder = resolve_delta_folder(path, **hub_kwargs)
        with DeltaZipFile(folder / DZ_FILENAME) as dz:
            header = dict(dz.header)
            config = load_folder_config(folder, header)
            modules = {name: PackedModule.from_record(rec, dz.module_tensors(name)) for name, rec in dz.modules.items()}
            params = {name: dz.get_tensor(t) for name, t in dz.params.items()}
        return cls(config=config, modules=modules, params=params, header=header)

    def push_to_hub(self, repo_id: str, *, private: Optional[bool] = None, revision: Optional[str] = None,
                    commit_message: Optional[str] = None, token: Optional[str] = None,
                    quality: Optional[dict] = None):
        """Save, add a generated model card, and upload as one commit to the Hub repo ``repo_id``.

        The repo is created if needed. Returns the commit's ``huggingface_hub.CommitInfo``
        (``.oid`` is the commit sha to pin loads to).
        """
        import tempfile

        from .hub import push_delta_folder

        with tempfile.TemporaryDirectory(prefix="deltazip-") as tmp:
            self.save_pretrained(tmp)
            return push_delta_folder(tmp, repo_id, private=private, revision=revision,
                                     commit_message=commit_message, token=token, quality=quality)



def resolve_delta_folder(path_or_id: Union[str, os.PathLike], **hub_kwargs) -> Path:
    """A local delta folder as it is, or a Hub repo id downloaded through huggingface_hub's cache."""
    p = Path(path_or_id)
    if p.is_dir():
        if not (p / CONFIG_NAME).is_file() or not (p / DZ_FILENAME).is_file():
            raise DeltaZipFormatError(p, f"not a delta folder: it needs {CONFIG_NAME} and {DZ_FILENAME}")
        return p
    if p.is_file() and p.suffix == ".dz":
        raise DeltaZipFormatError(p, f"pass the folder that holds {p.name} and {CONFIG_NAME}, not the .dz file")
    if p.exists() or not _REPO_ID.match(str(path_or_id)):
        raise DeltaZipFormatError(p, "no such delta folder (and not a Hub repo id like 'org/name')")
    from .hub import download_delta

    return Path(download_delta(str(path_or_id), **hub_kwargs))


def load_folder_config(folder: Union[str, os.PathLike], header: Mapping) -> DeltaZipConfig:
    """The config of a delta folder, after checking ``deltazip_config.json`` against the ``.dz`` header.

    ``header`` is the ``DeltaZipFile.header`` of the folder's ``delta.dz``. Its ``config`` entry is the
    config the delta was compressed with and is the truth; ``deltazip_config.json`` is a copy for tools
    that do not read ``.dz`` files. A setting in the JSON that contradicts the header is refused, so
    nothing ever reports settings the delta does not have.

    Returns:
        The header's config (the JSON's only when the header records none).

    Raises:
        DeltaZipFormatError: the JSON contradicts the header (the message names both values), or the
            header's config is invalid.
        DeltaZipConfigError: ``deltazip_config.json`` is missing, not JSON, or holds invalid values.
    """
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    data = read_config_json(config_path)
    in_json = DeltaZipConfig.from_dict(data)
    recorded = header.get("config")
    if recorded is None:
        return in_json
    try:
        truth = DeltaZipConfig.from_dict(recorded)
    except DeltaZipError as e:
        raise DeltaZipFormatError(folder / DZ_FILENAME, f"the header's config is invalid ({e}); re-save the delta") from None
    said, holds = in_json.to_dict(), truth.to_dict()
    wrong = [key for key in data if key in holds and said[key] != holds[key]]
    if wrong:
        pairs = "; ".join(f"{key} is {said[key]!r} but {DZ_FILENAME} was compressed with {holds[key]!r}" for key in wrong)
        fix = ", ".join(f"{key}={holds[key]!r}" for key in wrong)
        raise DeltaZipFormatError(
            config_path,
            f"contradicts {DZ_FILENAME}: {pairs}. The .dz header is what the delta holds: set {fix} in "
            f"{CONFIG_NAME} (or download / save the delta again)",
        )
    return truth


def resolve_recorded_base(header: Mapping) -> str:
    """What to pass to ``from_pretrained`` to load the base a delta was compressed against.

    ``header`` is a ``.dz`` header. :func:`hf_deltazip.compress` records a Hub base as its repo id (with
    ``base_revision``, the commit to load) and a local base as an absolute folder, marked by
    ``base_source`` (``"hub"`` or ``"local"``). Returns the Hub id, or the folder when it exists.

    A local base that is no longer there is reported at once, not taken for a Hub id and retried over
    the network. In deltas written before ``base_source`` existed, a name that is no local folder is
    taken for a Hub id when it can be one (``org/name``); an absolute or ``./`` path is reported missing.

    Raises:
        BaseMismatchError: the delta records no base, or its local base is missing; the message says
            to pass ``base=``.
    """
    name = header.get("base_model")
    if not name or not isinstance(name, str):
        raise BaseMismatchError("the delta records no base model: pass base= (the base model, its folder or its Hub id)")
    source = header.get("base_source")
    if source == "hub":
        return str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if source == "local" or path.is_absolute() or name.startswith((".", "~")) or not _REPO_ID.match(name):
        raise BaseMismatchError(
            f"the delta was compressed against the local base model {name!r}, which is not there (moved or "
            "deleted?): pass base= with that model (loaded, its folder or its Hub id)"
        )
    return str(name)


def recorded_location(given, model) -> tuple:
    """``(name, source)`` that :func:`resolve_recorded_base` can find again for a model passed as ``given``.

    ``given`` is what the caller passed (a Hub id, a path, or the model itself, whose config's
    ``_name_or_path`` is then used). A name that is an existing local folder is recorded as its absolute
    path with source ``"local"``; any other name as a Hub id, source ``"hub"``. ``(None, None)`` when
    nothing names the model.
    """
    if isinstance(given, (str, os.PathLike)):
        name = os.fspath(given)
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if not name:
        return None, None
    path = Path(name).expanduser()
    if path.exists():
        return str(path.resolve()), "local"
    return str(name), "hub"


def delta_bytes_report(folder: Union[str, os.PathLike]) -> dict:
    """Bytes by category of a saved delta, and its ratio to the fine-tune in 16-bit (docs/format.md, section 7)."""
    folder = Path(folder)
    dz_path = folder / DZ_FILENAME if folder.is_dir() else folder
    cfg_bytes = (dz_path.parent / CONFIG_NAME).stat().st_size if (dz_path.parent / CONFIG_NAME).exists() else 0
    cats = {"linear deltas": 0, "scales and zeros": 0, "masks": 0, "embeddings and head": 0, "other parameters": 0}
    per_module = []
    with DeltaZipFile(dz_path) as dz:
        total = dz_path.stat().st_size + cfg_bytes
        for name, rec in dz.modules.items():
            stored = {role: dz.stored_bytes(t) for role, t in rec.tensors.items()}
            if rec.kind == "embedding":
                cats["embeddings and head"] += sum(stored.values())
            else:
                cats["linear deltas"] += stored["qweight"]
                cats["scales and zeros"] += stored["scales"] + stored["zeros"]
                cats["masks"] += stored.get("positions", 0) + stored.get("mask", 0)
            per_module.append(
                {"module": name, "kind": rec.kind, "shape": list(rec.shape), "bits": rec.bits,
                 "group_size": rec.group_size, "sparsity": rec.sparsity, "bytes": sum(stored.values()),
                 "bits_per_weight": 8 * sum(stored.values()) / (rec.shape[0] * rec.shape[1])}
            )
        for name, t in dz.params.items():
            cats["other parameters"] += dz.stored_bytes(t)
        header = dict(dz.header)
    overhead = total - sum(cats.values())
    n_params = int(header.get("extra", {}).get("finetune_num_params", 0))
    fp16_bytes = 2 * n_params
    return {
        "path": str(dz_path),
        "header": header,
        "total_bytes": total,
        "categories": cats,
        "container_and_config_bytes": overhead,
        "finetune_fp16_bytes": fp16_bytes,
        "ratio": fp16_bytes / total if n_params else None,
        "modules": per_module,
    }
