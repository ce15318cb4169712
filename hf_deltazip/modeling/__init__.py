"""Serving fine-tunes as deltas: `DeltaModel`, its delta cache, routing and the delta-carrying layers.

Layout (arrows point down the data path):

* ``model.py`` - :class:`DeltaModel`, the user-facing object (loading, active delta, saving, merging).
* ``cache.py`` - :class:`DeltaCache`: residency of deltas (device / host / disk), budgets, holds, prefetch.
* ``placement.py`` - :class:`DeltaPlacer`: wrapping modules and placing a delta's tensors under a slot.
* ``layers.py`` - the delta-carrying wrappers (:class:`DeltaLinear`, :class:`DeltaEmbedding`, :class:`DeltaOverride`).
* ``routing.py`` - per-batch :class:`BatchRouting`, the :class:`Router`, :class:`LayoutVersion`, :class:`KernelPolicy`.
* ``arch.py`` - finding decoder layers and linear modules in transformers models.
* ``tensor_parallel.py`` - how each delta is cut on a rank of a base loaded with ``tp_plan`` (torchrun).
"""

from .cache import CacheEntry, CacheFullError, DeltaCache, DeltaInUseError, Residency
from .layers import DeltaEmbedding, DeltaLinear, DeltaModule, DeltaOverride
from .model import DeltaModel
from .routing import BatchRouting, KernelPolicy, LayoutVersion, Router

__all__ = [
    "DeltaModel",
    "DeltaCache",
    "CacheEntry",
    "CacheFullError",
    "DeltaInUseError",
    "Residency",
    "DeltaModule",
    "DeltaLinear",
    "DeltaEmbedding",
    "DeltaOverride",
    "BatchRouting",
    "KernelPolicy",
    "LayoutVersion",
    "Router",
]
