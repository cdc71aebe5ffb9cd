"""The ``torch`` backend for stk's block-sparse matmuls (``stk.backend.triton_kernels``).

Same signatures and results as stk 0.7.1's ``sdd``, ``dsd``, ``dds`` and ``row_indices``: each
writes its result into ``out`` and returns ``None``. Written independently of the Triton kernels
(whole-block batched matmuls instead of tiles), so each checks the other.

A sparse matrix is stk's BCSR: ``shape`` ``(M, N)`` in square blocks of ``B = data.shape[1]``;
block ``i`` holds ``data[i]`` at block row ``row_indices[i]`` and block column
``column_indices[i]``, and block row ``r`` owns blocks ``offsets[r] .. offsets[r + 1]``. The
transposed metadata (``offsets_t``, ``column_indices_t``, ``block_offsets_t``) lists the same
blocks in column order; this module does not read it: the blocks' coordinates come from
``row_indices`` and ``column_indices`` alone (swapped, with each block transposed, for a
transposed operand), so a kernel that misreads the transposed metadata disagrees with it. Of
``offsets`` it reads only the last entry: the number of blocks that belong to the matrix. A
topology built at a size the host knows (the sparse dMoE's, ``kernels/topology.py``) has spare
blocks past ``offsets[-1]``: ``sdd`` writes them as zeros and the products leave them out.

Autocast: the products are float32 whatever autocast says (``torch.bmm`` would otherwise run in
the autocast dtype; MegaBlocks' memory-optimized backward calls ``dsd`` with autocast on).

Memory: no sparse operand is made dense. The products are batched matmuls over chunks of
blocks, in float32, with at most :data:`CHUNK_ELEMENTS` float32 elements of temporaries per
chunk; the dense outputs of ``dsd``/``dds`` are accumulated in float32 and cast once. Rows of
a dense output that no block reaches are zero, as in stk.
"""

from __future__ import annotations

import functools

import torch

CHUNK_ELEMENTS = 1 << 26  # float32 elements of temporaries per chunk of blocks (256 MiB)


def _float32(fn):
    """Run ``fn`` with autocast off on its tensors' device, so its float32 products stay float32."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next(a.device for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor) and a.device.type != "meta")
        with torch.autocast(device.type, enabled=False):
            return fn(*args, **kwargs)
    return run


def _chunks(n: int, elements_per_block: int):
    step = max(1, CHUNK_ELEMENTS // max(1, elements_per_block))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _live(offsets, nnz):
    """Which of the ``nnz`` blocks belong to the matrix: the first ``offsets[-1]`` (a static-size
    topology's spare blocks past it are no part of it; stk's own matrices have none)."""
    return torch.arange(nnz, device=offsets.device) < offsets[-1].clamp(0, nnz)


def _blocks(data, offsets, row_indices, column_indices, transpose):
    """The blocks of the matrix as seen (transposed or not): (block rows, block columns, a
    function giving the float32 blocks of a chunk, the spare blocks as zeros)."""
    rows, cols = row_indices.long(), column_indices.long()
    live = _live(offsets, data.shape[0])[:, None, None]
    if transpose:
        return cols, rows, lambda s: torch.where(live[s], data[s].transpose(1, 2).float(), 0.0)
    return rows, cols, lambda s: torch.where(live[s], data[s].float(), 0.0)


@_float32
def sdd(lhs, rhs, shape, out, offsets, row_indices, column_indices):
    """``out[i] = (lhs @ rhs)`` restricted to block ``i``: the blocks of a dense product that the
    topology keeps; zeros for the spare blocks past ``offsets[-1]``."""
    block = out.shape[1]
    k = lhs.shape[1]
    a = lhs.unflatten(0, (lhs.shape[0] // block, block))  # [M/B, B, K]
    b = rhs.unflatten(1, (rhs.shape[1] // block, block)).permute(1, 0, 2)  # [N/B, K, B]
    rows, cols = row_indices.long(), column_indices.long()
    live = _live(offsets, out.shape[0])[:, None, None]
    for s in _chunks(out.shape[0], block * (2 * k + block)):
        out[s] = torch.where(live[s], torch.bmm(a[rows[s]].float(), b[cols[s]].float()), 0.0).to(out.dtype)


@_float32
def dsd(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_a, rhs, out):
    """``out = A @ rhs``, ``A`` the sparse matrix (its transpose when ``transpose_a``; ``shape`` is
    ``A``'s shape as seen)."""
    m, k = shape
    block = data.shape[1]
    n = rhs.shape[1]
    a_rows, a_cols, blocks = _blocks(data, offsets, row_indices, column_indices, transpose_a)
    r = rhs.unflatten(0, (k // block, block))  # [K/B, B, N]
    acc = torch.zeros((m // block, block, n), dtype=torch.float32, device=out.device)
    for s in _chunks(data.shape[0], block * (block + 2 * n)):
        acc.index_add_(0, a_rows[s], torch.bmm(blocks(s), r[a_cols[s]].float()))
    out.copy_(acc.view(m, n))


@_float32
def dds(lhs, shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_b, out):
    """``out = lhs @ B``, ``B`` the sparse matrix (its transpose when ``transpose_b``; ``shape`` is
    ``B``'s shape as seen)."""
    m = lhs.shape[0]
    n = shape[1]
    block = data.shape[1]
    b_rows, b_cols, blocks = _blocks(data, offsets, row_indices, column_indices, transpose_b)
    a = lhs.unflatten(1, (lhs.shape[1] // block, block)).permute(1, 0, 2)  # [K/B, M, B]
    acc = torch.zeros((n // block, m, block), dtype=torch.float32, device=out.device)
    for s in _chunks(data.shape[0], block * (2 * m + block)):
        acc.index_add_(0, b_cols[s], torch.bmm(a[b_rows[s]].float(), blocks(s)))
    out.copy_(acc.permute(1, 0, 2).reshape(m, n))


def row_indices(shape, data, offsets, column_indices, out):
    """``out[j]`` = the block row of block ``j``: the ``r`` with ``offsets[r] <= j < offsets[r + 1]``.
    Entries at or past ``offsets[-1]`` are left as they are (stk does not write them either).
    ``data`` is not read (MegaBlocks passes a tensor on the meta device)."""
    j = torch.arange(out.shape[0], device=out.device)
    bounds = offsets.long()
    rows = torch.searchsorted(bounds, j, right=True) - 1
    out.copy_(torch.where(j < bounds[-1], rows, out.long()).to(out.dtype))


def topology(padded_bins, block_size, block_rows, blocks_per_row):
    """The sparse dMoE's topology with ``block_rows`` block rows (``kernels/topology.py`` says what
    each tensor holds): the live blocks from a search of each block row's expert, the transpose from
    a stable sort of the live blocks by column and a count of each column's blocks, as upstream's
    ``ParallelDroplessMLP.topology`` / ``sparse_transpose`` build it."""
    device = padded_bins.device
    bpr = blocks_per_row
    ends = (padded_bins.long() // block_size).clamp(0, block_rows)  # each expert's block-row end
    live_rows = ends[-1]
    b = torch.arange(block_rows * bpr, device=device)
    r, k = b // bpr, b % bpr
    live = r < live_rows
    expert = torch.searchsorted(ends, r, right=True)
    column_indices = torch.where(live, expert * bpr + k, k)
    offsets = torch.arange(block_rows + 1, device=device).clamp(max=live_rows) * bpr
    columns = ends.shape[0] * bpr
    order = torch.sort(torch.where(live, column_indices, columns), stable=True).indices  # spare blocks last
    counts = torch.zeros(columns + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, torch.where(live, column_indices, columns), torch.ones_like(b))
    offsets_t = torch.cat([counts.new_zeros(1), counts[:columns].cumsum(0)])
    return (r.to(torch.int16), column_indices.to(torch.int16), offsets.int(), r[order].to(torch.int16),
            offsets_t.int(), order.int())
