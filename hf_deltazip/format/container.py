"""The ``.dz`` container: a safetensors file whose tensors are (optionally zstd-compressed) byte arrays.

``docs/format.md`` is the specification; this module implements it. The writer is atomic; the
reader (:class:`DeltaZipFile`) checks every length, offset, shape and checksum against the file
before it allocates or decodes anything, and raises :class:`DeltaZipFormatError` otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import mmap
import os
import struct
import sys
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import zstandard

from ..errors import DeltaZipFormatError
from ..fileio import atomic_write_bytes
from ..packing import CODE_BITS, num_groups, packed_nbytes
from .header import HEADER_TABLES, DeltaHeader, HeaderError

logger = logging.getLogger(__name__)

DZ_FORMAT_VERSION = 4  # 2 added the "rows" layout, 3 "lowrank", 4 "lowrank" embeddings and LM heads; a file is
# written as the oldest version its layouts allow
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)
LOWRANK_VOCAB_SINCE = 4  # the lowrank layout on an "embedding" module (an input embedding or LM head)
# the first format version each layout exists in
LAYOUT_SINCE = {"dense": 1, "2:4": 1, "bitmask": 1, "rows": 2, "lowrank": 3}
FORMAT_TAG = "hf-deltazip"
DZ_FILENAME = "delta.dz"
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSOR_BYTES = 1 << 40

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ENCODINGS = ("raw", "zstd")
SPARSITY_LAYOUTS = ("dense", "2:4", "bitmask", "rows", "lowrank")
MODULE_KINDS = ("linear", "embedding")
SCALE_DTYPES = ("float16", "float32")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a .dz file; allowed: {sorted(DTYPES)}") from None


# --------------------------------------------------------------------------- records
@dataclass
class TensorRecord:
    encoding: str
    dtype: str
    shape: tuple
    nbytes: int
    crc32: int


@dataclass
class ModuleRecord:
    """How one compressed weight delta is stored (see docs/format.md, "modules")."""

    kind: str
    shape: tuple  # (N, K)
    bits: int
    group_size: int
    symmetric: bool
    sparsity: str
    transposed: bool
    tensors: dict  # role -> stored tensor name
    nnz: Optional[int] = None  # bitmask layout: weights kept; rows layout: rows stored
    bands: Optional[list] = None  # lowrank layout: [[directions, bits], ...], most precise band first

    def to_json(self) -> dict:
        d = {
            "kind": self.kind,
            "shape": list(self.shape),
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "sparsity": self.sparsity,
            "transposed": self.transposed,
            "tensors": dict(self.tensors),
        }
        if self.nnz is not None:
            d["nnz"] = self.nnz
        if self.bands is not None:
            d["bands"] = [list(b) for b in self.bands]
        return d

    def expected_shapes(self) -> dict:
        """role -> (shape, allowed dtype names) that this record's tensors must have."""
        n, k = self.shape
        if self.sparsity == "lowrank":  # the factors only: the served codes are rebuilt from them on load
            out, rank = {}, sum(r for r, _ in self.bands)
            for side, width in (("a", n), ("b", k)):
                out[f"{side}.qweight"] = ((sum(r * packed_nbytes(width, b) for r, b in self.bands),), ("uint8",))
                out[f"{side}.scales"] = ((rank, 1), SCALE_DTYPES)
                out[f"{side}.zeros"] = ((rank, 1), ("uint8",))
            return out
        g = num_groups(k, self.group_size)
        out = {"scales": ((n, g), SCALE_DTYPES), "zeros": ((n, g), ("uint8",))}
        if self.sparsity == "dense":
            out["qweight"] = ((n, packed_nbytes(k, self.bits)), ("uint8",))
        elif self.sparsity == "2:4":
            out["qweight"] = ((n, packed_nbytes(k // 2, self.bits)), ("uint8",))
            out["positions"] = ((n, packed_nbytes(k // 2, 2)), ("uint8",))
        elif self.sparsity == "rows":
            r = self.nnz
            out = {"scales": ((r, g), SCALE_DTYPES), "zeros": ((r, g), ("uint8",)),
                   "qweight": ((r, packed_nbytes(k, self.bits)), ("uint8",)),
                   "mask": ((math.ceil(n / 8),), ("uint8",))}
        else:
            out["qweight"] = ((packed_nbytes(self.nnz, self.bits),), ("uint8",))
            out["mask"] = ((n, math.ceil(k / 8)), ("uint8",))
        return out


# --------------------------------------------------------------------------- writer
def _encode(raw: bytes, level: int) -> tuple[str, bytes]:
    if level <= 0 or not raw:
        return "raw", raw
    comp = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(raw)
    if len(comp) >= len(raw):
        return "raw", raw
    return "zstd", comp


def format_version_for(records: Iterable[ModuleRecord]) -> int:
    """The format version a file of these module records is written as: the oldest that has all their layouts."""
    return max([1] + [_record_version(r) for r in records])


def _record_version(rec: ModuleRecord) -> int:
    if rec.sparsity == "lowrank" and rec.kind == "embedding":
        return LOWRANK_VOCAB_SINCE
    return LAYOUT_SINCE[rec.sparsity]


def encoded_nbytes(t: torch.Tensor, zstd_level: int) -> int:
    """Bytes ``t`` takes in a ``.dz`` file written with ``zstd_level`` (its payload, as :func:`write_dz` stores it)."""
    return len(_encode(_tensor_bytes(t), zstd_level)[1])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_dz(
    path: Union[str, os.PathLike],
    tensors: dict,
    modules: dict,
    params: dict,
    header: Union[DeltaHeader, dict],
    zstd_level: int = 9,
    num_threads: Optional[int] = None,
) -> int:
    """Write a ``.dz`` file atomically. Returns the file size in bytes.

    Args:
        path: destination; an existing file there is replaced only once the new one is complete.
        tensors: stored name -> tensor (any dtype in :data:`DTYPES`).
        modules: module name -> :class:`ModuleRecord` (its ``tensors`` must name entries of ``tensors``).
        params: parameter name -> stored tensor name of an exactly stored parameter.
        header: the other ``dz_header`` fields (a :class:`DeltaHeader`, or a dict of them); JSON-serialisable.
        zstd_level: 0 stores raw bytes; otherwise each tensor is one zstd frame (kept only if smaller).
        num_threads: threads compressing tensors in parallel (default: CPU count).
    """
    names = list(tensors)
    for mod_name, rec in modules.items():
        for role, tname in rec.tensors.items():
            if tname not in tensors:
                raise ValueError(f"module {mod_name!r}: tensor {tname!r} ({role}) was not given")
    for pname, tname in params.items():
        if tname not in tensors:
            raise ValueError(f"param {pname!r}: tensor {tname!r} was not given")

    def encode(name):
        t = tensors[name]
        raw = _tensor_bytes(t)
        enc, payload = _encode(raw, zstd_level)
        rec = TensorRecord(enc, dtype_name(t.dtype), tuple(t.shape), len(raw), zlib.crc32(raw))
        return rec, payload

    with ThreadPoolExecutor(max_workers=num_threads or os.cpu_count() or 1) as pool:
        encoded = list(pool.map(encode, names))

    dz_header = DeltaHeader.from_dict(header).to_dict()
    dz_header["tensors"] = {
        n: {"encoding": r.encoding, "dtype": r.dtype, "shape": list(r.shape), "nbytes": r.nbytes, "crc32": r.crc32}
        for n, (r, _) in zip(names, encoded)
    }
    dz_header["modules"] = {n: r.to_json() for n, r in modules.items()}
    dz_header["params"] = {n: {"tensor": t} for n, t in params.items()}
    dz_json = json.dumps(dz_header, sort_keys=True, separators=(",", ":"))

    st_header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT_TAG,
            "dz_format_version": str(format_version_for(modules.values())),
            "dz_header": dz_json,
            "dz_header_crc32": str(zlib.crc32(dz_json.encode())),
        }
    }
    offset = 0
    for n, (_, payload) in zip(names, encoded):
        st_header[n] = {"dtype": "U8", "shape": [len(payload)], "data_offsets": [offset, offset + len(payload)]}
        offset += len(payload)
    hb = json.dumps(st_header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)

    def chunks():
        yield struct.pack("<Q", len(hb))
        yield hb
        for _, payload in encoded:
            yield payload

    atomic_write_bytes(path, chunks())
    return 8 + len(hb) + offset


# --------------------------------------------------------------------------- reader
def reader_threads(num_threads: Optional[int] = None) -> int:
    """Threads that read and decode a file's tensors: ``num_threads``, or up to 16 (one per core)."""
    return num_threads or min(16, os.cpu_count() or 1)


_IOV_BATCH = 512  # buffers per preadv call (IOV_MAX is 1024 on Linux)


def _aligned(n: int) -> int:
    """Bytes a tensor of ``n`` bytes takes in a piece's buffer: every tensor starts 64-byte aligned."""
    return -(-n // 64) * 64


#: offsets, lengths and buffer addresses of direct (``O_DIRECT``) reads are multiples of this
DIRECT_ALIGN = 4096
#: bytes of one direct read; ``readers`` of them are in flight at once
DIRECT_IO_BYTES = 4 << 20
#: gaps up to this many bytes between the tensors of one piece are read rather than skipped (direct reads)
_DIRECT_GAP = 64 << 10


def page_cache_fraction(fd: int, size: int) -> Optional[float]:
    """The fraction of a file's pages now in the page cache (Linux ``mincore``), or ``None`` where that
    cannot be told (another OS, a file system that does not say). Pages of a file the caller may not
    write count as absent (the kernel reports only its own mappings then)."""
    if not sys.platform.startswith("linux") or size <= 0:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, munmap, mincore = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    addr = mmap_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = torch.empty(pages, dtype=torch.uint8)
        if mincore(addr, size, vec.data_ptr()) != 0:
            return None
        return (vec & 1).sum().item() / pages
    finally:
        munmap(addr, size)


class _StagingBuffers:
    """Aligned host buffers that direct reads land in, reused within one stream (each is touched, and so
    faulted in, once)."""

    def __init__(self):
        self._free: list = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % DIRECT_ALIGN
        return raw[skip : skip + nbytes]

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class DeltaZipFile:
    """A validated, memory-mapped ``.dz`` file whose tensors are decoded on demand.

    Example:
        >>> with DeltaZipFile("delta.dz") as dz:
        ...     print(dz.header.base_model, len(dz.modules))
        ...     qweight = dz.get_tensor(dz.modules["model.layers.0.mlp.up_proj"].tensors["qweight"])
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self._mmap = None
        self._file = None
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise DeltaZipFormatError(self.path, "file not found") from None
        except OSError as e:
            raise DeltaZipFormatError(self.path, f"cannot open: {e}") from None
        try:
            self._open()
        except DeltaZipFormatError:
            self.close()
            raise
        except Exception as e:  # anything unexpected is still a format problem of this file
            self.close()
            raise DeltaZipFormatError(self.path, f"invalid file ({type(e).__name__}: {e})") from e

    def _fail(self, problem: str):
        raise DeltaZipFormatError(self.path, problem)

    def _open(self) -> None:
        size = self._file_size = os.fstat(self._file.fileno()).st_size
        if size < 8:
            self._fail(f"truncated: {size} bytes, not even a header length; re-download or re-save the delta")
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        (hlen,) = struct.unpack("<Q", self._mmap[:8])
        if hlen > MAX_HEADER_BYTES:
            self._fail(f"header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit: not a .dz file or corrupt")
        if 8 + hlen > size:
            self._fail(f"truncated: header of {hlen} bytes but the file has {size} bytes; re-download or re-save")
        try:
            st = json.loads(bytes(self._mmap[8 : 8 + hlen]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"header is not valid JSON ({e}): the file is corrupt")
        if not isinstance(st, dict):
            self._fail("header is not a JSON object")
        meta = st.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
            self._fail("not an hf-deltazip file (safetensors metadata lacks format=hf-deltazip)")
        version = meta.get("dz_format_version")
        if version not in [str(v) for v in SUPPORTED_FORMAT_VERSIONS]:
            self._fail(
                f"format version {version!r} is not supported (this hf-deltazip reads "
                f"{list(SUPPORTED_FORMAT_VERSIONS)}); upgrade hf-deltazip"
            )
        self.format_version = int(version)
        dz_json = meta.get("dz_header")
        if not isinstance(dz_json, str):
            self._fail("metadata lacks dz_header")
        if meta.get("dz_header_crc32") != str(zlib.crc32(dz_json.encode("utf-8", "surrogatepass"))):
            self._fail("dz_header checksum mismatch: the header is corrupt")
        #: the header's checksum, which covers every tensor's: tells this delta from another saved in its place
        self.content_id = meta["dz_header_crc32"]
        try:
            dz = json.loads(dz_json)
        except json.JSONDecodeError as e:
            self._fail(f"dz_header is not valid JSON ({e})")
        if not isinstance(dz, dict):
            self._fail("dz_header is not a JSON object")

        # safetensors layer: U8 byte arrays, contiguous payloads ending at the end of the file
        data_start = 8 + hlen
        data_len = size - data_start
        spans = []
        for name, entry in st.items():
            if not isinstance(entry, dict) or entry.get("dtype") != "U8":
                self._fail(f"tensor {name!r}: stored tensors must be U8 byte arrays")
            shape, offs = entry.get("shape"), entry.get("data_offsets")
            if not (isinstance(shape, list) and len(shape) == 1 and _is_int(shape[0]) and shape[0] >= 0):
                self._fail(f"tensor {name!r}: bad stored shape {shape!r}")
            if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
                self._fail(f"tensor {name!r}: bad data_offsets {offs!r}")
            b, e = offs
            if not (0 <= b <= e <= data_len) or e - b != shape[0]:
                self._fail(f"tensor {name!r}: data_offsets {offs} do not fit the file ({data_len} payload bytes)")
            spans.append((b, e, name))
        spans.sort()
        pos = 0
        for b, e, name in spans:
            if b != pos:
                self._fail(f"tensor {name!r}: payloads overlap or leave a gap at byte {pos}")
            pos = e
        if pos != data_len:
            self._fail(f"{data_len - pos} bytes after the last payload: the file is corrupt or was appended to")
        self._spans = {name: (data_start + b, data_start + e) for b, e, name in spans}

        # hf-deltazip layer
        tensors = dz.get("tensors")
        if not isinstance(tensors, dict) or set(tensors) != set(self._spans):
            self._fail("dz_header.tensors does not list exactly the stored tensors")
        self.tensors: dict[str, TensorRecord] = {}
        for name, t in tensors.items():
            self.tensors[name] = self._check_tensor_record(name, t)
        self.modules: dict[str, ModuleRecord] = {}
        modules = dz.get("modules", {})
        if not isinstance(modules, dict):
            self._fail("dz_header.modules is not an object")
        for name, m in modules.items():
            self.modules[name] = self._check_module_record(name, m)
        needed = format_version_for(self.modules.values())
        if needed != self.format_version:  # writers stamp the version their layouts need, no other
            self._fail(f"declares format version {self.format_version} but its layouts are version {needed}: the file is corrupt")
        params = dz.get("params", {})
        if not isinstance(params, dict):
            self._fail("dz_header.params is not an object")
        self.params: dict[str, str] = {}
        for name, p in params.items():
            if not isinstance(p, dict) or p.get("tensor") not in self.tensors:
                self._fail(f"param {name!r} does not name a stored tensor")
            self.params[name] = p["tensor"]
        try:
            self.header = DeltaHeader.from_dict({k: v for k, v in dz.items() if k not in HEADER_TABLES})
        except HeaderError as e:
            self._fail(f"{e}: the header is corrupt or from an incompatible writer")

    def _check_tensor_record(self, name, t) -> TensorRecord:
        if not isinstance(t, dict):
            self._fail(f"tensor {name!r}: record is not an object")
        enc, dt, shape, nbytes, crc = (t.get(k) for k in ("encoding", "dtype", "shape", "nbytes", "crc32"))
        if enc not in ENCODINGS:
            self._fail(f"tensor {name!r}: unknown encoding {enc!r} (known: {list(ENCODINGS)}); upgrade hf-deltazip")
        if dt not in DTYPES:
            self._fail(f"tensor {name!r}: unknown dtype {dt!r}")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_is_int(s) and 0 <= s <= MAX_TENSOR_BYTES for s in shape)):
            self._fail(f"tensor {name!r}: bad shape {shape!r}")
        itemsize = DTYPES[dt].itemsize
        expected = math.prod(shape) * itemsize
        if not _is_int(nbytes) or nbytes != expected or nbytes > MAX_TENSOR_BYTES:
            self._fail(f"tensor {name!r}: nbytes {nbytes!r} does not match shape {shape} x {dt} ({expected})")
        if not _is_int(crc) or not 0 <= crc < 2**32:
            self._fail(f"tensor {name!r}: bad crc32 {crc!r}")
        b, e = self._spans[name]
        if enc == "raw" and e - b != nbytes:
            self._fail(f"tensor {name!r}: raw payload is {e - b} bytes, expected {nbytes}")
        return TensorRecord(enc, dt, tuple(shape), nbytes, crc)

    def _check_module_record(self, name, m) -> ModuleRecord:
        if not isinstance(m, dict):
            self._fail(f"module {name!r}: record is not an object")
        try:
            rec = ModuleRecord(
                kind=m["kind"],
                shape=tuple(m["shape"]),
                bits=m["bits"],
                group_size=m["group_size"],
                symmetric=m["symmetric"],
                sparsity=m["sparsity"],
                transposed=m["transposed"],
                tensors=dict(m["tensors"]),
                nnz=m.get("nnz"),
                bands=m.get("bands"),
            )
        except (KeyError, TypeError, ValueError) as e:
            self._fail(f"module {name!r}: incomplete record ({e})")
        if rec.kind not in MODULE_KINDS:
            self._fail(f"module {name!r}: unknown kind {rec.kind!r}")
        if not (len(rec.shape) == 2 and all(_is_int(s) and 0 < s <= MAX_TENSOR_BYTES for s in rec.shape)):
            self._fail(f"module {name!r}: bad shape {list(rec.shape)}")
        if not _is_int(rec.bits) or rec.bits not in CODE_BITS:
            self._fail(f"module {name!r}: bits {rec.bits!r} not in {list(CODE_BITS)}")
        gs = rec.group_size
        if not (_is_int(gs) and (gs == -1 or (gs >= 1 and gs & (gs - 1) == 0))):
            self._fail(f"module {name!r}: bad group_size {gs!r}")
        if not isinstance(rec.symmetric, bool) or not isinstance(rec.transposed, bool):
            self._fail(f"module {name!r}: symmetric and transposed must be booleans")
        if rec.sparsity not in SPARSITY_LAYOUTS:
            self._fail(f"module {name!r}: unknown sparsity layout {rec.sparsity!r}")
        if rec.sparsity == "2:4" and rec.shape[1] % 4:
            self._fail(f"module {name!r}: 2:4 layout needs K divisible by 4")
        if LAYOUT_SINCE[rec.sparsity] > self.format_version:
            self._fail(f"module {name!r}: layout {rec.sparsity!r} does not exist in format version {self.format_version}")
        if rec.sparsity == "bitmask":
            if not (_is_int(rec.nnz) and 0 <= rec.nnz <= rec.shape[0] * rec.shape[1]):
                self._fail(f"module {name!r}: bad nnz {rec.nnz!r}")
        if rec.sparsity == "lowrank":
            bands = rec.bands
            if rec.kind == "embedding" and self.format_version < LOWRANK_VOCAB_SINCE:
                self._fail(f"module {name!r}: a lowrank embedding does not exist in format version {self.format_version}")
            ok = isinstance(bands, list) and rec.nnz is None and rec.kind in ("linear", "embedding") and all(
                isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and b[0] >= 1 and _is_int(b[1]) and b[1] in CODE_BITS
                for b in bands)
            if not ok or sum(b[0] for b in bands) > min(rec.shape):
                self._fail(f"module {name!r}: bad lowrank bands {bands!r} (a linear or embedding module's [[directions, bits], ...], "
                           f"at most {min(rec.shape)} directions in all, no nnz)")
            rec.bands = [tuple(b) for b in bands]
        elif rec.bands is not None:
            self._fail(f"module {name!r}: bands given for the {rec.sparsity} layout, which has none")
        if rec.sparsity in ("dense", "2:4") and rec.nnz is not None:
            self._fail(f"module {name!r}: nnz {rec.nnz!r} given for the {rec.sparsity} layout, which has none")
        if rec.sparsity == "rows":
            if not (_is_int(rec.nnz) and 0 <= rec.nnz <= rec.shape[0]):
                self._fail(f"module {name!r}: bad nnz {rec.nnz!r} (rows stored)")
        expected = rec.expected_shapes()
        if set(rec.tensors) != set(expected):
            self._fail(f"module {name!r}: tensors {sorted(rec.tensors)} but layout {rec.sparsity} needs {sorted(expected)}")
        for role, (shape, dtypes) in expected.items():
            tname = rec.tensors[role]
            t = self.tensors.get(tname)
            if t is None:
                self._fail(f"module {name!r}: {role} tensor {tname!r} is not stored")
            if t.shape != tuple(shape) or t.dtype not in dtypes:
                self._fail(
                    f"module {name!r}: {role} is {list(t.shape)} {t.dtype}, expected {list(shape)} {' or '.join(dtypes)}"
                )
        return rec

    # ------------------------------------------------------------------ tensors
    def get_tensor(self, name: str, *, pin_memory: bool = False) -> torch.Tensor:
        """Decode one stored tensor (checks its frame size and CRC-32 before returning it).

        The stored bytes are read with ``pread`` straight into the result (raw payloads) or into a
        buffer that zstd decodes into the result; ``pin_memory`` allocates the result in page-locked
        memory, ready for an asynchronous copy to a GPU.
        """
        rec = self.tensors.get(name)
        if rec is None:
            raise KeyError(f"{self.path}: no tensor {name!r} in this file")
        b, e = self._spans[name]
        out = torch.empty(rec.nbytes, dtype=torch.uint8, pin_memory=pin_memory and torch.cuda.is_available())
        if rec.nbytes == 0:
            return out.view(DTYPES[rec.dtype]).reshape(rec.shape)
        payload = self._pread(bytearray(e - b), b) if rec.encoding == "zstd" else self._pread(memoryview(out.numpy()), b)
        return self._decoded(name, payload, out)

    def _decoded(self, name: str, payload, out: torch.Tensor) -> torch.Tensor:
        """Finish one tensor whose stored bytes were read: decode a zstd ``payload`` into ``out`` (raw payloads
        were read into ``out`` itself), check its size and CRC-32, and view it with its dtype and shape."""
        rec = self.tensors[name]
        if rec.nbytes == 0:
            return out.view(DTYPES[rec.dtype]).reshape(rec.shape)
        view = memoryview(out.numpy())
        if rec.encoding == "zstd":
            try:
                params = zstandard.get_frame_parameters(payload)
            except zstandard.ZstdError as err:
                self._fail(f"tensor {name!r}: corrupt zstd frame ({err})")
            if params.content_size != rec.nbytes:
                self._fail(f"tensor {name!r}: zstd frame declares {params.content_size} bytes, header says {rec.nbytes}")
            try:
                raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=rec.nbytes)
            except zstandard.ZstdError as err:
                self._fail(f"tensor {name!r}: corrupt zstd data ({err})")
            if len(raw) != rec.nbytes:
                self._fail(f"tensor {name!r}: decoded {len(raw)} bytes, expected {rec.nbytes}")
            view[:] = raw
        else:
            b, e = self._spans[name]
            if e - b != rec.nbytes:
                self._fail(f"tensor {name!r}: decoded {e - b} bytes, expected {rec.nbytes}")
        if zlib.crc32(view) != rec.crc32:
            self._fail(f"tensor {name!r}: checksum mismatch, the data is corrupt; re-download or re-save the delta")
        return out.view(DTYPES[rec.dtype]).reshape(rec.shape)

    def _pread(self, buf, offset: int):
        """Fill ``buf`` with the file's bytes from ``offset`` (thread-safe: no shared file position)."""
        mv = memoryview(buf).cast("B")
        fd = self._file.fileno()
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                self._fail(f"truncated: could not read {len(mv) - done} bytes at offset {offset + done}")
            done += n
        return buf

    def in_file_order(self, names: Optional[Iterable[str]] = None) -> list:
        """Tensor names (all, or ``names``) sorted by where their bytes start in the file."""
        return sorted(self.tensors if names is None else names, key=lambda n: self._spans[n][0])

    def read_tensors(self, names: Optional[Iterable[str]] = None, num_threads: Optional[int] = None,
                     pin_memory: bool = False) -> dict:
        """Read and decode several tensors in parallel threads (reads, zstd and CRC release the GIL)."""
        names = self.in_file_order(names)  # sequential reads per thread
        workers = reader_threads(num_threads)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            got = pool.map(lambda n: self.get_tensor(n, pin_memory=pin_memory), names)
            return dict(zip(names, got))

    def stream_tensors(self, names: Optional[Iterable[str]] = None, *, piece_bytes: int = 64 << 20,
                       num_threads: Optional[int] = None, pin_memory: bool = False, ahead: int = 3,
                       readers: int = 1, direct_io: Union[bool, str] = False, io_bytes: int = DIRECT_IO_BYTES):
        """Yield the tensors (all, or ``names``) as ``{name: tensor}`` pieces of about ``piece_bytes`` decoded
        bytes each, in file order, while the rest of the file is still being read.

        One thread reads each piece with sequential ``preadv`` calls (the access pattern of a plain read
        of the file): raw payloads straight into one buffer per piece, page-locked with ``pin_memory``
        (CUDA only), compressed ones into a scratch buffer. A pool of ``num_threads`` decodes and checks
        each tensor (zstd, size, CRC-32) while the next pieces are read, up to ``ahead`` pieces beyond the
        one handed out (at least ``readers``). ``readers`` > 1 reads that many pieces at once (each still
        front to back), so the disk has work while one reader waits for Python's lock. A piece's tensors are views of its buffer,
        so the buffer is freed (and, pinned, reused by PyTorch's caching host allocator once its uploads are
        done) when they are dropped.

        ``direct_io``: read the stored bytes with ``O_DIRECT`` (Linux), past the page cache, in reads of
        ``io_bytes`` of which ``readers`` are in flight at once, into reused aligned buffers that the pool
        decodes or copies from (a cold file reads faster and more steadily so than through the page
        cache); ``"auto"``: so when most of the file is not in the page cache (a file just written or read
        is read from memory as usual). Where the OS or file system refuses direct reads, the file is read
        as without.

        Raises :class:`DeltaZipFormatError` naming the first corrupt tensor, when its piece is reached;
        closing the generator early stops the reads.
        """
        if direct_io not in (True, False, "auto"):
            raise ValueError(f"direct_io must be True, False or 'auto', not {direct_io!r}")
        if io_bytes <= 0 or io_bytes % DIRECT_ALIGN:
            raise ValueError(f"io_bytes must be a positive multiple of {DIRECT_ALIGN}, not {io_bytes}")
        order = self.in_file_order(names)
        pin = pin_memory and torch.cuda.is_available()
        direct_fd = self._open_direct(direct_io)
        pieces, piece, size = [], [], 0
        for n in order:
            need = _aligned(self.tensors[n].nbytes)
            if piece and size + need > piece_bytes:  # pieces stay under piece_bytes (one pinned size class)
                pieces.append(piece)
                piece, size = [], 0
            piece.append(n)
            size += need
        if piece:
            pieces.append(piece)
        pool = ThreadPoolExecutor(max_workers=reader_threads(num_threads), thread_name_prefix="deltazip-load")
        pending: deque = deque()
        todo = iter(pieces)
        if direct_fd is None:
            reader = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="deltazip-read")
            io = None
            read_piece = lambda piece: self._read_piece(piece, pin, pool)  # noqa: E731
            depth = max(ahead, readers)
        else:  # two threads lay out pieces and wait for their reads, which ``readers`` threads issue in file order
            reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltazip-piece")
            io = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="deltazip-read")
            staging = _StagingBuffers()
            read_piece = lambda piece: self._read_piece_direct(piece, pin, pool, io, direct_fd, staging, io_bytes)  # noqa: E731
            depth = max(ahead, 2)

        def submit_next():
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(reader.submit(read_piece, nxt))

        try:
            for _ in range(depth + 1):
                submit_next()
            while pending:
                futures = pending.popleft().result()
                submit_next()
                yield {n: f.result() for n, f in futures.items()}
        finally:
            for f in pending:
                f.cancel()
            reader.shutdown(wait=True, cancel_futures=True)
            if io is not None:
                io.shutdown(wait=True, cancel_futures=True)
            pool.shutdown(wait=True, cancel_futures=True)
            if direct_fd is not None:
                os.close(direct_fd)

    def _open_direct(self, direct_io) -> Optional[int]:
        """A descriptor of the file opened with ``O_DIRECT`` when ``direct_io`` asks for direct reads and the
        OS and file system allow them (``"auto"``: when most of the file is not in the page cache)."""
        if not direct_io or not hasattr(os, "O_DIRECT"):
            return None
        if direct_io == "auto":
            cached = page_cache_fraction(self._file.fileno(), self._file_size)
            if cached is None or cached >= 0.5:
                return None
        try:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as err:
            logger.debug("%s: no direct reads (%s); reading through the page cache", self.path, err)
            return None

    def _read_piece_direct(self, names: list, pin: bool, pool: ThreadPoolExecutor, io: ThreadPoolExecutor,
                           fd: int, staging: _StagingBuffers, io_bytes: int) -> dict:
        """Read the stored bytes of ``names`` (in file order) with direct reads of ``io_bytes`` on ``io`` into
        an aligned staging buffer, then queue each tensor's decode (zstd) or copy (raw) into one buffer
        per piece, and its check, on ``pool``. Returns ``{name: future of the tensor}``."""
        A = DIRECT_ALIGN
        runs = []  # [lo, hi) aligned file ranges, each read whole; gaps under _DIRECT_GAP are read through
        for n in names:
            b, e = self._spans[n]
            if e == b:
                continue
            lo, hi = b - b % A, -(-e // A) * A
            if runs and lo <= runs[-1][1] + _DIRECT_GAP:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        at_of, pos = [], 0  # where each run starts in the staging buffer
        for lo, hi in runs:
            at_of.append(pos)
            pos += hi - lo
        buf = staging.acquire(pos) if pos else None
        mv = memoryview(buf.numpy()) if pos else None
        reads = []
        for (lo, hi), at in zip(runs, at_of):
            for off in range(lo, hi, io_bytes):
                n = min(io_bytes, hi - off)
                reads.append(io.submit(self._pread_direct, fd, mv[at + off - lo : at + off - lo + n], off))
        try:
            for f in reads:
                f.result()
        except BaseException:
            for f in reads:
                f.cancel()
            raise
        total = sum(_aligned(self.tensors[n].nbytes) for n in names)
        block = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        futures, off, left = {}, 0, [len(names)]
        lock = threading.Lock()

        def done(_):
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last and buf is not None:
                staging.release(buf)

        for n in names:
            rec = self.tensors[n]
            b, e = self._spans[n]
            stored = None
            if e > b:
                i = max(k for k, (lo, _) in enumerate(runs) if lo <= b)
                at = at_of[i] + b - runs[i][0]
                stored = mv[at : at + e - b]
            futures[n] = pool.submit(self._decoded_stored, n, stored, block[off : off + rec.nbytes])
            futures[n].add_done_callback(done)
            off += _aligned(rec.nbytes)
        return futures

    def _decoded_stored(self, name: str, stored, out: torch.Tensor) -> torch.Tensor:
        """:meth:`_decoded` for stored bytes held elsewhere: a raw tensor's are copied into ``out`` first."""
        if self.tensors[name].encoding == "raw" and stored is not None:
            out.copy_(torch.frombuffer(stored, dtype=torch.uint8))
            stored = None
        return self._decoded(name, stored, out)

    def _pread_direct(self, fd: int, mv: memoryview, offset: int) -> None:
        """Fill ``mv`` (aligned, a multiple of :data:`DIRECT_ALIGN` long) from ``offset`` with direct reads, up
        to the end of the file; through the page cache where the file system refuses a direct read."""
        need = min(len(mv), self._file_size - offset)  # the last block of the file is read short
        done = 0
        while done < need:
            try:
                got = os.preadv(fd, [mv[done:]], offset + done)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                logger.debug("%s: a direct read was refused (%s); reading through the page cache", self.path, err)
                self._pread(mv[done:need], offset + done)
                return
            if got <= 0:
                break
            done += got
        if done < need:
            self._fail(f"truncated: could not read {need - done} bytes at offset {offset + done}")

    def _read_piece(self, names: list, pin: bool, pool: ThreadPoolExecutor) -> dict:
        """Read the stored bytes of ``names`` (in file order) with as few ``preadv`` calls as their spans
        allow and queue each tensor's decode and check on ``pool``. Returns ``{name: future of the tensor}``."""
        total = sum(_aligned(self.tensors[n].nbytes) for n in names)
        block = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        mv = memoryview(block.numpy()) if total else memoryview(b"")
        outs, payloads, run, run_start, run_end, off = {}, {}, [], None, None, 0
        for n in names:
            rec = self.tensors[n]
            b, e = self._spans[n]
            outs[n] = block[off : off + rec.nbytes]
            if rec.encoding == "zstd":
                payloads[n] = target = bytearray(e - b)
            else:
                if e - b != rec.nbytes:
                    self._fail(f"tensor {n!r}: decoded {e - b} bytes, expected {rec.nbytes}")
                payloads[n], target = None, mv[off : off + rec.nbytes]
            off += _aligned(rec.nbytes)
            if e == b:
                continue
            if run and b != run_end:  # not contiguous with the run so far: read that run first
                self._preadv(run, run_start)
                run = []
            if not run:
                run_start = b
            run.append(target)
            run_end = e
        if run:
            self._preadv(run, run_start)
        return {n: pool.submit(self._decoded, n, payloads[n], outs[n]) for n in names}

    def _preadv(self, bufs: list, offset: int) -> None:
        """Fill ``bufs`` one after another with the file's bytes from ``offset`` (a few large ``preadv`` calls)."""
        fd = self._file.fileno()
        views = [memoryview(b).cast("B") for b in bufs]
        i = 0
        while i < len(views):
            batch = views[i : i + _IOV_BATCH]
            want = sum(len(v) for v in batch)
            got = os.preadv(fd, batch, offset)
            if got <= 0:
                self._fail(f"truncated: could not read {want} bytes at offset {offset}")
            offset += got
            if got == want:
                i += len(batch)
                continue
            # a short read: drop the buffers it filled, keep reading into the rest of the one it stopped in
            for v in batch:
                if got >= len(v):
                    got -= len(v)
                    i += 1
                else:
                    views[i] = v[got:]
                    break

    def verify(self, num_threads: Optional[int] = None) -> int:
        """Decode every stored tensor and check its size and CRC-32. Returns how many were checked.

        Raises :class:`DeltaZipFormatError` naming a corrupt tensor. Nothing is kept: each thread holds
        one decoded tensor at a time.
        """
        names = sorted(self.tensors, key=lambda n: self._spans[n][0])

        def check(name):
            self.get_tensor(name)

        with ThreadPoolExecutor(max_workers=num_threads or min(8, os.cpu_count() or 1)) as pool:
            for _ in pool.map(check, names):
                pass
        return len(names)

    def module_tensors(self, module: str) -> dict:
        """role -> tensor of one compressed module."""
        rec = self.modules[module]
        return {role: self.get_tensor(t) for role, t in rec.tensors.items()}

    def stored_bytes(self, name: str) -> int:
        b, e = self._spans[name]
        return e - b

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
