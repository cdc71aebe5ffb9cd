"""An independent float64 reference for MegaBlocks' nine routing kernels, and routing generators.

Not a test module: tests import it. Everything here is written as plain Python loops over
experts and sorted positions, straight from the definitions below (the semantics of MegaBlocks
0.10.0's ``megablocks/backend/kernels.py``), and does
not use ``megablocks_ascend`` (whose own ``reference`` backend is one of the things tested
against this file):

* ``indices[p]`` is the assignment slot at sorted position ``p``; the slot's token is
  ``indices[p] // top_k``.
* ``bins[e]`` is the inclusive count of positions through expert ``e``; expert ``e`` owns
  positions ``[bins[e-1], bins[e])`` (start 0 for ``e == 0``) and ``offset = p - start``.
* binned: a position is kept when ``offset < expert_capacity`` and lands on row
  ``e * expert_capacity + offset``; unused capacity rows are zero.
* dropless: position ``p`` lands on row ``p``.
* padded: expert ``e``'s rows start at ``padded_bins[e-1]`` (0 for ``e == 0``); position
  ``p`` lands on row ``padded_start + offset``; padding rows are zero.
* gather copies token rows (optionally times the router weight of the slot) to their rows;
  scatter sends each kept row (optionally weighted) to its slot and sums a token's ``top_k``
  slots; wgrad is the dot product of a kept row with its token's output gradient, stored at
  the slot (zero for dropped slots).

All kernel references return float64 tensors (no rounding to the input dtype), with
upstream MegaBlocks' signatures (``megablocks.backend.kernels``).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# Routing generators (built the way MegaBlocks' layers build them).


def make_routing(tokens, num_experts, top_k, *, skew=None, empty_experts=(), counts=None, generator):
    """Random expert choices, sorted the way MegaBlocks does it.

    Returns ``(indices, bin_ids, bins, tokens_per_expert)``, all int32, as
    ``megablocks.layers.moe.ParallelMLP.indices_and_bins`` computes them: ``top_experts``
    (``[tokens * top_k]``, slot ``t * top_k + k``) is stably sorted (``bin_ids`` are the
    sorted expert ids, ``indices`` the slots in that order), ``tokens_per_expert`` is its
    histogram and ``bins`` the inclusive cumulative sum of the histogram.

    By default each token picks ``top_k`` distinct experts (as a top-k router does), never
    one of ``empty_experts``, with probabilities proportional to ``(rank + 1) ** -skew`` over
    the remaining experts (uniform when ``skew`` is None). ``counts`` instead fixes how many
    slots each expert gets (they must sum to ``tokens * top_k``); the slots are then assigned
    in random order, so one token may pick the same expert twice (the kernels do not care).
    """
    n = tokens * top_k
    if counts is not None:
        counts = [int(c) for c in counts]
        if len(counts) != num_experts or sum(counts) != n:
            raise ValueError(f"counts {counts} must have {num_experts} entries summing to {n}")
        pool = [e for e, c in enumerate(counts) for _ in range(c)]
        order = torch.randperm(n, generator=generator).tolist()
        top_experts = [pool[i] for i in order]
    else:
        allowed = [e for e in range(num_experts) if e not in set(empty_experts)]
        if len(allowed) < top_k and tokens > 0:
            raise ValueError(f"top_k={top_k} needs at least that many non-empty experts, got {allowed}")
        if skew is None:
            probs = torch.ones(len(allowed), dtype=torch.float64)
        else:
            probs = torch.tensor([(r + 1.0) ** -float(skew) for r in range(len(allowed))], dtype=torch.float64)
        top_experts = []
        for _ in range(tokens):
            picks = torch.multinomial(probs, top_k, replacement=False, generator=generator).tolist()
            top_experts.extend(allowed[i] for i in picks)

    # Stable sort of the expert ids (Python's sort is stable), as CUB's radix sort is.
    order = sorted(range(n), key=lambda a: top_experts[a])
    indices = torch.tensor(order, dtype=torch.int32)
    bin_ids = torch.tensor([top_experts[a] for a in order], dtype=torch.int32)
    histogram = [0] * num_experts
    for e in top_experts:
        histogram[e] += 1
    running, bins = 0, []
    for c in histogram:
        running += c
        bins.append(running)
    return indices, bin_ids, torch.tensor(bins, dtype=torch.int32), torch.tensor(histogram, dtype=torch.int32)


def padded_bins(bins, block):
    """``bins`` with each expert's count rounded up to a multiple of ``block``, as MegaBlocks'
    dMoE computes it (``ops.round_up`` of ``tokens_per_expert``, then an inclusive cumsum)."""
    out, previous, running = [], 0, 0
    for end in _ints(bins):
        count = end - previous
        previous = end
        running += (count + block - 1) // block * block
        out.append(running)
    return torch.tensor(out, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Where each sorted position lands: a list indexed by position, holding a row or None (dropped).


def _ints(t):
    return [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def binned_rows(bins, expert_capacity):
    rows, start = [], 0
    for e, end in enumerate(_ints(bins)):
        for p in range(start, end):
            offset = p - start
            rows.append(e * expert_capacity + offset if offset < expert_capacity else None)
        start = end
    return rows


def dropless_rows(bins):
    return list(range(_ints(bins)[-1] if len(_ints(bins)) else 0))


def padded_rows(bins, padded_bins):
    rows, start, padded_start = [], 0, 0
    for end, padded_end in zip(_ints(bins), _ints(padded_bins)):
        for p in range(start, end):
            rows.append(padded_start + (p - start))
        start, padded_start = end, padded_end
    return rows


def slot_rows(indices, position_rows):
    """The row of each assignment slot (``None`` where dropped), from a position -> row list."""
    idx = _ints(indices)
    out = [None] * len(idx)
    for p, row in enumerate(position_rows):
        out[idx[p]] = row
    return out


def unused_rows(position_rows, num_rows):
    """The buffer rows no position lands on (unused capacity or padding)."""
    used = {r for r in position_rows if r is not None}
    return [r for r in range(num_rows) if r not in used]


# ---------------------------------------------------------------------------------------------
# The three kernels, on a position -> row map.


def _gather(x, indices, weights, position_rows, num_rows, top_k):
    x64 = x.detach().to(torch.float64)
    w64 = None if weights is None else weights.detach().to(torch.float64)
    out = torch.zeros((num_rows, x.shape[1]), dtype=torch.float64)
    idx = _ints(indices)
    for p, row in enumerate(position_rows):
        if row is None:
            continue
        slot = idx[p]
        value = x64[slot // top_k]
        if w64 is not None:
            value = value * w64[slot]
        out[row] = value
    return out


def _scatter(y, indices, weights, position_rows, top_k):
    hidden = y.shape[-1]
    y64 = y.detach().to(torch.float64).reshape(-1, hidden)
    w64 = None if weights is None else weights.detach().to(torch.float64)
    idx = _ints(indices)
    out = torch.zeros((len(idx) // top_k, hidden), dtype=torch.float64)
    for p, row in enumerate(position_rows):
        if row is None:
            continue
        slot = idx[p]
        value = y64[row]
        if w64 is not None:
            value = value * w64[slot]
        out[slot // top_k] += value
    return out


def _wgrad(y, grad, indices, position_rows, top_k):
    hidden = y.shape[-1]
    y64 = y.detach().to(torch.float64).reshape(-1, hidden)
    g64 = grad.detach().to(torch.float64)
    idx = _ints(indices)
    out = torch.zeros(len(idx), dtype=torch.float64)
    for p, row in enumerate(position_rows):
        if row is None:
            continue
        slot = idx[p]
        out[slot] = torch.dot(y64[row], g64[slot // top_k])
    return out


# ---------------------------------------------------------------------------------------------
# MegaBlocks' kernel entry points (megablocks.backend.kernels signatures), in float64.


def binned_gather(x, indices, weights, bins, expert_capacity, top_k):
    num_experts = len(_ints(bins))
    out = _gather(x, indices, weights, binned_rows(bins, expert_capacity), num_experts * expert_capacity, top_k)
    return out.view(num_experts, expert_capacity, x.shape[1])


def binned_scatter(x, indices, weights, bins, top_k):
    return _scatter(x, indices, weights, binned_rows(bins, x.shape[1]), top_k)


def binned_scatter_wgrad(x, grad, indices, bins, top_k):
    return _wgrad(x, grad, indices, binned_rows(bins, x.shape[1]), top_k)


def gather(x, indices, bin_ids, weights, bins, top_k):
    return _gather(x, indices, weights, dropless_rows(bins), len(_ints(indices)), top_k)


def scatter(x, indices, bin_ids, weights, bins, top_k):
    return _scatter(x, indices, weights, dropless_rows(bins), top_k)


def scatter_wgrad(x, grad, indices, bin_ids, bins, top_k):
    return _wgrad(x, grad, indices, dropless_rows(bins), top_k)


def padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    pb = _ints(padded_bins)
    return _gather(x, indices, weights, padded_rows(bins, pb), pb[-1] if pb else 0, top_k)


def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    return _scatter(x, indices, weights, padded_rows(bins, padded_bins), top_k)


def padded_scatter_wgrad(x, grad, indices, bin_ids, bins, padded_bins, top_k):
    return _wgrad(x, grad, indices, padded_rows(bins, padded_bins), top_k)


KERNELS = {
    "binned_gather": binned_gather,
    "binned_scatter": binned_scatter,
    "binned_scatter_wgrad": binned_scatter_wgrad,
    "gather": gather,
    "scatter": scatter,
    "scatter_wgrad": scatter_wgrad,
    "padded_gather": padded_gather,
    "padded_scatter": padded_scatter,
    "padded_scatter_wgrad": padded_scatter_wgrad,
}
