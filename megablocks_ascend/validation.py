"""Input checks shared by every backend, run before any kernel launch.

Cheap checks (shapes, dtypes, devices, scalar arguments) always run. Checks that read
tensor values (``bins`` monotone and ending at the number of assignments, ``indices`` a
permutation, ``bin_ids`` consistent with ``bins``, ``padded_bins`` covering ``bins``, finite
router weights) need a device-to-host sync and run only when ``MEGABLOCKS_ASCEND_CHECKS=1``.
No check writes to its arguments: a failing call leaves the caller's tensors untouched.

:func:`check_routing` covers MegaBlocks' routing kernels (:class:`RoutingArgumentError`),
:func:`check_blocksparse` stk's block-sparse matmuls (:class:`BlockSparseArgumentError`; with
the checks on, also a well-formed BCSR topology and transposed metadata that matches it).
"""

from __future__ import annotations

import torch

from megablocks_ascend import envs, keeping

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
    check_routing_args(op, x, x_ndim, indices, bins, top_k, bin_ids, weights, padded_bins, expert_capacity, grad,
                       x_rows)


# Routing tensors made by the routing preparation (``megablocks_ascend.ops.prepare_routing``) are
# well-formed by construction: 1-D int32 on one device, ``indices`` a permutation, ``bin_ids`` and
# ``bins`` consistent, ``padded_bins`` covering ``bins``; and, where the preparation checked the
# router's ids (MEGABLOCKS_ASCEND_CHECKS=1), ``bins`` ends at the number of assignments. The
# preparation records that on ``indices`` (:func:`mark_prepared`, under the rule of
# :mod:`megablocks_ascend.keeping`), and a routing call that passes those very tensors, unchanged
# since, is not checked for it again: the checks hold, and each of a step's five routing calls
# would otherwise repeat them (with the value checks on, a device-to-host sync each). Anything
# else about the call is checked as always.
_PREPARED_ATTR = "_megablocks_ascend_prepared"


def mark_prepared(indices, bins, bin_ids, padded_bins, values_checked: bool) -> None:
    """Record that these routing tensors come from one routing preparation (see above), where
    :func:`keeping.keepable` allows it. The record holds whatever the capture state."""
    if keeping.keepable(indices):
        keeping.keep(indices, _PREPARED_ATTR, values_checked, companions=(bins, bin_ids, padded_bins))


def _prepared(indices, bins, bin_ids, padded_bins):
    """Whether the routing preparation made these tensors (see above): None if not, else whether
    it checked their values. A call without ``bin_ids`` or ``padded_bins`` (the binned ops have
    neither) is not compared on them."""
    if not isinstance(indices, torch.Tensor):
        return None
    return keeping.kept(indices, _PREPARED_ATTR, (), (bins, keeping.ANY if bin_ids is None else bin_ids,
                                                      keeping.ANY if padded_bins is None else padded_bins))


def _check_against_preparation(op, indices, bins, bin_ids, padded_bins):
    """``indices`` made by the routing preparation (and unchanged since) with routing tensors other
    than the preparation's: their shapes must be those the preparation made, which were made with
    ``indices`` (one bin per expert, one bin id per assignment). Free: shapes only."""
    kept = keeping.record(indices, _PREPARED_ATTR)
    if kept is None:
        return
    for name, given, made in zip(("bins", "bin_ids", "padded_bins"), (bins, bin_ids, padded_bins), kept.companions()):
        if isinstance(given, torch.Tensor) and made is not None and given is not made and given.shape != made.shape:
            what = "experts" if name != "bin_ids" else "assignments"
            _fail(op, name, f"has {given.shape[0]} entries, but 'indices' comes from a routing preparation for "
                            f"{made.shape[0]} {what} (its {name} has {made.shape[0]})")


def check_routing_args(op, x, x_ndim, indices, bins, top_k, bin_ids, weights, padded_bins, expert_capacity, grad,
                       x_rows):
    """:func:`check_routing` with every argument in order: what the dispatchers call on every
    routing call, so the common case is written to cost as little host time as it can (the checks
    and the order in which they fail are the same). Returns whether the routing tensors are the
    routing preparation's (then also contiguous)."""
    _tensor(op, "x", x, x_ndim, FLOAT_DTYPES)
    prepared = _prepared(indices, bins, bin_ids, padded_bins)
    if prepared is not None:  # the routing tensors as the preparation made them (see above)
        _check_with_prepared(op, x, x_ndim, indices, bins, top_k, weights, expert_capacity, grad, x_rows,
                             prepared)
        return True
    _tensor(op, "indices", indices, 1, INDEX_DTYPES)
    _tensor(op, "bins", bins, 1, INDEX_DTYPES)
    if type(top_k) is not int or top_k < 1:  # (type, not isinstance: a bool is not a top_k)
        _int(op, "top_k", top_k, 1)
    experts = bins.shape[0]
    if experts == 0:
        _fail(op, "bins", "must have one entry per expert, got 0 entries")
    if _PREPARED_ATTR in indices.__dict__:
        _check_against_preparation(op, indices, bins, bin_ids, padded_bins)
    n = indices.shape[0]
    _check_assignments(op, x, n, top_k, x_rows, bin_ids, weights)
    if bin_ids is not None:
        _tensor(op, "bin_ids", bin_ids, 1, INDEX_DTYPES)
        if bin_ids.shape[0] != n:
            _fail(op, "bin_ids", f"has {bin_ids.shape[0]} entries, expected one per assignment ({n})")
    if padded_bins is not None:
        _tensor(op, "padded_bins", padded_bins, 1, INDEX_DTYPES)
        if padded_bins.shape[0] != experts:
            _fail(op, "padded_bins", f"has {padded_bins.shape[0]} entries, expected one per expert ({experts})")
    _check_call(op, x, x_ndim, n, experts, top_k, weights, expert_capacity, grad)
    device = x.device
    if indices.device != device or bins.device != device \
            or (bin_ids is not None and bin_ids.device != device) \
            or (weights is not None and weights.device != device) \
            or (padded_bins is not None and padded_bins.device != device) \
            or (grad is not None and grad.device != device):
        _same_device(op, "x", x, (("indices", indices), ("bins", bins), ("bin_ids", bin_ids),
                                  ("weights", weights), ("padded_bins", padded_bins), ("grad", grad)))
    if envs.checks_enabled():
        check_values(op, indices=indices, bins=bins, bin_ids=bin_ids, weights=weights, padded_bins=padded_bins)
    return False


def _check_assignments(op, x, n, top_k, x_rows, bin_ids=None, weights=None, prepared=False):
    """``n`` assignments against ``top_k`` and against ``x``'s rows (see :func:`check_routing`).
    Where ``x`` holds the tokens and the counts disagree, ``bin_ids`` and ``weights`` (one entry
    per assignment) tell which of ``x`` and ``indices`` is wrong, and ``indices`` made by the routing
    preparation (``prepared``) is right by construction; otherwise both are named."""
    if n % top_k != 0:
        _fail(op, "indices", f"has {n} assignments, which is not a multiple of top_k={top_k}")
    if x_rows == "tokens":
        rows = x.shape[0]
        if n != rows * top_k:
            witnesses = [(name, t.shape[0]) for name, t in (("bin_ids", bin_ids), ("weights", weights))
                         if isinstance(t, torch.Tensor) and t.dim() == 1]
            if prepared:
                _fail(op, "x", f"has {rows} rows, but the routing (from the routing preparation) is for "
                               f"{n // top_k} tokens: {n} assignments = tokens * top_k = {n // top_k} * {top_k}")
            if witnesses and all(length == n for _, length in witnesses):
                _fail(op, "x", f"has {rows} rows, but the routing is for {n // top_k} tokens ('indices' and "
                               f"{' and '.join(repr(w) for w, _ in witnesses)} have {n} = tokens * top_k = "
                               f"{n // top_k} * {top_k} entries)")
            if witnesses and all(length == rows * top_k for _, length in witnesses):
                _fail(op, "indices", f"has {n} assignments, expected tokens * top_k = {rows} * {top_k} (as 'x' "
                                     f"and {' and '.join(repr(w) for w, _ in witnesses)} have)")
            _fail(op, "x", f"has {rows} rows (tokens) but 'indices' has {n} assignments: expected tokens * top_k = "
                           f"{rows} * {top_k} = {rows * top_k} (one of 'x' and 'indices' is wrong)")
    elif x_rows == "assignments" and x.shape[0] != n:
        _fail(op, "x", f"must have one row per assignment ({n}), got {x.shape[0]}")


def _check_call(op, x, x_ndim, n, experts, top_k, weights, expert_capacity, grad):
    """The call's own arguments against the routing: router weights, capacity, output gradient,
    and an expert-major ``x``'s expert count."""
    if weights is not None:
        _tensor(op, "weights", weights, 1, FLOAT_DTYPES)
        if weights.shape[0] != n:
            _fail(op, "weights", f"has {weights.shape[0]} entries, expected one per assignment ({n})")
    if expert_capacity is not None and (type(expert_capacity) is not int or expert_capacity < 0):
        _int(op, "expert_capacity", expert_capacity, 0)
    if grad is not None:
        _tensor(op, "grad", grad, 2, FLOAT_DTYPES)
        if grad.shape != (n // top_k, x.shape[-1]):
            _fail(op, "grad", f"must have shape {(n // top_k, x.shape[-1])}, got {tuple(grad.shape)}")
    if x_ndim == 3 and x.shape[0] != experts:
        _fail(op, "x", f"has {x.shape[0]} experts but 'bins' has {experts}")


def _check_with_prepared(op, x, x_ndim, indices, bins, top_k, weights, expert_capacity, grad, x_rows,
                         values_checked):
    """The checks of :func:`check_routing_args` that the routing preparation does not answer: the
    call's own arguments and how they fit the routing (the same checks, in the same order)."""
    if type(top_k) is not int or top_k < 1:
        _int(op, "top_k", top_k, 1)
    experts = bins.shape[0]
    n = indices.shape[0]
    _check_assignments(op, x, n, top_k, x_rows, weights=weights, prepared=True)
    _check_call(op, x, x_ndim, n, experts, top_k, weights, expert_capacity, grad)
    device = x.device
    if indices.device != device or (weights is not None and weights.device != device) \
            or (grad is not None and grad.device != device):
        _same_device(op, "x", x, (("indices", indices), ("weights", weights), ("grad", grad)))
    if envs.checks_enabled():
        if not values_checked:  # the preparation ran without the value checks: check the routing now
            check_values(op, indices=indices, bins=bins, weights=weights)
        elif weights is not None:
            check_values(op, indices=indices, bins=bins, weights=weights, routing=False)


def check_num_rows(op, num_rows, padded_bins):
    """``padded_gather``'s ``num_rows``: None (the row count is ``padded_bins[-1]``, read on the
    host) or a Python int; with ``MEGABLOCKS_ASCEND_CHECKS=1`` at least ``padded_bins[-1]`` (a
    sync), so that no row of the layout falls outside the output."""
    if num_rows is None:
        return
    if type(num_rows) is not int or num_rows < 0:
        _int(op, "num_rows", num_rows, 0)
    if envs.checks_enabled() and isinstance(padded_bins, torch.Tensor) and padded_bins.numel():
        needed = int(padded_bins[-1])
        if num_rows < needed:
            _fail(op, "num_rows", f"is {num_rows}, fewer than the padded layout's padded_bins[-1] = {needed} rows")


def check_topology(op, *, padded_bins, block_size, block_rows, blocks_per_row):
    """The sparse dMoE's topology (``ops.topology``): ``padded_bins`` a non-empty 1-D int32/int64
    tensor, ``block_size`` >= 1, ``block_rows`` >= 0 and ``blocks_per_row`` >= 1 Python ints, with
    block rows and block columns (experts x ``blocks_per_row``) within int16 block indices, stk's
    own limit; with ``MEGABLOCKS_ASCEND_CHECKS=1`` also ``padded_bins`` non-decreasing, in multiples
    of ``block_size``, and within ``block_rows`` (a sync)."""
    _tensor(op, "padded_bins", padded_bins, 1, INDEX_DTYPES)
    if padded_bins.shape[0] == 0:
        _fail(op, "padded_bins", "must have one entry per expert, got 0 entries")
    _int(op, "block_size", block_size, 1)
    _int(op, "block_rows", block_rows, 0)
    _int(op, "blocks_per_row", blocks_per_row, 1)
    columns = padded_bins.shape[0] * blocks_per_row
    for name, blocks in (("block_rows", block_rows), ("blocks_per_row", columns)):
        if blocks > INT16_BLOCKS:
            _fail(op, name, f"gives {blocks} block {'rows' if name == 'block_rows' else 'columns'}, more than "
                  f"stk's int16 block indices hold ({INT16_BLOCKS})")
    if envs.checks_enabled():
        p = padded_bins.long()
        if bool((p[1:] < p[:-1]).any()) or bool((p < 0).any()) or bool((p % block_size != 0).any()):
            _fail(op, "padded_bins", f"must be non-decreasing multiples of block_size={block_size}")
        if int(p[-1]) > block_rows * block_size:
            _fail(op, "block_rows", f"is {block_rows}, fewer than padded_bins[-1] / block_size = "
                  f"{int(p[-1]) // block_size}")


_INT32_MAX = 2**31 - 1
ROUTE_LAYOUTS = (-1, 0, 1, 2)  # none, and routing.DROPLESS, PADDED, BINNED


def check_preparation(op, *, top_experts, num_experts, block, route, capacity):
    """Validate one routing preparation: the router's expert ids ``top_experts`` ([tokens, top_k]
    or flat, int32/int64), ``num_experts`` (>= 1), ``block`` (round each expert's count up to a
    multiple of it for ``padded_bins``; 0: no ``padded_bins``), the route-map layout ``route``
    (-1: none) and the binned ``capacity``. Sizes must keep every result in int32. With
    ``MEGABLOCKS_ASCEND_CHECKS=1``, every id must lie in ``[0, num_experts)`` (a sync)."""
    if not (isinstance(top_experts, torch.Tensor) and top_experts.ndim in (1, 2) and top_experts.dtype in INDEX_DTYPES):
        if not isinstance(top_experts, torch.Tensor):
            _fail(op, "top_experts", f"must be a torch.Tensor, got {type(top_experts).__name__}")
        if top_experts.ndim not in (1, 2):
            _fail(op, "top_experts", f"must be 1-D or 2-D ([tokens, top_k]), got shape {tuple(top_experts.shape)}")
        dtype = str(top_experts.dtype).replace("torch.", "")
        _fail(op, "top_experts", f"must have dtype in (int32, int64), got {dtype}")
    _int(op, "num_experts", num_experts, 1)
    _int(op, "block", block, 0)
    _int(op, "capacity", capacity, 0)
    if isinstance(route, bool) or route not in ROUTE_LAYOUTS:
        _fail(op, "route", f"must be one of {ROUTE_LAYOUTS} (none, dropless, padded, binned), got {route!r}")
    if route == 1 and not block:
        _fail(op, "block", "must be > 0 for a padded route map (route=1)")
    n = top_experts.numel()
    if n + num_experts * max(block - 1, 0) > _INT32_MAX:
        _fail(op, "top_experts", f"has {n} assignments, too many for int32 indices and bins"
              + (f" padded to multiples of {block}" if block else ""))
    if route == 2 and num_experts * capacity > _INT32_MAX:
        _fail(op, "capacity", f"{capacity} x {num_experts} experts rows do not fit int32 row numbers")
    if envs.checks_enabled() and n and bool(((top_experts < 0) | (top_experts >= num_experts)).any()):
        _fail(op, "top_experts", f"must lie in [0, {num_experts}) (expert ids)")


def check_values(op, *, indices, bins, bin_ids=None, weights=None, padded_bins=None, routing=True):
    """The checks that read values (one device-to-host sync for all of them); ``routing=False``:
    only the weights'."""
    if not routing:
        if not bool(torch.isfinite(weights).all()):
            _fail(op, "weights", "must be finite (found NaN or inf)")
        return
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



# ------------------------------------------------------------------------------------------
# stk's block-sparse matmuls (stk.backend.triton_kernels.{sdd, dsd, dds, row_indices}).

BLOCK_INDEX_DTYPES = (torch.int16, torch.int32)
# stk.Matrix's own limit for int16 indices: at most 32767 blocks along each dimension (its
# ``max_dim = iinfo(int16).max * blocking``); the same rule here, for every backend.
INT16_BLOCKS = torch.iinfo(torch.int16).max


class BlockSparseArgumentError(ValueError):
    """One of stk's block-sparse matmuls was called with an argument it cannot use."""


def _bs_fail(op, name, problem):
    raise BlockSparseArgumentError(f"{op}: argument '{name}' {problem}")


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _bs_tensor(op, name, t, ndim, dtypes):
    if not isinstance(t, torch.Tensor):
        _bs_fail(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        _bs_fail(op, name, f"must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _bs_fail(op, name, f"must have dtype in ({', '.join(map(_dtype_name, dtypes))}), got {_dtype_name(t.dtype)}")


def _bs_shape(op, shape):
    if isinstance(shape, torch.Tensor) or not isinstance(shape, (tuple, list)) or len(shape) != 2 or \
            any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        _bs_fail(op, "shape", f"must be two non-negative ints (the sparse matrix's size), got {shape!r}")
    return int(shape[0]), int(shape[1])


def _bs_blocks(op, name, t):
    """A [nnz, B, B] tensor of blocks (``data``, or sdd's ``out``): returns (nnz, B)."""
    _bs_tensor(op, name, t, 3, FLOAT_DTYPES)
    if t.shape[1] != t.shape[2] or t.shape[1] == 0:
        _bs_fail(op, name, f"must hold square, non-empty blocks [nnz, B, B], got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _bs_fail(op, name, "must be contiguous")
    return t.shape[0], t.shape[1]


def _bs_dense(op, name, t, rows, cols, like_name, like, operand=True):
    """A dense matrix: an operand (read by stk's stride rule, below) or an output (``operand=False``,
    written through its strides, whatever they are)."""
    _bs_tensor(op, name, t, 2, FLOAT_DTYPES)
    if t.dtype != like.dtype:
        _bs_fail(op, name, f"has dtype {_dtype_name(t.dtype)} but '{like_name}' has {_dtype_name(like.dtype)}")
    if (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
        want = ", ".join("?" if d is None else str(d) for d in (rows, cols))
        _bs_fail(op, name, f"must have shape ({want}), got {tuple(t.shape)}")
    if operand and t.stride(0) > 1 and t.stride(1) > 1:
        _bs_fail(op, name, f"has strides {t.stride()}: stk reads a dense operand whose strides are both > 1 as the "
                 "transpose of itself, so it must be contiguous or the .t() of a contiguous tensor")


def _bs_multiple(op, shape, block, blocks_name):
    for what, dim in zip(("rows", "columns"), shape):
        if dim % block:
            _bs_fail(op, "shape", f"has {dim} {what}, not a multiple of the block size {block} (from '{blocks_name}')")


def _bs_index(op, name, t, n, dtypes=BLOCK_INDEX_DTYPES):
    _bs_tensor(op, name, t, 1, dtypes)
    if t.shape[0] != n:
        _bs_fail(op, name, f"has {t.shape[0]} entries, expected {n}")


def _bs_fits_int16(op, name, t, blocks, what):
    if t.dtype == torch.int16 and blocks > INT16_BLOCKS:
        _bs_fail(op, name, f"is int16, which cannot index {blocks} block {what} (at most {INT16_BLOCKS}, "
                 "stk.Matrix's limit); use int32 indices")


def _bs_topology(op, a, stored, block, nnz, transposed_metadata):
    """The BCSR metadata of the stored (untransposed) matrix of size ``stored``."""
    block_rows, block_cols = stored[0] // block, stored[1] // block
    _bs_index(op, "offsets", a["offsets"], block_rows + 1, (torch.int32,))
    _bs_index(op, "row_indices", a["row_indices"], nnz)
    _bs_index(op, "column_indices", a["column_indices"], nnz)
    _bs_fits_int16(op, "row_indices", a["row_indices"], block_rows, "rows")
    _bs_fits_int16(op, "column_indices", a["column_indices"], block_cols, "columns")
    if transposed_metadata:
        _bs_index(op, "offsets_t", a["offsets_t"], block_cols + 1, (torch.int32,))
        _bs_index(op, "column_indices_t", a["column_indices_t"], nnz)
        _bs_index(op, "block_offsets_t", a["block_offsets_t"], nnz, (torch.int32,))
        _bs_fits_int16(op, "column_indices_t", a["column_indices_t"], block_rows, "rows")
    if nnz > block_rows * block_cols:
        _bs_fail(op, "row_indices", f"has {nnz} blocks, more than the {block_rows} x {block_cols} the matrix holds")


def check_blocksparse(op, a):
    """Validate one call of stk's ``sdd``/``dsd``/``dds``/``row_indices`` (``a``: the arguments by
    name, as stk's functions take them). Shapes, dtypes, devices and strides always; the
    metadata's values only when ``MEGABLOCKS_ASCEND_CHECKS=1``. Returns the block size."""
    shape = _bs_shape(op, a["shape"])
    if op == "sdd":  # out = the blocks of lhs [M, K] @ rhs [K, N] that the topology keeps
        nnz, block = _bs_blocks(op, "out", a["out"])
        _bs_multiple(op, shape, block, "out")
        _bs_dense(op, "lhs", a["lhs"], shape[0], None, "out", a["out"])
        _bs_dense(op, "rhs", a["rhs"], a["lhs"].shape[1], shape[1], "out", a["out"])
        stored = shape
        _bs_topology(op, a, stored, block, nnz, transposed_metadata=False)
        tensors = ("lhs", "rhs", "out", "offsets", "row_indices", "column_indices")
    elif op in ("dsd", "dds"):
        transpose = "transpose_a" if op == "dsd" else "transpose_b"
        if not isinstance(a[transpose], bool):
            _bs_fail(op, transpose, f"must be a bool, got {type(a[transpose]).__name__}")
        nnz, block = _bs_blocks(op, "data", a["data"])
        _bs_multiple(op, shape, block, "data")
        if op == "dsd":  # out [M, N] = sparse [M, K] @ rhs [K, N]
            _bs_dense(op, "rhs", a["rhs"], shape[1], None, "data", a["data"])
            _bs_dense(op, "out", a["out"], shape[0], a["rhs"].shape[1], "data", a["data"], operand=False)
            dense = "rhs"
        else:  # out [M, N] = lhs [M, K] @ sparse [K, N]
            _bs_dense(op, "lhs", a["lhs"], None, shape[0], "data", a["data"])
            _bs_dense(op, "out", a["out"], a["lhs"].shape[0], shape[1], "data", a["data"], operand=False)
            dense = "lhs"
        stored = shape[::-1] if a[transpose] else shape
        _bs_topology(op, a, stored, block, nnz, transposed_metadata=True)
        tensors = (dense, "out", "data", "offsets", "row_indices", "column_indices", "offsets_t",
                   "column_indices_t", "block_offsets_t")
    elif op == "row_indices":
        # ``data`` only gives the block count and size: MegaBlocks passes a tensor on the meta device.
        nnz, block = _bs_blocks(op, "data", a["data"])
        _bs_multiple(op, shape, block, "data")
        _bs_index(op, "offsets", a["offsets"], shape[0] // block + 1, (torch.int32,))
        _bs_index(op, "column_indices", a["column_indices"], nnz)
        _bs_index(op, "out", a["out"], nnz)
        _bs_fits_int16(op, "out", a["out"], shape[0] // block, "rows")
        tensors = ("offsets", "column_indices", "out")
    else:
        raise ValueError(f"unknown block-sparse op {op!r}")
    devices = {name: a[name].device for name in tensors}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            _bs_fail(op, name, f"is on {dev} but '{first_name}' is on {first}")
    if envs.checks_enabled():
        if op == "row_indices":
            check_offsets_values(op, "offsets", a["offsets"], nnz)
        else:
            check_topology_values(op, a, stored, block, transposed_metadata=op != "sdd")
    return block


def check_offsets_values(op, name, offsets, nnz):
    """``offsets`` rise from 0 without decreasing to at most ``nnz``; returns ``offsets[-1]``, the
    number of blocks that belong to the matrix (the rest, if any, are a static-size topology's spare
    blocks: ``kernels/topology.py``)."""
    o = offsets.long()
    if bool(o[0] != 0) or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > nnz:
        _bs_fail(op, name, f"must rise from 0 to at most the number of blocks ({nnz}) without decreasing")
    return int(o[-1])


def check_topology_values(op, a, stored, block, transposed_metadata):
    """The checks that read the metadata's values (a device-to-host sync): a well-formed BCSR
    matrix (its blocks the first ``offsets[-1]``), and transposed metadata that lists the same
    blocks column by column."""
    nnz = a["row_indices"].shape[0]
    block_rows, block_cols = stored[0] // block, stored[1] // block
    nnz = check_offsets_values(op, "offsets", a["offsets"], nnz)  # the matrix's own blocks: the first nnz
    rows, cols = a["row_indices"][:nnz].long(), a["column_indices"][:nnz].long()
    expected_rows = torch.repeat_interleave(torch.arange(block_rows, device=rows.device),
                                            torch.diff(a["offsets"].long()), output_size=nnz)
    if not torch.equal(rows, expected_rows):
        _bs_fail(op, "row_indices", "is not consistent with 'offsets' (block i lies in the block row r with "
                 "offsets[r] <= i < offsets[r + 1])")
    if nnz and bool(((cols < 0) | (cols >= block_cols)).any()):
        _bs_fail(op, "column_indices", f"must lie in [0, {block_cols})")
    if not transposed_metadata:
        return
    if check_offsets_values(op, "offsets_t", a["offsets_t"], a["row_indices"].shape[0]) != nnz:
        _bs_fail(op, "offsets_t", f"must end at the number of blocks 'offsets' gives ({nnz})")
    order = a["block_offsets_t"][:nnz].long()
    if not torch.equal(torch.sort(order).values, torch.arange(nnz, device=order.device)):
        _bs_fail(op, "block_offsets_t", "must be a permutation of the blocks")
    if not torch.equal(a["column_indices_t"][:nnz].long(), rows[order]):
        _bs_fail(op, "column_indices_t", "must hold the block row of each block, in 'block_offsets_t' order")
    expected_cols = torch.repeat_interleave(torch.arange(block_cols, device=cols.device),
                                            torch.diff(a["offsets_t"].long()), output_size=nnz)
    if not torch.equal(cols[order], expected_cols):
        _bs_fail(op, "block_offsets_t", "must list the blocks column by column, as 'offsets_t' counts them")
