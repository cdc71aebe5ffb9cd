"""A detector for host syncs: every point where the host reads values that live on a device.

A host sync drains the device's queue (the host waits for the device to reach the point where
the value is ready) and cannot be captured in a CUDA/NPU graph. ``HostSyncs`` records them, in two
layers, while a block runs:

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

On a machine without an accelerator the test runs everything on the CPU, where a "device" read
costs nothing and ``Tensor.cpu()`` on a CPU tensor does not even reach the dispatcher. With
``cpu_is_device=True`` (the default for CPU tensors) the detector therefore treats CPU tensors as
device tensors: any read of their values into Python, and any ``.cpu()``/``.to("cpu")``, counts,
as it would on an accelerator. That is what makes the check meaningful on CPU: MegaBlocks'
``tokens_per_expert.cpu()`` and the grouped GEMM's ``batch_sizes.tolist()`` are caught there.

The Triton interpreter stands in for the device on CPU; reads made from inside it (it copies
its arguments through numpy) are device work, not host syncs, and are not counted.

A ``torch.library`` custom op runs its Python implementation with both kinds of modes switched
off, which would hide whatever it does; the detector runs such an implementation itself, under
fresh modes of its own, and records a custom op whose implementation it cannot find as an event
(so a blind spot fails a test instead of passing it).
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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

_BUILTIN_NAMESPACES = ("aten", "prim", "prims")

_HERE = os.path.abspath(__file__)
_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep,)


@dataclasses.dataclass(frozen=True)
class Sync:
    kind: str  # what happened ("Tensor.cpu", "aten._local_scalar_dense", ...)
    where: str  # innermost frame outside torch and this file: "file.py:line in function"

    def __str__(self):
        return f"{self.kind} at {self.where}"


def _where() -> tuple[str, bool]:
    """(the innermost caller outside torch and this module, whether the Triton interpreter is on
    the stack)."""
    frames = traceback.extract_stack()[:-3]
    in_interpreter = any(f.filename.replace(os.sep, "/").endswith("triton/runtime/interpreter.py")
                         for f in frames)
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if path == _HERE or path.startswith(_SKIP_DIRS) or path.endswith("contextlib.py"):
            continue
        marker = "site-packages" + os.sep
        short = path.split(marker)[-1] if marker in path else os.path.relpath(path)
        return f"{short}:{f.lineno} in {f.name}", in_interpreter
    return "?", in_interpreter


class HostSyncs:
    """``with HostSyncs() as syncs: step()`` then ``syncs.events`` lists every :class:`Sync`.

    ``cpu_is_device``: count reads of CPU tensors as device reads (default: only when no
    accelerator is in use, i.e. the caller says so; see the module doc).
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
        opdef = torch._library.custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}")
        if opdef is None:
            self._add(f"custom op {func} (its implementation could not be watched)")
            return func(*args, **kwargs)
        inner = HostSyncs(self.cpu_is_device)
        inner.events = self.events
        with inner:
            return opdef._init_fn(*args, **kwargs)

    # -- bookkeeping

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or self.cpu_is_device) \
            and t.device.type != "meta"

    def _add(self, kind: str) -> None:
        where, in_interpreter = _where()
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
