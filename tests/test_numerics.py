"""The scatters round once: fp16 results equal, bit for bit, the exact weighted sum rounded once.

MegaBlocks' own ``binned_scatter`` / ``padded_scatter`` tests compare with a numpy reference that
rounds each ``weight * row`` product to fp16 (numpy fp16 arithmetic) before summing, at
``rtol=5e-3, atol=0``. Our scatters (and the ``torch`` backend) multiply and sum in float32 and
round once. These tests choose inputs on which float32 arithmetic is exact, so "rounded once" has a
single right answer (float64, rounded by numpy), check ours against it bit for bit, and show that
the per-product reference differs from it, by up to its own rounding error, enough on results near
zero to fail a comparison at ``atol=0``. README.md ("Numerics") says the same.
"""

import numpy as np
import pytest
import torch

import megablocks.backend.kernels as kernels
import megablocks_ascend

TOKENS, HIDDEN, EXPERTS = 24, 40, 3
# x = m / 1024 with |m| < 2048 and w = n / 1024 with 0 <= n < 1024 are exact in fp16; each product
# m * n / 2**20 has |m * n| < 2**21, and a sum of top_k <= 4 of them stays below 2**23 / 2**20: exact
# in float32 (24-bit significand), so float32 accumulation equals the float64 value exactly.
SCALE = 2.0 ** -10


def _grid_values(shape, low, high):
    return torch.randint(low, high, shape, dtype=torch.int64).double() * SCALE


def _problem(layout, top_k):
    """A routing, each slot's row and weight on the exact grid, a few tokens whose two products
    nearly cancel (results in fp16's subnormal range), and the buffer the scatter reads."""
    n = TOKENS * top_k
    top = torch.randint(0, EXPERTS, (n,), dtype=torch.int32)
    bin_ids, indices = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=EXPERTS)
    bins = torch.cumsum(counts, 0).int()
    rows_per_slot = _grid_values((n, HIDDEN), -2047, 2048)
    weights = _grid_values((n,), 0, 1024)
    for t, w_int in ((0, 63), (1, 17), (2, 5), (3, 1023)):  # w * (m - (m - 1)) / 1024 = w / 2**20
        a, b = t * top_k, t * top_k + 1
        weights[a] = weights[b] = w_int * SCALE
        m = torch.randint(1024, 2048, (HIDDEN,), dtype=torch.int64).double()
        rows_per_slot[a] = m * SCALE
        rows_per_slot[b] = -(m - 1) * SCALE
        rows_per_slot[a + 2:a + top_k] = 0.0

    # Each expert's segment of buffer rows: its count (dropless), rounded up to 4 (padded) or a
    # capacity that drops some positions (binned).
    if layout == "dropless":
        seg = counts
    elif layout == "padded":
        seg = (counts + 3) // 4 * 4
    else:
        seg = torch.full_like(counts, int(counts.max()) - 1)
    row_of_slot = torch.full((n,), -1, dtype=torch.int64)
    pos = row = 0
    for e in range(EXPERTS):
        for j in range(int(counts[e])):
            if j < int(seg[e]):
                row_of_slot[indices[pos + j]] = row + j
        pos += int(counts[e])
        row += int(seg[e])
    buffer = torch.zeros((row, HIDDEN), dtype=torch.float64)
    kept = row_of_slot >= 0
    buffer[row_of_slot[kept]] = rows_per_slot[kept]
    assert (~kept).any() == (layout == "binned")

    x = buffer.half()
    assert torch.equal(x.double(), buffer) and torch.equal(weights.half().double(), weights)  # exact in fp16
    padded_bins = torch.cumsum(seg, 0).int()
    if layout == "dropless":
        args = (x, indices.int(), bin_ids.int(), weights.half(), bins, top_k)
    elif layout == "padded":
        args = (x, indices.int(), bin_ids.int(), weights.half(), bins, padded_bins, top_k)
    else:
        args = (x.view(EXPERTS, -1, HIDDEN), indices.int(), weights.half(), bins, top_k)
    return args, rows_per_slot, weights, kept


def _rounded_once(rows_per_slot, weights, kept, top_k):
    """The exact weighted sum per token (float64: exact here), rounded once to fp16 by numpy."""
    products = torch.where(kept[:, None], rows_per_slot * weights[:, None], 0.0)
    exact = products.view(TOKENS, top_k, HIDDEN).sum(dim=1)
    return torch.from_numpy(exact.numpy().astype(np.float16)), products


def _rounded_per_product(rows_per_slot, weights, kept, top_k):
    """MegaBlocks' test reference: numpy fp16 ``scale * row`` (one rounding per product), summed
    into a float64 array, then ``.half()``."""
    out = np.zeros((TOKENS, HIDDEN))
    x16, w16 = rows_per_slot.numpy().astype(np.float16), weights.numpy().astype(np.float16)
    for slot in np.flatnonzero(kept.numpy()):
        out[slot // top_k, :] += w16[slot] * x16[slot]
    return torch.from_numpy(out).half()


SCATTERS = {"dropless": kernels.scatter, "padded": kernels.padded_scatter, "binned": kernels.binned_scatter}


@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("layout", list(SCATTERS))
def test_fp16_scatter_rounds_once_and_the_per_product_reference_does_not(layout, top_k, backend):
    args, rows_per_slot, weights, kept = _problem(layout, top_k)
    once, products = _rounded_once(rows_per_slot, weights, kept, top_k)
    per_product = _rounded_per_product(rows_per_slot, weights, kept, top_k)

    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        ours = SCATTERS[layout](*args)
    assert [c.backend for c in calls] == [backend] and ours.dtype == torch.float16

    # Ours is the exact result rounded once, bit for bit (including the subnormal results).
    assert torch.equal(ours.view(torch.int16), once.view(torch.int16))
    assert (once[:4].abs() < torch.finfo(torch.float16).tiny).any()  # the cancelling tokens

    # The per-product reference is off by its own rounding of each product, no more ...
    differ = ours != per_product
    assert differ.any()
    fp16_rounding = (products.abs() * 2.0 ** -11).view(TOKENS, top_k, HIDDEN).sum(dim=1) + 2.0 ** -25
    last_place = torch.from_numpy(np.spacing(np.maximum(ours.abs().numpy(), per_product.abs().numpy())))
    assert ((ours.double() - per_product.double()).abs() <= fp16_rounding + last_place.double()).all()
    # ... which near zero is a large relative error, so MegaBlocks' own comparison fails.
    with pytest.raises(AssertionError, match="Not equal to tolerance rtol=0.005, atol=0"):
        np.testing.assert_allclose(ours.numpy(), per_product.numpy(), rtol=5e-3)
    print(f"{layout} top_k={top_k} {backend}: {int(differ.sum())}/{differ.numel()} elements differ from the "
          "per-product reference; 0 from the exact sum rounded once")


@pytest.mark.parametrize("top_k", [2, 4])
def test_upstream_binned_scatter_rounds_each_weighted_row_like_its_reference(upstream_kernels, top_k):
    """Upstream's kernel (in the interpreter) stores each weighted row in fp16 before summing over
    top_k, so it matches its own numpy reference here, and not the sum rounded once."""
    args, rows_per_slot, weights, kept = _problem("binned", top_k)
    once, _ = _rounded_once(rows_per_slot, weights, kept, top_k)
    per_product = _rounded_per_product(rows_per_slot, weights, kept, top_k)
    theirs = upstream_kernels["binned_scatter"](*args)
    assert torch.equal(theirs, per_product)
    assert not torch.equal(theirs, once)
