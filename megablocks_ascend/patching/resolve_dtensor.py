"""The ``resolve-dtensor`` patch (page: ``patches/resolve-dtensor.md``): MegaBlocks'
``resolve_dtensor`` without the torch version parse it makes on every expert-MLP forward, which
dynamo cannot trace on torch 2.7 or 2.11.
"""

from __future__ import annotations

import torch

from megablocks_ascend.patching.registry import Patch, PatchError, expect_params

RESOLVE_DTENSOR = ("megablocks.layers.mlp.resolve_dtensor", "megablocks.layers.glu.resolve_dtensor")


def _dtensor_class() -> type | None:
    """``DTensor``, the class ``resolve_dtensor`` unwraps; ``None`` in a torch without
    ``torch.distributed``, where no DTensor can exist."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed._tensor import DTensor  # noqa: PLC0415  (upstream's import)
    return DTensor


def apply(p: Patch) -> None:
    import megablocks.layers.glu as glu  # noqa: PLC0415
    import megablocks.layers.mlp as mlp  # noqa: PLC0415
    upstream = mlp.resolve_dtensor
    expect_params("megablocks.layers.mlp.resolve_dtensor", upstream, ("weight",))
    if getattr(glu, "resolve_dtensor", None) is not upstream:
        raise PatchError("megablocks.layers.glu.resolve_dtensor is no longer the function imported "
                         "from megablocks.layers.mlp")
    dtensor = _dtensor_class()  # upstream asks on every call whether torch >= 2.0; it is

    def resolve_dtensor(weight: torch.Tensor):
        if dtensor is not None and isinstance(weight, dtensor):
            return weight.to_local()
        return weight

    resolve_dtensor.__wrapped__ = upstream
    resolve_dtensor.__doc__ = "megablocks.layers.mlp.resolve_dtensor, its torch version check made once."
    for target in RESOLVE_DTENSOR:
        p.replace(target, resolve_dtensor)


PATCH = Patch(
    name="resolve-dtensor",
    targets=RESOLVE_DTENSOR,
    why="resolve_dtensor parses torch.__version__ with packaging on every expert-MLP forward; "
        "dynamo cannot trace packaging's Version on torch 2.7 or 2.11, so torch.compile of an "
        "unchanged MoE or dMoE fails there, whatever backend serves the routing.",
    how="Both names (glu imports it from mlp) are replaced by one function that does what "
        "upstream does on every torch >= 2.0 (the only ones MegaBlocks 0.10.0 runs on): unwrap a "
        "DTensor to its local tensor, return anything else unchanged. DTensor is looked up once, "
        "at install.",
    upstream_fix="Decide the version check once at import (or drop it: MegaBlocks needs "
                 "torch >= 2.0 anyway).",
    apply=apply,
)
