"""Block-sparse matrix products on stk's BCSR matrices: ``sdd``, ``dsd``, ``dds`` and ``row_indices``.

The four entry points have the signatures and results of ``stk.backend.triton_kernels`` (stanford-stk
0.7.1), which MegaBlocks' sparse dMoE calls through ``stk.ops`` and, in its memory-optimized MLP,
directly; each writes its result into ``out``. They take the arguments that
:func:`megablocks_ascend.validation.check_blocksparse` accepted, with a block size of :data:`BLOCK_SIZES`
(the ``ascend`` backend's record refuses others): the dispatcher (``backends.STK_KERNELS``) checks
every argument once, before any launch, and the launchers check only what depends on their own
choices (a ``tile`` they are given, and int32 indexing at their tile).

One idea: stk's block-sparse products. The three products share the sparse operand's layout, the
offset rules, the tile and the launch helpers below, and stk computes each one's gradients with
the other two, so they are one file, as stk's ``triton_kernels`` is.

The sparse operand
------------------
A sparse matrix of ``shape`` ``(R, C)`` is stored in blocks of ``B x B`` (``B`` in :data:`BLOCK_SIZES`):
``data[nnz, B, B]`` holds the non-zero blocks in row-major block order; block ``b`` sits at block row
``row_indices[b]`` and block column ``column_indices[b]``; block row ``r`` owns blocks
``offsets[r] .. offsets[r + 1]``. The transpose metadata walks the same blocks column by column:
column ``c`` owns entries ``offsets_t[c] .. offsets_t[c + 1]``, entry ``j`` is the block
``block_offsets_t[j]`` of ``data``, which sits at block row ``column_indices_t[j]``.
(``row_indices``/``column_indices``/``column_indices_t``: int16 as stk stores them, or int32;
``offsets``, ``offsets_t``, ``block_offsets_t``: int32.)

What each product computes (``op(S)`` is ``S`` or its transpose; the ``shape`` argument of ``dsd``
and ``dds`` is the shape of ``op(S)``, as stk passes it)::

    sdd(lhs, rhs, shape, out, ...)       out[b] = (lhs @ rhs)[rows of block b, columns of block b]
    dsd(shape, data, ..., transpose_a, rhs, out)   out = op(S) @ rhs        (op = transpose if transpose_a)
    dds(lhs, shape, data, ..., transpose_b, out)   out = lhs @ op(S)        (op = transpose if transpose_b)
    row_indices(shape, data, offsets, column_indices, out)   out[b] = the block row of block b

Dense operands are read through their actual strides: a transposed view (``x.t()`` of a contiguous
tensor, stride ``(1, n)``) is read as what it is; a constexpr per operand picks which way a tile is
loaded so that the contiguous dimension comes last (on Ascend that keeps every tile load one
DMA with a contiguous inner dimension; the tile is transposed on chip). stk decides the same from
strides; where it swaps the strides of an operand whose two strides are both above 1 (a view stk's
callers never make), these kernels read that operand as it is.

How the kernels are shaped
--------------------------
Every kernel has a 1-D persistent grid (``devices.num_programs(..., unit="cube")``: one program
per AI core on an NPU, ``programs_per_sm`` per SM on CUDA, a few in the interpreter); program ``p``
computes output tiles ``p, p + P, p + 2P, ...``, each a ``BLOCK_M x BLOCK_N`` float32 accumulator
(``tl.dot``) over K-steps of ``BLOCK_K``, cast to ``out``'s dtype once and stored once. Tile sizes
come from ``devices.cube_tile`` (the A2 cube budget on an NPU, a table on CUDA that the H200
sweep of ``benchmarks/bench_blocksparse.py`` sets).

``_sdd``  one tile is a ``BLOCK_M x BLOCK_N`` piece of one non-zero block; the K loop runs over the
          dense inner dimension (masked at its end). Blocks are visited in groups of ``GROUP`` block
          rows, column by column within a group, so that tiles in flight at the same time share
          their ``lhs`` rows and ``rhs`` columns (with MegaBlocks' topology, where every block row
          has the same blocks per row and consecutive rows belong to the same expert, the rows of a
          group share their columns).
``_dsd``  one tile is ``BLOCK_M`` rows of one block row of ``op(S)`` by ``BLOCK_N`` dense columns;
          the K loop walks the row's blocks (``offsets``/``column_indices``, or for a transposed
          ``S`` its columns through ``offsets_t``/``column_indices_t``/``block_offsets_t``), ``B /
          BLOCK_K`` steps per block, one flat loop so that CUDA's software pipeline runs across
          blocks. An empty block row gives zeros: every element of ``out`` is written.
``_dds``  the mirror image: ``BLOCK_M`` dense rows by ``BLOCK_N`` columns of one block column of
          ``op(S)``.
``_row_indices``  one block row per step: writes its index into its blocks' entries.

Offsets
-------
Block indices are loaded (int16 or int32), widened to int32 and clamped into range before any
arithmetic, so no arithmetic is ever done in int16 (stk's bug on Triton >= 3.2, where int16 block
index times a constexpr stays int16 and wraps past 32767 elements: MegaBlocks PR #168, stk PR #17)
and garbage metadata can give wrong values but never an access out of bounds. Element offsets are
int32 when every offset the kernel can form (tiles padded to whole tiles included) is below 2**31,
which the launcher checks from shapes and strides; otherwise the kernel is specialised with
``INT64=True``, which widens every block index and index vector to int64 before it multiplies a
stride. Indices within one dimension and tile counts are int32 either way (the launchers refuse
a dimension or a tile count past 2**31 - 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megablocks_ascend import compat, devices
from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels import launch

BLOCK_SIZES = (16, 32, 64, 128)  # block sides the kernels support
# launch.py's int32 convention (a value formed in int32 must be <= launch.INT32_MAX), with the two
# limits it is applied with here, each lowered by the tests that pretend a tensor is huge:
_OFFSET_LIMIT = launch.INT32_MAX  # largest element offset the int32 kernels form
_EXTENT_LIMIT = launch.INT32_MAX  # largest index within one dimension, and tile count (int32 always)


# --------------------------------------------------------------------------------------------
# Shared pieces of the kernels.


# (Helpers return one variable assigned under a constexpr if/else: triton-ascend 3.2.0's code
# generator checks every return statement of a function against the others, taken or not.)


@triton.jit
def _widen(x, INT64: tl.constexpr):
    if INT64:
        y = x.to(tl.int64)
    else:
        y = x.to(tl.int32)
    return y


@triton.jit
def _index(ptr, i, limit):
    """``ptr[i]`` (an int16 or int32 block index) widened to int32 and clamped into ``[0, limit)``."""
    v = tl.load(ptr + i).to(tl.int32)
    return tl.minimum(tl.maximum(v, 0), limit - 1)


@triton.jit
def _span(offsets, i, nnz):
    """``offsets[i] .. offsets[i + 1]`` clamped into ``[0, nnz]`` (and end >= start)."""
    start = tl.minimum(tl.maximum(tl.load(offsets + i), 0), nnz)
    end = tl.minimum(tl.maximum(tl.load(offsets + i + 1), start), nnz)
    return start, end


@triton.jit
def _grouped(i, n, width, GROUP: tl.constexpr):
    """A permutation of ``[0, n)``: items in lines of ``width``, walked in groups of ``GROUP``
    lines column by column (item ``i`` of the walk is line ``i % GROUP`` of its group, column
    ``i // GROUP``); a last partial group keeps its order."""
    if GROUP == 1:
        j = i
    else:
        size = GROUP * width
        w = i % size
        j = tl.where(i < (n // size) * size, (i // size) * size + (w % GROUP) * width + w // GROUP, i)
    return j


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """``acc + a @ b`` in float32 (``WIDEN``: operands widened to float32 first, see
    ``compat.dot_needs_float32``)."""
    if WIDEN:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tile_mask(rows, cols, r_bound, c_bound, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """The bounds mask of a tile; called only where one of ``MASK_R``, ``MASK_C`` is set."""
    if MASK_R and MASK_C:
        mask = (rows[:, None] < r_bound) & (cols[None, :] < c_bound)
    elif MASK_R:
        mask = rows[:, None] < r_bound
    else:
        mask = cols[None, :] < c_bound
    return mask


@triton.jit
def _load(base, rows, cols, stride_r, stride_c, r_bound, c_bound,
          COLUMN_MAJOR: tl.constexpr, MASK_R: tl.constexpr, MASK_C: tl.constexpr, INT64: tl.constexpr):
    """The ``[len(rows), len(cols)]`` tile ``base[rows * stride_r + cols * stride_c]`` (0 where masked).

    ``rows`` and ``cols`` are int32 indices (inside their dimensions); with ``INT64`` they are
    widened before they multiply the strides. ``COLUMN_MAJOR`` (``stride_r`` is the unit stride)
    loads the tile as ``[cols, rows]``, contiguous dimension last, and transposes it on chip."""
    r64 = _widen(rows, INT64)
    c64 = _widen(cols, INT64)
    if COLUMN_MAJOR:
        ptrs = base + c64[:, None] * stride_c + r64[None, :] * stride_r
        if MASK_R or MASK_C:
            t = tl.load(ptrs, mask=_tile_mask(cols, rows, c_bound, r_bound, MASK_C, MASK_R), other=0.0)
        else:
            t = tl.load(ptrs)
        t = tl.trans(t)
    else:
        ptrs = base + r64[:, None] * stride_r + c64[None, :] * stride_c
        if MASK_R or MASK_C:
            t = tl.load(ptrs, mask=_tile_mask(rows, cols, r_bound, c_bound, MASK_R, MASK_C), other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def _store(base, rows, cols, stride_r, stride_c, value, r_bound, c_bound,
           COLUMN_MAJOR: tl.constexpr, MASK_R: tl.constexpr, MASK_C: tl.constexpr, INT64: tl.constexpr):
    """Stores ``value`` (``[len(rows), len(cols)]``) like :func:`_load` loads."""
    r64 = _widen(rows, INT64)
    c64 = _widen(cols, INT64)
    if COLUMN_MAJOR:
        ptrs = base + c64[:, None] * stride_c + r64[None, :] * stride_r
        value = tl.trans(value)
        if MASK_R or MASK_C:
            tl.store(ptrs, value, mask=_tile_mask(cols, rows, c_bound, r_bound, MASK_C, MASK_R))
        else:
            tl.store(ptrs, value)
    else:
        ptrs = base + r64[:, None] * stride_r + c64[None, :] * stride_c
        if MASK_R or MASK_C:
            tl.store(ptrs, value, mask=_tile_mask(rows, cols, r_bound, c_bound, MASK_R, MASK_C))
        else:
            tl.store(ptrs, value)


# --------------------------------------------------------------------------------------------
# The kernels.


@triton.jit
def _sdd_blocks(lhs, rhs, out, row_indices, column_indices, b, live, m_in, n_in,
                K, block_rows, block_cols, stride_lm, stride_lk, stride_rk, stride_rn, stride_ob, stride_om, stride_on,
                BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                LHS_CM: tl.constexpr, RHS_CM: tl.constexpr, OUT_CM: tl.constexpr, EVEN_K: tl.constexpr,
                INT64: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_N]`` tile ``(m_in, n_in)`` of block ``b``: its products over K, or zeros
    for a spare block (``b >= live``)."""
    rows = _index(row_indices, b, block_rows) * BLOCK_SIZE + m_in
    cols = _index(column_indices, b, block_cols) * BLOCK_SIZE + n_in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(b < live, K, 0)  # a spare block: no products, its tile stored as zeros
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _load(lhs, rows, ks, stride_lm, stride_lk, 0, K, LHS_CM, False, not EVEN_K, INT64)
        w = _load(rhs, ks, cols, stride_rk, stride_rn, K, 0, RHS_CM, not EVEN_K, False, INT64)
        acc = _dot(a, w, acc, PRECISION, WIDEN)
    _store(out + _widen(b, INT64) * stride_ob, m_in, n_in, stride_om, stride_on,
           acc.to(out.dtype.element_ty), 0, 0, OUT_CM, False, False, INT64)


@kernel
def _sdd(lhs, rhs, out, offsets, row_indices, column_indices,
         K, nnz, block_rows, block_cols, row_width,
         stride_lm, stride_lk, stride_rk, stride_rn, stride_ob, stride_om, stride_on,
         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         GROUP: tl.constexpr, LHS_CM: tl.constexpr, RHS_CM: tl.constexpr, OUT_CM: tl.constexpr,
         EVEN_K: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
         PAIRS: tl.constexpr):
    """``out[b] = lhs[rows of b] @ rhs[:, columns of b]`` for every live block ``b`` (tiles of it),
    zeros for the spare blocks past ``offsets[block_rows]``. ``PAIRS``: a tile is ``BLOCK_M`` rows of
    the blocks ``2p`` and ``2p + 1``, one ``[BLOCK_M, 2 * BLOCK_SIZE]`` product when they lie in the same
    block row (each of MegaBlocks' rows is a run of blocks), each block on its own otherwise."""
    TILES_N: tl.constexpr = BLOCK_SIZE // BLOCK_N
    TILES: tl.constexpr = (BLOCK_SIZE // BLOCK_M) * TILES_N
    live = tl.minimum(tl.maximum(tl.load(offsets + block_rows), 0), nnz)
    if PAIRS:  # (BLOCK_N == BLOCK_SIZE: whole blocks, side by side)
        TILES_M: tl.constexpr = BLOCK_SIZE // BLOCK_M
        pairs = (nnz + 1) // 2
        m_tile = tl.arange(0, BLOCK_M)
        n_pair = tl.arange(0, 2 * BLOCK_SIZE)
        hi = n_pair >= BLOCK_SIZE
        n_half = n_pair - tl.where(hi, BLOCK_SIZE, 0)
        for t in range(tl.program_id(0), pairs * TILES_M, tl.num_programs(0)):
            # Live pairs are grouped among themselves, in lines of half a row (as blocks are, below).
            p = _grouped(t // TILES_M, (live + 1) // 2, tl.maximum(row_width // 2, 1), GROUP)
            m_in = (t % TILES_M) * BLOCK_M + m_tile
            b0 = 2 * p
            b1 = b0 + 1
            same_row = _index(row_indices, b0, block_rows) == _index(row_indices, tl.minimum(b1, nnz - 1), block_rows)
            if (b1 < live) & same_row:
                rows = _index(row_indices, b0, block_rows) * BLOCK_SIZE + m_in
                cols = tl.where(hi, _index(column_indices, b1, block_cols), _index(column_indices, b0, block_cols))
                cols = cols * BLOCK_SIZE + n_half
                acc = tl.zeros((BLOCK_M, 2 * BLOCK_SIZE), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    a = _load(lhs, rows, ks, stride_lm, stride_lk, 0, K, LHS_CM, False, not EVEN_K, INT64)
                    w = _load(rhs, ks, cols, stride_rk, stride_rn, K, 0, RHS_CM, not EVEN_K, False, INT64)
                    acc = _dot(a, w, acc, PRECISION, WIDEN)
                # the two halves are blocks b0 and b1 = b0 + 1
                blk = _widen(b0 + hi.to(tl.int32), INT64)
                ptrs = out + blk[None, :] * stride_ob + _widen(m_in, INT64)[:, None] * stride_om \
                    + _widen(n_half, INT64)[None, :] * stride_on
                tl.store(ptrs, acc.to(out.dtype.element_ty))
            else:
                for h in range(2):
                    b = b0 + h
                    if b < nnz:
                        _sdd_blocks(lhs, rhs, out, row_indices, column_indices, b, live, m_in,
                                    tl.arange(0, BLOCK_SIZE), K, block_rows, block_cols, stride_lm, stride_lk,
                                    stride_rk, stride_rn, stride_ob, stride_om, stride_on, BLOCK_SIZE, BLOCK_M,
                                    BLOCK_SIZE, BLOCK_K, LHS_CM, RHS_CM, OUT_CM, EVEN_K, INT64, PRECISION, WIDEN)
    else:
        for t in range(tl.program_id(0), nnz * TILES, tl.num_programs(0)):
            # Live blocks are grouped among themselves; the spare ones keep their order (_grouped).
            b = _grouped(t // TILES, live, row_width, GROUP)
            sub = t % TILES
            m_in = (sub // TILES_N) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows and columns inside the block
            n_in = (sub % TILES_N) * BLOCK_N + tl.arange(0, BLOCK_N)
            _sdd_blocks(lhs, rhs, out, row_indices, column_indices, b, live, m_in, n_in, K, block_rows, block_cols,
                        stride_lm, stride_lk, stride_rk, stride_rn, stride_ob, stride_om, stride_on, BLOCK_SIZE,
                        BLOCK_M, BLOCK_N, BLOCK_K, LHS_CM, RHS_CM, OUT_CM, EVEN_K, INT64, PRECISION, WIDEN)


@triton.jit
def _run(indices, block_offsets, start, end, nnz, k_blocks, GATHER: tl.constexpr, CHECK: tl.constexpr):
    """Whether the entries ``start .. end`` of a line (a block row, or through the transpose a block
    column) are one affine run: block column (row) ``first + i`` and block ``base + i * step`` for its
    ``i``-th entry (``base = start``, ``step = 1`` when not ``GATHER``), every one in range. MegaBlocks'
    topology is made of such runs (a row is an expert's consecutive columns; a column holds its
    expert's consecutive rows, ``blocks_per_row`` blocks apart). Read with vector loads, ``CHECK``
    entries at a time; returns ``(run, first, base, step)``."""
    at = tl.minimum(start, nnz - 1)
    first = tl.load(indices + at).to(tl.int32)
    if GATHER:
        base = tl.load(block_offsets + at).to(tl.int32)
        step = tl.load(block_offsets + tl.minimum(at + 1, nnz - 1)).to(tl.int32) - base
    else:
        base = start
        step = 1
    lanes = tl.arange(0, CHECK)
    bad = tl.zeros((CHECK,), tl.int32)
    for j0 in range(start, end, CHECK):
        j = j0 + lanes
        inside = j < end
        i = j - start
        v = tl.load(indices + j, mask=inside, other=0).to(tl.int32)
        wrong = (v != first + i) | (v < 0) | (v >= k_blocks)
        if GATHER:
            blk = tl.load(block_offsets + j, mask=inside, other=0).to(tl.int32)
            wrong = wrong | (blk != base + i * step) | (blk < 0) | (blk >= nnz)
        bad = bad | (inside & wrong).to(tl.int32)
    return tl.max(bad, axis=0) == 0, first, base, step


@triton.jit
def _dsd_step(acc, s, start, data, rhs, indices, block_offsets, m_in, cols, N, nnz, k_blocks,
              stride_db, stride_am, stride_ak, stride_rk, stride_rn,
              BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr, A_CM: tl.constexpr,
              RHS_CM: tl.constexpr, EVEN_N: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
              WIDEN: tl.constexpr):
    """K-step ``s`` of a line from ``start``: its block and block column loaded from the metadata."""
    KSUB: tl.constexpr = BLOCK_SIZE // BLOCK_K
    j = start + s // KSUB
    k_in = (s % KSUB) * BLOCK_K + tl.arange(0, BLOCK_K)
    if GATHER:
        blk = _index(block_offsets, j, nnz)
    else:
        blk = j
    a = _load(data + _widen(blk, INT64) * stride_db, m_in, k_in, stride_am, stride_ak, 0, 0, A_CM, False, False, INT64)
    ks = _index(indices, j, k_blocks) * BLOCK_SIZE + k_in
    w = _load(rhs, ks, cols, stride_rk, stride_rn, 0, N, RHS_CM, False, not EVEN_N, INT64)
    return _dot(a, w, acc, PRECISION, WIDEN)


@kernel
def _dsd(data, rhs, out, offsets, indices, block_offsets,
         M, N, nnz, k_blocks,
         stride_db, stride_am, stride_ak, stride_rk, stride_rn, stride_om, stride_on,
         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         GROUP: tl.constexpr, GATHER: tl.constexpr, A_CM: tl.constexpr, RHS_CM: tl.constexpr,
         OUT_CM: tl.constexpr, EVEN_N: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
         WIDEN: tl.constexpr, AFFINE: tl.constexpr):
    """``out = op(S) @ rhs``: block row ``r`` of ``op(S)`` is the list ``offsets[r] .. offsets[r+1]``
    of (block ``block_offsets[j]`` if ``GATHER`` else ``j``, at block column ``indices[j]``); element
    ``(m, k)`` of a block is ``data[block, 0, 0] + m * stride_am + k * stride_ak``. ``AFFINE``: a row
    whose list is one affine run (:func:`_run`) computes its blocks' and columns' addresses instead of
    loading them at every K-step, which lets the loads pipeline; the other rows load them in a loop
    that is not pipelined (two pipelined loops would not fit in shared memory together)."""
    TILES_M: tl.constexpr = BLOCK_SIZE // BLOCK_M
    KSUB: tl.constexpr = BLOCK_SIZE // BLOCK_K
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = (M // BLOCK_M) * tiles_n
    for t in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        g = _grouped(t, num_tiles, tiles_n, GROUP)
        tm = g // tiles_n
        br = tm // TILES_M
        m_in = (tm % TILES_M) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (g % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        start, end = _span(offsets, br, nnz)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if AFFINE:
            run, first, base, step = _run(indices, block_offsets, start, end, nnz, k_blocks, GATHER, 128)
            if run:
                a_base = data + _widen(base, INT64) * stride_db
                r_base = rhs + _widen(first, INT64) * BLOCK_SIZE * stride_rk
                for s in range((end - start) * KSUB):
                    i = s // KSUB
                    k_in = (s % KSUB) * BLOCK_K + tl.arange(0, BLOCK_K)
                    a = _load(a_base + _widen(i * step, INT64) * stride_db, m_in, k_in, stride_am, stride_ak, 0, 0,
                              A_CM, False, False, INT64)
                    w = _load(r_base, i * BLOCK_SIZE + k_in, cols, stride_rk, stride_rn, 0, N, RHS_CM, False,
                              not EVEN_N, INT64)
                    acc = _dot(a, w, acc, PRECISION, WIDEN)
            else:
                for s in tl.range(0, (end - start) * KSUB, num_stages=1):
                    acc = _dsd_step(acc, s, start, data, rhs, indices, block_offsets, m_in, cols, N, nnz, k_blocks,
                                    stride_db, stride_am, stride_ak, stride_rk, stride_rn, BLOCK_SIZE, BLOCK_K, GATHER,
                                    A_CM, RHS_CM, EVEN_N, INT64, PRECISION, WIDEN)
        else:
            for s in range((end - start) * KSUB):
                acc = _dsd_step(acc, s, start, data, rhs, indices, block_offsets, m_in, cols, N, nnz, k_blocks,
                                stride_db, stride_am, stride_ak, stride_rk, stride_rn, BLOCK_SIZE, BLOCK_K, GATHER,
                                A_CM, RHS_CM, EVEN_N, INT64, PRECISION, WIDEN)
        _store(out, br * BLOCK_SIZE + m_in, cols, stride_om, stride_on,
               acc.to(out.dtype.element_ty), 0, N, OUT_CM, False, not EVEN_N, INT64)


@kernel
def _dds(lhs, data, out, offsets, indices, block_offsets,
         M, N, nnz, k_blocks,
         stride_lm, stride_lk, stride_db, stride_bk, stride_bn, stride_om, stride_on,
         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         GROUP: tl.constexpr, GATHER: tl.constexpr, LHS_CM: tl.constexpr, B_CM: tl.constexpr,
         OUT_CM: tl.constexpr, EVEN_M: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
         WIDEN: tl.constexpr):
    """``out = lhs @ op(S)``: block column ``c`` of ``op(S)`` is the list ``offsets[c] ..
    offsets[c+1]`` of (block ``block_offsets[j]`` if ``GATHER`` else ``j``, at block row
    ``indices[j]``); element ``(k, n)`` of a block is ``data[block, 0, 0] + k * stride_bk + n * stride_bn``."""
    TILES_N: tl.constexpr = BLOCK_SIZE // BLOCK_N
    KSUB: tl.constexpr = BLOCK_SIZE // BLOCK_K
    col_tiles = N // BLOCK_N
    num_tiles = tl.cdiv(M, BLOCK_M) * col_tiles
    for t in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        g = _grouped(t, num_tiles, col_tiles, GROUP)
        rows = (g // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        tn = g % col_tiles
        bc = tn // TILES_N
        n_in = (tn % TILES_N) * BLOCK_N + tl.arange(0, BLOCK_N)
        start, end = _span(offsets, bc, nnz)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range((end - start) * KSUB):
            j = start + s // KSUB
            k_in = (s % KSUB) * BLOCK_K + tl.arange(0, BLOCK_K)
            ks = _index(indices, j, k_blocks) * BLOCK_SIZE + k_in
            a = _load(lhs, rows, ks, stride_lm, stride_lk, M, 0, LHS_CM, not EVEN_M, False, INT64)
            if GATHER:
                blk = _index(block_offsets, j, nnz)
            else:
                blk = j
            w = _load(data + _widen(blk, INT64) * stride_db, k_in, n_in, stride_bk, stride_bn, 0, 0, B_CM, False, False,
                      INT64)
            acc = _dot(a, w, acc, PRECISION, WIDEN)
        _store(out, rows, bc * BLOCK_SIZE + n_in, stride_om, stride_on,
               acc.to(out.dtype.element_ty), M, 0, OUT_CM, not EVEN_M, False, INT64)


@kernel
def _row_indices(offsets, out, block_rows, nnz, BLOCK: tl.constexpr):
    """``out[offsets[r] .. offsets[r + 1]] = r`` for every block row ``r``."""
    lane = tl.arange(0, BLOCK)
    for r in range(tl.program_id(0), block_rows, tl.num_programs(0)):
        start, end = _span(offsets, r, nnz)
        value = (tl.zeros((BLOCK,), tl.int32) + r).to(out.dtype.element_ty)
        for s in range(start, end, BLOCK):
            tl.store(out + s + lane, value, mask=s + lane < end)


# --------------------------------------------------------------------------------------------
# Launch helpers.


def _column_major(stride_r: int, stride_c: int) -> bool:
    """Whether a tile with these (row, column) element strides is loaded transposed: the rows are
    the contiguous dimension and the columns are not."""
    return stride_r == 1 and stride_c != 1


def _max_offset(sizes, strides) -> int:
    """The largest element offset a kernel forms for a tensor of ``sizes`` (padded to whole tiles)."""
    if any(s <= 0 for s in sizes):
        return 0
    return sum((s - 1) * abs(st) for s, st in zip(sizes, strides))


def _needs_int64(*max_offsets: int) -> bool:
    return launch.needs_int64(*max_offsets, limit=_OFFSET_LIMIT)


def _check_int32_extents(tiles: int, **dims) -> None:
    """Tile counts and indices within one dimension (tiles padded to whole tiles) are int32 in the
    kernels, whatever ``INT64`` says."""
    for name, (size, tile) in dims.items():
        if launch.cdiv(size, tile) * tile > _EXTENT_LIMIT:
            _fail(name, f"has a dimension of {size} elements; the kernels index within a dimension in int32 "
                        f"(at most {_EXTENT_LIMIT} elements, tiles included)")
    if tiles > _EXTENT_LIMIT:
        _fail("shape", f"needs {tiles} output tiles; the kernels count tiles in int32 (at most {_EXTENT_LIMIT})")


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot``'s input precision: float32 operands follow torch's TF32 switch on CUDA (``tf32``
    only where ``torch.backends.cuda.matmul.allow_tf32`` is on, as for torch's own matmuls), exact
    (``ieee``) elsewhere. 16-bit operands are multiplied exactly either way; they get ``ieee``
    too, because triton-ascend 3.2.0 has no default to fall back on (``input_precision=None``
    raises there)."""
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _tile(kind, dtype, block_size, dense, device, tile, transposed=False):
    if tile is not None:
        return tile
    return devices.cube_tile(kind, dtype, block_size, dense, devices.target(device), transposed)


def _grid(device, work: int, tile, num_programs):
    if num_programs is None:
        num_programs = devices.num_programs(device, work, unit="cube", programs_per_sm=tile.programs_per_sm)
    return (max(1, min(num_programs, work)),)


def _launch_options(tile, device) -> dict:
    if device.type == "cuda":
        return dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    return {}


# --------------------------------------------------------------------------------------------
# What the launchers check themselves: only what depends on their own choices (the tile, and
# int32 indexing at that tile). Every argument was checked before: see the module docstring.


def _fail(name: str, what: str):
    raise ValueError(f"{name}: {what}")


# --------------------------------------------------------------------------------------------
# stk's kernel entry points (stk.backend.triton_kernels), same signatures and results.


def sdd(lhs, rhs, shape, out, offsets, row_indices, column_indices, *, tile=None, num_programs=None):
    """``out[b] = (lhs @ rhs)[block b]`` for every non-zero block ``b`` of the topology."""
    device = out.device
    nnz, b = out.shape[0], out.shape[1]
    m, n = shape
    if nnz == 0:
        return out
    k = lhs.shape[1]
    t = _tile("sdd", lhs.dtype, b, k, device, tile)
    _check_tile(t, b, "sdd")
    kp = launch.cdiv(max(k, 1), t.block_k) * t.block_k
    int64 = _needs_int64(_max_offset((m, kp), lhs.stride()), _max_offset((kp, n), rhs.stride()),
                         _max_offset(out.shape, out.stride()))
    pairs = t.pairs and t.block_n == b  # tiles of two whole blocks side by side
    tiles = launch.cdiv(nnz, 2) * (b // t.block_m) if pairs else nnz * (b // t.block_m) * (b // t.block_n)
    _check_int32_extents(tiles, lhs=(max(m, k), t.block_k), rhs=(max(k, n), t.block_k))
    _sdd[_grid(device, tiles, t, num_programs)](
        lhs, rhs, out, offsets, row_indices, column_indices,
        k, nnz, m // b, n // b, max(1, nnz // max(m // b, 1)),
        lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_SIZE=b, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP=t.group,
        LHS_CM=_column_major(lhs.stride(0), lhs.stride(1)), RHS_CM=_column_major(rhs.stride(0), rhs.stride(1)),
        OUT_CM=_column_major(out.stride(1), out.stride(2)), EVEN_K=k % t.block_k == 0, INT64=int64,
        PRECISION=_precision(lhs.dtype, device), WIDEN=compat.dot_needs_float32(lhs.dtype, device), PAIRS=pairs,
        **_launch_options(t, device),
    )
    return out


def dsd(shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_a, rhs, out, *, tile=None, num_programs=None):
    """``out = op(S) @ rhs``, ``op(S)`` of ``shape``: ``S`` itself, or its transpose if ``transpose_a``."""
    device = rhs.device
    nnz, b = data.shape[0], data.shape[1]
    m, k = shape
    n = rhs.shape[1]
    if transpose_a:  # rows of op(S) are S's columns, walked through the transpose metadata
        line_offsets, line_indices = offsets_t, column_indices_t
        stride_am, stride_ak = data.stride(2), data.stride(1)
    else:
        line_offsets, line_indices = offsets, column_indices
        stride_am, stride_ak = data.stride(1), data.stride(2)
    if m == 0 or n == 0:
        return out
    if nnz == 0:
        return out.zero_()
    t = _tile("dsd", data.dtype, b, n, device, tile, transpose_a)
    _check_tile(t, b, "dsd")
    np_ = launch.cdiv(n, t.block_n) * t.block_n
    int64 = _needs_int64(_max_offset(data.shape, data.stride()), _max_offset((k, np_), rhs.stride()),
                         _max_offset((m, np_), out.stride()))
    tiles = (m // t.block_m) * launch.cdiv(n, t.block_n)
    _check_int32_extents(tiles, rhs=(max(k, n), t.block_n), out=(max(m, n), t.block_n))
    _dsd[_grid(device, tiles, t, num_programs)](
        data, rhs, out, line_offsets, line_indices, block_offsets_t if transpose_a else line_offsets,
        m, n, nnz, k // b,
        data.stride(0), stride_am, stride_ak, rhs.stride(0), rhs.stride(1), out.stride(0), out.stride(1),
        BLOCK_SIZE=b, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP=t.group,
        GATHER=transpose_a, A_CM=_column_major(stride_am, stride_ak),
        RHS_CM=_column_major(rhs.stride(0), rhs.stride(1)), OUT_CM=_column_major(out.stride(0), out.stride(1)),
        EVEN_N=n % t.block_n == 0, INT64=int64, PRECISION=_precision(data.dtype, device),
        WIDEN=compat.dot_needs_float32(data.dtype, device), AFFINE=t.affine,
        **_launch_options(t, device),
    )
    return out


def dds(lhs, shape, data, offsets, row_indices, column_indices, offsets_t, column_indices_t, block_offsets_t,
        transpose_b, out, *, tile=None, num_programs=None):
    """``out = lhs @ op(S)``, ``op(S)`` of ``shape``: ``S`` itself, or its transpose if ``transpose_b``."""
    device = lhs.device
    nnz, b = data.shape[0], data.shape[1]
    k, n = shape
    m = lhs.shape[0]
    if transpose_b:  # columns of op(S) are S's rows, walked in S's own order
        line_offsets, line_indices = offsets, column_indices
        stride_bk, stride_bn = data.stride(2), data.stride(1)
    else:
        line_offsets, line_indices = offsets_t, column_indices_t
        stride_bk, stride_bn = data.stride(1), data.stride(2)
    if m == 0 or n == 0:
        return out
    if nnz == 0:
        return out.zero_()
    t = _tile("dds", data.dtype, b, m, device, tile, transpose_b)
    _check_tile(t, b, "dds")
    mp = launch.cdiv(m, t.block_m) * t.block_m
    int64 = _needs_int64(_max_offset(data.shape, data.stride()), _max_offset((mp, k), lhs.stride()),
                         _max_offset((mp, n), out.stride()))
    tiles = launch.cdiv(m, t.block_m) * (n // t.block_n)
    _check_int32_extents(tiles, lhs=(max(m, k), t.block_m), out=(max(m, n), t.block_m))
    _dds[_grid(device, tiles, t, num_programs)](
        lhs, data, out, line_offsets, line_indices, line_offsets if transpose_b else block_offsets_t,
        m, n, nnz, k // b,
        lhs.stride(0), lhs.stride(1), data.stride(0), stride_bk, stride_bn, out.stride(0), out.stride(1),
        BLOCK_SIZE=b, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP=t.group,
        GATHER=not transpose_b, LHS_CM=_column_major(lhs.stride(0), lhs.stride(1)),
        B_CM=_column_major(stride_bk, stride_bn), OUT_CM=_column_major(out.stride(0), out.stride(1)),
        EVEN_M=m % t.block_m == 0, INT64=int64, PRECISION=_precision(data.dtype, device),
        WIDEN=compat.dot_needs_float32(data.dtype, device),
        **_launch_options(t, device),
    )
    return out


ROW_INDICES_BLOCK = 128  # entries written per store


def row_indices(shape, data, offsets, column_indices, out, *, num_programs=None):
    """``out[b]`` = the block row of block ``b``, from ``offsets``. ``data`` is not read (MegaBlocks
    passes a tensor on the meta device)."""
    device = offsets.device
    block_rows = offsets.numel() - 1
    nnz = out.numel()
    if nnz == 0 or block_rows == 0:
        return out
    grid = num_programs if num_programs is not None else devices.num_programs(device, block_rows)
    _row_indices[(max(1, min(grid, block_rows)),)](offsets, out, block_rows, nnz, BLOCK=ROW_INDICES_BLOCK)
    return out


def _check_tile(t, b: int, kind: str) -> None:
    """A tile the kernels can run: sides that lie inside a block divide it, every side >= 16."""
    inside = {"sdd": (t.block_m, t.block_n), "dsd": (t.block_m, t.block_k), "dds": (t.block_n, t.block_k)}[kind]
    sides = (t.block_m, t.block_n, t.block_k)
    if any(s < 16 or s & (s - 1) for s in sides) or any(s > b for s in inside):
        _fail("tile", f"{kind} tile {sides} does not fit block size {b}: sides must be powers of two >= 16 "
                      f"and the sides inside a block at most {b}")
