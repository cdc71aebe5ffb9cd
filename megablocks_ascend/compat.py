"""What differs between standard Triton, triton-ascend, and the Triton interpreter.

Kernels in this package are written once, against the subset of ``triton.language``
that standard Triton (CUDA), triton-ascend (NPU) and the Triton interpreter (CPU)
all implement. This module is the only place that knows about the differences:

* :class:`Kernel` wraps one kernel function: compiled by ``triton.jit`` for CUDA and NPU
  tensors, run by the Triton interpreter for CPU tensors, with a clear error when the
  interpreter was not switched on before ``triton`` was imported.
* :func:`slice_ops` resolves triton-ascend's slice operations (``insert_slice``,
  ``extract_slice``, ``get_element``) across its API generations: they live in
  ``triton.language`` in triton-ascend 3.2.x and in
  ``triton.language.extra.cann.extension`` in later releases; standard Triton has
  neither. Our kernels do not need them today (2-D pointer tiles lower to per-row
  DMA on Ascend, see ``docs/notes/ascend-lowering.md``); the resolver exists so a
  kernel that does never imports a triton-ascend name directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any, Callable

import triton

SLICE_OP_NAMES = ("insert_slice", "extract_slice", "get_element")


def is_triton_ascend() -> bool:
    """True when the installed ``triton`` package is triton-ascend."""
    return importlib.util.find_spec("triton.backends.ascend") is not None


def slice_ops(language: Any = None, extension_module: str = "triton.language.extra.cann.extension"):
    """Return a namespace with triton-ascend's slice ops, or ``None`` where they do not exist.

    ``language`` defaults to ``triton.language``; it is a parameter so each branch can be
    tested without installing each triton-ascend generation.
    """
    if language is None:
        import triton.language as language  # noqa: PLC0415
    if all(hasattr(language, name) for name in SLICE_OP_NAMES):
        return types.SimpleNamespace(source=language.__name__,
                                     **{n: getattr(language, n) for n in SLICE_OP_NAMES})
    try:
        ext = importlib.import_module(extension_module)
    except ImportError:
        return None
    if all(hasattr(ext, name) for name in SLICE_OP_NAMES):
        return types.SimpleNamespace(source=ext.__name__, **{n: getattr(ext, n) for n in SLICE_OP_NAMES})
    return None


INTERPRETER_HINT = (
    "CPU tensors run our Triton kernels through the Triton interpreter, which must be switched on "
    "before `triton` is first imported: set TRITON_INTERPRET=1 in the environment, or import "
    "megablocks_ascend before anything imports triton (on a machine without CUDA or NPU devices it "
    "switches the interpreter on by itself)."
)


_interpreting = False  # once seen, for good: the mode is fixed when triton is imported


def interpreter_active() -> bool:
    """True when ``triton`` was imported in interpreter mode, so CPU tensors can run kernels.

    ``TRITON_INTERPRET`` is read when ``triton.language`` defines its own library functions
    (``tl.max``, ``tl.sum``, ``tl.cdiv``...), so setting it after ``import triton`` is too late;
    this checks those functions, not the variable. (Asked on every routing call on CPU tensors:
    a True answer is remembered, as nothing can switch the interpreter off again.)
    """
    global _interpreting
    if _interpreting:
        return True
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    import triton.language.standard as standard  # noqa: PLC0415
    _interpreting = isinstance(getattr(standard, "sum", None), InterpretedFunction)
    return _interpreting


class Kernel:
    """One Triton kernel source, launchable on every target.

    ``kernel[grid](*args, **meta)`` launches ``triton.jit(fn)``: compiled for CUDA tensors
    (standard Triton) and NPU tensors (triton-ascend), interpreted for CPU tensors when the
    Triton interpreter is on, and a clear error for CPU tensors when it is not. ``kernel.jit``
    is what the Ascend lowering gate hands to triton-ascend's front end.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jit = None

    @property
    def jit(self):
        if self._jit is None:
            self._jit = triton.jit(self.fn)
        return self._jit

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # Our kernels take a tensor first; the CPU check is one attribute test on a device.
            if args[0].device.type == "cpu" and not interpreter_active():
                raise RuntimeError(f"cannot run Triton kernel {self.__name__} on CPU tensors: " + INTERPRETER_HINT)
            return self.jit[grid](*args, **kwargs)
        return launch

    def __repr__(self) -> str:
        return f"Kernel({self.__name__})"


def kernel(fn: Callable) -> Kernel:
    """Decorator: ``@kernel`` in place of ``@triton.jit``."""
    return Kernel(fn)
