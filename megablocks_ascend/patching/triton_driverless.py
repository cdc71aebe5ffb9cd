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
    why="`@triton.autotune` builds an `Autotuner` when the module that decorates a kernel is imported. In "
        "Triton 3.3.1 and triton-ascend 3.2.0 its `__init__` calls "
        "`triton.runtime.driver.active.get_benchmarker()`, and Triton's driver lookup raises "
        "`RuntimeError: 0 active drivers` where no backend's driver is active: a CPU-only machine (the "
        "Triton interpreter is not a driver), or triton-ascend on a build box, login node or CI runner "
        "without an NPU and CANN. stk decorates its kernels at import, and MegaBlocks imports stk, so "
        "`import megablocks` fails there, and with it `import megablocks_ascend` (whose patches import "
        "MegaBlocks), `python -m megablocks_ascend doctor`, `lower` and the `torch` backend. Triton 3.9 "
        "asks for the benchmarker only when it benchmarks, so it imports fine.",
    how="At install, `megablocks_ascend.compat.active_drivers()` asks every Triton backend's driver "
        "whether it is active (the same question Triton's own lookup asks, with triton-ascend's warning "
        "about a missing CANN compiler silenced), and `compat.autotuner_needs_driver()` whether "
        "`Autotuner.do_bench` is resolved at construction (it is not a `property`/`cached_property`). Only "
        "when there is no driver and it is: `Autotuner.__init__` is wrapped so that an autotuner "
        "constructed without a `do_bench` of its own gets a `compat.RefusingBenchmarker` as its "
        "`do_bench`. The patch refuses to install if `__init__` has no `fn`, `configs` or `do_bench` "
        "parameter.",
    upstream_fix="Resolve the benchmarker when benchmarking, not at construction, as Triton 3.9 does "
                 "(`Autotuner.do_bench` is a `cached_property` there); for triton-ascend, a release based "
                 "on such a Triton.",
    apply=apply,
    needs_megablocks=False,
)
