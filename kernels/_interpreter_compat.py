"""Keep the Triton interpreter usable with NumPy 2.4 and later on Triton releases before 3.7.

The interpreter (``TRITON_INTERPRET=1``) stores every scalar as a one-element NumPy array and gives
its tensors an ``__index__`` of ``int(data)``. NumPy 2.4 turned ``int()`` of an array with one
dimension into an error ("only 0-dimensional arrays can be converted to Python scalars"), so on
Triton 3.6 any kernel loop whose bounds are runtime values (``range(k_begin, k_end, BK)``) fails
under the interpreter, although the compiled kernel is unaffected. Later Triton releases squeeze the
array first; :func:`ensure` installs the same ``__index__`` on the releases that lack it, once, and
only when the interpreter would fail. Nothing changes for compiled kernels.
"""

from __future__ import annotations

_DONE = False


def _needs_patch() -> bool:
    import numpy as np

    try:
        int(np.array([1]))
    except TypeError:
        return True
    return False


def ensure() -> None:
    """Install a squeezing ``__index__`` on the interpreter's tensors if this NumPy needs it."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    if not _needs_patch():
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "deltazip_squeezes_index", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor.deltazip_squeezes_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
