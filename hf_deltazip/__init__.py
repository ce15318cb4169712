"""hf-deltazip: full-parameter fine-tunes stored as compressed deltas over their base model.

Example:
    >>> from hf_deltazip import DeltaZipConfig, compress, DeltaModel
    >>> delta = compress("org/base", "org/finetune", DeltaZipConfig(bits=4), calibration="data.jsonl")
    >>> delta.save_pretrained("ft-delta")
    >>> model = DeltaModel.from_pretrained("ft-delta", base="org/base")
"""

import os as _os
import sys as _sys


def _unshadow_kernels_package():
    """Run from the root of a source checkout (``python -m ...`` puts it first on ``sys.path``), the checkout's
    ``kernels/`` folder, installed as ``hf_deltazip.kernels``, would also be importable as a top-level
    ``kernels`` and hide the Hugging Face ``kernels`` package that transformers (5.25+) imports. Drop that root
    from ``sys.path`` before transformers is imported; this package itself is already loaded."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not _os.path.isfile(_os.path.join(root, "kernels", "multi_delta.py")):
        return  # an installed copy, not a checkout
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != root]


_unshadow_kernels_package()

from ._version import __version__  # noqa: E402
from .config import DeltaZipConfig
from .errors import (
    BaseMismatchError,
    DeltaNotFoundError,
    DeltaZipConfigError,
    DeltaZipError,
    DeltaZipFormatError,
    HubError,
    TargetRatioTooLowError,
    UnsupportedModelError,
)

__all__ = [
    "DeltaZipConfig",
    "DeltaZipError",
    "DeltaZipConfigError",
    "TargetRatioTooLowError",
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
