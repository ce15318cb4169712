"""Which delta each batch row uses, and when the device layout of the deltas changed.

Three small objects, each with one job, shared by every delta-carrying module of one model:

* :class:`BatchRouting` - the rows of *one* batch: a slot per row (host list, ``-1`` = the plain
  base) or, for a captured decode step, a device tensor of slots. Immutable; made per call.
* :class:`Router` - the channel through which a batch's routing reaches the modules during a
  forward pass that transformers drives (the modules cannot take extra arguments). Thread-local,
  so two threads may run batches on one model.
* :class:`LayoutVersion` - a counter bumped whenever a module's device tensors are replaced (not
  merely written in place). A captured CUDA graph is valid while the version it was captured at holds.

And :class:`KernelPolicy`: whether modules run the Triton kernels, and how much room their kernel
stacks keep for more deltas.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..errors import DeltaZipError

__all__ = ["BatchRouting", "Router", "LayoutVersion", "KernelPolicy", "BASE_SLOT", "DECODE_SPLIT_MIN_DELTAS",
           "host_to_device"]

BASE_SLOT = -1
#: distinct deltas from which ``KernelPolicy(decode="auto")`` takes the split route (see there)
DECODE_SPLIT_MIN_DELTAS = 6


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device. A copy out of pageable host memory waits
    until the GPU has run everything queued before it (a prefill's first layer would wait for the decode
    step in flight, and its later layers for the earlier ones); out of page-locked memory it is queued like a
    kernel. PyTorch's page-locked allocator keeps the buffer until the queued copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class BatchRouting:
    """The slot each row of one batch uses.

    Attributes:
        slots: one slot per row (``-1``: the plain base), or ``None`` for an all-base batch.
        uniform: every row uses ``slots[0]``, whatever the batch size (a model's active delta).
        device_rows: a device int32 tensor of per-row slots read inside a captured decode step
            (``slots`` is then ``None``): modules must take no host-side decisions.
        max_ids: per row of ``slots``, its largest token id, where the host knows them (the engine's prompts):
            modules that check ids against a fine-tune's vocabulary take them from here instead of reading the
            ids back from the device, which would wait for all the work queued before.
    """

    slots: Optional[tuple] = None
    uniform: bool = False
    device_rows: Optional[torch.Tensor] = None
    max_ids: Optional[tuple] = None
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def base(cls) -> "BatchRouting":
        return cls()

    @classmethod
    def per_row(cls, slots: Sequence[int], max_ids: Optional[Sequence[int]] = None) -> "BatchRouting":
        slots = tuple(int(s) for s in slots)
        if max_ids is not None:
            max_ids = tuple(int(i) for i in max_ids)
            if len(max_ids) != len(slots):
                raise DeltaZipError(f"{len(slots)} rows but {len(max_ids)} max_ids: give one per row")
        return cls(slots=slots, max_ids=max_ids)

    @classmethod
    def every_row(cls, slot: int) -> "BatchRouting":
        return cls(slots=(int(slot),), uniform=True)

    @classmethod
    def static(cls, device_rows: torch.Tensor) -> "BatchRouting":
        return cls(device_rows=device_rows)

    @property
    def is_static(self) -> bool:
        return self.device_rows is not None

    def rows_for(self, batch: int) -> list:
        """Slot of each of ``batch`` rows (generate() may repeat rows: beams, several sequences each)."""
        if self.slots is None:
            return [BASE_SLOT] * batch
        if self.uniform:
            return [self.slots[0]] * batch
        n = len(self.slots)
        if n == batch:
            return list(self.slots)
        if batch % n == 0:
            return [s for s in self.slots for _ in range(batch // n)]
        raise DeltaZipError(f"the batch has {batch} rows but {n} delta names were given: pass one name per row")

    def max_id_of(self, rows: Sequence[int], batch: int) -> Optional[int]:
        """The largest token id of the batch rows ``rows`` (of ``batch``), if the host knows it, else ``None``."""
        if self.max_ids is None or not rows:
            return None
        n = len(self.max_ids)
        if batch % n:
            return None
        return max(self.max_ids[r // (batch // n)] for r in rows)

    def device_rows_for(self, batch: int, device) -> torch.Tensor:
        """``rows_for(batch)`` as a device int32 tensor, made once per batch size and device."""
        if self.device_rows is not None:
            return self.device_rows
        key = (batch, str(device))
        t = self._device_cache.get(key)
        if t is None:
            t = self._device_cache[key] = host_to_device(torch.tensor(self.rows_for(batch), dtype=torch.int32), device)
        return t

    def kernel_rows(self, batch: int, tokens: int, device) -> tuple:
        """What every delta layer of this batch passes its kernels, made once per batch (and captured once
        per decode step): ``slot + 1`` of each of the ``batch * tokens`` rows (long), and
        ``(slots, segments)``: the rows' int32 slot ids and their row-segment table."""
        key = ("kernel", batch, tokens, str(device))
        hit = self._device_cache.get(key)
        if hit is None:
            from ..kernels import build_row_segments

            rows = self.device_rows_for(batch, device)
            slots = (rows.repeat_interleave(tokens) if tokens > 1 else rows).to(torch.int32)
            hit = self._device_cache[key] = (slots.long() + 1, (slots, build_row_segments(slots)))
        return hit

    def token_rows(self, rows: tuple, tokens: int, device) -> torch.Tensor:
        """Long indices of the ``rows * tokens`` flattened rows of the batch rows ``rows``, made once per batch
        and device (every layer of the dequant route gathers the same rows: one host-to-device copy, not
        one per layer)."""
        key = ("tokens", rows, tokens, str(device))
        hit = self._device_cache.get(key)
        if hit is None:
            r = torch.tensor(rows, dtype=torch.long)
            hit = self._device_cache[key] = host_to_device((r[:, None] * tokens + torch.arange(tokens)).reshape(-1), device)
        return hit

    def int32_on(self, values: tuple, device) -> torch.Tensor:
        """``values`` as a device int32 tensor, made once per batch and device (every layer of the dequant route
        names the same slots)."""
        key = ("int32", values, str(device))
        hit = self._device_cache.get(key)
        if hit is None:
            hit = self._device_cache[key] = host_to_device(torch.tensor(values, dtype=torch.int32), device)
        return hit

    def gather_plan(self, groups: tuple, tokens: int, device) -> tuple:
        """How the dequant route runs several deltas' rows through one batched matmul, made once per batch and
        device: ``groups`` holds each delta's batch rows (a tuple of tuples), each batch row ``tokens``
        flattened rows. Returns ``(gather, keep, rows)``, long device tensors: ``gather`` (``len(groups) * R``,
        R the most rows of a delta) picks each delta's rows, padded with its first; ``keep`` the positions of
        the real (not padding) ones in that order, ``None`` without padding; ``rows`` their flattened rows."""
        key = ("gather", groups, tokens, str(device))
        hit = self._device_cache.get(key)
        if hit is None:
            width = tokens * max(len(g) for g in groups)
            gather, keep, rows = [], [], []
            for u, g in enumerate(groups):
                own = [r * tokens + t for r in g for t in range(tokens)]
                gather += own + own[:1] * (width - len(own))
                keep += range(u * width, u * width + len(own))
                rows += own

            def put(v):
                return host_to_device(torch.tensor(v, dtype=torch.long), device)

            hit = self._device_cache[key] = (put(gather), None if len(rows) == len(gather) else put(keep), put(rows))
        return hit


_BASE = BatchRouting.base()


class Router:
    """The current :class:`BatchRouting` of this thread, for the modules of one model."""

    def __init__(self):
        self._local = threading.local()

    @property
    def current(self) -> BatchRouting:
        return getattr(self._local, "routing", _BASE)

    @contextmanager
    def use(self, routing: BatchRouting):
        """Within this block, the modules of this thread route by ``routing``."""
        previous = self.current
        self._local.routing = routing
        try:
            yield routing
        finally:
            self._local.routing = previous

    def __deepcopy__(self, memo):  # a copied model routes on its own
        return Router()


class LayoutVersion:
    """Bumped when a module's device tensors are replaced; captured graphs are valid while it holds."""

    def __init__(self):
        self.value = 0
        self._lock = threading.Lock()

    def bump(self) -> None:
        with self._lock:
            self.value += 1

    def __deepcopy__(self, memo):
        return LayoutVersion()


class KernelPolicy:
    """Whether delta modules run the Triton kernels, and the room their kernel stacks keep.

    Args:
        mode: ``"auto"`` (kernels on CUDA), ``"always"`` (also on the CPU, through the Triton
            interpreter) or ``"never"`` (the PyTorch reference path).
        capacity: deltas a kernel stack is sized for (the cache's resident budget), or ``None``.
        prefill: how eager (uncaptured) forwards with many rows per delta run on the kernel route:
            ``"auto"`` (the default: ``"split"`` for forwards of ``prefill_split_min_rows`` rows or more,
            else ``"fused"``), ``"fused"`` (the multi-delta kernel, as decode steps), ``"dequant"`` (the
            base in one dense matmul, plus ``x_rows @ dequant(delta)^T`` per delta, the deltas written out
            dense once per layer and call, those of one format class in one launch, their rows in one batched
            matmul) or ``"split"`` (the base in one dense matmul, read once for every
            row, plus the multi-delta kernel adding the deltas alone to its output).
        dequant_min_rows: with ``prefill="dequant"``, ``"split"`` or ``"auto"``, the fewest rows (tokens)
            every delta of the batch must have for the dequant or split route; batches with fewer take the
            fused kernel.
        prefill_split_min_rows: with ``prefill="auto"``, the fewest rows (tokens, all deltas together) a
            forward needs for the split route (1024: the split prefill was 1.18-1.31x the fused kernel at
            1024-2048 tokens on an H200 and an H100, but 0.94-1.17x at 512 and 0.90x at 128; BENCHMARKS.md
            section 4).
        decode: how the other forwards (decode steps, captured or not, and prefills the routes above do
            not take) run: ``"fused"`` (the base and every row's delta in one launch per class of delta
            format), ``"split"`` (the base by one dense matmul, which reads its weight once for every row;
            then the multi-delta kernel adds each row's delta into its output, skipping the base:
            ``multi_delta_linear(accumulate=True)``) or ``"auto"`` (the default): ``"split"`` for a forward
            of at most ``kernels.multi_delta.GLUON_MAX_ROWS`` rows carrying ``decode_split_min_deltas``
            distinct deltas or more where the split route adds them with the Gluon decode kernel (an sm_90
            GPU, ``kernels.gluon_decode_available``), else ``"fused"``. A forward routed on the host counts its deltas itself; a captured step
            cannot, so the decode engine counts the step's deltas and replays the graph it captured for
            that route (:meth:`step_route`).
        decode_split_min_rows: with ``decode="split"`` or ``"auto"``, the fewest rows a forward needs for
            the split route; fewer take the fused kernel.
        decode_split_min_deltas: with ``decode="auto"``, the fewest distinct deltas a forward's rows need
            for the split route (BENCHMARKS.md section 4, "The decode routes chosen per step").

    :attr:`sparse` (set by ``DeltaModel.set_activation_sparsity``): whether thresholded layers run decode steps
    through the activation-sparse kernels; layers wrapped later follow it.
    """

    MODES = ("auto", "always", "never")
    PREFILL = ("auto", "fused", "dequant", "split")
    DECODE = ("auto", "fused", "split")

    def __init__(self, mode: str = "auto", capacity: Optional[int] = None, prefill: str = "auto",
                 dequant_min_rows: int = 64, decode: str = "auto", decode_split_min_rows: int = 1,
                 prefill_split_min_rows: int = 1024, decode_split_min_deltas: int = DECODE_SPLIT_MIN_DELTAS):
        if mode not in self.MODES:
            raise DeltaZipError(f'use_kernels must be "auto", "always" or "never", got {mode!r}')
        self.mode = mode
        self.capacity = capacity
        # set (and checked) by the two setters below from the arguments, whose defaults are the only ones
        self.prefill = self.dequant_min_rows = self.prefill_split_min_rows = None
        self.decode = self.decode_split_min_rows = self.decode_split_min_deltas = None
        self.sparse = False
        self._step = threading.local()  # the route a decode engine chose for the step it runs (step_route)
        self.set_prefill(prefill, dequant_min_rows, prefill_split_min_rows)
        self.set_decode(decode, decode_split_min_rows, decode_split_min_deltas)

    def set_prefill(self, prefill: Optional[str] = None, dequant_min_rows: Optional[int] = None,
                    split_min_rows: Optional[int] = None) -> None:
        """Change :attr:`prefill`, :attr:`dequant_min_rows` and/or :attr:`prefill_split_min_rows` (``None``
        keeps the current value); nothing changes when one of them is refused."""
        if prefill is not None and prefill not in self.PREFILL:
            raise DeltaZipError(f'prefill must be "auto", "fused", "dequant" or "split", got {prefill!r}')
        for name, v in (("dequant_min_rows", dequant_min_rows), ("prefill_split_min_rows", split_min_rows)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise DeltaZipError(f"{name} must be a positive int, got {v!r}")
        self.prefill = prefill or self.prefill
        self.dequant_min_rows = dequant_min_rows or self.dequant_min_rows
        self.prefill_split_min_rows = split_min_rows or self.prefill_split_min_rows

    def set_decode(self, decode: Optional[str] = None, min_rows: Optional[int] = None,
                   min_deltas: Optional[int] = None) -> None:
        """Change :attr:`decode`, :attr:`decode_split_min_rows` and/or :attr:`decode_split_min_deltas`
        (``None`` keeps the current value); nothing changes when one of them is refused."""
        if decode is not None and decode not in self.DECODE:
            raise DeltaZipError(f'decode must be "auto", "fused" or "split", got {decode!r}')
        for name, v in (("decode_split_min_rows", min_rows), ("decode_split_min_deltas", min_deltas)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise DeltaZipError(f"{name} must be a positive int, got {v!r}")
        self.decode = decode or self.decode
        self.decode_split_min_rows = min_rows or self.decode_split_min_rows
        self.decode_split_min_deltas = min_deltas or self.decode_split_min_deltas

    def decode_route(self, rows: int, deltas: int, device) -> str:
        """``"split"`` or ``"fused"``: the route of a forward of ``rows`` rows carrying ``deltas`` distinct
        deltas on ``device`` outside the prefill routes (see ``decode``)."""
        if rows < self.decode_split_min_rows or self.decode == "fused":
            return "fused"
        if self.decode == "split":
            return "split"
        from ..kernels import gluon_decode_available
        from ..kernels.multi_delta import GLUON_MAX_ROWS

        # where the Gluon kernel would not add the deltas (a prefill's many rows), the split route has not paid
        if rows > GLUON_MAX_ROWS or deltas < self.decode_split_min_deltas:
            return "fused"
        return "split" if gluon_decode_available(device) else "fused"

    def wants_decode_split(self, rows: int, deltas: Optional[int] = None, device=None) -> bool:
        """Whether a forward of ``rows`` rows outside the prefill routes takes the split route. ``deltas``:
        the distinct deltas of its rows where the host knows them (``None``: a captured step, which takes
        the route its engine chose with :meth:`step_route`, else the fused one)."""
        chosen = getattr(self._step, "route", None)
        if chosen is not None:
            return chosen == "split" and rows >= self.decode_split_min_rows
        if self.decode == "auto" and deltas is None:
            return False
        return self.decode_route(rows, deltas or 0, device) == "split"

    @contextmanager
    def step_route(self, route: Optional[str]):
        """Within the block (this thread), forwards outside the prefill routes take ``route`` (``"split"``
        or ``"fused"``; ``None``: as ``decode`` says). The decode engine runs and captures its steps in one."""
        if route not in (None, "split", "fused"):
            raise DeltaZipError(f'a step route is "split", "fused" or None, got {route!r}')
        before = getattr(self._step, "route", None)
        self._step.route = route
        try:
            yield
        finally:
            self._step.route = before

    def wants_dequant(self, rows_per_delta: int) -> bool:
        """Whether an eager forward whose every delta has ``rows_per_delta`` rows or more takes the dequant route."""
        return self.prefill == "dequant" and rows_per_delta >= self.dequant_min_rows

    def wants_split(self, rows_per_delta: int, rows: int) -> bool:
        """Whether an eager forward of ``rows`` rows whose every delta has ``rows_per_delta`` rows or more takes
        the split route."""
        chosen = self.prefill == "split" or (self.prefill == "auto" and rows >= self.prefill_split_min_rows)
        return chosen and rows_per_delta >= self.dequant_min_rows

    def wants_kernels(self, device) -> bool:
        return self.mode == "always" or (self.mode == "auto" and torch.device(device).type == "cuda")

    def __deepcopy__(self, memo):
        policy = KernelPolicy(self.mode, self.capacity, self.prefill, self.dequant_min_rows, self.decode,
                              self.decode_split_min_rows, self.prefill_split_min_rows, self.decode_split_min_deltas)
        policy.sparse = self.sparse
        return policy
