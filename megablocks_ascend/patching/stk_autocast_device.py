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
    why="stk 0.7.1's block-sparse matmuls (`stk.ops.sdd`/`dsd`/`dds`, which MegaBlocks' sparse MLP and GLU "
        "call) are autograd functions decorated with stk's own `stk.backend.autocast.custom_fwd` and "
        "`custom_bwd`. Those ask `torch.is_autocast_enabled()` (CUDA's autocast only), read "
        "`torch.get_autocast_gpu_dtype()`, cast only CUDA tensors, and turn off CUDA's autocast in the "
        "backward. Under autocast on an NPU or the CPU they do nothing: the sparse dMoE, whose activations "
        "MegaBlocks has already cast to bf16 and whose weights are float32, hands stk's kernels operands "
        "of two dtypes. `RowIndices` is not decorated (it only handles index tensors), so it is left "
        "alone.",
    how="The undecorated `forward`/`backward` of `SDD`, `DSD` and `DDS` (found through `__wrapped__`) are "
        "re-wrapped with `megablocks_ascend.autocast.custom_fwd(cast_inputs=True)` and `custom_bwd`. Under "
        "autocast for the device type of the forward's tensors, every floating-point tensor argument on "
        "that device type (float64 excepted) is cast to the autocast dtype and the forward runs with "
        "autocast off; the backward then runs with autocast off too. That is stk's rule "
        "(`torch.amp.custom_fwd(cast_inputs=<autocast dtype>)`), for any device. The casts happen inside "
        "the function, so the gradients it returns have the autocast dtype, and autograd hands float32 "
        "inputs float32 gradients. The patch refuses to install if a method is no longer a staticmethod "
        "wrapped by stk's decorators.",
    upstream_fix="In stk, `torch.amp.custom_fwd(device_type=x.device.type, "
                 "cast_inputs=torch.get_autocast_dtype(...))`, or a decorator that takes the device type "
                 "from the inputs.",
    apply=apply,
)
