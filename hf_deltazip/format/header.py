"""The typed hf-deltazip header of a ``.dz`` file (docs/format.md, section 2).

:class:`DeltaHeader` holds everything the header says about a delta except the tensor, module and
parameter tables (those are :class:`~.container.TensorRecord` / :class:`~.container.ModuleRecord`):
which base it was made from and how to find that base again, the fine-tune's architecture, the
compression config, and the ``extra`` facts loaders rely on (tied embeddings, vocabulary sizes, ...).
Every field is checked when a header is read; keys this version does not know are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional

__all__ = ["DeltaHeader", "HEADER_TABLES"]

# the parts of dz_header that are tables of records, not header fields
HEADER_TABLES = ("tensors", "modules", "params")


class HeaderError(ValueError):
    """A header field has the wrong type (the reader turns it into a DeltaZipFormatError)."""


def _optional_str(name, value):
    if value is not None and not isinstance(value, str):
        raise HeaderError(f"header field {name!r} must be a string or null, got {type(value).__name__}")
    return value


def _dict(name, value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeaderError(f"header field {name!r} must be an object, got {type(value).__name__}")
    return dict(value)


def _str_list(name, value):
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HeaderError(f"header field {name!r} must be a list of strings")
    return list(value)


@dataclass(eq=False)
class DeltaHeader(Mapping):
    """What a delta records about itself.

    Read its fields as attributes (``header.base_model``, ``header.tied_embeddings``); as a read-only
    mapping it is its JSON form (``dict(header) == header.to_dict()``).

    Attributes:
        library_version: the hf-deltazip version that wrote it.
        base_model: the base it was compressed against: a Hub repo id or an absolute local folder.
        base_source: ``"hub"`` or ``"local"`` (``None`` in files written before it existed).
        base_revision: the base's Hub commit, when known.
        base_fingerprint: samples of the base's weights (see :mod:`hf_deltazip.fingerprint`).
        finetuned_model: where the fine-tune came from (informative).
        model_type, architectures, model_config: the fine-tune's transformers architecture and config.
        config: the :class:`~hf_deltazip.DeltaZipConfig` it was compressed with, as a dict (the truth
            when ``deltazip_config.json`` disagrees).
        extra: further facts (``tied_embeddings``, ``vocab_size_finetune``, ``finetune_num_params``, ...).
        unknown: header keys this version does not know, kept for round trips.
    """

    library_version: Optional[str] = None
    base_model: Optional[str] = None
    base_source: Optional[str] = None
    base_revision: Optional[str] = None
    base_fingerprint: dict = field(default_factory=dict)
    finetuned_model: Optional[str] = None
    model_type: Optional[str] = None
    architectures: list = field(default_factory=list)
    model_config: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    unknown: dict = field(default_factory=dict, repr=False)

    _STRINGS = ("library_version", "base_model", "base_source", "base_revision", "finetuned_model", "model_type")
    _DICTS = ("base_fingerprint", "model_config", "config", "extra")

    @classmethod
    def from_dict(cls, data: Any) -> "DeltaHeader":
        """Check and type a header read from JSON (or written by older code); raises ``HeaderError``."""
        if isinstance(data, DeltaHeader):
            return data
        if not isinstance(data, dict):
            raise HeaderError(f"the header must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"unknown"}
        kwargs: dict = {}
        for name in cls._STRINGS:
            kwargs[name] = _optional_str(name, data.get(name))
        for name in cls._DICTS:
            kwargs[name] = _dict(name, data.get(name))
        kwargs["architectures"] = _str_list("architectures", data.get("architectures"))
        if kwargs["base_source"] not in (None, "hub", "local"):
            raise HeaderError(f"header field 'base_source' must be 'hub', 'local' or null, got {kwargs['base_source']!r}")
        unknown = {k: v for k, v in data.items() if k not in known and k not in HEADER_TABLES}
        return cls(**kwargs, unknown=unknown)

    def to_dict(self) -> dict:
        """The JSON form (known fields, then the unknown ones as they were read)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "unknown"}
        out.update(self.unknown)
        return out

    # the read-only mapping of the JSON form
    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other) -> bool:
        if isinstance(other, (DeltaHeader, dict)):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None

    # -- the extra facts loaders rely on
    @property
    def tied_embeddings(self) -> bool:
        """The fine-tune's input embedding and LM head are one tensor (stored once)."""
        return bool(self.extra.get("tied_embeddings"))

    @property
    def vocab_size_finetune(self) -> Optional[int]:
        v = self.extra.get("vocab_size_finetune")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def finetune_num_params(self) -> int:
        """Parameters of the fine-tune (what the compression ratio is measured against), 0 if unknown."""
        v = self.extra.get("finetune_num_params", 0)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0
