"""The version of hf-deltazip (read by pyproject.toml and the package)."""

__version__ = "0.1.0.dev0"
