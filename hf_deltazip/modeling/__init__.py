"""Serving: `DeltaModel` and the delta-carrying layers."""

from .delta_model import DeltaModel

__all__ = ["DeltaModel"]
