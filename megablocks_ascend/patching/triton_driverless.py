"""The ``triton-driverless`` patch (page: ``patches/triton-driverless.md``): where Triton has no
driver, ``triton.autotune`` no longer asks for one when it decorates a kernel, so that ``import stk``
(hence ``import megablocks``) works; an autotuner asked to time its configs refuses loudly.

First in the registry: every later patch imports MegaBlocks, which imports stk, whose kernels are
autotuned.
"""

from __future__ import annotations

import inspect
from typing import Any

from megablocks_ascend.patching.registry import Patch, PatchError, owner


def _kernel_name(fn: Any) -> str:
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):  # JITFunction, Heuristics...
        fn = fn.fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(fn)


def apply(p: Patch) -> None:
    from megablocks_ascend import compat  # noqa: PLC0415
    if not compat.autotuner_needs_driver() or compat.active_drivers():
        return  # a driver is there, or this Triton asks for one only when it benchmarks
    target = "triton.runtime.autotuner:Autotuner.__init__"
    cls, attr = owner(target)
    original = cls.__dict__[attr]
    params = list(inspect.signature(original).parameters)[1:]  # without self
    for name in ("fn", "configs", "do_bench"):
        if name not in params:
            raise PatchError(f"{target} has no parameter {name!r} (it has {tuple(params)}); this "
                             "Triton version is not supported by this megablocks-ascend version")
    fn_at, configs_at, do_bench_at = (params.index(n) for n in ("fn", "configs", "do_bench"))

    def __init__(self, *args, **kwargs):
        if len(args) <= do_bench_at and kwargs.get("do_bench") is None:
            fn = args[fn_at] if len(args) > fn_at else kwargs.get("fn")
            configs = args[configs_at] if len(args) > configs_at else kwargs.get("configs")
            kwargs["do_bench"] = compat.RefusingBenchmarker(_kernel_name(fn), len(configs or ()) or 1)
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    __init__.__signature__ = inspect.signature(original)
    p.replace(target, __init__)


PATCH = Patch(
    name="triton-driverless",
    targets=("triton.runtime.autotuner:Autotuner.__init__",),
    why="Triton 3.3.1 and triton-ascend 3.2.0 ask the driver for a benchmarker when "
        "triton.autotune decorates a kernel, so on a machine where Triton has no driver (CPU "
        "only; triton-ascend without an NPU) importing stk, hence MegaBlocks, raises "
        "'0 active drivers'.",
    how="Only where Triton has no active driver and its Autotuner asks for the benchmarker at "
        "construction: Autotuner.__init__ is wrapped to pass a RefusingBenchmarker as do_bench. "
        "An autotuner with one config never calls it and runs; one asked to time several "
        "configs raises NoTritonDriver before any of them runs. Nothing pretends a device exists.",
    upstream_fix="Ask the driver for the benchmarker when benchmarking, as Triton 3.9 does "
                 "(triton-ascend: rebase on such a Triton).",
    apply=apply,
    needs_megablocks=False,
)
