"""Modules that carry deltas: each keeps the original as ``base_layer`` and adds per-row delta paths.

Every loaded fine-tune occupies a *slot* (an integer). A forward pass reads, from the model's
:class:`~.routing.Router`, the current :class:`~.routing.BatchRouting` (which slot each batch row uses,
-1 = the plain base) and computes each row as that row's merged fine-tune would:

* :class:`DeltaLinear` (``nn.Linear`` / ``Conv1D``, LM head included): ``x W_u^T + b_u`` with
  ``W_u = W_base + dequant(delta_u)`` built on the fly for the rows of slot ``u`` (CPU, the reference),
  or the multi-delta Triton kernel (CUDA: one launch for every delta of a format class in the batch).
* :class:`DeltaEmbedding`: base rows plus the dequantized delta rows of the looked-up tokens.
* :class:`DeltaOverride`: any other module whose parameters a fine-tune changed (norms, position
  embeddings): the module runs with that fine-tune's parameters on that fine-tune's rows.

No 16-bit copy of a delta is kept: deltas stay packed on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..delta import PackedModule
from ..errors import DeltaZipError
from ..packing import dequantize, unpack_codes
from ..quantization import dequantize_module_weight, logical_weight_shape
from .activation_sparsity import add_sparsity_correction, base_sees_whole_input, kernel_sparsity, sparsify_module_input
from .arch import conv1d_class
from .quantized import base_runs_itself, unhooked
from .routing import BASE_SLOT, KernelPolicy, LayoutVersion, Router
from .tensor_parallel import TPShard, local_tensor


def _index(router: Router, rows: list, device) -> torch.Tensor:
    """Batch rows ``rows`` as a long tensor on ``device``: made once per batch and copied without waiting
    for the device (``BatchRouting.token_rows``), where every layer used to copy them again."""
    return router.current.token_rows(tuple(rows), 1, device)


def _groups(slots: list) -> dict:
    out: dict = {}
    for i, s in enumerate(slots):
        out.setdefault(s, []).append(i)
    return out


def base_plus_delta(w_nk: torch.Tensor, packed: PackedModule, dtype) -> torch.Tensor:
    """``W_base + dequant(delta)`` in float32, cast to ``dtype``; rows the fine-tune added start from 0."""
    wf = w_nk.float()
    if packed.shape[0] > wf.shape[0]:
        wf = torch.cat([wf, wf.new_zeros(packed.shape[0] - wf.shape[0], wf.shape[1])])
    return (wf + packed.dequantize().to(wf.device)).to(dtype)


class DeltaModule(nn.Module):
    """Base class of the delta-carrying wrappers: the original module as ``base_layer``, plus per-slot
    packed deltas (``packed``) and replaced parameters (``overrides``).

    Args:
        base_layer: the module wrapped.
        router: where the current batch's routing is read.
        layout: bumped when this module's device tensors are replaced.
        policy: whether to run the Triton kernels, and the room kernel stacks keep.
    """

    def __init__(self, base_layer: nn.Module, router: Router, layout: LayoutVersion, policy: KernelPolicy):
        super().__init__()
        self.base_layer = base_layer
        self.router = router
        self.layout = layout
        self.policy = policy
        self.packed: dict[int, PackedModule] = {}
        self.overrides: dict[int, dict] = {}  # slot -> {param rel name: tensor}
        self.names: dict[int, str] = {}  # slot -> delta name, for display
        self.tp: Optional[TPShard] = None  # how this rank's shard of each delta is cut (tensor-parallel base)

    def slots(self) -> set:
        return set(self.packed) | set(self.overrides)

    def remove_slot(self, slot: int, keep_room: bool = True) -> None:
        self.names.pop(slot, None)
        self.packed.pop(slot, None)
        self.overrides.pop(slot, None)
        self._changed()

    def can_write_in_place(self, slot: int, packed: PackedModule) -> bool:
        """Whether ``add_packed(slot, packed)`` would only write into room kept for it (no new tensors)."""
        return False

    def can_override_in_place(self, slot: int, name: str, value: torch.Tensor) -> bool:
        """Whether ``add_override(slot, name, value)`` would only write into a per-slot table row."""
        return False

    def _changed(self) -> None:
        self.layout.bump()

    def extra_repr(self) -> str:
        parts = []
        for slot in sorted(self.slots()):
            name = self.names.get(slot, f"slot {slot}")
            p = self.packed.get(slot)
            if p is not None:
                sp = "" if p.sparsity == "dense" else f", {p.sparsity}"
                parts.append(f"{name}: {p.bits}-bit{sp}")
            else:
                parts.append(f"{name}: {', '.join(sorted(self.overrides.get(slot, {})))}")
        return "deltas={" + "; ".join(parts) + "}"

    def add_packed(self, slot: int, packed: PackedModule) -> None:
        self.packed[slot] = packed
        self._changed()

    def add_override(self, slot: int, name: str, value: torch.Tensor) -> None:
        self.overrides.setdefault(slot, {})[name] = value
        self._changed()

    def delta_nbytes(self, slot: int) -> int:
        n = self.packed[slot].nbytes if slot in self.packed else 0
        return n + sum(t.numel() * t.element_size() for t in self.overrides.get(slot, {}).values())

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for slot, p in self.packed.items():
            self.packed[slot] = map_packed(p, fn)
        for slot, ov in self.overrides.items():
            self.overrides[slot] = {k: fn(v) for k, v in ov.items()}
        self._changed()
        return out


def map_packed(p: PackedModule, fn) -> PackedModule:
    if isinstance(p, StackedPacked):  # codes in a kernel stack: take them out in the file layout first
        p = p.to_packed()
    # .to(device) must move the packed tensors but never cast them (they are codes, not weights)
    def move(t):
        if t is None:
            return None
        moved = fn(t)
        return moved if moved.dtype == t.dtype else t.to(moved.device)

    return PackedModule(
        kind=p.kind, shape=p.shape, bits=p.bits, group_size=p.group_size, symmetric=p.symmetric,
        sparsity=p.sparsity, transposed=p.transposed, qweight=move(p.qweight), scales=move(p.scales),
        zeros=move(p.zeros), positions=move(p.positions), mask=move(p.mask), nnz=p.nnz,
    )


def can_take_sparse_route(base_layer: nn.Module, tp=None) -> bool:
    """Whether a linear layer can run decode steps through the activation-sparse kernels: a plain float
    weight it does not compute through itself (not bitsandbytes, offloaded or tensor-parallel)."""
    w = getattr(base_layer, "weight", None)
    return (tp is None and not base_runs_itself(base_layer) and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype in (torch.float16, torch.bfloat16, torch.float32))


def sparse_copy_estimate(module, out_features: int, in_features: int) -> int:
    """Bytes the activation-sparse route's input-major copy of a linear delta ``module`` (a ``PackedModule``
    or ``ModuleRecord``) takes in a layer of ``out_features x in_features`` (0 for a module that gets none:
    an embedding delta, a changed shape, 3 bits)."""
    from ..kernels.act_sparse import input_major_nbytes

    if module.kind != "linear" or tuple(module.shape) != (out_features, in_features):
        return 0
    return input_major_nbytes(out_features, in_features, module.bits, module.group_size)


class DeltaLinear(DeltaModule):
    """A linear layer (``nn.Linear`` or transformers' ``Conv1D``) plus the packed deltas of every slot.

    Over a bitsandbytes layer (4-bit, 8-bit) or one run through an accelerate hook (device maps, CPU or
    disk offload), the base computes itself (``base_layer(x)``) and each row's delta is added on top:
    by the multi-delta kernel with an all-zero base (CUDA), or ``x · dequant(Δ)ᵀ`` per delta (CPU).
    """

    def __init__(self, base_layer: nn.Module, router: Router, layout: LayoutVersion, policy: KernelPolicy, *,
                 is_output_embedding: bool = False, tp: Optional[TPShard] = None):
        super().__init__(base_layer, router, layout, policy)
        self.tp = tp
        c = conv1d_class()
        self.transposed = c is not None and isinstance(base_layer, c)
        self.is_output_embedding = is_output_embedding
        self.stacks = None  # kernels.SlotStacks: the kernel-side copy of the packed deltas
        self._bias_delta = None
        self._sparse = False  # decode steps through the activation-sparse kernels (set_sparse_kernels)
        # centred thresholds on the sparse route: (the centre it was made for, [table_size, out] float32 whose row
        # slot + 1 is that slot's delta times the centre), made on first use and kept in step with loads
        self._centre_delta = None
        self._changed()

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    @property
    def in_features(self) -> int:
        if self.tp is not None:  # the whole layer's, not this rank's shard
            return self.tp.full[1]
        shape = logical_weight_shape(self.base_layer)  # a 4-bit weight holds packed bytes
        if shape is not None:
            return shape[1]
        w = self.base_layer.weight
        return w.shape[0] if self.transposed else w.shape[1]

    @property
    def out_features(self) -> int:
        if self.tp is not None:
            return self.tp.full[0]
        shape = logical_weight_shape(self.base_layer)
        if shape is not None:
            return shape[0]
        w = self.base_layer.weight
        return w.shape[1] if self.transposed else w.shape[0]

    def _changed(self) -> None:
        """A change the kernel stacks cannot absorb in place: rebuild them (now on CUDA, else lazily)."""
        self.stacks = None
        self._centre_delta = None
        self._refresh()
        self.layout.bump()
        if self._kernel_route and self.packed:
            device = self.base_layer.weight.device
            if device.type != "meta" and self.policy.wants_kernels(device):
                self._build_stacks(device)

    def _refresh(self) -> None:
        self._through = base_runs_itself(self.base_layer) or self.tp is not None  # TP: its forward communicates
        self._slot_set = self.slots()
        self._width = max([self.out_features] + [p.shape[0] for p in self.packed.values()])
        only_bias = all(set(ov) <= {"bias"} for ov in self.overrides.values())
        self._kernel_route = ((bool(self.packed) or self.stacks is not None) and only_bias and self.tp is None
                              and self._kernel_ok())

    def add_packed(self, slot: int, packed: PackedModule) -> None:
        if self.stacks is not None and slot not in self.packed and self._write_in_place(slot, packed):
            # written into room the stacks kept, with this layer's output rows: the route, width and kernel
            # check _refresh derives stay as they were; only the set of slots grows (staging a delta ahead
            # calls this for every layer between decode steps, so it is kept to what changes)
            self._slot_set = self._slot_set | {slot}
            self._centre_row(slot)
            return
        self.packed[slot] = packed
        self._changed()

    def remove_slot(self, slot: int, keep_room: bool = True) -> None:
        """Drop a slot's delta. With ``keep_room`` (evictions) its place in the stack stays allocated
        for the next delta, and tensors a captured decode step reads stay alive."""
        ov = self.overrides.get(slot, {})
        in_place = self.stacks is not None and set(ov) <= {"bias"} and (not ov or self._bias_delta is not None)
        if in_place and (slot in self.packed or ov):
            self.names.pop(slot, None)
            self.stacks.remove(slot)  # the graph-visible tables change in place
            self.packed.pop(slot, None)
            if self.overrides.pop(slot, None):
                self._bias_delta[slot + 1].zero_()
            self._centre_row(slot)
            self._refresh()
            if not self.packed and not keep_room:
                self.stacks = None
                self.layout.bump()
            return
        super().remove_slot(slot)

    def can_override_in_place(self, slot: int, name: str, value: torch.Tensor) -> bool:
        return (name == "bias" and self.stacks is not None and self._bias_delta is not None
                and slot + 1 < self._bias_delta.shape[0] and tuple(value.shape) == (self.out_features,))

    def add_override(self, slot: int, name: str, value: torch.Tensor) -> None:
        if self.can_override_in_place(slot, name, value):
            self.overrides.setdefault(slot, {})[name] = value
            self._bias_delta[slot + 1].copy_(self._bias_row(value))
            self._refresh()
            return
        super().add_override(slot, name, value)

    def _bias_row(self, value: torch.Tensor) -> torch.Tensor:
        base_b = self.base_layer.bias
        b0 = local_tensor(base_b.detach()).float().to(value.device) if base_b is not None else 0.0
        return value.detach().float() - b0

    def can_write_in_place(self, slot: int, packed: PackedModule) -> bool:
        """Whether ``add_packed(slot, packed)`` would only write into free room of an existing stack."""
        if self.stacks is None or slot in self.packed or packed.shape[1] != self.in_features:
            return False
        key = (packed.bits, packed.group_size, "2:4" if packed.sparsity == "2:4" else "dense")
        return self.stacks.place_for(slot, key, packed.shape[0], packed.scales.dtype) is not None

    def _write_in_place(self, slot: int, packed: PackedModule) -> bool:
        if packed.shape[1] != self.in_features:
            return False
        p = packed.to_dense_layout()
        where = self.stacks.write(slot, _fields(p))
        if where is None:
            return False
        self.packed[slot] = StackedPacked.of(p, self.stacks, slot)
        return True

    def out_width(self) -> int:
        return self._width

    def base_weight_nk(self) -> torch.Tensor:
        if logical_weight_shape(self.base_layer) is not None:  # bitsandbytes: what it computes with
            return dequantize_module_weight(self.base_layer)
        w = self.base_layer.weight
        return w.t() if self.transposed else w

    def merged_weight(self, slot: int, dtype=None) -> torch.Tensor:
        """``W_base + dequant(delta)`` as ``[N, K]`` (the merged fine-tune's weight)."""
        w = self.base_weight_nk()
        dtype = dtype or w.dtype
        if "weight" in self.overrides.get(slot, {}):
            ov = self.overrides[slot]["weight"]
            return (ov.t() if self.transposed else ov).to(dtype)
        p = self.packed.get(slot)
        return w.to(dtype) if p is None else base_plus_delta(w, p, dtype)

    def merged_bias(self, slot: int) -> Optional[torch.Tensor]:
        ov = self.overrides.get(slot, {})
        if "bias" in ov:
            return ov["bias"]
        b = self.base_layer.bias
        p = self.packed.get(slot)
        if b is not None and p is not None and p.shape[0] > b.shape[0]:
            b = torch.cat([b, b.new_zeros(p.shape[0] - b.shape[0])])
        return b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._sparse:  # a decode step through the activation-sparse kernels
            y = self._forward_sparse(x)
            if y is not None:
                return y
        xs = sparsify_module_input(self.base_layer, x)  # activation sparsity (off unless installed)
        if xs is x:
            return self._forward(x)
        if self.tp is None and base_sees_whole_input(self.base_layer, x):
            # a decode step of many rows: the base multiplies the whole input, the deltas the thresholded one
            if not self.packed and not self.overrides and self.stacks is None:
                return self._forward(x)
            return add_sparsity_correction(self.base_layer, x, xs, self._forward(xs), self.base_weight_nk)
        return add_sparsity_correction(self.base_layer, x, xs, self._forward(xs))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed and not self.overrides and self.stacks is None:
            return self.base_layer(x)
        routing = self.router.current
        # a decode step being captured: no host-side decisions. Stacks kept with room but (for now) no
        # delta still take the kernel route: a delta written into them later must reach a captured step.
        if routing.is_static:
            if not self._kernel_route:
                raise DeltaZipError(f"this layer's deltas cannot run in a captured decode step ({self._why_not()})")
            return self._forward_kernel(x, routing.device_rows.shape[0], routing)
        batch = x.shape[0] if x.dim() > 1 else 1
        slots = routing.rows_for(batch)
        if self._slot_set.isdisjoint(slots):
            y = self.base_layer(x)
            return self._pad_out(y) if self._width != self.out_features else y
        if self.policy.wants_kernels(x.device) and self._kernel_route and x.dim() >= 2:
            return self._forward_kernel(x, batch, routing, slots)
        if self.tp is not None and self.tp.mode != "whole":
            return self._forward_sharded(x, slots)
        if self._through:
            return self._forward_base_then_deltas(x, slots)
        return self._forward_reference(x, slots)

    def _forward_base_then_deltas(self, x: torch.Tensor, slots: list) -> torch.Tensor:
        """The base through its own module once for the batch (bitsandbytes, an accelerate hook), then
        each slot's rows plus ``x · dequant(Δ)ᵀ`` (and its bias change)."""
        y = self.base_layer(x)
        out = self._pad_out(y) if self._width != self.out_features else y.clone()
        n = self.out_features
        for slot, rows in _groups(slots).items():
            ov = self.overrides.get(slot, {})
            p = self.packed.get(slot)
            if p is None and not ov:
                continue
            idx = _index(self.router, rows, x.device)
            xr = x.index_select(0, idx)
            if "weight" in ov:  # replaced outright: the base is not needed
                yr = F.linear(xr, self.merged_weight(slot, x.dtype), _cast(self.merged_bias(slot), x.dtype))
            else:
                width = p.shape[0] if p is not None else n
                yr = y.new_zeros((*xr.shape[:-1], width))
                yr[..., :n] = y.index_select(0, idx)
                if p is not None:
                    yr = yr + F.linear(xr, p.dequantize().to(device=x.device, dtype=x.dtype))
                if "bias" in ov:
                    yr[..., :n] += self._bias_row(ov["bias"].to(x.device)).to(yr.dtype)
            out[idx, ..., : yr.shape[-1]] = yr
        return out

    def _forward_sharded(self, x: torch.Tensor, slots: list) -> torch.Tensor:
        """A tensor-parallel layer (see :mod:`.tensor_parallel`): this rank's base shard plus each row's delta
        shard. A row-parallel ``nn.Linear`` at inference sums the base's and the deltas' partial outputs in
        one all-reduce (what the base's own forward would do for the base alone), then adds the bias; any
        other layer runs the base's own forward (which communicates) and a row-parallel delta's partial
        output gets an all-reduce of its own. Every rank takes the same collectives: they route the same batch."""
        fused = self.tp.reduces and type(self.base_layer) is nn.Linear and not torch.is_grad_enabled()
        y = F.linear(x, local_tensor(self.base_layer.weight)) if fused else self.base_layer(x)
        groups = _groups(slots)
        delta = None
        for slot, rows in groups.items():
            p = self.packed.get(slot)
            if p is None:
                continue
            idx = _index(self.router, rows, x.device)
            part = F.linear(x.index_select(0, idx), p.dequantize().to(device=x.device, dtype=x.dtype))
            if delta is None:
                delta = y if fused else y.new_zeros((*y.shape[:-1], part.shape[-1]))
            delta.index_add_(0, idx, part)
        if fused:
            y = self.tp.reduce(y)
            if self.base_layer.bias is not None:
                y = y + local_tensor(self.base_layer.bias)  # replicated: added once, after the sum
        elif delta is not None:
            if self.tp.gathers:  # the base gathered its output columns: gather the delta's too
                delta = self.tp.gather(delta, -1, self.tp.full[0])
            y = y + (self.tp.reduce(delta) if self.tp.reduces else delta)
        for slot, rows in groups.items():
            b = self.overrides.get(slot, {}).get("bias")
            if b is not None:  # this rank's part of (b_u - b_base), added once, after the sum
                idx = _index(self.router, rows, y.device)
                y[idx] = y[idx] + self._bias_row(b.to(x.device)).to(y.dtype)
        return y

    def _pad_out(self, y):
        width = self._width
        out = y.new_full((*y.shape[:-1], width), float("-inf") if self.is_output_embedding else 0.0)
        out[..., : y.shape[-1]] = y
        return out

    def _forward_reference(self, x: torch.Tensor, slots: list) -> torch.Tensor:
        width = self.out_width()
        out = None
        for slot, rows in _groups(slots).items():
            idx = _index(self.router, rows, x.device)
            xr = x.index_select(0, idx)
            if slot in self.packed or slot in self.overrides:
                y = F.linear(xr, self.merged_weight(slot, x.dtype), _cast(self.merged_bias(slot), x.dtype))
            else:
                y = self.base_layer(xr)
            if out is None:
                fill = float("-inf") if self.is_output_embedding else 0.0
                out = y.new_full((x.shape[0], *y.shape[1:-1], width), fill)
            out[idx, ..., : y.shape[-1]] = y
        return out

    # -- kernel path (CUDA; or the Triton interpreter when use_kernels="always")
    def graph_safe(self) -> bool:
        """Whether a captured decode step can run this layer (no deltas, or all on the kernel route over a
        plain base: bitsandbytes layers and accelerate hooks are not known to be capturable)."""
        return not (self.packed or self.overrides) or (self._kernel_route and not self._through)

    def _why_not(self) -> str:
        if any(set(ov) - {"bias"} for ov in self.overrides.values()):
            return "a fine-tune replaces its weight outright"
        if any(p.shape[0] != self.out_features for p in self.packed.values()):
            return "a fine-tune adds output rows (tokens)"
        return "the Triton kernels are not available"

    def _kernel_ok(self) -> bool:
        from ..kernels import kernels_available

        return kernels_available() and all(p.shape[0] == self.out_features for p in self.packed.values())

    def _build_stacks(self, device):
        """The kernel stacks of this layer's deltas, with room for the policy's capacity (the cache's
        ``max_resident``) so later loads and evictions change tables in place (see ``kernels.slot_stacks``)."""
        from ..kernels import SlotStacks

        dense = {slot: p.to_dense_layout() for slot, p in sorted(self.packed.items())}
        stacks = SlotStacks([(slot, _fields(p)) for slot, p in dense.items()], self.in_features, self.out_features,
                            device, capacity=self.policy.capacity)
        for slot, p in dense.items():
            self.packed[slot] = StackedPacked.of(p, stacks, slot)
        self._bias_delta = None
        if self.overrides:  # fine-tunes that changed the bias: add (b_u - b_base) to their rows
            table = torch.zeros(stacks.table_size, self.out_features, dtype=torch.float32, device=device)
            for slot, ov in self.overrides.items():
                if "bias" in ov:
                    table[slot + 1] = self._bias_row(ov["bias"].to(device))
            self._bias_delta = table
        if self._sparse:
            stacks.enable_input_major()
        self.stacks = stacks
        return stacks

    def _forward_kernel(self, x: torch.Tensor, batch: int, routing, slots: Optional[list] = None) -> torch.Tensor:
        """The kernel route; ``slots``: the rows' slots when routing is on the host (not in a captured step)."""
        stacks = self.stacks if self.stacks is not None else self._build_stacks(x.device)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        slot_tok, segments = routing.kernel_rows(batch, x2.shape[0] // batch, x.device)  # shared by every layer
        # rows per distinct delta (the base counted as one), known on the host outside captured steps:
        # a prefill's many rows share few deltas, and the kernel then takes larger row blocks (fewer
        # passes over the weights)
        groups = None if slots is None else _groups(slots)
        share = None if groups is None else -(-x2.shape[0] // len(groups))
        held, per_row = {}, x2.shape[0] // batch
        if groups is not None and self.policy.prefill == "dequant" and self._width == self.out_features:
            in_stacks = stacks.slots
            held = {s: rows for s, rows in groups.items() if s in in_stacks}  # batch rows of each delta here
        if held and self.policy.wants_dequant(per_row * min(len(r) for r in held.values())):
            y = self._forward_dequant(x2, per_row, held, stacks, routing)
        elif self._through or self._base_input_major() or (groups is not None
                               and self.policy.wants_split(per_row * min(len(r) for r in groups.values()), x2.shape[0])
                               and self._width == self.out_features):
            # the base by its own module (it must compute itself), or, on the split route, by one dense matmul
            # that reads its weight once for all rows (the fused kernel reads it once per block of rows); the
            # deltas added to its output by the kernel
            y = self.base_layer(x2) if self._through else F.linear(x2, self._kernel_weight(), self.base_layer.bias)
            y = stacks.accumulate(x2, y.contiguous(), slot_tok, segments, share)
        elif (self._width == self.out_features and self.policy.wants_decode_split(
                x2.shape[0], None if groups is None else sum(1 for s in groups if s != BASE_SLOT), x.device)):
            # the split route of KernelPolicy.decode: the base's product by one dense matmul (its weight read
            # once for every row), each row's delta added into it by the kernel, which skips the base
            y = stacks.accumulate(x2, F.linear(x2, self._kernel_weight(), self.base_layer.bias), slot_tok, segments,
                                  share)
        else:
            y = stacks.apply(x2, self._kernel_weight(), self.base_layer.bias, slot_tok, segments, share)
        if self._bias_delta is not None:
            y = (y.float() + self._bias_delta[slot_tok]).to(y.dtype)
        return y.reshape(*lead, y.shape[-1])

    # -- activation-sparse decode steps (DeltaModel.set_activation_sparsity(..., kernels=...))
    def set_sparse_kernels(self, on: bool) -> bool:
        """Run decode steps (one token per row, at most ``SPARSE_BASE_MAX_ROWS`` rows) whose inputs this
        layer's installed thresholds sparsify through the activation-sparse kernels: the base by
        ``sparse_base_linear`` (threshold and compensation inside the kernel), each row's delta by
        ``sparse_delta_linear`` (the stacks then keep a second, input-major copy of every delta; with a
        3-bit delta, which has none, by the multi-delta kernel on the thresholded input). An ``nn.Linear``
        base's weight is re-laid out input-major in place (``weight`` becomes a transposed view of a
        ``[K, N]`` tensor: no memory, the same values, dense matmuls read it at full speed); ``on=False``
        lays it back out. Returns whether the layer takes the route (not over bitsandbytes / offloaded /
        tensor-parallel layers, nor a non-float weight)."""
        w = getattr(self.base_layer, "weight", None)
        if not (on and can_take_sparse_route(self.base_layer, self.tp)):
            if self._sparse or self._base_input_major():
                self._sparse = False
                if self.stacks is not None:
                    self.stacks.disable_input_major()
                if self._base_input_major():
                    w.data = w.data.contiguous()  # back to row-major [N, K]
                self.layout.bump()  # captured steps read the old storage
            return False
        if not self._sparse:
            self.layout.bump()  # captured steps took the other route
        self._sparse = True
        kernel_sparsity(self.base_layer, w)  # the compensation's kernel factors made now, not in a captured step
        if not self.transposed and w.is_contiguous():
            w.data = w.data.t().contiguous().t()  # [K, N] storage; the old copy is freed
            self.layout.bump()
        if self.stacks is not None:
            self.stacks.enable_input_major()
        return True

    def sparse_copy_nbytes(self, slot: int) -> int:
        """Device bytes of the input-major copy the activation-sparse route keeps of ``slot``'s delta, or will
        keep once the kernel stacks are built (0: none; see :meth:`set_sparse_kernels`)."""
        if not self._sparse or slot not in self.packed:
            return 0
        if self.stacks is not None and slot in self.stacks.slots:
            return self.stacks.input_major_nbytes(slot)
        return sparse_copy_estimate(self.packed[slot], self.out_features, self.in_features)

    def sparse_copy_estimate(self, module) -> int:
        """Bytes of the input-major copy a delta module placed here now would get (``module``: a
        ``PackedModule`` or the file's ``ModuleRecord``; 0 when the layer is off the sparse route)."""
        return sparse_copy_estimate(module, self.out_features, self.in_features) if self._sparse else 0

    def _base_input_major(self) -> bool:
        """Whether an ``nn.Linear`` base's weight is held input-major (:meth:`set_sparse_kernels`)."""
        w = getattr(self.base_layer, "weight", None)
        return (not self.transposed and isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_contiguous()
                and w.t().is_contiguous())

    def _weight_t(self) -> Optional[torch.Tensor]:
        w = self.base_layer.weight
        wt = w if self.transposed else w.t()
        return wt if wt.is_contiguous() else None

    def _forward_sparse(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A decode step through the activation-sparse kernels, or ``None`` where they do not apply (the
        ordinary route then runs: prefill, more rows, no thresholds installed, a delta that changes the
        layer's shape or replaces its weight)."""
        from ..kernels.act_sparse import SPARSE_BASE_MAX_ROWS, sparse_base_linear, sparsify_input

        k = x.shape[-1]
        if x.dim() < 2 or (x.dim() >= 3 and x.shape[-2] != 1) or k == 0:
            return None
        rows = x.numel() // k
        if not 1 <= rows <= SPARSE_BASE_MAX_ROWS or not self.policy.wants_kernels(x.device):
            return None
        if (self.packed or self.overrides) and not self._kernel_route:
            return None
        wt = self._weight_t()
        if wt is None or wt.dtype != x.dtype or wt.device != x.device:
            return None
        spec = kernel_sparsity(self.base_layer, x)
        if spec is None:
            return None
        threshold, lowrank, centre = spec
        bias = self.base_layer.bias
        lead = x.shape[:-1]
        x2 = x.reshape(rows, k)
        bias = None if bias is None else bias.to(x.dtype)
        # centred thresholds: the kernels threshold x - mu (a dropped input stands at mu), and the layer adds
        # W mu, each row's delta D mu
        xk = x2 if centre is None else x2 - centre[0]
        if base_sees_whole_input(self.base_layer, x):  # many rows: their kept inputs cover almost every column
            y = F.linear(x2, wt.t(), bias)
        else:
            y = sparse_base_linear(xk, wt, bias if centre is None else centre[1], threshold=threshold, lowrank=lowrank)
        if not self.packed and not self.overrides and self.stacks is None:
            return y.reshape(*lead, y.shape[-1])
        routing = self.router.current
        share = slots = None
        if routing.is_static:
            batch = routing.device_rows.shape[0]
        else:
            batch = x.shape[0]
            slots = routing.rows_for(batch)
            if self._slot_set.isdisjoint(slots):
                return y.reshape(*lead, y.shape[-1])
            share = -(-rows // len(_groups(slots)))
        stacks = self.stacks if self.stacks is not None else self._build_stacks(x.device)
        slot_tok, segments = routing.kernel_rows(batch, rows // batch, x.device)
        if stacks.input_major_ready:
            stacks.add_sparse_deltas(xk, y, segments, threshold, None if slots is None else set(slots))
        else:  # the multi-delta kernel on the thresholded input, adding the deltas alone to the base's product
            y = stacks.accumulate(sparsify_input(xk, threshold), y.contiguous(), slot_tok, segments, share)
        if self._bias_delta is not None:
            y = (y.float() + self._bias_delta[slot_tok]).to(y.dtype)
        if centre is not None:
            y = (y.float() + self._centre_rows(stacks, centre[0])[slot_tok]).to(y.dtype)
        return y.reshape(*lead, y.shape[-1])

    def _centre_rows(self, stacks, mu: torch.Tensor) -> torch.Tensor:
        """``[table_size, out]`` float32: row ``slot + 1`` is ``delta(slot) @ mu`` for every slot the stacks hold (0
        for the base and free room): what a row's delta adds for the centres its thresholds drop to. Made
        once per centre (outside a captured step: the warm-up makes it); loads and evictions rewrite a row."""
        held = self._centre_delta
        if held is None or held[0] is not mu or held[1].shape[0] != stacks.table_size:
            table = torch.zeros(stacks.table_size, self.out_features, dtype=torch.float32, device=mu.device)
            self._centre_delta = held = (mu, table)
            for slot in stacks.slots:
                self._centre_row(slot)
        return held[1]

    def _centre_row(self, slot: int) -> None:
        if self._centre_delta is None or self.stacks is None:
            return
        mu, table = self._centre_delta
        if slot in self.stacks.slots:
            table[slot + 1] = self.stacks.dense_delta(slot, torch.float32) @ mu.float()
        else:
            table[slot + 1].zero_()

    def _kernel_weight(self) -> torch.Tensor:
        """The base weight as ``[N, K]`` rows the kernels and the dense route read."""
        if self.transposed:
            return self._contiguous_weight(self.base_weight_nk())
        # a layer that is not run through its own module is no bitsandbytes layer (base_runs_itself):
        # its weight is what the kernel reads, without base_weight_nk's check (once per layer and call)
        return self.base_layer.weight if not self._through else self.base_weight_nk()

    def _forward_dequant(self, x2, per_row: int, held: dict, stacks, routing) -> torch.Tensor:
        """The dequant route (``DeltaModel.configure_kernels(prefill="dequant")``): the base for all rows in
        one dense matmul, then the deltas written out dense (one launch per chunk of deltas of one format,
        :meth:`~hf_deltazip.kernels.SlotStacks.dense_delta_chunks`) and each chunk's rows through one batched
        matmul ``x_rows @ dequant(delta)^T``, added to its rows (bias changes are the caller's). ``held``:
        slot -> batch rows, for the slots the stacks hold; ``per_row``: rows of ``x2`` per batch row;
        ``routing``: the batch's routing (it keeps the index tensors on the device for every layer)."""
        y = self.base_layer(x2) if self._through else F.linear(x2, self._kernel_weight(), self.base_layer.bias)
        device = x2.device
        for part, dense in stacks.dense_delta_chunks(list(held), x2.dtype, lambda t: routing.int32_on(t, device)):
            gather, keep, rows = routing.gather_plan(tuple(tuple(held[s]) for s in part), per_row, device)
            xs = x2.index_select(0, gather).view(len(part), -1, x2.shape[-1])
            prod = torch.bmm(xs, dense.transpose(1, 2)).reshape(-1, dense.shape[1])
            if keep is not None:
                prod = prod.index_select(0, keep)
            y.index_add_(0, rows, prod.to(y.dtype))
        return y

    def _contiguous_weight(self, w):
        # Conv1D stores [K, N]; the kernel reads [N, K] rows: keep one transposed copy per weight version
        key = (w.data_ptr(), w._version)
        if getattr(self, "_wt_key", None) != key:
            self._wt = w.contiguous()
            self._wt_key = key
        return self._wt


def _fields(p: PackedModule):
    """A delta's tensors as a stack write takes them: the file layout (read back from an old stack
    when the delta already sits in one, as it does when stacks are rebuilt)."""
    from ..kernels import PackedFields

    if isinstance(p, StackedPacked):
        p = p.to_packed()

    return PackedFields(qweight=p.qweight, scales=p.scales, zeros=p.zeros, positions=p.positions,
                        bits=p.bits, group_size=p.group_size, sparsity=p.sparsity)


@dataclasses.dataclass(repr=False)
class StackedPacked(PackedModule):
    """A delta placed in a layer's kernel stacks (its only device copy).

    The fields describe it in the file layout; the codes live in the stack, possibly in the kernel's
    own layout (planar, 2:4 densified), so they are read back through the stacks: ``dense_codes()``,
    ``tensors()`` (file layout, for saving and evicting) and ``nbytes`` (what the stack holds).
    """

    stacks: object = None
    slot: int = -1

    @classmethod
    def of(cls, p: PackedModule, stacks, slot: int) -> "StackedPacked":
        """``p`` (dense layout) as written into ``stacks`` under ``slot``; its tensor fields are the raw
        stack views (read them through :meth:`tensors`)."""
        c, i = stacks.where(slot)
        st = c.stack
        sparsity = "dense" if c.fmt.densify else p.sparsity  # a densified 2:4 delta holds dense codes
        return cls(kind=p.kind, shape=p.shape, bits=p.bits, group_size=p.group_size, symmetric=p.symmetric,
                   sparsity=sparsity, transposed=p.transposed, qweight=st.qweight[i], scales=st.scales[i],
                   zeros=st.zeros[i], positions=None if st.positions is None else st.positions[i],
                   stacks=stacks, slot=slot)

    def dense_codes(self) -> torch.Tensor:
        return self.stacks.codes(self.slot)

    def tensors(self) -> dict:
        f = self.stacks.file_fields(self.slot)
        out = {"qweight": f.qweight, "scales": f.scales, "zeros": f.zeros}
        if f.positions is not None:
            out["positions"] = f.positions
        return out

    @property
    def nbytes(self) -> int:
        return self.stacks.delta_nbytes(self.slot)

    def to_packed(self) -> PackedModule:
        """A plain :class:`PackedModule` in the file layout (a copy where the stack's layout differs)."""
        f = self.stacks.file_fields(self.slot)
        return PackedModule(kind=self.kind, shape=self.shape, bits=self.bits, group_size=self.group_size,
                            symmetric=self.symmetric, sparsity=f.sparsity, transposed=self.transposed,
                            qweight=f.qweight, scales=f.scales, zeros=f.zeros, positions=f.positions)


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


class DeltaEmbedding(DeltaModule):
    """Input embeddings plus per-slot delta rows (fine-tunes may add tokens).

    With kernels on (CUDA), deltas of the base's vocabulary size sit in :class:`~hf_deltazip.kernels.SlotStacks`
    with room to spare, so a captured decode step gathers each row's delta rows on the device and
    deltas come and go without new tensors (no re-capture).
    """

    def __init__(self, base_layer: nn.Module, router: Router, layout: LayoutVersion, policy: KernelPolicy):
        super().__init__(base_layer, router, layout, policy)
        self.stacks = None

    def _changed(self) -> None:
        self.stacks = None
        super()._changed()
        device = self.base_layer.weight.device
        if (self.packed and device.type != "meta" and self.policy.wants_kernels(device) and self._stackable()
                and self.tp is None):
            self._build_stacks(device)

    def _fits_stack(self, packed: PackedModule) -> bool:
        return packed.sparsity != "2:4" and tuple(packed.shape) == tuple(self.base_layer.weight.shape)

    def _stackable(self) -> bool:
        return all(self._fits_stack(p) for p in self.packed.values()) and not any("weight" in ov for ov in self.overrides.values())

    def _build_stacks(self, device) -> None:
        from ..kernels import SlotStacks

        dense = {slot: p.to_dense_layout() for slot, p in sorted(self.packed.items())}
        w = self.base_layer.weight
        self.stacks = SlotStacks([(slot, _fields(p)) for slot, p in dense.items()], w.shape[1], w.shape[0], device,
                                 capacity=self.policy.capacity, kernel_layout=False)
        for slot, p in dense.items():
            self.packed[slot] = StackedPacked.of(p, self.stacks, slot)

    def can_write_in_place(self, slot: int, packed: PackedModule) -> bool:
        if self.stacks is None or slot in self.packed or not self._fits_stack(packed):
            return False
        return self.stacks.place_for(slot, (packed.bits, packed.group_size, "dense"), packed.shape[0],
                                     packed.scales.dtype) is not None

    def add_packed(self, slot: int, packed: PackedModule) -> None:
        if self.can_write_in_place(slot, packed):
            p = packed.to_dense_layout()
            where = self.stacks.write(slot, _fields(p))
            if where is not None:
                self.packed[slot] = StackedPacked.of(p, self.stacks, slot)
                return
        super().add_packed(slot, packed)

    def remove_slot(self, slot: int, keep_room: bool = True) -> None:
        if self.stacks is not None and slot in self.packed and slot not in self.overrides:
            self.names.pop(slot, None)
            self.stacks.remove(slot)
            del self.packed[slot]
            if not self.packed and not keep_room:
                self.stacks = None
                self.layout.bump()
            return
        super().remove_slot(slot, keep_room)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def num_embeddings(self) -> int:
        return self.base_layer.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.base_layer.weight.shape[1]

    def merged_weight(self, slot: int, dtype=None) -> torch.Tensor:
        w = self.base_layer.weight
        dtype = dtype or w.dtype
        if "weight" in self.overrides.get(slot, {}):
            return self.overrides[slot]["weight"].to(dtype)
        p = self.packed.get(slot)
        return w.to(dtype) if p is None else base_plus_delta(w, p, dtype)

    def graph_safe(self) -> bool:
        return self._lookup_then_scale() and all(p.sparsity == "dense" for p in self.packed.values())

    def _lookup_then_scale(self) -> bool:
        """Whether the base's forward is a row lookup, maybe times ``embed_scale`` (transformers' scaled
        word embeddings: Gemma, Gemma 2/3, ...), which the delta paths below reproduce exactly."""
        return type(self.base_layer).forward is nn.Embedding.forward or hasattr(self.base_layer, "embed_scale")

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up rows as the base's forward returns them (times its ``embed_scale``, if any)."""
        scale = getattr(self.base_layer, "embed_scale", None)
        if scale is None:
            return rows
        return rows * (scale.to(self.base_layer.weight.dtype) if torch.is_tensor(scale) else scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        routing = self.router.current
        if routing.is_static and (self.slots() or self.stacks is not None):
            return self._forward_static(ids, routing.device_rows)
        batch = ids.shape[0] if ids.dim() > 1 else 1
        slots = routing.rows_for(batch)
        if not (set(slots) & self.slots()):
            return self.base_layer(ids)
        if self.tp is not None:
            return self._forward_tp(ids, slots)
        out = None
        w = self.base_layer.weight
        for slot, rows in _groups(slots).items():
            idx = _index(self.router, rows, ids.device)
            r_ids = ids.index_select(0, idx)
            if slot not in self.packed and "weight" not in self.overrides.get(slot, {}):
                y = self.base_layer(r_ids)
            elif not self._lookup_then_scale():  # an embedding whose forward does more: run it on merged rows
                y = torch.func.functional_call(self.base_layer, {"weight": self.merged_weight(slot)}, (r_ids,))
            elif "weight" in self.overrides.get(slot, {}):
                y = self._scaled(F.embedding(r_ids, self.overrides[slot]["weight"].to(w.dtype)))
            else:
                y = self._scaled(self._lookup(slot, r_ids, routing.max_id_of(rows, batch)))
            if out is None:
                out = y.new_empty((ids.shape[0], *y.shape[1:]))
            out[idx] = y
        return out

    def _forward_tp(self, ids: torch.Tensor, slots: list) -> torch.Tensor:
        """A tensor-parallel embedding (see :mod:`.tensor_parallel`): the base's own lookup (which sums or
        gathers over the ranks), plus each row's delta rows. A vocabulary-parallel rank holds the delta rows
        of its own vocabulary range: its lookups (zero for other tokens) are summed over the ranks in one
        all-reduce; a delta kept whole is looked up directly."""
        w = self.base_layer.weight
        y = self.base_layer(ids)
        start, end = self.tp.bounds(self.tp.full[0]) if self.tp.mode == "rows" else (0, self.tp.full[0])
        delta = None
        for slot, rows in _groups(slots).items():
            p = self.packed.get(slot)
            if p is None:
                continue
            idx = _index(self.router, rows, ids.device)
            r_ids = ids.index_select(0, idx) - start
            inside = (r_ids >= 0) & (r_ids < end - start)
            found = _dequantize_rows(p, r_ids.clamp(0, end - start - 1).reshape(-1)).view(*r_ids.shape, -1)
            if delta is None:
                delta = torch.zeros(*ids.shape, found.shape[-1], dtype=torch.float32, device=w.device)
            delta[idx.to(w.device)] = found.to(w.device) * inside[..., None].to(w.device)
        if delta is None:
            return y
        if self.tp.mode == "rows":
            self.tp.reduce(delta)
        return (y.float() + self._scaled(delta)).to(y.dtype)

    def _forward_static(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Every slot's rows computed for the whole batch and kept where the row uses that slot: no
        host decisions, so a captured decode step can run it (the slot set is fixed at capture)."""
        if not self.graph_safe():
            raise DeltaZipError("sparse embedding deltas (or an embedding with its own forward) cannot run in a captured decode step")
        w = self.base_layer.weight
        if self.stacks is not None and ids.dim() == 2:  # device gathers from stacks with room: no per-slot code
            out = F.embedding(ids, w).float() + self.stacks.gather_rows(rows.long() + 1, ids)
            return self._scaled(out.to(w.dtype))
        row_slot = rows.long().view(-1, *([1] * (ids.dim() - 1))).expand_as(ids)
        out = F.embedding(ids.clamp(max=w.shape[0] - 1), w).float()
        if any(p.shape[0] > w.shape[0] for p in self.packed.values()):
            out = out * (ids < w.shape[0])[..., None]
        for slot, p in self.packed.items():
            if "weight" in self.overrides.get(slot, {}):
                continue
            sel = row_slot == slot
            rows_p = torch.where(sel, ids, 0).clamp(max=p.shape[0] - 1)
            delta = _dequantize_rows(p, rows_p.reshape(-1)).to(out.device).view(*ids.shape, -1)
            out = out + delta * sel[..., None]
        for slot, ov in self.overrides.items():
            if "weight" in ov:
                table = ov["weight"]
                full = F.embedding(ids.clamp(max=table.shape[0] - 1), table).float()
                out = torch.where((row_slot == slot)[..., None], full, out)
        return self._scaled(out.to(w.dtype))

    def _lookup(self, slot: int, ids: torch.Tensor, top: Optional[int] = None) -> torch.Tensor:
        """``(W_base + delta)[ids]`` computing only the rows looked up. ``top``: the ids' largest, where the host
        knows it; else it is read back from the ids' device. Nothing else here waits for the device (no unique,
        no boolean mask), so an engine's prefill is queued whole behind a decode step in flight."""
        p = self.packed[slot]
        w = self.base_layer.weight
        if top is None:
            top = int(ids.max())
        if top >= p.shape[0]:
            raise DeltaZipError(f"token id {top} is outside this fine-tune's vocabulary of {p.shape[0]}")
        flat = ids.reshape(-1)
        base_rows = F.embedding(flat.clamp(max=w.shape[0] - 1), w).float()
        if p.shape[0] > w.shape[0]:  # tokens the fine-tune adds have no base row
            base_rows = base_rows * (flat < w.shape[0])[:, None]
        rows = (base_rows + _dequantize_rows(p, flat).to(w.device)).to(w.dtype)
        return rows.view(*ids.shape, -1)


def _dequantize_rows(p: PackedModule, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of a packed delta, dequantized (float32)."""
    k = p.shape[1]
    if p.sparsity == "dense":
        r = rows.to(p.qweight.device)
        codes = unpack_codes(p.qweight.index_select(0, r), p.bits, k)
        return dequantize(codes, p.scales.index_select(0, r), p.zeros.index_select(0, r), p.group_size)
    return p.dequantize().index_select(0, rows.to(p.qweight.device))


class DeltaOverride(DeltaModule):
    """Any module whose parameters some fine-tunes replace (norms, biases, position embeddings).

    With kernels on (CUDA), each replaced parameter also has a per-slot table with room to spare, read
    by a captured decode step; loads and evictions write its rows in place (no re-capture).
    """

    def __init__(self, base_layer: nn.Module, router: Router, layout: LayoutVersion, policy: KernelPolicy):
        super().__init__(base_layer, router, layout, policy)
        self._tables = None

    def _changed(self) -> None:
        self._tables = None
        super()._changed()
        device = next(iter(self.base_layer.parameters()), torch.empty(0)).device
        if self.overrides and device.type != "meta" and self.policy.wants_kernels(device):
            self._build_tables()

    def _build_tables(self) -> None:
        """Per parameter, a ``[table, *shape]`` tensor: row ``slot + 1`` holds that slot's value (row 0 and
        rows of other slots the base's), with room for more slots, so loads write rows in place."""
        base = dict(self.base_layer.named_parameters())
        size = max(64, 2 * (max(self.overrides) + 2))
        tables = {}
        for name in {n for ov in self.overrides.values() for n in ov}:
            p0 = base[name].detach()
            t = p0.unsqueeze(0).repeat(size, *([1] * p0.dim())).clone()
            for slot, ov in self.overrides.items():
                if name in ov:
                    t[slot + 1] = ov[name].to(p0.dtype)
            tables[name] = t
        self._tables = tables

    def can_override_in_place(self, slot: int, name: str, value: torch.Tensor) -> bool:
        t = (self._tables or {}).get(name)
        return t is not None and slot + 1 < t.shape[0] and tuple(value.shape) == tuple(t.shape[1:])

    def add_override(self, slot: int, name: str, value: torch.Tensor) -> None:
        if self.can_override_in_place(slot, name, value):
            self.overrides.setdefault(slot, {})[name] = value
            self._tables[name][slot + 1].copy_(value.to(self._tables[name].dtype))
            return
        super().add_override(slot, name, value)

    def remove_slot(self, slot: int, keep_room: bool = True) -> None:
        ov = self.overrides.get(slot)
        if self._tables is not None and ov and all(n in self._tables for n in ov) and slot not in self.packed:
            base = dict(self.base_layer.named_parameters())
            for n in self.overrides.pop(slot):
                self._tables[n][slot + 1].copy_(base[n].detach())  # back to the base's value
            self.names.pop(slot, None)
            if not self.overrides and not keep_room:
                self._changed()
            return
        super().remove_slot(slot, keep_room)

    def _forward_static(self, x, rows: torch.Tensor, args, kwargs):
        """All rows at once, each with its slot's parameters (gathered from per-slot tables on the
        device and applied with ``vmap``): what a captured decode step runs."""
        if args or kwargs or x.shape[0] != rows.shape[0]:
            raise DeltaZipError("parameter overrides of this module cannot run in a captured decode step")
        if self._tables is None:
            self._build_tables()
        idx = rows.long() + 1
        params = {name: t[idx] for name, t in self._tables.items()}

        def one(prm, xr):
            return torch.func.functional_call(self.base_layer, prm, (xr.unsqueeze(0),)).squeeze(0)

        return torch.vmap(one)(params, x)

    def forward(self, x, *args, **kwargs):
        if not torch.is_tensor(x) or x.dim() == 0:
            return self.base_layer(x, *args, **kwargs)
        routing = self.router.current
        if routing.is_static and (self.overrides or self._tables is not None):
            return self._forward_static(x, routing.device_rows, args, kwargs)
        routed = routing.slots
        if routed is None:
            return self.base_layer(x, *args, **kwargs)
        batch = len(routed) if x.shape[0] == 1 and len(routed) > 1 and not routing.uniform else x.shape[0]
        slots = routing.rows_for(batch)
        if not (set(slots) & set(self.overrides)):
            return self.base_layer(x, *args, **kwargs)
        if x.shape[0] != batch:  # broadcast inputs (position ids of shape [1, T])
            x = x.expand(batch, *x.shape[1:])
        out = None
        for slot, rows in _groups(slots).items():
            idx = _index(self.router, rows, x.device)
            xr = x.index_select(0, idx)
            # per-row tensors beside x (OPT's position ids, an MoE block's routing) are split the same way
            r_args = [_take_rows(a, idx, batch) for a in args]
            r_kwargs = {k: _take_rows(v, idx, batch) for k, v in kwargs.items()}
            if slot in self.overrides:
                params = {k: v.to(dict(self.base_layer.named_parameters())[k].dtype) for k, v in self.overrides[slot].items()}
                y = torch.func.functional_call(unhooked(self.base_layer, xr.device), params, (xr, *r_args), r_kwargs)
            else:
                y = self.base_layer(xr, *r_args, **r_kwargs)
            out = _put_rows(out, idx, y, batch)
        return out


def _take_rows(value, idx: torch.Tensor, batch: int):
    """Rows ``idx`` of a tensor with one row per batch row; anything else as it is."""
    if torch.is_tensor(value) and value.dim() and value.shape[0] == batch:
        return value.index_select(0, idx.to(value.device))
    return value


def _put_rows(out, idx: torch.Tensor, y, batch: int):
    """Write ``y`` (a tensor, or a tuple of them such as an MoE router's outputs) into rows ``idx`` (a long
    tensor) of ``out``, made on first use with ``batch`` rows."""
    if isinstance(y, tuple):
        olds = (None,) * len(y) if out is None else out
        return tuple(_put_rows(o, idx, v, batch) for o, v in zip(olds, y))
    if not torch.is_tensor(y):
        return y
    if out is None:
        out = y.new_empty((batch, *y.shape[1:]))
    out[idx.to(out.device)] = y
    return out
