"""The ``torch`` backend: MegaBlocks' routing kernels in plain PyTorch, on any device.

Same signatures and results as ``megablocks.backend.kernels``; written independently of
the Triton kernels (whole-tensor indexing instead of tiles), so each checks the other.
Scaling and reductions are done in float32 and cast once, like the kernels.
"""

from __future__ import annotations

import torch


def slot_rows(indices, bins, segment_ends):
    """For each assignment slot, its row in the expert-major buffer, or -1 where dropped.

    ``segment_ends[e]``: the end of expert ``e``'s row segment (``bins`` itself for dropless,
    ``padded_bins`` for padded, ``(e + 1) * capacity`` for binned).
    """
    n = indices.shape[0]
    device = indices.device
    bins = bins.long()
    segment_ends = segment_ends.long()
    pos = torch.arange(n, device=device)
    expert = torch.searchsorted(bins, pos, right=True)
    has_expert = expert < bins.shape[0]
    e = expert.clamp(max=bins.shape[0] - 1)
    first = e == 0
    pos_start = torch.where(first, 0, bins[(e - 1).clamp(min=0)])
    seg_start = torch.where(first, 0, segment_ends[(e - 1).clamp(min=0)])
    row = seg_start + (pos - pos_start)
    keep = has_expert & (row < segment_ends[e])
    out = torch.full((n,), -1, dtype=torch.long, device=device)
    out[indices.long()] = torch.where(keep, row, -1)
    return out


def _binned_ends(bins, capacity):
    return torch.arange(1, bins.shape[0] + 1, device=bins.device) * capacity


def _gather(x, indices, weights, rows_of_slots, num_rows, top_k):
    # Every slot writes its row; a dropped slot writes a spare row past the end, which is cut off.
    # (Selecting the kept slots first would need their count on the host: a sync on a device.)
    out = torch.zeros((num_rows + 1, x.shape[1]), dtype=x.dtype, device=x.device)
    rows = torch.where(rows_of_slots >= 0, rows_of_slots, num_rows)
    values = x[torch.arange(rows_of_slots.shape[0], device=x.device) // top_k]
    if weights is not None:
        values = (values.float() * weights.float()[:, None]).to(x.dtype)
    out[rows] = values
    return out[:num_rows]


def _slot_values(y, rows_of_slots):
    """Each slot's row of the expert-major buffer ``y`` in float32, zero where the slot was dropped."""
    kept = rows_of_slots >= 0
    if y.shape[0] == 0:  # no rows at all (a zero expert capacity): every slot was dropped
        return torch.zeros((rows_of_slots.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
    return torch.where(kept[:, None], y[rows_of_slots.clamp(min=0)].float(), 0.0)


def _scatter(y, weights, rows_of_slots, top_k):
    hidden = y.shape[-1]
    y = y.reshape(-1, hidden)
    values = _slot_values(y, rows_of_slots)
    if weights is not None:
        values = values * weights.float()[:, None]
    return values.view(-1, top_k, hidden).sum(dim=1).to(y.dtype)


def _wgrad(y, grad, rows_of_slots, top_k):
    y = y.reshape(-1, y.shape[-1])
    slots = torch.arange(rows_of_slots.shape[0], device=y.device)
    dots = (_slot_values(y, rows_of_slots) * grad[slots // top_k].float()).sum(dim=1)
    return torch.where(rows_of_slots >= 0, dots, 0.0).to(y.dtype)  # exactly 0 when dropped, whatever grad holds


def binned_gather(x, indices, weights, bins, expert_capacity, top_k):
    rows = slot_rows(indices, bins, _binned_ends(bins, expert_capacity))
    out = _gather(x, indices, weights, rows, bins.shape[0] * expert_capacity, top_k)
    return out.view(bins.shape[0], expert_capacity, x.shape[1])


def binned_scatter(x, indices, weights, bins, top_k):
    return _scatter(x, weights, slot_rows(indices, bins, _binned_ends(bins, x.shape[1])), top_k)


def binned_scatter_wgrad(x, grad, indices, bins, top_k):
    return _wgrad(x, grad, slot_rows(indices, bins, _binned_ends(bins, x.shape[1])), top_k)


def gather(x, indices, bin_ids, weights, bins, top_k):
    return _gather(x, indices, weights, slot_rows(indices, bins, bins), indices.shape[0], top_k)


def scatter(x, indices, bin_ids, weights, bins, top_k):
    return _scatter(x, weights, slot_rows(indices, bins, bins), top_k)


def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k):
    return _wgrad(x, grad, slot_rows(indices, bins, bins), top_k)


def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k, num_rows=None):
    if num_rows is None:  # upstream's size, read on the host
        num_rows = int(padded_bins[-1].item())
    return _gather(x, indices, weights, slot_rows(indices, bins, padded_bins), num_rows, top_k)


def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    return _scatter(x, weights, slot_rows(indices, bins, padded_bins), top_k)


def padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k):
    return _wgrad(x, grad, slot_rows(indices, bins, padded_bins), top_k)


def prepare_routing(top_experts, num_experts, block=0, route=-1, capacity=0):
    """The routing preparation (``megablocks_ascend.kernels.preparation.prepare_routing``):
    ``(indices, bin_ids, bins, tokens_per_expert, padded_bins)`` of the router's expert ids, as
    MegaBlocks' ``ops.sort`` / ``ops.histogram`` / ``ops.inclusive_cumsum`` (and ``ops.round_up``
    for ``padded_bins``, None when ``block`` is 0) compute them. Ids outside ``[0, num_experts)``
    count in no expert and sort after every valid one, in order, as if they were expert
    ``num_experts``: that is their ``bin_ids`` entry. ``route`` and ``capacity`` (the
    route map the Triton kernels write for their routing calls) are not used: this backend's
    routing ops find each slot's row from ``bins`` themselves."""
    del route, capacity
    ids = top_experts.reshape(-1)
    keys = ids.long()
    valid = (keys >= 0) & (keys < num_experts)
    keys = torch.where(valid, keys, num_experts)  # the invalid ones after every expert
    order = torch.sort(keys, stable=True).indices
    indices = order.int()
    bin_ids = keys[order].int()
    # A fixed-size scatter-add (not bincount or boolean indexing: no data-dependent size).
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    tokens_per_expert = counts[:num_experts]
    bins = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    padded_bins = None
    if block:
        padded_bins = torch.cumsum((tokens_per_expert + block - 1) // block * block, 0, dtype=torch.int32)
    return indices, bin_ids, bins, tokens_per_expert, padded_bins
