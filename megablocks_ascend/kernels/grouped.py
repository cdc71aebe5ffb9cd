"""Kernels around the grouped GEMM (the ``grouped_gemm`` stand-in, :mod:`megablocks_ascend.native.grouped_gemm`).

``_zero_empty_groups``
    Zeroes the blocks of a K-grouped GEMM's result whose group has no rows, and touches nothing
    else. The K-grouped form (``gmm(a, b, batch_sizes, trans_a=True)``: ``out[g] = a_g.T @ b_g``,
    ``[E, M, N]``) is how MegaBlocks computes its expert weight gradients; an expert that received
    no tokens has an empty sum, i.e. a zero block, which not every device kernel writes (see
    ``docs/notes/grouped-gemm.md``). The group sizes stay on the device: the kernel reads the
    group ends ``ends[g]`` (cumulative, non-decreasing; int32 or int64) and a group is empty when
    ``ends[g] == ends[g - 1]`` (``ends[-1]`` taken as 0). No host read, a fixed grid, so it can be
    captured in a CUDA/NPU graph; its cost is one scalar pair per work item plus the zero stores
    of the empty groups only, where a mask over the whole ``[E, M, N]`` tensor read and wrote
    every element of every weight gradient.

How it is shaped
----------------
A 1-D grid of ``devices.num_programs`` programs (vector cores on an NPU) loops over work items:
item ``i`` is chunk ``i % chunks`` of group ``i // chunks``, ``chunk`` elements of the group's
contiguous ``M * N`` block, so that the zeros of one empty group are spread over many programs.
A program loads the two group ends of its item and, only when the group is empty, stores zero
tiles of ``BLOCK`` elements over its chunk (one contiguous DMA per tile on Ascend). The tile mask
depends on the chunk's position only, never on loaded data (a mask computed from loaded data makes
triton-ascend store element by element), and folds away when ``BLOCK`` divides the block
(``EVEN``). Offsets are int32 unless a value the kernel forms passes ``launch.INT32_MAX`` (``INT64``).
"""

from __future__ import annotations

import torch
import triton.language as tl

from megablocks_ascend import devices
from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels import launch

# launch.py's int32 convention: the largest value the kernel forms must be <= this (lowered in tests).
_INT32_LIMIT = launch.INT32_MAX


@kernel
def _zero_empty_groups(
    out, ends,
    group_numel, group_stride, chunk, num_items,
    INT64: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    chunks = tl.cdiv(group_numel, chunk)
    cols = tl.arange(0, BLOCK)
    zeros = tl.zeros((BLOCK,), out.dtype.element_ty)
    for item in range(pid, num_items, npg):
        g = item // chunks
        end = tl.load(ends + g)
        start = tl.load(ends + tl.maximum(g - 1, 0))  # group 0 starts at 0 (below), not at ends[0]
        start = tl.where(g > 0, start, 0)
        if end == start:
            lo = item - g * chunks
            if INT64:
                base = g.to(tl.int64) * group_stride
                lo = lo.to(tl.int64)
            else:
                base = g * group_stride
            lo = lo * chunk
            hi = tl.minimum(lo + chunk, group_numel)
            for x0 in range(lo, hi, BLOCK):
                c = x0 + cols
                if EVEN:
                    tl.store(out + base + c, zeros)
                else:
                    tl.store(out + base + c, zeros, mask=c < hi)


def zero_empty_groups(out: torch.Tensor, ends: torch.Tensor, *, block: int | None = None,
                      num_programs: int | None = None) -> torch.Tensor:
    """Set ``out[g]`` to zero for every group ``g`` whose rows ``[ends[g-1], ends[g])`` are empty, on
    the device, without reading ``ends`` on the host; the other groups are neither read nor written.

    ``out``: ``[E, M, N]`` with each ``out[g]`` one contiguous block (``out.stride(2) == 1`` and
    ``out.stride(1) == N``; the groups may lie further apart than ``M * N``); ``ends``: 1-D int32 or
    int64 of ``E`` cumulative group ends, on ``out``'s device. Returns ``out``.
    """
    if out.ndim != 3 or ends.ndim != 1 or ends.shape[0] != out.shape[0]:
        raise ValueError(f"zero_empty_groups: 'out' must be [E, M, N] and 'ends' [E]; got {tuple(out.shape)} "
                         f"and {tuple(ends.shape)}")
    if ends.dtype not in (torch.int32, torch.int64) or ends.device != out.device:
        raise ValueError(f"zero_empty_groups: 'ends' must be int32 or int64 on {out.device}; got {ends.dtype} "
                         f"on {ends.device}")
    groups, m, n = out.shape
    group_numel = m * n
    if groups == 0 or group_numel == 0:
        return out
    if not (out.stride(2) == 1 or n == 1) or not (out.stride(1) == n or m == 1) \
            or (groups > 1 and out.stride(0) < group_numel):
        raise ValueError(f"zero_empty_groups: every out[g] must be one contiguous block; 'out' has strides "
                         f"{out.stride()} for shape {tuple(out.shape)}")
    ends = ends.contiguous()
    block = block if block is not None else devices.fill_block(out.dtype, devices.target(out.device))
    chunk = block * devices.FILL_CHUNK_BLOCKS
    items = groups * launch.cdiv(group_numel, chunk)
    group_stride = out.stride(0) if groups > 1 else group_numel
    # One past the largest offset stored, and no less than any value the kernel forms (``lo + chunk``).
    span = (groups - 1) * group_stride + launch.cdiv(group_numel, chunk) * chunk
    n_prog = num_programs if num_programs is not None else devices.num_programs(out.device, items)
    _zero_empty_groups[(max(1, min(n_prog, items)),)](
        out, ends, group_numel, group_stride, chunk, items,
        INT64=launch.needs_int64(span, limit=_INT32_LIMIT), EVEN=group_numel % block == 0, BLOCK=block,
    )
    return out
