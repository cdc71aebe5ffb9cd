"""The sparse dMoE's topology in one launch (``kernels/topology.py``), and the block-sparse products
on a topology with spare block rows.

The kernel is held to the plain-PyTorch reference (a search of each block row's expert and a
stable sort of the blocks by column: ``reference/blocksparse.py``) and, without spare rows, to
upstream's own sequence (``ops.topology``, ``stk.ops.row_indices`` and the sort / histogram /
cumsum transpose: ``backends.upstream_topology``) and to MegaBlocks' ``ParallelDroplessMLP.topology``
as shipped. Every element of every output is written (the outputs are poisoned first).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megablocks_ascend
from megablocks_ascend import backends, library, ops, reference
from megablocks_ascend.kernels import blocksparse
from megablocks_ascend.kernels import topology as topology_kernels
from megablocks_ascend.validation import RoutingArgumentError

NAMES = ("row_indices", "column_indices", "offsets", "column_indices_t", "offsets_t", "block_offsets_t")


def _padded_bins(counts, block, device, dtype=torch.int32):
    counts = torch.as_tensor(counts)
    return torch.cumsum((counts + block - 1) // block * block, 0).to(dtype).to(device)


def _assert_same(got, want, what=""):
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype, (what, name, g.dtype, w.dtype)
        assert torch.equal(g.cpu(), w.cpu()), (what, name, g, w)


CASES = [
    # (counts per expert, block size, blocks per row, spare block rows)
    pytest.param([5], 4, 1, 0, id="one-expert"),
    pytest.param([3, 0, 9, 4], 4, 2, 0, id="empty-expert"),
    pytest.param([0, 0, 0], 4, 3, 2, id="no-tokens"),
    pytest.param([1, 8, 2, 0, 7, 4], 4, 3, 5, id="spare-rows"),
    pytest.param([0, 0, 17], 4, 5, 3, id="leading-empty"),
    pytest.param([130, 1, 0, 257], 128, 6, 4, id="block-128"),
    pytest.param(list(range(40)), 8, 2, 40, id="40-experts"),
    pytest.param([3] * 5, 4, 300, 1, id="wide-rows"),  # BLOCK_K 512: one block row per tile
]


@pytest.mark.parametrize("counts,block,bpr,spare", CASES)
def test_kernel_matches_reference(counts, block, bpr, spare, device, poison_empty):
    poison_empty(topology_kernels)
    padded_bins = _padded_bins(counts, block, device)
    rows = int(padded_bins[-1]) // block + spare
    got = topology_kernels.topology(padded_bins, block, rows, bpr)
    _assert_same(got, reference.blocksparse.topology(padded_bins, block, rows, bpr))


@pytest.mark.parametrize("programs", [1, 2, 7])
def test_kernel_result_does_not_depend_on_the_grid(programs, device):
    padded_bins = _padded_bins([1, 8, 2, 0, 7, 4, 30, 1], 4, device)
    rows = int(padded_bins[-1]) // 4 + 3
    want = reference.blocksparse.topology(padded_bins, 4, rows, 3)
    _assert_same(topology_kernels.topology(padded_bins, 4, rows, 3, num_programs=programs), want)


def test_int64_padded_bins(device):
    padded_bins = _padded_bins([5, 0, 9], 4, device, torch.int64)
    rows = int(padded_bins[-1]) // 4 + 2
    _assert_same(topology_kernels.topology(padded_bins, 4, rows, 3),
                 reference.blocksparse.topology(padded_bins, 4, rows, 3))


@pytest.mark.parametrize("counts,block,bpr,spare", CASES)
def test_without_spare_rows_it_is_upstreams_topology(counts, block, bpr, spare, device):
    """With exactly ``padded_bins[-1] / B`` block rows: upstream's sequence (the live part of a
    topology with spare rows is the same, checked against it too)."""
    padded_bins = _padded_bins(counts, block, device)
    rows = int(padded_bins[-1]) // block
    with megablocks_ascend.use_backend("torch"):  # (stk's row_indices at any block size)
        want = backends.upstream_topology(padded_bins, block, rows, bpr)
    with megablocks_ascend.use_backend("ascend"):
        _assert_same(ops.topology(padded_bins, block, rows, bpr), want, "exact")
        spare_rows = ops.topology(padded_bins, block, rows + spare, bpr)
    live = rows * bpr
    assert int(spare_rows[2][-1]) == live and int(spare_rows[4][-1]) == live
    assert torch.equal(spare_rows[2][:rows + 1].cpu(), want[2].cpu())
    assert torch.equal(spare_rows[4].cpu(), want[4].cpu())
    for i in (0, 1, 3, 5):
        assert torch.equal(spare_rows[i][:live].cpu(), want[i].cpu()), NAMES[i]


def test_spare_blocks_belong_to_no_row(device):
    padded_bins = _padded_bins([5, 0, 9], 4, device)  # 8 + 12 rows: 5 block rows of 4
    live_rows, bpr, spare = 5, 3, 2
    with megablocks_ascend.use_backend("ascend"):  # (upstream's sequence, cuda's, has no spare rows)
        ri, ci, off, cit, offt, bot = ops.topology(padded_bins, 4, live_rows + spare, bpr)
    b = torch.arange(live_rows * bpr, (live_rows + spare) * bpr)
    assert off.tolist()[live_rows:] == [live_rows * bpr] * (spare + 1)
    assert torch.equal(ri[b].cpu().long(), b // bpr) and torch.equal(ci[b].cpu().long(), b % bpr)
    assert torch.equal(cit[b].cpu().long(), b // bpr) and torch.equal(bot[b].cpu().long(), b)


def test_the_layer_topology_is_megablocks_own_at_exact_sizes(device, monkeypatch):
    """The patched ``ParallelDroplessMLP.topology`` builds the same ``stk.Matrix`` as MegaBlocks'
    method as shipped, for a buffer of ``padded_bins[-1]`` rows."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import ParallelDroplessMLP
    with megablocks_ascend.use_backend("ascend"):
        args = Arguments(hidden_size=32, ffn_hidden_size=384, moe_num_experts=4, moe_top_k=2, device=device,
                         bf16=False, fp16=False)
        mlp = ParallelDroplessMLP(args)
        padded_bins = _padded_bins([130, 0, 7, 300], 128, device)
        x = torch.empty(int(padded_bins[-1]), 32, device=device)
        ours = mlp.topology(x, padded_bins)
        shipped = ParallelDroplessMLP.topology.__wrapped__(mlp, x, padded_bins)
    assert ours.shape == shipped.shape and ours.data.shape == shipped.data.shape and ours.data.is_meta
    for name in NAMES:
        a, b = getattr(ours, name), getattr(shipped, name)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_dispatch_records_the_backend(backend, device):
    padded_bins = _padded_bins([3, 4], 4, device)
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        ops.topology(padded_bins, 4, 3, 2)
    assert [(c.op, c.backend) for c in calls] == [("topology", backend)]


BAD = [
    (dict(padded_bins=torch.zeros(2, 2, dtype=torch.int32)), "padded_bins", "must be 1-D"),
    (dict(padded_bins=torch.zeros(0, dtype=torch.int32)), "padded_bins", "one entry per expert"),
    (dict(padded_bins=torch.zeros(2)), "padded_bins", "dtype"),
    (dict(block_size=0), "block_size", ">= 1"),
    (dict(block_rows=-1), "block_rows", ">= 0"),
    (dict(block_rows=2.0), "block_rows", "Python int"),
    (dict(blocks_per_row=0), "blocks_per_row", ">= 1"),
    (dict(block_rows=32768), "block_rows", "int16"),
    (dict(blocks_per_row=16384), "blocks_per_row", "int16"),
]


@pytest.mark.parametrize("change,arg,match", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_are_refused_before_any_launch(change, arg, match, device):
    a = dict(padded_bins=_padded_bins([3, 4], 4, device), block_size=4, block_rows=3, blocks_per_row=2)
    a.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        with pytest.raises(RoutingArgumentError, match=f"^topology: argument '{arg}'.*{match}"):
            ops.topology(**a)
    assert calls == []


@pytest.mark.parametrize("padded_bins,rows,arg", [([4, 12], 2, "block_rows"), ([4, 2], 3, "padded_bins"),
                                                  ([4, 6], 3, "padded_bins")])
def test_value_checks(padded_bins, rows, arg, device, monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    with pytest.raises(RoutingArgumentError, match=f"^topology: argument '{arg}'"):
        ops.topology(torch.tensor(padded_bins, dtype=torch.int32, device=device), 4, rows, 2)
    ops.topology(torch.tensor([4, 12], dtype=torch.int32, device=device), 4, 3, 2)  # 3 rows hold it


def test_custom_op_opcheck(device):
    padded_bins = _padded_bins([3, 0, 4], 4, device)
    with megablocks_ascend.use_backend("ascend"):
        torch.library.opcheck(library.topology, (padded_bins, 4, 5, 2))


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=12), block=st.sampled_from([1, 2, 4, 8]),
       bpr=st.integers(1, 6), spare=st.integers(0, 6))
def test_property_kernel_equals_reference(counts, block, bpr, spare):
    padded_bins = _padded_bins(counts, block, "cpu")
    rows = int(padded_bins[-1]) // block + spare
    _assert_same(topology_kernels.topology(padded_bins, block, rows, bpr),
                 reference.blocksparse.topology(padded_bins, block, rows, bpr))


# ------------------------------------------------------------------------------------------
# The block-sparse products on a topology with spare blocks: sdd writes them as zeros without
# computing them; dsd and dds never read them (NaN there changes nothing).

B = 16


def _spare_matrix(device, dtype=torch.float32, spare=3):
    counts = [20, 0, 35, 9]
    padded_bins = _padded_bins(counts, B, device)
    live_rows = int(padded_bins[-1]) // B
    bpr = 2
    with megablocks_ascend.use_backend("ascend"):  # (upstream's sequence, cuda's, has no spare rows)
        meta = ops.topology(padded_bins, B, live_rows + spare, bpr)
    shape = ((live_rows + spare) * B, len(counts) * bpr * B)
    return dict(zip(NAMES, meta)), shape, live_rows * bpr


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_sdd_writes_spare_blocks_as_zeros(backend, device):
    m, shape, live = _spare_matrix(device)
    lhs = torch.randn(shape[0], 24, device=device)
    rhs = torch.randn(24, shape[1], device=device)
    out = torch.full((m["row_indices"].shape[0], B, B), float("nan"), device=device)
    with megablocks_ascend.use_backend(backend):
        from stk.backend import triton_kernels as stk_kernels
        stk_kernels.sdd(lhs, rhs, shape, out, m["offsets"], m["row_indices"], m["column_indices"])
    assert torch.equal(out[live:].cpu(), torch.zeros_like(out[live:]).cpu())
    dense = (lhs.double() @ rhs.double()).cpu()
    for b in range(live):
        r, c = int(m["row_indices"][b]), int(m["column_indices"][b])
        torch.testing.assert_close(out[b].double().cpu(), dense[r * B:(r + 1) * B, c * B:(c + 1) * B],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("transpose", [False, True])
def test_dsd_and_dds_leave_out_spare_blocks(backend, transpose, device):
    m, shape, live = _spare_matrix(device)
    nnz = m["row_indices"].shape[0]
    data = torch.randn(nnz, B, B, device=device)
    data[live:] = float("nan")  # never read
    dense = torch.zeros(shape, dtype=torch.float64)
    for b in range(live):
        r, c = int(m["row_indices"][b]), int(m["column_indices"][b])
        dense[r * B:(r + 1) * B, c * B:(c + 1) * B] = data[b].double().cpu()
    seen = dense.t() if transpose else dense
    meta = (m["offsets"], m["row_indices"], m["column_indices"], m["offsets_t"], m["column_indices_t"],
            m["block_offsets_t"])
    from stk.backend import triton_kernels as stk_kernels
    rhs = torch.randn(seen.shape[1], 24, device=device)
    out = torch.full((seen.shape[0], 24), float("nan"), device=device)
    lhs = torch.randn(24, seen.shape[0], device=device)
    out2 = torch.full((24, seen.shape[1]), float("nan"), device=device)
    with megablocks_ascend.use_backend(backend):
        stk_kernels.dsd(tuple(seen.shape), data, *meta, transpose, rhs, out)
        stk_kernels.dds(lhs, tuple(seen.shape), data, *meta, transpose, out2)
    torch.testing.assert_close(out.double().cpu(), seen @ rhs.double().cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2.double().cpu(), lhs.double().cpu() @ seen, rtol=1e-5, atol=1e-5)


def test_spare_blocks_pass_the_value_checks(device, monkeypatch):
    """``MEGABLOCKS_ASCEND_CHECKS=1`` accepts a topology whose ``offsets`` end before its blocks (the
    spare ones are no part of the matrix) and still checks the live ones."""
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    m, shape, live = _spare_matrix(device)
    from stk.backend import triton_kernels as stk_kernels
    out = torch.empty(m["row_indices"].shape[0], B, B, device=device)
    with megablocks_ascend.use_backend("torch"):
        stk_kernels.sdd(torch.randn(shape[0], 8, device=device), torch.randn(8, shape[1], device=device), shape, out,
                        m["offsets"], m["row_indices"], m["column_indices"])
        bad = m["row_indices"].clone()
        bad[live - 1] += 1
        with pytest.raises(Exception, match="'row_indices' is not consistent"):
            stk_kernels.sdd(torch.randn(shape[0], 8, device=device), torch.randn(8, shape[1], device=device), shape,
                            out, m["offsets"], bad, m["column_indices"])

