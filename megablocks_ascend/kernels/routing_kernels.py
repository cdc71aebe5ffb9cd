"""The routing ops' device code: the Triton kernels for the three MegaBlocks layouts (binned,
dropless and padded) and the jit helpers they share. Their launchers, launch plans, route-map
cache and MegaBlocks' entry points are host code, in :mod:`~megablocks_ascend.kernels.routing`.

One idea: the routing kernels, which share one vocabulary and one walk over the experts' segments
(below); the compile gate lowers this module, and its census's digests are of its code
(``table.source_digest``).

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
tensor has more than ``launch.INT32_MAX`` elements, in which case the launcher specialises the
kernel with ``INT64=True``. Masks keep every access inside its tensor, whatever the routing says.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megablocks_ascend import compat
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

