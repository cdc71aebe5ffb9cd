"""The ``stk-autocast-device`` patch (page: ``patches/stk-autocast-device.md``): stk's block-sparse
matmuls (``SDD``, ``DSD``, ``DDS``) follow autocast on their inputs' own device type instead of
CUDA's only.
"""

from __future__ import annotations

import importlib

from megablocks_ascend.patching.registry import Patch, redecorate

# stk.backend.sputnik's RowIndices is not decorated (it only handles index tensors).
STK_AUTOCAST_FUNCTIONS = (
    "stk.backend.sputnik:SDD",
    "stk.backend.sputnik:DSD",
    "stk.backend.sputnik:DDS",
)


def apply(p: Patch) -> None:
    from megablocks_ascend import autocast  # noqa: PLC0415
    # By module name, not attribute: after a failed `import megablocks` (no driver, say) the
    # package `stk` can lack its `backend` attribute although the submodule is importable.
    upstream = importlib.import_module("stk.backend.autocast")
    for cls_target in STK_AUTOCAST_FUNCTIONS:
        redecorate(p, cls_target, (upstream.custom_fwd, upstream.custom_bwd),
                   (autocast.custom_fwd(cast_inputs=True), autocast.custom_bwd),
                   "stk.backend.autocast.custom_fwd/custom_bwd")


PATCH = Patch(
    name="stk-autocast-device",
    targets=tuple(f"{c}.{m}" for c in STK_AUTOCAST_FUNCTIONS for m in ("forward", "backward")),
    why="stk's autocast decorators (stk.backend.autocast) ask only CUDA's autocast and cast only "
        "CUDA tensors, so under autocast on an NPU or the CPU its block-sparse matmuls get "
        "operands of mixed dtypes.",
    how="SDD, DSD and DDS's undecorated forward/backward are re-wrapped with "
        "megablocks_ascend.autocast.custom_fwd(cast_inputs=True)/custom_bwd: the same rule "
        "(floating inputs cast to the autocast dtype, forward and backward with autocast off) "
        "for the device type of the inputs.",
    upstream_fix="Use torch.amp.custom_fwd(device_type=x.device.type, cast_inputs=...) in stk.",
    apply=apply,
)
