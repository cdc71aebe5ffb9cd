"""The ``megablocks_ops`` stand-in (megablocks_ascend/native/megablocks_ops.py) against the
semantics of upstream MegaBlocks' CUDA extension (csrc/ of databricks/megablocks):

* ``sort``: ``cub::DeviceRadixSort::SortPairs`` over key bits ``[0, end_bit)`` with values
  ``iota`` in the key dtype -- stable, keys keep their full value in ``x_out``. CUB sorts signed
  keys by flipping the sign bit first ("twiddling"), so a sort over all bits orders negatives
  first, while a sort over fewer bits sees only the raw low bits.
* ``histogram``: ``cub::DeviceHistogram::HistogramEven`` with levels ``0..max_val`` per row:
  int32 counts, values outside ``[0, max_val)`` ignored, 1-D in -> 1-D out.
* ``inclusive_cumsum`` / ``exclusive_cumsum``: ``cub::DeviceScan`` along dim 1 of a 2-D
  int16/int32/int64 tensor (dim must be 1).
* ``indices`` (csrc/indices.h): for bin ``b``, block rows ``padded_bins[b-1] / block_size`` to
  ``padded_bins[b] / block_size`` (integer division) get ``short(b * columns + c)`` in column
  ``c``; rows outside every bin are not written.
* ``replicate_forward`` (csrc/replicate.h): ``out[i, j] = x[i, b]`` for ``j`` in bin ``b``;
  ``replicate_backward``: the per-bin segmented sum of ``grad``.

Each is checked against a plain Python loop written from those descriptions, directly and
through MegaBlocks' own wrappers (``megablocks.ops.sort`` etc., which megablocks-ascend does
not replace and which call whatever ``megablocks_ops`` module was imported).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import megablocks.ops as mb_ops
from megablocks_ascend.native import megablocks_ops as native

INT_DTYPES = (torch.int16, torch.int32, torch.int64)
BITS = {torch.int16: 16, torch.int32: 32, torch.int64: 64}


def test_megablocks_wrappers_use_the_stand_in():
    for name in ("sort", "histogram", "cumsum", "replicate", "topology"):
        assert importlib.import_module(f"megablocks.ops.{name}").ops is native, name


# ---------------------------------------------------------------------------------------------
# sort


def sort_loop(values, end_bit, bits):
    """Stable sort on key bits [0, end_bit) of CUB's twiddled key (sign bit flipped)."""
    def key(v):
        u = v & ((1 << bits) - 1)  # two's complement bits
        u ^= 1 << (bits - 1)  # CUB's TwiddleIn for signed integers
        return u & ((1 << end_bit) - 1)
    order = sorted(range(len(values)), key=lambda i: key(values[i]))
    return [values[i] for i in order], order


def _sort_case(dtype, end_bit, high_bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << min(end_bit, 12), (n,), generator=g)  # many duplicates: stability
    if high_bits:  # bits above end_bit set, and they must not take part in the order
        values = values + (torch.randint(1, 1 << min(BITS[dtype] - 1 - end_bit, 8), (n,), generator=g) << end_bit)
    return values.to(dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("end_bit, high_bits", [(3, False), (3, True), (5, True), (8, True)])
def test_sort_low_bits(dtype, end_bit, high_bits):
    x = _sort_case(dtype, end_bit, high_bits, 300, end_bit + BITS[dtype])
    if high_bits:
        assert bool((x.long() >> end_bit).ne(0).all())
    x_before = x.clone()
    x_out, iota_out = torch.empty_like(x), torch.empty_like(x)
    native.sort(x, end_bit, x_out, iota_out)
    expected_values, expected_order = sort_loop(x.tolist(), end_bit, BITS[dtype])
    assert x_out.tolist() == expected_values
    assert iota_out.tolist() == expected_order
    assert iota_out.dtype == x.dtype
    assert torch.equal(x, x_before)
    # MegaBlocks' wrapper returns (x_out, iota_out) in the key dtype.
    w_values, w_order = mb_ops.sort(x, end_bit)
    assert w_values.tolist() == expected_values and w_order.tolist() == expected_order
    assert w_values.dtype == w_order.dtype == dtype


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_sort_negative_keys_below_full_width(dtype):
    """With end_bit below the width, CUB sees the raw low bits of negative keys."""
    x = torch.tensor([5, -1, 3, -8, 0, 7, -3, 3, -1], dtype=dtype)
    x_out, iota_out = torch.empty_like(x), torch.empty_like(x)
    native.sort(x, 4, x_out, iota_out)
    expected_values, expected_order = sort_loop(x.tolist(), 4, BITS[dtype])
    assert x_out.tolist() == expected_values and iota_out.tolist() == expected_order


def test_sort_full_width_default_end_bit_int64():
    """megablocks.ops.sort without end_bit sorts on every bit of the dtype: signed order."""
    x = torch.tensor([5, -1, 3, -8, 0, 7, -3, 3, -1], dtype=torch.int64)
    expected_values, expected_order = sort_loop(x.tolist(), 64, 64)
    assert expected_values == sorted(x.tolist())  # twiddling gives the signed order
    values, order = mb_ops.sort(x)
    assert values.tolist() == expected_values and order.tolist() == expected_order


@pytest.mark.parametrize("dtype", (torch.int16, torch.int32))
def test_sort_full_width_negative_keys(dtype):
    x = torch.tensor([5, -1, 3, -8, 0, 7, -3, 3, -1], dtype=dtype)
    expected_values, expected_order = sort_loop(x.tolist(), BITS[dtype], BITS[dtype])
    assert expected_values == sorted(x.tolist())
    values, order = mb_ops.sort(x)
    assert values.tolist() == expected_values and order.tolist() == expected_order


def test_sort_empty_and_routing_use():
    x = torch.zeros(0, dtype=torch.int32)
    values, order = mb_ops.sort(x, 3)
    assert values.numel() == 0 and order.numel() == 0
    # The way MegaBlocks sorts expert ids: 0..num_experts-1 with sort_end_bit = bit length.
    top = torch.tensor([3, 1, 0, 3, 2, 1, 1, 0], dtype=torch.int32)
    bin_ids, indices = mb_ops.sort(top, 2)
    assert bin_ids.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert indices.tolist() == [2, 7, 1, 5, 6, 4, 0, 3]


# ---------------------------------------------------------------------------------------------
# histogram


def histogram_loop(rows, max_val):
    out = []
    for row in rows:
        counts = [0] * max_val
        for v in row:
            if 0 <= v < max_val:
                counts[v] += 1
        out.append(counts)
    return out


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("max_val", [1, 5, 64])
def test_histogram_1d(dtype, max_val):
    g = torch.Generator().manual_seed(max_val)
    x = torch.randint(-3, max_val + 4, (200,), generator=g).to(dtype)  # some outside [0, max_val)
    assert bool(((x < 0) | (x >= max_val)).any())
    expected = histogram_loop([x.tolist()], max_val)[0]
    for out in (native.histogram(x, max_val), mb_ops.histogram(x, max_val)):
        assert out.dtype == torch.int32 and out.shape == (max_val,)
        assert out.tolist() == expected


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_histogram_2d(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-2, 9, (4, 33), generator=g).to(dtype)
    out = native.histogram(x, 6)
    assert out.dtype == torch.int32 and out.shape == (4, 6)
    assert out.tolist() == histogram_loop(x.tolist(), 6)
    assert mb_ops.histogram(x, 6).tolist() == out.tolist()


def test_histogram_empty_input():
    assert native.histogram(torch.zeros(0, dtype=torch.int32), 4).tolist() == [0, 0, 0, 0]
    assert native.histogram(torch.zeros(3, 0, dtype=torch.int64), 2).tolist() == [[0, 0]] * 3


# ---------------------------------------------------------------------------------------------
# cumsum


def cumsum_loop(rows, exclusive):
    out = []
    for row in rows:
        running, acc = 0, []
        for v in row:
            if exclusive:
                acc.append(running)
            running += v
            if not exclusive:
                acc.append(running)
        out.append(acc)
    return out


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum_2d(dtype, exclusive):
    g = torch.Generator().manual_seed(int(exclusive))
    x = torch.randint(-50, 100, (3, 37), generator=g).to(dtype)
    out = torch.full_like(x, 12345)
    fn = native.exclusive_cumsum if exclusive else native.inclusive_cumsum
    fn(x, 1, out)
    assert out.dtype == dtype
    assert out.tolist() == cumsum_loop(x.tolist(), exclusive)
    wrapper = mb_ops.exclusive_cumsum if exclusive else mb_ops.inclusive_cumsum
    assert wrapper(x, 1).tolist() == out.tolist()


@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum_in_place(exclusive):
    """``out`` may be ``x`` itself (CUB's scans allow it): the result is the scan of ``x`` as it
    was before the call, not of values the scan has already overwritten."""
    x = torch.randint(-50, 100, (2, 29), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    want = cumsum_loop(x.tolist(), exclusive)
    fn = native.exclusive_cumsum if exclusive else native.inclusive_cumsum
    y = x.clone()
    fn(x, 1, x)
    assert x.tolist() == want

    def in_place(t):  # traced: storage cannot be asked for there, aliasing is assumed
        fn(t, 1, t)
        return t

    assert torch.compile(in_place, fullgraph=True)(y).tolist() == want


def test_cumsum_out_of_another_shape_is_refused():
    x = torch.ones(2, 3, dtype=torch.int32)
    out = torch.full((2, 4), 7, dtype=torch.int32)
    with pytest.raises(ValueError, match="'out' must have the shape of 'x'"):
        native.inclusive_cumsum(x, 1, out)
    assert out.eq(7).all()  # untouched


@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum_1d_through_megablocks(exclusive):
    """megablocks.ops.*_cumsum(x, 0) on a 1-D tensor: viewed as one row, then squeezed
    (a single expert gives a 0-d tensor, which MegaBlocks' layers promote back to 1-D)."""
    wrapper = mb_ops.exclusive_cumsum if exclusive else mb_ops.inclusive_cumsum
    x = torch.tensor([3, 0, 5, 2, 0, 1], dtype=torch.int32)
    out = wrapper(x, 0)
    assert out.dtype == torch.int32 and out.tolist() == cumsum_loop([x.tolist()], exclusive)[0]
    single = wrapper(torch.tensor([4], dtype=torch.int32), 0)
    assert single.shape == () and single.item() == (0 if exclusive else 4)


def test_cumsum_only_along_dim_1():
    x = torch.ones(2, 3, dtype=torch.int32)
    with pytest.raises(Exception):
        native.inclusive_cumsum(x, 0, torch.empty_like(x))
    with pytest.raises(Exception):
        native.exclusive_cumsum(x, 0, torch.empty_like(x))


# ---------------------------------------------------------------------------------------------
# indices (the block-sparse topology's column indices)


def indices_loop(padded_bins, block_size, rows, columns, initial):
    """csrc/indices.h: one CUDA block per (bin, row offset); rows of bin b are
    [padded_bins[b-1] / block_size, padded_bins[b] / block_size)."""
    out = list(initial)
    for b in range(len(padded_bins)):
        start = (padded_bins[b - 1] if b > 0 else 0) // block_size
        end = padded_bins[b] // block_size
        for r in range(start, end):
            for c in range(columns):
                value = c + b * columns
                out[r * columns + c] = (value + 2**15) % 2**16 - 2**15  # C++ cast to short
    return out


@pytest.mark.parametrize("padded_bins, block_size, rows, columns", [
    ([4, 4, 12, 20, 20], 4, 5, 3),  # empty bins (first bin non-empty, middle and last empty)
    ([0, 8, 8, 24], 8, 3, 7),  # empty first bin
    ([5, 9, 16], 4, 4, 2),  # ends not on the block: integer division
    ([8, 16], 8, 4, 3),  # more output rows than the bins cover: the extra rows stay untouched
    ([1, 2, 3], 1, 3, 12000),  # values past 32767 wrap as the CUDA kernel's short store does
])
def test_indices(padded_bins, block_size, rows, columns):
    pb = torch.tensor(padded_bins, dtype=torch.int32)
    initial = [-7] * (rows * columns)
    out = torch.tensor(initial, dtype=torch.int16)
    native.indices(pb, block_size, rows, columns, out)
    expected = indices_loop(padded_bins, block_size, rows, columns, initial)
    assert out.tolist() == expected
    if padded_bins[-1] // block_size == rows:
        # MegaBlocks' wrapper starts from torch.empty: compare only when every row is written.
        assert mb_ops.topology(pb, block_size, rows, columns).tolist() == expected


def test_indices_traces_under_compile():
    """The sparse dMoE's topology under torch.compile: the same values, rows past the bins kept."""
    pb = torch.tensor([4, 4, 12, 20, 20], dtype=torch.int32)

    def topology(padded_bins, out):
        native.indices(padded_bins, 4, 6, 3, out)
        return out

    want = indices_loop(pb.tolist(), 4, 6, 3, [-7] * 18)
    got = torch.compile(topology, fullgraph=True)(pb, torch.full((18,), -7, dtype=torch.int16))
    assert got.tolist() == want


def test_indices_match_dmoe_topology_shape():
    """How dMoE calls it: rows = padded tokens / block, columns = ffn_hidden / block."""
    bins_tokens = torch.tensor([0, 5, 0, 3], dtype=torch.int32)
    block = 4
    padded = torch.cumsum((bins_tokens + block - 1) // block * block, 0).to(torch.int32)
    rows, columns = int(padded[-1]) // block, 3
    out = mb_ops.topology(padded, block, rows, columns)
    assert out.dtype == torch.int16 and out.shape == (rows * columns,)
    # Expert 1 owns block rows 0-1, expert 3 block row 2.
    assert out.view(rows, columns).tolist() == [[3, 4, 5], [3, 4, 5], [9, 10, 11]]


# ---------------------------------------------------------------------------------------------
# replicate


def replicate_forward_loop(x_rows, bins):
    out = []
    for row in x_rows:
        acc, start = [], 0
        for b, end in enumerate(bins):
            acc.extend([row[b]] * (end - start))
            start = end
        out.append(acc)
    return out


def replicate_backward_loop(grad_rows, bins):
    out = []
    for row in grad_rows:
        acc, start = [], 0
        for end in bins:
            acc.append(sum(row[start:end]))
            start = end
        out.append(acc)
    return out


BINS = [0, 3, 3, 7, 8, 8]  # empty first, middle and last bins


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.float16, torch.float32])
def test_replicate_forward(dtype):
    x = (torch.arange(2 * len(BINS)).view(2, len(BINS)) * 3 - 5).to(dtype)
    out = torch.empty(2, BINS[-1], dtype=dtype)
    native.replicate_forward(x, torch.tensor(BINS, dtype=torch.int32), out)
    assert out.tolist() == replicate_forward_loop(x.tolist(), BINS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_replicate_backward(dtype):
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(3, BINS[-1], generator=g).to(dtype)
    out = torch.full((3, len(BINS)), float("nan"), dtype=dtype)
    native.replicate_backward(grad, torch.tensor(BINS, dtype=torch.int32), out)
    expected = torch.tensor(replicate_backward_loop(grad.double().tolist(), BINS), dtype=torch.float64)
    magnitude = torch.tensor(replicate_backward_loop(grad.double().abs().tolist(), BINS), dtype=torch.float64)
    # One rounding to the dtype after summing at most 4 values (float32 sums, or CUB's in half).
    bound = 4 * torch.finfo(dtype).eps * magnitude
    assert bool(((out.double() - expected).abs() <= bound).all())
    assert out[:, [0, 2, 5]].eq(0).all()  # empty bins get exactly zero


def test_replicate_through_megablocks_with_autograd():
    bins = torch.tensor(BINS, dtype=torch.int32)
    x = torch.tensor([[1.0, 2.0, -3.0, 4.0, 5.0, 6.0], [0.5, -1.0, 2.0, 8.0, -2.0, 1.0]], requires_grad=True)
    out = mb_ops.replicate(x, bins, BINS[-1])
    assert out.tolist() == replicate_forward_loop(x.tolist(), BINS)
    grad = torch.arange(2 * BINS[-1], dtype=torch.float32).view(2, BINS[-1])
    out.backward(grad)
    assert x.grad.tolist() == replicate_backward_loop(grad.tolist(), BINS)


def test_replicate_moe_expert_parallel_use():
    """layers/moe.py: int32 expert ids (1, E) replicated by the received counts."""
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    bins = mb_ops.inclusive_cumsum(counts, 0)
    experts = torch.remainder(torch.arange(4, dtype=torch.int32), 2)
    out = mb_ops.replicate(experts.unsqueeze(0), bins, int(counts.sum())).flatten()
    assert out.dtype == torch.int32 and out.tolist() == [0, 0, 0, 0, 0, 1]
