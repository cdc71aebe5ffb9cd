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
    why="stk's block-sparse matmuls, which the sparse dMoE runs, are written for NVIDIA GPUs, and with "
        "Triton >= 3.2 its sdd computes wrong results (or reads out of bounds) once the sparse matrix has "
        "more than 32768 rows or columns: arithmetic on its int16 block indices stays int16.",
    how="Each function is replaced by an entry point that validates its inputs and hands them to the "
        "backend MEGABLOCKS_BACKEND selects: our Triton kernels (ascend), stk's own function (cuda, "
        "refused with BackendUnavailable where it overflows), or plain PyTorch (torch); a "
        "torch.library custom op while torch.compile traces.",
    upstream_fix="stk PR #17 (int32/int64 block offsets) released, and a kernel registry in "
                 "stk.backend that plugins can register with.",
    apply=apply,
)
