"""Routing kernels for the three MegaBlocks layouts: binned, dropless and padded.

Vocabulary
----------
assignment slot ``a``   one (token, choice) pair, ``a = token * top_k + choice``; ``N = tokens * top_k``.
sorted position ``p``   index into ``indices``: ``indices[p]`` is the slot at position ``p``, and
                        positions are grouped by expert (``bins`` is the inclusive cumulative count
                        of positions per expert).
buffer row ``r``        a row of the expert-major buffer that the expert MLPs read. Expert ``e``
                        owns rows ``[pend[e-1], pend[e])``, where ``pend`` (the end of each expert's
                        row segment) is
                          * dropless: ``bins`` itself (no padding, no dropping),
                          * padded:   ``padded_bins`` (segments rounded up; the extra rows are zero),
                          * binned:   ``(e + 1) * expert_capacity`` (positions past the capacity are
                                      dropped; unused capacity rows are zero).
                        Position ``p`` of expert ``e`` lands on row ``pend[e-1] + (p - bins[e-1])``
                        when that is below ``pend[e]``, and is dropped otherwise.

One formula therefore serves all three layouts; each layout only chooses ``pend``.

Walking the experts' segments
-----------------------------
Kernels that go over positions or rows of a padded or binned layout do so expert by expert
(``_walk``): each expert's segment is cut into blocks of ``BLOCK_M``, the blocks of all experts
are numbered in expert order, and a program maps a block number back to its expert with one
``BLOCK_E``-wide compare per block. Every item of a block then shares the expert's offsets, so
no per-item search over the experts is needed (a ``[BLOCK_M, BLOCK_E]`` compare per block cost
an H200 ~10 us per call at 64 experts), and a walk may visit only part of each segment (the
rows no position lands on, for zeroing).

Kernels
-------
``_gather``   buffer-row-major: each program walks sub-blocks of ``BLOCK_M`` buffer rows, reads
              each row's position (the row itself when dropless, else from the row map, ``-1`` for
              padding), and copies token rows ``x[indices[p] // top_k]`` in feature tiles of
              ``BLOCK_X``, optionally scaled by the router weight. Padding and unused capacity rows
              are written as zeros, so the output needs no separate zero fill, and every output row
              is written exactly once. No search over the experts: its work per row and its tile
              are the same at 8 experts and at 256.
``_gather_tokens`` token-major, for top_k > 1: each program walks sub-blocks of ``BLOCK_M``
              tokens, loads each token row once per feature tile and stores it (scaled by each
              slot's weight) to the buffer rows of its kept slots (from ``_route_map``); a second
              walk visits only the rows no slot lands on (padding, unused capacity) and writes
              them as zeros. ``_gather`` would read a token row ``top_k`` times, far apart in time.
``_route_map`` position-major (a walk): for each position, the buffer row it lands on (or -1
              when dropped), stored at its slot: the inverse map the token-major kernels need.
``_row_map``  row-major (a walk), padded and binned: for each buffer row, the position that lands
              on it (or -1): the map ``_gather`` reads. The routing preparation writes the same map
              in its own launch (kernels/preparation.py), so a layer step launches nothing for it.
``_scatter``  token-major: each program walks sub-blocks of ``BLOCK_M`` tokens and, per feature
              tile, sums the token's ``top_k`` buffer rows (scaled by the router weights) in
              float32 registers; each output row is written once, with no ``[tokens, top_k,
              hidden]`` temporary and no separate reduction pass.
``_wgrad``    slot-major: the float32 dot product of each slot's buffer row with its token's
              output gradient (zero for dropped slots): the router-weight gradient.
``_scatter_one``, ``_wgrad_one``  position-major walks, for top_k == 1: each token has exactly one
              position, so walking positions writes every output row (or slot) exactly once and
              needs no inverse map: one launch instead of two (``_route_map`` + the token- or
              slot-major kernel). With top_k > 1, position order would re-read each token's rows
              top_k times from memory, so the two-launch kernels are faster there (H200 notes).

Two forms
---------
Each op has a form whose stores all land on consecutive rows (``_gather``, ``_scatter``,
``_wgrad``: rows are gathered on load) and, for some top_k, one that stores to data-dependent rows
(``_gather_tokens`` for top_k > 1; ``_scatter_one`` and ``_wgrad_one`` for top_k == 1). On an NPU a
store to data-dependent rows becomes a loop over the rows in which each store waits for the one
before (a ``pipe_barrier`` on the store pipe), so the NPU runs the contiguous form; on CUDA the
other is the faster (each token row read once; one launch less). ``devices.STORES`` says which form
each target runs, ``MEGABLOCKS_ASCEND_STORES`` overrides it, and ``docs/notes/npu-census.md`` has
the compile gate's figures. In the kernels that keep the scattered form, a value stored to
data-dependent rows is finished by a select (``_scaled``): without it triton-ascend copies the whole
chain computing the value into the per-row store loop.

Rows a kernel must not touch (dropped slots, padding, the tail of the last sub-block) are
redirected to a spare row or element allocated past the end of the output (never read), not
masked per row: a row mask computed from loaded data makes triton-ascend store element by
element, while a column-only mask keeps one DMA per row. Offsets computed from loaded data are
clamped to valid rows before they address memory (triton-ascend#2332).

Every kernel has a 1-D grid of ``devices.num_programs`` programs (vector cores on an NPU) that
loop over their sub-blocks; rows are moved by 2-D tiles whose row offsets come from an index
vector, which triton-ascend lowers to one contiguous DMA per row. Offsets are int32 unless a
tensor has 2**31 elements or more, in which case the launcher specialises the kernel with
``INT64=True``. Masks keep every access inside its tensor, whatever the routing says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megablocks_ascend import compat, devices, envs, keeping
from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels.scan import cumsum

DROPLESS, PADDED, BINNED = 0, 1, 2
# Triton kernels may only read globals that are tl.constexpr; the launchers use the ints above.
_DROPLESS, _PADDED = tl.constexpr(DROPLESS), tl.constexpr(PADDED)
_BIG = tl.constexpr(2147483647)


_POSITIONS, _PADDING, _ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _segments(bins, padded_bins, capacity, num_experts, LAYOUT: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per expert, loaded from ``bins`` / ``padded_bins``: ``(e, e_mask, pstart, count, rstart, seg)``,
    its sorted positions ``[pstart, pstart + count)`` and its buffer rows ``[rstart, rstart + seg)``."""
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    prev = tl.maximum(e - 1, 0)
    has_prev = e_mask & (e > 0)
    pend = tl.load(bins + e, mask=e_mask, other=0).to(tl.int32)
    pstart = tl.load(bins + prev, mask=has_prev, other=0).to(tl.int32)
    if LAYOUT == _PADDED:
        rend = tl.load(padded_bins + e, mask=e_mask, other=0).to(tl.int32)
        rstart = tl.load(padded_bins + prev, mask=has_prev, other=0).to(tl.int32)
    elif LAYOUT == _DROPLESS:
        rend = pend
        rstart = pstart
    else:
        rstart = e * capacity
        rend = rstart + capacity
    return e, e_mask, pstart, tl.maximum(pend - pstart, 0), rstart, tl.maximum(rend - rstart, 0)


@triton.jit
def _walk_table(e, e_mask, pstart, count, rstart, seg, num_experts, num_items,
                WALK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The block table of a walk (:func:`_walk`) from each expert's segments (:func:`_segments`),
    given as values: the routing preparation computes them in the launch that writes ``bins``."""
    kept = tl.minimum(count, seg)
    if WALK == _POSITIONS:  # items are positions, from each segment's first
        begin = pstart
        end = pstart + count
        delta = rstart - pstart
        kend = pstart + kept
    elif WALK == _PADDING:  # items are rows, from each segment's first padding row
        begin = rstart + kept
        # (the rows past the last segment, in a buffer sized above padded_bins[-1], are padding too)
        end = tl.where(e == num_experts - 1, tl.maximum(rstart + seg, num_items), rstart + seg)
        delta = pstart - rstart
        kend = begin
    else:  # items are every row, the last expert's segment reaching num_items (the map's rows)
        begin = rstart
        end = tl.where(e == num_experts - 1, tl.maximum(rstart + seg, num_items), rstart + seg)
        delta = pstart - rstart
        kend = rstart + kept
    nblk = tl.where(e_mask, (end - begin + BLOCK_M - 1) // BLOCK_M, 0)
    first = cumsum(nblk, BLOCK_E) - nblk  # (a vector scan: kernels/scan.py)
    return e, first, nblk, tl.sum(nblk, axis=0), begin - first * BLOCK_M, end, delta, kend


@triton.jit
def _walk(bins, padded_bins, capacity, num_experts, num_items,
          LAYOUT: tl.constexpr, WALK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The block table of a walk over the experts' segments, one expert per block.

    ``WALK`` picks the items walked: each expert's sorted positions (``_POSITIONS``), its buffer
    rows that no position lands on (``_PADDING``), or all its buffer rows (``_ROWS``; the last
    expert's reach ``num_items``, so that a walk covers every row of a map of ``num_items``). Per
    expert ``e``: positions ``[pstart, pstart + count)`` (from ``bins``) and rows ``[rstart,
    rstart + seg)`` (from the layout's segment ends); the first ``kept = min(count, seg)``
    positions feed the first ``kept`` rows, the other rows are padding (padded) or unused capacity
    (binned), and the other positions are dropped (binned). Each expert's items are cut into
    blocks of ``BLOCK_M``, numbered ``0 .. total - 1`` in expert order; :func:`_walk_block` maps a
    block number back to its expert with one ``BLOCK_E``-wide compare per block, not one per item.

    Returns ``(e, first, nblk, total, start, end, delta, kend)``, per expert: its first block
    number, its block count, then ``start`` such that item ``m`` of its block ``g`` is
    ``start + g * BLOCK_M + m``, ``end`` (its items end there), ``delta`` (item + delta is the
    row of a position, or the position of a row) and ``kend`` (items below it are kept positions,
    or rows that a position lands on). The dropless position walk needs no table (rows are
    positions).
    """
    if LAYOUT == _DROPLESS and WALK == _POSITIONS:
        e = tl.arange(0, BLOCK_E)
        zero = tl.zeros((BLOCK_E,), tl.int32)
        return e, zero, zero, tl.cdiv(num_items, BLOCK_M), zero, zero, zero, zero
    e, e_mask, pstart, count, rstart, seg = _segments(bins, padded_bins, capacity, num_experts, LAYOUT, BLOCK_E)
    return _walk_table(e, e_mask, pstart, count, rstart, seg, num_experts, num_items, WALK, BLOCK_M, BLOCK_E)


@triton.jit
def _pick(sel, v):
    return tl.sum(tl.where(sel, v, 0), axis=0)


@triton.jit
def _walk_block(g, m, num_items, e, first, nblk, start, end, delta, kend,
                LAYOUT: tl.constexpr, WALK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``g`` of a :func:`_walk`: ``(item, inside, delta, kend)``, its items (positions or
    rows), which of them exist, and its expert's ``delta`` and ``kend`` (scalars)."""
    if LAYOUT == _DROPLESS and WALK == _POSITIONS:
        item = g * BLOCK_M + m
        return item, item < num_items, 0, _BIG
    # The expert owning block g: the last one with blocks whose first block is <= g.
    sel = e == tl.max(tl.where((first <= g) & (nblk > 0), e, -1), axis=0)
    item = _pick(sel, start) + g * BLOCK_M + m
    return item, item < _pick(sel, end), _pick(sel, delta), _pick(sel, kend)


@triton.jit
def _position_rows(blk, m, indices, num_positions, num_rows, e, first, nblk, start, end, delta, kend,
                   LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block ``blk`` of a position walk: ``(row, slot, has_slot, keep)``, the buffer row of each
    position (clamped to 0 where not kept), its assignment slot, whether the slot is a real one,
    and whether the position is kept (its slot is real and it has a row below ``num_rows``: it
    was not dropped)."""
    pos, inside, d, k_end = _walk_block(blk, m, num_positions, e, first, nblk, start, end, delta, kend,
                                        LAYOUT, _POSITIONS, BLOCK_M)
    in_pos = inside & (pos >= 0) & (pos < num_positions)
    # clamped, not only masked (triton-ascend#2332)
    slot = tl.load(indices + tl.where(in_pos, pos, 0), mask=in_pos, other=-1).to(tl.int32)
    has_slot = in_pos & (slot >= 0) & (slot < num_positions)
    row = pos + d
    keep = has_slot & (pos < k_end) & (row >= 0) & (row < num_rows)
    return tl.where(keep, row, 0), slot, has_slot, keep


@triton.jit
def _offsets(rows, hidden, INT64: tl.constexpr):
    """Element offsets of the starts of ``rows``: int64 when the launcher specialised the kernel
    for a tensor of 2**31 elements or more, int32 otherwise."""
    if INT64:
        rows = rows.to(tl.int64)
    return rows * hidden


@triton.jit
def _columns(x0, cols, hidden, EVEN_X: tl.constexpr, BLOCK_X: tl.constexpr):
    """The feature columns of one tile and their mask. When ``hidden`` is a multiple of ``BLOCK_X``
    (``EVEN_X``) the mask is a constant and folds away: no per-tile compare in the hot loop."""
    c = x0 + cols
    if EVEN_X:
        c_mask = tl.full((BLOCK_X,), 1, tl.int1)
    else:
        c_mask = c < hidden
    return c, c_mask


@triton.jit
def _scaled(tile, scale, valid, dtype):
    """``tile * scale`` per row, in float32, cast to ``dtype``, for a store to computed rows. The
    select at the end is not arithmetic: triton-ascend's front end turns a store to data-dependent
    rows into a loop over the rows and copies the whole chain that feeds the store into it (the
    cast, the broadcast, the multiply, the truncation: per row, with a bf16 weight moved through a
    one-element buffer because the scalar unit cannot convert bf16, and a handshake each way); a
    select stops the copying, so the chain runs once on the whole tile (docs/notes/npu-census.md)."""
    return tl.where(valid[:, None], (tile.to(tl.float32) * scale[:, None]).to(dtype), 0)


# Row loads through triton-ascend's index_select_simd (the SELECT form, devices.ROW_LOADS): on
# triton-ascend the builtin itself; elsewhere (standard Triton, the interpreter) its documented
# semantics in plain Triton, so that CI runs the kernels' SELECT form: rows ``rows`` of a
# [num_src_rows, hidden] tensor, columns [x0, x0 + BLOCK_X); no check of the row numbers; what lies
# outside the tensor is not defined (NaN here: a kernel that does not select those elements away
# fails its tests).
_ASCEND = compat.ascend_row_select()  # the module holding the builtin, or None


@triton.jit
def _select_rows_builtin(src, rows, num_src_rows, hidden, x0, BLOCK_X: tl.constexpr):
    return _ASCEND.index_select_simd(src, 0, rows, [num_src_rows, hidden], [-1, x0], [-1, BLOCK_X])


@triton.jit
def _select_rows_plain(src, rows, num_src_rows, hidden, x0, BLOCK_X: tl.constexpr):
    cols = x0 + tl.arange(0, BLOCK_X)
    inside = (rows >= 0) & (rows < num_src_rows)
    return tl.load(src + rows[:, None] * hidden + cols[None, :], mask=inside[:, None] & (cols < hidden)[None, :],
                   other=float("nan"))


_select_rows = _select_rows_builtin if _ASCEND is not None else _select_rows_plain


@triton.jit
def _load_rows(src, rows, offsets, valid, num_src_rows, hidden, x0, c, c_mask,
               SELECT: tl.constexpr, BLOCK_X: tl.constexpr):
    """Feature tile ``c`` of rows ``rows`` of ``src`` (row numbers clamped to valid ones, ``offsets``
    their element offsets): 0 where not ``valid`` and outside the features. ``SELECT``: through
    ``index_select_simd`` (the launcher sets it only for int32 offsets and whole feature tiles), the
    rows not ``valid`` selected to 0 after the load; else one masked 2-D load."""
    if SELECT:
        tile = tl.where(valid[:, None], _select_rows(src, rows, num_src_rows, hidden, x0, BLOCK_X), 0)
    else:
        tile = tl.load(src + offsets[:, None] + c[None, :], mask=valid[:, None] & c_mask[None, :], other=0)
    return tile


_INT32_LIMIT = 2**31


@kernel
def _gather(
    x, out, indices, row_pos, weights,
    num_rows, map_rows, num_positions, hidden,
    MAPPED: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr, INT64: tl.constexpr, SELECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, EVEN_X: tl.constexpr,
):
    # Buffer-row-major. Each row's sorted position is the row itself (dropless) or, MAPPED (padded,
    # binned), read from the row map (_row_map, or the routing preparation's launch): one
    # contiguous load per sub-block, no search over the experts, so neither the work per row nor
    # the tile depends on the expert count (a [BLOCK_M, BLOCK_E] search here took the tile from 16
    # rows at 8 experts to 4 at 256 on an NPU: docs/notes/many-experts.md). Rows past the map
    # (map_rows) are padding. It serves every top_k on an NPU (its stores are contiguous:
    # devices.STORES) and the dropless top_k == 1 on CUDA.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    for blk in range(pid, tl.cdiv(num_rows, BLOCK_M), npg):
        rows = blk * BLOCK_M + m
        in_rows = rows < num_rows
        if MAPPED:
            pos = tl.load(row_pos + rows, mask=rows < map_rows, other=-1)
            valid = in_rows & (pos >= 0) & (pos < num_positions)
            # Loads through computed offsets are clamped to valid addresses, not just masked:
            # triton-ascend 3.2 may issue a masked-out data-dependent load (triton-ascend#2332).
            pos = tl.where(valid, pos, 0)
        else:
            pos = rows
            valid = in_rows
        slot = tl.load(indices + pos, mask=valid, other=0).to(tl.int32)
        valid = valid & (slot >= 0) & (slot < num_positions)
        slot = tl.where(valid, slot, 0)
        token = slot // TOP_K
        if SCALE:
            scale = tl.load(weights + slot, mask=valid, other=0).to(tl.float32)
        src = _offsets(token, hidden, INT64)
        dst = _offsets(rows, hidden, INT64)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            tile = _load_rows(x, token, src, valid, num_positions // TOP_K, hidden, x0, c, c_mask, SELECT, BLOCK_X)
            if SCALE:
                tile = (tile.to(tl.float32) * scale[:, None]).to(out.dtype.element_ty)
            tl.store(out + dst[:, None] + c[None, :], tile, mask=in_rows[:, None] & c_mask[None, :])


@kernel
def _gather_tokens(
    x, out, slot_to_row, bins, padded_bins, weights,
    num_tokens, num_rows, num_experts, hidden, capacity,
    LAYOUT: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_X: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    # Token-major copies: each token row is read once and written to each of its TOP_K buffer rows.
    for blk in range(pid, tl.cdiv(num_tokens, BLOCK_M), npg):
        tokens = blk * BLOCK_M + m
        in_tokens = tokens < num_tokens
        used = in_tokens & (tokens < 0)  # all False; becomes "has a kept slot"
        for k in tl.static_range(TOP_K):
            row = tl.load(slot_to_row + tokens * TOP_K + k, mask=in_tokens, other=-1)
            used = used | (in_tokens & (row >= 0) & (row < num_rows))
        src_tokens = tl.where(in_tokens, tokens, 0)
        src = _offsets(src_tokens, hidden, INT64)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            tile = tl.load(x + src[:, None] + c[None, :], mask=used[:, None] & c_mask[None, :], other=0)
            for k in tl.static_range(TOP_K):
                slot = tokens * TOP_K + k
                row = tl.load(slot_to_row + slot, mask=in_tokens, other=-1)
                valid = in_tokens & (row >= 0) & (row < num_rows)
                # Dropped slots write to the spare row num_rows (allocated, never read) instead of
                # being masked: a row mask computed from loaded data makes triton-ascend store
                # element by element, while a column-only mask keeps one DMA per row.
                row = tl.where(valid, row, num_rows)
                dst = _offsets(row, hidden, INT64)
                if SCALE:
                    scale = tl.load(weights + slot, mask=valid, other=0).to(tl.float32)
                    value = _scaled(tile, scale, valid, out.dtype.element_ty)
                else:
                    value = tile
                tl.store(out + dst[:, None] + c[None, :], value, mask=c_mask[None, :])
    # Rows no assignment lands on (padding, unused capacity) are written as zeros: the walk visits
    # only those rows, and decides them from bins alone (no load of indices: with value checks
    # off, a row whose position holds an invalid slot is left unwritten, like that slot's weight
    # gradient).
    if LAYOUT != _DROPLESS:
        e, first, nblk, total, start, end, delta, kend = _walk(
            bins, padded_bins, capacity, num_experts, num_rows, LAYOUT, _PADDING, BLOCK_M, BLOCK_E)
        zeros = tl.zeros((BLOCK_M, BLOCK_X), out.dtype.element_ty)
        for blk in range(pid, total, npg):
            rows, inside, _, _ = _walk_block(blk, m, num_rows, e, first, nblk, start, end, delta, kend,
                                             LAYOUT, _PADDING, BLOCK_M)
            rows = tl.where(inside & (rows >= 0) & (rows < num_rows), rows, num_rows)  # else the spare row
            dst = _offsets(rows, hidden, INT64)
            for x0 in range(0, hidden, BLOCK_X):
                c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
                tl.store(out + dst[:, None] + c[None, :], zeros, mask=c_mask[None, :])


@kernel
def _route_map(
    indices, bins, padded_bins, slot_to_row,
    num_positions, num_experts, capacity,
    LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    e, first, nblk, total, start, end, delta, kend = _walk(
        bins, padded_bins, capacity, num_experts, num_positions, LAYOUT, _POSITIONS, BLOCK_M, BLOCK_E)
    for blk in range(pid, total, npg):
        row, slot, has_slot, keep = _position_rows(blk, m, indices, num_positions, _BIG, e, first, nblk, start,
                                                   end, delta, kend, LAYOUT, BLOCK_M)
        tl.store(slot_to_row + slot, tl.where(keep, row, -1), mask=has_slot)


@kernel
def _row_map(
    bins, padded_bins, row_pos,
    num_rows, num_experts, capacity,
    LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Row-major walk (padded, binned): each block is consecutive rows of one expert, so a block's
    # positions are consecutive too, and every store lands on consecutive rows (no store to
    # data-dependent rows). Rows no position lands on (padding, unused capacity, the rows past the
    # last segment) get -1.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    e, first, nblk, total, start, end, delta, kend = _walk(
        bins, padded_bins, capacity, num_experts, num_rows, LAYOUT, _ROWS, BLOCK_M, BLOCK_E)
    for blk in range(pid, total, npg):
        rows, inside, d, k_end = _walk_block(blk, m, num_rows, e, first, nblk, start, end, delta, kend,
                                             LAYOUT, _ROWS, BLOCK_M)
        tl.store(row_pos + rows, tl.where(rows < k_end, rows + d, -1), mask=inside & (rows >= 0) & (rows < num_rows))


@kernel
def _scatter(
    y, out, slot_to_row, weights,
    num_tokens, num_rows, hidden,
    TOP_K: tl.constexpr, SCALE: tl.constexpr, INT64: tl.constexpr, FLAT: tl.constexpr, SELECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr, EVEN_X: tl.constexpr,
):
    # Token-major: a sub-block of BLOCK_M tokens gathers its slots' rows on load and stores its
    # sums contiguously. FLAT (the NPU's form, devices.STORES): the sub-block's slots are one
    # [BLOCK_M, BLOCK_K] tile (BLOCK_K: top_k to a power of two), so the map, the weights and the
    # rows each come in one load of BLOCK_M * BLOCK_K rows and the top_k sum is a reduction: one
    # scalar<->vector handshake per sub-block where a load per slot took one per slot and row
    # (docs/notes/npu-census.md). Otherwise (CUDA) one [BLOCK_M, BLOCK_X] load per slot, which
    # keeps its registers to one tile per slot.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    for blk in range(pid, tl.cdiv(num_tokens, BLOCK_M), npg):
        tokens = blk * BLOCK_M + m
        in_tokens = tokens < num_tokens
        dst = _offsets(tokens, hidden, INT64)
        if FLAT:
            first = tokens * TOP_K
            kk = tl.arange(0, BLOCK_K)
            slots = first[:, None] + kk[None, :]
            # Both compares on the full tile (no broadcast of a [BLOCK_M] or [BLOCK_K] mask).
            in_slots = (slots < num_tokens * TOP_K) & (slots - first[:, None] < TOP_K)
            row = tl.load(slot_to_row + slots, mask=in_slots, other=-1)
            valid = in_slots & (row >= 0) & (row < num_rows)
            flat_rows = tl.reshape(tl.where(valid, row, 0), (BLOCK_M * BLOCK_K,))
            src = _offsets(flat_rows, hidden, INT64)
            if SCALE:
                # A dropped slot's weight is selected away, not multiplied by its zero row: a NaN or
                # infinite weight would make the token's sum NaN (CUDA's form masks it the same way).
                scale = tl.load(weights + slots, mask=in_slots, other=0).to(tl.float32)
                scale = tl.reshape(tl.where(valid, scale, 0.0), (BLOCK_M * BLOCK_K,))
            valid = tl.reshape(valid, (BLOCK_M * BLOCK_K,))
            for x0 in range(0, hidden, BLOCK_X):
                c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
                tile = _load_rows(y, flat_rows, src, valid, num_rows, hidden, x0, c, c_mask, SELECT, BLOCK_X)
                tile = tile.to(tl.float32)
                if SCALE:
                    tile = tile * scale[:, None]
                acc = tl.sum(tl.reshape(tile, (BLOCK_M, BLOCK_K, BLOCK_X)), axis=1)
                tl.store(out + dst[:, None] + c[None, :], acc.to(out.dtype.element_ty),
                         mask=in_tokens[:, None] & c_mask[None, :])
        else:
            for x0 in range(0, hidden, BLOCK_X):
                c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
                acc = tl.zeros((BLOCK_M, BLOCK_X), tl.float32)
                for k in tl.static_range(TOP_K):
                    slot = tokens * TOP_K + k
                    row = tl.load(slot_to_row + slot, mask=in_tokens, other=-1)
                    valid = in_tokens & (row >= 0) & (row < num_rows)
                    row = tl.where(valid, row, 0)  # clamped, not only masked (triton-ascend#2332)
                    src = _offsets(row, hidden, INT64)
                    tile = tl.load(y + src[:, None] + c[None, :], mask=valid[:, None] & c_mask[None, :], other=0)
                    tile = tile.to(tl.float32)
                    if SCALE:
                        tile = tile * tl.load(weights + slot, mask=valid, other=0).to(tl.float32)[:, None]
                    acc += tile
                tl.store(out + dst[:, None] + c[None, :], acc.to(out.dtype.element_ty),
                         mask=in_tokens[:, None] & c_mask[None, :])


@kernel
def _scatter_one(
    y, out, indices, bins, padded_bins, weights,
    num_positions, num_experts, num_rows, hidden, capacity,
    LAYOUT: tl.constexpr, SCALE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_X: tl.constexpr,
):
    # top_k == 1: every token has exactly one position, so position-major writes never collide
    # and no inverse map is needed (one launch). A dropped position writes its token's zeros.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    e, first, nblk, total, start, end, delta, kend = _walk(
        bins, padded_bins, capacity, num_experts, num_positions, LAYOUT, _POSITIONS, BLOCK_M, BLOCK_E)
    for blk in range(pid, total, npg):
        row, token, ok, valid = _position_rows(blk, m, indices, num_positions, num_rows, e, first, nblk, start,
                                               end, delta, kend, LAYOUT, BLOCK_M)
        token = tl.where(ok, token, num_positions)  # positions without a token: the spare row
        if SCALE:
            scale = tl.load(weights + tl.where(valid, token, 0), mask=valid, other=0).to(tl.float32)
        src = _offsets(row, hidden, INT64)
        dst = _offsets(token, hidden, INT64)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            tile = tl.load(y + src[:, None] + c[None, :], mask=valid[:, None] & c_mask[None, :], other=0)
            if SCALE:
                tile = _scaled(tile, scale, valid, out.dtype.element_ty)
            tl.store(out + dst[:, None] + c[None, :], tile, mask=c_mask[None, :])


@kernel
def _wgrad(
    y, grad, out, slot_to_row,
    num_slots, num_rows, hidden,
    TOP_K: tl.constexpr, INT64: tl.constexpr, SELECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, EVEN_X: tl.constexpr,
):
    # Slot-major: consecutive slots share a token, so each grad row is read once.
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    for blk in range(pid, tl.cdiv(num_slots, BLOCK_M), npg):
        slots = blk * BLOCK_M + m
        in_slots = slots < num_slots
        row = tl.load(slot_to_row + slots, mask=in_slots, other=-1)
        valid = in_slots & (row >= 0) & (row < num_rows)
        row = tl.where(valid, row, 0)  # clamped, not only masked (triton-ascend#2332)
        token = tl.where(valid, slots, 0) // TOP_K
        src = _offsets(row, hidden, INT64)
        gsrc = _offsets(token, hidden, INT64)
        acc = tl.zeros((BLOCK_M, BLOCK_X), tl.float32)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            a = _load_rows(y, row, src, valid, num_rows, hidden, x0, c, c_mask, SELECT, BLOCK_X).to(tl.float32)
            b = _load_rows(grad, token, gsrc, valid, num_slots // TOP_K, hidden, x0, c, c_mask, SELECT,
                           BLOCK_X).to(tl.float32)
            acc += a * b
        tl.store(out + slots, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=in_slots)


@kernel
def _wgrad_one(
    y, grad, out, indices, bins, padded_bins,
    num_positions, num_experts, num_rows, hidden, capacity,
    LAYOUT: tl.constexpr, INT64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_X: tl.constexpr,
):
    # top_k == 1, position-major: buffer rows are read in order, each slot is written once
    # (indices is a permutation) and no inverse map is needed (one launch). With top_k > 1 the
    # slot-major _wgrad is faster: position order would re-read each grad row top_k times from
    # memory (on an H200, fine-grained: 0.20 ms against 0.13 ms).
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    e, first, nblk, total, start, end, delta, kend = _walk(
        bins, padded_bins, capacity, num_experts, num_positions, LAYOUT, _POSITIONS, BLOCK_M, BLOCK_E)
    for blk in range(pid, total, npg):
        row, slot, ok, valid = _position_rows(blk, m, indices, num_positions, num_rows, e, first, nblk, start,
                                              end, delta, kend, LAYOUT, BLOCK_M)
        token = tl.where(valid, slot, 0)
        src = _offsets(row, hidden, INT64)
        gsrc = _offsets(token, hidden, INT64)
        acc = tl.zeros((BLOCK_M, BLOCK_X), tl.float32)
        for x0 in range(0, hidden, BLOCK_X):
            c, c_mask = _columns(x0, cols, hidden, EVEN_X, BLOCK_X)
            mask = valid[:, None] & c_mask[None, :]
            a = tl.load(y + src[:, None] + c[None, :], mask=mask, other=0).to(tl.float32)
            b = tl.load(grad + gsrc[:, None] + c[None, :], mask=mask, other=0).to(tl.float32)
            acc += a * b
        # Positions without a slot write to the spare element num_positions. The select after the
        # cast keeps the cast out of the per-element store loop (see _scaled).
        value = tl.where(valid, tl.sum(acc, axis=1).to(out.dtype.element_ty), 0)
        tl.store(out + tl.where(ok, slot, num_positions), value)


# --------------------------------------------------------------------------------------------
# Launchers. They take validated, contiguous tensors (see megablocks_ascend.validation) and
# never launch on empty work.
#
# Launch plans: a launcher derives its grid and constexprs (tile, grid, int32 or int64 offsets,
# the experts' vector width...) from the sizes, dtype and device of the call alone, and a training
# step makes the same few calls step after step. Each distinct call is planned once
# (``_planned``); later calls find the plan by those facts, with the grid override of the
# environment read on every call as part of the key. What remains per call is the output's
# allocation, the route-map lookup and the launch: a host-bound step pays for every microsecond
# above the launch (docs/notes/routing-preparation.md).

_PLANS: dict = {}
_MAX_PLANS = 4096  # distinct calls kept (a new batch size is a new call); past that, start over


def _planned(key, make):
    """The plan ``make()`` returns for ``key``, made on the first call with that key."""
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def clear_plans() -> None:
    """Forget every launch plan (for tests that change the device tables)."""
    _PLANS.clear()


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: a jit-callable function that unwraps constexprs on every host-side call
    # (~4-5 us each on a CPU, measured), and launchers call it on every launch.
    return -(-a // b)


def _walk_blocks(items: int, block_m: int, experts: int) -> int:
    """An upper bound on the blocks of a :func:`_walk` over ``items`` (each expert's last block may
    be partial): the work count that sizes the grid."""
    return _cdiv(items, block_m) + experts


def _needs_int64(*numels: int) -> bool:
    return max(numels) >= _INT32_LIMIT


def _tile(kind, dtype, hidden, device, tile, *, top_k=1, bins=None):
    """The launcher's tile: ``tile`` if given, else the device's. On an NPU it also depends on the
    expert count (``bins``) and, for the kernels that unroll their top_k slots (the token-major
    gather and scatter), on ``top_k``: the Unified Buffer plan grows with both (``devices.ub_bytes``)."""
    if tile is not None:
        return tile
    experts = bins.shape[0] if bins is not None else 1
    return devices.tile(kind, dtype, hidden, devices.target(device), top_k=top_k, num_experts=experts)


def _grid(device, work: int, num_programs):
    n = num_programs if num_programs is not None else devices.num_programs(device, work)
    return (max(1, min(n, work)),)


def _row_meta(t, hidden, **meta):
    """The constexprs of a kernel that moves rows in feature tiles of ``t``."""
    return dict(meta, BLOCK_M=t.block_m, BLOCK_X=t.block_x, EVEN_X=hidden % t.block_x == 0, num_warps=t.num_warps)


def _select(device, kind, meta) -> dict:
    """``meta`` with ``SELECT``: whether ``kind``'s gathered rows load through ``index_select_simd``
    (``devices.row_select``), where its offsets are int32 and its feature tiles whole."""
    return dict(meta, SELECT=devices.row_select(device, kind) and not meta["INT64"] and meta["EVEN_X"])


def gather_rows(x, indices, bins, padded_bins, weights, *, layout, num_rows, top_k,
                capacity=0, tile=None, num_programs=None):
    """``out[r] = x[slot(r) // top_k] * weights[slot(r)]`` for every buffer row ``r`` (0 for padding).

    Dropless rows are positions; the padded and binned layouts find each row's position in the row
    map (:func:`row_map`: the routing preparation's, or one launch), not by a search over the
    experts, so the tile is the same at every expert count."""
    tokens, hidden = x.shape
    device = x.device
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    if num_rows == 0 or hidden == 0:
        return out
    n = indices.shape[0]
    mapped = layout != DROPLESS
    row_pos = row_map(indices, bins, padded_bins, layout=layout, num_rows=num_rows, capacity=capacity,
                      num_programs=num_programs) if mapped else indices
    map_rows = row_pos.shape[0] if mapped else num_rows

    def plan():
        t = _tile("gather", x.dtype, hidden, device, tile)
        return _grid(device, _cdiv(num_rows, t.block_m), num_programs), _select(device, "gather", _row_meta(
            t, hidden, MAPPED=mapped, TOP_K=top_k, SCALE=weights is not None,
            INT64=_needs_int64(tokens * hidden, num_rows * hidden)))

    grid, meta = _planned(("gather", device, x.dtype, tokens, hidden, num_rows, mapped, top_k,
                           weights is None, tile, num_programs, envs.num_programs_override(), envs.row_loads()), plan)
    _gather.launch(grid, x, out, indices, row_pos, weights if weights is not None else x, num_rows, map_rows, n,
                   hidden, **meta)
    return out


def gather_tokens_rows(x, indices, bins, padded_bins, weights, *, layout, num_rows, top_k,
                       capacity=0, tile=None, num_programs=None):
    """:func:`gather_rows`' result, computed token-major: each token row is read once and written
    to its ``top_k`` rows (after :func:`route_map`); rows no assignment lands on are zeroed."""
    tokens, hidden = x.shape
    device = x.device
    # One spare row at the end takes the writes of dropped slots and padding (see _gather_tokens).
    buffer = torch.empty((num_rows + 1, hidden), dtype=x.dtype, device=device)
    out = buffer[:num_rows]
    if num_rows == 0 or hidden == 0:
        return out
    slot_to_row = route_map(indices, bins, padded_bins, layout=layout, capacity=capacity,
                            num_programs=num_programs)
    experts = bins.shape[0]

    def plan():
        t = _tile("gather_tokens", x.dtype, hidden, device, tile, top_k=top_k, bins=bins)
        walk = _walk_blocks(num_rows, t.block_m, experts) if layout != DROPLESS else 0
        return _grid(device, max(_cdiv(tokens, t.block_m), walk), num_programs), _row_meta(
            t, hidden, LAYOUT=layout, TOP_K=top_k, SCALE=weights is not None,
            INT64=_needs_int64(tokens * hidden, (num_rows + 1) * hidden), BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("gather_tokens", device, x.dtype, tokens, hidden, num_rows, experts, layout, top_k,
                           weights is None, tile, num_programs, envs.num_programs_override()), plan)
    _gather_tokens.launch(grid, x, buffer, slot_to_row, bins, padded_bins if padded_bins is not None else bins,
                          weights if weights is not None else x, tokens, num_rows, experts, hidden, capacity,
                          **meta)
    return out


def _gather_any(x, indices, bins, padded_bins, weights, *, layout, num_rows, top_k, capacity=0, **launch):
    """Buffer-row-major (:func:`gather_rows`: gathers token rows on load, stores whole sub-blocks)
    on targets that take contiguous stores (an NPU: ``devices.STORES``), and for the dropless layout
    where each token has one slot (no map needed: rows are positions); token-major
    (:func:`gather_tokens_rows`) otherwise, so that each token row is read once rather than
    ``top_k`` times (a token's rows lie far apart in the expert-sorted buffer, so re-reads miss the
    cache: on an H200 the fine-grained gather went from 2.5 to 3.4 TB/s), and a padded or binned
    gather of one slot per token takes the route map the scatter after it takes too, rather than a
    row map of its own."""
    token_major = not devices.contiguous_stores(x.device) and (top_k > 1 or layout != DROPLESS)
    launcher = gather_tokens_rows if token_major else gather_rows
    return launcher(x, indices, bins, padded_bins, weights, layout=layout, num_rows=num_rows, top_k=top_k,
                    capacity=capacity, **launch)


# Route maps, kept on the routing tensor they were computed from. One MegaBlocks layer step asks
# for the same map up to five times (forward gather and scatter, their backwards, the weight
# gradient) with the same ``indices`` tensor object (autograd hands saved inputs back as the same
# object), so later calls reuse the first map. It is kept under the rule of
# :mod:`megablocks_ascend.keeping` (on the object, not in a table keyed by data pointers; by the
# version counters and lengths of ``indices``, ``bins`` and ``padded_bins``; never on inference
# tensors or inside ``keeping.no_reuse``), one map per layout and capacity.
#
# Where the routing comes from the routing preparation (kernels/preparation.py), the map is
# written by the same launch that writes ``indices`` and ``bins`` and kept from the start
# (keep_route_map), so no routing call of the step launches anything to build it. A map is only
# ever used under the capture state it was made in: one made while a graph is being captured
# (only the preparation keeps those: its map and its ``indices`` are written by the same captured
# launch, so every replay rewrites both together) serves the captured calls after it, and one made
# outside a capture never serves a captured call, which records its own route-map launch instead:
# no map computed outside a capture crosses into one (a few us of device time per extra launch,
# no host time at replay).
_ROUTE_MAP_ATTR = "_megablocks_ascend_route_maps"
_route_map_token = object()  # replaced by clear_route_maps(); maps kept under another are stale


def clear_route_maps() -> None:
    """Forget every kept route map (each op then pays for its map: for timing single ops)."""
    global _route_map_token
    _route_map_token = object()


def route_map_keepable(indices) -> bool:
    """Whether a route map may be kept on ``indices`` for later calls (:func:`keeping.keepable`)."""
    return keeping.keepable(indices)


def _for(indices, bins, padded_bins):
    """What a route map is for, besides its layout and capacity (its key in :mod:`keeping`)."""
    return (indices.shape[0], bins.shape[0], None if padded_bins is None else padded_bins.shape[0], _route_map_token)


def _keep(indices, layout, capacity, bins, padded_bins, slot_to_row, captured, what):
    keeping.keep(indices, _ROUTE_MAP_ATTR, slot_to_row, what, (bins, padded_bins), captured, (layout, capacity))


def keep_route_map(indices, bins, padded_bins, slot_to_row, *, layout, capacity=0) -> None:
    """Keep ``slot_to_row``, written by the launch that wrote ``indices`` and ``bins`` (the routing
    preparation), as the route map of ``layout`` for the routing calls that follow; the caller
    checked :func:`route_map_keepable`. Kept under the capture state of the moment (see above)."""
    _keep(indices, layout, capacity, bins, padded_bins, slot_to_row, keeping.capturing_on(indices),
          _for(indices, bins, padded_bins))


def route_map(indices, bins, padded_bins, *, layout, capacity=0, block_m=None, num_programs=None):
    """``slot_to_row[a]``: the buffer row of assignment slot ``a``, or -1 where it was dropped.

    Found on ``indices`` when the routing preparation or an earlier call of the step made it for this
    ``bins``/``padded_bins`` (see above); else computed (one launch) and kept. Must not be modified."""
    if not keeping.keepable(indices, bins, padded_bins):
        return _compute_route_map(indices, bins, padded_bins, layout=layout, capacity=capacity, block_m=block_m,
                                  num_programs=num_programs)
    captured = keeping.capturing_on(indices)
    what = _for(indices, bins, padded_bins)
    slot_to_row = keeping.kept(indices, _ROUTE_MAP_ATTR, what, (bins, padded_bins), captured, (layout, capacity))
    if slot_to_row is None:
        slot_to_row = _compute_route_map(indices, bins, padded_bins, layout=layout, capacity=capacity,
                                         block_m=block_m, num_programs=num_programs)
        if not captured:  # a captured call keeps nothing it computed (see above)
            _keep(indices, layout, capacity, bins, padded_bins, slot_to_row, False, what)
    return slot_to_row


ROUTE_MAP_BLOCK_M = {"cpu": 64}  # positions per block; 128 elsewhere


def _compute_route_map(indices, bins, padded_bins, *, layout, capacity, block_m, num_programs):
    n = indices.shape[0]
    device = indices.device
    slot_to_row = torch.empty(n, dtype=torch.int32, device=device)
    if n == 0:
        return slot_to_row
    experts = bins.shape[0]

    def plan():
        bm = block_m if block_m is not None else ROUTE_MAP_BLOCK_M.get(device.type, 128)
        return _grid(device, _walk_blocks(n, bm, experts), num_programs), dict(
            LAYOUT=layout, BLOCK_M=bm, BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("route_map", device, n, experts, layout, block_m, num_programs,
                           envs.num_programs_override()), plan)
    _route_map.launch(grid, indices, bins, padded_bins if padded_bins is not None else bins, slot_to_row,
                      n, experts, capacity, **meta)
    return slot_to_row


# Row maps, for the buffer-row-major gather of the padded and binned layouts: ``row_pos[r]``, the
# sorted position feeding buffer row ``r``, or -1 (padding, unused capacity, rows past the last
# segment). Kept on ``indices`` under the same rule as the route maps (above), one per layout and
# capacity; the routing preparation writes and keeps the map of the layout it was asked for on
# the targets that take contiguous stores (kernels/preparation.py). Its map has a row for every
# row a gather of that routing can have (``padded_rows_bound``, ``experts * capacity``): "whole",
# it serves a gather of any row count (rows past it are padding). A map computed here has the rows
# of the call that asked for it, and serves calls of as many rows or fewer.
_ROW_MAP_ATTR = "_megablocks_ascend_row_maps"


def padded_rows_bound(num_positions: int, num_experts: int, block: int) -> int:
    """The most rows a padded layout of ``num_positions`` positions over ``num_experts`` experts,
    each segment rounded up to a multiple of ``block``, can have: ``padded_bins[-1]`` is at most this."""
    return num_positions + num_experts * (max(int(block), 1) - 1)


def keep_row_map(indices, bins, padded_bins, row_pos, *, layout, capacity=0) -> None:
    """Keep ``row_pos``, a whole row map written by the launch that wrote ``indices`` and ``bins``
    (the routing preparation), for the gathers that follow (see :func:`keep_route_map`)."""
    keeping.keep(indices, _ROW_MAP_ATTR, (row_pos, True), _for(indices, bins, padded_bins), (bins, padded_bins),
                 keeping.capturing_on(indices), (layout, capacity))


def row_map(indices, bins, padded_bins, *, layout, num_rows, capacity=0, num_programs=None):
    """``row_pos`` of at least ``num_rows`` rows, or a whole one (see above): found on ``indices``, else
    computed (one launch of :func:`_row_map`) and kept. Must not be modified."""
    if not keeping.keepable(indices, bins, padded_bins):
        return _compute_row_map(bins, padded_bins, layout=layout, num_rows=num_rows, capacity=capacity,
                                num_programs=num_programs)
    captured = keeping.capturing_on(indices)
    what = _for(indices, bins, padded_bins)
    found = keeping.kept(indices, _ROW_MAP_ATTR, what, (bins, padded_bins), captured, (layout, capacity))
    if found is not None and (found[1] or found[0].shape[0] >= num_rows):
        return found[0]
    row_pos = _compute_row_map(bins, padded_bins, layout=layout, num_rows=num_rows, capacity=capacity,
                               num_programs=num_programs)
    if not captured:  # a captured call keeps nothing it computed (see the route maps)
        keeping.keep(indices, _ROW_MAP_ATTR, (row_pos, False), what, (bins, padded_bins), False, (layout, capacity))
    return row_pos


def _compute_row_map(bins, padded_bins, *, layout, num_rows, capacity, num_programs, block_m=None):
    device = bins.device
    row_pos = torch.empty(num_rows, dtype=torch.int32, device=device)
    if num_rows == 0:
        return row_pos
    experts = bins.shape[0]

    def plan():
        bm = block_m if block_m is not None else ROUTE_MAP_BLOCK_M.get(device.type, 128)
        return _grid(device, _walk_blocks(num_rows, bm, experts), num_programs), dict(
            LAYOUT=layout, BLOCK_M=bm, BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("row_map", device, num_rows, experts, layout, block_m, num_programs,
                           envs.num_programs_override()), plan)
    _row_map.launch(grid, bins, padded_bins if padded_bins is not None else bins, row_pos, num_rows, experts,
                    capacity, **meta)
    return row_pos


def scatter_rows(y, slot_to_row, weights, *, num_tokens, top_k, tile=None, num_programs=None):
    """``out[t] = sum_k weights[t*top_k+k] * y[slot_to_row[t*top_k+k]]`` (float32 sum, one write)."""
    hidden = y.shape[-1]
    y = y.reshape(-1, hidden)
    rows = y.shape[0]
    device = y.device
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=device)
    if num_tokens == 0 or hidden == 0:
        return out

    def plan():
        t = _tile("scatter", y.dtype, hidden, device, tile, top_k=devices.block_k(top_k))  # its slot rows
        flat = devices.contiguous_stores(device)
        meta = _select(device, "scatter", _row_meta(
            t, hidden, TOP_K=top_k, SCALE=weights is not None,
            INT64=_needs_int64(rows * hidden, num_tokens * hidden), FLAT=flat, BLOCK_K=devices.block_k(top_k)))
        meta["SELECT"] = meta["SELECT"] and flat  # (the flat form's rows; CUDA's per-slot loads are masked)
        return _grid(device, _cdiv(num_tokens, t.block_m), num_programs), meta

    grid, meta = _planned(("scatter", device, y.dtype, rows, hidden, num_tokens, top_k, weights is None, tile,
                           num_programs, envs.num_programs_override(), envs.stores(), envs.row_loads()), plan)
    _scatter.launch(grid, y, out, slot_to_row, weights if weights is not None else y, num_tokens, rows, hidden,
                    **meta)
    return out


def scatter_one_rows(y, indices, bins, padded_bins, weights, *, layout, capacity=0, tile=None,
                     num_programs=None):
    """top_k == 1: ``out[indices[p]] = weights[indices[p]] * y[row(p)]`` (0 where dropped), one launch."""
    hidden = y.shape[-1]
    y = y.reshape(-1, hidden)
    rows = y.shape[0]
    n = indices.shape[0]
    device = y.device
    buffer = torch.empty((n + 1, hidden), dtype=y.dtype, device=device)  # + the spare row
    out = buffer[:n]
    if n == 0 or hidden == 0:
        return out
    experts = bins.shape[0]

    def plan():
        t = _tile("scatter_one", y.dtype, hidden, device, tile, bins=bins)
        return _grid(device, _walk_blocks(n, t.block_m, experts), num_programs), _row_meta(
            t, hidden, LAYOUT=layout, SCALE=weights is not None,
            INT64=_needs_int64(rows * hidden, (n + 1) * hidden), BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("scatter_one", device, y.dtype, rows, hidden, n, experts, layout, weights is None,
                           tile, num_programs, envs.num_programs_override()), plan)
    _scatter_one.launch(grid, y, buffer, indices, bins, padded_bins if padded_bins is not None else bins,
                        weights if weights is not None else y, n, experts, rows, hidden, capacity, **meta)
    return out


def _scatter_any(y, indices, bins, padded_bins, weights, *, layout, top_k, capacity=0, **launch):
    """Token-major after the inverse map (:func:`route_map`, :func:`scatter_rows`: gathers a token's
    rows on load, stores whole sub-blocks of tokens); position-major in one launch when each token
    has one slot on targets that take scattered stores (:func:`scatter_one_rows`: CUDA)."""
    if top_k == 1 and not devices.contiguous_stores(y.device):
        return scatter_one_rows(y, indices, bins, padded_bins, weights, layout=layout, capacity=capacity,
                                **launch)
    slot_to_row = route_map(indices, bins, padded_bins, layout=layout, capacity=capacity,
                            num_programs=launch.get("num_programs"))
    return scatter_rows(y, slot_to_row, weights, num_tokens=indices.shape[0] // top_k, top_k=top_k, **launch)


def wgrad_rows(y, grad, slot_to_row, *, top_k, tile=None, num_programs=None):
    """``out[a] = <y[slot_to_row[a]], grad[a // top_k]>`` in float32 (0 where dropped)."""
    hidden = y.shape[-1]
    y = y.reshape(-1, hidden)
    rows = y.shape[0]
    n = slot_to_row.shape[0]
    device = y.device
    out = torch.empty(n, dtype=y.dtype, device=device)
    if n == 0:
        return out
    if hidden == 0:
        return out.zero_()
    grad_numel = grad.numel()

    def plan():
        t = _tile("wgrad", y.dtype, hidden, device, tile)
        return _grid(device, _cdiv(n, t.block_m), num_programs), _select(device, "wgrad", _row_meta(
            t, hidden, TOP_K=top_k, INT64=_needs_int64(rows * hidden, grad_numel)))

    grid, meta = _planned(("wgrad", device, y.dtype, rows, hidden, n, grad_numel, top_k, tile, num_programs,
                           envs.num_programs_override(), envs.row_loads()), plan)
    _wgrad.launch(grid, y, grad, out, slot_to_row, n, rows, hidden, **meta)
    return out


def wgrad_one_rows(y, grad, indices, bins, padded_bins, *, layout, capacity=0, tile=None, num_programs=None):
    """top_k == 1: ``out[indices[p]] = <y[row(p)], grad[indices[p]]>`` in float32 (0 where dropped)."""
    hidden = y.shape[-1]
    y = y.reshape(-1, hidden)
    rows = y.shape[0]
    n = indices.shape[0]
    device = y.device
    buffer = torch.empty(n + 1, dtype=y.dtype, device=device)  # + the spare element
    out = buffer[:n]
    if n == 0:
        return out
    if hidden == 0:
        return out.zero_()
    experts = bins.shape[0]
    grad_numel = grad.numel()

    def plan():
        t = _tile("wgrad" if layout == DROPLESS else "wgrad_walk", y.dtype, hidden, device, tile, bins=bins)
        return _grid(device, _walk_blocks(n, t.block_m, experts), num_programs), _row_meta(
            t, hidden, LAYOUT=layout, INT64=_needs_int64(rows * hidden, grad_numel), BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("wgrad_one", device, y.dtype, rows, hidden, n, grad_numel, experts, layout, tile,
                           num_programs, envs.num_programs_override()), plan)
    _wgrad_one.launch(grid, y, grad, buffer, indices, bins, padded_bins if padded_bins is not None else bins,
                      n, experts, rows, hidden, capacity, **meta)
    return out


def _wgrad_any(y, grad, indices, bins, padded_bins, *, layout, top_k, capacity=0, **launch):
    """Slot-major after the inverse map (:func:`route_map`, :func:`wgrad_rows`: stores whole
    sub-blocks of slots); position-major in one launch when each token has one slot on targets that
    take scattered stores (:func:`wgrad_one_rows`: CUDA)."""
    if top_k == 1 and not devices.contiguous_stores(y.device):
        return wgrad_one_rows(y, grad, indices, bins, padded_bins, layout=layout, capacity=capacity, **launch)
    slot_to_row = route_map(indices, bins, padded_bins, layout=layout, capacity=capacity,
                            num_programs=launch.get("num_programs"))
    return wgrad_rows(y, grad, slot_to_row, top_k=top_k, **launch)


# --------------------------------------------------------------------------------------------
# MegaBlocks' kernel entry points (megablocks.backend.kernels), same signatures and results.


def binned_gather(x, indices, weights, bins, expert_capacity, top_k, **launch):
    out = _gather_any(x, indices, bins, None, weights, layout=BINNED, top_k=top_k,
                      num_rows=bins.shape[0] * expert_capacity, capacity=expert_capacity, **launch)
    return out.view(bins.shape[0], expert_capacity, x.shape[1])


def binned_scatter(x, indices, weights, bins, top_k, **launch):
    return _scatter_any(x, indices, bins, None, weights, layout=BINNED, top_k=top_k, capacity=x.shape[1],
                        **launch)


def binned_scatter_wgrad(x, grad, indices, bins, top_k, **launch):
    return _wgrad_any(x, grad, indices, bins, None, layout=BINNED, top_k=top_k, capacity=x.shape[1],
                           **launch)


def gather(x, indices, bin_ids, weights, bins, top_k, **launch):
    return _gather_any(x, indices, bins, None, weights, layout=DROPLESS, num_rows=indices.shape[0], top_k=top_k,
                       **launch)


def scatter(x, indices, bin_ids, weights, bins, top_k, **launch):
    return _scatter_any(x, indices, bins, None, weights, layout=DROPLESS, top_k=top_k, **launch)


def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k, **launch):
    return _wgrad_any(x, grad, indices, bins, None, layout=DROPLESS, top_k=top_k, **launch)


def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, num_rows=None, **launch):
    """MegaBlocks' ``padded_gather``; with ``num_rows`` (at least ``padded_bins[-1]``: the sparse
    dMoE's static size) the output has that many rows, those past ``padded_bins[-1]`` zero, and
    nothing is read on the host. Without it the row count is ``padded_bins[-1]``, read on the host
    (upstream's semantics: a sync)."""
    if num_rows is None:
        if top_k > 1 and indices.shape[0] and padded_bins.numel() and not devices.contiguous_stores(x.device):
            # Launch the route map before the host waits for the output size; the token-major gather
            # below finds it in the route-map cache, so only one launch follows the sync.
            route_map(indices, bins, padded_bins, layout=PADDED, num_programs=launch.get("num_programs"))
        num_rows = int(padded_bins[-1].item()) if padded_bins.numel() else 0
    return _gather_any(x, indices, bins, padded_bins, weights, layout=PADDED, top_k=top_k,
                       num_rows=num_rows, **launch)


def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k, **launch):
    return _scatter_any(x, indices, bins, padded_bins, weights, layout=PADDED, top_k=top_k, **launch)


def padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k, **launch):
    return _wgrad_any(x, grad, indices, bins, padded_bins, layout=PADDED, top_k=top_k, **launch)
