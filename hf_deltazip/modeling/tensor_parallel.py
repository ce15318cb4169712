"""Deltas over a tensor-parallel base: transformers' ``tp_plan`` under ``torchrun``.

``AutoModelForCausalLM.from_pretrained(..., tp_plan="auto")`` shards each planned layer over the ranks
and makes its forward do the communication (transformers 5.2x: DTensor weights and a replaced
``forward``; older 5.x: local weight shards and module hooks). A delta layer lets that base forward run
as it is (``base_layer(x)``) and adds this rank's share of the delta, which is sharded like the weight:

* ``colwise`` (q/k/v, gate/up): the base returns this rank's output columns; the rank keeps the delta's
  matching output rows and adds ``x · Δ_rowsᵀ`` locally. No communication.
* ``rowwise`` (o_proj, down_proj): the input is this rank's slice of the features and the base's output
  is summed over the ranks; the rank keeps the delta's matching input columns (whole quantization
  groups) and its partial ``x_local · Δ_colsᵀ`` joins the base's partial output before the one
  all-reduce (an ``nn.Linear`` at inference), or gets an all-reduce of its own after the base's forward.
* ``colwise_gather_output`` (the LM head): rows as for ``colwise``; the base gathers its output and the
  delta's part is gathered too (one all-gather per forward that routes a delta to the head).
* ``embedding_rowwise`` (the input embedding): the rank keeps the delta rows of its vocabulary range;
  its lookups (zero outside the range) are summed over the ranks, one all-reduce per forward that
  routes a delta to the embedding.
* anything else whose base output is whole on every rank (``rowwise_split_input``, ``embedding_colwise``):
  the delta is kept whole on every rank and added to that output.
* modules the plan replicates (``replicate``, Qwen3's q/k norms): deltas work as without a plan.
* any other style (MoE experts, packed or sequence-parallel layers) is refused with a
  :class:`TensorParallelError` when a delta touches it.

Shards follow ``torch.chunk`` (what DTensor's ``Shard`` does): rank ``r`` holds
``[r·c, min((r+1)·c, n))`` with ``c = ceil(n / world)``; the base's own local shape is checked against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..delta import PackedModule
from ..errors import DeltaZipError

__all__ = ["TensorParallelError", "TPShard", "tp_size", "tp_shard", "local_tensor", "full_tensor",
           "fingerprint_view", "gather_chunks", "distributed_kwargs", "tensor_parallel_problem"]

# the plan styles a delta can follow, by what the base layer's forward gives back on each rank
_ROWS = frozenset({"colwise", "local_colwise"})  # output columns sharded: the delta's output rows too
_GATHERED = frozenset({"colwise_gather_output", "colwise_rep"})  # the same, output columns then gathered
_VOCAB = frozenset({"embedding_rowwise"})  # an embedding's vocabulary rows sharded, the lookups summed
_COLUMNS = frozenset({"rowwise", "local_rowwise"})  # input sharded, output all-reduced: input columns
_WHOLE = frozenset({"rowwise_rep", "rowwise_split_input", "embedding_colwise"})  # whole output on every rank
_REPLICATED = frozenset({"replicate", "replicated_with_grad_allreduce"})  # parameters whole on every rank
_UNREDUCED = frozenset({"local_rowwise"})  # a partial output that a parent module sums
# the weight dimension each style shards (transformers' own layouts), for gathering plain local shards
_WEIGHT_DIM = {"colwise": 0, "local_colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "rowwise": 1,
               "local_rowwise": 1, "rowwise_rep": 1, "rowwise_split_input": 1, "embedding_rowwise": 0,
               "embedding_colwise": 1}


class TensorParallelError(DeltaZipError):
    """A delta cannot be sharded the way the tensor-parallel base is (the message says why and what to do)."""


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, or ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def tp_size(model: nn.Module) -> int:
    """How many ranks ``model``'s weights are sharded over (1: not tensor-parallel)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    size = getattr(model, "tp_size", None)
    if not size:  # a transformers without the attribute: the size of the model's TP mesh
        mesh = getattr(model, "device_mesh", None)
        size = _tp_mesh(mesh).size() if mesh is not None else 1
    return int(size)


def _tp_mesh(mesh):
    return mesh["tp"] if mesh.ndim > 1 and "tp" in (mesh.mesh_dim_names or ()) else mesh


def _plan(model: nn.Module) -> dict:
    plan = getattr(model, "tp_plan", None)
    return dict(plan if plan else getattr(model, "_tp_plan", None) or {})


def _style(plan: dict, name: str) -> Optional[str]:
    if name in plan:
        return plan[name]
    for key, style in plan.items():
        if "*" in key and re.fullmatch(re.escape(key).replace(r"\*", r"\d+"), name):
            return style
    return None


def _group(model: nn.Module, weight):
    mesh = weight.device_mesh if _is_dtensor(weight) else getattr(model, "device_mesh", None)
    return _tp_mesh(mesh).get_group() if mesh is not None else torch.distributed.group.WORLD


@dataclass(frozen=True)
class TPShard:
    """How module ``name``'s deltas are sharded on this rank.

    ``mode``: ``"rows"`` (colwise layer), ``"columns"`` (rowwise layer) or ``"whole"`` (kept whole).
    ``gathers``: a ``"rows"`` layer whose base output is gathered (the LM head): the delta's part is too.
    """

    name: str
    style: str
    mode: str
    rank: int
    world: int
    group: object
    full: tuple  # (out, in) of the whole weight: (vocab, dim) for an embedding
    gathers: bool = False

    def bounds(self, size: int) -> tuple:
        """``(start, end)`` of this rank's chunk of ``size`` (``torch.chunk``'s split)."""
        chunk = -(-size // self.world)
        start = min(self.rank * chunk, size)
        return start, min(start + chunk, size)

    @property
    def reduces(self) -> bool:
        """Whether this layer sums its partial output over the ranks (a ``local_rowwise`` layer leaves that
        to a parent module, which then sums the delta's part too)."""
        return self.mode == "columns" and self.style not in _UNREDUCED

    def local_shape(self) -> tuple:
        """``(out, in)`` of this rank's part of the layer's weight."""
        n, k = self.full
        if self.mode == "rows":
            r0, r1 = self.bounds(n)
            return r1 - r0, k
        if self.mode == "columns":
            c0, c1 = self.bounds(k)
            return n, c1 - c0
        return n, k

    def take(self, p: PackedModule) -> PackedModule:
        """This rank's shard of the whole delta ``p``; a shard taken before (a delta evicted to the host
        and placed again) is returned as it is."""
        n, k = p.shape
        if self.mode == "whole" or (self.world > 1 and (n, k) == self.local_shape() != tuple(self.full)):
            return p
        if (n, k) != tuple(self.full):
            raise TensorParallelError(
                f"{self.name}: the delta is {[n, k]} but the base layer is {list(self.full)} ({self.style} over "
                f"{self.world} ranks); load the delta onto the base it was made from"
            )
        if self.mode == "rows":
            return p.sliced(rows=self.bounds(n))
        c0, c1 = self.bounds(k)
        g = p.group_size
        cuts_group = g != -1 and (c0 % g or (c1 % g and c1 != k))
        if cuts_group or (p.sparsity == "2:4" and (c0 % 4 or c1 % 4)):
            width = -(-k // self.world)
            unit = f"quantization groups of {g} columns" if cuts_group else "2:4 blocks of 4 columns"
            raise TensorParallelError(
                f"{self.name} is row-parallel over {self.world} ranks: rank {self.rank} holds input columns "
                f"{c0}:{c1} (shards of {width} of {k}), which cut the delta's {unit}. Compress the delta with a "
                f"group_size that divides {width} ({_groups_that_fit(width)}), or run "
                "with a tensor-parallel size whose shards hold whole groups"
            )
        return p.sliced(columns=(c0, c1))

    def take_bias(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a replaced bias (output rows of a colwise layer; whole otherwise). A part
        taken before is returned as it is."""
        if self.mode != "rows" or self.gathers or value.shape[0] != self.full[0]:
            return value
        r0, r1 = self.bounds(value.shape[0])
        return value[r0:r1]

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (every rank must call this with the same shape)."""
        torch.distributed.all_reduce(t, group=self.group)
        return t

    def gather(self, local: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        """The whole tensor from each rank's ``torch.chunk`` part along ``dim`` (``size`` long in all)."""
        return gather_chunks(local, dim, size, self.world, self.group)


def gather_chunks(local: torch.Tensor, dim: int, size: int, world: int, group) -> torch.Tensor:
    """Every rank's ``torch.chunk`` part of a tensor along ``dim`` put back together (``size`` long)."""
    chunk = -(-size // world)
    shape = list(local.shape)
    shape[dim] = chunk
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, size)


def _groups_that_fit(width: int) -> str:
    """The group sizes a delta may use (``-1``, or a power of two from 32 to 1024) that divide ``width``."""
    fits = [g for g in (1024, 512, 256, 128, 64, 32) if width % g == 0]
    return "group_size=-1" + (", or " + " / ".join(map(str, fits)) if fits else "")


def tp_shard(model: nn.Module, name: str, module: nn.Module) -> Optional[TPShard]:
    """How the deltas of module ``name`` (the base module ``module``) are sharded, or ``None`` when
    ``model`` is not tensor-parallel or the plan leaves the module alone (its deltas work as usual).

    Raises:
        TensorParallelError: the plan gives the module a style that deltas cannot follow.
    """
    world = tp_size(model)
    if world <= 1:
        return None
    style = _style(_plan(model), name)
    if style is None or style in _REPLICATED:  # not cut: deltas (norm overrides, ...) work as usual
        return None
    if style in _ROWS or style in _GATHERED or style in _VOCAB:
        mode = "rows"
    elif style in _COLUMNS:
        mode = "columns"
    elif style in _WHOLE:
        mode = "whole"
    else:
        raise TensorParallelError(
            f"{name} is sharded with the tensor-parallel style {style!r}, which deltas do not follow yet "
            f"(supported: {sorted(_ROWS | _GATHERED | _VOCAB | _COLUMNS | _WHOLE | _REPLICATED)}); load the base without tp_plan "
            "(device_map='auto' spreads it over the GPUs) or with a tp_plan that leaves this module replicated"
        )
    weight = module.weight
    group = _group(model, weight)
    rank = torch.distributed.get_rank(group)
    if _is_dtensor(weight):
        full = tuple(weight.shape)
    else:  # a plain local shard (older transformers): the whole length is the sum of the ranks' chunks
        dim = _WEIGHT_DIM.get(style)
        full = list(weight.shape)
        if dim is not None:
            size = torch.tensor([weight.shape[dim]], device=weight.device)
            torch.distributed.all_reduce(size, group=group)
            full[dim] = int(size)
    shard = TPShard(name=name, style=style, mode=mode, rank=rank, world=world, group=group, full=tuple(full),
                    gathers=style in _GATHERED)
    local = tuple(local_tensor(weight).shape)
    if mode != "whole" and local != shard.local_shape():
        raise TensorParallelError(
            f"{name}: this rank's base weight is {list(local)} but a {style} shard of {list(full)} over {world} "
            f"ranks would be {list(shard.local_shape())}; the base is sharded in a way hf-deltazip does not "
            "follow: load it without tp_plan, or with a plan that leaves this module replicated"
        )
    return shard


def _sharded_dim(model: nn.Module, name: str, t: torch.Tensor) -> Optional[int]:
    """The dimension a plain (non-DTensor) parameter ``name`` is cut along on the ranks, or ``None``."""
    owner, _, attr = name.rpartition(".")
    style = _style(_plan(model), owner)
    dim = _WEIGHT_DIM.get(style)
    if dim is None or (attr == "bias" and style in _COLUMNS):  # a row-parallel bias is replicated
        return None
    return 0 if attr == "bias" or t.dim() == 1 else dim


def full_tensor(model: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """Parameter ``name`` of a tensor-parallel ``model`` whole on every rank (a collective: every rank calls it)."""
    if _is_dtensor(t):
        return t.full_tensor()
    dim = _sharded_dim(model, name, t) if tp_size(model) > 1 else None
    if dim is None:
        return t
    group = _group(model, t)
    size = torch.tensor([t.shape[dim]], device=t.device)  # the chunks' sum: the last may be short
    torch.distributed.all_reduce(size, group=group)
    return gather_chunks(t, dim, int(size), tp_size(model), group)


def fingerprint_view(model: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """What the base fingerprint can check of parameter ``name`` on one rank: a replicated parameter
    itself; a sharded one as a ``meta`` tensor of the whole shape (its shape and dtype are checked, its
    sampled values are spread over the ranks and are not)."""
    if _is_dtensor(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    dim = _sharded_dim(model, name, t)
    if dim is None:
        return t
    size = torch.tensor([t.shape[dim]], device=t.device)
    torch.distributed.all_reduce(size, group=_group(model, t))
    shape = list(t.shape)
    shape[dim] = int(size)
    return torch.empty(shape, dtype=t.dtype, device="meta")


def distributed_kwargs(kwargs: dict) -> dict:
    """``from_pretrained`` keyword arguments with ``tp_plan`` / ``tp_size`` moved into a ``DistributedConfig``,
    where transformers has one (it deprecates the bare arguments); anything else as it is."""
    if "distributed_config" in kwargs or not ({"tp_plan", "tp_size"} & set(kwargs)):
        return kwargs
    try:
        from transformers import DistributedConfig
    except ImportError:  # a transformers that only takes the bare arguments
        return kwargs
    kwargs = dict(kwargs)
    config = DistributedConfig(tp_plan=kwargs.pop("tp_plan", None), tp_size=kwargs.pop("tp_size", None))
    return {**kwargs, "distributed_config": config}


def tensor_parallel_problem(model: nn.Module) -> Optional[str]:
    """Why a static-cache decode engine cannot run ``model`` (tensor-parallel), or ``None``."""
    world = tp_size(model)
    if world <= 1:
        return None
    return (f"the base is tensor-parallel over {world} ranks (tp_plan): the decode engine's captured steps and "
            "static KV cache run on one device and do not take part in the ranks' collectives. Use "
            "DeltaModel.generate(..., delta_names=[...]) on every rank under torchrun (one batch, a delta per "
            "row), or serve one base per GPU (DeltaServer / deltazip serve) if the base fits a GPU")
