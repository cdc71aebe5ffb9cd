"""The ``stk-kernels`` patch (page: ``patches/stk-kernels.md``): stk's block-sparse matmuls
(``stk.backend.triton_kernels``: ``sdd``, ``dsd``, ``dds``, ``row_indices``) are replaced by entry
points (:mod:`megablocks_ascend.library`) that validate their inputs and hand them to the backend
``MEGABLOCKS_BACKEND`` selects.
"""

from __future__ import annotations

from megablocks_ascend.patching.registry import Patch, replace_dispatched


def apply(p: Patch) -> None:
    from megablocks_ascend import backends, library  # noqa: PLC0415
    import stk.backend.triton_kernels as upstream  # noqa: PLC0415
    replace_dispatched(p, upstream, library.STK_ENTRY_POINTS, backends.STK_SPECS, backends.UPSTREAM_STK)


PATCH = Patch(
    name="stk-kernels",
    targets=tuple(f"stk.backend.triton_kernels.{n}" for n in ("sdd", "dsd", "dds", "row_indices")),
    why="MegaBlocks' sparse dMoE (`mlp_impl=\"sparse\"`) runs its expert MLPs as stk block-sparse matmuls. "
        "stk's `stk.ops.*` autograd functions (`stk/backend/sputnik.py`) reach its Triton kernels through "
        "the module (`backend.sdd(...)`), and MegaBlocks' memory-optimized MLP calls "
        "`stk.backend.triton_kernels.sdd`/`dsd` directly, so these four functions are every way in.",
    how="Each function is replaced by an entry point (`megablocks_ascend.library.STK_ENTRY_POINTS`) with "
        "stk's parameters. It runs the dispatcher `megablocks_ascend.backends.STK_KERNELS[name]`, or, "
        "while `torch.compile` traces, the custom op `torch.ops.megablocks_ascend.stk_<name>` (declared as "
        "mutating `out`) that runs the same dispatcher. The dispatcher validates the call "
        "(`megablocks_ascend.validation.check_blocksparse`: shapes, dtypes, devices, strides, the BCSR "
        "metadata's sizes; with `MEGABLOCKS_ASCEND_CHECKS=1` also its values), resolves the backend for "
        "the tensors' device, records the call for `trace()` (ops `sdd`, `dsd`, `dds`, `row_indices`), and "
        "writes `out` with our Triton kernels (`ascend`, `megablocks_ascend.kernels.blocksparse`), stk's "
        "original function (`cuda`, kept in `backends.UPSTREAM_STK`), or plain PyTorch (`torch`, "
        "`megablocks_ascend.reference.blocksparse`). `auto` picks by device as for the routing ops: NPU "
        "`ascend`, CUDA `cuda`, CPU `torch`. The patch refuses to install if one of stk's functions has "
        "other parameters than the ones it was written against.",
    upstream_fix="Release stk PR #17 (block offsets computed in int32/int64), and give `stk.backend` a "
                 "kernel registry plugins can register with.",
    apply=apply,
)
