"""`DeltaModel`: one base model, any number of compressed fine-tunes, a different one per batch row."""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from concurrent.futures import Future
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..delta import CompressedDelta, PackedModule, load_folder_config, resolve_delta_folder, resolve_recorded_base
from ..errors import DeltaZipError
from ..fileio import staged_writes
from ..format import DZ_FILENAME, DeltaHeader, DeltaZipFile
from .cache import CacheEntry, CacheFullError, DeltaCache, Residency, to_host
from .placement import DeltaPlacer
from .quantized import dequantize_model, is_quantized_model, warn_merge_dequantizes
from .routing import BatchRouting, KernelPolicy, LayoutVersion, Router
from .tensor_parallel import TensorParallelError, distributed_kwargs, local_tensor, tp_size

__all__ = ["DeltaModel"]

_UNSET = object()  # set_delta() never called


class DeltaModel(nn.Module):
    """A transformers causal LM with compressed fine-tunes loaded on top of it.

    The base stays as it is; each module a delta touches is wrapped (the original kept as
    ``base_layer``). ``model(...)`` and ``model.generate(...)`` take ``delta_names``: one name per
    batch row, ``None`` for the plain base.

    **The active delta.** A call without ``delta_names`` uses the *active* delta on every row, as PEFT
    uses its active adapter: the one chosen with :meth:`set_delta` (``set_delta(None)``: the plain
    base); :meth:`from_pretrained` makes the delta it loads active; with no choice made and exactly
    one delta loaded, that delta. With several deltas loaded and none chosen, a call without
    ``delta_names`` raises instead of guessing.

    Example:
        >>> model = DeltaModel.from_pretrained("chat-delta", base="org/base", delta_name="chat")
        >>> model.generate(ids)  # the "chat" fine-tune
        >>> model.load_delta("code-delta", delta_name="code")
        >>> out = model.generate(ids, attention_mask=mask, delta_names=["chat", "code", None])
    """

    def __init__(self, base_model: nn.Module, *, use_kernels: str = "auto"):
        super().__init__()
        self.base_model = base_model
        self.router = Router()
        self.layout_version = LayoutVersion()
        self.kernel_policy = KernelPolicy(use_kernels)
        self._placer = DeltaPlacer(base_model, self.router, self.layout_version, self.kernel_policy)
        self._cache = DeltaCache(self._placer)
        self._active = _UNSET
        # Jacobi decoding's fallback gates, one per (rows' deltas, batch, block, min_accept): a delta that
        # does not accept several tokens per forward falls back at once on the next generate call
        self._jacobi_gates: dict = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        delta_id_or_path: Union[str, os.PathLike],
        base: Union[str, os.PathLike, nn.Module, None] = None,
        delta_name: str = "default",
        *,
        revision: Optional[str] = None,
        token: Optional[str] = None,
        cache_dir: Optional[str] = None,
        local_files_only: Optional[bool] = None,
        use_kernels: str = "auto",
        activation_sparsity=None,
        activation_calibration=None,
        activation_decode_only: bool = False,
        **base_kwargs,
    ) -> "DeltaModel":
        """Load a base model and one delta onto it; that delta is made active.

        Args:
            delta_id_or_path: a local delta folder or a Hub repo id.
            base: the base model, its id or path; ``None`` loads the base recorded in the delta.
            delta_name: the name this delta is known by (``None``: the folder or repo name).
            revision, token, cache_dir, local_files_only: for downloading the delta from the Hub.
            use_kernels: ``"auto"`` (Triton kernels on CUDA), ``"always"`` or ``"never"``.
            activation_sparsity: off (``None``, the default); a target such as ``0.4`` (thresholds read
                from ``activation_thresholds.json`` in the delta folder or a local base folder, else
                calibrated from ``activation_calibration``); or thresholds / their file (see
                :mod:`.activation_sparsity` and :meth:`set_activation_sparsity`).
            activation_calibration: texts or token ids to calibrate thresholds on when none are saved.
            activation_decode_only: threshold one-token decode steps only (prompts run dense). Decode steps of
                several rows threshold the deltas' inputs only (the base multiplies the whole input); change that
                with :meth:`set_activation_sparsity` (``threshold_base_rows``).
            base_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (dtype, device_map, tp_plan,
                quantization_config, ...). A bitsandbytes base (``BitsAndBytesConfig(load_in_4bit=True)``,
                nf4 or fp4, double quantization, or ``load_in_8bit=True``) computes its own matmuls and the
                deltas are added on top; with a ``device_map`` (CPU or disk offload included) each delta
                lives on the device its layer computes on. With ``tp_plan="auto"`` under ``torchrun`` the base
                is sharded over the ranks and each rank keeps only its shard of each delta (see
                :mod:`.tensor_parallel`); every rank then makes the same calls with the same inputs.

        Raises:
            BaseMismatchError: the base is not the one the delta was made from.
            DeltaZipFormatError: the delta folder is corrupt.
            HubError: the delta could not be downloaded.
        """
        hub = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only)
        folder = resolve_delta_folder(delta_id_or_path, **{k: v for k, v in hub.items() if v is not None})
        if not isinstance(base, nn.Module):
            from transformers import AutoModelForCausalLM

            with DeltaZipFile(folder / DZ_FILENAME) as dz:
                header = dz.header
            # a recorded local base that is gone is reported now, not retried as a Hub id
            base_id = str(base) if base is not None else resolve_recorded_base(header)
            kwargs = dict(base_kwargs)
            if base is None and header.base_source == "hub" and header.base_revision and "revision" not in kwargs:
                kwargs["revision"] = header.base_revision
            if token is not None:
                kwargs.setdefault("token", token)
            base = AutoModelForCausalLM.from_pretrained(base_id, **distributed_kwargs(kwargs))
        model = cls(base, use_kernels=use_kernels)
        model.set_delta(model.load_delta(folder, delta_name=delta_name))
        if activation_sparsity is not None:
            from .activation_sparsity import resolve_activation_sparsity

            base_dir = getattr(model.base_model, "name_or_path", None) or None  # where transformers loaded it from
            local_base = Path(base_dir) if base_dir and Path(base_dir).is_dir() else None
            model.set_activation_sparsity(resolve_activation_sparsity(
                model, activation_sparsity, [folder, local_base], activation_calibration,
                tokenizer_from=[folder, base_dir]), decode_only=activation_decode_only)
        return model

    def load_delta(
        self,
        delta_id_or_path: Union[str, os.PathLike],
        delta_name: Optional[str] = None,
        *,
        num_threads: Optional[int] = None,
        resident: bool = True,
        **hub_kwargs,
    ) -> str:
        """Load another delta onto this base. Returns its name. The active delta does not change.

        Args:
            delta_id_or_path: a local delta folder or a Hub repo id.
            delta_name: the name to use (default: the folder or repo name).
            num_threads: threads decompressing tensors in parallel.
            resident: put it on the model's device now (default); ``False`` only registers it (its header
                and base are checked) and it is loaded on demand when a batch names it.
            hub_kwargs: revision, token, cache_dir, local_files_only.
        """
        name = check_delta_name(Path(str(delta_id_or_path)).name if delta_name is None else delta_name)
        folder = resolve_delta_folder(delta_id_or_path, **{k: v for k, v in hub_kwargs.items() if v is not None})
        with self._cache.lock:
            if name in self._cache:
                raise DeltaZipError(f"a delta named {name!r} is already loaded: delete_delta({name!r}) first or pick another name")
            with DeltaZipFile(folder / DZ_FILENAME) as dz:
                header, content_id = dz.header, dz.content_id
            config = load_folder_config(folder, header)  # the header is the truth: a contradicting JSON is refused
            self._placer.check_base(header, folder)
            self._cache.add(CacheEntry(name=name, path=folder, config=config, header=header, num_threads=num_threads,
                                       content_id=content_id), resident=resident)
        return name

    def add_delta(self, delta, delta_name: str, *, resident: bool = True) -> str:
        """Put an in-memory delta on this base (no file): a :class:`~hf_deltazip.CompressedDelta`
        (e.g. straight from :func:`hf_deltazip.compress`) or a dict ``{module name: PackedModule}``.

        The delta's tensors may be on the CPU or on the model's device. If the cache evicts it later
        it is kept in host memory, since there is no file to read it back from.
        """
        check_delta_name(delta_name)
        if isinstance(delta, CompressedDelta):
            modules, params, config = dict(delta.modules), dict(delta.params), delta.config
            header = DeltaHeader.from_dict(delta.header)
            if header.base_fingerprint or header.model_type:
                self._placer.check_base(header, f"delta {delta_name!r}")
        elif isinstance(delta, dict) and all(isinstance(p, PackedModule) for p in delta.values()):
            modules, params, header, config = dict(delta), {}, DeltaHeader(), None
        else:
            raise DeltaZipError(
                f"add_delta takes a CompressedDelta or a dict of PackedModule, got {type(delta).__name__}; "
                "for a folder or Hub repo use load_delta()"
            )
        if not resident:  # kept until needed: in host memory, where the cache's budget counts it
            modules, params = to_host(modules, params)
        with self._cache.lock:
            if delta_name in self._cache:
                raise DeltaZipError(
                    f"a delta named {delta_name!r} is already loaded: delete_delta({delta_name!r}) first or pick another name"
                )
            self._placer.validate(modules, params, header, f"delta {delta_name!r}")
            self._cache.add(CacheEntry(name=delta_name, path=None, config=config, header=header, host=(modules, params),
                                       host_is_only_copy=True, validated=True), resident=resident)
        return delta_name

    # ------------------------------------------------------------------ the delta cache
    @property
    def cache(self) -> DeltaCache:
        """The :class:`~hf_deltazip.modeling.cache.DeltaCache` of this model's deltas."""
        return self._cache

    def configure_cache(
        self,
        *,
        max_resident: Optional[int] = None,
        max_resident_bytes: Optional[int] = None,
        max_host_bytes: int = 0,
    ) -> None:
        """Limit the deltas kept on the model's device; keep evicted ones in (pinned) host memory.

        A batch that names a delta that is not resident loads it on demand (from the host tier if it
        is there, else from disk or the Hub cache), evicting the least recently used resident deltas
        that the batch does not need.

        Args:
            max_resident: most deltas on the device at once (``None``: no limit).
            max_resident_bytes: most bytes of deltas on the device at once (``None``: no limit): their
                packed tensors as held, and on the activation-sparse route the input-major copies of their
                linear deltas (:meth:`set_activation_sparsity`).
            max_host_bytes: bytes of host memory for copies of deltas (pinned when CUDA is available),
                so an evicted delta comes back without reading and decompressing its file again.

        Call it before loading many deltas: on CUDA the kernel stacks are sized for ``max_resident``
        deltas when they are first built, so later loads and evictions only write into that room (no
        reallocation, and captured decode graphs stay valid). Without a ``max_resident`` a stack
        keeps half again the room it needs and is rebuilt (old and new briefly both in memory) when full.
        """
        self._cache.configure(max_resident=max_resident, max_resident_bytes=max_resident_bytes,
                              max_host_bytes=max_host_bytes)

    def configure_kernels(self, *, prefill: Optional[str] = None, dequant_min_rows: Optional[int] = None,
                          decode: Optional[str] = None, decode_split_min_rows: Optional[int] = None,
                          prefill_split_min_rows: Optional[int] = None,
                          decode_split_min_deltas: Optional[int] = None) -> None:
        """Choose how prefills and decode steps run the kernels.

        Args:
            prefill: ``"auto"`` (default): ``"split"`` for forwards of ``prefill_split_min_rows`` tokens or
                more, ``"fused"`` for smaller ones. ``"fused"``: the multi-delta kernel, as in decode steps.
                ``"dequant"``: the base runs through one dense matmul and each delta adds ``x_rows @ dequant(delta)^T``
                for its rows, the deltas written out dense (``[out, in]`` in the activation dtype) once per
                layer and call, those of one format together (one launch, at most
                ``kernels.slot_stacks.DEQUANT_CHUNK_BYTES`` at once) with their rows in one batched matmul; for
                many rows per delta, where the fused kernel (built for a few rows
                per delta) re-reads the weights for every block of rows. ``"split"``: the base through
                one dense matmul (its weight read once for all rows) and the deltas through the
                multi-delta kernel adding each row's delta to its output (only the packed codes re-read per block).
            dequant_min_rows: with ``"dequant"``, ``"split"`` or ``"auto"``, the fewest rows (tokens) every
                delta of a batch needs for the dequant or split route (default 64); smaller batches keep the
                fused kernel.
            prefill_split_min_rows: with ``prefill="auto"``, the fewest rows (tokens of all the batch's rows
                together) a forward needs for the split route (default 1024: at 8B layer shapes the split
                prefill was 1.18-1.31x the fused kernel at 1024-2048 tokens on an H200 and an H100, 0.94-1.17x
                at 512 and 0.90x for one 2-bit prompt of 128; BENCHMARKS.md section 4).
            decode: how every other forward runs, decode steps (captured or not) included: ``"fused"``:
                the multi-delta kernel reads the base and the rows' deltas in one launch. ``"split"``: the
                base through one dense matmul, then the kernel adds each row's delta to its output without
                reading the base (the fused kernel reads the base once per block of 16 rows). ``"auto"``
                (default): ``"split"`` for a forward of up to 64 rows whose rows carry ``decode_split_min_deltas``
                distinct deltas or more where the Gluon decode kernel adds them (an sm_90 GPU), ``"fused"`` otherwise;
                the decode engine captures one graph per route and replays the one each step's mix needs.
            decode_split_min_rows: with ``decode="split"`` or ``"auto"``, the fewest rows a forward needs
                for the split route (default 1); smaller ones keep the fused kernel.
            decode_split_min_deltas: with ``decode="auto"``, the fewest distinct deltas a forward's rows
                need for the split route (default ``routing.DECODE_SPLIT_MIN_DELTAS``, measured:
                BENCHMARKS.md section 4).

        Outputs agree with the fused route to 16-bit rounding (the split routes round the base's product
        before the deltas are added). Captured decode steps are captured again after a change of ``decode``.

        Raises:
            DeltaZipError: an unknown ``prefill`` or ``decode``, or a ``dequant_min_rows``,
            ``decode_split_min_rows``, ``decode_split_min_deltas`` or ``prefill_split_min_rows`` below 1.
        """
        policy = self.kernel_policy
        policy.set_prefill(prefill, dequant_min_rows, prefill_split_min_rows)
        before = (policy.decode, policy.decode_split_min_rows, policy.decode_split_min_deltas)
        policy.set_decode(decode, decode_split_min_rows, decode_split_min_deltas)
        if (policy.decode, policy.decode_split_min_rows, policy.decode_split_min_deltas) != before:
            self.layout_version.bump()  # captured steps took the other route

    @property
    def resident_deltas(self) -> list:
        """Names of the deltas on the model's device now."""
        return self._cache.resident

    def prefetch(self, names: Sequence[str], *, to_device: bool = True) -> Future:
        """Load deltas ahead of the requests that will name them (see :meth:`DeltaCache.prefetch`)."""
        return self._cache.prefetch(names, to_device=to_device)

    # ------------------------------------------------------------------ managing deltas
    @property
    def deltas(self) -> list:
        """Names of the loaded deltas (resident on the device or not)."""
        return self._cache.names

    @property
    def active_delta(self) -> Optional[str]:
        """The delta calls without ``delta_names`` use (``None``: the plain base); see the class docstring."""
        if self._active is not _UNSET:
            return self._active
        names = self._cache.names
        return names[0] if len(names) == 1 else None

    def set_delta(self, name: Optional[str]) -> None:
        """Make ``name`` the active delta, used by calls without ``delta_names`` (``None``: the plain base)."""
        if name is not None:
            self._cache.entry(name)
        self._active = name

    def delete_delta(self, name: str) -> None:
        """Unload a delta; the others stay usable. If it was active, no delta is chosen any more."""
        self._cache.remove(name)
        if self._active == name:
            self._active = _UNSET
        self._jacobi_gates.clear()

    # ------------------------------------------------------------------ routing
    def _route_names(self, delta_names: Optional[Sequence]) -> tuple:
        """``(names, every)``: the delta names a call routes by (one per row, or the active delta, if any, for
        every row), raising where the call names none clearly."""
        if delta_names is None:
            if self._active is _UNSET and len(self._cache) > 1:
                raise DeltaZipError(
                    f"{len(self._cache)} deltas are loaded ({self.deltas}) and none is active: pass delta_names=[...] "
                    "(one name per row, None for the base) or choose one with set_delta(name)"
                )
            return ([] if self.active_delta is None else [self.active_delta]), True
        if isinstance(delta_names, str):
            raise DeltaZipError("delta_names takes one name per batch row (a list), e.g. ['chat', None]")
        return list(delta_names), False

    @contextmanager
    def route(self, delta_names: Optional[Sequence], max_ids: Optional[Sequence[int]] = None):
        """Within this block every call through ``base_model`` uses ``delta_names`` (one per row, a single
        name for every row, or the active delta for ``None``). Holds the cache's lock, so the deltas stay
        where they are. With several names, a call whose batch has another number of rows raises
        :class:`DeltaZipError`. ``max_ids`` (with one name per row): per row, the largest token id its input
        may hold, where the caller knows it; a fine-tune's embedding then checks ids against its vocabulary
        without reading them back from the device (which waits for all the work queued before)."""
        check = None
        if delta_names is not None and not isinstance(delta_names, str) and len(delta_names) > 1:
            names = list(delta_names)
            check = self.base_model.register_forward_pre_hook(
                lambda module, args, kwargs: _check_rows(names, args, kwargs), with_kwargs=True)
        try:
            with self._route(delta_names, max_ids):
                yield
        finally:
            if check is not None:
                check.remove()

    @contextmanager
    def _route(self, delta_names: Optional[Sequence], max_ids: Optional[Sequence[int]] = None):
        """``route`` without the row check: ``generate`` repeats rows (beams, several sequences a prompt).

        A delta only on disk is read beside the block's first forward pass, each module waiting for its own
        tensors (:meth:`DeltaCache.acquire_overlapped`; ``cache.overlap_loads``), so a prompt's first layers
        compute while the file's last pieces are read."""
        cache = self._cache
        with cache.lock:
            names, every = self._route_names(delta_names)
            # (a name the cache does not know: slots_for raises naming it)
            if not (cache.overlap_loads and all(n is None or n in cache for n in names) and cache.cold_deltas(names)):
                with self.router.use(_routing(cache.slots_for(names), every, max_ids)):
                    yield
                return
            with cache.acquire_overlapped(names) as slots:
                with self.router.use(_routing(slots, every, max_ids)):
                    yield
            cache.release(names)  # the holds acquire_overlapped took (it releases them itself on failure)

    @contextmanager
    def route_static(self, device_rows: torch.Tensor):
        """Within this block every module reads each row's slot from ``device_rows`` (an int32 device
        tensor, -1 for the base) and takes no host-side decision: what a captured decode step runs."""
        with self.router.use(BatchRouting.static(device_rows)):
            yield

    def uses_kernels(self, device=None) -> bool:
        """Whether the delta modules run the Triton kernels on ``device`` (default: the model's)."""
        return self.kernel_policy.wants_kernels(self._placer.device if device is None else device)

    def graph_safe(self) -> bool:
        """Whether every delta module can run inside a captured decode step (kernel route, no host decisions)."""
        return self._placer.graph_safe()

    def set_activation_sparsity(self, thresholds, *, decode_only: bool = False, rank: Optional[int] = None,
                                kernels: Optional[bool] = None, strict: bool = True,
                                threshold_base_rows: Optional[int] = 1) -> int:
        """Zero each linear layer's small inputs (``|x| <= threshold``), for the base and every delta;
        ``None`` turns it off. Returns the number of layers thresholded.

        ``thresholds``: :class:`~.activation_sparsity.ActivationThresholds` (from
        :func:`~.activation_sparsity.calibrate_activation_thresholds`), a thresholds file or folder
        holding one target, or ``None``. ``decode_only``: decode steps only (Jacobi steps included);
        prompts run dense. Prefer it for generation: thresholding a prompt buys no speed (prompts take the
        ordinary route) and costs quality (BENCHMARKS.md section 8: +6.3 % NLL against +9.1 % on the later
        halves of documents at 40 %); the default thresholds every token, as a whole-sequence NLL
        measurement expects. ``rank``: the low-rank compensation of the dropped inputs through the base
        weights (``None``: the thresholds' own, 16 for new calibrations; 0: none). ``strict=False``: apply
        the thresholds that name a layer of this model and leave the other layers dense (default: refuse
        thresholds that do not cover exactly this model's layers).

        ``threshold_base_rows`` (default 1): decode steps (one token per row) of at most this many rows threshold
        the base's input as well as the deltas'; in a step of more rows the base weights multiply the whole
        input, exactly, and only each row's delta reads the thresholded one. Skipping columns saves bytes only
        where few rows share a weight: a delta serves one row or a few, but the base serves every row of the
        step, and at 2-8 rows their kept inputs together cover nearly every column, so the sparse base kernel
        is slower there than the dense matmul on the whole input (BENCHMARKS.md section 8). A row's output
        then depends on how many rows its step has: alone it is the thresholded model's, beside others its base
        part is exact (closer to the dense model). ``None``: threshold the base in every step (each row's output
        the thresholded model's whatever the batch); ``0``: never threshold the base, in any forward (deltas
        only; a teacher-forced pass then scores what steps of several rows compute). With ``1`` or more, prompts
        and other steps of several tokens per row threshold the base as they do the deltas (``decode_only``
        leaves them dense).

        ``kernels``: whether decode steps (one token per row, up to 16 rows) of the delta-carrying layers
        run the activation-sparse kernels, which read only the weight columns of kept inputs (the point:
        speed; the results are the same either way):

        * ``None`` (default): ``True`` when the model runs the Triton kernels (CUDA), else ``False``;
        * ``True``: the base's matmul and each row's delta. Every 2-, 4- or 8-bit delta's codes are then held
          a second time, input-major, on the device (4-bit deltas a quarter of the base layer's bytes each,
          2-bit an eighth; ``memory_footprint()`` and ``configure_cache(max_resident_bytes=...)`` count them:
          turning the route on evicts the least recently used deltas the budget no longer holds); a layer
          holding a 3-bit delta runs its
          deltas through the dense multi-delta kernel on the thresholded input (slower than dense);
        * ``False``: thresholding in PyTorch before the ordinary kernels (slower than dense: for quality
          measurements).

        With kernels on, each thresholded ``nn.Linear`` base weight is laid out input-major in place (a
        transposed view of a ``[K, N]`` tensor: the same values and memory; prompts take the dense
        matmul plus the delta kernel); turning sparsity off, or ``kernels=False``, lays it back out.

        Raises:
            DeltaZipError: ``kernels`` is not one of these, or ``True`` on a model that does not run the
                Triton kernels (``use_kernels="never"``, or the CPU without ``"always"``).
            CacheFullError: the input-major copies of the deltas in use (held by a running batch) do not fit
                ``max_resident_bytes``; the thresholds stay installed, the kernels off (decode steps then
                threshold in PyTorch, with the same results): raise the budget and call again.
        """
        from .activation_sparsity import install_activation_sparsity, resolve_activation_sparsity

        if kernels not in (None, True, False):
            raise DeltaZipError(f"kernels must be None, True or False, got {kernels!r}")
        if kernels is True and not self.uses_kernels():
            raise DeltaZipError(
                f"kernels={kernels!r} needs the Triton kernels, which this model does not run on "
                f"{self._placer.device} (use_kernels={self.kernel_policy.mode!r}): move it to a CUDA device, "
                "or leave kernels=None")
        n = install_activation_sparsity(self, resolve_activation_sparsity(self, thresholds), decode_only=decode_only,
                                        rank=rank, strict=strict, threshold_base_rows=threshold_base_rows)
        self.layout_version.bump()  # captured decode steps hold the old thresholds: capture again
        on = bool(n) and (self.uses_kernels() if kernels is None else kernels)
        self._placer.set_sparse_kernels(on)
        if on and self._cache.max_resident_bytes is not None:
            try:  # the input-major copies count against the byte budget: evict what it no longer holds
                self._cache.fit_budget()
            except CacheFullError as err:
                self._placer.set_sparse_kernels(False)
                raise CacheFullError(
                    f"the activation-sparse kernels keep each linear delta a second time, and the deltas in use do "
                    f"not fit max_resident_bytes={self._cache.max_resident_bytes} then ({err}): the thresholds are "
                    "installed with the kernels off; raise the budget with configure_cache() and call again, or pass "
                    "kernels=False") from err
        return n

    # ------------------------------------------------------------------ running
    def forward(self, *args, delta_names: Optional[Sequence] = None, **kwargs):
        _check_rows(delta_names, args, kwargs)
        with self._route(delta_names):  # the rows were checked above
            return self.base_model(*args, **kwargs)

    def generate(self, *args, delta_names: Optional[Sequence] = None, decoding: Optional[str] = None, **kwargs):
        """``generate`` with one delta per row (``None`` = base; omitted: the active delta); every generate option works.

        ``decoding="jacobi"`` (with ``jacobi_block_size=16``) decodes greedily by Jacobi iteration, several
        tokens per forward, same output (see :func:`hf_deltazip.decoding.jacobi_generate`). Its fallback
        gate is kept per delta (per row's delta, batch size, block size and ``min_accept``) from one call
        to the next: a delta whose outputs Jacobi steps do not speed up is decoded with one-token steps from
        the start of the next call, with an occasional probe. Pass ``gate=JacobiGate(...)`` to use your own
        (a fresh one forgets); :meth:`delete_delta` forgets them all."""
        _check_rows(delta_names, args, kwargs)
        if decoding not in (None, "jacobi"):
            raise DeltaZipError(f'decoding must be None (transformers generate) or "jacobi", got {decoding!r}')
        with self._route(delta_names):  # generate repeats rows for beams and samples: no row check inside
            if decoding == "jacobi":
                from ..decoding import jacobi_generate

                block = kwargs.pop("jacobi_block_size", 16)
                if "gate" not in kwargs:
                    kwargs["gate"] = self._jacobi_gate(delta_names, args, kwargs, block)
                return jacobi_generate(self.base_model, *args, block_size=block, **kwargs)
            return self.base_model.generate(*args, **kwargs)

    _JACOBI_GATES = 256  # gates remembered, at most (the oldest is forgotten first)

    def _jacobi_gate(self, delta_names, args, kwargs, block):
        from ..decoding import JacobiGate

        ids = args[0] if args else kwargs.get("input_ids")
        rows = tuple(delta_names) if delta_names is not None else ("<active>", self.active_delta)
        min_accept = kwargs.pop("min_accept", 1.5)
        key = (rows, int(ids.shape[0]) if torch.is_tensor(ids) and ids.dim() == 2 else None, block, min_accept)
        gate = self._jacobi_gates.pop(key, None) or JacobiGate(min_accept)
        self._jacobi_gates[key] = gate  # most recently used last
        while len(self._jacobi_gates) > self._JACOBI_GATES:
            self._jacobi_gates.pop(next(iter(self._jacobi_gates)))
        return gate

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    # ------------------------------------------------------------------ saving and merging
    def save_pretrained(self, save_directory: Union[str, os.PathLike], selected_deltas: Optional[Sequence[str]] = None,
                        **kwargs) -> Path:
        """Save loaded deltas as delta folders (never the base), as PEFT saves adapters.

        The delta named ``"default"`` goes into ``save_directory`` itself, every other one into
        ``save_directory/<name>``; :meth:`from_pretrained` and :meth:`load_delta` read them back. For a
        plain transformers model with a delta merged in, use ``merge_and_unload(name).save_pretrained(...)``.

        Args:
            save_directory: the folder to write.
            selected_deltas: names to save (default: every loaded delta).
            kwargs: ``num_threads`` for compressing in-memory deltas.

        Each file is written atomically: an interrupted save leaves earlier files whole.
        """
        if isinstance(selected_deltas, str):
            selected_deltas = [selected_deltas]
        names = list(self.deltas if selected_deltas is None else selected_deltas)
        if not names:
            raise DeltaZipError("no delta is loaded: there is nothing to save (the base is never saved by DeltaModel)"
                                if selected_deltas is None else
                                f"selected_deltas is empty: name one or more of the loaded deltas {self.deltas}")
        for n in names:
            self._cache.entry(n)
        root = Path(save_directory)
        if root.exists() and not root.is_dir():
            raise DeltaZipError(f"{root} is a file: pass a folder to save deltas into")
        targets = {n: root if n == "default" else root / _folder_name(n) for n in names}
        for n, target in targets.items():  # checked before anything is written
            for other in self.deltas:
                src = self._cache.entry(other).path
                if other != n and src is not None and Path(src).resolve() == target.resolve():
                    raise DeltaZipError(
                        f"{target} is the folder delta {other!r} is read from: saving {n!r} there would replace its "
                        "files under it; save into another folder (or delete_delta the other first)"
                    )
        for n, target in targets.items():
            self._save_one(n, target, **kwargs)
        return root

    def _save_one(self, name: str, folder: Path, num_threads: Optional[int] = None) -> None:
        with self._cache.lock:
            e = self._cache.entry(name)
            if e.path is not None:
                folder.mkdir(parents=True, exist_ok=True)
                src = Path(e.path)
                if src.resolve() != folder.resolve():
                    with staged_writes() as stage:  # every file copied in full before any replaces an old one
                        for f in sorted(src.iterdir()):
                            if f.is_file():
                                stage.copy(f, folder / f.name)
                return
            if e.config is None:
                raise DeltaZipError(
                    f"delta {name!r} was added as bare packed modules and has no DeltaZipConfig: add it with "
                    "add_delta(CompressedDelta(...)) to be able to save it"
                )
            if e.host is None and tp_size(self.base_model) > 1:
                raise TensorParallelError(
                    f"delta {name!r} was added from device tensors and each rank now holds only its shard of it: "
                    "save the CompressedDelta itself (delta.save_pretrained(...)), or add it with CPU tensors"
                )
            modules, params = e.host if e.host is not None else self._placer.gather(e.slot)
            modules, params = to_host(modules, params)
        CompressedDelta(config=e.config, modules=modules, params=params, header=e.header.to_dict()).save_pretrained(
            folder, num_threads=num_threads)

    def merge_and_unload(self, name: Optional[str] = None, *, inplace: bool = False) -> nn.Module:
        """A plain transformers model with delta ``name`` (default: the active one) merged in.

        With ``inplace=False`` (default) the base and the other deltas stay usable and a merged copy is
        returned; with ``inplace=True`` the base itself becomes the merged model and every delta is unloaded.

        On a bitsandbytes base (4-bit, 8-bit) the merged model is dequantized (plain ``nn.Linear`` layers in
        the compute dtype, no ``quantization_config``), with a warning: it is exactly the quantized base plus
        the delta. Load it with a ``quantization_config`` to quantize it again (that rounds the delta too).

        On a tensor-parallel base (``tp_plan``) every rank must call it: each rank merges its shard of each
        weight, the shards are gathered, and every rank gets the same plain, unsharded model (whole, in host
        memory or wherever the base's weights are). ``inplace=True`` is refused there.
        """
        if name is None:
            name = self.active_delta
        elif not isinstance(name, str):
            raise DeltaZipError(
                f"merge_and_unload merges one delta: pass its name as a str, got {type(name).__name__} {name!r} "
                "(to get several merged models, call it once per name)"
            )
        if name is None:
            raise DeltaZipError("merge_and_unload needs the name of a loaded delta (or an active one)")
        with self._cache.lock:
            slot = self._cache.slots_for([name])[0]
            header = self._cache.entry(name).header
            if tp_size(self.base_model) > 1:
                if inplace:
                    raise TensorParallelError(
                        "merge_and_unload(inplace=True) on a tensor-parallel base: the merged model is gathered "
                        "whole on every rank, it cannot replace the sharded base in place; call it with inplace=False"
                    )
                merged = self._placer.merged_model_gathered(slot, header)
            elif is_quantized_model(self.base_model):
                merged = self._merge_dequantized(slot, header, inplace)
            else:
                merged = self._placer.merged_model(slot, header, inplace)
            if inplace:
                self._cache.clear()
                self._active = _UNSET
            return merged

    def _merge_dequantized(self, slot: int, header: DeltaHeader, inplace: bool) -> nn.Module:
        """A bitsandbytes base merged into a dequantized model (the exact base + delta; PEFT would
        re-quantize and round the delta away)."""
        warn_merge_dequantizes()
        if inplace:
            dequantize_model(self.base_model)
            return self._placer.merged_model(slot, header, inplace=True)
        target = dequantize_model(copy.deepcopy(self.base_model))
        placer = DeltaPlacer(target, self.router, self.layout_version, self.kernel_policy)
        return placer.merged_model(slot, header, inplace=True)

    def memory_footprint(self) -> dict:
        """Bytes of the base and of each loaded delta, as they sit on their devices (on a tensor-parallel
        base: this rank's shards)."""
        seen = set()
        base = 0
        for p in list(self.base_model.parameters()) + list(self.base_model.buffers()):
            p = local_tensor(p)
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            base += p.numel() * p.element_size()
        per = {n: self._placer.nbytes_on_device(self._cache.slot_of(n)) for n in self._cache.resident}
        return {"base": base, "deltas": per, "total": base + sum(per.values()), "host": self._cache.host_bytes()}

    # ------------------------------------------------------------------ showing
    def _delta_rows(self) -> list:
        rows = []
        for n in self.deltas:
            e = self._cache.entry(n)
            cfg = e.config
            setting = "packed modules" if cfg is None else f"{cfg.bits}-bit" + ("" if not cfg.sparsity else f", {cfg.sparsity} sparse")
            rows.append({"name": n, "active": n == self.active_delta, "setting": setting,
                         "where": {Residency.DEVICE: "GPU" if self._placer.device.type == "cuda" else str(self._placer.device),
                                   Residency.HOST: "host", Residency.DISK: "disk"}[e.state],
                         "source": str(e.path) if e.path is not None else "in memory"})
        return rows

    def extra_repr(self) -> str:
        # print(model) then shows this line, then the patched base, whose delta layers list their deltas
        base = getattr(getattr(self.base_model, "config", None), "_name_or_path", None) or type(self.base_model).__name__
        deltas = ", ".join(f"{r['name']}{' (active)' if r['active'] else ''}: {r['setting']}, on {r['where']}"
                           for r in self._delta_rows())
        return f"base={base!r}, deltas=[{deltas}]"

    def _repr_html_(self) -> str:
        import html

        rows = self._delta_rows()
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(r[k]))}</td>" for k in ("name", "setting", "where", "source"))
            + f"<td>{'yes' if r['active'] else ''}</td></tr>" for r in rows
        )
        fp = self.memory_footprint()
        return (f"<p><b>DeltaModel</b> over {html.escape(type(self.base_model).__name__)} "
                f"({fp['base'] / 2**20:.1f} MiB base, {sum(fp['deltas'].values()) / 2**20:.1f} MiB deltas on the device)</p>"
                "<table><thead><tr><th>delta</th><th>setting</th><th>where</th><th>source</th><th>active</th></tr></thead>"
                f"<tbody>{body}</tbody></table>")


def check_delta_name(name) -> str:
    """A delta's name: a non-empty str (``None`` in ``delta_names`` means the plain base)."""
    if not isinstance(name, str) or not name:
        raise DeltaZipError(f"a delta name must be a non-empty str, got {name!r} (None in delta_names means the "
                            "plain base, so it cannot name a delta)")
    return name


def _folder_name(name: str) -> str:
    """``name`` as the sub-folder ``DeltaModel.save_pretrained`` writes it to: one path component."""
    if name in (".", "..") or "/" in name or "\\" in name:
        raise DeltaZipError(
            f"delta {name!r} cannot be saved under its name: a delta is saved into save_directory/<name>, and "
            "that must be one folder name (no '/', '\\', '.' or '..'); save it with "
            "model.merge_and_unload(name) or load it again under another name"
        )
    return name


def _routing(slots: list, every: bool, max_ids: Optional[Sequence[int]] = None) -> BatchRouting:
    """The routing of a call: one slot for every row (none: the base alone), or one slot per row (with each
    row's largest token id, where known)."""
    if every:
        return BatchRouting.base() if not slots else BatchRouting.every_row(slots[0])
    return BatchRouting.per_row(slots, max_ids)


def _check_rows(delta_names, args, kwargs):
    if delta_names is None or isinstance(delta_names, str):
        return
    ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
    for key in ("inputs", "inputs_embeds"):  # generate's first parameter by keyword; embeddings
        if ids is None:
            ids = kwargs.get(key)
    if torch.is_tensor(ids) and ids.dim() >= 2 and ids.shape[0] != len(delta_names):
        raise DeltaZipError(f"{len(delta_names)} delta names for a batch of {ids.shape[0]} rows: pass one name per row")
