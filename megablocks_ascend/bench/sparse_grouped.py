"""The sparse dMoE's block-sparse products as grouped GEMMs plus a layout copy: the form ``bench``
times beside our block-sparse kernels.

On an NPU the expert MLP's products could run as ``npu_grouped_matmul`` over the padded groups,
with the activations copied between stk's ``[blocks, B, B]`` data and the dense ``[rows, ffn]``
layout a grouped GEMM reads and writes; whether that beats our Triton cube kernels only an NPU can
say. This module is that form, through the ``grouped_gemm`` stand-in
(:func:`megablocks_ascend.native.grouped_gemm.gmm`: ``npu_grouped_matmul`` on an NPU,
``torch._grouped_mm`` on CUDA and on the CPU, a loop elsewhere), with stk's signatures:

``sdd``            ``gmm(lhs, w[e].T)`` over the experts' rows, then the ``[rows, ffn]`` result
                   copied into the blocks;
``dsd``            the blocks copied into ``[rows, ffn]``, then ``gmm`` with ``w[e]`` (or, for the
                   transposed operand, the K-grouped ``gmm`` giving ``[experts, ffn, N]``).

It serves MegaBlocks' topology only (``kernels/topology.py``: every block row holds its expert's
``blocks_per_row`` consecutive columns, rows in expert order), the one the sparse dMoE builds; its
group sizes come from that topology on the device (no host read). The spare block rows of a
static-size topology join the last expert's group, where their zero rows add zeros (computed, not
skipped: this form does up to ``experts x (block - 1)`` rows more work than ours).

:func:`products` swaps stk's ``sdd`` and ``dsd`` for these for the duration of a block (a
whole sparse dMoE step then runs on them); ``bench``'s ``sparse`` section times both forms. Ours
stays the default until an NPU says otherwise. ``tests/test_sparse_grouped.py`` holds this form
to our kernels.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megablocks_ascend import backends, validation
from megablocks_ascend.native import grouped_gemm


def group_rows(offsets: torch.Tensor, column_indices: torch.Tensor, block: int, blocks_per_row: int,
               experts: int) -> torch.Tensor:
    """Rows of each expert's group (int64, on the device): its block rows (the expert of a row is
    its first block's column // ``blocks_per_row``) times ``block``; the spare rows past
    ``offsets[-1]`` join the last group, so the groups cover every row."""
    rows = offsets.numel() - 1
    first = column_indices.view(rows, blocks_per_row)[:, 0].long() // blocks_per_row
    live_rows = offsets[-1].long() // blocks_per_row
    r = torch.arange(rows, device=offsets.device)
    expert = torch.where(r < live_rows, first.clamp(0, experts - 1), experts - 1)
    counts = torch.zeros(experts, dtype=torch.long, device=offsets.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    return counts * block


def dense_from_blocks(data: torch.Tensor, blocks_per_row: int) -> torch.Tensor:
    """stk's ``[rows / B * blocks_per_row, B, B]`` blocks as the dense ``[rows, blocks_per_row * B]``."""
    b = data.shape[1]
    rows = data.shape[0] // blocks_per_row
    return data.view(rows, blocks_per_row, b, b).permute(0, 2, 1, 3).reshape(rows * b, blocks_per_row * b)


def blocks_from_dense(dense: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The dense ``[rows, blocks_per_row * B]`` written into stk's blocks ``out`` (``[n, B, B]``)."""
    b = out.shape[1]
    rows, width = dense.shape
    out.view(rows // b, width // b, b, b).copy_(dense.view(rows // b, b, width // b, b).permute(0, 2, 1, 3))
    return out


def _shape(out_or_data, offsets, columns):
    b = out_or_data.shape[1]
    block_rows = offsets.numel() - 1
    blocks_per_row = out_or_data.shape[0] // max(block_rows, 1)
    experts = columns // (blocks_per_row * b)
    if block_rows * blocks_per_row != out_or_data.shape[0] or experts * blocks_per_row * b != columns:
        raise ValueError("sparse_grouped: the topology is not MegaBlocks' (every block row with the same "
                         f"blocks per row, {columns} columns a whole number of experts' ffn)")
    return b, blocks_per_row, experts


def sdd(lhs, rhs, shape, out, offsets, row_indices, column_indices):
    """stk's ``sdd`` for MegaBlocks' topology: ``gmm(lhs, w[e].T)`` (``rhs`` is ``w.t()``), copied into the blocks."""
    b, bpr, experts = _shape(out, offsets, shape[1])
    w = rhs.t()  # [experts * ffn, K]: MegaBlocks passes w1.t() / w2.t()
    sizes = group_rows(offsets, column_indices, b, bpr, experts)
    dense = grouped_gemm.gmm(lhs, w.reshape(experts, bpr * b, w.shape[1]), sizes, trans_b=True)
    return blocks_from_dense(dense, out)


def dsd(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_a, rhs, out):
    """stk's ``dsd`` for MegaBlocks' topology: the blocks made dense, then ``gmm`` with ``rhs``'s
    experts (``op(S) @ rhs``) or, transposed, the K-grouped ``gmm`` (``S.T @ rhs``)."""
    columns = shape[0] if transpose_a else shape[1]
    b, bpr, experts = _shape(data, offsets, columns)
    sizes = group_rows(offsets, column_indices, b, bpr, experts)
    dense = dense_from_blocks(data, bpr)
    if transpose_a:
        result = grouped_gemm.gmm(dense, rhs, sizes, trans_a=True).view(experts * bpr * b, rhs.shape[1])
    else:
        result = grouped_gemm.gmm(dense, rhs.reshape(experts, bpr * b, rhs.shape[1]), sizes)
    out.copy_(result)
    return out


FORMS = {"sdd": sdd, "dsd": dsd}


@contextlib.contextmanager
def products() -> Iterator[None]:
    """Within this block stk's ``sdd`` and ``dsd`` (``stk.backend.triton_kernels``) run as grouped
    GEMMs plus the layout copy (validated as ours are); restored on exit."""
    saved = {name: backends.STK_KERNELS[name] for name in FORMS}

    def dispatcher(name):
        params = backends.STK_SPECS[name][0]

        def call(*args, **kwargs):
            a = dict(zip(params, args), **kwargs)
            validation.check_blocksparse(name, a)
            FORMS[name](**a)
        return call

    try:
        for name in FORMS:
            backends.STK_KERNELS[name] = dispatcher(name)
        yield
    finally:
        backends.STK_KERNELS.update(saved)
