"""A catalogue of malformed calls to every public routing op.

Each bad call must raise ``RoutingArgumentError`` naming the offending argument, before any kernel
runs (the trace records no call) and without touching the caller's tensors. Value checks that
need a device-to-host sync run only with ``MEGABLOCKS_ASCEND_CHECKS=1``; without it, a malformed
routing still never reads or writes out of bounds. Empty batches give the right (empty or zero)
answer, and non-contiguous inputs the same answer as contiguous ones.
"""

import copy

import pytest
import torch

import megablocks
import megablocks_ascend
from megablocks_ascend import RoutingArgumentError, backends


def routing(tokens=6, experts=3, top_k=2):
    top = torch.arange(tokens * top_k, dtype=torch.int32) % experts
    bin_ids, indices = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=experts)
    bins = torch.cumsum(counts, 0).int()
    padded_bins = torch.cumsum((counts + 3) // 4 * 4, 0).int()
    return dict(indices=indices.int(), bin_ids=bin_ids.int(), bins=bins, padded_bins=padded_bins,
                weights=torch.rand(tokens * top_k), top_k=top_k)


def base_args(name, tokens=6, experts=3, top_k=2, hidden=8, capacity=4):
    r = routing(tokens, experts, top_k)
    n = tokens * top_k
    x = {
        "binned_gather": torch.randn(tokens, hidden), "gather": torch.randn(tokens, hidden),
        "padded_gather": torch.randn(tokens, hidden),
        "binned_scatter": torch.randn(experts, capacity, hidden),
        "binned_scatter_wgrad": torch.randn(experts, capacity, hidden),
        "scatter": torch.randn(n, hidden), "scatter_wgrad": torch.randn(n, hidden),
        "padded_scatter": torch.randn(int(r["padded_bins"][-1]), hidden),
        "padded_scatter_wgrad": torch.randn(int(r["padded_bins"][-1]), hidden),
    }[name]
    values = dict(r, x=x, grad=torch.randn(tokens, hidden), expert_capacity=capacity)
    return {p: values[p] for p in backends.SPECS[name][0]}


def call(name, args):
    return backends.KERNELS[name](**args)


def expect_rejected(name, args, argument, match=None):
    snapshot = {k: v.clone() if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in args.items()}
    with megablocks_ascend.use_backend("ascend"), megablocks_ascend.trace() as calls:
        with pytest.raises(RoutingArgumentError, match=match) as info:
            call(name, args)
    assert f"'{argument}'" in str(info.value), str(info.value)
    assert calls == [], "a kernel ran before the error"
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            assert v.device == snapshot[k].device, k
            if v.device.type != "meta":
                torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0, equal_nan=True)
    return str(info.value)


# (kernel function, how to break its arguments, the argument the error must name)
CATALOGUE = [
    ("gather", lambda a: a.update(indices=a["indices"].view(2, -1)), "indices"),
    ("gather", lambda a: a.update(indices=a["indices"].float()), "indices"),
    ("binned_gather", lambda a: a.update(bins=a["bins"][None]), "bins"),
    ("binned_gather", lambda a: a.update(bins=a["bins"].float()), "bins"),
    ("gather", lambda a: a.update(bin_ids=a["bin_ids"][:-1]), "bin_ids"),
    ("scatter", lambda a: a.update(weights=a["weights"][:-1]), "weights"),
    ("scatter", lambda a: a.update(weights=a["weights"].to(torch.int32)), "weights"),
    ("binned_gather", lambda a: a.update(x=a["x"].flatten()), "x"),
    ("gather", lambda a: a.update(x=a["x"].to(torch.int32)), "x"),
    ("gather", lambda a: a.update(x=a["x"].double()), "x"),
    ("binned_scatter", lambda a: a.update(top_k=0), "top_k"),
    ("scatter", lambda a: a.update(top_k=5), "indices"),  # 12 assignments, not a multiple of 5
    # 5 tokens * 2 != 12 assignments: 'bin_ids' and 'weights' agree with 'indices', so 'x' is wrong
    ("gather", lambda a: a.update(x=a["x"][:-1]), "x"),
    ("padded_gather", lambda a: a.update(x=a["x"][:-1]), "x"),
    # ... and here they agree with 'x': 'indices' is wrong
    ("gather", lambda a: a.update(indices=a["indices"][:-2]), "indices"),
    # no witness (binned_gather without weights): both named, 'x' first
    ("binned_gather", lambda a: a.update(x=a["x"][:-1], weights=None), "x"),
    ("binned_gather", lambda a: a.update(expert_capacity=-1), "expert_capacity"),
    ("binned_gather", lambda a: a.update(expert_capacity=4.0), "expert_capacity"),
    ("binned_gather", lambda a: a.update(bins=a["bins"][:0]), "bins"),
    ("padded_gather", lambda a: a.update(padded_bins=a["padded_bins"][:-1]), "padded_bins"),
    ("gather", lambda a: a.update(indices=a["indices"].to("meta")), "indices"),
    ("scatter_wgrad", lambda a: a.update(grad=a["grad"][:, :-1]), "grad"),
    ("binned_scatter", lambda a: a.update(x=a["x"][:-1]), "x"),  # 2 experts in x, 3 in bins
    ("scatter", lambda a: a.update(x=a["x"][:-1]), "x"),  # one row per assignment
    ("binned_scatter_wgrad", lambda a: a.update(top_k=True), "top_k"),
    ("padded_scatter", lambda a: a.update(top_k=torch.tensor(2)), "top_k"),
    ("gather", lambda a: a.update(x=a["x"].tolist()), "x"),  # not a tensor at all
    ("binned_gather", lambda a: a.update(x=torch.tensor(1.0)), "x"),  # 0-d
]


@pytest.mark.parametrize("name,breaker,argument", CATALOGUE,
                         ids=[f"{i}-{c[0]}-{c[2]}" for i, c in enumerate(CATALOGUE)])
def test_malformed_call_is_rejected_before_launch(name, breaker, argument):
    args = base_args(name)
    breaker(args)
    expect_rejected(name, args, argument)


# Value checks: need MEGABLOCKS_ASCEND_CHECKS=1.
VALUE_CATALOGUE = [
    ("binned_gather", lambda a: a["bins"].copy_(torch.tensor([8, 4, 12], dtype=torch.int32)), "bins",
     "non-decreasing"),
    ("gather", lambda a: a["bins"].copy_(torch.tensor([4, 8, 11], dtype=torch.int32)), "bins", "must end"),
    ("scatter", lambda a: a["bin_ids"].copy_(torch.zeros(12, dtype=torch.int32)), "bin_ids", "consistent"),
    ("scatter", lambda a: a["indices"].__setitem__(0, 12), "indices", r"\[0, 12\)"),
    ("binned_scatter", lambda a: a["indices"].__setitem__(1, int(a["indices"][0])), "indices", "permutation"),
    ("scatter", lambda a: a["weights"].__setitem__(3, float("nan")), "weights", "finite"),
    ("padded_scatter", lambda a: a["padded_bins"].copy_(torch.tensor([4, 4, 12], dtype=torch.int32)),
     "padded_bins", "at least as many"),
]


def _value_case_args(name, breaker):
    args = base_args(name)
    if name == "padded_scatter":  # keep x's rows equal to the (broken) padded total
        args["x"] = torch.randn(12, 8)
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    breaker(args)
    return args


@pytest.mark.parametrize("name,breaker,argument,match", VALUE_CATALOGUE,
                         ids=[f"{c[0]}-{c[2]}" for c in VALUE_CATALOGUE])
def test_value_checks_catch_malformed_routing(monkeypatch, name, breaker, argument, match):
    args = _value_case_args(name, breaker)
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "1")
    expect_rejected(name, args, argument, match=match)


@pytest.mark.parametrize("name,breaker,argument,match", VALUE_CATALOGUE,
                         ids=[f"{c[0]}-{c[2]}" for c in VALUE_CATALOGUE])
def test_without_value_checks_malformed_routing_stays_in_bounds(monkeypatch, name, breaker, argument, match):
    """The kernels mask every access by the tensors' real extents, whatever the routing says."""
    args = _value_case_args(name, breaker)
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "0")
    snapshot = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with megablocks_ascend.use_backend("ascend"):
        call(name, args)
    for k, v in snapshot.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)


def test_checks_switch_rejects_garbage(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_CHECKS", "maybe")
    with pytest.raises(ValueError, match="MEGABLOCKS_ASCEND_CHECKS"):
        call("gather", base_args("gather"))


@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("name", list(backends.SPECS))
def test_empty_batch_gives_the_right_answer(backend, name):
    args = base_args(name, tokens=0)
    with megablocks_ascend.use_backend(backend):
        out = call(name, args)
    if name == "binned_gather":
        assert out.shape == (3, 4, 8) and not out.any()
    elif name.endswith("wgrad"):
        assert out.shape == (0,)
    elif "gather" in name:
        assert out.shape == (0, 8)
    else:
        assert out.shape == (0, 8)


@pytest.mark.parametrize("name", ["binned_gather", "binned_scatter", "gather", "scatter", "padded_scatter"])
def test_non_contiguous_inputs_give_the_contiguous_answer(name):
    args = base_args(name)
    strided = dict(args)
    wide = torch.randn(*args["x"].shape[:-1], args["x"].shape[-1] * 2)
    wide[..., ::2] = args["x"]
    strided["x"] = wide[..., ::2]
    assert not strided["x"].is_contiguous()
    strided["weights"] = torch.stack([args["weights"], args["weights"]], 1)[:, 0]
    assert not strided["weights"].is_contiguous()
    with megablocks_ascend.use_backend("ascend"):
        assert torch.equal(call(name, strided), call(name, args))


def test_layer_level_error_names_the_argument():
    """Through MegaBlocks' own op wrappers the same error reaches the user."""
    r = routing()
    with pytest.raises(RoutingArgumentError, match="'indices'"):
        megablocks.ops.gather(torch.randn(6, 8), r["indices"].float(), r["bin_ids"], r["bins"], 2)


def test_without_a_witness_both_x_and_indices_are_named():
    args = base_args("binned_gather")
    args.update(x=args["x"][:-1], weights=None)
    message = expect_rejected("binned_gather", args, "x")
    assert "'indices' has 12 assignments" in message and "one of 'x' and 'indices' is wrong" in message


def _prepared(route, experts=3, tokens=6, top_k=2, capacity=4):
    from megablocks_ascend import ops
    top = torch.arange(tokens * top_k, dtype=torch.int32) % experts
    indices, bin_ids, bins, _, padded_bins = ops.prepare_routing(top, experts, 4, route, capacity)
    return dict(indices=indices, bin_ids=bin_ids, bins=bins, padded_bins=padded_bins, top_k=top_k)


@pytest.mark.parametrize("backend", ["ascend", "torch"])
@pytest.mark.parametrize("name,argument", [("gather", "bins"), ("binned_gather", "bins"),
                                           ("padded_gather", "bins"), ("padded_gather", "padded_bins"),
                                           ("padded_scatter", "bins")])
def test_routing_tensors_shaped_unlike_the_preparations_are_rejected_on_every_backend(backend, name, argument):
    """With the value checks off: 'bins' (or 'padded_bins') with another number of experts than the
    routing preparation made 'indices' for is a shape fact, so it is rejected for free, on every
    backend, before any launch. (It used to give 'ascend' and 'torch' different answers.)"""
    with megablocks_ascend.use_backend(backend):
        prepared = _prepared(-1)
    args = base_args(name)
    args.update({k: v for k, v in prepared.items() if k in args})
    for longer in (False, True):
        broken = dict(args)
        if argument == "bins":
            broken["bins"] = torch.cat([args["bins"], args["bins"][-1:]]) if longer else args["bins"][:-1].clone()
            if "padded_bins" in broken:  # (keep the two consistent with each other: only the preparation differs)
                broken["padded_bins"] = (torch.cat([args["padded_bins"], args["padded_bins"][-1:]]) if longer
                                         else args["padded_bins"][:-1].clone())
        else:
            broken["padded_bins"] = args["padded_bins"][:-1].clone()
        snapshot = {k: v.clone() for k, v in broken.items() if isinstance(v, torch.Tensor)}
        with megablocks_ascend.use_backend(backend), megablocks_ascend.trace() as calls:
            with pytest.raises(RoutingArgumentError, match=f"'{argument}'") as info:
                call(name, broken)
        assert calls == []
        assert argument == "padded_bins" or "routing preparation for 3 experts" in str(info.value)
        for k, v in snapshot.items():
            assert torch.equal(broken[k], v)


def test_a_kept_route_map_serves_only_the_routing_tensors_it_was_made_from(monkeypatch):
    """The preparation keeps the step's route map on 'indices'. A call with the same 'indices' and
    another 'bins' (here a well-formed routing that sorts to the same 'indices': experts 0, 1, 1, 1,
    2, 2 against 0, 0, 1, 1, 2, 2) is served from a map made for its own tensors (the binned
    scatter at top_k 1 reads one), and equals the 'torch' backend's answer; with the preparation's own tensors the kept map serves (nothing computed)."""
    from megablocks_ascend.kernels import routing as kernels
    computed = []
    real = kernels._compute_route_map
    monkeypatch.setattr(kernels, "_compute_route_map", lambda *a, **k: computed.append(1) or real(*a, **k))
    from megablocks_ascend import ops
    top = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)
    other = torch.tensor([0, 1, 1, 1, 2, 2], dtype=torch.int32)
    x = torch.randn(3, 2, 8)  # the expert-major buffer of a binned scatter: 3 experts, capacity 2
    with megablocks_ascend.use_backend("ascend"):
        indices, bin_ids, bins, _, _ = ops.prepare_routing(top, 3, 0, kernels.BINNED, 2)
    o_bin_ids, o_indices = torch.sort(other, stable=True)
    assert torch.equal(o_indices.int(), indices)
    o_bins = torch.cumsum(torch.bincount(other, minlength=3), 0).int()
    for b, expect_computed in ((bins, 0), (o_bins, 1)):
        computed.clear()
        with megablocks_ascend.use_backend("ascend"):
            ours = call("binned_scatter", dict(x=x, indices=indices, weights=None, bins=b, top_k=1))
        with megablocks_ascend.use_backend("torch"):
            ref = call("binned_scatter", dict(x=x, indices=indices, weights=None, bins=b, top_k=1))
        assert len(computed) == expect_computed
        assert torch.equal(ours, ref)
