"""One linear layer serving many deltas in one launch: reference, launcher and tuning table.

For a batch ``x [M, K]`` whose row ``m`` asked for delta ``row_delta[m]`` (``-1``: the plain
base model), :func:`multi_delta_linear` computes::

    y[m] = x[m] @ W_base^T + bias + x[m] @ dequant(stack[row_delta[m]])^T      (fp32 accumulation)

Design (the Triton kernel is in ``_multi_delta_triton.py``; its docstring has the details):

* **Fused.** The base matmul runs in the same kernel as the deltas: at decode sizes a layer is
  memory-bound and every byte counts (``2NK + U*NK*b/8``), and one launch per layer leaves no
  gaps. The kernel streams the base tile once per row block (16-64 sorted rows) and each delta a
  block uses once.
* **Sorted on the device.** Each program ranks the rows by delta id in registers (``M <= 64``;
  above that the launcher sorts with ``torch.argsort``, still on the device). No host sync, no
  data-dependent shape: the grid is ``cdiv(N, BN) * cdiv(M, 16) * split_k``, fixed by the
  shapes, so a captured CUDA graph stays right when the mix of deltas changes.
* **Split-K without a second launch.** Partial sums go to an fp32 workspace; the last program of
  each tile (a per-tile semaphore) sums them in a fixed order, so results are deterministic.
* **Two kernels.** Stacks in the planar kernel layout (``stack.layout_block > 0``: dense 2-, 4- and
  8-bit codes repacked by :func:`kernels.layout.repack_for_kernel` / :func:`kernels.layout.prepare_stack`
  when deltas are written into the stack) run ``planar_delta_linear_kernel``: each decoded code plane
  multiplies a contiguous slice of x, and rows come from the step's row-segment table
  (:func:`kernels.layout.build_row_segments`, passed as ``segments=``). Stacks in the file layout
  (3-bit, 2:4 not densified, shapes without whole blocks) run the generic kernel, which sorts rows itself.

On a CPU tensor without ``TRITON_INTERPRET=1`` the public function runs the reference.

Caveats: the kernel trusts ``row_delta`` to be in ``[-1, U)`` (it cannot check without a host
sync); a row with another id comes out as NaN instead of reading out of bounds. Launches that
split K share one semaphore buffer per device: do not run two of them at once on different
streams of one device.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import torch

from . import _interpreter_compat
from .delta_stack import DeltaStack, dequantize_delta
from .launch import LaunchPlan, plan_cache, tensor_key
from .launch import semaphores as _semaphores
from .launch import sm_count as _sm_count
from .layout import SEGMENT_FIELDS, build_row_segments

__all__ = [
    "MultiDeltaConfig",
    "multi_delta_linear",
    "multi_delta_linear_reference",
    "default_config",
    "auto_split_k",
    "layer_bytes",
    "set_default_backend",
    "set_gluon_block_rows",
    "set_gluon_stages",
    "gluon_decode_supported",
    "gluon_decode_available",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FUSED_SORT_MAX_M = 64
BACKENDS = ("auto", "triton")
#: most rows an ``accumulate=True`` launch may have for the Gluon decode kernel (decode steps)
GLUON_MAX_ROWS = 64
#: most rows per delta, when the caller knows it, for the Gluon decode kernel: it multiplies each decoded
#: weight tile by one block of 8 rows, so a delta with more rows has its codes decoded once per block (H100,
#: 8B shapes: 32 rows on one delta ran 0.88x the fused route with it against 0.97x with the Triton kernel;
#: BENCHMARKS.md section 3, "The Gluon decode kernel")
GLUON_MAX_ROWS_PER_DELTA = 8
#: rows per block the Gluon decode kernel may take (:attr:`MultiDeltaConfig.gluon_block_rows`)
GLUON_BLOCK_ROWS = (8, 16, 32)
#: copy-pipeline stages the Gluon decode kernel may take (:attr:`MultiDeltaConfig.gluon_stages`; 0: the launcher's)
GLUON_STAGES = (0, 2, 3, 4)
_DEFAULT_BACKEND = ["auto"]
_DEFAULT_GLUON_ROWS = [8]
_DEFAULT_GLUON_STAGES = [0]


def set_default_backend(backend: str) -> None:
    """The ``backend`` that :func:`default_config` gives (``"auto"`` or ``"triton"``; see
    :class:`MultiDeltaConfig`). For comparing the two kernels end to end."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _DEFAULT_BACKEND[0] = backend


def set_gluon_block_rows(rows: int) -> int:
    """The :attr:`MultiDeltaConfig.gluon_block_rows` that :func:`default_config` gives (8, 16 or 32; default 8):
    the Gluon decode kernel decodes a delta's codes once per block of that many of its rows. For comparing
    row blocks end to end (``deltazip bench serve --gluon-block-rows``). Returns the setting it replaces."""
    if rows not in GLUON_BLOCK_ROWS:
        raise ValueError(f"gluon_block_rows must be one of {GLUON_BLOCK_ROWS}, got {rows!r}")
    previous, _DEFAULT_GLUON_ROWS[0] = _DEFAULT_GLUON_ROWS[0], rows
    return previous


def set_gluon_stages(stages: int) -> int:
    """The :attr:`MultiDeltaConfig.gluon_stages` that :func:`default_config` gives (2, 3 or 4; 0, the default:
    the launcher's, three for 2-bit codes and four for 4-bit). For comparing launches end to end (``deltazip
    bench serve --gluon-stages``): with 16-row blocks two stages take the shared memory that three take with
    8-row blocks. Returns the setting it replaces."""
    if stages not in GLUON_STAGES:
        raise ValueError(f"gluon_stages must be one of {GLUON_STAGES}, got {stages!r}")
    previous, _DEFAULT_GLUON_STAGES[0] = _DEFAULT_GLUON_STAGES[0], stages
    return previous


_GLUON = {}


def _device_key(device: torch.device):
    if device.type != "cuda":
        return device.type
    return device.index if device.index is not None else torch.cuda.current_device()


def _gluon_available(device: torch.device) -> bool:
    """Gluon's Hopper ops import, and ``device`` is an sm_90 GPU (not under the Triton interpreter)."""
    if device.type != "cuda" or _interpreting():
        return False
    key = _device_key(device)
    if key not in _GLUON:
        ok = torch.cuda.get_device_capability(key) == (9, 0)
        if ok:
            try:
                from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
            except ImportError:
                ok = False
        _GLUON[key] = ok
    return _GLUON[key]


def gluon_decode_available(device) -> bool:
    """Whether ``accumulate=True`` launches on ``device`` can take the Gluon decode kernel: an sm_90 GPU whose
    Triton builds it (not turned off by a failed build), with the default backend ``"auto"``."""
    return _DEFAULT_BACKEND[0] == "auto" and _gluon_available(torch.device(device))


def _gluon_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says the Gluon kernel could not be built here (another Triton's Gluon API, a compiler
    failure), as opposed to an error of the launch itself."""
    try:
        from triton.compiler.errors import CompilationError
    except ImportError:  # pragma: no cover - Triton without the compiler's error module
        CompilationError = ()
    if isinstance(exc, CompilationError) or isinstance(exc, (ImportError, AttributeError, TypeError)):
        return True
    return isinstance(exc, RuntimeError) and "PassManager" in str(exc)


def _launch_gluon_or_planar(x, stack, segments, out, cfg, lut):
    """The Gluon decode kernel; if it cannot be built with this Triton, a warning (once per GPU), the Gluon
    kernel off for that GPU, and the planar Triton kernel instead."""
    from ._gluon_decode import gluon_delta_accumulate

    try:
        gluon_delta_accumulate(x, stack, segments, out, lut=lut, block_rows=cfg.gluon_block_rows,
                               stages=cfg.gluon_stages or None)
        return
    except Exception as exc:  # noqa: BLE001 - only build failures are handled, the rest re-raised
        if not _gluon_failed(exc):
            raise
        _GLUON[_device_key(x.device)] = False
        warnings.warn(f"the Gluon decode kernel does not build with this Triton ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); the Triton kernel adds the deltas instead", RuntimeWarning, stacklevel=3)
    _launch_planar(x, None, None, stack, segments, out, cfg, lut)


def uses_gluon(x: torch.Tensor, stack: DeltaStack, out: torch.Tensor, config: "MultiDeltaConfig",
               rows_per_delta: Optional[int] = None) -> bool:
    """Whether an ``accumulate=True`` launch adds its deltas with the Gluon decode kernel (see
    :attr:`MultiDeltaConfig.backend`)."""
    return (config.backend == "auto" and out.dtype == x.dtype and out.stride(1) == 1
            and (rows_per_delta is None or rows_per_delta <= max(GLUON_MAX_ROWS_PER_DELTA, config.gluon_block_rows))
            and gluon_decode_supported(x, stack))


def gluon_decode_supported(x: torch.Tensor, stack: DeltaStack) -> bool:
    """Whether the Gluon decode kernel can add ``stack``'s deltas for ``x`` (shape, format and GPU)."""
    bits, bkp, gs = stack.bits, stack.layout_block, stack.group_size
    if bits not in (2, 4) or bkp != 64 or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows copied 16 bytes at a time
        return False
    if x.shape[0] > GLUON_MAX_ROWS or x.shape[0] == 0 or stack.num_deltas == 0:
        return False
    planes = 16 // bits
    if gs == -1 or gs % bkp or planes % (gs // bkp):  # every k-step holds whole groups
        return False
    if stack.scales.dtype not in (torch.float16, torch.float32):
        return False
    return _gluon_available(x.device)


@dataclass(frozen=True)
class MultiDeltaConfig:
    """Launch parameters of the multi-delta kernel.

    Attributes:
        block_m: rows per program (sorted rows; 16 is the smallest MMA tile).
        block_n: output features per program.
        block_k: dense inputs per k-step of a delta pass (raised to what the format needs for a
            16-deep MMA; lowered to the group size when that is smaller and still deep enough).
        block_k_base: inputs per k-step of the base pass.
        split_k: programs that share one tile's K range (0: choose from the shape and the GPU).
        swap_ab: put the weight tile on the MMA's M side (``W x^T``) instead of ``x W^T``.
        wide_elements: read codes as 16-bit elements where that still gives 16-deep MMAs (two
            codes of a plane per register: no byte shuffling); off: always bytes.
        fast_dequant: on the GPU, turn codes into fp16/bf16 with inline PTX, two per
            instruction (2-, 4- and fp16 8-bit codes); off: plain Triton integer arithmetic.
        num_warps, num_stages: Triton's launch options.
        scale_in_weights: planar kernel only: multiply each decoded code by its group scale
            (one more packed instruction per two weights; the MMA then accumulates in place)
            instead of scaling each group's fp32 partial product.
        max_registers: planar kernel only: cap on registers per thread (0: the compiler's
            choice); lower caps let more programs share an SM (latency hiding).
        backend: which kernel adds the deltas of an ``accumulate=True`` launch. ``"auto"``: on an
            sm_90 GPU (H100 / H200), for steps of at most :data:`GLUON_MAX_ROWS` rows (and at most
            :data:`GLUON_MAX_ROWS_PER_DELTA` rows per delta when the caller says how many) over a
            planar 2- or 4-bit stack with blocks of 64 and fp16 / bf16 activations, the Gluon decode
            kernel (``kernels/_gluon_decode.py``: each plane's decode overlaps the MMAs in flight); the
            planar Triton kernel otherwise. ``"triton"``: always the Triton kernel.
        gluon_block_rows: rows of one delta the Gluon decode kernel multiplies by each decoded weight tile
            (8, 16 or 32): a delta with more rows has its codes decoded once per block, a larger block holds
            more accumulators and shared memory per program (:func:`set_gluon_block_rows` sets the default).
            On an H100 (BENCHMARKS.md section 3) 16-row blocks were 1.26-1.85x faster on 8B layers where every
            delta had 16 rows or more and 0.78-0.89x where deltas had fewer than 8; 32-row blocks were never the
            fastest. Default 8: the many-delta steps that take this kernel carry few rows per delta.
        gluon_stages: the Gluon decode kernel's ring of shared-memory buffers (copies in flight): 2, 3 or 4;
            0 (default): the launcher's, three for 2-bit codes and four for 4-bit (:func:`set_gluon_stages`).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    block_k_base: int = 64
    split_k: int = 0
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 3
    fast_dequant: bool = True
    wide_elements: bool = True
    scale_in_weights: bool = False
    max_registers: int = 0
    backend: str = "auto"
    gluon_block_rows: int = 8
    gluon_stages: int = 0


# --------------------------------------------------------------------------- reference
def multi_delta_linear_reference(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stack: DeltaStack,
    row_delta: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """What :func:`multi_delta_linear` computes, in plain PyTorch (fp32 dequantize, fp32 matmul).

    Synchronises with the device (it looks at ``row_delta`` on the host); meant for tests and as
    the CPU path.

    Raises:
        ValueError: shapes or dtypes do not fit, or a ``row_delta`` value is outside ``[-1, U)``.
    """
    _check_inputs(x, base_weight, bias, stack, row_delta, out_dtype, None, need_same_device=True)
    u_count = stack.num_deltas
    rd = row_delta.to(torch.int64)
    if rd.numel() and (int(rd.min()) < -1 or int(rd.max()) >= u_count):
        raise ValueError(
            f"row_delta values must be in [-1, {u_count}) (-1 = base model only), got "
            f"min {int(rd.min())}, max {int(rd.max())}"
        )
    xf = x.float()
    y = xf @ base_weight.float().t()
    if bias is not None:
        y = y + bias.float()
    for u in torch.unique(rd[rd >= 0]).tolist():
        rows = (rd == u).nonzero().squeeze(1)
        y[rows] += xf[rows] @ dequantize_delta(stack, u).t()
    return y.to(out_dtype or x.dtype)


# --------------------------------------------------------------------------- checks
def _check_inputs(x, base_weight, bias, stack, row_delta, out_dtype, out, need_same_device):
    if not isinstance(stack, DeltaStack):
        raise TypeError(f"stack must be a DeltaStack (see build_delta_stack), got {type(stack).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K]: flatten leading dims first, got {_shape(x)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    if base_weight is None:  # the deltas alone (accumulate=True): the stack gives the layer's shape
        n = stack.out_features
        if stack.in_features != k:
            raise ValueError(f"the delta stack is for a {stack.out_features}x{stack.in_features} layer, but x is "
                             f"[{m}, {k}]")
        if bias is not None:
            raise ValueError("bias must be None when base_weight is None: the output already holds the base's "
                             "product and its bias (accumulate=True)")
        base_weight = x  # for the checks below that only need a tensor on x's device
    elif base_weight.dim() != 2 or base_weight.shape[1] != k:
        raise ValueError(f"base_weight must be [N, K={k}] to match x [{m}, {k}], got {tuple(base_weight.shape)}")
    elif base_weight.dtype != x.dtype:
        raise ValueError(
            f"base_weight is {base_weight.dtype} but x is {x.dtype}: cast x to the base weight's dtype"
        )
    else:
        n = base_weight.shape[0]
    if stack.in_features != k or stack.out_features != n:
        raise ValueError(
            f"the delta stack is for a {stack.out_features}x{stack.in_features} layer, but base_weight is {n}x{k}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.dtype.is_floating_point):
        raise ValueError(f"bias must be a float tensor [N={n}] or None, got {bias.dtype} {tuple(bias.shape)}")
    if row_delta.dim() != 1 or row_delta.shape[0] != m or row_delta.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"row_delta must be int32 or int64 [M={m}] (one delta index per row, -1 = base only), got "
            f"{row_delta.dtype} {tuple(row_delta.shape)}"
        )
    if out_dtype is not None and out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16, float32 or None, got {out_dtype}")
    if out is not None:
        want = out_dtype or x.dtype
        if tuple(out.shape) != (m, n) or out.dtype != want or out.device != x.device or out.stride(1) != 1:
            raise ValueError(
                f"out must be a {want} [{m}, {n}] tensor on {x.device} with contiguous rows, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
            )
    if need_same_device and not (
        x.device == base_weight.device == row_delta.device == stack.qweight.device
        and (bias is None or bias.device == x.device)
    ):
        named = {"x": x, "base_weight": base_weight, "row_delta": row_delta, "stack": stack.qweight}
        if bias is not None:
            named["bias"] = bias
        devices = {name: t.device for name, t in named.items()}
        if len(set(devices.values())) != 1:
            where = ", ".join(f"{name} on {d}" for name, d in devices.items())
            raise ValueError(f"all inputs must be on one device: {where}; move them with .to(device)")


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


# --------------------------------------------------------------------------- tuning
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"




def _min_block_k(bits: int, sparse: bool) -> int:
    """Smallest k-step (dense inputs) whose code planes give a 16-deep MMA."""
    per_byte = 8 // (2 if bits <= 3 else bits)
    return 16 * per_byte * (2 if sparse else 1)


def auto_split_k(n: int, k: int, block_n: int, device: torch.device, waves: float = 2.0) -> int:
    """K splits that give about ``waves`` programs per SM for an ``n x k`` layer (one value per
    shape: the row blocks are not counted, so the grid and the compiled kernel stay fixed)."""
    if device.type != "cuda":
        return 1
    tiles = math.ceil(n / block_n)
    return max(1, min(round(waves * _sm_count(device) / tiles), k // 256))


_DEFAULT_CONFIGS = plan_cache()


def default_config(m: int, n: int, k: int, stack: DeltaStack, device: torch.device,
                   rows_per_delta: Optional[int] = None) -> MultiDeltaConfig:
    """Launch parameters for an ``[m, k] x [n, k]`` layer with ``stack``'s format on ``device`` (see
    :func:`_default_config`; memoized: a decode step asks for the same few shapes every token)."""
    key = (m, n, k, stack.layout_block, stack.bits, stack.num_deltas, rows_per_delta, device.type, device.index,
           _DEFAULT_BACKEND[0], _DEFAULT_GLUON_ROWS[0], _DEFAULT_GLUON_STAGES[0])
    cfg = _DEFAULT_CONFIGS.get(key)
    if cfg is None:
        cfg = _DEFAULT_CONFIGS[key] = replace(_default_config(m, n, k, stack, device, rows_per_delta),
                                              backend=_DEFAULT_BACKEND[0], gluon_block_rows=_DEFAULT_GLUON_ROWS[0],
                                              gluon_stages=_DEFAULT_GLUON_STAGES[0])
    return cfg


def _default_config(m: int, n: int, k: int, stack: DeltaStack, device: torch.device,
                    rows_per_delta: Optional[int] = None) -> MultiDeltaConfig:
    """Launch parameters for an ``[m, k] x [n, k]`` layer with ``stack``'s format on ``device``.

    Tuned on an H200 (``deltazip bench kernels --auto-tune`` / ``--variants``, BENCHMARKS.md
    section 3): 64 outputs per program, base k-steps of 64, 3 pipeline stages, K split for about
    four programs per SM (planar 4-bit stacks on layers of 8192 outputs or more and more than one
    row: 2 stages, six programs per SM; planar 2-bit stacks with 16-row blocks: at most 128
    registers per thread). Row blocks are as large as the rows per delta (16 to 64), so a batch of many
    rows over few deltas streams each weight once: ``rows_per_delta`` when the caller knows it (a
    prefill's rows mostly share one delta), else the rows spread evenly over the stack's deltas. Planar
    stacks with row blocks of 32-64 (prefills) take their own tiles: 2-bit with 64-row blocks 128 outputs
    per program on 8 warps, the others four pipeline stages; K is not split once one wave of row blocks
    fills the GPU. File-layout stacks keep K unsplit when their row blocks give the programs per SM aimed at.
    """
    if device.type != "cuda":
        return MultiDeltaConfig(block_n=32, block_k=64, block_k_base=64, split_k=1, swap_ab=False, num_stages=1)
    rows_per_delta = rows_per_delta or math.ceil(m / max(stack.num_deltas, 1))
    bm = 16 if rows_per_delta <= 16 else (32 if rows_per_delta <= 32 else 64)
    cfg = MultiDeltaConfig(block_m=bm)
    waves = 4.0
    if stack.layout_block and stack.bits >= 4 and n >= 8192 and m > 1:
        # planar 4-bit on wide layers: two stages and more programs (H200 sweep, BENCHMARKS.md;
        # one row keeps three stages: 10 % faster there)
        cfg = replace(cfg, num_stages=2)
        waves = 6.0
    if stack.layout_block and stack.bits == 2 and bm == 16:
        # planar 2-bit: 128 registers let four programs share an SM (uncapped: 167, three)
        cfg = replace(cfg, max_registers=128)
    if bm > 16 and stack.layout_block:
        # prefill-sized row blocks (H100 sweep, BENCHMARKS.md section 3, "Prefill tiles"): 2-bit with 64-row
        # blocks: 128 outputs per program over two warpgroups (1.4-2.9x); otherwise four pipeline stages
        # (4-bit 1.2-2.2x, 2-bit with 32-row blocks 1.1x)
        if stack.bits == 2 and bm == 64:
            cfg = replace(cfg, block_n=128, num_warps=8)
        else:
            cfg = replace(cfg, num_stages=4)
    # prefill-sized batches (many rows per delta) whose row blocks alone fill the GPU: splitting K on top only
    # adds partial sums (H200, 512 and 2048 rows over 16 deltas: 1.1-1.9x faster unsplit; BENCHMARKS.md section
    # 3, "Prefill-sized batches"); planar stacks from one wave of row blocks ("Prefill tiles"), others from `waves`
    row_programs = math.ceil(m / bm) * math.ceil(n / cfg.block_n)
    if bm > 16 and row_programs >= (1.0 if stack.layout_block else waves) * _sm_count(device):
        return replace(cfg, split_k=1)
    if bm == 16 and stack.layout_block and bm < m <= 2 * bm:
        # decode steps of 17-32 rows run two row blocks, which share the programs per SM aimed at: K is split
        # half as much (H200, 32 rows: 1.03x geometric mean over 1-32 deltas on the 8B layers, up to 1.20x at
        # 4 deltas; three row blocks split a third as much were slower; BENCHMARKS.md section 3, "Decode steps
        # of 32 rows")
        waves /= 2
    return replace(cfg, split_k=auto_split_k(n, k, cfg.block_n, device, waves=waves))


def layer_bytes(
    m: int, n: int, k: int, stack: DeltaStack, act_bytes: int = 2, deltas_used: Optional[int] = None
) -> int:
    """Bytes one call must move at least: base weight, each used delta once, activations in and out."""
    u = stack.num_deltas if deltas_used is None else deltas_used
    per_delta = stack.nbytes() // max(stack.num_deltas, 1)
    return n * k * act_bytes + u * per_delta + m * k * act_bytes + m * n * act_bytes


# --------------------------------------------------------------------------- launcher


def triton_kernel(name: str = "multi_delta_linear_kernel", module: str = "_multi_delta_triton"):
    """The compiled Triton kernel ``name`` of ``module`` (a module of this package; interpreted under
    ``TRITON_INTERPRET=1``); imports Triton on first use."""
    import importlib

    mod = importlib.import_module(f".{module}", __package__)  # triton is imported here, on first use
    if _interpreting():
        _interpreter_compat.ensure()
    kern = getattr(mod, name)
    interpreted = type(kern).__name__ == "InterpretedFunction"
    if interpreted != _interpreting():  # TRITON_INTERPRET changed since the first import
        mod = importlib.reload(mod)
        kern = getattr(mod, name)
    return kern


def multi_delta_linear(
    x: torch.Tensor,
    base_weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stack: DeltaStack,
    row_delta: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
    config: Optional[MultiDeltaConfig] = None,
    segments: Optional[torch.Tensor] = None,
    segment_lookup: Optional[torch.Tensor] = None,
    rows_per_delta: Optional[int] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """``y = x W_base^T + bias + x dequant(stack[row_delta[m]])^T`` per row, in one launch.

    Args:
        x: ``[M, K]`` activations, float16 or bfloat16 (float32 also works: slower, exact dots).
        base_weight: ``[N, K]`` base weight, same dtype as ``x``, rows contiguous.
        bias: ``[N]`` or ``None``.
        stack: the layer's :class:`DeltaStack` (``U`` deltas of one format class).
        row_delta: int32 / int64 ``[M]`` in ``[-1, U)``: the delta of each row, ``-1`` for the
            plain base model. Read on the device only; values outside the range give NaN rows.
        out_dtype: output dtype (default: ``x.dtype``).
        out: optional preallocated ``[M, N]`` output.
        config: launch parameters (default: :func:`default_config`).
        segments: the step's row-segment table of ``row_delta``
            (:func:`kernels.layout.build_row_segments`, int32 ``[4, M]``), built once per step and
            shared by every layer whose stacks use this ``row_delta``. Used by stacks in the planar
            layout (``stack.layout_block > 0``); when ``None`` the launcher builds it (a few small
            device ops per call). The caller must keep it in step with ``row_delta``.
        segment_lookup: int32 ``[T]``: when given, ``row_delta`` holds each row's *slot id* (``-1``:
            base) rather than its stack index, ``segments`` was built from those slot ids (one table
            shared by every layer of a step, whatever each layer's stack holds), and a row's stack
            index is ``segment_lookup[slot + 1]`` (``-1``: not in this stack), read in the kernel.
        rows_per_delta: how many rows share a delta, when the caller knows it without a device read
            (sizes the row blocks of the default config; ``None``: rows spread over the stack).
        accumulate: add each row's delta product to ``out``, which already holds the base's product
            (``x W_base^T + bias``, e.g. from one dense matmul that reads the base weight once for all
            rows); ``base_weight`` and ``bias`` must then be ``None``. Rows of the plain base (``-1``) keep
            their value. Planar stacks skip the base pass inside the kernel; other stacks add the
            result of a launch over an all-zero base.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``, accumulated in fp32.

    Raises:
        TypeError / ValueError: a shape, dtype or device does not fit (the message says which).

    Example:
        >>> y = multi_delta_linear(x, layer.weight, layer.bias, stack, row_delta)
    """
    if accumulate and (out is None or base_weight is not None or bias is not None):
        raise ValueError("accumulate=True adds the deltas to out, which holds the base's product already: pass "
                         "out=, and base_weight=None and bias=None")
    if base_weight is None and not accumulate:
        raise ValueError("base_weight is None: pass the base weight, or accumulate=True with out= holding the "
                         "base's product")
    _check_inputs(x, base_weight, bias, stack, row_delta, out_dtype, out, need_same_device=True)
    if config is not None and config.backend not in BACKENDS:
        raise ValueError(f"config.backend must be one of {BACKENDS}, got {config.backend!r}")
    if config is not None and config.gluon_block_rows not in GLUON_BLOCK_ROWS:
        raise ValueError(f"config.gluon_block_rows must be one of {GLUON_BLOCK_ROWS}, got {config.gluon_block_rows!r}")
    if config is not None and config.gluon_stages not in GLUON_STAGES:
        raise ValueError(f"config.gluon_stages must be one of {GLUON_STAGES}, got {config.gluon_stages!r}")
    device = x.device
    if segment_lookup is not None and (not stack.layout_block or segments is None):
        row_delta, segment_lookup = segment_lookup[row_delta.long() + 1], None  # slot ids -> stack indices
    add_to = None
    if accumulate and not (stack.layout_block and (device.type == "cuda" or _interpreting())):
        # the reference, and stacks without the planar kernel: the deltas over an all-zero base (one row read
        # for all), in float32, then added
        add_to, out, out_dtype = out, None, torch.float32
        base_weight = x.new_zeros(1, x.shape[1]).expand(stack.out_features, x.shape[1])
    if device.type != "cuda" and not _interpreting():
        y = multi_delta_linear_reference(x, base_weight, bias, stack, row_delta, out_dtype)
        if add_to is not None:
            return add_to.copy_(add_to.float() + y)
        if out is not None:
            out.copy_(y)
            return out
        return y
    if base_weight is not None and base_weight.stride(1) != 1:
        raise ValueError("base_weight must have contiguous rows (stride 1 along K): call .contiguous() once")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = stack.out_features
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=device)
    if m == 0 or n == 0:
        return out if add_to is None else add_to
    if config is None:
        config = default_config(m, n, k, stack, device, rows_per_delta)
    if stack.layout_block:
        if segments is None:
            segments = build_row_segments(row_delta)
        elif tuple(segments.shape) != (SEGMENT_FIELDS, m) or segments.dtype != torch.int32 or segments.device != device:
            raise ValueError(
                f"segments must be the int32 [{SEGMENT_FIELDS}, {m}] table of build_row_segments(row_delta) on "
                f"{device}, got {segments.dtype} {tuple(segments.shape)} on {segments.device}"
            )
        if segment_lookup is not None and (segment_lookup.dtype != torch.int32 or segment_lookup.device != device
                                           or segment_lookup.dim() != 1):
            raise ValueError(f"segment_lookup must be a 1-D int32 tensor on {device}")
        if add_to is None and base_weight is None and uses_gluon(x, stack, out, config, rows_per_delta):
            _launch_gluon_or_planar(x, stack, segments.contiguous(), out, config, segment_lookup)
        else:
            _launch_planar(x, base_weight, bias, stack, segments.contiguous(), out, config, segment_lookup)
    else:
        _launch(x, base_weight, bias, stack, row_delta.contiguous(), out, config)
    if add_to is not None:
        return add_to.copy_(add_to.float() + out)
    return out


def _split_grid(m, n, k, cfg, step, device):
    """(split, k_chunk, n_rblocks, n_tiles): K cut into ``split`` chunks of whole ``step``s."""
    split = cfg.split_k if cfg.split_k > 0 else auto_split_k(n, k, cfg.block_n, device, waves=4.0)
    k_chunk = math.ceil(math.ceil(k / split) / step) * step
    split = math.ceil(k / k_chunk)
    return split, k_chunk, math.ceil(m / cfg.block_m), math.ceil(n / cfg.block_n)


def _workspace(split, n_rblocks, bm, n, n_tiles, out):
    if split > 1:
        ws = torch.empty((split, n_rblocks * bm, n), dtype=torch.float32, device=out.device)
        return ws, _semaphores(out.device, n_tiles * n_rblocks)
    return out, out


def _magic(x_dtype, bits):
    if x_dtype == torch.float16:
        return 1
    if x_dtype == torch.bfloat16 and bits <= 4:
        return 2
    return 0


_PLANAR_PLANS = plan_cache()


def _launch_planar(x, base_weight, bias, stack, segments, out, cfg: MultiDeltaConfig, lut=None):
    """``base_weight=None``: the deltas alone, added to what ``out`` holds (``multi_delta_linear(accumulate=True)``)."""
    m, k = x.shape
    n = stack.out_features
    has_base = base_weight is not None
    if not has_base:
        base_weight = x  # never read (HAS_BASE off); any valid pointer will do
    u_count = stack.num_deltas
    q, s, z = (stack.qweight, stack.scales, stack.zeros) if u_count > 0 else (x, x, x)
    kern = triton_kernel("planar_delta_linear_kernel")
    # every tensor argument's dtype and alignment: what Triton's compiled kernel was specialized on (ws and
    # the counters are the output itself without split-K, else fresh float32 / int32 buffers)
    tensors = (x, base_weight, q, s, z, segments, out) + ((bias,) if bias is not None else ()) + ((lut,) if lut is not None else ())
    key = (id(kern), m, n, k, x.device, x.stride(0), base_weight.stride(0), out.stride(0), stack.bits,
           stack.group_size, stack.layout_block, u_count, stack.qweight.shape[2], stack.num_groups, cfg,
           bias is not None, lut is not None, has_base, tensor_key(*tensors))
    hit = _PLANAR_PLANS.get(key)
    if hit is None:
        hit = _PLANAR_PLANS[key] = _planar_plan(kern, m, n, k, x.dtype, x.device, x.stride(0), base_weight.stride(0),
                                                 out.stride(0), stack, cfg, bias is not None, lut is not None,
                                                 has_base)
    plan, (split, n_rblocks, n_tiles) = hit
    ws, cnt = _workspace(split, n_rblocks, cfg.block_m, n, n_tiles, out)
    plan.launch(x, base_weight, bias if bias is not None else out, q, s, z, segments, lut if lut is not None else segments,
                out, ws, cnt)


def _planar_plan(kern, m, n, k, x_dtype, device, sx, sw, so, stack, cfg: MultiDeltaConfig, has_bias, has_lut,
                 has_base=True):
    from . import _multi_delta_triton as tmod

    bits, gs, bkp = stack.bits, stack.group_size, stack.layout_block
    planes = 16 // bits
    lb = planes * bkp  # inputs per k-step (one layout block)
    ppg = planes if gs == -1 else min(planes, gs // bkp)  # planes per quantization group
    bkb = min(cfg.block_k_base, lb)
    split, k_chunk, n_rblocks, n_tiles = _split_grid(m, n, k, cfg, lb, device)
    magic = _magic(x_dtype, bits)
    fast = cfg.fast_dequant and not _interpreting() and magic in (1, 2) and not (magic == 2 and bits == 8)
    names = list(kern.arg_names)
    tensors = names[:11]  # x, base, bias, q, s, z, segments, lut, out, ws, counters
    scalars = [m, n, k, stack.num_deltas, stack.qweight.shape[2] // 2, stack.num_groups,
               (gs if gs > 0 else 1 << 30).bit_length() - 1, k_chunk, sx, sw, so]
    args = {name: None for name in tensors}
    args.update(zip(names[11:11 + len(scalars)], scalars))
    args.update(
        BITS=bits, HAS_BIAS=has_bias, HAS_LUT=has_lut, HAS_BASE=has_base, ACCUM=not has_base, BM=cfg.block_m, BN=cfg.block_n, BKP=bkp, BKB=bkb, PPG=ppg,
        SPLIT=split, SWAP=cfg.swap_ab, MAGIC=magic, SCALE_W=cfg.scale_in_weights,
        DOT_PREC="ieee" if x_dtype == torch.float32 else "tf32", FAST=fast,
        **tmod.planar_asm_args(bits, magic, cfg.scale_in_weights),
    )
    plan = LaunchPlan(kern, (n_tiles * n_rblocks * split,), args, tensors,
                      dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_reg_cap(cfg)))
    return plan, (split, n_rblocks, n_tiles)


def _reg_cap(cfg: MultiDeltaConfig) -> dict:
    return {"maxnreg": cfg.max_registers} if cfg.max_registers and not _interpreting() else {}


def _launch(x, base_weight, bias, stack, row_delta, out, cfg: MultiDeltaConfig):
    m, k = x.shape
    n = base_weight.shape[0]
    bits, sparse, gs = stack.bits, stack.sparse_2of4, stack.group_size
    u_count = stack.num_deltas

    min_bk = _min_block_k(bits, sparse)
    bk = max(cfg.block_k, min_bk)
    if gs > 0 and bk > gs >= min_bk:
        bk = gs  # a k-step inside one group: scale once per step
    per_elem = gs > 0 and gs % bk != 0
    bkb = cfg.block_k_base
    kmax = max(bk, bkb)
    split, k_chunk, n_rblocks, n_tiles = _split_grid(m, n, k, cfg, kmax, x.device)
    bm, bn = cfg.block_m, cfg.block_n
    grid = (n_tiles * n_rblocks * split,)

    fused_sort = m <= FUSED_SORT_MAX_M
    mp = FUSED_SORT_MAX_M if fused_sort else 16  # fixed: one compile serves every M <= 64
    perm = row_delta if fused_sort else torch.argsort(row_delta, stable=True)

    ws, cnt = _workspace(split, n_rblocks, bm, n, n_tiles, out)
    magic = _magic(x.dtype, bits)
    if u_count > 0:
        q, s, z = stack.qweight, stack.scales, stack.zeros
        pos = stack.positions if sparse else q
    else:  # nothing to read: any valid pointer will do
        q = s = z = pos = x
    fast = (cfg.fast_dequant and not _interpreting() and magic != 0 and bits in (2, 4, 8) and (bits != 8 or magic == 1)
            and not (sparse and bits == 8))
    # 16-bit packed elements (two codes of a plane per register) when they still give 16-deep
    # MMAs; bytes otherwise (3-bit, and 2-bit 2:4 at k-steps of 128)
    slots = bk // 2 if sparse else bk
    per_elem16 = 16 // (2 if bits <= 3 else bits)
    ew = 16 if (cfg.wide_elements and bits != 3 and slots // per_elem16 >= 16 and stack.qweight.shape[2] % 2 == 0
                and not (sparse and per_elem16 == 8)) else 8
    kq = stack.kept_features
    kern = triton_kernel()
    kern[grid](
        x, base_weight, bias if bias is not None else out, q, s, z, pos, row_delta, perm,
        out, ws, cnt,
        m, n, k, u_count, kq, stack.qweight.shape[2] * 8 // ew, stack.num_groups, math.ceil(k / 8),
        math.ceil(kq / 4), (gs if gs > 0 else 1 << 30).bit_length() - 1, k_chunk,
        x.stride(0), base_weight.stride(0), out.stride(0),
        BITS=bits, SPARSE=sparse, HAS_BIAS=bias is not None,
        FUSED_SORT=fused_sort, MP=mp,
        BM=bm, BN=bn, BK=bk, BKB=bkb,
        SPLIT=split, SWAP=cfg.swap_ab, PER_ELEM=per_elem, MAGIC=magic,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", FAST=fast, EVEN_K=k % kmax == 0, EW=ew,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
