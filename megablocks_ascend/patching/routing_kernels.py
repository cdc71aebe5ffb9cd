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
    why="MegaBlocks' routing kernels are written for CUDA GPUs: one program per row, and "
        "scatters that go through a [tokens, top_k, hidden] temporary.",
    how="Each function is replaced by a dispatcher that validates its inputs and hands them to "
        "the backend MEGABLOCKS_BACKEND selects: our Triton kernels (ascend), upstream's own "
        "function (cuda), or plain PyTorch (torch).",
    upstream_fix="A backend registry in megablocks.backend that plugins can register kernels with.",
    apply=apply,
)
