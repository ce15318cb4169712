"""`DeltaModel`: one base model, any number of compressed fine-tunes, a different one per batch row."""

from __future__ import annotations

import copy
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..config import DeltaZipConfig
from ..delta import PackedModule, resolve_delta_folder
from ..errors import BaseMismatchError, DeltaNotFoundError, DeltaZipError
from ..fingerprint import check_fingerprint
from ..format import DZ_FILENAME, DeltaZipFile
from .arch import is_linear
from .layers import DeltaEmbedding, DeltaLinear, DeltaOverride, Routing, _DeltaModuleBase, _map_packed

_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only")


class DeltaModel(nn.Module):
    """A transformers causal LM with compressed fine-tunes loaded on top of it.

    The base stays as it is; each module a delta touches is wrapped (the original kept as
    ``base_layer``). ``model(...)`` and ``model.generate(...)`` take ``delta_names``: one name per
    batch row, ``None`` for the plain base.

    Example:
        >>> model = DeltaModel.from_pretrained("chat-delta", base="org/base", delta_name="chat")
        >>> model.load_delta("code-delta", delta_name="code")
        >>> out = model.generate(ids, attention_mask=mask, delta_names=["chat", "code", None])
    """

    def __init__(self, base_model: nn.Module, *, use_kernels: str = "auto"):
        super().__init__()
        if use_kernels not in ("auto", "always", "never"):
            raise DeltaZipError(f'use_kernels must be "auto", "always" or "never", got {use_kernels!r}')
        self.base_model = base_model
        self._routing = Routing()
        self._routing.kernels = use_kernels
        self._slots: dict[str, int] = {}  # resident deltas -> slot
        self._info: dict[str, dict] = {}  # every known delta: folder, config, header, host copy, use clock
        self._default: Optional[str] = None
        self._lock = threading.RLock()
        self._clock = itertools.count()
        self._max_resident: Optional[int] = None
        self._max_resident_bytes: Optional[int] = None
        self._max_host_bytes: int = 0
        self._prefetcher = None
        self._held: dict[str, int] = {}  # deltas that running requests use: never evicted
        self._side_stream = None

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
        **base_kwargs,
    ) -> "DeltaModel":
        """Load a base model and one delta onto it.

        Args:
            delta_id_or_path: a local delta folder or a Hub repo id.
            base: the base model, its id or path; ``None`` loads the base recorded in the delta.
            delta_name: the name this delta is known by.
            revision, token, cache_dir, local_files_only: for downloading the delta from the Hub.
            base_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (dtype, device_map,
                quantization_config, ...).

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
                header = dict(dz.header)
            base_id = str(base) if base is not None else header.get("base_model")
            if not base_id:
                raise BaseMismatchError("the delta records no base model: pass base=")
            kwargs = dict(base_kwargs)
            if base is None and header.get("base_revision") and "revision" not in kwargs:
                kwargs["revision"] = header["base_revision"]
            if token is not None:
                kwargs.setdefault("token", token)
            base = AutoModelForCausalLM.from_pretrained(base_id, **kwargs)
        model = cls(base)
        model.load_delta(folder, delta_name=delta_name)
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
        """Load another delta onto this base. Returns its name.

        Args:
            delta_id_or_path: a local delta folder or a Hub repo id.
            delta_name: the name to use (default: the folder or repo name).
            num_threads: threads decompressing tensors in parallel.
            resident: put it on the model's device now (default); ``False`` only registers it (its header
                and base are checked) and it is loaded on demand when a batch names it.
            hub_kwargs: revision, token, cache_dir, local_files_only.
        """
        folder = resolve_delta_folder(delta_id_or_path, **{k: v for k, v in hub_kwargs.items() if v is not None})
        name = delta_name or Path(str(delta_id_or_path)).name
        with self._lock:
            self._check_new_name(name)
            config = DeltaZipConfig.from_pretrained(folder)
            with DeltaZipFile(folder / DZ_FILENAME) as dz:
                header = dict(dz.header)
                self._check_base(header, folder)
            self._register(name, {"path": str(folder), "config": config, "header": header, "host": None,
                                  "validated": False, "threads": num_threads}, resident)
        return name

    def _check_new_name(self, name: str) -> None:
        if name in self._info:
            raise DeltaZipError(f"a delta named {name!r} is already loaded: delete_delta({name!r}) first or pick another name")

    def _register(self, name: str, info: dict, resident: bool) -> None:
        """Record a delta (caller holds the lock); with ``resident``, load it now or forget it on failure."""
        self._info[name] = {**info, "used": next(self._clock)}
        if resident:
            try:
                self._ensure_resident([name])
            except Exception:
                del self._info[name]
                raise

    def add_delta(self, delta, delta_name: str, *, resident: bool = True) -> str:
        """Put an in-memory delta on this base (no file): a :class:`~hf_deltazip.CompressedDelta`
        (e.g. straight from :func:`hf_deltazip.compress`) or a dict ``{module name: PackedModule}``.

        The delta's tensors may be on the CPU or on the model's device. If the cache evicts it later
        it is kept in host memory, since there is no file to read it back from.
        """
        from ..delta import CompressedDelta

        if isinstance(delta, CompressedDelta):
            modules, params, header = dict(delta.modules), dict(delta.params), dict(delta.header)
            if header.get("base_fingerprint") or header.get("model_type"):
                self._check_base(header, f"delta {delta_name!r}")
        elif isinstance(delta, dict) and all(isinstance(p, PackedModule) for p in delta.values()):
            modules, params, header = dict(delta), {}, {"extra": {}}
        else:
            raise DeltaZipError(
                f"add_delta takes a CompressedDelta or a dict of PackedModule, got {type(delta).__name__}; "
                "for a folder or Hub repo use load_delta()"
            )
        header.setdefault("extra", {})
        if not resident:  # kept until needed: in host memory, where the cache's budget counts it
            modules, params = _to_host(modules, params)
        with self._lock:
            self._check_new_name(delta_name)
            self._validate(modules, params, header, f"delta {delta_name!r}")
            self._register(delta_name, {"path": None, "config": getattr(delta, "config", None), "header": header,
                                        "host": (modules, params), "keep_host": True, "validated": True,
                                        "threads": None}, resident)
        return delta_name

    # ------------------------------------------------------------------ the delta cache
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
            max_resident_bytes: most bytes of deltas on the device at once (``None``: no limit).
            max_host_bytes: bytes of host memory for copies of deltas (pinned when CUDA is available),
                so an evicted delta comes back without reading and decompressing its file again.

        Call it before loading many deltas: on CUDA the kernel stacks are sized for ``max_resident``
        deltas when they are first built, so later loads and evictions only write into that room (no
        reallocation, and captured decode graphs stay valid). Without a ``max_resident`` a stack
        keeps half again the room it needs and is rebuilt (old and new briefly both in memory) when full.
        """
        for value, what in ((max_resident, "max_resident"), (max_resident_bytes, "max_resident_bytes")):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise DeltaZipError(f"{what} must be a positive integer or None, got {value!r}")
        if not isinstance(max_host_bytes, int) or max_host_bytes < 0:
            raise DeltaZipError(f"max_host_bytes must be a non-negative integer, got {max_host_bytes!r}")
        with self._lock:
            self._max_resident, self._max_resident_bytes, self._max_host_bytes = max_resident, max_resident_bytes, max_host_bytes
            self._routing.capacity = max_resident  # kernel stacks get room for this many deltas
            self._trim_host(keep=())
            self._make_room(needed=(), incoming=0)

    @property
    def resident_deltas(self) -> list:
        """Names of the deltas on the model's device now."""
        return list(self._slots)

    def prefetch(self, names: Sequence[str], *, to_device: bool = True) -> Future:
        """Load deltas ahead of the requests that will name them, in a background thread; returns a Future.

        Each delta is read and decompressed into (pinned) host memory; then, on CUDA and with
        ``to_device``, copied into free room of the kernel stacks on a side stream, overlapping the
        decode running on the main stream. A prefetch never evicts: a delta that does not fit the
        resident budget stays in host memory and is uploaded when a batch names it.
        """
        names = [n for n in names if n is not None]
        for n in names:
            if n not in self._info:
                raise DeltaNotFoundError(f"no delta named {n!r} is loaded; loaded: {self.deltas}. Use load_delta() first")
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltazip-prefetch")

        def work():
            for n in names:
                with self._lock:
                    info = self._info.get(n)
                    if info is None or info["host"] is not None or n in self._slots:
                        continue
                modules, params = self._read(n)  # disk and decompression: outside the lock
                host = _to_host(modules, params)
                with self._lock:
                    if n in self._info and self._info[n]["host"] is None:
                        self._info[n]["host"] = host
                        self._info[n]["prefetched"] = True
                    if to_device:
                        self._upload_ahead(n)
            return names

        return self._prefetcher.submit(work)

    def _upload_ahead(self, name: str) -> None:
        """Put a host-tier delta on the device ahead of use, into free room only (caller holds the lock).

        On CUDA the copies run on a side stream (device memory is taken on the main stream, so the
        caching allocator never hands a block in use by a running step to the side stream); the
        first batch that names the delta waits for them with an event.
        """
        info = self._info.get(name)
        device = _first_device(self.base_model)
        if info is None or name in self._slots or info["host"] is None or not self._routing.wants_kernels(device):
            return
        modules, params = info["host"]
        slot = self._free_slot()
        nbytes = _nbytes(modules, params)
        if info["header"].get("extra", {}).get("tied_embeddings"):
            return  # the LM head would share the embedding's delta: attach on demand instead
        if self._max_resident is not None and len(self._slots) + 1 > self._max_resident:
            return
        if self._max_resident_bytes is not None and self._resident_bytes() + nbytes > self._max_resident_bytes:
            return
        # only changes that need no new wrapper and no stack rebuild
        for mname, p in modules.items():
            mod = self._find(mname)
            if isinstance(mod, DeltaLinear):
                if not mod.can_write_in_place(slot, p):
                    return
            elif not isinstance(mod, _DeltaModuleBase):
                return
        for pname in params:
            owner = self._find(pname.rpartition(".")[0])
            if not isinstance(owner, _DeltaModuleBase) or isinstance(owner, DeltaLinear):
                return
        side = None
        if device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(device))
        self._attach(slot, modules, params, info["header"], side=side)
        if side is not None:
            ready = torch.cuda.Event()
            ready.record(side)
            info["ready"] = ready
        self._slots[name] = slot
        info["nbytes"] = nbytes
        info.pop("prefetched", None)
        info.pop("keep_host", None)
        if not self._max_host_bytes or info["path"] is None:
            info["host"] = None  # pinned blocks stay alive until the copy is done (caching host allocator)
        self._trim_host(keep=())

    def _wait_ready(self, name: str) -> None:
        ready = self._info[name].pop("ready", None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)

    def _fits(self, names) -> bool:
        """Whether the deltas ``names`` could all be resident next to the held ones (without waiting)."""
        names = {n for n in names if n is not None}
        keep = names | set(self._held)
        if self._max_resident is not None and len(keep) > self._max_resident:
            return False
        if self._max_resident_bytes is not None:
            def size(n):
                info = self._info.get(n, {})
                if "nbytes" in info:
                    return info["nbytes"]
                return _nbytes(*info["host"]) if info.get("host") is not None else 0

            if sum(size(n) for n in keep) > self._max_resident_bytes:
                return False
        return True

    def _hold(self, names) -> None:
        """Mark deltas as used by running requests (the cache will not evict them)."""
        with self._lock:
            for n in names:
                if n is not None:
                    self._held[n] = self._held.get(n, 0) + 1

    def _unhold(self, names) -> None:
        with self._lock:
            for n in names:
                if n is not None and self._held.get(n):
                    self._held[n] -= 1
                    if not self._held[n]:
                        del self._held[n]

    def _read(self, name: str):
        info = self._info[name]
        folder = Path(info["path"])
        with DeltaZipFile(folder / DZ_FILENAME) as dz:
            pin = _first_device(self.base_model).type == "cuda"  # page-locked: uploads go asynchronously
            tensors = dz.read_tensors(num_threads=info.get("threads"), pin_memory=pin)
            modules = {
                mname: PackedModule.from_record(rec, {role: tensors[t] for role, t in rec.tensors.items()})
                for mname, rec in dz.modules.items()
            }
            params = {pname: tensors[t] for pname, t in dz.params.items()}
        if not info["validated"]:
            self._validate(modules, params, info["header"], folder)
            info["validated"] = True
        return modules, params

    def _ensure_resident(self, names) -> None:
        with self._lock:
            needed = list(dict.fromkeys(names))
            if self._max_resident is not None and len(needed) > self._max_resident:
                raise DeltaZipError(
                    f"this batch needs {len(needed)} deltas but at most {self._max_resident} may be resident: "
                    "raise max_resident with configure_cache() or split the batch"
                )
            for n in needed:
                self._info[n]["used"] = next(self._clock)
                if n in self._slots:
                    self._wait_ready(n)
                    continue
                info = self._info[n]
                if info["host"] is not None:
                    modules, params = info["host"]
                else:
                    modules, params = self._read(n)
                nbytes = _nbytes(modules, params)
                self._make_room(needed=needed, incoming=nbytes)
                slot = self._free_slot()
                try:
                    self._attach(slot, modules, params, info["header"])
                except Exception:
                    self._detach(slot)
                    raise
                self._slots[n] = slot
                info["nbytes"] = nbytes
                if info.get("keep_host") and _on_device(modules, params):
                    info["host"] = None  # an in-memory delta given on the device: the stack holds it now
                    info.pop("keep_host")
                if info["host"] is None and self._max_host_bytes and info["path"] is not None:
                    info["host"] = _to_host(modules, params)
                info.pop("prefetched", None)
                self._trim_host(keep=needed)

    def _resident_bytes(self) -> int:
        return sum(self._info[n].get("nbytes", 0) for n in self._slots)

    def _make_room(self, needed, incoming: int) -> None:
        def over():
            count = len(self._slots) + (1 if incoming else 0)
            if self._max_resident is not None and count > self._max_resident:
                return True
            return self._max_resident_bytes is not None and self._resident_bytes() + incoming > self._max_resident_bytes

        while over():
            victims = sorted((self._info[n]["used"], n) for n in self._slots if n not in needed and not self._held.get(n))
            if not victims:
                raise DeltaZipError(
                    "the deltas this batch needs do not fit the resident budget: raise max_resident_bytes with "
                    "configure_cache() or split the batch"
                )
            self._evict(victims[0][1])

    def _evict(self, name: str) -> None:
        info = self._info[name]
        if info["path"] is None and info["host"] is None:  # nothing to read it back from: keep it in host memory
            info["host"] = _to_host(*self._gather(self._slots[name]))
            info["keep_host"] = True
        self._detach(self._slots.pop(name))  # a default delta stays the default: it comes back on demand

    def _gather(self, slot: int):
        """A resident delta's packed modules and parameters, as the wrappers hold them."""
        modules, params = {}, {}
        special = self._special_names()
        for name, mod in self.base_model.named_modules():
            if not isinstance(mod, _DeltaModuleBase):
                continue
            name = _plain(name)
            if slot in mod.packed and not (name == special.get("output") and isinstance(mod, DeltaLinear)
                                           and mod.packed[slot].kind == "embedding"):
                modules[name] = mod.packed[slot]
            for attr, t in mod.overrides.get(slot, {}).items():
                params[f"{name}.{attr}"] = t
        return modules, params

    def _trim_host(self, keep) -> None:
        # the host tier's budget covers cached copies, not prefetches in flight or in-memory deltas' only copy
        cached = [n for n, i in self._info.items() if i["host"] is not None and not i.get("prefetched") and not i.get("keep_host")]
        total = sum(_nbytes(*self._info[n]["host"]) for n in cached)
        order = sorted(cached, key=lambda n: (n in keep, self._info[n]["used"]))  # LRU, the batch's own last
        for n in order:
            if total <= self._max_host_bytes:
                break
            total -= _nbytes(*self._info[n]["host"])
            self._info[n]["host"] = None

    def _check_base(self, header: dict, folder) -> None:
        cfg = getattr(self.base_model, "config", None)
        expected = header.get("base_model") or "?"
        mt = header.get("model_type")
        if mt is not None and getattr(cfg, "model_type", None) != mt:
            raise BaseMismatchError(
                f"{folder}: the delta is for a {mt!r} model ({expected}) but the base is {getattr(cfg, 'model_type', None)!r}; "
                f"load it onto {expected!r}"
            )
        check_fingerprint(header.get("base_fingerprint") or {}, self._plain_params(), expected_base=expected)

    def _plain_params(self) -> dict:
        """The base's parameters under their original names (wrappers' ``base_layer`` removed)."""
        return {n.replace(".base_layer.", "."): p for n, p in self.base_model.named_parameters()}

    def _validate(self, modules: dict, params: dict, header: dict, folder) -> None:
        base_params = self._plain_params()
        vocab_rows = set()
        for name, p in modules.items():
            mod = self._find(name)
            if mod is None:
                raise BaseMismatchError(f"{folder}: the base has no module {name!r}; load the delta onto {header.get('base_model')!r}")
            base_mod = mod.base_layer if isinstance(mod, _DeltaModuleBase) else mod
            w = base_mod.weight
            n, k = (w.shape[1], w.shape[0]) if p.transposed else tuple(w.shape)
            if p.kind == "embedding":
                vocab_rows.add(name)
                if k != p.shape[1] or p.shape[0] < n:
                    raise BaseMismatchError(f"{folder}: {name} is {list(p.shape)} in the delta but {[n, k]} in the base")
            elif (n, k) != tuple(p.shape):
                raise BaseMismatchError(f"{folder}: {name} is {list(p.shape)} in the delta but {[n, k]} in the base")
        for pname, t in params.items():
            b = base_params.get(pname)
            if b is None:
                raise BaseMismatchError(f"{folder}: the base has no parameter {pname!r}; load the delta onto {header.get('base_model')!r}")
            owner = pname.rsplit(".", 1)[0]
            if tuple(b.shape) != tuple(t.shape) and owner not in vocab_rows and not self._is_vocab_param(pname):
                raise BaseMismatchError(f"{folder}: {pname} is {list(t.shape)} in the delta but {list(b.shape)} in the base")

    def _is_vocab_param(self, pname: str) -> bool:
        names = self._special_names()
        return pname.rsplit(".", 1)[0] in names.values()

    def _special_names(self) -> dict:
        out = {}
        inner = self.base_model
        ie, oe = inner.get_input_embeddings(), inner.get_output_embeddings()
        for n, m in inner.named_modules():
            if m is ie:
                out["input"] = _plain(n)
            if m is oe:
                out["output"] = _plain(n)
        return out

    def _find(self, name: str) -> Optional[nn.Module]:
        try:
            mod = self.base_model.get_submodule(name)
        except AttributeError:
            return None
        return mod

    def _free_slot(self) -> int:
        used = set(self._slots.values())
        slot = 0
        while slot in used:
            slot += 1
        return slot

    def _wrap(self, name: str, kind: str) -> _DeltaModuleBase:
        mod = self.base_model.get_submodule(name)
        if isinstance(mod, _DeltaModuleBase):
            return mod
        parent_name, _, child = name.rpartition(".")
        parent = self.base_model.get_submodule(parent_name) if parent_name else self.base_model
        special = self._special_names()
        if kind == "linear" and is_linear(mod):
            wrapper = DeltaLinear(mod, self._routing, is_output_embedding=special.get("output") == name)
        elif kind == "embedding" and isinstance(mod, nn.Embedding):
            wrapper = DeltaEmbedding(mod, self._routing)
        elif kind == "embedding" and is_linear(mod):
            wrapper = DeltaLinear(mod, self._routing, is_output_embedding=True)
        else:
            wrapper = DeltaOverride(mod, self._routing)
        setattr(parent, child, wrapper)
        return wrapper

    def _attach(self, slot: int, modules: dict, params: dict, header: dict, side=None) -> None:
        """Put a delta's tensors on the device under ``slot``; with a CUDA ``side`` stream, the copies
        run on it (memory is taken on the current stream)."""
        from contextlib import nullcontext

        device = _first_device(self.base_model)
        special = self._special_names()
        on_side = torch.cuda.stream(side) if side is not None else nullcontext()

        def move(t):
            if side is None or t.device == device:
                return t.to(device)
            dst = torch.empty_like(t, device=device)
            with torch.cuda.stream(side):
                dst.copy_(t, non_blocking=True)
            dst.record_stream(side)
            return dst

        for name, p in modules.items():
            wrapper = self._wrap(name, p.kind)
            if not (isinstance(wrapper, DeltaLinear) and wrapper.can_write_in_place(slot, p)):
                p = p.to_dense_layout() if device.type == "cuda" else p
                p = _map_packed(p, move)
                wrapper.add_packed(slot, p)
            else:
                with on_side:
                    wrapper.add_packed(slot, p)  # in place: one copy from (pinned) host memory into the stack
            # tied embeddings: the LM head shares the input embedding's delta
            if p.kind == "embedding" and header.get("extra", {}).get("tied_embeddings") and name == special.get("input"):
                out_name = special.get("output")
                if out_name and out_name not in modules:
                    self._wrap(out_name, "linear").add_packed(slot, p)
        for pname, t in params.items():
            owner, _, attr = pname.rpartition(".")
            wrapper = self._wrap(owner, "override" if owner not in modules else modules[owner].kind)
            t = move(t)
            wrapper.add_override(slot, attr, t)
            # tied embeddings stored exactly: the LM head shares the input embedding's new weight too
            out_name = special.get("output")
            if (attr == "weight" and owner == special.get("input") and header.get("extra", {}).get("tied_embeddings")
                    and out_name and f"{out_name}.weight" not in params and out_name not in modules):
                self._wrap(out_name, "linear").add_override(slot, "weight", t)

    def _detach(self, slot: int, keep_room: bool = True) -> None:
        for mod in list(self.base_model.modules()):
            if isinstance(mod, _DeltaModuleBase) and slot in mod.slots():
                mod.remove_slot(slot, keep_room=keep_room)

    # ------------------------------------------------------------------ managing deltas
    @property
    def deltas(self) -> list:
        """Names of the loaded deltas (resident on the device or not)."""
        return list(self._info)

    @property
    def active_delta(self) -> Optional[str]:
        return self._default

    def set_delta(self, name: Optional[str]) -> None:
        """The delta used for calls without ``delta_names`` (``None``: the plain base)."""
        if name is not None and name not in self._info:
            raise DeltaNotFoundError(f"no delta named {name!r} is loaded; loaded: {self.deltas}. Use load_delta() first")
        self._default = name

    def delete_delta(self, name: str) -> None:
        """Unload a delta; the others stay usable."""
        with self._lock:
            if name not in self._info:
                raise DeltaNotFoundError(f"no delta named {name!r} is loaded; loaded: {self.deltas}")
            if self._held.get(name):
                raise DeltaZipError(f"delta {name!r} is in use by running requests; delete it once they finish")
            if name in self._slots:
                self._detach(self._slots.pop(name), keep_room=False)
            del self._info[name]
            if self._default == name:
                self._default = None

    def _slot(self, name: str) -> int:
        if name not in self._info:
            raise DeltaNotFoundError(f"no delta named {name!r} is loaded; loaded: {self.deltas}. Use load_delta() first")
        self._ensure_resident([name])
        return self._slots[name]

    def _slots_for(self, delta_names: Optional[Sequence]) -> Optional[list]:
        if delta_names is None:
            if self._default is None:
                return None
            return _DefaultSlots(self._slot(self._default))
        if isinstance(delta_names, str):
            raise DeltaZipError("delta_names takes one name per batch row (a list), e.g. ['chat', None]")
        needed = [n for n in delta_names if n is not None]
        for n in needed:
            if n not in self._info:
                raise DeltaNotFoundError(f"no delta named {n!r} is loaded; loaded: {self.deltas}. Use load_delta() first")
        self._ensure_resident(needed)
        return [-1 if n is None else self._slots[n] for n in delta_names]

    @contextmanager
    def route(self, delta_names: Optional[Sequence]):
        """Within this block every call uses ``delta_names`` (one per row); holds the model's lock."""
        with self._lock:
            slots = self._slots_for(delta_names)
            previous = self._routing.slots
            self._routing.slots = slots
            try:
                yield
            finally:
                self._routing.slots = previous

    # ------------------------------------------------------------------ running
    def forward(self, *args, delta_names: Optional[Sequence] = None, **kwargs):
        _check_rows(delta_names, args, kwargs)
        with self.route(delta_names):
            return self.base_model(*args, **kwargs)

    def generate(self, *args, delta_names: Optional[Sequence] = None, **kwargs):
        """``generate`` with one delta per row (``None`` = base); every generate option works."""
        _check_rows(delta_names, args, kwargs)
        with self.route(delta_names):
            return self.base_model.generate(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    # ------------------------------------------------------------------ merging and memory
    def merge_and_unload(self, name: Optional[str] = None, *, inplace: bool = False) -> nn.Module:
        """A plain transformers model with delta ``name`` merged in (``W_base + dequant(delta)``).

        With ``inplace=False`` (default) the base and the other deltas stay usable and a merged copy is
        returned; with ``inplace=True`` the base itself becomes the merged model and every delta is unloaded.
        """
        name = name or self._default
        if name is None:
            raise DeltaZipError("merge_and_unload needs the name of a loaded delta")
        with self._lock:
            return self._merge(name, inplace)

    def _merge(self, name: str, inplace: bool) -> nn.Module:
        slot = self._slot(name)
        target = self.base_model if inplace else copy.deepcopy(self.base_model)
        for mod_name, mod in list(target.named_modules()):
            if not isinstance(mod, _DeltaModuleBase):
                continue
            merged = _merged_module(mod, slot)
            parent_name, _, child = mod_name.rpartition(".")
            parent = target.get_submodule(parent_name) if parent_name else target
            setattr(parent, child, merged)
        header = self._info[name]["header"]
        vocab = header.get("extra", {}).get("vocab_size_finetune")
        if vocab and getattr(target.config, "vocab_size", None) != vocab:
            target.config.vocab_size = vocab
        if header.get("extra", {}).get("tied_embeddings"):
            target.tie_weights()
        if inplace:
            self._slots.clear()
            self._info.clear()
            self._default = None
        return target

    def memory_footprint(self) -> dict:
        """Bytes of the base and of each loaded delta, as they sit on their devices."""
        seen = set()
        base = 0
        for p in list(self.base_model.parameters()) + list(self.base_model.buffers()):
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            base += p.numel() * p.element_size()
        per = {n: 0 for n in self._slots}
        for mod in self.base_model.modules():
            if isinstance(mod, _DeltaModuleBase):
                for n, slot in self._slots.items():
                    if slot in mod.slots():
                        per[n] += mod.delta_nbytes(slot)
        host = {n: _nbytes(*i["host"]) for n, i in self._info.items() if i["host"] is not None}
        return {"base": base, "deltas": per, "total": base + sum(per.values()), "host": host}


def _on_device(modules: dict, params: dict) -> bool:
    tensors = [p.qweight for p in modules.values()] + list(params.values())
    return any(t.device.type != "cpu" for t in tensors)


def _nbytes(modules: dict, params: dict) -> int:
    return sum(p.nbytes for p in modules.values()) + sum(t.numel() * t.element_size() for t in params.values())


def _to_host(modules: dict, params: dict):
    """CPU copies of a delta's tensors, pinned when CUDA is available (fast, asynchronous uploads)."""
    pin = torch.cuda.is_available()

    def host(t):
        t = t.detach().to("cpu")
        return t.pin_memory() if pin else t

    return ({n: _map_packed(p, host) for n, p in modules.items()}, {n: host(t) for n, t in params.items()})


class _DefaultSlots(list):
    """Every row uses one slot, whatever the batch size."""

    def __init__(self, slot: int):
        super().__init__([slot])
        self.slot = slot


def _check_rows(delta_names, args, kwargs):
    if delta_names is None:
        return
    ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is not None and ids.dim() >= 2 and ids.shape[0] != len(delta_names):
        raise DeltaZipError(f"{len(delta_names)} delta names for a batch of {ids.shape[0]} rows: pass one name per row")


def _plain(name: str) -> str:
    return name.replace(".base_layer", "")


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _merged_module(mod: _DeltaModuleBase, slot: int) -> nn.Module:
    base = mod.base_layer
    new = copy.deepcopy(base)
    if isinstance(mod, DeltaLinear):
        w = mod.merged_weight(slot) if (slot in mod.packed or "weight" in mod.overrides.get(slot, {})) else None
        if w is not None:
            w = w.t() if mod.transposed else w
            new.weight = nn.Parameter(w.contiguous().to(base.weight.dtype), requires_grad=base.weight.requires_grad)
            if isinstance(new, nn.Linear):
                new.out_features, new.in_features = new.weight.shape
            elif hasattr(new, "nf"):
                new.nf = new.weight.shape[1]
        b = mod.merged_bias(slot) if slot in mod.slots() else None
        if b is not None:
            new.bias = nn.Parameter(b.to(base.weight.dtype).clone(), requires_grad=False)
    elif isinstance(mod, DeltaEmbedding):
        if slot in mod.packed or "weight" in mod.overrides.get(slot, {}):
            new.weight = nn.Parameter(mod.merged_weight(slot).clone(), requires_grad=base.weight.requires_grad)
            new.num_embeddings = new.weight.shape[0]
    for attr, value in mod.overrides.get(slot, {}).items():
        if isinstance(mod, DeltaLinear) and attr in ("weight", "bias"):
            continue
        if isinstance(mod, DeltaEmbedding) and attr == "weight":
            continue
        old = getattr(new, attr)
        setattr(new, attr, nn.Parameter(value.to(old.dtype).clone(), requires_grad=getattr(old, "requires_grad", False)))
    return new
