"""hf-deltazip: full-parameter fine-tunes stored as compressed deltas over their base model.

Example:
    >>> from hf_deltazip import DeltaZipConfig, compress, DeltaModel
    >>> delta = compress("org/base", "org/finetune", DeltaZipConfig(bits=4), calibration="data.jsonl")
    >>> delta.save_pretrained("ft-delta")
    >>> model = DeltaModel.from_pretrained("ft-delta", base="org/base")
"""

from ._version import __version__
from .config import DeltaZipConfig
from .errors import (
    BaseMismatchError,
    DeltaNotFoundError,
    DeltaZipConfigError,
    DeltaZipError,
    DeltaZipFormatError,
    HubError,
    UnsupportedModelError,
)

__all__ = [
    "DeltaZipConfig",
    "DeltaZipError",
    "DeltaZipConfigError",
    "DeltaZipFormatError",
    "BaseMismatchError",
    "DeltaNotFoundError",
    "UnsupportedModelError",
    "HubError",
    "__version__",
]


def __getattr__(name):
    # heavy pieces (transformers, the solver) load on first use, so `import hf_deltazip` stays light
    if name == "compress":
        from .compression import compress

        return compress
    if name == "DeltaModel":
        from .modeling import DeltaModel

        return DeltaModel
    if name == "CompressedDelta":
        from .delta import CompressedDelta

        return CompressedDelta
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ += ["compress", "DeltaModel", "CompressedDelta"]
