"""A stand-in for ``megablocks_ops``, MegaBlocks' CUDA extension, in device-agnostic PyTorch.

MegaBlocks' ``megablocks/ops/{sort,histogram,cumsum,replicate,topology}.py`` import this
extension at import time, so without it ``import megablocks`` fails. The functions below have
the extension's signatures and write the same results into the same output arguments
(semantics from upstream's ``csrc/``: CUB radix sort, even histogram, CUB scans, the topology
index kernel and the replicate kernels). They run on whatever device their tensors are on.

``sort`` (of int16 / int32 values) and ``histogram`` (of a 1-D tensor) run a counting-sort
kernel where the backend for the tensors' device has one (``backends.counting_sort``: under
``ascend``, ``kernels/preparation.py``'s, the routing preparation's) and there are at most
``devices.MAX_PREP_KEYS`` keys (``2**end_bit`` for sort): that is where MegaBlocks calls them
directly (the sparse dMoE's topology transpose, the expert-parallel path's second sort). Everywhere else (and while ``torch.compile`` traces), and
always for the other functions, the PyTorch code below serves them. This module imports
nothing of the plugin at import time (the patch registry registers it before MegaBlocks and the
rest of the plugin are imported); the backend is asked at call time.
"""

from __future__ import annotations

import torch

_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


def _check(name, t, ndim, dtypes=_INT_DTYPES):
    if not isinstance(t, torch.Tensor) or t.ndim != ndim or t.dtype not in dtypes:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"megablocks_ops: '{name}' must be a {ndim}-D tensor of {dtypes}, got {got}")


def _ours(op: str, x: torch.Tensor, num_keys: int):
    """The counting-sort kernel that serves ``op`` for ``x`` (``backends.counting_sort``), or None."""
    if torch.compiler.is_compiling():
        return None  # traced as the PyTorch ops below (a compiled graph of MegaBlocks' sparse dMoE)
    from megablocks_ascend import backends  # noqa: PLC0415  (at call time: see the module docstring)
    return backends.counting_sort(op, x, num_keys)


def sort(x: torch.Tensor, end_bit: int, x_out: torch.Tensor, iota_out: torch.Tensor) -> None:
    """Stable ascending sort of ``x`` on its bits ``[0, end_bit)``; ``iota_out`` gets the permutation.

    CUB's radix sort over the low ``end_bit`` bits is stable, and keys keep their full value
    in ``x_out``; a stable sort on the masked keys reproduces it exactly. CUB flips the sign bit
    of signed keys first, so over the full width negative keys sort first (a plain signed sort),
    while over fewer bits the sign bit is not looked at (the low bits, unsigned).
    """
    _check("x", x, 1)
    _check("x_out", x_out, 1, (x.dtype,))
    _check("iota_out", iota_out, 1, (x.dtype,))
    if not isinstance(end_bit, int) or isinstance(end_bit, bool) or not 0 < end_bit <= torch.iinfo(x.dtype).bits:
        raise ValueError(f"megablocks_ops.sort: 'end_bit' must be an int in [1, {torch.iinfo(x.dtype).bits}], "
                         f"got {end_bit!r}")
    if x_out.shape != x.shape or iota_out.shape != x.shape:
        raise ValueError("megablocks_ops.sort: 'x_out' and 'iota_out' must have the shape of 'x'")
    kernel = x.dtype != torch.int64 and end_bit < 16 and x_out.is_contiguous() and iota_out.is_contiguous() \
        and _ours("sort", x, 1 << end_bit)
    if kernel:
        kernel(x.contiguous(), end_bit, x_out, iota_out)
        return
    keys = x.long()  # (no branch on x's size: the sparse dMoE sorts a data-dependent number of blocks)
    if end_bit < torch.iinfo(x.dtype).bits:
        keys = keys & ((1 << end_bit) - 1)
    order = torch.sort(keys, stable=True).indices
    x_out.copy_(x[order])
    iota_out.copy_(order.to(x.dtype))


def histogram(x: torch.Tensor, max_val: int) -> torch.Tensor:
    """int32 counts of the values ``0 .. max_val-1`` (others ignored), per row if ``x`` is 2-D."""
    if not isinstance(x, torch.Tensor) or x.ndim not in (1, 2) or x.dtype not in _INT_DTYPES:
        raise ValueError("megablocks_ops.histogram: 'x' must be a 1-D or 2-D integer tensor")
    num_bins = int(max_val)
    kernel = x.ndim == 1 and 0 < num_bins and _ours("histogram", x, num_bins)
    if kernel:
        return kernel(x.contiguous(), num_bins)
    rows = x.view(1, -1) if x.ndim == 1 else x
    values = rows.long()
    inside = (values >= 0) & (values < num_bins)
    # Fixed-size scatter-add (no boolean indexing, no branch on the size, which is data-dependent
    # in the sparse dMoE): values outside [0, max_val) land in one extra bin that is dropped.
    trash = rows.shape[0] * num_bins
    flat = values + torch.arange(rows.shape[0], device=x.device)[:, None] * num_bins
    flat = torch.where(inside, flat, trash).flatten()
    counts = torch.zeros(trash + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    out = counts[:trash].view(rows.shape[0], num_bins)
    return out.flatten() if x.ndim == 1 else out


def _may_alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage; always assumed under ``torch.compile``, where storage
    cannot be asked for (and inductor fuses the extra copy anyway)."""
    if torch.compiler.is_compiling():
        return True
    return bool(a.numel() and b.numel()) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _cumsum(x, dim, out, exclusive):
    _check("x", x, 2)
    _check("out", out, 2, (x.dtype,))
    if dim != 1:
        raise ValueError(f"megablocks_ops: cumsum supports only dim=1 (the contiguous one), got {dim}")
    if out.shape != x.shape:
        raise ValueError(f"megablocks_ops: 'out' must have the shape of 'x' {tuple(x.shape)}, got {tuple(out.shape)}")
    if _may_alias(x, out):
        # In place (CUB's scans allow it): through a temporary, as the scan reads what it writes.
        total = torch.cumsum(x, dim=1, dtype=x.dtype)
        out.copy_(total - x if exclusive else total)
        return
    # One launch for the inclusive scan, written straight into the caller's buffer (MegaBlocks
    # hands an empty one); the exclusive scan subtracts the input in place: two.
    torch.cumsum(x, dim=1, dtype=x.dtype, out=out)
    if exclusive:
        out.sub_(x)


def inclusive_cumsum(x: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    _cumsum(x, dim, out, exclusive=False)


def exclusive_cumsum(x: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    _cumsum(x, dim, out, exclusive=True)


def indices(padded_bins: torch.Tensor, block_size: int, output_block_rows: int,
            output_block_columns: int, out: torch.Tensor) -> None:
    """The block-sparse topology's column indices: block row ``r`` of expert ``e`` holds
    columns ``e * output_block_columns + (0 .. output_block_columns-1)``."""
    _check("padded_bins", padded_bins, 1, (torch.int32,))
    _check("out", out, 1, (torch.int16,))
    if out.numel() != output_block_rows * output_block_columns:
        raise ValueError("megablocks_ops.indices: 'out' must have output_block_rows * output_block_columns elements")
    # No branch on the sizes and no boolean indexing: the sparse dMoE's row count is data-dependent,
    # and this must trace under torch.compile (empty tensors need no special case). Seven launches:
    # int32 indices (no int64 casts), the product and sum in one add that stores int16 (what the
    # cast did), and the select written straight into ``out``.
    block_ends = padded_bins.div(block_size, rounding_mode="floor")  # padded_bins >= 0
    rows = torch.arange(output_block_rows, dtype=torch.int32, device=out.device)
    expert = torch.searchsorted(block_ends, rows, right=True, out_int32=True)
    cols = torch.arange(output_block_columns, dtype=torch.int32, device=out.device)
    values = torch.empty((output_block_rows, output_block_columns), dtype=torch.int16, device=out.device)
    torch.add(cols[None, :], expert[:, None], alpha=output_block_columns, out=values)
    # Rows past the last expert's blocks are never written by the CUDA kernel; keep them as they are.
    covered = (expert < padded_bins.numel())[:, None]
    view = out.view(output_block_rows, output_block_columns)
    torch.where(covered, values, view, out=view)


def replicate_forward(x: torch.Tensor, bins: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b, j] = x[b, e]`` for every column ``j`` in bin ``e`` (bins: inclusive ends)."""
    if x.ndim != 2 or out.ndim != 2 or out.dtype != x.dtype or x.shape[0] != out.shape[0]:
        raise ValueError("megablocks_ops.replicate_forward: x and out must be 2-D, same dtype and batch")
    _check("bins", bins, 1, (torch.int32,))
    if x.shape[1] != bins.shape[0]:
        raise ValueError("megablocks_ops.replicate_forward: x must have one column per bin")
    if out.numel() == 0:
        return
    counts = torch.diff(bins.long(), prepend=bins.new_zeros(1, dtype=torch.long))
    out.copy_(torch.repeat_interleave(x, counts, dim=1, output_size=out.shape[1]))


def replicate_backward(grad: torch.Tensor, bins: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b, e] = sum of grad[b, j]`` over the columns ``j`` of bin ``e``."""
    if grad.ndim != 2 or out.ndim != 2 or grad.shape[0] != out.shape[0]:
        raise ValueError("megablocks_ops.replicate_backward: grad and out must be 2-D with the same batch")
    _check("bins", bins, 1, (torch.int32,))
    if out.shape[1] != bins.shape[0]:
        raise ValueError("megablocks_ops.replicate_backward: out must have one column per bin")
    counts = torch.diff(bins.long(), prepend=bins.new_zeros(1, dtype=torch.long))
    owner = torch.repeat_interleave(torch.arange(bins.shape[0], device=grad.device), counts,
                                    output_size=grad.shape[1])
    acc = torch.zeros(out.shape, dtype=torch.float32, device=grad.device)
    acc.index_add_(1, owner, grad.float())
    out.copy_(acc)  # copy_ casts: no separate cast launch
