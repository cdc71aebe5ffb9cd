"""The routing preparation (kernels/preparation.py and its op) against independent references.

``prepare_routing`` turns the router's expert ids into ``indices``, ``bin_ids``, ``bins``,
``tokens_per_expert`` and ``padded_bins`` (and, on ``ascend``, the route map of the routing calls
that follow). It is checked against:

* a plain Python loop written from the definitions (a stable sort of the ids; counts; inclusive
  sums; counts rounded up to the block), and for the route maps ``tests/support/reference_impl.py``'s
  position -> row lists;
* MegaBlocks' own sequence (``ops.sort`` / ``ops.histogram`` / ``ops.inclusive_cumsum`` /
  ``ops.round_up``, through the ``megablocks_ops`` stand-in's PyTorch code);
* ``torch.sort(stable=True)``;
* the routing kernels' own route-map kernel (``routing._compute_route_map``).

Our kernels run in the Triton interpreter. Every output the launchers allocate is poisoned first
(``poisoned``), so an element the kernels forget to write shows up.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megablocks.ops as mb_ops
import megablocks_ascend
import reference_impl as ref
from megablocks_ascend import backends, devices, keeping, library, ops, patching, reference, validation
from megablocks_ascend.patching import routing_preparation
from megablocks_ascend.devices import PrepTile
from megablocks_ascend.kernels import preparation, routing, routing_kernels
from megablocks_ascend.native import grouped_gemm
from megablocks_ascend.native import megablocks_ops as native
from test_native_ops import sort_loop

NO_ROUTE = preparation.NO_ROUTE
@pytest.fixture
def poisoned(poison_empty):
    poison_empty(preparation)


def loop_reference(ids, num_experts, block):
    """``(indices, bin_ids, bins, tokens_per_expert, padded_bins)`` by Python loops: a stable sort
    (ids outside ``[0, num_experts)`` after every valid one, in order, their bin id ``num_experts``),
    counts and inclusive sums."""
    values = [int(v) for v in ids.reshape(-1).tolist()]
    n = len(values)
    key = [v if 0 <= v < num_experts else num_experts for v in values]
    order = sorted(range(n), key=lambda a: key[a])  # Python's sort is stable
    counts = [0] * num_experts
    for v in values:
        if 0 <= v < num_experts:
            counts[v] += 1
    bins, padded, run, prun = [], [], 0, 0
    for c in counts:
        run += c
        bins.append(run)
        if block:
            prun += (c + block - 1) // block * block
            padded.append(prun)
    i32 = dict(dtype=torch.int32)
    return (torch.tensor(order, **i32), torch.tensor([key[a] for a in order], **i32),
            torch.tensor(bins, **i32), torch.tensor(counts, **i32), torch.tensor(padded, **i32) if block else None)


def route_reference(indices, bins, padded_bins, layout, capacity):
    """The route map by Python loops (``reference_impl``): each slot's buffer row, -1 where dropped."""
    if layout == routing.BINNED:
        rows = ref.binned_rows(bins, capacity)
    elif layout == routing.PADDED:
        rows = ref.padded_rows(bins, padded_bins)
    else:
        rows = ref.dropless_rows(bins)
    return torch.tensor([-1 if r is None else r for r in ref.slot_rows(indices, rows)], dtype=torch.int32)


def kept_route_map(indices, bins, padded_bins, layout, capacity, monkeypatch):
    """The route map kept on ``indices``, found the way the routing calls find it (computing one
    here fails the test)."""
    def no_launch(*args, **kwargs):
        raise AssertionError("the route map was not kept by the preparation")
    monkeypatch.setattr(routing, "_compute_route_map", no_launch)
    out = routing.route_map(indices, bins, padded_bins, layout=layout, capacity=capacity)
    monkeypatch.undo()
    return out


def assert_same(got, want):
    names = ("indices", "bin_ids", "bins", "tokens_per_expert", "padded_bins")
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g, w), (name, g, w)


def _ids(tokens, top_k, experts, *, low=0, high=None, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, experts if high is None else high, (tokens, top_k), generator=g).to(dtype)


# (id, ids, experts, block, tile block_m, programs)
CASES = [
    ("random-e8-k2", lambda: _ids(37, 2, 8), 8, 4, 4, 3),
    ("top1", lambda: _ids(23, 1, 4, seed=1), 4, 2, 2, 5),
    ("all-one-expert", lambda: torch.full((19, 3), 5, dtype=torch.int64), 8, 8, 4, 2),
    ("empty-experts-first-and-last", lambda: _ids(30, 2, 7, low=2, high=5, seed=2), 7, 4, 8, 3),
    ("one-expert", lambda: torch.zeros(11, 1, dtype=torch.int64), 1, 4, 2, 2),
    ("e256-k8", lambda: _ids(40, 8, 256, seed=3), 256, 128, None, None),
    ("e300-not-pow2", lambda: _ids(25, 6, 300, seed=4), 300, 16, 8, 4),
    ("e1024-max", lambda: _ids(9, 4, 1024, seed=5), 1024, 2, None, 2),
    ("no-tokens", lambda: torch.zeros(0, 2, dtype=torch.int64), 4, 4, 4, 3),
    ("int32-flat", lambda: _ids(21, 3, 6, dtype=torch.int32, seed=6).reshape(-1), 6, 4, 4, 3),
    ("items-not-a-multiple-of-the-block", lambda: _ids(13, 3, 5, seed=7), 5, 3, 16, 2),
    ("more-programs-than-blocks", lambda: _ids(5, 2, 3, seed=8), 3, 2, 4, 64),
    ("one-program", lambda: _ids(50, 2, 8, seed=9), 8, 4, 8, 1),
    ("block-m-2", lambda: _ids(9, 2, 3, seed=10), 3, 2, 2, 3),
]


@pytest.mark.parametrize("name,make,experts,block,block_m,programs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("layout", [NO_ROUTE, routing.DROPLESS, routing.PADDED, routing.BINNED])
@pytest.mark.parametrize("npu_form", [True, False], ids=["npu-form", "cuda-form"])
def test_prepare_matches_a_stable_sort(name, make, experts, block, block_m, programs, layout, npu_form, poisoned,
                                       monkeypatch):
    """Both forms of the preparation (devices.PREP_NPU_FORM: the NPU's, which the interpreter runs
    by default, and CUDA's) against the references."""
    ids = make()
    before = ids.clone()
    n = ids.numel()
    capacity = max(n // experts, 1) if layout == routing.BINNED else 0
    want = loop_reference(ids, experts, block)
    tile = PrepTile(block_m) if block_m else None
    got = preparation.prepare_routing(ids, experts, block, layout, capacity, tile=tile, num_programs=programs,
                                      npu_form=npu_form)
    assert torch.equal(ids, before)  # the input is left alone
    assert_same(got, want)
    # torch.sort's stable sort and MegaBlocks' own sequence agree (ids are valid here)
    bin_ids, order = torch.sort(ids.reshape(-1), stable=True)
    assert torch.equal(got[0], order.int()) and torch.equal(got[1], bin_ids.int())
    with megablocks_ascend.use_backend("torch"):  # the megablocks_ops stand-in's PyTorch code
        assert_same(backends.upstream_preparation(ids, experts, block), want)
    assert_same(reference.prepare_routing(ids, experts, block), want)
    if layout != NO_ROUTE:
        indices, _, bins, _, padded_bins = got
        pb = padded_bins if layout == routing.PADDED else None
        kept = kept_route_map(indices, bins, pb, layout, capacity, monkeypatch)
        assert torch.equal(kept, route_reference(indices, bins, pb, layout, capacity))
        assert torch.equal(kept, routing._compute_route_map(indices, bins, pb, layout=layout, capacity=capacity,
                                                            block_m=None, num_programs=None))
    else:
        assert routing._ROUTE_MAP_ATTR not in got[0].__dict__


@pytest.mark.parametrize("experts,tokens,top_k", [(8, 256, 2), (128, 128, 8), (1000, 20, 4)])
def test_prepare_on_the_test_device(device, experts, tokens, top_k):
    """The kernels on ``MEGABLOCKS_ASCEND_TEST_DEVICE`` (CUDA: compiled Triton, launch-sized tiles and
    grid, 32 times the tokens) against torch's stable sort and the route-map kernel there, for each
    layout's map."""
    tokens *= 1 if device.type == "cpu" else 32
    g = torch.Generator(device=device).manual_seed(experts)
    ids = torch.topk(torch.rand(tokens, experts, device=device, generator=g), top_k).indices
    bin_ids, order = torch.sort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=experts).int()
    capacity = tokens * top_k // experts
    for layout, block in ((routing.DROPLESS, 0), (routing.PADDED, 128), (routing.BINNED, 0)):
        indices, got_bin_ids, bins, tokens_per_expert, padded_bins = preparation.prepare_routing(
            ids, experts, block, layout, capacity)
        assert torch.equal(indices, order.int()) and torch.equal(got_bin_ids, bin_ids.int())
        assert torch.equal(tokens_per_expert, counts) and torch.equal(bins, torch.cumsum(counts, 0).int())
        pb = padded_bins if layout == routing.PADDED else None
        if block:
            assert torch.equal(padded_bins, torch.cumsum((counts + block - 1) // block * block, 0).int())
        kept = indices.__dict__[routing._ROUTE_MAP_ATTR][(layout, capacity if layout == routing.BINNED else 0)][-1]
        assert torch.equal(kept, routing._compute_route_map(indices, bins, pb, layout=layout, capacity=capacity,
                                                            block_m=None, num_programs=None))


def test_binned_route_map_drops_past_the_capacity(monkeypatch):
    ids = torch.tensor([[1, 0], [1, 2], [1, 0], [1, 1]])  # expert 1 has 5, capacity 2
    indices, _, bins, _, _ = preparation.prepare_routing(ids, 3, 0, routing.BINNED, 2, tile=PrepTile(2),
                                                         num_programs=3)
    got = kept_route_map(indices, bins, None, routing.BINNED, 2, monkeypatch)
    # slots in order: (t0: e1, e0), (t1: e1, e2), (t2: e1, e0), (t3: e1, e1); rows e*2 + rank
    assert got.tolist() == [2, 0, 3, 4, -1, 1, -1, -1]
    zero, _, zero_bins, _, _ = preparation.prepare_routing(ids, 3, 0, routing.BINNED, 0)  # capacity 0: all dropped
    assert kept_route_map(zero, zero_bins, None, routing.BINNED, 0, monkeypatch).tolist() == [-1] * 8


@pytest.mark.parametrize("npu_form", [True, False], ids=["npu-form", "cuda-form"])
def test_out_of_range_ids_in_both_forms(npu_form, poisoned):
    ids = torch.tensor([3, -1, 0, 5, 2, 3, 2**32 + 2, 0, 1, -2])
    got = preparation.prepare_routing(ids, 4, 2, routing.DROPLESS, tile=PrepTile(4), num_programs=2,
                                      npu_form=npu_form)
    assert_same(got, loop_reference(ids, 4, 2))
    assert got[1].tolist() == [0, 0, 1, 2, 3, 3, 4, 4, 4, 4]  # the four invalid ones: bin id 4, their bucket


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_out_of_range_ids_go_last_and_count_nowhere(backend, poisoned):
    ids = torch.tensor([3, -1, 0, 5, 2, 3, 2**32 + 2, 0, 1, -2])  # valid: 0..3; 2**32 + 2 is 2 in int32
    with megablocks_ascend.use_backend(backend):
        got = ops.prepare_routing(ids, 4, 2, routing.DROPLESS)
    assert_same(got, loop_reference(ids, 4, 2))
    assert got[0].tolist() == [2, 7, 8, 4, 0, 5, 1, 3, 6, 9]
    assert got[2].tolist() == [2, 3, 4, 6]  # bins end before the invalid ones
    if backend == "ascend":  # their route-map entries say dropped
        m = routing.route_map(got[0], got[2], None, layout=routing.DROPLESS)
        assert m.tolist() == [4, -1, 0, -1, 3, 5, -1, 1, 2, -1]


def test_many_items_no_narrow_integers(poisoned):
    """More assignments than int16 holds (and than one program's chunk): nothing wraps."""
    ids = _ids(20000, 2, 8, seed=11)
    assert_same(preparation.prepare_routing(ids, 8, 128, tile=PrepTile(1024), num_programs=3),
                loop_reference(ids, 8, 128))


def test_reruns_are_bit_identical():
    ids = _ids(60, 4, 16, seed=12)
    a = preparation.prepare_routing(ids, 16, 8, routing.PADDED, tile=PrepTile(8), num_programs=4)
    b = preparation.prepare_routing(ids, 16, 8, routing.PADDED, tile=PrepTile(8), num_programs=4)
    assert_same(a, b)


@pytest.mark.parametrize("route, npu_form, want", [
    (routing.DROPLESS, True, ["_count", "_place"]), (routing.PADDED, False, ["_count", "_place"]),
    (routing.PADDED, True, ["_count", "_place", "_row_map"]), (routing.BINNED, True, ["_count", "_place", "_row_map"]),
])
def test_two_launches(monkeypatch, route, npu_form, want):
    """Two launches, and in the NPU form a third for the padded and binned layouts' row map (the
    buffer-row-major gather's: tests/test_many_experts.py)."""
    launched = []
    for name in ("_count", "_place"):
        real = getattr(preparation, name)
        monkeypatch.setattr(preparation, name, _Recording(real, name, launched))
    monkeypatch.setattr(routing_kernels, "_row_map", _Recording(routing_kernels._row_map, "_row_map", launched))
    preparation.prepare_routing(_ids(10, 2, 4), 4, 4 if route == routing.PADDED else 0, route, 5, npu_form=npu_form)
    assert launched == want


class _Recording:
    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]

    def launch(self, grid, *args, **kwargs):
        self.log.append(self.name)
        return self.kernel.launch(grid, *args, **kwargs)


# ------------------------------------------------------------------------------------------
# The route map kept on indices: when it is kept, when it is used.


def test_route_map_is_kept_only_where_it_can_be_trusted(monkeypatch):
    ids = _ids(8, 2, 4)
    with keeping.no_reuse():  # compiled graphs keep nothing
        indices = preparation.prepare_routing(ids, 4, 0, routing.DROPLESS)[0]
    assert routing._ROUTE_MAP_ATTR not in indices.__dict__
    with torch.inference_mode():  # no version counter
        indices = preparation.prepare_routing(ids, 4, 0, routing.DROPLESS)[0]
    assert routing._ROUTE_MAP_ATTR not in indices.__dict__
    indices, _, bins, _, _ = preparation.prepare_routing(ids, 4, 0, routing.DROPLESS)
    kept = kept_route_map(indices, bins, None, routing.DROPLESS, 0, monkeypatch)
    assert routing.route_map(indices, bins.clone(), None, layout=routing.DROPLESS) is not kept  # other bins
    assert routing.route_map(indices, bins, None, layout=routing.BINNED, capacity=3) is not kept  # other layout
    indices.copy_(indices.flip(0))  # changed in place: the kept map is stale
    fresh = routing.route_map(indices, bins, None, layout=routing.DROPLESS)
    assert fresh is not kept and torch.equal(fresh[indices.long()], torch.arange(16, dtype=torch.int32))


def test_route_map_kept_under_a_capture_serves_that_capture_only(monkeypatch):
    """A map the preparation wrote inside a capture is written by the same captured launch as its
    indices, so captured calls may use it; eager calls do not, and a map made outside a capture
    never serves a captured call (which records its own launch)."""
    ids = _ids(8, 2, 4)
    monkeypatch.setattr(keeping, "capturing_on", lambda t: True)
    indices, _, bins, _, _ = preparation.prepare_routing(ids, 4, 0, routing.DROPLESS)
    kept = kept_route_map(indices, bins, None, routing.DROPLESS, 0, monkeypatch)
    monkeypatch.setattr(keeping, "capturing_on", lambda t: True)
    assert routing.route_map(indices, bins, None, layout=routing.DROPLESS) is kept
    monkeypatch.setattr(keeping, "capturing_on", lambda t: False)
    assert routing.route_map(indices, bins, None, layout=routing.DROPLESS) is not kept
    eager_indices, _, eager_bins, _, _ = preparation.prepare_routing(ids, 4, 0, routing.DROPLESS)
    eager = routing.route_map(eager_indices, eager_bins, None, layout=routing.DROPLESS)
    monkeypatch.setattr(keeping, "capturing_on", lambda t: True)
    assert routing.route_map(eager_indices, eager_bins, None, layout=routing.DROPLESS) is not eager
    monkeypatch.setattr(keeping, "capturing_on", lambda t: False)
    assert routing.route_map(eager_indices, eager_bins, None, layout=routing.DROPLESS) is eager


def test_routing_calls_without_the_preparation_still_build_their_map():
    """A user calling the routing ops with indices of their own: the first call builds the map."""
    ids = _ids(6, 2, 3)
    with megablocks_ascend.use_backend("torch"):
        indices, bin_ids, bins, _, _ = ops.prepare_routing(ids, 3)
    assert routing._ROUTE_MAP_ATTR not in indices.__dict__
    x = torch.randn(6, 8)
    with megablocks_ascend.use_backend("ascend"):
        out = mb_ops.gather(x, indices, bin_ids, bins, 2)
    assert torch.equal(out, x[indices.long() // 2])


# ------------------------------------------------------------------------------------------
# Routing calls given the preparation's tensors: their own arguments are still checked.


def _prepared_call(backend="ascend", checks="0", monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", checks)
    with megablocks_ascend.use_backend(backend):
        return ops.prepare_routing(_ids(6, 2, 4, seed=14), 4, 0, routing.DROPLESS)


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_routing_calls_on_prepared_tensors_still_check_their_own_arguments(backend):
    indices, bin_ids, bins, _, _ = _prepared_call(backend)
    assert validation._prepared(indices, bins, bin_ids, None) is not None
    x, w = torch.randn(6, 8), torch.rand(12)
    with megablocks_ascend.use_backend(backend):
        assert torch.equal(mb_ops.gather(x, indices, bin_ids, bins, 2), x[indices.long() // 2])
        for bad, arg in ((lambda: mb_ops.gather(torch.randn(5, 8), indices, bin_ids, bins, 2), "x"),  # (the preparation's indices are right)
                         (lambda: mb_ops.gather(x.int(), indices, bin_ids, bins, 2), "x"),
                         (lambda: mb_ops.scatter(torch.randn(12, 8), indices, bin_ids, w[:5], bins, 2), "weights"),
                         (lambda: mb_ops.gather(x, indices, bin_ids, bins, 5), "indices")):
            with pytest.raises(validation.RoutingArgumentError, match=f"argument '{arg}'"):
                bad()
        # other tensors than the preparation's, or its own changed in place: the full checks again
        assert validation._prepared(indices, bins.clone(), bin_ids, None) is None
        bins[-1] = 11
        assert validation._prepared(indices, bins, bin_ids, None) is None


def test_value_checks_on_prepared_tensors(monkeypatch):
    """With MEGABLOCKS_ASCEND_CHECKS=1 a preparation that checked the router's ids leaves only the
    weights to check per routing call; one that ran without the checks has its routing checked by
    the calls."""
    seen = []
    real = validation.check_values
    monkeypatch.setattr(validation, "check_values", lambda op, **kw: seen.append(kw.get("routing", True))
                        or real(op, **kw))
    x, w = torch.randn(12, 8), torch.rand(12)
    for checked in ("1", "0"):
        indices, bin_ids, bins, _, _ = _prepared_call(checks=checked, monkeypatch=monkeypatch)
        monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
        seen.clear()
        with megablocks_ascend.use_backend("ascend"):
            mb_ops.scatter(x, indices, bin_ids, w, bins, 2)
        assert seen == ([False] if checked == "1" else [True])
    w[3] = float("nan")
    with megablocks_ascend.use_backend("ascend"), pytest.raises(validation.RoutingArgumentError, match="'weights'"):
        mb_ops.scatter(x, indices, bin_ids, w, bins, 2)


# ------------------------------------------------------------------------------------------
# Validation, backends, the custom op.


BAD = [
    ("not-a-tensor", lambda: ([[0, 1]], 4, 0, -1, 0), "top_experts", "torch.Tensor"),
    ("3-d", lambda: (torch.zeros(2, 2, 2, dtype=torch.int64), 4, 0, -1, 0), "top_experts", "1-D or 2-D"),
    ("float-ids", lambda: (torch.zeros(4), 4, 0, -1, 0), "top_experts", "dtype"),
    ("int16-ids", lambda: (torch.zeros(4, dtype=torch.int16), 4, 0, -1, 0), "top_experts", "dtype"),
    ("no-experts", lambda: (torch.zeros(4, dtype=torch.int64), 0, 0, -1, 0), "num_experts", ">= 1"),
    ("experts-a-tensor", lambda: (torch.zeros(4, dtype=torch.int64), torch.tensor(4), 0, -1, 0), "num_experts",
     "Python int"),
    ("negative-block", lambda: (torch.zeros(4, dtype=torch.int64), 4, -1, -1, 0), "block", ">= 0"),
    ("unknown-route", lambda: (torch.zeros(4, dtype=torch.int64), 4, 0, 3, 0), "route", "one of"),
    ("padded-route-without-block", lambda: (torch.zeros(4, dtype=torch.int64), 4, 0, routing.PADDED, 0), "block",
     "padded route map"),
    ("negative-capacity", lambda: (torch.zeros(4, dtype=torch.int64), 4, 0, routing.BINNED, -2), "capacity", ">= 0"),
    ("rows-past-int32", lambda: (torch.zeros(4, dtype=torch.int64), 1 << 20, 0, routing.BINNED, 1 << 12), "capacity",
     "int32"),
    ("padded-past-int32", lambda: (torch.zeros(4, dtype=torch.int64), 1 << 16, 1 << 16, -1, 0), "top_experts",
     "int32"),
]


@pytest.mark.parametrize("name,make,arg,words", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_bad_input_names_the_argument_before_any_launch(name, make, arg, words, backend, monkeypatch):
    for kernel in ("_count", "_place"):
        monkeypatch.setattr(preparation, kernel, None)  # a launch would fail differently
    args = make()
    before = args[0].clone() if isinstance(args[0], torch.Tensor) else None
    with megablocks_ascend.use_backend(backend), pytest.raises(validation.RoutingArgumentError) as e:
        ops.prepare_routing(*args)
    assert f"argument '{arg}'" in str(e.value) and words in str(e.value), str(e.value)
    if before is not None:
        assert torch.equal(args[0], before)


def test_value_checks_reject_out_of_range_ids(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    for bad in (torch.tensor([0, 4, 1]), torch.tensor([-1, 0, 1])):
        with megablocks_ascend.use_backend("ascend"), pytest.raises(validation.RoutingArgumentError,
                                                                    match="'top_experts' must lie in"):
            ops.prepare_routing(bad, 4)
    with megablocks_ascend.use_backend("ascend"):
        ops.prepare_routing(torch.tensor([0, 3, 1]), 4)


def test_backends_that_cannot_serve_say_so():
    ids = torch.zeros(4, dtype=torch.int64)
    with megablocks_ascend.use_backend("ascend"), \
            pytest.raises(backends.BackendUnavailable, match="MEGABLOCKS_BACKEND=torch"):
        ops.prepare_routing(ids, devices.MAX_PREP_KEYS + 1)
    with megablocks_ascend.use_backend("torch"):
        assert ops.prepare_routing(ids, devices.MAX_PREP_KEYS + 1)[3].shape == (devices.MAX_PREP_KEYS + 1,)
    with megablocks_ascend.use_backend("cuda"), pytest.raises(backends.BackendUnavailable):
        ops.prepare_routing(ids, 4)


@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_each_backend_serves_and_is_traced(backend, monkeypatch):
    served = []
    monkeypatch.setattr(preparation, "prepare_routing", _spy(preparation.prepare_routing, served, "ascend"))
    monkeypatch.setattr(reference, "prepare_routing", _spy(reference.prepare_routing, served, "torch"))
    with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
        ops.prepare_routing(_ids(4, 2, 3), 3)
    assert served == [backend] and [(c.op, c.backend) for c in calls] == [("prepare_routing", backend)]


def _spy(fn, log, name):
    def run(*args, **kwargs):
        log.append(name)
        return fn(*args, **kwargs)
    return run


def test_custom_op_opcheck_and_compile():
    ids = _ids(6, 2, 5)
    with megablocks_ascend.use_backend("ascend"):
        torch.library.opcheck(library.prepare_routing, (ids, 5, 4, routing.PADDED, 0),
                              test_utils=["test_schema", "test_faketensor", "test_aot_dispatch_static"])
        compiled = torch.compile(lambda t: ops.prepare_routing(t, 5, 4, routing.PADDED), fullgraph=True,
                                 backend="aot_eager")
        got = compiled(ids)
        assert_same(got, loop_reference(ids, 5, 4))
        no_block = torch.compile(lambda t: ops.prepare_routing(t, 5), fullgraph=True, backend="aot_eager")(ids)
        assert no_block[4] is None and torch.equal(no_block[2], got[2])


# ------------------------------------------------------------------------------------------
# The megablocks_ops stand-in's sort and histogram on our kernels.


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("end_bit", [1, 3, 10])
def test_stand_in_sort_on_our_kernels(dtype, end_bit):
    g = torch.Generator().manual_seed(end_bit)
    # values with bits above end_bit set and negative ones: only the low bits decide the order
    x = (torch.randint(-300, 300, (45,), generator=g)).to(dtype)
    x_out, iota_out = torch.empty_like(x), torch.empty_like(x)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        native.sort(x, end_bit, x_out, iota_out)
    # int64 sorts (MegaBlocks makes none) stay on the PyTorch path: the kernels' keys are int32
    assert [(c.op, c.backend) for c in calls] == ([] if dtype == torch.int64 else [("sort", "ascend")])
    values, order = sort_loop(x.tolist(), end_bit, torch.iinfo(dtype).bits)
    assert x_out.tolist() == values and iota_out.tolist() == order


def test_stand_in_histogram_on_our_kernels():
    x = torch.tensor([1, 1, 2, 5, 0, -3, 2, 2], dtype=torch.int16)
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        counts = native.histogram(x, 3)
    assert counts.dtype == torch.int32 and counts.tolist() == [1, 2, 3]
    assert [(c.op, c.backend) for c in calls] == [("histogram", "ascend")]
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:  # 2-D: the PyTorch path
        assert native.histogram(x.view(2, 4), 3).tolist() == [[0, 2, 1], [1, 0, 2]]
    assert calls == []


def test_stand_in_keeps_its_pytorch_path_elsewhere():
    x = torch.tensor([3, 1, 2, 1], dtype=torch.int32)
    x_out, iota_out = torch.empty_like(x), torch.empty_like(x)
    for backend in ("torch", "auto"):
        with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
            native.sort(x, 2, x_out, iota_out)
            native.histogram(x, 4)
        assert calls == [] and x_out.tolist() == [1, 1, 2, 3] and iota_out.tolist() == [1, 3, 2, 0]
    big = torch.tensor([2000, 5, 1030], dtype=torch.int32)  # 2**11 keys: more than our kernels take
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        native.sort(big, 11, torch.empty_like(big), torch.empty_like(big))
    assert calls == []


# ------------------------------------------------------------------------------------------
# The patch.


def _patch():
    return next(p for p in patching.PATCHES if p.name == "routing-preparation")


def test_patch_replaces_both_methods_and_reverts_exactly():
    from megablocks.layers.dmoe import ParallelDroplessMLP
    from megablocks.layers.moe import ParallelMLP
    patch = _patch()
    assert ParallelMLP.indices_and_bins is routing_preparation._indices_and_bins
    assert ParallelDroplessMLP.indices_and_padded_bins is routing_preparation._indices_and_padded_bins
    originals = dict(patch.originals)
    patch.revert()
    try:
        target = "megablocks.layers.moe:ParallelMLP.indices_and_bins"
        assert ParallelMLP.__dict__["indices_and_bins"] is originals[target]
        assert ParallelMLP.indices_and_bins is routing_preparation._indices_and_bins.__wrapped__
    finally:
        patch.apply(patch)
        patch.applied = True
    assert ParallelMLP.indices_and_bins is routing_preparation._indices_and_bins


def test_patch_refuses_a_changed_upstream_body(monkeypatch):
    from megablocks.layers.moe import ParallelMLP
    patch = _patch()
    patch.revert()
    try:
        def indices_and_bins(self, top_expert):  # same parameters, another body
            return top_expert
        monkeypatch.setattr(ParallelMLP, "indices_and_bins", indices_and_bins)
        with pytest.raises(patching.PatchError, match="not the code megablocks-ascend was written against"):
            patch.apply(patch)
        patch.revert()
    finally:
        monkeypatch.undo()
        patch.apply(patch)
        patch.applied = True


@pytest.mark.parametrize("layer_kind", ["MoE", "MoE-top1", "MoE-capacity-0", "dMoE-grouped", "dMoE-sparse"])
def test_patched_methods_return_upstreams_results(layer_kind):
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    from megablocks.layers.moe import MoE
    cls = MoE if layer_kind.startswith("MoE") else dMoE
    args = Arguments(hidden_size=16, ffn_hidden_size=128, moe_num_experts=6,
                     moe_top_k=1 if layer_kind == "MoE-top1" else 3,
                     moe_capacity_factor=0 if layer_kind == "MoE-capacity-0" else 1,
                     mlp_impl="sparse" if layer_kind == "dMoE-sparse" else "grouped", fp16=False, bf16=False)
    experts = cls(args).experts
    top = _ids(10, args.moe_top_k, 6, seed=13).reshape(-1)
    method = "indices_and_padded_bins" if layer_kind == "dMoE-sparse" else "indices_and_bins"
    ours = getattr(experts, method)
    upstream = getattr(type(experts), method).__wrapped__.__get__(experts)
    with megablocks_ascend.use_backend("torch"):  # upstream's sequence on the stand-in's PyTorch code
        want = upstream(top)
    for backend in ("ascend", "torch"):
        with megablocks_ascend.use_backend(backend):
            got = ours(top)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    route, capacity = routing_preparation.route_for(experts, top, padded=layer_kind == "dMoE-sparse")
    expected = {"MoE": (routing.BINNED, 5), "MoE-top1": (NO_ROUTE, 0), "MoE-capacity-0": (NO_ROUTE, 0),
                "dMoE-grouped": (routing.DROPLESS, 0), "dMoE-sparse": (routing.PADDED, 0)}[layer_kind]
    assert (route, capacity) == expected


# ------------------------------------------------------------------------------------------
# Properties over random routings, tiles and grids.

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(experts=st.integers(1, 70), tokens=st.integers(0, 40), top_k=st.integers(1, 4),
       invalid=st.sampled_from([0, 0, 3]), dtype=st.sampled_from([torch.int32, torch.int64]),
       block=st.sampled_from([0, 1, 3, 16]), block_m=st.sampled_from([2, 4, 8, 32]),
       programs=st.integers(1, 6), layout=st.sampled_from([NO_ROUTE, routing.DROPLESS, routing.PADDED,
                                                           routing.BINNED]),
       capacity=st.integers(0, 9), seed=st.integers(0, 2**31 - 1), npu_form=st.booleans())
def test_preparation_property(experts, tokens, top_k, invalid, dtype, block, block_m, programs, layout, capacity,
                              seed, npu_form):
    if layout == routing.PADDED and not block:
        block = 4
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-invalid, experts + invalid, (tokens, top_k), generator=g).to(dtype)
    got = preparation.prepare_routing(ids, experts, block, layout, capacity, tile=PrepTile(block_m),
                                      num_programs=programs, npu_form=npu_form)
    assert_same(got, loop_reference(ids, experts, block))
    indices, _, bins, _, padded_bins = got
    if layout != NO_ROUTE:
        pb = padded_bins if layout == routing.PADDED else None
        maps = indices.__dict__[routing._ROUTE_MAP_ATTR]
        kept = maps[(layout, capacity if layout == routing.BINNED else 0)][-1]
        assert torch.equal(kept, route_reference(indices, bins, pb, layout, capacity))


def test_selftest_checks_the_preparation(monkeypatch):
    """``python -m megablocks_ascend selftest`` (the first thing to run on an NPU) compares the
    preparation and the stand-in's sort and histogram with the references, and notices a wrong one."""
    from megablocks_ascend.cli import selftest
    gen = torch.Generator().manual_seed(0)
    checked = selftest._preparation(40, 6, 2, 20, torch.device("cpu"), gen)
    assert [name for name, _, _ in checked] == ["prepare_routing[dropless]", "prepare_routing[padded]",
                                                "prepare_routing[binned]", "megablocks_ops.sort",
                                                "megablocks_ops.histogram"]
    assert all(ok for _, _, ok in checked)
    real = preparation.prepare_routing

    def wrong(*args, **kwargs):
        indices, bin_ids, bins, tokens_per_expert, padded_bins = real(*args, **kwargs)
        return indices.flip(0), bin_ids, bins, tokens_per_expert, padded_bins
    monkeypatch.setattr(preparation, "prepare_routing", wrong)
    checked = selftest._preparation(40, 6, 2, 20, torch.device("cpu"), gen)
    assert [ok for _, _, ok in checked] == [False, False, False, True, True]


# ---------------------------------------------------------------------------------------------
# The preparation's bins as the grouped GEMM's group ends


@pytest.mark.skipif(not grouped_gemm.choice._cpu_supports_grouped_mm(),
                    reason=f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm (needs torch >= 2.9)")
@pytest.mark.parametrize("backend", ["ascend", "torch"])
def test_the_preparations_bins_serve_the_grouped_gemms_as_group_ends(backend, monkeypatch):
    """``ops.prepare_routing`` keeps ``bins`` on ``tokens_per_expert`` as the group ends of the
    grouped GEMMs over its assignments: forward, data gradient and weight gradient launch only the
    GEMM (no clamp / cumsum / cast of the sizes), equal the float64 reference, and the weight
    gradient of the empty expert is exactly zero. An in-place change of ``bins`` or of the sizes,
    GEMMs over another number of rows, and a graph capture all compute their own ends again."""
    from megablocks_ascend.bench.instruments import LaunchCounter  # noqa: PLC0415

    ids = torch.tensor([[3, 0], [0, 3], [1, 3], [3, 1], [0, 1]])  # expert 2 gets nothing
    with backends.use_backend(backend):
        indices, _, bins, tokens_per_expert, _ = ops.prepare_routing(ids, 4)
    rows, sizes = indices.shape[0], tokens_per_expert.tolist()
    assert sizes == [3, 3, 0, 4]
    kept = tokens_per_expert.__dict__[grouped_gemm.device_sizes._GROUPS_ATTR]
    assert kept.ends is bins and kept.offsets is bins  # (int32: nothing to cast)
    assert kept.counts.dtype == torch.int64 and kept.counts.tolist() == sizes  # npu_grouped_matmul's group_list
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, 16, generator=gen, dtype=torch.float64).float()
    w = torch.randn(4, 8, 16, generator=gen, dtype=torch.float64).float()
    grad = torch.randn(rows, 8, generator=gen, dtype=torch.float64).float()

    def reference():
        a64, w64, g64 = a.double(), w.double(), grad.double()
        ends = [0] + torch.tensor(sizes).cumsum(0).tolist()
        out, da, dw = torch.empty(rows, 8, dtype=torch.float64), torch.empty_like(a64), torch.zeros_like(w64)
        for e in range(4):
            s = slice(ends[e], ends[e + 1])
            out[s], da[s], dw[e] = a64[s] @ w64[e].t(), g64[s] @ w64[e], g64[s].t() @ a64[s]
        return out, da, dw

    def step(batch_sizes):
        a_, w_ = a.clone().requires_grad_(), w.clone().requires_grad_()
        with LaunchCounter() as counter:
            out = grouped_gemm.ops.gmm(a_, w_, batch_sizes, trans_b=True)
            out.backward(grad)
        return (out.detach(), a_.grad, w_.grad), counter.by_name()

    results, launched = step(tokens_per_expert)
    assert launched == {"aten._grouped_mm.default": 3}, launched
    for got, want in zip(results, reference()):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(results[2][2]) == 0

    def recomputes(batch_sizes):
        results, launched = step(batch_sizes)
        for got, want in zip(results, reference()):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        return launched.get("aten.cumsum.default", 0) == 1

    bins.add_(0)  # a new version of the ends: no longer vouched for
    assert recomputes(tokens_per_expert)
    with backends.use_backend(backend):
        _, _, bins, tokens_per_expert, _ = ops.prepare_routing(ids, 4)
    tokens_per_expert.add_(0)  # a new version of the sizes
    assert recomputes(tokens_per_expert)
    with backends.use_backend(backend):
        _, _, _, tokens_per_expert, _ = ops.prepare_routing(ids[:4], 4)  # 8 assignments, not 10
    kept = tokens_per_expert.__dict__[grouped_gemm.device_sizes._GROUPS_ATTR]
    assert kept.key[1] == 8 and not kept.current((tokens_per_expert._version, rows))
    monkeypatch.setattr(keeping, "capturing", lambda device: True)
    with backends.use_backend(backend):
        _, _, _, tokens_per_expert, _ = ops.prepare_routing(ids, 4)
    assert grouped_gemm.device_sizes._GROUPS_ATTR not in tokens_per_expert.__dict__  # nothing kept during a capture


@pytest.mark.parametrize("npu_form", [True, False], ids=["npu-form", "cuda-form"])
def test_the_stand_ins_sort_in_both_forms(npu_form, poisoned):
    """megablocks_ops.sort through the preparation (values with bits above end_bit, which take no
    part in the order but are placed with their item), in both forms."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(0, 8, (77,), generator=g) + (torch.randint(1, 4, (77,), generator=g) << 3)).to(torch.int32)
    x_out, iota_out = torch.empty_like(x), torch.empty_like(x)
    preparation.sort(x, 3, x_out, iota_out, tile=PrepTile(8), num_programs=3, npu_form=npu_form)
    values, order = sort_loop(x.tolist(), 3, 32)
    assert x_out.tolist() == values and iota_out.tolist() == order
