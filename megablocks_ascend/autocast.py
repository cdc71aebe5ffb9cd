"""Device-generic versions of the autocast decorators MegaBlocks hard-codes to CUDA.

MegaBlocks decorates its custom autograd functions with
``torch.amp.custom_fwd(device_type='cuda')`` (and stk's equivalents), so under autocast on
an NPU (or the CPU) the forward does not see the autocast state it was called with, and the
backward does not replay it. These decorators take the device type from the tensors they
are given instead.
"""

from __future__ import annotations

import functools

import torch


def _device_type(args) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def custom_fwd(fwd=None, *, cast_inputs: bool = False):
    """Like ``torch.amp.custom_fwd``, for whichever device the inputs are on.

    With ``cast_inputs=True`` (stk's behaviour) floating inputs are cast to the autocast dtype
    and the forward runs with autocast off; otherwise the forward runs under the caller's
    autocast state and the backward replays it.
    """
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        device_type = _device_type(args)
        ctx._autocast_device_type = device_type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        ctx._autocast_dtype = torch.get_autocast_dtype(device_type)
        if cast_inputs and ctx._fwd_used_autocast:
            dtype = ctx._autocast_dtype
            ctx._fwd_used_autocast = False
            with torch.autocast(device_type=device_type, enabled=False):
                return fwd(ctx, *_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
        return fwd(ctx, *args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd):
    """Runs the backward under the autocast state its forward saw (see :func:`custom_fwd`)."""

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *args, **kwargs):
        device_type = getattr(ctx, "_autocast_device_type", "cpu")
        with torch.autocast(device_type=device_type, enabled=getattr(ctx, "_fwd_used_autocast", False),
                            dtype=getattr(ctx, "_autocast_dtype", None)):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd


def cast_if_autocast_enabled(tensor: torch.Tensor) -> torch.Tensor:
    """``megablocks.layers.common.cast_if_autocast_enabled`` for any device type."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return tensor.to(dtype=torch.get_autocast_dtype(device_type))
    return tensor
