"""The ``arguments-device`` patch (page: ``patches/arguments-device.md``): ``Arguments`` without a
device gets :func:`default_device` (the current NPU, else CUDA's current device, else the CPU)
instead of ``torch.cuda.current_device()``, which raises without CUDA.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from megablocks_ascend.patching.registry import Patch, PatchError


def default_device() -> torch.device | int:
    """The device ``Arguments`` uses when none is given: the current NPU, else CUDA's
    current device (upstream's default), else the CPU."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return torch.device("cpu")


def apply(p: Patch) -> None:
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    fields = {f.name: f for f in dataclasses.fields(Arguments)}
    if "device" not in fields or fields["device"].default_factory is not torch.cuda.current_device:
        raise PatchError("megablocks.layers.arguments.Arguments.device no longer defaults to "
                         "torch.cuda.current_device")
    original = Arguments.__init__
    names = list(inspect.signature(original).parameters)[1:]
    position = names.index("device")

    def __init__(self, *args, **kwargs):
        if len(args) <= position and "device" not in kwargs:
            kwargs["device"] = default_device()
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    __init__.__signature__ = inspect.signature(original)
    p.replace("megablocks.layers.arguments:Arguments.__init__", __init__)


PATCH = Patch(
    name="arguments-device",
    targets=("megablocks.layers.arguments:Arguments.__init__",),
    why="Arguments.device defaults to torch.cuda.current_device(), which raises without CUDA.",
    how="Arguments.__init__ is wrapped: when no device is given it passes default_device() "
        "(the current NPU, else CUDA's current device as upstream, else the CPU).",
    upstream_fix="A device-neutral default for Arguments.device (e.g. torch.get_default_device()).",
    apply=apply,
)
