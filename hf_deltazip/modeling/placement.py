"""Putting a delta's tensors into a base model's modules, and taking them out again.

:class:`DeltaPlacer` knows the base model: which modules a delta touches, how to wrap them
(:mod:`.layers`), whether a delta's shapes fit the base, and how to write a delta under a *slot*
(in place into free kernel-stack room when it can). It decides nothing about which deltas should
be on the device: that is the :class:`~.cache.DeltaCache`'s job, which calls it.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

from ..errors import BaseMismatchError, DeltaZipFormatError
from ..fingerprint import check_fingerprint, load_onto_hint
from ..format import DeltaHeader
from ..quantization import logical_weight_shape
from .activation_sparsity import has_activation_sparsity
from .arch import is_linear, weight_as_nk
from .layers import (
    DeltaEmbedding,
    DeltaLinear,
    DeltaModule,
    DeltaOverride,
    base_plus_delta,
    can_take_sparse_route,
    map_packed,
    sparse_copy_estimate,
)
from .quantized import execution_device
from .routing import KernelPolicy, LayoutVersion, Router
from .tensor_parallel import TensorParallelError, fingerprint_view, full_tensor, local_tensor, tp_shard, tp_size

__all__ = ["DeltaPlacer", "delta_nbytes"]


def delta_nbytes(modules: dict, params: dict) -> int:
    """Bytes of a delta's packed modules and parameters as they are held (not the file's bytes)."""
    # a lowrank module is held as the served codes of its factors' product (the factors stay on the host)
    return sum(p.resident_nbytes if p.factors is not None else p.nbytes for p in modules.values()) + \
        sum(t.numel() * t.element_size() for t in params.values())


class DeltaPlacer:
    """Wraps the modules of ``base_model`` that deltas touch and places deltas into them by slot.

    Args:
        base_model: the transformers model (patched in place).
        router, layout, policy: shared with every wrapper (see :mod:`.routing`).
    """

    def __init__(self, base_model: nn.Module, router: Router, layout: LayoutVersion, policy: KernelPolicy):
        self.base_model = base_model
        self.router = router
        self.layout = layout
        self.policy = policy
        self._tp = {}  # module name -> its TPShard (or None): computed once, on every rank alike
        self._copies = None  # sparse_copy_nbytes(), kept until a delta is attached or detached or the route changes

    # ------------------------------------------------------------------ the base
    @property
    def device(self) -> torch.device:
        for p in self.base_model.parameters():
            return p.device
        return torch.device("cpu")

    def uses_kernels(self) -> bool:
        return self.policy.wants_kernels(self.device)

    def plain_params(self) -> dict:
        """The base's parameters under their original names (wrappers' ``base_layer`` removed)."""
        return {n.replace(".base_layer.", "."): p for n, p in self.base_model.named_parameters()}

    def special_names(self) -> dict:
        """``{"input": name, "output": name}`` of the input and output embedding modules."""
        out = {}
        ie, oe = self.base_model.get_input_embeddings(), self.base_model.get_output_embeddings()
        for n, m in self.base_model.named_modules():
            if m is ie:
                out["input"] = _plain(n)
            if m is oe:
                out["output"] = _plain(n)
        return out

    def tp_shard(self, name: str, module: nn.Module):
        """How module ``name``'s deltas are cut on this rank of a tensor-parallel base (``None``: whole)."""
        if name not in self._tp:
            self._tp[name] = tp_shard(self.base_model, name, module) if tp_size(self.base_model) > 1 else None
        return self._tp[name]

    def find(self, name: str) -> Optional[nn.Module]:
        try:
            return self.base_model.get_submodule(name)
        except AttributeError:
            return None

    def wrappers(self):
        """``(name, wrapper)`` of every delta-carrying module, names without ``base_layer``."""
        for n, m in self.base_model.named_modules():
            if isinstance(m, DeltaModule):
                yield _plain(n), m

    # ------------------------------------------------------------------ checks
    def check_base(self, header: DeltaHeader, where) -> None:
        """Raise :class:`BaseMismatchError` unless this base is the one the delta was made from."""
        cfg = getattr(self.base_model, "config", None)
        expected = header.base_model
        mt = header.model_type
        fix = load_onto_hint(expected, mt)  # what every mismatch below tells the user to do
        if mt is not None and getattr(cfg, "model_type", None) != mt:
            raise BaseMismatchError(
                f"{where}: the delta is for a {mt!r} model{f' ({expected})' if expected else ''} but the base is "
                f"{getattr(cfg, 'model_type', None)!r}; {fix}"
            )
        params = self.plain_params()
        if tp_size(self.base_model) > 1:  # sharded weights: their whole shape (and the replicated ones' values)
            params = {n: fingerprint_view(self.base_model, n, t) for n, t in params.items()}
        check_fingerprint(header.base_fingerprint, params, expected_base=expected)

    def validate(self, modules: dict, params: dict, header: DeltaHeader, where) -> None:
        """Raise :class:`BaseMismatchError` unless every module and parameter of the delta fits the base, and
        :class:`DeltaZipFormatError` for zero points off their code grid (what no compression writes; the kernels
        take a zero point's low bits, the reference path its value, so such a delta would compute two ways)."""
        base_params = self.plain_params()
        fix = load_onto_hint(header.base_model, header.model_type)  # what every mismatch below tells the user to do
        vocab_rows = set()
        for name, p in modules.items():
            mod = self.find(name)
            if mod is None:
                raise BaseMismatchError(f"{where}: the base has no module {name!r}; {fix}")
            base_mod = mod.base_layer if isinstance(mod, DeltaModule) else mod
            w = base_mod.weight
            n, k = (w.shape[1], w.shape[0]) if p.transposed else (logical_weight_shape(base_mod) or tuple(w.shape))
            tp = self.tp_shard(name, base_mod)
            if tp is not None:
                n, k = tp.full
            if p.kind == "embedding":  # may carry rows for tokens the fine-tune added
                vocab_rows.add(name)
                fits = k == p.shape[1] and p.shape[0] >= n
            else:
                fits = (n, k) == tuple(p.shape)
            if not fits:
                raise BaseMismatchError(f"{where}: {name} is {list(p.shape)} in the delta but {[n, k]} in the base; {fix}")
            top = (1 << p.bits) - 1
            if p.bits < 8 and p.zeros.numel() and int(p.zeros.max()) > top:
                raise DeltaZipFormatError(where, f"{name}: zero points up to {int(p.zeros.max())}, but those of {p.bits}-bit "
                                                 f"codes lie in [0, {top}]; the delta is damaged or was not made by "
                                                 "hf_deltazip: compress the fine-tune again")
        vocab_modules = set(self.special_names().values())
        for pname, t in params.items():
            b = base_params.get(pname)
            if b is None:
                raise BaseMismatchError(f"{where}: the base has no parameter {pname!r}; {fix}")
            owner = pname.rsplit(".", 1)[0]
            if tuple(b.shape) != tuple(t.shape) and owner not in vocab_rows and owner not in vocab_modules:
                raise BaseMismatchError(f"{where}: {pname} is {list(t.shape)} in the delta but {list(b.shape)} in the base; "
                                        f"{fix}")

    # ------------------------------------------------------------------ placing
    def wrap(self, name: str, kind: str) -> DeltaModule:
        """The wrapper of module ``name`` (made and swapped in on first use)."""
        mod = self.base_model.get_submodule(name)
        if isinstance(mod, DeltaModule):
            return mod
        parent_name, _, child = name.rpartition(".")
        parent = self.base_model.get_submodule(parent_name) if parent_name else self.base_model
        shared = (self.router, self.layout, self.policy)
        output = self.special_names().get("output") == name
        tp = self.tp_shard(name, mod)
        if (kind == "linear" or tp is not None) and is_linear(mod):  # a sharded layer's bias too: DeltaLinear cuts it
            wrapper = DeltaLinear(mod, *shared, is_output_embedding=output, tp=tp)
        elif kind == "embedding" and isinstance(mod, nn.Embedding):
            wrapper = DeltaEmbedding(mod, *shared)
            wrapper.tp = tp
        elif kind == "embedding" and is_linear(mod):
            wrapper = DeltaLinear(mod, *shared, is_output_embedding=True, tp=tp)
        elif tp is not None:
            raise TensorParallelError(
                f"{name} ({type(mod).__name__}) is sharded by the tensor-parallel plan ({tp.style}) but is neither "
                "a linear layer nor an embedding: deltas cannot change it under tp_plan; load the base without tp_plan"
            )
        else:
            wrapper = DeltaOverride(mod, *shared)
        if self.policy.sparse and isinstance(wrapper, DeltaLinear) and has_activation_sparsity(mod):
            wrapper.set_sparse_kernels(True)
        setattr(parent, child, wrapper)
        return wrapper

    @staticmethod
    def _tied_head(header: DeltaHeader, special: dict, owner: str, attr: Optional[str], modules: dict,
                   params: dict) -> Optional[str]:
        """The LM head that shares input embedding ``owner``'s part of the delta (tied embeddings): its packed
        delta (``attr`` None) or its exactly stored ``attr`` ("weight"); ``None`` where no head shares it."""
        out = special.get("output")
        if not (header.tied_embeddings and out and owner == special.get("input") and out not in modules):
            return None
        if attr is not None and (attr != "weight" or f"{out}.weight" in params):
            return None
        return out

    def can_attach_in_room(self, slot: int, modules: dict, params: dict, header: DeltaHeader) -> bool:
        """Whether :meth:`attach` would only write into room kept for ``slot`` (no new wrapper, no kernel-stack
        or per-slot-table rebuild, so a captured decode step stays valid): what an upload ahead of use (while a
        decode step may run) is allowed to do. It asks every module that would take a part of the delta, the
        LM head of tied embeddings among them, as :meth:`attach` would hand it that part."""
        special = self.special_names()
        for mname, p in modules.items():
            mod = self.find(mname)
            if not isinstance(mod, DeltaModule):
                return False
            if mod.tp is not None:
                try:
                    p = self._shard(mname, mod, p)
                except TensorParallelError:
                    return False
            if not mod.can_write_in_place(slot, p):
                return False
            head_name = self._tied_head(header, special, mname, None, modules, params) if p.kind == "embedding" else None
            if head_name is not None:  # the LM head takes the input embedding's delta into its own stack
                head = self.find(head_name)
                if not isinstance(head, DeltaLinear) or not head.can_write_in_place(
                        slot, p if head.tp is None else head.tp.take(p)):
                    return False
        for pname, t in params.items():
            owner, _, attr = pname.rpartition(".")
            head_name = self._tied_head(header, special, owner, attr, modules, params)
            targets = [self.find(owner)] + ([self.find(head_name)] if head_name is not None else [])
            for mod in targets:
                if not isinstance(mod, DeltaModule) or mod.tp is not None or not mod.can_override_in_place(slot, attr, t):
                    return False
        return True

    def attach(self, slot: int, modules: dict, params: dict, header: DeltaHeader, name: Optional[str] = None,
               side: Optional[torch.cuda.Stream] = None) -> None:
        """Put a delta's tensors on the device under ``slot``; with a CUDA ``side`` stream the copies
        run on it (device memory is taken on the current stream)."""
        for _ in self.attach_steps(slot, modules, params, header, name=name, side=side):
            pass

    def attach_steps(self, slot: int, modules: dict, params: dict, header: DeltaHeader, name: Optional[str] = None,
                     side: Optional[torch.cuda.Stream] = None):
        """:meth:`attach` a piece at a time: a generator that places one module (with the LM head sharing it)
        or one exactly stored parameter per step. Until it is exhausted the slot holds part of the delta;
        :meth:`detach` takes a part out as it takes a whole delta out. Each wrapper learns the delta's name
        as its part is placed."""
        self._copies = None
        device = self.device
        special = self.special_names()
        on_side = torch.cuda.stream(side) if side is not None else nullcontext()

        def move(t):
            if side is None or t.device == device:
                return t.to(device)
            dst = torch.empty_like(t, device=device)
            with torch.cuda.stream(side):
                dst.copy_(t, non_blocking=True)
            dst.record_stream(side)
            return dst

        touched = []
        for mname, p in modules.items():
            wrapper = self.wrap(mname, p.kind)
            touched.append(wrapper)
            if wrapper.tp is not None:  # a tensor-parallel rank keeps its shard only
                p = self._shard(mname, wrapper, p)
            # a device-mapped base: the delta lives where its layer computes
            where = execution_device(wrapper.base_layer) or device
            if not wrapper.can_write_in_place(slot, p):
                # new device tensors, which the wrapper may read at once (stack builds): main stream
                p = p.to_dense_layout() if where.type == "cuda" else p
                wrapper.add_packed(slot, map_packed(p, lambda t: t.to(where)))
            else:
                with on_side:
                    wrapper.add_packed(slot, p)  # in place: one copy from (pinned) host memory into the stack
            # tied embeddings: the LM head shares the input embedding's delta
            head_name = self._tied_head(header, special, mname, None, modules, params) if p.kind == "embedding" else None
            if head_name is not None:
                head = self.wrap(head_name, "linear")
                hp = p if head.tp is None else head.tp.take(p)
                with (on_side if head.can_write_in_place(slot, hp) else nullcontext()):
                    head.add_packed(slot, hp)  # in place: one copy into the head's stack
                touched.append(head)
            self._named(touched, slot, name)
            yield
        for pname, t in params.items():
            owner, _, attr = pname.rpartition(".")
            targets = [self.wrap(owner, "override" if owner not in modules else modules[owner].kind)]
            # tied embeddings stored exactly: the LM head shares the input embedding's new weight too
            head_name = self._tied_head(header, special, owner, attr, modules, params)
            if head_name is not None:
                targets.append(self.wrap(head_name, "linear"))
            copies = {}  # one device copy per stream, shared by the embedding and a tied head
            if any(w.tp is not None for w in targets):
                t = self._shard_param(pname, targets[0], attr, t)
            for wrapper in targets:
                if wrapper.can_override_in_place(slot, attr, t):
                    if "side" not in copies:
                        copies["side"] = move(t)
                    with on_side:
                        wrapper.add_override(slot, attr, copies["side"])  # in place: a row of the per-slot table
                else:
                    where = execution_device(wrapper.base_layer) or device
                    if where not in copies:
                        copies[where] = t.to(where)
                    wrapper.add_override(slot, attr, copies[where])
                touched.append(wrapper)
            self._named(touched, slot, name)
            yield

    def _named(self, touched: list, slot: int, name: Optional[str]) -> None:
        """The end of a step of :meth:`attach_steps`: name the slot in the wrappers just written (``touched``,
        emptied for the next step)."""
        self._copies = None  # what the written wrappers hold changed
        if name is not None:
            for w in touched:
                w.names[slot] = name
        touched.clear()

    @staticmethod
    def _shard(name: str, wrapper: DeltaModule, p):
        vocab = p.kind == "embedding" or getattr(wrapper, "is_output_embedding", False)
        if vocab and p.shape[0] > wrapper.tp.full[0]:
            raise TensorParallelError(
                f"{name}: the fine-tune adds {p.shape[0] - wrapper.tp.full[0]} tokens to the vocabulary, for which "
                "the base's tensor-parallel embedding and LM head have no rows; load the base without tp_plan "
                "(device_map='auto') for this delta"
            )
        return wrapper.tp.take(p)

    @staticmethod
    def _shard_param(name: str, wrapper: DeltaModule, attr: str, t):
        tp = wrapper.tp
        if isinstance(wrapper, DeltaLinear) and attr == "bias" and tp.mode != "whole" and not tp.gathers:
            return tp.take_bias(t)
        raise TensorParallelError(
            f"the delta replaces {name} outright, which is sharded by the tensor-parallel plan "
            f"({tp.style}); only packed deltas and bias changes of colwise/rowwise layers follow the "
            "plan: load the base without tp_plan (device_map='auto') for this delta"
        )

    def detach(self, slot: int, keep_room: bool = True) -> None:
        """Take slot ``slot``'s delta out of every wrapper (with ``keep_room``, its stack room stays)."""
        self._copies = None
        for _, mod in list(self.wrappers()):
            if slot in mod.slots():
                mod.remove_slot(slot, keep_room=keep_room)

    def gather(self, slot: int):
        """A placed delta's packed modules and parameters, as the wrappers hold them."""
        modules, params = {}, {}
        output = self.special_names().get("output")
        for name, mod in self.wrappers():
            if slot in mod.packed and not (name == output and isinstance(mod, DeltaLinear)
                                           and mod.packed[slot].kind == "embedding"):
                modules[name] = mod.packed[slot]
            for attr, t in mod.overrides.get(slot, {}).items():
                params[f"{name}.{attr}"] = t
        return modules, params

    def set_sparse_kernels(self, on: bool) -> None:
        """Put every thresholded linear wrapper on the activation-sparse route, or take them all off it;
        layers wrapped later follow (:meth:`wrap`)."""
        self.policy.sparse = on
        self._copies = None
        for _, mod in self.wrappers():
            if isinstance(mod, DeltaLinear):
                mod.set_sparse_kernels(on and has_activation_sparsity(mod.base_layer))

    def sparse_copy_nbytes(self) -> dict:
        """``{slot: bytes}`` of the input-major copies the activation-sparse kernels keep of each slot's
        linear deltas (:meth:`set_sparse_kernels`; empty when off). Computed once per change of what is
        placed (the cache's budget checks ask for it on every admission)."""
        if not self.policy.sparse:
            return {}
        if self._copies is None:
            out: dict = {}
            for _, mod in self.wrappers():
                if isinstance(mod, DeltaLinear):
                    for slot in mod.packed:
                        out[slot] = out.get(slot, 0) + mod.sparse_copy_nbytes(slot)
            self._copies = out
        return self._copies

    def sparse_copy_estimate(self, modules: dict) -> int:
        """Bytes of input-major copies placing ``modules`` (name -> ``PackedModule`` or ``ModuleRecord``) would
        add on the activation-sparse route: the budget's share of a delta before it is read."""
        if not self.policy.sparse:
            return 0
        total = 0
        for name, rec in modules.items():
            try:
                mod = self.base_model.get_submodule(name)
            except AttributeError:
                continue
            if isinstance(mod, DeltaLinear):
                total += mod.sparse_copy_estimate(rec)
            elif (not isinstance(mod, DeltaModule) and is_linear(mod) and has_activation_sparsity(mod)
                  and can_take_sparse_route(mod, self.tp_shard(name, mod))):
                total += sparse_copy_estimate(rec, *weight_as_nk(mod).shape)  # wrapped on first use, onto the route
        return total

    def nbytes_on_device(self, slot: int) -> int:
        return sum(mod.delta_nbytes(slot) for _, mod in self.wrappers() if slot in mod.slots())

    def graph_safe(self) -> bool:
        """Whether every wrapper can run inside a captured decode step."""
        return all(mod.graph_safe() for _, mod in self.wrappers() if hasattr(mod, "graph_safe"))

    # ------------------------------------------------------------------ merging
    def merged_model(self, slot: int, header: DeltaHeader, inplace: bool) -> nn.Module:
        """The base with slot ``slot``'s delta merged in, every wrapper replaced by a plain module."""
        target = self.base_model if inplace else copy.deepcopy(self.base_model)
        for mod_name, mod in list(target.named_modules()):
            if not isinstance(mod, DeltaModule):
                continue
            merged = _merged_module(mod, slot)
            parent_name, _, child = mod_name.rpartition(".")
            parent = target.get_submodule(parent_name) if parent_name else target
            setattr(parent, child, merged)
        vocab = header.vocab_size_finetune
        if vocab and getattr(target.config, "vocab_size", None) != vocab:
            target.config.vocab_size = vocab
        if header.tied_embeddings:
            target.tie_weights()
        return target

    def merged_model_gathered(self, slot: int, header: DeltaHeader) -> nn.Module:
        """A tensor-parallel base with slot ``slot``'s delta merged in, gathered into a plain (unsharded)
        model of the same class, whole on every rank: each rank merges its shard of each weight, then the
        shards are gathered (collectives: every rank calls this)."""
        base = self.base_model
        wrappers = dict(self.wrappers())
        merged = {}
        for name, t in self.plain_params().items():
            owner, _, attr = name.rpartition(".")
            merged[name] = self._merged_whole(name, attr, t.detach(), wrappers.get(owner), slot)
        with torch.device("meta"):
            target = type(base)(copy.deepcopy(base.config))
        target.load_state_dict(merged, strict=False, assign=True)
        for mname, mod in target.named_modules():  # buffers and tensor attributes (rotary tables): the base's
            src = self.find(mname) if mname else base
            src = src.base_layer if isinstance(src, DeltaModule) else src
            for attr, value in list(mod.named_buffers(recurse=False)) + list(vars(mod).items()):
                if torch.is_tensor(value) and value.device.type == "meta" and torch.is_tensor(getattr(src, attr, None)):
                    setattr(mod, attr, getattr(src, attr).detach().clone())
        if header.tied_embeddings or getattr(target.config, "tie_word_embeddings", False):
            target.tie_weights()
        left = [n for n, t in list(target.named_parameters()) + list(target.named_buffers()) if t.device.type == "meta"]
        if left:
            raise TensorParallelError(f"merging the tensor-parallel base left {left} unset; merge on a base loaded "
                                      "without tp_plan instead")
        target.generation_config = copy.deepcopy(base.generation_config)
        return target.eval()

    def _merged_whole(self, name: str, attr: str, t: torch.Tensor, mod: Optional[DeltaModule], slot: int):
        """Parameter ``name`` of the merged model, whole (the delta's change added to this rank's shard,
        then the shards gathered)."""
        ov = mod.overrides.get(slot, {}) if mod is not None else {}
        p = mod.packed.get(slot) if mod is not None and attr == "weight" else None
        tp = mod.tp if mod is not None else None
        if tp is not None and tp.mode != "whole":
            local = ov.get(attr, local_tensor(t))  # a bias override is this rank's part already
            if p is not None:
                local = (local.float() + p.dequantize().to(local.device)).to(t.dtype)
            if attr == "bias" and tp.mode == "columns":
                return local.to(t.dtype).clone()  # a row-parallel layer's bias is replicated
            dim = 0 if tp.mode == "rows" or attr == "bias" else 1
            return tp.gather(local.to(t.dtype), dim, tp.full[dim])
        if attr in ov:
            return ov[attr].to(t.dtype).clone()
        whole = full_tensor(self.base_model, name, t)
        return whole.clone() if p is None else base_plus_delta(whole, p, t.dtype)


def _plain(name: str) -> str:
    return name.replace(".base_layer", "")


def _merged_module(mod: DeltaModule, slot: int) -> nn.Module:
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
