"""In-memory deltas: one packed module (:class:`PackedModule`) and a whole fine-tune (:class:`CompressedDelta`)."""

from __future__ import annotations

import math
import os
import re
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

from . import __version__
from .config import CONFIG_NAME, DeltaZipConfig
from .display import delta_table_html, format_bytes, format_ratio, html_section
from .errors import BaseMismatchError, DeltaZipFormatError
from .fileio import staged_writes
from .format import DZ_FILENAME, DeltaHeader, DeltaZipFile, ModuleRecord, write_dz
# re-exported: what a delta folder on disk holds (read by CLI, hub and loaders through this module too)
from .format.folder import BYTE_CATEGORIES, categorize_bytes, delta_bytes_report, load_folder_config  # noqa: F401
from .packing import (
    choose_scale_dtype,
    compress_2of4,
    compute_qparams,
    lowrank_group_size,
    dequantize,
    expand_2of4,
    expand_groups,
    pack_bits,
    packed_nbytes,
    pack_codes,
    quantize,
    unpack_bits,
    unpack_codes,
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")

# The parts of ``CompressedDelta.summary`` that only the compressor knows; saved in the header's
# ``extra.summary`` so a delta read back from disk has them too. Timings are not saved: the same
# inputs must give the same file, byte for byte.
_SAVED_SUMMARY_KEYS = ("device", "relative_error")


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    # the lowrank layout: ((bits, A, B), ...) per band, A [r, N] and B [r, K] dense modules with one grid per
    # direction. The file stores these; the fields above hold the served delta, RTN(sum A^T B) on the module's
    # own grid, rebuilt from them on load (:meth:`from_factors`), which is what kernels, merges and
    # references read
    factors: Optional[tuple] = None

    @classmethod
    def from_factors(cls, factors, shape, *, bits: int, group_size: int, symmetric: bool = True,
                     kind: str = "linear", transposed: bool = False) -> "PackedModule":
        """A lowrank-layout module: ``factors`` as stored (``(bits, A, B)`` per band, CPU :class:`PackedModule`
        s) and the served delta they define: their product, summed over bands in float32 on the CPU, rounded
        to ``bits`` on ``group_size`` groups (so loading a file rebuilds the very codes compression made)."""
        product = lowrank_product(factors, shape)
        gs = lowrank_group_size(shape[1], group_size)
        # round to nearest on the module's grid (what the solver's rtn_compress does for a dense delta)
        scales, zeros = compute_qparams(product, bits, gs, symmetric)
        codes = quantize(product, scales, zeros, bits, gs)
        served = cls.from_codes(codes, scales, zeros, None, bits=bits, group_size=gs, symmetric=symmetric,
                                kind=kind, transposed=transposed)
        return dataclasses.replace(served, factors=tuple(factors))

    @classmethod
    def split_factors(cls, tensors: dict, bands, shape) -> tuple:
        """The ``(bits, A, B)`` bands of a lowrank layout's six stored tensors (see :meth:`tensors`)."""
        n, k = shape
        out, at = [], {"a": 0, "b": 0}
        row = 0
        for r, b in bands:
            sides = []
            for side, width in (("a", n), ("b", k)):
                size = r * packed_nbytes(width, b)
                q = tensors[f"{side}.qweight"][at[side]:at[side] + size].reshape(r, packed_nbytes(width, b))
                at[side] += size
                sides.append(cls(kind="factor", shape=(r, width), bits=b, group_size=-1, symmetric=True, sparsity="dense",
                                 transposed=False, qweight=q, scales=tensors[f"{side}.scales"][row:row + r],
                                 zeros=tensors[f"{side}.zeros"][row:row + r]))
            out.append((b, *sides))
            row += r
        return tuple(out)

    @classmethod
    def lowrank(cls, bands, shape, *, bits: int, group_size: int, symmetric: bool = True, kind: str = "linear",
                transposed: bool = False) -> "PackedModule":
        """A lowrank-layout module from solved bands: ``(bits, A, B)`` with ``A``, ``B``
        :class:`~hf_deltazip.compression.solver.SolverResult` s (see
        :func:`~hf_deltazip.compression.lowrank.mixed_precision_factors`)."""
        factors = tuple((b, cls.from_codes(a.codes, a.scales, a.zeros, None, bits=b, group_size=-1, symmetric=a.symmetric,
                                           kind="factor"),
                         cls.from_codes(bt.codes, bt.scales, bt.zeros, None, bits=b, group_size=-1, symmetric=bt.symmetric,
                                        kind="factor"))
                        for b, a, bt in bands)
        return cls.from_factors(factors, shape, bits=bits, group_size=group_size, symmetric=symmetric, kind=kind,
                                transposed=transposed)

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
        skip_zero_rows: bool = False,
    ) -> "PackedModule":
        """Pack dense codes ``[N, K]`` (pruned entries hold the zero point) and their grid.

        ``mask`` (bool, True = kept) selects the sparse layout: 2:4 when ``two_four``, else a bitmask.
        ``skip_zero_rows`` (dense only): when some rows decode to all zeros (embedding rows the fine-tune
        did not change), store a row bitmap and only the other rows (the ``rows`` layout).
        """
        packed = cls._pack_on_device(codes, scales, zeros, mask, bits=bits, group_size=group_size,
                                     symmetric=symmetric, two_four=two_four, kind=kind, transposed=transposed,
                                     skip_zero_rows=skip_zero_rows)
        # packed where the codes are (a GPU packs a 262k-row vocabulary in milliseconds); stored on the CPU
        for field in ("qweight", "scales", "zeros", "positions", "mask"):
            t = getattr(packed, field)
            if t is not None:
                setattr(packed, field, t.cpu())
        return packed

    @classmethod
    def _pack_on_device(cls, codes, scales, zeros, mask, *, bits, group_size, symmetric, two_four, kind, transposed,
                        skip_zero_rows) -> "PackedModule":
        n, k = codes.shape
        device = codes.device
        codes = codes.to(torch.uint8)
        scales = scales.float().to(device)
        scales = scales.to(choose_scale_dtype(scales))
        zeros = zeros.to(device=device, dtype=torch.uint8)
        common = dict(kind=kind, shape=(n, k), bits=bits, group_size=group_size, symmetric=symmetric,
                      transposed=transposed, scales=scales, zeros=zeros)
        if mask is None and skip_zero_rows:
            stored = (codes != expand_groups(zeros, k, group_size).to(torch.uint8)).any(dim=1)
            if not bool(stored.all()):
                idx = stored.nonzero().squeeze(1)
                common.update(scales=scales[idx].contiguous(), zeros=zeros[idx].contiguous())
                return cls(sparsity="rows", qweight=pack_codes(codes[idx], bits), mask=pack_bits(stored.to(torch.uint8), 1),
                           nnz=int(idx.numel()), **common)
        if mask is None:
            return cls(sparsity="dense", qweight=pack_codes(codes, bits), **common)
        mask = mask.to(device=device, dtype=torch.bool)
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
    def stored_rows(self) -> Optional[torch.Tensor]:
        """Rows layout: bool ``[N]``, True for the rows stored (the others decode to 0); else None."""
        if self.sparsity != "rows":
            return None
        stored = unpack_bits(self.mask, 1, self.shape[0]).bool()
        if int(stored.sum()) != self.nnz:
            raise DeltaZipFormatError("<module>", f"row bitmap marks {int(stored.sum())} rows, nnz says {self.nnz}")
        return stored

    def _full_grid(self) -> tuple:
        """``(codes, scales, zeros)`` for all ``N`` rows of a rows-layout delta (absent rows decode to 0)."""
        n, k = self.shape
        stored = self.stored_rows()
        g = self.scales.shape[1]
        scales = torch.zeros(n, g, dtype=self.scales.dtype, device=self.scales.device)
        zeros = torch.full((n, g), 1 << (self.bits - 1), dtype=torch.uint8, device=self.zeros.device)
        codes = torch.full((n, k), 1 << (self.bits - 1), dtype=torch.uint8, device=self.qweight.device)
        scales[stored], zeros[stored] = self.scales, self.zeros
        codes[stored.to(codes.device)] = unpack_codes(self.qweight, self.bits, k)
        return codes, scales, zeros

    def kept_mask(self) -> Optional[torch.Tensor]:
        n, k = self.shape
        if self.sparsity == "rows":
            return None
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
        if self.sparsity == "rows":
            return self._full_grid()[0]
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
        if self.sparsity == "rows":
            return dequantize(*self._full_grid(), self.group_size, dtype)
        return dequantize(self.dense_codes(), self.scales, self.zeros, self.group_size, dtype)

    def to_dense_layout(self) -> "PackedModule":
        """Bitmask and rows layouts -> dense layout (what kernels read); 2:4 and dense are returned as they are."""
        if self.sparsity not in ("bitmask", "rows"):
            return self
        codes, scales, zeros = self._full_grid() if self.sparsity == "rows" else (self.dense_codes(), self.scales, self.zeros)
        return PackedModule(
            kind=self.kind, shape=self.shape, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
            sparsity="dense", transposed=self.transposed, qweight=pack_codes(codes, self.bits),
            scales=scales, zeros=zeros,
        )

    def sliced(self, rows: Optional[tuple] = None, columns: Optional[tuple] = None) -> "PackedModule":
        """The block ``[rows[0]:rows[1], columns[0]:columns[1]]`` of this delta, re-packed in its own layout
        with the same codes and grid (it dequantizes to exactly that block of :meth:`dequantize`): a
        tensor-parallel rank's shard. Column bounds must fall on quantization-group boundaries (and on
        2:4 blocks of 4); the caller checks that and says what to do (see ``modeling.tensor_parallel``).
        """
        n, k = self.shape
        r0, r1 = rows or (0, n)
        c0, c1 = columns or (0, k)
        g = self.group_size
        if (g != -1 and (c0 % g or (c1 % g and c1 != k))) or (self.sparsity == "2:4" and (c0 % 4 or c1 % 4)):
            raise DeltaZipFormatError("<module>", f"columns {c0}:{c1} cut a quantization group of {g} (or a 2:4 block)")
        if self.sparsity == "rows":
            (codes, scales, zeros), mask = self._full_grid(), None
        else:
            codes, scales, zeros, mask = self.dense_codes(), self.scales, self.zeros, self.kept_mask()
        g0, g1 = (0, scales.shape[1]) if g == -1 else (c0 // g, -(-c1 // g))
        scales, zeros = scales[r0:r1, g0:g1], zeros[r0:r1, g0:g1]
        out = PackedModule.from_codes(
            codes[r0:r1, c0:c1], scales, zeros, None if mask is None else mask[r0:r1, c0:c1], bits=self.bits,
            group_size=g, symmetric=self.symmetric, two_four=self.sparsity == "2:4", kind=self.kind,
            transposed=self.transposed, skip_zero_rows=self.sparsity == "rows")
        exact = scales.cpu()  # from_codes may pick another scale dtype: keep the stored values as they are
        if out.sparsity == "rows":
            exact = exact[out.stored_rows()]
        return dataclasses.replace(out, scales=exact.contiguous())

    @property
    def resident_nbytes(self) -> int:
        """Bytes this delta occupies on a GPU once loaded for the kernels (bitmask and rows are expanded
        to dense codes there; 2:4 stays 2:4): what a decode step reads, unlike the file's zstd bytes."""
        n, k = self.shape
        if self.factors is not None:  # the served codes, not the stored factors
            return sum(_tensor_bytes(t) for t in (self.qweight, self.scales, self.zeros))
        if self.sparsity not in ("bitmask", "rows"):
            return self.nbytes
        g = self.scales.shape[1]
        return n * packed_nbytes(k, self.bits) + n * g * (self.scales.element_size() + 1)

    # ------------------------------------------------------------------ storage
    def tensors(self) -> dict:
        """The tensors the file stores, by role. The lowrank layout stores its factors only, six tensors
        whatever the bands: per side (``a``: ``[r, N]`` rows, ``b``: ``[r, K]``) the bands' packed codes one
        after the other (``qweight``, 1-D), and one scale and zero point per direction (``scales``, ``zeros``
        ``[R, 1]``, bands in order)."""
        if self.factors is not None:
            out = {}
            for side, pick in (("a", 1), ("b", 2)):
                fs = [band[pick] for band in self.factors]
                scales = [f.scales for f in fs]
                wide = any(t.dtype == torch.float32 for t in scales)
                out[f"{side}.qweight"] = torch.cat([f.qweight.reshape(-1) for f in fs]) if fs else \
                    torch.zeros(0, dtype=torch.uint8)
                out[f"{side}.scales"] = torch.cat([t.float() if wide else t for t in scales]) if fs else \
                    torch.zeros(0, 1, dtype=torch.float16)
                out[f"{side}.zeros"] = torch.cat([f.zeros for f in fs]) if fs else torch.zeros(0, 1, dtype=torch.uint8)
            return out
        out = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        if self.positions is not None:
            out["positions"] = self.positions
        if self.mask is not None:
            out["mask"] = self.mask
        return out

    def record(self, name: str) -> ModuleRecord:
        lowrank = self.factors is not None
        return ModuleRecord(
            kind=self.kind, shape=tuple(self.shape), bits=self.bits, group_size=self.group_size,
            symmetric=self.symmetric, sparsity="lowrank" if lowrank else self.sparsity, transposed=self.transposed,
            tensors={role: f"{name}.{role}" for role in self.tensors()}, nnz=None if lowrank else self.nnz,
            bands=[(int(a.shape[0]), b) for b, a, _ in self.factors] if lowrank else None,
        )

    @classmethod
    def from_record(cls, rec: ModuleRecord, tensors: dict) -> "PackedModule":
        if rec.sparsity == "lowrank":
            factors = cls.split_factors(tensors, rec.bands, rec.shape)
            return cls.from_factors(factors, tuple(rec.shape), bits=rec.bits, group_size=rec.group_size,
                                    symmetric=rec.symmetric, kind=rec.kind, transposed=rec.transposed)
        return cls(
            kind=rec.kind, shape=tuple(rec.shape), bits=rec.bits, group_size=rec.group_size, symmetric=rec.symmetric,
            sparsity=rec.sparsity, transposed=rec.transposed, qweight=tensors["qweight"], scales=tensors["scales"],
            zeros=tensors["zeros"], positions=tensors.get("positions"), mask=tensors.get("mask"), nnz=rec.nnz,
        )

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(t) for t in self.tensors().values())

    # ------------------------------------------------------------------ display
    def info(self) -> dict:
        """Layout and size of this module: what ``CompressedDelta.summary["modules"]`` lists per module."""
        n, k = self.shape
        sparsity = self.sparsity
        if self.factors is not None:
            sparsity = "lowrank[" + "+".join(f"{a.shape[0]}x{b}b" for b, a, _ in self.factors) + "]"
        return {"kind": self.kind, "shape": [n, k], "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "sparsity": sparsity, "bytes": self.nbytes,
                "resident_bytes": self.resident_nbytes,
                "bits_per_weight": 8 * self.nbytes / (n * k)}

    def __repr__(self) -> str:
        n, k = self.shape
        group = "per row" if self.group_size == -1 else f"group {self.group_size}"
        grid = "symmetric" if self.symmetric else "asymmetric"
        layout = self.info()["sparsity"] if self.factors is not None else self.sparsity
        return (f"PackedModule({self.kind} [{n}, {k}], {self.bits}-bit, {group}, {grid}, {layout}, "
                f"{format_bytes(self.nbytes)}{', transposed' if self.transposed else ''})")

    def _repr_html_(self) -> str:
        settings = [(key, value) for key, value in self.info().items() if key != "bytes"]
        settings.append(("transposed", self.transposed))
        tensors = [(role, str(t.dtype).removeprefix("torch."), list(t.shape), _tensor_bytes(t))
                   for role, t in self.tensors().items()]
        return html_section(
            f"PackedModule ({format_bytes(self.nbytes)})",
            delta_table_html(settings, columns=["setting", "value"]),
            delta_table_html(tensors, columns=["tensor", "dtype", "shape", "bytes"]),
        )


def lowrank_product(bands, shape, device=None) -> torch.Tensor:
    """``sum A^T B`` over ``(bits, A, B)`` bands (anything with ``dequantize()``: packed factors or solver
    results), in float32 on ``device`` (default the CPU): the delta a lowrank module's factors stand for."""
    out, dev = None, torch.device("cpu") if device is None else device
    for _, a, b in bands:  # the first band's product is the sum so far (no zeros to add it to)
        term = a.dequantize().to(dev).t() @ b.dequantize().to(dev)
        out = term if out is None else out.add_(term)
    return torch.zeros(*shape, dtype=torch.float32, device=dev) if out is None else out


@dataclass(repr=False)
class CompressedDelta:
    """A compressed fine-tune: packed module deltas, exactly stored parameters and metadata.

    Made by :func:`hf_deltazip.compress`; saved with :meth:`save_pretrained`; loaded onto a base by
    :class:`hf_deltazip.DeltaModel`.
    """

    config: DeltaZipConfig
    modules: dict = field(default_factory=dict)  # name -> PackedModule
    params: dict = field(default_factory=dict)  # name -> tensor (the fine-tune's exact value)
    header: DeltaHeader = field(default_factory=DeltaHeader)  # base, fingerprint, architecture, ... (a dict is typed)
    tokenizer: object = None
    generation_config: object = None
    summary: dict = field(default_factory=dict)

    def __post_init__(self):
        self.header = DeltaHeader.from_dict(self.header)  # a dict (older code, tests) becomes the typed record

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: Union[str, os.PathLike], num_threads: Optional[int] = None) -> Path:
        """Write ``deltazip_config.json``, ``delta.dz`` and, when known, the tokenizer and generation config.

        The ``.dz`` file and the config are both written in full under temporary names before they replace
        an earlier delta's files, so an error while writing either keeps that earlier delta intact.
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
        header = dataclasses.replace(self.header, library_version=self.header.library_version or __version__,
                                     config=self.config.to_dict(), extra={**self.header.extra, **self._summary_to_save()})
        config_bytes = self.config.to_json_string().encode()
        with staged_writes() as stage:  # both written in full before either replaces an earlier delta's file
            dz_bytes = write_dz(stage.path_for(directory / DZ_FILENAME), tensors, records, params, header,
                                self.config.zstd_level, num_threads)
            stage.write(directory / CONFIG_NAME, config_bytes)
        self._note_stored_bytes(dz_bytes + len(config_bytes))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(directory)
        return directory

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike], *, progress: Optional[bool] = None,
                        **hub_kwargs) -> "CompressedDelta":
        """Read a delta folder (or Hub id) fully into memory.

        ``progress``: show a tqdm bar while tensors are decoded (``None``: only on a terminal).
        """
        folder = resolve_delta_folder(path, **hub_kwargs)
        with DeltaZipFile(folder / DZ_FILENAME) as dz:
            header = dz.header
            config = load_folder_config(folder, header)  # the header is the truth: a contradicting JSON is refused
            modules, params = read_packed(dz, progress=progress, desc=f"reading {folder.name}")
        delta = cls(config=config, modules=modules, params=params, header=header)
        cls._restore_summary(delta, folder)
        return delta

    # ------------------------------------------------------------------ summary
    def _summary_to_save(self) -> dict:
        saved = {key: self.summary[key] for key in _SAVED_SUMMARY_KEYS if self.summary.get(key) not in (None, {})}
        return {"summary": saved} if saved else {}

    def _note_stored_bytes(self, stored: int) -> None:
        fp16 = self.summary.get("finetune_fp16_bytes")
        self.summary.update(stored_bytes=stored, ratio=fp16 / stored if fp16 else None)

    def _restore_summary(self, folder: Path) -> None:
        """Fill ``summary`` of a delta read from ``folder``: what the compressor saved, what the records give."""
        saved = self.header.extra.get("summary", {})
        self.summary.update({key: saved[key] for key in _SAVED_SUMMARY_KEYS if key in saved})
        self._note_stored_bytes((folder / DZ_FILENAME).stat().st_size + (folder / CONFIG_NAME).stat().st_size)

    def _derived_summary(self) -> dict:
        """The parts of ``summary`` that the modules, params and header determine."""
        packed = sum(m.nbytes for m in self.modules.values())
        exact = sum(_tensor_bytes(t) for t in self.params.values())
        n_params = self.header.finetune_num_params
        return {
            "packed_bytes": packed,
            "exact_param_bytes": exact,
            "finetune_fp16_bytes": 2 * n_params if n_params else None,
            "ratio_before_zstd": 2 * n_params / max(1, packed + exact) if n_params else None,
            "relative_error": {},
            "modules": {name: mod.info() for name, mod in self.modules.items()},
        }

    def bytes_by_category(self) -> dict:
        """Bytes in memory (decoded, before zstd) by category: linear deltas, scales and zeros, masks, ..."""
        return categorize_bytes(
            ((m.kind, {role: _tensor_bytes(t) for role, t in m.tensors().items()}) for m in self.modules.values()),
            (_tensor_bytes(t) for t in self.params.values()),
        )

    # ------------------------------------------------------------------ display
    def _overview(self) -> list:
        s = self.summary
        base = self.header.base_model or "?"
        total = s["packed_bytes"] + s["exact_param_bytes"]
        ratio = format_ratio(s["ratio_before_zstd"]) + " before zstd"
        if s.get("stored_bytes"):
            ratio += f", {format_ratio(s.get('ratio'))} on disk ({format_bytes(s['stored_bytes'])})"
        if s.get("target_ratio"):
            ratio += f" for a target of {format_ratio(s['target_ratio'])}"
        rows = [("base", base), ("model type", self.header.model_type or "?"),
                ("contents", f"{len(self.modules)} modules, {len(self.params)} exact parameters"),
                ("bytes", f"{format_bytes(total)} in memory"), ("ratio", ratio)]
        errors = s.get("relative_error") or {}
        if errors:
            worst = max(errors, key=errors.get)
            rows.append(("error", f"mean {sum(errors.values()) / len(errors):.4g}, worst {errors[worst]:.4g} ({worst})"))
        return rows

    def __repr__(self) -> str:
        cats = ", ".join(f"{cat} {format_bytes(n)}" for cat, n in self.bytes_by_category().items() if n)
        rows = [("config", repr(self.config)), *self._overview()]
        width = max(len(key) for key, _ in rows) + 2
        lines = [f"  {key + ':':<{width}}{value}" + (f" ({cats})" if key == "bytes" and cats else "")
                 for key, value in rows]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"

    def _repr_html_(self) -> str:
        cats = self.bytes_by_category()
        total = sum(cats.values()) or 1
        settings = [(name, repr(value)) for name, value in self.config.key_settings().items()]
        return html_section(
            type(self).__name__,
            delta_table_html(self._overview()),
            delta_table_html(settings, columns=["setting", "value"], caption="settings"),
            delta_table_html([(cat, n, f"{100 * n / total:.1f}%") for cat, n in cats.items()],
                             columns=["category", "bytes", "share"], caption="bytes by category (in memory)"),
        )

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



def _get_summary(self) -> dict:
    summary = self.__dict__["_summary"]
    if "modules" not in summary:
        for key, value in self._derived_summary().items():
            summary.setdefault(key, value)
    return summary


def _set_summary(self, value: dict) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"summary must be a dict, got {type(value).__name__}")
    self.__dict__["_summary"] = value


CompressedDelta.summary = property(_get_summary, _set_summary, doc=(
    "What the compression did: bytes (``packed_bytes``, ``exact_param_bytes``, ``ratio_before_zstd``; after a "
    "save or load ``stored_bytes`` and ``ratio``), ``modules`` (name -> :meth:`PackedModule.info`) and the "
    "compressor's ``seconds``, ``steps`` and ``layers`` (timings, in memory only), ``device`` and per-module "
    "``relative_error`` (kept in the file since hf-deltazip 0.1; older files give ``{}``)."
))


def read_packed(dz: DeltaZipFile, *, num_threads: Optional[int] = None, pin_memory: bool = False,
                progress: Optional[bool] = None, desc: str = "reading delta") -> tuple[dict, dict]:
    """Decode every module and exactly stored parameter of an open ``.dz`` file.

    Tensors are decoded in parallel threads (:meth:`DeltaZipFile.read_tensors`), a slice at a time so
    that a tqdm bar (in decoded bytes) can follow; ``progress=None`` shows it only on a terminal.

    Returns:
        ``(modules, params)``: module name -> :class:`PackedModule`, parameter name -> tensor.
    """
    names = list(dz.tensors)
    if (not sys.stderr.isatty()) if progress is None else not progress:  # no bar: one read, file order, all threads
        tensors = dz.read_tensors(names, num_threads=num_threads, pin_memory=pin_memory)
        return _packed_from(dz, tensors)
    step = max(16, math.ceil(len(names) / 20))
    tensors = {}
    total = sum(rec.nbytes for rec in dz.tensors.values())
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None if progress is None else not progress,
              leave=False) as bar:
        for i in range(0, len(names), step):
            got = dz.read_tensors(names[i : i + step], num_threads=num_threads, pin_memory=pin_memory)
            tensors.update(got)
            bar.update(sum(dz.tensors[n].nbytes for n in got))
    return _packed_from(dz, tensors)


def _packed_from(dz: DeltaZipFile, tensors: dict) -> tuple[dict, dict]:
    modules = {name: PackedModule.from_record(rec, {role: tensors[t] for role, t in rec.tensors.items()})
               for name, rec in dz.modules.items()}
    params = {name: tensors[t] for name, t in dz.params.items()}
    return modules, params


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
    header = DeltaHeader.from_dict(header)
    name = header.base_model
    if not name or not isinstance(name, str):
        raise BaseMismatchError("the delta records no base model: pass base= (the base model, its folder or its Hub id)")
    source = header.base_source
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
