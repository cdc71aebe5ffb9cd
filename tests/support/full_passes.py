"""A detector for full passes: aten ops that read or write every element of a given tensor size.

``FullPasses(numel)`` is a ``TorchDispatchMode`` that records each aten op one of whose tensor
arguments or results has ``numel`` elements, except

* the GEMMs (``_grouped_mm``, ``mm``, ``addmm``, ``bmm``): the work itself;
* views and aliases (``OpOverload.is_view``): no data moves;
* allocations (``empty``, ``empty_strided``, ``new_empty``, ...): no data moves;
* what the Triton interpreter does to copy a kernel's arguments in and out (it stands in for the
  device on a CPU machine: those copies are not device work). A Triton kernel's own work is not an
  aten op and is not seen; test kernels separately.

The sizes of a test are chosen so that ``numel`` belongs to one tensor family only (the expert
weights and their gradients); an op that touches it is then a pass over a whole weight gradient
(or weight) that is not the GEMM.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
GEMMS = {_aten._grouped_mm, _aten.mm, _aten.addmm, _aten.bmm} if hasattr(_aten, "_grouped_mm") else \
    {_aten.mm, _aten.addmm, _aten.bmm}
ALLOCATIONS = {_aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided, _aten.empty_like}


def _in_interpreter() -> bool:
    return any(f.filename.replace(os.sep, "/").endswith("triton/runtime/interpreter.py")
               for f in traceback.extract_stack())


class FullPasses(TorchDispatchMode):
    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in GEMMS or packet in ALLOCATIONS or func.is_view:
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.numel() == self.numel for t in tensors) and not _in_interpreter():
            self.events.append(str(func))
        return out
