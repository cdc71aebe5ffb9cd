"""The nine routing kernel functions against an independent float64 reference and upstream.

For every kernel function of the three families (binned, dropless, padded) and both of our
implementations ('ascend': ``megablocks_ascend.kernels.routing`` run by the Triton
interpreter; 'torch': ``megablocks_ascend.reference``), each case is compared with
``tests/support/reference_impl.py`` (float64 loops written from the routing ops' definitions) and with
upstream MegaBlocks' own kernel on the same inputs (``upstream_kernels``, also interpreted).

What is asserted, by kind:
* gathers: bit-exact against upstream and against the float64 reference rounded once to
  the dtype. Unweighted they are pure copies; weighted ones multiply in float32 and round
  once, and a float32 product of two fp16/bf16 values is exact while a float64 product of two
  float32 values is exact, so rounding the float64 reference once gives the same bits. Rows
  that no position lands on (unused capacity, padding) are exactly zero.
* scatters: ours sums a token's top_k slots in float32 and rounds once; the bound against
  the float64 reference is ``(eps/2 + top_k * eps32) * sum|w*y|`` (one rounding to the dtype,
  top_k float32 roundings). Upstream rounds each slot to the dtype, then sums and rounds
  again, so the comparison with it adds ``(top_k + 1)`` roundings of the dtype to that bound.
* wgrads: float32 dot products over ``hidden`` rounded to the dtype: ``eps/2 * |ref| +
  hidden * eps32 * sum|y*g|`` against the reference, twice that against upstream; slots that
  were dropped are exactly zero.

Rounding in the Triton interpreter: its float32 -> bfloat16 cast truncates (rounds toward
zero; ``triton/runtime/interpreter.py`` ``cast_impl`` passes no rounding mode), where compiled
Triton and PyTorch round to nearest even. Interpreted kernels (ours as 'ascend' and upstream's)
are therefore held to round-toward-zero for bf16 -- exactly for gathers, with a full ulp
instead of half in the bounds for scatters and wgrads -- while the 'torch' backend is held to
round-to-nearest-even; ``test_interpreter_rounds_bf16_toward_zero`` pins that assumption.

Poison: the expert-major inputs of scatter/wgrad hold NaN in every row no position lands on
(unused capacity, padding), so reading one shows up as NaN in the output; for the 'ascend'
kernels every ``torch.empty`` the launchers allocate is pre-filled with NaN (see
``poisoned_empty``), so an output element the kernels forget to write shows up too. Inputs
must come back unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference_impl as ref
from megablocks_ascend import reference as torch_backend
from megablocks_ascend.devices import Tile
from megablocks_ascend.kernels import routing

EPS32 = torch.finfo(torch.float32).eps
SMALL = Tile(block_m=4, block_x=16)  # forces many sub-blocks that straddle expert boundaries

FAMILIES = {
    "binned": ("binned_gather", "binned_scatter", "binned_scatter_wgrad"),
    "dropless": ("gather", "scatter", "scatter_wgrad"),
    "padded": ("padded_gather", "padded_scatter", "padded_scatter_wgrad"),
}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    dtype: torch.dtype
    weighted: bool
    capacity: int = 0  # binned only
    block: int = 0  # padded only
    counts: tuple | None = None  # fixed slots per expert (else random top-k choices)
    skew: float | None = None
    empty: tuple = ()
    tile: Tile | None = None  # None: the launcher's own choice
    num_programs: int | None = None
    index_dtype: torch.dtype = torch.int32


# The case matrix. Not a cross product: each case combines several of the situations the definitions
# name, so that together they cover all of them for every family, with every dtype, both
# weighted and unweighted, and both the forced small tile (4 rows x 16 features, with 1 and 3
# programs) and the launcher's default tile. Hidden sizes 1, 3, 37 and 130 are not multiples
# of either tile width (16 forced; 256 default in the interpreter).
CASES = {
    "binned": [
        # Counts 0,7,3,0,9,5,0 with capacity 5: empty first/middle/last experts, overflow (7, 9
        # > 5), exact capacity (5), under capacity (3); 4-row sub-blocks straddle experts and
        # their overflow; 3 programs each walk several sub-blocks.
        Case("mixed-fp32-w-np3", 12, 7, 2, 37, torch.float32, True, capacity=5,
             counts=(0, 7, 3, 0, 9, 5, 0), tile=SMALL, num_programs=3),
        # Same boundaries in fp16, unweighted, top_k=1, one program walking every sub-block.
        Case("mixed-fp16-np1", 24, 7, 1, 3, torch.float16, False, capacity=5,
             counts=(0, 7, 3, 0, 9, 5, 0), tile=SMALL, num_programs=1),
        # ... and in bf16 with top_k=4 and hidden 130 (9 feature tiles of 16, the last one of 2).
        Case("mixed-bf16-w-k4-np3", 6, 7, 4, 130, torch.bfloat16, True, capacity=5,
             counts=(0, 7, 3, 0, 9, 5, 0), tile=SMALL, num_programs=3),
        # 64 skewed tokens: the popular experts overflow capacity 12, others are under it.
        Case("skew-fp16-w-t64", 64, 8, 2, 37, torch.float16, True, capacity=12, skew=2.0,
             tile=SMALL, num_programs=3),
        # Capacity 1 with top_k=4: almost everything is dropped; bf16, weighted, default tile.
        Case("cap1-bf16-w-k4", 16, 4, 4, 130, torch.bfloat16, True, capacity=1),
        # Capacity larger than all assignments (40 > 32): nothing dropped, most rows unused;
        # skewed routing; int64 index tensors.
        Case("cap-huge-fp32-skew", 16, 4, 2, 130, torch.float32, False, capacity=40, skew=1.5,
             index_dtype=torch.int64),
        # One expert that overflows (20 tokens, capacity 16), hidden 1.
        Case("one-expert-fp16-w", 20, 1, 1, 1, torch.float16, True, capacity=16, tile=SMALL, num_programs=3),
        # 64 experts, capacity 2: a sub-block spans several experts, many of them empty.
        Case("e64-bf16-w", 32, 64, 2, 37, torch.bfloat16, True, capacity=2, tile=SMALL, num_programs=3),
        # Empty batch: no tokens, the whole capacity buffer is unused.
        Case("empty-batch", 0, 4, 2, 37, torch.float32, True, capacity=3),
        # Capacity 0, which the ops accept (MegaBlocks' layers replace a computed 0 by the largest
        # expert's count, direct callers need not): every assignment is dropped and the expert
        # buffer has no rows.
        Case("cap0-bf16-w", 3, 8, 2, 37, torch.bfloat16, True, capacity=0, tile=SMALL, num_programs=3),
        Case("cap0-fp32-k1", 5, 8, 1, 16, torch.float32, False, capacity=0),
        # top_k=3: the flat scatter's slot tile is 4 wide, its last column outside every token.
        Case("k3-fp16-w-np3", 11, 5, 3, 37, torch.float16, True, capacity=6, tile=SMALL, num_programs=3),
    ],
    "dropless": [
        # top_k=8 over 8 experts: every token goes to every expert.
        Case("k8-fp32-w-np3", 8, 8, 8, 37, torch.float32, True, tile=SMALL, num_programs=3),
        Case("k8-bf16-np1", 8, 16, 8, 130, torch.bfloat16, False, tile=SMALL, num_programs=1),
        # 256 positions in 64 sub-blocks over 3 programs.
        Case("t64-k4-fp32-w-np3", 64, 8, 4, 37, torch.float32, True, tile=SMALL, num_programs=3),
        # Empty first/middle/last experts, tiny segments (1) inside 4-row sub-blocks.
        Case("empty-experts-fp16-np1", 6, 6, 2, 3, torch.float16, False,
             counts=(0, 5, 0, 6, 1, 0), tile=SMALL, num_programs=1),
        # 64 experts, top_k=4, bf16, weighted, default tile, int64 index tensors.
        Case("e64-k4-bf16-w", 32, 64, 4, 130, torch.bfloat16, True, index_dtype=torch.int64),
        # One expert, top_k=1, hidden 1, token count not a multiple of the sub-block.
        Case("one-expert-fp32", 33, 1, 1, 1, torch.float32, False, tile=SMALL, num_programs=3),
        # Skewed routing (a few experts take most tokens), 64 tokens, fp16, weighted.
        Case("skew-fp16-w-k2", 64, 8, 2, 130, torch.float16, True, skew=2.0),
        Case("empty-batch", 0, 4, 2, 37, torch.bfloat16, True),
        # top_k=3 and 6 (slot tiles of 4 and 8 with unused columns), sub-blocks past the last token.
        Case("k3-bf16-w-np3", 13, 5, 3, 37, torch.bfloat16, True, tile=SMALL, num_programs=3),
        Case("k6-fp32-w", 9, 8, 6, 130, torch.float32, True),
    ],
    "padded": [
        # Block 4, counts 0,4,5,0,8,9,3,1,0: segments exactly on a multiple (4, 8), just over
        # (5, 9), under (3, 1), empty first/middle/last (0 rows after padding).
        Case("boundary-fp32-w-np3", 15, 9, 2, 37, torch.float32, True, block=4,
             counts=(0, 4, 5, 0, 8, 9, 3, 1, 0), tile=SMALL, num_programs=3),
        Case("boundary-bf16-np1", 30, 9, 1, 3, torch.bfloat16, False, block=4,
             counts=(0, 4, 5, 0, 8, 9, 3, 1, 0), tile=SMALL, num_programs=1),
        Case("boundary-fp16-w-k4-np3", 8, 9, 4, 130, torch.float16, True, block=4,
             counts=(0, 4, 5, 0, 8, 9, 3, 3, 0), tile=SMALL, num_programs=3),
        Case("skew-fp32-w-t64-np1", 64, 8, 2, 37, torch.float32, True, block=8, skew=1.0,
             tile=SMALL, num_programs=1),
        # Block larger than every segment, top_k=4, fp16, weighted, default tile.
        Case("block16-fp16-w-k4", 16, 4, 4, 130, torch.float16, True, block=16),
        # 64 experts with top_k=8: mostly padding.
        Case("e64-k8-bf16-w", 8, 64, 8, 37, torch.bfloat16, True, block=4, tile=SMALL, num_programs=3,
             index_dtype=torch.int64),
        # One expert, 13 tokens padded to 16.
        Case("one-expert-fp32", 13, 1, 1, 1, torch.float32, False, block=8, tile=SMALL, num_programs=3),
        Case("empty-batch", 0, 4, 2, 37, torch.float16, True, block=4),
    ],
}


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # [tokens, hidden]
    y: torch.Tensor  # the expert-major buffer (NaN in rows no position lands on)
    grad: torch.Tensor  # [tokens, hidden]
    weights: torch.Tensor | None
    indices: torch.Tensor
    bin_ids: torch.Tensor
    bins: torch.Tensor
    padded_bins: torch.Tensor | None
    position_rows: list
    num_rows: int


_INPUTS: dict[tuple[str, str], Inputs] = {}


def inputs(family: str, case: Case) -> Inputs:
    key = (family, case.id)
    if key in _INPUTS:
        return _INPUTS[key]
    g = torch.Generator().manual_seed(sum(map(ord, family + case.id)))
    n = case.tokens * case.top_k
    indices, bin_ids, bins, _ = ref.make_routing(case.tokens, case.experts, case.top_k, skew=case.skew,
                                                 empty_experts=case.empty, counts=case.counts, generator=g)
    pbins = None
    if family == "binned":
        rows = ref.binned_rows(bins, case.capacity)
        num_rows = case.experts * case.capacity
        y_shape = (case.experts, case.capacity, case.hidden)
    elif family == "dropless":
        rows, num_rows, y_shape = ref.dropless_rows(bins), n, (n, case.hidden)
    else:
        pbins = ref.padded_bins(bins, case.block)
        rows = ref.padded_rows(bins, pbins)
        num_rows = int(pbins[-1])
        y_shape = (num_rows, case.hidden)
    y = torch.randn(num_rows, case.hidden, generator=g).to(case.dtype)
    y[ref.unused_rows(rows, num_rows)] = float("nan")
    it = case.index_dtype
    result = Inputs(
        x=torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype),
        y=y.view(y_shape),
        grad=torch.randn(case.tokens, case.hidden, generator=g).to(case.dtype),
        weights=(torch.rand(n, generator=g) + 0.1).to(case.dtype) if case.weighted else None,
        indices=indices.to(it), bin_ids=bin_ids.to(it), bins=bins.to(it),
        padded_bins=None if pbins is None else pbins.to(it),
        position_rows=rows, num_rows=num_rows)
    _INPUTS[key] = result
    return result


def call_args(fn: str, case: Case, inp: Inputs, *, magnitude: bool = False):
    """Positional arguments of ``fn`` (upstream's signature). ``magnitude``: absolute values,
    so the same function gives the sum of |terms| that bounds the rounding error."""
    y = inp.y.abs() if magnitude else inp.y
    w = inp.weights.abs() if (magnitude and inp.weights is not None) else inp.weights
    grad = inp.grad.abs() if magnitude else inp.grad
    i, b, bins, pb, k = inp.indices, inp.bin_ids, inp.bins, inp.padded_bins, case.top_k
    return {
        "binned_gather": (inp.x, i, w, bins, case.capacity, k),
        "binned_scatter": (y, i, w, bins, k),
        "binned_scatter_wgrad": (y, grad, i, bins, k),
        "gather": (inp.x, i, b, w, bins, k),
        "scatter": (y, i, b, w, bins, k),
        "scatter_wgrad": (y, grad, i, b, bins, k),
        "padded_gather": (inp.x, i, b, w, bins, pb, k),
        "padded_scatter": (y, i, b, w, bins, pb, k),
        "padded_scatter_wgrad": (y, grad, i, b, bins, pb, k),
    }[fn]


_UPSTREAM: dict[tuple[str, str, str], torch.Tensor] = {}


def upstream_result(upstream_kernels, family, fn, case, inp):
    key = (family, fn, case.id)
    if key not in _UPSTREAM:
        _UPSTREAM[key] = upstream_kernels[fn](*call_args(fn, case, inp))
    return _UPSTREAM[key]


@pytest.fixture
def poisoned_empty(poison_empty):
    poison_empty(routing)


def run(backend: str, fn: str, case: Case, args):
    if backend.startswith("ascend"):
        return getattr(routing, fn)(*args, tile=case.tile, num_programs=case.num_programs)
    return getattr(torch_backend, fn)(*args)


def round_like(t64: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    """``t64`` rounded once to ``dtype`` the way the implementation does it: to nearest even,
    except bf16 in the Triton interpreter, which truncates. (Truncation is done on the float32
    bits, so it needs ``t64`` exact in float32: true of products of two bf16 values.)"""
    if interpreted and dtype == torch.bfloat16:
        t32 = t64.to(torch.float32)
        assert torch.equal(t32.double(), t64), "round-toward-zero helper needs values exact in float32"
        return (t32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return t64.to(dtype)


def _tiny(dtype):
    """The spacing of subnormals: the least absolute error a rounding to ``dtype`` can make."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def assert_within(out, expected, bound, what):
    err = (out.double() - expected).abs()
    bad = ~(err <= bound)  # NaN anywhere counts as a failure
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {out.numel()} elements out of bound; first at "
        f"{tuple(torch.nonzero(bad)[0].tolist())}: got {out.double()[bad][0].item()}, "
        f"expected {expected[bad][0].item()}, bound {bound.expand_as(err)[bad][0].item():.3g}")


def forms_differ(fn: str, case: Case) -> bool:
    """Whether the two forms of the routing kernels (``devices.STORES``) run different kernels for
    ``fn``: the gathers at top_k > 1 (buffer-row-major / token-major), the scatters at every top_k
    (1: token-major after the route map / position-major; more: the flat slot tile / a load per
    slot) and the weight gradients at top_k 1 (slot-major after the route map / position-major)."""
    if fn.endswith("gather"):  # (a padded or binned gather is token-major on CUDA at every top_k)
        return case.top_k > 1 or fn != "gather"
    return fn.endswith("scatter") or case.top_k == 1


# 'ascend' runs the form the interpreter takes by default (the NPU's: contiguous stores);
# 'ascend-scattered' the other one (CUDA's), where it differs.
PARAMS = [
    pytest.param(family, fn, case, backend, id=f"{fn}-{case.id}-{backend}")
    for family, fns in FAMILIES.items()
    for fn in fns
    for case in CASES[family]
    for backend in ("ascend", "ascend-scattered", "torch")
    if backend != "ascend-scattered" or forms_differ(fn, case)
]


@pytest.mark.parametrize("family, fn, case, backend", PARAMS)
def test_kernel(family, fn, case, backend, upstream_kernels, poisoned_empty, monkeypatch):
    if backend == "ascend-scattered":
        monkeypatch.setenv("MEGABLOCKS_ASCEND_STORES", "scattered")
    inp = inputs(family, case)
    args = call_args(fn, case, inp)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]

    out = run(backend, fn, case, args)

    after = [a for a in args if isinstance(a, torch.Tensor)]
    for a, b in zip(after, before):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)), \
            "an input was modified"
    expected = ref.KERNELS[fn](*args)
    upstream = upstream_result(upstream_kernels, family, fn, case, inp)
    assert out.dtype == case.dtype
    assert out.shape == expected.shape == upstream.shape
    dtype, eps, tiny = case.dtype, torch.finfo(case.dtype).eps, _tiny(case.dtype)
    interpreted = backend.startswith("ascend")
    # One rounding to the dtype costs half an ulp, a whole one where the interpreter truncates.
    ours_rounding = eps if (interpreted and dtype == torch.bfloat16) else eps / 2
    upstream_rounding = eps if dtype == torch.bfloat16 else eps / 2

    if fn.endswith("gather"):
        # Exact against both; unused capacity / padding rows exactly zero.
        assert torch.equal(out, round_like(expected, dtype, interpreted)), "gather differs from the float64 reference"
        if interpreted or dtype != torch.bfloat16 or not case.weighted:
            assert torch.equal(out, upstream), "gather differs from upstream"
        else:  # torch rounds to nearest, interpreted upstream toward zero
            assert torch.equal(upstream, round_like(expected, dtype, True)), "upstream is not what we think"
        unused = ref.unused_rows(inp.position_rows, inp.num_rows)
        flat = out.reshape(inp.num_rows, case.hidden)
        assert torch.equal(flat[unused], torch.zeros_like(flat[unused])), "unused rows are not zero"
        if family == "binned":
            assert len(unused) >= case.experts * case.capacity - case.tokens * case.top_k
        elif family == "padded":
            assert len(unused) == inp.num_rows - case.tokens * case.top_k
    elif fn.endswith("scatter"):
        mag = ref.KERNELS[fn](*call_args(fn, case, inp, magnitude=True))
        assert_within(out, expected, (ours_rounding + case.top_k * EPS32) * mag + tiny, "scatter vs float64")
        # Upstream: each slot rounded to the dtype, then summed (torch sums and rounds once).
        up_bound = (ours_rounding + case.top_k * upstream_rounding + eps / 2 + case.top_k * EPS32) * mag
        assert_within(out, upstream.double(), up_bound + 2 * tiny, "scatter vs upstream")
        if case.top_k == 1 and not case.weighted:
            assert torch.equal(out, upstream), "a top_k=1 unweighted scatter is a pure copy"
        # Tokens whose every slot was dropped receive exactly zero.
        none_kept = mag.sum(dim=1) == 0
        assert torch.equal(out[none_kept], torch.zeros_like(out[none_kept]))
    else:
        mag = ref.KERNELS[fn](*call_args(fn, case, inp, magnitude=True))
        h = case.hidden
        sums = h * EPS32 * mag  # float32 accumulation over hidden
        assert_within(out, expected, ours_rounding * expected.abs() + sums + tiny, "wgrad vs float64")
        assert_within(out, upstream.double(),
                      (ours_rounding + upstream_rounding) * expected.abs() + 2 * sums + 2 * tiny, "wgrad vs upstream")
        dropped = [s for s, r in enumerate(ref.slot_rows(inp.indices, inp.position_rows)) if r is None]
        assert torch.equal(out[dropped], torch.zeros_like(out[dropped])), "dropped slots are not zero"


def test_interpreter_rounds_bf16_toward_zero(upstream_kernels):
    """The rounding assumption above. With ``x = 1 + a/128`` and ``w = 1 + b/128`` (exact in
    bf16, whose ulp in [1, 2) is 1/128) the product is ``1 + (a+b)/128`` plus ``ab/128`` of an
    ulp: a = b = 11 leaves 121/128 of an ulp, which rounds up to nearest and down toward zero."""
    x = torch.tensor([[1 + 11 / 128], [1 + 3 / 128]], dtype=torch.bfloat16)
    w = torch.tensor([1 + 11 / 128, 1 + 5 / 128], dtype=torch.bfloat16)
    indices, bins = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    exact = x.double().flatten() * w.double()
    nearest, toward_zero = exact.to(torch.bfloat16), round_like(exact, torch.bfloat16, True)
    assert not torch.equal(nearest, toward_zero)  # the example does tell the modes apart
    args = (x, indices, indices, w, bins, 1)
    assert torch.equal(routing.gather(*args).flatten(), toward_zero)
    assert torch.equal(upstream_kernels["gather"](*args).flatten(), toward_zero)
    assert torch.equal(torch_backend.gather(*args).flatten(), nearest)


def test_case_matrix_covers_the_seed():
    """The matrix above really contains the situations the comments claim."""
    seen = set()
    for family, cases in CASES.items():
        for case in cases:
            inp = inputs(family, case)
            counts = torch.diff(inp.bins.long(), prepend=inp.bins.new_zeros(1).long()).tolist()
            seen.add((family, "dtype", case.dtype))
            seen.add((family, "weighted", case.weighted))
            seen.add((family, "top_k", case.top_k))
            seen.add((family, "tokens0", case.tokens == 0))
            seen.add((family, "one-expert", case.experts == 1))
            seen.add((family, "many-experts", case.experts >= 64))
            seen.add((family, "programs", case.num_programs))
            if case.tile is not None and case.tokens:
                seen.add((family, "odd-hidden", case.hidden % case.tile.block_x != 0))
            if counts and case.tokens:
                seen.add((family, "empty-first", counts[0] == 0))
                seen.add((family, "empty-last", counts[-1] == 0))
                seen.add((family, "empty-middle", 0 in counts[1:-1]))
            if family == "binned" and case.tokens:
                seen.add((family, "overflow", max(counts) > case.capacity))
                seen.add((family, "exact", case.capacity in counts))
                seen.add((family, "cap1", case.capacity == 1))
                seen.add((family, "cap>all", case.capacity > case.tokens * case.top_k))
            if family == "padded" and case.tokens:
                seen.add((family, "on-multiple", any(c and c % case.block == 0 for c in counts)))
                seen.add((family, "just-over", any(c % case.block == 1 and c > case.block for c in counts)))
    for family in CASES:
        for item in [("dtype", d) for d in (torch.float32, torch.float16, torch.bfloat16)] + [
                ("weighted", True), ("weighted", False), ("tokens0", True), ("one-expert", True),
                ("many-experts", True), ("programs", 1), ("programs", 3), ("odd-hidden", True),
                ("empty-first", True), ("empty-last", True), ("empty-middle", True)]:
            assert (family, *item) in seen, (family, item)
        for k in (1, 2, 4):
            assert (family, "top_k", k) in seen, (family, k)
    assert ("dropless", "top_k", 8) in seen
    for item in ("overflow", "exact", "cap1", "cap>all"):
        assert ("binned", item, True) in seen, item
    for item in ("on-multiple", "just-over"):
        assert ("padded", item, True) in seen, item


@pytest.mark.parametrize("experts", [1, 70, 130])
@pytest.mark.parametrize("layout", ["binned", "dropless", "padded"])
@pytest.mark.parametrize("block_m, num_programs", [(1, 3), (2, 1), (8, 7), (64, 2)])
def test_route_map_walk_over_many_experts(experts, layout, block_m, num_programs, poisoned_empty):
    """The route map walks each expert's positions in blocks of ``block_m`` (one expert lookup per
    block): every slot gets its row (or -1 when dropped), with many experts (``BLOCK_E`` up to
    256), runs of empty experts, segments that end mid-block, and more blocks than programs."""
    gen = torch.Generator().manual_seed(experts * 31 + block_m)
    tokens, top_k = 150, min(2, experts)
    empty = tuple(range(1, experts, 3))
    indices, _, bins, _ = ref.make_routing(tokens, experts, top_k, skew=1.0, empty_experts=empty, generator=gen)
    capacity = max(1, tokens * top_k // max(experts - len(empty), 1) // 2)  # binned: drops about half
    pbins = ref.padded_bins(bins, 4)
    positions = {"binned": ref.binned_rows(bins, capacity), "dropless": ref.dropless_rows(bins),
                 "padded": ref.padded_rows(bins, pbins)}[layout]
    expected = [-1 if r is None else r for r in ref.slot_rows(indices, positions)]
    code = {"binned": routing.BINNED, "dropless": routing.DROPLESS, "padded": routing.PADDED}[layout]
    got = routing._compute_route_map(indices, bins, pbins if layout == "padded" else None, layout=code,
                                     capacity=capacity if layout == "binned" else 0, block_m=block_m,
                                     num_programs=num_programs)
    assert got.tolist() == expected
    if layout == "binned":
        assert -1 in expected  # the case does drop positions


@pytest.mark.parametrize("top_k", [1, 2])
def test_int64_offsets_give_the_same_results(monkeypatch, top_k):
    """The launchers specialise the kernels with int64 offsets for tensors of 2**31 elements or more
    (checked at that size on an H200, BENCHMARKS.md); here every tensor counts as that large, and
    all nine functions must give bit-identical results to the int32 kernels."""
    gen = torch.Generator().manual_seed(7)
    tokens, experts, hidden = 37, 5, 24
    indices, bin_ids, bins, _ = ref.make_routing(tokens, experts, top_k, skew=1.0, generator=gen)
    n = tokens * top_k
    pbins = ref.padded_bins(bins, 8)
    cap = max(1, n // experts - 1)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.rand(n, generator=gen)
    grad = torch.randn(tokens, hidden, generator=gen)
    calls = {
        "binned_gather": (x, indices, w, bins, cap, top_k),
        "binned_scatter": (torch.randn(experts, cap, hidden, generator=gen), indices, w, bins, top_k),
        "binned_scatter_wgrad": (torch.randn(experts, cap, hidden, generator=gen), grad, indices, bins, top_k),
        "gather": (x, indices, bin_ids, w, bins, top_k),
        "scatter": (torch.randn(n, hidden, generator=gen), indices, bin_ids, w, bins, top_k),
        "scatter_wgrad": (torch.randn(n, hidden, generator=gen), grad, indices, bin_ids, bins, top_k),
        "padded_gather": (x, indices, bin_ids, w, bins, pbins, top_k),
        "padded_scatter": (torch.randn(int(pbins[-1]), hidden, generator=gen), indices, bin_ids, w, bins, pbins,
                           top_k),
        "padded_scatter_wgrad": (torch.randn(int(pbins[-1]), hidden, generator=gen), grad, indices, bin_ids, bins,
                                 pbins, top_k),
    }
    int32 = {name: getattr(routing, name)(*args, tile=SMALL, num_programs=3) for name, args in calls.items()}
    routing.clear_route_maps()
    monkeypatch.setattr(routing, "_INT32_LIMIT", 0)
    routing.clear_plans()  # (the int32 calls above planned these launches with the real limit)
    assert routing._needs_int64(1)
    for name, args in calls.items():
        assert torch.equal(getattr(routing, name)(*args, tile=SMALL, num_programs=3), int32[name]), name


@pytest.mark.parametrize("target, stores, want", [
    ("npu", "auto", "contiguous"), ("interpreter", "auto", "contiguous"), ("cuda", "auto", "scattered"),
    ("npu", "scattered", "scattered"), ("cuda", "contiguous", "contiguous"),
])
def test_each_target_runs_its_store_form(target, stores, want, monkeypatch):
    """Which kernels a routing op launches: the contiguous-store form on an NPU (and the CPU
    interpreter), the scattered one on CUDA, either when ``MEGABLOCKS_ASCEND_STORES`` says so.
    The launchers are replaced by recorders: this checks the choice, test_kernel the results.
    (The padded and binned gathers: tests/test_many_experts.py.)"""
    from megablocks_ascend import devices
    monkeypatch.setenv("MEGABLOCKS_ASCEND_STORES", stores)
    monkeypatch.setattr(devices, "target", lambda device: target)
    ran = []
    for name in ("gather_rows", "gather_tokens_rows", "scatter_rows", "scatter_one_rows", "wgrad_rows",
                 "wgrad_one_rows", "route_map"):
        monkeypatch.setattr(routing, name, lambda *a, _name=name, **k: ran.append(_name))
    x, idx, bins = torch.zeros(4, 8), torch.arange(4, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    for top_k in (1, 2):
        ran.clear()
        routing.gather(x[:4 // top_k], idx, idx, None, bins, top_k)
        routing.scatter(x, idx, idx, None, bins, top_k)
        routing.scatter_wgrad(x, x[:4 // top_k], idx, idx, bins, top_k)
        if want == "contiguous":
            expect = ["gather_rows", "route_map", "scatter_rows", "route_map", "wgrad_rows"]
        elif top_k == 1:
            expect = ["gather_rows", "scatter_one_rows", "wgrad_one_rows"]
        else:
            expect = ["gather_tokens_rows", "route_map", "scatter_rows", "route_map", "wgrad_rows"]
        assert ran == expect, (top_k, ran)


def test_an_invalid_store_form_is_refused(monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_ASCEND_STORES", "rows")
    with pytest.raises(ValueError, match="MEGABLOCKS_ASCEND_STORES='rows': expected one of auto, contiguous, scattered"):
        routing.scatter(torch.zeros(4, 8), torch.arange(4, dtype=torch.int32), None, None,
                        torch.tensor([4], dtype=torch.int32), 1)


@pytest.mark.parametrize("stores", ["contiguous", "scattered"])
def test_a_dropped_slot_adds_nothing_whatever_its_weight(stores, monkeypatch):
    """A slot that capacity dropped (``slot_to_row`` -1) contributes exactly nothing to its token's
    sum, as in upstream MegaBlocks, where dropped slots are never visited: not ``weight * 0``, which
    is NaN for a NaN or infinite weight. Both store forms (the NPU's flat slot tile and CUDA's
    per-slot loads); the reference is float64 over the kept slots."""
    from megablocks_ascend import devices
    monkeypatch.setenv("MEGABLOCKS_ASCEND_STORES", stores)
    monkeypatch.setattr(devices, "target", lambda device: "npu" if stores == "contiguous" else "cuda")
    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, hidden = 6, 3, 20
    y = torch.randn(num_tokens * top_k, hidden, generator=gen)
    slot_to_row = torch.randperm(num_tokens * top_k, generator=gen).to(torch.int32)
    weights = torch.rand(num_tokens * top_k, generator=gen)
    dropped = torch.tensor([1, 5, 6, 7, 8, 16])  # token 2 loses every slot
    slot_to_row[dropped] = -1
    weights[dropped] = torch.tensor([float("nan"), float("inf"), float("nan"), -float("inf"), 1e30, float("nan")])
    out = routing.scatter_rows(y, slot_to_row, weights, num_tokens=num_tokens, top_k=top_k, tile=SMALL)
    kept = slot_to_row >= 0
    want = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for slot in torch.nonzero(kept).flatten().tolist():
        want[slot // top_k] += weights[slot].double() * y[slot_to_row[slot]].double()
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(hidden))
