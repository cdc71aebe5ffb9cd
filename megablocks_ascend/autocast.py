"""Device-generic versions of the autocast decorators MegaBlocks and stk hard-code to CUDA.

MegaBlocks decorates its memory-optimized MLPs with ``torch.amp.custom_fwd(device_type='cuda')``,
and stk (whose decorators MegaBlocks' routing ops use too) has its own ``custom_fwd`` that asks
only CUDA's autocast and casts only CUDA tensors. Under autocast on an NPU or the CPU those
forwards do not see the caller's autocast state, and their backwards do not replay it.

:func:`custom_fwd` and :func:`custom_bwd` keep ``torch.amp.custom_fwd``/``custom_bwd``'s contract
exactly (same attributes on ``ctx``, same casting rule), with one difference: the device type is
the one of the forward's first tensor argument instead of a constant.

* ``ctx._dtype``: ``torch.get_autocast_dtype(device_type)``, set on every call (MegaBlocks'
  memory-optimized MLPs cast their inputs to it when ``ctx._fwd_used_autocast``);
* ``ctx._fwd_used_autocast``: whether the forward ran under autocast;
* ``ctx._autocast_device_type``: the device type both decorators use (torch's decorators take it as
  an argument instead).

``cast_inputs=None`` runs the forward under the caller's autocast state, and the backward under
the same state. ``cast_inputs=<dtype>`` (torch's meaning) or ``cast_inputs=True`` (stk's: whatever
dtype autocast is using) casts the floating-point tensors on that device type (float64 excepted) to
that dtype when autocast is on, and runs the forward, and then the backward, with autocast off.
Outside autocast both are no-ops.
"""

from __future__ import annotations

import functools

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` in this thread, or ``None`` where it is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = tuple(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def _device_type(fwd, args, kwargs) -> str:
    found = _first_tensor(args)
    if found is None:
        found = _first_tensor(kwargs)
    if found is None:
        raise TypeError(f"{fwd.__qualname__}: megablocks_ascend.autocast.custom_fwd takes the device type "
                        "from the forward's tensor arguments, but it was called without any")
    return found.device.type


def cast(value, device_type: str, dtype: torch.dtype):
    """``value`` with its floating-point tensors on ``device_type`` cast to ``dtype``, float64
    excepted (``torch.amp.custom_fwd``'s rule), also inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type \
            and value.dtype is not torch.float64
        return value.to(dtype) if eligible else value
    if isinstance(value, dict):
        return {k: cast(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and _first_tensor(value) is not None:
        return type(value)(cast(v, device_type, dtype) for v in value)
    return value


def custom_fwd(fwd=None, *, cast_inputs: torch.dtype | bool | None = None):
    """``torch.amp.custom_fwd`` for whichever device the forward's tensors are on (module docstring)."""
    if cast_inputs is not None and cast_inputs is not True and not isinstance(cast_inputs, torch.dtype):
        raise TypeError(f"cast_inputs must be None, True or a torch.dtype, got {cast_inputs!r}")
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(ctx, *args, **kwargs):
        first = args[0] if args else None  # (the routing ops' forwards take a tensor first: no search)
        device_type = first.device.type if isinstance(first, torch.Tensor) else _device_type(fwd, args, kwargs)
        enabled = torch.is_autocast_enabled(device_type)
        ctx._autocast_device_type = device_type
        ctx._dtype = torch.get_autocast_dtype(device_type)
        if cast_inputs is None:
            ctx._fwd_used_autocast = enabled
            return fwd(ctx, *args, **kwargs)
        ctx._fwd_used_autocast = False
        if not enabled:
            return fwd(ctx, *args, **kwargs)
        dtype = ctx._dtype if cast_inputs is True else cast_inputs
        with torch.autocast(device_type=device_type, enabled=False):
            return fwd(ctx, *cast(args, device_type, dtype), **cast(kwargs, device_type, dtype))

    return decorate_fwd


def custom_bwd(bwd):
    """``torch.amp.custom_bwd``: runs the backward under the autocast state its forward recorded
    (see :func:`custom_fwd`; like torch's, it needs the forward to have been decorated)."""

    @functools.wraps(bwd)
    def decorate_bwd(ctx, *args, **kwargs):
        device_type = ctx._autocast_device_type
        if not ctx._fwd_used_autocast and not torch.is_autocast_enabled(device_type) \
                and torch.get_autocast_dtype(device_type) == ctx._dtype:
            # Already the state the forward recorded (autocast off, same dtype): entering it again
            # would change nothing but cost host time on every backward of a routing op.
            return bwd(ctx, *args, **kwargs)
        with torch.autocast(device_type=device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd


def cast_if_autocast_enabled(tensor: torch.Tensor) -> torch.Tensor:
    """``megablocks.layers.common.cast_if_autocast_enabled`` for any device type."""
    dtype = autocast_dtype(tensor.device.type)
    return tensor if dtype is None else tensor.to(dtype=dtype)
