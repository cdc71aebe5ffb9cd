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
    why="Every expert MLP and GLU forward (`MLP`, `GroupedMLP`, `GroupedGLU`, the sparse and "
        "memory-optimized variants) calls `resolve_dtensor` on its weights, and it starts with "
        "`packaging.version.parse(torch.__version__) >= packaging.version.parse('2.0.0')`. Dynamo cannot "
        "trace that on torch 2.7.1 (`Unsupported method call: Dynamo does not know how to trace method "
        "issuperset of class frozenset`, from `packaging/version.py`, CPU) or torch 2.11 "
        "(`InternalTorchDynamoError ... UserDefinedExceptionObjectVariable`, on the H200), so "
        "`torch.compile(fullgraph=True)` of an unchanged `MoE` or `dMoE` fails on those versions with any "
        "routing backend, `cuda` included. torch 2.13 traces it.",
    how="Both names are replaced by one function that does what upstream's does on every torch >= 2.0 "
        "(MegaBlocks 0.10.0 needs torch 2.7 anyway): a `DTensor` is unwrapped with `to_local()`, anything "
        "else is returned unchanged. `DTensor` is imported once, at install, from the module upstream "
        "imports it from (`torch.distributed._tensor`); in a torch built without `torch.distributed` no "
        "DTensor can exist and every weight is returned unchanged. The patch refuses to install if "
        "upstream's function no longer takes exactly `weight`, or if glu's name is no longer mlp's "
        "function.",
    upstream_fix="Decide the version check once at import (or drop it: MegaBlocks requires a torch far "
                 "past 2.0).",
    apply=apply,
)
