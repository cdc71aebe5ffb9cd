"""The ``grouped-gemm`` patch (page: ``patches/grouped-gemm.md``): where the CUDA-only
``grouped_gemm`` package is not installed, :mod:`megablocks_ascend.native.grouped_gemm` stands in
for it, so that dMoE's grouped MLP runs; if MegaBlocks recorded it as missing, that is corrected.
"""

from __future__ import annotations

import sys

from megablocks_ascend.patching.registry import Patch, PatchError, module_absent


def apply(p: Patch) -> None:
    from megablocks_ascend.native import grouped_gemm as standin  # noqa: PLC0415
    if not module_absent("grouped_gemm") and not getattr(sys.modules.get("grouped_gemm"),
                                                         "__megablocks_ascend_standin__", False):
        return  # the real package is installed: leave it alone
    modules = sys.modules.get("grouped_gemm")
    if modules is None:
        modules = standin.make_modules()
        for name, module in modules.items():
            p.set_module(name, module)
    # MegaBlocks decided at its import whether grouped_gemm exists; if that import came first,
    # correct what it recorded.
    if "megablocks.grouped_gemm_util" in sys.modules:
        gg = sys.modules["megablocks.grouped_gemm_util"]
        for attr in ("_grouped_gemm_is_available", "backend", "ops"):
            if not hasattr(gg, attr):
                raise PatchError(f"megablocks.grouped_gemm_util.{attr} is missing")
        if not gg._grouped_gemm_is_available:
            top = sys.modules["grouped_gemm"]
            p.replace("megablocks.grouped_gemm_util._grouped_gemm_is_available", True)
            p.replace("megablocks.grouped_gemm_util.backend", top.backend)
            p.replace("megablocks.grouped_gemm_util.ops", top.ops)


PATCH = Patch(
    name="grouped-gemm",
    targets=("sys.modules['grouped_gemm']", "megablocks.grouped_gemm_util._grouped_gemm_is_available",
             "megablocks.grouped_gemm_util.backend", "megablocks.grouped_gemm_util.ops"),
    why="dMoE with mlp_impl='grouped' asserts that grouped_gemm (a CUDA-only package) is installed.",
    how="When grouped_gemm is not installed, megablocks_ascend.native.grouped_gemm is registered "
        "as grouped_gemm (npu_grouped_matmul on NPU, torch._grouped_mm on CUDA and CPU where "
        "torch supports the call, a loop elsewhere; group sizes on the host or on the device); "
        "if MegaBlocks was imported first, grouped_gemm_util's availability flag and modules are "
        "corrected too. An installed grouped_gemm is left alone.",
    upstream_fix="Let grouped_gemm_util choose a grouped GEMM per device (e.g. torch._grouped_mm).",
    apply=apply,
    needs_megablocks=False,
)
