"""Input checks shared by every backend, run before any kernel launch.

Cheap checks (shapes, dtypes, devices, scalar arguments) always run. Checks that read
tensor values (``bins`` monotone and ending at the number of assignments, ``indices`` a
permutation, ``bin_ids`` consistent with ``bins``, ``padded_bins`` covering ``bins``, finite
router weights) need a device-to-host sync and run only when ``MEGABLOCKS_ASCEND_CHECKS=1``.
No check writes to its arguments: a failing call leaves the caller's tensors untouched.
"""

from __future__ import annotations

import torch

from megablocks_ascend import envs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class RoutingArgumentError(ValueError):
    """A routing op was called with an argument it cannot use."""


def _fail(op: str, name: str, problem: str):
    raise RoutingArgumentError(f"{op}: argument '{name}' {problem}")


def _tensor(op, name, t, ndim, dtypes):
    if isinstance(t, torch.Tensor) and t.ndim == ndim and t.dtype in dtypes:
        return  # the common case, checked first (this runs for every tensor of every routing call)
    if not isinstance(t, torch.Tensor):
        _fail(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        _fail(op, name, f"must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, name, f"must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def _int(op, name, value, minimum):
    if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, int):
        _fail(op, name, f"must be a Python int, got {type(value).__name__}")
    if value < minimum:
        _fail(op, name, f"must be >= {minimum}, got {value}")


def _same_device(op, first_name, first, named):
    """Every tensor in ``named`` (pairs; None entries skipped) on ``first``'s device."""
    device = first.device
    for name, t in named:
        if t is not None and t.device != device:
            _fail(op, name, f"is on {t.device} but '{first_name}' is on {device}")


def check_routing(op, *, x, x_ndim, indices, bins, top_k, bin_ids=None, weights=None,
                  padded_bins=None, expert_capacity=None, grad=None, x_rows=None):
    """Validate one routing call. ``x_rows``: what ``x``'s rows are, where that is fixed:
    ``"tokens"`` (the assignments cover ``x.shape[0] * top_k``) or ``"assignments"`` (one row each)."""
    _tensor(op, "x", x, x_ndim, FLOAT_DTYPES)
    _tensor(op, "indices", indices, 1, INDEX_DTYPES)
    _tensor(op, "bins", bins, 1, INDEX_DTYPES)
    _int(op, "top_k", top_k, 1)
    if bins.shape[0] == 0:
        _fail(op, "bins", "must have one entry per expert, got 0 entries")
    n = indices.shape[0]
    if n % top_k != 0:
        _fail(op, "indices", f"has {n} assignments, which is not a multiple of top_k={top_k}")
    if x_rows == "tokens" and n != x.shape[0] * top_k:
        _fail(op, "indices", f"has {n} assignments, expected tokens * top_k = {x.shape[0]} * {top_k}")
    if x_rows == "assignments" and x.shape[0] != n:
        _fail(op, "x", f"must have one row per assignment ({n}), got {x.shape[0]}")
    if bin_ids is not None:
        _tensor(op, "bin_ids", bin_ids, 1, INDEX_DTYPES)
        if bin_ids.shape[0] != n:
            _fail(op, "bin_ids", f"has {bin_ids.shape[0]} entries, expected one per assignment ({n})")
    if padded_bins is not None:
        _tensor(op, "padded_bins", padded_bins, 1, INDEX_DTYPES)
        if padded_bins.shape != bins.shape:
            _fail(op, "padded_bins", f"has {padded_bins.shape[0]} entries, expected one per expert ({bins.shape[0]})")
    if weights is not None:
        _tensor(op, "weights", weights, 1, FLOAT_DTYPES)
        if weights.shape[0] != n:
            _fail(op, "weights", f"has {weights.shape[0]} entries, expected one per assignment ({n})")
    if expert_capacity is not None:
        _int(op, "expert_capacity", expert_capacity, 0)
    if grad is not None:
        _tensor(op, "grad", grad, 2, FLOAT_DTYPES)
        if grad.shape != (n // top_k, x.shape[-1]):
            _fail(op, "grad", f"must have shape {(n // top_k, x.shape[-1])}, got {tuple(grad.shape)}")
    if x_ndim == 3 and x.shape[0] != bins.shape[0]:
        _fail(op, "x", f"has {x.shape[0]} experts but 'bins' has {bins.shape[0]}")
    _same_device(op, "x", x, (("indices", indices), ("bins", bins), ("bin_ids", bin_ids),
                              ("weights", weights), ("padded_bins", padded_bins), ("grad", grad)))
    if envs.checks_enabled():
        check_values(op, indices=indices, bins=bins, bin_ids=bin_ids, weights=weights, padded_bins=padded_bins)


def check_values(op, *, indices, bins, bin_ids=None, weights=None, padded_bins=None):
    """The checks that read values (one device-to-host sync for all of them)."""
    n = indices.shape[0]
    b = bins.long()
    problems = {
        "bins": [
            (b.numel() > 1 and bool((b[1:] < b[:-1]).any()), "must be non-decreasing"),
            (bool(b[0] < 0), "must not be negative"),
            (int(b[-1]) != n, f"must end at the number of assignments ({n}), got bins[-1]={int(b[-1])}"),
        ],
    }
    counts = torch.bincount(indices.long().clamp(0, max(n - 1, 0)), minlength=n) if n else indices.new_zeros(0)
    problems["indices"] = [
        (n > 0 and bool(((indices < 0) | (indices >= n)).any()), f"must lie in [0, {n})"),
        (n > 0 and bool((counts != 1).any()), "must be a permutation of the assignment slots (each slot exactly once)"),
    ]
    if bin_ids is not None and n:
        expected = torch.searchsorted(b, torch.arange(n, device=b.device), right=True)
        problems["bin_ids"] = [(not torch.equal(bin_ids.long(), expected), "is not consistent with 'bins'")]
    if padded_bins is not None:
        p = padded_bins.long()
        counts_e = torch.diff(b, prepend=b.new_zeros(1))
        pcounts = torch.diff(p, prepend=p.new_zeros(1))
        problems["padded_bins"] = [
            (p.numel() > 1 and bool((p[1:] < p[:-1]).any()), "must be non-decreasing"),
            (bool((pcounts < counts_e).any()), "must give every expert at least as many rows as 'bins' does"),
        ]
    if weights is not None:
        problems["weights"] = [(not bool(torch.isfinite(weights).all()), "must be finite (found NaN or inf)")]
    for name, items in problems.items():
        for bad, message in items:
            if bad:
                _fail(op, name, message)
