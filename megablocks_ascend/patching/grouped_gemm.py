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
    why="`Arguments(mlp_impl=\"grouped\")` asserts that `grouped_gemm` is importable, and dMoE's grouped "
        "MLP and GLU call `grouped_gemm.backend.gmm` / `grouped_gemm.ops.gmm`. The package builds CUDA "
        'kernels only. MegaBlocks 0.10.0 also refuses `mlp_impl="sparse"` with triton >= 3.2 '
        "(triton-ascend is 3.2.0), so the grouped path is the one dMoE users can run.",
    how="`megablocks_ascend.native.grouped_gemm` has the package's layout and semantics (`gmm(a, b, "
        "batch_sizes, trans_a, trans_b, c)` and the autograd `ops.gmm`), backed by "
        "`torch_npu.npu_grouped_matmul` on NPU, `torch._grouped_mm` on CUDA and CPU where torch supports "
        "the call, and a per-group `torch.mm` loop elsewhere (`gmm_impl_name` says which). Besides the "
        "real package's CPU `batch_sizes` it takes them on the operands' device, which the first two use "
        "without reading them on the host ([grouped-mlp-device-sizes](grouped-mlp-device-sizes.md) relies "
        "on that). An installed `grouped_gemm` is left alone.",
    upstream_fix="Let `megablocks.grouped_gemm_util` pick a grouped GEMM per device, e.g. "
                 "`torch._grouped_mm` where available, instead of requiring the CUDA package.",
    apply=apply,
    needs_megablocks=False,
)
