"""Cached launch plans: the host work of a kernel launch done once per shape instead of once per call.

An eager decode step launches one kernel per linear layer, a few hundred per token, and at small
shapes (a 270M model, one row) the host-side work of each launch (choosing the launch settings,
building the constexpr arguments, Triton's argument binding and cache lookup) took longer than the
kernel. A :class:`LaunchPlan` holds everything about a launch that its key fixes: the grid, every
scalar and constexpr argument in the kernel's order, and the launch options. A call fills in the
tensors.

The first call of a plan goes through Triton's ``kernel[grid](...)`` (which compiles, specializes and
checks); later calls of a compiled (not interpreted) kernel call the compiled launcher that call
returned, with the same arguments, skipping the binding and the cache lookup. That is only right
when the specialization Triton chose still holds, so a plan's key must fix every integer argument
and every tensor argument's dtype and 16-byte alignment (:func:`tensor_key`: a kernel compiled for a
bfloat16 output called with a float32 one writes out of bounds), which is what the callers' keys do.
The direct call is skipped while a Triton launch hook is installed (a profiler). It is **off by
default** and turned on with ``DELTAZIP_DIRECT_LAUNCH=1``: its first GPU run keyed plans without the
dtypes of the tensor arguments, and a layer whose delta stack kept float32 scales reused a kernel
compiled for float16 ones (an illegal memory access); the key now holds every dtype, and the GPU tests
of those cases pass (tests/test_launch_plans.py), but no full workload has run with it on yet. Without
it every call goes through Triton's JIT, which specializes each call itself (measured on an H200 at a
270M model's shapes: about 120 µs more per launch than the direct call); the rest of the plan
(settings and arguments worked out once) applies either way.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = ["LaunchPlan", "tensor_key", "plan_cache", "sm_count", "semaphores", "blocks_per_sm"]

_MAX_PLANS = 4096


def _direct_allowed() -> bool:
    return os.environ.get("DELTAZIP_DIRECT_LAUNCH", "0") == "1" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def tensor_key(*tensors) -> tuple:
    """What Triton specializes a launch on for these tensor arguments: each one's dtype (the pointer
    type of the compiled kernel) and whether its data starts on 16 bytes (``True`` for all of them in
    the common case, else one flag per tensor)."""
    ptrs = [t.data_ptr() for t in tensors]
    any_off = 0
    for p in ptrs:
        any_off |= p
    dtypes = tuple(t.dtype for t in tensors)
    if any_off % 16 == 0:
        return dtypes, True
    return dtypes, tuple(p % 16 == 0 for p in ptrs)


class LaunchPlan:
    """One kernel launch with everything but its tensor arguments fixed.

    Args:
        kernel: the ``@triton.jit`` function (compiled or interpreted).
        grid: the launch grid (a tuple of up to three ints).
        args: every argument of the kernel by name; the ones named in ``tensors`` are placeholders.
        tensors: names of the arguments each call passes, in the order :meth:`launch` takes them.
        options: Triton launch options (``num_warps``, ``num_stages``, ...).
    """

    __slots__ = ("kernel", "grid", "options", "_template", "_where", "_compiled", "_device")

    def __init__(self, kernel, grid: Sequence[int], args: dict, tensors: Sequence[str], options: dict):
        names = list(kernel.arg_names)
        missing = [n for n in names if n not in args]
        if missing:
            raise ValueError(f"launch plan for {kernel.__name__ if hasattr(kernel, '__name__') else kernel}: "
                             f"no value for {missing}")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.options = options
        self._template = [args[n] for n in names]
        self._where = [names.index(n) for n in tensors]
        self._compiled = None
        self._device = None

    def launch(self, *tensors) -> None:
        vals = self._template.copy()
        for i, t in zip(self._where, tensors):
            vals[i] = t
        ck = self._compiled
        if ck is not None and _no_hooks():
            dev = torch.cuda.current_device()  # Triton's JIT keys its compiled kernels and stream by it too
            if dev == self._device:
                ck.run(self.grid[0], self.grid[1], self.grid[2], _raw_stream(dev), ck.function, ck.packed_metadata,
                       None, None, None, *vals)
                return
        result = self.kernel[self.grid](*vals, **self.options)
        if ck is None and _direct_allowed() and _usable(result):
            self._compiled, self._device = result, torch.cuda.current_device()


def _usable(ck) -> bool:
    # a compiled kernel whose launcher takes (grid, stream, function, metadata, hooks, *args): Triton 3.x
    try:
        return ck is not None and callable(ck.run) and ck.function is not None and hasattr(ck, "packed_metadata")
    except Exception:  # noqa: BLE001 - another Triton version's object: keep the JIT path
        return False


def _raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _no_hooks() -> bool:
    try:
        from triton import knobs
    except ImportError:  # older Triton: no hook chains
        return True
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def plan_cache() -> dict:
    """A dict (of plans, or other per-shape launch work) that forgets everything when it grows past a few
    thousand entries."""
    return _BoundedDict()


class _BoundedDict(dict):
    def __setitem__(self, key, value):
        if len(self) >= _MAX_PLANS:
            self.clear()
        super().__setitem__(key, value)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 4 for a CPU, where only the interpreter runs)."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def blocks_per_sm(regs_per_thread: int, shared_bytes: int, num_warps: int, *, regs_per_sm: int = 65536,
                  shared_per_sm: int = 233472, reserved_shared: int = 1024, max_threads: int = 2048,
                  max_blocks: int = 32) -> int:
    """Programs of a kernel one SM holds at once, from the registers per thread and the shared memory per
    program it compiled to (what a persistent kernel's grid should be per SM: a program beyond it waits for
    another to exit, a whole extra round). The defaults are Hopper's (sm_90): registers are allocated per
    warp in units of 256, every program's shared memory has 1 KiB reserved beside it."""
    warp_regs = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    by_regs = (regs_per_sm // warp_regs) // num_warps
    by_shared = shared_per_sm // (shared_bytes + reserved_shared)
    by_threads = max_threads // (num_warps * 32)
    return max(0, min(by_regs, by_shared, by_threads, max_blocks))


_COUNTERS: dict = {}


def semaphores(device: torch.device, count: int) -> torch.Tensor:
    """The int32 split-K counters every multi-delta kernel shares on ``device`` (at least ``count``, all zero
    between launches: each launch resets the ones it used)."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "multi_delta_linear needs its split-K semaphores allocated before CUDA graph capture: "
                "run the layer once (a warm-up) before capturing"
            )
        buf = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
