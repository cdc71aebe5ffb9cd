"""The harness's instruments: what a block of PyTorch code launches, and where it reads device values
on the host, counted on any device (CUDA, an Ascend NPU, or the CPU standing in for one).

**Launches.** ``LaunchCounter`` records, while a block runs,

* every **aten op that would launch a device kernel** (a ``TorchDispatchMode``): each op that
  reaches the dispatcher, except views and other ops that only make or change tensor metadata
  (:func:`launches_kernel` says which), counted once even where its device implementation is
  several kernels (a CUB radix sort is ~10, a cumsum 1-3; ``torch.profiler`` on a GPU counts those:
  ``benchmarks/bench_steps.py``'s ``kernels`` column, ``benchmarks/launches_per_step.py``);
* every **Triton kernel launch**: the Triton launcher is hooked (``JITFunction.run`` compiled,
  ``GridExecutor.__call__`` in the interpreter; an autotuned or heuristics-wrapped kernel ends
  there too, so every Triton kernel is counted once per launch, ours, MegaBlocks' and stk's alike);
* every **collective** of ``torch.distributed`` (the ``c10d`` ops an expert-parallel layer's
  ``all_to_all_single`` reaches the dispatcher as), one launch each (NCCL runs one kernel per
  collective).

The Triton interpreter runs a kernel on CPU tensors by copying each argument into NumPy and the
results back (``Tensor.cpu``, ``copy_``...): device work that a compiled launch does not do. While
a Triton launch runs, the dispatch mode counts nothing, so those copies are not counted, and a
kernel costs one launch in the interpreter as it does on a device.

Where the tensors are on an accelerator (``device="cuda"``/``"npu"``), an op counts only when one
of its tensors is on that device (an op on host tensors launches nothing there); on the CPU, the
stand-in for a device, every op counts (``Tensor.cpu()`` of a CPU tensor does not reach the
dispatcher, so a device-to-host copy is not seen there: :class:`HostSyncs` finds those).

With ``where=True`` each launch also records the source line that caused it: the innermost frame
outside torch and this module (MegaBlocks, stk, megablocks_ascend, the caller), and for the
backward of a torch op (an autograd node implemented in C++) the node's name and the line of the
forward that created it (recorded by anomaly mode with its NaN checks off, which adds no op).

    with LaunchCounter(where=True) as launches:
        step()
    launches.total, launches.by_name(), print(launches.report())

**Host syncs.** A host sync drains the device's queue (the host waits for the device to reach the
point where the value is ready) and cannot be captured in a CUDA/NPU graph. ``HostSyncs`` records
them, in two layers, while a block runs:

* a ``TorchFunctionMode`` sees the Python-level reads: ``Tensor.item``, ``tolist``, ``numpy``,
  ``__array__``, ``__bool__``/``__int__``/``__float__``/``__index__``/``__complex__``,
  ``__repr__``/``__str__``/``__format__``, ``Tensor.cpu`` and ``Tensor.to``/``copy_`` across
  devices, and host data turned into device tensors (``torch.tensor``, ``as_tensor``,
  ``from_numpy``), which graph capture also refuses;
* a ``TorchDispatchMode`` sees what reaches the dispatcher from C++ too:
  ``aten._local_scalar_dense`` (every ``.item()``), cross-device ``_to_copy``/``copy_``, and the
  ops whose output size depends on the data, which sync internally on CUDA (``nonzero``,
  ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``,
  boolean-mask indexing, ``equal``, ``is_nonzero``).

On a machine without an accelerator everything runs on the CPU, where a "device" read costs
nothing and ``Tensor.cpu()`` on a CPU tensor does not even reach the dispatcher. With
``cpu_is_device=True`` (the default) the detector therefore treats CPU tensors as device tensors:
any read of their values into Python, and any ``.cpu()``/``.to("cpu")``, counts, as it would on an
accelerator. That is what makes the check meaningful on CPU: MegaBlocks'
``tokens_per_expert.cpu()`` and the grouped GEMM's ``batch_sizes.tolist()`` are caught there. With
the tensors on an accelerator (``cpu_is_device=False``) only reads of device tensors count.

The Triton interpreter stands in for the device on CPU; reads made from inside it (it copies
its arguments through numpy) are device work, not host syncs, and are not counted.

    with HostSyncs() as syncs:
        step()
    syncs.events, print(syncs.report())

**Custom ops.** A ``torch.library`` custom op reaches a dispatch mode as one opaque op and runs its
Python implementation with both kinds of modes switched off, which would hide whatever it does;
both instruments run that implementation themselves, under their own modes. One whose
implementation cannot be found fails the launch counter (rather than hide its launches) and is an
event of the host-sync detector (so a blind spot fails a test instead of passing it).

:func:`count_launches` and :func:`count_syncs` are one step's figures for the bench's rows (the
``launches`` and ``syncs`` columns of :mod:`~megablocks_ascend.bench.steps`), on any device;
:func:`count_cuda_syncs` cross-checks the syncs on CUDA with torch's sync debug mode.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megablocks_ascend.bench import timing

_BUILTIN_NAMESPACES = ("aten", "prim", "prims")


def _implementation(func):
    """The Python implementation of the custom op ``func`` (None where it cannot be found)."""
    opdef = torch._library.custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}")
    return None if opdef is None else opdef._init_fn


# ------------------------------------------------------------------------------------------
# Launches

# Ops that launch nothing: allocation without initialisation, and metadata-only ops whose schema
# does not mark their output as an alias (views that do are found from the schema).
NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty.names", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default", "aten.alias.default",
    "aten._unsafe_view.default", "aten._reshape_alias.default", "aten.lift_fresh.default",
    "aten.set_.source_Storage_storage_offset", "aten.resize_.default", "aten._has_compatible_shallow_copy_type.default",
    "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.is_same_size.default", "aten.is_contiguous.default", "aten.is_contiguous.memory_format",
    "aten.dim.default", "aten.size.default", "aten.stride.default", "aten.numel.default",
})

_COLLECTIVE_NAMESPACE = "c10d"  # torch.distributed's collectives (c10d.alltoall_base_, ...)
_is_view_cache: dict = {}


def launches_kernel(func) -> bool:
    """Whether the aten op ``func`` would launch a device kernel: not a view (an output that
    aliases an input without writing it, read from the op's schema) and not in :data:`NO_KERNEL`."""
    hit = _is_view_cache.get(func)
    if hit is None:
        returns = func._schema.returns
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        hit = _is_view_cache[func] = not is_view and str(func) not in NO_KERNEL
    return hit


@dataclasses.dataclass(frozen=True)
class Launch:
    kind: str  # "aten", "triton" or "collective"
    name: str  # "aten.mm.default", "triton:_gather_tokens", "c10d.alltoall_base_.default"
    where: str = ""  # with where=True: the source line that caused it ("megablocks/layers/moe.py:170 in ...")

    def __str__(self):
        return f"{self.name} at {self.where}" if self.where else self.name


# -- where a launch or a sync comes from

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "autograd") + os.sep
try:
    import triton as _triton  # noqa: PLC0415
    _TRITON_DIR = os.path.dirname(_triton.__file__) + os.sep
except ImportError:
    _TRITON_DIR = _TORCH_DIR
_LAUNCH_WRAPPER = os.path.join("megablocks_ascend", "compat.py")  # compat.Kernel: launches triton.jit
_SITE = "site-packages" + os.sep
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep


def _short(path: str) -> str:
    if _SITE in path:
        return path.split(_SITE)[-1]
    if path.startswith(_REPO):
        return path[len(_REPO):]
    return os.path.basename(path)


def _skipped(path: str) -> bool:
    return path == _HERE or path.startswith((_TORCH_DIR, _TRITON_DIR)) \
        or path.endswith(("contextlib.py", "functools.py", _LAUNCH_WRAPPER))


def _frame_where(frame) -> str:
    return f"{_short(os.path.abspath(frame.f_code.co_filename))}:{frame.f_lineno} in {frame.f_code.co_name}"


def _forward_where(node) -> str:
    """The innermost frame outside torch of the forward that created autograd ``node`` (from the
    traceback anomaly mode stores on it), or ''."""
    tb = (node.metadata or {}).get("traceback_") if hasattr(node, "metadata") else None
    if not tb:
        return ""
    best = ""
    entries = tb if isinstance(tb, list) else [tb]
    for line in (ln for entry in entries for ln in str(entry).splitlines()):
        line = line.strip()
        if not line.startswith('File "'):
            continue
        path, _, rest = line[len('File "'):].partition('"')
        path = os.path.abspath(path)
        # rest: ", line N, in fn"
        parts = [p.strip() for p in rest.split(",")]
        lineno = next((p.split()[1] for p in parts if p.startswith("line ")), "?")
        fn = next((p[3:] for p in parts if p.startswith("in ")), "?")
        if _skipped(path):
            continue
        best = f"{_short(path)}:{lineno} in {fn}"
    return best


def _where() -> str:
    frame = sys._getframe(2)
    crossed_engine = False  # passed through torch.autograd (the engine runs C++ backward nodes there)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not _skipped(path):
            break
        if path.startswith(_AUTOGRAD_DIR) and frame.f_code.co_name in ("_engine_run_backward", "backward", "grad"):
            crossed_engine = True
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is not None and (crossed_engine or frame is None):
        # A backward node implemented in C++: the Python stack ends at the caller's backward()
        # (or, on a GPU's autograd thread, at nothing).
        forward = _forward_where(node)
        return f"autograd {node.name()}" + (f" of {forward}" if forward else "")
    return _frame_where(frame) if frame is not None else "?"


# -- the Triton launcher hook


def _triton_launchers():
    """``(class, method)`` pairs that every Triton launch goes through once: ``JITFunction.run``
    for compiled kernels (an autotuner or heuristics wrapper ends there too), and the
    interpreter's ``GridExecutor.__call__`` (Triton 3.3 and 3.9 alike: 3.3's interpreted
    ``kernel[grid]`` returns one directly, its autotuner and 3.9's launches build one)."""
    found = []
    try:
        from triton.runtime.jit import JITFunction  # noqa: PLC0415
        found.append((JITFunction, "run"))
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import GridExecutor  # noqa: PLC0415
        found.append((GridExecutor, "__call__"))
    except ImportError:
        pass
    return found


def _kernel_name(launcher) -> str:
    fn = getattr(launcher, "fn", None)
    while fn is not None and not hasattr(fn, "__code__") and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", None) or type(launcher).__name__


class _TritonHook:
    """Wraps the launchers while at least one counter listens (nested counters share it)."""

    listeners: list = []
    depth = 0  # > 0 while a Triton launch runs (its interpreter copies are not counted)
    originals: dict = {}

    @classmethod
    def add(cls, counter) -> None:
        if not cls.listeners:
            found = {(owner, method): owner.__dict__.get(method) for owner, method in _triton_launchers()}
            for (owner, method), original in found.items():
                if original is None:  # a Triton this counter was not written for: say so, undercount nothing
                    import triton  # noqa: PLC0415
                    raise RuntimeError(f"LaunchCounter: Triton {triton.__version__}'s {owner.__name__} has no "
                                       f"{method} of its own to hook, so its launches could not be counted")
            for (owner, method), original in found.items():
                cls.originals[(owner, method)] = original
                setattr(owner, method, cls._wrap(original))
        cls.listeners.append(counter)

    @classmethod
    def remove(cls, counter) -> None:
        cls.listeners.remove(counter)
        if not cls.listeners:
            for (owner, method), original in cls.originals.items():
                setattr(owner, method, original)
            cls.originals.clear()

    @classmethod
    def _wrap(cls, original):
        def launch(self, *args, **kwargs):
            if cls.depth == 0 and not kwargs.get("warmup", False):
                name = "triton:" + _kernel_name(self)
                for counter in cls.listeners:
                    counter._add("triton", name)
            cls.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                cls.depth -= 1
        launch.__wrapped__ = original
        return launch


# -- the counter


class LaunchCounter:
    """``with LaunchCounter() as c: step()``; then ``c.total``, ``c.by_name()``, ``c.report()``.

    ``device``: the device type the step's tensors are on (``None``: the CPU stand-in, where every
    op counts); ``where``: record each launch's source line (slower: a stack walk per op, and
    anomaly mode's forward tracebacks).
    """

    def __init__(self, device: str | torch.device | None = None, where: bool = False):
        self.device = None if device is None else torch.device(device).type
        if self.device == "cpu":
            self.device = None
        self.where = where
        self.events: list[Launch] = []
        outer = self

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace == _COLLECTIVE_NAMESPACE:
                    out = func(*args, **kwargs)
                    outer._add("collective", str(func))
                    return out
                if func.namespace not in _BUILTIN_NAMESPACES:
                    return outer._custom(func, args, kwargs)
                out = func(*args, **kwargs)
                if _TritonHook.depth == 0 and launches_kernel(func) and outer._on_device(args, kwargs, out):
                    outer._add("aten", str(func))
                return out

        self._mode = _Dispatch()
        self._stack = contextlib.ExitStack()

    def _on_device(self, args, kwargs, out) -> bool:
        if self.device is None:
            return True
        for tree in (args, kwargs, out):
            for t in torch.utils._pytree.tree_leaves(tree):
                if isinstance(t, torch.Tensor) and t.device.type == self.device:
                    return True
        return False

    def _custom(self, func, args, kwargs):
        implementation = _implementation(func)
        if implementation is None:
            raise RuntimeError(f"LaunchCounter: custom op {func} reached the dispatch mode, and its Python "
                               "implementation cannot be found to count what it launches")
        with self._mode:
            return implementation(*args, **kwargs)

    def _add(self, kind: str, name: str) -> None:
        self.events.append(Launch(kind, name, _where() if self.where else ""))

    def __enter__(self) -> "LaunchCounter":
        _TritonHook.add(self)
        self._stack.callback(_TritonHook.remove, self)
        if self.where:
            self._stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        self._stack.enter_context(self._mode)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()

    # -- results

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def aten(self) -> int:
        return sum(e.kind == "aten" for e in self.events)

    @property
    def triton(self) -> int:
        return sum(e.kind == "triton" for e in self.events)

    @property
    def collectives(self) -> int:
        return sum(e.kind == "collective" for e in self.events)

    def by_name(self) -> collections.Counter:
        return collections.Counter(e.name for e in self.events)

    def by_where(self) -> collections.Counter:
        return collections.Counter((e.where, e.name) for e in self.events)

    def report(self) -> str:
        """One line per op (count, name), and with ``where`` one line per (source line, op), in
        the order they first launched."""
        lines = [f"{self.total} launches: {self.aten} aten ops, {self.triton} Triton kernels"
                 + (f", {self.collectives} collectives" if self.collectives else "")]
        if self.where:
            counts = self.by_where()
            for (where, name), n in counts.items():
                lines.append(f"{n:4d}  {name:40s} {where}")
        else:
            for name, n in sorted(self.by_name().items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"{n:4d}  {name}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Host syncs

_T = torch.Tensor
_READS = {
    _T.item: "Tensor.item", _T.tolist: "Tensor.tolist", _T.numpy: "Tensor.numpy",
    _T.__array__: "Tensor.__array__", _T.__bool__: "Tensor.__bool__", _T.__int__: "Tensor.__int__",
    _T.__float__: "Tensor.__float__", _T.__index__: "Tensor.__index__", _T.__complex__: "Tensor.__complex__",
    _T.__repr__: "Tensor.__repr__", _T.__str__: "Tensor.__str__", _T.__format__: "Tensor.__format__",
}
_FROM_HOST = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor",
              torch.from_numpy: "torch.from_numpy"}

_aten = torch.ops.aten
_DATA_DEPENDENT = {
    _aten.nonzero.default, _aten.nonzero.out, _aten.masked_select.default, _aten._unique2.default,
    _aten.unique_consecutive.default, _aten.unique_dim.default, _aten.bincount.default,
    _aten.equal.default, _aten.is_nonzero.default, _aten.nonzero_static.default,
}


@dataclasses.dataclass(frozen=True)
class Sync:
    kind: str  # what happened ("Tensor.cpu", "aten._local_scalar_dense", ...)
    where: str  # innermost frame outside torch and this file: "file.py:line in function"

    def __str__(self):
        return f"{self.kind} at {self.where}"


def _read_where() -> tuple[str, bool]:
    """(the innermost caller outside torch and this module, whether the Triton interpreter is on
    the stack)."""
    frames = traceback.extract_stack()[:-3]
    in_interpreter = any(f.filename.replace(os.sep, "/").endswith("triton/runtime/interpreter.py")
                         for f in frames)
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if not _skipped(path):
            return f"{_short(path)}:{f.lineno} in {f.name}", in_interpreter
    return "?", in_interpreter


class HostSyncs:
    """``with HostSyncs() as syncs: step()`` then ``syncs.events`` lists every :class:`Sync`.

    ``cpu_is_device``: count reads of CPU tensors as device reads (the CPU standing in for a
    device; False where the block's tensors are on an accelerator: see the module doc).
    """

    def __init__(self, cpu_is_device: bool = True):
        self.cpu_is_device = cpu_is_device
        self.events: list[Sync] = []
        outer = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                outer._function(func, args, kwargs)
                return func(*args, **kwargs)

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace not in _BUILTIN_NAMESPACES:
                    return outer._custom(func, args, kwargs)
                outer._dispatch(func, args, kwargs)
                return func(*args, **kwargs)

        self._modes = (_Functions(), _Dispatch())

    def _custom(self, func, args, kwargs):
        """Run a custom op's own implementation under a fresh detector sharing these events."""
        implementation = _implementation(func)
        if implementation is None:
            self._add(f"custom op {func} (its implementation could not be watched)")
            return func(*args, **kwargs)
        inner = HostSyncs(self.cpu_is_device)
        inner.events = self.events
        with inner:
            return implementation(*args, **kwargs)

    # -- bookkeeping

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or self.cpu_is_device) \
            and t.device.type != "meta"

    def _add(self, kind: str) -> None:
        where, in_interpreter = _read_where()
        if not in_interpreter:
            self.events.append(Sync(kind, where))

    # -- the two layers

    def _function(self, func, args, kwargs) -> None:
        if func in _READS:
            if args and self._on_device(args[0]):
                self._add(_READS[func])
        elif func is _T.cpu:  # a no-op on a CPU tensor, but on a device tensor a copy to the host
            if args and self._on_device(args[0]):
                self._add("Tensor.cpu")
        elif func is _T.to:
            if args and isinstance(args[0], torch.Tensor):
                device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
                if device is not None and self._crosses(args[0].device, torch.device(device)):
                    self._add(f"Tensor.to({torch.device(device)})")
        elif func in _FROM_HOST:
            device = kwargs.get("device")
            target = torch.device(device) if device is not None else torch.get_default_device()
            if target.type != "cpu" or self.cpu_is_device:
                self._add(f"{_FROM_HOST[func]} (host data to a device tensor)")

    @staticmethod
    def _crosses(src: torch.device, dst: torch.device) -> bool:
        """A copy between two devices (the host's memory counting as the ``cpu`` device)."""
        return src != dst and "meta" not in (src.type, dst.type)

    def _dispatch(self, func, args, kwargs) -> None:
        if func is _aten._local_scalar_dense.default:
            if args and self._on_device(args[0]):
                self._add("aten._local_scalar_dense")
            return
        if func in _DATA_DEPENDENT:
            if args and self._on_device(args[0]):
                self._add(f"aten.{func.__name__} (data-dependent output size)")
            return
        if func is _aten.repeat_interleave.Tensor or func is _aten.repeat_interleave.self_Tensor:
            if kwargs.get("output_size") is None and self._on_device(args[0]):
                self._add("aten.repeat_interleave without output_size")
            return
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()) \
                    and self._on_device(args[0]):
                self._add(f"aten.{func.__name__} with a boolean mask (data-dependent)")
            return
        if func is _aten._to_copy.default:
            device = kwargs.get("device")
            if device is not None and args and self._crosses(args[0].device, torch.device(device)):
                self._add(f"aten._to_copy to {device}")
            return
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and self._crosses(src.device, dst.device):
                self._add(f"aten.copy_ {src.device} -> {dst.device}")

    # -- context manager

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def report(self) -> str:
        return "\n".join(str(e) for e in self.events) or "(none)"


# ------------------------------------------------------------------------------------------
# One step's figures, for the bench's rows


def count_launches(run, device: torch.device, by_line: bool = False):
    """``(launches, by line)`` of one call of ``run()``: aten ops that launch a kernel plus Triton
    launches (on the CPU every op counts, on an accelerator the ops on it); with ``by_line`` the
    launches by source line (``[{n, name, where}]``), else None."""
    with LaunchCounter(device=None if device.type == "cpu" else device.type, where=by_line) as counted:
        run()
    timing.synchronize(device)
    lines = None
    if by_line:
        lines = [dict(n=n, name=name, where=where) for (where, name), n in counted.by_where().items()]
    return counted.total, lines


def count_syncs(run, device: torch.device) -> int:
    """Host syncs in one call of ``run()``, on any device (:class:`HostSyncs`; on the CPU its
    tensors stand in for a device's)."""
    with HostSyncs(cpu_is_device=device.type == "cpu") as syncs:
        run()
    timing.synchronize(device)
    return len(syncs.events)


def count_cuda_syncs(run, device: torch.device) -> int | None:
    """Synchronizing CUDA calls in one call of ``run()`` (torch's sync debug mode, as warnings): a
    cross-check of :func:`count_syncs` from the CUDA runtime's side; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
