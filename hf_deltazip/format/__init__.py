"""The ``.dz`` delta format (specification: ``docs/format.md``).

* ``container.py`` - the file: :func:`write_dz` (atomic) and :class:`DeltaZipFile` (a reader that checks
  every length, offset, shape and checksum before it decodes anything), with the tensor and module records.
* ``header.py`` - :class:`DeltaHeader`, the typed header: the base and how to find it, the architecture,
  the config, and the facts loaders rely on.
"""

from ..fileio import atomic_write_bytes
from .container import (
    DTYPES,
    DZ_FILENAME,
    DZ_FORMAT_VERSION,
    FORMAT_TAG,
    MODULE_KINDS,
    SPARSITY_LAYOUTS,
    DeltaZipFile,
    ModuleRecord,
    TensorRecord,
    dtype_name,
    write_dz,
)
from .header import HEADER_TABLES, DeltaHeader

__all__ = [
    "DZ_FILENAME",
    "DZ_FORMAT_VERSION",
    "FORMAT_TAG",
    "DTYPES",
    "MODULE_KINDS",
    "SPARSITY_LAYOUTS",
    "DeltaZipFile",
    "DeltaHeader",
    "HEADER_TABLES",
    "ModuleRecord",
    "TensorRecord",
    "atomic_write_bytes",
    "dtype_name",
    "write_dz",
]
