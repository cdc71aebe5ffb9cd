"""The ``autocast-device`` patch (page: ``patches/autocast-device.md``): MegaBlocks'
``cast_if_autocast_enabled`` and the custom autograd functions of its memory-optimized MLPs ask
autocast about their tensors' own device type instead of CUDA's (:mod:`megablocks_ascend.autocast`).
"""

from __future__ import annotations

import torch

from megablocks_ascend.patching.registry import Patch, expect_params, owner, redecorate

# The custom autograd functions decorated with torch.amp.custom_fwd/custom_bwd(device_type="cuda").
AUTOCAST_FUNCTIONS = (
    "megablocks.layers.mlp:ScaleGradient",
    "megablocks.layers.mlp:MemoryOptimizedMLP",
    "megablocks.layers.mlp:MemoryOptimizedGroupedMLP",
    "megablocks.layers.glu:MemoryOptimizedGroupedGLU",
)


def apply(p: Patch) -> None:
    from megablocks_ascend import autocast  # noqa: PLC0415
    target = "megablocks.layers.common.cast_if_autocast_enabled"
    module, attr = owner(target)
    expect_params(target, getattr(module, attr), ("tensor",))
    p.replace(target, autocast.cast_if_autocast_enabled)
    for cls_target in AUTOCAST_FUNCTIONS:
        redecorate(p, cls_target,
                   (torch.amp.custom_fwd(device_type="cuda"), torch.amp.custom_bwd(device_type="cuda")),
                   (autocast.custom_fwd, autocast.custom_bwd), "torch.amp.custom_fwd/custom_bwd")


PATCH = Patch(
    name="autocast-device",
    targets=("megablocks.layers.common.cast_if_autocast_enabled",)
    + tuple(f"{c}.{m}" for c in AUTOCAST_FUNCTIONS for m in ("forward", "backward")),
    why="common.cast_if_autocast_enabled raises NotImplementedError for NPU tensors under "
        "autocast, and the memory-optimized MLPs use torch.amp.custom_fwd(device_type='cuda'), "
        "so on other devices they ignore the caller's autocast state.",
    how="cast_if_autocast_enabled is replaced by a version that asks autocast about the "
        "tensor's own device type; the four custom autograd functions are re-wrapped with "
        "decorators that keep torch.amp.custom_fwd/custom_bwd's contract (ctx._dtype, "
        "ctx._fwd_used_autocast, the backward under the forward's autocast state) but take the "
        "device type from their inputs.",
    upstream_fix="Use torch.is_autocast_enabled(x.device.type) and pass the device type through.",
    apply=apply,
)
