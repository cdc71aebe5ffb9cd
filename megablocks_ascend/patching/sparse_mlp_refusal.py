"""The ``sparse-mlp-refusal`` patch (page: ``patches/sparse-mlp-refusal.md``): MegaBlocks' refusal
of ``mlp_impl="sparse"`` with Triton >= 3.2 (stk's kernels overflow there) is lifted while stk's
matmuls on the layer's device are ours or the torch reference (:func:`lift_sparse_refusal`), and
kept, saying why and what to set, otherwise (:func:`sparse_mlp_blocker`).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from megablocks_ascend.patching.registry import Patch, PatchError, expect_params

SPARSE_REFUSAL = "Sparse MLP is not supported with triton"
_SPARSE_LIFTED = "sparse (megablocks-ascend: refusal lifted)"  # what __post_init__ sees while it runs


def sparse_mlp_blocker(device: Any) -> str | None:
    """Why MegaBlocks' refusal of ``mlp_impl="sparse"`` must stay for a layer on ``device``, or
    None when stk's matmuls on that device are served by our kernels or the torch reference."""
    from megablocks_ascend import backends  # noqa: PLC0415
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"the layer's device {device!r} cannot be read ({e})"
    try:
        backend = backends.resolve(dev)
    except backends.BackendUnavailable as e:
        return str(e)
    if backends.RECORDS[backend].upstream:
        return (f"MEGABLOCKS_BACKEND={backends.requested()} sends stk's block-sparse matmuls on {dev} to stk's own "
                "Triton kernels, which with Triton >= 3.2 compute wrong results once a sparse matrix has more than "
                "32768 rows or columns (megablocks-ascend refuses those calls; see patches/sparse-mlp-refusal.md). "
                "Set MEGABLOCKS_BACKEND=ascend to use megablocks-ascend's kernels (or torch for plain PyTorch), "
                "or use mlp_impl=\"grouped\"")
    return None


def lift_sparse_refusal(original: Callable) -> Callable:
    """``Arguments.__post_init__`` without its refusal of ``mlp_impl="sparse"`` while stk's matmuls
    on the layer's device are ours, and with the reason added to the refusal otherwise."""

    def __post_init__(self):
        if self.mlp_impl != "sparse":
            return original(self)
        blocker = sparse_mlp_blocker(self.device)
        if blocker is not None:
            try:
                return original(self)
            except ValueError as e:
                if SPARSE_REFUSAL not in str(e):
                    raise
                raise ValueError(f"{e} (megablocks-ascend: the refusal stays: {blocker})") from e
        # stk's matmuls are ours: run every other check of the original, then restore the value.
        self.mlp_impl = _SPARSE_LIFTED
        try:
            return original(self)
        finally:
            self.mlp_impl = "sparse"

    __post_init__.__wrapped__ = original
    return __post_init__


def apply(p: Patch) -> None:
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    target = "megablocks.layers.arguments:Arguments.__post_init__"
    original = Arguments.__dict__.get("__post_init__")
    if original is None:
        raise PatchError(f"{target} is missing")
    expect_params(target, original, ("self",))
    # Shape check by behaviour: the original refuses "sparse" with its message, and runs the rest of
    # its checks for a value it does not know (which the wrapper below relies on).
    try:
        original(types.SimpleNamespace(mlp_impl="sparse", shared_expert_hidden_size=None, ffn_hidden_size=8))
    except ValueError as e:
        if SPARSE_REFUSAL not in str(e):
            raise PatchError(f"{target} raises {e!r} for mlp_impl='sparse', not the refusal this patch lifts") from e
    else:
        return  # this MegaBlocks / Triton does not refuse the sparse MLP: nothing to lift
    probe = types.SimpleNamespace(mlp_impl=_SPARSE_LIFTED, shared_expert_hidden_size=None, ffn_hidden_size=8)
    try:
        original(probe)
    except Exception as e:  # noqa: BLE001
        raise PatchError(f"{target} no longer accepts an mlp_impl it does not check ({e!r})") from e
    if probe.shared_expert_hidden_size != 8:
        raise PatchError(f"{target} no longer defaults shared_expert_hidden_size to ffn_hidden_size")

    p.replace(target, lift_sparse_refusal(original))


PATCH = Patch(
    name="sparse-mlp-refusal",
    targets=("megablocks.layers.arguments:Arguments.__post_init__",),
    why="MegaBlocks 0.10.0 refuses `mlp_impl=\"sparse\"`, which is also `Arguments`' default, whenever "
        '`triton.__version__ >= "3.2.0"` (MegaBlocks PR #168): `ValueError: Sparse MLP is not supported '
        "with triton >=3.2.0`. That covers triton-ascend 3.2.0 and every current Triton, so `Arguments()` "
        "itself raises. The reason is real: stk's kernels overflow int16 arithmetic at real sizes (see "
        "[stk-kernels](stk-kernels.md)). With the stk-kernels patch, stk's matmuls no longer have to run "
        "those kernels.",
    how='`Arguments.__post_init__` is wrapped. For any `mlp_impl` other than `"sparse"` it runs the '
        "original unchanged. For `\"sparse\"` it resolves the backend that would serve stk's matmuls on "
        "the layer's device (`Arguments.device`, from `MEGABLOCKS_BACKEND` / `use_backend()`):",
    upstream_fix="Release stk's overflow fix (stk PR #17) and remove the Triton version check from "
                 "`Arguments.__post_init__` (MegaBlocks issue #178 asks for it).",
    apply=apply,
)
