"""The delta cache: which loaded deltas sit on the device, in host memory or only on disk.

Every delta a :class:`~hf_deltazip.DeltaModel` knows has a :class:`CacheEntry` in its
:class:`DeltaCache` (``model.cache``). An entry is in one of three residency states:

=============  ==============================================================================
``DISK``       registered (header and base checked); its tensors are read from its delta folder
               (or the Hub cache) when a batch needs it. In-memory deltas never are in this state.
``HOST``       a copy of its tensors sits in host memory (pinned when CUDA is available): from
               a prefetch, an eviction under a host budget, or an in-memory delta not yet used.
``DEVICE``     placed in the model's modules under a *slot*: batches can use it now.
=============  ==============================================================================

Moves: a batch naming a delta makes it ``DEVICE`` (:meth:`DeltaCache.acquire` /
:meth:`DeltaCache.slots_for`), evicting the least recently used ``DEVICE`` deltas that the batch
does not need and nobody holds when the resident budget (:meth:`DeltaCache.configure`) is full;
an evicted delta drops to ``HOST`` if the host budget keeps a copy (or it has no file), else to
``DISK``; :meth:`DeltaCache.prefetch` brings ``DISK`` deltas to ``HOST`` on a background thread and,
where free kernel-stack room allows, on to ``DEVICE`` on a CUDA side stream.

*Holds*: :meth:`acquire` marks deltas as used by running requests; a held delta is never evicted
or removed until :meth:`release`. :meth:`fits` says whether some deltas could be ``DEVICE``
together with the held ones, without loading anything.

The cache's :attr:`~DeltaCache.lock` guards every change; hold it to keep residency fixed across
several calls (e.g. a check and the forward pass that relies on it).
"""

from __future__ import annotations

import enum
import itertools
import threading
from contextlib import contextmanager, nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..delta import PackedModule, read_packed
from ..errors import DeltaNotFoundError, DeltaZipError
from ..format import DZ_FILENAME, DeltaHeader, DeltaZipFile
from .layers import DeltaModule, map_packed
from .placement import DeltaPlacer, delta_nbytes

__all__ = ["DeltaCache", "CacheEntry", "Residency", "CacheFullError", "DeltaInUseError"]


class CacheFullError(DeltaZipError):
    """The deltas a batch needs do not fit the resident budget next to the deltas in use."""


class DeltaInUseError(DeltaZipError):
    """The delta is held by running requests (it cannot be removed now)."""


class Residency(str, enum.Enum):
    """Where a delta's tensors are (see the module docstring)."""

    DISK = "disk"
    HOST = "host"
    DEVICE = "device"


@dataclass
class CacheEntry:
    """One delta the cache knows.

    Attributes:
        name: the name batches use.
        path: the delta folder its tensors are read from, or ``None`` for an in-memory delta.
        config: its :class:`~hf_deltazip.DeltaZipConfig` (``None`` for bare packed modules).
        header: the typed ``.dz`` header (base, fingerprint, extra facts such as tied embeddings).
        host: ``(modules, params)`` in host memory, or ``None``.
        slot: its slot while ``DEVICE``, else ``None``.
        nbytes: bytes of its tensors as held (known once read).
        holds: running requests using it.
    """

    name: str
    path: Optional[Path]
    config: Any
    header: DeltaHeader
    host: Optional[tuple] = None
    slot: Optional[int] = None
    nbytes: Optional[int] = None
    holds: int = 0
    last_used: int = 0
    validated: bool = False
    num_threads: Optional[int] = None
    host_is_only_copy: bool = False  # an in-memory delta's host copy: never trimmed
    prefetched: bool = False  # host copy made by a prefetch and not used yet: outside the host budget
    ready: Any = field(default=None, repr=False)  # CUDA event: side-stream copies done
    staging: Any = field(default=None, repr=False)  # a staging still writing it (DeltaCache.stage(defer=True))
    content_id: Optional[str] = None  # its .dz file's content id when registered: another delta saved there is refused

    @property
    def state(self) -> Residency:
        if self.slot is not None:
            return Residency.DEVICE
        return Residency.HOST if self.host is not None else Residency.DISK


class _LoadFailed(Exception):
    """Raised in a forward pass that waited for an overlapped load that failed (its error is raised after)."""


class _OverlappedLoad:
    """A load of :meth:`DeltaCache.acquire_overlapped` into ``slot`` and what the forward pass waits for: one event
    per module of the delta, and one (``None``) for its exactly stored parameters."""

    def __init__(self, slot: int):
        self.slot = slot
        self.events: dict = {}
        self.handles: dict = {}  # module -> its waiting pre-hook, removed once passed
        self.result, self.error, self.thread, self.finalize = None, None, None, None

    def placed(self, names) -> None:
        for n in names if names is not None else [None]:
            ev = self.events.get(n)
            if ev is not None:
                ev.set()

    def fail(self, err: BaseException) -> None:
        self.error = err

    def finish(self) -> None:
        for ev in self.events.values():
            ev.set()

    def wait_in(self, module, key) -> None:
        """Make ``module``'s forward wait for ``key`` (a module's name, ``None`` for the parameters) to be placed.
        The hook removes itself once passed (later passes, a whole ``generate``, run without it); PyTorch runs the
        hooks from a copy of its list, so that is safe from inside the hook."""
        event = self.events.setdefault(key, threading.Event())

        def wait(mod, args):
            event.wait()
            if self.error is not None:
                raise _LoadFailed()
            self.handles.pop(mod).remove()

        self.handles[module] = module.register_forward_pre_hook(wait)

    def unhook(self) -> None:
        for h in self.handles.values():
            h.remove()
        self.handles.clear()


class _Staging:
    """A delta being written into its slot a piece at a time (:meth:`DeltaCache.stage` with ``defer``): the
    placer's :meth:`~DeltaPlacer.attach_steps` generator and the side stream its copies run on."""

    def __init__(self, steps, side, pieces: int):
        self.steps, self.side, self.left = steps, side, pieces  # left: pieces still to write


class DeltaCache:
    """Residency of a model's deltas: budgets, LRU eviction, holds, a host tier and prefetching.

    Made by :class:`~hf_deltazip.DeltaModel`; reach it as ``model.cache``.
    """

    def __init__(self, placer: DeltaPlacer):
        self.placer = placer
        self.lock = threading.RLock()
        self._entries: dict[str, CacheEntry] = {}
        self._clock = itertools.count(1)
        self.max_resident: Optional[int] = None
        self.max_resident_bytes: Optional[int] = None
        self.max_host_bytes: int = 0
        self._prefetcher: Optional[ThreadPoolExecutor] = None
        self._side_stream = None
        #: read a delta that is only on disk a piece at a time, placing each piece while the next is read
        #: (the default: pieces read front to back, checks and uploads beside them; on six H200 machines
        #: an 8B-shaped delta's first token came 0.1-0.5 s sooner than with ``False``, which reads the
        #: whole file with every decompression thread, then places it; BENCHMARKS.md section 4, "Cold start")
        self.pipeline_loads: bool = True
        #: decoded bytes per piece of a pipelined load
        self.pipeline_piece_bytes: int = 16 << 20
        #: pieces a pipelined load reads ahead of the one being placed (``pipeline_readers`` if that is more)
        self.pipeline_ahead: int = 4
        #: threads reading pieces of a pipelined load at once, each piece front to back (four readers of
        #: 16 MB pieces, with the prefill beside the read: the first token of a cold 8B-shaped 2-bit delta
        #: 0.985 s after the request, 1.05x the disk's plain read, medians of five on one H200;
        #: BENCHMARKS.md section 4)
        self.pipeline_readers: int = 4
        #: read a cold delta's file past the page cache (``O_DIRECT``, Linux), ``pipeline_readers`` reads of
        #: 4 MB in flight: ``True``: always; ``"auto"``: when most of the file is not in the page cache (a
        #: file just downloaded or written is still read from memory); ``False`` (the default): never. Where
        #: the file system refuses direct reads the file is read through the page cache. Off by default:
        #: on five H200 machines the direct load of a cold 8B-shaped delta came 0.1-0.8 s later than the
        #: page cache's (BENCHMARKS.md section 4, "Cold start").
        self.pipeline_direct_io = False
        #: :meth:`acquire_overlapped` (the serving engine's prefill) reads a cold delta on a background
        #: thread while the forward pass runs, each module waiting for its own tensors
        self.overlap_loads: bool = True
        self._staging_ready = False
        #: overlapped loads in flight (:meth:`acquire_overlapped`): name -> its load
        self._inflight: dict = {}
        #: stagings still writing their delta (``stage(defer=True)``), in the order they began: name -> None
        self._pending: dict = {}
        #: decode a delta read from disk into page-locked host memory (CUDA only), so its uploads run
        #: asynchronously; ``False``: into pageable memory (no pinning cost on the read; each upload then
        #: waits for its copy). A prefetched host copy is pinned either way.
        self.pinned_loads: bool = True

    # ------------------------------------------------------------------ looking
    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list:
        """Every delta the cache knows, in the order they were added."""
        return list(self._entries)

    def entry(self, name: str) -> CacheEntry:
        """The entry of delta ``name`` (read it, do not change it)."""
        try:
            return self._entries[name]
        except KeyError:
            raise DeltaNotFoundError(
                f"no delta named {name!r} is loaded; loaded: {self.names}. Use load_delta() first"
            ) from None

    def state(self, name: str) -> Residency:
        return self.entry(name).state

    @property
    def resident(self) -> list:
        """Names of the deltas on the device now."""
        return [n for n, e in self._entries.items() if e.slot is not None]

    @property
    def held(self) -> dict:
        """``{name: holds}`` of the deltas running requests use (never evicted while held)."""
        return {n: e.holds for n, e in self._entries.items() if e.holds}

    def slot_of(self, name: str) -> Optional[int]:
        """Slot of a resident delta (``None`` if it is not on the device)."""
        return self.entry(name).slot

    def name_of_slot(self, slot: int) -> Optional[str]:
        for n, e in self._entries.items():
            if e.slot == slot:
                return n
        return None

    def resident_bytes(self) -> int:
        """Device bytes of the resident deltas as the byte budget counts them: each delta's packed tensors, and
        the input-major copies the activation-sparse kernels keep of its linear deltas."""
        copies = self.placer.sparse_copy_nbytes()
        return sum(_budget_nbytes(e, copies) for e in self._entries.values() if e.slot is not None)

    def host_bytes(self) -> dict:
        return {n: delta_nbytes(*e.host) for n, e in self._entries.items() if e.host is not None}

    # ------------------------------------------------------------------ budgets
    def configure(self, *, max_resident: Optional[int] = None, max_resident_bytes: Optional[int] = None,
                  max_host_bytes: int = 0) -> None:
        """Set the budgets (see :meth:`hf_deltazip.DeltaModel.configure_cache`) and apply them now."""
        for value, what in ((max_resident, "max_resident"), (max_resident_bytes, "max_resident_bytes")):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise DeltaZipError(f"{what} must be a positive integer or None, got {value!r}")
        if not isinstance(max_host_bytes, int) or max_host_bytes < 0:
            raise DeltaZipError(f"max_host_bytes must be a non-negative integer, got {max_host_bytes!r}")
        with self.lock:
            self.max_resident, self.max_resident_bytes, self.max_host_bytes = max_resident, max_resident_bytes, max_host_bytes
            self.placer.policy.capacity = max_resident  # kernel stacks get room for this many deltas
            self._trim_host(keep=())
            self._make_room(needed=(), incoming=0)

    def fit_budget(self) -> None:
        """Evict least recently used deltas not in use until the resident ones fit the budgets (after what a
        delta holds grew: the activation-sparse route's copies). Raises :class:`CacheFullError` when the
        deltas in use alone do not fit."""
        with self.lock:
            self._make_room(needed=(), incoming=0)

    def fits(self, names: Sequence) -> bool:
        """Whether the deltas ``names`` could all be on the device next to the held ones (loads nothing)."""
        with self.lock:
            wanted = {n for n in names if n is not None}
            keep = wanted | {n for n, e in self._entries.items() if e.holds}
            if self.max_resident is not None and len(keep) > self.max_resident:
                return False
            if self.max_resident_bytes is not None:
                copies = self.placer.sparse_copy_nbytes()

                def size(n):
                    e = self._entries.get(n)
                    if e is None:
                        return 0
                    if e.nbytes is not None and e.slot is not None:
                        return _budget_nbytes(e, copies)
                    if e.host is not None:
                        return delta_nbytes(*e.host) + self.placer.sparse_copy_estimate(e.host[0])
                    return e.nbytes or 0

                if sum(size(n) for n in keep) > self.max_resident_bytes:
                    return False
            return True

    # ------------------------------------------------------------------ adding and removing
    def add(self, entry: CacheEntry, *, resident: bool = True) -> None:
        """Register a delta; with ``resident``, put it on the device now (forgotten again on failure)."""
        with self.lock:
            if entry.name in self._entries:
                raise DeltaZipError(
                    f"a delta named {entry.name!r} is already loaded: delete_delta({entry.name!r}) first or pick another name"
                )
            entry.last_used = next(self._clock)
            self._entries[entry.name] = entry
            if not resident and entry.path is not None:
                self._prepare_staging()
            if resident:
                try:
                    self.ensure_resident([entry.name])
                except BaseException:
                    del self._entries[entry.name]
                    raise

    def remove(self, name: str) -> None:
        """Forget a delta (taken off the device for good). Raises :class:`DeltaInUseError` while held."""
        with self.lock:
            e = self.entry(name)
            if e.holds:
                raise DeltaInUseError(f"delta {name!r} is in use by running requests; delete it once they finish")
            self._drop_staging(e)
            if e.slot is not None:
                self.placer.detach(e.slot, keep_room=False)
            del self._entries[name]

    def clear(self) -> None:
        """Forget every delta without touching the modules (after they were merged away)."""
        with self.lock:
            for e in self._entries.values():
                self._drop_staging(e)
            self._entries.clear()

    # ------------------------------------------------------------------ using
    def acquire(self, names: Sequence) -> list:
        """Make ``names`` resident and hold them for running requests; returns one slot per name (-1 for ``None``).

        Raises:
            DeltaNotFoundError: a name is not loaded.
            CacheFullError: they do not fit the resident budget next to the held deltas.
        """
        with self.lock:
            slots = self.slots_for(names)
            for n in names:
                if n is not None:
                    self._entries[n].holds += 1
            return slots

    def release(self, names: Sequence) -> None:
        """Undo :meth:`acquire` for ``names`` (the deltas may be evicted again once nobody holds them)."""
        with self.lock:
            for n in names:
                e = self._entries.get(n) if n is not None else None
                if e is not None and e.holds:
                    e.holds -= 1

    def slots_for(self, names: Sequence) -> list:
        """One slot per name (-1 for ``None``), loading the deltas onto the device as needed."""
        needed = [n for n in names if n is not None]
        with self.lock:
            for n in needed:
                self.entry(n)
            self.ensure_resident(needed)
            return [-1 if n is None else self._entries[n].slot for n in names]

    def ensure_resident(self, names: Sequence) -> None:
        """Put the deltas ``names`` on the device (evicting others as the budget requires)."""
        with self.lock:
            needed = list(dict.fromkeys(names))
            self._check_count(needed)
            for n in needed:
                e = self.entry(n)
                e.last_used = next(self._clock)
                if n in self._inflight:  # read beside a forward pass further up this thread: let it end first
                    self._end_overlapped(n)
                if e.slot is not None:
                    self._wait_ready(e)
                    continue
                if e.host is None and self.pipeline_loads and e.path is not None:
                    modules, params, nbytes, slot = self._load_pipelined(e, needed)
                else:
                    modules, params = e.host if e.host is not None else self._read(e)
                    nbytes = delta_nbytes(modules, params)
                    self._make_room(needed=needed, incoming=nbytes + self.placer.sparse_copy_estimate(modules))
                    slot = self._free_slot()
                    try:
                        self.placer.attach(slot, modules, params, e.header, name=n)
                    except BaseException:
                        self.placer.detach(slot)
                        raise
                self._placed(e, modules, params, nbytes, slot, needed)

    def _check_count(self, needed: list) -> None:
        if self.max_resident is not None and len(needed) > self.max_resident:
            raise CacheFullError(
                f"this batch needs {len(needed)} deltas but at most {self.max_resident} may be resident: "
                "raise max_resident with configure_cache() or split the batch"
            )

    def cold_deltas(self, names: Sequence) -> list:
        """The known deltas of ``names`` that a pipelined load would read from disk (no copy on the device or in
        host memory, no load of them in flight), in order, once each."""
        if not self.pipeline_loads:
            return []
        out = []
        for n in dict.fromkeys(n for n in names if n is not None):
            e = self._entries.get(n)
            if e is not None and e.slot is None and e.host is None and e.path is not None and n not in self._inflight:
                out.append(n)
        return out

    def _placed(self, e: CacheEntry, modules, params, nbytes: int, slot: int, needed) -> None:
        """Record that ``e`` is now resident in ``slot``."""
        e.slot, e.nbytes = slot, nbytes
        if e.host_is_only_copy and _on_device(modules, params):
            e.host, e.host_is_only_copy = None, False  # given on the device: the stack holds it now
        if e.host is None and self.max_host_bytes and e.path is not None:
            e.host = to_host(modules, params)
        e.prefetched = False
        self._trim_host(keep=needed)

    @contextmanager
    def acquire_overlapped(self, names: Sequence):
        """:meth:`acquire` for one forward pass that may begin before a delta read from disk is all in.

        Yields one slot per name, the deltas held as after :meth:`acquire` (``release`` them when done; if the
        block or the load fails, they are released here).
        The first delta of ``names`` that is only on disk is read and placed a piece at a time on a
        background thread (a pipelined load) while the block runs; each module that delta changes waits
        for its own tensors before it computes, so a prefill's first layers compute while the file's last
        pieces are read. Leaving the block waits for the load to end; if the load failed (a corrupt file,
        another base), what it placed is taken out and its error raised. Without such a delta, or where
        the delta would be the first to change a module (wrapping a module is not done under a running
        forward), or with :attr:`overlap_loads` off, this is :meth:`acquire` with nothing in the
        background.
        """
        with self.lock:
            needed = list(dict.fromkeys(n for n in names if n is not None))
            for n in needed:
                self.entry(n)
            cold = self.cold_deltas(needed) if self.overlap_loads else []
            plan = self._overlap_plan(self._entries[cold[0]]) if cold else None
            if plan is None:
                slots = self.acquire(names)
                try:
                    yield slots
                except BaseException:
                    self.release(names)
                    raise
                return
            e, waits, total = plan
            self._check_count(needed)
            self.ensure_resident([n for n in needed if n != e.name])
            for n in needed:  # recency in the order of names, as ensure_resident stamps it
                self._entries[n].last_used = next(self._clock)
            self._make_room(needed=needed, incoming=total)
            slot = self._free_slot()
            load = _OverlappedLoad(slot)
            stream = torch.cuda.current_stream(self.placer.device) if self.placer.device.type == "cuda" else None

            def run():
                try:  # the copies go onto the forward's stream, ahead of the work that waits for them
                    with torch.cuda.stream(stream) if stream is not None else nullcontext():
                        load.result = self._load_pipelined(e, needed, slot=slot, placed=load.placed)
                except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                    load.fail(err)
                finally:
                    load.finish()

            for w, key in waits.items():
                load.wait_in(w, key)
            load.thread = threading.Thread(target=run, name="deltazip-overlap", daemon=True)
            load.finalize = lambda: self._placed(e, *load.result[:3], slot, needed)
            for n in names:
                if n is not None:
                    self._entries[n].holds += 1
            self._inflight[e.name] = load
            load.thread.start()
            failed = False
            try:
                yield [-1 if n is None else (slot if n == e.name else self._entries[n].slot) for n in names]
            except _LoadFailed:
                failed = True  # the load's own error is raised below
            except BaseException:
                failed = True
                raise
            finally:
                load.unhook()
                if e.name in self._inflight:  # (a call nested in the block may have ended it already)
                    try:
                        self._end_overlapped(e.name)
                    except BaseException:  # noqa: BLE001 - raised below
                        pass
                if failed or load.error is not None:
                    self.release(names)
            if load.error is not None:
                raise load.error

    def _end_overlapped(self, name: str) -> None:
        """Wait for the overlapped load of ``name`` and record it as resident; raise its error if it failed."""
        load = self._inflight[name]
        load.thread.join()
        del self._inflight[name]
        if load.error is not None:
            raise load.error
        load.finalize()  # resident, whatever became of the pass

    def _overlap_plan(self, e: CacheEntry):
        """``(entry, {wrapper: what it waits for}, bytes it will hold)`` for an overlapped load of ``e``, or ``None``
        where some module it changes has no wrapper yet."""
        with DeltaZipFile(Path(e.path) / DZ_FILENAME) as dz:
            _check_same_delta(e, dz)
            total = sum(rec.nbytes for rec in dz.tensors.values()) + self.placer.sparse_copy_estimate(dz.modules)
            kinds = {m: rec.kind for m, rec in dz.modules.items()}
            owners = {p.rpartition(".")[0] for p in dz.params}
        model = self.placer.base_model
        waits = {}

        def wrapper(name):
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                return None
            return mod if isinstance(mod, DeltaModule) else None

        for m in kinds:
            w = wrapper(m)
            if w is None:
                return None
            waits[w] = m
        special = self.placer.special_names()
        if e.header.tied_embeddings and special.get("input") in kinds and special.get("output") not in kinds:
            head = wrapper(special.get("output")) if special.get("output") else None
            if head is not None:
                waits[head] = special["input"]  # the tied head computes with the input embedding's delta
        for o in owners:  # exactly stored parameters are placed last
            w = wrapper(o)
            if w is None:
                return None
            waits[w] = None
        return e, waits, total

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, names: Sequence, *, to_device: bool = True) -> Future:
        """Read and decompress deltas into host memory on a background thread; returns a Future.

        With ``to_device`` (and kernels on a CUDA device), each is then copied into free kernel-stack
        room on a side stream, overlapping the work on the main stream; the first batch naming it
        waits for the copies. A prefetch never evicts: a delta that does not fit stays in host memory.
        """
        names = [n for n in names if n is not None]
        for n in names:
            self.entry(n)
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltazip-prefetch")

        def work():
            for n in names:
                with self.lock:
                    e = self._entries.get(n)
                    if e is None or e.host is not None or e.slot is not None:
                        continue
                modules, params = self._read(e)  # disk and decompression: outside the lock
                host = to_host(modules, params)
                with self.lock:
                    if self._entries.get(n) is e and e.host is None:
                        e.host, e.prefetched = host, True
                    if to_device:
                        self._upload_ahead(e)
            return names

        return self._prefetcher.submit(work)

    def stage(self, names: Sequence, *, keep: Sequence = (), defer: bool = False) -> list:
        """Start putting the host-tier deltas of ``names`` (most urgent first) on the device ahead of use,
        evicting least recently used deltas to make room: never a held one, one of ``keep`` or one of
        ``names``. On CUDA the copies run on a side stream while the main stream keeps working;
        :meth:`is_ready` tells when a staged delta's copies are done (a batch that uses it earlier waits
        for them on the device). Deltas only on disk, or already on the device, are left as they are
        (:meth:`prefetch` reads the former); staging stops at the first delta that cannot be made room
        for (nothing is evicted for it). A delta the kernel stacks or per-slot tables cannot take ahead of use
        (a layout they keep no room for, added tokens) is placed at its admission instead; staging it has then
        freed the room that admission needs (an idle delta evicted a little earlier than it would have been),
        and later rounds evict nothing more for it while that room stays free. Returns the names whose copies
        began now.

        With ``defer``, only the room is made now (slot taken, victims evicted): the delta's modules are written
        a few at a time by later :meth:`advance_staging` calls, which a serving loop makes while the device
        computes a step, so the host work of staging stays off its critical path. A deferred delta counts as
        resident but is not ready (:meth:`is_ready`) until its last module is written; whatever needs it first
        (a batch, a merge) writes the rest at once. Evicting it before then takes its written part out again.
        """
        started = []
        with self.lock:
            if not self.placer.uses_kernels():
                return started
            protect = {n for n in (*keep, *names) if n is not None}
            for n in dict.fromkeys(x for x in names if x is not None):
                e = self._entries.get(n)
                if e is None or e.slot is not None or e.host is None or n in self._inflight:
                    continue
                modules, params = e.host
                try:
                    self._make_room(needed=protect,
                                    incoming=delta_nbytes(modules, params) + self.placer.sparse_copy_estimate(modules))
                except CacheFullError:
                    break
                if not self._upload_ahead(e, defer=defer):
                    break
                e.last_used = next(self._clock)
                started.append(n)
        return started

    def is_ready(self, name: str) -> bool:
        """Whether delta ``name`` is on the device with its copies done (a staged or prefetched delta whose
        side-stream copies are still running is not yet)."""
        with self.lock:
            e = self.entry(name)
            return e.slot is not None and e.staging is None and (e.ready is None or e.ready.query())

    @property
    def staging_pending(self) -> list:
        """Deltas staged with ``defer`` whose modules are not all written yet, oldest first."""
        return list(self._pending)

    def advance_staging(self, steps: int = 1, more: Optional[Callable[[], bool]] = None) -> int:
        """Write ``steps`` more pieces (a module, or an exactly stored parameter, each) of the deferred stagings,
        oldest first, then more while ``more()`` returns true (a serving loop passes "the device is still
        computing the step just launched"). Returns how many stagings are still pending."""
        with self.lock:
            done = 0
            for n in list(self._pending):
                e = self._entries[n]
                done += self._run_staging(e, steps - done, more)[0]
                if e.staging is not None:  # out of budget
                    break
            return len(self._pending)

    def finish_staging(self, names: Optional[Sequence] = None) -> None:
        """Write the remaining pieces of the deferred stagings of ``names`` (default: all) now."""
        with self.lock:
            for n in list(self._pending) if names is None else [n for n in dict.fromkeys(names) if n in self._pending]:
                self._run_staging(self._entries[n])

    def _upload_ahead(self, e: CacheEntry, defer: bool = False) -> bool:
        """Put a host-tier delta on the device ahead of use, into free room only (caller holds the lock);
        returns whether it did (with ``defer``: took its slot, see :meth:`stage`).

        On CUDA the copies run on a side stream (device memory is taken on the main stream, so the
        caching allocator never hands a block in use by a running step to the side stream).
        """
        if e.slot is not None or e.host is None or not self.placer.uses_kernels():
            return False
        modules, params = e.host
        slot = self._free_slot()
        nbytes = delta_nbytes(modules, params)
        if self.max_resident is not None and len(self.resident) + 1 > self.max_resident:
            return False
        if self.max_resident_bytes is not None and \
                self.resident_bytes() + nbytes + self.placer.sparse_copy_estimate(modules) > self.max_resident_bytes:
            return False
        if not self.placer.can_attach_in_room(slot, modules, params, e.header):
            return False
        device = self.placer.device
        side = None
        if device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
        e.staging = _Staging(self.placer.attach_steps(slot, modules, params, e.header, name=e.name, side=side), side,
                             pieces=len(modules) + len(params))
        e.slot, e.nbytes, e.prefetched, e.ready = slot, nbytes, False, None
        self._pending[e.name] = None
        if not defer:
            self._run_staging(e)
        return True

    def _run_staging(self, e: CacheEntry, steps: Optional[int] = None, more=None) -> tuple:
        """Write pieces of ``e``'s staging (caller holds the lock): all of them (``steps`` None), or ``steps``
        then more while ``more()``. Returns ``(pieces written, finished)``. A failure takes the part written out
        again (the delta stays where it was before the staging) and raises."""
        job = e.staging
        if job.side is not None:  # after what the main stream was given so far (its memory, evicted slots)
            job.side.wait_stream(torch.cuda.current_stream(self.placer.device))
        done = 0
        try:
            while job.left and (steps is None or done < steps or (more is not None and more())):
                next(job.steps)
                done += 1
                job.left -= 1
            if not job.left:
                self._staged(e)
                return done, True
        except BaseException:
            self._drop_staging(e)
            self.placer.detach(e.slot)
            e.slot = None
            raise
        return done, False

    def _staged(self, e: CacheEntry) -> None:
        """A staging wrote its last piece: the delta is ready once its copies are done."""
        job, e.staging = e.staging, None
        job.steps.close()  # every piece is written: only the generator's end is left
        self._pending.pop(e.name, None)
        if job.side is not None:
            e.ready = torch.cuda.Event()
            e.ready.record(job.side)
        # an in-memory delta keeps its host copy (evicting it again copies nothing back); otherwise the copy goes
        # unless the host tier keeps it (pinned blocks stay alive until the upload is done: caching host allocator)
        if not e.host_is_only_copy and (not self.max_host_bytes or e.path is None):
            e.host = None
        self._trim_host(keep=())

    def _drop_staging(self, e: CacheEntry) -> None:
        """Stop ``e``'s staging where it is (its written part stays in the slot until detached)."""
        if e.staging is not None:
            e.staging.steps.close()
            e.staging = None
            self._pending.pop(e.name, None)

    def shutdown(self) -> None:
        """Stop the prefetch thread (after the work queued so far)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None

    # ------------------------------------------------------------------ internals
    def _wait_ready(self, e: CacheEntry) -> None:
        if e.staging is not None:  # deferred: the rest of it now
            self._run_staging(e)
        ready, e.ready = e.ready, None
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)

    def _prepare_staging(self) -> None:
        """Page-lock the host blocks a pipelined load reads into, once, ahead of the first cold load: they are
        handed back to PyTorch's caching host allocator, which gives them to each piece (and to each later
        load) again, so a cold start does not pay for pinning memory on its critical path."""
        if self._staging_ready or not (self.pipeline_loads and self._pin_loads()):
            return
        blocks = [torch.empty(self.pipeline_piece_bytes, dtype=torch.uint8, pin_memory=True)
                  for _ in range(max(self.pipeline_ahead, self.pipeline_readers) + 2)]  # read or queued, and placed
        del blocks
        self._staging_ready = True

    def _pin_loads(self) -> bool:
        return self.placer.device.type == "cuda" and self.pinned_loads

    def _read(self, e: CacheEntry):
        if e.path is None:
            raise DeltaZipError(f"delta {e.name!r} has no file and no host copy: load it again")
        folder = Path(e.path)
        with DeltaZipFile(folder / DZ_FILENAME) as dz:
            _check_same_delta(e, dz)
            pin = self._pin_loads()  # page-locked: uploads go asynchronously
            # a tqdm bar on a terminal; otherwise one read of the whole file in file order
            modules, params = read_packed(dz, num_threads=e.num_threads, pin_memory=pin, desc=f"loading {e.name}")
        if not e.validated:
            self.placer.validate(modules, params, e.header, folder)
            e.validated = True
        return modules, params

    def _load_pipelined(self, e: CacheEntry, needed, slot: Optional[int] = None, placed=None) -> tuple:
        """Read a delta from its file and place it a piece at a time while the rest is still being read
        (:meth:`DeltaZipFile.stream_tensors`: one thread reads the file sequentially, as a plain read
        would, a pool decodes and checks each piece, and each module is placed as soon as its tensors are
        in), so the file's read overlaps the checks and the uploads instead of preceding them. Returns
        ``(modules, params, nbytes, slot)``.

        Pieces are about :attr:`pipeline_piece_bytes` of decoded tensors in file order; the exactly stored
        parameters are placed last. Each module is checked against the base before it is placed; a failure
        takes the partly placed delta out again. ``slot``: room already made and this slot chosen (an
        overlapped load); ``placed(names)`` is called after each group of modules is placed (``None`` for
        the parameters).
        """
        folder = Path(e.path)
        pin = self._pin_loads()
        with DeltaZipFile(folder / DZ_FILENAME) as dz:
            _check_same_delta(e, dz)
            total = sum(rec.nbytes for rec in dz.tensors.values())
            if slot is None:
                self._make_room(needed=needed, incoming=total + self.placer.sparse_copy_estimate(dz.modules))
                slot = self._free_slot()
            owners: dict = {}  # tensor -> the modules it belongs to
            for mname, rec in dz.modules.items():
                for t in set(rec.tensors.values()):
                    owners.setdefault(t, []).append(mname)
            missing = {m: len(set(rec.tensors.values())) for m, rec in dz.modules.items()}
            uses = {t: len(ms) for t, ms in owners.items()}
            # host copies are kept only for the host tier; otherwise each piece's (pinned) block is let go once
            # its modules are placed, so the next pieces reuse it instead of page-locking new memory
            keep = bool(self.max_host_bytes)
            got, modules, embeddings, nbytes = {}, {}, {}, 0
            # a tqdm bar in decoded bytes on a terminal, as a whole-file read shows
            bar = tqdm(total=total, desc=f"loading {e.name}", unit="B", unit_scale=True, disable=None, leave=False)
            try:
                for piece in dz.stream_tensors(piece_bytes=self.pipeline_piece_bytes, num_threads=e.num_threads,
                                               pin_memory=pin, ahead=self.pipeline_ahead, readers=self.pipeline_readers,
                                               direct_io=self.pipeline_direct_io):
                    bar.update(sum(dz.tensors[t].nbytes for t in piece))
                    got.update(piece)
                    arrived = list(piece)
                    del piece
                    ready = {}
                    for t in arrived:
                        for m in owners.get(t, ()):
                            missing[m] -= 1
                            if not missing[m]:
                                ready[m] = PackedModule.from_record(
                                    dz.modules[m], {role: got[name] for role, name in dz.modules[m].tensors.items()})
                    for m in ready:
                        for t in set(dz.modules[m].tensors.values()):
                            uses[t] -= 1
                            if not uses[t]:
                                del got[t]
                    if not ready:
                        continue
                    nbytes += delta_nbytes(ready, {})
                    if not e.validated:  # kept for the parameters' check only
                        embeddings.update({m: p for m, p in ready.items() if p.kind == "embedding"})
                    if keep:
                        modules.update(ready)
                    if not e.validated:
                        self.placer.validate(ready, {}, e.header, folder)
                    self.placer.attach(slot, ready, {}, e.header, name=e.name)
                    if placed is not None:
                        placed(list(ready))
                    del ready
                params = {p: got[t] for p, t in dz.params.items()}
                nbytes += delta_nbytes({}, params)
                if not e.validated:  # the parameters' check needs the embeddings (vocabulary rows)
                    self.placer.validate(embeddings, params, e.header, folder)
                if params:
                    self.placer.attach(slot, {}, params, e.header, name=e.name)
                if placed is not None:
                    placed(None)
            except BaseException:
                self.placer.detach(slot)
                raise
            finally:
                bar.close()
        e.validated = True
        return modules, (params if keep else {}), nbytes, slot

    def _free_slot(self) -> int:
        used = {e.slot for e in self._entries.values() if e.slot is not None}
        used |= {load.slot for load in self._inflight.values()}  # taken by loads still in flight
        slot = 0
        while slot in used:
            slot += 1
        return slot

    def _make_room(self, needed, incoming: int) -> None:
        """Evict least recently used deltas (never a held one or one of ``needed``) until ``incoming`` more
        device bytes (and one more delta when ``incoming``) fit the budgets. The victims are chosen first and
        evicted only if they make enough room: a request that cannot fit raises with every delta left where it
        was."""
        count = len(self.resident) + (1 if incoming else 0)
        total = self.resident_bytes() + incoming if self.max_resident_bytes is not None else 0

        def over(count, total):
            if self.max_resident is not None and count > self.max_resident:
                return True
            return self.max_resident_bytes is not None and total > self.max_resident_bytes

        if not over(count, total):
            return
        copies = self.placer.sparse_copy_nbytes() if self.max_resident_bytes is not None else {}
        victims = sorted((e.last_used, n) for n, e in self._entries.items()
                         if e.slot is not None and n not in needed and not e.holds)
        plan = []
        for _, n in victims:
            if not over(count, total):
                break
            e = self._entries[n]
            plan.append(e)
            count -= 1
            total -= _budget_nbytes(e, copies)
        if over(count, total):
            if self.max_resident_bytes is not None and incoming > self.max_resident_bytes:
                raise CacheFullError(
                    f"this delta takes {incoming} bytes on the device, more than the whole resident budget "
                    f"(max_resident_bytes={self.max_resident_bytes}): raise it with configure_cache()")
            raise CacheFullError(
                "the deltas this batch needs do not fit the resident budget next to the deltas in use: "
                "raise max_resident / max_resident_bytes with configure_cache() or split the batch"
            )
        for e in plan:
            self._evict(e)

    def _evict(self, e: CacheEntry) -> None:
        if e.path is None and e.host is None:  # nothing to read it back from: keep it in host memory
            e.host = to_host(*self.placer.gather(e.slot))
            e.host_is_only_copy = True
        self._drop_staging(e)
        self.placer.detach(e.slot)
        e.slot, e.ready = None, None

    def _trim_host(self, keep) -> None:
        # the host budget covers cached copies, not prefetches in flight or in-memory deltas' only copy
        # (a staging still writing a delta keeps its host copy: what it writes next, and what save_delta reads)
        cached = [n for n, e in self._entries.items()
                  if e.host is not None and not e.prefetched and not e.host_is_only_copy and e.staging is None]
        total = sum(delta_nbytes(*self._entries[n].host) for n in cached)
        order = sorted(cached, key=lambda n: (n in keep, self._entries[n].last_used))  # LRU, the batch's own last
        for n in order:
            if total <= self.max_host_bytes:
                break
            total -= delta_nbytes(*self._entries[n].host)
            self._entries[n].host = None


def _budget_nbytes(e: CacheEntry, copies: dict) -> int:
    """Device bytes of resident delta ``e`` as the byte budget counts them: its packed tensors and the input-major
    copies (``copies``: :meth:`DeltaPlacer.sparse_copy_nbytes`) the activation-sparse kernels keep of it."""
    return (e.nbytes or 0) + copies.get(e.slot, 0)


def _check_same_delta(e: CacheEntry, dz: DeltaZipFile) -> None:
    """Refuse to read a delta whose file now holds another delta (one saved over its folder since it was
    registered): it would serve that one under this delta's name. The same delta saved again passes."""
    if e.content_id is not None and dz.content_id != e.content_id:
        raise DeltaZipError(
            f"the file of delta {e.name!r} ({dz.path}) was replaced by another delta after it was loaded; "
            f"delete_delta({e.name!r}) and load_delta it again to use what the folder holds now"
        )


def _on_device(modules: dict, params: dict) -> bool:
    tensors = [p.qweight for p in modules.values()] + list(params.values())
    return any(t.device.type != "cpu" for t in tensors)


def to_host(modules: dict, params: dict):
    """CPU copies of a delta's tensors, pinned when CUDA is available (fast, asynchronous uploads)."""
    pin = torch.cuda.is_available()

    def host(t):
        t = t.detach()
        if t.device.type == "cpu":
            return t.pin_memory() if pin else t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)  # one copy, straight into page-locked memory
        out.copy_(t)
        return out

    return ({n: map_packed(p, host) for n, p in modules.items()}, {n: host(t) for n, t in params.items()})
