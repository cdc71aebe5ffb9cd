"""MegaBlocks' memory-optimized grouped MLP and GLU, for a grouped GEMM that returns its results.

MegaBlocks' ``MemoryOptimizedGroupedMLP`` / ``MemoryOptimizedGroupedGLU`` (``megablocks/layers/mlp.py``,
``glu.py``) save memory in their backward by handing two of its grouped GEMMs a buffer to overwrite:
``gmm(ddsd_out, w2, trans_b=True, c=activation_fn_out)`` and ``gmm(dsdd_out, w1, c=ddsd_out)``.
The ``grouped_gemm`` package writes into ``c`` directly. Neither ``torch._grouped_mm`` nor
``npu_grouped_matmul`` has an ``out=`` argument, so the stand-in computes into a new tensor and
copies it into ``c``: a full read and write of a ``[tokens x top_k, ffn]`` and a
``[tokens x top_k, hidden]`` tensor per step, for nothing.

The two functions here are upstream's, with that one difference: their forward is upstream's own
(called through the decorators the ``autocast-device`` patch gives it), and their backward is
upstream's code with the two GEMM results taken as returned instead of copied into ``c``. The
buffers they no longer overwrite are released where upstream would have reused them (the MLP's
recomputed activation, once its weight gradient is computed), so the peak memory is upstream's
with the real package for the MLP with the default activation, and one buffer more (the GEMM's
result while the buffer it would have overwritten is still referenced, as with the copy) otherwise.

:func:`memory_optimized_grouped_mlp` and :func:`memory_optimized_grouped_glu` are what the
``grouped-mlp-device-sizes`` patch's forwards call when MegaBlocks uses the stand-in
(``patches/grouped-mlp-device-sizes.md``). What they use of MegaBlocks is looked up by :func:`bind` (the patch calls it; otherwise the first
forward does).
"""

from __future__ import annotations

from typing import Any

import torch

from megablocks_ascend import autocast


def _inner(method) -> Any:
    """The undecorated function of a ``custom_fwd``/``custom_bwd``-decorated autograd method."""
    fn = getattr(method, "__func__", method)
    return getattr(fn, "__wrapped__", fn)


# What the functions below use of MegaBlocks, looked up once (by bind(), which the patch calls when
# it installs) rather than in the functions themselves, which torch.compile traces: upstream's
# undecorated forwards, grouped_gemm_util (its backend at call time), gelu, the default activation.
_mlp_forward = _glu_forward = _gg = _gelu = _default_activation = None


def bind() -> None:
    """Look up what the functions below use of MegaBlocks."""
    global _mlp_forward, _glu_forward, _gg, _gelu, _default_activation
    from megablocks import grouped_gemm_util  # noqa: PLC0415
    from megablocks.layers import gelu, glu, mlp  # noqa: PLC0415
    from megablocks.layers.arguments import DEFAULT_ACTIVATION_FN  # noqa: PLC0415
    _mlp_forward = _inner(mlp.MemoryOptimizedGroupedMLP.forward)
    _glu_forward = _inner(glu.MemoryOptimizedGroupedGLU.forward)
    _gg, _gelu, _default_activation = grouped_gemm_util, gelu, DEFAULT_ACTIVATION_FN


class MemoryOptimizedGroupedMLP(torch.autograd.Function):
    """``megablocks.layers.mlp.MemoryOptimizedGroupedMLP`` without the copies into ``c``."""

    @staticmethod
    @autocast.custom_fwd
    def forward(ctx, x, w1, w2, batch_sizes, activation_fn):
        if _mlp_forward is None:
            bind()
        return _mlp_forward(ctx, x, w1, w2, batch_sizes, activation_fn)

    @staticmethod
    @autocast.custom_bwd
    def backward(ctx: Any, ddsd_out: torch.Tensor):
        gg = _gg
        if not ctx.needs_input_grad[0] or not ctx.needs_input_grad[1] or not ctx.needs_input_grad[2]:
            raise ValueError("Expected all MLP inputs to need grad.")
        w1, w2, batch_sizes, x, sdd_out = ctx.saved_tensors

        # Rematerialize the activation (upstream).
        activation_fn = ctx.activation_fn
        with torch.set_grad_enabled(True):
            sdd_out.requires_grad = True
            activation_fn_out = activation_fn(sdd_out)
            activation_grad_fn = activation_fn_out.backward

        dw2 = gg.backend.gmm(activation_fn_out, ddsd_out, batch_sizes, trans_a=True)
        default = activation_fn is _default_activation
        if default:
            del activation_fn_out, activation_grad_fn  # upstream reuses this buffer for the next result

        # The activation's gradient, as returned (upstream: written into activation_fn_out).
        dactivation_fn_out = gg.backend.gmm(ddsd_out, w2, batch_sizes, trans_b=True)
        if default:
            dsdd_out = _gelu.gelu_backward_(dactivation_fn_out, sdd_out)
        else:
            activation_grad_fn(dactivation_fn_out)
            dsdd_out = sdd_out.grad

        dw1 = gg.backend.gmm(dsdd_out, x, batch_sizes, trans_a=True)
        # dx, as returned (upstream: written into ddsd_out).
        dx = gg.backend.gmm(dsdd_out, w1, batch_sizes)
        return dx, dw1, dw2, None, None


class MemoryOptimizedGroupedGLU(torch.autograd.Function):
    """``megablocks.layers.glu.MemoryOptimizedGroupedGLU`` without the copy into ``c``."""

    @staticmethod
    @autocast.custom_fwd
    def forward(ctx, x, w1, v1, w2, batch_sizes, activation_fn):
        if _glu_forward is None:
            bind()
        return _glu_forward(ctx, x, w1, v1, w2, batch_sizes, activation_fn)

    @staticmethod
    @autocast.custom_bwd
    def backward(ctx, ddsd_out):
        gg = _gg
        if not ctx.needs_input_grad[0] or not ctx.needs_input_grad[1] or not ctx.needs_input_grad[2]:
            raise ValueError("Expected all MLP inputs to need grad.")
        w1, v1, w2, batch_sizes, x, sdd_out, v1_out = ctx.saved_tensors

        # Rematerialize the activation (upstream).
        activation_fn = ctx.activation_fn
        with torch.set_grad_enabled(True):
            sdd_out.requires_grad = True
            v1_out.requires_grad = True
            activation_fn_out = activation_fn(sdd_out) * v1_out
            activation_grad_fn = activation_fn_out.backward

        dw2 = gg.backend.gmm(activation_fn_out, ddsd_out, batch_sizes, trans_a=True)

        # The activation's gradient, as returned (upstream: written into activation_fn_out).
        dactivation_fn_out = gg.backend.gmm(ddsd_out, w2, batch_sizes, trans_b=True)
        activation_grad_fn(dactivation_fn_out)
        dsdd_out = sdd_out.grad
        dv1_out = v1_out.grad

        dw1 = gg.backend.gmm(dsdd_out, x, batch_sizes, trans_a=True)
        dv1 = gg.backend.gmm(dv1_out, x, batch_sizes, trans_a=True)
        # dx, as returned (upstream: written into ddsd_out), plus the v1 path's part (upstream).
        dx = gg.backend.gmm(dsdd_out, w1, batch_sizes)
        dx += gg.backend.gmm(dv1_out, v1, batch_sizes)
        return dx, dw1, dv1, dw2, None, None


memory_optimized_grouped_mlp = MemoryOptimizedGroupedMLP.apply
memory_optimized_grouped_glu = MemoryOptimizedGroupedGLU.apply

# The upstream code these follow, undecorated, with its source fingerprint in MegaBlocks 0.10.0
# (patching.registry.source_fingerprint): the forwards are called as they are, the backwards
# re-expressed above. The patch that calls these functions refuses to install over another body.
UPSTREAM = {
    "megablocks.layers.mlp:MemoryOptimizedGroupedMLP.forward": "25824f0d07fb1e7b",
    "megablocks.layers.mlp:MemoryOptimizedGroupedMLP.backward": "35596ccf0a77a011",
    "megablocks.layers.glu:MemoryOptimizedGroupedGLU.forward": "f548f88285009fbb",
    "megablocks.layers.glu:MemoryOptimizedGroupedGLU.backward": "e7b7281f415930e6",
}
