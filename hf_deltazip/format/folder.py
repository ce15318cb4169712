"""Delta folders on disk: reading their config against the header, and what their bytes are spent on.

A delta folder holds ``delta.dz`` (the container, :mod:`.container`) and ``deltazip_config.json`` (a copy
of the config for tools that do not read ``.dz`` files; the header's config is the truth).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Union

from ..config import CONFIG_NAME, DeltaZipConfig, read_config_json
from ..errors import DeltaZipError, DeltaZipFormatError
from ..packing import lowrank_group_size, num_groups, packed_nbytes
from .container import DZ_FILENAME, DeltaZipFile
from .header import DeltaHeader

__all__ = ["BYTE_CATEGORIES", "categorize_bytes", "load_folder_config", "delta_bytes_report", "resident_nbytes"]

# How the bytes of a delta split up (docs/format.md, section 7).
BYTE_CATEGORIES = ("linear deltas", "scales and zeros", "masks", "embeddings and head", "other parameters")
def categorize_bytes(modules, param_bytes) -> dict:
    """Bytes by category of a delta.

    Args:
        modules: ``(kind, {role: bytes})`` of each compressed module.
        param_bytes: bytes of each exactly stored parameter.
    """
    cats = dict.fromkeys(BYTE_CATEGORIES, 0)
    for kind, stored in modules:
        if kind == "embedding":
            cats["embeddings and head"] += sum(stored.values())
        else:  # the lowrank layout's factors have the same roles per side ("a.qweight", "b.scales", ...)
            for role, nbytes in stored.items():
                last = role.rsplit(".", 1)[-1]
                cats["linear deltas" if last == "qweight" else "scales and zeros" if last in ("scales", "zeros")
                     else "masks"] += nbytes
    cats["other parameters"] += sum(param_bytes)
    return cats


def resident_nbytes(rec, tensor_records: Mapping) -> int:
    """Bytes module ``rec`` (a :class:`~.container.ModuleRecord`) occupies on a GPU once loaded for the
    kernels: its tensors as they are, except bitmask and rows layouts, which are expanded to dense codes."""
    raw = {role: tensor_records[name] for role, name in rec.tensors.items()}
    if rec.sparsity == "lowrank":  # the served codes of the factors' product, on the record's grid
        n, k = rec.shape
        g = num_groups(k, lowrank_group_size(k, rec.group_size))
        # float16 scales, as served codes almost always have (float32 only where a scale leaves float16's range)
        return n * packed_nbytes(k, rec.bits) + n * g * (2 + 1)
    if rec.sparsity not in ("bitmask", "rows"):
        return sum(t.nbytes for t in raw.values())
    n, k = rec.shape
    g = num_groups(k, rec.group_size)
    scale_bytes = 2 if raw["scales"].dtype == "float16" else 4
    return n * packed_nbytes(k, rec.bits) + n * g * (scale_bytes + 1)


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
    recorded = DeltaHeader.from_dict(header).config or None
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


def delta_bytes_report(folder: Union[str, os.PathLike]) -> dict:
    """Bytes by category of a saved delta, and its ratio to the fine-tune in 16-bit (docs/format.md, section 7)."""
    folder = Path(folder)
    dz_path = folder / DZ_FILENAME if folder.is_dir() else folder
    cfg_bytes = (dz_path.parent / CONFIG_NAME).stat().st_size if (dz_path.parent / CONFIG_NAME).exists() else 0
    per_module, stored_by_module = [], []
    with DeltaZipFile(dz_path) as dz:
        total = dz_path.stat().st_size + cfg_bytes
        for name, rec in dz.modules.items():
            stored = {role: dz.stored_bytes(t) for role, t in rec.tensors.items()}
            stored_by_module.append((rec.kind, stored))
            resident = resident_nbytes(rec, dz.tensors)
            per_module.append(
                {"module": name, "kind": rec.kind, "shape": list(rec.shape), "bits": rec.bits,
                 "group_size": rec.group_size, "bytes": sum(stored.values()),
                 "sparsity": rec.sparsity if rec.bands is None else
                 "lowrank[" + "+".join(f"{r}x{b}b" for r, b in rec.bands) + "]",
                 "bits_per_weight": 8 * sum(stored.values()) / (rec.shape[0] * rec.shape[1]),
                 "resident_bytes": resident}
            )
        param_resident = sum(t.nbytes for name, t in dz.tensors.items() if name in set(dz.params.values()))
        cats = categorize_bytes(stored_by_module, [dz.stored_bytes(t) for t in dz.params.values()])
        header = dz.header
    overhead = total - sum(cats.values())
    n_params = header.finetune_num_params
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
        # what the delta occupies on a GPU (dense codes where the file holds bitmask or rows layouts, no zstd)
        "resident_bytes": sum(m["resident_bytes"] for m in per_module) + param_resident,
        "budget": dict(header.extra.get("budget") or {}),
    }
