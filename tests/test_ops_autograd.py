"""The six routing ops of ``megablocks_ascend.ops``, forward and backward.

Each op runs under ``use_backend('ascend')`` (our Triton kernels, interpreted) and
``use_backend('torch')``, and is checked three ways:

* against an oracle built from float64 PyTorch ops that autograd can differentiate
  (``index_select`` / ``index_copy`` / ``index_add`` on the slot -> row map that
  ``tests/support/reference_impl.py`` derives from the routing ops' definitions): the forward output, the
  gradient of ``x`` and the gradient of the router weights. The kernels take fp32, fp16 and
  bf16 only, so ``gradcheck`` in float64 is not possible; fp32 results are held to 1e-5
  relative (of the largest reference value, so that a wgrad that cancels to ~0 is not held to
  a relative bound it cannot meet), bf16 to a few of its ulps;
* against upstream MegaBlocks' own autograd Functions (``megablocks.ops.<op>`` modules; our
  patch replaced the module attributes, not the classes), which call
  ``megablocks.backend.kernels.<fn>`` -- patched to our dispatcher -- so under the same
  backend they must give bit-identical outputs and gradients: this checks that our Functions
  wire forward and backward exactly as upstream's do;
* with ``backends.trace()``: every kernel call of forward and backward is served by the
  selected backend, and the weight gradient kernel runs only when the weights need a gradient.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import reference_impl as ref
from megablocks_ascend import backends, ops, use_backend

BACKENDS = ("ascend", "torch")

UPSTREAM_FUNCTIONS = {
    "binned_gather": ("megablocks.ops.binned_gather", "BinnedGatherOp"),
    "binned_scatter": ("megablocks.ops.binned_scatter", "BinnedScatterOp"),
    "gather": ("megablocks.ops.gather", "GatherOp"),
    "scatter": ("megablocks.ops.scatter", "ScatterOp"),
    "padded_gather": ("megablocks.ops.padded_gather", "PaddedGatherOp"),
    "padded_scatter": ("megablocks.ops.padded_scatter", "PaddedScatterOp"),
}
FAMILY = {"binned_gather": "binned", "binned_scatter": "binned", "gather": "dropless", "scatter": "dropless",
          "padded_gather": "padded", "padded_scatter": "padded"}
# The kernels each op's forward and backward call (weights gradient last, for scatters).
KERNEL_CALLS = {
    "binned_gather": ("binned_gather", "binned_scatter"),
    "binned_scatter": ("binned_scatter", "binned_gather", "binned_scatter_wgrad"),
    "gather": ("gather", "scatter"),
    "scatter": ("scatter", "gather", "scatter_wgrad"),
    "padded_gather": ("padded_gather", "padded_scatter"),
    "padded_scatter": ("padded_scatter", "padded_gather", "padded_scatter_wgrad"),
}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    counts: tuple | None = None
    capacity: int = 0
    block: int = 0


# Per family: one case with fixed counts (empty first/middle/last experts, overflow and exact
# capacity for binned, segments on and just over the block multiple for padded) and one with
# random top-k routing and a different top_k.
CASES = {
    "binned": [Case("counts", 12, 7, 2, 37, counts=(0, 7, 3, 0, 9, 5, 0), capacity=5),
               Case("random-k4", 8, 4, 4, 5, capacity=6)],
    "dropless": [Case("counts", 6, 6, 2, 37, counts=(0, 5, 0, 6, 1, 0)),
                 Case("random-k4", 8, 8, 4, 16)],
    "padded": [Case("counts", 15, 9, 2, 37, counts=(0, 4, 5, 0, 8, 9, 3, 1, 0), block=4),
               Case("random-k3", 10, 4, 3, 7, block=8)],
}


@dataclasses.dataclass
class Problem:
    """Everything one op call needs; ``x`` is the op's input (tokens for gathers, the expert
    buffer with NaN in unused rows for scatters), ``dy`` the gradient fed to backward."""
    indices: torch.Tensor
    bin_ids: torch.Tensor
    bins: torch.Tensor
    padded_bins: torch.Tensor | None
    slots: torch.Tensor  # kept assignment slots
    rows: torch.Tensor  # their buffer rows
    num_rows: int
    x: torch.Tensor
    weights: torch.Tensor
    dy: torch.Tensor


def make_problem(op: str, case: Case, dtype: torch.dtype) -> Problem:
    family = FAMILY[op]
    g = torch.Generator().manual_seed(sum(map(ord, op + case.id)))
    indices, bin_ids, bins, _ = ref.make_routing(case.tokens, case.experts, case.top_k,
                                                 counts=case.counts, generator=g)
    padded_bins = None
    if family == "binned":
        position_rows, num_rows = ref.binned_rows(bins, case.capacity), case.experts * case.capacity
    elif family == "dropless":
        position_rows, num_rows = ref.dropless_rows(bins), case.tokens * case.top_k
    else:
        padded_bins = ref.padded_bins(bins, case.block)
        position_rows, num_rows = ref.padded_rows(bins, padded_bins), int(padded_bins[-1])
    kept = [(s, r) for s, r in enumerate(ref.slot_rows(indices, position_rows)) if r is not None]
    slots = torch.tensor([s for s, _ in kept], dtype=torch.long)
    rows = torch.tensor([r for _, r in kept], dtype=torch.long)
    buffer_shape = (case.experts, case.capacity, case.hidden) if family == "binned" else (num_rows, case.hidden)
    if op.endswith("gather"):
        x = torch.randn(case.tokens, case.hidden, generator=g)
        dy = torch.randn(buffer_shape, generator=g)
    else:
        x = torch.randn(num_rows, case.hidden, generator=g)
        x[ref.unused_rows(position_rows, num_rows)] = float("nan")
        x = x.view(buffer_shape)
        dy = torch.randn(case.tokens, case.hidden, generator=g)
    weights = torch.rand(case.tokens * case.top_k, generator=g) + 0.1
    return Problem(indices, bin_ids, bins, padded_bins, slots, rows, num_rows,
                   x.to(dtype), weights.to(dtype), dy.to(dtype))


def op_args(op: str, case: Case, p: Problem, x, weights):
    return {
        "binned_gather": (x, p.indices, p.bins, case.capacity, case.top_k),
        "binned_scatter": (x, p.indices, weights, p.bins, case.top_k),
        "gather": (x, p.indices, p.bin_ids, p.bins, case.top_k),
        "scatter": (x, p.indices, p.bin_ids, weights, p.bins, case.top_k),
        "padded_gather": (x, p.indices, p.bin_ids, p.bins, p.padded_bins, case.top_k),
        "padded_scatter": (x, p.indices, p.bin_ids, weights, p.bins, p.padded_bins, case.top_k),
    }[op]


def oracle(op: str, case: Case, p: Problem, x64, w64):
    """The op in float64 torch ops that autograd differentiates."""
    tokens = p.slots // case.top_k
    if op.endswith("gather"):
        out = torch.zeros(p.num_rows, case.hidden, dtype=torch.float64)
        out = out.index_copy(0, p.rows, x64.index_select(0, tokens))
        return out.view(p.dy.shape)
    values = x64.reshape(-1, case.hidden).index_select(0, p.rows)
    if w64 is not None:
        values = values * w64.index_select(0, p.slots)[:, None]
    return torch.zeros(case.tokens, case.hidden, dtype=torch.float64).index_add(0, tokens, values)


def run_op(fn, op, case, p, *, weighted, x_grad=True, w_grad=True):
    x = p.x.clone().requires_grad_(x_grad)
    w = p.weights.clone().requires_grad_(w_grad) if weighted else None
    with backends.trace() as calls:
        out = fn(*op_args(op, case, p, x, w))
        out.backward(p.dy)
    return out.detach(), x.grad, None if w is None else w.grad, calls


def assert_close(actual, expected, dtype, what):
    if dtype == torch.float32:
        rtol = 1e-5
    else:  # a few roundings of the dtype
        rtol = 4 * torch.finfo(dtype).eps
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")


PARAMS = [
    pytest.param(op, case, backend, weighted, dtype,
                 id=f"{op}-{case.id}-{backend}{'-weighted' if weighted else ''}-{str(dtype)[6:]}")
    for op in ops.OPS
    for case in CASES[FAMILY[op]]
    for backend in BACKENDS
    for weighted in ((True, False) if op.endswith("scatter") else (False,))
    for dtype in (torch.float32,)
] + [
    # One bf16 run per op: the kernels' dtype handling inside autograd.
    pytest.param(op, CASES[FAMILY[op]][0], backend, op.endswith("scatter"), torch.bfloat16,
                 id=f"{op}-{CASES[FAMILY[op]][0].id}-{backend}-bf16")
    for op in ops.OPS for backend in BACKENDS
]


@pytest.mark.parametrize("op, case, backend, weighted, dtype", PARAMS)
def test_forward_backward(op, case, backend, weighted, dtype):
    p = make_problem(op, case, dtype)
    with use_backend(backend):
        out, x_grad, w_grad, calls = run_op(ops.OPS[op], op, case, p, weighted=weighted)

    # The float64 oracle and its gradients.
    x64 = p.x.double().requires_grad_(True)
    w64 = p.weights.double().requires_grad_(True) if weighted else None
    expected = oracle(op, case, p, x64, w64)
    expected.backward(p.dy.double())

    assert out.dtype == dtype and out.shape == expected.shape
    assert x_grad.dtype == dtype and x_grad.shape == p.x.shape
    assert_close(out, expected.detach(), dtype, "forward")
    assert_close(x_grad, x64.grad, dtype, "x gradient")
    if weighted:
        assert w_grad is not None and w_grad.dtype == dtype
        assert_close(w_grad, w64.grad, dtype, "weights gradient")
    if op.endswith("scatter"):
        # No gradient flows to (or from) the NaN-poisoned unused rows of the expert buffer.
        assert not torch.isnan(out).any() and not torch.isnan(x_grad).any()

    # Every kernel call, forward and backward, went to the selected backend.
    names = KERNEL_CALLS[op] if weighted else KERNEL_CALLS[op][:2]
    assert [c.op for c in calls] == list(names)
    assert {c.backend for c in calls} == {backend}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(ops.OPS))
def test_matches_upstream_autograd_function(op, backend):
    """Our Function and upstream's, both calling the same backend's kernels: same bits."""
    module, cls = UPSTREAM_FUNCTIONS[op]
    upstream_fn = getattr(importlib.import_module(module), cls).apply
    assert upstream_fn is not ops.OPS[op]
    case = CASES[FAMILY[op]][0]
    p = make_problem(op, case, torch.float32)
    weighted = op.endswith("scatter")
    with use_backend(backend):
        ours = run_op(ops.OPS[op], op, case, p, weighted=weighted)
        theirs = run_op(upstream_fn, op, case, p, weighted=weighted)
    for name, a, b in zip(("forward", "x gradient", "weights gradient"), ours[:3], theirs[:3]):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differs from upstream's Function"
    assert [c.op for c in ours[3]] == [c.op for c in theirs[3]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [o for o in ops.OPS if o.endswith("scatter")])
def test_gradients_only_where_needed(op, backend):
    """Weights without requires_grad: no weight-gradient kernel and no weight gradient;
    x without requires_grad: the weight gradient alone is still right."""
    case = CASES[FAMILY[op]][0]
    p = make_problem(op, case, torch.float32)
    w64 = p.weights.double().requires_grad_(True)
    expected = oracle(op, case, p, p.x.double(), w64)
    expected.backward(p.dy.double())
    with use_backend(backend):
        _, x_grad, w_grad, calls = run_op(ops.OPS[op], op, case, p, weighted=True, w_grad=False)
        assert w_grad is None and x_grad is not None
        assert not any(c.op.endswith("_wgrad") for c in calls)
        _, x_grad, w_grad, calls = run_op(ops.OPS[op], op, case, p, weighted=True, x_grad=False)
        assert x_grad is None
        assert_close(w_grad, w64.grad, torch.float32, "weights gradient alone")
        assert calls[-1].op.endswith("_wgrad")
