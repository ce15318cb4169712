"""hf-deltazip: full-parameter fine-tunes stored as compressed deltas over their base model.

Example:
    >>> from hf_deltazip import DeltaZipConfig, compress, DeltaModel
    >>> delta = compress("org/base", "org/finetune", DeltaZipConfig(bits=4), calibration="data.jsonl")
    >>> delta.save_pretrained("ft-delta")
    >>> model = DeltaModel.from_pretrained("ft-delta", base="org/base")
"""

__version__ = "0.1.0.dev0"


def _map_source_tree_packages() -> None:
    # An installed wheel carries the top-level folders kernels/ and model_cards/ as
    # hf_deltazip.kernels and hf_deltazip.model_cards. In a source checkout they sit beside this
    # package: register them under the same names so both layouts import alike.
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for sub in ("kernels", "model_cards"):
        name = f"{__name__}.{sub}"
        init = here.parent / sub / "__init__.py"
        if name in sys.modules or (here / sub).is_dir() or not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        globals()[sub] = module


_map_source_tree_packages()

from .config import DeltaZipConfig  # noqa: E402
from .errors import (  # noqa: E402
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
