"""The sparse dMoE's block-sparse topology in one launch, at a size the host knows.

MegaBlocks' sparse dMoE (``ParallelDroplessMLP.topology`` and ``sparse_transpose``) describes the
expert MLP's intermediate activation, ``[padded rows, experts * ffn]``, as an stk BCSR matrix in
blocks of ``B x B``: block row ``r`` of expert ``e`` holds the ``BPR = ffn / B`` blocks of
columns ``e * BPR .. e * BPR + BPR - 1``. Upstream builds it from ``padded_bins`` in about a
dozen launches (the column indices, ``stk.ops.row_indices``, a radix sort of the column
indices for the transpose, a gather, a histogram, a cumsum, a concatenation, an arange), and
its size is the padded row count, ``padded_bins[-1]``, read on the host.

:func:`topology` writes all six index tensors of ``stk.Matrix`` in one launch, for a matrix of
``block_rows`` block rows chosen by the caller (the sparse dMoE passes a bound that holds for any
routing: :func:`megablocks_ascend.ops.padded_rows`). The matrix's own block rows are the
first ``R = padded_bins[-1] / B``; the rest are spare capacity, with no blocks:

* ``offsets[r] = min(r, R) * BPR`` (``r`` in ``[0, block_rows]``): a spare block row is empty,
  and ``offsets[-1] = R * BPR`` is the number of live blocks;
* block ``b < R * BPR`` (row ``r = b // BPR``, ``k = b % BPR``): ``row_indices[b] = r``,
  ``column_indices[b] = e(r) * BPR + k``;
* the transpose lists the live blocks column by column, in block order within a column (what
  upstream's stable sort gives): column ``c = e * BPR + k`` of an expert with block rows
  ``[rs, rs + n)`` starts at ``offsets_t[c] = rs * BPR + k * n``, and its ``i``-th entry is block
  row ``column_indices_t = rs + i``, block ``block_offsets_t = (rs + i) * BPR + k``;
  ``offsets_t[-1] = R * BPR``;
* a spare block ``b >= R * BPR`` belongs to no row: ``row_indices[b] = column_indices_t[b] =
  b // BPR``, ``column_indices[b] = b % BPR``, ``block_offsets_t[b] = b`` (in range, never read
  as part of the matrix: the block-sparse kernels take the live blocks from ``offsets``).

With ``block_rows == R`` this is upstream's topology exactly (``tests/test_topology.py``).

How it is shaped
----------------
A 1-D grid of ``devices.num_programs`` programs. Program ``p`` builds experts ``p, p + P, ...``:
per expert one store of its ``BPR`` transpose offsets, then tiles of ``[BLOCK_I, BLOCK_K]`` (block
rows by their blocks) stored twice, row-major into the block order and column-major into the
transpose order; then every program takes chunks of ``offsets`` and of the spare blocks. No
division by a value loaded from memory (``BPR`` is a constant of the kernel), no search over the
experts, no atomics. Offsets are int32 (the launcher refuses sizes past int16 block indices,
stk.Matrix's own limit, so every offset is far inside int32).
"""

from __future__ import annotations

import torch
import triton.language as tl

from megablocks_ascend import devices
from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels import launch

TILE = 512  # index entries per tile of the per-expert loop ([BLOCK_I, BLOCK_K])
CHUNK = 256  # entries per store of the offsets and spare-block loops


@kernel
def _topology(
    padded_bins, row_indices, column_indices, offsets, column_indices_t, offsets_t, block_offsets_t,
    num_experts, block_rows,
    BLOCK_SIZE: tl.constexpr, BPR: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    total = block_rows * BPR
    # The live block rows: padded_bins[-1] / B, clamped into the matrix whatever padded_bins holds.
    last = tl.load(padded_bins + num_experts - 1).to(tl.int32)
    live_rows = tl.minimum(tl.maximum(last // BLOCK_SIZE, 0), block_rows)
    live = live_rows * BPR
    i = tl.arange(0, BLOCK_I)
    k = tl.arange(0, BLOCK_K)
    k_in = k < BPR
    for e in range(pid, num_experts, npg):
        end = tl.load(padded_bins + e).to(tl.int32)
        start = tl.load(padded_bins + tl.maximum(e - 1, 0)).to(tl.int32)
        start = tl.where(e > 0, start, 0)
        rs = tl.minimum(tl.maximum(start // BLOCK_SIZE, 0), live_rows)
        n = tl.minimum(tl.maximum(end // BLOCK_SIZE, rs), live_rows) - rs
        tl.store(offsets_t + e * BPR + k, rs * BPR + k * n, mask=k_in)
        columns = e * BPR + k
        for i0 in range(0, n, BLOCK_I):
            rows = rs + i0 + i
            mask = ((i0 + i) < n)[:, None] & k_in[None, :]
            blocks = rows[:, None] * BPR + k[None, :]
            rows_2d = rows[:, None] + tl.zeros((BLOCK_I, BLOCK_K), tl.int32)
            tl.store(row_indices + blocks, rows_2d.to(row_indices.dtype.element_ty), mask=mask)
            tl.store(column_indices + blocks,
                     (columns[None, :] + tl.zeros((BLOCK_I, BLOCK_K), tl.int32)).to(column_indices.dtype.element_ty),
                     mask=mask)
            entries = rs * BPR + k[None, :] * n + (i0 + i)[:, None]
            tl.store(column_indices_t + entries, rows_2d.to(column_indices_t.dtype.element_ty), mask=mask)
            tl.store(block_offsets_t + entries, blocks, mask=mask)
    lane = tl.arange(0, CHUNK)
    for c in range(pid, tl.cdiv(block_rows + 1, CHUNK), npg):
        r = c * CHUNK + lane
        tl.store(offsets + r, tl.minimum(r, live_rows) * BPR, mask=r <= block_rows)
    tl.store(offsets_t + num_experts * BPR, live, mask=pid == 0)
    for c in range(pid, tl.cdiv(total - live, CHUNK), npg):
        b = live + c * CHUNK + lane
        spare = b < total
        row = b // BPR
        tl.store(row_indices + b, row.to(row_indices.dtype.element_ty), mask=spare)
        tl.store(column_indices + b, (b - row * BPR).to(column_indices.dtype.element_ty), mask=spare)
        tl.store(column_indices_t + b, row.to(column_indices_t.dtype.element_ty), mask=spare)
        tl.store(block_offsets_t + b, b, mask=spare)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile(blocks_per_row: int) -> tuple[int, int]:
    """``(BLOCK_I, BLOCK_K)``: the per-expert tile, block rows by their ``blocks_per_row`` blocks."""
    block_k = _next_pow2(blocks_per_row)
    return max(1, TILE // block_k), block_k


def topology(padded_bins: torch.Tensor, block_size: int, block_rows: int, blocks_per_row: int, *,
             num_programs: int | None = None):
    """``(row_indices, column_indices, offsets, column_indices_t, offsets_t, block_offsets_t)`` of
    the sparse dMoE's topology with ``block_rows`` block rows (see the module docstring), in one
    launch. ``padded_bins``: the experts' padded segment ends (int32 or int64, multiples of
    ``block_size``), on the device the results go to. The caller checked the arguments
    (``validation.check_topology``)."""
    device = padded_bins.device
    experts = padded_bins.shape[0]
    nnz = block_rows * blocks_per_row
    row_indices = torch.empty(nnz, dtype=torch.int16, device=device)  # stk.Matrix's index dtype
    column_indices = torch.empty(nnz, dtype=torch.int16, device=device)
    offsets = torch.empty(block_rows + 1, dtype=torch.int32, device=device)
    column_indices_t = torch.empty(nnz, dtype=torch.int16, device=device)
    offsets_t = torch.empty(experts * blocks_per_row + 1, dtype=torch.int32, device=device)
    block_offsets_t = torch.empty(nnz, dtype=torch.int32, device=device)
    block_i, block_k = tile(blocks_per_row)
    work = max(experts, launch.cdiv(block_rows + 1, CHUNK), launch.cdiv(nnz, CHUNK))
    n = num_programs if num_programs is not None else devices.num_programs(device, work)
    _topology.launch((max(1, min(n, work)),), padded_bins, row_indices, column_indices, offsets, column_indices_t,
                     offsets_t, block_offsets_t, experts, block_rows,
                     BLOCK_SIZE=block_size, BPR=blocks_per_row, BLOCK_I=block_i, BLOCK_K=block_k, CHUNK=CHUNK)
    return row_indices, column_indices, offsets, column_indices_t, offsets_t, block_offsets_t
