"""Block-sparse (BCSR) topologies and a float64 dense reference for stk's four kernel functions.

Not a test module: tests import it. Written from stk 0.7.1's definitions with plain Python
loops and without ``megablocks_ascend`` or stk (both of which are tested against it):

* a sparse matrix of ``shape`` ``(M, N)`` in ``B x B`` blocks; block ``i`` holds ``data[i]`` at
  block row ``row_indices[i]``, block column ``column_indices[i]``, blocks sorted by row, and
  ``offsets[r] .. offsets[r + 1]`` the blocks of block row ``r``;
* the transposed metadata lists the same blocks column by column (rows ascending within a
  column, the order a stable sort by column gives): ``block_offsets_t[j]`` is the block at
  position ``j``, ``column_indices_t[j]`` its block row, ``offsets_t`` the per-column ranges;
* ``sdd(lhs, rhs)`` keeps the blocks of ``lhs @ rhs`` the topology names; ``dsd`` is
  ``A @ rhs`` and ``dds`` ``lhs @ A``, with ``A`` the sparse matrix or its transpose.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Topology:
    shape: tuple[int, int]  # the stored (untransposed) matrix
    block: int
    row_indices: torch.Tensor
    column_indices: torch.Tensor
    offsets: torch.Tensor
    column_indices_t: torch.Tensor
    offsets_t: torch.Tensor
    block_offsets_t: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.row_indices.numel())

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return list(zip(self.row_indices.tolist(), self.column_indices.tolist()))

    def to(self, device) -> "Topology":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def metadata(self) -> dict:
        """The metadata arguments, by stk's parameter names."""
        return dict(offsets=self.offsets, row_indices=self.row_indices, column_indices=self.column_indices,
                    offsets_t=self.offsets_t, column_indices_t=self.column_indices_t,
                    block_offsets_t=self.block_offsets_t)


def topology(shape, block, blocks, index_dtype=torch.int16) -> Topology:
    """The BCSR metadata of a ``shape`` matrix whose nonzero blocks are ``blocks`` ((row, col) pairs)."""
    block_rows, block_cols = shape[0] // block, shape[1] // block
    blocks = sorted(set(blocks))
    for r, c in blocks:
        assert 0 <= r < block_rows and 0 <= c < block_cols, (r, c)
    offsets, i = [0], 0
    for r in range(block_rows):
        while i < len(blocks) and blocks[i][0] == r:
            i += 1
        offsets.append(i)
    by_column = sorted(range(len(blocks)), key=lambda j: (blocks[j][1], blocks[j][0]))
    offsets_t, j = [0], 0
    for c in range(block_cols):
        while j < len(by_column) and blocks[by_column[j]][1] == c:
            j += 1
        offsets_t.append(j)
    return Topology(
        shape=(shape[0], shape[1]), block=block,
        row_indices=torch.tensor([r for r, _ in blocks], dtype=index_dtype),
        column_indices=torch.tensor([c for _, c in blocks], dtype=index_dtype),
        offsets=torch.tensor(offsets, dtype=torch.int32),
        column_indices_t=torch.tensor([blocks[j][0] for j in by_column], dtype=index_dtype),
        offsets_t=torch.tensor(offsets_t, dtype=torch.int32),
        block_offsets_t=torch.tensor(by_column, dtype=torch.int32),
    )


def random_topology(block_rows, block_cols, block, density, generator, *, empty_rows=(), empty_cols=(),
                    index_dtype=torch.int16) -> Topology:
    blocks = [(r, c) for r in range(block_rows) for c in range(block_cols)
              if r not in empty_rows and c not in empty_cols
              and float(torch.rand((), generator=generator)) < density]
    return topology((block_rows * block, block_cols * block), block, blocks, index_dtype)


def dense(top: Topology, data: torch.Tensor) -> torch.Tensor:
    """The stored matrix in float64, block by block."""
    out = torch.zeros(top.shape, dtype=torch.float64)
    b = top.block
    for i, (r, c) in enumerate(top.blocks):
        out[r * b:(r + 1) * b, c * b:(c + 1) * b] = data[i].detach().to(torch.float64).cpu()
    return out


def blocks_of(top: Topology, matrix: torch.Tensor) -> torch.Tensor:
    """The topology's blocks of a dense ``matrix`` (float64): ``[nnz, B, B]``."""
    b = top.block
    out = torch.zeros((top.nnz, b, b), dtype=torch.float64)
    for i, (r, c) in enumerate(top.blocks):
        out[i] = matrix[r * b:(r + 1) * b, c * b:(c + 1) * b]
    return out


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64).cpu()
