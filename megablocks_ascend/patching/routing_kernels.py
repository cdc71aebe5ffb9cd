"""The ``routing-kernels`` patch (page: ``patches/routing-kernels.md``): MegaBlocks' nine routing
kernels (``megablocks.backend.kernels``) are replaced by dispatchers that validate their inputs and
hand them to the backend ``MEGABLOCKS_BACKEND`` selects (:mod:`megablocks_ascend.backends`).
"""

from __future__ import annotations

from megablocks_ascend.patching.registry import Patch, replace_dispatched


def apply(p: Patch) -> None:
    from megablocks_ascend import backends  # noqa: PLC0415
    import megablocks.backend.kernels as upstream  # noqa: PLC0415
    replace_dispatched(p, upstream, backends.KERNELS, backends.SPECS, backends.UPSTREAM)


PATCH = Patch(
    name="routing-kernels",
    targets=tuple(f"megablocks.backend.kernels.{n}" for n in (
        "binned_gather", "binned_scatter", "binned_scatter_wgrad", "gather", "scatter",
        "scatter_wgrad", "padded_gather", "padded_scatter", "padded_scatter_wgrad")),
    why="These are the routing kernels every MegaBlocks layer runs. Upstream's are Triton kernels with one "
        "program per row (tens of thousands of programs against a few dozen Ascend vector cores) whose "
        "scatters write a `[tokens, top_k, hidden]` temporary and reduce it in a second pass.",
    how="Each function is replaced by a dispatcher (`megablocks_ascend.backends.KERNELS[name]`) with the "
        "same parameters. It validates its arguments (`megablocks_ascend.validation`), resolves the "
        "backend for the tensors' device from `MEGABLOCKS_BACKEND` / `use_backend`, records the call for "
        "`trace()`, and calls our Triton kernels (`ascend`), upstream's original function (`cuda`, kept in "
        "`backends.UPSTREAM`), or the PyTorch implementation (`torch`). A backend that cannot serve the "
        "device raises `BackendUnavailable`; nothing falls back silently. Upstream's own functions call "
        "their siblings by module-global name (`scatter` calls `padded_scatter`), which after patching "
        "finds the dispatcher again; such nested calls go straight to upstream's original, unrecorded and "
        "not validated twice. The patch refuses to install if an upstream function's parameters differ "
        "from the ones it was written against.",
    upstream_fix="A small backend registry in `megablocks.backend` that plugins register kernels with.",
    apply=apply,
)
