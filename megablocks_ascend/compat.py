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
* :func:`ascend_row_select` finds triton-ascend's ``index_select_simd`` (a row gather from global
  memory into the Unified Buffer), the builtin the routing kernels' ``SELECT`` form calls on an NPU.
* :func:`dot_needs_float32` says where ``tl.dot`` cannot take bfloat16 operands as they are: the
  Triton interpreter keeps bfloat16 as its uint16 bit patterns and multiplies those.
* :func:`active_drivers` and :func:`autotuner_needs_driver` tell whether Triton has a
  driver here and whether its ``triton.autotune`` asks for one when a kernel is decorated
  (Triton 3.3.1 and triton-ascend 3.2.0 do; Triton 3.9 waits until it benchmarks);
  :class:`RefusingBenchmarker` is what the ``triton-driverless`` patch hands such an
  autotuner instead (see ``patches/triton-driverless.md``).
* :func:`interpreter_index_broken` tells whether this Triton's interpreter fails to use a
  scalar as a loop bound or index with this NumPy (Triton 3.3.1 and 3.6.0 with NumPy >= 2.4), and
  :func:`interpreter_index` is the conversion newer Triton uses (``patches/triton-interpreter-index.md``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import types
import warnings
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


ASCEND_GATHER_MODULES = ("triton.language.extra.ascend.libdevice", "triton.language.extra.cann.extension")


def ascend_row_select(modules=ASCEND_GATHER_MODULES):
    """triton-ascend's ``index_select_simd`` builtin (rows of a 2-D tensor in global memory, picked by an
    index vector, to a tile in the Unified Buffer), or ``None`` where this Triton has none (standard
    Triton, the interpreter). triton-ascend 3.2.0 has it in ``triton.language.extra.ascend.libdevice``
    (put there when ``triton`` is imported); later releases also in ``triton.language.extra.cann.extension``.
    Returns the module holding it, which is what a kernel calls it through."""
    if not is_triton_ascend():
        return None
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, "index_select_simd", None)):
            return module
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

    ``kernel[grid](*args, **meta)`` (or ``kernel.launch(grid, *args, **meta)``) launches
    ``triton.jit(fn)``: compiled for CUDA tensors
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

    def launch(self, grid, *args, **kwargs):
        """``kernel[grid](*args, **kwargs)`` without the closures the indexing makes per call (ours
        and Triton's): the launchers call this on every routing call."""
        # Our kernels take a tensor first; the CPU check is one attribute test.
        if args[0].is_cpu and not interpreter_active():
            raise RuntimeError(f"cannot run Triton kernel {self.__name__} on CPU tensors: " + INTERPRETER_HINT)
        return self.jit.run(*args, grid=grid, warmup=False, **kwargs)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def __repr__(self) -> str:
        return f"Kernel({self.__name__})"


def kernel(fn: Callable) -> Kernel:
    """Decorator: ``@kernel`` in place of ``@triton.jit``."""
    return Kernel(fn)


def dot_needs_float32(dtype, device) -> bool:
    """Whether a kernel must widen ``dtype`` operands to float32 before ``tl.dot`` on ``device``.

    The Triton interpreter (CPU tensors) stores bfloat16 as uint16 and its ``tl.dot`` multiplies
    those integers (seen with triton 3.3.1 and 3.9.0: results off by ~1e10). A bfloat16 product is
    exact in float32, so widening first gives what a bfloat16 matrix unit computes with a float32
    accumulator. Compiled Triton (CUDA, NPU) takes bfloat16 operands directly.
    """
    import torch  # noqa: PLC0415
    return device.type == "cpu" and dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------
# Machines where Triton has no driver (a CPU machine; triton-ascend without an NPU).


class NoTritonDriver(RuntimeError):
    """Triton has no active driver here, and something asked it to time a kernel."""


def active_drivers() -> list[str]:
    """Names of the Triton backends whose driver is active on this machine (what Triton's own
    driver lookup counts: it needs exactly one). Empty on a CPU machine, and with triton-ascend
    where CANN's compiler is missing; the Triton interpreter is not a driver."""
    from triton.backends import backends  # noqa: PLC0415
    found = []
    for name, backend in backends.items():
        with warnings.catch_warnings():  # triton-ascend warns when it finds no CANN compiler
            warnings.simplefilter("ignore")
            try:
                active = bool(backend.driver.is_active())
            except Exception:  # noqa: BLE001 - a driver that cannot even tell is not active
                active = False
        if active:
            found.append(name)
    return found


def autotuner_needs_driver() -> bool:
    """Whether ``triton.autotune`` asks the driver for a benchmarker when it decorates a kernel.

    Triton 3.3.1 and triton-ascend 3.2.0 call ``driver.active.get_benchmarker()`` in
    ``Autotuner.__init__`` unless a ``do_bench`` is given; Triton 3.9 makes ``do_bench`` a
    (cached) property that asks only when it benchmarks.
    """
    from triton.runtime.autotuner import Autotuner  # noqa: PLC0415
    lazy = inspect.getattr_static(Autotuner, "do_bench", None)
    return not isinstance(lazy, (property, functools.cached_property))


class RefusingBenchmarker:
    """The ``do_bench`` given to an autotuner on a machine without a Triton driver.

    It never times anything: an autotuner with one config never calls it, and one with several
    that is asked to choose raises :class:`NoTritonDriver` before any of its configs runs.
    """

    def __init__(self, kernel: str, num_configs: int):
        self.kernel = kernel
        self.num_configs = num_configs

    def __call__(self, kernel_call, quantiles=None, **kwargs):
        del kernel_call, quantiles, kwargs
        raise NoTritonDriver(
            f"triton.autotune of {self.kernel} was asked to time its {self.num_configs} configs, but "
            "Triton has no active driver on this machine (no CUDA GPU, no Ascend NPU with CANN), so "
            "there is nothing to time them on. Run it where Triton has a device; in the Triton "
            "interpreter, narrow the autotuner to one config (`kernel.configs = kernel.configs[:1]`). "
            "(megablocks-ascend patch triton-driverless; see patches/triton-driverless.md)")

    def __repr__(self) -> str:
        return f"RefusingBenchmarker({self.kernel!r}, {self.num_configs})"


# ------------------------------------------------------------------------------------------
# The interpreter's scalar-to-int conversion (Triton 3.3.1 and 3.6.0 with NumPy >= 2.4).


def interpreter_index(self) -> int:
    """``tl.tensor.__index__`` in the interpreter, as Triton 3.9 defines it.

    Interpreted scalars (``tl.program_id(0)``, a ``tl.sum``, a scalar argument) hold a NumPy
    array of shape ``(1,)``. Triton 3.3.1 and 3.6.0 convert it with ``int(data)``, which NumPy
    deprecated in 1.25 and refuses from 2.4 on ("only 0-dimensional arrays can be converted to
    Python scalars"); ``squeeze()`` first makes it 0-dimensional. An array of more than one
    element is still refused.
    """
    return int(self.handle.data.squeeze())


# The two forms of the interpreter function that defines tl.tensor's methods before each launch:
# Triton 3.3.1 sets them directly; 3.6 and 3.9 set them through a scope that restores them after.
INTERPRETER_TENSOR_FORMS = (("tensor",), ("tensor", "scope"))


class _SetAttrScope:
    """Stands in for the interpreter's patch scope (``set_attr`` only) in the probe below."""

    def set_attr(self, obj, name, value):
        setattr(obj, name, value)


def interpreter_index_broken() -> bool:
    """Whether the interpreter's ``tl.tensor.__index__`` (which ``range(pid, n, step)`` in a
    kernel calls) raises on an interpreted scalar with the installed NumPy.

    Checked by running the interpreter's own ``_patch_lang_tensor`` on a stand-in class and
    converting a shape-``(1,)`` array with the ``__index__`` it defines, so it answers for the
    Triton and NumPy at hand rather than from version numbers (Triton 3.3.1 and 3.6.0 with NumPy
    2.4: broken; Triton 3.9: not). ``False`` for an interpreter organised some other way.
    """
    import numpy as np  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415

    define = getattr(interpreter, "_patch_lang_tensor", None)
    if define is None:
        return False
    try:
        params = tuple(inspect.signature(define).parameters)
    except (TypeError, ValueError):
        return False
    if params not in INTERPRETER_TENSOR_FORMS:
        return False

    class Probe:
        pass

    define(Probe, *([_SetAttrScope()] if len(params) == 2 else []))
    probe = Probe()
    probe.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
    try:
        return Probe.__index__(probe) != 3
    except TypeError:
        return True
