"""The block-sparse products as grouped GEMMs plus the layout copy (``bench/sparse_grouped.py``: the
form ``bench`` times beside ours, for an NPU's ``npu_grouped_matmul``) held to our kernels and to
the float64 dense products, on MegaBlocks' topology with and without spare block rows, and a whole
sparse dMoE step run on it against the step on ours."""

from __future__ import annotations

import pytest
import torch

import megablocks_ascend
from megablocks_ascend import ops
from megablocks_ascend.bench import sparse_grouped
from megablocks_ascend.kernels import blocksparse

B = 32  # block side (our kernels take 16-128)


def _problem(device, spare, counts=(40, 0, 70, 9), bpr=2, hidden=24, dtype=torch.float32):
    counts = torch.tensor(counts)
    padded_bins = torch.cumsum((counts + B - 1) // B * B, 0).int().to(device)
    rows = int(padded_bins[-1]) // B + spare
    with megablocks_ascend.use_backend("ascend"):
        ri, ci, off, cit, offt, bot = ops.topology(padded_bins, B, rows, bpr)
    experts = counts.numel()
    g = torch.Generator().manual_seed(0)
    t = rows * B
    live = int(padded_bins[-1])
    x = torch.randn(t, hidden, generator=g)
    x[live:] = 0  # the padded gather's spare rows
    w = torch.randn(experts * bpr * B, hidden, generator=g)
    meta = dict(offsets=off, row_indices=ri, column_indices=ci, offsets_t=offt, column_indices_t=cit,
                block_offsets_t=bot)
    return dict(x=x.to(device, dtype), w=w.to(device, dtype), meta=meta, shape=(t, experts * bpr * B),
                nnz=ri.numel(), experts=experts, bpr=bpr, rows=rows, live=live)


@pytest.mark.parametrize("spare", [0, 3])
def test_group_rows_cover_every_row(spare, device):
    p = _problem(device, spare)
    sizes = sparse_grouped.group_rows(p["meta"]["offsets"], p["meta"]["column_indices"], B, p["bpr"], p["experts"])
    assert sizes.tolist() == [64, 0, 96, 32 + spare * B]


def test_layout_copies_are_inverse(device):
    data = torch.randn(6 * 3, B, B, device=device)
    dense = sparse_grouped.dense_from_blocks(data, 3)
    assert dense.shape == (6 * B, 3 * B)
    assert torch.equal(dense[B:2 * B, 2 * B:3 * B], data[1 * 3 + 2])  # block row 1, block 2
    assert torch.equal(sparse_grouped.blocks_from_dense(dense, torch.empty_like(data)), data)


@pytest.mark.parametrize("spare", [0, 3])
def test_products_match_our_kernels(spare, device):
    p = _problem(device, spare)
    m = p["meta"]
    ours = torch.full((p["nnz"], B, B), float("nan"), device=device)
    theirs = torch.full_like(ours, float("nan"))
    args = (p["x"], p["w"].t(), p["shape"])
    blocksparse.sdd(*args, ours, m["offsets"], m["row_indices"], m["column_indices"])
    sparse_grouped.sdd(*args, theirs, m["offsets"], m["row_indices"], m["column_indices"])
    live = p["live"] // B * p["bpr"]
    torch.testing.assert_close(theirs[:live], ours[:live], rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs[live:], torch.zeros_like(theirs[live:]))  # zero rows times w
    data = ours
    meta = tuple(m[k] for k in ("offsets", "row_indices", "column_indices", "offsets_t", "column_indices_t",
                                "block_offsets_t"))
    for transpose, rhs in ((False, p["w"]), (True, torch.randn(p["shape"][0], 20, device=device))):
        shape = p["shape"][::-1] if transpose else p["shape"]
        want = torch.full((shape[0], rhs.shape[1]), float("nan"), device=device)
        got = torch.full_like(want, float("nan"))
        blocksparse.dsd(shape, data, *meta, transpose, rhs, want)
        sparse_grouped.dsd(shape, data, *meta, transpose, rhs, got)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_sparse_dmoe_step_runs_on_them(device, monkeypatch):
    """MegaBlocks' sparse dMoE, forward and backward, with stk's sdd and dsd swapped for the grouped
    form: the output and every gradient of the step on our kernels; the swap is undone after."""
    from test_sparse_static import _layer, _results
    layer, args = _layer("mlp", torch.float32, device)
    x = torch.randn(24, 2, 16, generator=torch.Generator().manual_seed(3)).to(device)
    want = _results(layer, args, x, "ascend")
    saved = dict(megablocks_ascend.backends.STK_KERNELS)
    calls = []
    for name, fn in list(sparse_grouped.FORMS.items()):
        monkeypatch.setitem(sparse_grouped.FORMS, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    with sparse_grouped.products():
        got = _results(layer, args, x, "ascend")
    assert megablocks_ascend.backends.STK_KERNELS == saved
    assert sorted(set(calls)) == ["dsd", "sdd"] and len(calls) == 6  # 2 forward, 4 backward
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_other_topologies_are_refused(device):
    out = torch.empty(5, B, B, device=device)
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)  # rows of 2 and 3 blocks
    with pytest.raises(ValueError, match="not MegaBlocks'"):
        sparse_grouped.sdd(torch.randn(2 * B, 8, device=device), torch.randn(8, 4 * B, device=device), (2 * B, 4 * B),
                           out, offsets, torch.zeros(5, dtype=torch.int16, device=device),
                           torch.zeros(5, dtype=torch.int16, device=device))


def test_bench_sparse_section_checks_both_forms_of_every_product_and_the_step(tmp_path):
    """``bench --sections sparse`` (CPU, quick configs): the six products of a step and the whole sparse
    dMoE step, in our form and as grouped GEMMs plus the copy, each checked (against the float32
    products and the grouped step); configs whose ffn is not whole 128-wide blocks are left out."""
    from megablocks_ascend.bench import blocksparse as bench_blocksparse, suite

    plan = suite.plan_for(torch.device("cpu"), quick=True, sections=("sparse",))
    results = suite.run(plan, tmp_path, "s", plot_png=False, log=lambda s="": None)
    rows = results["rows"]
    assert {r["case"] for r in rows} == {"tiny"}  # tiny16's ffn is 64
    items = [call for call, _ in bench_blocksparse.CALLS] + ["step eager"]
    assert sorted((r["item"], r["impl"]) for r in rows) == sorted(
        (i, impl) for i in items for impl in ("ours", "grouped GEMM + copy"))
    assert all(r["check_ok"] and "error" not in r for r in rows), [r for r in rows if not r.get("check_ok")]
    assert all(r["unwritten"] == 0 and r["rel_err"] <= bench_blocksparse.TOL[torch.bfloat16]
               for r in rows if r["item"] != "step eager")
    assert all(r["err_vs_reference"] is not None for r in rows if r["item"] == "step eager")
    assert results["summary"]["ok"] and set(results["section_seconds"]) == {"sparse"}


def test_bench_runs_the_sparse_section_by_default_on_an_npu_only():
    from megablocks_ascend.bench import suite

    assert "sparse" not in suite.plan_for(torch.device("cpu"), quick=True).sections
    assert "sparse" not in suite.plan_for(torch.device("cuda"), quick=False).sections
    npu = type("Device", (), {"type": "npu", "index": 0})()
    assert "sparse" in suite.plan_for(npu, quick=True).sections
