"""Serving many deltas: the static-cache :class:`DecodeEngine` and the thread-safe :class:`DeltaServer`.

Both drive a :class:`~hf_deltazip.DeltaModel` through its public API only: ``model.cache``
(:meth:`~hf_deltazip.modeling.DeltaCache.acquire` / ``acquire_overlapped`` / ``release`` / ``fits`` /
``lock``), ``model.route``,
``model.route_static``, ``model.layout_version`` and ``model.graph_safe()``.
"""

from .engine import AdmissionPolicy, DecodeEngine, EngineStats, Finished, Pending, auto_max_deltas, fit_step_costs
from .norms import use_fused_norms
from .server import DeltaServer, QueueFullError, RequestStats, TokenStream

__all__ = ["AdmissionPolicy", "DecodeEngine", "EngineStats", "Finished", "Pending", "auto_max_deltas", "fit_step_costs",
           "DeltaServer", "QueueFullError", "RequestStats", "TokenStream", "use_fused_norms"]
