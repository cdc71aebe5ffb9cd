"""MegaBlocks' routing ops (``megablocks.ops``) with upstream's autograd semantics.

Each op is the same ``torch.autograd.Function`` as upstream's ``megablocks/ops/<op>.py``
(same forward, same backward, same saved tensors), with two differences: kernels are called
through :mod:`megablocks_ascend.backends`, so ``MEGABLOCKS_BACKEND`` decides who serves them,
and the autocast handling follows the tensors' device instead of assuming CUDA. Under
``torch.compile`` the kernels are called as ``torch.library`` custom ops
(:mod:`megablocks_ascend.library`), so these Functions trace without graph breaks.

Dtypes, the same on every backend (``ascend``, ``torch``, ``cuda``):

* Under ``torch.autocast`` for the device type of ``x``: every floating-point input (``x``, and the
  router ``weights`` of the scatters) is cast to the autocast dtype, and the kernels run on those
  with autocast off (:func:`~megablocks_ascend.autocast.custom_fwd` with ``cast_inputs=True``:
  the rule of stk's ``custom_fwd``, which upstream's ops apply on CUDA only). The result has the
  autocast dtype, bit for bit what the op gives for inputs cast beforehand, and each input's
  gradient comes back in that input's own dtype (float32 weights get float32 gradients).
* Without autocast, dtypes are not unified. The output, and the gradient of ``x``, have ``x``'s
  dtype. ``weights`` may have another floating-point dtype than ``x`` (bf16 tokens with float32
  router weights): they are read as they are, products and the top_k sum are formed in float32 and
  rounded once to ``x``'s dtype. The weights' gradient is computed in float32 and stored in
  ``x``'s dtype (as upstream's kernels allocate it); autograd hands it to float32 weights as
  float32.
* Index tensors (``indices``, ``bin_ids``, ``bins``, ``padded_bins``) are never cast.
"""

from __future__ import annotations

from typing import Any

import torch

from megablocks_ascend import backends, library
from megablocks_ascend.autocast import custom_bwd, custom_fwd
from megablocks_ascend.native import grouped_gemm


class _Kernels:
    """The dispatched kernels: as ``torch.library`` custom ops while ``torch.compile`` traces (one
    opaque node each), as plain calls otherwise (a custom op's Python dispatch costs ~30 us of
    host time per call, which a host-bound layer step feels)."""

    def __getattr__(self, name):
        return library.OPS[name] if torch.compiler.is_compiling() else backends.KERNELS[name]


kernels = _Kernels()


def _padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, num_rows):
    """``kernels.padded_gather`` with ``num_rows`` (None: ``padded_bins[-1]`` rows, read on the host);
    the custom op, which takes no None for an int, is given -1 for it."""
    if torch.compiler.is_compiling():
        return library.OPS["padded_gather"](x, indices, bin_ids, weights, bins, padded_bins, top_k,
                                            -1 if num_rows is None else num_rows)
    return backends.KERNELS["padded_gather"](x, indices, bin_ids, weights, bins, padded_bins, top_k, num_rows)


class BinnedGatherOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, bins, bin_size: int, top_k: int):
        ctx.save_for_backward(indices, bins)
        ctx.top_k = top_k
        return kernels.binned_gather(x, indices, None, bins, bin_size, top_k)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        indices, bins = ctx.saved_tensors
        out = kernels.binned_scatter(grad.contiguous(), indices, None, bins, ctx.top_k)
        return out, None, None, None, None


class BinnedScatterOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, weights, bins, top_k: int):
        if x.ndim != 3:
            raise ValueError(f"binned_scatter: argument 'x' must be 3-D, got shape {tuple(x.shape)}")
        ctx.bin_size = x.shape[1]
        ctx.top_k = top_k
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, indices, weights, bins)
        return kernels.binned_scatter(x, indices, weights, bins, top_k)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        grad = grad.contiguous()
        x, indices, weights, bins = ctx.saved_tensors
        out = kernels.binned_gather(grad, indices, weights, bins, ctx.bin_size, ctx.top_k)
        wgrad = None
        if ctx.needs_input_grad[2]:
            wgrad = kernels.binned_scatter_wgrad(x, grad, indices, bins, ctx.top_k)
        return out, None, wgrad, None, None


class GatherOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, bin_ids, bins, top_k: int):
        ctx.save_for_backward(indices, bin_ids, bins)
        ctx.top_k = top_k
        return kernels.gather(x, indices, bin_ids, None, bins, top_k)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        indices, bin_ids, bins = ctx.saved_tensors
        out = kernels.scatter(grad.contiguous(), indices, bin_ids, None, bins, ctx.top_k)
        return out, None, None, None, None


class ScatterOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, bin_ids, weights, bins, top_k: int):
        ctx.save_for_backward(indices, bin_ids, weights, bins, x if ctx.needs_input_grad[3] else None)
        ctx.top_k = top_k
        return kernels.scatter(x, indices, bin_ids, weights, bins, top_k)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        grad = grad.contiguous()
        indices, bin_ids, weights, bins, x = ctx.saved_tensors
        dgrad = wgrad = None
        if ctx.needs_input_grad[0]:
            dgrad = kernels.gather(grad, indices, bin_ids, weights, bins, ctx.top_k)
        if ctx.needs_input_grad[3]:
            wgrad = kernels.scatter_wgrad(x, grad, indices, bin_ids, bins, ctx.top_k)
        return dgrad, None, None, wgrad, None, None


class PaddedGatherOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, bin_ids, bins, padded_bins, top_k: int, num_rows=None):
        ctx.save_for_backward(indices, bin_ids, bins, padded_bins)
        ctx.top_k = top_k
        return _padded_gather(x, indices, bin_ids, None, bins, padded_bins, top_k, num_rows)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        indices, bin_ids, bins, padded_bins = ctx.saved_tensors
        out = kernels.padded_scatter(grad.contiguous(), indices, bin_ids, None, bins, padded_bins, ctx.top_k)
        return out, None, None, None, None, None, None


class PaddedScatterOp(torch.autograd.Function):

    @staticmethod
    @custom_fwd(cast_inputs=True)
    def forward(ctx: Any, x, indices, bin_ids, weights, bins, padded_bins, top_k: int):
        ctx.save_for_backward(indices, bin_ids, weights, bins, padded_bins,
                              x if ctx.needs_input_grad[3] else None)
        ctx.top_k = top_k
        ctx.rows = x.shape[0]  # x's gradient has x's rows, whatever padded_bins[-1] is: no host read
        return kernels.padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k)

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad):
        grad = grad.contiguous()
        indices, bin_ids, weights, bins, padded_bins, x = ctx.saved_tensors
        dgrad = wgrad = None
        if ctx.needs_input_grad[0]:
            dgrad = _padded_gather(grad, indices, bin_ids, weights, bins, padded_bins, ctx.top_k, ctx.rows)
        if ctx.needs_input_grad[3]:
            wgrad = kernels.padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, ctx.top_k)
        return dgrad, None, None, wgrad, None, None, None


def binned_gather(x, indices, bins, bin_size, top_k):
    return BinnedGatherOp.apply(x, indices, bins, bin_size, top_k)


def binned_scatter(x, indices, weights, bins, top_k):
    return BinnedScatterOp.apply(x, indices, weights, bins, top_k)


def gather(x, indices, bin_ids, bins, top_k):
    return GatherOp.apply(x, indices, bin_ids, bins, top_k)


def scatter(x, indices, bin_ids, weights, bins, top_k):
    return ScatterOp.apply(x, indices, bin_ids, weights, bins, top_k)


def padded_gather(x, indices, bin_ids, bins, padded_bins, top_k, num_rows=None):
    """MegaBlocks' ``ops.padded_gather``. ``num_rows`` (ours): the output's row count, at least
    ``padded_bins[-1]`` (:func:`padded_rows` gives one that holds for any routing); the rows past
    the layout's are zero. Without it the row count is ``padded_bins[-1]``, read on the host
    (upstream's semantics: a device-to-host sync, refused with ``CaptureError`` during a capture)."""
    return PaddedGatherOp.apply(x, indices, bin_ids, bins, padded_bins, top_k, num_rows)


def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    return PaddedScatterOp.apply(x, indices, bin_ids, weights, bins, padded_bins, top_k)


def prepare_routing(top_experts, num_experts: int, block: int = 0, route: int = -1, capacity: int = 0):
    """The routing preparation: ``(indices, bin_ids, bins, tokens_per_expert, padded_bins)`` of the
    router's expert ids, what MegaBlocks' ``ops.sort`` / ``ops.histogram`` / ``ops.inclusive_cumsum``
    (/ ``ops.round_up``) sequence gives (``padded_bins``: each expert's count rounded up to a multiple
    of ``block``; None when ``block`` is 0). No gradients (MegaBlocks calls it under ``no_grad``).
    On ``ascend`` it is two launches, and ``route`` (a routing layout, ``capacity`` for the binned
    one) names the route map to write in them for the routing calls that follow; see
    :func:`megablocks_ascend.backends.prepare_routing`. A ``torch.library`` custom op while
    ``torch.compile`` traces.

    ``bins`` is kept on ``tokens_per_expert`` as the group ends of the grouped GEMMs that take it
    as their ``batch_sizes`` over the step's assignments (the grouped dMoE's expert MLP), so they
    launch nothing to compute them (:func:`~megablocks_ascend.native.grouped_gemm.keep_group_ends`)."""
    if torch.compiler.is_compiling():
        indices, bin_ids, bins, tokens_per_expert, padded_bins = library.prepare_routing(
            top_experts, num_experts, block, route, capacity)
        return indices, bin_ids, bins, tokens_per_expert, padded_bins if block else None
    prepared = backends.prepare_routing(top_experts, num_experts, block, route, capacity)
    indices, _, bins, tokens_per_expert, _ = prepared
    grouped_gemm.keep_group_ends(tokens_per_expert, bins, rows=indices.shape[0])
    return prepared


def padded_rows(assignments: int, experts: int, block: int) -> int:
    """The most rows MegaBlocks' padded layout can take for ``assignments`` routed to ``experts``
    with each expert's count rounded up to a multiple of ``block``, for any routing: every expert
    that receives assignments adds at most ``block - 1`` rows of padding, and at most
    ``m = min(experts, assignments)`` of them receive any, so ``block * floor((assignments + m *
    (block - 1)) / block)``, at most ``m * (block - 1)`` rows above the routing's own
    ``padded_bins[-1]``. Known to the host without reading the routing: the sparse dMoE's static
    size (``MEGABLOCKS_ASCEND_SPARSE_SIZES``)."""
    for name, value, low in (("assignments", assignments, 0), ("experts", experts, 1), ("block", block, 1)):
        if type(value) is not int or value < low:
            raise ValueError(f"padded_rows: '{name}' must be a Python int >= {low}, got {value!r}")
    used = min(experts, assignments)
    return (assignments + used * (block - 1)) // block * block


def topology(padded_bins, block_size: int, block_rows: int, blocks_per_row: int):
    """The sparse dMoE's block-sparse topology, ``(row_indices, column_indices, offsets,
    column_indices_t, offsets_t, block_offsets_t)`` of a matrix of ``block_rows`` block rows whose
    first ``padded_bins[-1] / block_size`` are the experts' (``blocks_per_row`` blocks each, at the
    columns of their expert) and the rest spare capacity with no blocks
    (``kernels/topology.py``). Served by the backend ``MEGABLOCKS_BACKEND`` selects: one launch on
    ``ascend``; upstream's sequence (which needs ``block_rows == padded_bins[-1] / block_size``) on
    ``cuda``. No gradients; a ``torch.library`` custom op while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return library.topology(padded_bins, block_size, block_rows, blocks_per_row)
    return backends.topology(padded_bins, block_size, block_rows, blocks_per_row)


OPS = {
    "binned_gather": binned_gather,
    "binned_scatter": binned_scatter,
    "gather": gather,
    "scatter": scatter,
    "padded_gather": padded_gather,
    "padded_scatter": padded_scatter,
}
