"""MegaBlocks' routing kernels as ``torch.library`` custom ops (``torch.ops.megablocks_ascend.*``).

Each op runs the dispatcher of :mod:`megablocks_ascend.backends` (validation, backend choice,
trace record) at run time, and has a fake (meta) implementation giving its output's shape, so
``torch.compile`` treats it as one opaque node instead of breaking the graph on Python it cannot
trace. The autograd Functions in :mod:`megablocks_ascend.ops` call these ops, so MegaBlocks' layers
compile through them. ``padded_gather``'s row count is data-dependent (``padded_bins[-1]``) and
is declared as such.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megablocks_ascend import backends

_NS = "megablocks_ascend"


@torch.library.custom_op(f"{_NS}::binned_gather", mutates_args=())
def binned_gather(x: Tensor, indices: Tensor, weights: Optional[Tensor], bins: Tensor,
                  expert_capacity: int, top_k: int) -> Tensor:
    return backends.KERNELS["binned_gather"](x, indices, weights, bins, expert_capacity, top_k)


@binned_gather.register_fake
def _(x, indices, weights, bins, expert_capacity, top_k):
    return x.new_empty(bins.shape[0], expert_capacity, x.shape[1])


@torch.library.custom_op(f"{_NS}::binned_scatter", mutates_args=())
def binned_scatter(x: Tensor, indices: Tensor, weights: Optional[Tensor], bins: Tensor, top_k: int) -> Tensor:
    return backends.KERNELS["binned_scatter"](x, indices, weights, bins, top_k)


@binned_scatter.register_fake
def _(x, indices, weights, bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[2])


@torch.library.custom_op(f"{_NS}::binned_scatter_wgrad", mutates_args=())
def binned_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bins: Tensor, top_k: int) -> Tensor:
    return backends.KERNELS["binned_scatter_wgrad"](x, grad, indices, bins, top_k)


@binned_scatter_wgrad.register_fake
def _(x, grad, indices, bins, top_k):
    return x.new_empty(indices.shape[0])


@torch.library.custom_op(f"{_NS}::gather", mutates_args=())
def gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
           top_k: int) -> Tensor:
    return backends.KERNELS["gather"](x, indices, bin_ids, weights, bins, top_k)


@gather.register_fake
def _(x, indices, bin_ids, weights, bins, top_k):
    return x.new_empty(indices.shape[0], x.shape[1])


@torch.library.custom_op(f"{_NS}::scatter", mutates_args=())
def scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
            top_k: int) -> Tensor:
    return backends.KERNELS["scatter"](x, indices, bin_ids, weights, bins, top_k)


@scatter.register_fake
def _(x, indices, bin_ids, weights, bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[1])


@torch.library.custom_op(f"{_NS}::scatter_wgrad", mutates_args=())
def scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                  top_k: int) -> Tensor:
    return backends.KERNELS["scatter_wgrad"](x, grad, indices, bin_ids, bins, top_k)


@scatter_wgrad.register_fake
def _(x, grad, indices, bin_ids, bins, top_k):
    return x.new_empty(indices.shape[0])


@torch.library.custom_op(f"{_NS}::padded_gather", mutates_args=())
def padded_gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                  padded_bins: Tensor, top_k: int) -> Tensor:
    return backends.KERNELS["padded_gather"](x, indices, bin_ids, weights, bins, padded_bins, top_k)


@padded_gather.register_fake
def _(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, x.shape[1])


@torch.library.custom_op(f"{_NS}::padded_scatter", mutates_args=())
def padded_scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                   padded_bins: Tensor, top_k: int) -> Tensor:
    return backends.KERNELS["padded_scatter"](x, indices, bin_ids, weights, bins, padded_bins, top_k)


@padded_scatter.register_fake
def _(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[1])


@torch.library.custom_op(f"{_NS}::padded_scatter_wgrad", mutates_args=())
def padded_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                         padded_bins: Tensor, top_k: int) -> Tensor:
    return backends.KERNELS["padded_scatter_wgrad"](x, grad, indices, bin_ids, bins, padded_bins, top_k)


@padded_scatter_wgrad.register_fake
def _(x, grad, indices, bin_ids, bins, padded_bins, top_k):
    return x.new_empty(indices.shape[0])


OPS = {name: globals()[name] for name in backends.SPECS}
