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
    why="`MoE.forward` calls `common.cast_if_autocast_enabled(x)`, which asks only about CUDA autocast and "
        "raises `NotImplementedError` for any device other than `cuda` and `cpu` — an NPU under autocast "
        "stops there. The memory-optimized MLPs and `ScaleGradient` (used with expert parallelism) are "
        "decorated with `torch.amp.custom_fwd(device_type='cuda')`, so on other devices they do not see "
        "the caller's autocast state (the memory-optimized MLPs then skip the casts of their inputs to "
        "`ctx._dtype`, and hand float32 weights and bf16 activations to the grouped GEMM), and their "
        "backward does not replay it.",
    how="`cast_if_autocast_enabled` is replaced by a version that asks autocast about the tensor's own "
        "device type (`torch.is_autocast_enabled(x.device.type)`, `torch.get_autocast_dtype(...)`). Each "
        "of the four autograd functions' undecorated `forward`/`backward` (found through `__wrapped__`) is "
        "re-decorated with `megablocks_ascend.autocast.custom_fwd`/`custom_bwd`. These keep "
        "`torch.amp.custom_fwd`'s contract exactly — they set `ctx._dtype` and `ctx._fwd_used_autocast`, "
        "which the memory-optimized MLPs read, cast by the same rule, and the backward runs under the "
        "forward's autocast state — but take the device type from the forward's first tensor argument. The "
        "patch refuses to install if a method is no longer a staticmethod wrapped by "
        "`torch.amp.custom_fwd`/`custom_bwd` (the wrapper's code object is compared with the decorator's), "
        "and a failed install is rolled back.",
    upstream_fix="Use `torch.is_autocast_enabled(x.device.type)` in `cast_if_autocast_enabled`, and "
                 "decorate with `torch.amp.custom_fwd(device_type=...)` for the device the layer is built "
                 "on (or a device-generic decorator like this one).",
    apply=apply,
)
