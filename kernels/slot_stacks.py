"""Slots to stacks: the device-side bookkeeping one linear layer needs to run many deltas in one launch.

A model numbers its loaded deltas by *slot* (0, 1, 2, ...; -1 is the plain base). The kernel reads
deltas from :class:`~.delta_stack.DeltaStack` tensors, one per *format class* (bits, group size,
2:4 or dense). :class:`SlotStacks` maps one to the other for one layer:

* each format class has a stack with room for more deltas than it holds (``capacity``), a free list,
  and two device tables indexed by ``slot + 1``: ``lookup`` (the delta's index in the stack, -1 for
  none) and ``member`` (whether the row's delta is of this class);
* writing a delta into free room or freeing its place changes table entries in place, never tensors,
  so a CUDA graph captured over :meth:`SlotStacks.apply` stays valid while deltas come and go;
* anything that needs new tensors (a new format class, a full stack) is a rebuild, which the caller
  must report as a layout change (see ``hf_deltazip.modeling.routing.LayoutVersion``);
* with ``kernel_layout`` (linear layers), deltas are written in the fast path's layout
  (:func:`~.layout.pack_for_stack`: planar codes, 2:4 densified); :meth:`SlotStacks.file_fields`
  reads one back in the file layout. Embedding stacks keep the file layout (:meth:`SlotStacks.gather_rows`);
* :meth:`SlotStacks.enable_input_major` adds to each 2-, 4- or 8-bit class a second copy of its deltas in the
  input-major layout of the activation-sparse kernel (:class:`~.act_sparse.InputMajorDeltas`, same room and
  indices), kept in step by :meth:`SlotStacks.write`; :meth:`SlotStacks.add_sparse_deltas` runs it.

Plain PyTorch plus the kernel launcher; nothing here knows about models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from hf_deltazip.packing import dequantize, pack_codes, packed_nbytes, unpack_codes

from .delta_stack import DeltaStack
from .layout import KernelStackFormat, kernel_stack_format, pack_for_stack

__all__ = ["DEQUANT_CHUNK_BYTES", "PackedFields", "SlotStacks", "format_key"]

#: the most bytes of dense deltas the dequant prefill route writes out at once (one launch per chunk): 512 MiB
#: holds four of an 8B model's largest layers (14336 x 4096) in bfloat16
DEQUANT_CHUNK_BYTES = 512 << 20


@dataclass(frozen=True)
class PackedFields:
    """One delta's packed tensors in the stack layout (dense codes, or kept codes + 2:4 positions)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    positions: Optional[torch.Tensor]
    bits: int
    group_size: int
    sparsity: str  # "dense" or "2:4" (unstructured deltas are stored densely)


def format_key(fields: PackedFields) -> tuple:
    """The format class a delta belongs to: deltas of one class share a stack."""
    return (fields.bits, fields.group_size, "2:4" if fields.sparsity == "2:4" else "dense")


@dataclass
class _ClassStack:
    key: tuple
    fmt: KernelStackFormat
    stack: DeltaStack
    lookup: torch.Tensor  # int32 [table]: slot + 1 -> index in the stack, -1 if not in this class
    member: torch.Tensor  # bool [table]: slot + 1 -> the slot's delta is in this class
    index: dict = field(default_factory=dict)  # slot -> index
    free: list = field(default_factory=list)  # free indices, popped from the end
    input_major: Optional[object] = None  # act_sparse.InputMajorDeltas with the same room, or None


class SlotStacks:
    """The kernel stacks of one linear layer of ``out_features x in_features`` (see the module docstring).

    Args:
        items: ``(slot, PackedFields)`` of the deltas to hold now (at least one).
        in_features, out_features: the layer's shape.
        device: where the stacks live.
        capacity: deltas the stacks should have room for in all (the cache's resident budget), or
            ``None``: each class gets half again the room it needs.
        kernel_layout: store codes in the fast kernel's layout (linear layers); ``False`` keeps the
            file layout (embedding stacks, read row by row).
    """

    def __init__(self, items: Iterable, in_features: int, out_features: int, device, capacity: Optional[int] = None,
                 kernel_layout: bool = True):
        items = sorted(items, key=lambda it: it[0])
        if not items:
            raise ValueError("SlotStacks needs at least one delta")
        self.in_features, self.out_features = in_features, out_features
        self.kernel_layout = kernel_layout
        self.device = torch.device(device)
        self.table_size = max(64, 2 * (max(s for s, _ in items) + 2))
        classes: dict = {}
        for slot, f in items:
            classes.setdefault(format_key(f), []).append((slot, f))
        total = len(items)
        self.classes: list[_ClassStack] = []
        for key, members in classes.items():
            spare = max(capacity - total, 0) if capacity else (len(members) + 1) // 2
            self.classes.append(self._new_class(key, members, len(members) + spare))
        for slot, f in items:
            if self.write(slot, f) is None:  # room for every item was made above
                raise RuntimeError("SlotStacks: no room for a delta just sized for")

    def _new_class(self, key, members, cap: int) -> _ClassStack:
        first = members[0][1]
        sdtype = torch.float32 if any(f.scales.dtype == torch.float32 for _, f in members) else torch.float16
        n, dev = first.qweight.shape[0], self.device
        bits, group_size, sparsity = key
        k = self.in_features
        if self.kernel_layout:
            fmt = kernel_stack_format(bits, group_size, k, sparsity == "2:4")
        else:
            fmt = KernelStackFormat(0, False, packed_nbytes(k // 2 if sparsity == "2:4" else k, bits), sparsity == "2:4")
        stack = DeltaStack(
            torch.empty((cap, n, fmt.row_bytes), dtype=torch.uint8, device=dev),
            torch.zeros((cap, n, first.scales.shape[1]), dtype=sdtype, device=dev),
            torch.zeros((cap, n, first.zeros.shape[1]), dtype=torch.uint8, device=dev),
            torch.empty((cap, n, first.positions.shape[1]), dtype=torch.uint8, device=dev) if fmt.has_positions else None,
            bits, group_size, k, layout_block=fmt.layout_block,
        )
        return _ClassStack(key=key, fmt=fmt, stack=stack,
                           lookup=torch.full((self.table_size,), -1, dtype=torch.int32, device=dev),
                           member=torch.zeros((self.table_size,), dtype=torch.bool, device=dev),
                           free=list(range(cap - 1, -1, -1)))

    # ------------------------------------------------------------------ in-place changes
    def place_for(self, slot: int, key: tuple, out_rows: int, scales_dtype: torch.dtype) -> Optional[_ClassStack]:
        """The class stack with free room for a delta of format class ``key`` under ``slot``, or ``None``."""
        if out_rows != self.out_features or slot + 1 >= self.table_size or any(slot in c.index for c in self.classes):
            return None
        for c in self.classes:
            if c.key != key or not c.free:
                continue
            if scales_dtype == torch.float32 and c.stack.scales.dtype != torch.float32:
                continue
            return c
        return None

    def write(self, slot: int, fields: PackedFields) -> Optional[tuple]:
        """Copy a delta into free room of its class's stack (asynchronously from pinned memory).

        Returns ``(stack, index)``, where the delta now lives, or ``None`` when there is no room
        (the caller rebuilds). Only table entries change: captured graphs stay valid.
        """
        c = self.place_for(slot, format_key(fields), fields.qweight.shape[0], fields.scales.dtype)
        if c is None:
            return None
        q = fields.qweight
        if c.fmt.layout_block or c.fmt.densify:  # the kernel's layout: planar codes, 2:4 as dense codes
            pos, zeros, dev = fields.positions, fields.zeros, c.stack.qweight.device
            if q.device != dev:
                # repack where the stack lives: on a GPU one layer takes microseconds, on the host
                # (a delta arriving in pinned memory) seconds, which made an 8B delta's load take 20 s
                q = q.to(dev, non_blocking=True)
                if c.fmt.densify:  # 2:4 codes are densified there with their positions and zero points
                    pos = pos.to(dev, non_blocking=True) if pos is not None else None
                    zeros = zeros.to(dev, non_blocking=True)
            q = pack_for_stack(c.fmt, q, pos, zeros, fields.bits, fields.group_size, self.in_features)
        if tuple(q.shape) != tuple(c.stack.qweight.shape[1:]):
            return None
        i = c.free.pop()
        st = c.stack
        st.qweight[i].copy_(q, non_blocking=True)
        st.scales[i].copy_(fields.scales, non_blocking=True)
        st.zeros[i].copy_(fields.zeros, non_blocking=True)
        if st.positions is not None:
            st.positions[i].copy_(fields.positions, non_blocking=True)
        if c.input_major is not None:
            self._write_input_major(c, i)
        c.index[slot] = i
        c.lookup[slot + 1].fill_(i)  # fill_: the value rides in the launch (assigning a number copies it
        c.member[slot + 1].fill_(True)  # from pageable memory, which waits for the stream: a staging's sync)
        return st, i

    def remove(self, slot: int) -> bool:
        """Free a slot's place (its room stays allocated for the next delta). Returns whether it was here."""
        for c in self.classes:
            if slot in c.index:
                c.free.append(c.index.pop(slot))
                c.lookup[slot + 1].fill_(-1)
                c.member[slot + 1].fill_(False)
                return True
        return False

    # ------------------------------------------------------------------ the activation-sparse copy
    def enable_input_major(self) -> bool:
        """Keep every class's deltas a second time in the input-major layout the activation-sparse delta
        kernel reads (:func:`~.act_sparse.sparse_delta_linear`): the same bytes again per delta (4-bit: a
        quarter of the base layer's; 2-bit: an eighth), with room for as many as the class's stack. Returns
        whether every class has it (3-bit classes cannot: no whole codes per byte along the outputs)."""
        from .act_sparse import InputMajorDeltas

        for c in self.classes:
            st = c.stack
            if c.input_major is not None or st.bits not in (2, 4, 8) or not self.kernel_layout:
                continue
            cap, n, k = st.qweight.shape[0], self.out_features, self.in_features
            c.input_major = InputMajorDeltas(
                qweight=torch.zeros((cap, k, -(-n * st.bits // 8)), dtype=torch.uint8, device=self.device),
                scales=torch.zeros((cap, st.scales.shape[2], n), dtype=st.scales.dtype, device=self.device),
                zeros=torch.zeros((cap, st.zeros.shape[2], n), dtype=torch.uint8, device=self.device),
                bits=st.bits, group_size=st.group_size, out_features=n)
            for i in c.index.values():
                self._write_input_major(c, i)
        return self.input_major_ready

    def disable_input_major(self) -> None:
        """Drop the input-major copies (:meth:`enable_input_major`)."""
        for c in self.classes:
            c.input_major = None

    @property
    def input_major_ready(self) -> bool:
        """Whether every class keeps the input-major copy."""
        return all(c.input_major is not None for c in self.classes)

    def _write_input_major(self, c: _ClassStack, i: int) -> None:
        from .act_sparse import input_major_fields

        im = c.input_major
        for dst, src in zip((im.qweight, im.scales, im.zeros), input_major_fields(c.stack, i)):
            dst[i].copy_(src)

    def add_sparse_deltas(self, x2: torch.Tensor, out: torch.Tensor, slot_segments: tuple,
                          threshold: Optional[float], slots: Optional[set] = None) -> torch.Tensor:
        """``out[m] += x2[m] dequant(delta of row m)^T`` reading only the delta columns of inputs with
        ``|x| > threshold`` (:func:`~.act_sparse.sparse_delta_linear`, one launch per format class; every class
        must keep the input-major copy). ``slot_segments``: ``(slots, build_row_segments(slots))`` of the
        rows' int32 slot ids, built once per step and shared by every layer (each class translates slots to
        its own indices in the kernel). ``slots``: the batch's slots when known on the host (classes holding
        none of them are skipped)."""
        from .act_sparse import sparse_delta_linear

        row_slots, segments = slot_segments
        for c in self.classes:
            if slots is not None and slots.isdisjoint(c.index):
                continue
            sparse_delta_linear(x2, c.input_major, row_slots, out=out, threshold=threshold, segments=segments,
                                segment_lookup=c.lookup)
        return out

    @property
    def slots(self) -> set:
        return {s for c in self.classes for s in c.index}

    def where(self, slot: int) -> tuple:
        """``(class stack, index)`` of a slot held here (``KeyError`` if it is not)."""
        for c in self.classes:
            if slot in c.index:
                return c, c.index[slot]
        raise KeyError(slot)

    def codes(self, slot: int) -> torch.Tensor:
        """Dense uint8 codes ``[N, K]`` of a slot's delta (pruned entries at their group's zero point)."""
        c, i = self.where(slot)
        return c.stack.codes(i)

    def file_fields(self, slot: int) -> PackedFields:
        """A slot's delta in the file layout (views when the stack keeps that layout; a 2:4 delta stored
        densified comes back as dense codes, the same values)."""
        c, i = self.where(slot)
        st = c.stack
        if not c.fmt.layout_block and not c.fmt.densify:
            return PackedFields(st.qweight[i], st.scales[i], st.zeros[i], None if st.positions is None else st.positions[i],
                                st.bits, st.group_size, "2:4" if st.positions is not None else "dense")
        return PackedFields(pack_codes(st.codes(i), st.bits), st.scales[i], st.zeros[i], None, st.bits, st.group_size,
                            "dense")

    def dense_delta(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """One slot's delta as a dense ``[out_features, in_features]`` tensor of ``dtype`` on the stacks' device
        (one Triton launch for planar stacks, see :func:`~.dequant.dequantize_stack_delta`)."""
        from .dequant import dequantize_stack_delta

        c, i = self.where(slot)
        return dequantize_stack_delta(c.stack, i, dtype)

    def dense_delta_chunks(self, slots: Sequence[int], dtype: torch.dtype, device_slots: Callable[[tuple], torch.Tensor],
                           max_bytes: Optional[int] = None) -> Iterator[tuple]:
        """Several slots' deltas dense: ``(slots, tensor [len(slots), out_features, in_features])`` per chunk, the
        slots of one stack class together and at most ``max_bytes`` (default :data:`DEQUANT_CHUNK_BYTES`) of
        ``dtype`` per chunk (at least one delta), each chunk one Triton launch for planar stacks
        (:func:`~.dequant.dequantize_stack_deltas`).
        ``device_slots(tuple)``: those slots as a device int32 tensor (a cached one: no copy per layer)."""
        from .dequant import dequantize_stack_delta, dequantize_stack_deltas, runs_dequant_kernel

        per = self.out_features * self.in_features * dtype.itemsize
        most = max(1, (max_bytes or DEQUANT_CHUNK_BYTES) // per)
        for c in self.classes:
            mine = [s for s in slots if s in c.index]
            for i in range(0, len(mine), most):
                part = tuple(mine[i:i + most])
                if runs_dequant_kernel(c.stack):
                    yield part, dequantize_stack_deltas(c.stack, device_slots(part), dtype, lut=c.lookup)
                else:  # the PyTorch reference, one delta at a time (indices known on the host)
                    yield part, torch.stack([dequantize_stack_delta(c.stack, c.index[s], dtype) for s in part])

    def delta_nbytes(self, slot: int) -> int:
        """Device bytes one slot's delta occupies in its stack."""
        c, i = self.where(slot)
        st = c.stack
        tensors = [st.qweight[i], st.scales[i], st.zeros[i]] + ([st.positions[i]] if st.positions is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors) + self.input_major_nbytes(slot)

    def input_major_nbytes(self, slot: int) -> int:
        """Device bytes of a slot's input-major copy (:meth:`enable_input_major`; 0 without one, or when the
        slot is not here)."""
        for c in self.classes:
            if slot in c.index and c.input_major is not None:
                i = c.index[slot]
                return sum(t[i].numel() * t.element_size() for t in (c.input_major.qweight, c.input_major.scales,
                                                                      c.input_major.zeros))
        return 0

    def nbytes(self) -> int:
        """Device bytes of every stack and table (room included; input-major copies too)."""
        return sum(c.stack.nbytes() + c.lookup.numel() * 4 + c.member.numel()
                   + (c.input_major.nbytes() if c.input_major is not None else 0) for c in self.classes)

    def gather_rows(self, slot_plus_one: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """For an embedding-shaped stack (``out_features`` = vocabulary): each batch row's delta rows.

        Args:
            slot_plus_one: long ``[B]``: each batch row's slot + 1 (0 for the plain base).
            ids: long ``[B, T]`` token ids (``< out_features``).

        Returns:
            float32 ``[B, T, in_features]``: the dequantized delta rows of each row's slot, zeros for
            rows whose slot holds no delta here. Device gathers only (no host sync): a captured decode
            step can run it, and later writes into free room change what it reads.
        """
        b, t = ids.shape
        k = self.in_features
        out = torch.zeros((b, t, k), dtype=torch.float32, device=ids.device)
        for c in self.classes:
            if c.stack.sparse_2of4 or c.stack.layout_block:
                raise ValueError("gather_rows reads dense stacks in the file layout only (kernel_layout=False)")
            where = c.lookup[slot_plus_one].long().clamp(min=0)[:, None].expand(b, t)
            q = c.stack.qweight[where, ids].reshape(b * t, -1)
            scales = c.stack.scales[where, ids].reshape(b * t, -1)
            zeros = c.stack.zeros[where, ids].reshape(b * t, -1)
            rows = dequantize(unpack_codes(q, c.stack.bits, k), scales, zeros, c.stack.group_size).view(b, t, k)
            out = out + rows * c.member[slot_plus_one][:, None, None]
        return out

    # ------------------------------------------------------------------ the launch
    def apply(self, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              slot_plus_one: torch.Tensor, slot_segments: Optional[tuple] = None,
              rows_per_delta: Optional[int] = None) -> torch.Tensor:
        """``x W^T + bias`` plus, for each row, its slot's delta: one kernel launch per format class, the
        first reading the base weight, the others adding their rows' deltas to its output
        (``multi_delta_linear(accumulate=True)``) instead of reading the base again.

        Args:
            x2: ``[M, K]`` activations.
            weight: ``[N, K]`` base weight; bias: ``[N]`` or ``None``.
            slot_plus_one: long ``[M]``: each row's slot + 1 (0 for the plain base), on the device.
            slot_segments: ``(slots, build_row_segments(slots))`` with ``slots = slot_plus_one - 1``
                (int32), built once per step and shared by every layer: planar stacks then translate
                slots to their own indices in the kernel (no per-layer sorting or gathering).
            rows_per_delta: rows per distinct delta of the batch, when known on the host (sizes the
                kernel's row blocks, see :func:`~kernels.multi_delta.default_config`).
        """
        y = self._launch(self.classes[0], x2, weight, bias, None, slot_plus_one, slot_segments, rows_per_delta)
        # each row belongs to one format class: the first launch gave every row the base (and its own class's rows
        # their deltas); the other classes add theirs without reading the base again
        self._accumulate(x2, y, slot_plus_one, slot_segments, rows_per_delta, self.classes[1:])
        return y

    def accumulate(self, x2: torch.Tensor, out: torch.Tensor, slot_plus_one: torch.Tensor,
                   slot_segments: Optional[tuple] = None, rows_per_delta: Optional[int] = None) -> torch.Tensor:
        """Add each row's delta product to ``out`` (``[M, N]``, holding the base's ``x W^T + bias``), one
        launch per format class that skips the base (``multi_delta_linear(accumulate=True)``); rows of the
        plain base, or of a class not launched, keep their value. Arguments as :meth:`apply`."""
        return self._accumulate(x2, out, slot_plus_one, slot_segments, rows_per_delta, self.classes)

    def _accumulate(self, x2, out, slot_plus_one, slot_segments, rows_per_delta, classes) -> torch.Tensor:
        for c in classes:
            self._launch(c, x2, None, None, out, slot_plus_one, slot_segments, rows_per_delta)
        return out

    @staticmethod
    def _launch(c, x2, weight, bias, out, slot_plus_one, slot_segments, rows_per_delta) -> torch.Tensor:
        """One format class's launch: with the base (``weight``, a new output) or adding its rows' deltas to
        ``out`` (``weight=None``). Planar stacks read the step's shared segment table through the class's
        lookup; others get the rows' stack indices."""
        from .multi_delta import multi_delta_linear

        add = weight is None
        kw = dict(out=out, rows_per_delta=rows_per_delta, accumulate=add)
        if slot_segments is not None and c.stack.layout_block:
            slots, segments = slot_segments
            rows, kw = slots, dict(kw, segments=segments, segment_lookup=c.lookup)
        else:
            rows = c.lookup[slot_plus_one]
        return multi_delta_linear(x2, weight, bias, c.stack, rows, out.dtype if add else None, **kw)
