"""MegaBlocks' routing kernels as ``torch.library`` custom ops (``torch.ops.megablocks_ascend.*``).

Each op runs the dispatcher of :mod:`megablocks_ascend.backends` (validation, backend choice,
trace record) at run time, and has a fake (meta) implementation giving its output's shape, so
``torch.compile`` treats it as one opaque node instead of breaking the graph on Python it cannot
trace. The autograd Functions in :mod:`megablocks_ascend.ops` call these ops, so MegaBlocks' layers
compile through them. ``padded_gather``'s row count is data-dependent (``padded_bins[-1]``) and
is declared as such, unless the caller gives it (``num_rows``: the sparse dMoE's static size).

stk's block-sparse matmuls are custom ops too (``torch.ops.megablocks_ascend.stk_{sdd,dsd,dds,
row_indices}``, writing ``out`` in place, so declared ``mutates_args=("out",)``).
:data:`STK_ENTRY_POINTS` are the functions installed as ``stk.backend.triton_kernels.*``: they call
the custom op while ``torch.compile`` traces and the dispatcher directly otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from megablocks_ascend import backends, keeping, validation

_NS = "megablocks_ascend"


@torch.library.custom_op(f"{_NS}::binned_gather", mutates_args=())
def binned_gather(x: Tensor, indices: Tensor, weights: Optional[Tensor], bins: Tensor,
                  expert_capacity: int, top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["binned_gather"](x, indices, weights, bins, expert_capacity, top_k)


@binned_gather.register_fake
def _(x, indices, weights, bins, expert_capacity, top_k):
    return x.new_empty(bins.shape[0], expert_capacity, x.shape[1])


@torch.library.custom_op(f"{_NS}::binned_scatter", mutates_args=())
def binned_scatter(x: Tensor, indices: Tensor, weights: Optional[Tensor], bins: Tensor, top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["binned_scatter"](x, indices, weights, bins, top_k)


@binned_scatter.register_fake
def _(x, indices, weights, bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[2])


@torch.library.custom_op(f"{_NS}::binned_scatter_wgrad", mutates_args=())
def binned_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bins: Tensor, top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["binned_scatter_wgrad"](x, grad, indices, bins, top_k)


@binned_scatter_wgrad.register_fake
def _(x, grad, indices, bins, top_k):
    return x.new_empty(indices.shape[0])


@torch.library.custom_op(f"{_NS}::gather", mutates_args=())
def gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
           top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["gather"](x, indices, bin_ids, weights, bins, top_k)


@gather.register_fake
def _(x, indices, bin_ids, weights, bins, top_k):
    return x.new_empty(indices.shape[0], x.shape[1])


@torch.library.custom_op(f"{_NS}::scatter", mutates_args=())
def scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
            top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["scatter"](x, indices, bin_ids, weights, bins, top_k)


@scatter.register_fake
def _(x, indices, bin_ids, weights, bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[1])


@torch.library.custom_op(f"{_NS}::scatter_wgrad", mutates_args=())
def scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                  top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["scatter_wgrad"](x, grad, indices, bin_ids, bins, top_k)


@scatter_wgrad.register_fake
def _(x, grad, indices, bin_ids, bins, top_k):
    return x.new_empty(indices.shape[0])


# num_rows: -1 for None (a custom op's int cannot be None): the row count padded_bins[-1], data-dependent.
@torch.library.custom_op(f"{_NS}::padded_gather", mutates_args=())
def padded_gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                  padded_bins: Tensor, top_k: int, num_rows: int = -1) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["padded_gather"](x, indices, bin_ids, weights, bins, padded_bins, top_k,
                                                 None if num_rows < 0 else num_rows)


@padded_gather.register_fake
def _(x, indices, bin_ids, weights, bins, padded_bins, top_k, num_rows=-1):
    rows = num_rows if num_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, x.shape[1])


@torch.library.custom_op(f"{_NS}::padded_scatter", mutates_args=())
def padded_scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Optional[Tensor], bins: Tensor,
                   padded_bins: Tensor, top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["padded_scatter"](x, indices, bin_ids, weights, bins, padded_bins, top_k)


@padded_scatter.register_fake
def _(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    return x.new_empty(indices.shape[0] // top_k, x.shape[1])


@torch.library.custom_op(f"{_NS}::padded_scatter_wgrad", mutates_args=())
def padded_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                         padded_bins: Tensor, top_k: int) -> Tensor:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors
        return backends.KERNELS["padded_scatter_wgrad"](x, grad, indices, bin_ids, bins, padded_bins, top_k)


@padded_scatter_wgrad.register_fake
def _(x, grad, indices, bin_ids, bins, padded_bins, top_k):
    return x.new_empty(indices.shape[0])


OPS = {name: globals()[name] for name in backends.SPECS}


# The routing preparation. A custom op cannot return None, so ``padded_bins`` is an empty tensor
# when ``block`` is 0 (ops.prepare_routing turns it back into None).
@torch.library.custom_op(f"{_NS}::prepare_routing", mutates_args=())
def prepare_routing(top_experts: Tensor, num_experts: int, block: int, route: int,
                    capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with keeping.no_reuse():  # compiled graphs: nothing kept on their tensors (no route map either)
        indices, bin_ids, bins, tokens_per_expert, padded_bins = backends.prepare_routing(
            top_experts, num_experts, block, route, capacity)
    return indices, bin_ids, bins, tokens_per_expert, padded_bins if padded_bins is not None else bins.new_empty(0)


@prepare_routing.register_fake
def _(top_experts, num_experts, block, route, capacity):
    n = top_experts.numel()
    like = top_experts.new_empty(0, dtype=torch.int32)
    return (like.new_empty(n), like.new_empty(n), like.new_empty(num_experts), like.new_empty(num_experts),
            like.new_empty(num_experts if block else 0))


# The sparse dMoE's topology (ops.topology): six index tensors whose sizes the arguments give.
@torch.library.custom_op(f"{_NS}::topology", mutates_args=())
def topology(padded_bins: Tensor, block_size: int, block_rows: int,
             blocks_per_row: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(backends.topology(padded_bins, block_size, block_rows, blocks_per_row))


@topology.register_fake
def _(padded_bins, block_size, block_rows, blocks_per_row):
    nnz = block_rows * blocks_per_row
    index = padded_bins.new_empty(0, dtype=torch.int16)
    offsets = padded_bins.new_empty(0, dtype=torch.int32)
    return (index.new_empty(nnz), index.new_empty(nnz), offsets.new_empty(block_rows + 1), index.new_empty(nnz),
            offsets.new_empty(padded_bins.shape[0] * blocks_per_row + 1), offsets.new_empty(nnz))


# ------------------------------------------------------------------------------------------
# stk's block-sparse matmuls (stk.backend.triton_kernels).


@torch.library.custom_op(f"{_NS}::stk_sdd", mutates_args=("out",))
def stk_sdd(lhs: Tensor, rhs: Tensor, shape: Sequence[int], out: Tensor, offsets: Tensor, row_indices: Tensor,
            column_indices: Tensor) -> None:
    backends.STK_KERNELS["sdd"](lhs, rhs, tuple(shape), out, offsets, row_indices, column_indices)


@stk_sdd.register_fake
def _(lhs, rhs, shape, out, offsets, row_indices, column_indices):
    return None


@torch.library.custom_op(f"{_NS}::stk_dsd", mutates_args=("out",))
def stk_dsd(shape: Sequence[int], data: Tensor, offsets: Tensor, row_indices: Tensor, column_indices: Tensor,
            offsets_t: Tensor, column_indices_t: Tensor, block_offsets_t: Tensor, transpose_a: bool, rhs: Tensor,
            out: Tensor) -> None:
    backends.STK_KERNELS["dsd"](tuple(shape), data, offsets, row_indices, column_indices, offsets_t,
                                column_indices_t, block_offsets_t, transpose_a, rhs, out)


@stk_dsd.register_fake
def _(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
      transpose_a, rhs, out):
    return None


@torch.library.custom_op(f"{_NS}::stk_dds", mutates_args=("out",))
def stk_dds(lhs: Tensor, shape: Sequence[int], data: Tensor, offsets: Tensor, row_indices: Tensor,
            column_indices: Tensor, offsets_t: Tensor, column_indices_t: Tensor, block_offsets_t: Tensor,
            transpose_b: bool, out: Tensor) -> None:
    backends.STK_KERNELS["dds"](lhs, tuple(shape), data, offsets, row_indices, column_indices, offsets_t,
                                column_indices_t, block_offsets_t, transpose_b, out)


@stk_dds.register_fake
def _(lhs, shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
      transpose_b, out):
    return None


# row_indices' ``data`` only tells the block count and size, and MegaBlocks passes it on the meta
# device: a meta tensor among a custom op's arguments would send the call to the fake
# implementation, so the op takes the two numbers instead.
@torch.library.custom_op(f"{_NS}::stk_row_indices", mutates_args=("out",))
def stk_row_indices(shape: Sequence[int], blocks: int, block_size: int, offsets: Tensor, column_indices: Tensor,
                    out: Tensor) -> None:
    data = torch.empty((blocks, block_size, block_size), device="meta")
    backends.STK_KERNELS["row_indices"](tuple(shape), data, offsets, column_indices, out)


@stk_row_indices.register_fake
def _(shape, blocks, block_size, offsets, column_indices, out):
    return None


def sdd(lhs, rhs, shape, out, offsets, row_indices, column_indices):
    if torch.compiler.is_compiling():
        return stk_sdd(lhs, rhs, list(shape), out, offsets, row_indices, column_indices)
    return backends.STK_KERNELS["sdd"](lhs, rhs, shape, out, offsets, row_indices, column_indices)


def dsd(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_a, rhs, out):
    if torch.compiler.is_compiling():
        return stk_dsd(list(shape), data, offsets, row_indices, column_indices, offsets_t, column_indices_t,
                       block_offsets_t, bool(transpose_a), rhs, out)
    return backends.STK_KERNELS["dsd"](shape, data, offsets, row_indices, column_indices, offsets_t,
                                       column_indices_t, block_offsets_t, transpose_a, rhs, out)


def dds(lhs, shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_b, out):
    if torch.compiler.is_compiling():
        return stk_dds(lhs, list(shape), data, offsets, row_indices, column_indices, offsets_t, column_indices_t,
                       block_offsets_t, bool(transpose_b), out)
    return backends.STK_KERNELS["dds"](lhs, shape, data, offsets, row_indices, column_indices, offsets_t,
                                       column_indices_t, block_offsets_t, transpose_b, out)


def row_indices(shape, data, offsets, column_indices, out):
    if torch.compiler.is_compiling():
        if out.dtype == torch.int16:
            # The sparse dMoE's row count is data-dependent (padded_gather), and right after this
            # call stk.Matrix compares it with its int16 limit, which the compiler cannot decide.
            # Validation holds every call to the same limit; stating it here lets it decide.
            torch._check(shape[0] <= validation.INT16_BLOCKS * data.shape[1])
        return stk_row_indices(list(shape), data.shape[0], data.shape[1], offsets, column_indices, out)
    return backends.STK_KERNELS["row_indices"](shape, data, offsets, column_indices, out)


STK_ENTRY_POINTS = {"sdd": sdd, "dsd": dsd, "dds": dds, "row_indices": row_indices}
STK_OPS = {"sdd": stk_sdd, "dsd": stk_dsd, "dds": stk_dds, "row_indices": stk_row_indices}
for _entry in STK_ENTRY_POINTS.values():
    _entry.__megablocks_ascend__ = True
    _entry.__doc__ = (f"stk.backend.triton_kernels.{_entry.__name__}, served by the backend MEGABLOCKS_BACKEND "
                      "selects (a torch.library custom op while torch.compile traces).")
