"""Property tests over random routings, shapes, dtypes, tile sizes and grids (hypothesis).

For every draw, our Triton kernels (interpreter) must:
* gather: copy rows bit-exactly (weighted rows: within one unit in the last place of the dtype,
  since the product is rounded once from float32);
* scatter: be within the bound of float32 accumulation plus one rounding to the dtype of the
  float64 reference;
* wgrad: be within the bound of a float32 dot product plus one rounding;
* be bit-identical from run to run.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megablocks_ascend.devices import Tile
from megablocks_ascend.kernels import routing as kernels
import reference_impl as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Unit roundoff of one rounding to the dtype. bf16 gets a full ulp: the Triton interpreter
# truncates float32 -> bfloat16 instead of rounding to nearest.
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}
F32 = 2.0**-24

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def problems(draw):
    experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, min(4, experts)))
    tokens = draw(st.integers(0, 24))
    hidden = draw(st.integers(1, 70))
    layout = draw(st.sampled_from(["binned", "dropless", "padded"]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    skew = draw(st.sampled_from([None, 1.0, 3.0]))
    indices, bin_ids, bins, _ = ref.make_routing(tokens, experts, top_k, skew=skew, generator=gen)
    n = tokens * top_k
    return dict(
        experts=experts, top_k=top_k, tokens=tokens, hidden=hidden, layout=layout, dtype=dtype,
        indices=indices, bin_ids=bin_ids, bins=bins,
        padded_bins=ref.padded_bins(bins, draw(st.sampled_from([1, 2, 4, 8]))),
        capacity=draw(st.integers(1, max(n, 1) + 2)),
        weights=(torch.rand(n, generator=gen) if draw(st.booleans()) else None),
        tile=Tile(draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([8, 16, 32, 64]))),
        num_programs=draw(st.integers(1, 5)),
        gen=gen,
    )


def _buffer_rows(p):
    if p["layout"] == "binned":
        return p["experts"] * p["capacity"]
    if p["layout"] == "padded":
        return int(p["padded_bins"][-1]) if p["padded_bins"].numel() else 0
    return p["tokens"] * p["top_k"]


def _call(kind, p, x, grad=None):
    launch = dict(tile=p["tile"], num_programs=p["num_programs"])
    i, b, bi, pb, w, k = p["indices"], p["bins"], p["bin_ids"], p["padded_bins"], p["weights"], p["top_k"]
    w = None if w is None else w.to(x.dtype)
    if p["layout"] == "binned":
        return {"gather": lambda: kernels.binned_gather(x, i, w, b, p["capacity"], k, **launch),
                "scatter": lambda: kernels.binned_scatter(x, i, w, b, k, **launch),
                "wgrad": lambda: kernels.binned_scatter_wgrad(x, grad, i, b, k, **launch)}[kind]()
    if p["layout"] == "dropless":
        return {"gather": lambda: kernels.gather(x, i, bi, w, b, k, **launch),
                "scatter": lambda: kernels.scatter(x, i, bi, w, b, k, **launch),
                "wgrad": lambda: kernels.scatter_wgrad(x, grad, i, bi, b, k, **launch)}[kind]()
    return {"gather": lambda: kernels.padded_gather(x, i, bi, w, b, pb, k, **launch),
            "scatter": lambda: kernels.padded_scatter(x, i, bi, w, b, pb, k, **launch),
            "wgrad": lambda: kernels.padded_scatter_wgrad(x, grad, i, bi, b, pb, k, **launch)}[kind]()


def _reference(kind, p, x, grad=None):
    i, b, bi, pb, k = p["indices"], p["bins"], p["bin_ids"], p["padded_bins"], p["top_k"]
    w = None if p["weights"] is None else p["weights"].to(x.dtype)
    fn = {"binned": {"gather": lambda: ref.binned_gather(x, i, w, b, p["capacity"], k),
                     "scatter": lambda: ref.binned_scatter(x, i, w, b, k),
                     "wgrad": lambda: ref.binned_scatter_wgrad(x, grad, i, b, k)},
          "dropless": {"gather": lambda: ref.gather(x, i, bi, w, b, k),
                       "scatter": lambda: ref.scatter(x, i, bi, w, b, k),
                       "wgrad": lambda: ref.scatter_wgrad(x, grad, i, bi, b, k)},
          "padded": {"gather": lambda: ref.padded_gather(x, i, bi, w, b, pb, k),
                     "scatter": lambda: ref.padded_scatter(x, i, bi, w, b, pb, k),
                     "wgrad": lambda: ref.padded_scatter_wgrad(x, grad, i, bi, b, pb, k)}}
    return fn[p["layout"]][kind]()


def _abs_reference(kind, p, x, grad=None):
    """The same sums over absolute values: the scale of the rounding error bound."""
    q = dict(p, weights=None if p["weights"] is None else p["weights"].abs())
    return _reference(kind, q, x.abs(), None if grad is None else grad.abs())


def _expert_input(p):
    rows = {"binned": (p["experts"], p["capacity"]), "dropless": (p["tokens"] * p["top_k"],),
            "padded": (_buffer_rows(p),)}[p["layout"]]
    return torch.randn(*rows, p["hidden"], generator=p["gen"]).to(p["dtype"])


@SETTINGS
@given(problems())
def test_gather_property(p):
    x = torch.randn(p["tokens"], p["hidden"], generator=p["gen"]).to(p["dtype"])
    out = _call("gather", p, x)
    expected = _reference("gather", p, x)
    assert out.shape == expected.shape
    if p["weights"] is None:
        assert torch.equal(out, expected.to(p["dtype"]))
    else:
        err = (out.double() - expected).abs()
        assert bool((err <= 2 * UNIT[p["dtype"]] * expected.abs()).all())
    assert torch.equal(out, _call("gather", p, x))


@SETTINGS
@given(problems())
def test_scatter_property(p):
    y = _expert_input(p)
    out = _call("scatter", p, y)
    expected = _reference("scatter", p, y)
    scale = _abs_reference("scatter", p, y)
    bound = (p["top_k"] + 2) * F32 * scale + UNIT[p["dtype"]] * (expected.abs() + p["top_k"] * F32 * scale)
    assert out.shape == expected.shape
    assert bool(((out.double() - expected).abs() <= bound + 1e-30).all())
    assert torch.equal(out, _call("scatter", p, y))


@SETTINGS
@given(problems())
def test_wgrad_property(p):
    y = _expert_input(p)
    grad = torch.randn(p["tokens"], p["hidden"], generator=p["gen"]).to(p["dtype"])
    out = _call("wgrad", p, y, grad)
    expected = _reference("wgrad", p, y, grad)
    scale = _abs_reference("wgrad", p, y, grad)
    bound = (p["hidden"] + 2) * F32 * scale + UNIT[p["dtype"]] * (expected.abs() + p["hidden"] * F32 * scale)
    assert out.shape == expected.shape
    assert bool(((out.double() - expected).abs() <= bound + 1e-30).all())
    assert torch.equal(out, _call("wgrad", p, y, grad))
