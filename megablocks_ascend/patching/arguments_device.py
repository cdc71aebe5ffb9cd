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
    why="`Arguments.device` is declared with `default_factory=torch.cuda.current_device`, so "
        "`Arguments(...)` without an explicit `device` raises on any machine without CUDA. The dataclass's "
        "generated `__init__` captured that factory, so changing the field afterwards has no effect.",
    how="`Arguments.__init__` is wrapped: when the caller passes no `device` (neither by keyword nor by "
        "position), the wrapper passes `megablocks_ascend.patching.default_device()`: the current NPU when "
        "torch_npu reports one, else CUDA's current device (upstream's behaviour), else the CPU. An "
        "explicit `device` is passed through untouched. The patch refuses to install if the field's "
        "default factory is no longer `torch.cuda.current_device`.",
    upstream_fix="A device-neutral default, e.g. `default_factory=lambda: torch.get_default_device()` or "
                 "accelerator-aware selection via `torch.accelerator.current_accelerator()`.",
    apply=apply,
)
