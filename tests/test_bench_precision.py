"""``bench.precision.errors`` against the whole-tensor float64 formula it computes a chunk at a time."""

import math

import pytest
import torch

from megablocks_ascend.bench import precision


def _whole(actual, golden, floor):
    a = actual.to(torch.float64).reshape(-1)
    g = golden.to(torch.float64).reshape(-1)
    keep = torch.isfinite(g)
    a, g = a[keep], g[keep]
    bad = int((~torch.isfinite(a)).sum())
    diff = (a - g).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    rel = diff / (g.abs() + floor)
    return dict(MARE=float(rel.max()), MERE=float(rel.mean()), RMSE=float(diff.square().mean().sqrt()), nonfinite=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, precision.ERRORS_CHUNK, 2 * precision.ERRORS_CHUNK + 7])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_errors_equal_the_whole_tensor_formula_and_leave_inputs_alone(dtype, n, nonfinite):
    gen = torch.Generator().manual_seed(n)
    golden = torch.randn(n, dtype=torch.float64, generator=gen)
    actual = (golden + 1e-3 * torch.randn(n, dtype=torch.float64, generator=gen)).to(dtype)
    if nonfinite and n > 1:
        actual[n - 1] = math.inf  # in the last chunk: counted, and every error infinite
        golden[0] = math.nan  # where the golden is not finite, the element is not judged
    kept = actual.clone(), golden.clone()
    got, want = precision.errors(actual, golden, 1e-3), _whole(actual, golden, 1e-3)
    assert got["nonfinite"] == want["nonfinite"] == int(nonfinite and n > 1)
    for metric in ("MARE", "MERE", "RMSE"):
        assert got[metric] == pytest.approx(want[metric], rel=1e-12), metric
    assert torch.equal(actual, kept[0]) and torch.equal(golden.nan_to_num(), kept[1].nan_to_num())


def test_errors_of_an_empty_or_wholly_nonfinite_golden_are_zero():
    assert precision.errors(torch.ones(3), torch.full((3,), math.nan), 1e-3) == dict(MARE=0.0, MERE=0.0, RMSE=0.0,
                                                                                      nonfinite=0)
    assert precision.errors(torch.ones(0), torch.ones(0), 1e-3)["RMSE"] == 0.0
