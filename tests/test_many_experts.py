"""Many experts (issue 33): the row map of the padded and binned layouts, the buffer-row-major gather
that reads it instead of searching the experts, and the routing preparation's count in chunks of keys.

References are independent of the kernels: ``tests/reference_impl.py``'s position -> row lists (a
Python loop over ``bins`` / ``padded_bins``), inverted here into a row -> position list, and a stable
sort by Python loops (``test_preparation.loop_reference``). Every output the launchers allocate is
poisoned first, so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import pytest
import torch

import reference_impl as ref
from megablocks_ascend import devices
from megablocks_ascend.devices import PrepTile, Tile
from megablocks_ascend.kernels import preparation, routing, routing_kernels
from test_preparation import assert_same, loop_reference

SMALL = Tile(block_m=4, block_x=16)


@pytest.fixture
def poisoned(poison_empty):
    poison_empty(routing)
    poison_empty(preparation)


def row_reference(position_rows, num_rows):
    """``row_pos`` by a Python loop: the position landing on each of ``num_rows`` rows, else -1."""
    out = [-1] * num_rows
    for p, row in enumerate(position_rows):
        if row is not None and row < num_rows:
            out[row] = p
    return out


def _routing(tokens, experts, top_k, seed, empty=()):
    gen = torch.Generator().manual_seed(seed)
    indices, bin_ids, bins, _ = ref.make_routing(tokens, experts, top_k, skew=1.0, empty_experts=empty, generator=gen)
    return indices, bin_ids, bins, gen


@pytest.mark.parametrize("experts", [1, 70, 256])
@pytest.mark.parametrize("layout", [routing.PADDED, routing.BINNED])
@pytest.mark.parametrize("block_m, num_programs", [(1, 3), (8, 7), (64, 2)])
@pytest.mark.parametrize("extra", [0, 37])
def test_row_map_walk(experts, layout, block_m, num_programs, extra, poisoned):
    """The row-map kernel walks every row in blocks of one expert's consecutive rows: each row gets
    the position landing on it, or -1 (padding, unused capacity, and ``extra`` rows past the last
    segment, as a static row count larger than ``padded_bins[-1]`` has them); runs of empty experts,
    segments ending mid-block, more blocks than programs."""
    tokens, top_k = 150, min(2, experts)
    indices, _, bins, _ = _routing(tokens, experts, top_k, experts * 7 + block_m, tuple(range(1, experts, 3)))
    if layout == routing.PADDED:
        pbins = ref.padded_bins(bins, 4)
        positions, rows, capacity = ref.padded_rows(bins, pbins), int(pbins[-1]) + extra, 0
    else:
        pbins = None
        capacity = max(1, tokens * top_k // experts // 2) + extra // 37  # binned: drops about half
        positions, rows = ref.binned_rows(bins, capacity), experts * capacity
    got = routing._compute_row_map(bins, pbins, layout=layout, num_rows=rows, capacity=capacity,
                                   num_programs=num_programs, block_m=block_m)
    assert got.tolist() == row_reference(positions, rows)
    if layout == routing.BINNED and experts > 1:
        assert any(r is None for r in positions)  # the case does drop positions


@pytest.mark.parametrize("experts, block, top_k", [(8, 4, 2), (70, 8, 3), (256, 16, 8)])
@pytest.mark.parametrize("layout", [routing.PADDED, routing.BINNED])
@pytest.mark.parametrize("npu_form", [True, False], ids=["npu-form", "cuda-form"])
def test_the_preparation_writes_the_row_map(experts, block, top_k, layout, npu_form, poisoned, monkeypatch):
    """In the NPU form the routing preparation writes the padded or binned row map in its own launch,
    for every row a gather of that routing can have (the padded bound, ``experts * capacity``), equal
    to the reference and to the row-map kernel's; the routing calls find it kept on ``indices``. CUDA's
    form writes none (its gathers of these layouts are token-major)."""
    gen = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (41, top_k), generator=gen)
    n = ids.numel()
    capacity = max(n // experts, 1) if layout == routing.BINNED else 0
    got = preparation.prepare_routing(ids, experts, block if layout == routing.PADDED else 0, layout, capacity,
                                      num_programs=3, npu_form=npu_form)
    assert_same(got, loop_reference(ids, experts, block if layout == routing.PADDED else 0))
    indices, _, bins, _, padded_bins = got
    pb = padded_bins if layout == routing.PADDED else None
    kept = indices.__dict__.get(routing._ROW_MAP_ATTR)
    if not npu_form:
        assert kept is None
        return
    row_pos = kept[(layout, capacity)][1][0]
    if layout == routing.PADDED:
        positions, rows = ref.padded_rows(bins, padded_bins), routing.padded_rows_bound(n, experts, block)
        assert rows >= int(padded_bins[-1])
    else:
        positions, rows = ref.binned_rows(bins, capacity), experts * capacity
    assert row_pos.tolist() == row_reference(positions, rows)
    monkeypatch.setattr(routing, "_compute_row_map", lambda *a, **k: pytest.fail("the row map was not kept"))
    for asked in (1, rows, rows + 100):  # a whole map serves any row count
        assert routing.row_map(indices, bins, pb, layout=layout, num_rows=asked, capacity=capacity) is row_pos


@pytest.mark.parametrize("layout", [routing.PADDED, routing.BINNED])
@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("top_k, scaled", [(1, False), (2, True), (8, True)])
def test_gather_reads_the_row_map(layout, prepared, top_k, scaled, poisoned):
    """The buffer-row-major gather of a padded or binned layout, at 256 experts, with the row map the
    preparation kept or one it computes, against the float64 reference; rows past the last segment
    (a static row count larger than ``padded_bins[-1]``) are zeros."""
    experts, tokens, hidden, block = 256, 40, 24, 4
    gen = torch.Generator().manual_seed(top_k)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    n = ids.numel()
    capacity = 2 if layout == routing.BINNED else 0
    if prepared:
        indices, _, bins, _, padded_bins = preparation.prepare_routing(
            ids, experts, block if layout == routing.PADDED else 0, layout, capacity, npu_form=True)
    else:
        indices, _, bins, _, padded_bins = loop_reference(ids, experts, block if layout == routing.PADDED else 0)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.rand(n, generator=gen) if scaled else None
    if layout == routing.PADDED:
        positions = ref.padded_rows(bins, padded_bins)
        rows = int(padded_bins[-1]) + 9
    else:
        positions, rows = ref.binned_rows(bins, capacity), experts * capacity
    got = routing.gather_rows(x, indices, bins, padded_bins, w, layout=layout, num_rows=rows, top_k=top_k,
                              capacity=capacity, tile=SMALL, num_programs=3)
    want = ref._gather(x, indices, w, positions, rows, top_k)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0), (got - want).abs().max()
    if layout == routing.PADDED:
        assert not got[int(padded_bins[-1]):].any()


@pytest.mark.parametrize("experts", [3, 8, 9, 70, 300, 1024])
@pytest.mark.parametrize("chunk, count_block", [(2, 8), (8, 16), (64, 4)])
def test_the_count_in_chunks_of_keys(experts, chunk, count_block, poisoned):
    """The NPU form's count compares each block's keys with ``chunk`` keys at a time (its block of
    items then does not shrink with the experts): the same sort, counts and bins as the references,
    for key counts that are and are not multiples of the chunk, with the placement's blocks smaller
    than the count's (both launches cut the items into the same chunks)."""
    gen = torch.Generator().manual_seed(experts + chunk)
    ids = torch.randint(0, experts, (37, 3), generator=gen)
    tile = PrepTile(block_m=max(2, count_block // 2), count_block_m=count_block, key_chunk=chunk)
    got = preparation.prepare_routing(ids, experts, 4, routing.PADDED, tile=tile, num_programs=3, npu_form=True)
    assert_same(got, loop_reference(ids, experts, 4))


def test_npu_tiles_do_not_depend_on_the_expert_count():
    """On an NPU the gather's tile and the count's block of items are the same at 8 and at 256 experts
    (devices.tile, devices.prep_tile): what issue 33 set out to hold, also held by the compile
    gate's recorded census (tests/test_census.py)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hidden in (1000, 1024, 2048, 4096, 7168):
            tiles = {devices.tile("gather", dtype, hidden, "npu", num_experts=e) for e in (8, 64, 128, 256)}
            assert len(tiles) == 1, (dtype, hidden, tiles)
    blocks = {devices.prep_count_tile(devices.prep_tile(e, "npu"), devices.block_e(e)) for e in (8, 64, 256, 1024)}
    assert blocks == {(512, 8)}


@pytest.mark.parametrize("target, stores, want", [
    ("npu", "auto", "gather_rows"), ("interpreter", "auto", "gather_rows"), ("cuda", "auto", "gather_tokens_rows"),
    ("npu", "scattered", "gather_tokens_rows"), ("cuda", "contiguous", "gather_rows"),
])
def test_padded_and_binned_gathers_of_one_slot(target, stores, want, monkeypatch):
    """At top_k 1 the padded and binned gathers take the buffer-row-major form (its row map) where
    stores are contiguous, and the token-major form (the route map the scatter takes too) on CUDA;
    the dropless gather of one slot is buffer-row-major everywhere (no map: rows are positions)."""
    monkeypatch.setenv("MEGABLOCKS_ASCEND_STORES", stores)
    monkeypatch.setattr(devices, "target", lambda device: target)
    ran = []
    for name in ("gather_rows", "gather_tokens_rows"):
        monkeypatch.setattr(routing, name, lambda x, *a, _name=name, num_rows, **k: ran.append(_name)
                            or x.new_zeros(num_rows, x.shape[1]))
    x, idx, bins = torch.zeros(4, 8), torch.arange(4, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    routing.binned_gather(x, idx, None, bins, 4, 1)
    routing.padded_gather(x, idx, idx, None, bins, bins, 1)
    routing.gather(x, idx, idx, None, bins, 1)
    assert ran == [want, want, "gather_rows"]


# ---------------------------------------------------------------------------------------------
# The SELECT form: rows loaded through triton-ascend's index_select_simd (its documented semantics
# in plain Triton here, NaN past the tensor), behind MEGABLOCKS_ASCEND_ROW_LOADS.

def _nine_calls(hidden, top_k, gen):
    tokens, experts = 19, 6
    indices, bin_ids, bins, _ = ref.make_routing(tokens, experts, top_k, skew=1.0, empty_experts=(2,), generator=gen)
    n = tokens * top_k
    pbins = ref.padded_bins(bins, 4)
    cap = max(1, n // experts - 1)  # drops some
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w = torch.rand(n, generator=gen).to(torch.bfloat16)
    grad = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)

    def buffer(rows, position_rows):  # NaN in every row no position lands on
        y = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
        y[ref.unused_rows(position_rows, rows)] = float("nan")
        return y
    yb = buffer(experts * cap, ref.binned_rows(bins, cap)).view(experts, cap, hidden)
    yd = buffer(n, ref.dropless_rows(bins))
    yp = buffer(int(pbins[-1]), ref.padded_rows(bins, pbins))
    return {
        "binned_gather": (x, indices, w, bins, cap, top_k),
        "binned_scatter": (yb, indices, w, bins, top_k),
        "binned_scatter_wgrad": (yb, grad, indices, bins, top_k),
        "gather": (x, indices, bin_ids, w, bins, top_k),
        "scatter": (yd, indices, bin_ids, w, bins, top_k),
        "scatter_wgrad": (yd, grad, indices, bin_ids, bins, top_k),
        "padded_gather": (x, indices, bin_ids, w, bins, pbins, top_k),
        "padded_scatter": (yp, indices, bin_ids, w, bins, pbins, top_k),
        "padded_scatter_wgrad": (yp, grad, indices, bin_ids, bins, pbins, top_k),
    }


@pytest.mark.parametrize("top_k", [1, 3])
def test_the_select_form_gives_the_masked_forms_results(top_k, poisoned, monkeypatch):
    """Every routing op of the contiguous-store form with its gathered rows loaded through
    index_select_simd's semantics (``MEGABLOCKS_ASCEND_ROW_LOADS=select``: rows clamped to valid ones,
    then those not valid selected to 0) gives bit for bit what the masked 2-D loads give, rows no
    position lands on holding NaN; and the launchers do pass SELECT for it."""
    gen = torch.Generator().manual_seed(top_k)
    calls = _nine_calls(32, top_k, gen)  # whole feature tiles of 16: SELECT applies
    launched = []
    real = routing_kernels._gather.launch, routing_kernels._scatter.launch, routing_kernels._wgrad.launch
    for k, launch in zip((routing_kernels._gather, routing_kernels._scatter, routing_kernels._wgrad), real):
        monkeypatch.setattr(k, "launch", lambda *a, _l=launch, **kw: launched.append(kw["SELECT"]) or _l(*a, **kw))
    results = {}
    for loads in ("masked", "select"):
        monkeypatch.setenv("MEGABLOCKS_ASCEND_ROW_LOADS", loads)
        launched.clear()
        results[loads] = {name: getattr(routing, name)(*args, tile=SMALL, num_programs=3) for name, args in calls.items()}
        assert set(launched) == {loads == "select"}, (loads, launched)
    for name in calls:
        got, want = results["select"][name], results["masked"][name]
        assert not got.isnan().any(), name
        assert torch.equal(got, want), name


def test_select_only_where_rows_are_int32_and_tiles_whole(monkeypatch):
    """The launchers leave SELECT off for a partial last feature tile (the builtin, as triton-ascend
    3.2.0 lowers it, reads whole tiles past a row's end) and for int64 offsets, whatever the switch."""
    monkeypatch.setenv("MEGABLOCKS_ASCEND_ROW_LOADS", "select")
    cpu = torch.device("cpu")
    assert routing._select(cpu, "gather", dict(INT64=False, EVEN_X=True))["SELECT"]
    assert not routing._select(cpu, "gather", dict(INT64=False, EVEN_X=False))["SELECT"]
    assert not routing._select(cpu, "gather", dict(INT64=True, EVEN_X=True))["SELECT"]
    monkeypatch.setenv("MEGABLOCKS_ASCEND_ROW_LOADS", "auto")  # the census's choice: masked everywhere
    assert not any(devices.row_select(cpu, k) for k in ("gather", "scatter", "wgrad"))
    monkeypatch.setenv("MEGABLOCKS_ASCEND_ROW_LOADS", "gathered")
    with pytest.raises(ValueError, match="expected one of auto, masked, select"):
        devices.row_select(cpu, "gather")


@pytest.mark.parametrize("experts, tokens, top_k", [(8, 256, 2), (256, 64, 8)])
@pytest.mark.parametrize("layout", [routing.PADDED, routing.BINNED])
def test_row_map_and_gather_on_the_test_device(device, experts, tokens, top_k, layout):
    """On ``MEGABLOCKS_ASCEND_TEST_DEVICE`` (CUDA: compiled Triton, launch-sized tiles and grid): the
    preparation's row map in the NPU form equals the row-map kernel's and a Python loop's, and the
    buffer-row-major gather through it equals the torch backend's, at 8 and 256 experts."""
    from megablocks_ascend import reference
    gen = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(device)
    n = ids.numel()
    block, capacity = (128, 0) if layout == routing.PADDED else (0, max(n // experts, 1))
    indices, bin_ids, bins, _, padded_bins = preparation.prepare_routing(ids, experts, block, layout, capacity,
                                                                         npu_form=True)
    row_pos = routing.row_map(indices, bins, padded_bins, layout=layout, num_rows=1, capacity=capacity)
    rows = row_pos.shape[0]
    computed = routing._compute_row_map(bins, padded_bins, layout=layout, num_rows=rows, capacity=capacity,
                                        num_programs=None)
    assert torch.equal(row_pos, computed)
    positions = ref.padded_rows(bins.cpu(), padded_bins.cpu()) if layout == routing.PADDED else \
        ref.binned_rows(bins.cpu(), capacity)
    assert row_pos.cpu().tolist() == row_reference(positions, rows)
    x = torch.randn(tokens, 256, generator=gen).to(device)  # (float32: one rounding either way, the same)
    w = torch.rand(n, generator=gen).to(device)
    num_rows = int(padded_bins[-1]) if layout == routing.PADDED else experts * capacity
    got = routing.gather_rows(x, indices, bins, padded_bins, w, layout=layout, num_rows=num_rows, top_k=top_k,
                              capacity=capacity)
    if layout == routing.PADDED:
        want = reference.padded_gather(x, indices, bin_ids, w, bins, padded_bins, top_k)
    else:
        want = reference.binned_gather(x, indices, w, bins, capacity, top_k).reshape(num_rows, -1)
    assert torch.equal(got, want)
