"""The routing ops' host code: launch plans, the route and row maps kept on the routing tensors,
the launchers, and MegaBlocks' kernel entry points (``gather``, ``scatter``, ``binned_*``,
``padded_*``, with ``megablocks.backend.kernels``' signatures and results). This is the module the
backends, the routing preparation and the benchmarks import.

The kernels it launches are in :mod:`~megablocks_ascend.kernels.routing_kernels`, device code only
(as Liger-Kernel keeps ``fused_moe_kernels.py`` apart from ``fused_moe.py``): what the compile gate
lowers, and the vocabulary the names here use (slots, sorted positions, buffer rows, the three
layouts, the walk over the experts' segments, the two store forms). The launchers' integer
arithmetic and the int32 convention are :mod:`~megablocks_ascend.kernels.launch`'s.
"""

from __future__ import annotations

import torch

from megablocks_ascend import devices, envs, keeping
from megablocks_ascend.kernels import routing_kernels
from megablocks_ascend.kernels.launch import INT32_MAX, cdiv, needs_int64
from megablocks_ascend.kernels.routing_kernels import BINNED, DROPLESS, PADDED


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


def _walk_blocks(items: int, block_m: int, experts: int) -> int:
    """An upper bound on the blocks of a walk over ``items`` (:func:`routing_kernels._walk`; each
    expert's last block may be partial): the work count that sizes the grid."""
    return cdiv(items, block_m) + experts


# launch.py's int32 convention: the largest value a kernel forms must be <= this (lowered in tests).
_INT32_LIMIT = INT32_MAX


def _needs_int64(*numels: int) -> bool:
    """Whether the kernels must address tensors of ``numels`` elements with int64 offsets: each
    count bounds the offsets formed into its tensor (spare rows included), and one passes the limit."""
    return needs_int64(*numels, limit=_INT32_LIMIT)


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
        return _grid(device, cdiv(num_rows, t.block_m), num_programs), _select(device, "gather", _row_meta(
            t, hidden, MAPPED=mapped, TOP_K=top_k, SCALE=weights is not None,
            INT64=_needs_int64(tokens * hidden, num_rows * hidden)))

    grid, meta = _planned(("gather", device, x.dtype, tokens, hidden, num_rows, mapped, top_k,
                           weights is None, tile, num_programs, envs.num_programs_override(), envs.row_loads()), plan)
    routing_kernels._gather.launch(grid, x, out, indices, row_pos, weights if weights is not None else x,
                                   num_rows, map_rows, n, hidden, **meta)
    return out


def gather_tokens_rows(x, indices, bins, padded_bins, weights, *, layout, num_rows, top_k,
                       capacity=0, tile=None, num_programs=None):
    """:func:`gather_rows`' result, computed token-major: each token row is read once and written
    to its ``top_k`` rows (after :func:`route_map`); rows no assignment lands on are zeroed."""
    tokens, hidden = x.shape
    device = x.device
    # One spare row at the end takes the writes of dropped slots and padding (see routing_kernels._gather_tokens).
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
        return _grid(device, max(cdiv(tokens, t.block_m), walk), num_programs), _row_meta(
            t, hidden, LAYOUT=layout, TOP_K=top_k, SCALE=weights is not None,
            INT64=_needs_int64(tokens * hidden, (num_rows + 1) * hidden), BLOCK_E=devices.block_e(experts))

    grid, meta = _planned(("gather_tokens", device, x.dtype, tokens, hidden, num_rows, experts, layout, top_k,
                           weights is None, tile, num_programs, envs.num_programs_override()), plan)
    routing_kernels._gather_tokens.launch(
        grid, x, buffer, slot_to_row, bins, padded_bins if padded_bins is not None else bins,
        weights if weights is not None else x, tokens, num_rows, experts, hidden, capacity, **meta)
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


def _walk_plan(kind, device, items, experts, layout, block_m, num_programs):
    """``(grid, constexprs)`` of a walk over ``items`` positions in the expert order (the route map,
    the row map): ``block_m`` positions per block (default :data:`ROUTE_MAP_BLOCK_M`), planned once."""
    def plan():
        bm = block_m if block_m is not None else ROUTE_MAP_BLOCK_M.get(device.type, 128)
        return _grid(device, _walk_blocks(items, bm, experts), num_programs), dict(
            LAYOUT=layout, BLOCK_M=bm, BLOCK_E=devices.block_e(experts))
    return _planned((kind, device, items, experts, layout, block_m, num_programs, envs.num_programs_override()), plan)


def _compute_route_map(indices, bins, padded_bins, *, layout, capacity, block_m, num_programs):
    n = indices.shape[0]
    device = indices.device
    slot_to_row = torch.empty(n, dtype=torch.int32, device=device)
    if n == 0:
        return slot_to_row
    experts = bins.shape[0]
    grid, meta = _walk_plan("route_map", device, n, experts, layout, block_m, num_programs)
    routing_kernels._route_map.launch(grid, indices, bins, padded_bins if padded_bins is not None else bins,
                                      slot_to_row, n, experts, capacity, **meta)
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
    computed (one launch of :func:`routing_kernels._row_map`) and kept. Must not be modified."""
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
    grid, meta = _walk_plan("row_map", device, num_rows, experts, layout, block_m, num_programs)
    routing_kernels._row_map.launch(grid, bins, padded_bins if padded_bins is not None else bins, row_pos,
                                    num_rows, experts, capacity, **meta)
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
        return _grid(device, cdiv(num_tokens, t.block_m), num_programs), meta

    grid, meta = _planned(("scatter", device, y.dtype, rows, hidden, num_tokens, top_k, weights is None, tile,
                           num_programs, envs.num_programs_override(), envs.stores(), envs.row_loads()), plan)
    routing_kernels._scatter.launch(grid, y, out, slot_to_row, weights if weights is not None else y,
                                    num_tokens, rows, hidden, **meta)
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
    routing_kernels._scatter_one.launch(
        grid, y, buffer, indices, bins, padded_bins if padded_bins is not None else bins,
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
        return _grid(device, cdiv(n, t.block_m), num_programs), _select(device, "wgrad", _row_meta(
            t, hidden, TOP_K=top_k, INT64=_needs_int64(rows * hidden, grad_numel)))

    grid, meta = _planned(("wgrad", device, y.dtype, rows, hidden, n, grad_numel, top_k, tile, num_programs,
                           envs.num_programs_override(), envs.row_loads()), plan)
    routing_kernels._wgrad.launch(grid, y, grad, out, slot_to_row, n, rows, hidden, **meta)
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
    routing_kernels._wgrad_one.launch(grid, y, grad, buffer, indices, bins,
                                      padded_bins if padded_bins is not None else bins,
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
