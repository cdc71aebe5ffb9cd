"""Routing preparation: the router's expert ids -> everything the routing kernels take, in two launches.

MegaBlocks prepares a step's routing with a radix sort of the expert ids (``ops.sort``: indices
and bin_ids), a histogram (``tokens_per_expert``), inclusive cumsums (``bins``; for the sparse
dMoE also ``ops.round_up`` and a cumsum: ``padded_bins``), and our token-major gathers and
scatters then invert the sort (the route map). That is a dozen launches or more on a GPU (CUB's
radix sort alone is several). Expert ids are small integers, so a **counting sort** does all of it
in two:

``_count``  each program counts the keys of its own contiguous chunk of the items: one
            histogram row per program (``counts[p, e]``), plus the number of items whose key is
            not a valid one (``counts[P * BLOCK_E + p]``).
``_place``  each program reads every program's row (``P x BLOCK_E`` numbers), which gives the
            totals (``tokens_per_expert``; their inclusive scan is ``bins``) and how many items
            of each key the programs before it hold; then it walks its chunk in blocks of
            ``BLOCK_M`` items, in order, and puts item ``i`` of key ``e`` at position
            ``bins[e - 1] + (items of key e before this program) + (earlier items of key e in
            this program)``. That is where a stable sort puts it: ``indices`` lists each expert's
            assignments in increasing order, exactly what ``ops.sort`` gives. Program 0 writes
            ``tokens_per_expert``, ``bins`` and ``padded_bins``; every program writes the route map
            entries of its own items (``slot_to_row[i]``, contiguous stores: the slot is the item).

Nothing decides an order through atomics or timing: each position is a sum of counts, so the
result is the same on every run and every device, and it equals a stable sort's. Items whose key is
not a valid one (only with ``MEGABLOCKS_ASCEND_CHECKS=0`` and a malformed router output: an id
outside ``[0, num_experts)``) are counted in no expert and placed after every valid item, in order,
so ``indices`` stays a permutation and nothing is written out of bounds; their route-map entry is
-1 (dropped).

Shape on the device: a 1-D grid of ``P`` programs (vector cores on an NPU, SMs on CUDA), each
looping over its chunk in blocks of ``BLOCK_M`` items; every per-key quantity is a ``BLOCK_E``-wide
vector and every block a one-hot tile of ``BLOCK_M`` items by ``BLOCK_E`` keys (which key each
item has; on an NPU with the keys along its last axis, ``_hit``). An
item's position is its key's cursor picked from the tile (``_pick``) plus its rank among the
block's items of that key (a scan of the tile along the items), so the kernels use only
element-wise ops, reductions and scans along an axis. The tile work is float32, not int32:
compiled for an A2 vector core (``bishengir-compile``, docs/notes/routing-preparation.md), an
int32 multiply-and-reduce over a ``[128, 32]`` tile needed 521 KiB of the 192 KiB Unified Buffer
and the float32 one 123 KiB; float32 is exact here (0/1 times values below 2**16, sums of one
term; ranks below 2**24). Keys are compared as float32 too: on Ascend's vector units an int32
compare runs as scalar code (triton-ascend's performance guide). Offsets are int32 (the
number of items is below 2**31, which validation checks).

The same two kernels serve the ``megablocks_ops`` stand-in's ``sort`` (keys: a value's low
``end_bit`` bits, ``key_mask``) and ``histogram`` (``_place`` with ``PLACE=False``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megablocks_ascend import devices
from megablocks_ascend.compat import kernel
from megablocks_ascend.kernels import routing
from megablocks_ascend.kernels.launch import cdiv
from megablocks_ascend.kernels.scan import cumsum

NO_ROUTE = -1  # ROUTE: no route map; else the layout of the one to write (routing.DROPLESS, ...)
_DROPLESS, _PADDED = tl.constexpr(routing.DROPLESS), tl.constexpr(routing.PADDED)
# PLACE: what _place writes besides the counts: nothing (the histogram), the routing preparation
# (bin_ids are expert ids, written in position order), or a sort (bin_ids are the sorted values).
HISTOGRAM, ROUTING, SORT = 0, 1, 2
_HISTOGRAM, _ROUTING, _SORT = tl.constexpr(HISTOGRAM), tl.constexpr(ROUTING), tl.constexpr(SORT)


@triton.jit
def _keys(keys, items, inside, num_keys, key_mask):
    """``(raw, key, valid)`` of ``items``: the stored value, its key (its low 32 bits ``& key_mask``,
    int32) and whether the key is one of ``0 .. num_keys - 1`` (False outside ``inside``). The
    range test is made on float32 copies (exact: the keys that pass are below 2**24), and an int64
    value passes only if it fits int32 (its float32 copy equals its key's): no int64 or int32
    vector compare (see the module docstring)."""
    raw = tl.load(keys + items, mask=inside, other=0)
    key = raw.to(tl.int32) & key_mask
    key_f = key.to(tl.float32)
    valid = inside & (key_f >= 0) & (key_f < num_keys)
    if keys.dtype.element_ty == tl.int64:
        valid = valid & (raw.to(tl.float32) == key_f)
    return raw, key, valid


@triton.jit
def _scan(v, BLOCK: tl.constexpr, NPU_FORM: tl.constexpr):
    """The inclusive prefix sum of a vector: in vector operations on an NPU (kernels/scan.py),
    ``tl.cumsum`` elsewhere (a warp-level scan on CUDA)."""
    if NPU_FORM:
        out = cumsum(v, BLOCK)
    else:
        out = tl.cumsum(v, axis=0)
    return out


@triton.jit
def _hit(key, valid, e_f, NPU_FORM: tl.constexpr):
    """The block's one-hot, float32: 1 where item ``m`` has key ``e``, else 0 (an item without a
    valid key: 0 everywhere). On an NPU ``[BLOCK_M, BLOCK_E]``, the keys along the last axis: an
    elementwise op on a tile whose last axis is shorter than a 32-byte block lowers, through
    bishengir-compile 1.2.0, to a loop of one small vector op per row (at 1024 experts, 4 items a
    block: two 1024-iteration loops of 4-element compares and selects per block,
    docs/notes/npu-census.md). On CUDA ``[BLOCK_E, BLOCK_M]``, whose scans along the items run within
    a warp (on an H200 the transposed tile made the preparation 1.1-1.5x slower)."""
    k = tl.where(valid, key, -1).to(tl.float32)
    if NPU_FORM:
        hit = tl.where(k[:, None] == e_f[None, :], 1.0, 0.0)
    else:
        hit = tl.where(e_f[:, None] == k[None, :], 1.0, 0.0)
    return hit


@triton.jit
def _rank(hit, NPU_FORM: tl.constexpr):
    """Each item's rank among the block's items of its key, from :func:`_hit`'s one-hot: a scan of the
    one-hot along the items (float32 is exact, counts are at most BLOCK_M). On an NPU along the
    tile's first axis (a vector scan there; along the last axis it is a scalar loop over every
    element); on CUDA along its last axis."""
    if NPU_FORM:
        rank = tl.sum(hit * tl.cumsum(hit, axis=0), axis=1).to(tl.int32) - 1
    else:
        rank = tl.sum(hit * tl.cumsum(hit, axis=1), axis=0).to(tl.int32) - 1
    return rank


@triton.jit
def _tally(hit, NPU_FORM: tl.constexpr):
    """The block's items of each key (int32, ``[BLOCK_E]``), from :func:`_hit`'s one-hot."""
    if NPU_FORM:
        out = tl.sum(hit, axis=0).to(tl.int32)
    else:
        out = tl.sum(hit, axis=1).to(tl.int32)
    return out


@triton.jit
def _pick(hit, v, NPU_FORM: tl.constexpr):
    """``v[key of m]`` for each item ``m`` (0 for an item without a valid key): :func:`_hit`'s
    one-hot times ``v``, summed over the keys. In float32, whose products and sums of one term are
    exact below 2**24, so ``v`` (int32) goes in two halves of 16 bits."""
    hi = (v >> 16).to(tl.float32)
    lo = (v & 65535).to(tl.float32)
    if NPU_FORM:
        out = (tl.sum(hit * hi[None, :], axis=1).to(tl.int32) << 16) + tl.sum(hit * lo[None, :], axis=1).to(tl.int32)
    else:
        out = (tl.sum(hit * hi[:, None], axis=0).to(tl.int32) << 16) + tl.sum(hit * lo[:, None], axis=0).to(tl.int32)
    return out


@triton.jit
def _below(v, bound):
    """1 where ``v < bound``, else 0 (int32; both within int32 and their difference too): the sign
    bit of ``v - bound``. A compare whose result is broadcast along another axis lowered, through
    bishengir-compile 1.2.0, to one single-element vector compare per row."""
    return -((v - bound) >> 31)


@triton.jit
def _chunk(pid, chunk, num_items):
    begin = pid * chunk
    return begin, tl.minimum(begin + chunk, num_items)


@kernel
def _count(
    keys, counts,
    num_items, num_keys, key_mask, chunk, table_rows,
    NPU_FORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    e = tl.arange(0, BLOCK_E)
    begin, end = _chunk(pid, chunk, num_items)
    bad = tl.zeros((BLOCK_M,), tl.int32)
    if NPU_FORM:
        # The keys in chunks of CHUNK: a [BLOCK_M, CHUNK] one-hot per chunk, its tally added to row c
        # of a [BLOCK_E / CHUNK, CHUNK] table. The block of items is the same at every key count, so
        # its per-block costs (the keys' load and its handshakes) do not grow per item with the
        # experts (a [BLOCK_M, BLOCK_E] one-hot of 4096 elements took 16 items a block at 256
        # experts: docs/notes/many-experts.md). The table's chunk numbers are a whole tile (no
        # compare broadcast along an axis: see _below).
        cc = tl.arange(0, CHUNK)
        rows_f = (tl.arange(0, BLOCK_E // CHUNK)[:, None] + cc[None, :] * 0).to(tl.float32)
        table = tl.zeros((BLOCK_E // CHUNK, CHUNK), tl.float32)
        for m0 in range(begin, end, BLOCK_M):
            items = m0 + m
            inside = items < end
            _, key, valid = _keys(keys, items, inside, num_keys, key_mask)
            k = tl.where(valid, key, -1).to(tl.float32)
            for c in range(0, BLOCK_E // CHUNK):
                keys_c = (c * CHUNK + cc).to(tl.float32)
                tally = tl.sum(tl.where(k[:, None] == keys_c[None, :], 1.0, 0.0), axis=0)
                table += tl.where(rows_f == c, tally[None, :], 0.0)
            bad += inside.to(tl.int32) - valid.to(tl.int32)  # (valid implies inside)
        acc = tl.reshape(table, (BLOCK_E,)).to(tl.int32)
    else:
        e_f = e.to(tl.float32)
        acc = tl.zeros((BLOCK_E,), tl.int32)
        for m0 in range(begin, end, BLOCK_M):
            items = m0 + m
            inside = items < end
            _, key, valid = _keys(keys, items, inside, num_keys, key_mask)
            acc += _tally(_hit(key, valid, e_f, NPU_FORM), NPU_FORM)
            bad += inside.to(tl.int32) - valid.to(tl.int32)  # (valid implies inside)
    tl.store(counts + pid * BLOCK_E + e, acc)
    tl.store(counts + table_rows * BLOCK_E + pid, tl.sum(bad, axis=0))


@kernel
def _place(
    keys, counts, indices, bin_ids, tokens_per_expert, bins, padded_bins, slot_to_row,
    num_items, num_keys, key_mask, chunk, table_rows, block, capacity,
    PLACE: tl.constexpr, PADDED: tl.constexpr, ROUTE: tl.constexpr, NPU_FORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    e = tl.arange(0, BLOCK_E)
    e_f = e.to(tl.float32)
    p = tl.arange(0, BLOCK_P)
    # Every program's histogram row: the totals, and what the programs before this one hold.
    total = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    bad_before = tl.zeros((BLOCK_P,), tl.int32)
    for q0 in range(0, npg, BLOCK_P):
        q = q0 + p
        # The table has table_rows >= npg rows, a multiple of BLOCK_P (the launcher's), so whole
        # [BLOCK_P, BLOCK_E] tiles are read unmasked and the rows past the programs are multiplied
        # by 0: a row mask (or a select) broadcast along the keys lowers, on an NPU, to one small
        # vector op per row.
        rows = tl.load(counts + q[:, None] * BLOCK_E + e[None, :])
        live = _below(q, npg)
        earlier = _below(q, pid)
        total += tl.sum(rows * live[:, None], axis=0)
        before += tl.sum(rows * earlier[:, None], axis=0)
        if PLACE != _HISTOGRAM:  # (only the placement needs them)
            bad_before += tl.load(counts + table_rows * BLOCK_E + q) * earlier
    ends = _scan(total, BLOCK_E, NPU_FORM)  # inclusive: bins
    starts = ends - total
    if PADDED or ROUTE == _PADDED:  # (the launcher never asks for a padded map without PADDED)
        padded = (total + block - 1) // block * block
        padded_ends = _scan(padded, BLOCK_E, NPU_FORM)
    if pid == 0:
        e_mask = e < num_keys
        tl.store(tokens_per_expert + e, total, mask=e_mask)
        tl.store(bins + e, ends, mask=e_mask)
        if PADDED:
            tl.store(padded_bins + e, padded_ends, mask=e_mask)
    if PLACE != _HISTOGRAM:
        begin, end = _chunk(pid, chunk, num_items)
        cursor = starts + before  # the position of this program's next item of each key
        bad_cursor = tl.sum(total, axis=0) + tl.sum(bad_before, axis=0)  # invalid keys: after all valid
        if ROUTE == _PADDED:
            shift = padded_ends - padded - starts  # a position of key e + shift[e]: its buffer row
        for m0 in range(begin, end, BLOCK_M):
            items = m0 + m
            inside = items < end
            raw, key, valid = _keys(keys, items, inside, num_keys, key_mask)
            hit = _hit(key, valid, e_f, NPU_FORM)
            rank = _rank(hit, NPU_FORM)
            pos = _pick(hit, cursor, NPU_FORM) + rank
            bad = inside.to(tl.int32) - valid.to(tl.int32)  # items without a valid key
            pos = tl.where(valid, pos, bad_cursor + _scan(bad, BLOCK_M, NPU_FORM) - bad)
            # Positions are sums of counts of these same keys, so they lie in [0, num_items); the
            # mask keeps that true even if the keys changed between the two launches.
            ok = inside & (pos >= 0) & (pos < num_items)
            pos = tl.where(ok, pos, 0)
            # The one store to computed positions on an NPU (a sort's): one element at a time there.
            tl.store(indices + pos, items.to(indices.dtype.element_ty), mask=ok)
            if PLACE == _SORT:  # the sorted values themselves (they may have bits above the key's)
                tl.store(bin_ids + pos, raw.to(bin_ids.dtype.element_ty), mask=ok)
            elif PLACE == _ROUTING and not NPU_FORM:  # (on an NPU: in position order, below)
                tl.store(bin_ids + pos, tl.where(valid, key, num_keys).to(bin_ids.dtype.element_ty), mask=ok)
            if ROUTE >= 0:
                if ROUTE == _DROPLESS:
                    row = pos
                elif ROUTE == _PADDED:
                    row = pos + _pick(hit, shift, NPU_FORM)
                else:  # binned: the first `capacity` positions of each expert are kept
                    offset = _pick(hit, cursor - starts, NPU_FORM) + rank
                    row = tl.where(offset < capacity, key * capacity + offset, -1)
                tl.store(slot_to_row + items, tl.where(valid & ok, row, -1), mask=inside)
            cursor += _tally(hit, NPU_FORM)
            bad_cursor += tl.sum(bad, axis=0)
        if PLACE == _ROUTING and NPU_FORM:
            # bin_ids written in position order, this program's share of the positions: the key
            # whose segment holds position p, i.e. how many segments end at or before p (num_keys
            # for the invalid ones, which lie after every segment). p - ends[e] < 0 is read off
            # its sign bit: no integer compare (scalar code on an A2 vector unit), and no mask
            # broadcast along the positions (a row-by-row select there): the lanes past the keys
            # end at 2**31 - 1, which no position reaches.
            last = tl.where(e < num_keys, ends, 2147483647)
            for m0 in range(begin, end, BLOCK_M):
                positions = m0 + m
                seg = tl.sum(((positions[:, None] - last[None, :]) >> 31) + 1, axis=1)
                tl.store(bin_ids + positions, seg.to(bin_ids.dtype.element_ty), mask=positions < end)


# --------------------------------------------------------------------------------------------
# Launchers. They take validated tensors (megablocks_ascend.validation.check_preparation).


def _grid(device, n: int, block_m: int, num_programs):
    """``(programs, chunk)``: the grid of both launches and the items per program (a multiple of
    ``block_m``); no program is empty."""
    work = cdiv(n, block_m)
    programs = num_programs if num_programs is not None else devices.num_programs(device, work, programs_per_sm=1)
    programs = max(1, min(programs, work))
    chunk = cdiv(work, programs) * block_m
    return cdiv(n, chunk), chunk


def _launch(keys, num_keys, key_mask, *, place=HISTOGRAM, indices=None, bin_ids=None, block=0, route=NO_ROUTE,
            capacity=0, tile=None, num_programs=None, npu_form=None):
    """Both launches over the flat ``keys``; returns ``(tokens_per_expert, bins, padded_bins,
    slot_to_row, row_pos)`` and, unless ``place`` is ``HISTOGRAM``, fills ``indices`` and ``bin_ids``
    (``ROUTING``: each position's expert; ``SORT``: each position's value). ``row_pos`` (the padded or
    binned route's row map, :func:`routing.row_map`) is made in the NPU form only, where the
    buffer-row-major gather reads it, by a third launch (:func:`_row_map_of`); None elsewhere."""
    n = keys.shape[0]
    device = keys.device
    target = devices.target(device)
    t = tile if tile is not None else devices.prep_tile(num_keys, target)
    if npu_form is None:
        npu_form = devices.PREP_NPU_FORM[target]
    block_e = devices.block_e(num_keys)
    count_block, key_chunk = devices.prep_count_tile(t, block_e)
    tokens_per_expert = torch.empty(num_keys, dtype=torch.int32, device=device)
    bins = torch.empty(num_keys, dtype=torch.int32, device=device)
    padded_bins = torch.empty(num_keys, dtype=torch.int32, device=device) if block else None
    slot_to_row = torch.empty(n, dtype=torch.int32, device=device) if route != NO_ROUTE else None
    if n == 0:
        for out in (tokens_per_expert, bins, padded_bins):
            if out is not None:
                out.zero_()
        return tokens_per_expert, bins, padded_bins, slot_to_row, _row_map_of(bins, padded_bins, n, route, capacity, block,
                                                                          npu_form and place != HISTOGRAM, num_programs)
    # Both launches cut the items into the same chunks, whole blocks of both kernels.
    programs, chunk = _grid(device, n, max(t.block_m, count_block), num_programs)
    # One histogram row per program, then one count of invalid keys per program; rows up to a
    # multiple of BLOCK_P (read in whole tiles by _place, never written: multiplied by 0 there).
    block_p = devices.prep_block_p(programs, block_e)
    table_rows = cdiv(programs, block_p) * block_p
    counts = torch.empty(table_rows * (block_e + 1), dtype=torch.int32, device=device)
    _count.launch((programs,), keys, counts, n, num_keys, key_mask, chunk, table_rows, NPU_FORM=npu_form,
                  BLOCK_M=count_block if npu_form else t.block_m, BLOCK_E=block_e, CHUNK=key_chunk,
                  num_warps=t.num_warps)
    placed = place != HISTOGRAM
    _place.launch(
        (programs,), keys, counts, indices if placed else counts, bin_ids if placed else counts, tokens_per_expert, bins,
        padded_bins if block else bins, slot_to_row if slot_to_row is not None else counts,
        n, num_keys, key_mask, chunk, table_rows, max(block, 1), capacity,
        PLACE=place, PADDED=bool(block), ROUTE=route, NPU_FORM=npu_form,
        BLOCK_M=t.block_m, BLOCK_E=block_e, BLOCK_P=block_p, num_warps=t.num_warps,
    )
    row_pos = _row_map_of(bins, padded_bins, n, route, capacity, block, npu_form and place != HISTOGRAM, num_programs)
    return tokens_per_expert, bins, padded_bins, slot_to_row, row_pos


def _row_map_of(bins, padded_bins, n, route, capacity, block, npu_form, num_programs):
    """The padded or binned route's row map, for the buffer-row-major gather (the NPU form only; None
    elsewhere): every row a gather of this routing can have (``routing.padded_rows_bound``,
    ``experts * capacity``), in a third launch (``routing_kernels._row_map``: a walk with contiguous
    stores). Written in ``_place`` instead, its per-row search or picks over ``[BLOCK_M, BLOCK_E]``
    tiles took the placement's Unified Buffer plan to 193-196 KiB of 192 (docs/notes/many-experts.md)."""
    if not npu_form or route not in (routing.PADDED, routing.BINNED):
        return None
    experts = bins.shape[0]
    rows = routing.padded_rows_bound(n, experts, block) if route == routing.PADDED else experts * capacity
    if rows == 0:
        return None
    if n == 0:
        return torch.full((rows,), -1, dtype=torch.int32, device=bins.device)
    return routing._compute_row_map(bins, padded_bins if route == routing.PADDED else None, layout=route,
                                    num_rows=rows, capacity=capacity if route == routing.BINNED else 0,
                                    num_programs=num_programs)


def prepare_routing(top_experts, num_experts, block=0, route=NO_ROUTE, capacity=0, *, tile=None,
                    num_programs=None, npu_form=None):
    """``(indices, bin_ids, bins, tokens_per_expert, padded_bins)`` of the router's expert ids, as
    MegaBlocks computes them (``padded_bins``: each expert's count rounded up to a multiple of
    ``block``; None when ``block`` is 0), in two launches.

    ``route`` (a layout of :mod:`~megablocks_ascend.kernels.routing`, with ``capacity`` for the
    binned one) also writes that layout's route map in the same launch and keeps it on ``indices``
    for the routing calls of the step (:func:`routing.keep_route_map`), so none of them launches a
    kernel to build it; in the NPU form, for the padded and binned layouts, also their row map
    (:func:`routing.keep_row_map`, a third launch), for the buffer-row-major gather."""
    keys = top_experts.reshape(-1)
    n = keys.shape[0]
    indices = torch.empty(n, dtype=torch.int32, device=keys.device)
    bin_ids = torch.empty(n, dtype=torch.int32, device=keys.device)
    keep = route != NO_ROUTE and routing.route_map_keepable(indices)
    tokens_per_expert, bins, padded_bins, slot_to_row, row_pos = _launch(
        keys, num_experts, -1, place=ROUTING, indices=indices, bin_ids=bin_ids, block=block,
        route=route if keep else NO_ROUTE,
        capacity=capacity, tile=tile, num_programs=num_programs, npu_form=npu_form)
    if keep:
        kept_padded = padded_bins if route == routing.PADDED else None
        kept_capacity = capacity if route == routing.BINNED else 0
        routing.keep_route_map(indices, bins, kept_padded, slot_to_row, layout=route, capacity=kept_capacity)
        if row_pos is not None:
            routing.keep_row_map(indices, bins, kept_padded, row_pos, layout=route, capacity=kept_capacity)
    return indices, bin_ids, bins, tokens_per_expert, padded_bins


def sort(x, end_bit, x_out, iota_out, *, tile=None, num_programs=None, npu_form=None):
    """``megablocks_ops.sort`` (a stable sort on the low ``end_bit`` bits) for ``end_bit`` up to
    ``log2(devices.MAX_PREP_KEYS)``: ``x_out`` gets the sorted values, ``iota_out`` the permutation."""
    _launch(x, 1 << end_bit, (1 << end_bit) - 1, place=SORT, indices=iota_out, bin_ids=x_out, tile=tile,
            num_programs=num_programs, npu_form=npu_form)


def histogram(x, num_bins, *, tile=None, num_programs=None):
    """``megablocks_ops.histogram`` of a 1-D tensor: int32 counts of the values ``0 .. num_bins - 1``
    (others ignored), for ``num_bins`` up to ``devices.MAX_PREP_KEYS``."""
    return _launch(x, num_bins, -1, tile=tile, num_programs=num_programs)[0]
